//! Builders for tests and benchmarks: model hyperparameters of the shipped descriptors,
//! synthesized inventories and hardware probes. Invariant: only used to build inputs; no
//! planner logic lives here.

use strata_schemas::arch::{expected_tensors, QuantRecipe};
use strata_schemas::inventory::{HParams, ModelInventory, SsmParams, VisionSpec};
use strata_schemas::probe::{DeviceProbe, HardwareProbe, HostProbe, Vendor, GIB};

/// Qwen3-Next-80B-A3B.
pub fn qwen3next_hparams() -> HParams {
    HParams {
        n_layer: 48,
        n_embd: 2048,
        n_vocab: 151936,
        n_ctx_train: 262144,
        n_head: 16,
        n_head_kv: 2,
        head_dim_k: 256,
        head_dim_v: 256,
        n_ff: 0,
        n_expert: 512,
        n_expert_used: 10,
        n_ff_exp: 512,
        n_ff_shexp: 512,
        n_leading_dense: 0,
        full_attention_interval: Some(4),
        ssm: Some(SsmParams {
            conv_kernel: 4,
            state_size: 128,
            group_count: 16,
            time_step_rank: 32,
            inner_size: 4096,
        }),
        nextn_predict_layers: 1,
        rope_theta: 1e7,
        rope_dim: Some(64),
        rms_eps: 1e-6,
        norm_topk_prob: true,
        tied_embeddings: false,
    }
}

/// Qwen3-30B-A3B.
pub fn qwen3moe_hparams() -> HParams {
    HParams {
        n_layer: 48,
        n_embd: 2048,
        n_vocab: 151936,
        n_ctx_train: 40960,
        n_head: 32,
        n_head_kv: 4,
        head_dim_k: 128,
        head_dim_v: 128,
        n_ff: 0,
        n_expert: 128,
        n_expert_used: 8,
        n_ff_exp: 768,
        n_ff_shexp: 0,
        n_leading_dense: 0,
        full_attention_interval: None,
        ssm: None,
        nextn_predict_layers: 0,
        rope_theta: 1e6,
        rope_dim: None,
        rms_eps: 1e-6,
        norm_topk_prob: true,
        tied_embeddings: false,
    }
}

/// A stand-in vision tower sized like a SigLIP-so400m mmproj in F16.
pub fn vision() -> VisionSpec {
    VisionSpec {
        weights_bytes: 856 << 20,
        n_embd: 1152,
        n_layer: 27,
        n_head: 16,
        n_ff: 4304,
        max_image_tokens: 4096,
    }
}

/// Synthesize an inventory with a quant preset.
pub fn inventory(arch: &str, hp: HParams, preset: &str) -> ModelInventory {
    let recipe = QuantRecipe::preset(preset).expect("known preset");
    ModelInventory {
        arch: arch.into(),
        name: format!("{arch}-{preset}"),
        tensors: expected_tensors(arch, &hp, &recipe).expect("synthesizes"),
        hparams: hp,
        vision: Some(vision()),
    }
}

/// A probe of identical or mixed devices: (vram bytes, bandwidth GB/s) each.
pub fn probe(devices: &[(u64, f64)], ram: u64, available: u64) -> HardwareProbe {
    HardwareProbe {
        host: HostProbe {
            ram_bytes: ram,
            available_bytes: available,
            memlock_limit_bytes: None,
            disk_read_gbps: None,
        },
        devices: devices
            .iter()
            .enumerate()
            .map(|(i, (vram, bw))| DeviceProbe {
                index: i as u32,
                name: format!("gpu{i}"),
                vendor: Vendor::Nvidia,
                arch: "sm_86".into(),
                vram_bytes: *vram,
                free_bytes: None,
                runtime_reserve_bytes: None,
                mem_bandwidth_gbps: Some(*bw),
                h2d_gbps: Some(25.0),
                pcie_gen: None,
                pcie_width: None,
            })
            .collect(),
    }
}

pub const G: u64 = GIB;
