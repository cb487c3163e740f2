//! Plan arithmetic and slicing on arbitrary geometry: `KdaTpPlan::with_options` must refuse or
//! give a consistent plan (never panic, never overflow); for every tensor of an accepted plan
//! (block-scale grids of FP8 weights included) with a small enough full size, `shard_bytes` must
//! equal an element-by-element reference slice, `gather_cols` must agree, and a buffer of the
//! wrong length must be refused. Options drawn too: Kimi K3's full-rank gate, a zero-padded
//! `A_log`, block quantization; a scale grid must cover exactly its weight's blocks.
#![no_main]

use arbitrary::Arbitrary;
use kda_tp::plan::{KdaShard, KdaTensorPlan};
use kda_tp::quant::{BlockQuant, ScaleLayout, QUANTIZABLE};
use kda_tp::{slice, KdaTpPlan, PlanOptions};
use libfuzzer_sys::fuzz_target;

/// Sizes as raw u64 (any value, overflow included) or small (likely valid).
#[derive(Debug, Arbitrary)]
enum Size {
    Small(u8),
    Medium(u16),
    Raw(u64),
}

impl Size {
    fn get(&self) -> usize {
        match *self {
            Size::Small(v) => usize::from(v),
            Size::Medium(v) => usize::from(v),
            Size::Raw(v) => usize::try_from(v).unwrap_or(usize::MAX),
        }
    }
}

#[derive(Debug, Arbitrary)]
struct Input {
    tp_rank: Size,
    tp_size: Size,
    hidden: Size,
    head_dim: Size,
    heads: Size,
    conv_kernel: Size,
    gate_rank: Size,
    qk_multiple: Size,
    /// (plan tensor index, dtype index) overrides.
    dtypes: Vec<(u8, u8)>,
    /// Added to the full length for the wrong-length check.
    wrong: u8,
    full_rank_gate: bool,
    /// Extra stored `A_log` entries past the heads.
    a_log_pad: Option<Size>,
    /// (block rows, block cols, bit mask over `QUANTIZABLE`, ModelOpt 4-D layout).
    quant: Option<(Size, Size, u16, bool)>,
}

const DTYPES: [&str; 8] = ["BF16", "F16", "F32", "F64", "I32", "U8", "F8_E4M3", "BOOL"];
const MAX_BYTES: usize = 1 << 16;

fuzz_target!(|input: Input| {
    let mut options = PlanOptions {
        qk_multiple: input.qk_multiple.get(),
        full_rank_gate: input.full_rank_gate,
        a_log_len: input
            .a_log_pad
            .as_ref()
            .map(|pad| input.heads.get().saturating_add(pad.get())),
        block_quant: input
            .quant
            .as_ref()
            .map(|(b0, b1, mask, modelopt)| BlockQuant {
                block: [b0.get(), b1.get()],
                tensors: QUANTIZABLE
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| mask & (1 << i) != 0)
                    .map(|(_, n)| (*n).to_string())
                    .collect(),
                layout: if *modelopt {
                    ScaleLayout::ModelOpt
                } else {
                    ScaleLayout::Grid
                },
            }),
        ..PlanOptions::default()
    };
    let names: &[&str] = if input.full_rank_gate {
        &kda_tp::plan::FULL_RANK_GATE_TENSOR_NAMES
    } else {
        &kda_tp::plan::TENSOR_NAMES
    };
    for &(t, d) in input.dtypes.iter().take(4) {
        let name = names.get(usize::from(t)).map_or("no_such_tensor", |n| *n);
        let dtype = serde_json::from_value(serde_json::Value::from(DTYPES[usize::from(d) % 8]))
            .expect("a safetensors dtype name");
        options.dtypes.push((name.to_string(), dtype));
    }
    let Ok(plan) = KdaTpPlan::with_options(
        input.tp_rank.get(),
        input.tp_size.get(),
        input.hidden.get(),
        input.head_dim.get(),
        input.heads.get(),
        input.conv_kernel.get(),
        input.gate_rank.get(),
        &options,
    ) else {
        return;
    };
    assert!(plan.tp_rank < plan.tp_size);
    assert_eq!(plan.local_heads * plan.tp_size, plan.full_heads);
    let _ = (plan.local_bytes(), plan.full_bytes());
    for weight in &plan.tensors {
        if let (Some(scale), Some([b0, b1])) = (weight.scale.as_deref(), weight.block) {
            check_covering(weight, scale, b0, b1);
        }
    }
    let with_scales = plan
        .tensors
        .iter()
        .flat_map(|t| std::iter::once(t).chain(t.scale.as_deref()));
    for t in with_scales {
        assert!(t.local_bytes() <= t.full_bytes(), "{}", t.name);
        assert!(t.src_row_offset + t.local_rows <= t.full_rows, "{}", t.name);
        assert!(
            t.src_col_offset + t.local_row_elems <= t.full_row_elems,
            "{}",
            t.name
        );
        let _ = t
            .local_shape(&t.disk_shape)
            .expect("the canonical disk shape is accepted");
        if t.full_bytes() > MAX_BYTES {
            continue;
        }
        let full: Vec<u8> = (0..t.full_bytes())
            .map(|i| (i * 31 + i / 251) as u8)
            .collect();
        let got = slice::shard_bytes(t, &full).expect("the right length is accepted");
        // Reference: element by element.
        let e = t.elem_bytes;
        let mut want = Vec::with_capacity(t.local_bytes());
        for r in 0..t.local_rows {
            for c in 0..t.local_row_elems {
                let at = ((t.src_row_offset + r) * t.full_row_elems + t.src_col_offset + c) * e;
                want.extend_from_slice(&full[at..at + e]);
            }
        }
        assert_eq!(&got[..], &want[..], "{}", t.name);
        let mut out = vec![0u8; t.local_bytes()];
        slice::gather_cols(t, &full, &mut out).expect("gather_cols on the right lengths");
        assert_eq!(out, want, "{}", t.name);
        if t.kind != KdaShard::ChannelCols {
            assert!(slice::row_byte_range(t).is_some());
        }
        let mut longer = full.clone();
        longer.extend(std::iter::repeat_n(0, usize::from(input.wrong) + 1));
        assert!(slice::shard_bytes(t, &longer).is_err(), "{}", t.name);
        if !full.is_empty() {
            assert!(
                slice::shard_bytes(t, &full[..full.len() - 1]).is_err(),
                "{}",
                t.name
            );
        }
    }
});

/// A scale grid keeps exactly the blocks covering its weight's range on the sharded axis, and
/// that range starts on a block boundary or lies inside one block.
fn check_covering(weight: &KdaTensorPlan, scale: &KdaTensorPlan, b0: usize, b1: usize) {
    let (start, len, block, first, count) = match weight.kind {
        KdaShard::Replicated => {
            assert_eq!(
                (scale.local_rows, scale.local_row_elems),
                (scale.full_rows, scale.full_row_elems)
            );
            return;
        }
        KdaShard::ChannelCols => (
            weight.src_col_offset,
            weight.local_row_elems,
            b1,
            scale.src_col_offset,
            scale.local_row_elems,
        ),
        _ => (
            weight.src_row_offset,
            weight.local_rows,
            b0,
            scale.src_row_offset,
            scale.local_rows,
        ),
    };
    assert_eq!(first, start / block, "{}", weight.name);
    assert_eq!(
        first + count,
        (start + len).div_ceil(block),
        "{}",
        weight.name
    );
    assert!(
        start % block == 0 || start / block == (start + len - 1) / block,
        "{}",
        weight.name
    );
}
