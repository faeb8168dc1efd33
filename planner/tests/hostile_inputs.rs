//! Hostile inputs to `strata-plan` (issue 23): every path it reads whole is refused fast,
//! with exit 1 and a message naming the file, when it is a device, a FIFO, a link to one,
//! or larger than its kind of file may be; control bytes in names never reach the terminal.
#![cfg(unix)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Run strata-plan; fail if it takes more than 20 s (it would read forever before the fix).
fn plan(args: &[&str]) -> (i32, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata-plan"))
        .current_dir(root())
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
        if t0.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("strata-plan {args:?} still running after 20 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn mkfifo(p: &Path) -> bool {
    Command::new("mkfifo")
        .arg(p)
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

#[test]
fn devices_fifos_links_and_huge_files_are_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let d = |n: &str| dir.path().join(n).display().to_string();
    std::os::unix::fs::symlink("/dev/zero", d("zero.gguf")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", d("zero.plan")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", d("zero.toml")).unwrap();
    let fifo = mkfifo(Path::new(&d("fifo.toml")));
    // A sparse 5 MiB probe: larger than a probe may be.
    std::fs::File::create(d("huge.toml"))
        .unwrap()
        .set_len(5 << 20)
        .unwrap();
    let hw = "plans/hardware/cpu.toml";
    let model = "tests/data/tiny-chat-moe";
    let mut cases: Vec<(Vec<String>, String, &str)> = vec![
        (
            vec![
                "--hardware".into(),
                "/dev/zero".into(),
                "--model".into(),
                model.into(),
            ],
            "/dev/zero".into(),
            "character device",
        ),
        (
            vec![
                "--hardware".into(),
                d("zero.toml"),
                "--model".into(),
                model.into(),
            ],
            d("zero.toml"),
            "character device",
        ),
        (
            vec![
                "--hardware".into(),
                d("huge.toml"),
                "--model".into(),
                model.into(),
            ],
            d("huge.toml"),
            "larger than 4194304 bytes",
        ),
        (
            vec![
                "--hardware".into(),
                hw.into(),
                "--model".into(),
                d("zero.gguf"),
            ],
            d("zero.gguf"),
            "character device",
        ),
        (
            vec![
                "--hardware".into(),
                hw.into(),
                "--model".into(),
                d("zero.toml"),
            ],
            d("zero.toml"),
            "character device",
        ),
        (
            vec![
                "--hardware".into(),
                hw.into(),
                "--model".into(),
                model.into(),
                "--serve".into(),
                "/dev/zero".into(),
            ],
            "/dev/zero".into(),
            "character device",
        ),
        (
            vec![
                "--hardware".into(),
                hw.into(),
                "--model".into(),
                model.into(),
                "--gpu".into(),
                "0".into(),
                "--expert-profile".into(),
                "/dev/zero".into(),
            ],
            "/dev/zero".into(),
            "character device",
        ),
        (
            vec!["inspect".into(), "/dev/zero".into()],
            "/dev/zero".into(),
            "character device",
        ),
        (
            vec!["inspect".into(), d("zero.plan")],
            d("zero.plan"),
            "character device",
        ),
        (
            vec!["model-info".into(), d("zero.gguf")],
            d("zero.gguf"),
            "character device",
        ),
    ];
    if fifo {
        cases.push((
            vec![
                "--hardware".into(),
                d("fifo.toml"),
                "--model".into(),
                model.into(),
            ],
            d("fifo.toml"),
            "FIFO",
        ));
        cases.push((
            vec![
                "--hardware".into(),
                hw.into(),
                "--model".into(),
                d("fifo.toml"),
            ],
            d("fifo.toml"),
            "FIFO",
        ));
    } else {
        eprintln!("mkfifo unavailable: the FIFO cases are not exercised");
    }
    for (args, file, why) in &cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, err) = plan(&args);
        assert_eq!(code, 1, "{args:?}: {err}");
        assert!(
            err.contains(file.as_str()) && err.contains(why),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn control_bytes_in_device_names_are_escaped_on_the_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let probe = std::fs::read_to_string(root().join("plans/hardware/cpu.toml")).unwrap();
    let evil = probe.replacen(
        "name = \"",
        "name = \"\\u001b[2J\\u001b]0;owned\\u0007\\r",
        1,
    );
    assert_ne!(evil, probe, "the probe has a device name to poison");
    let p = dir.path().join("evil.toml");
    std::fs::write(&p, evil).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_strata-plan"))
        .current_dir(root())
        .args([
            "--hardware",
            p.to_str().unwrap(),
            "--model",
            "tests/data/tiny-chat-moe",
        ])
        .args(["--gpu", "0", "--max-context", "64"])
        .output()
        .unwrap();
    let all = [out.stdout.as_slice(), out.stderr.as_slice()].concat();
    assert!(
        !all.iter().any(|&b| b == 0x1b || b == 0x07 || b == b'\r'),
        "raw control bytes reached the terminal: {}",
        String::from_utf8_lossy(&all)
    );
    let text = String::from_utf8_lossy(&all);
    assert!(
        text.contains("\\x1b[2J"),
        "the name is shown escaped: {text}"
    );
}

/// A copy of the tiny chat model with its safetensors header and config.json edited.
fn broken_model(
    dir: &Path,
    name: &str,
    edit_header: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
    edit_config: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> String {
    let src = root().join("tests/data/tiny-chat-moe");
    let out = dir.join(name);
    std::fs::create_dir_all(&out).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit_header(&mut header);
    let mut json = serde_json::to_vec(&header).unwrap();
    while json.len() % 8 != 0 {
        json.push(b' ');
    }
    let data = if header.keys().all(|k| k == "__metadata__") {
        &[][..]
    } else {
        &bytes[8 + n..]
    };
    let mut file = (json.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&json);
    file.extend_from_slice(data);
    std::fs::write(out.join("model.safetensors"), file).unwrap();
    let mut cfg: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    edit_config(&mut cfg);
    std::fs::write(out.join("config.json"), serde_json::to_vec(&cfg).unwrap()).unwrap();
    out.display().to_string()
}

type Map = serde_json::Map<String, serde_json::Value>;

#[test]
fn broken_safetensors_models_are_refused_at_plan_time_naming_the_tensor_or_key() {
    let dir = tempfile::tempdir().unwrap();
    let keep = |_: &mut Map| {};
    let drop_named = |part: &'static str| move |h: &mut Map| h.retain(|k, _| !k.contains(part));
    let shape = |name: &'static str, f: fn(&[u64]) -> Vec<u64>| {
        move |h: &mut Map| {
            let t = h.get_mut(name).unwrap();
            let s: Vec<u64> = serde_json::from_value(t["shape"].clone()).unwrap();
            t["shape"] = serde_json::json!(f(&s));
        }
    };
    let cases: Vec<(String, &str)> = vec![
        (
            broken_model(
                dir.path(),
                "zero",
                |h| h.retain(|k, _| k == "__metadata__"),
                keep,
            ),
            "token_embd.weight",
        ),
        (
            broken_model(
                dir.path(),
                "no-q",
                drop_named("layers.0.self_attn.q_proj"),
                keep,
            ),
            "blk.0.attn_q.weight",
        ),
        (
            broken_model(dir.path(), "no-head", drop_named("lm_head"), keep),
            "output.weight",
        ),
        (
            broken_model(
                dir.path(),
                "transposed",
                shape("model.embed_tokens.weight", |s| {
                    s.iter().rev().copied().collect()
                }),
                keep,
            ),
            "token_embd.weight",
        ),
        (
            broken_model(
                dir.path(),
                "rank3",
                shape("model.layers.1.self_attn.o_proj.weight", |s| {
                    vec![s[0], s[1] / 2, 2]
                }),
                keep,
            ),
            "blk.1.attn_output.weight",
        ),
        (
            broken_model(
                dir.path(),
                "i32",
                |h| {
                    h.get_mut("model.layers.0.self_attn.k_proj.weight").unwrap()["dtype"] =
                        "I32".into()
                },
                keep,
            ),
            "I32",
        ),
        (
            broken_model(dir.path(), "layers", keep, |c| {
                c.insert("num_hidden_layers".into(), 9.into());
            }),
            "blk.2.",
        ),
        (
            broken_model(dir.path(), "vocab", keep, |c| {
                c.insert("vocab_size".into(), 500.into());
            }),
            "token_embd.weight",
        ),
        (
            broken_model(dir.path(), "kvheads", keep, |c| {
                c.remove("num_key_value_heads");
            }),
            "num_key_value_heads",
        ),
    ];
    for (model, needle) in &cases {
        let (code, err) = plan(&[
            "--hardware",
            "plans/hardware/cpu.toml",
            "--model",
            model,
            "--gpu",
            "0",
        ]);
        assert_eq!(code, 1, "{model}: {err}");
        assert!(err.contains(needle), "{model}: `{needle}` not in {err}");
    }
    // A tied head needs no lm_head.
    let tied = broken_model(dir.path(), "tied", drop_named("lm_head"), |c| {
        c.insert("tie_word_embeddings".into(), true.into());
    });
    let (code, err) = plan(&[
        "--hardware",
        "plans/hardware/cpu.toml",
        "--model",
        &tied,
        "--gpu",
        "0",
    ]);
    assert_eq!(code, 0, "{err}");
}
