//! Server error handling: bad input of every kind gets a 4xx OpenAI-style JSON error and the
//! next request is still served; API keys; loading state; the info endpoints.
#[path = "serve_common/mod.rs"]
mod common;

use common::*;
use serde_json::json;
use std::time::Duration;
use strata_exec::serve::test_engine::TinyConfig;
use strata_exec::serve::ServeOptions;

fn cfg() -> TinyConfig {
    TinyConfig {
        n_slots: 2,
        max_context: 128,
        ubatch: 8,
        ..Default::default()
    }
}

fn assert_error(r: &Resp, status: u16, needle: &str) {
    assert_eq!(r.status, status, "{}", r.text());
    let v = r.json();
    let msg = v["error"]["message"]
        .as_str()
        .unwrap_or_else(|| panic!("no error.message: {v}"));
    assert!(v["error"]["type"].is_string(), "{v}");
    assert!(v["error"].get("code").is_some(), "{v}");
    assert!(msg.contains(needle), "`{needle}` not in `{msg}`");
}

/// Bad requests of every kind: (path, body, the status wanted, a word its message names).
fn bad_requests() -> Vec<(&'static str, Vec<u8>, u16, &'static str)> {
    vec![
        (
            "/v1/completions",
            b"{not json".to_vec(),
            400,
            "not valid JSON",
        ),
        ("/v1/completions", b"".to_vec(), 400, "empty"),
        ("/v1/completions", b"[1,2]".to_vec(), 400, "JSON object"),
        (
            "/v1/completions",
            b"{\"prompt\": \"\xff\xfe\"}".to_vec(),
            400,
            "JSON",
        ),
        (
            "/v1/completions",
            br#"{"prompt": 12}"#.to_vec(),
            400,
            "prompt",
        ),
        (
            "/v1/completions",
            br#"{"prompt": "x", "max_tokens": "ten"}"#.to_vec(),
            400,
            "max_tokens",
        ),
        (
            "/v1/completions",
            br#"{"prompt": "x", "max_tokens": -5}"#.to_vec(),
            400,
            "max_tokens",
        ),
        (
            "/v1/completions",
            br#"{"prompt": "x", "max_tokens": 99999999999999999999999}"#.to_vec(),
            400,
            "max_tokens",
        ),
        (
            "/v1/completions",
            br#"{"prompt": "x", "temperature": -1}"#.to_vec(),
            400,
            "temperature",
        ),
        (
            "/v1/completions",
            br#"{"prompt": "x", "top_p": 7}"#.to_vec(),
            400,
            "top_p",
        ),
        (
            "/v1/completions",
            br#"{"prompt": "x", "n": 3}"#.to_vec(),
            400,
            "`n`",
        ),
        (
            "/v1/completions",
            br#"{"prompt": [1, 99999]}"#.to_vec(),
            400,
            "vocabulary",
        ),
        (
            "/v1/completions",
            br#"{"prompt": ""}"#.to_vec(),
            400,
            "empty",
        ),
        (
            "/v1/completions",
            br#"{"prompt": "x", "model": "gpt-4"}"#.to_vec(),
            404,
            "gpt-4",
        ),
        (
            "/v1/chat/completions",
            br#"{"messages": []}"#.to_vec(),
            400,
            "empty",
        ),
        (
            "/v1/chat/completions",
            br#"{"messages": [{"role": "user", "content": 5}]}"#.to_vec(),
            400,
            "content",
        ),
        (
            "/v1/chat/completions",
            br#"{"messages": [{"role": "wizard", "content": "x"}]}"#.to_vec(),
            400,
            "role",
        ),
        (
            "/v1/chat/completions",
            br#"{"messages": "hello"}"#.to_vec(),
            400,
            "messages",
        ),
        ("/tokenize", br#"{"content": 5}"#.to_vec(), 400, "content"),
        (
            "/detokenize",
            br#"{"tokens": [-1]}"#.to_vec(),
            400,
            "tokens[0]",
        ),
        ("/v1/completions", vec![b' '; 100 * 1024], 413, "larger"),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_4xx_json_and_the_next_request_is_served() {
    let s = TestServer::start(
        cfg(),
        ServeOptions {
            max_body_bytes: 64 * 1024,
            ..Default::default()
        },
    )
    .await;
    let good =
        json!({"model": "strata-tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0});
    for (path, body, status, needle) in bad_requests() {
        let r = s.post(path, &body).await;
        assert_error(&r, status, needle);
        let ok = s.post_json("/v1/completions", &good).await;
        assert_eq!(
            ok.status,
            200,
            "after {path} {}: {}",
            String::from_utf8_lossy(&body[..body.len().min(60)]),
            ok.text()
        );
    }
    // The planned context is a per-request limit, named with both numbers.
    let long = "Hello there how are you today ".repeat(40);
    let r = s
        .post_json(
            "/v1/completions",
            &json!({"prompt": "Tell me a story", "max_tokens": 500}),
        )
        .await;
    assert_error(&r, 400, "max_tokens is 500");
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("128"),
        "{}",
        r.text()
    );
    let r = s
        .post_json("/v1/completions", &json!({"prompt": long}))
        .await;
    assert_error(&r, 400, "planned context is 128");
    assert_error(&s.get("/nope").await.unwrap(), 404, "/nope");
    assert_error(&s.get("/v1/completions").await.unwrap(), 405, "GET");
    assert_eq!(s.post_json("/v1/completions", &good).await.status, 200);
    let m = s.get("/metrics").await.unwrap().text();
    assert!(m.contains("strata_requests_rejected_total"), "{m}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_guards_everything_but_health() {
    let s = TestServer::start(
        cfg(),
        ServeOptions {
            api_key: Some("sekret".into()),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(s.get("/health").await.unwrap().status, 200);
    assert_error(&s.get("/v1/models").await.unwrap(), 401, "API key");
    let body = json!({"prompt": "Hi", "max_tokens": 2}).to_string();
    let wrong = request(
        s.addr,
        "POST",
        "/v1/completions",
        &[("Authorization", "Bearer nope")],
        body.as_bytes(),
    )
    .await
    .unwrap();
    assert_error(&wrong, 401, "wrong");
    let right = request(
        s.addr,
        "POST",
        "/v1/completions",
        &[("Authorization", "Bearer sekret")],
        body.as_bytes(),
    )
    .await
    .unwrap();
    assert_eq!(right.status, 200, "{}", right.text());
    let models = request(
        s.addr,
        "GET",
        "/v1/models",
        &[("Authorization", "Bearer sekret")],
        b"",
    )
    .await
    .unwrap();
    assert_eq!(models.json()["data"][0]["id"], "strata-tiny");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_503_while_loading_then_200() {
    let s = TestServer::start_with_load_delay(
        cfg(),
        ServeOptions::default(),
        Duration::from_millis(600),
    )
    .await;
    let r = s.get("/health").await.unwrap();
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["status"], "loading");
    assert_error(
        &s.post_json("/v1/completions", &json!({"prompt": "x"}))
            .await,
        503,
        "loading",
    );
    s.wait_ready().await;
    assert_eq!(s.get("/health").await.unwrap().status, 200);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_endpoints_and_chat_template() {
    let s = TestServer::start(cfg(), ServeOptions::default()).await;
    let m = s.get("/v1/models").await.unwrap().json();
    assert_eq!(m["data"][0]["meta"]["max_context"], 128);
    let t = s
        .post_json("/tokenize", &json!({"content": "Hello there"}))
        .await
        .json();
    let ids = t["tokens"].as_array().unwrap().clone();
    assert!(!ids.is_empty());
    let d = s
        .post_json("/detokenize", &json!({"tokens": ids}))
        .await
        .json();
    assert_eq!(d["content"], "Hello there");
    let slots = s.slots().await;
    assert_eq!(slots.as_array().unwrap().len(), 2);
    assert_eq!(slots[0]["state"], "idle");
    assert_eq!(slots[0]["n_ctx"], 128);
    // The chat prompt is the template's rendering: usage counts its tokens.
    let r = s
        .post_json("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2, "temperature": 0}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let rendered = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n";
    let n = s
        .post_json("/tokenize", &json!({"content": rendered}))
        .await
        .json()["tokens"]
        .as_array()
        .unwrap()
        .len();
    assert_eq!(v["usage"]["prompt_tokens"], n as u64);
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let metrics = s.get("/metrics").await.unwrap();
    assert!(metrics
        .header("content-type")
        .unwrap()
        .starts_with("application/openmetrics-text; version=1.0.0"));
    let text = metrics.text();
    for fam in [
        "strata_requests_running",
        "strata_requests_queued",
        "strata_prompt_tokens_total",
        "strata_generated_tokens_total",
        "strata_tokens_per_second",
        "strata_expert_cache_hits_total",
        "strata_expert_cache_misses_total",
        "strata_expert_bytes_streamed_total",
        "strata_kv_cells_in_use{slot=\"1\"}",
    ] {
        assert!(text.contains(fam), "{fam} missing");
    }
    s.stop().await;
}
