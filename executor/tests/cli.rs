//! The `strata-exec` binary: plan file + model folder -> JSON tokens and logits; refusals
//! exit 1 with the reason.

mod common;

use common::*;
use std::path::Path;
use std::process::Command;
use strata_exec::tokenizer::Tokenizer;

fn exe() -> Command {
    Command::new(env!("CARGO_BIN_EXE_strata-exec"))
}

#[test]
fn json_output_matches_transformers_greedy_and_refusals_exit_1() {
    let r = reference("base");
    let prompt = &prompts(&r)[1];
    let p = plan("base", &Ask::default());
    let dir = tempfile::tempdir().unwrap();
    let plan_path = dir.path().join("tiny.plan");
    strata_schemas::planfile::write_plan(&p, &plan_path).unwrap();
    let toks: Vec<String> = prompt.iter().map(|t| t.to_string()).collect();
    // The plan run on reference model `variant` with `args`.
    let run = |variant: &str, args: &[&str]| {
        exe()
            .arg(&plan_path)
            .arg("--model")
            .arg(data(variant))
            .args(args)
            .output()
            .unwrap()
    };
    let out = run(
        "base",
        &[
            "--prompt-tokens",
            &toks.join(","),
            "-n",
            "16",
            "--format",
            "json",
            "--logits",
            "-q",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["generated_token_ids"], r["greedy"][1]);
    let rows = j["prompt_logits"].as_array().unwrap();
    assert_eq!(rows.len(), prompt.len());
    assert_eq!(rows[0].as_array().unwrap().len(), 256);
    let want = r["logits"][1][prompt.len() - 1][7].as_f64().unwrap();
    let got = rows[prompt.len() - 1][7].as_f64().unwrap();
    assert!((want - got).abs() < 1e-2, "{want} vs {got}");
    assert_eq!(j["allocations"], 1 + p.host.pinned_chunks.len() as u64);

    // A text prompt without a tokenizer.
    let out = run("base", &["--prompt", "hello"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--prompt-tokens") && err.contains("no tokenizer.json in folder"),
        "{err}"
    );

    // Another model than the plan's.
    let out = run("nonorm", &["--prompt-tokens", "1,2"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("fingerprint") && err.contains(&p.model.fingerprint),
        "{err}"
    );

    // A device map for a plan the CPU backend runs.
    let out = run("base", &["--prompt-tokens", "1,2", "--device-map", "0,0"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--device-map") && err.contains("CPU backend"),
        "{err}"
    );

    // A forced miss policy for a plan the CPU backend runs (it computes every expert on the
    // CPU anyway): refused, naming the flag; `auto` runs.
    let out = run(
        "base",
        &["--prompt-tokens", "1,2", "-n", "2", "--miss-policy", "cpu"],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--miss-policy") && err.contains("CPU backend"),
        "{err}"
    );
    let out = run(
        "base",
        &["--prompt-tokens", "1,2", "-n", "2", "--miss-policy", "auto"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A forced KV host policy likewise (the CPU backend's KV is all in host memory).
    let out = run(
        "base",
        &["--prompt-tokens", "1,2", "-n", "2", "--kv-host", "stream"],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--kv-host") && err.contains("CPU backend"),
        "{err}"
    );
    // --help documents the three values of each.
    let out = exe().arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.contains("--miss-policy") && help.contains("stream") && help.contains("cpu"),
        "{help}"
    );
    assert!(help.contains("--kv-host"), "{help}");
    // --kernel-options names the any-type loader's A/B switch.
    assert!(help.contains("any-pipelined"), "{help}");
}

fn json_run(args: &[&str]) -> serde_json::Value {
    let out = exe().args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// `--prompt TEXT` through the model folder's tokenizer.json, through `--tokenizer`, and
/// through the vocabulary our converter embeds in a GGUF: the same tokens and text each way;
/// EOS stops generation unless `--ignore-eos`; a model without a tokenizer exits 1 naming
/// the folder or file and suggesting --prompt-tokens.
#[test]
fn text_prompts_through_folder_gguf_and_override_tokenizers() {
    let chat = source("base").join("../../tiny-chat");
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    // Vocabulary 400 covers tiny-chat's 397 tokens + 3 specials.
    random_folder(&model, 2, 64, 4, 2, 32, 400, 7);
    let p = plan_folder(
        &model,
        1,
        None,
        strata_schemas::serve::ExpertCache::Auto,
        None,
    );
    let plan_path = dir.path().join("m.plan");
    strata_schemas::planfile::write_plan(&p, &plan_path).unwrap();
    let plan_s = plan_path.to_str().unwrap();
    let text = "Hello world, this is a test.";

    no_tokenizer_exits_1_but_prompt_tokens_run(plan_s, &model, text);
    let (tok, want_prompt, gen) = tokenizer_path_equals_the_ids(plan_s, &chat, text);
    folder_tokenizer_json_and_text_output(plan_s, &chat, &model, text, &tok, &gen);
    gguf_vocabulary_gives_the_same_tokens(dir.path(), &model, text, &tok, &want_prompt, &gen);
    eos_stops_generation(plan_s, &model, text, &tok, &gen);
    gguf_without_vocabulary_exits_1(dir.path(), &plan_path);
}

/// No tokenizer yet: exit 1 with the folder and the way out; --prompt-tokens still runs.
fn no_tokenizer_exits_1_but_prompt_tokens_run(plan_s: &str, model: &Path, text: &str) {
    // No tokenizer yet: exit 1 with the folder and the way out.
    let out = exe()
        .args([plan_s, "--prompt", text, "-q"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no tokenizer.json in folder")
            && err.contains(model.to_str().unwrap())
            && err.contains("--prompt-tokens"),
        "{err}"
    );
    // ... and --prompt-tokens still runs, with "text": null.
    let j = json_run(&[
        plan_s,
        "--prompt-tokens",
        "5,6,7",
        "-n",
        "3",
        "--format",
        "json",
        "-q",
    ]);
    assert!(j["text"].is_null());
    assert_eq!(ids(&j["generated_token_ids"]).len(), 3);
}

/// `--tokenizer PATH`: the prompt's tokens, and the same generation as those ids given
/// directly. Returns the tokenizer, the prompt's ids and the 12 generated ids.
fn tokenizer_path_equals_the_ids(
    plan_s: &str,
    chat: &Path,
    text: &str,
) -> (Tokenizer, Vec<u32>, Vec<u32>) {
    // --tokenizer PATH.
    let tok = strata_exec::tokenizer::Tokenizer::from_file(chat).unwrap();
    let want_prompt = tok.encode(text, true).unwrap();
    assert!(want_prompt.len() > 3);
    let j = json_run(&[
        plan_s,
        "--tokenizer",
        chat.join("tokenizer.json").to_str().unwrap(),
        "--prompt",
        text,
        "-n",
        "12",
        "--ignore-eos",
        "--format",
        "json",
        "-q",
    ]);
    let gen = ids(&j["generated_token_ids"]);
    assert_eq!(gen.len(), 12);
    assert_eq!(j["prompt_tokens"], want_prompt.len());
    assert_eq!(j["text"], tok.decode(&gen, true).unwrap());
    // The same as the ids given directly.
    let id_list: Vec<String> = want_prompt.iter().map(|t| t.to_string()).collect();
    let j2 = json_run(&[
        plan_s,
        "--prompt-tokens",
        &id_list.join(","),
        "-n",
        "12",
        "--format",
        "json",
        "-q",
    ]);
    assert_eq!(ids(&j2["generated_token_ids"]), gen);

    (tok, want_prompt, gen)
}

/// The folder's own tokenizer.json (copied in from `chat`), and the text output.
fn folder_tokenizer_json_and_text_output(
    plan_s: &str,
    chat: &Path,
    model: &Path,
    text: &str,
    tok: &Tokenizer,
    gen: &[u32],
) {
    // The folder's own tokenizer.json, and the text output.
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(chat.join(f), model.join(f)).unwrap();
    }
    let j = json_run(&[
        plan_s,
        "--prompt",
        text,
        "-n",
        "12",
        "--ignore-eos",
        "--format",
        "json",
        "-q",
    ]);
    assert_eq!(ids(&j["generated_token_ids"]), gen);
    let out = exe()
        .args([plan_s, "--prompt", text, "-n", "12", "--ignore-eos", "-q"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim_end_matches('\n'),
        tok.decode(gen, true).unwrap()
    );
}

/// A GGUF converted from `model` in `dir`, with the vocabulary embedded: same tokens.
fn gguf_vocabulary_gives_the_same_tokens(
    dir: &Path,
    model: &Path,
    text: &str,
    tok: &Tokenizer,
    want_prompt: &[u32],
    gen: &[u32],
) {
    // A GGUF with the vocabulary embedded by the converter: same tokens.
    let gguf = dir.join("m.gguf");
    strata_schemas::gguf::convert::convert_hf_folder(
        model,
        &gguf,
        strata_schemas::ggml::GgmlType::F32,
        None,
    )
    .unwrap();
    let gplan = dir.join("g.plan");
    // plan_folder reads the GGUF through the planner's --model path.
    let pg = plan_folder(
        &gguf,
        1,
        None,
        strata_schemas::serve::ExpertCache::Auto,
        None,
    );
    strata_schemas::planfile::write_plan(&pg, &gplan).unwrap();
    let j = json_run(&[
        gplan.to_str().unwrap(),
        "--prompt",
        text,
        "-n",
        "12",
        "--ignore-eos",
        "--format",
        "json",
        "-q",
    ]);
    assert_eq!(j["prompt_tokens"], want_prompt.len());
    assert_eq!(
        ids(&j["generated_token_ids"]),
        gen,
        "GGUF tokenizer + weights"
    );
    assert_eq!(j["text"], tok.decode(gen, true).unwrap());
}

/// EOS: make the k-th generated token the configured EOS; generation stops right there.
fn eos_stops_generation(plan_s: &str, model: &Path, text: &str, tok: &Tokenizer, gen: &[u32]) {
    // EOS: make the k-th generated token the configured EOS; generation stops right there.
    let k = (1..gen.len())
        .find(|&k| !gen[..k].contains(&gen[k]))
        .unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(model.join("tokenizer_config.json")).unwrap())
            .unwrap();
    cfg["eos_token"] = serde_json::json!(tok.token(gen[k]).unwrap());
    std::fs::write(model.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let ends: Vec<u32> = vec![gen[k], 397, 399];
    let stop = gen.iter().position(|t| ends.contains(t)).unwrap();
    let j = json_run(&[
        plan_s, "--prompt", text, "-n", "12", "--format", "json", "-q",
    ]);
    assert_eq!(ids(&j["generated_token_ids"]), gen[..=stop].to_vec());
    assert_eq!(j["stop"], "eos");
}

/// A GGUF without a vocabulary: exit 1 naming it.
fn gguf_without_vocabulary_exits_1(dir: &Path, plan_path: &Path) {
    // A GGUF without a vocabulary.
    let bare = dir.join("bare.gguf");
    strata_schemas::gguf::convert::convert_hf_folder(
        &data("base"),
        &bare,
        strata_schemas::ggml::GgmlType::F32,
        None,
    )
    .unwrap();
    let out = exe()
        .arg(plan_path)
        .arg("--model")
        .arg(&bare)
        .args(["--prompt", "hi"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("has no tokenizer.ggml.model") && err.contains("bare.gguf"),
        "{err}"
    );
}

#[test]
fn bench_sampled_decode_names_its_draw_and_bad_settings_exit_1() {
    let p = plan("base", &Ask::default());
    let dir = tempfile::tempdir().unwrap();
    let plan_path = dir.path().join("tiny.plan");
    strata_schemas::planfile::write_plan(&p, &plan_path).unwrap();
    let bench = |extra: &[&str]| {
        exe()
            .arg("bench")
            .arg(&plan_path)
            .arg("--model")
            .arg(data("base"))
            .args(["-p", "8", "-n", "8", "-r", "1", "-q"])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = bench(&["--temperature", "0.8", "--top-k", "5", "--top-p", "0.9"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("| tg8 T0.8 top-k 5 top-p 0.9 |"),
        "no sampled tg row in:\n{text}"
    );
    // The plan's prediction and the ratio beside each measured figure.
    assert!(
        text.contains("| plan predicts t/s | measured / predicted |"),
        "{text}"
    );
    // -q prints only the table (the footnotes are tested in bench_cli.rs).
    assert!(!text.contains("predictions: guesses"), "{text}");
    let out = bench(&["--temperature", "1.5", "--format", "json"]);
    assert!(out.status.success());
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["decode_sampling"]["temperature"], 1.5);
    assert!(j["decode_tok_s"]["mean"].as_f64().unwrap() > 0.0);
    let pred = &j["predicted"];
    for k in ["prefill_tok_s", "decode_tok_s"] {
        assert!(pred[k].as_f64().unwrap() > 0.0, "{k}: {pred}");
    }
    let r = pred["decode_measured_over_predicted"].as_f64().unwrap();
    let (m, p) = (
        j["decode_tok_s"]["mean"].as_f64().unwrap(),
        pred["decode_tok_s"].as_f64().unwrap(),
    );
    assert!((r - m / p).abs() < 1e-9 * r.max(1.0), "{r} vs {m} / {p}");
    assert_eq!(pred["guessed"], true);
    for bad in [["--top-p", "1.5"], ["--temperature=-0.5", "-q"]] {
        let out = exe()
            .args(["bench", "missing.plan"])
            .args(bad)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{bad:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--temperature") && err.contains("--top-p"),
            "{bad:?}: {err}"
        );
    }
}
