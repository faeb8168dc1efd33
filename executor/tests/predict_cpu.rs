//! The plan's predicted speeds against the CPU engine's measured ones, in-process: the CPU
//! device's `[device.cost]` coefficients are measured here with the engine's own product
//! (`backend::cpu::matmul`), as `strata-exec probe` would on a live machine; the model is then
//! planned with that probe, started, and timed (prefill of one ubatch, decode at one slot and
//! at four). Measurement and run share this build, so a debug build's slower arithmetic cancels.
//! Invariant: every prediction is within [`FACTOR`] of what the engine does. The factor is
//! wide because the CI machine is shared (other builds run beside the test); a cost model
//! that counts the wrong bytes, ignores the batch or the context would still miss it.

mod common;

use common::cpu_probe;
use std::path::PathBuf;
use std::time::Instant;
use strata_exec::backend::cpu::ops::matmul;
use strata_exec::backend::cpu::Matrix;
use strata_exec::engine::Engine;
use strata_exec::exec::{start_cpu, EngineOptions};
use strata_exec::load::GgufModel;
use strata_plan::solve::{solve, Outcome, PlanRequest};
use strata_schemas::arch::QuantRecipe;
use strata_schemas::ggml::GgmlType;
use strata_schemas::gguf::random::{write_random_model, RandomOptions};
use strata_schemas::gguf::testutil::tiny_qwen3next;
use strata_schemas::inventory::{HParams, SsmParams};
use strata_schemas::known::qwen3_30b_a3b;
use strata_schemas::plan::Plan;
use strata_schemas::probe::{CostProbe, GIB, MIB};
use strata_schemas::quant::quantize_row;
use strata_schemas::serve::ServeSettings;

/// Predicted and measured times agree within this factor either way.
const FACTOR: f64 = 3.0;

fn hp() -> HParams {
    HParams {
        n_layer: 2,
        n_embd: 128,
        n_vocab: 1024,
        n_ctx_train: 1024,
        n_head: 4,
        n_head_kv: 2,
        head_dim_k: 32,
        head_dim_v: 32,
        n_expert: 8,
        n_expert_used: 2,
        n_ff_exp: 128,
        ..qwen3_30b_a3b()
    }
}

/// A small Qwen3-Next whose linear layers' state (8 value heads of 64 x 64, 128 KiB a layer)
/// is a real share of a token's work (about half the predicted prefill and a quarter of a
/// decode step here, the CPU's recurrence reading and writing it every token).
fn next_hp() -> HParams {
    HParams {
        n_embd: 128,
        n_vocab: 1024,
        n_head: 4,
        n_head_kv: 2,
        head_dim_k: 32,
        head_dim_v: 32,
        n_expert: 8,
        n_expert_used: 2,
        n_ff_exp: 128,
        n_ff_shexp: 128,
        nextn_predict_layers: 0,
        ssm: Some(SsmParams {
            conv_kernel: 4,
            state_size: 64,
            group_count: 4,
            time_step_rank: 8,
            inner_size: 512,
        }),
        ..tiny_qwen3next()
    }
}

fn model(arch: &str, hp: &HParams) -> PathBuf {
    let d = common::run_dir("predict");
    let path = d.join(format!("{arch}-q8.gguf"));
    let recipe = QuantRecipe::preset("Q8_0").unwrap();
    let opts = RandomOptions {
        threads: 1,
        ..RandomOptions::default()
    };
    write_random_model(&path, arch, hp, &recipe, 3, opts).unwrap();
    path
}

/// A Q8_0 matrix of `rows` x `cols` (every row the same quantized values).
fn q8_matrix(rows: usize, cols: usize) -> Vec<u8> {
    let x: Vec<f32> = (0..cols).map(|i| ((i % 17) as f32 - 8.0) * 0.01).collect();
    let mut row = Vec::new();
    quantize_row(GgmlType::Q8_0, &x, &mut row).unwrap();
    row.repeat(rows)
}

/// Best seconds of `reps` runs of `f`.
fn best(reps: usize, mut f: impl FnMut()) -> f64 {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// The CPU device's coefficients, measured with the engine's product.
fn measure() -> CostProbe {
    let cols = 128;
    // One-token products over a working set the size of the model: bytes per second.
    let rows = 2 * MIB as usize / 136;
    let big = q8_matrix(rows, cols);
    let m = Matrix::new(GgmlType::Q8_0, cols, rows, &big).unwrap();
    let x = vec![0.5f32; cols];
    let mut y = vec![0f32; rows];
    let mut tmp = Vec::new();
    let t_big = best(3, || matmul(&m, &x, 1, &mut y, &mut tmp).unwrap());
    // Many tokens over a small matrix (cache-hot): flops per second.
    let (r2, n_tok) = (128, 16);
    let small = q8_matrix(r2, cols);
    let m2 = Matrix::new(GgmlType::Q8_0, cols, r2, &small).unwrap();
    let xs = vec![0.5f32; cols * n_tok];
    let mut ys = vec![0f32; r2 * n_tok];
    let mut tmp2 = vec![0f32; r2 * n_tok];
    let t_small = best(5, || matmul(&m2, &xs, n_tok, &mut ys, &mut tmp2).unwrap());
    // A product of next to nothing: the cost of one parallel section.
    let tiny = q8_matrix(8, cols);
    let m3 = Matrix::new(GgmlType::Q8_0, cols, 8, &tiny).unwrap();
    let mut y3 = vec![0f32; 8];
    let t_tiny = best(50, || matmul(&m3, &x, 1, &mut y3, &mut tmp).unwrap());
    let gbps = big.len() as f64 / t_big / 1e9;
    let tflops = 2.0 * (r2 * cols * n_tok) as f64 / t_small / 1e12;
    eprintln!(
        "measured: one-token products {gbps:.2} GB/s, {n_tok}-token products {:.1} GFLOP/s, a section {:.1} us",
        tflops * 1e3,
        t_tiny * 1e6
    );
    CostProbe {
        launch_us: Some(t_tiny * 1e6),
        product_latency_us: Some(t_tiny * 1e6),
        product_gbps: Some(gbps),
        attention_latency_us: Some(t_tiny * 1e6),
        attention_gbps: Some(gbps),
        gemm_tflops: Some(tflops),
        prefill_attention_tflops: Some(tflops),
        step_us: Some(0.0),
        host_expert_gbps: Some(gbps),
        host_expert_pinned_gbps: Some(gbps),
        // The CPU engine's experts are its products: the planner takes their figures.
        expert_latency_us: None,
        expert_gbps: None,
        expert_pass_gbps: None,
        expert_gemm_tflops: None,
        host_matvec_gbps: None,
        host_expert_latency_us: None,
        types: Default::default(),
        host_round_trip_us: None,
        kv_host_round_trip_us: None,
        eager_launch_us: None,
        expert_gemm_tokens_per_expert: None,
        delta_rule_token_us: None,
        delta_rule_latency_us: None,
        linear_state_gbps: None,
    }
}

fn plan(model: &std::path::Path, cost: CostProbe, batch: u32) -> Plan {
    let inv = strata_plan::model::load_model(model).unwrap();
    let mut probe = cpu_probe(1);
    probe.devices[0].vram_bytes = 512 * MIB;
    probe.devices[0].cost = Some(cost);
    let s = ServeSettings {
        max_context: 256,
        batch,
        ubatch: 16,
        pinned_chunk_mib: 1,
        ..ServeSettings::default()
    };
    let req = PlanRequest {
        inventory: &inv,
        model_source: model.display().to_string(),
        probe: &probe,
        probe_source: "measured cpu probe".into(),
        settings: &s,
        profile: None,
        vision: None,
        mtp_file: None,
    };
    match solve(&req).unwrap() {
        Outcome::Planned(p) => *p,
        Outcome::Infeasible(i) => panic!("infeasible: {:?}", i.reasons),
    }
}

fn within(what: &str, predicted: f64, measured: f64) {
    let r = predicted / measured;
    eprintln!("{what}: predicted {predicted:.4} s, measured {measured:.4} s, ratio {r:.2}");
    assert!(
        r > 1.0 / FACTOR && r < FACTOR,
        "{what}: predicted {predicted} s is not within {FACTOR}x of the measured {measured} s"
    );
}

#[test]
fn cpu_predictions_are_within_a_factor_of_three_of_the_engine() {
    predictions_hold(&model("qwen3moe", &hp()), 1024);
}

/// The same for Qwen3-Next: its linear layers' delta rule (every token reads and writes the
/// state on the CPU) and the state a decode step reads and writes for every slot.
#[test]
fn cpu_predictions_hold_for_qwen3next() {
    predictions_hold(&model("qwen3next", &next_hp()), 1024);
}

/// Plans the model at `path` (ids below `vocab`) with a measured CPU probe, runs it, and
/// holds prefill and decode at one and four slots to the plan's predictions.
fn predictions_hold(path: &std::path::Path, vocab: u32) {
    // One model at a time: the two tests' timings must not share the cores.
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let path = path.to_path_buf();
    let cost = measure();
    let p1 = plan(&path, cost.clone(), 1);
    let p4 = plan(&path, cost, 4);
    assert!(!p1.predicted.guessed, "{}", p1.predicted.basis);
    assert!(p4.predicted.decode_empty.aggregate_tok_s > p1.predicted.decode_empty.aggregate_tok_s);
    let opts = EngineOptions {
        progress: false,
        mem_available: Some(8 * GIB),
    };
    let mut e = start_cpu(&p4, Box::new(GgufModel::open(&path).unwrap()), opts).unwrap();
    let prompt: Vec<u32> = (0..16).map(|i| i * 37 % vocab).collect();

    // Each figure is the best of three runs, as the coefficients are: a busy machine slows
    // single runs of either side, not the best of several.
    e.prefill(0, &prompt, true).unwrap(); // warm-up
    let measured = best(3, || {
        e.reset_slot(0);
        e.prefill(0, &prompt, true).unwrap();
    });
    within("prefill of 16 tokens", p4.prefill_seconds(16, 16), measured);

    // Decode at one slot: 16 steps from 16 cells.
    let mut measured = f64::INFINITY;
    for _ in 0..3 {
        e.reset_slot(0);
        e.prefill(0, &prompt, true).unwrap();
        let mut tok = [0u32];
        let t = Instant::now();
        for _ in 0..16 {
            e.decode_greedy(&[(0, tok[0])], &mut tok).unwrap();
        }
        measured = measured.min(t.elapsed().as_secs_f64());
    }
    let predicted: f64 = (16..32).map(|c| p1.decode_step_seconds(1, c)).sum();
    within("16 decode steps at batch 1", predicted, measured);

    // Decode all four slots together: 8 steps from 16 cells each.
    let mut measured4 = f64::INFINITY;
    for _ in 0..3 {
        for s in 0..4 {
            e.reset_slot(s);
            e.prefill(s, &prompt, true).unwrap();
        }
        let mut toks = [0u32; 4];
        let t = Instant::now();
        for _ in 0..8 {
            let batch: Vec<(usize, u32)> = (0..4).map(|s| (s, toks[s])).collect();
            e.decode_greedy(&batch, &mut toks).unwrap();
        }
        measured4 = measured4.min(t.elapsed().as_secs_f64());
    }
    let predicted4: f64 = (16..24).map(|c| p4.decode_step_seconds(4, c)).sum();
    within("8 decode steps at batch 4", predicted4, measured4);
}
