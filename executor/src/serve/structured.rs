//! Structured output (`response_format`): `json_object` and `json_schema` compiled by
//! llguidance against a token trie of the served tokenizer ([`Grammars`]), and the
//! per-sequence [`Constraint`] that gives each step's token mask (applied before any other
//! processing, where the backend picks: on the device where it samples there) and follows
//! the tokens drawn.
//! Invariant: a constrained sequence only ever draws a token its grammar allows at that
//! point (every other id is `-inf` before any other processing, so the output is a prefix
//! of a document the schema accepts, and a whole one when it ends by end-of-sequence); a
//! schema llguidance cannot compile is refused before the request is queued, as a 400
//! naming `response_format`.

use super::openai::ApiError;
use crate::tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use std::sync::Arc;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

/// What a request's `response_format` asks for (`{"type": "text"}` is no constraint).
#[derive(Debug, Clone, PartialEq)]
pub enum ResponseFormat {
    /// `{"type": "json_object"}`: any JSON object.
    JsonObject,
    /// `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`.
    JsonSchema { name: String, schema: Value },
}

/// Why structured output cannot be served for a request or a tokenizer.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StructuredError {
    #[error("`response_format` needs the model's tokenizer, and this server has none (it serves token ids only); serve a model folder with tokenizer.json, or leave `response_format` out")]
    NoTokenizer,
    #[error("`response_format` is unavailable: the tokenizer could not be turned into a token trie for constrained decoding: {0}")]
    Trie(String),
    #[error("`response_format.json_schema.schema` ({name}) cannot be used for constrained decoding: {reason}; fix the schema (llguidance's JSON Schema subset: https://github.com/guidance-ai/llguidance/blob/main/docs/json_schema.md)")]
    Schema { name: String, reason: String },
}

impl From<StructuredError> for ApiError {
    fn from(e: StructuredError) -> Self {
        let code = match e {
            StructuredError::Schema { .. } => "invalid_value",
            _ => "unsupported_parameter",
        };
        ApiError::param(code, e.to_string())
    }
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::param("invalid_value", msg)
}

/// Parse `response_format`: absent or `{"type": "text"}` is `None`.
pub fn parse_response_format(v: Option<&Value>) -> Result<Option<ResponseFormat>, ApiError> {
    let Some(v) = v else { return Ok(None) };
    let Some(o) = v.as_object() else {
        return Err(bad(
            "`response_format` must be an object such as {\"type\": \"json_object\"}",
        ));
    };
    match o.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(ResponseFormat::JsonObject)),
        Some("json_schema") => {
            let Some(js) = o.get("json_schema").and_then(Value::as_object) else {
                return Err(bad("`response_format.json_schema` must be an object with `name` and `schema` when `type` is \"json_schema\""));
            };
            let name = match js.get("name") {
                Some(Value::String(s)) if !s.is_empty() => s.clone(),
                Some(_) => return Err(bad("`response_format.json_schema.name` must be a non-empty string")),
                None => return Err(bad("`response_format.json_schema.name` is required (OpenAI's shape); give the schema a name")),
            };
            match js.get("strict") {
                None | Some(Value::Bool(_)) | Some(Value::Null) => {}
                Some(_) => {
                    return Err(bad(
                        "`response_format.json_schema.strict` must be true or false",
                    ))
                }
            }
            let schema = match js.get("schema") {
                Some(s @ Value::Object(_)) => s.clone(),
                Some(_) => {
                    return Err(bad(
                        "`response_format.json_schema.schema` must be a JSON Schema object",
                    ))
                }
                // OpenAI allows leaving it out: any JSON value.
                None => json!({}),
            };
            Ok(Some(ResponseFormat::JsonSchema { name, schema }))
        }
        Some(t) => Err(bad(format!(
            "`response_format.type` is \"{t}\"; use \"text\", \"json_object\" or \"json_schema\""
        ))),
        None => Err(bad(
            "`response_format.type` is required: \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

/// The served tokenizer as llguidance sees it: the trie of every token's bytes (special
/// tokens behind toktrie's marker byte, ids past the tokenizer up to the model's vocabulary
/// as unreachable placeholders) and the tokenizer itself for canonical tokenization.
struct TrieEnv {
    trie: TokTrie,
    tok: Arc<Tokenizer>,
}

impl TokenizerEnv for TrieEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie
            .tokenize_with_greedy_fallback(s, |s| self.tok.encode_literal(s).unwrap_or_default())
    }
}

/// The grammar compiler for one served tokenizer (built once when the model is ready).
pub struct Grammars {
    factory: ParserFactory,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("vocab", &self.factory.tok_env().tok_trie().vocab_size())
            .finish()
    }
}

impl Grammars {
    /// The compiler for `tok` over a model vocabulary of `n_vocab` logits; `eos` are the
    /// ids that end a generation (the grammar allows them once the document is complete).
    pub fn new(tok: Arc<Tokenizer>, n_vocab: usize, eos: &[u32]) -> Result<Self, StructuredError> {
        let size = tok.vocab_size().max(n_vocab);
        let mut words = Vec::with_capacity(size);
        for id in 0..size as u32 {
            let w = if let Some(s) = tok.special_token(id) {
                let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                b.extend_from_slice(s.as_bytes());
                b
            } else if let Some(b) = tok.token_bytes(id).filter(|_| tok.token(id).is_some()) {
                b
            } else {
                // An id the tokenizer lacks: a special placeholder no grammar can produce.
                let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                b.extend_from_slice(format!("<[{id}]>").as_bytes());
                b
            };
            words.push(w);
        }
        let eos: Vec<u32> = eos
            .iter()
            .copied()
            .filter(|&i| (i as usize) < size)
            .collect();
        let Some(&first) = eos.first() else {
            return Err(StructuredError::Trie(
                "the tokenizer names no end-of-sequence token, so a constrained document could never end".into(),
            ));
        };
        let info = TokRxInfo::new(size as u32, first);
        let mut trie = TokTrie::from(&info, &words);
        if eos.len() > 1 {
            trie = trie.with_eos_tokens(&eos);
        }
        let env: TokEnv = Arc::new(TrieEnv { trie, tok });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| StructuredError::Trie(e.to_string()))?;
        factory.quiet();
        Ok(Self { factory })
    }

    /// Compile `f` into a fresh constraint. JSON is generated compact (no whitespace between
    /// tokens) unless the schema sets llguidance's own `x-guidance` options.
    pub fn compile(&self, f: &ResponseFormat) -> Result<Constraint, StructuredError> {
        let (name, mut schema) = match f {
            ResponseFormat::JsonObject => ("json_object".to_string(), json!({"type": "object"})),
            ResponseFormat::JsonSchema { name, schema } => (name.clone(), schema.clone()),
        };
        if let Some(o) = schema.as_object_mut() {
            o.entry("x-guidance")
                .or_insert_with(|| json!({"whitespace_flexible": false}));
        }
        let grammar = TopLevelGrammar::from_json_schema(schema);
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| StructuredError::Schema {
                name: name.clone(),
                reason: e.to_string(),
            })?;
        let mut matcher = Matcher::new(Ok(parser));
        // Some schemas only fail once the first mask is computed.
        if let Err(e) = matcher.compute_mask() {
            return Err(StructuredError::Schema {
                name,
                reason: e.to_string(),
            });
        }
        Ok(Constraint { matcher })
    }
}

/// One sequence's grammar state.
pub struct Constraint {
    matcher: Matcher,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Constraint {
    /// An independent copy in the same state (one per choice of an `n > 1` request).
    pub fn fork(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
        }
    }

    /// The tokens the grammar allows next, one bit each (bit `i % 32` of word `i / 32`), into
    /// `words` (the mask of [`crate::pick::RowProc`], applied by the backend where it picks).
    /// Fails when the grammar is in an error state (never expected: only allowed tokens are
    /// fed to it).
    pub fn mask_words(&mut self, words: &mut Vec<u32>) -> Result<(), String> {
        let m = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| format!("structured output: {e}"))?;
        words.clear();
        words.extend_from_slice(m.as_slice());
        Ok(())
    }

    /// Follow the drawn token `tok`.
    pub fn advance(&mut self, tok: u32) -> Result<(), String> {
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher
            .consume_token(tok)
            .map_err(|e| format!("structured output: token {tok} does not fit the grammar: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_accepts_the_openai_shapes_and_names_bad_fields() {
        assert_eq!(parse_response_format(None).unwrap(), None);
        assert_eq!(
            parse_response_format(Some(&json!({"type": "text"}))).unwrap(),
            None
        );
        assert_eq!(
            parse_response_format(Some(&json!({"type": "json_object"}))).unwrap(),
            Some(ResponseFormat::JsonObject)
        );
        let s = json!({"type": "object"});
        assert_eq!(
            parse_response_format(Some(&json!({"type": "json_schema",
                "json_schema": {"name": "x", "schema": s, "strict": true}})))
            .unwrap(),
            Some(ResponseFormat::JsonSchema {
                name: "x".into(),
                schema: s
            })
        );
        for (v, field) in [
            (json!("json"), "`response_format`"),
            (json!({"type": "xml"}), "`response_format.type`"),
            (json!({}), "`response_format.type`"),
            (
                json!({"type": "json_schema"}),
                "`response_format.json_schema`",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"schema": {}}}),
                "`response_format.json_schema.name`",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "a", "schema": 3}}),
                "`response_format.json_schema.schema`",
            ),
        ] {
            let e = parse_response_format(Some(&v)).unwrap_err();
            assert_eq!(e.status, 400);
            assert!(e.message.contains(field), "{field}: {}", e.message);
        }
    }
}
