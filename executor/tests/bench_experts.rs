//! `strata-exec bench` reports the expert cache's counters of the timed repetitions beside
//! the plan's predicted hit rate: a CPU plan whose cache holds fewer slots than the model has
//! experts misses, and the JSON's rate is its own hits over lookups.

mod common;

use common::*;
use std::process::Command;
use strata_schemas::serve::ExpertCache;

#[test]
fn bench_reports_expert_hits_misses_and_the_predicted_rate() {
    let base = plan("base", &Ask::default());
    let n_all = base.model.n_layer as u64 * base.model.n_expert;
    let p = plan(
        "base",
        &Ask {
            cache: ExpertCache::Slots(n_all / 4),
            ..Ask::default()
        },
    );
    let dir = tempfile::tempdir().unwrap();
    let plan_path = dir.path().join("small-cache.plan");
    strata_schemas::planfile::write_plan(&p, &plan_path).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_strata-exec"))
        .arg("bench")
        .arg(&plan_path)
        .arg("--model")
        .arg(data("base"))
        .args(["-p", "16", "-n", "8", "-r", "2", "--format", "json", "-q"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
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
