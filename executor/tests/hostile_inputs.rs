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
            vec![&plan, "--tokenizer", "/dev/zero", "--prompt", "hi", "-n", "1"],
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
