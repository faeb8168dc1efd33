//! The K-quants: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (256-element super-blocks, ggml-common.h's
//! `block_q*_K`): block decoders, and ggml's reference quantizers for Q4_K, Q5_K and Q6_K
//! (`make_qkx2_quants` / `make_qx_quants` scale searches, no importance matrix).
//! Invariant: every function takes exactly one super-block; the decoders compute each value
//! with the same f32 operations in the same order as gguf-py's `dequantize` (bit-identical).

// Loops index by element number on purpose: the index arithmetic is the bit layout.
#![allow(clippy::needless_range_loop)]

use super::{rd_f16, wr_f16};

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` (0..8) of a Q4_K or
/// Q5_K block's 12 scale bytes.
#[inline]
pub fn get_scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The 2-bit field of element `e` (0..256) in 64 bytes of crumbs laid out as Q2_K/Q3_K's
/// `qs`: two halves of 128 elements, each 32 bytes holding four 32-element rows by shift.
#[inline(always)]
fn crumb(qs: &[u8], e: usize) -> u8 {
    let (h, s, l) = (e / 128, (e % 128) / 32, e % 32);
    (qs[32 * h + l] >> (2 * s)) & 3
}

/// Q2_K (84 bytes): 16 bytes of (4-bit scale, 4-bit min) per 16 elements, 64 bytes of 2-bit
/// quants, f16 d, f16 dmin; x = d * sc * q - dmin * m.
pub(super) fn dequant_q2_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (rd_f16(b, 80), rd_f16(b, 82));
    for s in 0..16 {
        let sc = b[s];
        let dl = d * (sc & 0xF) as f32;
        let ml = dmin * (sc >> 4) as f32;
        for e in 16 * s..16 * s + 16 {
            out[e] = dl * crumb(&b[16..80], e) as f32 - ml;
        }
    }
}

/// Q3_K's 16 signed 6-bit scales from its 12 scale bytes.
fn q3_k_scales(sc: &[u8]) -> [i8; 16] {
    std::array::from_fn(|k| {
        let lo = (sc[k % 8] >> (4 * (k / 8))) & 0xF;
        let hi = (sc[8 + k % 4] >> (2 * (k / 4))) & 3;
        ((lo | (hi << 4)) as i8).wrapping_sub(32)
    })
}

/// Q3_K (110 bytes): 32 bytes of high-bit masks, 64 bytes of 2-bit quants, 12 bytes of 6-bit
/// scales, f16 d; x = d * (scale - 32) * (q - (mask bit clear ? 4 : 0)).
pub(super) fn dequant_q3_k(b: &[u8], out: &mut [f32]) {
    let d = rd_f16(b, 108);
    let scales = q3_k_scales(&b[96..108]);
    let (hmask, qs) = (&b[0..32], &b[32..96]);
    for s in 0..16 {
        let dl = d * scales[s] as f32;
        for e in 16 * s..16 * s + 16 {
            let hbit = (hmask[e % 32] >> (e / 32)) & 1;
            let q = crumb(qs, e) as i32 - if hbit == 0 { 4 } else { 0 };
            out[e] = dl * q as f32;
        }
    }
}

/// Q4_K (144 bytes): f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
/// (four 64-element groups: low nibbles the first 32, high nibbles the next 32).
pub(super) fn dequant_q4_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (rd_f16(b, 0), rd_f16(b, 2));
    for j in 0..8 {
        let (sc, m) = get_scale_min_k4(j, &b[4..16]);
        let (dl, ml) = (d * sc as f32, dmin * m as f32);
        let q = &b[16 + 32 * (j / 2)..48 + 32 * (j / 2)];
        let shift = 4 * (j % 2);
        for l in 0..32 {
            out[32 * j + l] = dl * ((q[l] >> shift) & 0xF) as f32 - ml;
        }
    }
}

/// Q5_K (176 bytes): Q4_K's header, 32 bytes of fifth bits (bit j/32 of byte j%32), 128 bytes
/// of nibbles in Q4_K's order.
pub(super) fn dequant_q5_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (rd_f16(b, 0), rd_f16(b, 2));
    let (qh, qs) = (&b[16..48], &b[48..176]);
    for j in 0..8 {
        let (sc, m) = get_scale_min_k4(j, &b[4..16]);
        let (dl, ml) = (d * sc as f32, dmin * m as f32);
        let q = &qs[32 * (j / 2)..32 * (j / 2) + 32];
        let shift = 4 * (j % 2);
        for l in 0..32 {
            let v = ((q[l] >> shift) & 0xF) | (((qh[l] >> j) & 1) << 4);
            out[32 * j + l] = dl * v as f32 - ml;
        }
    }
}

/// Q6_K (210 bytes): 128 bytes of low nibbles, 64 bytes of high crumbs, 16 signed 8-bit
/// scales, f16 d; x = d * scale * (q - 32).
pub(super) fn dequant_q6_k(b: &[u8], out: &mut [f32]) {
    let d = rd_f16(b, 208);
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    for s in 0..16 {
        let dl = d * (sc[s] as i8) as f32;
        for e in 16 * s..16 * s + 16 {
            let (h, r) = (e / 128, e % 128);
            let lo = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0xF;
            let hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
            out[e] = dl * ((lo | (hi << 4)) as i32 - 32) as f32;
        }
    }
}

/// ggml's `nearest_int`: round half to even.
#[inline]
pub(super) fn nearest_int(v: f32) -> i32 {
    v.round_ties_even() as i32
}

/// ggml's `make_qkx2_quants`: fit `x ≈ scale * L - min` with `L` in 0..=nmax, weighted least
/// squares over a small grid of trial scales. Returns (scale, min) with min >= 0.
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l_out: &mut [u8],
    l_aux: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        min = min.min(x[i]);
        max = max.max(x[i]);
        sum_w += weights[i];
        sum_x += weights[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l_out[..n].fill(0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l_out[i] = l as u8;
        let diff = scale * l as f32 + min - x[i];
        best_error += weights[i] * diff * diff;
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            l_aux[i] = l as u8;
            let w = weights[i];
            let lf = l as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                let diff = this_scale * l_aux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * diff * diff;
            }
            if cur_error < best_error {
                l_out[..n].copy_from_slice(&l_aux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// The shared half of ggml's reference Q4_K / Q5_K quantizers: fit each 32-element sub-block
/// with `make_qkx2_quants` (levels 0..=nmax), quantize the eight scales and mins to 6 bits
/// against f16 `d` / `dmin`, write the header (d, dmin, 12 scale bytes) into `head`, and
/// return each element's level recomputed against the stored scales.
fn fit_scale_min_blocks(
    x: &[f32],
    nmax: i32,
    rmin: f32,
    nstep: i32,
    head: &mut [u8],
) -> [u8; QK_K] {
    let mut l = [0u8; QK_K];
    let mut l_aux = [0u8; 32];
    let mut weights = [0f32; 32];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let mut max_scale = 0f32;
    let mut max_min = 0f32;
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let sum_x2: f32 = xs.iter().map(|v| v * v).sum();
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        let (s, m) = make_qkx2_quants(
            nmax,
            xs,
            &weights,
            &mut l[32 * j..32 * j + 32],
            &mut l_aux,
            rmin,
            0.1,
            nstep,
        );
        scales[j] = s;
        mins[j] = m;
        max_scale = max_scale.max(s);
        max_min = max_min.max(m);
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let sc = &mut head[4..16];
    sc.fill(0);
    for j in 0..8 {
        let ls = nearest_int(inv_scale * scales[j]).clamp(0, 63) as u8;
        let lm = nearest_int(inv_min * mins[j]).clamp(0, 63) as u8;
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    let d = wr_f16(head, 0, max_scale / 63.0);
    let dmin = wr_f16(head, 2, max_min / 63.0);
    for j in 0..8 {
        let (s, m) = get_scale_min_k4(j, &head[4..16]);
        let dj = d * s as f32;
        if dj == 0.0 {
            continue;
        }
        let dm = dmin * m as f32;
        for ii in 0..32 {
            l[32 * j + ii] = nearest_int((x[32 * j + ii] + dm) / dj).clamp(0, nmax) as u8;
        }
    }
    l
}

/// ggml's reference Q4_K for one 256-element block.
pub(super) fn quantize_q4_k(x: &[f32], out: &mut [u8]) {
    let l = fit_scale_min_blocks(x, 15, -1.0, 20, out);
    let qs = &mut out[16..144];
    for g in 0..4 {
        for k in 0..32 {
            qs[32 * g + k] = l[64 * g + k] | (l[64 * g + 32 + k] << 4);
        }
    }
}

/// ggml's reference Q5_K for one 256-element block.
pub(super) fn quantize_q5_k(x: &[f32], out: &mut [u8]) {
    let l = fit_scale_min_blocks(x, 31, -0.5, 15, out);
    let (qh, qs) = out[16..176].split_at_mut(32);
    qh.fill(0);
    for g in 0..4 {
        for k in 0..32 {
            let (a, b) = (l[64 * g + k], l[64 * g + 32 + k]);
            qs[32 * g + k] = (a & 0xF) | ((b & 0xF) << 4);
            qh[k] |= ((a >> 4) << (2 * g)) | ((b >> 4) << (2 * g + 1));
        }
    }
}

/// ggml's `make_qx_quants` with `rmse_type` 1 and no importance: a symmetric scale for levels
/// -nmax..nmax-1 (stored in `l` offset by nmax), refined over 18 trial scales by weighted
/// (x^2) least squares. Returns the scale (0 for an all-zero group).
fn make_qx_quants(nmax: i32, x: &[f32], l: &mut [u8]) -> f32 {
    let mut max = 0f32;
    let mut amax = 0f32;
    for v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = *v;
        }
    }
    if amax < 1e-15 {
        l.fill(0);
        return 0.0;
    }
    let level = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let fit = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for v in x {
            let q = level(iscale, *v) as f32;
            let w = v * v;
            sumlx += w * v * q;
            suml2 += w * q * q;
        }
        (sumlx, suml2)
    };
    let mut iscale = -(nmax as f32) / max;
    let (sumlx, suml2) = fit(iscale);
    let mut scale = if suml2 > 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        let trial = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = fit(trial);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            iscale = trial;
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    for (o, v) in l.iter_mut().zip(x) {
        *o = (level(iscale, *v) + nmax) as u8;
    }
    scale
}

/// ggml's reference Q6_K for one 256-element block: a `make_qx_quants` scale per 16 elements,
/// the sixteen scales quantized to i8 against f16 d, levels recomputed against them.
pub(super) fn quantize_q6_k(x: &[f32], out: &mut [u8]) {
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; 16];
    let (mut max_scale, mut max_abs) = (0f32, 0f32);
    for s in 0..16 {
        let sc = make_qx_quants(32, &x[16 * s..16 * s + 16], &mut l[16 * s..16 * s + 16]);
        scales[s] = sc;
        if sc.abs() > max_abs {
            max_abs = sc.abs();
            max_scale = sc;
        }
    }
    out.fill(0);
    if max_abs < 1e-15 {
        return;
    }
    let iscale = -128.0 / max_scale;
    let d = wr_f16(out, 208, 1.0 / iscale);
    for s in 0..16 {
        let q = nearest_int(iscale * scales[s]).min(127) as i8;
        out[192 + s] = q as u8;
        let ds = d * q as f32;
        if ds == 0.0 {
            continue;
        }
        for e in 16 * s..16 * s + 16 {
            l[e] = (nearest_int(x[e] / ds).clamp(-32, 31) + 32) as u8;
        }
    }
    let (ql, rest) = out.split_at_mut(128);
    let qh = &mut rest[..64];
    for h in 0..2 {
        let (lb, ql, qh) = (&l[128 * h..], &mut ql[64 * h..], &mut qh[32 * h..]);
        for k in 0..32 {
            let (a, b, c, e) = (lb[k], lb[k + 32], lb[k + 64], lb[k + 96]);
            ql[k] = (a & 0xF) | ((c & 0xF) << 4);
            ql[k + 32] = (b & 0xF) | ((e & 0xF) << 4);
            qh[k] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6);
        }
    }
}
