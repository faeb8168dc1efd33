//! The int8-activation products (kernels/cuda/dp4a.cu; the default for Q8_0 weights,
//! `--kernel-options dp4a` for every type) on the GPU:
//! the quantization bit for bit against its host reference (`launch::dp4a::quantize_q8a`),
//! the Q8_0, Q4_K, Q6_K and IQ3_S matrix-vector products (1 to 19 tokens, one and three
//! matrices, Q4_K_M's Q4_K/Q4_K/Q6_K and the IQ3_S file's IQ3_S/IQ3_S/Q4_K Q/K/V in one launch,
//! added or not; staged in shared memory and not, bit for bit equal) and the MoE gate/up and
//! down against an f64 reference over the same quantized inputs, IQ3_S also at
//! Qwen3-Next-80B-A3B's shapes (with a print-only timing of its experts against the f32
//! products), and the engine with the option against the CPU engine (IQ3_S qwen3moe and
//! qwen3next models among them).
//! Tolerances: a product is within 1e-5 of the sum of |w_i v_i| (v the values the quants
//! stand for, d * q) of its f64 reference — the f32 sums' order only — and within the
//! quantization's own bound of the f32 input's product: every input moves by at most half a
//! step (amax / 254 of its block), so |W q8a(x) - W x| <= sum over blocks of amax / 254 times
//! the sum of the block's |w|. The engine: logits within 3e-2 of the largest of each row of
//! the CPU engine's (whose products are f32), the same greedy tokens on the trained tiny
//! model, and logits that differ from the f32 products' (proof the option ran); the default
//! options run them on Q8_0 weights (the explicit `dp4a` run bit for bit) and not on Q4_K
//! (the `f32-products` run bit for bit).
//! Invariant: without a usable CUDA device each test prints `SKIP ...` and returns; it never
//! passes silently. Run on a GPU machine with
//! `cargo test -p strata-exec --release --test cuda_dp4a -- --test-threads=1 --nocapture`.
#![cfg(feature = "cuda")]

mod common;
mod cuda_common;

use common::*;
use cuda_common::{get, put, rand_vec, Carve};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::sync::OnceLock;
use strata_exec::backend::cuda::launch::decode::{self, ExpertTable};
use strata_exec::backend::cuda::launch::dp4a::{self, quantize_q8a, Q8a};
use strata_exec::backend::cuda::launch::{Launcher, Mat};
use strata_exec::backend::cuda::layout::to_device;
use strata_exec::backend::cuda::options::{CudaOptions, Int8Products, KernelOptions};
use strata_exec::backend::cuda::start::{start_cuda, CudaEngine};
use strata_exec::backend::cuda::{CudaDevice, DeviceArena, DeviceView};
use strata_exec::engine::Engine;
use strata_exec::load::open_model;
use strata_exec::quant;
use strata_schemas::ggml::GgmlType;

static DEV: OnceLock<Result<CudaDevice, String>> = OnceLock::new();

fn dev(test: &str) -> Option<&'static CudaDevice> {
    cuda_common::device_or_skip(&DEV, test, || {
        CudaDevice::open(0).map_err(|e| e.to_string())
    })
}

/// `rows x cols` random weights of `ty`: the device layout and the CPU's dequantized rows.
/// Quantized from uniform values, or (IQ3_S, which has no quantizer) random valid blocks of
/// about the same root mean square.
fn weights(rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    let mut gguf = Vec::new();
    if ty == GgmlType::Iq3S {
        gguf.resize(quant::row_bytes(ty, rows * cols).unwrap(), 0);
        quant::random::random_row(ty, 0.58, &mut || rng.random::<u64>(), &mut gguf).unwrap();
    } else {
        let x = rand_vec(rng, rows * cols, 1.0);
        for r in x.chunks(cols) {
            quant::quantize_row(ty, r, &mut gguf).unwrap();
        }
    }
    let rb = gguf.len() / rows;
    let mut deq = vec![0f32; rows * cols];
    for (r, o) in gguf.chunks_exact(rb).zip(deq.chunks_exact_mut(cols)) {
        quant::dequantize_row(ty, r, o).unwrap();
    }
    let mut dev = vec![0u8; gguf.len()];
    to_device(ty, &gguf, 1, rows, cols, &mut dev).unwrap();
    (dev, deq)
}

/// Inputs with an outlier now and then and an all-zero first block.
fn inputs(rng: &mut StdRng, n: usize, cols: usize) -> Vec<f32> {
    let mut x = rand_vec(rng, n * cols, 1.0);
    for (i, v) in x.iter_mut().enumerate() {
        if i % 97 == 5 {
            *v *= 9.0;
        }
    }
    x[..32].fill(0.0);
    x
}

/// f64 dot and the sum of |terms|.
fn dot(w: &[f32], x: &[f32]) -> (f64, f64) {
    w.iter().zip(x).fold((0.0, 0.0), |(s, a), (w, x)| {
        let p = *w as f64 * *x as f64;
        (s + p, a + p.abs())
    })
}

/// The quantization's bound on |W q8a(x) - W x| (see the file comment).
fn quant_bound(w: &[f32], x: &[f32]) -> f64 {
    w.chunks(32)
        .zip(x.chunks(32))
        .map(|(wb, xb)| {
            let amax = xb.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
            amax / 254.0 * wb.iter().map(|v| v.abs() as f64).sum::<f64>()
        })
        .sum()
}

/// Quantized rows on the device (the q8a layout in a carved window).
fn q8a<'a>(c: &Carve<'a>, rows: usize, cols: usize) -> Q8a<'a> {
    Q8a::carve(c.take(Q8a::bytes(rows, cols)), rows, cols).unwrap()
}

#[test]
fn quantization_is_bit_exact_with_the_host_reference() {
    let Some(d) = dev("quantization_is_bit_exact_with_the_host_reference") else {
        return;
    };
    let arena = d.alloc_arena("test", 16 << 20).unwrap();
    let mut rng = StdRng::seed_from_u64(3);
    let l = Launcher::new(d);
    for (n, cols) in [(1, 32), (3, 2048), (16, 768)] {
        let c = Carve::new(&arena);
        let x = inputs(&mut rng, n, cols);
        let xv = put(d, &c, &x);
        let out = q8a(&c, n, cols);
        dp4a::quantize(&l, xv, &out).unwrap();
        let q: Vec<u8> = get(d, out.q, n * cols);
        let ds: Vec<f32> = get(d, out.ds, 2 * n * cols / 32);
        let want = quantize_q8a(&x);
        for (i, (g, w)) in q.iter().zip(&want.q).enumerate() {
            assert_eq!(*g as i8, *w, "{n} x {cols}: quant {i} (x = {})", x[i]);
        }
        for (b, w) in want.ds.iter().enumerate() {
            assert_eq!(
                [ds[2 * b].to_bits(), ds[2 * b + 1].to_bits()],
                [w[0].to_bits(), w[1].to_bits()],
                "{n} x {cols}: block {b} (d, s)"
            );
        }
    }
}

/// Checks `got` (n x rows) against W q8a(x) (tight) and W x (the quantization bound), plus
/// `y0` when the product adds.
#[allow(clippy::too_many_arguments)]
fn check_rows(
    what: &str,
    got: &[f32],
    deq: &[f32],
    x: &[f32],
    xv: &[f32],
    y0: Option<&[f32]>,
    rows: usize,
    cols: usize,
) {
    for t in 0..got.len() / rows {
        for r in 0..rows {
            let w = &deq[r * cols..(r + 1) * cols];
            let (xt, vt) = (&x[t * cols..(t + 1) * cols], &xv[t * cols..(t + 1) * cols]);
            let base = y0.map_or(0.0, |y| y[t * rows + r] as f64);
            let (wq, scale) = dot(w, vt);
            let g = got[t * rows + r] as f64;
            let tight = 1e-5 * (scale + base.abs()).max(1e-30);
            assert!(
                (g - base - wq).abs() <= tight,
                "{what}: y[{t}][{r}] = {g}, W.q8a(x) {wq} + {base} (bound {tight:e})"
            );
            let loose = quant_bound(w, xt) * 1.0001 + tight;
            let wx = dot(w, xt).0;
            assert!(
                (g - base - wx).abs() <= loose,
                "{what}: y[{t}][{r}] = {g}, W.x {wx} + {base} (quantization bound {loose:e})"
            );
        }
    }
}

/// Every product twice: staged (the tokens' q8a rows in shared memory, two tokens or more)
/// and read from global memory; the two bit for bit equal and both within the bounds. Widths
/// of one, two and one-and-a-bit staged chunks (`STAGE_COLS`), token counts of each kernel
/// (1, 4, 8, 16 and between, 19 in two grid rows), row counts not a multiple of the warps.
#[test]
fn matvec_products_match_the_quantized_reference() {
    let Some(d) = dev("matvec_products_match_the_quantized_reference") else {
        return;
    };
    let arena = d.alloc_arena("test", 256 << 20).unwrap();
    let mut rng = StdRng::seed_from_u64(5);
    let l = Launcher::new(d);
    let kc = dp4a::STAGE_COLS;
    let mut cases = 0;
    for ty in [GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K, GgmlType::Iq3S] {
        let cols_set: Vec<usize> = if ty == GgmlType::Q8_0 {
            vec![96, kc + 96, 2 * kc]
        } else {
            vec![256, kc + 256, 2 * kc]
        };
        for cols in cols_set {
            // One matrix, and Q/K/V-like three stacked (rows not a multiple of the warps).
            for split in [&[37usize][..], &[70, 17, 9][..]] {
                let c = Carve::new(&arena);
                // With Q4_K: Q4_K_M's Q4_K Q and K with a Q6_K V, in one launch; with IQ3_S:
                // the IQ3_S file's IQ3_S Q and K with a Q4_K V.
                let tys: Vec<GgmlType> = (0..split.len())
                    .map(|i| match (ty, i) {
                        (GgmlType::Q4K, 2) => GgmlType::Q6K,
                        (GgmlType::Iq3S, 2) => GgmlType::Q4K,
                        _ => ty,
                    })
                    .collect();
                let ws: Vec<_> = split
                    .iter()
                    .zip(&tys)
                    .map(|(&r, &t)| weights(&mut rng, t, r, cols))
                    .collect();
                let views: Vec<DeviceView<'_>> = ws.iter().map(|(b, _)| put(d, &c, b)).collect();
                for n in [1usize, 2, 3, 4, 5, 8, 9, 16, 19] {
                    for add in [false, true] {
                        let c2 = Carve::new(&arena);
                        c2.off.set(c.off.get());
                        let x = inputs(&mut rng, n, cols);
                        let xq = q8a(&c2, n, cols);
                        dp4a::quantize(&l, put(d, &c2, &x), &xq).unwrap();
                        let y0s: Vec<Vec<f32>> = split
                            .iter()
                            .map(|&r| rand_vec(&mut rng, n * r, 1.0))
                            .collect();
                        let mats: Vec<Mat<'_>> = split
                            .iter()
                            .zip(&views)
                            .zip(&tys)
                            .map(|((&rows, &w), &ty)| Mat { w, ty, rows, cols })
                            .collect();
                        let run = |stage: bool| -> Vec<Vec<f32>> {
                            let ys: Vec<DeviceView<'_>> =
                                y0s.iter().map(|y| put(d, &c2, y)).collect();
                            dp4a::mv(&l, "test", &mats, &xq, &ys, n, add, stage).unwrap();
                            split
                                .iter()
                                .zip(&ys)
                                .map(|(&rows, &y)| get(d, y, n * rows))
                                .collect()
                        };
                        let (staged, global) = (run(true), run(false));
                        let xv = quantize_q8a(&x).values();
                        for (k, &rows) in split.iter().enumerate() {
                            let what =
                                format!("{tys:?} {split:?}x{cols} n {n} add {add} matrix {k}");
                            for (i, (a, b)) in staged[k].iter().zip(&global[k]).enumerate() {
                                assert_eq!(
                                    a.to_bits(),
                                    b.to_bits(),
                                    "{what}: y[{}][{}] staged {a}, from global memory {b}",
                                    i / rows,
                                    i % rows
                                );
                            }
                            let base = add.then_some(&y0s[k][..]);
                            check_rows(&what, &staged[k], &ws[k].1, &x, &xv, base, rows, cols);
                            cases += 1;
                        }
                    }
                }
            }
        }
    }
    eprintln!("{cases} product cases within the bounds, staged equal to unstaged");
}

/// The shape of a MoE case: `n_expert` experts, `k` picked a token, gate and up `f x e`, down
/// `e x f`.
#[derive(Clone, Copy)]
struct MoeShape {
    n_expert: usize,
    k: usize,
    e: usize,
    f: usize,
}

/// One MoE case on the GPU: `n` tokens routed to `k` experts of `ty` each, the gate/up's h
/// against silu(g) u of the quantized input and the down (into y0, weighted) against the GPU's
/// h quantized and the f32 h's bound. Only the picked experts get weights of their own; the
/// table's other entries point at expert 0's (never read). With `time`, also prints the
/// int8 and the f32 products' time a pass over the same experts (print only).
fn moe_case(
    d: &CudaDevice,
    arena: &DeviceArena,
    rng: &mut StdRng,
    ty: GgmlType,
    s: MoeShape,
    n: usize,
    time: bool,
) {
    let MoeShape { n_expert, k, e, f } = s;
    let l = Launcher::new(d);
    let silu = |v: f64| v / (1.0 + (-v).exp());
    let c = Carve::new(arena);
    let ids: Vec<i32> = (0..n * k)
        .map(|a| ((a * 3 + a / k) % n_expert) as i32)
        .collect();
    // Per picked expert: gate, up (f x e), down (e x f).
    let mut host = std::collections::BTreeMap::new();
    let mut table = vec![0u64; 3 * n_expert];
    for &id in ids.iter().chain([0].iter()) {
        let id = id as usize;
        if host.contains_key(&id) {
            continue;
        }
        let m = [
            weights(rng, ty, f, e),
            weights(rng, ty, f, e),
            weights(rng, ty, e, f),
        ];
        for (i, (b, _)) in m.iter().enumerate() {
            table[3 * id + i] = put(d, &c, b).ptr();
        }
        host.insert(id, m);
    }
    for id in 0..n_expert {
        if !host.contains_key(&id) {
            table.copy_within(0..3, 3 * id);
        }
    }
    let tv = put(d, &c, &table);
    let ex = ExpertTable {
        table: tv,
        ty,
        ty_up: ty,
        ty_down: ty,
        n_expert,
        f,
        e,
    };
    let wts: Vec<f32> = (0..n * k).map(|a| 0.2 + 0.1 * (a % k) as f32).collect();
    let (idv, wv) = (put(d, &c, &ids), put(d, &c, &wts));
    let x = inputs(rng, n, e);
    let xd = put(d, &c, &x);
    let xq = q8a(&c, n, e);
    dp4a::quantize(&l, xd, &xq).unwrap();
    let h = c.take(4 * (n * k * f) as u64);
    dp4a::moe_gate_up(&l, ex, idv, k, &xq, h, n).unwrap();
    let hg: Vec<f32> = get(d, h, n * k * f);
    let xv = quantize_q8a(&x).values();
    let what = format!("{ty} {n_expert} experts top-{k} {e}x{f} n {n}");
    for a in 0..n * k {
        let (t, m) = (a / k, &host[&(ids[a] as usize)]);
        let vt = &xv[t * e..(t + 1) * e];
        for r in 0..f {
            let (g, _) = dot(&m[0].1[r * e..(r + 1) * e], vt);
            let (u, _) = dot(&m[1].1[r * e..(r + 1) * e], vt);
            let want = silu(g) * u;
            let got = hg[a * f + r] as f64;
            assert!(
                (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                "{what}: h[{a}][{r}] = {got}, silu(g) u of the quantized input {want}"
            );
        }
    }
    // Down of the GPU's h, quantized by the GPU (bit-exact with the host reference, checked
    // above), into y = y0 + the weighted sum.
    let hq = q8a(&c, n * k, f);
    dp4a::quantize(&l, h, &hq).unwrap();
    let y0 = rand_vec(rng, n * e, 1.0);
    let y = put(d, &c, &y0);
    dp4a::moe_down(&l, ex, idv, wv, k, &hq, y, n).unwrap();
    let got: Vec<f32> = get(d, y, n * e);
    let hv = quantize_q8a(&hg).values();
    for t in 0..n {
        for r in 0..e {
            let (mut want, mut scale, mut want_f, mut qb) = (y0[t * e + r] as f64, 0.0, 0.0, 0.0);
            for j in 0..k {
                let a = t * k + j;
                let dr = &host[&(ids[a] as usize)][2].1[r * f..(r + 1) * f];
                let (s, sc) = dot(dr, &hv[a * f..(a + 1) * f]);
                want += wts[a] as f64 * s;
                scale += wts[a] as f64 * sc;
                want_f += wts[a] as f64 * dot(dr, &hg[a * f..(a + 1) * f]).0;
                qb += wts[a] as f64 * quant_bound(dr, &hg[a * f..(a + 1) * f]);
            }
            let g = got[t * e + r] as f64;
            let tight = 1e-5 * (scale + (y0[t * e + r] as f64).abs());
            assert!(
                (g - want).abs() <= tight,
                "{what}: y[{t}][{r}] = {g}, want {want} (bound {tight:e})"
            );
            let wf = y0[t * e + r] as f64 + want_f;
            assert!(
                (g - wf).abs() <= qb * 1.0001 + tight,
                "{what}: y[{t}][{r}] = {g}, f32 input's {wf} (bound {qb:e})"
            );
        }
    }
    if time {
        // A decode layer's experts as the engine issues them: int8 (quantize x, gate/up,
        // quantize h, down) against f32 (gate/up, down; staging as the engine: Q8_0 only).
        let bytes = 3 * n * k * quant::row_bytes(ty, e * f).unwrap();
        let stage = ty == GgmlType::Q8_0;
        let reps = 200;
        let run = |int8: bool| {
            let pass = || {
                if int8 {
                    dp4a::quantize(&l, xd, &xq).unwrap();
                    dp4a::moe_gate_up(&l, ex, idv, k, &xq, h, n).unwrap();
                    dp4a::quantize(&l, h, &hq).unwrap();
                    dp4a::moe_down(&l, ex, idv, wv, k, &hq, y, n).unwrap();
                } else {
                    decode::moe_gate_up(&l, ex, idv, k, xd, h, n, stage).unwrap();
                    decode::moe_down(&l, ex, idv, wv, k, h, y, n).unwrap();
                }
            };
            for _ in 0..5 {
                pass();
            }
            d.synchronize().unwrap();
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                pass();
            }
            d.synchronize().unwrap();
            t0.elapsed().as_secs_f64() / reps as f64
        };
        let (t8, t32) = (run(true), run(false));
        eprintln!(
            "TIMING {what}: int8 {:.1} us ({:.0} GB/s of expert weights), f32 {:.1} us ({:.0} GB/s): int8 {:.2}x (print only)",
            t8 * 1e6,
            bytes as f64 / t8 / 1e9,
            t32 * 1e6,
            bytes as f64 / t32 / 1e9,
            t32 / t8
        );
    }
}

#[test]
fn moe_products_match_the_quantized_reference() {
    let Some(d) = dev("moe_products_match_the_quantized_reference") else {
        return;
    };
    let arena = d.alloc_arena("test", 64 << 20).unwrap();
    let mut rng = StdRng::seed_from_u64(9);
    let s = MoeShape {
        n_expert: 4,
        k: 3,
        e: 512,
        f: 256,
    };
    for ty in [GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K, GgmlType::Iq3S] {
        for n in [1usize, 3] {
            moe_case(d, &arena, &mut rng, ty, s, n, false);
        }
    }
}

/// IQ3_S at Qwen3-Next-80B-A3B's shapes (the file users run): dense products of the hidden
/// width 2048 (an input projection 12288 x 2048, and 2048 x 4096 as the attention and delta
/// net outputs) at 1, 4 and 16 tokens, staged and not; the routed experts (512, top-10, 2048
/// x 512) at 1 and 3 tokens, with the int8 / f32 timing of a one-token layer printed.
#[test]
fn iq3_s_products_at_the_80b_shapes() {
    let Some(d) = dev("iq3_s_products_at_the_80b_shapes") else {
        return;
    };
    let arena = d.alloc_arena("test", 512 << 20).unwrap();
    let mut rng = StdRng::seed_from_u64(80);
    let l = Launcher::new(d);
    let ty = GgmlType::Iq3S;
    for (rows, cols) in [(12288usize, 2048usize), (2048, 4096)] {
        let c = Carve::new(&arena);
        let (wb, deq) = weights(&mut rng, ty, rows, cols);
        let mats = [Mat {
            w: put(d, &c, &wb),
            ty,
            rows,
            cols,
        }];
        for n in [1usize, 4, 16] {
            let x = inputs(&mut rng, n, cols);
            let xq = q8a(&c, n, cols);
            dp4a::quantize(&l, put(d, &c, &x), &xq).unwrap();
            let xv = quantize_q8a(&x).values();
            let mut outs = Vec::new();
            for stage in [true, false] {
                let y = c.take(4 * (n * rows) as u64);
                dp4a::mv(&l, "test", &mats, &xq, &[y], n, false, stage).unwrap();
                let got: Vec<f32> = get(d, y, n * rows);
                let what = format!("IQ3_S {rows}x{cols} n {n} stage {stage}");
                check_rows(&what, &got, &deq, &x, &xv, None, rows, cols);
                outs.push(got);
            }
            let same = outs[0]
                .iter()
                .zip(&outs[1])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "IQ3_S {rows}x{cols} n {n}: staged differs from unstaged"
            );
        }
    }
    let s = MoeShape {
        n_expert: 512,
        k: 10,
        e: 2048,
        f: 512,
    };
    moe_case(d, &arena, &mut rng, ty, s, 1, true);
    moe_case(d, &arena, &mut rng, ty, s, 3, false);
}

/// Max over rows of max |a - b| / max |b| of the row.
fn rel_err(a: &[f32], b: &[f32], v: usize) -> f64 {
    let mut worst = 0f64;
    for (ra, rb) in a.chunks(v).zip(b.chunks(v)) {
        let scale = rb.iter().fold(0f64, |m, x| m.max(x.abs() as f64));
        for (x, y) in ra.iter().zip(rb) {
            worst = worst.max((*x as f64 - *y as f64).abs() / scale);
        }
    }
    worst
}

/// The CUDA engine on `gguf` with `kernels`, planned for a 2 GiB NVIDIA device with `ask`.
fn cuda_on(variant: &str, gguf: &std::path::Path, ask: &Ask, kernels: KernelOptions) -> CudaEngine {
    let ask = Ask {
        gpu: true,
        ..ask.clone()
    };
    let inv = strata_plan::model::load_model(gguf).unwrap();
    let p = plan_inventory(variant, &inv, gguf, &ask);
    let opts = CudaOptions {
        kernels,
        ..CudaOptions::default()
    };
    start_cuda(&p, open_model(gguf).unwrap(), opts).unwrap()
}

/// Prompt logits (every position) then `steps` decode steps fed `feed`'s greedy tokens (the
/// engine's own when `feed` is None): the logits and the tokens fed.
fn teacher(
    e: &mut dyn Engine,
    prompt: &[u32],
    steps: usize,
    feed: Option<&[u32]>,
) -> (Vec<f32>, Vec<u32>) {
    let ub = e.info().ubatch;
    let v = e.info().n_vocab;
    let mut logits = Vec::new();
    for chunk in prompt.chunks(ub) {
        logits.extend_from_slice(e.prefill_all(0, chunk).unwrap());
    }
    let mut toks = vec![argmax(&logits[logits.len() - v..])];
    for i in 0..steps {
        let tok = feed.map_or(toks[i], |f| f[i]);
        let l = e.decode(&[(0, tok)]).unwrap().to_vec();
        toks.push(argmax(&l));
        logits.extend_from_slice(&l);
    }
    (logits, toks)
}

/// The tiny test models: the trained tiny model converted to Q8_0 (`base`), and random
/// models of Q4_K weights and of llama.cpp's Q4_K_M mix (Q6_K V, half the down projections
/// and the head; hidden and expert width 256; routed to all their experts, so no router
/// choice can flip), and of IQ3_S: a qwen3moe (`iq3s`) and a qwen3next (`next-iq3s`, the
/// tiny one at hidden and expert width 256) with every matrix IQ3_S (IQ4_NL where a row is
/// not whole 256-value blocks) and an F16 head, so IQ3_S is the only type `dp4a` adds and a
/// dp4a run that differs from the f32 products ran the IQ3_S int8 kernels; each with its
/// vocabulary and whether it is trained.
fn test_models(dir: &std::path::Path) -> Vec<(&'static str, std::path::PathBuf, u32, bool)> {
    let q8 = dir.join("tiny-q8_0.gguf");
    strata_schemas::gguf::convert::convert_hf_folder(&data("base"), &q8, GgmlType::Q8_0, None)
        .unwrap();
    let mut hp = strata_schemas::known::qwen3_30b_a3b();
    hp.n_layer = 2;
    hp.n_embd = 256;
    hp.n_head = 8;
    hp.n_head_kv = 2;
    hp.head_dim_k = 128;
    hp.head_dim_v = 128;
    hp.n_expert = 8;
    hp.n_expert_used = 8;
    hp.n_ff_exp = 256;
    hp.n_vocab = 512;
    let write = |name: &str, preset: &str| {
        let path = dir.join(format!("{name}.gguf"));
        let recipe = strata_schemas::arch::QuantRecipe::preset(preset).unwrap();
        strata_schemas::gguf::random::write_random_model(
            &path,
            "qwen3moe",
            &hp,
            &recipe,
            7,
            strata_schemas::gguf::random::RandomOptions::default(),
        )
        .unwrap();
        path
    };
    let (q4, q4km) = (write("q4k", "Q4_K"), write("q4km", "Q4_K_M"));
    let iq3s = strata_schemas::arch::QuantRecipe {
        head: GgmlType::F16,
        attention_v: None,
        ..strata_schemas::arch::QuantRecipe::preset("IQ3_S").unwrap()
    };
    let write_iq3s = |name: &str, arch: &str, hp: &strata_schemas::inventory::HParams| {
        let path = dir.join(format!("{name}.gguf"));
        strata_schemas::gguf::random::write_random_model(
            &path,
            arch,
            hp,
            &iq3s,
            7,
            strata_schemas::gguf::random::RandomOptions::default(),
        )
        .unwrap();
        path
    };
    let next_hp = strata_schemas::inventory::HParams {
        n_embd: 256,
        n_ff_exp: 256,
        ..tiny_qwen3next_hp()
    };
    let next_vocab = next_hp.n_vocab as u32;
    vec![
        ("base", q8, 256u32, true),
        ("q4k", q4, 512, false),
        ("q4km", q4km, 512, false),
        ("iq3s", write_iq3s("iq3s", "qwen3moe", &hp), 512, false),
        (
            "next-iq3s",
            write_iq3s("next-iq3s", "qwen3next", &next_hp),
            next_vocab,
            false,
        ),
    ]
}

/// ubatch 32: the plan places the tensor-core path's `xh`, which holds the q8a rows.
fn int8_ask() -> Ask {
    Ask {
        ctx: 128,
        ubatch: 32,
        ..Ask::default()
    }
}

fn dp4a_all() -> KernelOptions {
    KernelOptions {
        int8: Int8Products::All,
        ..KernelOptions::default()
    }
}

/// How many of two runs' logits differ bit for bit.
fn differing(a: &[f32], b: &[f32]) -> usize {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

/// The engine with `dp4a` (int8 products for every type) against the CPU engine on the same
/// file, and against itself with `f32-products`: greedy tokens equal too on the trained
/// model; the random ones teacher-forced with the CPU's tokens.
#[test]
fn the_engine_with_dp4a_matches_the_cpu_engine() {
    if !gpu_present() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ask = int8_ask();
    let mut bad = Vec::new();
    for (name, gguf, vocab, trained) in test_models(dir.path()) {
        let gguf = &gguf;
        let prompt: Vec<u32> = (0..21).map(|i| (i * 37 + 11) % vocab).collect();
        let inv = strata_plan::model::load_model(gguf).unwrap();
        let cp = plan_inventory(name, &inv, gguf, &ask);
        let mut c = strata_exec::exec::start_cpu(
            &cp,
            open_model(gguf).unwrap(),
            strata_exec::exec::EngineOptions::default(),
        )
        .unwrap();
        let (cl, ct) = teacher(&mut c, &prompt, 12, None);
        let feed = (!trained).then_some(&ct[..]);
        let mut g = cuda_on(name, gguf, &ask, dp4a_all());
        let (gl, gt) = teacher(&mut g, &prompt, 12, feed);
        let mut f = cuda_on(name, gguf, &ask, KernelOptions::f32_products());
        let (fl, _) = teacher(&mut f, &prompt, 12, feed.or(Some(&gt)));
        let v = vocab as usize;
        let (e_cpu, e_f32) = (rel_err(&gl, &cl, v), rel_err(&fl, &cl, v));
        let differ = differing(&gl, &fl);
        eprintln!(
            "{name}: dp4a vs CPU {e_cpu:e} (f32 products vs CPU {e_f32:e}); {differ} of {} logits differ from the f32 products'",
            gl.len()
        );
        if e_cpu >= 3e-2 {
            bad.push(format!("{name}: dp4a vs CPU {e_cpu} (bound 3e-2)"));
        }
        if differ == 0 {
            bad.push(format!(
                "{name}: dp4a logits are the f32 products' bit for bit: the option did not run"
            ));
        }
        if trained && gt != ct {
            bad.push(format!("{name}: greedy tokens {gt:?}, CPU {ct:?}"));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("; "));
}

/// The default options choose the int8 products per weight type: on the Q8_0 model the
/// default run equals the explicit `dp4a` run bit for bit and differs from `f32-products`
/// (within the dp4a bound of it, 3e-2 of each row's largest logit); on the Q4_K, Q4_K_M and
/// IQ3_S models it equals `f32-products` bit for bit and differs from `dp4a`. All three runs fed
/// the same tokens (the f32 run's greedy picks). The prompt of 13 tokens is prefilled by the
/// few-token products (under 16 tokens: no tensor-core pass), so the staged `dq4_mv16` runs
/// in the engine too, not only the one-token decode.
#[test]
fn the_default_runs_int8_products_on_q8_0_weights_only() {
    if !gpu_present() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ask = int8_ask();
    let mut bad = Vec::new();
    for (name, gguf, vocab, _) in test_models(dir.path()) {
        let gguf = &gguf;
        let prompt: Vec<u32> = (0..13).map(|i| (i * 37 + 11) % vocab).collect();
        let mut f = cuda_on(name, gguf, &ask, KernelOptions::f32_products());
        let (fl, ft) = teacher(&mut f, &prompt, 12, None);
        drop(f);
        let run = |kernels: KernelOptions| {
            let mut e = cuda_on(name, gguf, &ask, kernels);
            teacher(&mut e, &prompt, 12, Some(&ft)).0
        };
        let (dl, al) = (run(KernelOptions::default()), run(dp4a_all()));
        let (d_f32, d_all) = (differing(&dl, &fl), differing(&dl, &al));
        let e = rel_err(&dl, &fl, vocab as usize);
        eprintln!(
            "{name}: default vs f32-products: {d_f32} of {} logits differ ({e:e}); vs dp4a: {d_all} differ",
            dl.len()
        );
        if name == "base" {
            if d_f32 == 0 {
                bad.push(format!("{name} (Q8_0): the default ran the f32 products"));
            }
            if d_all != 0 {
                bad.push(format!(
                    "{name} (Q8_0): the default is not the dp4a run bit for bit"
                ));
            }
            if e >= 3e-2 {
                bad.push(format!(
                    "{name} (Q8_0): default vs f32-products {e} (bound 3e-2)"
                ));
            }
        } else {
            if d_f32 != 0 {
                bad.push(format!(
                    "{name}: the default is not the f32 products bit for bit"
                ));
            }
            if differing(&al, &fl) == 0 {
                bad.push(format!("{name}: dp4a ran the f32 products"));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("; "));
}
