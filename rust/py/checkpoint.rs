//! `Checkpoint` (a validated safetensors checkpoint) and `TensorBytes` (a tensor's bytes, shared
//! with numpy without a copy).

use std::collections::HashMap;
use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::UsageError;
use crate::checkpoint::{Backend, Checkpoint, TensorData, WritableData};

/// The raw bytes of one tensor, exposed to numpy through ``__array_interface__`` without a copy.
/// The object keeps the file mapping alive for as long as any array views it.
///
/// Nothing in this process writes these bytes while the object lives (a read-only mapping, or a
/// copy the object owns and never changes; numpy cannot make a view of them writable), which is
/// why the slicers may borrow them with the GIL released (`py/slice.rs`). A file changed by
/// another process under its mapping is the mapping's own hazard, checked at every read
/// (`rust/checkpoint.rs`).
#[pyclass(frozen, name = "TensorBytes", module = "kda_tp._native")]
pub(super) struct PyTensorBytes(TensorData);

#[pymethods]
impl PyTensorBytes {
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let bytes = self.0.as_slice();
        let dict = PyDict::new(py);
        dict.set_item("shape", (bytes.len(),))?;
        dict.set_item("typestr", "|u1")?;
        dict.set_item("data", (bytes.as_ptr() as usize, true))?;
        dict.set_item("version", 3)?;
        Ok(dict)
    }
    fn __len__(&self) -> usize {
        self.0.as_slice().len()
    }
}

/// The bytes of one tensor for a receiver that may write them (``Checkpoint.read_writable``),
/// exposed to numpy as a writable buffer without a copy: a range of the file's copy-on-write
/// mapping (a write copies the page into this process; the file and every read-only view keep
/// the file's bytes), or with pread a copy the object owns. The object keeps them alive for as
/// long as any array views it. Rust code never touches these bytes once handed out.
#[pyclass(frozen, name = "WritableBytes", module = "kda_tp._native")]
pub(super) struct PyWritableBytes(WritableData);

#[pymethods]
impl PyWritableBytes {
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (address, len) = self.0.address();
        let dict = PyDict::new(py);
        dict.set_item("shape", (len,))?;
        dict.set_item("typestr", "|u1")?;
        dict.set_item("data", (address, false))?;
        dict.set_item("version", 3)?;
        Ok(dict)
    }
    fn __len__(&self) -> usize {
        self.0.address().1
    }
}

/// A validated safetensors checkpoint (file or directory); see `kda_tp.SafetensorsSource`.
#[pyclass(frozen, name = "Checkpoint", module = "kda_tp._native")]
pub(super) struct PyCheckpoint(Checkpoint);

#[pymethods]
impl PyCheckpoint {
    #[new]
    #[pyo3(signature = (path, backend="mmap"))]
    fn new(py: Python<'_>, path: PathBuf, backend: &str) -> PyResult<Self> {
        let backend = match backend {
            "mmap" => Backend::Mmap,
            "pread" => Backend::Pread,
            other => {
                return Err(UsageError::new_err(format!(
                    "backend must be \"mmap\" or \"pread\", got {other:?}"
                )))
            }
        };
        Ok(Self(py.detach(|| Checkpoint::open(&path, backend))?))
    }
    #[getter]
    fn root(&self) -> PathBuf {
        self.0.root().to_path_buf()
    }
    fn names(&self) -> Vec<String> {
        self.0.names()
    }
    /// ``(dtype, shape, file_path)`` of a tensor, or None.
    fn info(&self, name: &str) -> Option<(String, Vec<usize>, PathBuf)> {
        self.0.locate(name).map(|(file, info)| {
            (
                info.dtype.to_string(),
                info.shape.clone(),
                file.path().to_path_buf(),
            )
        })
    }
    /// The raw bytes of a tensor, or of bytes ``[start, stop)`` of it (read alone with pread).
    #[pyo3(signature = (name, start=0, stop=None))]
    fn read(
        &self,
        py: Python<'_>,
        name: &str,
        start: usize,
        stop: Option<usize>,
    ) -> PyResult<PyTensorBytes> {
        let part = start..stop.unwrap_or(usize::MAX);
        Ok(PyTensorBytes(py.detach(|| self.0.read_range(name, part))?))
    }
    /// Bytes ``[start, stop)`` of a tensor as a writable buffer: a range of the file's
    /// copy-on-write mapping (mmap; no copy until a page is written) or a fresh copy (pread).
    #[pyo3(signature = (name, start=0, stop=None))]
    fn read_writable(
        &self,
        py: Python<'_>,
        name: &str,
        start: usize,
        stop: Option<usize>,
    ) -> PyResult<PyWritableBytes> {
        let part = start..stop.unwrap_or(usize::MAX);
        Ok(PyWritableBytes(
            py.detach(|| self.0.read_writable(name, part))?,
        ))
    }
    /// ``count`` spans of ``span`` bytes of a tensor, ``stride`` bytes apart from byte
    /// ``start``, concatenated (a column block of a row-major matrix); with pread only those
    /// bytes are read.
    fn read_spans(
        &self,
        py: Python<'_>,
        name: &str,
        start: usize,
        span: usize,
        stride: usize,
        count: usize,
    ) -> PyResult<PyTensorBytes> {
        Ok(PyTensorBytes(py.detach(|| {
            self.0.read_spans(name, start, span, stride, count)
        })?))
    }
    /// Bytes read from the files with read calls: headers, and with pread tensor data.
    #[getter]
    fn bytes_read(&self) -> u64 {
        self.0.bytes_read()
    }
    /// ``(fd, start, stop)``: the open file descriptor holding a tensor and the absolute byte
    /// range ``[start, stop)`` in that file of bytes ``[part_start, part_stop)`` of the tensor
    /// (``part_stop`` clamped to its length), for kernel-side copies (``os.copy_file_range``).
    /// The descriptor belongs to this object: use it only while the checkpoint is open, never
    /// close it. None for an unknown name or a part starting past the tensor; CheckpointError
    /// when the file changed since it was opened.
    #[cfg(unix)]
    #[pyo3(signature = (name, part_start=0, part_stop=None))]
    fn file_range(
        &self,
        name: &str,
        part_start: usize,
        part_stop: Option<usize>,
    ) -> PyResult<Option<(i32, u64, u64)>> {
        use std::os::fd::AsRawFd;
        let Some((file, _)) = self.0.locate(name) else {
            return Ok(None);
        };
        let part = part_start..part_stop.unwrap_or(usize::MAX);
        Ok(file
            .file_range(name, part)?
            .map(|(handle, range)| (handle.as_raw_fd(), range.start, range.end)))
    }
    /// Drops this process's resident pages of a tensor (mmap only); views stay valid.
    fn release(&self, py: Python<'_>, name: &str) {
        py.detach(|| self.0.release(name));
    }
    /// ``[(file_path, user_metadata or None, mapping (start, stop) or None)]`` per file.
    #[allow(clippy::type_complexity)]
    fn files(
        &self,
    ) -> Vec<(
        PathBuf,
        Option<HashMap<String, String>>,
        Option<(usize, usize)>,
    )> {
        self.0
            .files()
            .iter()
            .map(|f| {
                (
                    f.path().to_path_buf(),
                    f.user_metadata().cloned(),
                    f.mapping().map(|r| (r.start, r.end)),
                )
            })
            .collect()
    }
}
