//! The CUDA expert cache of one stage whose plan keeps some experts in host memory: exactly
//! the planned `expert_cache` slots (inside the arena's planned region), seeded at start-up
//! with the plan's `resident_experts` (from the routing profile, or the planner's default),
//! refilled on a miss from the host copy of the expert stacks, with the replacement decisions
//! of [`crate::experts::LruPolicy`] (the CPU engine's; LFU with the profile's hot set pinned
//! under `--kernel-options expert-lfu`). The decode kernels read a per-layer
//! table of expert pointers; a miss rewrites the layer's table entry to point at the slot it
//! filled, so the products read the cache slots without a change to the kernels.
//! Invariant: no slot ever holds bytes other than the expert the policy says it holds; the
//! slots used never exceed the plan's `expert_cache_slots`; every copy into a slot or a table
//! is ordered after every kernel that may read the slot, and the products of a group of
//! tokens, queued after its copies, read all of its experts from their slots. The router's
//! picks are read back to the host with a synchronisation once per MoE layer and pass (the
//! only one; the hybrid path, `hybrid.rs`, reads the pass's `xn` and `wts` rows right after
//! it, the stream idle), so decode passes of such a stage are not captured in CUDA graphs.
//! A decode miss the hybrid path computes on the CPU fills no slot and evicts nothing. When the plan
//! pins a host expert tier for the stage (`host_tier.rs`), a miss is one DMA of a whole slot
//! from pinned memory on a copy stream, ordered by events (a group's copies overlap the
//! previous group's products; the compute stream waits for them before the group's
//! products); otherwise misses are copied on the compute stream from the pageable mmapped
//! model file, which the driver stages before each call returns. A pass whose tokens pick
//! more distinct experts than the cache holds runs in groups of tokens that fit. A long
//! prompt's pass is a scan: its misses recycle the slots earlier scan misses filled rather
//! than evicting cached experts, so a prefill streams what the cache lacks, not the cache.

use super::forward::Grouped;
use super::host_tier::PinnedTier;
use super::hybrid::HostHalf;
use super::launch::decode::{self, ExpertTable};
use super::pinned::PinnedHost;
use super::stage::CudaStage;
use super::{layout, CudaDevice, CudaError, DeviceView};
use crate::backend::WorkBuf;
use crate::experts::{Lookup, LruPolicy};
use crate::load::HostModel;
use crate::routing::RoutingTally;
use std::sync::Arc;
use strata_schemas::dims::Dims;
use strata_schemas::ggml::GgmlType;
use strata_schemas::plan::{DevicePlan, Placement, Plan, RegionKind};

/// Picks per expert of a prefill pass from which the next layer's experts are fetched ahead
/// (at 4, an expert goes unpicked with a chance of about e^-4 under uniform routing).
const PREFETCH_PICKS: usize = 4;

fn err(detail: impl Into<String>) -> CudaError {
    CudaError::Shape {
        op: "expert cache",
        detail: detail.into(),
    }
}

/// Counters of the cache since start-up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExpertCounters {
    pub hits: u64,
    /// Misses copied from host memory into a slot.
    pub misses_streamed: u64,
    /// Bytes copied host -> device for misses (seeding at start-up not counted).
    pub bytes_streamed: u64,
}

/// What the hybrid path needs at start-up: the misses per token the plan's policy (or
/// `--miss-policy`) sends to the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CacheOptions {
    pub lfu: bool,
    pub cpu_per_token: u32,
}

/// One layer served through the cache.
struct CachedLayer {
    /// Arena offset of the layer's expert table (`3 x n_expert` u64 pointers).
    table_off: u64,
    /// The host mirror of that table.
    table: Vec<u64>,
    /// The mirror changed since it was last uploaded.
    stale: bool,
    /// gate, up, down: (type, rows, cols, bytes of one expert).
    mats: [(GgmlType, usize, usize, u64); 3],
}

/// The cache of one stage (see the file's doc).
pub(crate) struct CudaExpertCache {
    host: Arc<dyn HostModel>,
    policy: LruPolicy,
    layer_first: u32,
    /// Arena offset of the `expert_cache` region and bytes of one slot.
    region_off: u64,
    slot_bytes: u64,
    /// Device address of the arena's first byte.
    arena_base: u64,
    layers: Vec<Option<CachedLayer>>,
    /// The pass's picks read back (`max_tok x k`), the distinct experts of a group, and a
    /// slot's bytes in device layout: all sized here, once.
    ids: Vec<u32>,
    in_group: Vec<bool>,
    group: Vec<u32>,
    tmp: Vec<u8>,
    tally: RoutingTally,
    pub(crate) counters: ExpertCounters,
    /// The pinned host expert tier and its copy stream, when the plan pins one and the
    /// driver pinned it.
    tier: Option<PinnedTier>,
    /// A group's misses waiting for the copy stream (expert, slot) and the slots it reads.
    misses: Vec<(u32, u32)>,
    used: Vec<u32>,
    /// The layer whose experts a prefill pass fetched ahead (while the layer before it
    /// computed), and which of its experts that fetch brought in.
    prefetch_layer: Option<u32>,
    prefetched: Vec<bool>,
    /// The hybrid path's host half (`hybrid.rs`).
    hybrid: HostHalf,
}

impl CudaExpertCache {
    /// The cache of planned device `dp` when some of its experts are in no planned slot (their
    /// stacks stay in host memory, `HostExperts`, and `resident_experts` leaves them out), else
    /// `None` (every expert is resident and the tables point at the stacks or slots once, at
    /// binding).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn for_device(
        plan: &Plan,
        dp: &DevicePlan,
        dev: &CudaDevice,
        pinned: Option<Vec<PinnedHost>>,
        host: Arc<dyn HostModel>,
        arena_base: u64,
        d: &Dims,
        max_tok: usize,
        opts: CacheOptions,
    ) -> Result<Option<Self>, CudaError> {
        let (n_layer, n_expert, k) = (d.n_layer, d.n_expert, d.k);
        // Layers whose stacks stay in host memory; when the plan's resident experts cover
        // every expert of them, the tables point at the slots once and no cache runs.
        let hosted: std::collections::BTreeSet<u32> = plan
            .tensors
            .iter()
            .filter(
                |t| matches!(t.placement, Placement::HostExperts { device } if device == dp.index),
            )
            .filter_map(|t| {
                t.name
                    .strip_prefix("blk.")?
                    .split('.')
                    .next()?
                    .parse::<u32>()
                    .ok()
            })
            .collect();
        let resident = dp
            .resident_experts
            .iter()
            .filter(|r| hosted.contains(&r.layer))
            .count();
        if resident >= hosted.len() * n_expert {
            return Ok(None);
        }
        let region = dp.region(RegionKind::ExpertCache).ok_or_else(|| {
            err(format!(
                "device {} serves experts from host memory but the plan has no expert_cache region: re-plan with this strata-plan",
                dp.index
            ))
        })?;
        let slots = dp.expert_cache_slots;
        if slots == 0 || slots.saturating_mul(dp.expert_slot_bytes) > region.bytes {
            return Err(err(format!(
                "device {}: {slots} expert-cache slots of {} bytes do not fit the planned expert_cache region of {} bytes (or there are none): re-plan with this strata-plan",
                dp.index, dp.expert_slot_bytes, region.bytes
            )));
        }
        let mut policy = LruPolicy::new(
            dp.layer_first,
            dp.layer_end,
            n_expert as u32,
            slots as u32,
            &dp.resident_experts,
        )
        .map_err(|e| err(format!("device {}: {e}", dp.index)))?;
        if opts.lfu {
            // A quarter of the slots (at least two tokens' picks) take the misses; the rest
            // keep the profile's hottest experts for good.
            let unpinned = (slots as usize / 4).max(2 * k).min(slots as usize);
            policy.pin_hot(&dp.resident_experts, unpinned);
        }
        let layers = hosted.iter().copied().collect();
        let tier = match pinned {
            Some(chunks) => Some(PinnedTier::new(dp, dev, chunks, layers, n_expert as u64)?),
            None => None,
        };
        Ok(Some(Self {
            host,
            policy,
            layer_first: dp.layer_first,
            region_off: region.offset,
            slot_bytes: dp.expert_slot_bytes,
            arena_base,
            layers: (dp.layer_first..dp.layer_end).map(|_| None).collect(),
            ids: vec![0; max_tok * k],
            in_group: vec![false; n_expert],
            group: Vec::with_capacity(n_expert),
            tmp: vec![0; dp.expert_slot_bytes as usize],
            tally: RoutingTally::new(n_layer, n_expert, k),
            counters: ExpertCounters::default(),
            tier,
            misses: Vec::with_capacity(n_expert),
            used: Vec::with_capacity(n_expert),
            prefetch_layer: None,
            prefetched: vec![false; n_expert],
            hybrid: HostHalf::new(
                opts.cpu_per_token,
                (max_tok, (plan.serve.batch as usize).clamp(1, max_tok)),
                (d.e, d.f, k, n_expert),
            )?,
        }))
    }

    /// Serve `layer` through the cache: its table lives at `table_off` and holds `table`
    /// (absolute pointers, as uploaded); `mats` are gate, up, down as (type, rows, cols).
    pub(crate) fn register_layer(
        &mut self,
        layer: u32,
        table_off: u64,
        table: Vec<u64>,
        mats: [(GgmlType, usize, usize); 3],
    ) -> Result<(), CudaError> {
        let mut m = [(GgmlType::F32, 0, 0, 0u64); 3];
        for (i, (ty, rows, cols)) in mats.into_iter().enumerate() {
            m[i] = (ty, rows, cols, super::forward::mat_bytes(ty, rows, cols)?);
        }
        if m.iter().map(|x| x.3).sum::<u64>() > self.slot_bytes {
            return Err(err(format!(
                "one expert of layer {layer} takes {} bytes but a planned slot holds {}: re-plan with this strata-plan",
                m.iter().map(|x| x.3).sum::<u64>(),
                self.slot_bytes
            )));
        }
        if let Some(t) = self.tier.as_mut() {
            t.fill_layer(self.host.as_ref(), layer, m)?;
        }
        let entry = self
            .layers
            .get_mut(layer.wrapping_sub(self.layer_first) as usize)
            .ok_or_else(|| err(format!("layer {layer} is not on this stage")))?;
        *entry = Some(CachedLayer {
            table_off,
            table,
            stale: false,
            mats: m,
        });
        Ok(())
    }

    /// Whether `layer`'s experts go through the cache.
    pub(crate) fn serves(&self, layer: u32) -> bool {
        self.layers
            .get(layer.wrapping_sub(self.layer_first) as usize)
            .is_some_and(|l| l.is_some())
    }

    pub(crate) fn tally(&self) -> &RoutingTally {
        &self.tally
    }

    pub(crate) fn hits_misses(&self) -> (u64, u64) {
        (self.policy.hits, self.policy.misses)
    }

    /// Misses computed on the host CPU (the hybrid path) since start-up.
    pub(crate) fn misses_cpu(&self) -> u64 {
        self.hybrid.computed
    }

    /// Wait for every copy the copy stream has queued (before the arena goes).
    pub(crate) fn quiesce(&self) {
        if let Some(t) = &self.tier {
            t.quiesce();
        }
    }

    /// The pinned chunks the tier holds and their bytes.
    pub(crate) fn pinned_chunks(&self) -> (u64, u64) {
        self.tier.as_ref().map_or((0, 0), |t| t.chunks())
    }
}

/// Where the table entry of an expert in no slot points until it is fetched (arena offsets):
/// slot 0 of the `expert_cache` region at `region`, valid memory that is never read for that
/// expert, whose every use looks it up (and fills a slot) first.
pub(crate) fn placeholder(region: u64, per_gu: u64) -> [u64; 3] {
    [region, region + per_gu, region + 2 * per_gu]
}

/// How many of `ids`' tokens (rows of `k`) from the first fit: their distinct experts that
/// `counts` (those not pinned in a slot) number at most `budget`; at least one token.
/// `seen` (n_expert flags, all false on entry and on return) marks them meanwhile, `group`
/// collects every distinct expert of those tokens in first-use order.
pub(crate) fn group_len(
    ids: &[u32],
    k: usize,
    budget: usize,
    counts: &dyn Fn(u32) -> bool,
    seen: &mut [bool],
    group: &mut Vec<u32>,
) -> usize {
    group.clear();
    let mut used = 0;
    let mut t = 0;
    for row in ids.chunks(k) {
        let new = row
            .iter()
            .enumerate()
            .filter(|&(j, x)| {
                (*x as usize) < seen.len()
                    && !seen[*x as usize]
                    && !row[..j].contains(x)
                    && counts(*x)
            })
            .count();
        if t > 0 && used + new > budget {
            break;
        }
        used += new;
        for &x in row {
            if (x as usize) < seen.len() && !seen[x as usize] {
                seen[x as usize] = true;
                group.push(x);
            }
        }
        t += 1;
    }
    for &x in group.iter() {
        seen[x as usize] = false;
    }
    t
}

impl CudaStage {
    /// The experts op of a layer served through the cache: read the picks back, then per
    /// group of tokens whose experts fit the slots, fetch its misses into slots, rewrite the
    /// layer's table and run the decode products on the group's rows.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn experts_through_cache(
        &mut self,
        layer: u32,
        tys: [GgmlType; 3],
        xn: WorkBuf,
        ids: WorkBuf,
        wts: WorkBuf,
        y: WorkBuf,
        n: usize,
    ) -> Result<(), CudaError> {
        let (e, f, k, ne) = (self.d.e, self.d.f, self.d.k, self.d.n_expert);
        let mut c = self
            .xcache
            .take()
            .ok_or_else(|| err("this stage has no expert cache"))?;
        let r = self.cache_pass(&mut c, layer, tys, (e, f, k, ne), [xn, ids, wts, y], n);
        self.xcache = Some(c);
        r
    }

    fn cache_pass(
        &mut self,
        c: &mut CudaExpertCache,
        layer: u32,
        [ty, ty_up, ty_down]: [GgmlType; 3],
        (e, f, k, ne): (usize, usize, usize, usize),
        [xn, ids, wts, y]: [WorkBuf; 4],
        n: usize,
    ) -> Result<(), CudaError> {
        if n * k > c.ids.len() {
            return Err(err(format!(
                "a pass of {n} tokens is more than the {} the cache was sized for",
                c.ids.len() / k.max(1)
            )));
        }
        // One synchronisation: the router's picks of the whole pass.
        let idv = self.buf_at(ids, 0, (4 * n * k) as u64)?;
        self.dev.dtoh(idv, &mut c.ids[..n * k])?;
        if let Some(t) = c.tier.as_mut() {
            t.synchronised();
        }
        // The hybrid path reads the pass's rows now, while the stream is idle.
        if c.hybrid.per_token > 0 && !self.kind.prefills() {
            self.hybrid_rows(&mut c.hybrid, n, [xn, wts])?;
        }
        // This layer's products read what a prefetch copied; a prefetch of another layer
        // (a pass that stopped before it) is waited on too, since its slots now count as
        // filled.
        let pending = c.prefetch_layer.take();
        if let (Some(_), Some(t)) = (pending, c.tier.as_ref()) {
            t.await_prefetch(&self.dev)?;
        }
        if pending != Some(layer) {
            c.prefetched.fill(false);
        }
        c.tally.record(layer, &c.ids[..n * k]);
        // A scan's misses, and the next layer's fetch ahead, recycle the slots earlier scan
        // misses filled instead of evicting the cached experts the next pass and the decode
        // steps need.
        c.policy
            .set_scan(crate::experts::pass_is_scan(self.kind.prefills(), n, k, ne));
        let li = (layer - c.layer_first) as usize;
        let budget = c.policy.unpinned_slots();
        let stage_in = self.opts.stage_inputs && ty == GgmlType::Q8_0 && ty_up == ty;
        let mut t0 = 0;
        while t0 < n {
            let mut group = std::mem::take(&mut c.group);
            let policy = &c.policy;
            let counts = |x: u32| !policy.is_pinned(layer, x);
            let g = group_len(
                &c.ids[t0 * k..n * k],
                k,
                budget,
                &counts,
                &mut c.in_group,
                &mut group,
            );
            let need = group.iter().filter(|x| counts(**x)).count();
            if need > budget {
                c.group = group;
                return Err(err(format!(
                    "one token of layer {layer} needs {need} experts outside the pinned slots but the expert cache leaves {budget} slots for them: re-plan with a larger --expert-cache"
                )));
            }
            let grouped = self.grouped_experts(g, [ty, ty_up, ty_down]);
            // The hybrid path: a decode group's misses, up to the policy's count, on the CPU.
            let host_cap = if grouped || self.kind.prefills() {
                0
            } else {
                c.hybrid.cap(g)
            };
            c.policy.begin_group();
            let r = self.fetch_group(c, li, layer, &group, host_cap);
            let stand_in = group.iter().copied().find(|x| !c.hybrid.takes(*x));
            c.group = group;
            if let Err(e) = r {
                c.hybrid.clear();
                return Err(e);
            }
            let l = c.layers[li]
                .as_mut()
                .ok_or_else(|| err("layer not bound"))?;
            if l.stale {
                let tv = self.view(l.table_off, 8 * l.table.len() as u64)?;
                htod_queued(self, table_bytes(&l.table), tv)?;
                l.stale = false;
            }
            let l = &*l;
            let table = ExpertTable {
                table: self.view(l.table_off, 24 * ne as u64)?,
                ty,
                ty_up,
                ty_down,
                n_expert: ne,
                f,
                e,
            };
            let lch = self.launcher();
            if grouped {
                // A prefill group: the grouped tensor-core products, reading every expert of
                // the group from its slot through the table just written.
                let src = Grouped::Table { off: l.table_off };
                let bufs = [xn, ids, wts, y];
                self.experts_grouped(&lch, src, [ty, ty_down], bufs, t0, g)?;
                if let Some(t) = c.tier.as_mut() {
                    t.group_done(&self.dev)?;
                }
                t0 += g;
                continue;
            }
            let mats = l.mats;
            let hybrid = !c.hybrid.experts.is_empty();
            let r = self.decode_group(c, table, (t0, g), [xn, ids, wts, y], stage_in, stand_in);
            if hybrid {
                let r = r.and_then(|()| {
                    let host = c.host.clone();
                    self.hybrid_finish(&mut c.hybrid, host.as_ref(), layer, &mats, (t0, g), y)
                });
                c.hybrid.clear();
                r?;
            } else {
                r?;
            }
            if let Some(t) = c.tier.as_mut() {
                t.group_done(&self.dev)?;
            }
            t0 += g;
        }
        c.prefetched.fill(false);
        self.prefetch_next(c, layer, n)
    }
}

impl CudaStage {
    /// The decode products of a group (`g` tokens from `t0`) through the layer's table; when
    /// the hybrid path takes some of its picks, those are first pointed at `stand_in` with
    /// weight 0 on the device (and no launch runs when the host takes them all).
    #[allow(clippy::too_many_arguments)]
    fn decode_group(
        &self,
        c: &mut CudaExpertCache,
        table: ExpertTable<'_>,
        (t0, g): (usize, usize),
        [xn, ids, wts, y]: [WorkBuf; 4],
        stage_in: bool,
        stand_in: Option<u32>,
    ) -> Result<(), CudaError> {
        let (e, f, k) = (self.d.e, self.d.f, self.d.k);
        if !c.hybrid.experts.is_empty() {
            let picks = &c.ids[t0 * k..(t0 + g) * k];
            let bufs = [ids, wts];
            if !self.hybrid_prepare(&mut c.hybrid, picks, (t0, g), bufs, stand_in)? {
                return Ok(());
            }
        }
        let row = |b: WorkBuf, width: usize| {
            self.buf_at(b, (4 * t0 * width) as u64, (4 * g * width) as u64)
        };
        let (xv, iv, wv, yv) = (row(xn, e)?, row(ids, k)?, row(wts, k)?, row(y, e)?);
        let h = self.buf_at(WorkBuf::H, 0, (4 * g * k * f) as u64)?;
        let lch = self.launcher();
        decode::moe_gate_up(&lch, table, iv, k, xv, h, g, stage_in)?;
        decode::moe_down(&lch, table, iv, wv, k, h, yv, g)
    }

    /// Look up every expert of a group (`group`, distinct) and bring its misses into slots:
    /// from the pinned tier on the copy stream (ordered after the slots' last readers, the
    /// compute stream then waiting for the copies), or from the mapped file on the compute
    /// stream. A failed copy empties the slots it was filling.
    fn fetch_group(
        &self,
        c: &mut CudaExpertCache,
        li: usize,
        layer: u32,
        group: &[u32],
        host_cap: usize,
    ) -> Result<(), CudaError> {
        let ne = self.d.n_expert;
        c.misses.clear();
        c.used.clear();
        c.hybrid.clear();
        for &x in group {
            if x as usize >= ne {
                return Err(err(format!(
                    "the router of layer {layer} picked expert {x} of {ne}"
                )));
            }
            // A miss the hybrid path takes: computed on the CPU, no slot filled or evicted.
            if c.hybrid.experts.len() < host_cap
                && c.policy.slot_of(layer, x).is_none()
                && !c.prefetched[x as usize]
            {
                c.hybrid.take(x);
                continue;
            }
            let slot = match c.policy.lookup(layer, x).map_err(err)? {
                Lookup::Hit { slot } if c.prefetched[x as usize] => {
                    // Fetched ahead: counted once, as the miss it was.
                    c.prefetched[x as usize] = false;
                    c.policy.hits = c.policy.hits.saturating_sub(1);
                    slot
                }
                Lookup::Hit { slot } => {
                    c.counters.hits += 1;
                    slot
                }
                Lookup::Miss { slot, .. } if c.tier.is_some() => {
                    c.misses.push((x, slot));
                    slot
                }
                Lookup::Miss { slot, .. } => {
                    // No synchronisation: an earlier group's products, queued before this
                    // group's copies on the same stream, finish before the copies start.
                    if let Err(e) = fill(self, c, li, layer, x, slot) {
                        // The slot's bytes are no expert now: empty it.
                        c.policy.forget(layer, x);
                        return Err(e);
                    }
                    c.counters.misses_streamed += 1;
                    slot
                }
            };
            c.used.push(slot);
            point(c, li, x, slot);
        }
        let r = self.copy_misses(c, li, layer, false);
        if r.is_err() {
            for &(x, _) in &c.misses {
                c.policy.forget(layer, x);
            }
        }
        if let Some(t) = c.tier.as_mut() {
            for &s in &c.used {
                t.reads(s);
            }
        }
        r
    }

    /// After a prefill pass's layer: when the pass is long enough that every expert of the
    /// next layer is as good as certain to be picked (`PREFETCH_PICKS` picks per expert) and
    /// the cache has room for one and a half layers' experts, copy the next layer's experts
    /// that are in no slot on the copy stream now, while this layer's products (queued) and
    /// the next layer's attention and router run; the next layer waits for them before its
    /// products.
    fn prefetch_next(
        &self,
        c: &mut CudaExpertCache,
        layer: u32,
        n: usize,
    ) -> Result<(), CudaError> {
        let (k, ne) = (self.d.k, self.d.n_expert);
        let next = layer + 1;
        if c.tier.is_none()
            || !self.kind.prefills()
            || n * k < PREFETCH_PICKS * ne
            || !c.serves(next)
            || 2 * c.policy.unpinned_slots() < 3 * ne
        {
            return Ok(());
        }
        let li = (next - c.layer_first) as usize;
        c.policy.begin_group();
        c.misses.clear();
        for x in 0..ne as u32 {
            // Every expert of the layer is looked up, so that none in a slot is evicted for
            // another; one in a slot is touched, not used (no hit counted).
            match c.policy.lookup(next, x).map_err(err)? {
                Lookup::Hit { .. } => c.policy.hits = c.policy.hits.saturating_sub(1),
                Lookup::Miss { slot, .. } => {
                    c.misses.push((x, slot));
                    c.prefetched[x as usize] = true;
                    point(c, li, x, slot);
                }
            }
        }
        let r = self.copy_misses(c, li, next, true);
        if r.is_err() {
            for &(x, _) in &c.misses {
                c.policy.forget(next, x);
            }
            c.prefetched.fill(false);
            return r;
        }
        c.prefetch_layer = (!c.misses.is_empty()).then_some(next);
        Ok(())
    }

    /// The group's misses from the pinned tier, one DMA of a slot each, on the copy stream;
    /// the compute stream waits for them now, or (`ahead`, a prefetch) at the layer's pass.
    fn copy_misses(
        &self,
        c: &mut CudaExpertCache,
        li: usize,
        layer: u32,
        ahead: bool,
    ) -> Result<(), CudaError> {
        let (Some(t), false) = (c.tier.as_ref(), c.misses.is_empty()) else {
            return Ok(());
        };
        let per: u64 = c.layers[li]
            .as_ref()
            .ok_or_else(|| err(format!("layer {layer} is not bound")))?
            .mats
            .iter()
            .map(|m| m.3)
            .sum();
        t.order_after_readers(&self.dev, c.misses.iter().map(|m| m.1))?;
        for &(x, slot) in &c.misses {
            let dst = self.view(c.region_off + slot as u64 * c.slot_bytes, per)?;
            t.copy_expert(&self.dev, layer, x, dst)?;
            c.counters.misses_streamed += 1;
            c.counters.bytes_streamed += per;
        }
        if ahead {
            t.prefetch_done(&self.dev)
        } else {
            t.copies_done(&self.dev)
        }
    }
}

/// The bytes of a table of device pointers.
fn table_bytes(t: &[u64]) -> &[u8] {
    // SAFETY: u64 has no padding and any byte is a valid u8; the slice covers exactly the
    // table's bytes and borrows it.
    unsafe { std::slice::from_raw_parts(t.as_ptr().cast::<u8>(), std::mem::size_of_val(t)) }
}

/// Queue a copy of `src` (pageable host memory) into `dst` on the stage's stream, without
/// waiting: it runs after everything queued before it. The driver copies pageable memory to
/// its own staging before returning, so `src` may change as soon as this returns.
fn htod_queued(st: &CudaStage, src: &[u8], dst: DeviceView<'_>) -> Result<(), CudaError> {
    dst.expect_len("expert cache copy", src.len() as u64)?;
    // SAFETY: `dst` is a checked view of exactly src.len() bytes inside the stage's live arena;
    // `src` is pageable host memory, which htod_raw stages before it returns (on HIP it waits).
    unsafe { st.dev.htod_raw("expert cache", dst.ptr(), src) }
}

/// Point the layer's table entry of expert `x` at `slot` (marking the table stale when that
/// changes it).
fn point(c: &mut CudaExpertCache, li: usize, x: u32, slot: u32) {
    let (base, region, sb) = (c.arena_base, c.region_off, c.slot_bytes);
    let Some(l) = c.layers[li].as_mut() else {
        return;
    };
    let so = base + region + slot as u64 * sb;
    let want = [so, so + l.mats[0].3, so + l.mats[0].3 + l.mats[1].3];
    let at = 3 * x as usize;
    if l.table[at..at + 3] != want {
        l.table[at..at + 3].copy_from_slice(&want);
        l.stale = true;
    }
}

/// Copy expert `x` of `layer` from the host stacks into `slot` (device layout).
fn fill(
    st: &CudaStage,
    c: &mut CudaExpertCache,
    li: usize,
    layer: u32,
    x: u32,
    slot: u32,
) -> Result<(), CudaError> {
    let mats = c.layers[li]
        .as_ref()
        .ok_or_else(|| err(format!("layer {layer} is not bound")))?
        .mats;
    let mut off = c.region_off + slot as u64 * c.slot_bytes;
    for ((ty, rows, cols, per), part) in mats.into_iter().zip(["gate", "up", "down"]) {
        let name = format!("blk.{layer}.ffn_{part}_exps.weight");
        let stack = c
            .host
            .tensor_bytes(&name)
            .ok_or_else(|| err(format!("`{name}` is missing from the model")))?;
        let per = per as usize;
        let src = stack
            .get(x as usize * per..(x as usize + 1) * per)
            .ok_or_else(|| err(format!("`{name}` holds no expert {x}")))?;
        let dst = st.view(off, per as u64)?;
        if layout::is_rearranged(ty) {
            let tmp = &mut c.tmp[..per];
            layout::to_device(ty, src, 1, rows, cols, tmp).map_err(|e| err(e.to_string()))?;
            htod_queued(st, tmp, dst)?;
        } else {
            htod_queued(st, src, dst)?;
        }
        c.counters.bytes_streamed += per as u64;
        off += per as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_take_whole_tokens_while_their_experts_fit() {
        let mut seen = vec![false; 8];
        let mut g = Vec::new();
        let all = |_: u32| true;
        // k = 2; tokens pick {0,1}, {1,2}, {3,4}, {0,5}.
        let ids = [0, 1, 1, 2, 3, 4, 0, 5];
        assert_eq!(group_len(&ids, 2, 3, &all, &mut seen, &mut g), 2);
        assert_eq!(g, vec![0, 1, 2]);
        assert!(seen.iter().all(|s| !s), "flags are cleared");
        assert_eq!(group_len(&ids[4..], 2, 3, &all, &mut seen, &mut g), 1);
        assert_eq!(g, vec![3, 4]);
        // Everything fits in 8 slots; a token never splits, even when it alone overflows.
        assert_eq!(group_len(&ids, 2, 8, &all, &mut seen, &mut g), 4);
        assert_eq!(group_len(&ids, 2, 1, &all, &mut seen, &mut g), 1);
        // A token picking one expert twice counts it once.
        assert_eq!(group_len(&[6, 6, 7, 7], 2, 2, &all, &mut seen, &mut g), 2);
        assert_eq!(g, vec![6, 7]);
        // Pinned experts (0 and 1 here) take no budget: tokens {0,1}, {1,2}, {3,4} need 0, 1
        // and 2 more unpinned slots.
        let unpinned = |x: u32| x > 1;
        assert_eq!(group_len(&ids, 2, 2, &unpinned, &mut seen, &mut g), 2);
        assert_eq!(group_len(&ids, 2, 3, &unpinned, &mut seen, &mut g), 3);
        assert_eq!(g, vec![0, 1, 2, 3, 4]);
    }
}
