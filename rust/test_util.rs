//! Helpers shared by the unit tests of several modules (compiled for tests only).

/// The fields `$field, ..` of the error variant `Error::$variant` in `$result` (a `Result`), as
/// a tuple in the order given (one field: the field itself); panics on anything else, naming
/// the variant expected and what came instead.
macro_rules! error_fields {
    ($result:expr, $variant:ident { $($field:ident),+ $(,)? }) => {
        match $result {
            Err($crate::error::Error::$variant { $($field,)+ .. }) => ($($field),+),
            other => panic!(concat!("expected ", stringify!($variant), ", got {:?}"), other),
        }
    };
}
