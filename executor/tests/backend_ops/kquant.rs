//! backend_ops: the K-quant decode kernels (`*_kq`) at the shapes they are for, CPU against
//! CUDA as in `main.rs`.

use super::*;

/// The K-quant decode kernels (`dq_mv1_kq` / `dq_mv8_kq`) on a matrix tall enough for the
/// one-token product to cap its grid, so each warp walks many rows and (with staged inputs)
/// the block reads its input from shared memory: an LM head's shape, narrowed. Odd rows, 1
/// to 9 tokens (9: two chunks of `dq_mv8_kq`), every launch variant, Q4_K beside them.
#[test]
fn kquant_products_tall_matrix_capped_grid() {
    let Some(dev) = gpu("kquant_tall") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(8);
    // Enough rows for the capped grid on a GPU of up to 256 SMs (4 blocks an SM, 8 rows a
    // warp, 4 warps a block).
    let (rows, cols) = (256 * 128 + 7, 512usize);
    for ty in [GgmlType::Q6K, GgmlType::Q5K, GgmlType::Q4K] {
        let mut w = MemWeights::new();
        put_mat(&mut w, &mut rng, "head.weight", ty, rows, cols, 0.3);
        // The logits buffer holds the product: a vocabulary of `rows`, a row a slot (one
        // more than the widest pass, for the NaN tail).
        let mut h = hp(cols as u64, 4, 2, (cols / 4) as u64, 8, 2, 32);
        h.n_vocab = rows as u64;
        let s = Setup {
            hp: h,
            weights: w,
            slots: 10,
            ctx: 64,
            kv: KvType::F16,
            tokens: 10,
        };
        for (vname, kernels) in variants() {
            let (mut cpu, mut gpu) = backends(dev.clone(), &s, kernels);
            let (hc, hg) = (
                ok(cpu.matrix("head.weight", rows, cols), "cpu"),
                ok(gpu.matrix("head.weight", rows, cols), "gpu"),
            );
            for n in [1usize, 2, 8, 9] {
                let slots: Vec<u32> = (0..n as u32).collect();
                inputs(&mut cpu, StepKind::Decode, &[], &slots, &vec![0; n]);
                inputs(&mut gpu, StepKind::Decode, &[], &slots, &vec![0; n]);
                let x = rand_vec(&mut rng, n * cols, 1.0);
                fill(&mut cpu, WorkBuf::Xn, &x, 0);
                fill(&mut gpu, WorkBuf::Xn, &x, 0);
                fill(&mut gpu, WorkBuf::Logits, &vec![f32::NAN; n * rows], TAIL);
                ok(cpu.project(WorkBuf::Xn, &[(hc, WorkBuf::Logits)], n), "cpu");
                ok(gpu.project(WorkBuf::Xn, &[(hg, WorkBuf::Logits)], n), "gpu");
                let want = read(&mut cpu, WorkBuf::Logits, n * rows);
                let got = read(&mut gpu, WorkBuf::Logits, n * rows + TAIL);
                compare(
                    &format!("tall {ty} {rows}x{cols} n={n} {vname}"),
                    &got,
                    &want,
                    2e-5,
                );
            }
        }
        eprintln!("PASS kquant tall {ty} {rows}x{cols}: 1, 2, 8 and 9 tokens");
    }
}

/// The K-quant expert kernels at a Qwen3-30B-A3B-like width (down rows of 3 super-blocks, top-8
/// of 16 experts): gate, up and down each of its own K-quant (Q4_K_M's Q4_K gate/up with Q6_K
/// down, and the other mixes `dq_moe_gate_up_kq` / `dq_moe_down_kq` take), decode passes of 1
/// to 3 tokens, every launch variant.
#[test]
fn kquant_experts_mixed_types_decode() {
    let Some(dev) = gpu("kquant_experts") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(9);
    use GgmlType::{Q4K, Q5K, Q6K};
    let (e, f, ne, k) = (512usize, 768usize, 16usize, 8usize);
    for (ty_g, ty_u, ty_d) in [
        (Q4K, Q4K, Q6K),
        (Q4K, Q4K, Q4K),
        (Q6K, Q6K, Q6K),
        (Q5K, Q5K, Q5K),
        (Q4K, Q6K, Q5K),
        (Q6K, Q5K, Q4K),
    ] {
        let mut w = MemWeights::new();
        for (name, ty, rows, cols) in [
            ("blk.0.ffn_gate_exps.weight", ty_g, f, e),
            ("blk.0.ffn_up_exps.weight", ty_u, f, e),
            ("blk.0.ffn_down_exps.weight", ty_d, e, f),
        ] {
            put_tensor(
                &mut w,
                &mut rng,
                name,
                ty,
                &[cols as u64, rows as u64, ne as u64],
                0.3,
            );
        }
        let s = Setup {
            hp: hp(
                e as u64,
                4,
                2,
                (e / 4) as u64,
                ne as u64,
                k as u64,
                f as u64,
            ),
            weights: w,
            slots: 4,
            ctx: 64,
            kv: KvType::F16,
            // One more than the widest pass: room for the NaN tail past the outputs.
            tokens: 4,
        };
        for (vname, kernels) in variants() {
            let (mut cpu, mut gpu) = backends(dev.clone(), &s, kernels);
            let xc = ok(cpu.experts_of(0), "cpu");
            let xg = ok(gpu.experts_of(0), "gpu");
            for n in [1usize, 2, 3] {
                let what =
                    format!("experts gate {ty_g} up {ty_u} down {ty_d} e={e} f={f} n={n} {vname}");
                let slots: Vec<u32> = (0..n as u32).collect();
                inputs(&mut cpu, StepKind::Decode, &[], &slots, &vec![0; n]);
                inputs(&mut gpu, StepKind::Decode, &[], &slots, &vec![0; n]);
                let mut ids = Vec::with_capacity(n * k);
                let mut wts = Vec::with_capacity(n * k);
                for _ in 0..n {
                    let mut pick: Vec<u32> = Vec::new();
                    while pick.len() < k {
                        let c = rng.random_range(0..ne as u32);
                        if !pick.contains(&c) {
                            pick.push(c);
                        }
                    }
                    let raw: Vec<f32> = (0..k).map(|_| 0.1 + rng.random::<f32>()).collect();
                    let sum: f32 = raw.iter().sum();
                    ids.extend(pick.iter().map(|c| f32::from_bits(*c)));
                    wts.extend(raw.iter().map(|r| r / sum));
                }
                let xn = rand_vec(&mut rng, n * e, 1.0);
                let y0 = rand_vec(&mut rng, n * e, 1.0);
                for (b, v) in [
                    (WorkBuf::Ids, &ids),
                    (WorkBuf::Wts, &wts),
                    (WorkBuf::Xn, &xn),
                ] {
                    fill(&mut cpu, b, v, 0);
                    fill(&mut gpu, b, v, 0);
                }
                fill(&mut cpu, WorkBuf::X, &y0, 0);
                fill(&mut gpu, WorkBuf::X, &y0, TAIL);
                let (i, wt, x) = (WorkBuf::Ids, WorkBuf::Wts, WorkBuf::X);
                ok(cpu.experts(0, &xc, WorkBuf::Xn, i, wt, x, n), "cpu");
                ok(gpu.experts(0, &xg, WorkBuf::Xn, i, wt, x, n), "gpu");
                let want: Vec<f32> = read(&mut cpu, WorkBuf::X, n * e)
                    .iter()
                    .zip(&y0)
                    .map(|(a, b)| a - b)
                    .collect();
                let mut got = read(&mut gpu, WorkBuf::X, n * e + TAIL);
                for (g, b) in got.iter_mut().zip(&y0) {
                    *g -= b;
                }
                compare(&what, &got, &want, 2e-5);
            }
        }
        eprintln!("PASS kquant experts gate {ty_g} up {ty_u} down {ty_d}: decode 1-3 tokens");
    }
}
