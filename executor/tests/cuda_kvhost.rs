//! `--kv-host cpu` at the kernel level: the split-KV decode attention over a KV layer whose
//! cells past the window live in mapped pinned chunks, computed two ways on the same stored
//! rows — the GPU reading every cell (`attn_decode`, the stream policy) and the GPU's window
//! (`attn_gqa` with `cpu_part`) plus the host CPU's partial over the rest
//! (`host_attn::host_partials` from the chunks) merged by `attn_combine` — agree within 1e-4
//! of the largest output, for F16 and Q8_0 KV, a token deep past the window beside one below
//! it. Needs a GPU: without one it prints SKIP and returns (on the GPU machine: `cargo test
//! -p strata-exec --release --test cuda_kvhost -- --nocapture`).

#![cfg(feature = "cuda")]

mod common;

use common::gpu_present;
use strata_exec::backend::cpu::host_attn::{host_partials, scratch_len, SpilledCells};
use strata_exec::backend::cuda::kv_spill::{KvSpill, SpillLayout};
use strata_exec::backend::cuda::launch::attention::{self, Heads, HostPartial, KvLayer, Splits};
use strata_exec::backend::cuda::launch::Launcher;
use strata_exec::backend::cuda::CudaDevice;
use strata_schemas::ggml::GgmlType;

const N_HEAD: usize = 8;
const N_KV: usize = 2;
const HD: usize = 128;
const SLOTS: usize = 2;
const CTX: usize = 200;
const WINDOW: usize = 72;

fn rand(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

fn case(dev: &CudaDevice, ty: GgmlType, code: i32) -> f32 {
    let width = N_KV * HD;
    let rb = strata_exec::quant::row_bytes(ty, width).unwrap() as u64;
    // One KV layer, a 6-byte tail in each spilled cell, 37 cells a chunk.
    let cell = 2 * rb + 6;
    let cells = (SLOTS * (CTX - WINDOW)) as u64;
    let mut chunks = Vec::new();
    let mut left = cells;
    while left > 0 {
        chunks.push(left.min(37) * cell);
        left -= left.min(37);
    }
    let layout = SpillLayout::new(chunks, SLOTS as u64, CTX as u64, WINDOW as u64, 2 * rb)
        .unwrap()
        .unwrap();
    let spill = KvSpill::pin(dev, layout).unwrap();
    let host = spill.arg(0, rb);
    let slot_bytes = 2 * WINDOW as u64 * rb;
    let kv = dev.alloc_arena("kv", SLOTS as u64 * slot_bytes).unwrap();
    let ints = dev.alloc_arena("ints", 4 * 2 * CTX as u64).unwrap();
    let rows = dev
        .alloc_arena("rows", 4 * 2 * (CTX * width) as u64)
        .unwrap();
    let small = dev.alloc_arena("small", 4 * HD as u64).unwrap();
    let l = Launcher {
        dev,
        pdl: false,
        prof: None,
        q4k_lanes: false,
    };
    let layer = |slot, pos| KvLayer {
        kv: kv.all(),
        slot_bytes,
        k_off: 0,
        v_off: WINDOW as u64 * rb,
        row_bytes: rb,
        cells: WINDOW as u64,
        ty: code,
        host,
        slot,
        pos,
    };
    // Every cell of both slots stored through the engine's KV store (VRAM or the chunks).
    for s in 0..SLOTS {
        let (k, v) = (
            rand(CTX * width, 7 + s as u32),
            rand(CTX * width, 99 + s as u32),
        );
        let kr = rows.view(0, 4 * (CTX * width) as u64).unwrap();
        let vr = rows
            .view(4 * (CTX * width) as u64, 4 * (CTX * width) as u64)
            .unwrap();
        dev.htod(&k, kr).unwrap();
        dev.htod(&v, vr).unwrap();
        let slot: Vec<i32> = vec![s as i32; CTX];
        let pos: Vec<i32> = (0..CTX as i32).collect();
        dev.htod(&slot, ints.view(0, 4 * CTX as u64).unwrap())
            .unwrap();
        dev.htod(&pos, ints.view(4 * CTX as u64, 4 * CTX as u64).unwrap())
            .unwrap();
        let kl = layer(
            ints.view(0, 4 * CTX as u64).unwrap(),
            ints.view(4 * CTX as u64, 4 * CTX as u64).unwrap(),
        );
        attention::kv_store(&l, kr, vr, kl, width, CTX).unwrap();
        dev.synchronize().unwrap();
    }
    // Two decoding tokens: slot 0 over its whole context, slot 1 below the window.
    let n = 2;
    let n_ctx = [CTX as i32, WINDOW as i32 - 5];
    let step = dev.alloc_arena("step", 4 * 3 * n as u64).unwrap();
    dev.htod(
        &[0i32, 1, n_ctx[0] - 1, n_ctx[1] - 1, n_ctx[0], n_ctx[1]],
        step.all(),
    )
    .unwrap();
    let (sv, pv, cv) = (
        step.view(0, 8).unwrap(),
        step.view(8, 8).unwrap(),
        step.view(16, 8).unwrap(),
    );
    let q = rand(n * N_HEAD * HD, 5);
    let qa = dev.alloc_arena("q", 4 * q.len() as u64).unwrap();
    dev.htod(&q, qa.all()).unwrap();
    let heads = Heads {
        n_head: N_HEAD,
        n_head_kv: N_KV,
        hd: HD,
        n_rot: HD,
        eps: 1e-6,
        attn_factor: 1.0,
        inv_freq: small.view(0, 4 * (HD / 2) as u64).unwrap(),
        q_norm: small.all(),
        k_norm: small.all(),
    };
    let ns = strata_schemas::workset::att_splits(CTX);
    let po = dev
        .alloc_arena("part_o", 4 * (n * N_HEAD * ns * HD) as u64)
        .unwrap();
    let pm = dev
        .alloc_arena("part_ms", 4 * (n * N_HEAD * ns * 2) as u64)
        .unwrap();
    let sp = Splits {
        n: ns,
        part_o: po.all(),
        part_ms: pm.all(),
    };
    let out = dev
        .alloc_arena("out", 4 * (n * N_HEAD * HD) as u64)
        .unwrap();
    // The GPU reading every cell.
    attention::attn_decode(&l, heads, qa.all(), layer(sv, pv), cv, sp, out.all(), n).unwrap();
    let mut want = vec![0f32; n * N_HEAD * HD];
    dev.dtoh(out.all(), &mut want).unwrap();
    dev.memset(out.all(), 0).unwrap();
    // The window on the GPU, the rest on the CPU.
    let mut win = layer(sv, pv);
    win.host.cpu_part = 1;
    attention::attn_gqa(&l, heads, qa.all(), win, cv, sp, n).unwrap();
    dev.synchronize().unwrap();
    let slices = spill.chunk_slices();
    let cells = SpilledCells {
        chunks: &slices,
        ty,
        cell_bytes: cell as usize,
        per_chunk: 37,
        resident: WINDOW,
        per_slot: CTX - WINDOW,
        k_off: 0,
        v_off: rb as usize,
        row_bytes: rb as usize,
    };
    let mut part = vec![0f32; n * N_HEAD * (HD + 2)];
    let mut scratch = vec![0f32; scratch_len(n, N_HEAD, HD, 3)];
    let (o, ms) = part.split_at_mut(n * N_HEAD * HD);
    let (slot, ctx) = ([0u32, 1], [n_ctx[0] as u32, n_ctx[1] as u32]);
    let scale = 1.0 / (HD as f32).sqrt();
    let shape = (N_HEAD, N_KV, HD);
    host_partials(
        &cells,
        shape,
        &slot,
        &ctx,
        &q,
        scale,
        3,
        &mut scratch,
        o,
        ms,
    )
    .unwrap();
    let pa = dev.alloc_arena("host_part", 4 * part.len() as u64).unwrap();
    dev.htod(&part, pa.all()).unwrap();
    let ob = 4 * (n * N_HEAD * HD) as u64;
    let hp = HostPartial {
        o: pa.view(0, ob).unwrap(),
        ms: pa.view(ob, 4 * (n * N_HEAD * 2) as u64).unwrap(),
        window: WINDOW as u64,
    };
    attention::attn_combine(&l, heads, cv, sp, Some(hp), out.all(), n).unwrap();
    let mut got = vec![0f32; n * N_HEAD * HD];
    dev.dtoh(out.all(), &mut got).unwrap();
    let top = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    let worst = got
        .iter()
        .zip(&want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
        / top;
    assert!(top > 1e-3, "{ty}: a non-trivial attention output");
    worst
}

#[test]
fn host_partials_merge_with_the_gpu_window_as_the_gpu_alone_attends() {
    if !gpu_present() {
        return;
    }
    let dev = CudaDevice::open(0).unwrap();
    for (ty, code) in [(GgmlType::F16, 1), (GgmlType::Q8_0, 3)] {
        let worst = case(&dev, ty, code);
        eprintln!(
            "{ty}: window on the GPU + host part on the CPU within {worst:e} of the GPU alone"
        );
        assert!(worst < 1e-4, "{ty}: {worst}");
    }
}
