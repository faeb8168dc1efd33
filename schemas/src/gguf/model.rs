//! GGUF header -> planner inventory: llama.cpp metadata keys (`{arch}.block_count`,
//! `{arch}.expert_count`, `{arch}.ssm.*`, ...) become [`HParams`], tensor records become
//! [`TensorInfo`]s whose role and block come from [`arch::classify`].
//! Invariant: an inventory is returned only when its tensors match the architecture — for
//! `qwen3moe` / `qwen3next` exactly (every tensor, every shape, via [`arch::check_tensors`]),
//! for the planning-only architectures (`qwen2moe`, `gpt-oss`, `deepseek2`) every expert stack
//! has `expert_count` experts and every block index exists; any mismatch is an error naming
//! the tensor or the key.
//!
//! Mapping decisions (the same model from a descriptor, a safetensors folder or a GGUF must
//! give the same [`HParams`]):
//! - `block_count` counts the MTP blocks too (llama.cpp: `n_layer() = block_count -
//!   nextn_predict_layers`), so `n_layer = block_count - nextn_predict_layers`.
//! - `n_ff` is 0 when every block is MoE, even though real files carry `feed_forward_length`
//!   (6144 for Qwen3-30B-A3B): the descriptors set 0 and nothing reads it for MoE blocks. It is
//!   `feed_forward_length` only when there are leading dense blocks (deepseek2).
//! - `rope_dim` is `None` when `rope.dimension_count` equals the head dim (the whole head).
//! - f32 metadata (`layer_norm_rms_epsilon`, `rope.freq_base`) is widened through its shortest
//!   decimal form, so `1e-6f32` becomes `1e-6`, as a descriptor writes it.
//! - `n_vocab` is the row count of `token_embd.weight`; tied embeddings = no `output.weight`.
//! - `qwen3next`: `full_attention_interval` defaults to 4 (llama.cpp's default) and may come from
//!   a periodic `attention.recurrent_layers` array; `n_ff_shexp` falls back to
//!   `feed_forward_length` (llama.cpp's fallback).
//! - `deepseek2` (MLA): llama.cpp caches one latent per cell — `kv_lora_rank` + the rope dims —
//!   and reads V from it, so `n_head_kv = 1`, `head_dim_k = kv_lora_rank +
//!   rope.dimension_count`, `head_dim_v = 0`; `n_leading_dense = leading_dense_block_count`;
//!   the shared expert width is `expert_feed_forward_length * expert_shared_count`.
//! - `gpt-oss`: every other block uses a 128-cell sliding window; all blocks are counted as
//!   full attention (an over-estimate of KV, never an under-estimate).
//! - `qwen2moe`: shared expert width from `expert_shared_feed_forward_length` (or the
//!   `ffn_up_shexp` tensor).
//!
//! Tensor order: the inventory is sorted into the canonical order of
//! [`arch::expected_tensors`] (embedding, blocks, MTP blocks, output norm, head; extras of a
//! block after its canonical tensors), not file order, so a real file and its descriptor
//! fingerprint the same. `TensorInfo::file_offset` is the offset relative to the data section
//! of the split part that holds the tensor; the part itself is in the [`GgufFile`], which the
//! caller keeps ([`load_gguf_model`] returns both, [`tensor_location`] resolves a name to the
//! part file and absolute offset).

use super::{read_gguf, GgufError, GgufFile, GgufValue};
use crate::arch;
use crate::inventory::{
    HParams, InventoryError, ModelInventory, SsmParams, TensorInfo, TensorRole,
};
use std::collections::BTreeMap;
use std::path::Path;

/// Architectures `strata-plan` can plan from a GGUF file (llama.cpp `general.architecture`).
pub const PLANNABLE: &[&str] = &["qwen3moe", "qwen3next", "qwen2moe", "gpt-oss", "deepseek2"];

/// Whether `arch` is checked tensor for tensor against its layout (the executor can run it);
/// the other [`PLANNABLE`] architectures are mapped for planning sizes only.
pub fn is_fully_checked(arch: &str) -> bool {
    arch::SUPPORTED.contains(&arch)
}

/// Sanity cap for block counts read from metadata.
const MAX_BLOCKS: u64 = 4096;

/// Why a GGUF file cannot be turned into a planning inventory. Every message names the file
/// and the key or tensor.
#[derive(Debug, thiserror::Error)]
pub enum GgufModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{file}: metadata key `{key}` is missing; {hint}")]
    MissingKey {
        file: String,
        key: String,
        hint: String,
    },
    #[error("{file}: metadata key `{key}`: {reason}")]
    BadKey {
        file: String,
        key: String,
        reason: String,
    },
    #[error("{file}: architecture `{arch}` is not supported for planning; supported are {supported} (`strata-plan model-info` still describes the file)")]
    UnsupportedArch {
        file: String,
        arch: String,
        supported: String,
    },
    #[error("{file}: {source}")]
    Layout {
        file: String,
        #[source]
        source: InventoryError,
    },
    #[error("{file}: tensor `{tensor}`: {reason}")]
    BadTensor {
        file: String,
        tensor: String,
        reason: String,
    },
}

impl GgufModelError {
    /// The tensor the error is about, if any.
    pub fn tensor(&self) -> Option<&str> {
        match self {
            GgufModelError::BadTensor { tensor, .. } => Some(tensor),
            GgufModelError::Layout {
                source:
                    InventoryError::BadShape { tensor, .. }
                    | InventoryError::Missing { tensor, .. }
                    | InventoryError::Unexpected { tensor, .. }
                    | InventoryError::WrongShape { tensor, .. },
                ..
            } => Some(tensor),
            _ => None,
        }
    }
}

/// Where a tensor's bytes are: the part file, the absolute offset in it and the length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorLocation {
    /// Index into [`GgufFile::parts`].
    pub part: u32,
    /// Path of that part.
    pub path: String,
    /// Absolute byte offset of the tensor data in `path`.
    pub offset: u64,
    pub bytes: u64,
}

/// Resolve a tensor name to its part file and absolute offset.
pub fn tensor_location(g: &GgufFile, name: &str) -> Option<TensorLocation> {
    let t = g.tensor(name)?;
    let part = g.parts.get(t.part as usize)?;
    Some(TensorLocation {
        part: t.part,
        path: part.path.clone(),
        offset: g.tensor_file_offset(t)?,
        bytes: t.bytes,
    })
}

/// Read a GGUF (all parts of a split model) and map it: the inventory and the header the
/// executor needs to find each tensor's part.
pub fn load_gguf_model(path: &Path) -> Result<(ModelInventory, GgufFile), GgufModelError> {
    let g = read_gguf(path)?;
    let inv = inventory_from_gguf(&g)?;
    Ok((inv, g))
}

/// `general.architecture` of a file, required.
pub fn architecture(g: &GgufFile) -> Result<&str, GgufModelError> {
    g.get_str("general.architecture")?
        .ok_or_else(|| GgufModelError::MissingKey {
            file: g.path.clone(),
            key: "general.architecture".into(),
            hint: "every llama.cpp model GGUF has it; re-convert the model with llama.cpp's convert_hf_to_gguf.py".into(),
        })
}

/// Map a validated GGUF header to the planner's inventory (see the module docs for every
/// mapping decision). Unsupported architectures are refused with the supported list.
pub fn inventory_from_gguf(g: &GgufFile) -> Result<ModelInventory, GgufModelError> {
    let arch = architecture(g)?.to_string();
    if !PLANNABLE.contains(&arch.as_str()) {
        return Err(GgufModelError::UnsupportedArch {
            file: g.path.clone(),
            arch,
            supported: PLANNABLE.join(", "),
        });
    }
    let file = g.path.clone();
    let layout = |source| GgufModelError::Layout {
        file: file.clone(),
        source,
    };

    let mut tensors = tensor_infos(g)?;
    let m = Meta { g, arch: &arch };
    let hp = m.hparams(&tensors)?;

    if is_fully_checked(&arch) {
        check_and_sort(&arch, &hp, &mut tensors).map_err(layout)?;
    } else {
        m.check_planning(&hp, &tensors)?;
        sort_canonical(&mut tensors, &BTreeMap::new());
    }
    Ok(ModelInventory {
        name: model_name(g)?,
        arch,
        hparams: hp,
        tensors,
        vision: None,
    })
}

/// Every tensor record of `g` as a [`TensorInfo`] (role and block from [`arch::classify`],
/// `file_offset` relative to its part's data section), in file order.
pub(crate) fn tensor_infos(g: &GgufFile) -> Result<Vec<TensorInfo>, GgufModelError> {
    let mut tensors = Vec::with_capacity(g.tensors.len());
    for t in &g.tensors {
        let (role, layer) = arch::classify(&t.name);
        let mut info = TensorInfo::new(t.name.clone(), t.dims.clone(), t.ggml_type, role, layer)
            .map_err(|source| GgufModelError::Layout {
                file: g.path.clone(),
                source,
            })?;
        info.file_offset = Some(t.offset);
        tensors.push(info);
    }
    Ok(tensors)
}

/// The hyperparameters of `g`, an `arch` file whose tensors are `tensors` (see the module
/// docs for the mapping); nothing is checked against the tensor table but `token_embd`.
pub(crate) fn hparams_of(
    g: &GgufFile,
    arch: &str,
    tensors: &[TensorInfo],
) -> Result<HParams, GgufModelError> {
    Meta { g, arch }.hparams(tensors)
}

/// `general.name`, else the file's stem.
pub(crate) fn model_name(g: &GgufFile) -> Result<String, GgufModelError> {
    Ok(match g.get_str("general.name")? {
        Some(n) if !n.trim().is_empty() => n.to_string(),
        _ => Path::new(&g.path)
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into()),
    })
}

/// For a fully checked architecture: the hyperparameters valid, every tensor present with its
/// shape (trailing 1s canonicalised), then the canonical order.
pub(crate) fn check_and_sort(
    arch: &str,
    hp: &HParams,
    tensors: &mut [TensorInfo],
) -> Result<(), InventoryError> {
    arch::validate_hparams(arch, hp)?;
    arch::check_tensors(arch, hp, tensors)?;
    arch::canonical_dims(arch, hp, tensors)?;
    let canonical: BTreeMap<String, usize> = arch::expected_shapes(arch, hp)?
        .into_iter()
        .enumerate()
        .map(|(i, (name, _))| (name, i))
        .collect();
    sort_canonical(tensors, &canonical);
    Ok(())
}

/// Canonical order: embedding, blocks in order (canonical tensors first, in spec order, then
/// extras in file order), output norm, head, then any other global tensor.
fn sort_canonical(tensors: &mut [TensorInfo], canonical: &BTreeMap<String, usize>) {
    let mut keyed: Vec<((u8, u32, usize, usize), TensorInfo)> = tensors
        .iter()
        .cloned()
        .enumerate()
        .map(|(i, t)| {
            let group = match (t.role, t.layer) {
                (TensorRole::Embedding, None) => 0,
                (_, Some(_)) => 1,
                (TensorRole::OutputNorm, None) => 2,
                (TensorRole::Head, None) => 3,
                _ => 4,
            };
            let canon = canonical.get(&t.name).copied().unwrap_or(usize::MAX);
            ((group, t.layer.unwrap_or(0), canon, i), t)
        })
        .collect();
    keyed.sort_by_key(|k| k.0);
    for (slot, (_, t)) in tensors.iter_mut().zip(keyed) {
        *slot = t;
    }
}

/// f32 metadata widened through its shortest decimal form (`1e-6f32` -> `1e-6`).
fn widen(v: &GgufValue) -> Option<f64> {
    match v {
        GgufValue::F32(x) => x.to_string().parse::<f64>().ok(),
        other => other.as_f64(),
    }
}

/// Typed access to `{arch}.*` keys with errors naming the full key.
struct Meta<'a> {
    g: &'a GgufFile,
    arch: &'a str,
}

impl Meta<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    fn bad(&self, k: &str, reason: impl Into<String>) -> GgufModelError {
        GgufModelError::BadKey {
            file: self.g.path.clone(),
            key: self.key(k),
            reason: reason.into(),
        }
    }

    fn missing(&self, k: &str) -> GgufModelError {
        GgufModelError::MissingKey {
            file: self.g.path.clone(),
            key: self.key(k),
            hint: format!(
                "llama.cpp's `{}` loader needs it; the file is incomplete or was written by an old converter",
                self.arch
            ),
        }
    }

    /// An unsigned integer, or a per-layer array of them. Arrays must be uniform for the
    /// fully checked architectures; for the planning-only ones their maximum is used (the
    /// larger size never under-plans).
    fn u64_opt(&self, k: &str) -> Result<Option<u64>, GgufModelError> {
        let key = self.key(k);
        match self.g.get(&key) {
            None => Ok(None),
            Some(GgufValue::Array(a)) => {
                let vals = a
                    .to_u64_vec()
                    .ok_or_else(|| self.bad(k, "is an array, but not of non-negative integers"))?;
                let Some(max) = vals.iter().copied().max() else {
                    return Err(self.bad(k, "is an empty array"));
                };
                if is_fully_checked(self.arch) && vals.iter().any(|v| *v != max) {
                    return Err(self.bad(
                        k,
                        format!(
                            "per-layer values {vals:?} differ; {} needs one value for every layer",
                            self.arch
                        ),
                    ));
                }
                Ok(Some(max))
            }
            Some(_) => Ok(self.g.get_u64(&key)?),
        }
    }

    fn u64_req(&self, k: &str) -> Result<u64, GgufModelError> {
        self.u64_opt(k)?.ok_or_else(|| self.missing(k))
    }

    fn f64_opt(&self, k: &str) -> Result<Option<f64>, GgufModelError> {
        let key = self.key(k);
        match self.g.get(&key) {
            None => Ok(None),
            Some(v) => match widen(v) {
                Some(x) if x.is_finite() => Ok(Some(x)),
                Some(x) => Err(self.bad(k, format!("{x} is not a finite number"))),
                None => Err(self.bad(k, format!("expected a number, found {}", v.type_name()))),
            },
        }
    }

    fn bool_opt(&self, k: &str) -> Result<Option<bool>, GgufModelError> {
        Ok(self.g.get_bool(&self.key(k))?)
    }

    fn u32_of(&self, k: &str, v: u64) -> Result<u32, GgufModelError> {
        if v > MAX_BLOCKS {
            return Err(self.bad(k, format!("{v} is above the sanity limit {MAX_BLOCKS}")));
        }
        u32::try_from(v).map_err(|_| self.bad(k, format!("{v} does not fit in u32")))
    }

    /// `blk.{l}.{rest}` dims, if the tensor is present.
    fn dims_of<'t>(&self, tensors: &'t [TensorInfo], name: &str) -> Option<&'t [u64]> {
        tensors
            .iter()
            .find(|t| t.name == name)
            .map(|t| t.dims.as_slice())
    }

    fn layout(&self, source: InventoryError) -> GgufModelError {
        GgufModelError::Layout {
            file: self.g.path.clone(),
            source,
        }
    }

    fn hparams(&self, tensors: &[TensorInfo]) -> Result<HParams, GgufModelError> {
        let arch = self.arch;
        let strict = is_fully_checked(arch);
        let block_count = self.u64_req("block_count")?;
        let block_count = self.u32_of("block_count", block_count)?;
        let nextn = match self.u64_opt("nextn_predict_layers")? {
            Some(n) => self.u32_of("nextn_predict_layers", n)?,
            None => 0,
        };
        if nextn >= block_count {
            return Err(self.bad(
                "nextn_predict_layers",
                format!("{nextn} MTP blocks but block_count is only {block_count} (block_count counts the MTP blocks too)"),
            ));
        }
        let n_layer = block_count - nextn;
        let n_embd = self.u64_req("embedding_length")?;
        let n_vocab = self.n_vocab(tensors)?;
        let n_ctx_train = self.u64_req("context_length")?;
        let n_head = self.u64_req("attention.head_count")?;
        if n_head == 0 {
            return Err(self.bad("attention.head_count", "must be greater than 0"));
        }
        let n_head_kv = self.u64_opt("attention.head_count_kv")?.unwrap_or(n_head);
        let default_hd = if n_embd % n_head == 0 {
            Some(n_embd / n_head)
        } else {
            None
        };
        let head_dim = |k: &str| -> Result<u64, GgufModelError> {
            match (self.u64_opt(k)?, default_hd) {
                (Some(v), _) | (None, Some(v)) => Ok(v),
                (None, None) => Err(self.bad(
                    k,
                    format!("is missing and embedding_length {n_embd} is not a multiple of attention.head_count {n_head}"),
                )),
            }
        };
        let head_dim_k = head_dim("attention.key_length")?;
        let head_dim_v = head_dim("attention.value_length")?;
        let n_expert = self.u64_req("expert_count")?;
        let n_expert_used = self.u64_req("expert_used_count")?;
        let n_ff_exp = match self.u64_opt("expert_feed_forward_length")? {
            Some(v) => v,
            None if !strict => self
                .first_expert_width(tensors)
                .ok_or_else(|| self.missing("expert_feed_forward_length"))?,
            None => return Err(self.missing("expert_feed_forward_length")),
        };
        let rms_eps = match self.f64_opt("attention.layer_norm_rms_epsilon")? {
            Some(e) => e,
            None if strict => return Err(self.missing("attention.layer_norm_rms_epsilon")),
            None => 1e-6,
        };
        // llama.cpp's default freq_base.
        let rope_theta = self.f64_opt("rope.freq_base")?.unwrap_or(10_000.0);
        let rope_dim = self.u64_opt("rope.dimension_count")?;
        let norm_default = matches!(arch, "qwen3moe" | "qwen3next" | "gpt-oss");
        let norm_topk_prob = self
            .bool_opt("expert_weights_norm")?
            .unwrap_or(norm_default);

        let mut hp = HParams {
            n_layer,
            n_embd,
            n_vocab,
            n_ctx_train,
            n_head,
            n_head_kv,
            head_dim_k,
            head_dim_v,
            n_ff: 0,
            n_expert,
            n_expert_used,
            n_ff_exp,
            n_ff_shexp: 0,
            n_leading_dense: 0,
            full_attention_interval: None,
            ssm: None,
            nextn_predict_layers: nextn,
            rope_theta,
            rope_dim: None,
            rms_eps,
            norm_topk_prob,
            tied_embeddings: !tensors.iter().any(|t| t.name == "output.weight"),
        };

        self.arch_hparams(&mut hp, tensors, block_count, rope_dim)?;
        hp.rope_dim = rope_dim.filter(|r| *r != hp.head_dim_k);
        Ok(hp)
    }

    /// `n_vocab` from `token_embd.weight`'s dims[1]; the tensor must exist and be 2-D or more.
    fn n_vocab(&self, tensors: &[TensorInfo]) -> Result<u64, GgufModelError> {
        match self.dims_of(tensors, "token_embd.weight") {
            Some(d) if d.len() >= 2 => Ok(d[1]),
            Some(d) => Err(GgufModelError::BadTensor {
                file: self.g.path.clone(),
                tensor: "token_embd.weight".into(),
                reason: format!("dims {d:?}: expected [n_embd, n_vocab]"),
            }),
            None => Err(self.layout(InventoryError::Missing {
                arch: self.arch.into(),
                tensor: "token_embd.weight".into(),
            })),
        }
    }

    /// The architecture's own hyperparameters on top of the common ones in `hp`: Qwen3-Next's
    /// SSM and attention interval, the shared-expert widths, DeepSeek2's dense blocks and MLA.
    fn arch_hparams(
        &self,
        hp: &mut HParams,
        tensors: &[TensorInfo],
        block_count: u32,
        rope_dim: Option<u64>,
    ) -> Result<(), GgufModelError> {
        let (n_layer, n_ff_exp) = (hp.n_layer, hp.n_ff_exp);
        match self.arch {
            "qwen3next" => {
                hp.ssm = Some(SsmParams {
                    conv_kernel: self.u64_req("ssm.conv_kernel")?,
                    state_size: self.u64_req("ssm.state_size")?,
                    group_count: self.u64_req("ssm.group_count")?,
                    time_step_rank: self.u64_req("ssm.time_step_rank")?,
                    inner_size: self.u64_req("ssm.inner_size")?,
                });
                hp.full_attention_interval =
                    Some(self.full_attention_interval(block_count, n_layer)?);
                hp.n_ff_shexp = match self.u64_opt("expert_shared_feed_forward_length")? {
                    Some(v) => v,
                    None => self
                        .u64_opt("feed_forward_length")?
                        .ok_or_else(|| self.missing("expert_shared_feed_forward_length"))?,
                };
            }
            "qwen2moe" => {
                hp.n_ff_shexp = match self.u64_opt("expert_shared_feed_forward_length")? {
                    Some(v) => v,
                    None => self
                        .dims_of(tensors, "blk.0.ffn_up_shexp.weight")
                        .and_then(|d| d.get(1).copied())
                        .unwrap_or(0),
                };
            }
            "deepseek2" => {
                let leading = self.u64_opt("leading_dense_block_count")?.unwrap_or(0);
                let leading = self.u32_of("leading_dense_block_count", leading)?;
                if leading > n_layer {
                    return Err(self.bad(
                        "leading_dense_block_count",
                        format!("{leading} dense blocks but only {n_layer} blocks"),
                    ));
                }
                hp.n_leading_dense = leading;
                if leading > 0 {
                    hp.n_ff = self.u64_req("feed_forward_length")?;
                }
                let shared = self.u64_opt("expert_shared_count")?.unwrap_or(0);
                hp.n_ff_shexp = n_ff_exp.checked_mul(shared).ok_or_else(|| {
                    self.bad(
                        "expert_shared_count",
                        "times expert_feed_forward_length overflows",
                    )
                })?;
                // MLA: one latent of kv_lora_rank plus the rope dims per cell, V read from it.
                let kv_lora = self.u64_req("attention.kv_lora_rank")?;
                let rope = rope_dim.ok_or_else(|| self.missing("rope.dimension_count"))?;
                hp.n_head_kv = 1;
                hp.head_dim_k = kv_lora.checked_add(rope).ok_or_else(|| {
                    self.bad(
                        "attention.kv_lora_rank",
                        "plus rope.dimension_count overflows",
                    )
                })?;
                hp.head_dim_v = 0;
            }
            // qwen3moe, gpt-oss: every block MoE, no shared expert.
            _ => {}
        }
        Ok(())
    }

    /// Width of the first routed expert stack (`ffn_up_exps` or `ffn_gate_exps`, dims[1]).
    fn first_expert_width(&self, tensors: &[TensorInfo]) -> Option<u64> {
        tensors
            .iter()
            .filter(|t| t.role == TensorRole::ExpertStack)
            .find(|t| {
                t.name.contains("ffn_up_exps.weight") || t.name.contains("ffn_gate_exps.weight")
            })
            .and_then(|t| t.dims.get(1).copied())
    }

    /// qwen3next: `full_attention_interval`, else a periodic `attention.recurrent_layers`
    /// array, else llama.cpp's default 4.
    fn full_attention_interval(
        &self,
        block_count: u32,
        n_layer: u32,
    ) -> Result<u32, GgufModelError> {
        if let Some(k) = self.u64_opt("full_attention_interval")? {
            return u32::try_from(k).ok().filter(|k| *k > 0).ok_or_else(|| {
                self.bad(
                    "full_attention_interval",
                    format!("{k} must be between 1 and 2^32-1"),
                )
            });
        }
        let key = self.key("attention.recurrent_layers");
        let Some(a) = self.g.get_array(&key)? else {
            return Ok(4);
        };
        let flags: Vec<bool> = match a {
            super::GgufArray::Bool(v) => v.clone(),
            other => other
                .to_u64_vec()
                .map(|v| v.iter().map(|x| *x != 0).collect())
                .ok_or_else(|| {
                    self.bad("attention.recurrent_layers", "must be an array of bools")
                })?,
        };
        if flags.len() != block_count as usize && flags.len() != n_layer as usize {
            return Err(self.bad(
                "attention.recurrent_layers",
                format!("{} entries, block_count is {block_count}", flags.len()),
            ));
        }
        let main = &flags[..(n_layer as usize).min(flags.len())];
        let Some(first_full) = main.iter().position(|r| !r) else {
            return Err(self.bad("attention.recurrent_layers", "no full-attention layer"));
        };
        let k = u32::try_from(first_full + 1).unwrap_or(u32::MAX);
        let periodic = main
            .iter()
            .enumerate()
            .all(|(i, r)| *r != (i as u64 + 1).is_multiple_of(u64::from(k)));
        if !periodic {
            return Err(self.bad(
                "attention.recurrent_layers",
                "the layer pattern is not periodic (every k-th layer full attention); Strata cannot plan it",
            ));
        }
        Ok(k)
    }

    /// Checks for the planning-only architectures: every block index exists, every expert
    /// stack has `expert_count` experts and sits in a block that has experts, and every MoE
    /// block has its down-projection stack.
    fn check_planning(&self, hp: &HParams, tensors: &[TensorInfo]) -> Result<(), GgufModelError> {
        let file = &self.g.path;
        let bad_tensor = |t: &TensorInfo, reason: String| GgufModelError::BadTensor {
            file: file.clone(),
            tensor: t.name.clone(),
            reason,
        };
        if hp.n_embd == 0 {
            return Err(self.bad("embedding_length", "must be greater than 0"));
        }
        if hp.n_expert == 0 {
            return Err(self.bad("expert_count", "must be greater than 0 for an MoE model"));
        }
        if hp.n_expert_used == 0 || hp.n_expert_used > hp.n_expert {
            return Err(self.bad(
                "expert_used_count",
                format!(
                    "{} must be between 1 and expert_count {}",
                    hp.n_expert_used, hp.n_expert
                ),
            ));
        }
        if hp.n_head_kv == 0 || !hp.n_head.is_multiple_of(hp.n_head_kv) {
            return Err(self.bad(
                "attention.head_count_kv",
                format!(
                    "{} must divide attention.head_count {}",
                    hp.n_head_kv, hp.n_head
                ),
            ));
        }
        let blocks = hp.n_blocks_total();
        for t in tensors {
            if let Some(l) = t.layer {
                if l >= blocks {
                    return Err(bad_tensor(
                        t,
                        format!("belongs to block {l}, but block_count is {blocks}"),
                    ));
                }
            }
            if t.role == TensorRole::ExpertStack {
                let last = t.dims.last().copied().unwrap_or(1);
                if last != hp.n_expert {
                    return Err(bad_tensor(
                        t,
                        format!(
                            "dims {:?}: the last dim is the expert index and must be expert_count {}",
                            t.dims, hp.n_expert
                        ),
                    ));
                }
                match t.layer {
                    Some(l) if hp.layer_has_experts(l) => {}
                    Some(l) => {
                        return Err(bad_tensor(
                            t,
                            format!(
                                "block {l} is one of the leading_dense_block_count {} dense blocks",
                                hp.n_leading_dense
                            ),
                        ))
                    }
                    None => return Err(bad_tensor(t, "an expert stack outside any block".into())),
                }
            }
        }
        for l in hp.n_leading_dense..hp.n_layer {
            let has_down = tensors.iter().any(|t| {
                t.layer == Some(l)
                    && t.role == TensorRole::ExpertStack
                    && t.name.contains("ffn_down_exps")
            });
            if !has_down {
                return Err(self.layout(InventoryError::Missing {
                    arch: self.arch.into(),
                    tensor: format!("blk.{l}.ffn_down_exps.weight"),
                }));
            }
        }
        Ok(())
    }
}

/// Test-only GGUF writer: metadata and tensors (zero data) with correct alignment, for the
/// tests of this module, `mmproj` and `modelinfo`.
#[cfg(test)]
pub(crate) mod testfile {
    use super::super::testutil::B;
    use super::super::value_type as t;
    use crate::ggml::GgmlType;
    use crate::inventory::TensorInfo;

    /// A metadata value for [`gguf_bytes`].
    #[derive(Clone, Debug)]
    pub enum V {
        U16(u16),
        U32(u32),
        U64(u64),
        F32(f32),
        Bool(bool),
        Str(String),
        BoolArr(Vec<bool>),
    }

    pub fn s(v: &str) -> V {
        V::Str(v.to_string())
    }

    /// A GGUF v3 file with `kv` and `tensors` (data zero-filled, 32-byte aligned).
    pub fn gguf_bytes(kv: &[(String, V)], tensors: &[(String, Vec<u64>, GgmlType)]) -> Vec<u8> {
        let mut b = B::new().header(3, tensors.len() as u64, kv.len() as u64);
        for (k, v) in kv {
            b = match v {
                V::U16(x) => b.kv_u16(k, *x),
                V::U32(x) => b.kv_u32(k, *x),
                V::U64(x) => b.str(k).u32(t::U64).u64(*x),
                V::F32(x) => b.str(k).u32(t::F32).bytes(&x.to_le_bytes()),
                V::Bool(x) => b.kv_bool(k, u8::from(*x)),
                V::Str(x) => b.kv_str(k, x),
                V::BoolArr(xs) => {
                    let mut b = b.str(k).u32(t::ARRAY).u32(t::BOOL).u64(xs.len() as u64);
                    for x in xs {
                        b = b.u8(u8::from(*x));
                    }
                    b
                }
            };
        }
        let mut offset = 0u64;
        for (name, dims, ty) in tensors {
            b = b.tensor(name, dims, ty.id(), offset);
            let bytes = ty.tensor_bytes(dims).expect("test tensor fits its type");
            offset += bytes.div_ceil(32) * 32;
        }
        let mut b = b.pad(32);
        b.buf.resize(b.buf.len() + offset as usize, 0);
        b.done()
    }

    /// One tensor record: name, GGUF dims, type.
    pub type TestTensor = (String, Vec<u64>, GgmlType);

    /// The tensor table of an inventory, as `gguf_bytes` takes it.
    pub fn table(ts: &[TensorInfo]) -> Vec<(String, Vec<u64>, GgmlType)> {
        ts.iter()
            .map(|t| (t.name.clone(), t.dims.clone(), t.ggml_type))
            .collect()
    }

    pub fn kv(arch: &str, pairs: &[(&str, V)]) -> Vec<(String, V)> {
        let mut out = vec![("general.architecture".to_string(), s(arch))];
        for (k, v) in pairs {
            let key = if k.starts_with("general.") || k.starts_with("clip.") {
                k.to_string()
            } else {
                format!("{arch}.{k}")
            };
            out.push((key, v.clone()));
        }
        out
    }
}

#[cfg(test)]
mod tests;
