//! CPU reference ops on f32 slices: matmul against quantized weight rows, RMSNorm (whole
//! rows and per head), NEOX rotary embedding with HF's YaRN scaling, softmax and SiLU.
//! (Attention over a slot's KV lives with the KV in `kv`.)
//! Invariant: every op checks its shapes before it starts, writes only its output slices and
//! allocates nothing; a token's result never depends on the other tokens of its batch.

use crate::quant::{self, QuantError};
use rayon::prelude::*;
use strata_schemas::ggml::GgmlType;

/// A shape mismatch between an op's arguments.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpError {
    #[error(transparent)]
    Quant(#[from] QuantError),
    #[error("{op}: {what} has {got} elements but {expected} are needed")]
    Shape {
        op: &'static str,
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("attention: token {token} sees {n_ctx} cells but its KV region holds {n_cells}")]
    KvRange {
        token: usize,
        n_ctx: usize,
        n_cells: usize,
    },
}

pub(crate) fn need(
    op: &'static str,
    what: &'static str,
    expected: usize,
    got: usize,
) -> Result<(), OpError> {
    if got < expected {
        return Err(OpError::Shape {
            op,
            what,
            expected,
            got,
        });
    }
    Ok(())
}

/// A weight matrix of `rows` rows, each `cols` elements of `ty` stored contiguously (a GGUF
/// tensor with dims `[cols, rows]`, i.e. a PyTorch weight of shape `[rows, cols]`).
#[derive(Debug, Clone, Copy)]
pub struct Matrix<'a> {
    pub ty: GgmlType,
    pub cols: usize,
    pub rows: usize,
    row_bytes: usize,
    data: &'a [u8],
}

impl<'a> Matrix<'a> {
    /// Wrap `data`, checking that it holds exactly `rows` rows of `cols` elements of `ty`.
    pub fn new(ty: GgmlType, cols: usize, rows: usize, data: &'a [u8]) -> Result<Self, OpError> {
        let row_bytes = quant::row_bytes(ty, cols)?;
        if data.len() != row_bytes * rows {
            return Err(OpError::Shape {
                op: "matrix",
                what: "data bytes",
                expected: row_bytes * rows,
                got: data.len(),
            });
        }
        Ok(Self {
            ty,
            cols,
            rows,
            row_bytes,
            data,
        })
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// The encoded bytes of row `r` (`r < rows`).
    pub fn row(&self, r: usize) -> &'a [u8] {
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Dequantize row `r` into `out` (`cols` elements).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Result<(), OpError> {
        if r >= self.rows {
            return Err(OpError::Shape {
                op: "matrix row",
                what: "row index",
                expected: r + 1,
                got: self.rows,
            });
        }
        need("matrix row", "output", self.cols, out.len())?;
        quant::dequantize_row(self.ty, self.row(r), &mut out[..self.cols])?;
        Ok(())
    }
}

/// `y[t][r] = W_r · x[t]` for `n_tok` tokens. `x` is `n_tok × cols`, `y` is `n_tok × rows`;
/// `tmp` (at least `n_tok × rows` when `n_tok > 1`) holds the row-major partials. Parallel
/// over weight rows; each row is read once and dotted with every token while it is hot.
pub fn matmul(
    w: &Matrix<'_>,
    x: &[f32],
    n_tok: usize,
    y: &mut [f32],
    tmp: &mut [f32],
) -> Result<(), OpError> {
    need("matmul", "x", n_tok * w.cols, x.len())?;
    need("matmul", "y", n_tok * w.rows, y.len())?;
    let (ty, cols) = (w.ty, w.cols);
    if n_tok == 1 {
        y[..w.rows]
            .par_iter_mut()
            .with_min_len(8)
            .enumerate()
            .for_each(|(r, out)| *out = quant::dot_row(ty, w.row(r), &x[..cols]));
        return Ok(());
    }
    need("matmul", "tmp", n_tok * w.rows, tmp.len())?;
    tmp[..n_tok * w.rows]
        .par_chunks_mut(n_tok)
        .with_min_len(4)
        .enumerate()
        .for_each(|(r, outs)| {
            let row = w.row(r);
            for (t, o) in outs.iter_mut().enumerate() {
                *o = quant::dot_row(ty, row, &x[t * cols..(t + 1) * cols]);
            }
        });
    let rows = w.rows;
    let tmp = &tmp[..n_tok * rows];
    y[..n_tok * rows]
        .par_chunks_mut(rows)
        .enumerate()
        .for_each(|(t, yt)| {
            for (r, o) in yt.iter_mut().enumerate() {
                *o = tmp[r * n_tok + t];
            }
        });
    Ok(())
}

/// RMSNorm of one row as HF computes it: `w * (x / sqrt(mean(x²) + eps))`.
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) -> Result<(), OpError> {
    let n = w.len();
    need("rmsnorm", "x", n, x.len())?;
    need("rmsnorm", "out", n, out.len())?;
    let ss: f64 = x[..n].iter().map(|v| (*v as f64) * (*v as f64)).sum();
    let var = (ss / n as f64) as f32;
    let r = 1.0 / (var + eps).sqrt();
    for i in 0..n {
        out[i] = w[i] * (x[i] * r);
    }
    Ok(())
}

/// RMSNorm of `n_rows` consecutive rows of `w.len()` elements, in parallel.
pub fn rmsnorm_rows(
    x: &[f32],
    w: &[f32],
    eps: f32,
    n_rows: usize,
    out: &mut [f32],
) -> Result<(), OpError> {
    let n = w.len();
    need("rmsnorm_rows", "x", n * n_rows, x.len())?;
    need("rmsnorm_rows", "out", n * n_rows, out.len())?;
    out[..n * n_rows]
        .par_chunks_mut(n)
        .zip(x[..n * n_rows].par_chunks(n))
        .for_each(|(o, xr)| {
            // Shapes were checked above; rmsnorm cannot fail here.
            let _ = rmsnorm(xr, w, eps, o);
        });
    Ok(())
}

/// In-place RMSNorm of every `w.len()`-element head in `x` (Qwen3's QK-norm).
pub fn rmsnorm_heads_inplace(x: &mut [f32], w: &[f32], eps: f32) -> Result<(), OpError> {
    let hd = w.len();
    if hd == 0 || x.len() % hd != 0 {
        return Err(OpError::Shape {
            op: "rmsnorm_heads",
            what: "x (a whole number of heads)",
            expected: x.len().div_ceil(hd.max(1)) * hd,
            got: x.len(),
        });
    }
    for head in x.chunks_exact_mut(hd) {
        let ss: f64 = head.iter().map(|v| (*v as f64) * (*v as f64)).sum();
        let var = (ss / hd as f64) as f32;
        let r = 1.0 / (var + eps).sqrt();
        for (v, wi) in head.iter_mut().zip(w) {
            *v = wi * (*v * r);
        }
    }
    Ok(())
}

/// YaRN context extension, with HF's `_compute_yarn_parameters` semantics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    /// Context scale factor (> 1).
    pub factor: f64,
    /// The trained context the ramp is computed against (`original_max_position_embeddings`).
    pub orig_ctx: u64,
    /// Rotations above which a frequency is left alone (HF default 32).
    pub beta_fast: f64,
    /// Rotations below which a frequency is fully interpolated (HF default 1).
    pub beta_slow: f64,
}

impl Yarn {
    /// YaRN with HF's default betas (32, 1).
    pub fn new(factor: f64, orig_ctx: u64) -> Self {
        Self {
            factor,
            orig_ctx,
            beta_fast: 32.0,
            beta_slow: 1.0,
        }
    }

    /// HF's `get_mscale(factor)`: `0.1 ln(factor) + 1`, or 1 for factor <= 1.
    pub fn attention_factor(&self) -> f64 {
        if self.factor <= 1.0 {
            1.0
        } else {
            0.1 * self.factor.ln() + 1.0
        }
    }

    /// HF's `find_correction_range` with `truncate=True`: (floor(low) ∨ 0, ceil(high) ∧ dim-1).
    pub fn correction_range(&self, dim: usize, base: f64) -> (f64, f64) {
        let corr = |rot: f64| {
            dim as f64 * (self.orig_ctx as f64 / (rot * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * base.ln())
        };
        let low = corr(self.beta_fast).floor();
        let high = corr(self.beta_slow).ceil();
        (low.max(0.0), high.min(dim as f64 - 1.0))
    }
}

/// Rotary embedding, NEOX style (rotate-half): dims `i` and `i + n_rot/2` of each head form
/// a pair, as HF Qwen3 and llama.cpp's `LLAMA_ROPE_TYPE_NEOX` do.
#[derive(Debug, Clone)]
pub struct Rope {
    n_rot: usize,
    inv_freq: Vec<f32>,
    attn_factor: f32,
}

impl Rope {
    /// Frequencies for `n_rot` rotated dims (even) at base `theta`, with optional YaRN.
    pub fn new(n_rot: usize, theta: f64, yarn: Option<Yarn>) -> Self {
        let half = n_rot / 2;
        // HF: pos_freqs = base ** (arange(0, dim, 2).float() / dim), in float32.
        let pos_freqs: Vec<f32> = (0..half)
            .map(|i| {
                let e = (2 * i) as f32 / n_rot as f32;
                theta.powf(e as f64) as f32
            })
            .collect();
        let (inv_freq, attn_factor) = match yarn {
            None => (pos_freqs.iter().map(|p| 1.0f32 / p).collect(), 1.0f32),
            Some(y) => {
                let (low, high) = y.correction_range(n_rot, theta);
                let (low, mut high) = (low as f32, high as f32);
                if low == high {
                    high += 0.001;
                }
                let f = y.factor as f32;
                let inv = pos_freqs
                    .iter()
                    .enumerate()
                    .map(|(i, p)| {
                        let extrap = 1.0f32 / p;
                        let interp = 1.0f32 / (f * p);
                        let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrap_factor = 1.0 - ramp;
                        interp * (1.0 - extrap_factor) + extrap * extrap_factor
                    })
                    .collect();
                (inv, y.attention_factor() as f32)
            }
        };
        Self {
            n_rot,
            inv_freq,
            attn_factor,
        }
    }

    /// Rotated dims per head.
    pub fn n_rot(&self) -> usize {
        self.n_rot
    }

    /// The `n_rot/2` inverse frequencies.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// The factor cos and sin are multiplied by (YaRN's mscale; 1 without YaRN).
    pub fn attn_factor(&self) -> f32 {
        self.attn_factor
    }

    /// (cos, sin) of pair `i` at `pos`, scaled by the attention factor, as HF's float32 path.
    #[inline]
    pub fn cos_sin(&self, i: usize, pos: u32) -> (f32, f32) {
        let f = self.inv_freq[i] * pos as f32;
        let (s, c) = (f as f64).sin_cos();
        ((c as f32) * self.attn_factor, (s as f32) * self.attn_factor)
    }

    /// Rotate every head of `x` (heads of `head_dim`, the first `n_rot` dims rotated) at `pos`.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, pos: u32) -> Result<(), OpError> {
        if head_dim < self.n_rot || head_dim == 0 || x.len() % head_dim != 0 {
            return Err(OpError::Shape {
                op: "rope",
                what: "x (whole heads of at least n_rot dims)",
                expected: head_dim.max(self.n_rot),
                got: x.len(),
            });
        }
        let half = self.n_rot / 2;
        for i in 0..half {
            let (c, s) = self.cos_sin(i, pos);
            for head in x.chunks_exact_mut(head_dim) {
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * c - b * s;
                head[i + half] = b * c + a * s;
            }
        }
        Ok(())
    }
}

/// In-place softmax of one row.
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b));
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// SiLU, `x * sigmoid(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Head counts and sizes of an attention op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_row;

    #[test]
    fn matmul_matches_naive_for_one_and_many_tokens() {
        let (rows, cols, n_tok) = (5, 64, 3);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 10.0)
            .collect();
        let x: Vec<f32> = (0..n_tok * cols)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) / 7.0)
            .collect();
        let mut bytes = Vec::new();
        quantize_row(GgmlType::F32, &w, &mut bytes).unwrap();
        let m = Matrix::new(GgmlType::F32, cols, rows, &bytes).unwrap();
        let mut y = vec![0f32; n_tok * rows];
        let mut tmp = vec![0f32; n_tok * rows];
        matmul(&m, &x, n_tok, &mut y, &mut tmp).unwrap();
        for t in 0..n_tok {
            let mut y1 = vec![0f32; rows];
            matmul(&m, &x[t * cols..(t + 1) * cols], 1, &mut y1, &mut []).unwrap();
            for r in 0..rows {
                let want: f32 = (0..cols).map(|c| w[r * cols + c] * x[t * cols + c]).sum();
                assert!((y[t * rows + r] - want).abs() < 1e-4);
                assert_eq!(y1[r], y[t * rows + r], "batch-invariant");
            }
        }
        assert!(Matrix::new(GgmlType::F32, cols, rows + 1, &bytes).is_err());
        assert!(matmul(&m, &x, 4, &mut y, &mut tmp).is_err());
    }

    #[test]
    fn rmsnorm_and_head_norm() {
        let x = [3.0f32, 4.0];
        let mut o = [0f32; 2];
        rmsnorm(&x, &[1.0, 2.0], 0.0, &mut o).unwrap();
        // rms = sqrt((9+16)/2) = 3.5355
        assert!((o[0] - 3.0 / 12.5f32.sqrt()).abs() < 1e-6);
        assert!((o[1] - 8.0 / 12.5f32.sqrt()).abs() < 1e-6);
        let mut h = [3.0f32, 4.0, 1.0, 1.0];
        rmsnorm_heads_inplace(&mut h, &[1.0, 1.0], 0.0).unwrap();
        assert!((h[2] - 1.0).abs() < 1e-6 && (h[0] - o[0]).abs() < 1e-6);
        assert!(rmsnorm_heads_inplace(&mut [1.0; 3], &[1.0, 1.0], 0.0).is_err());
    }

    #[test]
    fn rope_plain_hand_values() {
        // head_dim 4, theta 10000: inv_freq = [1, 10000^-0.5 = 0.01].
        let r = Rope::new(4, 10000.0, None);
        assert_eq!(r.inv_freq(), &[1.0, 0.01]);
        let mut x = [1.0f32, 0.0, 0.0, 1.0]; // pairs (x0, x2) = (1, 0), (x1, x3) = (0, 1)
        r.apply(&mut x, 4, 2).unwrap();
        // pair 0 angle 2: (cos 2, sin 2); pair 1 angle 0.02: (-sin .02, cos .02)
        let want = [2f32.cos(), -(0.02f32).sin(), 2f32.sin(), 0.02f32.cos()];
        for (a, b) in x.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{x:?}");
        }
        // position 0 is the identity
        let mut y = [0.3f32, -0.2, 0.7, 0.1];
        r.apply(&mut y, 4, 0).unwrap();
        assert_eq!(y, [0.3, -0.2, 0.7, 0.1]);
    }

    #[test]
    fn yarn_hand_values() {
        // dim 16, base 10000, factor 4, orig 64. find_correction_dim(r) =
        //   16 ln(64 / (2π r)) / (2 ln 10000):
        //   r=32: 16 ln(0.31831) / 18.4207 = -0.99430 -> floor -1 -> max 0 => low 0
        //   r=1:  16 ln(10.18592) / 18.4207 = 2.01600 -> ceil 3 => high 3
        let y = Yarn::new(4.0, 64);
        assert_eq!(y.correction_range(16, 10000.0), (0.0, 3.0));
        // mscale = 0.1 ln 4 + 1 = 1.1386294
        assert!((y.attention_factor() - 1.138_629_436).abs() < 1e-9);
        let r = Rope::new(16, 10000.0, Some(y));
        // ramp(i) = clamp(i/3): extrap weight 1-ramp. i=0: pure extrapolation 1.0;
        // i=1: 2/3 * 10000^-0.125 + 1/3 * 10000^-0.125 / 4 = 0.75 * 0.3162278 = 0.2371708;
        // i>=3: pure interpolation 10000^(-2i/16) / 4.
        let f = r.inv_freq();
        assert!((f[0] - 1.0).abs() < 1e-7);
        assert!((f[1] - 0.237_170_8).abs() < 1e-6, "{}", f[1]);
        assert!((f[2] - (1.0 / 3.0 * 0.1 + 2.0 / 3.0 * 0.1 / 4.0) as f32).abs() < 1e-7);
        assert!((f[5] - 10000f32.powf(-10.0 / 16.0) / 4.0).abs() < 1e-9);
        // Position 3, pair 1: angle 3 * 0.2371708 = 0.7115124, scaled by mscale.
        let mut x = [0f32; 16];
        x[1] = 1.0;
        r.apply(&mut x, 16, 3).unwrap();
        let m = 1.138_629_4f32;
        assert!((x[1] - m * 0.711_512_4f32.cos()).abs() < 1e-5, "{}", x[1]);
        assert!((x[9] - m * 0.711_512_4f32.sin()).abs() < 1e-5, "{}", x[9]);
    }

    #[test]
    fn softmax_and_silu() {
        let mut x = [0.0f32, 2f32.ln()];
        softmax(&mut x);
        assert!((x[0] - 1.0 / 3.0).abs() < 1e-6 && (x[1] - 2.0 / 3.0).abs() < 1e-6);
        assert_eq!(silu(0.0), 0.0);
        assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
    }
}
