//! backend_ops: Qwen3-Next's ops (the query/gate split, the sigmoid output gate, the Gated
//! DeltaNet core over slots and passes, the shared expert), CPU against CUDA as in `main.rs`.

use super::*;

/// A one-layer Qwen3-Next (its one layer linear attention: interval 2) with these linear
/// heads, conv width and shared-expert width, over `hp`'s other dims.
fn next_hp(
    e: u64,
    n_head: u64,
    hd: u64,
    (nk, nv, dk, dv): (u64, u64, u64, u64),
    conv_k: u64,
    sh: u64,
) -> HParams {
    HParams {
        n_ff_shexp: sh,
        full_attention_interval: Some(2),
        ssm: Some(strata_schemas::inventory::SsmParams {
            conv_kernel: conv_k,
            state_size: dk,
            group_count: nk,
            time_step_rank: nv,
            inner_size: nv * dv,
        }),
        ..hp(e, n_head, 1, hd, 8, 2, 32)
    }
}

/// The two backends of a Qwen3-Next check: as [`backends`], the CPU stage with every slot's
/// linear state of the model's linear layers (the CUDA stage makes its own).
fn backends_next(dev: Arc<CudaDevice>, s: &Setup) -> (CpuStage<'static>, CudaStage) {
    use strata_exec::backend::cpu::linear_state::LinearState;
    let d = Dims::of(&s.hp);
    let lin = (0..s.hp.n_layer)
        .filter(|&l| s.hp.layer_kind(l) == strata_schemas::inventory::LayerKind::LinearAttention)
        .count();
    let (cpu, gpu) = backends(dev, s, KernelOptions::f32_products());
    (
        cpu.with_linear_state(LinearState::owned(&d, lin, s.slots)),
        gpu,
    )
}

/// The linear-attention op of `linear_attention_across_passes_and_slots`'s tensors on `b`.
fn lin_bind<B: Bind>(b: &mut B, d: &Dims) -> strata_exec::backend::LinearAttention<B::Vector>
where
    B::Error: std::fmt::Display,
{
    let nv = d.lin_v_heads;
    strata_exec::backend::LinearAttention {
        lin_layer: 0,
        qkv: WorkBuf::Qkv,
        z: WorkBuf::Z,
        ba: WorkBuf::Ba,
        conv: ok(b.table("c.weight", d.lin_qkv(), d.conv_k), "conv taps"),
        dt_bias: ok(b.vector("dt.bias", nv), "dt_bias"),
        ssm_a: ok(b.vector("a", nv), "ssm_a"),
        norm: ok(b.vector("norm.weight", d.lin_hv), "ssm_norm"),
        out: WorkBuf::Lin,
    }
}

/// Qwen3-Next's gated attention around the attention op: the query/gate split of `attn_q`'s
/// output (a copy: exact) and the sigmoid output gate (1e-6 of the RMS: `expf` against
/// Rust's `exp`), for odd head counts and dims, one and many tokens.
#[test]
fn query_gate_split_and_sigmoid_gate() {
    let Some(dev) = gpu("split_query_gate") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(21);
    for (n_head, hd) in [(4u64, 16u64), (3, 24), (5, 7)] {
        let s = Setup {
            hp: next_hp(64, n_head, hd, (2, 4, 16, 16), 4, 32),
            weights: MemWeights::new(),
            slots: 2,
            ctx: 64,
            kv: KvType::F16,
            tokens: 40,
        };
        let (mut cpu, mut gpu) = backends_next(dev.clone(), &s);
        let w = (n_head * hd) as usize;
        for n in [1usize, 7, 40] {
            let slots = vec![0u32; n];
            let pos: Vec<u32> = (0..n as u32).collect();
            let kind = if n == 1 {
                StepKind::Decode
            } else {
                StepKind::Prefill
            };
            inputs(&mut cpu, kind, &[], &slots, &pos);
            inputs(&mut gpu, kind, &[], &slots, &pos);
            let qg = rand_vec(&mut rng, n * 2 * w, 2.0);
            fill(&mut cpu, WorkBuf::Qg, &qg, 0);
            fill(&mut gpu, WorkBuf::Qg, &qg, 0);
            let tail = if n == 40 { 0 } else { TAIL };
            fill(&mut gpu, WorkBuf::Q, &vec![f32::NAN; n * w], tail);
            fill(&mut gpu, WorkBuf::Gate, &vec![f32::NAN; n * w], tail);
            ok(
                cpu.split_query_gate(WorkBuf::Qg, WorkBuf::Q, WorkBuf::Gate, n),
                "cpu",
            );
            ok(
                gpu.split_query_gate(WorkBuf::Qg, WorkBuf::Q, WorkBuf::Gate, n),
                "gpu",
            );
            for b in [WorkBuf::Q, WorkBuf::Gate] {
                let want = read(&mut cpu, b, n * w);
                let got = read(&mut gpu, b, n * w + tail);
                compare(
                    &format!("split {} heads {n_head}x{hd} n={n}", b.name()),
                    &got,
                    &want,
                    0.0,
                );
            }
            let x = rand_vec(&mut rng, n * w, 1.0);
            fill(&mut cpu, WorkBuf::Att, &x, 0);
            fill(&mut gpu, WorkBuf::Att, &x, tail);
            ok(cpu.sigmoid_gate(WorkBuf::Att, WorkBuf::Gate, n), "cpu");
            ok(gpu.sigmoid_gate(WorkBuf::Att, WorkBuf::Gate, n), "gpu");
            let want = read(&mut cpu, WorkBuf::Att, n * w);
            let got = read(&mut gpu, WorkBuf::Att, n * w + tail);
            compare(
                &format!("sigmoid_gate heads {n_head}x{hd} n={n}"),
                &got,
                &want,
                1e-6,
            );
        }
    }
    eprintln!("PASS split_query_gate (exact) and sigmoid_gate (1e-6) for 1, 7 and 40 tokens");
}

/// The Gated DeltaNet core (conv with each slot's conv state, gates, q/k l2-norm, the delta
/// rule over each slot's recurrent state, the gated norm) across passes that carry the state:
/// a 37-token prefill of slot 0, 5 more tokens of it, a 1-token prefill of slot 1, three decode
/// steps of both slots together, then slot 0 restarted at position 0 over its stale state.
/// Shapes: the tiny references' (16- and 12-wide heads, conv 4 and 3), Qwen3-Next-80B's
/// 128-wide heads, and odd ones (7-wide keys, 5-wide values, conv 2), with the conv taps F32
/// (read in place) or F16 (converted at binding). Tolerance 2e-4 of the RMS: the CPU runs
/// multi-token runs with the chunked rule (another summation order than the GPU's token by
/// token), and the gated norm divides by each head's RMS.
#[test]
fn linear_attention_across_passes_and_slots() {
    let Some(dev) = gpu("linear_attention") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(22);
    let mut worst = 0f64;
    for (heads, conv_k, e, taps) in [
        ((2u64, 4u64, 16u64, 16u64), 4u64, 64u64, GgmlType::F32),
        ((3, 6, 12, 12), 3, 48, GgmlType::F16),
        ((2, 4, 128, 128), 4, 256, GgmlType::F32),
        ((1, 3, 7, 5), 2, 32, GgmlType::F32),
    ] {
        let hp = next_hp(e, 4, 16, heads, conv_k, 32);
        let d = Dims::of(&hp);
        let (c, vd, nv) = (d.lin_qkv(), d.lin_v(), d.lin_v_heads);
        let mut w = MemWeights::new();
        let conv = rand_vec(&mut rng, c * conv_k as usize, 0.5);
        w.insert_f32("c.weight", &[conv_k, c as u64], &conv, taps)
            .unwrap();
        let dt = rand_vec(&mut rng, nv, 0.5);
        w.insert_f32("dt.bias", &[nv as u64], &dt, GgmlType::F32)
            .unwrap();
        let a: Vec<f32> = rand_vec(&mut rng, nv, 0.5)
            .iter()
            .map(|x| x - 1.0)
            .collect();
        w.insert_f32("a", &[nv as u64], &a, GgmlType::F32).unwrap();
        put_norm(&mut w, &mut rng, "norm.weight", d.lin_hv);
        let s = Setup {
            hp,
            weights: w,
            slots: 2,
            ctx: 64,
            kv: KvType::F16,
            tokens: 48,
        };
        let (mut cpu, mut gpu) = backends_next(dev.clone(), &s);
        let la_c = lin_bind(&mut cpu, &d);
        let la_g = lin_bind(&mut gpu, &d);
        let passes: Vec<(StepKind, Vec<u32>, Vec<u32>)> = vec![
            (StepKind::Prefill, vec![0; 37], (0..37).collect()),
            (StepKind::Prefill, vec![0; 5], (37..42).collect()),
            (StepKind::Prefill, vec![1], vec![0]),
            (StepKind::Decode, vec![0, 1], vec![42, 1]),
            (StepKind::Decode, vec![1, 0], vec![2, 43]),
            (StepKind::Decode, vec![0, 1], vec![44, 3]),
            (StepKind::Prefill, vec![0; 9], (0..9).collect()),
        ];
        for (i, (kind, slots, pos)) in passes.iter().enumerate() {
            let n = slots.len();
            inputs(&mut cpu, *kind, &[], slots, pos);
            inputs(&mut gpu, *kind, &[], slots, pos);
            for (b, width, scale) in [
                (WorkBuf::Qkv, c, 1.0),
                (WorkBuf::Z, vd, 1.0),
                (WorkBuf::Ba, 2 * nv, 2.0),
            ] {
                let v = rand_vec(&mut rng, n * width, scale);
                fill(&mut cpu, b, &v, 0);
                fill(&mut gpu, b, &v, 0);
            }
            fill(&mut gpu, WorkBuf::Lin, &vec![f32::NAN; n * vd], TAIL);
            ok(cpu.linear_attention(&la_c, n), "cpu");
            ok(gpu.linear_attention(&la_g, n), "gpu");
            let want = read(&mut cpu, WorkBuf::Lin, n * vd);
            let got = read(&mut gpu, WorkBuf::Lin, n * vd + TAIL);
            worst = worst.max(compare(
                &format!(
                    "linear_attention heads {heads:?} conv {conv_k} taps {taps} pass {i} ({kind:?}, {n} tokens)"
                ),
                &got,
                &want,
                2e-4,
            ));
        }
    }
    eprintln!("PASS linear_attention: 7 passes over 2 slots, 4 shapes, worst {worst:.2e} of the RMS (tol 2e-4)");
}

/// The shared expert (`y += sigmoid(gate_inp . xn) * down(silu(gate xn) * up xn)`) on F32,
/// Q8_0 and Q4_K weights, one and many tokens: 1e-4 of the RMS where every product is f32
/// (the few-token kernels), 1e-2 on the tensor-core prefill (two chained products of f16
/// inputs, 4e-3 each as in `products_every_type_one_and_many_tokens`).
#[test]
fn shared_expert_every_path() {
    let Some(dev) = gpu("shared_expert") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(23);
    for (ty, e, sh) in [
        (GgmlType::F32, 64usize, 40usize),
        (GgmlType::Q8_0, 64, 96),
        (GgmlType::Q4K, 256, 256),
    ] {
        let mut w = MemWeights::new();
        put_mat(&mut w, &mut rng, "g.weight", ty, sh, e, 0.3);
        put_mat(&mut w, &mut rng, "u.weight", ty, sh, e, 0.3);
        put_mat(&mut w, &mut rng, "d.weight", ty, e, sh, 0.3);
        let gi = rand_vec(&mut rng, e, 0.3);
        w.insert_f32("gi.weight", &[e as u64], &gi, GgmlType::F32)
            .unwrap();
        let s = Setup {
            hp: next_hp(e as u64, 4, 16, (2, 4, 16, 16), 4, sh as u64),
            weights: w,
            slots: 2,
            ctx: 64,
            kv: KvType::F16,
            tokens: 48,
        };
        let (mut cpu, mut gpu) = backends_next(dev.clone(), &s);
        let sc = strata_exec::backend::SharedFfn {
            gate_inp: ok(cpu.vector("gi.weight", e), "cpu"),
            gate: ok(cpu.matrix("g.weight", sh, e), "cpu"),
            up: ok(cpu.matrix("u.weight", sh, e), "cpu"),
            down: ok(cpu.matrix("d.weight", e, sh), "cpu"),
        };
        let sg = strata_exec::backend::SharedFfn {
            gate_inp: ok(gpu.vector("gi.weight", e), "gpu"),
            gate: ok(gpu.matrix("g.weight", sh, e), "gpu"),
            up: ok(gpu.matrix("u.weight", sh, e), "gpu"),
            down: ok(gpu.matrix("d.weight", e, sh), "gpu"),
        };
        for (kind, n) in [
            (StepKind::Decode, 1usize),
            (StepKind::Decode, 2),
            (StepKind::Prefill, 5),
            (StepKind::Prefill, 16),
            (StepKind::Prefill, 41),
        ] {
            let tol = if kind == StepKind::Prefill && n >= 16 && tensor_core(ty) {
                1e-2
            } else {
                1e-4
            };
            let slots: Vec<u32> = (0..n as u32).map(|i| i % 2).collect();
            let pos: Vec<u32> = (0..n as u32).map(|i| i / 2).collect();
            inputs(&mut cpu, kind, &[], &slots, &pos);
            inputs(&mut gpu, kind, &[], &slots, &pos);
            let x = rand_vec(&mut rng, n * e, 1.0);
            let y0 = rand_vec(&mut rng, n * e, 1.0);
            fill(&mut cpu, WorkBuf::Xn, &x, 0);
            fill(&mut gpu, WorkBuf::Xn, &x, 0);
            fill(&mut cpu, WorkBuf::X, &y0, 0);
            fill(&mut gpu, WorkBuf::X, &y0, TAIL);
            ok(cpu.shared_expert(&sc, WorkBuf::Xn, WorkBuf::X, n), "cpu");
            ok(gpu.shared_expert(&sg, WorkBuf::Xn, WorkBuf::X, n), "gpu");
            let want: Vec<f32> = read(&mut cpu, WorkBuf::X, n * e)
                .iter()
                .zip(&y0)
                .map(|(a, b)| a - b)
                .collect();
            let mut got = read(&mut gpu, WorkBuf::X, n * e + TAIL);
            for (g, b) in got.iter_mut().zip(&y0) {
                *g -= b;
            }
            compare(
                &format!("shared_expert {ty} {e}x{sh} {kind:?} n={n}"),
                &got,
                &want,
                tol,
            );
        }
        eprintln!("PASS shared_expert {ty} {e}x{sh}: decode 1-2 tokens, prefill 5/16/41");
    }
}
