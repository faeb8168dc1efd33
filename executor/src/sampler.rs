//! Token sampling: greedy, temperature, top-k, top-p, with a seeded generator.
//! Invariant: temperature 0 is exactly argmax (lowest id on ties); the same seed and logits
//! give the same token; sampling allocates nothing after the first call.

/// Sampling settings of one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = no top-k cut.
    pub top_k: usize,
    /// 1 = no nucleus cut.
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// A sampler with its own generator state and reusable candidate buffer.
pub struct Sampler {
    params: SamplingParams,
    state: u64,
    cand: Vec<(f32, u32)>,
}

/// Index of the largest logit (lowest index on ties; NaN never wins).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut bv = f32::NEG_INFINITY;
    for (i, v) in logits.iter().enumerate() {
        if *v > bv {
            bv = *v;
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Self {
            params,
            // splitmix64 seeding: a zero seed still gives a live generator.
            state: params.seed ^ 0x9E37_79B9_7F4A_7C15,
            cand: Vec::new(),
        }
    }

    pub fn params(&self) -> SamplingParams {
        self.params
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Pick the next token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = self.params;
        if p.temperature <= 0.0 || logits.is_empty() {
            return argmax(logits);
        }
        self.cand.clear();
        self.cand.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, v)| v.is_finite())
                .map(|(i, v)| (*v, i as u32)),
        );
        if self.cand.is_empty() {
            return argmax(logits);
        }
        // Highest logit first; ties by id for determinism.
        self.cand
            .sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        if p.top_k > 0 && p.top_k < self.cand.len() {
            self.cand.truncate(p.top_k);
        }
        let max = self.cand[0].0;
        let mut sum = 0.0f64;
        for c in self.cand.iter_mut() {
            let w = (((c.0 - max) / p.temperature) as f64).exp();
            c.0 = w as f32;
            sum += w;
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0f64;
            let mut keep = self.cand.len();
            for (i, c) in self.cand.iter().enumerate() {
                acc += c.0 as f64 / sum;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            self.cand.truncate(keep.max(1));
            sum = self.cand.iter().map(|c| c.0 as f64).sum();
        }
        let mut r = self.next_f64() * sum;
        for c in &self.cand {
            r -= c.0 as f64;
            if r < 0.0 {
                return c.1;
            }
        }
        self.cand.last().map_or(0, |c| c.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax_with_lowest_id_on_ties() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0]), 1);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_cuts() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let params = SamplingParams {
            temperature: 0.8,
            top_k: 5,
            top_p: 0.9,
            seed: 42,
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(params);
            (0..200).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(params);
            (0..200).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b, "same seed, same tokens");
        let mut order: Vec<u32> = (0..50).collect();
        order.sort_by(|x, y| logits[*y as usize].total_cmp(&logits[*x as usize]));
        let top5: Vec<u32> = order[..5].to_vec();
        assert!(a.iter().all(|t| top5.contains(t)), "top-k 5 respected");
        let distinct: std::collections::BTreeSet<_> = a.iter().collect();
        assert!(distinct.len() > 1, "temperature sampling is not greedy");
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1e-6,
            seed: 1,
        });
        assert_eq!(
            s.sample(&logits),
            order[0],
            "a tiny top_p keeps only the best token"
        );
    }
}
