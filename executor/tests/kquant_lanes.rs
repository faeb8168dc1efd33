//! A host model of the K-quant (and IQ3_S) decode kernels' lane mapping (products.cuh's `dq_kq_oa`,
//! `dq_kq_gap` and `dq_kq_lane`, moe.cu's `dq_moe_down_kq_part` work split), transcribed
//! operation for operation, checked against the CPU reference decoder on random blocks: the
//! 32 lanes of a super-block read each of its 256 weights exactly once, at the column the
//! kernel dots it with, with the value the reference decodes (bit for bit). Runs anywhere; the
//! kernels themselves are checked against the CPU on a GPU by `backend_ops`.
//! Invariant: a change to the mapping in the .cu sources is mirrored here.

use rand::{rngs::StdRng, Rng, SeedableRng};
use strata_exec::quant;
use strata_schemas::ggml::GgmlType;

/// `common.cuh`'s `st_u8x4_to_f32`: the four bytes of `q`, less `sub`.
fn u8x4(q: u32, sub: f32) -> [f32; 4] {
    std::array::from_fn(|k| ((q >> (8 * k)) & 0xff) as f32 - sub)
}

fn u16_at(b: &[u8], o: usize) -> u32 {
    u16::from_le_bytes([b[o], b[o + 1]]) as u32
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u16_at(b, o) | (u16_at(b, o + 2) << 16)
}

fn h2f(b: &[u8], o: usize) -> f32 {
    half::f16::from_bits(u16_at(b, o) as u16).to_f32()
}

/// `st_scale_min_k4`.
fn scale_min(j: usize, q: &[u8]) -> (f32, f32) {
    let (sc, m) = quant::get_scale_min_k4(j, q);
    (sc as f32, m as f32)
}

/// `dq_kq_oa` and `dq_kq_gap`.
fn oa_gap(ty: GgmlType, l: usize) -> (usize, usize) {
    if ty == GgmlType::Iq3S {
        (8 * l, 4)
    } else if ty == GgmlType::Q6K {
        (128 * (l >> 4) + 32 * ((l >> 3) & 1) + 4 * (l & 7), 64)
    } else {
        (64 * (l >> 3) + 4 * (l & 7), 32)
    }
}

/// `dq_kq_lane`: (qa, qb, ka, kb, ma, mb) of lane `l` over block `b`.
fn lane(ty: GgmlType, b: &[u8], l: usize) -> ([f32; 4], [f32; 4], f32, f32, f32, f32) {
    if ty == GgmlType::Iq3S {
        let (gi, h) = (l >> 2, l & 3);
        let k = 8 * gi + 2 * h;
        let qs = u16_at(b, 2 + k);
        let qh = b[66 + gi] as u32;
        let g0 = quant::IQ3S_GRID[((qs & 0xff) | (((qh >> (2 * h)) & 1) << 8)) as usize];
        let g1 = quant::IQ3S_GRID[((qs >> 8) | (((qh >> (2 * h + 1)) & 1) << 8)) as usize];
        let sg = b[74 + 4 * gi + h] as u32;
        let (mut qa, mut qb) = (u8x4(g0, 0.0), u8x4(g1, 0.0));
        for j in 0..4 {
            if (sg >> j) & 1 == 1 {
                qa[j] = -qa[j];
            }
            if (sg >> (j + 4)) & 1 == 1 {
                qb[j] = -qb[j];
            }
        }
        let sc = (b[106 + (gi >> 1)] >> (4 * (gi & 1))) & 15;
        let ka = h2f(b, 0) * (1 + 2 * sc as u32) as f32;
        return (qa, qb, ka, ka, 0.0, 0.0);
    }
    if ty == GgmlType::Q6K {
        let (n, h, j) = (l >> 4, (l >> 3) & 1, 4 * (l & 7));
        let ql = u32_at(b, 64 * n + 32 * h + j);
        let qh = u32_at(b, 128 + 32 * n + j);
        let qa = u8x4(
            (ql & 0x0F0F_0F0F) | (((qh >> (2 * h)) & 0x0303_0303) << 4),
            32.0,
        );
        let qb = u8x4(
            ((ql >> 4) & 0x0F0F_0F0F) | (((qh >> (4 + 2 * h)) & 0x0303_0303) << 4),
            32.0,
        );
        let d = h2f(b, 208);
        let s = 8 * n + 2 * h + ((l & 7) >> 2);
        let ka = d * (b[192 + s] as i8) as f32;
        let kb = d * (b[192 + s + 4] as i8) as f32;
        return (qa, qb, ka, kb, 0.0, 0.0);
    }
    let (g, j) = (l >> 3, 4 * (l & 7));
    let (d, dmin) = (h2f(b, 0), h2f(b, 2));
    let (sc0, m0) = scale_min(2 * g, &b[4..16]);
    let (sc1, m1) = scale_min(2 * g + 1, &b[4..16]);
    let (qa, qb) = if ty == GgmlType::Q5K {
        let qs = u32_at(b, 48 + 32 * g + j);
        let qh = u32_at(b, 16 + j);
        (
            (qs & 0x0F0F_0F0F) | (((qh >> (2 * g)) & 0x0101_0101) << 4),
            ((qs >> 4) & 0x0F0F_0F0F) | (((qh >> (2 * g + 1)) & 0x0101_0101) << 4),
        )
    } else {
        let qs = u32_at(b, 16 + 32 * g + j);
        (qs & 0x0F0F_0F0F, (qs >> 4) & 0x0F0F_0F0F)
    };
    (
        u8x4(qa, 0.0),
        u8x4(qb, 0.0),
        d * sc0,
        d * sc1,
        dmin * m0,
        dmin * m1,
    )
}

#[test]
fn every_weight_of_a_kquant_block_is_read_once_with_the_reference_value() {
    let mut rng = StdRng::seed_from_u64(19);
    for ty in [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K, GgmlType::Iq3S] {
        let bytes = quant::row_bytes(ty, 256).unwrap();
        for trial in 0..200 {
            let mut blk = vec![0u8; bytes];
            let mut next = || rng.random::<u64>();
            quant::random::random_row(ty, 0.5, &mut next, &mut blk).unwrap();
            let mut want = vec![0f32; 256];
            quant::dequantize_row(ty, &blk, &mut want).unwrap();
            let mut got = [f32::NAN; 256];
            let mut seen = [0u8; 256];
            for l in 0..32 {
                let (oa, gap) = oa_gap(ty, l);
                assert_eq!(oa % 4, 0, "{ty} lane {l}: runs start on a float4");
                let (qa, qb, ka, kb, ma, mb) = lane(ty, &blk, l);
                for k in 0..4 {
                    // The kernel's f32 value of each weight: ka * qa - ma (the reference's
                    // dl * q - ml, the same operations).
                    got[oa + k] = ka * qa[k] - ma;
                    got[oa + gap + k] = kb * qb[k] - mb;
                    seen[oa + k] += 1;
                    seen[oa + gap + k] += 1;
                }
            }
            assert!(
                seen.iter().all(|&s| s == 1),
                "{ty}: columns read other than once: {seen:?}"
            );
            for i in 0..256 {
                assert_eq!(
                    got[i].to_bits(),
                    want[i].to_bits(),
                    "{ty} trial {trial} value {i}: lane model {} vs reference {}",
                    got[i],
                    want[i]
                );
            }
        }
    }
}

/// `dq_moe_down_kq_part`'s split of k experts' super-blocks over a block's warps (each warp
/// reading `ST_WARP / 32` blocks a step): every (expert, block) pair once, for both wave
/// sizes and the shapes the launcher allows (k up to 32).
#[test]
fn moe_down_work_split_covers_every_expert_block_once() {
    for wave in [32usize, 64] {
        let warps = 128 / wave;
        let span = wave / 32;
        for k in 1..=32usize {
            for nb in 1..=8usize {
                let mut seen = vec![0u8; k * nb];
                for warp in 0..warps {
                    for lane in (0..wave).step_by(32) {
                        let mut p = warp * span + (lane >> 5);
                        while p < k * nb {
                            let (j, b) = (p / nb, p % nb);
                            seen[j * nb + b] += 1;
                            p += warps * span;
                        }
                    }
                }
                assert!(seen.iter().all(|&s| s == 1), "wave {wave} k {k} nb {nb}");
            }
        }
    }
}
