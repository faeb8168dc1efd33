//! Which experts start resident in each device's cache, and the hit rate that buys.
//! Invariant: selection is by greatest marginal hit gain (expected uses per token) with a
//! deterministic tie order (rank within layer, then layer), so equal inputs pick equal sets;
//! without a profile every expert of a layer is equally likely (n_expert_used / n_expert).
//! The hit rate is the LRU curve of the profile's reuse histogram (format v2) when it has
//! one — what the executors' LRU caches do — else the resident set's share of the routing
//! mass, which knows nothing of reuse between tokens and is reported as a guess.

use crate::facts::ModelFacts;
use strata_schemas::profile::{ExpertProfile, ReuseHistogram};

struct LayerProbs {
    /// Expected uses per token, descending.
    sorted: Vec<f64>,
    /// prefix[i] = sum of sorted[..i].
    prefix: Vec<f64>,
    /// Expert ids in the order of `sorted`.
    order: Vec<u32>,
}

impl LayerProbs {
    /// Sort one layer's expected uses, best first (ties by expert id).
    fn new(probs: &[f64]) -> Self {
        let mut order: Vec<u32> = (0..probs.len() as u32).collect();
        order.sort_by(|a, b| {
            probs[*b as usize]
                .total_cmp(&probs[*a as usize])
                .then(a.cmp(b))
        });
        let sorted: Vec<f64> = order.iter().map(|i| probs[*i as usize]).collect();
        let mut prefix = vec![0.0; sorted.len() + 1];
        for (i, p) in sorted.iter().enumerate() {
            prefix[i + 1] = prefix[i] + p;
        }
        Self {
            sorted,
            prefix,
            order,
        }
    }
}

/// Expected expert uses per token, per main layer, from a profile or uniform.
pub struct ExpertOracle {
    n_expert: u64,
    n_expert_used: u64,
    /// `None` for a layer without experts.
    layers: Vec<Option<LayerProbs>>,
    uniform: bool,
    /// The profile's decode stack distances, pooled over every main layer with experts
    /// (`expert_layers` of them), when it records any reuse.
    curve: Option<ReuseHistogram>,
    expert_layers: u64,
    /// Whether a profile was given (with or without reuse).
    profiled: bool,
}

/// Where a plan's predicted hit rate comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HitSource {
    /// Every expert has a slot: no misses.
    AllResident,
    /// The profile's LRU reuse curve at the planned slots.
    ReuseCurve,
    /// The resident set's share of the profile's routing counts (a v1 profile: no reuse).
    ProfileShare,
    /// Uniform routing assumed (no profile).
    Uniform,
}

impl HitSource {
    /// The report's wording (JSON `predicted.expert_hit_source` and the text report).
    pub fn describe(self) -> &'static str {
        match self {
            HitSource::AllResident => "every expert resident: no misses",
            HitSource::ReuseCurve => {
                "measured: the expert profile's LRU reuse curve (stack distances of its decode steps) at the planned slots"
            }
            HitSource::ProfileShare => {
                "a guess: the resident experts' share of the profile's routing counts (a v1 profile records no reuse; record one with this strata-exec profile)"
            }
            HitSource::Uniform => {
                "a guess: uniform routing assumed (pass --expert-profile from strata-exec profile for a measured curve)"
            }
        }
    }
}

impl ExpertOracle {
    pub fn new(facts: &ModelFacts, profile: Option<&ExpertProfile>) -> Self {
        let e = facts.n_expert;
        let used = facts.n_expert_used;
        let mut layers = Vec::with_capacity(facts.n_layer as usize);
        for l in 0..facts.n_layer {
            if facts.expert[l as usize] == 0 || e == 0 {
                layers.push(None);
                continue;
            }
            let probs: Vec<f64> = match profile {
                Some(p) if l < p.layers => p.probabilities(l, used),
                _ => vec![used as f64 / e as f64; e as usize],
            };
            layers.push(Some(LayerProbs::new(&probs)));
        }
        let curve = profile
            .and_then(|p| p.reuse.as_ref())
            .map(|r| r.decode.clone())
            .filter(|h| h.reuses() > 0);
        let expert_layers = layers.iter().flatten().count() as u64;
        Self {
            n_expert: e,
            n_expert_used: used,
            layers,
            uniform: profile.is_none(),
            curve,
            expert_layers,
            profiled: profile.is_some(),
        }
    }

    /// Whether `slots` hold every expert of layers `[a, b)`.
    pub fn covers(&self, a: u32, b: u32, slots: u64) -> bool {
        let n_layers = self.layers[a as usize..b as usize].iter().flatten().count() as u64;
        slots >= n_layers * self.n_expert
    }

    /// Where a plan's hit rate comes from; `all_covered`: every device's slots hold every
    /// expert of its layers.
    pub fn source(&self, all_covered: bool) -> HitSource {
        match (all_covered, &self.curve, self.profiled) {
            (true, _, _) => HitSource::AllResident,
            (false, Some(_), _) => HitSource::ReuseCurve,
            (false, None, true) => HitSource::ProfileShare,
            (false, None, false) => HitSource::Uniform,
        }
    }

    /// Share of expert references an LRU cache of `slots` over layers `[a, b)` serves, from
    /// the profile's reuse curve: its distances count (layer, expert) pairs of every expert
    /// layer, so a range of fewer layers sees `slots x all / range` of them (exact for one
    /// device holding every layer; for a split, layers assumed alike). `None` without a curve.
    pub fn curve_hit_rate(&self, a: u32, b: u32, slots: u64) -> Option<f64> {
        let c = self.curve.as_ref()?;
        let n_layers = self.layers[a as usize..b as usize].iter().flatten().count() as u64;
        if n_layers == 0 {
            return None;
        }
        c.hit_rate(slots as f64 * self.expert_layers as f64 / n_layers as f64)
    }

    /// Each expert's expected uses per token over layers `[a, b)`, ranked busiest first
    /// within each layer and averaged rank by rank (the cost model's tile count of the
    /// grouped prefill products: a close approximation of averaging each layer's count, as
    /// layers' skews are alike); empty without a profile (uniform routing) or experts.
    pub fn rank_shares(&self, a: u32, b: u32) -> Vec<f64> {
        if self.uniform {
            return Vec::new();
        }
        let layers: Vec<&LayerProbs> = self.layers[a as usize..b as usize]
            .iter()
            .flatten()
            .collect();
        let Some(first) = layers.first() else {
            return Vec::new();
        };
        let n = layers.len() as f64;
        (0..first.sorted.len())
            .map(|i| layers.iter().map(|l| l.sorted[i]).sum::<f64>() / n)
            .collect()
    }

    /// Expected expert uses per token over layers `[a, b)`.
    pub fn total_mass(&self, a: u32, b: u32) -> f64 {
        self.layers[a as usize..b as usize].iter().flatten().count() as f64
            * self.n_expert_used as f64
    }

    /// Expected uses per token served from cache when `slots` slots serve layers `[a, b)`:
    /// the reuse curve's hit rate times the total when the profile has one, else the mass of
    /// the `slots` best experts (they stay resident).
    pub fn cached_mass(&self, a: u32, b: u32, slots: u64) -> f64 {
        let range = &self.layers[a as usize..b as usize];
        let n_layers = range.iter().flatten().count() as u64;
        let all = n_layers * self.n_expert;
        if slots >= all {
            return self.total_mass(a, b);
        }
        if let Some(h) = self.curve_hit_rate(a, b, slots) {
            return h * self.total_mass(a, b);
        }
        if self.uniform {
            return slots as f64 * self.n_expert_used as f64 / self.n_expert as f64;
        }
        // Threshold search: the `slots` largest values over the union of sorted layers.
        let count_above = |x: f64| -> (u64, f64) {
            let mut c = 0u64;
            let mut s = 0.0;
            for lp in range.iter().flatten() {
                let k = lp.sorted.partition_point(|v| *v > x);
                c += k as u64;
                s += lp.prefix[k];
            }
            (c, s)
        };
        let mut lo = 0.0f64;
        let mut hi = range
            .iter()
            .flatten()
            .map(|lp| lp.sorted[0])
            .fold(0.0, f64::max);
        for _ in 0..48 {
            let mid = 0.5 * (lo + hi);
            if count_above(mid).0 >= slots {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let (c, s) = count_above(hi);
        s + (slots.saturating_sub(c)) as f64 * hi
    }

    /// The experts to make resident: `slots` (layer, expert) pairs of layers `[a, b)`, best
    /// first.
    pub fn select(&self, a: u32, b: u32, slots: u64) -> Vec<(u32, u32)> {
        let mut all: Vec<(f64, u32, u32, u32)> = Vec::new();
        for l in a..b {
            if let Some(lp) = &self.layers[l as usize] {
                for (rank, (p, e)) in lp.sorted.iter().zip(&lp.order).enumerate() {
                    all.push((*p, rank as u32, l, *e));
                }
            }
        }
        all.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
        all.truncate(slots as usize);
        all.into_iter().map(|(_, _, l, e)| (l, e)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn oracle_from(counts: Vec<Vec<u64>>, used: u64) -> ExpertOracle {
        let e = counts[0].len() as u64;
        let layers = counts.len() as u32;
        let profile = ExpertProfile {
            layers,
            experts: e as u32,
            counts: counts.into_iter().flatten().collect(),
            reuse: None,
        };
        let layers_probs = (0..layers)
            .map(|l| Some(LayerProbs::new(&profile.probabilities(l, used))))
            .collect();
        ExpertOracle {
            n_expert: e,
            n_expert_used: used,
            layers: layers_probs,
            uniform: false,
            curve: None,
            expert_layers: layers as u64,
            profiled: true,
        }
    }

    #[test]
    fn cached_mass_matches_brute_force_top_k() {
        let counts = vec![
            vec![10, 0, 5, 5, 1, 9],
            vec![3, 3, 3, 30, 0, 1],
            vec![0, 0, 0, 0, 0, 0],
        ];
        let o = oracle_from(counts, 2);
        let mut all: Vec<f64> = Vec::new();
        for l in 0..3 {
            all.extend(o.layers[l].as_ref().unwrap().sorted.iter());
        }
        all.sort_by(|a, b| b.total_cmp(a));
        for k in 0..=18u64 {
            let brute: f64 = all.iter().take(k as usize).sum();
            let got = o.cached_mass(0, 3, k);
            assert!((brute - got).abs() < 1e-9, "k={k} brute={brute} got={got}");
        }
        assert!((o.total_mass(0, 3) - 6.0).abs() < 1e-12);
    }

    #[test]
    fn rank_shares_average_each_layers_busiest_first() {
        let o = oracle_from(vec![vec![1, 3, 0, 0], vec![0, 0, 2, 2]], 1);
        // Layer 0 ranked: 0.75, 0.25, 0, 0; layer 1: 0.5, 0.5, 0, 0.
        let s = o.rank_shares(0, 2);
        let want = [0.625, 0.375, 0.0, 0.0];
        assert!(
            s.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-12),
            "{s:?}"
        );
        assert_eq!(o.rank_shares(1, 2), vec![0.5, 0.5, 0.0, 0.0]);
        // Each rank sums to the experts a token uses, as the layers' shares do.
        assert!((s.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        // No profile: uniform routing, which the cost model takes as empty.
        let inv = crate::testing::inventory("qwen3moe", crate::testing::qwen3moe_hparams(), "Q8_0");
        let facts = crate::facts::ModelFacts::new(&inv, strata_schemas::ggml::GgmlType::F16);
        assert!(ExpertOracle::new(&facts, None).rank_shares(0, 4).is_empty());
    }

    #[test]
    fn select_takes_hottest_first_deterministically() {
        let o = oracle_from(vec![vec![1, 50, 2, 0], vec![40, 0, 0, 60]], 1);
        let s = o.select(0, 2, 3);
        // p(0,1) = 50/53 = 0.94, p(1,3) = 0.6, p(1,0) = 0.4.
        assert_eq!(s, vec![(0, 1), (1, 3), (1, 0)]);
        assert_eq!(o.select(0, 2, 3), s);
    }
}
