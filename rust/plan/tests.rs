//! Tests of the shard plan: the geometry of every tensor, every refusal with its exact fields, and
//! properties over random geometries.
//!
//! One module per concern: [`geometry`] (the GLM-5.3 geometry, tensor by tensor),
//! [`refusals`] (each refusal with its exact fields), [`dtypes`] (dtype overrides), [`layouts`]
//! (on-disk shapes, sharded axes, local shapes), [`properties`] (random geometries), [`k3`]
//! (Kimi K3: a full-rank gate and a padded `A_log`). The shared geometries are here.
#![allow(clippy::unwrap_used)]

use safetensors::Dtype;

use super::*;

mod dtypes;
mod geometry;
mod k3;
mod layouts;
mod properties;
mod refusals;

/// GLM-5.3-Flash's KDA geometry: hidden 4096, 64 heads of 128, conv kernel 4, gate rank 128.
fn glm(rank: usize, tp: usize) -> KdaTpPlan {
    KdaTpPlan::new(rank, tp, 4096, 128, 64, 4, 128).unwrap()
}

/// Kimi-Linear's KDA geometry: hidden 2304, 32 heads of 128, conv kernel 4, gate rank 128.
fn kimi(rank: usize, tp: usize) -> KdaTpPlan {
    KdaTpPlan::new(rank, tp, 2304, 128, 32, 4, 128).unwrap()
}

fn opts(qk_multiple: usize, dtypes: &[(&str, Dtype)]) -> PlanOptions {
    PlanOptions {
        qk_multiple,
        dtypes: dtypes.iter().map(|(n, d)| (n.to_string(), *d)).collect(),
        ..PlanOptions::default()
    }
}

fn overflow_tensor(r: Result<KdaTpPlan>) -> String {
    error_fields!(r, Overflow { tensor })
}
