//! The mixed-step comparison (`Engine::step_mixed`: a prompt chunk and other slots' decode
//! tokens in one pass) shared by `mixed_cpu` and `cuda_mixed`: two engines over the same
//! plan, one driven by mixed steps and one by the same requests run as separate prefill and
//! decode steps, must agree on every logit row (within `tol` of the largest) and every
//! greedy pick, during the mixed steps and in plain decode steps afterwards (which read the
//! KV and linear state the mixed passes wrote).

use super::max_rel;
use strata_exec::engine::{DecodePick, Engine, MixedPrefill};
use strata_exec::sampler::{argmax_rows, Draw};

/// `len` prompt tokens below `vocab` from `seed`.
pub fn prompt(len: usize, seed: u32, vocab: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 37 + seed) % vocab as u32)
        .collect()
}

/// Prefill `tokens` into `slot` in chunks of the plan's ubatch; the last token's logits.
pub fn prefill(e: &mut dyn Engine, slot: usize, tokens: &[u32]) -> Vec<f32> {
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

fn close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    let r = max_rel(got, want);
    assert!(r <= tol, "{what}: max relative difference {r} > {tol}");
}

/// Slots 1 and 2 decode while slot 0's long prompt (`long` tokens) arrives in mixed steps
/// of the chunk `mixed.mixed_chunk` allows (then the same chunks on `apart` as prefill
/// calls, each followed by the decode step); every other mixed step picks its decode rows
/// greedily on the engine instead of returning them. Then every slot decodes a few plain
/// steps together on both. Teacher-forced with `apart`'s greedy picks. Returns the mixed
/// steps run.
pub fn compare(mixed: &mut dyn Engine, apart: &mut dyn Engine, long: usize, tol: f32) -> usize {
    let v = apart.info().n_vocab;
    assert!(mixed.info().n_slots >= 3, "the comparison needs 3 slots");
    // Two slots hold short sequences and have decoded a token each.
    let mut next = [0u32; 3];
    for (slot, len) in [(1usize, 5usize), (2, 11)] {
        let p = prompt(len, 7 * slot as u32, v);
        let a = prefill(apart, slot, &p);
        let m = prefill(mixed, slot, &p);
        close(&format!("slot {slot}'s prompt"), &m, &a, tol);
        next[slot] = argmax_rows_one(&a, v);
    }
    let batch: Vec<(usize, u32)> = (1..3).map(|s| (s, next[s])).collect();
    let a = apart.decode(&batch).unwrap().to_vec();
    let m = mixed.decode(&batch).unwrap().to_vec();
    close("the first decode step", &m, &a, tol);
    let mut picks = vec![0u32; 2];
    argmax_rows(&a, v, &mut picks);
    next[1] = picks[0];
    next[2] = picks[1];
    // Slot 0's long prompt in mixed steps.
    let long_prompt = prompt(long, 3, v);
    let mut row = vec![0f32; v];
    let (mut fed, mut steps) = (0usize, 0usize);
    while fed < long {
        let batch: Vec<(usize, u32)> = (1..3).map(|s| (s, next[s])).collect();
        let room = mixed.mixed_chunk(batch.len());
        assert!(room >= 1, "no room for a prompt chunk beside 2 decode rows");
        let end = (fed + room).min(long);
        let chunk = &long_prompt[fed..end];
        let last = end == long;
        let what = format!("mixed step {steps} (prompt {fed}..{end} of {long})");
        let want_prompt = apart.prefill(0, chunk, last).unwrap().map(<[f32]>::to_vec);
        let want = apart.decode(&batch).unwrap().to_vec();
        let mut want_picks = vec![0u32; batch.len()];
        argmax_rows(&want, v, &mut want_picks);
        let prefill = MixedPrefill {
            slot: 0,
            tokens: chunk,
            want_logits: last,
        };
        row.fill(f32::NAN);
        if steps % 2 == 0 {
            let got = mixed
                .step_mixed(prefill, &mut row, &batch, DecodePick::Logits)
                .unwrap()
                .expect("the decode rows' logits")
                .to_vec();
            close(&format!("{what}: decode rows"), &got, &want, tol);
            let mut got_picks = vec![0u32; batch.len()];
            argmax_rows(&got, v, &mut got_picks);
            same_picks(&what, &got_picks, &want_picks, &want, v, tol);
        } else {
            let draws = vec![Draw::GREEDY; batch.len()];
            let mut out = vec![u32::MAX; batch.len()];
            let got = mixed
                .step_mixed(
                    prefill,
                    &mut row,
                    &batch,
                    DecodePick::Sample {
                        draws: &draws,
                        out: &mut out,
                    },
                )
                .unwrap();
            assert!(got.is_none(), "{what}: picked on the engine, no rows back");
            same_picks(
                &format!("{what} (on the engine)"),
                &out,
                &want_picks,
                &want,
                v,
                tol,
            );
        }
        if let Some(w) = want_prompt {
            close(&format!("{what}: the prompt's last row"), &row, &w, tol);
            next[0] = argmax_rows_one(&w, v);
        }
        for (k, s) in (1..3).enumerate() {
            next[s] = want_picks[k];
        }
        for s in 0..3 {
            assert_eq!(mixed.slot_len(s), apart.slot_len(s), "{what}: slot {s}");
        }
        fed = end;
        steps += 1;
    }
    // Plain decode steps of all three slots read what the mixed passes wrote.
    for step in 0..3 {
        let batch: Vec<(usize, u32)> = (0..3).map(|s| (s, next[s])).collect();
        let a = apart.decode(&batch).unwrap().to_vec();
        let m = mixed.decode(&batch).unwrap().to_vec();
        close(
            &format!("decode step {step} after the mixed steps"),
            &m,
            &a,
            tol,
        );
        argmax_rows(&a, v, &mut next);
    }
    steps
}

/// Each pick equals the wanted one, except where the wanted row's two largest logits lie
/// within `4 tol` of its largest (a tie the tolerance allows to go either way; never on
/// the CPU at 1e-4, where both engines run the same ops).
fn same_picks(what: &str, got: &[u32], want: &[u32], rows: &[f32], v: usize, tol: f32) {
    for (i, row) in rows.chunks_exact(v).enumerate() {
        let scale = row.iter().fold(0f32, |m, x| m.max(x.abs()));
        let top = row[want[i] as usize];
        let second = row
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != want[i] as usize)
            .fold(f32::MIN, |m, (_, x)| m.max(*x));
        if top - second > 4.0 * tol * scale {
            assert_eq!(got[i], want[i], "{what}: greedy pick of row {i}");
        } else {
            eprintln!(
                "{what}: row {i}'s top two logits tie within the tolerance; pick not compared"
            );
        }
    }
}

fn argmax_rows_one(row: &[f32], v: usize) -> u32 {
    let mut out = [0u32];
    argmax_rows(&row[..v], v, &mut out);
    out[0]
}
