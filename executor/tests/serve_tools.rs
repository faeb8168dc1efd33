//! Chat output shaping and template inputs end to end: `chat_template_kwargs`
//! (`enable_thinking: false` renders Qwen3's empty think block), `<think>` blocks split into
//! `reasoning_content` (whole and streamed, tags cut across tokens, a think block opened by
//! the prompt), Hermes/Qwen3 `<tool_call>` blocks parsed into `tool_calls` with
//! `finish_reason: tool_calls` (whole and streamed), malformed calls kept as content, tool
//! history rendered through the template, 400s naming the field; over a scripted engine
//! (exact model text) in process, and the real `strata-exec PLAN --serve` with a Qwen3-style
//! template for the request side.
#[path = "serve_common/mod.rs"]
mod common;

use common::exec::*;
use common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use strata_exec::serve::script_engine::ScriptEngine;
use strata_exec::serve::ServeOptions;
use strata_exec::tokenizer::Tokenizer;

const QWEN3_TEMPLATE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/data/qwen3-template/chat_template.jinja"
);

/// The tiny-chat tokenizer with `template` as its chat template, written into `dir`.
fn tokenizer_with(dir: &Path, template: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(
        Path::new(TOK_DIR).join("tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    let mut cfg: Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(TOK_DIR).join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    cfg["chat_template"] = json!(template);
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    dir.to_path_buf()
}

fn qwen3_template() -> String {
    std::fs::read_to_string(QWEN3_TEMPLATE).unwrap()
}

/// A server whose model writes `pieces` (each tokenized on its own, so token boundaries
/// fall at least at the piece boundaries), then end-of-sequence.
async fn script_server(tok_dir: &Path, pieces: &[&str], opts: ServeOptions) -> TestServer {
    let tok = Tokenizer::from_file(tok_dir).unwrap();
    let mut ids = Vec::new();
    for p in pieces {
        ids.extend(tok.encode(p, false).unwrap());
    }
    let end = tok.eos_ids()[0];
    let loader: strata_exec::serve::Loader = Box::new(move || {
        let e = ScriptEngine::new(ids, end, tok.vocab_size(), 2, 4096);
        Ok((
            Box::new(e) as Box<dyn strata_exec::engine::Engine>,
            Some(tok),
        ))
    });
    TestServer::start_loader(loader, opts, true).await
}

fn chat(extra: Value) -> Value {
    let mut b = json!({"messages": [{"role": "user", "content": "Hi"}], "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

/// The `delta`s and finish reasons of a streamed chat (choice 0).
fn deltas(r: &Resp) -> (Vec<Value>, Vec<String>) {
    assert_eq!(r.status, 200, "{}", r.text());
    let mut d = Vec::new();
    let mut f = Vec::new();
    for line in r.sse_data() {
        if line == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&line).unwrap();
        let c = &v["choices"][0];
        if let Some(x) = c["finish_reason"].as_str() {
            f.push(x.to_string());
        }
        d.push(c["delta"].clone());
    }
    (d, f)
}

fn joined(d: &[Value], key: &str) -> String {
    d.iter().filter_map(|x| x[key].as_str()).collect()
}

const THINK: &[&str] = &[
    "<th",
    "ink>\nThe user gr",
    "eets.\n</th",
    "ink>\n\nHel",
    "lo!",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn think_blocks_split_into_reasoning_content() {
    let dir = tempfile::tempdir().unwrap();
    let tok_dir = tokenizer_with(dir.path(), &qwen3_template());
    let s = script_server(&tok_dir, THINK, ServeOptions::default()).await;
    let r = s.post_json("/v1/chat/completions", &chat(json!({}))).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let m = &v["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], "The user greets.", "{v}");
    assert_eq!(m["content"], "Hello!", "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    let r = s
        .post_json("/v1/chat/completions", &chat(json!({"stream": true})))
        .await;
    let (d, f) = deltas(&r);
    assert_eq!(d[0]["role"], "assistant");
    assert_eq!(joined(&d, "reasoning_content"), "The user greets.");
    assert_eq!(joined(&d, "content"), "Hello!");
    // Every reasoning delta comes before the first content text.
    let first_content = d
        .iter()
        .position(|x| x["content"].as_str().is_some_and(|c| !c.is_empty()))
        .unwrap();
    assert!(d[first_content..]
        .iter()
        .all(|x| x.get("reasoning_content").is_none()));
    assert_eq!(f, ["stop"]);

    // Turned off per request: the block stays in the content.
    let r = s
        .post_json(
            "/v1/chat/completions",
            &chat(json!({"reasoning_format": "none"})),
        )
        .await;
    let v = r.json();
    assert_eq!(v["choices"][0]["message"]["content"], THINK.concat(), "{v}");
    assert!(v["choices"][0]["message"]
        .get("reasoning_content")
        .is_none());

    // `enable_thinking: false` renders the empty think block: the prompt grows by it.
    let tok = Tokenizer::from_file(&tok_dir).unwrap();
    let plain = s
        .post_json("/v1/chat/completions", &chat(json!({})))
        .await
        .json();
    for extra in [
        json!({"chat_template_kwargs": {"enable_thinking": false, "anything": [1]}}),
        json!({"enable_thinking": false}),
    ] {
        let off = s
            .post_json("/v1/chat/completions", &chat(extra))
            .await
            .json();
        let want = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";
        assert_eq!(
            off["usage"]["prompt_tokens"].as_u64().unwrap(),
            tok.encode(want, false).unwrap().len() as u64,
            "{off} vs {plain}"
        );
        assert!(off["usage"]["prompt_tokens"].as_u64() > plain["usage"]["prompt_tokens"].as_u64());
    }
    s.stop().await;

    // Server-wide off.
    let s = script_server(
        &tok_dir,
        THINK,
        ServeOptions {
            reasoning_format: strata_exec::serve::reasoning::ReasoningFormat::None,
            ..Default::default()
        },
    )
    .await;
    let v = s
        .post_json("/v1/chat/completions", &chat(json!({})))
        .await
        .json();
    assert_eq!(v["choices"][0]["message"]["content"], THINK.concat());
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_think_block_opened_by_the_prompt_is_reasoning_until_its_close() {
    let dir = tempfile::tempdir().unwrap();
    let src = qwen3_template();
    let opened = src.replace(
        "{{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking",
        "{{- '<|im_start|>assistant\\n<think>\\n' }}\n    {%- if enable_thinking",
    );
    assert_ne!(src, opened, "the fixture's generation prompt moved");
    let tok_dir = tokenizer_with(dir.path(), &opened);
    let s = script_server(
        &tok_dir,
        &["Thinking ", "hard.\n</", "think>\n\nDone."],
        ServeOptions::default(),
    )
    .await;
    let v = s
        .post_json("/v1/chat/completions", &chat(json!({})))
        .await
        .json();
    let m = &v["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], "Thinking hard.", "{v}");
    assert_eq!(m["content"], "Done.");
    let r = s
        .post_json("/v1/chat/completions", &chat(json!({"stream": true})))
        .await;
    let (d, _) = deltas(&r);
    assert_eq!(joined(&d, "reasoning_content"), "Thinking hard.");
    assert_eq!(joined(&d, "content"), "Done.");
    assert!(d[1].get("reasoning_content").is_some(), "{d:?}");
    s.stop().await;
}

const CALLS: &[&str] = &[
    "I'll check.\n<tool",
    "_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"note\": \"}{ \\\"\"}}\n</tool_",
    "call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
];

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "get_time"}}
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_are_parsed_whole_and_streamed() {
    let dir = tempfile::tempdir().unwrap();
    let tok_dir = tokenizer_with(dir.path(), &qwen3_template());
    let s = script_server(&tok_dir, CALLS, ServeOptions::default()).await;
    let v = s
        .post_json("/v1/chat/completions", &chat(json!({"tools": tools()})))
        .await
        .json();
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls", "{v}");
    assert_eq!(c["message"]["content"], "I'll check.");
    let calls = c["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0]["type"], "function");
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    assert_ne!(calls[0]["id"], calls[1]["id"]);
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris", "note": "}{ \""}));
    assert_eq!(calls[1]["function"]["name"], "get_time");
    assert_eq!(calls[1]["function"]["arguments"], "{}");

    let r = s
        .post_json(
            "/v1/chat/completions",
            &chat(json!({"tools": tools(), "stream": true, "tool_choice": "required"})),
        )
        .await;
    let (d, f) = deltas(&r);
    assert_eq!(joined(&d, "content"), "I'll check.");
    let streamed: Vec<&Value> = d
        .iter()
        .filter_map(|x| x["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(streamed.len(), 2, "{d:?}");
    for (i, call) in streamed.iter().enumerate() {
        assert_eq!(call["index"], i);
        assert!(call["id"].as_str().unwrap().starts_with("call_"));
        assert_eq!(call["type"], "function");
    }
    assert_eq!(streamed[1]["function"]["name"], "get_time");
    assert_eq!(f, ["tool_calls"]);

    // No tools, or `tool_choice: none`: the text comes back as it was written.
    for extra in [json!({}), json!({"tools": tools(), "tool_choice": "none"})] {
        let v = s
            .post_json("/v1/chat/completions", &chat(extra))
            .await
            .json();
        assert_eq!(v["choices"][0]["message"]["content"], CALLS.concat());
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert!(v["choices"][0]["message"].get("tool_calls").is_none());
    }
    s.stop().await;

    // A call that is not JSON stays in the content, tags and all.
    let bad = "Hmm <tool_call>\n{\"name\": \"get_time\", \"arguments\": {oops}\n</tool_call>";
    let s = script_server(&tok_dir, &[bad], ServeOptions::default()).await;
    for stream in [false, true] {
        let r = s
            .post_json(
                "/v1/chat/completions",
                &chat(json!({"tools": tools(), "stream": stream})),
            )
            .await;
        if stream {
            let (d, f) = deltas(&r);
            assert_eq!(joined(&d, "content"), bad);
            assert_eq!(f, ["stop"]);
        } else {
            let v = r.json();
            assert_eq!(v["choices"][0]["message"]["content"], bad);
            assert_eq!(v["choices"][0]["finish_reason"], "stop");
        }
    }
    s.stop().await;
}

/// A conversation with a call and its answer.
fn history() -> Value {
    json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}
    ])
}

/// The prompt `history()` renders to with the tools and `enable_thinking: false`.
fn history_prompt() -> String {
    let tools_json = concat!(
        r#"{"function": {"description": "Weather in a city", "name": "get_weather", "parameters": {"properties": {"city": {"type": "string"}}, "type": "object"}}, "type": "function"}"#,
        "\n",
        r#"{"function": {"name": "get_time"}, "type": "function"}"#
    );
    format!(
        concat!(
            "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n",
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{}",
            "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call><|im_end|>\n",
            "<|im_start|>user\nWeather in Paris?<|im_end|>\n",
            "<|im_start|>assistant\n<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"Paris\"}}}}\n</tool_call><|im_end|>\n",
            "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n",
            "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        ),
        tools_json
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_history_renders_and_bad_tools_are_400s() {
    let dir = tempfile::tempdir().unwrap();
    let tok_dir = tokenizer_with(dir.path(), &qwen3_template());
    let s = script_server(&tok_dir, &["ok"], ServeOptions::default()).await;
    let body = json!({"messages": history(), "tools": tools(),
                      "chat_template_kwargs": {"enable_thinking": false}, "max_tokens": 4});
    let v = s.post_json("/v1/chat/completions", &body).await.json();
    let tok = Tokenizer::from_file(&tok_dir).unwrap();
    assert_eq!(
        v["usage"]["prompt_tokens"].as_u64().unwrap(),
        tok.encode(&history_prompt(), false).unwrap().len() as u64,
        "{v}"
    );
    assert_eq!(v["choices"][0]["message"]["content"], "ok");

    let base = json!({"messages": [{"role": "user", "content": "x"}]});
    for (extra, needle) in [
        (json!({"tools": {"a": 1}}), "`tools`"),
        (
            json!({"tools": [{"type": "function"}]}),
            "tools[0].function",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"description": "d"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}),
            "tools[0].type",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}),
            "tools[0].function.parameters",
        ),
        (json!({"tool_choice": "sometimes"}), "tool_choice"),
        (json!({"tool_choice": "required"}), "tools"),
        (
            json!({"tools": tools(), "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "nope",
        ),
        (json!({"chat_template_kwargs": 5}), "chat_template_kwargs"),
        (
            json!({"chat_template_kwargs": {"messages": []}}),
            "chat_template_kwargs.messages",
        ),
        (json!({"reasoning_format": "loud"}), "reasoning_format"),
        (
            json!({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}]}),
            "messages[0].tool_calls[0].function.name",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}),
            "messages[0].tool_calls",
        ),
    ] {
        let mut b = base.clone();
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let r = s.post_json("/v1/chat/completions", &b).await;
        assert_eq!(r.status, 400, "{b}: {}", r.text());
        let m = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(m.contains(needle), "{b}: {m}");
    }
    // Completions take no tools.
    let r = s
        .post_json("/v1/completions", &json!({"prompt": "x", "tools": tools()}))
        .await;
    assert_eq!(r.status, 400);
    s.stop().await;
}

/// The real binary over tiny-chat-moe with the Qwen3-style template: tools, tool history and
/// `chat_template_kwargs` render through it (the prompt is exactly the expected one), and
/// `--reasoning-format` is a flag.
#[test]
fn real_binary_renders_tools_and_kwargs() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("qwen3ish");
    std::fs::create_dir_all(&model).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(Path::new(REAL_MODEL).join(f), model.join(f)).unwrap();
    }
    tokenizer_with(&model, &qwen3_template());
    let plan = write_plan(dir.path(), &model, 2, 2048, 32);
    let s = ExecServer::start(&plan, &["--reasoning-format", "deepseek"]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let body = json!({"messages": history(), "tools": tools(), "max_tokens": 3,
                      "chat_template_kwargs": {"enable_thinking": false}, "temperature": 0});
    let v = rt
        .block_on(s.post_json("/v1/chat/completions", &body))
        .json();
    let tok = Tokenizer::from_file(&model).unwrap();
    assert_eq!(
        v["usage"]["prompt_tokens"].as_u64().unwrap(),
        tok.encode(&history_prompt(), false).unwrap().len() as u64,
        "{v}"
    );
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
    let r = rt.block_on(s.post_json(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}),
    ));
    assert_eq!(r.status, 400);
    drop(s);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_strata-exec"))
        .arg(&plan)
        .args(["--serve", "--reasoning-format", "sometimes"])
        .output()
        .unwrap();
    assert!(!out.status.success());
}

/// An engine that cannot copy a slot (the scripted one keeps the trait's default) still
/// serves `n` choices: each prefills the prompt itself, and /metrics counts no copies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_prefill_each_where_the_engine_cannot_copy_a_slot() {
    let dir = tempfile::tempdir().unwrap();
    let tok_dir = tokenizer_with(dir.path(), &qwen3_template());
    let s = script_server(&tok_dir, &["Hello", " there"], ServeOptions::default()).await;
    let p0 = s.metric("strata_prompt_tokens_total").await;
    let body = json!({"prompt": "Say hi", "max_tokens": 8, "temperature": 0, "n": 2});
    let r = s.post_json("/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    for c in v["choices"].as_array().unwrap() {
        assert_eq!(c["text"], "Hello there", "{v}");
    }
    let p = v["usage"]["prompt_tokens"].as_f64().unwrap();
    assert_eq!(s.metric("strata_prompt_tokens_total").await - p0, 2.0 * p);
    assert_eq!(s.metric("strata_prompt_tokens_copied_total").await, 0.0);
    s.stop().await;
}
