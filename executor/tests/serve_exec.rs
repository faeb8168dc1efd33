//! `strata-exec PLAN --serve` end to end with the real CPU engine (tiny-chat-moe): the ready
//! line, chat and completions streaming and not with the model's chat template, usage in the
//! last chunk, the API key, the context limit, serving without a tokenizer, bad flags, and
//! SIGTERM exiting 0.
#[path = "serve_common/mod.rs"]
mod common;

use common::exec::*;
use common::*;
use serde_json::json;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const KEY: &str = "sekrit";

fn authed(s: &ExecServer, path: &str, body: &serde_json::Value) -> Resp {
    let h = format!("Bearer {KEY}");
    futures_block(request(
        s.addr,
        "POST",
        path,
        &[("Authorization", &h)],
        body.to_string().as_bytes(),
    ))
    .unwrap()
}

fn futures_block<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

#[test]
fn serves_chat_and_completions_with_the_real_engine_and_exits_0_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), Path::new(REAL_MODEL), 4, 256, 8);
    let s = ExecServer::start(
        &plan,
        &[
            "--api-key",
            KEY,
            "--model-name",
            "tiny",
            "--shutdown-grace",
            "3",
        ],
    );
    let line = &s.ready_line;
    for want in [
        &s.addr.to_string() as &str,
        "`tiny`",
        "4 slots",
        "context 256",
        "chat template",
    ] {
        assert!(line.contains(want), "ready line lacks {want}: {line}");
    }
    // /health is open; everything else needs the key.
    let health = futures_block(s.get("/health")).unwrap();
    assert_eq!(health.status, 200);
    let r = futures_block(s.get("/v1/models")).unwrap();
    assert_eq!(r.status, 401, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "authentication_error");

    // Chat, not streamed and streamed with usage: the same greedy text.
    let msgs = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]);
    let full = authed(
        &s,
        "/v1/chat/completions",
        &json!({"model": "tiny", "messages": msgs, "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(full.status, 200, "{}", full.text());
    let fj = full.json();
    let text = fj["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let usage = fj["usage"].clone();
    // The template (system + user + generation prompt) is well over the raw text's length.
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 10, "{fj}");
    let st = authed(
        &s,
        "/v1/chat/completions",
        &json!({"model": "tiny", "messages": msgs, "max_tokens": 12, "temperature": 0,
                "stream": true, "stream_options": {"include_usage": true}}),
    );
    assert_eq!(st.status, 200);
    let (stext, finish) = stream_text(&st, true);
    assert_eq!(stext, text);
    assert_eq!(
        finish.as_deref(),
        fj["choices"][0]["finish_reason"].as_str()
    );
    let data = st.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let last: serde_json::Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(last["usage"], usage, "usage rides in the last chunk");
    assert_eq!(last["choices"], json!([]));

    // A stop string cuts the text, and the request counts as finished, not cancelled.
    let stop: String = text.chars().skip(1).take(1).collect();
    if !stop.trim().is_empty() {
        let r = authed(
            &s,
            "/v1/chat/completions",
            &json!({"model": "tiny", "messages": msgs, "max_tokens": 12, "temperature": 0, "stop": [stop]}),
        );
        let v = r.json();
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        assert_eq!(
            v["choices"][0]["message"]["content"].as_str().unwrap(),
            &text[..text.find(&stop).unwrap()],
            "stop {stop:?} in {text:?}"
        );
    } else {
        eprintln!(
            "note: greedy text {text:?} has no printable second character; stop check skipped"
        );
    }

    // Completions from token ids, and from text.
    let r = authed(
        &s,
        "/v1/completions",
        &json!({"prompt": [398, 1, 17, 42], "max_tokens": 5, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["prompt_tokens"], 4);
    let r = authed(
        &s,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 5, "stream": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text());

    // prompt + max_tokens beyond the planned context: 400 naming both numbers.
    let r = authed(
        &s,
        "/v1/completions",
        &json!({"prompt": [1, 2, 3], "max_tokens": 300}),
    );
    assert_eq!(r.status, 400);
    let m = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(m.contains("300") && m.contains("256"), "{m}");
    let m = futures_block(async {
        let h = format!("Bearer {KEY}");
        request(s.addr, "GET", "/metrics", &[("Authorization", &h)], b"")
            .await
            .unwrap()
            .text()
    });
    let finished = if stop.trim().is_empty() { 4 } else { 5 };
    assert!(
        m.contains(&format!("strata_requests_finished_total {finished}\n")),
        "{m}"
    );
    assert!(m.contains("strata_requests_cancelled_total 0\n"), "{m}");
    assert!(m.contains("strata_kv_cells_in_use{slot=\"3\"} 0"), "{m}");
    assert_eq!(s.stop_with("-TERM", Duration::from_secs(15)), 0);
}

#[test]
fn without_a_tokenizer_token_ids_are_served_and_chat_is_a_clear_400() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_without_tokenizer(dir.path());
    let plan = write_plan(dir.path(), &model, 2, 128, 8);
    let s = ExecServer::start(&plan, &[]);
    assert!(s.ready_line.contains("no tokenizer"), "{}", s.ready_line);
    assert!(s.log().contains("--tokenizer"), "{}", s.log());
    let r = futures_block(s.post_json(
        "/v1/completions",
        &json!({"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}),
    ));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["completion_tokens"], 4);
    let r = futures_block(s.post_json(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}]}),
    ));
    assert_eq!(r.status, 400);
    let e = r.json();
    assert_eq!(e["error"]["code"], "no_tokenizer", "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("token ids"),
        "{e}"
    );
    let r = futures_block(s.post_json("/v1/completions", &json!({"prompt": "hello"})));
    assert_eq!(r.status, 400);
    // --tokenizer gives it one back; served names from a comma list, CORS for one origin.
    drop(s);
    let s = ExecServer::start(
        &plan,
        &[
            "--tokenizer",
            TOK_DIR,
            "--served-model-name",
            "qwen3,gpt-4o",
            "--allowed-origins",
            "http://app.example",
        ],
    );
    let ids: Vec<String> = futures_block(s.get("/v1/models")).unwrap().json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids, ["qwen3", "gpt-4o"]);
    let r = futures_block(request(
        s.addr,
        "GET",
        "/v1/models/gpt-4o",
        &[("Origin", "http://app.example")],
        b"",
    ))
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://app.example")
    );
    assert!(s.ready_line.contains("chat template"), "{}", s.ready_line);
    let r = futures_block(s.post_json(
        "/v1/chat/completions",
        &json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                "presence_penalty": 1.0, "logit_bias": {"5": -100}}),
    ));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["model"], "qwen3");
    assert_eq!(s.stop_with("-INT", Duration::from_secs(15)), 0);
}

#[test]
fn bad_serve_flags_exit_1_before_binding() {
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), Path::new(REAL_MODEL), 1, 64, 8);
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_strata-exec"))
            .arg(&plan)
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = run(&["--serve", "--tokenizer", "/nonexistent/tok.json"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("--tokenizer") && !err.contains("listening"),
        "{err}"
    );
    let (code, err) = run(&["--serve", "--prompt-tokens", "1,2"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--prompt-tokens"), "{err}");
    let (code, err) = run(&["--serve", "--allowed-origins", "http://a\nb"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--allowed-origins"), "{err}");
    let (code, err) = run(&["--serve", "--default-temperature", "5"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--default-temperature"), "{err}");
    let (code, err) = run(&["--serve", "--shutdown-grace", "-4"]);
    assert_ne!(code, Some(0), "{err}");
    let (code, err) = run(&["--port", "9000"]);
    assert_eq!(
        code,
        Some(2),
        "clap refuses a server flag without --serve: {err}"
    );
    assert!(err.contains("--serve"), "{err}");
    // A port already taken: exit 1 naming the address.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let (code, err) = run(&["--serve", "--port", &port]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(&port) && err.contains("--port"), "{err}");
}
