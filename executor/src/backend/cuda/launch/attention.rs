//! Launchers of the decode attention and KV store kernels (`kernels/cuda/decode.cu`):
//! `dq_rope_store`, `dq_kv_store`, `dq_attn_fused`, `dq_attn_gqa` + `dq_attn_combine` (with
//! the host CPU's partial under `--kv-host cpu`). (The
//! prefill attention kernels' launchers are in `flash`.)
//! Invariant: a slot's KV lies at `kv + slot * slot_bytes`; layer `l`'s K rows at `k_off`,
//! V rows at `v_off`, `cells` rows of `row_bytes` each inside the slot (the VRAM window), the
//! slot's cells past it where `host` (pinned chunks mapped into the device) says; every launch
//! checks that geometry against the views it is given.

use super::{bad, cfg, f32s, int, launch, Launcher, ATT_MAX_D, ATT_MAX_GROUP, ATT_MAX_SPLIT};
use crate::backend::cuda::kv_spill::KvHostArg;
use crate::backend::cuda::{CudaError, DeviceView};

/// One layer of every slot's KV, and the step's per-token slots and positions.
#[derive(Debug, Clone, Copy)]
pub struct KvLayer<'a> {
    /// The stage's whole KV region (every slot).
    pub kv: DeviceView<'a>,
    pub slot_bytes: u64,
    pub k_off: u64,
    pub v_off: u64,
    pub row_bytes: u64,
    /// Cells of one slot.
    pub cells: u64,
    /// Kernel type code of the rows (F16 1, Q8_0 3, F32 0).
    pub ty: i32,
    /// The slots' cells past `cells` (this layer's rows in the pinned `kv_spill` chunks);
    /// [`KvHostArg::none`] when every cell is in VRAM.
    pub host: KvHostArg,
    /// `n` i32 slots and positions of the step's tokens.
    pub slot: DeviceView<'a>,
    pub pos: DeviceView<'a>,
}

impl KvLayer<'_> {
    fn check(&self, op: &'static str, n: usize) -> Result<[i64; 4], CudaError> {
        let span = self.cells * self.row_bytes;
        if self.k_off + span > self.slot_bytes
            || self.v_off + span > self.slot_bytes
            || self.kv.len() < self.slot_bytes
        {
            return Err(bad(
                op,
                format!(
                    "KV layer at K {} / V {} of {} cells x {} bytes does not fit a slot of {} bytes in a region of {}",
                    self.k_off,
                    self.v_off,
                    self.cells,
                    self.row_bytes,
                    self.slot_bytes,
                    self.kv.len()
                ),
            ));
        }
        self.slot.expect(op, "slot", 4 * n as u64, 4)?;
        self.pos.expect(op, "pos", 4 * n as u64, 4)?;
        let i = |v: u64| i64::try_from(v).map_err(|_| bad(op, format!("{v} exceeds i64")));
        Ok([
            i(self.slot_bytes)?,
            i(self.k_off)?,
            i(self.v_off)?,
            i(self.row_bytes)?,
        ])
    }
}

/// Head counts and sizes, the RoPE tables and the Q/K norms of an attention.
#[derive(Debug, Clone, Copy)]
pub struct Heads<'a> {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub hd: usize,
    pub n_rot: usize,
    pub eps: f32,
    pub attn_factor: f32,
    /// `n_rot / 2` f32.
    pub inv_freq: DeviceView<'a>,
    /// `hd` f32 each.
    pub q_norm: DeviceView<'a>,
    pub k_norm: DeviceView<'a>,
}

impl Heads<'_> {
    fn check(&self, op: &'static str) -> Result<(i32, i32, i32, i32), CudaError> {
        if self.n_head_kv == 0
            || self.n_head % self.n_head_kv != 0
            || self.n_head / self.n_head_kv > ATT_MAX_GROUP
            || self.hd > ATT_MAX_D
            || self.hd % 4 != 0
            || self.n_rot % 2 != 0
            || self.n_rot > self.hd
        {
            return Err(bad(
                op,
                format!(
                    "{} query heads over {} KV heads of {} ({} rotated): the kernels take whole groups of at most {ATT_MAX_GROUP}, head dims a multiple of 4 up to {ATT_MAX_D}, an even rotation",
                    self.n_head, self.n_head_kv, self.hd, self.n_rot
                ),
            ));
        }
        self.inv_freq
            .expect(op, "inv_freq", f32s(self.n_rot / 2), 4)?;
        self.q_norm.expect(op, "q_norm", f32s(self.hd), 4)?;
        self.k_norm.expect(op, "k_norm", f32s(self.hd), 4)?;
        Ok((
            self.n_head as i32,
            self.n_head_kv as i32,
            self.hd as i32,
            self.n_rot as i32,
        ))
    }
}

/// `dq_rope_store`: QK-norm and RoPE of Q and K of `n` tokens, in place, and the store of K
/// and V into each token's slot at its position.
pub fn rope_store(
    l: &Launcher<'_>,
    h: Heads<'_>,
    q: DeviceView<'_>,
    k: DeviceView<'_>,
    v: DeviceView<'_>,
    kv: KvLayer<'_>,
    n: usize,
) -> Result<(), CudaError> {
    const OP: &str = "rope_store";
    let (nh, nkv, hd, nr) = h.check(OP)?;
    let [sb, ko, vo, rb] = kv.check(OP, n)?;
    q.expect(OP, "q", f32s(n * h.n_head * h.hd), 4)?;
    k.expect(OP, "k", f32s(n * h.n_head_kv * h.hd), 4)?;
    v.expect(OP, "v", f32s(n * h.n_head_kv * h.hd), 4)?;
    let (qp, kp, vp) = (q.ptr(), k.ptr(), v.ptr());
    let (qn, kn, pp, fp) = (
        h.q_norm.ptr(),
        h.k_norm.ptr(),
        kv.pos.ptr(),
        h.inv_freq.ptr(),
    );
    let (kvp, sp) = (kv.kv.ptr(), kv.slot.ptr());
    let blocks = (h.n_head + 2 * h.n_head_kv) as u32;
    launch!(l, "dq_rope_store", cfg((blocks, int(OP, "n", n)? as u32, 1), 128, 0);
        &qp, &kp, &vp, &qn, &kn, &h.eps, &pp, &fp, &h.attn_factor, &nh, &nkv, &hd, &nr,
        &kvp, &sp, &sb, &ko, &vo, &rb, &kv.ty, &kv.host)
}

/// `dq_kv_store`: K and V rows of `n` tokens (`width` elements each) into each token's slot
/// at its position.
pub fn kv_store(
    l: &Launcher<'_>,
    k: DeviceView<'_>,
    v: DeviceView<'_>,
    kv: KvLayer<'_>,
    width: usize,
    n: usize,
) -> Result<(), CudaError> {
    const OP: &str = "kv_store";
    let [sb, ko, vo, rb] = kv.check(OP, n)?;
    k.expect(OP, "k", f32s(n * width), 4)?;
    v.expect(OP, "v", f32s(n * width), 4)?;
    let (kp, vp, kvp, sp, pp) = (k.ptr(), v.ptr(), kv.kv.ptr(), kv.slot.ptr(), kv.pos.ptr());
    let w = int(OP, "width", width)?;
    launch!(l, "dq_kv_store", cfg((int(OP, "n", n)? as u32, 1, 1), 128, 0);
        &kp, &vp, &kvp, &sp, &pp, &sb, &ko, &vo, &rb, &kv.ty, &w, &kv.host)
}

/// Split-KV partials and the merge of the splits.
#[derive(Debug, Clone, Copy)]
pub struct Splits<'a> {
    pub n: usize,
    /// `slots x n_head x n x hd` f32 and `slots x n_head x n x 2` f32.
    pub part_o: DeviceView<'a>,
    pub part_ms: DeviceView<'a>,
}

impl Splits<'_> {
    fn check(
        &self,
        op: &'static str,
        tokens: usize,
        n_head: usize,
        hd: usize,
    ) -> Result<(), CudaError> {
        if self.n == 0 || self.n > ATT_MAX_SPLIT {
            return Err(bad(op, format!("{} splits (1..={ATT_MAX_SPLIT})", self.n)));
        }
        let rows = tokens * n_head * self.n;
        self.part_o.expect(op, "part_o", f32s(rows * hd), 4)?;
        self.part_ms.expect(op, "part_ms", f32s(rows * 2), 4)
    }
}

/// `dq_attn_fused`: a decode step's attention of `n` tokens in one launch: QK-norm + RoPE,
/// the KV store, split-KV attention over cells `0..=pos` and the merge of the splits into
/// `out`. F16 KV, head dims a multiple of 8 up to 128, query groups dividing 128 up to 16;
/// splits of at least `min_chunk` cells; `counters` hold `n x n_head_kv` u32, zero between
/// launches.
#[allow(clippy::too_many_arguments)]
pub fn attn_fused(
    l: &Launcher<'_>,
    h: Heads<'_>,
    q: DeviceView<'_>,
    k: DeviceView<'_>,
    v: DeviceView<'_>,
    kv: KvLayer<'_>,
    sp: Splits<'_>,
    min_chunk: u32,
    counters: DeviceView<'_>,
    out: DeviceView<'_>,
    n: usize,
) -> Result<(), CudaError> {
    const OP: &str = "attn_fused";
    let (nh, nkv, hd, nr) = h.check(OP)?;
    let g = h.n_head / h.n_head_kv;
    if kv.host.spills() {
        return Err(bad(
            OP,
            "the fused attention reads every cell from VRAM but this plan keeps some beyond --kv-resident in host memory: run attn_decode (the stage turns fusion off for such plans)".into(),
        ));
    }
    if kv.ty != 1 || h.hd % 8 != 0 || h.hd > 128 || 128 % g != 0 || kv.row_bytes % 16 != 0 {
        return Err(bad(
            OP,
            format!(
                "KV type {} with head dim {} and groups of {g}: the fused attention needs F16 KV, head dims a multiple of 8 up to 128, groups dividing 128, 16-byte rows",
                kv.ty, h.hd
            ),
        ));
    }
    let [sb, ko, vo, rb] = kv.check(OP, n)?;
    sp.check(OP, n, h.n_head, h.hd)?;
    q.expect(OP, "q", f32s(n * h.n_head * h.hd), 16)?;
    k.expect(OP, "k", f32s(n * h.n_head_kv * h.hd), 16)?;
    v.expect(OP, "v", f32s(n * h.n_head_kv * h.hd), 16)?;
    counters.expect(OP, "counters", 4 * (n * h.n_head_kv) as u64, 4)?;
    out.expect(OP, "out", f32s(n * h.n_head * h.hd), 16)?;
    let scale = 1.0f32 / (h.hd as f32).sqrt();
    let chunk = min_chunk.clamp(1, 1 << 20) as i32;
    let (qp, kp, vp) = (q.ptr(), k.ptr(), v.ptr());
    let (qn, kn, pp, fp) = (
        h.q_norm.ptr(),
        h.k_norm.ptr(),
        kv.pos.ptr(),
        h.inv_freq.ptr(),
    );
    let (kvp, slp) = (kv.kv.ptr(), kv.slot.ptr());
    let (po, pm, cn, op) = (sp.part_o.ptr(), sp.part_ms.ptr(), counters.ptr(), out.ptr());
    let grid = (h.n_head_kv as u32, sp.n as u32, int(OP, "n", n)? as u32);
    launch!(l, "dq_attn_fused", cfg(grid, 128, 0);
        &qp, &kp, &vp, &qn, &kn, &h.eps, &pp, &fp, &h.attn_factor, &nh, &nkv, &hd, &nr,
        &kvp, &slp, &sb, &ko, &vo, &rb, &scale, &chunk, &po, &pm, &cn, &op)
}

/// `dq_attn_gqa` then `dq_attn_combine`: split-KV decode attention of `n` tokens whose K/V are
/// stored, over `n_ctx[t]` cells each, merged into `out`.
#[allow(clippy::too_many_arguments)]
pub fn attn_decode(
    l: &Launcher<'_>,
    h: Heads<'_>,
    q: DeviceView<'_>,
    kv: KvLayer<'_>,
    n_ctx: DeviceView<'_>,
    sp: Splits<'_>,
    out: DeviceView<'_>,
    n: usize,
) -> Result<(), CudaError> {
    attn_gqa(l, h, q, kv, n_ctx, sp, n)?;
    attn_combine(l, h, n_ctx, sp, None, out, n)
}

/// `dq_attn_gqa`: the split-KV partials of `n` decoding tokens whose K/V are stored, over
/// `n_ctx[t]` cells each (the window's only when `kv.host.cpu_part` is set: the host CPU
/// attends the rest).
pub fn attn_gqa(
    l: &Launcher<'_>,
    h: Heads<'_>,
    q: DeviceView<'_>,
    kv: KvLayer<'_>,
    n_ctx: DeviceView<'_>,
    sp: Splits<'_>,
    n: usize,
) -> Result<(), CudaError> {
    const OP: &str = "attn_decode";
    let (nh, nkv, hd, _) = h.check(OP)?;
    let [sb, ko, vo, rb] = kv.check(OP, n)?;
    sp.check(OP, n, h.n_head, h.hd)?;
    q.expect(OP, "q", f32s(n * h.n_head * h.hd), 16)?;
    n_ctx.expect(OP, "n_ctx", 4 * n as u64, 4)?;
    let scale = 1.0f32 / (h.hd as f32).sqrt();
    let (qp, kvp, slp, cp) = (q.ptr(), kv.kv.ptr(), kv.slot.ptr(), n_ctx.ptr());
    let (po, pm) = (sp.part_o.ptr(), sp.part_ms.ptr());
    let nt = int(OP, "n", n)? as u32;
    launch!(l, "dq_attn_gqa", cfg((h.n_head_kv as u32, sp.n as u32, nt), 128, 0);
        &qp, &kvp, &slp, &cp, &sb, &ko, &vo, &kv.ty, &nh, &nkv, &hd, &rb, &scale, &po, &pm,
        &kv.host)
}

/// The host CPU's partial over the cells past the window (`--kv-host cpu`): per token and
/// head the unnormalised output (`n x n_head x hd` f32) and (max, sum) (`n x n_head x 2`).
#[derive(Debug, Clone, Copy)]
pub struct HostPartial<'a> {
    pub o: DeviceView<'a>,
    pub ms: DeviceView<'a>,
    /// Cells of a slot in VRAM: the device's splits cover `min(n_ctx[t], window)`.
    pub window: u64,
}

/// `dq_attn_combine`: the flash-decoding merge of `dq_attn_gqa`'s splits of `n` tokens, and
/// of the host's partial when there is one, into `out`.
pub fn attn_combine(
    l: &Launcher<'_>,
    h: Heads<'_>,
    n_ctx: DeviceView<'_>,
    sp: Splits<'_>,
    host: Option<HostPartial<'_>>,
    out: DeviceView<'_>,
    n: usize,
) -> Result<(), CudaError> {
    const OP: &str = "attn_combine";
    let (nh, _, hd, _) = h.check(OP)?;
    sp.check(OP, n, h.n_head, h.hd)?;
    n_ctx.expect(OP, "n_ctx", 4 * n as u64, 4)?;
    out.expect(OP, "out", f32s(n * h.n_head * h.hd), 4)?;
    let (ho, hm, win) = match host {
        Some(p) => {
            p.o.expect(OP, "host o", f32s(n * h.n_head * h.hd), 4)?;
            p.ms.expect(OP, "host ms", f32s(n * h.n_head * 2), 4)?;
            let w = i32::try_from(p.window).unwrap_or(i32::MAX);
            (p.o.ptr(), p.ms.ptr(), w)
        }
        None => (0u64, 0u64, i32::MAX),
    };
    let ns = sp.n as i32;
    let (po, pm, cp, op) = (sp.part_o.ptr(), sp.part_ms.ptr(), n_ctx.ptr(), out.ptr());
    let nt = int(OP, "n", n)? as u32;
    launch!(l, "dq_attn_combine", cfg((h.n_head as u32, nt, 1), 128, 0);
        &po, &pm, &cp, &nh, &hd, &ns, &ho, &hm, &win, &op)
}
