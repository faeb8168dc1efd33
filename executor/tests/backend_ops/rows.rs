//! backend_ops: the multi-token products (rows.cu, issue 20) through their launchers against
//! an f64 host reference, and their timings at Qwen3-30B-A3B's decode shapes.

use super::*;

use strata_exec::backend::cuda::launch::decode::{self as launch_decode, InNorm};
use strata_exec::backend::cuda::launch::{Launcher, Mat};
use strata_exec::backend::cuda::layout;

/// A random `rows x cols` matrix of `ty` (rows of varied scale): (device-layout bytes, its
/// values dequantized by the CPU reference).
fn rows_weights(rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    let mut gguf = Vec::new();
    let mut deq = vec![0f32; rows * cols];
    for r in 0..rows {
        let s = 0.2 + rng.random::<f32>();
        let row = rand_vec(rng, cols, s);
        let at = gguf.len();
        quant::quantize_row(ty, &row, &mut gguf).unwrap();
        quant::dequantize_row(ty, &gguf[at..], &mut deq[r * cols..(r + 1) * cols]).unwrap();
    }
    let mut dev = vec![0u8; gguf.len()];
    layout::to_device(ty, &gguf, 1, rows, cols, &mut dev).unwrap();
    (dev, deq)
}

/// `y[t][r] = sum_c w[r][c] xin[t][c]` in f64, rounded to f32.
fn rows_reference(w: &[f32], rows: usize, cols: usize, xin: &[f64]) -> Vec<f32> {
    xin.chunks(cols)
        .flat_map(|x| {
            (0..rows).map(move |r| {
                let wr = &w[r * cols..(r + 1) * cols];
                wr.iter().zip(x).map(|(a, b)| *a as f64 * b).sum::<f64>() as f32
            })
        })
        .collect()
}

/// The inputs a product sees: `x`, or RMSNorm(x) * nw per token.
fn rows_inputs(x: &[f32], cols: usize, norm: Option<(&[f32], f32)>) -> Vec<f64> {
    x.chunks(cols)
        .flat_map(|t| {
            let s = norm.map_or(1.0, |(_, eps)| {
                let ss: f64 = t.iter().map(|v| (*v as f64).powi(2)).sum();
                1.0 / (ss / cols as f64 + eps as f64).sqrt()
            });
            t.iter()
                .enumerate()
                .map(move |(i, v)| *v as f64 * s * norm.map_or(1.0, |(w, _)| w[i] as f64))
        })
        .collect()
}

/// What a product run adds to the plain one: accumulate into y, normalise on the fly, and
/// also write the normalised inputs.
#[derive(Debug, Clone, Copy)]
struct RowsVariant {
    add: bool,
    norm: bool,
    xn_out: bool,
}

/// One `mv` launch of `n` tokens over `(wb, deq)` (`rows x cols` of `ty`) against the host,
/// with NaN past every output (checked untouched).
#[allow(clippy::too_many_arguments)]
fn check_rows_mv(
    dev: &CudaDevice,
    arena: &strata_exec::backend::cuda::DeviceArena,
    (ty, rows, cols): (GgmlType, usize, usize),
    (wb, deq): (&[u8], &[f32]),
    n: usize,
    v: RowsVariant,
    rng: &mut StdRng,
) {
    let l = Launcher::new(dev);
    let c = cuda_common::Carve::new(arena);
    let what = format!("rows mv {ty} {rows}x{cols} n={n} {v:?}");
    let x = rand_vec(rng, n * cols, 1.0);
    let nw: Vec<f32> = rand_vec(rng, cols, 0.2).iter().map(|a| 1.0 + a).collect();
    let eps = 1e-6f32;
    let y0: Vec<f32> = if v.add {
        rand_vec(rng, n * rows, 1.0)
    } else {
        vec![f32::NAN; n * rows]
    };
    let mut y_init = y0.clone();
    y_init.extend(std::iter::repeat_n(f32::NAN, TAIL));
    let wv = cuda_common::put(dev, &c, wb);
    let xv = cuda_common::put(dev, &c, &x);
    let nv = cuda_common::put(dev, &c, &nw);
    let yall = cuda_common::put(dev, &c, &y_init);
    let xnall = cuda_common::put(dev, &c, &vec![f32::NAN; n * cols + TAIL]);
    let norm = v.norm.then(|| InNorm {
        w: nv,
        eps,
        xn_out: v
            .xn_out
            .then(|| xnall.sub(0, 4 * (n * cols) as u64).unwrap()),
    });
    let m = Mat {
        w: wv,
        ty,
        rows,
        cols,
    };
    let yv = yall.sub(0, 4 * (n * rows) as u64).unwrap();
    ok(
        launch_decode::mv(&l, "mv", m, xv, norm, yv, n, v.add, true),
        &what,
    );
    let xin = rows_inputs(&x, cols, v.norm.then_some((&nw[..], eps)));
    let mut want = rows_reference(deq, rows, cols, &xin);
    if v.add {
        for (w, a) in want.iter_mut().zip(&y0) {
            *w += a;
        }
    }
    let got: Vec<f32> = cuda_common::get(dev, yall, n * rows + TAIL);
    compare(&what, &got, &want, 2e-5);
    let xn: Vec<f32> = cuda_common::get(dev, xnall, n * cols + TAIL);
    if v.norm && v.xn_out {
        let want: Vec<f32> = xin.iter().map(|a| *a as f32).collect();
        compare(&format!("{what} xn_out"), &xn, &want, 1e-5);
    } else {
        assert!(xn.iter().all(|a| a.is_nan()), "{what}: wrote xn_out");
    }
}

/// `mv` of 2 to 33 tokens over Q8_0 and Q4_K (the multi-token kernels: 4, 8 or 16 tokens a
/// grid row, more on grid.y), odd row counts (one row, a partial row tile, a thousand rows,
/// and enough rows for each column split), column counts with a partial staged chunk and (Q8_0)
/// a partial 128-column step, plain, added into y, normalised on the fly, and normalised with
/// the normalised inputs written out; against the host in f64, and nothing written past the
/// rows or tokens.
#[test]
fn multi_token_products_q8_0_and_q4_k() {
    let Some(dev) = gpu("multi_token_products") else {
        return;
    };
    let arena = dev.alloc_arena("rows-test", 64 << 20).unwrap();
    let mut rng = StdRng::seed_from_u64(20);
    let plain = RowsVariant {
        add: false,
        norm: false,
        xn_out: false,
    };
    let variants = [
        plain,
        RowsVariant { add: true, ..plain },
        RowsVariant {
            norm: true,
            ..plain
        },
        RowsVariant {
            norm: true,
            xn_out: true,
            add: true,
        },
    ];
    for ty in [GgmlType::Q8_0, GgmlType::Q4K] {
        let col_list: &[usize] = if ty == GgmlType::Q4K {
            &[256, 1280]
        } else {
            &[96, 544, 2080]
        };
        for &cols in col_list {
            for rows in [1, 7, 33, 1000] {
                let (wb, deq) = rows_weights(&mut rng, ty, rows, cols);
                for n in [2, 3, 5, 8, 9, 16, 17, 33] {
                    for v in variants {
                        check_rows_mv(&dev, &arena, (ty, rows, cols), (&wb, &deq), n, v, &mut rng);
                    }
                }
            }
        }
        // Enough rows for the narrower column splits (two blocks an SM of 64 or 32 rows).
        let cols = col_list[0];
        for rows in [9001, 17001] {
            let (wb, deq) = rows_weights(&mut rng, ty, rows, cols);
            for n in [3, 16, 17] {
                for v in [variants[0], variants[3]] {
                    check_rows_mv(&dev, &arena, (ty, rows, cols), (&wb, &deq), n, v, &mut rng);
                }
            }
        }
        eprintln!(
            "PASS multi-token products {ty}: 2-33 tokens, rows 1-17001, plain/add/norm/xn_out"
        );
    }
}

/// Q/K/V in one launch over Q8_0 and Q4_K for 2 to 33 tokens, with GQA-like row splits
/// (K and V a quarter or an eighth of Q) and odd ones (row tiles straddling the matrices).
#[test]
fn multi_token_qkv_q8_0_and_q4_k() {
    let Some(dev) = gpu("multi_token_qkv") else {
        return;
    };
    let arena = dev.alloc_arena("rows-qkv-test", 64 << 20).unwrap();
    let mut rng = StdRng::seed_from_u64(21);
    for ty in [GgmlType::Q8_0, GgmlType::Q4K] {
        for (split, cols) in [
            ([32, 8, 8], 256),
            ([33, 7, 9], 512),
            ([1000, 130, 130], 768),
            ([4096, 512, 512], 2048),
        ] {
            let w: Vec<_> = split
                .iter()
                .map(|&r| rows_weights(&mut rng, ty, r, cols))
                .collect();
            for n in [2, 5, 9, 16, 17, 33] {
                let l = Launcher::new(&dev);
                let c = cuda_common::Carve::new(&arena);
                let what = format!("rows qkv {ty} {split:?}x{cols} n={n}");
                let x = rand_vec(&mut rng, n * cols, 1.0);
                let xv = cuda_common::put(&dev, &c, &x);
                let mats: Vec<Mat<'_>> = w
                    .iter()
                    .zip(split)
                    .map(|((wb, _), rows)| Mat {
                        w: cuda_common::put(&dev, &c, wb),
                        ty,
                        rows,
                        cols,
                    })
                    .collect();
                let ys: Vec<_> = split
                    .iter()
                    .map(|r| cuda_common::put(&dev, &c, &vec![f32::NAN; n * r + TAIL]))
                    .collect();
                let outs: Vec<_> = ys
                    .iter()
                    .zip(split)
                    .map(|(y, r)| y.sub(0, 4 * (n * r) as u64).unwrap())
                    .collect();
                ok(
                    launch_decode::qkv(
                        &l,
                        [mats[0], mats[1], mats[2]],
                        xv,
                        [outs[0], outs[1], outs[2]],
                        n,
                        true,
                    ),
                    &what,
                );
                let xin = rows_inputs(&x, cols, None);
                for (i, ((_, deq), rows)) in w.iter().zip(split).enumerate() {
                    let want = rows_reference(deq, rows, cols, &xin);
                    let got: Vec<f32> = cuda_common::get(&dev, ys[i], n * rows + TAIL);
                    compare(&format!("{what} [{i}]"), &got, &want, 2e-5);
                }
            }
        }
        eprintln!("PASS multi-token qkv {ty}: 2-33 tokens, GQA and odd row splits");
    }
}

/// Timings (no assertion) of the products at Qwen3-30B-A3B's decode shapes, Q8_0: the LM head
/// (151936 x 2048), Q/K/V (4096 + 512 + 512 rows x 2048) and the output projection (2048 x
/// 4096), for 1 token (dq_mv1 / dq_qkv1) and 2, 4, 8, 16 and 32 tokens (rows.cu).
#[test]
fn multi_token_product_timings() {
    let Some(dev) = gpu("multi_token_product_timings") else {
        return;
    };
    let ty = GgmlType::Q8_0;
    let arena = dev.alloc_arena("rows-time", 512 << 20).unwrap();
    let l = Launcher::new(&dev);
    let c = cuda_common::Carve::new(&arena);
    let bytes = |rows: usize, cols: usize| quant::row_bytes(ty, cols).unwrap() * rows;
    // Zero weights: the time does not depend on the values.
    let zeros = |len: usize| {
        let v = c.take(len as u64);
        dev.memset(v, 0).unwrap();
        v
    };
    let head = zeros(bytes(151936, 2048));
    let qkv: Vec<_> = [4096, 512, 512]
        .iter()
        .map(|&r| zeros(bytes(r, 2048)))
        .collect();
    let o = zeros(bytes(2048, 4096));
    let x = zeros(4 * 32 * 4096);
    let y = zeros(4 * 32 * 151936);
    let ys: Vec<_> = [4096, 512, 512]
        .iter()
        .map(|&r| zeros(4 * 32 * r))
        .collect();
    let time = |f: &dyn Fn()| {
        for _ in 0..3 {
            f();
        }
        let reps = 20;
        let e0 = dev.record_event().unwrap();
        for _ in 0..reps {
            f();
        }
        let e1 = dev.record_event().unwrap();
        e1.synchronize().unwrap();
        1e3 * e0.elapsed_ms(&e1).unwrap() as f64 / reps as f64
    };
    for n in [1, 2, 4, 8, 16, 32] {
        let mat = |w, rows, cols| Mat { w, ty, rows, cols };
        let h = time(&|| {
            launch_decode::mv(
                &l,
                "mv",
                mat(head, 151936, 2048),
                x,
                None,
                y,
                n,
                false,
                true,
            )
            .unwrap()
        });
        let q = time(&|| {
            let m = [
                mat(qkv[0], 4096, 2048),
                mat(qkv[1], 512, 2048),
                mat(qkv[2], 512, 2048),
            ];
            launch_decode::qkv(&l, m, x, [ys[0], ys[1], ys[2]], n, true).unwrap()
        });
        let ov = time(&|| {
            launch_decode::mv(&l, "mv_o", mat(o, 2048, 4096), x, None, y, n, true, true).unwrap()
        });
        let tbs = |b: usize, us: f64| b as f64 / us / 1e6;
        eprintln!(
            "TIME n={n}: head {h:.1} us ({:.2} TB/s), qkv {q:.1} us ({:.2} TB/s), o {ov:.1} us ({:.2} TB/s)",
            tbs(bytes(151936, 2048), h),
            tbs(bytes(5120, 2048), q),
            tbs(bytes(2048, 4096), ov)
        );
    }
}
