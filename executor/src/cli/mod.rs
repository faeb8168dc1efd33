//! What every `strata-exec` command shares: opening the plan and the model it names, picking
//! the backend the plan was made for, starting the engine, and failing with one clear line.
//! Invariant: nothing here allocates an arena before the plan, the model's fingerprint and
//! the machine have all been checked (the engines' `start` does that, in that order).

pub mod bench;
pub mod probe;
pub mod profile;
pub mod run;
pub mod serve;

use std::path::{Path, PathBuf};
use strata_exec::engine::Engine;
use strata_exec::exec::{start_cpu, EngineOptions};
use strata_schemas::plan::Plan;

/// Print `strata-exec: MSG` and exit 1 (bad input or a mismatch).
pub fn fail(msg: impl std::fmt::Display) -> ! {
    eprintln!(
        "strata-exec: {}",
        strata_schemas::text::for_terminal(&msg.to_string())
    );
    std::process::exit(1)
}

/// Which backend runs the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// The one the plan's devices call for: the GPU engine for `nvidia` (CUDA) or `amd`
    /// (HIP, in a build with the `hip` feature) devices, else the CPU.
    Auto,
    /// The CPU reference backend (plans made for `vendor = "cpu"` devices).
    Cpu,
    /// The GPU engine: NVIDIA GPUs through CUDA, AMD GPUs through HIP (the plan's vendor
    /// picks the runtime).
    Cuda,
}

/// Stage-to-stage hand-off of a layer split run with `--device-map`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Handoff {
    /// What the plan chose (its `handoff_in`: a peer copy where the probe found the GPUs
    /// reach each other, else pinned host memory); a peer copy when both stages share a GPU.
    Auto,
    /// Always a peer copy (the driver stages it when there is no direct path).
    Peer,
    /// Always through pinned host memory (the plan's staging chunks).
    Host,
}

/// How a GPU stage serves the experts its cache misses in a decode step (the hybrid path).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MissPolicyArg {
    /// What the plan chose (`miss policy` in its report: stream, cpu or split N).
    Auto,
    /// Copy every miss into a cache slot and compute it on the GPU.
    Stream,
    /// Compute every miss on the CPU from host memory while the GPU computes the hits.
    Cpu,
}

/// Where a GPU stage's decode attention reads the KV cells past `--kv-resident`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvHostArg {
    /// What the plan chose (`kv host` in its report: stream or cpu).
    Auto,
    /// The GPU reads them from pinned host memory over PCIe in place.
    Stream,
    /// The host CPU attends them while the GPU attends its VRAM window.
    Cpu,
}

/// The options every command that runs a plan takes.
#[derive(clap::Args, Debug, Clone)]
pub struct PlanArgs {
    /// The model (GGUF file or Hugging Face safetensors folder); default: the path the plan
    /// was made from.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The MTP-only GGUF (llama.cpp's `convert_hf_to_gguf.py --mtp` output) of a plan made
    /// with `strata-plan --mtp-model`; default: the path the plan was made with.
    #[arg(long, value_name = "MTP.gguf")]
    pub mtp_model: Option<PathBuf>,
    /// Backend: auto picks CUDA when the plan's devices are NVIDIA GPUs, else the CPU.
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: Backend,
    /// CUDA device every planned device maps onto (a layer split over several planned
    /// devices then runs on this one card, all stages on one stream) [default: 0, or the
    /// plan's own GPUs for a plan over several NVIDIA devices].
    #[arg(long)]
    pub gpu: Option<usize>,
    /// One CUDA device per planned device, in plan order: `--device-map 0,1,2` runs a
    /// three-way layer split on three GPUs; `--device-map 0,0,0` runs each stage on GPU 0
    /// with a stream and hand-off of its own (the multi-GPU code on one card). Without it
    /// and without --gpu, a plan over several NVIDIA devices runs on the GPUs it was planned
    /// for (their probe indices).
    #[arg(
        long,
        value_delimiter = ',',
        conflicts_with = "gpu",
        value_name = "GPU,GPU,..."
    )]
    pub device_map: Option<Vec<usize>>,
    /// How stages on separate device objects (`--device-map`) hand over the hidden state.
    #[arg(long, value_enum, default_value = "auto")]
    pub handoff: Handoff,
    /// Launch decode kernels one by one instead of replaying a captured CUDA graph.
    #[arg(long)]
    pub no_graphs: bool,
    /// Prefill with the matrix-vector kernels instead of the tensor-core products.
    #[arg(long)]
    pub no_prefill_gemm: bool,
    /// Launch every kernel only after the one ahead has finished. By default, on Hopper and
    /// later GPUs, a kernel starts while the one ahead finishes (programmatic dependent
    /// launch) and fetches its weights meanwhile; this turns that off, for comparison.
    #[arg(long)]
    pub no_pdl: bool,
    /// Launch variants of the CUDA engine, for comparing a fused or staged kernel with the
    /// launches it replaces, comma-separated: unfused-topk (the router's top-k in a launch of
    /// its own), unfused-attention (decode attention in three launches), attn-chunk=N (the
    /// fused attention's smallest split, cells; default 32), no-staging (one-token products
    /// and the few-token int8 products read their input from global memory), host-pick
    /// (greedy and sampled tokens picked on the host from the logits), expert-lfu (on plans with experts outside VRAM, the expert
    /// cache replaces the least frequently used expert and keeps the profile's hottest
    /// pinned, instead of LRU), q4k-own (one-token Q4_K products on Q4_K's own kernels instead
    /// of the K-quant lane mapping that Q5_K, Q6_K and IQ3_S share), dp4a (the decode products
    /// over Q4_K, Q6_K and IQ3_S weights on int8 activations too, as those over Q8_0 run by default),
    /// f32-products (every decode product on f32 activations, Q8_0's too), any-pipelined (the
    /// prefill products over IQ3_S, Q6_K, Q5_K and IQ4_XS weights load them through the
    /// pipelined loader instead of decoding each stage's weights synchronously; not yet run on
    /// a GPU). Every variant gives
    /// the same tokens, but the int8 products: they quantize each product input to int8 once
    /// and dot 4 quants an instruction, which rounds the inputs to 8 bits (tests/cuda_dp4a.rs
    /// states the bounds); on the H200 they decode Q8_0 weights faster and Q4_K slower.
    #[arg(long, value_delimiter = ',', value_name = "OPT,OPT,...")]
    pub kernel_options: Vec<String>,
    /// On plans with experts outside VRAM (CUDA): where a decode step's missed experts are
    /// computed. auto takes the plan's choice (its report's `miss policy`); stream copies
    /// every miss into the expert cache; cpu computes every miss on the host CPU (every
    /// core, from the mapped model file) while the GPU computes the hits, and adds its sum
    /// into the layer's output. For measuring one against the other; the tokens agree
    /// within the products' f32 tolerance.
    #[arg(long, value_enum, default_value = "auto")]
    pub miss_policy: MissPolicyArg,
    /// On plans with KV cells beyond --kv-resident (CUDA): where a decode step attends them.
    /// auto takes the plan's choice (its report's `kv host`); stream lets the GPU read them
    /// from pinned host memory over PCIe; cpu attends them on the host CPU (every core) while
    /// the GPU attends its VRAM window, the two partial softmaxes merged on the GPU (decode
    /// steps that reach past the window then run without CUDA graphs). For measuring one
    /// against the other; the tokens agree within the KV type's tolerance.
    #[arg(long, value_enum, default_value = "auto")]
    pub kv_host: KvHostArg,
    /// Time every kernel launch with events (decode graphs and programmatic dependent launch
    /// off) and print the totals per kernel on stderr at exit.
    #[arg(long)]
    pub profile: bool,
    /// No progress bar.
    #[arg(long, short = 'q')]
    pub quiet: bool,
    /// Run a model whose weights hold NaN or infinite values (found by the load-time scan)
    /// with a warning instead of refusing it.
    #[arg(long)]
    pub allow_non_finite_weights: bool,
}

/// Map and decode a plan file, and resolve the model path it runs.
pub fn open_plan(path: &Path, args: &PlanArgs) -> (Plan, PathBuf) {
    let mapped = strata_schemas::planfile::open_plan(path).unwrap_or_else(|e| fail(e));
    let plan = mapped.to_plan().unwrap_or_else(|e| fail(e));
    let model = args
        .model
        .clone()
        .unwrap_or_else(|| PathBuf::from(&plan.model.source));
    (plan, model)
}

/// Whether plan devices of `vendor` run on the GPU engine (CUDA or HIP).
fn gpu_vendor(vendor: &str) -> bool {
    vendor == "nvidia" || vendor == "amd"
}

/// The backend `args` asks for, resolved against the plan's devices (exits 1 when
/// `--device-map` is given for a plan the CPU backend runs).
pub fn backend_for(plan: &Plan, args: &PlanArgs) -> Backend {
    let b = match args.backend {
        Backend::Auto if plan.devices.iter().any(|d| gpu_vendor(&d.vendor)) => Backend::Cuda,
        Backend::Auto => Backend::Cpu,
        b => b,
    };
    if b == Backend::Cpu && args.device_map.is_some() {
        fail("--device-map maps planned devices onto CUDA GPUs, but this plan runs on the CPU backend: drop --device-map, or pass --backend cuda for a plan made for NVIDIA devices");
    }
    if b == Backend::Cpu && args.miss_policy != MissPolicyArg::Auto {
        fail("--miss-policy chooses how the CUDA engine's expert cache serves its misses, but this plan runs on the CPU backend (which computes every expert on the CPU): drop --miss-policy, or pass --backend cuda for a plan made for NVIDIA devices");
    }
    if b == Backend::Cpu && args.kv_host != KvHostArg::Auto {
        fail("--kv-host chooses where the CUDA engine attends its KV cells beyond --kv-resident, but this plan runs on the CPU backend (whose KV is all in host memory): drop --kv-host, or pass --backend cuda for a plan made for NVIDIA devices");
    }
    if b == Backend::Cpu && (!args.kernel_options.is_empty() || args.profile) {
        fail("--kernel-options and --profile choose and time CUDA kernel launches, but this plan runs on the CPU backend: drop them, or pass --backend cuda for a plan made for NVIDIA devices");
    }
    b
}

/// Check and load `model` into the plan's memory on the chosen backend.
pub fn start_engine(plan: &Plan, model: &Path, args: &PlanArgs) -> Box<dyn Engine> {
    try_start_engine(plan, model, args).unwrap_or_else(|e| fail(e))
}

/// [`start_engine`] that returns the CPU engine's failures instead of exiting, for the
/// server's loader thread (which reports them on `/health` and stops cleanly).
pub fn try_start_engine(
    plan: &Plan,
    model: &Path,
    args: &PlanArgs,
) -> Result<Box<dyn Engine>, String> {
    let host = strata_exec::load::open_planned(plan, model, args.mtp_model.as_deref())
        .map_err(|e| e.to_string())?;
    let broken = strata_exec::load::non_finite_weights(&*host);
    if !broken.is_empty() {
        let msg = strata_exec::load::non_finite_summary(&broken);
        if !args.allow_non_finite_weights {
            return Err(format!("{msg} (--allow-non-finite-weights runs it anyway)"));
        }
        eprintln!(
            "strata-exec: warning: {}",
            strata_schemas::text::for_terminal(&msg)
        );
    }
    match backend_for(plan, args) {
        Backend::Cuda => start_cuda(plan, host, args),
        _ => start_cpu(
            plan,
            host,
            EngineOptions {
                progress: !args.quiet,
                mem_available: None,
            },
        )
        .map(|e| Box::new(e) as Box<dyn Engine>)
        .map_err(|e| e.to_string()),
    }
}

#[cfg(feature = "cuda")]
fn start_cuda(
    plan: &Plan,
    host: Box<dyn strata_exec::load::HostModel>,
    args: &PlanArgs,
) -> Result<Box<dyn Engine>, String> {
    start_cuda_engine(plan, host, args)
        .map(|e| Box::new(e) as Box<dyn Engine>)
        .map_err(|e| e.to_string())
}

/// Which GPU each planned device runs on: `--device-map` as given; none (everything on one
/// `--gpu`) when --gpu is given or the plan has one device; else the plan's own device
/// indices, which `strata-exec probe` took from the CUDA (or HIP) ordinals.
#[cfg(feature = "cuda")]
fn device_map(plan: &Plan, args: &PlanArgs) -> Option<Vec<usize>> {
    if let Some(m) = &args.device_map {
        return Some(m.clone());
    }
    let gpus = plan
        .devices
        .iter()
        .filter(|d| gpu_vendor(&d.vendor))
        .count();
    if args.gpu.is_some() || plan.devices.len() < 2 || gpus != plan.devices.len() {
        return None;
    }
    Some(plan.devices.iter().map(|d| d.index as usize).collect())
}

/// The CUDA start-up options `args` ask for (exits 1 on a bad `--kernel-options`).
#[cfg(feature = "cuda")]
pub fn cuda_options(
    plan: &Plan,
    args: &PlanArgs,
) -> strata_exec::backend::cuda::options::CudaOptions {
    use strata_exec::backend::cuda::handoff::HandoffPolicy;
    use strata_exec::backend::cuda::options::{
        CudaOptions, KernelOptions, KvHostOverride, MissOverride,
    };
    CudaOptions {
        gpu: args.gpu.unwrap_or(0),
        device_map: device_map(plan, args),
        handoff: match args.handoff {
            Handoff::Auto => HandoffPolicy::Auto,
            Handoff::Peer => HandoffPolicy::Peer,
            Handoff::Host => HandoffPolicy::Host,
        },
        progress: !args.quiet,
        graphs: !args.no_graphs,
        prefill_gemm: !args.no_prefill_gemm,
        pdl: !args.no_pdl,
        profile: args.profile,
        kernels: KernelOptions::parse(&args.kernel_options).unwrap_or_else(|e| fail(e)),
        miss_policy: match args.miss_policy {
            MissPolicyArg::Auto => MissOverride::Plan,
            MissPolicyArg::Stream => MissOverride::Stream,
            MissPolicyArg::Cpu => MissOverride::Cpu,
        },
        kv_host: match args.kv_host {
            KvHostArg::Auto => KvHostOverride::Plan,
            KvHostArg::Stream => KvHostOverride::Stream,
            KvHostArg::Cpu => KvHostOverride::Cpu,
        },
    }
}

/// The CUDA engine itself (bench reads its device memory).
#[cfg(feature = "cuda")]
pub fn start_cuda_engine(
    plan: &Plan,
    host: Box<dyn strata_exec::load::HostModel>,
    args: &PlanArgs,
) -> Result<
    strata_exec::backend::cuda::start::CudaEngine,
    strata_exec::backend::cuda::start::CudaEngineError,
> {
    strata_exec::backend::cuda::start::start_cuda(plan, host, cuda_options(plan, args))
}

#[cfg(not(feature = "cuda"))]
fn start_cuda(
    _plan: &Plan,
    _host: Box<dyn strata_exec::load::HostModel>,
    args: &PlanArgs,
) -> Result<Box<dyn Engine>, String> {
    let _ = (&args.kernel_options, args.profile);
    Err("this strata-exec was built without the `cuda` feature: rebuild with it, or pass --backend cpu".into())
}
