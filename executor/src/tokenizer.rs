//! The project's tokenizer: a Hugging Face `tokenizers::Tokenizer` loaded from a
//! `tokenizer.json` (with `tokenizer_config.json` beside it for the chat template and the
//! special tokens), or rebuilt from a GGUF's embedded vocabulary (`tokenizer.ggml.*`, the
//! `gpt2` byte-level BPE model with Qwen2's pre-tokenizer).
//! Invariant: both constructors produce the same kind of `tokenizers::Tokenizer`, so
//! encoding a text gives the same ids whichever file the vocabulary came from; every id
//! this type hands out is inside the vocabulary.

use std::path::{Path, PathBuf};
use strata_schemas::files;
use strata_schemas::gguf::{GgufArray, GgufFile, GgufValue};

/// Qwen2's pre-tokenizer split (the regex of its `tokenizer.json`), also used by llama.cpp
/// for the `qwen2` pre-tokenizer type.
pub const QWEN2_SPLIT_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// End-of-turn tokens that chat models emit besides their configured EOS.
const END_TOKENS: [&str; 4] = ["<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>"];

/// A tokenizer that cannot be built or used, naming the file or key and the fix.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(
        "`{path}` is not a valid tokenizer: {reason} (expected a Hugging Face tokenizer.json)"
    )]
    Parse { path: String, reason: String },
    #[error("`{path}`: tokenizer_config.json is not valid JSON: {reason}")]
    Config { path: String, reason: String },
    #[error("GGUF `{path}`: {reason}")]
    Gguf { path: String, reason: String },
    #[error(transparent)]
    File(#[from] strata_schemas::files::FileError),
    #[error("tokenizer: {0}")]
    Codec(String),
}

/// A tokenizer with the model's special tokens and chat template.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// `inner` with special-token matching off: special-token text encodes as plain text.
    literal: tokenizers::Tokenizer,
    eos: Vec<u32>,
    bos: Option<u32>,
    chat_template: Option<String>,
    source: String,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("source", &self.source)
            .field("vocab", &self.vocab_size())
            .field("eos", &self.eos)
            .field("bos", &self.bos)
            .field("chat_template", &self.chat_template.is_some())
            .finish()
    }
}

/// A special token given in `tokenizer_config.json`: a string or `{"content": ...}`.
fn config_token(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

impl Tokenizer {
    /// The tokenizer that belongs to a model: `tokenizer.json` in a model folder, or the
    /// vocabulary embedded in a GGUF file. `Ok(None)` when the model carries none (a folder
    /// without `tokenizer.json`, a GGUF without `tokenizer.ggml.model`).
    pub fn for_model(model: impl AsRef<Path>) -> Result<Option<Self>, TokenizerError> {
        let model = model.as_ref();
        if model.is_dir() {
            if !model.join("tokenizer.json").is_file() {
                return Ok(None);
            }
            return Self::from_file(model).map(Some);
        }
        let gguf =
            strata_schemas::gguf::read::read_gguf(model).map_err(|e| TokenizerError::Gguf {
                path: model.display().to_string(),
                reason: e.to_string(),
            })?;
        if gguf
            .get_str("tokenizer.ggml.model")
            .ok()
            .flatten()
            .is_none()
        {
            return Ok(None);
        }
        Self::from_gguf(&gguf).map(Some)
    }

    /// Load `path`: a `tokenizer.json`, or a folder holding one. A `tokenizer_config.json`
    /// in the same folder supplies `chat_template`, `eos_token` and `bos_token`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        let path = path.as_ref();
        let file: PathBuf = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        let shown = file.display().to_string();
        let bytes = files::read_limited(&file, files::limit::TOKENIZER_JSON, "tokenizer")?;
        let inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| TokenizerError::Parse {
                path: shown.clone(),
                reason: e.to_string(),
            })?;
        let cfg_path = file
            .parent()
            .unwrap_or(Path::new("."))
            .join("tokenizer_config.json");
        let cfg_bytes = files::read_limited(
            &cfg_path,
            files::limit::TOKENIZER_CONFIG,
            "tokenizer config",
        );
        let cfg: Option<serde_json::Value> = match cfg_bytes {
            Ok(b) => Some(
                serde_json::from_slice(&b).map_err(|e| TokenizerError::Config {
                    path: cfg_path.display().to_string(),
                    reason: e.to_string(),
                })?,
            ),
            Err(e) if e.io_kind() == Some(std::io::ErrorKind::NotFound) => None,
            Err(e) => return Err(e.into()),
        };
        let get = |k: &str| cfg.as_ref().and_then(|c| c.get(k));
        // A template may also be a list of named templates; take the default one.
        let chat_template = match get("chat_template") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
            _ => None,
        };
        let eos_tok = config_token(get("eos_token"));
        let bos_tok = config_token(get("bos_token"));
        let eos_id = eos_tok.as_deref().and_then(|t| inner.token_to_id(t));
        let bos = bos_tok.as_deref().and_then(|t| inner.token_to_id(t));
        Ok(Self::finish(inner, eos_id, bos, chat_template, shown))
    }

    /// Rebuild the tokenizer embedded in a GGUF header: `tokenizer.ggml.model = "gpt2"`
    /// (byte-level BPE) with `tokenizer.ggml.tokens`, `tokenizer.ggml.merges` and optional
    /// `tokenizer.ggml.token_type` (3 = control and 4 = user-defined become special added
    /// tokens), `tokenizer.ggml.{eos,bos}_token_id`, `tokenizer.chat_template`.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self, TokenizerError> {
        let path = gguf.path.clone();
        let err = |reason: String| TokenizerError::Gguf {
            path: path.clone(),
            reason,
        };
        let kind = gguf
            .get_str("tokenizer.ggml.model")
            .map_err(|e| err(e.to_string()))?
            .ok_or_else(|| {
                err("no `tokenizer.ggml.model`: this GGUF carries no vocabulary; pass a tokenizer.json".into())
            })?;
        if kind != "gpt2" {
            return Err(err(format!(
                "`tokenizer.ggml.model` is `{kind}`; only `gpt2` (byte-level BPE, as Qwen uses) is supported: pass the model's tokenizer.json instead"
            )));
        }
        let strings = |key: &str| -> Result<Vec<String>, TokenizerError> {
            match gguf.get_array(key).map_err(|e| err(e.to_string()))? {
                Some(GgufArray::Strings(v)) => Ok(v.clone()),
                Some(a) => Err(err(format!(
                    "`{key}` is an array of type id {}, expected strings",
                    a.elem_type_id()
                ))),
                None => Err(err(format!("`{key}` is missing"))),
            }
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?;
        if tokens.is_empty() {
            return Err(err("`tokenizer.ggml.tokens` is empty".into()));
        }
        let types: Vec<u64> = match gguf
            .get_array("tokenizer.ggml.token_type")
            .map_err(|e| err(e.to_string()))?
        {
            Some(a) => a
                .to_u64_vec()
                .ok_or_else(|| err("`tokenizer.ggml.token_type` is not an integer array".into()))?,
            None => Vec::new(),
        };
        if !types.is_empty() && types.len() != tokens.len() {
            return Err(err(format!(
                "`tokenizer.ggml.token_type` has {} entries but there are {} tokens",
                types.len(),
                tokens.len()
            )));
        }
        let mut vocab = serde_json::Map::new();
        let mut added = Vec::new();
        for (id, tok) in tokens.iter().enumerate() {
            let ty = types.get(id).copied().unwrap_or(1);
            if ty == 3 || ty == 4 {
                added.push(serde_json::json!({
                    "id": id, "content": tok, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": ty == 3,
                }));
            }
            if vocab.insert(tok.clone(), serde_json::json!(id)).is_some() {
                return Err(err(format!(
                    "token {id} `{tok}` appears twice in `tokenizer.ggml.tokens`"
                )));
            }
        }
        for (i, m) in merges.iter().enumerate() {
            let mut parts = m.split(' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some(a), Some(b), None) if !a.is_empty() && !b.is_empty() => {}
                _ => {
                    return Err(err(format!(
                        "merge {i} `{m}` is not two tokens separated by one space"
                    )))
                }
            }
        }
        let byte_level = serde_json::json!({
            "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false
        });
        let json = serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": {"type": "NFC"},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT_REGEX}, "behavior": "Isolated", "invert": false},
                byte_level,
            ]},
            "post_processor": byte_level,
            "decoder": byte_level,
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
                "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false,
                "ignore_merges": false, "vocab": vocab, "merges": merges,
            },
        });
        let inner =
            tokenizers::Tokenizer::from_bytes(json.to_string().as_bytes()).map_err(|e| {
                err(format!(
                    "the embedded vocabulary does not form a BPE tokenizer: {e}"
                ))
            })?;
        let id_key = |key: &str| -> Result<Option<u32>, TokenizerError> {
            match gguf.get(key) {
                None => Ok(None),
                Some(v) => match v.as_u64() {
                    Some(id) if (id as usize) < tokens.len() => Ok(Some(id as u32)),
                    _ => Err(err(format!(
                        "`{key}` is {v:?}, not a token id below {}",
                        tokens.len()
                    ))),
                },
            }
        };
        let eos = id_key("tokenizer.ggml.eos_token_id")?;
        let bos = id_key("tokenizer.ggml.bos_token_id")?;
        let template = match gguf.get("tokenizer.chat_template") {
            Some(GgufValue::String(s)) => Some(s.clone()),
            _ => None,
        };
        Ok(Self::finish(inner, eos, bos, template, path))
    }

    fn finish(
        inner: tokenizers::Tokenizer,
        eos: Option<u32>,
        bos: Option<u32>,
        chat_template: Option<String>,
        source: String,
    ) -> Self {
        let mut eos_ids: Vec<u32> = eos.into_iter().collect();
        for t in END_TOKENS {
            if let Some(id) = inner.token_to_id(t) {
                if !eos_ids.contains(&id) {
                    eos_ids.push(id);
                }
            }
        }
        let mut literal = inner.clone();
        literal.set_encode_special_tokens(true);
        Self {
            inner,
            literal,
            eos: eos_ids,
            bos,
            chat_template,
            source,
        }
    }

    /// Token ids of `text`. `add_special` runs the post-processor (e.g. a BOS for models
    /// that want one); special tokens written in the text (`<|im_start|>`) are always
    /// recognised.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .inner
            .encode(text, add_special)
            .map_err(|e| TokenizerError::Codec(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of `text` with special-token text encoded as ordinary text
    /// (`<|im_end|>` becomes the tokens of those ten characters).
    pub fn encode_literal(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .literal
            .encode(text, false)
            .map_err(|e| TokenizerError::Codec(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of every special (added, special-flagged) token, in id order.
    pub fn special_tokens(&self) -> Vec<String> {
        let mut v: Vec<(u32, String)> = self
            .inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, t)| (id, t.content))
            .collect();
        v.sort();
        v.into_iter().map(|(_, t)| t).collect()
    }

    /// Text of `ids`; ids outside the vocabulary decode to nothing. Bytes that do not form
    /// valid UTF-8 (a token sequence cut inside a character) become U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| TokenizerError::Codec(e.to_string()))
    }

    /// Ids that end a generation: the configured EOS and the chat end-of-turn tokens present
    /// in the vocabulary.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// The model's own Jinja chat template, when it ships one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The id of a token (special or not) written exactly as `token`.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The text form of token `id`, as stored in the vocabulary.
    pub fn token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The bytes token `id` stands for (what `logprobs` reports as `bytes`): the UTF-8 of
    /// its text when that decodes whole; else a `<0xHH>` byte-fallback piece as that byte, or
    /// a byte-level BPE piece mapped back through GPT-2's byte-to-character table (a token
    /// holding part of a character).
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let text = self.decode(&[id], false).ok()?;
        if !text.contains('\u{FFFD}') {
            return Some(text.into_bytes());
        }
        let piece = self.token(id)?;
        if let Some(h) = piece.strip_prefix("<0x").and_then(|r| r.strip_suffix('>')) {
            if let Ok(b) = u8::from_str_radix(h, 16) {
                return Some(vec![b]);
            }
        }
        let mapped: Option<Vec<u8>> = piece.chars().map(byte_level_byte).collect();
        Some(mapped.unwrap_or_else(|| text.into_bytes()))
    }

    /// The text of `id` if it is a special (added, special-flagged) token.
    pub fn special_token(&self, id: u32) -> Option<String> {
        self.inner
            .get_added_tokens_decoder()
            .get(&id)
            .filter(|t| t.special)
            .map(|t| t.content.clone())
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Where the vocabulary came from (file path or GGUF path).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The underlying Hugging Face tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// The byte a character of a byte-level BPE piece stands for (GPT-2's `bytes_to_unicode`:
/// printable Latin-1 bytes are themselves, the other 68 are U+0100 onwards in byte order).
fn byte_level_byte(c: char) -> Option<u8> {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    let c = c as u32;
    if c < 0x100 {
        return printable(c).then_some(c as u8);
    }
    (0..=255u32)
        .filter(|&b| !printable(b))
        .nth((c - 0x100) as usize)
        .map(|b| b as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/tiny-chat")
    }

    #[test]
    fn token_bytes_spell_the_text_also_inside_a_character() {
        let t = Tokenizer::from_file(fixture()).unwrap();
        let text = "Héllo ✓ wörld 日本";
        let ids = t.encode(text, false).unwrap();
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&i| t.token_bytes(i).unwrap())
            .collect();
        assert_eq!(bytes, text.as_bytes());
        assert_eq!(byte_level_byte('Ġ'), Some(b' '));
        assert_eq!(byte_level_byte('a'), Some(b'a'));
        assert_eq!(byte_level_byte('\u{ad}'), None);
    }

    /// A GGUF header (only metadata matters here) carrying the fixture's vocabulary.
    fn gguf_of(t: &Tokenizer) -> GgufFile {
        let n = t.vocab_size();
        let tokens: Vec<String> = (0..n as u32).map(|i| t.token(i).unwrap()).collect();
        let json: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixture().join("tokenizer.json")).unwrap(),
        )
        .unwrap();
        let merges: Vec<String> = json["model"]["merges"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m.as_str().unwrap().to_string())
            .collect();
        let types: Vec<i32> = (0..n as u32)
            .map(|i| if t.special_token(i).is_some() { 3 } else { 1 })
            .collect();
        GgufFile {
            path: "tiny.gguf".into(),
            version: 3,
            metadata: vec![
                (
                    "tokenizer.ggml.model".into(),
                    GgufValue::String("gpt2".into()),
                ),
                (
                    "tokenizer.ggml.tokens".into(),
                    GgufValue::Array(GgufArray::Strings(tokens)),
                ),
                (
                    "tokenizer.ggml.merges".into(),
                    GgufValue::Array(GgufArray::Strings(merges)),
                ),
                (
                    "tokenizer.ggml.token_type".into(),
                    GgufValue::Array(GgufArray::I32(types)),
                ),
                ("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(399)),
                (
                    "tokenizer.chat_template".into(),
                    GgufValue::String(t.chat_template().unwrap().to_string()),
                ),
            ],
            tensors: vec![],
            alignment: 32,
            data_offset: 0,
            file_size: 0,
            parts: vec![],
        }
    }

    #[test]
    fn fixture_round_trips_and_knows_its_specials() {
        let t = Tokenizer::from_file(fixture()).unwrap();
        assert_eq!(t.vocab_size(), 400);
        let text = "Hello there! The capital of France is Paris.\n  Ünïcode ✓ 42";
        let ids = t.encode(text, false).unwrap();
        assert!(ids.iter().all(|&i| i < 400));
        assert!(ids.len() < text.len(), "merges compress common words");
        assert_eq!(t.decode(&ids, false).unwrap(), text);
        let im_end = t.token_id("<|im_end|>").unwrap();
        assert_eq!(im_end, 399);
        assert!(t.eos_ids().contains(&399) && t.eos_ids().contains(&397));
        assert_eq!(t.bos_id(), None);
        assert_eq!(
            t.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap()[0],
            398,
            "special tokens in text are matched whole"
        );
        assert_eq!(t.decode(&[398, im_end], true).unwrap(), "");
        assert_eq!(t.special_token(399).as_deref(), Some("<|im_end|>"));
        let lit = t.encode_literal("<|im_end|>").unwrap();
        assert!(lit.len() > 1 && !lit.contains(&399), "{lit:?}");
        assert_eq!(t.decode(&lit, true).unwrap(), "<|im_end|>");
        let sp = t.special_tokens();
        assert!(
            sp.contains(&"<|im_end|>".to_string()) && sp.contains(&"<|im_start|>".to_string()),
            "{sp:?}"
        );
        assert!(t.chat_template().unwrap().contains("im_start"));
    }

    #[test]
    fn gguf_vocabulary_builds_the_same_tokenizer() {
        let t = Tokenizer::from_file(fixture()).unwrap();
        let g = Tokenizer::from_gguf(&gguf_of(&t)).unwrap();
        for text in [
            "Once upon a time there was a little robot.",
            "a'll  \n\n x=1+2;",
            "日本語 ok",
        ] {
            assert_eq!(
                g.encode(text, false).unwrap(),
                t.encode(text, false).unwrap(),
                "{text}"
            );
        }
        assert_eq!(g.eos_ids()[0], 399);
        assert_eq!(g.chat_template(), t.chat_template());
        assert_eq!(g.special_token(398).as_deref(), Some("<|im_start|>"));
    }

    #[test]
    fn bad_inputs_are_errors_that_name_the_source() {
        let e = Tokenizer::from_file("/nonexistent/tokenizer.json").unwrap_err();
        assert!(e.to_string().contains("/nonexistent/tokenizer.json"), "{e}");
        let t = Tokenizer::from_file(fixture()).unwrap();
        let mut g = gguf_of(&t);
        g.metadata[0].1 = GgufValue::String("llama".into());
        let e = Tokenizer::from_gguf(&g).unwrap_err().to_string();
        assert!(e.contains("tiny.gguf") && e.contains("llama"), "{e}");
        let mut g = gguf_of(&t);
        g.metadata[2].1 = GgufValue::Array(GgufArray::Strings(vec!["abc".into()]));
        let e = Tokenizer::from_gguf(&g).unwrap_err().to_string();
        assert!(e.contains("merge 0"), "{e}");
        let mut g = gguf_of(&t);
        g.metadata[4].1 = GgufValue::U32(100_000);
        assert!(Tokenizer::from_gguf(&g).is_err());
    }
}
