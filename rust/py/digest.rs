//! `digest` and `digest_if_equal` on numpy buffers: the guard's exact region digests ([`crate::digest`]), with the GIL
//! released.
//!
//! The buffers are borrowed read-only for the call (numpy's borrow flag stops Rust code using
//! rust-numpy from writing it meanwhile). Python code writing it from another thread during
//! the call is the caller's to prevent: the digest is then of some mix of the old and new
//! bytes, as a numpy copy made meanwhile would be.

use numpy::PyReadonlyArray1;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::errors::BufferLayoutError;
use crate::digest as exact;

/// The 16-byte digest (XXH3-128 over 1 MiB chunks hashed in parallel, combined in order) of a
/// C-contiguous 1-D uint8 array's bytes, every byte read, the GIL released.
///
/// Raises:
///     BufferLayoutError: the array is not C-contiguous.
#[pyfunction]
pub(super) fn digest<'py>(
    py: Python<'py>,
    data: PyReadonlyArray1<'py, u8>,
) -> PyResult<Bound<'py, PyBytes>> {
    let bytes = data
        .as_slice()
        .map_err(|_| BufferLayoutError::new_err("the buffer must be C-contiguous"))?;
    let found = py.detach(|| exact::digest(bytes));
    Ok(PyBytes::new(py, &found))
}

/// ``data``'s digest (as ``digest`` gives it) when ``data`` and ``expected`` (C-contiguous 1-D
/// uint8 arrays) hold the same bytes, in one pass over both; None when they differ anywhere
/// (their lengths included). The GIL is released.
///
/// Raises:
///     BufferLayoutError: an array is not C-contiguous.
#[pyfunction]
pub(super) fn digest_if_equal<'py>(
    py: Python<'py>,
    data: PyReadonlyArray1<'py, u8>,
    expected: PyReadonlyArray1<'py, u8>,
) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let layout = |_| BufferLayoutError::new_err("the buffers must be C-contiguous");
    let (bytes, want) = (
        data.as_slice().map_err(layout)?,
        expected.as_slice().map_err(layout)?,
    );
    let found = py.detach(|| exact::digest_if_equal(bytes, want));
    Ok(found.map(|d| PyBytes::new(py, &d)))
}
