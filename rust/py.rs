//! The PyO3 binding layer (`kda_tp._native`): type and error conversion only; the logic lives in
//! the core modules. The Python package re-exports these names and documents them.

use std::collections::HashMap;
use std::path::PathBuf;

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyReadwriteArray1};
use pyo3::exceptions::PyKeyError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PySlice, PyTuple};
use pyo3::PyTypeInfo;
use safetensors::Dtype;

use crate::checkpoint::{Backend, Checkpoint, TensorData};
use crate::error::{divisors, Error};
use crate::pages;
use crate::plan::{allowed_tp_sizes, KdaShard, KdaTensorPlan, KdaTpPlan, PlanOptions};
use crate::quant::{self, BlockQuant, ScaleLayout};
use crate::slice;

pyo3::import_exception!(kda_tp.errors, PlanError);
pyo3::import_exception!(kda_tp.errors, ShapeMismatchError);
pyo3::import_exception!(kda_tp.errors, CheckpointError);
pyo3::import_exception!(kda_tp.errors, BufferLayoutError);
pyo3::import_exception!(kda_tp.errors, UsageError);

/// An exception of class `E` (a `kda_tp.errors` class) with `message` and the keyword fields
/// that `fields` sets, which its `__init__` stores as attributes.
fn error_with<E: PyTypeInfo>(
    message: String,
    fields: impl FnOnce(&Bound<'_, PyDict>) -> PyResult<()>,
) -> PyErr {
    Python::attach(|py| {
        let build = || -> PyResult<PyErr> {
            let kwargs = PyDict::new(py);
            fields(&kwargs)?;
            let value = E::type_object(py).call((message,), Some(&kwargs))?;
            Ok(PyErr::from_value(value))
        };
        // Building the exception failed (out of memory): raise that instead.
        build().unwrap_or_else(|failed| failed)
    })
}

/// A `PlanError` naming the argument `field` that was refused.
fn plan_error(field: &str, message: String) -> PyErr {
    error_with::<PlanError>(message, |f| f.set_item("field", field))
}

/// The world sizes passing the rules for this geometry, and the head count's divisors (the
/// sizes with no q|k rule), as the attributes of a `PlanError` about `tp_size`.
fn set_tp_sizes(
    f: &Bound<'_, PyDict>,
    heads: usize,
    head_dim: usize,
    qk_multiple: usize,
    tp_size: usize,
) -> PyResult<()> {
    f.set_item("tp_size", tp_size)?;
    f.set_item("heads", heads)?;
    f.set_item("head_dim", head_dim)?;
    f.set_item("qk_multiple", qk_multiple)?;
    let tuple = |sizes: Option<Vec<usize>>| sizes.map(|s| PyTuple::new(f.py(), s)).transpose();
    f.set_item(
        "allowed_tp_sizes",
        tuple(allowed_tp_sizes(heads, head_dim, qk_multiple))?,
    )?;
    f.set_item("head_divisors", tuple(divisors(heads))?)
}

/// Each variant becomes its `kda_tp.errors` class, with the variant's fields as keyword
/// arguments (attributes); the message is the variant's `Display`, unchanged.
impl From<Error> for PyErr {
    fn from(err: Error) -> PyErr {
        let message = err.to_string();
        match err {
            Error::RankOutOfRange { tp_rank, tp_size } => error_with::<PlanError>(message, |f| {
                f.set_item("tp_rank", tp_rank)?;
                f.set_item("tp_size", tp_size)
            }),
            Error::ZeroSize { field } => plan_error(field, message),
            Error::HeadsNotDivisible {
                heads,
                tp_size,
                head_dim,
                qk_multiple,
            } => error_with::<PlanError>(message, |f| {
                set_tp_sizes(f, heads, head_dim, qk_multiple, tp_size)
            }),
            Error::QkWidth {
                multiple,
                head_dim,
                heads,
                tp_size,
                ..
            } => error_with::<PlanError>(message, |f| {
                set_tp_sizes(f, heads, head_dim, multiple, tp_size)
            }),
            Error::ALogLength { heads, .. } => error_with::<PlanError>(message, |f| {
                f.set_item("field", "a_log_len")?;
                f.set_item("heads", heads)
            }),
            Error::BlockSize { .. } => plan_error("block", message),
            Error::NotQuantizable { tensor }
            | Error::Overflow { tensor }
            | Error::BlockSplit { tensor, .. }
            | Error::UnknownTensor { name: tensor, .. } => {
                error_with::<PlanError>(message, |f| f.set_item("tensor", tensor))
            }
            Error::UnsupportedDtype { tensor, dtype } => error_with::<PlanError>(message, |f| {
                f.set_item("tensor", tensor)?;
                f.set_item("dtype", dtype)
            }),
            Error::BufferSize {
                tensor,
                actual,
                expected,
                ..
            } => error_with::<ShapeMismatchError>(message, |f| {
                f.set_item("tensor", tensor)?;
                f.set_item("expected_bytes", expected)?;
                f.set_item("actual_bytes", actual)
            }),
            Error::Shape {
                tensor,
                actual,
                example,
                ..
            } => error_with::<ShapeMismatchError>(message, |f| {
                f.set_item("tensor", tensor)?;
                f.set_item("expected_shape", PyTuple::new(f.py(), example)?)?;
                f.set_item("actual_shape", PyTuple::new(f.py(), actual)?)
            }),
            Error::TensorNotFound { path, name } => error_with::<CheckpointError>(message, |f| {
                f.set_item("path", path)?;
                f.set_item("tensor", name)
            }),
            Error::Io { path, .. }
            | Error::Safetensors { path, .. }
            | Error::Checkpoint { path, .. } => {
                error_with::<CheckpointError>(message, |f| f.set_item("path", path))
            }
        }
    }
}

/// How one KDA tensor maps onto tensor-parallel ranks.
///
/// REPLICATED: every rank holds the whole tensor (f_a_proj, g_a_proj, o_norm).
/// HEAD_ROWS: the leading dimension is heads; each rank keeps its head range (b_proj, A_log).
/// CHANNEL_ROWS: the leading dimension is heads * head_dim; each rank keeps its channel range
/// (column-parallel: q/k/v_proj, q/k/v_conv1d, f_b_proj, g_b_proj, dt_bias).
/// CHANNEL_COLS: the trailing (input) dimension is heads * head_dim; each rank keeps every row's
/// channel range and its output is all-reduced (row-parallel: o_proj).
#[pyclass(eq, eq_int, frozen, hash, name = "KdaShard", module = "kda_tp")]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum PyKdaShard {
    #[pyo3(name = "REPLICATED")]
    Replicated,
    #[pyo3(name = "HEAD_ROWS")]
    HeadRows,
    #[pyo3(name = "CHANNEL_ROWS")]
    ChannelRows,
    #[pyo3(name = "CHANNEL_COLS")]
    ChannelCols,
}

#[pymethods]
impl PyKdaShard {
    /// The member's name, e.g. ``"CHANNEL_COLS"``.
    #[getter]
    fn name(&self) -> &'static str {
        match self {
            Self::Replicated => "REPLICATED",
            Self::HeadRows => "HEAD_ROWS",
            Self::ChannelRows => "CHANNEL_ROWS",
            Self::ChannelCols => "CHANNEL_COLS",
        }
    }
}

impl From<KdaShard> for PyKdaShard {
    fn from(kind: KdaShard) -> Self {
        match kind {
            KdaShard::Replicated => Self::Replicated,
            KdaShard::HeadRows => Self::HeadRows,
            KdaShard::ChannelRows => Self::ChannelRows,
            KdaShard::ChannelCols => Self::ChannelCols,
        }
    }
}

/// One tensor's placement for one rank, in a flat ``[rows, row_elems]`` view of the on-disk tensor.
///
/// Counts are elements unless the name says bytes. For CHANNEL_COLS the sharded axis is
/// ``row_elems`` (columns); for the row kinds it is ``rows``.
///
/// Attributes:
///     name: plan name, e.g. ``"q_proj"`` (checkpoint name without layer prefix and ``.weight``).
///     kind: a ``KdaShard``.
///     dtype: safetensors dtype name, e.g. ``"BF16"``; elem_bytes: bytes per element.
///     full_rows, full_row_elems: the full tensor as ``[rows, row_elems]``.
///     local_rows, local_row_elems: this rank's part.
///     src_row_offset: first row of this rank's slice (0 for REPLICATED and CHANNEL_COLS).
///     src_col_offset: first element of this rank's column slice (CHANNEL_COLS only, else 0).
///     local_bytes, full_bytes: byte sizes of this rank's part and of the full tensor.
///     disk_shape: the full shape as Kimi-Linear stores it, e.g. ``(1, 1, H, 1)`` for A_log.
///     byte_range: ``(start, stop)`` byte range of this rank's part in the full tensor, or None
///         for CHANNEL_COLS (a strided gather, not one range).
///     block: ``(rows, cols)`` block edge in elements when the weight is block-quantized (FP8),
///         else None.
///     scale: the ``KdaTensorPlan`` of a block-quantized weight's scale grid (F32), else None:
///         same kind as the weight, rows/columns counted in blocks, ``src_row_offset`` /
///         ``src_col_offset`` the first block this rank keeps (the blocks covering its range),
///         ``disk_shape`` ``(ob, 1, ib, 1)`` (ModelOpt) or ``(ob, ib)``.
#[pyclass(frozen, eq, name = "KdaTensorPlan", module = "kda_tp")]
#[derive(PartialEq)]
struct PyTensorPlan(KdaTensorPlan);

#[pymethods]
impl PyTensorPlan {
    #[getter]
    fn name(&self) -> &'static str {
        self.0.name
    }
    #[getter]
    fn kind(&self) -> PyKdaShard {
        self.0.kind.into()
    }
    #[getter]
    fn dtype(&self) -> String {
        self.0.dtype.to_string()
    }
    #[getter]
    fn elem_bytes(&self) -> usize {
        self.0.elem_bytes
    }
    #[getter]
    fn full_rows(&self) -> usize {
        self.0.full_rows
    }
    #[getter]
    fn full_row_elems(&self) -> usize {
        self.0.full_row_elems
    }
    #[getter]
    fn local_rows(&self) -> usize {
        self.0.local_rows
    }
    #[getter]
    fn local_row_elems(&self) -> usize {
        self.0.local_row_elems
    }
    #[getter]
    fn src_row_offset(&self) -> usize {
        self.0.src_row_offset
    }
    #[getter]
    fn src_col_offset(&self) -> usize {
        self.0.src_col_offset
    }
    #[getter]
    fn local_bytes(&self) -> usize {
        self.0.local_bytes()
    }
    #[getter]
    fn full_bytes(&self) -> usize {
        self.0.full_bytes()
    }
    #[getter]
    fn disk_shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.0.disk_shape)
    }
    #[getter]
    fn byte_range(&self) -> Option<(usize, usize)> {
        slice::row_byte_range(&self.0).map(|r| (r.start, r.end))
    }
    #[getter]
    fn block(&self) -> Option<(usize, usize)> {
        self.0.block.map(|[rows, cols]| (rows, cols))
    }
    #[getter]
    fn scale(&self) -> Option<PyTensorPlan> {
        self.0.scale.as_deref().cloned().map(PyTensorPlan)
    }
    /// The on-disk axis sharded in a tensor stored with shape ``disk_shape`` (None when
    /// replicated): for the row kinds the first axis of extent ``full_rows`` after only unit
    /// axes (``(1, 1, H, 1)`` -> 2, ``(H,)`` -> 0, ``(C, 1, K)`` -> 0), for CHANNEL_COLS the last.
    ///
    /// Raises:
    ///     ShapeMismatchError: ``disk_shape`` does not hold exactly this tensor.
    fn sharded_axis(&self, disk_shape: Vec<usize>) -> PyResult<Option<usize>> {
        Ok(self.0.sharded_axis(&disk_shape)?)
    }
    /// This rank's shape of a tensor stored as ``disk_shape``: the same rank (number of
    /// dimensions), with the sharded axis reduced, e.g. ``(8192, 1, 4)`` -> ``(4096, 1, 4)``.
    ///
    /// Raises:
    ///     ShapeMismatchError: ``disk_shape`` does not hold exactly this tensor.
    fn local_shape<'py>(
        &self,
        py: Python<'py>,
        disk_shape: Vec<usize>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.0.local_shape(&disk_shape)?)
    }
    fn __repr__(&self) -> String {
        let t = &self.0;
        format!(
            "KdaTensorPlan(name={:?}, kind={}, dtype={}, full=[{}, {}], local=[{}, {}], \
             src_row_offset={}, src_col_offset={})",
            t.name,
            PyKdaShard::from(t.kind).name(),
            t.dtype,
            t.full_rows,
            t.full_row_elems,
            t.local_rows,
            t.local_row_elems,
            t.src_row_offset,
            t.src_col_offset
        )
    }
}

/// A non-negative integer argument; anything else (a bool included: Python's `True` is an
/// int, and `tp_rank=True` is a bug, not rank 1) is a `PlanError` naming the field.
fn size_arg(value: &Bound<'_, PyAny>, field: &str) -> PyResult<usize> {
    let refused = || {
        plan_error(
            field,
            format!(
                "{field} must be a non-negative integer that fits in 64 bits, got {}",
                value.repr().map_or_else(|_| "?".into(), |r| r.to_string())
            ),
        )
    };
    if value.is_instance_of::<PyBool>() {
        return Err(refused());
    }
    value.extract::<usize>().map_err(|_| refused())
}

fn parse_dtype(tensor: &str, dtype: &str) -> PyResult<Dtype> {
    serde_json::from_value(serde_json::Value::String(dtype.to_string())).map_err(|_| {
        error_with::<PlanError>(
            format!(
                "{tensor}: unknown dtype {dtype:?} (expected a safetensors dtype such as \"BF16\")"
            ),
            |f| {
                f.set_item("tensor", tensor)?;
                f.set_item("dtype", dtype)
            },
        )
    })
}

/// The per-rank shard plan for one KDA block (see the Rust `KdaTpPlan`).
#[pyclass(frozen, subclass, name = "KdaTpPlan", module = "kda_tp")]
struct PyPlan(KdaTpPlan);

#[pymethods]
impl PyPlan {
    #[new]
    #[pyo3(signature = (tp_rank, tp_size, hidden, head_dim, full_heads, conv_kernel, gate_rank, *, qk_multiple=None, dtypes=None, full_rank_gate=false, a_log_len=None, quant_block=None, quantized=None, scale_layout="grid"))]
    // What help() and inspect.signature() show: `None` above only means "not passed", which
    // becomes PlanOptions::default()'s 256 (tests/integration/test_types.py checks the two agree).
    #[pyo3(
        text_signature = "(tp_rank, tp_size, hidden, head_dim, full_heads, conv_kernel, gate_rank, *, qk_multiple=256, dtypes=None, full_rank_gate=False, a_log_len=None, quant_block=None, quantized=None, scale_layout='grid')"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        tp_rank: &Bound<'_, PyAny>,
        tp_size: &Bound<'_, PyAny>,
        hidden: &Bound<'_, PyAny>,
        head_dim: &Bound<'_, PyAny>,
        full_heads: &Bound<'_, PyAny>,
        conv_kernel: &Bound<'_, PyAny>,
        gate_rank: &Bound<'_, PyAny>,
        qk_multiple: Option<&Bound<'_, PyAny>>,
        dtypes: Option<HashMap<String, String>>,
        full_rank_gate: bool,
        a_log_len: Option<&Bound<'_, PyAny>>,
        quant_block: Option<&Bound<'_, PyAny>>,
        quantized: Option<Vec<String>>,
        scale_layout: &str,
    ) -> PyResult<Self> {
        let quant_block = match quant_block {
            Some(block) => {
                let (rows, cols): (Bound<'_, PyAny>, Bound<'_, PyAny>) =
                    block.extract().map_err(|_| {
                        plan_error(
                            "quant_block",
                            format!(
                                "quant_block must be a (rows, cols) pair of block sizes, got {}",
                                block.repr().map_or_else(|_| "?".into(), |r| r.to_string())
                            ),
                        )
                    })?;
                Some((
                    size_arg(&rows, "quant_block rows")?,
                    size_arg(&cols, "quant_block cols")?,
                ))
            }
            None => None,
        };
        let mut options = PlanOptions {
            full_rank_gate,
            ..PlanOptions::default()
        };
        if let Some(len) = a_log_len {
            options.a_log_len = Some(size_arg(len, "a_log_len")?);
        }
        let layout = match scale_layout {
            "grid" => ScaleLayout::Grid,
            "modelopt" => ScaleLayout::ModelOpt,
            other => {
                return Err(plan_error(
                    "scale_layout",
                    format!("scale_layout must be \"grid\" or \"modelopt\", got {other:?}"),
                ))
            }
        };
        options.block_quant = match (quant_block, quantized) {
            (Some((rows, cols)), names) => Some(BlockQuant {
                block: [rows, cols],
                tensors: names.unwrap_or_else(|| quant::projections(full_rank_gate)),
                layout,
            }),
            (None, Some(_)) => {
                return Err(plan_error(
                    "quantized",
                    "quantized= needs quant_block=(rows, cols), the block size".into(),
                ))
            }
            (None, None) => None,
        };
        if let Some(multiple) = qk_multiple {
            options.qk_multiple = size_arg(multiple, "qk_multiple")?;
        }
        for (tensor, dtype) in dtypes.unwrap_or_default() {
            let parsed = parse_dtype(&tensor, &dtype)?;
            options.dtypes.push((tensor, parsed));
        }
        Ok(Self(KdaTpPlan::with_options(
            size_arg(tp_rank, "tp_rank")?,
            size_arg(tp_size, "tp_size")?,
            size_arg(hidden, "hidden")?,
            size_arg(head_dim, "head_dim")?,
            size_arg(full_heads, "full_heads")?,
            size_arg(conv_kernel, "conv_kernel")?,
            size_arg(gate_rank, "gate_rank")?,
            &options,
        )?))
    }
    #[getter]
    fn tp_rank(&self) -> usize {
        self.0.tp_rank
    }
    #[getter]
    fn tp_size(&self) -> usize {
        self.0.tp_size
    }
    #[getter]
    fn hidden(&self) -> usize {
        self.0.hidden
    }
    #[getter]
    fn head_dim(&self) -> usize {
        self.0.head_dim
    }
    #[getter]
    fn full_heads(&self) -> usize {
        self.0.full_heads
    }
    #[getter]
    fn local_heads(&self) -> usize {
        self.0.local_heads
    }
    #[getter]
    fn conv_kernel(&self) -> usize {
        self.0.conv_kernel
    }
    #[getter]
    fn gate_rank(&self) -> usize {
        self.0.gate_rank
    }
    #[getter]
    fn qk_multiple(&self) -> usize {
        self.0.qk_multiple
    }
    #[getter]
    fn full_rank_gate(&self) -> bool {
        self.0.full_rank_gate
    }
    #[getter]
    fn a_log_len(&self) -> usize {
        self.0.a_log_len
    }
    #[getter]
    fn tensors(&self) -> Vec<PyTensorPlan> {
        self.0.tensors.iter().cloned().map(PyTensorPlan).collect()
    }
    #[getter]
    fn local_bytes(&self) -> usize {
        self.0.local_bytes()
    }
    #[getter]
    fn full_bytes(&self) -> usize {
        self.0.full_bytes()
    }
    #[getter]
    fn needs_output_all_reduce(&self) -> bool {
        self.0.needs_output_all_reduce()
    }
    /// The entry for a plan name such as ``"q_proj"`` or ``"A_log"``, or None.
    fn get(&self, name: &str) -> Option<PyTensorPlan> {
        self.0.get(name).cloned().map(PyTensorPlan)
    }
    /// The entry for a plan name; raises KeyError listing the plan names when absent.
    fn __getitem__(&self, name: &str) -> PyResult<PyTensorPlan> {
        self.get(name).ok_or_else(|| {
            PyKeyError::new_err(format!(
                "{name:?} is not a KDA plan name; expected one of {}",
                self.0.names().join(", ")
            ))
        })
    }
    fn __contains__(&self, name: &str) -> bool {
        self.0.get(name).is_some()
    }
    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.cast::<PyPlan>().is_ok_and(|o| o.get().0 == self.0)
    }
    fn __repr__(&self) -> String {
        let p = &self.0;
        format!(
            "KdaTpPlan(tp_rank={}, tp_size={}, hidden={}, head_dim={}, full_heads={}, \
             conv_kernel={}, gate_rank={}, qk_multiple={}, full_rank_gate={}, a_log_len={})",
            p.tp_rank,
            p.tp_size,
            p.hidden,
            p.head_dim,
            p.full_heads,
            p.conv_kernel,
            p.gate_rank,
            p.qk_multiple,
            if p.full_rank_gate { "True" } else { "False" },
            p.a_log_len
        )
    }
}

/// This rank's bytes of one full tensor held in a 1-D uint8 array (see `kda_tp.shard_bytes`).
#[pyfunction]
fn shard_bytes<'py>(
    py: Python<'py>,
    plan: &PyTensorPlan,
    full: PyReadonlyArray1<'py, u8>,
) -> PyResult<Bound<'py, PyAny>> {
    let src = full
        .as_slice()
        .map_err(|_| BufferLayoutError::new_err("the buffer must be C-contiguous"))?;
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
fn shard_into(
    py: Python<'_>,
    plan: &PyTensorPlan,
    full: PyReadonlyArray1<'_, u8>,
    mut out: PyReadwriteArray1<'_, u8>,
) -> PyResult<()> {
    let src = contiguous(full.as_slice())?;
    let dst = out
        .as_slice_mut()
        .map_err(|_| BufferLayoutError::new_err("the output buffer must be C-contiguous"))?;
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
fn copy_into(
    py: Python<'_>,
    src: PyReadonlyArray1<'_, u8>,
    mut out: PyReadwriteArray1<'_, u8>,
) -> PyResult<()> {
    let src = contiguous(src.as_slice())?;
    let dst = out
        .as_slice_mut()
        .map_err(|_| BufferLayoutError::new_err("the output buffer must be C-contiguous"))?;
    if src.len() != dst.len() {
        let message = format!(
            "the output buffer is {} bytes, the source is {} bytes",
            dst.len(),
            src.len()
        );
        return Err(error_with::<ShapeMismatchError>(message, |f| {
            f.set_item("expected_bytes", src.len())?;
            f.set_item("actual_bytes", dst.len())
        }));
    }
    py.detach(|| slice::copy_parallel(src, dst));
    Ok(())
}

fn contiguous<T, E>(slice: Result<T, E>) -> PyResult<T> {
    slice.map_err(|_| BufferLayoutError::new_err("the buffer must be C-contiguous"))
}

/// The raw bytes of one tensor, exposed to numpy through ``__array_interface__`` without a copy.
/// The object keeps the file mapping alive for as long as any array views it.
#[pyclass(frozen, name = "TensorBytes", module = "kda_tp._native")]
struct PyTensorBytes(TensorData);

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

/// A validated safetensors checkpoint (file or directory); see `kda_tp.SafetensorsSource`.
#[pyclass(frozen, name = "Checkpoint", module = "kda_tp._native")]
struct PyCheckpoint(Checkpoint);

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
    /// close it. None for an unknown name or a part starting past the tensor.
    #[cfg(unix)]
    #[pyo3(signature = (name, part_start=0, part_stop=None))]
    fn file_range(
        &self,
        name: &str,
        part_start: usize,
        part_stop: Option<usize>,
    ) -> Option<(i32, u64, u64)> {
        use std::os::fd::AsRawFd;
        let (file, _) = self.0.locate(name)?;
        let part = part_start..part_stop.unwrap_or(usize::MAX);
        let (handle, range) = file.file_range(name, part)?;
        Some((handle.as_raw_fd(), range.start, range.end))
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

#[pymodule(gil_used = false)]
#[pyo3(name = "_native")]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("QUANTIZABLE", quant::QUANTIZABLE.to_vec())?;
    m.add_class::<PyKdaShard>()?;
    m.add_class::<PyTensorPlan>()?;
    m.add_class::<PyPlan>()?;
    m.add_class::<PyTensorBytes>()?;
    m.add_class::<PyCheckpoint>()?;
    m.add_function(wrap_pyfunction!(shard_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(shard_into, m)?)?;
    m.add_function(wrap_pyfunction!(copy_into, m)?)?;
    Ok(())
}
