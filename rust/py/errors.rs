//! The core's [`Error`] as `kda_tp.errors` exceptions, each variant's fields as attributes.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use pyo3::PyTypeInfo;

use crate::error::{divisors, Error};
use crate::plan::allowed_tp_sizes;

pyo3::import_exception!(kda_tp.errors, PlanError);
pyo3::import_exception!(kda_tp.errors, ShapeMismatchError);
pyo3::import_exception!(kda_tp.errors, CheckpointError);
pyo3::import_exception!(kda_tp.errors, BufferLayoutError);
pyo3::import_exception!(kda_tp.errors, UsageError);

/// An exception of class `E` (a `kda_tp.errors` class) with `message` and the keyword fields
/// that `fields` sets, which its `__init__` stores as attributes.
pub(super) fn error_with<E: PyTypeInfo>(
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

/// `error_with::<$class>($message, ..)` setting each `key = value` as the keyword field `key`.
macro_rules! py_err {
    ($class:ty, $message:expr $(, $key:ident = $value:expr)+ $(,)?) => {
        $crate::py::errors::error_with::<$class>($message, |f| {
            $(f.set_item(stringify!($key), $value)?;)+
            Ok(())
        })
    };
}
pub(super) use py_err;

/// A `PlanError` naming the argument `field` that was refused.
pub(super) fn plan_error(field: &str, message: String) -> PyErr {
    py_err!(PlanError, message, field = field)
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
            Error::RankOutOfRange { tp_rank, tp_size } => {
                py_err!(PlanError, message, tp_rank = tp_rank, tp_size = tp_size)
            }
            Error::ZeroSize { field } => plan_error(field, message),
            Error::HeadsNotDivisible {
                heads,
                tp_size,
                head_dim,
                qk_multiple,
            }
            | Error::QkWidth {
                multiple: qk_multiple,
                head_dim,
                heads,
                tp_size,
                ..
            } => error_with::<PlanError>(message, |f| {
                set_tp_sizes(f, heads, head_dim, qk_multiple, tp_size)
            }),
            Error::ALogLength { heads, .. } => {
                py_err!(PlanError, message, field = "a_log_len", heads = heads)
            }
            Error::MlaZeroSize { field } => plan_error(field, message),
            Error::MlaHeadsNotDivisible { heads, tp_size } => {
                error_with::<PlanError>(message, |f| {
                    f.set_item("tp_size", tp_size)?;
                    f.set_item("heads", heads)?;
                    let sizes = divisors(heads)
                        .map(|s| PyTuple::new(f.py(), s))
                        .transpose()?;
                    f.set_item("allowed_tp_sizes", sizes.clone())?;
                    f.set_item("head_divisors", sizes)
                })
            }
            Error::MlaUnknownTensor { name, .. } => py_err!(PlanError, message, tensor = name),
            Error::MlaUnsupportedDtype { tensor, dtype } => {
                py_err!(PlanError, message, tensor = tensor, dtype = dtype)
            }
            Error::MlaNotQuantizable { tensor } => py_err!(PlanError, message, tensor = tensor),
            // The rank, its offsets and the block edge are in the message (a `tp_rank` field
            // would say the rank is out of range).
            Error::MlaBlockSplit {
                tensor,
                tp_size,
                allowed,
                ..
            } => error_with::<PlanError>(message, |f| {
                f.set_item("tensor", tensor)?;
                f.set_item("tp_size", tp_size)?;
                f.set_item("allowed_tp_sizes", PyTuple::new(f.py(), allowed)?)
            }),
            Error::BlockSize { .. } => plan_error("block", message),
            Error::NotQuantizable { tensor }
            | Error::Overflow { tensor }
            | Error::BlockSplit { tensor, .. }
            | Error::UnknownTensor { name: tensor, .. } => {
                py_err!(PlanError, message, tensor = tensor)
            }
            Error::UnsupportedDtype { tensor, dtype } => {
                py_err!(PlanError, message, tensor = tensor, dtype = dtype)
            }
            Error::BufferSize {
                tensor,
                actual,
                expected,
                ..
            } => py_err!(
                ShapeMismatchError,
                message,
                tensor = tensor,
                expected_bytes = expected,
                actual_bytes = actual,
            ),
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
            Error::TensorNotFound { path, name } => {
                py_err!(CheckpointError, message, path = path, tensor = name)
            }
            Error::Io { path, .. }
            | Error::Safetensors { path, .. }
            | Error::Checkpoint { path, .. } => py_err!(CheckpointError, message, path = path),
        }
    }
}
