//! SIGINT/SIGTERM: the server binary stops accepting, ends a running stream within the grace
//! period and exits 0.
#[path = "serve_common/mod.rs"]
mod common;

use common::*;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Start `strata-serve-test` on a free port; returns the child and its address.
fn spawn(extra: &[&str]) -> (Child, std::net::SocketAddr) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata-serve-test"))
        .args([
            "--tokenizer",
            TOK_DIR,
            "--port",
            "0",
            "--slots",
            "2",
            "--ctx",
            "512",
            "--ubatch",
            "4",
        ])
        .args(extra)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let l = lines.next().expect("server printed its address").unwrap();
        if let Some(a) = l.split("http://").nth(1) {
            break a.trim().parse().unwrap();
        }
    };
    // Keep draining stderr so the child never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    (child, addr)
}

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
}

fn wait_exit(child: &mut Child, limit: Duration) -> i32 {
    let t0 = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st.code().expect("exited, not killed");
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            panic!("server did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

async fn wait_health(addr: std::net::SocketAddr) {
    for _ in 0..600 {
        if let Ok(r) = request(addr, "GET", "/health", &[], b"").await {
            if r.status == 200 {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("never healthy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_ends_running_streams_and_exits_zero() {
    let (mut child, addr) = spawn(&["--delay-ms", "30", "--grace-ms", "500"]);
    wait_health(addr).await;
    // A long stream that will not finish within the grace period.
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let body =
        serde_json::json!({"prompt": "Hello", "max_tokens": 500, "stream": true}).to_string();
    conn.write_all(&request_bytes(
        "POST",
        "/v1/completions",
        &[],
        body.as_bytes(),
    ))
    .await
    .unwrap();
    let mut buf = [0u8; 4096];
    let n = conn.read(&mut buf).await.unwrap();
    assert!(n > 0);
    let t0 = Instant::now();
    signal(&child, "-INT");
    // The stream is ended by the server (error event then [DONE]), not left hanging.
    let mut rest = buf[..n].to_vec();
    loop {
        let n = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut buf))
            .await
            .expect("stream ends")
            .unwrap();
        if n == 0 {
            break;
        }
        rest.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&rest);
    assert!(text.contains("[DONE]"), "{text}");
    let code = tokio::task::spawn_blocking(move || wait_exit(&mut child, Duration::from_secs(10)))
        .await
        .unwrap();
    assert_eq!(code, 0);
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t0.elapsed()
    );
    // Nothing listens any more.
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_when_idle_exits_zero() {
    let (mut child, addr) = spawn(&[]);
    wait_health(addr).await;
    let r = request(
        addr,
        "POST",
        "/v1/completions",
        &[],
        br#"{"prompt":"Hi","max_tokens":2}"#,
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200);
    signal(&child, "-TERM");
    let code = tokio::task::spawn_blocking(move || wait_exit(&mut child, Duration::from_secs(10)))
        .await
        .unwrap();
    assert_eq!(code, 0);
}

/// The real program: `strata-exec PLAN --serve` with the CPU engine ends a stream that
/// outlives `--shutdown-grace` after SIGTERM (error event, then [DONE]) and exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strata_exec_sigterm_ends_a_running_stream_and_exits_zero() {
    use common::exec::*;
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), std::path::Path::new(REAL_MODEL), 2, 1024, 4);
    let s = ExecServer::start(&plan, &["--shutdown-grace", "0.5"]);
    let addr = s.addr;
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    // Greedy from these ids never meets the end-of-sequence id within 1000 tokens, so only
    // the shutdown can end this stream early.
    let body = serde_json::json!({"prompt": [1, 2, 3], "max_tokens": 1000, "temperature": 0,
                                  "stream": true})
    .to_string();
    conn.write_all(&request_bytes(
        "POST",
        "/v1/completions",
        &[],
        body.as_bytes(),
    ))
    .await
    .unwrap();
    let mut buf = [0u8; 4096];
    let n = conn.read(&mut buf).await.unwrap();
    assert!(n > 0);
    let t0 = Instant::now();
    let stopper =
        tokio::task::spawn_blocking(move || s.stop_with("-TERM", Duration::from_secs(10)));
    let mut rest = buf[..n].to_vec();
    loop {
        let n = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut buf))
            .await
            .expect("stream ends")
            .unwrap();
        if n == 0 {
            break;
        }
        rest.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&rest);
    assert!(text.contains("[DONE]"), "{text}");
    assert!(text.contains("shutting down"), "{text}");
    assert_eq!(stopper.await.unwrap(), 0);
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t0.elapsed()
    );
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}
