//! The CUDA backend's start-up options: the documented flags of `strata-exec` (`--gpu`,
//! `--device-map`, `--handoff`, `--no-graphs`, `--no-prefill-gemm`, `--no-pdl`, `--profile`,
//! `--miss-policy`)
//! and the launch variants of `--kernel-options` (for comparing a fused or staged kernel with
//! the launches it replaces), parsed once at start-up.
//! Invariant: nothing here is read from the environment, and every variant computes the same
//! function (most bit for bit; where a variant sums in another order, its doc says so), but
//! the int8 products ([`Int8Products`]: on by default for Q8_0 weights, `dp4a` for every type
//! that has them, `f32-products` for none), which round the products' inputs to 8 bits and
//! say so. `any-pipelined` picks the prefill products' pipelined any-type weight loader
//! ([`AnyLoad`]) over the synchronous default, bit for bit the same (not yet run on a GPU).

use super::gemm::AnyLoad;
use super::handoff::HandoffPolicy;
use strata_schemas::ggml::GgmlType;

/// Which weight types' decode products run on int8 activations (`dp4a.cu`): measured on the
/// H200 (BENCHMARKS.md, 2026-12-05), Q8_0 decode gains (+11% at batch 1, +2% at 16 slots),
/// Q4_K loses (0% at batch 1, -18% at 16 slots), hence the per-type default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Int8Products {
    /// Every product in f32 (`--kernel-options f32-products`): the CPU engine's numerics.
    None,
    /// Q8_0 weights only (the default); Q4_K, Q6_K and IQ3_S keep the f32 kernels.
    #[default]
    Q8_0,
    /// Every type with an int8 kernel: Q8_0, Q4_K, Q6_K and IQ3_S (`--kernel-options dp4a`).
    All,
}

impl Int8Products {
    /// Whether products over weights of `ty` run on int8 activations.
    pub fn covers(self, ty: GgmlType) -> bool {
        match self {
            Int8Products::None => false,
            Int8Products::Q8_0 => ty == GgmlType::Q8_0,
            Int8Products::All => matches!(
                ty,
                GgmlType::Q8_0 | GgmlType::Q4K | GgmlType::Q6K | GgmlType::Iq3S
            ),
        }
    }
}

/// Launch variants of decode steps, for comparison (`--kernel-options`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelOptions {
    /// The router's softmax and top-k in the last block of its logit launch instead of a
    /// launch of their own (`unfused-topk` turns it off). Bit for bit the same either way.
    pub fused_topk: bool,
    /// QK-norm + RoPE, the KV store, split-KV attention and the merge of the splits in one
    /// launch (`dq_attn_fused`) where the model allows it (`unfused-attention` runs the three
    /// launches instead). Its splits are at least `attn_chunk` cells, so its sums run in
    /// another order than the three launches'.
    pub fused_attention: bool,
    /// The fused attention's smallest split, in cells (`attn-chunk=N`, default 32).
    pub attn_chunk: u32,
    /// One-token Q8_0 products stage their input in shared memory (`no-staging` reads it
    /// from global memory): Q/K/V, the output projection and the MoE gate/up; and so do the
    /// int8 products of 2..16 tokens (`dq4_mv4/8/16`, their q8a rows). Bit for bit the same
    /// logits either way.
    pub stage_inputs: bool,
    /// Greedy and sampled picks read the logits back and pick on the host (`host-pick`)
    /// instead of on the device. The same tokens either way.
    pub host_pick: bool,
    /// On plans with experts outside VRAM: the expert cache replaces the least frequently
    /// used expert and keeps the plan's hottest resident experts (the routing profile's) pinned
    /// (`expert-lfu`), instead of replacing the least recently used. The same logits either
    /// way; only which misses are copied differs.
    pub expert_lfu: bool,
    /// One-token Q4_K products (matrix-vector, Q/K/V, the experts' gate/up) on the K-quant
    /// kernels' lane mapping (`dq_*_kq`, each lane 8 values of every 256-value block), as Q5_K,
    /// Q6_K and IQ3_S run: 2.8% faster decode than Q4_K's own kernels on the H200's Q4_K_M
    /// file, which `q4k-own` runs instead for comparison. Within the products' f32 tolerance
    /// of each other (the sums run in another order; 1.7e-4 relative on the logits measured).
    pub q4k_lanes: bool,
    /// The decode products on int8 activations, for the weight types `int8` covers (Q8_0 by
    /// default; `dp4a`: Q8_0, Q4_K, Q6_K and IQ3_S; `f32-products`: none): each product input of
    /// 1..16 tokens quantized once to blocks of 32 (`dq_quant_q8a`, into the plan's `xh`
    /// buffer, which the tensor-core prefill alone uses otherwise) and dotted 4 quants an
    /// instruction (`dq4_*`, kernels/cuda/dp4a.cu): Q/K/V, the output projection, the
    /// experts' gate/up and down. Not the same function: the inputs are rounded to 8 bits a
    /// value (tests/cuda_dp4a.rs states the bounds). Plans whose `xh` is too small (no
    /// tensor-core prefill) and experts served through the expert cache keep the f32
    /// products.
    pub int8: Int8Products,
    /// How the prefill's tensor-core products load weights of the types without a kernel of
    /// their own (`gemm.rs`'s [`AnyLoad`]): the synchronous loader by default, `any-pipelined`
    /// for IQ3_S, Q6_K, Q5_K and IQ4_XS through the pipelined one (raw bytes fetched a stage
    /// ahead into registers, decoded after the stage's mmas). The same f16 weights and so the
    /// same logits bit for bit either way. The pipelined loader has not yet run on a GPU,
    /// so it is not the default.
    pub any_load: AnyLoad,
}

impl Default for KernelOptions {
    fn default() -> Self {
        Self {
            fused_topk: true,
            fused_attention: true,
            attn_chunk: 32,
            stage_inputs: true,
            host_pick: false,
            expert_lfu: false,
            q4k_lanes: true,
            int8: Int8Products::Q8_0,
            any_load: AnyLoad::Sync,
        }
    }
}

/// The values `--kernel-options` takes, for `--help` and errors.
pub const KERNEL_OPTIONS_HELP: &str =
    "unfused-topk, unfused-attention, attn-chunk=N, no-staging, host-pick, expert-lfu, q4k-own, dp4a, f32-products, any-pipelined";

impl KernelOptions {
    /// The defaults with every product in f32 (`f32-products`): what the tests comparing the
    /// CUDA engine with the CPU engine's f32 numerics run.
    pub fn f32_products() -> Self {
        Self {
            int8: Int8Products::None,
            ..Self::default()
        }
    }

    /// Parse a comma-separated `--kernel-options` list over the defaults.
    pub fn parse(list: &[String]) -> Result<Self, String> {
        let mut o = Self::default();
        let mut int8: Option<(&str, Int8Products)> = None;
        for item in list.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
            match item {
                "unfused-topk" => o.fused_topk = false,
                "unfused-attention" => o.fused_attention = false,
                "no-staging" => o.stage_inputs = false,
                "host-pick" => o.host_pick = true,
                "expert-lfu" => o.expert_lfu = true,
                "q4k-own" => o.q4k_lanes = false,
                "any-pipelined" => o.any_load = AnyLoad::Pipelined,
                "dp4a" | "f32-products" => {
                    let want = if item == "dp4a" {
                        Int8Products::All
                    } else {
                        Int8Products::None
                    };
                    if let Some((other, had)) = int8 {
                        if had != want {
                            return Err(format!(
                                "--kernel-options: `{other}` and `{item}` contradict each other (dp4a: int8 products for Q8_0, Q4_K, Q6_K and IQ3_S; f32-products: for none): give one"
                            ));
                        }
                    }
                    int8 = Some((item, want));
                    o.int8 = want;
                }
                _ => match item.strip_prefix("attn-chunk=") {
                    Some(v) => {
                        o.attn_chunk = v
                            .parse::<u32>()
                            .ok()
                            .filter(|n| (1..=1 << 20).contains(n))
                            .ok_or_else(|| {
                                format!("--kernel-options attn-chunk={v}: give a number of cells in 1..=1048576")
                            })?
                    }
                    None => {
                        return Err(format!(
                            "--kernel-options: unknown option `{item}` (known: {KERNEL_OPTIONS_HELP})"
                        ))
                    }
                },
            }
        }
        Ok(o)
    }
}

/// Where a stage's decode misses are computed (`--miss-policy`): the plan's choice, or one
/// of the two paths for every miss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MissOverride {
    /// The plan's `cpu_misses_per_token` (its report's `miss policy`).
    #[default]
    Plan,
    /// Copy every miss into a cache slot.
    Stream,
    /// Compute every miss on the host CPU.
    Cpu,
}

impl MissOverride {
    /// Misses per token of a decode layer computed on the CPU, given the plan's count.
    pub fn cpu_per_token(self, planned: u32) -> u32 {
        match self {
            MissOverride::Plan => planned,
            MissOverride::Stream => 0,
            MissOverride::Cpu => u32::MAX,
        }
    }
}

/// Where a decode pass attends the KV cells past `--kv-resident` (`--kv-host`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvHostOverride {
    /// The plan's choice (its report's `kv host`).
    #[default]
    Plan,
    /// The device reads them over PCIe in place.
    Stream,
    /// The host CPU attends them while the device attends its window.
    Cpu,
}

impl KvHostOverride {
    /// Whether the host CPU attends the spilled cells, given the plan's choice.
    pub fn cpu(self, planned: bool) -> bool {
        match self {
            KvHostOverride::Plan => planned,
            KvHostOverride::Stream => false,
            KvHostOverride::Cpu => true,
        }
    }
}

/// Start-up options of the CUDA engine.
#[derive(Debug, Clone)]
pub struct CudaOptions {
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
    /// Prefill through the tensor-core products where the weights allow (Q8_0 / Q4_K / BF16,
    /// experts at a fixed stride); else every pass uses the matrix-vector kernels.
    pub prefill_gemm: bool,
    /// Programmatic dependent launch on GPUs of compute capability 9.0 and later (a kernel
    /// starts while the one ahead finishes and prefetches its weights meanwhile).
    pub pdl: bool,
    /// Time every launch with events (graphs and PDL off) and print the totals per kernel
    /// when the engine is dropped.
    pub profile: bool,
    pub kernels: KernelOptions,
    /// Where decode misses of the expert cache are computed (the hybrid path).
    pub miss_policy: MissOverride,
    /// Where decode attention reads the KV cells past `--kv-resident`.
    pub kv_host: KvHostOverride,
}

impl CudaOptions {
    /// The defaults with every product in f32 ([`KernelOptions::f32_products`]).
    pub fn f32_products() -> Self {
        Self {
            kernels: KernelOptions::f32_products(),
            ..Self::default()
        }
    }
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            gpu: 0,
            device_map: None,
            handoff: HandoffPolicy::Auto,
            progress: false,
            graphs: true,
            prefill_gemm: true,
            pdl: true,
            profile: false,
            kernels: KernelOptions::default(),
            miss_policy: MissOverride::Plan,
            kv_host: KvHostOverride::Plan,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_options_parse_and_refuse_with_the_list() {
        let o =
            KernelOptions::parse(&["unfused-attention".into(), "attn-chunk=64".into()]).unwrap();
        assert!(!o.fused_attention && o.attn_chunk == 64 && o.fused_topk && o.stage_inputs);
        assert_eq!(KernelOptions::parse(&[]).unwrap(), KernelOptions::default());
        let e = KernelOptions::parse(&["fast".into()]).unwrap_err();
        assert!(e.contains("`fast`") && e.contains("host-pick"), "{e}");
        assert!(KernelOptions::parse(&["attn-chunk=0".into()]).is_err());
        let o = KernelOptions::parse(&["no-staging".into(), "host-pick".into()]).unwrap();
        assert!(!o.stage_inputs && o.host_pick && !o.expert_lfu && o.q4k_lanes);
        assert!(!KernelOptions::parse(&["q4k-own".into()]).unwrap().q4k_lanes);
        let d = KernelOptions::default();
        assert_eq!(d.int8, Int8Products::Q8_0);
        assert!(d.int8.covers(GgmlType::Q8_0) && !d.int8.covers(GgmlType::Q4K));
        assert!(!d.int8.covers(GgmlType::Q6K) && !d.int8.covers(GgmlType::F32));
        let all = KernelOptions::parse(&["dp4a".into()]).unwrap().int8;
        assert_eq!(all, Int8Products::All);
        assert!(
            all.covers(GgmlType::Q8_0) && all.covers(GgmlType::Q4K) && all.covers(GgmlType::Q6K)
        );
        assert!(!all.covers(GgmlType::BF16));
        let none = KernelOptions::parse(&["f32-products".into()]).unwrap();
        assert_eq!(none, KernelOptions::f32_products());
        assert!(!none.int8.covers(GgmlType::Q8_0));
        let e = KernelOptions::parse(&["dp4a".into(), "f32-products".into()]).unwrap_err();
        assert!(e.contains("`dp4a`") && e.contains("`f32-products`"), "{e}");
        assert!(KernelOptions::parse(&["dp4a".into(), "dp4a".into()]).is_ok());
        assert!(
            KernelOptions::parse(&["expert-lfu".into()])
                .unwrap()
                .expert_lfu
        );
        assert_eq!(d.any_load, AnyLoad::Sync);
        let o = KernelOptions::parse(&["any-pipelined".into(), "no-staging".into()]).unwrap();
        assert!(o.any_load == AnyLoad::Pipelined && !o.stage_inputs && o.int8 == d.int8);
        assert!(KERNEL_OPTIONS_HELP.contains("any-pipelined"));
    }
}
