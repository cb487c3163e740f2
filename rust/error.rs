//! The one error type of the core. Every variant carries the numbers a user needs to fix the input;
//! the Python binding maps each variant to a class of `kda_tp.errors`.

use std::path::PathBuf;

/// Everything the core can refuse. Nothing a caller passes in makes the core panic.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `tp_rank` is not below `tp_size`.
    #[error("tp_rank {tp_rank} >= tp_size {tp_size}")]
    RankOutOfRange { tp_rank: usize, tp_size: usize },

    /// A geometry field that must be positive is zero.
    #[error("degenerate KDA TP geometry: {field} is 0")]
    ZeroSize { field: &'static str },

    /// The head count does not split evenly over the ranks.
    #[error(
        "KDA TP requires heads ({heads}) divisible by tp_size ({tp_size}); tp_size may be one of \
         {}",
        divisors(*heads)
    )]
    HeadsNotDivisible { heads: usize, tp_size: usize },

    /// The local q|k width breaks the kernel's channel-multiple rule.
    #[error(
        "KDA TP: local qk_channels ({channels}) must be a multiple of {multiple} \
         (local heads={local_heads}, head_dim={head_dim}); the fused causal_conv1d + L2-norm \
         kernel handles 2 heads per 256-thread block (pass qk_multiple=1 to switch the rule off)"
    )]
    QkWidth {
        channels: usize,
        multiple: usize,
        local_heads: usize,
        head_dim: usize,
    },

    /// A stored `A_log` length shorter than the head count.
    #[error("A_log stores {len} entries, fewer than the {heads} heads")]
    ALogLength { len: usize, heads: usize },

    /// A size computed from the geometry does not fit in the address space.
    #[error("KDA TP geometry too large: {tensor} byte size overflows")]
    Overflow { tensor: String },

    /// A name that is not one of the plan's tensors.
    #[error("unknown KDA tensor {name:?}; the plan has {known}")]
    UnknownTensor { name: String, known: String },

    /// A dtype the plan does not support for a KDA tensor.
    #[error("{tensor}: dtype {dtype}; a KDA tensor must be BF16, F16, F32 or F64")]
    UnsupportedDtype { tensor: String, dtype: String },

    /// A KDA tensor whose dtype differs from the plan's.
    #[error("{tensor}: dtype {actual}, expected {expected}")]
    DtypeMismatch {
        tensor: String,
        expected: String,
        actual: String,
    },

    /// A buffer whose length disagrees with the plan's full shape.
    #[error(
        "{tensor}: buffer is {actual} bytes, the plan's full shape [{rows}, {row_elems}] x \
         {elem_bytes} bytes implies {expected} bytes"
    )]
    BufferSize {
        tensor: String,
        actual: usize,
        expected: usize,
        rows: usize,
        row_elems: usize,
        elem_bytes: usize,
    },

    /// An on-disk shape that cannot hold the plan's tensor.
    #[error("{tensor}: on-disk shape {actual:?} does not match the plan; expected {expected}")]
    Shape {
        tensor: String,
        actual: Vec<usize>,
        expected: String,
    },

    /// An I/O failure on a checkpoint file.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A safetensors file whose header or layout is invalid.
    #[error("{}: invalid safetensors file: {reason}", path.display())]
    Safetensors { path: PathBuf, reason: String },

    /// A checkpoint directory or index that is inconsistent.
    #[error("{}: {reason}", path.display())]
    Checkpoint { path: PathBuf, reason: String },

    /// A tensor name the checkpoint does not hold.
    #[error("{}: no tensor named {name:?}", path.display())]
    TensorNotFound { path: PathBuf, name: String },
}

/// The divisors of `n`, comma-separated: the world sizes a head count can be split over.
fn divisors(n: usize) -> String {
    let small: Vec<usize> = (1..).take_while(|d| d * d <= n).filter(|d| n % d == 0).collect();
    let large = small.iter().rev().map(|d| n / d).filter(|&d| d * d != n);
    let all: Vec<String> = small.iter().copied().chain(large).map(|d| d.to_string()).collect();
    all.join(", ")
}

/// Result alias of the core.
pub type Result<T, E = Error> = std::result::Result<T, E>;
