//! One slot's KV cache on the CPU backend (a resident window in the stage's `kv_cache`
//! region, the other cells one planned `kv_spill` slice each) and causal GQA attention over
//! it.
//! Invariant: the storage is fixed at construction and never grows; a spilled cell and a
//! resident cell hold the same bytes, and attention reads them in the same order, so a split
//! cache gives bit-identical results to a contiguous one.

use super::ops::{AttnShape, OpError};
use crate::quant::{self, QuantError};
use rayon::prelude::*;
use strata_schemas::dims::Dims;
use strata_schemas::ggml::GgmlType;

/// Why a KV cache cannot be built over the storage it was given.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("KV cache: {0}")]
pub struct KvError(pub String);

/// The geometry of one slot's KV: `n_layer` layers of `n_cells` cells, every cell a K row and
/// a V row of all KV heads in `ty`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGeom {
    pub ty: GgmlType,
    pub n_layer: usize,
    pub n_cells: usize,
    pub k_row_elems: usize,
    pub v_row_elems: usize,
    /// Bytes of a K row and of a V row.
    pub krb: usize,
    pub vrb: usize,
}

impl KvGeom {
    /// The geometry for `n_layer` layers of the model `d`, KV stored as `ty`.
    pub fn new(d: &Dims, ty: GgmlType, n_layer: usize, n_cells: usize) -> Result<Self, KvError> {
        if !quant::is_kv_type(ty) {
            return Err(KvError(format!(
                "type {ty} cannot hold KV rows: use f16 or q8_0 (or f32)"
            )));
        }
        let (k_row_elems, v_row_elems) = (d.k_out(), d.v_out());
        let kv_err = |e: QuantError| {
            KvError(format!(
                "{e} (a KV row is n_head_kv x head_dim; pick --kv f16 when it is not a multiple of the block)"
            ))
        };
        let krb = quant::row_bytes(ty, k_row_elems).map_err(kv_err)?;
        let vrb = quant::row_bytes(ty, v_row_elems).map_err(kv_err)?;
        Ok(Self {
            ty,
            n_layer,
            n_cells,
            k_row_elems,
            v_row_elems,
            krb,
            vrb,
        })
    }

    /// Bytes of one cell across every layer (a K row and a V row per layer).
    pub fn cell_bytes(&self) -> usize {
        self.n_layer * (self.krb + self.vrb)
    }
}

#[derive(Debug)]
enum KvBuf<'a> {
    Owned(Vec<u8>),
    Region(&'a mut [u8]),
}

impl KvBuf<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            KvBuf::Owned(v) => v,
            KvBuf::Region(r) => r,
        }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            KvBuf::Owned(v) => v,
            KvBuf::Region(r) => r,
        }
    }
}

/// One slot's KV cache: cells `[0, n_res)` layer-major in one buffer (per layer `n_res` K
/// rows then `n_res` V rows), each cell beyond it in a slice of its own (per layer a K row
/// then a V row). The storage is fixed at construction and never grows; the pipeline tracks
/// how many cells are filled.
#[derive(Debug)]
pub struct KvCache<'a> {
    g: KvGeom,
    buf: KvBuf<'a>,
    n_res: usize,
    spill: Vec<&'a mut [u8]>,
}

impl<'a> KvCache<'a> {
    /// A cache of `g.n_cells` cells that owns its storage, allocated once here.
    pub fn owned(g: KvGeom) -> Result<Self, KvError> {
        let n = g
            .cell_bytes()
            .checked_mul(g.n_cells)
            .ok_or_else(|| KvError(format!("{} cells do not fit in memory", g.n_cells)))?;
        Ok(Self {
            g,
            buf: KvBuf::Owned(vec![0u8; n]),
            n_res: g.n_cells,
            spill: Vec::new(),
        })
    }

    /// A cache whose first `resident_cells` cells live in `resident` (a planned `kv_cache`
    /// slice) and whose other cells each live in one slice of `spill` (planned `kv_spill`
    /// host memory); `g.n_cells` must be `resident_cells + spill.len()`.
    pub fn split(
        g: KvGeom,
        resident_cells: usize,
        resident: &'a mut [u8],
        spill: Vec<&'a mut [u8]>,
    ) -> Result<Self, KvError> {
        if g.n_cells != resident_cells + spill.len() {
            return Err(KvError(format!(
                "{} cells planned but {resident_cells} resident + {} spilled given",
                g.n_cells,
                spill.len()
            )));
        }
        let need = g.cell_bytes() * resident_cells;
        if resident.len() < need {
            return Err(KvError(format!(
                "the resident KV slice holds {} bytes but {resident_cells} cells of {} layers of {} need {need}",
                resident.len(),
                g.n_layer,
                g.ty
            )));
        }
        if let Some((i, c)) = spill
            .iter()
            .enumerate()
            .find(|(_, c)| c.len() < g.cell_bytes())
        {
            return Err(KvError(format!(
                "spilled KV cell {i} holds {} bytes but a cell of {} layers of {} needs {}",
                c.len(),
                g.n_layer,
                g.ty,
                g.cell_bytes()
            )));
        }
        Ok(Self {
            g,
            buf: KvBuf::Region(&mut resident[..need]),
            n_res: resident_cells,
            spill,
        })
    }

    /// The cache's geometry.
    pub fn geom(&self) -> &KvGeom {
        &self.g
    }

    /// Cells kept in the resident window (the rest are spilled).
    pub fn resident_cells(&self) -> usize {
        self.n_res
    }

    fn layer(&self, l: usize) -> KvRead<'_> {
        KvRead {
            g: self.g,
            l,
            n_res: self.n_res,
            res: self.buf.bytes(),
            spill: &self.spill,
        }
    }

    /// Copy cells `[0, cells)` of every layer from `src` (a cache of the same geometry).
    pub fn copy_prefix_from(&mut self, src: &KvCache<'_>, cells: usize) -> Result<(), KvError> {
        let g = self.g;
        if src.g != g || src.n_res != self.n_res || cells > g.n_cells {
            return Err(KvError(format!(
                "cannot copy {cells} cells between KV caches of different shapes ({} and {} cells)",
                src.g.n_cells, g.n_cells
            )));
        }
        let res = cells.min(self.n_res);
        let (krb, vrb, n_res) = (g.krb, g.vrb, self.n_res);
        let (from, to) = (src.buf.bytes(), self.buf.bytes_mut());
        for l in 0..g.n_layer {
            let base = l * n_res * (krb + vrb);
            let (k, v) = (base, base + n_res * krb);
            to[k..k + res * krb].copy_from_slice(&from[k..k + res * krb]);
            to[v..v + res * vrb].copy_from_slice(&from[v..v + res * vrb]);
        }
        for c in 0..cells.saturating_sub(n_res) {
            let n = g.cell_bytes();
            self.spill[c][..n].copy_from_slice(&src.spill[c][..n]);
        }
        Ok(())
    }

    /// Store layer `l`'s K and V rows of one token at `cell`.
    pub fn write(&mut self, l: usize, cell: usize, k: &[f32], v: &[f32]) -> Result<(), OpError> {
        let g = self.g;
        if l >= g.n_layer || cell >= g.n_cells {
            return Err(OpError::KvRange {
                token: l,
                n_ctx: cell + 1,
                n_cells: g.n_cells,
            });
        }
        let (kb, vb): (&mut [u8], &mut [u8]) = if cell < self.n_res {
            let base = l * self.n_res * (g.krb + g.vrb);
            let b = self.buf.bytes_mut();
            let (head, tail) = b[base..].split_at_mut(self.n_res * g.krb);
            (
                &mut head[cell * g.krb..(cell + 1) * g.krb],
                &mut tail[cell * g.vrb..(cell + 1) * g.vrb],
            )
        } else {
            let c = &mut self.spill[cell - self.n_res];
            let off = l * (g.krb + g.vrb);
            c[off..off + g.krb + g.vrb].split_at_mut(g.krb)
        };
        quant::quantize_row_into(g.ty, &k[..g.k_row_elems], kb)?;
        quant::quantize_row_into(g.ty, &v[..g.v_row_elems], vb)?;
        Ok(())
    }
}

/// Read access to one layer of one slot's KV, wherever its cells live.
#[derive(Clone, Copy)]
struct KvRead<'b> {
    g: KvGeom,
    l: usize,
    n_res: usize,
    res: &'b [u8],
    spill: &'b [&'b mut [u8]],
}

impl KvRead<'_> {
    fn k_row(&self, c: usize) -> &[u8] {
        let g = &self.g;
        if c < self.n_res {
            let base = self.l * self.n_res * (g.krb + g.vrb);
            &self.res[base + c * g.krb..base + (c + 1) * g.krb]
        } else {
            let off = self.l * (g.krb + g.vrb);
            &self.spill[c - self.n_res][off..off + g.krb]
        }
    }
    fn v_row(&self, c: usize) -> &[u8] {
        let g = &self.g;
        if c < self.n_res {
            let base = self.l * self.n_res * (g.krb + g.vrb) + self.n_res * g.krb;
            &self.res[base + c * g.vrb..base + (c + 1) * g.vrb]
        } else {
            let off = self.l * (g.krb + g.vrb) + g.krb;
            &self.spill[c - self.n_res][off..off + g.vrb]
        }
    }
}

/// Causal GQA attention of layer `l`: token `t` (of `n_tok`; queries `q`, `n_tok x n_head x
/// head_dim_k`) reads the cells `0..n_ctx(t)` of `caches[slot(t)]` (its own K/V already
/// written); `out` gets `n_tok x n_head x head_dim_v`. Query head `h` reads KV head
/// `h / (n_head / n_head_kv)`. Parallel over (token, head); softmax in f32 with the running
/// maximum taken first.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    shape: AttnShape,
    caches: &[KvCache<'_>],
    l: usize,
    slot: &[u32],
    n_ctx: &[u32],
    q: &[f32],
    scale: f32,
    out: &mut [f32],
) -> Result<(), OpError> {
    let AttnShape {
        n_head,
        n_head_kv,
        head_dim_k: hdk,
        head_dim_v: hdv,
    } = shape;
    let n_tok = slot.len().min(n_ctx.len());
    if n_head_kv == 0 || n_head % n_head_kv != 0 {
        return Err(OpError::Shape {
            op: "attention",
            what: "n_head (a multiple of n_head_kv)",
            expected: n_head_kv,
            got: n_head,
        });
    }
    for t in 0..n_tok {
        let s = slot[t] as usize;
        let kv = caches.get(s).ok_or(OpError::Shape {
            op: "attention",
            what: "slot",
            expected: s + 1,
            got: caches.len(),
        })?;
        let c = n_ctx[t] as usize;
        if c == 0 || c > kv.g.n_cells || l >= kv.g.n_layer {
            return Err(OpError::KvRange {
                token: t,
                n_ctx: c,
                n_cells: kv.g.n_cells,
            });
        }
        if kv.g.k_row_elems < n_head_kv * hdk || kv.g.v_row_elems < n_head_kv * hdv {
            return Err(OpError::Shape {
                op: "attention",
                what: "KV row elements",
                expected: n_head_kv * hdk.max(hdv),
                got: kv.g.k_row_elems.min(kv.g.v_row_elems),
            });
        }
    }
    if q.len() < n_tok * n_head * hdk || out.len() < n_tok * n_head * hdv {
        return Err(OpError::Shape {
            op: "attention",
            what: "q / out",
            expected: n_tok * n_head * hdk.max(hdv),
            got: q.len().min(out.len()),
        });
    }
    let group = n_head / n_head_kv;
    out[..n_tok * n_head * hdv]
        .par_chunks_mut(hdv)
        .enumerate()
        .for_each(|(idx, o)| {
            let (t, h) = (idx / n_head, idx % n_head);
            let kvh = h / group;
            let qh = &q[idx * hdk..(idx + 1) * hdk];
            let kv = caches[slot[t] as usize].layer(l);
            let ctx = n_ctx[t] as usize;
            let (ty, kre, vre) = (kv.g.ty, kv.g.k_row_elems, kv.g.v_row_elems);
            let score = |c: usize| {
                quant::dot_range(ty, kv.k_row(c), kre, kvh * hdk, qh).unwrap_or(f32::NAN) * scale
            };
            let mut m = f32::NEG_INFINITY;
            for c in 0..ctx {
                m = m.max(score(c));
            }
            o.fill(0.0);
            let mut sum = 0f32;
            for c in 0..ctx {
                let e = (score(c) - m).exp();
                sum += e;
                if quant::axpy_range(ty, kv.v_row(c), vre, kvh * hdv, e, o).is_err() {
                    o.fill(f32::NAN);
                    return;
                }
            }
            for v in o.iter_mut() {
                *v /= sum;
            }
        });
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// One attention layer of `n_head` query heads over `n_head_kv` KV heads of `hd`, nothing
    /// else (host_attn.rs's tests share it).
    pub(crate) fn dims(n_head: usize, n_head_kv: usize, hd: usize) -> Dims {
        Dims {
            n_layer: 1,
            e: 8,
            vocab: 8,
            n_head,
            n_head_kv,
            hd,
            hd_v: hd,
            n_rot: hd,
            n_expert: 0,
            k: 0,
            f: 0,
            n_ff: 0,
            n_ff_shexp: 0,
            eps: 1e-6,
            norm_topk: true,
            rope_theta: 1e4,
            n_ctx_train: 16,
            lin_k_heads: 0,
            lin_v_heads: 0,
            lin_hk: 0,
            lin_hv: 0,
            conv_k: 0,
        }
    }

    #[test]
    fn attention_gqa_two_cells_by_hand() {
        // 2 query heads share 1 KV head of dim 2. Cells: k0 = (1,0), k1 = (0,1); v0 = (1,2),
        // v1 = (3,4). Query head 0 = (ln 3, 0) with scale 1: scores (ln 3, 0) -> weights
        // (3/4, 1/4) -> out = (1.5, 2.5). Head 1 = (0,0): uniform -> (2, 3).
        let g = KvGeom::new(&dims(2, 1, 2), GgmlType::F16, 1, 2).unwrap();
        let mut kv = KvCache::owned(g).unwrap();
        kv.write(0, 0, &[1.0, 0.0], &[1.0, 2.0]).unwrap();
        kv.write(0, 1, &[0.0, 1.0], &[3.0, 4.0]).unwrap();
        let shape = AttnShape {
            n_head: 2,
            n_head_kv: 1,
            head_dim_k: 2,
            head_dim_v: 2,
        };
        let caches = [kv];
        let q = [3f32.ln(), 0.0, 0.0, 0.0];
        let mut out = [0f32; 4];
        attention(shape, &caches, 0, &[0], &[2], &q, 1.0, &mut out).unwrap();
        let want = [1.5, 2.5, 2.0, 3.0];
        for (a, b) in out.iter().zip(want) {
            assert!((a - b).abs() < 1e-3, "{out:?}");
        }
        // Causal: seeing only cell 0 gives v0 exactly.
        attention(shape, &caches, 0, &[0], &[1], &q, 1.0, &mut out).unwrap();
        assert_eq!(out, [1.0, 2.0, 1.0, 2.0]);
        assert!(attention(shape, &caches, 0, &[0], &[3], &q, 1.0, &mut out).is_err());
        assert!(attention(shape, &caches, 0, &[1], &[1], &q, 1.0, &mut out).is_err());
    }

    #[test]
    fn a_split_cache_reads_what_a_contiguous_one_does() {
        let d = dims(2, 2, 4);
        let g = KvGeom::new(&d, GgmlType::Q8_0, 2, 5).unwrap_err();
        assert!(g.to_string().contains("--kv f16"), "{g}");
        let g = KvGeom::new(&d, GgmlType::F16, 2, 5).unwrap();
        let mut whole = KvCache::owned(g).unwrap();
        let mut res = vec![0u8; 2 * g.cell_bytes()];
        let mut cells: Vec<Vec<u8>> = (0..3).map(|_| vec![0u8; g.cell_bytes()]).collect();
        let spill: Vec<&mut [u8]> = cells.iter_mut().map(|c| c.as_mut_slice()).collect();
        let mut split = KvCache::split(g, 2, &mut res, spill).unwrap();
        for l in 0..2 {
            for c in 0..5 {
                let k: Vec<f32> = (0..8).map(|i| (i + c * 3 + l) as f32 * 0.1).collect();
                let v: Vec<f32> = (0..8).map(|i| (i * c + l) as f32 * -0.2).collect();
                whole.write(l, c, &k, &v).unwrap();
                split.write(l, c, &k, &v).unwrap();
            }
        }
        let shape = AttnShape {
            n_head: 2,
            n_head_kv: 2,
            head_dim_k: 4,
            head_dim_v: 4,
        };
        let q: Vec<f32> = (0..16).map(|i| (i as f32 * 0.37).sin()).collect();
        let (mut a, mut b) = ([0f32; 16], [0f32; 16]);
        let whole = [whole];
        let split = [split];
        attention(shape, &whole, 1, &[0, 0], &[5, 3], &q, 0.5, &mut a).unwrap();
        attention(shape, &split, 1, &[0, 0], &[5, 3], &q, 0.5, &mut b).unwrap();
        assert_eq!(a, b);
        assert!(whole[0].geom().n_cells == 5 && split[0].resident_cells() == 2);
    }
}
