//! The CUDA engine on plans whose KV does not all fit VRAM (`--kv-resident` below the
//! context): each slot's cells past the window live in the plan's pinned `kv_spill` chunks,
//! mapped into the GPU and read and written in place by the KV store and attention kernels.
//! Three slots, prompts whose prefill passes cross the window, and batched decode that takes
//! every slot past it: the logits equal the all-resident plan's within the KV type's bound
//! (only the attention kernels' summation order differs: the resident plan runs the fused
//! decode attention and the tensor-core prefill) with the same greedy tokens, and equal bit for
//! bit whatever the chunking of the spilled cells (7 cells a chunk against the planned one);
//! a slot copied by `copy_slot` (spilled cells included) continues as its source does. All of
//! it twice: with the GPU reading the spilled cells over PCIe (`--kv-host stream`) and with
//! the host CPU attending them beside the GPU's window (`--kv-host cpu`, which must have
//! attended some layers there).
//! The plans are checked without a GPU; the runs need one: without it they print SKIP and
//! return (on the GPU machine: `cargo test -p strata-exec --release --test cuda_kvspill --
//! --test-threads=1 --nocapture`).

#![cfg(feature = "cuda")]

mod common;

use common::*;
use strata_exec::backend::cuda::options::{CudaOptions, KvHostOverride};
use strata_exec::backend::cuda::start::{preflight, start_cuda, CudaEngine};
use strata_exec::engine::Engine;
use strata_exec::load::open_model;
use strata_schemas::plan::{PinnedChunk, Plan};
use strata_schemas::serve::KvType;

/// Cells per slot in VRAM in the spilling plans.
const WINDOW: u64 = 40;

/// A random Q8_0 Qwen3-MoE of two layers, 8 query heads over 2 KV heads of 128 (the
/// tensor-core prefill's head size), written into `dir`.
fn model(dir: &std::path::Path) -> std::path::PathBuf {
    use strata_schemas::gguf::random::{write_random_model, RandomOptions};
    let mut hp = strata_schemas::known::qwen3_30b_a3b();
    hp.n_layer = 2;
    hp.n_embd = 256;
    hp.n_head = 8;
    hp.n_head_kv = 2;
    hp.head_dim_k = 128;
    hp.head_dim_v = 128;
    hp.n_expert = 8;
    hp.n_expert_used = 2;
    hp.n_ff_exp = 64;
    hp.n_vocab = 512;
    let recipe = strata_schemas::arch::QuantRecipe::preset("Q8_0").unwrap();
    let gguf = dir.join("kvspill-q8_0.gguf");
    write_random_model(
        &gguf,
        "qwen3moe",
        &hp,
        &recipe,
        11,
        RandomOptions::default(),
    )
    .unwrap();
    gguf
}

/// A one-GPU plan of `gguf`: three slots of 128 cells, `resident` of them in VRAM.
fn gpu_plan(gguf: &std::path::Path, kv: KvType, resident: Option<u64>) -> Plan {
    let inv = strata_plan::model::load_model(gguf).unwrap();
    let ask = Ask {
        gpu: true,
        ctx: 128,
        batch: 3,
        ubatch: 16,
        kv,
        resident,
        ..Ask::default()
    };
    plan_inventory("kvspill", &inv, gguf, &ask)
}

/// The plan's `kv_spill` chunks of device 0: (count, bytes).
fn spill_chunks(p: &Plan) -> (u64, u64) {
    let c = p
        .host
        .pinned_chunks
        .iter()
        .filter(|c| c.device == 0 && c.purpose == "kv_spill");
    (c.clone().count() as u64, c.map(|c| c.bytes).sum())
}

/// `p` with its spilled cells re-chunked `per` cells a chunk (the last holds the rest).
fn rechunked(p: &Plan, per: u64) -> Plan {
    let mut q = p.clone();
    let (_, bytes) = spill_chunks(p);
    let cells = p.serve.batch as u64 * (p.serve.max_context - p.serve.kv_resident);
    let cell = bytes / cells;
    q.host.pinned_chunks.retain(|c| c.purpose != "kv_spill");
    let mut left = cells;
    while left > 0 {
        let n = left.min(per);
        q.host.pinned_chunks.push(PinnedChunk {
            purpose: "kv_spill".into(),
            device: 0,
            bytes: n * cell,
        });
        left -= n;
    }
    q.host.pinned_bytes = q.host.pinned_chunks.iter().map(|c| c.bytes).sum();
    q
}

/// Three prompts prefilled in 16-token passes (slot 0's and slot 1's cross the window inside
/// a pass, slot 2's stays below it), then `steps` greedy decode steps of all three slots
/// together (slot 2 crosses the window while decoding): every logit row and every token.
fn scenario(e: &mut CudaEngine, steps: usize) -> (Vec<f32>, Vec<u32>) {
    let v = e.info().n_vocab;
    let prompts: [Vec<u32>; 3] = [
        (0..57).map(|i| (i * 53 + 7) % 512).collect(),
        (0..45).map(|i| (i * 31 + 3) % 512).collect(),
        (0..9).map(|i| (i * 17 + 5) % 512).collect(),
    ];
    let (mut logits, mut tokens) = (Vec::new(), Vec::new());
    let mut next = [0u32; 3];
    for (slot, p) in prompts.iter().enumerate() {
        e.reset_slot(slot);
        for chunk in p.chunks(16) {
            logits.extend_from_slice(e.prefill_all(slot, chunk).unwrap());
        }
        next[slot] = argmax(&logits[logits.len() - v..]);
    }
    for _ in 0..steps {
        let l = e
            .decode(&[(0, next[0]), (1, next[1]), (2, next[2])])
            .unwrap();
        for (s, n) in next.iter_mut().enumerate() {
            *n = argmax(&l[s * v..(s + 1) * v]);
        }
        tokens.extend_from_slice(&next);
        logits.extend_from_slice(l);
    }
    (logits, tokens)
}

/// After [`scenario`]: slot 0 (every cell past the window written) copied into slot 2 by
/// `copy_slot` (its VRAM cells on the device, its spilled cells on the host), then both
/// decode the same token: the two rows agree (within 1e-5 of the largest logit).
fn copy_continues_the_slot(e: &mut CudaEngine, what: &str) {
    let v = e.info().n_vocab;
    assert!(
        e.slot_len(0) > WINDOW,
        "{what}: slot 0 reaches past the window"
    );
    assert!(e.copy_slot(0, 2).unwrap(), "{what}: copy_slot refused");
    assert_eq!(e.slot_len(2), e.slot_len(0));
    let l = e.decode(&[(0, 7), (2, 7)]).unwrap();
    // The same cells and position; only the rows' places in the batch differ.
    let err = max_rel(&l[v..2 * v], &l[..v]);
    assert!(
        err < 1e-5,
        "{what}: the copied slot's row is {err} off its source's"
    );
}

#[test]
fn spilled_kv_equals_the_all_resident_run() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = model(dir.path());
    let gpu = gpu_present();
    for kv in [KvType::F16, KvType::Q8_0] {
        let full = gpu_plan(&gguf, kv, None);
        let spill = gpu_plan(&gguf, kv, Some(WINDOW));
        assert_eq!(
            spill_chunks(&full).0,
            0,
            "{kv:?}: the reference keeps all KV"
        );
        assert_eq!(
            spill.serve.kv_resident, WINDOW,
            "{kv:?}: the window as asked"
        );
        let (n, bytes) = spill_chunks(&spill);
        assert!(
            n >= 1 && bytes > 0,
            "{kv:?}: the plan pins the spilled cells"
        );
        let straddle = rechunked(&spill, 7);
        assert!(spill_chunks(&straddle).0 > 1, "{kv:?}: several chunks");
        for p in [&spill, &straddle] {
            let host = open_model(&gguf).unwrap();
            if let Err(e) = preflight(p, host.as_ref(), &CudaOptions::f32_products()) {
                panic!("{kv:?}: preflight refuses the spilling plan: {e}");
            }
        }
        if !gpu {
            continue;
        }
        let start = |p: &Plan, kv_host| {
            let opts = CudaOptions {
                kv_host,
                ..CudaOptions::f32_products()
            };
            start_cuda(p, open_model(&gguf).unwrap(), opts)
        };
        let (want_l, want_t) = scenario(&mut start(&full, KvHostOverride::Stream).unwrap(), 48);
        for policy in [KvHostOverride::Stream, KvHostOverride::Cpu] {
            let mut runs = Vec::new();
            for (what, p) in [("as planned", &spill), ("7 cells a chunk", &straddle)] {
                let what = format!("{what}, --kv-host {policy:?}");
                let mut g = start(p, policy).unwrap();
                assert!(
                    !g.fused_attention(),
                    "{kv:?} {what}: fused attention reads VRAM only"
                );
                assert_eq!(
                    g.allocations(),
                    p.devices.len() as u64 + spill_chunks(p).0,
                    "{kv:?} {what}: one arena per planned device and the planned KV chunks"
                );
                let (l, t) = scenario(&mut g, 48);
                let err = max_rel(&l, &want_l);
                eprintln!("{kv:?} {what}: logits within {err:e} of the all-resident run");
                let bound = if kv == KvType::F16 { 2e-3 } else { 1e-2 };
                assert!(err < bound, "{kv:?} {what}: {err} (bound {bound})");
                assert_eq!(t, want_t, "{kv:?} {what}: greedy tokens");
                // Two layers a step once any slot is past the window: most of the 48 steps.
                let on_host = g.kv_host_layers();
                match policy {
                    KvHostOverride::Cpu => assert!(
                        on_host >= 2 * 40,
                        "{kv:?} {what}: the host CPU attended only {on_host} layers"
                    ),
                    _ => assert_eq!(on_host, 0, "{kv:?} {what}: nothing on the host"),
                }
                runs.push(l);
                copy_continues_the_slot(&mut g, &format!("{kv:?} {what}"));
            }
            assert!(
                runs[0] == runs[1],
                "{kv:?} --kv-host {policy:?}: the chunking of the spilled cells changes no logit"
            );
        }
    }
}
