//! `MlaTpPlan`: the per-rank shard plan of one MLA layer, and the checks of its Python
//! arguments.

use std::collections::HashMap;

use pyo3::exceptions::PyKeyError;
use pyo3::prelude::*;

use super::errors::plan_error;
use super::plan::{block_arg, layout_arg, parse_dtype, size_arg};
use super::tensor::PyTensorPlan;
use crate::mla::{self, IndexerGeometry, MlaGeometry, MlaTpPlan};
use crate::quant::BlockQuant;

/// The per-rank shard plan for one MLA layer (see the Rust `MlaTpPlan`).
#[pyclass(frozen, subclass, name = "MlaTpPlan", module = "kda_tp")]
pub(super) struct PyMlaPlan(MlaTpPlan);

pymethods_with_getters! {
    impl PyMlaPlan {
        fields {
            tp_rank: usize,
            tp_size: usize,
            local_heads: usize,
        }
        methods {
            local_bytes: usize,
            full_bytes: usize,
        }
        #[new]
        #[pyo3(signature = (tp_rank, tp_size, hidden, heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, *, q_lora_rank=None, output_gate=false, indexer=None, dtypes=None, quant_block=None, quantized=None, scale_layout="grid"))]
        #[allow(clippy::too_many_arguments)]
        fn new(
            tp_rank: &Bound<'_, PyAny>,
            tp_size: &Bound<'_, PyAny>,
            hidden: &Bound<'_, PyAny>,
            heads: &Bound<'_, PyAny>,
            kv_lora_rank: &Bound<'_, PyAny>,
            qk_nope_head_dim: &Bound<'_, PyAny>,
            qk_rope_head_dim: &Bound<'_, PyAny>,
            v_head_dim: &Bound<'_, PyAny>,
            q_lora_rank: Option<&Bound<'_, PyAny>>,
            output_gate: bool,
            indexer: Option<&Bound<'_, PyAny>>,
            dtypes: Option<HashMap<String, String>>,
            quant_block: Option<&Bound<'_, PyAny>>,
            quantized: Option<Vec<String>>,
            scale_layout: &str,
        ) -> PyResult<Self> {
            let quant_block = quant_block.map(block_arg).transpose()?;
            let layout = layout_arg(scale_layout)?;
            if quant_block.is_none() && quantized.is_some() {
                return Err(plan_error(
                    "quantized",
                    "quantized= needs quant_block=(rows, cols), the block size".into(),
                ));
            }
            let indexer = match indexer {
                Some(given) => {
                    let (heads, head_dim, kpool): (Bound<'_, PyAny>, Bound<'_, PyAny>, Bound<'_, PyAny>) =
                        given.extract().map_err(|_| {
                            plan_error(
                                "indexer",
                                format!(
                                    "indexer must be an (index_n_heads, index_head_dim, index_kpool) \
                                     triple, got {}",
                                    given.repr().map_or_else(|_| "?".into(), |r| r.to_string())
                                ),
                            )
                        })?;
                    Some(IndexerGeometry {
                        heads: size_arg(&heads, "index_n_heads")?,
                        head_dim: size_arg(&head_dim, "index_head_dim")?,
                        kpool: size_arg(&kpool, "index_kpool")?,
                    })
                }
                None => None,
            };
            let geometry = MlaGeometry {
                hidden: size_arg(hidden, "hidden")?,
                heads: size_arg(heads, "heads")?,
                q_lora_rank: q_lora_rank.map(|q| size_arg(q, "q_lora_rank")).transpose()?,
                kv_lora_rank: size_arg(kv_lora_rank, "kv_lora_rank")?,
                qk_nope_head_dim: size_arg(qk_nope_head_dim, "qk_nope_head_dim")?,
                qk_rope_head_dim: size_arg(qk_rope_head_dim, "qk_rope_head_dim")?,
                v_head_dim: size_arg(v_head_dim, "v_head_dim")?,
                output_gate,
                indexer,
            };
            let mut overrides = Vec::new();
            for (tensor, dtype) in dtypes.unwrap_or_default() {
                let parsed = parse_dtype(&tensor, &dtype)?;
                overrides.push((tensor, parsed));
            }
            let (tp_rank, tp_size) = (size_arg(tp_rank, "tp_rank")?, size_arg(tp_size, "tp_size")?);
            let quant = match quant_block {
                Some((rows, cols)) => Some(BlockQuant {
                    block: [rows, cols],
                    // Default: every projection this layer has.
                    tensors: match quantized {
                        Some(names) => names,
                        None => MlaTpPlan::new(0, 1, geometry, &[])?
                            .names()
                            .into_iter()
                            .filter(|n| mla::QUANTIZABLE.contains(n))
                            .map(str::to_string)
                            .collect(),
                    },
                    layout,
                }),
                None => None,
            };
            Ok(Self(MlaTpPlan::with_quant(
                tp_rank,
                tp_size,
                geometry,
                &overrides,
                quant.as_ref(),
            )?))
        }
        #[getter]
        fn hidden(&self) -> usize {
            self.0.geometry.hidden
        }
        #[getter]
        fn heads(&self) -> usize {
            self.0.geometry.heads
        }
        #[getter]
        fn q_lora_rank(&self) -> Option<usize> {
            self.0.geometry.q_lora_rank
        }
        #[getter]
        fn kv_lora_rank(&self) -> usize {
            self.0.geometry.kv_lora_rank
        }
        #[getter]
        fn qk_nope_head_dim(&self) -> usize {
            self.0.geometry.qk_nope_head_dim
        }
        #[getter]
        fn qk_rope_head_dim(&self) -> usize {
            self.0.geometry.qk_rope_head_dim
        }
        #[getter]
        fn v_head_dim(&self) -> usize {
            self.0.geometry.v_head_dim
        }
        #[getter]
        fn output_gate(&self) -> bool {
            self.0.geometry.output_gate
        }
        #[getter]
        fn indexer(&self) -> Option<(usize, usize, usize)> {
            self.0.geometry.indexer.map(|i| (i.heads, i.head_dim, i.kpool))
        }
        #[getter]
        fn tensors(&self) -> Vec<PyTensorPlan> {
            self.0.tensors.iter().cloned().map(PyTensorPlan).collect()
        }
        /// Plan names of this layer's tensors, in order.
        fn names(&self) -> Vec<&'static str> {
            self.0.names()
        }
        /// The entry for a plan name such as ``"kv_b_proj"``, or None.
        fn get(&self, name: &str) -> Option<PyTensorPlan> {
            self.0.get(name).cloned().map(PyTensorPlan)
        }
        /// The entry for a plan name; raises KeyError listing the plan names when absent.
        fn __getitem__(&self, name: &str) -> PyResult<PyTensorPlan> {
            self.get(name).ok_or_else(|| {
                PyKeyError::new_err(format!(
                    "{name:?} is not an MLA plan name; expected one of {}",
                    self.0.names().join(", ")
                ))
            })
        }
        fn __contains__(&self, name: &str) -> bool {
            self.0.get(name).is_some()
        }
        fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
            other.cast::<PyMlaPlan>().is_ok_and(|o| o.get().0 == self.0)
        }
        fn __repr__(&self) -> String {
            let (p, g) = (&self.0, &self.0.geometry);
            let opt = |v: Option<usize>| v.map_or_else(|| "None".to_string(), |v| v.to_string());
            format!(
                "MlaTpPlan(tp_rank={}, tp_size={}, hidden={}, heads={}, kv_lora_rank={}, \
                 qk_nope_head_dim={}, qk_rope_head_dim={}, v_head_dim={}, q_lora_rank={}, \
                 output_gate={}, indexer={})",
                p.tp_rank,
                p.tp_size,
                g.hidden,
                g.heads,
                g.kv_lora_rank,
                g.qk_nope_head_dim,
                g.qk_rope_head_dim,
                g.v_head_dim,
                opt(g.q_lora_rank),
                if g.output_gate { "True" } else { "False" },
                g.indexer.map_or_else(
                    || "None".to_string(),
                    |i| format!("({}, {}, {})", i.heads, i.head_dim, i.kpool)
                )
            )
        }
    }
}
