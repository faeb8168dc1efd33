//! The any-type CUDA kernels (`dequant_rows`, `mv_any`, kernels/cuda/dequant.cu) against the
//! CPU reference (`quant`) for every weight type it decodes, across shapes: 1, 7 and 33 rows
//! (odd counts leave a partly filled last block of warps), rows of one and of several blocks.
//! Blocks are the reference quantizers' output where a type has one, else valid random blocks
//! (`quant::random`), so every bit of each layout is exercised.
//! Tolerances: dequantization is bit-exact (the decoders use the CPU's operations, no
//! contracted multiply-add); a product is within 2e-6 of the sum of |w_i x_i| of the f64 dot
//! of the CPU-dequantized row (f32 accumulation in another order).
//! Invariant: without a usable CUDA device each test prints `SKIP (no CUDA device): ...` and
//! returns; it never passes silently. Run on a GPU machine with
//! `cargo test -p strata-exec --release --test cuda_quants -- --nocapture`.
#![cfg(feature = "cuda")]

mod cuda_common;
use cuda_common::{get, put, rand_vec, Carve};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::sync::OnceLock;
use strata_exec::backend::cuda::CudaDevice;
use strata_exec::quant::{self, SUPPORTED};
use strata_schemas::ggml::GgmlType;

static DEV: OnceLock<Result<CudaDevice, String>> = OnceLock::new();

fn dev(test: &str) -> Option<&'static CudaDevice> {
    cuda_common::device_or_skip(&DEV, test, || {
        CudaDevice::open(0).map_err(|e| e.to_string())
    })
}

/// `rows` GGUF rows of `cols` values of `ty` and their CPU dequantization.
fn weights(rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    let rb = quant::row_bytes(ty, cols).unwrap();
    let mut bytes = vec![0u8; rb * rows];
    for r in bytes.chunks_exact_mut(rb) {
        if quant::can_quantize(ty) {
            let x = rand_vec(rng, cols, 1.0);
            quant::quantize_row_into(ty, &x, r).unwrap();
        } else {
            let mut next = || rng.random::<u64>();
            quant::random::random_row(ty, 0.5, &mut next, r).unwrap();
        }
    }
    let mut deq = vec![0f32; rows * cols];
    for (r, o) in bytes.chunks_exact(rb).zip(deq.chunks_exact_mut(cols)) {
        quant::dequantize_row(ty, r, o).unwrap();
    }
    (bytes, deq)
}

/// Shapes per type: rows of one block (or 32 plain values) and of several.
fn col_counts(ty: GgmlType) -> [usize; 2] {
    match ty.block_elems() {
        256 => [256, 768],
        _ => [32, 416],
    }
}

#[test]
fn dequant_rows_is_bit_exact_for_every_type() {
    let Some(d) = dev("dequant_rows_is_bit_exact_for_every_type") else {
        return;
    };
    let arena = d.alloc_arena("test", 64 << 20).unwrap();
    let mut rng = StdRng::seed_from_u64(19);
    let mut cases = 0;
    for &ty in SUPPORTED {
        for cols in col_counts(ty) {
            for rows in [1usize, 7, 33] {
                let c = Carve::new(&arena);
                let (bytes, deq) = weights(&mut rng, ty, rows, cols);
                let w = put(d, &c, &bytes);
                // Every row in order, then a gather (the embedding lookup).
                let out = c.take(4 * (rows * cols) as u64);
                d.dequant_rows(w, ty, rows, cols, None, out).unwrap();
                let got: Vec<f32> = get(d, out, rows * cols);
                for (i, (g, e)) in got.iter().zip(&deq).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        e.to_bits(),
                        "{ty} rows {rows} cols {cols}: value {i}: gpu {g:e}, cpu {e:e}"
                    );
                }
                let ids: Vec<i32> = (0..5).map(|k| ((k * 5 + 3) % rows) as i32).collect();
                let idv = put(d, &c, &ids);
                let out = c.take(4 * (ids.len() * cols) as u64);
                d.dequant_rows(w, ty, rows, cols, Some((&ids, idv)), out)
                    .unwrap();
                let got: Vec<f32> = get(d, out, ids.len() * cols);
                for (k, id) in ids.iter().enumerate() {
                    let want = &deq[*id as usize * cols..(*id as usize + 1) * cols];
                    assert_eq!(
                        &got[k * cols..(k + 1) * cols],
                        want,
                        "{ty}: gathered row {id}"
                    );
                }
                cases += 1;
            }
        }
    }
    // Bad ids and shapes are refused before a launch.
    let c = Carve::new(&arena);
    let w = c.take(34 * 4);
    let idv = put(d, &c, &[4i32]);
    let out = c.take(4 * 32);
    assert!(d
        .dequant_rows(w, GgmlType::Q8_0, 4, 32, Some((&[4], idv)), out)
        .is_err());
    assert!(d.dequant_rows(w, GgmlType::Q8_0, 4, 48, None, out).is_err());
    eprintln!(
        "PASS dequant_rows: {} types x 2 widths x rows 1/7/33 ({cases} cases), bit-exact; gathers too",
        SUPPORTED.len()
    );
}

#[test]
fn mv_any_matches_the_cpu_reference_for_every_type() {
    let Some(d) = dev("mv_any_matches_the_cpu_reference_for_every_type") else {
        return;
    };
    let arena = d.alloc_arena("test", 64 << 20).unwrap();
    let mut rng = StdRng::seed_from_u64(23);
    let mut worst = 0f64;
    for &ty in SUPPORTED {
        for cols in col_counts(ty) {
            for rows in [1usize, 7, 33, 130] {
                let c = Carve::new(&arena);
                let (bytes, deq) = weights(&mut rng, ty, rows, cols);
                let x = rand_vec(&mut rng, cols, 1.0);
                let (w, xv) = (put(d, &c, &bytes), put(d, &c, &x));
                let y = c.take(4 * rows as u64);
                d.mv_any(w, ty, rows, cols, xv, y).unwrap();
                let got: Vec<f32> = get(d, y, rows);
                for r in 0..rows {
                    let row = &deq[r * cols..(r + 1) * cols];
                    let exact: f64 = row.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let scale: f64 = row
                        .iter()
                        .zip(&x)
                        .map(|(a, b)| (*a as f64 * *b as f64).abs())
                        .sum();
                    let err = (got[r] as f64 - exact).abs();
                    worst = worst.max(err / scale.max(1e-30));
                    assert!(
                        err <= 2e-6 * scale + 1e-30,
                        "{ty} rows {rows} cols {cols} row {r}: gpu {} vs {exact} (scale {scale})",
                        got[r]
                    );
                    // The CPU's own product agrees within the same bound.
                    let cpu = quant::dot_row(
                        ty,
                        &bytes[r * bytes.len() / rows..(r + 1) * bytes.len() / rows],
                        &x,
                    ) as f64;
                    assert!((cpu - exact).abs() <= 2e-6 * scale + 1e-30, "{ty}: cpu dot");
                }
            }
        }
    }
    eprintln!(
        "PASS mv_any: {} types x 2 widths x rows 1/7/33/130; worst error {worst:.2e} of sum |w x|",
        SUPPORTED.len()
    );
}
