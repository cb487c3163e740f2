//! The byte slicers on numpy buffers (`shard_bytes`, `shard_into`, `copy_into`), with the GIL
//! released.
//!
//! **What a GIL-released copy relies on.** A copy borrows its source as `&[u8]` and its output
//! as `&mut [u8]` while other Python threads run. numpy's borrow flags (`PyReadonlyArray`,
//! `PyReadwriteArray`, held for the whole call) stop Rust code that uses rust-numpy from
//! writing the source or touching the output meanwhile, and refuse an output that overlaps the
//! source (numpy's `TypeError`, "already borrowed"); they cannot stop Python code, so the rest
//! is the caller's contract, the one numpy's own GIL-released copies and Python's `readinto`
//! have:
//! * the source is not written by another thread during the call. What `SafetensorsSource`
//!   reads keeps it by construction: a `TensorBytes` (a read-only file mapping, or a copy that
//!   object owns and never changes), which numpy cannot make writable
//!   (`tests/rank/test_read_into.py`), or an aligned copy made for the one call. Another
//!   source's arrays (a custom source behind `KdaShardedSource`, a buffer passed to
//!   `kda_tp.shard_bytes`) are its owner's to keep still;
//! * the output belongs to the caller: no other thread reads or writes it until the call
//!   returns. A fresh array (`shard_bytes`) is seen by no one else.
//!
//! Holding the GIL instead would not make a foreign source safe either (numpy's own copies
//! write arrays with the GIL released), and would stop every other Python thread for the copy.

use std::mem::MaybeUninit;

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyReadwriteArray1};
use pyo3::prelude::*;
use pyo3::types::PySlice;

use super::errors::{py_err, BufferLayoutError, ShapeMismatchError};
use super::tensor::PyTensorPlan;
use crate::pages;
use crate::slice;

/// This rank's bytes of one full tensor held in a 1-D uint8 array (see `kda_tp.shard_bytes`).
#[pyfunction]
pub(super) fn shard_bytes<'py>(
    py: Python<'py>,
    plan: &PyTensorPlan,
    full: PyReadonlyArray1<'py, u8>,
) -> PyResult<Bound<'py, PyAny>> {
    let src = contiguous(full.as_slice())?;
    slice::check_full_len(&plan.0, src.len())?;
    if let Some(range) = slice::row_byte_range(&plan.0) {
        let view = PySlice::new(py, range.start as isize, range.end as isize, 1);
        return full.as_any().get_item(view);
    }
    let len = plan.0.local_bytes();
    // SAFETY: a new, uninitialised 1-D array of `len` bytes that nothing else can see yet.
    let array = unsafe { PyArray1::<u8>::new(py, len, false) };
    let out: &mut [MaybeUninit<u8>] = if len == 0 {
        &mut []
    } else {
        // SAFETY: the new array's data is `len` bytes (non-null), valid for writes, aligned
        // for bytes, and borrowed by nothing else while `out` lives (the array is handed out
        // only after the last use of `out`).
        unsafe { std::slice::from_raw_parts_mut(array.data().cast::<MaybeUninit<u8>>(), len) }
    };
    if len >= slice::PARALLEL_MIN_BYTES {
        pages::advise_huge_pages(out);
    }
    py.detach(|| slice::gather_cols_uninit(&plan.0, src, out))?;
    // Every byte is written: `gather_cols_uninit` returned `Ok`.
    Ok(array.into_any())
}

/// Writes this rank's bytes of one tensor into a caller-owned buffer, with the GIL released
/// (see `KdaShardedSource.read_into`, which checks the buffer and names the tensor first, and
/// the module docs for what the call relies on).
///
/// ``full``: the full tensor's raw bytes, a C-contiguous 1-D uint8 array of
/// ``plan.full_bytes`` bytes. ``out``: a writable C-contiguous 1-D uint8 array of
/// ``plan.local_bytes`` bytes; every byte is overwritten. Neither is used by another thread
/// during the call.
///
/// Raises:
///     ShapeMismatchError: ``full`` or ``out`` has the wrong number of bytes.
///     BufferLayoutError: an array is not C-contiguous.
///     TypeError: ``out`` overlaps ``full`` (numpy's borrow check).
#[pyfunction]
pub(super) fn shard_into(
    py: Python<'_>,
    plan: &PyTensorPlan,
    full: PyReadonlyArray1<'_, u8>,
    mut out: PyReadwriteArray1<'_, u8>,
) -> PyResult<()> {
    let src = contiguous(full.as_slice())?;
    let dst = contiguous_out(out.as_slice_mut())?;
    py.detach(|| slice::shard_into(&plan.0, src, dst))?;
    Ok(())
}

/// Copies ``src`` into ``out`` (both C-contiguous 1-D uint8 arrays of the same length in bytes)
/// with the GIL released; large copies use several threads (see `KdaShardedSource.read_into`,
/// and the module docs for what the call relies on).
///
/// Raises:
///     ShapeMismatchError: the lengths differ (the message gives both, in bytes).
///     BufferLayoutError: an array is not C-contiguous.
///     TypeError: ``out`` overlaps ``src`` (numpy's borrow check).
#[pyfunction]
pub(super) fn copy_into(
    py: Python<'_>,
    src: PyReadonlyArray1<'_, u8>,
    mut out: PyReadwriteArray1<'_, u8>,
) -> PyResult<()> {
    let src = contiguous(src.as_slice())?;
    let dst = contiguous_out(out.as_slice_mut())?;
    if src.len() != dst.len() {
        let message = format!(
            "the output buffer is {} bytes, the source is {} bytes",
            dst.len(),
            src.len()
        );
        return Err(py_err!(
            ShapeMismatchError,
            message,
            expected_bytes = src.len(),
            actual_bytes = dst.len(),
        ));
    }
    py.detach(|| slice::copy_parallel(src, dst));
    Ok(())
}

/// An input array's slice, or `BufferLayoutError` when the array is not C-contiguous.
fn contiguous<T, E>(slice: Result<T, E>) -> PyResult<T> {
    slice.map_err(|_| BufferLayoutError::new_err("the buffer must be C-contiguous"))
}

/// The output array's slice, or `BufferLayoutError` when it is not C-contiguous.
fn contiguous_out<T, E>(slice: Result<T, E>) -> PyResult<T> {
    slice.map_err(|_| BufferLayoutError::new_err("the output buffer must be C-contiguous"))
}
