//! Quant recipes: which ggml type each tensor of a synthesized or requantized model gets, as
//! `llama-quantize` decides it (llama-quant.cpp's `llama_tensor_get_type` for qwen3moe and
//! qwen3next: the arch is not Falcon, the expert count is not 8, no importance matrix), plus
//! an unsloth-style dynamic mix and user overrides.
//! Invariant: `type_for` is a pure function of (recipe, tensor spec, block count, GQA ratio);
//! every type it returns holds the tensor's rows (llama.cpp's fallback table, then F16).

use super::{Kind, Spec};
use crate::ggml::GgmlType;
use serde::{Deserialize, Serialize};

/// One per-tensor-name override: the first pattern that matches wins (like llama-quantize's
/// `--tensor-type`). Patterns are globs over the full tensor name where `*` matches any run of
/// characters (`blk.*.ffn_down_exps.weight`, `*attn_v*`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorOverride {
    pub pattern: String,
    #[serde(rename = "type")]
    pub ggml_type: GgmlType,
}

/// Which tensors an early-block bump applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BumpTarget {
    /// llama.cpp's attn_v-like tensors: `attn_v`, and linear attention's fused `attn_qkv`.
    AttnV,
    /// Every `ffn_down*` tensor: routed experts and the shared expert.
    FfnDown,
}

/// How many leading blocks an early-block bump covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockLimit {
    /// Blocks `i < n`.
    Count(u32),
    /// Blocks `i < n_blocks / d` (integer division, MTP blocks counted in `n_blocks`).
    Fraction(u32),
}

/// llama.cpp's "more bits for the first blocks" rules (Q3_K_M: the first two attn_v and the
/// first sixteenth of ffn_down at Q5_K; IQ3_M / IQ4_XS: the first eighth of ffn_down).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FirstBlocks {
    pub target: BumpTarget,
    pub below: BlockLimit,
    #[serde(rename = "type")]
    pub ggml_type: GgmlType,
}

/// Per-role ggml types for synthesizing a quantized model, with llama.cpp's rules.
///
/// Rules, in order, for each tensor:
/// 1. Tensors llama.cpp never quantizes keep a float type: 1-D tensors (norms, `ssm_a`,
///    `ssm_dt.bias`, `ffn_gate_inp_shexp`) and `ssm_conv1d` take `norms` (F32 in every preset:
///    the converter writes them F32 and `llama-quantize` skips them); the router
///    `ffn_gate_inp` takes `router` (F32 in every preset, likewise never quantized).
/// 2. Otherwise the first matching `overrides` pattern decides.
/// 3. Otherwise the role's field: `embedding`, `head`, `attention` (full-attention q/k/v/o),
///    `ssm` (linear-attention projections `attn_qkv`, `attn_gate`, `ssm_ba`, `ssm_out`,
///    legacy `ssm_in`), `expert_gate_up`, `expert_down`, `shared_expert`, and `default` for
///    anything else (the MTP `nextn.eh_proj`); `attention_v` (attn_v-like: `attn_v`,
///    `attn_qkv`, when the GQA ratio n_head / n_head_kv is at least `attention_v_min_gqa`),
///    `attention_output` and `shared_down` refine those roles when set.
/// 4. The first `first_blocks` rule whose target and block range match replaces that type.
///    Otherwise llama.cpp's `use_more_bits` bump: when `more_bits` is set and has more bits
///    per weight, attn_v-like tensors and every `ffn_down*` tensor of blocks `i < n/8 ||
///    i >= 7n/8 || (i - n/8) % 3 == 2` (n = all blocks, MTP included) take it (Q4_K_M: Q6_K).
/// 5. Fallback when the type cannot hold a row (`ne0` not a multiple of its block), as
///    llama.cpp's `tensor_type_fallback`: IQ1/IQ2/IQ3/IQ4_XS -> IQ4_NL, Q2_K/Q3_K/TQ -> Q4_0,
///    Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; and F16 if that still does not fit (or for
///    any other type that does not fit).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuantRecipe {
    /// Preset name this recipe started from (for reports).
    pub preset: String,
    pub default: GgmlType,
    pub embedding: GgmlType,
    pub head: GgmlType,
    pub attention: GgmlType,
    pub expert_gate_up: GgmlType,
    pub expert_down: GgmlType,
    pub shared_expert: GgmlType,
    pub ssm: GgmlType,
    /// MoE router (`ffn_gate_inp`); F32 in every preset.
    pub router: GgmlType,
    /// 1-D tensors and `ssm_conv1d`; F32 in every preset.
    pub norms: GgmlType,
    /// llama.cpp's `use_more_bits` bump for attn_v-like and ffn_down tensors (Q4_K_M: Q6_K).
    pub more_bits: Option<GgmlType>,
    #[serde(default)]
    pub overrides: Vec<TensorOverride>,
    /// attn_v-like tensors (`attn_v`, `attn_qkv`), when the GQA ratio allows (see below).
    #[serde(default)]
    pub attention_v: Option<GgmlType>,
    /// `attention_v` applies only when n_head / n_head_kv is at least this (0: always).
    #[serde(default)]
    pub attention_v_min_gqa: u64,
    /// `attn_output` (default: `attention`).
    #[serde(default)]
    pub attention_output: Option<GgmlType>,
    /// The shared expert's `ffn_down_shexp` (default: `shared_expert`).
    #[serde(default)]
    pub shared_down: Option<GgmlType>,
    /// Early-block bumps, first match wins (they take precedence over `more_bits`).
    #[serde(default)]
    pub first_blocks: Vec<FirstBlocks>,
}

/// Preset names [`QuantRecipe::preset`] accepts.
pub const PRESETS: &[&str] = &[
    "Q4_K_M",
    "Q5_K_M",
    "Q3_K_M",
    "IQ3_M",
    "IQ3_S",
    "IQ4_XS",
    "Q4_0",
    "Q8_0",
    "Q4_K",
    "UD-Q4_K_XL",
    "BF16",
    "F16",
    "F32",
];

/// The model facts the rules depend on besides the tensor itself.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RecipeCtx {
    /// All blocks, MTP blocks included (llama.cpp's `n_layer_all`).
    pub n_blocks: u32,
    /// n_head / n_head_kv (0 when unknown).
    pub gqa: u64,
}

impl QuantRecipe {
    /// A recipe with every role at `t` (norms and router F32, no bump).
    fn uniform(preset: &str, t: GgmlType) -> Self {
        Self {
            preset: preset.to_string(),
            default: t,
            embedding: t,
            head: t,
            attention: t,
            expert_gate_up: t,
            expert_down: t,
            shared_expert: t,
            ssm: t,
            router: GgmlType::F32,
            norms: GgmlType::F32,
            more_bits: None,
            overrides: Vec::new(),
            attention_v: None,
            attention_v_min_gqa: 0,
            attention_output: None,
            shared_down: None,
            first_blocks: Vec::new(),
        }
    }

    /// `uniform` with llama.cpp's head rule for every quantized mix but Q8_0: Q6_K.
    fn mix(preset: &str, t: GgmlType) -> Self {
        Self {
            head: GgmlType::Q6K,
            ..Self::uniform(preset, t)
        }
    }

    /// A named preset (case-insensitive). Each llama.cpp mix is `llama-quantize`'s choice for
    /// qwen3moe / qwen3next without an importance matrix:
    ///
    /// | preset  | what it chooses |
    /// |---------|-----------------|
    /// | Q4_K_M  | Q4_K (embedding too), head Q6_K, Q6_K for attn_v-like and `ffn_down*` of the `use_more_bits` blocks |
    /// | Q5_K_M  | the same with Q5_K |
    /// | Q3_K_M  | Q3_K, head Q6_K, attn_v-like Q4_K (first two blocks Q5_K), `attn_output` Q4_K, `ffn_down*` Q4_K (first sixteenth Q5_K) |
    /// | IQ3_M   | IQ3_S, head Q6_K, attn_v-like and `attn_output` Q4_K, `ffn_down*` of the first eighth Q4_K |
    /// | IQ3_S   | IQ3_S, head Q6_K, attn_v-like Q4_K when n_head / n_head_kv >= 4 |
    /// | IQ4_XS  | IQ4_XS, head Q6_K, attn_v-like Q5_K when n_head / n_head_kv >= 4, `ffn_down*` of the first eighth Q5_K |
    /// | Q4_0    | Q4_0, head Q6_K |
    /// | Q8_0    | Q8_0 everywhere, head included |
    /// | Q4_K    | "pure" Q4_K (`llama-quantize --pure`): every quantizable tensor Q4_K, head included |
    /// | UD-Q4_K_XL | an unsloth-style dynamic mix (our approximation, not a llama.cpp ftype): attention, linear attention, shared expert and MTP projection Q8_0, embedding Q4_K, head Q6_K, routed experts gate/up Q4_K and down Q5_K (Q6_K in the `use_more_bits` blocks) |
    /// | F16, BF16, F32 | every matrix in that type |
    ///
    /// Norms, 1-D tensors, `ssm_conv1d` and the router stay F32 in every preset.
    pub fn preset(name: &str) -> Option<Self> {
        use GgmlType::*;
        let upper = name.to_ascii_uppercase();
        let first = |target, below, ggml_type| FirstBlocks {
            target,
            below,
            ggml_type,
        };
        let r = match upper.as_str() {
            "Q4_K_M" => Self {
                more_bits: Some(Q6K),
                ..Self::mix("Q4_K_M", Q4K)
            },
            "Q5_K_M" => Self {
                more_bits: Some(Q6K),
                ..Self::mix("Q5_K_M", Q5K)
            },
            "Q3_K_M" => Self {
                attention_v: Some(Q4K),
                attention_output: Some(Q4K),
                expert_down: Q4K,
                shared_down: Some(Q4K),
                first_blocks: vec![
                    first(BumpTarget::AttnV, BlockLimit::Count(2), Q5K),
                    first(BumpTarget::FfnDown, BlockLimit::Fraction(16), Q5K),
                ],
                ..Self::mix("Q3_K_M", Q3K)
            },
            "IQ3_M" => Self {
                attention_v: Some(Q4K),
                attention_output: Some(Q4K),
                first_blocks: vec![first(BumpTarget::FfnDown, BlockLimit::Fraction(8), Q4K)],
                ..Self::mix("IQ3_M", Iq3S)
            },
            "IQ3_S" => Self {
                attention_v: Some(Q4K),
                attention_v_min_gqa: 4,
                ..Self::mix("IQ3_S", Iq3S)
            },
            "IQ4_XS" => Self {
                attention_v: Some(Q5K),
                attention_v_min_gqa: 4,
                first_blocks: vec![first(BumpTarget::FfnDown, BlockLimit::Fraction(8), Q5K)],
                ..Self::mix("IQ4_XS", Iq4Xs)
            },
            "Q4_0" => Self::mix("Q4_0", Q4_0),
            "Q8_0" => Self::uniform("Q8_0", Q8_0),
            "Q4_K" => Self::uniform("Q4_K", Q4K),
            "UD-Q4_K_XL" => Self {
                default: Q8_0,
                attention: Q8_0,
                ssm: Q8_0,
                shared_expert: Q8_0,
                expert_down: Q5K,
                more_bits: Some(Q6K),
                ..Self::mix("UD-Q4_K_XL", Q4K)
            },
            "F16" => Self::uniform("F16", F16),
            "BF16" => Self::uniform("BF16", BF16),
            "F32" => Self::uniform("F32", F32),
            _ => return None,
        };
        Some(r)
    }

    /// The type the tensor `spec` gets (see the struct docs for the rules).
    pub(crate) fn type_for(&self, spec: &Spec, ctx: RecipeCtx) -> GgmlType {
        let ne0 = spec.dims.first().copied().unwrap_or(1);
        let t = self.choose(spec, ctx);
        fallback(t, ne0)
    }

    /// The role's type before any block-dependent bump.
    fn base(&self, kind: Kind, gqa: u64) -> GgmlType {
        let attn_v = self
            .attention_v
            .filter(|_| self.attention_v_min_gqa == 0 || gqa >= self.attention_v_min_gqa);
        match kind {
            Kind::Embedding => self.embedding,
            Kind::Head => self.head,
            Kind::Attention => self.attention,
            Kind::AttentionOutput => self.attention_output.unwrap_or(self.attention),
            Kind::AttentionV => attn_v.unwrap_or(self.attention),
            Kind::LinearQkv => attn_v.unwrap_or(self.ssm),
            Kind::Linear => self.ssm,
            Kind::ExpertGateUp => self.expert_gate_up,
            Kind::ExpertDown => self.expert_down,
            Kind::SharedGateUp => self.shared_expert,
            Kind::SharedDown => self.shared_down.unwrap_or(self.shared_expert),
            Kind::Other => self.default,
            Kind::Norm | Kind::ConvKernel => self.norms,
            Kind::Router => self.router,
        }
    }

    fn choose(&self, spec: &Spec, ctx: RecipeCtx) -> GgmlType {
        if n_dims(&spec.dims) < 2 || spec.kind == Kind::ConvKernel {
            return self.norms;
        }
        if spec.kind == Kind::Router {
            return self.router;
        }
        if let Some(o) = self
            .overrides
            .iter()
            .find(|o| glob_match(&o.pattern, &spec.name))
        {
            return o.ggml_type;
        }
        let base = self.base(spec.kind, ctx.gqa);
        let target = match spec.kind {
            Kind::AttentionV | Kind::LinearQkv => BumpTarget::AttnV,
            Kind::ExpertDown | Kind::SharedDown => BumpTarget::FfnDown,
            _ => return base,
        };
        let Some(layer) = spec.layer else {
            return base;
        };
        for f in &self.first_blocks {
            let below = match f.below {
                BlockLimit::Count(n) => n,
                BlockLimit::Fraction(d) => ctx.n_blocks / d.max(1),
            };
            if f.target == target && layer < below {
                return f.ggml_type;
            }
        }
        match self.more_bits {
            Some(more)
                if use_more_bits(layer, ctx.n_blocks)
                    && more.bits_per_weight() > base.bits_per_weight() =>
            {
                more
            }
            _ => base,
        }
    }
}

/// llama.cpp's `use_more_bits(i, n)`.
pub(crate) fn use_more_bits(i: u32, n: u32) -> bool {
    let (i, n) = (i64::from(i), i64::from(n));
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// ggml_n_dims: dims after dropping trailing 1s (at least 1).
pub(crate) fn n_dims(dims: &[u64]) -> usize {
    dims.iter().rposition(|d| *d != 1).map_or(1, |p| p + 1)
}

/// llama.cpp's `tensor_type_fallback`, plus F16 for any type that cannot hold the row.
pub fn fallback(t: GgmlType, ne0: u64) -> GgmlType {
    use GgmlType::*;
    if ne0 % t.block_elems() == 0 {
        return t;
    }
    let next = match t {
        Iq1S | Iq1M | Iq2Xxs | Iq2Xs | Iq2S | Iq3Xxs | Iq3S | Iq4Xs => Iq4Nl,
        Q2K | Q3K | Tq1_0 | Tq2_0 => Q4_0,
        Q4K => Q5_0,
        Q5K => Q5_1,
        Q6K => Q8_0,
        _ => F16,
    };
    if ne0 % next.block_elems() == 0 {
        next
    } else {
        F16
    }
}

/// Glob match where `*` matches any (possibly empty) run of characters.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let p = pattern.as_bytes();
    let n = name.as_bytes();
    let (mut pi, mut ni) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, ni));
            pi += 1;
        } else if pi < p.len() && p[pi] == n[ni] {
            pi += 1;
            ni += 1;
        } else if let Some((sp, sn)) = star {
            pi = sp + 1;
            ni = sn + 1;
            star = Some((sp, sn + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::expected_tensors;
    use crate::known::{qwen3_30b_a3b, qwen3_next_80b_a3b};
    use GgmlType::*;

    /// The type of tensor `name` in `preset`'s qwen3moe (Qwen3-30B-A3B: 48 blocks, GQA 8)
    /// or qwen3next (Qwen3-Next-80B-A3B: 48 blocks + MTP, GQA 8) inventory.
    fn ty(arch: &str, preset: &str, name: &str) -> GgmlType {
        let hp = match arch {
            "qwen3moe" => qwen3_30b_a3b(),
            _ => qwen3_next_80b_a3b(),
        };
        let t = expected_tensors(arch, &hp, &QuantRecipe::preset(preset).unwrap()).unwrap();
        t.iter()
            .find(|x| x.name == name)
            .unwrap_or_else(|| panic!("{name}"))
            .ggml_type
    }

    #[test]
    fn llama_cpp_mixes_for_qwen3moe() {
        let m = |p: &str, n: &str| ty("qwen3moe", p, n);
        // Q5_K_M: Q4_K_M's shape with Q5_K.
        assert_eq!(m("Q5_K_M", "blk.0.attn_v.weight"), Q6K);
        assert_eq!(m("Q5_K_M", "blk.6.attn_v.weight"), Q5K);
        assert_eq!(m("Q5_K_M", "blk.8.ffn_down_exps.weight"), Q6K);
        assert_eq!(m("Q5_K_M", "blk.9.ffn_down_exps.weight"), Q5K);
        assert_eq!(m("Q5_K_M", "output.weight"), Q6K);
        // Q3_K_M: attn_v Q5_K for blocks 0-1 then Q4_K; ffn_down Q5_K below 48/16 = 3.
        assert_eq!(m("Q3_K_M", "blk.1.attn_v.weight"), Q5K);
        assert_eq!(m("Q3_K_M", "blk.2.attn_v.weight"), Q4K);
        assert_eq!(m("Q3_K_M", "blk.2.ffn_down_exps.weight"), Q5K);
        assert_eq!(m("Q3_K_M", "blk.3.ffn_down_exps.weight"), Q4K);
        assert_eq!(m("Q3_K_M", "blk.3.attn_output.weight"), Q4K);
        assert_eq!(m("Q3_K_M", "blk.3.attn_q.weight"), Q3K);
        assert_eq!(m("Q3_K_M", "blk.3.ffn_up_exps.weight"), Q3K);
        assert_eq!(m("Q3_K_M", "token_embd.weight"), Q3K);
        // IQ3_M: attn_v / attn_output Q4_K, ffn_down Q4_K below 48/8 = 6.
        assert_eq!(m("IQ3_M", "blk.20.attn_v.weight"), Q4K);
        assert_eq!(m("IQ3_M", "blk.20.attn_output.weight"), Q4K);
        assert_eq!(m("IQ3_M", "blk.5.ffn_down_exps.weight"), Q4K);
        assert_eq!(m("IQ3_M", "blk.6.ffn_down_exps.weight"), Iq3S);
        assert_eq!(m("IQ3_M", "blk.6.ffn_gate_exps.weight"), Iq3S);
        assert_eq!(m("IQ3_M", "output.weight"), Q6K);
        // IQ4_XS: attn_v Q5_K (GQA 8), ffn_down Q5_K below 6.
        assert_eq!(m("IQ4_XS", "blk.30.attn_v.weight"), Q5K);
        assert_eq!(m("IQ4_XS", "blk.0.ffn_down_exps.weight"), Q5K);
        assert_eq!(m("IQ4_XS", "blk.30.ffn_down_exps.weight"), Iq4Xs);
        assert_eq!(m("IQ4_XS", "token_embd.weight"), Iq4Xs);
        // Q4_0: everything Q4_0 but the head; Q8_0 keeps its head Q8_0.
        assert_eq!(m("Q4_0", "blk.0.ffn_down_exps.weight"), Q4_0);
        assert_eq!(m("Q4_0", "output.weight"), Q6K);
        assert_eq!(m("Q8_0", "output.weight"), Q8_0);
        // Norms and the router stay F32 in every mix.
        for p in PRESETS {
            assert_eq!(m(p, "blk.0.ffn_gate_inp.weight"), F32, "{p}");
            assert_eq!(m(p, "blk.0.attn_norm.weight"), F32, "{p}");
        }
    }

    #[test]
    fn llama_cpp_mixes_for_qwen3next_and_the_gqa_rule() {
        let n = |p: &str, name: &str| ty("qwen3next", p, name);
        // attn_qkv is attn_v-like in every mix; attn_gate and ssm_out are "other".
        assert_eq!(n("IQ3_S", "blk.0.attn_qkv.weight"), Q4K);
        assert_eq!(n("IQ3_S", "blk.0.attn_gate.weight"), Iq3S);
        assert_eq!(n("IQ4_XS", "blk.1.attn_qkv.weight"), Q5K);
        assert_eq!(n("Q3_K_M", "blk.0.attn_qkv.weight"), Q5K);
        assert_eq!(n("Q3_K_M", "blk.5.attn_qkv.weight"), Q4K);
        assert_eq!(n("Q3_K_M", "blk.5.ffn_down_shexp.weight"), Q4K);
        assert_eq!(n("Q3_K_M", "blk.5.ffn_up_shexp.weight"), Q3K);
        // 49 blocks with the MTP block: the first eighth is blocks 0..6.
        assert_eq!(n("IQ3_M", "blk.5.ffn_down_exps.weight"), Q4K);
        assert_eq!(n("IQ3_M", "blk.6.ffn_down_exps.weight"), Iq3S);
        // The unsloth-style mix: dense work Q8_0, experts low.
        assert_eq!(n("UD-Q4_K_XL", "blk.3.attn_q.weight"), Q8_0);
        assert_eq!(n("UD-Q4_K_XL", "blk.0.attn_qkv.weight"), Q8_0);
        assert_eq!(n("UD-Q4_K_XL", "blk.0.ffn_up_shexp.weight"), Q8_0);
        assert_eq!(n("UD-Q4_K_XL", "blk.48.nextn.eh_proj.weight"), Q8_0);
        assert_eq!(n("UD-Q4_K_XL", "blk.10.ffn_gate_exps.weight"), Q4K);
        assert_eq!(n("UD-Q4_K_XL", "blk.10.ffn_down_exps.weight"), Q5K);
        assert_eq!(n("UD-Q4_K_XL", "blk.0.ffn_down_exps.weight"), Q6K);
        assert_eq!(n("UD-Q4_K_XL", "output.weight"), Q6K);
        // GQA below 4: IQ3_S keeps attn_v at IQ3_S (llama.cpp's n_gqa() >= 4 condition).
        let mut hp = qwen3_30b_a3b();
        hp.n_head_kv = hp.n_head / 2;
        let r = QuantRecipe::preset("IQ3_S").unwrap();
        let t = expected_tensors("qwen3moe", &hp, &r).unwrap();
        let v = t.iter().find(|x| x.name == "blk.0.attn_v.weight").unwrap();
        assert_eq!(v.ggml_type, Iq3S);
    }

    #[test]
    fn recipes_round_trip_through_toml() {
        let r = QuantRecipe::preset("Q3_K_M").unwrap();
        let text = toml::to_string(&r).unwrap();
        let back: QuantRecipe = toml::from_str(&text).unwrap();
        assert_eq!(back, r);
    }
}
