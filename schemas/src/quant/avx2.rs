//! AVX2 versions of the Q8_0 and Q4_K dot products: the same lanes, the same operations in
//! the same order as [`dot_row_body`] (no fused multiply-add), so results are bit-identical
//! to the portable build; other types use `dot_row_body` compiled for AVX2.
//! Invariant: every function needs AVX2, which `super::dot_row` checks before calling in.

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
                        p = _mm256_add_ps(p, _mm256_mul_ps(q, f32x8(arr(&xb[8 * j..8 * j + 8]))));
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
                        let first = _mm256_sub_ps(_mm256_mul_ps(d1, qa), _mm256_mul_ps(mm1, sa));
                        let second = _mm256_sub_ps(_mm256_mul_ps(d2, qh), _mm256_mul_ps(mm2, sh));
                        tot = _mm256_add_ps(tot, _mm256_add_ps(first, second));
                    }
                }
                hsum(tot)
            }
            _ => dot_row_body(ty, row, x),
        }
    }
}
