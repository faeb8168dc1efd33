//! A host emulation of `kernels/cuda/dp4a.cu`'s lane arithmetic over Q8_0, Q4_K, Q6_K and
//! IQ3_S weights — the q8a quantization, the integer dot products of 4 quants (IQ3_S's grid
//! rows with their signs applied branch-free), the scales applied in the kernels' order
//! (`fmaf` where they use it), the warp's butterfly sum, the MoE down's block sum and the
//! multi-token products' staging of the q8a rows in shared memory (`stage`) — checked without
//! a GPU against an f64 reference of the weights times the quantized inputs (tight: the
//! algorithm) and times the f32 inputs (the stated quantization bound).
//! Invariant: each emulated step is the kernel's, in its order, so a wrong lane mapping,
//! scale, sign, min term or block index here is one in the kernel.

use super::quantize_q8a;
use crate::backend::cuda::layout::to_device;
use crate::quant::{dequantize_row, quantize_row, random::random_row, IQ3S_GRID};
use strata_schemas::ggml::GgmlType;

const WARP: usize = 32;

fn dp4a(a: u32, b: u32, c: i32) -> i32 {
    (0..4).fold(c, |c, k| {
        c + ((a >> (8 * k)) as u8 as i8 as i32) * ((b >> (8 * k)) as u8 as i8 as i32)
    })
}

fn word(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn h2f(b: &[u8]) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// common.cuh's st_scale_min_k4.
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    if j < 4 {
        ((q[j] & 63) as f32, (q[j + 4] & 63) as f32)
    } else {
        (
            ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)) as f32,
            ((q[j + 4] >> 4) | ((q[j] >> 6) << 4)) as f32,
        )
    }
}

/// st_warp_sum: the xor butterfly; every lane ends with the same value (lane 0's returned).
fn warp_sum(mut v: [f32; WARP]) -> f32 {
    let mut m = WARP / 2;
    while m > 0 {
        let prev = v;
        for (i, x) in v.iter_mut().enumerate() {
            *x = prev[i] + prev[i ^ m];
        }
        m /= 2;
    }
    v[0]
}

/// Quantized activation rows as the kernels read them: quants as bytes, (d, s) per block;
/// rows of `cols` (the stride) from column `c0` on: whole rows in global memory (c0 = 0), or
/// a chunk staged in shared memory (`cols` = STAGE_COLS, c0 the chunk's first column).
struct Act {
    q: Vec<u8>,
    ds: Vec<[f32; 2]>,
    cols: usize,
    c0: usize,
}

fn act(x: &[f32], cols: usize) -> Act {
    let h = quantize_q8a(x);
    Act {
        q: h.q.iter().map(|&v| v as u8).collect(),
        ds: h.ds,
        cols,
        c0: 0,
    }
}

/// qa_mv_staged's copy of columns [c0, c0 + kc) of the first `n` rows of `a` (whole rows)
/// into the shared arrays: item i of the quants' loop copies 16 bytes of token i / (kc / 16),
/// item i of the pairs' loop one pair of token i / (kc / 32); rows STAGE_COLS apart, the
/// rest of the arrays never written (here quants 0x55 and NaN pairs, which a stray read shows).
fn stage(a: &Act, n: usize, c0: usize, kc: usize) -> Act {
    let kcs = super::STAGE_COLS;
    let mut q = vec![0x55u8; n * kcs];
    let mut ds = vec![[f32::NAN; 2]; n * kcs / 32];
    let (v16, nb) = (kc / 16, kc / 32);
    for i in 0..n * v16 {
        let (t, v) = (i / v16, i % v16);
        let src = t * a.cols + c0 + 16 * v;
        q[t * kcs + 16 * v..t * kcs + 16 * v + 16].copy_from_slice(&a.q[src..src + 16]);
    }
    for i in 0..n * nb {
        let (t, b) = (i / nb, i % nb);
        ds[t * (kcs / 32) + b] = a.ds[t * (a.cols / 32) + c0 / 32 + b];
    }
    Act {
        q,
        ds,
        cols: kcs,
        c0,
    }
}

/// qa_q8_piece: acc + piece (16 weight quants at column i0 of weight row `wq`, scale dw) .
/// activation row t.
fn q8_piece(wq: &[u8], dw: f32, a: &Act, t: usize, i0: usize, acc: f32) -> f32 {
    let xq = &a.q[t * a.cols + i0 - a.c0..];
    let mut s = 0;
    for j in 0..4 {
        s = dp4a(word(&wq[i0 + 4 * j..]), word(&xq[4 * j..]), s);
    }
    (dw * a.ds[t * a.cols / 32 + (i0 - a.c0) / 32][0]).mul_add(s as f32, acc)
}

/// qa_q4k_lane + qa_q4k_dot: acc + lane l's part of block b of Q4_K row `row` . activation t.
fn q4k_lane(row: &[u8], l: usize, b: usize, a: &Act, t: usize, acc: f32) -> f32 {
    let blk = &row[b * 144..];
    let (g, j) = (l >> 3, 4 * (l & 7));
    let (d, dmin) = (h2f(blk), h2f(&blk[2..]));
    let (sc0, m0) = scale_min_k4(2 * g, &blk[4..]);
    let (sc1, m1) = scale_min_k4(2 * g + 1, &blk[4..]);
    let qs = word(&blk[16 + 32 * g + j..]);
    let (qa, qb) = (qs & 0x0F0F_0F0F, (qs >> 4) & 0x0F0F_0F0F);
    let (ka, kb, ma, mb) = (d * sc0, d * sc1, dmin * m0, dmin * m1);
    let xb = b - a.c0 / 256;
    let ia = t * a.cols + xb * 256 + 64 * g + j;
    let nq = t * a.cols / 32 + xb * 8 + 2 * g;
    let (da, db) = (a.ds[nq], a.ds[nq + 1]);
    let sa = dp4a(qa, word(&a.q[ia..]), 0);
    let sb = dp4a(qb, word(&a.q[ia + 32..]), 0);
    let mut v = (ka * da[0]) * sa as f32;
    v = (kb * db[0]).mul_add(sb as f32, v);
    if l & 7 == 0 {
        v = (-ma).mul_add(da[1], v);
        v = (-mb).mul_add(db[1], v);
    }
    acc + v
}

/// qa_sub32x4: each byte minus 32, no borrow across bytes.
fn sub32x4(v: u32) -> u32 {
    ((v | 0x8080_8080).wrapping_sub(0x2020_2020)) ^ 0x8080_8080
}

fn ld_u32_a2(b: &[u8]) -> u32 {
    word(b)
}

/// qa_q6k_lane + qa_q6k_dot: acc + lane l's part of block b of Q6_K row `row` . activation t.
fn q6k_lane(row: &[u8], l: usize, b: usize, a: &Act, t: usize, acc: f32) -> f32 {
    let blk = &row[b * 210..];
    let (n, h, j) = (l >> 4, (l >> 3) & 1, 4 * (l & 7));
    let ql = ld_u32_a2(&blk[64 * n + 32 * h + j..]);
    let qh = ld_u32_a2(&blk[128 + 32 * n + j..]);
    let qa = sub32x4((ql & 0x0F0F_0F0F) | (((qh >> (2 * h)) & 0x0303_0303) << 4));
    let qb = sub32x4(((ql >> 4) & 0x0F0F_0F0F) | (((qh >> (4 + 2 * h)) & 0x0303_0303) << 4));
    let d = h2f(&blk[208..]);
    let sc = 8 * n + 2 * h + ((l & 7) >> 2);
    let (ka, kb) = (
        d * blk[192 + sc] as i8 as f32,
        d * blk[192 + sc + 4] as i8 as f32,
    );
    let xb = b - a.c0 / 256;
    let ia = t * a.cols + xb * 256 + 128 * n + 32 * h + j;
    let nq = t * a.cols / 32 + xb * 8 + 4 * n + h;
    let (da, db) = (a.ds[nq][0], a.ds[nq + 2][0]);
    let sa = dp4a(qa, word(&a.q[ia..]), 0);
    let sb = dp4a(qb, word(&a.q[ia + 64..]), 0);
    let mut v = (ka * da) * sa as f32;
    v = (kb * db).mul_add(sb as f32, v);
    acc + v
}

/// qa_signed4: the 4 grid bytes of `g` with byte j negated where bit j of `bits` is set (the
/// nibble spread one bit a byte by the multiply, then xor and add: no branch).
fn signed4(g: u32, bits: u32) -> u32 {
    let m = ((bits & 0xF).wrapping_mul(0x0020_4081)) & 0x0101_0101;
    (g ^ m.wrapping_mul(0xFF)).wrapping_add(m)
}

/// qa_iq3s_lane + qa_iq3s_dot: acc + lane l's part of block b of IQ3_S row `row` .
/// activation t.
fn iq3s_lane(row: &[u8], l: usize, b: usize, a: &Act, t: usize, acc: f32) -> f32 {
    let blk = &row[b * 110..];
    let (gi, h) = (l >> 2, l & 3);
    let k = 8 * gi + 2 * h;
    let qs = u16::from_le_bytes([blk[2 + k], blk[3 + k]]) as usize;
    let qh = blk[66 + gi] as usize;
    let g0 = IQ3S_GRID[(qs & 0xFF) | (((qh >> (2 * h)) & 1) << 8)];
    let g1 = IQ3S_GRID[(qs >> 8) | (((qh >> (2 * h + 1)) & 1) << 8)];
    let sg = blk[74 + 4 * gi + h] as u32;
    let (qa, qb) = (signed4(g0, sg), signed4(g1, sg >> 4));
    let nib = (blk[106 + (gi >> 1)] >> (4 * (gi & 1))) & 15;
    let kw = h2f(blk) * (1 + 2 * nib as i32) as f32;
    let xb = b - a.c0 / 256;
    let ia = t * a.cols + xb * 256 + 8 * l;
    let dx = a.ds[t * a.cols / 32 + xb * 8 + gi][0];
    let s = dp4a(qb, word(&a.q[ia + 4..]), dp4a(qa, word(&a.q[ia..]), 0));
    (kw * dx).mul_add(s as f32, acc)
}

/// Bytes of one 256-value block of the K-quant-like types the lanes walk a block at a time.
fn block_bytes(ty: GgmlType) -> Option<usize> {
    match ty {
        GgmlType::Q4K => Some(144),
        GgmlType::Q6K => Some(210),
        GgmlType::Iq3S => Some(110),
        _ => None,
    }
}

/// Lane l's part of block b of `row` (Q4_K, Q6_K or IQ3_S) . activation t, added to acc.
fn block_lane(ty: GgmlType, row: &[u8], l: usize, b: usize, a: &Act, t: usize, acc: f32) -> f32 {
    match ty {
        GgmlType::Q4K => q4k_lane(row, l, b, a, t, acc),
        GgmlType::Q6K => q6k_lane(row, l, b, a, t, acc),
        GgmlType::Iq3S => iq3s_lane(row, l, b, a, t, acc),
        _ => unreachable!("{ty} has no 256-value lane mapping"),
    }
}

/// A weight matrix: its device layout and the reference's dequantized rows.
struct W {
    ty: GgmlType,
    dev: Vec<u8>,
    deq: Vec<f32>,
    rows: usize,
    cols: usize,
}

impl W {
    /// Random weights of `ty`: quantized from uniform values, or (IQ3_S, which has no
    /// quantizer) random valid blocks of about the same root mean square.
    fn new(seed: &mut u64, ty: GgmlType, rows: usize, cols: usize) -> Self {
        let mut gguf = Vec::new();
        if ty == GgmlType::Iq3S {
            gguf.resize(rows * cols / 256 * 110, 0);
            let mut next = || {
                rnd(seed);
                *seed
            };
            random_row(ty, 0.58, &mut next, &mut gguf).unwrap();
        } else {
            let vals: Vec<f32> = (0..rows * cols).map(|_| rnd(seed)).collect();
            for r in vals.chunks(cols) {
                quantize_row(ty, r, &mut gguf).unwrap();
            }
        }
        let rb = gguf.len() / rows;
        let mut deq = vec![0f32; rows * cols];
        for (r, out) in deq.chunks_mut(cols).enumerate() {
            dequantize_row(ty, &gguf[r * rb..(r + 1) * rb], out).unwrap();
        }
        let mut dev = vec![0u8; gguf.len()];
        to_device(ty, &gguf, 1, rows, cols, &mut dev).unwrap();
        Self {
            ty,
            dev,
            deq,
            rows,
            cols,
        }
    }

    /// acc + the lane's part of row r . activation t over the columns [c0, c1) (qa_row).
    fn lane(
        &self,
        r: usize,
        lane: usize,
        (c0, c1): (usize, usize),
        a: &Act,
        t: usize,
        acc: f32,
    ) -> f32 {
        let mut acc = acc;
        if let Some(bb) = block_bytes(self.ty) {
            let nb = self.cols / 256;
            let row = &self.dev[r * nb * bb..(r + 1) * nb * bb];
            for b in c0 / 256..c1 / 256 {
                acc = block_lane(self.ty, row, lane, b, a, t, acc);
            }
            return acc;
        }
        let wq = &self.dev[r * self.cols..(r + 1) * self.cols];
        let scales = &self.dev[self.rows * self.cols + 2 * r * (self.cols / 32)..];
        let mut i0 = c0 + lane * 16;
        while i0 < c1 {
            let dw = h2f(&scales[2 * (i0 / 32)..]);
            acc = q8_piece(wq, dw, a, t, i0, acc);
            i0 += WARP * 16;
        }
        acc
    }

    /// qa_mv_body's output for row r, token t: the warp's lanes summed.
    fn row(&self, r: usize, a: &Act, t: usize) -> f32 {
        warp_sum(std::array::from_fn(|lane| {
            self.lane(r, lane, (0, self.cols), a, t, 0.0)
        }))
    }

    /// qa_mv_staged's output for row r, token t of `n` tokens (`a` whole rows): each chunk
    /// of STAGE_COLS columns staged, each lane's sum carried over the chunks.
    fn row_staged(&self, r: usize, a: &Act, n: usize, t: usize) -> f32 {
        let kcs = super::STAGE_COLS;
        let mut acc = [0f32; WARP];
        for c0 in (0..self.cols).step_by(kcs) {
            let kc = kcs.min(self.cols - c0);
            let st = stage(a, n, c0, kc);
            for (lane, v) in acc.iter_mut().enumerate() {
                *v = self.lane(r, lane, (c0, c0 + kc), &st, t, *v);
            }
        }
        warp_sum(acc)
    }
}

fn rnd(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
}

/// f64 dot, and the sum of |terms| (the scale the tight bound is relative to).
fn dot(w: &[f32], x: &[f32]) -> (f64, f64) {
    w.iter().zip(x).fold((0.0, 0.0), |(s, a), (w, x)| {
        let p = *w as f64 * *x as f64;
        (s + p, a + p.abs())
    })
}

/// The bound of the quantization alone: each input moves by at most half a step, d / 2 =
/// amax / 254 of its block, so |W.q8a(x) - W.x| <= sum over blocks of (amax_b / 254) *
/// sum_{i in b} |w_i|.
fn quant_bound(w: &[f32], x: &[f32]) -> f64 {
    w.chunks(32)
        .zip(x.chunks(32))
        .map(|(wb, xb)| {
            let amax = xb.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
            amax / 254.0 * wb.iter().map(|v| v.abs() as f64).sum::<f64>()
        })
        .sum()
}

/// Inputs of `n` tokens with one outlier a block now and then (what makes per-block scales
/// matter) and an all-zero block.
fn inputs(seed: &mut u64, n: usize, cols: usize) -> Vec<f32> {
    let mut x: Vec<f32> = (0..n * cols).map(|_| rnd(seed)).collect();
    for (i, v) in x.iter_mut().enumerate() {
        if i % 97 == 5 {
            *v *= 9.0;
        }
    }
    x[..32].fill(0.0);
    x
}

/// Checks one emulated output against both references.
fn check(what: &str, got: f32, w: &[f32], x: &[f32], xv: &[f32]) {
    let (want_q, scale) = dot(w, xv);
    let tight = 1e-5 * scale.max(1e-30);
    assert!(
        (got as f64 - want_q).abs() <= tight,
        "{what}: {got} against W.q8a(x) = {want_q} (bound {tight:e})"
    );
    let (want, _) = dot(w, x);
    let loose = quant_bound(w, x) * 1.0001 + tight;
    assert!(
        (got as f64 - want).abs() <= loose,
        "{what}: {got} against W.x = {want} (quantization bound {loose:e})"
    );
}

#[test]
fn quantization_rounds_half_away_and_keeps_zero_blocks() {
    let mut x = vec![0f32; 64];
    x[32] = 127.0;
    x[33] = 0.5;
    x[34] = -1.5;
    x[35] = -127.0;
    let h = quantize_q8a(&x);
    assert_eq!(h.ds[0], [0.0, 0.0]);
    assert!(h.q[..32].iter().all(|&q| q == 0));
    assert_eq!(&h.q[32..36], &[127, 1, -2, -127]);
    assert_eq!(h.ds[1], [1.0, -1.0]);
    assert_eq!(h.values()[34], -2.0);
}

#[test]
fn emulated_matvec_lanes_compute_the_quantized_products() {
    let mut seed = 11u64;
    for (ty, rows, cols) in [
        (GgmlType::Q8_0, 9, 96),
        (GgmlType::Q8_0, 5, 2048),
        (GgmlType::Q4K, 7, 256),
        (GgmlType::Q4K, 4, 2048),
        (GgmlType::Q6K, 6, 256),
        (GgmlType::Q6K, 3, 2048),
        (GgmlType::Iq3S, 5, 256),
        (GgmlType::Iq3S, 7, 2048),
        (GgmlType::Iq3S, 3, 512),
    ] {
        let w = W::new(&mut seed, ty, rows, cols);
        for n in [1, 3, 16] {
            let x = inputs(&mut seed, n, cols);
            let a = act(&x, cols);
            let xv = quantize_q8a(&x).values();
            for t in 0..n {
                for r in 0..rows {
                    let got = w.row(r, &a, t);
                    let wr = &w.deq[r * cols..(r + 1) * cols];
                    let (xt, xvt) = (&x[t * cols..(t + 1) * cols], &xv[t * cols..(t + 1) * cols]);
                    check(
                        &format!("{ty} {rows}x{cols} n {n} t {t} r {r}"),
                        got,
                        wr,
                        xt,
                        xvt,
                    );
                }
            }
        }
    }
}

/// qa_mv_staged (the multi-token products, 2..16 tokens, their q8a rows staged in shared
/// memory a chunk of STAGE_COLS columns at a time): each output equal to the unstaged loop's
/// bit for bit (the chunks keep each lane's order) and within both bounds, over one chunk, a
/// chunk and a part, and two chunks.
#[test]
fn emulated_staged_rows_equal_the_unstaged_products() {
    let kc = super::STAGE_COLS;
    let mut seed = 23u64;
    for (ty, rows, cols) in [
        (GgmlType::Q8_0, 5, 96),
        (GgmlType::Q8_0, 3, kc + 96),
        (GgmlType::Q8_0, 3, 2 * kc),
        (GgmlType::Q4K, 3, kc + 256),
        (GgmlType::Q4K, 2, 2 * kc),
        (GgmlType::Q6K, 3, kc + 256),
        (GgmlType::Iq3S, 3, kc + 256),
        (GgmlType::Iq3S, 2, 2 * kc),
    ] {
        let w = W::new(&mut seed, ty, rows, cols);
        for n in [2, 3, 4, 8, 16] {
            let x = inputs(&mut seed, n, cols);
            let a = act(&x, cols);
            let xv = quantize_q8a(&x).values();
            for t in 0..n {
                for r in 0..rows {
                    let what = format!("{ty} {rows}x{cols} n {n} t {t} r {r}");
                    let (got, want) = (w.row_staged(r, &a, n, t), w.row(r, &a, t));
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{what}: staged {got}, unstaged {want}"
                    );
                    let wr = &w.deq[r * cols..(r + 1) * cols];
                    let (xt, xvt) = (&x[t * cols..(t + 1) * cols], &xv[t * cols..(t + 1) * cols]);
                    check(&what, got, wr, xt, xvt);
                }
            }
        }
    }
}

/// dq4_moe_gate_up (a row of gate and of up, SwiGLU; IQ3_S's qa_pair_iq3s interleaves the two
/// rows' blocks but each row's arithmetic is qa_row<1>'s, emulated by `W::row`) and dq4_moe_down (the k experts' pieces
/// over a block of 128 threads, weighted, then st_block_sum) for one token: k experts of
/// `ty`, gate and up f x e, down e x f, with the routing weights `wts`; every gate/up row and
/// every `down_step`-th down row checked.
fn moe_case(seed: &mut u64, ty: GgmlType, (e, f): (usize, usize), wts: &[f32], down_step: usize) {
    let k = wts.len();
    let silu = |v: f64| v / (1.0 + (-v).exp());
    let gate: Vec<W> = (0..k).map(|_| W::new(seed, ty, f, e)).collect();
    let up: Vec<W> = (0..k).map(|_| W::new(seed, ty, f, e)).collect();
    let down: Vec<W> = (0..k).map(|_| W::new(seed, ty, e, f)).collect();
    let x = inputs(seed, 1, e);
    let a = act(&x, e);
    let xv = quantize_q8a(&x).values();
    // Gate/up: h[j][r], checked against silu(g) u of the quantized input in f64.
    let mut h = vec![0f32; k * f];
    for j in 0..k {
        for r in 0..f {
            let (g, u) = (gate[j].row(r, &a, 0), up[j].row(r, &a, 0));
            let gs = g / (1.0 + (-g).exp());
            h[j * f + r] = gs * u;
            let (gw, uw) = (
                &gate[j].deq[r * e..(r + 1) * e],
                &up[j].deq[r * e..(r + 1) * e],
            );
            check(&format!("{ty} gate {j} {r}"), g, gw, &x, &xv);
            check(&format!("{ty} up {j} {r}"), u, uw, &x, &xv);
            let want = silu(dot(gw, &xv).0) * dot(uw, &xv).0;
            assert!(
                (h[j * f + r] as f64 - want).abs() <= 1e-4 * (1.0 + want.abs()),
                "{ty} h[{j}][{r}] = {} against {want}",
                h[j * f + r]
            );
        }
    }
    // Down: h quantized once (k rows of f), a block of 128 threads per output row.
    let ha = act(&h, f);
    let hv = quantize_q8a(&h).values();
    for r in (0..e).step_by(down_step) {
        let mut part = [0f32; 128];
        if let Some(bb) = block_bytes(ty) {
            let nb = f / 256;
            for (tid, p) in part.iter_mut().enumerate() {
                let (warp, l) = (tid / WARP, tid % WARP);
                let mut q = warp;
                while q < k * nb {
                    let (j, b) = (q / nb, q % nb);
                    let v = block_lane(ty, &down[j].dev[r * nb * bb..], l, b, &ha, j, 0.0);
                    *p = wts[j].mul_add(v, *p);
                    q += 128 / WARP;
                }
            }
        } else {
            let per = f / 16;
            for (tid, p) in part.iter_mut().enumerate() {
                let mut q = tid;
                while q < k * per {
                    let (j, i0) = (q / per, (q % per) * 16);
                    let dj = &down[j];
                    let dw = h2f(&dj.dev[e * f + 2 * (r * (f / 32) + i0 / 32)..]);
                    let v = q8_piece(&dj.dev[r * f..], dw, &ha, j, i0, 0.0);
                    *p = wts[j].mul_add(v, *p);
                    q += 128;
                }
            }
        }
        // st_block_sum: each warp's butterfly, then the warps' sums by one warp.
        let sums: Vec<f32> = part
            .chunks(WARP)
            .map(|c| warp_sum(c.try_into().unwrap()))
            .collect();
        let got = warp_sum(std::array::from_fn(|i| sums.get(i).copied().unwrap_or(0.0)));
        let (mut want_q, mut want, mut scale, mut qb) = (0f64, 0f64, 0f64, 0f64);
        for j in 0..k {
            let dr = &down[j].deq[r * f..(r + 1) * f];
            let (hj, hvj) = (&h[j * f..(j + 1) * f], &hv[j * f..(j + 1) * f]);
            let (dq, sc) = dot(dr, hvj);
            want_q += wts[j] as f64 * dq;
            scale += wts[j] as f64 * sc;
            want += wts[j] as f64 * dot(dr, hj).0;
            qb += wts[j] as f64 * quant_bound(dr, hj);
        }
        let tight = 1e-5 * scale;
        assert!(
            (got as f64 - want_q).abs() <= tight,
            "{ty} down row {r}: {got} against {want_q} (bound {tight:e})"
        );
        assert!(
            (got as f64 - want).abs() <= qb * 1.0001 + tight,
            "{ty} down row {r}: {got} against the f32 input's {want} (bound {qb:e})"
        );
    }
}

#[test]
fn emulated_moe_products_compute_the_quantized_products() {
    let mut seed = 5u64;
    for ty in [GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K, GgmlType::Iq3S] {
        moe_case(&mut seed, ty, (512, 256), &[0.5, 0.3, 0.2], 37);
    }
}

/// Qwen3-Next-80B-A3B's routed experts at IQ3_S (the file users run): hidden width 2048,
/// expert width 512, top-10 (its weights summing to 1), every down row.
#[test]
fn emulated_iq3_s_moe_products_at_the_80b_shapes() {
    let mut seed = 80u64;
    let wts: Vec<f32> = (0..10).map(|j| (10 - j) as f32 / 55.0).collect();
    moe_case(&mut seed, GgmlType::Iq3S, (2048, 512), &wts, 1);
}

/// IQ3_S's branch-free signs: every grid byte is odd and in 1..=15 (so negating a byte never
/// carries into the next), and qa_signed4 equals the reference's per-byte sign for every
/// grid row and every nibble of sign bits.
#[test]
fn iq3_s_signs_negate_each_grid_byte_without_carries() {
    for (i, &g) in IQ3S_GRID.iter().enumerate() {
        for j in 0..4 {
            let v = (g >> (8 * j)) & 0xFF;
            assert!(v % 2 == 1 && v <= 15, "IQ3S_GRID[{i}] byte {j} = {v}");
        }
        for bits in 0..16u32 {
            let got = signed4(g, bits);
            for j in 0..4 {
                let want = ((g >> (8 * j)) & 0xFF) as i32 * if bits >> j & 1 == 1 { -1 } else { 1 };
                assert_eq!(
                    (got >> (8 * j)) as u8 as i8 as i32,
                    want,
                    "grid {i} bits {bits:04b} byte {j}"
                );
            }
        }
    }
}
