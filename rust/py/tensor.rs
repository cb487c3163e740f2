//! `KdaShard` and `KdaTensorPlan`: one tensor's placement for one rank.

use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::plan::{KdaShard, KdaTensorPlan};
use crate::slice;

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
pub(super) enum PyKdaShard {
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
pub(super) struct PyTensorPlan(pub(super) KdaTensorPlan);

pymethods_with_getters! {
    impl PyTensorPlan {
        fields {
            name: &'static str,
            elem_bytes: usize,
            full_rows: usize,
            full_row_elems: usize,
            local_rows: usize,
            local_row_elems: usize,
            src_row_offset: usize,
            src_col_offset: usize,
        }
        methods {
            local_bytes: usize,
            full_bytes: usize,
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
}
