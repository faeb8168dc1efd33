//! GPU kernel tests in the style of ggml's test-backend-ops: every CUDA op runs on fresh
//! random inputs (odd sizes, ragged tails, one and many tokens) and is compared with the CPU
//! reference (`backend::cpu`, `quant`) under the tolerance stated at each check.
//! Invariant: without a usable CUDA device each test prints `SKIP (no CUDA device): ...` to
//! stderr and returns; it never passes silently. Run on a GPU machine with
//! `cargo test -p strata-exec --release --test cuda_ops -- --test-threads=1 --nocapture`.
#![cfg(feature = "cuda")]

mod cuda_common;
use cuda_common::{get, put, rand_vec, Carve};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::sync::OnceLock;
use strata_exec::backend::cpu::{self, AttnShape, KvLayer, Matrix, Rope, Yarn};
use strata_exec::backend::cuda::compile;
use strata_exec::backend::cuda::ops::{AttnDecode, SlotKv};
use strata_exec::backend::cuda::{arena_allocations, CudaDevice, CudaError, DeviceArena};
use strata_exec::quant;
use strata_schemas::ggml::GgmlType;

static DEV: OnceLock<Result<CudaDevice, String>> = OnceLock::new();

fn init() -> Result<CudaDevice, String> {
    // A fresh cache folder per run: the first open compiles, the second must hit the cache.
    let dir = std::env::temp_dir().join(format!("strata-kcache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::env::set_var("STRATA_KERNEL_CACHE", &dir);
    let t = std::time::Instant::now();
    let first = CudaDevice::open(0).map_err(|e| e.to_string())?;
    let compiled_s = t.elapsed().as_secs_f64();
    assert_eq!(first.modules_from_cache, 0, "an empty cache served modules");
    drop(first);
    let t = std::time::Instant::now();
    let d = CudaDevice::open(0).map_err(|e| e.to_string())?;
    assert_eq!(
        d.modules_from_cache,
        strata_kernels::all().len(),
        "second open did not read every module from {dir:?}"
    );
    eprintln!(
        "device: {} ({}), NVRTC {:?}, {} kernel modules compiled in {compiled_s:.2}s, reopened from cache in {:.3}s",
        d.name(),
        d.arch(),
        d.nvrtc_version(),
        strata_kernels::all().len(),
        t.elapsed().as_secs_f64()
    );
    Ok(d)
}

fn dev(test: &str) -> Option<&'static CudaDevice> {
    cuda_common::device_or_skip(&DEV, test, init)
}

/// Asserts |got - want| <= atol + rtol * |want| elementwise (with a per-element scale when
/// given) and prints the largest error. Returns the max absolute error.
fn check(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut max = 0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let e = (g - w).abs();
        assert!(
            e <= atol + rtol * w.abs() && g.is_finite(),
            "{what}: element {i}: got {g}, want {w} (err {e}, atol {atol}, rtol {rtol})"
        );
        max = max.max(e);
    }
    eprintln!("PASS {what}: max abs err {max:.3e} (atol {atol:.0e}, rtol {rtol:.0e})");
    max
}

fn big_arena(d: &CudaDevice, mib: u64) -> DeviceArena {
    d.alloc_arena("test", mib << 20).unwrap()
}

#[test]
fn arena_is_one_allocation_and_views_are_bounds_checked() {
    let Some(d) = dev("arena") else { return };
    let before = arena_allocations();
    let a = d.alloc_arena("kv", 1000).unwrap();
    assert_eq!(arena_allocations(), before + 1);
    assert_eq!(a.size(), 1000);
    assert!(a.view(0, 1000).is_ok());
    assert!(matches!(
        a.view(1, 1000),
        Err(CudaError::OutOfBounds { .. })
    ));
    assert!(a.view(u64::MAX, 2).is_err());
    let v = a.view(100, 200).unwrap();
    assert!(v.sub(150, 51).is_err() && v.sub(150, 50).is_ok());
    // Round trip through the device.
    let x: Vec<u8> = (0..200u32).map(|i| (i * 7) as u8).collect();
    d.htod(&x, v).unwrap();
    let mut y = vec![0u8; 200];
    d.dtoh(v, &mut y).unwrap();
    assert_eq!(x, y);
    assert!(
        d.htod(&x[..10], v).is_err(),
        "length mismatch must be refused"
    );
    assert!(d.alloc_arena("zero", 0).is_err());
    let e0 = d.record_event().unwrap();
    d.memset(v, 0).unwrap();
    let e1 = d.record_event().unwrap();
    e1.synchronize().unwrap();
    assert!(e0.elapsed_ms(&e1).unwrap() >= 0.0);
    d.dtoh(v, &mut y).unwrap();
    assert!(y.iter().all(|b| *b == 0));
    eprintln!("PASS arena: one allocation, bounds-checked views, copies, memset, events");
}

#[test]
fn nvrtc_error_names_the_module_and_prints_the_log() {
    let Some(d) = dev("nvrtc_error") else { return };
    let source = format!(
        "{}\nST_KERNEL void broken(float* x) {{ x[0] = undefined_name; }}\n",
        strata_kernels::COMMON
    );
    let src = strata_kernels::KernelSource {
        name: "broken_module",
        hash: strata_kernels::source_hash(&source),
        source,
        entry_points: &["broken"],
        cuda_only: false,
    };
    let cc = match d.arch().trim_start_matches("sm_").parse::<i32>() {
        Ok(n) => (n / 10, n % 10),
        Err(_) => (9, 0),
    };
    let e = compile::compile(&src, cc, d.nvrtc_version())
        .unwrap_err()
        .to_string();
    assert!(e.contains("broken_module") && e.contains("broken"), "{e}");
    assert!(e.contains("undefined_name"), "log missing from: {e}");
    eprintln!(
        "PASS nvrtc_error: {}",
        e.lines().take(3).collect::<Vec<_>>().join(" | ")
    );
}

#[test]
fn rmsnorm_with_and_without_residual() {
    let Some(d) = dev("rmsnorm") else { return };
    let mut rng = StdRng::seed_from_u64(1);
    let a = big_arena(d, 64);
    let mut worst = 0f32;
    for &n in &[1usize, 7, 33, 128, 1000, 2048, 4097] {
        for &rows in &[1usize, 3, 8] {
            for fused in [false, true] {
                let c = Carve::new(&a);
                let x = rand_vec(&mut rng, n * rows, 3.0);
                let r = rand_vec(&mut rng, n * rows, 1.0);
                let w = rand_vec(&mut rng, n, 1.5);
                let (xv, rv, wv) = (put(d, &c, &x), put(d, &c, &r), put(d, &c, &w));
                let hv = c.take(4 * (n * rows) as u64);
                let ov = c.take(4 * (n * rows) as u64);
                let h: Vec<f32> = if fused {
                    x.iter().zip(&r).map(|(a, b)| a + b).collect()
                } else {
                    x.clone()
                };
                d.rmsnorm(
                    xv,
                    fused.then_some(rv),
                    fused.then_some(hv),
                    wv,
                    ov,
                    n,
                    rows,
                    1e-6,
                )
                .unwrap();
                let mut want = vec![0f32; n * rows];
                cpu::rmsnorm_rows(&h, &w, 1e-6, rows, &mut want).unwrap();
                let got = get::<f32>(d, ov, n * rows);
                let err = check(
                    &format!("rmsnorm n={n} rows={rows} fused={fused}"),
                    &got,
                    &want,
                    1e-5,
                    2e-5,
                );
                worst = worst.max(err);
                if fused {
                    assert_eq!(get::<f32>(d, hv, n * rows), h, "residual sum must be exact");
                }
            }
        }
    }
    // In place, fused: x <- norm(x + r), r <- x + r.
    let c = Carve::new(&a);
    let (n, rows) = (2048, 2);
    let x = rand_vec(&mut rng, n * rows, 1.0);
    let r = rand_vec(&mut rng, n * rows, 1.0);
    let w = rand_vec(&mut rng, n, 1.0);
    let (xv, rv, wv) = (put(d, &c, &x), put(d, &c, &r), put(d, &c, &w));
    d.rmsnorm(xv, Some(rv), Some(rv), wv, xv, n, rows, 1e-6)
        .unwrap();
    let h: Vec<f32> = x.iter().zip(&r).map(|(a, b)| a + b).collect();
    let mut want = vec![0f32; n * rows];
    cpu::rmsnorm_rows(&h, &w, 1e-6, rows, &mut want).unwrap();
    check(
        "rmsnorm in place fused",
        &get::<f32>(d, xv, n * rows),
        &want,
        1e-5,
        2e-5,
    );
    assert_eq!(get::<f32>(d, rv, n * rows), h);
    // A short view is refused before launch.
    assert!(d
        .rmsnorm(xv, None, None, wv, xv.sub(0, 8).unwrap(), n, rows, 1e-6)
        .is_err());
    eprintln!("SUMMARY rmsnorm: max abs err {worst:.3e}");
}

#[test]
fn qk_norm_and_rope_neox_with_yarn() {
    let Some(d) = dev("qk_norm_rope") else { return };
    let mut rng = StdRng::seed_from_u64(2);
    let a = big_arena(d, 16);
    for &(head_dim, n_rot) in &[(128usize, 128usize), (64, 32), (80, 80), (256, 64)] {
        for yarn in [None, Some(Yarn::new(4.0, 4096))] {
            for norm in [true, false] {
                for &n_tok in &[1usize, 5] {
                    let n_head = 7;
                    let c = Carve::new(&a);
                    let x = rand_vec(&mut rng, n_tok * n_head * head_dim, 2.0);
                    let w = rand_vec(&mut rng, head_dim, 1.2);
                    let pos: Vec<i32> = (0..n_tok).map(|_| rng.random_range(0..40000)).collect();
                    let rope = Rope::new(n_rot, 1_000_000.0, yarn);
                    let (xv, wv, pv, fv) = (
                        put(d, &c, &x),
                        put(d, &c, &w),
                        put(d, &c, &pos),
                        put(d, &c, rope.inv_freq()),
                    );
                    d.qk_norm_rope(
                        xv,
                        norm.then_some(wv),
                        1e-6,
                        pv,
                        fv,
                        rope.attn_factor(),
                        n_tok,
                        n_head,
                        head_dim,
                        n_rot,
                    )
                    .unwrap();
                    let mut want = x.clone();
                    for t in 0..n_tok {
                        let tok = &mut want[t * n_head * head_dim..(t + 1) * n_head * head_dim];
                        if norm {
                            cpu::rmsnorm_heads_inplace(tok, &w, 1e-6).unwrap();
                        }
                        rope.apply(tok, head_dim, pos[t] as u32).unwrap();
                    }
                    let got = get::<f32>(d, xv, x.len());
                    check(
                        &format!("qk_norm_rope hd={head_dim} n_rot={n_rot} yarn={} norm={norm} n_tok={n_tok}", yarn.is_some()),
                        &got,
                        &want,
                        3e-5,
                        3e-5,
                    );
                }
            }
        }
    }
}

fn quantized(rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = Vec::new();
    let mut deq = vec![0f32; rows * cols];
    for r in 0..rows {
        // Row scales vary so Q4_K's mins and scales are exercised.
        let s = 0.2 + 2.0 * rng.random::<f32>();
        let off = 0.3 * (2.0 * rng.random::<f32>() - 1.0);
        let row: Vec<f32> = (0..cols)
            .map(|_| off + s * (2.0 * rng.random::<f32>() - 1.0))
            .collect();
        let at = bytes.len();
        quant::quantize_row(ty, &row, &mut bytes).unwrap();
        quant::dequantize_row(ty, &bytes[at..], &mut deq[r * cols..(r + 1) * cols]).unwrap();
    }
    (bytes, deq)
}

#[test]
fn matvec_q8_0_q4_k_bf16_f16_f32() {
    let Some(d) = dev("matvec") else { return };
    let mut rng = StdRng::seed_from_u64(3);
    let a = big_arena(d, 256);
    let cases: &[(GgmlType, &[usize], &[usize])] = &[
        (GgmlType::Q8_0, &[32, 96, 2080, 4096], &[1, 7, 129]),
        (GgmlType::Q4K, &[256, 768, 2304, 4096], &[1, 5, 67]),
        (GgmlType::BF16, &[1, 7, 33, 1000, 2048], &[1, 6, 65]),
        (GgmlType::F16, &[5, 64, 1031], &[3, 33]),
        (GgmlType::F32, &[3, 130], &[1, 9]),
    ];
    for &(ty, colss, rowss) in cases {
        let mut worst_rel = 0f32;
        for &cols in colss {
            for &rows in rowss {
                for &n_tok in &[1usize, 2, 5, 8, 11] {
                    let c = Carve::new(&a);
                    let (wb, deq) = quantized(&mut rng, ty, rows, cols);
                    let x = rand_vec(&mut rng, n_tok * cols, 1.0);
                    let (wv, xv) = (put(d, &c, &wb), put(d, &c, &x));
                    let yv = c.take(4 * (n_tok * rows) as u64);
                    d.matvec(wv, ty, rows, cols, xv, n_tok, yv).unwrap();
                    let got = get::<f32>(d, yv, n_tok * rows);
                    let m = Matrix::new(ty, cols, rows, &wb).unwrap();
                    let mut want = vec![0f32; n_tok * rows];
                    let mut tmp = vec![0f32; n_tok * rows];
                    cpu::matmul(&m, &x, n_tok, &mut want, &mut tmp).unwrap();
                    // Tolerance: f32 summation-order error, bounded by 2e-6 * sum |w||x|.
                    for t in 0..n_tok {
                        for r in 0..rows {
                            let mag: f32 = (0..cols)
                                .map(|k| (deq[r * cols + k] * x[t * cols + k]).abs())
                                .sum();
                            let (g, w) = (got[t * rows + r], want[t * rows + r]);
                            let e = (g - w).abs();
                            assert!(
                                e <= 2e-6 * mag + 1e-6,
                                "matvec {ty} rows={rows} cols={cols} n_tok={n_tok}: [{t}][{r}] got {g} want {w} (sum|wx| {mag})"
                            );
                            worst_rel = worst_rel.max(e / (mag + 1e-6));
                        }
                    }
                }
            }
        }
        eprintln!("PASS matvec {ty}: cols {colss:?} rows {rowss:?} tokens 1,2,5,8,11: max err / sum|w x| = {worst_rel:.3e} (tol 2e-6)");
    }
}

#[test]
fn embedding_lookup_dequantizes() {
    let Some(d) = dev("get_rows") else { return };
    let mut rng = StdRng::seed_from_u64(4);
    let a = big_arena(d, 64);
    for &(ty, cols) in &[
        (GgmlType::Q8_0, 2080usize),
        (GgmlType::Q4K, 2304),
        (GgmlType::BF16, 1001),
        (GgmlType::F16, 77),
        (GgmlType::F32, 5),
    ] {
        let rows = 301;
        let c = Carve::new(&a);
        let (wb, deq) = quantized(&mut rng, ty, rows, cols);
        let ids: Vec<i32> = (0..9)
            .map(|_| rng.random_range(0..rows as i32))
            .chain([0, rows as i32 - 1])
            .collect();
        let (wv, iv) = (put(d, &c, &wb), put(d, &c, &ids));
        let ov = c.take(4 * (ids.len() * cols) as u64);
        d.get_rows(wv, ty, rows, cols, &ids, iv, ov).unwrap();
        let want: Vec<f32> = ids
            .iter()
            .flat_map(|&i| deq[i as usize * cols..(i as usize + 1) * cols].to_vec())
            .collect();
        check(
            &format!("get_rows {ty} cols={cols}"),
            &get::<f32>(d, ov, want.len()),
            &want,
            1e-6,
            1e-6,
        );
        assert!(
            d.get_rows(wv, ty, rows, cols, &[rows as i32], iv, ov)
                .is_err(),
            "id past the table"
        );
    }
}

#[test]
fn swiglu_matches() {
    let Some(d) = dev("swiglu") else { return };
    let mut rng = StdRng::seed_from_u64(5);
    let a = big_arena(d, 8);
    for &n in &[1usize, 31, 768, 100_003] {
        let c = Carve::new(&a);
        let g = rand_vec(&mut rng, n, 8.0);
        let u = rand_vec(&mut rng, n, 2.0);
        let (gv, uv) = (put(d, &c, &g), put(d, &c, &u));
        let ov = c.take(4 * n as u64);
        d.swiglu(gv, uv, ov, n).unwrap();
        let want: Vec<f32> = g.iter().zip(&u).map(|(g, u)| cpu::silu(*g) * u).collect();
        check(
            &format!("swiglu n={n}"),
            &get::<f32>(d, ov, n),
            &want,
            1e-6,
            1e-5,
        );
    }
}

fn router_ref(logits: &[f32], k: usize, norm: bool) -> (Vec<i32>, Vec<f32>) {
    let mut p = logits.to_vec();
    cpu::softmax(&mut p);
    let mut idx: Vec<usize> = Vec::new();
    let mut w = Vec::new();
    for _ in 0..k {
        let mut best = usize::MAX;
        for c in 0..p.len() {
            if idx.contains(&c) {
                continue;
            }
            if best == usize::MAX || p[c] > p[best] {
                best = c;
            }
        }
        idx.push(best);
        w.push(p[best]);
    }
    if norm {
        let s: f32 = w.iter().sum();
        w.iter_mut().for_each(|v| *v /= s);
    }
    (idx.into_iter().map(|i| i as i32).collect(), w)
}

#[test]
fn router_softmax_topk() {
    let Some(d) = dev("router") else { return };
    let mut rng = StdRng::seed_from_u64(6);
    let a = big_arena(d, 8);
    for &ne in &[8usize, 60, 128, 512] {
        for &k in &[1usize, 2, 8] {
            for norm in [true, false] {
                for &n_tok in &[1usize, 5, 33] {
                    let c = Carve::new(&a);
                    let logits = rand_vec(&mut rng, n_tok * ne, 4.0);
                    let lv = put(d, &c, &logits);
                    let (iv, wv) = (
                        c.take(4 * (n_tok * k) as u64),
                        c.take(4 * (n_tok * k) as u64),
                    );
                    d.router_topk(lv, n_tok, ne, k, norm, iv, wv).unwrap();
                    let mut gi = vec![0i32; n_tok * k];
                    d.dtoh(iv, &mut gi).unwrap();
                    let gw = get::<f32>(d, wv, n_tok * k);
                    let mut want_w = Vec::new();
                    for t in 0..n_tok {
                        let (ri, rw) = router_ref(&logits[t * ne..(t + 1) * ne], k, norm);
                        assert_eq!(
                            &gi[t * k..(t + 1) * k],
                            &ri[..],
                            "router ne={ne} k={k} token {t}: expert choice"
                        );
                        want_w.extend(rw);
                    }
                    let what = format!("router ne={ne} k={k} norm={norm} n_tok={n_tok}");
                    let e = gw
                        .iter()
                        .zip(&want_w)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max);
                    assert!(e <= 1e-6, "{what}: weight err {e}");
                    if n_tok == 33 && norm {
                        eprintln!("PASS {what}: indices exact, max weight err {e:.3e} (tol 1e-6)");
                    }
                }
            }
        }
    }
    // Ties go to the lower index, as the CPU reference.
    let c = Carve::new(&a);
    let lv = put(d, &c, &[1.0f32, 3.0, 3.0, 0.0, 3.0]);
    let (iv, wv) = (c.take(12), c.take(12));
    d.router_topk(lv, 1, 5, 3, false, iv, wv).unwrap();
    let mut gi = [0i32; 3];
    d.dtoh(iv, &mut gi).unwrap();
    assert_eq!(gi, [1, 2, 4]);
    eprintln!("PASS router ties: lower index first");
}

#[test]
fn argmax_greedy_sampling() {
    let Some(d) = dev("argmax") else { return };
    let mut rng = StdRng::seed_from_u64(7);
    let a = big_arena(d, 8);
    for &n in &[1usize, 7, 1000, 151_936] {
        let n_tok = 3;
        let c = Carve::new(&a);
        let mut logits = rand_vec(&mut rng, n_tok * n, 10.0);
        if n > 10 {
            logits[5] = 50.0; // a tie within token 0: the lower index wins
            logits[9] = 50.0;
        }
        let lv = put(d, &c, &logits);
        let ov = c.take(4 * n_tok as u64);
        d.argmax(lv, n_tok, n, ov).unwrap();
        let mut got = vec![0i32; n_tok];
        d.dtoh(ov, &mut got).unwrap();
        let want: Vec<i32> = (0..n_tok)
            .map(|t| strata_exec::sampler::argmax(&logits[t * n..(t + 1) * n]) as i32)
            .collect();
        assert_eq!(got, want, "argmax n={n}");
    }
    eprintln!("PASS argmax: vocab 1, 7, 1000, 151936 exact (ties to the lower index)");
}

#[test]
fn decode_attention_f16_and_q8_0_kv_gqa() {
    let Some(d) = dev("attn_decode") else { return };
    let mut rng = StdRng::seed_from_u64(8);
    let a = big_arena(d, 256);
    for kv_ty in [GgmlType::F16, GgmlType::Q8_0] {
        let mut worst = 0f32;
        for &(n_head, n_head_kv, hd) in &[
            (32usize, 4usize, 128usize),
            (16, 16, 64),
            (8, 2, 80),
            (4, 1, 256),
        ] {
            for &n_cells in &[1usize, 17, 300, 1000, 4099] {
                for &n_tok in &[1usize, 4] {
                    let c = Carve::new(&a);
                    let row = n_head_kv * hd;
                    let mut kb = Vec::new();
                    let mut vb = Vec::new();
                    for _ in 0..n_cells {
                        quant::quantize_row(kv_ty, &rand_vec(&mut rng, row, 2.0), &mut kb).unwrap();
                        quant::quantize_row(kv_ty, &rand_vec(&mut rng, row, 1.0), &mut vb).unwrap();
                    }
                    let q = rand_vec(&mut rng, n_tok * n_head * hd, 1.0);
                    let mut n_ctx: Vec<i32> = (0..n_tok)
                        .map(|_| rng.random_range(1..=n_cells as i32))
                        .collect();
                    n_ctx[0] = n_cells as i32; // one token sees everything (ragged tail of the last split)
                    let max_ctx = *n_ctx.iter().max().unwrap() as usize;
                    let scale = 1.0 / (hd as f32).sqrt();
                    let args = AttnDecode {
                        n_tok,
                        n_head,
                        n_head_kv,
                        head_dim_k: hd,
                        head_dim_v: hd,
                        n_cells,
                        k_row_elems: row,
                        v_row_elems: row,
                        kv_ty,
                        scale,
                        max_ctx,
                    };
                    let (qv, kv, vv, cv) = (
                        put(d, &c, &q),
                        put(d, &c, &kb),
                        put(d, &c, &vb),
                        put(d, &c, &n_ctx),
                    );
                    let sv = c.take(args.scratch_bytes());
                    let ov = c.take(4 * (n_tok * n_head * hd) as u64);
                    d.attn_decode(&args, qv, kv, vv, &n_ctx, cv, sv, ov)
                        .unwrap();
                    let layer = KvLayer {
                        ty: kv_ty,
                        k: &kb,
                        v: &vb,
                        n_cells,
                        k_row_elems: row,
                        v_row_elems: row,
                    };
                    let shape = AttnShape {
                        n_head,
                        n_head_kv,
                        head_dim_k: hd,
                        head_dim_v: hd,
                    };
                    let mut want = vec![0f32; n_tok * n_head * hd];
                    cpu::attention(
                        shape,
                        &q,
                        n_tok,
                        |t| (layer, n_ctx[t] as usize),
                        scale,
                        &mut want,
                    )
                    .unwrap();
                    let got = get::<f32>(d, ov, want.len());
                    let what = format!("attn_decode {kv_ty} heads {n_head}/{n_head_kv} hd={hd} cells={n_cells} n_tok={n_tok}");
                    let mut max = 0f32;
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        let e = (g - w).abs();
                        assert!(
                            e <= 2e-5 + 1e-4 * w.abs(),
                            "{what}: element {i} got {g} want {w}"
                        );
                        max = max.max(e);
                    }
                    worst = worst.max(max);
                }
            }
        }
        eprintln!("PASS attn_decode {kv_ty} KV: GQA 32/4 x128, 16/16 x64, 8/2 x80, 4/1 x256; cells 1..4099; 1 and 4 tokens: max abs err {worst:.3e} (atol 2e-5, rtol 1e-4)");
    }
}

#[test]
fn missing_library_is_an_error_not_a_panic() {
    // Runs everywhere: on a machine without libcuda the error must name what was looked for.
    match strata_exec::backend::cuda::check_libraries() {
        Ok(()) => eprintln!("libraries present: check_libraries ok"),
        Err(e) => {
            let m = e.to_string();
            assert!(m.contains("libcuda") || m.contains("libnvrtc"), "{m}");
            assert!(m.contains("LD_LIBRARY_PATH") && m.contains(".so"), "{m}");
            eprintln!("SKIP (no CUDA device): libraries missing, reported as: {m}");
        }
    }
}

/// Rows of `n_cells` cells for `n_slots` slots, K then V per slot (the engine's layout),
/// random, as stored by the host quantizer.
fn slot_kv_host(rng: &mut StdRng, l: &SlotKv) -> Vec<u8> {
    let mut out = Vec::new();
    for _ in 0..l.n_slots {
        for scale in [2.0, 1.0] {
            for _ in 0..l.n_cells {
                quant::quantize_row(l.ty, &rand_vec(rng, l.row_elems, scale), &mut out).unwrap();
            }
        }
    }
    out
}

#[test]
fn kv_store_matches_the_host_quantizer_byte_for_byte() {
    let Some(d) = dev("kv_store") else { return };
    let mut rng = StdRng::seed_from_u64(21);
    let a = big_arena(d, 16);
    for ty in [GgmlType::F16, GgmlType::Q8_0, GgmlType::F32] {
        for &row_elems in &[32usize, 256, 1024] {
            let l = SlotKv {
                n_slots: 3,
                n_cells: 40,
                row_elems,
                ty,
            };
            let c = Carve::new(&a);
            let mut kv = slot_kv_host(&mut rng, &l);
            let kvv = put(d, &c, &kv);
            let n = 7;
            let slots: Vec<i32> = (0..n).map(|i| [2, 0, 1, 2, 0, 1, 1][i]).collect();
            let pos: Vec<i32> = (0..n).map(|i| [0, 5, 39, 17, 6, 0, 1][i]).collect();
            let k = rand_vec(&mut rng, n * row_elems, 3.0);
            let v = rand_vec(&mut rng, n * row_elems, 0.5);
            let (kd, vd, sd, pd) = (
                put(d, &c, &k),
                put(d, &c, &v),
                put(d, &c, &slots),
                put(d, &c, &pos),
            );
            d.kv_store(&l, kd, vd, kvv, &slots, sd, &pos, pd).unwrap();
            let got = get::<u8>(d, kvv, kv.len());
            let rb = l.row_bytes().unwrap() as usize;
            for t in 0..n {
                let cell = |which: usize| {
                    (slots[t] as usize * 2 + which) * l.n_cells * rb + pos[t] as usize * rb
                };
                for (which, src) in [(0, &k), (1, &v)] {
                    let mut row = Vec::new();
                    quant::quantize_row(ty, &src[t * row_elems..(t + 1) * row_elems], &mut row)
                        .unwrap();
                    let at = cell(which);
                    kv[at..at + rb].copy_from_slice(&row);
                }
            }
            // Identical f32 inputs and the same rounding rules: every byte equal, and no
            // byte outside the written cells touched.
            let diffs: Vec<String> = got
                .iter()
                .zip(&kv)
                .enumerate()
                .filter(|(_, (a, b))| a != b)
                .map(|(i, (a, b))| format!("row {} byte {}: {a} vs {b}", i / rb, i % rb))
                .collect();
            assert!(
                diffs.is_empty(),
                "kv_store {ty} rows of {row_elems}: {} bytes differ from the host quantizer (device vs host): {}",
                diffs.len(),
                diffs[..diffs.len().min(16)].join("; ")
            );
        }
    }
    eprintln!("PASS kv_store F16/Q8_0/F32, rows 32/256/1024, 3 slots: byte-identical to quant::quantize_row");
}

#[test]
fn prefill_attention_f16_and_q8_0_kv_matches_the_cpu() {
    let Some(d) = dev("attn_prefill") else { return };
    let mut rng = StdRng::seed_from_u64(22);
    let a = big_arena(d, 64);
    let mut worst = 0f32;
    for ty in [GgmlType::F16, GgmlType::Q8_0] {
        for &(n_head, n_head_kv, hd) in &[(4usize, 2usize, 16usize), (32, 4, 128), (8, 8, 64)] {
            for &(p0, n_tok) in &[(0usize, 8usize), (8, 8), (0, 29), (37, 40), (0, 1)] {
                let l = SlotKv {
                    n_slots: 2,
                    n_cells: 96,
                    row_elems: n_head_kv * hd,
                    ty,
                };
                let c = Carve::new(&a);
                let kv = slot_kv_host(&mut rng, &l);
                let slot = 1i32;
                let pos: Vec<i32> = (p0..p0 + n_tok).map(|p| p as i32).collect();
                let q = rand_vec(&mut rng, n_tok * n_head * hd, 1.0);
                let (qd, kvd, sd, pd) = (
                    put(d, &c, &q),
                    put(d, &c, &kv),
                    put(d, &c, &[slot]),
                    put(d, &c, &pos),
                );
                let od = c.take(4 * (n_tok * n_head * hd) as u64);
                d.attn_prefill(
                    &l,
                    (n_head, n_head_kv, hd),
                    false,
                    qd,
                    kvd,
                    &[slot],
                    sd,
                    &pos,
                    pd,
                    od,
                )
                .unwrap();
                let rb = l.row_bytes().unwrap() as usize;
                let base = slot as usize * 2 * l.n_cells * rb;
                let layer = KvLayer {
                    ty,
                    k: &kv[base..base + l.n_cells * rb],
                    v: &kv[base + l.n_cells * rb..base + 2 * l.n_cells * rb],
                    n_cells: l.n_cells,
                    k_row_elems: l.row_elems,
                    v_row_elems: l.row_elems,
                };
                let shape = AttnShape {
                    n_head,
                    n_head_kv,
                    head_dim_k: hd,
                    head_dim_v: hd,
                };
                let mut want = vec![0f32; n_tok * n_head * hd];
                let scale = 1.0 / (hd as f32).sqrt();
                cpu::attention(
                    shape,
                    &q,
                    n_tok,
                    |t| (layer, pos[t] as usize + 1),
                    scale,
                    &mut want,
                )
                .unwrap();
                let got = get::<f32>(d, od, want.len());
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let e = (g - w).abs();
                    assert!(
                        e <= 2e-5 + 1e-4 * w.abs(),
                        "attn_prefill {ty} heads {n_head}/{n_head_kv} x{hd} p0={p0} n_tok={n_tok}: element {i} got {g} want {w}"
                    );
                    worst = worst.max(e);
                }
            }
        }
    }
    eprintln!("PASS attn_prefill (dq_attn_prefill) F16/Q8_0 KV: heads 4/2x16, 32/4x128, 8/8x64; starts 0, 8, 37; 1..40 tokens; slot 1 of 2: max abs err {worst:.3e} (atol 2e-5, rtol 1e-4)");
}
