//! The host part of decode attention over spilled KV (`--kv-host cpu`): for each decoding
//! token, the partial softmax of its query heads over its slot's cells past the VRAM window,
//! read straight from the GPU engine's pinned `kv_spill` chunks (F32, F16 or Q8_0 rows,
//! dequantised as the CPU backend's KV is), on rayon's pool while the device attends the
//! window; a token's cells are cut into pieces so a batch of one keeps every core busy. The device's flash-decoding combine merges this partial with its own splits.
//! Invariant: a partial is exactly what `dq_attn_gqa` writes for a split — the maximum `m` of
//! the scaled scores, `l = sum exp(s - m)` and the unnormalised `o = sum exp(s - m) v` — over
//! cells `[resident, n_ctx)` in increasing order; a token with no such cell gets
//! `(-inf, 0, 0)`, which the merge weighs 0. Nothing is allocated here.

use super::ops::OpError;
use crate::quant;
use rayon::prelude::*;
use strata_schemas::ggml::GgmlType;

const OP: &str = "host attention";

/// One KV layer's cells past the window as the GPU engine lays them in its `kv_spill`
/// chunks (`backend/cuda/kv_spill.rs`): spilled cell `i = slot * per_slot + (c - resident)`
/// lies at `(i % per_chunk) * cell_bytes` in chunk `i / per_chunk`; inside it this layer's K
/// row at `k_off` and V row at `v_off`, `row_bytes` each (`n_head_kv x head_dim` values of
/// `ty`).
#[derive(Debug, Clone, Copy)]
pub struct SpilledCells<'a> {
    pub chunks: &'a [&'a [u8]],
    pub ty: GgmlType,
    pub cell_bytes: usize,
    pub per_chunk: usize,
    pub resident: usize,
    pub per_slot: usize,
    pub k_off: usize,
    pub v_off: usize,
    pub row_bytes: usize,
}

impl SpilledCells<'_> {
    /// The K (`off = k_off`) or V row of spilled cell `c` of `slot`.
    fn row(&self, slot: usize, c: usize, off: usize) -> &[u8] {
        let i = slot * self.per_slot + (c - self.resident);
        let at = (i % self.per_chunk) * self.cell_bytes + off;
        &self.chunks[i / self.per_chunk][at..at + self.row_bytes]
    }

    /// Whether every cell of `slots` slots lies inside its chunk and holds both rows.
    fn check(&self, slots: usize, row_elems: usize) -> Result<(), OpError> {
        let shape = |what, expected, got| OpError::Shape {
            op: OP,
            what,
            expected,
            got,
        };
        let rb = quant::row_bytes(self.ty, row_elems)?;
        if rb != self.row_bytes {
            return Err(shape("KV row bytes", rb, self.row_bytes));
        }
        let end = self.k_off.max(self.v_off) + self.row_bytes;
        if end > self.cell_bytes || self.per_chunk == 0 {
            return Err(shape("spilled cell bytes", end, self.cell_bytes));
        }
        let cells = slots * self.per_slot;
        let held: usize = self.chunks.iter().map(|c| c.len() / self.cell_bytes).sum();
        let whole = self
            .chunks
            .iter()
            .rev()
            .skip(1)
            .all(|c| c.len() / self.cell_bytes == self.per_chunk);
        if held < cells || !whole {
            return Err(shape("spilled cells in the chunks", cells, held));
        }
        Ok(())
    }
}

/// Bytes of `f32` scratch [`host_partials`] needs for `n_tok` tokens in `pieces` pieces.
pub fn scratch_len(n_tok: usize, n_head: usize, hd: usize, pieces: usize) -> usize {
    n_tok * n_head * pieces.max(1) * (hd + 2)
}

/// The host partials of `slot.len()` decoding tokens: token `t` (query rows `q`, `n_tok x
/// n_head x hd`, already normed and rotated) attends cells `[resident, n_ctx[t])` of slot
/// `slot[t]`; `o` gets `n_tok x n_head x hd` unnormalised outputs and `ms` `n_tok x n_head`
/// (max, sum) pairs. Query head `h` reads KV head `h / (n_head / n_head_kv)`. Each token's
/// cells are cut into `pieces` runs so that a batch of one still keeps every core busy: a
/// task is one (token, KV head, piece), which reads each of its cells' K and V rows once for
/// the group's heads (online softmax in f32) into `scratch` ([`scratch_len`]); the pieces
/// are then merged as the device's combine merges splits.
#[allow(clippy::too_many_arguments)]
pub fn host_partials(
    cells: &SpilledCells<'_>,
    (n_head, n_head_kv, hd): (usize, usize, usize),
    slot: &[u32],
    n_ctx: &[u32],
    q: &[f32],
    scale: f32,
    pieces: usize,
    scratch: &mut [f32],
    o: &mut [f32],
    ms: &mut [f32],
) -> Result<(), OpError> {
    let n = slot.len();
    let pieces = pieces.max(1);
    if n_head_kv == 0 || n_head % n_head_kv != 0 || hd == 0 {
        return Err(OpError::Shape {
            op: OP,
            what: "n_head (a multiple of n_head_kv)",
            expected: n_head_kv,
            got: n_head,
        });
    }
    let need = |what, want: usize, got: usize| {
        if got < want {
            Err(OpError::Shape {
                op: OP,
                what,
                expected: want,
                got,
            })
        } else {
            Ok(())
        }
    };
    need("n_ctx", n, n_ctx.len())?;
    need("q", n * n_head * hd, q.len())?;
    need("o", n * n_head * hd, o.len())?;
    need("ms", n * n_head * 2, ms.len())?;
    need("scratch", scratch_len(n, n_head, hd, pieces), scratch.len())?;
    let slots = slot.iter().map(|&s| s as usize + 1).max().unwrap_or(0);
    cells.check(slots, n_head_kv * hd)?;
    for (t, &c) in n_ctx[..n].iter().enumerate() {
        if c as usize > cells.resident + cells.per_slot {
            return Err(OpError::KvRange {
                token: t,
                n_ctx: c as usize,
                n_cells: cells.resident + cells.per_slot,
            });
        }
    }
    let g = n_head / n_head_kv;
    let per = g * (hd + 2);
    let scratch = &mut scratch[..n * n_head_kv * pieces * per];
    scratch
        .par_chunks_mut(per)
        .enumerate()
        .try_for_each(|(task, part)| {
            let (t, kvh, p) = (
                task / (n_head_kv * pieces),
                task / pieces % n_head_kv,
                task % pieces,
            );
            let (w, end) = (cells.resident, (n_ctx[t] as usize).max(cells.resident));
            let len = end - w;
            let run = (w + p * len / pieces, w + (p + 1) * len / pieces);
            let q0 = (t * n_head + kvh * g) * hd;
            let (og, mg) = part.split_at_mut(g * hd);
            attend(
                cells,
                (kvh, hd, g, n_head_kv * hd),
                slot[t] as usize,
                run,
                &q[q0..q0 + g * hd],
                scale,
                og,
                mg,
            )
        })?;
    // Merge each (token, KV head)'s pieces into its heads' partials.
    let scratch = &*scratch;
    o[..n * n_head * hd]
        .par_chunks_mut(g * hd)
        .zip(ms[..n * n_head * 2].par_chunks_mut(g * 2))
        .enumerate()
        .for_each(|(task, (og, mg))| {
            let parts = &scratch[task * pieces * per..(task + 1) * pieces * per];
            for h in 0..g {
                let m_of = |p: usize| parts[p * per + g * hd + 2 * h];
                let mm = (0..pieces).map(m_of).fold(f32::NEG_INFINITY, f32::max);
                let oh = &mut og[h * hd..(h + 1) * hd];
                oh.fill(0.0);
                let mut l = 0.0f32;
                if mm > f32::NEG_INFINITY {
                    for p in 0..pieces {
                        let (m, base) = (m_of(p), p * per);
                        if m == f32::NEG_INFINITY {
                            continue;
                        }
                        let wt = (m - mm).exp();
                        l += wt * parts[base + g * hd + 2 * h + 1];
                        let src = &parts[base + h * hd..base + (h + 1) * hd];
                        for (x, y) in oh.iter_mut().zip(src) {
                            *x += wt * y;
                        }
                    }
                }
                mg[2 * h] = mm;
                mg[2 * h + 1] = l;
            }
        });
    Ok(())
}

/// One task: the `g` query heads `qg` of KV head `kvh` over cells `[a, b)` of `slot` (rows
/// of `re` values), into `og` (`g x hd` unnormalised outputs) and `mg` (`g` (max, sum)
/// pairs).
#[allow(clippy::too_many_arguments)]
fn attend(
    cells: &SpilledCells<'_>,
    (kvh, hd, g, re): (usize, usize, usize, usize),
    slot: usize,
    (a, b): (usize, usize),
    qg: &[f32],
    scale: f32,
    og: &mut [f32],
    mg: &mut [f32],
) -> Result<(), quant::QuantError> {
    let ty = cells.ty;
    og.fill(0.0);
    for m in mg.chunks_mut(2) {
        m[0] = f32::NEG_INFINITY;
        m[1] = 0.0;
    }
    for c in a..b {
        let (kr, vr) = (
            cells.row(slot, c, cells.k_off),
            cells.row(slot, c, cells.v_off),
        );
        for h in 0..g {
            let sc = quant::dot_range(ty, kr, re, kvh * hd, &qg[h * hd..(h + 1) * hd])? * scale;
            let (m, l) = (mg[2 * h], mg[2 * h + 1]);
            let oh = &mut og[h * hd..(h + 1) * hd];
            let mn = m.max(sc);
            if mn > m {
                // A new maximum: what was summed so far is rescaled to it.
                let r = (m - mn).exp();
                oh.iter_mut().for_each(|x| *x *= r);
                mg[2 * h + 1] = l * r;
                mg[2 * h] = mn;
            }
            let p = (sc - mn).exp();
            mg[2 * h + 1] += p;
            quant::axpy_range(ty, vr, re, kvh * hd, p, oh)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::kv::{attention, KvCache, KvGeom};
    use crate::backend::cpu::ops::AttnShape;
    use strata_schemas::dims::Dims;

    /// kv.rs's fixture with two layers and a longer trained context.
    fn dims(n_head: usize, n_head_kv: usize, hd: usize) -> Dims {
        Dims {
            n_layer: 2,
            n_ctx_train: 256,
            ..crate::backend::cpu::kv::tests::dims(n_head, n_head_kv, hd)
        }
    }

    /// A partial over cells `[a, b)` of one head of the whole-context cache, the
    /// straightforward way (what the device's window splits compute): (max, sum, o).
    fn window_partial(
        k: &[Vec<f32>],
        v: &[Vec<f32>],
        qh: &[f32],
        (kvh, hd): (usize, usize),
        (a, b): (usize, usize),
        scale: f32,
    ) -> (f32, f32, Vec<f32>) {
        let s: Vec<f32> = (a..b)
            .map(|c| (0..hd).map(|i| qh[i] * k[c][kvh * hd + i]).sum::<f32>() * scale)
            .collect();
        let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut o = vec![0.0f32; hd];
        let mut l = 0.0f32;
        for (j, c) in (a..b).enumerate() {
            let p = (s[j] - m).exp();
            l += p;
            for i in 0..hd {
                o[i] += p * v[c][kvh * hd + i];
            }
        }
        (m, l, o)
    }

    /// The flash-decoding merge `dq_attn_combine` does: weights exp(m_i - M).
    fn merge(parts: &[(f32, f32, Vec<f32>)]) -> Vec<f32> {
        let mm = parts.iter().map(|p| p.0).fold(f32::NEG_INFINITY, f32::max);
        let hd = parts[0].2.len();
        let (mut out, mut l) = (vec![0.0f32; hd], 0.0f32);
        for (m, pl, o) in parts {
            let w = if *m == f32::NEG_INFINITY {
                0.0
            } else {
                (m - mm).exp()
            };
            l += w * pl;
            for (x, oi) in out.iter_mut().zip(o) {
                *x += w * oi;
            }
        }
        out.iter().map(|x| x / l).collect()
    }

    /// Values of `ty`'s rows as stored (quantised and back), so the window's reference reads
    /// what the cache holds.
    fn stored(ty: GgmlType, x: &[f32]) -> Vec<f32> {
        let mut b = vec![0u8; quant::row_bytes(ty, x.len()).unwrap()];
        quant::quantize_row_into(ty, x, &mut b).unwrap();
        let mut out = vec![0.0f32; x.len()];
        quant::axpy_range(ty, &b, x.len(), 0, 1.0, &mut out).unwrap();
        out
    }

    /// Window partials (reference) merged with the host partials over the pinned-chunk
    /// layout equal the CPU backend's whole attention over the same rows, for F16 and Q8_0
    /// KV, GQA groups of 1, 2 and 4, several windows (none, most, all spilled), chunk sizes
    /// and pieces a token's cells are cut into, two slots and tokens of different lengths.
    #[test]
    fn window_and_host_partials_merge_to_the_whole_attention() {
        let (ctx, slots, layers) = (70usize, 2usize, 2usize);
        for ty in [GgmlType::F16, GgmlType::Q8_0] {
            for (nh, nkv, hd) in [(4, 4, 32), (4, 2, 32), (8, 2, 64)] {
                for (w, per_chunk) in [(0usize, 7usize), (16, 5), (40, 64), (69, 3)] {
                    for pieces in [1, 3, 8] {
                        check_case(
                            ty,
                            (nh, nkv, hd),
                            (ctx, slots, layers),
                            (w, per_chunk),
                            pieces,
                        );
                    }
                }
            }
        }
    }

    fn check_case(
        ty: GgmlType,
        (nh, nkv, hd): (usize, usize, usize),
        (ctx, slots, layers): (usize, usize, usize),
        (w, per_chunk): (usize, usize),
        pieces: usize,
    ) {
        let d = dims(nh, nkv, hd);
        let g = KvGeom::new(&d, ty, layers, ctx).unwrap();
        let rb = g.krb;
        let cell_bytes = layers * 2 * rb + 6; // an MTP-like tail the layer rows skip
        let val = |s: usize, c: usize, i: usize, x: f32| {
            ((s * 131 + c * 17 + i) as f32 * 0.37 + x).sin() * (1.0 + (c % 5) as f32 * 0.4)
        };
        // Every slot's rows, written to a whole-context cache and to the spilled layout.
        let per_slot = ctx - w;
        let n_chunks = (slots * per_slot).div_ceil(per_chunk);
        let mut chunk_bufs: Vec<Vec<u8>> = (0..n_chunks)
            .map(|i| {
                let cells = per_chunk.min(slots * per_slot - i * per_chunk);
                vec![0u8; cells * cell_bytes]
            })
            .collect();
        let mut caches = Vec::new();
        let mut kf = vec![vec![Vec::new(); ctx]; slots];
        let mut vf = vec![vec![Vec::new(); ctx]; slots];
        let l = 1; // the layer attended
        for s in 0..slots {
            let mut cache = KvCache::owned(g).unwrap();
            for layer in 0..layers {
                for c in 0..ctx {
                    let k: Vec<f32> = (0..nkv * hd).map(|i| val(s, c, i, layer as f32)).collect();
                    let v: Vec<f32> = (0..nkv * hd)
                        .map(|i| val(s, c, i, 2.0 + layer as f32))
                        .collect();
                    cache.write(layer, c, &k, &v).unwrap();
                    if layer == l {
                        kf[s][c] = stored(ty, &k);
                        vf[s][c] = stored(ty, &v);
                    }
                    if c >= w {
                        let i = s * per_slot + (c - w);
                        let base = (i % per_chunk) * cell_bytes + layer * 2 * rb;
                        let cb = &mut chunk_bufs[i / per_chunk];
                        quant::quantize_row_into(ty, &k, &mut cb[base..base + rb]).unwrap();
                        quant::quantize_row_into(ty, &v, &mut cb[base + rb..base + 2 * rb])
                            .unwrap();
                    }
                }
            }
            caches.push(cache);
        }
        let chunks: Vec<&[u8]> = chunk_bufs.iter().map(|c| c.as_slice()).collect();
        let cells = SpilledCells {
            chunks: &chunks,
            ty,
            cell_bytes,
            per_chunk,
            resident: w,
            per_slot,
            k_off: l * 2 * rb,
            v_off: l * 2 * rb + rb,
            row_bytes: rb,
        };
        // Three tokens: slot 1 deep in the spill, slot 0 at the window's edge and short.
        let slot = [1u32, 0, 0];
        let n_ctx = [ctx as u32, (w + 1).min(ctx) as u32, (w / 2).max(1) as u32];
        let n = slot.len();
        let q: Vec<f32> = (0..n * nh * hd).map(|i| (i as f32 * 0.21).cos()).collect();
        let scale = 1.0 / (hd as f32).sqrt();
        let (mut o, mut ms) = (vec![f32::NAN; n * nh * hd], vec![f32::NAN; n * nh * 2]);
        let mut scratch = vec![f32::NAN; scratch_len(n, nh, hd, pieces)];
        host_partials(
            &cells,
            (nh, nkv, hd),
            &slot,
            &n_ctx,
            &q,
            scale,
            pieces,
            &mut scratch,
            &mut o,
            &mut ms,
        )
        .unwrap();
        let shape = AttnShape {
            n_head: nh,
            n_head_kv: nkv,
            head_dim_k: hd,
            head_dim_v: hd,
        };
        let mut whole = vec![0.0f32; n * nh * hd];
        attention(shape, &caches, l, &slot, &n_ctx, &q, scale, &mut whole).unwrap();
        let mut worst = 0.0f32;
        for t in 0..n {
            let (s, c) = (slot[t] as usize, n_ctx[t] as usize);
            for h in 0..nh {
                let idx = t * nh + h;
                let qh = &q[idx * hd..(idx + 1) * hd];
                let kvh = h / (nh / nkv);
                let host = (
                    ms[2 * idx],
                    ms[2 * idx + 1],
                    o[idx * hd..(idx + 1) * hd].to_vec(),
                );
                if c <= w {
                    assert_eq!((host.0, host.1), (f32::NEG_INFINITY, 0.0), "{ty} t{t}");
                    assert!(host.2.iter().all(|x| *x == 0.0));
                }
                let mut parts = vec![host];
                // The device's window, as two splits where it has the cells for them.
                let win = c.min(w);
                let cut = win / 2;
                for (a, b) in [(0, cut), (cut, win)] {
                    if b > a {
                        parts.push(window_partial(&kf[s], &vf[s], qh, (kvh, hd), (a, b), scale));
                    }
                }
                let got = merge(&parts);
                for (x, y) in got.iter().zip(&whole[idx * hd..(idx + 1) * hd]) {
                    worst = worst.max((x - y).abs() / y.abs().max(1.0));
                }
            }
        }
        assert!(
            worst < 1e-4,
            "{ty} heads {nh}/{nkv} hd {hd} window {w} chunk {per_chunk} pieces {pieces}: worst {worst}"
        );
        assert!(whole.iter().any(|x| x.abs() > 1e-2), "a non-trivial result");
    }

    #[test]
    fn short_chunks_and_wrong_rows_are_refused() {
        let buf = vec![0u8; 64];
        let chunks = [buf.as_slice()];
        let mut cells = SpilledCells {
            chunks: &chunks,
            ty: GgmlType::F16,
            cell_bytes: 32,
            per_chunk: 2,
            resident: 4,
            per_slot: 2,
            k_off: 0,
            v_off: 16,
            row_bytes: 16,
        };
        let (q, mut o, mut ms) = (vec![0.0; 8], vec![0.0; 8], vec![0.0; 2]);
        let mut sc = vec![0.0; scratch_len(1, 1, 8, 2)];
        let mut run = |cells: &SpilledCells<'_>, slot: u32, ctx: u32| {
            host_partials(
                cells,
                (1, 1, 8),
                &[slot],
                &[ctx],
                &q,
                1.0,
                2,
                &mut sc,
                &mut o,
                &mut ms,
            )
        };
        // Slot 0 fits the one chunk; slot 1's cells are not there.
        run(&cells, 0, 6).unwrap();
        assert!(run(&cells, 1, 6).is_err());
        // A context past the slot's cells.
        assert!(run(&cells, 0, 7).is_err());
        cells.row_bytes = 12;
        assert!(run(&cells, 0, 6).is_err());
        // Scratch for fewer pieces than asked.
        cells.row_bytes = 16;
        let mut short = vec![0.0; scratch_len(1, 1, 8, 1)];
        let (mut o, mut ms) = (vec![0.0; 8], vec![0.0; 2]);
        let r = host_partials(
            &cells,
            (1, 1, 8),
            &[0],
            &[6],
            &q,
            1.0,
            2,
            &mut short,
            &mut o,
            &mut ms,
        );
        assert!(r.is_err());
    }
}
