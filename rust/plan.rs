//! The per-rank shard plan of one KDA (Kimi Delta Attention) block: pure data, no I/O.
//!
//! Each rank owns a contiguous head range `[r·H/T, (r+1)·H/T)`. Per tensor:
//!
//! * `q/k/v_proj`, `q/k/v_conv1d`, `f_b_proj`, `g_b_proj` (or Kimi K3's full-rank `g_proj`),
//!   `dt_bias`: column-parallel, sliced by output channel (`c = h·head_dim + d`), i.e. rows of the
//!   on-disk `[out, in]` tensor.
//! * `b_proj`, `A_log`: one entry per head, sliced by head. Kimi K3 stores `A_log` zero-padded
//!   past the real heads (128 entries for 96 heads): a rank keeps `A_log[r·H/T, (r+1)·H/T)` of
//!   the stored tensor and the padding belongs to no rank.
//! * `f_a_proj`, `g_a_proj` (low-rank down-projections `[gate_rank, hidden]`) and `o_norm`
//!   (`[head_dim]`, shared by every head): replicated.
//! * `o_proj` `[hidden, heads·head_dim]`: row-parallel, sliced on its input (last) dimension; each
//!   rank's output is a partial sum until the all-reduce after it.
//!
//! This is the plan vLLM, SGLang, Megatron-Bridge and TensorRT-LLM use for Kimi-Linear.

use safetensors::Dtype;

use crate::error::{Error, Result};
use crate::quant::{self, BlockQuant};
pub use crate::tensor::{KdaShard, KdaTensorPlan};

/// Plan names of the tensors of one Kimi-Linear KDA block (low-rank output gate), in the order
/// of [`KdaTpPlan::tensors`].
pub const TENSOR_NAMES: [&str; 15] = [
    "q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_a_proj", "f_b_proj",
    "g_a_proj", "g_b_proj", "b_proj", "A_log", "dt_bias", "o_norm", "o_proj",
];

/// Plan names of the tensors of one Kimi K3 KDA block (`use_full_rank_gate`): `g_proj` replaces
/// `g_a_proj` and `g_b_proj`.
pub const FULL_RANK_GATE_TENSOR_NAMES: [&str; 14] = [
    "q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_a_proj", "f_b_proj",
    "g_proj", "b_proj", "A_log", "dt_bias", "o_norm", "o_proj",
];

/// Settings beyond the geometry, for callers whose kernels or checkpoints differ from the
/// defaults.
#[derive(Debug, Clone)]
pub struct PlanOptions {
    /// The local q|k width `2 · local_heads · head_dim` must be a multiple of this. 256 by
    /// default (GLM-5.3's fused `causal_conv1d_update_l2norm` handles 2 heads per 256-thread
    /// block); 1 switches the rule off.
    pub qk_multiple: usize,
    /// Dtype overrides by plan name. The default is BF16, with F32 for `A_log` and `dt_bias`.
    pub dtypes: Vec<(String, Dtype)>,
    /// Kimi K3's full-rank output gate (`linear_attn_config.use_full_rank_gate`): one `g_proj`
    /// `[C, hidden]`, column-parallel, instead of `g_a_proj`/`g_b_proj` (14 tensors, not 15).
    pub full_rank_gate: bool,
    /// Entries of the stored `A_log` when it is zero-padded past the heads (Kimi K3: 128 for 96
    /// heads); `None` when it holds exactly one entry per head. Must be at least `full_heads`.
    pub a_log_len: Option<usize>,
    /// Block-quantized (FP8) projections and their block size; their default dtype becomes
    /// `F8_E4M3` and each gets a [`KdaTensorPlan::scale`].
    pub block_quant: Option<BlockQuant>,
}

impl Default for PlanOptions {
    fn default() -> Self {
        Self {
            qk_multiple: 256,
            dtypes: Vec::new(),
            full_rank_gate: false,
            a_log_len: None,
            block_quant: None,
        }
    }
}

/// The per-rank shard plan for one KDA block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KdaTpPlan {
    /// This rank, `0 <= tp_rank < tp_size`.
    pub tp_rank: usize,
    /// Tensor-parallel world size.
    pub tp_size: usize,
    /// Hidden size of the model.
    pub hidden: usize,
    /// Elements per head (key and value heads alike).
    pub head_dim: usize,
    /// Head count before sharding (all ranks together).
    pub full_heads: usize,
    /// Heads this rank owns, `full_heads / tp_size`.
    pub local_heads: usize,
    /// Short-convolution kernel width.
    pub conv_kernel: usize,
    /// Low-rank width of the `f`/`g` gate bottleneck (`f_a_proj` rows).
    pub gate_rank: usize,
    /// The multiple the local q|k width must meet (see [`PlanOptions::qk_multiple`]).
    pub qk_multiple: usize,
    /// Whether the block has Kimi K3's full-rank `g_proj` (see [`PlanOptions::full_rank_gate`]).
    pub full_rank_gate: bool,
    /// Entries of the stored `A_log` (`full_heads` unless zero-padded; see
    /// [`PlanOptions::a_log_len`]).
    pub a_log_len: usize,
    /// Every tensor of the block, in [`TENSOR_NAMES`] order (or
    /// [`FULL_RANK_GATE_TENSOR_NAMES`] with a full-rank gate).
    pub tensors: Vec<KdaTensorPlan>,
}

impl KdaTpPlan {
    /// The plan with default options (256-channel rule, BF16 weights, F32 `A_log`/`dt_bias`).
    ///
    /// # Errors
    /// See [`Self::with_options`].
    pub fn new(
        tp_rank: usize,
        tp_size: usize,
        hidden: usize,
        head_dim: usize,
        full_heads: usize,
        conv_kernel: usize,
        gate_rank: usize,
    ) -> Result<Self> {
        Self::with_options(
            tp_rank,
            tp_size,
            hidden,
            head_dim,
            full_heads,
            conv_kernel,
            gate_rank,
            &PlanOptions::default(),
        )
    }

    /// The plan for rank `tp_rank` of `tp_size`.
    ///
    /// # Errors
    /// [`Error::ZeroSize`] for a zero `tp_size` or any other zero size (checked after the rank);
    /// [`Error::RankOutOfRange`] for `tp_rank >= tp_size`;
    /// [`Error::HeadsNotDivisible`]; [`Error::QkWidth`] when `2 · local_heads · head_dim`
    /// is not a multiple of `qk_multiple`; [`Error::ALogLength`] when `a_log_len < full_heads`;
    /// [`Error::UnknownTensor`] / [`Error::UnsupportedDtype`] for a bad dtype override (a name
    /// not in this block's layout, e.g. `g_proj` without `full_rank_gate`);
    /// [`Error::Overflow`] when a byte size exceeds `isize::MAX`.
    #[allow(clippy::too_many_arguments)]
    pub fn with_options(
        tp_rank: usize,
        tp_size: usize,
        hidden: usize,
        head_dim: usize,
        full_heads: usize,
        conv_kernel: usize,
        gate_rank: usize,
        options: &PlanOptions,
    ) -> Result<Self> {
        if tp_size == 0 {
            return Err(Error::ZeroSize { field: "tp_size" });
        }
        if tp_rank >= tp_size {
            return Err(Error::RankOutOfRange { tp_rank, tp_size });
        }
        for (field, value) in [
            ("hidden", hidden),
            ("head_dim", head_dim),
            ("full_heads", full_heads),
            ("conv_kernel", conv_kernel),
            ("gate_rank", gate_rank),
            ("qk_multiple", options.qk_multiple),
        ] {
            if value == 0 {
                return Err(Error::ZeroSize { field });
            }
        }
        if full_heads % tp_size != 0 {
            return Err(Error::HeadsNotDivisible {
                heads: full_heads,
                tp_size,
                head_dim,
                qk_multiple: options.qk_multiple,
            });
        }
        let local_heads = full_heads / tp_size;
        let overflow = |tensor: &str| Error::Overflow {
            tensor: tensor.to_string(),
        };
        let channels = qk_channels(local_heads, head_dim).ok_or_else(|| overflow("q|k width"))?;
        if channels % options.qk_multiple != 0 {
            return Err(Error::QkWidth {
                channels,
                multiple: options.qk_multiple,
                local_heads,
                head_dim,
                heads: full_heads,
                tp_size,
            });
        }
        let a_log_len = options.a_log_len.unwrap_or(full_heads);
        if a_log_len < full_heads {
            return Err(Error::ALogLength {
                len: a_log_len,
                heads: full_heads,
            });
        }
        // Unpadded: Kimi-Linear's `[1, 1, H, 1]`; padded: Kimi K3's 1-D `[a_log_len]`.
        let a_log_shape = if a_log_len == full_heads {
            vec![1, 1, full_heads, 1]
        } else {
            vec![a_log_len]
        };

        // Cannot overflow: `channels` above is twice this.
        let local_ch = local_heads * head_dim;
        let full_ch = full_heads
            .checked_mul(head_dim)
            .ok_or_else(|| overflow("q_proj"))?;
        let ch_off = tp_rank * local_ch;
        let head_off = tp_rank * local_heads;

        use KdaShard::{ChannelCols, ChannelRows, HeadRows, Replicated};
        type Row = (&'static str, KdaShard, usize, usize, Vec<usize>);
        #[rustfmt::skip]
        let output_gate: Vec<Row> = if options.full_rank_gate {
            vec![("g_proj",   ChannelRows, full_ch,   hidden,    vec![full_ch, hidden])]
        } else {
            vec![
                ("g_a_proj", Replicated,  gate_rank, hidden,    vec![gate_rank, hidden]),
                ("g_b_proj", ChannelRows, full_ch,   gate_rank, vec![full_ch, gate_rank]),
            ]
        };
        #[rustfmt::skip]
        let layout: Vec<Row> = [
            // name      kind         rows        row_elems    on-disk shape (Kimi-Linear)
            ("q_proj",   ChannelRows, full_ch,    hidden,      vec![full_ch, hidden]),
            ("k_proj",   ChannelRows, full_ch,    hidden,      vec![full_ch, hidden]),
            ("v_proj",   ChannelRows, full_ch,    hidden,      vec![full_ch, hidden]),
            ("q_conv1d", ChannelRows, full_ch,    conv_kernel, vec![full_ch, 1, conv_kernel]),
            ("k_conv1d", ChannelRows, full_ch,    conv_kernel, vec![full_ch, 1, conv_kernel]),
            ("v_conv1d", ChannelRows, full_ch,    conv_kernel, vec![full_ch, 1, conv_kernel]),
            // Low-rank forget gate: `_a` down-projects (replicated), `_b` up-projects.
            ("f_a_proj", Replicated,  gate_rank,  hidden,      vec![gate_rank, hidden]),
            ("f_b_proj", ChannelRows, full_ch,    gate_rank,   vec![full_ch, gate_rank]),
        ]
        .into_iter()
        // Output gate: low-rank `g_a`/`g_b` (Kimi-Linear) or full-rank `g_proj` (Kimi K3).
        .chain(output_gate)
        .chain([
            // beta: one row per head. `A_log`: one entry per head, plus any zero padding.
            ("b_proj",   HeadRows,    full_heads, hidden,      vec![full_heads, hidden]),
            ("A_log",    HeadRows,    a_log_len,  1,           a_log_shape),
            ("dt_bias",  ChannelRows, full_ch,    1,           vec![full_ch]),
            // `[head_dim]`, shared by every head.
            ("o_norm",   Replicated,  head_dim,   1,           vec![head_dim]),
            // Row-parallel: the input (last) axis is sharded; all-reduce after.
            ("o_proj",   ChannelCols, hidden,     full_ch,     vec![hidden, full_ch]),
        ])
        .collect();
        let names: Vec<&str> = layout.iter().map(|row| row.0).collect();
        let quantized: Vec<&str> = match &options.block_quant {
            Some(q) => {
                quant::check(q, &names)?;
                q.tensors.iter().map(String::as_str).collect()
            }
            None => Vec::new(),
        };
        let dtype_of = dtype_table(&options.dtypes, &names, &quantized)?;

        let mut tensors = Vec::with_capacity(layout.len());
        let mut block_bytes: usize = 0;
        for (name, kind, full_rows, full_row_elems, disk_shape) in layout {
            let dtype = dtype_of(name);
            let elem_bytes = dtype.bitsize() / 8;
            let full_bytes = full_rows
                .checked_mul(full_row_elems)
                .and_then(|n| n.checked_mul(elem_bytes))
                .filter(|&n| isize::try_from(n).is_ok())
                .ok_or_else(|| overflow(name))?;
            block_bytes = block_bytes
                .checked_add(full_bytes)
                .filter(|&n| isize::try_from(n).is_ok())
                .ok_or_else(|| overflow("KDA block"))?;
            let (local_rows, local_row_elems, src_row_offset, src_col_offset) = match kind {
                Replicated => (full_rows, full_row_elems, 0, 0),
                HeadRows => (local_heads, full_row_elems, head_off, 0),
                ChannelRows => (local_ch, full_row_elems, ch_off, 0),
                ChannelCols => (full_rows, local_ch, 0, ch_off),
            };
            let mut entry = KdaTensorPlan {
                name,
                kind,
                dtype,
                elem_bytes,
                full_rows,
                full_row_elems,
                local_rows,
                local_row_elems,
                src_row_offset,
                src_col_offset,
                disk_shape,
                block: None,
                scale: None,
            };
            if let Some(q) = options
                .block_quant
                .as_ref()
                .filter(|_| quantized.contains(&name))
            {
                entry.scale = Some(Box::new(quant::scale_plan(&entry, q, tp_size)?));
                entry.block = Some(q.block);
            }
            tensors.push(entry);
        }

        Ok(Self {
            tp_rank,
            tp_size,
            hidden,
            head_dim,
            full_heads,
            local_heads,
            conv_kernel,
            gate_rank,
            qk_multiple: options.qk_multiple,
            full_rank_gate: options.full_rank_gate,
            a_log_len,
            tensors,
        })
    }

    /// The plan entry for a plan name such as `q_proj` or `A_log`.
    pub fn get(&self, name: &str) -> Option<&KdaTensorPlan> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Bytes this rank stores for one KDA block.
    pub fn local_bytes(&self) -> usize {
        self.tensors.iter().map(KdaTensorPlan::local_bytes).sum()
    }

    /// Bytes one KDA block occupies on disk.
    pub fn full_bytes(&self) -> usize {
        self.tensors.iter().map(KdaTensorPlan::full_bytes).sum()
    }

    /// Whether the layer must all-reduce (sum) its output after `o_proj`: false at
    /// `tp_size == 1`, where the row-parallel slice is the whole tensor.
    pub fn needs_output_all_reduce(&self) -> bool {
        self.tp_size > 1
    }

    /// Plan names of this block's tensors, in order.
    pub fn names(&self) -> Vec<&'static str> {
        self.tensors.iter().map(|t| t.name).collect()
    }
}

/// The local q|k width `2 · local_heads · head_dim` (q and k side by side, as the fused conv +
/// L2-norm kernel reads them), or `None` when it overflows.
fn qk_channels(local_heads: usize, head_dim: usize) -> Option<usize> {
    local_heads.checked_mul(head_dim)?.checked_mul(2)
}

/// The world sizes that [`KdaTpPlan::with_options`] accepts for `heads` heads of `head_dim`
/// under the q|k rule `qk_multiple` (1: no rule): the divisors `t` of `heads` whose local q|k
/// width `2 · (heads / t) · head_dim` is a multiple of `qk_multiple`, ascending. `None` above
/// 2^20 heads (see [`crate::error::divisors`]). Arithmetic only: no plan is built.
pub fn allowed_tp_sizes(heads: usize, head_dim: usize, qk_multiple: usize) -> Option<Vec<usize>> {
    let mut sizes = crate::error::divisors(heads)?;
    sizes.retain(|&t| {
        qk_channels(heads / t, head_dim)
            .and_then(|c| c.checked_rem(qk_multiple))
            .is_some_and(|r| r == 0)
    });
    Some(sizes)
}

/// Resolves dtype overrides into a lookup by plan name, refusing names not in `names` (this
/// block's layout) and dtypes a KDA tensor may not have: floating-point (BF16, F16, F32, F64),
/// and FP8 (F8_E4M3, F8_E5M2) for the block-quantized names in `quantized`, which default to
/// F8_E4M3.
fn dtype_table<'a>(
    overrides: &'a [(String, Dtype)],
    names: &[&str],
    quantized: &'a [&'a str],
) -> Result<impl Fn(&str) -> Dtype + 'a> {
    for (name, dtype) in overrides {
        if !names.contains(&name.as_str()) {
            return Err(Error::UnknownTensor {
                name: name.clone(),
                known: names.join(", "),
            });
        }
        let fp8 = matches!(dtype, Dtype::F8_E4M3 | Dtype::F8_E5M2);
        let float = matches!(dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32 | Dtype::F64);
        if !(float || fp8 && quantized.contains(&name.as_str())) {
            return Err(Error::UnsupportedDtype {
                tensor: name.clone(),
                dtype: dtype.to_string(),
            });
        }
    }
    Ok(move |name: &str| {
        let default = if quantized.contains(&name) {
            Dtype::F8_E4M3
        } else if matches!(name, "A_log" | "dt_bias") {
            Dtype::F32
        } else {
            Dtype::BF16
        };
        overrides
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .map_or(default, |(_, d)| *d)
    })
}

#[cfg(test)]
mod tests;
