//! The decode cost model: seconds per token on one device at batch 1.
//! Invariant: time = bytes read from device memory / memory bandwidth + expected expert
//! misses x expert bytes / host-to-device bandwidth; every term is in the report's basis.

use crate::facts::ModelFacts;
use strata_schemas::probe::DeviceProbe;

/// The context length predictions assume (short chat turns), capped by `--max-context`.
pub const PREDICT_CONTEXT: u64 = 4096;

/// What one device does per decoded token.
pub struct DeviceWork {
    pub a: u32,
    pub b: u32,
    pub holds_head: bool,
    /// Expected expert uses per token served from the cache.
    pub cached_mass: f64,
    /// Expected expert uses per token in total.
    pub total_mass: f64,
    pub at_context: u64,
}

/// Seconds per token on `dev` for `work`.
pub fn device_token_seconds(facts: &ModelFacts, dev: &DeviceProbe, work: &DeviceWork) -> f64 {
    let bw = dev.mem_bandwidth() * 1e9;
    let h2d = dev.h2d() * 1e9;
    let (a, b) = (work.a, work.b);
    let n_exp_layers = facts.expert_layers(a, b);
    let avg_expert = if n_exp_layers == 0 || facts.n_expert == 0 {
        0.0
    } else {
        facts.experts_range(a, b) as f64 / (facts.n_expert * n_exp_layers) as f64
    };
    let mut read = facts.dense_range(a, b) as f64 + work.total_mass * avg_expert;
    if work.holds_head {
        read += facts.head_bytes as f64;
    }
    read += (work.at_context * facts.kv_cell_range(a, b)) as f64;
    read += 2.0 * facts.linear_range(a, b) as f64;
    let misses = (work.total_mass - work.cached_mass).max(0.0);
    read / bw + misses * avg_expert / h2d
}
