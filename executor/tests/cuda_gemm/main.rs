//! GPU tests of the prefill tensor-core products (`backend::cuda::gemm`): the dense GEMM for
//! Q8_0 (split device layout), Q4_K and BF16 weights, `moe_sort` and the grouped `moe_gemm`
//! (and its fused SwiGLU form), each
//! against a host reference (`quant::dequantize_row` + f64 matmul) on fresh random inputs
//! with odd sizes, ragged tails, empty experts and one expert taking every token; then
//! timings at Qwen3-30B-A3B's shapes. `any_load.rs`: the any-type products' pipelined and
//! synchronous weight loaders (IQ3_S, Q6_K, Q5_K, IQ4_XS) against the CPU and each other,
//! and timed at Qwen3-Next-80B-A3B's expert shapes.
//! Invariant: without a usable CUDA device each test prints `SKIP (no CUDA device): ...` to
//! stderr and returns. Run on a GPU machine with
//! `cargo test -p strata-exec --release --test cuda_gemm -- --test-threads=1 --nocapture`.
//!
//! Tolerances (u = unit roundoff of the 16-bit input type): Q8_0 weights run in f16 (the
//! dequantized weight and x are each rounded once, u = 2^-11), BF16 weights in bf16 (x rounded,
//! u = 2^-8); products are exact and summed in f32. The error of one output is then about
//! u * sqrt(sum (w x)^2) (random-sign rounding), which is ~ u * sqrt(cols) * rms(w x); we
//! assert |err| <= 8u * sqrt(sum (w x)^2) (Q8_0) or 6u * sqrt(...) (BF16), about 7 and 10
//! standard deviations, plus 1e-6 * sum |w x| for f32 summation. Q4_K runs in f16 too, but its
//! weight is fma(q, f16(d sc), -f16(dmin m)): the two rounded sub-block factors add errors
//! that are shared by the 32 columns of a sub-block (each about one more u * sqrt(sum (w x)^2)
//! at these random rows, ~1.7 in all), so Q4_K is held to 12u * sqrt(...), about 7 deviations.
#![cfg(feature = "cuda")]

mod any_load;
#[path = "../cuda_common/mod.rs"]
mod cuda_common;
mod timings;
use cuda_common::{get, put, rand_vec, Carve};
use rand::{rngs::StdRng, Rng, SeedableRng};
use rayon::prelude::*;
use std::sync::OnceLock;
use strata_exec::backend::cuda::gemm::{
    gemm_scratch_bytes, moe_scratch_bytes, AnyLoad, ExpertSource, GemmTile, MoeInput, MoeScratch,
    GEMM_BN, MOE_DEFAULT_TILE,
};
use strata_exec::backend::cuda::layout;
use strata_exec::backend::cuda::{CudaDevice, DeviceArena, DeviceView};
use strata_exec::quant;
use strata_schemas::ggml::GgmlType;

static DEV: OnceLock<Result<CudaDevice, String>> = OnceLock::new();

fn dev(test: &str) -> Option<&'static CudaDevice> {
    cuda_common::device_or_skip(&DEV, test, || {
        let dir = std::env::temp_dir().join(format!("strata-kcache-gemm-{}", std::process::id()));
        std::env::set_var("STRATA_KERNEL_CACHE", &dir);
        let t = std::time::Instant::now();
        let d = CudaDevice::open(0).map_err(|e| e.to_string())?;
        eprintln!(
            "device: {} ({}), NVRTC {:?}, kernels ready in {:.2}s",
            d.name(),
            d.arch(),
            d.nvrtc_version(),
            t.elapsed().as_secs_f64()
        );
        Ok(d)
    })
}

/// `mats` random matrices of `rows × cols` of `ty`: (device-layout bytes, dequantized f32).
fn weights(
    rng: &mut StdRng,
    ty: GgmlType,
    mats: usize,
    rows: usize,
    cols: usize,
) -> (Vec<u8>, Vec<f32>) {
    let mut gguf = Vec::new();
    let mut deq = vec![0f32; mats * rows * cols];
    let rb = quant::row_bytes(ty, cols).unwrap();
    for r in 0..mats * rows {
        let s = 0.2 + 2.0 * rng.random::<f32>();
        let row: Vec<f32> = (0..cols)
            .map(|_| s * (2.0 * rng.random::<f32>() - 1.0))
            .collect();
        let at = gguf.len();
        quant::quantize_row(ty, &row, &mut gguf).unwrap();
        assert_eq!(gguf.len() - at, rb);
        quant::dequantize_row(ty, &gguf[at..], &mut deq[r * cols..(r + 1) * cols]).unwrap();
    }
    let mut dev = vec![0u8; gguf.len()];
    layout::to_device(ty, &gguf, mats, rows, cols, &mut dev).unwrap();
    (dev, deq)
}

/// Reference `y[i][r] = sum_c w[r][c] x[i][c]` in f64 with sqrt(sum (w x)^2) and sum |w x|.
fn reference(w: &[f32], rows: usize, cols: usize, x: &[f32]) -> Vec<(f64, f64, f64)> {
    x.par_chunks(cols)
        .flat_map_iter(|xr| {
            (0..rows).map(move |r| {
                let wr = &w[r * cols..(r + 1) * cols];
                let (mut s, mut s2, mut sa) = (0f64, 0f64, 0f64);
                for (a, b) in wr.iter().zip(xr) {
                    let p = *a as f64 * *b as f64;
                    s += p;
                    s2 += p * p;
                    sa += p.abs();
                }
                (s, s2.sqrt(), sa)
            })
        })
        .collect()
}

fn unit(ty: GgmlType) -> (f64, f64) {
    // (unit roundoff, multiple of it allowed per sqrt(sum (w x)^2))
    match ty {
        GgmlType::BF16 => (2f64.powi(-8), 6.0),
        GgmlType::Q4K => (2f64.powi(-11), 12.0),
        _ => (2f64.powi(-11), 8.0),
    }
}

/// Checks got against the reference; returns the largest |err| / (u sqrt(sum (w x)^2)).
fn check(what: &str, ty: GgmlType, got: &[f32], want: &[(f64, f64, f64)]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let (u, m) = unit(ty);
    let mut worst = 0f64;
    for (i, (g, &(w, n2, na))) in got.iter().zip(want).enumerate() {
        let e = (*g as f64 - w).abs();
        let tol = m * u * n2 + 1e-6 * na + 1e-6;
        assert!(
            g.is_finite() && e <= tol,
            "{what}: element {i}: got {g}, want {w} (err {e:.3e}, tol {tol:.3e})"
        );
        worst = worst.max(e / (u * n2 + 1e-30));
    }
    worst
}

const GUARD: f32 = -12345.5;

#[test]
fn dense_gemm_q8_0_q4_k_and_bf16_odd_shapes_match_cpu() {
    let Some(d) = dev("dense_gemm") else { return };
    let mut rng = StdRng::seed_from_u64(11);
    let a = d.alloc_arena("gemm-test", 256 << 20).unwrap();
    let cases: &[(GgmlType, &[(usize, usize)])] = &[
        // (rows, cols): rows not multiples of 64/128, K tails of 32 (Q8_0), odd block
        // counts (cols 96, 160: the unaligned scale path), K tails of 8 (BF16 cols 72).
        (
            GgmlType::Q8_0,
            &[
                (1, 32),
                (33, 64),
                (129, 96),
                (257, 160),
                (100, 2080),
                (768, 2048),
            ],
        ),
        // Q4_K: columns multiples of 256 (one to nine blocks; 768 and 2304 odd block counts).
        (
            GgmlType::Q4K,
            &[
                (1, 256),
                (33, 512),
                (129, 256),
                (257, 768),
                (100, 2304),
                (768, 2048),
            ],
        ),
        (
            GgmlType::BF16,
            &[(1, 8), (45, 72), (130, 64), (257, 200), (768, 2048)],
        ),
    ];
    for &(ty, shapes) in cases {
        let mut worst = 0f64;
        for &(rows, cols) in shapes {
            let (wb, deq) = weights(&mut rng, ty, 1, rows, cols);
            for &n_tok in &[1usize, 7, 33, 64, 65, 512] {
                if rows * cols * n_tok > 300_000_000 {
                    continue;
                }
                let c = Carve::new(&a);
                let x = rand_vec(&mut rng, n_tok * cols, 1.0);
                let want = reference(&deq, rows, cols, &x);
                let (wv, xv) = (put(d, &c, &wb), put(d, &c, &x));
                let sv = c.take(gemm_scratch_bytes(n_tok, cols));
                // y with 64 guard floats after it: nothing past n_tok x rows may be written.
                let ny = n_tok * rows;
                let yall = put(d, &c, &vec![GUARD; ny + 64]);
                let yv = yall.sub(0, 4 * ny as u64).unwrap();
                for tile in [
                    None,
                    Some(GemmTile::M64),
                    Some(GemmTile::M128),
                    Some(GemmTile::M128W),
                ] {
                    d.memset(yv, 0xff).unwrap();
                    match tile {
                        None => d.gemm(wv, ty, rows, cols, xv, n_tok, yv, sv).unwrap(),
                        Some(t) => {
                            d.gemm_convert_x(xv, n_tok, cols, ty, sv).unwrap();
                            d.gemm_converted(
                                t,
                                AnyLoad::default(),
                                wv,
                                ty,
                                rows,
                                cols,
                                sv,
                                n_tok,
                                yv,
                                false,
                            )
                            .unwrap()
                        }
                    }
                    let got: Vec<f32> = get(d, yall, ny + 64);
                    let what =
                        format!("gemm {ty} rows={rows} cols={cols} n_tok={n_tok} tile={tile:?}");
                    worst = worst.max(check(&what, ty, &got[..ny], &want));
                    assert!(
                        got[ny..].iter().all(|v| *v == GUARD),
                        "{what}: wrote past y"
                    );
                }
                // Added into y (the output projection's residual): y0 + W x, where y0 is
                // what y held, with each element written once (one K part).
                let y0 = rand_vec(&mut rng, ny, 1.0);
                d.htod(&y0, yv).unwrap();
                let tile = d.gemm_default_tile(ty, rows, n_tok);
                d.gemm_convert_x(xv, n_tok, cols, ty, sv).unwrap();
                d.gemm_converted(
                    tile,
                    AnyLoad::default(),
                    wv,
                    ty,
                    rows,
                    cols,
                    sv,
                    n_tok,
                    yv,
                    true,
                )
                .unwrap();
                let got: Vec<f32> = get(d, yall, ny + 64);
                let added: Vec<f32> = got[..ny].iter().zip(&y0).map(|(g, a)| g - a).collect();
                let what = format!("gemm {ty} rows={rows} cols={cols} n_tok={n_tok} added into y");
                worst = worst.max(check(&what, ty, &added, &want));
                assert!(
                    got[ny..].iter().all(|v| *v == GUARD),
                    "{what}: wrote past y"
                );
            }
        }
        eprintln!(
            "PASS gemm {ty}: shapes {shapes:?}, tokens 1,7,33,64,65,512, tiles default/64/128/128w: max err = {worst:.2} u*sqrt(sum (wx)^2) (tol {})",
            unit(ty).1
        );
    }
    // Refusals before launch: short views, unsupported types, bad columns.
    let c = Carve::new(&a);
    let (wb, _) = weights(&mut rng, GgmlType::Q8_0, 1, 64, 64);
    let (wv, xv) = (put(d, &c, &wb), put(d, &c, &vec![0f32; 8 * 64]));
    let (yv, sv) = (c.take(4 * 8 * 64), c.take(gemm_scratch_bytes(8, 64)));
    assert!(d
        .gemm(
            wv,
            GgmlType::Q8_0,
            64,
            64,
            xv,
            8,
            yv.sub(0, 16).unwrap(),
            sv
        )
        .is_err());
    assert!(d
        .gemm(
            wv,
            GgmlType::Q8_0,
            64,
            64,
            xv,
            8,
            yv,
            sv.sub(0, 16).unwrap()
        )
        .is_err());
    assert!(d.gemm(wv, GgmlType::Q8_0, 65, 64, xv, 8, yv, sv).is_err());
    // Q4_K needs whole 256-column blocks: 8 x 128 is refused, and the message names the shape.
    let e = d
        .gemm(wv, GgmlType::Q4K, 8, 128, xv, 2, yv, sv)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("8 x 128") && e.contains("256"),
        "Q4_K 8 x 128 refusal: {e}"
    );
    eprintln!("refused as it should: {e}");
    // A type no decoder reads (every decoded type has the any-type kernels).
    let e = d
        .gemm(wv, GgmlType::Tq1_0, 8, 256, xv, 2, yv, sv)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no tensor-core kernel"), "TQ1_0 refusal: {e}");
    assert!(d.gemm(wv, GgmlType::BF16, 8, 12, xv, 2, yv, sv).is_err());
    eprintln!(
        "PASS gemm refusals: short y, short scratch, short w, Q4_K 8 x 128, TQ1_0, BF16 cols 12"
    );
}

/// Expected sort: counts, and the set of assignments per expert.
fn check_sort(
    d: &CudaDevice,
    sv: DeviceView<'_>,
    ids: &[i32],
    n_tok: usize,
    k: usize,
    ne: usize,
    what: &str,
) {
    let lay = MoeScratch::new(n_tok, k, ne);
    let words: Vec<i32> = get(d, sv, (lay.bytes / 4) as usize);
    let at = |b: u64| (b / 4) as usize;
    let offsets = &words[at(lay.offsets)..at(lay.offsets) + ne + 1];
    let perm = &words[at(lay.perm)..at(lay.perm) + lay.n_assign];
    let n_tiles = words[at(lay.n_tiles)] as usize;
    let tiles = &words[at(lay.tiles)..at(lay.tiles) + 2 * n_tiles];
    let mut counts = vec![0usize; ne];
    for &e in ids {
        if (0..ne as i32).contains(&e) {
            counts[e as usize] += 1;
        }
    }
    let mut o = 0usize;
    let mut want_tiles = Vec::new();
    for e in 0..ne {
        assert_eq!(offsets[e] as usize, o, "{what}: offsets[{e}]");
        let mut seg: Vec<i32> = perm[o..o + counts[e]].to_vec();
        seg.sort_unstable();
        let want: Vec<i32> = (0..ids.len() as i32)
            .filter(|&a| ids[a as usize] == e as i32)
            .collect();
        assert_eq!(seg, want, "{what}: expert {e}'s assignments");
        for i in 0..counts[e].div_ceil(GEMM_BN) {
            want_tiles.extend([e as i32, (o + i * GEMM_BN) as i32]);
        }
        o += counts[e];
    }
    assert_eq!(offsets[ne] as usize, o, "{what}: valid total");
    assert!(
        n_tiles <= lay.max_tiles,
        "{what}: {n_tiles} tiles > bound {}",
        lay.max_tiles
    );
    assert_eq!(tiles, &want_tiles[..], "{what}: tile list");
}

#[test]
fn moe_sort_groups_assignments_by_expert() {
    let Some(d) = dev("moe_sort") else { return };
    let mut rng = StdRng::seed_from_u64(12);
    let a = d.alloc_arena("sort-test", 16 << 20).unwrap();
    let mut n_cases = 0;
    for &(n_tok, k, ne) in &[
        (1usize, 1usize, 1usize),
        (7, 2, 4),
        (33, 8, 128),
        (512, 8, 128),
        (1024, 8, 128),
        (100, 4, 1000),
        (64, 2, 4096),
    ] {
        for mode in 0..4 {
            let n = n_tok * k;
            let ids: Vec<i32> = (0..n)
                .map(|i| match mode {
                    0 => rng.random_range(0..ne as i32),
                    1 => (ne / 2) as i32, // one expert takes all
                    2 => (rng.random_range(0..3) * (ne / 3).max(1)) as i32 % ne as i32, // most experts empty
                    _ => {
                        if i % 5 == 0 {
                            -1
                        } else {
                            rng.random_range(0..ne as i32 + 1)
                        }
                    } // invalid ids
                })
                .collect();
            let c = Carve::new(&a);
            let iv = put(d, &c, &ids);
            let sv = c.take(moe_scratch_bytes(n_tok, k, ne));
            d.memset(sv, 0xff).unwrap();
            d.moe_sort(iv, n_tok, k, ne, sv).unwrap();
            check_sort(
                d,
                sv,
                &ids,
                n_tok,
                k,
                ne,
                &format!("moe_sort n_tok={n_tok} k={k} experts={ne} mode={mode}"),
            );
            n_cases += 1;
        }
    }
    let c = Carve::new(&a);
    let iv = put(d, &c, &[0i32; 4]);
    let sv = c.take(moe_scratch_bytes(2, 2, 8));
    assert!(
        d.moe_sort(iv, 2, 2, 8, sv.sub(0, 16).unwrap()).is_err(),
        "short scratch"
    );
    assert!(d.moe_sort(iv, 2, 2, 5000, sv).is_err(), "too many experts");
    eprintln!("PASS moe_sort: {n_cases} cases (random, one expert takes all, most experts empty, invalid ids), offsets/perm/tiles exact");
}

#[allow(clippy::too_many_arguments)]
fn moe_case(
    d: &CudaDevice,
    a: &DeviceArena,
    rng: &mut StdRng,
    ty: GgmlType,
    ne: usize,
    rows: usize,
    cols: usize,
    n_tok: usize,
    k: usize,
    ids: &[i32],
    tile: GemmTile,
) -> f64 {
    let (wb, deq) = weights(rng, ty, ne, rows, cols);
    let n_assign = n_tok * k;
    let mut worst = 0f64;
    for input in [MoeInput::Gather, MoeInput::Direct] {
        let x_rows = if input == MoeInput::Gather {
            n_tok
        } else {
            n_assign
        };
        let x = rand_vec(rng, x_rows * cols, 1.0);
        // Reference per assignment.
        let mut want = Vec::with_capacity(n_assign * rows);
        for (asg, &e) in ids.iter().enumerate() {
            let e = e as usize;
            let xr = if input == MoeInput::Gather {
                asg / k
            } else {
                asg
            };
            want.extend(reference(
                &deq[e * rows * cols..(e + 1) * rows * cols],
                rows,
                cols,
                &x[xr * cols..(xr + 1) * cols],
            ));
        }
        let c = Carve::new(a);
        let (wv, xv, iv) = (put(d, &c, &wb), put(d, &c, &x), put(d, &c, ids));
        let sorted = c.take(moe_scratch_bytes(n_tok, k, ne));
        let sv = c.take(gemm_scratch_bytes(x_rows, cols));
        let ny = n_assign * rows;
        let yall = put(d, &c, &vec![GUARD; ny + 64]);
        let yv = yall.sub(0, 4 * ny as u64).unwrap();
        d.moe_sort(iv, n_tok, k, ne, sorted).unwrap();
        if tile == MOE_DEFAULT_TILE {
            d.moe_gemm(wv, ty, ne, rows, cols, xv, input, n_tok, k, sorted, yv, sv)
                .unwrap();
        } else {
            d.gemm_convert_x(xv, x_rows, cols, ty, sv).unwrap();
            d.moe_gemm_converted(
                tile,
                AnyLoad::default(),
                wv,
                None,
                ty,
                ne,
                rows,
                cols,
                sv,
                input,
                n_tok,
                k,
                sorted,
                yv,
            )
            .unwrap();
        }
        let got: Vec<f32> = get(d, yall, ny + 64);
        let what = format!("moe_gemm {ty} {input:?} experts={ne} rows={rows} cols={cols} n_tok={n_tok} k={k} tile={tile:?}");
        worst = worst.max(check(&what, ty, &got[..ny], &want));
        assert!(
            got[ny..].iter().all(|v| *v == GUARD),
            "{what}: wrote past y"
        );
        if tile != GemmTile::M64 {
            continue;
        }
        // Fused gate (wb) + up (a second tensor): h = silu(g) * u.
        let (ub, udeq) = weights(rng, ty, ne, rows, cols);
        let uv = put(d, &c, &ub);
        d.memset(yv, 0xff).unwrap();
        d.moe_gemm_glu(
            wv, uv, ty, ne, rows, cols, xv, input, n_tok, k, sorted, yv, sv,
        )
        .unwrap();
        let got: Vec<f32> = get(d, yall, ny + 64);
        let (u, m) = unit(ty);
        let mut worst_glu = 0f64;
        for (asg, &e) in ids.iter().enumerate() {
            let e = e as usize;
            let xr = if input == MoeInput::Gather {
                asg / k
            } else {
                asg
            };
            let xs = &x[xr * cols..(xr + 1) * cols];
            let wu = reference(
                &udeq[e * rows * cols..(e + 1) * rows * cols],
                rows,
                cols,
                xs,
            );
            for r in 0..rows {
                let (g, g2, ga) = want[asg * rows + r];
                let (uu, u2, ua) = wu[r];
                let sg = g / (1.0 + (-g).exp());
                let h = sg * uu;
                let (tg, tu) = (m * u * g2 + 1e-6 * ga + 1e-6, m * u * u2 + 1e-6 * ua + 1e-6);
                let tol = 1.1 * (uu.abs() + tu) * tg + sg.abs() * tu + 1e-6 * h.abs();
                let o = got[asg * rows + r] as f64;
                assert!(
                    o.is_finite() && (o - h).abs() <= tol,
                    "{what} GLU: [{asg}][{r}] got {o}, want {h} (tol {tol:.3e})"
                );
                worst_glu = worst_glu.max((o - h).abs() / tol);
            }
        }
        assert!(
            got[ny..].iter().all(|v| *v == GUARD),
            "{what} GLU: wrote past y"
        );
        if worst_glu > 0.5 {
            eprintln!("NOTE {what} GLU: largest error {worst_glu:.2} of its tolerance");
        }
    }
    worst
}

#[test]
fn moe_gemm_gather_and_direct_match_cpu() {
    let Some(d) = dev("moe_gemm") else { return };
    let mut rng = StdRng::seed_from_u64(13);
    let a = d.alloc_arena("moe-test", 512 << 20).unwrap();
    for ty in [GgmlType::Q8_0, GgmlType::Q4K, GgmlType::BF16] {
        let mut worst = 0f64;
        let mut n = 0;
        // (experts, rows, cols): rows*cols/32*34 a multiple of 16 for Q8_0; Q4_K columns
        // multiples of 256 (1, 2 and 3 blocks).
        let shapes: &[(usize, usize, usize)] = if ty == GgmlType::Q4K {
            &[(8, 100, 256), (16, 72, 512), (4, 200, 768), (8, 768, 512)]
        } else {
            &[(8, 100, 64), (16, 72, 256), (4, 200, 96), (8, 768, 512)]
        };
        for &(ne, rows, cols) in shapes {
            for &(n_tok, k) in &[(1usize, 2usize), (7, 3), (33, 4), (200, 2)] {
                for mode in 0..3 {
                    let ids: Vec<i32> = (0..n_tok * k)
                        .map(|_| match mode {
                            0 => rng.random_range(0..ne as i32),
                            1 => (ne - 1) as i32, // one expert takes all
                            _ => rng.random_range(0..2) * 2 + 1, // experts 1 and 3 only
                        })
                        .collect();
                    for tile in [GemmTile::M64, GemmTile::M128, GemmTile::M128W] {
                        worst = worst.max(moe_case(
                            d, &a, &mut rng, ty, ne, rows, cols, n_tok, k, &ids, tile,
                        ));
                        n += 1;
                    }
                }
            }
        }
        eprintln!(
            "PASS moe_gemm {ty}: {n} cases x gather/direct (+ fused SwiGLU on the 64-row tile) (experts 4..16, rows 72..768, shapes {shapes:?}, n_tok 1..200, k 2..4, random / one expert / two experts, tiles 64/128/128w): max err = {worst:.2} u*sqrt(sum (wx)^2) (tol {})",
            unit(ty).1
        );
    }
    // A Q8_0 expert matrix whose size is not a multiple of 16 is refused.
    let c = Carve::new(&a);
    let (wb, _) = weights(&mut rng, GgmlType::Q8_0, 2, 7, 32);
    let wv = put(d, &c, &wb);
    let (xv, iv) = (c.take(4 * 32), put(d, &c, &[0i32, 1]));
    let (sorted, sv, yv) = (
        c.take(moe_scratch_bytes(1, 2, 2)),
        c.take(1024),
        c.take(4 * 14),
    );
    d.moe_sort(iv, 1, 2, 2, sorted).unwrap();
    assert!(d
        .moe_gemm(
            wv,
            GgmlType::Q8_0,
            2,
            7,
            32,
            xv,
            MoeInput::Gather,
            1,
            2,
            sorted,
            yv,
            sv
        )
        .is_err());
    eprintln!("PASS moe_gemm refusal: 7x32 Q8_0 experts (238 bytes each) misaligned");
}

/// One shape of `moe_gemm_through_an_expert_table_equals_the_strided_stacks`.
#[derive(Clone, Copy)]
struct TableCase {
    ty: GgmlType,
    ne: usize,
    n_tok: usize,
    k: usize,
    e: usize,
    f: usize,
}

/// Its device buffers: the stacks, the slots' table, the input, the sort and two outputs.
struct TableViews<'a> {
    gate: DeviceView<'a>,
    up: DeviceView<'a>,
    down: DeviceView<'a>,
    table: DeviceView<'a>,
    x: DeviceView<'a>,
    xh: DeviceView<'a>,
    sorted: DeviceView<'a>,
    y: [DeviceView<'a>; 2],
}

/// The fused gate-up and the down product, gather and direct, from the stacks and through
/// the table: bit-equal outputs. Returns the products compared.
fn table_case(d: &CudaDevice, t: &TableCase, v: &TableViews<'_>) -> usize {
    let TableCase {
        ty,
        ne,
        n_tok,
        k,
        e,
        f,
    } = *t;
    let (gv, uv, dv, tv, xv, xh, sorted) = (v.gate, v.up, v.down, v.table, v.x, v.xh, v.sorted);
    let [y1, y2] = v.y;
    let mut n_run = 0;
    // (source pair, rows, cols, input): gate-up fused, then down.
    for (fused, rows, cols, input) in [
        (true, f, e, MoeInput::Gather),
        (true, f, e, MoeInput::Direct),
        (false, e, f, MoeInput::Gather),
        (false, e, f, MoeInput::Direct),
    ] {
        let x_rows = if input == MoeInput::Gather {
            n_tok
        } else {
            n_tok * k
        };
        d.gemm_convert_x(xv, x_rows, cols, ty, xh).unwrap();
        let (stacks, tab) = if fused {
            (
                ExpertSource::Strided {
                    w: gv,
                    wu: Some(uv),
                    stride: 0,
                },
                ExpertSource::Table {
                    table: tv,
                    col: 0,
                    fused_up: true,
                },
            )
        } else {
            (
                ExpertSource::Strided {
                    w: dv,
                    wu: None,
                    stride: 0,
                },
                ExpertSource::Table {
                    table: tv,
                    col: 2,
                    fused_up: false,
                },
            )
        };
        let tile = if fused {
            GemmTile::M64
        } else {
            MOE_DEFAULT_TILE
        };
        let n = n_tok * k * rows;
        d.memset(y1, 0x7f).unwrap();
        d.memset(y2, 0x3f).unwrap();
        let run = |src, y| {
            d.moe_gemm_from(
                tile,
                AnyLoad::default(),
                src,
                ty,
                ne,
                rows,
                cols,
                xh,
                input,
                n_tok,
                k,
                sorted,
                y,
            )
            .unwrap()
        };
        run(stacks, y1);
        run(tab, y2);
        let (a1, a2): (Vec<f32>, Vec<f32>) = (get(d, y1, n), get(d, y2, n));
        let what = format!("{ty} experts={ne} n_tok={n_tok} k={k} fused={fused} {input:?}");
        assert!(
            a1.iter().all(|v| v.is_finite()),
            "{what}: stacks gave non-finite"
        );
        assert!(
            a1.iter().zip(&a2).all(|(p, q)| p.to_bits() == q.to_bits()),
            "{what}: the table's outputs differ from the stacks'"
        );
        n_run += 1;
    }
    n_run
}

/// The grouped products reading every expert through an expert table (the expert cache's
/// slots, in any order) give the strided stacks' outputs bit for bit: the fused gate-up
/// (table columns 0 and 1) and the down product (column 2), gather and direct inputs.
#[test]
fn moe_gemm_through_an_expert_table_equals_the_strided_stacks() {
    let Some(d) = dev("moe_gemm table") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(29);
    let a = d.alloc_arena("moe-table-test", 256 << 20).unwrap();
    let mut cases = 0;
    for ty in [GgmlType::Q8_0, GgmlType::Q4K, GgmlType::BF16] {
        let (e, f) = if ty == GgmlType::Q4K {
            (512, 256)
        } else {
            (96, 64)
        };
        for &(ne, n_tok, k) in &[(8usize, 1usize, 2usize), (16, 37, 4), (5, 200, 3)] {
            let c = Carve::new(&a);
            // Gate and up: f x e; down: e x f; expert x's three matrices go to slot
            // perm[x] of a slot region, each slot gate | up | down.
            let (gb, _) = weights(&mut rng, ty, ne, f, e);
            let (ub, _) = weights(&mut rng, ty, ne, f, e);
            let (db, _) = weights(&mut rng, ty, ne, e, f);
            let (gm, dm) = (gb.len() / ne, db.len() / ne);
            let slot = (2 * gm + dm).div_ceil(256) * 256;
            let mut perm: Vec<usize> = (0..ne).collect();
            for i in (1..ne).rev() {
                perm.swap(i, rng.random_range(0..=i));
            }
            let mut slots = vec![0u8; slot * ne];
            for x in 0..ne {
                let s = perm[x] * slot;
                slots[s..s + gm].copy_from_slice(&gb[x * gm..(x + 1) * gm]);
                slots[s + gm..s + 2 * gm].copy_from_slice(&ub[x * gm..(x + 1) * gm]);
                slots[s + 2 * gm..s + 2 * gm + dm].copy_from_slice(&db[x * dm..(x + 1) * dm]);
            }
            let (gv, uv, dv, sv) = (
                put(d, &c, &gb),
                put(d, &c, &ub),
                put(d, &c, &db),
                put(d, &c, &slots),
            );
            let table: Vec<u64> = (0..ne)
                .flat_map(|x| {
                    let base = sv.ptr() + (perm[x] * slot) as u64;
                    [base, base + gm as u64, base + 2 * gm as u64]
                })
                .collect();
            let tv = put(d, &c, &table);
            let ids: Vec<i32> = (0..n_tok * k)
                .map(|_| rng.random_range(0..ne as i32))
                .collect();
            let iv = put(d, &c, &ids);
            let sorted = c.take(moe_scratch_bytes(n_tok, k, ne));
            d.moe_sort(iv, n_tok, k, ne, sorted).unwrap();
            let x = rand_vec(&mut rng, n_tok * k * e.max(f), 1.0);
            let xv = put(d, &c, &x);
            let xh = c.take(gemm_scratch_bytes(n_tok * k, e.max(f)));
            let ny = n_tok * k * e.max(f);
            let (y1, y2) = (c.take(4 * ny as u64), c.take(4 * ny as u64));
            let t = TableCase {
                ty,
                ne,
                n_tok,
                k,
                e,
                f,
            };
            let v = TableViews {
                gate: gv,
                up: uv,
                down: dv,
                table: tv,
                x: xv,
                xh,
                sorted,
                y: [y1, y2],
            };
            cases += table_case(d, &t, &v);
            // A column past down, or a fused product not from the gate column, is refused.
            let bad = ExpertSource::Table {
                table: tv,
                col: 1,
                fused_up: true,
            };
            assert!(d
                .moe_gemm_from(
                    GemmTile::M64,
                    AnyLoad::default(),
                    bad,
                    ty,
                    ne,
                    f,
                    e,
                    xh,
                    MoeInput::Gather,
                    n_tok,
                    k,
                    sorted,
                    y2
                )
                .is_err());
        }
    }
    eprintln!(
        "PASS moe_gemm through an expert table: {cases} cases equal the strided stacks bit for bit"
    );
}
