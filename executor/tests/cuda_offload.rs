//! The CUDA engine on plans whose experts do not all fit VRAM: the planned expert-cache slots
//! seeded from the plan, misses streamed from host memory into slots, prefill passes run in
//! groups of tokens whose experts fit the slots. The logits equal an all-resident run of the
//! same file bit for bit (F32 and Q8_0 experts, the latter through the device layout
//! conversion of a streamed miss) on every miss path: the plan's pinned host expert tier with
//! its copy stream (as planned, and re-chunked so experts of one layer straddle chunks) and
//! the mapped file (the plan without the tier); with LRU and with LFU over a pinned hot set,
//! the counters see the misses, and the router's picks are counted. The hybrid miss path
//! (`--miss-policy cpu`, and the plan's own choice): decode misses computed on the CPU while
//! the GPU computes the hits give the resident run's greedy tokens, logits within the f32
//! tolerance of a GPU-vs-CPU comparison (the CPU sums in another order).
//! The plans are checked without a GPU; the runs need one: without it they print SKIP and
//! return (on the GPU machine: `cargo test -p strata-exec --release --test cuda_offload --
//! --test-threads=1 --nocapture`).

#![cfg(feature = "cuda")]

mod common;

use common::*;
use strata_exec::backend::cuda::options::{CudaOptions, KernelOptions, MissOverride};
use strata_exec::backend::cuda::start::{preflight, start_cuda};
use strata_exec::engine::Engine;
use strata_exec::load::open_model;
use strata_exec::sampler::argmax;
use strata_schemas::ggml::GgmlType;
use strata_schemas::plan::{PinnedChunk, Placement, Plan, RegionKind, PINNED_EXPERTS};
use strata_schemas::serve::ExpertCache;

/// A GPU plan of `model` (a GGUF converted from the `base` reference) with `cache`.
fn gpu_plan(model: &std::path::Path, cache: ExpertCache) -> Plan {
    let inv = strata_plan::model::load_model(model).unwrap();
    let ask = Ask {
        gpu: true,
        cache,
        ..Ask::default()
    };
    plan_inventory("base", &inv, model, &ask)
}

/// (experts in no slot, slots) of a one-device plan: experts of the layers whose stacks stay
/// in host memory that `resident_experts` leaves out.
fn tiers(p: &Plan) -> (u64, u64) {
    let dp = &p.devices[0];
    let hosted_layers = p
        .tensors
        .iter()
        .filter(|t| {
            t.name.ends_with("ffn_gate_exps.weight")
                && matches!(t.placement, Placement::HostExperts { .. })
        })
        .count() as u64;
    let out = hosted_layers * p.model.n_expert - dp.resident_experts.len() as u64;
    (out, dp.expert_cache_slots)
}

/// Prompt logits (every position, in `ubatch` passes) and `n` greedy tokens with the logits
/// of each decode step.
fn run(e: &mut dyn Engine, prompt: &[u32], n: usize) -> (Vec<f32>, Vec<u32>) {
    e.reset_slot(0);
    let ub = e.info().ubatch;
    let v = e.info().n_vocab;
    let mut logits = Vec::new();
    for chunk in prompt.chunks(ub) {
        logits.extend_from_slice(e.prefill_all(0, chunk).unwrap());
    }
    let mut next = argmax(&logits[logits.len() - v..]);
    let mut out = vec![next];
    while out.len() < n {
        let l = e.decode(&[(0, next)]).unwrap();
        logits.extend_from_slice(l);
        next = argmax(l);
        out.push(next);
    }
    (logits, out)
}

/// The plan's pinned host expert chunks of device 0: (count, bytes).
fn expert_chunks(p: &Plan) -> (u64, u64) {
    let c = p
        .host
        .pinned_chunks
        .iter()
        .filter(|c| c.device == 0 && c.purpose == PINNED_EXPERTS);
    (c.clone().count() as u64, c.map(|c| c.bytes).sum())
}

/// `p` with its host expert tier cut into chunks of `per` experts (the last holds the rest),
/// or without the tier when `per` is 0 (misses then read the mapped file).
fn rechunked(p: &Plan, per: u64) -> Plan {
    let mut q = p.clone();
    let (_, bytes) = expert_chunks(p);
    q.host.pinned_chunks.retain(|c| c.purpose != PINNED_EXPERTS);
    let slot = p.devices[0].expert_slot_bytes;
    let mut left = bytes / slot;
    while per > 0 && left > 0 {
        let n = left.min(per);
        q.host.pinned_chunks.push(PinnedChunk {
            purpose: PINNED_EXPERTS.into(),
            device: 0,
            bytes: n * slot,
        });
        left -= n;
    }
    q.host.pinned_bytes = q.host.pinned_chunks.iter().map(|c| c.bytes).sum();
    q
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// Streamed misses give the all-resident logits, for a cache of half the experts and for
/// the minimum working set (where prefill passes split into groups of tokens).
#[test]
fn streamed_misses_equal_the_all_resident_run() {
    let dir = tempfile::tempdir().unwrap();
    let r = reference("base");
    let prompts = prompts(&r);
    let gpu = gpu_present();
    for ty in [GgmlType::F32, GgmlType::Q8_0] {
        let gguf = dir.path().join(format!("tiny-{ty}.gguf"));
        strata_schemas::gguf::convert::convert_hf_folder(&data("base"), &gguf, ty, None).unwrap();
        let full = gpu_plan(&gguf, ExpertCache::Auto);
        assert_eq!(
            tiers(&full).0,
            0,
            "{ty}: the reference plan keeps every expert in VRAM"
        );
        let n_all = full.model.n_layer as u64 * full.model.n_expert;
        let mut offloaded = Vec::new();
        for cache in [ExpertCache::Slots(n_all / 2), ExpertCache::Off] {
            let p = gpu_plan(&gguf, cache);
            let (out, slots) = tiers(&p);
            assert!(
                out > 0,
                "{ty} {cache:?}: the plan keeps experts in host memory"
            );
            assert!(slots < n_all, "{ty} {cache:?}");
            assert!(p.devices[0].resident_experts.len() as u64 <= slots);
            let dp = &p.devices[0];
            assert!(
                dp.region_bytes(RegionKind::ExpertCache) >= slots * dp.expert_slot_bytes,
                "{ty} {cache:?}: the region holds the slots"
            );
            // Every start-up check that needs no GPU passes.
            let host = open_model(&gguf).unwrap();
            if let Err(e) = preflight(&p, host.as_ref(), &CudaOptions::f32_products()) {
                panic!("{ty} {cache:?}: preflight refuses the plan: {e}");
            }
            // The host expert tier pins every expert of the cached layers, whole experts a
            // chunk, at most the planned chunk size (1 MiB in these plans) each.
            let (chunks, bytes) = expert_chunks(&p);
            let hosted = out + dp.resident_experts.len() as u64;
            assert_eq!(bytes, hosted * dp.expert_slot_bytes, "{ty} {cache:?}");
            assert!(
                chunks >= 1 && p.host.pinned_chunk_max_bytes <= (1 << 20).max(dp.expert_slot_bytes)
            );
            let straddle = rechunked(&p, 3);
            let pageable = rechunked(&p, 0);
            offloaded.push((format!("{cache:?} pinned"), p));
            offloaded.push((format!("{cache:?} pinned, 3 experts a chunk"), straddle));
            offloaded.push((format!("{cache:?} mapped file"), pageable));
        }
        if !gpu {
            continue;
        }
        let mut want = start_cuda(
            &full,
            open_model(&gguf).unwrap(),
            CudaOptions::f32_products(),
        )
        .unwrap();
        let reference: Vec<_> = prompts.iter().map(|pr| run(&mut want, pr, 8)).collect();
        assert_eq!(want.stats().expert_misses, 0);
        for (cache, p) in &offloaded {
            let mut g =
                start_cuda(p, open_model(&gguf).unwrap(), CudaOptions::f32_products()).unwrap();
            assert_eq!(
                g.allocations(),
                p.devices.len() as u64 + expert_chunks(p).0,
                "one arena per planned device and the planned pinned expert chunks, nothing more for the cache"
            );
            let mut fed = 0u64;
            for (pi, pr) in prompts.iter().enumerate() {
                let (gl, gt) = run(&mut g, pr, 8);
                let (wl, wt) = &reference[pi];
                let d = max_abs(&gl, wl);
                eprintln!(
                    "{ty} {cache} prompt {pi}: max |offloaded - resident| = {d:e}{}",
                    if gl == *wl { " (bit for bit)" } else { "" }
                );
                // The same kernels read the same expert bytes from another address: every
                // token's products are computed alike, in the same summation order.
                assert!(
                    gl == *wl,
                    "{ty} {cache} prompt {pi}: {d} off the resident run"
                );
                assert_eq!(&gt, wt, "{ty} {cache} prompt {pi}: greedy tokens");
                fed += pr.len() as u64 + 7;
            }
            let s = g.stats();
            eprintln!(
                "{ty} {cache}: {} hits, {} misses",
                s.expert_hits, s.expert_misses
            );
            assert!(s.expert_misses > 0, "{ty} {cache}: misses were streamed");
            let prof = g
                .routing_profile()
                .expect("the cache counts the router's picks");
            for l in 0..prof.layers {
                let row: u64 = (0..prof.experts).map(|x| prof.count(l, x)).sum();
                assert_eq!(row, fed * p.model.n_expert_used, "{ty} layer {l}");
            }
            // A lookup per distinct expert of a group and layer: never more than the picks.
            let picks = fed * p.model.n_expert_used * p.model.n_layer as u64;
            assert!(s.expert_hits + s.expert_misses <= picks);
            // Every miss copies one whole expert (gate, up, down), at most a slot.
            let per = s.expert_bytes_streamed / s.expert_misses;
            assert_eq!(per * s.expert_misses, s.expert_bytes_streamed);
            assert!(per > 0 && per <= p.devices[0].expert_slot_bytes);
        }
    }
}

/// Prefill passes long enough to fetch the next layer's experts ahead (16 tokens or more of
/// top-2 over 8 experts, a cache of 12 slots: `prefetch_next` in expert_cache.rs, its copies
/// into slots the layer before is still reading ordered by the group events) give the
/// all-resident logits bit for bit, with the tier as planned and re-chunked.
#[test]
fn prefetched_prefill_equals_the_all_resident_run() {
    let dir = tempfile::tempdir().unwrap();
    let r = reference("base");
    let mut prompt: Vec<u32> = prompts(&r).concat();
    prompt.truncate(40);
    assert!(prompt.len() >= 16, "a prompt long enough to prefetch");
    let gpu = gpu_present();
    for ty in [GgmlType::F32, GgmlType::Q8_0] {
        let gguf = dir.path().join(format!("tiny-{ty}.gguf"));
        strata_schemas::gguf::convert::convert_hf_folder(&data("base"), &gguf, ty, None).unwrap();
        let inv = strata_plan::model::load_model(&gguf).unwrap();
        let ask = |cache| Ask {
            gpu: true,
            cache,
            ubatch: 32,
            ..Ask::default()
        };
        let full = plan_inventory("base", &inv, &gguf, &ask(ExpertCache::Auto));
        let p = plan_inventory("base", &inv, &gguf, &ask(ExpertCache::Slots(12)));
        assert_eq!(tiers(&full).0, 0);
        assert!(
            tiers(&p).0 > 0 && tiers(&p).1 == 12,
            "{ty}: {:?}",
            tiers(&p)
        );
        assert!(expert_chunks(&p).0 > 0, "{ty}: the plan pins the tier");
        if !gpu {
            continue;
        }
        let n = (full.serve.max_context as usize - prompt.len()).min(8);
        let mut a = start_cuda(
            &full,
            open_model(&gguf).unwrap(),
            CudaOptions::f32_products(),
        )
        .unwrap();
        let (al, at) = run(&mut a, &prompt, n);
        for (name, q) in [
            ("as planned", p.clone()),
            ("3 experts a chunk", rechunked(&p, 3)),
        ] {
            let mut b =
                start_cuda(&q, open_model(&gguf).unwrap(), CudaOptions::f32_products()).unwrap();
            let (bl, bt) = run(&mut b, &prompt, n);
            let s = b.stats();
            eprintln!(
                "{ty} {name}: max |prefetched - resident| = {:e}; {} hits, {} misses, {} bytes",
                max_abs(&al, &bl),
                s.expert_hits,
                s.expert_misses,
                s.expert_bytes_streamed
            );
            assert!(al == bl, "{ty} {name}: logits");
            assert_eq!(at, bt, "{ty} {name}: tokens");
            assert!(s.expert_misses > 0);
        }
    }
}

/// A slot is refilled while other layers' experts are evicted and fetched again: a long
/// decode on the smallest cache keeps giving the resident run's tokens.
#[test]
fn replacement_keeps_the_tokens_over_a_long_decode() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("tiny-f32.gguf");
    strata_schemas::gguf::convert::convert_hf_folder(&data("base"), &gguf, GgmlType::F32, None)
        .unwrap();
    let full = gpu_plan(&gguf, ExpertCache::Auto);
    let small = gpu_plan(&gguf, ExpertCache::Off);
    assert!(tiers(&small).0 > 0);
    if !gpu_present() {
        return;
    }
    let r = reference("base");
    let prompt = &prompts(&r)[0];
    let mut a = start_cuda(
        &full,
        open_model(&gguf).unwrap(),
        CudaOptions::f32_products(),
    )
    .unwrap();
    let mut b = start_cuda(
        &small,
        open_model(&gguf).unwrap(),
        CudaOptions::f32_products(),
    )
    .unwrap();
    let n = (full.serve.max_context as usize - prompt.len()).min(48);
    let (al, at) = run(&mut a, prompt, n);
    let (bl, bt) = run(&mut b, prompt, n);
    assert_eq!(at, bt);
    assert!(max_abs(&al, &bl) <= 1e-5);
    let s = b.stats();
    assert!(
        s.expert_misses > tiers(&small).1,
        "more misses than slots: slots were reused ({} misses)",
        s.expert_misses
    );
    // LFU with the plan's hottest resident experts pinned (`--kernel-options expert-lfu`):
    // other misses, the same tokens and logits.
    let n_all = full.model.n_layer as u64 * full.model.n_expert;
    let half = gpu_plan(&gguf, ExpertCache::Slots(n_all / 2));
    let lfu = CudaOptions {
        kernels: KernelOptions {
            expert_lfu: true,
            ..KernelOptions::f32_products()
        },
        ..CudaOptions::f32_products()
    };
    for (name, opts) in [("lru", CudaOptions::f32_products()), ("lfu", lfu)] {
        let mut c = start_cuda(&half, open_model(&gguf).unwrap(), opts).unwrap();
        let (cl, ct) = run(&mut c, prompt, n);
        assert_eq!(at, ct, "{name}");
        assert!(max_abs(&al, &cl) <= 1e-5, "{name}");
        let s = c.stats();
        eprintln!(
            "{name}, {} slots: {} hits, {} misses over {n} tokens",
            tiers(&half).1,
            s.expert_hits,
            s.expert_misses
        );
    }
}

/// The hybrid miss path: with half the experts and with the minimum working set in VRAM,
/// `--miss-policy cpu` computes decode misses on the CPU (from the mapped file, every core)
/// while the GPU computes the hits, `stream` copies every miss, `auto` takes the plan's
/// choice. Every policy gives the all-resident run's greedy tokens; the logits stay within
/// 1e-4 of the largest (the bound of the GPU-vs-CPU engine comparison in cuda_engine.rs:
/// only the summation order differs), `stream` bit for bit; `cpu` computes decode misses on
/// the CPU (prefill passes still stream theirs) and `stream` computes none there.
#[test]
fn cpu_computed_misses_match_the_all_resident_run() {
    let dir = tempfile::tempdir().unwrap();
    let r = reference("base");
    let prompts = prompts(&r);
    let gpu = gpu_present();
    for ty in [GgmlType::F32, GgmlType::Q8_0] {
        let gguf = dir.path().join(format!("tiny-hybrid-{ty}.gguf"));
        strata_schemas::gguf::convert::convert_hf_folder(&data("base"), &gguf, ty, None).unwrap();
        let full = gpu_plan(&gguf, ExpertCache::Auto);
        let n_all = full.model.n_layer as u64 * full.model.n_expert;
        let plans = [
            (
                "half the experts",
                gpu_plan(&gguf, ExpertCache::Slots(n_all / 2)),
            ),
            ("minimum working set", gpu_plan(&gguf, ExpertCache::Off)),
        ];
        for (name, p) in &plans {
            assert!(tiers(p).0 > 0, "{ty} {name}: experts stay in host memory");
            eprintln!(
                "{ty} {name}: the plan's miss policy is {}",
                p.devices[0].cost.miss_policy()
            );
        }
        if !gpu {
            eprintln!("SKIP: {ty}: no GPU, the hybrid runs are not checked");
            continue;
        }
        let mut want = start_cuda(
            &full,
            open_model(&gguf).unwrap(),
            CudaOptions::f32_products(),
        )
        .unwrap();
        let reference: Vec<_> = prompts.iter().map(|pr| run(&mut want, pr, 8)).collect();
        for (name, p) in &plans {
            for policy in [MissOverride::Stream, MissOverride::Cpu, MissOverride::Plan] {
                let opts = CudaOptions {
                    miss_policy: policy,
                    ..CudaOptions::f32_products()
                };
                let mut g = start_cuda(p, open_model(&gguf).unwrap(), opts).unwrap();
                let mut worst = 0f32;
                let mut decode_misses = 0u64;
                for (pi, pr) in prompts.iter().enumerate() {
                    let before = g.stats();
                    let (gl, gt) = run(&mut g, pr, 8);
                    let (wl, wt) = &reference[pi];
                    assert_eq!(&gt, wt, "{ty} {name} {policy:?} prompt {pi}: greedy tokens");
                    let e = max_rel(&gl, wl);
                    worst = worst.max(e);
                    assert!(e < 1e-4, "{ty} {name} {policy:?} prompt {pi}: {e}");
                    if policy == MissOverride::Stream {
                        assert!(gl == *wl, "{ty} {name} stream prompt {pi}: bit for bit");
                    }
                    let after = g.stats();
                    decode_misses += after.expert_misses_cpu - before.expert_misses_cpu;
                }
                let s = g.stats();
                eprintln!(
                    "{ty} {name} {policy:?}: worst {worst:e} of the largest logit; {} hits, {} misses streamed, {} on the CPU",
                    s.expert_hits, s.expert_misses, s.expert_misses_cpu
                );
                match policy {
                    MissOverride::Stream => assert_eq!(s.expert_misses_cpu, 0, "{ty} {name}"),
                    MissOverride::Cpu => assert!(
                        decode_misses > 0,
                        "{ty} {name}: cpu computed decode misses on the CPU"
                    ),
                    MissOverride::Plan => {}
                }
            }
        }
    }
}
