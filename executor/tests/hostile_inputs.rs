//! Hostile inputs to the `strata-exec` binary (issue 23): endless or special files where a
//! plan, a model or a tokenizer is expected. Each exits 1 quickly naming the file.
#![cfg(unix)]
#[path = "serve_common/mod.rs"]
mod serve_common;

use serve_common::exec::{write_plan, REAL_MODEL};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Run strata-exec with `args`; fail if it is still running after 30 s.
fn exec(args: &[&str]) -> (i32, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata-exec"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
            return (st.code().unwrap_or(-1), err);
        }
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("strata-exec {args:?} still running after 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A copy of the tiny chat model whose file `name` is replaced by a link to /dev/zero.
fn model_with_endless(dir: &Path, name: &str) -> String {
    let out = dir.join(format!("model-{name}"));
    std::fs::create_dir_all(&out).unwrap();
    for f in std::fs::read_dir(REAL_MODEL).unwrap() {
        let f = f.unwrap().path();
        let n = f.file_name().unwrap().to_str().unwrap().to_string();
        if n == name {
            std::os::unix::fs::symlink("/dev/zero", out.join(&n)).unwrap();
        } else if f.is_file() {
            std::fs::copy(&f, out.join(&n)).unwrap();
        }
    }
    out.display().to_string()
}

#[test]
fn endless_plan_model_and_tokenizer_files_exit_1_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), Path::new(REAL_MODEL), 1, 64, 8);
    let plan = plan.display().to_string();
    let link = dir.path().join("zero.plan");
    std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
    let link = link.display().to_string();
    let tok_cfg = model_with_endless(dir.path(), "tokenizer_config.json");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["/dev/zero", "--prompt-tokens", "1"], "/dev/zero"),
        (vec![&link, "--prompt-tokens", "1"], &link),
        (
            vec![
                &plan,
                "--tokenizer",
                "/dev/zero",
                "--prompt",
                "hi",
                "-n",
                "1",
            ],
            "/dev/zero",
        ),
        (
            vec![&plan, "--tokenizer", &tok_cfg, "--prompt", "hi", "-n", "1"],
            "tokenizer_config.json",
        ),
    ];
    for (args, file) in cases {
        let (code, err) = exec(&args);
        assert_ne!(code, 0, "{args:?}: {err}");
        assert!(
            err.contains(file) && err.contains("character device"),
            "{args:?}: {err}"
        );
    }
}

/// A copy of the tiny chat model whose final norm weights are NaN.
fn model_with_nan_norm(dir: &Path) -> std::path::PathBuf {
    let out = dir.join("nan-model");
    std::fs::create_dir_all(&out).unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(Path::new(REAL_MODEL).join(f), out.join(f)).unwrap();
    }
    let mut bytes = std::fs::read(Path::new(REAL_MODEL).join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let t = &header["model.norm.weight"];
    assert_eq!(t["dtype"], "F32");
    let begin = 8 + n + t["data_offsets"][0].as_u64().unwrap() as usize;
    let end = 8 + n + t["data_offsets"][1].as_u64().unwrap() as usize;
    for v in bytes[begin..end].chunks_exact_mut(4) {
        v.copy_from_slice(&f32::NAN.to_le_bytes());
    }
    std::fs::write(out.join("model.safetensors"), bytes).unwrap();
    out
}

#[test]
fn nan_weights_are_refused_at_load_and_nan_logits_end_the_request() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_with_nan_norm(dir.path());
    let plan = write_plan(dir.path(), &model, 1, 64, 8);
    let plan = plan.display().to_string();
    let (code, err) = exec(&[&plan, "--prompt-tokens", "1,2,3", "-n", "4", "-q"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("NaN or infinite weights")
            && err.contains("output_norm.weight")
            && err.contains("--allow-non-finite-weights"),
        "{err}"
    );
    // Allowed: a warning, then the first token ends the run with an error instead of
    // printing token 0 forever.
    let (code, err) = exec(&[
        &plan,
        "--prompt-tokens",
        "1,2,3",
        "-n",
        "4",
        "-q",
        "--allow-non-finite-weights",
    ]);
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains("warning") && err.contains("NaN or infinite logits"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_served_request_with_nan_logits_ends_with_an_error() {
    use serve_common::Server;
    let dir = tempfile::tempdir().unwrap();
    let model = model_with_nan_norm(dir.path());
    let plan = write_plan(dir.path(), &model, 1, 64, 8);
    let s = serve_common::exec::ExecServer::start(&plan, &["--allow-non-finite-weights"]);
    for stream in [false, true] {
        let r = s
            .post_json(
                "/v1/chat/completions",
                &serde_json::json!({"messages": [{"role": "user", "content": "hi"}],
                                    "max_tokens": 4, "stream": stream}),
            )
            .await;
        assert!(
            r.text().contains("NaN or infinite logits"),
            "stream {stream}: {} {}",
            r.status,
            r.text()
        );
    }
    assert_eq!(s.get("/health").await.unwrap().status, 200);
}
