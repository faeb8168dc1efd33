//! MTP speculative decoding over a plan split across two CPU devices: the tiny random
//! Qwen3-Next with its MTP block (`blk.4.nextn.*`, no `nextn.embed_tokens`) planned on two
//! devices split after layer 2, so device 0 holds the embedding and device 1 the head and the
//! MTP block, which embeds its tokens with the plan's copy of `token_embd.weight` in device
//! 1's `mtp` region. Greedy decoding with `--mtp --spec N` (N = 1..3) gives exactly the tokens
//! of the same split plan without speculation, through the engine and through the real
//! `strata-exec` binary; a plan that drops the copy is refused at start-up naming the tensor,
//! where the plan puts it and the stage that needs it.

mod common;

use common::spec::{plain_pair_in_turn, prompt, speculative};
use common::{cpu_probe, solved, tiny_qwen3next_hp};
use std::path::Path;
use strata_exec::engine::Engine;
use strata_exec::exec::{start_cpu, CpuEngine, EngineOptions};
use strata_exec::load::GgufModel;
use strata_schemas::plan::{Placement, Plan, RegionKind};
use strata_schemas::serve::{LayerSplit, ServeSettings};

const CTX: u64 = 64;
const EMBD: &str = "token_embd.weight";

/// Two cpu devices split after layer 2, 2 slots of `CTX` cells, ubatch 8, speculating `spec`
/// drafts (0: none).
fn plan(path: &Path, spec: u32) -> Plan {
    let inv = strata_plan::model::load_model(path).unwrap();
    let settings = ServeSettings {
        max_context: CTX,
        batch: 2,
        ubatch: 8,
        mtp: spec > 0,
        spec,
        layer_split: LayerSplit::Bounds(vec![2]),
        pinned_chunk_mib: 1,
        ..ServeSettings::default()
    };
    solved(&inv, path, &cpu_probe(2), "test probe", &settings)
}

fn start(path: &Path, plan: &Plan) -> Result<CpuEngine, String> {
    start_cpu(
        plan,
        Box::new(GgufModel::open(path).unwrap()),
        EngineOptions::default(),
    )
    .map_err(|e| e.to_string())
}

/// The (device, region) of each of the plan's placements of `name`.
fn places(p: &Plan, name: &str) -> Vec<(u32, RegionKind)> {
    p.tensors
        .iter()
        .filter(|t| t.name == name)
        .filter_map(|t| match t.placement {
            Placement::Device { device, offset } => {
                let d = p.devices.iter().find(|d| d.index == device).unwrap();
                let r = d
                    .regions
                    .iter()
                    .find(|r| (r.offset..r.offset + r.bytes).contains(&offset))
                    .unwrap();
                Some((device, r.kind))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn a_split_plan_speculates_with_the_tokens_of_plain_decoding_for_n_1_to_3() {
    let dir = tempfile::tempdir().unwrap();
    let path = common::spec::mtp_model(dir.path(), tiny_qwen3next_hp());
    let n = 30;
    let base = plan(&path, 0);
    assert_eq!(base.devices.len(), 2);
    assert_eq!(places(&base, EMBD), [(0, RegionKind::Embedding)]);
    let mut plain_engine = start(&path, &base).unwrap();
    let want = plain_pair_in_turn(&mut plain_engine, n);
    for spec in 1..=3u32 {
        let p = plan(&path, spec);
        let (d0, d1) = (&p.devices[0], &p.devices[1]);
        assert_eq!((d0.layer_first, d0.layer_end), (0, 2));
        assert!(
            !d0.holds_mtp && d1.holds_mtp,
            "the MTP block is on device 1"
        );
        assert_eq!(
            places(&p, EMBD),
            [(0, RegionKind::Embedding), (1, RegionKind::Mtp)],
            "device 1 holds a copy of the embedding in its mtp region"
        );
        let mut e = start(&path, &p).unwrap();
        assert_eq!(e.spec_tokens(), spec as usize);
        for (s, w) in want.iter().enumerate() {
            e.reset_slot(0);
            let got = speculative(&mut e, 0, &prompt(s as u32), n, &|_| None);
            assert_eq!(&got, w, "spec {spec}, prompt {s}");
        }
        let st = e.stats().speculation;
        assert!(st.steps > 0 && st.drafted >= st.steps && st.accepted <= st.drafted);
    }
}

/// The same through `strata-exec PLAN --format json`: the split plan with `--spec 2` and
/// without give the same tokens, and the speculating run drafted.
#[test]
fn strata_exec_runs_a_split_speculating_plan() {
    let dir = tempfile::tempdir().unwrap();
    let path = common::spec::mtp_model(dir.path(), tiny_qwen3next_hp());
    let run = |spec: u32| -> serde_json::Value {
        let plan_path = dir.path().join(format!("split{spec}.plan"));
        strata_schemas::planfile::write_plan(&plan(&path, spec), &plan_path).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_strata-exec"))
            .arg(&plan_path)
            .arg("--model")
            .arg(&path)
            .args(["--prompt-tokens", "5,17,99,3,42", "-n", "16"])
            .args(["--format", "json", "-q"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "spec {spec}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let plain = run(0);
    let spec = run(2);
    assert_eq!(spec["generated_token_ids"], plain["generated_token_ids"]);
    assert_eq!(
        plain["generated_token_ids"].as_array().map(Vec::len),
        Some(16)
    );
    assert!(
        spec["speculation"]["drafted"].as_u64().unwrap() > 0,
        "{spec}"
    );
}

/// A plan without the copy (as an older planner wrote it) is refused at start-up: the message
/// says the tensor is in the model, where the plan puts it, and which device's stage needs it.
#[test]
fn a_plan_without_the_copy_names_the_tensor_and_the_stage() {
    let dir = tempfile::tempdir().unwrap();
    let path = common::spec::mtp_model(dir.path(), tiny_qwen3next_hp());
    let mut p = plan(&path, 2);
    p.tensors.retain(|t| {
        !(t.name == EMBD && matches!(t.placement, Placement::Device { device: 1, .. }))
    });
    let Err(e) = start(&path, &p) else {
        panic!("a plan without the copy started")
    };
    for want in [
        "`token_embd.weight` is in the model but not on this stage",
        "device 0 only",
        "device 1's stage",
        "re-plan",
    ] {
        assert!(e.contains(want), "`{want}` not in: {e}");
    }
}
