//! The seam's ops on CUDA: which kernels each op launches for the pass being issued. Decode
//! passes (and short prefill passes) take the one-token and few-token kernels — RMSNorm,
//! Q/K/V in one launch, the one-launch attention where the model allows it, the router with
//! its norm and top-k fused, MoE gate/up and down reading the expert table; prefill passes of
//! 16 tokens or more take the tensor-core products (the input converted once per product
//! group, the output projection added into the residual, the experts grouped by `moe_sort`)
//! and the flash prefill attention. The few-token products over Q8_0 weights (by default;
//! with `--kernel-options dp4a` also Q4_K, Q6_K and IQ3_S) go to `int8_products.rs` first.
//! Invariant: every choice depends only on the pass kind, its token count and what was bound
//! at start-up, so a decode pass issues the same launches every time it has the same count
//! (what graph replay needs).

use super::flash::{self, PrefillAttn};
use super::gemm::{gemm_col_multiple, ExpertSource, GemmTile, MoeInput, MOE_DEFAULT_TILE};
use super::kv_spill::KvHostArg;
use super::launch::attention::{self, Heads, KvLayer, Splits};
use super::launch::decode::{self, ExpertTable, FusedTopk, InNorm};
use super::launch::linear;
use super::launch::{kty, Launcher, Mat};
use super::stage::CudaStage;
use super::{CudaError, DeviceView};
use crate::backend::{Attention, Ops, Route, StepKind, WorkBuf};
use strata_schemas::ggml::GgmlType;

/// Prefill passes of at least this many tokens use the tensor-core products.
pub const GEMM_MIN_TOK: usize = 16;

/// A weight matrix bound on a stage: `rows x cols` of `ty` at an offset of its arena.
#[derive(Debug, Clone, Copy)]
pub struct CMat {
    pub off: u64,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
}

/// An f32 vector of `n` at an offset of the stage's arena.
#[derive(Debug, Clone, Copy)]
pub struct CVec {
    pub off: u64,
    pub n: usize,
}

/// Expert `e`'s gate, up and down matrices at `gate + e * gu_stride` etc. (arena offsets),
/// one type: what the grouped prefill products read.
#[derive(Debug, Clone, Copy)]
pub struct Stacks {
    pub gate: u64,
    pub up: u64,
    pub down: u64,
    pub gu_stride: u64,
    pub down_stride: u64,
}

/// Where the grouped prefill products read a layer's experts.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Grouped {
    /// Strided stacks (a whole stack, or consecutive cache slots).
    Stacks(Stacks),
    /// The expert table at arena offset `off` (`3 x n_expert` u64 addresses): the expert
    /// cache's slots, wherever the experts of a group were put.
    Table { off: u64 },
}

/// A layer's routed experts on a stage: the table of every expert's matrix addresses, the
/// types of the gate, up and down matrices (a quantizer's mix may give each its own), and the
/// experts as strided stacks when they sit at a fixed stride (a whole stack, or consecutive
/// cache slots) and share one type.
#[derive(Debug, Clone, Copy)]
pub struct CExperts {
    pub table_off: u64,
    pub ty: GgmlType,
    pub ty_up: GgmlType,
    pub ty_down: GgmlType,
    pub stacks: Option<Stacks>,
}

fn shape(op: &'static str, detail: impl Into<String>) -> CudaError {
    CudaError::Shape {
        op,
        detail: detail.into(),
    }
}

/// Bytes of a `rows x cols` matrix of `ty`.
pub(crate) fn mat_bytes(ty: GgmlType, rows: usize, cols: usize) -> Result<u64, CudaError> {
    let rb = crate::quant::row_bytes(ty, cols)
        .map_err(|e| shape("matrix", format!("{ty} rows of {cols}: {e}")))?;
    Ok(rb as u64 * rows as u64)
}

impl CudaStage {
    fn mat(&self, m: CMat) -> Result<Mat<'_>, CudaError> {
        Ok(Mat {
            w: self.view(m.off, mat_bytes(m.ty, m.rows, m.cols)?)?,
            ty: m.ty,
            rows: m.rows,
            cols: m.cols,
        })
    }

    fn vec(&self, v: CVec) -> Result<DeviceView<'_>, CudaError> {
        self.view(v.off, 4 * v.n as u64)
    }

    /// `n` rows of `width` f32 of buffer `b`.
    fn rows(&self, b: WorkBuf, n: usize, width: usize) -> Result<DeviceView<'_>, CudaError> {
        self.buf_at(b, 0, 4 * (n * width) as u64)
    }

    /// Whether this pass takes the tensor-core products (a prefill or mixed pass of at least
    /// [`GEMM_MIN_TOK`] rows: the products are row-wise, so a mixed pass's decode rows ride
    /// along).
    fn gemm_pass(&self, n: usize) -> bool {
        self.kind.prefills() && self.flags.gemm && n >= GEMM_MIN_TOK
    }

    fn gemm_fits(m: &CMat) -> bool {
        let c = gemm_col_multiple(m.ty);
        c != 0 && m.cols % c == 0
    }

    /// Tensor-core products of one input: `x` rounded to 16 bits once per input type, then
    /// each product (added into its output when `acc`).
    fn gemm_products(
        &self,
        l: &Launcher<'_>,
        label: &'static str,
        x: WorkBuf,
        outs: &[(CMat, WorkBuf)],
        n: usize,
        acc: bool,
    ) -> Result<(), CudaError> {
        let xh = self.buf(WorkBuf::Xh)?;
        let mut converted: Option<bool> = None;
        for (m, y) in outs {
            let bf16 = m.ty == GgmlType::BF16;
            if converted != Some(bf16) {
                let xv = self.rows(x, n, m.cols)?;
                l.timed("gemm_convert_x", || {
                    self.dev.gemm_convert_x(xv, n, m.cols, m.ty, xh)
                })?;
                converted = Some(bf16);
            }
            let w = self.mat(*m)?;
            let yv = self.rows(*y, n, m.rows)?;
            let tile = self.dev.gemm_default_tile(m.ty, m.rows, n);
            l.timed(label, || {
                self.dev.gemm_converted(
                    tile,
                    self.opts.any_load,
                    w.w,
                    m.ty,
                    m.rows,
                    m.cols,
                    xh,
                    n,
                    yv,
                    acc,
                )
            })?;
        }
        Ok(())
    }

    /// `y_j = W_j x` for outputs given as views (rows of `n` tokens): the tensor-core
    /// products where this pass takes them and the weights fit, the few-token products
    /// otherwise.
    fn products(
        &self,
        l: &Launcher<'_>,
        x: DeviceView<'_>,
        outs: &[(CMat, DeviceView<'_>)],
        n: usize,
    ) -> Result<(), CudaError> {
        let stage = self.opts.stage_inputs;
        let mut converted: Option<bool> = None;
        for (m, y) in outs {
            if self.gemm_pass(n) && Self::gemm_fits(m) {
                let xh = self.buf(WorkBuf::Xh)?;
                let bf16 = m.ty == GgmlType::BF16;
                if converted != Some(bf16) {
                    l.timed("gemm_convert_x", || {
                        self.dev.gemm_convert_x(x, n, m.cols, m.ty, xh)
                    })?;
                    converted = Some(bf16);
                }
                let w = self.mat(*m)?;
                let tile = self.dev.gemm_default_tile(m.ty, m.rows, n);
                l.timed("gemm_shexp", || {
                    self.dev.gemm_converted(
                        tile,
                        self.opts.any_load,
                        w.w,
                        m.ty,
                        m.rows,
                        m.cols,
                        xh,
                        n,
                        *y,
                        false,
                    )
                })?;
            } else {
                decode::mv(l, "mv_shexp", self.mat(*m)?, x, None, *y, n, false, stage)?;
            }
        }
        Ok(())
    }

    /// The prefill router's logits of `n` tokens from `xn`: a split-K F32 product whose
    /// partials go to `yd` (the experts write it only later), summed in a fixed order; routers
    /// stored in other types use the matrix-vector kernels.
    fn router_prefill(&self, l: &Launcher<'_>, w: Mat<'_>, n: usize) -> Result<(), CudaError> {
        let (rows, cols) = (w.rows, w.cols);
        let xn = self.rows(WorkBuf::Xn, n, cols)?;
        let logits = self.rows(WorkBuf::Router, n, rows)?;
        let yd = self.buf(WorkBuf::Yd)?;
        if w.ty == GgmlType::F32 && cols % 32 == 0 {
            // Enough blocks for every SM twice over, K chunks of whole 32-wide tiles, and
            // partials that fit in yd.
            let tiles = n.div_ceil(64) * rows.div_ceil(32);
            let mut splits = 264usize.div_ceil(tiles).clamp(1, 16).min(cols / 32);
            while splits > 1 && (4 * splits * n * rows) as u64 > yd.len() {
                splits /= 2;
            }
            if (4 * splits * n * rows) as u64 <= yd.len() {
                return decode::sgemm_split(l, w, xn, n, splits, yd, logits);
            }
        }
        decode::mv(l, "mv_router", w, xn, None, logits, n, false, false)
    }

    /// The experts of a prefill pass on the tensor-core products: assignments grouped by
    /// expert (`moe_sort`), a fused gate-up-SwiGLU product, the down product, then the
    /// weighted sum added into `y` — for the `n` tokens from row `t0` of the pass, reading
    /// the experts where `src` says (strided stacks, or the expert cache's table).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn experts_grouped(
        &self,
        l: &Launcher<'_>,
        src: Grouped,
        [ty, ty_down]: [GgmlType; 2],
        [xn, ids, wts, y]: [WorkBuf; 4],
        t0: usize,
        n: usize,
    ) -> Result<(), CudaError> {
        let d = self.d;
        let (e, f, k, ne) = (d.e, d.f, d.k, d.n_expert);
        let xh = self.buf(WorkBuf::Xh)?;
        let sorted = self.buf(WorkBuf::Sorted)?;
        let from = |b: WorkBuf, width: usize| {
            self.buf_at(b, (4 * t0 * width) as u64, (4 * n * width) as u64)
        };
        let idv = from(ids, k)?;
        l.timed("moe_sort", || self.dev.moe_sort(idv, n, k, ne, sorted))?;
        let xv = from(xn, e)?;
        l.timed("gemm_convert_x", || {
            self.dev.gemm_convert_x(xv, n, e, ty, xh)
        })?;
        let h = self.rows(WorkBuf::H, n * k, f)?;
        let (gate_up, down) = match src {
            Grouped::Stacks(s) => {
                let gu_span = s.gu_stride * (ne as u64 - 1) + mat_bytes(ty, f, e)?;
                let dn_span = s.down_stride * (ne as u64 - 1) + mat_bytes(ty_down, e, f)?;
                (
                    ExpertSource::Strided {
                        w: self.view(s.gate, gu_span)?,
                        wu: Some(self.view(s.up, gu_span)?),
                        stride: s.gu_stride,
                    },
                    ExpertSource::Strided {
                        w: self.view(s.down, dn_span)?,
                        wu: None,
                        stride: s.down_stride,
                    },
                )
            }
            Grouped::Table { off } => {
                let table = self.view(off, 24 * ne as u64)?;
                (
                    ExpertSource::Table {
                        table,
                        col: 0,
                        fused_up: true,
                    },
                    ExpertSource::Table {
                        table,
                        col: 2,
                        fused_up: false,
                    },
                )
            }
        };
        l.timed("moe_gemm_glu", || {
            self.dev.moe_gemm_from(
                GemmTile::M64,
                self.opts.any_load,
                gate_up,
                ty,
                ne,
                f,
                e,
                xh,
                MoeInput::Gather,
                n,
                k,
                sorted,
                h,
            )
        })?;
        l.timed("gemm_convert_x", || {
            self.dev.gemm_convert_x(h, n * k, f, ty_down, xh)
        })?;
        let yd = self.rows(WorkBuf::Yd, n * k, e)?;
        l.timed("moe_gemm_down", || {
            self.dev.moe_gemm_from(
                MOE_DEFAULT_TILE,
                self.opts.any_load,
                down,
                ty_down,
                ne,
                e,
                f,
                xh,
                MoeInput::Direct,
                n,
                k,
                sorted,
                yd,
            )
        })?;
        let (wv, yv) = (from(wts, k)?, from(y, e)?);
        decode::moe_combine(l, yd, wv, k, e, yv, n)
    }

    /// Whether a prefill pass of `n` tokens takes the grouped products for experts of
    /// these types (gate and up of one type for the fused launch; down may be of another,
    /// as Q4_K_M's Q6_K down layers, each read through its own type's tiles).
    pub(crate) fn grouped_experts(&self, n: usize, [ty, ty_up, ty_down]: [GgmlType; 3]) -> bool {
        let d = self.d;
        let fits = |ty: GgmlType| {
            let c = gemm_col_multiple(ty);
            c != 0 && d.e % c == 0 && d.f % c == 0
        };
        self.gemm_pass(n) && ty_up == ty && fits(ty) && fits(ty_down)
    }

    fn heads(&self, q_norm: CVec, k_norm: CVec) -> Result<Heads<'_>, CudaError> {
        let d = self.d;
        Ok(Heads {
            n_head: d.n_head,
            n_head_kv: d.n_head_kv,
            hd: d.hd,
            n_rot: d.n_rot,
            eps: d.eps,
            attn_factor: self.attn_factor,
            inv_freq: self.buf(WorkBuf::InvFreq)?,
            q_norm: self.vec(q_norm)?,
            k_norm: self.vec(k_norm)?,
        })
    }

    /// KV layer `l` of the stage: one of its main full-attention layers, or (the one after
    /// them) the MTP block's, in its own window of the `mtp` region.
    fn kv_layer(&self, l: usize) -> Result<KvLayer<'_>, CudaError> {
        let [_, pos, slot] = self.inputs()?;
        let (geo, l) = match &self.mtp_kv {
            Some(m) if l == self.kv.layers() => (m, 0),
            _ => (&self.kv, l),
        };
        if l >= geo.layers() {
            return Err(shape(
                "attention",
                format!("KV layer {l} on a stage holding {} KV layers", geo.layers()),
            ));
        }
        let (k_off, v_off) = geo.layer(l);
        Ok(KvLayer {
            kv: self.view(geo.region.off, geo.region.bytes)?,
            slot_bytes: geo.slot_bytes,
            k_off,
            v_off,
            row_bytes: geo.row_bytes,
            cells: geo.cells,
            ty: geo.ty,
            host: geo.host_arg(l),
            slot,
            pos,
        })
    }

    /// Whether every token of the `n`-token pass being issued sits in the VRAM window (so its
    /// attention reads no spilled cell).
    fn below_window(&self, n: usize) -> bool {
        let m = self.max_tok;
        let w = self.kv.cells as i64;
        self.host_in[m..m + n].iter().all(|&p| (p as i64) < w)
    }

    /// The split-KV decode attention of the `dn` rows from row `p` of the pass (a mixed
    /// pass's decode rows, their K/V already stored): queries, outputs, slots, positions and
    /// context lengths are the same buffers' views from row p.
    fn attn_decode_rows(
        &self,
        l: &Launcher<'_>,
        h: Heads<'_>,
        a: &Attention<CVec>,
        kv: KvLayer<'_>,
        p: usize,
        dn: usize,
    ) -> Result<(), CudaError> {
        let d = self.d;
        let at = |b: WorkBuf, width: usize| {
            self.buf_at(b, (4 * p * width) as u64, (4 * dn * width) as u64)
        };
        let (q, out) = (at(a.q, d.q_out())?, at(a.out, d.att_out())?);
        let n_ctx = at(WorkBuf::NCtx, 1)?;
        let m = 4 * self.max_tok as u64;
        let (row, len) = (4 * p as u64, 4 * dn as u64);
        let kv = KvLayer {
            pos: self.buf_at(WorkBuf::Inputs, m + row, len)?,
            slot: self.buf_at(WorkBuf::Inputs, 2 * m + row, len)?,
            ..kv
        };
        attention::attn_decode(l, h, q, kv, n_ctx, self.splits()?, out, dn)
    }

    fn splits(&self) -> Result<Splits<'_>, CudaError> {
        Ok(Splits {
            n: self.att_splits,
            part_o: self.buf(WorkBuf::PartO)?,
            part_ms: self.buf(WorkBuf::PartMs)?,
        })
    }
}

impl Ops for CudaStage {
    type Mat = CMat;
    type Vector = CVec;
    type Experts = CExperts;
    type Error = CudaError;

    fn pass_start(&mut self, n: usize) -> Result<(), CudaError> {
        if n == 0 || n > self.max_tok {
            return Err(shape(
                "pass",
                format!("{n} tokens for passes of at most {}", self.max_tok),
            ));
        }
        let [_, pos, _] = self.inputs()?;
        let n_ctx = self.buf(WorkBuf::NCtx)?;
        decode::ctx_from_pos(&self.launcher(), pos, n_ctx, n)
    }

    fn embed(&mut self, table: CMat, out: WorkBuf, n: usize) -> Result<(), CudaError> {
        let [tok, _, _] = self.inputs()?;
        let o = self.rows(out, n, table.cols)?;
        decode::get_rows(&self.launcher(), self.mat(table)?, tok, o, n)
    }

    fn rms_norm(
        &mut self,
        x: WorkBuf,
        first: usize,
        w: CVec,
        out: WorkBuf,
        n: usize,
    ) -> Result<(), CudaError> {
        let e = w.n;
        let xv = self.buf_at(x, (4 * first * e) as u64, (4 * n * e) as u64)?;
        let o = self.rows(out, n, e)?;
        let wv = self.vec(w)?;
        decode::rmsnorm(&self.launcher(), xv, None, None, wv, o, e, self.d.eps, n)
    }

    fn project(&mut self, x: WorkBuf, outs: &[(CMat, WorkBuf)], n: usize) -> Result<(), CudaError> {
        let l = self.launcher();
        if self.gemm_pass(n) {
            // The tensor-core products for the types they read, the few-token products for
            // the rest of a mix (e.g. Q4_K_M's Q6_K V projection).
            let (fit, rest): (Vec<_>, Vec<_>) = outs.iter().partition(|(m, _)| Self::gemm_fits(m));
            if !fit.is_empty() {
                let label = if fit.len() == 3 { "gemm_qkv" } else { "gemm" };
                self.gemm_products(&l, label, x, &fit, n, false)?;
            }
            let stage = self.opts.stage_inputs;
            for (m, y) in rest {
                let (xv, yv) = (self.rows(x, n, m.cols)?, self.rows(y, n, m.rows)?);
                decode::mv(&l, "mv", self.mat(m)?, xv, None, yv, n, false, stage)?;
            }
            return Ok(());
        }
        if self.int8_products(&l, "mv_q8a", x, outs, n, false)? {
            return Ok(());
        }
        let stage = self.opts.stage_inputs;
        if let [(q, yq), (k, yk), (v, yv)] = outs {
            if decode::qkv_fuses([(q.ty, q.cols), (k.ty, k.cols), (v.ty, v.cols)]) {
                let xv = self.rows(x, n, q.cols)?;
                let mats = [self.mat(*q)?, self.mat(*k)?, self.mat(*v)?];
                let ys = [
                    self.rows(*yq, n, q.rows)?,
                    self.rows(*yk, n, k.rows)?,
                    self.rows(*yv, n, v.rows)?,
                ];
                return decode::qkv(&l, mats, xv, ys, n, stage);
            }
        }
        for (m, y) in outs {
            let (xv, yv) = (self.rows(x, n, m.cols)?, self.rows(*y, n, m.rows)?);
            decode::mv(&l, "mv", self.mat(*m)?, xv, None, yv, n, false, stage)?;
        }
        Ok(())
    }

    fn project_add(&mut self, w: CMat, x: WorkBuf, y: WorkBuf, n: usize) -> Result<(), CudaError> {
        let l = self.launcher();
        if self.gemm_pass(n) && Self::gemm_fits(&w) {
            return self.gemm_products(&l, "gemm_o", x, &[(w, y)], n, true);
        }
        if self.int8_products(&l, "mv_o", x, &[(w, y)], n, true)? {
            return Ok(());
        }
        let (xv, yv) = (self.rows(x, n, w.cols)?, self.rows(y, n, w.rows)?);
        let stage = self.opts.stage_inputs;
        decode::mv(&l, "mv_o", self.mat(w)?, xv, None, yv, n, true, stage)
    }

    fn attention(&mut self, a: &Attention<CVec>, n: usize) -> Result<(), CudaError> {
        let l = self.launcher();
        let d = self.d;
        let (Some(qn), Some(kn)) = (a.q_norm, a.k_norm) else {
            return Err(shape(
                "attention",
                "the CUDA attention kernels apply Q/K norms; this model has none",
            ));
        };
        let h = self.heads(qn, kn)?;
        let kv = self.kv_layer(a.kv_layer)?;
        let q = self.rows(a.q, n, d.q_out())?;
        let k = self.rows(a.k, n, d.k_out())?;
        let v = self.rows(a.v, n, d.v_out())?;
        let out = self.rows(a.out, n, d.att_out())?;
        if self.decoding() && self.flags.fused_attention {
            // The attention's counters follow the router's (one per token of the pass).
            let m = 4 * self.max_tok as u64;
            let counters = self.buf_at(WorkBuf::Counters, m, 4 * (n * d.n_head_kv) as u64)?;
            let chunk = self.opts.attn_chunk;
            return attention::attn_fused(
                &l,
                h,
                q,
                k,
                v,
                kv,
                self.splits()?,
                chunk,
                counters,
                out,
                n,
            );
        }
        // QK-norm + RoPE and the KV store: one launch, or three where q8_0 KV blocks would
        // straddle heads (head dims not a multiple of 32).
        if Some(kv.ty) == kty(GgmlType::Q8_0) && d.hd % 32 != 0 {
            let (pos, inv) = (kv.pos, h.inv_freq);
            decode::qk_norm_rope(
                &l,
                q,
                h.q_norm,
                d.eps,
                pos,
                inv,
                h.attn_factor,
                d.n_head,
                d.hd,
                d.n_rot,
                n,
            )?;
            decode::qk_norm_rope(
                &l,
                k,
                h.k_norm,
                d.eps,
                pos,
                inv,
                h.attn_factor,
                d.n_head_kv,
                d.hd,
                d.n_rot,
                n,
            )?;
            attention::kv_store(&l, k, v, kv, d.k_out(), n)?;
        } else {
            attention::rope_store(&l, h, q, k, v, kv, n)?;
        }
        if self.decoding() {
            let n_ctx = self.buf(WorkBuf::NCtx)?;
            if self.kv_cpu_pass(n) {
                // --kv-host cpu: the cells past the window on the host CPU (kv_host_attn.rs).
                return self.attn_decode_host(&l, h, q, kv, n_ctx, self.splits()?, out, n);
            }
            return attention::attn_decode(&l, h, q, kv, n_ctx, self.splits()?, out, n);
        }
        // A mixed pass: its prompt rows `0..p` take the prefill attention, its decode rows
        // `p..n` (one token of another slot each) the split-KV decode attention, launched over
        // the same buffers from row p.
        let p = match self.kind {
            StepKind::Mixed { prefill } if prefill == 0 || prefill > n => {
                return Err(shape(
                    "attention",
                    format!("a mixed pass of {n} rows with {prefill} prompt rows"),
                ));
            }
            StepKind::Mixed { prefill } => prefill,
            _ => n,
        };
        if p < n {
            self.attn_decode_rows(&l, h, a, kv, p, n - p)?;
        }
        let (q, out) = (
            self.rows(a.q, p, d.q_out())?,
            self.rows(a.out, p, d.att_out())?,
        );
        let n = p;
        let pa = PrefillAttn {
            q: q.ptr(),
            kv: kv.kv.ptr(),
            slot: kv.slot.ptr(),
            pos: kv.pos.ptr(),
            slot_bytes: kv.slot_bytes,
            k_off: kv.k_off,
            v_off: kv.v_off,
            row_bytes: kv.row_bytes,
            kv_ty: kv.ty,
            n_head: d.n_head,
            n_head_kv: d.n_head_kv,
            hd: d.hd,
            scale: 1.0 / (d.hd as f32).sqrt(),
            n_tok: n,
            out: out.ptr(),
            // A pass whose cells all lie in the VRAM window keeps the tensor-core kernel.
            host: if self.below_window(n) {
                KvHostArg::none()
            } else {
                kv.host
            },
        };
        // SAFETY: q and out hold n tokens' heads (views checked above), the slot's layer of
        // KV lies in the stage's region (checked by `KvLayer`'s geometry at binding and the
        // pipeline's slot checks) and every position is below the planned context (checked
        // by the pipeline before the pass).
        l.timed("attn_prefill", || unsafe {
            flash::attn_prefill(&self.dev, &pa)
        })
    }

    fn route(&mut self, r: &Route<CMat, CVec>, n: usize) -> Result<(), CudaError> {
        let l = self.launcher();
        let d = self.d;
        let w = self.mat(r.router)?;
        let (x, xn) = (self.rows(r.x, n, d.e)?, self.rows(r.xn, n, d.e)?);
        let (ids, wts) = (
            self.buf_at(r.ids, 0, (4 * n * d.k) as u64)?,
            self.rows(r.wts, n, d.k)?,
        );
        let norm = self.vec(r.norm)?;
        let logits = self.rows(WorkBuf::Router, n, d.n_expert)?;
        if self.gemm_pass(n) {
            decode::rmsnorm(&l, x, None, None, norm, xn, d.e, d.eps, n)?;
            self.router_prefill(&l, w, n)?;
        } else if w.ty == GgmlType::F32 && d.e % 4 == 0 {
            let fused =
                self.decoding() && self.opts.fused_topk && d.n_expert <= 32 * 8 && d.k <= 32;
            let topk = if fused {
                Some(FusedTopk {
                    counters: self.buf_at(WorkBuf::Counters, 0, 4 * n as u64)?,
                    k: d.k,
                    norm_topk: d.norm_topk,
                    ids,
                    wts,
                })
            } else {
                None
            };
            decode::router_rows(&l, w, x, norm, d.eps, logits, xn, topk, n)?;
            if fused {
                return Ok(());
            }
        } else {
            let nm = InNorm {
                w: norm,
                eps: d.eps,
                xn_out: Some(xn),
            };
            decode::mv(&l, "mv_router", w, x, Some(nm), logits, n, false, false)?;
        }
        decode::router_topk(&l, logits, d.n_expert, d.k, d.norm_topk, ids, wts, n)
    }

    fn experts(
        &mut self,
        layer: u32,
        e: &CExperts,
        xn: WorkBuf,
        ids: WorkBuf,
        wts: WorkBuf,
        y: WorkBuf,
        n: usize,
    ) -> Result<(), CudaError> {
        if self.xcache.as_ref().is_some_and(|c| c.serves(layer)) {
            return self.experts_through_cache(
                layer,
                [e.ty, e.ty_up, e.ty_down],
                xn,
                ids,
                wts,
                y,
                n,
            );
        }
        let l = self.launcher();
        let d = self.d;
        if let (true, Some(s)) = (
            self.grouped_experts(n, [e.ty, e.ty_up, e.ty_down]),
            e.stacks,
        ) {
            let bufs = [xn, ids, wts, y];
            return self.experts_grouped(&l, Grouped::Stacks(s), [e.ty, e.ty_down], bufs, 0, n);
        }
        let table = ExpertTable {
            table: self.view(e.table_off, 24 * d.n_expert as u64)?,
            ty: e.ty,
            ty_up: e.ty_up,
            ty_down: e.ty_down,
            n_expert: d.n_expert,
            f: d.f,
            e: d.e,
        };
        let idv = self.buf_at(ids, 0, (4 * n * d.k) as u64)?;
        let (xv, h) = (self.rows(xn, n, d.e)?, self.rows(WorkBuf::H, n * d.k, d.f)?);
        let stage = self.opts.stage_inputs && e.ty == GgmlType::Q8_0 && e.ty_up == e.ty;
        if !self.int8_gate_up(&l, table, idv, d.k, xv, h, n)? {
            decode::moe_gate_up(&l, table, idv, d.k, xv, h, n, stage)?;
        }
        let (wv, yv) = (self.rows(wts, n, d.k)?, self.rows(y, n, d.e)?);
        if self.int8_down(&l, table, idv, wv, d.k, h, yv, n)? {
            return Ok(());
        }
        decode::moe_down(&l, table, idv, wv, d.k, h, yv, n)
    }

    fn dense_ffn(
        &mut self,
        _gate: CMat,
        _up: CMat,
        _down: CMat,
        _xn: WorkBuf,
        _y: WorkBuf,
        _n: usize,
    ) -> Result<(), CudaError> {
        Err(shape(
            "dense_ffn",
            "dense FFN layers are not in the CUDA forward pass yet: run with --backend cpu",
        ))
    }

    fn split_query_gate(
        &mut self,
        qg: WorkBuf,
        q: WorkBuf,
        gate: WorkBuf,
        n: usize,
    ) -> Result<(), CudaError> {
        let d = self.d;
        let w = d.q_out();
        let (qgv, qv, gv) = (
            self.rows(qg, n, 2 * w)?,
            self.rows(q, n, w)?,
            self.rows(gate, n, w)?,
        );
        linear::split_query_gate(&self.launcher(), qgv, qv, gv, d.n_head, d.hd, n)
    }

    fn sigmoid_gate(&mut self, x: WorkBuf, gate: WorkBuf, n: usize) -> Result<(), CudaError> {
        let w = self.d.att_out();
        let (xv, gv) = (self.rows(x, n, w)?, self.rows(gate, n, w)?);
        linear::sigmoid_gate(&self.launcher(), xv, gv, n * w)
    }

    /// The conv over each slot's conv state, then the delta rule (gates, q/k norms, the
    /// recurrent rule token by token, the gated norm) over its recurrent state, both reading
    /// slots and positions on the device. Every pass runs the recurrent rule token by token,
    /// so a verify pass computes what decoding its tokens one at a time would; it also keeps
    /// the state after each token but the last in the slot's checkpoints.
    fn linear_attention(
        &mut self,
        a: &crate::backend::LinearAttention<CVec>,
        n: usize,
    ) -> Result<(), CudaError> {
        let d = self.d;
        let lin = self.lin;
        if a.lin_layer >= lin.layers {
            return Err(shape(
                "linear_attention",
                format!(
                    "linear layer {} on a stage holding state for {}",
                    a.lin_layer, lin.layers
                ),
            ));
        }
        let l = self.launcher();
        let (c, vd) = (d.lin_qkv(), d.lin_v());
        let [_, pos, slot] = self.inputs()?;
        let tok = linear::Tokens { pos, slot, n };
        let live = 4 * (self.slots * lin.slot_floats()) as u64;
        let state = self.view(lin.region.off, live)?;
        // A verify pass keeps the state after each of its first tokens (but the last) in the
        // slot's checkpoints, for `rollback_linear`.
        let ckpt = if self.kind == StepKind::Verify {
            if n > lin.checkpoints + 1 {
                return Err(shape(
                    "linear_attention",
                    format!(
                        "a verify pass of {n} tokens, but the stage keeps {} linear-state checkpoints per slot (the plan's --spec)",
                        lin.checkpoints
                    ),
                ));
            }
            let v = self.view(lin.region.off + live, live * lin.checkpoints as u64)?;
            Some((v, lin.checkpoints))
        } else {
            None
        };
        let layer = a.lin_layer * (lin.conv + lin.rec);
        let slots = |layer_off| linear::LinSlots {
            state,
            slots: self.slots,
            slot_stride: lin.slot_floats(),
            layer_off,
            ckpt,
        };
        let conv_out = self.rows(WorkBuf::ConvOut, n, c)?;
        linear::conv_silu(
            &l,
            self.rows(a.qkv, n, c)?,
            self.vec(a.conv)?,
            slots(layer),
            tok,
            conv_out,
            c,
            d.conv_k,
        )?;
        let heads = linear::DeltaHeads {
            nk: d.lin_k_heads,
            nv: d.lin_v_heads,
            dk: d.lin_hk,
            dv: d.lin_hv,
        };
        let inp = linear::DeltaIn {
            conv: conv_out,
            ba: self.rows(a.ba, n, 2 * d.lin_v_heads)?,
            z: self.rows(a.z, n, vd)?,
            dt_bias: self.vec(a.dt_bias)?,
            ssm_a: self.vec(a.ssm_a)?,
            norm: self.vec(a.norm)?,
        };
        let out = self.rows(a.out, n, vd)?;
        linear::delta_rule(&l, heads, inp, slots(layer + lin.conv), tok, out, d.eps)
    }

    /// One launch of `lin_concat_rows` (the MTP block's `eh_proj` input), so a captured draft
    /// pass holds kernels only.
    fn concat_rows(
        &mut self,
        a: WorkBuf,
        b: WorkBuf,
        out: WorkBuf,
        n: usize,
    ) -> Result<(), CudaError> {
        let e = self.d.e;
        let (va, vb) = (self.rows(a, n, e)?, self.rows(b, n, e)?);
        let vo = self.rows(out, n, 2 * e)?;
        linear::concat_rows(&self.launcher(), va, vb, vo, e, n)
    }

    /// gate and up products into the `sh_scratch` rows, SwiGLU, the down product, then the
    /// sigmoid-gated add into `y`.
    fn shared_expert(
        &mut self,
        s: &crate::backend::SharedFfn<CMat, CVec>,
        xn: WorkBuf,
        y: WorkBuf,
        n: usize,
    ) -> Result<(), CudaError> {
        let (e, f) = (self.d.e, s.gate.rows);
        if s.up.rows != f || s.down.cols != f || s.down.rows != e || s.gate.cols != e {
            return Err(shape(
                "shared expert",
                format!(
                    "gate {}x{}, up {}x{}, down {}x{} for a hidden width of {e}",
                    s.gate.rows, s.gate.cols, s.up.rows, s.up.cols, s.down.rows, s.down.cols
                ),
            ));
        }
        let l = self.launcher();
        let sh = WorkBuf::ShScratch;
        let (fb, eb) = ((4 * n * f) as u64, (4 * n * e) as u64);
        let (g, u, dn) = (
            self.buf_at(sh, 0, fb)?,
            self.buf_at(sh, fb, fb)?,
            self.buf_at(sh, 2 * fb, eb)?,
        );
        let xv = self.rows(xn, n, e)?;
        self.products(&l, xv, &[(s.gate, g), (s.up, u)], n)?;
        linear::swiglu(&l, g, u, n * f)?;
        self.products(&l, g, &[(s.down, dn)], n)?;
        let yv = self.rows(y, n, e)?;
        linear::shared_add(&l, xv, self.vec(s.gate_inp)?, dn, yv, e, n)
    }
}
