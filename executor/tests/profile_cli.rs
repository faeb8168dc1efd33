//! `strata-exec profile`: the routing profile the binary writes counts every pick the engine
//! made on the prompts, reads back with the planner's reader, and re-plans the expert cache
//! with the hottest experts resident (the round trip profile -> `--expert-profile` -> plan).

mod common;

use common::*;
use std::process::Command;
use strata_exec::engine::Engine;
use strata_plan::solve::{solve, Outcome, PlanRequest};
use strata_schemas::profile::read_profile;
use strata_schemas::serve::{ExpertCache, ServeSettings};

fn exe() -> Command {
    Command::new(env!("CARGO_BIN_EXE_strata-exec"))
}

#[test]
fn profile_counts_the_picks_and_replans_the_cache_round_trip() {
    let r = reference("base");
    let prompts = prompts(&r);
    let p = plan("base", &Ask::default());
    let dir = tempfile::tempdir().unwrap();
    let plan_path = dir.path().join("tiny.plan");
    strata_schemas::planfile::write_plan(&p, &plan_path).unwrap();
    let mut file = String::from("# calibration prompts\n");
    for pr in &prompts {
        let ids: Vec<String> = pr.iter().map(|t| t.to_string()).collect();
        file.push_str(&ids.join(","));
        file.push('\n');
    }
    let prompts_path = dir.path().join("prompts.txt");
    std::fs::write(&prompts_path, &file).unwrap();
    let out_path = dir.path().join("profile.txt");
    let n_gen = 4usize;
    let out = exe()
        .arg("profile")
        .arg(&plan_path)
        .arg("--model")
        .arg(data("base"))
        .arg("--prompts")
        .arg(&prompts_path)
        .arg("-o")
        .arg(&out_path)
        .args(["-n", &n_gen.to_string(), "-q"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let prof = read_profile(&out_path).unwrap();
    let hp = &p.model;
    assert_eq!(prof.layers, hp.n_layer);
    assert_eq!(prof.experts as u64, hp.n_expert);
    prof.check_against_model(hp.n_layer, 0, hp.n_expert, "t")
        .unwrap();

    // Every token fed (each prompt's tokens, then each generated token fed back) picks k
    // experts in every layer.
    let fed: u64 = prompts
        .iter()
        .map(|pr| {
            let room = p.serve.max_context - pr.len() as u64;
            pr.len() as u64 + (n_gen as u64).min(room)
        })
        .sum();
    for l in 0..prof.layers {
        let row: u64 = (0..prof.experts).map(|x| prof.count(l, x)).sum();
        assert_eq!(row, fed * hp.n_expert_used, "layer {l}");
    }

    // The same prompts through the library engine count the same picks.
    let mut e = engine("base", &p);
    for pr in &prompts {
        e.reset_slot(0);
        let mut next = [0u32];
        let ub = e.info().ubatch;
        for c in pr.chunks(ub).take(pr.len().div_ceil(ub) - 1) {
            e.prefill(0, c, false).unwrap();
        }
        let tail = &pr[(pr.len() - 1) / ub * ub..];
        let l = e.prefill(0, tail, true).unwrap().unwrap();
        next[0] = strata_exec::sampler::argmax(l);
        for _ in 0..n_gen {
            let t = next[0];
            e.decode_greedy(&[(0, t)], &mut next).unwrap();
        }
    }
    assert_eq!(e.routing_profile().unwrap(), prof);

    // Re-plan with the profile and a cache smaller than the model's experts: every resident
    // expert is at least as likely as every expert left out.
    let dir_m = data("base");
    let inv = strata_plan::model::load_model(&dir_m).unwrap();
    let probe = cpu_probe(1);
    let total = hp.n_layer as u64 * hp.n_expert;
    let slots = total / 2;
    let settings = ServeSettings {
        max_context: 64,
        expert_cache: ExpertCache::Slots(slots),
        pinned_chunk_mib: 1,
        ..ServeSettings::default()
    };
    let req = PlanRequest {
        inventory: &inv,
        model_source: dir_m.display().to_string(),
        probe: &probe,
        probe_source: "test probe".into(),
        settings: &settings,
        profile: Some(&prof),
        vision: None,
        mtp_file: None,
    };
    let tuned = match solve(&req).unwrap() {
        Outcome::Planned(p) => *p,
        Outcome::Infeasible(i) => panic!("infeasible: {:?}", i.reasons),
    };
    let dp = &tuned.devices[0];
    assert_eq!(dp.resident_experts.len() as u64, slots);
    let k = hp.n_expert_used;
    let prob = |l: u32, x: u32| prof.probabilities(l, k)[x as usize];
    let resident: std::collections::BTreeSet<(u32, u32)> = dp
        .resident_experts
        .iter()
        .map(|re| (re.layer, re.expert))
        .collect();
    let coldest_in = resident
        .iter()
        .map(|&(l, x)| prob(l, x))
        .fold(f64::INFINITY, f64::min);
    let hottest_out = (0..prof.layers)
        .flat_map(|l| (0..prof.experts).map(move |x| (l, x)))
        .filter(|lx| !resident.contains(lx))
        .map(|(l, x)| prob(l, x))
        .fold(0.0, f64::max);
    assert!(
        coldest_in >= hottest_out - 1e-12,
        "resident {coldest_in} < left out {hottest_out}"
    );
    // The profile is not uniform (the test would show nothing otherwise).
    assert!(coldest_in > hottest_out || prof.counts.iter().any(|c| *c != prof.counts[0]));
}

/// `strata-exec profile PLAN --prompts FILE` on the tiny folder: exits 1; its stderr.
fn refused(plan: &std::path::Path, prompts: &std::path::Path) -> String {
    let out = exe()
        .arg("profile")
        .arg(plan)
        .arg("--model")
        .arg(data("base"))
        .arg("--prompts")
        .arg(prompts)
        .arg("-q")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn profile_refuses_bad_prompt_lines_with_the_line() {
    let p = plan("base", &Ask::default());
    let dir = tempfile::tempdir().unwrap();
    let plan_path = dir.path().join("tiny.plan");
    strata_schemas::planfile::write_plan(&p, &plan_path).unwrap();
    let prompts_path = dir.path().join("prompts.txt");
    // Line 2 holds a token beyond the vocabulary of 256.
    std::fs::write(&prompts_path, "1,2,3\n5,9999\n").unwrap();
    let err = refused(&plan_path, &prompts_path);
    assert!(
        err.contains("prompts.txt:2") && err.contains("9999"),
        "{err}"
    );
    // A text line without a tokenizer (the tiny folder has none).
    std::fs::write(&prompts_path, "hello there\n").unwrap();
    let err = refused(&plan_path, &prompts_path);
    assert!(err.contains("--tokenizer"), "{err}");
}
