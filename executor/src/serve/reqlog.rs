//! The server's request log: one line on stderr per finished generation request (id, model,
//! endpoint, status, prompt and completion tokens, time to first token, total time, finish
//! reason), as text or JSON (`--log-format`), filtered by a `RUST_LOG`-style level
//! (`info` by default; `RUST_LOG=warn` keeps only failed requests, `off` none).
//! Invariant: a line is one `write` of one line (never interleaved with another), the JSON
//! form is one valid JSON object per line, and logging never fails a request.

use serde_json::json;
use std::io::Write as _;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// `2026-01-02T03:04:05.678Z  INFO strata_exec::serve::request: key=value ...`
    #[default]
    Text,
    /// `{"timestamp": ..., "level": "INFO", "target": ..., "fields": {...}}`
    Json,
}

/// Log levels, most severe first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Off,
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

impl Level {
    fn parse(s: &str) -> Option<Self> {
        Some(match s.trim().to_ascii_lowercase().as_str() {
            "off" => Level::Off,
            "error" => Level::Error,
            "warn" | "warning" => Level::Warn,
            "info" => Level::Info,
            "debug" => Level::Debug,
            "trace" => Level::Trace,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            Level::Off => "OFF",
            Level::Error => "ERROR",
            Level::Warn => "WARN",
            Level::Info => "INFO",
            Level::Debug => "DEBUG",
            Level::Trace => "TRACE",
        }
    }
}

/// The target request lines are logged under.
pub const TARGET: &str = "strata_exec::serve::request";

/// The most verbose level logged for [`TARGET`], from a `RUST_LOG` value: comma-separated
/// directives `LEVEL` or `TARGET=LEVEL`; the longest target that prefixes ours wins over a
/// bare level; unknown levels are skipped. Empty or nothing that applies: `info`.
pub fn level_from(rust_log: Option<&str>) -> Level {
    let mut bare = None;
    let mut best: Option<(usize, Level)> = None;
    for d in rust_log.unwrap_or("").split(',').map(str::trim) {
        match d.split_once('=') {
            None => {
                if let Some(l) = Level::parse(d) {
                    bare = Some(l);
                }
            }
            Some((target, l)) => {
                let target = target.trim();
                let applies = TARGET == target
                    || TARGET
                        .strip_prefix(target)
                        .is_some_and(|rest| rest.starts_with("::"));
                if let (true, Some(l)) = (applies, Level::parse(l)) {
                    if best.is_none_or(|(n, _)| target.len() >= n) {
                        best = Some((target.len(), l));
                    }
                }
            }
        }
    }
    best.map(|(_, l)| l).or(bare).unwrap_or(Level::Info)
}

/// Where request lines go and which are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogConfig {
    pub format: LogFormat,
    pub level: Level,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: LogFormat::Text,
            level: Level::Info,
        }
    }
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
    pub fn level(&self) -> Level {
        if self.status >= 500 {
            Level::Warn
        } else {
            Level::Info
        }
    }

    /// The line (without its newline) in `format`, stamped `now`.
    pub fn line(&self, format: LogFormat, now: std::time::SystemTime) -> String {
        let ts = rfc3339(now);
        let ms = |x: f64| (x * 1000.0).round() / 1000.0;
        match format {
            LogFormat::Json => json!({
                "timestamp": ts,
                "level": self.level().name(),
                "target": TARGET,
                "fields": {
                    "message": "request finished",
                    "id": self.id, "endpoint": self.endpoint, "model": self.model,
                    "status": self.status, "prompt_tokens": self.prompt_tokens,
                    "completion_tokens": self.completion_tokens,
                    "ttft_ms": self.ttft_ms.map(ms), "total_ms": ms(self.total_ms),
                    "finish_reason": self.finish, "n": self.n, "stream": self.stream,
                    "error": self.error,
                },
            })
            .to_string(),
            LogFormat::Text => {
                let ttft = self
                    .ttft_ms
                    .map_or("-".to_string(), |t| format!("{:.1}", t));
                let mut s = format!(
                    "{ts} {:>5} {TARGET}: request finished id={} endpoint={} model={} status={} prompt_tokens={} completion_tokens={} ttft_ms={ttft} total_ms={:.1} finish_reason={} n={} stream={}",
                    self.level().name(),
                    self.id,
                    self.endpoint,
                    strata_schemas::text::for_terminal(&self.model),
                    self.status,
                    self.prompt_tokens,
                    self.completion_tokens,
                    self.total_ms,
                    self.finish,
                    self.n,
                    self.stream
                );
                if let Some(e) = &self.error {
                    s.push_str(&format!(
                        " error={:?}",
                        strata_schemas::text::for_terminal(e)
                    ));
                }
                s
            }
        }
    }
}

/// Write `r`'s line to stderr when `cfg` keeps its level.
pub fn log(cfg: &LogConfig, r: &RequestLog) {
    if r.level() > cfg.level {
        return;
    }
    let mut line = r.line(cfg.format, std::time::SystemTime::now());
    line.push('\n');
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// `now` as RFC 3339 UTC with milliseconds.
pub fn rfc3339(now: std::time::SystemTime) -> String {
    let d = now
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        d.subsec_millis()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn rust_log_directives_pick_the_level() {
        assert_eq!(level_from(None), Level::Info);
        assert_eq!(level_from(Some("")), Level::Info);
        assert_eq!(level_from(Some("warn")), Level::Warn);
        assert_eq!(level_from(Some("off")), Level::Off);
        assert_eq!(level_from(Some("error,strata_exec=debug")), Level::Debug);
        assert_eq!(
            level_from(Some("strata_exec=debug,strata_exec::serve=warn")),
            Level::Warn
        );
        assert_eq!(level_from(Some("hyper=trace")), Level::Info);
        assert_eq!(level_from(Some("strata_exec::serve::req=off")), Level::Info);
        assert_eq!(level_from(Some("bogus")), Level::Info);
    }

    #[test]
    fn lines_in_both_formats() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_millis(1_709_251_199_123);
        assert_eq!(rfc3339(t), "2024-02-29T23:59:59.123Z");
        let r = RequestLog {
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
        };
        let text = r.line(LogFormat::Text, t);
        assert!(text.starts_with("2024-02-29T23:59:59.123Z  INFO strata_exec::serve::request: request finished id=cmpl-1 "), "{text}");
        assert!(
            text.contains(" ttft_ms=1.3") && text.contains(" finish_reason=stop"),
            "{text}"
        );
        let v: serde_json::Value = serde_json::from_str(&r.line(LogFormat::Json, t)).unwrap();
        assert_eq!(v["level"], "INFO");
        assert_eq!(v["fields"]["completion_tokens"], 4);
        assert_eq!(v["fields"]["ttft_ms"], 1.26);
        let bad = RequestLog { status: 500, ..r };
        assert_eq!(bad.level(), Level::Warn);
    }
}
