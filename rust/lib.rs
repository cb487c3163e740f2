//! `kda_tp`: tensor-parallel sharding of KDA (Kimi Delta Attention) weights.
//!
//! * [`plan`]: which part of each KDA tensor a rank keeps (pure arithmetic).
//! * [`tensor`]: one tensor's placement on one rank ([`KdaTensorPlan`], [`KdaShard`]), shared
//!   by the plan and the block-scale grids.
//! * [`mla`]: which part of each tensor of an MLA layer (the hybrids' other attention) a
//!   rank keeps.
//! * [`quant`]: which part of a block-quantized (FP8) weight's scale grid a rank keeps.
//! * [`slice`](mod@slice): applying a plan entry to a tensor's bytes (contiguous row ranges, strided
//!   column gather).
//! * [`pages`]: prefaulting and huge-page hints for the memory a large copy writes.
//! * [`digest`]: the exact region digests the guard compares (XXH3-128, chunks in parallel).
//! * [`checkpoint`]: validated safetensors files and sharded checkpoint directories.
//! * [`error`]: the one error type.
//!
//! The Python bindings (`kda_tp._native`) live behind the `python` cargo feature, so
//! `cargo test` builds and tests the core without Python.

#[cfg(test)]
#[macro_use]
mod test_util;

pub mod checkpoint;
pub mod digest;
pub mod error;
pub mod mla;
pub mod pages;
pub mod plan;
pub mod quant;
pub mod slice;
pub mod tensor;

#[cfg(feature = "python")]
mod py;

pub use error::{Error, Result};
pub use mla::{IndexerGeometry, MlaGeometry, MlaTpPlan};
pub use plan::{KdaShard, KdaTensorPlan, KdaTpPlan, PlanOptions};
