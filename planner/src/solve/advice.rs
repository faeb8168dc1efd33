//! What the report tells the user beyond the plan itself: the expert residency a batch costs
//! against the same request at one slot (a degradation), concrete flag changes rounded to
//! values a person types, and the memlock advice when `ulimit -l` is what limits the plan.
//! Invariant: every suggestion names flags with values that the planner verified fit.

use super::*;

/// Every way to raise the memlock limit, for the advice.
const MEMLOCK_HOWTO: &str = "`ulimit -l unlimited` in the shell that starts strata-exec (or `* - memlock unlimited` in /etc/security/limits.conf), `LimitMEMLOCK=infinity` in its systemd unit, `docker run --ulimit memlock=-1:-1` in Docker; then re-run `strata-exec probe`";

/// Whether a plan without the memlock limit could be better than `o`.
pub(super) fn memlock_may_help(o: &Outcome) -> bool {
    match o {
        Outcome::Infeasible(_) => true,
        Outcome::Planned(p) => !p.degradations.is_empty(),
    }
}

/// Add the memlock advice to `o` when the same request without the limit (`unlimited`) plans
/// where `o` does not, or with fewer degradations; `limit` is the memlock limit in bytes.
pub(super) fn memlock(o: &mut Outcome, unlimited: &Outcome, limit: u64) {
    let Outcome::Planned(free) = unlimited else {
        return;
    };
    let text = format!(
        "raise the memlock limit: `ulimit -l` ({} in the probe's host.memlock_limit_bytes) caps pinned host memory, and this request pins {} when it is unlimited{} — {MEMLOCK_HOWTO}",
        bytes(limit),
        bytes(free.host.pinned_bytes),
        if free.degradations.is_empty() {
            " (and then plans with no degradation)"
        } else {
            ""
        }
    );
    match o {
        Outcome::Infeasible(inf) => {
            inf.reasons.push(format!(
                "host: the memlock limit ({}, `ulimit -l`) is what does not fit: without it this request plans",
                bytes(limit)
            ));
            inf.suggestions.insert(0, text);
        }
        Outcome::Planned(p) if free.degradations.len() < p.degradations.len() => {
            p.suggestions.insert(0, text);
        }
        Outcome::Planned(_) => {}
    }
}

impl Solver<'_> {
    /// The hit rate and predicted per-slot decode of the same request at one slot, or None
    /// when one slot does not fit either.
    fn at_one_slot(&self) -> Option<(f64, u64, f64)> {
        let resident = self.resident_for(1)?;
        let bounds = match &self.req.settings.layer_split {
            LayerSplit::Bounds(b) => b.clone(),
            LayerSplit::Auto => self.fastest_split(1, resident)?,
        };
        let c = Choice {
            slots: 1,
            resident,
            bounds,
        };
        let (slots, _) = self.cache_slots(&self.demands(&c));
        let (cached, mass) = self.masses(&c, &slots);
        let step = self.step_seconds(&c, &slots, 1);
        let hit = if mass > 0.0 { cached / mass } else { 1.0 };
        Some((
            hit,
            slots.iter().sum(),
            if step > 0.0 { 1.0 / step } else { 0.0 },
        ))
    }

    /// Seconds of a decode step of `batch` slots at empty context for choice `c`.
    fn step_seconds(&self, c: &Choice, slots: &[u64], batch: u32) -> f64 {
        ranges(&c.bounds, self.n_layer())
            .iter()
            .enumerate()
            .map(|(i, (a, b))| {
                let share = self.share(i, *a, *b, slots[i], c.resident);
                self.cost(i, &share).decode_step_seconds(batch, 0)
            })
            .sum()
    }

    /// A batch whose KV and sessions take VRAM the expert cache has at one slot: the hit rate
    /// it loses is a degradation.
    pub(super) fn residency_vs_batch_one(&self, c: &Choice, hit_rate: f64) -> Option<Degradation> {
        if c.slots <= 1 {
            return None;
        }
        let (hit1, slots1, tok1) = self.at_one_slot()?;
        if hit_rate >= hit1 - 1e-9 {
            return None;
        }
        let (slots, _) = self.cache_slots(&self.demands(c));
        let tok = {
            let step = self.step_seconds(c, &slots, c.slots as u32);
            if step > 0.0 {
                1.0 / step
            } else {
                0.0
            }
        };
        Some(Degradation {
            what: "expert_residency".into(),
            requested: format!(
                "expert hit rate {:.1}% ({slots1} experts resident), as --batch 1 plans",
                hit1 * 100.0
            ),
            planned: format!(
                "{:.1}% ({} experts resident)",
                hit_rate * 100.0,
                slots.iter().sum::<u64>()
            ),
            reason: format!(
                "the KV, sessions and scratch of {} slots take VRAM the expert cache holds at one slot; predicted decode {tok:.1} tok/s per slot against {tok1:.1} at --batch 1",
                c.slots
            ),
        })
    }

    /// The largest `--max-context` at which `want` slots fit with `--kv-resident` as asked.
    fn largest_context(&self, want: u64) -> u64 {
        let s = self.req.settings;
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
                )
                .with_prefix_checkpoint(self.sizing.prefix_checkpoint),
                oracle: ExpertOracle::new(self.facts, self.req.profile),
                devices: self.devices.clone(),
                ctx,
                pinned_budget: self.pinned_budget,
                expert_staging: self.expert_staging,
                coefficients: self.coefficients.clone(),
                gemm: self.gemm.clone(),
            };
            sub.fits(want, s.kv_resident_cells().min(ctx))
        };
        let (mut lo, mut hi) = (0u64, self.ctx);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if fits_ctx(mid) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        round_cells(lo, 1)
    }

    /// Concrete flag changes: the largest batch at this context, the largest context at this
    /// batch, and the KV window that VRAM left over could hold; cell counts are multiples of
    /// 256 where that still fits.
    pub(super) fn suggestions(
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
            let lo = self.largest_context(want);
            if lo > 0 {
                out.push(format!(
                    "largest context for --batch {want} with --kv-resident as asked: --max-context {lo}"
                ));
            }
        }
        if let Some(d) = degradations.iter().find(|d| d.what == "expert_residency") {
            out.push(format!(
                "fewer slots (--batch) or a shorter --max-context leave more VRAM to the expert cache: --batch 1 keeps the {}",
                d.requested.trim_end_matches(", as --batch 1 plans")
            ));
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
            let lo = if lo == self.ctx {
                lo
            } else {
                round_cells(lo, c.resident + 1)
            };
            if lo > c.resident {
                let moved = c.slots * (lo - c.resident) * self.facts.kv_cell_all(self.sizing.mtp);
                out.push(format!(
                    "every expert is resident and VRAM is left over: --kv-resident {lo} moves {} of KV from pinned host memory into VRAM",
                    bytes(moved)
                ));
            }
        }
        if !all_resident && s.expert_profile.is_none() {
            out.push("--expert-profile FILE (routing counts from your workload) picks the resident experts by measured use instead of uniformly".into());
        }
        out
    }
}
