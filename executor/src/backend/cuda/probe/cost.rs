//! The cost model's `[device.cost]` coefficients measured on the live GPU with the engine's
//! own launchers (`launch::decode::mv`/`rmsnorm`/`spin`, `launch::attention::attn_decode`,
//! `CudaDevice::gemm`, `flash::attn_prefill`) over synthetic buffers.
//! Invariant: every value is a timing of those kernels on this device (the expert keys by
//! `probe/experts.rs`, with the engine's expert launchers and miss copy); a measurement that fails is
//! None with a note, never a default. Weight and KV buffers are cycled so that each timed
//! pass reads more than the L2 cache holds; at most [`COST_ARENA_BYTES`] plus small buffers
//! are allocated at once, and everything is freed on return.

use crate::backend::cuda::flash::{attn_prefill, PrefillAttn, KV_TY_F16};
use crate::backend::cuda::kv_spill::KvHostArg;
use crate::backend::cuda::launch::attention::{attn_fused, Heads, KvLayer, Splits};
use crate::backend::cuda::launch::decode::{mv, rmsnorm, spin};
use crate::backend::cuda::launch::{Launcher, Mat, ATT_MAX_SPLIT};
use crate::backend::cuda::{drv, CudaDevice, CudaError};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;
use strata_schemas::ggml::GgmlType;

/// The largest buffer one measurement allocates (weights or KV), so the probe stays well
/// under 2 GiB.
pub const COST_ARENA_BYTES: u64 = 512 << 20;
/// Bytes each timed product or attention pass reads in all (several times the L2 cache).
const PASS_BYTES: u64 = 384 << 20;
/// Launches in the graph that times `launch_us`.
const LAUNCHES: usize = 256;
/// Columns of the probe's products (Qwen3-30B-A3B's `n_embd`).
const COLS: usize = 2048;
/// Rows of the products whose times are fitted: 0.55 MB to 71 MB of Q8_0 weights, from an
/// expert's down projection to a large head slice.
const PRODUCT_ROWS: [usize; 6] = [256, 1024, 2048, 4096, 8192, 32768];
/// Decode attention heads as Qwen3-30B-A3B: 32 query heads over 4 KV heads of 128, F16 KV.
pub(super) const N_HEAD: usize = 32;
pub(super) const N_HEAD_KV: usize = 4;
pub(super) const HD: usize = 128;
/// Context lengths whose decode attention times are fitted.
const CONTEXTS: [u64; 5] = [512, 2048, 8192, 16384, 32768];
/// The prefill GEMM's shape: Q8_0 `4096 x 2048` (Qwen3-30B's Q projection) over 512 tokens.
const GEMM_ROWS: usize = 4096;
const GEMM_TOK: usize = 512;
/// Prefill attention tokens (one pass from position 0, as `pp512`).
const PREFILL_TOK: usize = 512;
/// Timed repetitions of the big prefill kernels and of the decode step.
const REPS: usize = 20;
const STEPS: usize = 200;

/// The measured coefficients, in the probe's units; None = not measured (see `notes`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CostMeasure {
    pub launch_us: Option<f64>,
    pub product_latency_us: Option<f64>,
    pub product_gbps: Option<f64>,
    pub attention_latency_us: Option<f64>,
    pub attention_gbps: Option<f64>,
    pub gemm_tflops: Option<f64>,
    pub prefill_attention_tflops: Option<f64>,
    pub step_us: Option<f64>,
    pub host_expert_gbps: Option<f64>,
    pub host_expert_pinned_gbps: Option<f64>,
    pub expert_latency_us: Option<f64>,
    pub expert_gbps: Option<f64>,
    pub expert_pass_gbps: Option<f64>,
    pub expert_gemm_tflops: Option<f64>,
    pub host_matvec_gbps: Option<f64>,
    pub host_expert_latency_us: Option<f64>,
    /// `[device.cost.types.<TYPE>]`: the product families' rates per weight type
    /// (`probe/types.rs`).
    pub types: Vec<(GgmlType, strata_schemas::probe::TypeRates)>,
    pub host_round_trip_us: Option<f64>,
    pub kv_host_round_trip_us: Option<f64>,
    pub eager_launch_us: Option<f64>,
    /// Tokens an expert of the `expert_gemm_tflops` pass (`probe/experts.rs`).
    pub expert_gemm_tokens_per_expert: Option<f64>,
    /// The delta rule (`probe/linear.rs`).
    pub delta_rule_token_us: Option<f64>,
    pub delta_rule_latency_us: Option<f64>,
    pub linear_state_gbps: Option<f64>,
    /// How each value was measured, by key, for the probe file's `#` lines.
    pub how: Vec<(&'static str, String)>,
    /// Why a key is absent.
    pub notes: Vec<String>,
}

/// A least-squares line `y = intercept + slope * x`; None with fewer than two distinct `x`
/// or a non-finite result.
pub fn fit_line(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if sxx <= 0.0 {
        return None;
    }
    let slope = sxy / sxx;
    let intercept = my - slope * mx;
    (slope.is_finite() && intercept.is_finite()).then_some((intercept, slope))
}

/// From (bytes, µs) points: (latency µs, GB/s). Errors when the fit is not a positive slope;
/// a negative intercept (the line passes under the origin) is clamped to 0.
pub fn latency_and_gbps(points: &[(f64, f64)]) -> Result<(f64, f64), String> {
    let (b, s) = fit_line(points).ok_or("fewer than two distinct sizes")?;
    if s <= 0.0 {
        return Err(format!(
            "time does not grow with bytes (slope {s:e} µs/byte): {points:?}"
        ));
    }
    // s µs per byte = 1/s bytes per µs = 1e6/s bytes/s = 1e-3/s GB/s.
    Ok((b.max(0.0), 1e-3 / s))
}

/// Measures every coefficient on `dev`.
pub fn measure_cost(dev: &CudaDevice, progress: &mut dyn FnMut(&str)) -> CostMeasure {
    let mut m = CostMeasure::default();
    let t0 = std::time::Instant::now();
    let fail = |m: &mut CostMeasure, keys: &str, e: String| {
        m.notes.push(format!("{keys} not measured: {e}"));
    };
    match launch_us(dev) {
        Ok(v) => {
            progress(&format!(
                "cost: launch {v:.2} µs ({LAUNCHES} one-row RMSNorms in a graph)"
            ));
            m.launch_us = Some(v);
            m.how.push((
                "launch_us",
                format!("{LAUNCHES} one-row RMSNorm launches ({COLS} wide) in one captured graph, per launch"),
            ));
        }
        Err(e) => fail(&mut m, "launch_us", e.to_string()),
    }
    match products(dev) {
        Ok((lat, g)) => {
            progress(&format!(
                "cost: one-token Q8_0 products {lat:.1} µs + bytes at {g:.0} GB/s"
            ));
            m.product_latency_us = Some(lat);
            m.product_gbps = Some(g);
            m.how.push(("product_latency_us", format!(
                "line fit of dq_mv1 time against weight bytes, Q8_0 {PRODUCT_ROWS:?} rows x {COLS}, in graphs cycling {} MiB of weights: intercept", PASS_BYTES >> 20)));
            m.how
                .push(("product_gbps", "the same fit: 1 / slope".into()));
        }
        Err(e) => fail(&mut m, "product_latency_us, product_gbps", e),
    }
    // A decode attention far slower per byte than the one-token products means the timed
    // launches do not stand for the engine's (a split count or layout it never uses): the
    // keys are left to the defaults rather than written wrong.
    let plausible = |g: f64| m.product_gbps.is_none_or(|p| g >= 0.1 * p);
    match attention(dev) {
        Ok((_, g)) if !plausible(g) => fail(
            &mut m,
            "attention_latency_us, attention_gbps",
            format!(
                "decode attention timed at {g:.0} GB/s, under a tenth of the products' rate: implausible for the engine's kernels, left to the defaults"
            ),
        ),
        Ok((lat, g)) => {
            progress(&format!(
                "cost: decode attention {lat:.1} µs + KV at {g:.0} GB/s"
            ));
            m.attention_latency_us = Some(lat);
            m.attention_gbps = Some(g);
            m.how.push(("attention_latency_us", format!(
                "line fit of the fused decode attention (dq_attn_fused, as the engine runs it) time against K+V bytes, {N_HEAD}/{N_HEAD_KV} heads of {HD}, F16, {CONTEXTS:?} cells: intercept")));
            m.how
                .push(("attention_gbps", "the same fit: 1 / slope".into()));
        }
        Err(e) => fail(&mut m, "attention_latency_us, attention_gbps", e),
    }
    match gemm(dev) {
        Ok(v) => {
            progress(&format!("cost: prefill GEMM {v:.1} TFLOP/s"));
            m.gemm_tflops = Some(v);
            m.how.push(("gemm_tflops", format!(
                "CudaDevice::gemm (input conversion + tensor-core product), Q8_0 {GEMM_ROWS} x {COLS} over {GEMM_TOK} tokens, {REPS} runs")));
        }
        Err(e) => fail(&mut m, "gemm_tflops", e.to_string()),
    }
    match prefill_attention(dev) {
        Ok(v) => {
            progress(&format!("cost: prefill attention {v:.1} TFLOP/s"));
            m.prefill_attention_tflops = Some(v);
            m.how.push(("prefill_attention_tflops", format!(
                "attn_prefill (fa_prefill) of {PREFILL_TOK} tokens from position 0, {N_HEAD}/{N_HEAD_KV} heads of {HD}, F16 KV, causal flops, {REPS} runs")));
        }
        Err(e) => fail(&mut m, "prefill_attention_tflops", e.to_string()),
    }
    match step_us(dev, m.launch_us.unwrap_or(0.0)) {
        Ok(v) => {
            progress(&format!("cost: step overhead {v:.1} µs"));
            m.step_us = Some(v);
            m.how.push(("step_us", format!(
                "host wall time of {STEPS} steps (launch a one-kernel graph, read 4 bytes back), less the kernel's launch_us")));
        }
        Err(e) => fail(&mut m, "step_us", e.to_string()),
    }
    match super::experts::miss_copies(dev) {
        Ok(g) => {
            progress(&format!("cost: expert misses copied at {g:.1} GB/s"));
            m.host_expert_gbps = Some(g);
            m.how.push(("host_expert_gbps", format!(
                "one {}x{} Q8_0 expert matrix a copy from pageable host memory, as the expert cache fills a slot from the mapped model file", super::experts::F, super::experts::E)));
        }
        Err(e) => fail(&mut m, "host_expert_gbps", e.to_string()),
    }
    match super::experts::pinned_miss_copies(dev) {
        Ok(g) => {
            progress(&format!(
                "cost: expert misses from pinned memory copied at {g:.1} GB/s"
            ));
            m.host_expert_pinned_gbps = Some(g);
            m.how.push(("host_expert_pinned_gbps", format!(
                "one whole {}x{} Q8_0 expert (gate, up, down) a copy from pinned host memory on a copy stream, as the pinned host expert tier fills a slot", super::experts::F, super::experts::E)));
        }
        Err(e) => fail(&mut m, "host_expert_pinned_gbps", e.to_string()),
    }
    // The hybrid miss path's host half, on this machine's CPU (no device involved): the
    // same products `hybrid.rs` runs, over a working set of 64 experts (~300 MB).
    let counts = [1usize, 2, 4, 8];
    let host = crate::backend::cpu::host_experts::time_host_experts(
        (super::experts::E, super::experts::F),
        64,
        &counts,
        5,
    );
    match host.map(|rows| fit_line(&rows)) {
        Ok(Some((lat, slope))) if slope > 0.0 => {
            let g = 1.0 / slope / 1e9;
            let lat_us = (lat * 1e6).max(0.0);
            progress(&format!(
                "cost: misses on the CPU {lat_us:.1} µs + bytes at {g:.1} GB/s ({} threads)",
                crate::backend::cpu::host_experts::host_threads()
            ));
            m.host_matvec_gbps = Some(g);
            m.host_expert_latency_us = Some(lat_us);
            m.how.push(("host_matvec_gbps", format!(
                "line fit of the hybrid path's host products (gate, up, SiLU, down of {:?} one-token picks of distinct {}x{} Q8_0 experts, {} threads) against the expert bytes read: 1 / slope",
                counts, super::experts::F, super::experts::E, crate::backend::cpu::host_experts::host_threads())));
            m.how.push((
                "host_expert_latency_us",
                "the same fit: intercept (the thread pool's sections, hot; the device side is in host_round_trip_us)".into(),
            ));
        }
        Ok(_) => fail(
            &mut m,
            "host_matvec_gbps, host_expert_latency_us",
            "the host products' times did not grow with the bytes read".into(),
        ),
        Err(e) => fail(
            &mut m,
            "host_matvec_gbps, host_expert_latency_us",
            e.to_string(),
        ),
    }
    round_trips(dev, &mut m, progress);
    match super::experts::decode_experts(dev) {
        Ok((lat, g, pass)) => {
            progress(&format!(
                "cost: decode experts {lat:.1} µs + bytes at {g:.0} GB/s; {pass:.0} GB/s over {} tokens",
                super::experts::PASS_TOKENS
            ));
            m.expert_latency_us = Some(lat);
            m.expert_gbps = Some(g);
            m.expert_pass_gbps = Some(pass);
            m.how.push(("expert_latency_us", format!(
                "line fit of moe_gate_up + moe_down time against the expert bytes their uses read, {} Q8_0 experts of {}x{} top-{}, {:?} tokens: intercept",
                super::experts::N_EXPERT, super::experts::F, super::experts::E, super::experts::K, super::experts::DECODE_TOKENS)));
            m.how
                .push(("expert_gbps", "the same fit: 1 / slope".into()));
            m.how.push(("expert_pass_gbps", format!(
                "the same products over {} tokens (a prefill group through the expert cache): bytes of the uses over the time",
                super::experts::PASS_TOKENS)));
        }
        Err(e) => fail(
            &mut m,
            "expert_latency_us, expert_gbps, expert_pass_gbps",
            e,
        ),
    }
    match super::experts::prefill_experts(dev, GgmlType::Q8_0, REPS) {
        Ok(v) => {
            progress(&format!("cost: prefill grouped experts {v:.1} TFLOP/s"));
            m.expert_gemm_tflops = Some(v);
            let tpe = (super::experts::PREFILL_TOKENS * super::experts::K) as f64
                / super::experts::N_EXPERT as f64;
            m.expert_gemm_tokens_per_expert = Some(tpe);
            m.how.push(("expert_gemm_tokens_per_expert", format!(
                "the shape expert_gemm_tflops (and each type's) was measured at: {} tokens x top-{} / {} experts; the planner scales the rate by the grouped products' tile padding from here",
                super::experts::PREFILL_TOKENS, super::experts::K, super::experts::N_EXPERT)));
            m.how.push(("expert_gemm_tflops", format!(
                "moe_sort + input conversions + grouped gate-up (SwiGLU) and down products over {} tokens, top-{} of {} Q8_0 experts, {REPS} runs",
                super::experts::PREFILL_TOKENS, super::experts::K, super::experts::N_EXPERT)));
        }
        Err(e) => fail(&mut m, "expert_gemm_tflops", e.to_string()),
    }
    delta_rule(dev, &mut m, progress);
    m.types = super::types::measure_types(dev, progress, &mut m.notes);
    progress(&format!(
        "cost: measured in {:.1}s",
        t0.elapsed().as_secs_f64()
    ));
    m
}

/// The delta rule's keys (`probe/linear.rs`).
fn delta_rule(dev: &CudaDevice, m: &mut CostMeasure, progress: &mut dyn FnMut(&str)) {
    use super::linear::{
        delta_rule_decode, delta_rule_token_us, D, DECODE_SLOTS, NK, NV, PREFILL_TOKENS,
    };
    match delta_rule_token_us(dev) {
        Ok(v) => {
            progress(&format!(
                "cost: delta rule {v:.2} µs a token a layer in a prefill run"
            ));
            m.delta_rule_token_us = Some(v);
            m.how.push(("delta_rule_token_us", format!(
                "line fit of launch::linear::delta_rule (lin_delta_rule + lin_gated_norm) over one slot's run of {PREFILL_TOKENS:?} tokens, {NK} key / {NV} value heads of {D}: slope")));
        }
        Err(e) => m
            .notes
            .push(format!("delta_rule_token_us not measured: {e}")),
    }
    match delta_rule_decode(dev) {
        Ok((lat, g)) => {
            progress(&format!(
                "cost: decode delta rule {lat:.1} µs + state at {g:.0} GB/s"
            ));
            m.delta_rule_latency_us = Some(lat);
            m.linear_state_gbps = Some(g);
            m.how.push(("delta_rule_latency_us", format!(
                "line fit of launch::linear::delta_rule at one token in each of {DECODE_SLOTS:?} slots against the state bytes read and written, {NK} key / {NV} value heads of {D}, in graphs cycling 16 layers: intercept")));
            m.how
                .push(("linear_state_gbps", "the same fit: 1 / slope".into()));
        }
        Err(e) => m.notes.push(format!(
            "delta_rule_latency_us, linear_state_gbps not measured: {e}"
        )),
    }
}

/// The host round trips and the eager launch (`probe/round_trip.rs`), after the host
/// products' rate they subtract.
fn round_trips(dev: &CudaDevice, m: &mut CostMeasure, progress: &mut dyn FnMut(&str)) {
    use super::round_trip::{eager_launch_us, hybrid_round_trip, kv_round_trip};
    let host = m.host_matvec_gbps.unwrap_or(f64::INFINITY);
    let less = if m.host_matvec_gbps.is_some() {
        "less the bytes its host products read at host_matvec_gbps"
    } else {
        "(host_matvec_gbps unmeasured: nothing subtracted)"
    };
    match hybrid_round_trip(dev, host) {
        Ok((us, whole)) => {
            progress(&format!(
                "cost: a hybrid layer's round trip {us:.1} µs ({whole:.1} µs with its product)"
            ));
            m.host_round_trip_us = Some(us);
            m.how.push(("host_round_trip_us", format!(
                "median wall time of one decode layer sending one token's miss to the host, through hybrid.rs's own rows_back / picks_up / sum_up around host_experts, a cold pool each time (after 2 ms idle), the stream synchronised after: {whole:.1} µs, {less}")));
        }
        Err(e) => m
            .notes
            .push(format!("host_round_trip_us not measured: {e}")),
    }
    match kv_round_trip(dev, host) {
        Ok((us, whole)) => {
            progress(&format!(
                "cost: a KV host layer's round trip {us:.1} µs ({whole:.1} µs with its reads)"
            ));
            m.kv_host_round_trip_us = Some(us);
            m.how.push(("kv_host_round_trip_us", format!(
                "median wall time of one attention layer of one token (32 heads over 4 of 128, F16, a 512-cell window and 512 cells on the host) through kv_host_attn.rs's host_round_trip around host_partials, a cold pool each time: {whole:.1} µs, {less}")));
        }
        Err(e) => m
            .notes
            .push(format!("kv_host_round_trip_us not measured: {e}")),
    }
    match eager_launch_us(dev, COLS) {
        Ok(v) => {
            progress(&format!("cost: eager launch {v:.2} µs"));
            m.eager_launch_us = Some(v);
            m.how.push(("eager_launch_us", format!(
                "one-row RMSNorm launches ({COLS} wide) queued one by one outside a graph and waited for, per launch, best of 6")));
        }
        Err(e) => m.notes.push(format!("eager_launch_us not measured: {e}")),
    }
}

/// The graph of what `f` queues on the device's stream, instantiated and uploaded.
fn capture(
    dev: &CudaDevice,
    f: &mut dyn FnMut() -> Result<(), CudaError>,
) -> Result<CudaGraph, CudaError> {
    let stream = dev.stream()?;
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(drv("cuStreamBeginCapture"))?;
    let queued = f();
    let graph = stream.end_capture(CUgraphInstantiate_flags(0));
    queued?;
    let graph = graph
        .map_err(drv("cuStreamEndCapture / cuGraphInstantiate"))?
        .ok_or_else(|| CudaError::Shape {
            op: "cost probe",
            detail: "the driver captured an empty graph".into(),
        })?;
    graph.upload().map_err(drv("cuGraphUpload"))?;
    Ok(graph)
}

/// Captures what `f` queues on the device's stream into a graph, runs it once untimed, then
/// `reps` times between events; milliseconds per run.
pub(super) fn graph_ms(
    dev: &CudaDevice,
    reps: usize,
    f: &mut dyn FnMut() -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    let graph = capture(dev, f)?;
    graph.launch().map_err(drv("cuGraphLaunch"))?;
    dev.synchronize()?;
    let start = dev.record_event()?;
    for _ in 0..reps {
        graph.launch().map_err(drv("cuGraphLaunch"))?;
    }
    let end = dev.record_event()?;
    end.synchronize()?;
    let ms = start.elapsed_ms(&end)? as f64;
    positive(ms / reps as f64)
}

/// Queues `f` once untimed, then `reps` times between events; milliseconds per run.
pub(super) fn stream_ms(
    dev: &CudaDevice,
    reps: usize,
    f: &mut dyn FnMut() -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    f()?;
    dev.synchronize()?;
    let start = dev.record_event()?;
    for _ in 0..reps {
        f()?;
    }
    let end = dev.record_event()?;
    end.synchronize()?;
    let ms = start.elapsed_ms(&end)? as f64;
    positive(ms / reps as f64)
}

fn positive(ms: f64) -> Result<f64, CudaError> {
    if ms.is_finite() && ms > 0.0 {
        Ok(ms)
    } else {
        Err(CudaError::Shape {
            op: "cost probe",
            detail: format!("events measured {ms} ms"),
        })
    }
}

/// One buffer of `bytes` filled with `byte` (0x11 keeps f16 scales and KV small and finite).
pub(super) fn filled(
    dev: &CudaDevice,
    name: &str,
    bytes: u64,
    byte: u8,
) -> Result<crate::backend::cuda::DeviceArena, CudaError> {
    let a = dev.alloc_arena(name, bytes)?;
    dev.memset(a.all(), byte)?;
    Ok(a)
}

fn launch_us(dev: &CudaDevice) -> Result<f64, CudaError> {
    // The launch that reads next to nothing in a decode step: the residual add + RMSNorm of
    // one token's hidden row, as the engine launches it between a layer's products.
    let x = filled(dev, "probe-cost-norm-x", 4 * COLS as u64, 0)?;
    let w = filled(dev, "probe-cost-norm-w", 4 * COLS as u64, 0)?;
    let out = dev.alloc_arena("probe-cost-norm-out", 4 * COLS as u64)?;
    let l = decode_launcher(dev);
    let ms = graph_ms(dev, 20, &mut || {
        for _ in 0..LAUNCHES {
            rmsnorm(&l, x.all(), None, None, w.all(), out.all(), COLS, 1e-6, 1)?;
        }
        Ok(())
    })?;
    Ok(ms * 1e3 / LAUNCHES as f64)
}

fn decode_launcher(dev: &CudaDevice) -> Launcher<'_> {
    Launcher {
        dev,
        pdl: true,
        prof: None,
        q4k_lanes: false,
    }
}

/// (latency µs, GB/s) of one-token Q8_0 products.
fn products(dev: &CudaDevice) -> Result<(f64, f64), String> {
    products_of(dev, GgmlType::Q8_0, &PRODUCT_ROWS)
}

/// (latency µs, GB/s) of one-token products over `ty` weights of each of `row_counts` rows
/// of [`COLS`], fitted against their bytes.
pub(super) fn products_of(
    dev: &CudaDevice,
    ty: GgmlType,
    row_counts: &[usize],
) -> Result<(f64, f64), String> {
    let e = |e: CudaError| e.to_string();
    let w = filled(dev, "probe-cost-weights", COST_ARENA_BYTES, 0x11).map_err(e)?;
    let x = filled(dev, "probe-cost-x", 4 * COLS as u64, 0).map_err(e)?;
    let max_rows = row_counts.iter().copied().max().unwrap_or(1);
    let y = dev
        .alloc_arena("probe-cost-y", 4 * max_rows as u64)
        .map_err(e)?;
    let l = decode_launcher(dev);
    let row_bytes = crate::quant::row_bytes(ty, COLS).map_err(|e| e.to_string())? as u64;
    let mut points = Vec::new();
    for &rows in row_counts {
        let bytes = row_bytes * rows as u64;
        // Offsets 256-byte aligned, cycling through the arena.
        let stride = bytes.div_ceil(256) * 256;
        let fit = (COST_ARENA_BYTES / stride).max(1);
        let n = PASS_BYTES.div_ceil(bytes).clamp(4, 2048);
        let ms = graph_ms(dev, 5, &mut || {
            for i in 0..n {
                let mat = Mat {
                    w: w.view((i % fit) * stride, bytes)?,
                    ty,
                    rows,
                    cols: COLS,
                };
                let yv = y.view(0, 4 * rows as u64)?;
                mv(&l, "probe-mv", mat, x.all(), None, yv, 1, false, true)?;
            }
            Ok(())
        })
        .map_err(e)?;
        points.push((bytes as f64, ms * 1e3 / n as f64));
    }
    latency_and_gbps(&points)
}

/// The probed attention's heads ([`N_HEAD`] over [`N_HEAD_KV`] of [`HD`], full RoPE), their
/// inverse frequencies and Q/K norm weights read from `small` (at least `N_HEAD x HD` f32).
pub(super) fn probe_heads(
    small: &crate::backend::cuda::DeviceArena,
) -> Result<Heads<'_>, CudaError> {
    Ok(Heads {
        n_head: N_HEAD,
        n_head_kv: N_HEAD_KV,
        hd: HD,
        n_rot: HD,
        eps: 1e-6,
        attn_factor: 1.0,
        inv_freq: small.view(0, 4 * (HD / 2) as u64)?,
        q_norm: small.view(0, 4 * HD as u64)?,
        k_norm: small.view(0, 4 * HD as u64)?,
    })
}

/// (latency µs, GB/s) of split-KV decode attention of one token.
fn attention(dev: &CudaDevice) -> Result<(f64, f64), String> {
    let e = |e: CudaError| e.to_string();
    let row_bytes = (N_HEAD_KV * HD * 2) as u64;
    let kv = filled(dev, "probe-cost-kv", COST_ARENA_BYTES, 0x11).map_err(e)?;
    let small = filled(dev, "probe-cost-small", 4 * (N_HEAD * HD) as u64, 0).map_err(e)?;
    let q = filled(dev, "probe-cost-q", 4 * (N_HEAD * HD) as u64, 0).map_err(e)?;
    let out = dev
        .alloc_arena("probe-cost-att-out", 4 * (N_HEAD * HD) as u64)
        .map_err(e)?;
    // Part buffers for the most splits; each context takes the engine's own count.
    let splits = ATT_MAX_SPLIT;
    let part_o = dev
        .alloc_arena("probe-cost-part-o", 4 * (N_HEAD * splits * HD) as u64)
        .map_err(e)?;
    let part_ms = dev
        .alloc_arena("probe-cost-part-ms", 4 * (N_HEAD * splits * 2) as u64)
        .map_err(e)?;
    let ints = dev.alloc_arena("probe-cost-ints", 256).map_err(e)?;
    // The fused kernel's merge counters (zero between launches: the kernel's last block of
    // each head group resets its own) and the token's new K and V rows it stores.
    let counters = filled(dev, "probe-cost-counters", 4 * N_HEAD_KV as u64, 0).map_err(e)?;
    let kv_new = filled(dev, "probe-cost-kv-new", 4 * (N_HEAD_KV * HD) as u64, 0).map_err(e)?;
    let min_chunk = super::super::options::KernelOptions::default().attn_chunk;
    let l = decode_launcher(dev);
    let heads = probe_heads(&small).map_err(e)?;
    let mut points = Vec::new();
    for cells in CONTEXTS {
        let layer = 2 * cells * row_bytes;
        // One slot holds as many layers as fit; launches cycle through them.
        let layers = (COST_ARENA_BYTES / layer).max(1);
        let n = PASS_BYTES.div_ceil(layer).clamp(4, 1024);
        // slot 0, position cells - 1, n_ctx cells.
        dev.htod(
            &[0i32, cells as i32 - 1, cells as i32],
            ints.view(0, 12).map_err(e)?,
        )
        .map_err(e)?;
        let ms = graph_ms(dev, 5, &mut || {
            for i in 0..n {
                let base = (i % layers) * layer;
                let kvl = KvLayer {
                    kv: kv.all(),
                    slot_bytes: layers * layer,
                    k_off: base,
                    v_off: base + cells * row_bytes,
                    row_bytes,
                    cells,
                    ty: KV_TY_F16,
                    host: KvHostArg::none(),
                    slot: ints.view(0, 4)?,
                    pos: ints.view(4, 4)?,
                };
                let sp = Splits {
                    n: strata_schemas::workset::att_splits(cells as usize).min(splits),
                    part_o: part_o.all(),
                    part_ms: part_ms.all(),
                };
                // The decode attention the engine runs by default (`dq_attn_fused`: QK-norm,
                // RoPE, the KV store, the split attention and the merge in one launch).
                attn_fused(
                    &l,
                    heads,
                    q.all(),
                    kv_new.all(),
                    kv_new.all(),
                    kvl,
                    sp,
                    min_chunk,
                    counters.all(),
                    out.all(),
                    1,
                )?;
            }
            Ok(())
        })
        .map_err(e)?;
        points.push((layer as f64, ms * 1e3 / n as f64));
    }
    latency_and_gbps(&points)
}

/// TFLOP/s of the prefill GEMM over Q8_0 weights.
fn gemm(dev: &CudaDevice) -> Result<f64, CudaError> {
    gemm_of(dev, GgmlType::Q8_0, REPS)
}

/// TFLOP/s of the prefill GEMM over `ty` weights, `reps` timed runs.
pub(super) fn gemm_of(dev: &CudaDevice, ty: GgmlType, reps: usize) -> Result<f64, CudaError> {
    let row_bytes = crate::quant::row_bytes(ty, COLS).map_err(|err| CudaError::Shape {
        op: "cost probe",
        detail: err.to_string(),
    })? as u64;
    let w = filled(dev, "probe-cost-gemm-w", row_bytes * GEMM_ROWS as u64, 0x11)?;
    let x = filled(dev, "probe-cost-gemm-x", 4 * (GEMM_TOK * COLS) as u64, 0)?;
    let y = dev.alloc_arena("probe-cost-gemm-y", 4 * (GEMM_TOK * GEMM_ROWS) as u64)?;
    let scratch = dev.alloc_arena(
        "probe-cost-gemm-scratch",
        crate::backend::cuda::gemm::gemm_scratch_bytes(GEMM_TOK, COLS),
    )?;
    let ms = stream_ms(dev, reps, &mut || {
        dev.gemm(
            w.all(),
            ty,
            GEMM_ROWS,
            COLS,
            x.all(),
            GEMM_TOK,
            y.all(),
            scratch.all(),
        )
    })?;
    let flops = 2.0 * (GEMM_ROWS * COLS * GEMM_TOK) as f64;
    Ok(flops / (ms * 1e-3) / 1e12)
}

/// TFLOP/s of prefill attention, counting `2 n_head (hd_k + hd_v)` flops per (token, visible
/// cell) pair as the planner's `attn_cell_flops` does.
fn prefill_attention(dev: &CudaDevice) -> Result<f64, CudaError> {
    let row_bytes = (N_HEAD_KV * HD * 2) as u64;
    let cells = PREFILL_TOK as u64;
    let kv = filled(dev, "probe-cost-pf-kv", 2 * cells * row_bytes, 0x11)?;
    let q = filled(
        dev,
        "probe-cost-pf-q",
        4 * (PREFILL_TOK * N_HEAD * HD) as u64,
        0,
    )?;
    let out = dev.alloc_arena("probe-cost-pf-out", 4 * (PREFILL_TOK * N_HEAD * HD) as u64)?;
    let ints = dev.alloc_arena("probe-cost-pf-ints", 4 * (PREFILL_TOK as u64 + 1))?;
    let mut host = vec![0i32];
    host.extend(0..PREFILL_TOK as i32);
    dev.htod(&host, ints.all())?;
    let a = PrefillAttn {
        q: q.all().ptr(),
        kv: kv.all().ptr(),
        slot: ints.all().ptr(),
        pos: ints.view(4, 4 * PREFILL_TOK as u64)?.ptr(),
        slot_bytes: 2 * cells * row_bytes,
        k_off: 0,
        v_off: cells * row_bytes,
        row_bytes,
        kv_ty: KV_TY_F16,
        n_head: N_HEAD,
        n_head_kv: N_HEAD_KV,
        hd: HD,
        scale: 1.0 / (HD as f32).sqrt(),
        n_tok: PREFILL_TOK,
        out: out.all().ptr(),
        host: KvHostArg::none(),
    };
    let ms = stream_ms(dev, REPS, &mut || {
        // SAFETY: q and out hold n_tok x n_head x hd f32; slot is one i32 (0) and pos n_tok
        // i32 0..n_tok, so every row read (cells 0..n_tok of slot 0's K and V) lies inside
        // the kv arena of 2 x n_tok rows; all arenas outlive the synchronized timing.
        unsafe { attn_prefill(dev, &a) }
    })?;
    let pairs = (PREFILL_TOK * (PREFILL_TOK + 1) / 2) as f64;
    let flops = pairs * (2 * N_HEAD * 2 * HD) as f64;
    Ok(flops / (ms * 1e-3) / 1e12)
}

/// µs a decode step costs beyond its kernels: launching its graph, waiting, the token back.
fn step_us(dev: &CudaDevice, launch_us: f64) -> Result<f64, CudaError> {
    let l = Launcher::new(dev);
    let tok = filled(dev, "probe-cost-token", 256, 0)?;
    let graph = capture(dev, &mut || spin(&l, 0))?;
    let mut back = [0i32; 1];
    let step = |back: &mut [i32]| -> Result<(), CudaError> {
        graph.launch().map_err(drv("cuGraphLaunch"))?;
        dev.dtoh(tok.view(0, 4)?, back)
    };
    for _ in 0..10 {
        step(&mut back)?;
    }
    let t = std::time::Instant::now();
    for _ in 0..STEPS {
        step(&mut back)?;
    }
    let us = t.elapsed().as_secs_f64() * 1e6 / STEPS as f64;
    Ok((us - launch_us).max(0.1))
}

/// Probe-file lines for `[device.cost]` (a `#` line saying how before each key), or nothing
/// when no key was measured.
pub fn cost_toml(m: &CostMeasure) -> String {
    use std::fmt::Write as _;
    let keys = [
        ("launch_us", m.launch_us),
        ("product_latency_us", m.product_latency_us),
        ("product_gbps", m.product_gbps),
        ("attention_latency_us", m.attention_latency_us),
        ("attention_gbps", m.attention_gbps),
        ("gemm_tflops", m.gemm_tflops),
        ("prefill_attention_tflops", m.prefill_attention_tflops),
        ("step_us", m.step_us),
        ("host_expert_gbps", m.host_expert_gbps),
        ("host_expert_pinned_gbps", m.host_expert_pinned_gbps),
        ("expert_latency_us", m.expert_latency_us),
        ("expert_gbps", m.expert_gbps),
        ("expert_pass_gbps", m.expert_pass_gbps),
        ("expert_gemm_tflops", m.expert_gemm_tflops),
        ("host_matvec_gbps", m.host_matvec_gbps),
        ("host_expert_latency_us", m.host_expert_latency_us),
        ("host_round_trip_us", m.host_round_trip_us),
        ("kv_host_round_trip_us", m.kv_host_round_trip_us),
        ("eager_launch_us", m.eager_launch_us),
        (
            "expert_gemm_tokens_per_expert",
            m.expert_gemm_tokens_per_expert,
        ),
        ("delta_rule_token_us", m.delta_rule_token_us),
        ("delta_rule_latency_us", m.delta_rule_latency_us),
        ("linear_state_gbps", m.linear_state_gbps),
    ];
    let mut out = String::new();
    if keys.iter().all(|(_, v)| v.is_none()) && m.types.is_empty() {
        for n in &m.notes {
            let _ = writeln!(out, "# [device.cost] {n}");
        }
        return out;
    }
    let _ = writeln!(out, "[device.cost]");
    let _ = writeln!(
        out,
        "# the engine's own kernels timed on this device over synthetic buffers (strata-exec probe)"
    );
    for (key, v) in keys {
        match v {
            Some(v) => {
                for (_, how) in m.how.iter().filter(|(k, _)| *k == key) {
                    let _ = writeln!(out, "# {how}");
                }
                let _ = writeln!(out, "{key} = {v:.3}");
            }
            None => {
                let _ = writeln!(out, "# {key} not measured: the planner uses its default");
            }
        }
    }
    for n in &m.notes {
        let _ = writeln!(out, "# note: {n}");
    }
    if !m.types.is_empty() {
        let _ = writeln!(out, "# types: {}", super::types::how());
        out.push_str(&super::types::types_toml(&m.types));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_fit_recovers_latency_and_bandwidth() {
        // 7.2 µs plus bytes at 3000 GB/s (3e6 bytes per µs).
        let pts: Vec<(f64, f64)> = [1e6, 4e6, 16e6, 64e6]
            .iter()
            .map(|&b| (b, 7.2 + b / 3e6))
            .collect();
        let (lat, g) = latency_and_gbps(&pts).unwrap();
        assert!((lat - 7.2).abs() < 1e-6, "{lat}");
        assert!((g - 3000.0).abs() < 1e-6, "{g}");
    }

    #[test]
    fn line_fit_refuses_flat_or_single_points() {
        assert_eq!(fit_line(&[(1.0, 2.0)]), None);
        assert_eq!(fit_line(&[(1.0, 2.0), (1.0, 3.0)]), None);
        assert!(latency_and_gbps(&[(1.0, 5.0), (2.0, 4.0)]).is_err());
        // A line under the origin keeps its slope and clamps the latency to 0.
        let (lat, g) = latency_and_gbps(&[(1e6, 0.0), (2e6, 1.0)]).unwrap();
        assert_eq!(lat, 0.0);
        assert!((g - 1000.0).abs() < 1e-9, "{g}");
    }

    #[test]
    fn cost_toml_parses_as_a_device_table() {
        let m = CostMeasure {
            launch_us: Some(2.5),
            product_gbps: Some(3000.0),
            expert_gemm_tokens_per_expert: Some(32.0),
            delta_rule_token_us: Some(0.8),
            linear_state_gbps: Some(2500.0),
            notes: vec!["attention not measured: x".into()],
            types: vec![
                (
                    GgmlType::Q8_0,
                    strata_schemas::probe::TypeRates {
                        product_gbps: Some(3000.0),
                        gemm_tflops: Some(100.0),
                        ..Default::default()
                    },
                ),
                (
                    GgmlType::Iq3S,
                    strata_schemas::probe::TypeRates {
                        expert_gbps: Some(1500.0),
                        ..Default::default()
                    },
                ),
            ],
            ..Default::default()
        };
        let text = format!(
            "[host]\nram_bytes = 1\navailable_bytes = 1\n[[device]]\nindex = 0\nname = \"g\"\nvendor = \"nvidia\"\narch = \"sm_90\"\nvram_bytes = 85899345920\n{}",
            cost_toml(&m)
        );
        let p = strata_schemas::probe::HardwareProbe::from_toml(&text, "test").unwrap();
        let c = p.devices[0].cost.clone().unwrap();
        assert_eq!(c.launch_us, Some(2.5));
        assert_eq!(c.product_gbps, Some(3000.0));
        assert_eq!(c.gemm_tflops, None);
        assert_eq!(c.expert_gemm_tokens_per_expert, Some(32.0));
        assert_eq!(
            c.linear_entries(),
            [
                ("delta_rule_token_us", Some(0.8)),
                ("delta_rule_latency_us", None),
                ("linear_state_gbps", Some(2500.0)),
            ]
        );
        let q8 = c.type_rates(GgmlType::Q8_0).unwrap();
        assert_eq!(
            (q8.product_gbps, q8.gemm_tflops),
            (Some(3000.0), Some(100.0))
        );
        let iq = c.type_rates(GgmlType::Iq3S).unwrap();
        assert_eq!((iq.expert_gbps, iq.product_gbps), (Some(1500.0), None));
        assert_eq!(c.types.len(), 2);
    }
}
