//! Host-side logit processing of one request before its token is drawn: `logit_bias`,
//! presence/frequency penalties (OpenAI, over generated tokens), the repetition penalty
//! (llama.cpp/vLLM, over prompt and generated tokens), the locally typical `typical_p` cut
//! and the `min_p` cut.
//! Invariant: every step is a transform of the logits row that runs before the unchanged
//! draw of [`crate::sampler::sample_into`] (so the seeded draw stays the one the device
//! kernel repeats); a neutral [`LogitProc`] leaves the row bit for bit untouched, and only
//! rows with a non-neutral one are picked on the host.

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
    /// Added to the given token ids' logits (`-100` effectively bans, `100` forces).
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
        let seen = h.prompt.iter().chain(h.generated.keys());
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
        typical(row, p.typical_p, temperature);
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

/// The `typical_p` cut of `row` at `temperature`: with `lp` the log-softmax of `row /
/// temperature` and `H` its entropy, tokens are ranked by `|-lp - H|` and the smallest
/// prefix whose probability reaches `mass` is kept (at least one token); the rest become
/// `-inf`. Ties in rank keep the lower id first.
fn typical(row: &mut [f32], mass: f32, temperature: f32) {
    let max = row
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return;
    }
    let t = temperature as f64;
    let scaled = |v: f32| (v as f64 - max as f64) / t;
    let z: f64 = row
        .iter()
        .filter(|v| v.is_finite())
        .map(|&v| scaled(v).exp())
        .sum();
    let lz = z.ln();
    let mut ent = 0.0f64;
    let mut rank: Vec<(f64, u32, f64)> = Vec::new();
    for (i, &v) in row.iter().enumerate() {
        if v.is_finite() {
            let lp = scaled(v) - lz;
            ent -= lp.exp() * lp;
            rank.push((0.0, i as u32, lp));
        }
    }
    for r in rank.iter_mut() {
        r.0 = (-r.2 - ent).abs();
    }
    rank.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut cum = 0.0f64;
    let mut keep = rank.len();
    for (k, r) in rank.iter().enumerate() {
        cum += r.2.exp();
        if cum >= mass as f64 {
            keep = k + 1;
            break;
        }
    }
    for r in &rank[keep..] {
        row[r.1 as usize] = f32::NEG_INFINITY;
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
