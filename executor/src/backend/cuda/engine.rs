//! `CudaEngine`: a Qwen3-MoE plan run on one CUDA GPU — one arena per planned device (several
//! planned devices may share the GPU: a layer split on one card), every device-placed tensor
//! uploaded to its planned offset (Q8_0 in the split layout of `layout`), resident experts in
//! their planned expert-cache slots, KV in the `kv_cache` region, and all working buffers
//! carved from the device's planned `scratch` region. Decode steps are captured once per batch
//! size as CUDA graphs and replayed.
//! Invariant: start-up checks (fingerprint, architecture, pipeline, tensor sizes, device
//! memory, scratch fit) all pass before the first arena is allocated; after start-up the
//! engine allocates no device memory, and a stage's kernels touch only its own arena.

use super::handoff::{HandoffPolicy, Link};
use super::layout;
use super::{drv, CudaDevice, CudaError, DeviceArena};
use crate::backend::cpu::{Rope, Yarn};
use crate::engine::{Engine, EngineError, EngineInfo, EngineStats};
use crate::load::{self, HostModel};
use crate::sampler::Draw;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaGraph, LaunchConfig, PushKernelArg};
use std::collections::HashMap;
use strata_schemas::ggml::GgmlType;
use strata_schemas::plan::{Placement, Plan, RegionKind};
use strata_schemas::workset::{self, Pass, WorkDims, CARVE_ALIGN};

/// Why the CUDA engine did not start or a step failed.
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

/// Start-up options.
#[derive(Debug, Clone)]
pub struct CudaEngineOptions {
    /// CUDA device ordinal every planned device maps onto (when `device_map` is None): one
    /// device object and one stream for every stage.
    pub gpu: usize,
    /// One CUDA ordinal per planned device: each stage gets a device object (context binding,
    /// stream, kernels) of its own, even where ordinals repeat, and hands the hidden state
    /// to the next through `handoff`.
    pub device_map: Option<Vec<usize>>,
    /// How stages on separate device objects hand over (see `handoff`).
    pub handoff: HandoffPolicy,
    /// Draw a loading progress bar on stderr (only when it is a terminal).
    pub progress: bool,
    /// Capture decode steps in CUDA graphs.
    pub graphs: bool,
    /// Prefill through the tensor-core products when the weights allow (Q8_0 / Q4_K / BF16 and
    /// experts at a fixed stride); else every pass uses the matrix-vector kernels.
    pub prefill_gemm: bool,
    /// Programmatic dependent launch on GPUs of compute capability 9.0 and later (a kernel
    /// starts while the one ahead finishes and prefetches its weights meanwhile).
    pub pdl: bool,
    /// Decode launch fusions.
    pub fuse: DecodeFuse,
}

impl Default for CudaEngineOptions {
    fn default() -> Self {
        Self {
            gpu: 0,
            device_map: None,
            handoff: HandoffPolicy::Auto,
            progress: false,
            graphs: true,
            prefill_gemm: true,
            pdl: true,
            fuse: DecodeFuse::default(),
        }
    }
}

use super::ops::kty;

/// A weight matrix on the device: `rows x cols` in the device layout.
#[derive(Debug, Clone, Copy)]
struct Mat {
    ptr: CUdeviceptr,
    gty: GgmlType,
    ty: i32,
    rows: i32,
    cols: i32,
}

/// A carved buffer of the scratch region.
#[derive(Debug, Clone, Copy, Default)]
struct Buf {
    ptr: CUdeviceptr,
    bytes: u64,
}

struct Layer {
    attn_norm: CUdeviceptr,
    q: Mat,
    k: Mat,
    v: Mat,
    o: Mat,
    q_norm: CUdeviceptr,
    k_norm: CUdeviceptr,
    ffn_norm: CUdeviceptr,
    gate_inp: Mat,
    /// Device table of n_expert x (gate, up, down) matrix addresses.
    experts: CUdeviceptr,
    exp_ty: i32,
    /// Byte offsets of this layer's K and V inside a slot's KV.
    k_off: u64,
    v_off: u64,
    /// The experts as strided stacks for the grouped prefill product, when every expert of
    /// the layer sits at a fixed stride (a whole stack, or consecutive cache slots).
    stacks: Option<Stacks>,
}

/// Expert e's gate, up and down matrices at `gate + e * stride` etc. (device addresses).
#[derive(Debug, Clone, Copy)]
struct Stacks {
    gate: CUdeviceptr,
    up: CUdeviceptr,
    down: CUdeviceptr,
    gu_stride: u64,
    down_stride: u64,
    ty: GgmlType,
}

/// Working buffers of one stage, carved from its scratch region.
#[derive(Debug, Clone, Copy, Default)]
struct Bufs {
    /// Step inputs: token ids, positions, slots (i32 x max_tok each, contiguous) and n_ctx.
    inputs: Buf,
    n_ctx: Buf,
    x: Buf,
    q: Buf,
    k: Buf,
    v: Buf,
    att: Buf,
    part_o: Buf,
    part_ms: Buf,
    router: Buf,
    ids: Buf,
    wts: Buf,
    h: Buf,
    logits: Buf,
    inv_freq: Buf,
    /// Per-token counters of the last-block-finishes kernels, zero between launches.
    counters: Buf,
    /// The greedy choice on the device (`dq_argmax_rows`): per decoding slot ARGMAX_BLOCKS
    /// values, as many indices, a counter (zero between launches), the chosen token.
    argmax: Buf,
    /// Sampling on the device (`sample_rows`): one `sampler::Draw` per decoding slot.
    draws: Buf,
    // Prefill products (empty when the grouped path is off).
    xn: Buf,
    xh: Buf,
    tmp: Buf,
    yd: Buf,
    sorted: Buf,
}

struct Stage {
    arena: usize,
    /// Index of its device object in `CudaEngine::devs`.
    dev: usize,
    layers: Vec<Layer>,
    embd: Option<Mat>,
    out_norm: CUdeviceptr,
    head: Option<Mat>,
    bufs: Bufs,
    /// KV region base and bytes per slot.
    kv: CUdeviceptr,
    kv_slot_bytes: u64,
}

/// Model dimensions the kernels take.
#[derive(Debug, Clone, Copy)]
struct Dims {
    e: usize,
    n_head: usize,
    n_head_kv: usize,
    hd: usize,
    n_rot: usize,
    n_expert: usize,
    k: usize,
    f: usize,
    vocab: usize,
    eps: f32,
    norm_topk: bool,
    attn_factor: f32,
}

impl Dims {
    /// Query heads, KV heads, head dim and rotated dims as the kernels' `int`s.
    fn heads(&self) -> (i32, i32, i32, i32) {
        (
            self.n_head as i32,
            self.n_head_kv as i32,
            self.hd as i32,
            self.n_rot as i32,
        )
    }
}

/// What [`CudaEngine::preflight`] decided before any GPU is touched.
pub struct Preflight {
    /// Tokens of the largest forward pass the scratch holds (prefill chunks are split to it).
    pub max_tok: usize,
    /// Prefill through the tensor-core products.
    pub gemm: bool,
    /// Decode-attention splits the scratch holds, and the number the context asks for.
    pub att_splits: usize,
    pub full_att_splits: usize,
    /// The plan's ubatch.
    pub ubatch: usize,
    d: Dims,
    kv_ty: i32,
    kv_row_bytes: u64,
    rope: Rope,
    n_slots: usize,
    ctx: usize,
    logit_rows: usize,
}

/// Launch fusions and staging of a decode step. Its `Default` reads STRATA_FUSE_TOPK and
/// STRATA_FUSE_ATTN ("0" off, anything else on; both on by default), STRATA_ATT_CHUNK (the
/// fused attention's smallest split, in cells; 32 by default) and STRATA_XS (the mask of
/// products staging their input; all of them by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeFuse {
    /// The router's softmax and top-k in the last block of its logit launch instead of a
    /// launch of their own. The same code either way, so the logits are bit for bit the same.
    pub topk: bool,
    /// QK-norm + RoPE, the KV store, split-KV attention and the merge of the splits in one
    /// launch (`dq_attn_fused`) instead of three, where the model allows it (F16 KV, head
    /// dims a multiple of 8 up to 128, query groups dividing 128 up to 16). Its splits are at
    /// least `attn_chunk` cells, so its sums run in another order than the three launches'.
    pub attn: bool,
    /// The fused attention's smallest split, in cells (rounded up to a multiple of 16).
    pub attn_chunk: u32,
    /// Which one-token Q8_0 products stage their input in shared memory (decode.cu's
    /// dq_xs_fill), where the lanes' loads of it take a quarter of the L1 wavefronts: a mask
    /// of [`XS_QKV`], [`XS_OUT`] (the output projection) and [`XS_GATE_UP`]. The same values
    /// and arithmetic either way: bit for bit the same logits.
    pub xs: u8,
}

/// [`DecodeFuse::xs`]: the Q/K/V product stages its input.
pub const XS_QKV: u8 = 1;
/// [`DecodeFuse::xs`]: the output projection (rows wider than the register path's) does.
pub const XS_OUT: u8 = 2;
/// [`DecodeFuse::xs`]: the MoE gate/up product does.
pub const XS_GATE_UP: u8 = 4;

impl Default for DecodeFuse {
    fn default() -> Self {
        let on = |k: &str, default: bool| match std::env::var(k) {
            Ok(v) => v != "0",
            Err(_) => default,
        };
        Self {
            topk: on("STRATA_FUSE_TOPK", true),
            attn: on("STRATA_FUSE_ATTN", true),
            attn_chunk: std::env::var("STRATA_ATT_CHUNK")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(32),
            xs: std::env::var("STRATA_XS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(XS_QKV | XS_OUT | XS_GATE_UP),
        }
    }
}

/// A plan-bound engine on one CUDA GPU.
pub struct CudaEngine {
    info: EngineInfo,
    d: Dims,
    kv_ty: i32,
    kv_row_bytes: u64,
    /// Tokens one forward pass takes (prefill chunks are split to it).
    max_tok: usize,
    /// Rows of logits the head computes per pass.
    logit_rows: usize,
    att_splits: usize,
    stages: Vec<Stage>,
    lens: Vec<u64>,
    host_in: Vec<i32>,
    logits: Vec<f32>,
    all_rows: Vec<f32>,
    /// Captured decode steps by batch size: the whole step on one device object, or one
    /// graph per stage when stages have device objects of their own.
    graphs: HashMap<usize, Vec<Graph>>,
    use_graphs: bool,
    /// Which launches decode steps fuse.
    fuse: DecodeFuse,
    /// Launch PDL-aware kernels with programmatic dependent launch (see `launch_pdl`).
    pdl: bool,
    /// Prefill through the tensor-core products (else the matrix-vector kernels).
    gemm: bool,
    /// STRATA_PROFILE=1: time every launch with events (decode without graphs) and print
    /// the totals per kernel when the engine is dropped.
    prof: Option<Prof>,
    prof_totals: std::cell::RefCell<ProfTotals>,
    steps: u64,
    arenas: Vec<DeviceArena>,
    planned_bytes: u64,
    /// The hand-off into stage i + 1 (one per stage boundary).
    links: Vec<Link>,
    /// One device object shared by every stage, or one per stage (`--device-map`).
    devs: Vec<CudaDevice>,
    #[allow(dead_code)]
    host: Box<dyn HostModel>,
}

fn plan_err(s: impl Into<String>) -> CudaEngineError {
    CudaEngineError::Plan(s.into())
}

fn align(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

/// Bytes of a matrix of `rows x cols` of `ty`.
fn mat_bytes(ty: GgmlType, rows: usize, cols: usize) -> Result<u64, CudaEngineError> {
    let rb = crate::quant::row_bytes(ty, cols)
        .map_err(|e| CudaEngineError::Model(format!("{ty} rows of {cols}: {e}")))?;
    Ok(rb as u64 * rows as u64)
}

impl Dims {
    fn work(&self) -> WorkDims {
        WorkDims {
            e: self.e,
            n_head: self.n_head,
            n_head_kv: self.n_head_kv,
            hd: self.hd,
            n_rot: self.n_rot,
            n_expert: self.n_expert,
            k: self.k,
            f: self.f,
            vocab: self.vocab,
        }
    }
}

impl CudaEngine {
    /// Every start-up check that needs no GPU (fingerprint, architecture, pipeline, tensor
    /// sizes, KV type, kernel limits, scratch fit), and the pass shape the scratch allows.
    pub fn preflight(
        plan: &Plan,
        host: &dyn HostModel,
        opts: &CudaEngineOptions,
    ) -> Result<Preflight, CudaEngineError> {
        let inv = host.inventory();
        load::check_fingerprint(plan, host)?;
        if inv.arch != "qwen3moe" {
            return Err(plan_err(format!(
                "architecture `{}` has no CUDA forward pass in this build (qwen3moe only)",
                inv.arch
            )));
        }
        let hp = inv.hparams.clone();
        if hp.n_leading_dense > 0 || hp.n_expert == 0 {
            return Err(plan_err(
                "dense FFN layers are not in the CUDA forward pass yet: run with --backend cpu",
            ));
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
        if s.kv_resident < s.max_context {
            return Err(plan_err(format!(
                "the plan keeps {} of {} KV cells per slot on the GPU; KV spill to host memory is not in the CUDA engine yet: re-plan with --kv-resident {} or run with --backend cpu",
                s.kv_resident, s.max_context, s.max_context
            )));
        }
        let (kv_gg, kv_ty) = match s.kv.as_str() {
            "f16" => (GgmlType::F16, 1),
            "q8_0" => (GgmlType::Q8_0, 3),
            other => {
                return Err(plan_err(format!(
                    "serve.kv `{other}` is not a KV type the CUDA engine runs (f16, q8_0)"
                )))
            }
        };
        let n_rot = hp.rope_dim.unwrap_or(hp.head_dim_k) as usize;
        let yarn = (s.rope_scaling == "yarn").then(|| Yarn::new(s.rope_scale, s.yarn_orig_ctx));
        let rope = Rope::new(n_rot, hp.rope_theta, yarn);
        let d = Dims {
            e: hp.n_embd as usize,
            n_head: hp.n_head as usize,
            n_head_kv: hp.n_head_kv as usize,
            hd: hp.head_dim_k as usize,
            n_rot,
            n_expert: hp.n_expert as usize,
            k: hp.n_expert_used as usize,
            f: hp.n_ff_exp as usize,
            vocab: hp.n_vocab as usize,
            eps: hp.rms_eps as f32,
            norm_topk: hp.norm_topk_prob,
            attn_factor: rope.attn_factor(),
        };
        if hp.head_dim_v != hp.head_dim_k || d.hd > super::ops::ATT_MAX_D || d.hd % 4 != 0 {
            return Err(plan_err(format!(
                "head dims k {} v {}: the CUDA kernels need equal K/V head dims, a multiple of 4, at most {}",
                hp.head_dim_k,
                hp.head_dim_v,
                super::ops::ATT_MAX_D
            )));
        }
        if d.n_head % d.n_head_kv != 0 || d.n_head / d.n_head_kv > super::ops::ATT_MAX_GROUP {
            return Err(plan_err(format!(
                "{} query heads over {} KV heads: the CUDA decode attention needs a whole group of at most {} query heads per KV head",
                d.n_head, d.n_head_kv, super::ops::ATT_MAX_GROUP
            )));
        }
        if d.e % 32 != 0 || d.f % 32 != 0 {
            return Err(plan_err(format!(
                "hidden {} / expert width {}: the CUDA kernels need both to be multiples of 32",
                d.e, d.f
            )));
        }
        let n_slots = s.batch as usize;
        let ctx = s.max_context as usize;
        let kv_width = d.n_head_kv * d.hd;
        let kv_row_bytes = crate::quant::row_bytes(kv_gg, kv_width)
            .map_err(|e| plan_err(format!("KV rows: {e}")))? as u64;
        let full_splits = super::ops::att_splits(ctx);
        let logit_rows = n_slots.max(1);

        // The tensor-core prefill path: every projection and expert matrix Q8_0, Q4_K or BF16
        // (each product picks its kernel by its own tensor's type, so they may be mixed).
        let gemm_ty = super::gemm::gemm_supports;
        let gemm = opts.prefill_gemm
            && inv.tensors.iter().all(|t| {
                let n = t.name.as_str();
                let proj = ["attn_q.", "attn_k.", "attn_v.", "attn_output.", "_exps."]
                    .iter()
                    .any(|p| n.contains(p));
                !proj || gemm_ty(t.ggml_type)
            });
        // Norm vectors stored as F32 are read in place; others are converted into scratch.
        let f32_norms = inv
            .tensors
            .iter()
            .filter(|t| t.name.ends_with("norm.weight"))
            .all(|t| t.ggml_type == GgmlType::F32);
        // Scratch fit: the largest pass (<= ubatch, >= the decode batch) every stage's
        // scratch region can hold, after the expert tables and converted norm vectors.
        let ubatch = (s.ubatch as usize).max(1);
        // The largest pass every device's scratch holds: `Err(need)` when not even a decode
        // batch fits.
        let pass_fit = |gemm: bool, att_splits: usize| -> Result<usize, (u32, u64, u64)> {
            let mut max_tok = ubatch.max(n_slots);
            for dp in &plan.devices {
                let have = dp.region_bytes(RegionKind::Scratch);
                let n_layer = (dp.layer_end - dp.layer_first) as usize;
                let need = |t: usize| {
                    let p = Pass {
                        tokens: t,
                        logit_rows,
                        att_splits,
                        slots: n_slots,
                        gemm,
                    };
                    workset::stage_bytes(&d.work(), n_layer, f32_norms, &p)
                };
                while max_tok > n_slots.max(1) && need(max_tok) > have {
                    max_tok = (max_tok / 2).max(n_slots.max(1));
                }
                if need(max_tok) > have {
                    return Err((dp.index, have, need(max_tok)));
                }
            }
            Ok(max_tok)
        };
        // The tensor-core path only serves passes of GEMM_MIN_TOK tokens or more; when the
        // scratch cannot hold its buffers for such a pass, prefill with the matrix-vector
        // kernels instead.
        let choose = |att_splits: usize| match pass_fit(gemm, att_splits) {
            Ok(t) if !gemm || t >= GEMM_MIN_TOK => Ok((gemm, t)),
            _ => pass_fit(false, att_splits).map(|t| (false, t)),
        };
        // A plan made before the forward graph sized 16-cell splits has room for fewer: run
        // with as many as fit (the same results; decode attention is slower at long contexts).
        let mut att_splits = full_splits;
        let (gemm, max_tok) = loop {
            match choose(att_splits) {
                Ok(v) => break v,
                Err(_) if att_splits > 1 => att_splits /= 2,
                Err((index, have, need)) => {
                    return Err(plan_err(format!(
                        "device {index}: the scratch region holds {have} bytes but the CUDA engine needs {need} for a decode batch of {n_slots} slots: re-plan with fewer slots (--batch)"
                    )))
                }
            }
        };
        Ok(Preflight {
            max_tok,
            gemm,
            att_splits,
            full_att_splits: full_splits,
            ubatch,
            d,
            kv_ty,
            kv_row_bytes,
            rope,
            n_slots,
            ctx,
            logit_rows,
        })
    }

    /// Check `host` against `plan` and the GPU, allocate the planned arenas, upload the weights
    /// and prepare every stage.
    pub fn start(
        plan: &Plan,
        host: Box<dyn HostModel>,
        opts: CudaEngineOptions,
    ) -> Result<Self, CudaEngineError> {
        let pf = Self::preflight(plan, host.as_ref(), &opts)?;
        if pf.att_splits < pf.full_att_splits {
            eprintln!(
                "note: the plan's scratch holds {} of {} decode-attention splits (a plan from an older strata-plan): decode at long contexts is slower until you re-plan",
                pf.att_splits, pf.full_att_splits
            );
        }
        if pf.max_tok < pf.ubatch {
            eprintln!(
                "note: the plan's scratch holds prefill passes of {} of its {} ubatch tokens (a plan from an older strata-plan, or a smaller --ubatch would do): prompts run in {}-token passes until you re-plan",
                pf.max_tok, pf.ubatch, pf.max_tok
            );
        }
        let Preflight {
            max_tok,
            gemm,
            att_splits,
            ubatch,
            d,
            kv_ty,
            kv_row_bytes,
            rope,
            n_slots,
            ctx,
            logit_rows,
            ..
        } = pf;
        let s = &plan.serve;

        // The GPUs: one device object for every stage, or one per stage (`--device-map`), and
        // whether each GPU's free memory holds the arenas planned onto it.
        let devs: Vec<CudaDevice> = match &opts.device_map {
            None => vec![CudaDevice::open(opts.gpu)?],
            Some(map) => map
                .iter()
                .map(|&o| CudaDevice::open(o))
                .collect::<Result<_, _>>()?,
        };
        let mapped = opts.device_map.is_some();
        let dev_of = |i: usize| if mapped { i } else { 0 };
        let planned: u64 = plan.devices.iter().map(|dp| dp.arena_bytes).sum();
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

        // Every allocation, then the weights.
        let mut arenas = Vec::with_capacity(plan.devices.len());
        for (i, dp) in plan.devices.iter().enumerate() {
            arenas.push(
                devs[dev_of(i)].alloc_arena(&format!("device {}", dp.index), dp.arena_bytes)?,
            );
        }
        let arena_devs: Vec<&CudaDevice> = (0..arenas.len()).map(|i| &devs[dev_of(i)]).collect();
        upload_weights(plan, &arena_devs, &arenas, host.as_ref(), opts.progress)?;

        let mut stages = Vec::with_capacity(plan.devices.len());
        for (i, arena) in arenas.iter().enumerate() {
            stages.push(build_stage(
                plan,
                &devs[dev_of(i)],
                arena,
                i,
                host.as_ref(),
                &d,
                &rope,
                StageSizes {
                    gemm,
                    max_tok,
                    logit_rows,
                    att_splits,
                    n_slots,
                    ctx,
                    kv_row_bytes,
                },
            )?);
            if let Some(st) = stages.last_mut() {
                st.dev = dev_of(i);
            }
        }
        // The hand-offs between stages; a staged one through the pinned host memory the plan
        // sets aside for the receiving device.
        let handoff_bytes = (max_tok * d.e * 4) as u64;
        let mut links = Vec::with_capacity(stages.len().saturating_sub(1));
        for i in 1..stages.len() {
            let link = Link::choose(
                opts.handoff,
                &devs[dev_of(i - 1)],
                &devs[dev_of(i)],
                !mapped,
                &plan.devices[i].handoff_in,
                handoff_bytes,
            )?;
            if matches!(link, Link::Host(_)) {
                let dp = &plan.devices[i];
                let staged: u64 = plan
                    .host
                    .pinned_chunks
                    .iter()
                    .filter(|c| c.purpose == "staging" && c.device == dp.index)
                    .map(|c| c.bytes)
                    .sum();
                if staged < handoff_bytes {
                    return Err(plan_err(format!(
                        "device {}: the plan's pinned staging holds {staged} bytes but a hand-off of {max_tok} tokens x {} floats through host memory needs {handoff_bytes}: re-plan with this strata-plan, or use --handoff peer",
                        dp.index, d.e
                    )));
                }
            }
            links.push(link);
        }
        for dev in &devs {
            dev.synchronize()?;
        }
        let attn_ok = attn_fusable(&d, kv_ty, kv_row_bytes, max_tok, &stages);
        Ok(Self {
            info: EngineInfo {
                model_name: plan.model.name.clone(),
                n_slots,
                max_context: s.max_context,
                ubatch,
                n_vocab: d.vocab,
            },
            d,
            kv_ty,
            kv_row_bytes,
            max_tok,
            logit_rows,
            att_splits,
            stages,
            lens: vec![0; n_slots],
            host_in: vec![0; 3 * max_tok],
            logits: vec![0.0; logit_rows * d.vocab],
            all_rows: Vec::with_capacity(ubatch * d.vocab),
            graphs: HashMap::new(),
            use_graphs: opts.graphs && std::env::var_os("STRATA_PROFILE").is_none(),
            fuse: DecodeFuse {
                attn: opts.fuse.attn && attn_ok,
                ..opts.fuse
            },
            // Profiling times each kernel alone, so it launches them strictly in order.
            pdl: opts.pdl
                && std::env::var_os("STRATA_PROFILE").is_none()
                && devs.iter().all(|d| d.compute_capability().0 >= 9),
            gemm,
            prof: std::env::var_os("STRATA_PROFILE").map(|_| Prof::default()),
            prof_totals: Default::default(),
            steps: 0,
            arenas,
            planned_bytes: planned,
            links,
            devs,
            host,
        })
    }

    /// Whether decode steps run attention as one `dq_attn_fused` launch per layer (asked for
    /// in the options, and the model and plan allow it).
    pub fn fused_attention(&self) -> bool {
        self.fuse.attn
    }

    /// The GPU of the first stage.
    pub fn device(&self) -> &CudaDevice {
        &self.devs[0]
    }

    /// How each stage boundary hands over the hidden state (`same stream`, `peer copy` or
    /// `pinned host`), first boundary first.
    pub fn handoffs(&self) -> Vec<&'static str> {
        self.links.iter().map(|l| l.kind()).collect()
    }

    /// Per planned device, in plan order: (CUDA ordinal it runs on, bytes of its allocated
    /// arena).
    pub fn arenas(&self) -> Vec<(usize, u64)> {
        self.stages
            .iter()
            .map(|st| (self.devs[st.dev].ordinal(), self.arenas[st.arena].size()))
            .collect()
    }

    /// Per GPU in use: (ordinal, bytes of the planned arenas on it, bytes in use on it now).
    pub fn device_memory(&self) -> Result<Vec<(usize, u64, u64)>, CudaEngineError> {
        let held = self
            .stages
            .iter()
            .map(|st| (st.dev, self.arenas[st.arena].size()));
        bytes_per_gpu(&self.devs, held)
            .into_iter()
            .map(|(di, bytes)| {
                let (free, total) = mem_info(&self.devs[di])?;
                Ok((self.devs[di].ordinal(), bytes, total - free))
            })
            .collect()
    }

    fn dev(&self, st: &Stage) -> &CudaDevice {
        &self.devs[st.dev]
    }

    /// Launchers for stage `st`: with programmatic dependent launch in decode steps only
    /// (measured on the H200: decode 224 -> 233 tok/s with it; prefill passes lost 4% with it,
    /// so they launch in strict order).
    fn kern(&self, st: &Stage, decode: bool) -> Kern<'_> {
        Kern {
            dev: self.dev(st),
            pdl: self.pdl && decode,
            prof: self.prof.as_ref(),
            xs: self.fuse.xs,
        }
    }

    /// Waits for every stream.
    fn sync_all(&self) -> Result<(), CudaEngineError> {
        for dev in &self.devs {
            dev.synchronize()?;
        }
        Ok(())
    }

    /// Whether prefill passes of at least 16 tokens run through the tensor-core products in
    /// every layer (Q8_0/Q4_K/BF16 weights, experts at a fixed stride).
    pub fn grouped_prefill(&self) -> bool {
        self.gemm
            && self
                .stages
                .iter()
                .all(|s| s.layers.iter().all(|l| l.stacks.is_some()))
    }

    /// Tokens one forward pass takes (prefill chunks larger than this are split).
    pub fn pass_tokens(&self) -> usize {
        self.max_tok
    }

    /// Bytes of the planned arenas (all allocated at start-up).
    pub fn planned_bytes(&self) -> u64 {
        self.planned_bytes
    }

    /// Device memory (free, total) of the first stage's GPU now.
    pub fn mem_info(&self) -> Result<(u64, u64), CudaEngineError> {
        Ok(mem_info(&self.devs[0])?)
    }

    /// Upload tokens/positions/slots of `n` tokens to every stage.
    fn upload_inputs(&mut self, n: usize) -> Result<(), CudaEngineError> {
        let m = self.max_tok;
        for st in &self.stages {
            let bytes = &self.host_in[..3 * m];
            let dev = self.dev(st);
            dev.ctx_bind()?;
            // SAFETY: `inputs` was carved with 3 * max_tok i32s; the host slice lives in
            // self and is not touched until the stream is synchronized after the step.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    st.bufs.inputs.ptr,
                    bytes,
                    dev.stream().cu_stream(),
                )
            }
            .map_err(drv("cuMemcpyHtoDAsync(step inputs)"))?;
        }
        let _ = n;
        Ok(())
    }

    /// Run every stage over `n` tokens whose inputs are uploaded. `head_rows`: how many of
    /// the last tokens get logits (0 = none). `decode`: tokens are one per slot (else they are
    /// consecutive prompt tokens of one slot).
    fn forward(
        &self,
        n: usize,
        decode: bool,
        head_first: usize,
        head_rows: usize,
    ) -> Result<(), CudaEngineError> {
        for si in 0..self.stages.len() {
            if si > 0 {
                self.handoff(si, n)?;
            }
            self.stage_pass(si, n, decode, head_first, head_rows)?;
        }
        Ok(())
    }

    /// Queue the copy of the hidden state of `n` tokens from stage `si - 1` into stage `si`.
    fn handoff(&self, si: usize, n: usize) -> Result<(), CudaEngineError> {
        let (from, to) = (&self.stages[si - 1], &self.stages[si]);
        let bytes = (n * self.d.e * 4) as u64;
        self.links[si - 1].copy(
            self.dev(from),
            self.dev(to),
            from.bufs.x.ptr,
            to.bufs.x.ptr,
            bytes,
        )?;
        Ok(())
    }

    /// Stage `si`'s layers over `n` tokens whose hidden state is in its `x` (the first stage
    /// looks up the embedding), and the head when it is the last stage and `head_rows > 0`.
    fn stage_pass(
        &self,
        si: usize,
        n: usize,
        decode: bool,
        head_first: usize,
        head_rows: usize,
    ) -> Result<(), CudaEngineError> {
        let d = self.d;
        let st = &self.stages[si];
        let k = self.kern(st, decode);
        {
            let b = &st.bufs;
            let m = self.max_tok as u64;
            let tok = b.inputs.ptr;
            let pos = b.inputs.ptr + 4 * m;
            let slot = b.inputs.ptr + 8 * m;
            if si == 0 {
                let e = st
                    .embd
                    .ok_or_else(|| plan_err("the first stage holds no embedding"))?;
                k.get_rows(e, tok, b.x.ptr, n)?;
            }
            k.ctx_from_pos(pos, b.n_ctx.ptr, n)?;
            for l in &st.layers {
                if !decode && self.gemm && n >= GEMM_MIN_TOK && l.stacks.is_some() {
                    self.layer_prefill_gemm(st, l, pos, slot, n)?;
                    continue;
                }
                // Attention: RMSNorm once into xn, then Q/K/V in one launch. (The norm
                // inside that launch, every block normalising x itself, measured slower on
                // the H200: 212 against 227 tok/s decode.)
                k.rmsnorm(b.x.ptr, 0, 0, l.attn_norm, b.xn.ptr, d.e, d.eps, n)?;
                k.qkv(l, b.xn.ptr, b.q.ptr, b.k.ptr, b.v.ptr, n)?;
                if decode && self.fuse.attn {
                    k.attn_fused(
                        b,
                        st,
                        l,
                        slot,
                        pos,
                        self.kv_row_bytes,
                        d,
                        n,
                        self.att_splits,
                        self.max_tok,
                        self.fuse.attn_chunk,
                    )?;
                } else {
                    k.rope_store(b, st, l, slot, pos, self.kv_ty, self.kv_row_bytes, d, n)?;
                    if decode {
                        k.attn_decode(
                            b,
                            st,
                            l,
                            slot,
                            self.kv_ty,
                            self.kv_row_bytes,
                            d,
                            n,
                            self.att_splits,
                        )?;
                    } else {
                        k.attn_prefill(b, st, l, slot, pos, self.kv_ty, self.kv_row_bytes, d, n)?;
                    }
                }
                k.mv_chunks(l.o, b.att.ptr, 0, d.eps, b.x.ptr, n, true)?;
                // Router and experts over xn = RMSNorm(x) * ffn_norm.
                if !k.router_logits(l, b, d, n, decode && self.fuse.topk)? {
                    k.router(b.router.ptr, d, b.ids.ptr, b.wts.ptr, n)?;
                }
                k.moe(l, b, d, n)?;
            }
        }
        if head_rows > 0 && si + 1 == self.stages.len() {
            let head = st
                .head
                .ok_or_else(|| plan_err("the last stage holds no head"))?;
            let b = &st.bufs;
            let x = b.x.ptr + (head_first * d.e * 4) as u64;
            k.rmsnorm(x, 0, 0, st.out_norm, b.xn.ptr, d.e, d.eps, head_rows)?;
            k.mv_chunks(head, b.xn.ptr, 0, d.eps, b.logits.ptr, head_rows, false)?;
        }
        Ok(())
    }

    /// One layer of a prefill pass through the tensor-core products: RMSNorm, Q/K/V and
    /// output projections as GEMMs, flash attention, router, experts grouped by `moe_sort`
    /// into a fused gate-up-SwiGLU product and a down product, combined into the residual.
    fn layer_prefill_gemm(
        &self,
        st: &Stage,
        l: &Layer,
        pos: u64,
        slot: u64,
        n: usize,
    ) -> Result<(), CudaEngineError> {
        use super::gemm::{GemmTile, MoeInput, MOE_DEFAULT_TILE};
        let d = self.d;
        let b = &st.bufs;
        let k = self.kern(st, false);
        let dev = self.dev(st);
        let arena = &self.arenas[st.arena];
        let base = arena.all().ptr();
        let v = |ptr: u64, len: u64| arena.view(ptr - base, len);
        let f = |x: usize| (x * 4) as u64;
        let s = l
            .stacks
            .ok_or_else(|| plan_err("grouped prefill without expert stacks"))?;
        let q_out = d.n_head * d.hd;
        let kv_out = d.n_head_kv * d.hd;
        let xh = v(b.xh.ptr, b.xh.bytes)?;
        k.rmsnorm(b.x.ptr, 0, 0, l.attn_norm, b.xn.ptr, d.e, d.eps, n)?;
        let xn = v(b.xn.ptr, f(n * d.e))?;
        for (m, out, rows) in [
            (l.q, b.q.ptr, q_out),
            (l.k, b.k.ptr, kv_out),
            (l.v, b.v.ptr, kv_out),
        ] {
            let w = v(m.ptr, mat_bytes(m.gty, rows, d.e)?)?;
            let y = v(out, f(n * rows))?;
            k.timed("gemm_qkv", || dev.gemm(w, m.gty, rows, d.e, xn, n, y, xh))?;
        }
        k.rope_store(b, st, l, slot, pos, self.kv_ty, self.kv_row_bytes, d, n)?;
        k.attn_prefill(b, st, l, slot, pos, self.kv_ty, self.kv_row_bytes, d, n)?;
        let wo = v(l.o.ptr, mat_bytes(l.o.gty, d.e, q_out)?)?;
        let (att, tmp) = (v(b.att.ptr, f(n * q_out))?, v(b.tmp.ptr, f(n * d.e))?);
        k.timed("gemm_o", || {
            dev.gemm(wo, l.o.gty, d.e, q_out, att, n, tmp, xh)
        })?;
        // x += attention output; xn = RMSNorm(x) * ffn_norm.
        k.rmsnorm(
            b.tmp.ptr, b.x.ptr, b.x.ptr, l.ffn_norm, b.xn.ptr, d.e, d.eps, n,
        )?;
        k.router_prefill(l, b, d, n)?;
        k.router(b.router.ptr, d, b.ids.ptr, b.wts.ptr, n)?;
        let sorted = v(b.sorted.ptr, b.sorted.bytes)?;
        let ids = v(b.ids.ptr, (4 * n * d.k) as u64)?;
        k.timed("moe_sort", || dev.moe_sort(ids, n, d.k, d.n_expert, sorted))?;
        let gu_bytes = mat_bytes(s.ty, d.f, d.e)?;
        let gu_span = s.gu_stride * (d.n_expert as u64 - 1) + gu_bytes;
        k.timed("gemm_convert_x", || {
            dev.gemm_convert_x(xn, n, d.e, s.ty, xh)
        })?;
        let h = v(b.h.ptr, f(n * d.k * d.f))?;
        let (wg, wu) = (v(s.gate, gu_span)?, v(s.up, gu_span)?);
        k.timed("moe_gemm_glu", || {
            dev.moe_gemm_converted_strided(
                GemmTile::M64,
                wg,
                Some(wu),
                s.gu_stride,
                s.ty,
                d.n_expert,
                d.f,
                d.e,
                xh,
                MoeInput::Gather,
                n,
                d.k,
                sorted,
                h,
            )
        })?;
        let dn_bytes = mat_bytes(s.ty, d.e, d.f)?;
        let dn_span = s.down_stride * (d.n_expert as u64 - 1) + dn_bytes;
        k.timed("gemm_convert_x", || {
            dev.gemm_convert_x(h, n * d.k, d.f, s.ty, xh)
        })?;
        let (wd, yd) = (v(s.down, dn_span)?, v(b.yd.ptr, f(n * d.k * d.e))?);
        k.timed("moe_gemm_down", || {
            dev.moe_gemm_converted_strided(
                MOE_DEFAULT_TILE,
                wd,
                None,
                s.down_stride,
                s.ty,
                d.n_expert,
                d.e,
                d.f,
                xh,
                MoeInput::Direct,
                n,
                d.k,
                sorted,
                yd,
            )
        })?;
        k.combine(b.yd.ptr, b.wts.ptr, d.k, d.e, b.x.ptr, n)
    }

    /// Profiling: wait for the step, add each launch's time to the totals (keyed by decode
    /// or prefill and kernel name).
    fn prof_collect(&self, decode: bool) -> Result<(), CudaEngineError> {
        let Some(p) = &self.prof else {
            return Ok(());
        };
        self.sync_all()?;
        let mut tot = self.prof_totals.borrow_mut();
        for (name, e0, e1) in p.borrow_mut().drain(..) {
            let ms = e0.elapsed_ms(&e1).map_err(drv("cuEventElapsedTime"))? as f64;
            let t = tot.entry((decode, name)).or_insert((0, 0.0));
            t.0 += 1;
            t.1 += ms;
        }
        Ok(())
    }

    /// The argmax of each of the first `out.len()` rows of the last stage's logits, chosen on
    /// its device and copied into `out`; every stream synchronised after.
    fn greedy_back(&mut self, out: &mut [u32]) -> Result<(), CudaEngineError> {
        let st = self.stages.last().ok_or_else(|| plan_err("no stages"))?;
        let rows = out.len();
        let nb = strata_schemas::workset::ARGMAX_BLOCKS;
        let [part_v, part_i, cnt, ids] = self.pick_scratch(st, rows)?;
        let k = Kern {
            pdl: false,
            ..self.kern(st, true)
        };
        k.argmax_rows(
            st.bufs.logits.ptr,
            self.d.vocab,
            rows,
            nb as u32,
            [part_v, part_i, cnt, ids],
        )?;
        let dev = &self.devs[st.dev];
        dev.ctx_bind()?;
        // SAFETY: `ids` holds n_slots >= rows u32s on the device (checked against the buffer
        // above); `out` stays borrowed until the synchronize below.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(out, ids, dev.stream().cu_stream()) }
            .map_err(drv("cuMemcpyDtoHAsync(greedy tokens)"))?;
        self.sync_all()?;
        Ok(())
    }

    /// The last stage's `argmax` buffer carved for picking tokens from `rows` rows of logits
    /// (`dq_argmax_rows` and `sample_rows`): per slot ARGMAX_BLOCKS partial values, as many
    /// indices, then a counter per slot and the chosen token per slot.
    fn pick_scratch(&self, st: &Stage, rows: usize) -> Result<[u64; 4], CudaEngineError> {
        let nb = strata_schemas::workset::ARGMAX_BLOCKS;
        let a = st.bufs.argmax;
        let slots = self.info.n_slots as u64;
        let need = slots * (nb * 8 + 8);
        if a.bytes < need || rows as u64 > slots {
            return Err(plan_err(format!(
                "the argmax buffer holds {} bytes, {slots} slots need {need}: re-plan with this strata-plan",
                a.bytes
            )));
        }
        let (part_v, part_i) = (a.ptr, a.ptr + slots * nb * 4);
        let cnt = part_i + slots * nb * 4;
        Ok([part_v, part_i, cnt, cnt + slots * 4])
    }

    /// The token of `draws[i]` from each of the first `out.len()` rows of the last stage's
    /// logits, drawn on its device (`sample_rows`) and copied into `out`; every stream
    /// synchronised after.
    fn sample_back(&mut self, draws: &[Draw], out: &mut [u32]) -> Result<(), CudaEngineError> {
        let st = self.stages.last().ok_or_else(|| plan_err("no stages"))?;
        let rows = out.len();
        let slots = self.info.n_slots as u64;
        let dr = st.bufs.draws;
        let nb = strata_schemas::workset::ARGMAX_BLOCKS;
        let draw_bytes = strata_schemas::workset::DRAW_BYTES;
        if dr.bytes < slots * draw_bytes {
            return Err(plan_err(format!(
                "the draws buffer holds {} bytes, {slots} slots need {}: re-plan with this strata-plan",
                dr.bytes,
                slots * draw_bytes
            )));
        }
        // The argmax buffer's pairs, counters and token slots serve the sampler too.
        let [part_v, part_i, cnt, ids] = self.pick_scratch(st, rows)?;
        let mut bytes = Vec::with_capacity(rows * draw_bytes as usize);
        for d in draws {
            bytes.extend_from_slice(&d.to_bytes());
        }
        let dev = &self.devs[st.dev];
        dev.ctx_bind()?;
        // SAFETY: `draws` holds n_slots >= rows 32-byte draws on the device (checked above);
        // the host bytes stay alive until the synchronize below.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(dr.ptr, &bytes, dev.stream().cu_stream())
        }
        .map_err(drv("cuMemcpyHtoDAsync(sampling draws)"))?;
        let k = Kern {
            pdl: false,
            ..self.kern(st, true)
        };
        // Blocks per row: every block repeats the row's threshold passes, so fewer when a
        // draw has cuts (they read the row four or eight more times).
        let cuts = draws.iter().any(|d| {
            !d.is_greedy() && ((d.top_k > 0 && (d.top_k as usize) < self.d.vocab) || d.top_p < 1.0)
        });
        let blocks = if cuts { SAMPLE_BLOCKS_CUTS } else { nb as u32 };
        k.sample_rows(
            st.bufs.logits.ptr,
            self.d.vocab,
            rows,
            blocks,
            dr.ptr,
            [part_v, part_i, cnt, ids],
        )?;
        // SAFETY: `ids` holds n_slots >= rows u32s on the device; `out` stays borrowed until
        // the synchronize below.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(out, ids, dev.stream().cu_stream()) }
            .map_err(drv("cuMemcpyDtoHAsync(sampled tokens)"))?;
        self.sync_all()?;
        Ok(())
    }

    fn logits_back(&mut self, rows: usize) -> Result<(), CudaEngineError> {
        let st = self.stages.last().ok_or_else(|| plan_err("no stages"))?;
        let n = rows * self.d.vocab;
        let dev = &self.devs[st.dev];
        dev.ctx_bind()?;
        // SAFETY: `logits` holds logit_rows x vocab floats on the device and rows <= logit_rows;
        // the host buffer is borrowed until the synchronize below.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                &mut self.logits[..n],
                st.bufs.logits.ptr,
                dev.stream().cu_stream(),
            )
        }
        .map_err(drv("cuMemcpyDtoHAsync(logits)"))?;
        // The last stage's stream waited for every earlier stage's hand-off; the others are
        // synchronised too so that no stream still runs when the next step reuses buffers.
        self.sync_all()?;
        Ok(())
    }

    fn check_request(&self, slot: usize, n: usize) -> Result<(), EngineError> {
        if slot >= self.info.n_slots {
            return Err(EngineError::Request(format!(
                "slot {slot} does not exist (the plan has {})",
                self.info.n_slots
            )));
        }
        let len = self.lens[slot];
        if len + n as u64 > self.info.max_context {
            return Err(EngineError::Request(format!(
                "slot {slot} holds {len} of {} cells; {n} more do not fit",
                self.info.max_context
            )));
        }
        Ok(())
    }

    fn check_tokens(&self, tokens: impl Iterator<Item = u32>) -> Result<(), EngineError> {
        for t in tokens {
            if t as usize >= self.d.vocab {
                return Err(EngineError::Request(format!(
                    "token {t} is outside the vocabulary of {}",
                    self.d.vocab
                )));
            }
        }
        Ok(())
    }

    /// Prefill `tokens` into `slot`; `rows`: 0 no logits, 1 last row, 2 every row.
    fn prefill_inner(&mut self, slot: usize, tokens: &[u32], rows: u8) -> Result<(), EngineError> {
        let n = tokens.len();
        if n == 0 || n > self.info.ubatch {
            return Err(EngineError::Request(format!(
                "prefill of {n} tokens: give 1..={} (the plan's ubatch) per call",
                self.info.ubatch
            )));
        }
        self.check_request(slot, n)?;
        self.check_tokens(tokens.iter().copied())?;
        self.all_rows.clear();
        let m = self.max_tok;
        for (ci, chunk) in tokens.chunks(m).enumerate() {
            let base = self.lens[slot] as usize;
            let c = chunk.len();
            for (i, &t) in chunk.iter().enumerate() {
                self.host_in[i] = t as i32;
                self.host_in[m + i] = (base + i) as i32;
                self.host_in[2 * m + i] = slot as i32;
            }
            self.upload_inputs(c).map_err(internal)?;
            let last_chunk = (ci + 1) * m >= n;
            match rows {
                2 => {
                    self.forward(c, false, 0, 0).map_err(internal)?;
                    // The head in groups of logit_rows.
                    let mut r0 = 0;
                    while r0 < c {
                        let nr = (c - r0).min(self.logit_rows);
                        self.forward_head_only(r0, nr).map_err(internal)?;
                        self.logits_back(nr).map_err(internal)?;
                        self.all_rows
                            .extend_from_slice(&self.logits[..nr * self.d.vocab]);
                        r0 += nr;
                    }
                }
                1 if last_chunk => {
                    self.forward(c, false, c - 1, 1).map_err(internal)?;
                    self.logits_back(1).map_err(internal)?;
                }
                _ => {
                    self.forward(c, false, 0, 0).map_err(internal)?;
                    self.sync_all().map_err(internal)?;
                }
            }
            self.prof_collect(false).map_err(internal)?;
            self.lens[slot] += c as u64;
        }
        Ok(())
    }

    fn forward_head_only(&self, first: usize, rows: usize) -> Result<(), CudaEngineError> {
        let d = self.d;
        let st = self.stages.last().ok_or_else(|| plan_err("no stages"))?;
        let k = self.kern(st, false);
        let head = st
            .head
            .ok_or_else(|| plan_err("the last stage holds no head"))?;
        let x = st.bufs.x.ptr + (first * d.e * 4) as u64;
        k.rmsnorm(x, 0, 0, st.out_norm, st.bufs.xn.ptr, d.e, d.eps, rows)?;
        k.mv_chunks(
            head,
            st.bufs.xn.ptr,
            0,
            d.eps,
            st.bufs.logits.ptr,
            rows,
            false,
        )
    }

    /// One decode step; the logits come back to the host when `logits_back`, else they stay
    /// on the device (for [`Self::greedy_back`]).
    fn decode_inner(
        &mut self,
        batch: &[(usize, u32)],
        logits_back: bool,
    ) -> Result<(), EngineError> {
        let n = batch.len();
        if n == 0 || n > self.info.n_slots {
            return Err(EngineError::Request(format!(
                "a decode step takes 1..={} slots, got {n}",
                self.info.n_slots
            )));
        }
        for (i, &(slot, _)) in batch.iter().enumerate() {
            self.check_request(slot, 1)?;
            if batch[..i].iter().any(|(s, _)| *s == slot) {
                return Err(EngineError::Request(format!(
                    "slot {slot} appears twice in one decode step"
                )));
            }
        }
        self.check_tokens(batch.iter().map(|(_, t)| *t))?;
        let m = self.max_tok;
        for (i, &(slot, t)) in batch.iter().enumerate() {
            self.host_in[i] = t as i32;
            self.host_in[m + i] = self.lens[slot] as i32;
            self.host_in[2 * m + i] = slot as i32;
        }
        self.upload_inputs(n).map_err(internal)?;
        if self.use_graphs {
            if !self.graphs.contains_key(&n) {
                let g = match self.capture(n) {
                    Ok(g) => g,
                    Err(e) if self.pdl => {
                        eprintln!(
                            "warning: capturing a decode step with programmatic dependent \
                             launch failed ({e}); capturing it without (as --no-pdl would)"
                        );
                        self.pdl = false;
                        self.capture(n).map_err(internal)?
                    }
                    Err(e) => return Err(internal(e)),
                };
                self.graphs.insert(n, g);
            }
            let graphs = &self.graphs[&n];
            for (si, g) in graphs.iter().enumerate() {
                // One graph for the whole step, or one per stage with the hand-offs between.
                if si > 0 {
                    self.handoff(si, n).map_err(internal)?;
                }
                g.0.launch()
                    .map_err(drv("cuGraphLaunch"))
                    .map_err(|e| internal(e.into()))?;
            }
        } else {
            self.forward(n, true, 0, n).map_err(internal)?;
        }
        self.prof_collect(true).map_err(internal)?;
        if logits_back {
            self.logits_back(n).map_err(internal)?;
        }
        for &(slot, _) in batch {
            self.lens[slot] += 1;
        }
        self.steps += 1;
        Ok(())
    }

    /// Capture a decode step of `n` slots: the whole step when every stage shares one device
    /// object (hand-offs included), else one graph per stage on its own stream (the
    /// hand-offs, ordered by events across streams, run between the replays).
    fn capture(&self, n: usize) -> Result<Vec<Graph>, CudaEngineError> {
        let one = |stream: &std::sync::Arc<cudarc::driver::CudaStream>,
                   run: &dyn Fn() -> Result<(), CudaEngineError>|
         -> Result<Graph, CudaEngineError> {
            use cudarc::driver::sys;
            stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(drv("cuStreamBeginCapture"))?;
            let r = run();
            let g = stream
                .end_capture(sys::CUgraphInstantiate_flags_enum(0))
                .map_err(drv("cuStreamEndCapture"));
            r?;
            Ok(Graph(g?.ok_or_else(|| {
                plan_err("CUDA graph capture produced no graph")
            })?))
        };
        if self.devs.len() == 1 {
            return Ok(vec![one(self.devs[0].stream(), &|| {
                self.forward(n, true, 0, n)
            })?]);
        }
        (0..self.stages.len())
            .map(|si| {
                let stream = self.dev(&self.stages[si]).stream();
                one(stream, &|| self.stage_pass(si, n, true, 0, n))
            })
            .collect()
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        if self.prof.is_none() {
            return;
        }
        let tot = self.prof_totals.borrow();
        for decode in [false, true] {
            let all: f64 = tot
                .iter()
                .filter(|((dd, _), _)| *dd == decode)
                .map(|(_, v)| v.1)
                .sum();
            eprintln!(
                "STRATA_PROFILE {}: {:.3} ms in kernels",
                if decode { "decode" } else { "prefill" },
                all
            );
            let mut rows: Vec<_> = tot.iter().filter(|((dd, _), _)| *dd == decode).collect();
            rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
            for ((_, name), (count, ms)) in rows {
                eprintln!(
                    "  {name:<24} {count:>8} launches {ms:>10.3} ms {:>6.1}% {:>8.2} us/launch",
                    100.0 * ms / all.max(1e-12),
                    1000.0 * ms / *count as f64
                );
            }
        }
    }
}

/// A captured decode step.
struct Graph(CudaGraph);

// SAFETY: a graph is only launched by the engine's owner, one call at a time (`&mut self`);
// moving the engine to another thread moves its graphs with it, and cudarc binds the context
// to the calling thread before each launch.
unsafe impl Send for Graph {}

fn internal(e: CudaEngineError) -> EngineError {
    EngineError::Internal(e.to_string())
}

impl Engine for CudaEngine {
    fn info(&self) -> &EngineInfo {
        &self.info
    }

    fn prefill(
        &mut self,
        slot: usize,
        tokens: &[u32],
        want_logits: bool,
    ) -> Result<Option<&[f32]>, EngineError> {
        self.prefill_inner(slot, tokens, want_logits as u8)?;
        Ok(want_logits.then(|| &self.logits[..self.d.vocab]))
    }

    fn decode(&mut self, batch: &[(usize, u32)]) -> Result<&[f32], EngineError> {
        self.decode_inner(batch, true)?;
        Ok(&self.logits[..batch.len() * self.d.vocab])
    }

    /// The tokens picked on the device (`dq_argmax_rows` over the last stage's logits): only
    /// one u32 per slot comes back instead of a row of logits. With STRATA_HOST_GREEDY set,
    /// the logits come back and the host picks (for comparison).
    fn decode_greedy(
        &mut self,
        batch: &[(usize, u32)],
        out: &mut [u32],
    ) -> Result<(), EngineError> {
        crate::engine::check_greedy_args(batch.len(), out.len())?;
        let n = batch.len();
        if std::env::var_os("STRATA_HOST_GREEDY").is_some() {
            // For comparison: the logits back and the argmax on the host, as the trait's
            // default does.
            self.decode_inner(batch, true)?;
            crate::sampler::argmax_rows(&self.logits, self.d.vocab, &mut out[..n]);
            return Ok(());
        }
        self.decode_inner(batch, false)?;
        self.greedy_back(&mut out[..batch.len()]).map_err(internal)
    }

    /// Drawn on the device (`sample_rows` over the last stage's logits) unless every draw is
    /// greedy (then `dq_argmax_rows`, as [`Engine::decode_greedy`]); `STRATA_HOST_SAMPLE=1`
    /// brings the logits back and samples on the host, for comparison.
    fn decode_sample(
        &mut self,
        batch: &[(usize, u32)],
        draws: &[Draw],
        out: &mut [u32],
    ) -> Result<(), EngineError> {
        crate::engine::check_sample_args(batch.len(), draws.len(), out.len())?;
        let n = batch.len();
        if draws[..n].iter().all(|d| d.is_greedy()) {
            return self.decode_greedy(batch, out);
        }
        if std::env::var_os("STRATA_HOST_SAMPLE").is_some() || self.d.vocab > SAMPLE_MAX_VOCAB {
            self.decode_inner(batch, true)?;
            crate::sampler::sample_rows(&self.logits, self.d.vocab, &draws[..n], &mut out[..n]);
            return Ok(());
        }
        self.decode_inner(batch, false)?;
        self.sample_back(&draws[..n], &mut out[..n])
            .map_err(internal)
    }

    fn reset_slot(&mut self, slot: usize) {
        if let Some(l) = self.lens.get_mut(slot) {
            *l = 0;
        }
    }

    fn slot_len(&self, slot: usize) -> u64 {
        self.lens.get(slot).copied().unwrap_or(0)
    }

    fn stats(&self) -> EngineStats {
        EngineStats {
            expert_hits: 0,
            expert_misses: 0,
            kv_cells_in_use: self.lens.clone(),
        }
    }

    fn prefill_all(&mut self, slot: usize, tokens: &[u32]) -> Result<&[f32], EngineError> {
        self.prefill_inner(slot, tokens, 2)?;
        Ok(&self.all_rows)
    }

    fn allocations(&self) -> u64 {
        self.arenas.len() as u64
    }

    fn allocated_bytes(&self) -> u64 {
        self.arenas.iter().map(|a| a.size()).sum()
    }
}

impl CudaDevice {
    pub(crate) fn ctx_bind(&self) -> Result<(), CudaError> {
        self.stream()
            .context()
            .bind_to_thread()
            .map_err(drv("cuCtxSetCurrent"))
    }
}

/// Arena bytes per GPU, in order of first use: (index into `devs` of a device object on that
/// GPU, the bytes of every arena on it). `arenas`: (index into `devs`, bytes) per arena.
fn bytes_per_gpu(
    devs: &[CudaDevice],
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

fn mem_info(dev: &CudaDevice) -> Result<(u64, u64), CudaError> {
    dev.ctx_bind()?;
    let (free, total) = cudarc::driver::result::mem_get_info().map_err(drv("cuMemGetInfo"))?;
    Ok((free as u64, total as u64))
}

/// Shape of a tensor as (matrices, rows, cols) from its GGUF dims.
fn shape3(dims: &[u64]) -> (usize, usize, usize) {
    let cols = dims.first().copied().unwrap_or(1) as usize;
    let rows = dims.get(1).copied().unwrap_or(1) as usize;
    let mats = dims.iter().skip(2).product::<u64>().max(1) as usize;
    (mats, rows, cols)
}

/// Copy every device-placed tensor and every resident expert to its planned place (arena i
/// on `devs[i]`).
fn upload_weights(
    plan: &Plan,
    devs: &[&CudaDevice],
    arenas: &[DeviceArena],
    host: &dyn HostModel,
    progress: bool,
) -> Result<(), CudaEngineError> {
    let inv = host.inventory();
    let total: u64 = plan
        .tensors
        .iter()
        .filter(|t| matches!(t.placement, Placement::Device { .. }))
        .map(|t| t.bytes)
        .sum::<u64>()
        + plan
            .devices
            .iter()
            .map(|d| d.resident_experts.len() as u64 * d.expert_slot_bytes)
            .sum::<u64>();
    let bar = if progress && std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        let b = indicatif::ProgressBar::new(total);
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "loading to GPU {bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        ) {
            b.set_style(style);
        }
        b
    } else {
        indicatif::ProgressBar::hidden()
    };
    let arena_of = |dev_index: u32| -> Result<usize, CudaEngineError> {
        plan.devices
            .iter()
            .position(|d| d.index == dev_index)
            .ok_or_else(|| {
                plan_err(format!(
                    "a tensor is placed on device {dev_index}, which the plan does not list"
                ))
            })
    };
    let mut tmp: Vec<u8> = Vec::new();
    let mut put = |ai: usize,
                   offset: u64,
                   ty: GgmlType,
                   src: &[u8],
                   mats,
                   rows,
                   cols|
     -> Result<(), CudaEngineError> {
        tmp.resize(src.len(), 0);
        layout::to_device(ty, src, mats, rows, cols, &mut tmp)
            .map_err(|e| CudaEngineError::Model(e.to_string()))?;
        let view = arenas[ai].view(offset, src.len() as u64)?;
        devs[ai].htod(&tmp[..], view)?;
        Ok(())
    };
    for t in &plan.tensors {
        let Placement::Device { device, offset } = t.placement else {
            continue;
        };
        let info = inv
            .tensor(&t.name)
            .ok_or_else(|| plan_err(format!("`{}` is not in the model inventory", t.name)))?;
        let data = host
            .tensor_bytes(&t.name)
            .ok_or_else(|| load::LoadError::Missing {
                name: t.name.clone(),
                path: host.path().display().to_string(),
            })?;
        let (mats, rows, cols) = shape3(&info.dims);
        put(
            arena_of(device)?,
            offset,
            info.ggml_type,
            data,
            mats,
            rows,
            cols,
        )?;
        bar.inc(t.bytes);
    }
    // Resident experts: slot = gate, up, down matrices back to back.
    for (ai, dp) in plan.devices.iter().enumerate() {
        let Some(region) = dp.region(RegionKind::ExpertCache) else {
            continue;
        };
        for re in &dp.resident_experts {
            let mut off = region.offset + re.slot as u64 * dp.expert_slot_bytes;
            for p in ["gate", "up", "down"] {
                let name = format!("blk.{}.ffn_{p}_exps.weight", re.layer);
                let info = inv
                    .tensor(&name)
                    .ok_or_else(|| plan_err(format!("`{name}` is not in the model inventory")))?;
                let data = host
                    .tensor_bytes(&name)
                    .ok_or_else(|| load::LoadError::Missing {
                        name: name.clone(),
                        path: host.path().display().to_string(),
                    })?;
                let (mats, rows, cols) = shape3(&info.dims);
                let per = data.len() / mats.max(1);
                let e = re.expert as usize;
                if e >= mats {
                    return Err(plan_err(format!(
                        "resident expert {e} of layer {} is beyond `{name}`'s {mats} experts",
                        re.layer
                    )));
                }
                put(
                    ai,
                    off,
                    info.ggml_type,
                    &data[e * per..(e + 1) * per],
                    1,
                    rows,
                    cols,
                )?;
                off += per as u64;
            }
            bar.inc(dp.expert_slot_bytes);
        }
    }
    bar.finish_and_clear();
    Ok(())
}

/// Hands out 256-aligned pieces of a device's scratch region.
struct Carver {
    base: CUdeviceptr,
    cur: u64,
    end: u64,
    device: u32,
}

impl Carver {
    fn carve(&mut self, bytes: u64) -> Result<Buf, CudaEngineError> {
        let b = align(bytes, CARVE_ALIGN);
        if self.cur + b > self.end {
            return Err(plan_err(format!(
                "device {}: the scratch region ends at {} but the CUDA engine's buffers need {} more bytes at {}",
                self.device, self.end, b, self.cur
            )));
        }
        let buf = Buf {
            ptr: self.base + self.cur,
            bytes,
        };
        self.cur += b;
        Ok(buf)
    }
}

/// Whether `dq_attn_fused` can serve these stages: F16 KV, head dims a multiple of 8 up to
/// 128, query groups dividing 128 up to 16, every KV row, slot and layer offset 16-byte
/// aligned (its 16-byte loads), and counters for every token and KV head after the router's.
fn attn_fusable(d: &Dims, kv_ty: i32, kv_row_bytes: u64, max_tok: usize, stages: &[Stage]) -> bool {
    let g = d.n_head / d.n_head_kv.max(1);
    let shape = Some(kv_ty) == kty(GgmlType::F16)
        && d.hd % 8 == 0
        && d.hd <= 128
        && d.n_rot % 2 == 0
        && d.n_rot <= d.hd
        && d.n_head % d.n_head_kv.max(1) == 0
        && (1..=16).contains(&g)
        && 128 % g == 0;
    let a16 = |v: u64| v % 16 == 0;
    shape
        && a16(kv_row_bytes)
        && stages.iter().all(|st| {
            a16(st.kv)
                && a16(st.kv_slot_bytes)
                && st.bufs.counters.bytes >= (4 * max_tok * (1 + d.n_head_kv)) as u64
                && st.layers.iter().all(|l| a16(l.k_off) && a16(l.v_off))
        })
}

struct StageSizes {
    gemm: bool,
    max_tok: usize,
    logit_rows: usize,
    att_splits: usize,
    n_slots: usize,
    ctx: usize,
    kv_row_bytes: u64,
}

#[allow(clippy::too_many_arguments)]
fn build_stage(
    plan: &Plan,
    dev: &CudaDevice,
    arena: &DeviceArena,
    arena_index: usize,
    host: &dyn HostModel,
    d: &Dims,
    rope: &Rope,
    sz: StageSizes,
) -> Result<Stage, CudaEngineError> {
    let dp = &plan.devices[arena_index];
    let inv = host.inventory();
    let base = arena.all().ptr();
    let placed: HashMap<&str, u64> = plan
        .tensors
        .iter()
        .filter_map(|t| match t.placement {
            Placement::Device { device, offset } if device == dp.index => {
                Some((t.name.as_str(), offset))
            }
            _ => None,
        })
        .collect();
    let mat = |name: &str, rows: usize, cols: usize| -> Result<Mat, CudaEngineError> {
        let off = *placed
            .get(name)
            .ok_or_else(|| plan_err(format!("`{name}` is not placed on device {}", dp.index)))?;
        let info = inv
            .tensor(name)
            .ok_or_else(|| plan_err(format!("`{name}` is not in the model inventory")))?;
        let ty = kty(info.ggml_type).ok_or_else(|| {
            CudaEngineError::Model(format!(
                "`{name}` is {}, which the CUDA kernels do not read (F32, F16, BF16, Q8_0, Q4_K)",
                info.ggml_type
            ))
        })?;
        let (m, r, c) = shape3(&info.dims);
        if m != 1 || r != rows || c != cols {
            return Err(CudaEngineError::Model(format!(
                "`{name}` has dims {:?}, expected [{cols}, {rows}]",
                info.dims
            )));
        }
        let ptr = base + off;
        if ptr % 16 != 0 {
            return Err(plan_err(format!(
                "`{name}` at offset {off} is not 16-byte aligned"
            )));
        }
        Ok(Mat {
            ptr,
            gty: info.ggml_type,
            ty,
            rows: rows as i32,
            cols: cols as i32,
        })
    };

    // Carve the scratch region.
    let sr = dp
        .region(RegionKind::Scratch)
        .ok_or_else(|| plan_err(format!("device {} has no scratch region", dp.index)))?;
    let mut cv = Carver {
        base,
        cur: sr.offset,
        end: sr.offset + sr.bytes,
        device: dp.index,
    };
    // Norm vectors as f32.
    let vec_f32 = |cv: &mut Carver, name: &str, n: usize| -> Result<CUdeviceptr, CudaEngineError> {
        let data = host
            .tensor_bytes(name)
            .ok_or_else(|| plan_err(format!("`{name}` is missing from the model")))?;
        let ty = inv
            .tensor(name)
            .map(|t| t.ggml_type)
            .ok_or_else(|| plan_err(format!("`{name}` is not in the model inventory")))?;
        if ty == GgmlType::F32 && data.len() == n * 4 {
            if let Some(off) = placed.get(name).filter(|o| (base + **o) % 16 == 0) {
                return Ok(base + off);
            }
        }
        let mut v = vec![0f32; n];
        crate::quant::dequantize_row(ty, data, &mut v)
            .map_err(|e| CudaEngineError::Model(format!("`{name}`: {e}")))?;
        let buf = cv.carve((n * 4) as u64)?;
        dev.htod(&v, arena.view(buf.ptr - base, (n * 4) as u64)?)?;
        Ok(buf.ptr)
    };

    let out_norm = if dp.holds_head {
        vec_f32(&mut cv, "output_norm.weight", d.e)?
    } else {
        0
    };
    let mut layers = Vec::new();
    let n_layer = (dp.layer_end - dp.layer_first) as usize;
    let slot_bytes = 2 * sz.ctx as u64 * sz.kv_row_bytes * n_layer as u64;
    let ec = dp.region(RegionKind::ExpertCache);
    let mut slot_of: HashMap<(u32, u32), u32> = HashMap::new();
    for re in &dp.resident_experts {
        slot_of.insert((re.layer, re.expert), re.slot);
    }
    for (li, l) in (dp.layer_first..dp.layer_end).enumerate() {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        let q_out = d.n_head * d.hd;
        let kv_out = d.n_head_kv * d.hd;
        // Expert table: resident slots, or the stacks when placed whole on the device.
        let gate_name = n("ffn_gate_exps");
        let gi = inv
            .tensor(&gate_name)
            .ok_or_else(|| plan_err(format!("`{gate_name}` is not in the model inventory")))?;
        let ety = gi.ggml_type;
        let exp_ty = kty(ety).ok_or_else(|| {
            CudaEngineError::Model(format!(
                "`{gate_name}` is {ety}, which the CUDA kernels do not read"
            ))
        })?;
        let per_gu = mat_bytes(ety, d.f, d.e)?;
        let per_down = mat_bytes(
            inv.tensor(&n("ffn_down_exps"))
                .map(|t| t.ggml_type)
                .unwrap_or(ety),
            d.e,
            d.f,
        )?;
        let mut table = vec![0u64; d.n_expert * 3];
        let stacks = [n("ffn_gate_exps"), n("ffn_up_exps"), n("ffn_down_exps")];
        let whole = stacks.iter().all(|s| placed.contains_key(s.as_str()));
        for e in 0..d.n_expert {
            if whole {
                table[3 * e] = base + placed[stacks[0].as_str()] + e as u64 * per_gu;
                table[3 * e + 1] = base + placed[stacks[1].as_str()] + e as u64 * per_gu;
                table[3 * e + 2] = base + placed[stacks[2].as_str()] + e as u64 * per_down;
            } else {
                let (Some(s), Some(r)) = (slot_of.get(&(l, e as u32)), ec) else {
                    return Err(plan_err(format!(
                        "expert {e} of layer {l} is not resident on device {}: the CUDA engine in this build needs every expert in VRAM (the host-expert cache path runs with --backend cpu); re-plan with more VRAM or fewer layers per device",
                        dp.index
                    )));
                };
                let so = base + r.offset + *s as u64 * dp.expert_slot_bytes;
                table[3 * e] = so;
                table[3 * e + 1] = so + per_gu;
                table[3 * e + 2] = so + 2 * per_gu;
            }
        }
        let stacks = {
            let gs = table[3].wrapping_sub(table[0]);
            let ds = table[5].wrapping_sub(table[2]);
            let uniform = (0..d.n_expert).all(|e| {
                table[3 * e] == table[0] + e as u64 * gs
                    && table[3 * e + 1] == table[1] + e as u64 * gs
                    && table[3 * e + 2] == table[2] + e as u64 * ds
            });
            // The grouped products read gate, up and down with one kernel type.
            let same_ty = ["ffn_up_exps", "ffn_down_exps"]
                .iter()
                .all(|s| inv.tensor(&n(s)).map_or(ety, |t| t.ggml_type) == ety);
            (d.n_expert > 1 && uniform && gs % 16 == 0 && ds % 16 == 0 && same_ty).then_some(
                Stacks {
                    gate: table[0],
                    up: table[1],
                    down: table[2],
                    gu_stride: gs,
                    down_stride: ds,
                    ty: ety,
                },
            )
        };
        let tb = cv.carve((table.len() * 8) as u64)?;
        dev.htod(&table, arena.view(tb.ptr - base, tb.bytes)?)?;
        layers.push(Layer {
            attn_norm: vec_f32(&mut cv, &n("attn_norm"), d.e)?,
            q: mat(&n("attn_q"), q_out, d.e)?,
            k: mat(&n("attn_k"), kv_out, d.e)?,
            v: mat(&n("attn_v"), kv_out, d.e)?,
            o: mat(&n("attn_output"), d.e, q_out)?,
            q_norm: vec_f32(&mut cv, &n("attn_q_norm"), d.hd)?,
            k_norm: vec_f32(&mut cv, &n("attn_k_norm"), d.hd)?,
            ffn_norm: vec_f32(&mut cv, &n("ffn_norm"), d.e)?,
            gate_inp: mat(&n("ffn_gate_inp"), d.n_expert, d.e)?,
            experts: tb.ptr,
            exp_ty,
            k_off: 2 * li as u64 * sz.ctx as u64 * sz.kv_row_bytes,
            v_off: (2 * li as u64 + 1) * sz.ctx as u64 * sz.kv_row_bytes,
            stacks,
        });
    }
    let lay = workset::buffers(
        &d.work(),
        &Pass {
            tokens: sz.max_tok,
            logit_rows: sz.logit_rows,
            att_splits: sz.att_splits,
            slots: sz.n_slots,
            gemm: sz.gemm,
        },
    );
    let mut bufs = Bufs::default();
    for (name, bytes) in lay {
        let b = cv.carve(bytes)?;
        match name {
            "inputs" => bufs.inputs = b,
            "n_ctx" => bufs.n_ctx = b,
            "x" => bufs.x = b,
            "q" => bufs.q = b,
            "k" => bufs.k = b,
            "v" => bufs.v = b,
            "att" => bufs.att = b,
            "part_o" => bufs.part_o = b,
            "part_ms" => bufs.part_ms = b,
            "router" => bufs.router = b,
            "ids" => bufs.ids = b,
            "wts" => bufs.wts = b,
            "h" => bufs.h = b,
            "logits" => bufs.logits = b,
            "inv_freq" => bufs.inv_freq = b,
            "counters" => bufs.counters = b,
            "argmax" => bufs.argmax = b,
            "draws" => bufs.draws = b,
            "xn" => bufs.xn = b,
            "xh" => bufs.xh = b,
            "tmp" => bufs.tmp = b,
            "yd" => bufs.yd = b,
            "sorted" => bufs.sorted = b,
            _ => unreachable!("every buffer of workset::buffers is named here"),
        }
    }
    if d.n_head * d.hd >= d.e {
        bufs.xn = bufs.att;
    }
    for zeroed in [bufs.counters, bufs.argmax] {
        dev.memset(arena.view(zeroed.ptr - base, zeroed.bytes)?, 0)?;
    }
    let inv_freq = rope.inv_freq();
    dev.htod(
        inv_freq,
        arena.view(bufs.inv_freq.ptr - base, (inv_freq.len() * 4) as u64)?,
    )?;
    // KV.
    let kvr = dp
        .region(RegionKind::KvCache)
        .ok_or_else(|| plan_err(format!("device {} has no kv_cache region", dp.index)))?;
    if kvr.bytes < slot_bytes * sz.n_slots as u64 {
        return Err(plan_err(format!(
            "device {}: kv_cache holds {} bytes but {} slots x {} layers x {} cells need {}",
            dp.index,
            kvr.bytes,
            sz.n_slots,
            n_layer,
            sz.ctx,
            slot_bytes * sz.n_slots as u64
        )));
    }
    Ok(Stage {
        arena: arena_index,
        dev: 0,
        layers,
        embd: if dp.holds_embedding {
            Some(mat("token_embd.weight", d.vocab, d.e)?)
        } else {
            None
        },
        out_norm,
        head: if dp.holds_head {
            let name = if placed.contains_key("output.weight") {
                "output.weight"
            } else {
                "token_embd.weight"
            };
            Some(mat(name, d.vocab, d.e)?)
        } else {
            None
        },
        bufs,
        kv: base + kvr.offset,
        kv_slot_bytes: slot_bytes,
    })
}

/// Launch kernel `$name` with `$cfg` and the argument references in order (profiled under
/// `$label`, default the kernel's name).
macro_rules! launch {
    ($k:expr, $name:expr, $cfg:expr; $($arg:expr),* $(,)?) => {
        launch!($k, $name => $name, $cfg; $($arg),*)
    };
    ($k:expr, $name:expr => $label:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        let f = $k.dev.function($name)?;
        let e0 = $k.prof_start()?;
        if $k.pdl && strata_kernels::pdl_aware($name) {
            let mut params = [$( $arg as *const _ as *mut std::ffi::c_void ),*];
            // SAFETY: as below for the arguments (each entry points at a live argument value
            // of the kernel's parameter type); the kernel is PDL-aware (`strata_kernels::pdl_aware`), so it
            // touches nothing but weights before waiting for the kernel ahead.
            unsafe { launch_pdl($k.dev, f, $cfg, &mut params) }
                .map_err(drv(format!("cuLaunchKernelEx {}", $name)))?;
        } else {
            let mut b = $k.dev.stream().launch_builder(f);
            $( b.arg($arg); )*
            // SAFETY: every pointer argument addresses a buffer carved (or a tensor placed) in
            // a live arena with the sizes the kernel reads for these shapes (checked at
            // start-up: buffers sized for max_tok tokens, tensors' dims checked in
            // `build_stage`).
            unsafe { b.launch($cfg) }.map_err(drv(format!("launch {}", $name)))?;
        }
        if let (Some(p), Some(e0)) = ($k.prof, e0) {
            let e1 = $k.dev.record_event()?;
            p.borrow_mut().push(($label, e0, e1));
        }
        Ok::<(), CudaEngineError>(())
    }};
}

/// Launch `f` on `dev`'s stream with programmatic stream serialisation allowed: the driver
/// may start it while the kernel ahead is finishing (Hopper's programmatic dependent launch;
/// inside a graph capture this becomes a programmatic edge).
///
/// # Safety
/// `params` must hold one pointer per kernel parameter, each to a live value of that
/// parameter's type, and the kernel must be PDL-aware (`strata_kernels::pdl_aware`).
unsafe fn launch_pdl(
    dev: &CudaDevice,
    f: &cudarc::driver::CudaFunction,
    c: LaunchConfig,
    params: &mut [*mut std::ffi::c_void],
) -> Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys;
    dev.stream().context().bind_to_thread()?;
    // SAFETY: an all-zero launch attribute is a valid value of this plain C union.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let lc = sys::CUlaunchConfig {
        gridDimX: c.grid_dim.0,
        gridDimY: c.grid_dim.1,
        gridDimZ: c.grid_dim.2,
        blockDimX: c.block_dim.0,
        blockDimY: c.block_dim.1,
        blockDimZ: c.block_dim.2,
        sharedMemBytes: c.shared_mem_bytes,
        hStream: dev.stream().cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: the config lives across the call; `params` as the caller guarantees.
    unsafe {
        sys::cuLaunchKernelEx(
            &lc,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}

/// Kernel launchers over raw device addresses whose buffers were sized at start-up.
struct Kern<'a> {
    dev: &'a CudaDevice,
    /// Launch the PDL-aware kernels with programmatic dependent launch.
    pdl: bool,
    /// When profiling: every launch's name with events recorded around it.
    prof: Option<&'a Prof>,
    /// The products that stage their one-token Q8_0 input in shared memory
    /// ([`DecodeFuse::xs`]).
    xs: u8,
}

/// Launch count and milliseconds per (decode?, kernel name).
type ProfTotals = std::collections::BTreeMap<(bool, &'static str), (u64, f64)>;

/// Events around each launch of a profiled step.
type Prof = std::cell::RefCell<
    Vec<(
        &'static str,
        cudarc::driver::CudaEvent,
        cudarc::driver::CudaEvent,
    )>,
>;

impl Kern<'_> {
    /// When profiling: a 40 us spin kernel, then the start event. The spin keeps the GPU busy
    /// while the host queues the kernel and its end event, so the pair times the kernel alone
    /// and not the host's launch latency (which CUDA graphs hide in real decode steps).
    fn prof_start(&self) -> Result<Option<cudarc::driver::CudaEvent>, CudaEngineError> {
        if self.prof.is_none() {
            return Ok(None);
        }
        let f = self.dev.function("dq_spin")?;
        let ns = 40_000i64;
        let mut b = self.dev.stream().launch_builder(f);
        b.arg(&ns);
        // SAFETY: dq_spin takes one integer and touches no memory.
        unsafe { b.launch(cfg((1, 1, 1), 1, 0)) }.map_err(drv("launch dq_spin"))?;
        Ok(Some(self.dev.record_event()?))
    }

    /// Run `f` (which queues work on the stream) between two recorded events when profiling.
    fn timed<T>(
        &self,
        name: &'static str,
        f: impl FnOnce() -> Result<T, CudaError>,
    ) -> Result<T, CudaEngineError> {
        let e0 = self.prof_start()?;
        let r = f()?;
        if let (Some(p), Some(e0)) = (self.prof, e0) {
            let e1 = self.dev.record_event()?;
            p.borrow_mut().push((name, e0, e1));
        }
        Ok(r)
    }
}

fn cfg(grid: (u32, u32, u32), block: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem,
    }
}

const DQ_WARPS: u32 = 4;
/// decode.cu's DQ_XR_COLS: the widest rows of the register path of the one-token products.
const DQ_XR_COLS: usize = 2048;
/// Blocks per SM of the register path (its about 100 registers a thread allow 4 blocks of
/// 128 threads an SM).
const XR_BLOCKS_PER_SM: u32 = 4;
/// Rows per warp below which a one-token product keeps a warp per row (the register path's
/// capped grid measured slower for Q/K/V and the experts, 1-3 rows a warp, on the H200).
const XR_MIN_ROWS: u32 = 8;
/// Largest top-k of `dq_moe_down_rows` (decode.cu's DQ_DOWN_MAXK).
const DQ_DOWN_MAXK: usize = 32;

/// The KV kernels' addressing of layer `l` in stage `st`: bytes per slot, K and V offsets of
/// the layer inside a slot, bytes per cell row (as the kernels' `long`s).
fn kv_geometry(st: &Stage, l: &Layer, row_bytes: u64) -> (i64, i64, i64, i64) {
    (
        st.kv_slot_bytes as i64,
        l.k_off as i64,
        l.v_off as i64,
        row_bytes as i64,
    )
}
/// Prefill passes of at least this many tokens use the tensor-core products.
const GEMM_MIN_TOK: usize = 16;
/// The largest vocabulary `sample_rows` takes (sample.cu's SP_MAX_VOCAB: its histogram
/// parts count in u32); larger ones sample on the host.
const SAMPLE_MAX_VOCAB: usize = 1 << 19;
/// `sample_rows`' blocks per row when a draw has top-k or top-p cuts (without cuts it takes
/// `workset::ARGMAX_BLOCKS`, the most the scratch holds).
const SAMPLE_BLOCKS_CUTS: u32 = 16;

impl Kern<'_> {
    /// `dq_argmax_rows` over `rows` rows of `cols` logits at `x`, `nb` blocks a row; `scratch`:
    /// the pairs' values and indices, the row counters and the chosen tokens.
    fn argmax_rows(
        &self,
        x: u64,
        cols: usize,
        rows: usize,
        nb: u32,
        scratch: [u64; 4],
    ) -> Result<(), CudaEngineError> {
        let [part_v, part_i, cnt, ids] = scratch;
        let cols = cols as i32;
        launch!(self, "dq_argmax_rows", cfg((nb, rows as u32, 1), 256, 0); &x, &cols, &part_v, &part_i, &cnt, &ids)
    }

    /// sample.cu's `sample_rows`: `nb` blocks of 1024 threads per row of `cols` logits;
    /// scratch as `argmax_rows`'s (part_v, part_i: rows x nb; counters; tokens).
    fn sample_rows(
        &self,
        x: u64,
        cols: usize,
        rows: usize,
        nb: u32,
        draws: u64,
        scratch: [u64; 4],
    ) -> Result<(), CudaEngineError> {
        let [part_v, part_i, cnt, out] = scratch;
        let cols = cols as i32;
        launch!(self, "sample_rows", cfg((nb, rows as u32, 1), 1024, 0); &x, &cols, &draws, &part_v, &part_i, &cnt, &out)
    }

    fn get_rows(&self, w: Mat, ids: u64, out: u64, n: usize) -> Result<(), CudaEngineError> {
        let n32 = n as u32;
        launch!(self, "dq_get_rows", cfg((n32, 1, 1), 256, 0); &w.ptr, &w.ty, &w.rows, &w.cols, &ids, &out)
    }

    fn ctx_from_pos(&self, pos: u64, n_ctx: u64, n: usize) -> Result<(), CudaEngineError> {
        let n32 = n as i32;
        launch!(self, "dq_ctx_from_pos", cfg((n.div_ceil(128) as u32, 1, 1), 128, 0); &pos, &n_ctx, &n32)
    }

    #[allow(clippy::too_many_arguments)]
    /// Q, K and V of n tokens (x already normalised) in one launch.
    #[allow(clippy::too_many_arguments)]
    fn qkv(
        &self,
        l: &Layer,
        x: u64,
        yq: u64,
        yk: u64,
        yv: u64,
        n: usize,
    ) -> Result<(), CudaEngineError> {
        let rows = (l.q.rows + l.k.rows + l.v.rows) as u32;
        let (n32, no_norm, eps) = (n as i32, 0u64, 0f32);
        let chunks = n.div_ceil(8) as u32;
        let name = if n == 1 { "dq_qkv1" } else { "dq_qkv8" };
        let smem = self.xs_bytes(XS_QKV, n, l.q.gty, l.q.cols as usize);
        launch!(self, name, cfg((rows.div_ceil(DQ_WARPS), chunks, 1), 32 * DQ_WARPS, smem); &l.q.ptr, &l.k.ptr, &l.v.ptr, &l.q.ty, &l.q.rows, &l.k.rows, &l.v.rows, &l.q.cols, &x, &no_norm, &eps, &yq, &yk, &yv, &n32)
    }

    /// Dynamic shared memory for a product of `n` tokens over rows of `cols` columns: room
    /// to stage the input ([`DecodeFuse::xs`]) for one token of Q8_0 rows (at most 48 KiB,
    /// the limit without opting in), else none.
    fn xs_bytes(&self, which: u8, n: usize, ty: GgmlType, cols: usize) -> u32 {
        if self.xs & which != 0
            && n == 1
            && ty == GgmlType::Q8_0
            && cols % 4 == 0
            && cols * 4 <= 48 << 10
        {
            (cols * 4) as u32
        } else {
            0
        }
    }

    /// Blocks of a one-token product (`dq_mv1`) over `rows` rows: decode.cu's register path
    /// (Q8_0 rows of at most DQ_XR_COLS columns) lets each warp walk several rows, reading
    /// the input once, so where that gives every warp at least XR_MIN_ROWS rows (the LM
    /// head) the grid stops at XR_BLOCKS_PER_SM blocks per SM; otherwise a warp per row.
    fn mv1_blocks(&self, rows: usize, cols: usize, q8_0: bool) -> u32 {
        let full = (rows as u32).div_ceil(DQ_WARPS);
        let cap = self.dev.sm_count() as u32 * XR_BLOCKS_PER_SM;
        if q8_0 && cols <= DQ_XR_COLS && full >= cap * XR_MIN_ROWS {
            cap
        } else {
            full
        }
    }

    /// y (+)= W . norm?(x) for n tokens, in launches of at most 8 tokens.
    #[allow(clippy::too_many_arguments)]
    fn mv_chunks(
        &self,
        w: Mat,
        x: u64,
        nw: u64,
        eps: f32,
        y: u64,
        n: usize,
        add: bool,
    ) -> Result<(), CudaEngineError> {
        let label = if add { "mv_o" } else { "mv" };
        self.mv_launch(w, x, nw, eps, y, n, add, 0, label)
    }

    /// Prefill router logits of n tokens from xn (tensor-core path only, where `yd` exists):
    /// a split-K F32 product whose partials go to `yd` (the experts write it only later),
    /// summed in a fixed order; routers stored in other types use the matrix-vector kernels.
    fn router_prefill(
        &self,
        l: &Layer,
        b: &Bufs,
        d: Dims,
        n: usize,
    ) -> Result<(), CudaEngineError> {
        let w = l.gate_inp;
        let (rows, cols) = (w.rows as usize, w.cols as usize);
        if w.gty != GgmlType::F32 || cols % 32 != 0 {
            return self.mv_chunks(w, b.xn.ptr, 0, d.eps, b.router.ptr, n, false);
        }
        // Enough blocks for every SM twice over, k chunks of whole 32-wide tiles, and
        // partials that fit in yd.
        let tiles = n.div_ceil(64) * rows.div_ceil(32);
        let mut splits = 264usize.div_ceil(tiles).clamp(1, 16).min(cols / 32);
        while splits > 1 && (4 * splits * n * rows) as u64 > b.yd.bytes {
            splits /= 2;
        }
        let k_chunk = cols.div_ceil(splits).div_ceil(32) * 32;
        let splits = cols.div_ceil(k_chunk);
        if (4 * splits * n * rows) as u64 > b.yd.bytes {
            return self.mv_chunks(w, b.xn.ptr, 0, d.eps, b.router.ptr, n, false);
        }
        let (n32, kc, ns) = (n as i32, k_chunk as i32, splits as i32);
        let grid = (
            n.div_ceil(64) as u32,
            rows.div_ceil(32) as u32,
            splits as u32,
        );
        launch!(self, "dq_sgemm_split" => "router_sgemm", cfg(grid, 256, 0);
            &w.ptr, &w.rows, &w.cols, &b.xn.ptr, &n32, &kc, &b.yd.ptr)?;
        let total = (n * rows) as i64;
        launch!(self, "dq_split_sum" => "router_sum", cfg(((total as u64).div_ceil(256) as u32, 1, 1), 256, 0);
            &b.yd.ptr, &ns, &total, &b.router.ptr)
    }

    /// The router's logits from the residual stream x: RMSNorm by the layer's ffn_norm in
    /// the product's prologue, which also leaves xn = RMSNorm(x) * ffn_norm for the experts
    /// (one launch instead of a norm and a product).
    /// With `topk` the launch also picks the experts where it can (`dq_router_rows`'s last
    /// block per token); returns whether it did.
    fn router_logits(
        &self,
        l: &Layer,
        b_: &Bufs,
        d: Dims,
        n: usize,
        topk: bool,
    ) -> Result<bool, CudaEngineError> {
        if l.gate_inp.gty == GgmlType::F32 && d.e % 4 == 0 {
            let w = l.gate_inp;
            let fused = topk && d.n_expert <= 32 * 8 && d.k <= 32;
            let cnt = if fused { b_.counters.ptr } else { 0 };
            let (k, norm) = (d.k as i32, d.norm_topk as i32);
            launch!(self, "dq_router_rows" => "router_rows", cfg((w.rows as u32, n as u32, 1), 128, 0); &w.ptr, &w.rows, &w.cols, &b_.x.ptr, &l.ffn_norm, &d.eps, &b_.router.ptr, &b_.xn.ptr, &cnt, &k, &norm, &b_.ids.ptr, &b_.wts.ptr)?;
            return Ok(fused);
        }
        self.mv_launch(
            l.gate_inp,
            b_.x.ptr,
            l.ffn_norm,
            d.eps,
            b_.router.ptr,
            n,
            false,
            b_.xn.ptr,
            "mv_router",
        )?;
        Ok(false)
    }

    #[allow(clippy::too_many_arguments)]
    fn mv_launch(
        &self,
        w: Mat,
        x: u64,
        nw: u64,
        eps: f32,
        y: u64,
        n: usize,
        add: bool,
        xn_out: u64,
        label: &'static str,
    ) -> Result<(), CudaEngineError> {
        let (add, n32) = (add as i32, n as i32);
        let name = if n == 1 { "dq_mv1" } else { "dq_mv8" };
        let chunks = n.div_ceil(8) as u32;
        let blocks = if n == 1 {
            self.mv1_blocks(w.rows as usize, w.cols as usize, w.gty == GgmlType::Q8_0)
        } else {
            (w.rows as u32).div_ceil(DQ_WARPS)
        };
        // Rows of at most DQ_XR_COLS take the register path, which stages nothing.
        let smem = if nw == 0 && w.cols as usize > DQ_XR_COLS {
            self.xs_bytes(XS_OUT, n, w.gty, w.cols as usize)
        } else {
            0
        };
        launch!(self, name => label, cfg((blocks, chunks, 1), 32 * DQ_WARPS, smem);
            &w.ptr, &w.ty, &w.rows, &w.cols, &x, &nw, &eps, &y, &n32, &add, &xn_out)
    }

    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope(
        &self,
        x: u64,
        w: u64,
        pos: u64,
        inv_freq: u64,
        d: Dims,
        heads: usize,
        n: usize,
    ) -> Result<(), CudaEngineError> {
        let (nh, hd, nr) = (heads as i32, d.hd as i32, d.n_rot as i32);
        launch!(self, "qk_norm_rope_f32", cfg((heads as u32, n as u32, 1), 128, 0); &x, &w, &d.eps, &pos, &inv_freq, &d.attn_factor, &nh, &hd, &nr)
    }

    /// QK-norm + RoPE of Q and K and the KV store of K and V: one launch, or three where
    /// q8_0 KV blocks would straddle heads (head dims not a multiple of 32).
    #[allow(clippy::too_many_arguments)]
    fn rope_store(
        &self,
        b_: &Bufs,
        st: &Stage,
        l: &Layer,
        slot: u64,
        pos: u64,
        kv_ty: i32,
        row_bytes: u64,
        d: Dims,
        n: usize,
    ) -> Result<(), CudaEngineError> {
        if Some(kv_ty) == kty(GgmlType::Q8_0) && d.hd % 32 != 0 {
            self.qk_norm_rope(b_.q.ptr, l.q_norm, pos, b_.inv_freq.ptr, d, d.n_head, n)?;
            self.qk_norm_rope(b_.k.ptr, l.k_norm, pos, b_.inv_freq.ptr, d, d.n_head_kv, n)?;
            return self.kv_store(b_, st, l, slot, pos, kv_ty, row_bytes, d, n);
        }
        let (sb, ko, vo, rb) = kv_geometry(st, l, row_bytes);
        let (nh, nkv, hd, nr) = d.heads();
        let blocks = (d.n_head + 2 * d.n_head_kv) as u32;
        launch!(self, "dq_rope_store", cfg((blocks, n as u32, 1), 128, 0); &b_.q.ptr, &b_.k.ptr, &b_.v.ptr, &l.q_norm, &l.k_norm, &d.eps, &pos, &b_.inv_freq.ptr, &d.attn_factor, &nh, &nkv, &hd, &nr, &st.kv, &slot, &sb, &ko, &vo, &rb, &kv_ty)
    }

    #[allow(clippy::too_many_arguments)]
    fn kv_store(
        &self,
        b_: &Bufs,
        st: &Stage,
        l: &Layer,
        slot: u64,
        pos: u64,
        kv_ty: i32,
        row_bytes: u64,
        d: Dims,
        n: usize,
    ) -> Result<(), CudaEngineError> {
        let (sb, ko, vo, rb) = kv_geometry(st, l, row_bytes);
        let width = (d.n_head_kv * d.hd) as i32;
        launch!(self, "dq_kv_store", cfg((n as u32, 1, 1), 128, 0); &b_.k.ptr, &b_.v.ptr, &st.kv, &slot, &pos, &sb, &ko, &vo, &rb, &kv_ty, &width)
    }

    /// Decode attention in one launch (see [`DecodeFuse::attn`]): QK-norm + RoPE, the KV
    /// store, split-KV attention and the merge of the splits into `att`.
    #[allow(clippy::too_many_arguments)]
    fn attn_fused(
        &self,
        b_: &Bufs,
        st: &Stage,
        l: &Layer,
        slot: u64,
        pos: u64,
        row_bytes: u64,
        d: Dims,
        n: usize,
        splits: usize,
        max_tok: usize,
        min_chunk: u32,
    ) -> Result<(), CudaEngineError> {
        let (sb, ko, vo, rb) = kv_geometry(st, l, row_bytes);
        let (nh, nkv, hd, nr) = d.heads();
        let scale = 1.0f32 / (d.hd as f32).sqrt();
        let chunk = min_chunk.clamp(1, 1 << 20) as i32;
        // The attention's counters follow the router's max_tok.
        let cnt = b_.counters.ptr + 4 * max_tok as u64;
        launch!(self, "dq_attn_fused", cfg((d.n_head_kv as u32, splits as u32, n as u32), 128, 0); &b_.q.ptr, &b_.k.ptr, &b_.v.ptr, &l.q_norm, &l.k_norm, &d.eps, &pos, &b_.inv_freq.ptr, &d.attn_factor, &nh, &nkv, &hd, &nr, &st.kv, &slot, &sb, &ko, &vo, &rb, &scale, &chunk, &b_.part_o.ptr, &b_.part_ms.ptr, &cnt, &b_.att.ptr)
    }

    #[allow(clippy::too_many_arguments)]
    fn attn_decode(
        &self,
        b_: &Bufs,
        st: &Stage,
        l: &Layer,
        slot: u64,
        kv_ty: i32,
        row_bytes: u64,
        d: Dims,
        n: usize,
        splits: usize,
    ) -> Result<(), CudaEngineError> {
        let (sb, ko, vo, rb) = kv_geometry(st, l, row_bytes);
        let (nh, nkv, hd, _) = d.heads();
        let scale = 1.0f32 / (d.hd as f32).sqrt();
        let sp = splits as i32;
        launch!(self, "dq_attn_gqa", cfg((d.n_head_kv as u32, splits as u32, n as u32), 128, 0); &b_.q.ptr, &st.kv, &slot, &b_.n_ctx.ptr, &sb, &ko, &vo, &kv_ty, &nh, &nkv, &hd, &rb, &scale, &b_.part_o.ptr, &b_.part_ms.ptr)?;
        launch!(self, "dq_attn_combine", cfg((d.n_head as u32, n as u32, 1), 128, 0); &b_.part_o.ptr, &b_.part_ms.ptr, &b_.n_ctx.ptr, &nh, &hd, &sp, &b_.att.ptr)
    }

    #[allow(clippy::too_many_arguments)]
    fn attn_prefill(
        &self,
        b_: &Bufs,
        st: &Stage,
        l: &Layer,
        slot: u64,
        pos: u64,
        kv_ty: i32,
        row_bytes: u64,
        d: Dims,
        n: usize,
    ) -> Result<(), CudaEngineError> {
        let a = super::flash::PrefillAttn {
            q: b_.q.ptr,
            kv: st.kv,
            slot,
            pos,
            slot_bytes: st.kv_slot_bytes,
            k_off: l.k_off,
            v_off: l.v_off,
            row_bytes,
            kv_ty,
            n_head: d.n_head,
            n_head_kv: d.n_head_kv,
            hd: d.hd,
            scale: 1.0 / (d.hd as f32).sqrt(),
            n_tok: n,
            out: b_.att.ptr,
        };
        // SAFETY: q and att hold max_tok tokens' heads, the slot's layer of KV lies in the
        // stage's region and every position is below the planned context (checked by the
        // callers before the pass).
        self.timed("attn_prefill", || unsafe {
            super::flash::attn_prefill(self.dev, &a)
        })
    }

    /// out = RMSNorm(x (+ res)) * w per row; h_out (if non-zero) gets x + res.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm(
        &self,
        x: u64,
        res: u64,
        h_out: u64,
        w: u64,
        out: u64,
        e: usize,
        eps: f32,
        n: usize,
    ) -> Result<(), CudaEngineError> {
        let e32 = e as i32;
        launch!(self, "rmsnorm_f32", cfg((n as u32, 1, 1), 256, 0); &x, &res, &h_out, &w, &out, &e32, &eps)
    }

    #[allow(clippy::too_many_arguments)]
    fn combine(
        &self,
        y: u64,
        wts: u64,
        k: usize,
        e: usize,
        x: u64,
        n: usize,
    ) -> Result<(), CudaEngineError> {
        let (k32, e32) = (k as i32, e as i32);
        launch!(self, "dq_moe_combine", cfg((n as u32, 1, 1), 256, 0); &y, &wts, &k32, &e32, &x)
    }

    fn router(
        &self,
        logits: u64,
        d: Dims,
        ids: u64,
        wts: u64,
        n: usize,
    ) -> Result<(), CudaEngineError> {
        let (ne, k, norm, nt) = (d.n_expert as i32, d.k as i32, d.norm_topk as i32, n as i32);
        if d.n_expert <= 32 * 8 && d.k <= 32 {
            // One warp per token, no block barriers.
            return launch!(self, "dq_router_topk", cfg((n.div_ceil(4) as u32, 1, 1), 128, 0); &logits, &ne, &k, &norm, &nt, &ids, &wts);
        }
        let smem = (d.n_expert * 4) as u32;
        launch!(self, "router_softmax_topk", cfg((n as u32, 1, 1), 128, smem); &logits, &ne, &k, &norm, &ids, &wts)
    }

    fn moe(&self, l: &Layer, b_: &Bufs, d: Dims, n: usize) -> Result<(), CudaEngineError> {
        let (f, e, k, no_norm) = (d.f as i32, d.e as i32, d.k as i32, 0u64);
        // x is xn, already normalised by the caller.
        let smem = if Some(l.exp_ty) == kty(GgmlType::Q8_0) {
            self.xs_bytes(XS_GATE_UP, 1, GgmlType::Q8_0, d.e)
        } else {
            0
        };
        launch!(self, "dq_moe_gate_up", cfg(((d.f as u32).div_ceil(DQ_WARPS), (n * d.k) as u32, 1), 32 * DQ_WARPS, smem); &l.experts, &l.exp_ty, &f, &e, &b_.ids.ptr, &k, &b_.xn.ptr, &no_norm, &d.eps, &b_.h.ptr)?;
        if Some(l.exp_ty) == kty(GgmlType::Q8_0) && d.k <= DQ_DOWN_MAXK {
            return launch!(self, "dq_moe_down_rows", cfg((d.e as u32, n as u32, 1), 128, 0); &l.experts, &e, &f, &b_.ids.ptr, &b_.wts.ptr, &k, &b_.h.ptr, &b_.x.ptr);
        }
        launch!(self, "dq_moe_down", cfg(((d.e as u32).div_ceil(DQ_WARPS), n as u32, 1), 32 * DQ_WARPS, 0); &l.experts, &l.exp_ty, &e, &f, &b_.ids.ptr, &b_.wts.ptr, &k, &b_.h.ptr, &b_.x.ptr)
    }
}
