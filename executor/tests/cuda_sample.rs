//! Op test of `kernels/cuda/sample.cu`'s `sample_rows` (sampling on the device) against the
//! host's `sampler::sample_with`, which defines it: fresh random rows of 1 to 151,936 logits
//! with temperature, top-k and top-p draws (ties, NaN and infinities included) over 1, 5
//! and 64 blocks a row, the
//! frequencies of many draws against the softmax of the kept tokens, and its time at
//! Qwen3's vocabulary.
//! Invariant: without a usable CUDA device each test prints `SKIP (no CUDA device): ...` and
//! returns, never passing silently; a device token differing from the host's is allowed only
//! where the host itself flips under a 1e-6 nudge of top_p or the two tokens' Gumbel scores
//! are within 1e-5 (the last-place error of exp/log), and at most on 1% of the rows. Run on a
//! GPU machine with `cargo test -p strata-exec --release --test cuda_sample -- --nocapture`.
#![cfg(feature = "cuda")]

mod cuda_common;
use cuda_common::{get, put, rand_vec, Carve};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::sync::OnceLock;
use strata_exec::backend::cuda::launch::decode::{sample_rows, PickScratch};
use strata_exec::backend::cuda::launch::Launcher;
use strata_exec::backend::cuda::{CudaDevice, DeviceView};
use strata_exec::sampler::{
    argmax, gumbel, order_key, row_is_sound, sample_with, Draw, NON_FINITE,
};

static DEV: OnceLock<Result<CudaDevice, String>> = OnceLock::new();

fn dev(test: &str) -> Option<&'static CudaDevice> {
    cuda_common::device_or_skip(&DEV, test, || {
        let d = CudaDevice::open(0).map_err(|e| e.to_string())?;
        eprintln!("device: {} ({})", d.name(), d.arch());
        Ok(d)
    })
}

const POISON_I32: i32 = 0x5a5a_5a5a;

fn draw(temperature: f32, top_k: u32, top_p: f32, key: u64) -> Draw {
    Draw {
        temperature,
        top_k,
        top_p,
        key,
        ..Draw::GREEDY
    }
}

fn draw_bytes(draws: &[Draw]) -> Vec<u8> {
    draws.iter().flat_map(|d| d.to_bytes()).collect()
}

/// Device scratch of `sample_rows` for `rows` rows of `nb` blocks: (part_v, part_i,
/// counters zeroed, tokens poisoned with a guard).
fn scratch<'a>(d: &CudaDevice, c: &Carve<'a>, rows: usize, nb: u32) -> [DeviceView<'a>; 4] {
    let n = rows * nb as usize;
    [
        put(d, c, &vec![f32::NAN; n]),
        put(d, c, &vec![POISON_I32; n]),
        put(d, c, &vec![0u32; rows]),
        put(d, c, &vec![POISON_I32; rows + 3]),
    ]
}

/// Queue `sample_rows` over `rows` rows of `cols` logits (`x`) in `nb` blocks a row, with
/// the draws in `dv`.
fn queue(
    d: &CudaDevice,
    x: DeviceView<'_>,
    cols: usize,
    rows: usize,
    nb: u32,
    dv: DeviceView<'_>,
    s: &[DeviceView<'_>; 4],
) {
    let p = PickScratch {
        part_v: s[0],
        part_i: s[1],
        counters: s[2],
        out: s[3],
    };
    sample_rows(&Launcher::new(d), x, cols, rows, nb, dv, None, p).unwrap();
}

/// `sample_rows` over `rows` rows of `cols` logits (`x`), one draw each, `nb` blocks a row;
/// the tokens (and checks that the counters are back to zero and nothing past the rows was
/// written).
fn launch(
    d: &CudaDevice,
    c: &Carve<'_>,
    x: DeviceView<'_>,
    cols: usize,
    nb: u32,
    draws: &[Draw],
) -> Vec<i32> {
    let rows = draws.len();
    let dv = put(d, c, &draw_bytes(draws));
    let s = scratch(d, c, rows, nb);
    queue(d, x, cols, rows, nb, dv, &s);
    let got: Vec<i32> = get(d, s[3], rows + 3);
    assert!(
        got[rows..].iter().all(|v| *v == POISON_I32),
        "sample_rows wrote past its rows"
    );
    let counters: Vec<u32> = get(d, s[2], rows);
    assert!(
        counters.iter().all(|c| *c == 0),
        "counters left at {counters:?}"
    );
    got[..rows].to_vec()
}

/// The host's score of token `i` under draw `d` (the Gumbel-max quantity).
fn score(row: &[f32], d: &Draw, i: u32) -> f32 {
    let max = row
        .iter()
        .filter(|v| v.is_finite())
        .cloned()
        .fold(f32::NEG_INFINITY, f32::max);
    (row[i as usize] - max) / d.temperature + gumbel(d.key, i)
}

/// Whether a device token `got` differing from the host's `want` is a near-tie the last-place
/// error of exp/log can flip (see the module comment).
fn near_tie(row: &[f32], d: &Draw, got: u32, want: u32) -> bool {
    if got as usize >= row.len() {
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
    let (a, b) = (score(row, d, got), score(row, d, want));
    (a - b).abs() <= 1e-5 * b.abs().max(1.0)
}

#[test]
fn sample_rows_match_the_host_sampler() {
    let Some(d) = dev("sample_rows") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(0x5a3b_1e00);
    let a = d.alloc_arena("test", 64 << 20).unwrap();
    let (mut rows_checked, mut near, mut exact) = (0usize, 0usize, 0usize);
    for &cols in &[1usize, 2, 7, 255, 1000, 4099, 32_000, 151_936] {
        let rows = if cols > 50_000 { 24 } else { 64 };
        let mut x = rand_vec(&mut rng, rows * cols, 6.0);
        let mut draws = Vec::with_capacity(rows);
        for r in 0..rows {
            let row = &mut x[r * cols..(r + 1) * cols];
            match r % 8 {
                // NaN, -inf and +inf sprinkled: no token may be drawn (NON_FINITE).
                1 => {
                    for c in (0..cols).step_by(5) {
                        row[c] = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY][c % 3];
                    }
                }
                // Coarse values: many ties, also at the top-k and top-p thresholds.
                2 => row.iter_mut().for_each(|v| *v = v.round()),
                // Nothing finite: NON_FINITE too.
                3 if r % 16 == 3 => row.iter_mut().for_each(|v| *v = f32::NAN),
                // One dominant token.
                4 => row[rng.random_range(0..cols)] = 40.0,
                _ => {}
            }
            let t = [0.0f32, 0.3, 0.7, 1.0, 1.5, 4.0, 1e-3, 0.9][rng.random_range(0..8usize)];
            let k = [0u32, 1, 5, 40, 1000, 200_000][rng.random_range(0..6usize)];
            let p = [1.0f32, 0.95, 0.5, 0.9, 1e-6, 0.0][rng.random_range(0..6usize)];
            draws.push(draw(t, k, p, rng.random()));
        }
        let c = Carve::new(&a);
        let xv = put(d, &c, &x);
        let got = launch(d, &c, xv, cols, 64, &draws);
        // Again, and with 1, 5 and 16 blocks a row: the same tokens (no state survives a
        // launch, and neither the split of the last pass nor the order of the histograms'
        // integer sums matters).
        for nb in [64, 1, 5, 16] {
            assert_eq!(
                got,
                launch(d, &c, xv, cols, nb, &draws),
                "cols {cols}: {nb} blocks"
            );
        }
        for (r, dr) in draws.iter().enumerate() {
            let row = &x[r * cols..(r + 1) * cols];
            let want = if row_is_sound(row) {
                sample_with(row, dr)
            } else {
                NON_FINITE
            };
            let g = got[r] as u32;
            rows_checked += 1;
            if g == want {
                exact += 1;
                continue;
            }
            assert!(
                !dr.is_greedy() && near_tie(row, dr, g, want),
                "cols {cols} row {r} ({dr:?}): device {g}, host {want} (not a near-tie)"
            );
            near += 1;
        }
    }
    assert!(
        near * 100 <= rows_checked,
        "{near} of {rows_checked} rows differ by a near-tie (at most 1% allowed)"
    );
    eprintln!(
        "PASS sample_rows: cols 1..151936, temperatures 0..4, top_k 0..200000, top_p 0..1, \
         NaN/inf/ties: {exact} of {rows_checked} rows the host's token, {near} near-ties"
    );
}

/// 4,096 draws of the same 12 logits with their own keys: each token's frequency within 5
/// standard deviations of the softmax over the kept set (temperature 0.8; top-k 5, whose
/// 5th value is shared with the 6th, so both stay; top-p 0.7).
#[test]
fn sample_rows_frequencies_follow_the_softmax() {
    let Some(d) = dev("sample_rows frequencies") else {
        return;
    };
    let logits: [f32; 12] = [
        1.0, 0.2, 2.5, -1.0, 0.2, 1.7, 1.0, -0.4, 0.2, 2.0, 1.1, -3.0,
    ];
    let t = 0.8f32;
    let mut order: Vec<usize> = (0..12).collect();
    order.sort_by(|a, b| logits[*b].total_cmp(&logits[*a]));
    let w: Vec<f64> = logits
        .iter()
        .map(|l| (((l - 2.5) / t) as f64).exp())
        .collect();
    let kept_k: Vec<usize> = order
        .iter()
        .cloned()
        .filter(|&i| order_key(logits[i]) >= order_key(logits[order[4]]))
        .collect();
    assert_eq!(
        kept_k.len(),
        6,
        "the 5th and 6th largest tie, so top-k 5 keeps 6"
    );
    let z: f64 = w.iter().sum();
    let mut acc = 0.0;
    let mut kept_p = Vec::new();
    for &i in &order {
        kept_p.push(i);
        acc += w[i] / z;
        if acc >= 0.7 {
            break;
        }
    }
    let a = d.alloc_arena("test", 16 << 20).unwrap();
    let n = 4096;
    for (k, p, kept) in [
        (0u32, 1.0f32, (0..12).collect::<Vec<_>>()),
        (5, 1.0, kept_k),
        (0, 0.7, kept_p),
    ] {
        let c = Carve::new(&a);
        let x: Vec<f32> = (0..n).flat_map(|_| logits).collect();
        let xv = put(d, &c, &x);
        let draws: Vec<Draw> = (0..n as u64)
            .map(|i| draw(t, k, p, i.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 77))
            .collect();
        let got = launch(d, &c, xv, 12, 3, &draws);
        let mut count = [0usize; 12];
        for g in &got {
            count[*g as usize] += 1;
        }
        let zk: f64 = kept.iter().map(|&i| w[i]).sum();
        for i in 0..12 {
            let want = if kept.contains(&i) { w[i] / zk } else { 0.0 };
            let got = count[i] as f64 / n as f64;
            let sd = (want * (1.0 - want) / n as f64).sqrt().max(1e-9);
            assert!(
                (got - want).abs() <= 5.0 * sd,
                "top_k {k} top_p {p}: token {i} drawn {got:.4}, softmax of the kept {want:.4}"
            );
        }
        eprintln!("PASS sample_rows frequencies (top_k {k}, top_p {p}): {count:?}");
    }
    assert_eq!(argmax(&logits), order[0] as u32);
}

/// Time of one row at Qwen3's 151,936-token vocabulary: plain temperature, top-k 40, top-p
/// 0.95, both; and greedy (the argmax pass only).
#[test]
fn sample_rows_time_at_qwen3_vocabulary() {
    let Some(d) = dev("sample_rows time") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(9);
    let cols = 151_936;
    let a = d.alloc_arena("test", 16 << 20).unwrap();
    let c = Carve::new(&a);
    let x = rand_vec(&mut rng, cols, 8.0);
    let xv = put(d, &c, &x);
    let mut line = String::new();
    for (name, dr) in [
        ("greedy", Draw::GREEDY),
        ("T=1", draw(1.0, 0, 1.0, 5)),
        ("top-k 40", draw(0.8, 40, 1.0, 5)),
        ("top-p 0.95", draw(0.8, 0, 0.95, 5)),
        ("top-k 40 + top-p 0.95", draw(0.8, 40, 0.95, 5)),
    ] {
        let dv = put(d, &c, &draw_bytes(&[dr]));
        let cuts = dr.top_k > 0 || dr.top_p < 1.0;
        for nb in [if cuts { 16 } else { 64 }, 1] {
            let s = scratch(d, &c, 1, nb);
            let reps = 20;
            for _ in 0..2 {
                queue(d, xv, cols, 1, nb, dv, &s);
            }
            let e0 = d.record_event().unwrap();
            for _ in 0..reps {
                queue(d, xv, cols, 1, nb, dv, &s);
            }
            let e1 = d.record_event().unwrap();
            e1.synchronize().unwrap();
            let us = e0.elapsed_ms(&e1).unwrap() as f64 * 1e3 / reps as f64;
            let tok: Vec<i32> = get(d, s[3], 1);
            assert_eq!(
                tok[0] as u32,
                sample_with(&x, &dr),
                "{name}: the host's token"
            );
            line += &format!("{name} {us:.1} us ({nb} blocks); ");
        }
        line += "\n";
    }
    eprintln!("TIME sample_rows, one row of 151936 logits, kernel only: {line}");
}
