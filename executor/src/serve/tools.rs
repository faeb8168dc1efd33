//! Tool calls in chat output, Hermes/Qwen3 style: `<tool_call>\n{"name": ..., "arguments":
//! {...}}\n</tool_call>`, possibly several, parsed into OpenAI `tool_calls`.
//! Invariant: any split of the same output gives the same calls and text; a call whose JSON
//! does not parse (or that never closes and does not parse) stays in the text verbatim, tags
//! included, so no output is ever lost.

use super::reasoning::partial_tag;
use serde_json::{json, Value};
use std::hash::{BuildHasher, Hasher};

pub const CALL_OPEN: &str = "<tool_call>";
pub const CALL_CLOSE: &str = "</tool_call>";

/// One parsed call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// `call_` and 24 random hex digits.
    pub id: String,
    pub name: String,
    /// The arguments as a JSON string (OpenAI's shape).
    pub arguments: String,
}

impl ToolCall {
    /// The OpenAI `tool_calls` entry; `index` is added for stream deltas.
    pub fn json(&self, index: Option<usize>) -> Value {
        let mut v = json!({"id": self.id, "type": "function",
                           "function": {"name": self.name, "arguments": self.arguments}});
        if let Some(i) = index {
            v["index"] = json!(i);
        }
        v
    }
}

/// A fresh call id.
fn call_id() -> String {
    let s = std::collections::hash_map::RandomState::new();
    let mut h = s.build_hasher();
    h.write_u64(0x5eed);
    let a = h.finish();
    let mut h = s.build_hasher();
    h.write_u64(a);
    format!("call_{a:016x}{:08x}", h.finish() as u32)
}

/// The call in one `<tool_call>` body, when it is a JSON object with a `name` string and
/// `arguments` (or `parameters`) of any JSON type (a string is taken as already encoded).
pub fn parse_call(body: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let o = v.as_object()?;
    let name = o.get("name")?.as_str()?;
    if name.is_empty() {
        return None;
    }
    let arguments = match o.get("arguments").or_else(|| o.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
    };
    Some(ToolCall {
        id: call_id(),
        name: name.to_string(),
        arguments,
    })
}

/// A piece of output after the tool-call parser.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolPiece {
    Text(String),
    Call(ToolCall),
}

/// Incremental tool-call parser of one choice's answer text.
#[derive(Debug, Clone, Default)]
pub struct ToolCallParser {
    buf: String,
    /// Inside `<tool_call>` (the tag itself consumed).
    inside: bool,
    /// Calls parsed so far.
    pub calls: usize,
    /// The last thing out was a call: leading whitespace of the next text is dropped.
    after_call: bool,
    /// Whitespace dropped before the open call (restored if the call does not parse).
    gap: String,
}

impl ToolCallParser {
    pub fn new() -> Self {
        Self::default()
    }

    fn text(&mut self, t: &str, out: &mut Vec<ToolPiece>) {
        let t = if self.after_call { t.trim_start() } else { t };
        if !t.is_empty() {
            self.after_call = false;
            out.push(ToolPiece::Text(t.to_string()));
        }
    }

    /// Take more answer text; pieces that are certain go to `out`.
    pub fn push(&mut self, text: &str, out: &mut Vec<ToolPiece>) {
        self.buf.push_str(text);
        loop {
            if self.inside {
                let Some(i) = self.buf.find(CALL_CLOSE) else {
                    return;
                };
                let body = self.buf[..i].to_string();
                self.buf.drain(..i + CALL_CLOSE.len());
                self.inside = false;
                self.close(&body, true, out);
                continue;
            }
            if let Some(i) = self.buf.find(CALL_OPEN) {
                let before = self.buf[..i].trim_end().to_string();
                self.gap = self.buf[before.len()..i].to_string();
                self.text(&before, out);
                self.buf.drain(..i + CALL_OPEN.len());
                self.inside = true;
                continue;
            }
            // Hold a possible start of the tag and the whitespace before it.
            let p = partial_tag(&self.buf, CALL_OPEN);
            let cut = self.buf[..self.buf.len() - p].trim_end().len();
            let now = self.buf[..cut].to_string();
            self.buf.drain(..cut);
            self.text(&now, out);
            return;
        }
    }

    /// A call body ended (`closed`: by its tag; else by the end of output).
    fn close(&mut self, body: &str, closed: bool, out: &mut Vec<ToolPiece>) {
        match parse_call(body) {
            Some(c) => {
                self.calls += 1;
                self.after_call = true;
                out.push(ToolPiece::Call(c));
            }
            None => {
                let gap = if self.after_call {
                    String::new()
                } else {
                    std::mem::take(&mut self.gap)
                };
                let raw = format!(
                    "{gap}{CALL_OPEN}{body}{}",
                    if closed { CALL_CLOSE } else { "" }
                );
                self.after_call = false;
                out.push(ToolPiece::Text(raw));
            }
        }
    }

    /// The output ended: an unclosed call is parsed if it can be, else kept as text; held
    /// whitespace goes out unless a call came before it.
    pub fn finish(&mut self, out: &mut Vec<ToolPiece>) {
        let rest = std::mem::take(&mut self.buf);
        if self.inside {
            self.inside = false;
            self.close(&rest, false, out);
        } else if self.calls == 0 || !rest.trim().is_empty() {
            self.text(&rest, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (text, [(name, arguments)]) of `chunks`.
    fn run(chunks: &[&str]) -> (String, Vec<(String, String)>) {
        let mut p = ToolCallParser::new();
        let mut out = Vec::new();
        for c in chunks {
            p.push(c, &mut out);
        }
        p.finish(&mut out);
        let mut text = String::new();
        let mut calls = Vec::new();
        for x in out {
            match x {
                ToolPiece::Text(t) => text.push_str(&t),
                ToolPiece::Call(c) => {
                    assert!(c.id.starts_with("call_") && c.id.len() == 29, "{}", c.id);
                    calls.push((c.name, c.arguments));
                }
            }
        }
        (text, calls)
    }

    fn all_splits(text: &str, want_text: &str, want: &[(&str, &str)]) {
        let want: Vec<(String, String)> = want
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        let idx: Vec<usize> = (0..=text.len())
            .filter(|&i| text.is_char_boundary(i))
            .collect();
        for &a in &idx {
            for &b in idx.iter().filter(|&&b| b >= a).step_by(3) {
                let got = run(&[&text[..a], &text[a..b], &text[b..]]);
                assert_eq!(got.0, want_text, "{text:?} at {a},{b}");
                assert_eq!(got.1, want, "{text:?} at {a},{b}");
            }
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(run(&refs), (want_text.to_string(), want), "by chars");
    }

    #[test]
    fn one_call_with_text_around_it() {
        all_splits(
            "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            "Let me look.",
            &[("get_weather", r#"{"city":"Paris"}"#)],
        );
        all_splits(
            "<tool_call>{\"name\":\"f\",\"arguments\":{}}</tool_call>\nDone.",
            "Done.",
            &[("f", "{}")],
        );
    }

    #[test]
    fn several_calls_and_tricky_arguments() {
        let text = concat!(
            "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"q\": \"}{ </tool \\\" <tool_call>\", \"n\": {\"m\": [1, {\"k\": null}]}}}\n</tool_call>\n",
            "<tool_call>\n{\"name\": \"b\", \"parameters\": \"{\\\"x\\\": 1}\"}\n</tool_call>\n"
        );
        all_splits(
            text,
            "",
            &[
                (
                    "a",
                    r#"{"q":"}{ </tool \" <tool_call>","n":{"m":[1,{"k":null}]}}"#,
                ),
                ("b", r#"{"x": 1}"#),
            ],
        );
    }

    #[test]
    fn malformed_calls_stay_in_the_text() {
        let bad = "<tool_call>\n{\"name\": \"a\", \"arguments\": {oops}\n</tool_call>";
        all_splits(bad, bad, &[]);
        all_splits(
            "x <tool_call>{\"arguments\": {}}</tool_call> y",
            "x <tool_call>{\"arguments\": {}}</tool_call> y",
            &[],
        );
        // Unclosed: parsed when whole, else kept.
        all_splits(
            "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}",
            "",
            &[("a", "{}")],
        );
        all_splits(
            "<tool_call>\n{\"name\": \"a\", ",
            "<tool_call>\n{\"name\": \"a\", ",
            &[],
        );
        all_splits("no calls, just <tool", "no calls, just <tool", &[]);
        all_splits("trailing space  ", "trailing space  ", &[]);
    }
}
