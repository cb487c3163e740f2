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
use crate::pages;
use crate::tensor::{KdaShard, KdaTensorPlan};

/// Below this many output bytes a copy or column gather runs on the calling thread with ordinary
/// stores. From this size on it is split across the rayon pool and, on x86_64, written with
/// non-temporal (streaming) stores: an output this large is not read back from the cache soon,
/// and streaming stores skip reading every destination line before overwriting it. Measured on
/// the GLM-5.3 `o_proj` gather (8-32 MiB out) they raised the gather from 0.6-0.85x to 1.0-1.2x
/// a single-threaded `memcpy` into the same prefaulted memory (benchmarks/bench.py). Output
/// pages not yet faulted in are populated first ([`pages::prefault_for_write`]): streaming
/// stores into a page the fault has just zeroed into the cache cost 30 % more CPU time than
/// a plain `memcpy` faulting the same pages.
pub const PARALLEL_MIN_BYTES: usize = 4 << 20;
/// Output bytes per parallel task: large enough to amortise scheduling and short rows.
const TASK_BYTES: usize = 1 << 20;
/// Rows ahead of the one being copied whose source bytes a streaming gather prefetches: a row
/// of a column slice is a short run (2-8 KiB) in its own page, too short for the hardware
/// prefetcher to ramp up before the run ends.
const PREFETCH_ROWS: usize = 2;

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
/// bytes) and `out` receives `plan.local_bytes()` bytes. Outputs of 4 MiB or more are split
/// across the rayon pool in tasks of about 1 MiB of output, each a contiguous span of output
/// rows, written with streaming stores while the next rows' source bytes are prefetched; the
/// output's pages that are not resident yet are faulted in first, in one call per run.
///
/// # Errors
/// [`Error::BufferSize`] when `full` has the wrong length, or when `out` is not
/// `plan.local_bytes()` long (reported against the local shape).
pub fn gather_cols(plan: &KdaTensorPlan, full: &[u8], out: &mut [u8]) -> Result<()> {
    check_local_len(plan, out.len())?;
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
    let stream = rows * width >= PARALLEL_MIN_BYTES;
    // An address, not a pointer, so the closure can be shared across rayon's threads.
    let out_addr = out as usize;
    let copy_rows = |first: usize, count: usize| {
        let end = first + count;
        for i in first..end {
            let base = (plan.src_row_offset + i) * row + lo;
            let src = &full[base..base + width];
            if stream && i + PREFETCH_ROWS < end {
                let ahead = base + PREFETCH_ROWS * row;
                prefetch(&full[ahead..ahead + width]);
            }
            // SAFETY: output row `i` is `[i*width, (i+1)*width)`, inside the `rows*width` =
            // `local_bytes()` bytes the caller guarantees; tasks write disjoint rows.
            unsafe { copy_bytes(src, (out_addr as *mut u8).add(i * width), stream) };
        }
        if stream {
            store_fence();
        }
    };
    if !stream {
        copy_rows(0, rows);
    } else {
        pages::prefault_for_write(out_addr, rows * width);
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

/// Copies this rank's bytes of one tensor into a caller-owned buffer: the row range (one
/// contiguous copy) for `Replicated`, `HeadRows` and `ChannelRows`, the strided column gather
/// for `ChannelCols`.
///
/// `full` is the whole `[full_rows, full_row_elems]` tensor (`plan.full_bytes()` bytes,
/// row-major) and `out` receives exactly `plan.local_bytes()` bytes, row-major in the local
/// shape. Outputs of 4 MiB or more are written by the rayon pool with streaming stores (see
/// [`copy_parallel`]); every byte of `out` is overwritten.
///
/// # Errors
/// [`Error::BufferSize`] when `full` is not `plan.full_bytes()` long, or `out` is not
/// `plan.local_bytes()` long (reported against the local shape).
pub fn shard_into(plan: &KdaTensorPlan, full: &[u8], out: &mut [u8]) -> Result<()> {
    check_full_len(plan, full.len())?;
    check_local_len(plan, out.len())?;
    match row_byte_range(plan) {
        Some(range) => {
            copy_parallel(&full[range], out);
            Ok(())
        }
        None => gather_cols(plan, full, out),
    }
}

/// Copies `src` into `dst`, which must be the same length. Copies of 4 MiB or more fault in
/// `dst`'s missing pages first, then are split into 1 MiB tasks on the rayon pool and written
/// with streaming stores on x86_64 (measured
/// 1.1-1.3x a single-threaded `memcpy` into prefaulted memory on a 2-vCPU VM); smaller ones are
/// one `memcpy` on the calling thread.
///
/// # Panics
/// When the lengths differ (callers check them and report the sizes first).
pub fn copy_parallel(src: &[u8], dst: &mut [u8]) {
    assert_eq!(
        src.len(),
        dst.len(),
        "copy_parallel: source and destination lengths differ"
    );
    if src.len() < PARALLEL_MIN_BYTES {
        dst.copy_from_slice(src);
        return;
    }
    pages::prefault_for_write(dst.as_ptr() as usize, dst.len());
    dst.par_chunks_mut(TASK_BYTES)
        .zip(src.par_chunks(TASK_BYTES))
        .for_each(|(d, s)| {
            // SAFETY: `d` and `s` are disjoint chunks of the same length.
            unsafe { copy_bytes(s, d.as_mut_ptr(), true) };
            store_fence();
        });
}

fn check_local_len(plan: &KdaTensorPlan, len: usize) -> Result<()> {
    if len == plan.local_bytes() {
        return Ok(());
    }
    Err(Error::BufferSize {
        tensor: format!("{} (local output)", plan.name),
        actual: len,
        expected: plan.local_bytes(),
        rows: plan.local_rows,
        row_elems: plan.local_row_elems,
        elem_bytes: plan.elem_bytes,
    })
}

/// Copies `src` to `dst`: with `stream`, through non-temporal stores on x86_64 (the caller
/// issues [`store_fence`] before the bytes are handed on); otherwise, and elsewhere, `memcpy`.
///
/// # Safety
/// `dst` must be valid for writes of `src.len()` bytes and must not overlap `src`.
unsafe fn copy_bytes(src: &[u8], dst: *mut u8, stream: bool) {
    #[cfg(target_arch = "x86_64")]
    if stream {
        // SAFETY: forwarded from the caller.
        unsafe { stream_copy(src, dst) };
        return;
    }
    let _ = stream;
    // SAFETY: forwarded from the caller.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
}

/// `memcpy` with SSE2 streaming stores (baseline on x86_64): ordinary copies up to the first
/// 16-byte-aligned destination address and for the tail, 64-byte blocks in between.
///
/// # Safety
/// As [`copy_bytes`].
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(src: &[u8], dst: *mut u8) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    let len = src.len();
    let s = src.as_ptr();
    let head = dst.align_offset(16).min(len);
    // SAFETY: every access below stays inside `[0, len)` of `src` and of `dst` (caller's
    // contract); the streaming stores go to 16-byte-aligned addresses `dst + head + 16k`.
    unsafe {
        std::ptr::copy_nonoverlapping(s, dst, head);
        let mut k = head;
        while k + 64 <= len {
            for lane in (0..64).step_by(16) {
                let v = _mm_loadu_si128(s.add(k + lane).cast::<__m128i>());
                _mm_stream_si128(dst.add(k + lane).cast::<__m128i>(), v);
            }
            k += 64;
        }
        std::ptr::copy_nonoverlapping(s.add(k), dst.add(k), len - k);
    }
}

/// Orders this thread's streaming stores before whatever it does next (a no-op elsewhere than
/// x86_64, where [`copy_bytes`] never streams).
fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of the x86_64 baseline.
    unsafe {
        std::arch::x86_64::_mm_sfence();
    }
}

/// Asks the CPU to start loading `bytes` into the cache (a hint; x86_64 only).
fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64) {
        // SAFETY: a prefetch never faults, and `line` is a valid address anyway.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                line.as_ptr().cast::<i8>(),
            );
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
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
