//! One KDA tensor's placement on one rank ([`KdaTensorPlan`]) and how a tensor maps onto ranks
//! ([`KdaShard`]): the vocabulary the plan ([`crate::plan`]) and the block-scale grids
//! ([`crate::quant`]) share. It depends on neither, so neither depends on the other for it.

use safetensors::Dtype;

use crate::error::{Error, Result};

/// How one KDA tensor maps onto tensor-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KdaShard {
    /// Every rank holds the whole tensor.
    Replicated,
    /// Leading dimension is `heads`: each rank keeps its head range.
    HeadRows,
    /// Leading dimension is `heads · head_dim`: each rank keeps its channel range.
    ChannelRows,
    /// Trailing (input) dimension is `heads · head_dim`: a row-parallel GEMM weight; each rank
    /// keeps every row's channel range and its output is all-reduced.
    ChannelCols,
}

/// One tensor's placement, in a flat `[rows, row_elems]` view of the on-disk tensor.
///
/// All counts are elements except where a name says bytes. For [`KdaShard::ChannelCols`] the
/// sharded axis is `row_elems`; for the row kinds it is `rows`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KdaTensorPlan {
    /// Plan name, e.g. `q_proj` (the checkpoint name without layer prefix and `.weight`).
    pub name: &'static str,
    /// How the tensor is sharded.
    pub kind: KdaShard,
    /// On-disk dtype.
    pub dtype: Dtype,
    /// Bytes per element.
    pub elem_bytes: usize,
    /// Rows of the full (on-disk) tensor.
    pub full_rows: usize,
    /// Elements per row of the full tensor.
    pub full_row_elems: usize,
    /// Rows this rank keeps.
    pub local_rows: usize,
    /// Elements per row this rank keeps (differs from full only for `ChannelCols`).
    pub local_row_elems: usize,
    /// First row of this rank's slice. 0 for `Replicated` and `ChannelCols`.
    pub src_row_offset: usize,
    /// First element of this rank's column slice. 0 except for `ChannelCols`.
    pub src_col_offset: usize,
    /// The full tensor's shape as Kimi-Linear stores it: conv weights `[C, 1, K]`, `A_log`
    /// `[1, 1, H, 1]` (Kimi K3's zero-padded `A_log`: `[a_log_len]`), `dt_bias` `[C]`, `o_norm`
    /// `[head_dim]`.
    pub disk_shape: Vec<usize>,
    /// Block edge `[rows, columns]` (elements) when the weight is block-quantized (FP8).
    pub block: Option<[usize; 2]>,
    /// The plan of the weight's scale grid when block-quantized: same kind, counts and offsets
    /// in blocks (see [`crate::quant`]).
    pub scale: Option<Box<KdaTensorPlan>>,
}

impl KdaTensorPlan {
    /// Bytes this rank stores for this tensor.
    pub fn local_bytes(&self) -> usize {
        self.local_rows * self.local_row_elems * self.elem_bytes
    }

    /// Bytes the full tensor occupies on disk.
    pub fn full_bytes(&self) -> usize {
        self.full_rows * self.full_row_elems * self.elem_bytes
    }

    /// Bytes of one full row.
    pub fn row_bytes(&self) -> usize {
        self.full_row_elems * self.elem_bytes
    }

    /// The on-disk axis this plan shards in a tensor of shape `disk_shape`, or `None` when the
    /// tensor is replicated.
    ///
    /// The shape may have any rank that flattens to `[full_rows, full_row_elems]`: for the row
    /// kinds the sharded axis is the first one whose extent is `full_rows` with only unit axes
    /// before it (`[1, 1, H, 1]` → 2, `[H]` → 0, `[C, 1, K]` → 0); for `ChannelCols` it is the
    /// last one whose extent is `full_row_elems` with only unit axes after it (`[d, C]` → 1, a
    /// ModelOpt scale grid `[ob, 1, ib, 1]` → 2).
    ///
    /// # Errors
    /// [`Error::Shape`] when `disk_shape` does not hold exactly this tensor.
    pub fn sharded_axis(&self, disk_shape: &[usize]) -> Result<Option<usize>> {
        let mismatch = || Error::Shape {
            tensor: self.name.to_string(),
            actual: disk_shape.to_vec(),
            rows: self.full_rows,
            row_elems: self.full_row_elems,
            example: self.disk_shape.clone(),
        };
        let numel = disk_shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(mismatch)?;
        if numel != self.full_rows * self.full_row_elems {
            return Err(mismatch());
        }
        match self.kind {
            KdaShard::Replicated => Ok(None),
            KdaShard::HeadRows | KdaShard::ChannelRows => {
                let lead = disk_shape.iter().take_while(|&&d| d == 1).count();
                let axis = if self.full_rows == 1 { 0 } else { lead };
                match disk_shape.get(axis) {
                    Some(&d) if d == self.full_rows => Ok(Some(axis)),
                    _ => Err(mismatch()),
                }
            }
            KdaShard::ChannelCols => {
                let trail = disk_shape.iter().rev().take_while(|&&d| d == 1).count();
                let axis = if self.full_row_elems == 1 {
                    disk_shape.len()
                } else {
                    disk_shape.len() - trail
                };
                match axis
                    .checked_sub(1)
                    .and_then(|a| disk_shape.get(a).map(|&d| (a, d)))
                {
                    Some((a, d)) if d == self.full_row_elems => Ok(Some(a)),
                    _ => Err(mismatch()),
                }
            }
        }
    }

    /// This rank's shape of a tensor stored as `disk_shape`: the same rank, with the sharded
    /// axis (see [`Self::sharded_axis`]) reduced to the local extent.
    ///
    /// # Errors
    /// [`Error::Shape`] when `disk_shape` does not hold exactly this tensor.
    pub fn local_shape(&self, disk_shape: &[usize]) -> Result<Vec<usize>> {
        let mut shape = disk_shape.to_vec();
        if let Some(axis) = self.sharded_axis(disk_shape)? {
            shape[axis] = match self.kind {
                KdaShard::ChannelCols => self.local_row_elems,
                _ => self.local_rows,
            };
        }
        Ok(shape)
    }
}
