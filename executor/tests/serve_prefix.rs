//! The prefix cache end to end with the real CPU engine (tiny-chat-moe): a multi-turn chat,
//! each turn's messages the previous ones plus the answer and a new user message, gives the
//! same greedy answers with the cache on, off (`--no-prefix-cache`) and skipped per request
//! (`cache_prompt: false`), while /metrics counts hits and reused tokens growing turn by turn.
//! The same for a random Qwen3-Next (linear attention) whose client does not send the answers
//! back verbatim, so only the slot's prefix checkpoint (its linear state at the end of the
//! last prompt) can hit.
#[path = "serve_common/mod.rs"]
mod common;
#[path = "common/mod.rs"]
mod exec_common;

use common::exec::*;
use common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use strata_schemas::arch::QuantRecipe;
use strata_schemas::gguf::random::{write_random_model, RandomOptions};
use strata_schemas::inventory::HParams;

fn block<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

const USERS: [&str; 4] = [
    "Hello there, tell me a story.",
    "Go on, please.",
    "And what happened next?",
    "Thanks. One more line?",
];

/// Each turn's greedy answer, and after each turn the prefix cache's hits and reused tokens.
fn replay(s: &ExecServer, extra: Value) -> (Vec<String>, Vec<(f64, f64)>) {
    let mut messages: Vec<Value> = Vec::new();
    let mut answers = Vec::new();
    let mut counters = Vec::new();
    for u in USERS {
        messages.push(json!({"role": "user", "content": u}));
        let mut body = json!({
            "messages": messages,
            "max_tokens": 6,
            "temperature": 0,
        });
        if let (Value::Object(b), Value::Object(x)) = (&mut body, &extra) {
            b.extend(x.clone());
        }
        let r = block(s.post_json("/v1/chat/completions", &body));
        assert_eq!(r.status, 200, "{}", r.text());
        let text = r.json()["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        messages.push(json!({"role": "assistant", "content": text}));
        answers.push(text);
        counters.push((
            block(s.metric("strata_prefix_cache_hits_total")),
            block(s.metric("strata_prefix_cache_reused_tokens_total")),
        ));
    }
    (answers, counters)
}

#[test]
fn a_multi_turn_chat_gives_the_same_greedy_answers_with_and_without_the_prefix_cache() {
    let dir = tempfile::tempdir().unwrap();
    let plan = write_plan(dir.path(), Path::new(REAL_MODEL), 2, 512, 8);

    let off = ExecServer::start(&plan, &["--no-prefix-cache"]);
    let (want, counters) = replay(&off, json!({}));
    assert!(counters.iter().all(|&c| c == (0.0, 0.0)), "{counters:?}");
    assert_eq!(
        block(off.metric("strata_prefix_cache_prompt_tokens_total")),
        block(off.metric("strata_prompt_tokens_total")),
        "without the cache every prompt token is prefilled"
    );
    off.stop_with("-TERM", std::time::Duration::from_secs(15));

    let on = ExecServer::start(&plan, &[]);
    let (got, counters) = replay(&on, json!({}));
    assert_eq!(got, want, "the prefix cache changed a greedy answer");
    // Turn 1 has nothing to reuse; every later turn reuses more than the one before.
    assert_eq!(counters[0], (0.0, 0.0), "{counters:?}");
    for (t, w) in counters.windows(2).enumerate() {
        assert_eq!(
            w[1].0,
            w[0].0 + 1.0,
            "turn {} was no hit: {counters:?}",
            t + 2
        );
        assert!(
            w[1].1 > w[0].1,
            "turn {} reused nothing: {counters:?}",
            t + 2
        );
    }
    let reused = counters[3].1;
    let prompt = block(on.metric("strata_prefix_cache_prompt_tokens_total"));
    let prefilled = block(on.metric("strata_prompt_tokens_total"));
    assert_eq!(
        prefilled + reused,
        prompt,
        "reused + prefilled = every prompt token"
    );
    // The idle slot shows what it keeps.
    let slots = block(on.slots());
    assert!(
        slots
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["cached"].as_u64() > Some(0)),
        "{slots}"
    );

    // `cache_prompt: false` skips the cache for one request, with the same answers.
    let (got, counters) = replay(&on, json!({"cache_prompt": false}));
    assert_eq!(got, want, "cache_prompt false changed a greedy answer");
    assert!(counters.iter().all(|c| c.0 == 3.0), "{counters:?}");
    // A wrong type is refused.
    let r = block(on.post_json(
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 1, "cache_prompt": 1}),
    ));
    assert_eq!(r.status, 400, "{}", r.text());
    on.stop_with("-TERM", std::time::Duration::from_secs(15));
}

/// A random Qwen3-Next GGUF (4 blocks, every 2nd full attention) whose vocabulary covers
/// the tiny-chat tokenizer's 400 tokens, planned for 2 slots of 512 cells, prefill chunks of 8.
fn next_plan(dir: &Path) -> PathBuf {
    let hp = HParams {
        n_vocab: 400,
        n_ctx_train: 4096,
        ..exec_common::tiny_qwen3next_hp()
    };
    let gguf = dir.join("tiny-next.gguf");
    let opts = RandomOptions {
        name: "tiny next chat".into(),
        ..Default::default()
    };
    let f32 = QuantRecipe::preset("F32").unwrap();
    write_random_model(&gguf, "qwen3next", &hp, &f32, 23, opts).unwrap();
    write_plan(dir, &gguf, 2, 512, 8)
}

/// Each turn's greedy answer, the client sending back a fixed stand-in instead of each
/// answer (as clients that strip or edit replies do); after each turn the prefix cache's
/// hits, reused tokens and checkpoint hits.
fn replay_elided(s: &ExecServer) -> (Vec<String>, Vec<[f64; 3]>) {
    let mut messages: Vec<Value> = Vec::new();
    let mut answers = Vec::new();
    let mut counters = Vec::new();
    for u in USERS {
        messages.push(json!({"role": "user", "content": u}));
        let body = json!({"messages": messages, "max_tokens": 6, "temperature": 0});
        let r = block(s.post_json("/v1/chat/completions", &body));
        assert_eq!(r.status, 200, "{}", r.text());
        let text = r.json()["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        messages.push(json!({"role": "assistant", "content": "(answer elided)"}));
        answers.push(text);
        counters.push([
            block(s.metric("strata_prefix_cache_hits_total")),
            block(s.metric("strata_prefix_cache_reused_tokens_total")),
            block(s.metric("strata_prefix_cache_checkpoint_hits_total")),
        ]);
    }
    (answers, counters)
}

#[test]
fn qwen3next_reuses_its_prefix_checkpoint_when_the_answer_is_not_sent_back() {
    let dir = tempfile::tempdir().unwrap();
    let plan = next_plan(dir.path());
    let tok = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/data/tiny-chat");
    let off = ExecServer::start(&plan, &["--tokenizer", tok, "--no-prefix-cache"]);
    let (want, counters) = replay_elided(&off);
    assert!(counters.iter().all(|c| *c == [0.0; 3]), "{counters:?}");
    off.stop_with("-TERM", std::time::Duration::from_secs(15));

    let on = ExecServer::start(&plan, &["--tokenizer", tok]);
    let (got, counters) = replay_elided(&on);
    assert_eq!(got, want, "the prefix checkpoint changed a greedy answer");
    assert!(want.iter().any(|a| !a.is_empty()), "{want:?}");
    // Turn 1 has nothing to reuse; every later turn rewinds a slot to the end of the turn
    // before's prompt (the answer differs, so the whole context never matches).
    assert_eq!(counters[0], [0.0; 3], "{counters:?}");
    for (t, w) in counters.windows(2).enumerate() {
        assert_eq!(
            w[1][0],
            w[0][0] + 1.0,
            "turn {} was no hit: {counters:?}",
            t + 2
        );
        assert_eq!(
            w[1][2],
            w[0][2] + 1.0,
            "turn {}: not the checkpoint: {counters:?}",
            t + 2
        );
        assert!(
            w[1][1] > w[0][1],
            "turn {} reused nothing: {counters:?}",
            t + 2
        );
    }
    eprintln!("answers {got:?}; [hits, reused, checkpoint hits] per turn {counters:?}");
    let reused = counters[3][1];
    let prompt = block(on.metric("strata_prefix_cache_prompt_tokens_total"));
    let prefilled = block(on.metric("strata_prompt_tokens_total"));
    assert_eq!(
        prefilled + reused,
        prompt,
        "reused + prefilled = every prompt token"
    );
    on.stop_with("-TERM", std::time::Duration::from_secs(15));
}
