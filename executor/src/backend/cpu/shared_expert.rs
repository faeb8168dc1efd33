//! Qwen3-Next's shared expert: a SwiGLU MLP every token goes through, scaled by a per-token
//! sigmoid gate (`ffn_gate_inp_shexp`, one row of `n_embd`), added to the routed experts' sum.
//! Invariant: `out += sigmoid(g·x) · down(silu(gate·x) ⊙ up·x)` per token, HF's
//! `Qwen3NextSparseMoeBlock` shared branch and llama.cpp's `build_layer_ffn`; it allocates
//! nothing (scratch from [`SharedExpert::scratch_len`]) and a token's result does not depend
//! on the other tokens of its batch.

use super::ops::{matmul, need, silu, Matrix, OpError};

/// The shared expert's four weights (GGUF dims: `ffn_gate_inp_shexp [n_embd]` or
/// `[n_embd, 1]`, `ffn_{gate,up}_shexp [n_embd, n_ff]`, `ffn_down_shexp [n_ff, n_embd]`).
#[derive(Debug, Clone, Copy)]
pub struct SharedExpert<'a> {
    pub gate_inp: Matrix<'a>,
    pub gate: Matrix<'a>,
    pub up: Matrix<'a>,
    pub down: Matrix<'a>,
}

impl SharedExpert<'_> {
    fn check(&self) -> Result<(usize, usize), OpError> {
        let (e, f) = (self.gate.cols, self.gate.rows);
        let bad = |what: &'static str, expected: usize, got: usize| {
            Err(OpError::Shape {
                op: "shared expert",
                what,
                expected,
                got,
            })
        };
        if self.gate_inp.rows != 1 {
            return bad("ffn_gate_inp_shexp rows", 1, self.gate_inp.rows);
        }
        if self.gate_inp.cols != e {
            return bad("ffn_gate_inp_shexp cols (n_embd)", e, self.gate_inp.cols);
        }
        if (self.up.cols, self.up.rows) != (e, f) {
            return bad(
                "ffn_up_shexp (the gate's shape)",
                e * f,
                self.up.cols * self.up.rows,
            );
        }
        if (self.down.cols, self.down.rows) != (f, e) {
            return bad(
                "ffn_down_shexp ([n_ff, n_embd])",
                f * e,
                self.down.cols * self.down.rows,
            );
        }
        Ok((e, f))
    }

    /// Floats of scratch [`Self::add`] needs for `n_tok` tokens.
    pub fn scratch_len(&self, n_tok: usize) -> usize {
        let (e, f) = (self.gate.cols, self.gate.rows);
        // gate·x, up·x, down output, matmul partials, per-token gate scalars
        n_tok * (2 * f + e + f.max(e)) + n_tok
    }

    /// `out[t] += sigmoid(gate_inp·x[t]) · down(silu(gate·x[t]) ⊙ up·x[t])` for `n_tok` rows
    /// of `x` (`n_tok × n_embd`).
    pub fn add(
        &self,
        x: &[f32],
        n_tok: usize,
        scratch: &mut [f32],
        out: &mut [f32],
    ) -> Result<(), OpError> {
        let (e, f) = self.check()?;
        need("shared expert", "x", n_tok * e, x.len())?;
        need("shared expert", "out", n_tok * e, out.len())?;
        need(
            "shared expert",
            "scratch",
            self.scratch_len(n_tok),
            scratch.len(),
        )?;
        let (hg, rest) = scratch.split_at_mut(n_tok * f);
        let (hu, rest) = rest.split_at_mut(n_tok * f);
        let (d, rest) = rest.split_at_mut(n_tok * e);
        let (tmp, rest) = rest.split_at_mut(n_tok * f.max(e));
        let s = &mut rest[..n_tok];
        matmul(&self.gate, x, n_tok, hg, tmp)?;
        matmul(&self.up, x, n_tok, hu, tmp)?;
        for (a, b) in hg.iter_mut().zip(hu.iter()) {
            *a = silu(*a) * b;
        }
        matmul(&self.down, hg, n_tok, d, tmp)?;
        matmul(&self.gate_inp, x, n_tok, s, tmp)?;
        for t in 0..n_tok {
            let w = 1.0 / (1.0 + (-s[t]).exp());
            for (o, v) in out[t * e..(t + 1) * e]
                .iter_mut()
                .zip(&d[t * e..(t + 1) * e])
            {
                *o += w * v;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_row;
    use strata_schemas::ggml::GgmlType;

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        let mut b = Vec::new();
        quantize_row(GgmlType::F32, v, &mut b).unwrap();
        b
    }

    fn vals(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 13 + seed * 7) % 17) as f32 - 8.0) / 9.0)
            .collect()
    }

    #[test]
    fn matches_the_definition_and_is_batch_invariant() {
        let (e, f, n_tok) = (8usize, 6usize, 3usize);
        let (gi, g, u, dn) = (vals(e, 1), vals(f * e, 2), vals(f * e, 3), vals(e * f, 4));
        let (bgi, bg, bu, bd) = (f32_bytes(&gi), f32_bytes(&g), f32_bytes(&u), f32_bytes(&dn));
        let se = SharedExpert {
            gate_inp: Matrix::new(GgmlType::F32, e, 1, &bgi).unwrap(),
            gate: Matrix::new(GgmlType::F32, e, f, &bg).unwrap(),
            up: Matrix::new(GgmlType::F32, e, f, &bu).unwrap(),
            down: Matrix::new(GgmlType::F32, f, e, &bd).unwrap(),
        };
        let x = vals(n_tok * e, 5);
        let base = vals(n_tok * e, 6);
        let mut out = base.clone();
        let mut sc = vec![0f32; se.scratch_len(n_tok)];
        se.add(&x, n_tok, &mut sc, &mut out).unwrap();
        for t in 0..n_tok {
            let xt = &x[t * e..(t + 1) * e];
            let dotv = |w: &[f32], r: usize, n: usize, v: &[f32]| -> f64 {
                (0..n).map(|c| w[r * n + c] as f64 * v[c] as f64).sum()
            };
            let h: Vec<f64> = (0..f)
                .map(|r| {
                    let a = dotv(&g, r, e, xt);
                    a / (1.0 + (-a).exp()) * dotv(&u, r, e, xt)
                })
                .collect();
            let gate = 1.0 / (1.0 + (-dotv(&gi, 0, e, xt)).exp());
            for r in 0..e {
                let d: f64 = (0..f).map(|c| dn[r * f + c] as f64 * h[c]).sum();
                let want = base[t * e + r] as f64 + gate * d;
                assert!((out[t * e + r] as f64 - want).abs() < 1e-5, "t {t} r {r}");
            }
            // One token alone gives the same bits.
            let mut one = base[t * e..(t + 1) * e].to_vec();
            let mut sc1 = vec![0f32; se.scratch_len(1)];
            se.add(xt, 1, &mut sc1, &mut one).unwrap();
            assert_eq!(one, out[t * e..(t + 1) * e], "batch-invariant");
        }
        let e2 = se.add(&x, n_tok, &mut sc[1..], &mut out).unwrap_err();
        assert!(e2.to_string().contains("scratch"), "{e2}");
        let bad = SharedExpert {
            gate_inp: Matrix::new(GgmlType::F32, 4, 2, &bgi).unwrap(),
            ..se
        };
        let e3 = bad.add(&x, n_tok, &mut sc, &mut out).unwrap_err();
        assert!(e3.to_string().contains("ffn_gate_inp_shexp"), "{e3}");
    }
}
