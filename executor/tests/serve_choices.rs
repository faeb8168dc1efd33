//! `logprobs`/`top_logprobs` and `n` over the in-process test engine: logprobs are the
//! log-softmax of the model's raw logits (checked against the engine driven by hand, also
//! when `logit_bias` changes the pick), finite, at most 0, with sorted alternatives of the
//! asked length, in both OpenAI shapes and streamed; `n` gives `n` choices, choice `i` being
//! what one request with `seed + i` gives, reproducible for a seed, streamed with their
//! `index`; too large an `n` or `top_logprobs` is a 400 naming the field.
#[path = "serve_common/mod.rs"]
mod common;

use common::*;
use serde_json::{json, Value};
use strata_exec::engine::Engine;
use strata_exec::serve::test_engine::{TinyConfig, TinyEngine};
use strata_exec::serve::ServeOptions;
use strata_exec::tokenizer::Tokenizer;

const PROMPT: [u32; 6] = [10, 20, 30, 40, 50, 60];

/// Every test here drives a server (and some an engine by hand): one at a time, as in
/// serve_sampling.rs (on a 2-core machine parallel ones starve each other).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn cfg(slots: usize) -> TinyConfig {
    let tok = Tokenizer::from_file(std::path::Path::new(TOK_DIR)).unwrap();
    TinyConfig {
        n_vocab: tok.vocab_size() as u64,
        n_slots: slots,
        ..Default::default()
    }
}

/// Log-softmax of the engine's first row for `PROMPT`, in f64.
fn reference_first_row(cfg: &TinyConfig) -> Vec<f64> {
    let mut e = TinyEngine::new(cfg).unwrap();
    let row = e.prefill(0, &PROMPT, true).unwrap().unwrap().to_vec();
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
    row.iter().map(|&v| v as f64 - max - z.ln()).collect()
}

async fn post_ok(s: &TestServer, path: &str, body: &Value) -> Value {
    let r = s.post_json(path, body).await;
    assert_eq!(r.status, 200, "{body}: {}", r.text());
    r.json()
}

fn assert_sound_chat_entry(e: &Value, k: usize, greedy: bool) {
    let lp = e["logprob"].as_f64().unwrap();
    assert!(lp.is_finite() && lp <= 0.0, "{e}");
    let text = e["token"].as_str().unwrap();
    if !text.contains('\u{FFFD}') {
        assert_eq!(e["bytes"], json!(text.as_bytes()), "{e}");
    }
    let top = e["top_logprobs"].as_array().unwrap();
    assert_eq!(top.len(), k, "{e}");
    let lps: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
    assert!(lps.windows(2).all(|w| w[0] >= w[1]), "sorted: {e}");
    assert!(lps.iter().all(|&x| x.is_finite() && x <= 0.0), "{e}");
    let mass: f64 = lps.iter().map(|x| x.exp()).sum();
    assert!(mass <= 1.0 + 1e-4, "top mass {mass}: {e}");
    if greedy && k > 0 {
        assert_eq!(
            top[0]["token"], e["token"],
            "greedy picks the top entry: {e}"
        );
        assert!(
            (top[0]["logprob"].as_f64().unwrap() - lp).abs() < 1e-6,
            "{e}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_are_the_raw_log_softmax_in_both_shapes() {
    let _serial = SERIAL.lock().await;
    let cfg = cfg(2);
    let want = reference_first_row(&cfg);
    let s = TestServer::start(cfg.clone(), ServeOptions::default()).await;
    let mut best: Vec<(usize, f64)> = want.iter().copied().enumerate().collect();
    best.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let full: f64 = want.iter().map(|x| x.exp()).sum();
    assert!((full - 1.0).abs() < 1e-9, "the reference sums to 1");

    // Completions: `logprobs: k`.
    let body = json!({"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 5});
    let v = post_ok(&s, "/v1/completions", &body).await;
    let lp = &v["choices"][0]["logprobs"];
    let n = v["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    let toks = lp["tokens"].as_array().unwrap();
    assert_eq!(toks.len(), n, "{lp}");
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), n);
    assert_eq!(lp["top_logprobs"].as_array().unwrap().len(), n);
    let first = lp["token_logprobs"][0].as_f64().unwrap();
    assert!(
        (first - best[0].1).abs() < 1e-4,
        "greedy first token's logprob {first} is the reference's best {:?}",
        best[0]
    );
    for (i, x) in lp["token_logprobs"].as_array().unwrap().iter().enumerate() {
        let x = x.as_f64().unwrap();
        assert!(x.is_finite() && x <= 0.0, "{lp}");
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert!(!top.is_empty() && top.len() <= 6, "{lp}");
        let max = top
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!(
            (max - x).abs() < 1e-6,
            "greedy: the chosen one is the best: {lp}"
        );
    }
    let offs: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(offs[0], 0);
    for i in 1..n {
        let prev = toks[i - 1].as_str().unwrap().len() as u64;
        assert_eq!(offs[i], offs[i - 1] + prev, "text_offset: {lp}");
    }

    // Chat shape through /v1/completions' sibling: the reference row's top 20.
    let body = json!({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5,
                      "temperature": 0, "logprobs": true, "top_logprobs": 20});
    let v = post_ok(&s, "/v1/chat/completions", &body).await;
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        content.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap()
    );
    for e in content {
        assert_sound_chat_entry(e, 20, true);
    }
    let bytes: Vec<u8> = content
        .iter()
        .flat_map(|e| e["bytes"].as_array().unwrap().iter())
        .map(|b| b.as_u64().unwrap() as u8)
        .collect();
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&bytes),
        text,
        "the tokens' bytes spell the text"
    );
    // `logprobs: true` alone: the chosen token, no alternatives.
    let mut b0 = body.clone();
    b0.as_object_mut().unwrap().remove("top_logprobs");
    let v0 = post_ok(&s, "/v1/chat/completions", &b0).await;
    for e in v0["choices"][0]["logprobs"]["content"].as_array().unwrap() {
        assert_sound_chat_entry(e, 0, true);
    }
    assert_eq!(
        v0["choices"][0]["message"], v["choices"][0]["message"],
        "asking for logprobs changes no token"
    );
    // Without logprobs the field is null.
    let mut b1 = body.clone();
    b1.as_object_mut().unwrap().remove("logprobs");
    b1.as_object_mut().unwrap().remove("top_logprobs");
    let v1 = post_ok(&s, "/v1/chat/completions", &b1).await;
    assert!(v1["choices"][0]["logprobs"].is_null(), "{v1}");
    assert_eq!(v1["choices"][0]["message"], v["choices"][0]["message"]);

    // A +100 bias forces a token the model does not favour; its logprob is still the raw
    // model's (before the bias), so well below the best one's.
    let forced = best[50].0 as u32;
    let body = json!({"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 3,
                      "logit_bias": {forced.to_string(): 100}});
    let v = post_ok(&s, "/v1/completions", &body).await;
    let got = v["choices"][0]["logprobs"]["token_logprobs"][0]
        .as_f64()
        .unwrap();
    assert!(
        (got - best[50].1).abs() < 1e-4,
        "forced token {forced}: logprob {got}, raw {}",
        best[50].1
    );

    // Streamed: the chunks' logprobs joined are the non-streamed ones, for both shapes.
    let body = json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 2});
    let full = post_ok(&s, "/v1/completions", &body).await;
    let mut st = body.clone();
    st["stream"] = json!(true);
    let r = s.post_json("/v1/completions", &st).await;
    let (mut toks, mut lps, mut offs) = (Vec::new(), Vec::new(), Vec::new());
    for d in r.sse_data().iter().filter(|d| *d != "[DONE]") {
        let c: Value = serde_json::from_str(d).unwrap();
        let lp = &c["choices"][0]["logprobs"];
        if lp.is_null() {
            continue;
        }
        toks.extend(lp["tokens"].as_array().unwrap().iter().cloned());
        lps.extend(lp["token_logprobs"].as_array().unwrap().iter().cloned());
        offs.extend(lp["text_offset"].as_array().unwrap().iter().cloned());
    }
    let flp = &full["choices"][0]["logprobs"];
    assert_eq!(Value::Array(toks), flp["tokens"]);
    assert_eq!(Value::Array(lps), flp["token_logprobs"]);
    assert_eq!(Value::Array(offs), flp["text_offset"]);

    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
                      "temperature": 0, "logprobs": true, "top_logprobs": 3});
    let full = post_ok(&s, "/v1/chat/completions", &body).await;
    let mut st = body.clone();
    st["stream"] = json!(true);
    let r = s.post_json("/v1/chat/completions", &st).await;
    let mut content = Vec::new();
    for d in r.sse_data().iter().filter(|d| *d != "[DONE]") {
        let c: Value = serde_json::from_str(d).unwrap();
        if let Some(a) = c["choices"][0]["logprobs"]["content"].as_array() {
            content.extend(a.iter().cloned());
        }
    }
    assert_eq!(
        Value::Array(content),
        full["choices"][0]["logprobs"]["content"]
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_are_seeded_sequences_and_stream_with_their_index() {
    let _serial = SERIAL.lock().await;
    let s = TestServer::start(cfg(3), ServeOptions::default()).await;
    let body = json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 42,
                      "n": 3, "logprobs": 0});
    let a = post_ok(&s, "/v1/completions", &body).await;
    let b = post_ok(&s, "/v1/completions", &body).await;
    assert_eq!(
        a["choices"], b["choices"],
        "the same seed, the same choices"
    );
    let choices = a["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{a}");
    let mut tokens = 0;
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{a}");
        tokens += c["logprobs"]["tokens"].as_array().unwrap().len() as u64;
        // Choice i is what one request with seed 42 + i gives.
        let mut one = body.clone();
        one["n"] = json!(1);
        one["seed"] = json!(42 + i);
        let v = post_ok(&s, "/v1/completions", &one).await;
        assert_eq!(v["choices"][0]["text"], c["text"], "choice {i}");
    }
    assert_eq!(a["usage"]["completion_tokens"].as_u64().unwrap(), tokens);
    let texts: std::collections::HashSet<&str> = choices
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert!(texts.len() > 1, "three seeds, one text: {a}");

    // Chat, streamed: each index's chunks spell its non-streamed choice.
    let body = json!({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6,
                      "temperature": 0.9, "seed": 7, "n": 2,
                      "stream_options": {"include_usage": true}});
    let full = post_ok(&s, "/v1/chat/completions", &body).await;
    let mut st = body.clone();
    st["stream"] = json!(true);
    let r = s.post_json("/v1/chat/completions", &st).await;
    let mut text = [String::new(), String::new()];
    let mut finish = [None, None];
    let mut roles = 0;
    let mut usage = Value::Null;
    for d in r.sse_data().iter().filter(|d| *d != "[DONE]") {
        let c: Value = serde_json::from_str(d).unwrap();
        if !c["usage"].is_null() {
            usage = c["usage"].clone();
        }
        for ch in c["choices"].as_array().unwrap() {
            let i = ch["index"].as_u64().unwrap() as usize;
            roles += usize::from(ch["delta"]["role"] == "assistant");
            text[i].push_str(ch["delta"]["content"].as_str().unwrap_or(""));
            if let Some(f) = ch["finish_reason"].as_str() {
                finish[i] = Some(f.to_string());
            }
        }
    }
    assert_eq!(roles, 2);
    for i in 0..2 {
        assert_eq!(
            text[i], full["choices"][i]["message"]["content"],
            "choice {i}"
        );
        assert_eq!(
            finish[i].as_deref(),
            full["choices"][i]["finish_reason"].as_str()
        );
    }
    assert_eq!(usage, full["usage"]);
    wait_idle(&s, std::time::Duration::from_secs(10)).await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_large_n_and_top_logprobs_are_400s_naming_the_field() {
    let _serial = SERIAL.lock().await;
    let s = TestServer::start(cfg(2), ServeOptions::default()).await;
    for (path, extra, needles) in [
        (
            "/v1/completions",
            json!({"n": 3}),
            &["`n`", "2", "--batch"][..],
        ),
        ("/v1/completions", json!({"n": 0}), &["`n`"][..]),
        (
            "/v1/completions",
            json!({"logprobs": 21}),
            &["logprobs", "20"][..],
        ),
        (
            "/v1/chat/completions",
            json!({"n": 5}),
            &["`n`", "--batch"][..],
        ),
        (
            "/v1/chat/completions",
            json!({"logprobs": true, "top_logprobs": 21}),
            &["top_logprobs"][..],
        ),
        (
            "/v1/chat/completions",
            json!({"top_logprobs": 3}),
            &["top_logprobs", "logprobs: true"][..],
        ),
        (
            "/v1/chat/completions",
            json!({"logprobs": 2}),
            &["logprobs"][..],
        ),
        (
            "/v1/completions",
            json!({"typical_p": 0}),
            &["typical_p"][..],
        ),
    ] {
        let mut body = if path == "/v1/completions" {
            json!({"prompt": PROMPT, "max_tokens": 2})
        } else {
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
        };
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = s.post_json(path, &body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
        for n in needles {
            assert!(msg.contains(n), "{body}: {msg} lacks {n}");
        }
    }
    s.stop().await;
}

/// `n` choices prefill the prompt once: the later choices copy the first one's context
/// (`Engine::copy_slot`), so /metrics counts the prompt's tokens prefilled once and copied
/// `n - 1` times, and greedy choices are identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_prefill_the_prompt_once_and_copy_it() {
    let _serial = SERIAL.lock().await;
    let s = TestServer::start(cfg(3), ServeOptions::default()).await;
    let (p0, c0) = (
        s.metric("strata_prompt_tokens_total").await,
        s.metric("strata_prompt_tokens_copied_total").await,
    );
    let body = json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "n": 3,
                      "cache_prompt": false});
    let v = post_ok(&s, "/v1/completions", &body).await;
    let texts: Vec<&str> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert_eq!(texts.len(), 3);
    assert!(
        texts.iter().all(|t| *t == texts[0]),
        "greedy choices differ: {v}"
    );
    let n = PROMPT.len() as f64;
    assert_eq!(
        s.metric("strata_prompt_tokens_total").await - p0,
        n,
        "the prompt is prefilled once"
    );
    assert_eq!(
        s.metric("strata_prompt_tokens_copied_total").await - c0,
        2.0 * n,
        "and copied into the other two slots"
    );
    let mut one = body.clone();
    one["n"] = json!(1);
    let w = post_ok(&s, "/v1/completions", &one).await;
    assert_eq!(
        w["choices"][0]["text"], texts[0],
        "n = 1 gives the same text"
    );
    wait_idle(&s, std::time::Duration::from_secs(10)).await;
    s.stop().await;
}

/// The same with the real CPU engine over a tiny Qwen3-Next (its linear-attention state is
/// copied with the KV): three greedy choices equal one greedy answer, the prompt prefilled
/// once.
#[test]
fn qwen3next_n_choices_copy_the_linear_state() {
    use common::exec::{write_plan, ExecServer};
    let model =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/tiny-qwen3next/base");
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), &model, 3, 64, 8);
    let s = ExecServer::start(&plan, &["--no-prefix-cache"]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let prompt: Vec<u32> = (0..19).map(|i| (i * 37 + 5) % 100).collect();
    let body = json!({"prompt": prompt, "max_tokens": 10, "temperature": 0, "n": 3});
    let p0 = rt.block_on(s.metric("strata_prompt_tokens_total"));
    let r = rt.block_on(s.post_json("/v1/completions", &body));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let toks: Vec<Value> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].clone())
        .collect();
    assert_eq!(
        rt.block_on(s.metric("strata_prompt_tokens_total")) - p0,
        19.0,
        "prefilled once"
    );
    let mut one = body.clone();
    one["n"] = json!(1);
    let w = rt.block_on(s.post_json("/v1/completions", &one)).json();
    for (i, t) in toks.iter().enumerate() {
        assert_eq!(*t, w["choices"][0]["text"], "choice {i}: {v}");
    }
}
