//! Test-only bridge to transformers' reference outputs (`scripts/make_reference.py`): a
//! minimal float32 safetensors reader, the Hugging Face -> llama.cpp tensor-name mapping for
//! Qwen3-MoE, and the comparison of our logits and greedy tokens with transformers'.
//! Invariant: the mapping only renames and stacks (a PyTorch `[out, in]` weight is GGUF
//! `[in, out]` with the same bytes); it never transforms values.

use super::MemWeights;
use crate::backend::cpu::Yarn;
use crate::engine::Engine;
use crate::exec::{standalone_cpu, Standalone};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;
use strata_schemas::ggml::GgmlType;
use strata_schemas::inventory::HParams;

type Tensors = HashMap<String, (Vec<u64>, Vec<f32>)>;

/// Parse a safetensors file holding only F32 tensors.
fn parse_safetensors(bytes: &[u8]) -> Result<Tensors, String> {
    let n = u64::from_le_bytes(bytes.get(..8).ok_or("short file")?.try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(bytes.get(8..8 + n).ok_or("short header")?)
        .map_err(|e| e.to_string())?;
    let data = &bytes[8 + n..];
    let mut out = Tensors::new();
    for (name, info) in header.as_object().ok_or("header is not an object")? {
        if name == "__metadata__" {
            continue;
        }
        if info["dtype"] != "F32" {
            return Err(format!("{name}: dtype {} (only F32 here)", info["dtype"]));
        }
        let shape: Vec<u64> = info["shape"]
            .as_array()
            .ok_or("shape")?
            .iter()
            .map(|v| v.as_u64().unwrap_or(0))
            .collect();
        let off = &info["data_offsets"];
        let (a, b) = (
            off[0].as_u64().ok_or("offset")? as usize,
            off[1].as_u64().ok_or("offset")? as usize,
        );
        let raw = data
            .get(a..b)
            .ok_or(format!("{name}: offsets past the data"))?;
        let vals = raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        out.insert(name.clone(), (shape, vals));
    }
    Ok(out)
}

/// Build llama.cpp-named tensors (stored as `ty`) from hub-named Qwen3-MoE tensors.
fn hf_to_gguf(t: &Tensors, hp: &HParams, ty: GgmlType) -> Result<MemWeights, String> {
    let mut w = MemWeights::new();
    let get = |n: &str| t.get(n).ok_or(format!("missing {n}"));
    // A 1-D or 2-D tensor: reverse the PyTorch shape into GGUF dims, same values.
    let put = |w: &mut MemWeights, hf: &str, gguf: &str, ty: GgmlType| -> Result<(), String> {
        let (shape, vals) = get(hf)?;
        let dims: Vec<u64> = shape.iter().rev().copied().collect();
        let ty = if dims[0] % ty.block_elems() == 0 {
            ty
        } else {
            GgmlType::F32
        };
        w.insert_f32(gguf, &dims, vals, ty)
            .map_err(|e| e.to_string())
    };
    put(&mut w, "model.embed_tokens.weight", "token_embd.weight", ty)?;
    put(&mut w, "lm_head.weight", "output.weight", ty)?;
    put(
        &mut w,
        "model.norm.weight",
        "output_norm.weight",
        GgmlType::F32,
    )?;
    for l in 0..hp.n_layer {
        let p = format!("model.layers.{l}");
        let g = |s: &str| format!("blk.{l}.{s}.weight");
        let f32t = GgmlType::F32;
        put(
            &mut w,
            &format!("{p}.input_layernorm.weight"),
            &g("attn_norm"),
            f32t,
        )?;
        put(
            &mut w,
            &format!("{p}.post_attention_layernorm.weight"),
            &g("ffn_norm"),
            f32t,
        )?;
        put(
            &mut w,
            &format!("{p}.self_attn.q_norm.weight"),
            &g("attn_q_norm"),
            f32t,
        )?;
        put(
            &mut w,
            &format!("{p}.self_attn.k_norm.weight"),
            &g("attn_k_norm"),
            f32t,
        )?;
        put(
            &mut w,
            &format!("{p}.self_attn.q_proj.weight"),
            &g("attn_q"),
            ty,
        )?;
        put(
            &mut w,
            &format!("{p}.self_attn.k_proj.weight"),
            &g("attn_k"),
            ty,
        )?;
        put(
            &mut w,
            &format!("{p}.self_attn.v_proj.weight"),
            &g("attn_v"),
            ty,
        )?;
        put(
            &mut w,
            &format!("{p}.self_attn.o_proj.weight"),
            &g("attn_output"),
            ty,
        )?;
        put(
            &mut w,
            &format!("{p}.mlp.gate.weight"),
            &g("ffn_gate_inp"),
            ty,
        )?;
        for (hf, gg) in [
            ("gate_proj", "ffn_gate_exps"),
            ("up_proj", "ffn_up_exps"),
            ("down_proj", "ffn_down_exps"),
        ] {
            let mut vals = Vec::new();
            let mut dims = Vec::new();
            for e in 0..hp.n_expert {
                let (shape, v) = get(&format!("{p}.mlp.experts.{e}.{hf}.weight"))?;
                dims = vec![shape[1], shape[0], hp.n_expert];
                vals.extend_from_slice(v);
            }
            let ty = if dims[0] % ty.block_elems() == 0 {
                ty
            } else {
                GgmlType::F32
            };
            w.insert_f32(g(gg), &dims, &vals, ty)
                .map_err(|e| e.to_string())?;
        }
    }
    Ok(w)
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Compare one variant folder with our forward pass; returns the largest logit difference.
fn check_variant(dir: &Path) -> Result<f32, String> {
    let rd =
        |f: &str| std::fs::read(dir.join(f)).map_err(|e| format!("{}: {e}", dir.join(f).display()));
    let reference: Value =
        serde_json::from_slice(&rd("reference.json")?).map_err(|e| e.to_string())?;
    let hp: HParams =
        serde_json::from_value(reference["hparams"].clone()).map_err(|e| e.to_string())?;
    let yarn = reference["yarn"].as_object().map(|y| {
        Yarn::new(
            y["factor"].as_f64().unwrap_or(1.0),
            y["orig_ctx"].as_u64().unwrap_or(1),
        )
    });
    let t = parse_safetensors(&rd("model.safetensors")?)?;
    let w = hf_to_gguf(&t, &hp, GgmlType::F32)?;
    let prompts = reference["prompts"].as_array().ok_or("prompts")?;
    let mut m = standalone_cpu(
        &hp,
        &w,
        "reference",
        Standalone {
            slots: prompts.len(),
            ctx: 64,
            kv: GgmlType::F32,
            // Passes of 5 tokens, so prompts run in several.
            max_tok: 5,
            ubatch: 64,
            yarn,
        },
    )
    .map_err(|e| e.to_string())?;
    let rope = m.stages()[0].backend.rope().clone();
    // RoPE tables against transformers' own.
    let inv: Vec<f64> = reference["rope"]["inv_freq"]
        .as_array()
        .ok_or("rope")?
        .iter()
        .map(|v| v.as_f64().unwrap_or(0.0))
        .collect();
    for (i, (a, b)) in rope.inv_freq().iter().zip(&inv).enumerate() {
        if ((*a as f64) - b).abs() > 1e-6 * b.abs().max(1e-3) {
            return Err(format!("inv_freq[{i}]: ours {a}, transformers {b}"));
        }
    }
    let att = reference["rope"]["attention_scaling"]
        .as_f64()
        .unwrap_or(1.0);
    if ((rope.attn_factor() as f64) - att).abs() > 1e-6 {
        return Err(format!(
            "attention scaling: ours {}, transformers {att}",
            rope.attn_factor()
        ));
    }
    let v = hp.n_vocab as usize;
    let mut worst = 0f32;
    for (pi, p) in prompts.iter().enumerate() {
        let toks: Vec<u32> = p
            .as_array()
            .ok_or("prompt")?
            .iter()
            .map(|t| t.as_u64().unwrap_or(0) as u32)
            .collect();
        let slot = pi;
        let ours = m
            .prefill_all(slot, &toks)
            .map_err(|e| e.to_string())?
            .to_vec();
        let want = reference["logits"][pi].as_array().ok_or("logits")?;
        for (pos, row) in want.iter().enumerate() {
            for (j, x) in row.as_array().ok_or("row")?.iter().enumerate() {
                let d = (ours[pos * v + j] - x.as_f64().unwrap_or(f64::NAN) as f32).abs();
                if d.is_nan() || d > 2e-4 {
                    return Err(format!(
                        "prompt {pi} position {pos} token {j}: differs by {d}"
                    ));
                }
                worst = worst.max(d);
            }
        }
        let mut next = argmax(&ours[(toks.len() - 1) * v..]);
        let mut got = vec![next];
        let greedy: Vec<u32> = reference["greedy"][pi]
            .as_array()
            .ok_or("greedy")?
            .iter()
            .map(|t| t.as_u64().unwrap_or(0) as u32)
            .collect();
        while got.len() < greedy.len() {
            next = argmax(m.decode(&[(slot, next)]).map_err(|e| e.to_string())?);
            got.push(next);
        }
        if got != greedy {
            return Err(format!(
                "prompt {pi}: greedy {got:?}, transformers {greedy:?}"
            ));
        }
    }
    Ok(worst)
}

#[test]
fn mapping_renames_and_stacks_without_changing_values() {
    let hp = HParams {
        n_layer: 1,
        n_embd: 4,
        n_vocab: 3,
        n_ctx_train: 16,
        n_head: 1,
        n_head_kv: 1,
        head_dim_k: 4,
        head_dim_v: 4,
        n_ff: 0,
        n_expert: 2,
        n_expert_used: 1,
        n_ff_exp: 2,
        n_ff_shexp: 0,
        n_leading_dense: 0,
        full_attention_interval: None,
        ssm: None,
        nextn_predict_layers: 0,
        rope_theta: 10000.0,
        rope_dim: None,
        rms_eps: 1e-6,
        norm_topk_prob: true,
        tied_embeddings: false,
    };
    // Write a safetensors file by hand: every tensor's values count up from a base.
    let mut specs: Vec<(String, Vec<u64>)> = vec![
        ("model.embed_tokens.weight".into(), vec![3, 4]),
        ("lm_head.weight".into(), vec![3, 4]),
        ("model.norm.weight".into(), vec![4]),
    ];
    let p = "model.layers.0";
    for (s, shape) in [
        ("input_layernorm", vec![4]),
        ("post_attention_layernorm", vec![4]),
        ("self_attn.q_norm", vec![4]),
        ("self_attn.k_norm", vec![4]),
        ("self_attn.q_proj", vec![4, 4]),
        ("self_attn.k_proj", vec![4, 4]),
        ("self_attn.v_proj", vec![4, 4]),
        ("self_attn.o_proj", vec![4, 4]),
        ("mlp.gate", vec![2, 4]),
    ] {
        specs.push((format!("{p}.{s}.weight"), shape));
    }
    for e in 0..2 {
        specs.push((format!("{p}.mlp.experts.{e}.gate_proj.weight"), vec![2, 4]));
        specs.push((format!("{p}.mlp.experts.{e}.up_proj.weight"), vec![2, 4]));
        specs.push((format!("{p}.mlp.experts.{e}.down_proj.weight"), vec![4, 2]));
    }
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (i, (name, shape)) in specs.iter().enumerate() {
        let n: u64 = shape.iter().product();
        let start = data.len();
        for k in 0..n {
            data.extend_from_slice(&((100 * i) as f32 + k as f32).to_le_bytes());
        }
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let h = serde_json::to_vec(&Value::Object(header)).unwrap();
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&h);
    file.extend_from_slice(&data);
    let t = parse_safetensors(&file).unwrap();
    let w = hf_to_gguf(&t, &hp, GgmlType::F32).unwrap();
    let q = w.get("blk.0.attn_q.weight").unwrap();
    assert_eq!(q.dims, vec![4, 4]);
    let down = w.get("blk.0.ffn_down_exps.weight").unwrap();
    assert_eq!(down.dims, vec![2, 4, 2], "[n_ff_exp, n_embd, n_expert]");
    let vals: Vec<f32> = down
        .data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let e1_down = specs
        .iter()
        .position(|(n, _)| n.ends_with("experts.1.down_proj.weight"))
        .unwrap();
    assert_eq!(
        vals[8],
        (100 * e1_down) as f32,
        "expert 1 starts after expert 0's 8 values"
    );
    let gate_inp = w.get("blk.0.ffn_gate_inp.weight").unwrap();
    assert_eq!(gate_inp.dims, vec![4, 2]);
    // The mapped model has every tensor the forward pass needs, with the right dims.
    let mut m = standalone_cpu(
        &hp,
        &w,
        "mapped",
        Standalone {
            slots: 1,
            ctx: 4,
            kv: GgmlType::F32,
            max_tok: 2,
            ubatch: 2,
            yarn: None,
        },
    )
    .unwrap();
    assert_eq!(m.prefill(0, &[0, 2], true).unwrap().unwrap().len(), 3);
}

#[test]
fn matches_transformers_reference() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/tiny-qwen3moe");
    let mut checked = 0;
    for variant in ["base", "yarn", "nonorm"] {
        let dir = root.join(variant);
        let worst = check_variant(&dir).unwrap_or_else(|e| panic!("{variant}: {e}"));
        eprintln!("{variant}: largest logit difference from transformers {worst:e}");
        checked += 1;
    }
    assert_eq!(checked, 3);
}
