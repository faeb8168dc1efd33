//! `Engine::truncate_slot` on the CPU pipeline, the prefix cache's engine half: keeping a
//! prefix of a slot's context and prefilling the rest of a new prompt gives the logits of
//! prefilling the new prompt whole, for Qwen3-MoE (any prefix: a KV cache) and Qwen3-Next
//! (the whole context, or the position of the slot's prefix checkpoint, where its linear
//! state is restored from the plan's `prefix_checkpoint` region; other cuts are refused and
//! leave the slot as it was).

mod common;

use common::plan_folder_ctx;
use strata_exec::engine::{Engine, PrefixReuse};
use strata_exec::exec::{start_cpu, EngineOptions};
use strata_exec::load::GgufModel;
use strata_schemas::arch::QuantRecipe;
use strata_schemas::gguf::random::{write_random_model, RandomOptions};
use strata_schemas::gguf::testutil::tiny_qwen3next;
use strata_schemas::inventory::HParams;
use strata_schemas::plan::RegionKind;
use strata_schemas::serve::ExpertCache;

fn hp(next: bool) -> HParams {
    // The shared tiny Qwen3-Next with 8 experts and no MTP block; the Qwen3-MoE of the same
    // widths drops its shared expert, linear attention and partial RoPE.
    let next_hp = HParams {
        n_expert: 8,
        nextn_predict_layers: 0,
        ..tiny_qwen3next()
    };
    if next {
        return next_hp;
    }
    HParams {
        n_ff_shexp: 0,
        full_attention_interval: None,
        ssm: None,
        rope_dim: None,
        ..next_hp
    }
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter()
        .zip(b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs() / scale))
}

/// A CPU engine over a random model of `arch` (2 slots, 64 cells, prefill chunks of 8).
fn engine(dir: &std::path::Path, arch: &str) -> Box<dyn Engine> {
    engine_on(dir, arch, 1, None, true)
}

/// [`engine`] over `devices` planned CPU devices split at `split`, with or without the plan's
/// prefix checkpoint (as `strata-plan --no-prefix-checkpoint` plans it).
fn engine_on(
    dir: &std::path::Path,
    arch: &str,
    devices: usize,
    split: Option<Vec<u32>>,
    checkpoint: bool,
) -> Box<dyn Engine> {
    let path = dir.join(format!("{arch}.gguf"));
    let recipe = QuantRecipe::preset("F32").unwrap();
    let opts = RandomOptions {
        name: format!("tiny {arch}"),
        ..Default::default()
    };
    write_random_model(&path, arch, &hp(arch == "qwen3next"), &recipe, 11, opts).unwrap();
    let mut plan = plan_folder_ctx(&path, devices, split, ExpertCache::Off, None, 64);
    let linear = plan
        .devices
        .iter()
        .any(|d| d.region_bytes(RegionKind::LinearState) > 0);
    assert_eq!(plan.serve.prefix_checkpoint, linear, "{arch}");
    plan.serve.prefix_checkpoint &= checkpoint;
    Box::new(
        start_cpu(
            &plan,
            Box::new(GgufModel::open(&path).unwrap()),
            EngineOptions::default(),
        )
        .unwrap(),
    )
}

/// Prefill `tokens` into `slot` in chunks of the plan's ubatch; the last token's logits.
fn prefill(e: &mut dyn Engine, slot: usize, tokens: &[u32]) -> Vec<f32> {
    let ub = e.info().ubatch;
    let mut last = Vec::new();
    for (i, c) in tokens.chunks(ub).enumerate() {
        let want = (i + 1) * ub >= tokens.len();
        if let Some(l) = e.prefill(slot, c, want).unwrap() {
            last = l.to_vec();
        }
    }
    last
}

fn toks(n: u32, mul: u32, add: u32) -> Vec<u32> {
    (0..n).map(|i| (i * mul + add) % 128).collect()
}

#[test]
fn qwen3moe_truncate_then_prefill_the_rest_equals_a_whole_prefill() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = engine(dir.path(), "qwen3moe");
    assert_eq!(e.prefix_reuse(), PrefixReuse::Any);
    // Slot 0 holds an old conversation: 20 prompt tokens and 3 decoded ones.
    let old = toks(20, 37, 5);
    prefill(e.as_mut(), 0, &old);
    for t in [9, 17, 33] {
        e.decode(&[(0, t)]).unwrap();
    }
    assert_eq!(e.slot_len(0), 23);
    // The new prompt shares the first 12 tokens, then goes elsewhere.
    let mut new = old[..12].to_vec();
    new.extend(toks(10, 11, 3));
    assert!(!e.truncate_slot(0, 24), "beyond the slot's length");
    assert!(!e.truncate_slot(7, 1), "no such slot");
    assert_eq!(e.slot_len(0), 23);
    for keep in [12usize, 8, 0] {
        // A fresh copy of the old context each round.
        e.reset_slot(0);
        prefill(e.as_mut(), 0, &old);
        assert!(e.truncate_slot(0, keep as u64));
        assert_eq!(e.slot_len(0), keep as u64);
        let got = prefill(e.as_mut(), 0, &new[keep..]);
        e.reset_slot(1);
        let want = prefill(e.as_mut(), 1, &new);
        // The same math on the same cells: bit for bit on this backend (1e-5 leaves room
        // for a backend whose products depend on the chunk's size).
        let r = max_rel(&got, &want);
        assert!(r <= 1e-5, "keep {keep}: differs by {r}");
        // And decoding on from both gives the same next logits.
        let a = e.decode(&[(0, 42), (1, 42)]).unwrap().to_vec();
        let v = e.info().n_vocab;
        let r = max_rel(&a[..v], &a[v..]);
        assert!(r <= 1e-5, "keep {keep}: the decode after differs by {r}");
    }
}

#[test]
fn qwen3next_keeps_only_the_whole_context_and_continuing_it_equals_a_whole_prefill() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = engine(dir.path(), "qwen3next");
    assert_eq!(e.prefix_reuse(), PrefixReuse::Whole);
    let old = toks(13, 37, 5);
    prefill(e.as_mut(), 0, &old);
    for t in [9, 17] {
        e.decode(&[(0, t)]).unwrap();
    }
    let mut held = old.clone();
    held.extend([9, 17]);
    assert_eq!(e.slot_len(0), 15);
    // Rewinding the linear state is refused and changes nothing.
    assert!(!e.truncate_slot(0, 14));
    assert!(!e.truncate_slot(0, 0));
    assert_eq!(e.slot_len(0), 15);
    assert!(e.truncate_slot(0, 15));
    // The next turn extends everything held.
    let mut new = held.clone();
    new.extend(toks(9, 11, 3));
    let got = prefill(e.as_mut(), 0, &new[15..]);
    e.reset_slot(1);
    let want = prefill(e.as_mut(), 1, &new);
    let r = max_rel(&got, &want);
    // The held part was partly decoded (the recurrent form of the delta rule) where the
    // whole prefill runs the chunked form: equal up to rounding.
    assert!(r < 1e-4, "differs by {r}");
    let v = e.info().n_vocab;
    let a = e.decode(&[(0, 42), (1, 42)]).unwrap().to_vec();
    let r = max_rel(&a[..v], &a[v..]);
    assert!(r < 1e-4, "the decode after differs by {r}");
}

/// The prefix checkpoint: a Qwen3-Next slot saved at the end of its prompt and decoded on
/// rewinds to exactly that position (and no other), and prefilling a different continuation
/// from there gives the logits of prefilling the new prompt whole, again and again from the
/// same checkpoint, on one planned device and on a layer split over two (each stage restores
/// its own layers); a reset or a copy over the slot forgets it, and a plan without the
/// checkpoint region keeps none.
#[test]
fn qwen3next_rewinds_to_its_prefix_checkpoint_and_continuing_equals_a_whole_prefill() {
    let v = 128;
    for (what, devices, split) in [("one device", 1, None), ("two devices", 2, Some(vec![2]))] {
        let dir = tempfile::tempdir().unwrap();
        let mut e = engine_on(dir.path(), "qwen3next", devices, split, true);
        let old = toks(13, 37, 5);
        prefill(e.as_mut(), 0, &old);
        assert_eq!(e.prefix_checkpoint(0), None, "{what}: none before a save");
        assert!(e.save_prefix_checkpoint(0).unwrap(), "{what}");
        assert_eq!(e.prefix_checkpoint(0), Some(13), "{what}");
        for t in [9, 17, 33] {
            e.decode(&[(0, t)]).unwrap();
        }
        assert_eq!(e.slot_len(0), 16);
        assert!(
            !e.truncate_slot(0, 12),
            "{what}: only the checkpoint's position"
        );
        assert!(
            !e.truncate_slot(0, 14),
            "{what}: only the checkpoint's position"
        );
        assert_eq!(e.slot_len(0), 16);
        for round in 0..3u32 {
            assert!(e.truncate_slot(0, 13), "{what} round {round}");
            assert_eq!(e.slot_len(0), 13);
            let mut new = old.clone();
            new.extend(toks(9 + round, 11, 3 + round));
            let got = prefill(e.as_mut(), 0, &new[13..]);
            e.reset_slot(1);
            let want = prefill(e.as_mut(), 1, &new);
            // Chunks of 8 over 13 + 9 tokens against 8 over 22: the chunked delta rule's
            // blocks differ, equal up to rounding (as the whole-context test above).
            let r = max_rel(&got, &want);
            assert!(r < 1e-4, "{what} round {round}: differs by {r}");
            let a = e.decode(&[(0, 42), (1, 42)]).unwrap().to_vec();
            let r = max_rel(&a[..v], &a[v..]);
            assert!(
                r < 1e-4,
                "{what} round {round}: the decode after differs by {r}"
            );
            assert_eq!(
                e.prefix_checkpoint(0),
                Some(13),
                "{what}: rewinding keeps it"
            );
        }
        // Copying over a slot or resetting it forgets its checkpoint.
        assert!(e.save_prefix_checkpoint(1).unwrap());
        assert!(e.copy_slot(0, 1).unwrap());
        assert_eq!(e.prefix_checkpoint(1), None, "{what}");
        e.reset_slot(0);
        assert_eq!(e.prefix_checkpoint(0), None, "{what}");
        prefill(e.as_mut(), 0, &old);
        assert!(
            !e.truncate_slot(0, 5),
            "{what}: no checkpoint after a reset"
        );
    }
    // A plan without the region (`--no-prefix-checkpoint`) saves nothing.
    let dir = tempfile::tempdir().unwrap();
    let mut e = engine_on(dir.path(), "qwen3next", 1, None, false);
    prefill(e.as_mut(), 0, &toks(13, 37, 5));
    assert!(!e.save_prefix_checkpoint(0).unwrap());
    assert_eq!(e.prefix_checkpoint(0), None);
    // Nor does a KV-cache model, which needs none.
    let mut e = engine(dir.path(), "qwen3moe");
    prefill(e.as_mut(), 0, &toks(13, 37, 5));
    assert!(!e.save_prefix_checkpoint(0).unwrap());
}

/// `Engine::copy_slot`, the `n`-choices half: a slot given a copy of another's context (KV
/// cells and, for Qwen3-Next, the conv and recurrent state) decodes exactly as the original,
/// whatever it held before; a slot onto itself or outside the engine is refused.
#[test]
fn copy_slot_continues_the_sequence_for_both_architectures() {
    for arch in ["qwen3moe", "qwen3next"] {
        let dir = tempfile::tempdir().unwrap();
        let mut e = engine(dir.path(), arch);
        let v = e.info().n_vocab;
        let prompt = toks(19, 37, 5);
        let row = prefill(e.as_mut(), 0, &prompt);
        // Slot 1 holds an unrelated context first: the copy must replace all of it.
        prefill(e.as_mut(), 1, &toks(23, 3, 1));
        assert!(e.copy_slot(0, 1).unwrap(), "{arch}");
        assert_eq!(e.slot_len(1), 19, "{arch}");
        let mut t = strata_exec::sampler::argmax(&row);
        for step in 0..4 {
            let a = e.decode(&[(0, t), (1, t)]).unwrap().to_vec();
            let r = max_rel(&a[v..], &a[..v]);
            assert!(r <= 1e-6, "{arch} step {step}: the copy differs by {r}");
            t = strata_exec::sampler::argmax(&a[..v]);
        }
        assert!(!e.copy_slot(0, 0).unwrap(), "{arch}: onto itself");
        assert!(!e.copy_slot(0, 9).unwrap(), "{arch}: no such slot");
    }
}
