//! The shape of one chat choice's output: the reasoning split ([`super::reasoning`]), then
//! tool calls in the answer ([`super::tools`]), as a whole message or as stream deltas.
//! Invariant: the streamed deltas of an output, joined, equal the whole message of it (for
//! a prompt-opened think block; a whole output may also be recognised as one by its
//! `</think>` alone), and with neither feature on the output passes through unchanged.

use super::reasoning::{opened_in_whole, Piece, ReasoningSplit};
use super::tools::{ToolCall, ToolCallParser, ToolPiece};
use serde_json::{json, Value};

/// What to do with a chat choice's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ShapeConfig {
    /// Split `<think>` blocks into `reasoning_content`.
    pub reasoning: bool,
    /// The prompt ended inside an open think block.
    pub think_open: bool,
    /// Parse `<tool_call>` blocks into `tool_calls`.
    pub tools: bool,
}

/// A finished chat message.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Shaped {
    /// `None` when the message is only tool calls.
    pub content: Option<String>,
    pub reasoning: Option<String>,
    pub tool_calls: Vec<ToolCall>,
}

impl Shaped {
    /// The `message` object.
    pub fn json(&self) -> Value {
        let mut m = json!({"role": "assistant", "content": self.content});
        if let Some(r) = &self.reasoning {
            m["reasoning_content"] = json!(r);
        }
        if !self.tool_calls.is_empty() {
            let calls: Vec<Value> = self.tool_calls.iter().map(|c| c.json(None)).collect();
            m["tool_calls"] = Value::Array(calls);
        }
        m
    }
}

/// Incremental shaper of one choice.
#[derive(Debug, Clone)]
pub struct ChatShaper {
    reasoning: Option<ReasoningSplit>,
    tools: Option<ToolCallParser>,
    /// Calls emitted so far (the next call's stream index).
    pub calls: usize,
}

impl ChatShaper {
    pub fn new(cfg: ShapeConfig) -> Self {
        Self {
            reasoning: cfg.reasoning.then(|| ReasoningSplit::new(cfg.think_open)),
            tools: cfg.tools.then(ToolCallParser::new),
            calls: 0,
        }
    }

    fn answer(&mut self, text: &str, last: bool, deltas: &mut Vec<Delta>) {
        let Some(t) = self.tools.as_mut() else {
            if !text.is_empty() {
                deltas.push(Delta::Content(text.to_string()));
            }
            return;
        };
        let mut out = Vec::new();
        t.push(text, &mut out);
        if last {
            t.finish(&mut out);
        }
        for p in out {
            match p {
                ToolPiece::Text(s) => deltas.push(Delta::Content(s)),
                ToolPiece::Call(c) => {
                    deltas.push(Delta::Call(self.calls, c));
                    self.calls += 1;
                }
            }
        }
    }

    fn run(&mut self, text: &str, last: bool) -> Vec<Delta> {
        let mut deltas = Vec::new();
        let Some(r) = self.reasoning.as_mut() else {
            self.answer(text, last, &mut deltas);
            return merge(deltas);
        };
        let mut pieces = Vec::new();
        r.push(text, &mut pieces);
        if last {
            r.finish(&mut pieces);
        }
        let mut answer = String::new();
        for p in pieces {
            match p {
                Piece::Reasoning(s) => deltas.push(Delta::Reasoning(s)),
                Piece::Content(s) => answer.push_str(&s),
            }
        }
        self.answer(&answer, last, &mut deltas);
        merge(deltas)
    }

    /// Deltas for more output.
    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        self.run(text, false)
    }

    /// Deltas for the held output at the end.
    pub fn finish(&mut self) -> Vec<Delta> {
        self.run("", true)
    }
}

/// One stream delta.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delta {
    Reasoning(String),
    Content(String),
    /// A whole call with its index among the choice's calls.
    Call(usize, ToolCall),
}

impl Delta {
    /// The `delta` object of a chunk.
    pub fn json(&self) -> Value {
        match self {
            Delta::Reasoning(s) => json!({"reasoning_content": s}),
            Delta::Content(s) => json!({"content": s}),
            Delta::Call(i, c) => json!({"tool_calls": [c.json(Some(*i))]}),
        }
    }
}

/// Adjacent text deltas of one kind joined.
fn merge(v: Vec<Delta>) -> Vec<Delta> {
    let mut out: Vec<Delta> = Vec::with_capacity(v.len());
    for d in v {
        match (out.last_mut(), d) {
            (Some(Delta::Reasoning(a)), Delta::Reasoning(b)) => a.push_str(&b),
            (Some(Delta::Content(a)), Delta::Content(b)) => a.push_str(&b),
            (_, d) => out.push(d),
        }
    }
    out
}

/// The whole message of a finished output.
pub fn shape_whole(mut cfg: ShapeConfig, text: &str) -> Shaped {
    if !cfg.reasoning && !cfg.tools {
        return Shaped {
            content: Some(text.to_string()),
            ..Shaped::default()
        };
    }
    if cfg.reasoning {
        cfg.think_open = opened_in_whole(text, cfg.think_open);
    }
    let mut s = ChatShaper::new(cfg);
    let mut deltas = s.push(text);
    deltas.extend(s.finish());
    let mut m = Shaped::default();
    let mut content = String::new();
    let mut reasoning = String::new();
    for d in deltas {
        match d {
            Delta::Reasoning(t) => reasoning.push_str(&t),
            Delta::Content(t) => content.push_str(&t),
            Delta::Call(_, c) => m.tool_calls.push(c),
        }
    }
    m.reasoning = (!reasoning.is_empty()).then_some(reasoning);
    m.content = if content.is_empty() && !m.tool_calls.is_empty() {
        None
    } else {
        Some(content)
    };
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOTH: ShapeConfig = ShapeConfig {
        reasoning: true,
        think_open: false,
        tools: true,
    };

    #[test]
    fn reasoning_then_calls_whole_and_streamed() {
        let text = "<think>\nNeed weather.\n</think>\n\n<tool_call>\n{\"name\": \"w\", \"arguments\": {\"c\": \"P\"}}\n</tool_call>";
        let m = shape_whole(BOTH, text);
        assert_eq!(m.reasoning.as_deref(), Some("Need weather."));
        assert_eq!(m.content, None);
        assert_eq!(m.tool_calls.len(), 1);
        assert_eq!(m.tool_calls[0].arguments, r#"{"c":"P"}"#);
        let j = m.json();
        assert_eq!(j["tool_calls"][0]["function"]["name"], "w");
        assert!(j["content"].is_null());

        // Streamed in 5-byte chunks: reasoning deltas, then one call delta with index 0.
        let mut s = ChatShaper::new(BOTH);
        let mut all = Vec::new();
        let b = text.as_bytes();
        for c in b.chunks(5) {
            all.extend(s.push(std::str::from_utf8(c).unwrap()));
        }
        all.extend(s.finish());
        let reasoning: String = all
            .iter()
            .filter_map(|d| match d {
                Delta::Reasoning(t) => Some(t.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(reasoning, "Need weather.");
        assert!(
            !all.iter().any(|d| matches!(d, Delta::Content(_))),
            "{all:?}"
        );
        match all.last().unwrap() {
            Delta::Call(0, c) => assert_eq!(c.name, "w"),
            d => panic!("{d:?}"),
        }
        assert_eq!(all.last().unwrap().json()["tool_calls"][0]["index"], 0);
    }

    #[test]
    fn off_passes_through_and_close_alone_splits_whole() {
        let off = ShapeConfig::default();
        let m = shape_whole(off, "<think>x</think>y");
        assert_eq!(m.content.as_deref(), Some("<think>x</think>y"));
        assert_eq!(
            ChatShaper::new(off).push("<think>"),
            vec![Delta::Content("<think>".into())]
        );
        let r = ShapeConfig {
            reasoning: true,
            ..ShapeConfig::default()
        };
        let m = shape_whole(r, "thought\n</think>\nanswer");
        assert_eq!(m.reasoning.as_deref(), Some("thought"));
        assert_eq!(m.content.as_deref(), Some("answer"));
        let m = shape_whole(r, "just an answer");
        assert_eq!(
            (m.reasoning, m.content.as_deref()),
            (None, Some("just an answer"))
        );
    }
}
