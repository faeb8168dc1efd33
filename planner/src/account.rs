//! Per-device accounting: the bytes every region needs for a layer range and a slot/KV
//! request, in the fixed reservation order of DESIGN.md invariant 2.
//! Invariant: nothing here is sized from what is left over except the expert cache, which is
//! whatever remains after every other region (and never less than the minimum working set).

use crate::facts::ModelFacts;
use crate::pack::pack_best_fit;
use std::cell::RefCell;
use std::collections::BTreeMap;
use strata_schemas::graph::{forward_graph, per_slot_session_bytes, GraphParams};
use strata_schemas::inventory::{ModelInventory, VisionSpec};
use strata_schemas::plan::{RegionKind, ScratchBuffer};
use strata_schemas::probe::{DeviceProbe, Vendor};
use strata_schemas::serve::ExpertCache;
use strata_schemas::workset;

/// Alignment of every region inside an arena.
pub const ALIGN: u64 = 256;
/// Cells of host KV streamed per upload when `--kv-resident` is below the context.
pub const KV_STREAM_CHUNK: u64 = 4096;
/// The smallest VRAM window per slot before KV streaming stops being worth it.
pub const MIN_RESIDENT_CELLS: u64 = 4096;

pub fn align(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

/// What the user asked for, resolved, that every device sizing shares.
pub struct Sizing<'a> {
    pub inv: &'a ModelInventory,
    pub facts: &'a ModelFacts,
    pub ctx: u64,
    pub ubatch: u64,
    pub spec: u64,
    pub mtp: bool,
    pub vision: Option<&'a VisionSpec>,
    pub vram_reserve: u64,
    pub n_devices: usize,
    pub expert_cache: ExpertCache,
    scratch: RefCell<ScratchMemo>,
}

/// Packed scratch by (slots, resident cells, holds the head): (bytes, buffers).
type ScratchMemo = BTreeMap<(u64, u64, bool), (u64, Vec<ScratchBuffer>)>;

/// One device's demand for a layer range at `slots` slots with `resident` cells each.
#[derive(Debug, Clone)]
pub struct Demand {
    pub vram: u64,
    pub runtime_reserve: u64,
    pub user_reserve: u64,
    /// Arena regions other than the expert cache, in reservation order.
    pub regions: Vec<(RegionKind, u64)>,
    /// Bytes of one expert cache slot.
    pub slot_bytes: u64,
    /// Experts (layer x expert) of the range: the most slots that make sense.
    pub experts_here: u64,
    /// Required slots: the minimum working set.
    pub min_slots: u64,
}

impl Demand {
    /// vram minus both reserves.
    pub fn usable(&self) -> u64 {
        self.vram
            .saturating_sub(self.runtime_reserve)
            .saturating_sub(self.user_reserve)
    }
    /// Bytes of everything but the optional part of the expert cache.
    pub fn fixed(&self) -> u64 {
        self.regions.iter().map(|(_, b)| b).sum::<u64>() + self.min_slots * self.slot_bytes
    }
    /// Bytes left for cache slots beyond the minimum; `Err(shortfall)` when even the fixed
    /// part does not fit.
    pub fn remainder(&self) -> Result<u64, u64> {
        let (u, f) = (self.usable(), self.fixed());
        if f <= u {
            Ok(u - f)
        } else {
            Err(f - u)
        }
    }
    /// Cache slots on this device under the `auto` policy (capped by its experts).
    pub fn auto_slots(&self) -> Option<u64> {
        let rem = self.remainder().ok()?;
        if self.slot_bytes == 0 {
            return Some(0);
        }
        Some((self.min_slots + rem / self.slot_bytes).min(self.experts_here))
    }
    pub fn bytes(&self, kind: RegionKind) -> u64 {
        self.regions
            .iter()
            .filter(|(k, _)| *k == kind)
            .map(|(_, b)| b)
            .sum()
    }
}

impl<'a> Sizing<'a> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        inv: &'a ModelInventory,
        facts: &'a ModelFacts,
        ctx: u64,
        ubatch: u64,
        spec: u64,
        mtp: bool,
        vision: Option<&'a VisionSpec>,
        vram_reserve: u64,
        n_devices: usize,
        expert_cache: ExpertCache,
    ) -> Self {
        Self {
            inv,
            facts,
            ctx,
            ubatch,
            spec,
            mtp,
            vision,
            vram_reserve,
            n_devices,
            expert_cache,
            scratch: RefCell::new(BTreeMap::new()),
        }
    }

    /// Tokens one forward step carries at most: a prefill ubatch or every slot's decode rows.
    pub fn step_tokens(&self, slots: u64) -> u64 {
        self.ubatch.max(slots * (1 + self.spec))
    }

    /// Scratch of one forward step, packed by lifetime; logits only where the head is.
    pub fn scratch(&self, slots: u64, resident: u64, last: bool) -> (u64, Vec<ScratchBuffer>) {
        let key = (slots, resident, last);
        if let Some(v) = self.scratch.borrow().get(&key) {
            return v.clone();
        }
        let params = GraphParams {
            tokens: self.step_tokens(slots),
            logits_rows: if last {
                (slots * (1 + self.spec)).max(1)
            } else {
                0
            },
            ctx_cells: resident,
        };
        let value = match forward_graph(&self.inv.arch, &self.inv.hparams, &params) {
            Ok(g) => {
                let packed = pack_best_fit(&g.buffers, ALIGN);
                let bufs = g
                    .buffers
                    .iter()
                    .zip(&packed.offsets)
                    .map(|(b, off)| ScratchBuffer {
                        name: b.name.clone(),
                        offset: *off,
                        bytes: b.bytes,
                        first_op: b.first_op,
                        last_op: b.last_op,
                    })
                    .collect();
                (align(packed.total_bytes), bufs)
            }
            Err(_) => (0, Vec::new()),
        };
        self.scratch.borrow_mut().insert(key, value.clone());
        value
    }

    /// Scratch bytes the CUDA engine carves on an NVIDIA device holding `n_layer` layers
    /// (its working set for a pass of the step's tokens; 0 where it does not run the model).
    /// The scratch region holds the larger of this and the packed forward graph, so the
    /// engine's prefill passes are the planned ubatch.
    pub fn cuda_workset(&self, dev: &DeviceProbe, n_layer: u64, slots: u64) -> u64 {
        let hp = &self.inv.hparams;
        if dev.vendor != Vendor::Nvidia || !workset::cuda_runs(&self.inv.arch, hp) {
            return 0;
        }
        let pass = workset::Pass {
            tokens: self.step_tokens(slots) as usize,
            logit_rows: slots.max(1) as usize,
            att_splits: workset::att_splits(self.ctx as usize),
            slots: slots as usize,
            gemm: true,
        };
        // Norm vectors counted as converted to f32 (the most the engine keeps).
        align(workset::stage_bytes(
            &workset::WorkDims::of(hp),
            n_layer as usize,
            false,
            &pass,
        ))
    }

    /// The demand of `dev` holding layers `[a, b)`.
    #[allow(clippy::too_many_arguments)]
    pub fn demand(
        &self,
        dev: &DeviceProbe,
        a: u32,
        b: u32,
        first: bool,
        last: bool,
        slots: u64,
        resident: u64,
    ) -> Demand {
        let f = self.facts;
        let hp = &self.inv.hparams;
        let runtime_reserve = match dev.free_bytes {
            Some(free) => dev.runtime_reserve().max(dev.vram_bytes - free),
            None => dev.runtime_reserve(),
        };
        let mut regions = Vec::with_capacity(11);
        if first {
            regions.push((RegionKind::Embedding, align(f.embedding_bytes)));
        }
        regions.push((RegionKind::DenseWeights, align(f.dense_range(a, b))));
        if last {
            let tied_extra = if f.tied_embeddings && !first {
                f.embedding_bytes
            } else {
                0
            };
            regions.push((RegionKind::Head, align(f.head_bytes + tied_extra)));
        }
        let mtp_here = last && self.mtp;
        if mtp_here {
            let work = slots * (1 + self.spec) * (hp.n_vocab * 4 + 4 * hp.n_embd * 4);
            let kv = slots * resident * f.mtp_kv_cell;
            regions.push((
                RegionKind::Mtp,
                align(f.mtp_weight_bytes) + align(kv) + align(work),
            ));
        }
        if first {
            if let Some(v) = self.vision {
                regions.push((
                    RegionKind::Vision,
                    align(v.weights_bytes) + align(v.workspace_bytes()),
                ));
            }
        }
        regions.push((
            RegionKind::KvCache,
            align(slots * resident * f.kv_cell_range(a, b)),
        ));
        regions.push((RegionKind::LinearState, align(slots * f.linear_range(a, b))));
        let per_slot = per_slot_session_bytes(&self.inv.arch, hp, self.spec as u32);
        regions.push((RegionKind::SlotSessions, align(slots * per_slot)));
        let graph = self.scratch(slots, resident, last).0;
        let engine = self.cuda_workset(dev, u64::from(b - a), slots);
        regions.push((RegionKind::Scratch, graph.max(engine)));
        let mut staging = 0;
        if self.n_devices > 1 {
            staging += 2 * self.step_tokens(slots) * hp.n_embd * 4;
        }
        if resident < self.ctx {
            let max_layer_cell = f.kv_cell[a as usize..b as usize]
                .iter()
                .copied()
                .max()
                .unwrap_or(0)
                .max(if mtp_here { f.mtp_kv_cell } else { 0 });
            staging += 2 * KV_STREAM_CHUNK.min(self.ctx - resident) * max_layer_cell;
        }
        regions.push((RegionKind::Staging, align(staging)));
        let slot_bytes = align(f.slot_bytes(a, b));
        let experts_here = f.expert_layers(a, b) * f.n_expert;
        let min_slots = (2 * f.n_expert_used).min(experts_here);
        Demand {
            vram: dev.vram_bytes,
            runtime_reserve,
            user_reserve: self.vram_reserve,
            regions,
            slot_bytes,
            experts_here,
            min_slots,
        }
    }

    /// Cache slots a device gets under the `--expert-cache` policy, before any global cap.
    pub fn policy_slots(&self, d: &Demand) -> Option<u64> {
        match self.expert_cache {
            ExpertCache::Off => d.remainder().ok().map(|_| d.min_slots),
            _ => d.auto_slots(),
        }
    }
}
