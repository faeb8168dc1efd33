//! Server state shared between the HTTP tasks and the scheduler thread: readiness, counters,
//! per-slot views, and their Prometheus text rendering.
//! Invariant: the scheduler is the only writer of slot views and token counters; HTTP tasks
//! only read them (or bump request counters), so a scrape never blocks a decode step for
//! longer than one short mutex hold.

use crate::engine::EngineInfo;
use crate::tokenizer::Tokenizer;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};

use super::template::ChatTemplate;

/// What a loaded server knows about its model.
pub struct Ready {
    pub info: EngineInfo,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub template: Option<ChatTemplate>,
    /// Token ids that end a generation.
    pub eos: Arc<[u32]>,
}

/// A slot's state as `/slots` and `/metrics` show it.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct SlotView {
    pub id: usize,
    /// `idle`, `prefill` or `decode`.
    pub state: &'static str,
    pub request_id: Option<u64>,
    pub prompt_tokens: u64,
    /// Prompt tokens already fed.
    pub prompt_done: u64,
    pub generated: u64,
    pub kv_cells: u64,
    pub n_ctx: u64,
}

/// Counters and state shared by every part of the server.
#[derive(Default)]
pub struct Shared {
    pub ready: OnceLock<Ready>,
    /// Set when loading failed; `/health` reports it.
    pub load_error: OnceLock<String>,
    pub requests_total: AtomicU64,
    pub requests_rejected: AtomicU64,
    pub requests_finished: AtomicU64,
    pub requests_cancelled: AtomicU64,
    pub requests_failed: AtomicU64,
    pub running: AtomicU64,
    pub queued: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    /// Decode throughput, tokens/s, smoothed; f64 bits.
    pub tokens_per_s: AtomicU64,
    pub ttft_us_sum: AtomicU64,
    pub ttft_count: AtomicU64,
    pub expert_hits: AtomicU64,
    pub expert_misses: AtomicU64,
    pub expert_bytes_streamed: AtomicU64,
    pub slots: Mutex<Vec<SlotView>>,
    /// Notified once when loading failed, so the server stops instead of idling.
    pub load_failed: tokio::sync::Notify,
}

impl Shared {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// The slot views (a copy).
    pub fn slots(&self) -> Vec<SlotView> {
        self.slots.lock().map(|s| s.clone()).unwrap_or_default()
    }

    pub fn tokens_per_s(&self) -> f64 {
        f64::from_bits(self.tokens_per_s.load(Relaxed))
    }

    /// Prometheus text exposition of every metric.
    pub fn prometheus(&self) -> String {
        let mut o = String::with_capacity(2048);
        let mut m = |name: &str, kind: &str, help: &str, v: String| {
            let _ = writeln!(
                o,
                "# HELP strata_{name} {help}\n# TYPE strata_{name} {kind}\nstrata_{name} {v}"
            );
        };
        let g = |a: &AtomicU64| a.load(Relaxed).to_string();
        m(
            "ready",
            "gauge",
            "1 once the model is loaded",
            u8::from(self.ready.get().is_some()).to_string(),
        );
        m(
            "requests_total",
            "counter",
            "Generation requests received",
            g(&self.requests_total),
        );
        m(
            "requests_rejected_total",
            "counter",
            "Requests refused before running (4xx, queue full)",
            g(&self.requests_rejected),
        );
        m(
            "requests_finished_total",
            "counter",
            "Requests that completed",
            g(&self.requests_finished),
        );
        m(
            "requests_cancelled_total",
            "counter",
            "Requests whose client went away",
            g(&self.requests_cancelled),
        );
        m(
            "requests_failed_total",
            "counter",
            "Requests that failed inside the engine",
            g(&self.requests_failed),
        );
        m(
            "requests_running",
            "gauge",
            "Requests holding a slot",
            g(&self.running),
        );
        m(
            "requests_queued",
            "gauge",
            "Requests waiting for a slot",
            g(&self.queued),
        );
        m(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens prefilled",
            g(&self.prompt_tokens),
        );
        m(
            "generated_tokens_total",
            "counter",
            "Tokens generated",
            g(&self.generated_tokens),
        );
        m(
            "tokens_per_second",
            "gauge",
            "Recent decode throughput over all slots",
            format!("{:.3}", self.tokens_per_s()),
        );
        m(
            "expert_cache_hits_total",
            "counter",
            "Expert cache hits reported by the engine",
            g(&self.expert_hits),
        );
        m(
            "expert_cache_misses_total",
            "counter",
            "Expert cache misses reported by the engine",
            g(&self.expert_misses),
        );
        m(
            "expert_bytes_streamed_total",
            "counter",
            "Bytes of expert weights copied host to device for expert cache misses",
            g(&self.expert_bytes_streamed),
        );
        let _ = writeln!(
            o,
            "# HELP strata_time_to_first_token_seconds Time from a request's arrival to its first token\n# TYPE strata_time_to_first_token_seconds summary\nstrata_time_to_first_token_seconds_sum {:.6}\nstrata_time_to_first_token_seconds_count {}",
            self.ttft_us_sum.load(Relaxed) as f64 / 1e6,
            self.ttft_count.load(Relaxed)
        );
        let _ = writeln!(o, "# HELP strata_kv_cells_in_use KV cells in use per slot\n# TYPE strata_kv_cells_in_use gauge");
        for s in self.slots() {
            let _ = writeln!(
                o,
                "strata_kv_cells_in_use{{slot=\"{}\"}} {}",
                s.id, s.kv_cells
            );
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_text_has_every_family_once() {
        let s = Shared::new();
        s.requests_total.store(3, Relaxed);
        s.slots.lock().unwrap().push(SlotView {
            id: 1,
            kv_cells: 17,
            ..Default::default()
        });
        let t = s.prometheus();
        assert!(t.contains("strata_requests_total 3\n"), "{t}");
        assert!(t.contains("strata_kv_cells_in_use{slot=\"1\"} 17\n"), "{t}");
        assert!(t.contains("strata_ready 0\n"));
        for line in t.lines().filter(|l| !l.starts_with('#')) {
            let (_, v) = line.rsplit_once(' ').unwrap();
            assert!(v.parse::<f64>().is_ok(), "{line}");
        }
    }
}
