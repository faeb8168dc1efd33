//! Qwen3-Next's gated delta rule (the linear-attention core of its Gated DeltaNet layers): the
//! per-head gates from the `ssm_ba` projection, the q/k l2 normalization, and the rule itself
//! in recurrent form (decode, one token at a time) and chunked form (prefill, 64 tokens a
//! chunk), both rolling a slot's recurrent state forward.
//! Invariant: the two forms compute the same function (outputs and final state, up to f32
//! rounding) as the token-by-token definition, from any initial state; a call never allocates.
//!
//! Per value head `h` (key head `h / (n_v_heads / n_k_heads)`, the grouping both HF's
//! `repeat_interleave` and llama.cpp's qwen3next graph use), per token `t`, with `q`, `k`
//! l2-normalized and `q` scaled by `1/sqrt(head_k)`:
//! `S ← exp(g_t) S; d = β_t (v_t − Sᵀk_t); S ← S + k_t dᵀ; o_t = Sᵀ q_t`
//! where HF's `S` is `[head_k, head_v]`. The state is stored as llama.cpp stores it: per value
//! head `head_v` rows of `head_k` floats, row `j` = column `j` of HF's `S` (so every product
//! above is a dot product along a contiguous row); a slot's state is `n_v_heads × head_v ×
//! head_k` f32, zero for a fresh slot.
//!
//! Layouts: `qkv` is the conv output, token-major rows of `2·n_k_heads·head_k +
//! n_v_heads·head_v` (all q heads, all k heads, all v heads: llama.cpp's `attn_qkv` order);
//! `g` and `beta` are `n_tok × n_v_heads`; `out` is `n_tok × n_v_heads × head_v`.

use super::ops::{need, OpError};
use rayon::prelude::*;

/// Head counts and sizes of a gated delta net layer (llama.cpp's `ssm.*` keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaShape {
    /// Key heads (`ssm.group_count`, HF `linear_num_key_heads`).
    pub n_k_heads: usize,
    /// Value heads (`ssm.time_step_rank`, HF `linear_num_value_heads`), a multiple of
    /// `n_k_heads`.
    pub n_v_heads: usize,
    /// Key head dim (`ssm.state_size`).
    pub head_k: usize,
    /// Value head dim (`ssm.inner_size / ssm.time_step_rank`).
    pub head_v: usize,
}

impl DeltaShape {
    fn check(&self, op: &'static str) -> Result<(), OpError> {
        if self.n_k_heads == 0 || self.head_k == 0 || self.head_v == 0 {
            return Err(OpError::Shape {
                op,
                what: "n_k_heads, head_k and head_v (each at least 1)",
                expected: 1,
                got: 0,
            });
        }
        if self.n_v_heads == 0 || self.n_v_heads % self.n_k_heads != 0 {
            return Err(OpError::Shape {
                op,
                what: "n_v_heads (a positive multiple of n_k_heads)",
                expected: self.n_k_heads,
                got: self.n_v_heads,
            });
        }
        Ok(())
    }
    /// `n_k_heads · head_k`: the width of the q part and of the k part of a `qkv` row.
    pub fn key_dim(&self) -> usize {
        self.n_k_heads * self.head_k
    }
    /// `n_v_heads · head_v`: the width of the v part and of the output row.
    pub fn value_dim(&self) -> usize {
        self.n_v_heads * self.head_v
    }
    /// Floats of one `qkv` row (the conv's channels).
    pub fn qkv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// Floats of one slot's recurrent state.
    pub fn state_len(&self) -> usize {
        self.n_v_heads * self.head_v * self.head_k
    }
    /// The key head value head `h` reads.
    fn k_head(&self, h: usize) -> usize {
        h / (self.n_v_heads / self.n_k_heads)
    }
    /// (q, k, v) of value head `h` in the `qkv` row `row`.
    fn qkv_of<'a>(&self, row: &'a [f32], h: usize) -> (&'a [f32], &'a [f32], &'a [f32]) {
        let (kd, dk, dv) = (self.key_dim(), self.head_k, self.head_v);
        let kh = self.k_head(h);
        (
            &row[kh * dk..(kh + 1) * dk],
            &row[kd + kh * dk..kd + (kh + 1) * dk],
            &row[2 * kd + h * dv..2 * kd + (h + 1) * dv],
        )
    }
}

/// `softplus(x) = ln(1 + eˣ)`, linear above 20 as PyTorch's `F.softplus` (threshold 20).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The per-head gates from the `ssm_ba` projection (`n_tok × 2·n_v_heads`, HF's
/// `in_proj_ba` order: per key head, its `r = n_v_heads / n_k_heads` b values then its `r` a
/// values): `beta = sigmoid(b)`, `g = ssm_a · softplus(a + dt_bias)` with `ssm_a =
/// −exp(A_log)` as llama.cpp stores it.
pub fn gates(
    shape: DeltaShape,
    ba: &[f32],
    n_tok: usize,
    dt_bias: &[f32],
    ssm_a: &[f32],
    beta: &mut [f32],
    g: &mut [f32],
) -> Result<(), OpError> {
    shape.check("delta gates")?;
    let nv = shape.n_v_heads;
    let r = nv / shape.n_k_heads;
    need("delta gates", "ba", n_tok * 2 * nv, ba.len())?;
    need("delta gates", "dt_bias", nv, dt_bias.len())?;
    need("delta gates", "ssm_a", nv, ssm_a.len())?;
    need("delta gates", "beta", n_tok * nv, beta.len())?;
    need("delta gates", "g", n_tok * nv, g.len())?;
    for t in 0..n_tok {
        let row = &ba[t * 2 * nv..(t + 1) * 2 * nv];
        for h in 0..nv {
            let (grp, j) = (h / r, h % r);
            let b = row[grp * 2 * r + j];
            let a = row[grp * 2 * r + r + j];
            beta[t * nv + h] = sigmoid(b);
            g[t * nv + h] = ssm_a[h] * softplus(a + dt_bias[h]);
        }
    }
    Ok(())
}

/// HF's `l2norm` (as FLA computes it) of every `head`-float head of `x`:
/// `x · 1/sqrt(Σx² + eps)` (llama.cpp's `ggml_l2_norm` divides by `max(‖x‖, eps)` instead: the
/// same for any head that is not almost zero).
pub fn l2norm_heads_inplace(x: &mut [f32], head: usize, eps: f32) -> Result<(), OpError> {
    if head == 0 || x.len() % head != 0 {
        return Err(OpError::Shape {
            op: "l2norm",
            what: "x (a whole number of heads)",
            expected: x.len().div_ceil(head.max(1)) * head,
            got: x.len(),
        });
    }
    for v in x.chunks_exact_mut(head) {
        let ss: f32 = v.iter().map(|a| a * a).sum();
        let r = 1.0 / (ss + eps).sqrt();
        v.iter_mut().for_each(|a| *a *= r);
    }
    Ok(())
}

/// l2-normalize the q and k heads of every `qkv` row in place (the v part is left alone).
pub fn l2norm_qk_inplace(
    shape: DeltaShape,
    qkv: &mut [f32],
    n_tok: usize,
    eps: f32,
) -> Result<(), OpError> {
    shape.check("l2norm qk")?;
    let w = shape.qkv_dim();
    need("l2norm qk", "qkv", n_tok * w, qkv.len())?;
    for row in qkv[..n_tok * w].chunks_exact_mut(w) {
        l2norm_heads_inplace(&mut row[..2 * shape.key_dim()], shape.head_k, eps)?;
    }
    Ok(())
}

/// One call's inputs: `n_tok` tokens of conv output (`qkv`, q and k l2-normalized) and their
/// per-head gates.
#[derive(Debug, Clone, Copy)]
pub struct DeltaInputs<'a> {
    pub qkv: &'a [f32],
    pub g: &'a [f32],
    pub beta: &'a [f32],
    pub n_tok: usize,
}

impl DeltaInputs<'_> {
    fn check(
        &self,
        op: &'static str,
        shape: DeltaShape,
        state: &[f32],
        out: &[f32],
    ) -> Result<(), OpError> {
        shape.check(op)?;
        let n = self.n_tok;
        need(op, "qkv", n * shape.qkv_dim(), self.qkv.len())?;
        need(op, "g", n * shape.n_v_heads, self.g.len())?;
        need(op, "beta", n * shape.n_v_heads, self.beta.len())?;
        need(op, "state", shape.state_len(), state.len())?;
        need(op, "out", n * shape.value_dim(), out.len())?;
        Ok(())
    }
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The gated delta rule token by token (the decode step; any `n_tok`), parallel over value
/// heads. `qkv` holds l2-normalized q and k (see [`l2norm_qk_inplace`]).
pub fn delta_rule_recurrent(
    shape: DeltaShape,
    inp: DeltaInputs<'_>,
    state: &mut [f32],
    out: &mut [f32],
) -> Result<(), OpError> {
    inp.check("delta rule", shape, state, out)?;
    let DeltaInputs {
        qkv,
        g,
        beta,
        n_tok,
    } = inp;
    let (nv, dk, dv) = (shape.n_v_heads, shape.head_k, shape.head_v);
    let (w, scale) = (shape.qkv_dim(), 1.0 / (dk as f32).sqrt());
    for t in 0..n_tok {
        let row = &qkv[t * w..(t + 1) * w];
        state[..shape.state_len()]
            .par_chunks_mut(dv * dk)
            .zip(out[t * nv * dv..(t + 1) * nv * dv].par_chunks_mut(dv))
            .enumerate()
            .for_each(|(h, (s, o))| {
                let (q, k, v) = shape.qkv_of(row, h);
                let decay = g[t * nv + h].exp();
                let b = beta[t * nv + h];
                for (j, (srow, oj)) in s.chunks_exact_mut(dk).zip(o.iter_mut()).enumerate() {
                    let mut mem = 0f32;
                    for (si, ki) in srow.iter_mut().zip(k) {
                        *si *= decay;
                        mem += *si * ki;
                    }
                    let d = b * (v[j] - mem);
                    let mut acc = 0f32;
                    for ((si, ki), qi) in srow.iter_mut().zip(k).zip(q) {
                        *si += ki * d;
                        acc += *si * qi;
                    }
                    *oj = acc * scale;
                }
            });
    }
    Ok(())
}

/// HF's and llama.cpp's chunk length for the chunked form.
pub const CHUNK: usize = 64;

/// Floats of scratch [`delta_rule_chunked`] needs for `n_tok` tokens in chunks of `chunk`.
pub fn chunked_scratch_len(shape: DeltaShape, n_tok: usize, chunk: usize) -> usize {
    shape.n_v_heads * per_head_scratch(shape, n_tok, chunk)
}

fn per_head_scratch(shape: DeltaShape, n_tok: usize, chunk: usize) -> usize {
    let (c, dk, dv) = (chunk, shape.head_k, shape.head_v);
    // gc, kb, T, v_new, k_cumdecay, the head's outputs
    c + c * dk + c * c + c * dv + c * dk + n_tok * dv
}

/// The gated delta rule over `n_tok` tokens in chunks of `chunk` (prefill; [`CHUNK`] as HF
/// and llama.cpp), parallel over value heads; `scratch` holds at least
/// [`chunked_scratch_len`] floats. Per chunk of `L` tokens (HF's
/// `torch_chunk_gated_delta_rule`, without its padding): cumulative gates `γ`, `T = (I +
/// tril₋₁((β k) kᵀ ⊙ e^{γᵢ−γⱼ}))⁻¹` by forward substitution, `u = T (β v)`,
/// `w = T (β k ⊙ e^γ)`, then against the state carried in: `v' = u − w S`,
/// `o = (q ⊙ e^γ) S + tril₀(q kᵀ ⊙ e^{γᵢ−γⱼ}) v'`, `S ← e^{γ_L} S + (k ⊙ e^{γ_L−γ})ᵀ v'`.
pub fn delta_rule_chunked(
    shape: DeltaShape,
    inp: DeltaInputs<'_>,
    chunk: usize,
    state: &mut [f32],
    scratch: &mut [f32],
    out: &mut [f32],
) -> Result<(), OpError> {
    inp.check("delta rule chunked", shape, state, out)?;
    let n_tok = inp.n_tok;
    if chunk == 0 {
        return Err(OpError::Shape {
            op: "delta rule chunked",
            what: "chunk (tokens per chunk)",
            expected: 1,
            got: 0,
        });
    }
    let per = per_head_scratch(shape, n_tok, chunk);
    need(
        "delta rule chunked",
        "scratch",
        shape.n_v_heads * per,
        scratch.len(),
    )?;
    let (nv, dk, dv) = (shape.n_v_heads, shape.head_k, shape.head_v);
    state[..shape.state_len()]
        .par_chunks_mut(dv * dk)
        .zip(scratch[..nv * per].par_chunks_mut(per))
        .enumerate()
        .for_each(|(h, (s, sc))| {
            let io = HeadIo { shape, h, inp };
            let mut t0 = 0;
            while t0 < n_tok {
                let len = chunk.min(n_tok - t0);
                chunk_step(&io, t0, len, chunk, s, sc, n_tok);
                t0 += len;
            }
        });
    // Scatter the head-major outputs into token-major rows.
    for h in 0..nv {
        let o = &scratch[h * per + per - n_tok * dv..(h + 1) * per];
        for t in 0..n_tok {
            out[(t * nv + h) * dv..(t * nv + h + 1) * dv].copy_from_slice(&o[t * dv..(t + 1) * dv]);
        }
    }
    Ok(())
}

/// What one value head reads.
struct HeadIo<'a> {
    shape: DeltaShape,
    h: usize,
    inp: DeltaInputs<'a>,
}

impl HeadIo<'_> {
    fn qkv(&self, t: usize) -> (&[f32], &[f32], &[f32]) {
        let w = self.shape.qkv_dim();
        self.shape.qkv_of(&self.inp.qkv[t * w..(t + 1) * w], self.h)
    }
    fn g(&self, t: usize) -> f32 {
        self.inp.g[t * self.shape.n_v_heads + self.h]
    }
    fn beta(&self, t: usize) -> f32 {
        self.inp.beta[t * self.shape.n_v_heads + self.h]
    }
}

/// One chunk `[t0, t0 + len)` of one head: outputs into the head's output rows of `sc`, the
/// state `s` rolled forward.
fn chunk_step(
    io: &HeadIo<'_>,
    t0: usize,
    len: usize,
    chunk: usize,
    s: &mut [f32],
    sc: &mut [f32],
    n_tok: usize,
) {
    let (dk, dv) = (io.shape.head_k, io.shape.head_v);
    let scale = 1.0 / (dk as f32).sqrt();
    let (gc, rest) = sc.split_at_mut(chunk);
    let (kb, rest) = rest.split_at_mut(chunk * dk);
    let (tm, rest) = rest.split_at_mut(chunk * chunk);
    let (vn, rest) = rest.split_at_mut(chunk * dv);
    let (kcd, rest) = rest.split_at_mut(chunk * dk);
    let o_all = &mut rest[..n_tok * dv];

    let mut acc = 0f32;
    for t in 0..len {
        acc += io.g(t0 + t);
        gc[t] = acc;
        let (_, k, _) = io.qkv(t0 + t);
        let b = io.beta(t0 + t);
        for (d, ki) in kb[t * dk..(t + 1) * dk].iter_mut().zip(k) {
            *d = ki * b;
        }
    }
    // T = (I + L)⁻¹ with L[t][s] = (kb_t · k_s) e^{γ_t − γ_s} for s < t, row by row: first the
    // row of −L, then X[t][s] = −L[t][s] + Σ_{s<m<t} −L[t][m] X[m][s] for s ascending (the −L
    // values of m > s are still in place).
    for t in 0..len {
        for s_ in 0..t {
            let (_, ks, _) = io.qkv(t0 + s_);
            tm[t * chunk + s_] = -dot(&kb[t * dk..(t + 1) * dk], ks) * (gc[t] - gc[s_]).exp();
        }
        for s_ in 0..t {
            let mut x = tm[t * chunk + s_];
            for m in s_ + 1..t {
                x += tm[t * chunk + m] * tm[m * chunk + s_];
            }
            tm[t * chunk + s_] = x;
        }
        tm[t * chunk + t] = 1.0;
    }
    // u = T (β v) into vn, w = T (β k e^γ) into kcd.
    for t in 0..len {
        let (u, w) = (
            &mut vn[t * dv..(t + 1) * dv],
            &mut kcd[t * dk..(t + 1) * dk],
        );
        u.fill(0.0);
        w.fill(0.0);
        for s_ in 0..=t {
            let c = tm[t * chunk + s_];
            let (_, _, vs) = io.qkv(t0 + s_);
            let cb = c * io.beta(t0 + s_);
            for (ui, vi) in u.iter_mut().zip(vs) {
                *ui += cb * vi;
            }
            let ce = c * gc[s_].exp();
            for (wi, ki) in w.iter_mut().zip(&kb[s_ * dk..(s_ + 1) * dk]) {
                *wi += ce * ki;
            }
        }
    }
    // v' = u − w S (S row j is value column j).
    for t in 0..len {
        for j in 0..dv {
            vn[t * dv + j] -= dot(&kcd[t * dk..(t + 1) * dk], &s[j * dk..(j + 1) * dk]);
        }
    }
    // o_t = e^{γ_t} Sᵀ q_t + Σ_{s≤t} (q_t·k_s) e^{γ_t−γ_s} v'_s, all times the q scale.
    for t in 0..len {
        let (q, _, _) = io.qkv(t0 + t);
        let o = &mut o_all[(t0 + t) * dv..(t0 + t + 1) * dv];
        let eg = gc[t].exp();
        for (j, oj) in o.iter_mut().enumerate() {
            *oj = eg * dot(q, &s[j * dk..(j + 1) * dk]);
        }
        for s_ in 0..=t {
            let (_, ks, _) = io.qkv(t0 + s_);
            let c = dot(q, ks) * (gc[t] - gc[s_]).exp();
            for (oj, vj) in o.iter_mut().zip(&vn[s_ * dv..(s_ + 1) * dv]) {
                *oj += c * vj;
            }
        }
        o.iter_mut().for_each(|x| *x *= scale);
    }
    // S ← e^{γ_L} S + Σ_t (k_t e^{γ_L − γ_t}) v'_tᵀ.
    let gl = gc[len - 1];
    let el = gl.exp();
    for (j, srow) in s.chunks_exact_mut(dk).enumerate() {
        srow.iter_mut().for_each(|x| *x *= el);
        for t in 0..len {
            let (_, k, _) = io.qkv(t0 + t);
            let c = vn[t * dv + j] * (gl - gc[t]).exp();
            for (si, ki) in srow.iter_mut().zip(k) {
                *si += c * ki;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::conv::tests::lcg;
    use super::*;

    fn di<'a>(qkv: &'a [f32], g: &'a [f32], beta: &'a [f32], n_tok: usize) -> DeltaInputs<'a> {
        DeltaInputs {
            qkv,
            g,
            beta,
            n_tok,
        }
    }

    /// Random normalized q/k, v, gates in a plausible range, and an initial state.
    struct Case {
        shape: DeltaShape,
        qkv: Vec<f32>,
        g: Vec<f32>,
        beta: Vec<f32>,
        state: Vec<f32>,
    }

    fn case(shape: DeltaShape, n_tok: usize, seed: u64) -> Case {
        let mut qkv = lcg(seed, n_tok * shape.qkv_dim());
        l2norm_qk_inplace(shape, &mut qkv, n_tok, 1e-6).unwrap();
        let g: Vec<f32> = lcg(seed + 1, n_tok * shape.n_v_heads)
            .iter()
            .map(|x| -0.02 - 0.5 * (x + 1.0))
            .collect();
        let beta: Vec<f32> = lcg(seed + 2, n_tok * shape.n_v_heads)
            .iter()
            .map(|x| 0.5 + 0.45 * x)
            .collect();
        let state = lcg(seed + 3, shape.state_len())
            .iter()
            .map(|x| 0.3 * x)
            .collect();
        Case {
            shape,
            qkv,
            g,
            beta,
            state,
        }
    }

    /// HF's `torch_recurrent_gated_delta_rule` in f64 with HF's state layout
    /// `S[h][i (key)][j (value)]`; returns (outputs, final state in our layout).
    fn naive(c: &Case, n_tok: usize) -> (Vec<f64>, Vec<f64>) {
        let sh = c.shape;
        let (nv, dk, dv) = (sh.n_v_heads, sh.head_k, sh.head_v);
        let mut s = vec![0f64; nv * dk * dv];
        for h in 0..nv {
            for j in 0..dv {
                for i in 0..dk {
                    s[(h * dk + i) * dv + j] = c.state[(h * dv + j) * dk + i] as f64;
                }
            }
        }
        let scale = 1.0 / (dk as f64).sqrt();
        let mut out = vec![0f64; n_tok * nv * dv];
        let w = sh.qkv_dim();
        for t in 0..n_tok {
            for h in 0..nv {
                let (q, k, v) = sh.qkv_of(&c.qkv[t * w..(t + 1) * w], h);
                let st = &mut s[h * dk * dv..(h + 1) * dk * dv];
                let decay = (c.g[t * nv + h] as f64).exp();
                st.iter_mut().for_each(|x| *x *= decay);
                for j in 0..dv {
                    let mem: f64 = (0..dk).map(|i| st[i * dv + j] * k[i] as f64).sum();
                    let d = c.beta[t * nv + h] as f64 * (v[j] as f64 - mem);
                    for i in 0..dk {
                        st[i * dv + j] += k[i] as f64 * d;
                    }
                }
                for j in 0..dv {
                    out[(t * nv + h) * dv + j] =
                        (0..dk).map(|i| st[i * dv + j] * q[i] as f64 * scale).sum();
                }
            }
        }
        let mut ours = vec![0f64; nv * dv * dk];
        for h in 0..nv {
            for j in 0..dv {
                for i in 0..dk {
                    ours[(h * dv + j) * dk + i] = s[(h * dk + i) * dv + j];
                }
            }
        }
        (out, ours)
    }

    fn close(what: &str, got: &[f32], want: &[f64], tol: f64) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            assert!(
                (*a as f64 - b).abs() <= tol * (1.0 + b.abs()),
                "{what}[{i}]: {a} vs {b}"
            );
        }
    }

    const SHAPES: [DeltaShape; 3] = [
        // Qwen3-Next's head ratio 2 (16 key heads, 32 value heads), scaled down.
        DeltaShape {
            n_k_heads: 2,
            n_v_heads: 4,
            head_k: 16,
            head_v: 16,
        },
        DeltaShape {
            n_k_heads: 3,
            n_v_heads: 3,
            head_k: 8,
            head_v: 8,
        },
        DeltaShape {
            n_k_heads: 1,
            n_v_heads: 3,
            head_k: 5,
            head_v: 7,
        },
    ];

    #[test]
    fn hand_computed_scalar_head() {
        // One head of one dim: S is a scalar, q = k = 1 (already unit), scale 1.
        // t0: v 2, g ln .5, β .5: S = 0·.5 = 0; d = .5·2 = 1; S = 1; o = 1.
        // t1: v 4, g ln .5, β 1: S = .5; d = 4 − .5 = 3.5; S = 4; o = 4.
        let shape = DeltaShape {
            n_k_heads: 1,
            n_v_heads: 1,
            head_k: 1,
            head_v: 1,
        };
        let qkv = [1.0f32, 1.0, 2.0, 1.0, 1.0, 4.0];
        let g = [0.5f32.ln(); 2];
        let beta = [0.5f32, 1.0];
        let mut s = [0f32];
        let mut out = [0f32; 2];
        delta_rule_recurrent(shape, di(&qkv, &g, &beta, 2), &mut s, &mut out).unwrap();
        assert!(
            (out[0] - 1.0).abs() < 1e-6 && (out[1] - 4.0).abs() < 1e-6,
            "{out:?}"
        );
        assert!((s[0] - 4.0).abs() < 1e-6);
        let mut s2 = [0f32];
        let mut o2 = [0f32; 2];
        let mut sc = vec![0f32; chunked_scratch_len(shape, 2, 64)];
        delta_rule_chunked(shape, di(&qkv, &g, &beta, 2), 64, &mut s2, &mut sc, &mut o2).unwrap();
        assert!(
            (o2[0] - 1.0).abs() < 1e-6 && (o2[1] - 4.0).abs() < 1e-6,
            "{o2:?}"
        );
        assert!((s2[0] - 4.0).abs() < 1e-6);
    }

    #[test]
    fn recurrent_matches_the_f64_definition() {
        for (i, shape) in SHAPES.into_iter().enumerate() {
            let n = 9;
            let c = case(shape, n, 10 + i as u64);
            let (want_o, want_s) = naive(&c, n);
            let mut s = c.state.clone();
            let mut out = vec![0f32; n * shape.value_dim()];
            delta_rule_recurrent(shape, di(&c.qkv, &c.g, &c.beta, n), &mut s, &mut out).unwrap();
            close("recurrent out", &out, &want_o, 1e-4);
            close("recurrent state", &s, &want_s, 1e-4);
        }
    }

    #[test]
    fn chunked_matches_recurrent_and_the_definition_across_chunks() {
        for (i, shape) in SHAPES.into_iter().enumerate() {
            for (n, chunk) in [(1, 64), (5, 64), (64, 64), (65, 64), (130, 64), (37, 16)] {
                let c = case(shape, n, 100 + i as u64 * 7 + n as u64);
                let (want_o, want_s) = naive(&c, n);
                let mut s = c.state.clone();
                let mut out = vec![0f32; n * shape.value_dim()];
                let mut sc = vec![0f32; chunked_scratch_len(shape, n, chunk)];
                delta_rule_chunked(
                    shape,
                    di(&c.qkv, &c.g, &c.beta, n),
                    chunk,
                    &mut s,
                    &mut sc,
                    &mut out,
                )
                .unwrap();
                let what = format!("shape {i} n {n} chunk {chunk}");
                close(&format!("{what} out"), &out, &want_o, 2e-4);
                close(&format!("{what} state"), &s, &want_s, 2e-4);

                let mut sr = c.state.clone();
                let mut or = vec![0f32; n * shape.value_dim()];
                delta_rule_recurrent(shape, di(&c.qkv, &c.g, &c.beta, n), &mut sr, &mut or)
                    .unwrap();
                for (a, b) in out.iter().zip(&or) {
                    assert!(
                        (a - b).abs() <= 2e-4 * (1.0 + b.abs()),
                        "{what}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn prefill_then_decode_continues_the_sequence() {
        // Chunked prefill of 70 tokens, then 3 recurrent steps == the definition over 73.
        let shape = SHAPES[0];
        let n = 73;
        let c = case(shape, n, 5);
        let (want_o, want_s) = naive(&c, n);
        let (w, vd, nv) = (shape.qkv_dim(), shape.value_dim(), shape.n_v_heads);
        let mut s = c.state.clone();
        let mut out = vec![0f32; n * vd];
        let mut sc = vec![0f32; chunked_scratch_len(shape, 70, CHUNK)];
        delta_rule_chunked(
            shape,
            di(&c.qkv[..70 * w], &c.g[..70 * nv], &c.beta[..70 * nv], 70),
            CHUNK,
            &mut s,
            &mut sc,
            &mut out[..70 * vd],
        )
        .unwrap();
        for t in 70..n {
            delta_rule_recurrent(
                shape,
                di(
                    &c.qkv[t * w..(t + 1) * w],
                    &c.g[t * nv..(t + 1) * nv],
                    &c.beta[t * nv..(t + 1) * nv],
                    1,
                ),
                &mut s,
                &mut out[t * vd..(t + 1) * vd],
            )
            .unwrap();
        }
        close("prefill+decode out", &out, &want_o, 2e-4);
        close("prefill+decode state", &s, &want_s, 2e-4);
    }

    #[test]
    fn random_shapes_chunks_and_splits_agree_with_the_definition() {
        // Property: however a sequence is cut into calls, and whichever form runs each call
        // (any chunk length), outputs and final state are the definition's.
        use rand::{rngs::StdRng, Rng, SeedableRng};
        let mut rng = StdRng::seed_from_u64(0x5eed_de17a);
        for trial in 0..40u64 {
            let nk = rng.random_range(1..=3usize);
            let shape = DeltaShape {
                n_k_heads: nk,
                n_v_heads: nk * rng.random_range(1..=3usize),
                head_k: rng.random_range(1..=9usize),
                head_v: rng.random_range(1..=9usize),
            };
            let n = rng.random_range(1..=140usize);
            let c = case(shape, n, 1000 + trial);
            let (want_o, want_s) = naive(&c, n);
            let (w, vd, nv) = (shape.qkv_dim(), shape.value_dim(), shape.n_v_heads);
            let mut s = c.state.clone();
            let mut out = vec![0f32; n * vd];
            let mut t = 0;
            let mut cuts = Vec::new();
            while t < n {
                let len = rng.random_range(1..=n - t);
                let chunk = [1usize, 3, 16, 64][rng.random_range(0..4usize)];
                let chunked = rng.random_bool(0.5);
                cuts.push((len, chunked.then_some(chunk)));
                let (qkv, g, beta) = (
                    &c.qkv[t * w..(t + len) * w],
                    &c.g[t * nv..(t + len) * nv],
                    &c.beta[t * nv..(t + len) * nv],
                );
                let o = &mut out[t * vd..(t + len) * vd];
                if chunked {
                    let mut sc = vec![0f32; chunked_scratch_len(shape, len, chunk)];
                    delta_rule_chunked(shape, di(qkv, g, beta, len), chunk, &mut s, &mut sc, o)
                        .unwrap();
                } else {
                    delta_rule_recurrent(shape, di(qkv, g, beta, len), &mut s, o).unwrap();
                }
                t += len;
            }
            let what = format!("trial {trial} {shape:?} n {n} cuts {cuts:?}");
            close(&format!("{what} out"), &out, &want_o, 3e-4);
            close(&format!("{what} state"), &s, &want_s, 3e-4);
        }
    }

    #[test]
    fn gates_and_l2norm_hand_values() {
        // 1 key head, 2 value heads: ba row = [b0, b1, a0, a1].
        let shape = DeltaShape {
            n_k_heads: 1,
            n_v_heads: 2,
            head_k: 2,
            head_v: 2,
        };
        let ba = [0.0f32, 2.0, 1.0, -30.0];
        let (mut beta, mut g) = ([0f32; 2], [0f32; 2]);
        gates(shape, &ba, 1, &[0.5, 0.0], &[-2.0, -1.0], &mut beta, &mut g).unwrap();
        assert!((beta[0] - 0.5).abs() < 1e-7);
        assert!((beta[1] - 1.0 / (1.0 + (-2.0f32).exp())).abs() < 1e-7);
        // g0 = −2 · ln(1 + e^1.5) = −2 · 1.701413; g1 = −1 · ln(1 + e^−30) ≈ −9.36e−14.
        assert!((g[0] + 2.0 * 1.701_413_5).abs() < 1e-5, "{g:?}");
        assert!(g[1] < 0.0 && g[1] > -1e-12);
        assert_eq!(softplus(25.0), 25.0);

        // Grouped layout with 2 key heads, ratio 2: [b(g0) b(g0) a(g0) a(g0) b(g1) ...].
        let shape2 = DeltaShape {
            n_k_heads: 2,
            n_v_heads: 4,
            head_k: 1,
            head_v: 1,
        };
        let ba2 = [1.0f32, 2.0, 0.0, 0.0, 3.0, 4.0, 0.0, 0.0];
        let (mut b2, mut g2) = ([0f32; 4], [0f32; 4]);
        gates(shape2, &ba2, 1, &[0.0; 4], &[-1.0; 4], &mut b2, &mut g2).unwrap();
        for (h, b) in [1.0f32, 2.0, 3.0, 4.0].iter().enumerate() {
            assert!((b2[h] - 1.0 / (1.0 + (-b).exp())).abs() < 1e-7, "{b2:?}");
        }

        let mut x = [3.0f32, 4.0, 0.0, 0.0];
        l2norm_heads_inplace(&mut x, 2, 1e-6).unwrap();
        // 3 / sqrt(25 + 1e-6), 4 / sqrt(25 + 1e-6)
        assert!(
            (x[0] - 0.6).abs() < 1e-7 && (x[1] - 0.8).abs() < 1e-7,
            "{x:?}"
        );
        assert_eq!(
            &x[2..],
            &[0.0, 0.0],
            "a zero head stays zero (eps keeps it finite)"
        );
        assert!(l2norm_heads_inplace(&mut x, 3, 1e-6).is_err());
    }

    #[test]
    fn value_heads_read_their_key_group() {
        // Head 1 of ratio 2 reads key head 0; head 2 reads key head 1.
        let shape = SHAPES[0];
        let row: Vec<f32> = (0..shape.qkv_dim()).map(|i| i as f32).collect();
        let (q, k, v) = shape.qkv_of(&row, 1);
        assert_eq!(q[0], 0.0);
        assert_eq!(k[0], shape.key_dim() as f32);
        assert_eq!(v[0], (2 * shape.key_dim() + shape.head_v) as f32);
        let (q2, _, _) = shape.qkv_of(&row, 2);
        assert_eq!(q2[0], shape.head_k as f32);
    }

    #[test]
    fn shapes_are_checked_by_name() {
        let shape = SHAPES[0];
        let n = 2;
        let c = case(shape, n, 1);
        let mut s = c.state.clone();
        let mut out = vec![0f32; n * shape.value_dim()];
        let e = delta_rule_recurrent(shape, di(&c.qkv[1..], &c.g, &c.beta, n), &mut s, &mut out)
            .unwrap_err();
        assert!(e.to_string().contains("qkv"), "{e}");
        let e = delta_rule_recurrent(shape, di(&c.qkv, &c.g, &c.beta, n), &mut s[1..], &mut out)
            .unwrap_err();
        assert!(e.to_string().contains("state"), "{e}");
        let mut sc = vec![0f32; chunked_scratch_len(shape, n, 64) - 1];
        let e = delta_rule_chunked(
            shape,
            di(&c.qkv, &c.g, &c.beta, n),
            64,
            &mut s,
            &mut sc,
            &mut out,
        )
        .unwrap_err();
        assert!(e.to_string().contains("scratch"), "{e}");
        let bad = DeltaShape {
            n_v_heads: 3,
            ..shape
        };
        let e =
            delta_rule_recurrent(bad, di(&c.qkv, &c.g, &c.beta, n), &mut s, &mut out).unwrap_err();
        assert!(e.to_string().contains("n_v_heads"), "{e}");
    }
}
