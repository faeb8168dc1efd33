//! `strata-exec PLAN` on a plan made for AMD GPUs (`vendor = "amd"`), end to end through the
//! real binary: the plan is picked up by the GPU engine (not refused as a CPU plan), passes
//! every check that needs no GPU, and stops at the runtime with an error that names what is
//! missing — `libamdhip64` on a `--features hip` build without ROCm, the `hip` feature on a
//! build without it. On a machine with ROCm and an RDNA GPU the same command runs the plan;
//! then this test checks the greedy tokens against the CPU engine's instead.
//! Invariant: the test never passes without having seen the binary's own output.

mod common;

use common::*;
use std::process::Command;

#[test]
fn an_amd_plan_reaches_the_hip_runtime() {
    let p = amd_plan("base", 1, None);
    assert!(p.devices.iter().all(|d| d.vendor == "amd"));
    let r = reference("base");
    let prompt = &prompts(&r)[1];
    let dir = tempfile::tempdir().unwrap();
    let plan_path = dir.path().join("amd.plan");
    strata_schemas::planfile::write_plan(&p, &plan_path).unwrap();
    let toks: Vec<String> = prompt.iter().map(|t| t.to_string()).collect();
    let n = r["greedy"][1].as_array().unwrap().len().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_strata-exec"))
        .arg(&plan_path)
        .arg("--model")
        .arg(data("base"))
        .args(["--prompt-tokens", &toks.join(","), "-n", &n, "-q"])
        .args(["--format", "json"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        // ROCm and an AMD GPU are here: the tokens must be the CPU engine's.
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        eprintln!("ran on an AMD GPU: {v}");
        assert_eq!(
            v["generated_token_ids"], r["greedy"][1],
            "greedy tokens on the AMD GPU against transformers'"
        );
        return;
    }
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        !stderr.contains("vendor `amd`") && !stderr.contains("not built into"),
        "an AMD plan must reach the GPU engine, not the CPU backend's refusal: {stderr}"
    );
    if cfg!(feature = "hip") {
        assert!(
            stderr.contains("libamdhip64")
                || stderr.contains("libhiprtc")
                || stderr.contains("HIP device 0 does not exist")
                || stderr.contains("wave64"),
            "{stderr}"
        );
    } else {
        assert!(stderr.contains("--features hip"), "{stderr}");
    }
    eprintln!("the binary stopped where expected: {stderr}");
}

#[test]
fn an_amd_plan_on_the_cpu_backend_is_refused_naming_the_vendor() {
    let p = amd_plan("base", 1, None);
    let dir = tempfile::tempdir().unwrap();
    let plan_path = dir.path().join("amd.plan");
    strata_schemas::planfile::write_plan(&p, &plan_path).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_strata-exec"))
        .arg(&plan_path)
        .arg("--model")
        .arg(data("base"))
        .args([
            "--prompt-tokens",
            "1,2,3",
            "-n",
            "2",
            "-q",
            "--backend",
            "cpu",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("amd"), "{stderr}");
}
