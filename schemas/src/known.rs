//! Hyperparameters of the models the project ships descriptors for (`plans/models/`), for
//! tests, benchmarks and examples. Invariant: these equal the `[hparams]` of the shipped
//! descriptors (a test loads them and compares).

use crate::inventory::{HParams, SsmParams};

/// Qwen3-30B-A3B (`qwen3moe`): 48 blocks, hidden 2048, 32/4 heads of 128, 128 experts top-8
/// of width 768, vocabulary 151936, trained context 40960.
pub fn qwen3_30b_a3b() -> HParams {
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

/// Qwen3-Next-80B-A3B (`qwen3next`): 48 blocks (every 4th full attention, the rest gated
/// delta net), hidden 2048, 16/2 heads of 256, 512 experts top-10 of width 512 plus a shared
/// expert, one MTP block, trained context 262144.
pub fn qwen3_next_80b_a3b() -> HParams {
    HParams {
        n_head: 16,
        n_head_kv: 2,
        head_dim_k: 256,
        head_dim_v: 256,
        n_expert: 512,
        n_expert_used: 10,
        n_ff_exp: 512,
        n_ff_shexp: 512,
        n_ctx_train: 262144,
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
        ..qwen3_30b_a3b()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn equal_the_shipped_descriptors() {
        let models = Path::new(env!("CARGO_MANIFEST_DIR")).join("../plans/models");
        for (file, hp) in [
            ("qwen3-30b-a3b-q4_k_m.toml", qwen3_30b_a3b()),
            ("qwen3-30b-a3b-q8_0.toml", qwen3_30b_a3b()),
            ("qwen3-next-80b-a3b-iq3_s.toml", qwen3_next_80b_a3b()),
            ("qwen3-next-80b-a3b-q4_k_m.toml", qwen3_next_80b_a3b()),
        ] {
            let inv = crate::descriptor::load_descriptor(&models.join(file)).unwrap();
            assert_eq!(inv.hparams, hp, "{file}");
        }
    }
}
