//! Per-architecture tensor layouts (llama.cpp names and GGUF shapes): synthesis and checking.
//! Invariant: one spec list per architecture is the single source of truth for the tensors a
//! model has; the descriptor synthesizer, the GGUF reader and the safetensors reader all go
//! through it, and every role comes from [`classify`], so a synthesized inventory and a real
//! file of the same model agree tensor for tensor.
//!
//! Shapes are in GGUF order (`dims[0]` is the contiguous dimension), exactly as llama.cpp's
//! `create_tensor` calls spell them. The quant recipe ([`QuantRecipe`]) decides each tensor's
//! ggml type the way `llama-quantize` does (see the preset table in [`QuantRecipe::preset`]).

mod qwen3moe;
mod qwen3next;
mod recipe;

#[cfg(test)]
use recipe::use_more_bits;
pub use recipe::{
    fallback, glob_match, BlockLimit, BumpTarget, FirstBlocks, QuantRecipe, TensorOverride, PRESETS,
};
use recipe::{n_dims, RecipeCtx};

use crate::inventory::{HParams, InventoryError, TensorInfo, TensorRole};
use std::collections::{BTreeMap, BTreeSet};

/// Architectures whose tensor layout Strata knows (llama.cpp `general.architecture` names).
pub const SUPPORTED: &[&str] = &["qwen3moe", "qwen3next"];

/// Sanity limit for any width (n_embd, head dims, FFN widths, ssm sizes): 2^20.
const MAX_WIDTH: u64 = 1 << 20;
/// Sanity limit for the vocabulary: 2^24 rows.
const MAX_VOCAB: u64 = 1 << 24;
/// Sanity limit for head and expert counts: 2^16.
const MAX_COUNT: u64 = 1 << 16;
/// Sanity limit for the number of blocks: 4096.
const MAX_LAYERS: u32 = 4096;

// ---------------------------------------------------------------------------------------------
// Classification
// ---------------------------------------------------------------------------------------------

/// Role and block of a tensor from its llama.cpp name, for ANY architecture.
///
/// `token_embd.*` -> Embedding, `output.*` -> Head, `output_norm.*` -> OutputNorm,
/// `blk.N.nextn.*` -> MtpExtra, `blk.N.*_exps.*` (weights, biases, scales: gpt-oss's
/// `ffn_down_exps.bias` too) -> ExpertStack, any other `blk.N.*` -> Dense (the router
/// `ffn_gate_inp` included), anything else -> Dense with no layer.
pub fn classify(name: &str) -> (TensorRole, Option<u32>) {
    if let Some(rest) = name.strip_prefix("blk.") {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits > 0 && rest.as_bytes().get(digits) == Some(&b'.') {
            if let Ok(layer) = rest[..digits].parse::<u32>() {
                let tail = &rest[digits + 1..];
                let role = if tail.starts_with("nextn.") {
                    TensorRole::MtpExtra
                } else if is_expert_stack(tail) {
                    TensorRole::ExpertStack
                } else {
                    TensorRole::Dense
                };
                return (role, Some(layer));
            }
        }
        return (TensorRole::Dense, None);
    }
    let stem = name.split('.').next().unwrap_or(name);
    let role = match stem {
        "token_embd" => TensorRole::Embedding,
        "output" => TensorRole::Head,
        "output_norm" => TensorRole::OutputNorm,
        _ => TensorRole::Dense,
    };
    (role, None)
}

/// `ffn_gate_exps.weight`, `ffn_down_exps.bias`, `ffn_gate_up_exps.weight`, ...: the part
/// before the first dot ends in `_exps`.
fn is_expert_stack(tail: &str) -> bool {
    let base = tail.split('.').next().unwrap_or(tail);
    base.ends_with("_exps")
}

// ---------------------------------------------------------------------------------------------
// Specs
// ---------------------------------------------------------------------------------------------

/// What a tensor is, as far as the quant recipe cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Embedding,
    Head,
    /// 1-D: norms, `ssm_a`, `ssm_dt.bias`, `ffn_gate_inp_shexp`.
    Norm,
    /// Full-attention q/k.
    Attention,
    /// Full-attention output projection (llama.cpp's attn_output category).
    AttentionOutput,
    /// Full-attention v (llama.cpp's attn_v category).
    AttentionV,
    /// Linear-attention fused q/k/v (`attn_qkv`, attn_v-like for llama.cpp).
    LinearQkv,
    /// Other linear-attention projections (`attn_gate`, `ssm_ba`, `ssm_out`, `ssm_in`).
    Linear,
    /// `ssm_conv1d`: never quantized.
    ConvKernel,
    /// `ffn_gate_inp`: never quantized.
    Router,
    ExpertGateUp,
    ExpertDown,
    SharedGateUp,
    SharedDown,
    /// Anything else (MTP `eh_proj`).
    Other,
}

/// One expected tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Spec {
    pub name: String,
    pub dims: Vec<u64>,
    pub kind: Kind,
    pub layer: Option<u32>,
    /// llama.cpp loads it with TENSOR_NOT_REQUIRED: accepted when present, fine when absent.
    /// Synthesis leaves optional tensors out.
    pub optional: bool,
}

impl Spec {
    pub(crate) fn new(name: String, dims: Vec<u64>, kind: Kind, layer: Option<u32>) -> Self {
        Self {
            name,
            dims,
            kind,
            layer,
            optional: false,
        }
    }
    pub(crate) fn optional(mut self) -> Self {
        self.optional = true;
        self
    }
}

/// `blk.{layer}.{rest}`.
pub(crate) fn blk(layer: u32, rest: &str) -> String {
    format!("blk.{layer}.{rest}")
}

/// Global tensors every supported arch has: embedding, final norm, head (unless tied).
pub(crate) fn global_specs(hp: &HParams) -> (Vec<Spec>, Vec<Spec>) {
    let head = vec![Spec::new(
        "token_embd.weight".into(),
        vec![hp.n_embd, hp.n_vocab],
        Kind::Embedding,
        None,
    )];
    let mut tail = vec![Spec::new(
        "output_norm.weight".into(),
        vec![hp.n_embd],
        Kind::Norm,
        None,
    )];
    if !hp.tied_embeddings {
        tail.push(Spec::new(
            "output.weight".into(),
            vec![hp.n_embd, hp.n_vocab],
            Kind::Head,
            None,
        ));
    }
    (head, tail)
}

fn unsupported(arch: &str) -> InventoryError {
    InventoryError::UnsupportedArch {
        arch: arch.to_string(),
        supported: SUPPORTED.join(", "),
    }
}

pub(crate) fn bad(key: &str, reason: impl Into<String>) -> InventoryError {
    InventoryError::BadHParam {
        key: key.to_string(),
        reason: reason.into(),
    }
}

/// Check the hyperparameters every supported arch shares: nonzero sizes within sanity limits,
/// heads dividing, `n_expert_used <= n_expert`.
fn validate_common(hp: &HParams) -> Result<(), InventoryError> {
    fn positive(key: &str, v: u64, max: u64) -> Result<(), InventoryError> {
        if v == 0 {
            return Err(bad(key, "must be greater than 0"));
        }
        if v > max {
            return Err(bad(key, format!("{v} is above the sanity limit {max}")));
        }
        Ok(())
    }
    if hp.n_layer == 0 {
        return Err(bad("n_layer", "must be greater than 0"));
    }
    if hp.n_layer > MAX_LAYERS {
        return Err(bad(
            "n_layer",
            format!("{} is above {MAX_LAYERS}", hp.n_layer),
        ));
    }
    if hp.nextn_predict_layers > 16 {
        return Err(bad("nextn_predict_layers", "more than 16 MTP blocks"));
    }
    positive("n_embd", hp.n_embd, MAX_WIDTH)?;
    positive("n_vocab", hp.n_vocab, MAX_VOCAB)?;
    if hp.n_ctx_train == 0 {
        return Err(bad("n_ctx_train", "must be greater than 0"));
    }
    positive("n_head", hp.n_head, MAX_COUNT)?;
    positive("n_head_kv", hp.n_head_kv, MAX_COUNT)?;
    if hp.n_head % hp.n_head_kv != 0 {
        return Err(bad(
            "n_head_kv",
            format!(
                "n_head {} is not a multiple of n_head_kv {}",
                hp.n_head, hp.n_head_kv
            ),
        ));
    }
    positive("head_dim_k", hp.head_dim_k, MAX_WIDTH)?;
    positive("head_dim_v", hp.head_dim_v, MAX_WIDTH)?;
    positive("n_expert", hp.n_expert, MAX_COUNT)?;
    positive("n_expert_used", hp.n_expert_used, MAX_COUNT)?;
    if hp.n_expert_used > hp.n_expert {
        return Err(bad(
            "n_expert_used",
            format!(
                "{} experts per token but only n_expert = {}",
                hp.n_expert_used, hp.n_expert
            ),
        ));
    }
    positive("n_ff_exp", hp.n_ff_exp, MAX_WIDTH)?;
    if hp.n_ff > MAX_WIDTH {
        return Err(bad("n_ff", "above the sanity limit"));
    }
    if hp.n_ff_shexp > MAX_WIDTH {
        return Err(bad("n_ff_shexp", "above the sanity limit"));
    }
    if hp.n_leading_dense != 0 {
        return Err(bad(
            "n_leading_dense",
            "this architecture has experts in every block; set 0",
        ));
    }
    if let Some(r) = hp.rope_dim {
        if r == 0 || r > hp.head_dim_k || r % 2 != 0 {
            return Err(bad(
                "rope_dim",
                format!(
                    "{r} must be even, nonzero and at most head_dim_k {}",
                    hp.head_dim_k
                ),
            ));
        }
    }
    if !(hp.rope_theta.is_finite() && hp.rope_theta > 0.0) {
        return Err(bad("rope_theta", "must be a positive number"));
    }
    if !(hp.rms_eps.is_finite() && hp.rms_eps > 0.0) {
        return Err(bad("rms_eps", "must be a positive number"));
    }
    Ok(())
}

/// Check `hp` for `arch`: zero sizes, heads that do not divide, fields the arch does not have.
/// Errors name the hyperparameter key (`InventoryError::BadHParam`).
pub fn validate_hparams(arch: &str, hp: &HParams) -> Result<(), InventoryError> {
    match arch {
        "qwen3moe" => {
            validate_common(hp)?;
            qwen3moe::validate(hp)
        }
        "qwen3next" => {
            validate_common(hp)?;
            qwen3next::validate(hp)
        }
        _ => Err(unsupported(arch)),
    }
}

/// Specs after validation; `present` (names in a real file) picks between layouts llama.cpp
/// accepts, e.g. qwen3next's legacy fused `ssm_in`.
fn specs(
    arch: &str,
    hp: &HParams,
    present: Option<&BTreeSet<&str>>,
) -> Result<Vec<Spec>, InventoryError> {
    validate_hparams(arch, hp)?;
    Ok(match arch {
        "qwen3moe" => qwen3moe::specs(hp),
        "qwen3next" => qwen3next::specs(hp, present),
        _ => return Err(unsupported(arch)),
    })
}

/// Every tensor a converted + quantized `arch` model with `hp` has, in canonical order
/// (token embedding, blocks 0.., MTP blocks, output norm, head), each with its role from
/// [`classify`], its layer and its type from `recipe`. MTP block tensors appear only when
/// `hp.nextn_predict_layers > 0`; optional llama.cpp tensors are left out.
pub fn expected_tensors(
    arch: &str,
    hp: &HParams,
    recipe: &QuantRecipe,
) -> Result<Vec<TensorInfo>, InventoryError> {
    let ctx = RecipeCtx {
        n_blocks: hp.n_blocks_total(),
        gqa: hp.n_head.checked_div(hp.n_head_kv).unwrap_or(0),
    };
    specs(arch, hp, None)?
        .into_iter()
        .filter(|s| !s.optional)
        .map(|s| {
            let t = recipe.type_for(&s, ctx);
            let (role, layer) = classify(&s.name);
            debug_assert_eq!(layer, s.layer);
            TensorInfo::new(s.name, s.dims, t, role, layer)
        })
        .collect()
}

/// Names and GGUF dims of every required tensor (no types).
pub fn expected_shapes(
    arch: &str,
    hp: &HParams,
) -> Result<Vec<(String, Vec<u64>)>, InventoryError> {
    Ok(specs(arch, hp, None)?
        .into_iter()
        .filter(|s| !s.optional)
        .map(|s| (s.name, s.dims))
        .collect())
}

/// Dims with trailing 1s dropped (llama.cpp compares shapes that way: `[2048, 1]` == `[2048]`).
fn trimmed(dims: &[u64]) -> &[u64] {
    &dims[..n_dims(dims).min(dims.len())]
}

/// Check a real file's tensor table against the layout: the first missing required tensor
/// (in canonical order), then the first tensor with a wrong shape, then the first tensor the
/// arch does not have (in the given order). Trailing dims of 1 are ignored, as llama.cpp does.
pub fn check_tensors(
    arch: &str,
    hp: &HParams,
    tensors: &[TensorInfo],
) -> Result<(), InventoryError> {
    let present: BTreeSet<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    let specs = specs(arch, hp, Some(&present))?;
    let given: BTreeMap<&str, &TensorInfo> = tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    for s in &specs {
        if !s.optional && !given.contains_key(s.name.as_str()) {
            return Err(InventoryError::Missing {
                arch: arch.to_string(),
                tensor: s.name.clone(),
            });
        }
    }
    for s in &specs {
        if let Some(t) = given.get(s.name.as_str()) {
            if trimmed(&t.dims) != trimmed(&s.dims) {
                return Err(InventoryError::WrongShape {
                    arch: arch.to_string(),
                    tensor: s.name.clone(),
                    found: t.dims.clone(),
                    expected: s.dims.clone(),
                });
            }
        }
    }
    let known: BTreeSet<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    if let Some(t) = tensors.iter().find(|t| !known.contains(t.name.as_str())) {
        return Err(InventoryError::Unexpected {
            arch: arch.to_string(),
            tensor: t.name.clone(),
        });
    }
    Ok(())
}

/// After [`check_tensors`] passed: give every tensor whose shape differs from its spec only
/// by trailing 1s (`[2048, 1]` for `[2048]`, which llama.cpp accepts) the spec's dims, so
/// every later reader (the executor's weight views) sees one canonical shape.
pub fn canonical_dims(
    arch: &str,
    hp: &HParams,
    tensors: &mut [TensorInfo],
) -> Result<(), InventoryError> {
    let present: BTreeSet<String> = tensors.iter().map(|t| t.name.clone()).collect();
    let present: BTreeSet<&str> = present.iter().map(String::as_str).collect();
    let specs: BTreeMap<String, Vec<u64>> = specs(arch, hp, Some(&present))?
        .into_iter()
        .map(|s| (s.name, s.dims))
        .collect();
    for t in tensors.iter_mut() {
        if let Some(d) = specs.get(&t.name) {
            if t.dims != *d && trimmed(&t.dims) == trimmed(d) {
                t.dims = d.clone();
            }
        }
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::ggml::GgmlType;
    use crate::inventory::ModelInventory;
    pub(crate) use crate::known::{qwen3_30b_a3b as qwen3_30b, qwen3_next_80b_a3b as qwen3_next};

    fn inventory(arch: &str, hp: HParams, preset: &str) -> ModelInventory {
        let recipe = QuantRecipe::preset(preset).unwrap();
        let tensors = expected_tensors(arch, &hp, &recipe).unwrap();
        ModelInventory {
            arch: arch.into(),
            name: "test".into(),
            hparams: hp,
            tensors,
            vision: None,
        }
    }

    #[test]
    fn trailing_ones_pass_the_check_and_become_the_canonical_shape() {
        let mut inv = inventory("qwen3moe", qwen3_30b(), "Q8_0");
        let i = inv
            .tensors
            .iter()
            .position(|t| t.name == "blk.0.attn_norm.weight")
            .unwrap();
        let want = inv.tensors[i].dims.clone();
        inv.tensors[i].dims.push(1);
        check_tensors("qwen3moe", &inv.hparams, &inv.tensors).unwrap();
        canonical_dims("qwen3moe", &inv.hparams, &mut inv.tensors).unwrap();
        assert_eq!(inv.tensors[i].dims, want);
    }

    #[test]
    fn classify_representative_names() {
        use TensorRole::*;
        let cases: &[(&str, TensorRole, Option<u32>)] = &[
            ("token_embd.weight", Embedding, None),
            ("output.weight", Head, None),
            ("output_norm.weight", OutputNorm, None),
            ("output_norm.bias", OutputNorm, None),
            ("blk.0.attn_q.weight", Dense, Some(0)),
            ("blk.12.ffn_gate_inp.weight", Dense, Some(12)),
            ("blk.3.ffn_gate_exps.weight", ExpertStack, Some(3)),
            ("blk.3.ffn_up_exps.weight", ExpertStack, Some(3)),
            ("blk.47.ffn_down_exps.weight", ExpertStack, Some(47)),
            ("blk.5.ffn_down_exps.bias", ExpertStack, Some(5)),
            ("blk.5.ffn_gate_up_exps.weight", ExpertStack, Some(5)),
            ("blk.7.ffn_gate_shexp.weight", Dense, Some(7)),
            ("blk.7.ffn_gate_inp_shexp.weight", Dense, Some(7)),
            ("blk.0.ssm_a", Dense, Some(0)),
            ("blk.0.ssm_dt.bias", Dense, Some(0)),
            ("blk.48.nextn.eh_proj.weight", MtpExtra, Some(48)),
            ("blk.48.nextn.shared_head_norm.weight", MtpExtra, Some(48)),
            ("blk.48.attn_q.weight", Dense, Some(48)),
            ("blk.48.ffn_up_exps.weight", ExpertStack, Some(48)),
            ("rope_freqs.weight", Dense, None),
            ("blk.x.attn_q.weight", Dense, None),
            ("blk.", Dense, None),
            ("", Dense, None),
        ];
        for (name, role, layer) in cases {
            assert_eq!(classify(name), (*role, *layer), "{name}");
        }
    }

    #[test]
    fn glob_and_fallback() {
        assert!(glob_match(
            "blk.*.ffn_down_exps.weight",
            "blk.17.ffn_down_exps.weight"
        ));
        assert!(!glob_match(
            "blk.*.ffn_down_exps.weight",
            "blk.17.ffn_down_shexp.weight"
        ));
        assert!(glob_match("*attn_v*", "blk.3.attn_v.weight"));
        assert!(glob_match("output.weight", "output.weight"));
        assert!(!glob_match("output", "output.weight"));
        assert!(glob_match("*", ""));
        // llama.cpp's fallback table.
        assert_eq!(fallback(GgmlType::Q4K, 2048), GgmlType::Q4K);
        assert_eq!(fallback(GgmlType::Q4K, 4304), GgmlType::F16); // 4304 % 32 == 16
        assert_eq!(fallback(GgmlType::Q4K, 1408), GgmlType::Q5_0);
        assert_eq!(fallback(GgmlType::Q6K, 1408), GgmlType::Q8_0);
        assert_eq!(fallback(GgmlType::Iq3S, 1408), GgmlType::Iq4Nl);
        assert_eq!(fallback(GgmlType::Q3K, 1408), GgmlType::Q4_0);
        assert_eq!(fallback(GgmlType::Q8_0, 100), GgmlType::F16);
        assert!(QuantRecipe::preset("nope").is_none());
        for p in PRESETS {
            assert!(QuantRecipe::preset(p).is_some(), "{p}");
        }
    }

    #[test]
    fn design_worked_numbers_next_iq3s() {
        let inv = inventory("qwen3next", qwen3_next(), "IQ3_S");
        // One routed expert of one layer: 3 x 2048 x 512 at IQ3_S = 1,351,680 B.
        for l in [0, 3, 47, 48] {
            assert_eq!(inv.expert_bytes(l), 1_351_680, "layer {l}");
        }
        // A layer's 512 experts ~ 0.69 GB.
        let layer = 512 * inv.expert_bytes(0);
        assert_eq!(layer, 692_060_160);
        // 48 layers + the MTP block ~ 33.9 GB.
        let all: u64 = inv
            .tensors
            .iter()
            .filter(|t| t.role == TensorRole::ExpertStack)
            .map(|t| t.bytes)
            .sum();
        assert_eq!(all, 49 * 692_060_160);
        assert!((33.85e9..33.95e9).contains(&(all as f64)), "{all}");
        // llama.cpp's IQ3_S mix: attn_v-like tensors Q4_K (GQA 8 >= 4), every other matrix
        // IQ3_S, head Q6_K, norms and router F32.
        assert_eq!(
            inv.tensor("blk.0.attn_qkv.weight").unwrap().ggml_type,
            GgmlType::Q4K
        );
        assert_eq!(
            inv.tensor("blk.3.attn_v.weight").unwrap().ggml_type,
            GgmlType::Q4K
        );
        assert_eq!(
            inv.tensor("blk.3.attn_q.weight").unwrap().ggml_type,
            GgmlType::Iq3S
        );
        assert_eq!(
            inv.tensor("output.weight").unwrap().ggml_type,
            GgmlType::Q6K
        );
        assert_eq!(
            inv.tensor("token_embd.weight").unwrap().ggml_type,
            GgmlType::Iq3S
        );
        assert_eq!(
            inv.tensor("blk.0.ffn_gate_inp.weight").unwrap().ggml_type,
            GgmlType::F32
        );
        assert_eq!(
            inv.tensor("blk.0.ssm_conv1d.weight").unwrap().ggml_type,
            GgmlType::F32
        );
        assert_eq!(inv.tensor("blk.0.ssm_a").unwrap().ggml_type, GgmlType::F32);
        assert_eq!(
            inv.tensor("blk.0.ssm_dt.bias").unwrap().ggml_type,
            GgmlType::F32
        );
        assert_eq!(
            inv.tensor("blk.0.ffn_down_shexp.weight").unwrap().ggml_type,
            GgmlType::Iq3S
        );
        assert_eq!(
            inv.tensor("blk.48.nextn.eh_proj.weight").unwrap().ggml_type,
            GgmlType::Iq3S
        );
        assert_eq!(
            inv.tensor("blk.48.nextn.enorm.weight").unwrap().role,
            TensorRole::MtpExtra
        );
    }

    #[test]
    fn qwen3_30b_q8_0_matches_real_file_size() {
        let inv = inventory("qwen3moe", qwen3_30b(), "Q8_0");
        let params: u64 = inv.tensors.iter().map(|t| t.elements()).sum();
        // 30.53B parameters (Qwen's model card: 30.5B).
        assert!((30.4e9..30.65e9).contains(&(params as f64)), "{params}");
        // Real Qwen3-30B-A3B-Q8_0.gguf: 32.48 GB (weights plus a few MB of metadata).
        let total = inv.total_bytes() as f64;
        let real = 32.48e9;
        assert!((total - real).abs() / real < 0.01, "{total}");
        assert_eq!(inv.tensors.len(), 579);
        assert_eq!(
            inv.tensor("blk.0.ffn_gate_inp.weight").unwrap().ggml_type,
            GgmlType::F32
        );
        assert_eq!(
            inv.tensor("output.weight").unwrap().ggml_type,
            GgmlType::Q8_0
        );
    }

    #[test]
    fn q4_k_m_bumps_like_llama_cpp() {
        let inv = inventory("qwen3moe", qwen3_30b(), "Q4_K_M");
        // use_more_bits(i, 48): i < 6, i >= 42, or (i - 6) % 3 == 2.
        let bumped: Vec<u32> = (0..48)
            .filter(|l| {
                inv.tensor(&format!("blk.{l}.attn_v.weight"))
                    .unwrap()
                    .ggml_type
                    == GgmlType::Q6K
            })
            .collect();
        let expect: Vec<u32> = (0..48).filter(|l| use_more_bits(*l, 48)).collect();
        assert_eq!(bumped, expect);
        assert_eq!(bumped[..7], [0, 1, 2, 3, 4, 5, 8]);
        for l in 0..48 {
            let down = inv
                .tensor(&format!("blk.{l}.ffn_down_exps.weight"))
                .unwrap();
            let gate = inv
                .tensor(&format!("blk.{l}.ffn_gate_exps.weight"))
                .unwrap();
            assert_eq!(gate.ggml_type, GgmlType::Q4K);
            let want = if use_more_bits(l, 48) {
                GgmlType::Q6K
            } else {
                GgmlType::Q4K
            };
            assert_eq!(down.ggml_type, want, "layer {l}");
            let q = inv.tensor(&format!("blk.{l}.attn_q.weight")).unwrap();
            assert_eq!(q.ggml_type, GgmlType::Q4K);
        }
        assert_eq!(
            inv.tensor("output.weight").unwrap().ggml_type,
            GgmlType::Q6K
        );
        assert_eq!(
            inv.tensor("token_embd.weight").unwrap().ggml_type,
            GgmlType::Q4K
        );
        // Next: attn_qkv is attn_v-like, shared ffn_down bumps too, the MTP block (48 of 49)
        // is in the last eighth.
        let next = inventory("qwen3next", qwen3_next(), "Q4_K_M");
        assert_eq!(
            next.tensor("blk.0.attn_qkv.weight").unwrap().ggml_type,
            GgmlType::Q6K
        );
        assert_eq!(
            next.tensor("blk.9.attn_qkv.weight").unwrap().ggml_type,
            GgmlType::Q4K
        );
        assert_eq!(
            next.tensor("blk.0.attn_gate.weight").unwrap().ggml_type,
            GgmlType::Q4K
        );
        assert_eq!(
            next.tensor("blk.0.ffn_down_shexp.weight")
                .unwrap()
                .ggml_type,
            GgmlType::Q6K
        );
        assert_eq!(
            next.tensor("blk.48.attn_v.weight").unwrap().ggml_type,
            GgmlType::Q6K
        );
        assert_eq!(
            next.tensor("blk.48.ffn_down_exps.weight")
                .unwrap()
                .ggml_type,
            GgmlType::Q6K
        );
    }

    #[test]
    fn overrides_and_fallback_apply() {
        let mut r = QuantRecipe::preset("Q4_K_M").unwrap();
        r.overrides.push(TensorOverride {
            pattern: "blk.*.ffn_down_exps.weight".into(),
            ggml_type: GgmlType::Q5K,
        });
        r.overrides.push(TensorOverride {
            pattern: "*ffn_gate_inp.weight".into(),
            ggml_type: GgmlType::Q8_0,
        });
        let t = expected_tensors("qwen3moe", &qwen3_30b(), &r).unwrap();
        let get = |n: &str| t.iter().find(|x| x.name == n).unwrap().ggml_type;
        assert_eq!(get("blk.0.ffn_down_exps.weight"), GgmlType::Q5K);
        // The router is never quantized, as in llama-quantize.
        assert_eq!(get("blk.0.ffn_gate_inp.weight"), GgmlType::F32);
        // A width that no 256-block type holds falls back like llama.cpp.
        let mut hp = qwen3_30b();
        hp.n_ff_exp = 1408;
        let t = expected_tensors("qwen3moe", &hp, &QuantRecipe::preset("Q4_K_M").unwrap()).unwrap();
        let down = t
            .iter()
            .find(|x| x.name == "blk.10.ffn_down_exps.weight")
            .unwrap();
        assert_eq!(down.ggml_type, GgmlType::Q5_0);
        assert_eq!(down.dims, vec![1408, 2048, 128]);
        let down = t
            .iter()
            .find(|x| x.name == "blk.0.ffn_down_exps.weight")
            .unwrap();
        assert_eq!(down.ggml_type, GgmlType::Q8_0);
    }

    #[test]
    fn check_tensors_catches_missing_extra_and_misshaped() {
        for (arch, hp) in [("qwen3moe", qwen3_30b()), ("qwen3next", qwen3_next())] {
            let good = expected_tensors(arch, &hp, &QuantRecipe::preset("Q8_0").unwrap()).unwrap();
            assert_eq!(check_tensors(arch, &hp, &good), Ok(()));

            let mut missing = good.clone();
            let gone = missing.remove(5).name;
            assert_eq!(
                check_tensors(arch, &hp, &missing),
                Err(InventoryError::Missing {
                    arch: arch.into(),
                    tensor: gone
                })
            );

            let mut extra = good.clone();
            extra.push(
                TensorInfo::new(
                    "blk.0.bogus.weight",
                    vec![32],
                    GgmlType::F32,
                    TensorRole::Dense,
                    Some(0),
                )
                .unwrap(),
            );
            assert_eq!(
                check_tensors(arch, &hp, &extra),
                Err(InventoryError::Unexpected {
                    arch: arch.into(),
                    tensor: "blk.0.bogus.weight".into()
                })
            );

            let mut wrong = good.clone();
            let i = wrong
                .iter()
                .position(|t| t.name == "blk.1.ffn_up_exps.weight")
                .unwrap();
            wrong[i].dims = vec![2048, 100, hp.n_expert];
            match check_tensors(arch, &hp, &wrong) {
                Err(InventoryError::WrongShape {
                    tensor,
                    found,
                    expected,
                    ..
                }) => {
                    assert_eq!(tensor, "blk.1.ffn_up_exps.weight");
                    assert_eq!(found, vec![2048, 100, hp.n_expert]);
                    assert_eq!(expected, vec![2048, hp.n_ff_exp, hp.n_expert]);
                }
                other => panic!("{other:?}"),
            }

            // Trailing 1s are the same shape, as llama.cpp reads them.
            let mut padded = good.clone();
            padded[1].dims.push(1);
            assert_eq!(check_tensors(arch, &hp, &padded), Ok(()));
        }
    }

    #[test]
    fn bad_hparams_name_the_key() {
        let mut hp = qwen3_30b();
        hp.n_expert_used = 200;
        assert!(matches!(
            validate_hparams("qwen3moe", &hp),
            Err(InventoryError::BadHParam { key, .. }) if key == "n_expert_used"
        ));
        let mut hp = qwen3_30b();
        hp.n_head_kv = 5;
        assert!(matches!(
            validate_hparams("qwen3moe", &hp),
            Err(InventoryError::BadHParam { key, .. }) if key == "n_head_kv"
        ));
        let mut hp = qwen3_next();
        hp.ssm = None;
        assert!(matches!(
            expected_shapes("qwen3next", &hp),
            Err(InventoryError::BadHParam { key, .. }) if key == "ssm"
        ));
        assert!(matches!(
            expected_shapes("llama", &qwen3_30b()),
            Err(InventoryError::UnsupportedArch { .. })
        ));
        let mut hp = qwen3_30b();
        hp.n_embd = u64::MAX;
        assert!(validate_hparams("qwen3moe", &hp).is_err());
    }
}
