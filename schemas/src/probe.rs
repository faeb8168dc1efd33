//! The hardware probe (TOML): host RAM limits and the devices a plan may use.
//! Invariant: unknown keys, zero sizes, duplicate device indices and peers that are not
//! another device of the probe are errors that name the file and key; every default filled in
//! here is documented on its field.

use crate::ggml::GgmlType;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::Path;

/// Device vendor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Vendor {
    Nvidia,
    Amd,
    Cpu,
}

impl Vendor {
    /// Runtime reserve assumed when the probe gives none: context, loaded modules, BLAS
    /// workspace and graphs. NVIDIA and AMD figures are what a CUDA 12/13 or ROCm 6 context
    /// with cuBLAS/hipBLAS and our kernels takes on a consumer card, rounded up.
    pub fn default_runtime_reserve(self) -> u64 {
        match self {
            Vendor::Nvidia => 640 * MIB,
            Vendor::Amd => 768 * MIB,
            Vendor::Cpu => 64 * MIB,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Vendor::Nvidia => "nvidia",
            Vendor::Amd => "amd",
            Vendor::Cpu => "cpu",
        }
    }
}

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// `[host]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostProbe {
    /// Physical RAM.
    pub ram_bytes: u64,
    /// `MemAvailable` when probed.
    pub available_bytes: u64,
    /// `ulimit -l` in bytes; absent = unlimited.
    #[serde(default)]
    pub memlock_limit_bytes: Option<u64>,
    /// Sequential read speed of the disk holding the model, for the cost of experts that page
    /// from disk; absent = 2 GB/s (a mid-range NVMe drive) and the report says it assumed so.
    #[serde(default)]
    pub disk_read_gbps: Option<f64>,
}

/// One `[[device]]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceProbe {
    pub index: u32,
    pub name: String,
    pub vendor: Vendor,
    /// e.g. "sm_86", "gfx1201", "x86_64".
    pub arch: String,
    pub vram_bytes: u64,
    /// Free memory after context creation; absent = `vram_bytes` minus the runtime reserve.
    #[serde(default)]
    pub free_bytes: Option<u64>,
    /// Measured runtime reserve; absent = the vendor default.
    #[serde(default)]
    pub runtime_reserve_bytes: Option<u64>,
    /// Memory bandwidth (datasheet or measured); absent = 300 GB/s.
    #[serde(default)]
    pub mem_bandwidth_gbps: Option<f64>,
    /// Host-to-device bandwidth; absent = derived from the PCIe link, else 12 GB/s.
    #[serde(default)]
    pub h2d_gbps: Option<f64>,
    #[serde(default)]
    pub pcie_gen: Option<u32>,
    #[serde(default)]
    pub pcie_width: Option<u32>,
    /// Indices of the devices whose memory this one reads directly (CUDA peer access, from
    /// `strata-exec probe`); absent = unknown, planned as none (hand-offs through host memory).
    #[serde(default)]
    pub peers: Option<Vec<u32>>,
    /// `[device.cost]`: the cost model's coefficients measured on this device; absent keys
    /// take the planner's documented defaults and the report calls its figures guesses.
    #[serde(default)]
    pub cost: Option<CostProbe>,
}

/// `[device.cost]`: what this device's kernels achieve, measured by running the engine's own
/// kernels (`strata-exec probe`). Every key is optional; an absent key takes the default in
/// the planner's cost model (`planner/src/cost.rs`, README "Predictions"), derived from
/// `mem_bandwidth_gbps` and calibrated on the H200, and the report says the figures are
/// guesses. Times are microseconds, bandwidths GB/s (1e9 bytes), throughputs TFLOP/s.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostProbe {
    /// A launch that reads next to nothing (RMSNorm, argmax) inside a captured decode step.
    #[serde(default)]
    pub launch_us: Option<f64>,
    /// A one-token weight product's time beyond its bytes (its launch, ramp and tail).
    #[serde(default)]
    pub product_latency_us: Option<f64>,
    /// Weight bytes per second one-token products (projections, experts, head) read.
    #[serde(default)]
    pub product_gbps: Option<f64>,
    /// Decode attention's time beyond its KV bytes, per layer.
    #[serde(default)]
    pub attention_latency_us: Option<f64>,
    /// KV bytes per second decode attention reads.
    #[serde(default)]
    pub attention_gbps: Option<f64>,
    /// Prefill products (tensor cores on a GPU, the dot kernels on a CPU), TFLOP/s.
    #[serde(default)]
    pub gemm_tflops: Option<f64>,
    /// Prefill attention, TFLOP/s.
    #[serde(default)]
    pub prefill_attention_tflops: Option<f64>,
    /// Per decode step: graph launch, synchronisation and the tokens back to the host.
    #[serde(default)]
    pub step_us: Option<f64>,
    /// Expert bytes per second into this device's expert cache from host memory, copied
    /// the way the engine copies a miss.
    #[serde(default)]
    pub host_expert_gbps: Option<f64>,
    /// The same from pinned host memory (the plan's pinned expert tier), one whole expert
    /// slot per copy.
    #[serde(default)]
    pub host_expert_pinned_gbps: Option<f64>,
    /// A decode step's expert products (gate-up and down launches of a layer) beyond their
    /// bytes.
    #[serde(default)]
    pub expert_latency_us: Option<f64>,
    /// Expert bytes per second the decode expert products read, counting every (token,
    /// expert) use.
    #[serde(default)]
    pub expert_gbps: Option<f64>,
    /// The same products over a many-token group (a prefill pass through an expert cache),
    /// expert bytes of the uses per second.
    #[serde(default)]
    pub expert_pass_gbps: Option<f64>,
    /// Prefill's grouped expert products (tensor cores on a GPU), TFLOP/s.
    #[serde(default)]
    pub expert_gemm_tflops: Option<f64>,
    /// The hybrid miss path (a GPU device's missed experts computed on the host CPU): expert
    /// bytes per second the host's expert products read from host memory with every core
    /// (the rate a miss computes at on the CPU), and the intercept of the same fit (the thread
    /// pool's sections, hot; the device side is `host_round_trip_us`). Host figures, kept per
    /// device beside the other miss keys (see [`CostProbe::host_entries`]).
    #[serde(default)]
    pub host_matvec_gbps: Option<f64>,
    #[serde(default)]
    pub host_expert_latency_us: Option<f64>,
    /// The whole round trip of one decode layer that computes a miss on the host, as the
    /// engine runs it (`backend/cuda/hybrid.rs`), less the pick's bytes at
    /// `host_matvec_gbps`: the rows and weights read back (a stream synchronisation), the
    /// picks' ids and weights up, the host products from a cold thread pool, the sum up and
    /// the combine launch. The device waits for it: the cost model charges it per layer
    /// serially. Absent from probes written before it was measured (the default is a
    /// conservative guess).
    #[serde(default)]
    pub host_round_trip_us: Option<f64>,
    /// The same for one attention layer whose spilled KV cells the host CPU attends
    /// (`--kv-host cpu`, `backend/cuda/kv_host_attn.rs`): the query rows back (a stream
    /// synchronisation), the host partials' fixed part from a cold pool, the partials up and
    /// the combine launch.
    #[serde(default)]
    pub kv_host_round_trip_us: Option<f64>,
    /// A kernel launched outside a captured graph (the eager launch a decode step with a host
    /// round trip pays: such a step cannot be one CUDA graph), host issue time per launch.
    #[serde(default)]
    pub eager_launch_us: Option<f64>,
    /// Tokens an expert (a pass's tokens x experts used / experts) at which
    /// `expert_gemm_tflops` and the types' `expert_gemm_tflops` were measured: the grouped
    /// products pad each expert's tokens to whole tiles, so the rate holds at this shape and
    /// the planner scales it to a model's (see `schemas/src/moe_tiles.rs`). Absent from
    /// probes written before it was recorded, which all measured 512 tokens top-8 of 128
    /// experts: 32, the planner's default (not a guess).
    #[serde(default)]
    pub expert_gemm_tokens_per_expert: Option<f64>,
    /// Qwen3-Next's Gated DeltaNet (`launch::linear::delta_rule`, `lin_delta_rule` +
    /// `lin_gated_norm`) at the probe's reference heads (16 key heads, 32 value heads of 128,
    /// the 80B's): one token's step of one layer inside a prefill run (the recurrence is a
    /// serial chain per state row: its latency per token, not bandwidth, bounds a prefill
    /// pass), and a decode step's launch per layer beyond its state bytes, with the state
    /// bytes (read and written once a step, every slot) per second. See
    /// [`CostProbe::linear_entries`].
    #[serde(default)]
    pub delta_rule_token_us: Option<f64>,
    #[serde(default)]
    pub delta_rule_latency_us: Option<f64>,
    #[serde(default)]
    pub linear_state_gbps: Option<f64>,
    /// `[device.cost.types.<TYPE>]`: the weight products' rates with weights of one type
    /// (llama.cpp's spelling, "Q4_K", "IQ3_S"), measured by `strata-exec probe` per type the
    /// engine runs. The family keys above are the Q8_0 figures; a type absent here takes its
    /// family key scaled by the planner's default ratio for the type (a guess).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub types: BTreeMap<String, TypeRates>,
}

/// `[device.cost.types.<TYPE>]`: the family rates of [`CostProbe`] with weights of one type.
/// Every key is optional; an absent one takes the family key scaled by the default ratio.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TypeRates {
    /// Weight bytes per second of one-token dense products (as `product_gbps`).
    #[serde(default)]
    pub product_gbps: Option<f64>,
    /// Expert bytes per second of the decode expert pair (as `expert_gbps`).
    #[serde(default)]
    pub expert_gbps: Option<f64>,
    /// Prefill products, TFLOP/s (as `gemm_tflops`).
    #[serde(default)]
    pub gemm_tflops: Option<f64>,
    /// Prefill grouped expert products, TFLOP/s (as `expert_gemm_tflops`).
    #[serde(default)]
    pub expert_gemm_tflops: Option<f64>,
}

impl TypeRates {
    /// Every key with its value, in file order.
    pub fn entries(&self) -> [(&'static str, Option<f64>); 4] {
        [
            ("product_gbps", self.product_gbps),
            ("expert_gbps", self.expert_gbps),
            ("gemm_tflops", self.gemm_tflops),
            ("expert_gemm_tflops", self.expert_gemm_tflops),
        ]
    }
}

impl CostProbe {
    /// Every key with its value, in file order (for validation and the report).
    pub fn entries(&self) -> [(&'static str, Option<f64>); 14] {
        [
            ("launch_us", self.launch_us),
            ("product_latency_us", self.product_latency_us),
            ("product_gbps", self.product_gbps),
            ("attention_latency_us", self.attention_latency_us),
            ("attention_gbps", self.attention_gbps),
            ("gemm_tflops", self.gemm_tflops),
            ("prefill_attention_tflops", self.prefill_attention_tflops),
            ("step_us", self.step_us),
            ("host_expert_gbps", self.host_expert_gbps),
            ("host_expert_pinned_gbps", self.host_expert_pinned_gbps),
            ("expert_latency_us", self.expert_latency_us),
            ("expert_gbps", self.expert_gbps),
            ("expert_pass_gbps", self.expert_pass_gbps),
            ("expert_gemm_tflops", self.expert_gemm_tflops),
        ]
    }

    /// The keys of the host paths (misses computed on the host CPU, spilled KV attended
    /// there, the eager launches such steps pay): a probe is complete without them (older
    /// probes lack some), and a plan whose device misses or spills takes their defaults as
    /// guesses.
    pub fn host_entries(&self) -> [(&'static str, Option<f64>); 5] {
        [
            ("host_matvec_gbps", self.host_matvec_gbps),
            ("host_expert_latency_us", self.host_expert_latency_us),
            ("host_round_trip_us", self.host_round_trip_us),
            ("kv_host_round_trip_us", self.kv_host_round_trip_us),
            ("eager_launch_us", self.eager_launch_us),
        ]
    }

    /// The keys of the linear-attention (Gated DeltaNet) kernels: a probe is complete
    /// without them (older probes lack them), and only a plan whose device holds linear
    /// layers takes their defaults as guesses.
    pub fn linear_entries(&self) -> [(&'static str, Option<f64>); 3] {
        [
            ("delta_rule_token_us", self.delta_rule_token_us),
            ("delta_rule_latency_us", self.delta_rule_latency_us),
            ("linear_state_gbps", self.linear_state_gbps),
        ]
    }

    /// Whether every key `strata-exec probe` measures is present (the prediction then rests
    /// on measurements only, misses aside).
    pub fn complete(&self) -> bool {
        self.entries().iter().all(|(_, v)| v.is_some())
    }

    /// The rates measured with weights of `ty`, if the probe has a table for it (names
    /// match case-insensitively, as [`GgmlType::from_name`] parses them).
    pub fn type_rates(&self, ty: GgmlType) -> Option<&TypeRates> {
        self.types
            .iter()
            .find(|(k, _)| GgmlType::from_name(k) == Some(ty))
            .map(|(_, v)| v)
    }
}

impl DeviceProbe {
    pub fn runtime_reserve(&self) -> u64 {
        self.runtime_reserve_bytes
            .unwrap_or_else(|| self.vendor.default_runtime_reserve())
    }
    pub fn mem_bandwidth(&self) -> f64 {
        self.mem_bandwidth_gbps.unwrap_or(300.0)
    }
    /// Host-to-device GB/s: measured, else ~80% of the PCIe link, else 12.
    pub fn h2d(&self) -> f64 {
        if let Some(v) = self.h2d_gbps {
            return v;
        }
        if self.vendor == Vendor::Cpu {
            return self.mem_bandwidth();
        }
        match (self.pcie_gen, self.pcie_width) {
            (Some(g), Some(w)) if g >= 1 => {
                let per_lane = match g {
                    1 => 0.25,
                    2 => 0.5,
                    3 => 0.985,
                    4 => 1.969,
                    5 => 3.938,
                    _ => 7.563,
                };
                per_lane * w as f64 * 0.8
            }
            _ => 12.0,
        }
    }
}

/// A whole probe file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HardwareProbe {
    pub host: HostProbe,
    #[serde(rename = "device", default)]
    pub devices: Vec<DeviceProbe>,
}

/// Errors reading a probe.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error(transparent)]
    File(#[from] crate::files::FileError),
    #[error("hardware probe {path}: {message}")]
    Parse { path: String, message: String },
    #[error("hardware probe {path}: `{key}` {reason}")]
    Invalid {
        path: String,
        key: String,
        reason: String,
    },
}

impl HardwareProbe {
    /// Read and validate a probe file.
    pub fn from_file(path: &Path) -> Result<Self, ProbeError> {
        let text =
            crate::files::read_text_limited(path, crate::files::limit::TOML, "hardware probe")?;
        Self::from_toml(&text, &path.display().to_string())
    }

    /// Parse and validate probe text; `origin` names it in errors.
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, ProbeError> {
        let probe: HardwareProbe = toml::from_str(text).map_err(|e| ProbeError::Parse {
            path: origin.to_string(),
            message: e.to_string().trim_end().to_string(),
        })?;
        probe.validate(origin)?;
        Ok(probe)
    }

    fn validate(&self, origin: &str) -> Result<(), ProbeError> {
        let bad = |key: String, reason: &str| ProbeError::Invalid {
            path: origin.to_string(),
            key,
            reason: reason.to_string(),
        };
        if self.host.ram_bytes == 0 {
            return Err(bad("host.ram_bytes".into(), "must be greater than zero"));
        }
        if self.host.available_bytes == 0 {
            return Err(bad(
                "host.available_bytes".into(),
                "must be greater than zero",
            ));
        }
        if self.host.available_bytes > self.host.ram_bytes {
            return Err(bad(
                "host.available_bytes".into(),
                "is larger than host.ram_bytes",
            ));
        }
        if let Some(g) = self.host.disk_read_gbps {
            if !(g.is_finite() && g > 0.0) {
                return Err(bad(
                    "host.disk_read_gbps".into(),
                    "must be a positive number",
                ));
            }
        }
        if self.devices.is_empty() {
            return Err(bad(
                "device".into(),
                "is missing: a probe needs at least one [[device]] (vendor = \"cpu\" for a CPU plan)",
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        for (i, d) in self.devices.iter().enumerate() {
            let k = |f: &str| format!("device[{i}].{f}");
            if !seen.insert(d.index) {
                return Err(bad(
                    k("index"),
                    "repeats an index used by an earlier device",
                ));
            }
            if d.vram_bytes == 0 {
                return Err(bad(k("vram_bytes"), "must be greater than zero"));
            }
            if let Some(f) = d.free_bytes {
                if f > d.vram_bytes {
                    return Err(bad(k("free_bytes"), "is larger than vram_bytes"));
                }
            }
            if d.runtime_reserve() >= d.vram_bytes {
                return Err(bad(
                    k("runtime_reserve_bytes"),
                    "leaves nothing of vram_bytes for the plan",
                ));
            }
            for (name, v) in [
                ("mem_bandwidth_gbps", d.mem_bandwidth_gbps),
                ("h2d_gbps", d.h2d_gbps),
            ] {
                if let Some(v) = v {
                    if !(v.is_finite() && v > 0.0) {
                        return Err(bad(k(name), "must be a positive number"));
                    }
                }
            }
            let keys = d.cost.iter().flat_map(|c| {
                c.entries()
                    .into_iter()
                    .chain(c.host_entries())
                    .chain(c.linear_entries())
                    .chain([(
                        "expert_gemm_tokens_per_expert",
                        c.expert_gemm_tokens_per_expert,
                    )])
            });
            for (name, v) in keys {
                if let Some(v) = v {
                    if !(v.is_finite() && v >= 0.0) {
                        return Err(bad(k(&format!("cost.{name}")), "must be a number >= 0"));
                    }
                }
            }
            if let Some(t) = d
                .cost
                .as_ref()
                .and_then(|c| c.expert_gemm_tokens_per_expert)
            {
                if t <= 0.0 {
                    return Err(bad(
                        k("cost.expert_gemm_tokens_per_expert"),
                        "must be positive (tokens x experts used / experts of the measured pass)",
                    ));
                }
            }
            for (ty, rates) in d.cost.iter().flat_map(|c| &c.types) {
                if GgmlType::from_name(ty).is_none() {
                    return Err(bad(
                        k(&format!("cost.types.{ty}")),
                        "is not a weight type (llama.cpp's spelling: Q8_0, Q4_K, IQ3_S, ...)",
                    ));
                }
                for (name, v) in rates.entries() {
                    if let Some(v) = v {
                        if !(v.is_finite() && v > 0.0) {
                            return Err(bad(
                                k(&format!("cost.types.{ty}.{name}")),
                                "must be a positive number",
                            ));
                        }
                    }
                }
            }
            if d.name.trim().is_empty() {
                return Err(bad(k("name"), "is empty"));
            }
        }
        for (i, d) in self.devices.iter().enumerate() {
            for &p in d.peers.iter().flatten() {
                if p == d.index || !self.devices.iter().any(|o| o.index == p) {
                    return Err(bad(
                        format!("device[{i}].peers"),
                        "lists an index that is not another [[device]] of this probe",
                    ));
                }
            }
        }
        Ok(())
    }

    /// The device with probe index `index`.
    pub fn device(&self, index: u32) -> Option<&DeviceProbe> {
        self.devices.iter().find(|d| d.index == index)
    }

    /// Fingerprint of what a plan depends on and live hardware must match: each device's
    /// index, name, vendor, arch and total memory, in probe order. Free memory, bandwidths
    /// and host RAM are checked at start-up against the plan's numbers, not fingerprinted.
    pub fn fingerprint(&self) -> String {
        let mut h = Sha256::new();
        for d in &self.devices {
            h.update(d.index.to_le_bytes());
            h.update(d.name.as_bytes());
            h.update([0]);
            h.update(d.vendor.as_str().as_bytes());
            h.update(d.arch.as_bytes());
            h.update([0]);
            h.update(d.vram_bytes.to_le_bytes());
        }
        crate::inventory::hex16(&h.finalize())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: &str = r#"
[host]
ram_bytes = 68719476736
available_bytes = 64000000000

[[device]]
index = 0
name = "NVIDIA GeForce RTX 3060"
vendor = "nvidia"
arch = "sm_86"
vram_bytes = 12884901888
mem_bandwidth_gbps = 360.0
pcie_gen = 4
pcie_width = 16
"#;

    #[test]
    fn parses_and_fills_defaults() {
        let p = HardwareProbe::from_toml(OK, "t.toml").unwrap();
        assert_eq!(p.devices.len(), 1);
        assert_eq!(p.host.memlock_limit_bytes, None);
        let d = &p.devices[0];
        assert_eq!(d.runtime_reserve(), 640 * MIB);
        assert!((d.h2d() - 25.2).abs() < 0.1, "{}", d.h2d());
    }

    #[test]
    fn unknown_key_is_named() {
        let text = OK.replace("pcie_width = 16", "pcie_widht = 16");
        let e = HardwareProbe::from_toml(&text, "t.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("pcie_widht"), "{e}");
        assert!(e.contains("t.toml"), "{e}");
    }

    #[test]
    fn zero_vram_and_duplicate_index_are_refused() {
        let text = OK.replace("vram_bytes = 12884901888", "vram_bytes = 0");
        let e = HardwareProbe::from_toml(&text, "t.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("device[0].vram_bytes"), "{e}");
        let dup = format!("{OK}\n{}", &OK[OK.find("[[device]]").unwrap()..]);
        let e = HardwareProbe::from_toml(&dup, "t.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("device[1].index"), "{e}");
    }

    #[test]
    fn peers_name_other_devices_of_the_probe() {
        let second = OK[OK.find("[[device]]").unwrap()..].replace("index = 0", "index = 1");
        let two = format!("{OK}peers = [1]\n\n{second}");
        let p = HardwareProbe::from_toml(&two, "t.toml").unwrap();
        assert_eq!(p.devices[0].peers, Some(vec![1]));
        assert_eq!(p.devices[1].peers, None);
        for bad in ["peers = [0]", "peers = [7]"] {
            let text = format!("{OK}{bad}\n\n{second}");
            let e = HardwareProbe::from_toml(&text, "t.toml")
                .unwrap_err()
                .to_string();
            assert!(e.contains("device[0].peers"), "{bad}: {e}");
        }
    }

    #[test]
    fn cost_keys_parse_and_are_checked() {
        let text = format!("{OK}\n[device.cost]\nproduct_gbps = 3010.0\nlaunch_us = 2.8\n");
        let p = HardwareProbe::from_toml(&text, "t.toml").unwrap();
        let c = p.devices[0].cost.as_ref().unwrap();
        assert_eq!(c.product_gbps, Some(3010.0));
        assert_eq!(c.launch_us, Some(2.8));
        assert!(!c.complete());
        let typo = format!("{OK}\n[device.cost]\nproduct_gbs = 3010.0\n");
        let e = HardwareProbe::from_toml(&typo, "t.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("product_gbs"), "{e}");
        let neg = format!("{OK}\n[device.cost]\ngemm_tflops = -1.0\n");
        let e = HardwareProbe::from_toml(&neg, "t.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("device[0].cost.gemm_tflops"), "{e}");
    }

    #[test]
    fn per_type_rates_parse_round_trip_and_are_checked() {
        let text = format!(
            "{OK}\n[device.cost]\nproduct_gbps = 3010.0\n\n[device.cost.types.Q4_K]\nproduct_gbps = 2500.0\ngemm_tflops = 80.0\n\n[device.cost.types.IQ3_S]\nexpert_gbps = 1500.0\n"
        );
        let p = HardwareProbe::from_toml(&text, "t.toml").unwrap();
        let c = p.devices[0].cost.as_ref().unwrap();
        let q4 = c.type_rates(GgmlType::Q4K).unwrap();
        assert_eq!(q4.product_gbps, Some(2500.0));
        assert_eq!(q4.gemm_tflops, Some(80.0));
        assert_eq!(q4.expert_gbps, None);
        assert_eq!(
            c.type_rates(GgmlType::Iq3S).unwrap().expert_gbps,
            Some(1500.0)
        );
        assert!(c.type_rates(GgmlType::Q6K).is_none());
        // Serialised and read back, the table is the same.
        let again = toml::to_string(&p).unwrap();
        assert_eq!(HardwareProbe::from_toml(&again, "again").unwrap(), p);
        // An old probe (no table) reads with an empty one and writes none.
        let old = HardwareProbe::from_toml(&format!("{OK}\n[device.cost]\nlaunch_us = 2.8\n"), "o")
            .unwrap();
        let oc = old.devices[0].cost.as_ref().unwrap();
        assert!(oc.types.is_empty());
        assert!(!toml::to_string(&old).unwrap().contains("types"));
        // Unknown types, unknown keys and non-positive rates are named.
        for (bad, key) in [
            (
                "[device.cost.types.Q4_Z]\nproduct_gbps = 1.0\n",
                "cost.types.Q4_Z",
            ),
            (
                "[device.cost.types.Q4_K]\nproduct_gbs = 1.0\n",
                "product_gbs",
            ),
            (
                "[device.cost.types.Q4_K]\ngemm_tflops = 0.0\n",
                "cost.types.Q4_K.gemm_tflops",
            ),
        ] {
            let text = format!("{OK}\n[device.cost]\nlaunch_us = 2.8\n\n{bad}");
            let e = HardwareProbe::from_toml(&text, "t.toml")
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{bad}: {e}");
        }
    }

    #[test]
    fn linear_and_tile_shape_keys_parse_and_are_checked() {
        let text = format!(
            "{OK}\n[device.cost]\ndelta_rule_token_us = 0.9\ndelta_rule_latency_us = 6.0\nlinear_state_gbps = 2500.0\nexpert_gemm_tokens_per_expert = 32.0\n"
        );
        let p = HardwareProbe::from_toml(&text, "t.toml").unwrap();
        let c = p.devices[0].cost.as_ref().unwrap();
        assert_eq!(
            c.linear_entries(),
            [
                ("delta_rule_token_us", Some(0.9)),
                ("delta_rule_latency_us", Some(6.0)),
                ("linear_state_gbps", Some(2500.0)),
            ]
        );
        assert_eq!(c.expert_gemm_tokens_per_expert, Some(32.0));
        // Not among the keys a complete probe needs: older probes lack them.
        assert!(!c.entries().iter().any(|(k, _)| k.starts_with("delta")));
        for (bad, key) in [
            ("delta_rule_token_us = -1.0", "cost.delta_rule_token_us"),
            ("linear_state_gbps = -2.0", "cost.linear_state_gbps"),
            (
                "expert_gemm_tokens_per_expert = 0.0",
                "cost.expert_gemm_tokens_per_expert",
            ),
        ] {
            let text = format!("{OK}\n[device.cost]\n{bad}\n");
            let e = HardwareProbe::from_toml(&text, "t.toml")
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{bad}: {e}");
        }
    }

    #[test]
    fn negative_size_is_a_parse_error_naming_the_key() {
        let text = OK.replace("ram_bytes = 68719476736", "ram_bytes = -1");
        let e = HardwareProbe::from_toml(&text, "t.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("ram_bytes"), "{e}");
    }
}
