//! Greedy decoding drivers shared by the MTP speculation tests of every engine (`mtp_cpu`,
//! `cuda_mtp`): the same prompt, prefill chunking and draft forcing, so the CPU and CUDA
//! suites check one behaviour. Invariant: each returns exactly `n` tokens.

use std::path::{Path, PathBuf};
use strata_exec::engine::Engine;
use strata_schemas::arch::QuantRecipe;
use strata_schemas::gguf::random::{write_random_model, RandomOptions};
use strata_schemas::inventory::HParams;

/// An F32 random Qwen3-Next of `hp` with one MTP block, `next-mtp.gguf` in `dir` (seed 9).
pub fn mtp_model(dir: &Path, hp: HParams) -> PathBuf {
    let path = dir.join("next-mtp.gguf");
    let hp = HParams {
        nextn_predict_layers: 1,
        ..hp
    };
    let recipe = QuantRecipe::preset("F32").unwrap();
    let opts = RandomOptions {
        name: "tiny next mtp".into(),
        ..Default::default()
    };
    write_random_model(&path, "qwen3next", &hp, &recipe, 9, opts).unwrap();
    path
}

/// Eleven prompt tokens over a vocabulary of 128, different for each `seed`.
pub fn prompt(seed: u32) -> Vec<u32> {
    (0..11u32).map(|i| (i * 53 + 7 + seed * 13) % 128).collect()
}

/// Prefill `p` into `slot` (chunks of 8, the tests' ubatch) and return the first greedy pick.
pub fn prefill(e: &mut dyn Engine, slot: usize, p: &[u32]) -> u32 {
    let mut last = Vec::new();
    for chunk in p.chunks(8) {
        last = e.prefill(slot, chunk, true).unwrap().unwrap().to_vec();
    }
    super::argmax(&last)
}

/// `n` greedy tokens after `p` without speculation.
pub fn plain(e: &mut dyn Engine, slot: usize, p: &[u32], n: usize) -> Vec<u32> {
    let mut out = vec![prefill(e, slot, p)];
    let mut tok = [0u32];
    while out.len() < n {
        e.decode_greedy(&[(slot, *out.last().unwrap())], &mut tok)
            .unwrap();
        out.push(tok[0]);
    }
    out
}

/// Plain greedy decoding of prompts 0 and 1 in slot 0 (reset before each), `n` tokens each:
/// what every speculative run must reproduce.
pub fn plain_pair_in_turn(e: &mut dyn Engine, n: usize) -> Vec<Vec<u32>> {
    (0..2)
        .map(|s| {
            e.reset_slot(0);
            plain(e, 0, &prompt(s), n)
        })
        .collect()
}

/// `n` greedy tokens after `p` by speculative steps; `forced(done)` gives the drafts to force
/// when the output holds `done` tokens (`None`: the MTP head's own).
pub fn speculative(
    e: &mut dyn Engine,
    slot: usize,
    p: &[u32],
    n: usize,
    forced: &dyn Fn(usize) -> Option<Vec<u32>>,
) -> Vec<u32> {
    let mut out = vec![prefill(e, slot, p)];
    let mut buf = vec![0u32; e.spec_tokens() + 1];
    while out.len() < n {
        let f = forced(out.len());
        let got = e
            .decode_spec_greedy(slot, *out.last().unwrap(), f.as_deref(), &mut buf)
            .unwrap();
        assert!((1..=buf.len()).contains(&got));
        out.extend_from_slice(&buf[..got]);
    }
    out.truncate(n);
    out
}

/// `n` greedy tokens of slots 0 and 1 (prompts 0 and 1) by speculative steps taken in turn.
pub fn speculative_pair(e: &mut dyn Engine, n: usize) -> [Vec<u32>; 2] {
    let mut out = [
        vec![prefill(e, 0, &prompt(0))],
        vec![prefill(e, 1, &prompt(1))],
    ];
    let mut buf = vec![0u32; e.spec_tokens() + 1];
    while out.iter().any(|o| o.len() < n) {
        for (s, o) in out.iter_mut().enumerate() {
            if o.len() < n {
                let got = e
                    .decode_spec_greedy(s, *o.last().unwrap(), None, &mut buf)
                    .unwrap();
                assert!((1..=buf.len()).contains(&got));
                o.extend_from_slice(&buf[..got]);
            }
        }
    }
    out.iter_mut().for_each(|o| o.truncate(n));
    out
}

/// Forced drafts on `e` (speculating `spec` tokens) against `want`, plain decoding's tokens
/// of prompt 2 (`n + spec` or more of them): drafts equal to `want` are all accepted; drafts
/// wrong from position `k` on (k cycling over 0..spec) keep k and roll the rest back, and
/// the output is still `want`. Both checked on `e`'s draft counters.
pub fn forced_drafts_accept_and_roll_back(e: &mut dyn Engine, want: &[u32], spec: usize, n: usize) {
    let oracle = |done: usize| Some(want[done..done + spec].to_vec());
    let got = speculative(e, 0, &prompt(2), n, &oracle);
    assert_eq!(got, want[..n]);
    let st = e.stats().speculation;
    assert!(st.drafted > 0);
    assert_eq!(
        st.accepted, st.drafted,
        "forced agreement accepts every draft"
    );

    e.reset_slot(0);
    let before = e.stats().speculation;
    let wrong_from = |done: usize| {
        let k = done % spec;
        let mut d = want[done..done + spec].to_vec();
        for t in &mut d[k..] {
            *t = (*t + 1) % 128;
        }
        Some(d)
    };
    let got = speculative(e, 0, &prompt(2), n, &wrong_from);
    assert_eq!(got, want[..n], "rollback left a trace");
    let st = e.stats().speculation;
    let (drafted, accepted) = (st.drafted - before.drafted, st.accepted - before.accepted);
    assert!(
        accepted > 0 && accepted < drafted,
        "{accepted} of {drafted}"
    );
}
