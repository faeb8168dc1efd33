//! Token sampling: greedy, temperature, top-k, top-p, with a seeded generator, defined so
//! that a GPU picks the same token from the same logits (`kernels/cuda/sample.cu` follows
//! [`sample_with`] step for step).
//!
//! A draw keeps the finite logits whose order key ([`order_key`]) is at least two thresholds:
//! the top-k one (the k-th largest logit; ties with it stay in) and the top-p one (the largest
//! logit whose descending prefix of kept tokens carries at least `top_p` of their softmax
//! mass, counted in fixed point). Among the kept tokens it takes the largest
//! `(l - max) / temperature + g`, where `g` is Gumbel noise hashed from the draw's key and the
//! token id (the Gumbel-max trick: this picks token i with probability softmax_i over the
//! kept set, in one pass with no sort and no cumulative walk, so a GPU can run it in
//! parallel). Ties go to the lowest id.
//! Invariant: temperature 0 is exactly [`argmax`]; the same seed and logits give the same
//! tokens; sampling allocates nothing after the first call; every step is f32 (or integer)
//! arithmetic a GPU repeats, so only the last-place error of `exp`/`ln` can make the two differ.

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

/// Everything one token's pick needs: the request's settings and this step's noise key.
/// `#[repr(C)]` with the layout of `sample.cu`'s `SampleDraw` (32 bytes), which a GPU
/// engine copies to the device as is.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Draw {
    pub temperature: f32,
    /// 0 = no top-k cut (values above `u32::MAX` are treated as no cut).
    pub top_k: u32,
    pub top_p: f32,
    pub _pad: u32,
    /// The Gumbel noise of token i is [`gumbel`]`(key, i)`.
    pub key: u64,
    pub _pad2: u64,
}

impl Draw {
    /// A greedy draw (temperature 0).
    pub const GREEDY: Draw = Draw {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        _pad: 0,
        key: 0,
        _pad2: 0,
    };

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.temperature.is_nan()
    }

    /// The bytes a GPU engine copies to the device.
    pub fn to_bytes(&self) -> [u8; 32] {
        let mut b = [0u8; 32];
        b[0..4].copy_from_slice(&self.temperature.to_le_bytes());
        b[4..8].copy_from_slice(&self.top_k.to_le_bytes());
        b[8..12].copy_from_slice(&self.top_p.to_le_bytes());
        b[16..24].copy_from_slice(&self.key.to_le_bytes());
        b
    }
}

/// Fixed-point unit of a kept token's weight `exp((l - max) / T)` in the top-p count
/// (the largest weight, 1, is 2^32; the sum over 2^31 tokens still fits a u64).
pub const MASS_ONE: f32 = 4_294_967_296.0;

/// The token id the row-level pickers ([`argmax_rows`], [`sample_rows`], [`Sampler::sample`])
/// return for a row holding NaN or +inf: the model's numerics broke, and no token may be
/// drawn from it. Callers end the request with an error naming the problem. (Engines that
/// pick on their device return the same id for such a row.)
pub const NON_FINITE: u32 = u32::MAX - 1;

/// Whether a row of logits may be sampled: no NaN and no +inf (-inf marks a banned token).
pub fn row_is_sound(row: &[f32]) -> bool {
    row.iter().all(|v| !v.is_nan() && *v != f32::INFINITY)
}

/// The error a request ends with when its logits were [`NON_FINITE`].
pub fn non_finite_message(step: &str) -> String {
    format!(
        "the model produced NaN or infinite logits at {step}: its weights or numerics are broken (check the model file for NaN/Inf weights; strata-exec checks them at load unless --allow-non-finite-weights)"
    )
}

/// A sampler with its own generator state and reusable candidate buffer.
pub struct Sampler {
    params: SamplingParams,
    state: u64,
    cand: Vec<(u32, u32)>,
}

/// Index of the largest logit (lowest index on ties; NaN and -inf never win; 0 when nothing
/// else does).
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

/// A u32 that orders floats as `f32::total_cmp` does (for finite values, as `<` does, with
/// -0 below +0): the sign bit flipped for positives, every bit for negatives.
pub fn order_key(v: f32) -> u32 {
    let u = v.to_bits();
    if u & 0x8000_0000 != 0 {
        !u
    } else {
        u | 0x8000_0000
    }
}

/// splitmix64's output mix.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// Gumbel(0, 1) noise of token `i` under `key`: `-ln(E)` with `E = -ln(1 - v)` exponential,
/// `v` the top 53 bits of a hash of (key, i) (forced odd, so never 0) rounded to f32; `ln_1p`
/// keeps E's relative precision for small v, which is where the winners' noise comes from
/// (the largest noise is about 36.7; a v rounded up to 1 gives -inf, a token that cannot win).
pub fn gumbel(key: u64, i: u32) -> f32 {
    let z = mix64(key.wrapping_add((i as u64 + 1).wrapping_mul(GOLDEN)));
    let v = ((z >> 11) | 1) as f32 * (1.0 / 9_007_199_254_740_992.0);
    -(-(-v).ln_1p()).ln()
}

/// The fixed-point top-p weight of a kept logit `l` (see [`MASS_ONE`]).
pub fn mass(l: f32, max: f32, temperature: f32) -> u64 {
    (((l - max) / temperature).exp() * MASS_ONE) as u64
}

/// Pick a token from one row of logits with one draw (see the module comment). `cand` is
/// scratch (reused to avoid allocating).
pub fn sample_into(logits: &[f32], d: &Draw, cand: &mut Vec<(u32, u32)>) -> u32 {
    if d.is_greedy() || logits.is_empty() {
        return argmax(logits);
    }
    let t = d.temperature;
    let Some((thr, max)) = kept(logits, d, cand) else {
        return argmax(logits);
    };
    let mut best = (f32::NEG_INFINITY, u32::MAX);
    for c in cand.iter() {
        if c.0 < thr {
            continue;
        }
        let s = (logits[c.1 as usize] - max) / t + gumbel(d.key, c.1);
        if s > best.0 || (s == best.0 && c.1 < best.1) {
            best = (s, c.1);
        }
    }
    if best.1 == u32::MAX {
        argmax(logits)
    } else {
        best.1
    }
}

/// The kept set of a (non-greedy) draw: fills `cand` with the finite logits' (order key, id)
/// and returns the smallest kept key and the largest logit; `None` when no logit is finite.
fn kept(logits: &[f32], d: &Draw, cand: &mut Vec<(u32, u32)>) -> Option<(u32, f32)> {
    let t = d.temperature;
    cand.clear();
    cand.extend(
        logits
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .map(|(i, v)| (order_key(*v), i as u32)),
    );
    if cand.is_empty() {
        return None;
    }
    let k = d.top_k as usize;
    let need_sort = (k > 0 && k < cand.len()) || d.top_p < 1.0;
    let mut thr = 0u32;
    if need_sort {
        // Highest key first (ids do not matter: thresholds keep whole tie groups).
        cand.sort_unstable_by_key(|c| std::cmp::Reverse(c.0));
        if k > 0 && k < cand.len() {
            thr = cand[k - 1].0;
        }
    }
    let max = cand.iter().map(|c| c.0).max().map(from_key).unwrap_or(0.0);
    if d.top_p < 1.0 {
        let kept = cand.iter().take_while(|c| c.0 >= thr);
        let total: u64 = kept
            .clone()
            .map(|c| mass(logits[c.1 as usize], max, t))
            .sum();
        let target =
            ((d.top_p.max(0.0) as f64 * total as f64).ceil() as u64).clamp(1, total.max(1));
        let mut acc = 0u64;
        for c in kept {
            acc += mass(logits[c.1 as usize], max, t);
            if acc >= target {
                thr = thr.max(c.0);
                break;
            }
        }
    }
    Some((thr, max))
}

/// The distribution [`sample_into`] draws from under `d` (its temperature, top-k and top-p;
/// the key does not matter): `out[i]` the probability of token i (one-hot on the argmax for
/// a greedy draw). The speculative sampling rule compares these (`pipeline/spec.rs`).
pub fn probs_into(logits: &[f32], d: &Draw, cand: &mut Vec<(u32, u32)>, out: &mut [f32]) {
    out.fill(0.0);
    let kept_set = if d.is_greedy() {
        None
    } else {
        kept(logits, d, cand)
    };
    let Some((thr, max)) = kept_set else {
        if let Some(o) = out.get_mut(argmax(logits) as usize) {
            *o = 1.0;
        }
        return;
    };
    let mut total = 0f64;
    for c in cand.iter().filter(|c| c.0 >= thr) {
        let w = ((logits[c.1 as usize] - max) / d.temperature).exp();
        out[c.1 as usize] = w;
        total += w as f64;
    }
    let inv = (1.0 / total.max(f64::MIN_POSITIVE)) as f32;
    out.iter_mut().for_each(|v| *v *= inv);
}

/// A uniform draw in [0, 1) from `key` and a stream index `i` (the speculative sampling
/// rule's coins).
pub fn uniform(key: u64, i: u32) -> f64 {
    let z = mix64(key ^ mix64((i as u64 + 1).wrapping_mul(GOLDEN)));
    (z >> 11) as f64 * (1.0 / 9_007_199_254_740_992.0)
}

/// [`argmax`] of consecutive rows of `n_vocab` logits into `out` (as many rows as the
/// shorter of the two gives).
pub fn argmax_rows(logits: &[f32], n_vocab: usize, out: &mut [u32]) {
    for (o, row) in out.iter_mut().zip(logits.chunks_exact(n_vocab.max(1))) {
        *o = if row_is_sound(row) {
            argmax(row)
        } else {
            NON_FINITE
        };
    }
}

/// [`sample_into`] for consecutive rows of `n_vocab` logits: `out[i]` gets row i's token
/// under `draws[i]` (as many rows as the shortest of the three gives).
pub fn sample_rows(logits: &[f32], n_vocab: usize, draws: &[Draw], out: &mut [u32]) {
    let mut cand = Vec::new();
    for ((o, row), d) in out
        .iter_mut()
        .zip(logits.chunks_exact(n_vocab.max(1)))
        .zip(draws)
    {
        *o = if row_is_sound(row) {
            sample_into(row, d, &mut cand)
        } else {
            NON_FINITE
        };
    }
}

/// [`sample_into`] with its own scratch.
pub fn sample_with(logits: &[f32], d: &Draw) -> u32 {
    sample_into(logits, d, &mut Vec::new())
}

/// The float an [`order_key`] came from.
fn from_key(k: u32) -> f32 {
    f32::from_bits(if k & 0x8000_0000 != 0 {
        k & 0x7fff_ffff
    } else {
        !k
    })
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Self {
            params,
            // splitmix64 seeding: a zero seed still gives a live generator.
            state: params.seed ^ GOLDEN,
            cand: Vec::new(),
        }
    }

    pub fn params(&self) -> SamplingParams {
        self.params
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN);
        mix64(self.state)
    }

    /// The next step's draw (advances the generator, also for greedy requests, so a
    /// request's tokens do not depend on which steps were greedy).
    pub fn next_draw(&mut self) -> Draw {
        let p = self.params;
        Draw {
            temperature: p.temperature,
            top_k: u32::try_from(p.top_k).unwrap_or(0),
            top_p: p.top_p,
            _pad: 0,
            key: self.next_u64(),
            _pad2: 0,
        }
    }

    /// Pick the next token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let d = self.next_draw();
        if !row_is_sound(logits) {
            return NON_FINITE;
        }
        sample_into(logits, &d, &mut self.cand)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_with_nan_or_inf_give_the_non_finite_id() {
        let v = 4;
        let rows = [
            0.0,
            1.0,
            2.0,
            f32::NEG_INFINITY, // sound: -inf is a banned token
            0.0,
            f32::NAN,
            2.0,
            1.0, // NaN
            f32::INFINITY,
            0.0,
            0.0,
            0.0, // +inf
        ];
        let mut out = [0u32; 3];
        argmax_rows(&rows, v, &mut out);
        assert_eq!(out, [2, NON_FINITE, NON_FINITE]);
        let d = Draw {
            temperature: 0.8,
            ..Draw::GREEDY
        };
        let mut out = [0u32; 3];
        sample_rows(&rows, v, &[d, d, d], &mut out);
        assert_ne!(out[0], NON_FINITE);
        assert_eq!(out[1..], [NON_FINITE, NON_FINITE]);
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[f32::NAN; 4]), NON_FINITE);
        assert_eq!(s.sample(&[0.0, 3.0, 1.0, 0.0]), 1);
        assert!(non_finite_message("step 3").contains("NaN"));
    }

    #[test]
    fn greedy_is_argmax_with_lowest_id_on_ties() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY]), 0);
    }

    #[test]
    fn order_key_orders_like_total_cmp() {
        let v = [
            f32::NEG_INFINITY,
            -3.5,
            -1e-30,
            -0.0,
            0.0,
            1e-30,
            2.0,
            f32::MAX,
            f32::INFINITY,
        ];
        for w in v.windows(2) {
            assert!(order_key(w[0]) < order_key(w[1]), "{} < {}", w[0], w[1]);
            assert_eq!(from_key(order_key(w[0])).to_bits(), w[0].to_bits());
        }
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

    /// Frequencies over 40,000 draws against the softmax of the kept set (each within 5
    /// standard deviations), for plain temperature, top-k (ties with the k-th kept) and
    /// top-p (the nucleus is the smallest prefix reaching p).
    #[test]
    fn frequencies_follow_the_softmax_of_the_kept_tokens() {
        let logits = [
            1.0f32,
            0.5,
            2.0,
            -1.0,
            0.5,
            f32::NAN,
            1.5,
            f32::NEG_INFINITY,
        ];
        let t = 0.7f32;
        let w: Vec<f64> = logits
            .iter()
            .map(|l| {
                if l.is_finite() {
                    ((l - 2.0) / t).exp() as f64
                } else {
                    0.0
                }
            })
            .collect();
        // (top_k, top_p, the kept ids)
        let cases: [(u32, f32, &[usize]); 4] = [
            (0, 1.0, &[0, 1, 2, 3, 4, 6]),
            // The 4th largest is 0.5, held by ids 1 and 4: both stay.
            (4, 1.0, &[0, 1, 2, 4, 6]),
            (2, 1.0, &[2, 6]),
            (0, 0.6, &[]),
        ];
        let z: f64 = w.iter().sum();
        // top-p 0.6: masses sorted 2.0, 1.5, 1.0, ...; the prefix {2} has w2/z, {2,6} more.
        let p2 = w[2] / z;
        let nucleus: Vec<usize> = if p2 >= 0.6 { vec![2] } else { vec![2, 6] };
        let n = 40_000;
        for (k, p, kept) in cases {
            let kept: Vec<usize> = if kept.is_empty() {
                nucleus.clone()
            } else {
                kept.to_vec()
            };
            let mut s = Sampler::new(SamplingParams {
                temperature: t,
                top_k: k as usize,
                top_p: p,
                seed: 7 + k as u64,
            });
            let mut count = [0usize; 8];
            let mut cand = Vec::new();
            for _ in 0..n {
                // `sample_into` itself: the NaN here must never be drawn (`Sampler::sample`
                // refuses a row holding one outright).
                let d = s.next_draw();
                count[sample_into(&logits, &d, &mut cand) as usize] += 1;
            }
            let zk: f64 = kept.iter().map(|&i| w[i]).sum();
            for (i, &c) in count.iter().enumerate() {
                let want = if kept.contains(&i) { w[i] / zk } else { 0.0 };
                let sd = (want * (1.0 - want) / n as f64).sqrt().max(1e-9);
                let got = c as f64 / n as f64;
                assert!(
                    (got - want).abs() <= 5.0 * sd,
                    "top_k {k} top_p {p}: token {i} drawn {got:.4}, softmax of the kept {want:.4}"
                );
            }
        }
    }

    #[test]
    fn gumbel_noise_is_finite_and_key_dependent() {
        let a: Vec<f32> = (0..1000).map(|i| gumbel(1, i)).collect();
        let b: Vec<f32> = (0..1000).map(|i| gumbel(2, i)).collect();
        assert!(a.iter().all(|g| g.is_finite() && *g > -3.0 && *g < 37.0));
        assert_ne!(a, b);
        // Gumbel(0, 1) has mean 0.5772 (Euler-Mascheroni) and sd pi/sqrt(6) = 1.28.
        let mean = a.iter().map(|g| *g as f64).sum::<f64>() / a.len() as f64;
        assert!(
            (mean - 0.5772).abs() < 5.0 * 1.28 / (1000f64).sqrt(),
            "mean {mean}"
        );
    }

    #[test]
    fn no_finite_logit_falls_back_to_argmax() {
        let d = Draw {
            temperature: 1.0,
            key: 3,
            ..Draw::GREEDY
        };
        assert_eq!(sample_with(&[f32::NAN, f32::INFINITY, 1.0 / 0.0], &d), 1);
        assert_eq!(sample_with(&[f32::NAN, f32::NAN], &d), 0);
    }
}
