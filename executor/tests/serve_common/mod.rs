//! Shared helpers of the server tests: an in-process server over the tiny test engine on a
//! free loopback port, the real `strata-exec PLAN --serve` binary over the tiny-chat-moe
//! model (`exec`), and a minimal raw HTTP/1.1 client (so tests control connections exactly,
//! including dropping them mid-request). Invariant: every request has a timeout and targets
//! only 127.0.0.1.
#![allow(dead_code)]

pub mod exec;

use std::net::SocketAddr;
use std::time::Duration;
use strata_exec::serve::test_engine::{TinyConfig, TinyEngine};
use strata_exec::serve::{serve_on, ServeError, ServeOptions};
use strata_exec::tokenizer::Tokenizer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub const TOK_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/data/tiny-chat");

pub struct TestServer {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    join: Option<tokio::task::JoinHandle<Result<(), ServeError>>>,
}

impl TestServer {
    pub async fn start(cfg: TinyConfig, opts: ServeOptions) -> Self {
        Self::start_with_load_delay(cfg, opts, Duration::ZERO).await
    }

    pub async fn start_with_load_delay(
        cfg: TinyConfig,
        opts: ServeOptions,
        load: Duration,
    ) -> Self {
        Self::start_full(cfg, opts, load, TOK_DIR.into()).await
    }

    /// A server whose tokenizer (and chat template) come from `tok_dir`.
    pub async fn start_with_tokenizer(
        cfg: TinyConfig,
        opts: ServeOptions,
        tok_dir: std::path::PathBuf,
    ) -> Self {
        Self::start_full(cfg, opts, Duration::ZERO, tok_dir).await
    }

    async fn start_full(
        mut cfg: TinyConfig,
        opts: ServeOptions,
        load: Duration,
        tok_dir: std::path::PathBuf,
    ) -> Self {
        let loader = Box::new(move || {
            std::thread::sleep(load);
            let tok = Tokenizer::from_file(&tok_dir).map_err(|e| e.to_string())?;
            cfg.n_vocab = tok.vocab_size() as u64;
            let e = TinyEngine::new(&cfg).map_err(|e| e.to_string())?;
            Ok((
                Box::new(e) as Box<dyn strata_exec::engine::Engine>,
                Some(tok),
            ))
        });
        Self::start_loader(loader, opts, load.is_zero()).await
    }

    /// A server over whatever `loader` makes (e.g. a scripted engine); waits until it is
    /// ready when `wait`.
    pub async fn start_loader(
        loader: strata_exec::serve::Loader,
        opts: ServeOptions,
        wait: bool,
    ) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let join = tokio::spawn(serve_on(listener, loader, opts, async move {
            let _ = rx.await;
        }));
        let s = Self {
            addr,
            stop: Some(tx),
            join: Some(join),
        };
        if wait {
            s.wait_ready().await;
        }
        s
    }

    /// Stop the server and check it shut down cleanly.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(j) = self.join.take() {
            let r = tokio::time::timeout(Duration::from_secs(30), j)
                .await
                .expect("server stops in time");
            r.unwrap().unwrap();
        }
    }
}

/// Anything listening on a loopback address: the HTTP helpers every server test uses.
#[allow(async_fn_in_trait)]
pub trait Server {
    fn addr(&self) -> SocketAddr;

    async fn wait_ready(&self) {
        for _ in 0..1200 {
            if let Ok(r) = self.get("/health").await {
                if r.status == 200 {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("server never became ready");
    }

    async fn get(&self, path: &str) -> std::io::Result<Resp> {
        request(self.addr(), "GET", path, &[], b"").await
    }

    async fn post(&self, path: &str, body: &[u8]) -> Resp {
        request(
            self.addr(),
            "POST",
            path,
            &[("Content-Type", "application/json")],
            body,
        )
        .await
        .unwrap()
    }

    async fn post_json(&self, path: &str, v: &serde_json::Value) -> Resp {
        self.post(path, v.to_string().as_bytes()).await
    }

    async fn slots(&self) -> serde_json::Value {
        self.get("/slots").await.unwrap().json()
    }

    /// One counter or gauge from /metrics (the first line starting with `name `).
    async fn metric(&self, name: &str) -> f64 {
        let m = self.get("/metrics").await.unwrap().text();
        m.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
            .unwrap_or_else(|| panic!("no {name} in /metrics:\n{m}"))
            .parse()
            .unwrap()
    }
}

impl Server for TestServer {
    fn addr(&self) -> SocketAddr {
        self.addr
    }
}

#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// `data:` payloads of an SSE body.
    pub fn sse_data(&self) -> Vec<String> {
        self.text()
            .lines()
            .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
            .map(|s| s.to_string())
            .collect()
    }
}

pub fn request_bytes(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    let mut b = req.into_bytes();
    b.extend_from_slice(body);
    b
}

/// One request on a fresh connection, read to the end (60 s limit).
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<Resp> {
    tokio::time::timeout(Duration::from_secs(60), async {
        let mut s = TcpStream::connect(addr).await?;
        s.write_all(&request_bytes(method, path, headers, body))
            .await?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await?;
        Ok(parse(&raw))
    })
    .await
    .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "request timed out"))?
}

fn parse(raw: &[u8]) -> Resp {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("response has a header");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    if chunked {
        body = dechunk(&body);
    }
    Resp {
        status,
        headers,
        body,
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = b.windows(2).position(|w| w == b"\r\n") {
        let size_line = String::from_utf8_lossy(&b[..eol]).into_owned();
        let n = usize::from_str_radix(size_line.split(';').next().unwrap().trim(), 16).unwrap_or(0);
        b = &b[eol + 2..];
        if n == 0 || b.len() < n {
            out.extend_from_slice(&b[..n.min(b.len())]);
            break;
        }
        out.extend_from_slice(&b[..n]);
        b = &b[(n + 2).min(b.len())..];
    }
    out
}

/// The text of a completion: the non-streaming body's, or the streamed chunks joined.
pub fn stream_text(r: &Resp, chat: bool) -> (String, Option<String>) {
    let mut text = String::new();
    let mut finish = None;
    for d in r.sse_data() {
        if d == "[DONE]" {
            break;
        }
        let v: serde_json::Value = serde_json::from_str(&d).unwrap();
        assert!(v.get("error").is_none(), "stream error: {d}");
        if let Some(c) = v["choices"].as_array().and_then(|a| a.first()) {
            let piece = if chat {
                &c["delta"]["content"]
            } else {
                &c["text"]
            };
            if let Some(s) = piece.as_str() {
                text.push_str(s);
            }
            if let Some(f) = c["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
    }
    (text, finish)
}

/// Resident memory of this process in KiB (Linux).
pub fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// Wait until every slot is idle (or fail after `limit`).
pub async fn wait_idle(s: &impl Server, limit: Duration) -> serde_json::Value {
    let t0 = std::time::Instant::now();
    loop {
        let v = s.slots().await;
        if v.as_array().unwrap().iter().all(|x| x["state"] == "idle") {
            return v;
        }
        assert!(t0.elapsed() < limit, "slots still busy: {v}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
