//! Load: 4x the slot count of concurrent streaming clients over several rounds. No errors
//! beyond planned 503s, every accepted request completes, greedy outputs equal the same
//! requests run one at a time, and memory stays flat: over the test engine in process and
//! over the real CPU engine through `strata-exec PLAN --serve`. Also the bounded queue (503
//! + Retry-After) and ignored benchmarks (requests/s and time to first token) of both.
#[path = "serve_common/mod.rs"]
mod common;

use common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use strata_exec::serve::test_engine::TinyConfig;
use strata_exec::serve::ServeOptions;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PROMPTS: [&str; 8] = [
    "Hello there! How are you today?",
    "The capital of France is",
    "Once upon a time there was a little robot.",
    "Count from one to ten:",
    "Write a poem about the sea and the sky.",
    "The quick brown fox",
    "Mixture of experts models route each token",
    "Please summarize this text.",
];

fn request_for(i: usize, stream: bool) -> (String, Value) {
    let p = PROMPTS[i % PROMPTS.len()];
    if i % 3 == 2 {
        (
            "/v1/chat/completions".into(),
            json!({"model": "strata-tiny", "messages": [{"role": "user", "content": p}], "max_tokens": 10 + i % 5, "temperature": 0, "stream": stream}),
        )
    } else {
        (
            "/v1/completions".into(),
            json!({"model": "strata-tiny", "prompt": p, "max_tokens": 10 + i % 5, "temperature": 0, "stream": stream}),
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_match_sequential_greedy_and_memory_is_flat() {
    let n_slots = 4;
    let clients = 4 * n_slots;
    let s = TestServer::start(
        TinyConfig {
            n_slots,
            max_context: 128,
            ubatch: 8,
            ..Default::default()
        },
        ServeOptions {
            queue: clients,
            ..Default::default()
        },
    )
    .await;
    // Reference: each request alone, not streamed.
    let mut expected = Vec::new();
    for i in 0..clients {
        let (path, body) = request_for(i, false);
        let r = s.post_json(&path, &body).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        let c = &v["choices"][0];
        let text = if path.contains("chat") {
            c["message"]["content"].as_str()
        } else {
            c["text"].as_str()
        };
        expected.push((
            text.unwrap().to_string(),
            c["finish_reason"].as_str().unwrap().to_string(),
        ));
    }
    let mut rss = Vec::new();
    for round in 0..3 {
        let mut tasks = Vec::new();
        for i in 0..clients {
            let addr = s.addr;
            tasks.push(tokio::spawn(async move {
                let (path, body) = request_for(i, true);
                let r = request(addr, "POST", &path, &[], body.to_string().as_bytes())
                    .await
                    .unwrap();
                (i, path, r)
            }));
        }
        for t in tasks {
            let (i, path, r) = t.await.unwrap();
            assert_eq!(r.status, 200, "round {round} client {i}: {}", r.text());
            assert!(r
                .header("content-type")
                .unwrap()
                .starts_with("text/event-stream"));
            let data = r.sse_data();
            assert_eq!(
                data.last().map(String::as_str),
                Some("[DONE]"),
                "stream ends with [DONE]"
            );
            let (text, finish) = stream_text(&r, path.contains("chat"));
            assert_eq!(
                (text, finish.unwrap()),
                expected[i],
                "round {round} client {i} differs from the sequential run"
            );
        }
        let idle = wait_idle(&s, Duration::from_secs(5)).await;
        assert!(idle
            .as_array()
            .unwrap()
            .iter()
            .all(|x| x["kv_cells"] == 0 || x["state"] == "idle"));
        rss.push(rss_kib());
    }
    let m = s.get("/metrics").await.unwrap().text();
    assert!(m.contains("strata_requests_failed_total 0"), "{m}");
    assert!(
        m.contains("strata_requests_running 0") && m.contains("strata_requests_queued 0"),
        "{m}"
    );
    // Flat memory: the later rounds do not grow beyond allocator noise.
    assert!(
        rss[2] <= rss[0] + 8 * 1024,
        "RSS grew across rounds: {rss:?} KiB"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_503_with_retry_after() {
    let s = TestServer::start(
        TinyConfig {
            n_slots: 1,
            max_context: 128,
            ubatch: 8,
            step_delay: Duration::from_millis(20),
            ..Default::default()
        },
        ServeOptions {
            queue: 1,
            ..Default::default()
        },
    )
    .await;
    let body = json!({"prompt": "Hello there", "max_tokens": 20, "temperature": 0}).to_string();
    let mut tasks = Vec::new();
    for _ in 0..5 {
        let addr = s.addr;
        let b = body.clone();
        tasks.push(tokio::spawn(async move {
            request(addr, "POST", "/v1/completions", &[], b.as_bytes())
                .await
                .unwrap()
        }));
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let (mut ok, mut busy) = (0, 0);
    for t in tasks {
        let r = t.await.unwrap();
        match r.status {
            200 => ok += 1,
            503 => {
                busy += 1;
                assert_eq!(r.header("retry-after"), Some("1"));
                assert_eq!(r.json()["error"]["code"], "queue_full");
            }
            other => panic!("unexpected {other}: {}", r.text()),
        }
    }
    assert!(ok >= 2 && busy >= 1, "ok {ok} busy {busy}");
    assert_eq!(
        s.post("/v1/completions", body.as_bytes()).await.status,
        200,
        "served again once the queue drains"
    );
    s.stop().await;
}

/// Time to the first SSE event and to the end of one streamed request.
async fn timed_stream(addr: std::net::SocketAddr, body: String) -> (Duration, Duration) {
    let t0 = Instant::now();
    let mut st = tokio::net::TcpStream::connect(addr).await.unwrap();
    st.write_all(&request_bytes(
        "POST",
        "/v1/completions",
        &[],
        body.as_bytes(),
    ))
    .await
    .unwrap();
    let mut buf = vec![0u8; 1 << 16];
    let mut seen = Vec::new();
    let mut first = None;
    loop {
        let n = st.read(&mut buf).await.unwrap();
        if n == 0 {
            break;
        }
        seen.extend_from_slice(&buf[..n]);
        if first.is_none() && seen.windows(6).any(|w| w == b"data: ") {
            first = Some(t0.elapsed());
        }
    }
    assert!(String::from_utf8_lossy(&seen).contains("[DONE]"));
    (first.unwrap(), t0.elapsed())
}

/// Requests/s and time to first token at concurrency 1, `n_slots` and `2 * n_slots`
/// (streamed, 32 generated tokens each), printed as `BENCH` lines.
async fn bench(s: &impl Server, label: &str, n_slots: usize) {
    let prompt = "Once upon a time there was a little robot. It wanted to sing with the birds in the morning.";
    let n_tok = s
        .post_json("/tokenize", &json!({"content": prompt}))
        .await
        .json()["tokens"]
        .as_array()
        .unwrap()
        .len();
    // Warm-up: first-touch page faults and lazy initialisation stay out of the numbers.
    for _ in 0..2 {
        let body = json!({"prompt": prompt, "max_tokens": 32, "temperature": 0, "stream": true});
        timed_stream(s.addr(), body.to_string()).await;
    }
    for (concurrency, total) in [(1usize, 16usize), (n_slots, 32), (2 * n_slots, 64)] {
        let body = json!({"prompt": prompt, "max_tokens": 32, "temperature": 0, "stream": true})
            .to_string();
        let t0 = Instant::now();
        let mut ttft = Vec::new();
        for _ in 0..total / concurrency {
            let mut tasks = Vec::new();
            for _ in 0..concurrency {
                let b = body.clone();
                let addr = s.addr();
                tasks.push(tokio::spawn(async move { timed_stream(addr, b).await }));
            }
            for t in tasks {
                ttft.push(t.await.unwrap().0);
            }
        }
        let wall = t0.elapsed().as_secs_f64();
        ttft.sort();
        let med = ttft[ttft.len() / 2].as_secs_f64() * 1e3;
        let p90 = ttft[ttft.len() * 9 / 10].as_secs_f64() * 1e3;
        println!(
            "BENCH {label} concurrency {concurrency}: {total} requests ({n_tok}-token prompt, up to 32 generated) in {wall:.2} s = {:.1} req/s; TTFT median {med:.1} ms, p90 {p90:.1} ms",
            total as f64 / wall
        );
    }
    let m = s.get("/metrics").await.unwrap().text();
    for l in m.lines().filter(|l| {
        l.starts_with("strata_generated_tokens_total")
            || l.starts_with("strata_time_to_first")
            || l.starts_with("strata_tokens_per_second")
    }) {
        println!("BENCH {label} {l}");
    }
}

/// `cargo test --release -p strata-exec --test serve_load bench_test_engine -- --ignored --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run in release with --nocapture"]
async fn bench_test_engine_requests_per_second_and_ttft() {
    let n_slots = 4;
    let s = TestServer::start(
        TinyConfig {
            n_slots,
            max_context: 256,
            ubatch: 16,
            ..Default::default()
        },
        ServeOptions {
            queue: 64,
            ..Default::default()
        },
    )
    .await;
    bench(&s, "test-engine", n_slots).await;
    s.stop().await;
}

/// The real CPU engine through `strata-exec PLAN --serve` (tiny-chat-moe, 4 slots, ubatch 16):
/// `cargo test --release -p strata-exec --test serve_load bench_real -- --ignored --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run in release with --nocapture"]
async fn bench_real_engine_requests_per_second_and_ttft() {
    use common::exec::*;
    let n_slots = 4;
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(
        dir.path(),
        std::path::Path::new(REAL_MODEL),
        n_slots as u32,
        256,
        16,
    );
    let s = ExecServer::start(&plan, &["--queue", "64"]);
    bench(&s, "cpu-engine", n_slots).await;
    println!("BENCH cpu-engine server RSS {} KiB", s.rss_kib());
    assert_eq!(s.stop_with("-INT", Duration::from_secs(15)), 0);
}

/// One streamed request that retries on a planned 503 (queue full); returns the response and
/// how many 503s it met.
async fn stream_with_retry(addr: std::net::SocketAddr, path: &str, body: &Value) -> (Resp, u32) {
    let mut busy = 0;
    loop {
        let r = request(addr, "POST", path, &[], body.to_string().as_bytes())
            .await
            .unwrap();
        if r.status != 503 {
            return (r, busy);
        }
        assert_eq!(r.header("retry-after"), Some("1"), "{}", r.text());
        assert_eq!(r.json()["error"]["code"], "queue_full");
        busy += 1;
        // Sooner than Retry-After's second, to keep the test short.
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
}

/// The real CPU engine through `strata-exec PLAN --serve`: 4x the slots of concurrent
/// streaming clients, four rounds, a queue small enough that some get the planned 503 and
/// retry. Every accepted request completes with the text the same request gets alone, and
/// the server's resident memory is flat from the second round on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_engine_concurrent_streams_match_sequential_greedy_and_rss_is_flat() {
    use common::exec::*;
    let n_slots = 4;
    let clients = 4 * n_slots;
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(
        dir.path(),
        std::path::Path::new(REAL_MODEL),
        n_slots as u32,
        128,
        8,
    );
    let s = ExecServer::start(&plan, &["--queue", "8", "--model-name", "strata-tiny"]);
    let mut expected = Vec::new();
    for i in 0..clients {
        let (path, body) = request_for(i, false);
        let r = s.post_json(&path, &body).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        let c = &v["choices"][0];
        let text = if path.contains("chat") {
            c["message"]["content"].as_str()
        } else {
            c["text"].as_str()
        };
        expected.push((
            text.unwrap().to_string(),
            c["finish_reason"].as_str().unwrap().to_string(),
        ));
    }
    let mut rss = Vec::new();
    let mut planned_503 = 0;
    for round in 0..4 {
        let mut tasks = Vec::new();
        for i in 0..clients {
            let addr = s.addr;
            tasks.push(tokio::spawn(async move {
                let (path, body) = request_for(i, true);
                let (r, busy) = stream_with_retry(addr, &path, &body).await;
                (i, path, r, busy)
            }));
        }
        for t in tasks {
            let (i, path, r, busy) = t.await.unwrap();
            planned_503 += busy;
            assert_eq!(r.status, 200, "round {round} client {i}: {}", r.text());
            assert_eq!(r.sse_data().last().map(String::as_str), Some("[DONE]"));
            let (text, finish) = stream_text(&r, path.contains("chat"));
            assert_eq!(
                (text, finish.unwrap()),
                expected[i],
                "round {round} client {i} differs from the request run alone"
            );
        }
        let idle = wait_idle(&s, Duration::from_secs(10)).await;
        assert!(
            idle.as_array().unwrap().iter().all(|x| x["kv_cells"] == 0),
            "{idle}"
        );
        rss.push(s.rss_kib());
    }
    assert_eq!(s.metric("strata_requests_failed_total").await, 0.0);
    assert_eq!(s.metric("strata_requests_cancelled_total").await, 0.0);
    assert_eq!(
        s.metric("strata_requests_finished_total").await,
        (5 * clients) as f64,
        "every accepted request finished"
    );
    assert_eq!(s.metric("strata_requests_running").await, 0.0);
    assert_eq!(s.metric("strata_requests_queued").await, 0.0);
    eprintln!("planned 503s: {planned_503}; server RSS after each round: {rss:?} KiB");
    assert!(
        rss[3] <= rss[1] + 4 * 1024,
        "the server's RSS grew across rounds: {rss:?} KiB"
    );
    assert_eq!(s.stop_with("-INT", Duration::from_secs(15)), 0);
}

/// Chunked prefill in mixed passes on the real CPU engine: while two slots stream greedy
/// completions, a third request brings a prompt of many chunks; its chunks run in the same
/// passes as the others' decode tokens (`strata_mixed_steps_total` counts them), and every
/// request's text equals what it gets alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_engine_long_prompt_beside_decoding_slots_keeps_greedy_outputs() {
    use common::exec::*;
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), std::path::Path::new(REAL_MODEL), 3, 512, 8);
    let s = ExecServer::start(&plan, &["--model-name", "strata-tiny"]);
    let long: String = (0..40)
        .map(|i| PROMPTS[i % PROMPTS.len()])
        .collect::<Vec<_>>()
        .join(" ");
    let body = |p: &str, max: u32, stream: bool| json!({"prompt": p, "max_tokens": max, "temperature": 0, "ignore_eos": true, "stream": stream});
    let reqs = [
        body(PROMPTS[0], 120, true),
        body(PROMPTS[1], 120, true),
        body(&long, 8, true),
    ];
    let mut alone = Vec::new();
    for b in &reqs {
        let mut b = b.clone();
        b["stream"] = json!(false);
        let r = s.post_json("/v1/completions", &b).await;
        assert_eq!(r.status, 200, "{}", r.text());
        alone.push(r.json()["choices"][0]["text"].as_str().unwrap().to_string());
    }
    let prompt_tokens = s.metric("strata_prompt_tokens_total").await;
    assert!(
        prompt_tokens > 100.0,
        "the long prompt is many chunks of 8: {prompt_tokens} prompt tokens in all"
    );
    assert_eq!(
        s.metric("strata_mixed_steps_total").await,
        0.0,
        "one at a time"
    );
    let mut tasks = Vec::new();
    for (i, b) in reqs.iter().enumerate() {
        let (addr, b) = (s.addr, b.clone());
        tasks.push(tokio::spawn(async move {
            if i == 2 {
                // The long prompt arrives once the others are decoding.
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
            request(
                addr,
                "POST",
                "/v1/completions",
                &[],
                b.to_string().as_bytes(),
            )
            .await
            .unwrap()
        }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        let (text, _) = stream_text(&r, false);
        assert_eq!(text, alone[i], "request {i} differs from its run alone");
    }
    let mixed = s.metric("strata_mixed_steps_total").await;
    assert!(
        mixed >= 3.0,
        "the long prompt's chunks ran beside the decoding slots: {mixed} mixed steps"
    );
    assert_eq!(s.metric("strata_requests_failed_total").await, 0.0);
    assert_eq!(s.stop_with("-INT", Duration::from_secs(15)), 0);
}
