//! The HIP driver operations on a real AMD GPU: device facts, arenas and their views,
//! copies, memset, events, graph capture and replay, and kernels whose result depends on the
//! wave size (block reductions, the arg-max butterfly) checked against host arithmetic at
//! the device's own reported warp size; then the whole engine: the tiny Qwen3-MoE planned for
//! AMD devices, started through `start_cuda` (which opens HIP for an `amd` plan) on one
//! device and as a two-stage layer split, its prompt logits and greedy tokens against
//! transformers' and the CPU engine's. Never run on AMD hardware by us yet: this is the
//! test to run the day one is at hand (`cargo test -p strata-exec --features hip --test
//! hip_device`).
//! Invariant: skips loudly, naming why, when there is no HIP runtime or no AMD device.

#![cfg(feature = "hip")]

mod common;

use std::ffi::c_void;
use strata_exec::backend::hip::{device::device_count, HipDevice};

fn device() -> Option<HipDevice> {
    match device_count() {
        Ok(0) => eprintln!("SKIP: the HIP runtime loads but reports no AMD device"),
        Ok(_) => return Some(HipDevice::open(0).expect("open HIP device 0")),
        Err(e) => eprintln!("SKIP: no HIP runtime here ({e})"),
    }
    None
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bytes_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn arg<T>(v: &T) -> *mut c_void {
    v as *const T as *mut c_void
}

#[test]
fn device_facts_views_copies_memset_and_events() {
    let Some(dev) = device() else { return };
    let i = dev.info();
    eprintln!("{i:?}");
    assert!(i.target.processor.starts_with("gfx"), "{i:?}");
    assert!(i.warp_size == 32 || i.warp_size == 64, "{i:?}");
    assert!(i.total_bytes > 0 && i.compute_units > 0);
    let (free, total) = dev.mem_info().unwrap();
    assert!(free <= total && total == i.total_bytes);
    let before = strata_exec::backend::hip::arena_allocations();
    let a = dev.alloc_arena("test", 1 << 20).unwrap();
    assert_eq!(strata_exec::backend::hip::arena_allocations(), before + 1);
    assert!(a.view(1 << 20, 1).is_err());
    assert!(dev.alloc_arena("empty", 0).is_err());
    let v = a.view(4096, 1024).unwrap();
    let data: Vec<u8> = (0..1024).map(|i| (i * 7) as u8).collect();
    dev.htod(&data, v).unwrap();
    let mut back = vec![0u8; 1024];
    dev.dtoh(v, &mut back).unwrap();
    assert_eq!(back, data);
    let s = dev.stream();
    let (t0, t1) = (dev.new_event().unwrap(), dev.new_event().unwrap());
    t0.record(s).unwrap();
    dev.memset_async(v.sub(0, 512).unwrap(), 0xab, s).unwrap();
    t1.record(s).unwrap();
    t1.synchronize().unwrap();
    assert!(t0.elapsed_ms(&t1).unwrap() >= 0.0);
    dev.dtoh(v, &mut back).unwrap();
    assert!(back[..512].iter().all(|&b| b == 0xab));
    assert_eq!(back[512..], data[512..]);
}

#[test]
fn reductions_match_the_host_at_the_devices_wave_size() {
    let Some(dev) = device() else { return };
    let wave = dev.info().warp_size;
    let s = dev.stream();
    // argmax over rows with ties at several places: the lowest index must win.
    let (rows, n) = (4usize, 3000usize);
    let mut x: Vec<f32> = (0..rows * n).map(|i| ((i * 37) % 101) as f32).collect();
    x[n + 2999] = 500.0;
    x[n + 17] = 500.0;
    // dq_argmax_rows, one block a row: x, then per row a partial value, index, counter
    // (zero) and the chosen token.
    let xb = (rows * n * 4) as u64;
    let a = dev.alloc_arena("x", xb + (4 * rows * 4) as u64).unwrap();
    let xv = a.view(0, xb).unwrap();
    let sv = |k: u64| {
        a.view(xb + k * (rows * 4) as u64, (rows * 4) as u64)
            .unwrap()
    };
    let (pv, pi, cn, ov) = (sv(0), sv(1), sv(2), sv(3));
    dev.htod(&f32_bytes(&x), xv).unwrap();
    dev.htod(&vec![0u8; rows * 4], cn).unwrap();
    let f = dev.function("dq_argmax_rows").unwrap();
    let (xp, ni, pvp, pip, cnp, op) = (xv.ptr(), n as i32, pv.ptr(), pi.ptr(), cn.ptr(), ov.ptr());
    // No row processing: a null `proc` and 0 words a row.
    let (proc, proc_words) = (0u64, 0i64);
    let mut args = [
        arg(&xp),
        arg(&ni),
        arg(&proc),
        arg(&proc_words),
        arg(&pvp),
        arg(&pip),
        arg(&cnp),
        arg(&op),
    ];
    // SAFETY: dq_argmax_rows(x, cols, proc, proc_words, part_v, part_i, cnt, out): rows x n
    // floats in, no processing, one
    // partial pair, counter and token per row (grid (1, rows), 256 threads).
    unsafe { dev.launch(f, (1, rows as u32, 1), (256, 1, 1), 0, s, &mut args) }.unwrap();
    let mut out = vec![0u8; rows * 4];
    dev.dtoh(ov, &mut out).unwrap();
    let got: Vec<i32> = out
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    for r in 0..rows {
        let row = &x[r * n..(r + 1) * n];
        let m = row.iter().cloned().fold(f32::MIN, f32::max);
        let want = row.iter().position(|&v| v == m).unwrap() as i32;
        assert_eq!(got[r], want, "row {r}, wave{wave}");
    }
    // rmsnorm: a block sum across every warp of the block.
    let n = 4096usize;
    let x: Vec<f32> = (0..n).map(|i| ((i % 13) as f32 - 6.0) * 0.25).collect();
    let w: Vec<f32> = (0..n).map(|i| 1.0 + (i % 3) as f32 * 0.5).collect();
    let b = dev.alloc_arena("norm", (3 * n * 4) as u64).unwrap();
    let (xv, wv, ov) = (
        b.view(0, (n * 4) as u64).unwrap(),
        b.view((n * 4) as u64, (n * 4) as u64).unwrap(),
        b.view((2 * n * 4) as u64, (n * 4) as u64).unwrap(),
    );
    dev.htod(&f32_bytes(&x), xv).unwrap();
    dev.htod(&f32_bytes(&w), wv).unwrap();
    let ss: f64 = x.iter().map(|v| (*v as f64) * (*v as f64)).sum();
    let r = 1.0 / (ss / n as f64 + 1e-6).sqrt();
    let f = dev.function("rmsnorm_f32").unwrap();
    for threads in [wave, 256, 1024] {
        let (xp, null, wp, op, ni, eps) = (xv.ptr(), 0u64, wv.ptr(), ov.ptr(), n as i32, 1e-6f32);
        let mut args = [
            arg(&xp),
            arg(&null),
            arg(&null),
            arg(&wp),
            arg(&op),
            arg(&ni),
            arg(&eps),
        ];
        // SAFETY: rmsnorm_f32(x, res, h_out, w, out, n, eps) over one row of n floats.
        unsafe { dev.launch(f, (1, 1, 1), (threads, 1, 1), 0, s, &mut args) }.unwrap();
        let mut out = vec![0u8; n * 4];
        dev.dtoh(ov, &mut out).unwrap();
        for (i, g) in bytes_f32(&out).iter().enumerate() {
            let want = (w[i] as f64 * x[i] as f64 * r) as f32;
            assert!(
                (g - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{i}: {g} vs {want}, {threads} threads"
            );
        }
    }
}

#[test]
fn a_captured_graph_replays_its_kernels_and_copies() {
    let Some(dev) = device() else { return };
    let s = dev.new_stream().unwrap();
    let n = 1000usize;
    let a = dev.alloc_arena("graph", (4 * n * 4) as u64).unwrap();
    let v = |k: usize| a.view((k * n * 4) as u64, (n * 4) as u64).unwrap();
    let pos: Vec<i32> = (0..n as i32).map(|i| i * 3 % 977).collect();
    let pos_bytes: Vec<u8> = pos.iter().flat_map(|p| p.to_le_bytes()).collect();
    dev.htod(&pos_bytes, v(0)).unwrap();
    let f = dev.function("dq_ctx_from_pos").unwrap();
    let (pp, op, nn) = (v(0).ptr(), v(2).ptr(), n as i32);
    let graph = dev
        .capture(&s, || {
            dev.memset_async(v(2), 0, &s)?;
            let mut args = [arg(&pp), arg(&op), arg(&nn)];
            // SAFETY: dq_ctx_from_pos(pos, n_ctx, n) over n ints each.
            unsafe { dev.launch(f, (8, 1, 1), (128, 1, 1), 0, &s, &mut args) }?;
            dev.dtod_async(v(2), v(3), &s)
        })
        .unwrap();
    for _ in 0..3 {
        graph.launch(&s).unwrap();
    }
    s.synchronize().unwrap();
    let mut out = vec![0u8; n * 4];
    dev.dtoh(v(3), &mut out).unwrap();
    for (i, c) in out.chunks_exact(4).enumerate() {
        let got = i32::from_le_bytes(c.try_into().unwrap());
        assert_eq!(got, pos[i] + 1, "{i}");
    }
}

#[test]
fn a_missing_kernel_and_a_bad_launch_are_errors() {
    let Some(dev) = device() else { return };
    let e = dev.function("gemm_q8_0_m64").unwrap_err().to_string();
    assert!(e.contains("CUDA-only"), "{e}");
    let f = dev.function("dq_ctx_from_pos").unwrap();
    // SAFETY: refused before launch (too many threads).
    let e = unsafe { dev.launch(f, (1, 1, 1), (4096, 1, 1), 0, dev.stream(), &mut []) };
    assert!(e.unwrap_err().to_string().contains("4096 threads"));
}

/// The largest |a - b| over every logit row, relative to that row's largest |b|.
fn rel_err(a: &[f32], b: &[f32], v: usize) -> f32 {
    a.chunks(v)
        .zip(b.chunks(v))
        .map(|(x, y)| {
            let s = y.iter().fold(0f32, |m, t| m.max(t.abs())).max(1e-6);
            x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs())) / s
        })
        .fold(0f32, f32::max)
}

/// Prompt logits (every position) and a greedy continuation of `n` tokens.
fn run(e: &mut dyn strata_exec::engine::Engine, prompt: &[u32], n: usize) -> (Vec<f32>, Vec<u32>) {
    let ub = e.info().ubatch;
    let mut logits = Vec::new();
    for chunk in prompt.chunks(ub) {
        logits.extend_from_slice(e.prefill_all(0, chunk).unwrap());
    }
    let v = e.info().n_vocab;
    let mut next = common::argmax(&logits[logits.len() - v..]);
    let mut out = vec![next];
    while out.len() < n {
        next = common::argmax(e.decode(&[(0, next)]).unwrap());
        out.push(next);
    }
    (logits, out)
}

#[test]
fn the_engine_runs_the_tiny_model_on_hip_as_the_cpu_engine_does() {
    use common::*;
    use strata_exec::backend::cuda::options::CudaOptions;
    use strata_exec::backend::cuda::start::start_cuda;
    use strata_exec::engine::Engine;
    use strata_exec::load::SafetensorsModel;
    let Some(dev) = device() else { return };
    if dev.info().warp_size != 32 {
        eprintln!(
            "SKIP: device 0 runs wave{}; the engine takes wave32 (RDNA) GPUs only",
            dev.info().warp_size
        );
        return;
    }
    drop(dev);
    let r = reference("base");
    let n_layer = strata_plan::model::load_model(&data("base"))
        .unwrap()
        .hparams
        .n_layer;
    for (devices, split) in [(1, None), (2, Some(vec![n_layer / 2]))] {
        let p = amd_plan("base", devices, split);
        let host = SafetensorsModel::open(&data("base")).unwrap();
        // Both planned devices on GPU 0 (one device object, as --gpu 0 runs a split).
        let mut g = start_cuda(&p, Box::new(host), CudaOptions::f32_products()).unwrap();
        assert_eq!(g.device().arch(), dev_arch());
        assert!(!g.grouped_prefill(), "no tensor-core prefill on HIP");
        let mut c = engine("base", &plan("base", &Ask::default()));
        let v = g.info().n_vocab;
        for (pi, prompt) in prompts(&r).iter().enumerate() {
            g.reset_slot(0);
            c.reset_slot(0);
            let greedy: Vec<u32> = r["greedy"][pi]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            let (gl, gt) = run(&mut g, prompt, greedy.len());
            let (cl, ct) = run(&mut c, prompt, greedy.len());
            let e_cpu = rel_err(&gl, &cl, v);
            eprintln!("{devices} device(s), prompt {pi}: HIP vs CPU {e_cpu:e}");
            assert!(e_cpu < 1e-4, "prompt {pi}: HIP vs CPU {e_cpu}");
            assert_eq!(gt, greedy, "prompt {pi}: greedy on HIP vs transformers");
            assert_eq!(ct, gt, "prompt {pi}: greedy HIP vs CPU");
        }
    }
}

/// Device 0's target ID as the HIP runtime reports it.
fn dev_arch() -> String {
    HipDevice::open_bare(0).unwrap().arch()
}
