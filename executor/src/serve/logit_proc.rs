//! Logit processing of one request before its token is drawn: `logit_bias`,
//! presence/frequency penalties (OpenAI, over generated tokens), the repetition penalty
//! (llama.cpp/vLLM, over prompt and generated tokens, each seen token once), the locally
//! typical `typical_p` cut and the `min_p` cut. [`LogitProc::row_proc`] turns a request's
//! settings and history into the [`crate::pick::RowProc`] a backend applies where it picks
//! (on the device for all but `typical_p`); [`apply`] is the dense host transform it must
//! equal (the unit tests check one against the other).
//! Invariant: every step is a transform of the logits row that runs before the unchanged
//! draw of [`crate::sampler::sample_into`] (so the seeded draw stays the one the device
//! kernel repeats); a neutral [`LogitProc`] leaves the row bit for bit untouched.

use crate::pick::{Edit, RowProc};
use std::collections::HashMap;

/// One request's logit processing settings (all neutral by default).
#[derive(Debug, Clone, PartialEq)]
pub struct LogitProc {
    /// Keep tokens whose probability is at least `min_p` times the best one's (0 = off).
    pub min_p: f32,
    /// Subtracted once from a token that was generated at least once.
    pub presence_penalty: f32,
    /// Subtracted from a token per time it was generated.
    pub frequency_penalty: f32,
    /// Divides positive (multiplies negative) logits of tokens seen in prompt or output (1 = off).
    pub repetition_penalty: f32,
    /// Added to the given token ids' logits (`-100` effectively bans, `100` forces). Ids are
    /// distinct (the HTTP side refuses one named twice).
    pub logit_bias: Vec<(u32, f32)>,
    /// Locally typical sampling (Meister et al. 2023, as Hugging Face's `typical_p` and
    /// llama.cpp's `typ_p`): keep the tokens whose surprise is closest to the distribution's
    /// entropy, up to this much probability (1 = off; greedy requests ignore it).
    pub typical_p: f32,
}

impl Default for LogitProc {
    fn default() -> Self {
        Self {
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            typical_p: 1.0,
        }
    }
}

impl LogitProc {
    /// Whether this leaves every row untouched (then the engine may pick on its device).
    pub fn is_neutral(&self) -> bool {
        self.min_p <= 0.0
            && self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
            && self.repetition_penalty == 1.0
            && self.logit_bias.is_empty()
            && self.typical_p >= 1.0
    }
}

impl LogitProc {
    /// This request's processing of a row drawn at `temperature` after history `h`, into
    /// `out` (its mask left as it is): one [`Edit`] per token that the bias or a penalty
    /// touches, the `typical_p` mass, the `min_p` offset.
    pub fn row_proc(&self, h: &History, temperature: f32, out: &mut RowProc) {
        out.edits.clear();
        // Greedy draws ignore typical_p (as `apply` does), so their rows stay device-side.
        out.typical = (self.typical_p < 1.0 && temperature > 0.0).then_some(self.typical_p);
        out.min_p_off = crate::pick::min_p_offset(self.min_p, temperature);
        if self.logit_bias.is_empty()
            && self.repetition_penalty == 1.0
            && self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
        {
            return;
        }
        let mut at: HashMap<u32, usize> = HashMap::new();
        let mut edit = |id: u32, f: &mut dyn FnMut(&mut Edit)| {
            let i = *at.entry(id).or_insert_with(|| {
                out.edits.push(Edit::none(id));
                out.edits.len() - 1
            });
            f(&mut out.edits[i]);
        };
        for &(id, b) in &self.logit_bias {
            edit(id, &mut |e| e.bias += b);
        }
        if self.repetition_penalty != 1.0 {
            let r = self.repetition_penalty;
            for &id in h.prompt.iter().chain(h.generated.keys()) {
                edit(id, &mut |e| e.rep = r);
            }
        }
        if self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 {
            for (&id, &n) in &h.generated {
                let pen = self.presence_penalty + self.frequency_penalty * n as f32;
                edit(id, &mut |e| e.pen = pen);
            }
        }
    }
}

/// What a request has seen so far, for the penalties.
#[derive(Debug, Default, Clone)]
pub struct History {
    /// Times each token was generated.
    generated: HashMap<u32, u32>,
    /// Tokens of the prompt (for the repetition penalty).
    prompt: std::collections::HashSet<u32>,
}

impl History {
    pub fn new(prompt: &[u32], p: &LogitProc) -> Self {
        let prompt = if p.repetition_penalty != 1.0 {
            prompt.iter().copied().collect()
        } else {
            Default::default()
        };
        Self {
            generated: HashMap::new(),
            prompt,
        }
    }

    /// Count a generated token.
    pub fn push(&mut self, tok: u32) {
        *self.generated.entry(tok).or_insert(0) += 1;
    }
}

/// Apply `p` to one row of logits in place; `temperature` is the request's (min_p compares
/// probabilities after it; greedy requests compare the raw softmax). Out-of-range ids are
/// ignored (the HTTP side refuses them).
pub fn apply(p: &LogitProc, h: &History, temperature: f32, row: &mut [f32]) {
    if p.is_neutral() {
        return;
    }
    for &(id, b) in &p.logit_bias {
        if let Some(l) = row.get_mut(id as usize) {
            *l += b;
        }
    }
    if p.repetition_penalty != 1.0 {
        let r = p.repetition_penalty;
        // Each seen token once, whether it was in the prompt, generated, or both.
        let seen = h
            .prompt
            .iter()
            .chain(h.generated.keys().filter(|id| !h.prompt.contains(id)));
        for &id in seen {
            if let Some(l) = row.get_mut(id as usize) {
                *l = if *l > 0.0 { *l / r } else { *l * r };
            }
        }
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        for (&id, &n) in &h.generated {
            if let Some(l) = row.get_mut(id as usize) {
                *l -= p.presence_penalty + p.frequency_penalty * n as f32;
            }
        }
    }
    if p.typical_p < 1.0 && temperature > 0.0 {
        crate::pick::typical_cut(row, p.typical_p, temperature);
    }
    if p.min_p > 0.0 {
        let max = row
            .iter()
            .copied()
            .filter(|v| v.is_finite())
            .fold(f32::NEG_INFINITY, f32::max);
        if max.is_finite() {
            let t = if temperature > 0.0 { temperature } else { 1.0 };
            // p_i / p_max = exp((l_i - max) / t) < min_p  <=>  l_i < max + t ln(min_p).
            let cut = max + t * p.min_p.ln();
            for l in row.iter_mut() {
                if *l < cut {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }
}

/// Log-softmax of `row` at `id` and the `n` most likely ids with theirs (highest first,
/// lowest id on ties), for `logprobs`. Non-finite entries have probability 0.
pub fn logprobs(row: &[f32], id: u32, n: usize) -> (f32, Vec<(u32, f32)>) {
    let max = row
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return (f32::NEG_INFINITY, Vec::new());
    }
    let z: f64 = row
        .iter()
        .filter(|v| v.is_finite())
        .map(|v| ((v - max) as f64).exp())
        .sum();
    let lz = max as f64 + z.ln();
    let lp = |v: f32| -> f32 {
        if v.is_finite() {
            (v as f64 - lz) as f32
        } else {
            f32::NEG_INFINITY
        }
    };
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        for (i, &v) in row.iter().enumerate() {
            if !v.is_finite() {
                continue;
            }
            if top.len() == n && v <= top[n - 1].1 {
                continue;
            }
            let pos = top.partition_point(|&(_, w)| w >= v);
            top.insert(pos, (i as u32, v));
            top.truncate(n);
        }
    }
    let chosen = row.get(id as usize).copied().map_or(f32::NEG_INFINITY, lp);
    (chosen, top.into_iter().map(|(i, v)| (i, lp(v))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neutral_leaves_the_row_untouched() {
        let mut row = vec![1.0, -2.0, 0.5];
        let p = LogitProc::default();
        apply(&p, &History::new(&[0, 1], &p), 0.7, &mut row);
        assert_eq!(row, [1.0, -2.0, 0.5]);
    }

    #[test]
    fn bias_and_penalties_move_the_argmax() {
        let base = [2.0f32, 1.9, 0.0, -1.0];
        let p = LogitProc {
            logit_bias: vec![(3, 10.0)],
            ..Default::default()
        };
        let mut row = base.to_vec();
        apply(&p, &History::new(&[], &p), 0.0, &mut row);
        assert_eq!(crate::sampler::argmax(&row), 3);

        let p = LogitProc {
            presence_penalty: 0.5,
            frequency_penalty: 0.1,
            ..Default::default()
        };
        let mut h = History::new(&[], &p);
        h.push(0);
        h.push(0);
        let mut row = base.to_vec();
        apply(&p, &h, 0.0, &mut row);
        assert_eq!(row[0], 2.0 - 0.5 - 0.2);
        assert_eq!(crate::sampler::argmax(&row), 1);

        let p = LogitProc {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        let mut row = base.to_vec();
        apply(&p, &History::new(&[0, 3], &p), 0.0, &mut row);
        assert_eq!(row, [1.0, 1.9, 0.0, -2.0]);
    }

    #[test]
    fn min_p_cuts_tokens_below_the_fraction_of_the_best() {
        let p = LogitProc {
            min_p: 0.5,
            ..Default::default()
        };
        // p1/p0 = e^-0.5 = 0.61 stays; p2/p0 = e^-1 = 0.37 goes (temperature 1).
        let mut row = vec![0.0f32, -0.5, -1.0];
        apply(&p, &History::default(), 1.0, &mut row);
        assert_eq!(row[..2], [0.0, -0.5]);
        assert_eq!(row[2], f32::NEG_INFINITY);
    }

    #[test]
    fn typical_p_keeps_the_tokens_nearest_the_entropy() {
        // p = [0.5, 0.25, 0.125, 0.125]: H = 1.75 bits = 1.213 nats; surprises (nats)
        // 0.693, 1.386, 2.079, 2.079: distances 0.52, 0.17, 0.87, 0.87. Rank: 1, 0, 2, 3, so
        // 0.2 keeps id 1 alone (0.25 >= 0.2) and 0.7 ids 1 and 0 (0.75 >= 0.7).
        let base: Vec<f32> = [0.5f32, 0.25, 0.125, 0.125]
            .iter()
            .map(|p| p.ln())
            .collect();
        let p = LogitProc {
            typical_p: 0.2,
            ..Default::default()
        };
        let mut row = base.clone();
        apply(&p, &History::default(), 1.0, &mut row);
        assert_eq!(
            row[0],
            f32::NEG_INFINITY,
            "the most likely token is atypical here"
        );
        assert_eq!(row[1], base[1]);
        assert!(row[2..].iter().all(|v| *v == f32::NEG_INFINITY));
        let p = LogitProc {
            typical_p: 0.7,
            ..Default::default()
        };
        let mut row = base.clone();
        apply(&p, &History::default(), 1.0, &mut row);
        assert_eq!(row[..2], base[..2]);
        assert_eq!(row[2], f32::NEG_INFINITY);
        assert_eq!(row[3], f32::NEG_INFINITY);
        let mut row = base.clone();
        apply(&p, &History::default(), 0.0, &mut row);
        assert_eq!(row, base, "greedy requests ignore typical_p");
    }

    /// A random request's settings and history on a random row: `row_proc` then
    /// `RowProc::apply` (what every backend repeats) gives the bits `apply` does after the
    /// grammar's mask (the host path before row processing existed), and so the same token
    /// for greedy and seeded draws.
    #[test]
    fn row_proc_equals_the_dense_host_processing() {
        use crate::pick::{pick_rows, RowProc};
        use crate::sampler::{sample_into, Draw};
        use rand::{rngs::StdRng, Rng, SeedableRng};
        let mut rng = StdRng::seed_from_u64(0x0d0e_c0de);
        let v = 300usize;
        for case in 0..400 {
            let pick = |rng: &mut StdRng, xs: &[f32]| xs[rng.random_range(0..xs.len())];
            let mut p = LogitProc {
                min_p: pick(&mut rng, &[0.0, 0.0, 0.05, 0.3, 1.0]),
                presence_penalty: pick(&mut rng, &[0.0, 0.5, -1.25, 2.0]),
                frequency_penalty: pick(&mut rng, &[0.0, 0.3, -0.7]),
                repetition_penalty: pick(&mut rng, &[1.0, 1.3, 0.8, 10.0]),
                typical_p: pick(&mut rng, &[1.0, 1.0, 1.0, 0.5]),
                ..Default::default()
            };
            let mut ids: Vec<u32> = (0..v as u32 + 5).collect();
            for _ in 0..rng.random_range(0..20) {
                let i = rng.random_range(0..ids.len());
                let id = ids.swap_remove(i);
                p.logit_bias.push((id, rng.random_range(-100.0f32..100.0)));
            }
            let prompt: Vec<u32> = (0..rng.random_range(0..40))
                .map(|_| rng.random_range(0..v as u32))
                .collect();
            let mut h = History::new(&prompt, &p);
            for _ in 0..rng.random_range(0..60) {
                h.push(rng.random_range(0..v as u32 + 3));
            }
            let mut row: Vec<f32> = (0..v)
                .map(|_| {
                    let x: f32 = rng.random_range(-8.0f32..8.0);
                    if case % 3 == 0 {
                        x.round()
                    } else {
                        x
                    }
                })
                .collect();
            if case % 7 == 0 {
                row[rng.random_range(0..v)] = f32::NEG_INFINITY;
                row[rng.random_range(0..v)] = -0.0;
            }
            let mask: Option<Vec<u32>> = (case % 2 == 0).then(|| {
                (0..v.div_ceil(32))
                    .map(|_| rng.random::<u32>() & rng.random::<u32>())
                    .collect()
            });
            let t = pick(&mut rng, &[0.0, 0.7, 1.0, 1.6]);
            let d = Draw {
                temperature: t,
                top_k: pick(&mut rng, &[0.0, 5.0, 40.0]) as u32,
                top_p: pick(&mut rng, &[1.0, 0.9, 0.5]),
                key: rng.random(),
                ..Draw::GREEDY
            };
            // The dense reference: the mask, then `apply`.
            let mut want = row.clone();
            if let Some(m) = &mask {
                for (i, l) in want.iter_mut().enumerate() {
                    if m[i / 32] >> (i % 32) & 1 == 0 {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            apply(&p, &h, t, &mut want);
            let mut rp = RowProc {
                mask: mask.clone(),
                ..Default::default()
            };
            p.row_proc(&h, t, &mut rp);
            let ids: std::collections::HashSet<u32> = rp.edits.iter().map(|e| e.id).collect();
            assert_eq!(ids.len(), rp.edits.len(), "one edit a token");
            let mut got = row.clone();
            rp.apply(t, &mut got);
            for i in 0..v {
                assert_eq!(
                    got[i].to_bits(),
                    want[i].to_bits(),
                    "case {case} token {i}: {} vs {}",
                    got[i],
                    want[i]
                );
            }
            let tok = sample_into(&want, &d, &mut Vec::new());
            let mut out = [0u32];
            pick_rows(
                &mut row.clone(),
                v,
                &[d],
                std::slice::from_ref(&rp),
                &mut out,
            );
            assert_eq!(out[0], tok, "case {case}");
            assert_eq!(rp.pick(&row, &d, &mut Vec::new(), &mut Vec::new()), tok);
        }
    }

    #[test]
    fn a_token_in_prompt_and_output_takes_the_repetition_penalty_once() {
        let p = LogitProc {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        let mut h = History::new(&[1], &p);
        h.push(1);
        let mut row = vec![0.0f32, 4.0, -4.0];
        apply(&p, &h, 0.0, &mut row);
        assert_eq!(row, [0.0, 2.0, -4.0]);
        let mut rp = crate::pick::RowProc::default();
        p.row_proc(&h, 0.0, &mut rp);
        let mut row2 = vec![0.0f32, 4.0, -4.0];
        rp.apply(0.0, &mut row2);
        assert_eq!(row2, row);
    }

    #[test]
    fn logprobs_are_log_softmax_with_sorted_top() {
        let row = [0.0f32, 2.0_f32.ln(), f32::NEG_INFINITY, 0.0];
        let (lp, top) = logprobs(&row, 1, 2);
        // softmax = [1/4, 2/4, 0, 1/4]
        assert!((lp - 0.5f32.ln()).abs() < 1e-6);
        assert_eq!(top[0].0, 1);
        assert_eq!(top[1].0, 0, "ties go to the lowest id");
        assert!((top[1].1 - 0.25f32.ln()).abs() < 1e-6);
        let sum: f32 = (0..4).map(|i| logprobs(&row, i, 0).0.exp()).sum();
        assert!((sum - 1.0).abs() < 1e-6);
    }
}
