//! Per-device accounting: the bytes every region needs for a layer range and a slot/KV
//! request, in the fixed reservation order of DESIGN.md invariant 2.
//! Invariant: nothing here is sized from what is left over except the expert cache, which is
//! whatever remains after every other region (and never less than the minimum working set).

use crate::facts::ModelFacts;
use crate::pack::pack_best_fit;
use std::cell::RefCell;
use std::collections::BTreeMap;
use strata_schemas::dims::Dims;
use strata_schemas::graph::{forward_graph, per_slot_session_bytes, BufferSpec, GraphParams};
use strata_schemas::inventory::{ModelInventory, VisionSpec};
use strata_schemas::plan::{RegionKind, ScratchBuffer, WorkPass};
use strata_schemas::probe::DeviceProbe;
use strata_schemas::serve::ExpertCache;
use strata_schemas::workset::{self, BackendKind};

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
    /// One checkpoint of each slot's linear state for the prefix cache (not
    /// `--no-prefix-checkpoint`; only devices with linear layers place one).
    pub prefix_checkpoint: bool,
    scratch: RefCell<ScratchMemo>,
}

/// Packed scratch by (backend, layers, slots, resident cells, holds the head): (bytes,
/// buffers, the pass a working set was sized for).
type ScratchMemo =
    BTreeMap<(BackendKind, u64, u64, u64, bool), (u64, Vec<ScratchBuffer>, WorkPass)>;

/// Buffers packed by lifetime into one aligned scratch: (bytes, buffers with offsets).
fn pack(specs: &[BufferSpec]) -> (u64, Vec<ScratchBuffer>) {
    let packed = pack_best_fit(specs, ALIGN);
    let bufs = specs
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
            prefix_checkpoint: false,
            scratch: RefCell::new(BTreeMap::new()),
        }
    }

    /// The same sizing with (or without) a prefix checkpoint of each slot's linear state.
    pub fn with_prefix_checkpoint(mut self, on: bool) -> Self {
        self.prefix_checkpoint = on;
        self
    }

    /// Tokens one forward step carries at most: a prefill ubatch or every slot's decode rows.
    pub fn step_tokens(&self, slots: u64) -> u64 {
        self.ubatch.max(slots * (1 + self.spec))
    }

    /// The scratch of a device holding layers `[a, b)` (`last`: and the head): the working
    /// set this build's executor binds there (`workset::buffers` for the device's backend at
    /// a pass of the planned step), packed, with the pass it was sized for; or, where no
    /// backend of this build runs the model, the forward graph's buffers packed by lifetime
    /// (an estimate nothing binds) and an all-zero pass. Returns (bytes, buffers, pass).
    pub fn scratch(
        &self,
        dev: &DeviceProbe,
        n_layer: u64,
        slots: u64,
        resident: u64,
        last: bool,
    ) -> (u64, Vec<ScratchBuffer>, WorkPass) {
        let backend = BackendKind::for_vendor(dev.vendor.as_str());
        let key = (backend, n_layer, slots, resident, last);
        if let Some(v) = self.scratch.borrow().get(&key) {
            return v.clone();
        }
        let value = match self.work_buffers(backend, n_layer, slots, last) {
            Some((specs, pass)) => {
                let (bytes, bufs) = pack(&specs);
                (bytes, bufs, pass)
            }
            None => {
                let params = GraphParams {
                    tokens: self.step_tokens(slots),
                    logits_rows: if last {
                        (slots * (1 + self.spec)).max(1)
                    } else {
                        0
                    },
                    ctx_cells: resident,
                };
                match forward_graph(&self.inv.arch, &self.inv.hparams, &params) {
                    Ok(g) => {
                        let (bytes, bufs) = pack(&g.buffers);
                        (bytes, bufs, WorkPass::default())
                    }
                    Err(_) => (0, Vec::new(), WorkPass::default()),
                }
            }
        };
        self.scratch.borrow_mut().insert(key, value.clone());
        value
    }

    /// The executor's working set on a device of `backend` holding `n_layer` layers, every
    /// buffer live for the whole step; `None` when this build has no forward pass for the
    /// model on that backend.
    fn work_buffers(
        &self,
        backend: BackendKind,
        n_layer: u64,
        slots: u64,
        last: bool,
    ) -> Option<(Vec<BufferSpec>, WorkPass)> {
        let hp = &self.inv.hparams;
        if !workset::runs(backend, &self.inv.arch, hp) {
            return None;
        }
        let rows = (slots * (1 + self.spec)).max(1);
        let pass = workset::Pass {
            tokens: self.step_tokens(slots) as usize,
            logit_rows: if last { rows as usize } else { 0 },
            att_splits: workset::att_splits(self.ctx as usize),
            slots: slots as usize,
            gemm: backend == BackendKind::Gpu,
            mtp: last && self.mtp,
        };
        let f32_norms = self
            .inv
            .tensors
            .iter()
            .filter(|t| workset::small_f32(&t.name))
            .all(|t| t.ggml_type == strata_schemas::ggml::GgmlType::F32);
        let d = Dims::of(hp);
        let specs = workset::buffers(backend, &d, n_layer as usize, f32_norms, &pass)
            .into_iter()
            .map(|(b, bytes)| BufferSpec {
                name: b.name().into(),
                bytes: align(bytes),
                first_op: 0,
                last_op: 0,
            })
            .collect();
        let work_pass = WorkPass {
            tokens: pass.tokens as u32,
            logit_rows: pass.logit_rows as u32,
            att_splits: pass.att_splits as u32,
            slots: pass.slots as u32,
            gemm: pass.gemm,
        };
        Some((specs, work_pass))
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
        // The last stage's own copy of the embedding table (`ModelFacts::embedding_copy`).
        let copy = f.embedding_copy(first, last, self.mtp);
        let copy_in = |kind: RegionKind| {
            if copy == Some(kind) {
                f.embedding_bytes
            } else {
                0
            }
        };
        if last {
            regions.push((
                RegionKind::Head,
                align(f.head_bytes + copy_in(RegionKind::Head)),
            ));
        }
        // The head and the MTP block share the last stage (the block reads the head, and the
        // embedding copy above serves both).
        let mtp_here = last && self.mtp;
        if mtp_here {
            let work = slots * (1 + self.spec) * (hp.n_vocab * 4 + 4 * hp.n_embd * 4);
            let kv = slots * resident * f.mtp_kv_cell;
            regions.push((
                RegionKind::Mtp,
                align(f.mtp_weight_bytes + copy_in(RegionKind::Mtp)) + align(kv) + align(work),
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
        // With MTP speculation each slot also keeps its linear state after each of the first
        // `spec` tokens of a verify pass, so rejected drafts can be rolled back
        // (executor/src/backend/cpu/linear_state.rs).
        let checkpoints = if self.mtp { self.spec } else { 0 };
        regions.push((
            RegionKind::LinearState,
            align(slots * (1 + checkpoints) * f.linear_range(a, b)),
        ));
        // The prefix cache's checkpoint: one more copy of each slot's linear state, saved at
        // the end of each prompt so a later prompt sharing it rewinds the slot there
        // (executor/src/backend/cpu/linear_state.rs, `save_prefix`).
        if self.prefix_checkpoint && f.linear_range(a, b) > 0 {
            regions.push((
                RegionKind::PrefixCheckpoint,
                align(slots * f.linear_range(a, b)),
            ));
        }
        let per_slot = per_slot_session_bytes(&self.inv.arch, hp, self.spec as u32);
        regions.push((RegionKind::SlotSessions, align(slots * per_slot)));
        let scratch = self.scratch(dev, u64::from(b - a), slots, resident, last).0;
        regions.push((RegionKind::Scratch, scratch));
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
