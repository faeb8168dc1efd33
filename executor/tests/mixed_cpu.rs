//! Mixed steps on the CPU pipeline (`Engine::step_mixed`: one slot's prompt chunk and the
//! other slots' decode tokens in one pass, `StepKind::Mixed`): the logits and greedy picks
//! equal the same requests run as separate prefill and decode steps, for Qwen3-MoE and
//! Qwen3-Next (whose linear attention runs the chunk's rows and each decode row over their
//! own slot's state), on one planned device and on a layer split over two; a step the
//! engine refuses leaves every slot as it was.

mod common;

use common::mixed::{compare, prefill, prompt};
use common::*;
use std::path::Path;
use strata_exec::engine::{DecodePick, Engine, EngineError, MixedPrefill};
use strata_exec::exec::{start_cpu, EngineOptions};
use strata_exec::load::open_model;
use strata_schemas::arch::QuantRecipe;
use strata_schemas::gguf::random::{write_random_model, RandomOptions};
use strata_schemas::inventory::HParams;
use strata_schemas::serve::ExpertCache;

/// tests/common's tiny Qwen3-Next, or the same widths as an all-full-attention Qwen3-MoE.
fn hp(arch: &str) -> HParams {
    let next = tiny_qwen3next_hp();
    if arch == "qwen3next" {
        return next;
    }
    HParams {
        n_ff_shexp: 0,
        full_attention_interval: None,
        ssm: None,
        rope_dim: None,
        ..next
    }
}

fn write_model(dir: &Path, arch: &str) -> std::path::PathBuf {
    let path = dir.join(format!("{arch}.gguf"));
    let recipe = QuantRecipe::preset("F32").unwrap();
    let opts = RandomOptions {
        name: format!("tiny {arch}"),
        ..Default::default()
    };
    write_random_model(&path, arch, &hp(arch), &recipe, 23, opts).unwrap();
    path
}

/// Three slots of 64 cells, prefill chunks and passes of 8 tokens, on `devices` planned CPU
/// devices split at `split`.
fn engine(gguf: &Path, devices: usize, split: Option<Vec<u32>>) -> Box<dyn Engine> {
    let inv = strata_plan::model::load_model(gguf).unwrap();
    let ask = Ask {
        devices,
        split,
        batch: 3,
        ctx: 64,
        ubatch: 8,
        cache: ExpertCache::Off,
        ..Ask::default()
    };
    let plan = plan_inventory("mixed-random", &inv, gguf, &ask);
    Box::new(start_cpu(&plan, open_model(gguf).unwrap(), EngineOptions::default()).unwrap())
}

#[test]
fn mixed_steps_equal_separate_prefill_and_decode_steps() {
    for arch in ["qwen3moe", "qwen3next"] {
        let dir = tempfile::tempdir().unwrap();
        let gguf = write_model(dir.path(), arch);
        for (what, devices, split) in [("one device", 1, None), ("two devices", 2, Some(vec![2]))] {
            let mut mixed = engine(&gguf, devices, split.clone());
            let mut apart = engine(&gguf, devices, split);
            // Two decode rows leave 6 of the 8-token pass to the prompt.
            assert_eq!(mixed.mixed_chunk(2), 6, "{arch}, {what}");
            let steps = compare(mixed.as_mut(), apart.as_mut(), 29, 1e-4);
            assert_eq!(steps, 5, "{arch}, {what}: 29 prompt tokens in chunks of 6");
            eprintln!("{arch}, {what}: {steps} mixed steps agree");
        }
    }
}

fn refused(r: Result<Option<&[f32]>, EngineError>, what: &str) {
    match r {
        Err(EngineError::Request(m)) => eprintln!("{what}: refused: {m}"),
        Err(e) => panic!("{what}: refused as an engine failure: {e}"),
        Ok(_) => panic!("{what}: accepted"),
    }
}

#[test]
fn a_refused_mixed_step_leaves_every_slot_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = write_model(dir.path(), "qwen3next");
    let mut e = engine(&gguf, 1, None);
    let v = e.info().n_vocab;
    prefill(e.as_mut(), 1, &prompt(5, 1, v));
    prefill(e.as_mut(), 2, &prompt(7, 2, v));
    prefill(e.as_mut(), 0, &prompt(3, 3, v));
    let lens = [3u64, 5, 7];
    let chunk = prompt(6, 4, v);
    let mut row = vec![0f32; v];
    let p = |tokens| MixedPrefill {
        slot: 0,
        tokens,
        want_logits: true,
    };
    refused(
        e.step_mixed(p(&chunk), &mut row, &[(0, 1), (1, 2)], DecodePick::Logits),
        "the prompt's slot also decoding",
    );
    refused(
        e.step_mixed(p(&chunk), &mut row, &[(1, 1), (1, 2)], DecodePick::Logits),
        "a slot twice",
    );
    let long = prompt(7, 4, v);
    refused(
        e.step_mixed(p(&long), &mut row, &[(1, 1), (2, 2)], DecodePick::Logits),
        "7 prompt tokens beside 2 decode rows in passes of 8",
    );
    refused(
        e.step_mixed(p(&[]), &mut row, &[(1, 1)], DecodePick::Logits),
        "an empty chunk",
    );
    refused(
        e.step_mixed(p(&chunk), &mut row, &[], DecodePick::Logits),
        "no decode rows",
    );
    refused(
        e.step_mixed(
            p(&chunk),
            &mut row,
            &[(1, 1), (2, v as u32)],
            DecodePick::Logits,
        ),
        "a decode token outside the vocabulary",
    );
    refused(
        e.step_mixed(p(&chunk), &mut row[..v - 1], &[(1, 1)], DecodePick::Logits),
        "no room for the prompt's row",
    );
    let mut out = [0u32; 1];
    refused(
        e.step_mixed(
            p(&chunk),
            &mut row,
            &[(1, 1), (2, 2)],
            DecodePick::Sample {
                draws: &[strata_exec::sampler::Draw::GREEDY; 2],
                out: &mut out,
            },
        ),
        "room for 1 pick of 2",
    );
    for (s, &len) in lens.iter().enumerate() {
        assert_eq!(e.slot_len(s), len, "slot {s} after the refusals");
    }
    // The slots still give what a fresh engine gives for the same requests.
    let mut fresh = engine(&gguf, 1, None);
    prefill(fresh.as_mut(), 1, &prompt(5, 1, v));
    prefill(fresh.as_mut(), 2, &prompt(7, 2, v));
    prefill(fresh.as_mut(), 0, &prompt(3, 3, v));
    let batch = [(0, 5), (1, 6), (2, 7)];
    let want = fresh.decode(&batch).unwrap().to_vec();
    let got = e.decode(&batch).unwrap().to_vec();
    let r = max_rel(&got, &want);
    assert!(r <= 1e-5, "after the refusals: {r}");
}

/// Not a check: writes the random Qwen3-MoE (the tiny-chat tokenizer's 400-token vocabulary,
/// Q8_0, 8 blocks of hidden 1024 and 32 experts of 512, top-4) that BENCHMARKS.md's mixed-pass
/// load measurement serves, under this build's target tmp folder, and prints its path:
/// `cargo test -p strata-exec --release --test mixed_cpu -- --ignored --nocapture`.
#[test]
#[ignore = "writes the serve_load.py measurement's model"]
fn write_the_load_measurement_model() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("mixed-load");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("moe-1024x8.gguf");
    let hp = HParams {
        n_layer: 8,
        n_embd: 1024,
        n_vocab: 400,
        n_ctx_train: 4096,
        n_head: 16,
        n_head_kv: 4,
        head_dim_k: 64,
        head_dim_v: 64,
        n_expert: 32,
        n_expert_used: 4,
        n_ff_exp: 512,
        ..hp("qwen3moe")
    };
    let recipe = QuantRecipe::preset("Q8_0").unwrap();
    let opts = RandomOptions {
        name: "mixed-load moe".into(),
        ..Default::default()
    };
    write_random_model(&path, "qwen3moe", &hp, &recipe, 5, opts).unwrap();
    println!("MODEL {}", path.display());
}
