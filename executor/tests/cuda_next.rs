//! Qwen3-Next (qwen3next, the Gated DeltaNet hybrid) on the CUDA engine end to end, against
//! the CPU engine (itself checked against transformers in `qwen3next_cpu`): random tiny
//! qwen3next GGUFs at shapes the CUDA kernels take (F32 and Q8_0 weights) planned for NVIDIA
//! devices give the CPU engine's logits for prefill passes of 1 to 32 tokens (the tensor-core
//! prefill included), decode steps with the slots' linear state (replayed as CUDA graphs) and
//! two slots decoding together, a slot reused for a new sequence, a slot rewound to its
//! prefix checkpoint, and a layer split over two planned devices on one GPU equal to one
//! device; then the transformers references of
//! `tests/data/tiny-qwen3next` run on CUDA wherever their shapes fit the kernels.
//! Needs a CUDA GPU: without one every test prints SKIP and returns (run them on the GPU
//! machine: `cargo test -p strata-exec --release --test cuda_next -- --test-threads=1
//! --nocapture`).

#![cfg(feature = "cuda")]

mod common;

use common::*;
use std::path::Path;
use strata_exec::backend::cuda::options::CudaOptions;
use strata_exec::backend::cuda::start::{preflight, start_cuda, CudaEngine};
use strata_exec::engine::Engine;
use strata_exec::exec::{start_cpu, CpuEngine, EngineOptions};
use strata_exec::load::open_model;
use strata_schemas::arch::QuantRecipe;
use strata_schemas::ggml::GgmlType;
use strata_schemas::gguf::convert::convert_hf_folder;
use strata_schemas::gguf::random::{write_random_model, RandomOptions};
use strata_schemas::inventory::HParams;
use strata_schemas::serve::ExpertCache;

/// Four blocks (every 2nd full attention), widths the CUDA kernels take (hidden and expert
/// widths multiples of 32), 16-wide linear heads (value heads twice the key heads), conv 4,
/// 4 experts all routed.
fn tiny_hp() -> HParams {
    HParams {
        // Every expert used: the top-k is then continuous in its inputs, so the two engines'
        // rounding (f16 inputs on the tensor-core prefill) cannot flip a routing choice.
        n_expert: 4,
        n_expert_used: 4,
        ..tiny_qwen3next_hp()
    }
}

/// Two slots of 128 cells, passes of up to 32 tokens (so prefill reaches the tensor-core
/// products at 16), on `devices` planned devices (split at `split`).
fn ask(gpu: bool, devices: usize, split: Option<Vec<u32>>) -> Ask {
    Ask {
        devices,
        split,
        batch: 2,
        ctx: 128,
        ubatch: 32,
        cache: ExpertCache::Off,
        gpu,
        ..Ask::default()
    }
}

fn cpu_engine(gguf: &Path) -> CpuEngine {
    let inv = strata_plan::model::load_model(gguf).unwrap();
    let p = plan_inventory("next-random", &inv, gguf, &ask(false, 1, None));
    start_cpu(&p, open_model(gguf).unwrap(), EngineOptions::default()).unwrap()
}

fn cuda_engine(gguf: &Path, a: &Ask) -> CudaEngine {
    let inv = strata_plan::model::load_model(gguf).unwrap();
    let p = plan_inventory("next-random", &inv, gguf, a);
    start_cuda(&p, open_model(gguf).unwrap(), CudaOptions::f32_products()).unwrap()
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 37 + seed) % 128).collect()
}

/// Every step of the comparison on both engines, each step's logits within `tol` of the
/// largest CPU logit: slot 0 prefilled in passes of 32, 8 and 1 tokens, slot 1 in one pass
/// of 5, six decode steps of both slots together (the same token count each step, so the
/// CUDA engine replays its captured graph), slot 0 alone, then slot 0 reused for a new
/// sequence. Teacher-forced with the CPU engine's greedy picks, so a near tie cannot fork
/// the two runs.
fn compare_runs(what: &str, cpu: &mut CpuEngine, gpu: &mut CudaEngine, tol: f32) -> f32 {
    let v = cpu.info().n_vocab;
    let mut worst = 0f32;
    let mut check = |step: &str, got: &[f32], want: &[f32]| {
        let r = max_rel(got, want);
        assert!(r < tol, "{what} {step}: logits differ by {r} (tol {tol})");
        worst = worst.max(r);
    };
    let p0 = prompt(41, 11);
    let mut last0 = Vec::new();
    for chunk in [&p0[..32], &p0[32..40], &p0[40..]] {
        let want = cpu.prefill_all(0, chunk).unwrap().to_vec();
        let got = gpu.prefill_all(0, chunk).unwrap().to_vec();
        check(
            &format!("prefill slot 0 ({} tokens)", chunk.len()),
            &got,
            &want,
        );
        last0 = want[(chunk.len() - 1) * v..].to_vec();
    }
    let p1 = prompt(5, 3);
    let want = cpu.prefill(1, &p1, true).unwrap().unwrap().to_vec();
    let got = gpu.prefill(1, &p1, true).unwrap().unwrap().to_vec();
    check("prefill slot 1 (5 tokens)", &got, &want);
    let mut last1 = want;
    for step in 0..6 {
        let batch = [(0usize, argmax(&last0)), (1usize, argmax(&last1))];
        let want = cpu.decode(&batch).unwrap().to_vec();
        let got = gpu.decode(&batch).unwrap().to_vec();
        check(&format!("decode step {step} of both slots"), &got, &want);
        last0 = want[..v].to_vec();
        last1 = want[v..].to_vec();
    }
    let batch = [(0usize, argmax(&last0))];
    let want = cpu.decode(&batch).unwrap().to_vec();
    let got = gpu.decode(&batch).unwrap().to_vec();
    check("decode of slot 0 alone", &got, &want);
    cpu.reset_slot(0);
    gpu.reset_slot(0);
    let p2 = prompt(19, 5);
    let want = cpu.prefill_all(0, &p2).unwrap().to_vec();
    let got = gpu.prefill_all(0, &p2).unwrap().to_vec();
    check("slot 0 reused for a new sequence", &got, &want);
    worst
}

/// Random tiny qwen3next models (F32; Q8_0) on the CUDA engine give the CPU engine's logits
/// within 1e-3 (F32: every product in f32, the delta rule token by token where the CPU
/// chunks it) and 2e-2 (Q8_0: the tensor-core prefill rounds its inputs to f16 and the
/// decode products read Q8_0 in another order) of the largest logit; a layer split over two
/// planned devices equals one device within 1e-5.
#[test]
fn random_qwen3next_matches_the_cpu_engine() {
    if !gpu_present() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let hp = tiny_hp();
    for (recipe, tol) in [("F32", 1e-3f32), ("Q8_0", 2e-2)] {
        let path = dir.path().join(format!("next-{recipe}.gguf"));
        let opts = RandomOptions {
            name: "tiny next".into(),
            ..Default::default()
        };
        let q = QuantRecipe::preset(recipe).unwrap();
        write_random_model(&path, "qwen3next", &hp, &q, 17, opts).unwrap();
        let mut cpu = cpu_engine(&path);
        let mut gpu = cuda_engine(&path, &ask(true, 1, None));
        let worst = compare_runs(recipe, &mut cpu, &mut gpu, tol);
        eprintln!("PASS {recipe}: CUDA within {worst:.2e} of the CPU engine (tol {tol:e})");

        // Two planned devices on one GPU (a linear and a full layer on each) equal one.
        let mut one = cuda_engine(&path, &ask(true, 1, None));
        let mut two = cuda_engine(&path, &ask(true, 2, Some(vec![2])));
        assert_eq!(two.stages().len(), 2);
        let p = prompt(23, 7);
        let a = one.prefill_all(1, &p).unwrap().to_vec();
        let b = two.prefill_all(1, &p).unwrap().to_vec();
        let r = max_rel(&b, &a);
        assert!(r < 1e-5, "{recipe}: a layer split differs by {r}");
        let t = argmax(&a[(p.len() - 1) * hp.n_vocab as usize..]);
        let a = one.decode(&[(1, t)]).unwrap().to_vec();
        let b = two.decode(&[(1, t)]).unwrap().to_vec();
        let r = max_rel(&b, &a);
        assert!(r < 1e-5, "{recipe}: a layer split's decode differs by {r}");
        eprintln!("PASS {recipe}: a split over two planned devices equals one");
    }
}

/// The transformers references (tests/data/tiny-qwen3next, converted to F32 GGUF as
/// `qwen3next_cpu` does) on the CUDA engine: every prompt position's logits within 1e-3 of
/// the largest logit of transformers with an f16 cache and the greedy continuation token for
/// token. The `cuda` variant (hidden 64, experts of width 32, MTP block, the 70-token prompt)
/// has the shapes the kernels take and must run; a variant whose shapes they do not take
/// (hidden and expert widths must be multiples of 32; the others' expert widths are 16 and
/// 20) is refused by the preflight with the reason, printed here as a SKIP of that variant.
#[test]
fn tiny_qwen3next_references_where_the_kernels_take_them() {
    if !gpu_present() {
        return;
    }
    let root =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/tiny-qwen3next");
    let tmp = tempfile::tempdir().unwrap();
    let mut ran = 0;
    for variant in ["base", "interval2", "odd", "cuda"] {
        let dir = root.join(variant);
        let r: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap();
        let gguf = tmp.path().join(format!("{variant}.gguf"));
        convert_hf_folder(&dir, &gguf, GgmlType::F32, None).unwrap();
        let inv = strata_plan::model::load_model(&gguf).unwrap();
        let a = Ask {
            batch: 1,
            ..ask(true, 1, None)
        };
        let plan = plan_inventory("next-reference", &inv, &gguf, &a);
        let host = open_model(&gguf).unwrap();
        if let Err(e) = preflight(&plan, host.as_ref(), &CudaOptions::f32_products()) {
            assert_ne!(variant, "cuda", "its shapes are the kernels': {e}");
            eprintln!("SKIP {variant}: the CUDA preflight refuses its shapes: {e}");
            continue;
        }
        let mut e = start_cuda(&plan, host, CudaOptions::f32_products()).unwrap();
        check_references(variant, &mut e, &r, 1e-3);
        ran += 1;
    }
    assert!(ran >= 1, "no reference variant ran");
}

/// `Engine::copy_slot` on the CUDA engine (device-to-device copies of every full-attention
/// layer's first cells and of the linear-attention state): slot 1, holding another sequence,
/// given slot 0's context decodes exactly as slot 0 does, on one planned device and on a
/// layer split over two (each stage copies its own layers).
#[test]
fn copy_slot_on_the_gpu_continues_the_sequence() {
    if !gpu_present() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let hp = tiny_hp();
    let path = dir.path().join("next-copy.gguf");
    let opts = RandomOptions {
        name: "tiny next".into(),
        ..Default::default()
    };
    let q = QuantRecipe::preset("F32").unwrap();
    write_random_model(&path, "qwen3next", &hp, &q, 17, opts).unwrap();
    let v = hp.n_vocab as usize;
    for (what, a) in [
        ("one device", ask(true, 1, None)),
        ("two devices", ask(true, 2, Some(vec![2]))),
    ] {
        let mut g = cuda_engine(&path, &a);
        let p = prompt(23, 7);
        let row = g.prefill_all(0, &p).unwrap()[(p.len() - 1) * v..].to_vec();
        g.prefill_all(1, &prompt(9, 3)).unwrap();
        assert!(g.copy_slot(0, 1).unwrap(), "{what}");
        assert_eq!(g.slot_len(1), 23, "{what}");
        let mut t = argmax(&row);
        for step in 0..4 {
            let l = g.decode(&[(0, t), (1, t)]).unwrap().to_vec();
            let r = max_rel(&l[v..], &l[..v]);
            assert!(r < 1e-6, "{what} step {step}: the copy differs by {r}");
            t = argmax(&l[..v]);
        }
        eprintln!("PASS {what}: a copied slot decodes as its original");
    }
}

/// The prefix checkpoint on the CUDA engine (device-to-device copies of each stage's linear
/// state into the plan's `prefix_checkpoint` region and back): a slot saved at the end of its
/// prompt, decoded on, rewound to the checkpoint and given a new continuation gives the
/// logits of the new prompt prefilled whole in the other slot, twice from one checkpoint, on
/// one planned device and on a layer split over two.
#[test]
fn prefix_checkpoint_on_the_gpu_rewinds_the_linear_state() {
    if !gpu_present() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let hp = tiny_hp();
    let path = dir.path().join("next-ckpt.gguf");
    let opts = RandomOptions {
        name: "tiny next".into(),
        ..Default::default()
    };
    let q = QuantRecipe::preset("F32").unwrap();
    write_random_model(&path, "qwen3next", &hp, &q, 19, opts).unwrap();
    let v = hp.n_vocab as usize;
    for (what, a) in [
        ("one device", ask(true, 1, None)),
        ("two devices", ask(true, 2, Some(vec![2]))),
    ] {
        let mut g = cuda_engine(&path, &a);
        let old = prompt(21, 7);
        g.prefill_all(0, &old).unwrap();
        assert!(
            g.save_prefix_checkpoint(0).unwrap(),
            "{what}: the plan places a checkpoint"
        );
        assert_eq!(g.prefix_checkpoint(0), Some(21), "{what}");
        for t in [3, 5, 7] {
            g.decode(&[(0, t)]).unwrap();
        }
        assert!(
            !g.truncate_slot(0, 20),
            "{what}: only the checkpoint's position"
        );
        for round in 0..2u32 {
            assert!(g.truncate_slot(0, 21), "{what} round {round}");
            let mut new = old.clone();
            new.extend(prompt(6 + round as usize, 11 + round));
            let got = g.prefill_all(0, &new[21..]).unwrap();
            let got = got[got.len() - v..].to_vec();
            g.reset_slot(1);
            let want = g.prefill_all(1, &new).unwrap();
            let want = want[want.len() - v..].to_vec();
            // Each within 1e-3 of the CPU engine (the F32 tolerance above), so within 2e-3 of
            // each other: a pass of 21 then 6 tokens against one of 27.
            let r = max_rel(&got, &want);
            assert!(r < 2e-3, "{what} round {round}: differs by {r}");
            let l = g.decode(&[(0, 42), (1, 42)]).unwrap().to_vec();
            let r = max_rel(&l[..v], &l[v..]);
            assert!(
                r < 2e-3,
                "{what} round {round}: the decode after differs by {r}"
            );
        }
        eprintln!(
            "PASS {what}: a slot rewound to its prefix checkpoint continues as a whole prefill"
        );
    }
}
