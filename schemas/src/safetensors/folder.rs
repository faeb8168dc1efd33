//! Hugging Face model folders (`config.json` + `model.safetensors` or an index and shards) read
//! from headers only and mapped onto llama.cpp's tensor inventory.
//! Invariant: every tensor of every shard is accounted for exactly once — mapped to a llama.cpp
//! name or rejected with an error naming it; config values are range-checked before use.
//!
//! Name mapping (HF -> llama.cpp, GGUF dims are the HF shape reversed):
//!
//! | HF | llama.cpp |
//! |---|---|
//! | `model.embed_tokens.weight` | `token_embd.weight` |
//! | `lm_head.weight` | `output.weight` |
//! | `model.norm.weight` | `output_norm.weight` |
//! | `model.layers.N.input_layernorm.weight` | `blk.N.attn_norm.weight` |
//! | `model.layers.N.post_attention_layernorm.weight` | qwen3moe: `blk.N.ffn_norm.weight`; qwen3next: `blk.N.post_attention_norm.weight` |
//! | `model.layers.N.self_attn.{q,k,v,o}_proj.{weight,bias}` | `blk.N.attn_{q,k,v,output}.*` |
//! | `model.layers.N.self_attn.{q,k}_norm.weight` | `blk.N.attn_{q,k}_norm.weight` |
//! | `model.layers.N.mlp.gate.weight` | `blk.N.ffn_gate_inp.weight` |
//! | `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight` (all E) | ONE `blk.N.ffn_{gate,up,down}_exps.weight`, dims `[in, out, n_expert]` |
//! | `model.layers.N.mlp.{gate,up,down}_proj.weight` (dense layers) | `blk.N.ffn_{gate,up,down}.weight` |
//! | qwen3next `mlp.shared_expert.{gate,up,down}_proj.weight` | `blk.N.ffn_{gate,up,down}_shexp.weight` |
//! | qwen3next `mlp.shared_expert_gate.weight` | `blk.N.ffn_gate_inp_shexp.weight` |
//! | qwen3next `linear_attn.in_proj_qkvz.weight` | split, as llama.cpp's converter does, into `blk.N.attn_qkv.weight` (`2·nk·dk + nv·dv` rows) and `blk.N.attn_gate.weight` (`nv·dv` rows) |
//! | qwen3next `linear_attn.in_proj_ba.weight` | `blk.N.ssm_ba.weight` |
//! | qwen3next `linear_attn.conv1d.weight` `[C,1,K]` | `blk.N.ssm_conv1d.weight` (size-1 dims squeezed: `[K, C]`) |
//! | qwen3next `linear_attn.A_log` | `blk.N.ssm_a` |
//! | qwen3next `linear_attn.dt_bias` | `blk.N.ssm_dt.bias` |
//! | qwen3next `linear_attn.norm.weight` | `blk.N.ssm_norm.weight` |
//! | qwen3next `linear_attn.out_proj.weight` | `blk.N.ssm_out.weight` |
//! | qwen3next `mtp.layers.K.<as above>` | `blk.{n_layer+K}.<as above>` |
//! | qwen3next `mtp.fc.weight` | `blk.B.nextn.eh_proj.weight` (one per MTP block B) |
//! | qwen3next `mtp.pre_fc_norm_embedding.weight` | `blk.B.nextn.enorm.weight` |
//! | qwen3next `mtp.pre_fc_norm_hidden.weight` | `blk.B.nextn.hnorm.weight` |
//! | qwen3next `mtp.norm.weight` | `blk.B.nextn.shared_head_norm.weight` |
//!
//! What is not byte-identical with a converted GGUF: llama.cpp's converter also changes values
//! (qwen3next norms `+1`, `A_log -> -exp(A_log)`) and reorders rows of the split `in_proj_qkvz`;
//! sizes and dims are identical, which is all planning needs. `file_offset` is set only for
//! tensors copied 1:1 (relative to the data section of the shard that holds them); merged
//! expert stacks and the split qkvz halves have `None`. Pre-merged 3-D HF expert tensors
//! (`mlp.experts.gate_up_proj`) are not supported yet and are reported as unknown tensors.

use super::{read_header, short, SafetensorsError, StTensor};
use crate::inventory::{HParams, ModelInventory, SsmParams, TensorInfo, TensorRole};
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::{Map, Value};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::path::Path;

/// Largest `config.json` we read.
pub const CONFIG_CAP: u64 = 16 << 20;
/// Largest `model.safetensors.index.json` we read.
pub const INDEX_CAP: u64 = 64 << 20;
/// Largest value of an integer hyperparameter.
const MAX_HPARAM: u64 = 1 << 32;
/// ggml tensors have at most four dims.
const GGML_MAX_DIMS: usize = 4;

const INDEX_NAME: &str = "model.safetensors.index.json";
const SINGLE_NAME: &str = "model.safetensors";

/// HF architecture -> llama.cpp architecture.
const ARCHES: &[(&str, &str)] = &[
    ("Qwen3MoeForCausalLM", "qwen3moe"),
    ("Qwen3NextForCausalLM", "qwen3next"),
];

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Arch {
    Qwen3Moe,
    Qwen3Next,
}

impl Arch {
    fn llama_name(self) -> &'static str {
        match self {
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Qwen3Next => "qwen3next",
        }
    }
}

/// One HF tensor and the shard file (name inside the folder) that holds it.
struct Located {
    shard: String,
    t: StTensor,
}

/// Read a Hugging Face model folder's `config.json` and safetensors headers and reduce them to
/// the llama.cpp-named inventory the planner uses.
pub fn load_folder(dir: &Path) -> Result<ModelInventory, SafetensorsError> {
    let dir_s = dir.display().to_string();
    let config_path = dir.join("config.json");
    let config_file = config_path.display().to_string();
    let config = read_json_capped(&config_path, CONFIG_CAP)?;
    let Value::Object(config) = config else {
        return Err(SafetensorsError::BadConfig {
            file: config_file,
            key: "(top level)".into(),
            reason: "must be a JSON object".into(),
        });
    };
    let cfg = Cfg {
        m: &config,
        file: config_file.clone(),
    };
    let arch = cfg.arch()?;

    let tensors = read_tensors(dir)?;

    // MTP blocks: counted from the weights present, bounded by the config when it says.
    let mtp_in_files = tensors
        .iter()
        .filter_map(|l| mtp_layer_index(&l.t.name))
        .max()
        .map(|k| k as u64 + 1);
    let has_mtp_shared = tensors.iter().any(|l| l.t.name.starts_with("mtp."));
    let cfg_mtp = match cfg.u64_opt("num_nextn_predict_layers")? {
        Some(n) => Some(("num_nextn_predict_layers", n)),
        None => cfg
            .u64_opt("mtp_num_hidden_layers")?
            .map(|n| ("mtp_num_hidden_layers", n)),
    };
    let nextn: u32 = match (arch, mtp_in_files, has_mtp_shared) {
        (Arch::Qwen3Moe, _, _) => 0,
        (Arch::Qwen3Next, None, false) => 0,
        (Arch::Qwen3Next, None, true) => {
            return Err(SafetensorsError::BadConfig {
                file: dir_s.clone(),
                key: "mtp.*".into(),
                reason: "MTP tensors are present but no `mtp.layers.K.*` block".into(),
            })
        }
        (Arch::Qwen3Next, Some(k), _) => match cfg_mtp {
            Some((key, n)) if n < k => {
                return Err(SafetensorsError::BadConfig {
                    file: config_file.clone(),
                    key: key.into(),
                    reason: format!("is {n}, but the weights have {k} MTP blocks"),
                })
            }
            _ => u32::try_from(k).unwrap_or(u32::MAX),
        },
    };

    let mut hp = cfg.hparams(arch)?;
    hp.nextn_predict_layers = nextn;

    let mut infos = map_tensors(dir, arch, &hp, &tensors)?;

    // Dense FFN width only matters when some layer has a dense FFN.
    let has_dense_ffn = infos.iter().any(|t| {
        t.layer.is_some()
            && ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
                .iter()
                .any(|s| t.name.ends_with(&format!(".{s}")))
    });
    hp.n_ff = if has_dense_ffn {
        cfg.u64_req("intermediate_size")?
    } else {
        0
    };

    // The same layout check a GGUF gets (every required tensor, every shape against the
    // hyperparameters, nothing extra): a folder the executor would refuse is refused here,
    // at plan time, by the one function both use.
    let layout = |source| SafetensorsError::Layout {
        dir: dir_s.clone(),
        source: Box::new(source),
    };
    crate::arch::validate_hparams(arch.llama_name(), &hp).map_err(layout)?;
    crate::arch::check_tensors(arch.llama_name(), &hp, &infos).map_err(layout)?;
    crate::arch::canonical_dims(arch.llama_name(), &hp, &mut infos).map_err(layout)?;

    let name = dir
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    Ok(ModelInventory {
        arch: arch.llama_name().into(),
        name,
        hparams: hp,
        tensors: infos,
        vision: None,
    })
}

// ---------------------------------------------------------------- files

fn read_json_capped(path: &Path, cap: u64) -> Result<Value, SafetensorsError> {
    let bytes = read_capped(path, cap)?;
    serde_json::from_slice(&bytes).map_err(|e| SafetensorsError::BadConfig {
        file: path.display().to_string(),
        key: "(JSON)".into(),
        reason: e.to_string(),
    })
}

fn read_capped(path: &Path, cap: u64) -> Result<Vec<u8>, SafetensorsError> {
    let what = match path.file_name().and_then(|n| n.to_str()) {
        Some(INDEX_NAME) => "safetensors index",
        _ => "model config",
    };
    crate::files::read_limited(path, cap, what).map_err(|e| match e {
        crate::files::FileError::Io { source, .. } => SafetensorsError::Io {
            file: path.display().to_string(),
            source,
        },
        crate::files::FileError::TooLarge { limit, .. } => SafetensorsError::BadConfig {
            file: path.display().to_string(),
            key: "(file)".into(),
            reason: format!("the file is over the {limit}-byte cap for this file"),
        },
        other => SafetensorsError::BadConfig {
            file: path.display().to_string(),
            key: "(file)".into(),
            reason: other.to_string(),
        },
    })
}

/// Every tensor of the folder, with its shard, in (shard order, header order).
fn read_tensors(dir: &Path) -> Result<Vec<Located>, SafetensorsError> {
    let index_path = dir.join(INDEX_NAME);
    if index_path.is_file() {
        return read_sharded(dir, &index_path);
    }
    let single = dir.join(SINGLE_NAME);
    if single.is_file() {
        let h = read_header(&single)?;
        return Ok(h
            .tensors
            .into_iter()
            .map(|t| Located {
                shard: SINGLE_NAME.into(),
                t,
            })
            .collect());
    }
    Err(SafetensorsError::NoModelFiles {
        dir: dir.display().to_string(),
    })
}

fn read_sharded(dir: &Path, index_path: &Path) -> Result<Vec<Located>, SafetensorsError> {
    let index_file = index_path.display().to_string();
    let bytes = read_capped(index_path, INDEX_CAP)?;
    let bad = |reason: String| SafetensorsError::BadIndex {
        file: index_file.clone(),
        reason,
    };
    let mut de = serde_json::Deserializer::from_slice(&bytes);
    let raw = RawIndex::deserialize(&mut de)
        .and_then(|r| de.end().map(|()| r))
        .map_err(|e| bad(e.to_string()))?;
    let Some(weight_map) = raw.weight_map else {
        return Err(bad("has no `weight_map`".into()));
    };
    if raw.weight_map_count > 1 {
        return Err(bad("`weight_map` appears more than once".into()));
    }

    // tensor -> shard, shards in first-appearance order.
    let mut where_is: HashMap<&str, &str> = HashMap::with_capacity(weight_map.len());
    let mut shards: Vec<&str> = Vec::new();
    let mut shard_seen: HashSet<&str> = HashSet::new();
    for (tensor, shard) in &weight_map {
        if where_is.insert(tensor, shard).is_some() {
            return Err(bad(format!(
                "tensor `{}` is listed more than once in `weight_map`",
                short(tensor)
            )));
        }
        if shard_seen.insert(shard) {
            if !is_plain_file_name(shard) {
                return Err(bad(format!(
                    "shard name `{}` is not a plain file name inside the folder",
                    short(shard)
                )));
            }
            shards.push(shard);
        }
    }

    let mut out = Vec::new();
    for shard in shards {
        let path = dir.join(shard);
        if !path.is_file() {
            return Err(SafetensorsError::MissingShard {
                index: index_file.clone(),
                shard: shard.to_string(),
            });
        }
        let h = read_header(&path)?;
        let present: HashSet<&str> = h.tensors.iter().map(|t| t.name.as_str()).collect();
        for t in &h.tensors {
            if where_is.get(t.name.as_str()) != Some(&shard) {
                return Err(SafetensorsError::TensorNotInIndex {
                    index: index_file.clone(),
                    shard: path.display().to_string(),
                    tensor: short(&t.name),
                });
            }
        }
        for (tensor, s) in &weight_map {
            if s == shard && !present.contains(tensor.as_str()) {
                return Err(SafetensorsError::TensorNotInShard {
                    index: index_file.clone(),
                    tensor: short(tensor),
                    shard: shard.to_string(),
                });
            }
        }
        drop(present);
        out.extend(h.tensors.into_iter().map(|t| Located {
            shard: shard.to_string(),
            t,
        }));
    }
    Ok(out)
}

fn is_plain_file_name(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && !s.contains(['/', '\\', '\0', ':'])
}

/// `model.safetensors.index.json`, keeping duplicate `weight_map` keys so they can be named.
struct RawIndex {
    weight_map: Option<Vec<(String, String)>>,
    weight_map_count: usize,
}

struct RawWeightMap(Vec<(String, String)>);

impl<'de> Deserialize<'de> for RawWeightMap {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawWeightMap;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("`weight_map`: an object of tensor name -> shard file name")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawWeightMap, A::Error> {
                let mut out = Vec::new();
                while let Some(k) = map.next_key::<String>()? {
                    let v = map.next_value::<String>().map_err(|e| {
                        de::Error::custom(format!("`weight_map` entry `{}`: {e}", short(&k)))
                    })?;
                    out.push((k, v));
                }
                Ok(RawWeightMap(out))
            }
        }
        d.deserialize_map(V)
    }
}

impl<'de> Deserialize<'de> for RawIndex {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawIndex;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an index object with a `weight_map`")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawIndex, A::Error> {
                let mut idx = RawIndex {
                    weight_map: None,
                    weight_map_count: 0,
                };
                while let Some(k) = map.next_key::<String>()? {
                    if k == "weight_map" {
                        idx.weight_map = Some(map.next_value::<RawWeightMap>()?.0);
                        idx.weight_map_count += 1;
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(idx)
            }
        }
        d.deserialize_map(V)
    }
}

// ---------------------------------------------------------------- config.json

struct Cfg<'a> {
    m: &'a Map<String, Value>,
    file: String,
}

impl Cfg<'_> {
    fn err(&self, key: &str, reason: impl Into<String>) -> SafetensorsError {
        SafetensorsError::BadConfig {
            file: self.file.clone(),
            key: key.into(),
            reason: reason.into(),
        }
    }

    fn arch(&self) -> Result<Arch, SafetensorsError> {
        let supported = ARCHES
            .iter()
            .map(|(hf, ll)| format!("{hf} ({ll})"))
            .collect::<Vec<_>>()
            .join(", ");
        let first = match self.m.get("architectures") {
            Some(Value::Array(a)) => match a.first() {
                Some(Value::String(s)) => s.clone(),
                _ => return Err(self.err("architectures", "must be a non-empty array of strings")),
            },
            Some(_) => return Err(self.err("architectures", "must be an array of strings")),
            // transformers 5 may leave `architectures` out; `model_type` still names the family.
            None => match self.m.get("model_type") {
                Some(Value::String(t)) if t == "qwen3_moe" => "Qwen3MoeForCausalLM".to_string(),
                Some(Value::String(t)) if t == "qwen3_next" => "Qwen3NextForCausalLM".to_string(),
                _ => return Err(self.err("architectures", "is missing; it names the model class")),
            },
        };
        match first.as_str() {
            "Qwen3MoeForCausalLM" => Ok(Arch::Qwen3Moe),
            "Qwen3NextForCausalLM" => Ok(Arch::Qwen3Next),
            _ => Err(SafetensorsError::UnsupportedArch {
                file: self.file.clone(),
                arch: short(&first),
                supported,
            }),
        }
    }

    fn u64_opt(&self, key: &str) -> Result<Option<u64>, SafetensorsError> {
        match self.m.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => match n.as_u64() {
                Some(v) if v <= MAX_HPARAM => Ok(Some(v)),
                _ => Err(self.err(key, format!("{n} is not an integer in 0..=2^32"))),
            },
            Some(v) => Err(self.err(key, format!("must be an integer, found {}", kind(v)))),
        }
    }

    fn u64_req(&self, key: &str) -> Result<u64, SafetensorsError> {
        self.u64_opt(key)?
            .ok_or_else(|| self.err(key, "is missing"))
    }

    /// Required and at least 1.
    fn pos(&self, key: &str) -> Result<u64, SafetensorsError> {
        let v = self.u64_req(key)?;
        if v == 0 {
            return Err(self.err(key, "must be at least 1"));
        }
        Ok(v)
    }

    fn f64_opt(&self, key: &str) -> Result<Option<f64>, SafetensorsError> {
        match self.m.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => match n.as_f64() {
                Some(v) if v.is_finite() && v > 0.0 => Ok(Some(v)),
                _ => Err(self.err(key, format!("{n} must be a positive finite number"))),
            },
            Some(v) => Err(self.err(key, format!("must be a number, found {}", kind(v)))),
        }
    }

    fn bool_opt(&self, key: &str) -> Result<Option<bool>, SafetensorsError> {
        match self.m.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.err(key, format!("must be true or false, found {}", kind(v)))),
        }
    }

    fn rope_theta(&self) -> Result<Option<f64>, SafetensorsError> {
        self.rope_f64("rope_theta")
    }

    /// A RoPE setting at the top level (transformers 4) or, failing that, nested in
    /// `rope_parameters` (transformers 5 moves `rope_theta` and `partial_rotary_factor` there).
    fn rope_f64(&self, key: &str) -> Result<Option<f64>, SafetensorsError> {
        if let Some(t) = self.f64_opt(key)? {
            return Ok(Some(t));
        }
        match self.m.get("rope_parameters") {
            Some(Value::Object(p)) => match p.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Number(n)) => match n.as_f64() {
                    Some(v) if v.is_finite() && v > 0.0 => Ok(Some(v)),
                    _ => Err(self.err(
                        &format!("rope_parameters.{key}"),
                        "must be a positive number",
                    )),
                },
                Some(_) => Err(self.err(&format!("rope_parameters.{key}"), "must be a number")),
            },
            _ => Ok(None),
        }
    }

    fn hparams(&self, arch: Arch) -> Result<HParams, SafetensorsError> {
        let n_layer = self.pos("num_hidden_layers")?;
        let n_embd = self.pos("hidden_size")?;
        let n_head = self.pos("num_attention_heads")?;
        // Required: the K/V projection shapes depend on it, and a silent default would plan
        // a model the weights contradict.
        let n_head_kv = self.pos("num_key_value_heads")?;
        if n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(self.err(
                "num_key_value_heads",
                format!("{n_head_kv} must be at least 1 and divide num_attention_heads ({n_head})"),
            ));
        }
        let head_dim = match self.u64_opt("head_dim")? {
            Some(0) => return Err(self.err("head_dim", "must be at least 1")),
            Some(h) => h,
            None => {
                if n_embd % n_head != 0 {
                    return Err(self.err(
                        "head_dim",
                        "is missing and hidden_size is not a multiple of num_attention_heads",
                    ));
                }
                n_embd / n_head
            }
        };
        // transformers 5 writes `num_local_experts` where 4.x wrote `num_experts`.
        let n_expert = match self.u64_opt("num_experts")? {
            None if self.m.contains_key("num_local_experts") => self.pos("num_local_experts")?,
            _ => self.pos("num_experts")?,
        };
        let n_expert_used = self.pos("num_experts_per_tok")?;
        if n_expert_used > n_expert {
            return Err(self.err(
                "num_experts_per_tok",
                format!("{n_expert_used} is more than num_experts ({n_expert})"),
            ));
        }
        let n_ff_exp = self.pos("moe_intermediate_size")?;
        if let Some(step) = self.u64_opt("decoder_sparse_step")? {
            if step != 1 {
                return Err(self.err(
                    "decoder_sparse_step",
                    format!("{step} is not supported (only every layer MoE, step 1)"),
                ));
            }
        }
        let n_leading_dense = self.leading_dense(n_layer)?;
        let n_ff_shexp = match arch {
            Arch::Qwen3Moe => 0,
            Arch::Qwen3Next => self
                .u64_opt("shared_expert_intermediate_size")?
                .unwrap_or(0),
        };

        let (full_attention_interval, ssm, rope_dim) = match arch {
            Arch::Qwen3Moe => {
                let rope_dim = match self.rope_f64("partial_rotary_factor")? {
                    Some(f) if f < 1.0 => Some((head_dim as f64 * f) as u64),
                    _ => None,
                };
                (None, None, rope_dim)
            }
            Arch::Qwen3Next => {
                let interval = self.full_attention_interval(n_layer)?;
                let nk = self.pos("linear_num_key_heads")?;
                let nv = self.pos("linear_num_value_heads")?;
                if nv % nk != 0 {
                    return Err(self.err(
                        "linear_num_value_heads",
                        format!("{nv} must be a multiple of linear_num_key_heads ({nk})"),
                    ));
                }
                let ssm = SsmParams {
                    conv_kernel: self.pos("linear_conv_kernel_dim")?,
                    state_size: self.pos("linear_key_head_dim")?,
                    group_count: nk,
                    time_step_rank: nv,
                    inner_size: self.pos("linear_value_head_dim")? * nv,
                };
                let f = self.rope_f64("partial_rotary_factor")?.unwrap_or(0.25);
                if f > 1.0 {
                    return Err(self.err("partial_rotary_factor", "must be at most 1"));
                }
                (
                    Some(interval),
                    Some(ssm),
                    Some((head_dim as f64 * f) as u64),
                )
            }
        };

        let mut hp = HParams {
            n_layer: n_layer as u32,
            n_embd,
            n_vocab: self.pos("vocab_size")?,
            n_ctx_train: self.pos("max_position_embeddings")?,
            n_head,
            n_head_kv,
            head_dim_k: head_dim,
            head_dim_v: head_dim,
            n_ff: 0,
            n_expert,
            n_expert_used,
            n_ff_exp,
            n_ff_shexp,
            n_leading_dense,
            full_attention_interval,
            ssm,
            nextn_predict_layers: 0,
            rope_theta: 1_000_000.0,
            rope_dim,
            rms_eps: 1e-6,
            norm_topk_prob: matches!(arch, Arch::Qwen3Next),
            tied_embeddings: false,
        };
        if let Some(t) = self.rope_theta()? {
            hp.rope_theta = t;
        }
        if let Some(e) = self.f64_opt("rms_norm_eps")? {
            hp.rms_eps = e;
        }
        if let Some(b) = self.bool_opt("norm_topk_prob")? {
            hp.norm_topk_prob = b;
        }
        if let Some(b) = self.bool_opt("tie_word_embeddings")? {
            hp.tied_embeddings = b;
        }
        Ok(hp)
    }

    /// `mlp_only_layers` must be a prefix `0..k` (leading dense layers) or empty.
    fn leading_dense(&self, n_layer: u64) -> Result<u32, SafetensorsError> {
        let key = "mlp_only_layers";
        let list = match self.m.get(key) {
            None | Some(Value::Null) => return Ok(0),
            Some(Value::Array(a)) => a,
            Some(v) => return Err(self.err(key, format!("must be an array, found {}", kind(v)))),
        };
        for (i, v) in list.iter().enumerate() {
            if v.as_u64() != Some(i as u64) {
                return Err(self.err(
                    key,
                    "only a leading run of dense layers [0, 1, .., k-1] is supported",
                ));
            }
        }
        if list.len() as u64 > n_layer {
            return Err(self.err(key, "lists more layers than num_hidden_layers"));
        }
        Ok(list.len() as u32)
    }

    /// qwen3next: every k-th layer is full attention; from `full_attention_interval` or
    /// `layer_types`, which must agree and follow that pattern.
    fn full_attention_interval(&self, n_layer: u64) -> Result<u32, SafetensorsError> {
        let explicit = self.u64_opt("full_attention_interval")?;
        if explicit == Some(0) {
            return Err(self.err("full_attention_interval", "must be at least 1"));
        }
        let from_types = match self.m.get("layer_types") {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) => {
                if a.len() as u64 != n_layer {
                    return Err(self.err(
                        "layer_types",
                        format!("has {} entries for {n_layer} layers", a.len()),
                    ));
                }
                let mut full = Vec::with_capacity(a.len());
                for v in a {
                    match v.as_str() {
                        Some("full_attention") => full.push(true),
                        Some("linear_attention") => full.push(false),
                        _ => {
                            return Err(self.err(
                                "layer_types",
                                "entries must be \"full_attention\" or \"linear_attention\"",
                            ))
                        }
                    }
                }
                let k = full
                    .iter()
                    .position(|f| *f)
                    .map(|i| i as u64 + 1)
                    .unwrap_or(n_layer + 1);
                if full
                    .iter()
                    .enumerate()
                    .any(|(i, f)| *f != ((i as u64 + 1) % k == 0))
                {
                    return Err(self.err(
                        "layer_types",
                        "is not \"every k-th layer full attention\", which is all llama.cpp's qwen3next supports",
                    ));
                }
                Some(k)
            }
            Some(v) => {
                return Err(self.err(
                    "layer_types",
                    format!("must be an array, found {}", kind(v)),
                ))
            }
        };
        let k = match (explicit, from_types) {
            (Some(a), Some(b)) if a != b => {
                return Err(self.err(
                    "full_attention_interval",
                    format!("is {a}, but layer_types puts full attention every {b} layers"),
                ))
            }
            (Some(a), _) => a,
            (None, Some(b)) => b,
            (None, None) => 4,
        };
        Ok(u32::try_from(k).unwrap_or(u32::MAX))
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

// ---------------------------------------------------------------- name mapping

/// `K` of `mtp.layers.K.*`.
fn mtp_layer_index(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("mtp.layers.")?;
    rest.split('.').next()?.parse().ok()
}

/// Role and block of a llama.cpp name (same rules as `arch::classify`; the lead swaps it in).
fn classify_local(name: &str) -> Option<(TensorRole, Option<u32>)> {
    if name.starts_with("token_embd.") {
        return Some((TensorRole::Embedding, None));
    }
    if name.starts_with("output_norm.") {
        return Some((TensorRole::OutputNorm, None));
    }
    if name.starts_with("output.") {
        return Some((TensorRole::Head, None));
    }
    let rest = name.strip_prefix("blk.")?;
    let (n, tail) = rest.split_once('.')?;
    let layer: u32 = n.parse().ok()?;
    let base = tail.split('.').next()?;
    let role = if tail.starts_with("nextn.") {
        TensorRole::MtpExtra
    } else if base.ends_with("_exps") {
        TensorRole::ExpertStack
    } else {
        TensorRole::Dense
    };
    Some((role, Some(layer)))
}

/// A per-block HF suffix (after `model.layers.N.`) -> llama.cpp suffix (after `blk.N.`).
fn block_suffix(arch: Arch, hf: &str) -> Option<&'static str> {
    let common = match hf {
        "input_layernorm.weight" => Some("attn_norm.weight"),
        "self_attn.q_proj.weight" => Some("attn_q.weight"),
        "self_attn.k_proj.weight" => Some("attn_k.weight"),
        "self_attn.v_proj.weight" => Some("attn_v.weight"),
        "self_attn.o_proj.weight" => Some("attn_output.weight"),
        "self_attn.q_proj.bias" => Some("attn_q.bias"),
        "self_attn.k_proj.bias" => Some("attn_k.bias"),
        "self_attn.v_proj.bias" => Some("attn_v.bias"),
        "self_attn.o_proj.bias" => Some("attn_output.bias"),
        "self_attn.q_norm.weight" => Some("attn_q_norm.weight"),
        "self_attn.k_norm.weight" => Some("attn_k_norm.weight"),
        "mlp.gate.weight" => Some("ffn_gate_inp.weight"),
        "mlp.gate_proj.weight" => Some("ffn_gate.weight"),
        "mlp.up_proj.weight" => Some("ffn_up.weight"),
        "mlp.down_proj.weight" => Some("ffn_down.weight"),
        _ => None,
    };
    if common.is_some() {
        return common;
    }
    match arch {
        Arch::Qwen3Moe => match hf {
            "post_attention_layernorm.weight" => Some("ffn_norm.weight"),
            _ => None,
        },
        Arch::Qwen3Next => match hf {
            "post_attention_layernorm.weight" => Some("post_attention_norm.weight"),
            "mlp.shared_expert.gate_proj.weight" => Some("ffn_gate_shexp.weight"),
            "mlp.shared_expert.up_proj.weight" => Some("ffn_up_shexp.weight"),
            "mlp.shared_expert.down_proj.weight" => Some("ffn_down_shexp.weight"),
            "mlp.shared_expert_gate.weight" => Some("ffn_gate_inp_shexp.weight"),
            "linear_attn.in_proj_ba.weight" => Some("ssm_ba.weight"),
            "linear_attn.conv1d.weight" => Some("ssm_conv1d.weight"),
            "linear_attn.A_log" => Some("ssm_a"),
            "linear_attn.dt_bias" => Some("ssm_dt.bias"),
            "linear_attn.norm.weight" => Some("ssm_norm.weight"),
            "linear_attn.out_proj.weight" => Some("ssm_out.weight"),
            _ => None,
        },
    }
}

const PROJS: [&str; 3] = ["gate", "up", "down"];

/// `mlp.experts.E.{gate,up,down}_proj.weight` -> (E, proj index).
fn expert_parts(rest: &str) -> Option<(u64, usize)> {
    let tail = rest.strip_prefix("mlp.experts.")?;
    let (e, proj) = tail.split_once('.')?;
    let e: u64 = e.parse().ok()?;
    let p = PROJS
        .iter()
        .position(|p| proj.strip_prefix(p) == Some("_proj.weight"))?;
    Some((e, p))
}

struct Out {
    name: String,
    dims: Vec<u64>,
    ty: crate::ggml::GgmlType,
    file_offset: Option<u64>,
}

/// Map every tensor of the folder onto llama.cpp's inventory: tensors one by one, then the
/// per-expert tensors stacked, then names checked and classified.
fn map_tensors(
    dir: &Path,
    arch: Arch,
    hp: &HParams,
    tensors: &[Located],
) -> Result<Vec<TensorInfo>, SafetensorsError> {
    let mut outs: Vec<Out> = Vec::new();
    let mut experts: ExpertGroups = BTreeMap::new();
    for l in tensors {
        map_one(dir, arch, hp, l, &mut outs, &mut experts)?;
    }
    stack_experts(dir, hp, &experts, &mut outs)?;
    into_infos(dir, arch, outs)
}

/// Experts of a model folder grouped for stacking: (block, proj) -> expert -> tensor.
type ExpertGroups<'a> = BTreeMap<(u32, usize), BTreeMap<u64, &'a Located>>;

/// Map one tensor: to one (or, for MTP norms and `in_proj_qkvz`, several) llama.cpp tensors in
/// `outs`, or, for a routed expert's projection, into `experts` to be stacked later.
fn map_one<'a>(
    dir: &Path,
    arch: Arch,
    hp: &HParams,
    l: &'a Located,
    outs: &mut Vec<Out>,
    experts: &mut ExpertGroups<'a>,
) -> Result<(), SafetensorsError> {
    let file_of = |l: &Located| dir.join(&l.shard).display().to_string();
    let n_layer = hp.n_layer;
    let n_blocks = hp.n_blocks_total();
    let t = &l.t;
    let unknown = || SafetensorsError::UnknownTensor {
        file: file_of(l),
        arch: arch.llama_name().into(),
        tensor: short(&t.name),
    };
    // Model weights are floating point: integer (and F64) tensors are refused here, as
    // the executor would refuse them at load.
    let ty = t
        .dtype
        .ggml_type()
        .filter(|ty| {
            use crate::ggml::GgmlType;
            matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
        })
        .ok_or_else(|| SafetensorsError::UnsupportedDtype {
            file: file_of(l),
            tensor: short(&t.name),
            dtype: t.dtype,
        })?;
    let reversed = || -> Vec<u64> {
        if t.shape.is_empty() {
            vec![1]
        } else {
            t.shape.iter().rev().copied().collect()
        }
    };
    let one = |name: String, dims: Vec<u64>| Out {
        name,
        dims,
        ty,
        file_offset: Some(t.begin),
    };

    match t.name.as_str() {
        "model.embed_tokens.weight" => {
            outs.push(one("token_embd.weight".into(), reversed()));
            return Ok(());
        }
        "lm_head.weight" => {
            outs.push(one("output.weight".into(), reversed()));
            return Ok(());
        }
        "model.norm.weight" => {
            outs.push(one("output_norm.weight".into(), reversed()));
            return Ok(());
        }
        _ => {}
    }

    if arch == Arch::Qwen3Next {
        let nextn = match t.name.as_str() {
            "mtp.fc.weight" => Some("nextn.eh_proj.weight"),
            "mtp.pre_fc_norm_embedding.weight" => Some("nextn.enorm.weight"),
            "mtp.pre_fc_norm_hidden.weight" => Some("nextn.hnorm.weight"),
            "mtp.norm.weight" => Some("nextn.shared_head_norm.weight"),
            _ => None,
        };
        if let Some(s) = nextn {
            // llama.cpp gives every MTP block its own copy.
            for b in n_layer..n_blocks {
                outs.push(one(format!("blk.{b}.{s}"), reversed()));
            }
            return Ok(());
        }
    }

    // Per-block tensors.
    let (block, rest) = if let Some(r) = t.name.strip_prefix("model.layers.") {
        let (n, rest) = r.split_once('.').ok_or_else(unknown)?;
        let n: u32 = n.parse().map_err(|_| unknown())?;
        if n >= n_layer {
            return Err(SafetensorsError::UnknownTensor {
                file: file_of(l),
                arch: arch.llama_name().into(),
                tensor: format!(
                    "{} (layer {n}, but num_hidden_layers is {n_layer})",
                    short(&t.name)
                ),
            });
        }
        (n, rest)
    } else if let (Arch::Qwen3Next, Some(r)) = (arch, t.name.strip_prefix("mtp.layers.")) {
        let (k, rest) = r.split_once('.').ok_or_else(unknown)?;
        let k: u32 = k.parse().map_err(|_| unknown())?;
        // k < nextn by construction of nextn (max index + 1).
        (n_layer + k, rest)
    } else {
        return Err(unknown());
    };

    if let Some((e, p)) = expert_parts(rest) {
        experts.entry((block, p)).or_default().insert(e, l);
        return Ok(());
    }

    if arch == Arch::Qwen3Next && rest == "linear_attn.in_proj_qkvz.weight" {
        return split_qkvz(dir, arch, hp, l, block, ty, outs);
    }

    let suffix = block_suffix(arch, rest).ok_or_else(unknown)?;
    let dims = if suffix == "ssm_conv1d.weight" {
        let squeezed: Vec<u64> = t.shape.iter().rev().copied().filter(|d| *d != 1).collect();
        if squeezed.is_empty() {
            vec![1]
        } else {
            squeezed
        }
    } else {
        reversed()
    };
    outs.push(one(format!("blk.{block}.{suffix}"), dims));
    Ok(())
}

/// Qwen3-Next's fused `linear_attn.in_proj_qkvz.weight` of `block` (shape checked against the
/// `linear_*` hyperparameters) becomes llama.cpp's `attn_qkv` and `attn_gate`, with no single
/// file offset since each is a slice of rows.
fn split_qkvz(
    dir: &Path,
    arch: Arch,
    hp: &HParams,
    l: &Located,
    block: u32,
    ty: crate::ggml::GgmlType,
    outs: &mut Vec<Out>,
) -> Result<(), SafetensorsError> {
    let t = &l.t;
    let file_of = |l: &Located| dir.join(&l.shard).display().to_string();
    let unknown = || SafetensorsError::UnknownTensor {
        file: file_of(l),
        arch: arch.llama_name().into(),
        tensor: short(&t.name),
    };
    let s = hp.ssm.as_ref().ok_or_else(unknown)?;
    let qkv_rows = 2 * s.group_count * s.state_size + s.inner_size;
    let z_rows = s.inner_size;
    if t.shape != [qkv_rows + z_rows, hp.n_embd] {
        return Err(SafetensorsError::BadShape {
            file: file_of(l),
            tensor: short(&t.name),
            reason: format!(
                "{:?}; the linear_* hyperparameters need [{}, {}]",
                t.shape,
                qkv_rows + z_rows,
                hp.n_embd
            ),
        });
    }
    outs.push(Out {
        name: format!("blk.{block}.attn_qkv.weight"),
        dims: vec![hp.n_embd, qkv_rows],
        ty,
        file_offset: None,
    });
    outs.push(Out {
        name: format!("blk.{block}.attn_gate.weight"),
        dims: vec![hp.n_embd, z_rows],
        ty,
        file_offset: None,
    });
    Ok(())
}

/// Merge the per-expert tensors of each (block, proj) into one stack in `outs`: every expert
/// present once, all of one shape and dtype, and every block with experts has all projections.
fn stack_experts(
    dir: &Path,
    hp: &HParams,
    experts: &ExpertGroups,
    outs: &mut Vec<Out>,
) -> Result<(), SafetensorsError> {
    let dir_s = dir.display().to_string();
    let file_of = |l: &Located| dir.join(&l.shard).display().to_string();
    for ((block, p), by_e) in experts {
        let n = hp.n_expert;
        let (_, first) = by_e.iter().next().expect("groups are created non-empty");
        if let Some((&e, l)) = by_e.iter().find(|(&e, _)| e >= n) {
            return Err(SafetensorsError::ExpertMismatch {
                file: file_of(l),
                tensor: short(&l.t.name),
                reason: format!("expert {e}, but num_experts is {n}"),
            });
        }
        if let Some(missing) = (0..n).find(|e| !by_e.contains_key(e)) {
            return Err(SafetensorsError::MissingExpert {
                dir: dir_s.clone(),
                layer: *block,
                proj: format!("{}_proj", PROJS[*p]),
                expert: missing,
                n_expert: n,
            });
        }
        if first.t.shape.len() != 2 {
            return Err(SafetensorsError::ExpertMismatch {
                file: file_of(first),
                tensor: short(&first.t.name),
                reason: format!(
                    "shape {:?}: an expert projection must be 2-D",
                    first.t.shape
                ),
            });
        }
        for l in by_e.values() {
            if l.t.shape != first.t.shape || l.t.dtype != first.t.dtype {
                return Err(SafetensorsError::ExpertMismatch {
                    file: file_of(l),
                    tensor: short(&l.t.name),
                    reason: format!(
                        "{:?} {} differs from expert 0's {:?} {} (`{}`)",
                        l.t.shape,
                        l.t.dtype,
                        first.t.shape,
                        first.t.dtype,
                        short(&first.t.name)
                    ),
                });
            }
        }
        let ty = first
            .t
            .dtype
            .ggml_type()
            .ok_or_else(|| SafetensorsError::UnsupportedDtype {
                file: file_of(first),
                tensor: short(&first.t.name),
                dtype: first.t.dtype,
            })?;
        outs.push(Out {
            name: format!("blk.{block}.ffn_{}_exps.weight", PROJS[*p]),
            dims: vec![first.t.shape[1], first.t.shape[0], n],
            ty,
            file_offset: None,
        });
    }
    // A block with any routed experts needs all three projections.
    let blocks: HashSet<u32> = experts.keys().map(|(b, _)| *b).collect();
    for b in &blocks {
        for (p, proj) in PROJS.iter().enumerate() {
            if !experts.contains_key(&(*b, p)) {
                return Err(SafetensorsError::MissingExpert {
                    dir: dir_s.clone(),
                    layer: *b,
                    proj: format!("{proj}_proj"),
                    expert: 0,
                    n_expert: hp.n_expert,
                });
            }
        }
    }

    Ok(())
}

/// Check the mapped names (unique, at most ggml's dims, known to the classifier) and turn them
/// into inventory entries in a deterministic order.
fn into_infos(dir: &Path, arch: Arch, outs: Vec<Out>) -> Result<Vec<TensorInfo>, SafetensorsError> {
    let dir_s = dir.display().to_string();
    let mut infos = Vec::with_capacity(outs.len());
    let mut seen = HashSet::with_capacity(outs.len());
    for o in outs {
        if !seen.insert(o.name.clone()) {
            return Err(SafetensorsError::DuplicateTensor {
                file: dir_s.clone(),
                tensor: o.name,
            });
        }
        if o.dims.len() > GGML_MAX_DIMS {
            return Err(SafetensorsError::BadShape {
                file: dir_s.clone(),
                tensor: o.name.clone(),
                reason: format!(
                    "{:?} has more than {GGML_MAX_DIMS} dims, which ggml cannot hold",
                    o.dims
                ),
            });
        }
        let Some((role, layer)) = classify_local(&o.name) else {
            return Err(SafetensorsError::UnknownTensor {
                file: dir_s.clone(),
                arch: arch.llama_name().into(),
                tensor: o.name,
            });
        };
        let mut info = TensorInfo::new(o.name, o.dims, o.ty, role, layer).map_err(|source| {
            SafetensorsError::Inventory {
                file: dir_s.clone(),
                source,
            }
        })?;
        info.file_offset = o.file_offset;
        infos.push(info);
    }
    // Deterministic, shard-layout independent order: embedding, blocks, output norm, head.
    infos.sort_by(|a, b| sort_key(a).cmp(&sort_key(b)));
    Ok(infos)
}

fn sort_key(t: &TensorInfo) -> (u8, u32, &str) {
    let rank = match t.role {
        TensorRole::Embedding => 0,
        TensorRole::OutputNorm => 2,
        TensorRole::Head => 3,
        _ => 1,
    };
    (rank, t.layer.unwrap_or(0), t.name.as_str())
}

#[cfg(test)]
mod tests;
