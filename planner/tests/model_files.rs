//! `strata-plan` on real model files: GGUF files written here byte by byte (llama.cpp layout and
//! metadata keys) are planned end to end, checked against their architecture (missing, extra
//! and misshaped tensors exit 1 naming the tensor), described by `model-info` (also for
//! architectures Strata cannot plan), and an mmproj file sizes the vision tower.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use strata_schemas::arch::{expected_tensors, QuantRecipe};
use strata_schemas::ggml::GgmlType;
use strata_schemas::inventory::HParams;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn plan_cmd(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata-plan"))
        .current_dir(root())
        .args(args)
        .output()
        .expect("strata-plan runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn json_of(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}):\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&o.stdout),
            stderr(o)
        )
    })
}

/// A metadata value.
#[derive(Clone)]
enum V {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(&'static str),
}

type Tensor = (String, Vec<u64>, GgmlType);

/// Minimal GGUF v3 writer: metadata, tensor records with 32-byte aligned offsets, zero data.
fn gguf(kv: &[(String, V)], tensors: &[Tensor]) -> Vec<u8> {
    fn s(b: &mut Vec<u8>, x: &str) {
        b.extend((x.len() as u64).to_le_bytes());
        b.extend(x.as_bytes());
    }
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((kv.len() as u64).to_le_bytes());
    for (k, v) in kv {
        s(&mut b, k);
        match v {
            V::U32(x) => {
                b.extend(4u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            V::F32(x) => {
                b.extend(6u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            V::Bool(x) => {
                b.extend(7u32.to_le_bytes());
                b.push(u8::from(*x));
            }
            V::Str(x) => {
                b.extend(8u32.to_le_bytes());
                s(&mut b, x);
            }
        }
    }
    let mut off = 0u64;
    for (name, dims, ty) in tensors {
        s(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.id().to_le_bytes());
        b.extend(off.to_le_bytes());
        off += ty.tensor_bytes(dims).unwrap().div_ceil(32) * 32;
    }
    while !b.len().is_multiple_of(32) {
        b.push(0);
    }
    b.resize(b.len() + off as usize, 0);
    b
}

fn hp() -> HParams {
    HParams {
        n_layer: 4,
        n_embd: 256,
        n_vocab: 1024,
        n_ctx_train: 32768,
        n_head: 8,
        n_head_kv: 2,
        head_dim_k: 32,
        head_dim_v: 32,
        n_ff: 0,
        n_expert: 8,
        n_expert_used: 2,
        n_ff_exp: 256,
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

/// llama.cpp metadata for a qwen3moe with `hp`.
fn qwen3moe_kv(hp: &HParams) -> Vec<(String, V)> {
    let a = |k: &str| format!("qwen3moe.{k}");
    vec![
        ("general.architecture".into(), V::Str("qwen3moe")),
        ("general.name".into(), V::Str("Tiny-MoE")),
        (a("block_count"), V::U32(hp.n_layer)),
        (a("context_length"), V::U32(hp.n_ctx_train as u32)),
        (a("embedding_length"), V::U32(hp.n_embd as u32)),
        (a("feed_forward_length"), V::U32(768)),
        (a("attention.head_count"), V::U32(hp.n_head as u32)),
        (a("attention.head_count_kv"), V::U32(hp.n_head_kv as u32)),
        (a("attention.key_length"), V::U32(hp.head_dim_k as u32)),
        (a("attention.value_length"), V::U32(hp.head_dim_v as u32)),
        (a("rope.freq_base"), V::F32(hp.rope_theta as f32)),
        (
            a("attention.layer_norm_rms_epsilon"),
            V::F32(hp.rms_eps as f32),
        ),
        (a("expert_count"), V::U32(hp.n_expert as u32)),
        (a("expert_used_count"), V::U32(hp.n_expert_used as u32)),
        (a("expert_feed_forward_length"), V::U32(hp.n_ff_exp as u32)),
        (a("expert_weights_norm"), V::Bool(true)),
    ]
}

fn qwen3moe_tensors(hp: &HParams) -> Vec<Tensor> {
    expected_tensors("qwen3moe", hp, &QuantRecipe::preset("Q8_0").unwrap())
        .unwrap()
        .into_iter()
        .map(|t| (t.name, t.dims, t.ggml_type))
        .collect()
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> String {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p.display().to_string()
}

const DESCRIPTOR: &str = r#"
name = "Tiny-MoE"
arch = "qwen3moe"

[hparams]
n_layer = 4
n_embd = 256
n_vocab = 1024
n_ctx_train = 32768
n_head = 8
n_head_kv = 2
head_dim_k = 32
head_dim_v = 32
n_expert = 8
n_expert_used = 2
n_ff_exp = 256
rope_theta = 1000000.0
rms_eps = 1e-6

[quant]
preset = "Q8_0"
"#;

fn plan_json(model: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "--hardware",
        "plans/hardware/rtx3060.toml",
        "--model",
        model,
        "--max-context",
        "4096",
        "--format",
        "json",
    ];
    args.extend_from_slice(extra);
    plan_cmd(&args)
}

#[test]
fn gguf_plans_like_its_descriptor() {
    let dir = tempfile::tempdir().unwrap();
    let hp = hp();
    let g = write(
        dir.path(),
        "tiny.gguf",
        &gguf(&qwen3moe_kv(&hp), &qwen3moe_tensors(&hp)),
    );
    let d = write(dir.path(), "tiny.toml", DESCRIPTOR.as_bytes());
    let plan_out = dir.path().join("tiny.plan");
    let po = plan_out.display().to_string();
    let from_gguf = plan_json(&g, &["-o", &po]);
    assert_eq!(from_gguf.status.code(), Some(0), "{}", stderr(&from_gguf));
    assert!(plan_out.exists());
    let from_desc = plan_json(&d, &[]);
    assert_eq!(from_desc.status.code(), Some(0), "{}", stderr(&from_desc));
    let (a, b) = (json_of(&from_gguf), json_of(&from_desc));
    assert_eq!(a["feasible"], true);
    // Same inventory, same hyperparameters: every region of every device is the same.
    assert_eq!(a["devices"], b["devices"]);
    let dense = a["devices"][0]["regions"]["dense_weights"]
        .as_u64()
        .unwrap();
    assert!(dense > 0, "{a}");

    // A split-free GGUF with a capitalized extension is a GGUF too.
    let upper = write(dir.path(), "TINY.GGUF", &std::fs::read(&g).unwrap());
    assert_eq!(plan_json(&upper, &[]).status.code(), Some(0));
}

#[test]
fn mismatched_tensors_exit_1_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let hp = hp();
    let kv = qwen3moe_kv(&hp);
    let good = qwen3moe_tensors(&hp);

    let mut missing = good.clone();
    missing.retain(|t| t.0 != "blk.2.ffn_gate_inp.weight");
    let mut extra = good.clone();
    extra.push((
        "blk.1.ffn_gate_shexp.weight".into(),
        vec![256, 64],
        GgmlType::Q8_0,
    ));
    let mut wrong = good.clone();
    for t in wrong.iter_mut() {
        if t.0 == "blk.3.attn_k.weight" {
            t.1 = vec![256, 128];
        }
    }
    for (name, tensors, tensor, what) in [
        (
            "missing.gguf",
            missing,
            "blk.2.ffn_gate_inp.weight",
            "missing",
        ),
        (
            "extra.gguf",
            extra,
            "blk.1.ffn_gate_shexp.weight",
            "not part of",
        ),
        ("wrong.gguf", wrong, "blk.3.attn_k.weight", "[256, 64]"),
    ] {
        let p = write(dir.path(), name, &gguf(&kv, &tensors));
        let o = plan_json(&p, &[]);
        assert_eq!(o.status.code(), Some(1), "{name}: {}", stderr(&o));
        let e = stderr(&o);
        assert!(
            e.contains(tensor) && e.contains(what) && e.contains(name),
            "{name}: {e}"
        );
        assert!(o.stdout.is_empty());
    }
}

fn llama_file() -> Vec<u8> {
    let kv = vec![
        ("general.architecture".to_string(), V::Str("llama")),
        ("llama.block_count".to_string(), V::U32(1)),
        ("llama.embedding_length".to_string(), V::U32(64)),
    ];
    let ts: Vec<Tensor> = vec![
        ("token_embd.weight".into(), vec![64, 100], GgmlType::F16),
        ("blk.0.attn_q.weight".into(), vec![64, 64], GgmlType::Q8_0),
        ("blk.0.ffn_up.weight".into(), vec![64, 128], GgmlType::Q8_0),
        ("output_norm.weight".into(), vec![64], GgmlType::F32),
    ];
    gguf(&kv, &ts)
}

#[test]
fn unsupported_arch_lists_supported_and_model_info_still_works() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "llama.gguf", &llama_file());
    let o = plan_json(&p, &[]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    for a in [
        "llama",
        "qwen3moe",
        "qwen3next",
        "qwen2moe",
        "gpt-oss",
        "deepseek2",
    ] {
        assert!(e.contains(a), "{e}");
    }

    let o = plan_cmd(&["model-info", &p, "--format", "json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let j = json_of(&o);
    assert_eq!(j["arch"], "llama");
    assert_eq!(j["plannable"], false);
    assert_eq!(j["tensors"], 4);
    assert_eq!(j["params"], 64 * 100 + 64 * 64 + 64 * 128 + 64);
    assert_eq!(j["bytes"]["embedding"], 64 * 100 * 2);
    assert_eq!(j["bytes"]["head"], 64 * 4);
    assert_eq!(j["bytes"]["dense"], (64 * 64 + 64 * 128) / 32 * 34);
    assert_eq!(j["bytes"]["experts"], 0);
    assert_eq!(j["hparams"]["block_count"], 1);
    assert_eq!(j["hparams"]["vocab_size"], 100);
    let mix: Vec<&str> = j["quant_mix"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["type"].as_str().unwrap())
        .collect();
    // Q8_0 12,288 params (13,056 B) > F16 6,400 params (12,800 B) > F32.
    assert_eq!(mix, ["Q8_0", "F16", "F32"]);

    let o = plan_cmd(&["model-info", &p]);
    assert_eq!(o.status.code(), Some(0));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("llama (not plannable)") && text.contains("quant mix"),
        "{text}"
    );
}

#[test]
fn model_info_on_a_plannable_gguf_and_a_descriptor() {
    let dir = tempfile::tempdir().unwrap();
    let hp = hp();
    let g = write(
        dir.path(),
        "tiny.gguf",
        &gguf(&qwen3moe_kv(&hp), &qwen3moe_tensors(&hp)),
    );
    let d = write(dir.path(), "tiny.toml", DESCRIPTOR.as_bytes());
    let a = json_of(&plan_cmd(&["model-info", &g, "--format", "json"]));
    let b = json_of(&plan_cmd(&["model-info", &d, "--format", "json"]));
    assert_eq!(a["arch"], "qwen3moe");
    assert_eq!(a["plannable"], true);
    assert_eq!(a["planning_note"], Value::Null);
    assert_eq!(a["name"], "Tiny-MoE");
    for k in ["params", "total_bytes", "bytes", "quant_mix", "tensors"] {
        assert_eq!(a[k], b[k], "{k}");
    }
    let experts = a["bytes"]["experts"].as_u64().unwrap();
    assert_eq!(experts, 4 * 3 * (256 * 256 * 8 / 32 * 34));
    assert_eq!(a["hparams"]["expert_count"], 8);
}

#[test]
fn bad_paths_and_files_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let junk = write(dir.path(), "junk.gguf", b"not a gguf at all, just text");
    for args in [
        vec!["model-info", junk.as_str()],
        vec![
            "--hardware",
            "plans/hardware/rtx3060.toml",
            "--model",
            junk.as_str(),
        ],
    ] {
        let o = plan_cmd(&args);
        assert_eq!(o.status.code(), Some(1));
        assert!(stderr(&o).contains("junk.gguf"), "{}", stderr(&o));
    }
    let other = write(dir.path(), "model.bin", b"x");
    let o = plan_cmd(&[
        "--hardware",
        "plans/hardware/rtx3060.toml",
        "--model",
        &other,
    ]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains("model.bin")
            && e.contains(".gguf")
            && e.contains("safetensors")
            && e.contains(".toml"),
        "{e}"
    );
    let o = plan_cmd(&["model-info", "/nonexistent/model.gguf"]);
    assert_eq!(o.status.code(), Some(1));
}

fn mmproj() -> Vec<u8> {
    let kv = vec![
        ("general.architecture".to_string(), V::Str("clip")),
        ("clip.has_vision_encoder".to_string(), V::Bool(true)),
        ("clip.vision.embedding_length".to_string(), V::U32(128)),
        ("clip.vision.block_count".to_string(), V::U32(2)),
        ("clip.vision.attention.head_count".to_string(), V::U32(4)),
        ("clip.vision.feed_forward_length".to_string(), V::U32(512)),
        ("clip.vision.image_size".to_string(), V::U32(224)),
        ("clip.vision.patch_size".to_string(), V::U32(16)),
    ];
    let ts: Vec<Tensor> = vec![
        (
            "v.patch_embd.weight".into(),
            vec![16, 16, 3, 128],
            GgmlType::F16,
        ),
        (
            "v.blk.0.attn_qkv.weight".into(),
            vec![128, 384],
            GgmlType::F16,
        ),
        ("mm.0.weight".into(), vec![128, 256], GgmlType::F16),
    ];
    gguf(&kv, &ts)
}

#[test]
fn vision_mmproj_sizes_the_vision_region() {
    let dir = tempfile::tempdir().unwrap();
    let hp = hp();
    let g = write(
        dir.path(),
        "tiny.gguf",
        &gguf(&qwen3moe_kv(&hp), &qwen3moe_tensors(&hp)),
    );
    let mm = write(dir.path(), "mmproj-tiny.gguf", &mmproj());
    let o = plan_json(&g, &["--vision", &mm]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let j = json_of(&o);
    let weights = (16 * 16 * 3 * 128 + 128 * 384 + 128 * 256) * 2;
    let vision = j["devices"][0]["regions"]["vision"].as_u64().unwrap();
    // Weights plus the workspace of one 14 x 14 = 196-token image.
    assert!(vision >= weights, "{vision} < {weights}");

    // The model file is not an mmproj file: exit 1 saying so.
    let o = plan_json(&g, &["--vision", &g]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("not an mmproj file"), "{}", stderr(&o));
}

/// A qwen2moe file (planning sizes only): tensors per llama.cpp's LLM_ARCH_QWEN2MOE layout.
fn qwen2moe_file() -> Vec<u8> {
    let a = |k: &str| format!("qwen2moe.{k}");
    let kv = vec![
        ("general.architecture".to_string(), V::Str("qwen2moe")),
        (a("block_count"), V::U32(2)),
        (a("context_length"), V::U32(8192)),
        (a("embedding_length"), V::U32(256)),
        (a("attention.head_count"), V::U32(8)),
        (a("attention.head_count_kv"), V::U32(8)),
        (a("rope.freq_base"), V::F32(1e6)),
        (a("attention.layer_norm_rms_epsilon"), V::F32(1e-6)),
        (a("expert_count"), V::U32(8)),
        (a("expert_used_count"), V::U32(2)),
        (a("expert_feed_forward_length"), V::U32(256)),
        (a("expert_shared_feed_forward_length"), V::U32(512)),
    ];
    let (e, v, q8, f32t) = (256u64, 1024u64, GgmlType::Q8_0, GgmlType::F32);
    let mut ts: Vec<Tensor> = vec![("token_embd.weight".into(), vec![e, v], q8)];
    for l in 0..2 {
        let b = |r: &str| format!("blk.{l}.{r}");
        ts.extend([
            (b("attn_norm.weight"), vec![e], f32t),
            (b("attn_q.weight"), vec![e, e], q8),
            (b("attn_q.bias"), vec![e], f32t),
            (b("attn_k.weight"), vec![e, e], q8),
            (b("attn_k.bias"), vec![e], f32t),
            (b("attn_v.weight"), vec![e, e], q8),
            (b("attn_v.bias"), vec![e], f32t),
            (b("attn_output.weight"), vec![e, e], q8),
            (b("ffn_norm.weight"), vec![e], f32t),
            (b("ffn_gate_inp.weight"), vec![e, 8], f32t),
            (b("ffn_gate_exps.weight"), vec![e, 256, 8], q8),
            (b("ffn_up_exps.weight"), vec![e, 256, 8], q8),
            (b("ffn_down_exps.weight"), vec![256, e, 8], q8),
            (b("ffn_gate_inp_shexp.weight"), vec![e], f32t),
            (b("ffn_gate_shexp.weight"), vec![e, 512], q8),
            (b("ffn_up_shexp.weight"), vec![e, 512], q8),
            (b("ffn_down_shexp.weight"), vec![512, e], q8),
        ]);
    }
    ts.push(("output_norm.weight".into(), vec![e], f32t));
    ts.push(("output.weight".into(), vec![e, v], q8));
    gguf(&kv, &ts)
}

#[test]
fn planning_only_arch_plans_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "q2.gguf", &qwen2moe_file());
    let o = plan_json(&p, &[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let j = json_of(&o);
    assert_eq!(j["feasible"], true);
    let r = &j["devices"][0]["regions"];
    assert!(r["dense_weights"].as_u64().unwrap() > 0, "{r}");
    assert!(r["kv_cache"].as_u64().unwrap() > 0, "{r}");
    let info = json_of(&plan_cmd(&["model-info", &p, "--format", "json"]));
    assert_eq!(info["plannable"], true);
    assert!(info["planning_note"]
        .as_str()
        .unwrap()
        .contains("planning sizes only"));
    assert_eq!(info["bytes"]["experts"], 2 * 3 * (256 * 256 * 8 / 32 * 34));
}
