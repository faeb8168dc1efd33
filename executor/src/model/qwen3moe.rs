//! The Qwen3-MoE forward pass, written once over the backend seam, as transformers'
//! `Qwen3MoeForCausalLM` computes it: embedding, per layer RMSNorm, Q/K/V projections,
//! per-head Q/K RMSNorm, NEOX RoPE (optionally YaRN), causal GQA over each slot's KV, the
//! output projection added into the residual, then RMSNorm, a softmax router with top-k
//! (`norm_topk_prob`) and SwiGLU experts (or a dense SwiGLU FFN) added into the residual;
//! the output norm and the LM head.
//! Invariant: every tensor is bound and every shape checked in [`Qwen3Moe::bind`], before
//! the first pass; a pass reads and writes only the named working buffers below.

use super::{Forward, ModelError};
use crate::backend::{Attention, Bind, Ops, Route, WorkBuf};
use strata_schemas::dims::Dims;
use strata_schemas::inventory::{HParams, LayerKind};

/// The architecture's name in model files.
pub const ARCH: &str = "qwen3moe";

/// Which part of the model a stage holds: blocks `[layer_first, layer_end)`, and the
/// embedding / output head when it is the first / last stage of a pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageSpec {
    pub layer_first: u32,
    pub layer_end: u32,
    pub embedding: bool,
    pub head: bool,
    /// Bind the MTP draft block (`blk.{n_layer}.*`, Qwen3-Next) on this stage (the last).
    pub mtp: bool,
}

impl StageSpec {
    /// The whole model.
    pub fn whole(n_layer: u32) -> Self {
        Self {
            layer_first: 0,
            layer_end: n_layer,
            embedding: true,
            head: true,
            mtp: false,
        }
    }
}

fn hp_err(key: &'static str, reason: impl Into<String>) -> ModelError {
    ModelError::HParam {
        key,
        reason: reason.into(),
    }
}

/// The dimensions of `hp`, checked for what this forward pass relies on.
pub fn check_dims(hp: &HParams) -> Result<Dims, ModelError> {
    let d = Dims::of(hp);
    let big = |key: &'static str, v: usize| {
        if v == usize::MAX {
            Err(hp_err(key, "does not fit in memory on this machine"))
        } else {
            Ok(())
        }
    };
    big("embedding_length", d.e)?;
    big("vocab_size", d.vocab)?;
    if d.e == 0 || d.vocab == 0 || d.hd == 0 || d.hd_v == 0 {
        return Err(hp_err(
            "embedding_length",
            "n_embd, n_vocab and head dims must be non-zero",
        ));
    }
    if d.n_head_kv == 0 || d.n_head % d.n_head_kv != 0 {
        return Err(hp_err(
            "attention.head_count_kv",
            format!("{} must divide head_count {}", d.n_head_kv, d.n_head),
        ));
    }
    if d.n_expert > 0 && (d.k == 0 || d.k > d.n_expert) {
        return Err(hp_err(
            "expert_used_count",
            format!("{} must be in 1..={}", d.k, d.n_expert),
        ));
    }
    if hp.n_ff_shexp > 0 {
        return Err(hp_err(
            "expert_shared_feed_forward_length",
            "qwen3moe has no shared expert; this model is another architecture",
        ));
    }
    if (0..hp.n_layer).any(|l| hp.layer_kind(l) != LayerKind::FullAttention) {
        return Err(hp_err(
            "full_attention_interval",
            "qwen3moe layers are all full attention; linear attention needs the qwen3next forward",
        ));
    }
    if d.n_rot % 2 != 0 || d.n_rot > d.hd || d.n_rot == 0 {
        return Err(hp_err(
            "rope.dimension_count",
            format!("{} must be even and in 2..={}", d.n_rot, d.hd),
        ));
    }
    if (0..hp.n_layer).any(|l| !hp.layer_has_experts(l)) && d.n_ff == 0 {
        return Err(hp_err(
            "feed_forward_length",
            "a layer has a dense FFN but the width is 0",
        ));
    }
    Ok(d)
}

enum Ffn<B: Ops> {
    Moe {
        router: B::Mat,
        experts: B::Experts,
    },
    Dense {
        gate: B::Mat,
        up: B::Mat,
        down: B::Mat,
    },
}

struct Layer<B: Ops> {
    /// The model's layer index.
    index: u32,
    attn_norm: B::Vector,
    q: B::Mat,
    k: B::Mat,
    v: B::Mat,
    o: B::Mat,
    q_norm: B::Vector,
    k_norm: B::Vector,
    ffn_norm: B::Vector,
    ffn: Ffn<B>,
}

/// One stage of a Qwen3-MoE model bound on a backend.
pub struct Qwen3Moe<B: Ops> {
    ends: super::Ends<B>,
    layers: Vec<Layer<B>>,
}

impl<B: Bind> Qwen3Moe<B> {
    /// Bind every tensor of `stage` on `b` (the dims checked by [`check_dims`]).
    pub fn bind(b: &mut B, d: &Dims, hp: &HParams, stage: StageSpec) -> Result<Self, B::Error> {
        let ends = super::Ends::bind(b, d, hp, stage.embedding, stage.head)?;
        let mut layers = Vec::with_capacity((stage.layer_end - stage.layer_first) as usize);
        for l in stage.layer_first..stage.layer_end {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            let ffn = if hp.layer_has_experts(l) {
                Ffn::Moe {
                    router: b.matrix(&n("ffn_gate_inp"), d.n_expert, d.e)?,
                    experts: b.experts_of(l)?,
                }
            } else {
                Ffn::Dense {
                    gate: b.matrix(&n("ffn_gate"), d.n_ff, d.e)?,
                    up: b.matrix(&n("ffn_up"), d.n_ff, d.e)?,
                    down: b.matrix(&n("ffn_down"), d.e, d.n_ff)?,
                }
            };
            layers.push(Layer {
                index: l,
                attn_norm: b.vector(&n("attn_norm"), d.e)?,
                q: b.matrix(&n("attn_q"), d.q_out(), d.e)?,
                k: b.matrix(&n("attn_k"), d.k_out(), d.e)?,
                v: b.matrix(&n("attn_v"), d.v_out(), d.e)?,
                o: b.matrix(&n("attn_output"), d.e, d.att_out())?,
                q_norm: b.vector(&n("attn_q_norm"), d.hd)?,
                k_norm: b.vector(&n("attn_k_norm"), d.hd)?,
                ffn_norm: b.vector(&n("ffn_norm"), d.e)?,
                ffn,
            });
        }
        Ok(Self { ends, layers })
    }
}

impl<B: Ops> Forward<B> for Qwen3Moe<B> {
    fn forward(&self, b: &mut B, n: usize) -> Result<(), B::Error> {
        use WorkBuf::*;
        b.pass_start(n)?;
        self.ends.embed(b, n)?;
        for (kv_layer, l) in self.layers.iter().enumerate() {
            b.rms_norm(X, 0, l.attn_norm, Xn, n)?;
            b.project(Xn, &[(l.q, Q), (l.k, K), (l.v, V)], n)?;
            b.attention(
                &Attention {
                    kv_layer,
                    q: Q,
                    k: K,
                    v: V,
                    q_norm: Some(l.q_norm),
                    k_norm: Some(l.k_norm),
                    out: Att,
                },
                n,
            )?;
            b.project_add(l.o, Att, X, n)?;
            match &l.ffn {
                Ffn::Moe { router, experts } => {
                    b.route(
                        &Route {
                            x: X,
                            norm: l.ffn_norm,
                            router: *router,
                            xn: Xn,
                            ids: Ids,
                            wts: Wts,
                        },
                        n,
                    )?;
                    b.experts(l.index, experts, Xn, Ids, Wts, X, n)?;
                }
                Ffn::Dense { gate, up, down } => {
                    b.rms_norm(X, 0, l.ffn_norm, Xn, n)?;
                    b.dense_ffn(*gate, *up, *down, Xn, X, n)?;
                }
            }
        }
        Ok(())
    }

    fn head(&self, b: &mut B, first: usize, rows: usize) -> Result<(), B::Error> {
        self.ends.head(b, first, rows)
    }

    fn holds_head(&self) -> bool {
        self.ends.holds_head()
    }
}
