//! The server's log through `tracing`: the subscriber (`tracing-subscriber`'s `fmt`, text or
//! JSON by `--log-format`, levels from `RUST_LOG` through its `EnvFilter`, `info` when unset)
//! and the request log, one event per finished generation request under [`TARGET`] (id,
//! model, endpoint, status, prompt and completion tokens, time to first token, total time,
//! finish reason). `RUST_LOG=warn` keeps only failed (5xx) requests, `off` none.
//! Invariant: a log line is one write of one line (the subscriber's), the JSON form is one
//! valid JSON object per line, and logging never fails a request.

use strata_schemas::text::for_terminal;
use tracing_subscriber::filter::{EnvFilter, LevelFilter};

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// `2026-01-02T03:04:05.678901Z  INFO strata_exec::serve::request: request finished key=value ...`
    #[default]
    Text,
    /// `{"timestamp": ..., "level": "INFO", "fields": {"message": ..., ...}, "target": ...}`
    Json,
}

/// The target request lines are logged under.
pub const TARGET: &str = "strata_exec::serve::request";

/// The `RUST_LOG` filter: its directives, or `info` for everything when unset (invalid
/// directives are skipped, as `tracing-subscriber` does).
pub fn filter_from(rust_log: Option<&str>) -> EnvFilter {
    EnvFilter::builder()
        .with_default_directive(LevelFilter::INFO.into())
        .parse_lossy(rust_log.unwrap_or(""))
}

/// Install the process's log subscriber on stderr: `format`, filtered by `RUST_LOG` (the
/// one environment variable read, as every `tracing` program does). Colours only on a
/// terminal. A second call keeps the first subscriber.
pub fn init(format: LogFormat) {
    let filter = filter_from(std::env::var("RUST_LOG").ok().as_deref());
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => b.with_ansi(ansi).try_init(),
        LogFormat::Json => b.json().with_ansi(false).try_init(),
    };
}

/// One finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestLog {
    /// The response id (`chatcmpl-...`), or `-` for a request refused before it had one.
    pub id: String,
    pub endpoint: &'static str,
    pub model: String,
    pub status: u16,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Arrival to the first token, when one came.
    pub ttft_ms: Option<f64>,
    pub total_ms: f64,
    /// `stop`/`length` per choice (comma-separated), `cancelled`, or `error`.
    pub finish: String,
    pub n: u64,
    pub stream: bool,
    /// The error message of a failed or refused request.
    pub error: Option<String>,
}

impl RequestLog {
    /// Failures the server should look at (5xx) are warnings; the rest info.
    pub fn level(&self) -> tracing::Level {
        if self.status >= 500 {
            tracing::Level::WARN
        } else {
            tracing::Level::INFO
        }
    }
}

/// Log `r` as one event under [`TARGET`] (times in milliseconds, rounded to microseconds).
pub fn log(r: &RequestLog) {
    let ms = |x: f64| (x * 1000.0).round() / 1000.0;
    let ttft = r.ttft_ms.map(ms);
    let error = r.error.as_deref().map(for_terminal);
    let model = for_terminal(&r.model);
    macro_rules! emit {
        ($lvl:ident) => {
            tracing::$lvl!(
                target: TARGET,
                id = %r.id,
                endpoint = %r.endpoint,
                model = %model,
                status = r.status,
                prompt_tokens = r.prompt_tokens,
                completion_tokens = r.completion_tokens,
                ttft_ms = ttft,
                total_ms = ms(r.total_ms),
                finish_reason = %r.finish,
                n = r.n,
                stream = r.stream,
                error = error.as_deref(),
                "request finished"
            )
        };
    }
    if r.level() == tracing::Level::WARN {
        emit!(warn);
    } else {
        emit!(info);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// A writer into a shared buffer, for a subscriber scoped to one test.
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn sample() -> RequestLog {
        RequestLog {
            id: "cmpl-1".into(),
            endpoint: "/v1/completions",
            model: "m".into(),
            status: 200,
            prompt_tokens: 6,
            completion_tokens: 4,
            ttft_ms: Some(1.26),
            total_ms: 9.5,
            finish: "stop".into(),
            n: 1,
            stream: false,
            error: None,
        }
    }

    /// What `r` logs with `format` under the `RUST_LOG` value `rust_log`.
    fn logged(format: LogFormat, rust_log: &str, r: &RequestLog) -> String {
        let buf = Buf::default();
        let w = buf.clone();
        let b = tracing_subscriber::fmt()
            .with_env_filter(filter_from(Some(rust_log)))
            .with_writer(move || w.clone())
            .with_ansi(false);
        match format {
            LogFormat::Text => tracing::subscriber::with_default(b.finish(), || log(r)),
            LogFormat::Json => tracing::subscriber::with_default(b.json().finish(), || log(r)),
        }
        let out = buf.0.lock().unwrap().clone();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn lines_in_both_formats() {
        let r = sample();
        let text = logged(LogFormat::Text, "", &r);
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(
            text.contains("Z  INFO strata_exec::serve::request: request finished id=cmpl-1 "),
            "{text}"
        );
        assert!(
            text.contains(" ttft_ms=1.26") && text.contains(" finish_reason=stop"),
            "{text}"
        );
        let v: serde_json::Value = serde_json::from_str(&logged(LogFormat::Json, "", &r)).unwrap();
        assert_eq!(v["level"], "INFO");
        assert_eq!(v["target"], TARGET);
        assert_eq!(v["fields"]["message"], "request finished");
        assert_eq!(v["fields"]["completion_tokens"], 4);
        assert_eq!(v["fields"]["ttft_ms"], 1.26);
        assert_eq!(v["fields"]["stream"], false);
        assert!(v["fields"].get("error").is_none(), "{v}");
        let bad = RequestLog {
            status: 500,
            error: Some("boom".into()),
            ..r
        };
        let v: serde_json::Value =
            serde_json::from_str(&logged(LogFormat::Json, "", &bad)).unwrap();
        assert_eq!(v["level"], "WARN");
        assert_eq!(v["fields"]["error"], "boom");
    }

    #[test]
    fn rust_log_directives_pick_what_is_logged() {
        let ok = sample();
        let bad = RequestLog {
            status: 503,
            ..sample()
        };
        assert!(
            !logged(LogFormat::Text, "", &ok).is_empty(),
            "info by default"
        );
        assert!(logged(LogFormat::Text, "warn", &ok).is_empty());
        assert!(!logged(LogFormat::Text, "warn", &bad).is_empty());
        assert!(logged(LogFormat::Text, "off", &bad).is_empty());
        assert!(!logged(LogFormat::Text, "error,strata_exec=debug", &ok).is_empty());
        assert!(logged(
            LogFormat::Text,
            "strata_exec=debug,strata_exec::serve=warn",
            &ok
        )
        .is_empty());
        // As everywhere with `tracing`: directives for other targets only leave ours off.
        assert!(logged(LogFormat::Text, "hyper=trace", &ok).is_empty());
        assert!(!logged(LogFormat::Text, "hyper=trace,info", &ok).is_empty());
    }
}
