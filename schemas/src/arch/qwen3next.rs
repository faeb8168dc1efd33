//! qwen3next (Qwen3-Next-80B-A3B) tensor layout, as llama.cpp's converter writes it.
//! Invariant: names and GGUF dims match llama.cpp's LLM_ARCH_QWEN3NEXT `create_tensor` calls.
//!
//! Every block: `attn_norm`, `post_attention_norm` [n_embd], the router `ffn_gate_inp`
//! [n_embd, n_expert], routed experts `ffn_{gate,up}_exps` [n_embd, n_ff_exp, n_expert] and
//! `ffn_down_exps` [n_ff_exp, n_embd, n_expert], and the gated shared expert
//! (`ffn_gate_inp_shexp` [n_embd], `ffn_{gate,up}_shexp` [n_embd, n_ff_shexp],
//! `ffn_down_shexp` [n_ff_shexp, n_embd]).
//!
//! Block `l` with `(l + 1) % full_attention_interval == 0` is full attention with a gated q:
//! `attn_q` [n_embd, 2 * n_head * hd] (query and sigmoid gate interleaved per head),
//! `attn_k`/`attn_v` [n_embd, n_head_kv * hd], `attn_output` [n_head * hd, n_embd],
//! `attn_q_norm`/`attn_k_norm` [hd]. Every other block is a gated delta net:
//! `attn_qkv` [n_embd, 2 * key_dim + value_dim], `attn_gate` (z) [n_embd, value_dim],
//! `ssm_ba` [n_embd, 2 * n_v_heads], `ssm_conv1d` [conv_kernel, 2 * key_dim + value_dim],
//! `ssm_dt.bias` [n_v_heads], `ssm_a` (no suffix) [n_v_heads], `ssm_norm` [head_v_dim],
//! `ssm_out` [value_dim, n_embd], where key_dim = group_count * state_size and
//! value_dim = inner_size. GGUFs converted before the converter split HF's `in_proj_qkvz`
//! carry one legacy `ssm_in` [n_embd, 2 * key_dim + 2 * value_dim] instead of
//! `attn_qkv` + `attn_gate`; checking accepts either, synthesis writes the current split.
//!
//! MTP blocks (index n_layer..) are full-attention MoE blocks plus `nextn.eh_proj`
//! [2 * n_embd, n_embd], `nextn.enorm`, `nextn.hnorm`, `nextn.shared_head_norm` [n_embd]
//! (llama.cpp also accepts optional `nextn.embed_tokens` / `nextn.shared_head_head`; Qwen
//! shares the main embedding and head, so synthesis leaves them out).

use super::{bad, blk, global_specs, Kind, Spec};
use crate::inventory::{HParams, InventoryError, LayerKind};
use std::collections::BTreeSet;

pub(super) fn validate(hp: &HParams) -> Result<(), InventoryError> {
    let Some(s) = &hp.ssm else {
        return Err(bad(
            "ssm",
            "qwen3next needs [hparams.ssm] (conv_kernel, state_size, group_count, time_step_rank, inner_size)",
        ));
    };
    match hp.full_attention_interval {
        Some(k) if k > 0 => {}
        _ => {
            return Err(bad(
                "full_attention_interval",
                "qwen3next needs a positive full_attention_interval (4 for Qwen3-Next)",
            ))
        }
    }
    for (key, v) in [
        ("ssm.conv_kernel", s.conv_kernel),
        ("ssm.state_size", s.state_size),
        ("ssm.group_count", s.group_count),
        ("ssm.time_step_rank", s.time_step_rank),
        ("ssm.inner_size", s.inner_size),
    ] {
        if v == 0 {
            return Err(bad(key, "must be greater than 0"));
        }
        if v > super::MAX_WIDTH {
            return Err(bad(key, "above the sanity limit"));
        }
    }
    if s.conv_kernel > 64 {
        return Err(bad(
            "ssm.conv_kernel",
            "a depthwise conv wider than 64 is not plausible",
        ));
    }
    if s.time_step_rank % s.group_count != 0 {
        return Err(bad(
            "ssm.time_step_rank",
            format!(
                "value heads ({}) must be a multiple of key heads (group_count {})",
                s.time_step_rank, s.group_count
            ),
        ));
    }
    if s.inner_size % s.time_step_rank != 0 {
        return Err(bad(
            "ssm.inner_size",
            format!(
                "{} is not a multiple of time_step_rank {}",
                s.inner_size, s.time_step_rank
            ),
        ));
    }
    if s.inner_size / s.time_step_rank != s.state_size {
        return Err(bad(
            "ssm.inner_size",
            format!(
                "value head dim {} (inner_size {} / time_step_rank {}) differs from the key head dim (state_size {}); llama.cpp's qwen3next needs them equal",
                s.inner_size / s.time_step_rank,
                s.inner_size,
                s.time_step_rank,
                s.state_size
            ),
        ));
    }
    if hp.head_dim_k != hp.head_dim_v {
        return Err(bad(
            "head_dim_v",
            "qwen3next needs head_dim_k == head_dim_v (llama.cpp asserts it)",
        ));
    }
    if hp.n_ff_shexp == 0 {
        return Err(bad(
            "n_ff_shexp",
            "qwen3next has a shared expert; give its width (512)",
        ));
    }
    Ok(())
}

fn block(hp: &HParams, l: u32, legacy_in: bool) -> Vec<Spec> {
    let e = hp.n_embd;
    let s = |rest: &str, dims: Vec<u64>, kind: Kind| Spec::new(blk(l, rest), dims, kind, Some(l));
    let mut out = vec![s("attn_norm.weight", vec![e], Kind::Norm)];
    match (hp.layer_kind(l), &hp.ssm) {
        (LayerKind::LinearAttention, Some(ssm)) => {
            let key_dim = ssm.group_count * ssm.state_size;
            let value_dim = ssm.inner_size;
            let conv_dim = 2 * key_dim + value_dim;
            let v_heads = ssm.time_step_rank;
            if legacy_in {
                out.push(s(
                    "ssm_in.weight",
                    vec![e, conv_dim + value_dim],
                    Kind::Linear,
                ));
            } else {
                out.push(s("attn_qkv.weight", vec![e, conv_dim], Kind::LinearQkv));
                out.push(s("attn_gate.weight", vec![e, value_dim], Kind::Linear));
            }
            out.extend([
                s("ssm_ba.weight", vec![e, 2 * v_heads], Kind::Linear),
                s(
                    "ssm_conv1d.weight",
                    vec![ssm.conv_kernel, conv_dim],
                    Kind::ConvKernel,
                ),
                s("ssm_dt.bias", vec![v_heads], Kind::Norm),
                s("ssm_a", vec![v_heads], Kind::Norm),
                s("ssm_norm.weight", vec![ssm.head_v_dim()], Kind::Norm),
                s("ssm_out.weight", vec![value_dim, e], Kind::Linear),
            ]);
        }
        _ => {
            let hd = hp.head_dim_k;
            let q = hp.n_head * hd;
            out.extend([
                s("attn_q.weight", vec![e, 2 * q], Kind::Attention),
                s("attn_k.weight", vec![e, hp.n_head_kv * hd], Kind::Attention),
                s(
                    "attn_v.weight",
                    vec![e, hp.n_head_kv * hp.head_dim_v],
                    Kind::AttentionV,
                ),
                s("attn_output.weight", vec![q, e], Kind::AttentionOutput),
                s("attn_q_norm.weight", vec![hd], Kind::Norm),
                s("attn_k_norm.weight", vec![hd], Kind::Norm),
            ]);
        }
    }
    let (x, sh) = (hp.n_ff_exp, hp.n_ff_shexp);
    out.extend([
        s("post_attention_norm.weight", vec![e], Kind::Norm),
        s("ffn_gate_inp.weight", vec![e, hp.n_expert], Kind::Router),
        s(
            "ffn_gate_exps.weight",
            vec![e, x, hp.n_expert],
            Kind::ExpertGateUp,
        ),
        s(
            "ffn_up_exps.weight",
            vec![e, x, hp.n_expert],
            Kind::ExpertGateUp,
        ),
        s(
            "ffn_down_exps.weight",
            vec![x, e, hp.n_expert],
            Kind::ExpertDown,
        ),
        s("ffn_gate_inp_shexp.weight", vec![e], Kind::Norm),
        s("ffn_gate_shexp.weight", vec![e, sh], Kind::SharedGateUp),
        s("ffn_up_shexp.weight", vec![e, sh], Kind::SharedGateUp),
        s("ffn_down_shexp.weight", vec![sh, e], Kind::SharedDown),
    ]);
    if l >= hp.n_layer {
        out.extend([
            s("nextn.eh_proj.weight", vec![2 * e, e], Kind::Other),
            s("nextn.enorm.weight", vec![e], Kind::Norm),
            s("nextn.hnorm.weight", vec![e], Kind::Norm),
            s("nextn.shared_head_norm.weight", vec![e], Kind::Norm),
            s(
                "nextn.embed_tokens.weight",
                vec![e, hp.n_vocab],
                Kind::Embedding,
            )
            .optional(),
            s(
                "nextn.shared_head_head.weight",
                vec![e, hp.n_vocab],
                Kind::Head,
            )
            .optional(),
        ]);
    }
    out
}

/// Every tensor, canonical order; `present` (a real file's names) selects the legacy
/// `ssm_in` layout per block where the file has it.
pub(super) fn specs(hp: &HParams, present: Option<&BTreeSet<&str>>) -> Vec<Spec> {
    let (mut out, tail) = global_specs(hp);
    for l in 0..hp.n_blocks_total() {
        let legacy = present.is_some_and(|p| p.contains(blk(l, "ssm_in.weight").as_str()));
        out.extend(block(hp, l, legacy));
    }
    out.extend(tail);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::tests::qwen3_next;
    use crate::arch::{check_tensors, expected_tensors, QuantRecipe};
    use crate::ggml::GgmlType;
    use crate::inventory::{TensorInfo, TensorRole};

    fn dims(s: &[Spec], n: &str) -> Vec<u64> {
        s.iter()
            .find(|x| x.name == n)
            .unwrap_or_else(|| panic!("{n}"))
            .dims
            .clone()
    }

    #[test]
    fn qwen3_next_layout() {
        let hp = qwen3_next();
        let s: Vec<Spec> = specs(&hp, None)
            .into_iter()
            .filter(|x| !x.optional)
            .collect();
        let count = |l: u32| s.iter().filter(|x| x.layer == Some(l)).count();
        // Linear blocks 18 tensors, full-attention blocks 16, the MTP block 16 + 4.
        assert_eq!(count(0), 18);
        assert_eq!(count(3), 16);
        assert_eq!(count(47), 16);
        assert_eq!(count(46), 18);
        assert_eq!(count(48), 20);
        assert_eq!(s.len(), 3 + 36 * 18 + 12 * 16 + 20);

        // Full attention: gated q is twice the width.
        assert_eq!(dims(&s, "blk.3.attn_q.weight"), vec![2048, 8192]);
        assert_eq!(dims(&s, "blk.3.attn_k.weight"), vec![2048, 512]);
        assert_eq!(dims(&s, "blk.3.attn_v.weight"), vec![2048, 512]);
        assert_eq!(dims(&s, "blk.3.attn_output.weight"), vec![4096, 2048]);
        assert_eq!(dims(&s, "blk.3.attn_q_norm.weight"), vec![256]);
        // Gated delta net.
        assert_eq!(dims(&s, "blk.0.attn_qkv.weight"), vec![2048, 8192]);
        assert_eq!(dims(&s, "blk.0.attn_gate.weight"), vec![2048, 4096]);
        assert_eq!(dims(&s, "blk.0.ssm_ba.weight"), vec![2048, 64]);
        assert_eq!(dims(&s, "blk.0.ssm_conv1d.weight"), vec![4, 8192]);
        assert_eq!(dims(&s, "blk.0.ssm_dt.bias"), vec![32]);
        assert_eq!(dims(&s, "blk.0.ssm_a"), vec![32]);
        assert_eq!(dims(&s, "blk.0.ssm_norm.weight"), vec![128]);
        assert_eq!(dims(&s, "blk.0.ssm_out.weight"), vec![4096, 2048]);
        assert!(!s.iter().any(|x| x.name == "blk.3.attn_qkv.weight"));
        assert!(!s.iter().any(|x| x.name == "blk.0.attn_q.weight"));
        // MoE + shared expert.
        assert_eq!(dims(&s, "blk.0.ffn_gate_inp.weight"), vec![2048, 512]);
        assert_eq!(dims(&s, "blk.0.ffn_gate_exps.weight"), vec![2048, 512, 512]);
        assert_eq!(dims(&s, "blk.0.ffn_down_exps.weight"), vec![512, 2048, 512]);
        assert_eq!(dims(&s, "blk.0.ffn_gate_inp_shexp.weight"), vec![2048]);
        assert_eq!(dims(&s, "blk.0.ffn_down_shexp.weight"), vec![512, 2048]);
        assert_eq!(dims(&s, "blk.0.post_attention_norm.weight"), vec![2048]);
        // MTP block: full attention, MoE, plus the nextn extras.
        assert_eq!(dims(&s, "blk.48.attn_q.weight"), vec![2048, 8192]);
        assert_eq!(dims(&s, "blk.48.ffn_up_exps.weight"), vec![2048, 512, 512]);
        assert_eq!(dims(&s, "blk.48.nextn.eh_proj.weight"), vec![4096, 2048]);
        assert_eq!(dims(&s, "blk.48.nextn.shared_head_norm.weight"), vec![2048]);
        assert!(!s.iter().any(|x| x.name.contains("nextn.embed_tokens")));
    }

    #[test]
    fn no_mtp_block_without_nextn() {
        let mut hp = qwen3_next();
        hp.nextn_predict_layers = 0;
        let s = specs(&hp, None);
        assert!(!s.iter().any(|x| x.layer == Some(48)));
        assert_eq!(s.len(), 3 + 36 * 18 + 12 * 16);
    }

    #[test]
    fn legacy_ssm_in_is_accepted_when_checking() {
        let hp = qwen3_next();
        let good =
            expected_tensors("qwen3next", &hp, &QuantRecipe::preset("Q8_0").unwrap()).unwrap();
        let mut legacy: Vec<TensorInfo> = good
            .iter()
            .filter(|t| t.name != "blk.0.attn_qkv.weight" && t.name != "blk.0.attn_gate.weight")
            .cloned()
            .collect();
        legacy.push(
            TensorInfo::new(
                "blk.0.ssm_in.weight",
                vec![2048, 12288],
                GgmlType::Q8_0,
                TensorRole::Dense,
                Some(0),
            )
            .unwrap(),
        );
        assert_eq!(check_tensors("qwen3next", &hp, &legacy), Ok(()));
        // Optional MTP head copies are accepted too.
        let mut with_opt = good.clone();
        with_opt.push(
            TensorInfo::new(
                "blk.48.nextn.shared_head_head.weight",
                vec![2048, 151936],
                GgmlType::Q8_0,
                TensorRole::MtpExtra,
                Some(48),
            )
            .unwrap(),
        );
        assert_eq!(check_tensors("qwen3next", &hp, &with_opt), Ok(()));
    }

    #[test]
    fn bad_ssm_params_name_the_key() {
        let mut hp = qwen3_next();
        if let Some(s) = hp.ssm.as_mut() {
            s.time_step_rank = 24;
        }
        assert!(matches!(
            validate(&hp),
            Err(InventoryError::BadHParam { key, .. }) if key == "ssm.time_step_rank"
        ));
        let mut hp = qwen3_next();
        if let Some(s) = hp.ssm.as_mut() {
            s.inner_size = 32 * 64;
        }
        let e = validate(&hp).unwrap_err();
        assert!(
            matches!(&e, InventoryError::BadHParam { key, .. } if key == "ssm.inner_size"),
            "{e:?}"
        );
        let mut hp = qwen3_next();
        hp.full_attention_interval = Some(0);
        assert!(matches!(
            validate(&hp),
            Err(InventoryError::BadHParam { key, .. }) if key == "full_attention_interval"
        ));
    }
}
