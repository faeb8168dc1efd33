//! Mixed steps on the CUDA engine (`Engine::step_mixed`, `StepKind::Mixed`: the prompt
//! chunk's rows on the prefill attention, the decode rows on the split-KV decode attention
//! from their row, every row-wise op once over both): the logits and greedy picks equal the
//! same requests run as separate prefill and decode steps on the same engine (whose decode
//! steps replay captured graphs with the fused attention), for random tiny Qwen3-MoE and
//! Qwen3-Next files, with passes of 8 tokens (the few-token kernels) and of 32 (mixed passes
//! of 16 rows or more take the tensor-core products, decode rows included), on one planned
//! device and on a layer split over two on one GPU.
//! Needs a CUDA GPU: without one every test prints SKIP and returns (run on the GPU machine:
//! `cargo test -p strata-exec --release --test cuda_mixed -- --test-threads=1 --nocapture`).

#![cfg(feature = "cuda")]

mod common;

use common::mixed::compare;
use common::*;
use std::path::Path;
use strata_exec::backend::cuda::options::CudaOptions;
use strata_exec::backend::cuda::start::{start_cuda, CudaEngine};
use strata_exec::engine::Engine;
use strata_exec::load::open_model;
use strata_schemas::arch::QuantRecipe;
use strata_schemas::gguf::random::{write_random_model, RandomOptions};
use strata_schemas::inventory::HParams;
use strata_schemas::serve::ExpertCache;

/// tests/common's tiny Qwen3-Next (or the same widths as an all-full-attention Qwen3-MoE)
/// with 4 experts all routed: the top-k is then continuous in its inputs, so the tensor-core
/// products' f16 inputs cannot flip a routing choice between the two runs.
fn hp(arch: &str) -> HParams {
    let next = HParams {
        n_expert: 4,
        n_expert_used: 4,
        ..tiny_qwen3next_hp()
    };
    if arch == "qwen3next" {
        return next;
    }
    HParams {
        n_ff_shexp: 0,
        full_attention_interval: None,
        ssm: None,
        rope_dim: None,
        ..next
    }
}

/// Three slots of 128 cells, passes of `ubatch` tokens, on `devices` planned NVIDIA devices
/// split at `split` (all on GPU 0).
fn engine(gguf: &Path, ubatch: u32, devices: usize, split: Option<Vec<u32>>) -> CudaEngine {
    let inv = strata_plan::model::load_model(gguf).unwrap();
    let ask = Ask {
        devices,
        split,
        batch: 3,
        ctx: 128,
        ubatch,
        cache: ExpertCache::Off,
        gpu: true,
        ..Ask::default()
    };
    let plan = plan_inventory("mixed-random", &inv, gguf, &ask);
    start_cuda(
        &plan,
        open_model(gguf).unwrap(),
        CudaOptions::f32_products(),
    )
    .unwrap()
}

#[test]
fn mixed_steps_on_the_gpu_equal_separate_prefill_and_decode_steps() {
    if !gpu_present() {
        return;
    }
    for arch in ["qwen3moe", "qwen3next"] {
        let dir = tempfile::tempdir().unwrap();
        let gguf = dir.path().join(format!("{arch}.gguf"));
        let recipe = QuantRecipe::preset("F32").unwrap();
        let opts = RandomOptions {
            name: format!("tiny {arch}"),
            ..Default::default()
        };
        write_random_model(&gguf, arch, &hp(arch), &recipe, 29, opts).unwrap();
        for (ubatch, long) in [(8u32, 29usize), (32, 70)] {
            for (devices, split) in [(1, None), (2, Some(vec![2]))] {
                let what = format!("{arch}, passes of {ubatch}, {devices} device(s)");
                let mut mixed = engine(&gguf, ubatch, devices, split.clone());
                let mut apart = engine(&gguf, ubatch, devices, split);
                let room = mixed.mixed_chunk(2);
                assert!(
                    (1..ubatch as usize).contains(&room),
                    "{what}: {room} prompt tokens beside 2 decode rows"
                );
                // f16 inputs on the tensor-core products (mixed passes of 16+ rows) against
                // the f32 few-token kernels of the separate decode steps.
                let steps = compare(&mut mixed, &mut apart, long, 2e-3);
                assert_eq!(steps, long.div_ceil(room), "{what}");
                eprintln!("PASS {what}: {steps} mixed steps agree");
            }
        }
    }
}
