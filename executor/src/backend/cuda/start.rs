//! Starting a plan on GPUs: every check that needs no GPU ([`preflight`]), the GPUs opened
//! (CUDA for `nvidia` plans, HIP for `amd` ones: [`plan_vendor`]) and their free memory
//! checked against the arenas planned onto them, one arena per
//! planned device, the weights uploaded, each stage's working buffers bound from the plan's
//! scratch by name, its KV geometry checked against its `kv_cache` region, the model bound on
//! it, and the hand-offs between stages chosen — a [`CudaEngine`], the pipeline over CUDA
//! stages.
//! Invariant: every check passes before the first arena is allocated; after start-up the
//! engine allocates no device memory.

use super::bind::{upload_weights, Binder};
use super::expert_cache::CudaExpertCache;
use super::handoff::Link;
use super::host_tier;
use super::kv_spill::{KvHostArg, KvSpill, SpillLayout};
use super::launch::{kty, ATT_MAX_D, ATT_MAX_GROUP};
use super::options::CudaOptions;
use super::pinned::PinnedHost;
use super::stage::{CudaStage, KvGeo, LinGeo, RunFlags, Span};
use super::{CudaDevice, CudaError, DeviceArena, Vendor};
use crate::backend::cpu::{Rope, Yarn};
use crate::backend::WorkBuf;
use crate::engine::EngineInfo;
use crate::exec::planned_buffers;
use crate::load::{self, HostModel};
use crate::model::arch::{self, AnyModel};
use crate::model::qwen3moe::StageSpec;
use crate::model::qwen3next;
use crate::pipeline::{Pipeline, PipelineShape, StageOf};
use std::collections::HashMap;
use std::sync::Arc;
use strata_schemas::dims::Dims;
use strata_schemas::plan::{DevicePlan, Plan, RegionKind};
use strata_schemas::serve::KvType;
use strata_schemas::workset::{self, BackendKind};

/// A Qwen3-MoE or Qwen3-Next plan on CUDA GPUs.
pub type CudaEngine = Pipeline<CudaStage, AnyModel<CudaStage>>;

/// Why the CUDA engine did not start.
#[derive(Debug, thiserror::Error)]
pub enum CudaEngineError {
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error(transparent)]
    Load(#[from] load::LoadError),
    #[error(transparent)]
    Fingerprint(#[from] load::FingerprintMismatch),
    #[error("plan: {0}")]
    Plan(String),
    #[error("model: {0}")]
    Model(String),
}

fn plan_err(s: impl Into<String>) -> CudaEngineError {
    CudaEngineError::Plan(s.into())
}

/// What [`preflight`] decided before any GPU is touched.
pub struct Preflight {
    /// Tokens of the largest pass (the plan's work pass).
    pub max_tok: usize,
    /// Rows of logits the head computes per pass.
    pub logit_rows: usize,
    /// Decode-attention splits the plan's scratch holds.
    pub att_splits: usize,
    /// The plan sized the tensor-core prefill's buffers.
    pub gemm: bool,
    pub d: Dims,
    kv_ty: i32,
    kv_row_bytes: u64,
    rope: Rope,
    layouts: Vec<HashMap<WorkBuf, Span>>,
}

/// Every start-up check that needs no GPU: fingerprint, architecture, head shapes the
/// kernels take, pipeline, tensor sizes, KV type and residency, and each device's working
/// buffers bound by name.
pub fn preflight(
    plan: &Plan,
    host: &dyn HostModel,
    opts: &CudaOptions,
) -> Result<Preflight, CudaEngineError> {
    let inv = host.inventory();
    load::check_fingerprint(plan, host)?;
    if !workset::runs(BackendKind::Gpu, &inv.arch, &inv.hparams) {
        return Err(plan_err(format!(
            "architecture `{}` (or its dense FFN layers) has no CUDA forward pass in this build (qwen3moe or qwen3next with every layer MoE): run with --backend cpu",
            inv.arch
        )));
    }
    let hp = &inv.hparams;
    let (d, _) =
        arch::check_dims(&inv.arch, hp).map_err(|e| CudaEngineError::Model(e.to_string()))?;
    if d.linear() {
        check_linear(&d)?;
    }
    if d.hd_v != d.hd || d.hd > ATT_MAX_D || d.hd % 4 != 0 {
        return Err(plan_err(format!(
            "head dims k {} v {}: the CUDA kernels need equal K/V head dims, a multiple of 4, at most {ATT_MAX_D}",
            d.hd, d.hd_v
        )));
    }
    if d.n_head / d.n_head_kv > ATT_MAX_GROUP {
        return Err(plan_err(format!(
            "{} query heads over {} KV heads: the CUDA decode attention needs a whole group of at most {ATT_MAX_GROUP} query heads per KV head",
            d.n_head, d.n_head_kv
        )));
    }
    if d.e % 32 != 0 || d.f % 32 != 0 {
        return Err(plan_err(format!(
            "hidden {} / expert width {}: the CUDA kernels need both to be multiples of 32",
            d.e, d.f
        )));
    }
    crate::bind::check_pipeline(plan, hp.n_layer).map_err(CudaEngineError::Plan)?;
    load::check_tensors(plan, host)?;
    if let Some(map) = &opts.device_map {
        if map.len() != plan.devices.len() {
            let example: Vec<String> = (0..plan.devices.len()).map(|i| i.to_string()).collect();
            return Err(plan_err(format!(
                "--device-map lists {} GPU(s) for a plan of {} device(s): give one CUDA ordinal per planned device, e.g. --device-map {}",
                map.len(),
                plan.devices.len(),
                example.join(",")
            )));
        }
    }
    let s = &plan.serve;
    if s.spec > 0 {
        check_spec(plan)?;
    }
    let kv_gg = s.kv.ggml();
    let kv_ty = match s.kv {
        KvType::F16 | KvType::Q8_0 => kty(kv_gg).unwrap_or(1),
    };
    let kv_row_bytes = crate::quant::row_bytes(kv_gg, d.k_out())
        .map_err(|e| plan_err(format!("KV rows: {e}")))? as u64;
    // The cells beyond --kv-resident: every device's kv_spill chunks hold them as laid out.
    for dp in &plan.devices {
        spill_layout(plan, dp, host, kv_row_bytes)?;
    }
    let layouts = plan
        .devices
        .iter()
        .map(|dp| {
            let region = dp
                .region(RegionKind::Scratch)
                .ok_or_else(|| format!("device {} has no scratch region", dp.index))?;
            Ok(planned_buffers(dp)?
                .into_iter()
                .map(|(b, off, bytes)| {
                    (
                        b,
                        Span {
                            off: region.offset + off,
                            bytes,
                        },
                    )
                })
                .collect::<HashMap<WorkBuf, Span>>())
        })
        .collect::<Result<Vec<_>, String>>()
        .map_err(CudaEngineError::Plan)?;
    // Every buffer the GPU backend binds is planned, at least as large as the working set of
    // the planned pass needs.
    for (dp, layout) in plan.devices.iter().zip(&layouts) {
        let w = dp.work_pass;
        let pass = workset::Pass {
            tokens: w.tokens as usize,
            logit_rows: w.logit_rows as usize,
            att_splits: w.att_splits as usize,
            slots: w.slots as usize,
            gemm: w.gemm,
            mtp: dp.holds_mtp,
        };
        let n_layer = (dp.layer_end - dp.layer_first) as usize;
        for (b, need) in workset::buffers(BackendKind::Gpu, &d, n_layer, true, &pass) {
            let have = layout.get(&b).map_or(0, |s: &Span| s.bytes);
            if have < need {
                return Err(plan_err(format!(
                    "device {}: the plan's `{}` buffer holds {have} bytes but passes of {} tokens need {need}: re-plan with this build's strata-plan",
                    dp.index,
                    b.name(),
                    w.tokens
                )));
            }
        }
    }
    let first = plan
        .devices
        .first()
        .ok_or_else(|| plan_err("the plan has no devices"))?;
    let last = plan.devices.last().unwrap_or(first);
    let w = first.work_pass;
    if plan
        .devices
        .iter()
        .any(|dp| dp.work_pass.tokens != w.tokens)
    {
        return Err(plan_err(
            "the plan's devices were sized for passes of different lengths: re-plan with this build's strata-plan",
        ));
    }
    let yarn = s.yarn.map(|y| Yarn::new(y.factor, y.orig_ctx));
    Ok(Preflight {
        max_tok: w.tokens as usize,
        logit_rows: last.work_pass.logit_rows as usize,
        att_splits: w.att_splits as usize,
        gemm: w.gemm,
        d,
        kv_ty,
        kv_row_bytes,
        rope: Rope::new(d.n_rot, d.rope_theta, yarn),
        layouts,
    })
}

/// A plan that speculates (`--spec N`): its last device holds the MTP block. On AMD devices
/// the verify, rollback and draft passes are the CUDA stage's own (never yet run on AMD
/// hardware, as the rest of the HIP path).
fn check_spec(plan: &Plan) -> Result<(), CudaEngineError> {
    let s = &plan.serve;
    if !plan.devices.last().is_some_and(|dp| dp.holds_mtp) {
        return Err(plan_err(format!(
            "the plan speculates (--spec {}) but its last device holds no MTP block: re-plan with --mtp --spec {}",
            s.spec, s.spec
        )));
    }
    Ok(())
}

/// The Gated DeltaNet shapes the linear-attention kernels take (`launch::linear`).
fn check_linear(d: &Dims) -> Result<(), CudaEngineError> {
    use super::launch::linear::LIN_MAX_CONV;
    if d.conv_k > LIN_MAX_CONV {
        return Err(plan_err(format!(
            "a linear-attention conv of {} taps: the CUDA kernel takes at most {LIN_MAX_CONV}: run with --backend cpu",
            d.conv_k
        )));
    }
    let smem = 4 * (2 * d.lin_hk + d.lin_hv);
    if smem > 48 << 10 {
        return Err(plan_err(format!(
            "linear head dims k {} v {}: the CUDA delta rule keeps 2 key heads and a value head in 48 KiB of shared memory: run with --backend cpu",
            d.lin_hk, d.lin_hv
        )));
    }
    Ok(())
}

/// Whether `dq_attn_fused` can serve a stage: F16 KV, head dims a multiple of 8 up to 128,
/// an even rotation, query groups dividing 128 up to 16, every KV row, slot and layer offset
/// 16-byte aligned (its 16-byte loads) — of the main layers' KV and the MTP block's.
fn attn_fusable(d: &Dims, kv: &KvGeo, mtp_kv: Option<&KvGeo>) -> bool {
    one_kv_fusable(d, kv) && mtp_kv.is_none_or(|m| one_kv_fusable(d, m))
}

fn one_kv_fusable(d: &Dims, kv: &KvGeo) -> bool {
    let g = d.n_head / d.n_head_kv.max(1);
    let a16 = |v: u64| v % 16 == 0;
    kv.ty == 1
        && d.hd % 8 == 0
        && d.hd <= 128
        && d.n_rot % 2 == 0
        && d.n_rot <= d.hd
        && (1..=16).contains(&g)
        && 128 % g == 0
        && a16(kv.row_bytes)
        && a16(kv.region.off)
        && a16(kv.slot_bytes)
        && a16(kv.cells * kv.row_bytes)
}

/// Arena bytes per GPU, in order of first use: (index into `devs` of a device object on that
/// GPU, the bytes of every arena on it). `arenas`: (index into `devs`, bytes) per arena.
fn bytes_per_gpu(
    devs: &[Arc<CudaDevice>],
    arenas: impl IntoIterator<Item = (usize, u64)>,
) -> Vec<(usize, u64)> {
    let mut out: Vec<(usize, u64)> = Vec::new();
    for (di, bytes) in arenas {
        let ordinal = devs[di].ordinal();
        match out.iter_mut().find(|o| devs[o.0].ordinal() == ordinal) {
            Some(o) => o.1 += bytes,
            None => out.push((di, bytes)),
        }
    }
    out
}

/// Device memory (free, total) of `dev` now.
pub(crate) fn mem_info(dev: &CudaDevice) -> Result<(u64, u64), CudaError> {
    dev.mem_info()
}

/// The runtime the engine opens for the plan: HIP when its devices are `amd`, else CUDA (as
/// before HIP: `--backend cuda` runs a plan of any other vendor on CUDA GPUs); a plan that
/// mixes `amd` devices with others is refused, naming a device of each.
pub fn plan_vendor(plan: &Plan) -> Result<Vendor, CudaEngineError> {
    let amd = plan.devices.iter().find(|d| d.vendor == "amd");
    let other = plan.devices.iter().find(|d| d.vendor != "amd");
    match (amd, other) {
        (Some(a), Some(o)) => Err(plan_err(format!(
            "the plan mixes vendors: device {} is `amd` (HIP) but device {} is `{}`; one engine runs one vendor's GPUs: re-plan with a probe of one vendor's devices",
            a.index, o.index, o.vendor
        ))),
        (Some(_), None) => Ok(Vendor::Amd),
        _ => Ok(Vendor::Nvidia),
    }
}

/// Check `host` against `plan` and the GPUs, allocate the planned arenas, upload the weights
/// and bind every stage.
pub fn start_cuda(
    plan: &Plan,
    host: Box<dyn HostModel>,
    opts: CudaOptions,
) -> Result<CudaEngine, CudaEngineError> {
    let pf = preflight(plan, host.as_ref(), &opts)?;
    let vendor = plan_vendor(plan)?;
    let host: Arc<dyn HostModel> = Arc::from(host);
    let s = &plan.serve;
    let (n_slots, ctx) = (s.batch as usize, s.max_context as usize);
    let d = pf.d;

    let devs = open_gpus(plan, vendor, &opts)?;
    let mapped = opts.device_map.is_some();
    let dev_of = |i: usize| if mapped { i } else { 0 };
    let planned: u64 = plan.devices.iter().map(|dp| dp.arena_bytes).sum();

    // Every allocation, then the weights.
    let mut arenas = Vec::with_capacity(plan.devices.len());
    for (i, dp) in plan.devices.iter().enumerate() {
        arenas.push(devs[dev_of(i)].alloc_arena(&format!("device {}", dp.index), dp.arena_bytes)?);
    }
    // The planned KV cells beyond --kv-resident: pinned, mapped chunks (an error when the
    // driver refuses: the plan's KV has nowhere else to go).
    let mut spills = Vec::with_capacity(plan.devices.len());
    for (i, dp) in plan.devices.iter().enumerate() {
        spills.push(pin_kv_spill(
            plan,
            dp,
            &devs[dev_of(i)],
            host.as_ref(),
            &pf,
        )?);
    }
    // The planned pinned host expert tiers (None where the plan pins none or the driver
    // refused: those stages copy misses from the mapped file).
    let mut tiers: Vec<_> = plan
        .devices
        .iter()
        .enumerate()
        .map(|(i, dp)| host_tier::pin_chunks(plan, dp, &devs[dev_of(i)]))
        .collect();
    {
        let arena_devs: Vec<&CudaDevice> = (0..arenas.len())
            .map(|i| devs[dev_of(i)].as_ref())
            .collect();
        upload_weights(plan, &arena_devs, &arenas, host.as_ref(), opts.progress)?;
    }
    let start = Start {
        plan,
        opts: &opts,
        pf: &pf,
        host: &host,
        mapped,
        pdl: opts.pdl && !opts.profile && devs.iter().all(|d| d.pdl_capable()),
        n_slots,
        ctx,
    };
    let mut stages: Vec<StageOf<CudaStage, AnyModel<CudaStage>>> =
        Vec::with_capacity(plan.devices.len());
    for ((i, dp), arena) in plan.devices.iter().enumerate().zip(arenas) {
        let spill = spills[i].take();
        let kv = start.kv_geo(dp, spill.as_ref())?;
        let pinned = tiers[i].take();
        let (mut st, model) =
            start.bind_stage(i, dp, devs[dev_of(i)].clone(), arena, kv, pinned)?;
        st.kv_spill = spill;
        st.set_kv_host_cpu(opts.kv_host.cpu(dp.cost.kv_host_cpu))?;
        if i > 0 {
            st.link_in = Some(start.link_in(dp, &stages[i - 1].backend, &st)?);
        }
        stages.push(StageOf { backend: st, model });
    }
    for dev in &devs {
        dev.synchronize()?;
    }
    let info = EngineInfo {
        model_name: plan.model.name.clone(),
        n_slots,
        max_context: s.max_context,
        ubatch: (s.ubatch as usize).max(1),
        n_vocab: d.vocab,
    };
    let (chunks, pinned) = stages
        .iter()
        .flat_map(|s| {
            let b = &s.backend;
            let x = b.xcache.as_ref().map(|c| c.pinned_chunks());
            x.into_iter().chain(b.kv_spill.as_ref().map(|k| k.pinned()))
        })
        .fold((0, 0), |(n, b), (cn, cb)| (n + cn, b + cb));
    let shape = PipelineShape {
        max_tok: pf.max_tok,
        logit_rows: pf.logit_rows,
        allocations: plan.devices.len() as u64 + chunks,
        allocated_bytes: planned + pinned,
    };
    let p = Pipeline::new(info, stages, shape, vec![Box::new(host)])
        .map_err(|e| CudaEngineError::Plan(e.to_string()))?;
    if s.spec == 0 {
        return Ok(p);
    }
    p.with_mtp(s.spec as usize, d.e)
        .map_err(|e| CudaEngineError::Plan(e.to_string()))
}

/// The KV cells of planned device `dp` beyond `--kv-resident`, pinned and mapped on `dev`
/// (None when the plan keeps every cell in VRAM).
fn pin_kv_spill(
    plan: &Plan,
    dp: &DevicePlan,
    dev: &CudaDevice,
    host: &dyn HostModel,
    pf: &Preflight,
) -> Result<Option<KvSpill>, CudaEngineError> {
    match spill_layout(plan, dp, host, pf.kv_row_bytes)? {
        None => Ok(None),
        Some(y) => Ok(Some(KvSpill::pin(dev, y)?)),
    }
}

/// Where planned device `dp`'s KV cells beyond `--kv-resident` lie in its planned `kv_spill`
/// chunks (KV rows of `row_bytes`), or why the chunks do not hold them as this engine lays
/// them out.
fn spill_layout(
    plan: &Plan,
    dp: &DevicePlan,
    host: &dyn HostModel,
    row_bytes: u64,
) -> Result<Option<SpillLayout>, CudaEngineError> {
    let s = &plan.serve;
    let chunks: Vec<u64> = plan
        .host
        .pinned_chunks
        .iter()
        .filter(|c| c.device == dp.index && c.purpose == "kv_spill")
        .map(|c| c.bytes)
        .collect();
    let hp = &host.inventory().hparams;
    let (full, _) = qwen3next::layer_counts(hp, dp.layer_first, dp.layer_end);
    let main_cell = 2 * full as u64 * row_bytes;
    let resident = s.kv_resident.min(s.max_context);
    SpillLayout::new(chunks, s.batch as u64, s.max_context, resident, main_cell)
        .map_err(|e| plan_err(format!("device {}: {e}", dp.index)))
}

/// The GPUs (of `vendor`'s runtime): one device object for every stage, or one per stage
/// (`--device-map`), once each GPU's free memory is seen to hold the arenas planned onto it.
fn open_gpus(
    plan: &Plan,
    vendor: Vendor,
    opts: &CudaOptions,
) -> Result<Vec<Arc<CudaDevice>>, CudaEngineError> {
    let devs: Vec<Arc<CudaDevice>> = match &opts.device_map {
        None => vec![Arc::new(CudaDevice::open_vendor(vendor, opts.gpu)?)],
        Some(map) => map
            .iter()
            .map(|&o| CudaDevice::open_vendor(vendor, o).map(Arc::new))
            .collect::<Result<_, _>>()?,
    };
    let mapped = opts.device_map.is_some();
    let dev_of = |i: usize| if mapped { i } else { 0 };
    let wanted = (0..plan.devices.len()).map(|j| (dev_of(j), plan.devices[j].arena_bytes));
    for (di, here) in bytes_per_gpu(&devs, wanted) {
        let dev = &devs[di];
        let (free, total) = mem_info(dev)?;
        if here > free {
            return Err(plan_err(format!(
                "the plan's arenas need {here} bytes on GPU {} ({}) but {free} of {total} are free: re-plan with a probe of this machine (strata-exec probe), free the GPU, or map fewer planned devices onto it (--device-map)",
                dev.ordinal(),
                dev.name()
            )));
        }
    }
    Ok(devs)
}

/// What binding every stage of one start shares.
struct Start<'a> {
    plan: &'a Plan,
    opts: &'a CudaOptions,
    pf: &'a Preflight,
    host: &'a Arc<dyn HostModel>,
    /// One device object per stage (`--device-map`) rather than one shared.
    mapped: bool,
    /// Programmatic dependent launch: asked for, not profiling, and every GPU sm_90 or later.
    pdl: bool,
    n_slots: usize,
    ctx: usize,
}

impl Start<'_> {
    /// The KV geometry of planned device `dp`, once its `kv_cache` region is seen to hold
    /// every slot's VRAM window of cells of its full-attention layers (all of them but
    /// Qwen3-Next's linear-attention layers); the cells past it in `spill`.
    fn kv_geo(&self, dp: &DevicePlan, spill: Option<&KvSpill>) -> Result<KvGeo, CudaEngineError> {
        let (pf, n_slots) = (self.pf, self.n_slots);
        let ctx = spill.map_or(self.ctx as u64, |s| s.layout.resident);
        let hp = &self.host.inventory().hparams;
        let (full, _) = qwen3next::layer_counts(hp, dp.layer_first, dp.layer_end);
        let n_layer = full as u64;
        let kvr = dp
            .region(RegionKind::KvCache)
            .ok_or_else(|| plan_err(format!("device {} has no kv_cache region", dp.index)))?;
        let slot_bytes = 2 * ctx * pf.kv_row_bytes * n_layer;
        if kvr.bytes < slot_bytes * n_slots as u64 {
            return Err(plan_err(format!(
                "device {}: kv_cache holds {} bytes but {n_slots} slots x {n_layer} full-attention layers x {ctx} cells need {}",
                dp.index,
                kvr.bytes,
                slot_bytes * n_slots as u64
            )));
        }
        Ok(KvGeo {
            region: Span {
                off: kvr.offset,
                bytes: kvr.bytes,
            },
            slot_bytes,
            row_bytes: pf.kv_row_bytes,
            cells: ctx,
            ty: pf.kv_ty,
            host: spill.map_or_else(KvHostArg::none, |s| s.arg(0, pf.kv_row_bytes)),
        })
    }

    /// The MTP block's KV on planned device `dp` (main layers' KV `kv`): one layer of every
    /// slot's cells, in the `mtp` region after the block's weights (`exec::mtp_kv_offset`,
    /// the CPU engine's rule), slot after slot, K rows then V rows.
    fn mtp_kv_geo(&self, dp: &DevicePlan, kv: &KvGeo) -> Result<KvGeo, CudaEngineError> {
        // Past the window the block's K and V rows are the tail of each spilled cell, after
        // the main layers' rows (the planner's cells; the CPU engine's `stage_kv` split).
        let mut host = kv.host;
        if host.spills() {
            let main_cell = (2 * kv.layers() as u64 * kv.row_bytes) as i64;
            host.k_off = main_cell;
            host.v_off = main_cell + kv.row_bytes as i64;
            if host.v_off + kv.row_bytes as i64 > host.cell_bytes {
                return Err(plan_err(format!(
                    "device {}: its kv_spill cells hold {} bytes, no room after the {} KV layers' {main_cell} for the MTP block's K and V rows of {} bytes: re-plan with this build's strata-plan",
                    dp.index,
                    host.cell_bytes,
                    kv.layers(),
                    kv.row_bytes
                )));
            }
        }
        let slot_bytes = 2 * kv.cells * kv.row_bytes;
        let bytes = slot_bytes * self.n_slots as u64;
        let off = crate::exec::mtp_kv_offset(self.plan, dp, bytes).map_err(plan_err)?;
        Ok(KvGeo {
            region: Span { off, bytes },
            slot_bytes,
            row_bytes: kv.row_bytes,
            cells: kv.cells,
            ty: kv.ty,
            host,
        })
    }

    /// Stage `i` (planned device `dp`) on `dev` in `arena`: its expert cache, run flags,
    /// zeroed counters and RoPE table, and the model's layers bound on it.
    fn bind_stage(
        &self,
        i: usize,
        dp: &DevicePlan,
        dev: Arc<CudaDevice>,
        arena: DeviceArena,
        kv: KvGeo,
        pinned: Option<Vec<PinnedHost>>,
    ) -> Result<(CudaStage, AnyModel<CudaStage>), CudaEngineError> {
        let (plan, opts, pf, host) = (self.plan, self.opts, self.pf, self.host);
        let d = pf.d;
        let layout = pf.layouts[i].clone();
        let has = |b: WorkBuf| layout.get(&b).is_some_and(|s| s.bytes > 0);
        let speculate = dp.holds_mtp && plan.serve.spec > 0;
        let mtp_kv = if speculate {
            Some(self.mtp_kv_geo(dp, &kv)?)
        } else {
            None
        };
        // Experts served from host memory: the cache reads each MoE layer's picks back with a
        // host synchronisation, which a captured graph cannot hold, so those decode passes
        // run uncaptured.
        let xcache = CudaExpertCache::for_device(
            plan,
            dp,
            &dev,
            pinned,
            host.clone(),
            arena.all().ptr(),
            &d,
            pf.max_tok,
            super::expert_cache::CacheOptions {
                lfu: opts.kernels.expert_lfu,
                cpu_per_token: opts.miss_policy.cpu_per_token(dp.cost.cpu_misses_per_token),
            },
        )?;
        let flags = RunFlags {
            graphs: opts.graphs && !opts.profile && xcache.is_none(),
            pdl: self.pdl,
            gemm: opts.prefill_gemm
                && pf.gemm
                && has(WorkBuf::Xh)
                && has(WorkBuf::Yd)
                && dev.tensor_cores(),
            // The fused attention reads every cell from VRAM.
            fused_attention: opts.kernels.fused_attention
                && attn_fusable(&d, &kv, mtp_kv.as_ref())
                && !kv.host.spills(),
        };
        let binder = Binder::new(plan, dp, host.clone(), &layout);
        let mut st = CudaStage::new(
            dev,
            arena,
            layout,
            d,
            opts.kernels,
            flags,
            pf.rope.attn_factor(),
            kv,
            pf.max_tok,
            pf.att_splits,
            self.n_slots,
            opts.profile,
            binder,
        );
        st.xcache = xcache;
        st.mtp_kv = mtp_kv;
        // The zero-between-launches counters start at zero; the RoPE table is uploaded.
        for b in [WorkBuf::Counters, WorkBuf::Argmax] {
            let v = st.buf(b)?;
            st.device().memset(v, 0)?;
        }
        let inv_freq = pf.rope.inv_freq();
        let v = st.buf_at(WorkBuf::InvFreq, 0, 4 * inv_freq.len() as u64)?;
        st.device().htod(inv_freq, v)?;
        let spec = StageSpec {
            layer_first: dp.layer_first,
            layer_end: dp.layer_end,
            embedding: dp.holds_embedding,
            head: dp.holds_head,
            mtp: speculate,
        };
        let hp = &host.inventory().hparams;
        let (_, lin) = qwen3next::layer_counts(hp, dp.layer_first, dp.layer_end);
        if lin > 0 {
            let r = dp.region(RegionKind::LinearState).ok_or_else(|| {
                plan_err(format!(
                    "device {} holds {lin} linear-attention layers but no linear_state region: re-plan with this build's strata-plan",
                    dp.index
                ))
            })?;
            let region = Span {
                off: r.offset,
                bytes: r.bytes,
            };
            // With MTP speculation every slot keeps `spec` checkpoints of its state, on every
            // stage (each rolls its own layers back), as the planner sized the region.
            let ckpts = if self.plan.serve.mtp {
                self.plan.serve.spec as usize
            } else {
                0
            };
            let mut geo = LinGeo::new(&d, lin, self.n_slots, ckpts, region)?;
            if self.plan.serve.prefix_checkpoint {
                let r = dp.region(RegionKind::PrefixCheckpoint).ok_or_else(|| {
                    plan_err(format!(
                        "device {} holds {lin} linear-attention layers and the plan asks for a prefix checkpoint but has no prefix_checkpoint region: re-plan with this build's strata-plan",
                        dp.index
                    ))
                })?;
                let span = Span {
                    off: r.offset,
                    bytes: r.bytes,
                };
                geo = geo.with_prefix(self.n_slots, span)?;
            }
            st.set_linear_state(geo)?;
        }
        let inv = host.inventory();
        let model = AnyModel::bind(&inv.arch, &mut st, &d, &inv.hparams, spec)?;
        st.finish_binding();
        Ok((st, model))
    }

    /// The hand-off from stage `prev` into `st` (planned device `dp`); through host memory
    /// only when the plan's pinned staging for `dp` holds one pass's hidden states.
    fn link_in(
        &self,
        dp: &DevicePlan,
        prev: &CudaStage,
        st: &CudaStage,
    ) -> Result<Link, CudaEngineError> {
        let (pf, d) = (self.pf, self.pf.d);
        let handoff_bytes = (pf.max_tok * d.e * 4) as u64;
        let link = Link::choose(
            self.opts.handoff,
            prev.device(),
            st.device(),
            !self.mapped,
            &dp.handoff_in,
            handoff_bytes,
        )?;
        if matches!(link, Link::Host(_)) {
            let staged: u64 = self
                .plan
                .host
                .pinned_chunks
                .iter()
                .filter(|c| c.purpose == "staging" && c.device == dp.index)
                .map(|c| c.bytes)
                .sum();
            if staged < handoff_bytes {
                return Err(plan_err(format!(
                    "device {}: the plan's pinned staging holds {staged} bytes but a hand-off of {} tokens x {} floats through host memory needs {handoff_bytes}: re-plan with this strata-plan, or use --handoff peer",
                    dp.index, pf.max_tok, d.e
                )));
            }
        }
        Ok(link)
    }
}

/// The shape of a stage made without a plan.
#[derive(Debug, Clone, Copy)]
pub struct StandaloneStage {
    pub slots: usize,
    /// Cells per slot.
    pub ctx: usize,
    pub kv: KvType,
    pub pass: workset::Pass,
    pub yarn: Option<Yarn>,
}

/// One stage on `dev` holding every tensor of `host` and the working buffers, KV and logits
/// for passes of `s.pass`, laid out here in one arena by the same working-set rule the planner
/// uses (no plan): for op checks against the CPU backend and plan-less runs. Its weights are
/// still to be bound (`Bind`).
pub fn standalone_stage(
    dev: Arc<CudaDevice>,
    host: Arc<dyn HostModel>,
    s: StandaloneStage,
    opts: &CudaOptions,
) -> Result<CudaStage, CudaEngineError> {
    let d = Dims::of(&host.inventory().hparams);
    let al = |v: u64| v.div_ceil(256) * 256;
    let mut at = 0u64;
    let mut placed = HashMap::new();
    for t in &host.inventory().tensors {
        placed.insert(t.name.clone(), at);
        at += al(t.bytes);
    }
    let mut layout = HashMap::new();
    for (b, bytes) in workset::buffers(BackendKind::Gpu, &d, d.n_layer, false, &s.pass) {
        layout.insert(b, Span { off: at, bytes });
        at += al(bytes);
    }
    let kv_gg = s.kv.ggml();
    let row_bytes = crate::quant::row_bytes(kv_gg, d.k_out())
        .map_err(|e| plan_err(format!("KV rows: {e}")))? as u64;
    let hp = &host.inventory().hparams;
    let (full, lin) = qwen3next::layer_counts(hp, 0, hp.n_layer);
    let slot_bytes = 2 * s.ctx as u64 * row_bytes * full as u64;
    let kv = KvGeo {
        region: Span {
            off: at,
            bytes: slot_bytes * s.slots as u64,
        },
        slot_bytes,
        row_bytes,
        cells: s.ctx as u64,
        ty: kty(kv_gg).unwrap_or(1),
        host: KvHostArg::none(),
    };
    at += al(kv.region.bytes);
    let (conv, rec) = crate::backend::cpu::linear_state::layer_floats(&d);
    let lin_region = Span {
        off: at,
        bytes: 4 * (s.slots * lin * (conv + rec)) as u64,
    };
    at += al(lin_region.bytes);
    let arena = dev.alloc_arena("standalone stage", at.max(256))?;
    let mut tmp = Vec::new();
    for t in &host.inventory().tensors {
        let data = host
            .tensor_bytes(&t.name)
            .ok_or_else(|| plan_err(format!("`{}` has no bytes", t.name)))?;
        let cols = t.dims.first().copied().unwrap_or(1) as usize;
        let rows = t.dims.get(1).copied().unwrap_or(1) as usize;
        let mats = t.dims.iter().skip(2).product::<u64>().max(1) as usize;
        tmp.resize(data.len(), 0);
        super::layout::to_device(t.ggml_type, data, mats, rows, cols, &mut tmp)
            .map_err(|e| plan_err(e.to_string()))?;
        dev.htod(&tmp[..], arena.view(placed[&t.name], data.len() as u64)?)?;
    }
    let rope = Rope::new(d.n_rot, d.rope_theta, s.yarn);
    let pdl = opts.pdl && !opts.profile && dev.pdl_capable();
    let flags = RunFlags {
        graphs: opts.graphs && !opts.profile,
        pdl,
        gemm: opts.prefill_gemm && s.pass.gemm && dev.tensor_cores(),
        fused_attention: opts.kernels.fused_attention && attn_fusable(&d, &kv, None),
    };
    let binder = Binder::of_placed(host.clone(), placed, &layout);
    let mut st = CudaStage::new(
        dev,
        arena,
        layout,
        d,
        opts.kernels,
        flags,
        rope.attn_factor(),
        kv,
        s.pass.tokens,
        s.pass.att_splits,
        s.slots,
        opts.profile,
        binder,
    );
    for b in [WorkBuf::Counters, WorkBuf::Argmax] {
        let v = st.buf(b)?;
        st.device().memset(v, 0)?;
    }
    if lin > 0 {
        st.set_linear_state(LinGeo::new(&d, lin, s.slots, 0, lin_region)?)?;
    }
    let inv_freq = rope.inv_freq();
    let v = st.buf_at(WorkBuf::InvFreq, 0, 4 * inv_freq.len() as u64)?;
    st.device().htod(inv_freq, v)?;
    st.device().synchronize()?;
    Ok(st)
}

impl CudaEngine {
    /// The GPU of the first stage.
    pub fn device(&self) -> &CudaDevice {
        self.stages()[0].backend.device()
    }

    /// How each stage boundary hands over the hidden state (`same stream`, `peer copy` or
    /// `pinned host`), first boundary first.
    pub fn handoffs(&self) -> Vec<&'static str> {
        self.stages()
            .iter()
            .filter_map(|s| s.backend.handoff_in())
            .collect()
    }

    /// Per planned device, in plan order: (CUDA ordinal it runs on, bytes of its arena).
    pub fn arenas(&self) -> Vec<(usize, u64)> {
        self.stages()
            .iter()
            .map(|s| (s.backend.device().ordinal(), s.backend.arena_bytes()))
            .collect()
    }

    /// Per GPU in use: (ordinal, bytes of the planned arenas on it, bytes in use on it now).
    pub fn device_memory(&self) -> Result<Vec<(usize, u64, u64)>, CudaError> {
        let mut out: Vec<(usize, u64, u64)> = Vec::new();
        for s in self.stages() {
            let dev = s.backend.device();
            match out.iter_mut().find(|o| o.0 == dev.ordinal()) {
                Some(o) => o.1 += s.backend.arena_bytes(),
                None => {
                    let (free, total) = mem_info(dev)?;
                    out.push((dev.ordinal(), s.backend.arena_bytes(), total - free));
                }
            }
        }
        Ok(out)
    }

    /// Whether decode attention runs in one launch per layer on every stage.
    pub fn fused_attention(&self) -> bool {
        self.stages().iter().all(|s| s.backend.fused_attention())
    }

    /// Attention layers of decode passes whose spilled KV cells the host CPU attended
    /// (`--kv-host cpu`), every stage together, since start-up.
    pub fn kv_host_layers(&self) -> u64 {
        self.stages()
            .iter()
            .map(|s| s.backend.kv_host_layers())
            .sum()
    }

    /// Whether prefill passes of 16 tokens or more may take the tensor-core products.
    pub fn grouped_prefill(&self) -> bool {
        self.stages()
            .iter()
            .all(|s| s.backend.tensor_core_prefill())
    }
}
