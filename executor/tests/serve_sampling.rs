//! Host-side sampling features over the in-process test engine: `logit_bias`, presence,
//! frequency and repetition penalties, `typical_p` and `min_p` give exactly the tokens of a reference
//! loop over the same engine (prefill, processing, the shared draw), greedy and seeded; the
//! features change the output; bad values are 400s naming the field; the server's defaults
//! (generation_config.json, flags) fill the fields a request leaves out.
#[path = "serve_common/mod.rs"]
mod common;

use common::*;
use serde_json::{json, Value};
use strata_exec::engine::Engine;
use strata_exec::sampler::{sample_with, Sampler, SamplingParams};
use strata_exec::serve::defaults::SamplingDefaults;
use strata_exec::serve::logit_proc::{apply, History, LogitProc};
use strata_exec::serve::test_engine::{TinyConfig, TinyEngine};
use strata_exec::serve::ServeOptions;
use strata_exec::tokenizer::Tokenizer;

const PROMPT: [u32; 6] = [10, 20, 30, 40, 50, 60];

/// The tests that drive a reference engine by hand beside a server take this lock: run at the
/// same time in one process (two servers and two hand-driven engines sharing rayon's pool on a
/// 2-core machine) they stopped making progress, while each alone finishes in under a second.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const MAX: usize = 16;

/// The tokens the server must produce: the engine driven by hand.
fn reference(cfg: &TinyConfig, proc: &LogitProc, params: SamplingParams, eos: &[u32]) -> Vec<u32> {
    let mut e = TinyEngine::new(cfg).unwrap();
    let mut s = Sampler::new(params);
    let mut h = History::new(&PROMPT, proc);
    let mut row = e.prefill(0, &PROMPT, true).unwrap().unwrap().to_vec();
    let mut out = Vec::new();
    loop {
        let d = s.next_draw();
        apply(proc, &h, d.temperature, &mut row);
        let t = sample_with(&row, &d);
        h.push(t);
        if eos.contains(&t) {
            break;
        }
        out.push(t);
        if out.len() == MAX {
            break;
        }
        row = e.decode(&[(0, t)]).unwrap().to_vec();
    }
    out
}

async fn detok(s: &TestServer, ids: &[u32]) -> String {
    let r = s.post_json("/detokenize", &json!({ "tokens": ids })).await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["content"].as_str().unwrap().to_string()
}

async fn complete(s: &TestServer, extra: Value) -> String {
    let mut body = json!({"prompt": PROMPT, "max_tokens": MAX});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let r = s.post_json("/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{body}: {}", r.text());
    r.json()["choices"][0]["text"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn penalties_bias_and_min_p_match_a_reference_loop() {
    let _serial = SERIAL.lock().await;
    let tok = Tokenizer::from_file(std::path::Path::new(TOK_DIR)).unwrap();
    let cfg = TinyConfig {
        n_vocab: tok.vocab_size() as u64,
        n_slots: 2,
        ..Default::default()
    };
    let eos: Vec<u32> = tok.eos_ids().to_vec();
    let s = TestServer::start(cfg.clone(), ServeOptions::default()).await;
    let greedy = SamplingParams::default();
    let plain = reference(&cfg, &LogitProc::default(), greedy, &eos);
    assert_eq!(
        complete(&s, json!({"temperature": 0})).await,
        detok(&s, &plain).await
    );
    // A token to force: one the plain output does not start with.
    let forced = (100..400u32).find(|t| Some(t) != plain.first() && !eos.contains(t));
    let forced = forced.unwrap();
    let cases: Vec<(Value, LogitProc, SamplingParams)> = vec![
        (
            json!({"temperature": 0, "logit_bias": {forced.to_string(): 100}}),
            LogitProc {
                logit_bias: vec![(forced, 100.0)],
                ..Default::default()
            },
            greedy,
        ),
        (
            json!({"temperature": 0, "presence_penalty": 1.5, "frequency_penalty": 0.7}),
            LogitProc {
                presence_penalty: 1.5,
                frequency_penalty: 0.7,
                ..Default::default()
            },
            greedy,
        ),
        (
            json!({"temperature": 0, "repetition_penalty": 1.8}),
            LogitProc {
                repetition_penalty: 1.8,
                ..Default::default()
            },
            greedy,
        ),
        (
            json!({"temperature": 1.3, "seed": 5, "min_p": 0.2, "repeat_penalty": 1.3}),
            LogitProc {
                min_p: 0.2,
                repetition_penalty: 1.3,
                ..Default::default()
            },
            SamplingParams {
                temperature: 1.3,
                seed: 5,
                ..Default::default()
            },
        ),
        (
            json!({"temperature": 0.9, "seed": 9, "typical_p": 0.4}),
            LogitProc {
                typical_p: 0.4,
                ..Default::default()
            },
            SamplingParams {
                temperature: 0.9,
                seed: 9,
                ..Default::default()
            },
        ),
    ];
    for (body, proc, params) in cases {
        let want = reference(&cfg, &proc, params, &eos);
        // The completion's text leaves special tokens out; /detokenize keeps them.
        let shown: Vec<u32> = want
            .iter()
            .copied()
            .filter(|&t| tok.special_token(t).is_none())
            .collect();
        assert_eq!(
            complete(&s, body.clone()).await,
            detok(&s, &shown).await,
            "{body}"
        );
        if !proc.logit_bias.is_empty() {
            assert_eq!(want.first(), Some(&forced), "a +100 bias forces the token");
            assert_ne!(want, plain, "{body} changes the output");
        }
    }
    // Streamed with a penalty: the same text as not streamed.
    let body = json!({"temperature": 0, "presence_penalty": 1.5, "frequency_penalty": 0.7});
    let full = complete(&s, body.clone()).await;
    let mut st = body;
    st["prompt"] = json!(PROMPT);
    st["max_tokens"] = json!(MAX);
    st["stream"] = json!(true);
    let r = s.post_json("/v1/completions", &st).await;
    assert_eq!(stream_text(&r, false).0, full);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_sampling_values_name_the_field() {
    let s = TestServer::start(TinyConfig::default(), ServeOptions::default()).await;
    for (extra, field) in [
        (json!({"min_p": 1.5}), "min_p"),
        (json!({"presence_penalty": 3}), "presence_penalty"),
        (json!({"frequency_penalty": "x"}), "frequency_penalty"),
        (json!({"repetition_penalty": 0}), "repetition_penalty"),
        (json!({"logit_bias": {"abc": 1}}), "logit_bias"),
        (json!({"logit_bias": {"5": 101}}), "logit_bias"),
        (json!({"logit_bias": {"99999999": 1}}), "logit_bias"),
        (json!({"typical_p": 0}), "typical_p"),
        (json!({"typical_p": 1.5}), "typical_p"),
    ] {
        let mut body = json!({"prompt": PROMPT, "max_tokens": 2});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = s.post_json("/v1/completions", &body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(msg.contains(field), "{body}: {msg}");
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_defaults_fill_the_fields_a_request_leaves_out() {
    let _serial = SERIAL.lock().await;
    let tok = Tokenizer::from_file(std::path::Path::new(TOK_DIR)).unwrap();
    let cfg = TinyConfig {
        n_vocab: tok.vocab_size() as u64,
        n_slots: 1,
        ..Default::default()
    };
    let eos: Vec<u32> = tok.eos_ids().to_vec();
    let opts = ServeOptions {
        sampling_defaults: SamplingDefaults {
            temperature: 0.0,
            repetition_penalty: 1.8,
            ..Default::default()
        },
        ..Default::default()
    };
    let s = TestServer::start(cfg.clone(), opts).await;
    let proc = LogitProc {
        repetition_penalty: 1.8,
        ..Default::default()
    };
    let want = reference(&cfg, &proc, SamplingParams::default(), &eos);
    assert_eq!(complete(&s, json!({})).await, detok(&s, &want).await);
    // A request's own value wins over the default.
    let plain = reference(&cfg, &LogitProc::default(), SamplingParams::default(), &eos);
    assert_eq!(
        complete(&s, json!({"repetition_penalty": 1})).await,
        detok(&s, &plain).await
    );
    s.stop().await;
}

/// `ignore_eos`: with the end-of-sequence token forced by `logit_bias`, a request stops at
/// once (`finish_reason` "stop", no tokens); with `ignore_eos` the same request runs to
/// `max_tokens` ("length"); with `response_format` it is a 400 naming both fields.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ignore_eos_runs_past_the_end_of_sequence_token() {
    let _serial = SERIAL.lock().await;
    let tok = Tokenizer::from_file(std::path::Path::new(TOK_DIR)).unwrap();
    let cfg = TinyConfig {
        n_vocab: tok.vocab_size() as u64,
        n_slots: 1,
        ..Default::default()
    };
    let eos = *tok
        .eos_ids()
        .first()
        .expect("the test tokenizer has an EOS token");
    let s = TestServer::start(cfg, ServeOptions::default()).await;
    let body = |ignore: bool| {
        json!({"prompt": PROMPT, "max_tokens": MAX, "temperature": 0,
               "logit_bias": {eos.to_string(): 100}, "ignore_eos": ignore})
    };
    let r = s.post_json("/v1/completions", &body(false)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 0, "{v}");
    let r = s.post_json("/v1/completions", &body(true)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], MAX, "{v}");
    let mut bad = body(true);
    bad["response_format"] = json!({"type": "json_object"});
    let r = s.post_json("/v1/completions", &bad).await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("ignore_eos") && r.text().contains("response_format"));
    s.stop().await;
}
