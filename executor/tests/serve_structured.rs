//! Structured output (`response_format`) with the real CPU engine (tiny-chat-moe, random
//! weights: without the grammar its output is not JSON at all): 100 of 100 sampled
//! `json_schema` completions are valid against their schema (checked here field by field),
//! on chat and on completions, streamed too; `json_object` gives objects; `n` choices are
//! each constrained; constrained rows with bias, penalties and `min_p` batched with others
//! stay valid and reproducible; schemas llguidance rejects and malformed `response_format`s are 400s
//! naming the field; a server without a tokenizer refuses `response_format` by name.
#[path = "serve_common/mod.rs"]
mod common;

use common::exec::*;
use common::*;
use serde_json::{json, Value};
use std::path::Path;

/// A schema whose every document is short, so a sequence always completes within
/// `max_tokens` and its validity is never cut by the length limit.
fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "ok": {"type": "boolean"}
        },
        "required": ["name", "age", "tags", "ok"],
        "additionalProperties": false
    })
}

/// Whether `text` is one JSON document valid against [`schema`] (written out by hand for
/// this schema: exactly its keys, each of its type and within its bounds).
fn valid(text: &str) -> Result<(), String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON ({e})"))?;
    let o = v.as_object().ok_or("not an object")?;
    let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys.sort();
    if keys != ["age", "name", "ok", "tags"] {
        return Err(format!("keys {keys:?}"));
    }
    let name = o["name"].as_str().ok_or("name is not a string")?;
    if name.chars().count() > 6 {
        return Err(format!("name {name:?} is longer than 6"));
    }
    let age = o["age"].as_i64().ok_or("age is not an integer")?;
    if !(0..=150).contains(&age) {
        return Err(format!("age {age} out of range"));
    }
    let tags = o["tags"].as_array().ok_or("tags is not an array")?;
    if tags.len() > 3
        || tags
            .iter()
            .any(|t| !matches!(t.as_str(), Some("red" | "green" | "blue")))
    {
        return Err(format!("tags {tags:?}"));
    }
    o["ok"].as_bool().ok_or("ok is not a boolean")?;
    Ok(())
}

fn fmt() -> Value {
    json!({"type": "json_schema", "json_schema": {"name": "person", "schema": schema(), "strict": true}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constrained_output_is_valid_json_against_its_schema_in_100_of_100_runs() {
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), Path::new(REAL_MODEL), 4, 256, 8);
    let s = ExecServer::start(&plan, &[]);
    // Unconstrained, the random model's text is not JSON: the grammar is what makes it so.
    let r = s
        .post_json(
            "/v1/completions",
            &json!({"prompt": "Person:", "max_tokens": 40, "temperature": 1.0, "seed": 1}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let free = r.json()["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(
        valid(&free).is_err(),
        "unconstrained text was valid: {free}"
    );

    let mut bad = Vec::new();
    let mut distinct = std::collections::BTreeSet::new();
    for seed in 0..100u64 {
        let (path, body) = if seed % 2 == 0 {
            let msgs = json!([{"role": "user", "content": "Describe a person as JSON."}]);
            (
                "/v1/chat/completions",
                json!({"messages": msgs, "max_tokens": 200, "temperature": 1.0, "seed": seed, "response_format": fmt()}),
            )
        } else {
            (
                "/v1/completions",
                json!({"prompt": "Person:", "max_tokens": 200, "temperature": 1.0, "seed": seed, "response_format": fmt()}),
            )
        };
        let r = s.post_json(path, &body).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let c = &r.json()["choices"][0];
        let text = c["message"]["content"]
            .as_str()
            .or(c["text"].as_str())
            .unwrap()
            .to_string();
        if let Err(e) = valid(&text) {
            bad.push(format!("seed {seed}: {e}: {text}"));
        }
        assert_eq!(c["finish_reason"], "stop", "seed {seed}: {text}");
        distinct.insert(text);
    }
    assert!(
        bad.is_empty(),
        "{} invalid of 100:\n{}",
        bad.len(),
        bad.join("\n")
    );
    assert!(
        distinct.len() > 50,
        "sampling should vary the documents, got {} distinct",
        distinct.len()
    );

    // Streamed: the concatenated deltas form a valid document too.
    let r = s
        .post_json(
            "/v1/completions",
            &json!({"prompt": "Person:", "max_tokens": 200, "temperature": 1.0, "seed": 7,
                    "stream": true, "response_format": fmt()}),
        )
        .await;
    let (text, finish) = stream_text(&r, false);
    valid(&text).unwrap_or_else(|e| panic!("streamed: {e}: {text}"));
    assert_eq!(finish.as_deref(), Some("stop"));

    // n choices: each its own grammar state.
    let r = s
        .post_json(
            "/v1/completions",
            &json!({"prompt": "Person:", "max_tokens": 200, "temperature": 1.0, "seed": 3,
                    "n": 3, "response_format": fmt()}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    for c in r.json()["choices"].as_array().unwrap() {
        let t = c["text"].as_str().unwrap();
        valid(t).unwrap_or_else(|e| panic!("choice {}: {e}: {t}", c["index"]));
    }

    // json_object: an object whenever the document ended (not cut by max_tokens).
    for seed in 0..5u64 {
        let r = s
            .post_json(
                "/v1/completions",
                &json!({"prompt": "{", "max_tokens": 120, "temperature": 0.7, "seed": seed,
                        "response_format": {"type": "json_object"}}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text());
        let c = &r.json()["choices"][0];
        let t = c["text"].as_str().unwrap();
        assert!(t.starts_with('{'), "json_object output starts {t:?}");
        if c["finish_reason"] == "stop" {
            let v: Value = serde_json::from_str(t).unwrap_or_else(|e| panic!("{e}: {t}"));
            assert!(v.is_object(), "{t}");
        }
    }

    // Rejected schemas and shapes: 400 naming the field; the server goes on.
    for (rf, field) in [
        (
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}}),
            "response_format.json_schema.schema",
        ),
        (json!({"type": "yaml"}), "response_format.type"),
        (
            json!({"type": "json_schema"}),
            "response_format.json_schema",
        ),
    ] {
        let r = s
            .post_json(
                "/v1/completions",
                &json!({"prompt": "x", "max_tokens": 4, "response_format": rf}),
            )
            .await;
        assert_eq!(r.status, 400, "{rf}: {}", r.text());
        let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(msg.contains(field), "{rf}: {msg}");
    }
    let r = s
        .post_json(
            "/v1/completions",
            &json!({"prompt": "Person:", "max_tokens": 200, "seed": 1, "temperature": 1.0, "response_format": fmt()}),
        )
        .await;
    valid(r.json()["choices"][0]["text"].as_str().unwrap()).unwrap();
}

/// Constrained rows that also carry `logit_bias`, the three penalties and `min_p`, decoded in
/// the same batches as unconstrained ones (every row processed where the engine picks,
/// `Engine::decode_proc`): 12 concurrent requests over 4 slots. Each constrained document is
/// valid; a seeded constrained request gives the same document alone and in the crowd (rows
/// never take another's mask or edits); a +100 `logit_bias` forces its token on every step of
/// an unconstrained request batched with them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processed_constrained_rows_batched_with_others_stay_valid() {
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), Path::new(REAL_MODEL), 4, 256, 8);
    let s = ExecServer::start(&plan, &[]);
    let forced = 300u32;
    let r = s
        .post_json("/detokenize", &json!({"tokens": vec![forced; 6]}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let forced_text = r.json()["content"].as_str().unwrap().to_string();
    let processed = |seed: u64| {
        json!({"prompt": "Person:", "max_tokens": 200, "temperature": 1.0, "seed": seed,
               "presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2,
               "min_p": 0.05, "logit_bias": {"17": -100, "42": 5}, "response_format": fmt()})
    };
    let alone = s.post_json("/v1/completions", &processed(5)).await;
    assert_eq!(alone.status, 200, "{}", alone.text());
    let alone = alone.json()["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    valid(&alone).unwrap_or_else(|e| panic!("alone: {e}: {alone}"));
    let bodies: Vec<Value> = (0..12u64)
        .map(|i| match i % 3 {
            0 => processed(5 + i),
            1 => json!({"prompt": "Person:", "max_tokens": 200, "temperature": 0.0,
                        "logit_bias": {"42": -3}, "frequency_penalty": 1.0,
                        "response_format": fmt()}),
            _ => json!({"prompt": "Hello", "max_tokens": 6, "temperature": 1.0, "seed": i,
                        "logit_bias": {forced.to_string(): 100}}),
        })
        .collect();
    let replies =
        futures_util::future::join_all(bodies.iter().map(|b| s.post_json("/v1/completions", b)))
            .await;
    for (i, r) in replies.iter().enumerate() {
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        let text = r.json()["choices"][0]["text"].as_str().unwrap().to_string();
        match i % 3 {
            2 => assert_eq!(
                text, forced_text,
                "request {i}: the +100 bias forces its token"
            ),
            _ => valid(&text).unwrap_or_else(|e| panic!("request {i}: {e}: {text}")),
        }
        if i == 0 {
            assert_eq!(text, alone, "seed 5 alone and batched with others");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_a_tokenizer_refuses_response_format_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_without_tokenizer(dir.path());
    let plan = write_plan(dir.path(), &model, 1, 64, 8);
    let s = ExecServer::start(&plan, &[]);
    let r = s
        .post_json(
            "/v1/completions",
            &json!({"prompt": [1, 2, 3], "max_tokens": 4, "response_format": {"type": "json_object"}}),
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.text());
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(
        msg.contains("`response_format`") && msg.contains("tokenizer"),
        "{msg}"
    );
}
