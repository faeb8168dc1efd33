//! Qwen3-Next's two RMSNorm variants: the zero-centred one (HF stores `w`, multiplies by
//! `1 + w`; llama.cpp's converter stores `w + 1` so the plain [`super::ops::rmsnorm`] applies) and
//! the gated one on the delta net's output (`w · norm(x) · silu(z)` per value head, `w` stored
//! as is by both).
//! Invariant: the same math as HF's float32 `Qwen3NextRMSNorm` / `Qwen3NextRMSNormGated`
//! (sum of squares in f64 like the other CPU norms); shapes are checked before any write.

use super::ops::{need, silu, OpError};

/// `1/sqrt(mean(x²) + eps)` of one row.
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|v| (*v as f64) * (*v as f64)).sum();
    let var = (ss / x.len().max(1) as f64) as f32;
    1.0 / (var + eps).sqrt()
}

/// HF's zero-centred RMSNorm of `n_rows` rows of `w.len()`: `x / rms(x) · (1 + w)`, for
/// weights read straight from a Hugging Face folder (a GGUF holds `1 + w` already).
pub fn rmsnorm_zero_centred_rows(
    x: &[f32],
    w: &[f32],
    eps: f32,
    n_rows: usize,
    out: &mut [f32],
) -> Result<(), OpError> {
    let n = w.len();
    need("zero-centred rmsnorm", "x", n * n_rows, x.len())?;
    need("zero-centred rmsnorm", "out", n * n_rows, out.len())?;
    for (xr, or) in x[..n * n_rows]
        .chunks_exact(n.max(1))
        .zip(out[..n * n_rows].chunks_exact_mut(n.max(1)))
    {
        let r = inv_rms(xr, eps);
        for ((o, xi), wi) in or.iter_mut().zip(xr).zip(w) {
            *o = (xi * r) * (1.0 + wi);
        }
    }
    Ok(())
}

/// The delta net's gated RMSNorm over every `w.len()`-float head of `x` (all value heads of all
/// tokens, `x` and `z` laid out alike): `out = w · x / rms(x) · silu(z)`, HF's
/// `Qwen3NextRMSNormGated` (norm before gate) and llama.cpp's `build_norm_gated`.
pub fn gated_rmsnorm_heads(
    x: &[f32],
    z: &[f32],
    w: &[f32],
    eps: f32,
    out: &mut [f32],
) -> Result<(), OpError> {
    let hd = w.len();
    if hd == 0 || x.len() % hd != 0 {
        return Err(OpError::Shape {
            op: "gated rmsnorm",
            what: "x (a whole number of heads)",
            expected: x.len().div_ceil(hd.max(1)) * hd,
            got: x.len(),
        });
    }
    need("gated rmsnorm", "z", x.len(), z.len())?;
    need("gated rmsnorm", "out", x.len(), out.len())?;
    for ((xh, zh), oh) in x
        .chunks_exact(hd)
        .zip(z.chunks_exact(hd))
        .zip(out.chunks_exact_mut(hd))
    {
        let r = inv_rms(xh, eps);
        for (((o, xi), zi), wi) in oh.iter_mut().zip(xh).zip(zh).zip(w) {
            *o = wi * (xi * r) * silu(*zi);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::ops::rmsnorm_rows;
    use super::*;

    #[test]
    fn zero_centred_is_plain_rmsnorm_with_one_plus_w() {
        // x = [3, 4]: rms = sqrt(12.5); w = [0, 1] -> factors 1 and 2.
        let mut o = [0f32; 2];
        rmsnorm_zero_centred_rows(&[3.0, 4.0], &[0.0, 1.0], 0.0, 1, &mut o).unwrap();
        let r = 12.5f32.sqrt();
        assert!(
            (o[0] - 3.0 / r).abs() < 1e-6 && (o[1] - 8.0 / r).abs() < 1e-6,
            "{o:?}"
        );
        // Against the plain norm with the converter's stored 1 + w, over several rows.
        let x: Vec<f32> = (0..24).map(|i| (i as f32 * 0.37).sin()).collect();
        let w: Vec<f32> = (0..8).map(|i| 0.1 * (i as f32 - 3.5)).collect();
        let w1: Vec<f32> = w.iter().map(|v| 1.0 + v).collect();
        let (mut a, mut b) = (vec![0f32; 24], vec![0f32; 24]);
        rmsnorm_zero_centred_rows(&x, &w, 1e-6, 3, &mut a).unwrap();
        rmsnorm_rows(&x, &w1, 1e-6, 3, &mut b).unwrap();
        for (p, q) in a.iter().zip(&b) {
            assert!((p - q).abs() < 1e-6, "{p} vs {q}");
        }
        assert!(rmsnorm_zero_centred_rows(&x, &w, 1e-6, 4, &mut a).is_err());
    }

    #[test]
    fn gated_hand_values() {
        // Two heads of 2: head 0 x = [3, 4] (rms sqrt 12.5), z = [0, large]; head 1 x = [1, 1]
        // (rms 1), z = [1, -1]; w = [2, 1].
        let x = [3.0f32, 4.0, 1.0, 1.0];
        let z = [0.0f32, 30.0, 1.0, -1.0];
        let w = [2.0f32, 1.0];
        let mut o = [0f32; 4];
        gated_rmsnorm_heads(&x, &z, &w, 0.0, &mut o).unwrap();
        let r = 12.5f32.sqrt();
        let s = |v: f32| v / (1.0 + (-v).exp());
        let want = [0.0, 4.0 / r * 30.0, 2.0 * s(1.0), s(-1.0)];
        for (a, b) in o.iter().zip(want) {
            assert!((a - b).abs() < 1e-5, "{o:?} vs {want:?}");
        }
        assert!(gated_rmsnorm_heads(&x[..3], &z, &w, 0.0, &mut o).is_err());
        let e = gated_rmsnorm_heads(&x, &z[..2], &w, 0.0, &mut o).unwrap_err();
        assert!(e.to_string().contains(": z"), "{e}");
    }
}
