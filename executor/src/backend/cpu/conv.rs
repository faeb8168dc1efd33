//! Qwen3-Next's causal depthwise conv1d + SiLU over the mixed q/k/v channels, with the rolling
//! conv state a slot keeps between calls.
//! Invariant: prefilling n tokens in one call and stepping them one at a time give the same
//! outputs and the same final state (the state is exactly the last `k - 1` inputs seen).
//!
//! Layouts: `x` and `out` are token-major (`n_tok × channels`); `weight` is llama.cpp's
//! `ssm_conv1d` (GGUF dims `[k, channels]`: row `c` holds channel `c`'s `k` taps, the last tap
//! multiplying the current token; HF's `conv1d.weight [channels, 1, k]` has the same bytes);
//! `state` is `(k - 1) × channels`, row 0 the oldest input, zero for a fresh slot.
//!
//! `out[t][c] = silu(Σ_i weight[c][i] · in[t - (k - 1) + i][c])`, where `in[τ]` for `τ < 0`
//! is state row `k - 1 + τ`: HF's `F.silu(conv1d(x, padding = k - 1)[..., :n_tok])` and its
//! `torch_causal_conv1d_update`, and llama.cpp's `ggml_ssm_conv` over `concat(state, x)`.

use super::ops::{need, silu, OpError};
use rayon::prelude::*;

/// Run the conv over `n_tok` tokens of `channels` channels (`weight` is `channels × k`) and
/// roll `state` forward. Parallel over tokens.
pub fn conv1d_silu(
    x: &[f32],
    n_tok: usize,
    channels: usize,
    weight: &[f32],
    k: usize,
    state: &mut [f32],
    out: &mut [f32],
) -> Result<(), OpError> {
    if k == 0 {
        return Err(OpError::Shape {
            op: "conv1d",
            what: "k (kernel width)",
            expected: 1,
            got: 0,
        });
    }
    let hist = k - 1;
    need("conv1d", "x", n_tok * channels, x.len())?;
    need("conv1d", "weight", channels * k, weight.len())?;
    need("conv1d", "state", hist * channels, state.len())?;
    need("conv1d", "out", n_tok * channels, out.len())?;
    {
        let state: &[f32] = state;
        // Input row `j` of the virtual sequence concat(state, x).
        let input = |j: usize| -> &[f32] {
            if j < hist {
                &state[j * channels..(j + 1) * channels]
            } else {
                let t = j - hist;
                &x[t * channels..(t + 1) * channels]
            }
        };
        out[..n_tok * channels]
            .par_chunks_mut(channels)
            .with_min_len(4)
            .enumerate()
            .for_each(|(t, o)| {
                for (c, oc) in o.iter_mut().enumerate() {
                    let w = &weight[c * k..(c + 1) * k];
                    let mut acc = 0f32;
                    for (i, wi) in w.iter().enumerate() {
                        acc += wi * input(t + i)[c];
                    }
                    *oc = silu(acc);
                }
            });
    }
    roll_state(x, n_tok, channels, hist, state);
    Ok(())
}

/// Keep the last `hist` rows of `concat(state, x)` in `state`.
fn roll_state(x: &[f32], n_tok: usize, channels: usize, hist: usize, state: &mut [f32]) {
    if hist == 0 {
        return;
    }
    let state = &mut state[..hist * channels];
    if n_tok >= hist {
        state.copy_from_slice(&x[(n_tok - hist) * channels..n_tok * channels]);
    } else {
        let keep = hist - n_tok;
        state.copy_within(n_tok * channels.., 0);
        state[keep * channels..].copy_from_slice(&x[..n_tok * channels]);
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// `n` deterministic values in [-1, 1) from `seed` (an LCG; the CPU op tests share it).
    pub(in crate::backend::cpu) fn lcg(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// The convolution straight from its definition, in f64, over concat(state, x).
    fn naive(x: &[f32], n_tok: usize, ch: usize, w: &[f32], k: usize, state: &[f32]) -> Vec<f32> {
        let mut seq: Vec<f64> = state.iter().map(|v| *v as f64).collect();
        seq.extend(x[..n_tok * ch].iter().map(|v| *v as f64));
        let mut out = vec![0f32; n_tok * ch];
        for t in 0..n_tok {
            for c in 0..ch {
                let mut acc = 0f64;
                for i in 0..k {
                    acc += w[c * k + i] as f64 * seq[(t + i) * ch + c];
                }
                out[t * ch + c] = (acc / (1.0 + (-acc).exp())) as f32;
            }
        }
        out
    }

    #[test]
    fn hand_computed_two_channels() {
        // k = 3, channel 0 taps [1, 2, 3], channel 1 taps [0, 0, 1] (identity on the current
        // token). State rows (oldest first): [1, 10], [2, 20]; tokens [3, 30], [4, 40].
        let w = [1.0f32, 2.0, 3.0, 0.0, 0.0, 1.0];
        let mut state = [1.0f32, 10.0, 2.0, 20.0];
        let x = [3.0f32, 30.0, 4.0, 40.0];
        let mut out = [0f32; 4];
        conv1d_silu(&x, 2, 2, &w, 3, &mut state, &mut out).unwrap();
        // t0 ch0: 1*1 + 2*2 + 3*3 = 14; t1 ch0: 1*2 + 2*3 + 3*4 = 20; ch1 = the token.
        for (got, pre) in out.iter().zip([14.0f32, 30.0, 20.0, 40.0]) {
            assert!((got - silu(pre)).abs() < 1e-6, "{out:?}");
        }
        assert_eq!(state, [3.0, 30.0, 4.0, 40.0], "the last two inputs");
        // One more token shifts the window by one.
        let mut o1 = [0f32; 2];
        conv1d_silu(&[5.0, 50.0], 1, 2, &w, 3, &mut state, &mut o1).unwrap();
        assert!((o1[0] - silu(3.0 + 8.0 + 15.0)).abs() < 1e-5);
        assert_eq!(state, [4.0, 40.0, 5.0, 50.0]);
    }

    #[test]
    fn prefill_equals_steps_equals_naive() {
        for (k, ch, n_tok) in [
            (4, 24, 9),
            (4, 7, 2),
            (3, 5, 1),
            (2, 3, 6),
            (1, 4, 3),
            (5, 8, 3),
        ] {
            let w = lcg(1 + k as u64, ch * k);
            let x = lcg(7 * ch as u64, n_tok * ch);
            let init = lcg(99, (k - 1) * ch);
            let want = naive(&x, n_tok, ch, &w, k, &init);

            let mut s_all = init.clone();
            let mut o_all = vec![0f32; n_tok * ch];
            conv1d_silu(&x, n_tok, ch, &w, k, &mut s_all, &mut o_all).unwrap();

            let mut s_step = init.clone();
            let mut o_step = vec![0f32; n_tok * ch];
            for t in 0..n_tok {
                conv1d_silu(
                    &x[t * ch..(t + 1) * ch],
                    1,
                    ch,
                    &w,
                    k,
                    &mut s_step,
                    &mut o_step[t * ch..(t + 1) * ch],
                )
                .unwrap();
            }
            assert_eq!(o_all, o_step, "k {k} ch {ch} n {n_tok}: prefill vs steps");
            assert_eq!(s_all, s_step, "k {k} ch {ch} n {n_tok}: final state");
            for (a, b) in o_all.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "k {k}: {a} vs {b}");
            }
            // The final state is the last k-1 inputs of concat(init, x).
            let mut seq = init.clone();
            seq.extend_from_slice(&x);
            assert_eq!(s_all[..], seq[seq.len() - (k - 1) * ch..]);
        }
    }

    #[test]
    fn any_split_of_the_sequence_gives_the_same_outputs_and_state() {
        use rand::{rngs::StdRng, Rng, SeedableRng};
        let mut rng = StdRng::seed_from_u64(0xc0_417);
        for trial in 0..50u64 {
            let k = rng.random_range(1..=6usize);
            let ch = rng.random_range(1..=20usize);
            let n = rng.random_range(1..=24usize);
            let w = lcg(trial * 3 + 1, ch * k);
            let x = lcg(trial * 3 + 2, n * ch);
            let init = lcg(trial * 3 + 3, (k - 1) * ch);
            let want = naive(&x, n, ch, &w, k, &init);
            let mut st = init.clone();
            let mut out = vec![0f32; n * ch];
            let mut t = 0;
            while t < n {
                let len = rng.random_range(1..=n - t);
                conv1d_silu(
                    &x[t * ch..(t + len) * ch],
                    len,
                    ch,
                    &w,
                    k,
                    &mut st,
                    &mut out[t * ch..(t + len) * ch],
                )
                .unwrap();
                t += len;
            }
            for (a, b) in out.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "trial {trial}: {a} vs {b}");
            }
            let mut seq = init.clone();
            seq.extend_from_slice(&x);
            assert_eq!(
                st[..],
                seq[seq.len() - (k - 1) * ch..],
                "trial {trial}: state"
            );
        }
    }

    #[test]
    fn shapes_are_checked_by_name() {
        let mut st = [0f32; 6];
        let mut out = [0f32; 4];
        let e = conv1d_silu(&[0.0; 3], 2, 2, &[0.0; 8], 4, &mut st, &mut out).unwrap_err();
        assert!(e.to_string().contains("conv1d: x"), "{e}");
        let e = conv1d_silu(&[0.0; 4], 2, 2, &[0.0; 7], 4, &mut st, &mut out).unwrap_err();
        assert!(e.to_string().contains("weight"), "{e}");
        let e = conv1d_silu(&[0.0; 4], 2, 2, &[0.0; 8], 4, &mut st[..5], &mut out).unwrap_err();
        assert!(e.to_string().contains("state"), "{e}");
        let e = conv1d_silu(&[0.0; 4], 2, 2, &[0.0; 8], 0, &mut st, &mut out).unwrap_err();
        assert!(e.to_string().contains("kernel"), "{e}");
    }
}
