//! MTP speculative decoding on the CPU engine from a plan: a random tiny Qwen3-Next GGUF with
//! its MTP block (`blk.4.nextn.*`) planned with `--mtp --spec N` gives, for N = 1..4, exactly
//! the greedy tokens of the same model planned without speculation; drafts forced to agree
//! are all accepted; drafts forced to disagree at every position roll the KV and the linear
//! state back so the output still does not change; two slots speculating in turn do not
//! disturb each other; `run`, `bench` and the server (several requests over two slots, and
//! `/metrics`) give the same tokens with speculation as without.

mod common;
#[path = "serve_common/mod.rs"]
mod serve_common;

use common::spec::{plain, plain_pair_in_turn, prefill, prompt, speculative};
use common::{cpu_probe, solved, tiny_qwen3next_hp};
use std::path::Path;
use strata_exec::engine::Engine;
use strata_exec::exec::{start_cpu, CpuEngine, EngineOptions};
use strata_exec::load::GgufModel;
use strata_schemas::plan::{Plan, RegionKind};
use strata_schemas::serve::ServeSettings;

const CTX: u64 = 64;

fn model(dir: &Path) -> std::path::PathBuf {
    common::spec::mtp_model(dir, tiny_qwen3next_hp())
}

/// One cpu device, 2 slots of `CTX` cells, ubatch 8, speculating `spec` drafts (0: none).
fn plan(path: &Path, spec: u32) -> Plan {
    let inv = strata_plan::model::load_model(path).unwrap();
    let probe = cpu_probe(1);
    let settings = ServeSettings {
        max_context: CTX,
        batch: 2,
        ubatch: 8,
        mtp: spec > 0,
        spec,
        pinned_chunk_mib: 1,
        ..ServeSettings::default()
    };
    solved(&inv, path, &probe, "test probe", &settings)
}

fn start(path: &Path, plan: &Plan) -> CpuEngine {
    start_cpu(
        plan,
        Box::new(GgufModel::open(path).unwrap()),
        EngineOptions::default(),
    )
    .unwrap()
}

#[test]
fn greedy_speculation_gives_the_tokens_of_plain_decoding_for_n_1_to_4() {
    let dir = tempfile::tempdir().unwrap();
    let path = model(dir.path());
    let n = 40;
    let base = plan(&path, 0);
    let mut plain_engine = start(&path, &base);
    assert_eq!(plain_engine.spec_tokens(), 0);
    let want = plain_pair_in_turn(&mut plain_engine, n);
    for spec in 1..=4u32 {
        let p = plan(&path, spec);
        let dp = &p.devices[0];
        assert!(dp.holds_mtp && dp.region_bytes(RegionKind::Mtp) > 0);
        assert!(
            dp.region_bytes(RegionKind::LinearState)
                >= (1 + spec as u64) * base.devices[0].region_bytes(RegionKind::LinearState) - 64,
            "the linear state region holds the checkpoints"
        );
        let mut e = start(&path, &p);
        assert_eq!(e.spec_tokens(), spec as usize);
        // Two slots in turn: each step of one slot between the other's.
        let p0 = prompt(0);
        let p1 = prompt(1);
        let mut out = [vec![prefill(&mut e, 0, &p0)], vec![prefill(&mut e, 1, &p1)]];
        let mut buf = vec![0u32; spec as usize + 1];
        while out.iter().any(|o| o.len() < n) {
            for (s, o) in out.iter_mut().enumerate() {
                if o.len() < n {
                    let got = e
                        .decode_spec_greedy(s, *o.last().unwrap(), None, &mut buf)
                        .unwrap();
                    o.extend_from_slice(&buf[..got]);
                }
            }
        }
        for (s, o) in out.iter_mut().enumerate() {
            o.truncate(n);
            assert_eq!(o, &want[s], "spec {spec}, slot {s}");
        }
        let st = e.stats().speculation;
        assert!(st.steps > 0 && st.drafted >= st.steps && st.accepted <= st.drafted);
    }
}

#[test]
fn forced_drafts_are_all_accepted_and_wrong_ones_roll_back_at_every_position() {
    let dir = tempfile::tempdir().unwrap();
    let path = model(dir.path());
    let n = 33;
    let mut base = start(&path, &plan(&path, 0));
    let want = plain(&mut base, 0, &prompt(2), n + 8);
    let spec = 4usize;
    let mut e = start(&path, &plan(&path, spec as u32));
    common::spec::forced_drafts_accept_and_roll_back(&mut e, &want, spec, n);
}

/// `strata-exec PLAN --format json` with the plan's MTP block and without: the same tokens,
/// and a `speculation` object (drafted, accepted) only with it; `--spec-oracle` accepts every
/// draft and reproduces the run without speculation.
#[test]
fn run_json_reports_speculation_and_the_oracle_mode_accepts_every_draft() {
    let dir = tempfile::tempdir().unwrap();
    let path = model(dir.path());
    let run = |spec: u32, more: &[&str]| -> serde_json::Value {
        let plan_path = dir.path().join(format!("spec{spec}.plan"));
        strata_schemas::planfile::write_plan(&plan(&path, spec), &plan_path).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_strata-exec"))
            .arg(&plan_path)
            .arg("--model")
            .arg(&path)
            .args(["--prompt-tokens", "5,17,99,3,42", "-n", "24"])
            .args(["--format", "json", "-q"])
            .args(more)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "spec {spec} {more:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let plain = run(0, &[]);
    assert!(plain.get("speculation").is_none());
    let spec = run(3, &[]);
    assert_eq!(spec["generated_token_ids"], plain["generated_token_ids"]);
    let s = &spec["speculation"];
    assert_eq!(s["spec"], 3);
    let (drafted, accepted) = (
        s["drafted"].as_u64().unwrap(),
        s["accepted"].as_u64().unwrap(),
    );
    assert!(drafted > 0 && accepted <= drafted, "{s}");
    let oracle = run(3, &["--spec-oracle"]);
    assert_eq!(oracle["generated_token_ids"], plain["generated_token_ids"]);
    let o = &oracle["speculation"];
    assert!(o["drafted"].as_u64().unwrap() > 0);
    assert_eq!(o["accepted"], o["drafted"], "{o}");
    assert_eq!(o["oracle"]["identical"], true);
    // 23 decoded tokens in steps of up to 4: at most 6 steps (the last may be cut short).
    assert!(o["steps"].as_u64().unwrap() <= 6, "{o}");

    // `bench` decodes by speculative steps too and reports their counts per combination.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_strata-exec"))
        .arg("bench")
        .arg(dir.path().join("spec3.plan"))
        .arg("--model")
        .arg(&path)
        .args([
            "-p", "4", "-n", "12", "-b", "1,2", "-r", "1", "--format", "json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2);
    for r in rows {
        let s = &r["speculation"];
        assert_eq!(s["spec"], 3, "{r}");
        assert!(s["drafted"].as_u64().unwrap() > 0, "{r}");
        assert!(s["accepted"].as_u64() <= s["drafted"].as_u64(), "{r}");
    }
}

/// `strata-exec PLAN --serve` with speculation and without: concurrent greedy completions
/// over two slots (one request queued) give the same tokens, and `/metrics` counts the drafts.
#[test]
fn the_server_speculates_per_slot_with_the_tokens_of_plain_decoding() {
    use serde_json::json;
    use serve_common::exec::ExecServer;
    use serve_common::Server;
    let dir = tempfile::tempdir().unwrap();
    let path = model(dir.path());
    let bodies: Vec<serde_json::Value> = (0..3u32)
        .map(|i| {
            let p: Vec<u32> = prompt(i)[..5 + i as usize].to_vec();
            json!({"prompt": p, "max_tokens": 18, "temperature": 0})
        })
        .collect();
    let serve = |spec: u32| -> (Vec<String>, f64) {
        let plan_path = dir.path().join(format!("serve{spec}.plan"));
        strata_schemas::planfile::write_plan(&plan(&path, spec), &plan_path).unwrap();
        let s = ExecServer::start(&plan_path, &[]);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (a, b, c) = tokio::join!(
                s.post_json("/v1/completions", &bodies[0]),
                s.post_json("/v1/completions", &bodies[1]),
                s.post_json("/v1/completions", &bodies[2]),
            );
            let texts = [a, b, c]
                .iter()
                .map(|r| {
                    assert_eq!(r.status, 200, "{}", r.text());
                    let j = r.json();
                    assert_eq!(j["usage"]["completion_tokens"], 18, "{j}");
                    j["choices"][0]["text"].as_str().unwrap().to_string()
                })
                .collect();
            (texts, s.metric("strata_spec_draft_tokens_total").await)
        })
    };
    let (plain, drafted0) = serve(0);
    assert_eq!(drafted0, 0.0);
    let (spec, drafted) = serve(2);
    assert_eq!(spec, plain);
    assert!(drafted > 0.0, "no drafts counted on /metrics");
}

/// The MTP block of a transformers checkpoint (`mtp.*`, the tiny-qwen3next reference folder)
/// loads from the folder and speculates with the tokens of plain decoding.
#[test]
fn an_hf_folder_with_mtp_tensors_speculates() {
    use strata_exec::load::SafetensorsModel;
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/tiny-qwen3next/base");
    let start_hf = |spec: u32| -> CpuEngine {
        let p = plan(&dir, spec);
        start_cpu(
            &p,
            Box::new(SafetensorsModel::open(&dir).unwrap()),
            EngineOptions::default(),
        )
        .unwrap()
    };
    let mut base = start_hf(0);
    let want = plain(&mut base, 0, &prompt(3), 30);
    let mut e = start_hf(2);
    assert_eq!(e.spec_tokens(), 2);
    let got = speculative(&mut e, 0, &prompt(3), 30, &|_| None);
    assert_eq!(got, want);
    assert!(e.stats().speculation.drafted > 0);
}

/// Sampled speculation keeps the model's distribution: the first token of a speculative step
/// (MTP drafts, or a forced draft that is the most likely token, so both the acceptance and
/// the rejection branch run often) over 800 independent draws has the frequencies of the
/// target distribution (temperature 1.5, top-k 6) within a total variation of 0.09; the
/// usual rule violations (always accept, never accept) are off by 0.3 or more here.
#[test]
fn sampled_speculation_keeps_the_token_frequencies() {
    use strata_exec::sampler::{probs_into, Draw};
    let dir = tempfile::tempdir().unwrap();
    let path = model(dir.path());
    let pr = &prompt(4)[..3];
    let draw = |key: u64| Draw {
        temperature: 1.5,
        top_k: 6,
        key,
        ..Draw::GREEDY
    };
    let mut base = start(&path, &plan(&path, 0));
    let t0 = prefill(&mut base, 0, pr);
    let logits = base.decode(&[(0, t0)]).unwrap().to_vec();
    let mut p = vec![0f32; logits.len()];
    probs_into(&logits, &draw(0), &mut Vec::new(), &mut p);
    let likely = common::argmax(&p);
    let mut e = start(&path, &plan(&path, 2));
    let mut buf = [0u32; 3];
    let trials = 800u64;
    for forced in [None, Some([likely, likely])] {
        let before = e.stats().speculation;
        let mut counts = vec![0u64; p.len()];
        for i in 0..trials {
            e.reset_slot(0);
            prefill(&mut e, 0, pr);
            let key = (i + 1).wrapping_mul(0x2545_F491_4F6C_DD1D);
            let n = e
                .decode_spec_sample(0, t0, &draw(key), forced.as_ref().map(|f| &f[..]), &mut buf)
                .unwrap();
            assert!(n >= 1);
            counts[buf[0] as usize] += 1;
        }
        let tv: f64 = counts
            .iter()
            .zip(&p)
            .map(|(&c, &q)| (c as f64 / trials as f64 - q as f64).abs())
            .sum::<f64>()
            / 2.0;
        let s = e.stats().speculation;
        let (drafted, accepted) = (s.drafted - before.drafted, s.accepted - before.accepted);
        assert!(tv < 0.09, "forced {forced:?}: total variation {tv} from p");
        if forced.is_some() {
            assert!(
                accepted > 0 && accepted < drafted,
                "{accepted} of {drafted}"
            );
        }
    }
}

/// The draft length adapts per slot: after a step whose drafts all failed the next drafts
/// one token, after a fully accepted step it grows back, up to the plan's N.
#[test]
fn the_draft_length_follows_acceptance() {
    let dir = tempfile::tempdir().unwrap();
    let path = model(dir.path());
    let mut base = start(&path, &plan(&path, 0));
    let want = plain(&mut base, 0, &prompt(5), 40);
    let mut e = start(&path, &plan(&path, 4));
    let mut buf = [0u32; 5];
    let first = prefill(&mut e, 0, &prompt(5));
    assert_eq!(first, want[0]);
    let (mut done, mut next) = (1usize, first);
    let mut drafted = Vec::new();
    // Three steps of wrong drafts, then drafts that agree.
    for step in 0..8 {
        let mut d = want[done..done + 4].to_vec();
        if step < 3 {
            d.iter_mut().for_each(|t| *t = (*t + 1) % 128);
        }
        let before = e.stats().speculation.drafted;
        let got = e.decode_spec_greedy(0, next, Some(&d), &mut buf).unwrap();
        drafted.push(e.stats().speculation.drafted - before);
        assert_eq!(&buf[..got], &want[done..done + got]);
        done += got;
        next = buf[got - 1];
    }
    assert_eq!(drafted, [4, 1, 1, 1, 2, 3, 4, 4], "drafts per step");
}
