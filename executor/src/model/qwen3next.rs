//! The Qwen3-Next forward pass, written once over the backend seam, as transformers'
//! `Qwen3NextForCausalLM` computes it (docs/QWEN3NEXT.md): per block an RMSNorm, then either a
//! Gated DeltaNet (`attn_qkv`/`attn_gate`/`ssm_ba` projections, conv + delta rule + gated norm
//! over the slot's linear state, `ssm_out`) or gated full attention (query and output gate from
//! `attn_q`, QK-norm, partial RoPE, GQA, `sigmoid(gate)` before `attn_output`), then a
//! post-attention RMSNorm, the top-k MoE and the sigmoid-gated shared expert; the output norm
//! and head. Norm weights are the GGUF ones (llama.cpp's converter stores HF's `1 + w`).
//! The MTP draft block (`blk.{n_layer}.*` with its `nextn.*` tensors, bound when the stage
//! speculates) runs as vLLM's `qwen3_next_mtp` does: `eh_proj([enorm(embed(x_{t+1})),
//! hnorm(h_t)])` (embedding first), where `h_t` is the final-normed hidden state (the main
//! model's `output_norm`, or the block's own `shared_head_norm` when drafts are chained), then
//! one gated-full-attention MoE block with its own KV layer, `shared_head_norm` and the head.
//! Invariant: every tensor is bound and every shape checked in [`Qwen3Next::bind`] before the
//! first pass; the main blocks and the MTP block run through the one [`block`] function.

use super::qwen3moe::StageSpec;
use super::{Forward, ModelError};
use crate::backend::{Attention, Bind, LinearAttention, Ops, Route, SharedFfn, WorkBuf};
use crate::model::MtpInput;
use strata_schemas::dims::Dims;
use strata_schemas::inventory::{HParams, LayerKind};

/// The architecture's name in model files.
pub const ARCH: &str = "qwen3next";

fn hp_err(key: &'static str, reason: impl Into<String>) -> ModelError {
    ModelError::HParam {
        key,
        reason: reason.into(),
    }
}

/// The dimensions of `hp`, checked for what this forward pass relies on.
pub fn check_dims(hp: &HParams) -> Result<Dims, ModelError> {
    let d = Dims::of(hp);
    if [d.e, d.vocab].contains(&usize::MAX) {
        return Err(hp_err(
            "embedding_length",
            "does not fit in memory on this machine",
        ));
    }
    if d.e == 0 || d.vocab == 0 || d.hd == 0 || d.hd != d.hd_v {
        return Err(hp_err(
            "attention.key_length",
            "n_embd, n_vocab and head dims must be non-zero, key and value head dims equal",
        ));
    }
    if d.n_head_kv == 0 || d.n_head % d.n_head_kv != 0 {
        return Err(hp_err(
            "attention.head_count_kv",
            format!("{} must divide head_count {}", d.n_head_kv, d.n_head),
        ));
    }
    if d.n_expert == 0 || d.k == 0 || d.k > d.n_expert {
        return Err(hp_err(
            "expert_used_count",
            format!("{} must be in 1..={} (qwen3next is MoE)", d.k, d.n_expert),
        ));
    }
    if d.n_ff_shexp == 0 {
        return Err(hp_err(
            "expert_shared_feed_forward_length",
            "qwen3next has a shared expert; its width must be non-zero",
        ));
    }
    if hp.n_leading_dense > 0 {
        return Err(hp_err(
            "leading_dense_block_count",
            "qwen3next has no dense blocks",
        ));
    }
    if !d.linear() || d.lin_k_heads == 0 || d.lin_v_heads % d.lin_k_heads != 0 {
        return Err(hp_err(
            "ssm.group_count",
            "qwen3next needs ssm.* keys with value heads a multiple of key heads",
        ));
    }
    if d.lin_hk == 0 || d.lin_hk != d.lin_hv || d.conv_k == 0 {
        return Err(hp_err(
            "ssm.state_size",
            "the linear key and value head dims must be equal and non-zero, the conv width too",
        ));
    }
    if d.n_rot % 2 != 0 || d.n_rot > d.hd || d.n_rot == 0 {
        return Err(hp_err(
            "rope.dimension_count",
            format!("{} must be even and in 2..={}", d.n_rot, d.hd),
        ));
    }
    Ok(d)
}

enum Mixer<B: Ops> {
    Full {
        /// Index among the stage's full-attention layers (its KV layer).
        kv_layer: usize,
        q: B::Mat,
        k: B::Mat,
        v: B::Mat,
        o: B::Mat,
        q_norm: B::Vector,
        k_norm: B::Vector,
    },
    Linear {
        /// Index among the stage's linear layers (its linear state).
        lin_layer: usize,
        qkv: B::Mat,
        z: B::Mat,
        ba: B::Mat,
        conv: B::Vector,
        dt_bias: B::Vector,
        ssm_a: B::Vector,
        norm: B::Vector,
        out: B::Mat,
    },
}

struct Layer<B: Ops> {
    index: u32,
    attn_norm: B::Vector,
    mixer: Mixer<B>,
    post_norm: B::Vector,
    router: B::Mat,
    experts: B::Experts,
    shared: SharedFfn<B::Mat, B::Vector>,
}

/// The MTP draft block (see the module docs).
struct MtpBlock<B: Ops> {
    embd: B::Mat,
    enorm: B::Vector,
    hnorm: B::Vector,
    eh_proj: B::Mat,
    /// The main model's final norm (the hidden states it drafts from are taken before it).
    out_norm: B::Vector,
    layer: Layer<B>,
    head_norm: B::Vector,
    head: B::Mat,
}

/// One stage of a Qwen3-Next model bound on a backend.
pub struct Qwen3Next<B: Ops> {
    ends: super::Ends<B>,
    layers: Vec<Layer<B>>,
    mtp: Option<MtpBlock<B>>,
}

/// The full-attention and linear-attention layer counts of `[first, end)`.
pub fn layer_counts(hp: &HParams, first: u32, end: u32) -> (usize, usize) {
    let lin = (first..end)
        .filter(|&l| hp.layer_kind(l) == LayerKind::LinearAttention)
        .count();
    ((end - first) as usize - lin, lin)
}

fn bind_full<B: Bind>(b: &mut B, d: &Dims, l: u32, kv_layer: usize) -> Result<Mixer<B>, B::Error> {
    let n = |s: &str| format!("blk.{l}.{s}.weight");
    Ok(Mixer::Full {
        kv_layer,
        q: b.matrix(&n("attn_q"), d.q_proj(), d.e)?,
        k: b.matrix(&n("attn_k"), d.k_out(), d.e)?,
        v: b.matrix(&n("attn_v"), d.v_out(), d.e)?,
        o: b.matrix(&n("attn_output"), d.e, d.att_out())?,
        q_norm: b.vector(&n("attn_q_norm"), d.hd)?,
        k_norm: b.vector(&n("attn_k_norm"), d.hd)?,
    })
}

fn bind_linear<B: Bind>(
    b: &mut B,
    d: &Dims,
    l: u32,
    lin_layer: usize,
) -> Result<Mixer<B>, B::Error> {
    let n = |s: &str| format!("blk.{l}.{s}.weight");
    Ok(Mixer::Linear {
        lin_layer,
        qkv: b.matrix(&n("attn_qkv"), d.lin_qkv(), d.e)?,
        z: b.matrix(&n("attn_gate"), d.lin_v(), d.e)?,
        ba: b.matrix(&n("ssm_ba"), 2 * d.lin_v_heads, d.e)?,
        conv: b.table(&n("ssm_conv1d"), d.lin_qkv(), d.conv_k)?,
        dt_bias: b.vector(&format!("blk.{l}.ssm_dt.bias"), d.lin_v_heads)?,
        ssm_a: b.vector(&format!("blk.{l}.ssm_a"), d.lin_v_heads)?,
        norm: b.vector(&n("ssm_norm"), d.lin_hv)?,
        out: b.matrix(&n("ssm_out"), d.e, d.lin_v())?,
    })
}

/// Block `l` (a main block or the MTP block) around its mixer: norms, router, experts and
/// the shared expert.
fn bind_layer<B: Bind>(b: &mut B, d: &Dims, l: u32, mixer: Mixer<B>) -> Result<Layer<B>, B::Error> {
    let n = |s: &str| format!("blk.{l}.{s}.weight");
    let sh = d.n_ff_shexp;
    Ok(Layer {
        index: l,
        attn_norm: b.vector(&n("attn_norm"), d.e)?,
        mixer,
        post_norm: b.vector(&n("post_attention_norm"), d.e)?,
        router: b.matrix(&n("ffn_gate_inp"), d.n_expert, d.e)?,
        experts: b.experts_of(l)?,
        shared: SharedFfn {
            gate_inp: b.vector(&n("ffn_gate_inp_shexp"), d.e)?,
            gate: b.matrix(&n("ffn_gate_shexp"), sh, d.e)?,
            up: b.matrix(&n("ffn_up_shexp"), sh, d.e)?,
            down: b.matrix(&n("ffn_down_shexp"), d.e, sh)?,
        },
    })
}

/// The MTP block `blk.{n_layer}` with its own KV layer `kv_layer`: its embedding and head
/// are `nextn.embed_tokens` / `nextn.shared_head_head` when the file has them, else the main
/// model's (Qwen3-Next shares them).
fn bind_mtp<B: Bind>(
    b: &mut B,
    d: &Dims,
    hp: &HParams,
    kv_layer: usize,
) -> Result<MtpBlock<B>, B::Error> {
    let l = hp.n_layer;
    let x = |s: &str| format!("blk.{l}.nextn.{s}.weight");
    let embd = if b.has(&x("embed_tokens")) {
        x("embed_tokens")
    } else {
        "token_embd.weight".into()
    };
    let head = if b.has(&x("shared_head_head")) {
        x("shared_head_head")
    } else if b.has("output.weight") || !hp.tied_embeddings {
        "output.weight".into()
    } else {
        "token_embd.weight".into()
    };
    let mixer = bind_full(b, d, l, kv_layer)?;
    Ok(MtpBlock {
        embd: b.matrix(&embd, d.vocab, d.e)?,
        enorm: b.vector(&x("enorm"), d.e)?,
        hnorm: b.vector(&x("hnorm"), d.e)?,
        eh_proj: b.matrix(&x("eh_proj"), d.e, 2 * d.e)?,
        out_norm: b.vector("output_norm.weight", d.e)?,
        layer: bind_layer(b, d, l, mixer)?,
        head_norm: b.vector(&x("shared_head_norm"), d.e)?,
        head: b.matrix(&head, d.vocab, d.e)?,
    })
}

impl<B: Bind> Qwen3Next<B> {
    /// Bind every tensor of `stage` on `b` (the dims checked by [`check_dims`]); the MTP
    /// block's attention is the stage's KV layer after its main full-attention layers.
    pub fn bind(b: &mut B, d: &Dims, hp: &HParams, stage: StageSpec) -> Result<Self, B::Error> {
        let ends = super::Ends::bind(b, d, hp, stage.embedding, stage.head)?;
        let (mut kv_layer, mut lin_layer) = (0, 0);
        let mut layers = Vec::with_capacity((stage.layer_end - stage.layer_first) as usize);
        for l in stage.layer_first..stage.layer_end {
            let mixer = match hp.layer_kind(l) {
                LayerKind::LinearAttention => {
                    lin_layer += 1;
                    bind_linear(b, d, l, lin_layer - 1)?
                }
                _ => {
                    kv_layer += 1;
                    bind_full(b, d, l, kv_layer - 1)?
                }
            };
            layers.push(bind_layer(b, d, l, mixer)?);
        }
        let mtp = if stage.mtp {
            Some(bind_mtp(b, d, hp, kv_layer)?)
        } else {
            None
        };
        Ok(Self { ends, layers, mtp })
    }
}

/// One block over the `n` tokens of the pass: its norm, mixer, the routed and the shared
/// experts, each adding into `x`.
fn block<B: Ops>(b: &mut B, l: &Layer<B>, n: usize) -> Result<(), B::Error> {
    use WorkBuf::*;
    b.rms_norm(X, 0, l.attn_norm, Xn, n)?;
    match &l.mixer {
        Mixer::Full {
            kv_layer,
            q,
            k,
            v,
            o,
            q_norm,
            k_norm,
        } => {
            b.project(Xn, &[(*q, Qg), (*k, K), (*v, V)], n)?;
            b.split_query_gate(Qg, Q, Gate, n)?;
            b.attention(
                &Attention {
                    kv_layer: *kv_layer,
                    q: Q,
                    k: K,
                    v: V,
                    q_norm: Some(*q_norm),
                    k_norm: Some(*k_norm),
                    out: Att,
                },
                n,
            )?;
            b.sigmoid_gate(Att, Gate, n)?;
            b.project_add(*o, Att, X, n)?;
        }
        Mixer::Linear {
            lin_layer,
            qkv,
            z,
            ba,
            conv,
            dt_bias,
            ssm_a,
            norm,
            out,
        } => {
            b.project(Xn, &[(*qkv, Qkv), (*z, Z), (*ba, Ba)], n)?;
            b.linear_attention(
                &LinearAttention {
                    lin_layer: *lin_layer,
                    qkv: Qkv,
                    z: Z,
                    ba: Ba,
                    conv: *conv,
                    dt_bias: *dt_bias,
                    ssm_a: *ssm_a,
                    norm: *norm,
                    out: Lin,
                },
                n,
            )?;
            b.project_add(*out, Lin, X, n)?;
        }
    }
    // The routed experts and the shared expert both read xn (the post-attention norm of x
    // before either adds into it): the route op writes xn, the experts add into x, and the
    // shared expert reads the same xn.
    b.route(
        &Route {
            x: X,
            norm: l.post_norm,
            router: l.router,
            xn: Xn,
            ids: Ids,
            wts: Wts,
        },
        n,
    )?;
    b.experts(l.index, &l.experts, Xn, Ids, Wts, X, n)?;
    b.shared_expert(&l.shared, Xn, X, n)
}

impl<B: Ops> Forward<B> for Qwen3Next<B> {
    fn forward(&self, b: &mut B, n: usize) -> Result<(), B::Error> {
        b.pass_start(n)?;
        self.ends.embed(b, n)?;
        for l in &self.layers {
            block(b, l, n)?;
        }
        Ok(())
    }

    fn head(&self, b: &mut B, first: usize, rows: usize) -> Result<(), B::Error> {
        self.ends.head(b, first, rows)
    }

    fn holds_head(&self) -> bool {
        self.ends.holds_head()
    }

    fn recurrent(&self) -> bool {
        self.layers
            .iter()
            .any(|l| matches!(l.mixer, Mixer::Linear { .. }))
    }

    fn holds_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    fn mtp(
        &self,
        b: &mut B,
        n: usize,
        input: MtpInput,
        head: Option<(usize, usize)>,
    ) -> Result<(), B::Error> {
        use WorkBuf::*;
        let Some(m) = &self.mtp else {
            return Ok(());
        };
        b.pass_start(n)?;
        // The hidden states' final norm: the main model's, or the block's own when chained.
        let final_norm = match input {
            MtpInput::Main => m.out_norm,
            MtpInput::Chained => m.head_norm,
        };
        b.rms_norm(MtpHidden, 0, final_norm, Xn, n)?;
        b.rms_norm(Xn, 0, m.hnorm, X, n)?;
        b.embed(m.embd, Xn, n)?;
        b.rms_norm(Xn, 0, m.enorm, MtpHidden, n)?;
        b.concat_rows(MtpHidden, X, MtpCat, n)?;
        b.project(MtpCat, &[(m.eh_proj, X)], n)?;
        block(b, &m.layer, n)?;
        if let Some((first, rows)) = head {
            b.rms_norm(X, first, m.head_norm, Xn, rows)?;
            b.project(Xn, &[(m.head, Logits)], rows)?;
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::engine::Engine;
    use crate::exec::{standalone_next, Standalone};
    use crate::model::MemWeights;
    use rand::{rngs::StdRng, Rng, SeedableRng};
    use strata_schemas::ggml::GgmlType;
    use strata_schemas::inventory::SsmParams;

    /// Four blocks, the fourth full attention (interval 4), every width small.
    pub(crate) fn tiny_hp() -> HParams {
        HParams {
            n_layer: 4,
            n_embd: 32,
            n_vocab: 61,
            n_ctx_train: 256,
            n_head: 4,
            n_head_kv: 2,
            head_dim_k: 8,
            head_dim_v: 8,
            n_ff: 0,
            n_expert: 6,
            // Every expert used: the top-k choice is then continuous in its inputs, so the
            // chunked and recurrent rules' different rounding cannot flip a routing choice.
            n_expert_used: 6,
            n_ff_exp: 16,
            n_ff_shexp: 24,
            n_leading_dense: 0,
            full_attention_interval: Some(4),
            ssm: Some(SsmParams {
                conv_kernel: 4,
                state_size: 8,
                group_count: 2,
                time_step_rank: 4,
                inner_size: 32,
            }),
            nextn_predict_layers: 0,
            rope_theta: 10000.0,
            rope_dim: Some(4),
            rms_eps: 1e-6,
            norm_topk_prob: true,
            tied_embeddings: false,
        }
    }

    /// Random F32 weights for every tensor the forward pass binds (GGUF dims).
    pub(crate) fn tiny_weights(hp: &HParams, seed: u64) -> MemWeights {
        let d = Dims::of(hp);
        let mut rng = StdRng::seed_from_u64(seed);
        let mut w = MemWeights::new();
        let mut put = |name: String, dims: &[usize], scale: f32, off: f32| {
            let n: usize = dims.iter().product();
            let vals: Vec<f32> = (0..n)
                .map(|_| off + scale * (2.0 * rng.random::<f32>() - 1.0))
                .collect();
            let dims: Vec<u64> = dims.iter().map(|&v| v as u64).collect();
            w.insert_f32(name, &dims, &vals, GgmlType::F32).unwrap();
        };
        let e = d.e;
        put("token_embd.weight".into(), &[e, d.vocab], 1.0, 0.0);
        put("output_norm.weight".into(), &[e], 0.2, 1.0);
        put("output.weight".into(), &[e, d.vocab], 0.3, 0.0);
        for l in 0..hp.n_layer {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            put(n("attn_norm"), &[e], 0.2, 1.0);
            put(n("post_attention_norm"), &[e], 0.2, 1.0);
            if hp.layer_kind(l) == LayerKind::LinearAttention {
                put(n("attn_qkv"), &[e, d.lin_qkv()], 0.3, 0.0);
                put(n("attn_gate"), &[e, d.lin_v()], 0.3, 0.0);
                put(n("ssm_ba"), &[e, 2 * d.lin_v_heads], 0.3, 0.0);
                put(n("ssm_conv1d"), &[d.conv_k, d.lin_qkv()], 0.5, 0.0);
                put(format!("blk.{l}.ssm_dt.bias"), &[d.lin_v_heads], 0.5, 0.0);
                put(format!("blk.{l}.ssm_a"), &[d.lin_v_heads], 0.5, -1.0);
                put(n("ssm_norm"), &[d.lin_hv], 0.2, 1.0);
                put(n("ssm_out"), &[d.lin_v(), e], 0.3, 0.0);
            } else {
                put(n("attn_q"), &[e, d.q_proj()], 0.3, 0.0);
                put(n("attn_k"), &[e, d.k_out()], 0.3, 0.0);
                put(n("attn_v"), &[e, d.v_out()], 0.3, 0.0);
                put(n("attn_output"), &[d.att_out(), e], 0.3, 0.0);
                put(n("attn_q_norm"), &[d.hd], 0.2, 1.0);
                put(n("attn_k_norm"), &[d.hd], 0.2, 1.0);
            }
            put(n("ffn_gate_inp"), &[e, d.n_expert], 0.3, 0.0);
            put(n("ffn_gate_exps"), &[e, d.f, d.n_expert], 0.3, 0.0);
            put(n("ffn_up_exps"), &[e, d.f, d.n_expert], 0.3, 0.0);
            put(n("ffn_down_exps"), &[d.f, e, d.n_expert], 0.3, 0.0);
            put(n("ffn_gate_inp_shexp"), &[e], 0.3, 0.0);
            put(n("ffn_gate_shexp"), &[e, d.n_ff_shexp], 0.3, 0.0);
            put(n("ffn_up_shexp"), &[e, d.n_ff_shexp], 0.3, 0.0);
            put(n("ffn_down_shexp"), &[d.n_ff_shexp, e], 0.3, 0.0);
        }
        w
    }

    pub(crate) fn engine<'a>(
        hp: &HParams,
        w: &'a MemWeights,
        slots: usize,
        pass: usize,
    ) -> crate::pipeline::Pipeline<
        crate::backend::cpu::CpuStage<'a>,
        Qwen3Next<crate::backend::cpu::CpuStage<'a>>,
    > {
        standalone_next(
            hp,
            w,
            "tiny-next",
            Standalone {
                slots,
                ctx: 128,
                kv: GgmlType::F32,
                max_tok: pass,
                ubatch: 128,
                yarn: None,
            },
        )
        .unwrap()
    }

    pub(crate) fn max_rel(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        a.iter()
            .zip(b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs() / scale))
    }

    /// Longer than one delta-rule chunk (64), so prefill crosses chunks.
    pub(crate) fn prompt(len: usize) -> Vec<u32> {
        (0..len as u32).map(|i| (i * 37 + 11) % 61).collect()
    }

    #[test]
    fn decoding_with_state_equals_recomputing_the_whole_sequence() {
        let hp = tiny_hp();
        let w = tiny_weights(&hp, 7);
        let p = prompt(80);
        // Every position's logits from one prefill of the whole sequence.
        let mut full = engine(&hp, &w, 1, 128);
        let all = full.prefill_all(0, &p).unwrap().to_vec();
        let v = hp.n_vocab as usize;
        assert!(all.iter().all(|x| x.is_finite()));
        // Prefill 70 (two chunks), then decode the rest one token at a time.
        let mut inc = engine(&hp, &w, 1, 128);
        let first = inc.prefill(0, &p[..70], true).unwrap().unwrap().to_vec();
        let r = max_rel(&first, &all[69 * v..70 * v]);
        assert!(r < 1e-4, "prefill's last row differs by {r}");
        for (i, &t) in p[70..].iter().enumerate() {
            let got = inc.decode(&[(0, t)]).unwrap().to_vec();
            let at = 70 + i;
            let r = max_rel(&got, &all[at * v..(at + 1) * v]);
            assert!(r < 1e-4, "decode at position {at} differs by {r}");
        }
    }

    #[test]
    fn prefill_in_passes_and_slot_reuse_match_one_pass() {
        let hp = tiny_hp();
        let w = tiny_weights(&hp, 11);
        let p = prompt(40);
        let v = hp.n_vocab as usize;
        let mut one = engine(&hp, &w, 2, 64);
        let want = one.prefill_all(0, &p).unwrap().to_vec();
        // Passes of 7 tokens carry the conv and recurrent state between them.
        let mut small = engine(&hp, &w, 2, 7);
        let got = small.prefill_all(1, &p).unwrap().to_vec();
        assert!(max_rel(&got, &want) < 1e-4);
        // A reused slot starts from zero state: another sequence first, then reset.
        small.prefill(0, &prompt(9)[3..], false).unwrap();
        small.reset_slot(0);
        let again = small.prefill_all(0, &p).unwrap().to_vec();
        let r = max_rel(&again[..p.len() * v], &want);
        assert!(r < 1e-4, "a reused slot differs by {r}");
    }

    #[test]
    fn batched_decode_of_two_slots_equals_each_alone() {
        let hp = tiny_hp();
        let w = tiny_weights(&hp, 3);
        let (a, b) = (prompt(12), prompt(19)[5..].to_vec());
        let mut both = engine(&hp, &w, 2, 32);
        both.prefill(0, &a, false).unwrap();
        both.prefill(1, &b, false).unwrap();
        let got = both.decode(&[(0, 5), (1, 9)]).unwrap().to_vec();
        let v = hp.n_vocab as usize;
        for (slot, (p, t)) in [(&a, 5u32), (&b, 9u32)].into_iter().enumerate() {
            let mut alone = engine(&hp, &w, 1, 32);
            alone.prefill(0, p, false).unwrap();
            let want = alone.decode(&[(0, t)]).unwrap().to_vec();
            let r = max_rel(&got[slot * v..(slot + 1) * v], &want);
            assert!(r < 1e-4, "slot {slot} differs by {r}");
        }
    }

    #[test]
    fn a_qwen3moe_file_is_refused_with_the_key() {
        let mut hp = tiny_hp();
        hp.ssm = None;
        let e = check_dims(&hp).unwrap_err().to_string();
        assert!(e.contains("ssm"), "{e}");
    }
}
