//! Serve settings: what the user asks the planner for, as flags or as the same keys in a
//! `--serve serve.toml`. Invariant: a `ServeSettings` that passed `validate` has no zero
//! sizes, a known KV type and a consistent speculative/MTP request.

use crate::ggml::GgmlType;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// KV cache element type.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    Default,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
#[rkyv(derive(Debug, PartialEq, Eq, Clone, Copy))]
pub enum KvType {
    #[default]
    #[serde(rename = "f16")]
    F16,
    #[serde(rename = "q8_0")]
    Q8_0,
}

impl KvType {
    pub fn ggml(self) -> GgmlType {
        match self {
            KvType::F16 => GgmlType::F16,
            KvType::Q8_0 => GgmlType::Q8_0,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            KvType::F16 => "f16",
            KvType::Q8_0 => "q8_0",
        }
    }
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "f16" => Ok(KvType::F16),
            "q8_0" | "int8" => Ok(KvType::Q8_0),
            other => Err(format!("unknown KV type `{other}`: use f16 or q8_0")),
        }
    }
}

/// `--expert-cache auto|N|off`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
#[rkyv(derive(Debug, PartialEq, Eq, Clone, Copy))]
pub enum ExpertCache {
    /// The cache takes every byte left after the required and requested items.
    #[default]
    Auto,
    /// At most this many expert slots in total (over all devices).
    Slots(u64),
    /// Only the minimum working set: every expert is uploaded on use.
    Off,
}

impl ExpertCache {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(ExpertCache::Auto),
            "off" => Ok(ExpertCache::Off),
            n => n
                .parse::<u64>()
                .map(ExpertCache::Slots)
                .map_err(|_| format!("`{n}` is not auto, off or a number of expert slots")),
        }
    }
}

impl std::fmt::Display for ExpertCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExpertCache::Auto => f.write_str("auto"),
            ExpertCache::Off => f.write_str("off"),
            ExpertCache::Slots(n) => write!(f, "{n}"),
        }
    }
}

/// `--layer-split auto|16,32`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum LayerSplit {
    #[default]
    Auto,
    /// Layer boundaries: device i holds `[b[i-1], b[i])`; one fewer than the devices.
    Bounds(Vec<u32>),
}

impl LayerSplit {
    pub fn parse(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(LayerSplit::Auto);
        }
        s.split(',')
            .map(|p| {
                p.trim().parse::<u32>().map_err(|_| {
                    format!("`{p}` in `{s}` is not a layer number (use auto or e.g. 16,32)")
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(LayerSplit::Bounds)
    }
}

impl std::fmt::Display for LayerSplit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LayerSplit::Auto => f.write_str("auto"),
            LayerSplit::Bounds(b) => {
                let s: Vec<String> = b.iter().map(|x| x.to_string()).collect();
                f.write_str(&s.join(","))
            }
        }
    }
}

/// RoPE scaling request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    /// Only "yarn" is supported.
    pub kind: String,
    pub factor: f64,
    /// Original (trained) context; absent = the model's.
    pub orig_ctx: Option<u64>,
}

/// Everything the user asks for. Field docs are the flag docs.
#[derive(Debug, Clone, PartialEq)]
pub struct ServeSettings {
    /// `--max-context`: cells per slot (tokens of prompt + generation).
    pub max_context: u64,
    /// `--batch`: slot sessions decoded together.
    pub batch: u32,
    /// `--kv`.
    pub kv: KvType,
    /// `--kv-resident`: cells per slot kept in VRAM; the rest of each slot's context lives in
    /// pinned host memory. Absent = the whole context.
    pub kv_resident: Option<u64>,
    /// `--ubatch`: tokens per prefill step; sizes the scratch.
    pub ubatch: u32,
    /// `--mtp`: load the MTP draft head.
    pub mtp: bool,
    /// `--spec N`: draft tokens per step (implies `--mtp`); 0 = no speculation.
    pub spec: u32,
    /// Not `--no-prefix-checkpoint`: models with linear attention get one checkpoint of each
    /// slot's linear state, so the server's prefix cache can rewind a slot to its last prompt.
    pub prefix_checkpoint: bool,
    /// `--vision [mmproj.gguf]`: plan the vision tower; `Some(None)` = from the descriptor.
    pub vision: Option<Option<String>>,
    /// `--vram-reserve-mib`: left untouched on every device.
    pub vram_reserve_mib: u64,
    /// `--expert-cache`.
    pub expert_cache: ExpertCache,
    /// `--expert-profile FILE`.
    pub expert_profile: Option<String>,
    /// `--layer-split`.
    pub layer_split: LayerSplit,
    /// `--gpu 0,1,2`: probe indices, in pipeline order; absent = every probe device.
    pub gpu: Option<Vec<u32>>,
    /// `--pinned-chunk-mib`: largest single pinned host allocation.
    pub pinned_chunk_mib: u64,
    /// `--rope-scaling yarn --rope-scale F --yarn-orig-ctx N`.
    pub rope_scaling: Option<RopeScaling>,
}

impl Default for ServeSettings {
    fn default() -> Self {
        Self {
            max_context: 4096,
            batch: 1,
            kv: KvType::F16,
            kv_resident: None,
            ubatch: 512,
            mtp: false,
            spec: 0,
            prefix_checkpoint: true,
            vision: None,
            vram_reserve_mib: 0,
            expert_cache: ExpertCache::Auto,
            expert_profile: None,
            layer_split: LayerSplit::Auto,
            gpu: None,
            pinned_chunk_mib: 256,
            rope_scaling: None,
        }
    }
}

/// The TOML form of the settings: the flags' names as keys. Every key is optional.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ServeToml {
    pub max_context: Option<u64>,
    pub batch: Option<u32>,
    pub kv: Option<String>,
    pub kv_resident: Option<u64>,
    pub ubatch: Option<u32>,
    pub mtp: Option<bool>,
    pub spec: Option<u32>,
    pub no_prefix_checkpoint: Option<bool>,
    /// `true` = from the descriptor; a string = an mmproj file.
    pub vision: Option<toml::Value>,
    pub vram_reserve_mib: Option<u64>,
    pub expert_cache: Option<toml::Value>,
    pub expert_profile: Option<String>,
    pub layer_split: Option<toml::Value>,
    pub gpu: Option<Vec<u32>>,
    pub pinned_chunk_mib: Option<u64>,
    pub rope_scaling: Option<String>,
    pub rope_scale: Option<f64>,
    pub yarn_orig_ctx: Option<u64>,
}

/// A bad setting, naming the flag/key.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("{origin}`{key}`: {reason}")]
pub struct ServeError {
    /// "serve.toml: " or "" for flags.
    pub origin: String,
    pub key: String,
    pub reason: String,
}

fn err(origin: &str, key: &str, reason: impl Into<String>) -> ServeError {
    ServeError {
        origin: origin.to_string(),
        key: key.to_string(),
        reason: reason.into(),
    }
}

impl ServeToml {
    /// Read a serve TOML file.
    pub fn from_file(path: &Path) -> Result<Self, ServeError> {
        let origin = format!("{}: ", path.display());
        let text = crate::files::read_text_limited(path, crate::files::limit::TOML, "serve file")
            .map_err(|e| err(&origin, "--serve", e.to_string()))?;
        toml::from_str(&text)
            .map_err(|e| err(&origin, "toml", e.to_string().trim_end().to_string()))
    }

    /// Apply the keys present onto `s`.
    pub fn apply(&self, s: &mut ServeSettings, origin: &str) -> Result<(), ServeError> {
        let o = origin;
        if let Some(v) = self.max_context {
            s.max_context = v;
        }
        if let Some(v) = self.batch {
            s.batch = v;
        }
        if let Some(v) = &self.kv {
            s.kv = KvType::parse(v).map_err(|r| err(o, "kv", r))?;
        }
        if let Some(v) = self.kv_resident {
            s.kv_resident = Some(v);
        }
        if let Some(v) = self.ubatch {
            s.ubatch = v;
        }
        if let Some(v) = self.mtp {
            s.mtp = v;
        }
        if let Some(v) = self.spec {
            s.spec = v;
        }
        if let Some(v) = self.no_prefix_checkpoint {
            s.prefix_checkpoint = !v;
        }
        match &self.vision {
            None => {}
            Some(toml::Value::Boolean(true)) => s.vision = Some(None),
            Some(toml::Value::Boolean(false)) => s.vision = None,
            Some(toml::Value::String(p)) => s.vision = Some(Some(p.clone())),
            Some(_) => return Err(err(o, "vision", "must be true, false or an mmproj path")),
        }
        if let Some(v) = self.vram_reserve_mib {
            s.vram_reserve_mib = v;
        }
        match &self.expert_cache {
            None => {}
            Some(toml::Value::String(t)) => {
                s.expert_cache = ExpertCache::parse(t).map_err(|r| err(o, "expert-cache", r))?
            }
            Some(toml::Value::Integer(n)) if *n >= 0 => {
                s.expert_cache = ExpertCache::Slots(*n as u64)
            }
            Some(_) => {
                return Err(err(
                    o,
                    "expert-cache",
                    "must be \"auto\", \"off\" or a slot count",
                ))
            }
        }
        if let Some(v) = &self.expert_profile {
            s.expert_profile = Some(v.clone());
        }
        match &self.layer_split {
            None => {}
            Some(toml::Value::String(t)) => {
                s.layer_split = LayerSplit::parse(t).map_err(|r| err(o, "layer-split", r))?
            }
            Some(toml::Value::Array(a)) => {
                let mut b = Vec::new();
                for x in a {
                    match x.as_integer() {
                        Some(n) if n >= 0 && n <= u32::MAX as i64 => b.push(n as u32),
                        _ => {
                            return Err(err(o, "layer-split", "array items must be layer numbers"))
                        }
                    }
                }
                s.layer_split = LayerSplit::Bounds(b);
            }
            Some(_) => {
                return Err(err(
                    o,
                    "layer-split",
                    "must be \"auto\", \"16,32\" or [16, 32]",
                ))
            }
        }
        if let Some(v) = &self.gpu {
            s.gpu = Some(v.clone());
        }
        if let Some(v) = self.pinned_chunk_mib {
            s.pinned_chunk_mib = v;
        }
        if self.rope_scaling.is_some() || self.rope_scale.is_some() || self.yarn_orig_ctx.is_some()
        {
            s.rope_scaling = Some(RopeScaling {
                kind: self.rope_scaling.clone().unwrap_or_else(|| "yarn".into()),
                factor: self.rope_scale.unwrap_or(0.0),
                orig_ctx: self.yarn_orig_ctx,
            });
        }
        Ok(())
    }
}

impl ServeSettings {
    /// Resident KV cells per slot as asked (the whole context when `--kv-resident` is absent).
    pub fn kv_resident_cells(&self) -> u64 {
        self.kv_resident
            .unwrap_or(self.max_context)
            .min(self.max_context)
    }

    /// Whether the MTP head is asked for (`--mtp` or `--spec N>0`).
    pub fn wants_mtp(&self) -> bool {
        self.mtp || self.spec > 0
    }

    /// Check sizes and combinations; `origin` is "" for flags or "serve.toml: ".
    pub fn validate(&self, origin: &str) -> Result<(), ServeError> {
        let o = origin;
        if self.max_context == 0 {
            return Err(err(o, "--max-context", "must be at least 1 cell"));
        }
        if self.batch == 0 {
            return Err(err(o, "--batch", "must be at least 1 slot"));
        }
        if self.batch > 4096 {
            return Err(err(
                o,
                "--batch",
                "more than 4096 slots is not a serving configuration",
            ));
        }
        if self.ubatch == 0 {
            return Err(err(o, "--ubatch", "must be at least 1 token"));
        }
        if self.pinned_chunk_mib == 0 {
            return Err(err(o, "--pinned-chunk-mib", "must be at least 1 MiB"));
        }
        if self.pinned_chunk_mib > 64 * 1024 {
            return Err(err(
                o,
                "--pinned-chunk-mib",
                "chunks above 64 GiB defeat the point of chunking",
            ));
        }
        if let Some(r) = self.kv_resident {
            if r == 0 {
                return Err(err(
                    o,
                    "--kv-resident",
                    "must be at least 1 cell (omit it to keep the whole context resident)",
                ));
            }
            if r > self.max_context {
                return Err(err(
                    o,
                    "--kv-resident",
                    format!("{r} is larger than --max-context {}", self.max_context),
                ));
            }
        }
        if self.spec > 16 {
            return Err(err(o, "--spec", "at most 16 draft tokens per step"));
        }
        if let Some(r) = &self.rope_scaling {
            if r.kind != "yarn" {
                return Err(err(
                    o,
                    "--rope-scaling",
                    format!("`{}` is not supported: use yarn", r.kind),
                ));
            }
            if !(r.factor.is_finite() && r.factor > 1.0) {
                return Err(err(o, "--rope-scale", "must be a number above 1 (e.g. 4)"));
            }
            if r.orig_ctx == Some(0) {
                return Err(err(o, "--yarn-orig-ctx", "must be at least 1"));
            }
        }
        if let Some(g) = &self.gpu {
            if g.is_empty() {
                return Err(err(o, "--gpu", "lists no device"));
            }
            let mut s = g.clone();
            s.sort_unstable();
            s.dedup();
            if s.len() != g.len() {
                return Err(err(o, "--gpu", "lists a device twice"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_keys_mirror_flags() {
        let t: ServeToml = toml::from_str(
            r#"
max-context = 1048576
batch = 4
kv = "q8_0"
kv-resident = 32768
expert-cache = "auto"
layer-split = [16, 32]
rope-scaling = "yarn"
rope-scale = 4.0
yarn-orig-ctx = 262144
vision = true
"#,
        )
        .unwrap();
        let mut s = ServeSettings::default();
        t.apply(&mut s, "serve.toml: ").unwrap();
        s.validate("serve.toml: ").unwrap();
        assert_eq!(s.batch, 4);
        assert_eq!(s.kv, KvType::Q8_0);
        assert_eq!(s.layer_split, LayerSplit::Bounds(vec![16, 32]));
        assert_eq!(s.kv_resident_cells(), 32768);
        assert_eq!(s.vision, Some(None));
    }

    #[test]
    fn unknown_toml_key_is_an_error() {
        let e = toml::from_str::<ServeToml>("max-contxt = 5")
            .unwrap_err()
            .to_string();
        assert!(e.contains("max-contxt"), "{e}");
    }

    #[test]
    fn zero_sizes_name_the_flag() {
        let s = ServeSettings {
            batch: 0,
            ..Default::default()
        };
        assert_eq!(s.validate("").unwrap_err().key, "--batch");
        let s = ServeSettings {
            kv_resident: Some(10_000),
            max_context: 4096,
            ..Default::default()
        };
        assert_eq!(s.validate("").unwrap_err().key, "--kv-resident");
    }

    #[test]
    fn parsers() {
        assert_eq!(ExpertCache::parse("12").unwrap(), ExpertCache::Slots(12));
        assert!(ExpertCache::parse("-1").is_err());
        assert!(LayerSplit::parse("16,x").is_err());
        assert_eq!(KvType::parse("int8").unwrap(), KvType::Q8_0);
    }
}
