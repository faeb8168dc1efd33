//! Op launchers of the CUDA backend: each checks its views against the op's shape (bytes and
//! alignment) and its scalar arguments against the kernel's limits, then launches on the
//! device's compute stream. Layouts match `backend::cpu`: row-major f32 activations
//! (`n_tok × n`), GGUF weight rows, KV layers of `n_cells` K rows then V rows.
//! Invariant: nothing is launched with a view smaller than the kernel will touch.

use super::{drv, CudaDevice, CudaError, DeviceView};
use crate::quant;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use strata_schemas::ggml::GgmlType;

/// Tokens one matrix-vector launch handles (matvec.cu's MV_MAX_TOK).
pub const MV_MAX_TOK: usize = 8;
/// Largest head dimension of the attention kernels (common.cuh's ATT_MAX_D).
pub const ATT_MAX_D: usize = 256;
/// Largest number of query heads per KV head the decode attention serves (decode.cu's
/// DA_MAXG).
pub const ATT_MAX_GROUP: usize = 16;

/// Splits of the decode attention for contexts up to `ctx` cells (16 cells each, a
/// `dq_attn_gqa` sub-chunk, at most 64; the plan sizes their partials). The kernel spreads
/// each token's actual context over all of them, so a graph captured for `ctx` serves any
/// shorter one.
pub use strata_schemas::workset::att_splits;

/// Largest top-k of the router kernel.
pub const ROUTER_MAX_K: usize = 64;

/// Kernel type numbers (common.cuh's ST_TY_*).
pub(crate) fn kty(ty: GgmlType) -> Option<i32> {
    Some(match ty {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::BF16 => 2,
        GgmlType::Q8_0 => 3,
        GgmlType::Q4K => 4,
        _ => return None,
    })
}

/// `v` as a kernel's 32-bit index, or a shape error naming `what`.
pub(crate) fn int(op: &'static str, what: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Shape {
        op,
        detail: format!("{what} = {v} exceeds the kernel's 32-bit index"),
    })
}

/// A shape error of `op`.
pub(crate) fn bad(op: &'static str, detail: String) -> CudaError {
    CudaError::Shape { op, detail }
}

fn f32s(n: usize) -> u64 {
    4 * n as u64
}

fn grid1(n: usize, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Shapes of a decode attention call (see `CudaDevice::attn_decode`).
#[derive(Debug, Clone, Copy)]
pub struct AttnDecode {
    pub n_tok: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    /// Cells in the KV layer (rows of K and of V).
    pub n_cells: usize,
    /// Elements per K row and per V row (every KV head).
    pub k_row_elems: usize,
    pub v_row_elems: usize,
    /// F16, F32 or Q8_0.
    pub kv_ty: GgmlType,
    pub scale: f32,
    /// The largest `n_ctx` of any token (sizes the split count and the scratch).
    pub max_ctx: usize,
}

impl AttnDecode {
    /// Splits over the KV length.
    pub fn n_split(&self) -> usize {
        att_splits(self.max_ctx)
    }

    /// Scratch bytes the partial results need.
    pub fn scratch_bytes(&self) -> u64 {
        let slots = (self.n_tok * self.n_head * self.n_split()) as u64;
        4 * slots * (self.head_dim_v as u64 + 2)
    }
}

impl CudaDevice {
    /// RMSNorm of `n_rows` rows of `n`: `h = x (+ res)`, `out = w * h / rms(h)`; with `res`
    /// given, `h_out` (if any) receives `h` (the updated residual stream). In place is allowed.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm(
        &self,
        x: DeviceView<'_>,
        res: Option<DeviceView<'_>>,
        h_out: Option<DeviceView<'_>>,
        w: DeviceView<'_>,
        out: DeviceView<'_>,
        n: usize,
        n_rows: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        const OP: &str = "rmsnorm";
        if n == 0 || n_rows == 0 {
            return Err(bad(OP, format!("empty shape {n_rows} x {n}")));
        }
        let total = f32s(n * n_rows);
        x.expect(OP, "x", total, 4)?;
        w.expect(OP, "w", f32s(n), 4)?;
        out.expect(OP, "out", total, 4)?;
        if let Some(r) = res {
            r.expect(OP, "res", total, 4)?;
        }
        if let Some(h) = h_out {
            h.expect(OP, "h_out", total, 4)?;
        }
        let (ni, rows) = (int(OP, "n", n)?, int(OP, "n_rows", n_rows)?);
        let (rp, hp) = (res.map_or(0, |v| v.ptr()), h_out.map_or(0, |v| v.ptr()));
        let f = self.function("rmsnorm_f32")?;
        let mut b = self.stream.launch_builder(f);
        let (xp, wp, op) = (x.ptr(), w.ptr(), out.ptr());
        b.arg(&xp)
            .arg(&rp)
            .arg(&hp)
            .arg(&wp)
            .arg(&op)
            .arg(&ni)
            .arg(&eps);
        // SAFETY: every pointer is a checked view of at least the bytes the kernel touches
        // (n_rows rows of n f32, w of n); the argument list matches rmsnorm_f32's signature.
        unsafe { b.launch(grid1(rows as usize, 256)) }.map_err(drv("launch rmsnorm_f32"))?;
        Ok(())
    }

    /// In place on `x` (`n_tok × n_head × head_dim`): optional per-head RMSNorm by `w`
    /// (`head_dim` weights), then NEOX RoPE of the first `n_rot` dims at `pos[t]` with the
    /// host's `inv_freq` (`n_rot/2`, YaRN already folded in) and `attn_factor`.
    #[allow(clippy::too_many_arguments)]
    pub fn qk_norm_rope(
        &self,
        x: DeviceView<'_>,
        w: Option<DeviceView<'_>>,
        eps: f32,
        pos: DeviceView<'_>,
        inv_freq: DeviceView<'_>,
        attn_factor: f32,
        n_tok: usize,
        n_head: usize,
        head_dim: usize,
        n_rot: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "qk_norm_rope";
        if head_dim == 0 || head_dim > 1024 || n_rot > head_dim || n_rot % 2 != 0 {
            return Err(bad(
                OP,
                format!("head_dim {head_dim} must be 1..=1024 and n_rot {n_rot} even and <= it"),
            ));
        }
        if n_tok == 0 || n_head == 0 {
            return Ok(());
        }
        x.expect(OP, "x", f32s(n_tok * n_head * head_dim), 4)?;
        if let Some(w) = w {
            w.expect(OP, "w", f32s(head_dim), 4)?;
        }
        pos.expect(OP, "pos", 4 * n_tok as u64, 4)?;
        inv_freq.expect(OP, "inv_freq", f32s(n_rot / 2), 4)?;
        let (nh, hd, nr) = (
            int(OP, "n_head", n_head)?,
            int(OP, "head_dim", head_dim)?,
            int(OP, "n_rot", n_rot)?,
        );
        let f = self.function("qk_norm_rope_f32")?;
        let (xp, wp, pp, fp) = (x.ptr(), w.map_or(0, |v| v.ptr()), pos.ptr(), inv_freq.ptr());
        let mut b = self.stream.launch_builder(f);
        b.arg(&xp)
            .arg(&wp)
            .arg(&eps)
            .arg(&pp)
            .arg(&fp)
            .arg(&attn_factor);
        b.arg(&nh).arg(&hd).arg(&nr);
        let cfg = LaunchConfig {
            grid_dim: (n_head as u32, int(OP, "n_tok", n_tok)? as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: views checked above against the kernel's reads and writes.
        unsafe { b.launch(cfg) }.map_err(drv("launch qk_norm_rope_f32"))?;
        Ok(())
    }

    /// `y[t][r] = W_r · x[t]` for `n_tok` tokens; W is `rows` GGUF rows of `cols` elements
    /// of `ty` (F32, F16, BF16, Q8_0, Q4_K), x is `n_tok × cols`, y is `n_tok × rows`.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec(
        &self,
        w: DeviceView<'_>,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        x: DeviceView<'_>,
        n_tok: usize,
        y: DeviceView<'_>,
    ) -> Result<(), CudaError> {
        const OP: &str = "matvec";
        let rb = quant::row_bytes(ty, cols).map_err(|e| bad(OP, e.to_string()))?;
        let t = kty(ty).ok_or_else(|| bad(OP, format!("no kernel for {ty}")))?;
        w.expect(
            OP,
            "w",
            rb as u64 * rows as u64,
            if ty == GgmlType::F32 { 4 } else { 2 },
        )?;
        x.expect(OP, "x", f32s(n_tok * cols), 4)?;
        y.expect(OP, "y", f32s(n_tok * rows), 4)?;
        let (ri, ci) = (int(OP, "rows", rows)?, int(OP, "cols", cols)?);
        int(OP, "cols * n_tok", cols * n_tok)?;
        let name = match ty {
            GgmlType::Q8_0 => "mv_q8_0",
            GgmlType::Q4K => "mv_q4_k",
            _ => "mv_plain",
        };
        let f = self.function(name)?;
        const WARPS: usize = 4;
        let cfg = grid1(rows.div_ceil(WARPS), 32 * WARPS as u32);
        let wp = w.ptr();
        let mut t0 = 0;
        while t0 < n_tok {
            let nt = (n_tok - t0).min(MV_MAX_TOK) as i32;
            let xp = x.ptr() + f32s(t0 * cols);
            let yp = y.ptr() + f32s(t0 * rows);
            let mut b = self.stream.launch_builder(f);
            b.arg(&wp);
            if name == "mv_plain" {
                b.arg(&t);
            }
            b.arg(&xp).arg(&yp).arg(&ri).arg(&ci).arg(&nt);
            // SAFETY: w holds rows whole rows of ty; x and y hold n_tok tokens, and this chunk
            // reads tokens t0..t0+nt of them.
            unsafe { b.launch(cfg) }.map_err(drv(format!("launch {name}")))?;
            t0 += MV_MAX_TOK;
        }
        Ok(())
    }

    /// Embedding lookup: `out[t] = dequantize(W row ids[t])`, W `rows × cols` of `ty`.
    /// `ids` are checked on the host (`ids_host`), then read from `ids` on the device.
    #[allow(clippy::too_many_arguments)]
    pub fn get_rows(
        &self,
        w: DeviceView<'_>,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        ids_host: &[i32],
        ids: DeviceView<'_>,
        out: DeviceView<'_>,
    ) -> Result<(), CudaError> {
        const OP: &str = "get_rows";
        let rb = quant::row_bytes(ty, cols).map_err(|e| bad(OP, e.to_string()))?;
        let t = kty(ty).ok_or_else(|| bad(OP, format!("no kernel for {ty}")))?;
        let n_tok = ids_host.len();
        if let Some(bad_id) = ids_host.iter().find(|&&i| i < 0 || i as usize >= rows) {
            return Err(bad(
                OP,
                format!("token id {bad_id} outside the {rows}-row table"),
            ));
        }
        if n_tok == 0 {
            return Ok(());
        }
        w.expect(OP, "w", rb as u64 * rows as u64, 2)?;
        ids.expect(OP, "ids", 4 * n_tok as u64, 4)?;
        out.expect(OP, "out", f32s(n_tok * cols), 4)?;
        let (rbi, ci) = (rb as i64, int(OP, "cols", cols)?);
        let f = self.function("get_rows")?;
        let (wp, ip, op) = (w.ptr(), ids.ptr(), out.ptr());
        let mut b = self.stream.launch_builder(f);
        b.arg(&wp).arg(&t).arg(&rbi).arg(&ip).arg(&op).arg(&ci);
        // SAFETY: every id was checked < rows on the host and `ids` holds the same values
        // (the caller uploads ids_host); out holds n_tok rows.
        unsafe { b.launch(grid1(n_tok, 256)) }.map_err(drv("launch get_rows"))?;
        Ok(())
    }

    /// `out = silu(g) * u` over `n` elements.
    pub fn swiglu(
        &self,
        g: DeviceView<'_>,
        u: DeviceView<'_>,
        out: DeviceView<'_>,
        n: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "swiglu";
        for (v, what) in [(g, "g"), (u, "u"), (out, "out")] {
            v.expect(OP, what, f32s(n), 4)?;
        }
        if n == 0 {
            return Ok(());
        }
        let f = self.function("swiglu_f32")?;
        let (gp, up, op, ni) = (g.ptr(), u.ptr(), out.ptr(), n as i64);
        let mut b = self.stream.launch_builder(f);
        b.arg(&gp).arg(&up).arg(&op).arg(&ni);
        let blocks = n.div_ceil(256).min(65535);
        // SAFETY: all three views hold n f32; the kernel's grid-stride loop stops at n.
        unsafe { b.launch(grid1(blocks, 256)) }.map_err(drv("launch swiglu_f32"))?;
        Ok(())
    }

    /// MoE router: softmax over `n_expert` logits per token, top `k` (ties to the lower
    /// index) into `idx` (i32) and `w` (f32), each `n_tok × k`; renormalised when `norm`.
    #[allow(clippy::too_many_arguments)]
    pub fn router_topk(
        &self,
        logits: DeviceView<'_>,
        n_tok: usize,
        n_expert: usize,
        k: usize,
        norm: bool,
        idx: DeviceView<'_>,
        w: DeviceView<'_>,
    ) -> Result<(), CudaError> {
        const OP: &str = "router_topk";
        if k == 0 || k > ROUTER_MAX_K || k > n_expert || n_expert > 12 * 1024 {
            return Err(bad(
                OP,
                format!("k {k} must be 1..={ROUTER_MAX_K} and <= n_expert {n_expert} (<= 12288)"),
            ));
        }
        logits.expect(OP, "logits", f32s(n_tok * n_expert), 4)?;
        idx.expect(OP, "idx", 4 * (n_tok * k) as u64, 4)?;
        w.expect(OP, "w", f32s(n_tok * k), 4)?;
        if n_tok == 0 {
            return Ok(());
        }
        let f = self.function("router_softmax_topk")?;
        let (lp, ip, wp) = (logits.ptr(), idx.ptr(), w.ptr());
        let (ne, ki, ni) = (n_expert as i32, k as i32, norm as i32);
        let mut b = self.stream.launch_builder(f);
        b.arg(&lp).arg(&ne).arg(&ki).arg(&ni).arg(&ip).arg(&wp);
        let mut cfg = grid1(int(OP, "n_tok", n_tok)? as usize, 256);
        cfg.shared_mem_bytes = 4 * n_expert as u32;
        // SAFETY: views checked; dynamic shared memory holds n_expert floats (<= 48 KiB).
        unsafe { b.launch(cfg) }.map_err(drv("launch router_softmax_topk"))?;
        Ok(())
    }

    /// Greedy sampling: `out[t]` (i32) = lowest index of the largest of `n` logits of token t.
    pub fn argmax(
        &self,
        logits: DeviceView<'_>,
        n_tok: usize,
        n: usize,
        out: DeviceView<'_>,
    ) -> Result<(), CudaError> {
        const OP: &str = "argmax";
        logits.expect(OP, "logits", f32s(n_tok * n), 4)?;
        out.expect(OP, "out", 4 * n_tok as u64, 4)?;
        if n_tok == 0 {
            return Ok(());
        }
        let f = self.function("argmax_f32")?;
        let (lp, ni, op) = (logits.ptr(), int(OP, "n", n)?, out.ptr());
        let mut b = self.stream.launch_builder(f);
        b.arg(&lp).arg(&ni).arg(&op);
        // SAFETY: views checked above.
        unsafe { b.launch(grid1(n_tok, 256)) }.map_err(drv("launch argmax_f32"))?;
        Ok(())
    }

    /// Decode attention: `q` is `n_tok × n_head × head_dim_k`, token t sees KV cells
    /// `[0, n_ctx[t])` (`n_ctx_host` checked here, `n_ctx` the same values on the device);
    /// `out` is `n_tok × n_head × head_dim_v`; `scratch` holds `a.scratch_bytes()`.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_decode(
        &self,
        a: &AttnDecode,
        q: DeviceView<'_>,
        k: DeviceView<'_>,
        v: DeviceView<'_>,
        n_ctx_host: &[i32],
        n_ctx: DeviceView<'_>,
        scratch: DeviceView<'_>,
        out: DeviceView<'_>,
    ) -> Result<(), CudaError> {
        const OP: &str = "attn_decode";
        let t = match a.kv_ty {
            GgmlType::F32 | GgmlType::F16 | GgmlType::Q8_0 => kty(a.kv_ty).unwrap_or(1),
            other => return Err(bad(OP, format!("KV type {other} has no kernel"))),
        };
        if a.n_head_kv == 0 || a.n_head % a.n_head_kv != 0 {
            return Err(bad(
                OP,
                format!(
                    "n_head {} not a multiple of n_head_kv {}",
                    a.n_head, a.n_head_kv
                ),
            ));
        }
        if a.head_dim_k > ATT_MAX_D
            || a.head_dim_k != a.head_dim_v
            || a.k_row_elems != a.v_row_elems
        {
            return Err(bad(
                OP,
                format!(
                    "head dims {}/{} and row widths {}/{}: the kernel needs equal K and V head dims of at most {ATT_MAX_D} and equal row widths",
                    a.head_dim_k, a.head_dim_v, a.k_row_elems, a.v_row_elems
                ),
            ));
        }
        if a.n_head / a.n_head_kv > ATT_MAX_GROUP {
            return Err(bad(
                OP,
                format!(
                    "{} query heads per KV head: at most {ATT_MAX_GROUP}",
                    a.n_head / a.n_head_kv
                ),
            ));
        }
        if a.k_row_elems < a.n_head_kv * a.head_dim_k || a.v_row_elems < a.n_head_kv * a.head_dim_v
        {
            return Err(bad(OP, "KV rows shorter than n_head_kv heads".into()));
        }
        if n_ctx_host.len() != a.n_tok {
            return Err(bad(
                OP,
                format!("{} n_ctx values for {} tokens", n_ctx_host.len(), a.n_tok),
            ));
        }
        if let Some(c) = n_ctx_host
            .iter()
            .find(|&&c| c <= 0 || c as usize > a.n_cells || c as usize > a.max_ctx)
        {
            return Err(bad(
                OP,
                format!("n_ctx {c} outside 1..={} (cells {})", a.max_ctx, a.n_cells),
            ));
        }
        if a.n_tok == 0 {
            return Ok(());
        }
        let krb = quant::row_bytes(a.kv_ty, a.k_row_elems).map_err(|e| bad(OP, e.to_string()))?;
        let vrb = quant::row_bytes(a.kv_ty, a.v_row_elems).map_err(|e| bad(OP, e.to_string()))?;
        q.expect(OP, "q", f32s(a.n_tok * a.n_head * a.head_dim_k), 4)?;
        k.expect(OP, "k", krb as u64 * a.n_cells as u64, 2)?;
        v.expect(OP, "v", vrb as u64 * a.n_cells as u64, 2)?;
        n_ctx.expect(OP, "n_ctx", 4 * a.n_tok as u64, 4)?;
        scratch.expect(OP, "scratch", a.scratch_bytes(), 4)?;
        out.expect(OP, "out", f32s(a.n_tok * a.n_head * a.head_dim_v), 4)?;
        let n_split = a.n_split();
        let slots = (a.n_tok * a.n_head * n_split) as u64;
        let part_o = scratch.ptr();
        let part_ms = scratch.ptr() + 4 * slots * a.head_dim_v as u64;
        let (nh, nkv, hd) = (
            int(OP, "n_head", a.n_head)?,
            int(OP, "n_head_kv", a.n_head_kv)?,
            a.head_dim_k as i32,
        );
        let ns = n_split as i32;
        // The engine's kernel addresses K and V as offsets from one per-slot base; here the
        // base is K, V sits at (v - k) and the slot stride is 0 (so the slot array, any int
        // array of n_tok values, is only read and multiplied by 0).
        let (base, k_off, v_off, slot_bytes) =
            (k.ptr(), 0i64, v.ptr() as i64 - k.ptr() as i64, 0i64);
        let (rb, cp, op) = (krb as i64, n_ctx.ptr(), out.ptr());
        let qp = q.ptr();
        let f = self.function("dq_attn_gqa")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&qp)
            .arg(&base)
            .arg(&cp)
            .arg(&cp)
            .arg(&slot_bytes)
            .arg(&k_off)
            .arg(&v_off)
            .arg(&t)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd);
        b.arg(&rb).arg(&a.scale).arg(&part_o).arg(&part_ms);
        let cfg = LaunchConfig {
            grid_dim: (
                a.n_head_kv as u32,
                n_split as u32,
                int(OP, "n_tok", a.n_tok)? as u32,
            ),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: q, k, v, n_ctx, scratch were checked against the kernel's reads and writes;
        // every n_ctx is <= n_cells, so no row past the KV layer is read.
        unsafe { b.launch(cfg) }.map_err(drv("launch dq_attn_gqa"))?;
        let f = self.function("dq_attn_combine")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&part_o)
            .arg(&part_ms)
            .arg(&cp)
            .arg(&nh)
            .arg(&hd)
            .arg(&ns)
            .arg(&op);
        let cfg = LaunchConfig {
            grid_dim: (a.n_head as u32, a.n_tok as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the partials were written by the launch above on the same stream; out holds
        // n_tok × n_head × head_dim_v f32.
        unsafe { b.launch(cfg) }.map_err(drv("launch dq_attn_combine"))?;
        Ok(())
    }
}

/// One layer of per-slot KV as the engine lays it out: slot `s` holds `n_cells` K rows then
/// `n_cells` V rows of `row_elems` elements of `ty`, at `s * 2 * n_cells * row_bytes`.
#[derive(Debug, Clone, Copy)]
pub struct SlotKv {
    pub n_slots: usize,
    pub n_cells: usize,
    pub row_elems: usize,
    /// F16, F32 or Q8_0.
    pub ty: GgmlType,
}

impl SlotKv {
    pub fn row_bytes(&self) -> Result<u64, CudaError> {
        quant::row_bytes(self.ty, self.row_elems)
            .map(|b| b as u64)
            .map_err(|e| bad("kv", e.to_string()))
    }

    /// Bytes of the whole region.
    pub fn bytes(&self) -> Result<u64, CudaError> {
        Ok(2 * (self.n_slots * self.n_cells) as u64 * self.row_bytes()?)
    }

    /// The kernels' (type, slot_bytes, k_off, v_off, row_bytes) after checking every
    /// (slot, position) pair the launch will touch.
    fn geometry(
        &self,
        op: &'static str,
        kv: DeviceView<'_>,
        slots: &[i32],
        pos: &[i32],
    ) -> Result<(i32, i64, i64, i64, i64), CudaError> {
        let t = match self.ty {
            GgmlType::F32 | GgmlType::F16 | GgmlType::Q8_0 => kty(self.ty).unwrap_or(1),
            other => return Err(bad(op, format!("KV type {other} has no kernel"))),
        };
        let rb = self.row_bytes()?;
        kv.expect(op, "kv", self.bytes()?, 2)?;
        for (&s, &p) in slots.iter().zip(pos) {
            if s < 0 || s as usize >= self.n_slots || p < 0 || p as usize >= self.n_cells {
                return Err(bad(
                    op,
                    format!(
                        "slot {s} / position {p} outside {} slots of {} cells",
                        self.n_slots, self.n_cells
                    ),
                ));
            }
        }
        let cells = self.n_cells as i64 * rb as i64;
        Ok((t, 2 * cells, 0, cells, rb as i64))
    }
}

impl CudaDevice {
    /// The KV store (decode.cu's `dq_kv_store`): token t's K and V rows (`kv.row_elems` f32
    /// each) into cell `pos[t]` of slot `slot[t]`. `slot_host`/`pos_host` are the device
    /// arrays' values, checked here.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_store(
        &self,
        layout: &SlotKv,
        k: DeviceView<'_>,
        v: DeviceView<'_>,
        kv: DeviceView<'_>,
        slot_host: &[i32],
        slot: DeviceView<'_>,
        pos_host: &[i32],
        pos: DeviceView<'_>,
    ) -> Result<(), CudaError> {
        const OP: &str = "kv_store";
        let n = slot_host.len();
        if pos_host.len() != n || (layout.ty == GgmlType::Q8_0 && layout.row_elems % 32 != 0) {
            return Err(bad(
                OP,
                format!(
                    "{n} slots, {} positions, rows of {} (q8_0 needs whole 32-blocks)",
                    pos_host.len(),
                    layout.row_elems
                ),
            ));
        }
        let (t, sb, ko, vo, rb) = layout.geometry(OP, kv, slot_host, pos_host)?;
        k.expect(OP, "k", f32s(n * layout.row_elems), 4)?;
        v.expect(OP, "v", f32s(n * layout.row_elems), 4)?;
        slot.expect(OP, "slot", 4 * n as u64, 4)?;
        pos.expect(OP, "pos", 4 * n as u64, 4)?;
        if n == 0 {
            return Ok(());
        }
        let width = int(OP, "row_elems", layout.row_elems)?;
        let (kp, vp, kvp, sp, pp) = (k.ptr(), v.ptr(), kv.ptr(), slot.ptr(), pos.ptr());
        let f = self.function("dq_kv_store")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&kp).arg(&vp).arg(&kvp).arg(&sp).arg(&pp);
        b.arg(&sb).arg(&ko).arg(&vo).arg(&rb).arg(&t).arg(&width);
        // SAFETY: every (slot, position) was checked to lie in the region, whose size was
        // checked; k and v hold n rows.
        unsafe { b.launch(grid1(n, 128)) }.map_err(drv("launch dq_kv_store"))?;
        Ok(())
    }

    /// Prefill attention: `n_tok` queries of slot `slot_host[0]` at positions `pos_host`,
    /// each seeing cells `[0, pos]` of the slot's KV; `q` is `n_tok × n_head × hd`, `out` the
    /// same shape. `flash` picks the tensor-core `fa_prefill` (head sizes 64 and 128), else
    /// the f32 `dq_attn_prefill` runs.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_prefill(
        &self,
        layout: &SlotKv,
        heads: (usize, usize, usize),
        flash: bool,
        q: DeviceView<'_>,
        kv: DeviceView<'_>,
        slot_host: &[i32],
        slot: DeviceView<'_>,
        pos_host: &[i32],
        pos: DeviceView<'_>,
        out: DeviceView<'_>,
    ) -> Result<(), CudaError> {
        const OP: &str = "attn_prefill";
        let (n_head, n_head_kv, hd) = heads;
        let n = pos_host.len();
        if layout.row_elems != n_head_kv * hd || slot_host.is_empty() {
            return Err(bad(
                OP,
                format!(
                    "rows of {} for {n_head_kv} KV heads of {hd}, {} slots given",
                    layout.row_elems,
                    slot_host.len()
                ),
            ));
        }
        let slots = vec![slot_host[0]; n];
        let (t, sb, ko, vo, rb) = layout.geometry(OP, kv, &slots, pos_host)?;
        q.expect(OP, "q", f32s(n * n_head * hd), 16)?;
        out.expect(OP, "out", f32s(n * n_head * hd), 16)?;
        slot.expect(OP, "slot", 4, 4)?;
        pos.expect(OP, "pos", 4 * n as u64, 4)?;
        let a = super::flash::PrefillAttn {
            q: q.ptr(),
            kv: kv.ptr(),
            slot: slot.ptr(),
            pos: pos.ptr(),
            slot_bytes: sb as u64,
            k_off: ko as u64,
            v_off: vo as u64,
            row_bytes: rb as u64,
            kv_ty: t,
            n_head,
            n_head_kv,
            hd,
            scale: 1.0 / (hd as f32).sqrt(),
            n_tok: n,
            out: out.ptr(),
        };
        // SAFETY: the slot and every position were checked against the region, q and out
        // against n_tok rows; a query reads cells up to its own position only.
        unsafe {
            if flash {
                super::flash::launch_fa_prefill(self, &a)
            } else {
                super::flash::launch_dq_attn_prefill(self, &a)
            }
        }
    }
}
