//! MTP speculative decoding on the CUDA engine from a plan: a random tiny Qwen3-Next GGUF with
//! its MTP block (`blk.4.nextn.*`, widths the CUDA kernels take) planned for an NVIDIA device
//! with `--mtp --spec N` gives, for N = 1..4, exactly the greedy tokens of the same model
//! planned without speculation on the same GPU (two slots speculating in turn); drafts forced
//! to agree are all accepted; drafts forced wrong from every position roll the linear state
//! back so the output does not change; after an all-rejected step the next logits are plain
//! decoding's (they are not when the rejected drafts' state is kept, which the test checks
//! too, so it fails if `rollback_linear` does nothing); the CUDA engine drafts what the CPU
//! engine drafts (the same acceptance counts); `run --spec-oracle --format json` on the GPU
//! accepts every draft; the block read from an MTP-only file (two files) speculates as the
//! single file's does; a plan split over two devices on one GPU (the block and the head on
//! device 1, embedding with the plan's copy of `token_embd.weight` there) speculates with the
//! tokens of the same split plan without speculation, and without that copy does not start.
//! The plan's capability verdict and start-up checks run without a GPU.
//! Needs a CUDA GPU: without one every other test prints SKIP and returns (run them on the GPU
//! machine: `cargo test -p strata-exec --release --test cuda_mtp -- --test-threads=1
//! --nocapture`).

#![cfg(feature = "cuda")]

mod common;

use common::spec::{plain, prefill, prompt, speculative_pair};
use common::{cpu_probe, gpu_present, gpu_probe, max_rel, solved, tiny_qwen3next_hp};
use std::path::{Path, PathBuf};
use strata_exec::backend::cuda::options::CudaOptions;
use strata_exec::backend::cuda::start::{start_cuda, CudaEngine};
use strata_exec::engine::Engine;
use strata_exec::exec::{start_cpu, EngineOptions};
use strata_exec::load::open_model;
use strata_schemas::inventory::HParams;
use strata_schemas::plan::{Plan, RegionKind};
use strata_schemas::serve::{ExpertCache, ServeSettings};

const CTX: u64 = 96;

/// The tiny Qwen3-Next of the other CUDA tests (hidden 64, expert width 32) with one MTP
/// block; every expert routed, so the verify pass's rounding cannot flip a routing choice.
fn model(dir: &Path) -> PathBuf {
    let hp = HParams {
        n_expert: 4,
        n_expert_used: 4,
        ..tiny_qwen3next_hp()
    };
    common::spec::mtp_model(dir, hp)
}

/// One device (NVIDIA, or CPU when `!gpu`), 2 slots of `CTX` cells, ubatch 8, every expert
/// in VRAM, speculating `spec` drafts (0: none).
fn plan(path: &Path, spec: u32, gpu: bool) -> Plan {
    plan_resident(path, spec, gpu, CTX)
}

/// [`plan`] with `resident` cells of each slot in VRAM, the rest in pinned host chunks.
fn plan_resident(path: &Path, spec: u32, gpu: bool, resident: u64) -> Plan {
    let inv = strata_plan::model::load_model(path).unwrap();
    let probe = if gpu { gpu_probe(1) } else { cpu_probe(1) };
    solved(&inv, path, &probe, "test probe", &settings(spec, resident))
}

/// 2 slots of `CTX` cells, ubatch 8, every expert in VRAM, `resident` cells of each slot in
/// VRAM, speculating `spec` drafts (0: none).
fn settings(spec: u32, resident: u64) -> ServeSettings {
    ServeSettings {
        max_context: CTX,
        batch: 2,
        ubatch: 8,
        mtp: spec > 0,
        spec,
        expert_cache: ExpertCache::Off,
        pinned_chunk_mib: 1,
        kv_resident: (resident < CTX).then_some(resident),
        ..ServeSettings::default()
    }
}

fn start(path: &Path, spec: u32) -> CudaEngine {
    start_cuda(
        &plan(path, spec, true),
        open_model(path).unwrap(),
        CudaOptions::f32_products(),
    )
    .unwrap()
}

/// Without a GPU too: a plan for an NVIDIA device with `--mtp --spec 4` is runnable on CUDA
/// by the capability table and passes every start-up check that needs no GPU (its working
/// buffers, the `argmax` rows of a verify pass included).
#[test]
fn a_speculating_plan_passes_the_cuda_preflight() {
    use strata_exec::backend::cuda::start::preflight;
    use strata_schemas::capability::{runnable, Backend};
    let dir = tempfile::tempdir().unwrap();
    let path = model(dir.path());
    let p = plan(&path, 4, true);
    assert!(p.devices[0].holds_mtp);
    assert_eq!(
        runnable(&p).of(Backend::Cuda),
        &Ok(()),
        "the capability table runs MTP on CUDA"
    );
    let host = open_model(&path).unwrap();
    let pf = preflight(&p, host.as_ref(), &CudaOptions::f32_products()).unwrap();
    assert!(
        pf.max_tok >= 5 && pf.logit_rows >= 5,
        "a verify pass of 4 drafts fits"
    );
}

#[test]
fn greedy_speculation_on_cuda_gives_the_tokens_of_plain_decoding_for_n_1_to_4() {
    if !gpu_present() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = model(dir.path());
    let n = 40;
    let base_plan = plan(&path, 0, true);
    let mut base = start(&path, 0);
    assert_eq!(base.spec_tokens(), 0);
    let want: Vec<Vec<u32>> = (0..2)
        .map(|s| plain(&mut base, s, &prompt(s as u32), n))
        .collect();
    for spec in 1..=4u32 {
        let p = plan(&path, spec, true);
        let dp = &p.devices[0];
        assert!(dp.holds_mtp && dp.region_bytes(RegionKind::Mtp) > 0);
        let one = base_plan.devices[0].region_bytes(RegionKind::LinearState);
        assert!(
            dp.region_bytes(RegionKind::LinearState) >= (1 + spec as u64) * one - 4 * 256,
            "the linear state region holds the checkpoints"
        );
        let mut e = start(&path, spec);
        assert_eq!(e.spec_tokens(), spec as usize);
        let got = speculative_pair(&mut e, n);
        for (s, o) in got.iter().enumerate() {
            assert_eq!(o, &want[s], "spec {spec}, slot {s}");
        }
        let st = e.stats().speculation;
        assert!(st.steps > 0 && st.drafted >= st.steps && st.accepted <= st.drafted);
        eprintln!(
            "spec {spec}: {} steps, {} drafted, {} accepted",
            st.steps, st.drafted, st.accepted
        );
    }
}

#[test]
fn forced_drafts_on_cuda_are_all_accepted_and_wrong_ones_roll_back_at_every_position() {
    if !gpu_present() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = model(dir.path());
    let n = 33;
    let want = plain(&mut start(&path, 0), 0, &prompt(2), n + 8);
    let spec = 4usize;
    let mut e = start(&path, spec as u32);
    common::spec::forced_drafts_accept_and_roll_back(&mut e, &want, spec, n);
}

/// After a step whose four drafts are all rejected, the next decode step's logits are plain
/// decoding's; and the rejected drafts did change the linear state (an engine that verifies
/// them and keeps them, i.e. decodes them, gives other logits), so without the rollback this
/// test fails.
#[test]
fn an_all_rejected_step_leaves_the_logits_of_plain_decoding() {
    if !gpu_present() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = model(dir.path());
    let p = prompt(6);
    let mut base = start(&path, 0);
    let t0 = prefill(&mut base, 0, &p);
    let mut t1 = [0u32];
    base.decode_greedy(&[(0, t0)], &mut t1).unwrap();
    let want = base.decode(&[(0, t1[0])]).unwrap().to_vec();

    let mut e = start(&path, 4);
    assert_eq!(prefill(&mut e, 0, &p), t0);
    // Drafts that cannot be the model's pick after t0 (t1 is): all rejected.
    let wrong: Vec<u32> = (1..=4).map(|i| (t1[0] + i) % 128).collect();
    let mut buf = [0u32; 5];
    let got = e.decode_spec_greedy(0, t0, Some(&wrong), &mut buf).unwrap();
    assert_eq!(got, 1, "every draft rejected");
    assert_eq!(buf[0], t1[0]);
    let after = e.decode(&[(0, t1[0])]).unwrap().to_vec();
    let r = max_rel(&after, &want);
    assert!(r < 1e-3, "logits after the rollback differ by {r}");

    // What keeping the rejected drafts' state would have given: the state after t0 and the
    // first wrong draft, then t1 at the next position.
    let mut kept = start(&path, 0);
    prefill(&mut kept, 0, &p);
    kept.decode(&[(0, t0)]).unwrap();
    kept.decode(&[(0, wrong[0])]).unwrap();
    let polluted = kept.decode(&[(0, t1[0])]).unwrap().to_vec();
    let r = max_rel(&polluted, &want);
    assert!(
        r > 1e-2,
        "a rejected draft's state changes the logits by only {r}: the test cannot see a missing rollback"
    );
}

/// The MTP head on CUDA drafts what the CPU engine's drafts: the same greedy run of both slots
/// gives the same speculation counts on both engines (and the same tokens).
#[test]
fn cuda_drafts_what_the_cpu_engine_drafts() {
    if !gpu_present() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = model(dir.path());
    let n = 40;
    let mut cpu = start_cpu(
        &plan(&path, 3, false),
        open_model(&path).unwrap(),
        EngineOptions::default(),
    )
    .unwrap();
    let mut gpu = start(&path, 3);
    let want = speculative_pair(&mut cpu, n);
    let got = speculative_pair(&mut gpu, n);
    assert_eq!(got, want);
    let (c, g) = (cpu.stats().speculation, gpu.stats().speculation);
    assert_eq!(
        (g.steps, g.drafted, g.accepted),
        (c.steps, c.drafted, c.accepted),
        "CUDA's speculation counts differ from the CPU engine's"
    );
}

/// The `strata-exec` binary: beside this test binary (`scripts/build_gpu.sh`'s `target/gpu`
/// on the GPU machine), else the one cargo built with it.
fn strata_exec_bin() -> PathBuf {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("strata-exec")))
        .filter(|p| p.is_file());
    beside.unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_strata-exec")))
}

/// `strata-exec PLAN --spec-oracle --format json` on the GPU: every draft accepted, the tokens
/// of the run without speculation.
#[test]
fn run_spec_oracle_on_cuda_accepts_every_draft() {
    if !gpu_present() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = model(dir.path());
    let plan_path = dir.path().join("spec4.plan");
    strata_schemas::planfile::write_plan(&plan(&path, 4, true), &plan_path).unwrap();
    let out = std::process::Command::new(strata_exec_bin())
        .arg(&plan_path)
        .arg("--model")
        .arg(&path)
        .args(["--prompt-tokens", "5,17,99,3,42", "-n", "40"])
        .args(["--format", "json", "-q", "--spec-oracle"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let o = &j["speculation"];
    assert_eq!(o["spec"], 4, "{j}");
    assert!(o["drafted"].as_u64().unwrap() > 0, "{o}");
    assert_eq!(o["accepted"], o["drafted"], "{o}");
    assert_eq!(o["oracle"]["identical"], true, "{o}");
}

/// The MTP block over KV that spills: with 24 of 96 cells a slot in VRAM, the main layers'
/// and the block's cells past the window live in the pinned chunks (the block's rows the tail
/// of each spilled cell). Greedy `--spec 4` over two slots gives plain decoding's tokens on
/// the same plan, past the window. Without a GPU, the plan's spill and the start-up checks.
#[test]
fn speculation_over_spilled_kv_gives_the_tokens_of_plain_decoding() {
    use strata_exec::backend::cuda::start::preflight;
    const WINDOW: u64 = 24;
    let dir = tempfile::tempdir().unwrap();
    let path = model(dir.path());
    let p = plan_resident(&path, 4, true, WINDOW);
    assert_eq!(p.serve.kv_resident, WINDOW);
    assert!(
        p.devices[0].holds_mtp
            && p.host
                .pinned_chunks
                .iter()
                .any(|c| c.device == 0 && c.purpose == "kv_spill"),
        "the plan spills KV and holds the MTP block"
    );
    let host = open_model(&path).unwrap();
    preflight(&p, host.as_ref(), &CudaOptions::f32_products()).unwrap();
    if !gpu_present() {
        return;
    }
    let n = 40; // 11 prompt tokens + 40: every slot passes the window
    let mut base = start_cuda(
        &plan_resident(&path, 0, true, WINDOW),
        open_model(&path).unwrap(),
        CudaOptions::f32_products(),
    )
    .unwrap();
    let want: Vec<Vec<u32>> = (0..2)
        .map(|s| plain(&mut base, s, &prompt(s as u32), n))
        .collect();
    let mut e = start_cuda(&p, open_model(&path).unwrap(), CudaOptions::f32_products()).unwrap();
    let got = speculative_pair(&mut e, n);
    for (s, o) in got.iter().enumerate() {
        assert_eq!(o, &want[s], "slot {s} over spilled KV");
    }
    eprintln!(
        "PASS speculation over spilled KV: {:?}",
        e.stats().speculation
    );
}

/// The MTP block read from llama.cpp's MTP-only file (the model split by `split_mtp`, planned
/// as `strata-plan --model MAIN --mtp-model MTP` plans it): the CUDA engine binds it from the
/// second file and speculates with the single file's tokens and draft counts.
#[test]
fn the_block_from_an_mtp_only_file_drafts_on_cuda_what_the_single_file_drafts() {
    use strata_plan::solve::{solve, Outcome, PlanRequest};
    if !gpu_present() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = model(dir.path());
    let (main, mtp) = (
        dir.path().join("main.gguf"),
        dir.path().join("mtp-main.gguf"),
    );
    strata_schemas::gguf::split_mtp::split_mtp(&path, &main, &mtp).unwrap();
    let n = 40;
    let mut single = start(&path, 3);
    let want = speculative_pair(&mut single, n);

    let (inv, file) = strata_plan::model::load_model_with_mtp(&main, Some(&mtp)).unwrap();
    let probe = gpu_probe(1);
    let s = settings(3, CTX);
    let req = PlanRequest {
        inventory: &inv,
        model_source: main.display().to_string(),
        probe: &probe,
        probe_source: "test probe".into(),
        settings: &s,
        profile: None,
        vision: None,
        mtp_file: file,
    };
    let Outcome::Planned(p) = solve(&req).unwrap() else {
        panic!("the two-file model does not fit");
    };
    assert!(p.model.mtp_file.is_some() && p.devices[0].holds_mtp);
    let host = strata_exec::load::open_planned(&p, &main, None).unwrap();
    let mut two = start_cuda(&p, host, CudaOptions::f32_products()).unwrap();
    assert_eq!(two.spec_tokens(), 3);
    let got = speculative_pair(&mut two, n);
    assert_eq!(got, want);
    let (a, b) = (single.stats().speculation, two.stats().speculation);
    assert_eq!(
        (b.steps, b.drafted, b.accepted),
        (a.steps, a.drafted, a.accepted)
    );
    assert!(b.drafted > 0);
}

/// Two planned NVIDIA devices split after layer 2 (both on GPU 0 when run): the MTP block
/// and the head on device 1, 2 slots of `CTX` cells, speculating `spec` drafts (0: none).
fn split_plan(path: &Path, spec: u32) -> Plan {
    let inv = strata_plan::model::load_model(path).unwrap();
    let s = ServeSettings {
        layer_split: strata_schemas::serve::LayerSplit::Bounds(vec![2]),
        ..settings(spec, CTX)
    };
    solved(&inv, path, &gpu_probe(2), "test probe", &s)
}

/// The devices holding `token_embd.weight`, each with the region its bytes lie in.
fn embedding_places(p: &Plan) -> Vec<(u32, RegionKind)> {
    use strata_schemas::plan::Placement;
    p.tensors
        .iter()
        .filter(|t| t.name == "token_embd.weight")
        .filter_map(|t| match t.placement {
            Placement::Device { device, offset } => {
                let d = p.devices.iter().find(|d| d.index == device)?;
                let r = d
                    .regions
                    .iter()
                    .find(|r| (r.offset..r.offset + r.bytes).contains(&offset))?;
                Some((device, r.kind))
            }
            _ => None,
        })
        .collect()
}

/// Without a GPU too: the split speculating plan puts a copy of the embedding in device 1's
/// `mtp` region (the block embeds its tokens with it) and passes the CUDA start-up checks.
#[test]
fn a_split_speculating_plan_copies_the_embedding_and_passes_the_cuda_preflight() {
    use strata_exec::backend::cuda::start::preflight;
    let dir = tempfile::tempdir().unwrap();
    let path = model(dir.path());
    let p = split_plan(&path, 3);
    assert_eq!(p.devices.len(), 2);
    assert!(!p.devices[0].holds_mtp && p.devices[1].holds_mtp);
    assert_eq!(
        embedding_places(&p),
        [(0, RegionKind::Embedding), (1, RegionKind::Mtp)]
    );
    let host = open_model(&path).unwrap();
    preflight(&p, host.as_ref(), &CudaOptions::default()).unwrap();
}

/// Greedy `--spec N` (N = 1..3) over the split plan on one GPU, every stage on one device
/// object and then each with its own (`--device-map 0,0`), gives the tokens of the same split
/// plan without speculation (two slots speculating in turn); without the embedding copy on
/// device 1 the MTP stage does not bind and the engine does not start.
#[test]
fn greedy_speculation_over_a_split_plan_on_cuda_gives_the_tokens_of_plain_decoding() {
    if !gpu_present() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = model(dir.path());
    let n = 40;
    let variants = [
        ("one stream", CudaOptions::default()),
        (
            "device map 0,0",
            CudaOptions {
                device_map: Some(vec![0, 0]),
                ..CudaOptions::default()
            },
        ),
    ];
    for (what, opts) in variants {
        let start_split = |spec: u32| {
            start_cuda(
                &split_plan(&path, spec),
                open_model(&path).unwrap(),
                opts.clone(),
            )
            .unwrap()
        };
        let mut base = start_split(0);
        let want: Vec<Vec<u32>> = (0..2)
            .map(|s| plain(&mut base, s, &prompt(s as u32), n))
            .collect();
        drop(base);
        for spec in 1..=3u32 {
            let mut e = start_split(spec);
            assert_eq!(e.spec_tokens(), spec as usize);
            let got = speculative_pair(&mut e, n);
            assert_eq!(got.to_vec(), want, "{what}, spec {spec}");
            let st = e.stats().speculation;
            assert!(
                st.steps > 0 && st.drafted >= st.steps,
                "{what}, spec {spec}"
            );
        }
    }
    let mut p = split_plan(&path, 2);
    p.tensors.retain(|t| {
        !(t.name == "token_embd.weight"
            && matches!(
                t.placement,
                strata_schemas::plan::Placement::Device { device: 1, .. }
            ))
    });
    let Err(e) = start_cuda(&p, open_model(&path).unwrap(), CudaOptions::default()) else {
        panic!("a split plan without the embedding copy started");
    };
    let e = e.to_string();
    assert!(
        e.contains("token_embd.weight") && e.contains("places no copy"),
        "{e}"
    );
}
