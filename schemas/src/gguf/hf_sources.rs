//! Which Hugging Face tensors, which of their rows and which value transform make each llama.cpp
//! tensor, as llama.cpp's `convert_hf_to_gguf.py` assembles them (qwen3moe and qwen3next).
//! Invariant: the pieces of a GGUF tensor, read in order, give its rows in order; a whole-tensor
//! piece covers all rows of its source; every transform is elementwise.
//!
//! qwen3next (llama.cpp's `Qwen3NextModel`): zero-centred norms are stored `w + 1` (every
//! `*norm.weight` but the delta net's gated `linear_attn.norm`), `A_log` becomes `ssm_a =
//! −exp(A_log)`, `dt_bias` is `ssm_dt.bias`, the conv kernel `[C, 1, K]` is `ssm_conv1d [K, C]`
//! (same bytes), and `in_proj_qkvz` — per key head `g`, rows `[q_g (dk), k_g (dk), v_g (r·dv),
//! z_g (r·dv)]` with `r = n_v_heads / n_k_heads` — is split into `attn_qkv` (all q heads, all k
//! heads, all v heads) and `attn_gate` (all z heads). `in_proj_ba` keeps its grouped
//! `[b_g (r), a_g (r)]` order as `ssm_ba`. The MTP block `mtp.layers.K.*` is block
//! `n_layer + K`; `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden` and
//! `mtp.norm` are its `nextn.eh_proj`, `nextn.enorm`, `nextn.hnorm` and
//! `nextn.shared_head_norm`.

use crate::inventory::HParams;

/// An elementwise change of values on the way from HF to GGUF.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transform {
    /// Bit for bit.
    Copy,
    /// `w + 1` (HF's zero-centred RMSNorm weight to llama.cpp's plain one).
    PlusOne,
    /// `−exp(x)` (`A_log` to `ssm_a`).
    NegExp,
}

impl Transform {
    pub fn apply(self, x: &mut [f32]) {
        match self {
            Transform::Copy => {}
            Transform::PlusOne => x.iter_mut().for_each(|v| *v += 1.0),
            Transform::NegExp => x.iter_mut().for_each(|v| *v = -v.exp()),
        }
    }
}

/// Rows `[row0, row0 + rows)` of the HF tensor `hf` (viewed as `[hf_rows, ne0]`, `ne0` the
/// GGUF tensor's first dim).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    pub hf: String,
    pub row0: u64,
    pub rows: u64,
    /// Rows the HF tensor has in all (its element count over `ne0`).
    pub hf_rows: u64,
}

/// A GGUF tensor's pieces, in row order, and the transform of their values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sources {
    pub pieces: Vec<Piece>,
    pub transform: Transform,
}

/// The sources of the GGUF tensor `name` with dims `dims` (GGUF order) of an `arch` model with
/// `hp`; `None` when no HF tensor makes it.
pub fn sources(arch: &str, hp: &HParams, name: &str, dims: &[u64]) -> Option<Sources> {
    let total_rows: u64 = dims.iter().skip(1).product();
    let whole = |names: Vec<String>, transform| {
        let n = names.len() as u64;
        let per = total_rows / n.max(1);
        Some(Sources {
            pieces: names
                .into_iter()
                .map(|hf| Piece {
                    hf,
                    row0: 0,
                    rows: per,
                    hf_rows: per,
                })
                .collect(),
            transform,
        })
    };
    let next = arch == "qwen3next";
    let norm = if next {
        Transform::PlusOne
    } else {
        Transform::Copy
    };
    match name {
        "token_embd.weight" => {
            return whole(vec!["model.embed_tokens.weight".into()], Transform::Copy)
        }
        "output.weight" => return whole(vec!["lm_head.weight".into()], Transform::Copy),
        "output_norm.weight" => return whole(vec!["model.norm.weight".into()], norm),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (l, tail) = rest.split_once('.')?;
    let block: u32 = l.parse().ok()?;
    let p = if block >= hp.n_layer {
        if !next {
            return None;
        }
        format!("mtp.layers.{}", block - hp.n_layer)
    } else {
        format!("model.layers.{block}")
    };
    let one = |s: &str, t| whole(vec![format!("{p}.{s}")], t);
    let copy = Transform::Copy;
    match tail {
        "attn_norm.weight" => return one("input_layernorm.weight", norm),
        "attn_q.weight" => return one("self_attn.q_proj.weight", copy),
        "attn_k.weight" => return one("self_attn.k_proj.weight", copy),
        "attn_v.weight" => return one("self_attn.v_proj.weight", copy),
        "attn_output.weight" => return one("self_attn.o_proj.weight", copy),
        "attn_q_norm.weight" => return one("self_attn.q_norm.weight", norm),
        "attn_k_norm.weight" => return one("self_attn.k_norm.weight", norm),
        "ffn_gate_inp.weight" => return one("mlp.gate.weight", copy),
        "ffn_gate_exps.weight" | "ffn_up_exps.weight" | "ffn_down_exps.weight" => {
            let proj = &tail[4..tail.find("_exps").unwrap_or(4)];
            return whole(
                (0..hp.n_expert)
                    .map(|e| format!("{p}.mlp.experts.{e}.{proj}_proj.weight"))
                    .collect(),
                copy,
            );
        }
        _ => {}
    }
    if !next {
        return match tail {
            "ffn_norm.weight" => one("post_attention_layernorm.weight", copy),
            _ => None,
        };
    }
    let mtp = |s: &str, t| whole(vec![format!("mtp.{s}")], t);
    match tail {
        "post_attention_norm.weight" => one("post_attention_layernorm.weight", norm),
        "ffn_gate_inp_shexp.weight" => one("mlp.shared_expert_gate.weight", copy),
        "ffn_gate_shexp.weight" => one("mlp.shared_expert.gate_proj.weight", copy),
        "ffn_up_shexp.weight" => one("mlp.shared_expert.up_proj.weight", copy),
        "ffn_down_shexp.weight" => one("mlp.shared_expert.down_proj.weight", copy),
        "ssm_ba.weight" => one("linear_attn.in_proj_ba.weight", copy),
        "ssm_conv1d.weight" => one("linear_attn.conv1d.weight", copy),
        "ssm_dt.bias" => one("linear_attn.dt_bias", copy),
        "ssm_a" => one("linear_attn.A_log", Transform::NegExp),
        "ssm_norm.weight" => one("linear_attn.norm.weight", copy),
        "ssm_out.weight" => one("linear_attn.out_proj.weight", copy),
        "attn_qkv.weight" | "attn_gate.weight" => {
            let s = hp.ssm.as_ref()?;
            let (nk, dk) = (s.group_count, s.state_size);
            let r = s.time_step_rank / nk.max(1);
            let rv = r * s.head_v_dim();
            let per_group = 2 * dk + 2 * rv;
            let hf = format!("{p}.linear_attn.in_proj_qkvz.weight");
            // (offset inside a group, rows) of each part, in GGUF order.
            let parts: &[(u64, u64)] = if tail == "attn_qkv.weight" {
                &[(0, dk), (dk, dk), (2 * dk, rv)]
            } else {
                &[(2 * dk + rv, rv)]
            };
            let mut pieces = Vec::new();
            for &(off, rows) in parts {
                for g in 0..nk {
                    pieces.push(Piece {
                        hf: hf.clone(),
                        row0: g * per_group + off,
                        rows,
                        hf_rows: nk * per_group,
                    });
                }
            }
            Some(Sources {
                pieces,
                transform: copy,
            })
        }
        "nextn.eh_proj.weight" => mtp("fc.weight", copy),
        "nextn.enorm.weight" => mtp("pre_fc_norm_embedding.weight", norm),
        "nextn.hnorm.weight" => mtp("pre_fc_norm_hidden.weight", norm),
        "nextn.shared_head_norm.weight" => mtp("norm.weight", norm),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{expected_tensors, QuantRecipe};
    use crate::known::qwen3_next_80b_a3b;

    #[test]
    fn every_qwen3next_tensor_has_sources_covering_its_rows() {
        let hp = qwen3_next_80b_a3b();
        let ts = expected_tensors("qwen3next", &hp, &QuantRecipe::preset("F32").unwrap()).unwrap();
        for t in &ts {
            let s = sources("qwen3next", &hp, &t.name, &t.dims)
                .unwrap_or_else(|| panic!("no sources for {}", t.name));
            let rows: u64 = s.pieces.iter().map(|p| p.rows).sum();
            assert_eq!(rows, t.dims[1..].iter().product::<u64>(), "{}", t.name);
        }
    }

    #[test]
    fn qkvz_is_regrouped_as_llama_cpp_does() {
        // Qwen3-Next: 16 key heads of 128, 32 value heads of 128 (r = 2): a group is
        // q 128 + k 128 + v 256 + z 256 = 768 rows.
        let hp = qwen3_next_80b_a3b();
        let s = sources("qwen3next", &hp, "blk.0.attn_qkv.weight", &[2048, 8192]).unwrap();
        assert_eq!(s.pieces.len(), 48);
        let at = |i: usize| (s.pieces[i].row0, s.pieces[i].rows);
        assert_eq!(at(0), (0, 128), "q of group 0");
        assert_eq!(at(1), (768, 128), "q of group 1");
        assert_eq!(at(16), (128, 128), "k of group 0");
        assert_eq!(at(32), (256, 256), "v of group 0");
        assert_eq!(at(47), (15 * 768 + 256, 256), "v of group 15");
        assert!(s
            .pieces
            .iter()
            .all(|p| p.hf_rows == 16 * 768
                && p.hf == "model.layers.0.linear_attn.in_proj_qkvz.weight"));
        let z = sources("qwen3next", &hp, "blk.0.attn_gate.weight", &[2048, 4096]).unwrap();
        assert_eq!(z.pieces.len(), 16);
        assert_eq!((z.pieces[1].row0, z.pieces[1].rows), (768 + 512, 256));
    }

    #[test]
    fn transforms_and_mtp_names() {
        let hp = qwen3_next_80b_a3b();
        let get = |n: &str| sources("qwen3next", &hp, n, &[2048]).unwrap();
        assert_eq!(get("blk.0.attn_norm.weight").transform, Transform::PlusOne);
        assert_eq!(
            get("blk.3.attn_q_norm.weight").transform,
            Transform::PlusOne
        );
        assert_eq!(get("output_norm.weight").transform, Transform::PlusOne);
        assert_eq!(get("blk.0.ssm_norm.weight").transform, Transform::Copy);
        assert_eq!(get("blk.0.ssm_a").transform, Transform::NegExp);
        let enorm = get("blk.48.nextn.enorm.weight");
        assert_eq!(enorm.pieces[0].hf, "mtp.pre_fc_norm_embedding.weight");
        assert_eq!(enorm.transform, Transform::PlusOne);
        assert_eq!(
            get("blk.48.attn_norm.weight").pieces[0].hf,
            "mtp.layers.0.input_layernorm.weight"
        );
        // qwen3moe keeps its norms and has no MTP block.
        let moe = crate::known::qwen3_30b_a3b();
        let n = sources("qwen3moe", &moe, "blk.0.attn_norm.weight", &[2048]).unwrap();
        assert_eq!(n.transform, Transform::Copy);
        assert!(sources("qwen3moe", &moe, "blk.48.attn_norm.weight", &[2048]).is_none());
        let mut x = [0.5f32, -1.0];
        Transform::NegExp.apply(&mut x);
        assert_eq!(x, [-(0.5f32.exp()), -((-1.0f32).exp())]);
    }
}
