//! `strata-plan model-info`: what a model file holds — architecture, parameter count, bytes by
//! role, quant mix, key hyperparameters — for ANY valid GGUF (also architectures Strata cannot
//! plan) and for any inventory (descriptor, safetensors folder).
//! Invariant: the role buckets partition the tensors (every tensor's bytes are counted in
//! exactly one bucket, so they sum to `total_bytes`), and the quant mix sums to the same total.
//!
//! Roles come from [`arch::classify`]: `embedding` (`token_embd`), `head` (`output` and
//! `output_norm`), `mtp` (every tensor of an MTP block — block index >= `block_count -
//! nextn_predict_layers` — and any `blk.N.nextn.*`), `experts` (routed expert stacks `*_exps`
//! outside MTP blocks), `dense` (everything else: attention, norms, routers, shared experts,
//! dense FFNs and unknown global tensors).

use crate::arch;
use crate::ggml::GgmlType;
use crate::gguf::{model, GgufFile, GgufValue};
use crate::graph::{forward_graph, GraphParams};
use crate::inventory::{ModelInventory, TensorRole};
use serde::Serialize;
use std::collections::BTreeMap;

/// Bytes per role (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RoleBytes {
    pub dense: u64,
    pub experts: u64,
    pub embedding: u64,
    pub head: u64,
    pub mtp: u64,
}

/// One ggml type's share of the file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct QuantShare {
    #[serde(rename = "type")]
    pub ggml_type: GgmlType,
    pub tensors: u64,
    pub params: u64,
    pub bytes: u64,
}

/// What `model-info` prints.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelInfo {
    /// The path given.
    pub source: String,
    /// llama.cpp architecture name (`general.architecture`).
    pub arch: String,
    /// `general.name` or the descriptor name, when there is one.
    pub name: Option<String>,
    /// Files the model spans (GGUF split parts; 1 otherwise).
    pub files: u64,
    pub tensors: u64,
    /// Sum of tensor elements.
    pub params: u64,
    pub total_bytes: u64,
    pub bytes: RoleBytes,
    /// By bytes, largest first (ties by type name).
    pub quant_mix: Vec<QuantShare>,
    /// Hyperparameters: a GGUF's `{arch}.*` scalar keys with the prefix dropped (plus
    /// `vocab_size` from `token_embd`), or an inventory's `HParams` fields.
    pub hparams: BTreeMap<String, serde_json::Value>,
    /// Whether `strata-plan --model` accepts it.
    pub plannable: bool,
    /// Why not, or what is approximate about it.
    pub planning_note: Option<String>,
}

/// Accumulates tensors into role buckets and the quant mix.
struct Acc {
    bytes: RoleBytes,
    mix: BTreeMap<GgmlType, QuantShare>,
    params: u64,
    total: u64,
    n: u64,
}

impl Acc {
    fn new() -> Self {
        Self {
            bytes: RoleBytes::default(),
            mix: BTreeMap::new(),
            params: 0,
            total: 0,
            n: 0,
        }
    }

    fn add(&mut self, name: &str, dims: &[u64], ty: GgmlType, bytes: u64, n_layer: Option<u32>) {
        let (role, layer) = arch::classify(name);
        let in_mtp = matches!((layer, n_layer), (Some(l), Some(n)) if l >= n);
        let bucket = match role {
            TensorRole::MtpExtra => &mut self.bytes.mtp,
            _ if in_mtp => &mut self.bytes.mtp,
            TensorRole::Embedding => &mut self.bytes.embedding,
            TensorRole::Head | TensorRole::OutputNorm => &mut self.bytes.head,
            TensorRole::ExpertStack => &mut self.bytes.experts,
            TensorRole::Dense => &mut self.bytes.dense,
        };
        *bucket = bucket.saturating_add(bytes);
        let elems = dims.iter().fold(1u64, |a, d| a.saturating_mul(*d));
        let q = self.mix.entry(ty).or_insert(QuantShare {
            ggml_type: ty,
            tensors: 0,
            params: 0,
            bytes: 0,
        });
        q.tensors += 1;
        q.params = q.params.saturating_add(elems);
        q.bytes = q.bytes.saturating_add(bytes);
        self.params = self.params.saturating_add(elems);
        self.total = self.total.saturating_add(bytes);
        self.n += 1;
    }

    fn mix(self) -> (RoleBytes, Vec<QuantShare>, u64, u64, u64) {
        let mut mix: Vec<QuantShare> = self.mix.into_values().collect();
        mix.sort_by(|a, b| {
            b.bytes
                .cmp(&a.bytes)
                .then(a.ggml_type.name().cmp(b.ggml_type.name()))
        });
        (self.bytes, mix, self.params, self.total, self.n)
    }
}

fn json_of(v: &GgufValue) -> Option<serde_json::Value> {
    use serde_json::Value as J;
    Some(match v {
        GgufValue::Bool(b) => J::Bool(*b),
        GgufValue::String(s) => J::String(s.clone()),
        GgufValue::F32(x) => {
            let x = x.to_string().parse::<f64>().ok()?;
            serde_json::Number::from_f64(x).map(J::Number)?
        }
        GgufValue::F64(x) => serde_json::Number::from_f64(*x).map(J::Number)?,
        GgufValue::Array(_) => return None,
        other => match other.as_u64() {
            Some(u) => J::from(u),
            None => J::from(other.as_f64()? as i64),
        },
    })
}

/// Describe any valid GGUF. Never fails: an architecture Strata cannot plan (or a file whose
/// tensors do not match its architecture) is reported in `plannable` / `planning_note`.
pub fn model_info_from_gguf(g: &GgufFile) -> ModelInfo {
    let arch = g
        .get_str("general.architecture")
        .ok()
        .flatten()
        .unwrap_or("(none)")
        .to_string();
    let prefix = format!("{arch}.");
    let mut hparams = BTreeMap::new();
    for (k, v) in &g.metadata {
        if let Some(short) = k.strip_prefix(&prefix) {
            if let Some(j) = json_of(v) {
                hparams.insert(short.to_string(), j);
            }
        }
    }
    if let Some(t) = g.tensor("token_embd.weight") {
        if let Some(v) = t.dims.get(1) {
            hparams
                .entry("vocab_size".to_string())
                .or_insert(serde_json::Value::from(*v));
        }
    }
    let u = |k: &str| g.get(&format!("{prefix}{k}")).and_then(GgufValue::as_u64);
    let n_layer = u("block_count").map(|b| {
        let n = b.saturating_sub(u("nextn_predict_layers").unwrap_or(0));
        u32::try_from(n).unwrap_or(u32::MAX)
    });
    let mut acc = Acc::new();
    for t in &g.tensors {
        acc.add(&t.name, &t.dims, t.ggml_type, t.bytes, n_layer);
    }
    let (bytes, quant_mix, params, total_bytes, tensors) = acc.mix();
    let (plannable, planning_note) = match model::inventory_from_gguf(g) {
        Ok(inv) => (true, planning_note(&inv)),
        Err(e) => (false, Some(e.to_string())),
    };
    ModelInfo {
        source: g.path.clone(),
        arch,
        name: g.get_str("general.name").ok().flatten().map(str::to_string),
        files: g.parts.len() as u64,
        tensors,
        params,
        total_bytes,
        bytes,
        quant_mix,
        hparams,
        plannable,
        planning_note,
    }
}

/// What is approximate when planning `inv`: a layout mapped for sizes only, and a missing
/// forward graph (the planner then cannot size the scratch).
fn planning_note(inv: &ModelInventory) -> Option<String> {
    let arch = inv.arch.as_str();
    let mut notes = Vec::new();
    if !model::is_fully_checked(arch) {
        notes.push(format!(
            "`{arch}` is mapped for planning sizes only (tensor layout not checked in full; the executor runs {})",
            arch::SUPPORTED.join(", ")
        ));
    }
    let probe = GraphParams {
        tokens: 1,
        logits_rows: 1,
        ctx_cells: 1,
    };
    if forward_graph(arch, &inv.hparams, &probe).is_err() {
        notes.push(format!(
            "no forward graph for `{arch}` yet: plans leave its scratch unsized"
        ));
    }
    if notes.is_empty() {
        None
    } else {
        Some(notes.join("; "))
    }
}

/// Describe an inventory (descriptor TOML or safetensors folder) read from `source`.
pub fn model_info_from_inventory(inv: &ModelInventory, source: &str) -> ModelInfo {
    let mut acc = Acc::new();
    for t in &inv.tensors {
        acc.add(
            &t.name,
            &t.dims,
            t.ggml_type,
            t.bytes,
            Some(inv.hparams.n_layer),
        );
    }
    let (bytes, quant_mix, params, total_bytes, tensors) = acc.mix();
    let hparams = match serde_json::to_value(&inv.hparams) {
        Ok(serde_json::Value::Object(m)) => m.into_iter().filter(|(_, v)| !v.is_null()).collect(),
        _ => BTreeMap::new(),
    };
    ModelInfo {
        source: source.to_string(),
        arch: inv.arch.clone(),
        name: Some(inv.name.clone()),
        files: 1,
        tensors,
        params,
        total_bytes,
        bytes,
        quant_mix,
        hparams,
        plannable: model::PLANNABLE.contains(&inv.arch.as_str()),
        planning_note: planning_note(inv),
    }
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / f64::from(1u32 << 30))
}

fn pct(part: u64, total: u64) -> String {
    if total == 0 {
        return "0.0%".into();
    }
    format!("{:.1}%", part as f64 * 100.0 / total as f64)
}

impl ModelInfo {
    /// One JSON object: the struct's fields.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }

    /// Human-readable report.
    pub fn to_text(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let _ = writeln!(s, "model        {}", self.source);
        if let Some(n) = &self.name {
            let _ = writeln!(s, "name         {}", crate::text::name(n));
        }
        let plan = if self.plannable {
            "plannable"
        } else {
            "not plannable"
        };
        let _ = writeln!(s, "architecture {} ({plan})", self.arch);
        if let Some(n) = &self.planning_note {
            let _ = writeln!(s, "             {n}");
        }
        let _ = writeln!(
            s,
            "parameters   {:.2} B ({})",
            self.params as f64 / 1e9,
            self.params
        );
        let _ = writeln!(
            s,
            "tensors      {} in {} file(s), {} ({} bytes)",
            self.tensors,
            self.files,
            gib(self.total_bytes),
            self.total_bytes
        );
        let _ = writeln!(s, "bytes by role");
        let b = &self.bytes;
        for (k, v) in [
            ("dense", b.dense),
            ("experts", b.experts),
            ("embedding", b.embedding),
            ("head", b.head),
            ("mtp", b.mtp),
        ] {
            let _ = writeln!(
                s,
                "  {k:<10} {:>12} {:>7}  ({v} bytes)",
                gib(v),
                pct(v, self.total_bytes)
            );
        }
        let _ = writeln!(s, "quant mix");
        for q in &self.quant_mix {
            let _ = writeln!(
                s,
                "  {:<8} {:>5} tensors {:>12} {:>7}  {:.2} bits/weight",
                q.ggml_type.name(),
                q.tensors,
                gib(q.bytes),
                pct(q.bytes, self.total_bytes),
                if q.params == 0 {
                    0.0
                } else {
                    q.bytes as f64 * 8.0 / q.params as f64
                }
            );
        }
        if !self.hparams.is_empty() {
            let _ = writeln!(s, "hyperparameters");
            for (k, v) in &self.hparams {
                let v = match v {
                    serde_json::Value::String(x) => x.clone(),
                    other => other.to_string(),
                };
                let _ = writeln!(s, "  {k} = {v}");
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{expected_tensors, QuantRecipe};
    use crate::gguf::model::testfile::*;
    use crate::gguf::{parse_gguf_bytes, testutil};
    use crate::inventory::HParams;

    #[test]
    fn any_gguf_is_described_even_unsupported() {
        let g = parse_gguf_bytes(&testutil::valid(3), "llama.gguf").unwrap();
        let info = model_info_from_gguf(&g);
        assert_eq!(info.arch, "llama");
        assert!(!info.plannable);
        assert!(info.planning_note.as_deref().unwrap().contains("qwen3moe"));
        assert_eq!(info.tensors, 2);
        assert_eq!(info.params, 8 + 8);
        assert_eq!(info.total_bytes, 64);
        // tok_embd is not llama.cpp's token_embd: dense; output_norm goes with the head.
        assert_eq!(info.bytes.head, 32);
        assert_eq!(info.bytes.dense, 32);
        assert_eq!(info.hparams["block_count"], serde_json::json!(2));
        assert_eq!(info.quant_mix.len(), 1);
        assert_eq!(info.quant_mix[0].bytes, 64);
        let text = info.to_text();
        assert!(
            text.contains("llama (not plannable)") && text.contains("F32"),
            "{text}"
        );
        assert_eq!(info.to_json()["plannable"], false);
    }

    fn next_hp() -> HParams {
        let mut hp = crate::known::qwen3_next_80b_a3b();
        hp.n_layer = 4;
        hp.n_embd = 64;
        hp.n_vocab = 128;
        hp.n_head = 4;
        hp.head_dim_k = 32;
        hp.head_dim_v = 32;
        hp.n_expert = 4;
        hp.n_expert_used = 2;
        hp.n_ff_exp = 32;
        hp.n_ff_shexp = 32;
        hp.rope_dim = Some(8);
        if let Some(s) = hp.ssm.as_mut() {
            s.state_size = 16;
            s.group_count = 2;
            s.time_step_rank = 4;
            s.inner_size = 64;
        }
        hp
    }

    #[test]
    fn roles_partition_the_bytes_and_match_the_inventory() {
        let hp = next_hp();
        let ts = expected_tensors("qwen3next", &hp, &QuantRecipe::preset("Q8_0").unwrap()).unwrap();
        let inv = ModelInventory {
            arch: "qwen3next".into(),
            name: "tiny".into(),
            hparams: hp.clone(),
            tensors: ts.clone(),
            vision: None,
        };
        let a = model_info_from_inventory(&inv, "tiny.toml");
        let b = &a.bytes;
        assert_eq!(
            b.dense + b.experts + b.embedding + b.head + b.mtp,
            inv.total_bytes()
        );
        assert_eq!(
            a.quant_mix.iter().map(|q| q.bytes).sum::<u64>(),
            inv.total_bytes()
        );
        // MTP block 4: all of its tensors, its experts included.
        let mtp: u64 = ts
            .iter()
            .filter(|t| t.layer == Some(4))
            .map(|t| t.bytes)
            .sum();
        assert_eq!(b.mtp, mtp);
        let experts: u64 = ts
            .iter()
            .filter(|t| t.role == TensorRole::ExpertStack && t.layer != Some(4))
            .map(|t| t.bytes)
            .sum();
        assert_eq!(b.experts, experts);
        assert_eq!(b.embedding, inv.tensor("token_embd.weight").unwrap().bytes);
        assert!(a.plannable);
        assert_eq!(a.planning_note, None);

        // The same model as a GGUF describes the same.
        let kv = kv(
            "qwen3next",
            &[
                ("block_count", V::U32(5)),
                ("nextn_predict_layers", V::U32(1)),
                ("expert_count", V::U32(4)),
            ],
        );
        let g = parse_gguf_bytes(&gguf_bytes(&kv, &table(&ts)), "next.gguf").unwrap();
        let g_info = model_info_from_gguf(&g);
        assert_eq!(g_info.bytes, a.bytes);
        assert_eq!(g_info.params, a.params);
        assert_eq!(g_info.quant_mix, a.quant_mix);
        // Too few keys to plan: says which one is missing, still describes the file.
        assert!(!g_info.plannable);
        assert!(
            g_info
                .planning_note
                .as_deref()
                .unwrap()
                .contains("qwen3next."),
            "{:?}",
            g_info.planning_note
        );
        assert_eq!(g_info.hparams["expert_count"], serde_json::json!(4));
    }
}
