//! What each backend of this build runs — architectures, weight and KV types, plan features
//! (experts outside VRAM, KV beyond `--kv-resident`, MTP, vision, dense-FFN layers, layer
//! splits), device vendors and kernel shape limits — and [`runnable`], the per-backend
//! verdict on a plan that `strata-plan` reports and `strata-exec` refuses by.
//! Invariant: [`TABLE`] is the single source of truth for "can this build run it": a change of
//! capability is one edited entry here, and every reason [`check`] gives names the missing
//! capability and the part of the plan or model that needs it.

use crate::ggml::GgmlType;
use crate::inventory::{ModelInventory, TensorRole};
use crate::plan::{ModelShape, Placement, Plan};

/// An executor backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Backend {
    Cpu,
    Cuda,
    Hip,
}

impl Backend {
    pub const ALL: [Backend; 3] = [Backend::Cpu, Backend::Cuda, Backend::Hip];

    /// The report's key (`runnable.cpu`, ...) and `strata-exec --backend` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
            Backend::Hip => "hip",
        }
    }
}

/// Kernel shape limits of a backend (the CUDA kernels' compile-time tile limits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shapes {
    /// K and V heads have the same dim, a multiple of `head_dim_multiple`, at most
    /// `head_dim_max`.
    pub head_dim_multiple: u64,
    pub head_dim_max: u64,
    /// Query heads per KV head, at most.
    pub group_max: u64,
    /// Hidden width and expert width are multiples of this.
    pub width_multiple: u64,
}

/// What one backend of this build runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capability {
    pub backend: Backend,
    /// `None` when this strata-exec has the backend; else why not.
    pub missing: Option<&'static str>,
    /// llama.cpp architecture names with a forward pass.
    pub archs: &'static [&'static str],
    /// Weight types it decodes.
    pub weight_types: &'static [GgmlType],
    /// `serve.kv` values.
    pub kv_types: &'static [&'static str],
    /// Plan device vendors it runs (`DevicePlan::vendor`).
    pub vendors: &'static [&'static str],
    /// Experts outside VRAM: a device's expert cache holding fewer than its experts, the
    /// rest served from host memory.
    pub host_experts: bool,
    /// KV cells beyond `--kv-resident` in pinned host memory (`kv_spill` chunks).
    pub kv_spill: bool,
    /// Most `kv_spill` chunks of one device it addresses (the GPU kernels' chunk table,
    /// `strata_kernels::consts::KVH_MAX_CHUNKS`); `None`: no limit.
    pub kv_spill_chunks_max: Option<u64>,
    /// The MTP draft head (`--mtp`).
    pub mtp: bool,
    /// The vision tower (`--vision`).
    pub vision: bool,
    /// Main layers with a dense FFN instead of routed experts.
    pub dense_ffn_layers: bool,
    /// Plans over several devices (`--layer-split`).
    pub layer_split: bool,
    /// Kernel shape limits, when it has any.
    pub shapes: Option<Shapes>,
    /// Weight types its tensor-core prefill products take (the cost model's prefill path:
    /// every projection and expert in one of these, else the decode products).
    pub prefill_gemm_types: &'static [GgmlType],
}

use GgmlType::{
    Iq1M, Iq1S, Iq2S, Iq2Xs, Iq2Xxs, Iq3S, Iq3Xxs, Iq4Nl, Iq4Xs, BF16, MXFP4, Q2K, Q3K, Q4K, Q4_0,
    Q4_1, Q5K, Q5_0, Q5_1, Q6K, Q8_0,
};

/// Today's truth, mirrored from `strata-exec`'s start-up checks (`exec.rs::start` for the
/// CPU engine, `backend/cuda/engine.rs::preflight` and its stage builder for CUDA).
pub const TABLE: [Capability; 3] = [
    Capability {
        backend: Backend::Cpu,
        missing: None,
        // qwen3next: the gated DeltaNet hybrid (model/qwen3next.rs) with its MTP block
        // (speculative decoding, pipeline/spec.rs).
        archs: &["qwen3moe", "qwen3next"],
        // Every type the reference decodes (quant::SUPPORTED).
        weight_types: crate::quant::SUPPORTED,
        kv_types: &["f16", "q8_0", "f32"],
        vendors: &["cpu"],
        host_experts: true,
        kv_spill: true,
        kv_spill_chunks_max: None,
        mtp: true,
        vision: false,
        dense_ffn_layers: true,
        layer_split: true,
        shapes: None,
        prefill_gemm_types: &[],
    },
    Capability {
        backend: Backend::Cuda,
        missing: None,
        // qwen3next: its linear-attention, gated-attention and shared-expert ops on
        // kernels/cuda/linear.cu, with its MTP block (speculative decoding: verify passes
        // checkpoint the linear state in the kernels, rollback copies one back).
        archs: &["qwen3moe", "qwen3next"],
        // Every type the reference decodes: F32/F16/BF16/Q8_0/Q4_K on dedicated kernels, the
        // rest on quants.cuh's decoders (launch::kty).
        weight_types: crate::quant::SUPPORTED,
        kv_types: &["f16", "q8_0"],
        vendors: &["nvidia"],
        host_experts: true,
        // Cells past --kv-resident in mapped pinned chunks, read and written in place by the
        // KV kernels (backend/cuda/kv_spill.rs).
        kv_spill: true,
        kv_spill_chunks_max: Some(128),
        mtp: true,
        vision: false,
        dense_ffn_layers: false,
        layer_split: true,
        shapes: Some(Shapes {
            head_dim_multiple: 4,
            head_dim_max: 256,
            group_max: 16,
            width_multiple: 32,
        }),
        // Every decoded type but F32 and F16: Q8_0, Q4_K and BF16 on their own tile kernels,
        // the rest decoded to f16 as each pipeline stage loads (gemm.cu's GM_ANY).
        prefill_gemm_types: &[
            Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2K, Q3K, Q4K, Q5K, Q6K, Iq2Xxs, Iq2Xs, Iq3Xxs, Iq1S,
            Iq4Nl, Iq3S, Iq2S, Iq4Xs, Iq1M, BF16, MXFP4,
        ],
    },
    Capability {
        backend: Backend::Hip,
        // A strata-exec built with `--features hip` runs AMD plans on the CUDA engine's own
        // stage, launchers and forward pass (backend/cuda/runtime.rs dispatches each driver
        // call to HIP), with the portable kernels compiled by hiprtc: what the CUDA row runs,
        // less the tensor-core prefill. Wired and compile-checked; never yet run on an AMD
        // GPU (README, "On an AMD GPU (HIP): status"). RDNA (wave32) only.
        missing: None,
        archs: &["qwen3moe", "qwen3next"],
        weight_types: crate::quant::SUPPORTED,
        kv_types: &["f16", "q8_0"],
        vendors: &["amd"],
        host_experts: true,
        // The same mapped chunks (hipHostMalloc mapped + hipHostGetDevicePointer).
        kv_spill: true,
        kv_spill_chunks_max: Some(128),
        // The CUDA stage's verify, rollback and draft passes: the same code and kernels
        // (linear.cu's checkpoint outputs compile under hiprtc in CI); never yet run on AMD.
        mtp: true,
        vision: false,
        dense_ffn_layers: false,
        layer_split: true,
        shapes: Some(Shapes {
            head_dim_multiple: 4,
            head_dim_max: 256,
            group_max: 16,
            width_multiple: 32,
        }),
        // No tensor-core modules on HIP: prefill takes the matrix-vector products.
        prefill_gemm_types: &[],
    },
];

/// The table entry of `backend`.
pub fn capability(backend: Backend) -> &'static Capability {
    TABLE
        .iter()
        .find(|c| c.backend == backend)
        .expect("every backend has a table entry")
}

/// The backend that runs devices of `vendor` (`cpu`, `nvidia`, `amd`).
pub fn backend_for_vendor(vendor: &str) -> Option<Backend> {
    TABLE
        .iter()
        .find(|c| c.vendors.contains(&vendor))
        .map(|c| c.backend)
}

/// What a plan (or a model alone) asks of a backend.
#[derive(Debug, Clone, Default)]
pub struct Workload {
    pub arch: String,
    /// (name, type) of every tensor the executor loads.
    pub tensors: Vec<(String, GgmlType)>,
    /// `serve.kv`; `None` for a model without a plan.
    pub kv: Option<String>,
    /// (plan index, vendor) of every device; empty for a model without a plan.
    pub devices: Vec<(u32, String)>,
    /// Experts (layer x expert) not resident in any expert cache, of all experts.
    pub host_experts: (u64, u64),
    /// (cells per slot in VRAM, cells per slot) when KV spills to host memory.
    pub kv_spill: Option<(u64, u64)>,
    /// The most `kv_spill` chunks the plan pins for one device.
    pub kv_spill_chunks: u64,
    pub mtp: bool,
    pub vision: bool,
    /// (dense-FFN layers, main layers).
    pub dense_ffn_layers: (u32, u32),
    pub shape: ModelShape,
}

impl Workload {
    /// What `plan` asks.
    pub fn of_plan(plan: &Plan) -> Self {
        let s = &plan.serve;
        let all: u64 = plan
            .devices
            .iter()
            .map(|d| u64::from(d.cost.expert_layers) * u64::from(d.cost.n_expert))
            .sum();
        let resident: u64 = plan
            .devices
            .iter()
            .map(|d| {
                d.expert_cache_slots
                    .min(u64::from(d.cost.expert_layers) * u64::from(d.cost.n_expert))
            })
            .sum();
        Self {
            arch: plan.model.arch.clone(),
            tensors: plan
                .tensors
                .iter()
                .filter(|t| !matches!(t.placement, Placement::Host))
                .map(|t| (t.name.clone(), t.ggml_type))
                .collect(),
            kv: Some(s.kv.as_str().to_string()),
            devices: plan
                .devices
                .iter()
                .map(|d| (d.index, d.vendor.clone()))
                .collect(),
            host_experts: (all - resident, all),
            kv_spill: (s.kv_resident < s.max_context).then_some((s.kv_resident, s.max_context)),
            kv_spill_chunks: plan
                .devices
                .iter()
                .map(|d| {
                    let mine = |c: &&crate::plan::PinnedChunk| {
                        c.device == d.index && c.purpose == "kv_spill"
                    };
                    plan.host.pinned_chunks.iter().filter(mine).count() as u64
                })
                .max()
                .unwrap_or(0),
            mtp: s.mtp,
            vision: s.vision,
            dense_ffn_layers: (plan.model.dense_ffn_layers, plan.model.n_layer),
            shape: plan.model.shape.clone(),
        }
    }

    /// What running `inv` at all asks (no plan: every tensor but the MTP block's, no
    /// devices, no spill).
    pub fn of_model(inv: &ModelInventory) -> Self {
        let hp = &inv.hparams;
        let n = hp.n_layer;
        Self {
            arch: inv.arch.clone(),
            tensors: inv
                .tensors
                .iter()
                .filter(|t| t.role != TensorRole::MtpExtra && t.layer.is_none_or(|l| l < n))
                .map(|t| (t.name.clone(), t.ggml_type))
                .collect(),
            dense_ffn_layers: (dense_ffn_layers(inv), n),
            shape: model_shape(inv),
            ..Self::default()
        }
    }
}

/// Main layers of `inv` without routed experts.
pub fn dense_ffn_layers(inv: &ModelInventory) -> u32 {
    let hp = &inv.hparams;
    (0..hp.n_layer)
        .filter(|l| !hp.layer_has_experts(*l))
        .count() as u32
}

/// The kernel-relevant dimensions of `inv`.
pub fn model_shape(inv: &ModelInventory) -> ModelShape {
    let hp = &inv.hparams;
    ModelShape {
        n_embd: hp.n_embd,
        n_ff_exp: hp.n_ff_exp,
        n_head: hp.n_head,
        n_head_kv: hp.n_head_kv,
        head_dim_k: hp.head_dim_k,
        head_dim_v: hp.head_dim_v,
    }
}

fn list<T: std::fmt::Display>(v: &[T]) -> String {
    if v.is_empty() {
        return "nothing".into();
    }
    v.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether `cap` runs `w`: `Ok`, or every reason it does not, each naming what is missing.
pub fn check(cap: &Capability, w: &Workload) -> Result<(), Vec<String>> {
    if let Some(m) = cap.missing {
        return Err(vec![m.to_string()]);
    }
    let mut why = Vec::new();
    if !cap.archs.contains(&w.arch.as_str()) {
        why.push(format!(
            "architecture `{}` has no forward pass here (runs {})",
            w.arch,
            list(cap.archs)
        ));
    }
    // Unsupported weight types, each with its first tensor and a count of the others.
    let mut bad: Vec<(GgmlType, &str, u64)> = Vec::new();
    for (name, ty) in &w.tensors {
        if cap.weight_types.contains(ty) {
            continue;
        }
        match bad.iter_mut().find(|(t, _, _)| t == ty) {
            Some(e) => e.2 += 1,
            None => bad.push((*ty, name, 1)),
        }
    }
    for (ty, first, n) in bad {
        let more = if n > 1 {
            format!(" and {} more tensor(s)", n - 1)
        } else {
            String::new()
        };
        why.push(format!(
            "weight type {ty} of tensor `{first}`{more} (decodes {})",
            list(cap.weight_types)
        ));
    }
    if let Some(kv) = &w.kv {
        if !cap.kv_types.contains(&kv.as_str()) {
            why.push(format!("KV type `{kv}` (runs {})", list(cap.kv_types)));
        }
    }
    for (index, vendor) in &w.devices {
        if !cap.vendors.contains(&vendor.as_str()) {
            why.push(format!(
                "device {index} is vendor `{vendor}` (runs {} devices)",
                list(cap.vendors)
            ));
        }
    }
    if w.devices.len() > 1 && !cap.layer_split {
        why.push(format!(
            "layer split over {} devices (runs one device)",
            w.devices.len()
        ));
    }
    let (host, all) = w.host_experts;
    if host > 0 && !cap.host_experts {
        why.push(format!(
            "region experts_host: {host} of {all} experts stay in host memory (needs every expert resident in VRAM: more VRAM, more devices or a smaller quantization)"
        ));
    }
    if let Some((resident, ctx)) = w.kv_spill {
        if !cap.kv_spill {
            why.push(format!(
                "region kv_spill: {resident} of {ctx} KV cells per slot in VRAM (keeps every cell in VRAM: --kv-resident {ctx})"
            ));
        } else if let Some(max) = cap.kv_spill_chunks_max.filter(|m| w.kv_spill_chunks > *m) {
            why.push(format!(
                "region kv_spill: {} pinned chunks on one device, the kernels address at most {max} (fewer chunks: a larger --pinned-chunk-mib or --kv-resident)",
                w.kv_spill_chunks
            ));
        }
    }
    if w.mtp && !cap.mtp {
        why.push("the MTP draft head (--mtp/--spec)".into());
    }
    if w.vision && !cap.vision {
        why.push("the vision tower (--vision)".into());
    }
    let (dense, layers) = w.dense_ffn_layers;
    if dense > 0 && !cap.dense_ffn_layers {
        why.push(format!(
            "dense-FFN layers: {dense} of {layers} layers have no routed experts"
        ));
    }
    if let Some(lim) = cap.shapes {
        why.extend(shape_reasons(&lim, &w.shape));
    }
    if why.is_empty() {
        Ok(())
    } else {
        Err(why)
    }
}

fn shape_reasons(lim: &Shapes, s: &ModelShape) -> Vec<String> {
    let mut why = Vec::new();
    let (k, v) = (s.head_dim_k, s.head_dim_v);
    if k != v || k == 0 || k % lim.head_dim_multiple != 0 || k > lim.head_dim_max {
        why.push(format!(
            "head dims K {k} / V {v} (needs equal K and V head dims, a multiple of {}, at most {})",
            lim.head_dim_multiple, lim.head_dim_max
        ));
    }
    if s.n_head_kv == 0 || s.n_head % s.n_head_kv != 0 || s.n_head / s.n_head_kv > lim.group_max {
        why.push(format!(
            "{} query heads over {} KV heads (needs a whole group of at most {} query heads per KV head)",
            s.n_head, s.n_head_kv, lim.group_max
        ));
    }
    if s.n_embd % lim.width_multiple != 0 || s.n_ff_exp % lim.width_multiple != 0 {
        why.push(format!(
            "hidden width {} / expert width {} (needs both multiples of {})",
            s.n_embd, s.n_ff_exp, lim.width_multiple
        ));
    }
    why
}

/// Per backend of [`Backend::ALL`]: `Ok` or the reasons it cannot run the workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Runnable(pub Vec<(Backend, Result<(), Vec<String>>)>);

impl Runnable {
    /// The backends that run it.
    pub fn backends(&self) -> Vec<Backend> {
        self.0
            .iter()
            .filter(|(_, r)| r.is_ok())
            .map(|(b, _)| *b)
            .collect()
    }

    /// Whether some backend of this build runs it.
    pub fn any(&self) -> bool {
        self.0.iter().any(|(_, r)| r.is_ok())
    }

    /// The verdict of one backend.
    pub fn of(&self, b: Backend) -> &Result<(), Vec<String>> {
        &self
            .0
            .iter()
            .find(|(x, _)| *x == b)
            .expect("every backend has a verdict")
            .1
    }
}

/// Every backend's verdict on `w`.
pub fn runnable_workload(w: &Workload) -> Runnable {
    Runnable(TABLE.iter().map(|c| (c.backend, check(c, w))).collect())
}

/// Every backend's verdict on `plan`.
pub fn runnable(plan: &Plan) -> Runnable {
    runnable_workload(&Workload::of_plan(plan))
}

/// Every backend's verdict on running `inv` at all (before any plan: architecture, weight
/// types, dense-FFN layers, kernel shapes).
pub fn runnable_model(inv: &ModelInventory) -> Runnable {
    runnable_workload(&Workload::of_model(inv))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen3moe() -> Workload {
        Workload {
            arch: "qwen3moe".into(),
            tensors: vec![
                ("token_embd.weight".into(), Q8_0),
                ("blk.0.ffn_down_exps.weight".into(), Q8_0),
            ],
            kv: Some("f16".into()),
            devices: vec![(0, "nvidia".into())],
            host_experts: (0, 128),
            dense_ffn_layers: (0, 48),
            shape: ModelShape {
                n_embd: 2048,
                n_ff_exp: 768,
                n_head: 32,
                n_head_kv: 4,
                head_dim_k: 128,
                head_dim_v: 128,
            },
            ..Workload::default()
        }
    }

    #[test]
    fn an_all_resident_qwen3moe_on_nvidia_runs_on_cuda_only() {
        let r = runnable_workload(&qwen3moe());
        assert_eq!(r.backends(), [Backend::Cuda]);
        let cpu = r.of(Backend::Cpu).as_ref().unwrap_err();
        assert!(cpu[0].contains("vendor `nvidia`"), "{cpu:?}");
        let hip = r.of(Backend::Hip).as_ref().unwrap_err();
        assert!(hip.iter().any(|w| w.contains("vendor `nvidia`")), "{hip:?}");
    }

    #[test]
    fn each_missing_capability_is_named() {
        let mut w = qwen3moe();
        // An architecture neither backend has a forward pass for.
        w.arch = "gpt-oss".into();
        w.tensors
            .push(("blk.0.ffn_up_exps.weight".into(), GgmlType::Tq1_0));
        w.tensors
            .push(("blk.1.ffn_up_exps.weight".into(), GgmlType::Tq1_0));
        w.kv = Some("f32".into());
        w.devices.push((1, "amd".into()));
        w.host_experts = (10, 128);
        w.kv_spill = Some((4096, 65536));
        w.mtp = true;
        w.vision = true;
        w.dense_ffn_layers = (1, 48);
        w.shape.head_dim_v = 64;
        let why = check(capability(Backend::Cuda), &w).unwrap_err();
        let all = why.join("\n");
        for needle in [
            "architecture `gpt-oss`",
            "TQ1_0 of tensor `blk.0.ffn_up_exps.weight` and 1 more",
            "KV type `f32`",
            "device 1 is vendor `amd`",
            "vision",
            "dense-FFN layers: 1 of 48",
            "head dims K 128 / V 64",
        ] {
            assert!(all.contains(needle), "missing `{needle}` in:\n{all}");
        }
        // CUDA serves host experts through its expert cache and spilled KV from mapped
        // pinned chunks; a backend without them names the region.
        assert!(!all.contains("experts_host"), "{all}");
        assert!(!all.contains("kv_spill"), "{all}");
        let no_spill = Capability {
            kv_spill: false,
            ..*capability(Backend::Cuda)
        };
        let why = check(&no_spill, &w).unwrap_err().join("\n");
        assert!(why.contains("kv_spill: 4096 of 65536"), "{why}");
        // More spill chunks on one device than the kernels' table holds.
        w.kv_spill_chunks = 129;
        let why = check(capability(Backend::Cuda), &w).unwrap_err().join("\n");
        assert!(
            why.contains("129 pinned chunks") && why.contains("--pinned-chunk-mib"),
            "{why}"
        );
        // CUDA and HIP run the MTP block, over spilled KV too; a backend without it names it.
        assert!(!all.contains("MTP"), "{all}");
        let hip = check(capability(Backend::Hip), &w).unwrap_err().join("\n");
        assert!(!hip.contains("MTP"), "{hip}");
        let no_mtp = Capability {
            mtp: false,
            ..*capability(Backend::Hip)
        };
        let why = check(&no_mtp, &w).unwrap_err().join("\n");
        assert!(why.contains("the MTP draft head (--mtp/--spec)"), "{why}");
        let no_host = Capability {
            host_experts: false,
            ..*capability(Backend::Cuda)
        };
        let why = check(&no_host, &w).unwrap_err().join("\n");
        assert!(why.contains("experts_host: 10 of 128"), "{why}");
        // The CPU backend takes host experts, KV spill, dense layers, f32 KV and any head dims.
        let cpu = check(capability(Backend::Cpu), &w).unwrap_err().join("\n");
        for absent in [
            "experts_host",
            "kv_spill",
            "dense-FFN",
            "KV type",
            "head dims",
        ] {
            assert!(!cpu.contains(absent), "`{absent}` in:\n{cpu}");
        }
    }

    #[test]
    fn cuda_prefill_gemm_takes_every_decoded_type_but_f32_and_f16() {
        let c = capability(Backend::Cuda);
        let want: Vec<GgmlType> = crate::quant::SUPPORTED
            .iter()
            .copied()
            .filter(|t| !matches!(t, GgmlType::F32 | GgmlType::F16))
            .collect();
        let mut got = c.prefill_gemm_types.to_vec();
        got.sort_by_key(|t| t.id());
        let mut w = want.clone();
        w.sort_by_key(|t| t.id());
        assert_eq!(got, w);
        assert!(got.iter().all(|t| c.weight_types.contains(t)));
    }

    #[test]
    fn every_backend_has_one_entry_and_vendors_map_to_one_backend() {
        for b in Backend::ALL {
            assert_eq!(TABLE.iter().filter(|c| c.backend == b).count(), 1);
        }
        assert_eq!(backend_for_vendor("nvidia"), Some(Backend::Cuda));
        assert_eq!(backend_for_vendor("cpu"), Some(Backend::Cpu));
        assert_eq!(backend_for_vendor("amd"), Some(Backend::Hip));
    }
}
