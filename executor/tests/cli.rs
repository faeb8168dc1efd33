//! The `strata-exec` binary: plan file + model folder -> JSON tokens and logits; refusals
//! exit 1 with the reason.

mod common;

use common::*;
use std::process::Command;

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
    let out = exe()
        .arg(&plan_path)
        .arg("--model")
        .arg(data("base"))
        .args([
            "--prompt-tokens",
            &toks.join(","),
            "-n",
            "16",
            "--format",
            "json",
            "--logits",
            "-q",
        ])
        .output()
        .unwrap();
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
    let out = exe()
        .arg(&plan_path)
        .arg("--model")
        .arg(data("base"))
        .args(["--prompt", "hello"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--prompt-tokens"));

    // Another model than the plan's.
    let out = exe()
        .arg(&plan_path)
        .arg("--model")
        .arg(data("nonorm"))
        .args(["--prompt-tokens", "1,2"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("fingerprint") && err.contains(&p.model.fingerprint),
        "{err}"
    );
}
