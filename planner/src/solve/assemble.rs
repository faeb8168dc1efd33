//! Assembling the search's choice (slots, VRAM window, split) into the plan: expert-cache
//! slots per device, arena regions and tensor placements, resident experts, pinned chunks,
//! the host RAM verdict and the prediction.
//! Invariant: every region and placement is checked (`verify_device`) before the plan is
//! returned, and every request the plan does not honour as asked is a `Degradation`.

use super::*;
use crate::verify::verify_device;
use std::collections::BTreeMap;
use strata_schemas::inventory::TensorRole;
use strata_schemas::serve::ExpertCache;

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

/// One device as assembled, before the host verdict.
struct Built {
    plan: DevicePlan,
    /// Expert bytes of its layers not resident in its cache.
    experts_host: u64,
    /// Average bytes of one expert of its layers (for the disk share of a miss).
    expert_bytes: f64,
    cached_mass: f64,
    total_mass: f64,
}

impl Solver<'_> {
    /// The demands of every device of the choice.
    pub(super) fn demands(&self, c: &Choice) -> Vec<Demand> {
        ranges(&c.bounds, self.n_layer())
            .iter()
            .enumerate()
            .map(|(i, (a, b))| self.demand(i, *a, *b, c.slots, c.resident))
            .collect()
    }

    /// Expert-cache slots per device under `--expert-cache` (the remainder, the minimum, or a
    /// global cap shared out in pipeline order), and the degradation when a cap cannot be met.
    pub(super) fn cache_slots(&self, demands: &[Demand]) -> (Vec<u64>, Option<Degradation>) {
        let mut slots: Vec<u64> = demands
            .iter()
            .map(|d| self.sizing.policy_slots(d).unwrap_or(d.min_slots))
            .collect();
        let ExpertCache::Slots(cap) = self.req.settings.expert_cache else {
            return (slots, None);
        };
        // The minimum working sets are required; the cap shares out what is above them.
        let possible: u64 = slots.iter().sum();
        let minimum: u64 = demands.iter().map(|d| d.min_slots).sum();
        let mut left = cap.saturating_sub(minimum);
        for (i, d) in demands.iter().enumerate() {
            let extra = (slots[i] - d.min_slots).min(left);
            left -= extra;
            slots[i] = d.min_slots + extra;
        }
        let degradation = if cap < minimum {
            Some(Degradation {
                what: "expert_cache".into(),
                requested: format!("{cap} slots"),
                planned: format!("{minimum} slots"),
                reason: "each device holding experts needs its minimum working set (2 x experts per token) to run a layer".into(),
            })
        } else if possible < cap {
            Some(Degradation {
                what: "expert_cache".into(),
                requested: format!("{cap} slots"),
                planned: format!("{possible} slots"),
                reason: "every byte left after the required and requested items holds expert slots; no more fit (or the model has no more experts)".into(),
            })
        } else {
            None
        };
        (slots, degradation)
    }

    /// Expected expert uses per token served from the caches of `slots`, and in total.
    pub(super) fn masses(&self, c: &Choice, slots: &[u64]) -> (f64, f64) {
        ranges(&c.bounds, self.n_layer()).iter().zip(slots).fold(
            (0.0, 0.0),
            |(h, t), ((a, b), s)| {
                (
                    h + self.oracle.cached_mass(*a, *b, *s),
                    t + self.oracle.total_mass(*a, *b),
                )
            },
        )
    }

    /// Fewer slots or another VRAM window than asked.
    fn slot_degradations(&self, c: &Choice) -> Vec<Degradation> {
        let s = self.req.settings;
        let mut out = Vec::new();
        let want_slots = s.batch as u64;
        let want_res = s.kv_resident_cells();
        if c.slots < want_slots {
            out.push(Degradation {
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
            out.push(Degradation {
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
            out.push(Degradation {
                what: "kv_resident".into(),
                requested: format!("{want_res} cells per slot in VRAM"),
                planned: format!("{} cells per slot in VRAM", c.resident),
                reason: format!(
                    "host RAM cannot pin the spill of the asked window ({} budget); more of each slot's context stays in VRAM instead",
                    bytes(self.pinned_budget)
                ),
            });
        }
        out
    }

    /// Arena regions in reservation order from offset 0 (the expert cache last), the two
    /// reserves at the top of device memory; returns (regions, arena bytes).
    fn regions(&self, dev: &DeviceProbe, dem: &Demand, slots: u64) -> (Vec<Region>, u64) {
        let mut regions = Vec::new();
        let mut off = 0u64;
        let cache = std::iter::once((RegionKind::ExpertCache, slots * dem.slot_bytes));
        for (kind, bytes) in dem.regions.iter().copied().chain(cache) {
            regions.push(Region {
                kind,
                offset: off,
                bytes,
            });
            off += align(bytes);
        }
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
        (regions, off)
    }

    /// Place the tensors device `i` (layers `[a, b)`) holds inside `regions`.
    fn place_tensors(
        &self,
        i: usize,
        (a, b): (u32, u32),
        regions: &[Region],
        out: &mut Vec<TensorPlacement>,
    ) -> Result<(), PlanError> {
        let n = self.n_layer();
        let dev = self.devices[i];
        let (first, last) = (i == 0, i + 1 == self.devices.len());
        let offset_of: BTreeMap<RegionKind, u64> =
            regions.iter().map(|r| (r.kind, r.offset)).collect();
        let mut cursor = BTreeMap::<RegionKind, u64>::new();
        let mut place = |kind: RegionKind, bytes: u64| -> Placement {
            let c = cursor.entry(kind).or_insert(0);
            let offset = offset_of[&kind] + *c;
            *c += align(bytes);
            Placement::Device {
                device: dev.index,
                offset,
            }
        };
        let copy = self.facts.embedding_copy(first, last, self.sizing.mtp);
        for t in &self.req.inventory.tensors {
            // The last stage's copy of the embedding, beside the first stage's table.
            if let (TensorRole::Embedding, None, Some(kind)) = (t.role, t.layer, copy) {
                out.push(TensorPlacement {
                    name: t.name.clone(),
                    bytes: t.bytes,
                    ggml_type: t.ggml_type,
                    placement: place(kind, t.bytes),
                });
                continue;
            }
            let mine = match (t.role, t.layer) {
                (TensorRole::Embedding, _) => first,
                (TensorRole::Head | TensorRole::OutputNorm, _) => last,
                (_, Some(l)) if l >= n => last,
                (_, Some(l)) => l >= a && l < b,
                (_, None) => first,
            };
            if !mine {
                continue;
            }
            let placement = match (t.role, t.layer) {
                (_, Some(l)) if l >= n && self.sizing.mtp => place(RegionKind::Mtp, t.bytes),
                (_, Some(l)) if l >= n => Placement::Host,
                (TensorRole::ExpertStack, _) => Placement::HostExperts { device: dev.index },
                (TensorRole::Embedding, _) => place(RegionKind::Embedding, t.bytes),
                (TensorRole::Head | TensorRole::OutputNorm, _) => place(RegionKind::Head, t.bytes),
                _ => place(RegionKind::DenseWeights, t.bytes),
            };
            out.push(TensorPlacement {
                name: t.name.clone(),
                bytes: t.bytes,
                ggml_type: t.ggml_type,
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
        Ok(())
    }

    /// Device `i` of choice `c` with `slots` cache slots; its tensors go to `tensors`, its
    /// pinned chunks to `chunks`.
    fn build_device(
        &self,
        i: usize,
        c: &Choice,
        dem: &Demand,
        slots: u64,
        tensors: &mut Vec<TensorPlacement>,
        chunks: &mut Vec<PinnedChunk>,
    ) -> Result<Built, PlanError> {
        let (a, b) = ranges(&c.bounds, self.n_layer())[i];
        let n = self.n_layer();
        let dev = self.devices[i];
        let (first, last) = (i == 0, i + 1 == self.devices.len());
        let (regions, arena) = self.regions(dev, dem, slots);
        self.place_tensors(i, (a, b), &regions, tensors)?;
        // Slots in (layer, expert) order: a layer's resident experts then sit side by side, at
        // one stride when they are all resident (the GPU's grouped products read them as one
        // strided stack).
        let mut chosen = self.oracle.select(a, b, slots);
        chosen.sort_unstable();
        let resident_bytes: u64 = chosen
            .iter()
            .map(|(l, _)| self.facts.expert[*l as usize])
            .sum();
        let resident_experts = chosen
            .iter()
            .enumerate()
            .map(|(k, (l, e))| ResidentExpert {
                layer: *l,
                expert: *e,
                slot: k as u32,
            })
            .collect();

        // Pinned host chunks: KV spill and upload staging.
        let chunk_max = self.req.settings.pinned_chunk_mib * MIB;
        let mtp_cell = if last && self.sizing.mtp {
            self.facts.mtp_kv_cell
        } else {
            0
        };
        let cell = self.facts.kv_cell_range(a, b) + mtp_cell;
        let spill = c.slots * (self.ctx - c.resident) * cell;
        push_chunks(chunks, "kv_spill", dev.index, spill, chunk_max, cell.max(1));
        let mut staging = 0;
        if slots < dem.experts_here {
            staging += 2 * dem.slot_bytes;
        }
        // The hidden state arriving through host memory (double-buffered); a peer copy and the
        // first device need none.
        let handoff = handoff_in(i.checked_sub(1).map(|j| self.devices[j]), dev);
        if handoff == "host" {
            let n_embd = self.req.inventory.hparams.n_embd;
            staging += 2 * self.sizing.step_tokens(c.slots) * n_embd * 4;
        }
        push_chunks(
            chunks,
            "staging",
            dev.index,
            staging,
            chunk_max,
            ALIGN_PINNED,
        );

        let share = self.share(i, a, b, slots, c.resident);
        let kv_layers = (a..b)
            .filter(|l| self.facts.kv_cell[*l as usize] > 0)
            .chain(if mtp_cell > 0 {
                n..self.req.inventory.hparams.n_blocks_total()
            } else {
                n..n
            })
            .collect();
        let (_, scratch, work_pass) =
            self.sizing
                .scratch(dev, u64::from(b - a), c.slots, c.resident, last);
        let plan = DevicePlan {
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
            expert_cache_slots: slots,
            resident_experts,
            scratch,
            work_pass,
            kv_layers,
            linear_layers: (a..b)
                .filter(|l| self.facts.linear_state[*l as usize] > 0)
                .collect(),
            free_bytes_probed: dev.free_bytes.is_some(),
            cost: self.cost(i, &share),
            handoff_in: handoff.into(),
        };
        verify_device(&plan)
            .map_err(|e| PlanError::Internal(format!("device {}: {e}", dev.index)))?;
        let n_exp = self.facts.expert_layers(a, b);
        Ok(Built {
            plan,
            experts_host: self.facts.experts_range(a, b) - resident_bytes,
            expert_bytes: if n_exp == 0 || self.facts.n_expert == 0 {
                0.0
            } else {
                self.facts.experts_range(a, b) as f64 / (n_exp * self.facts.n_expert) as f64
            },
            cached_mass: share.cached_mass,
            total_mass: share.total_mass,
        })
    }

    pub(super) fn assemble(&self, c: &Choice) -> Result<Plan, PlanError> {
        let inv = self.req.inventory;
        let demands = self.demands(c);
        for (i, d) in demands.iter().enumerate() {
            if let Err(short) = d.remainder() {
                return Err(PlanError::Internal(format!(
                    "chosen split leaves device {} short by {short} bytes",
                    self.devices[i].index
                )));
            }
        }
        let (slots, cap_degradation) = self.cache_slots(&demands);
        let mut degradations: Vec<Degradation> = cap_degradation.into_iter().collect();
        degradations.extend(self.slot_degradations(c));

        let mut tensors: Vec<TensorPlacement> = Vec::with_capacity(inv.tensors.len());
        let mut chunks = Vec::new();
        let mut built = Vec::with_capacity(self.devices.len());
        for (i, dem) in demands.iter().enumerate() {
            built.push(self.build_device(i, c, dem, slots[i], &mut tensors, &mut chunks)?);
        }
        // Tensors not placed on any device (an MTP block nobody asked for).
        for t in &inv.tensors {
            if !tensors.iter().any(|p| p.name == t.name) {
                tensors.push(TensorPlacement {
                    name: t.name.clone(),
                    bytes: t.bytes,
                    ggml_type: t.ggml_type,
                    placement: Placement::Host,
                });
            }
        }
        self.pin_host_experts(&mut built, &mut chunks);
        let (host, host_degradations, disk_share) = self.host_verdict(&built, chunks);
        degradations.extend(host_degradations);
        let disk = self
            .req
            .probe
            .host
            .disk_read_gbps
            .unwrap_or(DEFAULT_DISK_GBPS)
            * 1e9;
        for b in &mut built {
            b.plan.cost.expert_miss_s += disk_share * b.expert_bytes / disk;
            // The hybrid miss path runs on the CUDA engine's expert cache.
            if b.plan.vendor == Vendor::Nvidia.as_str() {
                b.plan.cost.cpu_misses_per_token = crate::cost::choose_miss_policy(&b.plan.cost);
                // The KV host policy too (`backend/cuda/kv_host_attn.rs`): at the planned
                // batch over a full context.
                b.plan.cost.kv_host_cpu =
                    crate::cost::choose_kv_host(&b.plan.cost, c.slots as u32, self.ctx);
            }
        }
        let (cached, mass) = built.iter().fold((0.0, 0.0), |(h, t), b| {
            (h + b.cached_mass, t + b.total_mass)
        });
        let hit_rate = if mass > 0.0 { cached / mass } else { 1.0 };
        degradations.extend(self.residency_vs_batch_one(c, hit_rate));
        let covered = built.iter().all(|b| {
            self.oracle.covers(
                b.plan.layer_first,
                b.plan.layer_end,
                b.plan.expert_cache_slots,
            )
        });
        let devices: Vec<DevicePlan> = built.into_iter().map(|b| b.plan).collect();
        let suggestions = self.suggestions(c, &demands, &slots, &degradations);
        let mut predicted = self.predicted(c, &devices, hit_rate, disk_share);
        predicted.expert_hit_source = self.oracle.source(covered).describe().into();
        Ok(Plan {
            model: self.plan_model(),
            hardware_fingerprint: self.req.probe.fingerprint(),
            serve: self.plan_serve(c),
            devices,
            tensors,
            host,
            degradations,
            suggestions,
            predicted,
        })
    }

    /// The host expert tier of each NVIDIA device whose cache holds fewer slots than its layers
    /// have experts: a pinned copy of every expert of those layers (`PINNED_EXPERTS` chunks,
    /// whole experts of `expert_slot_bytes` each, at most `--pinned-chunk-mib` a chunk), when
    /// it fits the pinned budget beside every other chunk and the CPU devices' arenas and one
    /// expert fits a chunk; a
    /// device whose copy does not fit keeps reading misses from the mapped model file (the
    /// report notes it). A pinned device's misses cost the pinned copy rate
    /// (`host_expert_pinned_gbps`) and its experts leave the mapped-file RAM count.
    fn pin_host_experts(&self, built: &mut [Built], chunks: &mut Vec<PinnedChunk>) {
        let cpu_arenas: u64 = built
            .iter()
            .filter(|b| b.plan.vendor == Vendor::Cpu.as_str())
            .map(|b| b.plan.arena_bytes)
            .sum();
        let mut used = chunks.iter().map(|c| c.bytes).sum::<u64>() + cpu_arenas;
        let ne = self.facts.n_expert;
        let chunk_max = self.req.settings.pinned_chunk_mib * MIB;
        for (i, b) in built.iter_mut().enumerate() {
            let p = &b.plan;
            let experts = self.facts.expert_layers(p.layer_first, p.layer_end) * ne;
            // The CUDA engine copies misses from the tier; the HIP engine runs no cache yet.
            if p.vendor != Vendor::Nvidia.as_str()
                || p.expert_slot_bytes == 0
                || p.expert_slot_bytes > chunk_max
                || p.resident_experts.len() as u64 >= experts
            {
                continue;
            }
            let need = experts * p.expert_slot_bytes;
            if used + need > self.pinned_budget {
                continue;
            }
            used += need;
            push_chunks(
                chunks,
                PINNED_EXPERTS,
                p.index,
                need,
                chunk_max,
                p.expert_slot_bytes,
            );
            let c = &self.coefficients[i];
            b.plan.cost.expert_miss_s *= c.host_expert_bps / c.host_expert_pinned_bps;
            b.experts_host = 0;
        }
    }

    /// Host RAM: pinned chunks, experts read from the mapped model file and the arenas of CPU
    /// devices against MemAvailable. Returns the host plan, its degradations and the share of
    /// missed experts read from disk (0 when RAM holds them).
    fn host_verdict(
        &self,
        built: &[Built],
        pinned_chunks: Vec<PinnedChunk>,
    ) -> (HostPlan, Vec<Degradation>, f64) {
        let host = &self.req.probe.host;
        let pinned_bytes: u64 = pinned_chunks.iter().map(|c| c.bytes).sum();
        let kv_host_bytes: u64 = pinned_chunks
            .iter()
            .filter(|c| c.purpose == "kv_spill")
            .map(|c| c.bytes)
            .sum();
        let experts_host: u64 = built.iter().map(|b| b.experts_host).sum();
        let cpu_arenas: u64 = built
            .iter()
            .filter(|b| b.plan.vendor == Vendor::Cpu.as_str())
            .map(|b| b.plan.arena_bytes)
            .sum();
        let ram_budget = host.available_bytes.saturating_sub(HOST_HEADROOM);
        let must = pinned_bytes + cpu_arenas;
        let ram_required = must + experts_host;
        let mut degradations = Vec::new();
        if must > ram_budget {
            degradations.push(Degradation {
                what: "host_ram".into(),
                requested: format!(
                    "{} of host RAM (CPU device arenas {} + pinned {})",
                    bytes(must),
                    bytes(cpu_arenas),
                    bytes(pinned_bytes)
                ),
                planned: format!("{} available", bytes(ram_budget)),
                reason: format!(
                    "MemAvailable {} minus {} headroom cannot hold them and strata-exec will refuse to start: lower the cpu devices' vram_bytes in the probe, --batch or --max-context",
                    bytes(host.available_bytes),
                    bytes(HOST_HEADROOM)
                ),
            });
        }
        let paging = ram_required > ram_budget && experts_host > 0;
        let mut disk_share = 0.0;
        if paging {
            let missing = (ram_required - ram_budget).min(experts_host);
            disk_share = missing as f64 / experts_host as f64;
            degradations.push(Degradation {
                what: "experts_in_ram".into(),
                requested: format!(
                    "{} of non-resident experts held in RAM",
                    bytes(experts_host)
                ),
                planned: format!("{} page from disk", bytes(missing)),
                reason: format!(
                    "RAM needed {} (pinned {} + CPU arenas {} + mapped experts {}) exceeds MemAvailable {} minus {} headroom: every expert miss that pages reads the disk at {} GB/s{}",
                    bytes(ram_required),
                    bytes(pinned_bytes),
                    bytes(cpu_arenas),
                    bytes(experts_host),
                    bytes(host.available_bytes),
                    bytes(HOST_HEADROOM),
                    host.disk_read_gbps.unwrap_or(DEFAULT_DISK_GBPS),
                    if host.disk_read_gbps.is_none() {
                        " (assumed: the probe gives no host.disk_read_gbps)"
                    } else {
                        ""
                    }
                ),
            });
        }
        let plan = HostPlan {
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
        };
        (plan, degradations, disk_share)
    }

    /// Decode at the planned batch (empty and full context) and prefill at the planned
    /// ubatch, from the devices' cost terms.
    fn predicted(
        &self,
        c: &Choice,
        devices: &[DevicePlan],
        hit_rate: f64,
        disk_share: f64,
    ) -> Predicted {
        let s = self.req.settings;
        let batch = c.slots as u32;
        let point = |context: u64| {
            let step: f64 = devices
                .iter()
                .map(|d| d.cost.decode_step_seconds(batch, context))
                .sum();
            let per_slot = if step > 0.0 { 1.0 / step } else { 0.0 };
            DecodePoint {
                batch,
                context,
                per_slot_tok_s: per_slot,
                aggregate_tok_s: per_slot * f64::from(batch),
            }
        };
        let (empty, full) = (point(0), point(self.ctx));
        let ub = u64::from(s.ubatch.max(1)).min(self.ctx);
        let pass: f64 = devices
            .iter()
            .map(|d| d.cost.prefill_pass_seconds(ub, 0))
            .sum();
        let guessed: Vec<String> = self
            .devices
            .iter()
            .zip(&self.coefficients)
            .zip(devices)
            .filter(|((_, c), p)| {
                let misses = p.cost.miss_policy() != strata_schemas::plan::MissPolicy::None
                    || p.cost.kv_host_policy(self.ctx) != strata_schemas::plan::KvHostPolicy::None;
                c.guessed() || (misses && !c.host_defaulted.is_empty())
            })
            .map(|((d, _), _)| d.index.to_string())
            .collect();
        let mut basis = format!(
            "cost model per device: launches x latency, weight and KV bytes over achieved bandwidth, flops over achieved throughput (the larger of bytes and flops per step), expert misses x expert bytes over host-to-device bandwidth; decode at {batch} slot(s), prefill in passes of {ub} tokens; MTP speculation not counted"
        );
        if disk_share > 0.0 {
            basis.push_str(&format!(
                "; {:.0}% of missed experts read from disk",
                disk_share * 100.0
            ));
        }
        if !guessed.is_empty() {
            basis.push_str(&format!(
                "; default coefficients for device(s) {}",
                guessed.join(", ")
            ));
        }
        let mut type_guesses: Vec<&str> = self
            .coefficients
            .iter()
            .flat_map(|c| c.type_defaulted.iter().map(|s| s.as_str()))
            .collect();
        type_guesses.sort();
        type_guesses.dedup();
        if !type_guesses.is_empty() {
            basis.push_str(&format!(
                "; weight-type rates at the default ratio to Q8_0's (no [device.cost.types] figure): {}",
                type_guesses.join(", ")
            ));
        }
        Predicted {
            decode_tok_s: empty.per_slot_tok_s,
            expert_hit_rate: hit_rate,
            expert_hit_source: String::new(),
            decode_empty: empty,
            decode_full: full,
            prefill_tok_s: if pass > 0.0 { ub as f64 / pass } else { 0.0 },
            guessed: !guessed.is_empty(),
            basis,
        }
    }

    fn plan_model(&self) -> PlanModel {
        let inv = self.req.inventory;
        let hp = &inv.hparams;
        PlanModel {
            arch: inv.arch.clone(),
            name: inv.name.clone(),
            fingerprint: inv.fingerprint(),
            source: self.req.model_source.clone(),
            mtp_file: self.req.mtp_file.clone(),
            n_layer: hp.n_layer,
            n_expert: hp.n_expert,
            n_expert_used: hp.n_expert_used,
            total_bytes: inv.total_bytes(),
            dense_ffn_layers: strata_schemas::capability::dense_ffn_layers(inv),
            shape: strata_schemas::capability::model_shape(inv),
        }
    }

    fn plan_serve(&self, c: &Choice) -> PlanServe {
        let s = self.req.settings;
        let hp = &self.req.inventory.hparams;
        let yarn = s.rope_scaling.as_ref().map(|r| PlanYarn {
            factor: r.factor,
            orig_ctx: r.orig_ctx.unwrap_or(hp.n_ctx_train),
        });
        PlanServe {
            max_context: self.ctx,
            requested_batch: s.batch,
            batch: c.slots as u32,
            kv: s.kv,
            requested_kv_resident: s.kv_resident_cells(),
            kv_resident: c.resident,
            ubatch: s.ubatch,
            mtp: self.sizing.mtp,
            spec: s.spec,
            prefix_checkpoint: self.sizing.prefix_checkpoint
                && self.facts.linear_state.iter().any(|b| *b > 0),
            vision: self.sizing.vision.is_some(),
            vram_reserve_bytes: s.vram_reserve_mib * MIB,
            expert_cache: s.expert_cache,
            layer_split: c.bounds.clone(),
            layer_split_requested: s.layer_split.to_string(),
            gpu: self.devices.iter().map(|d| d.index).collect(),
            pinned_chunk_bytes: s.pinned_chunk_mib * MIB,
            yarn,
            expert_profile: s.expert_profile.clone().unwrap_or_default(),
        }
    }
}
