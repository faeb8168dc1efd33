//! Row codecs for the weight and KV types the CPU reference reads (F32, F16, BF16, Q8_0, Q4_K):
//! dequantize, dot product with on-the-fly dequantization, element-range access for KV rows,
//! and the Q8_0 / Q4_K quantizers the GGUF writer uses.
//! Invariant: every function checks that the byte row and the element count agree with the
//! ggml block table before touching a byte; none allocates except `quantize_row`'s append.

use crate::ggml::GgmlType;
use half::{bf16, f16};

/// Elements per Q8_0 block.
pub const QK8_0: usize = 32;
/// Bytes per Q8_0 block: f16 scale + 32 signed bytes.
pub const Q8_0_BYTES: usize = 34;
/// Elements per K-quant super-block.
pub const QK_K: usize = 256;
/// Bytes per Q4_K block: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles.
pub const Q4_K_BYTES: usize = 144;

/// A row that does not fit its type, or a type this module does not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("ggml type {ty} is not supported by the CPU reference (supported: F32, F16, BF16, Q8_0, Q4_K); requantize the model")]
    Unsupported { ty: GgmlType },
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
    matches!(
        ty,
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_0 | GgmlType::Q4K
    )
}

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

#[inline]
fn rd_bf16(b: &[u8], off: usize) -> f32 {
    bf16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

#[inline]
fn rd_f32(b: &[u8], off: usize) -> f32 {
    f32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` (0..8) of a Q4_K block.
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
        GgmlType::Q8_0 => {
            for (blk, o) in row
                .chunks_exact(Q8_0_BYTES)
                .zip(out.chunks_exact_mut(QK8_0))
            {
                let d = rd_f16(blk, 0);
                for (j, v) in o.iter_mut().enumerate() {
                    *v = d * (blk[2 + j] as i8) as f32;
                }
            }
        }
        GgmlType::Q4K => {
            for (blk, o) in row.chunks_exact(Q4_K_BYTES).zip(out.chunks_exact_mut(QK_K)) {
                let d = rd_f16(blk, 0);
                let dmin = rd_f16(blk, 2);
                let scales = &blk[4..16];
                let qs = &blk[16..144];
                for g in 0..4 {
                    let (sc0, m0) = get_scale_min_k4(2 * g, scales);
                    let (sc1, m1) = get_scale_min_k4(2 * g + 1, scales);
                    let (d1, mm1) = (d * sc0 as f32, dmin * m0 as f32);
                    let (d2, mm2) = (d * sc1 as f32, dmin * m1 as f32);
                    let q = &qs[32 * g..32 * g + 32];
                    for l in 0..32 {
                        o[64 * g + l] = d1 * (q[l] & 0xF) as f32 - mm1;
                        o[64 * g + 32 + l] = d2 * (q[l] >> 4) as f32 - mm2;
                    }
                }
            }
        }
        _ => return Err(QuantError::Unsupported { ty }),
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
        _ => f32::NAN,
    }
}

/// AVX2 versions of the Q8_0 and Q4_K dot products: the same lanes, the same operations in
/// the same order as [`dot_row_body`] (no fused multiply-add), so results are bit-identical
/// to the portable build; other types use `dot_row_body` compiled for AVX2.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    // Every function here is an `unsafe fn` with `#[target_feature]` (callable on Rust 1.85);
    // its one contract is that the CPU supports AVX2, which `super::dot_row` checks.

    /// The horizontal sum of [`hsum8`]'s order.
    #[target_feature(enable = "avx2")]
    unsafe fn hsum(v: __m256) -> f32 {
        let mut a = [0f32; 8];
        // SAFETY: `a` holds exactly eight f32 (unaligned store); AVX2 per the contract.
        unsafe { _mm256_storeu_ps(a.as_mut_ptr(), v) };
        hsum8(&a)
    }

    /// Eight i8 widened to f32.
    #[target_feature(enable = "avx2")]
    unsafe fn i8x8(q: &[u8; 8]) -> __m256 {
        // SAFETY: reads exactly the 8 bytes of `q` (unaligned 64-bit load); AVX2 per the
        // contract.
        unsafe {
            let b = _mm_loadl_epi64(q.as_ptr() as *const __m128i);
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))
        }
    }

    /// Eight u8 widened to i32.
    #[target_feature(enable = "avx2")]
    unsafe fn u8x8(q: &[u8; 8]) -> __m256i {
        // SAFETY: reads exactly the 8 bytes of `q`; AVX2 per the contract.
        unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(q.as_ptr() as *const __m128i)) }
    }

    /// Eight f32 loaded.
    #[target_feature(enable = "avx2")]
    unsafe fn f32x8(x: &[f32; 8]) -> __m256 {
        // SAFETY: reads exactly the 8 floats of `x` (unaligned load); AVX2 per the contract.
        unsafe { _mm256_loadu_ps(x.as_ptr()) }
    }

    fn arr<T, const N: usize>(s: &[T]) -> &[T; N] {
        // Callers slice exactly N elements; a wrong length is a bug in this module.
        s.try_into().expect("slice of N elements")
    }

    /// [`super::dot_row`] for a row already checked to fit `ty` and `x`.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn dot_row(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
        // SAFETY: every call below needs AVX2 (this function's contract) and reads only
        // fixed-size arrays sliced from `row` and `x`.
        unsafe { dot_row_checked(ty, row, x) }
    }

    #[target_feature(enable = "avx2")]
    unsafe fn dot_row_checked(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
        // SAFETY: AVX2 per the contract; loads and stores go through the helpers above.
        unsafe {
            match ty {
                GgmlType::Q8_0 => {
                    let mut tot = _mm256_setzero_ps();
                    for (blk, xb) in row.chunks_exact(Q8_0_BYTES).zip(x.chunks_exact(QK8_0)) {
                        let mut p = _mm256_setzero_ps();
                        for j in 0..4 {
                            let q = i8x8(arr(&blk[2 + 8 * j..10 + 8 * j]));
                            p = _mm256_add_ps(
                                p,
                                _mm256_mul_ps(q, f32x8(arr(&xb[8 * j..8 * j + 8]))),
                            );
                        }
                        let d = _mm256_set1_ps(rd_f16(blk, 0));
                        tot = _mm256_add_ps(tot, _mm256_mul_ps(d, p));
                    }
                    hsum(tot)
                }
                GgmlType::Q4K => {
                    let mut tot = _mm256_setzero_ps();
                    let lo = _mm256_set1_epi32(0xF);
                    for (blk, xb) in row.chunks_exact(Q4_K_BYTES).zip(x.chunks_exact(QK_K)) {
                        let d = rd_f16(blk, 0);
                        let dmin = rd_f16(blk, 2);
                        let scales = &blk[4..16];
                        for g in 0..4 {
                            let (sc0, m0) = get_scale_min_k4(2 * g, scales);
                            let (sc1, m1) = get_scale_min_k4(2 * g + 1, scales);
                            let q = &blk[16 + 32 * g..48 + 32 * g];
                            let xa = &xb[64 * g..64 * g + 32];
                            let xh = &xb[64 * g + 32..64 * g + 64];
                            let (mut qa, mut qh) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                            let (mut sa, mut sh) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                            for j in 0..4 {
                                let b = u8x8(arr(&q[8 * j..8 * j + 8]));
                                let ql = _mm256_cvtepi32_ps(_mm256_and_si256(b, lo));
                                let qhi = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(b));
                                let a = f32x8(arr(&xa[8 * j..8 * j + 8]));
                                let h = f32x8(arr(&xh[8 * j..8 * j + 8]));
                                qa = _mm256_add_ps(qa, _mm256_mul_ps(ql, a));
                                qh = _mm256_add_ps(qh, _mm256_mul_ps(qhi, h));
                                sa = _mm256_add_ps(sa, a);
                                sh = _mm256_add_ps(sh, h);
                            }
                            let d1 = _mm256_set1_ps(d * sc0 as f32);
                            let mm1 = _mm256_set1_ps(dmin * m0 as f32);
                            let d2 = _mm256_set1_ps(d * sc1 as f32);
                            let mm2 = _mm256_set1_ps(dmin * m1 as f32);
                            let first =
                                _mm256_sub_ps(_mm256_mul_ps(d1, qa), _mm256_mul_ps(mm1, sa));
                            let second =
                                _mm256_sub_ps(_mm256_mul_ps(d2, qh), _mm256_mul_ps(mm2, sh));
                            tot = _mm256_add_ps(tot, _mm256_add_ps(first, second));
                        }
                    }
                    hsum(tot)
                }
                _ => dot_row_body(ty, row, x),
            }
        }
    }
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

/// Quantize `x` and append the row to `out` (F32, F16, BF16, Q8_0, Q4_K).
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
        GgmlType::Q8_0 => {
            for (xb, o) in x.chunks_exact(QK8_0).zip(out.chunks_exact_mut(Q8_0_BYTES)) {
                quantize_block_q8_0(xb, o);
            }
        }
        GgmlType::Q4K => {
            for (xb, o) in x.chunks_exact(QK_K).zip(out.chunks_exact_mut(Q4_K_BYTES)) {
                quantize_block_q4_k(xb, o);
            }
        }
        _ => return Err(QuantError::Unsupported { ty }),
    }
    Ok(())
}

/// ggml's reference Q8_0: d = max|x| / 127 stored as f16, q = round(x / d) (ties away from 0).
fn quantize_block_q8_0(x: &[f32], out: &mut [u8]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[0..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
    for (j, v) in x.iter().enumerate() {
        out[2 + j] = round_away(v * id).clamp(-128, 127) as i8 as u8;
    }
}

/// `roundf` (ties away from zero) without the libm call `f32::round` compiles to on baseline
/// x86-64: truncate, then step by one when the exact remainder is at least a half. NaN -> 0.
#[inline]
fn round_away(v: f32) -> i32 {
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

/// ggml's `nearest_int`: round half to even.
#[inline]
fn nearest_int(v: f32) -> i32 {
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

/// ggml's reference Q4_K for one 256-element block.
fn quantize_block_q4_k(x: &[f32], out: &mut [u8]) {
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
            15,
            xs,
            &weights,
            &mut l[32 * j..32 * j + 32],
            &mut l_aux,
            -1.0,
            0.1,
            20,
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
    let sc = &mut out[4..16];
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
    let d16 = f16::from_f32(max_scale / 63.0);
    let dmin16 = f16::from_f32(max_min / 63.0);
    out[0..2].copy_from_slice(&d16.to_bits().to_le_bytes());
    out[2..4].copy_from_slice(&dmin16.to_bits().to_le_bytes());
    let (d, dmin) = (d16.to_f32(), dmin16.to_f32());
    for j in 0..8 {
        let (s, m) = get_scale_min_k4(j, &out[4..16]);
        let dj = d * s as f32;
        if dj == 0.0 {
            continue;
        }
        let dm = dmin * m as f32;
        for ii in 0..32 {
            l[32 * j + ii] = nearest_int((x[32 * j + ii] + dm) / dj).clamp(0, 15) as u8;
        }
    }
    let qs = &mut out[16..144];
    for g in 0..4 {
        for k in 0..32 {
            qs[32 * g + k] = l[64 * g + k] | (l[64 * g + 32 + k] << 4);
        }
    }
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
            row_bytes(GgmlType::Iq3S, 256),
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
