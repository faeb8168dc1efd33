//! A test-support `Engine`: the plan-less CPU Qwen3-MoE engine over random in-memory weights
//! (2 layers, hidden 64, 4 experts top-2), paced by an optional delay, so the server is
//! testable without a plan or a GGUF.
//! Invariant: the same `TinyConfig` gives bit-identical weights and therefore identical
//! greedy outputs; each engine leaks its weights (well under 1 MiB) for the life of the
//! process, which is what lets the model borrow them as `'static`.

use crate::backend::cpu::CpuStage;
use crate::engine::{Engine, EngineError, EngineInfo, EngineStats};
use crate::exec::{standalone_cpu, Standalone};
use crate::model::qwen3moe::Qwen3Moe;
use crate::model::{MemWeights, ModelError};
use crate::pipeline::Pipeline;
use std::time::Duration;
use strata_schemas::ggml::GgmlType;
use strata_schemas::inventory::HParams;

/// Shape and pacing of a [`TinyEngine`].
#[derive(Debug, Clone, PartialEq)]
pub struct TinyConfig {
    pub n_vocab: u64,
    pub n_slots: usize,
    pub max_context: u64,
    pub ubatch: usize,
    pub seed: u64,
    /// Sleep added to every prefill chunk and decode step (to make mid-prefill and
    /// mid-decode disconnects observable in tests).
    pub step_delay: Duration,
}

impl Default for TinyConfig {
    fn default() -> Self {
        Self {
            n_vocab: 400,
            n_slots: 4,
            max_context: 256,
            ubatch: 16,
            seed: 1,
            step_delay: Duration::ZERO,
        }
    }
}

/// The hyperparameters of the tiny model.
// A literal, not the schemas' `tiny_qwen3next` fixture: this module is part of the library
// (other crates' serve tests use it), where `strata_schemas::gguf::testutil` is not built.
pub fn tiny_hparams(n_vocab: u64, n_ctx: u64) -> HParams {
    HParams {
        n_layer: 2,
        n_embd: 64,
        n_vocab,
        n_ctx_train: n_ctx,
        n_head: 4,
        n_head_kv: 2,
        head_dim_k: 16,
        head_dim_v: 16,
        n_ff: 0,
        n_expert: 4,
        n_expert_used: 2,
        n_ff_exp: 32,
        n_ff_shexp: 0,
        n_leading_dense: 0,
        full_attention_interval: None,
        ssm: None,
        nextn_predict_layers: 0,
        rope_theta: 10000.0,
        rope_dim: None,
        rms_eps: 1e-6,
        norm_topk_prob: true,
        tied_embeddings: false,
    }
}

/// splitmix64: a tiny deterministic generator for the weights.
struct Mix(u64);

impl Mix {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Random F32 weights for `hp` (norms near 1, matrices small).
pub fn tiny_weights(hp: &HParams, seed: u64) -> Result<MemWeights, ModelError> {
    let mut rng = Mix(seed);
    let mut w = MemWeights::new();
    let mut put = |w: &mut MemWeights, name: String, dims: &[u64], scale: f32, off: f32| {
        let n: u64 = dims.iter().product();
        let vals: Vec<f32> = (0..n).map(|_| off + scale * rng.next()).collect();
        w.insert_f32(name.clone(), dims, &vals, GgmlType::F32)
            .map_err(|source| ModelError::Tensor { name, source })
    };
    let (e, v) = (hp.n_embd, hp.n_vocab);
    let (qo, kvo) = (hp.n_head * hp.head_dim_k, hp.n_head_kv * hp.head_dim_k);
    put(&mut w, "token_embd.weight".into(), &[e, v], 1.0, 0.0)?;
    put(&mut w, "output_norm.weight".into(), &[e], 0.2, 1.0)?;
    put(&mut w, "output.weight".into(), &[e, v], 0.5, 0.0)?;
    for l in 0..hp.n_layer {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        put(&mut w, n("attn_norm"), &[e], 0.2, 1.0)?;
        put(&mut w, n("ffn_norm"), &[e], 0.2, 1.0)?;
        put(&mut w, n("attn_q_norm"), &[hp.head_dim_k], 0.2, 1.0)?;
        put(&mut w, n("attn_k_norm"), &[hp.head_dim_k], 0.2, 1.0)?;
        put(&mut w, n("attn_q"), &[e, qo], 0.2, 0.0)?;
        put(&mut w, n("attn_k"), &[e, kvo], 0.2, 0.0)?;
        put(&mut w, n("attn_v"), &[e, kvo], 0.2, 0.0)?;
        put(&mut w, n("attn_output"), &[qo, e], 0.2, 0.0)?;
        put(&mut w, n("ffn_gate_inp"), &[e, hp.n_expert], 0.3, 0.0)?;
        let (f, x) = (hp.n_ff_exp, hp.n_expert);
        put(&mut w, n("ffn_gate_exps"), &[e, f, x], 0.2, 0.0)?;
        put(&mut w, n("ffn_up_exps"), &[e, f, x], 0.2, 0.0)?;
        put(&mut w, n("ffn_down_exps"), &[f, e, x], 0.2, 0.0)?;
    }
    Ok(w)
}

/// An [`Engine`] over the CPU reference model with random weights.
pub struct TinyEngine {
    inner: Pipeline<CpuStage<'static>, Qwen3Moe<CpuStage<'static>>>,
    delay: Duration,
}

impl TinyEngine {
    pub fn new(cfg: &TinyConfig) -> Result<Self, crate::exec::StartError> {
        let hp = tiny_hparams(cfg.n_vocab, cfg.max_context);
        let weights: &'static MemWeights = Box::leak(Box::new(tiny_weights(&hp, cfg.seed)?));
        let inner = standalone_cpu(
            &hp,
            weights,
            "strata-tiny",
            Standalone {
                slots: cfg.n_slots,
                ctx: cfg.max_context as usize,
                kv: GgmlType::F32,
                max_tok: cfg.ubatch.max(1),
                ubatch: cfg.ubatch.max(1),
                yarn: None,
            },
        )?;
        Ok(Self {
            inner,
            delay: cfg.step_delay,
        })
    }

    fn pace(&self) {
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
    }
}

impl Engine for TinyEngine {
    fn info(&self) -> &EngineInfo {
        self.inner.info()
    }

    fn prefill(
        &mut self,
        slot: usize,
        tokens: &[u32],
        want_logits: bool,
    ) -> Result<Option<&[f32]>, EngineError> {
        self.pace();
        self.inner.prefill(slot, tokens, want_logits)
    }

    fn decode(&mut self, batch: &[(usize, u32)]) -> Result<&[f32], EngineError> {
        self.pace();
        self.inner.decode(batch)
    }

    fn reset_slot(&mut self, slot: usize) {
        self.inner.reset_slot(slot)
    }

    fn slot_len(&self, slot: usize) -> u64 {
        self.inner.slot_len(slot)
    }

    fn prefix_reuse(&self) -> crate::engine::PrefixReuse {
        self.inner.prefix_reuse()
    }

    fn truncate_slot(&mut self, slot: usize, n: u64) -> bool {
        self.inner.truncate_slot(slot, n)
    }

    fn copy_slot(&mut self, from: usize, to: usize) -> Result<bool, EngineError> {
        self.inner.copy_slot(from, to)
    }

    fn save_prefix_checkpoint(&mut self, slot: usize) -> Result<bool, EngineError> {
        self.inner.save_prefix_checkpoint(slot)
    }

    fn prefix_checkpoint(&self, slot: usize) -> Option<u64> {
        self.inner.prefix_checkpoint(slot)
    }

    fn stats(&self) -> EngineStats {
        self.inner.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The trait's default greedy step: the argmax of each row `decode` returns (checked on a
    /// twin engine fed the same tokens), and a too-small output is a request error.
    #[test]
    fn default_decode_greedy_is_the_argmax_of_each_row() {
        let cfg = TinyConfig {
            n_slots: 2,
            ubatch: 4,
            ..Default::default()
        };
        let (mut a, mut b) = (
            TinyEngine::new(&cfg).unwrap(),
            TinyEngine::new(&cfg).unwrap(),
        );
        for e in [&mut a, &mut b] {
            e.prefill(0, &[5, 17, 42], false).unwrap();
            e.prefill(1, &[9, 1], false).unwrap();
        }
        let mut next = [3u32, 7];
        let v = a.info().n_vocab;
        for _ in 0..6 {
            let batch = [(0, next[0]), (1, next[1])];
            let l = b.decode(&batch).unwrap();
            let want = [
                crate::sampler::argmax(&l[..v]),
                crate::sampler::argmax(&l[v..2 * v]),
            ];
            let mut got = [u32::MAX; 2];
            a.decode_greedy(&batch, &mut got).unwrap();
            assert_eq!(got, want);
            next = got;
        }
        let mut small = [0u32; 1];
        assert!(matches!(
            a.decode_greedy(&[(0, 1), (1, 2)], &mut small),
            Err(EngineError::Request(_))
        ));
    }

    #[test]
    fn tiny_engine_is_deterministic_and_slots_are_independent() {
        let cfg = TinyConfig {
            n_slots: 2,
            ubatch: 4,
            ..Default::default()
        };
        let mut a = TinyEngine::new(&cfg).unwrap();
        let prompt = [5u32, 17, 42, 3, 96, 0, 61];
        let run = |e: &mut TinyEngine, slot: usize| -> Vec<u32> {
            e.reset_slot(slot);
            let mut last = 0;
            for (i, c) in prompt.chunks(4).enumerate() {
                if let Some(l) = e.prefill(slot, c, i == 1).unwrap() {
                    last = crate::sampler::argmax(l);
                }
            }
            let mut out = vec![last];
            for _ in 0..5 {
                let l = e.decode(&[(slot, last)]).unwrap();
                last = crate::sampler::argmax(l);
                out.push(last);
            }
            out
        };
        let x = run(&mut a, 0);
        let y = run(&mut a, 1);
        assert_eq!(x, y);
        assert_eq!(a.slot_len(1), 12);
        let mut b = TinyEngine::new(&cfg).unwrap();
        assert_eq!(run(&mut b, 0), x);
        // A slot copied from another continues its sequence: the same logits and picks as
        // the original from the copied position on.
        a.reset_slot(0);
        a.reset_slot(1);
        let l0 = a.prefill(0, &prompt[..4], true).unwrap().unwrap().to_vec();
        assert!(a.copy_slot(0, 1).unwrap());
        assert_eq!(a.slot_len(1), 4);
        let t = crate::sampler::argmax(&l0);
        let v = a.info().n_vocab;
        let rows = a.decode(&[(0, t), (1, t)]).unwrap().to_vec();
        assert_eq!(
            rows[..v],
            rows[v..2 * v],
            "the copy decodes as the original"
        );
        assert!(!a.copy_slot(1, 1).unwrap(), "a slot onto itself is refused");
        assert!(
            a.prefill(0, &[1; 5], true).is_err(),
            "chunks beyond ubatch are refused"
        );
    }
}
