//! The routing tally: how often each routed expert of each main block was picked by the
//! router, counted by a backend as its passes run, so `strata-exec profile` can write the
//! routing profile `strata-plan --expert-profile` reads (`schemas/PROFILE.md`).
//! It also keeps the LRU stack distance of every reference (Mattson's algorithm over the
//! (block, expert) pairs, one reference per distinct expert of a block per pass, as the expert
//! caches look them up), so the profile gives the hit rate of an LRU cache of any size.
//! Invariant: the counts, the stack and the histograms are sized once (main blocks x experts)
//! when the stage is built and never grow; a pick outside that table (an MTP block, an id past
//! the experts) is not counted, so a profile only ever holds picks the model really made.

use strata_schemas::profile::{ExpertProfile, Reuse, ReuseHistogram};

/// Mattson's LRU stack over `keys` (block, expert) pairs: a Fenwick tree over time stamps
/// marks each key's latest reference, so a key's stack distance is the number of marks after
/// its previous one. Stamps run to `2 x keys`, then the live ones are renumbered in order.
#[derive(Debug, Clone, PartialEq, Eq)]
struct StackDistances {
    /// Latest stamp of each key, or `NONE`.
    last: Vec<u32>,
    /// Fenwick tree over stamps `0..2 x keys` (1-based inside).
    tree: Vec<i32>,
    now: u32,
    /// `[decode, prefill]`: references at each distance, and first references.
    hist: [Vec<u64>; 2],
    first: [u64; 2],
    /// Scratch for renumbering: (stamp, key) of the live keys.
    order: Vec<(u32, u32)>,
}

const NONE: u32 = u32::MAX;

impl StackDistances {
    fn new(keys: usize) -> Self {
        Self {
            last: vec![NONE; keys],
            tree: vec![0; 2 * keys + 1],
            now: 0,
            hist: [vec![0; keys], vec![0; keys]],
            first: [0; 2],
            order: Vec::with_capacity(keys),
        }
    }

    fn add(&mut self, stamp: u32, v: i32) {
        let mut i = stamp as usize + 1;
        while i < self.tree.len() {
            self.tree[i] += v;
            i += i & i.wrapping_neg();
        }
    }

    /// Marks at stamps `0..=stamp`.
    fn prefix(&self, stamp: u32) -> i64 {
        let mut i = stamp as usize + 1;
        let mut s = 0i64;
        while i > 0 {
            s += i64::from(self.tree[i]);
            i &= i - 1;
        }
        s
    }

    /// Renumber the live stamps `0..live` in their order and rebuild the tree.
    fn compact(&mut self) {
        self.order.clear();
        for (k, &t) in self.last.iter().enumerate() {
            if t != NONE {
                self.order.push((t, k as u32));
            }
        }
        self.order.sort_unstable();
        self.tree.fill(0);
        let order = std::mem::take(&mut self.order);
        for (i, &(_, k)) in order.iter().enumerate() {
            self.last[k as usize] = i as u32;
            self.add(i as u32, 1);
        }
        self.now = order.len() as u32;
        self.order = order;
    }

    /// Reference `key` in a pass of kind `kind` (0 decode, 1 prefill).
    fn reference(&mut self, key: usize, kind: usize) {
        let prev = self.last[key];
        if prev == NONE {
            self.first[kind] += 1;
        } else {
            let after = self.prefix(self.now.saturating_sub(1)) - self.prefix(prev);
            self.hist[kind][after as usize] += 1;
            self.add(prev, -1);
        }
        if self.now as usize + 1 >= self.tree.len() {
            if prev != NONE {
                self.last[key] = NONE;
            }
            self.compact();
        }
        self.add(self.now, 1);
        self.last[key] = self.now;
        self.now += 1;
    }

    fn reuse(&self) -> Reuse {
        Reuse {
            decode: ReuseHistogram::from_dense(self.first[0], &self.hist[0]),
            prefill: ReuseHistogram::from_dense(self.first[1], &self.hist[1]),
        }
    }
}

/// Counts of router picks, `counts[layer * experts + expert]`, over the main blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingTally {
    layers: usize,
    experts: usize,
    /// Experts each token picks: a pass of one token (`k` picks) is a decode step.
    k: usize,
    counts: Vec<u64>,
    stack: StackDistances,
    /// Which experts the current call picked (scratch, `experts` flags).
    picked: Vec<bool>,
}

impl RoutingTally {
    /// An all-zero tally of `layers` main blocks of `experts` routed experts each, `k` picked
    /// per token (allocated here, once).
    pub fn new(layers: usize, experts: usize, k: usize) -> Self {
        Self {
            layers,
            experts,
            k: k.max(1),
            counts: vec![0; layers * experts],
            stack: StackDistances::new(layers * experts),
            picked: vec![false; experts],
        }
    }

    /// Count the picks `ids` (the pass's tokens x k, flattened) of block `layer`, and
    /// reference each distinct expert once, in increasing id, on the LRU stack (a pass of
    /// one token is a decode step, a longer one a prefill pass).
    pub fn record(&mut self, layer: u32, ids: &[u32]) {
        let l = layer as usize;
        if l >= self.layers {
            return;
        }
        let row = &mut self.counts[l * self.experts..(l + 1) * self.experts];
        for &e in ids {
            if let Some(c) = row.get_mut(e as usize) {
                *c += 1;
                self.picked[e as usize] = true;
            }
        }
        let kind = usize::from(ids.len() > self.k);
        for (e, picked) in self.picked.iter_mut().enumerate() {
            if std::mem::take(picked) {
                self.stack.reference(l * self.experts + e, kind);
            }
        }
    }

    /// The stack-distance histograms so far.
    pub fn reuse(&self) -> Reuse {
        self.stack.reuse()
    }

    /// (main blocks, experts) this tally counts.
    pub fn dims(&self) -> (usize, usize) {
        (self.layers, self.experts)
    }

    /// Picks of `expert` in block `layer` so far.
    pub fn count(&self, layer: usize, expert: usize) -> u64 {
        if layer < self.layers && expert < self.experts {
            self.counts[layer * self.experts + expert]
        } else {
            0
        }
    }

    /// Add these counts and stack distances into `into` (a profile of the same model: every
    /// block this tally counts is a row of it, every expert a column). Several stages of a
    /// layer split each add the blocks they ran; their histograms add up, each stage's
    /// distances counted over its own blocks (as its own cache sees them).
    pub fn add_into(&self, into: &mut ExpertProfile) -> Result<(), String> {
        if into.experts as usize != self.experts || (into.layers as usize) < self.layers {
            return Err(format!(
                "a routing tally of {} blocks x {} experts does not fit a profile of {} x {}",
                self.layers, self.experts, into.layers, into.experts
            ));
        }
        for (dst, src) in into.counts.iter_mut().zip(&self.counts) {
            *dst += *src;
        }
        into.reuse
            .get_or_insert_with(Reuse::default)
            .merge(&self.reuse());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_picks_per_block_and_skips_what_is_outside_the_table() {
        let mut t = RoutingTally::new(2, 4, 2);
        // Two tokens x k = 2 in block 0, one token in block 1, an MTP block (2) and a bad id.
        t.record(0, &[1, 3, 3, 0]);
        t.record(1, &[2, 9]);
        t.record(2, &[0, 1]);
        assert_eq!(
            (0..2)
                .flat_map(|l| (0..4).map(move |e| (l, e)))
                .map(|(l, e)| t.count(l, e))
                .collect::<Vec<_>>(),
            vec![1, 1, 0, 2, 0, 0, 1, 0]
        );
        let mut p = ExpertProfile::uniform(2, 4);
        t.add_into(&mut p).unwrap();
        t.add_into(&mut p).unwrap();
        // Block 0's pass (4 picks > k = 2: prefill) references experts 0, 1, 3; block 1's
        // (one token: decode) expert 2; each a first reference, in both tallies added.
        let r = p.reuse.clone().unwrap();
        assert_eq!((r.prefill.first, r.decode.first), (2 * 3, 2));
        assert_eq!(r.decode.reuses() + r.prefill.reuses(), 0);
        assert_eq!(p.count(0, 3), 4);
        assert_eq!(p.count(1, 2), 2);
        assert_eq!(p.counts.iter().sum::<u64>(), 10);
        // The written profile reads back as the same counts.
        let back =
            strata_schemas::profile::parse_profile_bytes(p.write_text().as_bytes(), "t").unwrap();
        assert_eq!(back, p);
        assert!(t.add_into(&mut ExpertProfile::uniform(2, 5)).is_err());
        assert!(t.add_into(&mut ExpertProfile::uniform(1, 4)).is_err());
    }

    /// Hits of an LRU cache of `slots` over `refs`, simulated directly.
    fn lru_hits(refs: &[usize], slots: usize) -> u64 {
        let mut stack: Vec<usize> = Vec::new();
        let mut hits = 0;
        for &r in refs {
            if let Some(i) = stack.iter().position(|x| *x == r) {
                hits += u64::from(i < slots);
                stack.remove(i);
            }
            stack.insert(0, r);
        }
        hits
    }

    /// For every cache size, the references below that distance are exactly the hits of an
    /// LRU cache of that many slots (the long streams renumber the stamps many times).
    #[test]
    fn stack_distances_give_every_lru_size_its_hits() {
        use rand::{Rng, SeedableRng};
        for seed in 0..24u64 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let n = rng.random_range(1..400);
            let mut t = RoutingTally::new(3, 6, 1);
            let mut refs = Vec::new();
            for _ in 0..n {
                // Skewed towards low ids, so both short and long distances occur.
                let (l, e) = (
                    rng.random_range(0..3u32),
                    rng.random_range(0..6u32).min(rng.random_range(0..6u32)),
                );
                t.record(l, &[e]);
                refs.push((l * 6 + e) as usize);
            }
            let r = t.reuse();
            assert_eq!(r.prefill.references(), 0);
            assert_eq!(r.decode.references(), n as u64);
            for slots in 0..=18usize {
                let below: u64 = r
                    .decode
                    .distances
                    .iter()
                    .filter(|(d, _)| (*d as usize) < slots)
                    .map(|(_, c)| c)
                    .sum();
                assert_eq!(below, lru_hits(&refs, slots), "seed {seed}, {slots} slots");
            }
        }
    }
}
