//! Launchers of the norm, product, router, expert, lookup and token-pick kernels
//! (`kernels/cuda/norm.cu`, `decode.cu`, `router.cu`, `sample.cu`): one function per kernel,
//! each checking its views against what the kernel touches for the given shape.
//! Invariant: activations are row-major f32 (`n x width`), index buffers i32, and every view
//! is at least as long as the rows the launch reads or writes.

use super::{
    bad, cfg, f32s, int, kq_type, launch, mv1_blocks, walk_blocks, xs_bytes, Launcher, Mat,
    DQ_DOWN_MAXK, DQ_MAX_TOK, DQ_WARPS, DQ_XR_COLS, SAMPLE_MAX_VOCAB,
};
use crate::backend::cuda::{CudaError, DeviceView};
use strata_kernels::consts::{RW_KC, RW_TILE, RW_WARPS};
use strata_schemas::ggml::GgmlType;

/// `dq_spin`: keeps the GPU busy for `ns` nanoseconds (the profiler's spacer).
pub fn spin(l: &Launcher<'_>, ns: i64) -> Result<(), CudaError> {
    let mut args = [super::arg_ptr(&ns)];
    // SAFETY: dq_spin takes one integer and touches no memory.
    unsafe { l.dev.launch_raw("dq_spin", cfg((1, 1, 1), 1, 0), &mut args) }
}

/// `rmsnorm_f32`: `out[i] = RMSNorm(x[i] (+ res[i])) * w` over `n` rows of `e`; `h_out`
/// (when given) gets `x[i] + res[i]`.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm(
    l: &Launcher<'_>,
    x: DeviceView<'_>,
    res: Option<DeviceView<'_>>,
    h_out: Option<DeviceView<'_>>,
    w: DeviceView<'_>,
    out: DeviceView<'_>,
    e: usize,
    eps: f32,
    n: usize,
) -> Result<(), CudaError> {
    const OP: &str = "rmsnorm";
    let rows = f32s(n * e);
    x.expect(OP, "x", rows, 4)?;
    w.expect(OP, "w", f32s(e), 4)?;
    out.expect(OP, "out", rows, 4)?;
    if let Some(r) = res {
        r.expect(OP, "res", rows, 4)?;
    }
    if let Some(h) = h_out {
        h.expect(OP, "h_out", rows, 4)?;
    }
    let (xp, wp, op) = (x.ptr(), w.ptr(), out.ptr());
    let rp = res.map_or(0, |r| r.ptr());
    let hp = h_out.map_or(0, |h| h.ptr());
    let e32 = int(OP, "e", e)?;
    let nb = int(OP, "n", n)? as u32;
    launch!(l, "rmsnorm_f32", cfg((nb, 1, 1), 256, 0); &xp, &rp, &hp, &wp, &op, &e32, &eps)
}

/// `qk_norm_rope_f32`: per-head RMSNorm by `w` then NEOX RoPE at each token's position, in
/// place, over `n` tokens of `heads` heads of `hd` (`n_rot` dims rotated).
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope(
    l: &Launcher<'_>,
    x: DeviceView<'_>,
    w: DeviceView<'_>,
    eps: f32,
    pos: DeviceView<'_>,
    inv_freq: DeviceView<'_>,
    attn_factor: f32,
    heads: usize,
    hd: usize,
    n_rot: usize,
    n: usize,
) -> Result<(), CudaError> {
    const OP: &str = "qk_norm_rope";
    x.expect(OP, "x", f32s(n * heads * hd), 4)?;
    w.expect(OP, "w", f32s(hd), 4)?;
    pos.expect(OP, "pos", 4 * n as u64, 4)?;
    inv_freq.expect(OP, "inv_freq", f32s(n_rot / 2), 4)?;
    if n_rot % 2 != 0 || n_rot > hd {
        return Err(bad(
            OP,
            format!("n_rot {n_rot} must be even and at most {hd}"),
        ));
    }
    let (xp, wp, pp, fp) = (x.ptr(), w.ptr(), pos.ptr(), inv_freq.ptr());
    let (nh, hdi, nr) = (
        int(OP, "heads", heads)?,
        int(OP, "hd", hd)?,
        int(OP, "n_rot", n_rot)?,
    );
    let grid = (heads as u32, int(OP, "n", n)? as u32, 1);
    launch!(l, "qk_norm_rope_f32", cfg(grid, 128, 0); &xp, &wp, &eps, &pp, &fp, &attn_factor, &nh, &hdi, &nr)
}

/// `dq_get_rows`: `out[i] = W[ids[i]]` dequantized, for `n` ids.
pub fn get_rows(
    l: &Launcher<'_>,
    w: Mat<'_>,
    ids: DeviceView<'_>,
    out: DeviceView<'_>,
    n: usize,
) -> Result<(), CudaError> {
    const OP: &str = "get_rows";
    let ty = w.check(OP)?;
    ids.expect(OP, "ids", 4 * n as u64, 4)?;
    out.expect(OP, "out", f32s(n * w.cols), 4)?;
    let (wp, ip, op) = (w.w.ptr(), ids.ptr(), out.ptr());
    let (rows, cols) = (w.rows as i32, w.cols as i32);
    launch!(l, "dq_get_rows", cfg((int(OP, "n", n)? as u32, 1, 1), 256, 0); &wp, &ty, &rows, &cols, &ip, &op)
}

/// `dq_ctx_from_pos`: `n_ctx[i] = pos[i] + 1`.
pub fn ctx_from_pos(
    l: &Launcher<'_>,
    pos: DeviceView<'_>,
    n_ctx: DeviceView<'_>,
    n: usize,
) -> Result<(), CudaError> {
    const OP: &str = "ctx_from_pos";
    pos.expect(OP, "pos", 4 * n as u64, 4)?;
    n_ctx.expect(OP, "n_ctx", 4 * n as u64, 4)?;
    let (pp, cp, n32) = (pos.ptr(), n_ctx.ptr(), int(OP, "n", n)?);
    launch!(l, "dq_ctx_from_pos", cfg((n.div_ceil(128) as u32, 1, 1), 128, 0); &pp, &cp, &n32)
}

/// The optional RMSNorm a one-token product applies to its input first: the weights and
/// where the normalised rows go (`xn_out`, when wanted).
#[derive(Debug, Clone, Copy)]
pub struct InNorm<'a> {
    pub w: DeviceView<'a>,
    pub eps: f32,
    pub xn_out: Option<DeviceView<'a>>,
}

/// Whether a product of `n` tokens over `ty` weights takes the multi-token kernels of rows.cu
/// (`dq_rows_mv*`, `dq_rows_qkv*`): two tokens or more over Q8_0 or Q4_K, which they read once
/// for up to 16 tokens where `dq_mv8` / `dq_qkv8` read them once per token from L1.
pub fn rows_kernel(n: usize, ty: GgmlType) -> bool {
    n >= 2 && matches!(ty, GgmlType::Q8_0 | GgmlType::Q4K)
}

/// Tokens per grid row of the multi-token kernels for `n` tokens: 4, 8 or 16 (`n` past 16 in
/// chunks of 16 on grid.y); the kernel keeps that many accumulators a row.
pub fn rows_tokens(n: usize) -> usize {
    match n {
        0..=4 => 4,
        5..=8 => 8,
        _ => 16,
    }
}

/// Column split `wc` of the multi-token kernels: a block's RW_WARPS warps cover
/// `RW_WARPS / wc` row tiles of RW_TILE rows, each tile's columns split over `wc` warps. The
/// smallest split (the most rows a block, so the staged input serves the most weights) that
/// still gives two blocks per SM, else the widest.
pub fn rows_split(sms: usize, rows: usize) -> u32 {
    for wc in [1, 2] {
        if rows.div_ceil(rows_block(wc)) >= 2 * sms {
            return wc;
        }
    }
    RW_WARPS
}

/// Output rows of one block of the multi-token kernels at column split `wc`.
pub fn rows_block(wc: u32) -> usize {
    RW_TILE * (RW_WARPS / wc) as usize
}

/// Dynamic shared memory of the multi-token kernels at `nt` tokens a grid row: the staged
/// chunk (`nt x RW_KC` f32) and each thread's sums of squares (`nt` f32 a thread).
pub fn rows_smem(nt: usize) -> u32 {
    (4 * nt * (RW_KC + 32 * RW_WARPS as usize)) as u32
}

/// The launch shape of a multi-token kernel over `rows` rows and `n` tokens: (kernel name
/// suffix tokens, grid, block, shared bytes, column split).
fn rows_shape(l: &Launcher<'_>, rows: usize, n: usize) -> (usize, (u32, u32, u32), u32, u32, i32) {
    let nt = rows_tokens(n);
    let wc = rows_split(l.sm_count(), rows);
    let grid = (
        rows.div_ceil(rows_block(wc)) as u32,
        n.div_ceil(nt) as u32,
        1,
    );
    (nt, grid, 32 * RW_WARPS, rows_smem(nt), wc as i32)
}

/// `dq_mv1` (one token) / `dq_mv8` (up to 8 tokens per grid row): `y (+)= W norm?(x)` for `n`
/// tokens; two or more tokens over Q8_0 or Q4_K take `dq_rows_mv4/8/16` instead
/// ([`rows_kernel`]). `stage`: a one-token product over Q8_0 rows wider than the register
/// path stages its input in shared memory (bit for bit the same result), and so does one over
/// Q5_K or Q6_K rows (`dq_mv1_kq` / `dq_mv8_kq`) tall enough for its grid to be capped (the LM
/// head).
#[allow(clippy::too_many_arguments)]
pub fn mv(
    l: &Launcher<'_>,
    label: &'static str,
    w: Mat<'_>,
    x: DeviceView<'_>,
    norm: Option<InNorm<'_>>,
    y: DeviceView<'_>,
    n: usize,
    add: bool,
    stage: bool,
) -> Result<(), CudaError> {
    const OP: &str = "mv";
    let ty = w.check(OP)?;
    x.expect(OP, "x", f32s(n * w.cols), 4)?;
    y.expect(OP, "y", f32s(n * w.rows), 4)?;
    let (nw, eps, xn) = match norm {
        Some(nm) => {
            nm.w.expect(OP, "norm weights", f32s(w.cols), 4)?;
            if let Some(o) = nm.xn_out {
                o.expect(OP, "xn_out", f32s(n * w.cols), 4)?;
            }
            (nm.w.ptr(), nm.eps, nm.xn_out.map_or(0, |o| o.ptr()))
        }
        None => (0, 0.0, 0),
    };
    let (add, n32) = (add as i32, int(OP, "n", n)?);
    if rows_kernel(n, w.ty) {
        if w.rows == 0 {
            return Ok(());
        }
        // The kernel's float4 loads of x and the norm weights.
        x.expect(OP, "x", f32s(n * w.cols), 16)?;
        if let Some(nm) = norm {
            nm.w.expect(OP, "norm weights", f32s(w.cols), 16)?;
        }
        let (nt, grid, block, smem, wc) = rows_shape(l, w.rows, n);
        let name = match nt {
            4 => "dq_rows_mv4",
            8 => "dq_rows_mv8",
            _ => "dq_rows_mv16",
        };
        let (wp, xp, yp) = (w.w.ptr(), x.ptr(), y.ptr());
        let (rows, cols) = (w.rows as i32, w.cols as i32);
        return launch!(l, name => label, cfg(grid, block, smem);
            &wp, &ty, &rows, &cols, &xp, &nw, &eps, &yp, &n32, &add, &xn, &wc);
    }
    let chunks = n.div_ceil(DQ_MAX_TOK) as u32;
    let (wp, xp, yp) = (w.w.ptr(), x.ptr(), y.ptr());
    let (rows, cols) = (w.rows as i32, w.cols as i32);
    if kq_fast(l, w.ty) {
        // dq_mv1_kq / dq_mv8_kq: a tall one-token product (the LM head) caps its grid, its
        // warps walk groups of rows (each input value read once a group) and the block
        // stages its input in shared memory once.
        let (name, blocks) = if n == 1 {
            ("dq_mv1_kq", walk_blocks(l, w.rows))
        } else {
            ("dq_mv8_kq", (w.rows as u32).div_ceil(DQ_WARPS))
        };
        let capped = blocks < (w.rows as u32).div_ceil(DQ_WARPS);
        let smem = if stage && n == 1 && capped && w.cols * 4 <= 48 << 10 {
            (w.cols * 4) as u32
        } else {
            0
        };
        return launch!(l, name => label, cfg((blocks, chunks, 1), 32 * DQ_WARPS, smem);
            &wp, &ty, &rows, &cols, &xp, &nw, &eps, &yp, &n32, &add, &xn);
    }
    let name = match (n == 1, super::any_type(w.ty)) {
        (true, false) => "dq_mv1",
        (false, false) => "dq_mv8",
        (true, true) => "dq_mv1_any",
        (false, true) => "dq_mv8_any",
    };
    let blocks = if n == 1 {
        mv1_blocks(l, w.rows, w.cols, w.ty == GgmlType::Q8_0)
    } else {
        (w.rows as u32).div_ceil(DQ_WARPS)
    };
    // Rows of at most DQ_XR_COLS take the register path, which stages nothing.
    let smem = if nw == 0 && w.cols > DQ_XR_COLS {
        xs_bytes(stage, n, w.ty, w.cols)
    } else {
        0
    };
    launch!(l, name => label, cfg((blocks, chunks, 1), 32 * DQ_WARPS, smem);
        &wp, &ty, &rows, &cols, &xp, &nw, &eps, &yp, &n32, &add, &xn)
}

/// Whether the matrix-vector and Q/K/V products of `ty` take the `*_kq` kernels: Q5_K, Q6_K
/// and IQ3_S (Q4_K keeps its own path in `dq_mv1` / `dq_qkv1` unless the launcher asks for
/// `q4k_lanes`).
fn kq_fast(l: &Launcher<'_>, ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q5K | GgmlType::Q6K | GgmlType::Iq3S)
        || (l.q4k_lanes && ty == GgmlType::Q4K)
}

/// Whether [`qkv`] takes Q, K and V of these (type, columns) in one launch: equal columns, and
/// one type or K-quants only (each matrix then read as its own type by the `_kq` kernels).
pub fn qkv_fuses(m: [(GgmlType, usize); 3]) -> bool {
    let same_cols = m[1].1 == m[0].1 && m[2].1 == m[0].1;
    let same_ty = m[1].0 == m[0].0 && m[2].0 == m[0].0;
    same_cols && (same_ty || m.iter().all(|(t, _)| kq_type(*t)))
}

/// `dq_qkv1` / `dq_qkv8`: Q, K and V of `n` tokens (x already normalised) in one launch; the
/// three matrices share their columns, and their type (Q5_K, Q6_K: `dq_qkv1_kq` /
/// `dq_qkv8_kq`) or are K-quants of several types (Q4_K_M's Q4_K Q/K with a Q6_K V: the
/// `_kq` kernels, each matrix read as its own type; see [`qkv_fuses`]). Two or more tokens
/// over Q8_0 or Q4_K take `dq_rows_qkv4/8/16` ([`rows_kernel`]). `stage`: as [`mv`]'s.
#[allow(clippy::too_many_arguments)]
pub fn qkv(
    l: &Launcher<'_>,
    mats: [Mat<'_>; 3],
    x: DeviceView<'_>,
    outs: [DeviceView<'_>; 3],
    n: usize,
    stage: bool,
) -> Result<(), CudaError> {
    const OP: &str = "qkv";
    let cols = mats[0].cols;
    let mut tys = [0i32; 3];
    for ((m, y), t) in mats.iter().zip(&outs).zip(tys.iter_mut()) {
        *t = m.check(OP)?;
        y.expect(OP, "y", f32s(n * m.rows), 4)?;
    }
    if !qkv_fuses(mats.map(|m| (m.ty, m.cols))) {
        return Err(bad(
            OP,
            "Q, K and V must share their columns and their type, or all be K-quants (use three products)".into(),
        ));
    }
    let ty = tys[0];
    let mixed = tys.iter().any(|t| *t != ty);
    x.expect(OP, "x", f32s(n * cols), 4)?;
    let rows = (mats[0].rows + mats[1].rows + mats[2].rows) as u32;
    let (n32, no_norm, eps) = (int(OP, "n", n)?, 0u64, 0f32);
    let (wq, wk, wv) = (mats[0].w.ptr(), mats[1].w.ptr(), mats[2].w.ptr());
    let (rq, rk, rv, c) = (
        mats[0].rows as i32,
        mats[1].rows as i32,
        mats[2].rows as i32,
        cols as i32,
    );
    let (xp, yq, yk, yv) = (x.ptr(), outs[0].ptr(), outs[1].ptr(), outs[2].ptr());
    if !mixed && rows_kernel(n, mats[0].ty) {
        let total = int(OP, "rows", mats.iter().map(|m| m.rows).sum())? as usize;
        if total == 0 {
            return Ok(());
        }
        x.expect(OP, "x", f32s(n * cols), 16)?;
        let (nt, grid, block, smem, wc) = rows_shape(l, total, n);
        let name = match nt {
            4 => "dq_rows_qkv4",
            8 => "dq_rows_qkv8",
            _ => "dq_rows_qkv16",
        };
        return launch!(l, name, cfg(grid, block, smem);
            &wq, &wk, &wv, &ty, &rq, &rk, &rv, &c, &xp, &no_norm, &eps, &yq, &yk, &yv, &n32, &wc);
    }
    let chunks = n.div_ceil(DQ_MAX_TOK) as u32;
    let kq = kq_fast(l, mats[0].ty) || mixed;
    if kq {
        let name = if n == 1 { "dq_qkv1_kq" } else { "dq_qkv8_kq" };
        let (tq, tk, tv) = (tys[0], tys[1], tys[2]);
        return launch!(l, name, cfg((rows.div_ceil(DQ_WARPS), chunks, 1), 32 * DQ_WARPS, 0);
            &wq, &wk, &wv, &tq, &tk, &tv, &rq, &rk, &rv, &c, &xp, &no_norm, &eps, &yq, &yk, &yv,
            &n32);
    }
    let name = match (n == 1, super::any_type(mats[0].ty)) {
        (true, false) => "dq_qkv1",
        (false, false) => "dq_qkv8",
        (true, true) => "dq_qkv1_any",
        (false, true) => "dq_qkv8_any",
    };
    let smem = xs_bytes(stage, n, mats[0].ty, cols);
    launch!(l, name, cfg((rows.div_ceil(DQ_WARPS), chunks, 1), 32 * DQ_WARPS, smem);
        &wq, &wk, &wv, &ty, &rq, &rk, &rv, &c, &xp, &no_norm, &eps, &yq, &yk, &yv, &n32)
}

/// What [`router_rows`] picks in its last block per token, when asked to.
#[derive(Debug, Clone, Copy)]
pub struct FusedTopk<'a> {
    /// One u32 per token, zero between launches.
    pub counters: DeviceView<'a>,
    pub k: usize,
    pub norm_topk: bool,
    pub ids: DeviceView<'a>,
    pub wts: DeviceView<'a>,
}

/// `dq_router_rows`: router logits `y = W RMSNorm(x)` of F32 router weights (`rows` experts x
/// `cols`), the normalised rows into `xn_out`, and with `topk` the softmax top-k of each
/// token in its last block (at most 256 experts and k 32).
#[allow(clippy::too_many_arguments)]
pub fn router_rows(
    l: &Launcher<'_>,
    w: Mat<'_>,
    x: DeviceView<'_>,
    norm: DeviceView<'_>,
    eps: f32,
    y: DeviceView<'_>,
    xn_out: DeviceView<'_>,
    topk: Option<FusedTopk<'_>>,
    n: usize,
) -> Result<(), CudaError> {
    const OP: &str = "router_rows";
    if w.ty != GgmlType::F32 || w.cols % 4 != 0 {
        return Err(bad(
            OP,
            format!(
                "{} router of {} columns: F32 and a multiple of 4 only",
                w.ty, w.cols
            ),
        ));
    }
    w.check(OP)?;
    x.expect(OP, "x", f32s(n * w.cols), 16)?;
    norm.expect(OP, "norm", f32s(w.cols), 4)?;
    y.expect(OP, "y", f32s(n * w.rows), 4)?;
    xn_out.expect(OP, "xn_out", f32s(n * w.cols), 4)?;
    let (cnt, k, nt, ids, wts) = match topk {
        Some(t) => {
            if w.rows > 256 || t.k > 32 || t.k == 0 || t.k > w.rows {
                return Err(bad(OP, format!("fused top-{} of {} experts", t.k, w.rows)));
            }
            t.counters.expect(OP, "counters", 4 * n as u64, 4)?;
            t.ids.expect(OP, "ids", 4 * (n * t.k) as u64, 4)?;
            t.wts.expect(OP, "wts", f32s(n * t.k), 4)?;
            (
                t.counters.ptr(),
                t.k as i32,
                t.norm_topk as i32,
                t.ids.ptr(),
                t.wts.ptr(),
            )
        }
        None => (0, 0, 0, 0, 0),
    };
    let (wp, xp, np, yp, xo) = (w.w.ptr(), x.ptr(), norm.ptr(), y.ptr(), xn_out.ptr());
    let (rows, cols) = (w.rows as i32, w.cols as i32);
    let grid = (w.rows as u32, int(OP, "n", n)? as u32, 1);
    launch!(l, "dq_router_rows" => "router_rows", cfg(grid, 128, 0);
        &wp, &rows, &cols, &xp, &np, &eps, &yp, &xo, &cnt, &k, &nt, &ids, &wts)
}

/// `dq_sgemm_split` then `dq_split_sum`: `y = W x` for F32 `W` (`rows x cols`, cols a multiple
/// of 32) over `n` tokens, K split into `splits` chunks whose partials go to `part` (`splits x
/// n x rows` f32) and are summed in a fixed order. The prefill router's product.
#[allow(clippy::too_many_arguments)]
pub fn sgemm_split(
    l: &Launcher<'_>,
    w: Mat<'_>,
    x: DeviceView<'_>,
    n: usize,
    splits: usize,
    part: DeviceView<'_>,
    y: DeviceView<'_>,
) -> Result<(), CudaError> {
    const OP: &str = "sgemm_split";
    if w.ty != GgmlType::F32 || w.cols % 32 != 0 || splits == 0 {
        return Err(bad(
            OP,
            format!("{} weights of {} columns in {splits} splits: F32, columns a multiple of 32, at least one split", w.ty, w.cols),
        ));
    }
    w.check(OP)?;
    x.expect(OP, "x", f32s(n * w.cols), 4)?;
    y.expect(OP, "y", f32s(n * w.rows), 4)?;
    let k_chunk = w.cols.div_ceil(splits).div_ceil(32) * 32;
    let splits = w.cols.div_ceil(k_chunk);
    part.expect(OP, "part", f32s(splits * n * w.rows), 4)?;
    let (n32, kc, ns) = (int(OP, "n", n)?, k_chunk as i32, splits as i32);
    let grid = (
        n.div_ceil(64) as u32,
        w.rows.div_ceil(32) as u32,
        splits as u32,
    );
    let (wp, xp, pp, yp) = (w.w.ptr(), x.ptr(), part.ptr(), y.ptr());
    let (rows, cols) = (w.rows as i32, w.cols as i32);
    launch!(l, "dq_sgemm_split" => "router_sgemm", cfg(grid, 256, 0);
        &wp, &rows, &cols, &xp, &n32, &kc, &pp)?;
    let total = (n * w.rows) as i64;
    launch!(l, "dq_split_sum" => "router_sum", cfg(((total as u64).div_ceil(256) as u32, 1, 1), 256, 0);
        &pp, &ns, &total, &yp)
}

/// The router's softmax and top-k of `n` tokens' logits (`n x n_expert`): one warp per token
/// (`dq_router_topk`) up to 256 experts and k 32, else a block per token
/// (`router_softmax_topk`).
#[allow(clippy::too_many_arguments)]
pub fn router_topk(
    l: &Launcher<'_>,
    logits: DeviceView<'_>,
    n_expert: usize,
    k: usize,
    norm_topk: bool,
    ids: DeviceView<'_>,
    wts: DeviceView<'_>,
    n: usize,
) -> Result<(), CudaError> {
    const OP: &str = "router_topk";
    if k == 0 || k > n_expert || k > ROUTER_MAX_K {
        return Err(bad(OP, format!("top-{k} of {n_expert} experts")));
    }
    logits.expect(OP, "logits", f32s(n * n_expert), 4)?;
    ids.expect(OP, "ids", 4 * (n * k) as u64, 4)?;
    wts.expect(OP, "wts", f32s(n * k), 4)?;
    let (lp, ip, wp) = (logits.ptr(), ids.ptr(), wts.ptr());
    let (ne, k32, norm, nt) = (
        int(OP, "n_expert", n_expert)?,
        k as i32,
        norm_topk as i32,
        int(OP, "n", n)?,
    );
    if n_expert <= 32 * 8 && k <= 32 {
        return launch!(l, "dq_router_topk", cfg((n.div_ceil(4) as u32, 1, 1), 128, 0);
            &lp, &ne, &k32, &norm, &nt, &ip, &wp);
    }
    let smem = (n_expert * 4) as u32;
    launch!(l, "router_softmax_topk", cfg((n as u32, 1, 1), 128, smem); &lp, &ne, &k32, &norm, &ip, &wp)
}

/// Largest top-k of the router kernels.
pub const ROUTER_MAX_K: usize = 64;

/// A layer's routed experts as the expert kernels read them: a table of `n_expert x (gate,
/// up, down)` device addresses (`n_expert x 3` u64); every expert's gate matrices are of
/// `ty`, its up matrices of `ty_up` and its down matrices of `ty_down` (a quantizer's mix,
/// e.g. Q4_K_M's Q6_K down projections, gives the three their own types).
#[derive(Debug, Clone, Copy)]
pub struct ExpertTable<'a> {
    pub table: DeviceView<'a>,
    pub ty: GgmlType,
    pub ty_up: GgmlType,
    pub ty_down: GgmlType,
    pub n_expert: usize,
    /// Expert width (gate/up rows, down columns) and hidden width.
    pub f: usize,
    pub e: usize,
}

impl ExpertTable<'_> {
    /// Checks the table and shapes; returns the kernel codes of gate, up and down.
    pub(super) fn check(&self, op: &'static str) -> Result<[i32; 3], CudaError> {
        self.table
            .expect(op, "expert table", 24 * self.n_expert as u64, 8)?;
        int(op, "f", self.f)?;
        int(op, "e", self.e)?;
        let code = |ty: GgmlType, what: &str| {
            let c = super::kty(ty).ok_or_else(|| {
                bad(
                    op,
                    format!("{ty} expert {what} matrices: the CUDA kernels cannot read {ty}"),
                )
            })?;
            if super::any_type(ty) && (self.f % 32 != 0 || self.e % 32 != 0) {
                return Err(bad(
                    op,
                    format!(
                        "{ty} experts of {} x {}: the any-type kernels read rows of a multiple of 32",
                        self.f, self.e
                    ),
                ));
            }
            Ok(c)
        };
        Ok([
            code(self.ty, "gate")?,
            code(self.ty_up, "up")?,
            code(self.ty_down, "down")?,
        ])
    }
}

/// `dq_moe_gate_up`: for every assignment `a = t*k + j` of `n` tokens, `h[a] =
/// silu(G_e xn[t]) * (U_e xn[t])` with `e = ids[a]`. `stage`: Q8_0 experts stage the input in
/// shared memory. Gate and up of K-quants (Q4_K, Q5_K, Q6_K, not both Q4_K) take
/// `dq_moe_gate_up_kq`, the other any-type codes `dq_moe_gate_up_any`.
#[allow(clippy::too_many_arguments)]
pub fn moe_gate_up(
    l: &Launcher<'_>,
    ex: ExpertTable<'_>,
    ids: DeviceView<'_>,
    k: usize,
    xn: DeviceView<'_>,
    h: DeviceView<'_>,
    n: usize,
    stage: bool,
) -> Result<(), CudaError> {
    const OP: &str = "moe_gate_up";
    let [ty, ty_u, _] = ex.check(OP)?;
    ids.expect(OP, "ids", 4 * (n * k) as u64, 4)?;
    xn.expect(OP, "xn", f32s(n * ex.e), 16)?;
    h.expect(OP, "h", f32s(n * k * ex.f), 4)?;
    let smem = if ex.ty_up == ex.ty {
        xs_bytes(stage, 1, ex.ty, ex.e)
    } else {
        0
    };
    let (f, e, k32, no_norm, eps) = (ex.f as i32, ex.e as i32, k as i32, 0u64, 0f32);
    let (tp, ip, xp, hp) = (ex.table.ptr(), ids.ptr(), xn.ptr(), h.ptr());
    let grid = (
        (ex.f as u32).div_ceil(DQ_WARPS),
        int(OP, "n * k", n * k)? as u32,
        1,
    );
    let both_q4k = ex.ty == GgmlType::Q4K && ex.ty_up == GgmlType::Q4K && !l.q4k_lanes;
    let name = if kq_type(ex.ty) && kq_type(ex.ty_up) && !both_q4k {
        "dq_moe_gate_up_kq"
    } else if super::any_type(ex.ty) || super::any_type(ex.ty_up) {
        "dq_moe_gate_up_any"
    } else {
        "dq_moe_gate_up"
    };
    launch!(l, name, cfg(grid, 32 * DQ_WARPS, smem);
        &tp, &ty, &ty_u, &f, &e, &ip, &k32, &xp, &no_norm, &eps, &hp)
}

/// The MoE down products weighted and added into `y`: `y[t] += sum_j wts[t*k+j] D_e h[t*k+j]`
/// — a block per row for k up to 32 with Q8_0 (`dq_moe_down_rows`) or K-quant (Q4_K, Q5_K,
/// Q6_K: `dq_moe_down_kq`) down matrices, else `dq_moe_down` (a warp per row, any type).
#[allow(clippy::too_many_arguments)]
pub fn moe_down(
    l: &Launcher<'_>,
    ex: ExpertTable<'_>,
    ids: DeviceView<'_>,
    wts: DeviceView<'_>,
    k: usize,
    h: DeviceView<'_>,
    y: DeviceView<'_>,
    n: usize,
) -> Result<(), CudaError> {
    const OP: &str = "moe_down";
    let [_, _, ty] = ex.check(OP)?;
    ids.expect(OP, "ids", 4 * (n * k) as u64, 4)?;
    wts.expect(OP, "wts", f32s(n * k), 4)?;
    h.expect(OP, "h", f32s(n * k * ex.f), 16)?;
    y.expect(OP, "y", f32s(n * ex.e), 4)?;
    let (e, f, k32) = (ex.e as i32, ex.f as i32, k as i32);
    let (tp, ip, wp, hp, yp) = (ex.table.ptr(), ids.ptr(), wts.ptr(), h.ptr(), y.ptr());
    let nt = int(OP, "n", n)? as u32;
    if ex.ty_down == GgmlType::Q8_0 && k <= DQ_DOWN_MAXK {
        return launch!(l, "dq_moe_down_rows", cfg((ex.e as u32, nt, 1), 128, 0);
            &tp, &e, &f, &ip, &wp, &k32, &hp, &yp);
    }
    if kq_type(ex.ty_down) && k <= DQ_DOWN_MAXK && ex.f % 256 == 0 {
        return launch!(l, "dq_moe_down_kq", cfg((ex.e as u32, nt, 1), 128, 0);
            &tp, &ty, &e, &f, &ip, &wp, &k32, &hp, &yp);
    }
    let name = if super::any_type(ex.ty_down) {
        "dq_moe_down_any"
    } else {
        "dq_moe_down"
    };
    launch!(l, name, cfg(((ex.e as u32).div_ceil(DQ_WARPS), nt, 1), 32 * DQ_WARPS, 0);
        &tp, &ty, &e, &f, &ip, &wp, &k32, &hp, &yp)
}

/// `dq_moe_combine`: `x[t] += sum_j wts[t*k+j] y[t*k+j]` over rows of `e`.
pub fn moe_combine(
    l: &Launcher<'_>,
    y: DeviceView<'_>,
    wts: DeviceView<'_>,
    k: usize,
    e: usize,
    x: DeviceView<'_>,
    n: usize,
) -> Result<(), CudaError> {
    const OP: &str = "moe_combine";
    y.expect(OP, "y", f32s(n * k * e), 4)?;
    wts.expect(OP, "wts", f32s(n * k), 4)?;
    x.expect(OP, "x", f32s(n * e), 4)?;
    let (yp, wp, xp) = (y.ptr(), wts.ptr(), x.ptr());
    let (k32, e32) = (int(OP, "k", k)?, int(OP, "e", e)?);
    launch!(l, "dq_moe_combine", cfg((int(OP, "n", n)? as u32, 1, 1), 256, 0); &yp, &wp, &k32, &e32, &xp)
}

/// Where the token picks work: per row, `blocks` partial (value, index) pairs, a counter
/// (zero between launches) and the chosen token.
#[derive(Debug, Clone, Copy)]
pub struct PickScratch<'a> {
    pub part_v: DeviceView<'a>,
    pub part_i: DeviceView<'a>,
    pub counters: DeviceView<'a>,
    pub out: DeviceView<'a>,
}

impl PickScratch<'_> {
    fn check(&self, op: &'static str, rows: usize, blocks: u32) -> Result<(), CudaError> {
        let pairs = 4 * (rows as u64) * blocks as u64;
        self.part_v.expect(op, "part_v", pairs, 4)?;
        self.part_i.expect(op, "part_i", pairs, 4)?;
        self.counters.expect(op, "counters", 4 * rows as u64, 4)?;
        self.out.expect(op, "out", 4 * rows as u64, 4)
    }
}

/// `dq_argmax_rows`: the argmax of each of `rows` rows of `cols` logits (lowest id on ties,
/// NaN never wins) among the tokens each row of `proc` allows (`None`: all), `blocks` blocks
/// a row.
pub fn argmax_rows(
    l: &Launcher<'_>,
    x: DeviceView<'_>,
    cols: usize,
    rows: usize,
    blocks: u32,
    proc: Option<super::pick::ProcRows<'_>>,
    s: PickScratch<'_>,
) -> Result<(), CudaError> {
    const OP: &str = "argmax_rows";
    x.expect(OP, "x", f32s(rows * cols), 4)?;
    s.check(OP, rows, blocks)?;
    let (pp, pw) = super::pick::proc_args(OP, proc, rows, cols)?;
    let (xp, pv, pi, cn, op) = (
        x.ptr(),
        s.part_v.ptr(),
        s.part_i.ptr(),
        s.counters.ptr(),
        s.out.ptr(),
    );
    let c = int(OP, "cols", cols)?;
    launch!(l, "dq_argmax_rows", cfg((blocks, rows as u32, 1), 256, 0); &xp, &c, &pp, &pw, &pv, &pi, &cn, &op)
}

/// `sample_rows`: row `i`'s token drawn by `draws[i]` (`sampler::Draw`'s 32-byte records)
/// after row `i` of `proc`'s mask and `min_p` (`None`: no processing), `blocks` blocks of
/// 1024 threads a row.
#[allow(clippy::too_many_arguments)]
pub fn sample_rows(
    l: &Launcher<'_>,
    x: DeviceView<'_>,
    cols: usize,
    rows: usize,
    blocks: u32,
    draws: DeviceView<'_>,
    proc: Option<super::pick::ProcRows<'_>>,
    s: PickScratch<'_>,
) -> Result<(), CudaError> {
    const OP: &str = "sample_rows";
    if cols > SAMPLE_MAX_VOCAB {
        return Err(bad(
            OP,
            format!("{cols} logits: at most {SAMPLE_MAX_VOCAB} (sample on the host)"),
        ));
    }
    x.expect(OP, "x", f32s(rows * cols), 4)?;
    draws.expect(
        OP,
        "draws",
        strata_schemas::workset::DRAW_BYTES * rows as u64,
        8,
    )?;
    s.check(OP, rows, blocks)?;
    let (pp, pw) = super::pick::proc_args(OP, proc, rows, cols)?;
    let (xp, dp, pv, pi, cn, op) = (
        x.ptr(),
        draws.ptr(),
        s.part_v.ptr(),
        s.part_i.ptr(),
        s.counters.ptr(),
        s.out.ptr(),
    );
    let c = int(OP, "cols", cols)?;
    launch!(l, "sample_rows", cfg((blocks, rows as u32, 1), 1024, 0); &xp, &c, &dp, &pp, &pw, &pv, &pi, &cn, &op)
}

#[cfg(test)]
mod tests {
    //! Host emulation of rows.cu's index mapping (the GPU tests in backend_ops check the
    //! numbers): which weight bytes, staged input slots and output rows each lane touches.
    use super::*;

    const LANES: usize = 8;
    const GROUPS: usize = 32 / LANES;
    const R: usize = RW_TILE / GROUPS;
    const STEP: usize = LANES * 16;

    /// rows.cu's rw_slot.
    fn slot(m: usize) -> usize {
        let r = (m >> 3) & 3;
        m ^ ((r >> 1) | ((r & 1) << 1))
    }

    /// rows.cu's rw_m: the staged float4 (before the swizzle) of piece j of lane c, step s.
    fn piece_m(q4k: bool, s: usize, c: usize, j: usize) -> usize {
        if q4k {
            32 * s + 16 * (c / 4) + 2 * (c % 4) + (j & 1) + 8 * (j >> 1)
        } else {
            32 * s + 4 * c + j
        }
    }

    /// The column of a row that weight value e (0..4) of piece j of lane c reads at step column
    /// cb, from the weight layout: Q8_0 quant byte cb + 16 c + 4 j + e; Q4_K quant byte
    /// 64 h + 8 c + 4 (j & 1) + e of block cb / 256, nibble j >> 1 (GGUF: byte k holds columns
    /// 64 (k / 32) + k % 32, low nibble, and 32 further, high nibble).
    fn weight_col(q4k: bool, cb: usize, c: usize, j: usize, e: usize) -> usize {
        if !q4k {
            return cb + 16 * c + 4 * j + e;
        }
        let h = (cb / STEP) & 1;
        let k = 64 * h + 8 * c + 4 * (j & 1) + e;
        cb / 256 * 256 + 64 * (k / 32) + k % 32 + 32 * (j >> 1)
    }

    #[test]
    fn every_weight_is_read_once_against_its_staged_input() {
        for q4k in [false, true] {
            let col_list: &[usize] = if q4k {
                &[256, 768, 1280, 2048]
            } else {
                &[32, 96, 544, 2048, 2080]
            };
            for &cols in col_list {
                for wc in [1u32, 2, 4] {
                    let tiles = (RW_WARPS / wc) as usize;
                    // Per (row tile, row within the tile, column): how often it is read.
                    let mut seen = vec![0u8; tiles * RW_TILE * cols];
                    for warp in 0..RW_WARPS as usize {
                        let (tile, part) = (warp / wc as usize, warp % wc as usize);
                        for lane in 0..32 {
                            let (g, c) = (lane / LANES, lane % LANES);
                            for k0 in (0..cols).step_by(RW_KC) {
                                for s in (part..RW_KC / STEP).step_by(wc as usize) {
                                    let cb = k0 + s * STEP;
                                    if cb >= cols {
                                        break;
                                    }
                                    // Q8_0: a lane's 16 columns are all in or all out.
                                    if !q4k && cb + 16 * c >= cols {
                                        continue;
                                    }
                                    if !q4k {
                                        // One scale for the lane's 16 columns.
                                        assert_eq!((cb + 16 * c) / 32, (cb + 16 * c + 15) / 32);
                                    } else {
                                        // The sub-block scales rw_load picks.
                                        let j0 = 2 * (2 * ((cb / STEP) & 1) + c / 4);
                                        assert_eq!(weight_col(q4k, cb, c, 0, 0) % 256 / 32, j0);
                                        assert_eq!(weight_col(q4k, cb, c, 2, 0) % 256 / 32, j0 + 1);
                                    }
                                    for j in 0..4 {
                                        let m = piece_m(q4k, s, c, j);
                                        assert!(m < RW_KC / 4 && slot(m) < RW_KC / 4);
                                        for e in 0..4 {
                                            let col = weight_col(q4k, cb, c, j, e);
                                            // The staged value it meets is x[col].
                                            assert_eq!(
                                                k0 + 4 * m + e,
                                                col,
                                                "q4k {q4k} c {c} j {j}"
                                            );
                                            assert!(col < cols);
                                            for i in 0..R {
                                                let rr = g + GROUPS * i;
                                                seen[(tile * RW_TILE + rr) * cols + col] += 1;
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                    assert!(
                        seen.iter().all(|&v| v == 1),
                        "q4k {q4k} cols {cols} wc {wc}: a weight read {:?} times",
                        seen.iter().find(|&&v| v != 1)
                    );
                }
            }
        }
    }

    #[test]
    fn staged_reads_are_conflict_free_and_the_swizzle_a_permutation() {
        let mut hit = [false; RW_KC / 4];
        for m in 0..RW_KC / 4 {
            assert!(!hit[slot(m)]);
            hit[slot(m)] = true;
            assert_eq!(slot(m) / 8, m / 8, "the swizzle stays in its 128-byte line");
        }
        for q4k in [false, true] {
            for s in 0..RW_KC / STEP {
                for j in 0..4 {
                    // The 8 lanes of a row group hit 8 distinct 16-byte bank groups.
                    let mut groups: Vec<usize> = (0..LANES)
                        .map(|c| slot(piece_m(q4k, s, c, j)) % 8)
                        .collect();
                    groups.sort();
                    groups.dedup();
                    assert_eq!(groups.len(), LANES, "q4k {q4k} s {s} j {j}");
                }
            }
        }
    }

    #[test]
    fn shapes_fit_shared_memory_and_cover_every_row_once() {
        for nt in [4, 8, 16] {
            assert!(rows_smem(nt) <= 48 << 10, "no opt-in above 48 KiB");
            // The partial sums reuse the staged chunk.
            assert!(RW_WARPS as usize * RW_TILE * (nt + 1) <= nt * RW_KC);
        }
        for n in 2..=40 {
            let nt = rows_tokens(n);
            assert!(nt >= n.min(16) && [4, 8, 16].contains(&nt));
        }
        assert_eq!(rows_split(132, 151936), 1);
        assert_eq!(rows_split(132, 5120), 4);
        assert_eq!(rows_split(132, 1), 4);
        for wc in [1u32, 2, 4] {
            let brows = rows_block(wc);
            let tiles = (RW_WARPS / wc) as usize;
            // Output rows of a block: tile tl = rl / RW_TILE, summed over its wc warps
            // tl * wc + p, whose lanes (g, i) wrote row g + GROUPS i of the tile.
            let mut wrote = vec![0u8; brows];
            for warp in 0..RW_WARPS as usize {
                let tile = warp / wc as usize;
                assert!(tile < tiles);
                for g in 0..GROUPS {
                    for i in 0..R {
                        wrote[tile * RW_TILE + g + GROUPS * i] += 1;
                    }
                }
            }
            assert!(wrote.iter().all(|&v| v as u32 == wc));
        }
        assert!(rows_kernel(2, GgmlType::Q4K) && rows_kernel(33, GgmlType::Q8_0));
        assert!(!rows_kernel(1, GgmlType::Q8_0) && !rows_kernel(4, GgmlType::Q6K));
    }

    /// A matrix for the emulation: device-layout bytes and rows.
    struct EmuMat {
        w: Vec<u8>,
        rows: usize,
    }

    fn h2f(b: &[u8]) -> f32 {
        half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
    }

    fn word(b: &[u8]) -> u32 {
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }

    /// rows.cu's rw_scale_min on the 12 scale bytes as three words.
    fn scale_min(j: usize, s1: u32, s2: u32, s3: u32) -> (f32, f32) {
        let k = j & 3;
        let byte = |v: u32| (v >> (8 * k)) & 0xFF;
        if j < 4 {
            ((byte(s1) & 63) as f32, (byte(s2) & 63) as f32)
        } else {
            (
                ((byte(s3) & 0xF) | ((byte(s1) >> 6) << 4)) as f32,
                ((byte(s3) >> 4) | ((byte(s2) >> 6) << 4)) as f32,
            )
        }
    }

    /// The 16 weights (4 pieces of 4) lane c reads of row r of `m` at step column cb, as
    /// rw_load and rw_piece decode them.
    fn lane_weights(
        q4k: bool,
        m: &EmuMat,
        cols: usize,
        r: usize,
        cb: usize,
        c: usize,
    ) -> [[f32; 4]; 4] {
        let mut w = [[0f32; 4]; 4];
        if !q4k {
            let col = cb + 16 * c;
            if col >= cols {
                return w;
            }
            let q = &m.w[r * cols + col..r * cols + col + 16];
            let at = m.rows * cols + 2 * (r * (cols / 32) + col / 32);
            let d = h2f(&m.w[at..]);
            for (j, wj) in w.iter_mut().enumerate() {
                for (e, v) in wj.iter_mut().enumerate() {
                    *v = q[4 * j + e] as i8 as f32 * d;
                }
            }
            return w;
        }
        let blk = &m.w[r * (cols / 256) * 144 + cb / 256 * 144..];
        let h = (cb / STEP) & 1;
        let (d, dmin) = (h2f(&blk[0..]), h2f(&blk[2..]));
        let (s1, s2, s3) = (word(&blk[4..]), word(&blk[8..]), word(&blk[12..]));
        let j0 = 2 * (2 * h + c / 4);
        let q = &blk[16 + 64 * h + 8 * c..];
        let qw = [word(q), word(&q[4..])];
        for (j, wj) in w.iter_mut().enumerate() {
            let hi = j >> 1;
            let (sc, mn) = scale_min(j0 + hi, s1, s2, s3);
            let v = (qw[j & 1] >> (4 * hi)) & 0x0F0F_0F0F;
            for (e, x) in wj.iter_mut().enumerate() {
                *x = (((v >> (8 * e)) & 0xFF) as f32).mul_add(d * sc, -(dmin * mn));
            }
        }
        w
    }

    /// Options of one emulated launch.
    #[derive(Clone, Copy)]
    struct EmuRun<'a> {
        q4k: bool,
        cols: usize,
        nt: usize,
        wc: u32,
        nw: Option<&'a [f32]>,
        eps: f32,
        add: bool,
    }

    /// rows.cu's dq_rows_body, block by block, warp by warp, lane by lane, on the host: y of
    /// each matrix (`y[k]` holds n x rows, added to when `add`).
    fn emulate(mats: &[EmuMat], x: &[f32], n: usize, o: EmuRun<'_>, y: &mut [Vec<f32>]) {
        let EmuRun {
            q4k,
            cols,
            nt,
            wc,
            nw,
            eps,
            add,
        } = o;
        let total: usize = mats.iter().map(|m| m.rows).sum();
        let brows = rows_block(wc);
        let which = |mut r: usize| {
            for (k, m) in mats.iter().enumerate() {
                if r < m.rows {
                    return (k, r);
                }
                r -= m.rows;
            }
            unreachable!()
        };
        let warps = RW_WARPS as usize;
        for bx in 0..total.div_ceil(brows) {
            let b0 = bx * brows;
            for t0 in (0..n).step_by(nt) {
                let ntt = nt.min(n - t0);
                let xb = &x[t0 * cols..];
                let mut acc = vec![0f32; warps * 32 * R * nt];
                let mut ssp = vec![0f32; nt * RW_KC / 4];
                for k0 in (0..cols).step_by(RW_KC) {
                    let mut xs = vec![[0f32; 4]; nt * RW_KC / 4];
                    for q in 0..RW_KC / 4 {
                        let col = k0 + 4 * q;
                        for t in 0..nt {
                            let mut v = [0f32; 4];
                            if t < ntt && col < cols {
                                v.copy_from_slice(&xb[t * cols + col..t * cols + col + 4]);
                            }
                            ssp[t * RW_KC / 4 + q] += v.iter().map(|a| a * a).sum::<f32>();
                            if let (Some(w), true) = (nw, col < cols) {
                                for e in 0..4 {
                                    v[e] *= w[col + e];
                                }
                            }
                            xs[t * RW_KC / 4 + slot(q)] = v;
                        }
                    }
                    for warp in 0..warps {
                        let (tile, part) = (warp / wc as usize, warp % wc as usize);
                        for lane in 0..32 {
                            let (g, c) = (lane / LANES, lane % LANES);
                            for s in (part..RW_KC / STEP).step_by(wc as usize) {
                                let cb = k0 + s * STEP;
                                if cb >= cols {
                                    break;
                                }
                                for i in 0..R {
                                    let r = (b0 + tile * RW_TILE + g + GROUPS * i).min(total - 1);
                                    let (k, rl) = which(r);
                                    let w = lane_weights(q4k, &mats[k], cols, rl, cb, c);
                                    for (j, wj) in w.iter().enumerate() {
                                        let sl = slot(piece_m(q4k, s, c, j));
                                        for t in 0..nt {
                                            let xv = xs[t * RW_KC / 4 + sl];
                                            let a = &mut acc[((warp * 32 + lane) * R + i) * nt + t];
                                            for e in 0..4 {
                                                *a = wj[e].mul_add(xv[e], *a);
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
                // The row groups' shuffles, then the partial sums by (warp, tile row, token).
                let mut red = vec![f32::NAN; warps * RW_TILE * (nt + 1)];
                for warp in 0..warps {
                    for g in 0..GROUPS {
                        for i in 0..R {
                            for t in 0..nt {
                                let v: f32 = (0..LANES)
                                    .map(|c| acc[((warp * 32 + g * LANES + c) * R + i) * nt + t])
                                    .sum();
                                red[(warp * RW_TILE + g + GROUPS * i) * (nt + 1) + t] = v;
                            }
                        }
                    }
                }
                let rms: Vec<f32> = (0..nt)
                    .map(|t| {
                        let a: f32 = ssp[t * RW_KC / 4..(t + 1) * RW_KC / 4].iter().sum();
                        1.0 / (a / cols as f32 + eps).sqrt()
                    })
                    .collect();
                for idx in 0..brows * ntt {
                    let (rl, t) = (idx % brows, idx / brows);
                    let r = b0 + rl;
                    if r >= total {
                        continue;
                    }
                    let (tl, rr) = (rl / RW_TILE, rl % RW_TILE);
                    let mut v: f32 = (0..wc as usize)
                        .map(|p| red[((tl * wc as usize + p) * RW_TILE + rr) * (nt + 1) + t])
                        .sum();
                    if nw.is_some() {
                        v *= rms[t];
                    }
                    let (k, r) = which(r);
                    let o = &mut y[k][(t0 + t) * mats[k].rows + r];
                    *o = if add { *o + v } else { v };
                }
            }
        }
    }

    /// A random matrix of `ty`: device-layout bytes and the reference's dequantized rows.
    fn emu_mat(seed: &mut u64, ty: GgmlType, rows: usize, cols: usize) -> (EmuMat, Vec<f32>) {
        let mut next = || {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        };
        let vals: Vec<f32> = (0..rows * cols).map(|_| next()).collect();
        let mut gguf = Vec::new();
        for r in vals.chunks(cols) {
            crate::quant::quantize_row(ty, r, &mut gguf).unwrap();
        }
        let mut deq = vec![0f32; rows * cols];
        let rb = gguf.len() / rows;
        for (r, out) in deq.chunks_mut(cols).enumerate() {
            crate::quant::dequantize_row(ty, &gguf[r * rb..(r + 1) * rb], out).unwrap();
        }
        let mut w = vec![0u8; gguf.len()];
        crate::backend::cuda::layout::to_device(ty, &gguf, 1, rows, cols, &mut w).unwrap();
        (EmuMat { w, rows }, deq)
    }

    /// The emulated kernel against an f64 reference over the dequantized weights: Q8_0 and
    /// Q4_K, one and three matrices (row tiles straddling them), partial chunks and steps,
    /// every column split, 3 to 17 tokens, plain, normalised and added.
    #[test]
    fn the_emulated_kernel_computes_the_products() {
        let mut seed = 7u64;
        let cases: &[(GgmlType, &[usize], usize)] = &[
            (GgmlType::Q8_0, &[7], 96),
            (GgmlType::Q8_0, &[33, 7, 9], 544),
            (GgmlType::Q4K, &[5], 768),
            (GgmlType::Q4K, &[20, 3, 9], 256),
        ];
        for &(ty, split, cols) in cases {
            let (mats, deqs): (Vec<_>, Vec<_>) = split
                .iter()
                .map(|&r| emu_mat(&mut seed, ty, r, cols))
                .unzip();
            for (n, wc, norm, add) in [
                (3, 1, false, false),
                (9, 2, true, false),
                (17, 4, true, true),
            ] {
                let x: Vec<f32> = (0..n * cols)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
                    .collect();
                let nwv: Vec<f32> = (0..cols).map(|i| 1.0 + (i % 7) as f32 / 20.0).collect();
                let eps = 1e-6;
                let y0: Vec<Vec<f32>> = split
                    .iter()
                    .map(|&r| (0..n * r).map(|i| (i % 5) as f32).collect())
                    .collect();
                let mut y = y0.clone();
                let run = EmuRun {
                    q4k: ty == GgmlType::Q4K,
                    cols,
                    nt: rows_tokens(n),
                    wc,
                    nw: norm.then_some(&nwv[..]),
                    eps,
                    add,
                };
                emulate(&mats, &x, n, run, &mut y);
                for (k, deq) in deqs.iter().enumerate() {
                    let rows = split[k];
                    for t in 0..n {
                        let xt = &x[t * cols..(t + 1) * cols];
                        let s = if norm {
                            let ss: f64 = xt.iter().map(|v| (*v as f64).powi(2)).sum();
                            1.0 / (ss / cols as f64 + eps as f64).sqrt()
                        } else {
                            1.0
                        };
                        for r in 0..rows {
                            let mut want: f64 = (0..cols)
                                .map(|i| {
                                    let xi =
                                        xt[i] as f64 * s * if norm { nwv[i] as f64 } else { 1.0 };
                                    deq[r * cols + i] as f64 * xi
                                })
                                .sum();
                            if add {
                                want += y0[k][t * rows + r] as f64;
                            }
                            let got = y[k][t * rows + r] as f64;
                            assert!(
                                (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                                "{ty} {split:?}x{cols} n {n} wc {wc} norm {norm} add {add}: y[{k}][{t}][{r}] = {got}, want {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
