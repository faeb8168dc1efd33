//! Server state shared between the HTTP tasks and the scheduler thread: readiness, counters,
//! latency and size histograms (`prometheus-client`'s), per-slot views, and their exposition
//! through a `prometheus-client` registry (OpenMetrics text, every name `strata_`-prefixed).
//! Counters and gauges are plain atomics here, read into the registry at each scrape by one
//! collector: a new one is a field and a row of [`Shared::scalars`].
//! Invariant: the scheduler is the only writer of slot views and token counters; HTTP tasks
//! only read them (or bump request counters), so a scrape never blocks a decode step for
//! longer than one short mutex hold.

use crate::engine::EngineInfo;
use crate::tokenizer::Tokenizer;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
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
    /// The compiler of `response_format` grammars, or why there is none.
    pub grammars: Result<Arc<super::structured::Grammars>, super::structured::StructuredError>,
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
    /// Prompt tokens a choice of an `n > 1` request took by copying the first choice's slot.
    pub prompt_tokens_copied: AtomicU64,
    /// Engine steps that ran a prompt chunk together with other slots' decode tokens.
    pub mixed_steps: AtomicU64,
    /// Sequences that reused at least one cached prompt token.
    pub prefix_hits: AtomicU64,
    /// Prompt tokens taken from slots' caches instead of prefilled.
    pub prefix_reused_tokens: AtomicU64,
    /// Of `prefix_hits`: recurrent slots rewound to their prefix checkpoint.
    pub prefix_checkpoint_hits: AtomicU64,
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
    pub expert_misses_cpu: AtomicU64,
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

/// A Prometheus histogram with fixed bounds (`prometheus-client`'s, lock-free), which
/// ignores non-finite observations.
#[derive(Debug, Clone)]
pub struct Histogram(prometheus_client::metrics::histogram::Histogram);

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self(prometheus_client::metrics::histogram::Histogram::new(
            bounds.iter().copied(),
        ))
    }

    pub fn observe(&self, v: f64) {
        if v.is_finite() {
            self.0.observe(v);
        }
    }
}

/// The value of a counter or gauge read at scrape time.
#[derive(Debug, Clone, Copy)]
enum Value {
    Int(u64),
    Float(f64),
}

/// One counter or gauge: name after `strata_` (a counter's without its `_total`, which the
/// encoder adds), help, kind, value.
type Scalar = (&'static str, &'static str, MetricType, Value);

/// The counters, gauges and per-slot KV cells as read at one scrape.
#[derive(Debug)]
struct Snapshot {
    scalars: Vec<Scalar>,
    kv_cells: Vec<(usize, u64)>,
}

impl Collector for Snapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for &(name, help, kind, v) in &self.scalars {
            let m = enc.encode_descriptor(name, help, None, kind)?;
            match (kind, v) {
                (MetricType::Counter, Value::Int(x)) => ConstCounter::new(x).encode(m)?,
                (MetricType::Counter, Value::Float(x)) => ConstCounter::new(x).encode(m)?,
                (_, Value::Int(x)) => ConstGauge::new(x as i64).encode(m)?,
                (_, Value::Float(x)) => ConstGauge::new(x).encode(m)?,
            }
        }
        let mut m = enc.encode_descriptor(
            "kv_cells_in_use",
            "KV cells in use per slot",
            None,
            MetricType::Gauge,
        )?;
        for &(slot, cells) in &self.kv_cells {
            let labels = [("slot", slot.to_string())];
            ConstGauge::new(cells as i64).encode(m.encode_family(&labels)?)?;
        }
        Ok(())
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
            prompt_tokens_copied: AtomicU64::new(0),
            mixed_steps: AtomicU64::new(0),
            prefix_hits: AtomicU64::new(0),
            prefix_reused_tokens: AtomicU64::new(0),
            prefix_checkpoint_hits: AtomicU64::new(0),
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
            expert_misses_cpu: AtomicU64::new(0),
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

    /// Every counter and gauge but the per-slot ones.
    fn scalars(&self) -> Vec<Scalar> {
        use MetricType::{Counter, Gauge};
        let g = |a: &AtomicU64| Value::Int(a.load(Relaxed));
        vec![
            ("ready", "1 once the model is loaded", Gauge, Value::Int(u64::from(self.ready.get().is_some()))),
            ("requests", "Generation requests received", Counter, g(&self.requests_total)),
            ("requests_rejected", "Requests refused before running (4xx, queue full)", Counter, g(&self.requests_rejected)),
            ("requests_finished", "Requests that completed", Counter, g(&self.requests_finished)),
            ("requests_cancelled", "Requests whose client went away", Counter, g(&self.requests_cancelled)),
            ("requests_failed", "Requests that failed inside the engine", Counter, g(&self.requests_failed)),
            ("requests_running", "Requests holding a slot", Gauge, g(&self.running)),
            ("requests_queued", "Requests waiting for a slot", Gauge, g(&self.queued)),
            ("prompt_tokens", "Prompt tokens prefilled", Counter, g(&self.prompt_tokens)),
            ("generated_tokens", "Tokens generated", Counter, g(&self.generated_tokens)),
            ("prompt_tokens_copied", "Prompt tokens a later choice of an n > 1 request took by copying the first choice's context instead of prefilling", Counter, g(&self.prompt_tokens_copied)),
            ("mixed_steps", "Engine steps that ran a prompt chunk together with other slots' decode tokens (chunked prefill)", Counter, g(&self.mixed_steps)),
            ("prefix_cache_hits", "Sequences that reused at least one prompt token cached in their slot", Counter, g(&self.prefix_hits)),
            ("prefix_cache_reused_tokens", "Prompt tokens taken from a slot's prefix cache instead of prefilled", Counter, g(&self.prefix_reused_tokens)),
            ("prefix_cache_checkpoint_hits", "Of the prefix cache hits, slots with recurrent state (Qwen3-Next) rewound to their prefix checkpoint", Counter, g(&self.prefix_checkpoint_hits)),
            ("prefix_cache_prompt_tokens", "Prompt tokens of every sequence admitted into a slot (reused or prefilled)", Counter, g(&self.prefix_prompt_tokens)),
            ("tokens_per_second", "Recent decode throughput over all slots", Gauge, Value::Float(self.tokens_per_s())),
            ("expert_cache_hits", "Expert cache hits reported by the engine", Counter, g(&self.expert_hits)),
            ("expert_cache_misses", "Expert cache misses copied into the cache (streamed) reported by the engine", Counter, g(&self.expert_misses)),
            ("expert_cache_misses_cpu", "Expert cache misses computed on the host CPU instead of streamed (the hybrid path)", Counter, g(&self.expert_misses_cpu)),
            ("expert_bytes_streamed", "Bytes of expert weights copied host to device for expert cache misses", Counter, g(&self.expert_bytes_streamed)),
            ("spec_steps", "MTP speculative decoding steps", Counter, g(&self.spec_steps)),
            ("spec_draft_tokens", "Tokens drafted by the MTP block", Counter, g(&self.spec_drafted)),
            ("spec_accepted_tokens", "Drafted tokens the model accepted", Counter, g(&self.spec_accepted)),
        ]
    }

    /// OpenMetrics text exposition of every metric (ends with `# EOF`).
    pub fn prometheus(&self) -> String {
        let mut r = Registry::with_prefix("strata");
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
            r.register(name, help, h.0.clone());
        }
        r.register_collector(Box::new(Snapshot {
            scalars: self.scalars(),
            kv_cells: self.slots().iter().map(|s| (s.id, s.kv_cells)).collect(),
        }));
        let mut o = String::with_capacity(4096);
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut o, &r);
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
        // OpenMetrics from the prometheus-client encoder: counters typed under their name
        // without `_total`, the exposition closed by `# EOF`.
        assert!(t.contains("# TYPE strata_requests counter\n"), "{t}");
        assert!(t.ends_with("# EOF\n"), "{t}");
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
