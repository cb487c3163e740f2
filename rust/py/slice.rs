//! The byte slicers on numpy buffers (`shard_bytes`, `shard_into`, `copy_into`), with the GIL
//! released.

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
    // SAFETY: a new, uninitialised 1-D array of `local_bytes()` bytes that nothing else can
    // see yet; `gather_cols_uninit` writes every byte of it before it is returned.
    let out = unsafe { PyArray1::<u8>::new(py, plan.0.local_bytes(), false) };
    let dst = out.data() as usize;
    if plan.0.local_bytes() >= slice::PARALLEL_MIN_BYTES {
        pages::advise_huge_pages(dst, plan.0.local_bytes());
    }
    py.detach(|| {
        // SAFETY: `dst` is the new array's `local_bytes()` bytes, which only this call sees.
        unsafe { slice::gather_cols_uninit(&plan.0, src, dst as *mut u8) }
    })?;
    Ok(out.into_any())
}

/// Writes this rank's bytes of one tensor into a caller-owned buffer, with the GIL released
/// (see `KdaShardedSource.read_into`, which checks the buffer and names the tensor first).
///
/// ``full``: the full tensor's raw bytes, a C-contiguous 1-D uint8 array of
/// ``plan.full_bytes`` bytes. ``out``: a writable C-contiguous 1-D uint8 array of
/// ``plan.local_bytes`` bytes; every byte is overwritten.
///
/// Raises:
///     ShapeMismatchError: ``full`` or ``out`` has the wrong number of bytes.
///     BufferLayoutError: an array is not C-contiguous.
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
/// with the GIL released; large copies use several threads (see `KdaShardedSource.read_into`).
///
/// Raises:
///     ShapeMismatchError: the lengths differ (the message gives both, in bytes).
///     BufferLayoutError: an array is not C-contiguous.
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
