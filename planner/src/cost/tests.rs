//! The cost model's unit tests: each term against the figures it was calibrated on
//! (BENCHMARKS.md) and against the direction it must move.

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
        expert_shares: Vec::new(),
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
        expert_gemm_tokens_per_expert: None,
        delta_rule_token_us: None,
        delta_rule_latency_us: None,
        linear_state_gbps: None,
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
        expert_gemm_tokens_per_expert: Some(32.0),
        delta_rule_token_us: Some(1.0),
        delta_rule_latency_us: Some(10.0),
        linear_state_gbps: Some(3000.0),
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

/// The 80B-shaped Qwen3-Next IQ3_S inventory's facts.
fn next_facts() -> ModelFacts {
    let inv = inventory("qwen3next", qwen3next_hparams(), "IQ3_S");
    ModelFacts::new(&inv, GgmlType::F16)
}

/// `facts` on a measured H200 (every key, the delta rule's included) holding `[a, b)` and the
/// head, with `shares` as the routing.
fn next_cost(facts: &ModelFacts, a: u32, b: u32, shares: Vec<f64>) -> DeviceCost {
    let mut dev = h200();
    dev.cost = Some(measured(&[]));
    let share = DeviceShare {
        a,
        b,
        expert_shares: shares,
        ..whole(facts, true)
    };
    device_cost(facts, &dev, &Coefficients::for_model(&dev, facts), &share)
}

#[test]
fn the_delta_term_grows_with_the_linear_layers_and_the_slots() {
    let facts = next_facts();
    let linear = |a: u32, b: u32| {
        facts.linear_state[a as usize..b as usize]
            .iter()
            .filter(|x| **x > 0)
            .count() as f64
    };
    assert_eq!(linear(0, 48), 36.0);
    let (all, half) = (
        next_cost(&facts, 0, 48, vec![]),
        next_cost(&facts, 0, 24, vec![]),
    );
    // One token through a linear layer at the reference heads: the probe's 1 µs a layer.
    assert!((all.delta_token_s - 36.0 * 1e-6).abs() < 1e-12, "{all:?}");
    assert!((half.delta_token_s - linear(0, 24) * 1e-6).abs() < 1e-12);
    // The state: 32 x 128 x 128 f32 a layer and slot, read and written at 3,000 GB/s.
    assert_eq!(facts.delta_state_bytes, 32 * 128 * 128 * 4);
    let state = 2.0 * facts.linear_range(0, 48) as f64 / 3000e9;
    assert!((all.state_row_s - state).abs() < 1e-15);
    assert!(all.state_row_s > 1.9 * half.state_row_s);
    // Decode: every slot reads and writes its state, and each layer pays the rule's launches.
    let no_delta = DeviceCost {
        state_row_s: 0.0,
        row_s: all.row_s - all.state_row_s,
        step_s: all.step_s - 36.0 * 10e-6,
        ..all.clone()
    };
    for b in [1u32, 4, 16] {
        let d = all.decode_step_seconds(b, 0) - no_delta.decode_step_seconds(b, 0);
        let want = f64::from(b) * all.state_row_s + 36.0 * 10e-6;
        assert!((d - want).abs() < 1e-12, "batch {b}: {d} vs {want}");
    }
    // Prefill: the chain per token, the state once a pass (the kernels hold it in registers).
    let flat = DeviceCost {
        delta_token_s: 0.0,
        state_row_s: 0.0,
        row_s: all.row_s - all.state_row_s,
        ..all.clone()
    };
    for t in [1u64, 64, 512] {
        let d = all.prefill_pass_seconds(t, 0) - flat.prefill_pass_seconds(t, 0);
        let want = t as f64 * all.delta_token_s + all.state_row_s;
        assert!((d - want).abs() < 1e-9, "{t} tokens: {d} vs {want}");
    }
    // A slower probed chain costs more in proportion.
    let mut dev = h200();
    dev.cost = Some(CostProbe {
        delta_rule_token_us: Some(2.0),
        ..measured(&[])
    });
    let slow = device_cost(
        &facts,
        &dev,
        &Coefficients::for_model(&dev, &facts),
        &whole(&facts, true),
    );
    assert!((slow.delta_token_s - 2.0 * all.delta_token_s).abs() < 1e-12);
}

#[test]
fn the_delta_keys_are_guesses_only_for_models_with_linear_layers() {
    let mut dev = h200();
    dev.cost = Some(CostProbe {
        delta_rule_token_us: None,
        delta_rule_latency_us: None,
        linear_state_gbps: None,
        ..measured(&[
            ("IQ3_S", rates(0.6)),
            ("Q4_K", rates(0.74)),
            ("Q6_K", rates(0.74)),
            ("Q8_0", rates(1.0)),
        ])
    });
    let next = Coefficients::for_model(&dev, &next_facts());
    assert!(next.defaulted.contains(&"delta_rule_token_us"), "{next:?}");
    assert!(next.guessed());
    let inv = inventory("qwen3moe", qwen3moe_hparams(), "Q8_0");
    let thirty = ModelFacts::new(&inv, GgmlType::F16);
    let c = Coefficients::for_model(&dev, &thirty);
    assert!(!c.guessed(), "{:?}", c.defaulted);
    // No linear layers: no delta terms at all.
    let dc = device_cost(&thirty, &dev, &c, &whole(&thirty, true));
    assert_eq!((dc.delta_token_s, dc.state_row_s), (0.0, 0.0));
    // The CPU's delta terms come from its measured products: its recurrence reads and writes
    // the state every token.
    let mut cpu = probe(&[(64 * G, 100.0)], 128 * G, 120 * G)
        .devices
        .remove(0);
    cpu.vendor = Vendor::Cpu;
    cpu.cost = Some(CostProbe {
        product_gbps: Some(50.0),
        ..measured(&[])
    });
    cpu.cost.as_mut().unwrap().delta_rule_token_us = None;
    cpu.cost.as_mut().unwrap().linear_state_gbps = None;
    let facts = next_facts();
    let cc = Coefficients::for_model(&cpu, &facts);
    assert!(!cc.defaulted.contains(&"delta_rule_token_us"));
    let dcpu = device_cost(&facts, &cpu, &cc, &whole(&facts, false));
    let per_token = 36.0 * 2.0 * facts.delta_state_bytes as f64 / 50e9;
    assert!((dcpu.delta_token_s - per_token).abs() < 1e-12, "{dcpu:?}");
}

/// BENCHMARKS.md (2026-12-05 morning): the 80B's grouped products at 512 tokens give each of
/// 512 experts about 10 tokens, a sixth of a 64-token tile; the probe measured 30B's 32.
#[test]
fn fewer_tokens_an_expert_cost_more_per_token() {
    let facts = next_facts();
    let dc = next_cost(&facts, 0, 48, vec![]);
    let s512 = dc.tile_slowdown(512);
    assert!((s512 - 3.2).abs() < 0.01, "{s512}");
    assert!(dc.tile_slowdown(128) > s512);
    assert!(dc.tile_slowdown(4096) < s512 && dc.tile_slowdown(4096) >= 1.0);
    // The grouped products' extra time at 512 tokens is their useful time x (slowdown - 1).
    let flat = DeviceCost {
        expert_gemm_s: 0.0,
        ..dc.clone()
    };
    let extra = 512.0 * dc.expert_gemm_s * (s512 - 1.0);
    let (a, b) = (
        dc.prefill_pass_seconds(512, 0),
        flat.prefill_pass_seconds(512, 0),
    );
    assert!(a > b + 0.99 * extra, "{a} vs {b} + {extra}");
    // A probe that measured at the 80B's own shape (10 tokens an expert) is taken as is.
    let mut dev = h200();
    dev.cost = Some(CostProbe {
        expert_gemm_tokens_per_expert: Some(10.0),
        ..measured(&[])
    });
    let own = device_cost(
        &facts,
        &dev,
        &Coefficients::for_model(&dev, &facts),
        &whole(&facts, true),
    );
    assert!((own.tile_slowdown(512) - 1.0).abs() < 0.01);
    assert!(own.prefill_pass_seconds(512, 0) < a);
    // The 30B at the probe's shape: unchanged (its pp512 test above holds the figure).
    let inv = inventory("qwen3moe", qwen3moe_hparams(), "Q8_0");
    let thirty = ModelFacts::new(&inv, GgmlType::F16);
    let t = next_cost(&thirty, 0, thirty.n_layer, vec![]);
    assert!((t.tile_slowdown(512) - 1.0).abs() < 1e-6);
    // The CPU and a prefill through the expert cache run no tiles.
    let cached = DeviceCost {
        prefill_experts_per_use: true,
        ..dc.clone()
    };
    assert_eq!(cached.tile_slowdown(512), 1.0);
}

/// BENCHMARKS.md: the skewed-routing 30B Q8_0 file prefilled at 11.7k tok/s against 14.9k
/// for the uniform one, the cost model predicting both alike (0.82): the busy experts take
/// several tiles, the idle ones still one each.
#[test]
fn a_skewed_profile_costs_more_than_a_uniform_one_at_the_same_bytes() {
    let inv = inventory("qwen3moe", qwen3moe_hparams(), "Q8_0");
    let facts = ModelFacts::new(&inv, GgmlType::F16);
    let k = facts.n_expert_used as f64;
    let e = facts.n_expert as usize;
    // Three fifths of the picks on an eighth of the experts, busiest first.
    let skew: Vec<f64> = (0..e)
        .map(|i| {
            if i < e / 8 {
                0.6 * k / (e / 8) as f64
            } else {
                0.4 * k / (e - e / 8) as f64
            }
        })
        .collect();
    let uniform = next_cost(&facts, 0, facts.n_layer, vec![]);
    let skewed = next_cost(&facts, 0, facts.n_layer, skew);
    // The same bytes and flops: decode is the same, prefill slower.
    assert_eq!(uniform.token_compute_s, skewed.token_compute_s);
    assert_eq!(
        uniform.decode_step_seconds(1, 0),
        skewed.decode_step_seconds(1, 0)
    );
    let (pu, ps) = (
        uniform.prefill_pass_seconds(512, 0),
        skewed.prefill_pass_seconds(512, 0),
    );
    eprintln!(
        "pp512 uniform {:.0} tok/s, skewed {:.0}",
        512.0 / pu,
        512.0 / ps
    );
    assert!(ps > 1.1 * pu, "{ps} vs {pu}");
    // A profile as flat as uniform routing costs what uniform routing does.
    let flat = next_cost(&facts, 0, facts.n_layer, vec![k / e as f64; e]);
    assert!((flat.prefill_pass_seconds(512, 0) - pu).abs() < 1e-12);
}

/// A long prompt's pass through the expert cache streams every expert outside the slots once
/// (the cache treats it as a scan), on the grouped products where the types have them: with
/// a skewed profile the hit rate (a share of uses) understates that count, so the pass's
/// misses follow the experts outside, and one decode step's still follow the hit rate.
#[test]
fn a_long_pass_through_the_cache_streams_the_experts_outside_it() {
    let inv = inventory("qwen3moe", qwen3moe_hparams(), "Q8_0");
    let facts = ModelFacts::new(&inv, GgmlType::F16);
    let (k, e) = (facts.n_expert_used as f64, facts.n_expert as usize);
    // An eighth of the experts take three fifths of the picks; the cache serves 0.8 of the
    // uses: the busy eighth (0.6) and half of the rest (0.2 of their 0.4).
    let skew: Vec<f64> = (0..e)
        .map(|i| {
            if i < e / 8 {
                0.6 * k / (e / 8) as f64
            } else {
                0.4 * k / (e - e / 8) as f64
            }
        })
        .collect();
    let dc = DeviceCost {
        hit_rate: 0.8,
        expert_miss_s: 1e-3,
        prefill_experts_per_use: false,
        ..next_cost(&facts, 0, facts.n_layer, skew)
    };
    let layers = f64::from(dc.expert_layers);
    // Outside the cache: the other half of the rest.
    let outside = 0.5 * (e - e / 8) as f64;
    let long = dc.outside_touched(4096);
    assert!((long - outside).abs() < 0.5, "{long} vs {outside}");
    let hit_based = e as f64 * (1.0 - dc.hit_rate);
    assert!(
        long > 2.0 * hit_based,
        "{long} vs the hit rate's {hit_based}"
    );
    let miss_pass = dc.prefill_pass_seconds(4096, 0)
        - DeviceCost {
            expert_miss_s: 0.0,
            ..dc.clone()
        }
        .prefill_pass_seconds(4096, 0);
    assert!(
        (miss_pass - layers * long * 1e-3).abs() < 1e-6,
        "{miss_pass} s of misses for {long} experts a layer"
    );
    // One decode step: k x (1 - hit rate) a layer, as before.
    assert!((dc.outside_touched(1) - k * 0.2).abs() < 1e-9);
}
