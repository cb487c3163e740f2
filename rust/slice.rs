//! Applying a [`KdaTensorPlan`] to the bytes of one full tensor.
//!
//! Two slicing shapes, and the wrong one is not a size error:
//!
//! * **Row slices** (`HeadRows`, `ChannelRows`) are one contiguous byte range, because this rank's
//!   rows sit next to each other on disk. They are returned as a range, so callers can borrow.
//! * **The column slice** (`ChannelCols`, `o_proj` alone) is a strided gather: every row
//!   contributes its own middle part. Row-slicing `o_proj` instead gives a tensor of the right
//!   size (at `tp_size = 2` for a square-ish weight) filled with the wrong numbers.

use std::borrow::Cow;
use std::ops::Range;

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::plan::{KdaShard, KdaTensorPlan};

/// Below this many output bytes a column gather runs on the calling thread.
const PARALLEL_MIN_BYTES: usize = 4 << 20;
/// Output bytes per parallel task: large enough to amortise scheduling and short rows.
const TASK_BYTES: usize = 1 << 20;

/// Refuses a full-tensor buffer whose length is not the plan's full byte size.
///
/// # Errors
/// [`Error::BufferSize`] naming the tensor and both sizes.
pub fn check_full_len(plan: &KdaTensorPlan, len: usize) -> Result<()> {
    if len == plan.full_bytes() {
        return Ok(());
    }
    Err(Error::BufferSize {
        tensor: plan.name.to_string(),
        actual: len,
        expected: plan.full_bytes(),
        rows: plan.full_rows,
        row_elems: plan.full_row_elems,
        elem_bytes: plan.elem_bytes,
    })
}

/// The byte range of the full tensor that this rank keeps, for every kind but `ChannelCols`
/// (which has no single range and gives `None`). `Replicated` gives the whole tensor.
pub fn row_byte_range(plan: &KdaTensorPlan) -> Option<Range<usize>> {
    match plan.kind {
        KdaShard::ChannelCols => None,
        KdaShard::Replicated | KdaShard::HeadRows | KdaShard::ChannelRows => {
            let start = plan.src_row_offset * plan.row_bytes();
            Some(start..start + plan.local_rows * plan.row_bytes())
        }
    }
}

/// Copies this rank's `[local_rows, local_row_elems]` block of `full` into `out`, in one pass:
/// for `ChannelCols` a strided gather of every row's column range, for the other kinds a copy
/// of the row range.
///
/// `full` is the whole `[full_rows, full_row_elems]` tensor (row-major, `plan.full_bytes()`
/// bytes) and `out` receives `plan.local_bytes()` bytes. Large outputs are split across the
/// rayon pool in tasks of about 1 MiB of output.
///
/// # Errors
/// [`Error::BufferSize`] when `full` has the wrong length, or when `out` is not
/// `plan.local_bytes()` long (reported against the local shape).
pub fn gather_cols(plan: &KdaTensorPlan, full: &[u8], out: &mut [u8]) -> Result<()> {
    if out.len() != plan.local_bytes() {
        return Err(Error::BufferSize {
            tensor: format!("{} (local output)", plan.name),
            actual: out.len(),
            expected: plan.local_bytes(),
            rows: plan.local_rows,
            row_elems: plan.local_row_elems,
            elem_bytes: plan.elem_bytes,
        });
    }
    // SAFETY: `out` is a live, exclusively borrowed buffer of exactly `local_bytes()` bytes.
    unsafe { gather_cols_uninit(plan, full, out.as_mut_ptr()) }
}

/// [`gather_cols`] into memory that may be uninitialised, such as a freshly allocated array:
/// every output byte is written, so no zeroing pass (and no reuse penalty) is needed.
///
/// # Errors
/// [`Error::BufferSize`] when `full` has the wrong length.
///
/// # Safety
/// `out` must be valid for writes of `plan.local_bytes()` bytes, and nothing else may read or
/// write that memory during the call.
pub unsafe fn gather_cols_uninit(plan: &KdaTensorPlan, full: &[u8], out: *mut u8) -> Result<()> {
    check_full_len(plan, full.len())?;
    let width = plan.local_row_elems * plan.elem_bytes;
    let rows = plan.local_rows;
    if width == 0 || rows == 0 {
        return Ok(());
    }
    let row = plan.row_bytes();
    let lo = plan.src_col_offset * plan.elem_bytes;
    // An address, not a pointer, so the closure can be shared across rayon's threads.
    let out_addr = out as usize;
    let copy_rows = |first: usize, count: usize| {
        for i in first..first + count {
            let base = (plan.src_row_offset + i) * row + lo;
            let src = &full[base..base + width];
            // SAFETY: output row `i` is `[i*width, (i+1)*width)`, inside the `rows*width` =
            // `local_bytes()` bytes the caller guarantees; tasks write disjoint rows.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.as_ptr(),
                    (out_addr as *mut u8).add(i * width),
                    width,
                );
            }
        }
    };
    if rows * width < PARALLEL_MIN_BYTES {
        copy_rows(0, rows);
    } else {
        let per_task = (TASK_BYTES / width).max(1);
        (0..rows.div_ceil(per_task))
            .into_par_iter()
            .for_each(|task| {
                let first = task * per_task;
                copy_rows(first, per_task.min(rows - first));
            });
    }
    Ok(())
}

/// This rank's bytes of one tensor: borrowed from `full` for row kinds and replicated tensors,
/// a freshly gathered buffer for `ChannelCols`.
///
/// # Errors
/// [`Error::BufferSize`] when `full.len()` is not the plan's full byte size: a shorter or longer
/// buffer is another tensor, and slicing it would return a valid-looking range of wrong data.
pub fn shard_bytes<'a>(plan: &KdaTensorPlan, full: &'a [u8]) -> Result<Cow<'a, [u8]>> {
    check_full_len(plan, full.len())?;
    match row_byte_range(plan) {
        Some(range) => Ok(Cow::Borrowed(&full[range])),
        None => {
            let mut out = Vec::with_capacity(plan.local_bytes());
            // SAFETY: the capacity is `local_bytes()`, and every byte is written before
            // `set_len`.
            unsafe {
                gather_cols_uninit(plan, full, out.as_mut_ptr())?;
                out.set_len(plan.local_bytes());
            }
            Ok(Cow::Owned(out))
        }
    }
}

#[cfg(test)]
mod tests;
