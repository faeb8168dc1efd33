//! `strata-gguf` end to end: a tiny random model from flags reads back with the layout the
//! planner synthesizes, a descriptor conflict and a bad preset fail with exit 1 and a message.

use std::process::Command;
use strata_schemas::arch::{expected_tensors, QuantRecipe};
use strata_schemas::gguf::read_gguf;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_strata-gguf"))
}

#[test]
fn random_from_flags_matches_the_synthesized_layout() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("tiny.gguf");
    let o = bin()
        .args([
            "random", "--arch", "qwen3moe", "--preset", "Q8_0", "--layers", "2",
        ])
        .args([
            "--embd",
            "64",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--head-dim",
            "32",
        ])
        .args([
            "--experts",
            "4",
            "--experts-used",
            "2",
            "--ff-exp",
            "32",
            "--vocab",
            "64",
        ])
        .args(["--seed", "3", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("MB/s"), "{err}");
    let f = read_gguf(&out).unwrap();
    assert_eq!(f.get_str("general.name").unwrap(), Some("random qwen3moe"));
    let mut hp = strata_schemas::inventory::HParams {
        n_layer: 2,
        n_embd: 64,
        n_vocab: 64,
        n_head: 2,
        n_head_kv: 1,
        head_dim_k: 32,
        head_dim_v: 32,
        n_expert: 4,
        n_expert_used: 2,
        n_ff_exp: 32,
        n_ctx_train: 40_960,
        n_ff: 0,
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
    };
    let want = expected_tensors("qwen3moe", &hp, &QuantRecipe::preset("Q8_0").unwrap()).unwrap();
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
    hp.n_layer = 3;
    assert_ne!(
        expected_tensors("qwen3moe", &hp, &QuantRecipe::preset("Q8_0").unwrap())
            .unwrap()
            .len(),
        got.len()
    );
}

#[test]
fn bad_input_exits_1_with_a_message() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("x.gguf");
    let o = bin()
        .args(["random", "--arch", "qwen3moe", "--preset", "Q9", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--preset Q9") && err.contains("Q8_0"), "{err}");
    let o = bin()
        .args(["random", "--arch", "qwen3moe", "--ssm-inner", "64", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--ssm-*"));
    let o = bin()
        .args(["convert", "/nonexistent-dir", "--type", "q6_k", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--type q6_k"));
    assert!(!out.exists());
}

#[test]
fn random_qwen3next_from_flags_reads_back_as_llama_cpp_lays_it_out() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("next.gguf");
    let flags = [
        "random",
        "--arch",
        "qwen3next",
        "--preset",
        "Q8_0",
        "--layers",
        "4",
        "--embd",
        "64",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--head-dim",
        "32",
        "--experts",
        "4",
        "--experts-used",
        "2",
        "--ff-exp",
        "32",
        "--ff-shexp",
        "32",
        "--vocab",
        "64",
        "--ssm-state",
        "16",
        "--ssm-groups",
        "2",
        "--ssm-heads",
        "4",
        "--ssm-inner",
        "64",
        "--out",
    ];
    let o = bin().args(flags).arg(&out).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    // The GGUF reader checks every tensor and shape against the qwen3next layout.
    let (inv, f) = strata_schemas::gguf::model::load_gguf_model(&out).unwrap();
    let hp = &inv.hparams;
    assert_eq!((hp.n_layer, hp.nextn_predict_layers), (4, 1));
    assert_eq!(hp.full_attention_interval, Some(4));
    assert_eq!(hp.rope_dim, Some(8), "a quarter of the 32-dim head");
    assert!(f.tensor("blk.0.attn_qkv.weight").is_some());
    assert!(f.tensor("blk.3.attn_q.weight").is_some());
    assert!(f.tensor("blk.4.nextn.eh_proj.weight").is_some());
    assert_eq!(f.get_u64("qwen3next.block_count").unwrap(), Some(5));
    // A value head dim other than the key head dim is refused (llama.cpp needs them equal).
    let mut bad = flags.to_vec();
    let i = bad.iter().position(|a| *a == "--ssm-inner").unwrap();
    bad[i + 1] = "128";
    let o = bin()
        .args(&bad)
        .arg(d.path().join("bad.gguf"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("ssm.inner_size"), "{err}");
}

#[test]
fn random_presets_write_real_blocks_and_quantize_requantizes() {
    let d = tempfile::tempdir().unwrap();
    let shape = [
        "--layers",
        "2",
        "--embd",
        "256",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--head-dim",
        "128",
        "--experts",
        "2",
        "--experts-used",
        "1",
        "--ff-exp",
        "256",
        "--vocab",
        "32",
    ];
    // IQ3_S: every matrix a type without a quantizer (random blocks), the head Q6_K.
    let iq = d.path().join("iq3s.gguf");
    let o = bin()
        .args(["random", "--arch", "qwen3moe", "--preset", "IQ3_S"])
        .args(shape)
        .arg("--out")
        .arg(&iq)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let f = read_gguf(&iq).unwrap();
    let ty = |f: &strata_schemas::gguf::GgufFile, n: &str| f.tensor(n).unwrap().ggml_type;
    use strata_schemas::ggml::GgmlType;
    assert_eq!(ty(&f, "blk.0.ffn_up_exps.weight"), GgmlType::Iq3S);
    assert_eq!(ty(&f, "output.weight"), GgmlType::Q6K);
    // Requantize it to Q8_0: every matrix Q8_0, norms and router kept F32.
    let q8 = d.path().join("q8.gguf");
    let o = bin()
        .args(["quantize"])
        .arg(&iq)
        .arg(&q8)
        .args(["--type", "q8_0", "--threads", "2"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("requantized") && err.contains("MB/s"), "{err}");
    let g = read_gguf(&q8).unwrap();
    assert_eq!(ty(&g, "blk.0.ffn_up_exps.weight"), GgmlType::Q8_0);
    assert_eq!(ty(&g, "output.weight"), GgmlType::Q8_0);
    assert_eq!(ty(&g, "blk.0.ffn_gate_inp.weight"), GgmlType::F32);
    assert_eq!(ty(&g, "blk.0.attn_norm.weight"), GgmlType::F32);
    assert_eq!(g.get_u64("general.file_type").unwrap(), Some(7));
    // A type without a quantizer, and a missing target, are refused with exit 1 / 2.
    let o = bin()
        .args(["quantize"])
        .arg(&q8)
        .arg(d.path().join("x.gguf"))
        .args(["--type", "IQ2_XXS"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--type IQ2_XXS") && err.contains("Q6_K"),
        "{err}"
    );
    let o = bin()
        .args(["quantize"])
        .arg(&q8)
        .arg(d.path().join("x.gguf"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "clap usage error");
}

/// `random --vocab-from DIR`: the folder's byte-level BPE as llama.cpp's tokenizer keys,
/// padded to the vocabulary (what llama-bench needs to load the file); a folder without a
/// tokenizer.json is refused with exit 1 naming the flag.
#[test]
fn random_vocab_from_writes_the_tokenizer_keys_padded_to_the_vocabulary() {
    use strata_schemas::gguf::GgufArray;
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("tok.gguf");
    let folder = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/data/tiny-chat-moe");
    let shape = [
        "--layers",
        "1",
        "--embd",
        "64",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--head-dim",
        "32",
        "--experts",
        "4",
        "--experts-used",
        "2",
        "--ff-exp",
        "32",
        "--vocab",
        "600",
    ];
    let o = bin()
        .args(["random", "--arch", "qwen3moe", "--preset", "Q8_0"])
        .args(shape)
        .args(["--vocab-from", folder, "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let f = read_gguf(&out).unwrap();
    assert_eq!(f.get_str("tokenizer.ggml.model").unwrap(), Some("gpt2"));
    let Some(GgufArray::Strings(tokens)) = f.get_array("tokenizer.ggml.tokens").unwrap() else {
        panic!("no token list");
    };
    assert_eq!(tokens.len(), 600, "one token per embedding row");
    assert!(tokens.iter().any(|t| t == "Ċ"), "the newline byte token");
    assert_eq!(tokens[599], "[PAD599]");
    let Some(GgufArray::Strings(merges)) = f.get_array("tokenizer.ggml.merges").unwrap() else {
        panic!("no merges");
    };
    assert!(!merges.is_empty());
    let o = bin()
        .args(["random", "--arch", "qwen3moe", "--preset", "Q8_0"])
        .args(shape)
        .args(["--vocab-from"])
        .arg(d.path())
        .arg("--out")
        .arg(d.path().join("none.gguf"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--vocab-from") && err.contains("tokenizer.json"),
        "{err}"
    );
}

/// `split-mtp`: a Qwen3-Next with its MTP block splits into llama.cpp's `--no-mtp` main file
/// and its `--mtp` file (keys and tensors as the converter names them); a model without an MTP
/// block exits 1 naming the file.
#[test]
fn split_mtp_writes_the_main_and_the_mtp_only_file() {
    let d = tempfile::tempdir().unwrap();
    let whole = d.path().join("next.gguf");
    let shape = [
        "--layers",
        "4",
        "--embd",
        "64",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "16",
        "--experts",
        "4",
        "--experts-used",
        "2",
        "--ff-exp",
        "32",
        "--ff-shexp",
        "32",
        "--vocab",
        "64",
        "--ssm-state",
        "16",
        "--ssm-groups",
        "2",
        "--ssm-heads",
        "4",
        "--ssm-inner",
        "64",
    ];
    let o = bin()
        .args([
            "random",
            "--arch",
            "qwen3next",
            "--preset",
            "F32",
            "--mtp",
            "1",
        ])
        .args(shape)
        .arg("--out")
        .arg(&whole)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (main, mtp) = (d.path().join("main.gguf"), d.path().join("mtp-next.gguf"));
    let split = |input: &std::path::Path| {
        bin()
            .arg("split-mtp")
            .arg(input)
            .arg("--main-out")
            .arg(&main)
            .arg("--mtp-out")
            .arg(&mtp)
            .output()
            .unwrap()
    };
    let o = split(&whole);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let m = read_gguf(&main).unwrap();
    assert_eq!(m.get_u64("qwen3next.block_count").unwrap(), Some(4));
    assert!(m.get("qwen3next.nextn_predict_layers").is_none());
    assert!(m.tensors.iter().all(|t| !t.name.starts_with("blk.4.")));
    let x = read_gguf(&mtp).unwrap();
    assert_eq!(x.get_u64("qwen3next.block_count").unwrap(), Some(5));
    assert_eq!(
        x.get_u64("qwen3next.nextn_predict_layers").unwrap(),
        Some(1)
    );
    let names: Vec<&str> = x.tensors.iter().map(|t| t.name.as_str()).collect();
    for n in [
        "token_embd.weight",
        "output_norm.weight",
        "output.weight",
        "blk.4.nextn.eh_proj.weight",
        "blk.4.nextn.enorm.weight",
        "blk.4.nextn.hnorm.weight",
        "blk.4.nextn.shared_head_norm.weight",
        "blk.4.attn_q.weight",
        "blk.4.ffn_down_exps.weight",
    ] {
        assert!(names.contains(&n), "{n} not in {names:?}");
    }
    assert!(names
        .iter()
        .all(|n| !n.starts_with("blk.") || n.starts_with("blk.4.")));
    // The main file has no block to split off.
    let o = split(&main);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("main.gguf") && err.contains("no MTP block"),
        "{err}"
    );
}
