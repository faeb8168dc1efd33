//! `PlanEngine`: a Qwen3-MoE model bound to a plan on the CPU backend — one stage per planned
//! device in pipeline order, each running its blocks `[layer_first, layer_end)` over weights
//! in its arena, KV in its `kv_cache` region (cells `[0, kv_resident)`) and its `kv_spill`
//! chunks (the rest), routed experts through its expert cache, and handing hidden states to
//! the next device through that device's `staging` region.
//! Invariant: start-up checks (fingerprint, hardware, memory) all pass before any arena is
//! allocated; after start-up a prefill chunk or decode step allocates nothing; a stage
//! only touches memory of its own device's arena and chunks.

use crate::backend::cpu::Yarn;
use crate::bind::{self, BindError, Binding, RawView};
use crate::engine::{Engine, EngineError, EngineInfo, EngineStats};
use crate::experts::{CpuExpertCache, HostStacks, LruPolicy};
use crate::load::{self, ArenaWeights, HostModel, LoadError, LoadStats};
use crate::model::qwen3moe::{KvCache, Model, ModelError, ModelOptions, StageSpec};
use strata_schemas::ggml::GgmlType;
use strata_schemas::plan::{Plan, RegionKind};

/// Why an engine did not start. Every message names the plan, file or numbers.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Fingerprint(#[from] load::FingerprintMismatch),
    #[error(transparent)]
    Bind(#[from] BindError),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("plan: {0}")]
    Plan(String),
    #[error("model: {0}")]
    Model(#[from] ModelError),
}

/// Start-up options.
#[derive(Debug, Clone, Copy, Default)]
pub struct EngineOptions {
    /// Draw a loading progress bar on stderr (only when it is a terminal).
    pub progress: bool,
    /// Use this instead of /proc/meminfo's MemAvailable (tests).
    pub mem_available: Option<u64>,
}

struct Stage {
    // Field order is drop order: the model and cache borrow `weights` and the binding.
    model: Model<'static>,
    cache: Option<CpuExpertCache<'static>>,
    /// Inbound hand-off buffer in this device's `staging` region (empty on the first stage).
    staging_in: &'static mut [f32],
    #[allow(dead_code)]
    weights: Box<ArenaWeights<'static>>,
    device: u32,
}

/// A plan-bound engine on the CPU backend.
pub struct PlanEngine {
    info: EngineInfo,
    // Dropped before `binding` and `host`, which they borrow.
    stages: Vec<Stage>,
    lens: Vec<u64>,
    tok: Vec<u32>,
    slot_of: Vec<usize>,
    pos: Vec<u32>,
    load: LoadStats,
    allocations: u64,
    binding: Binding,
    host: Box<dyn HostModel>,
}

fn kv_type(s: &str) -> Result<GgmlType, StartError> {
    match s {
        "f16" => Ok(GgmlType::F16),
        "q8_0" => Ok(GgmlType::Q8_0),
        "f32" => Ok(GgmlType::F32),
        other => Err(StartError::Plan(format!(
            "serve.kv `{other}` is not a KV type this build runs (f16, q8_0)"
        ))),
    }
}

fn req(e: ModelError) -> EngineError {
    match e {
        ModelError::NoSlot { .. }
        | ModelError::ContextFull { .. }
        | ModelError::BadToken { .. }
        | ModelError::BatchTooLarge { .. }
        | ModelError::Request(_) => EngineError::Request(e.to_string()),
        other => EngineError::Internal(other.to_string()),
    }
}

impl PlanEngine {
    /// Check `host` against `plan` and this machine, allocate the planned arenas and chunks,
    /// load the weights and bind the stages.
    pub fn start(
        plan: &Plan,
        host: Box<dyn HostModel>,
        opts: EngineOptions,
    ) -> Result<Self, StartError> {
        let inv = host.inventory();
        load::check_fingerprint(plan, host.as_ref())?;
        if inv.arch != "qwen3moe" {
            return Err(StartError::Plan(format!(
                "architecture `{}` has no CPU forward pass in this build (qwen3moe only)",
                inv.arch
            )));
        }
        let available = match opts.mem_available {
            Some(v) => v,
            None => bind::mem_available()?,
        };
        bind::check_hardware(plan, available)?;
        let hp = inv.hparams.clone();
        bind::check_pipeline(plan, hp.n_layer).map_err(StartError::Plan)?;
        load::check_tensors(plan, host.as_ref())?;

        // Every allocation, then the weights.
        let mut binding = Binding::allocate(plan)?;
        let allocations = binding.allocations();
        let load = load::load_weights(plan, &mut binding, host.as_ref(), opts.progress)?;

        let s = &plan.serve;
        let kv = kv_type(&s.kv)?;
        let n_slots = s.batch as usize;
        let ctx = s.max_context as usize;
        let resident = (s.kv_resident.min(s.max_context)) as usize;
        let max_tok = (s.ubatch as usize).max(n_slots).max(1);
        let yarn = (s.rope_scaling == "yarn").then(|| Yarn::new(s.rope_scale, s.yarn_orig_ctx));
        let e = hp.n_embd as usize;
        // SAFETY: `host` is boxed (its address is stable) and is dropped after every stage
        // (field order of PlanEngine), so borrows of it may be treated as 'static here.
        let host_ref: &'static dyn HostModel = unsafe { &*(host.as_ref() as *const dyn HostModel) };
        let mut stages = Vec::with_capacity(plan.devices.len());
        for (i, d) in plan.devices.iter().enumerate() {
            let n_layer = (d.layer_end - d.layer_first) as usize;
            // SAFETY: the weight views cover only the tensors' own planned bytes (weight
            // regions), which nothing writes after loading; the binding outlives the stage.
            let weights = Box::new(unsafe {
                ArenaWeights::from_binding(plan, host_ref.inventory(), d.index, &binding)?
            });
            // SAFETY: the box's heap address is stable and the box is dropped after `model`
            // (field order of Stage).
            let wref: &'static ArenaWeights<'static> =
                unsafe { &*(weights.as_ref() as *const ArenaWeights<'static>) };
            let spec = StageSpec {
                layer_first: d.layer_first,
                layer_end: d.layer_end,
                embedding: d.holds_embedding,
                head: d.holds_head,
                expert_stacks: false,
            };
            let mut model = Model::new_stage(
                &hp,
                wref,
                ModelOptions {
                    max_batch_tokens: max_tok,
                    yarn,
                },
                spec,
            )?;

            // KV: per slot a resident window in kv_cache, the other cells in kv_spill chunks.
            let cell = KvCache::cell_bytes(&hp, kv, n_layer)? as usize;
            let kv_view = binding.region_view(d.index, RegionKind::KvCache)?;
            let need = n_slots * resident * cell;
            if kv_view.len() < need {
                return Err(StartError::Plan(format!(
                    "device {}: kv_cache holds {} bytes but {n_slots} slots x {resident} cells x {cell} need {need}",
                    d.index,
                    kv_view.len()
                )));
            }
            // SAFETY: the kv_cache region is disjoint from every other region of the arena
            // (checked by the planner's verifier and `Binding::allocate`), and only this
            // stage's caches touch it; the binding outlives them.
            let mut kv_rest: &'static mut [u8] = unsafe { kv_view.slice_mut() };
            let mut spill_cells: Vec<&'static mut [u8]> = Vec::new();
            for ch in binding.chunk_views(d.index, "kv_spill") {
                // SAFETY: each chunk is its own allocation, used only by this stage.
                let c: &'static mut [u8] = unsafe { ch.slice_mut() };
                if cell > 0 {
                    spill_cells.extend(c.chunks_exact_mut(cell));
                }
            }
            let spill_per_slot = ctx - resident;
            if spill_cells.len() < n_slots * spill_per_slot {
                return Err(StartError::Plan(format!(
                    "device {}: kv_spill chunks hold {} cells of {cell} bytes but {n_slots} slots x {spill_per_slot} cells are planned beyond the resident window",
                    d.index,
                    spill_cells.len()
                )));
            }
            let mut spill_iter = spill_cells.into_iter();
            for _ in 0..n_slots {
                let (mine, rest) = std::mem::take(&mut kv_rest).split_at_mut(resident * cell);
                kv_rest = rest;
                let cells: Vec<&'static mut [u8]> =
                    spill_iter.by_ref().take(spill_per_slot).collect();
                model.add_slot(KvCache::split(&hp, kv, n_layer, resident, mine, cells)?)?;
            }

            // Expert cache.
            let has_experts = (d.layer_first..d.layer_end).any(|l| hp.layer_has_experts(l));
            let cache = if has_experts {
                let policy = LruPolicy::new(
                    d.layer_first,
                    d.layer_end,
                    hp.n_expert as u32,
                    d.expert_cache_slots as u32,
                    &d.resident_experts,
                )
                .map_err(|m| StartError::Plan(format!("device {}: {m}", d.index)))?;
                let view = binding.region_view(d.index, RegionKind::ExpertCache)?;
                // SAFETY: the expert_cache region is disjoint from the others and only this
                // stage's cache touches it.
                let slots: &'static mut [u8] = unsafe { view.slice_mut() };
                let mut stacks = Vec::with_capacity(n_layer);
                for l in d.layer_first..d.layer_end {
                    if !hp.layer_has_experts(l) {
                        stacks.push(None);
                        continue;
                    }
                    let get = |p: &str| -> Result<(GgmlType, &'static [u8]), StartError> {
                        let name = format!("blk.{l}.ffn_{p}_exps.weight");
                        let ty = host_ref
                            .inventory()
                            .tensor(&name)
                            .map(|t| t.ggml_type)
                            .ok_or_else(|| StartError::Plan(format!("`{name}` missing")))?;
                        let b = host_ref
                            .tensor_bytes(&name)
                            .ok_or_else(|| StartError::Plan(format!("`{name}` missing")))?;
                        Ok((ty, b))
                    };
                    stacks.push(Some(HostStacks {
                        gate: get("gate")?,
                        up: get("up")?,
                        down: get("down")?,
                    }));
                }
                Some(
                    CpuExpertCache::new(
                        policy,
                        slots,
                        d.expert_slot_bytes,
                        hp.n_expert as u32,
                        stacks,
                    )
                    .map_err(|m| StartError::Plan(format!("device {}: {m}", d.index)))?,
                )
            } else {
                None
            };

            // Inbound hand-off: the first half of this device's staging region.
            let staging_in: &'static mut [f32] = if i == 0 {
                &mut []
            } else {
                let need = (max_tok * e * 4) as u64;
                let (off, bytes) = binding
                    .region(d.index, RegionKind::Staging)
                    .unwrap_or((0, 0));
                if bytes < need {
                    return Err(StartError::Plan(format!(
                        "device {}: staging holds {bytes} bytes but a hand-off of {max_tok} tokens x {e} floats needs {need}",
                        d.index
                    )));
                }
                let v: RawView = binding.arena_view(d.index, off, need)?;
                // SAFETY: the staging region is disjoint from the others and only the
                // previous stage (writing) and this one (reading) touch it, one at a time.
                let b: &'static mut [u8] = unsafe { v.slice_mut() };
                // SAFETY: every bit pattern is a valid f32; alignment is checked below
                // (arenas are page-aligned and regions 256-aligned, so it always holds).
                let (pre, f, _) = unsafe { b.align_to_mut::<f32>() };
                if !pre.is_empty() {
                    return Err(StartError::Plan(format!(
                        "device {}: staging region at offset {off} is not 4-byte aligned",
                        d.index
                    )));
                }
                f
            };
            stages.push(Stage {
                model,
                cache,
                staging_in,
                weights,
                device: d.index,
            });
        }
        Ok(Self {
            info: EngineInfo {
                model_name: plan.model.name.clone(),
                n_slots,
                max_context: s.max_context,
                ubatch: (s.ubatch as usize).max(1),
                n_vocab: hp.n_vocab as usize,
            },
            stages,
            lens: vec![0; n_slots],
            tok: Vec::with_capacity(max_tok),
            slot_of: Vec::with_capacity(max_tok),
            pos: Vec::with_capacity(max_tok),
            load,
            allocations,
            binding,
            host,
        })
    }

    /// Arena and chunk allocations made at start-up.
    pub fn allocations(&self) -> u64 {
        self.allocations
    }

    /// What loading copied.
    pub fn load_stats(&self) -> LoadStats {
        self.load
    }

    /// Bytes of every arena and chunk.
    pub fn allocated_bytes(&self) -> u64 {
        self.binding.allocated_bytes()
    }

    /// The model as host memory.
    pub fn host(&self) -> &dyn HostModel {
        self.host.as_ref()
    }

    /// Stage devices in pipeline order.
    pub fn stage_devices(&self) -> Vec<u32> {
        self.stages.iter().map(|s| s.device).collect()
    }

    /// Like [`Engine::prefill`] but returns the logits of every token fed
    /// (`tokens.len() x n_vocab`), e.g. for `--logits`.
    pub fn prefill_all(&mut self, slot: usize, tokens: &[u32]) -> Result<&[f32], EngineError> {
        self.prefill_inner(slot, tokens, 2)
            .map(|o| o.unwrap_or(&[]))
    }

    /// want: 0 none, 1 last row, 2 every row.
    fn prefill_inner(
        &mut self,
        slot: usize,
        tokens: &[u32],
        want: u8,
    ) -> Result<Option<&[f32]>, EngineError> {
        let n = tokens.len();
        if slot >= self.info.n_slots {
            return Err(EngineError::Request(format!(
                "slot {slot} does not exist (the plan has {})",
                self.info.n_slots
            )));
        }
        if n == 0 || n > self.info.ubatch {
            return Err(EngineError::Request(format!(
                "prefill of {n} tokens: give 1..={} (the plan's ubatch) per call",
                self.info.ubatch
            )));
        }
        let len = self.lens[slot];
        if len + n as u64 > self.info.max_context {
            return Err(EngineError::Request(format!(
                "slot {slot} holds {len} of {} cells; {n} more do not fit",
                self.info.max_context
            )));
        }
        self.tok.clear();
        self.slot_of.clear();
        self.pos.clear();
        for (i, &t) in tokens.iter().enumerate() {
            self.tok.push(t);
            self.slot_of.push(slot);
            self.pos.push((len + i as u64) as u32);
        }
        run_stages(&mut self.stages, &self.tok, &self.slot_of, &self.pos).map_err(req)?;
        for st in self.stages.iter_mut() {
            st.model.advance(slot, n).map_err(req)?;
        }
        self.lens[slot] += n as u64;
        let last = self
            .stages
            .last_mut()
            .ok_or_else(|| EngineError::Internal("no stages".into()))?;
        match want {
            0 => Ok(None),
            1 => last.model.head_rows(n - 1, 1).map(Some).map_err(req),
            _ => last.model.head_rows(0, n).map(Some).map_err(req),
        }
    }
}

/// Run every stage over the staged tokens, handing hidden states down the pipeline.
fn run_stages(
    stages: &mut [Stage],
    tok: &[u32],
    slot_of: &[usize],
    pos: &[u32],
) -> Result<(), ModelError> {
    let n = slot_of.len();
    for i in 0..stages.len() {
        let (cur, rest) = stages[i..]
            .split_first_mut()
            .ok_or_else(|| ModelError::Request("stage index out of range".into()))?;
        let Stage {
            model,
            cache,
            staging_in,
            ..
        } = cur;
        let hidden_in = if i == 0 { None } else { Some(&staging_in[..]) };
        let fetch = cache
            .as_mut()
            .map(|c| c as &mut dyn crate::model::qwen3moe::ExpertFetch);
        model.step(tok, slot_of, pos, hidden_in, fetch)?;
        if let Some(next) = rest.first_mut() {
            let h = model.hidden(n);
            next.staging_in[..h.len()].copy_from_slice(h);
        }
    }
    Ok(())
}

impl Engine for PlanEngine {
    fn info(&self) -> &EngineInfo {
        &self.info
    }

    fn prefill_all(&mut self, slot: usize, tokens: &[u32]) -> Result<&[f32], EngineError> {
        PlanEngine::prefill_all(self, slot, tokens)
    }

    fn allocations(&self) -> u64 {
        PlanEngine::allocations(self)
    }

    fn allocated_bytes(&self) -> u64 {
        PlanEngine::allocated_bytes(self)
    }

    fn prefill(
        &mut self,
        slot: usize,
        tokens: &[u32],
        want_logits: bool,
    ) -> Result<Option<&[f32]>, EngineError> {
        self.prefill_inner(slot, tokens, u8::from(want_logits))
    }

    fn decode(&mut self, batch: &[(usize, u32)]) -> Result<&[f32], EngineError> {
        let n = batch.len();
        if n == 0 || n > self.info.n_slots {
            return Err(EngineError::Request(format!(
                "decode of {n} slots: give 1..={} (the plan's batch)",
                self.info.n_slots
            )));
        }
        self.tok.clear();
        self.slot_of.clear();
        self.pos.clear();
        for (i, &(slot, t)) in batch.iter().enumerate() {
            if slot >= self.info.n_slots {
                return Err(EngineError::Request(format!(
                    "slot {slot} does not exist (the plan has {})",
                    self.info.n_slots
                )));
            }
            if batch[..i].iter().any(|(s, _)| *s == slot) {
                return Err(EngineError::Request(format!(
                    "slot {slot} appears twice in one decode step"
                )));
            }
            if self.lens[slot] + 1 > self.info.max_context {
                return Err(EngineError::Request(format!(
                    "slot {slot} is full ({} cells)",
                    self.info.max_context
                )));
            }
            self.tok.push(t);
            self.slot_of.push(slot);
            self.pos.push(self.lens[slot] as u32);
        }
        run_stages(&mut self.stages, &self.tok, &self.slot_of, &self.pos).map_err(req)?;
        for &(slot, _) in batch {
            for st in self.stages.iter_mut() {
                st.model.advance(slot, 1).map_err(req)?;
            }
            self.lens[slot] += 1;
        }
        let last = self
            .stages
            .last_mut()
            .ok_or_else(|| EngineError::Internal("no stages".into()))?;
        last.model.head_rows(0, n).map_err(req)
    }

    fn reset_slot(&mut self, slot: usize) {
        if let Some(l) = self.lens.get_mut(slot) {
            *l = 0;
        }
        for st in self.stages.iter_mut() {
            if let Some(kv) = st.model.slot_mut(slot) {
                kv.clear();
            }
        }
    }

    fn slot_len(&self, slot: usize) -> u64 {
        self.lens.get(slot).copied().unwrap_or(0)
    }

    fn stats(&self) -> EngineStats {
        let (mut hits, mut misses) = (0, 0);
        for st in &self.stages {
            if let Some(c) = &st.cache {
                let (h, m) = c.counters();
                hits += h;
                misses += m;
            }
        }
        EngineStats {
            expert_hits: hits,
            expert_misses: misses,
            kv_cells_in_use: self.lens.clone(),
        }
    }
}
