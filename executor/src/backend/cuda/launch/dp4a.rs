//! Launchers of the int8-activation products (`kernels/cuda/dp4a.cu`, `--kernel-options
//! dp4a`): the quantization of a product's input rows to q8a blocks of 32, and the Q8_0 /
//! Q4_K / Q6_K / IQ3_S matrix-vector (1..16 tokens, up to three matrices a launch), MoE
//! gate/up and MoE down products over them; plus the host reference of the quantization
//! ([`quantize_q8a`]) that the GPU tests compare with.
//! Invariant: a [`Q8a`] holds whole rows of a multiple of 32 columns, quants first and the
//! (d, s) pairs 16 bytes after them; nothing is launched over a type other than Q8_0 (split
//! layout), Q4_K, Q6_K or IQ3_S ([`supports`]), or a view smaller than the kernel touches.

use super::decode::ExpertTable;
use super::{bad, cfg, f32s, int, launch, walk_blocks, Launcher, Mat, DQ_DOWN_MAXK, DQ_WARPS};
use crate::backend::cuda::{CudaError, DeviceView};
use strata_schemas::ggml::GgmlType;

/// Quantized rows of a product's input in the q8a layout: `rows x cols` int8 quants, then at
/// the next 16-byte boundary `rows x cols / 32` pairs (d, s) of f32.
#[derive(Debug, Clone, Copy)]
pub struct Q8a<'a> {
    pub q: DeviceView<'a>,
    pub ds: DeviceView<'a>,
    pub rows: usize,
    pub cols: usize,
}

impl<'a> Q8a<'a> {
    /// Bytes of `rows` rows of `cols` in the q8a layout.
    pub fn bytes(rows: usize, cols: usize) -> u64 {
        Self::ds_offset(rows, cols) + 8 * (rows * cols / 32) as u64
    }

    fn ds_offset(rows: usize, cols: usize) -> u64 {
        ((rows * cols) as u64).div_ceil(16) * 16
    }

    /// `rows x cols` (cols a multiple of 32) in the front of `buf` (16-byte aligned).
    pub fn carve(buf: DeviceView<'a>, rows: usize, cols: usize) -> Result<Self, CudaError> {
        const OP: &str = "q8a";
        if cols % 32 != 0 {
            return Err(bad(
                OP,
                format!("rows of {cols} columns: q8a blocks are 32 wide"),
            ));
        }
        buf.expect(OP, "buffer", Self::bytes(rows, cols), 16)?;
        let at = Self::ds_offset(rows, cols);
        Ok(Self {
            q: buf.sub(0, (rows * cols) as u64)?,
            ds: buf.sub(at, 8 * (rows * cols / 32) as u64)?,
            rows,
            cols,
        })
    }

    fn check(&self, op: &'static str, rows: usize, cols: usize) -> Result<(), CudaError> {
        if self.rows < rows || self.cols != cols {
            return Err(bad(
                op,
                format!(
                    "q8a input of {} x {} where {rows} x {cols} are read",
                    self.rows, self.cols
                ),
            ));
        }
        self.q.expect(op, "xq", (rows * cols) as u64, 16)?;
        self.ds.expect(op, "xds", 8 * (rows * cols / 32) as u64, 16)
    }
}

/// Whether the int8-activation products read weights of `ty` in rows of `cols`: Q8_0 (split
/// layout, cols a multiple of 32), Q4_K, Q6_K and IQ3_S (whole 256-value blocks).
pub fn supports(ty: GgmlType, cols: usize) -> bool {
    match ty {
        GgmlType::Q8_0 => cols % 32 == 0 && cols > 0,
        GgmlType::Q4K | GgmlType::Q6K | GgmlType::Iq3S => cols % 256 == 0 && cols > 0,
        _ => false,
    }
}

/// The widest one-token Q8_0 rows whose input the matrix-vector kernel holds in registers
/// (dp4a.cu's QA_XR_COLS: `Q8A_XR_PIECES` pieces of 16 columns a lane of a 32-wide warp).
pub const XR_COLS: usize = strata_kernels::consts::Q8A_XR_PIECES * 32 * 16;

/// Columns of each token's q8a row the multi-token products stage in shared memory at a time
/// (dp4a.cu's QA_KC).
pub const STAGE_COLS: usize = strata_kernels::consts::Q8A_KC;

/// Most tokens one launch of the products takes on a grid row (more go in chunks on grid.y).
pub const MAX_TOK: usize = 16;

/// `dq_quant_q8a`: `out = q8a(x)` for `out.rows` rows of `out.cols` f32.
pub fn quantize(l: &Launcher<'_>, x: DeviceView<'_>, out: &Q8a<'_>) -> Result<(), CudaError> {
    const OP: &str = "quant_q8a";
    let (n, cols) = (out.rows, out.cols);
    out.check(OP, n, cols)?;
    x.expect(OP, "x", f32s(n * cols), 4)?;
    if n == 0 {
        return Ok(());
    }
    let (xp, qp, dp, c) = (x.ptr(), out.q.ptr(), out.ds.ptr(), int(OP, "cols", cols)?);
    let grid = (
        (cols / 32).div_ceil(4) as u32,
        int(OP, "rows", n)? as u32,
        1,
    );
    launch!(l, "dq_quant_q8a", cfg(grid, 128, 0); &xp, &c, &qp, &dp)
}

/// `dq4_mv1/4/8/16`: `y_i (+)= W_i q8a(x)` for `n` tokens over one to three matrices of
/// `x.cols` columns, each of a supported type of its own ([`supports`]), one launch (Q/K/V:
/// three). `label` names the launch in profiles. With `stage`, a launch of two tokens or more
/// stages the tokens' q8a rows in shared memory ([`STAGE_COLS`] columns at a time) rather
/// than each warp reading them from global memory: the same sums bit for bit.
#[allow(clippy::too_many_arguments)]
pub fn mv(
    l: &Launcher<'_>,
    label: &'static str,
    mats: &[Mat<'_>],
    x: &Q8a<'_>,
    ys: &[DeviceView<'_>],
    n: usize,
    add: bool,
    stage: bool,
) -> Result<(), CudaError> {
    const OP: &str = "mv_q8a";
    if mats.is_empty() || mats.len() > 3 || mats.len() != ys.len() {
        return Err(bad(
            OP,
            format!(
                "{} matrices, {} outputs: one to three each",
                mats.len(),
                ys.len()
            ),
        ));
    }
    let cols = mats[0].cols;
    let mut codes = [0i32; 3];
    for (i, (m, y)) in mats.iter().zip(ys).enumerate() {
        if m.cols != cols || !supports(m.ty, m.cols) {
            return Err(bad(
                OP,
                format!(
                    "{} x {} {}: Q8_0 (columns a multiple of 32), Q4_K, Q6_K or IQ3_S (of 256), one width",
                    m.rows, m.cols, m.ty
                ),
            ));
        }
        codes[i] = m.check(OP)?;
        y.expect(OP, "y", f32s(n * m.rows), 4)?;
    }
    // Absent matrices (no rows) take the first one's code.
    let c0 = codes[0];
    for c in codes.iter_mut().skip(mats.len()) {
        *c = c0;
    }
    let all_q8 = mats.iter().all(|m| m.ty == GgmlType::Q8_0);
    x.check(OP, n, cols)?;
    let total: usize = mats.iter().map(|m| m.rows).sum();
    if n == 0 || total == 0 {
        return Ok(());
    }
    int(OP, "rows", total)?;
    let nt = match n {
        1 => 1,
        2..=4 => 4,
        5..=8 => 8,
        _ => MAX_TOK,
    };
    let name = match nt {
        1 => "dq4_mv1",
        4 => "dq4_mv4",
        8 => "dq4_mv8",
        _ => "dq4_mv16",
    };
    let w = |i: usize| mats.get(i).map_or(0, |m| m.w.ptr());
    let r = |i: usize| mats.get(i).map_or(0, |m| m.rows as i32);
    let y = |i: usize| ys.get(i).map_or(0, |v| v.ptr());
    let (w0, w1, w2, r0, r1, r2) = (w(0), w(1), w(2), r(0), r(1), r(2));
    let (y0, y1, y2) = (y(0), y(1), y(2));
    let (c, xq, xd, n32, add, stage) = (
        cols as i32,
        x.q.ptr(),
        x.ds.ptr(),
        int(OP, "n", n)?,
        add as i32,
        stage as i32,
    );
    // One token over Q8_0 rows the kernel holds in registers: a tall matrix (the LM head)
    // caps its grid and each warp walks rows (`walk_blocks`); else a warp per row.
    let blocks = if n == 1 && all_q8 && cols <= XR_COLS {
        walk_blocks(l, total)
    } else {
        (total as u32).div_ceil(DQ_WARPS)
    };
    let grid = (blocks, n.div_ceil(nt) as u32, 1);
    launch!(l, name => label, cfg(grid, 32 * DQ_WARPS, 0);
        &w0, &w1, &w2, &codes[0], &codes[1], &codes[2], &r0, &r1, &r2, &c, &xq, &xd, &y0, &y1,
        &y2, &n32, &add, &stage)
}

/// `dq4_moe_gate_up`: `h[a] = silu(G_e q8a(x)[t]) * (U_e q8a(x)[t])` for every assignment
/// `a = t*k + j` of `n` tokens, `e = ids[a]`; gate and up of one supported type.
#[allow(clippy::too_many_arguments)]
pub fn moe_gate_up(
    l: &Launcher<'_>,
    ex: ExpertTable<'_>,
    ids: DeviceView<'_>,
    k: usize,
    x: &Q8a<'_>,
    h: DeviceView<'_>,
    n: usize,
) -> Result<(), CudaError> {
    const OP: &str = "moe_gate_up_q8a";
    if ex.ty != ex.ty_up || !supports(ex.ty, ex.e) {
        return Err(bad(
            OP,
            format!(
                "{} gate and {} up experts of {} columns: one type, Q8_0, Q4_K, Q6_K or IQ3_S",
                ex.ty, ex.ty_up, ex.e
            ),
        ));
    }
    let [ty, _, _] = ex.check(OP)?;
    ids.expect(OP, "ids", 4 * (n * k) as u64, 4)?;
    x.check(OP, n, ex.e)?;
    h.expect(OP, "h", f32s(n * k * ex.f), 4)?;
    if n * k == 0 {
        return Ok(());
    }
    let (f, e, k32) = (ex.f as i32, ex.e as i32, k as i32);
    let (tp, ip, xq, xd, hp) = (ex.table.ptr(), ids.ptr(), x.q.ptr(), x.ds.ptr(), h.ptr());
    let grid = (
        (ex.f as u32).div_ceil(DQ_WARPS),
        int(OP, "n * k", n * k)? as u32,
        1,
    );
    launch!(l, "dq4_moe_gate_up" => "moe_gate_up", cfg(grid, 32 * DQ_WARPS, 0);
        &tp, &ty, &f, &e, &ip, &k32, &xq, &xd, &hp)
}

/// `dq4_moe_down`: `y[t] += sum_j wts[t*k+j] D_e q8a(h)[t*k+j]` (`h` quantized: `n * k` rows
/// of the expert width), down matrices of one supported type, k at most DQ_DOWN_MAXK.
#[allow(clippy::too_many_arguments)]
pub fn moe_down(
    l: &Launcher<'_>,
    ex: ExpertTable<'_>,
    ids: DeviceView<'_>,
    wts: DeviceView<'_>,
    k: usize,
    h: &Q8a<'_>,
    y: DeviceView<'_>,
    n: usize,
) -> Result<(), CudaError> {
    const OP: &str = "moe_down_q8a";
    if !supports(ex.ty_down, ex.f) || k > DQ_DOWN_MAXK {
        return Err(bad(
            OP,
            format!(
                "{} down experts of {} columns, k {k}: Q8_0, Q4_K, Q6_K or IQ3_S, k at most {DQ_DOWN_MAXK}",
                ex.ty_down, ex.f
            ),
        ));
    }
    let [_, _, ty] = ex.check(OP)?;
    ids.expect(OP, "ids", 4 * (n * k) as u64, 4)?;
    wts.expect(OP, "wts", f32s(n * k), 4)?;
    h.check(OP, n * k, ex.f)?;
    y.expect(OP, "y", f32s(n * ex.e), 4)?;
    if n * k == 0 {
        return Ok(());
    }
    let (e, f, k32) = (ex.e as i32, ex.f as i32, k as i32);
    let (tp, ip, wp, hq, hd, yp) = (
        ex.table.ptr(),
        ids.ptr(),
        wts.ptr(),
        h.q.ptr(),
        h.ds.ptr(),
        y.ptr(),
    );
    let grid = (ex.e as u32, int(OP, "n", n)? as u32, 1);
    launch!(l, "dq4_moe_down" => "moe_down", cfg(grid, 128, 0);
        &tp, &ty, &e, &f, &ip, &wp, &k32, &hq, &hd, &yp)
}

/// Host q8a rows: per value its quant, per block of 32 its (d, s).
#[derive(Debug, Clone, PartialEq)]
pub struct Q8aHost {
    pub q: Vec<i8>,
    pub ds: Vec<[f32; 2]>,
}

impl Q8aHost {
    /// The values the quants stand for, `d * q` (what the products multiply the weights by).
    pub fn values(&self) -> Vec<f32> {
        self.q
            .iter()
            .enumerate()
            .map(|(i, &q)| self.ds[i / 32][0] * q as f32)
            .collect()
    }
}

/// The reference of `dq_quant_q8a` over `x` (rows of a multiple of 32, back to back), bit
/// for bit: per block of 32, amax = max |x|, d = amax / 127, q = round(x * (127 / amax))
/// (half away from zero; 0 for an all-zero block), s = d * sum(q).
pub fn quantize_q8a(x: &[f32]) -> Q8aHost {
    assert!(x.len() % 32 == 0, "q8a rows are whole blocks of 32");
    let mut q = Vec::with_capacity(x.len());
    let mut ds = Vec::with_capacity(x.len() / 32);
    for b in x.chunks(32) {
        let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let mut s = 0i32;
        for v in b {
            let qi = (v * inv).round() as i32;
            s += qi;
            q.push(qi as i8);
        }
        let d = amax / 127.0;
        ds.push([d, d * s as f32]);
    }
    Q8aHost { q, ds }
}

#[cfg(test)]
#[path = "dp4a_emu.rs"]
mod emu;

#[cfg(test)]
mod tests {
    use super::supports;
    use crate::backend::cuda::options::{Int8Products, KernelOptions};
    use strata_schemas::ggml::GgmlType;

    /// `--kernel-options dp4a` sends IQ3_S products (the 80B file's experts and dense
    /// matrices) to the int8 kernels, as the engine selects them (`covers` and `supports`);
    /// the default keeps them on the f32 products until a GPU measures the A/B.
    #[test]
    fn dp4a_selects_iq3_s_and_the_default_does_not() {
        let all = KernelOptions::parse(&["dp4a".into()]).unwrap().int8;
        assert!(all.covers(GgmlType::Iq3S) && supports(GgmlType::Iq3S, 2048));
        assert!(supports(GgmlType::Iq3S, 512) && !supports(GgmlType::Iq3S, 288));
        assert!(!supports(GgmlType::Iq3S, 0) && !supports(GgmlType::Iq3Xxs, 2048));
        assert!(!KernelOptions::default().int8.covers(GgmlType::Iq3S));
        assert!(!Int8Products::None.covers(GgmlType::Iq3S));
    }
}
