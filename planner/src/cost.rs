//! The cost model: one device's share of a decode step and a prefill pass as [`DeviceCost`]
//! terms (seconds), from the model's bytes and weights in its layer range and the device's
//! coefficients — the probe's `[device.cost]` keys, or the documented defaults below.
//! Invariant: every term is a count of launches times a latency, bytes over a bandwidth, or
//! flops over a throughput, with the coefficient it used named in [`Coefficients`]; a
//! coefficient not in the probe is a default and makes the prediction a guess.
//!
//! Defaults (calibrated on the H200, BENCHMARKS.md "CUDA engine": per-kernel profile of the
//! Qwen3-30B-A3B-shaped Q8_0 decode step and the pp512 prefill). A least-squares fit of the
//! one-token products' isolated times against their bytes gives 7.2 µs plus bytes at
//! 3.01 TB/s (63% of the 4.8 TB/s datasheet figure); RMSNorm, a launch that reads next to
//! nothing, takes 2.8 µs; the fused decode attention 17.8 µs at about 600 cells; the prefill
//! products about 108 TFLOP/s (22.5 flops per byte/s of datasheet bandwidth) and its flash
//! attention 52.7 TFLOP/s (49% of that).

use crate::facts::ModelFacts;
use strata_schemas::capability::{capability, Backend};
use strata_schemas::ggml::GgmlType;
use strata_schemas::inventory::{ModelInventory, TensorRole};
use strata_schemas::plan::DeviceCost;
use strata_schemas::probe::{DeviceProbe, TypeRates, Vendor};

/// Dense product launches a decode layer makes on the GPU engine: Q/K/V, output projection,
/// router. Plus the expert pair (gate-up, down), one RMSNorm and one attention launch.
const GPU_DENSE_PRODUCTS: f64 = 3.0;
/// Launches of a decode step outside the layers: embedding rows, positions, output norm,
/// argmax (the head is one more product).
const GPU_STEP_LAUNCHES: f64 = 4.0;
/// Tokens of a step one GPU product launch serves for the time of one read of its weights:
/// the multi-token products (`dq_rows_*`, rows.cu) read each weight once per launch, but past
/// about four tokens their f32 multiply-adds take longer than the read. On the H200 the LM
/// head (151,936 x 2048 Q8_0) took 168, 172, 268, 469 and 891 µs at 1, 4, 8, 16 and 32
/// tokens (backend_ops `multi_token_product_timings`): one read's time per ~6 tokens.
const GPU_ROWS_PER_READ: u32 = 6;
/// Launches of a prefill layer: norms, the Q/K/V/output GEMMs, flash attention, router and
/// its top-k, the expert sort, the grouped gate/up and down products, the combine.
const GPU_PREFILL_LAUNCHES: f64 = 10.0;
/// f32 rows of `n_embd` a prefill token reads and writes per layer between launches, beyond
/// two per expert it uses (the combine).
const PREFILL_ACT_ROWS: f64 = 10.0;
/// Ops (parallel sections) of a CPU decode layer: norms, projections, attention, router, and
/// gate/up/down per expert used (add `3 x n_expert_used`).
const CPU_LAYER_OPS: f64 = 8.0;
/// Default host expert matvec rate (GB/s of expert bytes, every core): a guess for a
/// desktop's dual-channel DDR5 or a server share; `host_matvec_gbps` replaces it.
const HOST_MATVEC_GBPS: f64 = 40.0;
/// Default round trip of a decode layer computing misses on the CPU (µs), the device waiting:
/// the rows read back with a stream synchronisation, the picks and the sum up, the thread
/// pool's wake-up, the combine launch; `host_round_trip_us`. A conservative guess: the H200
/// machine measured about 600 µs a layer in the engine (BENCHMARKS.md "Experts and KV beyond
/// VRAM": 1/28.3 - 1/177.7 s over 48 layers), where the hot host products alone fit 40 µs.
const HOST_ROUND_TRIP_US: f64 = 600.0;
/// Default round trip of an attention layer whose spilled cells the host attends (µs): the
/// query rows back with a synchronisation, the pool's wake-up, the partials up and the
/// merge; `kv_host_round_trip_us`. A conservative guess from the H200 machine (BENCHMARKS.md
/// "Experts and KV beyond VRAM": `--kv-host cpu` at depth 6144 cost about 180 ms a step
/// over 48 attention layers, of which the host's reads of 2048 cells are ~5 ms).
const KV_HOST_ROUND_TRIP_US: f64 = 3500.0;
/// Default host time of one kernel launched outside a graph (µs); `eager_launch_us`. A
/// guess: the CUDA driver's launch call costs a few µs of host time on current CPUs.
const EAGER_LAUNCH_US: f64 = 5.0;
/// Kernels a GPU decode layer launches (norms, Q/K/V, QK-norm and RoPE, KV store, attention
/// splits and merge, output, router and top-k, the expert pair, the combine): what a step
/// launched eagerly pays `eager_launch_us - launch_us` for, beside [`GPU_STEP_LAUNCHES`].
/// An estimate of the CUDA engine's launch count, not a measurement.
const GPU_LAYER_KERNELS: f64 = 14.0;

/// Tokens an expert of the probe's grouped-products measurement when the probe does not say
/// (`expert_gemm_tokens_per_expert`): every probe before the key measured 512 tokens, top-8
/// of 128 experts (`probe/experts.rs`).
const PROBE_EXPERT_GEMM_TPE: f64 = 32.0;
/// The delta rule's reference state (the probe's heads: 32 value heads of 128 x 128 f32),
/// bytes of one layer and slot.
const DELTA_REF_STATE_BYTES: f64 = (32 * 128 * 128 * 4) as f64;
/// Default µs of one token's step of one linear layer inside a GPU prefill run
/// (`delta_rule_token_us`). A guess, never measured: `lin_delta_rule` runs one warp per state
/// row with the row in registers, each token three dependent warp reductions, the gates and
/// the q/k rows from L2 (about 1,500-2,000 cycles); the kernel it replaced took 19.7 µs a
/// token (10.1 ms for 512 on the H200, BENCHMARKS.md, 2026-12-05 morning).
const DELTA_TOKEN_US: f64 = 1.0;
/// Default µs of a decode step's delta rule per linear layer beyond its state bytes
/// (`delta_rule_latency_us`): its two launches (the rule and the gated norm). A guess: about
/// a product's latency plus a launch; the replaced kernel took 36.6 µs a launch.
const DELTA_LATENCY_US: f64 = 10.0;

/// Coefficients of one device in SI units, and which of them were defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct Coefficients {
    pub launch_s: f64,
    pub product_latency_s: f64,
    pub product_bps: f64,
    pub attention_latency_s: f64,
    pub attention_bps: f64,
    pub gemm_flops: f64,
    pub prefill_attention_flops: f64,
    pub step_s: f64,
    pub host_expert_bps: f64,
    /// The same from the plan's pinned host expert tier (one slot per copy).
    pub host_expert_pinned_bps: f64,
    /// A decode layer's expert pair beyond its bytes; expert bytes per second of its uses
    /// at a few tokens and over a many-token group; the grouped prefill products.
    pub expert_latency_s: f64,
    pub expert_bps: f64,
    pub expert_pass_bps: f64,
    pub expert_gemm_flops: f64,
    /// The hybrid miss path: expert bytes per second the host CPU's products read from host
    /// memory, and a decode layer's round trip when it computes any miss there; the same
    /// round trip of an attention layer attending spilled cells on the host; one kernel
    /// launched outside a graph.
    pub host_matvec_bps: f64,
    pub host_layer_s: f64,
    pub kv_host_layer_s: f64,
    pub eager_launch_s: f64,
    /// The grouped expert products' measured shape: tokens an expert
    /// (`expert_gemm_tokens_per_expert`).
    pub expert_gemm_tpe: f64,
    /// The delta rule (Qwen3-Next's linear layers): one token's step of one layer at the
    /// probe's reference heads inside a prefill run, a decode step's launches per layer
    /// beyond the state, and the state bytes per second (read and written once a step).
    pub delta_token_s: f64,
    pub delta_latency_s: f64,
    pub linear_state_bps: f64,
    /// Linear-attention keys that took the default (a guess where the model has linear
    /// layers: [`Coefficients::for_model`] adds them to `defaulted` then).
    pub linear_defaulted: Vec<&'static str>,
    /// Probe keys that took the default.
    pub defaulted: Vec<&'static str>,
    /// Host keys of the miss path that took the default (a guess only where the device
    /// misses).
    pub host_defaulted: Vec<&'static str>,
    /// The probe's `[device.cost.types.<TYPE>]` tables (see [`Coefficients::factor`]).
    pub type_rates: Vec<(GgmlType, TypeRates)>,
    /// Whether the device is the CPU (whose family rates stand for every type).
    pub cpu: bool,
    /// Weight types of the model (from [`Coefficients::for_model`]) whose rate for some
    /// family is the default ratio, as "TYPE family_key": a guess.
    pub type_defaulted: Vec<String>,
}

/// The product families whose rates the probe gives per weight type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// One-token dense products (`product_gbps`).
    Product,
    /// The decode expert pair and its many-token passes (`expert_gbps`, `expert_pass_gbps`).
    Expert,
    /// Prefill products (`gemm_tflops`).
    Gemm,
    /// Prefill grouped expert products (`expert_gemm_tflops`).
    ExpertGemm,
}

impl Family {
    pub const ALL: [Family; 4] = [
        Family::Product,
        Family::Expert,
        Family::Gemm,
        Family::ExpertGemm,
    ];
    pub fn key(self) -> &'static str {
        match self {
            Family::Product => "product_gbps",
            Family::Expert => "expert_gbps",
            Family::Gemm => "gemm_tflops",
            Family::ExpertGemm => "expert_gemm_tflops",
        }
    }
    fn of(self, r: &TypeRates) -> Option<f64> {
        match self {
            Family::Product => r.product_gbps,
            Family::Expert => r.expert_gbps,
            Family::Gemm => r.gemm_tflops,
            Family::ExpertGemm => r.expert_gemm_tflops,
        }
    }
}

/// Default rate of a GPU's products over weights of `ty` as a fraction of the family's
/// (Q8_0) rate, where the probe has no `[device.cost.types]` figure; a guess the report
/// names. Q8_0 is the family itself, and F32/F16/BF16 take its rate (norm vectors and the
/// rare unquantised matrix). The other legacy and K-quants are scaled as measured for Q4_K
/// on the H200 (BENCHMARKS.md): decode at 0.83x llama.cpp where Q8_0 runs at 0.95x (0.87),
/// the prefill GEMM 10,920 tok/s against Q8_0's 14,855 on the same shape (0.74). The
/// lattice (IQ*) and MXFP4 decoders do more work per byte: 0.75 and 0.60, unmeasured.
pub fn default_type_ratio(ty: GgmlType, family: Family) -> f64 {
    use GgmlType::*;
    let decode = matches!(family, Family::Product | Family::Expert);
    match ty {
        Q8_0 | F32 | F16 | BF16 => 1.0,
        Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q2K | Q3K | Q4K | Q5K | Q6K => {
            if decode {
                0.87
            } else {
                0.74
            }
        }
        _ => {
            if decode {
                0.75
            } else {
                0.60
            }
        }
    }
}

impl Coefficients {
    /// The probe's `[device.cost]` values, defaults for the rest (see the module docs).
    pub fn of(dev: &DeviceProbe) -> Self {
        let bw = dev.mem_bandwidth();
        let cpu = dev.vendor == Vendor::Cpu;
        // (launch us, product latency us, product share of bandwidth, attention latency us,
        //  attention share, flops per byte/s of bandwidth, step us)
        let (launch, lat, prod, att_lat, att, fpb, step) = if cpu {
            (5.0, 10.0, 0.5, 10.0, 0.5, 2.0, 20.0)
        } else {
            (2.8, 7.2, 0.627, 16.5, 0.4, 22.5, 25.0)
        };
        let c = dev.cost.clone().unwrap_or_default();
        let mut defaulted = Vec::new();
        let mut get = |key: &'static str, v: Option<f64>, default: f64| {
            v.unwrap_or_else(|| {
                defaulted.push(key);
                default
            })
        };
        let gemm_tflops = get("gemm_tflops", c.gemm_tflops, fpb * bw / 1e3);
        let product_latency_us = get("product_latency_us", c.product_latency_us, lat);
        let product_gbps = get("product_gbps", c.product_gbps, prod * bw);
        let mut out = Self {
            launch_s: get("launch_us", c.launch_us, launch) * 1e-6,
            product_latency_s: product_latency_us * 1e-6,
            product_bps: product_gbps * 1e9,
            attention_latency_s: get("attention_latency_us", c.attention_latency_us, att_lat)
                * 1e-6,
            attention_bps: get("attention_gbps", c.attention_gbps, att * bw) * 1e9,
            gemm_flops: gemm_tflops * 1e12,
            prefill_attention_flops: get(
                "prefill_attention_tflops",
                c.prefill_attention_tflops,
                if cpu { gemm_tflops } else { 0.49 * gemm_tflops },
            ) * 1e12,
            step_s: get("step_us", c.step_us, step) * 1e-6,
            host_expert_bps: get("host_expert_gbps", c.host_expert_gbps, dev.h2d()) * 1e9,
            host_expert_pinned_bps: get(
                "host_expert_pinned_gbps",
                c.host_expert_pinned_gbps,
                dev.h2d(),
            ) * 1e9,
            // The CPU engine's experts are its products (the same matmul): their figures.
            expert_latency_s: 2.0 * product_latency_us * 1e-6,
            expert_bps: product_gbps * 1e9,
            expert_pass_bps: product_gbps * 1e9,
            expert_gemm_flops: gemm_tflops * 1e12,
            host_matvec_bps: 0.0,
            host_layer_s: 0.0,
            kv_host_layer_s: 0.0,
            eager_launch_s: 0.0,
            expert_gemm_tpe: PROBE_EXPERT_GEMM_TPE,
            delta_token_s: 0.0,
            delta_latency_s: 0.0,
            linear_state_bps: 0.0,
            linear_defaulted: Vec::new(),
            defaulted: Vec::new(),
            host_defaulted: Vec::new(),
            type_rates: Vec::new(),
            cpu,
            type_defaulted: Vec::new(),
        };
        out.type_rates = c
            .types
            .iter()
            .filter_map(|(k, v)| GgmlType::from_name(k).map(|t| (t, v.clone())))
            .collect();
        let mut host_defaulted = Vec::new();
        let mut host = |key: &'static str, v: Option<f64>, default: f64| {
            v.unwrap_or_else(|| {
                host_defaulted.push(key);
                default
            })
        };
        out.host_matvec_bps = host("host_matvec_gbps", c.host_matvec_gbps, HOST_MATVEC_GBPS) * 1e9;
        out.host_layer_s = host(
            "host_round_trip_us",
            c.host_round_trip_us,
            HOST_ROUND_TRIP_US,
        ) * 1e-6;
        out.kv_host_layer_s = host(
            "kv_host_round_trip_us",
            c.kv_host_round_trip_us,
            KV_HOST_ROUND_TRIP_US,
        ) * 1e-6;
        out.eager_launch_s = if cpu {
            0.0
        } else {
            host("eager_launch_us", c.eager_launch_us, EAGER_LAUNCH_US) * 1e-6
        };
        if !cpu {
            // Expert defaults (H200, BENCHMARKS.md "Predictions"): the decode pair 17 µs
            // plus bytes at 45% of the datasheet bandwidth, a 256-token group at 25%; the
            // grouped prefill products at the dense default (fitted on whole pp512 passes).
            out.expert_latency_s = get("expert_latency_us", c.expert_latency_us, 17.0) * 1e-6;
            out.expert_bps = get("expert_gbps", c.expert_gbps, 0.45 * bw) * 1e9;
            out.expert_pass_bps = get("expert_pass_gbps", c.expert_pass_gbps, 0.25 * bw) * 1e9;
            out.expert_gemm_flops =
                get("expert_gemm_tflops", c.expert_gemm_tflops, gemm_tflops) * 1e12;
        }
        out.expert_gemm_tpe = c
            .expert_gemm_tokens_per_expert
            .unwrap_or(PROBE_EXPERT_GEMM_TPE);
        out.delta_terms(&c);
        Self {
            defaulted,
            host_defaulted,
            ..out
        }
    }

    /// The delta rule's coefficients: the probe's keys, else on a GPU the documented guesses
    /// ([`DELTA_TOKEN_US`], [`DELTA_LATENCY_US`], the state at `product_gbps`) and on the CPU
    /// the engine's own rates (its recurrence reads and writes the state every token, at the
    /// products' rate; a step's state likewise; no launch beyond its ops).
    fn delta_terms(&mut self, c: &strata_schemas::probe::CostProbe) {
        let mut missing = Vec::new();
        let mut get = |key: &'static str, v: Option<f64>, default: f64| {
            v.unwrap_or_else(|| {
                missing.push(key);
                default
            })
        };
        let state_gbps = get(
            "linear_state_gbps",
            c.linear_state_gbps,
            self.product_bps / 1e9,
        );
        self.linear_state_bps = state_gbps * 1e9;
        if self.cpu {
            let reference = 2.0 * DELTA_REF_STATE_BYTES / self.linear_state_bps;
            self.delta_token_s = c.delta_rule_token_us.map_or(reference, |v| v * 1e-6);
            self.delta_latency_s = c.delta_rule_latency_us.map_or(0.0, |v| v * 1e-6);
            // Derived from measured rates: not a guess.
            self.linear_defaulted = Vec::new();
            return;
        }
        self.delta_token_s =
            get("delta_rule_token_us", c.delta_rule_token_us, DELTA_TOKEN_US) * 1e-6;
        self.delta_latency_s = get(
            "delta_rule_latency_us",
            c.delta_rule_latency_us,
            DELTA_LATENCY_US,
        ) * 1e-6;
        self.linear_defaulted = missing;
    }

    /// [`Coefficients::of`] with [`Coefficients::type_defaulted`] filled in for the weight
    /// types of `facts`'s model.
    pub fn for_model(dev: &DeviceProbe, facts: &ModelFacts) -> Self {
        let mut c = Self::of(dev);
        if facts.delta_state_bytes > 0 {
            let linear = c.linear_defaulted.clone();
            c.defaulted.extend(linear);
        }
        let mut types: Vec<GgmlType> = facts
            .dense_types
            .iter()
            .chain(&facts.expert_types)
            .flatten()
            .chain(&facts.head_types)
            .map(|s| s.ty)
            .collect();
        types.sort();
        types.dedup();
        for ty in types {
            for fam in Family::ALL {
                if c.factor(ty, fam).1 {
                    c.type_defaulted
                        .push(format!("{} {}", ty.name(), fam.key()));
                }
            }
        }
        c
    }

    /// The family's rate in SI units (bytes/s or flop/s).
    fn family_rate(&self, family: Family) -> f64 {
        match family {
            Family::Product => self.product_bps,
            Family::Expert => self.expert_bps,
            Family::Gemm => self.gemm_flops,
            Family::ExpertGemm => self.expert_gemm_flops,
        }
    }

    /// How much longer a byte (or flop) of `ty` takes than the family's rate says, and
    /// whether that is a guess. A probed type counts against the table's own Q8_0 entry
    /// (the same measurement) when it has one, else against the family key; an unprobed
    /// type on a GPU takes [`default_type_ratio`]; the CPU's family rates stand for every
    /// type. Exactly 1 for Q8_0 without a table, so an old probe predicts what it did.
    pub fn factor(&self, ty: GgmlType, family: Family) -> (f64, bool) {
        let rate = |t: GgmlType| {
            self.type_rates
                .iter()
                .find(|(x, _)| *x == t)
                .and_then(|(_, r)| family.of(r))
        };
        if let Some(r) = rate(ty) {
            return match rate(GgmlType::Q8_0) {
                Some(q8) => (q8 / r, false),
                None => {
                    let unit = if matches!(family, Family::Gemm | Family::ExpertGemm) {
                        1e12
                    } else {
                        1e9
                    };
                    (self.family_rate(family) / (r * unit), false)
                }
            };
        }
        if self.cpu {
            return (1.0, false);
        }
        let ratio = default_type_ratio(ty, family);
        (1.0 / ratio, ratio != 1.0)
    }

    /// `total` (bytes or weights at the family's rate) plus what `shares`' types add to it.
    fn weigh(
        &self,
        total: f64,
        shares: &[crate::facts::TypeShare],
        family: Family,
        params: bool,
    ) -> f64 {
        total
            + shares
                .iter()
                .map(|s| {
                    let n = if params { s.params } else { s.bytes } as f64;
                    n * (self.factor(s.ty, family).0 - 1.0)
                })
                .sum::<f64>()
    }

    /// Whether any coefficient is a default (the prediction is a guess).
    pub fn guessed(&self) -> bool {
        !self.defaulted.is_empty() || !self.type_defaulted.is_empty()
    }
}

/// What one device of a plan holds and serves.
pub struct DeviceShare {
    /// Main layers `[a, b)`.
    pub a: u32,
    pub b: u32,
    pub holds_head: bool,
    /// Expected expert uses per token served from the cache, and in total.
    pub cached_mass: f64,
    pub total_mass: f64,
    /// Whether the cache's slots hold every expert of `[a, b)` (no expert stays in host
    /// memory, whatever the hit rate says).
    pub experts_covered: bool,
    /// KV cells per slot in device memory.
    pub kv_resident: u64,
    /// How the hidden state arrives: "none", "peer" or "host".
    pub handoff_in: &'static str,
    /// Whether the device's backend prefills on tensor cores (see [`prefill_gemm`]).
    pub prefill_gemm: bool,
    /// Each expert's expected uses per token, busiest first, averaged over the expert layers
    /// of `[a, b)` (`ExpertOracle::rank_shares`): empty for uniform routing.
    pub expert_shares: Vec<f64>,
}

/// Whether a GPU engine of `vendor` prefills `inv` on tensor-core products: its backend
/// takes every projection and expert type in its GEMM list.
pub fn prefill_gemm(inv: &ModelInventory, vendor: Vendor) -> bool {
    let types = match vendor {
        Vendor::Nvidia => capability(Backend::Cuda).prefill_gemm_types,
        Vendor::Amd => capability(Backend::Cuda).prefill_gemm_types,
        Vendor::Cpu => return false,
    };
    let projection = |t: &strata_schemas::inventory::TensorInfo| {
        t.layer.is_some()
            && (t.role == TensorRole::ExpertStack || t.dims.len() >= 2)
            && !t.name.contains("norm")
            && !t.name.contains("gate_inp")
    };
    inv.tensors
        .iter()
        .filter(|t| projection(t))
        .all(|t| types.contains(&t.ggml_type) || t.ggml_type == GgmlType::F32)
}

/// The cost terms of `dev` (whose coefficients are `c`) holding `share` of the model.
pub fn device_cost(
    facts: &ModelFacts,
    dev: &DeviceProbe,
    c: &Coefficients,
    share: &DeviceShare,
) -> DeviceCost {
    let (a, b) = (share.a, share.b);
    let layers = f64::from(b - a);
    let k = facts.n_expert_used as f64;
    let expert_layers = facts.expert_layers(a, b);
    let avg = |v: &[u64]| -> f64 {
        let (sum, n) = v[a as usize..b as usize]
            .iter()
            .filter(|x| **x > 0)
            .fold((0u64, 0u64), |(s, n), x| (s + x, n + 1));
        if n == 0 {
            0.0
        } else {
            sum as f64 / n as f64
        }
    };
    let expert_bytes = avg(&facts.expert);
    // What each weight type adds over its family's (Q8_0) rate: a layer's dense tensors,
    // one expert (averaged over the expert layers as `avg` does) and the head.
    let range = a as usize..b as usize;
    let dense_extra = |family: Family, params: bool| -> f64 {
        facts.dense_types[range.clone()]
            .iter()
            .map(|v| c.weigh(0.0, v, family, params))
            .sum()
    };
    let expert_extra = |family: Family, params: bool| -> f64 {
        let (sum, n) = facts.expert_types[range.clone()]
            .iter()
            .zip(&facts.expert[range.clone()])
            .filter(|(_, x)| **x > 0)
            .fold((0.0, 0u64), |(s, n), (v, _)| {
                (s + c.weigh(0.0, v, family, params), n + 1)
            });
        if n == 0 {
            0.0
        } else {
            sum / n as f64
        }
    };
    let expert_read_bytes = expert_bytes + expert_extra(Family::Expert, false);
    let expert_params = avg(&facts.expert_params) + expert_extra(Family::ExpertGemm, true);
    let dense_params = facts.dense_params[range.clone()].iter().sum::<u64>() as f64
        + dense_extra(Family::Gemm, true);
    let attn_layers = facts.attention[a as usize..b as usize]
        .iter()
        .filter(|x| **x)
        .count() as f64;
    let mut dense_bytes = facts.dense_range(a, b) as f64 + dense_extra(Family::Product, false);
    let mut step = c.step_s;
    let head_compute_s = if share.holds_head {
        dense_bytes = c.weigh(
            dense_bytes + facts.head_bytes as f64,
            &facts.head_types,
            Family::Product,
            false,
        );
        2.0 * c.weigh(
            facts.head_params as f64,
            &facts.head_types,
            Family::Gemm,
            true,
        ) / c.gemm_flops
    } else {
        0.0
    };
    let cpu = dev.vendor == Vendor::Cpu;
    if cpu {
        step += layers * (CPU_LAYER_OPS + 3.0 * k) * c.launch_s;
        if share.holds_head {
            step += 2.0 * c.launch_s;
        }
    } else {
        step += layers
            * (c.launch_s + GPU_DENSE_PRODUCTS * c.product_latency_s + c.attention_latency_s)
            + expert_layers as f64 * c.expert_latency_s;
        if share.holds_head {
            step += GPU_STEP_LAUNCHES * c.launch_s + c.product_latency_s;
        }
    }
    // The linear layers' state, read and written once a step per slot (a prefill pass once),
    // and the delta rule: a decode step's launches, a prefill token's serial chain.
    let linear_layers = facts.linear_state[range.clone()]
        .iter()
        .filter(|x| **x > 0)
        .count() as f64;
    let state_row_s = if linear_layers > 0.0 {
        2.0 * facts.linear_range(a, b) as f64 / c.linear_state_bps
    } else {
        0.0
    };
    step += linear_layers * c.delta_latency_s;
    let delta_token_s = linear_layers * c.delta_token_s * delta_scale(facts, cpu);
    // The hidden state in: a peer copy or a trip through pinned host memory, one row a slot.
    let row_bytes = facts.n_embd as f64 * 4.0;
    let mut row_s = state_row_s;
    match share.handoff_in {
        "peer" => step += 2.0 * c.launch_s,
        "host" => {
            step += 4.0 * c.launch_s;
            row_s += 2.0 * row_bytes / (dev.h2d() * 1e9);
        }
        _ => {}
    }
    let kv_cell = facts.kv_cell_range(a, b) as f64;
    // Dense products at the GEMM's rate, routed experts at the grouped products' rate.
    let expert_gemm_s = 2.0 * expert_layers as f64 * k * expert_params / c.expert_gemm_flops;
    let token_compute_s = 2.0 * dense_params / c.gemm_flops + expert_gemm_s;
    let (rows_per_read, per_use, pass_launches) = if cpu {
        (u32::MAX, false, layers * (CPU_LAYER_OPS + 3.0 * k))
    } else {
        (GPU_ROWS_PER_READ, true, layers * GPU_PREFILL_LAUNCHES)
    };
    let pass_latency = if cpu { c.launch_s } else { c.product_latency_s };
    DeviceCost {
        step_s: step,
        dense_read_s: dense_bytes / c.product_bps,
        rows_per_read,
        token_compute_s,
        head_compute_s,
        expert_layers: expert_layers as u32,
        n_expert: facts.n_expert as u32,
        n_expert_used: facts.n_expert_used as u32,
        expert_read_s: expert_read_bytes / c.expert_bps,
        expert_pass_read_s: expert_read_bytes / c.expert_pass_bps,
        expert_read_per_use: per_use,
        hit_rate: if share.total_mass > 0.0 {
            (share.cached_mass / share.total_mass).min(1.0)
        } else {
            1.0
        },
        expert_miss_s: expert_bytes / c.host_expert_bps,
        host_expert_s: expert_bytes / c.host_matvec_bps,
        host_layer_s: c.host_layer_s,
        cpu_misses_per_token: 0,
        kv_cell_s: kv_cell / c.attention_bps,
        kv_host_cell_s: kv_cell / (dev.h2d() * 1e9),
        kv_cpu_cell_s: kv_cell / c.host_matvec_bps,
        kv_cpu_step_s: attn_layers * c.kv_host_layer_s,
        eager_step_s: if cpu {
            0.0
        } else {
            let kernels = layers * GPU_LAYER_KERNELS
                + if share.holds_head {
                    GPU_STEP_LAUNCHES + 1.0
                } else {
                    0.0
                };
            kernels * (c.eager_launch_s - c.launch_s).max(0.0)
        },
        kv_host_cpu: false,
        kv_resident: share.kv_resident,
        row_s,
        pass_s: pass_launches * pass_latency + c.step_s,
        prefill_gemm: share.prefill_gemm && !cpu,
        // The CUDA engine runs a stage's experts through its expert cache whenever some stay
        // in host memory: a prompt pass on the grouped tensor-core products reading the
        // slots through the layer's table where its types have them (each distinct expert
        // read once, as when all are resident, plus the misses streamed), else on the decode
        // products over groups of the pass's tokens (every use reads its expert).
        prefill_experts_per_use: !cpu && !share.experts_covered && !share.prefill_gemm,
        prefill_token_s: layers * (PREFILL_ACT_ROWS + 2.0 * k) * row_bytes / c.product_bps,
        prefill_cell_s: attn_layers * facts.attn_cell_flops as f64 / c.prefill_attention_flops,
        state_row_s,
        delta_token_s,
        expert_gemm_s,
        expert_gemm_ref_tpe: c.expert_gemm_tpe,
        expert_shares: share.expert_shares.clone(),
    }
}

/// How many reference layers' worth of delta-rule work one linear layer of `facts` is per
/// token: its state over the probe's reference state. A GPU runs up to the reference's rows
/// side by side (a latency-bound chain: a smaller layer is no faster, a larger one slower in
/// proportion); the CPU's recurrence is bound by its work, in proportion either way.
fn delta_scale(facts: &ModelFacts, cpu: bool) -> f64 {
    let r = facts.delta_state_bytes as f64 / DELTA_REF_STATE_BYTES;
    if cpu {
        r
    } else {
        r.max(1.0)
    }
}

/// The miss policy of a GPU device (the hybrid path): how many of a decode layer's misses
/// per token its host CPU computes while the device computes the hits and streams the rest,
/// the count in `0..=n_expert_used` whose decode step at batch 1 and empty context the cost
/// model finds shortest (the smallest on ties, so streaming wins a draw; but a count that
/// already covers the expected misses becomes `n_expert_used`, every miss, since a token's
/// misses vary about their mean). Nothing to choose where nothing misses.
pub fn choose_miss_policy(cost: &DeviceCost) -> u32 {
    if cost.expert_layers == 0 || cost.hit_rate >= 1.0 || cost.n_expert_used == 0 {
        return 0;
    }
    let at = |n: u32| {
        DeviceCost {
            cpu_misses_per_token: n,
            ..cost.clone()
        }
        .decode_step_seconds(1, 0)
    };
    let mut best = (f64::INFINITY, 0);
    for n in 0..=cost.n_expert_used {
        let t = at(n);
        if t < best.0 {
            best = (t, n);
        }
    }
    let all = cost.n_expert_used;
    if best.1 > 0 && at(all) <= best.0 * (1.0 + 1e-9) {
        return all;
    }
    best.1
}

/// The KV host policy of a GPU device (`--kv-host`): whether its decode attention over the
/// cells past `kv_resident` runs on the host CPU, beside the device's attention of the
/// window, rather than on the device reading them over PCIe. The cost model's decode step at
/// `batch` slots of a full `ctx`-cell context, the worst case the plan admits, decides: the
/// CPU when it is strictly shorter, so streaming wins a draw. Nothing to choose where
/// nothing spills.
pub fn choose_kv_host(cost: &DeviceCost, batch: u32, ctx: u64) -> bool {
    if ctx <= cost.kv_resident || cost.kv_cell_s <= 0.0 {
        return false;
    }
    let at = |cpu: bool| {
        DeviceCost {
            kv_host_cpu: cpu,
            ..cost.clone()
        }
        .decode_step_seconds(batch, ctx)
    };
    at(true) < at(false)
}

#[cfg(test)]
mod tests;
