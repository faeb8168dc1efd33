//! The i-quants: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (lattice codebooks from
//! the generated `tables`), IQ4_NL, IQ4_XS (non-linear 4-bit values), and MXFP4 (e2m1 values
//! with a shared power-of-two scale): block decoders, and a reference MXFP4 quantizer.
//! Invariant: every function takes exactly one block; the decoders compute each value with the
//! same f32 operations in the same order as gguf-py's `dequantize` (bit-identical). Any bytes
//! decode to finite values when the f16 scales are finite: every index field is as wide as its
//! table.

// Loops index by element number on purpose: the index arithmetic is the bit layout.
#![allow(clippy::needless_range_loop)]

use super::tables::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS,
    KVALUES_IQ4NL, KVALUES_MXFP4,
};
use super::{legacy::nibble, rd_f16, wr_f16};

/// Byte `j` of a packed grid row.
#[inline(always)]
fn grid_byte(row: u64, j: usize) -> u8 {
    (row >> (8 * j)) as u8
}

/// `sign bit j set ? -1 : 1`.
#[inline(always)]
fn sign(bits: u8, j: usize) -> f32 {
    if bits & (1 << j) != 0 {
        -1.0
    } else {
        1.0
    }
}

#[inline(always)]
fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

#[inline(always)]
fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

/// Eight values `db * grid[j] * sign_j` of one 8-wide grid row.
#[inline(always)]
fn put8(out: &mut [f32], db: f32, row: u64, signs: u8) {
    for (j, o) in out[..8].iter_mut().enumerate() {
        *o = db * grid_byte(row, j) as f32 * sign(signs, j);
    }
}

/// IQ2_XXS (66 bytes): f16 d, then per 32 elements two u32: four grid indices (bytes), and
/// four 7-bit sign indices plus a 4-bit scale in the top bits.
pub(super) fn dequant_iq2_xxs(b: &[u8], out: &mut [f32]) {
    let d = rd_f16(b, 0);
    for ib in 0..8 {
        let aux1 = u32_at(b, 2 + 8 * ib + 4);
        let db = d * (0.5 + (aux1 >> 28) as f32) * 0.25;
        for l in 0..4 {
            let row = IQ2XXS_GRID[b[2 + 8 * ib + l] as usize];
            let signs = KSIGNS_IQ2XS[((aux1 >> (7 * l)) & 127) as usize];
            put8(&mut out[32 * ib + 8 * l..], db, row, signs);
        }
    }
}

/// The 4-bit scale `s` of the nibble-packed scale bytes IQ2_XS / IQ2_S / IQ3_S use.
#[inline(always)]
fn nib_scale(scales: &[u8], s: usize) -> u8 {
    (scales[s / 2] >> (4 * (s % 2))) & 0xF
}

/// IQ2_XS (74 bytes): f16 d, 32 u16 (9-bit grid index, 7-bit sign index), 8 bytes of 4-bit
/// scales (one per 16 elements).
pub(super) fn dequant_iq2_xs(b: &[u8], out: &mut [f32]) {
    let d = rd_f16(b, 0);
    for k in 0..32 {
        let q = u16_at(b, 2 + 2 * k);
        let db = d * (0.5 + nib_scale(&b[66..74], k / 2) as f32) * 0.25;
        let row = IQ2XS_GRID[(q & 511) as usize];
        put8(&mut out[8 * k..], db, row, KSIGNS_IQ2XS[(q >> 9) as usize]);
    }
}

/// IQ2_S (82 bytes): f16 d, 32 bytes of grid index low bits, 32 bytes of explicit signs,
/// 8 bytes of index high bits (2 per index), 8 bytes of 4-bit scales.
pub(super) fn dequant_iq2_s(b: &[u8], out: &mut [f32]) {
    let d = rd_f16(b, 0);
    let (qs, signs, qh, scales) = (&b[2..34], &b[34..66], &b[66..74], &b[74..82]);
    for k in 0..32 {
        let idx = qs[k] as usize | ((((qh[k / 4] >> (2 * (k % 4))) & 3) as usize) << 8);
        let db = d * (0.5 + nib_scale(scales, k / 2) as f32) * 0.25;
        put8(&mut out[8 * k..], db, IQ2S_GRID[idx], signs[k]);
    }
}

/// IQ3_XXS (98 bytes): f16 d, 64 grid indices (4-wide rows), then per 32 elements a u32 of
/// four 7-bit sign indices and a 4-bit scale.
pub(super) fn dequant_iq3_xxs(b: &[u8], out: &mut [f32]) {
    let d = rd_f16(b, 0);
    for ib in 0..8 {
        let aux = u32_at(b, 66 + 4 * ib);
        let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
        for l in 0..4 {
            let signs = KSIGNS_IQ2XS[((aux >> (7 * l)) & 127) as usize];
            let row = u64::from(IQ3XXS_GRID[b[2 + 8 * ib + 2 * l] as usize])
                | (u64::from(IQ3XXS_GRID[b[2 + 8 * ib + 2 * l + 1] as usize]) << 32);
            put8(&mut out[32 * ib + 8 * l..], db, row, signs);
        }
    }
}

/// IQ3_S (110 bytes): f16 d, 64 bytes of grid index low bits, 8 bytes of ninth bits,
/// 32 bytes of explicit signs, 4 bytes of 4-bit scales (one per 32: d * (1 + 2 s)).
pub(super) fn dequant_iq3_s(b: &[u8], out: &mut [f32]) {
    let d = rd_f16(b, 0);
    let (qs, qh, signs, scales) = (&b[2..66], &b[66..74], &b[74..106], &b[106..110]);
    for ib in 0..8 {
        let db = d * (1 + 2 * nib_scale(scales, ib)) as f32;
        for l in 0..4 {
            let k = 8 * ib + 2 * l;
            let idx = |k: usize| qs[k] as usize | ((((qh[k / 8] >> (k % 8)) & 1) as usize) << 8);
            let row = u64::from(IQ3S_GRID[idx(k)]) | (u64::from(IQ3S_GRID[idx(k + 1)]) << 32);
            put8(&mut out[32 * ib + 8 * l..], db, row, signs[4 * ib + l]);
        }
    }
}

/// IQ1_S / IQ1_M's offset: +1/8, or -1/8 when the group's delta bit is set.
const IQ1_DELTA: f32 = 0.125;

/// Eight values `dl * (grid[j] + delta)` of one IQ1 grid row (values -1, 0, 1).
#[inline(always)]
fn put8_iq1(out: &mut [f32], dl: f32, idx: usize, delta: f32) {
    let row = IQ1S_GRID[idx];
    for (j, o) in out[..8].iter_mut().enumerate() {
        *o = dl * (grid_byte(row, j) as i8 as f32 + delta);
    }
}

/// IQ1_S (50 bytes): f16 d, 32 bytes of grid index low bits, 8 u16 (four 3-bit index high
/// parts, a 3-bit scale, a delta sign bit) per 32 elements.
pub(super) fn dequant_iq1_s(b: &[u8], out: &mut [f32]) {
    let d = rd_f16(b, 0);
    for ib in 0..8 {
        let qh = u16_at(b, 34 + 2 * ib);
        let dl = d * (2 * ((qh >> 12) & 7) + 1) as f32;
        let delta = if qh & 0x8000 != 0 {
            -IQ1_DELTA
        } else {
            IQ1_DELTA
        };
        for l in 0..4 {
            let idx = b[2 + 4 * ib + l] as usize | ((((qh >> (3 * l)) & 7) as usize) << 8);
            put8_iq1(&mut out[32 * ib + 8 * l..], dl, idx, delta);
        }
    }
}

/// IQ1_M's f16 super-block scale, spread over the top nibbles of its four scale u16s.
pub(super) fn iq1_m_d_bits(sc: &[u8]) -> u16 {
    let s = |i: usize| u16_at(sc, 2 * i);
    (s(0) >> 12) | ((s(1) >> 8) & 0x00F0) | ((s(2) >> 4) & 0x0F00) | (s(3) & 0xF000)
}

/// IQ1_M (56 bytes): 32 bytes of grid index low bits, 16 bytes of (3-bit index high part,
/// delta sign bit) nibbles, 8 bytes of 3-bit scales (one per 16 elements) around the f16 d.
pub(super) fn dequant_iq1_m(b: &[u8], out: &mut [f32]) {
    let (qs, qh, sc) = (&b[0..32], &b[32..48], &b[48..56]);
    let d = half::f16::from_bits(iq1_m_d_bits(sc)).to_f32();
    for k in 0..32 {
        let s = k / 2;
        let ls = (u16_at(sc, 2 * (s / 4)) >> (3 * (s % 4))) & 7;
        let dl = d * (2 * ls + 1) as f32;
        let h = (qh[k / 2] >> (4 * (k % 2))) & 0xF;
        let idx = qs[k] as usize | (((h & 7) as usize) << 8);
        let delta = if h & 8 != 0 { -IQ1_DELTA } else { IQ1_DELTA };
        put8_iq1(&mut out[8 * k..], dl, idx, delta);
    }
}

/// IQ4_NL (18 bytes): f16 d, 16 bytes of nibbles (Q4_0's order) indexing the value table.
pub(super) fn dequant_iq4_nl(b: &[u8], out: &mut [f32]) {
    let d = rd_f16(b, 0);
    for (j, o) in out[..32].iter_mut().enumerate() {
        *o = d * KVALUES_IQ4NL[nibble(&b[2..], j) as usize] as f32;
    }
}

/// IQ4_XS (136 bytes): f16 d, u16 of scale high bits, 4 bytes of scale low nibbles, then per
/// 32 elements 16 bytes of nibbles (Q4_0's order); x = d * (scale - 32) * value.
pub(super) fn dequant_iq4_xs(b: &[u8], out: &mut [f32]) {
    let d = rd_f16(b, 0);
    let sh = u16_at(b, 2);
    for s in 0..8 {
        let lo = nib_scale(&b[4..8], s);
        let hi = ((sh >> (2 * s)) & 3) as u8;
        let dl = d * ((lo | (hi << 4)) as i32 - 32) as f32;
        let qs = &b[8 + 16 * s..24 + 16 * s];
        for j in 0..32 {
            out[32 * s + j] = dl * KVALUES_IQ4NL[nibble(qs, j) as usize] as f32;
        }
    }
}

/// ggml's `e8m0_to_fp32_half`: 2^(e - 128), exact for every byte (subnormal below e = 2).
pub(super) fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        u32::from(e - 1) << 23
    };
    f32::from_bits(bits)
}

/// MXFP4 (17 bytes): the e8m0 exponent, 16 bytes of nibbles (Q4_0's order) indexing the
/// doubled e2m1 values.
pub(super) fn dequant_mxfp4(b: &[u8], out: &mut [f32]) {
    let d = e8m0_half(b[0]);
    for (j, o) in out[..32].iter_mut().enumerate() {
        *o = d * KVALUES_MXFP4[nibble(&b[1..], j) as usize] as f32;
    }
}

/// Reference MXFP4 (gguf-py's): e = floor(log2(max |x|)) - 2 + 127, each value the nearest
/// table entry (first on ties).
pub(super) fn quantize_mxfp4(x: &[f32], out: &mut [u8]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let e = if amax > 0.0 {
        (amax.log2().floor() as i32 - 2 + 127).clamp(0, 255) as u8
    } else {
        0
    };
    out[0] = e;
    nearest_nibbles(&KVALUES_MXFP4, e8m0_half(e), x, &mut out[1..17]);
}

/// Each of 32 values as the index of the nearest `d * table[k]` (the first on ties), packed
/// as nibbles in Q4_0's order into 16 bytes.
fn nearest_nibbles(table: &[i8; 16], d: f32, x: &[f32], out: &mut [u8]) {
    let q: [u8; 32] = std::array::from_fn(|j| {
        let mut best = (f32::INFINITY, 0u8);
        for (k, v) in table.iter().enumerate() {
            let err = (d * *v as f32 - x[j]).abs();
            if err < best.0 {
                best = (err, k as u8);
            }
        }
        best.1
    });
    for j in 0..16 {
        out[j] = q[j] | (q[j + 16] << 4);
    }
}

/// Reference IQ4_NL, simplified: d = (value of largest magnitude) / (table's -127), each value
/// the nearest table entry; no scale search (llama.cpp refines d by least squares).
pub(super) fn quantize_iq4_nl(x: &[f32], out: &mut [u8]) {
    let mut max = 0f32;
    for v in x {
        if v.abs() > max.abs() {
            max = *v;
        }
    }
    let d = wr_f16(out, 0, max / KVALUES_IQ4NL[0] as f32);
    nearest_nibbles(&KVALUES_IQ4NL, d, x, &mut out[2..18]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e8m0_half_is_a_power_of_two() {
        assert_eq!(e8m0_half(128), 1.0);
        assert_eq!(e8m0_half(127), 0.5);
        assert_eq!(e8m0_half(1), f32::from_bits(0x0040_0000), "2^-127");
        assert_eq!(e8m0_half(0), f32::from_bits(0x0020_0000), "2^-128");
        assert_eq!(e8m0_half(255), 2f32.powi(127));
    }

    #[test]
    fn iq2_xxs_hand_built_block() {
        // d = 1, first group: grid index 1 (row 0x080808080808082b: element 0 is 43), sign
        // index 1 (ksigns[1] = 0x81: elements 0 and 7 negative), scale 3 -> db = 3.5 / 4.
        let mut b = [0u8; 66];
        b[0..2].copy_from_slice(&half::f16::from_f32(1.0).to_bits().to_le_bytes());
        b[2] = 1;
        let aux1: u32 = 1 | (3 << 28);
        b[6..10].copy_from_slice(&aux1.to_le_bytes());
        let mut y = [0f32; 256];
        dequant_iq2_xxs(&b, &mut y);
        let db = 3.5 * 0.25;
        assert_eq!(y[0], -43.0 * db);
        assert_eq!(y[1], 8.0 * db);
        assert_eq!(y[7], -8.0 * db);
        assert_eq!(y[8], 8.0 * db, "grid index 0, no signs");
        assert_eq!(y[32], 8.0 * 0.125, "group 1: scale 0");
    }

    #[test]
    fn mxfp4_and_iq4_nl_quantizers_round_trip_table_values() {
        let mut x = [0f32; 32];
        for (j, v) in x.iter_mut().enumerate() {
            *v = KVALUES_MXFP4[j % 16] as f32 * 0.25;
        }
        let mut b = [0u8; 17];
        quantize_mxfp4(&x, &mut b);
        let mut y = [0f32; 32];
        dequant_mxfp4(&b, &mut y);
        assert_eq!(x, y);
        for (j, v) in x.iter_mut().enumerate() {
            *v = KVALUES_IQ4NL[j % 16] as f32 / 64.0;
        }
        let mut b = [0u8; 18];
        quantize_iq4_nl(&x, &mut b);
        dequant_iq4_nl(&b, &mut y);
        assert_eq!(x, y);
    }
}
