//! The output of a running request: each choice's text released past stop strings at
//! character boundaries ([`TextOut`]), the choices' events gathered for a whole answer
//! ([`collect`]) or sent as server-sent events ([`StreamState`]).
//! Invariant: no text is released that a stop string could still claim; a dropped stream
//! drops its receivers, which frees the slots.

use super::chat_out::{shape_whole, ChatShaper, Delta, ShapeConfig};
use super::http::*;
use super::logprobs::{self, LpToken};
use super::openai::{self, ApiError, Choice, Finish, GenParams, RespMeta, Usage};
use super::reqlog::{self, RequestLog};
use super::scheduler::{Event, TokenLogprobs};
use crate::tokenizer::Tokenizer;
use axum::response::sse::Event as SseEvent;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedReceiver;

/// Incremental detokenization with stop strings: text is released only once it cannot be
/// the start of a stop string, and only at UTF-8 character boundaries.
pub(super) struct TextOut {
    pub(super) tok: Option<Arc<Tokenizer>>,
    pub(super) ids: Vec<u32>,
    pub(super) prefix: usize,
    pub(super) read: usize,
    pub(super) pending: String,
    pub(super) stops: Vec<String>,
    pub(super) stopped: bool,
}

impl TextOut {
    pub(super) fn new(tok: Option<Arc<Tokenizer>>, stops: Vec<String>) -> Self {
        Self {
            tok,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            pending: String::new(),
            stops,
            stopped: false,
        }
    }

    pub(super) fn decode_new(&mut self, last: bool) {
        let Some(t) = &self.tok else {
            for id in &self.ids[self.read..] {
                self.pending.push_str(&format!(" {id}"));
            }
            self.read = self.ids.len();
            return;
        };
        let prev = t
            .decode(&self.ids[self.prefix..self.read], true)
            .unwrap_or_default();
        let full = t.decode(&self.ids[self.prefix..], true).unwrap_or_default();
        if full.len() > prev.len()
            && (last || !full.ends_with('\u{FFFD}'))
            && full.is_char_boundary(prev.len())
        {
            self.pending.push_str(&full[prev.len()..]);
            self.prefix = self.read;
            self.read = self.ids.len();
        }
    }

    /// Text that may be sent now; sets `stopped` when a stop string was found.
    pub(super) fn release(&mut self, last: bool) -> String {
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(pos) = hit {
            self.stopped = true;
            let out = self.pending[..pos].to_string();
            self.pending.clear();
            return out;
        }
        let mut keep = 0;
        if !last {
            for s in &self.stops {
                for k in (1..s.len()).rev() {
                    if k <= self.pending.len()
                        && s.is_char_boundary(k)
                        && self.pending.ends_with(&s[..k])
                    {
                        keep = keep.max(k);
                        break;
                    }
                }
            }
        }
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        out
    }

    pub(super) fn push(&mut self, id: u32) -> String {
        self.ids.push(id);
        self.decode_new(false);
        self.release(false)
    }

    pub(super) fn flush(&mut self) -> String {
        if self.read < self.ids.len() {
            self.decode_new(true);
        }
        self.release(true)
    }
}

pub(super) fn scheduler_gone() -> ApiError {
    ApiError::new(
        500,
        "server_error",
        Some("internal_error"),
        "the scheduler stopped before the request finished",
    )
}

/// One choice's output as it is produced: its text (stop strings held back), the
/// log-probabilities not yet sent, and how it ended.
pub(super) struct ChoiceOut {
    pub(super) text: TextOut,
    /// `Some` when the request asked for logprobs: the tokens not yet sent.
    pub(super) lps: Option<Vec<LpToken>>,
    /// Completions `text_offset` of the next token.
    pub(super) offset: usize,
    pub(super) tokens: u64,
    pub(super) finish: Option<Finish>,
    /// Chat: how the output is split (reasoning, tool calls), and the streaming splitter.
    pub(super) shape: Option<(ShapeConfig, ChatShaper)>,
}

impl ChoiceOut {
    pub(super) fn new(
        tok: Option<Arc<Tokenizer>>,
        gen: &GenParams,
        shape: Option<ShapeConfig>,
    ) -> Self {
        Self {
            text: TextOut::new(tok, gen.stop.clone()),
            lps: gen.logprobs.map(|_| Vec::new()),
            offset: 0,
            tokens: 0,
            finish: None,
            shape: shape.map(|c| (c, ChatShaper::new(c))),
        }
    }

    /// A choice that ended by stop with tool calls in it ends with `tool_calls`.
    pub(super) fn end_with_calls(&mut self, calls: bool) {
        if calls && self.finish == Some(Finish::Stop) {
            self.finish = Some(Finish::ToolCalls);
        }
    }

    /// Take a token; returns the text that may be sent now.
    pub(super) fn push(&mut self, id: u32, lp: Option<Box<TokenLogprobs>>) -> String {
        self.tokens += 1;
        if let (Some(v), Some(lp)) = (self.lps.as_mut(), lp) {
            v.push(LpToken { id, lp: *lp });
        }
        self.text.push(id)
    }

    pub(super) fn has_pending_lps(&self) -> bool {
        self.lps.as_ref().is_some_and(|v| !v.is_empty())
    }

    /// The `logprobs` object of the tokens not yet sent (none when not asked for).
    pub(super) fn take_lps(&mut self, chat: bool) -> Option<Value> {
        let items = std::mem::take(self.lps.as_mut()?);
        let tok = self.text.tok.as_deref();
        Some(if chat {
            logprobs::chat(tok, &items)
        } else {
            logprobs::completion(tok, &items, &mut self.offset)
        })
    }
}

/// What one event did to its choice.
pub(super) enum Step {
    /// Text to send (maybe empty); `true` when the choice ended with it.
    Text(String, bool),
    Failed(String),
}

/// Apply one event to its choice; events of a choice that already ended are ignored.
pub(super) fn step(outs: &mut [ChoiceOut], stops: &[Arc<AtomicBool>], i: usize, ev: Event) -> Step {
    let Some(o) = outs.get_mut(i) else {
        return Step::Text(String::new(), false);
    };
    if o.finish.is_some() {
        return Step::Text(String::new(), false);
    }
    match ev {
        Event::Token(id, lp) => {
            let t = o.push(id, lp);
            if o.text.stopped {
                if let Some(f) = stops.get(i) {
                    f.store(true, Relaxed);
                }
                o.finish = Some(Finish::Stop);
            }
            Step::Text(t, o.finish.is_some())
        }
        Event::Done { eos } => {
            let t = o.text.flush();
            o.finish = Some(if eos || o.text.stopped {
                Finish::Stop
            } else {
                Finish::Length
            });
            Step::Text(t, true)
        }
        Event::Error(m) => Step::Failed(m),
    }
}

/// Run a request to the end and return its choices.
pub(super) async fn collect(
    s: &mut Started,
    outs: &mut [ChoiceOut],
    first: &mut Option<Instant>,
    chat: bool,
) -> Result<(Vec<Choice>, Usage), ApiError> {
    let mut texts = vec![String::new(); outs.len()];
    let mut left = outs.len();
    while left > 0 {
        let Some((i, ev)) = s.rx.recv().await else {
            return Err(scheduler_gone());
        };
        if matches!(ev, Event::Token(..)) && first.is_none() {
            *first = Some(Instant::now());
        }
        match step(outs, &s.ended_by_stop, i, ev) {
            Step::Text(t, ended) => {
                if let Some(x) = texts.get_mut(i) {
                    x.push_str(&t);
                }
                left -= usize::from(ended);
            }
            Step::Failed(m) => {
                return Err(ApiError::new(500, "server_error", Some("engine_error"), m))
            }
        }
    }
    let usage = Usage {
        prompt: s.prompt_tokens,
        completion: outs.iter().map(|o| o.tokens).sum(),
    };
    let choices = outs
        .iter_mut()
        .zip(texts)
        .map(|(o, text)| {
            let shaped = o.shape.as_ref().map(|(c, _)| shape_whole(*c, &text));
            o.end_with_calls(shaped.as_ref().is_some_and(|m| !m.tool_calls.is_empty()));
            Choice {
                text,
                finish: o.finish.unwrap_or(Finish::Stop),
                logprobs: o.take_lps(chat),
                shaped,
            }
        })
        .collect();
    Ok((choices, usage))
}

/// The state of one SSE stream; dropping it (client gone) drops the receiver.
pub(super) struct StreamState {
    pub(super) rx: Option<UnboundedReceiver<(usize, Event)>>,
    pub(super) ended_by_stop: Vec<Arc<AtomicBool>>,
    pub(super) outs: Vec<ChoiceOut>,
    /// Choices still running.
    pub(super) left: usize,
    pub(super) meta: RespMeta,
    pub(super) chat: bool,
    pub(super) include_usage: bool,
    pub(super) usage: Usage,
    /// Events ready to send, in order.
    pub(super) queue: std::collections::VecDeque<SseEvent>,
    /// `[DONE]` is queued; nothing follows.
    pub(super) over: bool,
    /// This request's log line, written once when the stream ends (or is dropped).
    pub(super) log: Option<RequestLog>,
    pub(super) arrived: Instant,
    pub(super) first: Option<Instant>,
}

impl Drop for StreamState {
    fn drop(&mut self) {
        // Dropped before its end: the client went away.
        self.write_log(499, "cancelled".into(), None);
    }
}

impl StreamState {
    /// The chat chunks of `text` (after the choice's shaper; `ended`: its last text), the
    /// first carrying the logprobs not yet sent.
    pub(super) fn chat_chunks(&mut self, i: usize, text: &str, ended: bool) {
        let Some(o) = self.outs.get_mut(i) else {
            return;
        };
        let mut deltas: Vec<Value> = match o.shape.as_mut() {
            Some((_, sh)) => {
                let mut d = sh.push(text);
                if ended {
                    d.extend(sh.finish());
                }
                d.iter().map(Delta::json).collect()
            }
            None if text.is_empty() => Vec::new(),
            None => vec![json!({"content": text})],
        };
        if ended {
            let calls = o.shape.as_ref().is_some_and(|(_, sh)| sh.calls > 0);
            o.end_with_calls(calls);
        }
        if deltas.is_empty() && ended && o.has_pending_lps() {
            deltas.push(json!({"content": ""}));
        }
        for d in deltas {
            let lps = self.outs.get_mut(i).and_then(|o| o.take_lps(true));
            let v = openai::chat_chunk(&self.meta, i, d, lps, None);
            self.queue
                .push_back(SseEvent::default().data(v.to_string()));
        }
    }

    pub(super) fn chunk(&mut self, i: usize, text: &str, finish: Option<Finish>) -> SseEvent {
        let lps = match self.outs.get_mut(i) {
            Some(o) if finish.is_none() => o.take_lps(self.chat),
            _ => None,
        };
        let v = if self.chat {
            let delta = if finish.is_some() {
                json!({})
            } else {
                json!({"content": text})
            };
            openai::chat_chunk(&self.meta, i, delta, lps, finish)
        } else {
            openai::completion_chunk(&self.meta, i, text, lps, finish)
        };
        SseEvent::default().data(v.to_string())
    }

    pub(super) fn write_log(&mut self, status: u16, finish: String, error: Option<String>) {
        let Some(mut l) = self.log.take() else {
            return;
        };
        l.status = status;
        l.finish = finish;
        l.error = error;
        l.completion_tokens = self.outs.iter().map(|o| o.tokens).sum();
        l.ttft_ms = self.first.map(|t| ms(t - self.arrived));
        l.total_ms = ms(self.arrived.elapsed());
        reqlog::log(&l);
    }

    pub(super) fn end_with(&mut self, last: Option<SseEvent>, error: Option<String>) {
        match error {
            None => {
                let f = finish_reasons(&self.outs);
                self.write_log(200, f, None);
            }
            Some(m) => self.write_log(500, "error".into(), Some(m)),
        }
        self.queue.extend(last);
        self.queue.push_back(SseEvent::default().data("[DONE]"));
        self.over = true;
        self.rx = None;
    }

    pub(super) async fn next_event(&mut self) -> Option<SseEvent> {
        loop {
            if let Some(e) = self.queue.pop_front() {
                return Some(e);
            }
            if self.over {
                return None;
            }
            if self.left == 0 {
                self.usage.completion = self.outs.iter().map(|o| o.tokens).sum();
                let usage = self.include_usage.then(|| {
                    let object = if self.chat {
                        "chat.completion.chunk"
                    } else {
                        "text_completion"
                    };
                    let v = openai::usage_chunk(&self.meta, object, self.usage);
                    SseEvent::default().data(v.to_string())
                });
                self.end_with(usage, None);
                continue;
            }
            let ev = match self.rx.as_mut() {
                Some(rx) => rx.recv().await,
                None => None,
            };
            let Some((i, ev)) = ev else {
                let gone = scheduler_gone();
                let e = SseEvent::default().data(gone.body().to_string());
                self.end_with(Some(e), Some(gone.message));
                continue;
            };
            if matches!(ev, Event::Token(..)) && self.first.is_none() {
                self.first = Some(Instant::now());
            }
            match step(&mut self.outs, &self.ended_by_stop, i, ev) {
                Step::Failed(m) => {
                    let e = ApiError::new(500, "server_error", Some("engine_error"), m.clone());
                    let ev = SseEvent::default().data(e.body().to_string());
                    self.end_with(Some(ev), Some(m));
                }
                Step::Text(t, ended) if self.chat => {
                    self.chat_chunks(i, &t, ended);
                    if ended {
                        self.left -= 1;
                        let f = self.outs.get(i).and_then(|o| o.finish);
                        let c = self.chunk(i, "", Some(f.unwrap_or(Finish::Stop)));
                        self.queue.push_back(c);
                    }
                }
                Step::Text(t, ended) => {
                    let pending = self.outs.get(i).is_some_and(ChoiceOut::has_pending_lps);
                    // Text goes out as it is released; held-back logprobs go with the last text.
                    if !t.is_empty() || (ended && pending) {
                        let c = self.chunk(i, &t, None);
                        self.queue.push_back(c);
                    }
                    if ended {
                        self.left -= 1;
                        let f = self.outs.get(i).and_then(|o| o.finish);
                        let c = self.chunk(i, "", Some(f.unwrap_or(Finish::Stop)));
                        self.queue.push_back(c);
                    }
                }
            }
        }
    }
}
