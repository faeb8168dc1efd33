//! What an operator sees of `strata-exec PLAN --serve` with the real CPU engine: one request
//! log line per finished request on stderr (JSON with `--log-format json`, text by default,
//! none with `RUST_LOG=off`), carrying the response id, tokens, times, finish reason and
//! status; the Prometheus histograms (TTFT, inter-token, end-to-end, queue time, prompt and
//! generation tokens) whose counts grow with requests; and load progress as log lines when
//! stderr is not a terminal.
#[path = "serve_common/mod.rs"]
mod common;

use common::exec::*;
use common::*;
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const FAMILIES: [&str; 6] = [
    "strata_time_to_first_token_seconds",
    "strata_inter_token_latency_seconds",
    "strata_e2e_request_latency_seconds",
    "strata_request_queue_time_seconds",
    "strata_request_prompt_tokens",
    "strata_request_generation_tokens",
];

fn block<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

fn post(s: &ExecServer, path: &str, body: &Value) -> Resp {
    block(s.post_json(path, body))
}

/// The `_count` of every histogram family, checking each is declared a histogram with a
/// `+Inf` bucket equal to its count.
fn counts(s: &ExecServer) -> Vec<f64> {
    let m = block(s.get("/metrics")).unwrap().text();
    FAMILIES
        .iter()
        .map(|f| {
            assert!(
                m.contains(&format!("# TYPE {f} histogram\n")),
                "{f} is no histogram:\n{m}"
            );
            let inf = block(s.metric(&format!("{f}_bucket{{le=\"+Inf\"}}")));
            let count = block(s.metric(&format!("{f}_count")));
            assert_eq!(inf, count, "{f}");
            count
        })
        .collect()
}

/// The request log lines on the server's stderr, waiting up to 10 s for `want` of them.
fn json_lines(s: &ExecServer, want: usize) -> Vec<Value> {
    let t0 = Instant::now();
    loop {
        let lines: Vec<Value> = s
            .log()
            .lines()
            .filter(|l| l.starts_with('{'))
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .filter(|v: &Value| v["target"] == "strata_exec::serve::request")
            .collect();
        if lines.len() >= want || t0.elapsed() > Duration::from_secs(10) {
            return lines;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn request_log_lines_and_histograms_follow_each_request() {
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), Path::new(REAL_MODEL), 2, 256, 8);
    let s = ExecServer::start(&plan, &["--log-format", "json", "--model-name", "tiny"]);
    let before = counts(&s);
    assert_eq!(before, vec![0.0; 6], "nothing observed before a request");

    let r = post(
        &s,
        "/v1/completions",
        &json!({"prompt": [1, 17, 42, 5], "max_tokens": 5, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let after = counts(&s);
    for (i, f) in FAMILIES.iter().enumerate() {
        let grew = if *f == "strata_inter_token_latency_seconds" {
            // One interval between each two of the tokens (an EOS ends it early).
            after[i] >= before[i] + v["usage"]["completion_tokens"].as_f64().unwrap() - 1.0
        } else {
            after[i] == before[i] + 1.0
        };
        assert!(grew, "{f}: {} -> {}", before[i], after[i]);
    }
    let gen_sum = block(s.metric("strata_request_generation_tokens_sum"));
    assert_eq!(gen_sum, v["usage"]["completion_tokens"].as_f64().unwrap());
    let prompt_sum = block(s.metric("strata_request_prompt_tokens_sum"));
    assert_eq!(prompt_sum, 4.0);

    let lines = json_lines(&s, 1);
    assert_eq!(lines.len(), 1, "one line per request:\n{}", s.log());
    let f = &lines[0]["fields"];
    assert_eq!(lines[0]["level"], "INFO");
    assert!(lines[0]["timestamp"].as_str().unwrap().ends_with('Z'));
    assert_eq!(f["id"], v["id"]);
    assert_eq!(f["model"], "tiny");
    assert_eq!(f["endpoint"], "/v1/completions");
    assert_eq!(f["status"], 200);
    assert_eq!(f["prompt_tokens"], 4);
    assert_eq!(f["completion_tokens"], v["usage"]["completion_tokens"]);
    assert_eq!(f["finish_reason"], v["choices"][0]["finish_reason"]);
    assert_eq!(f["stream"], false);
    let (ttft, total) = (
        f["ttft_ms"].as_f64().unwrap(),
        f["total_ms"].as_f64().unwrap(),
    );
    assert!(0.0 < ttft && ttft <= total, "{f}");

    // Streamed with two choices, then a refused one.
    let r = post(
        &s,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                "temperature": 0.7, "seed": 1, "n": 2, "stream": true}),
    );
    assert_eq!(r.status, 200);
    let r = post(
        &s,
        "/v1/completions",
        &json!({"prompt": [1, 2], "max_tokens": 100000}),
    );
    assert_eq!(r.status, 400);
    let lines = json_lines(&s, 3);
    assert_eq!(lines.len(), 3, "{}", s.log());
    let f = &lines[1]["fields"];
    assert_eq!(f["endpoint"], "/v1/chat/completions");
    assert_eq!(
        (f["stream"].clone(), f["n"].clone()),
        (json!(true), json!(2))
    );
    assert_eq!(f["finish_reason"].as_str().unwrap().split(',').count(), 2);
    let f = &lines[2]["fields"];
    assert_eq!(f["status"], 400);
    assert!(
        f["error"].as_str().unwrap().contains("100000"),
        "the refusal's reason is logged: {f}"
    );
    let gen = block(s.metric("strata_request_generation_tokens_count"));
    assert_eq!(gen, 3.0, "one per finished sequence: 1 + 2");
}

#[test]
fn text_lines_by_default_and_none_with_rust_log_off() {
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), Path::new(REAL_MODEL), 1, 128, 8);
    let body = json!({"prompt": [1, 17], "max_tokens": 2, "temperature": 0});
    let s = ExecServer::start(&plan, &[]);
    let v = post(&s, "/v1/completions", &body).json();
    let id = v["id"].as_str().unwrap().to_string();
    let t0 = Instant::now();
    let line = loop {
        if let Some(l) = s
            .log()
            .lines()
            .find(|l| l.contains(&id))
            .map(str::to_string)
        {
            break l;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{}", s.log());
        std::thread::sleep(Duration::from_millis(20));
    };
    for want in [
        " INFO strata_exec::serve::request: request finished ",
        "status=200",
        "prompt_tokens=2",
        "ttft_ms=",
        "total_ms=",
        "finish_reason=",
    ] {
        assert!(line.contains(want), "{line} lacks {want}");
    }
    drop(s);
    let s = ExecServer::start_with_env(&plan, &[], &[("RUST_LOG", "off")]);
    let v = post(&s, "/v1/completions", &body).json();
    assert!(v["id"].is_string());
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !s.log().contains("request finished"),
        "RUST_LOG=off: {}",
        s.log()
    );
}

#[test]
fn load_progress_is_logged_when_stderr_is_not_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), Path::new(REAL_MODEL), 1, 64, 8);
    let out = Command::new(env!("CARGO_BIN_EXE_strata-exec"))
        .arg(&plan)
        .args(["--prompt-tokens", "1,17,42", "-n", "2"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.lines()
            .any(|l| l.contains(" INFO strata_exec::load: loading done: ") && l.ends_with(" s")),
        "{err}"
    );
}
