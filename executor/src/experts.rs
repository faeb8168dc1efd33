//! The expert cache: a device's planned `expert_cache` slots, seeded with the plan's
//! `resident_experts`, refilled on a miss by copying the expert (gate | up | down) from the
//! host copy of its stacks. The replacement policy ([`LruPolicy`]) is pure bookkeeping so the
//! CUDA backend runs the same decisions with device copies: LRU by default, or LFU with the
//! profile's hot set pinned ([`LruPolicy::pin_hot`]). A pass that touches most of a layer's
//! experts (a long prefill) is a scan ([`LruPolicy::set_scan`]): its misses take the slots
//! earlier scans filled, newest first, and evict a cached expert only when none of those is
//! free, so one long prompt streams the experts outside the cache instead of flushing it.
//! Invariant: a slot holds at most one (layer, expert) and the map and the slot contents
//! always agree; a miss evicts the least recently used slot (empty slots first, then the
//! oldest use; seeds start in plan order, best first, so the coldest seed goes first), or
//! under LFU the least used unpinned slot; a pinned slot and a slot used in the current group
//! ([`LruPolicy::begin_group`]) are never evicted; during a scan a miss first takes the
//! most recently filled scan slot not used in the current or the previous group (so a copy into it
//! need not wait for the products still reading the previous group's slots); nothing is
//! allocated after construction.

use strata_schemas::ggml::GgmlType;
use strata_schemas::plan::ResidentExpert;

const NONE: u32 = u32::MAX;

/// One routed expert's three matrices as the cache hands them out: (type, bytes) of gate
/// (`n_ff_exp` rows of `n_embd`), up (same) and down (`n_embd` rows of `n_ff_exp`).
#[derive(Debug, Clone, Copy)]
pub struct ExpertBytes<'b> {
    pub gate: (GgmlType, &'b [u8]),
    pub up: (GgmlType, &'b [u8]),
    pub down: (GgmlType, &'b [u8]),
}

/// What a lookup decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    Hit {
        slot: u32,
    },
    /// Fill `slot` (it held `evicted`, if anything).
    Miss {
        slot: u32,
        evicted: Option<(u32, u32)>,
    },
}

/// LRU over a fixed set of slots for the experts of layers `[layer_first, layer_end)`.
#[derive(Debug, Clone)]
pub struct LruPolicy {
    layer_first: u32,
    layer_end: u32,
    n_expert: u32,
    /// slot of (layer - layer_first) * n_expert + expert, or NONE.
    slot_of: Vec<u32>,
    owner: Vec<Option<(u32, u32)>>,
    last_use: Vec<u64>,
    /// Uses of the slot's expert since it was filled (LFU).
    uses: Vec<u64>,
    /// Slots never evicted (LFU's pinned hot set).
    pinned: Vec<bool>,
    /// The group each slot was last used in; 0 = no groups (the CPU cache computes each
    /// expert as soon as it is fetched and needs no protection).
    group_of: Vec<u64>,
    group: u64,
    /// Slots a scan's miss filled and no use outside a scan has touched since: the ring a
    /// scan recycles.
    scan_filled: Vec<bool>,
    /// The clock when each slot was last filled.
    filled_at: Vec<u64>,
    /// Lookups are part of a scan ([`LruPolicy::set_scan`]).
    scanning: bool,
    lfu: bool,
    clock: u64,
    pub hits: u64,
    pub misses: u64,
}

impl LruPolicy {
    /// `n_slots` slots; `resident` (plan order, best first) seeds them.
    pub fn new(
        layer_first: u32,
        layer_end: u32,
        n_expert: u32,
        n_slots: u32,
        resident: &[ResidentExpert],
    ) -> Result<Self, String> {
        let n_layers = layer_end.saturating_sub(layer_first) as usize;
        let mut p = Self {
            layer_first,
            layer_end,
            n_expert,
            slot_of: vec![NONE; n_layers * n_expert as usize],
            owner: vec![None; n_slots as usize],
            last_use: vec![0; n_slots as usize],
            uses: vec![0; n_slots as usize],
            pinned: vec![false; n_slots as usize],
            group_of: vec![0; n_slots as usize],
            group: 0,
            scan_filled: vec![false; n_slots as usize],
            filled_at: vec![0; n_slots as usize],
            scanning: false,
            lfu: false,
            clock: resident.len() as u64 + 1,
            hits: 0,
            misses: 0,
        };
        for (rank, r) in resident.iter().enumerate() {
            let i = p.index(r.layer, r.expert).ok_or_else(|| {
                format!(
                    "resident expert {} of layer {} is outside layers [{layer_first}, {layer_end}) x {n_expert} experts",
                    r.expert, r.layer
                )
            })?;
            if r.slot >= n_slots || p.owner[r.slot as usize].is_some() || p.slot_of[i] != NONE {
                return Err(format!(
                    "resident expert {} of layer {} names slot {} (of {n_slots}) twice or out of range",
                    r.expert, r.layer, r.slot
                ));
            }
            p.slot_of[i] = r.slot;
            p.owner[r.slot as usize] = Some((r.layer, r.expert));
            p.last_use[r.slot as usize] = (resident.len() - rank) as u64;
        }
        Ok(p)
    }

    fn index(&self, layer: u32, expert: u32) -> Option<usize> {
        (layer >= self.layer_first && layer < self.layer_end && expert < self.n_expert)
            .then(|| ((layer - self.layer_first) * self.n_expert + expert) as usize)
    }

    /// Whether the policy covers `layer`'s experts.
    pub fn covers(&self, layer: u32) -> bool {
        (self.layer_first..self.layer_end).contains(&layer)
    }

    pub fn n_slots(&self) -> usize {
        self.owner.len()
    }

    /// Switch to LFU with the hot set pinned: the seeds, best first, are pinned while at
    /// least `unpinned` slots stay free to take misses (the seeds are the plan's resident
    /// experts, chosen from the routing profile).
    pub fn pin_hot(&mut self, resident: &[ResidentExpert], unpinned: usize) {
        self.lfu = true;
        let budget = self.owner.len().saturating_sub(unpinned);
        for r in resident.iter().take(budget) {
            if let Some(s) = self.slot_of(r.layer, r.expert) {
                self.pinned[s as usize] = true;
            }
        }
    }

    /// Slots that can take misses (not pinned).
    pub fn unpinned_slots(&self) -> usize {
        self.pinned.iter().filter(|p| !**p).count()
    }

    /// Whether (layer, expert) sits in a pinned slot.
    pub fn is_pinned(&self, layer: u32, expert: u32) -> bool {
        self.slot_of(layer, expert)
            .is_some_and(|s| self.pinned[s as usize])
    }

    /// Empty the slot of (layer, expert), if it has one (its bytes could not be filled).
    pub fn forget(&mut self, layer: u32, expert: u32) {
        if let (Some(i), Some(s)) = (self.index(layer, expert), self.slot_of(layer, expert)) {
            self.slot_of[i] = NONE;
            self.owner[s as usize] = None;
            self.uses[s as usize] = 0;
            self.pinned[s as usize] = false;
            self.scan_filled[s as usize] = false;
        }
    }

    /// Whether the lookups from now on are part of a scan: a pass whose tokens pick about
    /// every expert of each layer once or more (a long prefill), which would otherwise evict
    /// the whole cache layer by layer while touching each expert only once. A scan's misses
    /// recycle the slots earlier scan misses filled (newest first), taking a cached expert's
    /// slot only when none of those is free; its hits refresh as usual. A use outside a scan
    /// makes a scan-filled slot an ordinary cached one.
    pub fn set_scan(&mut self, on: bool) {
        self.scanning = on;
    }

    /// Slots now holding a scan's miss (the ring a scan recycles).
    pub fn scan_slots(&self) -> usize {
        self.scan_filled.iter().filter(|s| **s).count()
    }

    /// Start a group of lookups whose experts must all stay in their slots together (one
    /// launch of the products reads them all): no lookup of the group evicts another's.
    pub fn begin_group(&mut self) {
        self.group += 1;
    }

    /// The slot holding (layer, expert), if any (no bookkeeping).
    pub fn slot_of(&self, layer: u32, expert: u32) -> Option<u32> {
        self.index(layer, expert)
            .map(|i| self.slot_of[i])
            .filter(|s| *s != NONE)
    }

    /// Record a use of (layer, expert): a hit refreshes it, a miss picks the slot to fill.
    pub fn lookup(&mut self, layer: u32, expert: u32) -> Result<Lookup, String> {
        let i = self.index(layer, expert).ok_or_else(|| {
            format!("expert {expert} of layer {layer} is not served by this cache")
        })?;
        if self.owner.is_empty() {
            return Err(format!(
                "the expert cache has no slots but expert {expert} of layer {layer} is needed (re-plan: the minimum working set is 2 x experts used)"
            ));
        }
        self.clock += 1;
        let s = self.slot_of[i];
        if s != NONE {
            self.hits += 1;
            self.last_use[s as usize] = self.clock;
            self.uses[s as usize] += 1;
            self.group_of[s as usize] = self.group;
            if !self.scanning {
                self.scan_filled[s as usize] = false;
            }
            return Ok(Lookup::Hit { slot: s });
        }
        let (group, lfu, scanning) = (self.group, self.lfu, self.scanning);
        // During a scan, a slot an earlier scan filled and neither this group nor the one
        // before it used goes first, the most recently filled first (a cyclic pass over more
        // experts than the ring holds then keeps the ring's older part for the next pass,
        // where a first-in-first-out ring would evict each expert just before its reuse);
        // empty slots still go before it.
        let recyclable = |k: usize| {
            scanning && self.scan_filled[k] && (group == 0 || self.group_of[k] + 1 < group)
        };
        let victim = (0..self.owner.len())
            .filter(|&k| !self.pinned[k] && (group == 0 || self.group_of[k] != group))
            .min_by_key(|&k| {
                let ring = recyclable(k);
                let uses = if lfu && !ring { self.uses[k] } else { 0 };
                let age = if ring {
                    u64::MAX - self.filled_at[k]
                } else {
                    self.last_use[k]
                };
                (self.owner[k].is_some(), !ring, uses, age, k)
            })
            .ok_or_else(|| {
                format!(
                    "expert {expert} of layer {layer} misses but every one of the {} slots is pinned or holds an expert of the same group (re-plan with a larger --expert-cache, or pin fewer)",
                    self.owner.len()
                )
            })?;
        self.misses += 1;
        let evicted = self.owner[victim];
        if let Some((l, e)) = evicted {
            if let Some(j) = self.index(l, e) {
                self.slot_of[j] = NONE;
            }
        }
        self.owner[victim] = Some((layer, expert));
        self.slot_of[i] = victim as u32;
        self.last_use[victim] = self.clock;
        self.uses[victim] = 1;
        self.group_of[victim] = self.group;
        self.scan_filled[victim] = scanning;
        self.filled_at[victim] = self.clock;
        Ok(Lookup::Miss {
            slot: victim as u32,
            evicted,
        })
    }
}

/// Whether a pass is a scan for the expert cache ([`LruPolicy::set_scan`]): a prompt pass
/// (`prefills`) whose `tokens x k` picks number the layer's `n_expert` experts or more, so it
/// picks each of them about once or more. The CPU and CUDA caches both decide by this.
pub fn pass_is_scan(prefills: bool, tokens: usize, k: usize, n_expert: usize) -> bool {
    prefills && tokens * k >= n_expert
}

/// The host copy of one layer's three expert stacks.
#[derive(Debug, Clone, Copy)]
pub struct HostStacks<'h> {
    pub gate: (GgmlType, &'h [u8]),
    pub up: (GgmlType, &'h [u8]),
    pub down: (GgmlType, &'h [u8]),
}

/// A CPU expert cache over a planned `expert_cache` region.
pub struct CpuExpertCache<'a> {
    policy: LruPolicy,
    slots: &'a mut [u8],
    slot_bytes: usize,
    n_expert: usize,
    /// Per layer of the range (None: a layer without experts).
    stacks: Vec<Option<HostStacks<'a>>>,
}

impl<'a> CpuExpertCache<'a> {
    /// `slots` is the `expert_cache` region (`n_slots x slot_bytes`); `stacks[l]` is layer
    /// `layer_first + l`'s host stacks. Seeds every resident expert's slot now.
    pub fn new(
        policy: LruPolicy,
        slots: &'a mut [u8],
        slot_bytes: u64,
        n_expert: u32,
        stacks: Vec<Option<HostStacks<'a>>>,
    ) -> Result<Self, String> {
        let slot_bytes = slot_bytes as usize;
        if slots.len() < policy.n_slots() * slot_bytes {
            return Err(format!(
                "the expert_cache region holds {} bytes but {} slots of {slot_bytes} need {}",
                slots.len(),
                policy.n_slots(),
                policy.n_slots() * slot_bytes
            ));
        }
        for (l, st) in stacks.iter().enumerate() {
            if let Some(st) = st {
                let per: usize = [st.gate, st.up, st.down]
                    .iter()
                    .map(|(_, b)| b.len() / n_expert.max(1) as usize)
                    .sum();
                if per > slot_bytes {
                    return Err(format!(
                        "one expert of layer {} takes {per} bytes but a cache slot holds {slot_bytes}",
                        policy.layer_first as usize + l
                    ));
                }
            }
        }
        let mut c = Self {
            policy,
            slots,
            slot_bytes,
            n_expert: n_expert as usize,
            stacks,
        };
        let seeds: Vec<(u32, u32, u32)> = c
            .policy
            .owner
            .iter()
            .enumerate()
            .filter_map(|(s, o)| o.map(|(l, e)| (l, e, s as u32)))
            .collect();
        for (l, e, s) in seeds {
            c.fill(l, e, s)?;
        }
        Ok(c)
    }

    /// Copy expert `e` of `layer` from the host stacks into `slot`.
    fn fill(&mut self, layer: u32, e: u32, slot: u32) -> Result<(), String> {
        let st = self
            .stacks
            .get((layer - self.policy.layer_first) as usize)
            .copied()
            .flatten()
            .ok_or_else(|| format!("layer {layer} has no expert stacks"))?;
        let base = slot as usize * self.slot_bytes;
        let mut at = base;
        for (_, bytes) in [st.gate, st.up, st.down] {
            let per = bytes.len() / self.n_expert;
            let src = &bytes[e as usize * per..(e as usize + 1) * per];
            self.slots[at..at + per].copy_from_slice(src);
            at += per;
        }
        Ok(())
    }

    /// Whether the lookups from now on belong to a scan ([`LruPolicy::set_scan`]).
    pub fn set_scan(&mut self, on: bool) {
        self.policy.set_scan(on);
    }

    /// Hit and miss counts so far (seeding is neither).
    pub fn counters(&self) -> (u64, u64) {
        (self.policy.hits, self.policy.misses)
    }

    pub fn policy(&self) -> &LruPolicy {
        &self.policy
    }
}

impl CpuExpertCache<'_> {
    /// Expert `expert` of `layer` from its cache slot, filled from the host stacks on a miss
    /// (the bytes stay valid until the next call).
    pub fn fetch(&mut self, layer: u32, expert: u32) -> Result<ExpertBytes<'_>, String> {
        let slot = match self.policy.lookup(layer, expert)? {
            Lookup::Hit { slot } => slot,
            Lookup::Miss { slot, .. } => {
                self.fill(layer, expert, slot)?;
                slot
            }
        };
        let st = self.stacks[(layer - self.policy.layer_first) as usize]
            .ok_or_else(|| format!("layer {layer} has no experts"))?;
        let base = slot as usize * self.slot_bytes;
        let n = self.n_expert;
        let (g, u, d) = (st.gate.1.len() / n, st.up.1.len() / n, st.down.1.len() / n);
        let s = &self.slots[base..base + g + u + d];
        Ok(ExpertBytes {
            gate: (st.gate.0, &s[..g]),
            up: (st.up.0, &s[g..g + u]),
            down: (st.down.0, &s[g + u..]),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn re(layer: u32, expert: u32, slot: u32) -> ResidentExpert {
        ResidentExpert {
            layer,
            expert,
            slot,
        }
    }

    #[test]
    fn lru_evicts_empty_then_coldest_seed_then_oldest() {
        // 3 slots, 2 seeds: (2,5) best in slot 1, (3,0) in slot 0; slot 2 empty.
        let mut p = LruPolicy::new(2, 4, 8, 3, &[re(2, 5, 1), re(3, 0, 0)]).unwrap();
        assert_eq!(p.lookup(2, 5).unwrap(), Lookup::Hit { slot: 1 });
        assert_eq!(
            p.lookup(3, 7).unwrap(),
            Lookup::Miss {
                slot: 2,
                evicted: None
            }
        );
        // Now every slot is full; the oldest use is seed (3,0) in slot 0.
        assert_eq!(
            p.lookup(2, 1).unwrap(),
            Lookup::Miss {
                slot: 0,
                evicted: Some((3, 0))
            }
        );
        assert_eq!(p.slot_of(3, 0), None);
        assert_eq!(p.slot_of(2, 1), Some(0));
        // (2,5) was used before (3,7): it goes next.
        assert_eq!(
            p.lookup(3, 3).unwrap(),
            Lookup::Miss {
                slot: 1,
                evicted: Some((2, 5))
            }
        );
        assert_eq!((p.hits, p.misses), (1, 3));
        assert!(p.lookup(4, 0).is_err(), "layer outside the range");
        assert!(LruPolicy::new(0, 1, 4, 1, &[re(0, 1, 0), re(0, 2, 0)]).is_err());
    }

    #[test]
    fn lfu_keeps_the_pinned_hot_set_and_evicts_the_least_used() {
        // 4 slots seeded with (0,0) best, (0,1), (0,2), (0,3); pin the two best, 2 unpinned.
        let seeds = [re(0, 0, 0), re(0, 1, 1), re(0, 2, 2), re(0, 3, 3)];
        let mut p = LruPolicy::new(0, 1, 8, 4, &seeds).unwrap();
        p.pin_hot(&seeds, 2);
        assert_eq!(p.unpinned_slots(), 2);
        assert!(p.is_pinned(0, 1) && !p.is_pinned(0, 2));
        // (0,2) used three times, (0,3) once more: a miss evicts (0,3), the less used.
        for _ in 0..3 {
            p.lookup(0, 2).unwrap();
        }
        p.lookup(0, 3).unwrap();
        assert_eq!(
            p.lookup(0, 4).unwrap(),
            Lookup::Miss {
                slot: 3,
                evicted: Some((0, 3))
            }
        );
        // (0,4) has one use, (0,2) three: the next miss takes (0,4)'s slot, never a pinned
        // one even though the pinned experts were not used since.
        assert_eq!(
            p.lookup(0, 5).unwrap(),
            Lookup::Miss {
                slot: 3,
                evicted: Some((0, 4))
            }
        );
        assert_eq!(p.slot_of(0, 0), Some(0));
        assert_eq!(p.slot_of(0, 1), Some(1));
    }

    #[test]
    fn a_group_never_evicts_its_own_experts() {
        // 2 slots, LRU: (0,0) in slot 0 is the oldest; a group that hits it and then misses
        // must take slot 1, and a third expert in the same group finds no slot.
        let mut p = LruPolicy::new(0, 1, 8, 2, &[re(0, 0, 0), re(0, 1, 1)]).unwrap();
        p.begin_group();
        assert_eq!(p.lookup(0, 0).unwrap(), Lookup::Hit { slot: 0 });
        assert_eq!(
            p.lookup(0, 5).unwrap(),
            Lookup::Miss {
                slot: 1,
                evicted: Some((0, 1))
            }
        );
        assert!(p.lookup(0, 6).is_err());
        // The next group may evict either.
        p.begin_group();
        assert!(matches!(
            p.lookup(0, 6).unwrap(),
            Lookup::Miss { slot: 0, .. }
        ));
    }

    #[test]
    fn only_prompt_passes_picking_every_expert_once_are_scans() {
        // 128 experts, top-8: 16 prompt tokens make 128 picks.
        assert!(pass_is_scan(true, 16, 8, 128));
        assert!(
            !pass_is_scan(true, 15, 8, 128),
            "a short prompt is plain LRU"
        );
        assert!(
            !pass_is_scan(false, 16, 8, 128),
            "a 16-slot decode step is not a scan"
        );
    }

    #[test]
    fn a_scan_recycles_its_own_slots_and_spares_an_older_group() {
        // 4 slots: (0,0) (0,1) cached, two empty. A scan's first misses take the empty
        // slots, the next takes the oldest cached expert (no scan slot is old enough yet).
        let mut p = LruPolicy::new(0, 3, 8, 4, &[re(0, 0, 0), re(0, 1, 1)]).unwrap();
        p.set_scan(true);
        p.begin_group(); // group 1: layer 0
        assert!(matches!(
            p.lookup(0, 5).unwrap(),
            Lookup::Miss {
                slot: 2,
                evicted: None
            }
        ));
        assert!(matches!(
            p.lookup(0, 6).unwrap(),
            Lookup::Miss {
                slot: 3,
                evicted: None
            }
        ));
        assert_eq!(p.scan_slots(), 2);
        p.begin_group(); // group 2: layer 1; slots 2 and 3 were used by the previous group
        assert_eq!(
            p.lookup(1, 0).unwrap(),
            Lookup::Miss {
                slot: 1,
                evicted: Some((0, 1))
            },
            "the previous group's scan slots are spared, so the coldest cached expert goes"
        );
        p.begin_group(); // group 3: layer 2; group 1's ring slots are free, newest fill first
        assert_eq!(
            p.lookup(2, 0).unwrap(),
            Lookup::Miss {
                slot: 3,
                evicted: Some((0, 6))
            }
        );
        assert_eq!(
            p.slot_of(0, 0),
            Some(0),
            "the cached expert outside the scan stays"
        );
        // Outside a scan, a hit makes a ring slot an ordinary one, and misses are plain LRU.
        p.set_scan(false);
        p.begin_group();
        assert!(matches!(p.lookup(0, 5).unwrap(), Lookup::Hit { slot: 2 }));
        assert_eq!(p.scan_slots(), 2, "slots 1 and 3 still hold scan misses");
        assert_eq!(
            p.lookup(1, 7).unwrap(),
            Lookup::Miss {
                slot: 0,
                evicted: Some((0, 0))
            }
        );
        assert_eq!(p.scan_slots(), 2);
    }

    /// Misses of each of `passes` prefill-like passes over `layers` layers of `ne` experts,
    /// every expert of a layer looked up once per pass in one group per layer (what a long
    /// prompt's pass does), with the cache seeded by the first `slots` experts in plan order.
    fn pass_misses(layers: u32, ne: u32, slots: u32, scan: bool, passes: usize) -> Vec<u64> {
        // The plan keeps the same share of every layer (best first: a layer's low experts).
        let per = slots / layers;
        let seeds: Vec<ResidentExpert> = (0..slots)
            .map(|i| re(i % layers, (i / layers).min(ne - 1), i))
            .filter(|r| r.slot < per * layers)
            .collect();
        let mut p = LruPolicy::new(0, layers, ne, slots, &seeds).unwrap();
        let mut out = Vec::new();
        for pass in 0..passes {
            p.set_scan(scan);
            let before = p.misses;
            for l in 0..layers {
                p.begin_group();
                // A different expert order each pass and layer, as routing gives.
                for j in 0..ne {
                    let x = (j * 7 + l * 3 + pass as u32 * 5) % ne;
                    p.lookup(l, x).unwrap();
                }
            }
            out.push(p.misses - before);
            // A few decode steps between prompts: plain lookups of hot experts.
            p.set_scan(false);
            for l in 0..layers {
                p.begin_group();
                p.lookup(l, 0).unwrap();
            }
        }
        out
    }

    #[test]
    fn long_prompts_stream_only_what_the_cache_lacks() {
        // 16 layers x 64 experts, 800 slots: 224 experts stay outside the cache, 14 a layer
        // (the plan keeps 50 of each layer). Measured here: a scan misses 257 a pass, LRU 1,012.
        let (layers, ne, slots) = (16, 64, 800);
        let outside = u64::from(layers * ne - slots);
        let scan = pass_misses(layers, ne, slots, true, 6);
        let lru = pass_misses(layers, ne, slots, false, 6);
        // Steady state (after the first pass built the ring): what is outside the cache plus
        // the ring of about three layers' misses the scan recycles.
        for (i, m) in scan.iter().enumerate().skip(1) {
            assert!(
                *m <= outside + 3 * outside / u64::from(layers) + 8,
                "pass {i}: a scan missed {m} times with {outside} experts outside the cache ({scan:?})"
            );
        }
        // Plain LRU evicts, layer by layer, what the next pass needs first.
        let (s, l): (u64, u64) = (scan[1..].iter().sum(), lru[1..].iter().sum());
        assert!(
            s * 3 < l * 2,
            "a scan should stream well under LRU's misses: {scan:?} vs {lru:?}"
        );
    }

    #[test]
    fn cache_serves_the_right_bytes_through_misses() {
        // One layer, 4 experts of 3 bytes per matrix; 2 slots.
        let gate: Vec<u8> = (0..12).collect();
        let up: Vec<u8> = (100..112).collect();
        let down: Vec<u8> = (200..212).collect();
        let st = HostStacks {
            gate: (GgmlType::F32, &gate),
            up: (GgmlType::F32, &up),
            down: (GgmlType::F32, &down),
        };
        let mut region = vec![0u8; 2 * 16];
        let pol = LruPolicy::new(0, 1, 4, 2, &[re(0, 2, 1)]).unwrap();
        let mut c = CpuExpertCache::new(pol, &mut region, 16, 4, vec![Some(st)]).unwrap();
        for e in [2u32, 0, 3, 2, 1, 1] {
            let b = c.fetch(0, e).unwrap();
            let k = 3 * e as u8;
            assert_eq!(b.gate.1, &[k, k + 1, k + 2]);
            assert_eq!(b.up.1, &[100 + k, 101 + k, 102 + k]);
            assert_eq!(b.down.1, &[200 + k, 201 + k, 202 + k]);
        }
        // 2 hit (seed), 0 miss (empty slot), 3 miss (evicts 2), 2 miss (evicts 0), 1 miss
        // (evicts 3), 1 hit.
        assert_eq!(c.counters(), (2, 4));
    }
}
