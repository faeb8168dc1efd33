//! Hugging Face safetensors folders to GGUF in llama.cpp's tensor names and shapes: each GGUF
//! tensor is assembled from its HF sources (one tensor, or one per expert for a stack),
//! decoded, quantized to the target type and streamed out, with the folder's tokenizer as
//! `tokenizer.ggml.*` metadata.
//! Invariant: every value of the source reaches the file (bit for bit at F32); a tensor the
//! architecture needs but the folder lacks is an error naming it.

use super::metadata::{arch_metadata, file_type, Vocab};
use super::random::rows_per_chunk;
use super::write::{GgufWriteError, GgufWriter, ProgressFn, WriteSummary};
use super::GgufValue;
use crate::arch::{self, QuantRecipe};
use crate::ggml::GgmlType;
use crate::inventory::TensorInfo;
use crate::quant::{self};
use crate::safetensors::{self, StDtype, StTensor};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// Where a GGUF tensor's data comes from: HF tensors concatenated in order (one for a 1:1
/// tensor, one per expert for a stack).
struct Source {
    shard: String,
    data_start: u64,
    t: StTensor,
}

/// The HF tensor names a qwen3moe GGUF tensor is made of.
fn qwen3moe_sources(name: &str, n_expert: u64) -> Option<Vec<String>> {
    let one = |s: &str| Some(vec![s.to_string()]);
    match name {
        "token_embd.weight" => return one("model.embed_tokens.weight"),
        "output.weight" => return one("lm_head.weight"),
        "output_norm.weight" => return one("model.norm.weight"),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (l, tail) = rest.split_once('.')?;
    let p = format!("model.layers.{l}");
    let m = |s: &str| Some(vec![format!("{p}.{s}")]);
    match tail {
        "attn_norm.weight" => m("input_layernorm.weight"),
        "ffn_norm.weight" => m("post_attention_layernorm.weight"),
        "attn_q.weight" => m("self_attn.q_proj.weight"),
        "attn_k.weight" => m("self_attn.k_proj.weight"),
        "attn_v.weight" => m("self_attn.v_proj.weight"),
        "attn_output.weight" => m("self_attn.o_proj.weight"),
        "attn_q_norm.weight" => m("self_attn.q_norm.weight"),
        "attn_k_norm.weight" => m("self_attn.k_norm.weight"),
        "ffn_gate_inp.weight" => m("mlp.gate.weight"),
        _ => {
            let proj = match tail {
                "ffn_gate_exps.weight" => "gate_proj",
                "ffn_up_exps.weight" => "up_proj",
                "ffn_down_exps.weight" => "down_proj",
                _ => return None,
            };
            Some(
                (0..n_expert)
                    .map(|e| format!("{p}.mlp.experts.{e}.{proj}.weight"))
                    .collect(),
            )
        }
    }
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

/// Convert a Hugging Face qwen3moe folder (F32/F16/BF16 safetensors, one file or sharded)
/// to a GGUF in llama.cpp's layout: names mapped as llama.cpp's converter does, dims the
/// PyTorch shape reversed with the same row-major bytes (no q/k permutation: Qwen uses NeoX
/// RoPE), per-expert tensors stacked into `ffn_*_exps` `[in, out, n_expert]` in expert order,
/// 1-D tensors and `ffn_gate_inp` kept F32, matrices stored as `ty` (F32, F16, BF16, Q8_0,
/// Q4_K; a row Q4_K cannot hold — llama.cpp would fall back to Q5_0 — is stored F16). The
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
    if inv.arch != "qwen3moe" {
        return Err(GgufWriteError::Convert {
            file: dir_s,
            problem: format!(
                "architecture {} is not converted yet (only qwen3moe; qwen3next needs llama.cpp's value transforms: norms +1, A_log -> -exp, qkvz reordering)",
                inv.arch
            ),
        });
    }
    let recipe = convert_recipe(ty).ok_or_else(|| GgufWriteError::Unsupported {
        file: out_file.clone(),
        name: "(all matrices)".into(),
        ty,
    })?;
    let hp = inv.hparams.clone();
    let mut tensors = arch::expected_tensors("qwen3moe", &hp, &recipe).map_err(|source| {
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
    let mut src = folder_tensors(dir)?;
    // Resolve every GGUF tensor to its sources before writing a byte.
    let mut plan: Vec<Vec<Source>> = Vec::with_capacity(tensors.len());
    for t in &tensors {
        let names =
            qwen3moe_sources(&t.name, hp.n_expert).ok_or_else(|| GgufWriteError::Convert {
                file: dir_s.clone(),
                problem: format!("no Hugging Face source is known for tensor '{}'", t.name),
            })?;
        let per_src_rows: u64 = t.dims[1..].iter().product::<u64>() / names.len() as u64;
        let mut v = Vec::with_capacity(names.len());
        for n in names {
            let s = src.remove(&n).ok_or_else(|| GgufWriteError::Convert {
                file: dir_s.clone(),
                problem: format!("tensor `{n}` (for '{}') is missing", t.name),
            })?;
            let want: Vec<u64> = if t.dims.len() == 1 {
                vec![t.dims[0]]
            } else {
                vec![per_src_rows, t.dims[0]]
            };
            if s.t.shape != want {
                return Err(GgufWriteError::Convert {
                    file: dir.join(&s.shard).display().to_string(),
                    problem: format!(
                        "tensor `{n}` has shape {:?}, expected {want:?} for '{}' {:?}",
                        s.t.shape, t.name, t.dims
                    ),
                });
            }
            if !matches!(s.t.dtype, StDtype::F32 | StDtype::F16 | StDtype::BF16) {
                return Err(GgufWriteError::Convert {
                    file: dir.join(&s.shard).display().to_string(),
                    problem: format!(
                        "tensor `{n}` is {}; only F32, F16 and BF16 folders convert",
                        s.t.dtype
                    ),
                });
            }
            v.push(s);
        }
        plan.push(v);
    }
    if let Some(extra) = src.keys().next() {
        return Err(GgufWriteError::Convert {
            file: dir_s,
            problem: format!(
                "tensor `{extra}` has no place in a qwen3moe GGUF; it would be dropped"
            ),
        });
    }

    let mut w = GgufWriter::new(out_path);
    let meta = arch_metadata("qwen3moe", &inv.name, &hp).map_err(|p| GgufWriteError::Convert {
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
    for (t, sources) in tensors.iter().zip(&plan) {
        let ne0 = t.dims[0];
        let in_rb = |d: StDtype| ne0 * d.bits() / 8;
        let out_rb = t.ggml_type.bytes_for(ne0).unwrap_or(0) as usize;
        for so in sources {
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
            let rows = so.t.elements() / ne0;
            let rb = in_rb(so.t.dtype);
            let per = rows_per_chunk(ne0);
            let mut r = 0;
            while r < rows {
                let n = per.min(rows - r);
                let at = so.data_start + so.t.begin + r * rb;
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
                r += n;
            }
        }
    }
    s.finish()
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
