//! The solver: checks the request, searches slots / KV residency / layer split in the fixed
//! reservation order, sizes the expert cache from the remainder and assembles the plan.
//! Invariant (DESIGN.md 2 and 3): required items first; then the requested slots and KV
//! residency; the expert cache last. A request that does not fit degrades in one documented
//! order — (1) stream more KV from host, (2) fewer slots — and every step is recorded;
//! MTP and vision are required items and are never dropped.

use crate::account::{align, Demand, Sizing, MIN_RESIDENT_CELLS};
use crate::cost::{device_token_seconds, DeviceWork, PREDICT_CONTEXT};
use crate::experts::ExpertOracle;
use crate::facts::ModelFacts;
use crate::split::{best_split, check_bounds, ranges, Bounds};
use crate::verify::verify_device;
use strata_schemas::inventory::{ModelInventory, TensorRole, VisionSpec};
use strata_schemas::plan::*;
use strata_schemas::probe::{DeviceProbe, HardwareProbe, Vendor, GIB, MIB};
use strata_schemas::profile::ExpertProfile;
use strata_schemas::serve::{ExpertCache, LayerSplit, ServeSettings};

/// RAM the plan leaves to the OS and other processes beyond what it pins or maps.
pub const HOST_HEADROOM: u64 = GIB;
/// Weight of the memory-balance tie-break in the split search, in seconds per token.
const BALANCE_WEIGHT: f64 = 1e-6;
/// Disk read speed assumed when the probe gives none.
pub const DEFAULT_DISK_GBPS: f64 = 2.0;

/// Everything the planner is asked.
pub struct PlanRequest<'a> {
    pub inventory: &'a ModelInventory,
    /// The model path as the user gave it.
    pub model_source: String,
    pub probe: &'a HardwareProbe,
    /// The probe path, for messages.
    pub probe_source: String,
    pub settings: &'a ServeSettings,
    pub profile: Option<&'a ExpertProfile>,
    /// The vision tower, already resolved from `--vision mmproj.gguf` or the descriptor.
    pub vision: Option<&'a VisionSpec>,
}

/// A bad request: exit 1.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("{0}")]
    BadInput(String),
    #[error("internal planner error (please report): {0}")]
    Internal(String),
}

/// One device's shortfall when even the required items do not fit.
#[derive(Debug, Clone)]
pub struct Shortfall {
    pub index: u32,
    pub name: String,
    pub vram_bytes: u64,
    pub layers: (u32, u32),
    pub needed_bytes: u64,
    pub shortfall_bytes: u64,
    pub regions: Vec<(RegionKind, u64)>,
}

/// Why no plan was written: exit 2.
#[derive(Debug, Clone)]
pub struct Infeasible {
    pub devices: Vec<Shortfall>,
    pub host_shortfall_bytes: u64,
    pub reasons: Vec<String>,
    pub suggestions: Vec<String>,
}

pub enum Outcome {
    Planned(Box<Plan>),
    Infeasible(Infeasible),
}

/// The (slots, resident cells, split) the search settled on.
#[derive(Debug, Clone)]
struct Choice {
    slots: u64,
    resident: u64,
    bounds: Bounds,
}

struct Solver<'a> {
    req: &'a PlanRequest<'a>,
    facts: &'a ModelFacts,
    sizing: Sizing<'a>,
    oracle: ExpertOracle,
    devices: Vec<&'a DeviceProbe>,
    ctx: u64,
    pinned_budget: u64,
}

/// Plan `req`.
pub fn solve(req: &PlanRequest) -> Result<Outcome, PlanError> {
    let s = req.settings;
    s.validate("")
        .map_err(|e| PlanError::BadInput(e.to_string()))?;
    let inv = req.inventory;
    let hp = &inv.hparams;

    // Context beyond the trained length needs YaRN.
    if s.max_context > hp.n_ctx_train {
        match &s.rope_scaling {
            None => {
                return Err(PlanError::BadInput(format!(
                    "--max-context {} is beyond the trained context of {} ({} cells): add \
                     --rope-scaling yarn --rope-scale {} --yarn-orig-ctx {}, or lower --max-context to {}",
                    s.max_context,
                    inv.name,
                    hp.n_ctx_train,
                    s.max_context.div_ceil(hp.n_ctx_train),
                    hp.n_ctx_train,
                    hp.n_ctx_train
                )))
            }
            Some(r) => {
                let orig = r.orig_ctx.unwrap_or(hp.n_ctx_train);
                let reach = (orig as f64 * r.factor).floor() as u64;
                if reach < s.max_context {
                    return Err(PlanError::BadInput(format!(
                        "--rope-scale {} x --yarn-orig-ctx {} reaches {} cells, short of --max-context {}: \
                         use --rope-scale {}",
                        r.factor,
                        orig,
                        reach,
                        s.max_context,
                        s.max_context.div_ceil(orig)
                    )));
                }
            }
        }
    }

    // Devices, in pipeline order.
    let order: Vec<u32> = match &s.gpu {
        Some(g) => g.clone(),
        None => req.probe.devices.iter().map(|d| d.index).collect(),
    };
    let mut devices = Vec::with_capacity(order.len());
    for i in &order {
        match req.probe.device(*i) {
            Some(d) => devices.push(d),
            None => {
                let have: Vec<String> = req
                    .probe
                    .devices
                    .iter()
                    .map(|d| d.index.to_string())
                    .collect();
                return Err(PlanError::BadInput(format!(
                    "--gpu {i}: the probe {} has no device with index {i} (it has {})",
                    req.probe_source,
                    have.join(", ")
                )));
            }
        }
    }
    if devices.len() as u32 > hp.n_layer {
        return Err(PlanError::BadInput(format!(
            "--gpu lists {} devices but the model has only {} layers to split",
            devices.len(),
            hp.n_layer
        )));
    }

    let facts = ModelFacts::new(inv, s.kv.ggml());
    let mtp = s.wants_mtp();
    if mtp && !facts.has_mtp {
        return Err(PlanError::BadInput(format!(
            "--mtp/--spec: {} has no MTP (next-n) block (nextn_predict_layers = 0); drop the flag",
            inv.name
        )));
    }
    if s.vision.is_some() && req.vision.is_none() {
        return Err(PlanError::BadInput(
            "--vision: no vision tower to plan: give --vision mmproj.gguf, or use a descriptor with a [vision] section".into(),
        ));
    }
    if let Some(p) = req.profile {
        p.check_against_model(
            hp.n_layer,
            hp.nextn_predict_layers,
            hp.n_expert,
            s.expert_profile.as_deref().unwrap_or("--expert-profile"),
        )
        .map_err(|e| PlanError::BadInput(e.to_string()))?;
    }
    if let LayerSplit::Bounds(b) = &s.layer_split {
        check_bounds(b, devices.len(), hp.n_layer).map_err(PlanError::BadInput)?;
    }

    let host = &req.probe.host;
    let mut pinned_budget = host.available_bytes.saturating_sub(HOST_HEADROOM);
    if let Some(m) = host.memlock_limit_bytes {
        pinned_budget = pinned_budget.min(m);
    }
    let sizing = Sizing::new(
        inv,
        &facts,
        s.max_context,
        s.ubatch as u64,
        s.spec as u64,
        mtp,
        req.vision,
        s.vram_reserve_mib * MIB,
        devices.len(),
        s.expert_cache,
    );
    let oracle = ExpertOracle::new(&facts, req.profile);
    let solver = Solver {
        req,
        facts: &facts,
        sizing,
        oracle,
        devices,
        ctx: s.max_context,
        pinned_budget,
    };
    solver.run()
}

impl<'a> Solver<'a> {
    fn n_layer(&self) -> u32 {
        self.facts.n_layer
    }

    fn demand(&self, d: usize, a: u32, b: u32, slots: u64, resident: u64) -> Demand {
        let n = self.devices.len();
        self.sizing
            .demand(self.devices[d], a, b, d == 0, d + 1 == n, slots, resident)
    }

    /// Pinned host bytes for KV beyond the resident window plus upload staging.
    fn host_pinned(&self, slots: u64, resident: u64) -> u64 {
        let spill = slots * (self.ctx - resident) * self.facts.kv_cell_all(self.sizing.mtp);
        spill + self.staging_estimate(slots)
    }

    /// Pinned staging before the split is known: two expert slots per device (whether or not
    /// its experts all end up resident) and the double-buffered hidden state of each device
    /// whose hand-off in goes through host memory (as the plan allocates them; a peer copy
    /// and the first device need none).
    fn staging_estimate(&self, slots: u64) -> u64 {
        let n = self.devices.len() as u64;
        let slot = align(self.facts.slot_bytes(0, self.n_layer()));
        let handoff = 2 * self.sizing.step_tokens(slots) * self.req.inventory.hparams.n_embd * 4;
        n * 2 * slot + host_handoffs(&self.devices) * handoff
    }

    /// Smallest resident window whose spill fits the pinned budget.
    fn min_resident_for_host(&self, slots: u64) -> Option<u64> {
        let per_cell = slots * self.facts.kv_cell_all(self.sizing.mtp);
        let staging = self.staging_estimate(slots);
        if staging > self.pinned_budget {
            return None;
        }
        if per_cell == 0 {
            return Some(0);
        }
        let spill_cells = (self.pinned_budget - staging) / per_cell;
        Some(self.ctx.saturating_sub(spill_cells))
    }

    /// Fast exact-enough feasibility: greedy longest prefixes (demand grows with the range).
    fn greedy_bounds(&self, slots: u64, resident: u64) -> Option<Bounds> {
        let n = self.n_layer();
        let d = self.devices.len();
        if let LayerSplit::Bounds(b) = &self.req.settings.layer_split {
            let ok = ranges(b, n)
                .iter()
                .enumerate()
                .all(|(i, (a, e))| self.demand(i, *a, *e, slots, resident).remainder().is_ok());
            return ok.then(|| b.clone());
        }
        let mut bounds = Vec::with_capacity(d.saturating_sub(1));
        let mut a = 0u32;
        for i in 0..d {
            let must_leave = (d - 1 - i) as u32;
            let hi = n - must_leave;
            if i + 1 == d {
                if self.demand(i, a, n, slots, resident).remainder().is_err() {
                    return None;
                }
                break;
            }
            // Largest e in (a, hi] that fits.
            if a + 1 > hi
                || self
                    .demand(i, a, a + 1, slots, resident)
                    .remainder()
                    .is_err()
            {
                return None;
            }
            let (mut lo, mut up) = (a + 1, hi);
            while lo < up {
                let mid = (lo + up).div_ceil(2);
                if self.demand(i, a, mid, slots, resident).remainder().is_ok() {
                    lo = mid;
                } else {
                    up = mid - 1;
                }
            }
            bounds.push(lo);
            a = lo;
        }
        Some(bounds)
    }

    fn fits(&self, slots: u64, resident: u64) -> bool {
        resident <= self.ctx
            && self.host_pinned(slots, resident) <= self.pinned_budget
            && self.greedy_bounds(slots, resident).is_some()
    }

    /// Largest resident window in `[lo, hi]` that fits VRAM at `slots` (None if `lo` doesn't).
    fn max_resident(&self, slots: u64, lo: u64, hi: u64) -> Option<u64> {
        if lo > hi || self.greedy_bounds(slots, lo).is_none() {
            return None;
        }
        let (mut l, mut h) = (lo, hi);
        while l < h {
            let mid = l + (h - l).div_ceil(2);
            if self.greedy_bounds(slots, mid).is_some() {
                l = mid;
            } else {
                h = mid - 1;
            }
        }
        Some(l)
    }

    /// The resident window for `slots`: as asked if possible, else the most that fits, never
    /// below what host RAM can take the spill of.
    fn resident_for(&self, slots: u64) -> Option<u64> {
        let asked = self.req.settings.kv_resident_cells();
        let host_min = self.min_resident_for_host(slots)?;
        let floor = asked.min(MIN_RESIDENT_CELLS.min(self.ctx)).max(host_min);
        let top = asked.max(host_min);
        if floor > self.ctx {
            return None;
        }
        self.max_resident(slots, floor, top)
    }

    fn search(&self) -> Option<Choice> {
        let want = self.req.settings.batch as u64;
        let pick =
            |slots: u64| -> Option<(u64, u64)> { self.resident_for(slots).map(|r| (slots, r)) };
        let (slots, resident) = match pick(want) {
            Some(v) => v,
            None => {
                // Fewest-slots fallback: the largest feasible slot count (monotone).
                pick(1)?;
                let (mut lo, mut hi) = (1u64, want - 1);
                while lo < hi {
                    let mid = lo + (hi - lo).div_ceil(2);
                    if pick(mid).is_some() {
                        lo = mid;
                    } else {
                        hi = mid - 1;
                    }
                }
                pick(lo)?
            }
        };
        // The split: explicit, or the fastest over all splits that fit.
        let bounds = match &self.req.settings.layer_split {
            LayerSplit::Bounds(b) => b.clone(),
            LayerSplit::Auto => self.fastest_split(slots, resident)?,
        };
        Some(Choice {
            slots,
            resident,
            bounds,
        })
    }

    fn device_seconds(&self, d: usize, a: u32, b: u32, cache_slots: u64) -> f64 {
        let n = self.devices.len();
        let work = DeviceWork {
            a,
            b,
            holds_head: d + 1 == n,
            cached_mass: self.oracle.cached_mass(a, b, cache_slots),
            total_mass: self.oracle.total_mass(a, b),
            at_context: PREDICT_CONTEXT.min(self.ctx),
        };
        device_token_seconds(self.facts, self.devices[d], &work)
    }

    fn fastest_split(&self, slots: u64, resident: u64) -> Option<Bounds> {
        let n = self.devices.len();
        best_split(n, self.n_layer(), |d, a, b| {
            let dem = self.demand(d, a, b, slots, resident);
            let cache = self.sizing.policy_slots(&dem)?;
            // Tie-break towards balanced memory: at most a microsecond per token, so it only
            // separates splits the cost model cannot tell apart (e.g. every expert resident).
            let used = (dem.fixed() + (cache - dem.min_slots) * dem.slot_bytes) as f64
                / dem.usable().max(1) as f64;
            Some(self.device_seconds(d, a, b, cache) + BALANCE_WEIGHT * used * used)
        })
        .or_else(|| self.greedy_bounds(slots, resident).map(|b| (b, 0.0)))
        .map(|(b, _)| b)
    }

    fn run(&self) -> Result<Outcome, PlanError> {
        match self.search() {
            Some(choice) => self
                .assemble(&choice)
                .map(|p| Outcome::Planned(Box::new(p))),
            None => Ok(Outcome::Infeasible(self.infeasible())),
        }
    }

    /// Per-device shortfall at one slot and the smallest useful window, on the split that
    /// comes closest (explicit split as given).
    fn infeasible(&self) -> Infeasible {
        let n = self.n_layer();
        let d = self.devices.len();
        let resident = self
            .req
            .settings
            .kv_resident_cells()
            .min(MIN_RESIDENT_CELLS.min(self.ctx));
        let host_min = self.min_resident_for_host(1);
        let resident = host_min.map_or(resident, |h| resident.max(h)).min(self.ctx);
        let bounds = match &self.req.settings.layer_split {
            LayerSplit::Bounds(b) => b.clone(),
            LayerSplit::Auto => best_split(d, n, |i, a, b| {
                let dem = self.demand(i, a, b, 1, resident);
                Some(match dem.remainder() {
                    Ok(_) => 0.0,
                    Err(s) => s as f64,
                })
            })
            .map(|(b, _)| b)
            .unwrap_or_else(|| crate::split::even_bounds(d, n)),
        };
        let mut devices = Vec::new();
        let mut reasons = Vec::new();
        for (i, (a, b)) in ranges(&bounds, n).into_iter().enumerate() {
            let dem = self.demand(i, a, b, 1, resident);
            let short = dem.remainder().err().unwrap_or(0);
            let dev = self.devices[i];
            if short > 0 {
                reasons.push(format!(
                    "device {} ({}) holding layers [{a}, {b}) needs {} for its required items but has {} usable: short by {}",
                    dev.index,
                    dev.name,
                    gib(dem.fixed()),
                    gib(dem.usable()),
                    gib(short)
                ));
            }
            let mut regions = vec![
                (RegionKind::RuntimeReserve, dem.runtime_reserve),
                (RegionKind::UserReserve, dem.user_reserve),
            ];
            regions.extend(dem.regions.iter().copied());
            regions.push((RegionKind::ExpertCache, dem.min_slots * dem.slot_bytes));
            devices.push(Shortfall {
                index: dev.index,
                name: dev.name.clone(),
                vram_bytes: dev.vram_bytes,
                layers: (a, b),
                needed_bytes: dem.fixed() + dem.runtime_reserve + dem.user_reserve,
                shortfall_bytes: short,
                regions,
            });
        }
        let host_short = match host_min {
            None => self.staging_estimate(1).saturating_sub(self.pinned_budget),
            Some(_) => 0,
        };
        if host_min.is_none() {
            reasons.push(format!(
                "host: pinned staging alone exceeds the pinned budget of {} (MemAvailable minus {} headroom, capped by memlock)",
                gib(self.pinned_budget),
                gib(HOST_HEADROOM)
            ));
        }
        let mut suggestions = Vec::new();
        let s = self.req.settings;
        if s.vram_reserve_mib > 0 {
            suggestions.push(format!(
                "--vram-reserve-mib {} frees {} per device",
                0,
                gib(s.vram_reserve_mib * MIB)
            ));
        }
        if s.vision.is_some() {
            suggestions.push("drop --vision to free the vision tower and its workspace".into());
        }
        if s.wants_mtp() {
            suggestions.push("drop --mtp/--spec to free the MTP draft head".into());
        }
        if s.ubatch > 128 {
            suggestions.push(format!(
                "--ubatch {} shrinks the prefill scratch",
                (s.ubatch / 4).max(64)
            ));
        }
        if matches!(s.layer_split, LayerSplit::Bounds(_)) {
            if let Some(b) = self.auto_bounds_that_fit() {
                suggestions.push(format!(
                    "--layer-split {} fits (or --layer-split auto)",
                    b.iter()
                        .map(|x| x.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                ));
            }
        }
        suggestions.push("add a device with --gpu, or use a smaller quantization".into());
        Infeasible {
            devices,
            host_shortfall_bytes: host_short,
            reasons,
            suggestions,
        }
    }

    /// With an explicit split that fails, does some other split fit at one slot?
    fn auto_bounds_that_fit(&self) -> Option<Bounds> {
        let resident = self
            .req
            .settings
            .kv_resident_cells()
            .min(MIN_RESIDENT_CELLS.min(self.ctx));
        best_split(self.devices.len(), self.n_layer(), |i, a, b| {
            self.demand(i, a, b, 1, resident)
                .remainder()
                .ok()
                .map(|_| 0.0)
        })
        .map(|(b, _)| b)
    }

    fn assemble(&self, c: &Choice) -> Result<Plan, PlanError> {
        let s = self.req.settings;
        let inv = self.req.inventory;
        let hp = &inv.hparams;
        let n = self.n_layer();
        let nd = self.devices.len();
        let rs = ranges(&c.bounds, n);
        let demands: Vec<Demand> = rs
            .iter()
            .enumerate()
            .map(|(i, (a, b))| self.demand(i, *a, *b, c.slots, c.resident))
            .collect();
        for (i, d) in demands.iter().enumerate() {
            if let Err(short) = d.remainder() {
                return Err(PlanError::Internal(format!(
                    "chosen split leaves device {} short by {short} bytes",
                    self.devices[i].index
                )));
            }
        }
        // Expert cache per device from the remainder, then the global cap of `--expert-cache N`.
        let mut slots: Vec<u64> = demands
            .iter()
            .map(|d| self.sizing.policy_slots(d).unwrap_or(d.min_slots))
            .collect();
        let mut degradations = Vec::new();
        if let ExpertCache::Slots(cap) = s.expert_cache {
            // The minimum working sets are required; the cap shares out what is above them,
            // in pipeline order.
            let possible: u64 = slots.iter().sum();
            let minimum: u64 = demands.iter().map(|d| d.min_slots).sum();
            let mut left = cap.saturating_sub(minimum);
            for (i, d) in demands.iter().enumerate() {
                let extra = (slots[i] - d.min_slots).min(left);
                left -= extra;
                slots[i] = d.min_slots + extra;
            }
            if cap < minimum {
                degradations.push(Degradation {
                    what: "expert_cache".into(),
                    requested: format!("{cap} slots"),
                    planned: format!("{minimum} slots"),
                    reason: "each device holding experts needs its minimum working set (2 x experts per token) to run a layer".into(),
                });
            } else if possible < cap {
                degradations.push(Degradation {
                    what: "expert_cache".into(),
                    requested: format!("{cap} slots"),
                    planned: format!("{possible} slots"),
                    reason: "every byte left after the required and requested items holds expert slots; no more fit (or the model has no more experts)".into(),
                });
            }
        }

        // Degradations of slots and residency.
        let want_slots = s.batch as u64;
        let want_res = s.kv_resident_cells();
        if c.slots < want_slots {
            degradations.push(Degradation {
                what: "batch".into(),
                requested: format!("{want_slots} slots"),
                planned: format!("{} slots", c.slots),
                reason: format!(
                    "{} slots do not fit even with the KV window per slot at its floor of {} cells and the expert cache at its minimum working set",
                    want_slots,
                    want_res.min(MIN_RESIDENT_CELLS.min(self.ctx))
                ),
            });
        }
        if c.resident < want_res {
            degradations.push(Degradation {
                what: "kv_resident".into(),
                requested: format!("{want_res} cells per slot in VRAM"),
                planned: format!("{} cells per slot in VRAM", c.resident),
                reason: format!(
                    "VRAM after the required items and the expert cache's minimum cannot hold the asked window for {} slots; the other {} cells of each slot stream from pinned host memory",
                    c.slots,
                    self.ctx - c.resident
                ),
            });
        } else if c.resident > want_res {
            degradations.push(Degradation {
                what: "kv_resident".into(),
                requested: format!("{want_res} cells per slot in VRAM"),
                planned: format!("{} cells per slot in VRAM", c.resident),
                reason: format!(
                    "host RAM cannot pin the spill of the asked window ({} budget); more of each slot's context stays in VRAM instead",
                    gib(self.pinned_budget)
                ),
            });
        }

        // Devices.
        let mut device_plans = Vec::with_capacity(nd);
        let mut tensors: Vec<TensorPlacement> = Vec::with_capacity(inv.tensors.len());
        let mut total_cached = 0.0;
        let mut total_mass = 0.0;
        let mut seconds = 0.0;
        let mut experts_host: u64 = 0;
        let mut pinned_chunks = Vec::new();
        let chunk_max = s.pinned_chunk_mib * MIB;
        for (i, ((a, b), dem)) in rs.iter().zip(&demands).enumerate() {
            let (a, b) = (*a, *b);
            let dev = self.devices[i];
            let first = i == 0;
            let last = i + 1 == nd;
            // Arena regions, in reservation order, from offset 0.
            let mut regions = Vec::new();
            let mut off = 0u64;
            let mut offset_of = std::collections::BTreeMap::new();
            for (kind, bytes) in dem.regions.iter().copied().chain(std::iter::once((
                RegionKind::ExpertCache,
                slots[i] * dem.slot_bytes,
            ))) {
                offset_of.insert(kind, off);
                regions.push(Region {
                    kind,
                    offset: off,
                    bytes,
                });
                off += align(bytes);
            }
            let arena = off;
            // Reserves at the top of device memory.
            let top = dev.vram_bytes;
            regions.push(Region {
                kind: RegionKind::RuntimeReserve,
                offset: top - dem.runtime_reserve,
                bytes: dem.runtime_reserve,
            });
            regions.push(Region {
                kind: RegionKind::UserReserve,
                offset: top - dem.runtime_reserve - dem.user_reserve,
                bytes: dem.user_reserve,
            });
            // Scratch buffers with their packed offsets (verified with the regions below).
            let (_, scratch, work_pass) =
                self.sizing
                    .scratch(dev, u64::from(b - a), c.slots, c.resident, last);

            // Tensor placements.
            let mut cursor = std::collections::BTreeMap::<RegionKind, u64>::new();
            let mut place = |kind: RegionKind, bytes: u64| -> u64 {
                let base = offset_of[&kind];
                let c = cursor.entry(kind).or_insert(0);
                let at = base + *c;
                *c += align(bytes);
                at
            };
            for t in &inv.tensors {
                let layer = t.layer;
                let mine = match (t.role, layer) {
                    (TensorRole::Embedding, _) => first,
                    (TensorRole::Head | TensorRole::OutputNorm, _) => last,
                    (_, Some(l)) if l >= n => last,
                    (_, Some(l)) => l >= a && l < b,
                    (_, None) => first,
                };
                if !mine {
                    continue;
                }
                let placement = match (t.role, layer) {
                    (_, Some(l)) if l >= n => {
                        if self.sizing.mtp {
                            Placement::Device {
                                device: dev.index,
                                offset: place(RegionKind::Mtp, t.bytes),
                            }
                        } else {
                            Placement::Host
                        }
                    }
                    (TensorRole::ExpertStack, _) => Placement::HostExperts { device: dev.index },
                    (TensorRole::Embedding, _) => Placement::Device {
                        device: dev.index,
                        offset: place(RegionKind::Embedding, t.bytes),
                    },
                    (TensorRole::Head | TensorRole::OutputNorm, _) => Placement::Device {
                        device: dev.index,
                        offset: place(RegionKind::Head, t.bytes),
                    },
                    _ => Placement::Device {
                        device: dev.index,
                        offset: place(RegionKind::DenseWeights, t.bytes),
                    },
                };
                tensors.push(TensorPlacement {
                    name: t.name.clone(),
                    bytes: t.bytes,
                    placement,
                });
            }
            // Everything placed must sit inside its region.
            for (kind, used) in &cursor {
                let region = regions
                    .iter()
                    .find(|r| r.kind == *kind)
                    .expect("region exists");
                if *used > align(region.bytes) {
                    return Err(PlanError::Internal(format!(
                        "device {}: tensors overflow region {} ({used} > {})",
                        dev.index,
                        kind.as_str(),
                        region.bytes
                    )));
                }
            }

            // Resident experts.
            // Slots in (layer, expert) order: a layer's resident experts then sit side by
            // side, at one stride when they are all resident (the GPU's grouped products
            // read them as one strided stack).
            let mut chosen = self.oracle.select(a, b, slots[i]);
            chosen.sort_unstable();
            let resident_bytes: u64 = chosen
                .iter()
                .map(|(l, _)| self.facts.expert[*l as usize])
                .sum();
            experts_host += self.facts.experts_range(a, b) - resident_bytes;
            let resident_experts: Vec<ResidentExpert> = chosen
                .iter()
                .enumerate()
                .map(|(k, (l, e))| ResidentExpert {
                    layer: *l,
                    expert: *e,
                    slot: k as u32,
                })
                .collect();
            let cached = self.oracle.cached_mass(a, b, slots[i]);
            total_cached += cached;
            total_mass += self.oracle.total_mass(a, b);
            let secs = self.device_seconds(i, a, b, slots[i]);
            seconds += secs;

            // Pinned host chunks for this device: KV spill and upload staging.
            let cell = self.facts.kv_cell_range(a, b)
                + if last && self.sizing.mtp {
                    self.facts.mtp_kv_cell
                } else {
                    0
                };
            let spill = c.slots * (self.ctx - c.resident) * cell;
            push_chunks(
                &mut pinned_chunks,
                "kv_spill",
                dev.index,
                spill,
                chunk_max,
                cell.max(1),
            );
            let mut staging = 0;
            if slots[i] < dem.experts_here {
                staging += 2 * dem.slot_bytes;
            }
            // The hidden state arriving through host memory (double-buffered); a peer copy
            // and the first device need none.
            let handoff = handoff_in(i.checked_sub(1).map(|j| self.devices[j]), dev);
            if handoff == "host" {
                staging += 2 * self.sizing.step_tokens(c.slots) * hp.n_embd * 4;
            }
            push_chunks(
                &mut pinned_chunks,
                "staging",
                dev.index,
                staging,
                chunk_max,
                ALIGN_PINNED,
            );

            let kv_layers: Vec<u32> = (a..b)
                .filter(|l| self.facts.kv_cell[*l as usize] > 0)
                .chain(if last && self.sizing.mtp {
                    n..hp.n_blocks_total()
                } else {
                    n..n
                })
                .collect();
            let linear_layers: Vec<u32> = (a..b)
                .filter(|l| self.facts.linear_state[*l as usize] > 0)
                .collect();
            device_plans.push(DevicePlan {
                index: dev.index,
                name: dev.name.clone(),
                vendor: dev.vendor.as_str().into(),
                arch: dev.arch.clone(),
                vram_bytes: dev.vram_bytes,
                free_bytes: dev.vram_bytes - dem.runtime_reserve,
                arena_bytes: arena,
                layer_first: a,
                layer_end: b,
                holds_embedding: first,
                holds_head: last,
                holds_mtp: last && self.sizing.mtp,
                holds_vision: first && self.sizing.vision.is_some(),
                regions,
                expert_slot_bytes: dem.slot_bytes,
                expert_cache_slots: slots[i],
                resident_experts,
                scratch,
                work_pass,
                kv_layers,
                linear_layers,
                predicted_token_seconds: secs,
                handoff_in: handoff.into(),
            });
            let planned = device_plans.last().expect("just pushed");
            verify_device(planned)
                .map_err(|e| PlanError::Internal(format!("device {}: {e}", dev.index)))?;
        }
        // Tensors not placed on any device (an MTP block nobody asked for).
        for t in &inv.tensors {
            if !tensors.iter().any(|p| p.name == t.name) {
                tensors.push(TensorPlacement {
                    name: t.name.clone(),
                    bytes: t.bytes,
                    placement: Placement::Host,
                });
            }
        }

        // Host verdict.
        let host = &self.req.probe.host;
        let pinned_bytes: u64 = pinned_chunks.iter().map(|c: &PinnedChunk| c.bytes).sum();
        let kv_host_bytes: u64 = pinned_chunks
            .iter()
            .filter(|c| c.purpose == "kv_spill")
            .map(|c| c.bytes)
            .sum();
        let ram_required = pinned_bytes + experts_host;
        let ram_budget = host.available_bytes.saturating_sub(HOST_HEADROOM);
        let paging = ram_required > ram_budget;
        let disk = host.disk_read_gbps.unwrap_or(DEFAULT_DISK_GBPS);
        let mut basis = format!(
            "batch 1 at {} cells of context: bytes read per token over each device's memory bandwidth, plus expected expert misses x expert bytes over host-to-device bandwidth; MTP speculation not counted",
            PREDICT_CONTEXT.min(self.ctx)
        );
        if paging {
            let missing = ram_required - ram_budget;
            let frac = (missing as f64 / experts_host.max(1) as f64).min(1.0);
            let misses = (total_mass - total_cached).max(0.0);
            let avg = self.facts.experts_range(0, n) as f64
                / (self.facts.n_expert.max(1) * self.facts.expert_layers(0, n).max(1)) as f64;
            let extra = misses * frac * avg / (disk * 1e9);
            seconds += extra;
            basis.push_str(&format!(
                "; {:.0}% of missed experts read from disk at {disk} GB/s{}",
                frac * 100.0,
                if host.disk_read_gbps.is_none() {
                    " (assumed: the probe gives no host.disk_read_gbps)"
                } else {
                    ""
                }
            ));
            degradations.push(Degradation {
                what: "experts_in_ram".into(),
                requested: format!("{} of non-resident experts held in RAM", gib(experts_host)),
                planned: format!("{} page from disk", gib(missing)),
                reason: format!(
                    "RAM needed {} (pinned {} + mapped experts {}) exceeds MemAvailable {} minus {} headroom; predicted cost {:.1} ms per token",
                    gib(ram_required),
                    gib(pinned_bytes),
                    gib(experts_host),
                    gib(host.available_bytes),
                    gib(HOST_HEADROOM),
                    extra * 1e3
                ),
            });
        }
        let hit_rate = if total_mass > 0.0 {
            total_cached / total_mass
        } else {
            1.0
        };
        let decode = if seconds > 0.0 { 1.0 / seconds } else { 0.0 };

        let suggestions = self.suggestions(c, &demands, &slots, &degradations);
        let vision = self.sizing.vision.is_some();
        let yarn = s.rope_scaling.as_ref().map(|r| PlanYarn {
            factor: r.factor,
            orig_ctx: r.orig_ctx.unwrap_or(hp.n_ctx_train),
        });
        Ok(Plan {
            model: PlanModel {
                arch: inv.arch.clone(),
                name: inv.name.clone(),
                fingerprint: inv.fingerprint(),
                source: self.req.model_source.clone(),
                n_layer: n,
                n_expert: hp.n_expert,
                n_expert_used: hp.n_expert_used,
                total_bytes: inv.total_bytes(),
            },
            hardware_fingerprint: self.req.probe.fingerprint(),
            serve: PlanServe {
                max_context: self.ctx,
                requested_batch: s.batch,
                batch: c.slots as u32,
                kv: s.kv,
                requested_kv_resident: s.kv_resident_cells(),
                kv_resident: c.resident,
                ubatch: s.ubatch,
                mtp: self.sizing.mtp,
                spec: s.spec,
                vision,
                vram_reserve_bytes: s.vram_reserve_mib * MIB,
                expert_cache: s.expert_cache,
                layer_split: c.bounds.clone(),
                layer_split_requested: s.layer_split.to_string(),
                gpu: self.devices.iter().map(|d| d.index).collect(),
                pinned_chunk_bytes: chunk_max,
                yarn,
                expert_profile: s.expert_profile.clone().unwrap_or_default(),
            },
            devices: device_plans,
            tensors,
            host: HostPlan {
                ram_bytes: host.ram_bytes,
                ram_available_bytes: host.available_bytes,
                memlock_limit_bytes: host.memlock_limit_bytes,
                pinned_chunk_max_bytes: pinned_chunks.iter().map(|c| c.bytes).max().unwrap_or(0),
                pinned_chunks,
                pinned_bytes,
                kv_host_bytes,
                experts_host_bytes: experts_host,
                ram_required_bytes: ram_required,
                experts_page_from_disk: paging,
            },
            degradations,
            suggestions,
            predicted: Predicted {
                decode_tok_s: decode,
                expert_hit_rate: hit_rate,
                at_context: PREDICT_CONTEXT.min(self.ctx),
                basis,
            },
        })
    }

    /// Concrete flag changes: the largest batch at this context, the largest context at this
    /// batch, and the KV window that VRAM left over could hold.
    fn suggestions(
        &self,
        c: &Choice,
        demands: &[Demand],
        slots: &[u64],
        degradations: &[Degradation],
    ) -> Vec<String> {
        let s = self.req.settings;
        let mut out = Vec::new();
        let want = s.batch as u64;
        let degraded = degradations
            .iter()
            .any(|d| d.what == "batch" || d.what == "kv_resident");
        if degraded {
            if c.slots < want {
                out.push(format!(
                    "largest batch at --max-context {}: --batch {} --kv-resident {}",
                    self.ctx, c.slots, c.resident
                ));
            } else {
                out.push(format!(
                    "largest VRAM window for --batch {want} at --max-context {}: --kv-resident {}",
                    self.ctx, c.resident
                ));
            }
            // Largest context at the requested batch.
            let (mut lo, mut hi) = (0u64, self.ctx);
            let fits_ctx = |ctx: u64| -> bool {
                let sub = Solver {
                    req: self.req,
                    facts: self.facts,
                    sizing: Sizing::new(
                        self.req.inventory,
                        self.facts,
                        ctx,
                        self.sizing.ubatch,
                        self.sizing.spec,
                        self.sizing.mtp,
                        self.sizing.vision,
                        self.sizing.vram_reserve,
                        self.sizing.n_devices,
                        self.sizing.expert_cache,
                    ),
                    oracle: ExpertOracle::new(self.facts, self.req.profile),
                    devices: self.devices.clone(),
                    ctx,
                    pinned_budget: self.pinned_budget,
                };
                let r = s.kv_resident_cells().min(ctx);
                sub.fits(want, r)
            };
            while lo < hi {
                let mid = lo + (hi - lo).div_ceil(2);
                if fits_ctx(mid) {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
            if lo > 0 {
                out.push(format!(
                    "largest context for --batch {want} with --kv-resident as asked: --max-context {lo}"
                ));
            }
        }
        // VRAM left once every expert of a device is resident: room for a larger KV window.
        let all_resident = demands.iter().zip(slots).all(|(d, s)| *s >= d.experts_here);
        if all_resident && c.resident < self.ctx {
            let rs = ranges(&c.bounds, self.n_layer());
            let keeps_all = |r: u64| {
                rs.iter().enumerate().all(|(i, (a, b))| {
                    let d = self.demand(i, *a, *b, c.slots, r);
                    d.remainder()
                        .is_ok_and(|rem| rem >= (d.experts_here - d.min_slots) * d.slot_bytes)
                })
            };
            let (mut lo, mut hi) = (c.resident, self.ctx);
            while lo < hi {
                let mid = lo + (hi - lo).div_ceil(2);
                if keeps_all(mid) {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
            if lo > c.resident {
                let moved = c.slots * (lo - c.resident) * self.facts.kv_cell_all(self.sizing.mtp);
                out.push(format!(
                    "every expert is resident and VRAM is left over: --kv-resident {lo} moves {} of KV from pinned host memory into VRAM",
                    gib(moved)
                ));
            }
        }
        if !all_resident && s.expert_profile.is_none() {
            out.push("--expert-profile FILE (routing counts from your workload) picks the resident experts by measured use instead of uniformly".into());
        }
        out
    }
}

/// Pinned allocations are rounded to whole pages.
const ALIGN_PINNED: u64 = 4096;

/// Split `bytes` into chunks of at most `max`, each a whole number of `granule`s.
fn push_chunks(
    out: &mut Vec<PinnedChunk>,
    purpose: &str,
    device: u32,
    bytes: u64,
    max: u64,
    granule: u64,
) {
    if bytes == 0 {
        return;
    }
    let per = (max / granule).max(1) * granule;
    let mut left = bytes;
    while left > 0 {
        let take = left.min(per);
        out.push(PinnedChunk {
            purpose: purpose.into(),
            device,
            bytes: take,
        });
        left -= take;
    }
}

/// Bytes as GiB with two decimals.
pub fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / GIB as f64)
}

/// How the hidden state reaches `dev` from `prev`, the device before it in the split: "none"
/// for the first device, "peer" when both are GPUs of one vendor and the probe lists `prev`
/// among `dev`'s peers, else "host" (through pinned host memory; also every CPU device).
fn handoff_in(prev: Option<&DeviceProbe>, dev: &DeviceProbe) -> &'static str {
    let Some(prev) = prev else {
        return "none";
    };
    let gpus = dev.vendor != Vendor::Cpu && dev.vendor == prev.vendor;
    let reach = dev.peers.as_ref().is_some_and(|p| p.contains(&prev.index));
    if gpus && reach {
        "peer"
    } else {
        "host"
    }
}

/// How many devices of a split (in order) take the hidden state in through pinned host memory.
fn host_handoffs(devices: &[&DeviceProbe]) -> u64 {
    devices
        .windows(2)
        .filter(|w| handoff_in(Some(w[0]), w[1]) == "host")
        .count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::*;

    fn run(inv: &ModelInventory, probe: &HardwareProbe, s: &ServeSettings) -> Outcome {
        let req = PlanRequest {
            inventory: inv,
            model_source: "test".into(),
            probe,
            probe_source: "probe.toml".into(),
            settings: s,
            profile: None,
            vision: if s.vision.is_some() {
                inv.vision.as_ref()
            } else {
                None
            },
        };
        solve(&req).unwrap()
    }

    #[test]
    fn the_hand_off_into_each_device_follows_the_probe_peers() {
        let inv = inventory("qwen3moe", qwen3moe_hparams(), "Q8_0");
        let s = ServeSettings {
            max_context: 4096,
            ..Default::default()
        };
        let three = || {
            probe(
                &[(24 * G, 900.0), (24 * G, 900.0), (24 * G, 900.0)],
                128 * G,
                120 * G,
            )
        };
        let handoffs = |pr: &HardwareProbe| match run(&inv, pr, &s) {
            Outcome::Planned(p) => p
                .devices
                .iter()
                .map(|d| d.handoff_in.clone())
                .collect::<Vec<_>>(),
            Outcome::Infeasible(i) => panic!("{}", crate::report::infeasible_text(&i)),
        };
        // No peer lists in the probe: through host memory.
        assert_eq!(handoffs(&three()), ["none", "host", "host"]);
        // Device 1 reads device 0 directly; device 2 lists only device 0, not its predecessor.
        let mut pr = three();
        pr.devices[1].peers = Some(vec![0, 2]);
        pr.devices[2].peers = Some(vec![0]);
        assert_eq!(handoffs(&pr), ["none", "peer", "host"]);
        // Pinned hand-off staging only where the state arrives through host memory: two
        // buffers of a 512-token step of 2048 floats (every expert is resident, so no expert
        // staging either).
        let Outcome::Planned(p) = run(&inv, &pr, &s) else {
            panic!("planned above")
        };
        let staged: Vec<u64> = (0..3)
            .map(|d| {
                p.host
                    .pinned_chunks
                    .iter()
                    .filter(|c| c.purpose == "staging" && c.device == d)
                    .map(|c| c.bytes)
                    .sum()
            })
            .collect();
        assert_eq!(staged, [0, 0, 2 * 512 * 2048 * 4]);
        // The staging estimate made before the split is known counts the same hand-offs.
        let refs =
            |pr: &HardwareProbe| -> u64 { host_handoffs(&pr.devices.iter().collect::<Vec<_>>()) };
        assert_eq!(refs(&pr), 1);
        assert_eq!(refs(&three()), 2);
        assert_eq!(host_handoffs(&[&three().devices[0]]), 0);
        // A CPU device never gets a peer copy.
        let mut pr = three();
        pr.devices[2].vendor = Vendor::Cpu;
        pr.devices[2].peers = Some(vec![1]);
        pr.devices[1].peers = Some(vec![0]);
        assert_eq!(handoffs(&pr), ["none", "peer", "host"]);
    }

    #[test]
    fn smoke_next_two_cards() {
        let inv = inventory("qwen3next", qwen3next_hparams(), "IQ3_S");
        let probe = probe(&[(32 * G, 640.0), (32 * G, 640.0)], 63 * G, 58 * G);
        let s = ServeSettings {
            max_context: 1 << 20,
            batch: 4,
            kv: strata_schemas::serve::KvType::Q8_0,
            kv_resident: Some(32768),
            mtp: true,
            spec: 4,
            vision: Some(None),
            vram_reserve_mib: 500,
            rope_scaling: Some(strata_schemas::serve::RopeScaling {
                kind: "yarn".into(),
                factor: 4.0,
                orig_ctx: Some(262144),
            }),
            ..Default::default()
        };
        match run(&inv, &probe, &s) {
            Outcome::Planned(p) => {
                eprintln!("{}", crate::report::plan_text(&p));
                assert_eq!(p.serve.batch, 4);
            }
            Outcome::Infeasible(i) => panic!("{}", crate::report::infeasible_text(&i)),
        }
    }
}
