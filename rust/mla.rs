//! The per-rank shard plan of one MLA (multi-head latent attention) layer of a KDA hybrid: pure
//! data, no I/O, in the KDA plan's vocabulary ([`KdaTensorPlan`], [`KdaShard`]).
//!
//! Kimi-Linear, Kimi K3 and GLM-5.3-Flash put an MLA layer beside their KDA layers (the spec:
//! `tests/data/spec/mla.md`, from vLLM 0.33.0's and SGLang 0.5.23's loaders). With `H` heads
//! (`num_attention_heads`, not the KDA head count), `T` ranks, `Hl = H/T`, `L` = `kv_lora_rank`,
//! `Q` = `q_lora_rank`, `P` = `qk_nope_head_dim`, `Pr` = `qk_rope_head_dim`, `V` = `v_head_dim`,
//! `d` = `hidden_size`, rank `r` keeps:
//!
//! * `q_proj` `[H·(P+Pr), d]` (no q-LoRA: Kimi-Linear) or `q_b_proj` `[H·(P+Pr), Q]`:
//!   column-parallel, rows `[r·Hl·(P+Pr), (r+1)·Hl·(P+Pr))` ([`KdaShard::ChannelRows`], the
//!   channel unit being one head's `P+Pr` rows).
//! * `kv_b_proj` `[H·(P+V), L]`: rows `[r·Hl·(P+V), …)`; the output gate `g_proj` `[H·V, d]`
//!   (K3): rows `[r·Hl·V, …)`.
//! * `o_proj` `[d, H·V]`: row-parallel, columns `[r·Hl·V, …)` ([`KdaShard::ChannelCols`]).
//! * `q_a_proj` `[Q, d]`, `q_a_layernorm` `[Q]`, `kv_a_proj_with_mqa` `[L+Pr, d]`,
//!   `kv_a_layernorm` `[L]` and GLM-5.3's DSA `indexer.*`: replicated.
//!
//! Block-quantized (FP8) projections ([`QUANTIZABLE`], e.g. NVIDIA's ModelOpt release of K3)
//! carry a scale grid `[⌈rows/b0⌉, ⌈cols/b1⌉]` ([`crate::quant`]): a replicated weight keeps the
//! whole grid (a trailing partial block included), a row slice the grid rows of its blocks, a
//! column slice (`o_proj`) the grid columns. Unlike the KDA rule, which also lets a range lie
//! inside one block, an MLA split follows vLLM 0.33's block-FP8 loader
//! (`validate_fp8_block_shape`): at `tp_size > 1` each rank's share of a sliced weight must be
//! a whole number of blocks, so every range starts and ends on a block boundary and no sliced
//! weight has a partial block; any other split is refused ([`Error::MlaBlockSplit`]).

use safetensors::Dtype;

use crate::error::{divisors, Error, Result};
use crate::quant::{self, BlockQuant};
use crate::tensor::{KdaShard, KdaTensorPlan};

/// The MLA projections a checkpoint may block-quantize (NVIDIA's ModelOpt `FP8_PB_WO` release
/// of K3 quantizes `q_a`, `q_b`, `kv_a`, `kv_b`, `g` and `o`); the norms and the DSA indexer
/// never are.
pub const QUANTIZABLE: [&str; 7] = [
    "q_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "g_proj",
    "o_proj",
];

/// One tensor of a layer's layout: name, kind, rows, row_elems, on-disk shape, elements per
/// head on the sharded axis.
type Row = (&'static str, KdaShard, usize, usize, Vec<usize>, usize);

/// The DSA indexer of a GLM-5.3-Flash MLA layer (every tensor replicated: vLLM 0.33
/// `glm5next/common/attention.py`, "no tensor parallel, just replicated").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexerGeometry {
    /// Indexer heads (`index_n_heads`).
    pub heads: usize,
    /// Elements per indexer head (`index_head_dim`).
    pub head_dim: usize,
    /// Pool size of the compressed token groups (`index_kpool`).
    pub kpool: usize,
}

/// The geometry of one MLA layer, as its config's keys name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaGeometry {
    /// `hidden_size`.
    pub hidden: usize,
    /// `num_attention_heads`: the MLA head count, split over the ranks.
    pub heads: usize,
    /// `q_lora_rank`; `None` for a full-rank `q_proj` (Kimi-Linear).
    pub q_lora_rank: Option<usize>,
    /// `kv_lora_rank`.
    pub kv_lora_rank: usize,
    /// `qk_nope_head_dim`.
    pub qk_nope_head_dim: usize,
    /// `qk_rope_head_dim` (0: NoPE, GLM-5.3-Flash).
    pub qk_rope_head_dim: usize,
    /// `v_head_dim`.
    pub v_head_dim: usize,
    /// Kimi K3's MLA output gate `g_proj` (`mla_use_output_gate`).
    pub output_gate: bool,
    /// GLM-5.3-Flash's DSA indexer, `None` when the layer has none.
    pub indexer: Option<IndexerGeometry>,
}

/// The per-rank shard plan for one MLA layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlaTpPlan {
    /// This rank, `0 <= tp_rank < tp_size`.
    pub tp_rank: usize,
    /// Tensor-parallel (attention-TP) world size.
    pub tp_size: usize,
    /// The layer's geometry.
    pub geometry: MlaGeometry,
    /// Heads this rank owns, `heads / tp_size`.
    pub local_heads: usize,
    /// Every tensor of the layer, in [`MlaTpPlan::names`] order: `q_proj` or `q_a_proj`,
    /// `q_a_layernorm`, `q_b_proj`; `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`;
    /// `g_proj` (output gate); `o_proj`; the indexer's tensors.
    pub tensors: Vec<KdaTensorPlan>,
}

impl MlaTpPlan {
    /// The plan for rank `tp_rank` of `tp_size`; `dtypes` overrides the default dtypes by
    /// plan name (BF16; F32 for `indexer.index_kpool_compress_ape`).
    ///
    /// # Errors
    /// [`Error::ZeroSize`] for a zero `tp_size`; [`Error::RankOutOfRange`];
    /// [`Error::MlaZeroSize`] for any other zero size (a zero `qk_rope_head_dim` is NoPE,
    /// allowed); [`Error::MlaHeadsNotDivisible`]; [`Error::MlaUnknownTensor`] /
    /// [`Error::MlaUnsupportedDtype`] for a bad dtype override; [`Error::Overflow`] when a byte
    /// size exceeds `isize::MAX`.
    pub fn new(
        tp_rank: usize,
        tp_size: usize,
        geometry: MlaGeometry,
        dtypes: &[(String, Dtype)],
    ) -> Result<Self> {
        Self::with_quant(tp_rank, tp_size, geometry, dtypes, None)
    }

    /// The plan as [`Self::new`], with `quant`'s projections block-quantized: their dtype
    /// defaults to `F8_E4M3` (`F8_E5M2` allowed), each gets its block edge and the plan of its
    /// F32 scale grid ([`KdaTensorPlan::scale`], [`crate::quant::grid_plan`]).
    ///
    /// # Errors
    /// As [`Self::new`]; [`Error::ZeroSize`] / [`Error::BlockSize`] for a bad block edge;
    /// [`Error::MlaUnknownTensor`] for a quantized name not in this layer;
    /// [`Error::MlaNotQuantizable`] for a norm or an indexer tensor; [`Error::MlaBlockSplit`]
    /// when `tp_size > 1` and a quantized sliced weight's share per rank is not a whole number
    /// of blocks (the message lists the world sizes that are).
    pub fn with_quant(
        tp_rank: usize,
        tp_size: usize,
        geometry: MlaGeometry,
        dtypes: &[(String, Dtype)],
        quant: Option<&BlockQuant>,
    ) -> Result<Self> {
        if tp_size == 0 {
            return Err(Error::ZeroSize { field: "tp_size" });
        }
        if tp_rank >= tp_size {
            return Err(Error::RankOutOfRange { tp_rank, tp_size });
        }
        let g = geometry;
        let mut sizes = vec![
            ("hidden_size", g.hidden),
            ("num_attention_heads", g.heads),
            ("kv_lora_rank", g.kv_lora_rank),
            ("qk_nope_head_dim", g.qk_nope_head_dim),
            ("v_head_dim", g.v_head_dim),
        ];
        if let Some(q) = g.q_lora_rank {
            sizes.push(("q_lora_rank", q));
        }
        if let Some(ix) = g.indexer {
            sizes.extend([
                ("index_n_heads", ix.heads),
                ("index_head_dim", ix.head_dim),
                ("index_kpool", ix.kpool),
            ]);
        }
        if let Some(&(field, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return Err(Error::MlaZeroSize { field });
        }
        if g.heads % tp_size != 0 {
            return Err(Error::MlaHeadsNotDivisible {
                heads: g.heads,
                tp_size,
            });
        }
        let local_heads = g.heads / tp_size;
        let overflow = |tensor: &str| Error::Overflow {
            tensor: tensor.to_string(),
        };
        let mul =
            |a: usize, b: usize, tensor: &str| a.checked_mul(b).ok_or_else(|| overflow(tensor));
        let add =
            |a: usize, b: usize, tensor: &str| a.checked_add(b).ok_or_else(|| overflow(tensor));
        let qk_head = add(g.qk_nope_head_dim, g.qk_rope_head_dim, "q_b_proj")?;
        let kv_head = add(g.qk_nope_head_dim, g.v_head_dim, "kv_b_proj")?;
        let kv_a_rows = add(g.kv_lora_rank, g.qk_rope_head_dim, "kv_a_proj_with_mqa")?;

        use KdaShard::{ChannelCols, ChannelRows, Replicated};
        let (d, l) = (g.hidden, g.kv_lora_rank);
        let q_rows = mul(g.heads, qk_head, "q_b_proj")?;
        let mut layout: Vec<Row> = match g.q_lora_rank {
            None => vec![("q_proj", ChannelRows, q_rows, d, vec![q_rows, d], qk_head)],
            Some(q) => vec![
                ("q_a_proj", Replicated, q, d, vec![q, d], 0),
                ("q_a_layernorm", Replicated, q, 1, vec![q], 0),
                ("q_b_proj", ChannelRows, q_rows, q, vec![q_rows, q], qk_head),
            ],
        };
        let kv_rows = mul(g.heads, kv_head, "kv_b_proj")?;
        let v_cols = mul(g.heads, g.v_head_dim, "o_proj")?;
        layout.extend([
            (
                "kv_a_proj_with_mqa",
                Replicated,
                kv_a_rows,
                d,
                vec![kv_a_rows, d],
                0,
            ),
            ("kv_a_layernorm", Replicated, l, 1, vec![l], 0),
            (
                "kv_b_proj",
                ChannelRows,
                kv_rows,
                l,
                vec![kv_rows, l],
                kv_head,
            ),
        ]);
        if g.output_gate {
            layout.push((
                "g_proj",
                ChannelRows,
                v_cols,
                d,
                vec![v_cols, d],
                g.v_head_dim,
            ));
        }
        layout.push((
            "o_proj",
            ChannelCols,
            d,
            v_cols,
            vec![d, v_cols],
            g.v_head_dim,
        ));
        if let Some(ix) = g.indexer {
            let (n, h) = (ix.heads, ix.head_dim);
            let q = g.q_lora_rank.unwrap_or(d);
            let wq = mul(n, h, "indexer.wq_b")?;
            layout.extend([
                ("indexer.wq_b", Replicated, wq, q, vec![wq, q], 0),
                ("indexer.wk", Replicated, h, d, vec![h, d], 0),
                ("indexer.weights_proj", Replicated, n, d, vec![n, d], 0),
                ("indexer.k_norm", Replicated, h, 1, vec![h], 0),
                ("indexer.k_norm.bias", Replicated, h, 1, vec![h], 0),
                (
                    "indexer.index_kpool_compress_ape",
                    Replicated,
                    ix.kpool,
                    h,
                    vec![ix.kpool, h],
                    0,
                ),
                (
                    "indexer.index_kpool_compress_gate",
                    Replicated,
                    h,
                    d,
                    vec![h, d],
                    0,
                ),
            ]);
        }
        let names: Vec<&str> = layout.iter().map(|row| row.0).collect();
        let quantized: Vec<&str> = match quant {
            None => Vec::new(),
            Some(q) => {
                quant::check_block(q.block)?;
                for name in &q.tensors {
                    if !names.contains(&name.as_str()) {
                        return Err(Error::MlaUnknownTensor {
                            name: name.clone(),
                            known: names.join(", "),
                        });
                    }
                    if !QUANTIZABLE.contains(&name.as_str()) {
                        return Err(Error::MlaNotQuantizable {
                            tensor: name.clone(),
                        });
                    }
                }
                names
                    .iter()
                    .copied()
                    .filter(|n| q.tensors.iter().any(|t| t == n))
                    .collect()
            }
        };
        // In plan order (unknown names last, by name), whatever order the caller's map has:
        // the first refused tensor is the same every time.
        let mut overrides: Vec<&(String, Dtype)> = dtypes.iter().collect();
        overrides.sort_by_key(|(name, _)| {
            let at = names.iter().position(|n| n == name);
            (at.unwrap_or(usize::MAX), name.clone())
        });
        for (name, dtype) in overrides {
            if !names.contains(&name.as_str()) {
                return Err(Error::MlaUnknownTensor {
                    name: name.clone(),
                    known: names.join(", "),
                });
            }
            let fp8 = matches!(dtype, Dtype::F8_E4M3 | Dtype::F8_E5M2);
            let float = matches!(dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32 | Dtype::F64);
            if !(float || fp8 && quantized.contains(&name.as_str())) {
                return Err(Error::MlaUnsupportedDtype {
                    tensor: name.clone(),
                    dtype: dtype.to_string(),
                });
            }
        }
        let dtype_of = |name: &str| {
            let default = if name == "indexer.index_kpool_compress_ape" {
                Dtype::F32
            } else if quantized.contains(&name) {
                Dtype::F8_E4M3
            } else {
                Dtype::BF16
            };
            dtypes
                .iter()
                .rev()
                .find(|(n, _)| n == name)
                .map_or(default, |(_, d)| *d)
        };

        if let Some(q) = quant {
            check_block_split(&layout, &quantized, q.block, g.heads, tp_rank, tp_size)?;
        }
        let mut tensors = Vec::with_capacity(layout.len());
        let mut layer_bytes: usize = 0;
        for (name, kind, full_rows, full_row_elems, disk_shape, per_head) in layout {
            let dtype = dtype_of(name);
            let elem_bytes = dtype.bitsize() / 8;
            let full_bytes = full_rows
                .checked_mul(full_row_elems)
                .and_then(|n| n.checked_mul(elem_bytes))
                .filter(|&n| isize::try_from(n).is_ok())
                .ok_or_else(|| overflow(name))?;
            layer_bytes = layer_bytes
                .checked_add(full_bytes)
                .filter(|&n| isize::try_from(n).is_ok())
                .ok_or_else(|| overflow("MLA layer"))?;
            // Cannot overflow: at most the full extent, checked above.
            let local = local_heads * per_head;
            let (local_rows, local_row_elems, src_row_offset, src_col_offset) = match kind {
                ChannelRows => (local, full_row_elems, tp_rank * local, 0),
                ChannelCols => (full_rows, local, 0, tp_rank * local),
                _ => (full_rows, full_row_elems, 0, 0),
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
            if let Some(q) = quant.filter(|_| quantized.contains(&name)) {
                entry.scale = Some(Box::new(quant::grid_plan(&entry, q)));
                entry.block = Some(q.block);
            }
            tensors.push(entry);
        }
        Ok(Self {
            tp_rank,
            tp_size,
            geometry,
            local_heads,
            tensors,
        })
    }

    /// The plan entry for a plan name such as `kv_b_proj` or `indexer.wk`.
    pub fn get(&self, name: &str) -> Option<&KdaTensorPlan> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Plan names of this layer's tensors, in order.
    pub fn names(&self) -> Vec<&'static str> {
        self.tensors.iter().map(|t| t.name).collect()
    }

    /// Bytes this rank stores for one MLA layer.
    pub fn local_bytes(&self) -> usize {
        self.tensors.iter().map(KdaTensorPlan::local_bytes).sum()
    }

    /// Bytes one MLA layer occupies on disk.
    pub fn full_bytes(&self) -> usize {
        self.tensors.iter().map(KdaTensorPlan::full_bytes).sum()
    }
}

/// Refuses a split in which a quantized sliced weight's share per rank is not a whole number of
/// blocks on its sharded axis (vLLM 0.33 `validate_fp8_block_shape`: a column-parallel output
/// partition a multiple of `block_n`, a row-parallel input partition a multiple of `block_k`;
/// nothing is checked at `tp_size == 1`, where a rank holds the whole weight and its trailing
/// partial block).
fn check_block_split(
    layout: &[Row],
    quantized: &[&str],
    block: [usize; 2],
    heads: usize,
    tp_rank: usize,
    tp_size: usize,
) -> Result<()> {
    // (name, axis, block edge, elements per head) of each quantized sliced weight.
    let sliced: Vec<(&'static str, &'static str, usize, usize)> = layout
        .iter()
        .filter(|row| quantized.contains(&row.0))
        .filter_map(|row| match row.1 {
            KdaShard::ChannelRows | KdaShard::HeadRows => Some((row.0, "rows", block[0], row.5)),
            KdaShard::ChannelCols => Some((row.0, "columns", block[1], row.5)),
            KdaShard::Replicated => None,
        })
        .collect();
    let fits = |size: usize| {
        size == 1
            || sliced
                .iter()
                .all(|&(_, _, edge, per_head)| (heads / size * per_head) % edge == 0)
    };
    let local_heads = heads / tp_size;
    let first_bad = sliced
        .iter()
        .find(|&&(_, _, edge, per_head)| tp_size > 1 && (local_heads * per_head) % edge != 0);
    let Some(&(name, axis, edge, per_head)) = first_bad else {
        return Ok(());
    };
    // Every divisor when the head count is too large to list them (`divisors`): 1 always fits.
    let allowed = divisors(heads)
        .unwrap_or_else(|| vec![1])
        .into_iter()
        .filter(|&size| fits(size))
        .collect();
    let local = local_heads * per_head;
    Err(Error::MlaBlockSplit {
        tensor: name.to_string(),
        axis,
        rank: tp_rank,
        start: tp_rank * local,
        end: (tp_rank + 1) * local,
        local,
        block: edge,
        tp_size,
        allowed,
    })
}

#[cfg(test)]
mod tests;
