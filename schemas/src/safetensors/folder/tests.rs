//! Tests of Hugging Face folder reading: configs, indexes and shards, tensor mapping and
//! expert stacking, and every refusal with its exact message.

use super::super::testutil::*;
use super::*;
use crate::ggml::GgmlType;
use serde_json::json;
use std::path::PathBuf;

const HIDDEN: u64 = 64;
const VOCAB: u64 = 128;
const N_EXP: u64 = 4;
const FF: u64 = 32;

fn moe_config() -> Value {
    json!({
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": FF,
        "intermediate_size": 96, "num_experts": N_EXP, "num_experts_per_tok": 2,
        "vocab_size": VOCAB, "max_position_embeddings": 4096, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "norm_topk_prob": true, "tie_word_embeddings": false,
        "decoder_sparse_step": 1, "mlp_only_layers": []
    })
}

/// The tiny qwen3moe tensor list, HF names and shapes.
fn moe_tensors() -> Vec<(String, Vec<u64>)> {
    let mut v = vec![
        ("model.embed_tokens.weight".to_string(), vec![VOCAB, HIDDEN]),
        ("lm_head.weight".to_string(), vec![VOCAB, HIDDEN]),
        ("model.norm.weight".to_string(), vec![HIDDEN]),
    ];
    for l in 0..2 {
        let p = format!("model.layers.{l}");
        v.push((format!("{p}.input_layernorm.weight"), vec![HIDDEN]));
        v.push((format!("{p}.post_attention_layernorm.weight"), vec![HIDDEN]));
        v.push((format!("{p}.self_attn.q_proj.weight"), vec![64, HIDDEN]));
        v.push((format!("{p}.self_attn.k_proj.weight"), vec![32, HIDDEN]));
        v.push((format!("{p}.self_attn.v_proj.weight"), vec![32, HIDDEN]));
        v.push((format!("{p}.self_attn.o_proj.weight"), vec![HIDDEN, 64]));
        v.push((format!("{p}.self_attn.q_norm.weight"), vec![16]));
        v.push((format!("{p}.self_attn.k_norm.weight"), vec![16]));
        v.push((format!("{p}.mlp.gate.weight"), vec![N_EXP, HIDDEN]));
        for e in 0..N_EXP {
            v.push((
                format!("{p}.mlp.experts.{e}.gate_proj.weight"),
                vec![FF, HIDDEN],
            ));
            v.push((
                format!("{p}.mlp.experts.{e}.up_proj.weight"),
                vec![FF, HIDDEN],
            ));
            v.push((
                format!("{p}.mlp.experts.{e}.down_proj.weight"),
                vec![HIDDEN, FF],
            ));
        }
    }
    v
}

fn st(tensors: &[(String, Vec<u64>)]) -> Vec<u8> {
    let e: Vec<(&str, &str, &[u64])> = tensors
        .iter()
        .map(|(n, s)| (n.as_str(), "BF16", s.as_slice()))
        .collect();
    st_file(&e)
}

fn write_single(config: &Value, tensors: &[(String, Vec<u64>)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    std::fs::write(dir.path().join(SINGLE_NAME), st(tensors)).unwrap();
    dir
}

/// Split round-robin over `n` shards and write the matching index.
fn write_sharded(config: &Value, tensors: &[(String, Vec<u64>)], n: usize) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let mut weight_map = serde_json::Map::new();
    for s in 0..n {
        let name = format!("model-{:05}-of-{:05}.safetensors", s + 1, n);
        let part: Vec<_> = tensors.iter().skip(s).step_by(n).cloned().collect();
        for (t, _) in &part {
            weight_map.insert(t.clone(), json!(name));
        }
        std::fs::write(dir.path().join(&name), st(&part)).unwrap();
    }
    let index = json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(dir.path().join(INDEX_NAME), index.to_string()).unwrap();
    dir
}

fn shard_path(dir: &tempfile::TempDir, s: usize, n: usize) -> PathBuf {
    dir.path()
        .join(format!("model-{:05}-of-{:05}.safetensors", s + 1, n))
}

#[test]
fn single_file_qwen3moe() {
    let dir = write_single(&moe_config(), &moe_tensors());
    let inv = load_folder(dir.path()).unwrap();
    assert_eq!(inv.arch, "qwen3moe");
    assert_eq!(inv.tensors.len(), 3 + 2 * 12);
    let hp = &inv.hparams;
    assert_eq!((hp.n_layer, hp.n_embd, hp.n_vocab), (2, HIDDEN, VOCAB));
    assert_eq!((hp.n_head, hp.n_head_kv, hp.head_dim_k), (4, 2, 16));
    assert_eq!((hp.n_expert, hp.n_expert_used, hp.n_ff_exp), (N_EXP, 2, FF));
    assert_eq!((hp.n_ff, hp.n_ff_shexp, hp.nextn_predict_layers), (0, 0, 0));
    assert_eq!(hp.full_attention_interval, None);
    assert!(hp.norm_topk_prob && !hp.tied_embeddings);

    let g = inv.tensor("blk.0.ffn_gate_exps.weight").unwrap();
    assert_eq!(g.dims, vec![HIDDEN, FF, N_EXP]);
    assert_eq!(g.role, TensorRole::ExpertStack);
    assert_eq!(g.layer, Some(0));
    assert_eq!(g.ggml_type, GgmlType::BF16);
    assert_eq!(g.bytes, HIDDEN * FF * N_EXP * 2);
    assert_eq!(g.file_offset, None);
    let d = inv.tensor("blk.1.ffn_down_exps.weight").unwrap();
    assert_eq!(d.dims, vec![FF, HIDDEN, N_EXP]);
    assert_eq!(inv.expert_bytes(1), 3 * HIDDEN * FF * 2);

    let e = inv.tensor("token_embd.weight").unwrap();
    assert_eq!((e.role, e.layer), (TensorRole::Embedding, None));
    assert_eq!(e.dims, vec![HIDDEN, VOCAB]);
    assert_eq!(e.file_offset, Some(0));
    assert_eq!(inv.tensor("output.weight").unwrap().role, TensorRole::Head);
    assert_eq!(
        inv.tensor("output_norm.weight").unwrap().role,
        TensorRole::OutputNorm
    );
    let k = inv.tensor("blk.1.attn_k.weight").unwrap();
    assert_eq!(
        (k.dims.clone(), k.role, k.layer),
        (vec![HIDDEN, 32], TensorRole::Dense, Some(1))
    );
    assert!(inv.tensor("blk.0.ffn_norm.weight").is_some());
    assert!(inv.tensor("blk.0.attn_output.weight").is_some());
    assert!(inv.tensor("blk.0.ffn_gate_inp.weight").is_some());
    // Order: embedding first, then blocks, then output norm, head.
    assert_eq!(inv.tensors[0].name, "token_embd.weight");
    assert_eq!(inv.tensors.last().unwrap().name, "output.weight");
    // Every byte of the files is counted.
    let hf_bytes: u64 = moe_tensors()
        .iter()
        .map(|(_, s)| s.iter().product::<u64>() * 2)
        .sum();
    assert_eq!(inv.total_bytes(), hf_bytes);
}

#[test]
fn sharded_equals_single() {
    let single = load_folder(write_single(&moe_config(), &moe_tensors()).path()).unwrap();
    let dir = write_sharded(&moe_config(), &moe_tensors(), 3);
    let sharded = load_folder(dir.path()).unwrap();
    assert_eq!(single.fingerprint(), sharded.fingerprint());
    let strip = |i: &ModelInventory| -> Vec<(String, Vec<u64>, TensorRole, Option<u32>)> {
        i.tensors
            .iter()
            .map(|t| (t.name.clone(), t.dims.clone(), t.role, t.layer))
            .collect()
    };
    assert_eq!(strip(&single), strip(&sharded));
}

#[test]
fn missing_shard() {
    let dir = write_sharded(&moe_config(), &moe_tensors(), 2);
    std::fs::remove_file(shard_path(&dir, 1, 2)).unwrap();
    let e = load_folder(dir.path()).unwrap_err();
    assert!(
        matches!(&e, SafetensorsError::MissingShard { shard, .. } if shard == "model-00002-of-00002.safetensors"),
        "{e}"
    );
}

#[test]
fn index_names_tensor_absent_from_its_shard() {
    let dir = write_sharded(&moe_config(), &moe_tensors(), 2);
    // Rewrite shard 1 without its first tensor.
    let part: Vec<_> = moe_tensors().into_iter().step_by(2).skip(1).collect();
    std::fs::write(shard_path(&dir, 0, 2), st(&part)).unwrap();
    let e = load_folder(dir.path()).unwrap_err();
    assert!(
        matches!(&e, SafetensorsError::TensorNotInShard { tensor, .. } if tensor == "model.embed_tokens.weight"),
        "{e}"
    );
    // And a shard holding a tensor the index puts elsewhere.
    let dir = write_sharded(&moe_config(), &moe_tensors(), 2);
    let mut part: Vec<_> = moe_tensors().into_iter().step_by(2).collect();
    part.push(moe_tensors()[1].clone());
    std::fs::write(shard_path(&dir, 0, 2), st(&part)).unwrap();
    let e = load_folder(dir.path()).unwrap_err();
    assert!(
        matches!(e, SafetensorsError::TensorNotInIndex { .. }),
        "{e}"
    );
}

#[test]
fn index_hostile_shard_names_and_duplicates() {
    let dir = write_sharded(&moe_config(), &moe_tensors(), 1);
    let idx = r#"{"weight_map": {"model.norm.weight": "../evil.safetensors"}}"#;
    std::fs::write(dir.path().join(INDEX_NAME), idx).unwrap();
    let e = load_folder(dir.path()).unwrap_err();
    assert!(matches!(e, SafetensorsError::BadIndex { .. }), "{e}");
    let idx = r#"{"weight_map": {"a": "x.safetensors", "a": "x.safetensors"}}"#;
    std::fs::write(dir.path().join(INDEX_NAME), idx).unwrap();
    let e = load_folder(dir.path()).unwrap_err();
    assert!(e.to_string().contains("more than once"), "{e}");
    std::fs::write(dir.path().join(INDEX_NAME), r#"{"metadata": {}}"#).unwrap();
    let e = load_folder(dir.path()).unwrap_err();
    assert!(e.to_string().contains("weight_map"), "{e}");
}

#[test]
fn missing_expert() {
    let t: Vec<_> = moe_tensors()
        .into_iter()
        .filter(|(n, _)| n != "model.layers.1.mlp.experts.2.up_proj.weight")
        .collect();
    let e = load_folder(write_single(&moe_config(), &t).path()).unwrap_err();
    match e {
        SafetensorsError::MissingExpert {
            layer,
            proj,
            expert,
            n_expert,
            ..
        } => {
            assert_eq!(
                (layer, proj.as_str(), expert, n_expert),
                (1, "up_proj", 2, N_EXP)
            )
        }
        e => panic!("{e}"),
    }
    // An expert index past num_experts.
    let mut t = moe_tensors();
    t.push((
        "model.layers.0.mlp.experts.4.up_proj.weight".into(),
        vec![FF, HIDDEN],
    ));
    let e = load_folder(write_single(&moe_config(), &t).path()).unwrap_err();
    assert!(e.to_string().contains("num_experts is 4"), "{e}");
}

#[test]
fn expert_shape_mismatch() {
    let t: Vec<_> = moe_tensors()
        .into_iter()
        .map(|(n, s)| {
            if n == "model.layers.0.mlp.experts.3.gate_proj.weight" {
                (n, vec![FF + 1, HIDDEN])
            } else {
                (n, s)
            }
        })
        .collect();
    let e = load_folder(write_single(&moe_config(), &t).path()).unwrap_err();
    assert!(
        matches!(&e, SafetensorsError::ExpertMismatch { tensor, .. } if tensor.contains("experts.3.gate_proj")),
        "{e}"
    );
}

#[test]
fn unsupported_arch_and_dtype_and_unknown_tensor() {
    let mut c = moe_config();
    c["architectures"] = json!(["LlamaForCausalLM"]);
    let e = load_folder(write_single(&c, &moe_tensors()).path()).unwrap_err();
    assert!(matches!(e, SafetensorsError::UnsupportedArch { .. }), "{e}");
    assert!(e.to_string().contains("Qwen3NextForCausalLM"), "{e}");

    let dir = write_single(&moe_config(), &moe_tensors());
    let bytes = st_file(&[("model.norm.weight", "F8_E4M3", &[HIDDEN])]);
    std::fs::write(dir.path().join(SINGLE_NAME), bytes).unwrap();
    let e = load_folder(dir.path()).unwrap_err();
    assert!(
        matches!(&e, SafetensorsError::UnsupportedDtype { tensor, .. } if tensor == "model.norm.weight"),
        "{e}"
    );

    let mut t = moe_tensors();
    t.push(("model.layers.0.mystery.weight".into(), vec![4]));
    let e = load_folder(write_single(&moe_config(), &t).path()).unwrap_err();
    assert!(matches!(e, SafetensorsError::UnknownTensor { .. }), "{e}");
    let mut t = moe_tensors();
    t.push(("model.layers.2.input_layernorm.weight".into(), vec![HIDDEN]));
    let e = load_folder(write_single(&moe_config(), &t).path()).unwrap_err();
    assert!(e.to_string().contains("num_hidden_layers is 2"), "{e}");
}

#[test]
fn bad_config_values_are_named() {
    for (key, val, want) in [
        ("hidden_size", json!(-1), "hidden_size"),
        ("num_experts", json!("many"), "num_experts"),
        ("num_experts_per_tok", json!(9), "num_experts_per_tok"),
        ("num_hidden_layers", json!(0), "num_hidden_layers"),
        ("mlp_only_layers", json!([1]), "mlp_only_layers"),
        ("num_key_value_heads", json!(3), "num_key_value_heads"),
    ] {
        let mut c = moe_config();
        c[key] = val;
        let e = load_folder(write_single(&c, &moe_tensors()).path()).unwrap_err();
        assert!(
            matches!(e, SafetensorsError::BadConfig { .. }),
            "{key}: {e}"
        );
        assert!(e.to_string().contains(want), "{e}");
    }
    let dir = write_single(&moe_config(), &moe_tensors());
    std::fs::write(dir.path().join("config.json"), "[]").unwrap();
    assert!(load_folder(dir.path()).is_err());
    std::fs::remove_file(dir.path().join(SINGLE_NAME)).unwrap();
    std::fs::write(dir.path().join("config.json"), moe_config().to_string()).unwrap();
    assert!(matches!(
        load_folder(dir.path()),
        Err(SafetensorsError::NoModelFiles { .. })
    ));
}

#[test]
fn hostile_shard_header_is_reported_with_its_file() {
    let dir = write_sharded(&moe_config(), &moe_tensors(), 2);
    let p = shard_path(&dir, 1, 2);
    let mut b = std::fs::read(&p).unwrap();
    b.truncate(b.len() - 1);
    std::fs::write(&p, b).unwrap();
    let e = load_folder(dir.path()).unwrap_err();
    assert!(matches!(e, SafetensorsError::OffsetsPastEnd { .. }), "{e}");
    assert!(e.to_string().contains("model-00002-of-00002"), "{e}");
}

// ---- qwen3next

fn next_config() -> Value {
    json!({
        "architectures": ["Qwen3NextForCausalLM"],
        "hidden_size": HIDDEN, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": FF,
        "shared_expert_intermediate_size": FF, "num_experts": N_EXP, "num_experts_per_tok": 2,
        "vocab_size": VOCAB, "max_position_embeddings": 4096, "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25, "full_attention_interval": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_value_head_dim": 8, "num_nextn_predict_layers": 1
    })
}

fn next_block(p: &str, full: bool, v: &mut Vec<(String, Vec<u64>)>) {
    v.push((format!("{p}.input_layernorm.weight"), vec![HIDDEN]));
    v.push((format!("{p}.post_attention_layernorm.weight"), vec![HIDDEN]));
    if full {
        v.push((format!("{p}.self_attn.q_proj.weight"), vec![128, HIDDEN]));
        v.push((format!("{p}.self_attn.k_proj.weight"), vec![32, HIDDEN]));
        v.push((format!("{p}.self_attn.v_proj.weight"), vec![32, HIDDEN]));
        v.push((format!("{p}.self_attn.o_proj.weight"), vec![HIDDEN, 64]));
        v.push((format!("{p}.self_attn.q_norm.weight"), vec![16]));
        v.push((format!("{p}.self_attn.k_norm.weight"), vec![16]));
    } else {
        // nk=2, dk=8, nv=4, dv=8: qkvz rows 2*2*8 + 2*4*8 = 96, ba rows 2*4 = 8
        v.push((
            format!("{p}.linear_attn.in_proj_qkvz.weight"),
            vec![96, HIDDEN],
        ));
        v.push((
            format!("{p}.linear_attn.in_proj_ba.weight"),
            vec![8, HIDDEN],
        ));
        v.push((format!("{p}.linear_attn.conv1d.weight"), vec![64, 1, 4]));
        v.push((format!("{p}.linear_attn.A_log"), vec![4]));
        v.push((format!("{p}.linear_attn.dt_bias"), vec![4]));
        v.push((format!("{p}.linear_attn.norm.weight"), vec![8]));
        v.push((format!("{p}.linear_attn.out_proj.weight"), vec![HIDDEN, 32]));
    }
    v.push((format!("{p}.mlp.gate.weight"), vec![N_EXP, HIDDEN]));
    v.push((
        format!("{p}.mlp.shared_expert_gate.weight"),
        vec![1, HIDDEN],
    ));
    v.push((
        format!("{p}.mlp.shared_expert.gate_proj.weight"),
        vec![FF, HIDDEN],
    ));
    v.push((
        format!("{p}.mlp.shared_expert.up_proj.weight"),
        vec![FF, HIDDEN],
    ));
    v.push((
        format!("{p}.mlp.shared_expert.down_proj.weight"),
        vec![HIDDEN, FF],
    ));
    for e in 0..N_EXP {
        v.push((
            format!("{p}.mlp.experts.{e}.gate_proj.weight"),
            vec![FF, HIDDEN],
        ));
        v.push((
            format!("{p}.mlp.experts.{e}.up_proj.weight"),
            vec![FF, HIDDEN],
        ));
        v.push((
            format!("{p}.mlp.experts.{e}.down_proj.weight"),
            vec![HIDDEN, FF],
        ));
    }
}

fn next_tensors() -> Vec<(String, Vec<u64>)> {
    let mut v = vec![
        ("model.embed_tokens.weight".to_string(), vec![VOCAB, HIDDEN]),
        ("lm_head.weight".to_string(), vec![VOCAB, HIDDEN]),
        ("model.norm.weight".to_string(), vec![HIDDEN]),
        ("mtp.fc.weight".to_string(), vec![HIDDEN, 2 * HIDDEN]),
        ("mtp.pre_fc_norm_embedding.weight".to_string(), vec![HIDDEN]),
        ("mtp.pre_fc_norm_hidden.weight".to_string(), vec![HIDDEN]),
        ("mtp.norm.weight".to_string(), vec![HIDDEN]),
    ];
    for l in 0..4 {
        next_block(&format!("model.layers.{l}"), l == 3, &mut v);
    }
    next_block("mtp.layers.0", true, &mut v);
    v
}

#[test]
fn qwen3next_mapping() {
    let dir = write_sharded(&next_config(), &next_tensors(), 2);
    let inv = load_folder(dir.path()).unwrap();
    assert_eq!(inv.arch, "qwen3next");
    let hp = &inv.hparams;
    assert_eq!(hp.full_attention_interval, Some(4));
    assert_eq!(hp.nextn_predict_layers, 1);
    assert_eq!(hp.n_ff_shexp, FF);
    assert_eq!(hp.rope_dim, Some(4));
    assert_eq!(hp.rope_theta, 1e7);
    let s = hp.ssm.as_ref().unwrap();
    assert_eq!(
        (
            s.conv_kernel,
            s.state_size,
            s.group_count,
            s.time_step_rank,
            s.inner_size
        ),
        (4, 8, 2, 4, 32)
    );
    assert_eq!(s.conv_channels(), 64);

    let dims = |n: &str| inv.tensor(n).unwrap_or_else(|| panic!("{n}")).dims.clone();
    assert_eq!(dims("blk.0.attn_qkv.weight"), vec![HIDDEN, 64]);
    assert_eq!(dims("blk.0.attn_gate.weight"), vec![HIDDEN, 32]);
    assert_eq!(dims("blk.0.ssm_ba.weight"), vec![HIDDEN, 8]);
    assert_eq!(dims("blk.0.ssm_conv1d.weight"), vec![4, 64]);
    assert_eq!(dims("blk.0.ssm_a"), vec![4]);
    assert_eq!(dims("blk.0.ssm_dt.bias"), vec![4]);
    assert_eq!(dims("blk.0.ssm_norm.weight"), vec![8]);
    assert_eq!(dims("blk.0.ssm_out.weight"), vec![32, HIDDEN]);
    assert_eq!(dims("blk.2.post_attention_norm.weight"), vec![HIDDEN]);
    assert_eq!(dims("blk.3.attn_q.weight"), vec![HIDDEN, 128]);
    // HF [1, H] is read as [H, 1] and given llama.cpp's canonical [H] (trailing 1s
    // dropped, as for a GGUF that stores it either way).
    assert_eq!(dims("blk.1.ffn_gate_inp_shexp.weight"), vec![HIDDEN]);
    assert_eq!(dims("blk.1.ffn_down_shexp.weight"), vec![FF, HIDDEN]);
    assert_eq!(dims("blk.1.ffn_up_exps.weight"), vec![HIDDEN, FF, N_EXP]);
    // The MTP block is block n_layer: ordinary tensors there, nextn extras as MtpExtra.
    let q = inv.tensor("blk.4.attn_q.weight").unwrap();
    assert_eq!((q.role, q.layer), (TensorRole::Dense, Some(4)));
    let x = inv.tensor("blk.4.ffn_gate_exps.weight").unwrap();
    assert_eq!((x.role, x.layer), (TensorRole::ExpertStack, Some(4)));
    let eh = inv.tensor("blk.4.nextn.eh_proj.weight").unwrap();
    assert_eq!(
        (eh.role, eh.layer, eh.dims.clone()),
        (TensorRole::MtpExtra, Some(4), vec![2 * HIDDEN, HIDDEN])
    );
    for n in ["enorm", "hnorm", "shared_head_norm"] {
        assert_eq!(
            inv.tensor(&format!("blk.4.nextn.{n}.weight")).unwrap().role,
            TensorRole::MtpExtra
        );
    }
    let hf_bytes: u64 = next_tensors()
        .iter()
        .map(|(_, s)| s.iter().product::<u64>() * 2)
        .sum();
    assert_eq!(inv.total_bytes(), hf_bytes);
}

#[test]
fn qwen3next_without_mtp_weights_has_no_mtp_block() {
    let t: Vec<_> = next_tensors()
        .into_iter()
        .filter(|(n, _)| !n.starts_with("mtp."))
        .collect();
    let inv = load_folder(write_single(&next_config(), &t).path()).unwrap();
    assert_eq!(inv.hparams.nextn_predict_layers, 0);
    assert!(inv.tensors.iter().all(|t| t.layer.is_none_or(|l| l < 4)));
}

#[test]
fn qwen3next_bad_layer_pattern_and_qkvz() {
    let mut c = next_config();
    c["layer_types"] = json!([
        "linear_attention",
        "full_attention",
        "linear_attention",
        "full_attention"
    ]);
    let e = load_folder(write_single(&c, &next_tensors()).path()).unwrap_err();
    assert!(e.to_string().contains("full_attention_interval"), "{e}");
    let t: Vec<_> = next_tensors()
        .into_iter()
        .map(|(n, s)| {
            if n.ends_with("0.linear_attn.in_proj_qkvz.weight") {
                (n, vec![95, HIDDEN])
            } else {
                (n, s)
            }
        })
        .collect();
    let e = load_folder(write_single(&next_config(), &t).path()).unwrap_err();
    assert!(matches!(e, SafetensorsError::BadShape { .. }), "{e}");
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 48, .. Default::default() })]
    /// Byte flips and truncations of config.json or the weights file never panic.
    #[test]
    fn mutated_folder_never_panics(
        flips in proptest::collection::vec((0usize..1 << 20, proptest::prelude::any::<u8>()), 1..6),
        cut in 0usize..1 << 20,
        which in 0u8..3,
    ) {
        let dir = write_single(&next_config(), &next_tensors());
        let name = if which == 0 { "config.json" } else { SINGLE_NAME };
        let p = dir.path().join(name);
        let mut b = std::fs::read(&p).unwrap();
        // Aim at the JSON: config.json whole, the weights' length and header.
        let span = if which == 0 { b.len() } else { b.len().min(8 + 4096) };
        for (i, v) in flips {
            let i = i % span;
            b[i] = v;
        }
        if which == 2 {
            b.truncate(cut % (b.len() + 1));
        }
        std::fs::write(&p, &b).unwrap();
        let _ = load_folder(dir.path());
    }
}

#[test]
fn qwen3next_config_fewer_mtp_blocks_than_weights() {
    let mut c = next_config();
    c["num_nextn_predict_layers"] = json!(0);
    let e = load_folder(write_single(&c, &next_tensors()).path()).unwrap_err();
    assert!(
        matches!(&e, SafetensorsError::BadConfig { key, .. } if key == "num_nextn_predict_layers"),
        "{e}"
    );
}

#[test]
fn classify_rules() {
    use TensorRole::*;
    assert_eq!(classify_local("token_embd.weight"), Some((Embedding, None)));
    assert_eq!(classify_local("output.weight"), Some((Head, None)));
    assert_eq!(
        classify_local("output_norm.weight"),
        Some((OutputNorm, None))
    );
    assert_eq!(
        classify_local("blk.7.ffn_up_exps.weight"),
        Some((ExpertStack, Some(7)))
    );
    assert_eq!(
        classify_local("blk.48.nextn.eh_proj.weight"),
        Some((MtpExtra, Some(48)))
    );
    assert_eq!(
        classify_local("blk.3.ffn_up_shexp.weight"),
        Some((Dense, Some(3)))
    );
    assert_eq!(classify_local("blk.x.attn_q.weight"), None);
    assert_eq!(classify_local("rope_freqs.weight"), None);
}
