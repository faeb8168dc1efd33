//! The hand-built sample plan that tests here and in other crates share.
//! Invariant: the plan is internally consistent (devices split the layers, regions fit the
//! arena) and uses both placements, so a round trip through the plan file exercises each part.

use crate::ggml::GgmlType;
use crate::plan::*;

/// Two devices splitting 48 layers, tensors on device, host and host-experts, a degradation.
pub fn sample_plan() -> Plan {
    Plan {
        model: sample_model(),
        hardware_fingerprint: "fedcba9876543210fedcba9876543210".into(),
        serve: sample_serve(),
        devices: vec![sample_device(0, 0, 24), sample_device(1, 24, 48)],
        tensors: sample_tensors(),
        host: sample_host(),
        degradations: vec![Degradation {
            what: "batch".into(),
            requested: "4".into(),
            planned: "2".into(),
            reason: "KV for 4 slots does not fit".into(),
        }],
        suggestions: vec!["add a GPU".into()],
        predicted: sample_predicted(),
    }
}

/// Device `index` holding layers `first..end` of the sample plan.
fn sample_device(index: u32, first: u32, end: u32) -> DevicePlan {
    DevicePlan {
        index,
        name: format!("Test GPU {index}"),
        vendor: "nvidia".into(),
        arch: "sm_90".into(),
        vram_bytes: 80 << 30,
        free_bytes: 79 << 30,
        arena_bytes: 70 << 30,
        layer_first: first,
        layer_end: end,
        holds_embedding: index == 0,
        holds_head: index == 1,
        holds_mtp: index == 1,
        holds_vision: false,
        regions: vec![
            Region {
                kind: RegionKind::DenseWeights,
                offset: 0,
                bytes: 10 << 30,
            },
            Region {
                kind: RegionKind::KvCache,
                offset: 10 << 30,
                bytes: 4 << 30,
            },
            Region {
                kind: RegionKind::ExpertCache,
                offset: 14 << 30,
                bytes: 56 << 30,
            },
            Region {
                kind: RegionKind::RuntimeReserve,
                offset: (80u64 << 30) - (512 << 20),
                bytes: 512 << 20,
            },
        ],
        expert_slot_bytes: 3 << 20,
        expert_cache_slots: 19114,
        resident_experts: vec![
            ResidentExpert {
                layer: first,
                expert: 7,
                slot: 0,
            },
            ResidentExpert {
                layer: first + 1,
                expert: 3,
                slot: 1,
            },
        ],
        scratch: vec![ScratchBuffer {
            name: "attn_out".into(),
            offset: 0,
            bytes: 1 << 20,
            first_op: 2,
            last_op: 9,
        }],
        work_pass: WorkPass::default(),
        kv_layers: (first..end).step_by(4).collect(),
        linear_layers: (first..end).filter(|l| l % 4 != 0).collect(),
        free_bytes_probed: index == 0,
        cost: DeviceCost {
            step_s: 0.0002,
            dense_read_s: 0.004,
            rows_per_read: 8,
            expert_layers: end - first,
            n_expert: 512,
            n_expert_used: 10,
            expert_read_s: 1e-6,
            expert_read_per_use: true,
            hit_rate: 0.83,
            kv_resident: 65536,
            ..DeviceCost::default()
        },
        handoff_in: if index == 0 { "none" } else { "peer" }.into(),
    }
}

/// The sample plan's model: an 80B-A3B Qwen3-Next.
fn sample_model() -> PlanModel {
    PlanModel {
        arch: "qwen3next".into(),
        name: "Sample-80B-A3B".into(),
        fingerprint: "0123456789abcdef0123456789abcdef".into(),
        source: "/models/sample.gguf".into(),
        mtp_file: Some(PlanMtpFile {
            source: "/models/mtp-sample.gguf".into(),
            fingerprint: "fedcba9876543210fedcba9876543210".into(),
        }),
        n_layer: 48,
        n_expert: 512,
        n_expert_used: 10,
        total_bytes: 160 << 30,
        dense_ffn_layers: 0,
        shape: ModelShape {
            n_embd: 2048,
            n_ff_exp: 512,
            n_head: 16,
            n_head_kv: 2,
            head_dim_k: 256,
            head_dim_v: 256,
        },
    }
}

/// The sample plan's serve settings: batch 4 asked, 2 planned, MTP and YaRN on.
fn sample_serve() -> PlanServe {
    PlanServe {
        max_context: 262144,
        requested_batch: 4,
        batch: 2,
        kv: crate::serve::KvType::F16,
        requested_kv_resident: 0,
        kv_resident: 65536,
        ubatch: 512,
        mtp: true,
        spec: 2,
        prefix_checkpoint: true,
        vision: false,
        vram_reserve_bytes: 512 << 20,
        expert_cache: crate::serve::ExpertCache::Auto,
        layer_split: vec![24],
        layer_split_requested: "auto".into(),
        gpu: vec![0, 1],
        pinned_chunk_bytes: 256 << 20,
        yarn: Some(crate::plan::PlanYarn {
            factor: 4.0,
            orig_ctx: 65536,
        }),
        expert_profile: String::new(),
    }
}

/// One tensor per placement.
fn sample_tensors() -> Vec<TensorPlacement> {
    vec![
        TensorPlacement {
            name: "token_embd.weight".into(),
            bytes: 1 << 30,
            ggml_type: GgmlType::Q4K,
            placement: Placement::Device {
                device: 0,
                offset: 0,
            },
        },
        TensorPlacement {
            name: "blk.30.ffn_gate_exps.weight".into(),
            bytes: 2 << 30,
            ggml_type: GgmlType::Iq3S,
            placement: Placement::HostExperts { device: 1 },
        },
        TensorPlacement {
            name: "blk.48.nextn.eh_proj.weight".into(),
            bytes: 64 << 20,
            ggml_type: GgmlType::Q8_0,
            placement: Placement::Host,
        },
    ]
}

/// The sample plan's host side: RAM, one pinned staging chunk, experts in RAM.
fn sample_host() -> HostPlan {
    HostPlan {
        ram_bytes: 256 << 30,
        ram_available_bytes: 200 << 30,
        memlock_limit_bytes: None,
        pinned_chunks: vec![PinnedChunk {
            purpose: "staging".into(),
            device: 0,
            bytes: 256 << 20,
        }],
        pinned_bytes: 256 << 20,
        pinned_chunk_max_bytes: 256 << 20,
        kv_host_bytes: 3 << 30,
        experts_host_bytes: 100 << 30,
        ram_required_bytes: 101 << 30,
        experts_page_from_disk: false,
    }
}

/// The sample plan's predicted speeds.
fn sample_predicted() -> Predicted {
    Predicted {
        decode_tok_s: 41.5,
        expert_hit_rate: 0.83,
        expert_hit_source: "a guess".into(),
        decode_empty: DecodePoint {
            batch: 2,
            context: 0,
            per_slot_tok_s: 41.5,
            aggregate_tok_s: 83.0,
        },
        decode_full: DecodePoint {
            batch: 2,
            context: 262144,
            per_slot_tok_s: 12.5,
            aggregate_tok_s: 25.0,
        },
        prefill_tok_s: 900.0,
        guessed: true,
        basis: "bandwidth model".into(),
    }
}
