//! Served names over the in-process test engine: several names (`--served-model-name A B`)
//! are all listed and accepted as `model`, `/v1/models/{id}` answers each (404 for others),
//! `created` is the real start time, response ids are unique to the server process, and
//! `--allowed-origins` CORS answers preflights (without the key) for listed origins only.
#[path = "serve_common/mod.rs"]
mod common;

use common::*;
use serde_json::json;
use strata_exec::serve::test_engine::TinyConfig;
use strata_exec::serve::ServeOptions;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aliases_are_listed_retrievable_and_accepted() {
    let opts = ServeOptions {
        model_name: Some("qwen/tiny".into()),
        model_aliases: vec!["gpt-4o".into()],
        ..Default::default()
    };
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let s = TestServer::start(TinyConfig::default(), opts.clone()).await;
    let list = s.get("/v1/models").await.unwrap().json();
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["qwen/tiny", "gpt-4o"]);
    let created = list["data"][0]["created"].as_u64().unwrap();
    assert!(created >= before && created <= before + 60, "{list}");
    for id in ids {
        let r = s.get(&format!("/v1/models/{id}")).await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["id"], id);
        let c = s
            .post_json(
                "/v1/completions",
                &json!({"model": id, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}),
            )
            .await;
        assert_eq!(c.status, 200, "{id}: {}", c.text());
    }
    let r = s.get("/v1/models/other").await.unwrap();
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    let c = s
        .post_json(
            "/v1/completions",
            &json!({"model": "other", "prompt": [1], "max_tokens": 1}),
        )
        .await;
    assert_eq!(c.status, 404);

    // Ids differ between two server processes' worth of state (here: two servers).
    let body = json!({"prompt": [1, 2], "max_tokens": 1});
    let a = s.post_json("/v1/completions", &body).await.json()["id"].clone();
    s.stop().await;
    let s2 = TestServer::start(TinyConfig::default(), opts).await;
    let b = s2.post_json("/v1/completions", &body).await.json()["id"].clone();
    assert_ne!(a, b, "ids repeat across restarts");
    s2.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_answers_preflight_for_allowed_origins_only() {
    let opts = ServeOptions {
        api_key: Some("k".into()),
        allowed_origins: vec!["http://app.example".into()],
        ..Default::default()
    };
    let s = TestServer::start(TinyConfig::default(), opts).await;
    let ok = preflight(s.addr, "http://app.example").await.unwrap();
    assert!(ok.status < 300, "preflight needs no key: {}", ok.status);
    assert_eq!(
        ok.header("access-control-allow-origin"),
        Some("http://app.example")
    );
    let allowed = ok
        .header("access-control-allow-headers")
        .unwrap_or("")
        .to_ascii_lowercase();
    assert!(allowed.contains("authorization"), "{allowed}");
    let other = preflight(s.addr, "http://evil.example").await.unwrap();
    assert_eq!(other.header("access-control-allow-origin"), None);
    // A real request from the allowed origin carries the header too.
    let r = request(
        s.addr,
        "GET",
        "/v1/models",
        &[
            ("Origin", "http://app.example"),
            ("Authorization", "Bearer k"),
        ],
        b"",
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://app.example")
    );
    s.stop().await;
}

async fn preflight(addr: std::net::SocketAddr, origin: &str) -> std::io::Result<Resp> {
    request(
        addr,
        "OPTIONS",
        "/v1/chat/completions",
        &[
            ("Origin", origin),
            ("Access-Control-Request-Method", "POST"),
            (
                "Access-Control-Request-Headers",
                "authorization,content-type",
            ),
        ],
        b"",
    )
    .await
}
