//! The hybrid miss path's host half: a GPU stage's missed experts computed on the CPU from
//! host memory (the mapped model file, GGUF layout) — the SwiGLU products of each (token,
//! expert) pick, weighted by the router and summed per token — on rayon's pool (every core),
//! while the device computes its hits. The device adds the sum into the layer's output.
//! Invariant: the result depends only on the picks, their weights, the rows of `xn` and the
//! experts' bytes (f32 accumulation, each output element summed over its token's picks in
//! pick order); nothing is allocated here beyond the caller's buffers.

use super::ops::{need, silu, Matrix, OpError};
use crate::quant;
use rayon::prelude::*;

/// One (token, expert) pick computed on the host: the token's row in the group, the expert
/// and its router weight.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostPick {
    pub token: u32,
    pub expert: u32,
    pub weight: f32,
}

/// `out[t] = sum over picks p of token t: w_p * down_p(silu(gate_p xn[t]) * up_p xn[t])` for
/// `tokens` rows of the hidden width `e`; `mats(p)` gives pick `p`'s gate and up (`f x e`)
/// and down (`e x f`) matrices; `h` holds `picks.len() x f` hidden values meanwhile. Picks
/// must come in increasing token order. Two parallel sections: the gate/up rows of every
/// pick, then every output element.
pub fn host_experts<'m>(
    mats: &[[Matrix<'m>; 3]],
    picks: &[HostPick],
    xn: &[f32],
    tokens: usize,
    (e, f): (usize, usize),
    h: &mut [f32],
    out: &mut [f32],
) -> Result<(), OpError> {
    const OP: &str = "host experts";
    need(OP, "matrices", picks.len(), mats.len())?;
    need(OP, "xn", tokens * e, xn.len())?;
    need(OP, "h", picks.len() * f, h.len())?;
    need(OP, "out", tokens * e, out.len())?;
    for (p, [g, u, d]) in picks.iter().zip(mats) {
        need(OP, "pick token", p.token as usize + 1, tokens)?;
        for (m, rows, cols) in [(g, f, e), (u, f, e), (d, e, f)] {
            need(OP, "expert rows", rows, m.rows)?;
            need(OP, "expert columns", cols, m.cols)?;
            need(OP, "expert columns (exact)", m.cols, cols)?;
        }
    }
    if picks.windows(2).any(|w| w[1].token < w[0].token) {
        return Err(OpError::Shape {
            op: OP,
            what: "picks in token order",
            expected: 1,
            got: 0,
        });
    }
    let h = &mut h[..picks.len() * f];
    h.par_iter_mut()
        .with_min_len(32)
        .enumerate()
        .for_each(|(i, v)| {
            let (p, r) = (i / f, i % f);
            let t = picks[p].token as usize;
            let x = &xn[t * e..(t + 1) * e];
            let [g, u, _] = &mats[p];
            let gv = quant::dot_row(g.ty, g.row(r), x);
            let uv = quant::dot_row(u.ty, u.row(r), x);
            *v = silu(gv) * uv;
        });
    // Each token's picks: [start, end) in `picks`.
    let h = &*h;
    out[..tokens * e]
        .par_iter_mut()
        .with_min_len(32)
        .enumerate()
        .for_each(|(i, o)| {
            let (t, r) = (i / e, i % e);
            let mut acc = 0.0f32;
            for (p, pick) in picks.iter().enumerate() {
                if pick.token as usize != t {
                    continue;
                }
                let d = &mats[p][2];
                acc += pick.weight * quant::dot_row(d.ty, d.row(r), &h[p * f..(p + 1) * f]);
            }
            *o = acc;
        });
    Ok(())
}

/// The threads the host half runs on (rayon's pool: one per core unless the process set
/// otherwise).
pub fn host_threads() -> usize {
    rayon::current_num_threads()
}

/// `n` Q8_0 experts of `e x f` (gate, up, down one after another, `3 x f x row_bytes(e)`
/// bytes each) of valid blocks (a scale of 1/64, small signed values): the probe's stand-ins
/// for a model's experts.
pub fn synthetic_experts((e, f): (usize, usize), n: usize) -> Result<Vec<u8>, OpError> {
    let per = quant::row_bytes(strata_schemas::ggml::GgmlType::Q8_0, e)? * f;
    let block: Vec<u8> = [0x00u8, 0x24]
        .into_iter()
        .chain((0..32).map(|i| (i as i8 - 16) as u8))
        .collect();
    Ok(block.iter().copied().cycle().take(3 * n * per).collect())
}

/// The gate, up and down matrices of each of the `n` experts in `weights` (as
/// [`synthetic_experts`] lays them).
pub fn synthetic_mats(
    weights: &[u8],
    (e, f): (usize, usize),
    n: usize,
) -> Result<Vec<[Matrix<'_>; 3]>, OpError> {
    let ty = strata_schemas::ggml::GgmlType::Q8_0;
    let per = quant::row_bytes(ty, e)? * f;
    (0..n)
        .map(|x| {
            let m = |k: usize, rows: usize, cols: usize| {
                let at = (3 * x + k) * per;
                Matrix::new(ty, cols, rows, weights.get(at..at + per).unwrap_or(&[]))
            };
            Ok([m(0, f, e)?, m(1, f, e)?, m(2, e, f)?])
        })
        .collect()
}

/// The host half's cost on this machine, for the probe's `host_matvec_gbps` and
/// `host_expert_latency_us`: [`host_experts`] over Q8_0 experts of `e x f` (gate, up and down
/// of distinct experts, a working set of `ws_experts` so the weights come from memory, not
/// cache), timed for each count of one-token picks in `picks` (best of `reps`). Returns
/// (bytes of expert weights read, seconds) per count, for a line fit: the slope's inverse is
/// the rate, the intercept the fixed cost of a call (the pool's wake-up and the sections).
pub fn time_host_experts(
    (e, f): (usize, usize),
    ws_experts: usize,
    picks: &[usize],
    reps: usize,
) -> Result<Vec<(f64, f64)>, OpError> {
    let most = picks.iter().copied().max().unwrap_or(0);
    let n = ws_experts.max(most).max(1);
    let weights = synthetic_experts((e, f), n)?;
    let mats = synthetic_mats(&weights, (e, f), n)?;
    let per = quant::row_bytes(strata_schemas::ggml::GgmlType::Q8_0, e)? * f;
    let xn = vec![0.25f32; e];
    let mut h = vec![0f32; most * f];
    let mut out = vec![0f32; e];
    let mut next = 0usize; // rotate through the working set
    let mut rows = Vec::with_capacity(picks.len());
    for &k in picks {
        let mut best = f64::INFINITY;
        for _ in 0..reps.max(1) {
            let chosen: Vec<[Matrix<'_>; 3]> = (0..k).map(|i| mats[(next + i) % n]).collect();
            next = (next + k) % n;
            let p: Vec<HostPick> = (0..k)
                .map(|i| HostPick {
                    token: 0,
                    expert: i as u32,
                    weight: 1.0 / k as f32,
                })
                .collect();
            let t = std::time::Instant::now();
            host_experts(&chosen, &p, &xn, 1, (e, f), &mut h[..k * f], &mut out)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        rows.push(((3 * k * per) as f64, best));
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_schemas::ggml::GgmlType;

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// Against the CPU backend's own expert loop on the same weights: gate, up, silu, down
    /// with `ops::matmul`, weighted and summed per token.
    #[test]
    fn host_experts_match_the_reference_products() {
        let (e, f, ne) = (64, 32, 4);
        let val = |i: usize, s: f32| ((i as f32 * 0.37 + s).sin()) * 0.2;
        let stack = |rows: usize, cols: usize, s: f32| {
            f32_bytes(
                &(0..ne * rows * cols)
                    .map(|i| val(i, s))
                    .collect::<Vec<f32>>(),
            )
        };
        let (gb, ub, db) = (stack(f, e, 1.0), stack(f, e, 2.0), stack(e, f, 3.0));
        fn m(b: &[u8], x: usize, rows: usize, cols: usize) -> Matrix<'_> {
            let per = rows * cols * 4;
            Matrix::new(GgmlType::F32, cols, rows, &b[x * per..(x + 1) * per]).unwrap()
        }
        let tokens = 3;
        let xn: Vec<f32> = (0..tokens * e).map(|i| val(i, 4.0)).collect();
        let picks = [
            HostPick {
                token: 0,
                expert: 2,
                weight: 0.6,
            },
            HostPick {
                token: 0,
                expert: 1,
                weight: 0.4,
            },
            HostPick {
                token: 2,
                expert: 3,
                weight: 1.0,
            },
        ];
        let mats: Vec<[Matrix<'_>; 3]> = picks
            .iter()
            .map(|p| {
                let x = p.expert as usize;
                [m(&gb, x, f, e), m(&ub, x, f, e), m(&db, x, e, f)]
            })
            .collect();
        let mut h = vec![0.0; picks.len() * f];
        let mut out = vec![f32::NAN; tokens * e];
        host_experts(&mats, &picks, &xn, tokens, (e, f), &mut h, &mut out).unwrap();
        let mut want = vec![0.0f32; tokens * e];
        for (p, [g, u, d]) in picks.iter().zip(&mats) {
            let t = p.token as usize;
            let x = &xn[t * e..(t + 1) * e];
            let (mut gv, mut uv, mut dv) = (vec![0.0; f], vec![0.0; f], vec![0.0; e]);
            super::super::ops::matmul(g, x, 1, &mut gv, &mut []).unwrap();
            super::super::ops::matmul(u, x, 1, &mut uv, &mut []).unwrap();
            let hv: Vec<f32> = gv.iter().zip(&uv).map(|(a, b)| silu(*a) * b).collect();
            super::super::ops::matmul(d, &hv, 1, &mut dv, &mut []).unwrap();
            for (o, v) in want[t * e..(t + 1) * e].iter_mut().zip(&dv) {
                *o += p.weight * v;
            }
        }
        // Token 1 picked nothing here: its row is zero, not left as it was.
        assert!(out[e..2 * e].iter().all(|v| *v == 0.0));
        let worst = out
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-5, "worst difference {worst}");
        assert!(want.iter().any(|v| v.abs() > 1e-3), "a non-trivial result");
    }

    #[test]
    fn host_experts_refuse_picks_out_of_token_order_and_short_buffers() {
        let b = f32_bytes(&[0.0; 4]);
        let m = Matrix::new(GgmlType::F32, 2, 2, &b).unwrap();
        let picks = [
            HostPick {
                token: 1,
                expert: 0,
                weight: 1.0,
            },
            HostPick {
                token: 0,
                expert: 0,
                weight: 1.0,
            },
        ];
        let mats = [[m, m, m], [m, m, m]];
        let (mut h, mut out) = (vec![0.0; 4], vec![0.0; 4]);
        let xn = [0.0; 4];
        assert!(host_experts(&mats, &picks, &xn, 2, (2, 2), &mut h, &mut out).is_err());
        assert!(host_experts(&mats, &picks[..1], &xn, 2, (2, 2), &mut h[..1], &mut out).is_err());
    }

    /// The timing helper reads what it says: more picks take longer on the whole, and the
    /// fitted rate is a positive, finite number of bytes a second.
    #[test]
    fn the_host_rate_timing_gives_a_usable_line() {
        let rows = time_host_experts((256, 128), 24, &[1, 4, 16], 3).unwrap();
        assert_eq!(rows.len(), 3);
        assert!(rows.windows(2).all(|w| w[1].0 > w[0].0));
        assert!(rows.iter().all(|r| r.1 > 0.0 && r.1.is_finite()));
        let (x0, y0) = rows[0];
        let (x2, y2) = rows[2];
        let rate = (x2 - x0) / (y2 - y0).max(1e-9);
        assert!(rate.is_finite() && rate > 0.0, "{rows:?}");
    }
}
