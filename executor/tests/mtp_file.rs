//! The MTP block from a separate MTP-only GGUF, end to end through the real binaries: a tiny
//! random Qwen3-Next with its MTP block is split by `strata-gguf split-mtp` into the main file
//! and llama.cpp's MTP-only file, `strata-plan --model MAIN --mtp-model MTP --spec 3` plans
//! both, and `strata-exec` gives the tokens of the single-file plan (and of plain decoding)
//! with drafts made by the block it read from the second file. A moved, changed or mismatched
//! second file is refused with exit 1 naming the file and the fix, and `strata-plan inspect`
//! shows the file.

mod common;

use common::tiny_qwen3next_hp;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A workspace binary of another package, built by cargo (a no-op when fresh) into the
/// target folder of `strata-exec`, beside it; a binary already there is used only when cargo
/// cannot be started (test binaries copied to a machine without it).
fn workspace_bin(name: &str, package: &str) -> PathBuf {
    let exec = PathBuf::from(env!("CARGO_BIN_EXE_strata-exec"));
    let dir = exec.parent().unwrap();
    let bin = dir.join(name);
    let target = dir.parent().unwrap();
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(["build", "-q", "-p", package, "--bin", name, "--target-dir"])
        .arg(target)
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    if dir.file_name().is_some_and(|p| p == "release") {
        cmd.arg("--release");
    }
    match cmd.status() {
        Ok(st) => assert!(st.success() && bin.is_file(), "cargo build {name}: {st}"),
        Err(e) => assert!(
            bin.is_file(),
            "no {name} beside strata-exec and no cargo: {e}"
        ),
    }
    bin
}

fn ok(o: &Output, what: &str) {
    assert!(
        o.status.success(),
        "{what}: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

fn refused(o: &Output, what: &str) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "{what}: {err}");
    err
}

/// One cpu device (the arch of this machine) with room for the tiny model.
fn probe(dir: &Path) -> PathBuf {
    let p = dir.join("cpu.toml");
    let toml = format!(
        "[host]\nram_bytes = 17179869184\navailable_bytes = 8589934592\n\n[[device]]\nindex = 0\nname = \"cpu0\"\nvendor = \"cpu\"\narch = \"{}\"\nvram_bytes = 268435456\nruntime_reserve_bytes = 16777216\nmem_bandwidth_gbps = 20.0\n",
        std::env::consts::ARCH
    );
    std::fs::write(&p, toml).unwrap();
    p
}

/// `strata-plan` for 2 slots of 64 cells, ubatch 8, with `extra` flags.
fn plan(dir: &Path, out: &str, extra: &[&std::ffi::OsStr]) -> Output {
    Command::new(workspace_bin("strata-plan", "strata-plan"))
        .arg("--hardware")
        .arg(probe(dir))
        .args([
            "--max-context",
            "64",
            "--batch",
            "2",
            "--ubatch",
            "8",
            "--pinned-chunk-mib",
            "1",
        ])
        .args(extra)
        .arg("-o")
        .arg(dir.join(out))
        .output()
        .unwrap()
}

fn exec(plan: &Path, extra: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata-exec"))
        .arg(plan)
        .args(["--prompt-tokens", "5,17,99,3,42,7,61", "-n", "24"])
        .args(["--format", "json", "-q"])
        .args(extra)
        .output()
        .unwrap()
}

fn tokens(o: &Output) -> Value {
    let j: Value = serde_json::from_slice(&o.stdout).unwrap();
    j["generated_token_ids"].clone()
}

fn split(input: &Path, main: &Path, mtp: &Path) {
    let o = Command::new(workspace_bin("strata-gguf", "strata-tools"))
        .arg("split-mtp")
        .arg(input)
        .arg("--main-out")
        .arg(main)
        .arg("--mtp-out")
        .arg(mtp)
        .output()
        .unwrap();
    ok(&o, "strata-gguf split-mtp");
}

#[test]
fn main_plus_mtp_file_speculates_with_the_tokens_of_the_single_file() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let whole = common::spec::mtp_model(dir, tiny_qwen3next_hp());
    let (main, mtp) = (dir.join("main.gguf"), dir.join("mtp-main.gguf"));
    split(&whole, &main, &mtp);

    let spec: [&std::ffi::OsStr; 2] = ["--spec".as_ref(), "3".as_ref()];
    let o = plan(
        dir,
        "single.plan",
        &["--model".as_ref(), whole.as_os_str(), spec[0], spec[1]],
    );
    ok(&o, "plan single");
    let o = plan(dir, "plain.plan", &["--model".as_ref(), main.as_os_str()]);
    ok(&o, "plan plain");
    let two = [
        "--model".as_ref(),
        main.as_os_str(),
        "--mtp-model".as_ref(),
        mtp.as_os_str(),
        spec[0],
        spec[1],
    ];
    let o = plan(dir, "two.plan", &two);
    ok(&o, "plan two files");
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("MTP block from") && text.contains("mtp-main.gguf"),
        "{text}"
    );

    let single = exec(&dir.join("single.plan"), &[]);
    ok(&single, "exec single");
    let plain = exec(&dir.join("plain.plan"), &[]);
    ok(&plain, "exec plain");
    let both = exec(&dir.join("two.plan"), &[]);
    ok(&both, "exec two files");
    assert_eq!(tokens(&both), tokens(&single));
    assert_eq!(tokens(&both), tokens(&plain));
    let j: Value = serde_json::from_slice(&both.stdout).unwrap();
    let s = &j["speculation"];
    assert_eq!(s["spec"], 3, "{j}");
    assert!(s["drafted"].as_u64().unwrap() > 0, "{s}");
    // The block the second file holds makes the same drafts as the single file's.
    let js: Value = serde_json::from_slice(&single.stdout).unwrap();
    assert_eq!(s["accepted"], js["speculation"]["accepted"], "{s} vs {js}");

    // The plan records both files; inspect shows the second.
    let o = Command::new(workspace_bin("strata-plan", "strata-plan"))
        .arg("inspect")
        .arg(dir.join("two.plan"))
        .args(["--format", "json"])
        .output()
        .unwrap();
    ok(&o, "inspect");
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["model"]["mtp_file"]["source"], mtp.display().to_string());
    assert_eq!(r["model"]["source"], main.display().to_string());
    let single_fp = {
        let o = Command::new(workspace_bin("strata-plan", "strata-plan"))
            .arg("inspect")
            .arg(dir.join("single.plan"))
            .args(["--format", "json"])
            .output()
            .unwrap();
        let r: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert!(r["model"].get("mtp_file").is_none(), "{r}");
        r["model"]["fingerprint"].clone()
    };
    // Two files with the block of one: the model planned is the single file's.
    assert_eq!(r["model"]["fingerprint"], single_fp);
    assert_ne!(r["model"]["mtp_file"]["fingerprint"], single_fp);

    // Moved: refused naming the path and --mtp-model; found again with --mtp-model.
    let moved = dir.join("moved-mtp.gguf");
    std::fs::rename(&mtp, &moved).unwrap();
    let err = refused(&exec(&dir.join("two.plan"), &[]), "moved");
    assert!(
        err.contains("mtp-main.gguf") && err.contains("--mtp-model"),
        "{err}"
    );
    let o = exec(
        &dir.join("two.plan"),
        &["--mtp-model".as_ref(), moved.as_os_str()],
    );
    ok(&o, "exec --mtp-model moved");
    assert_eq!(tokens(&o), tokens(&single));

    // Changed: another model's MTP file at the planned path.
    let other_dir = dir.join("other");
    std::fs::create_dir(&other_dir).unwrap();
    let mut hp = tiny_qwen3next_hp();
    hp.n_ff_exp = 64;
    let other = common::spec::mtp_model(&other_dir, hp);
    let (other_main, other_mtp) = (other_dir.join("main.gguf"), other_dir.join("mtp.gguf"));
    split(&other, &other_main, &other_mtp);
    std::fs::copy(&other_mtp, &mtp).unwrap();
    let err = refused(&exec(&dir.join("two.plan"), &[]), "changed");
    assert!(
        err.contains("mtp-main.gguf") && err.contains("not the file planned"),
        "{err}"
    );

    // Mismatched: planning that file beside our main model names it and the key.
    let o = plan(
        dir,
        "bad.plan",
        &[
            "--model".as_ref(),
            main.as_os_str(),
            "--mtp-model".as_ref(),
            other_mtp.as_os_str(),
        ],
    );
    let err = refused(&o, "mismatched plan");
    assert!(
        err.contains("mtp.gguf") && err.contains("n_ff_exp"),
        "{err}"
    );
    assert!(!dir.join("bad.plan").exists());

    // A whole model given as the MTP file, and the MTP file given as the model.
    let o = plan(
        dir,
        "bad.plan",
        &[
            "--model".as_ref(),
            main.as_os_str(),
            "--mtp-model".as_ref(),
            whole.as_os_str(),
        ],
    );
    let err = refused(&o, "whole as mtp");
    assert!(err.contains("pass it as --model"), "{err}");
    let o = plan(dir, "bad.plan", &["--model".as_ref(), moved.as_os_str()]);
    let err = refused(&o, "mtp as model");
    assert!(
        err.contains("MTP-only GGUF") && err.contains("--mtp-model"),
        "{err}"
    );

    // --mtp-model for a plan made from one file.
    let err = refused(
        &exec(
            &dir.join("single.plan"),
            &["--mtp-model".as_ref(), moved.as_os_str()],
        ),
        "not planned",
    );
    assert!(err.contains("drop --mtp-model"), "{err}");
}
