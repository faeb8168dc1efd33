//! OpenAI-compatible request parsing and strict validation, response bodies and the error
//! shape `{"error": {"message", "type", "code"}}`.
//! Invariant: a request either becomes a fully checked `CompletionRequest`/`ChatRequest`
//! (every number in range, every type right) or an `ApiError` with a 4xx status whose
//! message names the field; nothing here panics on any input.

use super::defaults::SamplingDefaults;
use crate::sampler::SamplingParams;
use serde_json::{json, Map, Value};

/// An error answered to the client as OpenAI-style JSON.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    /// OpenAI error type: `invalid_request_error`, `authentication_error`, `server_error`...
    pub kind: &'static str,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (queue full, loading).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(
        status: u16,
        kind: &'static str,
        code: Option<&'static str>,
        msg: impl Into<String>,
    ) -> Self {
        Self {
            status,
            message: msg.into(),
            kind,
            code,
            retry_after: None,
        }
    }

    /// 400 invalid_request_error.
    pub fn invalid(msg: impl Into<String>) -> Self {
        Self::new(400, "invalid_request_error", None, msg)
    }

    /// 400 naming the offending parameter.
    pub fn param(code: &'static str, msg: impl Into<String>) -> Self {
        Self::new(400, "invalid_request_error", Some(code), msg)
    }

    pub fn with_retry_after(mut self, s: u64) -> Self {
        self.retry_after = Some(s);
        self
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "code": self.code}})
    }
}

/// A completion prompt: text to tokenize, or token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// Generation settings shared by both endpoints.
#[derive(Debug, Clone, PartialEq)]
pub struct GenParams {
    /// `max_tokens` / `max_completion_tokens`; `None` = up to the planned context.
    pub max_tokens: Option<u64>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// `min_p`, penalties and `logit_bias` (applied on the host).
    pub proc: super::logit_proc::LogitProc,
    /// `Some(k)`: return each token's log-probability and its `k` most likely alternatives
    /// (chat: `logprobs: true` + `top_logprobs: k`; completions: `logprobs: k`).
    pub logprobs: Option<usize>,
    /// `n`: independent sequences (choices) for this prompt, at least 1.
    pub n: u64,
    /// `cache_prompt` (llama-server's): false = prefill the whole prompt, reusing no
    /// slot's cached prefix. Default true.
    pub cache_prompt: bool,
    /// `response_format` other than text: the output is constrained to it.
    pub response_format: Option<super::structured::ResponseFormat>,
    /// `ignore_eos` (vLLM's and llama-server's): an end-of-sequence token does not end the
    /// sequence, so it runs to `max_tokens` or a `stop` string (load tests, benchmarks).
    pub ignore_eos: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
    pub gen: GenParams,
}

/// One chat message as the template sees it.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant message's calls, OpenAI-shaped, with each `function.arguments` that is
    /// a JSON object string decoded into the object (as vLLM does: templates `tojson` it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` message's answer to this call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// An assistant message's reasoning (templates such as Qwen3's may render it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ToolChoice {
    /// The model decides (the default).
    #[default]
    Auto,
    /// No tools: none are passed to the template and output is not parsed for calls.
    None,
    /// The model should call one; the template gets every tool (nothing forces the call).
    Required,
    /// The model should call this one; the template gets only it.
    Function(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    pub gen: GenParams,
    /// Function tools for the template (checked; empty = none), after `tool_choice`.
    pub tools: Vec<Value>,
    pub tool_choice: ToolChoice,
    /// `chat_template_kwargs` (and top-level `enable_thinking`): more template variables.
    pub template_kwargs: Map<String, Value>,
    /// `reasoning_format`, when the request sets it.
    pub reasoning_format: Option<super::reasoning::ReasoningFormat>,
}

/// Longest stop string accepted, in bytes, and the most stop strings.
pub const MAX_STOP_BYTES: usize = 256;
pub const MAX_STOPS: usize = 16;
/// Most `logit_bias` entries accepted.
pub const MAX_LOGIT_BIAS: usize = 1024;
/// Most alternatives per token accepted in `top_logprobs` (chat) / `logprobs` (completions),
/// as OpenAI's chat API and vLLM.
pub const MAX_TOP_LOGPROBS: i64 = 20;

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn wrong(key: &str, want: &str, v: &Value) -> ApiError {
    ApiError::param(
        "invalid_type",
        format!("`{key}` must be {want}, got {}", type_name(v)),
    )
}

/// The request body as a JSON object.
pub fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    if body.is_empty() {
        return Err(ApiError::invalid(
            "the request body is empty; send a JSON object",
        ));
    }
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::param(
            "invalid_json",
            format!("the request body is not valid JSON: {e}"),
        )
    })?;
    match v {
        Value::Object(m) => Ok(m),
        other => Err(ApiError::param(
            "invalid_json",
            format!(
                "the request body must be a JSON object, got {}",
                type_name(&other)
            ),
        )),
    }
}

struct Obj<'a>(&'a Map<String, Value>);

impl Obj<'_> {
    /// The value of `key`, treating JSON null as absent.
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn f64_in(&self, key: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => {
                let x = v.as_f64().ok_or_else(|| wrong(key, "a number", v))?;
                if !(lo..=hi).contains(&x) {
                    return Err(ApiError::param(
                        "invalid_value",
                        format!("`{key}` must be between {lo} and {hi}, got {x}"),
                    ));
                }
                Ok(Some(x))
            }
        }
    }

    /// An integer; `lo..=hi` inclusive. Floats with a fraction and huge values are errors.
    fn int_in(&self, key: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => {
                let x = match v.as_i64() {
                    Some(x) => x,
                    None => match v.as_f64() {
                        Some(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => f as i64,
                        Some(f) => {
                            return Err(ApiError::param(
                                "invalid_value",
                                format!(
                                    "`{key}` must be an integer between {lo} and {hi}, got {f}"
                                ),
                            ))
                        }
                        None => return Err(wrong(key, "an integer", v)),
                    },
                };
                if x < lo || x > hi {
                    return Err(ApiError::param(
                        "invalid_value",
                        format!("`{key}` must be an integer between {lo} and {hi}, got {x}"),
                    ));
                }
                Ok(Some(x))
            }
        }
    }

    fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(wrong(key, "a boolean", v)),
        }
    }

    fn string(&self, key: &str) -> Result<Option<&str>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(wrong(key, "a string", v)),
        }
    }

    /// Reject a parameter we do not implement unless it has its neutral value.
    fn unsupported_unless(
        &self,
        key: &str,
        neutral: impl Fn(&Value) -> bool,
    ) -> Result<(), ApiError> {
        match self.get(key) {
            Some(v) if !neutral(v) => Err(ApiError::param(
                "unsupported_parameter",
                format!("`{key}` is not supported by this server; leave it out"),
            )),
            _ => Ok(()),
        }
    }
}

/// `logprobs`/`top_logprobs`: chat takes `logprobs: true` and `top_logprobs: 0..=20` (which
/// needs `logprobs: true`); completions take `logprobs: 0..=20`.
fn logprobs(o: &Obj, chat: bool) -> Result<Option<usize>, ApiError> {
    if !chat {
        return Ok(o
            .int_in("logprobs", 0, MAX_TOP_LOGPROBS)?
            .map(|k| k as usize));
    }
    let on = o.bool("logprobs")?.unwrap_or(false);
    let top = o.int_in("top_logprobs", 0, MAX_TOP_LOGPROBS)?;
    match (on, top) {
        (false, Some(k)) if k > 0 => Err(ApiError::param(
            "invalid_value",
            format!(
                "`top_logprobs` is {k} but `logprobs` is not true; send `logprobs: true` with it"
            ),
        )),
        (false, _) => Ok(None),
        (true, k) => Ok(Some(k.unwrap_or(0) as usize)),
    }
}

fn gen_params(o: &Obj, d: &SamplingDefaults, chat: bool) -> Result<GenParams, ApiError> {
    let max_a = o.int_in("max_tokens", 1, i64::MAX)?;
    let max_b = o.int_in("max_completion_tokens", 1, i64::MAX)?;
    let max_tokens = max_b.or(max_a).map(|x| x as u64);
    let temperature = o.f64_in("temperature", 0.0, 2.0)?.unwrap_or(d.temperature);
    let top_p = o.f64_in("top_p", 0.0, 1.0)?.unwrap_or(d.top_p);
    if top_p <= 0.0 && o.get("top_p").is_some() {
        return Err(ApiError::param(
            "invalid_value",
            "`top_p` must be greater than 0 and at most 1",
        ));
    }
    let top_k = o
        .int_in("top_k", 0, 1 << 31)?
        .map_or(d.top_k, |k| k as usize);
    let seed = match o.int_in("seed", i64::MIN, i64::MAX)? {
        Some(s) => s as u64,
        None => {
            // No seed: a fresh one per request (greedy requests do not use it).
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        }
    };
    // Bounded by the plan's slots where the request is started (it knows them).
    let n = o.int_in("n", 1, i64::MAX)?.map_or(1, |n| n as u64);
    let stop = match o.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            let mut out = Vec::with_capacity(a.len());
            for (i, s) in a.iter().enumerate() {
                match s {
                    Value::String(s) => out.push(s.clone()),
                    v => return Err(wrong(&format!("stop[{i}]"), "a string", v)),
                }
            }
            out
        }
        Some(v) => return Err(wrong("stop", "a string or an array of strings", v)),
    };
    if stop.len() > MAX_STOPS {
        return Err(ApiError::param(
            "invalid_value",
            format!(
                "`stop` holds {} strings; at most {MAX_STOPS} are accepted",
                stop.len()
            ),
        ));
    }
    if let Some(s) = stop
        .iter()
        .find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
    {
        return Err(ApiError::param(
            "invalid_value",
            format!(
                "each `stop` string must be 1 to {MAX_STOP_BYTES} bytes, got {} bytes",
                s.len()
            ),
        ));
    }
    let stream = o.bool("stream")?.unwrap_or(false);
    let include_usage = match o.get("stream_options") {
        None => false,
        Some(Value::Object(m)) => Obj(m).bool("include_usage")?.unwrap_or(false),
        Some(v) => return Err(wrong("stream_options", "an object", v)),
    };
    let proc = logit_proc(o, d)?;
    let logprobs = logprobs(o, chat)?;
    if !chat {
        for key in ["tools", "tool_choice"] {
            if o.get(key).is_some() {
                return Err(ApiError::param(
                    "unsupported_parameter",
                    format!("`{key}` is for /v1/chat/completions (the chat template renders tools); leave it out of /v1/completions"),
                ));
            }
        }
    }
    let cache_prompt = o.bool("cache_prompt")?.unwrap_or(true);
    let response_format = super::structured::parse_response_format(o.get("response_format"))?;
    let ignore_eos = o.bool("ignore_eos")?.unwrap_or(false);
    if ignore_eos && response_format.is_some() {
        return Err(ApiError::param(
            "invalid_value",
            "`ignore_eos` with `response_format`: a constrained output ends where its grammar ends; leave one of them out".to_string(),
        ));
    }
    o.unsupported_unless("best_of", |v| v.as_i64() == Some(1))?;
    o.unsupported_unless("echo", |v| v == &Value::Bool(false))?;
    o.unsupported_unless("suffix", |v| v.as_str() == Some(""))?;
    Ok(GenParams {
        max_tokens,
        sampling: SamplingParams {
            temperature: temperature as f32,
            top_k,
            top_p: top_p as f32,
            seed,
        },
        stop,
        stream,
        include_usage,
        proc,
        logprobs,
        n,
        cache_prompt,
        response_format,
        ignore_eos,
    })
}

/// `min_p`, `typical_p`, `presence_penalty`, `frequency_penalty`, `repetition_penalty`
/// (alias `repeat_penalty`) and `logit_bias` (token id strings to -100..100).
fn logit_proc(o: &Obj, d: &SamplingDefaults) -> Result<super::logit_proc::LogitProc, ApiError> {
    let mut p = super::logit_proc::LogitProc {
        min_p: d.min_p as f32,
        repetition_penalty: d.repetition_penalty as f32,
        ..Default::default()
    };
    if let Some(x) = o.f64_in("min_p", 0.0, 1.0)? {
        p.min_p = x as f32;
    }
    if let Some(x) = o.f64_in("presence_penalty", -2.0, 2.0)? {
        p.presence_penalty = x as f32;
    }
    if let Some(x) = o.f64_in("frequency_penalty", -2.0, 2.0)? {
        p.frequency_penalty = x as f32;
    }
    if let Some(x) = o.f64_in("typical_p", 0.0, 1.0)? {
        if x <= 0.0 {
            return Err(ApiError::param(
                "invalid_value",
                "`typical_p` must be greater than 0 and at most 1 (1 = off)",
            ));
        }
        p.typical_p = x as f32;
    }
    let rep = o.f64_in("repetition_penalty", 0.0, 10.0)?;
    let rep = rep.or(o.f64_in("repeat_penalty", 0.0, 10.0)?);
    if let Some(x) = rep {
        if x <= 0.0 {
            return Err(ApiError::param(
                "invalid_value",
                "`repetition_penalty` must be greater than 0 (1 = off)",
            ));
        }
        p.repetition_penalty = x as f32;
    }
    match o.get("logit_bias") {
        None => {}
        Some(Value::Object(m)) => {
            if m.len() > MAX_LOGIT_BIAS {
                return Err(ApiError::param(
                    "invalid_value",
                    format!(
                        "`logit_bias` holds {} entries; at most {MAX_LOGIT_BIAS} are accepted",
                        m.len()
                    ),
                ));
            }
            for (k, v) in m {
                let id: u32 = k.parse().map_err(|_| {
                    ApiError::param(
                        "invalid_value",
                        format!("`logit_bias` key `{k}` must be a token id (a decimal integer)"),
                    )
                })?;
                let b = v
                    .as_f64()
                    .ok_or_else(|| wrong(&format!("logit_bias.{k}"), "a number", v))?;
                if !(-100.0..=100.0).contains(&b) {
                    return Err(ApiError::param(
                        "invalid_value",
                        format!("`logit_bias.{k}` must be between -100 and 100, got {b}"),
                    ));
                }
                if p.logit_bias.iter().any(|(i, _)| *i == id) {
                    return Err(ApiError::param(
                        "invalid_value",
                        format!("`logit_bias` names token {id} twice (key `{k}` is another spelling of an earlier key); give each token once"),
                    ));
                }
                p.logit_bias.push((id, b as f32));
            }
        }
        Some(v) => return Err(wrong("logit_bias", "an object of token id to bias", v)),
    }
    Ok(p)
}

fn token_ids(key: &str, a: &[Value]) -> Result<Vec<u32>, ApiError> {
    a.iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| {
                    ApiError::param(
                        "invalid_value",
                        format!("`{key}[{i}]` must be a token id (an integer from 0 to 4294967295), got {v}"),
                    )
                })
        })
        .collect()
}

/// Parse and check a `/v1/completions` body.
pub fn parse_completion(body: &[u8]) -> Result<CompletionRequest, ApiError> {
    parse_completion_with(body, &SamplingDefaults::default())
}

/// [`parse_completion`] with the server's defaults for the sampling fields left out.
pub fn parse_completion_with(
    body: &[u8],
    d: &SamplingDefaults,
) -> Result<CompletionRequest, ApiError> {
    let m = parse_object(body)?;
    let o = Obj(&m);
    let model = o.string("model")?.map(str::to_string);
    let prompt = match o.get("prompt") {
        None => return Err(ApiError::param("missing_parameter", "`prompt` is required")),
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(ApiError::param(
                "invalid_value",
                "`prompt` is an empty array",
            ))
        }
        Some(Value::Array(a)) => match &a[0] {
            Value::String(_) | Value::Array(_) if a.len() > 1 => {
                return Err(ApiError::param(
                    "unsupported_parameter",
                    format!("`prompt` holds {} prompts; send one per request", a.len()),
                ))
            }
            Value::String(s) => Prompt::Text(s.clone()),
            Value::Array(inner) => Prompt::Tokens(token_ids("prompt[0]", inner)?),
            _ => Prompt::Tokens(token_ids("prompt", a)?),
        },
        Some(v) => {
            return Err(wrong(
                "prompt",
                "a string, an array of token ids, or an array of one string",
                v,
            ))
        }
    };
    Ok(CompletionRequest {
        model,
        prompt,
        gen: gen_params(&o, d, false)?,
    })
}

const ROLES: [&str; 5] = ["system", "user", "assistant", "tool", "developer"];

/// Parse and check a `/v1/chat/completions` body.
pub fn parse_chat(body: &[u8]) -> Result<ChatRequest, ApiError> {
    parse_chat_with(body, &SamplingDefaults::default())
}

/// `messages[i].content` of a `role` message: a string, or text parts joined.
fn message_content(i: usize, role: &str, mo: &Obj<'_>) -> Result<String, ApiError> {
    Ok(match mo.get("content") {
        None if role == "assistant" => String::new(),
        None => {
            return Err(ApiError::param(
                "missing_parameter",
                format!("`messages[{i}].content` is required"),
            ))
        }
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                let key = format!("messages[{i}].content[{j}]");
                let po = match p {
                    Value::Object(po) => Obj(po),
                    v => return Err(wrong(&key, "a content part object", v)),
                };
                match po.string("type")? {
                    Some("text") => match po.get("text") {
                        Some(Value::String(t)) => text.push_str(t),
                        Some(v) => return Err(wrong(&format!("{key}.text"), "a string", v)),
                        None => {
                            return Err(ApiError::param(
                                "missing_parameter",
                                format!("`{key}.text` is required"),
                            ))
                        }
                    },
                    other => {
                        return Err(ApiError::param(
                            "unsupported_parameter",
                            format!(
                                "`{key}.type` is {}; only `text` parts are supported",
                                other.map_or("missing".to_string(), |t| format!("`{t}`"))
                            ),
                        ))
                    }
                }
            }
            text
        }
        Some(v) => {
            return Err(wrong(
                &format!("messages[{i}].content"),
                "a string or an array of parts",
                v,
            ))
        }
    })
}

/// [`parse_chat`] with the server's defaults for the sampling fields left out.
pub fn parse_chat_with(body: &[u8], d: &SamplingDefaults) -> Result<ChatRequest, ApiError> {
    let m = parse_object(body)?;
    let o = Obj(&m);
    let model = o.string("model")?.map(str::to_string);
    let msgs = match o.get("messages") {
        None => {
            return Err(ApiError::param(
                "missing_parameter",
                "`messages` is required",
            ))
        }
        Some(Value::Array(a)) => a,
        Some(v) => return Err(wrong("messages", "an array of messages", v)),
    };
    if msgs.is_empty() {
        return Err(ApiError::param(
            "invalid_value",
            "`messages` is empty; send at least one message",
        ));
    }
    let mut messages = Vec::with_capacity(msgs.len());
    for (i, msg) in msgs.iter().enumerate() {
        let mo = match msg {
            Value::Object(mo) => Obj(mo),
            v => return Err(wrong(&format!("messages[{i}]"), "an object", v)),
        };
        let role = mo
            .string("role")
            .map_err(|_| {
                let v = mo.0.get("role").unwrap_or(&Value::Null);
                wrong(&format!("messages[{i}].role"), "a string", v)
            })?
            .ok_or_else(|| {
                ApiError::param(
                    "missing_parameter",
                    format!("`messages[{i}].role` is required"),
                )
            })?;
        if !ROLES.contains(&role) {
            return Err(ApiError::param(
                "invalid_value",
                format!(
                    "`messages[{i}].role` is `{role}`; use one of {}",
                    ROLES.join(", ")
                ),
            ));
        }
        let content = message_content(i, role, &mo)?;
        let name = mo.string("name")?.map(str::to_string);
        let tool_calls = match mo.get("tool_calls") {
            None => None,
            Some(v) if role == "assistant" => Some(history_calls(i, v)?),
            Some(_) => {
                return Err(ApiError::param(
                    "invalid_value",
                    format!("`messages[{i}].tool_calls` is only for `assistant` messages; this one is `{role}`"),
                ))
            }
        };
        let tool_call_id = mo
            .string("tool_call_id")
            .map_err(|_| {
                wrong(
                    &format!("messages[{i}].tool_call_id"),
                    "a string",
                    mo.0.get("tool_call_id").unwrap_or(&Value::Null),
                )
            })?
            .map(str::to_string);
        let reasoning_content = mo
            .string("reasoning_content")
            .map_err(|_| {
                wrong(
                    &format!("messages[{i}].reasoning_content"),
                    "a string",
                    mo.0.get("reasoning_content").unwrap_or(&Value::Null),
                )
            })?
            .map(str::to_string);
        messages.push(ChatMessage {
            role: role.to_string(),
            content,
            name,
            tool_calls,
            tool_call_id,
            reasoning_content,
        });
    }
    let (tools, tool_choice) = tools(&o)?;
    let template_kwargs = template_kwargs(&o)?;
    let reasoning_format = match o.string("reasoning_format")? {
        None => None,
        Some(f) => Some(super::reasoning::ReasoningFormat::parse(f).ok_or_else(|| {
            ApiError::param(
                "invalid_value",
                format!("`reasoning_format` is `{f}`; use `auto`, `deepseek` or `none`"),
            )
        })?),
    };
    Ok(ChatRequest {
        model,
        messages,
        gen: gen_params(&o, d, true)?,
        tools,
        tool_choice,
        template_kwargs,
        reasoning_format,
    })
}

/// Most tools accepted in one request.
pub const MAX_TOOLS: usize = 128;

/// The `function` object of `key`, which must hold a non-empty `name` string.
fn function_name<'a>(key: &str, f: Option<&'a Value>) -> Result<&'a str, ApiError> {
    let f = match f {
        Some(Value::Object(f)) => f,
        Some(v) => return Err(wrong(key, "an object with a `name`", v)),
        None => {
            return Err(ApiError::param(
                "missing_parameter",
                format!("`{key}` is required (an object with a `name`)"),
            ))
        }
    };
    match f.get("name") {
        Some(Value::String(n)) if !n.is_empty() => Ok(n),
        Some(Value::String(_)) => Err(ApiError::param(
            "invalid_value",
            format!("`{key}.name` is empty; name the function"),
        )),
        Some(v) => Err(wrong(&format!("{key}.name"), "a string", v)),
        None => Err(ApiError::param(
            "missing_parameter",
            format!("`{key}.name` is required"),
        )),
    }
}

/// An assistant message's `tool_calls`, checked, with string arguments that hold a JSON
/// object decoded (templates expect a mapping they can `tojson` or iterate).
fn history_calls(i: usize, v: &Value) -> Result<Vec<Value>, ApiError> {
    let key = format!("messages[{i}].tool_calls");
    let a = v
        .as_array()
        .ok_or_else(|| wrong(&key, "an array of tool calls", v))?;
    let mut out = Vec::with_capacity(a.len());
    for (j, c) in a.iter().enumerate() {
        let ck = format!("{key}[{j}]");
        let Value::Object(co) = c else {
            return Err(wrong(&ck, "an object", c));
        };
        let fk = format!("{ck}.function");
        function_name(&fk, co.get("function"))?;
        let mut c = c.clone();
        match c["function"].get("arguments") {
            None | Some(Value::Null) | Some(Value::Object(_)) => {}
            Some(Value::String(s)) => {
                if let Ok(obj @ Value::Object(_)) = serde_json::from_str::<Value>(s) {
                    c["function"]["arguments"] = obj;
                }
            }
            Some(a) => {
                return Err(wrong(
                    &format!("{fk}.arguments"),
                    "a JSON string or an object",
                    a,
                ))
            }
        }
        out.push(c);
    }
    Ok(out)
}

/// `tools` and `tool_choice`, checked; the tools the template gets after the choice.
fn tools(o: &Obj) -> Result<(Vec<Value>, ToolChoice), ApiError> {
    let tools = match o.get("tools") {
        None => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(v) => return Err(wrong("tools", "an array of function tools", v)),
    };
    if tools.len() > MAX_TOOLS {
        return Err(ApiError::param(
            "invalid_value",
            format!(
                "`tools` holds {} tools; at most {MAX_TOOLS} are accepted",
                tools.len()
            ),
        ));
    }
    let mut names = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let key = format!("tools[{i}]");
        let Value::Object(to) = t else {
            return Err(wrong(&key, "a function tool object", t));
        };
        match to.get("type") {
            Some(Value::String(s)) if s == "function" => {}
            Some(v) => {
                return Err(ApiError::param(
                    "invalid_value",
                    format!("`{key}.type` must be `function` (the only tool type served), got {v}"),
                ))
            }
            None => {
                return Err(ApiError::param(
                    "missing_parameter",
                    format!("`{key}.type` is required; send `\"type\": \"function\"`"),
                ))
            }
        }
        let fk = format!("{key}.function");
        names.push(function_name(&fk, to.get("function"))?);
        let f = &to["function"];
        match f.get("parameters") {
            None | Some(Value::Null) | Some(Value::Object(_)) => {}
            Some(v) => {
                return Err(wrong(
                    &format!("{fk}.parameters"),
                    "a JSON Schema object",
                    v,
                ))
            }
        }
        match f.get("description") {
            None | Some(Value::Null) | Some(Value::String(_)) => {}
            Some(v) => return Err(wrong(&format!("{fk}.description"), "a string", v)),
        }
    }
    let choice = match o.get("tool_choice") {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::param(
                    "invalid_value",
                    format!("`tool_choice` is `{other}`; use `auto`, `none`, `required` or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
                ))
            }
        },
        Some(Value::Object(c)) => {
            if c.get("type").and_then(Value::as_str) != Some("function") {
                return Err(ApiError::param(
                    "invalid_value",
                    "`tool_choice.type` must be `function`",
                ));
            }
            ToolChoice::Function(function_name("tool_choice.function", c.get("function"))?.to_string())
        }
        Some(v) => {
            return Err(wrong(
                "tool_choice",
                "`auto`, `none`, `required` or a named function object",
                v,
            ))
        }
    };
    let picked = match &choice {
        ToolChoice::None => Vec::new(),
        ToolChoice::Auto => tools,
        ToolChoice::Required if tools.is_empty() => {
            return Err(ApiError::param(
                "invalid_value",
                "`tool_choice` is `required` but `tools` is empty; send the tools",
            ))
        }
        ToolChoice::Required => tools,
        ToolChoice::Function(n) => {
            let Some(i) = names.iter().position(|x| x == n) else {
                return Err(ApiError::param(
                    "invalid_value",
                    format!("`tool_choice` names the function `{n}`, which is not in `tools`; add it to `tools` or name one of them"),
                ));
            };
            vec![tools[i].clone()]
        }
    };
    Ok((picked, choice))
}

/// Variables the server sets itself; `chat_template_kwargs` may not replace them.
const RESERVED_KWARGS: [&str; 5] = [
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
];

/// `chat_template_kwargs` (any object) with a top-level `enable_thinking` boolean merged in
/// (the kwargs' own value wins).
fn template_kwargs(o: &Obj) -> Result<Map<String, Value>, ApiError> {
    let mut kw = match o.get("chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(v) => return Err(wrong("chat_template_kwargs", "an object", v)),
    };
    if let Some(k) = RESERVED_KWARGS.iter().find(|k| kw.contains_key(**k)) {
        return Err(ApiError::param(
            "invalid_value",
            format!("`chat_template_kwargs.{k}` is set by the server; send it in the request's own fields, not as a template variable"),
        ));
    }
    if let Some(b) = o.bool("enable_thinking")? {
        kw.entry("enable_thinking").or_insert(Value::Bool(b));
    }
    Ok(kw)
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// End-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The model called tools (a chat choice whose output held parsed tool calls).
    ToolCalls,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::ToolCalls => "tool_calls",
        }
    }
}

/// Token counts of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt: u64,
    pub completion: u64,
}

impl Usage {
    pub fn json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion,
        })
    }
}

/// Ids and timestamp shared by a response and its chunks.
#[derive(Debug, Clone)]
pub struct RespMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

/// One finished choice of a response.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub text: String,
    pub finish: Finish,
    /// The `logprobs` object in the endpoint's shape, when asked for.
    pub logprobs: Option<Value>,
    /// A chat message split into reasoning, content and tool calls (else `text` is content).
    pub shaped: Option<super::chat_out::Shaped>,
}

pub fn completion_body(m: &RespMeta, choices: &[Choice], usage: Usage) -> Value {
    let choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({"index": i, "text": c.text, "logprobs": c.logprobs,
                   "finish_reason": c.finish.as_str()})
        })
        .collect();
    json!({
        "id": m.id, "object": "text_completion", "created": m.created, "model": m.model,
        "choices": choices, "usage": usage.json(),
    })
}

pub fn completion_chunk(
    m: &RespMeta,
    index: usize,
    text: &str,
    logprobs: Option<Value>,
    finish: Option<Finish>,
) -> Value {
    json!({
        "id": m.id, "object": "text_completion", "created": m.created, "model": m.model,
        "choices": [{"index": index, "text": text, "logprobs": logprobs,
                     "finish_reason": finish.map(Finish::as_str)}],
    })
}

pub fn chat_body(m: &RespMeta, choices: &[Choice], usage: Usage) -> Value {
    let choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let message = match &c.shaped {
                Some(m) => m.json(),
                None => json!({"role": "assistant", "content": c.text}),
            };
            json!({"index": i, "message": message,
                   "logprobs": c.logprobs, "finish_reason": c.finish.as_str()})
        })
        .collect();
    json!({
        "id": m.id, "object": "chat.completion", "created": m.created, "model": m.model,
        "choices": choices, "usage": usage.json(),
    })
}

/// A chat chunk of choice `index`; `delta` is `{"role": ...}` for the first, `{"content": ...}`
/// after.
pub fn chat_chunk(
    m: &RespMeta,
    index: usize,
    delta: Value,
    logprobs: Option<Value>,
    finish: Option<Finish>,
) -> Value {
    json!({
        "id": m.id, "object": "chat.completion.chunk", "created": m.created, "model": m.model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                     "finish_reason": finish.map(Finish::as_str)}],
    })
}

/// The last streamed chunk when `stream_options.include_usage`: no choices, the usage.
pub fn usage_chunk(m: &RespMeta, object: &str, usage: Usage) -> Value {
    json!({
        "id": m.id, "object": object, "created": m.created, "model": m.model,
        "choices": [], "usage": usage.json(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(r: Result<impl std::fmt::Debug, ApiError>) -> ApiError {
        r.expect_err("expected an error")
    }

    #[test]
    fn completion_parses_and_defaults() {
        let r = parse_completion(br#"{"model":"m","prompt":"hi","max_tokens":5,"temperature":0,"stop":["x"],"seed":7,"stream":true,"stream_options":{"include_usage":true}}"#).unwrap();
        assert_eq!(r.prompt, Prompt::Text("hi".into()));
        assert_eq!(r.gen.max_tokens, Some(5));
        assert_eq!(r.gen.sampling.temperature, 0.0);
        assert_eq!(r.gen.sampling.seed, 7);
        assert_eq!(r.gen.stop, vec!["x".to_string()]);
        assert!(r.gen.stream && r.gen.include_usage);
        let r = parse_completion(br#"{"prompt":[1,2,3],"user":"ignored","n":1,"logprobs":null}"#)
            .unwrap();
        assert_eq!(r.prompt, Prompt::Tokens(vec![1, 2, 3]));
        assert_eq!(r.gen.sampling.temperature, 1.0);
        assert_eq!(
            parse_completion(br#"{"prompt":[[4,5]]}"#).unwrap().prompt,
            Prompt::Tokens(vec![4, 5])
        );
    }

    #[test]
    fn bad_values_are_400s_naming_the_field() {
        for (body, needle) in [
            (&br#"{"prompt":"x","max_tokens":-1}"#[..], "max_tokens"),
            (br#"{"prompt":"x","max_tokens":1e300}"#, "max_tokens"),
            (br#"{"prompt":"x","max_tokens":"5"}"#, "max_tokens"),
            (br#"{"prompt":"x","temperature":3}"#, "temperature"),
            (br#"{"prompt":"x","top_p":0}"#, "top_p"),
            (br#"{"prompt":"x","top_k":-2}"#, "top_k"),
            (br#"{"prompt":"x","n":0}"#, "`n`"),
            (br#"{"prompt":"x","stop":[1]}"#, "stop[0]"),
            (br#"{"prompt":"x","stop":""}"#, "stop"),
            (br#"{"prompt":"x","stream":"yes"}"#, "stream"),
            (br#"{"prompt":"x","logprobs":true}"#, "logprobs"),
            (br#"{"prompt":"x","logprobs":21}"#, "logprobs"),
            (br#"{"prompt":[1,-3]}"#, "prompt[1]"),
            (br#"{"prompt":["a","b"]}"#, "prompt"),
            (br#"{"prompt":7}"#, "prompt"),
            (br#"{"max_tokens":3}"#, "prompt"),
            (br#"{"prompt":"x","model":5}"#, "model"),
        ] {
            let e = err(parse_completion(body));
            assert_eq!(e.status, 400);
            assert!(
                e.message.contains(needle),
                "{}: {}",
                String::from_utf8_lossy(body),
                e.message
            );
            assert_eq!(e.body()["error"]["type"], "invalid_request_error");
        }
        for body in [
            &b""[..],
            b"{",
            b"[1]",
            b"\xff\xfe",
            b"{\"prompt\":\"\xff\"}",
            b"null",
        ] {
            assert_eq!(err(parse_completion(body)).status, 400);
        }
    }

    #[test]
    fn chat_messages_are_checked() {
        let r = parse_chat(br#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#).unwrap();
        assert_eq!(r.messages[1].content, "ab");
        for (body, needle) in [
            (&br#"{"messages":[]}"#[..], "empty"),
            (br#"{"messages":"hi"}"#, "messages"),
            (br#"{"messages":[{"role":"king","content":"x"}]}"#, "role"),
            (br#"{"messages":[{"role":"user"}]}"#, "content"),
            (br#"{"messages":[{"role":"user","content":5}]}"#, "content"),
            (br#"{"messages":[{"content":"x"}]}"#, "role"),
            (
                br#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
                "image_url",
            ),
            (br#"{}"#, "messages"),
        ] {
            let e = err(parse_chat(body));
            assert_eq!(e.status, 400);
            assert!(
                e.message.contains(needle),
                "{}: {}",
                String::from_utf8_lossy(body),
                e.message
            );
        }
    }

    #[test]
    fn tools_choice_history_and_kwargs_parse() {
        let r = parse_chat(br#"{"messages":[{"role":"user","content":"q"},
            {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\": [1]}"}},
                                                            {"id":"c2","type":"function","function":{"name":"g","arguments":"not json"}}]},
            {"role":"tool","tool_call_id":"c1","content":"r"}],
            "tools":[{"type":"function","function":{"name":"f"}},{"type":"function","function":{"name":"g","parameters":{"type":"object"}}}],
            "tool_choice":{"type":"function","function":{"name":"g"}},
            "chat_template_kwargs":{"enable_thinking":true,"x":1},"enable_thinking":false}"#).unwrap();
        assert_eq!(r.messages[1].content, "");
        let calls = r.messages[1].tool_calls.as_ref().unwrap();
        // A JSON-object string is decoded for the template; anything else stays a string.
        assert_eq!(calls[0]["function"]["arguments"], json!({"a": [1]}));
        assert_eq!(calls[1]["function"]["arguments"], "not json");
        assert_eq!(r.messages[2].tool_call_id.as_deref(), Some("c1"));
        assert_eq!(r.tool_choice, ToolChoice::Function("g".into()));
        assert_eq!(r.tools.len(), 1);
        assert_eq!(r.tools[0]["function"]["name"], "g");
        // The kwargs' own value wins over the top-level shorthand.
        assert_eq!(r.template_kwargs["enable_thinking"], true);
        assert_eq!(r.template_kwargs["x"], 1);
        let r = parse_chat(br#"{"messages":[{"role":"user","content":"q"}],"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"none","enable_thinking":false}"#).unwrap();
        assert!(r.tools.is_empty());
        assert_eq!(r.template_kwargs["enable_thinking"], false);
        let e = err(parse_chat(br#"{"messages":[{"role":"user","content":"q"}],"tools":[{"type":"function","function":{"name":""}}]}"#));
        assert!(
            e.message.contains("tools[0].function.name"),
            "{}",
            e.message
        );
    }
}
