//! Shared helpers of the executor's integration tests: CPU probes, plans of the tiny
//! reference models made with the planner library, and the reference data.
#![allow(dead_code)]

pub mod mixed;
pub mod spec;

use serde_json::Value;
use std::path::{Path, PathBuf};
use strata_exec::exec::{start_cpu, CpuEngine, EngineOptions};
use strata_exec::load::SafetensorsModel;
use strata_plan::solve::{solve, Outcome, PlanRequest};
use strata_schemas::plan::Plan;
use strata_schemas::probe::{DeviceProbe, HardwareProbe, HostProbe, Vendor, GIB, MIB};
use strata_schemas::serve::{ExpertCache, KvType, LayerSplit, RopeScaling, ServeSettings};

/// The small files llama.cpp's own quantizer wrote (`scripts/gpu_llama.sh fixtures`:
/// `llama-quantize small-f32.gguf small-MIX.gguf MIX`, no importance matrix), each with a type
/// the mix must hold (a file without it would not test what it claims).
pub const LLAMA_QUANTIZED: &[(&str, strata_schemas::ggml::GgmlType)] = &[
    ("Q4_K_M", strata_schemas::ggml::GgmlType::Q4K),
    ("Q5_K_M", strata_schemas::ggml::GgmlType::Q5K),
    ("IQ4_XS", strata_schemas::ggml::GgmlType::Iq4Xs),
    ("IQ3_S", strata_schemas::ggml::GgmlType::Iq3S),
];

/// `tests/data/llama-quantized/small-<mix>.gguf`.
pub fn llama_quantized(mix: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/data/llama-quantized")
        .join(format!("small-{}.gguf", mix.to_ascii_lowercase()))
}

pub fn source(variant: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/data/tiny-qwen3moe")
        .join(variant)
}

/// This test process's own folder `NAME-PID` under cargo's per-target temporary folder
/// (`target/tmp`, removed by `cargo clean`), never the system's: the folders of earlier runs
/// whose process has exited are removed first, so repeated runs do not pile up copies of the
/// models they write.
pub fn run_dir(name: &str) -> PathBuf {
    let root = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let me = std::process::id();
    if let Ok(entries) = std::fs::read_dir(root) {
        for e in entries.flatten() {
            let file = e.file_name();
            let pid = file
                .to_str()
                .and_then(|f| f.strip_prefix(name)?.strip_prefix('-')?.parse::<u32>().ok());
            // A process that is gone has no /proc entry (Linux; elsewhere nothing is removed).
            if let Some(pid) = pid {
                let gone =
                    cfg!(target_os = "linux") && !Path::new("/proc").join(pid.to_string()).exists();
                if pid != me && gone {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
    }
    let d = root.join(format!("{name}-{me}"));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A runnable copy of a reference folder: transformers 5 saved `config.json` without
/// `architectures` and with `num_local_experts` / `rope_parameters`, which the folder reader
/// does not read yet, so the copy adds the older keys.
pub fn data(variant: &str) -> PathBuf {
    let dir = run_dir("tiny-qwen3moe").join(variant);
    if dir.join("model.safetensors").exists() {
        return dir;
    }
    let tmp =
        dir.with_extension(format!("tmp{:?}", std::thread::current().id()).replace(['(', ')'], ""));
    std::fs::create_dir_all(&tmp).unwrap();
    let src = source(variant);
    let mut cfg: Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    // transformers 5 spellings -> the keys the folder reader knows.
    if cfg.get("architectures").is_none() {
        cfg["architectures"] = serde_json::json!(["Qwen3MoeForCausalLM"]);
    }
    if cfg.get("num_experts").is_none() {
        cfg["num_experts"] = cfg["num_local_experts"].clone();
    }
    if cfg.get("rope_theta").is_none() {
        cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"].clone();
    }
    std::fs::write(
        tmp.join("config.json"),
        serde_json::to_vec_pretty(&cfg).unwrap(),
    )
    .unwrap();
    std::fs::copy(src.join("model.safetensors"), tmp.join("model.safetensors")).unwrap();
    // Another test thread may have won the race; either copy is the same.
    let _ = std::fs::rename(&tmp, &dir);
    let _ = std::fs::remove_dir_all(&tmp);
    dir
}

pub fn reference(variant: &str) -> Value {
    serde_json::from_slice(&std::fs::read(source(variant).join("reference.json")).unwrap()).unwrap()
}

/// `n` cpu devices of 256 MiB on a host with 8 GiB available.
pub fn cpu_probe(n: usize) -> HardwareProbe {
    HardwareProbe {
        host: HostProbe {
            ram_bytes: 16 * GIB,
            available_bytes: 8 * GIB,
            memlock_limit_bytes: None,
            disk_read_gbps: None,
        },
        devices: (0..n)
            .map(|i| DeviceProbe {
                index: i as u32,
                name: format!("cpu{i}"),
                vendor: Vendor::Cpu,
                arch: std::env::consts::ARCH.into(),
                vram_bytes: 256 * MIB,
                free_bytes: None,
                runtime_reserve_bytes: Some(16 * MIB),
                mem_bandwidth_gbps: Some(20.0),
                h2d_gbps: Some(20.0),
                pcie_gen: None,
                pcie_width: None,
                peers: None,
                cost: None,
            })
            .collect(),
    }
}

/// `n` NVIDIA devices of 2 GiB (all mapped onto GPU 0 by the CUDA engine).
pub fn gpu_probe(n: usize) -> HardwareProbe {
    let mut p = cpu_probe(n);
    for d in &mut p.devices {
        d.name = "NVIDIA test device".into();
        d.vendor = Vendor::Nvidia;
        d.arch = "sm_90".into();
        d.vram_bytes = 2 * GIB;
        d.runtime_reserve_bytes = Some(256 * MIB);
        d.mem_bandwidth_gbps = Some(3000.0);
        d.h2d_gbps = Some(25.0);
    }
    p
}

#[derive(Clone)]
pub struct Ask {
    pub devices: usize,
    pub split: Option<Vec<u32>>,
    pub batch: u32,
    pub ctx: u64,
    pub resident: Option<u64>,
    pub kv: KvType,
    pub ubatch: u32,
    pub cache: ExpertCache,
    /// Plan for NVIDIA devices of 2 GiB (the CUDA engine) instead of CPU devices.
    pub gpu: bool,
}

impl Default for Ask {
    fn default() -> Self {
        Self {
            devices: 1,
            split: None,
            batch: 1,
            ctx: 64,
            resident: None,
            kv: KvType::F16,
            ubatch: 8,
            cache: ExpertCache::Auto,
            gpu: false,
        }
    }
}

pub fn plan(variant: &str, ask: &Ask) -> Plan {
    let dir = data(variant);
    let inv = strata_plan::model::load_model(&dir).unwrap();
    plan_inventory(variant, &inv, &dir, ask)
}

/// Plan `inv` (read from `src`) with `ask` and the rope scaling of reference `variant` (any
/// name without a reference folder plans without scaling).
pub fn plan_inventory(
    variant: &str,
    inv: &strata_schemas::inventory::ModelInventory,
    src: &Path,
    ask: &Ask,
) -> Plan {
    let probe = if ask.gpu {
        gpu_probe(ask.devices)
    } else {
        cpu_probe(ask.devices)
    };
    let rope_scaling = if source(variant).join("reference.json").exists() {
        let r = reference(variant);
        r["yarn"].as_object().map(|y| RopeScaling {
            kind: "yarn".into(),
            factor: y["factor"].as_f64().unwrap(),
            orig_ctx: y["orig_ctx"].as_u64(),
        })
    } else {
        None
    };
    let settings = ServeSettings {
        max_context: ask.ctx,
        batch: ask.batch,
        kv: ask.kv,
        kv_resident: ask.resident,
        ubatch: ask.ubatch,
        expert_cache: ask.cache,
        layer_split: ask
            .split
            .clone()
            .map_or(LayerSplit::Auto, LayerSplit::Bounds),
        pinned_chunk_mib: 1,
        rope_scaling,
        ..ServeSettings::default()
    };
    solved(inv, src, &probe, "test probe", &settings)
}

/// The plan of `inv` (read from `src`) for `probe` with `settings`, no profile or vision
/// encoder; panics naming the reasons when the planner finds it infeasible.
pub fn solved(
    inv: &strata_schemas::inventory::ModelInventory,
    src: &Path,
    probe: &HardwareProbe,
    probe_source: &str,
    settings: &ServeSettings,
) -> Plan {
    let req = PlanRequest {
        inventory: inv,
        model_source: src.display().to_string(),
        probe,
        probe_source: probe_source.into(),
        settings,
        profile: None,
        vision: None,
        mtp_file: None,
    };
    match solve(&req).unwrap() {
        Outcome::Planned(p) => *p,
        Outcome::Infeasible(i) => panic!("infeasible: {:?}", i.reasons),
    }
}

pub fn engine(variant: &str, plan: &Plan) -> CpuEngine {
    let host = SafetensorsModel::open(&data(variant)).unwrap();
    start_cpu(plan, Box::new(host), EngineOptions::default()).unwrap()
}

pub fn prompts(r: &Value) -> Vec<Vec<u32>> {
    r["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            p.as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect()
        })
        .collect()
}

pub fn argmax(row: &[f32]) -> u32 {
    strata_exec::sampler::argmax(row)
}

/// Max |a - b| over the largest |b|.
pub fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter()
        .zip(b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs() / scale))
}

/// Every prompt of a transformers reference (`reference.json` of tests/data/tiny-qwen3next)
/// on `e`, whose KV cache is f16: the logits of every position within `tol` of the largest
/// reference logit of `logits_kv_f16` (transformers with K and V rounded to f16 as they enter
/// the cache, as the engines store them) and within 1e-3 of the plain float32 `logits` (that
/// rounding alone moves them by up to 4.3e-4 on these models), then the greedy continuation
/// with the cache and the linear state, token for token.
pub fn check_references(what: &str, e: &mut dyn strata_exec::engine::Engine, r: &Value, tol: f32) {
    let v = e.info().n_vocab;
    let ub = e.info().ubatch;
    let rows = |key: &str, i: usize| -> Vec<f32> {
        r[key][i]
            .as_array()
            .unwrap_or_else(|| panic!("{what}: reference.json lacks `{key}` (regenerate it with scripts/make_reference_next.py)"))
            .iter()
            .flat_map(|row| row.as_array().unwrap().iter())
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    };
    for (i, ids) in prompts(r).iter().enumerate() {
        e.reset_slot(0);
        let mut got = Vec::new();
        for chunk in ids.chunks(ub) {
            got.extend_from_slice(e.prefill_all(0, chunk).unwrap());
        }
        assert_eq!(got.len(), ids.len() * v);
        let rel = max_rel(&got, &rows("logits_kv_f16", i));
        assert!(
            rel < tol,
            "{what} prompt {i}: logits differ from the f16-KV reference by {rel}"
        );
        let rel32 = max_rel(&got, &rows("logits", i));
        assert!(
            rel32 < 1e-3,
            "{what} prompt {i}: logits differ from the float32 reference by {rel32}"
        );
        let greedy: Vec<u32> = r["greedy_cached"][i]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let mut row = got[(ids.len() - 1) * v..].to_vec();
        let mut out = Vec::new();
        for _ in 0..greedy.len() {
            let t = argmax(&row);
            out.push(t);
            if out.len() == greedy.len() {
                break;
            }
            row = e.decode(&[(0, t)]).unwrap().to_vec();
        }
        assert_eq!(out, greedy, "{what} prompt {i}: greedy continuation");
        eprintln!(
            "PASS {what} prompt {i}: {} positions within {rel:.2e} (f16-KV reference; {rel32:.2e} of the float32 one), {} greedy tokens",
            ids.len(),
            out.len()
        );
    }
}

#[allow(clippy::too_many_arguments)]
/// A random Qwen3-MoE Hugging Face folder (F32, single `model.safetensors`) in `dir`.
pub fn random_folder(
    dir: &Path,
    n_layer: u32,
    hidden: u64,
    n_expert: u64,
    used: u64,
    ff: u64,
    vocab: u64,
    seed: u64,
) {
    let (heads, kv_heads, hd) = (4u64, 2u64, hidden / 4);
    std::fs::create_dir_all(dir).unwrap();
    let cfg = serde_json::json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": hidden, "intermediate_size": 2 * ff, "moe_intermediate_size": ff,
        "num_hidden_layers": n_layer, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": hd, "num_experts": n_expert, "num_experts_per_tok": used,
        "norm_topk_prob": true, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 256, "vocab_size": vocab, "tie_word_embeddings": false,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "torch_dtype": "float32"
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(&cfg).unwrap(),
    )
    .unwrap();
    let mut specs: Vec<(String, Vec<u64>, f32, f32)> = vec![
        (
            "model.embed_tokens.weight".into(),
            vec![vocab, hidden],
            1.0,
            0.0,
        ),
        ("lm_head.weight".into(), vec![vocab, hidden], 0.2, 0.0),
        ("model.norm.weight".into(), vec![hidden], 0.2, 1.0),
    ];
    for l in 0..n_layer {
        let p = format!("model.layers.{l}");
        let w = 1.0 / (hidden as f32).sqrt();
        for (s, shape, sc, off) in [
            ("input_layernorm", vec![hidden], 0.2, 1.0),
            ("post_attention_layernorm", vec![hidden], 0.2, 1.0),
            ("self_attn.q_norm", vec![hd], 0.2, 1.0),
            ("self_attn.k_norm", vec![hd], 0.2, 1.0),
            ("self_attn.q_proj", vec![heads * hd, hidden], w, 0.0),
            ("self_attn.k_proj", vec![kv_heads * hd, hidden], w, 0.0),
            ("self_attn.v_proj", vec![kv_heads * hd, hidden], w, 0.0),
            ("self_attn.o_proj", vec![hidden, heads * hd], w, 0.0),
            ("mlp.gate", vec![n_expert, hidden], w, 0.0),
        ] {
            specs.push((format!("{p}.{s}.weight"), shape, sc, off));
        }
        for e in 0..n_expert {
            let m = format!("{p}.mlp.experts.{e}");
            specs.push((format!("{m}.gate_proj.weight"), vec![ff, hidden], w, 0.0));
            specs.push((format!("{m}.up_proj.weight"), vec![ff, hidden], w, 0.0));
            specs.push((
                format!("{m}.down_proj.weight"),
                vec![hidden, ff],
                1.0 / (ff as f32).sqrt(),
                0.0,
            ));
        }
    }
    let mut state = seed ^ 0x9E37_79B9_7F4A_7C15;
    let mut rnd = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let mut header = serde_json::Map::new();
    let mut data: Vec<u8> = Vec::new();
    for (name, shape, sc, off) in &specs {
        let n: u64 = shape.iter().product();
        let start = data.len();
        for _ in 0..n {
            data.extend_from_slice(&(off + sc * rnd()).to_le_bytes());
        }
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let h = serde_json::to_vec(&Value::Object(header)).unwrap();
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&h);
    file.extend_from_slice(&data);
    std::fs::write(dir.join("model.safetensors"), file).unwrap();
}

/// Plan a folder on `n` cpu devices with an explicit split (64 cells of context).
pub fn plan_folder(
    dir: &Path,
    n: usize,
    split: Option<Vec<u32>>,
    cache: ExpertCache,
    resident: Option<u64>,
) -> Plan {
    plan_folder_ctx(dir, n, split, cache, resident, 64)
}

/// [`plan_folder`] with `ctx` cells of context per slot.
#[allow(dead_code)]
pub fn plan_folder_ctx(
    dir: &Path,
    n: usize,
    split: Option<Vec<u32>>,
    cache: ExpertCache,
    resident: Option<u64>,
    ctx: u64,
) -> Plan {
    let inv = strata_plan::model::load_model(dir).unwrap();
    let probe = cpu_probe(n);
    let settings = ServeSettings {
        max_context: ctx,
        batch: 2,
        kv_resident: resident,
        ubatch: 8,
        expert_cache: cache,
        layer_split: split.map_or(LayerSplit::Auto, LayerSplit::Bounds),
        pinned_chunk_mib: 1,
        ..ServeSettings::default()
    };
    solved(&inv, dir, &probe, "test probe", &settings)
}

/// A tiny Qwen3-Next: four blocks (every 2nd full attention), hidden 64, 16-wide heads,
/// 8 experts top-2 of width 32 and a shared expert, 16-wide linear heads (value heads twice
/// the key heads), conv 4.
pub fn tiny_qwen3next_hp() -> strata_schemas::inventory::HParams {
    strata_schemas::inventory::HParams {
        n_expert: 8,
        nextn_predict_layers: 0,
        ..strata_schemas::gguf::testutil::tiny_qwen3next()
    }
}

/// The tiny reference model `variant` planned for `n` AMD Radeon AI PRO R9700-like devices
/// (gfx1201) of 2 GiB.
pub fn amd_plan(variant: &str, n: usize, split: Option<Vec<u32>>) -> Plan {
    let dir = data(variant);
    let inv = strata_plan::model::load_model(&dir).unwrap();
    let mut probe = gpu_probe(n);
    for d in &mut probe.devices {
        d.name = "AMD Radeon AI PRO R9700".into();
        d.vendor = Vendor::Amd;
        d.arch = "gfx1201".into();
    }
    let settings = ServeSettings {
        max_context: 64,
        batch: 1,
        ubatch: 8,
        layer_split: split.map_or(LayerSplit::Auto, LayerSplit::Bounds),
        pinned_chunk_mib: 1,
        ..ServeSettings::default()
    };
    solved(&inv, &dir, &probe, "test probe (AMD)", &settings)
}

/// Whether a CUDA GPU is here: the driver libraries load and device 0 opens. Without one it
/// prints why (`SKIP: ...`) so a GPU test that returns early says so loudly.
#[cfg(feature = "cuda")]
pub fn gpu_present() -> bool {
    if let Err(e) = strata_exec::backend::cuda::check_libraries() {
        eprintln!("SKIP: {e}");
        return false;
    }
    match strata_exec::backend::cuda::CudaDevice::open(0) {
        Ok(_) => true,
        Err(e) => {
            eprintln!("SKIP: no CUDA device: {e}");
            false
        }
    }
}
