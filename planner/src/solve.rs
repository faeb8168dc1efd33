//! The solver: checks the request, searches slots / KV residency / layer split in the fixed
//! reservation order, sizes the expert cache from the remainder and assembles the plan.
//! Invariant (DESIGN.md 2 and 3): required items first; then the requested slots and KV
//! residency; the expert cache last. A request that does not fit degrades in one documented
//! order — (1) stream more KV from host, (2) fewer slots — and every step is recorded;
//! MTP and vision are required items and are never dropped. Assembling the chosen plan is
//! `assemble`; degradations beyond the search and suggested flags are `advice`.

mod advice;
mod assemble;

use crate::account::{align, Demand, Sizing, MIN_RESIDENT_CELLS};
use crate::cost::{device_cost, prefill_gemm, Coefficients, DeviceShare};
use crate::experts::ExpertOracle;
use crate::facts::ModelFacts;
use crate::split::{best_split, check_bounds, ranges, Bounds};
use crate::units::{bytes, round_cells};
use strata_schemas::inventory::{ModelInventory, VisionSpec};
use strata_schemas::plan::*;
use strata_schemas::probe::{DeviceProbe, HardwareProbe, HostProbe, Vendor, GIB, MIB};
use strata_schemas::profile::ExpertProfile;
use strata_schemas::serve::{LayerSplit, ServeSettings};

/// RAM the plan leaves to the OS and other processes beyond what it pins or maps.
pub const HOST_HEADROOM: u64 = GIB;
/// Weight of the memory-balance tie-break in the split search, in seconds per token.
const BALANCE_WEIGHT: f64 = 1e-6;
/// Disk read speed assumed when the probe gives none.
pub const DEFAULT_DISK_GBPS: f64 = 2.0;
/// Context the split search compares decode speeds at (short chat turns), capped by
/// `--max-context`.
pub const SEARCH_CONTEXT: u64 = 4096;

/// The pinned host memory a plan may use, and what limits it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinnedBudget {
    pub bytes: u64,
    /// True when the memlock limit (`ulimit -l`) is the smaller bound.
    pub memlock_binds: bool,
}

/// The memlock rule: pinned host memory is at most MemAvailable minus [`HOST_HEADROOM`], and
/// at most the memlock limit (`ulimit -l`) when the probe has one.
/// Measured on the GPU machine (`strata-exec probe --memlock-test`, BENCHMARKS.md): there
/// cuMemHostAlloc and cuMemHostRegister pinned 64 MiB under an 8 MiB `ulimit -l` and VmLck did
/// not move; that machine runs a gVisor kernel, so until a bare-metal Linux box is measured
/// the same way this keeps the conservative rule (pinned memory counts against the limit).
pub fn pinned_budget(host: &HostProbe) -> PinnedBudget {
    let ram = host.available_bytes.saturating_sub(HOST_HEADROOM);
    match host.memlock_limit_bytes {
        Some(m) if m < ram => PinnedBudget {
            bytes: m,
            memlock_binds: true,
        },
        _ => PinnedBudget {
            bytes: ram,
            memlock_binds: false,
        },
    }
}

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
    /// The MTP-only file `inventory`'s MTP block was merged from (`--mtp-model`), recorded in
    /// the plan beside the model.
    pub mtp_file: Option<strata_schemas::plan::PlanMtpFile>,
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
    /// Count upload staging for experts on every device before the split is known (the
    /// second, conservative pass); the first pass counts it only once assembled, so a plan
    /// whose experts are all resident needs no pinned memory for them.
    expert_staging: bool,
    /// Per device: its cost coefficients and whether it prefills on tensor cores.
    coefficients: Vec<Coefficients>,
    gemm: Vec<bool>,
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

    let facts = &facts;
    let budget = pinned_budget(&req.probe.host);
    let mut outcome = solve_with(req, facts, &devices, budget.bytes)?;
    if budget.memlock_binds && advice::memlock_may_help(&outcome) {
        let free = pinned_budget(&HostProbe {
            memlock_limit_bytes: None,
            ..req.probe.host.clone()
        });
        let unlimited = solve_with(req, facts, &devices, free.bytes)?;
        advice::memlock(&mut outcome, &unlimited, budget.bytes);
    }
    Ok(outcome)
}

/// The search with `pinned` bytes of pinned host memory: first counting expert staging only
/// where the assembled plan needs it, then, if that plan pins too much, counting it on every
/// device from the start.
fn solve_with(
    req: &PlanRequest,
    facts: &ModelFacts,
    devices: &[&DeviceProbe],
    pinned: u64,
) -> Result<Outcome, PlanError> {
    let lean = solver(req, facts, devices, pinned, false).run()?;
    match &lean {
        Outcome::Planned(p) if p.host.pinned_bytes > pinned => {
            solver(req, facts, devices, pinned, true).run()
        }
        _ => Ok(lean),
    }
}

fn solver<'a>(
    req: &'a PlanRequest<'a>,
    facts: &'a ModelFacts,
    devices: &[&'a DeviceProbe],
    pinned_budget: u64,
    expert_staging: bool,
) -> Solver<'a> {
    let s = req.settings;
    let sizing = Sizing::new(
        req.inventory,
        facts,
        s.max_context,
        s.ubatch as u64,
        s.spec as u64,
        s.wants_mtp(),
        req.vision,
        s.vram_reserve_mib * MIB,
        devices.len(),
        s.expert_cache,
    )
    .with_prefix_checkpoint(s.prefix_checkpoint);
    Solver {
        req,
        facts,
        sizing,
        oracle: ExpertOracle::new(facts, req.profile),
        devices: devices.to_vec(),
        ctx: s.max_context,
        pinned_budget,
        expert_staging,
        coefficients: devices
            .iter()
            .map(|d| Coefficients::for_model(d, facts))
            .collect(),
        gemm: devices
            .iter()
            .map(|d| prefill_gemm(req.inventory, d.vendor))
            .collect(),
    }
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

    /// Pinned staging before the split is known: the double-buffered hidden state of each
    /// device whose hand-off in goes through host memory (as the plan allocates them; a peer
    /// copy and the first device need none), and in the conservative pass two expert slots
    /// per device whether or not its experts all end up resident.
    fn staging_estimate(&self, slots: u64) -> u64 {
        let n = self.devices.len() as u64;
        let slot = align(self.facts.slot_bytes(0, self.n_layer()));
        let handoff = 2 * self.sizing.step_tokens(slots) * self.req.inventory.hparams.n_embd * 4;
        let experts = if self.expert_staging { n * 2 * slot } else { 0 };
        experts + host_handoffs(&self.devices) * handoff
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

    /// Largest resident window in `[lo, hi]` that fits VRAM at `slots` (None if `lo` doesn't),
    /// rounded down to a multiple of 256 cells where that stays in range, so the planned
    /// window is a value a person would type.
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
        Some(if l == hi { l } else { round_cells(l, lo) })
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

    /// What device `d` holding `[a, b)` with `cache_slots` expert slots does in a step.
    fn share(&self, d: usize, a: u32, b: u32, cache_slots: u64, resident: u64) -> DeviceShare {
        let prev = d.checked_sub(1).map(|p| self.devices[p]);
        let dev = self.devices[d];
        DeviceShare {
            a,
            b,
            holds_head: d + 1 == self.devices.len(),
            cached_mass: self.oracle.cached_mass(a, b, cache_slots),
            total_mass: self.oracle.total_mass(a, b),
            experts_covered: self.oracle.covers(a, b, cache_slots),
            kv_resident: resident,
            handoff_in: handoff_in(prev, dev),
            prefill_gemm: self.gemm[d],
            expert_shares: self.oracle.rank_shares(a, b),
        }
    }

    /// The cost terms of device `d` for `share`.
    fn cost(&self, d: usize, share: &DeviceShare) -> DeviceCost {
        device_cost(self.facts, self.devices[d], &self.coefficients[d], share)
    }

    /// Seconds device `d` spends on a decode step of `slots` slots at the search context.
    fn device_seconds(&self, d: usize, a: u32, b: u32, cache: u64, slots: u64, res: u64) -> f64 {
        let cost = self.cost(d, &self.share(d, a, b, cache, res));
        cost.decode_step_seconds(slots as u32, SEARCH_CONTEXT.min(self.ctx))
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
            Some(
                self.device_seconds(d, a, b, cache, slots, resident) + BALANCE_WEIGHT * used * used,
            )
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
                    bytes(dem.fixed()),
                    bytes(dem.usable()),
                    bytes(short)
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
                bytes(self.pinned_budget),
                bytes(HOST_HEADROOM)
            ));
        }
        let mut suggestions = Vec::new();
        let s = self.req.settings;
        if s.vram_reserve_mib > 0 {
            suggestions.push(format!(
                "--vram-reserve-mib {} frees {} per device",
                0,
                bytes(s.vram_reserve_mib * MIB)
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
            mtp_file: None,
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

    /// The MTP block sits with the head on the last device; when that device is not the
    /// first and the file has no `nextn.embed_tokens`, the block embeds with a copy of
    /// `token_embd.weight` planned in that device's `mtp` region (the first device keeps the
    /// table in its `embedding` region); unsplit, or with the block's own embedding, no copy.
    #[test]
    fn a_split_mtp_plan_counts_a_copy_of_the_embedding_on_the_mtp_device() {
        use strata_schemas::plan::{Placement, TensorPlacement};
        let shared = inventory("qwen3next", qwen3next_hparams(), "Q8_0");
        let n = shared.hparams.n_layer;
        let embd = shared.tensor("token_embd.weight").unwrap().clone();
        let mut own = shared.clone();
        own.tensors.push(strata_schemas::inventory::TensorInfo {
            name: format!("blk.{n}.nextn.embed_tokens.weight"),
            role: strata_schemas::inventory::TensorRole::MtpExtra,
            layer: Some(n),
            ..embd.clone()
        });
        let s = |split: Option<u32>| ServeSettings {
            max_context: 4096,
            batch: 1,
            mtp: true,
            spec: 2,
            layer_split: split.map_or(LayerSplit::Auto, |b| LayerSplit::Bounds(vec![b])),
            ..Default::default()
        };
        let planned = |inv: &ModelInventory, devices: usize, split: Option<u32>| {
            let pr = probe(&vec![(96 * G, 640.0); devices], 256 * G, 240 * G);
            match run(inv, &pr, &s(split)) {
                Outcome::Planned(p) => *p,
                Outcome::Infeasible(i) => panic!("{}", crate::report::infeasible_text(&i)),
            }
        };
        // (device, region) of each placement of `name`.
        let places = |p: &Plan, name: &str| -> Vec<(u32, RegionKind)> {
            p.tensors
                .iter()
                .filter(|t: &&TensorPlacement| t.name == name)
                .filter_map(|t| match t.placement {
                    Placement::Device { device, offset } => {
                        let d = p.devices.iter().find(|d| d.index == device).unwrap();
                        let r = d
                            .regions
                            .iter()
                            .find(|r| (r.offset..r.offset + r.bytes).contains(&offset))
                            .unwrap();
                        Some((device, r.kind))
                    }
                    _ => None,
                })
                .collect()
        };
        let one = planned(&shared, 1, None);
        let split = planned(&shared, 2, Some(n / 2));
        let own_one = planned(&own, 1, None);
        let own_split = planned(&own, 2, Some(n / 2));
        for p in [&one, &split, &own_one, &own_split] {
            assert_eq!(p.serve.kv_resident, 4096, "every cell resident");
            let last = p.devices.last().unwrap();
            assert!(last.holds_mtp, "the MTP block is on the last device");
            assert!(
                last.region_bytes(RegionKind::Head) > 0
                    && places(p, "output.weight") == [(last.index, RegionKind::Head)],
                "the head sits with the MTP block"
            );
        }
        assert_eq!(
            places(&one, "token_embd.weight"),
            [(0, RegionKind::Embedding)]
        );
        assert_eq!(
            places(&split, "token_embd.weight"),
            [(0, RegionKind::Embedding), (1, RegionKind::Mtp)]
        );
        assert_eq!(
            places(&own_split, "token_embd.weight"),
            [(0, RegionKind::Embedding)]
        );
        // The copy is counted in the mtp region: exactly the table's aligned bytes more than
        // the unsplit plan's (the same slots and cells), and none with the block's own table.
        let mtp = |p: &Plan| p.devices.last().unwrap().region_bytes(RegionKind::Mtp);
        assert_eq!(mtp(&split), mtp(&one) + align(embd.bytes));
        assert_eq!(mtp(&own_split), mtp(&own_one), "the block's own table");
        // The report says so, once, for the split plan only.
        let copy_notes = |p: &Plan| {
            crate::report::notes(p)
                .into_iter()
                .filter(|n| n.contains("a copy of `token_embd.weight`"))
                .collect::<Vec<_>>()
        };
        let said = copy_notes(&split);
        assert!(
            said.len() == 1 && said[0].starts_with("device 1:") && said[0].contains("mtp region"),
            "{said:?}"
        );
        for p in [&one, &own_one, &own_split] {
            assert!(copy_notes(p).is_empty());
        }
        assert_eq!(
            places(&own_split, &format!("blk.{n}.nextn.embed_tokens.weight")),
            [(1, RegionKind::Mtp)]
        );
    }

    /// A tied head (no `output.weight`) on a last stage that is not the first reads its own
    /// copy of `token_embd.weight`, placed in its `head` region (which counted it already).
    #[test]
    fn a_split_tied_head_has_its_copy_of_the_embedding() {
        use strata_schemas::plan::Placement;
        let hp = strata_schemas::inventory::HParams {
            tied_embeddings: true,
            ..qwen3moe_hparams()
        };
        let inv = inventory("qwen3moe", hp, "Q8_0");
        assert!(inv.tensor("output.weight").is_none());
        let embd = inv.tensor("token_embd.weight").unwrap().bytes;
        let s = ServeSettings {
            max_context: 4096,
            layer_split: LayerSplit::Bounds(vec![24]),
            ..Default::default()
        };
        let pr = probe(&[(96 * G, 640.0), (96 * G, 640.0)], 256 * G, 240 * G);
        let Outcome::Planned(p) = run(&inv, &pr, &s) else {
            panic!("infeasible")
        };
        let head = p.devices[1].region(RegionKind::Head).unwrap();
        let copies: Vec<u32> = p
            .tensors
            .iter()
            .filter(|t| t.name == "token_embd.weight")
            .map(|t| match t.placement {
                Placement::Device { device, offset } => {
                    if device == 1 {
                        assert!(offset >= head.offset && offset + embd <= head.offset + head.bytes);
                    }
                    device
                }
                _ => panic!("the embedding is placed on a device"),
            })
            .collect();
        assert_eq!(copies, [0, 1]);
        assert!(head.bytes >= align(embd));
    }

    /// `--expert-profile` with skewed routing (an eighth of the experts take three fifths of
    /// the picks in every layer) on an all-resident plan: the same bytes, so the same decode,
    /// but the busy experts take several tiles of the grouped prefill products.
    #[test]
    fn a_skewed_profile_predicts_a_slower_prefill_at_the_same_decode() {
        use strata_schemas::profile::ExpertProfile;
        let inv = inventory("qwen3moe", qwen3moe_hparams(), "Q8_0");
        let probe = probe(&[(141 * G, 4800.0)], 128 * G, 120 * G);
        let s = ServeSettings {
            max_context: 4096,
            ..Default::default()
        };
        let (layers, e) = (inv.hparams.n_layer, inv.hparams.n_expert as u32);
        let row: Vec<u64> = (0..e).map(|i| if i < e / 8 { 6 * 7 } else { 4 }).collect();
        let profile = ExpertProfile {
            layers,
            experts: e,
            counts: (0..layers).flat_map(|_| row.clone()).collect(),
            reuse: None,
        };
        let plan = |profile: Option<&ExpertProfile>| {
            let req = PlanRequest {
                inventory: &inv,
                model_source: "test".into(),
                probe: &probe,
                probe_source: "probe.toml".into(),
                settings: &s,
                profile,
                vision: None,
                mtp_file: None,
            };
            match solve(&req).unwrap() {
                Outcome::Planned(p) => p.predicted,
                Outcome::Infeasible(i) => panic!("{}", crate::report::infeasible_text(&i)),
            }
        };
        let (uniform, skewed) = (plan(None), plan(Some(&profile)));
        assert_eq!(skewed.expert_hit_rate, 1.0);
        assert!((uniform.decode_tok_s - skewed.decode_tok_s).abs() < 1e-9);
        assert!(
            skewed.prefill_tok_s < 0.92 * uniform.prefill_tok_s,
            "{} vs {}",
            skewed.prefill_tok_s,
            uniform.prefill_tok_s
        );
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

    /// The prefix checkpoint: on the 80B Qwen3-Next one more copy of each slot's linear state
    /// (DESIGN.md's worked ~75 MB a slot) per device that holds linear layers, in its own
    /// region that the verifier checked, said in the notes; none with
    /// `--no-prefix-checkpoint`, and none for Qwen3-MoE (no linear state).
    #[test]
    fn a_prefix_checkpoint_is_one_copy_of_each_slots_linear_state() {
        let inv = inventory("qwen3next", qwen3next_hparams(), "IQ3_S");
        let probe = probe(&[(96 * G, 640.0), (96 * G, 640.0)], 63 * G, 58 * G);
        let on = ServeSettings {
            max_context: 8192,
            batch: 3,
            ..Default::default()
        };
        let off = ServeSettings {
            prefix_checkpoint: false,
            ..on.clone()
        };
        let planned = |s: &ServeSettings| match run(&inv, &probe, s) {
            Outcome::Planned(p) => *p,
            Outcome::Infeasible(i) => panic!("{}", crate::report::infeasible_text(&i)),
        };
        let (p_on, p_off) = (planned(&on), planned(&off));
        assert!(p_on.serve.prefix_checkpoint && !p_off.serve.prefix_checkpoint);
        assert_eq!(p_on.devices.len(), 2);
        let per_slot = |p: &Plan| -> u64 {
            p.devices
                .iter()
                .map(|d| d.region_bytes(RegionKind::PrefixCheckpoint))
                .sum::<u64>()
                / 3
        };
        let linear = |p: &Plan| -> u64 {
            p.devices
                .iter()
                .map(|d| d.region_bytes(RegionKind::LinearState))
                .sum()
        };
        // Planned = used: the linear state of 3 slots, give or take each region's alignment.
        let want = 36 * inv.hparams.linear_state_bytes_per_layer();
        assert!(want > 75_000_000 && want < 80_000_000, "{want}");
        assert!(per_slot(&p_on) >= want && per_slot(&p_on) < want + 4096);
        assert!(linear(&p_on) >= 3 * want && linear(&p_on) < 3 * want + 8192);
        assert_eq!(per_slot(&p_off), 0);
        assert_eq!(linear(&p_off), linear(&p_on));
        for d in &p_on.devices {
            assert!(
                d.region(RegionKind::PrefixCheckpoint).is_some(),
                "device {}",
                d.index
            );
            crate::verify::verify_device(d).unwrap();
        }
        let notes = crate::report::notes(&p_on).join("\n");
        assert!(
            notes.contains("prefix_checkpoint") && notes.contains("--no-prefix-checkpoint"),
            "{notes}"
        );
        assert!(crate::report::notes(&p_off)
            .join("\n")
            .contains("prefix checkpoint off"));
        assert!(
            crate::report::plan_json(&p_on)["devices"][0]["regions"]["prefix_checkpoint"]
                .as_u64()
                .is_some_and(|b| b > 0)
        );
        // No linear attention: no checkpoint, whatever was asked.
        let moe = inventory("qwen3moe", qwen3moe_hparams(), "Q8_0");
        let Outcome::Planned(p) = run(&moe, &probe, &on) else {
            panic!("qwen3moe fits two 96 GB cards")
        };
        assert!(!p.serve.prefix_checkpoint);
        assert!(p
            .devices
            .iter()
            .all(|d| d.region(RegionKind::PrefixCheckpoint).is_none()));
    }
}
