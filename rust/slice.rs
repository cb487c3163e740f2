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
use std::mem::MaybeUninit;
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
/// across the rayon pool (`par_chunks_mut`) in tasks of about 1 MiB of output, each a contiguous
/// span of whole output rows, written with streaming stores while the next rows' source bytes
/// are prefetched; the output's pages that are not resident yet are faulted in first, in one
/// call per run.
///
/// # Errors
/// [`Error::BufferSize`] when `full` has the wrong length, or when `out` is not
/// `plan.local_bytes()` long (reported against the local shape).
pub fn gather_cols(plan: &KdaTensorPlan, full: &[u8], out: &mut [u8]) -> Result<()> {
    gather(plan, full, out)
}

/// [`gather_cols`] into memory that may be uninitialised, such as a freshly allocated array or
/// a `Vec`'s spare capacity: every output byte is written, so no zeroing pass (and no reuse
/// penalty) is needed. On `Ok`, every byte of `out` is initialised.
///
/// # Errors
/// As [`gather_cols`]; `out` is then left as it was or partly written.
pub fn gather_cols_uninit(
    plan: &KdaTensorPlan,
    full: &[u8],
    out: &mut [MaybeUninit<u8>],
) -> Result<()> {
    gather(plan, full, out)
}

/// [`gather_cols`] over either kind of output byte.
fn gather<B: OutByte>(plan: &KdaTensorPlan, full: &[u8], out: &mut [B]) -> Result<()> {
    check_full_len(plan, full.len())?;
    check_local_len(plan, out.len())?;
    let width = plan.local_row_elems * plan.elem_bytes;
    if width == 0 || out.is_empty() {
        return Ok(());
    }
    let row = plan.row_bytes();
    let lo = plan.src_col_offset * plan.elem_bytes;
    // Source row `i` of this rank's block (in range: `full` is `full_bytes()` long).
    let src_row = |i: usize| {
        let base = (plan.src_row_offset + i) * row + lo;
        &full[base..base + width]
    };
    // `out` is `local_rows * width` bytes (checked above): `chunks_exact_mut` covers it whole.
    if out.len() < PARALLEL_MIN_BYTES {
        for (i, dst) in out.chunks_exact_mut(width).enumerate() {
            copy_bytes(src_row(i), dst, false);
        }
        return Ok(());
    }
    pages::prefault_for_write(out);
    let per_task = (TASK_BYTES / width).max(1);
    out.par_chunks_mut(per_task * width)
        .enumerate()
        .for_each(|(task, rows)| {
            let first = task * per_task;
            let count = rows.len() / width;
            for (j, dst) in rows.chunks_exact_mut(width).enumerate() {
                if j + PREFETCH_ROWS < count {
                    prefetch(src_row(first + j + PREFETCH_ROWS));
                }
                copy_bytes(src_row(first + j), dst, true);
            }
            store_fence();
        });
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
    pages::prefault_for_write(dst);
    dst.par_chunks_mut(TASK_BYTES)
        .zip(src.par_chunks(TASK_BYTES))
        .for_each(|(d, s)| {
            copy_bytes(s, d, true);
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

/// A byte of an output buffer: `u8`, or `MaybeUninit<u8>` for memory not initialised yet.
///
/// # Safety
/// Implementors have the size and alignment of `u8`, and every initialised `u8` written through
/// a `*mut u8` cast of a pointer to one is a valid value of the type.
unsafe trait OutByte: Send {}
// SAFETY: `u8` itself.
unsafe impl OutByte for u8 {}
// SAFETY: `MaybeUninit<u8>` has `u8`'s layout, and any byte is a valid value of it.
unsafe impl OutByte for MaybeUninit<u8> {}

/// Copies `src` into `dst` (the same length): with `stream`, through non-temporal stores on
/// x86_64 (the caller issues [`store_fence`] before the bytes are handed on); otherwise, and
/// elsewhere, `memcpy`.
///
/// # Panics
/// When the lengths differ (every caller passes equal lengths; the check is one comparison per
/// row or task, not per byte).
fn copy_bytes<B: OutByte>(src: &[u8], dst: &mut [B], stream: bool) {
    assert_eq!(src.len(), dst.len(), "copy_bytes: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if stream {
        stream_copy(src, dst);
        return;
    }
    let _ = stream;
    // SAFETY: `dst` is an exclusive borrow of `src.len()` one-byte values (`OutByte`), so it is
    // valid for that many byte writes, and it cannot overlap the shared borrow `src`.
    unsafe {
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast::<u8>(), src.len());
    }
}

/// `memcpy` with SSE2 streaming stores (baseline on x86_64): ordinary copies up to the first
/// 16-byte-aligned destination address and for the tail, 64-byte blocks in between. `src` and
/// `dst` have the same length (checked by [`copy_bytes`], the only caller).
#[cfg(target_arch = "x86_64")]
fn stream_copy<B: OutByte>(src: &[u8], dst: &mut [B]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    let len = src.len().min(dst.len());
    let s = src.as_ptr();
    let d = dst.as_mut_ptr().cast::<u8>();
    let head = d.align_offset(16).min(len);
    // SAFETY: every access below stays inside `[0, len)` of `src` (a shared borrow) and of
    // `dst` (an exclusive borrow of one-byte values, `OutByte`; it cannot overlap `src`); the
    // streaming stores go to 16-byte-aligned addresses `d + head + 16k`, as `_mm_stream_si128`
    // requires; SSE2 is part of the x86_64 baseline.
    unsafe {
        std::ptr::copy_nonoverlapping(s, d, head);
        let mut k = head;
        while k + 64 <= len {
            for lane in (0..64).step_by(16) {
                let v = _mm_loadu_si128(s.add(k + lane).cast::<__m128i>());
                _mm_stream_si128(d.add(k + lane).cast::<__m128i>(), v);
            }
            k += 64;
        }
        std::ptr::copy_nonoverlapping(s.add(k), d.add(k), len - k);
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
            let len = plan.local_bytes();
            let mut out = Vec::with_capacity(len);
            gather_cols_uninit(plan, full, &mut out.spare_capacity_mut()[..len])?;
            // SAFETY: the capacity is at least `len`, and `gather_cols_uninit` returned `Ok`,
            // having written all of the first `len` bytes of it.
            unsafe { out.set_len(len) };
            Ok(Cow::Owned(out))
        }
    }
}

#[cfg(test)]
mod tests;
