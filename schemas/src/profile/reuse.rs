//! The reuse part of an expert profile (format v2, `schemas/PROFILE.md`): histograms of the
//! LRU stack distance of every expert reference (Mattson's algorithm), from which the hit
//! rate of an LRU cache of any number of slots follows — `hit(S)` = share of re-references
//! whose distance is below `S`.
//! Invariant: a parsed histogram has distances strictly ascending, each below the profile's
//! key space (`layers x experts`), and totals that fit a u64.

/// Stack distances of one kind of pass: how many references found their (block, expert)
/// `d` distinct other (block, expert) pairs after its previous reference, pooled over the
/// main blocks in the order the engine ran them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReuseHistogram {
    /// References to a (block, expert) never referenced before (infinite distance).
    pub first: u64,
    /// (distance, references), distance strictly ascending; zero counts may be omitted.
    pub distances: Vec<(u64, u64)>,
}

impl ReuseHistogram {
    /// From a dense histogram (`dense[d]` = references at distance `d`), zeros dropped.
    pub fn from_dense(first: u64, dense: &[u64]) -> Self {
        let distances = dense
            .iter()
            .enumerate()
            .filter(|(_, c)| **c > 0)
            .map(|(d, c)| (d as u64, *c))
            .collect();
        Self { first, distances }
    }

    /// References to an expert referenced before (the histogram's mass).
    pub fn reuses(&self) -> u64 {
        self.distances.iter().map(|(_, c)| *c).sum()
    }

    /// Every reference, first ones included.
    pub fn references(&self) -> u64 {
        self.first + self.reuses()
    }

    /// Share of re-references an LRU cache of `slots` slots over the profiled blocks serves
    /// (distance < slots), in steady state (first references are not counted: a long run
    /// has few of them). A fractional `slots` interpolates between its two neighbours.
    /// `None` when the histogram holds no re-reference.
    pub fn hit_rate(&self, slots: f64) -> Option<f64> {
        let total = self.reuses();
        if total == 0 {
            return None;
        }
        let s = slots.max(0.0);
        let lo = s.floor();
        let frac = s - lo;
        let below = |n: f64| -> u64 {
            self.distances
                .iter()
                .take_while(|(d, _)| (*d as f64) < n)
                .map(|(_, c)| *c)
                .sum()
        };
        let a = below(lo) as f64;
        let b = below(lo + 1.0) as f64;
        Some((a + frac * (b - a)) / total as f64)
    }

    /// Add `other`'s references into this one.
    pub fn merge(&mut self, other: &ReuseHistogram) {
        self.first += other.first;
        let mut out = Vec::with_capacity(self.distances.len() + other.distances.len());
        let (mut i, mut j) = (0, 0);
        let (a, b) = (&self.distances, &other.distances);
        while i < a.len() || j < b.len() {
            let take_a = j >= b.len() || (i < a.len() && a[i].0 <= b[j].0);
            let take_b = i >= a.len() || (j < b.len() && b[j].0 <= a[i].0);
            let d = if take_a { a[i].0 } else { b[j].0 };
            let mut c = 0u64;
            if take_a {
                c = c.saturating_add(a[i].1);
                i += 1;
            }
            if take_b {
                c = c.saturating_add(b[j].1);
                j += 1;
            }
            out.push((d, c));
        }
        self.distances = out;
    }

    /// `first` and the pairs as the text encoding writes them (`d:count` separated by spaces).
    pub(super) fn write_pairs(&self) -> String {
        let mut s = String::new();
        for (d, c) in &self.distances {
            if !s.is_empty() {
                s.push(' ');
            }
            s.push_str(&format!("{d}:{c}"));
        }
        s
    }

    /// Check the invariant against a key space of `keys` (block, expert) pairs.
    pub(super) fn check(&self, keys: u64) -> Result<(), String> {
        let mut prev: Option<u64> = None;
        let mut total = self.first;
        for (d, c) in &self.distances {
            if prev.is_some_and(|p| *d <= p) {
                return Err(format!(
                    "distance {d} comes after {}: distances must be strictly ascending",
                    prev.unwrap_or(0)
                ));
            }
            if *d >= keys {
                return Err(format!(
                    "distance {d} is not below layers x experts = {keys} (no LRU stack is that deep)"
                ));
            }
            total = total
                .checked_add(*c)
                .ok_or_else(|| "the references add up past u64".to_string())?;
            prev = Some(*d);
        }
        Ok(())
    }
}

/// Parse the text value of `reuse.KIND = d:c d:c ...`.
pub(super) fn parse_pairs(value: &str) -> Result<Vec<(u64, u64)>, String> {
    value
        .split_whitespace()
        .map(|tok| {
            let (d, c) = tok
                .split_once(':')
                .ok_or_else(|| format!("`{tok}` is not `distance:count`"))?;
            let d = d
                .parse::<u64>()
                .map_err(|_| format!("`{tok}`: distance is not an unsigned integer"))?;
            let c = c
                .parse::<u64>()
                .map_err(|_| format!("`{tok}`: count is not an unsigned 64-bit integer"))?;
            Ok((d, c))
        })
        .collect()
}

/// The reuse histograms of a profile: single-token passes (decode steps) and longer passes
/// (prefill), kept apart because a prefill pass references most experts of a block at once.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Reuse {
    pub decode: ReuseHistogram,
    pub prefill: ReuseHistogram,
}

impl Reuse {
    /// Add `other` into this one.
    pub fn merge(&mut self, other: &Reuse) {
        self.decode.merge(&other.decode);
        self.prefill.merge(&other.prefill);
    }

    /// Binary form: per histogram (decode, prefill) u64 first, u64 pairs, pairs x (u64, u64).
    pub(super) fn write_binary(&self, out: &mut Vec<u8>) {
        for h in [&self.decode, &self.prefill] {
            out.extend_from_slice(&h.first.to_le_bytes());
            out.extend_from_slice(&(h.distances.len() as u64).to_le_bytes());
            for (d, c) in &h.distances {
                out.extend_from_slice(&d.to_le_bytes());
                out.extend_from_slice(&c.to_le_bytes());
            }
        }
    }

    /// Parse the binary form from `bytes` (starting at file offset `base`); every length is
    /// checked against the bytes left before anything is allocated. Returns the error's
    /// offset and reason.
    pub(super) fn parse_binary(bytes: &[u8], base: u64, keys: u64) -> Result<Self, (u64, String)> {
        let mut at = 0usize;
        let end = base + bytes.len() as u64;
        let u64_at = |at: &mut usize, what: &str| -> Result<u64, (u64, String)> {
            let b = bytes.get(*at..*at + 8).ok_or_else(|| {
                (
                    end,
                    format!("truncated: the reuse section ends inside {what}"),
                )
            })?;
            *at += 8;
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            Ok(u64::from_le_bytes(a))
        };
        let mut hs = [ReuseHistogram::default(), ReuseHistogram::default()];
        for (h, name) in hs.iter_mut().zip(["decode", "prefill"]) {
            let start = base + at as u64;
            h.first = u64_at(&mut at, "a histogram's first-reference count")?;
            let n = u64_at(&mut at, "a histogram's pair count")?;
            let left = (bytes.len() - at) as u64;
            if n > left / 16 {
                return Err((
                    start + 8,
                    format!("the {name} histogram claims {n} pairs but {left} bytes are left"),
                ));
            }
            h.distances = Vec::with_capacity(n as usize);
            for _ in 0..n {
                let d = u64_at(&mut at, "a distance")?;
                let c = u64_at(&mut at, "a count")?;
                h.distances.push((d, c));
            }
            h.check(keys)
                .map_err(|r| (start, format!("{name} histogram: {r}")))?;
        }
        if at != bytes.len() {
            return Err((
                base + at as u64,
                format!(
                    "{} trailing bytes after the reuse histograms",
                    bytes.len() - at
                ),
            ));
        }
        let [decode, prefill] = hs;
        Ok(Self { decode, prefill })
    }
}

/// The `reuse.*` lines of a text profile as they are read: each key at most once, all four
/// or none.
#[derive(Debug, Default)]
pub(super) struct ReuseLines {
    /// (value, line) of reuse.decode.first, reuse.decode, reuse.prefill.first, reuse.prefill.
    got: [Option<(String, u64)>; 4],
}

const REUSE_KEYS: [&str; 4] = [
    "reuse.decode.first",
    "reuse.decode",
    "reuse.prefill.first",
    "reuse.prefill",
];

impl ReuseLines {
    /// Keep `key = value` of line `n`.
    pub(super) fn take(&mut self, key: &str, value: &str, n: u64) -> Result<(), String> {
        let i = REUSE_KEYS.iter().position(|k| *k == key).ok_or_else(|| {
            format!(
                "unknown key `{key}`; the reuse keys are {}",
                REUSE_KEYS.join(", ")
            )
        })?;
        if let Some((_, first)) = &self.got[i] {
            return Err(format!("`{key}` given again (first on line {first})"));
        }
        self.got[i] = Some((value.to_string(), n));
        Ok(())
    }

    /// The histograms, checked against `keys` (block, expert) pairs; `None` when no reuse
    /// line was given. Errors carry the line they are about (`None`: the end of the file).
    pub(super) fn finish(self, keys: u64) -> Result<Option<Reuse>, (Option<u64>, String)> {
        if self.got.iter().all(|g| g.is_none()) {
            return Ok(None);
        }
        let mut hs = [ReuseHistogram::default(), ReuseHistogram::default()];
        for (h, pair) in hs.iter_mut().zip(self.got.chunks(2)) {
            let (first, pairs) = match (&pair[0], &pair[1]) {
                (Some(f), Some(p)) => (f, p),
                _ => {
                    return Err((
                        None,
                        format!(
                            "a v2 profile with reuse lines needs all of {}",
                            REUSE_KEYS.join(", ")
                        ),
                    ))
                }
            };
            h.first = first.0.parse().map_err(|_| {
                (
                    Some(first.1),
                    format!("`{}` is not an unsigned 64-bit integer", first.0),
                )
            })?;
            h.distances = parse_pairs(&pairs.0).map_err(|r| (Some(pairs.1), r))?;
            h.check(keys).map_err(|r| (Some(pairs.1), r))?;
        }
        let [decode, prefill] = hs;
        Ok(Some(Reuse { decode, prefill }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hit_rate_is_the_share_below_the_slots_and_interpolates() {
        let h = ReuseHistogram::from_dense(5, &[4, 0, 2, 2]);
        assert_eq!(h.distances, vec![(0, 4), (2, 2), (3, 2)]);
        assert_eq!(h.reuses(), 8);
        assert_eq!(h.references(), 13);
        assert_eq!(h.hit_rate(0.0), Some(0.0));
        assert_eq!(h.hit_rate(1.0), Some(0.5));
        assert_eq!(h.hit_rate(2.0), Some(0.5));
        assert_eq!(h.hit_rate(3.0), Some(0.75));
        assert_eq!(h.hit_rate(2.5), Some(0.625));
        assert_eq!(h.hit_rate(4.0), Some(1.0));
        assert_eq!(h.hit_rate(1e9), Some(1.0));
        assert_eq!(ReuseHistogram::default().hit_rate(3.0), None);
    }

    #[test]
    fn merge_adds_pairwise() {
        let mut a = ReuseHistogram::from_dense(1, &[1, 0, 3]);
        let b = ReuseHistogram::from_dense(2, &[0, 5, 1, 7]);
        a.merge(&b);
        assert_eq!(a.first, 3);
        assert_eq!(a.distances, vec![(0, 1), (1, 5), (2, 4), (3, 7)]);
        assert!(a.check(4).is_ok());
        assert!(a.check(3).unwrap_err().contains("not below"));
        let bad = ReuseHistogram {
            first: 0,
            distances: vec![(2, 1), (2, 1)],
        };
        assert!(bad.check(9).unwrap_err().contains("strictly ascending"));
    }

    proptest::proptest! {
        /// hit(S) never falls as S grows and ends at 1.
        #[test]
        fn hit_rate_is_monotone(dense in proptest::collection::vec(0u64..50, 1..40), s in 0.0f64..45.0) {
            let h = ReuseHistogram::from_dense(0, &dense);
            if let (Some(a), Some(b)) = (h.hit_rate(s), h.hit_rate(s + 0.5)) {
                proptest::prop_assert!(a <= b + 1e-12);
                proptest::prop_assert!((0.0..=1.0).contains(&a));
                proptest::prop_assert_eq!(h.hit_rate(dense.len() as f64), Some(1.0));
            }
        }
    }
}
