//! The `logprobs` objects of responses and chunks, in the two OpenAI shapes: chat
//! (`{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`) and
//! completions (`{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`).
//! Invariant: one entry per generated token, in order, each from the scheduler's log-softmax
//! of the model's raw logits; a token's text is its own decode (special tokens shown,
//! `token_id:N` without a tokenizer), `bytes` are the bytes it stands for (also a piece of a
//! character, whose text shows U+FFFD), and every number is
//! finite JSON (an impossible token's `-inf` is written `-9999.0`, as vLLM does).

use super::scheduler::TokenLogprobs;
use crate::tokenizer::Tokenizer;
use serde_json::{json, Map, Value};

/// One generated token and its log-probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct LpToken {
    pub id: u32,
    pub lp: TokenLogprobs,
}

/// The text of one token as `logprobs` shows it.
pub fn token_text(tok: Option<&Tokenizer>, id: u32) -> String {
    match tok.and_then(|t| t.decode(&[id], false).ok()) {
        Some(s) => s,
        None => format!("token_id:{id}"),
    }
}

fn num(x: f32) -> Value {
    json!(if x.is_finite() { x } else { -9999.0 })
}

fn entry(tok: Option<&Tokenizer>, id: u32, lp: f32) -> Map<String, Value> {
    let text = token_text(tok, id);
    let bytes = tok
        .and_then(|t| t.token_bytes(id))
        .unwrap_or_else(|| text.as_bytes().to_vec());
    let mut m = Map::new();
    m.insert("bytes".into(), json!(bytes));
    m.insert("token".into(), Value::String(text));
    m.insert("logprob".into(), num(lp));
    m
}

/// The chat shape of `items`.
pub fn chat(tok: Option<&Tokenizer>, items: &[LpToken]) -> Value {
    let content: Vec<Value> = items
        .iter()
        .map(|t| {
            let mut m = entry(tok, t.id, t.lp.logprob);
            let top: Vec<Value> =
                t.lp.top
                    .iter()
                    .map(|&(id, lp)| Value::Object(entry(tok, id, lp)))
                    .collect();
            m.insert("top_logprobs".into(), Value::Array(top));
            Value::Object(m)
        })
        .collect();
    json!({ "content": content })
}

/// The completions shape of `items`; `offset` is the length in bytes of the choice's text
/// before them (advanced past them).
pub fn completion(tok: Option<&Tokenizer>, items: &[LpToken], offset: &mut usize) -> Value {
    let mut tokens = Vec::with_capacity(items.len());
    let mut lps = Vec::with_capacity(items.len());
    let mut tops = Vec::with_capacity(items.len());
    let mut offsets = Vec::with_capacity(items.len());
    for t in items {
        let text = token_text(tok, t.id);
        offsets.push(*offset);
        *offset += text.len();
        // As vLLM: the chosen token is always among its alternatives. Two ids of the same
        // text (pieces of characters) keep the likelier one's value.
        let mut top = Map::new();
        for &(id, lp) in &t.lp.top {
            top.entry(token_text(tok, id)).or_insert_with(|| num(lp));
        }
        top.entry(text.clone()).or_insert_with(|| num(t.lp.logprob));
        tokens.push(Value::String(text));
        lps.push(num(t.lp.logprob));
        tops.push(Value::Object(top));
    }
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn items() -> Vec<LpToken> {
        vec![
            LpToken {
                id: 7,
                lp: TokenLogprobs {
                    logprob: -0.5,
                    top: vec![(7, -0.5), (3, -1.5)],
                },
            },
            LpToken {
                id: 9,
                lp: TokenLogprobs {
                    logprob: f32::NEG_INFINITY,
                    top: vec![(2, -0.1)],
                },
            },
        ]
    }

    #[test]
    fn both_shapes_without_a_tokenizer() {
        let c = chat(None, &items());
        let e = &c["content"][0];
        assert_eq!(e["token"], "token_id:7");
        assert_eq!(e["logprob"], -0.5);
        assert_eq!(e["bytes"], json!(b"token_id:7"));
        assert_eq!(e["top_logprobs"][1]["token"], "token_id:3");
        assert_eq!(c["content"][1]["logprob"], -9999.0);
        let mut off = 4;
        let p = completion(None, &items(), &mut off);
        assert_eq!(p["tokens"], json!(["token_id:7", "token_id:9"]));
        assert_eq!(p["text_offset"], json!([4, 14]));
        assert_eq!(off, 24);
        assert_eq!(p["top_logprobs"][0]["token_id:3"], -1.5);
        assert_eq!(
            p["top_logprobs"][1]["token_id:9"], -9999.0,
            "the chosen token is among the alternatives"
        );
    }
}
