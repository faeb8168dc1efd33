//! The 32-element "legacy" block types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (ggml-common.h's
//! `block_q*`), their block decoders and ggml's reference quantizers for each.
//! Invariant: every function takes exactly one block (`QK` values, the type's block bytes);
//! the decoders compute each value with the same f32 operations in the same order as gguf-py's
//! `dequantize`, so results are bit-identical to it.

// Loops index by element number on purpose: the index arithmetic is the bit layout.
#![allow(clippy::needless_range_loop)]

use super::{rd_f16, wr_f16};

/// Elements per legacy block.
pub const QK: usize = 32;

/// The 4-bit value `j` (0..32) of a block's 16 packed bytes: element j < 16 in the low nibble
/// of byte j, element j + 16 in the high nibble.
#[inline(always)]
pub(super) fn nibble(qs: &[u8], j: usize) -> u8 {
    (qs[j % 16] >> (4 * (j / 16))) & 0xF
}

/// The fifth bit of element `j` from the 32-bit `qh` word.
#[inline(always)]
fn high_bit(qh: u32, j: usize) -> u8 {
    ((qh >> j) & 1) as u8
}

/// Q4_0 (18 bytes): f16 d, 16 bytes of nibbles; x = d * (q - 8).
pub(super) fn dequant_q4_0(b: &[u8], out: &mut [f32]) {
    let d = rd_f16(b, 0);
    for (j, o) in out[..QK].iter_mut().enumerate() {
        *o = d * (nibble(&b[2..], j) as i32 - 8) as f32;
    }
}

/// Q4_1 (20 bytes): f16 d, f16 m, 16 bytes of nibbles; x = d * q + m.
pub(super) fn dequant_q4_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (rd_f16(b, 0), rd_f16(b, 2));
    for (j, o) in out[..QK].iter_mut().enumerate() {
        *o = d * nibble(&b[4..], j) as f32 + m;
    }
}

/// Q5_0 (22 bytes): f16 d, u32 of fifth bits, 16 bytes of nibbles; x = d * (q - 16).
pub(super) fn dequant_q5_0(b: &[u8], out: &mut [f32]) {
    let d = rd_f16(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for (j, o) in out[..QK].iter_mut().enumerate() {
        let q = nibble(&b[6..], j) | (high_bit(qh, j) << 4);
        *o = d * (q as i32 - 16) as f32;
    }
}

/// Q5_1 (24 bytes): f16 d, f16 m, u32 of fifth bits, 16 bytes of nibbles; x = d * q + m.
pub(super) fn dequant_q5_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (rd_f16(b, 0), rd_f16(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for (j, o) in out[..QK].iter_mut().enumerate() {
        let q = nibble(&b[8..], j) | (high_bit(qh, j) << 4);
        *o = d * q as f32 + m;
    }
}

/// Q8_0 (34 bytes): f16 d, 32 signed bytes; x = d * q.
pub(super) fn dequant_q8_0(b: &[u8], out: &mut [f32]) {
    let d = rd_f16(b, 0);
    for (j, o) in out[..QK].iter_mut().enumerate() {
        *o = d * (b[2 + j] as i8) as f32;
    }
}

/// The value of largest magnitude (the first one on ties), with its sign.
fn signed_absmax(x: &[f32]) -> f32 {
    let mut best = 0f32;
    for v in x {
        if v.abs() > best.abs() {
            best = *v;
        }
    }
    best
}

/// Packs 32 values of up to 5 bits: nibbles into `qs` (16 bytes), fifth bits into the
/// returned word.
fn pack_5(q: &[u8; QK], qs: &mut [u8]) -> u32 {
    let mut qh = 0u32;
    for j in 0..16 {
        qs[j] = (q[j] & 0xF) | ((q[j + 16] & 0xF) << 4);
    }
    for (j, v) in q.iter().enumerate() {
        qh |= u32::from(v >> 4) << j;
    }
    qh
}

/// ggml's reference Q4_0: d = (value of largest magnitude) / -8, q = trunc(x / d + 8.5)
/// clamped to 15.
pub(super) fn quantize_q4_0(x: &[f32], out: &mut [u8]) {
    let d = signed_absmax(x) / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    wr_f16(out, 0, d);
    let q: [u8; QK] = std::array::from_fn(|j| ((x[j] * id + 8.5) as i32).clamp(0, 15) as u8);
    for j in 0..16 {
        out[2 + j] = q[j] | (q[j + 16] << 4);
    }
}

/// The Q4_1 / Q5_1 fit: d = (max - min) / nmax and m = min written as f16 at bytes 0 and 2,
/// q = trunc((x - min) / d + 0.5) clamped to nmax.
fn min_scaled(x: &[f32], nmax: i32, out: &mut [u8]) -> [u8; QK] {
    let min = x.iter().fold(f32::INFINITY, |m, v| m.min(*v));
    let max = x.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
    let d = (max - min) / nmax as f32;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    wr_f16(out, 0, d);
    wr_f16(out, 2, min);
    std::array::from_fn(|j| (((x[j] - min) * id + 0.5) as i32).clamp(0, nmax) as u8)
}

/// ggml's reference Q4_1: d = (max - min) / 15, m = min, q = trunc((x - min) / d + 0.5).
pub(super) fn quantize_q4_1(x: &[f32], out: &mut [u8]) {
    let q = min_scaled(x, 15, out);
    for j in 0..16 {
        out[4 + j] = q[j] | (q[j + 16] << 4);
    }
}

/// ggml's reference Q5_0: d = (value of largest magnitude) / -16, q = trunc(x / d + 16.5)
/// clamped to 31.
pub(super) fn quantize_q5_0(x: &[f32], out: &mut [u8]) {
    let d = signed_absmax(x) / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    wr_f16(out, 0, d);
    let q: [u8; QK] = std::array::from_fn(|j| ((x[j] * id + 16.5) as i32).clamp(0, 31) as u8);
    let qh = pack_5(&q, &mut out[6..22]);
    out[2..6].copy_from_slice(&qh.to_le_bytes());
}

/// ggml's reference Q5_1: d = (max - min) / 31, m = min, q = trunc((x - min) / d + 0.5).
pub(super) fn quantize_q5_1(x: &[f32], out: &mut [u8]) {
    let q = min_scaled(x, 31, out);
    let qh = pack_5(&q, &mut out[8..24]);
    out[4..8].copy_from_slice(&qh.to_le_bytes());
}

/// ggml's reference Q8_0: d = max|x| / 127 stored as f16, q = round(x / d) (ties away from 0).
pub(super) fn quantize_q8_0(x: &[f32], out: &mut [u8]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    wr_f16(out, 0, d);
    for (j, v) in x.iter().enumerate() {
        out[2 + j] = round_away(v * id).clamp(-128, 127) as i8 as u8;
    }
}

/// `roundf` (ties away from zero) without the libm call `f32::round` compiles to on baseline
/// x86-64: truncate, then step by one when the exact remainder is at least a half. NaN -> 0.
#[inline]
pub(super) fn round_away(v: f32) -> i32 {
    let t = v as i32;
    let f = v - t as f32;
    if f >= 0.5 {
        t.saturating_add(1)
    } else if f <= -0.5 {
        t.saturating_sub(1)
    } else {
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_away_is_roundf() {
        for v in [
            0.0f32,
            0.5,
            -0.5,
            1.5,
            -1.5,
            2.5,
            0.49999997,
            -0.49999997,
            126.5,
            -127.5,
            3.7,
            -3.7,
            1e-8,
            8388607.5,
            f32::NAN,
        ] {
            assert_eq!(round_away(v), v.round() as i32, "{v}");
        }
        assert_eq!(round_away(f32::INFINITY), i32::MAX);
    }

    #[test]
    fn q4_0_and_q5_0_hand_derived_blocks() {
        // Largest magnitude -8 -> d = 1; q = trunc(x + 8.5) so 0.5 -> 9, -8 -> 0, 7 -> 15.
        let mut x = [0f32; 32];
        x[0] = -8.0;
        x[1] = 0.5;
        x[17] = 7.0;
        let mut b = [0u8; 18];
        quantize_q4_0(&x, &mut b);
        assert_eq!(&b[..2], &[0x00, 0x3C]);
        assert_eq!(b[2], 0x80, "element 0 -> 0, element 16 -> 8");
        assert_eq!(b[3], 0xF9, "element 1 -> 9, element 17 -> 15");
        let mut y = [0f32; 32];
        dequant_q4_0(&b, &mut y);
        assert_eq!((y[0], y[1], y[17], y[5]), (-8.0, 1.0, 7.0, 0.0));
        // Q5_0: largest magnitude -16 -> d = 1; element 20 = 5 -> q 21 (fifth bit set).
        let mut x = [0f32; 32];
        x[3] = -16.0;
        x[20] = 5.0;
        let mut b = [0u8; 22];
        quantize_q5_0(&x, &mut b);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        assert_eq!(qh & (1 << 3), 0, "q = 0 for -16");
        assert_ne!(qh & (1 << 20), 0, "q = 21 for 5");
        dequant_q5_0(&b, &mut y);
        assert_eq!((y[3], y[20], y[0]), (-16.0, 5.0, 0.0));
    }
}
