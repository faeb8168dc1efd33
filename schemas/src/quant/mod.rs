//! Row codecs for every ggml weight type of the GGUFs people download (F32, F16, BF16; Q4_0,
//! Q4_1, Q5_0, Q5_1, Q8_0; Q2_K..Q6_K; IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
//! IQ4_NL, IQ4_XS; MXFP4): dequantize, dot product with on-the-fly dequantization, element
//! range access for KV rows, and the quantizers the GGUF writers use. One file per family:
//! `legacy` (32-element blocks), `kquants`, `iquants` (with the generated `tables`), `avx2`
//! (the fast Q8_0 / Q4_K products), `random` (valid random blocks of any type).
//! Invariant: every function checks that the byte row and the element count agree with the
//! ggml block table before touching a byte; none allocates except `quantize_row`'s append.
//! Dequantization equals gguf-py's `dequantize` bit for bit (tests/quant_fixtures.rs).

#[cfg(target_arch = "x86_64")]
mod avx2;
mod iquants;
mod kquants;
mod legacy;
pub mod random;
#[rustfmt::skip]
mod tables;

use crate::ggml::GgmlType;
use half::{bf16, f16};

pub use kquants::{get_scale_min_k4, QK_K};
/// The IQ3_S grid (element j of a row in byte j), for host models of the GPU kernels' decoders.
pub use tables::IQ3S_GRID;

/// Elements per Q8_0 block.
pub const QK8_0: usize = 32;
/// Bytes per Q8_0 block: f16 scale + 32 signed bytes.
pub const Q8_0_BYTES: usize = 34;
/// Bytes per Q4_K block: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles.
pub const Q4_K_BYTES: usize = 144;

/// Every type this module decodes, in ggml id order (for tests, `--help` and errors).
pub const SUPPORTED: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::Iq2Xxs,
    GgmlType::Iq2Xs,
    GgmlType::Iq3Xxs,
    GgmlType::Iq1S,
    GgmlType::Iq4Nl,
    GgmlType::Iq3S,
    GgmlType::Iq2S,
    GgmlType::Iq4Xs,
    GgmlType::Iq1M,
    GgmlType::BF16,
    GgmlType::MXFP4,
];

/// Every type [`quantize_row`] writes from f32 values (ggml's reference quantizers, no
/// importance matrix; IQ4_NL without llama.cpp's scale refinement).
pub const QUANTIZABLE: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::Iq4Nl,
    GgmlType::MXFP4,
];

/// Names of the supported types, comma-separated (for messages).
fn supported_names() -> String {
    SUPPORTED
        .iter()
        .map(|t| t.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A row that does not fit its type, or a type this module does not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("ggml type {ty} is not supported by the CPU reference (supported: {}); requantize the model with `strata-gguf quantize IN OUT --type Q8_0`", supported_names())]
    Unsupported { ty: GgmlType },
    #[error("ggml type {ty} has no quantizer here (quantizable: {}); pick one of those", QUANTIZABLE.iter().map(|t| t.name()).collect::<Vec<_>>().join(", "))]
    NoQuantizer { ty: GgmlType },
    #[error("a {ty} row of {n} elements is not a whole number of {block}-element blocks")]
    PartialBlock {
        ty: GgmlType,
        n: usize,
        block: usize,
    },
    #[error("a {ty} row of {n} elements needs {expected} bytes but {got} were given")]
    ByteLength {
        ty: GgmlType,
        n: usize,
        expected: usize,
        got: usize,
    },
    #[error("element range {start}..{end} is outside a {ty} row of {n} elements")]
    Range {
        ty: GgmlType,
        start: usize,
        end: usize,
        n: usize,
    },
}

/// Whether this module can decode `ty`.
pub fn is_supported(ty: GgmlType) -> bool {
    SUPPORTED.contains(&ty)
}

/// Whether [`quantize_row`] can write `ty`.
pub fn can_quantize(ty: GgmlType) -> bool {
    QUANTIZABLE.contains(&ty)
}

/// One block's decoder: `(elements, bytes, fn(block, out))`, for every quantized type.
type BlockFn = fn(&[u8], &mut [f32]);

fn block_decoder(ty: GgmlType) -> Option<(usize, usize, BlockFn)> {
    use GgmlType::*;
    let f: BlockFn = match ty {
        Q4_0 => legacy::dequant_q4_0,
        Q4_1 => legacy::dequant_q4_1,
        Q5_0 => legacy::dequant_q5_0,
        Q5_1 => legacy::dequant_q5_1,
        Q8_0 => legacy::dequant_q8_0,
        Q2K => kquants::dequant_q2_k,
        Q3K => kquants::dequant_q3_k,
        Q4K => kquants::dequant_q4_k,
        Q5K => kquants::dequant_q5_k,
        Q6K => kquants::dequant_q6_k,
        Iq2Xxs => iquants::dequant_iq2_xxs,
        Iq2Xs => iquants::dequant_iq2_xs,
        Iq2S => iquants::dequant_iq2_s,
        Iq3Xxs => iquants::dequant_iq3_xxs,
        Iq3S => iquants::dequant_iq3_s,
        Iq1S => iquants::dequant_iq1_s,
        Iq1M => iquants::dequant_iq1_m,
        Iq4Nl => iquants::dequant_iq4_nl,
        Iq4Xs => iquants::dequant_iq4_xs,
        MXFP4 => iquants::dequant_mxfp4,
        _ => return None,
    };
    Some((ty.block_elems() as usize, ty.block_bytes() as usize, f))
}

/// One block's quantizer, for the quantized types of [`QUANTIZABLE`].
fn block_quantizer(ty: GgmlType) -> Option<BlockFnMut> {
    use GgmlType::*;
    Some(match ty {
        Q4_0 => legacy::quantize_q4_0,
        Q4_1 => legacy::quantize_q4_1,
        Q5_0 => legacy::quantize_q5_0,
        Q5_1 => legacy::quantize_q5_1,
        Q8_0 => legacy::quantize_q8_0,
        Q4K => kquants::quantize_q4_k,
        Q5K => kquants::quantize_q5_k,
        Q6K => kquants::quantize_q6_k,
        Iq4Nl => iquants::quantize_iq4_nl,
        MXFP4 => iquants::quantize_mxfp4,
        _ => return None,
    })
}

type BlockFnMut = fn(&[f32], &mut [u8]);

/// Bytes of a row of `n` elements of `ty`, refusing unsupported types and partial blocks.
pub fn row_bytes(ty: GgmlType, n: usize) -> Result<usize, QuantError> {
    if !is_supported(ty) {
        return Err(QuantError::Unsupported { ty });
    }
    let block = ty.block_elems() as usize;
    if n % block != 0 {
        return Err(QuantError::PartialBlock { ty, n, block });
    }
    Ok(n / block * ty.block_bytes() as usize)
}

fn check(ty: GgmlType, row: &[u8], n: usize) -> Result<(), QuantError> {
    let expected = row_bytes(ty, n)?;
    if row.len() != expected {
        return Err(QuantError::ByteLength {
            ty,
            n,
            expected,
            got: row.len(),
        });
    }
    Ok(())
}

#[inline]
fn rd_f16(b: &[u8], off: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

/// Writes `v` as f16 at `off` and returns the value stored (as f32).
#[inline]
fn wr_f16(b: &mut [u8], off: usize, v: f32) -> f32 {
    let h = f16::from_f32(v);
    b[off..off + 2].copy_from_slice(&h.to_bits().to_le_bytes());
    h.to_f32()
}

#[inline]
fn rd_bf16(b: &[u8], off: usize) -> f32 {
    bf16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

#[inline]
fn rd_f32(b: &[u8], off: usize) -> f32 {
    f32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// Dot product of two f32 slices of equal length with eight running sums (the one order
/// every f32 path here uses, so dequantize-then-dot and `dot_row` agree bit for bit on F32).
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Dequantize one row of `out.len()` elements.
pub fn dequantize_row(ty: GgmlType, row: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    check(ty, row, out.len())?;
    match ty {
        GgmlType::F32 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = rd_f32(row, 4 * i);
            }
        }
        GgmlType::F16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = rd_f16(row, 2 * i);
            }
        }
        GgmlType::BF16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = rd_bf16(row, 2 * i);
            }
        }
        _ => {
            let (be, bb, f) = block_decoder(ty).ok_or(QuantError::Unsupported { ty })?;
            for (blk, o) in row.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
                f(blk, o);
            }
        }
    }
    Ok(())
}

/// Sum of eight lanes in the one order every path here uses.
#[inline(always)]
fn hsum8(acc: &[f32; 8]) -> f32 {
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// Dot product of a row of plain elements (`W` bytes each, decoded by `rd`) with `x`, summed
/// in eight lanes in dot_f32's order. Whole groups of eight are fixed-size arrays so the
/// compiler vectorizes the decode and the multiply-add.
#[inline(always)]
fn dot_plain<const W: usize>(row: &[u8], x: &[f32], rd: impl Fn([u8; W]) -> f32) -> f32 {
    let mut acc = [0f32; 8];
    let mut rows = row.chunks_exact(8 * W);
    let mut xs = x.chunks_exact(8);
    for (rb, xb) in (&mut rows).zip(&mut xs) {
        for k in 0..8 {
            let mut e = [0u8; W];
            e.copy_from_slice(&rb[W * k..W * k + W]);
            acc[k] += rd(e) * xb[k];
        }
    }
    let mut tail = 0f32;
    for (e, xv) in rows.remainder().chunks_exact(W).zip(xs.remainder()) {
        let mut b = [0u8; W];
        b.copy_from_slice(e);
        tail += rd(b) * xv;
    }
    hsum8(&acc) + tail
}

/// One Q8_0 block: `sum_i q_i x_i` in eight lanes (the scale is applied by the caller).
#[inline(always)]
fn q8_0_lanes(q: &[u8; 32], x: &[f32; 32]) -> [f32; 8] {
    let mut p = [0f32; 8];
    for j in 0..4 {
        for k in 0..8 {
            p[k] += (q[8 * j + k] as i8) as f32 * x[8 * j + k];
        }
    }
    p
}

/// The body of [`dot_row`] once the row is known to fit: compiled twice on x86-64 (baseline
/// and AVX2) from this one source. No fused multiply-add is enabled, so both builds round
/// every operation the same way and give bit-identical results.
#[inline(always)]
fn dot_row_body(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    match ty {
        // The same eight-lane summation order as dot_f32, so the plain paths agree exactly.
        GgmlType::F32 => dot_plain::<4>(row, x, f32::from_le_bytes),
        GgmlType::F16 => dot_plain::<2>(row, x, |b| f16::from_le_bytes(b).to_f32()),
        GgmlType::BF16 => dot_plain::<2>(row, x, |b| bf16::from_le_bytes(b).to_f32()),
        GgmlType::Q8_0 => {
            let mut tot = [0f32; 8];
            for (blk, xb) in row.chunks_exact(Q8_0_BYTES).zip(x.chunks_exact(QK8_0)) {
                let (Ok(q), Ok(xb)) =
                    (<&[u8; 32]>::try_from(&blk[2..]), <&[f32; 32]>::try_from(xb))
                else {
                    return f32::NAN;
                };
                let d = rd_f16(blk, 0);
                let p = q8_0_lanes(q, xb);
                for k in 0..8 {
                    tot[k] += d * p[k];
                }
            }
            hsum8(&tot)
        }
        GgmlType::Q4K => {
            let mut tot = [0f32; 8];
            for (blk, xb) in row.chunks_exact(Q4_K_BYTES).zip(x.chunks_exact(QK_K)) {
                let d = rd_f16(blk, 0);
                let dmin = rd_f16(blk, 2);
                let scales = &blk[4..16];
                for g in 0..4 {
                    let (sc0, m0) = get_scale_min_k4(2 * g, scales);
                    let (sc1, m1) = get_scale_min_k4(2 * g + 1, scales);
                    let (Ok(q), Ok(xa), Ok(xh)) = (
                        <&[u8; 32]>::try_from(&blk[16 + 32 * g..48 + 32 * g]),
                        <&[f32; 32]>::try_from(&xb[64 * g..64 * g + 32]),
                        <&[f32; 32]>::try_from(&xb[64 * g + 32..64 * g + 64]),
                    ) else {
                        return f32::NAN;
                    };
                    let (mut qa, mut qh, mut sa, mut sh) =
                        ([0f32; 8], [0f32; 8], [0f32; 8], [0f32; 8]);
                    for j in 0..4 {
                        for k in 0..8 {
                            let b = q[8 * j + k];
                            let (a, h) = (xa[8 * j + k], xh[8 * j + k]);
                            qa[k] += (b & 0xF) as f32 * a;
                            qh[k] += (b >> 4) as f32 * h;
                            sa[k] += a;
                            sh[k] += h;
                        }
                    }
                    let (d1, mm1) = (d * sc0 as f32, dmin * m0 as f32);
                    let (d2, mm2) = (d * sc1 as f32, dmin * m1 as f32);
                    for k in 0..8 {
                        tot[k] += (d1 * qa[k] - mm1 * sa[k]) + (d2 * qh[k] - mm2 * sh[k]);
                    }
                }
            }
            hsum8(&tot)
        }
        _ => dot_blocks(ty, row, x),
    }
}

/// Dot product for the types without a dedicated kernel: each block is decoded into a stack
/// buffer and multiplied in eight lanes (the lanes summed in [`hsum8`]'s order at the end).
#[inline(always)]
fn dot_blocks(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    let Some((be, bb, f)) = block_decoder(ty) else {
        return f32::NAN;
    };
    let mut buf = [0f32; QK_K];
    let mut tot = [0f32; 8];
    for (blk, xb) in row.chunks_exact(bb).zip(x.chunks_exact(be)) {
        f(blk, &mut buf[..be]);
        for (w8, x8) in buf[..be].chunks_exact(8).zip(xb.chunks_exact(8)) {
            for k in 0..8 {
                tot[k] += w8[k] * x8[k];
            }
        }
    }
    hsum8(&tot)
}

/// `sum_i W[i] * x[i]` for one weight row of `x.len()` elements, dequantizing on the fly
/// block by block without allocating. Returns NaN (never panics) when the row does not fit
/// `ty` and `x`; callers validate shapes once up front (see `try_dot_row`).
pub fn dot_row(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    if check(ty, row, x.len()).is_err() {
        return f32::NAN;
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected on this CPU just above.
        return unsafe { avx2::dot_row(ty, row, x) };
    }
    dot_row_body(ty, row, x)
}

/// `dot_row` through the portable build only (tests compare it with the AVX2 build).
#[doc(hidden)]
pub fn dot_row_portable(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    if check(ty, row, x.len()).is_err() {
        return f32::NAN;
    }
    dot_row_body(ty, row, x)
}

/// `dot_row` with the shape check reported as an error.
pub fn try_dot_row(ty: GgmlType, row: &[u8], x: &[f32]) -> Result<f32, QuantError> {
    check(ty, row, x.len())?;
    Ok(dot_row(ty, row, x))
}

/// Element `i` of a row of a plain or Q8_0 type (the KV types); 0 for other types.
#[inline]
fn kv_elem(ty: GgmlType, row: &[u8], i: usize) -> f32 {
    match ty {
        GgmlType::F32 => rd_f32(row, 4 * i),
        GgmlType::F16 => rd_f16(row, 2 * i),
        GgmlType::BF16 => rd_bf16(row, 2 * i),
        GgmlType::Q8_0 => {
            let b = i / QK8_0;
            rd_f16(row, b * Q8_0_BYTES) * (row[b * Q8_0_BYTES + 2 + i % QK8_0] as i8) as f32
        }
        _ => 0.0,
    }
}

/// Whether `ty` can store a KV row (element access at any offset).
pub fn is_kv_type(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_0
    )
}

fn check_range(
    ty: GgmlType,
    row: &[u8],
    n: usize,
    start: usize,
    len: usize,
) -> Result<(), QuantError> {
    if !is_kv_type(ty) {
        return Err(QuantError::Unsupported { ty });
    }
    check(ty, row, n)?;
    if start + len > n {
        return Err(QuantError::Range {
            ty,
            start,
            end: start + len,
            n,
        });
    }
    Ok(())
}

/// `sum_j row[start + j] * x[j]` over a KV row of `n` elements (the range may cross Q8_0
/// blocks, as a head of 16 does).
pub fn dot_range(
    ty: GgmlType,
    row: &[u8],
    n: usize,
    start: usize,
    x: &[f32],
) -> Result<f32, QuantError> {
    check_range(ty, row, n, start, x.len())?;
    let end = start + x.len();
    // Plain types in dot_row's eight lanes; Q8_0 element by element (a head may start
    // inside a block).
    Ok(match ty {
        GgmlType::F32 => dot_plain::<4>(&row[4 * start..4 * end], x, f32::from_le_bytes),
        GgmlType::F16 => dot_plain::<2>(&row[2 * start..2 * end], x, |b| {
            f16::from_le_bytes(b).to_f32()
        }),
        GgmlType::BF16 => dot_plain::<2>(&row[2 * start..2 * end], x, |b| {
            bf16::from_le_bytes(b).to_f32()
        }),
        _ => {
            let mut s = 0f32;
            for (j, xv) in x.iter().enumerate() {
                s += kv_elem(ty, row, start + j) * xv;
            }
            s
        }
    })
}

/// `out[j] += w * row[start + j]` over a KV row of `n` elements.
pub fn axpy_range(
    ty: GgmlType,
    row: &[u8],
    n: usize,
    start: usize,
    w: f32,
    out: &mut [f32],
) -> Result<(), QuantError> {
    check_range(ty, row, n, start, out.len())?;
    let end = start + out.len();
    match ty {
        GgmlType::F32 => {
            for (o, b) in out.iter_mut().zip(row[4 * start..4 * end].chunks_exact(4)) {
                *o += w * f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, b) in out.iter_mut().zip(row[2 * start..2 * end].chunks_exact(2)) {
                *o += w * f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        _ => {
            for (j, o) in out.iter_mut().enumerate() {
                *o += w * kv_elem(ty, row, start + j);
            }
        }
    }
    Ok(())
}

/// Quantize `x` and append the row to `out` (the types of [`QUANTIZABLE`]).
pub fn quantize_row(ty: GgmlType, x: &[f32], out: &mut Vec<u8>) -> Result<(), QuantError> {
    let n = row_bytes(ty, x.len())?;
    let at = out.len();
    out.resize(at + n, 0);
    quantize_row_into(ty, x, &mut out[at..])
}

/// Quantize `x` into exactly `row_bytes(ty, x.len())` bytes of `out`, without allocating.
pub fn quantize_row_into(ty: GgmlType, x: &[f32], out: &mut [u8]) -> Result<(), QuantError> {
    check(ty, out, x.len())?;
    match ty {
        GgmlType::F32 => {
            for (v, o) in x.iter().zip(out.chunks_exact_mut(4)) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for (v, o) in x.iter().zip(out.chunks_exact_mut(2)) {
                o.copy_from_slice(&f16::from_f32(*v).to_bits().to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for (v, o) in x.iter().zip(out.chunks_exact_mut(2)) {
                o.copy_from_slice(&bf16::from_f32(*v).to_bits().to_le_bytes());
            }
        }
        _ => {
            let f = block_quantizer(ty).ok_or(QuantError::NoQuantizer { ty })?;
            let (be, bb) = (ty.block_elems() as usize, ty.block_bytes() as usize);
            for (xb, o) in x.chunks_exact(be).zip(out.chunks_exact_mut(bb)) {
                f(xb, o);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// splitmix64: a tiny deterministic generator for test inputs.
    struct StdRng(u64);
    impl StdRng {
        fn seed_from_u64(s: u64) -> Self {
            Self(s)
        }
        fn unit(&mut self) -> f32 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z >> 40) as f32 / (1u64 << 24) as f32
        }
    }

    fn randn(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
        // Sum of 4 uniforms: roughly normal, with some spread between blocks.
        (0..n)
            .map(|_| {
                let s: f32 = (0..4).map(|_| rng.unit() - 0.5).sum();
                s * scale
            })
            .collect()
    }

    #[test]
    fn q8_0_hand_derived_block() {
        // x = [127, -127, 63.5, 0, 1, ...]: amax 127 -> d = 1.0 (f16 0x3C00), q = round(x).
        let mut x = vec![0f32; 32];
        x[0] = 127.0;
        x[1] = -127.0;
        x[2] = 63.5; // ties away from zero -> 64
        x[3] = -2.5; // -> -3
        x[4] = 1.0;
        let mut out = Vec::new();
        quantize_row(GgmlType::Q8_0, &x, &mut out).unwrap();
        let mut want = vec![0x00u8, 0x3C, 127, 0x81, 64, 0xFD, 1];
        want.resize(34, 0);
        assert_eq!(out, want);
        let mut back = vec![0f32; 32];
        dequantize_row(GgmlType::Q8_0, &out, &mut back).unwrap();
        assert_eq!(&back[..5], &[127.0, -127.0, 64.0, -3.0, 1.0]);
        // Decode a hand-written block: d = 0.5 (f16 0x3800), q[0] = -4, q[31] = 7.
        let mut blk = vec![0x00u8, 0x38];
        blk.resize(34, 0);
        blk[2] = (-4i8) as u8;
        blk[33] = 7;
        dequantize_row(GgmlType::Q8_0, &blk, &mut back).unwrap();
        assert_eq!(back[0], -2.0);
        assert_eq!(back[31], 3.5);
        assert_eq!(back[1..31].iter().filter(|v| **v != 0.0).count(), 0);
    }

    #[test]
    fn q8_0_round_trip_within_half_step() {
        let mut rng = StdRng::seed_from_u64(1);
        let x = randn(&mut rng, 32 * 64, 3.0);
        let mut q = Vec::new();
        quantize_row(GgmlType::Q8_0, &x, &mut q).unwrap();
        let mut y = vec![0f32; x.len()];
        dequantize_row(GgmlType::Q8_0, &q, &mut y).unwrap();
        for (xb, yb) in x.chunks(32).zip(y.chunks(32)) {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            // d/2 = amax/254, plus the f16 rounding of d (relative 2^-11) times 127 steps.
            let bound = amax / 254.0 + amax * 127.0 / 127.0 / 2048.0 + 1e-6;
            for (a, b) in xb.iter().zip(yb) {
                assert!((a - b).abs() <= bound, "{a} vs {b}, bound {bound}");
            }
        }
    }

    #[test]
    fn q8_0_requantize_is_byte_stable() {
        let mut rng = StdRng::seed_from_u64(2);
        let x = randn(&mut rng, 32 * 16, 0.2);
        let mut q1 = Vec::new();
        quantize_row(GgmlType::Q8_0, &x, &mut q1).unwrap();
        let mut y = vec![0f32; x.len()];
        dequantize_row(GgmlType::Q8_0, &q1, &mut y).unwrap();
        let mut q2 = Vec::new();
        quantize_row(GgmlType::Q8_0, &y, &mut q2).unwrap();
        assert_eq!(q1, q2);
    }

    #[test]
    fn q4_k_scale_min_packing_is_ggml_layout() {
        // Sub-blocks 0..4 use the low 6 bits of bytes 0..8; 4..8 use the nibbles of bytes
        // 8..12 plus the top two bits of bytes 0..8.
        let mut q = [0u8; 12];
        q[1] = 0b11_000101; // scale of j=1 is 5; its top bits are bits 4-5 of scale j=5
        q[5] = 0b10_000111; // min of j=1 is 7; top bits are bits 4-5 of min j=5
        q[9] = 0x3A; // j=5: scale low nibble 0xA, min low nibble 0x3
        assert_eq!(get_scale_min_k4(1, &q), (5, 7));
        assert_eq!(get_scale_min_k4(5, &q), (0xA | (3 << 4), 0x3 | (2 << 4)));
    }

    #[test]
    fn q4_k_round_trip_bound() {
        let mut rng = StdRng::seed_from_u64(3);
        let x = randn(&mut rng, 256 * 32, 1.0);
        let mut q = Vec::new();
        quantize_row(GgmlType::Q4K, &x, &mut q).unwrap();
        assert_eq!(q.len(), 32 * 144);
        let mut y = vec![0f32; x.len()];
        dequantize_row(GgmlType::Q4K, &q, &mut y).unwrap();
        // Bound: within each 32-element sub-block, error <= (max - min(min, 0)) / 15, i.e. one
        // full 4-bit step (the ideal is half a step; the 6-bit scale/min quantization and the
        // weighted fit may cost up to another half). RMS error <= 10% of RMS(x).
        let (mut se, mut sx) = (0f64, 0f64);
        for (xs, ys) in x.chunks(32).zip(y.chunks(32)) {
            let mx = xs.iter().fold(f32::MIN, |m, v| m.max(*v));
            let mn = xs.iter().fold(f32::MAX, |m, v| m.min(*v)).min(0.0);
            let step = (mx - mn) / 15.0;
            for (a, b) in xs.iter().zip(ys) {
                assert!((a - b).abs() <= step, "{a} vs {b}, step {step}");
                se += ((a - b) as f64).powi(2);
                sx += (*a as f64).powi(2);
            }
        }
        let rel = (se / sx).sqrt();
        assert!(rel < 0.10, "relative RMS error {rel}");
    }

    /// Relative RMS error of a quantize -> dequantize round trip of ~N(0, 1) data.
    fn round_trip_error(ty: GgmlType, x: &[f32]) -> f64 {
        let mut q = Vec::new();
        quantize_row(ty, x, &mut q).unwrap();
        assert_eq!(q.len(), row_bytes(ty, x.len()).unwrap());
        let mut y = vec![0f32; x.len()];
        dequantize_row(ty, &q, &mut y).unwrap();
        let se: f64 = x
            .iter()
            .zip(&y)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        let sx: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum();
        (se / sx).sqrt()
    }

    #[test]
    fn every_quantizer_round_trips_within_its_type_tolerance() {
        let mut rng = StdRng::seed_from_u64(11);
        let x = randn(&mut rng, 256 * 16, 1.0);
        // Bounds: measured errors (x ~ sum of 4 uniforms) with about 25% headroom; the order
        // follows bits per weight.
        for (ty, bound) in [
            (GgmlType::F32, 0.0),
            (GgmlType::F16, 3e-4),
            (GgmlType::BF16, 2.5e-3),
            (GgmlType::Q8_0, 0.0065),
            (GgmlType::Q6K, 0.021),
            (GgmlType::Q5_0, 0.05),
            (GgmlType::Q5_1, 0.045),
            (GgmlType::Q5K, 0.044),
            (GgmlType::Q4_0, 0.1),
            (GgmlType::Q4_1, 0.093),
            (GgmlType::Q4K, 0.086),
            (GgmlType::Iq4Nl, 0.098),
            (GgmlType::MXFP4, 0.14),
        ] {
            let e = round_trip_error(ty, &x);
            eprintln!("{ty}: relative RMS error {e:.4}");
            assert!(e <= bound, "{ty}: relative RMS error {e} > {bound}");
        }
        assert_eq!(QUANTIZABLE.len(), 13, "every quantizer is covered above");
        // All-zero input gives all-zero values (finite scales, no NaN).
        for &ty in QUANTIZABLE {
            let z = vec![0f32; 256];
            let mut q = Vec::new();
            quantize_row(ty, &z, &mut q).unwrap();
            let mut y = vec![1f32; 256];
            dequantize_row(ty, &q, &mut y).unwrap();
            assert!(y.iter().all(|v| *v == 0.0), "{ty}");
        }
        assert_eq!(
            quantize_row(GgmlType::Iq3S, &x[..256], &mut Vec::new()),
            Err(QuantError::NoQuantizer { ty: GgmlType::Iq3S })
        );
    }

    #[test]
    fn q4_k_requantize_is_stable() {
        let mut rng = StdRng::seed_from_u64(4);
        let x = randn(&mut rng, 256 * 8, 0.5);
        let mut q1 = Vec::new();
        quantize_row(GgmlType::Q4K, &x, &mut q1).unwrap();
        let mut y1 = vec![0f32; x.len()];
        dequantize_row(GgmlType::Q4K, &q1, &mut y1).unwrap();
        let mut q2 = Vec::new();
        quantize_row(GgmlType::Q4K, &y1, &mut q2).unwrap();
        let mut y2 = vec![0f32; x.len()];
        dequantize_row(GgmlType::Q4K, &q2, &mut y2).unwrap();
        // Values already on a Q4_K grid come back (nearly) unchanged: the second pass moves
        // nothing by more than 2% of the block's largest magnitude.
        for (b1, b2) in y1.chunks(256).zip(y2.chunks(256)) {
            let amax = b1.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in b1.iter().zip(b2) {
                assert!((a - b).abs() <= 0.02 * amax, "{a} vs {b} (amax {amax})");
            }
        }
    }

    #[test]
    fn dot_row_matches_dequantize_then_dot() {
        let mut rng = StdRng::seed_from_u64(5);
        let w = randn(&mut rng, 512, 1.0);
        let x = randn(&mut rng, 512, 1.0);
        for ty in [
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::BF16,
            GgmlType::Q8_0,
            GgmlType::Q4K,
        ] {
            let mut q = Vec::new();
            quantize_row(ty, &w, &mut q).unwrap();
            let mut d = vec![0f32; 512];
            dequantize_row(ty, &q, &mut d).unwrap();
            let want: f64 = d.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
            let got = dot_row(ty, &q, &x);
            assert!((got as f64 - want).abs() < 1e-3, "{ty}: {got} vs {want}");
            if ty == GgmlType::F32 {
                assert_eq!(got, dot_f32(&d, &x), "F32 paths agree bit for bit");
            }
            assert_eq!(
                got.to_bits(),
                dot_row_portable(ty, &q, &x).to_bits(),
                "{ty}: the AVX2 and portable builds round alike"
            );
            // A tail shorter than eight elements (plain types only).
            if matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
                let mut q5 = Vec::new();
                quantize_row(ty, &w[..13], &mut q5).unwrap();
                let mut d5 = vec![0f32; 13];
                dequantize_row(ty, &q5, &mut d5).unwrap();
                let want5: f32 = d5.iter().zip(&x).map(|(a, b)| a * b).sum();
                assert!(
                    (dot_row(ty, &q5, &x[..13]) - want5).abs() < 1e-4,
                    "{ty} tail"
                );
            }
        }
    }

    #[test]
    fn bad_rows_are_refused_without_panicking() {
        assert_eq!(
            row_bytes(GgmlType::Q8_0, 33),
            Err(QuantError::PartialBlock {
                ty: GgmlType::Q8_0,
                n: 33,
                block: 32
            })
        );
        assert!(matches!(
            row_bytes(GgmlType::Tq1_0, 256),
            Err(QuantError::Unsupported { .. })
        ));
        let x = vec![1f32; 32];
        assert!(dot_row(GgmlType::Q8_0, &[0u8; 33], &x).is_nan());
        assert!(try_dot_row(GgmlType::Q8_0, &[0u8; 33], &x).is_err());
        let mut out = vec![0f32; 32];
        assert!(dequantize_row(GgmlType::Q4K, &[0u8; 144], &mut out).is_err());
    }

    #[test]
    fn kv_range_access_crosses_q8_0_blocks() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 30.0) / 8.0).collect();
        let mut q = Vec::new();
        quantize_row(GgmlType::Q8_0, &x, &mut q).unwrap();
        let mut full = vec![0f32; 64];
        dequantize_row(GgmlType::Q8_0, &q, &mut full).unwrap();
        let probe = vec![1f32; 16];
        let s = dot_range(GgmlType::Q8_0, &q, 64, 24, &probe).unwrap();
        let want: f32 = full[24..40].iter().sum();
        assert!((s - want).abs() < 1e-5);
        let mut acc = vec![0f32; 16];
        axpy_range(GgmlType::Q8_0, &q, 64, 24, 2.0, &mut acc).unwrap();
        for (a, f) in acc.iter().zip(&full[24..40]) {
            assert_eq!(*a, 2.0 * f);
        }
        assert!(dot_range(GgmlType::Q8_0, &q, 64, 60, &probe).is_err());
    }
}
