//! Op tests of the fused decode kernels of `kernels/cuda/decode.cu` (`dq_mv1`/`dq_mv8`,
//! `dq_qkv1`/`dq_qkv8`, `dq_moe_gate_up`, `dq_moe_down`, `dq_moe_down_rows`, `dq_router_rows`,
//! `dq_attn_fused`): each is launched directly, with the grid and block its comment states,
//! on fresh random weights (Q8_0 in the device split layout, Q4_K/BF16/F16/F32 in the GGUF
//! layout) and inputs, and compared with an f64 reference written here under the tolerance
//! stated at each check.
//! Invariant: without a usable CUDA device each test prints `SKIP (no CUDA device): ...` and
//! returns, never passing silently; every output buffer ends in a poisoned tail that must come
//! back untouched (rows past `rows`, tokens past `n_tok`), and every input ends in NaNs that
//! would show in an output if read. Run on a GPU machine with
//! `cargo test -p strata-exec --release --test cuda_decode_ops -- --test-threads=1 --nocapture`.
#![cfg(feature = "cuda")]

mod cuda_common;
use cuda_common::{get, put, rand_vec, Carve};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use rand::{rngs::StdRng, seq::SliceRandom, Rng, SeedableRng};
use rayon::prelude::*;
use std::sync::OnceLock;
use strata_exec::backend::cuda::{layout, CudaDevice, DeviceArena, DeviceView};
use strata_exec::quant;
use strata_schemas::ggml::GgmlType;

static DEV: OnceLock<Result<CudaDevice, String>> = OnceLock::new();

fn dev(test: &str) -> Option<&'static CudaDevice> {
    cuda_common::device_or_skip(&DEV, test, || {
        let d = CudaDevice::open(0).map_err(|e| e.to_string())?;
        eprintln!(
            "device: {} ({}), NVRTC {:?}",
            d.name(),
            d.arch(),
            d.nvrtc_version()
        );
        Ok(d)
    })
}

/// RMSNorm epsilon passed to every kernel.
const EPS: f32 = 1e-6;
/// decode.cu's DQ_WARPS: warps (output rows) per block of the one-warp-per-row kernels.
const DQ_WARPS: u32 = 4;
/// decode.cu's DQ_MAX_TOK: tokens per grid.y chunk of the `*8` kernels.
const DQ_MAX_TOK: usize = 8;
/// Extra poisoned values after every buffer's tail (beyond the whole-chunk tails).
const GUARD: usize = 67;
/// A quiet NaN no kernel computes: the poisoned tails' bit pattern.
const POISON: u32 = 0x7fc0_beef;
/// The poisoned tail of int buffers.
const POISON_I32: i32 = 0x5a5a_5a5a;

fn poison() -> f32 {
    f32::from_bits(POISON)
}

/// `v` followed by `tail` poisoned floats.
fn poisoned(v: &[f32], tail: usize) -> Vec<f32> {
    let mut out = v.to_vec();
    out.resize(v.len() + tail, poison());
    out
}

/// Asserts that `got[from..]` is still the poison it was filled with.
fn assert_untouched(what: &str, got: &[f32], from: usize) {
    if let Some(i) = got[from..].iter().position(|v| v.to_bits() != POISON) {
        panic!(
            "{what}: wrote past its output: element {} (output ends at {from}) holds {}",
            from + i,
            got[from + i]
        );
    }
}

/// A carve starting where `c` stands (buffers of an inner loop after the outer loop's).
fn after<'a>(a: &'a DeviceArena, c: &Carve<'a>) -> Carve<'a> {
    let n = Carve::new(a);
    n.off.set(c.off.get());
    n
}

/// Kernel type numbers (common.cuh's ST_TY_*).
fn kty(ty: GgmlType) -> i32 {
    match ty {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::BF16 => 2,
        GgmlType::Q8_0 => 3,
        GgmlType::Q4K => 4,
        _ => panic!("no decode kernel reads {ty}"),
    }
}

fn f16_at(b: &[u8], at: usize) -> f64 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f64()
}

/// ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j of a Q4_K block's 12
/// scale bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// One weight matrix as the kernels read it and as the reference uses it.
struct Mat {
    rows: usize,
    cols: usize,
    /// The device layout: Q8_0 split (`layout::to_device`), every other type as in GGUF.
    dev: Vec<u8>,
    /// Exact element values, decoded here from the GGUF bytes (f16 scales times integer
    /// quants are exact in f64).
    w: Vec<f64>,
    /// Per element, the magnitude the kernel's f32 arithmetic rounds against: |w|, except
    /// Q4_K's |d*sc*q| + |dmin*m| (the kernel sums the scaled quants and the mins apart).
    wabs: Vec<f64>,
}

/// Decodes one GGUF row of `ty` exactly into `w` / `wabs`.
fn decode_row(ty: GgmlType, row: &[u8], w: &mut Vec<f64>, wabs: &mut Vec<f64>) {
    match ty {
        GgmlType::F32 => {
            for b in row.chunks_exact(4) {
                let v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64;
                w.push(v);
                wabs.push(v.abs());
            }
        }
        GgmlType::F16 | GgmlType::BF16 => {
            for b in row.chunks_exact(2) {
                let bits = u16::from_le_bytes([b[0], b[1]]);
                let v = if ty == GgmlType::F16 {
                    half::f16::from_bits(bits).to_f64()
                } else {
                    half::bf16::from_bits(bits).to_f64()
                };
                w.push(v);
                wabs.push(v.abs());
            }
        }
        GgmlType::Q8_0 => {
            for blk in row.chunks_exact(quant::Q8_0_BYTES) {
                let d = f16_at(blk, 0);
                for &q in &blk[2..] {
                    let v = d * (q as i8) as f64;
                    w.push(v);
                    wabs.push(v.abs());
                }
            }
        }
        GgmlType::Q4K => {
            for blk in row.chunks_exact(quant::Q4_K_BYTES) {
                let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
                let (scales, qs) = (&blk[4..16], &blk[16..]);
                for i in 0..quant::QK_K {
                    let (g, hi, l) = (i / 64, (i % 64) >= 32, i % 32);
                    let (sc, m) = scale_min_k4(2 * g + hi as usize, scales);
                    let qb = qs[32 * g + l];
                    let q = if hi { qb >> 4 } else { qb & 0xF };
                    let (a, b) = (d * sc as f64 * q as f64, dmin * m as f64);
                    w.push(a - b);
                    wabs.push(a.abs() + b.abs());
                }
            }
        }
        _ => panic!("no decoder for {ty}"),
    }
}

/// A random `rows x cols` matrix of `ty` (row scales and offsets vary, so Q4_K's scales and
/// mins are exercised), quantized by the host quantizer. The exact decode here is checked
/// against `quant::dequantize_row` (f32: within one rounding of the exact value).
fn mat(rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> Mat {
    let mut gguf = Vec::new();
    for _ in 0..rows {
        let s = 0.2 + 2.0 * rng.random::<f32>();
        let off = 0.3 * (2.0 * rng.random::<f32>() - 1.0);
        let row: Vec<f32> = (0..cols)
            .map(|_| off + s * (2.0 * rng.random::<f32>() - 1.0))
            .collect();
        quant::quantize_row(ty, &row, &mut gguf).unwrap();
    }
    let rb = quant::row_bytes(ty, cols).unwrap();
    assert_eq!(gguf.len(), rows * rb);
    let (mut w, mut wabs) = (
        Vec::with_capacity(rows * cols),
        Vec::with_capacity(rows * cols),
    );
    let mut deq = vec![0f32; cols];
    for (r, row) in gguf.chunks_exact(rb).enumerate() {
        decode_row(ty, row, &mut w, &mut wabs);
        quant::dequantize_row(ty, row, &mut deq).unwrap();
        for (i, &v) in deq.iter().enumerate() {
            let (e, a) = (w[r * cols + i], wabs[r * cols + i]);
            assert!(
                (v as f64 - e).abs() <= 1.2e-7 * a,
                "{ty} decode of row {r} element {i}: test {e} vs quant {v}"
            );
        }
    }
    let mut dev = vec![0u8; gguf.len()];
    layout::to_device(ty, &gguf, 1, rows, cols, &mut dev).unwrap();
    Mat {
        rows,
        cols,
        dev,
        w,
        wabs,
    }
}

/// The kernels' input per token: x[t] RMS-normalised and scaled by nw when nw is given
/// (x * nw / sqrt(mean(x^2) + eps)), else x itself; in f64.
fn kernel_input(x: &[f32], cols: usize, nw: Option<&[f32]>, eps: f32) -> Vec<f64> {
    x.chunks_exact(cols)
        .flat_map(|xt| {
            let s = match nw {
                Some(_) => {
                    let ss: f64 = xt.iter().map(|&v| v as f64 * v as f64).sum();
                    1.0 / (ss / cols as f64 + eps as f64).sqrt()
                }
                None => 1.0,
            };
            xt.iter()
                .enumerate()
                .map(move |(i, &v)| v as f64 * s * nw.map_or(1.0, |w| w[i] as f64))
        })
        .collect()
}

/// `(W_r . xin[t], sum_i wabs[r][i] * |xin[t][i]|)` for every token and row, as
/// `[t * rows + r]`.
fn products(m: &Mat, xin: &[f64], n_tok: usize) -> (Vec<f64>, Vec<f64>) {
    let (rows, cols) = (m.rows, m.cols);
    assert_eq!(xin.len(), n_tok * cols);
    let per_row: Vec<Vec<(f64, f64)>> = (0..rows)
        .into_par_iter()
        .map(|r| {
            let (w, wa) = (
                &m.w[r * cols..(r + 1) * cols],
                &m.wabs[r * cols..(r + 1) * cols],
            );
            xin.chunks_exact(cols)
                .map(|x| {
                    w.iter()
                        .zip(wa)
                        .zip(x)
                        .fold((0.0, 0.0), |(s, a), ((w, wa), x)| {
                            (s + w * x, a + wa * x.abs())
                        })
                })
                .collect()
        })
        .collect();
    let (mut dot, mut mag) = (vec![0.0; n_tok * rows], vec![0.0; n_tok * rows]);
    for (r, per_tok) in per_row.iter().enumerate() {
        for (t, &(s, a)) in per_tok.iter().enumerate() {
            dot[t * rows + r] = s;
            mag[t * rows + r] = a;
        }
    }
    (dot, mag)
}

/// Asserts, for every output, |got - want| <= rel * mag + 2.4e-7 * |want| + 1e-6 (`mag`: the
/// output's sum of |w x|, which bounds f32 summation-order error; 2.4e-7 |want|: the final
/// rounding and an added y; 1e-6: outputs that cancel to about 0) and a finite `got`.
/// Returns the largest err / (mag + 1e-6).
fn check_dots(what: &str, got: &[f32], want: &[f64], mag: &[f64], rel: f64) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut worst = 0f64;
    for (i, ((&g, &w), &m)) in got.iter().zip(want).zip(mag).enumerate() {
        let e = (g as f64 - w).abs();
        let tol = rel * m + 2.4e-7 * w.abs() + 1e-6;
        assert!(
            g.is_finite() && e <= tol,
            "{what}: output {i}: got {g}, want {w} (err {e:.3e}, tol {tol:.3e}, sum|wx| {m:.3e})"
        );
        worst = worst.max(e / (m + 1e-6));
    }
    worst
}

/// Asserts |got - want| <= atol + rtol * |want| and a finite `got` elementwise.
fn check_close(what: &str, got: &[f32], want: &[f64], atol: f64, rtol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let e = (g as f64 - w).abs();
        assert!(
            g.is_finite() && e <= atol + rtol * w.abs(),
            "{what}: element {i}: got {g}, want {w} (err {e:.3e}, atol {atol:.0e}, rtol {rtol:.0e})"
        );
    }
}

/// Output tolerance relative to sum |w x|: f32 products summed in the kernel's order.
const REL: f64 = 2e-6;
/// The same with the RMSNorm folded in: the kernel's RMS factor is itself an f32 sum of
/// `cols` squares (up to ~1.3e-6 relative in the worst case), scaling every product.
const REL_NORM: f64 = 4e-6;
/// xn_out (the normalised input) against the f64 one: that RMS factor and two roundings.
const XN_RTOL: f64 = 3e-6;

fn cfg(grid: (u32, u32, u32), block: u32) -> LaunchConfig {
    cfg_smem(grid, block, 0)
}

fn cfg_smem(grid: (u32, u32, u32), block: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem,
    }
}

/// Dynamic shared memory with which a one-token Q8_0 product without norm stages its input
/// there (decode.cu's dq_xs_fill; the engine's `xs_bytes`): cols floats, at most 48 KiB.
/// None where the kernel would not take it.
fn xs_smem(nt: usize, ty: GgmlType, nw: bool, cols: usize) -> Option<u32> {
    (nt == 1 && ty == GgmlType::Q8_0 && !nw && cols * 4 <= 48 << 10).then_some(4 * cols as u32)
}

/// Bit-for-bit equality of a staged-input launch's output with the plain launch's.
fn assert_same_bits(what: &str, plain: &[f32], staged: &[f32]) {
    assert_eq!(plain.len(), staged.len());
    for (i, (a, b)) in plain.iter().zip(staged).enumerate() {
        assert!(
            a.to_bits() == b.to_bits(),
            "{what}: input staged in shared memory: element {i} is {b}, the plain launch gave {a}"
        );
    }
}

/// Waits for kernel `name` and turns a device fault into a panic naming it.
fn finish(d: &CudaDevice, name: &str) {
    d.synchronize()
        .unwrap_or_else(|e| panic!("{name} failed on the device: {e}"));
}

/// Converts a size to the kernels' `int`.
fn int(v: usize) -> i32 {
    i32::try_from(v).unwrap()
}

/// Arguments of `dq_mv1` / `dq_mv8` (pointers as device addresses, 0 for null).
struct MvArgs {
    w: u64,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    x: u64,
    nw: u64,
    y: u64,
    n_tok: usize,
    add: bool,
    xn_out: u64,
    /// Dynamic shared memory of the launch (the staged input, see `xs_smem`), else 0.
    smem: u32,
}

/// grid.x of a `dq_mv1`/`dq_mv8` launch: a warp per row, except on decode.cu's register path
/// (one token per chunk, Q8_0 rows of at most 2048 columns), where three blocks make each
/// warp walk every twelfth row, as the engine's capped grid for the LM head does at scale.
fn blocks_x(nt: usize, ty: GgmlType, rows: usize, cols: usize) -> u32 {
    let full = (rows as u32).div_ceil(DQ_WARPS);
    if nt == 1 && ty == GgmlType::Q8_0 && cols <= 2048 {
        full.min(3)
    } else {
        full
    }
}

/// `dq_mv1` (nt = 1) or `dq_mv8` (nt = 8): grid (ceil(rows / 4), ceil(n_tok / nt) +
/// extra_chunks), block 128.
fn launch_mv(d: &CudaDevice, nt: usize, a: &MvArgs, extra_chunks: u32) {
    let name = if nt == 1 { "dq_mv1" } else { "dq_mv8" };
    let (ty, rows, cols, n, add) = (
        kty(a.ty),
        int(a.rows),
        int(a.cols),
        int(a.n_tok),
        a.add as i32,
    );
    let grid = (
        blocks_x(nt, a.ty, a.rows, a.cols),
        a.n_tok.div_ceil(nt) as u32 + extra_chunks,
        1,
    );
    let f = d.function(name).unwrap();
    let mut b = d.stream().launch_builder(f);
    b.arg(&a.w)
        .arg(&ty)
        .arg(&rows)
        .arg(&cols)
        .arg(&a.x)
        .arg(&a.nw)
        .arg(&EPS)
        .arg(&a.y)
        .arg(&n)
        .arg(&add)
        .arg(&a.xn_out);
    // SAFETY: the arguments follow dq_mv's parameter list with the C types' Rust equivalents
    // (const u8*/float* as u64 device addresses, int as i32, float as f32); w holds a
    // rows x cols matrix of ty in the device layout, x n_tok x cols floats and y n_tok x rows
    // (each plus a tail), xn_out (when non-zero) n_tok x cols, nw (when non-zero) cols, all
    // in a live test arena at 256-byte aligned offsets.
    unsafe { b.launch(cfg_smem(grid, 32 * DQ_WARPS, a.smem)) }
        .unwrap_or_else(|e| panic!("launch {name}: {e}"));
    finish(d, name);
}

#[test]
fn mv_q8_0_split_and_gguf_types_with_norm_add_and_xn_out() {
    let Some(d) = dev("dq_mv") else { return };
    let mut rng = StdRng::seed_from_u64(0xdec0_0001);
    let a = d.alloc_arena("test", 64 << 20).unwrap();
    // (type, cols, rows): Q8_0 at the brief's sizes; Q4_K whole super-blocks; BF16/F32 also
    // at widths off the vector paths (cols % 8 != 0, cols % 4 != 0: the scalar loop).
    let cases: &[(GgmlType, &[usize], &[usize])] = &[
        (
            GgmlType::Q8_0,
            &[32, 96, 2048, 2080, 4096],
            &[1, 7, 129, 1000],
        ),
        (GgmlType::Q4K, &[256, 2048, 4096], &[1, 7, 129]),
        (GgmlType::BF16, &[32, 96, 2080, 36, 1001], &[1, 7, 129]),
        (GgmlType::F32, &[32, 2080, 4096, 33, 1002], &[1, 7, 129]),
        (GgmlType::F16, &[96, 77], &[7, 33]),
    ];
    // (tokens per chunk, token counts): dq_mv1 also serves several tokens, one per grid.y.
    let runs: &[(usize, &[usize])] = &[
        (1, &[1, 3]),
        (DQ_MAX_TOK, &[1, 2, 3, 4, 5, 6, 7, 8, 11, 17]),
    ];
    // (nw, add, xn_out given, extra grid.y chunks).
    let variants = [
        (false, false, true, 0u32),
        (false, true, false, 1),
        (true, false, true, 0),
        (true, true, false, 1),
    ];
    for &(ty, colss, rowss) in cases {
        let (mut worst, mut worst_norm, mut launches) = (0f64, 0f64, 0);
        let mut staged_launches = 0;
        for &cols in colss {
            for &rows in rowss {
                let m = mat(&mut rng, ty, rows, cols);
                let c = Carve::new(&a);
                let wv = put(d, &c, &m.dev);
                for &(nt, toks) in runs {
                    let name = if nt == 1 { "dq_mv1" } else { "dq_mv8" };
                    for &n in toks {
                        let c2 = after(&a, &c);
                        let x = rand_vec(&mut rng, n * cols, 2.0);
                        let nw = rand_vec(&mut rng, cols, 1.5);
                        // NaN tails: a whole chunk of tokens past n_tok, columns past cols.
                        let xv = put(d, &c2, &poisoned(&x, DQ_MAX_TOK * cols + GUARD));
                        let nwv = put(d, &c2, &poisoned(&nw, GUARD));
                        let plain = kernel_input(&x, cols, None, EPS);
                        let normed = kernel_input(&x, cols, Some(&nw), EPS);
                        let (dot_p, mag_p) = products(&m, &plain, n);
                        let (dot_n, mag_n) = products(&m, &normed, n);
                        for &(use_nw, add, with_xn, extra) in &variants {
                            let c3 = after(&a, &c2);
                            let y0 = rand_vec(&mut rng, n * rows, 1.0);
                            let y_tail = DQ_MAX_TOK * rows + GUARD;
                            let yv = put(d, &c3, &poisoned(&y0, y_tail));
                            let xn_len = n * cols + DQ_MAX_TOK * cols + GUARD;
                            let xnv = put(d, &c3, &vec![poison(); xn_len]);
                            let args = MvArgs {
                                w: wv.ptr(),
                                ty,
                                rows,
                                cols,
                                x: xv.ptr(),
                                nw: if use_nw { nwv.ptr() } else { 0 },
                                y: yv.ptr(),
                                n_tok: n,
                                add,
                                xn_out: if with_xn { xnv.ptr() } else { 0 },
                                smem: 0,
                            };
                            launch_mv(d, nt, &args, extra);
                            launches += 1;
                            let what = format!(
                                "{name} {ty} rows={rows} cols={cols} n_tok={n} nw={use_nw} add={add} xn_out={with_xn} grid.y+{extra}"
                            );
                            let got = get::<f32>(d, yv, n * rows + y_tail);
                            assert_untouched(&what, &got, n * rows);
                            let (dot, mag) = if use_nw {
                                (&dot_n, &mag_n)
                            } else {
                                (&dot_p, &mag_p)
                            };
                            let want: Vec<f64> = dot
                                .iter()
                                .zip(&y0)
                                .map(|(p, &y)| p + if add { y as f64 } else { 0.0 })
                                .collect();
                            let rel = if use_nw { REL_NORM } else { REL };
                            let e = check_dots(&what, &got[..n * rows], &want, mag, rel);
                            if use_nw {
                                worst_norm = worst_norm.max(e);
                            } else {
                                worst = worst.max(e);
                            }
                            // xn_out: written (by grid column 0) only when nw is given.
                            let xn = get::<f32>(d, xnv, xn_len);
                            if use_nw && with_xn {
                                check_close(
                                    &format!("{what}: xn_out"),
                                    &xn[..n * cols],
                                    &normed,
                                    1e-6,
                                    XN_RTOL,
                                );
                                assert_untouched(&format!("{what}: xn_out"), &xn, n * cols);
                            } else {
                                assert_untouched(&format!("{what}: xn_out"), &xn, 0);
                            }
                            // The staged input (rows wider than the register path's 2048).
                            if let Some(smem) =
                                xs_smem(nt, ty, use_nw, cols).filter(|_| cols > 2048)
                            {
                                d.htod(&poisoned(&y0, y_tail), yv).unwrap();
                                launch_mv(d, nt, &MvArgs { smem, ..args }, extra);
                                let staged = get::<f32>(d, yv, n * rows + y_tail);
                                assert_same_bits(&what, &got, &staged);
                                staged_launches += 1;
                            }
                        }
                    }
                }
            }
        }
        eprintln!(
            "PASS dq_mv1/dq_mv8 {ty}: cols {colss:?} rows {rowss:?}, tokens 1,3 (mv1) and 1..8,11,17 (mv8), nw/add/xn_out variants, {launches} launches: max err/sum|wx| {worst:.3e} (tol {REL:.0e}), with norm {worst_norm:.3e} (tol {REL_NORM:.0e}); xn_out rtol {XN_RTOL:.0e}; tails untouched; {staged_launches} launches with the input staged in shared memory bit for bit the same"
        );
    }
}

/// `dq_qkv1` (nt = 1) or `dq_qkv8`: grid (ceil((rq + rk + rv) / 4), ceil(n_tok / nt)),
/// block 128. `w` and `y` are the (Q, K, V) matrices and outputs, `r` their row counts.
#[allow(clippy::too_many_arguments)]
fn launch_qkv(
    d: &CudaDevice,
    nt: usize,
    w: [u64; 3],
    ty: GgmlType,
    r: [usize; 3],
    cols: usize,
    x: u64,
    nw: u64,
    y: [u64; 3],
    n_tok: usize,
    smem: u32,
) {
    let name = if nt == 1 { "dq_qkv1" } else { "dq_qkv8" };
    let (t, rq, rk, rv, c, n) = (
        kty(ty),
        int(r[0]),
        int(r[1]),
        int(r[2]),
        int(cols),
        int(n_tok),
    );
    let grid = (
        ((r[0] + r[1] + r[2]) as u32).div_ceil(DQ_WARPS),
        n_tok.div_ceil(nt) as u32,
        1,
    );
    let f = d.function(name).unwrap();
    let mut b = d.stream().launch_builder(f);
    b.arg(&w[0])
        .arg(&w[1])
        .arg(&w[2])
        .arg(&t)
        .arg(&rq)
        .arg(&rk)
        .arg(&rv)
        .arg(&c)
        .arg(&x)
        .arg(&nw)
        .arg(&EPS)
        .arg(&y[0])
        .arg(&y[1])
        .arg(&y[2])
        .arg(&n);
    // SAFETY: the arguments follow dq_qkv's parameter list (pointers as u64 device
    // addresses, int as i32, float as f32); w[i] holds an r[i] x cols matrix of ty in the
    // device layout and y[i] n_tok x r[i] floats (plus a tail), x n_tok x cols, nw (when
    // non-zero) cols, all in a live test arena at 256-byte aligned offsets; smem is at most
    // 48 KiB.
    unsafe { b.launch(cfg_smem(grid, 32 * DQ_WARPS, smem)) }
        .unwrap_or_else(|e| panic!("launch {name}: {e}"));
    finish(d, name);
}

#[test]
fn qkv_three_matrices_in_one_launch() {
    let Some(d) = dev("dq_qkv") else { return };
    let mut rng = StdRng::seed_from_u64(0xdec0_0002);
    let a = d.alloc_arena("test", 64 << 20).unwrap();
    // (type, cols, rq, rk, rv): Qwen3-30B's 4096/512/512, small heads, and row counts that
    // are not multiples of the block's 4 rows (blocks straddling Q|K and K|V).
    let cases: &[(GgmlType, usize, [usize; 3])] = &[
        (GgmlType::Q8_0, 2048, [4096, 512, 512]),
        (GgmlType::Q8_0, 96, [96, 32, 32]),
        (GgmlType::Q8_0, 2080, [7, 5, 3]),
        (GgmlType::Q8_0, 32, [1, 1, 1]),
        (GgmlType::Q4K, 2048, [4096, 512, 512]),
        (GgmlType::Q4K, 256, [7, 5, 3]),
        (GgmlType::BF16, 2048, [96, 32, 32]),
        (GgmlType::BF16, 1001, [7, 5, 3]),
        (GgmlType::F32, 96, [6, 3, 5]),
    ];
    let runs: &[(usize, &[usize])] = &[(1, &[1, 2]), (DQ_MAX_TOK, &[1, 3, 8, 11])];
    let (mut worst, mut worst_norm, mut staged) = (0f64, 0f64, 0);
    for &(ty, cols, r) in cases {
        let ms: Vec<Mat> = r
            .iter()
            .map(|&rows| mat(&mut rng, ty, rows, cols))
            .collect();
        let c = Carve::new(&a);
        let wv: Vec<DeviceView> = ms.iter().map(|m| put(d, &c, &m.dev)).collect();
        for &(nt, toks) in runs {
            let name = if nt == 1 { "dq_qkv1" } else { "dq_qkv8" };
            for &n in toks {
                for use_nw in [false, true] {
                    let c2 = after(&a, &c);
                    let x = rand_vec(&mut rng, n * cols, 2.0);
                    let nw = rand_vec(&mut rng, cols, 1.5);
                    let xv = put(d, &c2, &poisoned(&x, DQ_MAX_TOK * cols + GUARD));
                    let nwv = put(d, &c2, &poisoned(&nw, GUARD));
                    let xin = kernel_input(&x, cols, use_nw.then_some(&nw[..]), EPS);
                    let tails: Vec<usize> =
                        r.iter().map(|&rows| DQ_MAX_TOK * rows + GUARD).collect();
                    let yv: Vec<DeviceView> = (0..3)
                        .map(|j| put(d, &c2, &vec![poison(); n * r[j] + tails[j]]))
                        .collect();
                    launch_qkv(
                        d,
                        nt,
                        [wv[0].ptr(), wv[1].ptr(), wv[2].ptr()],
                        ty,
                        r,
                        cols,
                        xv.ptr(),
                        if use_nw { nwv.ptr() } else { 0 },
                        [yv[0].ptr(), yv[1].ptr(), yv[2].ptr()],
                        n,
                        0,
                    );
                    let mut plain_out = Vec::new();
                    for (j, qkv) in ["q", "k", "v"].iter().enumerate() {
                        let what = format!(
                            "{name} {ty} cols={cols} rows {r:?} n_tok={n} nw={use_nw}: y{qkv}"
                        );
                        let got = get::<f32>(d, yv[j], n * r[j] + tails[j]);
                        assert_untouched(&what, &got, n * r[j]);
                        let (dot, mag) = products(&ms[j], &xin, n);
                        let rel = if use_nw { REL_NORM } else { REL };
                        let e = check_dots(&what, &got[..n * r[j]], &dot, &mag, rel);
                        if use_nw {
                            worst_norm = worst_norm.max(e);
                        } else {
                            worst = worst.max(e);
                        }
                        plain_out.push(got);
                    }
                    // The staged input (the kernel stages nothing when nw is given).
                    if let Some(smem) = xs_smem(nt, ty, use_nw, cols) {
                        for (j, y) in yv.iter().enumerate() {
                            d.htod(&vec![poison(); n * r[j] + tails[j]], *y).unwrap();
                        }
                        launch_qkv(
                            d,
                            nt,
                            [wv[0].ptr(), wv[1].ptr(), wv[2].ptr()],
                            ty,
                            r,
                            cols,
                            xv.ptr(),
                            if use_nw { nwv.ptr() } else { 0 },
                            [yv[0].ptr(), yv[1].ptr(), yv[2].ptr()],
                            n,
                            smem,
                        );
                        for j in 0..3 {
                            let staged = get::<f32>(d, yv[j], n * r[j] + tails[j]);
                            let what = format!(
                                "{name} {ty} cols={cols} rows {r:?} n_tok={n} nw={use_nw}: y{j}"
                            );
                            assert_same_bits(&what, &plain_out[j], &staged);
                        }
                        staged += 1;
                    }
                }
            }
        }
    }
    eprintln!(
        "PASS dq_qkv1/dq_qkv8: Q8_0/Q4_K/BF16/F32, rows 4096/512/512, 96/32/32, 7/5/3, 1/1/1; tokens 1,2 (qkv1) and 1,3,8,11 (qkv8); max err/sum|wx| {worst:.3e} (tol {REL:.0e}), with norm {worst_norm:.3e} (tol {REL_NORM:.0e}); tails untouched; {staged} launches with the input staged in shared memory bit for bit the same"
    );
}

/// MoE experts: gate and up (F x E) and down (E x F) per expert, with the eptr table of
/// their device addresses (expert e at [e*3 + 0/1/2]). A test builds only the matrices its
/// kernel reads; the others' entries are 0, so reading one faults.
struct Experts {
    gate: Vec<Mat>,
    up: Vec<Mat>,
    down: Vec<Mat>,
}

fn experts(
    rng: &mut StdRng,
    ty: GgmlType,
    n_expert: usize,
    e: usize,
    f: usize,
    gate_up: bool,
) -> Experts {
    let mut ex = Experts {
        gate: Vec::new(),
        up: Vec::new(),
        down: Vec::new(),
    };
    for _ in 0..n_expert {
        if gate_up {
            ex.gate.push(mat(rng, ty, f, e));
            ex.up.push(mat(rng, ty, f, e));
        } else {
            ex.down.push(mat(rng, ty, e, f));
        }
    }
    ex
}

/// Uploads the experts' matrices and returns the eptr table.
fn upload_experts<'a>(
    d: &CudaDevice,
    c: &Carve<'a>,
    ex: &Experts,
    n_expert: usize,
) -> DeviceView<'a> {
    let mut table = vec![0u64; 3 * n_expert];
    for (which, mats) in [&ex.gate, &ex.up, &ex.down].into_iter().enumerate() {
        for (e, m) in mats.iter().enumerate() {
            table[e * 3 + which] = put(d, c, &m.dev).ptr();
        }
    }
    put(d, c, &table)
}

/// `n_tok` tokens' k distinct expert ids each (different tokens share experts).
fn route(rng: &mut StdRng, n_tok: usize, n_expert: usize, k: usize) -> Vec<i32> {
    let mut ids = Vec::new();
    let mut all: Vec<i32> = (0..n_expert as i32).collect();
    for _ in 0..n_tok {
        all.shuffle(rng);
        ids.extend_from_slice(&all[..k]);
    }
    ids
}

fn silu(v: f64) -> f64 {
    v / (1.0 + (-v).exp())
}

/// `dq_moe_gate_up`: grid (ceil(F / 4), n_tok * k), block 128.
#[allow(clippy::too_many_arguments)]
fn launch_gate_up(
    d: &CudaDevice,
    eptr: u64,
    ty: GgmlType,
    f: usize,
    e: usize,
    ids: u64,
    k: usize,
    x: u64,
    nw: u64,
    h: u64,
    n_tok: usize,
    smem: u32,
) {
    let name = "dq_moe_gate_up";
    let (t, fi, ei, ki) = (kty(ty), int(f), int(e), int(k));
    let grid = ((f as u32).div_ceil(DQ_WARPS), (n_tok * k) as u32, 1);
    let fun = d.function(name).unwrap();
    let mut b = d.stream().launch_builder(fun);
    b.arg(&eptr)
        .arg(&t)
        .arg(&fi)
        .arg(&ei)
        .arg(&ids)
        .arg(&ki)
        .arg(&x)
        .arg(&nw)
        .arg(&EPS)
        .arg(&h);
    // SAFETY: the arguments follow dq_moe_gate_up's parameter list (pointers as u64 device
    // addresses, int as i32, float as f32); eptr holds 3 addresses per expert whose gate and
    // up entries are F x E matrices of ty in the device layout, ids n_tok * k ids below the
    // expert count, x n_tok x E floats, nw (when non-zero) E, h n_tok * k x F (plus a tail),
    // all in a live test arena; smem is at most 48 KiB.
    unsafe { b.launch(cfg_smem(grid, 32 * DQ_WARPS, smem)) }
        .unwrap_or_else(|e| panic!("launch {name}: {e}"));
    finish(d, name);
}

#[test]
fn moe_gate_up_swiglu_reads_experts_by_id() {
    let Some(d) = dev("dq_moe_gate_up") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(0xdec0_0003);
    let a = d.alloc_arena("test", 128 << 20).unwrap();
    // (type, E (hidden, the matrices' cols), F (expert width, rows), experts, top-k).
    let cases: &[(GgmlType, usize, usize, usize, &[usize])] = &[
        (GgmlType::Q8_0, 2048, 768, 8, &[1, 2, 8]),
        (GgmlType::Q8_0, 96, 7, 5, &[1, 3]),
        (GgmlType::Q8_0, 32, 129, 4, &[2]),
        (GgmlType::Q4K, 256, 129, 4, &[1, 3]),
        (GgmlType::Q4K, 2048, 33, 3, &[2]),
        (GgmlType::BF16, 96, 33, 5, &[1, 2]),
        (GgmlType::BF16, 1001, 7, 3, &[2]),
        (GgmlType::F32, 36, 17, 3, &[2]),
    ];
    let (mut worst, mut staged) = (0f64, 0);
    for &(ty, e, f, n_expert, ks) in cases {
        let ex = experts(&mut rng, ty, n_expert, e, f, true);
        let c = Carve::new(&a);
        let eptr = upload_experts(d, &c, &ex, n_expert);
        for &k in ks {
            for &n in &[1usize, 3, 8] {
                // Q8_0 without nw takes the kernel's paired gate/up loop, with nw dq_row_dot.
                for use_nw in [false, true] {
                    let c2 = after(&a, &c);
                    let x = rand_vec(&mut rng, n * e, 2.0);
                    let nw = rand_vec(&mut rng, e, 1.5);
                    let ids = route(&mut rng, n, n_expert, k);
                    let xv = put(d, &c2, &poisoned(&x, e + GUARD));
                    let nwv = put(d, &c2, &poisoned(&nw, GUARD));
                    let idv = put(d, &c2, &ids);
                    let h_tail = k * f + GUARD;
                    let hv = put(d, &c2, &vec![poison(); n * k * f + h_tail]);
                    launch_gate_up(
                        d,
                        eptr.ptr(),
                        ty,
                        f,
                        e,
                        idv.ptr(),
                        k,
                        xv.ptr(),
                        if use_nw { nwv.ptr() } else { 0 },
                        hv.ptr(),
                        n,
                        0,
                    );
                    let what =
                        format!("dq_moe_gate_up {ty} E={e} F={f} k={k} n_tok={n} nw={use_nw}");
                    let got = get::<f32>(d, hv, n * k * f + h_tail);
                    assert_untouched(&what, &got, n * k * f);
                    let xin = kernel_input(&x, e, use_nw.then_some(&nw[..]), EPS);
                    let rel = if use_nw { REL_NORM } else { REL };
                    for (asg, &id) in ids.iter().enumerate() {
                        let xt = &xin[(asg / k) * e..(asg / k + 1) * e];
                        let (g, gm) = products(&ex.gate[id as usize], xt, 1);
                        let (u, um) = products(&ex.up[id as usize], xt, 1);
                        for r in 0..f {
                            let want = silu(g[r]) * u[r];
                            // g and u each within rel * sum|wx| + 1e-6 (as check_dots); silu'
                            // is at most 1.1 in magnitude; then expf and the products' own
                            // roundings.
                            let (eg, eu) = (rel * gm[r] + 1e-6, rel * um[r] + 1e-6);
                            let tol = 1.1 * eg * u[r].abs()
                                + silu(g[r]).abs() * eu
                                + eg * eu
                                + 1e-6 * want.abs()
                                + 1e-6;
                            let v = got[asg * f + r];
                            let err = (v as f64 - want).abs();
                            assert!(
                                v.is_finite() && err <= tol,
                                "{what}: assignment {asg} (token {}, expert {id}) row {r}: got {v}, want {want} (err {err:.3e}, tol {tol:.3e})",
                                asg / k
                            );
                            worst = worst.max(err / tol);
                        }
                    }
                    // The staged input: every token's x (grid.y picks it), no norm.
                    if let Some(smem) = xs_smem(1, ty, use_nw, e) {
                        d.htod(&vec![poison(); n * k * f + h_tail], hv).unwrap();
                        launch_gate_up(
                            d,
                            eptr.ptr(),
                            ty,
                            f,
                            e,
                            idv.ptr(),
                            k,
                            xv.ptr(),
                            0,
                            hv.ptr(),
                            n,
                            smem,
                        );
                        let staged_h = get::<f32>(d, hv, n * k * f + h_tail);
                        assert_same_bits(&what, &got, &staged_h);
                        staged += 1;
                    }
                }
            }
        }
    }
    eprintln!(
        "PASS dq_moe_gate_up: Q8_0 (paired loop and with nw)/Q4_K/BF16/F32, E 32..2048, F 7..768, k 1..8, tokens 1,3,8: h = silu(g) * u within |u|*1.1*tol_g + |silu g|*tol_u + 1e-6|h| (tol_g, tol_u as the products'), max err/tol {worst:.3}; tails untouched; {staged} launches with the input staged in shared memory bit for bit the same"
    );
}

/// `dq_moe_down_rows` (Q8_0; grid (E, n_tok), block 128) or, with `generic`, `dq_moe_down`
/// (grid (ceil(E / 4), n_tok), block 128).
#[allow(clippy::too_many_arguments)]
fn launch_down(
    d: &CudaDevice,
    generic: bool,
    eptr: u64,
    ty: GgmlType,
    e: usize,
    f: usize,
    ids: u64,
    wts: u64,
    k: usize,
    h: u64,
    y: u64,
    n_tok: usize,
) {
    let (ei, fi, ki) = (int(e), int(f), int(k));
    let (name, grid, t) = if generic {
        (
            "dq_moe_down",
            ((e as u32).div_ceil(DQ_WARPS), n_tok as u32, 1),
            Some(kty(ty)),
        )
    } else {
        assert_eq!(ty, GgmlType::Q8_0);
        ("dq_moe_down_rows", (e as u32, n_tok as u32, 1), None)
    };
    let fun = d.function(name).unwrap();
    let mut b = d.stream().launch_builder(fun);
    b.arg(&eptr);
    if let Some(t) = &t {
        b.arg(t);
    }
    b.arg(&ei)
        .arg(&fi)
        .arg(&ids)
        .arg(&wts)
        .arg(&ki)
        .arg(&h)
        .arg(&y);
    // SAFETY: the arguments follow the kernel's parameter list (dq_moe_down has `int ty`
    // after eptr, dq_moe_down_rows does not; pointers as u64 device addresses, int as i32);
    // eptr holds 3 addresses per expert whose down entries are E x F matrices of ty in the
    // device layout (Q8_0 for the rows kernel, k <= 32), ids and wts n_tok * k entries, h
    // n_tok * k x F floats, y n_tok x E (plus a tail), all in a live test arena.
    unsafe { b.launch(cfg(grid, 128)) }.unwrap_or_else(|e| panic!("launch {name}: {e}"));
    finish(d, name);
}

#[test]
fn moe_down_rows_q8_0_and_generic_down_add_weighted_experts() {
    let Some(d) = dev("dq_moe_down") else { return };
    let mut rng = StdRng::seed_from_u64(0xdec0_0004);
    let a = d.alloc_arena("test", 128 << 20).unwrap();
    // (type, E (rows of down), F (its cols), experts, top-k). Q8_0 runs both kernels.
    let cases: &[(GgmlType, usize, usize, usize, &[usize])] = &[
        (GgmlType::Q8_0, 2048, 768, 8, &[1, 2, 8]),
        (GgmlType::Q8_0, 129, 96, 5, &[1, 3]),
        (GgmlType::Q8_0, 7, 32, 4, &[2, 4]),
        (GgmlType::Q8_0, 33, 64, 40, &[32]),
        (GgmlType::Q4K, 129, 256, 4, &[1, 3]),
        (GgmlType::Q4K, 7, 768, 3, &[2]),
        (GgmlType::BF16, 129, 96, 5, &[2]),
        (GgmlType::BF16, 7, 100, 3, &[3]),
        (GgmlType::F32, 33, 36, 3, &[2]),
        (GgmlType::F32, 5, 33, 3, &[1]),
    ];
    let mut worst = [0f64; 2];
    for &(ty, e, f, n_expert, ks) in cases {
        let ex = experts(&mut rng, ty, n_expert, e, f, false);
        let c = Carve::new(&a);
        let eptr = upload_experts(d, &c, &ex, n_expert);
        for &k in ks {
            for &n in &[1usize, 3, 8] {
                let c2 = after(&a, &c);
                let h = rand_vec(&mut rng, n * k * f, 1.0);
                let ids = route(&mut rng, n, n_expert, k);
                let wts: Vec<f32> = (0..n * k).map(|_| rng.random::<f32>()).collect();
                let y0 = rand_vec(&mut rng, n * e, 1.0);
                let hv = put(d, &c2, &poisoned(&h, k * f + GUARD));
                let idv = put(d, &c2, &ids);
                let wv = put(d, &c2, &poisoned(&wts, GUARD));
                // y[t][r] = y0 + sum_j wts[a] * (D_ids[a],r . h[a]), a = t*k + j.
                let mut want: Vec<f64> = y0.iter().map(|&v| v as f64).collect();
                let mut mag = vec![0f64; n * e];
                for (asg, &id) in ids.iter().enumerate() {
                    let t = asg / k;
                    let hin: Vec<f64> = h[asg * f..(asg + 1) * f]
                        .iter()
                        .map(|&v| v as f64)
                        .collect();
                    let (p, pm) = products(&ex.down[id as usize], &hin, 1);
                    let w = wts[asg] as f64;
                    for r in 0..e {
                        want[t * e + r] += w * p[r];
                        mag[t * e + r] += w * pm[r];
                    }
                }
                let kernels: &[bool] = if ty == GgmlType::Q8_0 {
                    &[false, true]
                } else {
                    &[true]
                };
                for &generic in kernels {
                    let name = if generic {
                        "dq_moe_down"
                    } else {
                        "dq_moe_down_rows"
                    };
                    let y_tail = e + GUARD;
                    let yv = put(d, &c2, &poisoned(&y0, y_tail));
                    launch_down(
                        d,
                        generic,
                        eptr.ptr(),
                        ty,
                        e,
                        f,
                        idv.ptr(),
                        wv.ptr(),
                        k,
                        hv.ptr(),
                        yv.ptr(),
                        n,
                    );
                    let what = format!("{name} {ty} E={e} F={f} k={k} n_tok={n}");
                    let got = get::<f32>(d, yv, n * e + y_tail);
                    assert_untouched(&what, &got, n * e);
                    let err = check_dots(&what, &got[..n * e], &want, &mag, REL);
                    worst[generic as usize] = worst[generic as usize].max(err);
                }
            }
        }
    }
    eprintln!(
        "PASS dq_moe_down_rows (Q8_0, k 1..32) max err/sum|w wx| {:.3e}, dq_moe_down (Q8_0/Q4_K/BF16/F32) {:.3e} (tol {REL:.0e}): y += sum_j wts * D.h into y0; tails untouched",
        worst[0], worst[1]
    );
}

/// Buffers of one `dq_router_rows` launch.
struct RouterBufs<'a> {
    y: DeviceView<'a>,
    xn: DeviceView<'a>,
    idx: DeviceView<'a>,
    w: DeviceView<'a>,
}

impl<'a> RouterBufs<'a> {
    /// Fresh poisoned outputs for n tokens of `rows` logits, `cols` wide, top `k`.
    fn new(d: &CudaDevice, c: &Carve<'a>, n: usize, rows: usize, cols: usize, k: usize) -> Self {
        Self {
            y: put(d, c, &vec![poison(); n * rows + GUARD]),
            xn: put(d, c, &vec![poison(); n * cols + GUARD]),
            idx: put(d, c, &vec![POISON_I32; n * k + GUARD]),
            w: put(d, c, &vec![poison(); n * k + GUARD]),
        }
    }
}

/// `dq_router_rows`: grid (rows, n_tok), block 128; `cnt` 0 or n_tok zeroed counters.
#[allow(clippy::too_many_arguments)]
fn launch_router(
    d: &CudaDevice,
    w: u64,
    rows: usize,
    cols: usize,
    x: u64,
    nw: u64,
    b_: &RouterBufs,
    cnt: u64,
    k: usize,
    norm: bool,
    n_tok: usize,
) {
    let name = "dq_router_rows";
    let (ri, ci, ki, ni) = (int(rows), int(cols), int(k), norm as i32);
    let (y, xn, idx, wo) = (b_.y.ptr(), b_.xn.ptr(), b_.idx.ptr(), b_.w.ptr());
    let fun = d.function(name).unwrap();
    let mut b = d.stream().launch_builder(fun);
    b.arg(&w)
        .arg(&ri)
        .arg(&ci)
        .arg(&x)
        .arg(&nw)
        .arg(&EPS)
        .arg(&y)
        .arg(&xn)
        .arg(&cnt)
        .arg(&ki)
        .arg(&ni)
        .arg(&idx)
        .arg(&wo);
    // SAFETY: the arguments follow dq_router_rows's parameter list (pointers as u64 device
    // addresses, int as i32, float as f32); W holds rows x cols f32, x n_tok x cols, nw
    // cols, y n_tok x rows, xn_out n_tok x cols, idx_out / w_out n_tok x k, cnt (when
    // non-zero) n_tok zeroed ints; cols % 4 == 0, rows <= 256, k <= 32 <= rows; all in a live
    // test arena at 256-byte aligned offsets.
    unsafe { b.launch(cfg((rows as u32, n_tok as u32, 1), 128)) }
        .unwrap_or_else(|e| panic!("launch {name}: {e}"));
    finish(d, name);
}

/// Checks one token's top-k against its logits `l` — the kernel's own, so both rank the same
/// numbers: the ids exactly (largest probability first, equal logits to the lower index),
/// except that a pick may differ from the reference's where the two logits differ by less
/// than the kernel's f32 softmax resolves (0 < gap <= 2e-6 * max(1, |logit|)); the weights
/// (softmax over all logits, renormalised over the chosen when `norm`) to 1e-6 absolute.
/// Returns how many such near-ties were met.
fn check_topk(what: &str, l: &[f32], k: usize, norm: bool, ids: &[i32], w: &[f32]) -> usize {
    let lm = l.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
    let ex: Vec<f64> = l.iter().map(|&v| (v as f64 - lm).exp()).collect();
    let s: f64 = ex.iter().sum();
    let p: Vec<f64> = ex.iter().map(|v| v / s).collect();
    let mut taken = vec![false; l.len()];
    let mut near = 0;
    for (j, &g) in ids.iter().enumerate() {
        // The lowest index of the largest remaining logit.
        let best = (0..l.len())
            .filter(|&i| !taken[i])
            .reduce(|b, i| if l[i] > l[b] { i } else { b })
            .unwrap();
        assert!(
            g >= 0 && (g as usize) < l.len() && !taken[g as usize],
            "{what}: pick {j}: expert {g} is out of range or already chosen (ids {ids:?})"
        );
        let g = g as usize;
        if g != best {
            let gap = l[best] as f64 - l[g] as f64;
            let delta = 2e-6 * (l[best].abs() as f64).max(1.0);
            assert!(
                gap > 0.0 && gap <= delta,
                "{what}: pick {j}: got expert {g} (logit {}), want {best} (logit {}); ids {ids:?}",
                l[g],
                l[best]
            );
            near += 1;
        }
        taken[g] = true;
    }
    let tot: f64 = ids.iter().map(|&i| p[i as usize]).sum();
    for (j, (&id, &got)) in ids.iter().zip(w).enumerate() {
        let want = if norm {
            p[id as usize] / tot
        } else {
            p[id as usize]
        };
        assert!(
            got.is_finite() && (got as f64 - want).abs() <= 1e-6,
            "{what}: weight {j} (expert {id}): got {got}, want {want}"
        );
    }
    assert_eq!(ids.len(), k);
    near
}

#[test]
fn router_rows_logits_xn_and_fused_topk_with_counters() {
    let Some(d) = dev("dq_router_rows") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(0xdec0_0005);
    let a = d.alloc_arena("test", 64 << 20).unwrap();
    let (mut worst, mut near, mut tokens) = (0f64, 0usize, 0usize);
    for &(rows, cols) in &[
        (8usize, 32usize),
        (60, 100),
        (128, 2048),
        (256, 2052),
        (33, 4),
    ] {
        // Router weights scaled so the logits are O(1), as a trained router's: wide logits
        // would underflow the softmax to exact zeros, all tied.
        let wt = rand_vec(&mut rng, rows * cols, 2.0 / (cols as f32).sqrt());
        let m = Mat {
            rows,
            cols,
            dev: Vec::new(),
            w: wt.iter().map(|&v| v as f64).collect(),
            wabs: wt.iter().map(|&v| (v as f64).abs()).collect(),
        };
        let c = Carve::new(&a);
        let wv = put(d, &c, &poisoned(&wt, GUARD));
        for &k in &[1usize, 2, 8, 32] {
            if k > rows {
                continue;
            }
            for &n in &[1usize, 5, 8, 33] {
                for norm in [false, true] {
                    let c2 = after(&a, &c);
                    let x = rand_vec(&mut rng, n * cols, 3.0);
                    let nw = rand_vec(&mut rng, cols, 1.5);
                    let xv = put(d, &c2, &poisoned(&x, cols + GUARD));
                    let nwv = put(d, &c2, &poisoned(&nw, GUARD));
                    let what = format!(
                        "dq_router_rows rows={rows} cols={cols} k={k} n_tok={n} norm={norm}"
                    );
                    // 1. No counters: logits and xn only; idx/w untouched.
                    let b0 = RouterBufs::new(d, &c2, n, rows, cols, k);
                    launch_router(
                        d,
                        wv.ptr(),
                        rows,
                        cols,
                        xv.ptr(),
                        nwv.ptr(),
                        &b0,
                        0,
                        k,
                        norm,
                        n,
                    );
                    let xin = kernel_input(&x, cols, Some(&nw), EPS);
                    let (dot, mag) = products(&m, &xin, n);
                    let y = get::<f32>(d, b0.y, n * rows + GUARD);
                    assert_untouched(&format!("{what} cnt=0: y"), &y, n * rows);
                    let e = check_dots(
                        &format!("{what} cnt=0: logits"),
                        &y[..n * rows],
                        &dot,
                        &mag,
                        REL_NORM,
                    );
                    worst = worst.max(e);
                    let xn = get::<f32>(d, b0.xn, n * cols + GUARD);
                    assert_untouched(&format!("{what}: xn"), &xn, n * cols);
                    check_close(
                        &format!("{what}: xn_out"),
                        &xn[..n * cols],
                        &xin,
                        1e-6,
                        XN_RTOL,
                    );
                    assert_untouched(
                        &format!("{what} cnt=0: w_out"),
                        &get::<f32>(d, b0.w, n * k + GUARD),
                        0,
                    );
                    let idx0 = get::<i32>(d, b0.idx, n * k + GUARD);
                    assert!(
                        idx0.iter().all(|&v| v == POISON_I32),
                        "{what} cnt=0: idx_out written"
                    );
                    // 2. Zeroed counters, launched twice without re-zeroing (the last block
                    // of each token must reset its counter): the second on fresh x.
                    let mut cnt_init = vec![0i32; n];
                    cnt_init.resize(n + GUARD, POISON_I32);
                    let cv = put(d, &c2, &cnt_init);
                    let x2 = rand_vec(&mut rng, n * cols, 3.0);
                    let x2v = put(d, &c2, &poisoned(&x2, cols + GUARD));
                    for (round, xr) in [(0, xv), (1, x2v)] {
                        let b1 = RouterBufs::new(d, &c2, n, rows, cols, k);
                        launch_router(
                            d,
                            wv.ptr(),
                            rows,
                            cols,
                            xr.ptr(),
                            nwv.ptr(),
                            &b1,
                            cv.ptr(),
                            k,
                            norm,
                            n,
                        );
                        let what = format!("{what} cnt round {round}");
                        let cnt = get::<i32>(d, cv, n + GUARD);
                        assert_eq!(
                            cnt, cnt_init,
                            "{what}: counters not back to 0 (or tail written)"
                        );
                        let y1 = get::<f32>(d, b1.y, n * rows + GUARD);
                        assert_untouched(&format!("{what}: y"), &y1, n * rows);
                        let xn1 = get::<f32>(d, b1.xn, n * cols + GUARD);
                        assert_untouched(&format!("{what}: xn"), &xn1, n * cols);
                        if round == 0 {
                            // The same blocks on the same inputs: bit-identical to step 1.
                            let bits =
                                |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                            assert_eq!(
                                bits(&y1[..n * rows]),
                                bits(&y[..n * rows]),
                                "{what}: logits differ from the cnt=0 launch"
                            );
                            assert_eq!(
                                bits(&xn1[..n * cols]),
                                bits(&xn[..n * cols]),
                                "{what}: xn differs from the cnt=0 launch"
                            );
                        } else {
                            let xin2 = kernel_input(&x2, cols, Some(&nw), EPS);
                            let (dot2, mag2) = products(&m, &xin2, n);
                            let e = check_dots(
                                &format!("{what}: logits"),
                                &y1[..n * rows],
                                &dot2,
                                &mag2,
                                REL_NORM,
                            );
                            worst = worst.max(e);
                            check_close(
                                &format!("{what}: xn_out"),
                                &xn1[..n * cols],
                                &xin2,
                                1e-6,
                                XN_RTOL,
                            );
                        }
                        let ids = get::<i32>(d, b1.idx, n * k + GUARD);
                        assert!(
                            ids[n * k..].iter().all(|&v| v == POISON_I32),
                            "{what}: idx_out written past n_tok * k"
                        );
                        let ws = get::<f32>(d, b1.w, n * k + GUARD);
                        assert_untouched(&format!("{what}: w_out"), &ws, n * k);
                        for t in 0..n {
                            near += check_topk(
                                &format!("{what} token {t}"),
                                &y1[t * rows..(t + 1) * rows],
                                k,
                                norm,
                                &ids[t * k..(t + 1) * k],
                                &ws[t * k..(t + 1) * k],
                            );
                            tokens += 1;
                        }
                    }
                }
            }
        }
    }
    // Exact ties: rows 3, 5 and 9 identical and dominant give bit-identical logits; the
    // kernel must take them lowest index first, with equal weights.
    let (rows, cols, k) = (16usize, 64usize, 4usize);
    let c = Carve::new(&a);
    let x = rand_vec(&mut rng, cols, 3.0);
    let nw = rand_vec(&mut rng, cols, 1.5);
    let mut wt = rand_vec(&mut rng, rows * cols, 0.25);
    let strong: Vec<f32> = x
        .iter()
        .zip(&nw)
        .map(|(a, b)| 0.2 * (a * b).signum())
        .collect();
    for r in [9, 3, 5] {
        wt[r * cols..(r + 1) * cols].copy_from_slice(&strong);
    }
    let (wv, xv, nwv) = (put(d, &c, &wt), put(d, &c, &x), put(d, &c, &nw));
    let cv = put(d, &c, &[0i32]);
    for norm in [false, true] {
        let b1 = RouterBufs::new(d, &c, 1, rows, cols, k);
        launch_router(
            d,
            wv.ptr(),
            rows,
            cols,
            xv.ptr(),
            nwv.ptr(),
            &b1,
            cv.ptr(),
            k,
            norm,
            1,
        );
        let y = get::<f32>(d, b1.y, rows);
        let ids = get::<i32>(d, b1.idx, k);
        let ws = get::<f32>(d, b1.w, k);
        assert!(
            y[3] == y[5] && y[5] == y[9],
            "tied rows gave different logits: {y:?}"
        );
        assert_eq!(
            &ids[..3],
            &[3, 5, 9],
            "ties must go to the lower index (logits {y:?})"
        );
        assert!(
            ws[0] == ws[1] && ws[1] == ws[2],
            "tied weights differ: {ws:?}"
        );
        check_topk("dq_router_rows ties", &y, k, norm, &ids, &ws);
        assert_eq!(
            get::<i32>(d, cv, 1),
            [0],
            "tie launch: counter not back to 0"
        );
    }
    eprintln!(
        "PASS dq_router_rows: rows 8/60/128/256/33, cols 32/100/2048/2052/4, k 1..32, tokens 1..33, norm on/off: logits max err/sum|wx| {worst:.3e} (tol {REL_NORM:.0e}), xn_out rtol {XN_RTOL:.0e}; with counters: logits and xn bit-identical, top-k ids exact over {tokens} tokens ({near} near-ties within 2e-6 of a logit), weights within 1e-6, counters back to 0 after each launch; exact ties to the lower index"
    );
}

/// The quiet-NaN f16 that fills each step's own KV cell before a `dq_attn_fused` launch: the
/// kernel must overwrite its heads, and reading it back unwritten shows in the output.
const KV_POISON: u16 = 0x7e00;
/// Bytes of the KV test region before `kv` and after the last slot (must stay untouched).
const KV_LEAD: usize = 128;
const KV_TAIL: usize = 256;
/// Slots of the KV test region; the tokens use some of them.
const KV_SLOTS: usize = 3;

/// The f16 bits of `x` rounded to nearest even (the kernel's `cvt.rn.f16.f32`).
fn f16_bits(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// A KV region's geometry in bytes, as `dq_attn_fused` takes it: slot `s`'s K row of cell `c`
/// at `kv + s * slot_bytes + k_off + c * row_bytes` (V at `v_off`), `kv` at `KV_LEAD`.
struct KvLay {
    cells: usize,
    row_bytes: usize,
    slot_bytes: usize,
    k_off: usize,
    v_off: usize,
}

impl KvLay {
    /// `cells` rows of K then of V per slot, rows of `width` f16 plus `row_pad` bytes, and 64
    /// bytes of padding after each slot: all 16-byte aligned.
    fn new(cells: usize, width: usize, row_pad: usize) -> Self {
        let row_bytes = (width * 2).div_ceil(16) * 16 + row_pad;
        assert_eq!(row_bytes % 16, 0);
        Self {
            cells,
            row_bytes,
            slot_bytes: 2 * cells * row_bytes + 64,
            k_off: 0,
            v_off: cells * row_bytes,
        }
    }
    /// The region's length in bytes, lead and tail included.
    fn len(&self) -> usize {
        KV_LEAD + KV_SLOTS * self.slot_bytes + KV_TAIL
    }
    /// Byte offset in the region of cell `c`'s K (`v` false) or V row of slot `s`.
    fn row(&self, s: usize, v: bool, c: usize) -> usize {
        let off = if v { self.v_off } else { self.k_off };
        KV_LEAD + s * self.slot_bytes + off + c * self.row_bytes
    }
    /// Where byte `at` of the region lies, for failure messages.
    fn describe(&self, at: usize) -> String {
        if at < KV_LEAD || at >= KV_LEAD + KV_SLOTS * self.slot_bytes {
            return format!("byte {at} (lead / tail padding)");
        }
        let (s, o) = (
            (at - KV_LEAD) / self.slot_bytes,
            (at - KV_LEAD) % self.slot_bytes,
        );
        if o >= 2 * self.cells * self.row_bytes {
            return format!("byte {at} (slot {s}'s padding)");
        }
        let (kv, o) = if o >= self.v_off {
            ("V", o - self.v_off)
        } else {
            ("K", o)
        };
        format!(
            "byte {at}: slot {s} {kv} cell {} byte {} of the row",
            o / self.row_bytes,
            o % self.row_bytes
        )
    }
}

/// Asserts that the KV region read back equals `want` (as f16 words), naming the first
/// differing word's place.
fn assert_region(what: &str, lay: &KvLay, got: &[u16], want: &[u16]) {
    assert_eq!(got.len(), want.len(), "{what}: KV region length");
    if let Some(i) = got.iter().zip(want).position(|(g, w)| g != w) {
        panic!(
            "{what}: KV region {}: got {:#06x}, want {:#06x}",
            lay.describe(2 * i),
            got[i],
            want[i]
        );
    }
}

/// One head's `df_warp_norm_rope` in f64: RMSNorm (x * r * w, r = 1 / sqrt(mean(x^2) + eps)),
/// NEOX RoPE of the pairs (i, i + n_rot / 2) at position p with cos / sin times
/// `attn_factor` (dims from n_rot on unrotated), all times `mul`. The angle is the f32
/// product inv_freq[i] * p, as the kernel (and dq_rope_store) computes it: the reference
/// rotates by the same angle, so at position 4095 it is not off by the product's rounding
/// (up to 1.2e-4 rad below 4096, far over the output tolerance).
#[allow(clippy::too_many_arguments)]
fn norm_rope_ref(
    x: &[f32],
    w: &[f32],
    eps: f32,
    p: i32,
    inv_freq: &[f32],
    attn_factor: f32,
    n_rot: usize,
    mul: f64,
) -> Vec<f64> {
    let hd = x.len();
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    let r = 1.0 / (ss / hd as f64 + eps as f64).sqrt();
    let mut y: Vec<f64> = x
        .iter()
        .zip(w)
        .map(|(&v, &w)| w as f64 * (v as f64 * r))
        .collect();
    let half = n_rot / 2;
    for i in 0..half {
        let ang = (inv_freq[i] * p as f32) as f64;
        let (s, c) = ang.sin_cos();
        let (s, c) = (s * attn_factor as f64, c * attn_factor as f64);
        let (a, b) = (y[i], y[i + half]);
        y[i] = a * c - b * s;
        y[i + half] = b * c + a * s;
    }
    y.iter().map(|v| v * mul).collect()
}

/// Device addresses and sizes of one `dq_attn_fused` launch.
struct FusedArgs {
    q: u64,
    k: u64,
    v: u64,
    q_norm: u64,
    k_norm: u64,
    pos: u64,
    inv_freq: u64,
    attn_factor: f32,
    n_head: usize,
    n_head_kv: usize,
    hd: usize,
    n_rot: usize,
    kv: u64,
    slot: u64,
    scale: f32,
    min_chunk: usize,
    part_o: u64,
    part_ms: u64,
    cnt: u64,
    out: u64,
    n_tok: usize,
    n_split: usize,
}

/// `dq_attn_fused`: grid (n_head_kv, n_split, n_tok), block 128.
fn launch_attn_fused(d: &CudaDevice, a: &FusedArgs, lay: &KvLay) {
    let name = "dq_attn_fused";
    let (nh, nkv, hd, nr, mc) = (
        int(a.n_head),
        int(a.n_head_kv),
        int(a.hd),
        int(a.n_rot),
        int(a.min_chunk),
    );
    let [sb, ko, vo, rb] = [lay.slot_bytes, lay.k_off, lay.v_off, lay.row_bytes].map(|v| v as i64);
    let fun = d.function(name).unwrap();
    let mut b = d.stream().launch_builder(fun);
    b.arg(&a.q)
        .arg(&a.k)
        .arg(&a.v)
        .arg(&a.q_norm)
        .arg(&a.k_norm)
        .arg(&EPS)
        .arg(&a.pos)
        .arg(&a.inv_freq)
        .arg(&a.attn_factor)
        .arg(&nh)
        .arg(&nkv)
        .arg(&hd)
        .arg(&nr)
        .arg(&a.kv)
        .arg(&a.slot)
        .arg(&sb)
        .arg(&ko)
        .arg(&vo)
        .arg(&rb)
        .arg(&a.scale)
        .arg(&mc)
        .arg(&a.part_o)
        .arg(&a.part_ms)
        .arg(&a.cnt)
        .arg(&a.out);
    let grid = (a.n_head_kv as u32, a.n_split as u32, a.n_tok as u32);
    // SAFETY: the arguments follow dq_attn_fused's parameter list (pointers as u64 device
    // addresses, int as i32, long as i64, float as f32); q holds n_tok x n_head x hd floats,
    // k and v n_tok x n_head_kv x hd, q_norm / k_norm hd, inv_freq n_rot / 2, pos and slot
    // n_tok ints (slots < KV_SLOTS, pos + 1 <= lay.cells), kv the KV region of `lay` (F16,
    // every offset and row 16-byte aligned), part_o / part_ms n_tok x n_head x n_split x hd
    // / x 2 floats, cnt n_tok x n_head_kv zeroed u32, out n_tok x n_head x hd, each plus a
    // tail; hd % 8 == 0, hd <= 128, 128 % G == 0, G <= 16, n_split <= 64; all in a live test
    // arena.
    unsafe { b.launch(cfg(grid, 128)) }.unwrap_or_else(|e| panic!("launch {name}: {e}"));
    finish(d, name);
}

/// `dq_attn_fused` against an f64 reference over 5 head shapes (G = 8, 16 with partial
/// rotation, 4, 1, 2 with hd 40; one with attn_factor 0.9 and KV rows padded past their
/// heads), contexts of 1 to 4096 cells, 1 and 3 tokens (each on its own slot at its own
/// position), n_split 64 and min_chunk 1/32 (plus 64/96 for 3 tokens), so both the direct
/// single-split output and the counted last-block merge run. Checks: the output within
/// 2e-5 + 1e-4 |want| of softmax(q.K) V over cells [0, pos] (q normalised, rotated and
/// scaled; K of the step's own cell as stored); the own cell's K within an f16 ulp of
/// f16(rope(norm(k))) and its V exactly f16(v), which overwrite the NaNs it held; every
/// other byte of the KV region (earlier cells, other slots, row and slot padding) and q, k, v
/// unchanged; the counters back to 0, so a second launch without re-zeroing gives the same
/// output bit for bit and stores the same bytes; every buffer's tail untouched.
#[test]
fn attn_fused_norm_rope_store_and_split_merge() {
    let Some(d) = dev("dq_attn_fused") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(0xdec0_0006);
    let a = d.alloc_arena("test", 64 << 20).unwrap();
    let n_split = 64usize;
    // (n_head, n_head_kv, hd, n_rot, attn_factor, row_pad).
    let shapes: &[(usize, usize, usize, usize, f32, usize)] = &[
        (32, 4, 128, 128, 1.0, 0),
        (16, 1, 128, 64, 1.0, 0),
        (8, 2, 64, 64, 0.9, 0),
        (4, 4, 96, 96, 1.0, 16),
        (6, 3, 40, 40, 1.0, 0),
    ];
    let (mut worst, mut launches) = (0f64, 0usize);
    for &(n_head, n_kv, hd, n_rot, af, row_pad) in shapes {
        let inv_freq: Vec<f32> = (0..n_rot / 2)
            .map(|i| 1e6f64.powf(-2.0 * i as f64 / n_rot as f64) as f32)
            .collect();
        let scale = 1.0f32 / (hd as f32).sqrt();
        for ctx in [1usize, 31, 32, 33, 100, 1000, 4096] {
            for n_tok in [1usize, 3] {
                let (ctxs, slots) = if n_tok == 1 {
                    (vec![ctx], vec![1usize])
                } else {
                    (
                        vec![ctx, ctx.div_ceil(2), (3 * ctx).div_ceil(4) + 1],
                        vec![2, 0, 1],
                    )
                };
                let pos: Vec<i32> = ctxs.iter().map(|&c| int(c - 1)).collect();
                let lay = KvLay::new(ctxs.iter().max().unwrap() + 3, n_kv * hd, row_pad);
                // Earlier steps' cells (and all padding): random f16 of magnitude 1/8..2,
                // either sign, so the scores spread about +-1 over a head; the tokens' own
                // cells hold NaNs the kernel must overwrite.
                let mut init = vec![0u16; lay.len() / 2];
                for ch in init.chunks_exact_mut(4) {
                    let r: u64 = rng.random();
                    for (j, h) in ch.iter_mut().enumerate() {
                        let r = (r >> (16 * j)) as u16;
                        *h = (r & 0x83ff) | ((12 + ((r >> 10) & 3)) << 10);
                    }
                }
                for t in 0..n_tok {
                    for v in [false, true] {
                        let at = lay.row(slots[t], v, pos[t] as usize) / 2;
                        init[at..at + lay.row_bytes / 2].fill(KV_POISON);
                    }
                }
                let q = rand_vec(&mut rng, n_tok * n_head * hd, 2.0);
                let k = rand_vec(&mut rng, n_tok * n_kv * hd, 2.0);
                let v = rand_vec(&mut rng, n_tok * n_kv * hd, 2.0);
                let around1 = |rng: &mut StdRng| -> Vec<f32> {
                    rand_vec(rng, hd, 0.5).iter().map(|w| 1.0 + w).collect()
                };
                let (qn, kn) = (around1(&mut rng), around1(&mut rng));
                // The references of the normalised, rotated (and for q scaled) heads.
                let head = |x: &[f32], i: usize, t: usize, w: &[f32], mul: f64| {
                    let src = &x[i * hd..(i + 1) * hd];
                    norm_rope_ref(src, w, EPS, pos[t], &inv_freq, af, n_rot, mul)
                };
                let qref: Vec<f64> = (0..n_tok * n_head)
                    .flat_map(|i| head(&q, i, i / n_head, &qn, scale as f64))
                    .collect();
                let kref: Vec<f64> = (0..n_tok * n_kv)
                    .flat_map(|i| head(&k, i, i / n_kv, &kn, 1.0))
                    .collect();
                let mut pos_in = pos.clone();
                pos_in.resize(n_tok + GUARD, POISON_I32);
                let mut slot_in: Vec<i32> = slots.iter().map(|&s| int(s)).collect();
                slot_in.resize(n_tok + GUARD, POISON_I32);
                let (q_in, k_in, v_in) = (
                    poisoned(&q, n_head * hd + GUARD),
                    poisoned(&k, n_kv * hd + GUARD),
                    poisoned(&v, n_kv * hd + GUARD),
                );
                let c = Carve::new(&a);
                let (qv, kv_, vv) = (put(d, &c, &q_in), put(d, &c, &k_in), put(d, &c, &v_in));
                let (qnv, knv) = (
                    put(d, &c, &poisoned(&qn, GUARD)),
                    put(d, &c, &poisoned(&kn, GUARD)),
                );
                let ifv = put(d, &c, &poisoned(&inv_freq, GUARD));
                let (posv, slotv) = (put(d, &c, &pos_in), put(d, &c, &slot_in));
                let n_out = n_tok * n_head * hd;
                let n_po = n_tok * n_head * n_split * hd;
                let n_pm = n_tok * n_head * n_split * 2;
                let mut cnt_init = vec![0i32; n_tok * n_kv];
                cnt_init.resize(n_tok * n_kv + GUARD, POISON_I32);
                // The region with the stored heads, from the first launch (once checked).
                let mut stored: Option<Vec<u16>> = None;
                let mut want = Vec::new();
                let mut chunks = vec![1usize, 32];
                if n_tok == 3 {
                    chunks.extend([64, 96]);
                }
                for min_chunk in chunks {
                    let what = format!(
                        "dq_attn_fused heads {n_head}/{n_kv} hd={hd} n_rot={n_rot} ctx={ctx} \
                         (tokens {ctxs:?}) n_tok={n_tok} min_chunk={min_chunk}"
                    );
                    let c2 = after(&a, &c);
                    let kvv = put(d, &c2, &init);
                    let pov = put(d, &c2, &vec![poison(); n_po + GUARD]);
                    let pmv = put(d, &c2, &vec![poison(); n_pm + GUARD]);
                    let cv = put(d, &c2, &cnt_init);
                    let outs: Vec<DeviceView> = (0..2)
                        .map(|_| put(d, &c2, &vec![poison(); n_out + n_head * hd + GUARD]))
                        .collect();
                    let mut got_out: Vec<Vec<f32>> = Vec::new();
                    for (round, ov) in outs.iter().enumerate() {
                        let what = format!("{what} launch {}", round + 1);
                        let args = FusedArgs {
                            q: qv.ptr(),
                            k: kv_.ptr(),
                            v: vv.ptr(),
                            q_norm: qnv.ptr(),
                            k_norm: knv.ptr(),
                            pos: posv.ptr(),
                            inv_freq: ifv.ptr(),
                            attn_factor: af,
                            n_head,
                            n_head_kv: n_kv,
                            hd,
                            n_rot,
                            kv: kvv.ptr() + KV_LEAD as u64,
                            slot: slotv.ptr(),
                            scale,
                            min_chunk,
                            part_o: pov.ptr(),
                            part_ms: pmv.ptr(),
                            cnt: cv.ptr(),
                            out: ov.ptr(),
                            n_tok,
                            n_split,
                        };
                        launch_attn_fused(d, &args, &lay);
                        launches += 1;
                        let region = get::<u16>(d, kvv, init.len());
                        if let Some(exp) = &stored {
                            // The store is the same arithmetic in whichever split holds the
                            // cell: the same bytes again, and nothing else written.
                            assert_region(&what, &lay, &region, exp);
                        } else {
                            let exp = check_stored(
                                &what, &lay, &region, &init, &kref, &v, &pos, &slots, n_kv, hd,
                            );
                            want = attn_ref(&lay, &exp, &qref, &pos, &slots, n_head, n_kv, hd);
                            stored = Some(exp);
                        }
                        let out = get::<f32>(d, *ov, n_out + n_head * hd + GUARD);
                        assert_untouched(&format!("{what}: out"), &out, n_out);
                        check_close(&format!("{what}: out"), &out[..n_out], &want, 2e-5, 1e-4);
                        for (&g, &w) in out[..n_out].iter().zip(&want) {
                            worst = worst.max((g as f64 - w).abs());
                        }
                        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        for (nm, dv, host) in
                            [("q", qv, &q_in), ("k", kv_, &k_in), ("v", vv, &v_in)]
                        {
                            assert_eq!(
                                bits(&get::<f32>(d, dv, host.len())),
                                bits(host),
                                "{what}: the kernel wrote its input {nm}"
                            );
                        }
                        assert_eq!(
                            get::<i32>(d, cv, cnt_init.len()),
                            cnt_init,
                            "{what}: counters not back to 0 (or their tail written)"
                        );
                        assert_untouched(
                            &format!("{what}: part_o"),
                            &get::<f32>(d, pov, n_po + GUARD),
                            n_po,
                        );
                        assert_untouched(
                            &format!("{what}: part_ms"),
                            &get::<f32>(d, pmv, n_pm + GUARD),
                            n_pm,
                        );
                        if let Some(first) = got_out.first() {
                            assert_eq!(
                                bits(&out[..n_out]),
                                bits(&first[..n_out]),
                                "{what}: output differs from the first launch's"
                            );
                        }
                        got_out.push(out);
                    }
                }
            }
        }
    }
    eprintln!(
        "PASS dq_attn_fused: shapes (n_head, n_head_kv, hd, n_rot) (32,4,128,128) \
         (16,1,128,64) (8,2,64,64, attn_factor 0.9) (4,4,96,96, padded rows) (6,3,40,40), ctx \
         1..4096, 1 and 3 tokens, n_split 64, min_chunk 1/32/64/96, {launches} launches: max \
         abs err {worst:.3e} (tol 2e-5 + 1e-4 |want|); own cell's K within an f16 ulp, V \
         exact, rest of the KV region, q/k/v, counters and tails untouched; second launches \
         bit-identical"
    );
}

/// The reference output [n_tok][n_head][hd]: for token t, head h (KV head h / G), softmax
/// over cells [0, pos[t]] of slot slots[t] of qref . K (K and V decoded from the region
/// `kvr`, which holds the step's own cells as stored), times V, in f64.
#[allow(clippy::too_many_arguments)]
fn attn_ref(
    lay: &KvLay,
    kvr: &[u16],
    qref: &[f64],
    pos: &[i32],
    slots: &[usize],
    n_head: usize,
    n_kv: usize,
    hd: usize,
) -> Vec<f64> {
    let g = n_head / n_kv;
    let n_tok = pos.len();
    let blocks: Vec<Vec<f64>> = (0..n_tok * n_kv)
        .into_par_iter()
        .map(|tk| {
            let (t, h) = (tk / n_kv, tk % n_kv);
            let ctx = pos[t] as usize + 1;
            let rows = |v: bool| -> Vec<f64> {
                (0..ctx)
                    .flat_map(|c| {
                        let at = lay.row(slots[t], v, c) / 2 + h * hd;
                        kvr[at..at + hd]
                            .iter()
                            .map(|&b| half::f16::from_bits(b).to_f64())
                    })
                    .collect()
            };
            let (kf, vf) = (rows(false), rows(true));
            let mut o = vec![0f64; g * hd];
            for j in 0..g {
                let qh = &qref[(t * n_head + h * g + j) * hd..][..hd];
                let s: Vec<f64> = kf
                    .chunks_exact(hd)
                    .map(|kr| kr.iter().zip(qh).map(|(a, b)| a * b).sum())
                    .collect();
                let m = s.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let l: f64 = w.iter().sum();
                let oh = &mut o[j * hd..(j + 1) * hd];
                for (wc, vr) in w.iter().zip(vf.chunks_exact(hd)) {
                    for (acc, &vv) in oh.iter_mut().zip(vr) {
                        *acc += wc * vv;
                    }
                }
                oh.iter_mut().for_each(|x| *x /= l);
            }
            o
        })
        .collect();
    blocks.concat()
}

/// Checks the KV region read back after the first launch on a region whose own cells held
/// NaNs: each token's own cell holds K heads within an f16 ulp of f16(kref) (compared as f32,
/// 1e-3 |want| + 1e-6) and V heads exactly f16(v), round to nearest even; every other word
/// equals `init`. Returns the region as every launch on these inputs must leave it.
#[allow(clippy::too_many_arguments)]
fn check_stored(
    what: &str,
    lay: &KvLay,
    region: &[u16],
    init: &[u16],
    kref: &[f64],
    v: &[f32],
    pos: &[i32],
    slots: &[usize],
    n_kv: usize,
    hd: usize,
) -> Vec<u16> {
    let mut exp = init.to_vec();
    for (t, (&p, &s)) in pos.iter().zip(slots).enumerate() {
        for h in 0..n_kv {
            let ka = lay.row(s, false, p as usize) / 2 + h * hd;
            let va = lay.row(s, true, p as usize) / 2 + h * hd;
            for i in 0..hd {
                let x = (t * n_kv + h) * hd + i;
                let gk = half::f16::from_bits(region[ka + i]).to_f32();
                let wk = half::f16::from_f64(kref[x]).to_f32();
                assert!(
                    gk.is_finite() && (gk - wk).abs() <= 1e-3 * wk.abs() + 1e-6,
                    "{what}: token {t} stored K head {h} dim {i}: got {gk}, want {wk} (f16 of {})",
                    kref[x]
                );
                assert_eq!(
                    region[va + i],
                    f16_bits(v[x]),
                    "{what}: token {t} stored V head {h} dim {i} is not f16({})",
                    v[x]
                );
            }
            exp[ka..ka + hd].copy_from_slice(&region[ka..ka + hd]);
            exp[va..va + hd].copy_from_slice(&region[va..va + hd]);
        }
    }
    assert_region(what, lay, region, &exp);
    exp
}

/// `dq_argmax_rows` (grid (blocks, rows), block 256) against the host's
/// `strata_exec::sampler::argmax`, row by row: rows of 1 to 151936 logits over 1, 3 and 64
/// blocks, with the maximum planted twice (the lower index wins), NaNs (never win), -inf and
/// +inf entries, a row of only NaN and -inf (0, as on the host); the counters are back to 0
/// after every launch, so launching again without clearing them gives the same tokens.
#[test]
fn argmax_rows_ties_nan_and_infinities_like_the_host() {
    let Some(d) = dev("dq_argmax_rows") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(0xdec0_0005);
    let a = d.alloc_arena("test", 64 << 20).unwrap();
    let name = "dq_argmax_rows";
    let mut launches = 0;
    for &cols in &[1usize, 7, 255, 256, 257, 4099, 151_936] {
        for &nb in &[1u32, 3, 64] {
            let rows = 5;
            let mut x = rand_vec(&mut rng, rows * cols, 4.0);
            // Row 1: its maximum at two random places (the lower index must win).
            if cols > 1 {
                let (i, j) = (rng.random_range(0..cols), rng.random_range(0..cols));
                let m = x[cols..2 * cols].iter().cloned().fold(f32::MIN, f32::max) + 1.0;
                x[cols + i] = m;
                x[cols + j] = m;
            }
            // Row 2: NaNs and -inf sprinkled, a +inf late.
            for c in (0..cols).step_by(3) {
                x[2 * cols + c] = if c % 2 == 0 {
                    f32::NAN
                } else {
                    f32::NEG_INFINITY
                };
            }
            x[2 * cols + cols - 1] = f32::INFINITY;
            // Row 3: nothing but NaN and -inf.
            for c in 0..cols {
                x[3 * cols + c] = if c % 2 == 0 {
                    f32::NAN
                } else {
                    f32::NEG_INFINITY
                };
            }
            // Row 4: all equal.
            for c in 0..cols {
                x[4 * cols + c] = 0.5;
            }
            let want: Vec<i32> = x
                .chunks_exact(cols)
                .map(|r| strata_exec::sampler::argmax(r) as i32)
                .collect();
            let c = Carve::new(&a);
            let xv = put(d, &c, &x);
            let pv = put(d, &c, &vec![poison(); rows * nb as usize]);
            let pi = put(d, &c, &vec![POISON_I32; rows * nb as usize]);
            let cnt = put(d, &c, &vec![0u32; rows + 1]);
            let out = put(d, &c, &vec![POISON_I32; rows + 1]);
            for round in 0..2 {
                let f = d.function(name).unwrap();
                let mut b = d.stream().launch_builder(f);
                let ci = int(cols);
                let (xp, pvp, pip, cp, op) = (xv.ptr(), pv.ptr(), pi.ptr(), cnt.ptr(), out.ptr());
                b.arg(&xp).arg(&ci).arg(&pvp).arg(&pip).arg(&cp).arg(&op);
                // SAFETY: the arguments follow dq_argmax_rows's parameter list (pointers as
                // u64 device addresses, int as i32); x holds rows x cols floats, part_v and
                // part_i rows x nb entries, cnt and out rows (+1 guard) entries, all in a live
                // test arena.
                unsafe { b.launch(cfg((nb, rows as u32, 1), 256)) }
                    .unwrap_or_else(|e| panic!("launch {name}: {e}"));
                finish(d, name);
                launches += 1;
                let got = get::<i32>(d, out, rows + 1);
                assert_eq!(
                    &got[..rows],
                    &want[..],
                    "{name} cols={cols} blocks={nb} round {round}: device vs host argmax"
                );
                assert_eq!(got[rows], POISON_I32, "{name}: out's guard");
                let counters = get::<u32>(d, cnt, rows + 1);
                assert!(
                    counters.iter().all(|&v| v == 0),
                    "{name} cols={cols} blocks={nb}: counters not reset: {counters:?}"
                );
            }
        }
    }
    eprintln!(
        "PASS dq_argmax_rows: cols 1..151936, 1/3/64 blocks a row, ties (lowest index), NaN, \
         -inf, +inf, all-NaN/-inf rows (0) and equal rows, {launches} launches: the host's \
         argmax exactly; counters reset"
    );
}
