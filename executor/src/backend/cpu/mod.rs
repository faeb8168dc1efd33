//! The CPU reference backend: [`CpuStage`] implements the seam's ops plainly, over weights
//! read in place from a [`WeightSource`] (a planned arena or the mmapped file), working
//! buffers bound from the plan's scratch, each slot's KV in its planned `kv_cache` window and
//! `kv_spill` cells, and routed experts from their stacks or through the expert cache. Every
//! GPU kernel is tested against these ops.
//! Invariant: an op touches only the buffers it is given, the stage's KV and its expert
//! cache; a token's result never depends on the other tokens of its pass; nothing is
//! allocated per pass.

pub mod attn_gate;
pub mod conv;
pub mod delta_net;
pub mod host_attn;
pub mod host_experts;
pub mod kv;
pub mod linear_state;
pub mod norms;
pub mod ops;
pub mod scratch;
pub mod shared_expert;

pub use ops::{AttnShape, Matrix, OpError, Rope, Yarn};

use crate::backend::{
    Attention, Bind, LinearAttention, Ops, Route, SharedFfn, Stage, StepKind, WorkBuf,
};
use crate::experts::{CpuExpertCache, ExpertBytes};
use crate::model::{check_view, ModelError, WeightSource};
use crate::quant::{self, QuantError};
use crate::routing::RoutingTally;
use kv::{KvCache, KvError};
use linear_state::LinearState;
use scratch::{Scratch, ScratchError};
use strata_schemas::dims::Dims;
use strata_schemas::ggml::GgmlType;

/// Why a CPU op or binding failed.
#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Op(#[from] OpError),
    #[error(transparent)]
    Scratch(#[from] ScratchError),
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error("{0}")]
    Other(String),
}

impl From<QuantError> for CpuError {
    fn from(e: QuantError) -> Self {
        CpuError::Op(OpError::Quant(e))
    }
}

/// A norm vector bound by [`CpuStage::vector`] (an index into the stage's f32 vectors).
#[derive(Debug, Clone, Copy)]
pub struct CpuVector(usize);

/// One expert stack (`[cols, rows, n_expert]` in GGUF order) read in place.
#[derive(Debug, Clone, Copy)]
pub struct Stack<'a> {
    ty: GgmlType,
    cols: usize,
    rows: usize,
    per_expert: usize,
    data: &'a [u8],
}

impl<'a> Stack<'a> {
    fn expert(&self, e: usize) -> Result<Matrix<'a>, OpError> {
        Matrix::new(
            self.ty,
            self.cols,
            self.rows,
            &self.data[e * self.per_expert..(e + 1) * self.per_expert],
        )
    }
}

/// Where a layer's routed experts are read from.
#[derive(Debug, Clone, Copy)]
pub enum CpuExperts<'a> {
    /// Gate, up and down stacks, read in place.
    Stacks(Stack<'a>, Stack<'a>, Stack<'a>),
    /// Through the stage's expert cache.
    Cache,
}

/// One planned device (or a whole plan-less model) on the CPU.
pub struct CpuStage<'a> {
    d: Dims,
    src: &'a (dyn WeightSource + Sync),
    arch: &'static str,
    rope: Rope,
    vectors: Vec<Vec<f32>>,
    scratch: Scratch<'a>,
    kv: Vec<KvCache<'a>>,
    /// Each slot's KV of the MTP block, when it lives apart from `kv` (a plan puts it in the
    /// `mtp` region): KV layer `kv[0].n_layer + i` is its layer `i`.
    mtp_kv: Vec<KvCache<'a>>,
    /// Each slot's linear-attention state (no layers for models without linear attention).
    lin: LinearState<'a>,
    cache: Option<CpuExpertCache<'a>>,
    /// The router's picks of every pass so far.
    tally: RoutingTally,
    /// The pass's inputs: token ids, slots and positions (capacity: the planned pass).
    tok: Vec<u32>,
    slot: Vec<u32>,
    pos: Vec<u32>,
    /// Per token of the pass, the cells it sees (`pos + 1`).
    n_ctx: Vec<u32>,
    /// The kind of the uploaded pass.
    kind: StepKind,
    max_tok: usize,
}

impl<'a> CpuStage<'a> {
    /// A stage over `src`'s weights with its working buffers in `scratch`, one KV cache per
    /// slot and (where experts are not read from their stacks) an expert cache; passes of at
    /// most `max_tok` tokens.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        d: Dims,
        arch: &'static str,
        src: &'a (dyn WeightSource + Sync),
        rope: Rope,
        scratch: Scratch<'a>,
        kv: Vec<KvCache<'a>>,
        cache: Option<CpuExpertCache<'a>>,
        max_tok: usize,
    ) -> Self {
        Self {
            d,
            src,
            arch,
            rope,
            vectors: Vec::new(),
            scratch,
            kv,
            mtp_kv: Vec::new(),
            lin: LinearState::owned(&d, 0, 0),
            cache,
            tally: RoutingTally::new(d.n_layer, d.n_expert, d.k),
            tok: Vec::with_capacity(max_tok),
            slot: Vec::with_capacity(max_tok),
            pos: Vec::with_capacity(max_tok),
            n_ctx: Vec::with_capacity(max_tok),
            kind: StepKind::Prefill,
            max_tok,
        }
    }

    /// A stage with working buffers, KV (`slots` of `ctx` cells of `kv`) and logits of its
    /// own for passes of `pass` (no plan): the same working-set rule the planner uses.
    #[allow(clippy::too_many_arguments)]
    pub fn standalone(
        d: Dims,
        arch: &'static str,
        src: &'a (dyn WeightSource + Sync),
        rope: Rope,
        slots: usize,
        ctx: usize,
        kv: GgmlType,
        pass: &strata_schemas::workset::Pass,
    ) -> Result<Self, CpuError> {
        use strata_schemas::workset::{buffers, BackendKind};
        let bufs = buffers(BackendKind::Cpu, &d, d.n_layer, true, pass);
        let scratch = Scratch::owned(&bufs)?;
        let g = kv::KvGeom::new(&d, kv, d.n_layer, ctx)?;
        let caches = (0..slots)
            .map(|_| KvCache::owned(g))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self::new(
            d,
            arch,
            src,
            rope,
            scratch,
            caches,
            None,
            pass.tokens,
        ))
    }

    /// The stage with `kv` as its slots' MTP-block KV (see the field).
    pub fn with_mtp_kv(mut self, kv: Vec<KvCache<'a>>) -> Self {
        self.mtp_kv = kv;
        self
    }

    /// The stage with `lin` as its slots' linear-attention state.
    pub fn with_linear_state(mut self, lin: LinearState<'a>) -> Self {
        self.lin = lin;
        self
    }

    /// The model dimensions.
    pub fn dims(&self) -> &Dims {
        &self.d
    }

    /// The rotary embedding in use.
    pub fn rope(&self) -> &Rope {
        &self.rope
    }

    fn check_n(&self, n: usize) -> Result<(), CpuError> {
        if n == 0 || n > self.tok.len().max(self.slot.len()) || n > self.max_tok {
            return Err(CpuError::Other(format!(
                "a pass of {n} tokens, but {} were uploaded (at most {})",
                self.slot.len(),
                self.max_tok
            )));
        }
        Ok(())
    }

    fn stack(&self, name: &str, cols: usize, rows: usize) -> Result<Stack<'a>, CpuError> {
        let n = self.d.n_expert;
        let v = check_view(
            self.src,
            self.arch,
            name,
            &[cols as u64, rows as u64, n as u64],
        )?;
        let rb = quant::row_bytes(v.ggml_type, cols).map_err(|source| ModelError::Tensor {
            name: name.into(),
            source,
        })?;
        Ok(Stack {
            ty: v.ggml_type,
            cols,
            rows,
            per_expert: rb * rows,
            data: v.data,
        })
    }
}

/// `x += y` element by element.
fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

fn expert_matrix<'b>(
    ex: usize,
    layer: u32,
    what: &str,
    (ty, data): (GgmlType, &'b [u8]),
    cols: usize,
    rows: usize,
) -> Result<Matrix<'b>, CpuError> {
    Matrix::new(ty, cols, rows, data).map_err(|err| {
        CpuError::Other(format!(
            "expert {ex} of layer {layer}: {what} from the expert cache: {err}"
        ))
    })
}

impl<'a> Ops for CpuStage<'a> {
    type Mat = Matrix<'a>;
    type Vector = CpuVector;
    type Experts = CpuExperts<'a>;
    type Error = CpuError;

    fn pass_start(&mut self, n: usize) -> Result<(), CpuError> {
        self.check_n(n)
    }

    fn embed(&mut self, table: Matrix<'a>, out: WorkBuf, n: usize) -> Result<(), CpuError> {
        let e = table.cols;
        let [o]: [&mut [f32]; 1] = self.scratch.words([(out, n * e)])?;
        for (t, &tok) in self.tok[..n].iter().enumerate() {
            table.dequantize_row(tok as usize, &mut o[t * e..(t + 1) * e])?;
        }
        Ok(())
    }

    fn rms_norm(
        &mut self,
        x: WorkBuf,
        first: usize,
        w: CpuVector,
        out: WorkBuf,
        n: usize,
    ) -> Result<(), CpuError> {
        let wv = &self.vectors[w.0];
        let e = wv.len();
        let [xs, o]: [&mut [f32]; 2] = self.scratch.words([(x, (first + n) * e), (out, n * e)])?;
        ops::rmsnorm_rows(&xs[first * e..], wv, self.d.eps, n, o)?;
        Ok(())
    }

    fn project(
        &mut self,
        x: WorkBuf,
        outs: &[(Matrix<'a>, WorkBuf)],
        n: usize,
    ) -> Result<(), CpuError> {
        for (w, y) in outs {
            let [xs, ys, tmp]: [&mut [f32]; 3] = self.scratch.words([
                (x, n * w.cols),
                (*y, n * w.rows),
                (WorkBuf::Tmp, if n > 1 { n * w.rows } else { 0 }),
            ])?;
            ops::matmul(w, xs, n, ys, tmp)?;
        }
        Ok(())
    }

    fn project_add(
        &mut self,
        w: Matrix<'a>,
        x: WorkBuf,
        y: WorkBuf,
        n: usize,
    ) -> Result<(), CpuError> {
        let [xs, ys, proj, tmp]: [&mut [f32]; 4] = self.scratch.words([
            (x, n * w.cols),
            (y, n * w.rows),
            (WorkBuf::Proj, n * w.rows),
            (WorkBuf::Tmp, if n > 1 { n * w.rows } else { 0 }),
        ])?;
        ops::matmul(&w, xs, n, proj, tmp)?;
        add_into(&mut ys[..n * w.rows], &proj[..n * w.rows]);
        Ok(())
    }

    fn attention(&mut self, a: &Attention<CpuVector>, n: usize) -> Result<(), CpuError> {
        let d = self.d;
        let (qw, kw, vw) = (d.q_out(), d.k_out(), d.v_out());
        let [q, k, v, out]: [&mut [f32]; 4] = self.scratch.words([
            (a.q, n * qw),
            (a.k, n * kw),
            (a.v, n * vw),
            (a.out, n * d.att_out()),
        ])?;
        if let Some(w) = a.q_norm {
            ops::rmsnorm_heads_inplace(&mut q[..n * qw], &self.vectors[w.0], d.eps)?;
        }
        if let Some(w) = a.k_norm {
            ops::rmsnorm_heads_inplace(&mut k[..n * kw], &self.vectors[w.0], d.eps)?;
        }
        let n_main = self.kv.first().map_or(0, |c| c.geom().n_layer);
        let (caches, layer) = if a.kv_layer >= n_main && !self.mtp_kv.is_empty() {
            (&mut self.mtp_kv, a.kv_layer - n_main)
        } else {
            (&mut self.kv, a.kv_layer)
        };
        for t in 0..n {
            let p = self.pos[t];
            self.rope.apply(&mut q[t * qw..(t + 1) * qw], d.hd, p)?;
            self.rope.apply(&mut k[t * kw..(t + 1) * kw], d.hd, p)?;
            let s = self.slot[t] as usize;
            let kv = caches.get_mut(s).ok_or_else(|| {
                CpuError::Other(format!("slot {s} has no KV cache on this stage"))
            })?;
            kv.write(
                layer,
                p as usize,
                &k[t * kw..(t + 1) * kw],
                &v[t * vw..(t + 1) * vw],
            )?;
        }
        let shape = AttnShape {
            n_head: d.n_head,
            n_head_kv: d.n_head_kv,
            head_dim_k: d.hd,
            head_dim_v: d.hd_v,
        };
        let scale = 1.0 / (d.hd as f32).sqrt();
        kv::attention(
            shape,
            caches,
            layer,
            &self.slot[..n],
            &self.n_ctx[..n],
            q,
            scale,
            out,
        )?;
        Ok(())
    }

    fn route(&mut self, r: &Route<Matrix<'a>, CpuVector>, n: usize) -> Result<(), CpuError> {
        let d = self.d;
        let (e, ne, k) = (d.e, d.n_expert, d.k);
        let ([x, xn, logits, wts, tmp], [ids]): ([&mut [f32]; 5], [&mut [u32]; 1]) =
            self.scratch.mixed(
                [
                    (r.x, n * e),
                    (r.xn, n * e),
                    (WorkBuf::Router, n * ne),
                    (r.wts, n * k),
                    (WorkBuf::Tmp, if n > 1 { n * ne } else { 0 }),
                ],
                [(r.ids, n * k)],
            )?;
        ops::rmsnorm_rows(x, &self.vectors[r.norm.0], d.eps, n, xn)?;
        ops::matmul(&r.router, xn, n, logits, tmp)?;
        for t in 0..n {
            let probs = &mut logits[t * ne..(t + 1) * ne];
            ops::softmax(probs);
            let idx = &mut ids[t * k..(t + 1) * k];
            let w = &mut wts[t * k..(t + 1) * k];
            for j in 0..k {
                // Largest remaining probability; ties go to the lower expert index.
                let mut best = usize::MAX;
                for c in 0..ne {
                    if idx[..j].contains(&(c as u32)) {
                        continue;
                    }
                    if best == usize::MAX || probs[c] > probs[best] {
                        best = c;
                    }
                }
                idx[j] = best as u32;
                w[j] = probs[best];
            }
            if d.norm_topk {
                let sum: f32 = w.iter().sum();
                for v in w.iter_mut() {
                    *v /= sum;
                }
            }
        }
        Ok(())
    }

    /// Each expert runs once over the tokens that picked it, in increasing expert index (as
    /// HF's loop does); a token's outputs are summed in that order, then added into `y`.
    fn experts(
        &mut self,
        layer: u32,
        src: &CpuExperts<'a>,
        xn: WorkBuf,
        ids: WorkBuf,
        wts: WorkBuf,
        y: WorkBuf,
        n: usize,
    ) -> Result<(), CpuError> {
        let d = self.d;
        let (e, ne, k, f) = (d.e, d.n_expert, d.k, d.f);
        let ([xs, ws, ys, proj, ex_w, ex_x, ex_g, ex_u, ex_d, tmp], [is, ex_tok]): (
            [&mut [f32]; 10],
            [&mut [u32]; 2],
        ) = self.scratch.mixed(
            [
                (xn, n * e),
                (wts, n * k),
                (y, n * e),
                (WorkBuf::Proj, n * e),
                (WorkBuf::ExW, n),
                (WorkBuf::ExX, n * e),
                (WorkBuf::ExG, n * f),
                (WorkBuf::ExU, n * f),
                (WorkBuf::ExD, n * e),
                (WorkBuf::Tmp, if n > 1 { n * e.max(f) } else { 0 }),
            ],
            [(ids, n * k), (WorkBuf::ExTok, n)],
        )?;
        self.tally.record(layer, &is[..n * k]);
        if let (CpuExperts::Cache, Some(c)) = (src, self.cache.as_mut()) {
            c.set_scan(crate::experts::pass_is_scan(self.kind.prefills(), n, k, ne));
        }
        proj[..n * e].fill(0.0);
        for ex in 0..ne {
            let mut cnt = 0;
            for t in 0..n {
                if let Some(j) = is[t * k..(t + 1) * k].iter().position(|&c| c == ex as u32) {
                    ex_tok[cnt] = t as u32;
                    ex_w[cnt] = ws[t * k + j];
                    ex_x[cnt * e..(cnt + 1) * e].copy_from_slice(&xs[t * e..(t + 1) * e]);
                    cnt += 1;
                }
            }
            if cnt == 0 {
                continue;
            }
            let (gate, up, down) = match src {
                CpuExperts::Stacks(g, u, dn) => (g.expert(ex)?, u.expert(ex)?, dn.expert(ex)?),
                CpuExperts::Cache => {
                    let cache = self.cache.as_mut().ok_or_else(|| {
                        CpuError::Other(format!(
                            "layer {layer} reads its experts through an expert cache this stage lacks"
                        ))
                    })?;
                    let b: ExpertBytes<'_> =
                        cache.fetch(layer, ex as u32).map_err(CpuError::Other)?;
                    (
                        expert_matrix(ex, layer, "gate", b.gate, e, f)?,
                        expert_matrix(ex, layer, "up", b.up, e, f)?,
                        expert_matrix(ex, layer, "down", b.down, f, e)?,
                    )
                }
            };
            ops::matmul(&gate, ex_x, cnt, ex_g, tmp)?;
            ops::matmul(&up, ex_x, cnt, ex_u, tmp)?;
            for (g, u) in ex_g[..cnt * f].iter_mut().zip(&ex_u[..cnt * f]) {
                *g = ops::silu(*g) * u;
            }
            ops::matmul(&down, ex_g, cnt, ex_d, tmp)?;
            for i in 0..cnt {
                let (t, w) = (ex_tok[i] as usize, ex_w[i]);
                for (o, v) in proj[t * e..(t + 1) * e]
                    .iter_mut()
                    .zip(&ex_d[i * e..(i + 1) * e])
                {
                    *o += w * v;
                }
            }
        }
        add_into(&mut ys[..n * e], &proj[..n * e]);
        Ok(())
    }

    fn dense_ffn(
        &mut self,
        gate: Matrix<'a>,
        up: Matrix<'a>,
        down: Matrix<'a>,
        xn: WorkBuf,
        y: WorkBuf,
        n: usize,
    ) -> Result<(), CpuError> {
        let (e, f) = (self.d.e, gate.rows);
        let [xs, ys, g, u, proj, tmp]: [&mut [f32]; 6] = self.scratch.words([
            (xn, n * e),
            (y, n * e),
            (WorkBuf::ExG, n * f),
            (WorkBuf::ExU, n * f),
            (WorkBuf::Proj, n * e),
            (WorkBuf::Tmp, if n > 1 { n * e.max(f) } else { 0 }),
        ])?;
        ops::matmul(&gate, xs, n, g, tmp)?;
        ops::matmul(&up, xs, n, u, tmp)?;
        for (a, b) in g[..n * f].iter_mut().zip(&u[..n * f]) {
            *a = ops::silu(*a) * b;
        }
        ops::matmul(&down, g, n, proj, tmp)?;
        add_into(&mut ys[..n * e], &proj[..n * e]);
        Ok(())
    }

    fn split_query_gate(
        &mut self,
        qg: WorkBuf,
        q: WorkBuf,
        gate: WorkBuf,
        n: usize,
    ) -> Result<(), CpuError> {
        let d = self.d;
        let w = d.q_out();
        let [a, qs, gs]: [&mut [f32]; 3] =
            self.scratch
                .words([(qg, n * 2 * w), (q, n * w), (gate, n * w)])?;
        attn_gate::split_query_gate(&a[..n * 2 * w], n, d.n_head, d.hd, qs, gs)?;
        Ok(())
    }

    fn sigmoid_gate(&mut self, x: WorkBuf, gate: WorkBuf, n: usize) -> Result<(), CpuError> {
        let w = self.d.att_out();
        let [xs, gs]: [&mut [f32]; 2] = self.scratch.words([(x, n * w), (gate, n * w)])?;
        attn_gate::sigmoid_gate_inplace(&mut xs[..n * w], &gs[..n * w])?;
        Ok(())
    }

    /// Tokens run in runs of consecutive tokens of one slot (a prefill pass is one run, a
    /// decode pass one run per slot): the chunked rule for runs longer than one token, the
    /// recurrent step otherwise. A verify pass runs each token alone (so it computes what
    /// decoding them one by one would) and checkpoints the state after each but the last.
    fn linear_attention(
        &mut self,
        a: &LinearAttention<CpuVector>,
        n: usize,
    ) -> Result<(), CpuError> {
        let d = self.d;
        let shape = delta_net::DeltaShape {
            n_k_heads: d.lin_k_heads,
            n_v_heads: d.lin_v_heads,
            head_k: d.lin_hk,
            head_v: d.lin_hv,
        };
        let (c, vd, nv) = (d.lin_qkv(), d.lin_v(), d.lin_v_heads);
        let chunk = strata_schemas::workset::DELTA_CHUNK;
        let sc_len = delta_net::chunked_scratch_len(shape, n, chunk);
        let [qkv, z, ba, out, conv_out, gb, dout, dsc]: [&mut [f32]; 8] = self.scratch.words([
            (a.qkv, n * c),
            (a.z, n * vd),
            (a.ba, n * 2 * nv),
            (a.out, n * vd),
            (WorkBuf::ConvOut, n * c),
            (WorkBuf::Gbeta, 2 * n * nv),
            (WorkBuf::DeltaOut, n * vd),
            (WorkBuf::DeltaScratch, if n > 1 { sc_len } else { 0 }),
        ])?;
        let (beta, g) = gb[..2 * n * nv].split_at_mut(n * nv);
        delta_net::gates(
            shape,
            &ba[..n * 2 * nv],
            n,
            &self.vectors[a.dt_bias.0],
            &self.vectors[a.ssm_a.0],
            beta,
            g,
        )?;
        let conv_w = &self.vectors[a.conv.0];
        let mut t0 = 0;
        while t0 < n {
            let slot = self.slot[t0];
            let mut t1 = t0 + 1;
            while t1 < n && self.slot[t1] == slot {
                t1 += 1;
            }
            let step = if self.kind == StepKind::Verify {
                1
            } else {
                t1 - t0
            };
            let mut s0 = t0;
            while s0 < t1 {
                let s1 = (s0 + step).min(t1);
                let len = s1 - s0;
                let (cs, rs) = self.lin.layer(slot as usize, a.lin_layer).ok_or_else(|| {
                    CpuError::Other(format!(
                        "slot {slot} has no state for linear layer {} on this stage",
                        a.lin_layer
                    ))
                })?;
                if self.pos[s0] == 0 {
                    // A new sequence in this slot: this layer starts from zero state (the
                    // other layers clear theirs when their op sees the same token).
                    cs.fill(0.0);
                    rs.fill(0.0);
                }
                let rows = &mut conv_out[s0 * c..s1 * c];
                conv::conv1d_silu(&qkv[s0 * c..s1 * c], len, c, conv_w, d.conv_k, cs, rows)?;
                delta_net::l2norm_qk_inplace(shape, rows, len, 1e-6)?;
                let inp = delta_net::DeltaInputs {
                    qkv: rows,
                    g: &g[s0 * nv..s1 * nv],
                    beta: &beta[s0 * nv..s1 * nv],
                    n_tok: len,
                };
                let o = &mut dout[s0 * vd..s1 * vd];
                if len > 1 {
                    delta_net::delta_rule_chunked(shape, inp, chunk, rs, dsc, o)?;
                } else {
                    delta_net::delta_rule_recurrent(shape, inp, rs, o)?;
                }
                let j = s1 - 1 - t0;
                if step == 1 && s1 < t1 && !self.lin.save(slot as usize, a.lin_layer, j) {
                    return Err(CpuError::Other(format!(
                        "a verify pass of {} tokens for slot {slot}, but the stage keeps {} linear-state checkpoints per slot (the plan's --spec)",
                        t1 - t0,
                        self.lin.checkpoints()
                    )));
                }
                s0 = s1;
            }
            t0 = t1;
        }
        norms::gated_rmsnorm_heads(
            &dout[..n * vd],
            &z[..n * vd],
            &self.vectors[a.norm.0],
            d.eps,
            &mut out[..n * vd],
        )?;
        Ok(())
    }

    fn concat_rows(
        &mut self,
        a: WorkBuf,
        b: WorkBuf,
        out: WorkBuf,
        n: usize,
    ) -> Result<(), CpuError> {
        let e = self.d.e;
        let [xa, xb, y]: [&mut [f32]; 3] =
            self.scratch
                .words([(a, n * e), (b, n * e), (out, 2 * n * e)])?;
        for (i, row) in y[..2 * n * e].chunks_exact_mut(2 * e).enumerate() {
            row[..e].copy_from_slice(&xa[i * e..(i + 1) * e]);
            row[e..].copy_from_slice(&xb[i * e..(i + 1) * e]);
        }
        Ok(())
    }

    fn shared_expert(
        &mut self,
        s: &SharedFfn<Matrix<'a>, CpuVector>,
        xn: WorkBuf,
        y: WorkBuf,
        n: usize,
    ) -> Result<(), CpuError> {
        let e = self.d.e;
        let gi = &self.vectors[s.gate_inp.0];
        // The gate row as an F32 matrix of one row, read in place from the bound vector.
        // SAFETY: f32 has no padding or invalid bit patterns as bytes; the byte slice covers
        // exactly the vector's elements and lives as long as the borrow of `gi`.
        let gi_bytes: &[u8] =
            unsafe { std::slice::from_raw_parts(gi.as_ptr() as *const u8, 4 * gi.len()) };
        let gate_inp = Matrix::new(GgmlType::F32, e, 1, gi_bytes)?;
        let sh = shared_expert::SharedExpert {
            gate_inp,
            gate: s.gate,
            up: s.up,
            down: s.down,
        };
        let len = sh.scratch_len(n);
        let [xs, ys, sc]: [&mut [f32]; 3] =
            self.scratch
                .words([(xn, n * e), (y, n * e), (WorkBuf::ShScratch, len)])?;
        sh.add(&xs[..n * e], n, &mut sc[..len], &mut ys[..n * e])?;
        Ok(())
    }
}

impl<'a> Bind for CpuStage<'a> {
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Matrix<'a>, CpuError> {
        let v = check_view(self.src, self.arch, name, &[cols as u64, rows as u64])?;
        Matrix::new(v.ggml_type, cols, rows, v.data).map_err(|e| match e {
            OpError::Quant(source) => CpuError::Model(ModelError::Tensor {
                name: name.into(),
                source,
            }),
            other => CpuError::Op(other),
        })
    }

    fn vector(&mut self, name: &str, n: usize) -> Result<CpuVector, CpuError> {
        let v = check_view(self.src, self.arch, name, &[n as u64])?;
        let mut out = vec![0f32; n];
        quant::dequantize_row(v.ggml_type, v.data, &mut out).map_err(|source| {
            ModelError::Tensor {
                name: name.into(),
                source,
            }
        })?;
        self.vectors.push(out);
        Ok(CpuVector(self.vectors.len() - 1))
    }

    fn table(&mut self, name: &str, rows: usize, cols: usize) -> Result<CpuVector, CpuError> {
        let v = check_view(self.src, self.arch, name, &[cols as u64, rows as u64])?;
        let m = Matrix::new(v.ggml_type, cols, rows, v.data).map_err(|e| match e {
            OpError::Quant(source) => CpuError::Model(ModelError::Tensor {
                name: name.into(),
                source,
            }),
            other => CpuError::Op(other),
        })?;
        let mut out = vec![0f32; rows * cols];
        for (r, o) in out.chunks_exact_mut(cols.max(1)).enumerate() {
            m.dequantize_row(r, o)?;
        }
        self.vectors.push(out);
        Ok(CpuVector(self.vectors.len() - 1))
    }

    fn experts_of(&mut self, layer: u32) -> Result<CpuExperts<'a>, CpuError> {
        let n = |p: &str| format!("blk.{layer}.ffn_{p}_exps.weight");
        let (e, f) = (self.d.e, self.d.f);
        // The MTP block's experts (a layer past the cache's range) are read where the plan
        // placed them, in the `mtp` region.
        if self
            .cache
            .as_ref()
            .is_some_and(|c| c.policy().covers(layer))
        {
            return Ok(CpuExperts::Cache);
        }
        Ok(CpuExperts::Stacks(
            self.stack(&n("gate"), e, f)?,
            self.stack(&n("up"), e, f)?,
            self.stack(&n("down"), f, e)?,
        ))
    }

    fn has(&self, name: &str) -> bool {
        self.src.tensor(name).is_some()
    }
}

impl Stage for CpuStage<'_> {
    fn upload_inputs(
        &mut self,
        kind: StepKind,
        tokens: &[u32],
        slots: &[u32],
        pos: &[u32],
    ) -> Result<(), CpuError> {
        let n = slots.len();
        if n > self.max_tok || pos.len() != n || (!tokens.is_empty() && tokens.len() != n) {
            return Err(CpuError::Other(format!(
                "step inputs of {} tokens, {n} slots and {} positions (at most {} a pass)",
                tokens.len(),
                pos.len(),
                self.max_tok
            )));
        }
        for (&s, &p) in slots.iter().zip(pos) {
            let cap = self.kv.get(s as usize).map(|c| c.geom().n_cells);
            if cap.is_none_or(|c| p as usize >= c) {
                return Err(CpuError::Other(format!(
                    "slot {s} position {p} is outside its KV ({} cells)",
                    cap.unwrap_or(0)
                )));
            }
        }
        self.tok.clear();
        self.tok.extend_from_slice(tokens);
        self.slot.clear();
        self.slot.extend_from_slice(slots);
        self.pos.clear();
        self.pos.extend_from_slice(pos);
        self.n_ctx.clear();
        self.n_ctx.extend(pos.iter().map(|p| p + 1));
        self.kind = kind;
        Ok(())
    }

    fn run(
        &mut self,
        _kind: StepKind,
        _n: usize,
        forward: &mut dyn FnMut(&mut Self) -> Result<(), CpuError>,
    ) -> Result<(), CpuError> {
        forward(self)
    }

    fn send_hidden(&mut self, next: &mut Self, x: WorkBuf, n: usize) -> Result<(), CpuError> {
        let e = self.d.e;
        let [src]: [&mut [f32]; 1] = self.scratch.words([(x, n * e)])?;
        let [dst]: [&mut [f32]; 1] = next.scratch.words([(x, n * e)])?;
        dst[..n * e].copy_from_slice(&src[..n * e]);
        Ok(())
    }

    fn read_logits(&mut self, rows: usize, out: &mut [f32]) -> Result<(), CpuError> {
        let v = self.d.vocab;
        let [l]: [&mut [f32]; 1] = self.scratch.words([(WorkBuf::Logits, rows * v)])?;
        out[..rows * v].copy_from_slice(&l[..rows * v]);
        Ok(())
    }

    fn copy_slot(&mut self, from: usize, to: usize, cells: usize) -> Result<bool, CpuError> {
        if from == to || from >= self.kv.len() || to >= self.kv.len() {
            return Ok(false);
        }
        let (src, dst) = if from < to {
            let (a, b) = self.kv.split_at_mut(to);
            (&a[from], &mut b[0])
        } else {
            let (a, b) = self.kv.split_at_mut(from);
            (&b[0], &mut a[to])
        };
        dst.copy_prefix_from(src, cells)
            .map_err(|e| CpuError::Other(e.0))?;
        if self.lin.slots() > 0 && !self.lin.copy_slot(from, to) {
            return Ok(false);
        }
        Ok(true)
    }

    fn sync(&mut self) -> Result<(), CpuError> {
        Ok(())
    }

    fn write_buf(&mut self, b: WorkBuf, data: &[f32]) -> Result<(), CpuError> {
        let [x]: [&mut [f32]; 1] = self.scratch.words([(b, data.len())])?;
        x[..data.len()].copy_from_slice(data);
        Ok(())
    }

    fn read_buf(&mut self, b: WorkBuf, out: &mut [f32]) -> Result<(), CpuError> {
        let [x]: [&mut [f32]; 1] = self.scratch.words([(b, out.len())])?;
        out.copy_from_slice(&x[..out.len()]);
        Ok(())
    }

    fn rollback_linear(&mut self, slot: usize, keep: usize) -> Result<(), CpuError> {
        if self.lin.layers() == 0 {
            return Ok(());
        }
        if !self.lin.restore(slot, keep) {
            return Err(CpuError::Other(format!(
                "rollback of slot {slot} to verify token {keep}: the stage keeps {} linear-state checkpoints of {} slots (the plan's --spec and --batch)",
                self.lin.checkpoints(),
                self.lin.slots()
            )));
        }
        Ok(())
    }

    fn save_linear_checkpoint(&mut self, slot: usize) -> Result<bool, CpuError> {
        Ok(self.lin.layers() == 0 || self.lin.save_prefix(slot))
    }

    fn restore_linear_checkpoint(&mut self, slot: usize) -> Result<bool, CpuError> {
        Ok(self.lin.layers() == 0 || self.lin.restore_prefix(slot))
    }

    fn expert_counters(&self) -> (u64, u64) {
        self.cache.as_ref().map_or((0, 0), |c| c.counters())
    }

    fn routing(&self) -> Option<&RoutingTally> {
        Some(&self.tally)
    }
}
