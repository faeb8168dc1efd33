//! The axum routes: OpenAI endpoints (`/v1/models`, `/v1/completions`,
//! `/v1/chat/completions`, non-streaming and SSE), `/health`, `/metrics`, `/tokenize`,
//! `/detokenize`, `/slots`, plus API-key checking and JSON errors for every failure; `n`
//! choices (one scheduler job each) and their `logprobs`; chat output shaped into
//! reasoning, content and tool calls ([`super::chat_out`]).
//! Invariant: every response that is not a success is an OpenAI-style JSON error with a
//! 4xx/5xx status; a handler that is dropped (client gone) drops its event receiver, which
//! is how the scheduler learns to free the slot.

use super::chat_out::ShapeConfig;
use super::metrics::{Ready, Shared};
use super::openai::{self, ApiError, Finish, GenParams, Prompt, RespMeta, Usage};
use super::reqlog::{self, RequestLog};
use super::scheduler::{Event, Job, SchedulerHandle, SubmitError};
use super::stream::*;
use super::template::{RenderExtras, Segment};
use super::ServeOptions;
use crate::tokenizer::Tokenizer;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// Chat-template renders that may run at once: a render past its deadline keeps its
/// thread until it ends, so at most this many can burn CPU for a hostile template.
pub const RENDERS_AT_ONCE: usize = 2;

/// Everything a handler needs.
pub struct App {
    pub shared: Arc<Shared>,
    pub sched: SchedulerHandle,
    pub opts: Arc<ServeOptions>,
    next_id: AtomicU64,
    /// Unique to this server process (start time and pid), so ids never repeat across
    /// restarts.
    id_prefix: String,
    /// When the server started (`created` of `/v1/models`).
    started: u64,
    renders: Arc<tokio::sync::Semaphore>,
}

type AppState = State<Arc<App>>;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut r = (status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

/// The routes, with the API-key check.
pub fn router(shared: Arc<Shared>, sched: SchedulerHandle, opts: Arc<ServeOptions>) -> Router {
    let app = Arc::new(App {
        shared,
        sched,
        opts,
        next_id: AtomicU64::new(1),
        id_prefix: id_prefix(),
        started: now_secs(),
        renders: Arc::new(tokio::sync::Semaphore::new(RENDERS_AT_ONCE)),
    });
    let cors = cors_layer(&app.opts.allowed_origins);
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/slots", get(slots))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model_by_id))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(app.clone(), auth))
        // Outside the key check: a browser's preflight carries no Authorization header.
        .layer(
            tower_http::cors::CorsLayer::new()
                .allow_origin(cors.0)
                .allow_methods(cors.1)
                .allow_headers(cors.2),
        )
        .with_state(app)
}

/// The CORS policy of `--allowed-origins`: none (no origin matches) when empty, any for `*`,
/// else the listed origins (the ones that are not valid header values are dropped; the CLI
/// checks them first).
fn cors_layer(
    origins: &[String],
) -> (
    tower_http::cors::AllowOrigin,
    tower_http::cors::AllowMethods,
    tower_http::cors::AllowHeaders,
) {
    use tower_http::cors::{AllowHeaders, AllowMethods, AllowOrigin, Any};
    let methods = AllowMethods::list([
        axum::http::Method::GET,
        axum::http::Method::POST,
        axum::http::Method::OPTIONS,
    ]);
    let headers = AllowHeaders::list([header::AUTHORIZATION, header::CONTENT_TYPE]);
    if origins.iter().any(|o| o == "*") {
        return (AllowOrigin::from(Any), methods, AllowHeaders::from(Any));
    }
    let list: Vec<HeaderValue> = origins
        .iter()
        .filter_map(|o| HeaderValue::from_str(o).ok())
        .collect();
    (AllowOrigin::list(list), methods, headers)
}

async fn not_found(req: Request) -> ApiError {
    ApiError::new(
        404,
        "invalid_request_error",
        Some("not_found"),
        format!(
            "no route {} {}; see /v1/models, /v1/completions, /v1/chat/completions",
            req.method(),
            req.uri().path()
        ),
    )
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        405,
        "invalid_request_error",
        Some("method_not_allowed"),
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
}

/// Constant-time comparison, so a wrong key's timing says nothing about the right one.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn auth(State(app): AppState, req: Request, next: Next) -> Response {
    if let Some(key) = &app.opts.api_key {
        if req.uri().path() != "/health" {
            let given = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .or_else(|| req.headers().get("x-api-key").and_then(|v| v.to_str().ok()));
            let ok = given.is_some_and(|g| same(g.trim().as_bytes(), key.as_bytes()));
            if !ok {
                let msg = if given.is_some() {
                    "the API key is wrong"
                } else {
                    "an API key is required: send `Authorization: Bearer KEY`"
                };
                return ApiError::new(401, "authentication_error", Some("invalid_api_key"), msg)
                    .into_response();
            }
        }
    }
    next.run(req).await
}

pub(super) fn ready(app: &App) -> Result<&Ready, ApiError> {
    if let Some(r) = app.shared.ready.get() {
        return Ok(r);
    }
    Err(match app.shared.load_error.get() {
        Some(e) => ApiError::new(
            503,
            "server_error",
            Some("model_load_failed"),
            format!("the model failed to load: {e}"),
        ),
        None => ApiError::new(
            503,
            "server_error",
            Some("model_loading"),
            "the model is still loading; retry shortly",
        )
        .with_retry_after(1),
    })
}

pub(super) fn model_name<'a>(app: &'a App, r: &'a Ready) -> &'a str {
    app.opts.model_name.as_deref().unwrap_or(&r.info.model_name)
}

fn too_large(limit: usize, declared: Option<u64>) -> ApiError {
    let what = match declared {
        Some(n) => format!("the request declares a {n}-byte body"),
        None => "the body sent went past that".to_string(),
    };
    ApiError::new(
        413,
        "invalid_request_error",
        Some("body_too_large"),
        format!("the request body is larger than this server accepts ({limit} bytes, --max-body): {what}"),
    )
}

/// The request body, refused early (413) when its Content-Length is over `--max-body`, and
/// 408 when it does not arrive within `--body-timeout`.
async fn read_body(app: &App, req: Request) -> Result<Bytes, ApiError> {
    let limit = app.opts.max_body_bytes;
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large(limit, declared));
    }
    let timeout = app.opts.body_timeout;
    match tokio::time::timeout(timeout, axum::body::to_bytes(req.into_body(), limit)).await {
        Err(_) => Err(ApiError::new(
            408,
            "invalid_request_error",
            Some("body_timeout"),
            format!(
                "the request body did not arrive within {} s (--body-timeout){}",
                timeout.as_secs_f64(),
                declared.map_or(String::new(), |n| format!(
                    "; the request declared {n} bytes: send all of them"
                ))
            ),
        )),
        Ok(Ok(b)) => Ok(b),
        Ok(Err(e)) => {
            let inner = e.into_inner();
            if inner
                .downcast_ref::<http_body_util::LengthLimitError>()
                .is_some()
            {
                Err(too_large(limit, None))
            } else {
                Err(ApiError::new(
                    400,
                    "invalid_request_error",
                    Some("invalid_body"),
                    format!("cannot read the request body: {inner}"),
                ))
            }
        }
    }
}

async fn health(State(app): AppState) -> Response {
    if app.shared.ready.get().is_some() {
        return Json(json!({"status": "ok"})).into_response();
    }
    let (status, err) = match app.shared.load_error.get() {
        Some(e) => ("error", e.as_str()),
        None => ("loading", "the model is still loading"),
    };
    let mut r = (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({"status": status, "error": {"message": err, "type": "server_error", "code": status}})),
    )
        .into_response();
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(1u32));
    r
}

async fn metrics(State(app): AppState) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        app.shared.prometheus(),
    )
        .into_response()
}

async fn slots(State(app): AppState) -> Response {
    Json(app.shared.slots()).into_response()
}

/// Every served name (the first is the primary one).
fn served_names<'a>(app: &'a App, r: &'a Ready) -> impl Iterator<Item = &'a str> {
    std::iter::once(model_name(app, r)).chain(app.opts.model_aliases.iter().map(String::as_str))
}

fn model_card(app: &App, r: &Ready, id: &str) -> Value {
    json!({
        "id": id, "object": "model", "created": app.started, "owned_by": "strata",
        "meta": {"n_slots": r.info.n_slots, "max_context": r.info.max_context,
                 "ubatch": r.info.ubatch, "n_vocab": r.info.n_vocab},
    })
}

async fn models(State(app): AppState) -> Result<Response, ApiError> {
    let r = ready(&app)?;
    let data: Vec<Value> = served_names(&app, r)
        .map(|n| model_card(&app, r, n))
        .collect();
    Ok(Json(json!({"object": "list", "data": data})).into_response())
}

/// `/v1/models/{id}` (the SDK's `models.retrieve`): the card of a served name, else 404.
async fn model_by_id(
    State(app): AppState,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Response, ApiError> {
    let r = ready(&app)?;
    check_model(&app, r, &Some(id.clone()))?;
    Ok(Json(model_card(&app, r, &id)).into_response())
}

fn tokenizer_of(r: &Ready) -> Result<&Arc<Tokenizer>, ApiError> {
    r.tokenizer.as_ref().ok_or_else(|| {
        ApiError::param(
            "no_tokenizer",
            "this server was started without a tokenizer: send token ids (completions with an array `prompt`)",
        )
    })
}

async fn tokenize(State(app): AppState, req: Request) -> Result<Response, ApiError> {
    let body = read_body(&app, req).await?;
    let r = ready(&app)?;
    let m = openai::parse_object(&body)?;
    let text = match m.get("content") {
        Some(Value::String(s)) => s,
        Some(_) => {
            return Err(ApiError::param(
                "invalid_type",
                "`content` must be a string",
            ))
        }
        None => {
            return Err(ApiError::param(
                "missing_parameter",
                "`content` is required",
            ))
        }
    };
    let add_special = match m.get("add_special") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::param(
                "invalid_type",
                "`add_special` must be a boolean",
            ))
        }
    };
    let ids = tokenizer_of(r)?
        .encode(text, add_special)
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    Ok(Json(json!({"tokens": ids})).into_response())
}

async fn detokenize(State(app): AppState, req: Request) -> Result<Response, ApiError> {
    let body = read_body(&app, req).await?;
    let r = ready(&app)?;
    let m = openai::parse_object(&body)?;
    let t = tokenizer_of(r)?;
    let ids: Vec<u32> = match m.get("tokens") {
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_u64()
                    .filter(|&x| x < t.vocab_size() as u64)
                    .map(|x| x as u32)
                    .ok_or_else(|| {
                        ApiError::param(
                            "invalid_value",
                            format!(
                                "`tokens[{i}]` must be a token id below {}, got {v}",
                                t.vocab_size()
                            ),
                        )
                    })
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::param(
                "invalid_type",
                "`tokens` must be an array of token ids",
            ))
        }
        None => return Err(ApiError::param("missing_parameter", "`tokens` is required")),
    };
    let text = t
        .decode(&ids, false)
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    Ok(Json(json!({"content": text})).into_response())
}

fn check_model(app: &App, r: &Ready, asked: &Option<String>) -> Result<(), ApiError> {
    match asked {
        Some(m) if m != model_name(app, r) && !app.opts.model_aliases.contains(m) => {
            Err(ApiError::new(
                404,
                "invalid_request_error",
                Some("model_not_found"),
                format!(
                    "the model `{m}` does not exist here; this server serves `{}`",
                    model_name(app, r)
                ),
            ))
        }
        _ => Ok(()),
    }
}

/// Checked prompt and limits, queued on the scheduler as `n` sequences.
pub(super) struct Started {
    /// Every sequence's events, tagged with its choice index.
    pub(super) rx: UnboundedReceiver<(usize, Event)>,
    /// Per choice: set when a stop string ended it (the scheduler then frees its slot).
    pub(super) ended_by_stop: Vec<Arc<AtomicBool>>,
    pub(super) prompt_tokens: u64,
    pub(super) id: u64,
    /// When the request arrived (its log's times count from here).
    pub(super) arrived: Instant,
}

fn start(
    app: &App,
    r: &Ready,
    prompt: Vec<u32>,
    gen: &GenParams,
    arrived: Instant,
) -> Result<Started, ApiError> {
    let ctx = r.info.max_context;
    if prompt.is_empty() {
        return Err(ApiError::param(
            "invalid_value",
            "the prompt is empty: it must hold at least one token",
        ));
    }
    if let Some((i, t)) = prompt
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= r.info.n_vocab)
    {
        return Err(ApiError::param(
            "invalid_value",
            format!(
                "prompt token {i} is id {t}, outside the model's vocabulary of {}",
                r.info.n_vocab
            ),
        ));
    }
    if let Some((t, _)) = gen
        .proc
        .logit_bias
        .iter()
        .find(|(t, _)| *t as usize >= r.info.n_vocab)
    {
        return Err(ApiError::param(
            "invalid_value",
            format!(
                "`logit_bias` names token id {t}, outside the model's vocabulary of {}",
                r.info.n_vocab
            ),
        ));
    }
    let p = prompt.len() as u64;
    if p >= ctx {
        return Err(ApiError::param(
            "context_length_exceeded",
            format!("the prompt has {p} tokens but the planned context is {ctx} tokens (room for at least one generated token is needed); shorten the prompt"),
        ));
    }
    let max_tokens = match gen.max_tokens {
        Some(m) if p.saturating_add(m) > ctx => {
            return Err(ApiError::param(
                "context_length_exceeded",
                format!(
                    "the prompt has {p} tokens and max_tokens is {m}: {} exceeds the planned context of {ctx} tokens; lower max_tokens to at most {}",
                    p.saturating_add(m),
                    ctx - p
                ),
            ))
        }
        Some(m) => m,
        None => ctx - p,
    };
    let slots = r.info.n_slots as u64;
    if gen.n > slots {
        return Err(ApiError::param(
            "invalid_value",
            format!(
                "`n` is {} but this server runs at most {slots} sequences at once (the plan's slots), so `n` may be at most {slots}; lower `n`, or serve a plan made with more `--batch` slots",
                gen.n
            ),
        ));
    }
    // Compiled before anything is queued, so a schema llguidance rejects is a 400.
    let constraint = match &gen.response_format {
        None => None,
        Some(f) => {
            let g = r.grammars.as_ref().map_err(|e| ApiError::from(e.clone()))?;
            Some(g.compile(f).map_err(ApiError::from)?)
        }
    };
    let (tx, rx) = unbounded_channel();
    let id = app.next_id.fetch_add(1, Relaxed);
    let mut ended_by_stop = Vec::with_capacity(gen.n as usize);
    let mut jobs = Vec::with_capacity(gen.n as usize);
    for index in 0..gen.n as usize {
        let flag = Arc::new(AtomicBool::new(false));
        // Each choice its own stream of draws: seed, seed+1, ...; the prompt is prefilled
        // once and its context copied into the other choices' slots (the scheduler's
        // followers), or prefilled into each where the engine cannot copy.
        let mut sampling = gen.sampling;
        sampling.seed = sampling.seed.wrapping_add(index as u64);
        let job = Job {
            id,
            index,
            prompt: prompt.clone(),
            max_tokens,
            sampling,
            proc: gen.proc.clone(),
            logprobs: gen.logprobs,
            eos: if gen.ignore_eos {
                Arc::from([])
            } else {
                r.eos.clone()
            },
            events: tx.clone(),
            arrived,
            ended_by_stop: flag.clone(),
            cache_prompt: gen.cache_prompt,
            constraint: constraint.as_ref().map(|c| Box::new(c.fork())),
        };
        jobs.push(job);
        ended_by_stop.push(flag);
    }
    // One queue entry for the whole request, so its choices are admitted together.
    submit_error(app, r, app.sched.submit_group(jobs))?;
    Ok(Started {
        rx,
        ended_by_stop,
        prompt_tokens: p,
        id,
        arrived,
    })
}

fn submit_error(app: &App, r: &Ready, res: Result<(), SubmitError>) -> Result<(), ApiError> {
    match res {
        Ok(()) => Ok(()),
        Err(SubmitError::QueueFull) => Err(ApiError::new(
            503,
            "server_error",
            Some("queue_full"),
            format!(
                "all {} slots are busy and {} requests are waiting; retry later",
                r.info.n_slots, app.opts.queue
            ),
        )
        .with_retry_after(1)),
        Err(SubmitError::ShuttingDown) => Err(ApiError::new(
            503,
            "server_error",
            Some("shutting_down"),
            "the server is shutting down",
        )),
    }
}

/// Hex of this process's start time in nanoseconds and its pid.
pub(super) fn id_prefix() -> String {
    let ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    format!("{ns:x}{:x}", std::process::id())
}

pub(super) fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Milliseconds of `d`.
pub(super) fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The finish reasons of the choices, comma-separated (`stop`, `length`).
pub(super) fn finish_reasons(outs: &[ChoiceOut]) -> String {
    let v: Vec<&str> = outs
        .iter()
        .map(|o| o.finish.map_or("cancelled", Finish::as_str))
        .collect();
    v.join(",")
}

pub(super) fn endpoint(chat: bool) -> &'static str {
    if chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    }
}

/// Respond to a started request, streaming or not.
async fn respond(
    app: &Arc<App>,
    r: &Ready,
    mut s: Started,
    gen: GenParams,
    chat: bool,
    shape: Option<ShapeConfig>,
) -> Result<Response, ApiError> {
    let meta = RespMeta {
        id: format!(
            "{}-{}-{}",
            if chat { "chatcmpl" } else { "cmpl" },
            app.id_prefix,
            s.id
        ),
        created: now_secs(),
        model: model_name(app, r).to_string(),
    };
    let mut log = RequestLog {
        id: meta.id.clone(),
        endpoint: endpoint(chat),
        model: meta.model.clone(),
        status: 200,
        prompt_tokens: s.prompt_tokens,
        completion_tokens: 0,
        ttft_ms: None,
        total_ms: 0.0,
        finish: String::new(),
        n: gen.n,
        stream: gen.stream,
        error: None,
    };
    let mut outs: Vec<ChoiceOut> = (0..gen.n)
        .map(|_| ChoiceOut::new(r.tokenizer.clone(), &gen, shape))
        .collect();
    if !gen.stream {
        let mut first = None;
        let res = collect(&mut s, &mut outs, &mut first, chat).await;
        log.completion_tokens = outs.iter().map(|o| o.tokens).sum();
        log.ttft_ms = first.map(|t| ms(t - s.arrived));
        log.total_ms = ms(s.arrived.elapsed());
        match &res {
            Ok(_) => log.finish = finish_reasons(&outs),
            Err(e) => {
                log.status = e.status;
                log.finish = "error".into();
                log.error = Some(e.message.clone());
            }
        }
        reqlog::log(&log);
        let (choices, usage) = res?;
        let body = if chat {
            openai::chat_body(&meta, &choices, usage)
        } else {
            openai::completion_body(&meta, &choices, usage)
        };
        return Ok(Json(body).into_response());
    }
    let mut queue = std::collections::VecDeque::new();
    if chat {
        for i in 0..outs.len() {
            let v = openai::chat_chunk(
                &meta,
                i,
                json!({"role": "assistant", "content": ""}),
                None,
                None,
            );
            queue.push_back(SseEvent::default().data(v.to_string()));
        }
    }
    let st = StreamState {
        usage: Usage {
            prompt: s.prompt_tokens,
            completion: 0,
        },
        rx: Some(s.rx),
        ended_by_stop: s.ended_by_stop,
        left: outs.len(),
        outs,
        meta,
        chat,
        include_usage: gen.include_usage,
        queue,
        over: false,
        log: Some(log),
        arrived: s.arrived,
        first: None,
    };
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        let ev = st.next_event().await?;
        Some((Ok::<_, Infallible>(ev), st))
    });
    Ok(Sse::new(stream).into_response())
}

/// Count a request refused before it ran, and log it.
fn count_rejected<T>(
    app: &App,
    chat: bool,
    arrived: Instant,
    r: Result<T, ApiError>,
) -> Result<T, ApiError> {
    if let Err(e) = &r {
        app.shared.requests_rejected.fetch_add(1, Relaxed);
        let model = app
            .shared
            .ready
            .get()
            .map_or("-".to_string(), |rd| model_name(app, rd).to_string());
        reqlog::log(&RequestLog {
            id: "-".into(),
            endpoint: endpoint(chat),
            model,
            status: e.status,
            prompt_tokens: 0,
            completion_tokens: 0,
            ttft_ms: None,
            total_ms: ms(arrived.elapsed()),
            finish: "rejected".into(),
            n: 0,
            stream: false,
            error: Some(e.message.clone()),
        });
    }
    r
}

async fn completions(State(app): AppState, req: Request) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    app.shared.requests_total.fetch_add(1, Relaxed);
    let body = read_body(&app, req).await;
    let prepared = (|| {
        let body = body?;
        let r = ready(&app)?;
        let req = openai::parse_completion_with(&body, &app.opts.sampling_defaults)?;
        check_model(&app, r, &req.model)?;
        let prompt = match req.prompt {
            Prompt::Tokens(t) => t,
            Prompt::Text(text) => {
                let t = tokenizer_of(r)?;
                let mut ids = t
                    .encode(&text, true)
                    .map_err(|e| ApiError::invalid(e.to_string()))?;
                if ids.is_empty() {
                    ids.extend(t.bos_id());
                }
                ids
            }
        };
        let s = start(&app, r, prompt, &req.gen, arrived)?;
        Ok((r, s, req.gen))
    })();
    let (r, s, gen) = count_rejected(&app, false, arrived, prepared)?;
    respond(&app, r, s, gen, false, None).await
}

/// Render and tokenize a chat on a blocking thread (a slow template never holds up the
/// server's other connections), within the template's deadline and at most
/// [`RENDERS_AT_ONCE`] at a time.
async fn render_chat(app: &Arc<App>, req: ChatRender) -> Result<Rendered, ApiError> {
    let limit = app.opts.template.max_time;
    let busy = || {
        ApiError::new(
            503,
            "server_error",
            Some("templates_busy"),
            format!("the chat template is still busy with earlier requests ({RENDERS_AT_ONCE} at once, each up to {} s); retry later", limit.as_secs_f64()),
        )
        .with_retry_after(1)
    };
    let permit = match tokio::time::timeout(limit, app.renders.clone().acquire_owned()).await {
        Ok(Ok(p)) => p,
        _ => return Err(busy()),
    };
    let app2 = app.clone();
    let job = tokio::task::spawn_blocking(move || {
        // Held until the render really ends, even when the request gave up on it.
        let _permit = permit;
        let r = ready(&app2)?;
        let (Some(t), Some(tpl)) = (&r.tokenizer, &r.template) else {
            return Err(scheduler_gone());
        };
        let extras = RenderExtras {
            tools: &req.tools,
            kwargs: Some(&req.kwargs),
        };
        let segs = tpl
            .render_with(&req.messages, true, &extras)
            .map_err(ApiError::invalid)?;
        let tail: String = segs
            .iter()
            .rev()
            .take(2)
            .rev()
            .map(|s| match s {
                Segment::Markup(t) | Segment::Literal(t) => t.as_str(),
            })
            .collect();
        Ok(Rendered {
            ids: encode_segments(t, &segs)?,
            think_open: super::reasoning::prompt_opens_think(&tail),
            thinks: tpl.thinks(),
        })
    });
    match tokio::time::timeout(limit, job).await {
        Ok(Ok(r)) => r,
        Ok(Err(_)) => Err(scheduler_gone()),
        Err(_) => Err(ApiError::invalid(format!(
            "the model's chat template took longer than {} s on these messages (raise --template-timeout if the template is trusted)",
            limit.as_secs_f64()
        ))),
    }
}

/// What a chat render needs besides the template.
struct ChatRender {
    messages: Vec<openai::ChatMessage>,
    tools: Vec<Value>,
    kwargs: serde_json::Map<String, Value>,
}

/// A rendered, tokenized chat.
struct Rendered {
    ids: Vec<u32>,
    /// The prompt ends inside an open `<think>` block.
    think_open: bool,
    /// The template mentions `<think>`.
    thinks: bool,
}

/// The prompt ids of a rendered chat: markup with special tokens recognised, special-token
/// text that came from messages as plain text.
fn encode_segments(t: &Tokenizer, segs: &[Segment]) -> Result<Vec<u32>, ApiError> {
    let mut ids = Vec::new();
    for s in segs {
        let part = match s {
            Segment::Markup(text) => t.encode(text, false),
            Segment::Literal(text) => t.encode_literal(text),
        };
        ids.extend(part.map_err(|e| ApiError::invalid(e.to_string()))?);
    }
    Ok(ids)
}

async fn chat_completions(State(app): AppState, req: Request) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    app.shared.requests_total.fetch_add(1, Relaxed);
    let body = read_body(&app, req).await;
    let parsed = (|| {
        let body = body?;
        let r = ready(&app)?;
        let req = openai::parse_chat_with(&body, &app.opts.sampling_defaults)?;
        check_model(&app, r, &req.model)?;
        tokenizer_of(r)?;
        r.template.as_ref().ok_or_else(|| {
            ApiError::param(
                "no_chat_template",
                "the model ships no chat template (tokenizer_config.json `chat_template` or GGUF `tokenizer.chat_template`); use /v1/completions",
            )
        })?;
        Ok(req)
    })();
    let req = count_rejected(&app, true, arrived, parsed)?;
    let render = ChatRender {
        messages: req.messages,
        tools: req.tools,
        kwargs: req.template_kwargs,
    };
    let tools_on = !render.tools.is_empty();
    let encoded = count_rejected(&app, true, arrived, render_chat(&app, render).await);
    let prepared = (|| {
        let rendered = encoded?;
        let r = ready(&app)?;
        let format = req.reasoning_format.unwrap_or(app.opts.reasoning_format);
        let shape = ShapeConfig {
            reasoning: format.splits(rendered.thinks),
            think_open: rendered.think_open,
            tools: tools_on,
        };
        let s = start(&app, r, rendered.ids, &req.gen, arrived)?;
        Ok((r, s, req.gen, shape))
    })();
    let (r, s, gen, shape) = count_rejected(&app, true, arrived, prepared)?;
    respond(&app, r, s, gen, true, Some(shape)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok() -> Arc<Tokenizer> {
        Arc::new(
            Tokenizer::from_file(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../tests/data/tiny-chat"
            ))
            .unwrap(),
        )
    }

    #[test]
    fn text_out_streams_whole_text_and_honours_stops() {
        let t = tok();
        let text = "Hello there! The capital of France is Paris. ✓ done";
        let ids = t.encode(text, false).unwrap();
        let mut o = TextOut::new(Some(t.clone()), vec![]);
        let mut s: String = ids.iter().map(|&i| o.push(i)).collect();
        s.push_str(&o.flush());
        assert_eq!(s, text);
        let mut o = TextOut::new(Some(t.clone()), vec!["France is".into()]);
        let mut s = String::new();
        for &i in &ids {
            s.push_str(&o.push(i));
            if o.stopped {
                break;
            }
        }
        assert!(o.stopped);
        assert_eq!(s, "Hello there! The capital of ");
        let mut o = TextOut::new(Some(t), vec!["zzz".into()]);
        let mut s: String = ids.iter().map(|&i| o.push(i)).collect();
        s.push_str(&o.flush());
        assert_eq!(s, text, "an unmatched stop holds nothing back at the end");
    }
}
