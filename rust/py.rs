//! The PyO3 binding layer (`kda_tp._native`): type and error conversion only; the logic lives in
//! the core modules. The Python package re-exports these names and documents them.
//!
//! One module per concern: [`errors`] (the core's errors as `kda_tp.errors` exceptions),
//! [`tensor`] (`KdaShard`, `KdaTensorPlan`), [`plan`] (`KdaTpPlan` and its argument checks),
//! [`mla`] (`MlaTpPlan`), [`slice`](mod@slice) (the byte slicers on numpy buffers),
//! [`digest`](mod@digest) (the guard's region digests), [`checkpoint`] (`Checkpoint`,
//! `TensorBytes`).

use pyo3::prelude::*;

use crate::quant;

/// `#[pymethods] impl $ty { .. }` (`$ty` wrapping a core value as field `0`) with a `#[getter]`
/// returning `self.0.$field` for each of `fields` and `self.0.$method()` for each of `methods`,
/// then the other methods written out in the braces.
macro_rules! pymethods_with_getters {
    (
        impl $ty:ident {
            fields { $($field:ident: $field_ty:ty),* $(,)? }
            methods { $($method:ident: $method_ty:ty),* $(,)? }
            $($rest:tt)*
        }
    ) => {
        #[pyo3::pymethods]
        impl $ty {
            $(
                #[getter]
                fn $field(&self) -> $field_ty {
                    self.0.$field
                }
            )*
            $(
                #[getter]
                fn $method(&self) -> $method_ty {
                    self.0.$method()
                }
            )*
            $($rest)*
        }
    };
}

mod checkpoint;
mod digest;
mod errors;
mod mla;
mod plan;
mod slice;
mod tensor;

#[pymodule(gil_used = false)]
#[pyo3(name = "_native")]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("QUANTIZABLE", quant::QUANTIZABLE.to_vec())?;
    m.add_class::<tensor::PyKdaShard>()?;
    m.add_class::<tensor::PyTensorPlan>()?;
    m.add_class::<plan::PyPlan>()?;
    m.add_class::<mla::PyMlaPlan>()?;
    m.add_class::<checkpoint::PyTensorBytes>()?;
    m.add_class::<checkpoint::PyWritableBytes>()?;
    m.add_class::<checkpoint::PyCheckpoint>()?;
    m.add_function(wrap_pyfunction!(slice::shard_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(slice::shard_into, m)?)?;
    m.add_function(wrap_pyfunction!(slice::copy_into, m)?)?;
    m.add_function(wrap_pyfunction!(digest::digest, m)?)?;
    m.add_function(wrap_pyfunction!(digest::digest_if_equal, m)?)?;
    Ok(())
}
