//! `strata-exec bench` reports the expert cache's counters of the timed repetitions beside
//! the plan's predicted hit rate: a CPU plan whose cache holds fewer slots than the model has
//! experts misses, and the JSON's rate is its own hits over lookups.

mod common;

use common::*;
use std::process::Command;
use strata_schemas::serve::ExpertCache;

/// A plan of the tiny "base" model whose expert cache holds `slots`, and the JSON of
/// `strata-exec bench` over it with `args`.
fn bench_with_cache(slots: u64, args: &[&str]) -> (strata_schemas::plan::Plan, serde_json::Value) {
    let p = plan(
        "base",
        &Ask {
            cache: ExpertCache::Slots(slots),
            ..Ask::default()
        },
    );
    let dir = tempfile::tempdir().unwrap();
    let plan_path = dir.path().join("cache.plan");
    strata_schemas::planfile::write_plan(&p, &plan_path).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_strata-exec"))
        .arg("bench")
        .arg(&plan_path)
        .arg("--model")
        .arg(data("base"))
        .args(args)
        .args(["--format", "json", "-q"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (p, serde_json::from_slice(&out.stdout).unwrap())
}

#[test]
fn bench_reports_expert_hits_misses_and_the_predicted_rate() {
    let base = plan("base", &Ask::default());
    let n_all = base.model.n_layer as u64 * base.model.n_expert;
    let (p, j) = bench_with_cache(n_all / 4, &["-p", "16", "-n", "8", "-r", "2"]);
    let x = &j["experts"];
    let (hits, misses) = (
        x["hits"].as_u64().unwrap(),
        x["misses_streamed"].as_u64().unwrap(),
    );
    assert_eq!(x["reps"], 2);
    assert!(misses > 0, "a cache of {} slots misses: {x}", n_all / 4);
    assert_eq!(x["misses_cpu"], 0);
    let rate = x["hit_rate"].as_f64().unwrap();
    assert!((rate - hits as f64 / (hits + misses) as f64).abs() < 1e-12);
    assert_eq!(
        x["predicted_hit_rate"].as_f64().unwrap(),
        p.predicted.expert_hit_rate
    );
}

/// A long prompt is a scan: each pass streams only the experts outside the cache (the CPU
/// engine recycles one slot for them), where plain LRU over a cache smaller than one pass's
/// experts would miss nearly every lookup, pass after pass (measured with the scan off: 251
/// misses and a 4.6% hit rate where this test allows 174).
#[test]
fn long_prompts_stream_only_the_experts_outside_the_cache() {
    let base = plan("base", &Ask::default());
    let (layers, ne, k) = (
        base.model.n_layer as u64,
        base.model.n_expert,
        base.model.n_expert_used,
    );
    let n_all = layers * ne;
    let slots = n_all / 2;
    let (p, j) = bench_with_cache(slots, &["-p", "48", "-n", "1", "-r", "3"]);
    let x = &j["experts"];
    let (hits, misses) = (
        x["hits"].as_u64().unwrap(),
        x["misses_streamed"].as_u64().unwrap(),
    );
    // Per repetition: the 48-token prompt in passes of the planned ubatch (each a scan when
    // its picks number the layer's experts or more), and one decode step (k picks a layer).
    let ub = u64::from(p.serve.ubatch).max(1);
    let passes = 48u64.div_ceil(ub);
    assert!(ub.min(48) * k >= ne, "the test needs scans: ubatch {ub}");
    let outside = n_all - slots + 1;
    let bound = passes * outside + k * layers;
    assert!(
        misses <= 3 * bound,
        "{misses} misses in 3 repetitions of {passes} passes with {outside} experts outside the cache (at most {bound} a repetition): {x}"
    );
    assert!(hits > 0, "the cached half serves the passes: {x}");
}
