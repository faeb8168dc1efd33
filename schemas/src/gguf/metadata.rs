//! llama.cpp's GGUF metadata for the models we write: the tokenizer vocabulary
//! (`tokenizer.ggml.*`), `general.file_type`, and the per-architecture hyperparameter keys.
//! Invariant: key names are llama.cpp's (llama-arch.cpp `LLM_KV_NAMES`), so llama.cpp loads
//! what we write; a value that does not fit llama.cpp's type is an error, never truncated.

use super::{GgufArray, GgufValue};
use crate::ggml::GgmlType;
use crate::inventory::{HParams, TensorInfo};
use std::collections::BTreeMap;

/// A tokenizer vocabulary in llama.cpp's `tokenizer.ggml.*` form (BPE, "gpt2").
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Vocab {
    /// Token strings by id; must have `n_vocab` entries.
    pub tokens: Vec<String>,
    /// llama.cpp token types by id (1 normal, 3 control, 4 user defined, 5 unused...).
    pub token_type: Vec<i32>,
    /// BPE merges, "left right".
    pub merges: Vec<String>,
    /// `tokenizer.ggml.pre` (e.g. "qwen2"); omitted when `None`.
    pub pre: Option<String>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub pad: Option<u32>,
    pub chat_template: Option<String>,
}

impl Vocab {
    /// The `tokenizer.*` metadata entries.
    pub fn metadata(&self) -> Vec<(String, GgufValue)> {
        let mut kv = vec![(
            "tokenizer.ggml.model".to_string(),
            GgufValue::String("gpt2".into()),
        )];
        if let Some(p) = &self.pre {
            kv.push(("tokenizer.ggml.pre".into(), GgufValue::String(p.clone())));
        }
        kv.push((
            "tokenizer.ggml.tokens".into(),
            GgufValue::Array(GgufArray::Strings(self.tokens.clone())),
        ));
        kv.push((
            "tokenizer.ggml.token_type".into(),
            GgufValue::Array(GgufArray::I32(self.token_type.clone())),
        ));
        kv.push((
            "tokenizer.ggml.merges".into(),
            GgufValue::Array(GgufArray::Strings(self.merges.clone())),
        ));
        for (k, v) in [
            ("tokenizer.ggml.bos_token_id", self.bos),
            ("tokenizer.ggml.eos_token_id", self.eos),
            ("tokenizer.ggml.padding_token_id", self.pad),
        ] {
            if let Some(id) = v {
                kv.push((k.into(), GgufValue::U32(id)));
            }
        }
        if let Some(t) = &self.chat_template {
            kv.push((
                "tokenizer.chat_template".into(),
                GgufValue::String(t.clone()),
            ));
        }
        kv
    }

    /// Check the vocabulary fits a model of `n_vocab` rows.
    pub fn check(&self, n_vocab: u64) -> Result<(), String> {
        if self.tokens.len() as u64 != n_vocab {
            return Err(format!(
                "{} tokens but the model has n_vocab = {n_vocab} embedding rows",
                self.tokens.len()
            ));
        }
        if self.token_type.len() != self.tokens.len() {
            return Err(format!(
                "{} token types for {} tokens",
                self.token_type.len(),
                self.tokens.len()
            ));
        }
        for (what, id) in [("bos", self.bos), ("eos", self.eos), ("pad", self.pad)] {
            if let Some(id) = id {
                if u64::from(id) >= n_vocab {
                    return Err(format!(
                        "{what} token id {id} is not below n_vocab {n_vocab}"
                    ));
                }
            }
        }
        Ok(())
    }
}

/// llama.cpp's `general.file_type` (`LLAMA_FTYPE_*`) for a preset name or, failing that, the
/// type most matrix bytes have.
pub fn file_type(preset: &str, tensors: &[TensorInfo]) -> u32 {
    match preset.to_ascii_uppercase().as_str() {
        "F32" => return 0,
        "F16" => return 1,
        "Q8_0" => return 7,
        "Q4_K" | "Q4_K_S" => return 14,
        "Q4_K_M" | "UD-Q4_K_XL" => return 15,
        "Q4_0" => return 2,
        "Q3_K_M" => return 12,
        "Q5_K_M" => return 17,
        "IQ3_S" => return 26,
        "IQ3_M" => return 27,
        "IQ4_XS" => return 30,
        "BF16" => return 32,
        _ => {}
    }
    let mut by: BTreeMap<GgmlType, u64> = BTreeMap::new();
    for t in tensors.iter().filter(|t| t.dims.len() >= 2) {
        *by.entry(t.ggml_type).or_default() += t.bytes;
    }
    let main = by.into_iter().max_by_key(|(_, b)| *b).map(|(t, _)| t);
    use GgmlType::*;
    match main {
        Some(F16) => 1,
        Some(Q4_0) => 2,
        Some(Q4_1) => 3,
        Some(Q8_0) => 7,
        Some(Q5_0) => 8,
        Some(Q5_1) => 9,
        Some(Q2K) => 10,
        Some(Q3K) => 12,
        Some(Q4K) => 14,
        Some(Q5K) => 16,
        Some(Q6K) => 18,
        Some(Iq2Xxs) => 19,
        Some(Iq2Xs) => 20,
        Some(Iq3Xxs) => 23,
        Some(Iq1S) => 24,
        Some(Iq4Nl) => 25,
        Some(Iq3S) => 26,
        Some(Iq2S) => 28,
        Some(Iq4Xs) => 30,
        Some(Iq1M) => 31,
        Some(BF16) => 32,
        Some(MXFP4) => 38,
        _ => 0,
    }
}

fn u32_of(key: &str, v: u64) -> Result<GgufValue, String> {
    u32::try_from(v)
        .map(GgufValue::U32)
        .map_err(|_| format!("{key} = {v} does not fit the u32 llama.cpp stores"))
}

/// llama.cpp's metadata for `arch` with `hp` (names from llama-arch.cpp's `LLM_KV_NAMES`).
/// `block_count` counts every block, MTP blocks included (llama.cpp's convention, with
/// `nextn_predict_layers` saying how many of them are MTP); `rope.dimension_count` is the
/// rotated dims (the whole head unless `hp.rope_dim`); `expert_weights_norm` carries
/// `norm_topk_prob`.
pub fn arch_metadata(
    arch: &str,
    name: &str,
    hp: &HParams,
) -> Result<Vec<(String, GgufValue)>, String> {
    let k = |s: &str| format!("{arch}.{s}");
    let mut kv: Vec<(String, GgufValue)> = vec![
        (
            "general.architecture".into(),
            GgufValue::String(arch.into()),
        ),
        ("general.name".into(), GgufValue::String(name.into())),
    ];
    let push_u32 = |kv: &mut Vec<(String, GgufValue)>, key: String, v: u64| {
        let val = u32_of(&key, v)?;
        kv.push((key, val));
        Ok::<(), String>(())
    };
    push_u32(&mut kv, k("block_count"), u64::from(hp.n_blocks_total()))?;
    push_u32(&mut kv, k("context_length"), hp.n_ctx_train)?;
    push_u32(&mut kv, k("embedding_length"), hp.n_embd)?;
    push_u32(&mut kv, k("feed_forward_length"), hp.n_ff)?;
    push_u32(&mut kv, k("attention.head_count"), hp.n_head)?;
    push_u32(&mut kv, k("attention.head_count_kv"), hp.n_head_kv)?;
    push_u32(&mut kv, k("attention.key_length"), hp.head_dim_k)?;
    push_u32(&mut kv, k("attention.value_length"), hp.head_dim_v)?;
    kv.push((
        k("attention.layer_norm_rms_epsilon"),
        GgufValue::F32(hp.rms_eps as f32),
    ));
    kv.push((k("rope.freq_base"), GgufValue::F32(hp.rope_theta as f32)));
    push_u32(
        &mut kv,
        k("rope.dimension_count"),
        hp.rope_dim.unwrap_or(hp.head_dim_k),
    )?;
    push_u32(&mut kv, k("expert_count"), hp.n_expert)?;
    push_u32(&mut kv, k("expert_used_count"), hp.n_expert_used)?;
    push_u32(&mut kv, k("expert_feed_forward_length"), hp.n_ff_exp)?;
    if hp.n_ff_shexp > 0 {
        push_u32(
            &mut kv,
            k("expert_shared_feed_forward_length"),
            hp.n_ff_shexp,
        )?;
    }
    kv.push((k("expert_weights_norm"), GgufValue::Bool(hp.norm_topk_prob)));
    if let Some(s) = &hp.ssm {
        push_u32(&mut kv, k("ssm.conv_kernel"), s.conv_kernel)?;
        push_u32(&mut kv, k("ssm.state_size"), s.state_size)?;
        push_u32(&mut kv, k("ssm.group_count"), s.group_count)?;
        push_u32(&mut kv, k("ssm.time_step_rank"), s.time_step_rank)?;
        push_u32(&mut kv, k("ssm.inner_size"), s.inner_size)?;
    }
    if let Some(i) = hp.full_attention_interval {
        kv.push((k("full_attention_interval"), GgufValue::U32(i)));
    }
    if hp.nextn_predict_layers > 0 {
        kv.push((
            k("nextn_predict_layers"),
            GgufValue::U32(hp.nextn_predict_layers),
        ));
    }
    Ok(kv)
}
