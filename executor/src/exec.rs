//! Starting a model on the CPU backend: from a plan (one stage per planned device in pipeline
//! order, weights in its arena, working buffers bound from its scratch region by name, KV in
//! its `kv_cache` region (cells `[0, kv_resident)`) and its `kv_spill` chunks (the rest),
//! routed experts through its expert cache), or plan-less over in-memory weights for tests
//! and references.
//! Invariant: start-up checks (fingerprint, hardware, memory, tensors) all pass before any
//! arena is allocated; after start-up a pass allocates nothing; a stage only touches memory of
//! its own device's arena and chunks.

use crate::backend::cpu::kv::{KvCache, KvGeom};
use crate::backend::cpu::linear_state::LinearState;
use crate::backend::cpu::scratch::Scratch;
use crate::backend::cpu::{CpuStage, Rope, Yarn};
use crate::bind::{self, BindError, Binding};
use crate::engine::{EngineError, EngineInfo};
use crate::experts::{CpuExpertCache, HostStacks, LruPolicy};
use crate::load::{self, ArenaWeights, HostModel, LoadError};
use crate::model::arch::{self, AnyModel};
use crate::model::qwen3moe::{self, Qwen3Moe, StageSpec};
use crate::model::qwen3next::{self, Qwen3Next};
use crate::model::{ModelError, WeightSource};
use crate::pipeline::{Pipeline, PipelineShape, StageOf};
use strata_schemas::dims::Dims;
use strata_schemas::ggml::GgmlType;
use strata_schemas::inventory::HParams;
use strata_schemas::plan::{DevicePlan, Placement, Plan, RegionKind};
use strata_schemas::workset::{self, BackendKind, WorkBuf};

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
    #[error("{0}")]
    Backend(String),
}

/// Start-up options.
#[derive(Debug, Clone, Copy, Default)]
pub struct EngineOptions {
    /// Draw a loading progress bar on stderr (only when it is a terminal).
    pub progress: bool,
    /// Use this instead of /proc/meminfo's MemAvailable (tests).
    pub mem_available: Option<u64>,
}

/// A Qwen3-MoE model on the CPU backend.
pub type CpuEngine = Pipeline<CpuStage<'static>, AnyModel<CpuStage<'static>>>;

fn backend_err(e: impl std::fmt::Display) -> StartError {
    StartError::Backend(e.to_string())
}

/// The rotary embedding a plan's serve settings ask for.
pub fn rope_of(plan: &Plan, d: &Dims) -> Rope {
    let yarn = plan.serve.yarn.map(|y| Yarn::new(y.factor, y.orig_ctx));
    Rope::new(d.n_rot, d.rope_theta, yarn)
}

/// The named working buffers a plan gives `dp`, as (buffer, offset, bytes).
pub fn planned_buffers(dp: &DevicePlan) -> Result<Vec<(WorkBuf, u64, u64)>, String> {
    if dp.work_pass.tokens == 0 {
        return Err(format!(
            "device {}: the plan binds no working set (the planner found no backend of its build that runs this model here): re-plan with this build's strata-plan",
            dp.index
        ));
    }
    dp.scratch
        .iter()
        .map(|b| {
            WorkBuf::from_name(&b.name)
                .map(|w| (w, b.offset, b.bytes))
                .ok_or_else(|| {
                    format!(
                        "device {}: scratch buffer `{}` is not one this build binds: re-plan with this build's strata-plan",
                        dp.index, b.name
                    )
                })
        })
        .collect()
}

/// The arena offset of the resident window of the MTP block's KV (`need` bytes): in `dp`'s
/// `mtp` region, after the block's weights, 64-byte aligned (the planner reserves `slots x
/// resident cells` there). Every backend places the block's KV by this rule.
pub fn mtp_kv_offset(plan: &Plan, dp: &DevicePlan, need: u64) -> Result<u64, String> {
    let r = dp.region(RegionKind::Mtp).ok_or_else(|| {
        format!(
            "device {} holds the MTP block but no mtp region: re-plan with this strata-plan",
            dp.index
        )
    })?;
    let (lo, hi) = (r.offset, r.offset + r.bytes);
    let weights_end = plan
        .tensors
        .iter()
        .filter_map(|t| match t.placement {
            Placement::Device { device, offset }
                if device == dp.index && (lo..hi).contains(&offset) =>
            {
                Some(offset + t.bytes)
            }
            _ => None,
        })
        .max()
        .unwrap_or(lo);
    let start = weights_end.div_ceil(64) * 64;
    if start + need > hi {
        return Err(format!(
            "device {}: the mtp region [{lo}, {hi}) holds the block's weights up to {weights_end} and no room for its {need} bytes of KV: re-plan with this strata-plan",
            dp.index
        ));
    }
    Ok(start)
}

/// The resident window of the MTP block's KV (`need` bytes, at [`mtp_kv_offset`]).
fn mtp_kv_window(
    plan: &Plan,
    binding: &Binding,
    dp: &DevicePlan,
    need: u64,
) -> Result<&'static mut [u8], StartError> {
    let start = mtp_kv_offset(plan, dp, need).map_err(StartError::Plan)?;
    let view = binding.arena_view(dp.index, start, need)?;
    // SAFETY: the window lies in the mtp region past every tensor placed there (checked
    // above), so no weight view overlaps it, and only this stage's MTP KV touches it; the
    // binding outlives the stage.
    Ok(unsafe { view.slice_mut() })
}

/// The KV caches of one stage: per slot a resident window of `kv_cache`, the other cells in
/// the device's `kv_spill` chunks; with `gm` (the MTP block's layer) a second set, its
/// resident window in the `mtp` region and its spilled cells the tail of each planned spill
/// cell (the main layers first, as the planner sizes them).
fn stage_kv(
    plan: &Plan,
    binding: &Binding,
    dp: &DevicePlan,
    g: KvGeom,
    gm: Option<KvGeom>,
) -> Result<(Vec<KvCache<'static>>, Vec<KvCache<'static>>), StartError> {
    let s = &plan.serve;
    let (n_slots, ctx) = (s.batch as usize, s.max_context as usize);
    let resident = (s.kv_resident.min(s.max_context)) as usize;
    let cell = g.cell_bytes();
    let kv_view = binding.region_view(dp.index, RegionKind::KvCache)?;
    let need = n_slots * resident * cell;
    if kv_view.len() < need {
        return Err(StartError::Plan(format!(
            "device {}: kv_cache holds {} bytes but {n_slots} slots x {resident} cells x {cell} need {need}",
            dp.index,
            kv_view.len()
        )));
    }
    // SAFETY: the kv_cache region is disjoint from every other region of the arena (checked
    // by the planner's verifier and `Binding::allocate`), and only this stage's caches touch
    // it; the binding outlives them (the pipeline drops its stages first).
    let mut kv_rest: &'static mut [u8] = unsafe { kv_view.slice_mut() };
    let mcell = gm.map_or(0, |m| m.cell_bytes());
    let mut spill_cells: Vec<&'static mut [u8]> = Vec::new();
    let mut mtp_spill: Vec<&'static mut [u8]> = Vec::new();
    for ch in binding.chunk_views(dp.index, "kv_spill") {
        // SAFETY: each chunk is its own allocation, used only by this stage.
        let c: &'static mut [u8] = unsafe { ch.slice_mut() };
        if cell + mcell > 0 {
            for both in c.chunks_exact_mut(cell + mcell) {
                let (main, mtp) = both.split_at_mut(cell);
                spill_cells.push(main);
                mtp_spill.push(mtp);
            }
        }
    }
    let spill_per_slot = ctx - resident;
    if spill_cells.len() < n_slots * spill_per_slot {
        return Err(StartError::Plan(format!(
            "device {}: kv_spill chunks hold {} cells of {cell} bytes but {n_slots} slots x {spill_per_slot} cells are planned beyond the resident window",
            dp.index,
            spill_cells.len()
        )));
    }
    let mut spill_iter = spill_cells.into_iter();
    let mut caches = Vec::with_capacity(n_slots);
    for _ in 0..n_slots {
        let (mine, rest) = std::mem::take(&mut kv_rest).split_at_mut(resident * cell);
        kv_rest = rest;
        let cells: Vec<&'static mut [u8]> = spill_iter.by_ref().take(spill_per_slot).collect();
        caches.push(KvCache::split(g, resident, mine, cells).map_err(backend_err)?);
    }
    let Some(gm) = gm else {
        return Ok((caches, Vec::new()));
    };
    let mut window = mtp_kv_window(plan, binding, dp, (n_slots * resident * mcell) as u64)?;
    let mut spill_iter = mtp_spill.into_iter();
    let mut mtp = Vec::with_capacity(n_slots);
    for _ in 0..n_slots {
        let (mine, rest) = std::mem::take(&mut window).split_at_mut(resident * mcell);
        window = rest;
        let cells: Vec<&'static mut [u8]> = spill_iter.by_ref().take(spill_per_slot).collect();
        mtp.push(KvCache::split(gm, resident, mine, cells).map_err(backend_err)?);
    }
    Ok((caches, mtp))
}

/// The expert cache of a stage whose layers have experts: its planned slots over the
/// `expert_cache` region, filled from the host stacks.
fn stage_cache(
    host: &'static dyn HostModel,
    binding: &Binding,
    hp: &HParams,
    dp: &DevicePlan,
) -> Result<Option<CpuExpertCache<'static>>, StartError> {
    if !(dp.layer_first..dp.layer_end).any(|l| hp.layer_has_experts(l)) {
        return Ok(None);
    }
    let perr = |m: String| StartError::Plan(format!("device {}: {m}", dp.index));
    let policy = LruPolicy::new(
        dp.layer_first,
        dp.layer_end,
        hp.n_expert as u32,
        dp.expert_cache_slots as u32,
        &dp.resident_experts,
    )
    .map_err(perr)?;
    let view = binding.region_view(dp.index, RegionKind::ExpertCache)?;
    // SAFETY: the expert_cache region is disjoint from the others and only this stage's
    // cache touches it; the binding outlives the cache.
    let slots: &'static mut [u8] = unsafe { view.slice_mut() };
    let mut stacks = Vec::with_capacity((dp.layer_end - dp.layer_first) as usize);
    for l in dp.layer_first..dp.layer_end {
        if !hp.layer_has_experts(l) {
            stacks.push(None);
            continue;
        }
        let get = |p: &str| -> Result<(GgmlType, &'static [u8]), StartError> {
            let name = format!("blk.{l}.ffn_{p}_exps.weight");
            let ty = host
                .inventory()
                .tensor(&name)
                .map(|t| t.ggml_type)
                .ok_or_else(|| StartError::Plan(format!("`{name}` missing")))?;
            let b = host
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
    CpuExpertCache::new(
        policy,
        slots,
        dp.expert_slot_bytes,
        hp.n_expert as u32,
        stacks,
    )
    .map(Some)
    .map_err(perr)
}

/// Check `host` against `plan` and this machine, allocate the planned arenas and chunks,
/// load the weights and bind one CPU stage per planned device.
pub fn start_cpu(
    plan: &Plan,
    host: Box<dyn HostModel>,
    opts: EngineOptions,
) -> Result<CpuEngine, StartError> {
    let inv = host.inventory();
    load::check_fingerprint(plan, host.as_ref())?;
    if !workset::runs(BackendKind::Cpu, &inv.arch, &inv.hparams) {
        return Err(StartError::Plan(format!(
            "architecture `{}` has no CPU forward pass in this build (qwen3moe, qwen3next)",
            inv.arch
        )));
    }
    let available = match opts.mem_available {
        Some(v) => v,
        None => bind::mem_available()?,
    };
    bind::check_hardware(plan, available)?;
    let hp = inv.hparams.clone();
    let (d, arch_name) = arch::check_dims(&inv.arch, &hp)?;
    bind::check_pipeline(plan, hp.n_layer).map_err(StartError::Plan)?;
    load::check_tensors(plan, host.as_ref())?;
    let layouts = plan
        .devices
        .iter()
        .map(planned_buffers)
        .collect::<Result<Vec<_>, _>>()
        .map_err(StartError::Plan)?;

    // Every allocation, then the weights.
    let mut binding = Binding::allocate(plan)?;
    let allocations = binding.allocations();
    load::load_weights(plan, &mut binding, host.as_ref(), opts.progress)?;

    let s = &plan.serve;
    let kv_ty = s.kv.ggml();
    let rope = rope_of(plan, &d);
    // SAFETY: `host` is boxed (its address is stable) and kept by the pipeline until after
    // every stage is dropped, so borrows of it may be treated as 'static here.
    let host_ref: &'static dyn HostModel = unsafe { &*(host.as_ref() as *const dyn HostModel) };
    let mut keep: Vec<Box<dyn std::any::Any + Send>> = Vec::new();
    let mut stages = Vec::with_capacity(plan.devices.len());
    for (dp, layout) in plan.devices.iter().zip(&layouts) {
        let n_layer = (dp.layer_end - dp.layer_first) as usize;
        // SAFETY: the weight views cover only the tensors' own planned bytes (weight regions),
        // which nothing writes after loading; the binding outlives the stage.
        let weights = Box::new(unsafe {
            ArenaWeights::from_binding(plan, host_ref.inventory(), dp.index, &binding)?
        });
        // SAFETY: the box's heap address is stable and the pipeline drops it (in `keep`) after
        // the stage that borrows it.
        let wref: &'static (dyn WeightSource + Sync) =
            unsafe { &*(weights.as_ref() as *const ArenaWeights<'static>) };
        keep.push(weights);
        let view = binding.region_view(dp.index, RegionKind::Scratch)?;
        // SAFETY: the scratch region is disjoint from the arena's other regions and only this
        // stage touches it; the binding outlives the stage.
        let region: &'static mut [u8] = unsafe { view.slice_mut() };
        let scratch = Scratch::bind(region, layout).map_err(backend_err)?;
        let (full, lin) = qwen3next::layer_counts(&hp, dp.layer_first, dp.layer_end);
        debug_assert_eq!(full + lin, n_layer);
        let g = KvGeom::new(&d, kv_ty, full, s.max_context as usize).map_err(backend_err)?;
        let speculate = dp.holds_mtp && s.spec > 0;
        let gm = if speculate {
            Some(KvGeom::new(&d, kv_ty, 1, s.max_context as usize).map_err(backend_err)?)
        } else {
            None
        };
        let (kv, mtp_kv) = stage_kv(plan, &binding, dp, g, gm)?;
        let lin_state = if lin > 0 {
            let view = binding.region_view(dp.index, RegionKind::LinearState)?;
            // SAFETY: the linear_state region is disjoint from the arena's other regions and
            // only this stage touches it; the binding outlives the stage.
            let region: &'static mut [u8] = unsafe { view.slice_mut() };
            let ckpts = if s.mtp { s.spec as usize } else { 0 };
            let st =
                LinearState::bind(region, &d, lin, s.batch as usize, ckpts).map_err(backend_err)?;
            if s.prefix_checkpoint {
                let view = binding.region_view(dp.index, RegionKind::PrefixCheckpoint)?;
                // SAFETY: the prefix_checkpoint region is disjoint from the arena's other
                // regions and only this stage touches it; the binding outlives the stage.
                let region: &'static mut [u8] = unsafe { view.slice_mut() };
                st.with_prefix_region(region).map_err(backend_err)?
            } else {
                st
            }
        } else {
            LinearState::owned(&d, 0, 0)
        };
        let cache = stage_cache(host_ref, &binding, &hp, dp)?;
        let mut backend = CpuStage::new(
            d,
            arch_name,
            wref,
            rope.clone(),
            scratch,
            kv,
            cache,
            dp.work_pass.tokens as usize,
        )
        .with_linear_state(lin_state)
        .with_mtp_kv(mtp_kv);
        let spec = StageSpec {
            layer_first: dp.layer_first,
            layer_end: dp.layer_end,
            embedding: dp.holds_embedding,
            head: dp.holds_head,
            mtp: dp.holds_mtp && s.spec > 0,
        };
        let model =
            AnyModel::bind(&inv.arch, &mut backend, &d, &hp, spec).map_err(|e| match e {
                crate::backend::cpu::CpuError::Model(m) => StartError::Model(m),
                other => backend_err(other),
            })?;
        stages.push(StageOf { backend, model });
    }
    let last = plan.devices.last().map(|dp| dp.work_pass);
    let shape = PipelineShape {
        max_tok: plan
            .devices
            .iter()
            .map(|dp| dp.work_pass.tokens as usize)
            .min()
            .unwrap_or(0),
        logit_rows: last.map_or(0, |w| w.logit_rows as usize),
        allocations,
        allocated_bytes: binding.allocated_bytes(),
    };
    let info = EngineInfo {
        model_name: plan.model.name.clone(),
        n_slots: s.batch as usize,
        max_context: s.max_context,
        ubatch: (s.ubatch as usize).max(1),
        n_vocab: d.vocab,
    };
    keep.push(Box::new(binding));
    keep.push(Box::new(host));
    let p =
        Pipeline::new(info, stages, shape, keep).map_err(|e| StartError::Plan(e.to_string()))?;
    let speculate = plan.devices.last().is_some_and(|dp| dp.holds_mtp) && s.spec > 0;
    if !speculate {
        return Ok(p);
    }
    p.with_mtp(s.spec as usize, d.e)
        .map_err(|e| StartError::Plan(e.to_string()))
}

/// The shape of a plan-less CPU engine.
#[derive(Debug, Clone, Copy)]
pub struct Standalone {
    pub slots: usize,
    /// Cells per slot.
    pub ctx: usize,
    /// KV element type.
    pub kv: GgmlType,
    /// Tokens per pass (longer prefill calls run in passes of this many).
    pub max_tok: usize,
    /// The most tokens one prefill call takes.
    pub ubatch: usize,
    pub yarn: Option<Yarn>,
}

/// A Qwen3-MoE model over `src` on the CPU with no plan: one stage holding the whole model,
/// its working buffers, KV and logits owned here, sized by the same working-set rule the
/// planner uses. For tests, references and the serve test engine.
pub fn standalone_cpu<'a>(
    hp: &HParams,
    src: &'a (dyn WeightSource + Sync),
    name: &str,
    s: Standalone,
) -> Result<Pipeline<CpuStage<'a>, Qwen3Moe<CpuStage<'a>>>, StartError> {
    let d = qwen3moe::check_dims(hp)?;
    standalone(hp, &d, qwen3moe::ARCH, src, name, s, 0, Ok, Qwen3Moe::bind)
}

/// A Qwen3-Next model over `src` on the CPU with no plan, as [`standalone_cpu`]: one stage,
/// its working buffers, KV (full-attention layers) and linear state (linear layers) owned here.
pub fn standalone_next<'a>(
    hp: &HParams,
    src: &'a (dyn WeightSource + Sync),
    name: &str,
    s: Standalone,
) -> Result<Pipeline<CpuStage<'a>, Qwen3Next<CpuStage<'a>>>, StartError> {
    standalone_next_mtp(hp, src, name, s, 0)
}

/// [`standalone_next`] drafting `spec` tokens per step with the model's MTP block
/// (`blk.{n_layer}.*`; 0 = no MTP): the block's KV layer after the main ones, `spec`
/// linear-state checkpoints per slot.
pub fn standalone_next_mtp<'a>(
    hp: &HParams,
    src: &'a (dyn WeightSource + Sync),
    name: &str,
    s: Standalone,
    spec: usize,
) -> Result<Pipeline<CpuStage<'a>, Qwen3Next<CpuStage<'a>>>, StartError> {
    let d = qwen3next::check_dims(hp)?;
    let (full, lin) = qwen3next::layer_counts(hp, 0, hp.n_layer);
    if spec > 0 && (hp.nextn_predict_layers == 0 || full + 1 > d.n_layer) {
        return Err(StartError::Model(ModelError::HParam {
            key: "nextn_predict_layers",
            reason: format!(
                "speculation needs the model's MTP block and a KV layer for it ({} MTP blocks, {full} of {} layers full attention)",
                hp.nextn_predict_layers, d.n_layer
            ),
        }));
    }
    let slots = s.slots;
    let with_state = |b: CpuStage<'a>| {
        let st = LinearState::owned_with_checkpoints(&d, lin, slots, spec).with_owned_prefix();
        Ok(b.with_linear_state(st))
    };
    standalone(
        hp,
        &d,
        qwen3next::ARCH,
        src,
        name,
        s,
        spec,
        with_state,
        Qwen3Next::bind,
    )
}

/// The plan-less one-stage CPU pipeline of architecture `arch`: the backend sized for `s`,
/// adjusted by `prepare` (state an architecture adds), the model bound on it by `bind`;
/// drafting `spec` tokens per step with the MTP block when `spec > 0`.
#[allow(clippy::too_many_arguments)]
fn standalone<'a, M>(
    hp: &HParams,
    d: &Dims,
    arch: &'static str,
    src: &'a (dyn WeightSource + Sync),
    name: &str,
    s: Standalone,
    spec: usize,
    prepare: impl FnOnce(CpuStage<'a>) -> Result<CpuStage<'a>, StartError>,
    bind: impl FnOnce(
        &mut CpuStage<'a>,
        &Dims,
        &HParams,
        StageSpec,
    ) -> Result<M, crate::backend::cpu::CpuError>,
) -> Result<Pipeline<CpuStage<'a>, M>, StartError>
where
    M: crate::model::Forward<CpuStage<'a>>,
{
    let logit_rows = s.slots.max(1) * (1 + spec);
    let pass = workset::Pass {
        tokens: s.max_tok.max(s.slots * (1 + spec)),
        logit_rows,
        att_splits: 1,
        slots: s.slots,
        gemm: false,
        mtp: spec > 0,
    };
    let rope = Rope::new(d.n_rot, d.rope_theta, s.yarn);
    let backend = CpuStage::standalone(*d, arch, src, rope, s.slots, s.ctx, s.kv, &pass)
        .map_err(backend_err)?;
    let mut backend = prepare(backend)?;
    let stage = StageSpec {
        mtp: spec > 0,
        ..StageSpec::whole(hp.n_layer)
    };
    let model = bind(&mut backend, d, hp, stage).map_err(|e| match e {
        crate::backend::cpu::CpuError::Model(m) => StartError::Model(m),
        other => backend_err(other),
    })?;
    let info = EngineInfo {
        model_name: name.into(),
        n_slots: s.slots,
        max_context: s.ctx as u64,
        ubatch: s.ubatch.max(1),
        n_vocab: d.vocab,
    };
    let shape = PipelineShape {
        max_tok: pass.tokens,
        logit_rows,
        allocations: 0,
        allocated_bytes: 0,
    };
    let p = Pipeline::new(info, vec![StageOf { backend, model }], shape, Vec::new())
        .map_err(|e: EngineError| StartError::Plan(e.to_string()))?;
    if spec == 0 {
        return Ok(p);
    }
    p.with_mtp(spec, d.e)
        .map_err(|e: EngineError| StartError::Plan(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Engine;
    use crate::model::MemWeights;
    use crate::quant;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn tiny_hp() -> HParams {
        HParams {
            n_layer: 2,
            n_embd: 64,
            n_vocab: 97,
            n_ctx_train: 256,
            n_head: 4,
            n_head_kv: 2,
            head_dim_k: 16,
            head_dim_v: 16,
            n_ff: 0,
            n_expert: 8,
            n_expert_used: 2,
            n_ff_exp: 32,
            n_ff_shexp: 0,
            n_leading_dense: 0,
            full_attention_interval: None,
            ssm: None,
            nextn_predict_layers: 0,
            rope_theta: 10000.0,
            rope_dim: None,
            rms_eps: 1e-6,
            norm_topk_prob: true,
            tied_embeddings: false,
        }
    }

    /// A random tiny model: every tensor as f32 values (GGUF dims), encoded as `ty` (Q8_0
    /// where a row is not whole `ty` blocks) except norms, which stay F32 as converters keep
    /// them.
    fn tiny_weights(hp: &HParams, ty: GgmlType, seed: u64) -> MemWeights {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut w = MemWeights::new();
        let (e, v) = (hp.n_embd, hp.n_vocab);
        let (qo, kvo) = (hp.n_head * hp.head_dim_k, hp.n_head_kv * hp.head_dim_k);
        let mut put =
            |w: &mut MemWeights, name: String, dims: &[u64], scale: f32, off: f32, ty: GgmlType| {
                let n: u64 = dims.iter().product();
                // Like llama.cpp's quantizer, fall back to Q8_0 where rows are not whole blocks.
                let ty = if dims[0] % ty.block_elems() == 0 {
                    ty
                } else {
                    GgmlType::Q8_0
                };
                let vals: Vec<f32> = (0..n)
                    .map(|_| off + scale * (2.0 * rng.random::<f32>() - 1.0))
                    .collect();
                w.insert_f32(name, dims, &vals, ty).unwrap();
            };
        let f32t = GgmlType::F32;
        put(&mut w, "token_embd.weight".into(), &[e, v], 1.0, 0.0, ty);
        put(&mut w, "output_norm.weight".into(), &[e], 0.2, 1.0, f32t);
        put(&mut w, "output.weight".into(), &[e, v], 0.2, 0.0, ty);
        for l in 0..hp.n_layer {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            put(&mut w, n("attn_norm"), &[e], 0.2, 1.0, f32t);
            put(&mut w, n("ffn_norm"), &[e], 0.2, 1.0, f32t);
            put(&mut w, n("attn_q_norm"), &[hp.head_dim_k], 0.2, 1.0, f32t);
            put(&mut w, n("attn_k_norm"), &[hp.head_dim_k], 0.2, 1.0, f32t);
            put(&mut w, n("attn_q"), &[e, qo], 0.2, 0.0, ty);
            put(&mut w, n("attn_k"), &[e, kvo], 0.2, 0.0, ty);
            put(&mut w, n("attn_v"), &[e, kvo], 0.2, 0.0, ty);
            put(&mut w, n("attn_output"), &[qo, e], 0.2, 0.0, ty);
            put(&mut w, n("ffn_gate_inp"), &[e, hp.n_expert], 0.3, 0.0, ty);
            let (f, x) = (hp.n_ff_exp, hp.n_expert);
            put(&mut w, n("ffn_gate_exps"), &[e, f, x], 0.2, 0.0, ty);
            put(&mut w, n("ffn_up_exps"), &[e, f, x], 0.2, 0.0, ty);
            put(&mut w, n("ffn_down_exps"), &[f, e, x], 0.2, 0.0, ty);
        }
        w
    }

    /// The same tensors with every quantized one replaced by its F32 dequantization.
    fn dequantized_copy(w: &MemWeights) -> MemWeights {
        let mut out = MemWeights::new();
        for name in w.names() {
            let t = w.get(name).unwrap();
            let n: u64 = t.dims.iter().product();
            let mut vals = vec![0f32; n as usize];
            let ne0 = t.dims[0] as usize;
            let rb = quant::row_bytes(t.ggml_type, ne0).unwrap();
            for (row, o) in t.data.chunks_exact(rb).zip(vals.chunks_exact_mut(ne0)) {
                quant::dequantize_row(t.ggml_type, row, o).unwrap();
            }
            out.insert_f32(name, &t.dims, &vals, GgmlType::F32).unwrap();
        }
        out
    }

    type Tiny<'a> = Pipeline<CpuStage<'a>, Qwen3Moe<CpuStage<'a>>>;

    fn engine<'a>(
        hp: &HParams,
        w: &'a MemWeights,
        slots: usize,
        kv: GgmlType,
        pass: usize,
    ) -> Tiny<'a> {
        standalone_cpu(
            hp,
            w,
            "tiny",
            Standalone {
                slots,
                ctx: 64,
                kv,
                max_tok: pass,
                ubatch: 16,
                yarn: None,
            },
        )
        .unwrap()
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
    }

    const PROMPT: [u32; 11] = [5, 17, 42, 3, 96, 0, 61, 61, 8, 33, 70];

    #[test]
    fn prefill_then_decode_equals_longer_prefill() {
        let hp = tiny_hp();
        let w = tiny_weights(&hp, GgmlType::F32, 1);
        let mut a = engine(&hp, &w, 1, GgmlType::F32, 8);
        let full = a.prefill_all(0, &PROMPT).unwrap().to_vec();
        assert!(full.iter().all(|v| v.is_finite()));
        let mut b = engine(&hp, &w, 1, GgmlType::F32, 8);
        let last = b.prefill(0, &PROMPT[..8], true).unwrap().unwrap().to_vec();
        assert_eq!(max_diff(&last, &full[7 * 97..8 * 97]), 0.0);
        for (i, &t) in PROMPT[8..].iter().enumerate() {
            let got = b.decode(&[(0, t)]).unwrap().to_vec();
            let want = &full[(8 + i) * 97..(9 + i) * 97];
            assert!(
                max_diff(&got, want) <= 1e-5,
                "step {i}: {}",
                max_diff(&got, want)
            );
        }
        assert_eq!(b.slot_len(0), PROMPT.len() as u64);
        // Logits vary with the input (a model that ignores it would pass the checks above).
        assert!(max_diff(&full[..97], &full[97..194]) > 1e-3);
    }

    #[test]
    fn batched_decode_equals_one_at_a_time() {
        let hp = tiny_hp();
        let w = tiny_weights(&hp, GgmlType::F32, 2);
        let prompts: [&[u32]; 3] = [&PROMPT[..3], &PROMPT[2..9], &PROMPT[5..6]];
        let steps: [[u32; 3]; 3] = [[1, 2, 3], [50, 60, 70], [96, 0, 11]];
        let mut batched = engine(&hp, &w, 3, GgmlType::F16, 4);
        let mut single = engine(&hp, &w, 3, GgmlType::F16, 4);
        for (s, p) in prompts.iter().enumerate() {
            batched.prefill(s, p, false).unwrap();
            single.prefill(s, p, false).unwrap();
        }
        for step in steps {
            let batch: Vec<(usize, u32)> = (0..3).map(|s| (s, step[s])).collect();
            let got = batched.decode(&batch).unwrap().to_vec();
            for s in 0..3 {
                let one = single.decode(&[(s, step[s])]).unwrap();
                assert_eq!(&got[s * 97..(s + 1) * 97], one, "slot {s}: batch-invariant");
            }
        }
        assert!(
            batched.decode(&[(0, 1), (0, 2)]).is_err(),
            "one token per slot per step"
        );
    }

    #[test]
    fn pass_chunking_matches_one_pass() {
        let hp = tiny_hp();
        let w = tiny_weights(&hp, GgmlType::F32, 3);
        let one = engine(&hp, &w, 1, GgmlType::F32, 8)
            .prefill_all(0, &PROMPT[..8])
            .unwrap()
            .to_vec();
        let chunked = engine(&hp, &w, 1, GgmlType::F32, 3)
            .prefill_all(0, &PROMPT[..8])
            .unwrap()
            .to_vec();
        assert!(max_diff(&one, &chunked) <= 1e-5);
        let mut c = engine(&hp, &w, 1, GgmlType::F32, 3);
        let last = c.prefill(0, &PROMPT[..8], true).unwrap().unwrap();
        assert_eq!(last, &one[7 * 97..]);
    }

    #[test]
    fn quantized_weights_and_kv_stay_close_to_f32() {
        let hp = tiny_hp();
        // Same underlying f32 values (same seed), encoded as F32 and as Q8_0.
        let wf = tiny_weights(&hp, GgmlType::F32, 4);
        let wq = tiny_weights(&hp, GgmlType::Q8_0, 4);
        let lf = engine(&hp, &wf, 1, GgmlType::F32, 4)
            .prefill_all(0, &PROMPT)
            .unwrap()
            .to_vec();
        let lq = engine(&hp, &wq, 1, GgmlType::F32, 4)
            .prefill_all(0, &PROMPT)
            .unwrap()
            .to_vec();
        let scale = lf.iter().fold(0f32, |m, v| m.max(v.abs()));
        // Bound: Q8_0 weights move every logit by at most 2% of the largest |logit|, and the
        // argmax of every position agrees.
        let diff = max_diff(&lf, &lq);
        assert!(
            diff <= 0.02 * scale,
            "Q8_0 weights: {diff} vs scale {scale}"
        );
        assert!(diff > 0.0, "the Q8_0 copy really is quantized");
        for p in 0..PROMPT.len() {
            assert_eq!(
                crate::sampler::argmax(&lf[p * 97..(p + 1) * 97]),
                crate::sampler::argmax(&lq[p * 97..(p + 1) * 97])
            );
        }
        // Q8_0 and F16 KV caches (F32 weights): within 1% of the largest |logit|.
        for kv in [GgmlType::Q8_0, GgmlType::F16] {
            let lk = engine(&hp, &wf, 1, kv, 4)
                .prefill_all(0, &PROMPT)
                .unwrap()
                .to_vec();
            let diff = max_diff(&lf, &lk);
            assert!(diff <= 0.01 * scale, "{kv} KV: {diff} vs scale {scale}");
        }
    }

    #[test]
    fn q4_k_model_runs_close_to_f32() {
        // Q4_K rows are 256 elements: a model with n_embd 256 and n_ff_exp 256, so every
        // matrix but attn_output (rows of n_head x head_dim = 64, kept Q8_0) is Q4_K.
        let mut hp = tiny_hp();
        hp.n_embd = 256;
        hp.n_ff_exp = 256;
        hp.n_layer = 1;
        let wf = tiny_weights(&hp, GgmlType::F32, 5);
        let wq = tiny_weights(&hp, GgmlType::Q4K, 5);
        let run = |w: &MemWeights| {
            engine(&hp, w, 1, GgmlType::F32, 5)
                .prefill(0, &PROMPT[..5], true)
                .unwrap()
                .unwrap()
                .to_vec()
        };
        let (lf, lq) = (run(&wf), run(&wq));
        let scale = lf.iter().fold(0f32, |m, v| m.max(v.abs()));
        // Exactness of the on-the-fly Q4_K path: an F32 model holding the dequantized Q4_K
        // values gives the same logits within 1e-4 of the largest |logit| (only the order of
        // f32 sums differs).
        let wd = dequantized_copy(&wq);
        let exact = max_diff(&run(&wd), &lq);
        assert!(
            exact <= 1e-4 * scale,
            "Q4_K vs its dequantized copy: {exact}"
        );
        // Against the original f32 weights (uniform ±0.2, so ~7% RMS error per weight over
        // six matmuls in series plus router flips): relative RMS logit error <= 30%.
        let num: f32 = lf.iter().zip(&lq).map(|(a, b)| (a - b) * (a - b)).sum();
        let den: f32 = lf.iter().map(|a| a * a).sum();
        let rel = (num / den).sqrt();
        assert!(
            max_diff(&lf, &lq) > 0.0 && rel <= 0.30,
            "relative RMS {rel}"
        );
    }

    #[test]
    fn yarn_tables_reach_the_backend() {
        let hp = tiny_hp();
        let w = tiny_weights(&hp, GgmlType::F32, 6);
        let mut m = standalone_cpu(
            &hp,
            &w,
            "yarn",
            Standalone {
                slots: 1,
                ctx: 32,
                kv: GgmlType::F16,
                max_tok: 4,
                ubatch: 16,
                yarn: Some(Yarn::new(4.0, 64)),
            },
        )
        .unwrap();
        let rope = m.stages()[0].backend.rope().clone();
        // Same hand values as backend::cpu's YaRN test: head_dim 16, theta 1e4, factor 4.
        assert!((rope.inv_freq()[1] - 0.237_170_8).abs() < 1e-6);
        assert!((rope.attn_factor() - 1.138_629_4).abs() < 1e-6);
        let l = m.prefill(0, &PROMPT, true).unwrap().unwrap();
        assert!(l.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn bad_inputs_are_refused_with_names() {
        let hp = tiny_hp();
        let w = tiny_weights(&hp, GgmlType::F32, 7);
        let mut m = engine(&hp, &w, 1, GgmlType::F32, 8);
        let req = |r: Result<Option<&[f32]>, crate::engine::EngineError>| match r {
            Err(crate::engine::EngineError::Request(m)) => m,
            other => panic!(
                "not a request error: {:?}",
                other.map(|o| o.map(|l| l.len()))
            ),
        };
        assert!(req(m.prefill(0, &[97], false)).contains("token 97"));
        assert!(req(m.prefill(1, &[1], false)).contains("slot 1"));
        assert!(req(m.prefill(0, &[1; 17], false)).contains("ubatch"));
        for _ in 0..4 {
            m.prefill(0, &[1; 16], false).unwrap();
        }
        assert!(req(m.prefill(0, &[1], false)).contains("64 of 64"));
        m.reset_slot(0);
        assert_eq!(m.slot_len(0), 0, "a reset slot takes a new request");
        // A wrong-shaped tensor is named.
        let mut bad = w.get("blk.1.attn_k.weight").unwrap().clone();
        bad.dims = vec![64, 16];
        bad.data.truncate(64 * 16 * 4);
        let mut w2 = w.clone();
        w2.insert("blk.1.attn_k.weight", bad);
        let s = Standalone {
            slots: 1,
            ctx: 8,
            kv: GgmlType::F32,
            max_tok: 4,
            ubatch: 4,
            yarn: None,
        };
        let err = standalone_cpu(&hp, &w2, "bad", s).err().unwrap();
        assert!(err.to_string().contains("blk.1.attn_k.weight"), "{err}");
        let mut w3 = tiny_weights(&hp, GgmlType::F32, 7);
        w3.remove("blk.0.ffn_up_exps.weight");
        let err = standalone_cpu(&hp, &w3, "bad", s).err().unwrap();
        assert!(
            matches!(&err, StartError::Model(ModelError::MissingTensor { name, .. }) if name == "blk.0.ffn_up_exps.weight"),
            "{err}"
        );
    }

    #[test]
    fn norm_topk_prob_changes_the_output() {
        let mut hp = tiny_hp();
        let w = tiny_weights(&hp, GgmlType::F32, 8);
        let a = engine(&hp, &w, 1, GgmlType::F32, 4)
            .prefill(0, &PROMPT[..4], true)
            .unwrap()
            .unwrap()
            .to_vec();
        hp.norm_topk_prob = false;
        let mut mb = engine(&hp, &w, 1, GgmlType::F32, 4);
        let b = mb.prefill(0, &PROMPT[..4], true).unwrap().unwrap();
        assert!(max_diff(&a, b) > 1e-4);
    }
}
