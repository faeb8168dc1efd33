//! Builders for tests and benchmarks: model hyperparameters of the shipped descriptors,
//! synthesized inventories and hardware probes. Invariant: only used to build inputs; no
//! planner logic lives here.

use strata_schemas::arch::{expected_tensors, QuantRecipe};
use strata_schemas::inventory::{HParams, ModelInventory, VisionSpec};
pub use strata_schemas::known::{
    qwen3_30b_a3b as qwen3moe_hparams, qwen3_next_80b_a3b as qwen3next_hparams,
};
use strata_schemas::probe::{DeviceProbe, HardwareProbe, HostProbe, Vendor, GIB};

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
                peers: None,
                cost: None,
            })
            .collect(),
    }
}

pub const G: u64 = GIB;
