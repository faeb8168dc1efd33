//! The cost model's `[device.cost.types.<TYPE>]` rates: for each weight type of [`TYPES`],
//! the one-token dense products' GB/s, the decode expert pair's GB/s, the prefill GEMM's and
//! the grouped expert products' TFLOP/s, timed with the launchers the family keys use
//! (`cost.rs`'s `products_of`/`gemm_of`, `experts.rs`'s `decode_expert_gbps`/
//! `prefill_experts`) at fewer sizes and repetitions, so the whole table adds well under two
//! seconds to `strata-exec probe`.
//! Invariant: every rate is a timing of the engine's kernels over synthetic buffers of that
//! type (0x11 bytes: small finite scales in every format); one that fails is absent with a
//! note, never a default. Q8_0 is measured here the same way as the others: the planner
//! counts each type's rate relative to this table's Q8_0 entry.

use super::cost::{gemm_of, products_of};
use super::experts::{decode_expert_gbps, prefill_experts};
use crate::backend::cuda::CudaDevice;
use strata_schemas::ggml::GgmlType;
use strata_schemas::probe::TypeRates;

/// The weight types of the models the engine runs: Q8_0, llama.cpp's Q4_K_M / Q5_K_M mixes
/// (Q4_K or Q5_K with Q6_K), and the IQ3_S / IQ4_XS files (Qwen3-Next-80B's benchmark file).
pub const TYPES: [GgmlType; 6] = [
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::Iq3S,
    GgmlType::Iq4Xs,
];
/// Rows of `COLS` (2048) of the per-type product fits: 2 MB to 60 MB of Q8_0.
const ROWS: [usize; 3] = [1024, 4096, 32768];
/// Timed runs of each per-type prefill measurement.
const REPS: usize = 5;

/// The rates of every type of [`TYPES`] (a type with no rate measured is left out), the
/// `#` line saying how, and notes for what failed.
pub fn measure_types(
    dev: &CudaDevice,
    progress: &mut dyn FnMut(&str),
    notes: &mut Vec<String>,
) -> Vec<(GgmlType, TypeRates)> {
    let t0 = std::time::Instant::now();
    let mut out = Vec::new();
    for ty in TYPES {
        let mut r = TypeRates::default();
        let mut fail = |key: &str, e: String| {
            notes.push(format!("types.{}.{key} not measured: {e}", ty.name()));
        };
        match products_of(dev, ty, &ROWS) {
            Ok((_, g)) => r.product_gbps = Some(g),
            Err(e) => fail("product_gbps", e),
        }
        match decode_expert_gbps(dev, ty) {
            Ok(g) => r.expert_gbps = Some(g),
            Err(e) => fail("expert_gbps", e),
        }
        match gemm_of(dev, ty, REPS) {
            Ok(v) => r.gemm_tflops = Some(v),
            Err(e) => fail("gemm_tflops", e.to_string()),
        }
        match prefill_experts(dev, ty, REPS) {
            Ok(v) => r.expert_gemm_tflops = Some(v),
            Err(e) => fail("expert_gemm_tflops", e.to_string()),
        }
        let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
        progress(&format!(
            "cost: {} products {} GB/s, experts {} GB/s, GEMM {} TFLOP/s, grouped experts {} TFLOP/s",
            ty.name(),
            f(r.product_gbps),
            f(r.expert_gbps),
            f(r.gemm_tflops),
            f(r.expert_gemm_tflops)
        ));
        if r.entries().iter().any(|(_, v)| v.is_some()) {
            out.push((ty, r));
        }
    }
    progress(&format!(
        "cost: weight types measured in {:.1}s",
        t0.elapsed().as_secs_f64()
    ));
    out
}

/// How the per-type rates were measured, for the probe file's `#` line.
pub fn how() -> String {
    format!(
        "per weight type, the family keys' kernels: one-token products fitted at {ROWS:?} rows x 2048 (product_gbps), the decode expert pair fitted at {:?} tokens (expert_gbps), the prefill GEMM and the grouped expert products, {REPS} runs (TFLOP/s); the planner counts each type relative to Q8_0's entry",
        super::experts::DECODE_TOKENS
    )
}

/// Probe-file tables `[device.cost.types.<TYPE>]` for `types`.
pub fn types_toml(types: &[(GgmlType, TypeRates)]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    for (ty, r) in types {
        let _ = writeln!(out, "\n[device.cost.types.{}]", ty.name());
        for (key, v) in r.entries() {
            if let Some(v) = v {
                let _ = writeln!(out, "{key} = {v:.3}");
            }
        }
    }
    out
}
