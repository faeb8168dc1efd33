//! The expert cache's hit rate, predicted from a routing profile's LRU curve, against what the
//! CPU engine's LRU cache measures (issue 21): a random model with skewed routing
//! (`Routing::Skewed`) is profiled on an all-resident plan, planned again with a few cache
//! slots and `--expert-profile`, and run on the same prompts.
//! Invariant: the plan's hit rate is the profile's decode curve at the planned slots, the
//! curve is not degenerate (it rises with the slots instead of starting near 1), and the
//! engine's decode hit rate is within [`POINTS`] of it.

mod common;

use common::cpu_probe;
use std::path::{Path, PathBuf};
use strata_exec::engine::Engine;
use strata_exec::exec::{start_cpu, EngineOptions};
use strata_exec::load::GgufModel;
use strata_plan::solve::{solve, Outcome, PlanRequest};
use strata_schemas::arch::QuantRecipe;
use strata_schemas::gguf::random::{write_random_model, RandomOptions, Routing};
use strata_schemas::inventory::HParams;
use strata_schemas::known::qwen3_30b_a3b;
use strata_schemas::plan::Plan;
use strata_schemas::probe::GIB;
use strata_schemas::profile::ExpertProfile;
use strata_schemas::serve::{ExpertCache, ServeSettings};

/// Measured and predicted decode hit rates agree within this (absolute).
const POINTS: f64 = 0.05;

fn hp() -> HParams {
    HParams {
        n_layer: 4,
        n_embd: 128,
        n_vocab: 1024,
        n_ctx_train: 1024,
        n_head: 4,
        n_head_kv: 2,
        head_dim_k: 32,
        head_dim_v: 32,
        n_expert: 32,
        n_expert_used: 4,
        n_ff_exp: 64,
        ..qwen3_30b_a3b()
    }
}

fn model() -> PathBuf {
    let d = common::run_dir("hitcurve");
    let path = d.join("skewed-q8.gguf");
    let opts = RandomOptions {
        threads: 1,
        routing: Routing::Skewed { skew: 1.0 },
        ..RandomOptions::default()
    };
    let recipe = QuantRecipe::preset("Q8_0").unwrap();
    write_random_model(&path, "qwen3moe", &hp(), &recipe, 11, opts).unwrap();
    path
}

fn plan(model: &Path, cache: ExpertCache, profile: Option<&ExpertProfile>) -> Plan {
    let inv = strata_plan::model::load_model(model).unwrap();
    let probe = cpu_probe(1);
    let s = ServeSettings {
        max_context: 256,
        batch: 1,
        ubatch: 16,
        pinned_chunk_mib: 1,
        expert_cache: cache,
        ..ServeSettings::default()
    };
    let req = PlanRequest {
        inventory: &inv,
        model_source: model.display().to_string(),
        probe: &probe,
        probe_source: "test cpu probe".into(),
        settings: &s,
        profile,
        vision: None,
        mtp_file: None,
    };
    match solve(&req).unwrap() {
        Outcome::Planned(p) => *p,
        Outcome::Infeasible(i) => panic!("infeasible: {:?}", i.reasons),
    }
}

/// Eight prompts of eight tokens, each followed by 40 greedy steps; returns the engine's
/// (hits, misses) over the decode steps only.
fn run(e: &mut dyn Engine) -> (u64, u64) {
    let (mut hits, mut misses) = (0, 0);
    for p in 0..8u32 {
        let prompt: Vec<u32> = (0..8).map(|i| (p * 131 + i * 37 + 5) % 1024).collect();
        e.reset_slot(0);
        let logits = e.prefill(0, &prompt, true).unwrap().unwrap();
        let mut tok = [strata_exec::sampler::argmax(logits)];
        let before = e.stats();
        for _ in 0..40 {
            let t = tok[0];
            e.decode_greedy(&[(0, t)], &mut tok).unwrap();
        }
        let after = e.stats();
        hits += after.expert_hits - before.expert_hits;
        misses += after.expert_misses - before.expert_misses;
    }
    (hits, misses)
}

fn start(plan: &Plan, path: &Path) -> Box<dyn Engine> {
    let opts = EngineOptions {
        progress: false,
        mem_available: Some(8 * GIB),
    };
    Box::new(start_cpu(plan, Box::new(GgufModel::open(path).unwrap()), opts).unwrap())
}

#[test]
fn the_profile_curve_predicts_the_cpu_caches_hit_rate() {
    let path = model();
    let resident = plan(&path, ExpertCache::Auto, None);
    assert_eq!(
        resident.predicted.expert_hit_source,
        "every expert resident: no misses"
    );
    let mut e = start(&resident, &path);
    run(e.as_mut());
    let profile = e
        .routing_profile()
        .expect("the CPU engine counts the picks");
    drop(e);
    let curve = profile.reuse.clone().expect("a v2 profile").decode;
    let keys = profile.keys() as f64;
    let at = |f: f64| curve.hit_rate(keys * f).unwrap();
    eprintln!(
        "decode curve: 1/8 {:.3}, 1/4 {:.3}, 1/2 {:.3}, 3/4 {:.3}",
        at(0.125),
        at(0.25),
        at(0.5),
        at(0.75)
    );
    // Not degenerate: a small cache does not serve nearly everything, and more slots help.
    assert!(at(0.125) < 0.7, "{}", at(0.125));
    assert!(
        at(0.5) > at(0.25) + 0.05 && at(0.75) > at(0.5),
        "flat curve"
    );

    for slots in [32u64, 64] {
        let p = plan(&path, ExpertCache::Slots(slots), Some(&profile));
        assert_eq!(p.devices[0].expert_cache_slots, slots);
        assert!(
            p.predicted.expert_hit_source.starts_with("measured"),
            "{}",
            p.predicted.expert_hit_source
        );
        let predicted = curve.hit_rate(slots as f64).unwrap();
        assert!(
            (p.predicted.expert_hit_rate - predicted).abs() < 1e-9,
            "plan {} vs curve {predicted}",
            p.predicted.expert_hit_rate
        );
        let mut e = start(&p, &path);
        let (hits, misses) = run(e.as_mut());
        let measured = hits as f64 / (hits + misses) as f64;
        eprintln!("{slots} slots: predicted {predicted:.3}, measured {measured:.3}");
        assert!(
            (measured - predicted).abs() < POINTS,
            "{slots} slots: measured {measured:.3}, the curve says {predicted:.3}"
        );
    }
}
