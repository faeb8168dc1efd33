//! One timed repetition of a bench combination: `batch` sequences, each in its own slot,
//! first fill `depth` cells (untimed), then prefill `prompt` tokens (timed), then all decode
//! `n_gen` steps together (timed). With a plan that speculates (MTP), greedy decode runs by
//! speculative steps, slot after slot, until each sequence has `n_gen` tokens.
//! Invariant: measures only; every timed step includes bringing the logits (or the picked
//! tokens) back to the host, and slots `0..batch` are reset before the repetition.

use std::time::Instant;
use strata_exec::engine::Engine;
use strata_exec::sampler::{Sampler, SamplingParams};

/// One row of the cartesian product of `-p`, `-n`, `-b` and `-d`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Combo {
    pub prompt: usize,
    pub n_gen: usize,
    pub batch: usize,
    pub depth: usize,
}

impl Combo {
    /// Cells one slot holds at the end of a repetition (the prompt is at least one token:
    /// decode starts from its logits).
    pub fn cells(&self) -> usize {
        self.depth + self.prompt.max(1) + self.n_gen
    }
}

/// What one repetition measured.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// Prompt tokens of all sequences over the time of all their prefills.
    pub pp: f64,
    /// Decoded tokens of all sequences over the decode time.
    pub tg: f64,
    /// Decoded tokens of one sequence over the decode time.
    pub tg_seq: f64,
    /// Expert bytes copied host -> device (PCIe) during the prefills and during the decode.
    pub pp_streamed: u64,
    pub tg_streamed: u64,
}

fn tokens(seed: u64, n: usize, n_vocab: usize) -> Vec<u32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % n_vocab as u64) as u32
        })
        .collect()
}

/// Prefill `toks` into `slot` in ubatch chunks; the argmax of the last token's logits when
/// `want`.
fn feed(e: &mut dyn Engine, slot: usize, toks: &[u32], want: bool) -> Result<u32, String> {
    let ub = e.info().ubatch.max(1);
    let mut last = 0u32;
    for (i, chunk) in toks.chunks(ub).enumerate() {
        let w = want && (i + 1) * ub >= toks.len();
        if let Some(l) = e.prefill(slot, chunk, w).map_err(|e| e.to_string())? {
            last = strata_exec::sampler::argmax(l);
        }
    }
    Ok(last)
}

/// One repetition of `c`; decode greedy, or drawn with `sampling`'s temperature.
pub fn rep(
    e: &mut dyn Engine,
    c: Combo,
    seed: u64,
    sampling: SamplingParams,
) -> Result<Sample, String> {
    let v = e.info().n_vocab;
    for s in 0..c.batch {
        e.reset_slot(s);
    }
    for s in 0..c.batch {
        if c.depth > 0 {
            let fill = tokens(seed ^ (0x5eed << 16) ^ s as u64, c.depth, v);
            feed(e, s, &fill, false)?;
        }
    }
    let p = c.prompt.max(1);
    let prompts: Vec<Vec<u32>> = (0..c.batch)
        .map(|s| tokens(seed.wrapping_add(1000 * s as u64), p, v))
        .collect();
    let b0 = e.stats().expert_bytes_streamed;
    let t0 = Instant::now();
    let mut batch = Vec::with_capacity(c.batch);
    for (s, prompt) in prompts.iter().enumerate() {
        batch.push((s, feed(e, s, prompt, true)?));
    }
    let pp = (p * c.batch) as f64 / t0.elapsed().as_secs_f64().max(1e-12);
    let b1 = e.stats().expert_bytes_streamed;
    let mut samplers: Vec<Sampler> = (0..c.batch)
        .map(|s| {
            Sampler::new(SamplingParams {
                seed: seed.wrapping_add(s as u64),
                ..sampling
            })
        })
        .collect();
    let mut next = vec![0u32; c.batch];
    let t1 = Instant::now();
    if e.spec_tokens() > 0 && sampling.temperature <= 0.0 {
        speculate(e, &mut batch, c.n_gen)?;
        let secs = t1.elapsed().as_secs_f64().max(1e-12);
        let b2 = e.stats().expert_bytes_streamed;
        return Ok(Sample {
            pp,
            tg: (c.n_gen * c.batch) as f64 / secs,
            tg_seq: c.n_gen as f64 / secs,
            pp_streamed: b1.saturating_sub(b0),
            tg_streamed: b2.saturating_sub(b1),
        });
    }
    for _ in 0..c.n_gen {
        // Picked by the engine (on the device where it can).
        if sampling.temperature > 0.0 {
            let draws: Vec<_> = samplers.iter_mut().map(|s| s.next_draw()).collect();
            e.decode_sample(&batch, &draws, &mut next)
        } else {
            e.decode_greedy(&batch, &mut next)
        }
        .map_err(|e| e.to_string())?;
        for (b, t) in batch.iter_mut().zip(&next) {
            b.1 = *t;
        }
    }
    let secs = t1.elapsed().as_secs_f64().max(1e-12);
    let b2 = e.stats().expert_bytes_streamed;
    Ok(Sample {
        pp,
        tg: (c.n_gen * c.batch) as f64 / secs,
        tg_seq: c.n_gen as f64 / secs,
        pp_streamed: b1.saturating_sub(b0),
        tg_streamed: b2.saturating_sub(b1),
    })
}

/// Greedy speculative steps for every `(slot, pending token)` of `batch`, slot after slot,
/// until each has `n_gen` tokens (a last step may give a few more; they are not counted).
fn speculate(e: &mut dyn Engine, batch: &mut [(usize, u32)], n_gen: usize) -> Result<(), String> {
    let mut out = vec![0u32; e.spec_tokens() + 1];
    let mut done = vec![0usize; batch.len()];
    while done.iter().any(|&d| d < n_gen) {
        for (b, d) in batch.iter_mut().zip(done.iter_mut()) {
            if *d >= n_gen {
                continue;
            }
            let got = e
                .decode_spec_greedy(b.0, b.1, None, &mut out)
                .map_err(|e| e.to_string())?;
            b.1 = out[got - 1];
            *d += got;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_count_depth_prompt_and_decode() {
        let c = Combo {
            prompt: 0,
            n_gen: 5,
            batch: 2,
            depth: 7,
        };
        assert_eq!(c.cells(), 7 + 1 + 5);
    }

    #[test]
    fn pseudo_random_tokens_stay_in_the_vocabulary_and_differ_by_seed() {
        let a = tokens(1, 64, 10);
        assert!(a.iter().all(|&t| t < 10));
        assert_ne!(a, tokens(2, 64, 10));
    }
}
