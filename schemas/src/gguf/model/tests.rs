//! Tests of GGUF header -> inventory: hyperparameters per architecture and the tensor checks.

use super::testfile::*;
use super::*;
use crate::arch::{expected_tensors, QuantRecipe};
use crate::ggml::GgmlType;
use crate::gguf::parse_gguf_bytes;

fn small_moe() -> HParams {
    HParams {
        n_layer: 2,
        n_embd: 64,
        n_vocab: 128,
        n_ctx_train: 4096,
        n_head: 4,
        n_head_kv: 2,
        head_dim_k: 16,
        head_dim_v: 16,
        n_ff: 0,
        n_expert: 4,
        n_expert_used: 2,
        n_ff_exp: 32,
        n_ff_shexp: 0,
        n_leading_dense: 0,
        full_attention_interval: None,
        ssm: None,
        nextn_predict_layers: 0,
        rope_theta: 1e6,
        rope_dim: None,
        rms_eps: 1e-6,
        norm_topk_prob: true,
        tied_embeddings: false,
    }
}

fn small_next() -> HParams {
    HParams {
        n_layer: 4,
        n_head: 4,
        n_head_kv: 2,
        head_dim_k: 32,
        head_dim_v: 32,
        n_ff_shexp: 32,
        full_attention_interval: Some(4),
        ssm: Some(SsmParams {
            conv_kernel: 4,
            state_size: 16,
            group_count: 2,
            time_step_rank: 4,
            inner_size: 64,
        }),
        nextn_predict_layers: 1,
        rope_theta: 1e7,
        rope_dim: Some(8),
        ..small_moe()
    }
}

/// llama.cpp metadata for `hp` (what the converter writes), with the real-file extras a
/// descriptor does not have (`feed_forward_length`, a full-head `rope.dimension_count`).
fn meta(arch: &str, hp: &HParams) -> Vec<(String, V)> {
    let mut p: Vec<(&str, V)> = vec![
        ("general.name", s("tiny")),
        ("block_count", V::U32(hp.n_blocks_total())),
        ("context_length", V::U64(hp.n_ctx_train)),
        ("embedding_length", V::U32(hp.n_embd as u32)),
        ("feed_forward_length", V::U32(96)),
        ("attention.head_count", V::U32(hp.n_head as u32)),
        ("attention.head_count_kv", V::U32(hp.n_head_kv as u32)),
        ("attention.key_length", V::U32(hp.head_dim_k as u32)),
        ("attention.value_length", V::U32(hp.head_dim_v as u32)),
        ("rope.freq_base", V::F32(hp.rope_theta as f32)),
        (
            "rope.dimension_count",
            V::U32(hp.rope_dim.unwrap_or(hp.head_dim_k) as u32),
        ),
        (
            "attention.layer_norm_rms_epsilon",
            V::F32(hp.rms_eps as f32),
        ),
        ("expert_count", V::U32(hp.n_expert as u32)),
        ("expert_used_count", V::U32(hp.n_expert_used as u32)),
        ("expert_feed_forward_length", V::U32(hp.n_ff_exp as u32)),
    ];
    if hp.n_ff_shexp > 0 {
        p.push((
            "expert_shared_feed_forward_length",
            V::U32(hp.n_ff_shexp as u32),
        ));
    }
    if hp.nextn_predict_layers > 0 {
        p.push(("nextn_predict_layers", V::U32(hp.nextn_predict_layers)));
    }
    if let Some(s) = &hp.ssm {
        p.push(("ssm.conv_kernel", V::U32(s.conv_kernel as u32)));
        p.push(("ssm.state_size", V::U32(s.state_size as u32)));
        p.push(("ssm.group_count", V::U32(s.group_count as u32)));
        p.push(("ssm.time_step_rank", V::U32(s.time_step_rank as u32)));
        p.push(("ssm.inner_size", V::U32(s.inner_size as u32)));
    }
    if let Some(k) = hp.full_attention_interval {
        p.push(("full_attention_interval", V::U32(k)));
    }
    kv(arch, &p)
}

fn parse(kv: &[(String, V)], ts: &[(String, Vec<u64>, GgmlType)]) -> GgufFile {
    parse_gguf_bytes(&gguf_bytes(kv, ts), "test.gguf").expect("valid test GGUF")
}

fn descriptor_inv(arch: &str, hp: &HParams) -> ModelInventory {
    let tensors = expected_tensors(arch, hp, &QuantRecipe::preset("Q8_0").unwrap()).unwrap();
    ModelInventory {
        arch: arch.into(),
        name: "tiny".into(),
        hparams: hp.clone(),
        tensors,
        vision: None,
    }
}

#[test]
fn real_file_maps_to_the_descriptor_inventory() {
    for (arch, hp) in [("qwen3moe", small_moe()), ("qwen3next", small_next())] {
        let want = descriptor_inv(arch, &hp);
        // File order differs from canonical order: reversed.
        let mut table = table(&want.tensors);
        table.reverse();
        let g = parse(&meta(arch, &hp), &table);
        let got = inventory_from_gguf(&g).unwrap();
        assert_eq!(got.hparams, hp, "{arch}");
        assert_eq!(got.tensors.len(), want.tensors.len());
        for (a, b) in got.tensors.iter().zip(&want.tensors) {
            assert_eq!(
                (&a.name, &a.dims, a.ggml_type, a.role, a.layer, a.bytes),
                (&b.name, &b.dims, b.ggml_type, b.role, b.layer, b.bytes)
            );
            // The offset is the tensor's own, relative to the data section.
            assert_eq!(a.file_offset, Some(g.tensor(&a.name).unwrap().offset));
        }
        assert_eq!(got.fingerprint(), want.fingerprint(), "{arch}");
        assert_eq!(got.name, "tiny");
    }
    // The MTP block is index n_layer: block_count 5 = 4 + 1.
    let g = parse(
        &meta("qwen3next", &small_next()),
        &table(&descriptor_inv("qwen3next", &small_next()).tensors),
    );
    let inv = inventory_from_gguf(&g).unwrap();
    assert_eq!(inv.hparams.n_layer, 4);
    assert_eq!(
        inv.tensor("blk.4.nextn.eh_proj.weight").unwrap().role,
        TensorRole::MtpExtra
    );
    assert_eq!(
        inv.tensor("blk.4.ffn_up_exps.weight").unwrap().layer,
        Some(4)
    );
    let loc = tensor_location(&g, "blk.4.nextn.eh_proj.weight").unwrap();
    assert_eq!(loc.part, 0);
    assert_eq!(
        loc.offset,
        g.data_offset + g.tensor("blk.4.nextn.eh_proj.weight").unwrap().offset
    );
}

#[test]
fn split_files_map_with_per_part_offsets() {
    let hp = small_moe();
    let want = descriptor_inv("qwen3moe", &hp);
    let all = table(&want.tensors);
    let (a, b) = all.split_at(all.len() / 2);
    let split = |no: u16| {
        vec![
            ("split.no".to_string(), V::U16(no)),
            ("split.count".to_string(), V::U16(2)),
        ]
    };
    let mut kv1 = meta("qwen3moe", &hp);
    kv1.extend(split(0));
    let dir = tempfile::tempdir().unwrap();
    let first = dir.path().join("m-00001-of-00002.gguf");
    std::fs::write(&first, gguf_bytes(&kv1, a)).unwrap();
    std::fs::write(
        dir.path().join("m-00002-of-00002.gguf"),
        gguf_bytes(&split(1), b),
    )
    .unwrap();
    let (inv, g) = load_gguf_model(&first).unwrap();
    assert_eq!(g.parts.len(), 2);
    assert_eq!(inv.fingerprint(), want.fingerprint());
    // The first tensor of part 2 starts its data section: offset 0 there.
    let name = &b[0].0;
    assert_eq!(inv.tensor(name).unwrap().file_offset, Some(0));
    let loc = tensor_location(&g, name).unwrap();
    assert_eq!(loc.part, 1);
    assert!(loc.path.ends_with("m-00002-of-00002.gguf"));
    assert_eq!(loc.offset, g.parts[1].data_offset);
}

#[test]
fn tied_embeddings_and_recurrent_layer_array() {
    let mut hp = small_next();
    hp.tied_embeddings = true;
    let want = descriptor_inv("qwen3next", &hp);
    let mut kv = meta("qwen3next", &hp);
    kv.retain(|(k, _)| k != "qwen3next.full_attention_interval");
    // 4 main blocks + MTP: linear, linear, linear, full, (MTP) full.
    kv.push((
        "qwen3next.attention.recurrent_layers".into(),
        V::BoolArr(vec![true, true, true, false, false]),
    ));
    let got = inventory_from_gguf(&parse(&kv, &table(&want.tensors))).unwrap();
    assert!(got.hparams.tied_embeddings);
    assert_eq!(got.hparams.full_attention_interval, Some(4));
    assert_eq!(got.fingerprint(), want.fingerprint());
    // Non-periodic patterns are refused, naming the key.
    let n = kv.len() - 1;
    kv[n].1 = V::BoolArr(vec![true, false, true, true, false]);
    let e = inventory_from_gguf(&parse(&kv, &table(&want.tensors))).unwrap_err();
    assert!(e.to_string().contains("attention.recurrent_layers"), "{e}");
}

#[test]
fn layout_errors_name_the_tensor() {
    let hp = small_moe();
    let good = table(&descriptor_inv("qwen3moe", &hp).tensors);
    let kv = meta("qwen3moe", &hp);

    let mut missing = good.clone();
    missing.retain(|t| t.0 != "blk.1.attn_k.weight");
    let e = inventory_from_gguf(&parse(&kv, &missing)).unwrap_err();
    assert_eq!(e.tensor(), Some("blk.1.attn_k.weight"), "{e}");
    assert!(e.to_string().contains("missing"), "{e}");

    let mut extra = good.clone();
    extra.push(("blk.0.bogus.weight".into(), vec![64], GgmlType::F32));
    let e = inventory_from_gguf(&parse(&kv, &extra)).unwrap_err();
    assert_eq!(e.tensor(), Some("blk.0.bogus.weight"), "{e}");

    let mut wrong = good.clone();
    let i = wrong
        .iter()
        .position(|t| t.0 == "blk.0.ffn_up_exps.weight")
        .unwrap();
    wrong[i].1 = vec![64, 64, 4];
    let e = inventory_from_gguf(&parse(&kv, &wrong)).unwrap_err();
    assert_eq!(e.tensor(), Some("blk.0.ffn_up_exps.weight"), "{e}");
    assert!(e.to_string().contains("[64, 32, 4]"), "{e}");

    // A missing required key names the full key.
    let mut kv2 = kv.clone();
    kv2.retain(|(k, _)| k != "qwen3moe.expert_count");
    let e = inventory_from_gguf(&parse(&kv2, &good)).unwrap_err();
    assert!(e.to_string().contains("`qwen3moe.expert_count`"), "{e}");
    // A bad hyperparameter from validate_hparams names it too.
    let mut kv3 = kv.clone();
    for (k, v) in kv3.iter_mut() {
        if k == "qwen3moe.expert_used_count" {
            *v = V::U32(9);
        }
    }
    let e = inventory_from_gguf(&parse(&kv3, &good)).unwrap_err();
    assert!(e.to_string().contains("n_expert_used"), "{e}");
}

#[test]
fn unsupported_arch_lists_the_supported_ones() {
    let g = parse_gguf_bytes(&super::super::testutil::valid(3), "llama.gguf").unwrap();
    let e = inventory_from_gguf(&g).unwrap_err();
    assert!(matches!(&e, GgufModelError::UnsupportedArch { arch, .. } if arch == "llama"));
    let msg = e.to_string();
    for a in PLANNABLE {
        assert!(msg.contains(a), "{msg}");
    }
    assert!(msg.contains("llama.gguf"), "{msg}");
}

fn t(name: String, dims: Vec<u64>, ty: GgmlType) -> (String, Vec<u64>, GgmlType) {
    (name, dims, ty)
}

/// A deepseek2-Lite-like file: 1 leading dense block, MLA, 2 shared experts.
fn deepseek2_file(n_exp_in_file: u64) -> (Vec<(String, V)>, Vec<TestTensor>) {
    let (e, v, ne, ff, fe) = (64u64, 128u64, 8u64, 96u64, 32u64);
    let kv = kv(
        "deepseek2",
        &[
            ("block_count", V::U32(3)),
            ("context_length", V::U32(8192)),
            ("embedding_length", V::U32(e as u32)),
            ("feed_forward_length", V::U32(ff as u32)),
            ("attention.head_count", V::U32(4)),
            ("attention.head_count_kv", V::U32(4)),
            ("attention.key_length", V::U32(24)),
            ("attention.value_length", V::U32(16)),
            ("attention.kv_lora_rank", V::U32(32)),
            ("rope.dimension_count", V::U32(8)),
            ("rope.freq_base", V::F32(10000.0)),
            ("attention.layer_norm_rms_epsilon", V::F32(1e-6)),
            ("leading_dense_block_count", V::U32(1)),
            ("expert_count", V::U32(ne as u32)),
            ("expert_used_count", V::U32(2)),
            ("expert_shared_count", V::U32(2)),
            ("expert_feed_forward_length", V::U32(fe as u32)),
        ],
    );
    let f = GgmlType::F32;
    let mut ts = vec![t("token_embd.weight".into(), vec![e, v], f)];
    for l in 0..3u32 {
        let b = |r: &str| format!("blk.{l}.{r}");
        ts.push(t(b("attn_norm.weight"), vec![e], f));
        ts.push(t(b("attn_q.weight"), vec![e, 4 * 24], f));
        ts.push(t(b("attn_kv_a_mqa.weight"), vec![e, 32 + 8], f));
        ts.push(t(b("attn_kv_a_norm.weight"), vec![32], f));
        ts.push(t(b("attn_kv_b.weight"), vec![32, 4 * (16 + 16)], f));
        ts.push(t(b("attn_output.weight"), vec![4 * 16, e], f));
        ts.push(t(b("ffn_norm.weight"), vec![e], f));
        if l == 0 {
            ts.push(t(b("ffn_gate.weight"), vec![e, ff], f));
            ts.push(t(b("ffn_up.weight"), vec![e, ff], f));
            ts.push(t(b("ffn_down.weight"), vec![ff, e], f));
        } else {
            ts.push(t(b("ffn_gate_inp.weight"), vec![e, ne], f));
            ts.push(t(b("ffn_gate_exps.weight"), vec![e, fe, ne], f));
            ts.push(t(b("ffn_up_exps.weight"), vec![e, fe, n_exp_in_file], f));
            ts.push(t(b("ffn_down_exps.weight"), vec![fe, e, ne], f));
            ts.push(t(b("ffn_gate_shexp.weight"), vec![e, 2 * fe], f));
            ts.push(t(b("ffn_up_shexp.weight"), vec![e, 2 * fe], f));
            ts.push(t(b("ffn_down_shexp.weight"), vec![2 * fe, e], f));
        }
    }
    ts.push(t("output_norm.weight".into(), vec![e], f));
    ts.push(t("output.weight".into(), vec![e, v], f));
    (kv, ts)
}

#[test]
fn deepseek2_maps_mla_and_leading_dense_blocks() {
    let (kv, ts) = deepseek2_file(8);
    let inv = inventory_from_gguf(&parse(&kv, &ts)).unwrap();
    let hp = &inv.hparams;
    assert_eq!((hp.n_layer, hp.n_leading_dense, hp.n_ff), (3, 1, 96));
    assert_eq!((hp.n_head_kv, hp.head_dim_k, hp.head_dim_v), (1, 40, 0));
    assert_eq!(hp.rope_dim, Some(8));
    assert_eq!(hp.n_ff_shexp, 64);
    assert!(!hp.norm_topk_prob);
    assert!(!hp.layer_has_experts(0) && hp.layer_has_experts(1));
    // KV per cell per layer at f16: (40 + 0) x 2 B.
    assert_eq!(hp.kv_bytes_per_cell_layer(GgmlType::F16), 80);
    assert_eq!(inv.expert_bytes(0), 0);
    assert_eq!(inv.expert_bytes(1), 3 * 64 * 32 * 4);
    assert_eq!(
        inv.tensors.iter().map(|t| t.bytes).sum::<u64>(),
        inv.total_bytes()
    );

    // An expert stack with the wrong expert count names the tensor.
    let (kv, ts) = deepseek2_file(6);
    let e = inventory_from_gguf(&parse(&kv, &ts)).unwrap_err();
    assert_eq!(e.tensor(), Some("blk.1.ffn_up_exps.weight"), "{e}");
    assert!(e.to_string().contains("expert_count 8"), "{e}");
}

#[test]
fn gpt_oss_and_qwen2moe_plan_sizes() {
    let f = GgmlType::F32;
    let (e, v, ne, fe) = (64u64, 128u64, 4u64, 64u64);
    // gpt-oss: MXFP4 experts with biases, attention sinks, no shared expert.
    let kv_oss = kv(
        "gpt-oss",
        &[
            ("block_count", V::U32(2)),
            ("context_length", V::U32(131072)),
            ("embedding_length", V::U32(e as u32)),
            ("feed_forward_length", V::U32(fe as u32)),
            ("attention.head_count", V::U32(8)),
            ("attention.head_count_kv", V::U32(2)),
            ("attention.key_length", V::U32(16)),
            ("attention.value_length", V::U32(16)),
            ("attention.sliding_window", V::U32(128)),
            ("rope.freq_base", V::F32(150000.0)),
            ("attention.layer_norm_rms_epsilon", V::F32(1e-5)),
            ("expert_count", V::U32(ne as u32)),
            ("expert_used_count", V::U32(2)),
            ("expert_feed_forward_length", V::U32(fe as u32)),
        ],
    );
    let mut ts = vec![t("token_embd.weight".into(), vec![e, v], f)];
    for l in 0..2u32 {
        let b = |r: &str| format!("blk.{l}.{r}");
        ts.push(t(b("attn_norm.weight"), vec![e], f));
        ts.push(t(b("attn_q.weight"), vec![e, 128], f));
        ts.push(t(b("attn_q.bias"), vec![128], f));
        ts.push(t(b("attn_k.weight"), vec![e, 32], f));
        ts.push(t(b("attn_v.weight"), vec![e, 32], f));
        ts.push(t(b("attn_output.weight"), vec![128, e], f));
        ts.push(t(b("attn_sinks.weight"), vec![8], f));
        ts.push(t(b("post_attention_norm.weight"), vec![e], f));
        ts.push(t(b("ffn_gate_inp.weight"), vec![e, ne], f));
        ts.push(t(b("ffn_gate_inp.bias"), vec![ne], f));
        ts.push(t(
            b("ffn_gate_exps.weight"),
            vec![e, fe, ne],
            GgmlType::MXFP4,
        ));
        ts.push(t(b("ffn_gate_exps.bias"), vec![fe, ne], f));
        ts.push(t(b("ffn_up_exps.weight"), vec![e, fe, ne], GgmlType::MXFP4));
        ts.push(t(
            b("ffn_down_exps.weight"),
            vec![fe, e, ne],
            GgmlType::MXFP4,
        ));
        ts.push(t(b("ffn_down_exps.bias"), vec![e, ne], f));
    }
    ts.push(t("output_norm.weight".into(), vec![e], f));
    ts.push(t("output.weight".into(), vec![e, v], f));
    let inv = inventory_from_gguf(&parse(&kv_oss, &ts)).unwrap();
    assert_eq!(inv.arch, "gpt-oss");
    let hp = &inv.hparams;
    assert_eq!(
        (hp.n_layer, hp.n_ff, hp.n_ff_exp, hp.n_ff_shexp),
        (2, 0, 64, 0)
    );
    assert_eq!((hp.n_head, hp.n_head_kv, hp.head_dim_k), (8, 2, 16));
    assert_eq!(hp.rope_theta, 150000.0);
    assert_eq!(hp.rms_eps, 1e-5);
    assert!(hp.full_attention_interval.is_none());
    // One expert: 3 MXFP4 slices (64x64 at 17 B per 32) + the bias slices (64 + 64) x 4 B.
    assert_eq!(inv.expert_bytes(0), 3 * 64 * 64 / 32 * 17 + (64 + 64) * 4);
    assert_eq!(
        inv.tensor("blk.1.ffn_down_exps.bias").unwrap().role,
        TensorRole::ExpertStack
    );

    // qwen2moe: shared expert width from the tensor when the key is absent.
    let kv_q2 = kv(
        "qwen2moe",
        &[
            ("block_count", V::U32(1)),
            ("context_length", V::U32(8192)),
            ("embedding_length", V::U32(e as u32)),
            ("attention.head_count", V::U32(4)),
            ("attention.layer_norm_rms_epsilon", V::F32(1e-6)),
            ("expert_count", V::U32(ne as u32)),
            ("expert_used_count", V::U32(2)),
            ("expert_feed_forward_length", V::U32(32)),
        ],
    );
    let b = |r: &str| format!("blk.0.{r}");
    let ts = vec![
        t("token_embd.weight".into(), vec![e, v], f),
        t(b("attn_q.weight"), vec![e, e], f),
        t(b("attn_q.bias"), vec![e], f),
        t(b("ffn_gate_inp.weight"), vec![e, ne], f),
        t(b("ffn_gate_exps.weight"), vec![e, 32, ne], f),
        t(b("ffn_up_exps.weight"), vec![e, 32, ne], f),
        t(b("ffn_down_exps.weight"), vec![32, e, ne], f),
        t(b("ffn_gate_inp_shexp.weight"), vec![e], f),
        t(b("ffn_up_shexp.weight"), vec![e, 160], f),
        t("output_norm.weight".into(), vec![e], f),
    ];
    let inv = inventory_from_gguf(&parse(&kv_q2, &ts)).unwrap();
    let hp = &inv.hparams;
    assert_eq!((hp.n_ff_shexp, hp.head_dim_k, hp.n_head_kv), (160, 16, 4));
    assert!(hp.tied_embeddings);
    assert!(!hp.norm_topk_prob);
    assert_eq!(inv.tensors.last().unwrap().name, "output_norm.weight");

    // A tensor past block_count is named.
    let mut ts2 = ts.clone();
    ts2.push(t("blk.7.attn_norm.weight".into(), vec![e], f));
    let e2 = inventory_from_gguf(&parse(&kv_q2, &ts2)).unwrap_err();
    assert_eq!(e2.tensor(), Some("blk.7.attn_norm.weight"), "{e2}");
}
