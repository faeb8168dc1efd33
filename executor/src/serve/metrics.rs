//! Server state shared between the HTTP tasks and the scheduler thread: readiness, counters,
//! latency and size histograms, per-slot views, and their Prometheus text rendering.
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
    /// Context cells the running request holds (0 when idle).
    pub kv_cells: u64,
    /// Prompt tokens the running request took from the slot's prefix cache.
    pub reused: u64,
    /// Cells an idle slot keeps for the prefix cache (0 while a request holds it).
    pub cached: u64,
    pub n_ctx: u64,
}

/// Counters and state shared by every part of the server.
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
    /// Sequences that reused at least one cached prompt token.
    pub prefix_hits: AtomicU64,
    /// Prompt tokens taken from slots' caches instead of prefilled.
    pub prefix_reused_tokens: AtomicU64,
    /// Prompt tokens of every sequence admitted into a slot (reused or prefilled).
    pub prefix_prompt_tokens: AtomicU64,
    /// Decode throughput, tokens/s, smoothed; f64 bits.
    pub tokens_per_s: AtomicU64,
    /// Arrival to first token, per sequence.
    pub ttft: Histogram,
    /// Between two tokens of one sequence.
    pub inter_token: Histogram,
    /// Arrival to the last token, per finished sequence.
    pub e2e: Histogram,
    /// Arrival to admission into a slot, per sequence.
    pub queue_time: Histogram,
    /// Prompt tokens per finished sequence.
    pub prompt_len: Histogram,
    /// Generated tokens per finished sequence.
    pub generation_len: Histogram,
    pub expert_hits: AtomicU64,
    pub expert_misses: AtomicU64,
    pub expert_bytes_streamed: AtomicU64,
    /// MTP speculation reported by the engine: steps, drafted and accepted tokens.
    pub spec_steps: AtomicU64,
    pub spec_drafted: AtomicU64,
    pub spec_accepted: AtomicU64,
    pub slots: Mutex<Vec<SlotView>>,
    /// Notified once when loading failed, so the server stops instead of idling.
    pub load_failed: tokio::sync::Notify,
}

/// Bucket bounds (seconds) of the time-to-first-token and queue-time histograms (vLLM's,
/// with finer steps below 10 ms for small models).
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// Bucket bounds (seconds) of the inter-token latency histogram.
pub const ITL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];
/// Bucket bounds (seconds) of the end-to-end latency histogram.
pub const E2E_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
];
/// Bucket bounds (tokens) of the prompt and generation length histograms.
pub const TOKEN_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0,
    50000.0, 100000.0, 200000.0, 500000.0, 1000000.0,
];

/// A Prometheus histogram with fixed bounds, updated without locks.
pub struct Histogram {
    bounds: &'static [f64],
    /// Observations per bucket (not cumulative); the last is above every bound.
    counts: Vec<AtomicU64>,
    /// Sum of observations, f64 bits.
    sum: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicU64::new(0f64.to_bits()),
        }
    }

    pub fn observe(&self, v: f64) {
        if !v.is_finite() {
            return;
        }
        let i = self.bounds.partition_point(|&b| b < v);
        self.counts[i].fetch_add(1, Relaxed);
        let _ = self.sum.fetch_update(Relaxed, Relaxed, |b| {
            Some((f64::from_bits(b) + v).to_bits())
        });
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Relaxed)).sum()
    }

    /// The family `strata_{name}` in the text format: cumulative buckets, sum, count.
    fn render(&self, o: &mut String, name: &str, help: &str) {
        let _ = writeln!(
            o,
            "# HELP strata_{name} {help}\n# TYPE strata_{name} histogram"
        );
        let mut acc = 0u64;
        for (i, c) in self.counts.iter().enumerate() {
            acc += c.load(Relaxed);
            match self.bounds.get(i) {
                Some(b) => {
                    let _ = writeln!(o, "strata_{name}_bucket{{le=\"{b}\"}} {acc}");
                }
                None => {
                    let _ = writeln!(o, "strata_{name}_bucket{{le=\"+Inf\"}} {acc}");
                }
            }
        }
        let _ = writeln!(
            o,
            "strata_{name}_sum {}\nstrata_{name}_count {acc}",
            f64::from_bits(self.sum.load(Relaxed))
        );
    }
}

impl Default for Shared {
    fn default() -> Self {
        Self {
            ready: OnceLock::new(),
            load_error: OnceLock::new(),
            requests_total: AtomicU64::new(0),
            requests_rejected: AtomicU64::new(0),
            requests_finished: AtomicU64::new(0),
            requests_cancelled: AtomicU64::new(0),
            requests_failed: AtomicU64::new(0),
            running: AtomicU64::new(0),
            queued: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generated_tokens: AtomicU64::new(0),
            prefix_hits: AtomicU64::new(0),
            prefix_reused_tokens: AtomicU64::new(0),
            prefix_prompt_tokens: AtomicU64::new(0),
            tokens_per_s: AtomicU64::new(0),
            ttft: Histogram::new(TTFT_BUCKETS),
            inter_token: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            queue_time: Histogram::new(TTFT_BUCKETS),
            prompt_len: Histogram::new(TOKEN_BUCKETS),
            generation_len: Histogram::new(TOKEN_BUCKETS),
            expert_hits: AtomicU64::new(0),
            expert_misses: AtomicU64::new(0),
            expert_bytes_streamed: AtomicU64::new(0),
            spec_steps: AtomicU64::new(0),
            spec_drafted: AtomicU64::new(0),
            spec_accepted: AtomicU64::new(0),
            slots: Mutex::new(Vec::new()),
            load_failed: tokio::sync::Notify::new(),
        }
    }
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

    /// Every counter and gauge but the per-slot ones: (name after `strata_`, kind, help,
    /// value).
    fn scalars(&self) -> Vec<(&'static str, &'static str, &'static str, String)> {
        let g = |a: &AtomicU64| a.load(Relaxed).to_string();
        vec![
            (
                "ready",
                "gauge",
                "1 once the model is loaded",
                u8::from(self.ready.get().is_some()).to_string(),
            ),
            (
                "requests_total",
                "counter",
                "Generation requests received",
                g(&self.requests_total),
            ),
            (
                "requests_rejected_total",
                "counter",
                "Requests refused before running (4xx, queue full)",
                g(&self.requests_rejected),
            ),
            (
                "requests_finished_total",
                "counter",
                "Requests that completed",
                g(&self.requests_finished),
            ),
            (
                "requests_cancelled_total",
                "counter",
                "Requests whose client went away",
                g(&self.requests_cancelled),
            ),
            (
                "requests_failed_total",
                "counter",
                "Requests that failed inside the engine",
                g(&self.requests_failed),
            ),
            (
                "requests_running",
                "gauge",
                "Requests holding a slot",
                g(&self.running),
            ),
            (
                "requests_queued",
                "gauge",
                "Requests waiting for a slot",
                g(&self.queued),
            ),
            (
                "prompt_tokens_total",
                "counter",
                "Prompt tokens prefilled",
                g(&self.prompt_tokens),
            ),
            (
                "generated_tokens_total",
                "counter",
                "Tokens generated",
                g(&self.generated_tokens),
            ),
            (
                "prefix_cache_hits_total",
                "counter",
                "Sequences that reused at least one prompt token cached in their slot",
                g(&self.prefix_hits),
            ),
            (
                "prefix_cache_reused_tokens_total",
                "counter",
                "Prompt tokens taken from a slot's prefix cache instead of prefilled",
                g(&self.prefix_reused_tokens),
            ),
            (
                "prefix_cache_prompt_tokens_total",
                "counter",
                "Prompt tokens of every sequence admitted into a slot (reused or prefilled)",
                g(&self.prefix_prompt_tokens),
            ),
            (
                "tokens_per_second",
                "gauge",
                "Recent decode throughput over all slots",
                format!("{:.3}", self.tokens_per_s()),
            ),
            (
                "expert_cache_hits_total",
                "counter",
                "Expert cache hits reported by the engine",
                g(&self.expert_hits),
            ),
            (
                "expert_cache_misses_total",
                "counter",
                "Expert cache misses reported by the engine",
                g(&self.expert_misses),
            ),
            (
                "expert_bytes_streamed_total",
                "counter",
                "Bytes of expert weights copied host to device for expert cache misses",
                g(&self.expert_bytes_streamed),
            ),
            (
                "spec_steps_total",
                "counter",
                "MTP speculative decoding steps",
                g(&self.spec_steps),
            ),
            (
                "spec_draft_tokens_total",
                "counter",
                "Tokens drafted by the MTP block",
                g(&self.spec_drafted),
            ),
            (
                "spec_accepted_tokens_total",
                "counter",
                "Drafted tokens the model accepted",
                g(&self.spec_accepted),
            ),
        ]
    }

    /// Prometheus text exposition of every metric.
    pub fn prometheus(&self) -> String {
        let mut o = String::with_capacity(2048);
        for (name, kind, help, v) in self.scalars() {
            let _ = writeln!(
                o,
                "# HELP strata_{name} {help}\n# TYPE strata_{name} {kind}\nstrata_{name} {v}"
            );
        }
        for (h, name, help) in [
            (
                &self.ttft,
                "time_to_first_token_seconds",
                "Time from a request's arrival to the first token of each of its sequences",
            ),
            (
                &self.inter_token,
                "inter_token_latency_seconds",
                "Time between two consecutive tokens of one sequence",
            ),
            (
                &self.e2e,
                "e2e_request_latency_seconds",
                "Time from a request's arrival to the last token of each of its finished sequences",
            ),
            (
                &self.queue_time,
                "request_queue_time_seconds",
                "Time from a request's arrival until each of its sequences got a slot",
            ),
            (
                &self.prompt_len,
                "request_prompt_tokens",
                "Prompt tokens of each finished sequence",
            ),
            (
                &self.generation_len,
                "request_generation_tokens",
                "Generated tokens of each finished sequence",
            ),
        ] {
            h.render(&mut o, name, help);
        }
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

    #[test]
    fn histograms_are_cumulative_with_sum_and_count() {
        let s = Shared::new();
        for v in [0.003, 0.003, 0.5, 1e9] {
            s.ttft.observe(v);
        }
        s.ttft.observe(f64::NAN);
        let t = s.prometheus();
        assert!(
            t.contains("# TYPE strata_time_to_first_token_seconds histogram\n"),
            "{t}"
        );
        assert!(
            t.contains("strata_time_to_first_token_seconds_bucket{le=\"0.0025\"} 0\n"),
            "{t}"
        );
        assert!(
            t.contains("strata_time_to_first_token_seconds_bucket{le=\"0.005\"} 2\n"),
            "{t}"
        );
        assert!(
            t.contains("strata_time_to_first_token_seconds_bucket{le=\"0.5\"} 3\n"),
            "{t}"
        );
        assert!(
            t.contains("strata_time_to_first_token_seconds_bucket{le=\"+Inf\"} 4\n"),
            "{t}"
        );
        assert!(
            t.contains("strata_time_to_first_token_seconds_count 4\n"),
            "{t}"
        );
        assert!(
            t.contains("strata_request_generation_tokens_count 0\n"),
            "{t}"
        );
        let sum: f64 = t
            .lines()
            .find_map(|l| l.strip_prefix("strata_time_to_first_token_seconds_sum "))
            .unwrap()
            .parse()
            .unwrap();
        assert!((sum - (1e9 + 0.506)).abs() < 1e-3, "{sum}");
    }
}
