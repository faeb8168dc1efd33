//! `strata-exec PLAN --serve`: an OpenAI-compatible HTTP server over the planned slots.
//! `conn` holds the accept loop (connection caps, header timeout), `http` the axum routes,
//! `scheduler` the continuous-batching thread that owns the `Engine`, `openai` the
//! request/response shapes, `template` the chat templates and `metrics` the shared counters.
//! Invariant: the server binds before the model loads (`/health` says 503 until ready), never
//! lets bad input take it down, and on SIGINT/SIGTERM stops accepting, ends running streams
//! within `ServeOptions::shutdown_grace` and returns `Ok(())`.

pub mod chat_out;
pub mod conn;
pub mod defaults;
pub mod http;
pub mod logit_proc;
pub mod logprobs;
pub mod metrics;
pub mod openai;
pub mod prefix;
pub mod reasoning;
pub mod reqlog;
pub mod scheduler;
pub mod script_engine;
pub mod stream;
pub mod structured;
pub mod template;
pub mod test_engine;
pub mod tools;

use crate::engine::{Engine, EngineInfo};
use crate::tokenizer::Tokenizer;
use metrics::{Ready, Shared};
pub use scheduler::Loader;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// How the server listens and what it accepts.
#[derive(Debug, Clone, PartialEq)]
pub struct ServeOptions {
    /// Address to bind; loopback by default.
    pub host: String,
    pub port: u16,
    /// When set, every route but `/health` needs `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Requests that may wait for a slot; more get 503 with `Retry-After`.
    pub queue: usize,
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    /// How long running requests may go on after SIGINT/SIGTERM before they are cancelled.
    pub shutdown_grace: Duration,
    /// Name served on `/v1/models` and accepted as `model`; default the engine's.
    pub model_name: Option<String>,
    /// More names accepted as `model` and listed on `/v1/models` (`--served-model-name A B`).
    pub model_aliases: Vec<String>,
    /// Sampling values for fields a request leaves out.
    pub sampling_defaults: defaults::SamplingDefaults,
    /// Origins allowed by CORS (`*` = any); empty = no CORS headers.
    pub allowed_origins: Vec<String>,
    /// Connection caps and the header-read timeout.
    pub conn: conn::ConnLimits,
    /// How long a request body may take to arrive (408 beyond).
    pub body_timeout: Duration,
    /// What one chat-template render may spend.
    pub template: template::TemplateLimits,
    /// How chat output's `<think>` blocks are returned (`--reasoning-format`).
    pub reasoning_format: reasoning::ReasoningFormat,
    /// Reuse of each slot's context by the next request (`--no-prefix-cache`).
    pub prefix_cache: scheduler::PrefixCache,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8080,
            api_key: None,
            queue: 64,
            max_body_bytes: 4 << 20,
            shutdown_grace: Duration::from_secs(10),
            model_name: None,
            model_aliases: Vec::new(),
            allowed_origins: Vec::new(),
            sampling_defaults: defaults::SamplingDefaults::default(),
            conn: conn::ConnLimits::default(),
            body_timeout: Duration::from_secs(30),
            template: template::TemplateLimits::default(),
            reasoning_format: reasoning::ReasoningFormat::default(),
            prefix_cache: scheduler::PrefixCache::default(),
        }
    }
}

/// Why the server could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(
        "cannot listen on {addr}: {source} (is another server on that port? pick one with --port)"
    )]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("the model failed to load: {0}")]
    Load(String),
    #[error("server I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// The tokenizer-derived part of readiness: chat template and end-of-sequence ids.
pub(crate) fn make_ready(
    info: &EngineInfo,
    tok: Option<Tokenizer>,
    limits: template::TemplateLimits,
) -> Result<Ready, String> {
    let mut eos: Vec<u32> = Vec::new();
    let mut template = None;
    if let Some(t) = &tok {
        eos.extend(
            t.eos_ids()
                .iter()
                .copied()
                .filter(|&i| (i as usize) < info.n_vocab),
        );
        if t.vocab_size() > info.n_vocab {
            eprintln!(
                "strata-exec serve: warning: the tokenizer `{}` has {} tokens but the model {}; prompts using the extra ids are refused",
                strata_schemas::text::name(t.source()),
                t.vocab_size(),
                info.n_vocab
            );
        }
        let src = match t.chat_template() {
            Some(s) => Some(s.to_string()),
            None if t.token_id("<|im_start|>").is_some() => Some(template::CHATML.to_string()),
            None => None,
        };
        if let Some(src) = src {
            let bos = t.bos_id().and_then(|i| t.token(i));
            let eos_tok = t.eos_ids().first().and_then(|&i| t.token(i));
            template = Some(
                template::ChatTemplate::new(&src, bos, eos_tok, t.special_tokens(), limits)
                    .map_err(|e| format!("tokenizer `{}`: {e}", t.source()))?,
            );
        }
    }
    let tokenizer = tok.map(Arc::new);
    // The grammar compiler for `response_format`; a tokenizer it cannot use only makes
    // structured-output requests fail (with this reason), not the server.
    let grammars = match &tokenizer {
        None => Err(structured::StructuredError::NoTokenizer),
        Some(t) => structured::Grammars::new(t.clone(), info.n_vocab, &eos).map(Arc::new),
    };
    Ok(Ready {
        info: info.clone(),
        tokenizer,
        template,
        eos: eos.into(),
        grammars,
    })
}

/// The one line printed when the server is ready: address, model, slots, context.
pub fn ready_line(addr: &str, model_name: Option<&str>, r: &Ready) -> String {
    let i = &r.info;
    let tok = match (&r.tokenizer, &r.template) {
        (Some(t), Some(_)) => format!("tokenizer `{}` with a chat template", t.source()),
        (Some(t), None) => format!(
            "tokenizer `{}` without a chat template (chat requests get 400)",
            t.source()
        ),
        (None, _) => "no tokenizer (token-id prompts on /v1/completions only)".to_string(),
    };
    format!(
        "strata-exec serve: ready on http://{addr}: model `{}`, {} slots, context {} tokens per slot, prefill chunk {}, {tok}",
        model_name.unwrap_or(&i.model_name),
        i.n_slots,
        i.max_context,
        i.ubatch
    )
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// Serve `engine` on `opts.host:opts.port` until SIGINT/SIGTERM.
pub async fn serve(
    engine: Box<dyn Engine>,
    tokenizer: Option<Tokenizer>,
    opts: ServeOptions,
) -> Result<(), ServeError> {
    serve_with_loader(Box::new(move || Ok((engine, tokenizer))), opts).await
}

/// Like [`serve`], but the engine is built by `loader` after the port is bound, so clients
/// see `/health` 503 while the model loads.
pub async fn serve_with_loader(loader: Loader, opts: ServeOptions) -> Result<(), ServeError> {
    let addr = format!("{}:{}", opts.host, opts.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|source| ServeError::Bind {
            addr: addr.clone(),
            source,
        })?;
    let shown = listener.local_addr().map(|a| a.to_string()).unwrap_or(addr);
    eprintln!("strata-exec serve: listening on http://{shown}");
    serve_on(listener, loader, opts, shutdown_signal()).await
}

/// Serve on an already bound listener until `shutdown` resolves (tests pass a channel).
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    loader: Loader,
    opts: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let shared = Shared::new();
    let shown = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| format!("{}:{}", opts.host, opts.port));
    let name = opts.model_name.clone();
    let banner: scheduler::ReadyHook = Box::new(move |r: &Ready| {
        eprintln!(
            "{}",
            strata_schemas::text::for_terminal(&ready_line(&shown, name.as_deref(), r))
        );
    });
    let (handle, thread) = scheduler::spawn(
        loader,
        shared.clone(),
        opts.queue,
        opts.template,
        opts.prefix_cache,
        banner,
    )?;
    let grace = opts.shutdown_grace;
    let limits = opts.conn;
    let app = http::router(shared.clone(), handle.clone(), Arc::new(opts));
    let (stopped_tx, stopped_rx) = tokio::sync::watch::channel(false);
    let h2 = handle.clone();
    let sh2 = shared.clone();
    let signal = async move {
        tokio::select! {
            _ = shutdown => {},
            _ = sh2.load_failed.notified() => {},
        }
        eprintln!("strata-exec serve: stopping (running requests get {grace:?})");
        h2.shutdown(grace);
        let _ = stopped_tx.send(true);
    };
    let server = conn::serve(listener, app, limits, signal);
    // Connections that outlive the grace period (a stuck client) do not hold the exit.
    let mut rx = stopped_rx;
    let hard_stop = async move {
        while !*rx.borrow() {
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        tokio::time::sleep(grace + Duration::from_secs(2)).await;
    };
    tokio::select! {
        _ = server => {},
        _ = hard_stop => eprintln!("strata-exec serve: connections still open after the grace period; closing"),
    }
    handle.shutdown(Duration::ZERO);
    // A signal while the model is still loading must not wait for the load (minutes for a
    // large model): the loader thread is left to die with the process.
    if shared.ready.get().is_some() || shared.load_error.get().is_some() {
        let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    }
    if let Some(e) = shared.load_error.get() {
        if shared.ready.get().is_none() {
            return Err(ServeError::Load(e.clone()));
        }
    }
    Ok(())
}

/// Run `fut` on a fresh multi-threaded tokio runtime; on return, work still running on the
/// runtime's blocking threads (a chat template still rendering) is not waited for.
fn block_on<T>(fut: impl Future<Output = Result<T, ServeError>>) -> Result<T, ServeError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let r = rt.block_on(fut);
    rt.shutdown_timeout(Duration::from_millis(200));
    r
}

/// [`serve`] on a fresh multi-threaded tokio runtime, for callers that are not async.
pub fn serve_blocking(
    engine: Box<dyn Engine>,
    tokenizer: Option<Tokenizer>,
    opts: ServeOptions,
) -> Result<(), ServeError> {
    block_on(serve(engine, tokenizer, opts))
}

/// [`serve_with_loader`] on a fresh multi-threaded tokio runtime.
pub fn serve_with_loader_blocking(loader: Loader, opts: ServeOptions) -> Result<(), ServeError> {
    block_on(serve_with_loader(loader, opts))
}
