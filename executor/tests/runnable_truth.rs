//! The planner's `runnable` verdict against what this build's executor does with the plan: a
//! plan a backend refuses must never be reported runnable on it. Tiny random GGUF models
//! (Q8_0, Q4_K_M with its Q6_K tensors, a qwen3next, a head group the CUDA kernels cannot
//! take) are planned for CPU devices and for NVIDIA devices, with KV spill, host experts and
//! layer splits; each plan's verdict is checked against `exec::start_cpu` (CPU) and
//! `cuda::start::preflight` (CUDA's start-up checks, which need no GPU).
//! Invariant: runnable(plan) on a backend => the backend's start-up accepts the plan; and each
//! case's verdict is pinned, so a table change that makes a report lie fails here.

mod common;

use common::{cpu_probe, gpu_probe};
use std::path::{Path, PathBuf};
use strata_exec::exec::{start_cpu, EngineOptions};
use strata_exec::load::GgufModel;
use strata_plan::solve::{solve, Outcome, PlanRequest};
use strata_schemas::arch::QuantRecipe;
use strata_schemas::capability::{runnable, Backend};
use strata_schemas::gguf::random::{write_random_model, RandomOptions};
use strata_schemas::inventory::{HParams, SsmParams};
use strata_schemas::known::qwen3_30b_a3b;
use strata_schemas::plan::Plan;
use strata_schemas::probe::{HardwareProbe, GIB};
use strata_schemas::serve::{ExpertCache, LayerSplit, ServeSettings};

/// A Qwen3-MoE small enough to write in a blink, wide enough for Q4_K rows (256).
fn tiny_moe() -> HParams {
    HParams {
        n_layer: 2,
        n_embd: 256,
        n_vocab: 512,
        n_ctx_train: 512,
        n_head: 4,
        n_head_kv: 2,
        head_dim_k: 64,
        head_dim_v: 64,
        n_expert: 8,
        n_expert_used: 2,
        n_ff_exp: 256,
        ..qwen3_30b_a3b()
    }
}

/// 32 query heads over one KV head: a group the CUDA decode attention cannot take (16 max).
fn wide_group() -> HParams {
    HParams {
        n_head: 32,
        n_head_kv: 1,
        head_dim_k: 8,
        head_dim_v: 8,
        ..tiny_moe()
    }
}

/// A small Qwen3-Next: every 4th layer full attention, the rest gated delta net.
fn tiny_next() -> HParams {
    HParams {
        n_layer: 4,
        n_ff_shexp: 256,
        full_attention_interval: Some(4),
        ssm: Some(SsmParams {
            conv_kernel: 4,
            state_size: 32,
            group_count: 2,
            time_step_rank: 4,
            inner_size: 128,
        }),
        rope_dim: Some(16),
        ..tiny_moe()
    }
}

fn dir() -> PathBuf {
    common::run_dir("runnable")
}

/// Write a random model (types the quantizers do not produce are zero blocks); one writer at
/// a time, as the tests share the files.
fn model(name: &str, arch: &str, hp: &HParams, preset: &str) -> PathBuf {
    static WRITING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = WRITING.lock().unwrap_or_else(|e| e.into_inner());
    let path = dir().join(format!("{name}.gguf"));
    if !path.exists() {
        let opts = RandomOptions {
            threads: 1,
            zero_fill_unsupported: true,
            ..RandomOptions::default()
        };
        let recipe = QuantRecipe::preset(preset).unwrap();
        write_random_model(&path, arch, hp, &recipe, 7, opts).unwrap();
    }
    path
}

fn plan(model: &Path, probe: &HardwareProbe, s: &ServeSettings) -> Plan {
    let inv = strata_plan::model::load_model(model).unwrap();
    let req = PlanRequest {
        inventory: &inv,
        model_source: model.display().to_string(),
        probe,
        probe_source: "test probe".into(),
        settings: s,
        profile: None,
        vision: None,
        mtp_file: None,
    };
    match solve(&req).unwrap() {
        Outcome::Planned(p) => *p,
        Outcome::Infeasible(i) => panic!("{}: infeasible: {:?}", model.display(), i.reasons),
    }
}

fn settings() -> ServeSettings {
    ServeSettings {
        max_context: 256,
        ubatch: 16,
        pinned_chunk_mib: 1,
        ..ServeSettings::default()
    }
}

/// Whether the CPU engine starts the plan.
fn cpu_starts(plan: &Plan, model: &Path) -> Result<(), String> {
    let host = GgufModel::open(model).map_err(|e| e.to_string())?;
    let opts = EngineOptions {
        progress: false,
        mem_available: Some(8 * GIB),
    };
    start_cpu(plan, Box::new(host), opts)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Whether the CUDA engine's start-up checks pass (no GPU touched).
#[cfg(feature = "cuda")]
fn cuda_preflight(plan: &Plan, model: &Path) -> Result<(), String> {
    use strata_exec::backend::cuda::options::CudaOptions;
    use strata_exec::backend::cuda::start::preflight;
    let host = GgufModel::open(model).map_err(|e| e.to_string())?;
    preflight(plan, &host, &CudaOptions::f32_products())
        .map(|_| ())
        .map_err(|e| e.to_string())
}

struct Case {
    name: &'static str,
    model: PathBuf,
    plan: Plan,
    /// The verdicts this build's table must give (cpu, cuda).
    want: (bool, bool),
    /// Reason text the refusals must contain (cpu, cuda).
    why: (&'static str, &'static str),
}

fn cases() -> Vec<Case> {
    let q8 = model("moe-q8", "qwen3moe", &tiny_moe(), "Q8_0");
    let q4km = model("moe-q4km", "qwen3moe", &tiny_moe(), "Q4_K_M");
    let wide = model("wide-group", "qwen3moe", &wide_group(), "Q8_0");
    let next = model("next-q8", "qwen3next", &tiny_next(), "Q8_0");
    let s = settings();
    let spill = ServeSettings {
        kv_resident: Some(64),
        ..settings()
    };
    let off = ServeSettings {
        expert_cache: ExpertCache::Off,
        ..settings()
    };
    let split = ServeSettings {
        layer_split: LayerSplit::Bounds(vec![1]),
        ..settings()
    };
    let (cpu, gpu) = (cpu_probe(1), gpu_probe(1));
    let case = |name, m: &PathBuf, probe: &HardwareProbe, s: &ServeSettings, want, why| Case {
        name,
        model: m.clone(),
        plan: plan(m, probe, s),
        want,
        why,
    };
    vec![
        case(
            "cpu q8_0",
            &q8,
            &cpu,
            &s,
            (true, false),
            ("", "vendor `cpu`"),
        ),
        case(
            "cpu kv spill",
            &q8,
            &cpu,
            &spill,
            (true, false),
            ("", "vendor `cpu`"),
        ),
        case(
            "cpu host experts",
            &q8,
            &cpu,
            &off,
            (true, false),
            ("", "vendor `cpu`"),
        ),
        case(
            "cpu split",
            &q8,
            &cpu_probe(2),
            &split,
            (true, false),
            ("", "vendor"),
        ),
        // Both engines read every type the CPU reference decodes (Q4_K_M's Q6_K included).
        case(
            "cpu q4_k_m",
            &q4km,
            &cpu,
            &s,
            (true, false),
            ("", "vendor `cpu`"),
        ),
        case(
            "cpu qwen3next",
            &next,
            &cpu,
            &s,
            (true, false),
            ("", "vendor `cpu`"),
        ),
        case(
            "cpu wide group",
            &wide,
            &cpu,
            &s,
            (true, false),
            ("", "query heads"),
        ),
        case(
            "gpu q8_0",
            &q8,
            &gpu,
            &s,
            (false, true),
            ("vendor `nvidia`", ""),
        ),
        case(
            "gpu split",
            &q8,
            &gpu_probe(2),
            &split,
            (false, true),
            ("vendor", ""),
        ),
        case(
            "gpu kv spill",
            &q8,
            &gpu,
            &spill,
            // The CUDA engine keeps the cells past the window in mapped pinned chunks
            // (cuda_kvspill).
            (false, true),
            ("vendor", ""),
        ),
        case(
            "gpu host experts",
            &q8,
            &gpu,
            &off,
            // The CUDA engine serves them through its expert cache (cuda_offload).
            (false, true),
            ("vendor", ""),
        ),
        case("gpu q4_k_m", &q4km, &gpu, &s, (false, true), ("vendor", "")),
        case(
            "gpu qwen3next",
            &next,
            &gpu,
            &s,
            (false, true),
            ("vendor", ""),
        ),
        case(
            "gpu wide group",
            &wide,
            &gpu,
            &s,
            (false, false),
            ("vendor", "query heads"),
        ),
    ]
}

fn check_reason(case: &str, v: &Result<(), Vec<String>>, want: bool, why: &str) {
    match v {
        Ok(()) => assert!(want, "{case}: reported runnable, expected not"),
        Err(reasons) => {
            assert!(!want, "{case}: reported not runnable: {reasons:?}");
            assert!(
                reasons.iter().any(|r| r.contains(why)),
                "{case}: no reason names `{why}`: {reasons:?}"
            );
        }
    }
}

#[test]
fn a_plan_reported_runnable_starts_and_each_refusal_is_named() {
    for c in cases() {
        let run = runnable(&c.plan);
        check_reason(c.name, run.of(Backend::Cpu), c.want.0, c.why.0);
        check_reason(c.name, run.of(Backend::Cuda), c.want.1, c.why.1);
        assert!(
            run.of(Backend::Hip).is_err(),
            "{}: hip runs only `amd` devices",
            c.name
        );
        // The CPU engine mirrors the table exactly for everything these plans exercise.
        let started = cpu_starts(&c.plan, &c.model);
        assert_eq!(
            started.is_ok(),
            run.of(Backend::Cpu).is_ok(),
            "{}: CPU engine {:?} but the report says {:?}",
            c.name,
            started,
            run.of(Backend::Cpu)
        );
        // CUDA: reported runnable => its start-up checks pass. (Its preflight does not look at
        // device vendors, weight types or host experts yet: those refusals come later in
        // start-up, or are the table's own, which the lead makes the executor enforce.)
        #[cfg(feature = "cuda")]
        {
            let pf = cuda_preflight(&c.plan, &c.model);
            if run.of(Backend::Cuda).is_ok() {
                assert!(
                    pf.is_ok(),
                    "{}: reported runnable on cuda but {pf:?}",
                    c.name
                );
            }
            if let Err(e) = &pf {
                assert!(
                    run.of(Backend::Cuda).is_err(),
                    "{}: preflight refuses ({e}) but the report says runnable",
                    c.name
                );
            }
        }
    }
}

#[cfg(feature = "cuda")]
#[test]
fn cuda_preflight_refusals_are_reported() {
    // The cases the CUDA preflight itself refuses: each is reported not runnable on cuda.
    let refused: Vec<&str> = cases()
        .iter()
        .filter(|c| cuda_preflight(&c.plan, &c.model).is_err())
        .map(|c| c.name)
        .collect();
    assert!(
        refused.contains(&"gpu wide group"),
        "gpu wide group passes preflight: {refused:?}"
    );
    // A plan that spills KV passes: the CUDA engine keeps those cells in host memory.
    assert!(
        !refused.contains(&"gpu kv spill"),
        "gpu kv spill is refused: {refused:?}"
    );
}
