//! Row processing applied on the device before the pick (`pick::RowProc`: grammar mask,
//! `logit_bias` and penalty edits, `min_p`) against the host reference `pick::pick_rows`:
//! `sp_edits` writes exactly the host's edited logits (bit for bit), `dq_argmax_rows` and
//! `sample_rows` with the rows' processing pick the host's tokens (greedy exactly; seeded
//! draws up to the exp/log near-ties `cuda_sample` allows), on random rows of 7 to 151,936
//! logits; and the CUDA engine's `decode_proc` (the processing written into the plan's
//! `sample_proc` buffer) equals `decode` plus the host pick over the same logits, for a
//! masked greedy row and a biased, penalised, min_p sampled row decoded together.
//! Invariant: without a usable CUDA device each test prints `SKIP ...` and returns, never
//! passing silently. Run on a GPU machine with
//! `cargo test -p strata-exec --release --test cuda_sample_proc -- --nocapture --test-threads=1`.
#![cfg(feature = "cuda")]

mod common;
mod cuda_common;
use cuda_common::{get, put, rand_vec, Carve};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::sync::OnceLock;
use strata_exec::backend::cuda::launch::decode::{argmax_rows, sample_rows, PickScratch};
use strata_exec::backend::cuda::launch::pick::{
    proc_row_words, row_parts, sp_edits, ProcRows, RowParts,
};
use strata_exec::backend::cuda::launch::Launcher;
use strata_exec::backend::cuda::CudaDevice;
use strata_exec::engine::Engine;
use strata_exec::pick::{min_p_offset, pick_rows, Edit, RowProc};
use strata_exec::sampler::{gumbel, sample_with, Draw, Sampler, SamplingParams, NON_FINITE};

static DEV: OnceLock<Result<CudaDevice, String>> = OnceLock::new();

fn dev(test: &str) -> Option<&'static CudaDevice> {
    cuda_common::device_or_skip(&DEV, test, || {
        let d = CudaDevice::open(0).map_err(|e| e.to_string())?;
        eprintln!("device: {} ({})", d.name(), d.arch());
        Ok(d)
    })
}

/// The rows of `procs` in the device layout (every row its full planned size, as the
/// engine's `sample_proc` buffer), on the device.
fn proc_rows<'a>(d: &CudaDevice, c: &Carve<'a>, procs: &[RowProc], cols: usize) -> ProcRows<'a> {
    let words = proc_row_words(cols);
    let mut host = vec![0xdead_beefu32; procs.len() * words];
    let edits_at = 4 + strata_exec::backend::cuda::launch::pick::mask_words(cols);
    for (r, p) in procs.iter().enumerate() {
        let RowParts {
            head: h,
            mask: m,
            edits: e,
        } = row_parts(p, cols).expect("the test's rows fit the device");
        let row = &mut host[r * words..(r + 1) * words];
        row[..4].copy_from_slice(&h);
        if let Some(m) = m {
            row[4..4 + m.len()].copy_from_slice(m);
        }
        row[edits_at..edits_at + e.len()].copy_from_slice(e);
    }
    ProcRows {
        buf: put(d, c, &host),
        row_words: words,
    }
}

/// Pick scratch of `rows` rows of `nb` blocks (counters zeroed).
fn scratch<'a>(d: &CudaDevice, c: &Carve<'a>, rows: usize, nb: u32) -> PickScratch<'a> {
    let n = rows * nb as usize;
    PickScratch {
        part_v: put(d, c, &vec![f32::NAN; n]),
        part_i: put(d, c, &vec![0x5a5a_5a5ai32; n]),
        counters: put(d, c, &vec![0u32; rows]),
        out: put(d, c, &vec![0x5a5a_5a5ai32; rows]),
    }
}

/// A random processing of a `cols`-token row drawn at `t`: a mask on every other row (on
/// some rows allowing a handful of tokens only), unique edits of every kind (some ids past
/// the row), `min_p` on some.
fn random_proc(rng: &mut StdRng, cols: usize, t: f32, r: usize) -> RowProc {
    let mut p = RowProc::default();
    if r % 2 == 0 {
        let sparse = r % 4 == 0;
        p.mask = Some(
            (0..cols.div_ceil(32))
                .map(|_| {
                    let w: u32 = rng.random();
                    if sparse {
                        w & rng.random::<u32>() & rng.random::<u32>() & rng.random::<u32>()
                    } else {
                        w
                    }
                })
                .collect(),
        );
    }
    let mut ids: Vec<u32> = (0..cols as u32 + 3).collect();
    for _ in 0..rng.random_range(0..(cols / 4).clamp(1, 300)) {
        let id = ids.swap_remove(rng.random_range(0..ids.len()));
        let mut e = Edit::none(id);
        if rng.random::<bool>() {
            e.bias = [100.0, -100.0, 3.5, -0.25][rng.random_range(0..4usize)];
        }
        if rng.random::<bool>() {
            e.rep = [1.3f32, 0.7, 10.0][rng.random_range(0..3usize)];
        }
        if rng.random::<bool>() {
            e.pen = rng.random_range(-4.0f32..4.0);
        }
        p.edits.push(e);
    }
    if r % 3 != 1 {
        p.min_p_off = min_p_offset([0.05f32, 0.3, 0.9, 1.0][rng.random_range(0..4usize)], t);
    }
    p
}

/// The host's row after `p`'s mask and edits only (what `sp_edits` leaves in the logits,
/// before the pick kernels mask on the fly).
fn edited(row: &[f32], p: &RowProc) -> Vec<f32> {
    let only = RowProc {
        edits: p.edits.clone(),
        ..Default::default()
    };
    let mut x = row.to_vec();
    only.apply(1.0, &mut x);
    x
}

/// Whether a sampled device token `got` differing from the host's `want` is a near-tie of
/// the processed row `row` (their Gumbel scores within 1e-5, or the host flipping under a
/// 1e-6 nudge of top_p): the last-place error of exp/log, as `cuda_sample` allows.
fn near_tie(row: &[f32], d: &Draw, got: u32, want: u32) -> bool {
    if got as usize >= row.len() || !row[got as usize].is_finite() {
        return false;
    }
    let nudged = |dp: f32| {
        let mut e = *d;
        e.top_p = (d.top_p + dp).min(1.0);
        sample_with(row, &e)
    };
    if d.top_p < 1.0 && (nudged(1e-6) == got || nudged(-1e-6) == got) {
        return true;
    }
    let max = row
        .iter()
        .filter(|v| v.is_finite())
        .cloned()
        .fold(f32::NEG_INFINITY, f32::max);
    let s = |i: u32| (row[i as usize] - max) / d.temperature + gumbel(d.key, i);
    (s(got) - s(want)).abs() <= 1e-5 * s(want).abs().max(1.0)
}

#[test]
fn processed_device_picks_match_the_host_reference() {
    let Some(d) = dev("processed picks") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(0x9a0c_e55e);
    let a = d.alloc_arena("test", 256 << 20).unwrap();
    let l = Launcher::new(d);
    let (mut checked, mut near, mut masked_rows) = (0usize, 0usize, 0usize);
    for &cols in &[7usize, 300, 4099, 32_000, 151_936] {
        let rows = if cols > 50_000 { 12 } else { 32 };
        let mut x = rand_vec(&mut rng, rows * cols, 6.0);
        let mut draws = Vec::with_capacity(rows);
        let mut procs = Vec::with_capacity(rows);
        for r in 0..rows {
            let row = &mut x[r * cols..(r + 1) * cols];
            match r % 6 {
                // NaN and +inf: NON_FINITE even where the mask hides them.
                1 if r % 12 == 1 => {
                    row[cols / 2] = f32::NAN;
                    row[0] = f32::INFINITY;
                }
                // Ties and zeros of both signs, at the min_p cut too.
                2 => row.iter_mut().for_each(|v| *v = v.round()),
                3 => row.iter_mut().step_by(3).for_each(|v| *v = -0.0),
                _ => {}
            }
            let t = [0.0f32, 0.7, 1.0, 1.5, 0.0, 0.9][r % 6];
            let k = [0u32, 1, 5, 40][rng.random_range(0..4usize)];
            let p = [1.0f32, 0.95, 0.5][rng.random_range(0..3usize)];
            draws.push(Draw {
                temperature: t,
                top_k: k,
                top_p: p,
                key: rng.random(),
                ..Draw::GREEDY
            });
            procs.push(random_proc(&mut rng, cols, t, r));
        }
        let mut want = vec![0u32; rows];
        let mut host_rows = x.clone();
        pick_rows(&mut host_rows, cols, &draws, &procs, &mut want);

        // Sampled (every row through `sample_rows`, greedy rows included).
        let c = Carve::new(&a);
        let xv = put(d, &c, &x);
        let pr = proc_rows(d, &c, &procs, cols);
        sp_edits(&l, xv, cols, rows, pr).unwrap();
        let after: Vec<f32> = get(d, xv, rows * cols);
        for r in 0..rows {
            let row = &x[r * cols..(r + 1) * cols];
            let e = edited(row, &procs[r]);
            for i in 0..cols {
                assert_eq!(
                    after[r * cols + i].to_bits(),
                    e[i].to_bits(),
                    "cols {cols} row {r} token {i}: sp_edits {} vs host {}",
                    after[r * cols + i],
                    e[i]
                );
            }
        }
        let dv = put(
            d,
            &c,
            &draws.iter().flat_map(|d| d.to_bytes()).collect::<Vec<u8>>(),
        );
        let s = scratch(d, &c, rows, 16);
        sample_rows(&l, xv, cols, rows, 16, dv, Some(pr), s).unwrap();
        let got: Vec<i32> = get(d, s.out, rows);
        // Greedy (`dq_argmax_rows`) over the same edited rows.
        let s2 = scratch(d, &c, rows, 64);
        argmax_rows(&l, xv, cols, rows, 64, Some(pr), s2).unwrap();
        let greedy: Vec<i32> = get(d, s2.out, rows);
        for r in 0..rows {
            let g = got[r] as u32;
            let dr = &draws[r];
            let processed = &host_rows[r * cols..(r + 1) * cols];
            if want[r] != NON_FINITE && procs[r].mask.is_some() {
                assert!(
                    procs[r].allows(want[r] as usize) || processed.iter().all(|v| !v.is_finite())
                );
                masked_rows += 1;
            }
            let mut gd = [0u32];
            pick_rows(
                &mut x[r * cols..(r + 1) * cols].to_vec(),
                cols,
                &[Draw::GREEDY],
                std::slice::from_ref(&procs[r]),
                &mut gd,
            );
            assert_eq!(
                greedy[r] as u32, gd[0],
                "cols {cols} row {r}: device argmax vs host"
            );
            checked += 1;
            if g == want[r] {
                continue;
            }
            assert!(
                !dr.is_greedy() && want[r] != NON_FINITE && near_tie(processed, dr, g, want[r]),
                "cols {cols} row {r} ({dr:?}, {} edits, mask {}, min_p {:?}): device {g}, host {} (not a near-tie)",
                procs[r].edits.len(),
                procs[r].mask.is_some(),
                procs[r].min_p_off,
                want[r]
            );
            near += 1;
        }
    }
    assert!(masked_rows > 0, "no masked row was checked");
    assert!(
        near * 100 <= checked,
        "{near} of {checked} rows differ by a near-tie (at most 1% allowed)"
    );
    eprintln!(
        "PASS processed picks: {checked} rows (7..151936 logits; masks, edits, min_p; greedy and seeded), {near} near-ties"
    );
}

/// A random two-layer Qwen3-MoE (Q8_0, 1000-token vocabulary) on the CUDA engine, two slots
/// prefilled.
fn engine(dir: &std::path::Path, seed: u64) -> strata_exec::backend::cuda::start::CudaEngine {
    use strata_schemas::gguf::random::{write_random_model, RandomOptions};
    let mut hp = strata_schemas::known::qwen3_30b_a3b();
    hp.n_layer = 2;
    hp.n_embd = 256;
    hp.n_head = 8;
    hp.n_head_kv = 2;
    hp.head_dim_k = 128;
    hp.head_dim_v = 128;
    hp.n_expert = 8;
    hp.n_expert_used = 2;
    hp.n_ff_exp = 64;
    hp.n_vocab = 1000;
    let gguf = dir.join("proc-q8_0.gguf");
    let recipe = strata_schemas::arch::QuantRecipe::preset("Q8_0").unwrap();
    if !gguf.exists() {
        write_random_model(
            &gguf,
            "qwen3moe",
            &hp,
            &recipe,
            seed,
            RandomOptions::default(),
        )
        .unwrap();
    }
    let ask = common::Ask {
        ctx: 128,
        ubatch: 16,
        batch: 2,
        gpu: true,
        ..common::Ask::default()
    };
    let inv = strata_plan::model::load_model(&gguf).unwrap();
    let plan = common::plan_inventory("proc", &inv, &gguf, &ask);
    let host = strata_exec::load::open_model(&gguf).unwrap();
    let mut e = strata_exec::backend::cuda::start::start_cuda(
        &plan,
        host,
        strata_exec::backend::cuda::options::CudaOptions::f32_products(),
    )
    .unwrap();
    e.prefill(0, &[3, 14, 15, 92, 65], false).unwrap();
    e.prefill(1, &[35, 89], false).unwrap();
    e
}

/// `decode_proc` on the device against `decode` and `pick::pick_rows` on another engine of
/// the same model: slot 0 greedy under a mask allowing 1 in 8 tokens and `min_p`, slot 1
/// sampled with a +100 bias on one token every fourth step, penalties on the tokens it drew,
/// and `min_p`. The random model's logits leave no near-ties, so every token must be the
/// host's; the mask and the bias must show in the tokens.
#[test]
fn decode_proc_on_the_device_equals_the_host_reference() {
    if !common::gpu_present() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut host = engine(dir.path(), 29);
    let mut dev = engine(dir.path(), 29);
    let v = host.info().n_vocab;
    let mut sampler = Sampler::new(SamplingParams {
        temperature: 0.9,
        top_k: 0,
        top_p: 0.95,
        seed: 11,
    });
    let mask: Vec<u32> = (0..v.div_ceil(32))
        .map(|w| 0x0101_0101u32 << (w % 8))
        .collect();
    let (mut a, mut b) = ([7u32, 11], [7u32, 11]);
    let mut drawn: Vec<u32> = Vec::new();
    for step in 0..16 {
        let draws = [Draw::GREEDY, sampler.next_draw()];
        let mut p0 = RowProc {
            mask: Some(mask.clone()),
            min_p_off: min_p_offset(0.2, 0.0),
            ..Default::default()
        };
        let mut p1 = RowProc {
            min_p_off: min_p_offset(0.05, draws[1].temperature),
            ..Default::default()
        };
        let forced = (step * 37 % v) as u32;
        if step % 4 == 3 {
            p1.edits.push(Edit {
                bias: 100.0,
                ..Edit::none(forced)
            });
        }
        for &t in &drawn {
            if t != forced && !p1.edits.iter().any(|e| e.id == t) {
                p1.edits.push(Edit {
                    rep: 1.3,
                    pen: 0.4,
                    ..Edit::none(t)
                });
            }
        }
        p0.edits.push(Edit {
            bias: -100.0,
            ..Edit::none(0)
        });
        let procs = [p0, p1];
        let batch_a: Vec<(usize, u32)> = (0..2).map(|i| (i, a[i])).collect();
        let mut rows = host.decode(&batch_a).unwrap().to_vec();
        pick_rows(&mut rows, v, &draws, &procs, &mut a);
        let batch_b: Vec<(usize, u32)> = (0..2).map(|i| (i, b[i])).collect();
        let mut out = [u32::MAX; 2];
        dev.decode_proc(&batch_b, &draws, &procs, &mut out).unwrap();
        b = out;
        assert_eq!(a, b, "step {step}: device decode_proc vs host reference");
        assert!(
            procs[0].allows(b[0] as usize),
            "step {step}: masked token {}",
            b[0]
        );
        if step % 4 == 3 {
            assert_eq!(b[1], forced, "step {step}: a +100 bias forces its token");
        }
        drawn.push(b[1]);
    }
    eprintln!("PASS decode_proc: 16 steps of a masked greedy row and a processed sampled row = host reference");
}
