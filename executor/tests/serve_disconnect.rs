//! A client that disconnects frees its slot within a step or two, during prefill and during
//! decode, streaming or not; the slot is visibly idle on /slots and takes the next request.
//! Over the test engine (timed steps) and over the real CPU engine through
//! `strata-exec PLAN --serve`.
#[path = "serve_common/mod.rs"]
mod common;

use common::*;
use serde_json::json;
use std::time::{Duration, Instant};
use strata_exec::serve::test_engine::TinyConfig;
use strata_exec::serve::ServeOptions;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const STEP: Duration = Duration::from_millis(25);

async fn server() -> TestServer {
    TestServer::start(
        TinyConfig {
            n_slots: 2,
            max_context: 1024,
            ubatch: 4,
            step_delay: STEP,
            ..Default::default()
        },
        ServeOptions::default(),
    )
    .await
}

/// Send a request on a connection we keep, so the test can drop it.
async fn open(s: &impl Server, path: &str, body: serde_json::Value) -> TcpStream {
    let mut st = TcpStream::connect(s.addr()).await.unwrap();
    st.write_all(&request_bytes(
        "POST",
        path,
        &[],
        body.to_string().as_bytes(),
    ))
    .await
    .unwrap();
    st
}

/// Poll /slots until some slot is in `state`; returns that slot's view.
async fn wait_state(s: &impl Server, state: &str) -> serde_json::Value {
    let t0 = Instant::now();
    loop {
        let v = s.slots().await;
        if let Some(x) = v.as_array().unwrap().iter().find(|x| x["state"] == state) {
            return x.clone();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no slot reached {state}: {v}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn cancelled(s: &impl Server) -> u64 {
    let m = s.get("/metrics").await.unwrap().text();
    m.lines()
        .find_map(|l| l.strip_prefix("strata_requests_cancelled_total "))
        .unwrap()
        .parse()
        .unwrap()
}

/// Drop `conn` and time how long until every slot is idle again.
async fn drop_and_time(s: &impl Server, conn: TcpStream) -> Duration {
    drop(conn);
    let t0 = Instant::now();
    wait_idle(s, Duration::from_secs(5)).await;
    t0.elapsed()
}

fn long_prompt() -> String {
    "Once upon a time there was a little robot. It wanted to sing with the birds. ".repeat(20)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_mid_prefill_frees_the_slot() {
    let s = server().await;
    for stream in [true, false] {
        let before = cancelled(&s).await;
        let conn = open(
            &s,
            "/v1/completions",
            json!({"prompt": long_prompt(), "max_tokens": 8, "stream": stream}),
        )
        .await;
        let v = wait_state(&s, "prefill").await;
        let (done, total) = (
            v["prompt_done"].as_u64().unwrap(),
            v["prompt_tokens"].as_u64().unwrap(),
        );
        // The rest of the prefill alone would take (total - done) / 4 steps: far beyond the bound.
        assert!(total > 300 && done + 100 < total, "{v}");
        let took = drop_and_time(&s, conn).await;
        assert!(
            took < STEP * 20,
            "slot freed after {took:?} (stream {stream})"
        );
        assert_eq!(cancelled(&s).await, before + 1);
        let last = s.slots().await;
        assert!(
            last.as_array().unwrap().iter().all(|x| x["kv_cells"] == 0),
            "{last}"
        );
    }
    let r = s
        .post_json(
            "/v1/completions",
            &json!({"prompt": "Hello", "max_tokens": 2}),
        )
        .await;
    assert_eq!(r.status, 200);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_mid_decode_frees_the_slot() {
    let s = server().await;
    // Streaming: read a few tokens first. 900 tokens take 22 s at 25 ms a step, so the slot
    // is still decoding when /slots is polled even on a loaded 2-core CI box (with 300, one
    // CI run found both slots idle; a poll delayed past the 7.5 s generation is the likely
    // cause).
    let before = cancelled(&s).await;
    // Greedy: a sampled story on the random tiny model can draw an end-of-turn token within
    // the few steps before the drop and end as finished, not cancelled (one CI run saw
    // requests_cancelled stay 0 with the slot idle); the greedy one is the same every run.
    let mut conn = open(&s, "/v1/chat/completions", json!({"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 900, "stream": true, "temperature": 0})).await;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while got.windows(6).filter(|w| w == b"data: ").count() < 4 {
        let n = conn.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "stream ended early: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    let v = wait_state(&s, "decode").await;
    assert!(v["generated"].as_u64().unwrap() >= 1, "{v}");
    let took = drop_and_time(&s, conn).await;
    assert!(took < STEP * 20, "slot freed after {took:?}");
    assert_eq!(cancelled(&s).await, before + 1);
    // Not streaming: the dropped handler frees the slot as well.
    let conn = open(
        &s,
        "/v1/completions",
        json!({"prompt": "Hello", "max_tokens": 900, "temperature": 0}),
    )
    .await;
    wait_state(&s, "decode").await;
    let took = drop_and_time(&s, conn).await;
    assert!(
        took < STEP * 20,
        "slot freed after {took:?} (non-streaming)"
    );
    assert_eq!(cancelled(&s).await, before + 2);
    s.stop().await;
}

/// The real CPU engine (tiny-chat-moe, prefill chunks of 2 tokens): a client dropped during
/// a long prefill stops it (the prompt tokens fed stay below the prompt's length), one
/// dropped during decode stops generating, and both slots are idle with no KV cells on
/// /slots, then serve the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_engine_disconnect_mid_prefill_and_mid_decode_frees_the_slot() {
    use common::exec::*;
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), std::path::Path::new(REAL_MODEL), 2, 1024, 2);
    let s = ExecServer::start(&plan, &[]);
    let prompt: Vec<u32> = (0..1000u32).map(|i| (i * 7 + 3) % 397).collect();
    for stream in [true, false] {
        let before = cancelled(&s).await;
        let fed_before = s.metric("strata_prompt_tokens_total").await as u64;
        let conn = open(
            &s,
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 8, "stream": stream}),
        )
        .await;
        let v = wait_state(&s, "prefill").await;
        assert_eq!(v["prompt_tokens"], 1000, "{v}");
        let took = drop_and_time(&s, conn).await;
        let fed = s.metric("strata_prompt_tokens_total").await as u64 - fed_before;
        assert!(
            fed < 1000,
            "the prefill ran to the end ({fed} tokens) although the client left (stream {stream})"
        );
        assert!(
            took < Duration::from_secs(2),
            "slot freed after {took:?} (stream {stream})"
        );
        assert_eq!(cancelled(&s).await, before + 1);
        let last = s.slots().await;
        assert!(
            last.as_array().unwrap().iter().all(|x| x["kv_cells"] == 0),
            "{last}"
        );
    }
    for stream in [true, false] {
        let before = cancelled(&s).await;
        let gen_before = s.metric("strata_generated_tokens_total").await as u64;
        let conn = open(
            &s,
            "/v1/completions",
            json!({"prompt": [1, 2, 3], "max_tokens": 1000, "stream": stream, "temperature": 0}),
        )
        .await;
        let v = wait_state(&s, "decode").await;
        assert_eq!(v["prompt_done"], 3, "{v}");
        let took = drop_and_time(&s, conn).await;
        let generated = s.metric("strata_generated_tokens_total").await as u64 - gen_before;
        assert!(generated < 1000, "generated {generated} (stream {stream})");
        assert!(
            took < Duration::from_secs(2),
            "slot freed after {took:?} (stream {stream})"
        );
        assert_eq!(cancelled(&s).await, before + 1);
    }
    let r = s
        .post_json(
            "/v1/completions",
            &json!({"prompt": [5, 6], "max_tokens": 2}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(s.stop_with("-TERM", Duration::from_secs(15)), 0);
}
