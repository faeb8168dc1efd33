//! `strata-exec PLAN --serve`: the OpenAI-compatible server over the plan's engine.
//! Invariant: every flag, the plan and the paths are checked before binding (bad input exits
//! 1 before the port is taken); the server binds before the model loads, so `/health`
//! answers 503 while the loader runs; exit 0 after SIGINT/SIGTERM, 1 on a bind or load
//! failure.

use super::run::RunArgs;
use super::{fail, open_plan, try_start_engine};
use std::time::Duration;
use strata_exec::serve::conn::ConnLimits;
use strata_exec::serve::defaults::SamplingDefaults;
use strata_exec::serve::reasoning::ReasoningFormat;
use strata_exec::serve::reqlog::LogFormat;
use strata_exec::serve::scheduler::PrefixCache;
use strata_exec::serve::template::TemplateLimits;
use strata_exec::serve::{serve_with_loader_blocking, ServeOptions};
use strata_exec::tokenizer::Tokenizer;

/// Flags of `--serve` (flattened into the run command's arguments).
#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "Server (with --serve)")]
pub struct ServeArgs {
    /// Serve an OpenAI-compatible HTTP API over the plan's slots instead of generating once:
    /// /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics, /slots,
    /// /tokenize, /detokenize. Each planned slot runs one request; more wait in a queue.
    #[arg(long)]
    pub serve: bool,
    /// Address to listen on. The default answers only this machine; 0.0.0.0 answers every
    /// interface (set --api-key then).
    #[arg(long, default_value = "127.0.0.1", requires = "serve")]
    pub host: String,
    /// TCP port to listen on; 0 picks a free one (the chosen address is printed).
    #[arg(long, default_value_t = 8080, requires = "serve")]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every route but /health (401 otherwise).
    /// A key on the command line shows in the process list; the STRATA_API_KEY environment
    /// variable does not (this flag wins when both are given).
    #[arg(long, value_name = "KEY", requires = "serve")]
    pub api_key: Option<String>,
    /// Requests that may wait for a free slot; beyond that the server answers 503 with
    /// Retry-After.
    #[arg(long, value_name = "N", default_value_t = 64, requires = "serve",
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub queue: u64,
    /// Largest request body accepted, in bytes (413 beyond).
    #[arg(long, value_name = "BYTES", default_value_t = 4 << 20, requires = "serve",
          value_parser = clap::value_parser!(u64).range(1024..=1 << 30))]
    pub max_body: u64,
    /// Model ids shown on /v1/models and accepted in requests' `model` field (requests that
    /// name another model get 404); the first is the one answers carry. Several names make
    /// aliases (`--served-model-name qwen3,gpt-4o` or the flag repeated); default: the
    /// plan's model name.
    #[arg(long, visible_alias = "served-model-name", value_name = "NAME",
          action = clap::ArgAction::Append, value_delimiter = ',', requires = "serve")]
    pub model_name: Vec<String>,
    /// Seconds running requests may go on after SIGINT/SIGTERM before they are cancelled.
    #[arg(long, value_name = "SECS", default_value_t = 10.0, requires = "serve")]
    pub shutdown_grace: f64,
    /// Seconds a client has to send a whole request head, counted from when its connection
    /// opens or from its previous response: a slow sender and an idle keep-alive
    /// connection are both closed after it.
    #[arg(long, value_name = "SECS", default_value_t = 15.0, requires = "serve")]
    pub header_timeout: f64,
    /// Seconds a request body may take to arrive once its head is in (408 beyond, e.g. a
    /// Content-Length larger than the body sent).
    #[arg(long, value_name = "SECS", default_value_t = 30.0, requires = "serve")]
    pub body_timeout: f64,
    /// Browser origins allowed to call the API (CORS, with preflight `OPTIONS`), e.g.
    /// `--allowed-origins http://localhost:3000,https://app.example` (or the flag repeated);
    /// `*` allows any. Default: none (no CORS headers, so browsers on other origins are
    /// refused).
    #[arg(long, value_name = "ORIGIN", action = clap::ArgAction::Append, value_delimiter = ',',
          requires = "serve")]
    pub allowed_origins: Vec<String>,
    /// `temperature` for requests that leave it out (over the model folder's
    /// generation_config.json, over OpenAI's 1). (`--temperature` is one-off generation's.)
    #[arg(long, value_name = "T", requires = "serve")]
    pub default_temperature: Option<f64>,
    /// `top_p` for requests that leave it out (as --default-temperature).
    #[arg(long, value_name = "P", requires = "serve")]
    pub default_top_p: Option<f64>,
    /// `top_k` for requests that leave it out (as --default-temperature; 0 = no cut).
    #[arg(long, value_name = "K", requires = "serve")]
    pub default_top_k: Option<u32>,
    /// Default `min_p` (as --default-temperature; 0 = off).
    #[arg(long, value_name = "P", requires = "serve")]
    pub min_p: Option<f64>,
    /// Default `repetition_penalty` (as --default-temperature; 1 = off).
    #[arg(long, value_name = "R", requires = "serve")]
    pub repeat_penalty: Option<f64>,
    /// Open connections at most; more get an immediate 503 and are closed. Keep it under
    /// the open-file limit (`ulimit -n`).
    #[arg(long, value_name = "N", default_value_t = 512, requires = "serve",
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub max_connections: u64,
    /// Open connections from one client address at most (a reverse proxy on this machine
    /// counts as one client: raise it there), so one client cannot hold them all.
    #[arg(long, value_name = "N", default_value_t = 128, requires = "serve",
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub max_connections_per_client: u64,
    /// Instructions one chat-template render may run (the model's template is a program;
    /// a request whose render needs more gets 400).
    #[arg(long, value_name = "N", default_value_t = 20_000_000, requires = "serve",
          value_parser = clap::value_parser!(u64).range(1000..))]
    pub template_fuel: u64,
    /// Bytes one chat-template render may produce (400 beyond).
    #[arg(long, value_name = "BYTES", default_value_t = 8 << 20, requires = "serve",
          value_parser = clap::value_parser!(u64).range(1024..=1 << 32))]
    pub template_max_bytes: u64,
    /// Seconds one chat-template render may take (400 beyond; two renders at most run at
    /// once, so a template that is slow on some input cannot take every core).
    #[arg(long, value_name = "SECS", default_value_t = 10.0, requires = "serve")]
    pub template_timeout: f64,
    /// The request log on stderr, one line per finished request: `text` or `json` (one
    /// object per line). `RUST_LOG` sets its level: `info` (default), `warn` (failed requests
    /// only), `off`.
    #[arg(
        long,
        value_enum,
        value_name = "FORMAT",
        default_value = "text",
        requires = "serve"
    )]
    pub log_format: LogFormatArg,
    /// Prefill every prompt whole: do not keep a slot's context after its request for the
    /// next request that starts with the same tokens (the prefix cache, on by default; a
    /// request can also skip it with `"cache_prompt": false`).
    #[arg(long, requires = "serve")]
    pub no_prefix_cache: bool,
    /// Fewest matching prompt tokens the prefix cache reuses (shorter matches are
    /// prefilled anew).
    #[arg(long, value_name = "N", default_value_t = 1, requires = "serve",
          value_parser = clap::value_parser!(u64).range(1..=1 << 32))]
    pub prefix_cache_min: u64,
    /// Chat output's `<think>...</think>` blocks: `auto` (into `reasoning_content` when the
    /// model's chat template mentions `<think>`), `deepseek` (always split), `none` (left in
    /// `content`). A request's `reasoning_format` overrides it.
    #[arg(
        long,
        value_enum,
        value_name = "FORMAT",
        default_value = "auto",
        requires = "serve"
    )]
    pub reasoning_format: ReasoningFormatArg,
}

/// `--reasoning-format`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningFormatArg {
    Auto,
    Deepseek,
    None,
}

/// `--log-format`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormatArg {
    Text,
    Json,
}

impl From<LogFormatArg> for LogFormat {
    fn from(f: LogFormatArg) -> Self {
        match f {
            LogFormatArg::Text => LogFormat::Text,
            LogFormatArg::Json => LogFormat::Json,
        }
    }
}

/// `secs` as a duration for `flag`, or an error naming the flag and the range.
/// OpenAI's defaults, then the model folder's generation_config.json, then the flags
/// (each checked against the range a request may give).
fn sampling_defaults(s: &ServeArgs, model: &std::path::Path) -> SamplingDefaults {
    let mut d = SamplingDefaults::default().for_model(model);
    let check = |flag: &str, x: f64, lo: f64, hi: f64| -> f64 {
        if !(x.is_finite() && (lo..=hi).contains(&x)) {
            fail(format!("--{flag} {x}: give a value from {lo} to {hi}"));
        }
        x
    };
    if let Some(x) = s.default_temperature {
        d.temperature = check("default-temperature", x, 0.0, 2.0);
    }
    if let Some(x) = s.default_top_p {
        d.top_p = check("default-top-p", x, 1e-9, 1.0);
    }
    if let Some(k) = s.default_top_k {
        d.top_k = k as usize;
    }
    if let Some(x) = s.min_p {
        d.min_p = check("min-p", x, 0.0, 1.0);
    }
    if let Some(x) = s.repeat_penalty {
        d.repetition_penalty = check("repeat-penalty", x, 1e-9, 10.0);
    }
    d
}

fn seconds(flag: &str, secs: f64, max: f64) -> Duration {
    if !(secs.is_finite() && secs > 0.0 && secs <= max) {
        fail(format!(
            "--{flag} {secs}: give seconds above 0 and at most {max}"
        ));
    }
    Duration::from_secs_f64(secs)
}

pub fn main(args: RunArgs) -> ! {
    let plan_path = args
        .plan
        .clone()
        .unwrap_or_else(|| fail("give a plan file: strata-exec PLAN --serve"));
    if args.prompt.is_some() || args.prompt_tokens.is_some() || args.logits {
        fail("--prompt, --prompt-tokens and --logits are for one-off generation; with --serve the prompts come in HTTP requests");
    }
    let s = &args.serve;
    if !(s.shutdown_grace.is_finite() && (0.0..=3600.0).contains(&s.shutdown_grace)) {
        fail(format!(
            "--shutdown-grace {}: give seconds from 0 to 3600",
            s.shutdown_grace
        ));
    }
    let env_key = std::env::var("STRATA_API_KEY").ok();
    let key = api_key(s.api_key.as_deref(), env_key.as_deref()).unwrap_or_else(|e| fail(e));
    if key.is_none() && !is_loopback(&s.host) {
        eprintln!(
            "strata-exec serve: warning: listening on {} without an API key: anyone who can reach this address can use the model; set STRATA_API_KEY (or --api-key)",
            s.host
        );
    }
    let (plan, model) = open_plan(&plan_path, &args.common);
    if !model.exists() {
        fail(format!(
            "the plan's model `{}` does not exist: pass --model PATH",
            model.display()
        ));
    }
    // --tokenizer (shared with one-off generation): a tokenizer.json or a folder with one
    // (and tokenizer_config.json for the chat template); default: the model's own. Without
    // any, only token-id prompts on /v1/completions are served.
    if let Some(t) = &args.tokenizer {
        if !t.exists() {
            fail(format!(
                "--tokenizer {}: no such file or folder",
                t.display()
            ));
        }
    }
    let conn = ConnLimits {
        header_timeout: seconds("header-timeout", s.header_timeout, 3600.0),
        max_connections: s.max_connections as usize,
        max_per_client: s.max_connections_per_client.min(s.max_connections) as usize,
    };
    if let Some(limit) = open_file_limit() {
        if s.max_connections + 64 > limit {
            eprintln!(
                "strata-exec serve: warning: --max-connections {} is close to the open-file limit {limit} (`ulimit -n`); raise the limit or lower --max-connections",
                s.max_connections
            );
        }
    }
    for o in &s.allowed_origins {
        if o != "*" && axum::http::HeaderValue::from_str(o).is_err() {
            fail(format!(
                "--allowed-origins {o:?}: give origins like http://localhost:3000, or * for any"
            ));
        }
    }
    let opts = ServeOptions {
        host: s.host.clone(),
        port: s.port,
        api_key: key,
        queue: s.queue as usize,
        max_body_bytes: s.max_body as usize,
        shutdown_grace: Duration::from_secs_f64(s.shutdown_grace),
        model_name: s.model_name.first().cloned(),
        model_aliases: s.model_name.iter().skip(1).cloned().collect(),
        conn,
        body_timeout: seconds("body-timeout", s.body_timeout, 3600.0),
        allowed_origins: s.allowed_origins.clone(),
        sampling_defaults: sampling_defaults(s, &model),
        template: TemplateLimits {
            fuel: s.template_fuel,
            max_output_bytes: s.template_max_bytes as usize,
            max_time: seconds("template-timeout", s.template_timeout, 3600.0),
        },
        prefix_cache: PrefixCache {
            enabled: !s.no_prefix_cache,
            min_tokens: s.prefix_cache_min as usize,
        },
        reasoning_format: match s.reasoning_format {
            ReasoningFormatArg::Auto => ReasoningFormat::Auto,
            ReasoningFormatArg::Deepseek => ReasoningFormat::Deepseek,
            ReasoningFormatArg::None => ReasoningFormat::None,
        },
    };
    let tok_path = args.tokenizer.clone();
    let common = args.common.clone();
    let loader = Box::new(move || {
        // The tokenizer first: it is quick, and a broken one should not wait for the weights.
        let tok = match &tok_path {
            Some(p) => Some(Tokenizer::from_file(p).map_err(|e| format!("--tokenizer: {e}"))?),
            None => Tokenizer::for_model(&model).map_err(|e| e.to_string())?,
        };
        if tok.is_none() {
            eprintln!(
                "strata-exec serve: the model `{}` carries no tokenizer: only token-id prompts on /v1/completions are served (chat requests get 400); pass --tokenizer PATH for text",
                model.display()
            );
        }
        let engine = try_start_engine(&plan, &model, &common)?;
        Ok((engine, tok))
    });
    match serve_with_loader_blocking(loader, opts) {
        Ok(()) => std::process::exit(0),
        Err(e) => fail(e),
    }
}

/// The server's key: `--api-key`, else STRATA_API_KEY; neither means none. An empty (or
/// blank) key is an error, not "authentication off".
fn api_key(flag: Option<&str>, env: Option<&str>) -> Result<Option<String>, String> {
    match (flag, env) {
        (Some(k), _) if k.trim().is_empty() => Err(
            "--api-key is empty: give a key, or leave the flag out to serve without authentication".into(),
        ),
        (Some(k), _) => Ok(Some(k.to_owned())),
        (None, Some(k)) if k.trim().is_empty() => Err(
            "STRATA_API_KEY is set but empty: give it a key, or unset it to serve without authentication".into(),
        ),
        (None, k) => Ok(k.map(str::to_owned)),
    }
}

/// Whether `host` only answers this machine.
fn is_loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The soft limit on open files, from /proc/self/limits (Linux).
fn open_file_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::{api_key, is_loopback, open_file_limit};

    #[test]
    fn the_flag_wins_over_the_environment_and_empty_is_an_error() {
        assert_eq!(api_key(Some("a"), Some("b")).unwrap().as_deref(), Some("a"));
        assert_eq!(api_key(None, Some("b")).unwrap().as_deref(), Some("b"));
        assert_eq!(api_key(None, None).unwrap(), None);
        let e = api_key(Some(""), None).unwrap_err();
        assert!(e.contains("--api-key is empty"), "{e}");
        assert!(api_key(Some("  "), Some("b")).is_err());
        let e = api_key(None, Some("")).unwrap_err();
        assert!(e.contains("STRATA_API_KEY is set but empty"), "{e}");
    }

    #[test]
    fn loopback_hosts_are_recognised() {
        for h in [
            "127.0.0.1",
            "127.3.2.1",
            "::1",
            "[::1]",
            "localhost",
            "LOCALHOST",
        ] {
            assert!(is_loopback(h), "{h}");
        }
        for h in ["0.0.0.0", "::", "192.168.1.5", "example.com"] {
            assert!(!is_loopback(h), "{h}");
        }
    }

    #[test]
    fn the_open_file_limit_is_read_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(open_file_limit().is_some_and(|n| n > 0));
        }
    }
}
