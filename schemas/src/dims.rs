//! `Dims`: the model dimensions every forward pass, kernel and working-set size is computed
//! from, derived once from a model's [`HParams`] (the file's raw hyperparameters). The planner
//! sizes scratch from it, the executor's backends shape their ops with it.
//! Invariant: this is the only derived hyperparameter struct; nothing re-derives these values
//! from `HParams` elsewhere, and the forward pass of each architecture checks the values it
//! relies on (`model::*::check_dims` in the executor) before any memory is touched.

use crate::inventory::HParams;

/// Model dimensions as the executor uses them (element counts, not bytes).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dims {
    /// Main blocks (MTP blocks not counted).
    pub n_layer: usize,
    /// Hidden width.
    pub e: usize,
    pub vocab: usize,
    /// Query heads.
    pub n_head: usize,
    /// KV heads.
    pub n_head_kv: usize,
    /// Head dimension of queries and keys.
    pub hd: usize,
    /// Head dimension of values.
    pub hd_v: usize,
    /// Rotated dimensions of a head (RoPE).
    pub n_rot: usize,
    pub n_expert: usize,
    /// Experts per token.
    pub k: usize,
    /// Routed expert width.
    pub f: usize,
    /// Dense FFN width (0 when every layer is MoE).
    pub n_ff: usize,
    /// Shared expert width (0 when there is none).
    pub n_ff_shexp: usize,
    pub eps: f32,
    /// Renormalise the top-k router weights.
    pub norm_topk: bool,
    pub rope_theta: f64,
    /// Trained context (YaRN's default original context).
    pub n_ctx_train: u64,
    /// Linear attention (Gated DeltaNet, `ssm.*` keys; all 0 for models without it): key
    /// heads, value heads, key and value head dims, conv width.
    pub lin_k_heads: usize,
    pub lin_v_heads: usize,
    pub lin_hk: usize,
    pub lin_hv: usize,
    pub conv_k: usize,
}

impl Dims {
    /// The dimensions of `hp` (values too large for this machine's `usize` saturate; the
    /// forward pass's checks then refuse them).
    pub fn of(hp: &HParams) -> Self {
        let u = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        Self {
            n_layer: hp.n_layer as usize,
            e: u(hp.n_embd),
            vocab: u(hp.n_vocab),
            n_head: u(hp.n_head),
            n_head_kv: u(hp.n_head_kv),
            hd: u(hp.head_dim_k),
            hd_v: u(hp.head_dim_v),
            n_rot: u(hp.rope_dim.unwrap_or(hp.head_dim_k)),
            n_expert: u(hp.n_expert),
            k: u(hp.n_expert_used),
            f: u(hp.n_ff_exp),
            n_ff: u(hp.n_ff),
            n_ff_shexp: u(hp.n_ff_shexp),
            eps: hp.rms_eps as f32,
            norm_topk: hp.norm_topk_prob,
            rope_theta: hp.rope_theta,
            n_ctx_train: hp.n_ctx_train,
            lin_k_heads: hp.ssm.as_ref().map_or(0, |s| u(s.group_count)),
            lin_v_heads: hp.ssm.as_ref().map_or(0, |s| u(s.time_step_rank)),
            lin_hk: hp.ssm.as_ref().map_or(0, |s| u(s.state_size)),
            lin_hv: hp.ssm.as_ref().map_or(0, |s| u(s.head_v_dim())),
            conv_k: hp.ssm.as_ref().map_or(0, |s| u(s.conv_kernel)),
        }
    }

    /// Whether the model has linear-attention (Gated DeltaNet) layers.
    pub fn linear(&self) -> bool {
        self.lin_v_heads > 0
    }

    /// Channels of the linear layers' conv: all q, k and v heads (0 without linear layers).
    pub fn lin_qkv(&self) -> usize {
        2 * self.lin_k_heads * self.lin_hk + self.lin_v()
    }

    /// Width of all linear value heads (the delta net's output).
    pub fn lin_v(&self) -> usize {
        self.lin_v_heads * self.lin_hv
    }

    /// Width of the full-attention query projection: `2 x q_out` where the query carries an
    /// output gate (Qwen3-Next, which has linear layers), `q_out` otherwise.
    pub fn q_proj(&self) -> usize {
        if self.linear() {
            2 * self.q_out()
        } else {
            self.q_out()
        }
    }

    /// Width of all query heads (`n_head x hd`).
    pub fn q_out(&self) -> usize {
        self.n_head * self.hd
    }

    /// Width of all key heads (`n_head_kv x hd`).
    pub fn k_out(&self) -> usize {
        self.n_head_kv * self.hd
    }

    /// Width of all value heads (`n_head_kv x hd_v`).
    pub fn v_out(&self) -> usize {
        self.n_head_kv * self.hd_v
    }

    /// Width of the attention output (`n_head x hd_v`).
    pub fn att_out(&self) -> usize {
        self.n_head * self.hd_v
    }

    /// The widest FFN (routed expert, dense or shared).
    pub fn ff_max(&self) -> usize {
        self.f.max(self.n_ff).max(self.n_ff_shexp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_dims_default_to_the_head() {
        let hp = HParams {
            n_layer: 2,
            n_embd: 64,
            n_vocab: 256,
            n_ctx_train: 128,
            n_head: 4,
            n_head_kv: 2,
            head_dim_k: 16,
            head_dim_v: 16,
            n_ff: 0,
            n_expert: 8,
            n_expert_used: 2,
            n_ff_exp: 32,
            n_ff_shexp: 0,
            n_leading_dense: 0,
            full_attention_interval: None,
            ssm: None,
            nextn_predict_layers: 0,
            rope_theta: 10_000.0,
            rope_dim: None,
            rms_eps: 1e-6,
            norm_topk_prob: true,
            tied_embeddings: false,
        };
        let d = Dims::of(&hp);
        assert_eq!(
            (d.n_rot, d.q_out(), d.k_out(), d.att_out()),
            (16, 64, 32, 64)
        );
        let d = Dims::of(&HParams {
            rope_dim: Some(8),
            ..hp
        });
        assert_eq!(d.n_rot, 8);
    }
}
