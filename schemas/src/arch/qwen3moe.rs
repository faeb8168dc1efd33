//! qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B) tensor layout, as llama.cpp's converter writes it.
//! Invariant: names and GGUF dims match llama.cpp's `create_tensor` calls for LLM_ARCH_QWEN3MOE:
//! per block `attn_norm`, `attn_q` [n_embd, n_head*hd], `attn_k`/`attn_v` [n_embd, n_head_kv*hd],
//! `attn_output` [n_head*hd, n_embd], `attn_q_norm`/`attn_k_norm` [hd], `ffn_norm`,
//! `ffn_gate_inp` [n_embd, n_expert], `ffn_{gate,up}_exps` [n_embd, n_ff_exp, n_expert],
//! `ffn_down_exps` [n_ff_exp, n_embd, n_expert]. No shared expert, no MTP block.

use super::{bad, blk, global_specs, Kind, Spec};
use crate::inventory::{HParams, InventoryError};

/// Fields qwen3moe does not have must be absent, so a typo'd descriptor cannot pass.
pub(super) fn validate(hp: &HParams) -> Result<(), InventoryError> {
    if hp.ssm.is_some() {
        return Err(bad(
            "ssm",
            "qwen3moe has no linear-attention layers; remove [hparams.ssm]",
        ));
    }
    if hp.full_attention_interval.is_some() {
        return Err(bad(
            "full_attention_interval",
            "qwen3moe is all full attention; remove the key",
        ));
    }
    if hp.n_ff_shexp != 0 {
        return Err(bad(
            "n_ff_shexp",
            "qwen3moe has no shared expert; set 0 or remove",
        ));
    }
    if hp.nextn_predict_layers != 0 {
        return Err(bad(
            "nextn_predict_layers",
            "qwen3moe has no MTP block; set 0 or remove",
        ));
    }
    Ok(())
}

/// The tensors of one qwen3moe block.
fn block(hp: &HParams, l: u32) -> Vec<Spec> {
    let e = hp.n_embd;
    let q = hp.n_head * hp.head_dim_k;
    let k = hp.n_head_kv * hp.head_dim_k;
    let v = hp.n_head_kv * hp.head_dim_v;
    let s = |rest: &str, dims: Vec<u64>, kind: Kind| Spec::new(blk(l, rest), dims, kind, Some(l));
    vec![
        s("attn_norm.weight", vec![e], Kind::Norm),
        s("attn_q.weight", vec![e, q], Kind::Attention),
        s("attn_k.weight", vec![e, k], Kind::Attention),
        s("attn_v.weight", vec![e, v], Kind::AttentionV),
        s("attn_output.weight", vec![q, e], Kind::AttentionOutput),
        s("attn_q_norm.weight", vec![hp.head_dim_k], Kind::Norm),
        s("attn_k_norm.weight", vec![hp.head_dim_k], Kind::Norm),
        s("ffn_norm.weight", vec![e], Kind::Norm),
        s("ffn_gate_inp.weight", vec![e, hp.n_expert], Kind::Router),
        s(
            "ffn_gate_exps.weight",
            vec![e, hp.n_ff_exp, hp.n_expert],
            Kind::ExpertGateUp,
        ),
        s(
            "ffn_up_exps.weight",
            vec![e, hp.n_ff_exp, hp.n_expert],
            Kind::ExpertGateUp,
        ),
        s(
            "ffn_down_exps.weight",
            vec![hp.n_ff_exp, e, hp.n_expert],
            Kind::ExpertDown,
        ),
    ]
}

/// Every tensor, canonical order.
pub(super) fn specs(hp: &HParams) -> Vec<Spec> {
    let (mut out, tail) = global_specs(hp);
    for l in 0..hp.n_layer {
        out.extend(block(hp, l));
    }
    out.extend(tail);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::tests::qwen3_30b;

    #[test]
    fn qwen3_30b_layout() {
        let hp = qwen3_30b();
        let s = specs(&hp);
        // 3 globals + 48 blocks x 12 tensors (llama.cpp reports 579 tensors for this model).
        assert_eq!(s.len(), 3 + 48 * 12);
        for l in 0..48 {
            assert_eq!(s.iter().filter(|x| x.layer == Some(l)).count(), 12);
        }
        let get = |n: &str| s.iter().find(|x| x.name == n).unwrap().dims.clone();
        assert_eq!(get("token_embd.weight"), vec![2048, 151936]);
        assert_eq!(get("output.weight"), vec![2048, 151936]);
        assert_eq!(get("blk.0.attn_q.weight"), vec![2048, 4096]);
        assert_eq!(get("blk.0.attn_k.weight"), vec![2048, 512]);
        assert_eq!(get("blk.0.attn_output.weight"), vec![4096, 2048]);
        assert_eq!(get("blk.0.attn_q_norm.weight"), vec![128]);
        assert_eq!(get("blk.47.ffn_gate_inp.weight"), vec![2048, 128]);
        assert_eq!(get("blk.47.ffn_gate_exps.weight"), vec![2048, 768, 128]);
        assert_eq!(get("blk.47.ffn_down_exps.weight"), vec![768, 2048, 128]);
        assert!(!s
            .iter()
            .any(|x| x.name.contains("shexp") || x.name.contains("nextn")));
    }

    #[test]
    fn tied_embeddings_drop_the_head() {
        let mut hp = qwen3_30b();
        hp.tied_embeddings = true;
        assert!(!specs(&hp).iter().any(|x| x.name == "output.weight"));
    }

    #[test]
    fn foreign_fields_are_refused() {
        let mut hp = qwen3_30b();
        hp.n_ff_shexp = 512;
        assert!(
            matches!(validate(&hp), Err(InventoryError::BadHParam { key, .. }) if key == "n_ff_shexp")
        );
        let mut hp = qwen3_30b();
        hp.nextn_predict_layers = 1;
        assert!(validate(&hp).is_err());
    }
}
