//! Shared helpers of the executor's integration tests: CPU probes, plans of the tiny
//! reference models made with the planner library, and the reference data.
#![allow(dead_code)]

use serde_json::Value;
use std::path::{Path, PathBuf};
use strata_exec::exec::{EngineOptions, PlanEngine};
use strata_exec::load::SafetensorsModel;
use strata_plan::solve::{solve, Outcome, PlanRequest};
use strata_schemas::plan::Plan;
use strata_schemas::probe::{DeviceProbe, HardwareProbe, HostProbe, Vendor, GIB, MIB};
use strata_schemas::serve::{ExpertCache, KvType, LayerSplit, RopeScaling, ServeSettings};

pub fn source(variant: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/data/tiny-qwen3moe")
        .join(variant)
}

/// A runnable copy of a reference folder: transformers 5 saved `config.json` without
/// `architectures` and with `num_local_experts` / `rope_parameters`, which the folder reader
/// does not read yet, so the copy adds the older keys.
pub fn data(variant: &str) -> PathBuf {
    let dir = std::env::temp_dir()
        .join(format!("strata-exec-test-{}", std::process::id()))
        .join(variant);
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
            })
            .collect(),
    }
}

pub struct Ask {
    pub devices: usize,
    pub split: Option<Vec<u32>>,
    pub batch: u32,
    pub ctx: u64,
    pub resident: Option<u64>,
    pub kv: KvType,
    pub ubatch: u32,
    pub cache: ExpertCache,
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
        }
    }
}

pub fn plan(variant: &str, ask: &Ask) -> Plan {
    let dir = data(variant);
    let inv = strata_plan::model::load_model(&dir).unwrap();
    let probe = cpu_probe(ask.devices);
    let r = reference(variant);
    let rope_scaling = r["yarn"].as_object().map(|y| RopeScaling {
        kind: "yarn".into(),
        factor: y["factor"].as_f64().unwrap(),
        orig_ctx: y["orig_ctx"].as_u64(),
    });
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
    let req = PlanRequest {
        inventory: &inv,
        model_source: dir.display().to_string(),
        probe: &probe,
        probe_source: "test probe".into(),
        settings: &settings,
        profile: None,
        vision: None,
    };
    match solve(&req).unwrap() {
        Outcome::Planned(p) => *p,
        Outcome::Infeasible(i) => panic!("infeasible: {:?}", i.reasons),
    }
}

pub fn engine(variant: &str, plan: &Plan) -> PlanEngine {
    let host = SafetensorsModel::open(&data(variant)).unwrap();
    PlanEngine::start(plan, Box::new(host), EngineOptions::default()).unwrap()
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
