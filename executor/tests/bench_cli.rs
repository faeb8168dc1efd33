//! `strata-exec bench` end to end on the CPU engine and the tiny test model: comma lists of
//! -p / -n / -b / -d give one row (one JSON line) per combination, -b runs parallel
//! sequences, -d fills the KV cache first, and combinations the plan cannot hold exit 1
//! naming the flags and the numbers before the model is loaded.

mod common;

use common::*;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A plan of the base test model with `batch` slots of `ctx` cells, written under `dir`.
fn plan_file(dir: &Path, batch: u32, ctx: u64) -> PathBuf {
    let p = plan(
        "base",
        &Ask {
            batch,
            ctx,
            ..Ask::default()
        },
    );
    let path = dir.join("tiny.plan");
    strata_schemas::planfile::write_plan(&p, &path).unwrap();
    path
}

fn bench(plan: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata-exec"))
        .arg("bench")
        .arg(plan)
        .arg("--model")
        .arg(data("base"))
        .args(args)
        .output()
        .unwrap()
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn json_has_one_line_per_combination_with_batch_and_depth() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_file(dir.path(), 2, 64);
    let out = ok(&bench(
        &plan,
        &[
            "-p", "4,8", "-n", "3,5", "-b", "1,2", "-d", "0,6", "-r", "2", "-q", "--format", "json",
        ],
    ));
    let rows: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut seen = HashSet::new();
    for j in &rows {
        let key = (
            j["prompt_tokens"].as_u64().unwrap(),
            j["gen_tokens"].as_u64().unwrap(),
            j["batch"].as_u64().unwrap(),
            j["depth"].as_u64().unwrap(),
        );
        assert!(seen.insert(key), "{key:?} twice");
        assert_eq!(j["reps"], 2);
        let all = |k: &str| -> Vec<f64> {
            j[k]["all"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect()
        };
        let (tg, seq) = (all("decode_tok_s"), all("decode_tok_s_per_seq"));
        assert_eq!(tg.len(), 2);
        // Every sequence decodes in every step: aggregate = batch x per sequence.
        for (t, s) in tg.iter().zip(&seq) {
            assert!(*s > 0.0);
            assert!(
                (t - key.2 as f64 * s).abs() < 1e-9 * t,
                "{t} vs {s} x {}",
                key.2
            );
        }
        assert!(all("prefill_tok_s").iter().all(|&v| v > 0.0));
        assert!(j["predicted"]["decode_tok_s"].as_f64().unwrap() > 0.0);
        assert!(j["size_bytes"].as_u64().unwrap() > 0);
        assert!(j["params"].as_u64().unwrap() > 0);
        let file = data("base");
        assert_eq!(
            j["model_file"].as_str().unwrap(),
            file.file_name().unwrap().to_str().unwrap()
        );
    }
    let want: HashSet<_> = [4, 8]
        .iter()
        .flat_map(|&p| [3, 5].map(move |n| (p, n)))
        .flat_map(|(p, n)| [1, 2].map(move |b| (p, n, b)))
        .flat_map(|(p, n, b)| [0, 6].map(move |d| (p, n, b, d)))
        .collect();
    assert_eq!(seen, want);
}

#[test]
fn quiet_text_prints_only_the_table_with_llama_bench_columns() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_file(dir.path(), 2, 64);
    let out = bench(
        &plan,
        &["-p", "4", "-n", "3", "-b", "2", "-d", "6", "-r", "1", "-q"],
    );
    let text = ok(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "{text}");
    assert!(lines[0].starts_with("| model | size | params | backend | test | t/s | per-seq t/s |"));
    assert!(
        lines[2].contains(" GiB | ") && lines[2].contains("| cpu | pp4 @ d6 b2 |"),
        "{text}"
    );
    assert!(lines[3].contains("| cpu | tg3 @ d6 b2 |"), "{text}");
    for l in &lines {
        assert_eq!(l.matches('|').count(), 10, "{l}");
    }
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Without -q: progress on stderr and the footnotes after the table.
    let out = bench(&plan, &["-p", "4", "-n", "0", "-r", "1"]);
    let text = ok(&out);
    assert!(
        text.contains("| pp4 |") && !text.contains("| tg0"),
        "{text}"
    );
    assert!(text.contains("predictions: guesses"), "{text}");
    assert!(text.contains("host arenas:"), "{text}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("rep 1: pp4"));
}

#[test]
fn combinations_the_plan_cannot_hold_exit_1_naming_the_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_file(dir.path(), 2, 64);
    for (args, want) in [
        (
            vec!["-b", "1,3", "-p", "4", "-n", "3"],
            vec!["-b 3", "2 slot", "--batch 3"],
        ),
        (
            vec!["-b", "0", "-p", "4", "-n", "3"],
            vec!["-b 0", "--batch"],
        ),
        (
            vec!["-d", "60", "-p", "4", "-n", "3"],
            vec![
                "-d 60",
                "-p 4",
                "-n 3",
                "67 cells",
                "context of 64",
                "--max-context",
            ],
        ),
    ] {
        let out = bench(&plan, &args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        for w in want {
            assert!(err.contains(w), "{args:?}: no {w:?} in {err}");
        }
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}
