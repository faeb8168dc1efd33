//! The routing tally: how often each routed expert of each main block was picked by the
//! router, counted by a backend as its passes run, so `strata-exec profile` can write the
//! routing profile `strata-plan --expert-profile` reads (`schemas/PROFILE.md`).
//! Invariant: the counts are sized once (main blocks x experts) when the stage is built and
//! never grow; a pick outside that table (an MTP block, an id past the experts) is not
//! counted, so a profile only ever holds picks the model really made.

use strata_schemas::profile::ExpertProfile;

/// Counts of router picks, `counts[layer * experts + expert]`, over the main blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingTally {
    layers: usize,
    experts: usize,
    counts: Vec<u64>,
}

impl RoutingTally {
    /// An all-zero tally of `layers` main blocks of `experts` routed experts each (allocated
    /// here, once).
    pub fn new(layers: usize, experts: usize) -> Self {
        Self {
            layers,
            experts,
            counts: vec![0; layers * experts],
        }
    }

    /// Count the picks `ids` (any number of tokens x k, flattened) of block `layer`.
    pub fn record(&mut self, layer: u32, ids: &[u32]) {
        let l = layer as usize;
        if l >= self.layers {
            return;
        }
        let row = &mut self.counts[l * self.experts..(l + 1) * self.experts];
        for &e in ids {
            if let Some(c) = row.get_mut(e as usize) {
                *c += 1;
            }
        }
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

    /// Add these counts into `into` (a profile of the same model: every block this tally
    /// counts is a row of it, every expert a column). Several stages of a layer split each
    /// add the blocks they ran.
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
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_picks_per_block_and_skips_what_is_outside_the_table() {
        let mut t = RoutingTally::new(2, 4);
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
}
