//! The any-type products' two weight loaders (`gemm::AnyLoad`): the synchronous default and the
//! pipelined `any-pipelined`, for the four types the pipelined one covers (IQ3_S, Q6_K, Q5_K,
//! IQ4_XS). Each loader against the CPU reference (`quant::dequantize_row`, f64 sums) at odd
//! shapes and at Qwen3-Next-80B-A3B's few-tokens-per-expert shape (512 experts, top-10), the
//! dense products in every tile and the grouped ones as the engine runs them (fused gate + up,
//! then down; strided stacks and an expert table), and the two loaders bit for bit equal (they
//! store the same f16 weights and run the same mmas). Then both timed at the 80B's expert
//! shapes at pp512, for the A/B that decides whether the pipelined loader stays.
//! Invariant: GPU only; without a device each test prints `SKIP (no CUDA device): ...` and
//! returns (`super::dev`). Written on a machine without a GPU: not yet run.
//! Tolerances: the weights are decoded exactly in f32 and rounded once to f16, as Q8_0's are,
//! so `super::unit`'s Q8_0 bound applies.

use super::cuda_common::{get, put, rand_vec, Carve};
use super::timings::time_ms;
use super::{check, dev, reference, unit, GUARD};
use rand::{rngs::StdRng, Rng, SeedableRng};
use rayon::prelude::*;
use strata_exec::backend::cuda::gemm::{
    any_load_pipelined, gemm_scratch_bytes, moe_scratch_bytes, AnyLoad, ExpertSource, GemmTile,
    MoeInput, MOE_DEFAULT_TILE,
};
use strata_exec::backend::cuda::{CudaDevice, DeviceView};
use strata_exec::quant;
use strata_schemas::ggml::GgmlType;

/// The types the pipelined loader covers.
const TYPES: [GgmlType; 4] = [
    GgmlType::Iq3S,
    GgmlType::Q6K,
    GgmlType::Q5K,
    GgmlType::Iq4Xs,
];
const LOADS: [AnyLoad; 2] = [AnyLoad::Pipelined, AnyLoad::Sync];

/// One reference output: (sum, sqrt(sum (w x)^2), sum |w x|), as `super::reference` gives.
type Ref = (f64, f64, f64);

/// Random GGUF bytes of `ty` (one of [`TYPES`], 256-value blocks) for `mats` matrices of
/// `rows × cols`: every bit pattern is a valid encoding but the f16 block scales, which are
/// set to small normal values. Fast enough for hundreds of MB.
fn any_bytes(rng: &mut StdRng, ty: GgmlType, mats: usize, rows: usize, cols: usize) -> Vec<u8> {
    let bb = quant::row_bytes(ty, 256).unwrap();
    let mut b = vec![0u8; mats * rows * (cols / 256) * bb];
    rng.fill(&mut b[..]);
    let f16 = |lo: f32, hi: f32, r: u8| {
        half::f16::from_f32(lo + (hi - lo) * (r as f32 / 255.0))
            .to_bits()
            .to_le_bytes()
    };
    for blk in b.chunks_exact_mut(bb) {
        let (r, r2) = (blk[bb - 1] ^ blk[5], blk[7]);
        match ty {
            GgmlType::Q6K => blk[208..210].copy_from_slice(&f16(0.0005, 0.002, r)),
            GgmlType::Q5K => {
                blk[0..2].copy_from_slice(&f16(0.0005, 0.002, r));
                blk[2..4].copy_from_slice(&f16(0.001, 0.01, r2));
            }
            _ => blk[0..2].copy_from_slice(&f16(0.0005, 0.002, r)),
        }
    }
    b
}

/// The dequantized `rows × cols` matrix `m` of [`any_bytes`] bytes.
fn deq_matrix(ty: GgmlType, b: &[u8], m: usize, rows: usize, cols: usize) -> Vec<f32> {
    let rb = quant::row_bytes(ty, cols).unwrap();
    let mut out = vec![0f32; rows * cols];
    out.par_chunks_mut(cols).enumerate().for_each(|(r, o)| {
        let at = (m * rows + r) * rb;
        quant::dequantize_row(ty, &b[at..at + rb], o).unwrap();
    });
    out
}

/// Reference rows of a grouped product, by assignment: assignment `a` (expert `ids[a]`) times
/// x row `xrow(a)`; each used expert dequantized once.
fn moe_reference(
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    ids: &[i32],
    x: &[f32],
    xrow: impl Fn(usize) -> usize + Sync,
) -> Vec<Ref> {
    let ne = w.len() / (rows * quant::row_bytes(ty, cols).unwrap());
    let parts: Vec<(usize, Vec<Ref>)> = (0..ne)
        .into_par_iter()
        .flat_map_iter(|e| {
            let asg: Vec<usize> = (0..ids.len()).filter(|&a| ids[a] as usize == e).collect();
            let deq = if asg.is_empty() {
                Vec::new()
            } else {
                deq_matrix(ty, w, e, rows, cols)
            };
            asg.into_iter()
                .map(|a| {
                    let xr = xrow(a);
                    (
                        a,
                        reference(&deq, rows, cols, &x[xr * cols..(xr + 1) * cols]),
                    )
                })
                .collect::<Vec<_>>()
        })
        .collect();
    let mut out = vec![(0f64, 0f64, 0f64); ids.len() * rows];
    for (a, r) in parts {
        out[a * rows..(a + 1) * rows].copy_from_slice(&r);
    }
    out
}

/// Checks fused gate + up outputs `got` (silu(g) * u) against the gate and up references.
fn check_glu(what: &str, ty: GgmlType, got: &[f32], g: &[Ref], u: &[Ref]) {
    let (un, m) = unit(ty);
    for (i, (o, (&(gv, g2, ga), &(uv, u2, ua)))) in got.iter().zip(g.iter().zip(u)).enumerate() {
        let sg = gv / (1.0 + (-gv).exp());
        let h = sg * uv;
        let (tg, tu) = (
            m * un * g2 + 1e-6 * ga + 1e-6,
            m * un * u2 + 1e-6 * ua + 1e-6,
        );
        let tol = 1.1 * (uv.abs() + tu) * tg + sg.abs() * tu + 1e-6 * h.abs();
        let o = *o as f64;
        assert!(
            o.is_finite() && (o - h).abs() <= tol,
            "{what}: element {i}: got {o}, want {h} (tol {tol:.3e})"
        );
    }
}

/// Bit-for-bit equality of two outputs.
fn assert_same(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let diff = a
        .iter()
        .zip(b)
        .filter(|(p, q)| p.to_bits() != q.to_bits())
        .count();
    assert_eq!(diff, 0, "{what}: {diff} of {} outputs differ", a.len());
}

/// A view of `n` f32 followed by 64 guard floats: (the whole, the first n).
fn guarded<'a>(d: &CudaDevice, c: &Carve<'a>, n: usize) -> (DeviceView<'a>, DeviceView<'a>) {
    let all = put(d, c, &vec![GUARD; n + 64]);
    (all, all.sub(0, 4 * n as u64).unwrap())
}

/// The first n values of a guarded view, after checking nothing was written past them.
fn read_guarded(d: &CudaDevice, what: &str, all: DeviceView<'_>, n: usize) -> Vec<f32> {
    let got: Vec<f32> = get(d, all, n + 64);
    assert!(got[n..].iter().all(|v| *v == GUARD), "{what}: wrote past y");
    got[..n].to_vec()
}

#[test]
fn any_type_dense_products_on_both_loaders_match_cpu_and_each_other() {
    let Some(d) = dev("any_load dense") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(41);
    let a = d.alloc_arena("gemm-any-dense", 256 << 20).unwrap();
    // Rows off the 64/128 tiles, one to nine blocks a row (odd counts: the 2-byte aligned
    // IQ3_S and Q6_K blocks at both word alignments), and the 80B's shared expert.
    let shapes = [
        (1usize, 256usize),
        (33, 512),
        (129, 768),
        (257, 256),
        (100, 2304),
        (512, 2048),
    ];
    for ty in TYPES {
        let mut worst = 0f64;
        let mut n_cmp = 0;
        for (rows, cols) in shapes {
            let wb = any_bytes(&mut rng, ty, 1, rows, cols);
            let deq = deq_matrix(ty, &wb, 0, rows, cols);
            for n_tok in [1usize, 7, 33, 65] {
                let c = Carve::new(&a);
                let x = rand_vec(&mut rng, n_tok * cols, 1.0);
                let want = reference(&deq, rows, cols, &x);
                let (wv, xv) = (put(d, &c, &wb), put(d, &c, &x));
                let sv = c.take(gemm_scratch_bytes(n_tok, cols));
                let ny = n_tok * rows;
                let (yall, yv) = guarded(d, &c, ny);
                d.gemm_convert_x(xv, n_tok, cols, ty, sv).unwrap();
                for tile in [GemmTile::M64, GemmTile::M128, GemmTile::M128W] {
                    for kparts in [1usize, 2] {
                        let mut outs = Vec::new();
                        for load in LOADS {
                            d.memset(yv, 0xff).unwrap();
                            d.gemm_converted_kparts(
                                tile, load, kparts, wv, ty, rows, cols, sv, n_tok, yv, false,
                            )
                            .unwrap();
                            let what = format!("gemm {ty} {load:?} rows={rows} cols={cols} n_tok={n_tok} tile={tile:?} kparts={kparts}");
                            let got = read_guarded(d, &what, yall, ny);
                            worst = worst.max(check(&what, ty, &got, &want));
                            outs.push(got);
                        }
                        let what = format!(
                            "gemm {ty} rows={rows} cols={cols} n_tok={n_tok} tile={tile:?} kparts={kparts}: pipelined vs synchronous"
                        );
                        assert_same(&what, &outs[0], &outs[1]);
                        n_cmp += 1;
                    }
                }
            }
        }
        assert!(any_load_pipelined(
            AnyLoad::Pipelined,
            ty,
            false,
            false,
            GemmTile::M64
        ));
        eprintln!(
            "PASS gemm {ty} on both loaders: {n_cmp} products bit-equal between them, max err = {worst:.2} u*sqrt(sum (wx)^2) (tol {})",
            unit(ty).1
        );
    }
}

/// One grouped case: `ne` experts of gate and up `gu` (rows, cols) and down `dn`, `n_tok`
/// tokens picking `k` distinct experts each among the first `used` (the rest stay empty).
/// Every expert matrix must be a multiple of 16 bytes (rows x blocks a row a multiple of 8
/// for IQ3_S and Q6_K).
#[derive(Clone, Copy, Debug)]
struct MoeShape {
    ne: usize,
    used: usize,
    gu: (usize, usize),
    dn: (usize, usize),
    n_tok: usize,
    k: usize,
}

/// Each token's `k` distinct picks among experts `0..used`.
fn picks(rng: &mut StdRng, n_tok: usize, k: usize, used: usize) -> Vec<i32> {
    (0..n_tok)
        .flat_map(|_| {
            let mut ch: Vec<i32> = Vec::new();
            while ch.len() < k {
                let e = rng.random_range(0..used as i32);
                if !ch.contains(&e) {
                    ch.push(e);
                }
            }
            ch
        })
        .collect()
}

/// The fused gate + up (gathered x) and the down product (direct x) of one case, as the
/// engine launches them, on both loaders from the strided stacks and on the pipelined loader
/// through an expert table: all bit-equal, and the pipelined's within the CPU reference's
/// bounds.
fn moe_any_case(
    d: &CudaDevice,
    a: &strata_exec::backend::cuda::DeviceArena,
    rng: &mut StdRng,
    ty: GgmlType,
    s: MoeShape,
) {
    let MoeShape {
        ne,
        used,
        gu: (f, e),
        dn: (dr, dc),
        n_tok,
        k,
    } = s;
    let n_assign = n_tok * k;
    let gb = any_bytes(rng, ty, ne, f, e);
    let ub = any_bytes(rng, ty, ne, f, e);
    let db = any_bytes(rng, ty, ne, dr, dc);
    let ids = picks(rng, n_tok, k, used);
    let x = rand_vec(rng, n_tok * e, 1.0);
    let x2 = rand_vec(rng, n_assign * dc, 1.0);
    let c = Carve::new(a);
    let (gv, uv, dv) = (put(d, &c, &gb), put(d, &c, &ub), put(d, &c, &db));
    let (gm, dm) = ((gb.len() / ne) as u64, (db.len() / ne) as u64);
    let table: Vec<u64> = (0..ne as u64)
        .flat_map(|i| [gv.ptr() + i * gm, uv.ptr() + i * gm, dv.ptr() + i * dm])
        .collect();
    let tv = put(d, &c, &table);
    let (xv, x2v, iv) = (put(d, &c, &x), put(d, &c, &x2), put(d, &c, &ids));
    let sorted = c.take(moe_scratch_bytes(n_tok, k, ne));
    let s1 = c.take(gemm_scratch_bytes(n_tok, e));
    let s2 = c.take(gemm_scratch_bytes(n_assign, dc));
    d.moe_sort(iv, n_tok, k, ne, sorted).unwrap();
    d.gemm_convert_x(xv, n_tok, e, ty, s1).unwrap();
    d.gemm_convert_x(x2v, n_assign, dc, ty, s2).unwrap();
    let strided = |w, wu| ExpertSource::Strided { w, wu, stride: 0 };
    let tabled = |col, fused_up| ExpertSource::Table {
        table: tv,
        col,
        fused_up,
    };
    // (loader, gate-up source, down source): the stacks on both loaders, then the table.
    let runs = [
        (AnyLoad::Pipelined, strided(gv, Some(uv)), strided(dv, None)),
        (AnyLoad::Sync, strided(gv, Some(uv)), strided(dv, None)),
        (AnyLoad::Pipelined, tabled(0, true), tabled(2, false)),
    ];
    let mut hs: Vec<Vec<f32>> = Vec::new();
    let mut os: Vec<Vec<f32>> = Vec::new();
    for (i, (load, gu, dn)) in runs.into_iter().enumerate() {
        let what = format!("moe {ty} {s:?} run {i} ({load:?})");
        let (hall, hv) = guarded(d, &c, n_assign * f);
        let (oall, ov) = guarded(d, &c, n_assign * dr);
        d.moe_gemm_from(
            GemmTile::M64,
            load,
            gu,
            ty,
            ne,
            f,
            e,
            s1,
            MoeInput::Gather,
            n_tok,
            k,
            sorted,
            hv,
        )
        .unwrap();
        d.moe_gemm_from(
            MOE_DEFAULT_TILE,
            load,
            dn,
            ty,
            ne,
            dr,
            dc,
            s2,
            MoeInput::Direct,
            n_tok,
            k,
            sorted,
            ov,
        )
        .unwrap();
        hs.push(read_guarded(
            d,
            &format!("{what} gate-up"),
            hall,
            n_assign * f,
        ));
        os.push(read_guarded(
            d,
            &format!("{what} down"),
            oall,
            n_assign * dr,
        ));
    }
    for i in 1..runs.len() {
        let what = format!("moe {ty} {s:?}: run {i} against run 0 (pipelined, stacks)");
        assert_same(&format!("{what}, gate-up"), &hs[0], &hs[i]);
        assert_same(&format!("{what}, down"), &os[0], &os[i]);
    }
    let g = moe_reference(ty, &gb, f, e, &ids, &x, |a| a / k);
    let u = moe_reference(ty, &ub, f, e, &ids, &x, |a| a / k);
    check_glu(&format!("moe {ty} {s:?} gate-up"), ty, &hs[0], &g, &u);
    let want = moe_reference(ty, &db, dr, dc, &ids, &x2, |a| a);
    check(&format!("moe {ty} {s:?} down"), ty, &os[0], &want);
}

#[test]
fn any_type_expert_products_on_both_loaders_match_cpu_and_each_other() {
    let Some(d) = dev("any_load moe") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(43);
    let a = d.alloc_arena("gemm-any-moe", 2 << 30).unwrap();
    let shapes = [
        // Rows off the 64/128 tiles (200, 328), odd and even block counts, an empty expert.
        MoeShape {
            ne: 5,
            used: 4,
            gu: (200, 768),
            dn: (328, 512),
            n_tok: 37,
            k: 3,
        },
        // More than one 64-token tile for some experts; one-block rows.
        MoeShape {
            ne: 3,
            used: 3,
            gu: (72, 256),
            dn: (136, 1280),
            n_tok: 150,
            k: 2,
        },
        // Qwen3-Next-80B-A3B's experts at 64 tokens: 1.25 tokens an expert.
        MoeShape {
            ne: 512,
            used: 512,
            gu: (512, 2048),
            dn: (2048, 512),
            n_tok: 64,
            k: 10,
        },
    ];
    for ty in TYPES {
        for s in shapes {
            moe_any_case(d, &a, &mut rng, ty, s);
        }
        assert!(any_load_pipelined(
            AnyLoad::Pipelined,
            ty,
            true,
            true,
            GemmTile::M64
        ));
        assert!(!any_load_pipelined(
            AnyLoad::Sync,
            ty,
            true,
            true,
            GemmTile::M64
        ));
        eprintln!(
            "PASS moe {ty} on both loaders and through a table: fused gate-up and down bit-equal, within the CPU reference's bounds, shapes {shapes:?}"
        );
    }
}

/// Both loaders timed at Qwen3-Next-80B-A3B's expert shapes at pp512 (512 experts, top-10,
/// gate/up 512 x 2048 fused, down 2048 x 512) and its shared expert's dense products; prints
/// only (and checks the loaders agree bit for bit). IQ3_S first: the 80B file's type.
#[test]
fn any_load_timings_at_qwen3_next_80b_expert_shapes() {
    let Some(d) = dev("any_load timings") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(47);
    let a = d.alloc_arena("gemm-any-bench", 3 << 30).unwrap();
    let (ne, k, ff, hid, n_tok, reps) = (512usize, 10usize, 512usize, 2048usize, 512usize, 10);
    let n_assign = n_tok * k;
    let ids = picks(&mut rng, n_tok, k, ne);
    for ty in TYPES {
        let c = Carve::new(&a);
        let gv = put(d, &c, &any_bytes(&mut rng, ty, ne, ff, hid));
        let uv = put(d, &c, &any_bytes(&mut rng, ty, ne, ff, hid));
        let dv = put(d, &c, &any_bytes(&mut rng, ty, ne, hid, ff));
        let xv = put(d, &c, &rand_vec(&mut rng, n_tok * hid, 1.0));
        let iv = put(d, &c, &ids);
        let sorted = c.take(moe_scratch_bytes(n_tok, k, ne));
        let s1 = c.take(gemm_scratch_bytes(n_tok, hid));
        let s2 = c.take(gemm_scratch_bytes(n_assign, ff));
        let hv = c.take(4 * (n_assign * ff) as u64);
        let ov = c.take(4 * (n_assign * hid) as u64);
        d.moe_sort(iv, n_tok, k, ne, sorted).unwrap();
        d.gemm_convert_x(xv, n_tok, hid, ty, s1).unwrap();
        let glu = |load| {
            let src = ExpertSource::Strided {
                w: gv,
                wu: Some(uv),
                stride: 0,
            };
            d.moe_gemm_from(
                GemmTile::M64,
                load,
                src,
                ty,
                ne,
                ff,
                hid,
                s1,
                MoeInput::Gather,
                n_tok,
                k,
                sorted,
                hv,
            )
            .unwrap()
        };
        let down = |load| {
            let src = ExpertSource::Strided {
                w: dv,
                wu: None,
                stride: 0,
            };
            d.moe_gemm_from(
                MOE_DEFAULT_TILE,
                load,
                src,
                ty,
                ne,
                hid,
                ff,
                s2,
                MoeInput::Direct,
                n_tok,
                k,
                sorted,
                ov,
            )
            .unwrap()
        };
        let mut line = format!(
            "TIME any-load {ty} experts={ne} k={k} gate/up {ff}x{hid} down {hid}x{ff} n_tok={n_tok}:"
        );
        let mut outs = Vec::new();
        let mut per = Vec::new();
        for load in LOADS {
            glu(load);
            d.gemm_convert_x(hv, n_assign, ff, ty, s2).unwrap();
            down(load);
            let h: Vec<f32> = get(d, hv, n_assign * ff);
            let o: Vec<f32> = get(d, ov, n_assign * hid);
            outs.push((h, o));
            let tg = time_ms(d, reps, || glu(load));
            let td = time_ms(d, reps, || down(load));
            per.push((tg, td));
            line += &format!(
                " {load:?} gate-up {:.1} us, down {:.1} us, sum {:.1} us;",
                tg * 1e3,
                td * 1e3,
                (tg + td) * 1e3
            );
        }
        let ((pg, pd), (sg, sd)) = (per[0], per[1]);
        line += &format!(
            " pipelined/sync: gate-up x{:.2}, down x{:.2}, both x{:.2}",
            sg / pg,
            sd / pd,
            (sg + sd) / (pg + pd)
        );
        eprintln!("{line}");
        assert_same(&format!("timed {ty} gate-up"), &outs[0].0, &outs[1].0);
        assert_same(&format!("timed {ty} down"), &outs[0].1, &outs[1].1);
        // The shared expert (dense, 512 tokens): gate/up 512 x 2048, down 2048 x 512.
        for (rows, cols) in [(ff, hid), (hid, ff)] {
            let c2 = Carve::new(&a);
            c2.off.set(c.off.get());
            let wv = put(d, &c2, &any_bytes(&mut rng, ty, 1, rows, cols));
            let xv = put(d, &c2, &rand_vec(&mut rng, n_tok * cols, 1.0));
            let sv = c2.take(gemm_scratch_bytes(n_tok, cols));
            let yv = c2.take(4 * (n_tok * rows) as u64);
            d.gemm_convert_x(xv, n_tok, cols, ty, sv).unwrap();
            let tile = d.gemm_default_tile(ty, rows, n_tok);
            let mut line =
                format!("TIME any-load {ty} dense {rows}x{cols} n_tok={n_tok} tile={tile:?}:");
            let mut ts = Vec::new();
            for load in LOADS {
                let t = time_ms(d, reps, || {
                    d.gemm_converted(tile, load, wv, ty, rows, cols, sv, n_tok, yv, false)
                        .unwrap()
                });
                ts.push(t);
                line += &format!(" {load:?} {:.1} us;", t * 1e3);
            }
            eprintln!("{line} pipelined/sync x{:.2}", ts[1] / ts[0]);
        }
    }
}
