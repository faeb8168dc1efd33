//! Token columns the grouped expert products (`moe_sort` then `moe_gemm*` over the tile list,
//! `kernels/cuda/gemm.cu`) compute in a prefill pass: every routed expert's tokens rounded up
//! to whole tiles of [`MOE_TILE_TOKENS`]. A tile costs the same whether its columns hold
//! tokens or padding (its weights are decoded once and its tensor-core products run over
//! every column), so the cost model prices the grouped products by these padded columns,
//! relative to the shape the probe measured its rate at.
//! Invariant: pure arithmetic of the routing shares with fixed operation order (powers by
//! repeated squaring, no platform `powf`), so a plan's figures are the same bits everywhere.

use crate::workset::MOE_TILE_TOKENS;

/// `x^n` by repeated squaring (the same bits on every platform).
pub(crate) fn pow(x: f64, mut n: u64) -> f64 {
    let (mut base, mut acc) = (x, 1.0f64);
    while n > 0 {
        if n & 1 == 1 {
            acc *= base;
        }
        base *= base;
        n >>= 1;
    }
    acc
}

/// Expected padded token columns of one layer's grouped products over `tokens` tokens whose
/// experts are picked with `shares` (each expert's expected uses per token, summing to the
/// experts a token uses): an expert with `c = tokens x share` expected tokens gets any with
/// probability `1 - (1 - share)^tokens` and then takes `max(1, ceil(c / T))` tiles of `T`
/// columns.
pub fn padded_columns(shares: &[f64], tokens: u64) -> f64 {
    if tokens == 0 {
        return 0.0;
    }
    let t = MOE_TILE_TOKENS as f64;
    shares
        .iter()
        .map(|&p| {
            let p = p.clamp(0.0, 1.0);
            if p == 0.0 {
                return 0.0;
            }
            let c = tokens as f64 * p;
            (1.0 - pow(1.0 - p, tokens)) * (c / t).ceil().max(1.0) * t
        })
        .sum()
}

/// Padded columns over useful ones (`tokens x` the shares' sum): 1 when every tile is full.
pub fn padding(shares: &[f64], tokens: u64) -> f64 {
    let useful = tokens as f64 * shares.iter().sum::<f64>();
    if useful <= 0.0 {
        return 1.0;
    }
    padded_columns(shares, tokens) / useful
}

/// Expected distinct experts of one layer that `tokens` tokens pick outside the cache, when
/// the experts are picked with `shares` (busiest first, each expert's expected uses per
/// token, summing to the experts a token uses) and the cache holds the busiest ones up to a
/// `hit_rate` share of the uses: each expert counts with its chance of being picked at all,
/// `1 - (1 - share)^tokens`, times the part of it outside the cache. One token's picks give
/// `k x (1 - hit_rate)`, the decode figure; a long pass gives every expert outside the cache,
/// which a skewed routing's hit rate understates (a tenth of the uses can be a quarter of
/// the experts).
pub fn outside_touched(shares: &[f64], tokens: u64, hit_rate: f64) -> f64 {
    let k: f64 = shares.iter().sum();
    if tokens == 0 || k <= 0.0 {
        return 0.0;
    }
    let cached = hit_rate.clamp(0.0, 1.0) * k;
    let mut before = 0.0;
    let mut out = 0.0;
    for &p in shares {
        let p = p.clamp(0.0, 1.0);
        if p > 0.0 {
            let inside = ((cached - before) / p).clamp(0.0, 1.0);
            out += (1.0 - inside) * (1.0 - pow(1.0 - p, tokens));
        }
        before += p;
    }
    out
}

/// Uniform routing: `k / e` for each of `e` experts.
pub fn uniform(e: u32, k: u32) -> Vec<f64> {
    if e == 0 {
        return Vec::new();
    }
    vec![f64::from(k.min(e)) / f64::from(e); e as usize]
}

/// The padding of the probe's measured shape, known by its tokens an expert `r` (uniform
/// routing over a pass long enough that every expert is routed): `ceil(r / T) T / r`.
pub fn reference_padding(tokens_per_expert: f64) -> f64 {
    let t = MOE_TILE_TOKENS as f64;
    if tokens_per_expert.is_nan() || tokens_per_expert <= 0.0 {
        return 1.0;
    }
    (tokens_per_expert / t).ceil().max(1.0) * t / tokens_per_expert
}

/// How many times longer per useful flop the grouped products take over `tokens` tokens
/// routed by `shares` than at the probe's shape of `ref_tokens_per_expert`: the ratio of
/// their paddings, at least 1 (the probe's rate is the best the model credits, so its own
/// shape is priced as measured and fuller tiles are not promised to run faster).
pub fn slowdown(shares: &[f64], tokens: u64, ref_tokens_per_expert: f64) -> f64 {
    (padding(shares, tokens) / reference_padding(ref_tokens_per_expert)).max(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn powers_match_the_platform_within_rounding() {
        for (x, n) in [(0.9f64, 7u64), (1.0 - 10.0 / 512.0, 512), (0.5, 0)] {
            let want = x.powi(n as i32);
            assert!((pow(x, n) - want).abs() <= 1e-12 * want.max(1.0), "{x}^{n}");
        }
    }

    /// The 30B's pp512 (top-8 of 128: 32 tokens an expert) half fills each expert's tile;
    /// the 80B's (top-10 of 512: 10 an expert) fills under a sixth.
    #[test]
    fn fewer_tokens_an_expert_pad_more() {
        let thirty = uniform(128, 8);
        let p30 = padding(&thirty, 512);
        assert!((p30 - 2.0).abs() < 1e-6, "{p30}");
        assert!((reference_padding(32.0) - 2.0).abs() < 1e-12);
        assert!((slowdown(&thirty, 512, 32.0) - 1.0).abs() < 1e-6);
        let eighty = uniform(512, 10);
        let p80 = padding(&eighty, 512);
        assert!((p80 - 6.4).abs() < 1e-3, "{p80}");
        let s = slowdown(&eighty, 512, 32.0);
        assert!((s - 3.2).abs() < 1e-3, "{s}");
        // Shorter passes pad more, longer ones less, never under the probe's rate.
        assert!(slowdown(&eighty, 128, 32.0) > s);
        assert_eq!(slowdown(&thirty, 4096, 32.0), 1.0);
        // Full tiles at the reference: a 64-token shape is the fastest the model credits.
        assert_eq!(reference_padding(64.0), 1.0);
    }

    /// The same routing mass on a few busy experts takes more tiles: the busy ones several,
    /// the idle ones still one each.
    #[test]
    fn a_skewed_routing_takes_more_tiles_than_a_uniform_one() {
        let (e, k) = (128u32, 8u32);
        let uni = uniform(e, k);
        // Three fifths of the picks on an eighth of the experts (the skewed test file's).
        let hot = 0.6 * f64::from(k) / 16.0;
        let cold = 0.4 * f64::from(k) / 112.0;
        let skew: Vec<f64> = (0..e).map(|i| if i < 16 { hot } else { cold }).collect();
        let sum: f64 = skew.iter().sum();
        assert!((sum - f64::from(k)).abs() < 1e-9);
        let (pu, ps) = (padding(&uni, 512), padding(&skew, 512));
        assert!(ps > 1.2 * pu, "{ps} vs {pu}");
        assert!(slowdown(&skew, 512, 32.0) > 1.2);
    }

    #[test]
    fn a_long_pass_touches_every_expert_outside_the_cache() {
        // Uniform, 128 experts top-8, the cache holding 3/4 of them.
        let u = uniform(128, 8);
        let one = outside_touched(&u, 1, 0.75);
        assert!(
            (one - 8.0 * 0.25).abs() < 1e-9,
            "one token: k (1 - hit) = 2, got {one}"
        );
        let long = outside_touched(&u, 512, 0.75);
        assert!(
            (long - 32.0).abs() < 1e-6,
            "512 tokens: all 32 outside, got {long}"
        );
        // Skewed: 8 busy experts take 3/4 of the uses, 120 share the rest; the cache holds
        // the 8 busy ones and a few more (hit rate 0.8). A token misses k x 0.2 = 1.6 experts,
        // but a long pass streams nearly every expert the cache lacks (well over 128 x 0.2).
        let mut sk = vec![0.75; 8];
        sk.extend(std::iter::repeat_n(2.0 / 120.0, 120));
        let one = outside_touched(&sk, 1, 0.8);
        assert!((one - 1.6).abs() < 1e-9, "one token: {one}");
        let cached_ranks = 8.0 + (0.8 * 8.0 - 6.0) / (2.0 / 120.0);
        let long = outside_touched(&sk, 512, 0.8);
        assert!(
            long > 0.99 * (128.0 - cached_ranks) && long <= 128.0 - cached_ranks + 1e-9,
            "a long pass touches the {} experts outside, got {long}",
            128.0 - cached_ranks
        );
        assert!(
            long > 3.0 * 128.0 * 0.2,
            "the hit rate understates it: {long}"
        );
        // Nothing outside a full cache; more tokens never touch fewer.
        assert!(outside_touched(&sk, 512, 1.0) < 1e-9);
        let mut last = 0.0;
        for t in [1, 2, 8, 64, 512, 4096] {
            let x = outside_touched(&sk, t, 0.8);
            assert!(x >= last, "{t} tokens: {x} < {last}");
            last = x;
        }
    }

    #[test]
    fn empty_and_degenerate_inputs_cost_nothing_extra() {
        assert_eq!(padded_columns(&uniform(128, 8), 0), 0.0);
        assert_eq!(padding(&[], 512), 1.0);
        assert_eq!(reference_padding(0.0), 1.0);
        assert!(uniform(0, 8).is_empty());
    }
}
