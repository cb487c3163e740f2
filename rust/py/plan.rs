//! `KdaTpPlan`: the per-rank shard plan, and the checks of its Python arguments.

use std::collections::HashMap;

use pyo3::exceptions::PyKeyError;
use pyo3::prelude::*;
use pyo3::types::PyBool;
use safetensors::Dtype;

use super::errors::{plan_error, py_err, PlanError};
use super::tensor::PyTensorPlan;
use crate::plan::{KdaTpPlan, PlanOptions};
use crate::quant::{self, BlockQuant, ScaleLayout};

/// A non-negative integer argument; anything else (a bool included: Python's `True` is an
/// int, and `tp_rank=True` is a bug, not rank 1) is a `PlanError` naming the field.
pub(super) fn size_arg(value: &Bound<'_, PyAny>, field: &str) -> PyResult<usize> {
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

pub(super) fn parse_dtype(tensor: &str, dtype: &str) -> PyResult<Dtype> {
    serde_json::from_value(serde_json::Value::String(dtype.to_string())).map_err(|_| {
        py_err!(
            PlanError,
            format!(
                "{tensor}: unknown dtype {dtype:?} (expected a safetensors dtype such as \"BF16\")"
            ),
            tensor = tensor,
            dtype = dtype,
        )
    })
}

/// The per-rank shard plan for one KDA block (see the Rust `KdaTpPlan`).
#[pyclass(frozen, subclass, name = "KdaTpPlan", module = "kda_tp")]
pub(super) struct PyPlan(KdaTpPlan);

pymethods_with_getters! {
    impl PyPlan {
        fields {
            tp_rank: usize,
            tp_size: usize,
            hidden: usize,
            head_dim: usize,
            full_heads: usize,
            local_heads: usize,
            conv_kernel: usize,
            gate_rank: usize,
            qk_multiple: usize,
            full_rank_gate: bool,
            a_log_len: usize,
        }
        methods {
            local_bytes: usize,
            full_bytes: usize,
            needs_output_all_reduce: bool,
        }
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
            let quant_block = quant_block.map(block_arg).transpose()?;
            let mut options = PlanOptions {
                full_rank_gate,
                ..PlanOptions::default()
            };
            if let Some(len) = a_log_len {
                options.a_log_len = Some(size_arg(len, "a_log_len")?);
            }
            let layout = layout_arg(scale_layout)?;
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
        fn tensors(&self) -> Vec<PyTensorPlan> {
            self.0.tensors.iter().cloned().map(PyTensorPlan).collect()
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
}

/// A `quant_block` argument: a `(rows, cols)` pair of block edges.
pub(super) fn block_arg(block: &Bound<'_, PyAny>) -> PyResult<(usize, usize)> {
    let (rows, cols): (Bound<'_, PyAny>, Bound<'_, PyAny>) = block.extract().map_err(|_| {
        plan_error(
            "quant_block",
            format!(
                "quant_block must be a (rows, cols) pair of block sizes, got {}",
                block.repr().map_or_else(|_| "?".into(), |r| r.to_string())
            ),
        )
    })?;
    Ok((
        size_arg(&rows, "quant_block rows")?,
        size_arg(&cols, "quant_block cols")?,
    ))
}

/// A `scale_layout` argument: `"grid"` or `"modelopt"`.
pub(super) fn layout_arg(scale_layout: &str) -> PyResult<ScaleLayout> {
    match scale_layout {
        "grid" => Ok(ScaleLayout::Grid),
        "modelopt" => Ok(ScaleLayout::ModelOpt),
        other => Err(plan_error(
            "scale_layout",
            format!("scale_layout must be \"grid\" or \"modelopt\", got {other:?}"),
        )),
    }
}
