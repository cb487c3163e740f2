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

    /// The head count does not split evenly over the ranks. `head_dim` and `qk_multiple` are
    /// the rest of the geometry, for listing the world sizes that pass
    /// ([`crate::plan::allowed_tp_sizes`]).
    #[error(
        "KDA TP requires heads ({heads}) divisible by tp_size ({tp_size}); tp_size may be one of \
         {}",
        divisors(*heads).map_or_else(
            || "a divisor of the head count".to_string(),
            |all| all.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
        )
    )]
    HeadsNotDivisible {
        heads: usize,
        tp_size: usize,
        head_dim: usize,
        qk_multiple: usize,
    },

    /// The local q|k width breaks the kernel's channel-multiple rule. `heads` and `tp_size`
    /// are the full head count and the world size that gave `local_heads`.
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
        heads: usize,
        tp_size: usize,
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
    #[error(
        "{tensor}: dtype {dtype} is not allowed for a KDA tensor: BF16, F16, F32 or F64, and \
         F8_E4M3 or F8_E5M2 only for a block-quantized projection (with its scale)"
    )]
    UnsupportedDtype { tensor: String, dtype: String },

    /// A size of an MLA layer that must be positive is zero (`field` is the config key).
    #[error(
        "degenerate MLA geometry: {field} is 0; every MLA size but qk_rope_head_dim must be at \
         least 1 (fix the config's {field})"
    )]
    MlaZeroSize { field: &'static str },

    /// The MLA head count (`num_attention_heads`) does not split evenly over the ranks.
    #[error(
        "MLA TP requires num_attention_heads ({heads}) divisible by tp_size ({tp_size}): \
         q_proj/q_b_proj, kv_b_proj, g_proj and o_proj are split by head; tp_size may be one \
         of {}",
        divisors(*heads).map_or_else(
            || "a divisor of the head count".to_string(),
            |all| all.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
        )
    )]
    MlaHeadsNotDivisible { heads: usize, tp_size: usize },

    /// A name that is not one of the MLA layer's tensors.
    #[error("unknown MLA tensor {name:?}; this MLA layer has {known}")]
    MlaUnknownTensor { name: String, known: String },

    /// A dtype the MLA plan does not support.
    #[error(
        "{tensor}: dtype {dtype} is not allowed for an MLA tensor: BF16, F16, F32 or F64, and \
         F8_E4M3 or F8_E5M2 only for a block-quantized projection (with its scale)"
    )]
    MlaUnsupportedDtype { tensor: String, dtype: String },

    /// An MLA tensor that checkpoints never block-quantize (its norms, GLM-5.3's DSA indexer).
    #[error(
        "{tensor} is never block-quantized (the MLA norms and the DSA indexer stay \
         floating-point); a checkpoint that quantizes it is not supported"
    )]
    MlaNotQuantizable { tensor: String },

    /// A rank's range of a block-quantized MLA weight that does not start and end on a block
    /// boundary: vLLM 0.33 refuses the split (`validate_fp8_block_shape`: every rank's share
    /// of a column-parallel output, or of a row-parallel input, a multiple of the block edge).
    #[error(
        "{tensor}: rank {rank}'s {axis} {start}..{end} do not start and end on block \
         boundaries (blocks of {block} {axis}; {local} {axis} per rank at tp_size {tp_size}), so \
         its block scales \
         cannot be sliced to match (vLLM's block-FP8 loader refuses this split too: each \
         rank's share must be a multiple of the block); tp_size may be one of {}",
        allowed.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
    )]
    MlaBlockSplit {
        tensor: String,
        axis: &'static str,
        rank: usize,
        start: usize,
        end: usize,
        local: usize,
        block: usize,
        tp_size: usize,
        allowed: Vec<usize>,
    },

    /// A block edge over the supported maximum.
    #[error("block size {block} is larger than {max}")]
    BlockSize { block: usize, max: usize },

    /// A quantized tensor that checkpoints never quantize.
    #[error(
        "{tensor} is never block-quantized (conv weights, A_log, dt_bias and o_norm stay \
         floating-point); a checkpoint that quantizes it is not supported"
    )]
    NotQuantizable { tensor: String },

    /// A rank's range of a block-quantized weight that its scale grid cannot follow.
    #[error(
        "{tensor}: rank {rank}'s {axis} {start}..{end} start inside block {first} of {block} \
         {axis}, so the block scales cannot be sliced to match; a rank's range must start on a \
         block boundary or lie inside one block (choose another tp_size)"
    )]
    BlockSplit {
        tensor: String,
        axis: &'static str,
        rank: usize,
        start: usize,
        end: usize,
        block: usize,
        first: usize,
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

    /// An on-disk shape that cannot hold the plan's tensor: the plan's tensor is
    /// `[rows, row_elems]`, stored as `example` by Kimi-Linear.
    #[error(
        "{tensor}: on-disk shape {actual:?} does not match the plan; expected {} elements as \
         [{rows}, {row_elems}] (e.g. {example:?})",
        rows * row_elems
    )]
    Shape {
        tensor: String,
        actual: Vec<usize>,
        rows: usize,
        row_elems: usize,
        example: Vec<usize>,
    },

    /// An I/O failure on a checkpoint file. A missing path reads "no such file or directory",
    /// the one wording kda_tp uses for it everywhere (not the OS's "(os error 2)").
    #[error("{}: {}", path.display(), io_reason(source))]
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

/// The divisors of `n`, ascending: the world sizes a head count can be split over. `None`
/// above 2^20 (real models have at most a few hundred heads; listing is linear in `n`).
pub fn divisors(n: usize) -> Option<Vec<usize>> {
    (n <= 1 << 20).then(|| (1..=n).filter(|d| n % d == 0).collect())
}

/// Result alias of the core.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How an I/O error reads after its path: a missing path as "no such file or directory" (the
/// wording of every kda_tp refusal of a missing path), any other error as the OS says it.
fn io_reason(source: &std::io::Error) -> String {
    if source.kind() == std::io::ErrorKind::NotFound {
        "no such file or directory".to_owned()
    } else {
        source.to_string()
    }
}
