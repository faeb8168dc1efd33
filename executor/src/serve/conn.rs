//! The server's accept loop: every TCP connection is admitted against a total cap and a
//! per-client-address cap, then served by hyper's HTTP/1 connection with a header-read
//! timeout (which also closes idle keep-alive connections).
//! Invariant: the number of open client sockets never exceeds `max_connections` plus
//! `REJECTERS` short-lived refusals; a connection over a cap gets a fast 503 and is closed,
//! so one client can neither exhaust the file handles nor hold every connection; on
//! shutdown the loop stops accepting, asks every connection to finish its request, and
//! returns once they are all closed.

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

/// Refusals (503 then close) that may run at once; beyond this a connection over a cap is
/// closed without an answer.
pub const REJECTERS: usize = 64;

/// How many connections are let in and how long a client may take to send a request head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// A request head must arrive whole within this, counted from when the connection
    /// opens or from its previous response (so idle keep-alive connections close too).
    pub header_timeout: Duration,
    /// Open connections at most.
    pub max_connections: usize,
    /// Open connections from one client address at most.
    pub max_per_client: usize,
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(15),
            max_connections: 512,
            max_per_client: 128,
        }
    }
}

/// Open connections per client address; a [`ClientSlot`] gives its place back on drop.
#[derive(Default)]
struct PerClient {
    open: Mutex<HashMap<IpAddr, usize>>,
}

struct ClientSlot {
    table: Arc<PerClient>,
    ip: IpAddr,
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut open = self.table.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

impl PerClient {
    fn take(self: &Arc<Self>, ip: IpAddr, max: usize) -> Option<ClientSlot> {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let n = open.entry(ip).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(ClientSlot {
            table: self.clone(),
            ip,
        })
    }
}

/// The 503 a connection over a cap gets, as raw HTTP/1.1 (it is sent before any request
/// is read, then the connection closes).
fn refusal(why: &str) -> Vec<u8> {
    let body = serde_json::json!({"error": {
        "message": why, "type": "server_error", "code": "too_many_connections"}})
    .to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Answer 503 and close; reads what the client already sent (for at most a second) so the
/// close does not reset the connection before the client reads the answer.
async fn refuse(mut s: TcpStream, why: String, _permit: OwnedSemaphorePermit) {
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        s.write_all(&refusal(&why)).await?;
        s.shutdown().await?;
        let mut sink = [0u8; 4096];
        let mut left = 64 << 10;
        while left > 0 {
            match s.read(&mut sink).await? {
                0 => break,
                n => left -= n.min(left),
            }
        }
        Ok::<_, std::io::Error>(())
    })
    .await;
}

/// Serve `app` on `listener` under `limits` until `signal` resolves and every admitted
/// connection has finished.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    signal: impl Future<Output = ()> + Send + 'static,
) {
    let total = Arc::new(Semaphore::new(limits.max_connections));
    let rejecters = Arc::new(Semaphore::new(REJECTERS));
    let per_client = Arc::new(PerClient::default());
    // Dropped when the signal fires: connections then finish their request and close.
    let (stop_tx, stop_rx) = watch::channel(());
    // Every connection task holds a receiver; `closed()` resolves when all are gone.
    let (done_tx, done_rx) = watch::channel(());
    let mut signal = std::pin::pin!(signal);
    let mut accept_error_said = false;
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of file handles (EMFILE) and the like: say it once, back off.
                    if !accept_error_said {
                        eprintln!("strata-exec serve: cannot accept a connection: {e} (raise `ulimit -n` or lower --max-connections)");
                        accept_error_said = true;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut signal => break,
        };
        let ip = peer.ip();
        let admitted = match total.clone().try_acquire_owned() {
            Err(_) => Err(format!(
                "the server holds its maximum of {} connections (--max-connections); retry shortly",
                limits.max_connections
            )),
            Ok(permit) => match per_client.take(ip, limits.max_per_client) {
                None => Err(format!(
                    "this client address holds {} connections, the most one address may (--max-connections-per-client); reuse a keep-alive connection or retry shortly",
                    limits.max_per_client
                )),
                Some(slot) => Ok((permit, slot)),
            },
        };
        let (permit, slot) = match admitted {
            Ok(a) => a,
            Err(why) => {
                if let Ok(p) = rejecters.clone().try_acquire_owned() {
                    tokio::spawn(refuse(stream, why, p));
                }
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let mut stop = stop_rx.clone();
        let done = done_rx.clone();
        let header_timeout = limits.header_timeout;
        tokio::spawn(async move {
            let mut b = http1::Builder::new();
            b.timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .keep_alive(true);
            let conn = b.serve_connection(TokioIo::new(stream), service);
            let mut conn = std::pin::pin!(conn);
            let mut stopping = false;
            loop {
                tokio::select! {
                    _ = conn.as_mut() => break,
                    r = stop.changed(), if !stopping => {
                        debug_assert!(r.is_err());
                        stopping = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
            drop((permit, slot, done));
        });
    }
    drop(listener);
    drop(stop_tx);
    drop(done_rx);
    done_tx.closed().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_client_slots_are_counted_and_given_back() {
        let t = Arc::new(PerClient::default());
        let a: IpAddr = "127.0.0.1".parse().unwrap();
        let b: IpAddr = "127.0.0.2".parse().unwrap();
        let s1 = t.take(a, 2).unwrap();
        let s2 = t.take(a, 2).unwrap();
        assert!(
            t.take(a, 2).is_none(),
            "a third from the same address is refused"
        );
        let s3 = t.take(b, 2).unwrap();
        drop(s1);
        let s4 = t.take(a, 2).unwrap();
        drop((s2, s3, s4));
        assert!(t.open.lock().unwrap().is_empty(), "every slot given back");
    }

    #[test]
    fn the_refusal_is_a_complete_http_response() {
        let r = String::from_utf8(refusal("full")).unwrap();
        let (head, body) = r.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 503 "), "{head}");
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{head}"
        );
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "too_many_connections");
    }
}
