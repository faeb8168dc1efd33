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
        Self {
            defaulted,
            host_defaulted,
            ..out
        }
    }

    /// [`Coefficients::of`] with [`Coefficients::type_defaulted`] filled in for the weight
    /// types of `facts`'s model.
    pub fn for_model(dev: &DeviceProbe, facts: &ModelFacts) -> Self {
        let mut c = Self::of(dev);
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
    // The hidden state in: a peer copy or a trip through pinned host memory, one row a slot.
    let row_bytes = facts.n_embd as f64 * 4.0;
    let mut row_s = 2.0 * facts.linear_range(a, b) as f64 / c.product_bps;
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
    let token_compute_s = 2.0 * dense_params / c.gemm_flops
        + 2.0 * expert_layers as f64 * k * expert_params / c.expert_gemm_flops;
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
        // The CUDA engine runs a stage's experts through its expert cache (the decode
        // products on groups of the pass's tokens) whenever some stay in host memory.
        prefill_experts_per_use: !cpu && !share.experts_covered,
        prefill_token_s: layers * (PREFILL_ACT_ROWS + 2.0 * k) * row_bytes / c.product_bps,
        prefill_cell_s: attn_layers * facts.attn_cell_flops as f64 / c.prefill_attention_flops,
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
mod tests {
    use super::*;
    use crate::testing::*;
    use strata_schemas::probe::{CostProbe, TypeRates};

    fn h200() -> DeviceProbe {
        let mut p = probe(&[(141 * G, 4800.0)], 128 * G, 120 * G);
        p.devices[0].h2d_gbps = Some(55.0);
        p.devices.remove(0)
    }

    fn whole(facts: &ModelFacts, gemm: bool) -> DeviceShare {
        DeviceShare {
            a: 0,
            b: facts.n_layer,
            holds_head: true,
            cached_mass: 1.0,
            total_mass: 1.0,
            experts_covered: true,
            kv_resident: 4096,
            handoff_in: "none",
            prefill_gemm: gemm,
        }
    }

    #[test]
    fn measured_keys_replace_defaults_and_clear_the_guess() {
        let mut d = h200();
        let c = Coefficients::of(&d);
        assert!(c.guessed());
        assert!((c.product_bps - 0.627 * 4800e9).abs() < 1.0);
        d.cost = Some(CostProbe {
            launch_us: Some(3.0),
            product_latency_us: Some(7.0),
            product_gbps: Some(3000.0),
            attention_latency_us: Some(17.0),
            attention_gbps: Some(2000.0),
            gemm_tflops: Some(100.0),
            prefill_attention_tflops: Some(50.0),
            step_us: Some(20.0),
            host_expert_gbps: Some(50.0),
            host_expert_pinned_gbps: Some(52.0),
            expert_latency_us: Some(17.0),
            expert_gbps: Some(2000.0),
            expert_pass_gbps: Some(1000.0),
            expert_gemm_tflops: Some(60.0),
            host_matvec_gbps: None,
            host_expert_latency_us: None,
            types: Default::default(),
            host_round_trip_us: None,
            kv_host_round_trip_us: None,
            eager_launch_us: None,
        });
        let c = Coefficients::of(&d);
        assert!(!c.guessed(), "{:?}", c.defaulted);
        assert_eq!(c.product_bps, 3000e9);
        assert_eq!(c.gemm_flops, 100e12);
        assert_eq!(c.host_expert_pinned_bps, 52e9);
    }

    /// The 30B Q8_0 model on an H200 whose cache holds about a third of the expert uses,
    /// misses copied at `link_gbps` and computed on the host at `host_gbps` after a round
    /// trip of `trip_us` a layer.
    fn offload_cost_trip(link_gbps: f64, host_gbps: f64, trip_us: f64) -> DeviceCost {
        let inv = inventory("qwen3moe", qwen3moe_hparams(), "Q8_0");
        let facts = ModelFacts::new(&inv, GgmlType::F16);
        let mut dev = h200();
        dev.cost = Some(CostProbe {
            host_expert_gbps: Some(link_gbps),
            host_matvec_gbps: Some(host_gbps),
            host_expert_latency_us: Some(40.0),
            host_round_trip_us: Some(trip_us),
            ..CostProbe::default()
        });
        let share = DeviceShare {
            cached_mass: 0.3,
            experts_covered: false,
            ..whole(&facts, true)
        };
        device_cost(&facts, &dev, &Coefficients::of(&dev), &share)
    }

    /// The same with a cheap 40 µs round trip.
    fn offload_cost(link_gbps: f64, host_gbps: f64) -> DeviceCost {
        offload_cost_trip(link_gbps, host_gbps, 40.0)
    }

    /// The decode step at batch 1 with `n` misses a token on the host.
    fn step_at(c: &DeviceCost, n: u32) -> f64 {
        DeviceCost {
            cpu_misses_per_token: n,
            ..c.clone()
        }
        .decode_step_seconds(1, 0)
    }

    /// BENCHMARKS.md "Experts and KV beyond VRAM": on the H200 machine (55 GB/s link) every
    /// layer sending misses to the host cost about 0.6 ms of round trip, and streaming won by
    /// 6-10x. With that figure the model streams; with the round trip left out (0 µs) it
    /// would take the split, so this fails if the term is dropped.
    #[test]
    fn a_measured_600_us_round_trip_makes_the_h200_stream() {
        use strata_schemas::plan::MissPolicy;
        let mut c = offload_cost_trip(55.0, 40.0, 600.0);
        c.cpu_misses_per_token = choose_miss_policy(&c);
        assert_eq!(c.miss_policy(), MissPolicy::Stream, "{c:?}");
        let k = c.n_expert_used;
        for n in 1..=k {
            eprintln!(
                "n {n}: {:.3} ms vs stream {:.3}",
                step_at(&c, n) * 1e3,
                step_at(&c, 0) * 1e3
            );
            assert!(step_at(&c, n) > step_at(&c, 0), "n {n}");
        }
        let free = offload_cost_trip(55.0, 40.0, 0.0);
        assert_ne!(
            choose_miss_policy(&free),
            0,
            "without the round trip the host helps"
        );
    }

    /// A cheap round trip (20 µs) beside a slow link (8 GB/s, a PCIe 3 x8 card): the host's
    /// products beat copying the misses, and the model sends them there.
    #[test]
    fn a_cheap_round_trip_beside_a_slow_link_sends_misses_to_the_host() {
        use strata_schemas::plan::MissPolicy;
        let mut c = offload_cost_trip(8.0, 40.0, 20.0);
        let n = choose_miss_policy(&c);
        c.cpu_misses_per_token = n;
        assert_ne!(c.miss_policy(), MissPolicy::Stream, "{c:?}");
        assert!(step_at(&c, n) < 0.8 * step_at(&c, 0));
    }

    /// Without any host keys (an unprobed device) a PCIe 5 card (55 GB/s) holding a 12 GiB
    /// card's share of the 30B Q8_0 experts streams its misses: the default round trip is
    /// the conservative guess, and the prediction says it is one.
    #[test]
    fn the_defaults_stream_the_misses_of_a_pcie5_card() {
        use strata_schemas::plan::MissPolicy;
        let inv = inventory("qwen3moe", qwen3moe_hparams(), "Q8_0");
        let facts = ModelFacts::new(&inv, GgmlType::F16);
        let dev = h200();
        assert_eq!(dev.h2d(), 55.0);
        let c = Coefficients::of(&dev);
        assert!(c.host_defaulted.contains(&"host_round_trip_us"));
        for cached in [0.2, 0.3, 0.5] {
            let share = DeviceShare {
                cached_mass: cached,
                experts_covered: false,
                ..whole(&facts, true)
            };
            let mut dc = device_cost(&facts, &dev, &c, &share);
            dc.cpu_misses_per_token = choose_miss_policy(&dc);
            assert_eq!(dc.miss_policy(), MissPolicy::Stream, "{cached}: {dc:?}");
        }
    }

    /// A step whose experts come through the cache runs eagerly: the model charges each of
    /// its launches the eager cost beyond the graph's, and a resident step none.
    #[test]
    fn a_step_with_misses_pays_the_eager_launches() {
        let c = offload_cost(55.0, 40.0);
        assert!(c.eager(0));
        assert!(c.eager_step_s > 0.0);
        let graph = DeviceCost {
            eager_step_s: 0.0,
            ..c.clone()
        };
        let d = c.decode_step_seconds(1, 0) - graph.decode_step_seconds(1, 0);
        assert!((d - c.eager_step_s).abs() < 1e-12);
        let inv = inventory("qwen3moe", qwen3moe_hparams(), "Q8_0");
        let facts = ModelFacts::new(&inv, GgmlType::F16);
        let dev = h200();
        let all = device_cost(&facts, &dev, &Coefficients::of(&dev), &whole(&facts, true));
        assert!(!all.eager(0));
    }

    #[test]
    fn the_miss_policy_computes_on_the_cpu_when_the_link_is_slow_and_streams_when_fast() {
        use strata_schemas::plan::MissPolicy;
        let k = offload_cost(1.0, 1.0).n_expert_used;
        // A slow link (a PCIe 3 x4 riser) beside a fast host: every miss on the CPU.
        let mut slow = offload_cost(3.0, 80.0);
        slow.cpu_misses_per_token = choose_miss_policy(&slow);
        assert_eq!(slow.miss_policy(), MissPolicy::Cpu, "{slow:?}");
        assert_eq!(slow.cpu_misses_per_token, k);
        // A fast link beside a slow host: every miss streamed.
        let mut fast = offload_cost(200.0, 5.0);
        fast.cpu_misses_per_token = choose_miss_policy(&fast);
        assert_eq!(fast.miss_policy(), MissPolicy::Stream, "{fast:?}");
        // Comparable rates: both links at once, a split that beats either alone.
        let mut even = offload_cost(55.0, 55.0);
        let n = choose_miss_policy(&even);
        assert!(n > 0 && n < k, "split expected, got {n} of {k}");
        let at = |c: &DeviceCost, n: u32| {
            DeviceCost {
                cpu_misses_per_token: n,
                ..c.clone()
            }
            .decode_step_seconds(1, 0)
        };
        assert!(at(&even, n) < at(&even, 0) && at(&even, n) < at(&even, k));
        even.cpu_misses_per_token = n;
        assert_eq!(even.miss_policy(), MissPolicy::Split(n));
        // Every expert resident: nothing to choose.
        let inv = inventory("qwen3moe", qwen3moe_hparams(), "Q8_0");
        let facts = ModelFacts::new(&inv, GgmlType::F16);
        let dev = h200();
        let all = device_cost(&facts, &dev, &Coefficients::of(&dev), &whole(&facts, true));
        assert_eq!(choose_miss_policy(&all), 0);
        assert_eq!(all.miss_policy(), MissPolicy::None);
    }

    /// The 30B model's KV (F16) on an H200 holding `resident` cells a slot, the rest read
    /// over a link of `link_gbps` or attended on a host of `host_gbps`.
    fn spill_cost(resident: u64, link_gbps: f64, host_gbps: f64) -> DeviceCost {
        spill_cost_trip(resident, link_gbps, host_gbps, 40.0)
    }

    /// The same with a round trip of `trip_us` per attention layer attended on the host.
    fn spill_cost_trip(resident: u64, link_gbps: f64, host_gbps: f64, trip_us: f64) -> DeviceCost {
        let inv = inventory("qwen3moe", qwen3moe_hparams(), "Q8_0");
        let facts = ModelFacts::new(&inv, GgmlType::F16);
        let mut dev = h200();
        dev.h2d_gbps = Some(link_gbps);
        dev.cost = Some(CostProbe {
            host_matvec_gbps: Some(host_gbps),
            host_expert_latency_us: Some(40.0),
            kv_host_round_trip_us: Some(trip_us),
            ..CostProbe::default()
        });
        let share = DeviceShare {
            kv_resident: resident,
            ..whole(&facts, true)
        };
        device_cost(&facts, &dev, &Coefficients::of(&dev), &share)
    }

    #[test]
    fn the_kv_host_policy_attends_on_the_cpu_when_it_beats_the_link() {
        use strata_schemas::plan::KvHostPolicy;
        let ctx = 32_768;
        // A slow link (PCIe 3 x4) beside a fast host: the CPU attends the spilled cells, and
        // the step it predicts is shorter than streaming's.
        let mut slow = spill_cost(4096, 3.0, 80.0);
        let stream_s = slow.decode_step_seconds(4, ctx);
        slow.kv_host_cpu = choose_kv_host(&slow, 4, ctx);
        assert_eq!(slow.kv_host_policy(ctx), KvHostPolicy::Cpu, "{slow:?}");
        assert!(slow.decode_step_seconds(4, ctx) < stream_s);
        // A fast link beside a slow host: the device reads them over PCIe.
        let fast = spill_cost(4096, 55.0, 5.0);
        assert!(!choose_kv_host(&fast, 4, ctx));
        assert_eq!(fast.kv_host_policy(ctx), KvHostPolicy::Stream);
        // Nothing spilled at this context: nothing to choose, whatever the rates.
        let all = spill_cost(ctx, 3.0, 80.0);
        assert!(!choose_kv_host(&all, 4, ctx));
        assert_eq!(all.kv_host_policy(ctx), KvHostPolicy::None);
        // The CPU's part overlaps the window's: a window far slower than the host part hides it.
        let mut hidden = spill_cost(ctx - 16, 3.0, 80.0);
        hidden.kv_host_cpu = true;
        let window = 4.0 * (ctx - 16) as f64 * hidden.kv_cell_s;
        let host = hidden.kv_cpu_step_s + 4.0 * 16.0 * hidden.kv_cpu_cell_s;
        assert!(window > host);
        let none = DeviceCost {
            kv_resident: ctx,
            ..hidden.clone()
        };
        // The step costs what the window alone does (the whole context in VRAM less the 16
        // cells the host attended meanwhile), plus the round trips the device waits for and
        // the eager launches of a step that cannot be one graph.
        let d = hidden.decode_step_seconds(4, ctx) - none.decode_step_seconds(4, ctx);
        let saved = 4.0 * 16.0 * hidden.kv_cell_s;
        let paid = hidden.kv_cpu_step_s + hidden.eager_step_s;
        assert!(hidden.kv_cpu_step_s > 0.0 && hidden.eager_step_s > 0.0);
        assert!((d + saved - paid).abs() < 1e-12, "{d} vs {paid} - {saved}");
    }

    /// BENCHMARKS.md: spilled KV attended on the H200 machine's CPU cost 180 ms a step
    /// against 76.5 predicted with a 40 µs round trip: about 3.5 ms a layer. With that round
    /// trip the model streams over the 55 GB/s link even beside a host that reads faster
    /// than the link; with a cheap one (20 µs) beside a PCIe 3 x8 link (8 GB/s) the host
    /// attends. Both directions: dropping the term makes the first fail.
    #[test]
    fn the_kv_round_trip_decides_between_the_host_and_the_link() {
        let ctx = 32_768;
        let dear = spill_cost_trip(4096, 55.0, 60.0, 3500.0);
        assert!(!choose_kv_host(&dear, 4, ctx), "{dear:?}");
        let free = DeviceCost {
            kv_cpu_step_s: 0.0,
            eager_step_s: 0.0,
            ..dear.clone()
        };
        assert!(
            choose_kv_host(&free, 4, ctx),
            "without the round trips the host wins"
        );
        let cheap = spill_cost_trip(4096, 8.0, 60.0, 20.0);
        assert!(choose_kv_host(&cheap, 4, ctx), "{cheap:?}");
    }

    #[test]
    fn host_keys_are_guesses_apart_from_the_device_keys() {
        let mut d = h200();
        let c = Coefficients::of(&d);
        assert_eq!(
            c.host_defaulted,
            vec![
                "host_matvec_gbps",
                "host_round_trip_us",
                "kv_host_round_trip_us",
                "eager_launch_us"
            ]
        );
        assert!(!c.defaulted.contains(&"host_matvec_gbps"));
        d.cost = Some(CostProbe {
            host_matvec_gbps: Some(90.0),
            host_expert_latency_us: Some(25.0),
            host_round_trip_us: Some(300.0),
            kv_host_round_trip_us: Some(200.0),
            eager_launch_us: Some(4.0),
            ..CostProbe::default()
        });
        let c = Coefficients::of(&d);
        assert!(c.host_defaulted.is_empty());
        assert_eq!(c.host_matvec_bps, 90e9);
        // The round trips, not the hot products' intercept, price a host layer.
        assert!((c.host_layer_s - 300e-6).abs() < 1e-12);
        assert!((c.kv_host_layer_s - 200e-6).abs() < 1e-12);
        assert!((c.eager_launch_s - 4e-6).abs() < 1e-12);
    }

    /// Every family key measured (no default guesses), and `types` as given.
    fn measured(types: &[(&str, TypeRates)]) -> CostProbe {
        CostProbe {
            launch_us: Some(2.8),
            product_latency_us: Some(7.2),
            product_gbps: Some(3000.0),
            attention_latency_us: Some(16.5),
            attention_gbps: Some(1900.0),
            gemm_tflops: Some(108.0),
            prefill_attention_tflops: Some(53.0),
            step_us: Some(25.0),
            host_expert_gbps: Some(50.0),
            host_expert_pinned_gbps: Some(52.0),
            expert_latency_us: Some(17.0),
            expert_gbps: Some(2000.0),
            expert_pass_gbps: Some(1200.0),
            expert_gemm_tflops: Some(90.0),
            host_matvec_gbps: Some(40.0),
            host_expert_latency_us: Some(40.0),
            host_round_trip_us: Some(600.0),
            kv_host_round_trip_us: Some(3500.0),
            eager_launch_us: Some(5.0),
            types: types
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
        }
    }

    fn rates(scale: f64) -> TypeRates {
        TypeRates {
            product_gbps: Some(3000.0 * scale),
            expert_gbps: Some(2000.0 * scale),
            gemm_tflops: Some(108.0 * scale),
            expert_gemm_tflops: Some(90.0 * scale),
        }
    }

    fn cost_with(facts: &ModelFacts, cost: CostProbe) -> (Coefficients, DeviceCost) {
        let mut dev = h200();
        dev.cost = Some(cost);
        let c = Coefficients::for_model(&dev, facts);
        let dc = device_cost(facts, &dev, &c, &whole(facts, true));
        (c, dc)
    }

    /// Bytes (or weights) of `ty` in the whole model's dense tensors and head, and in one
    /// expert averaged over the expert layers.
    fn of_type(facts: &ModelFacts, ty: GgmlType, params: bool) -> (f64, f64) {
        let n = |s: &crate::facts::TypeShare| if params { s.params } else { s.bytes } as f64;
        let dense: f64 = facts
            .dense_types
            .iter()
            .flatten()
            .chain(&facts.head_types)
            .filter(|s| s.ty == ty)
            .map(n)
            .sum();
        let layers = facts.expert_layers(0, facts.n_layer) as f64;
        let expert: f64 = facts
            .expert_types
            .iter()
            .flatten()
            .filter(|s| s.ty == ty)
            .map(n)
            .sum::<f64>()
            / layers;
        (dense, expert)
    }

    #[test]
    fn a_q4_k_m_inventory_weighs_its_q4_k_bytes_at_the_probed_q4_k_rate() {
        let inv = inventory("qwen3moe", qwen3moe_hparams(), "Q4_K_M");
        let facts = ModelFacts::new(&inv, GgmlType::F16);
        let (q4_dense, q4_expert) = of_type(&facts, GgmlType::Q4K, false);
        let (q6_dense, _) = of_type(&facts, GgmlType::Q6K, false);
        assert!(
            q4_dense > 0.0 && q4_expert > 0.0 && q6_dense > 0.0,
            "a Q4_K/Q6_K mix"
        );
        // Q4_K and Q6_K probed at Q8_0's rates: every byte at the family rate.
        let (ca, same) = cost_with(
            &facts,
            measured(&[
                ("Q8_0", rates(1.0)),
                ("Q4_K", rates(1.0)),
                ("Q6_K", rates(1.0)),
            ]),
        );
        assert!(!ca.guessed(), "{:?}", ca.type_defaulted);
        // Q4_K probed at half: its bytes take twice as long, nothing else changes.
        let (cb, half) = cost_with(
            &facts,
            measured(&[
                ("Q8_0", rates(1.0)),
                ("Q4_K", rates(0.5)),
                ("Q6_K", rates(1.0)),
            ]),
        );
        assert!(!cb.guessed());
        let rel = |x: f64, y: f64| ((x - y) / y).abs() < 1e-9;
        assert!(rel(
            half.dense_read_s - same.dense_read_s,
            q4_dense / 3000e9
        ));
        assert!(rel(
            half.expert_read_s - same.expert_read_s,
            q4_expert / 2000e9
        ));
        assert!(rel(
            half.expert_pass_read_s - same.expert_pass_read_s,
            q4_expert / 1200e9
        ));
        let (q4_dense_w, q4_expert_w) = of_type(&facts, GgmlType::Q4K, true);
        let q4_head_w: f64 = facts
            .head_types
            .iter()
            .filter(|s| s.ty == GgmlType::Q4K)
            .map(|s| s.params as f64)
            .sum();
        let uses = facts.expert_layers(0, facts.n_layer) as f64 * facts.n_expert_used as f64;
        assert!(rel(
            half.token_compute_s - same.token_compute_s,
            2.0 * (q4_dense_w - q4_head_w) / 108e12 + 2.0 * uses * q4_expert_w / 90e12
        ));
        assert!(half.head_compute_s >= same.head_compute_s);
        // The decode step at batch 1 grows by at least the Q4_K dense bytes' extra read.
        let (a, b) = (
            same.decode_step_seconds(1, 0),
            half.decode_step_seconds(1, 0),
        );
        assert!(b - a >= 0.99 * q4_dense / 3000e9, "{a} {b}");
        assert!(b > 1.1 * a, "Q4_K is most of the bytes: {a} {b}");
        // The table's Q8_0 entry is the reference: all rates halved, nothing changes.
        let (_, scaled) = cost_with(
            &facts,
            measured(&[
                ("Q8_0", rates(0.5)),
                ("Q4_K", rates(0.25)),
                ("Q6_K", rates(0.5)),
            ]),
        );
        assert!(rel(scaled.dense_read_s, half.dense_read_s));
        // Without the Q6_K figure its rate is the default ratio, and the report says so.
        let (cg, _) = cost_with(&facts, measured(&[("Q4_K", rates(0.5))]));
        assert!(cg.guessed());
        assert!(
            cg.type_defaulted.iter().any(|s| s == "Q6_K product_gbps"),
            "{:?}",
            cg.type_defaulted
        );
        assert!(!cg.type_defaulted.iter().any(|s| s.starts_with("Q4_K")));
    }

    #[test]
    fn an_old_probe_without_types_predicts_exactly_as_before() {
        let inv = inventory("qwen3moe", qwen3moe_hparams(), "Q8_0");
        let facts = ModelFacts::new(&inv, GgmlType::F16);
        let (c, dc) = cost_with(&facts, measured(&[]));
        assert!(!c.guessed(), "{:?} {:?}", c.defaulted, c.type_defaulted);
        // The family rates alone, as the cost model charged every byte before per-type rates.
        let n = facts.n_layer;
        let dense = (facts.dense_range(0, n) + facts.head_bytes) as f64;
        assert_eq!(dc.dense_read_s, dense / c.product_bps);
        let layers = facts.expert_layers(0, n);
        let expert = facts.expert.iter().sum::<u64>() as f64 / layers as f64;
        assert_eq!(dc.expert_read_s, expert / c.expert_bps);
        assert_eq!(dc.expert_pass_read_s, expert / c.expert_pass_bps);
        let dense_w = facts.dense_params.iter().sum::<u64>() as f64;
        let expert_w = facts.expert_params.iter().sum::<u64>() as f64 / layers as f64;
        let k = facts.n_expert_used as f64;
        assert_eq!(
            dc.token_compute_s,
            2.0 * dense_w / c.gemm_flops + 2.0 * layers as f64 * k * expert_w / c.expert_gemm_flops
        );
        assert_eq!(
            dc.head_compute_s,
            2.0 * facts.head_params as f64 / c.gemm_flops
        );
        // The same old probe on a Q4_K_M file: Q4_K and Q6_K take the default ratio, a guess.
        let inv = inventory("qwen3moe", qwen3moe_hparams(), "Q4_K_M");
        let facts = ModelFacts::new(&inv, GgmlType::F16);
        let (c, dc) = cost_with(&facts, measured(&[]));
        assert!(c.guessed());
        assert!(c.type_defaulted.iter().any(|s| s == "Q4_K product_gbps"));
        let (q4, _) = of_type(&facts, GgmlType::Q4K, false);
        let family = (facts.dense_range(0, n) + facts.head_bytes) as f64 / c.product_bps;
        assert!(dc.dense_read_s > family + 0.1 * q4 / c.product_bps);
    }

    /// BENCHMARKS.md: the Qwen3-30B-A3B-shaped Q8_0 model on one H200, everything resident:
    /// tg128 261-266 tok/s after a 512-token prompt, pp512 15,106-15,277 tok/s.
    #[test]
    fn the_h200_q8_0_30b_predicts_within_15_percent_of_the_measured_figures() {
        let inv = inventory("qwen3moe", qwen3moe_hparams(), "Q8_0");
        let facts = ModelFacts::new(&inv, GgmlType::F16);
        let dev = h200();
        let share = whole(&facts, prefill_gemm(&inv, Vendor::Nvidia));
        let dc = device_cost(&facts, &dev, &Coefficients::for_model(&dev, &facts), &share);
        assert!(dc.prefill_gemm);
        // tg128 after pp512: contexts 512..640.
        let steps: f64 = (512..640).map(|c| dc.decode_step_seconds(1, c)).sum();
        let tg = 128.0 / steps;
        let pp = 512.0 / dc.prefill_pass_seconds(512, 0);
        eprintln!("predicted tg128 {tg:.1} tok/s (measured 262), pp512 {pp:.0} (measured 15,171)");
        assert!((tg / 262.0 - 1.0).abs() < 0.15, "tg {tg}");
        assert!((pp / 15_171.0 - 1.0).abs() < 0.15, "pp {pp}");
        // Batch 16 is not the batch-1 figure: more per step, less per slot, more in total.
        let one = dc.decode_step_seconds(1, 0);
        let sixteen = dc.decode_step_seconds(16, 0);
        assert!(sixteen > 1.5 * one, "{one} {sixteen}");
        assert!(16.0 / sixteen > 2.0 / one);
        // A full 40k context costs more than an empty one.
        assert!(dc.decode_step_seconds(1, 40960) > 1.2 * one);
    }
}
