//! Block-quantized KDA weights (FP8 with one scale per `block[0] × block[1]` tile): which part of
//! a weight's scale grid a rank keeps.
//!
//! A weight `[out, in]` stored as FP8 comes with a scale grid of `ceil(out/b0) × ceil(in/b1)`
//! entries (NVIDIA ModelOpt stores it 4-D `[ceil(out/b0), 1, ceil(in/b1), 1]`, DeepSeek and
//! compressed-tensors 2-D); element `(i, j)` dequantizes as `w[i, j] · scale[i / b0, j / b1]`.
//! The grid is sliced along the weight's sharded axis: a rank whose weight range is `[a, e)`
//! keeps the blocks covering it, `[floor(a/b), ceil(e/b))`, and a replicated weight keeps the
//! whole grid. That local grid dequantizes the local weight with the same `(i / b0, j / b1)`
//! rule only if the range starts on a block boundary or lies inside one block (Kimi K3's
//! `b_proj`: 12 of 96 rows per rank at TP=8, all in block row 0, so every rank keeps block row
//! 0). Any other split is refused.

use safetensors::Dtype;

use crate::error::{Error, Result};
use crate::tensor::{KdaShard, KdaTensorPlan};

/// Largest block edge accepted (real checkpoints use 128).
pub const MAX_BLOCK: usize = 1 << 16;

/// How a scale grid is stored on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScaleLayout {
    /// NVIDIA ModelOpt (`FP8_PB_WO`): `[ceil(out/b0), 1, ceil(in/b1), 1]`.
    ModelOpt,
    /// DeepSeek (`weight_scale_inv`) and compressed-tensors: `[ceil(out/b0), ceil(in/b1)]`.
    Grid,
}

/// Block quantization of some of a KDA block's projections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockQuant {
    /// Block edge `[rows, columns]` of the weight, in elements (`[128, 128]` in every published
    /// FP8 checkpoint).
    pub block: [usize; 2],
    /// Plan names of the quantized weights (projections only).
    pub tensors: Vec<String>,
    /// How the scale grids are stored.
    pub layout: ScaleLayout,
}

/// The projections a checkpoint may quantize. Conv weights, `A_log`, `dt_bias` and `o_norm`
/// never are.
pub const QUANTIZABLE: [&str; 10] = [
    "q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj", "g_proj",
    "b_proj", "o_proj",
];

/// The projections of a KDA block with the given output-gate form (the default set a
/// block-quantized checkpoint quantizes: Kimi K3's FP8 release quantizes all eight).
pub fn projections(full_rank_gate: bool) -> Vec<String> {
    let skip: &[&str] = if full_rank_gate {
        &["g_a_proj", "g_b_proj"]
    } else {
        &["g_proj"]
    };
    QUANTIZABLE
        .iter()
        .filter(|name| !skip.contains(name))
        .map(|name| (*name).to_string())
        .collect()
}

/// The plan name of a quantizable weight's scale grid, e.g. `q_proj.scale`.
fn scale_name(weight: &str) -> Option<&'static str> {
    Some(match weight {
        "q_proj" => "q_proj.scale",
        "k_proj" => "k_proj.scale",
        "v_proj" => "v_proj.scale",
        "f_a_proj" => "f_a_proj.scale",
        "f_b_proj" => "f_b_proj.scale",
        "g_a_proj" => "g_a_proj.scale",
        "g_b_proj" => "g_b_proj.scale",
        "g_proj" => "g_proj.scale",
        "b_proj" => "b_proj.scale",
        "o_proj" => "o_proj.scale",
        // An MLA layer's (crate::mla): `q_proj`, `g_proj` and `o_proj` are above.
        "q_a_proj" => "q_a_proj.scale",
        "q_b_proj" => "q_b_proj.scale",
        "kv_a_proj_with_mqa" => "kv_a_proj_with_mqa.scale",
        "kv_b_proj" => "kv_b_proj.scale",
        _ => return None,
    })
}

/// Checks the options against the block's plan names.
///
/// # Errors
/// [`Error::ZeroSize`] / [`Error::BlockSize`] for a block edge of 0 or over [`MAX_BLOCK`];
/// [`Error::UnknownTensor`] for a name not in `names`; [`Error::NotQuantizable`] for a conv
/// weight, `A_log`, `dt_bias` or `o_norm`.
pub fn check(quant: &BlockQuant, names: &[&str]) -> Result<()> {
    check_block(quant.block)?;
    for name in &quant.tensors {
        if !names.contains(&name.as_str()) {
            return Err(Error::UnknownTensor {
                name: name.clone(),
                known: names.join(", "),
            });
        }
        if !QUANTIZABLE.contains(&name.as_str()) {
            return Err(Error::NotQuantizable {
                tensor: name.clone(),
            });
        }
    }
    Ok(())
}

/// Checks a block edge pair.
///
/// # Errors
/// [`Error::ZeroSize`] / [`Error::BlockSize`] for an edge of 0 or over [`MAX_BLOCK`].
pub fn check_block(block: [usize; 2]) -> Result<()> {
    for edge in block {
        if edge == 0 {
            return Err(Error::ZeroSize { field: "block" });
        }
        if edge > MAX_BLOCK {
            return Err(Error::BlockSize {
                block: edge,
                max: MAX_BLOCK,
            });
        }
    }
    Ok(())
}

/// The plan of `weight`'s scale grid on the same rank: the same kind, counts in blocks, offsets
/// in blocks (the first block this rank keeps), dtype F32.
///
/// `weight` is this rank's plan entry of a `[rows, row_elems]` weight and `tp_size` the world
/// size; every rank's range is checked, so no rank gets a plan another rank would be refused.
///
/// # Errors
/// [`Error::BlockSplit`] when some rank's weight range starts inside a block and spans into the
/// next one (its scale rows or columns cannot be sliced to match it).
pub fn scale_plan(
    weight: &KdaTensorPlan,
    quant: &BlockQuant,
    tp_size: usize,
) -> Result<KdaTensorPlan> {
    let [b0, b1] = quant.block;
    match weight.kind {
        KdaShard::Replicated => {}
        KdaShard::HeadRows | KdaShard::ChannelRows => {
            check_split(weight, "rows", weight.local_rows, b0, tp_size)?;
        }
        KdaShard::ChannelCols => {
            check_split(weight, "columns", weight.local_row_elems, b1, tp_size)?;
        }
    }
    Ok(grid_plan(weight, quant))
}

/// The plan of `weight`'s scale grid, the split already checked: the blocks covering this
/// rank's range on the sharded axis (the whole grid when replicated), dtype F32.
pub fn grid_plan(weight: &KdaTensorPlan, quant: &BlockQuant) -> KdaTensorPlan {
    let [b0, b1] = quant.block;
    let grid_rows = weight.full_rows.div_ceil(b0);
    let grid_cols = weight.full_row_elems.div_ceil(b1);
    let (mut local_rows, mut local_cols, mut row_off, mut col_off) = (grid_rows, grid_cols, 0, 0);
    match weight.kind {
        KdaShard::Replicated => {}
        KdaShard::HeadRows | KdaShard::ChannelRows => {
            (row_off, local_rows) = covering(weight.src_row_offset, weight.local_rows, b0);
        }
        KdaShard::ChannelCols => {
            (col_off, local_cols) = covering(weight.src_col_offset, weight.local_row_elems, b1);
        }
    }
    let disk_shape = match quant.layout {
        ScaleLayout::ModelOpt => vec![grid_rows, 1, grid_cols, 1],
        ScaleLayout::Grid => vec![grid_rows, grid_cols],
    };
    KdaTensorPlan {
        name: scale_name(weight.name).unwrap_or("scale"),
        kind: weight.kind,
        dtype: Dtype::F32,
        elem_bytes: 4,
        full_rows: grid_rows,
        full_row_elems: grid_cols,
        local_rows,
        local_row_elems: local_cols,
        src_row_offset: row_off,
        src_col_offset: col_off,
        disk_shape,
        block: None,
        scale: None,
    }
}

/// `(first block, block count)` of the blocks covering elements `[start, start + len)`.
fn covering(start: usize, len: usize, block: usize) -> (usize, usize) {
    let first = start / block;
    (first, (start + len).div_ceil(block) - first)
}

/// Refuses the split when a rank's range `[r·len, (r+1)·len)` starts inside a block and reaches
/// into the next. Starts repeat modulo `block` with period `block / gcd(len, block)`, so that
/// many ranks decide it.
fn check_split(
    weight: &KdaTensorPlan,
    axis: &'static str,
    len: usize,
    block: usize,
    tp_size: usize,
) -> Result<()> {
    let period = block / gcd(len % block, block);
    for rank in 0..tp_size.min(period) {
        let start = rank * len;
        let (first, last) = (start / block, (start + len - 1) / block);
        if start % block != 0 && first != last {
            return Err(Error::BlockSplit {
                tensor: weight.name.to_string(),
                axis,
                rank,
                start,
                end: start + len,
                block,
                first,
            });
        }
    }
    Ok(())
}

fn gcd(a: usize, b: usize) -> usize {
    if a == 0 {
        b
    } else {
        gcd(b % a, a)
    }
}

#[cfg(test)]
mod tests;
