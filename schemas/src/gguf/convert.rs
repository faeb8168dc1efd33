//! Hugging Face safetensors folders to GGUF in llama.cpp's tensor names and shapes: each GGUF
//! tensor is assembled from its HF sources ([`super::hf_sources`]: one tensor, one per expert
//! for a stack, or row runs of one tensor for qwen3next's split `in_proj_qkvz`), decoded,
//! transformed as llama.cpp's converter does (qwen3next norms `+1`, `A_log -> -exp`),
//! quantized to the target type and streamed out, with the folder's tokenizer as
//! `tokenizer.ggml.*` metadata.
//! Invariant: every value of the source reaches the file exactly once (bit for bit at F32 when
//! the transform is a copy); a tensor the architecture needs but the folder lacks, or a folder
//! tensor with no place in the GGUF, is an error naming it.

use super::hf_sources::{self, Piece, Transform};
use super::metadata::{arch_metadata, file_type, Vocab};
use super::random::rows_per_chunk;
use super::write::{GgufWriteError, GgufWriter, ProgressFn, WriteSummary};
use super::GgufValue;
use crate::arch::{self, QuantRecipe};
use crate::ggml::GgmlType;
use crate::inventory::{HParams, TensorInfo};
use crate::quant::{self};
use crate::safetensors::{self, StDtype, StTensor};
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// An HF tensor and where its shard's data section starts.
#[derive(Clone)]
struct Source {
    shard: String,
    data_start: u64,
    t: StTensor,
}

/// A resolved piece: rows of one HF tensor.
struct Resolved {
    src: Source,
    row0: u64,
    rows: u64,
}

/// Every HF tensor of the folder with its shard: `model.safetensors.index.json`'s shards, or
/// the single `model.safetensors`.
fn folder_tensors(dir: &Path) -> Result<BTreeMap<String, Source>, GgufWriteError> {
    let index = dir.join("model.safetensors.index.json");
    let shards: Vec<String> = if index.is_file() {
        let file = index.display().to_string();
        let bytes = std::fs::read(&index).map_err(|source| GgufWriteError::Io {
            file: file.clone(),
            offset: 0,
            what: "read the index".into(),
            source,
        })?;
        let v: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| GgufWriteError::Convert {
                file: file.clone(),
                problem: format!("not JSON: {e}"),
            })?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| GgufWriteError::Convert {
                file: file.clone(),
                problem: "has no `weight_map` object".into(),
            })?;
        let mut seen = Vec::<String>::new();
        for s in map.values() {
            let s = s.as_str().ok_or_else(|| GgufWriteError::Convert {
                file: file.clone(),
                problem: "`weight_map` values must be shard file names".into(),
            })?;
            if !seen.iter().any(|x| x == s) {
                seen.push(s.to_string());
            }
        }
        seen
    } else {
        vec!["model.safetensors".to_string()]
    };
    let mut out = BTreeMap::new();
    for shard in shards {
        let h = safetensors::read_header(&dir.join(&shard))
            .map_err(|source| GgufWriteError::Safetensors { source })?;
        for t in h.tensors {
            out.insert(
                t.name.clone(),
                Source {
                    shard: shard.clone(),
                    data_start: h.data_start,
                    t,
                },
            );
        }
    }
    Ok(out)
}

/// The recipe for converting to one type: every matrix `ty`; norms and the router F32.
fn convert_recipe(ty: GgmlType) -> Option<QuantRecipe> {
    let name = match ty {
        GgmlType::F32 => "F32",
        GgmlType::F16 => "F16",
        GgmlType::BF16 => "BF16",
        GgmlType::Q8_0 => "Q8_0",
        GgmlType::Q4K => "Q4_K",
        _ => return None,
    };
    QuantRecipe::preset(name)
}

/// Convert a Hugging Face qwen3moe or qwen3next folder (F32/F16/BF16 safetensors, one file
/// or sharded) to a GGUF in llama.cpp's layout: names mapped as llama.cpp's converter does,
/// dims the PyTorch shape reversed with the same row-major bytes (no q/k permutation: Qwen
/// uses NeoX RoPE), per-expert tensors stacked into `ffn_*_exps` `[in, out, n_expert]` in
/// expert order, qwen3next's values transformed and `in_proj_qkvz` regrouped (see
/// [`super::hf_sources`]), the MTP block (`mtp.*`) written as block `n_layer`, 1-D tensors,
/// `ssm_conv1d` and the routers kept F32, matrices stored as `ty` (F32, F16, BF16, Q8_0, Q4_K;
/// a row the type cannot hold — llama.cpp would fall back to Q5_0 — is stored F16). The
/// config's hyperparameters are written as metadata; a `tokenizer.json` next to it adds the
/// vocabulary.
pub fn convert_hf_folder(
    dir: &Path,
    out_path: &Path,
    ty: GgmlType,
    progress: Option<ProgressFn>,
) -> Result<WriteSummary, GgufWriteError> {
    let out_file = out_path.display().to_string();
    let dir_s = dir.display().to_string();
    let inv =
        safetensors::load_folder(dir).map_err(|source| GgufWriteError::Safetensors { source })?;
    let arch_name = inv.arch.clone();
    if !["qwen3moe", "qwen3next"].contains(&arch_name.as_str()) {
        return Err(GgufWriteError::Convert {
            file: dir_s,
            problem: format!(
                "architecture {arch_name} is not converted (qwen3moe and qwen3next are)"
            ),
        });
    }
    let recipe = convert_recipe(ty).ok_or_else(|| GgufWriteError::Unsupported {
        file: out_file.clone(),
        name: "(all matrices)".into(),
        ty,
    })?;
    let hp = inv.hparams.clone();
    let mut tensors = arch::expected_tensors(&arch_name, &hp, &recipe).map_err(|source| {
        GgufWriteError::Inventory {
            file: dir_s.clone(),
            source,
        }
    })?;
    for t in tensors.iter_mut() {
        if !quant::can_quantize(t.ggml_type) {
            *t = TensorInfo::new(
                t.name.clone(),
                t.dims.clone(),
                GgmlType::F16,
                t.role,
                t.layer,
            )
            .map_err(|source| GgufWriteError::Inventory {
                file: dir_s.clone(),
                source,
            })?;
        }
    }
    let src = folder_tensors(dir)?;
    let plan = resolve_all(dir, &arch_name, &hp, &tensors, &src)?;

    let mut w = GgufWriter::new(out_path);
    let meta = arch_metadata(&arch_name, &inv.name, &hp).map_err(|p| GgufWriteError::Convert {
        file: dir_s.clone(),
        problem: p,
    })?;
    for (k, v) in meta {
        w.kv(&k, v)?;
    }
    w.kv(
        "general.file_type",
        GgufValue::U32(file_type(&recipe.preset, &tensors)),
    )?;
    w.kv("general.quantization_version", GgufValue::U32(2))?;
    if let Some(v) = vocab_from_folder(dir, hp.n_vocab)? {
        for (k, val) in v.metadata() {
            w.kv(&k, val)?;
        }
    }
    for t in &tensors {
        w.tensor_info(&t.name, &t.dims, t.ggml_type)?;
    }
    if let Some(p) = progress {
        w.on_progress(p);
    }
    let mut s = w.begin()?;
    let mut files: BTreeMap<String, File> = BTreeMap::new();
    let mut raw = Vec::new();
    let mut x = Vec::new();
    let mut q = Vec::new();
    for (t, (pieces, transform)) in tensors.iter().zip(&plan) {
        let ne0 = t.dims[0];
        let out_rb = t.ggml_type.bytes_for(ne0).unwrap_or(0) as usize;
        for r in pieces {
            let so = &r.src;
            let path = dir.join(&so.shard);
            let path_s = path.display().to_string();
            if !files.contains_key(&so.shard) {
                let f = File::open(&path).map_err(|source| GgufWriteError::Io {
                    file: path_s.clone(),
                    offset: 0,
                    what: "open".into(),
                    source,
                })?;
                files.insert(so.shard.clone(), f);
            }
            let Some(f) = files.get_mut(&so.shard) else {
                continue;
            };
            let rb = ne0 * so.t.dtype.bits() / 8;
            let per = rows_per_chunk(ne0);
            let mut done = 0;
            while done < r.rows {
                let n = per.min(r.rows - done);
                let at = so.data_start + so.t.begin + (r.row0 + done) * rb;
                raw.resize((n * rb) as usize, 0);
                f.seek(SeekFrom::Start(at))
                    .and_then(|_| f.read_exact(&mut raw))
                    .map_err(|source| GgufWriteError::Io {
                        file: path_s.clone(),
                        offset: at,
                        what: format!("read `{}`", so.t.name),
                        source,
                    })?;
                decode(so.t.dtype, &raw, &mut x);
                transform.apply(&mut x);
                q.clear();
                q.resize(out_rb * n as usize, 0);
                for (xr, or) in x.chunks_exact(ne0 as usize).zip(q.chunks_exact_mut(out_rb)) {
                    quant::quantize_row_into(t.ggml_type, xr, or).map_err(|source| {
                        GgufWriteError::Quant {
                            file: out_file.clone(),
                            name: t.name.clone(),
                            source,
                        }
                    })?;
                }
                s.data(&q)?;
                done += n;
            }
        }
    }
    s.finish()
}

/// Resolve every GGUF tensor to its pieces in the folder before a byte is written: each needs
/// a known source, and every folder tensor must be used. Returns each tensor's pieces and
/// transform, in `tensors` order.
fn resolve_all(
    dir: &Path,
    arch_name: &str,
    hp: &HParams,
    tensors: &[TensorInfo],
    src: &BTreeMap<String, Source>,
) -> Result<Vec<(Vec<Resolved>, Transform)>, GgufWriteError> {
    let dir_s = dir.display().to_string();
    let mut used = BTreeSet::new();
    let mut plan: Vec<(Vec<Resolved>, Transform)> = Vec::with_capacity(tensors.len());
    for t in tensors {
        let s = hf_sources::sources(arch_name, hp, &t.name, &t.dims).ok_or_else(|| {
            GgufWriteError::Convert {
                file: dir_s.clone(),
                problem: format!("no Hugging Face source is known for tensor '{}'", t.name),
            }
        })?;
        let mut v = Vec::with_capacity(s.pieces.len());
        for p in s.pieces {
            v.push(resolve(dir, src, &p, t)?);
            used.insert(p.hf);
        }
        plan.push((v, s.transform));
    }
    if let Some(extra) = src.keys().find(|k| !used.contains(*k)) {
        return Err(GgufWriteError::Convert {
            file: dir_s,
            problem: format!(
                "tensor `{extra}` has no place in a {arch_name} GGUF; it would be dropped"
            ),
        });
    }
    Ok(plan)
}

/// Check piece `p` of GGUF tensor `t` against the folder's tensor: present, a float type, and
/// holding exactly `p.hf_rows` rows of `t.dims[0]` (its last dim; size-1 dims aside).
fn resolve(
    dir: &Path,
    src: &BTreeMap<String, Source>,
    p: &Piece,
    t: &TensorInfo,
) -> Result<Resolved, GgufWriteError> {
    let s = src.get(&p.hf).ok_or_else(|| GgufWriteError::Convert {
        file: dir.display().to_string(),
        problem: format!("tensor `{}` (for '{}') is missing", p.hf, t.name),
    })?;
    let ne0 = t.dims[0];
    let last = s.t.shape.last().copied().unwrap_or(1);
    if last != ne0 || s.t.elements() != p.hf_rows * ne0 {
        let want = if p.hf_rows == 1 {
            format!("[{ne0}]")
        } else {
            format!("[{}, {ne0}]", p.hf_rows)
        };
        return Err(GgufWriteError::Convert {
            file: dir.join(&s.shard).display().to_string(),
            problem: format!(
                "tensor `{}` has shape {:?}, expected {want} for '{}' {:?}",
                p.hf, s.t.shape, t.name, t.dims
            ),
        });
    }
    if !matches!(s.t.dtype, StDtype::F32 | StDtype::F16 | StDtype::BF16) {
        return Err(GgufWriteError::Convert {
            file: dir.join(&s.shard).display().to_string(),
            problem: format!(
                "tensor `{}` is {}; only F32, F16 and BF16 folders convert",
                p.hf, s.t.dtype
            ),
        });
    }
    Ok(Resolved {
        src: s.clone(),
        row0: p.row0,
        rows: p.rows,
    })
}

/// Little-endian F32/F16/BF16 bytes to f32.
fn decode(dtype: StDtype, raw: &[u8], out: &mut Vec<f32>) {
    out.clear();
    match dtype {
        StDtype::F32 => out.extend(
            raw.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        StDtype::F16 => out.extend(
            raw.chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        StDtype::BF16 => out.extend(
            raw.chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        _ => {}
    }
}

/// The vocabulary of `dir/tokenizer.json` (a byte-level BPE), padded to `n_vocab` with
/// unused `[PAD{i}]` tokens as llama.cpp's converter does; `None` when there is no file.
/// `tokenizer_config.json`'s `chat_template` and the config's bos/eos ids come along.
pub fn vocab_from_folder(dir: &Path, n_vocab: u64) -> Result<Option<Vocab>, GgufWriteError> {
    let path = dir.join("tokenizer.json");
    if !path.is_file() {
        return Ok(None);
    }
    let file = path.display().to_string();
    let bad = |problem: String| GgufWriteError::Convert {
        file: file.clone(),
        problem,
    };
    let read_json = |p: &Path| -> Result<serde_json::Value, GgufWriteError> {
        let f = p.display().to_string();
        let bytes = std::fs::read(p).map_err(|source| GgufWriteError::Io {
            file: f.clone(),
            offset: 0,
            what: "read".into(),
            source,
        })?;
        serde_json::from_slice(&bytes).map_err(|e| GgufWriteError::Convert {
            file: f,
            problem: format!("not JSON: {e}"),
        })
    };
    let j = read_json(&path)?;
    let model = &j["model"];
    if model["type"].as_str() != Some("BPE") {
        return Err(bad(format!(
            "tokenizer model type {} is not BPE",
            model["type"]
        )));
    }
    let n = usize::try_from(n_vocab).map_err(|_| bad("n_vocab too large".into()))?;
    let mut tokens: Vec<Option<String>> = vec![None; n];
    let mut types = vec![1i32; n];
    let vocab = model["vocab"]
        .as_object()
        .ok_or_else(|| bad("model.vocab is not an object".into()))?;
    let mut place = |tok: &str, id: u64, ty: i32| -> Result<(), GgufWriteError> {
        let slot = tokens
            .get_mut(id as usize)
            .ok_or_else(|| bad(format!("token id {id} is not below n_vocab {n_vocab}")))?;
        *slot = Some(tok.to_string());
        types[id as usize] = ty;
        Ok(())
    };
    for (tok, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| bad(format!("model.vocab[{tok}] is not an id")))?;
        place(tok, id, 1)?;
    }
    if let Some(added) = j["added_tokens"].as_array() {
        for a in added {
            let (Some(id), Some(c)) = (a["id"].as_u64(), a["content"].as_str()) else {
                return Err(bad("added_tokens entries need `id` and `content`".into()));
            };
            let ty = if a["special"].as_bool() == Some(true) {
                3
            } else {
                4
            };
            place(c, id, ty)?;
        }
    }
    let tokens: Vec<String> = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            t.unwrap_or_else(|| {
                types[i] = 5;
                format!("[PAD{i}]")
            })
        })
        .collect();
    let merges = match model["merges"].as_array() {
        None => Vec::new(),
        Some(m) => m
            .iter()
            .map(|e| match e {
                serde_json::Value::String(s) => Ok(s.clone()),
                serde_json::Value::Array(p) if p.len() == 2 => Ok(format!(
                    "{} {}",
                    p[0].as_str().unwrap_or(""),
                    p[1].as_str().unwrap_or("")
                )),
                _ => Err(bad("model.merges entries must be strings or pairs".into())),
            })
            .collect::<Result<_, _>>()?,
    };
    let cfg = read_json(&dir.join("config.json"))?;
    let id = |k: &str| cfg[k].as_u64().and_then(|v| u32::try_from(v).ok());
    let tcfg = dir.join("tokenizer_config.json");
    let chat_template = if tcfg.is_file() {
        read_json(&tcfg)?["chat_template"]
            .as_str()
            .map(str::to_string)
    } else {
        None
    };
    Ok(Some(Vocab {
        tokens,
        token_type: types,
        merges,
        pre: Some("qwen2".into()),
        bos: id("bos_token_id"),
        eos: id("eos_token_id"),
        pad: None,
        chat_template,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::read_gguf;
    use crate::gguf::testutil::{tensor_f32, tmp};

    /// The F32 values of an HF tensor, read straight from the safetensors file.
    fn st_values(file: &Path, name: &str) -> Vec<f32> {
        let h = crate::safetensors::read_header(file).unwrap();
        let t = h.tensor(name).unwrap();
        let bytes = std::fs::read(file).unwrap();
        let raw = &bytes[(h.data_start + t.begin) as usize..(h.data_start + t.end) as usize];
        let mut out = Vec::new();
        decode(t.dtype, raw, &mut out);
        out
    }

    #[test]
    fn converting_the_tiny_hf_model_keeps_every_value() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/tiny-qwen3moe/base");
        let st = dir.join("model.safetensors");
        let d = tmp();
        let out = d.path().join("tiny-f32.gguf");
        convert_hf_folder(&dir, &out, GgmlType::F32, None).unwrap();
        let f = read_gguf(&out).unwrap();
        let hp = crate::safetensors::load_folder(&dir).unwrap().hparams;
        let want =
            arch::expected_tensors("qwen3moe", &hp, &QuantRecipe::preset("F32").unwrap()).unwrap();
        let got: Vec<_> = f
            .tensors
            .iter()
            .map(|t| (t.name.clone(), t.dims.clone(), t.ggml_type))
            .collect();
        let exp: Vec<_> = want
            .iter()
            .map(|t| (t.name.clone(), t.dims.clone(), t.ggml_type))
            .collect();
        assert_eq!(got, exp);
        assert_eq!(f.get_u64("qwen3moe.expert_count").unwrap(), Some(8));
        assert_eq!(f.get_u64("qwen3moe.block_count").unwrap(), Some(2));
        assert_eq!(f.get_f64("qwen3moe.rope.freq_base").unwrap(), Some(10000.0));
        for (gguf, hf) in [
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("output.weight", "lm_head.weight"),
            (
                "blk.1.attn_q.weight",
                "model.layers.1.self_attn.q_proj.weight",
            ),
            (
                "blk.0.attn_k_norm.weight",
                "model.layers.0.self_attn.k_norm.weight",
            ),
            (
                "blk.1.ffn_gate_inp.weight",
                "model.layers.1.mlp.gate.weight",
            ),
            ("output_norm.weight", "model.norm.weight"),
        ] {
            assert_eq!(tensor_f32(&out, gguf), st_values(&st, hf), "{gguf}");
        }
        // Expert 5 of layer 0's down stack: [32, 64, 8], one [64 x 32] slice per expert.
        let down = tensor_f32(&out, "blk.0.ffn_down_exps.weight");
        let e5 = st_values(&st, "model.layers.0.mlp.experts.5.down_proj.weight");
        assert_eq!(&down[5 * 64 * 32..6 * 64 * 32], &e5[..]);
        let up = tensor_f32(&out, "blk.1.ffn_up_exps.weight");
        assert_eq!(
            &up[7 * 32 * 64..],
            &st_values(&st, "model.layers.1.mlp.experts.7.up_proj.weight")[..]
        );

        // Q8_0: the router and norms stay F32, matrices are Q8_0 and close.
        let q = d.path().join("tiny-q8.gguf");
        convert_hf_folder(&dir, &q, GgmlType::Q8_0, None).unwrap();
        let fq = read_gguf(&q).unwrap();
        assert_eq!(
            fq.tensor("blk.0.ffn_gate_inp.weight").unwrap().ggml_type,
            GgmlType::F32
        );
        assert_eq!(
            fq.tensor("blk.0.attn_norm.weight").unwrap().ggml_type,
            GgmlType::F32
        );
        assert_eq!(
            fq.tensor("blk.0.ffn_down_exps.weight").unwrap().ggml_type,
            GgmlType::Q8_0
        );
        let qd = tensor_f32(&q, "blk.0.ffn_down_exps.weight");
        let amax = down.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(down
            .iter()
            .zip(&qd)
            .all(|(a, b)| (a - b).abs() <= amax / 127.0));
        // Unsupported target types are named.
        let e = convert_hf_folder(&dir, &q, GgmlType::Q6K, None).unwrap_err();
        assert!(e.to_string().contains("Q6_K"), "{e}");
    }
}

/// qwen3next conversion against a synthetic Hugging Face folder (transformers-5 style config,
/// ratio-2 linear heads, an MTP block), checked value for value by an oracle written from
/// llama.cpp's converter independently of [`hf_sources`].
#[cfg(test)]
mod next_tests {
    use super::*;
    use crate::gguf::model::load_gguf_model;
    use crate::gguf::read_gguf;
    use crate::gguf::testutil::{tensor_f32, tmp};
    use crate::inventory::HParams;
    use serde_json::json;
    use std::collections::BTreeMap;

    // hidden 32, 3 blocks (linear, linear, full) + MTP, 2 heads of 8 over 1 KV head,
    // linear 2 key heads / 4 value heads of 4, conv 3, 3 experts of 8, shared expert 6.
    const H: u64 = 32;
    const VOCAB: u64 = 40;
    const NK: u64 = 2;
    const NV: u64 = 4;
    const DK: u64 = 4;
    const NH: u64 = 2;
    const HD: u64 = 8;
    const NE: u64 = 3;
    const FF: u64 = 8;
    const SH: u64 = 6;
    const CONV: u64 = 3;

    fn config() -> serde_json::Value {
        json!({
            "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
            "vocab_size": VOCAB, "hidden_size": H, "num_hidden_layers": 3,
            "num_attention_heads": NH, "num_key_value_heads": 1, "head_dim": HD,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default",
                                "partial_rotary_factor": 0.25},
            "layer_types": ["linear_attention", "linear_attention", "full_attention"],
            "full_attention_interval": 3,
            "linear_conv_kernel_dim": CONV, "linear_key_head_dim": DK,
            "linear_value_head_dim": DK, "linear_num_key_heads": NK,
            "linear_num_value_heads": NV, "num_experts": NE, "num_experts_per_tok": 2,
            "moe_intermediate_size": FF, "shared_expert_intermediate_size": SH,
            "norm_topk_prob": true, "tie_word_embeddings": false, "decoder_sparse_step": 1,
            "mlp_only_layers": []
        })
    }

    /// Every HF tensor (name, shape) of the folder.
    fn hf_shapes() -> Vec<(String, Vec<u64>)> {
        let mut v: Vec<(String, Vec<u64>)> = vec![
            ("model.embed_tokens.weight".into(), vec![VOCAB, H]),
            ("model.norm.weight".into(), vec![H]),
            ("lm_head.weight".into(), vec![VOCAB, H]),
            ("mtp.fc.weight".into(), vec![H, 2 * H]),
            ("mtp.pre_fc_norm_embedding.weight".into(), vec![H]),
            ("mtp.pre_fc_norm_hidden.weight".into(), vec![H]),
            ("mtp.norm.weight".into(), vec![H]),
        ];
        let (kd, vd) = (NK * DK, NV * DK);
        for (p, full) in [
            ("model.layers.0", false),
            ("model.layers.1", false),
            ("model.layers.2", true),
            ("mtp.layers.0", true),
        ] {
            let mut add = |s: &str, shape: Vec<u64>| v.push((format!("{p}.{s}"), shape));
            add("input_layernorm.weight", vec![H]);
            add("post_attention_layernorm.weight", vec![H]);
            if full {
                add("self_attn.q_proj.weight", vec![2 * NH * HD, H]);
                add("self_attn.k_proj.weight", vec![HD, H]);
                add("self_attn.v_proj.weight", vec![HD, H]);
                add("self_attn.o_proj.weight", vec![H, NH * HD]);
                add("self_attn.q_norm.weight", vec![HD]);
                add("self_attn.k_norm.weight", vec![HD]);
            } else {
                add("linear_attn.in_proj_qkvz.weight", vec![2 * kd + 2 * vd, H]);
                add("linear_attn.in_proj_ba.weight", vec![2 * NV, H]);
                add("linear_attn.conv1d.weight", vec![2 * kd + vd, 1, CONV]);
                add("linear_attn.dt_bias", vec![NV]);
                add("linear_attn.A_log", vec![NV]);
                add("linear_attn.norm.weight", vec![DK]);
                add("linear_attn.out_proj.weight", vec![H, vd]);
            }
            add("mlp.gate.weight", vec![NE, H]);
            for e in 0..NE {
                add(&format!("mlp.experts.{e}.gate_proj.weight"), vec![FF, H]);
                add(&format!("mlp.experts.{e}.up_proj.weight"), vec![FF, H]);
                add(&format!("mlp.experts.{e}.down_proj.weight"), vec![H, FF]);
            }
            add("mlp.shared_expert.gate_proj.weight", vec![SH, H]);
            add("mlp.shared_expert.up_proj.weight", vec![SH, H]);
            add("mlp.shared_expert.down_proj.weight", vec![H, SH]);
            add("mlp.shared_expert_gate.weight", vec![1, H]);
        }
        v
    }

    /// Distinct, deterministic values per tensor.
    fn values(name: &str, n: u64) -> Vec<f32> {
        let h = name
            .bytes()
            .fold(7u64, |a, b| a.wrapping_mul(31).wrapping_add(u64::from(b)));
        (0..n)
            .map(|i| ((h.wrapping_add(i * 7919) % 2001) as f32 / 1000.0) - 1.0)
            .collect()
    }

    /// A single-file F32 safetensors folder with `tensors` (name -> values, shape).
    fn write_folder(dir: &Path, tensors: &[(String, Vec<u64>, Vec<f32>)]) {
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        for (name, shape, vals) in tensors {
            let b = data.len();
            data.extend(vals.iter().flat_map(|v| v.to_le_bytes()));
            header.insert(
                name.clone(),
                json!({"dtype": "F32", "shape": shape, "data_offsets": [b, data.len()]}),
            );
        }
        let mut h = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap();
        while h.len() % 8 != 0 {
            h.push(b' ');
        }
        let mut file = (h.len() as u64).to_le_bytes().to_vec();
        file.extend(h);
        file.extend(data);
        std::fs::write(dir.join("model.safetensors"), file).unwrap();
        std::fs::write(
            dir.join("config.json"),
            serde_json::to_vec(&config()).unwrap(),
        )
        .unwrap();
    }

    fn folder(dir: &Path) -> BTreeMap<String, Vec<f32>> {
        let ts: Vec<(String, Vec<u64>, Vec<f32>)> = hf_shapes()
            .into_iter()
            .map(|(n, s)| {
                let v = values(&n, s.iter().product());
                (n, s, v)
            })
            .collect();
        write_folder(dir, &ts);
        ts.into_iter().map(|(n, _, v)| (n, v)).collect()
    }

    /// What llama.cpp's converter writes for each GGUF tensor of a qwen3next model with `hp`,
    /// from the HF values.
    fn oracle(hf: &BTreeMap<String, Vec<f32>>, hp: &HParams) -> BTreeMap<String, Vec<f32>> {
        let get = |n: &str| hf.get(n).unwrap_or_else(|| panic!("{n}")).clone();
        let plus1 = |n: &str| get(n).iter().map(|v| v + 1.0).collect::<Vec<f32>>();
        let mut o = BTreeMap::new();
        o.insert(
            "token_embd.weight".to_string(),
            get("model.embed_tokens.weight"),
        );
        o.insert("output.weight".into(), get("lm_head.weight"));
        o.insert("output_norm.weight".into(), plus1("model.norm.weight"));
        let ssm = hp.ssm.clone().unwrap();
        let (h, nk, nv, dk) = (
            hp.n_embd as usize,
            ssm.group_count as usize,
            ssm.time_step_rank as usize,
            ssm.state_size as usize,
        );
        for b in 0..hp.n_blocks_total() {
            let p = if b < hp.n_layer {
                format!("model.layers.{b}")
            } else {
                format!("mtp.layers.{}", b - hp.n_layer)
            };
            let full = hp.layer_kind(b) == crate::inventory::LayerKind::FullAttention;
            let mut put = |s: &str, v: Vec<f32>| o.insert(format!("blk.{b}.{s}"), v);
            let f = |s: &str| format!("{p}.{s}");
            put("attn_norm.weight", plus1(&f("input_layernorm.weight")));
            put(
                "post_attention_norm.weight",
                plus1(&f("post_attention_layernorm.weight")),
            );
            if full {
                put("attn_q.weight", get(&f("self_attn.q_proj.weight")));
                put("attn_k.weight", get(&f("self_attn.k_proj.weight")));
                put("attn_v.weight", get(&f("self_attn.v_proj.weight")));
                put("attn_output.weight", get(&f("self_attn.o_proj.weight")));
                put("attn_q_norm.weight", plus1(&f("self_attn.q_norm.weight")));
                put("attn_k_norm.weight", plus1(&f("self_attn.k_norm.weight")));
            } else {
                // in_proj_qkvz viewed as [nk, q dk | k dk | v r·dv | z r·dv] rows of H.
                let w = get(&f("linear_attn.in_proj_qkvz.weight"));
                let rv = (nv / nk) * dk;
                let group = 2 * dk + 2 * rv;
                let rows = |g: usize, off: usize, n: usize| -> Vec<f32> {
                    let r0 = g * group + off;
                    w[r0 * h..(r0 + n) * h].to_vec()
                };
                let mut qkv = Vec::new();
                for (off, n) in [(0, dk), (dk, dk), (2 * dk, rv)] {
                    for g in 0..nk {
                        qkv.extend(rows(g, off, n));
                    }
                }
                assert_eq!(qkv.len(), (2 * nk * dk + nv * dk) * h);
                let mut z = Vec::new();
                for g in 0..nk {
                    z.extend(rows(g, 2 * dk + rv, rv));
                }
                put("attn_qkv.weight", qkv);
                put("attn_gate.weight", z);
                put("ssm_ba.weight", get(&f("linear_attn.in_proj_ba.weight")));
                put("ssm_conv1d.weight", get(&f("linear_attn.conv1d.weight")));
                put("ssm_dt.bias", get(&f("linear_attn.dt_bias")));
                put(
                    "ssm_a",
                    get(&f("linear_attn.A_log"))
                        .iter()
                        .map(|v| -v.exp())
                        .collect(),
                );
                put("ssm_norm.weight", get(&f("linear_attn.norm.weight")));
                put("ssm_out.weight", get(&f("linear_attn.out_proj.weight")));
            }
            put("ffn_gate_inp.weight", get(&f("mlp.gate.weight")));
            for proj in ["gate", "up", "down"] {
                let stack: Vec<f32> = (0..hp.n_expert)
                    .flat_map(|e| get(&f(&format!("mlp.experts.{e}.{proj}_proj.weight"))))
                    .collect();
                put(&format!("ffn_{proj}_exps.weight"), stack);
                put(
                    &format!("ffn_{proj}_shexp.weight"),
                    get(&f(&format!("mlp.shared_expert.{proj}_proj.weight"))),
                );
            }
            put(
                "ffn_gate_inp_shexp.weight",
                get(&f("mlp.shared_expert_gate.weight")),
            );
            if b >= hp.n_layer {
                put("nextn.eh_proj.weight", get("mtp.fc.weight"));
                put(
                    "nextn.enorm.weight",
                    plus1("mtp.pre_fc_norm_embedding.weight"),
                );
                put("nextn.hnorm.weight", plus1("mtp.pre_fc_norm_hidden.weight"));
                put("nextn.shared_head_norm.weight", plus1("mtp.norm.weight"));
            }
        }
        o
    }

    /// Convert `dir` to F32 and check every GGUF tensor against the oracle.
    fn check_f32_conversion(dir: &Path, out: &Path, hf: &BTreeMap<String, Vec<f32>>) {
        convert_hf_folder(dir, out, GgmlType::F32, None).unwrap();
        let from_folder = crate::safetensors::load_folder(dir).unwrap();
        let (inv, _) = load_gguf_model(out).unwrap();
        assert_eq!(inv.hparams, from_folder.hparams);
        let want = oracle(hf, &inv.hparams);
        let f = read_gguf(out).unwrap();
        let mut names: Vec<&str> = f.tensors.iter().map(|t| t.name.as_str()).collect();
        names.sort_unstable();
        assert_eq!(names, want.keys().map(String::as_str).collect::<Vec<_>>());
        for (name, v) in &want {
            assert_eq!(&tensor_f32(out, name), v, "{name}");
        }
    }

    #[test]
    fn qwen3next_folder_converts_value_for_value() {
        let d = tmp();
        let hf = folder(d.path());
        let out = d.path().join("next-f32.gguf");
        // Every value, and the hyperparameters read back equal the folder's
        // (partial_rotary_factor from rope_parameters, interval, ssm, MTP).
        check_f32_conversion(d.path(), &out, &hf);
        let (inv, g) = load_gguf_model(&out).unwrap();
        assert_eq!(inv.hparams.rope_dim, Some(2));
        assert_eq!(inv.hparams.nextn_predict_layers, 1);
        assert_eq!(inv.hparams.full_attention_interval, Some(3));
        let k = |s: &str| format!("qwen3next.{s}");
        assert_eq!(g.get_u64(&k("block_count")).unwrap(), Some(4));
        assert_eq!(g.get_u64(&k("full_attention_interval")).unwrap(), Some(3));
        assert_eq!(g.get_u64(&k("ssm.conv_kernel")).unwrap(), Some(CONV));
        assert_eq!(g.get_u64(&k("ssm.state_size")).unwrap(), Some(DK));
        assert_eq!(g.get_u64(&k("ssm.group_count")).unwrap(), Some(NK));
        assert_eq!(g.get_u64(&k("ssm.time_step_rank")).unwrap(), Some(NV));
        assert_eq!(g.get_u64(&k("ssm.inner_size")).unwrap(), Some(NV * DK));
        assert_eq!(g.get_u64(&k("rope.dimension_count")).unwrap(), Some(2));
        assert_eq!(g.get_u64(&k("nextn_predict_layers")).unwrap(), Some(1));
        assert_eq!(
            g.get_u64(&k("expert_shared_feed_forward_length")).unwrap(),
            Some(SH)
        );

        let f = read_gguf(&out).unwrap();
        assert_eq!(
            f.tensor("blk.0.ssm_conv1d.weight").unwrap().dims,
            vec![CONV, 2 * NK * DK + NV * DK]
        );

        // Q8_0: matrices quantized, the conv kernel, 1-D tensors and routers stay F32.
        let q = d.path().join("next-q8.gguf");
        convert_hf_folder(d.path(), &q, GgmlType::Q8_0, None).unwrap();
        let fq = read_gguf(&q).unwrap();
        let ty = |n: &str| fq.tensor(n).unwrap().ggml_type;
        assert_eq!(ty("blk.0.attn_qkv.weight"), GgmlType::Q8_0);
        assert_eq!(ty("blk.3.nextn.eh_proj.weight"), GgmlType::Q8_0);
        for n in [
            "blk.0.ssm_conv1d.weight",
            "blk.0.ssm_a",
            "blk.0.ssm_norm.weight",
            "blk.1.ffn_gate_inp.weight",
            "blk.2.ffn_gate_inp_shexp.weight",
        ] {
            assert_eq!(ty(n), GgmlType::F32, "{n}");
        }
    }

    #[test]
    fn missing_and_stray_tensors_are_named() {
        let d = tmp();
        let all: Vec<(String, Vec<u64>, Vec<f32>)> = hf_shapes()
            .into_iter()
            .map(|(n, s)| {
                let v = values(&n, s.iter().product());
                (n, s, v)
            })
            .collect();
        let out = d.path().join("x.gguf");
        // The folder reader finds a missing expert; conversion names a missing MTP norm.
        let drop = "mtp.pre_fc_norm_hidden.weight";
        let fewer: Vec<_> = all.iter().filter(|t| t.0 != drop).cloned().collect();
        write_folder(d.path(), &fewer);
        let e = convert_hf_folder(d.path(), &out, GgmlType::F32, None)
            .unwrap_err()
            .to_string();
        // The folder's layout check names the GGUF tensor the dropped one becomes.
        assert!(e.contains(drop) || e.contains("nextn.hnorm.weight"), "{e}");
        // A misshapen source is named with the shape it should have.
        let mut bad = all.clone();
        if let Some(t) = bad
            .iter_mut()
            .find(|t| t.0 == "model.layers.0.linear_attn.A_log")
        {
            t.1 = vec![2, 2];
        }
        write_folder(d.path(), &bad);
        let e = convert_hf_folder(d.path(), &out, GgmlType::F32, None)
            .unwrap_err()
            .to_string();
        // Named as the HF tensor or as the GGUF tensor it becomes, with the shape it needs.
        assert!(e.contains("A_log") || e.contains("blk.0.ssm_a"), "{e}");
    }

    /// The HF values of every tensor of a folder holding one F32 `model.safetensors`.
    fn read_values(dir: &Path) -> BTreeMap<String, Vec<f32>> {
        let file = dir.join("model.safetensors");
        let h = crate::safetensors::read_header(&file).unwrap();
        let bytes = std::fs::read(&file).unwrap();
        h.tensors
            .iter()
            .map(|t| {
                let raw =
                    &bytes[(h.data_start + t.begin) as usize..(h.data_start + t.end) as usize];
                let mut v = Vec::new();
                decode(t.dtype, raw, &mut v);
                (t.name.clone(), v)
            })
            .collect()
    }

    /// The transformers references (scripts/make_reference_next.py): the folder reads back as
    /// the hyperparameters the script recorded, and converts value for value.
    #[test]
    fn converting_the_tiny_qwen3next_references_keeps_every_value() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/tiny-qwen3next");
        let d = tmp();
        let mut n = 0;
        for variant in ["base", "interval2", "odd", "cuda"] {
            let dir = root.join(variant);
            let r: serde_json::Value =
                serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap())
                    .unwrap();
            let want: HParams = serde_json::from_value(r["hparams"].clone()).unwrap();
            let got = crate::safetensors::load_folder(&dir).unwrap().hparams;
            assert_eq!(
                got, want,
                "{variant}: config.json reads as the script's hparams"
            );
            let out = d.path().join(format!("{variant}.gguf"));
            check_f32_conversion(&dir, &out, &read_values(&dir));
            n += 1;
        }
        assert_eq!(n, 4);
    }
}
