//! Valid random blocks of any supported type, drawn directly in the quantized domain: random
//! quants, grid indices and signs, with each block's float scales set so its dequantized
//! values have a chosen root mean square (and a mean near zero). This is how the random model
//! writer fills types that have no quantizer here (the i-quants, Q2_K, Q3_K), and how tests
//! get blocks that exercise every bit of a layout.
//! Invariant: every block written decodes to finite values (all scales are finite f16 / e8m0
//! values; every index field is as wide as its table).

use super::{block_decoder, iquants, QuantError};
use crate::ggml::GgmlType;
use half::f16;

/// Where a block keeps its float scales, and the "unit" value each starts from before the
/// block is rescaled (mins are chosen so that a random block's mean is near zero).
#[derive(Clone, Copy)]
enum Scale {
    /// An f16 at this byte offset.
    F16 { off: usize, unit: f32 },
    /// IQ1_M's f16, spread over the top nibbles of the four u16 at bytes 48..56.
    Iq1M,
    /// MXFP4's e8m0 exponent at byte 0.
    E8m0,
}

fn scales(ty: GgmlType) -> &'static [Scale] {
    use GgmlType::*;
    const D0: Scale = Scale::F16 { off: 0, unit: 1.0 };
    match ty {
        Q4_0 | Q5_0 | Q8_0 | Iq4Nl | Iq2Xxs | Iq2Xs | Iq2S | Iq3Xxs | Iq3S | Iq1S | Iq4Xs => &[D0],
        // x = d sc q - dmin m with 6-bit sc and m: a mean of zero needs dmin = d * E[q].
        Q4K => &[D0, Scale::F16 { off: 2, unit: 7.5 }],
        Q5K => &[D0, Scale::F16 { off: 2, unit: 15.5 }],
        // x = d q + m: m = -d * E[q] centres the block.
        Q4_1 => &[D0, Scale::F16 { off: 2, unit: -7.5 }],
        Q5_1 => &[
            D0,
            Scale::F16 {
                off: 2,
                unit: -15.5,
            },
        ],
        // E[q] = 1.5 and E[scale] = E[min] = 7.5.
        Q2K => &[
            Scale::F16 { off: 80, unit: 1.0 },
            Scale::F16 { off: 82, unit: 1.5 },
        ],
        Q3K => &[Scale::F16 {
            off: 108,
            unit: 1.0,
        }],
        Q6K => &[Scale::F16 {
            off: 208,
            unit: 1.0,
        }],
        Iq1M => &[Scale::Iq1M],
        MXFP4 => &[Scale::E8m0],
        _ => &[],
    }
}

fn write_f16(b: &mut [u8], off: usize, v: f32) {
    b[off..off + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

fn write_iq1m_d(b: &mut [u8], v: f32) {
    let bits = f16::from_f32(v).to_bits();
    for i in 0..4 {
        let at = 48 + 2 * i;
        let low = u16::from_le_bytes([b[at], b[at + 1]]) & 0x0FFF;
        let top = (bits >> (4 * i)) & 0xF;
        b[at..at + 2].copy_from_slice(&(low | (top << 12)).to_le_bytes());
    }
}

/// Writes every scale of block `b` as its unit value times `factor`.
fn set_scales(ty: GgmlType, b: &mut [u8], factor: f32) {
    for s in scales(ty) {
        match *s {
            Scale::F16 { off, unit } => write_f16(b, off, unit * factor),
            Scale::Iq1M => write_iq1m_d(b, factor),
            Scale::E8m0 => {
                // Unit exponent 128 is a scale of 1.0: the nearest power of two to `factor`.
                let e = 128.0 + factor.log2().round();
                b[0] = e.clamp(1.0, 254.0) as u8;
            }
        }
    }
}

/// Fills `out`, a whole row of `ty` (a multiple of its block bytes), with valid random blocks
/// whose values have a root mean square of about `rms` each: random bytes, then each block's
/// scales set to `unit * rms / (the block's rms at unit scales)`. `next_u64` supplies the
/// randomness (deterministic callers pass a seeded generator). F32/F16/BF16 rows and types
/// without a decoder are refused.
pub fn random_row(
    ty: GgmlType,
    rms: f32,
    next_u64: &mut dyn FnMut() -> u64,
    out: &mut [u8],
) -> Result<(), QuantError> {
    let (be, bb, decode) = block_decoder(ty).ok_or(QuantError::Unsupported { ty })?;
    if out.len() % bb != 0 {
        return Err(QuantError::ByteLength {
            ty,
            n: out.len() / bb * be,
            expected: out.len() / bb * bb,
            got: out.len(),
        });
    }
    let mut vals = [0f32; super::QK_K];
    for blk in out.chunks_exact_mut(bb) {
        for chunk in blk.chunks_mut(8) {
            let r = next_u64().to_le_bytes();
            chunk.copy_from_slice(&r[..chunk.len()]);
        }
        set_scales(ty, blk, 1.0);
        decode(blk, &mut vals[..be]);
        let ms = vals[..be]
            .iter()
            .map(|v| f64::from(*v).powi(2))
            .sum::<f64>()
            / be as f64;
        let factor = if ms > 0.0 {
            (f64::from(rms) / ms.sqrt()) as f32
        } else {
            0.0
        };
        set_scales(ty, blk, factor);
    }
    Ok(())
}

/// The f16 scale bits IQ1_M keeps across its scale bytes (for tests of the layout).
#[doc(hidden)]
pub fn iq1_m_scale(block: &[u8]) -> f32 {
    f16::from_bits(iquants::iq1_m_d_bits(&block[48..56])).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize_row, SUPPORTED};

    #[test]
    fn random_rows_are_finite_non_zero_and_near_the_asked_rms() {
        let mut s = 0x1234_5678u64;
        let mut next = move || {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        for &ty in SUPPORTED {
            if ty.block_elems() == 1 {
                assert!(random_row(ty, 1.0, &mut next, &mut [0u8; 8]).is_err());
                continue;
            }
            let n = 4096;
            let mut row = vec![0u8; ty.bytes_for(n as u64).unwrap() as usize];
            random_row(ty, 0.02, &mut next, &mut row).unwrap();
            let mut y = vec![0f32; n];
            dequantize_row(ty, &row, &mut y).unwrap();
            assert!(y.iter().all(|v| v.is_finite()), "{ty}");
            let mean = y.iter().sum::<f32>() / n as f32;
            let rms = (y.iter().map(|v| v * v).sum::<f32>() / n as f32).sqrt();
            // f16 rounding of the scales, and MXFP4's power-of-two scale (within sqrt 2).
            let (lo, hi) = if ty == GgmlType::MXFP4 {
                (0.013, 0.03)
            } else {
                (0.019, 0.021)
            };
            assert!((lo..hi).contains(&rms), "{ty}: rms {rms}");
            assert!(mean.abs() < 0.004, "{ty}: mean {mean}");
        }
    }

    #[test]
    fn iq1_m_scale_round_trips_through_the_nibbles() {
        let mut b = [0xA5u8; 56];
        write_iq1m_d(&mut b, 0.375);
        assert_eq!(iq1_m_scale(&b), 0.375);
        assert_eq!(b[48], 0xA5, "low bits kept");
    }
}
