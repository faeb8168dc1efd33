//! `cuda_gemm`'s timings at Qwen3-30B-A3B's shapes (dense products, the grouped expert
//! products and a whole MoE layer, Q8_0 and Q4_K, 512 tokens), each checked on sampled
//! outputs against the CPU reference; prints `TIME` lines only.
//! Invariant: GPU only; without a device the test prints `SKIP (no CUDA device): ...` and
//! returns (`super::dev`).

use super::*;

/// Random Q8_0 split-layout bytes (quants anything, scales f16 in [0.002, 0.02)) for `mats`
/// matrices, fast enough for hundreds of MB.
fn fast_q8(rng: &mut StdRng, mats: usize, rows: usize, cols: usize) -> Vec<u8> {
    let mb = rows * cols / 32 * 34;
    let mut b = vec![0u8; mats * mb];
    rng.fill(&mut b[..]);
    for m in 0..mats {
        let sc = &mut b[m * mb + rows * cols..(m + 1) * mb];
        for s in sc.chunks_exact_mut(2) {
            let v = half::f16::from_f32(0.002 + 0.018 * (s[0] as f32 / 255.0));
            s.copy_from_slice(&v.to_bits().to_le_bytes());
        }
    }
    b
}

/// One dequantized row of matrix `m` of split-layout bytes.
fn q8_row(b: &[u8], m: usize, rows: usize, cols: usize, r: usize) -> Vec<f32> {
    let base = m * rows * cols / 32 * 34;
    let qs = &b[base + r * cols..base + (r + 1) * cols];
    let sc = &b[base + rows * cols..];
    (0..cols)
        .map(|c| {
            let blk = r * (cols / 32) + c / 32;
            let d = half::f16::from_bits(u16::from_le_bytes([sc[2 * blk], sc[2 * blk + 1]]));
            qs[c] as i8 as f32 * d.to_f32()
        })
        .collect()
}

/// Random Q4_K bytes (quants and 6-bit scales anything, d in [0.0005, 0.002) and dmin in
/// [0.001, 0.01) as f16) for `mats` matrices, fast enough for hundreds of MB.
fn fast_q4k(rng: &mut StdRng, mats: usize, rows: usize, cols: usize) -> Vec<u8> {
    let mut b = vec![0u8; mats * rows * cols / 256 * 144];
    rng.fill(&mut b[..]);
    for blk in b.chunks_exact_mut(144) {
        let d = half::f16::from_f32(0.0005 + 0.0015 * (blk[0] as f32 / 255.0));
        let dm = half::f16::from_f32(0.001 + 0.009 * (blk[2] as f32 / 255.0));
        blk[0..2].copy_from_slice(&d.to_bits().to_le_bytes());
        blk[2..4].copy_from_slice(&dm.to_bits().to_le_bytes());
    }
    b
}

/// Random device-layout weights of `ty` (Q8_0 or Q4_K) for `mats` matrices.
fn fast_w(rng: &mut StdRng, ty: GgmlType, mats: usize, rows: usize, cols: usize) -> Vec<u8> {
    if ty == GgmlType::Q4K {
        fast_q4k(rng, mats, rows, cols)
    } else {
        fast_q8(rng, mats, rows, cols)
    }
}

/// One dequantized row of matrix `m` of [`fast_w`] bytes.
fn w_row(ty: GgmlType, b: &[u8], m: usize, rows: usize, cols: usize, r: usize) -> Vec<f32> {
    if ty == GgmlType::Q4K {
        let rb = cols / 256 * 144;
        let at = (m * rows + r) * rb;
        let mut out = vec![0f32; cols];
        quant::dequantize_row(ty, &b[at..at + rb], &mut out).unwrap();
        out
    } else {
        q8_row(b, m, rows, cols, r)
    }
}

pub(super) fn time_ms(d: &CudaDevice, reps: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    let e0 = d.record_event().unwrap();
    for _ in 0..reps {
        f();
    }
    let e1 = d.record_event().unwrap();
    e1.synchronize().unwrap();
    e0.elapsed_ms(&e1).unwrap() as f64 / reps as f64
}

/// What every timing shares: the device, an arena to carve, tokens per pass and timed
/// repetitions.
#[derive(Clone, Copy)]
struct Timing<'a> {
    d: &'a CudaDevice,
    a: &'a DeviceArena,
    n_tok: usize,
    reps: usize,
}

/// The MoE layer of Qwen3-30B-A3B being timed: experts, top-k, FFN and hidden widths, each
/// token's picks (on the device as `iv`), the sort's scratch, and where the arena is free
/// after them.
#[derive(Clone, Copy)]
struct MoeLayer<'a> {
    ne: usize,
    k: usize,
    ff: usize,
    hid: usize,
    ids: &'a [i32],
    iv: DeviceView<'a>,
    sorted: DeviceView<'a>,
    free_at: u64,
}

#[test]
fn timings_at_qwen3_30b_shapes() {
    let Some(d) = dev("timings") else { return };
    let mut rng = StdRng::seed_from_u64(14);
    let a = d.alloc_arena("bench", 2 << 30).unwrap();
    let n_tok = 512;
    let reps = 20;
    let t = Timing {
        d,
        a: &a,
        n_tok,
        reps,
    };
    // Dense: expert-sized and attention-sized matrices at pp512 (checked on sampled outputs).
    for &(rows, cols) in &[
        (768usize, 2048usize),
        (2048, 768),
        (4096, 2048),
        (512, 2048),
        (2048, 4096),
    ] {
        for ty in [GgmlType::Q8_0, GgmlType::Q4K, GgmlType::BF16] {
            time_dense_gemm(t, &mut rng, ty, rows, cols);
        }
    }
    // MoE layer of Qwen3-30B-A3B at pp512: 128 experts, top-8, gate/up 768 x 2048 (gather),
    // down 2048 x 768 (direct), Q8_0 and Q4_K.
    let (ne, k, ff, hid) = (128usize, 8usize, 768usize, 2048usize);
    let ids: Vec<i32> = (0..n_tok)
        .flat_map(|_| {
            let mut ch: Vec<i32> = Vec::new();
            while ch.len() < k {
                let e = rng.random_range(0..ne as i32);
                if !ch.contains(&e) {
                    ch.push(e);
                }
            }
            ch
        })
        .collect();
    let c = Carve::new(&a);
    let iv = put(d, &c, &ids);
    let sorted = c.take(moe_scratch_bytes(n_tok, k, ne));
    let t_sort = time_ms(d, reps, || d.moe_sort(iv, n_tok, k, ne, sorted).unwrap());
    eprintln!(
        "TIME moe_sort n_tok={n_tok} k={k} experts={ne}: {:.1} us",
        t_sort * 1e3
    );
    let moe = MoeLayer {
        ne,
        k,
        ff,
        hid,
        ids: &ids,
        iv,
        sorted,
        free_at: c.off.get(),
    };
    for (ty, rows, cols, input) in [GgmlType::Q8_0, GgmlType::Q4K].into_iter().flat_map(|ty| {
        [
            (ty, ff, hid, MoeInput::Gather),
            (ty, hid, ff, MoeInput::Direct),
        ]
    }) {
        time_moe_gemm(t, &mut rng, moe, ty, rows, cols, input);
    }
    // The whole expert FFN of one layer as the engine runs it: sort, the fused gate + up
    // (SwiGLU, gather), down (direct).
    for ty in [GgmlType::Q8_0, GgmlType::Q4K] {
        time_moe_layer(t, &mut rng, moe, ty);
    }
}

/// One dense product `rows` x `cols` of `ty` at `t.n_tok` tokens: the x conversion, every
/// tile, split-K and `gemm()` timed on one line, sampled tokens of each checked.
fn time_dense_gemm(t: Timing, rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) {
    let Timing { d, a, n_tok, reps } = t;
    let c = Carve::new(a);
    let (wb, deq) = if ty != GgmlType::BF16 {
        let b = fast_w(rng, ty, 1, rows, cols);
        let deq: Vec<f32> = (0..rows)
            .flat_map(|r| w_row(ty, &b, 0, rows, cols, r))
            .collect();
        (b, deq)
    } else {
        let w = rand_vec(rng, rows * cols, 0.05);
        let mut b = Vec::new();
        quant::quantize_row(GgmlType::BF16, &w, &mut b).unwrap();
        let mut deq = vec![0f32; rows * cols];
        quant::dequantize_row(GgmlType::BF16, &b, &mut deq).unwrap();
        (b, deq)
    };
    let x = rand_vec(rng, n_tok * cols, 1.0);
    let (wv, xv) = (put(d, &c, &wb), put(d, &c, &x));
    let sv = c.take(gemm_scratch_bytes(n_tok, cols));
    let yv = c.take(4 * (n_tok * rows) as u64);
    let flop = 2.0 * (rows * cols * n_tok) as f64;
    let t_cvt = time_ms(d, reps, || {
        d.gemm_convert_x(xv, n_tok, cols, ty, sv).unwrap()
    });
    let mut line = format!(
        "TIME gemm {ty} rows={rows} cols={cols} n_tok={n_tok}: convert x {:.1} us",
        t_cvt * 1e3
    );
    for tile in [GemmTile::M64, GemmTile::M128, GemmTile::M128W] {
        let t = time_ms(d, reps, || {
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
                false,
            )
            .unwrap()
        });
        line += &format!(
            "; {tile:?} {:.1} us = {:.1} TFLOP/s",
            t * 1e3,
            flop / t / 1e9
        );
        // Check a sample of tokens of the last run.
        let got: Vec<f32> = get(d, yv, n_tok * rows);
        for &t in &[0usize, 1, 255, 511] {
            let want = reference(&deq, rows, cols, &x[t * cols..(t + 1) * cols]);
            check(
                &format!("timed gemm {ty} {rows}x{cols} {tile:?} token {t}"),
                ty,
                &got[t * rows..(t + 1) * rows],
                &want,
            );
        }
    }
    for tile in [GemmTile::M64, GemmTile::M128W] {
        let t = time_ms(d, reps, || {
            d.gemm_converted_kparts(
                tile,
                AnyLoad::default(),
                2,
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
        });
        line += &format!(
            "; {tile:?} split-K 2 {:.1} us = {:.1} TFLOP/s",
            t * 1e3,
            flop / t / 1e9
        );
        let got: Vec<f32> = get(d, yv, n_tok * rows);
        for &t in &[0usize, 300] {
            let want = reference(&deq, rows, cols, &x[t * cols..(t + 1) * cols]);
            check(
                &format!("timed split-K gemm {ty} {rows}x{cols} {tile:?} token {t}"),
                ty,
                &got[t * rows..(t + 1) * rows],
                &want,
            );
        }
    }
    let tile = d.gemm_default_tile(ty, rows, n_tok);
    let t = time_ms(d, reps, || {
        d.gemm(wv, ty, rows, cols, xv, n_tok, yv, sv).unwrap()
    });
    let kp = d.gemm_default_kparts(tile, rows, cols, n_tok);
    line += &format!(
        "; gemm() ({tile:?}, {kp} K parts, + convert) {:.1} us = {:.1} TFLOP/s",
        t * 1e3,
        flop / t / 1e9
    );
    eprintln!("{line}");
}

/// One grouped MoE product of `ty` (`rows` x `cols` per expert, `input` gathered or direct)
/// at `t.n_tok` tokens: the x conversion, every tile and (gathered) the fused SwiGLU form
/// timed on one line, sampled assignments of each tile checked.
fn time_moe_gemm(
    t: Timing,
    rng: &mut StdRng,
    moe: MoeLayer,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    input: MoeInput,
) {
    let Timing { d, a, n_tok, reps } = t;
    let MoeLayer {
        ne,
        k,
        ids,
        sorted,
        free_at,
        ..
    } = moe;
    let n_assign = n_tok * k;
    let c2 = Carve::new(a);
    c2.off.set(free_at);
    let wb = fast_w(rng, ty, ne, rows, cols);
    let x_rows = if input == MoeInput::Gather {
        n_tok
    } else {
        n_assign
    };
    let x = rand_vec(rng, x_rows * cols, 1.0);
    let (wv, xv) = (put(d, &c2, &wb), put(d, &c2, &x));
    let sv = c2.take(gemm_scratch_bytes(x_rows, cols));
    let yv = c2.take(4 * (n_assign * rows) as u64);
    let flop = 2.0 * (n_assign * rows * cols) as f64;
    let t_cvt = time_ms(d, reps, || {
        d.gemm_convert_x(xv, x_rows, cols, ty, sv).unwrap()
    });
    let mut line = format!(
        "TIME moe_gemm {ty} {input:?} rows={rows} cols={cols} n_tok={n_tok} k={k} experts={ne} ({} MB of weights): convert x {:.1} us",
        wb.len() >> 20,
        t_cvt * 1e3
    );
    for tile in [GemmTile::M64, GemmTile::M128, GemmTile::M128W] {
        let t = time_ms(d, reps, || {
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
            .unwrap()
        });
        line += &format!(
            "; {tile:?} {:.1} us = {:.1} TFLOP/s, {:.2} TB/s of weights",
            t * 1e3,
            flop / t / 1e9,
            wb.len() as f64 / t / 1e9
        );
        let got: Vec<f32> = get(d, yv, n_assign * rows);
        for _ in 0..16 {
            let asg = rng.random_range(0..n_assign);
            let e = ids[asg] as usize;
            let xr = if input == MoeInput::Gather {
                asg / k
            } else {
                asg
            };
            let wdeq: Vec<f32> = (0..rows)
                .flat_map(|r| w_row(ty, &wb, e, rows, cols, r))
                .collect();
            let want = reference(&wdeq, rows, cols, &x[xr * cols..(xr + 1) * cols]);
            check(
                &format!("timed moe_gemm {input:?} {tile:?} assignment {asg}"),
                ty,
                &got[asg * rows..(asg + 1) * rows],
                &want,
            );
        }
    }
    if input == MoeInput::Gather {
        let ub = fast_w(rng, ty, ne, rows, cols);
        let uv = put(d, &c2, &ub);
        let t = time_ms(d, reps, || {
            d.moe_gemm_converted(
                GemmTile::M64,
                AnyLoad::default(),
                wv,
                Some(uv),
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
            .unwrap()
        });
        line += &format!(
            "; fused gate+up (SwiGLU) {:.1} us = {:.1} TFLOP/s",
            t * 1e3,
            2.0 * flop / t / 1e9
        );
    }
    eprintln!("{line}");
}

/// The whole expert FFN of one layer of `ty` as the engine runs it (sort, fused gate + up,
/// down), timed.
fn time_moe_layer(t: Timing, rng: &mut StdRng, moe: MoeLayer, ty: GgmlType) {
    let Timing { d, a, n_tok, reps } = t;
    let MoeLayer {
        ne,
        k,
        ff,
        hid,
        iv,
        sorted,
        free_at,
        ..
    } = moe;
    let n_assign = n_tok * k;
    let c3 = Carve::new(a);
    c3.off.set(free_at);
    let wg = put(d, &c3, &fast_w(rng, ty, ne, ff, hid));
    let wu = put(d, &c3, &fast_w(rng, ty, ne, ff, hid));
    let wdn = put(d, &c3, &fast_w(rng, ty, ne, hid, ff));
    let xv = put(d, &c3, &rand_vec(rng, n_tok * hid, 1.0));
    let sv = c3.take(gemm_scratch_bytes(n_assign, hid.max(ff)));
    let hv = c3.take(4 * (n_assign * ff) as u64);
    let ov = c3.take(4 * (n_assign * hid) as u64);
    let t = time_ms(d, reps, || {
        d.moe_sort(iv, n_tok, k, ne, sorted).unwrap();
        let s1 = sv.sub(0, gemm_scratch_bytes(n_tok, hid)).unwrap();
        d.moe_gemm_glu(
            wg,
            wu,
            ty,
            ne,
            ff,
            hid,
            xv,
            MoeInput::Gather,
            n_tok,
            k,
            sorted,
            hv,
            s1,
        )
        .unwrap();
        let s2 = sv.sub(0, gemm_scratch_bytes(n_assign, ff)).unwrap();
        d.moe_gemm(
            wdn,
            ty,
            ne,
            hid,
            ff,
            hv,
            MoeInput::Direct,
            n_tok,
            k,
            sorted,
            ov,
            s2,
        )
        .unwrap();
    });
    let flop = 2.0 * 3.0 * (n_assign * ff * hid) as f64;
    eprintln!(
    "TIME MoE FFN layer (sort + fused gate/up + down, {MOE_DEFAULT_TILE:?}, {ty}) n_tok={n_tok}: {:.1} us = {:.1} TFLOP/s; x48 layers = {:.2} ms per {n_tok} tokens",
    t * 1e3,
    flop / t / 1e9,
    48.0 * t
);
}
