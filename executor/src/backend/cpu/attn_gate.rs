//! Qwen3-Next's gated full attention, the parts around the attention op: `attn_q` emits, per
//! head, the query then a gate of the same width; the query goes through QK-norm and partial
//! RoPE (NEOX over the first `n_rot` dims, [`super::Rope`] with `n_rot < head_dim`), and the
//! attention output is multiplied by `sigmoid(gate)` before `attn_output`.
//! Invariant: HF's `Qwen3NextAttention` split (`view(..., n_head, 2·head_dim)` then `chunk(2)`)
//! and llama.cpp's views of the same tensor pick the same elements; shapes are checked first.

use super::ops::{need, OpError};

/// Split the `attn_q` output (`n_tok × n_head × 2·head_dim`: per head the query then the gate)
/// into `q` and `gate` (each `n_tok × n_head × head_dim`).
pub fn split_query_gate(
    qg: &[f32],
    n_tok: usize,
    n_head: usize,
    head_dim: usize,
    q: &mut [f32],
    gate: &mut [f32],
) -> Result<(), OpError> {
    let n = n_tok * n_head * head_dim;
    need("split query/gate", "qg", 2 * n, qg.len())?;
    need("split query/gate", "q", n, q.len())?;
    need("split query/gate", "gate", n, gate.len())?;
    if head_dim == 0 {
        return Ok(());
    }
    for ((src, qh), gh) in qg[..2 * n]
        .chunks_exact(2 * head_dim)
        .zip(q[..n].chunks_exact_mut(head_dim))
        .zip(gate[..n].chunks_exact_mut(head_dim))
    {
        qh.copy_from_slice(&src[..head_dim]);
        gh.copy_from_slice(&src[head_dim..]);
    }
    Ok(())
}

/// `x *= sigmoid(gate)` elementwise (the attention output gate, `x` and `gate` laid out alike).
pub fn sigmoid_gate_inplace(x: &mut [f32], gate: &[f32]) -> Result<(), OpError> {
    need("sigmoid gate", "gate", x.len(), gate.len())?;
    for (v, g) in x.iter_mut().zip(gate) {
        *v *= 1.0 / (1.0 + (-g).exp());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::Rope;
    use super::*;

    #[test]
    fn split_takes_query_then_gate_per_head() {
        // 1 token, 2 heads of 2: [q00 q01 g00 g01 q10 q11 g10 g11].
        let qg = [1.0f32, 2.0, -1.0, -2.0, 3.0, 4.0, -3.0, -4.0];
        let (mut q, mut g) = ([0f32; 4], [0f32; 4]);
        split_query_gate(&qg, 1, 2, 2, &mut q, &mut g).unwrap();
        assert_eq!(q, [1.0, 2.0, 3.0, 4.0]);
        assert_eq!(g, [-1.0, -2.0, -3.0, -4.0]);
        let e = split_query_gate(&qg[..7], 1, 2, 2, &mut q, &mut g).unwrap_err();
        assert!(e.to_string().contains("qg"), "{e}");
    }

    #[test]
    fn sigmoid_gate_hand_values() {
        let mut x = [2.0f32, 2.0, 2.0];
        sigmoid_gate_inplace(&mut x, &[0.0, 100.0, -100.0]).unwrap();
        assert!((x[0] - 1.0).abs() < 1e-7 && (x[1] - 2.0).abs() < 1e-6 && x[2].abs() < 1e-6);
        assert!(sigmoid_gate_inplace(&mut x, &[0.0; 2]).is_err());
    }

    /// HF's `apply_rotary_pos_emb` with a rotary dim below the head dim: rotate_half over the
    /// first `n_rot` dims, the rest passed through; inv_freq = θ^(−2i/n_rot).
    fn hf_partial_rope(x: &[f32], head_dim: usize, n_rot: usize, theta: f64, pos: u32) -> Vec<f32> {
        let half = n_rot / 2;
        let mut out = x.to_vec();
        for head in 0..x.len() / head_dim {
            let h = &x[head * head_dim..(head + 1) * head_dim];
            for i in 0..n_rot {
                let f = (i % half) as f64;
                let inv = 1.0 / theta.powf(2.0 * f / n_rot as f64);
                let (s, c) = (pos as f64 * inv).sin_cos();
                let rot = if i < half { -h[i + half] } else { h[i - half] };
                out[head * head_dim + i] = (h[i] as f64 * c + rot as f64 * s) as f32;
            }
        }
        out
    }

    #[test]
    fn partial_rope_rotates_only_the_first_quarter() {
        // Qwen3-Next: head_dim 256, 64 rotated dims; here head_dim 16 with 4 rotated, 3 heads.
        let (hd, n_rot, theta) = (16usize, 4usize, 10_000.0f64);
        let rope = Rope::new(n_rot, theta, None);
        let x: Vec<f32> = (0..3 * hd)
            .map(|i| ((i * 7 % 11) as f32 - 5.0) / 3.0)
            .collect();
        for pos in [0u32, 1, 5, 1000] {
            let mut y = x.clone();
            rope.apply(&mut y, hd, pos).unwrap();
            let want = hf_partial_rope(&x, hd, n_rot, theta, pos);
            for (i, (a, b)) in y.iter().zip(&want).enumerate() {
                assert!((a - b).abs() < 2e-5, "pos {pos} [{i}]: {a} vs {b}");
            }
            for head in 0..3 {
                assert_eq!(
                    y[head * hd + n_rot..(head + 1) * hd],
                    x[head * hd + n_rot..(head + 1) * hd],
                    "dims past n_rot pass through"
                );
            }
        }
        // Hand value: pair (0, 2) at pos 1 turns by 1 radian, pair (1, 3) by 10000^-0.5.
        let mut h = vec![0f32; hd];
        h[0] = 1.0;
        h[3] = 1.0;
        rope.apply(&mut h, hd, 1).unwrap();
        assert!((h[0] - 1f32.cos()).abs() < 1e-6 && (h[2] - 1f32.sin()).abs() < 1e-6);
        assert!((h[1] + 0.01f32.sin()).abs() < 1e-6 && (h[3] - 0.01f32.cos()).abs() < 1e-6);
    }
}
