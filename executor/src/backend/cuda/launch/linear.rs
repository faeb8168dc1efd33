//! Launchers of Qwen3-Next's kernels (`kernels/cuda/linear.cu`): the gated attention's
//! query/gate split and sigmoid gate, the Gated DeltaNet's conv and delta rule over each
//! slot's linear state, the shared expert's SwiGLU and gated add, and the MTP block's row
//! concatenation — one function per
//! kernel, each checking its views against what the kernel touches for the given shape.
//! Invariant: activations are row-major f32 (`n x width`), slots and positions u32 per token
//! (read on the device, so a launch depends only on the token count), the state view holds
//! every slot's state at the stride given, and a checkpoint view (MTP verify passes) every
//! slot's checkpoints at that stride.

use super::{bad, cfg, f32s, int, launch, Launcher};
use crate::backend::cuda::{CudaError, DeviceView};

pub use strata_kernels::consts::LIN_MAX_CONV;
/// Threads per block of the delta rule.
const DELTA_THREADS: u32 = 128;
/// State rows of `lin_delta_rule` a block (one a warp): `LIN_DR_ROWS` in linear.cu.
const DELTA_ROWS: usize = 4;
/// The largest key head dim `lin_delta_rule` holds in a warp's registers: 32 x `LIN_DR_MAXL`.
const DELTA_MAX_DK: usize = 256;

/// Blocks of a grid-stride elementwise launch over `total` values.
fn blocks(total: usize) -> u32 {
    total.div_ceil(256).clamp(1, 4096) as u32
}

/// `lin_split_qg`: `qg` (`n x n_head x 2 hd`, per head the query then its gate) into `q` and
/// `gate` (`n x n_head x hd` each).
pub fn split_query_gate(
    l: &Launcher<'_>,
    qg: DeviceView<'_>,
    q: DeviceView<'_>,
    gate: DeviceView<'_>,
    n_head: usize,
    hd: usize,
    n: usize,
) -> Result<(), CudaError> {
    const OP: &str = "split_query_gate";
    let w = n * n_head * hd;
    qg.expect(OP, "qg", f32s(2 * w), 4)?;
    q.expect(OP, "q", f32s(w), 4)?;
    gate.expect(OP, "gate", f32s(w), 4)?;
    if w == 0 {
        return Ok(());
    }
    let (gp, qp, ap) = (qg.ptr(), q.ptr(), gate.ptr());
    let (nh, hd32) = (int(OP, "n_head", n_head)?, int(OP, "head_dim", hd)?);
    let grid = (nh as u32, int(OP, "n", n)? as u32, 1);
    launch!(l, "lin_split_qg", cfg(grid, 128, 0); &gp, &qp, &ap, &nh, &hd32)
}

/// `lin_sigmoid_gate`: `x *= sigmoid(gate)` over `total` values.
pub fn sigmoid_gate(
    l: &Launcher<'_>,
    x: DeviceView<'_>,
    gate: DeviceView<'_>,
    total: usize,
) -> Result<(), CudaError> {
    const OP: &str = "sigmoid_gate";
    x.expect(OP, "x", f32s(total), 4)?;
    gate.expect(OP, "gate", f32s(total), 4)?;
    let (xp, gp, t) = (x.ptr(), gate.ptr(), total as i64);
    launch!(l, "lin_sigmoid_gate", cfg((blocks(total), 1, 1), 256, 0); &xp, &gp, &t)
}

/// Every slot's linear state on a stage, as one layer's op reads it: slot `s`'s part of the
/// layer at `state + 4 * (s * slot_stride + layer_off)` bytes.
#[derive(Debug, Clone, Copy)]
pub struct LinSlots<'a> {
    pub state: DeviceView<'a>,
    pub slots: usize,
    /// Floats from one slot's state to the next.
    pub slot_stride: usize,
    /// Floats from a slot's state to this op's part of the layer.
    pub layer_off: usize,
    /// Where the state after each of a run's first tokens is kept (an MTP verify pass):
    /// `checkpoints` copies per slot, copy `j` of slot `s` at float `(s * checkpoints + j) *
    /// slot_stride` of the view; `None` in every other pass.
    pub ckpt: Option<(DeviceView<'a>, usize)>,
}

impl LinSlots<'_> {
    fn check(&self, op: &'static str, what: &str, floats: usize) -> Result<(), CudaError> {
        if self.layer_off + floats > self.slot_stride {
            return Err(bad(
                op,
                format!(
                    "{what} of {floats} floats at {} does not fit a slot's {} floats of linear state",
                    self.layer_off, self.slot_stride
                ),
            ));
        }
        self.state
            .expect(op, "linear state", f32s(self.slots * self.slot_stride), 4)?;
        if let Some((v, c)) = self.ckpt {
            v.expect(
                op,
                "linear-state checkpoints",
                f32s(self.slots * c * self.slot_stride),
                4,
            )?;
        }
        Ok(())
    }

    /// The checkpoints' address and count per slot (0 and 0 when none are kept).
    fn ckpt_args(&self) -> (u64, i32) {
        match self.ckpt {
            Some((v, c)) if c > 0 => (v.ptr(), c as i32),
            _ => (0, 0),
        }
    }
}

/// The step's per-token slots and positions (u32 each, `n` of them).
#[derive(Debug, Clone, Copy)]
pub struct Tokens<'a> {
    pub pos: DeviceView<'a>,
    pub slot: DeviceView<'a>,
    pub n: usize,
}

impl Tokens<'_> {
    fn check(&self, op: &'static str) -> Result<(), CudaError> {
        self.pos.expect(op, "pos", 4 * self.n as u64, 4)?;
        self.slot.expect(op, "slot", 4 * self.n as u64, 4)?;
        Ok(())
    }
}

/// `lin_conv_silu`: the causal depthwise conv1d + SiLU of `tok.n` tokens of `ch` channels
/// (`qkv` and `out` `n x ch`, `w` `ch x k`), each run of one slot's consecutive tokens over
/// and rolling that slot's conv state (`(k - 1) x ch` floats at `st`), zero for a run starting
/// at position 0, keeping the state after each of a run's first tokens in `st.ckpt` when
/// given. A pass holds at most one run per slot.
#[allow(clippy::too_many_arguments)]
pub fn conv_silu(
    l: &Launcher<'_>,
    qkv: DeviceView<'_>,
    w: DeviceView<'_>,
    st: LinSlots<'_>,
    tok: Tokens<'_>,
    out: DeviceView<'_>,
    ch: usize,
    k: usize,
) -> Result<(), CudaError> {
    const OP: &str = "conv1d";
    if k == 0 || k > LIN_MAX_CONV {
        return Err(bad(
            OP,
            format!("conv width {k}: the kernel takes 1..={LIN_MAX_CONV} taps"),
        ));
    }
    let n = tok.n;
    qkv.expect(OP, "qkv", f32s(n * ch), 4)?;
    out.expect(OP, "out", f32s(n * ch), 4)?;
    w.expect(OP, "weight", f32s(ch * k), 4)?;
    st.check(OP, "the conv state", (k - 1) * ch)?;
    tok.check(OP)?;
    if n == 0 || ch == 0 {
        return Ok(());
    }
    let (xp, wp, sp, pp, slp, op) = (
        qkv.ptr(),
        w.ptr(),
        st.state.ptr(),
        tok.pos.ptr(),
        tok.slot.ptr(),
        out.ptr(),
    );
    let (n32, ch32, k32) = (int(OP, "n", n)?, int(OP, "channels", ch)?, k as i32);
    let (stride, off) = (st.slot_stride as i64, st.layer_off as i64);
    let (ckp, nck) = st.ckpt_args();
    let grid = ((ch as u32).div_ceil(128), n32 as u32, 1);
    launch!(l, "lin_conv_silu", cfg(grid, 128, 0);
        &xp, &wp, &sp, &pp, &slp, &op, &n32, &ch32, &k32, &stride, &off, &ckp, &nck)
}

/// The head shape of a gated delta net layer.
#[derive(Debug, Clone, Copy)]
pub struct DeltaHeads {
    /// Key heads.
    pub nk: usize,
    /// Value heads (a multiple of `nk`).
    pub nv: usize,
    /// Key and value head dims.
    pub dk: usize,
    pub dv: usize,
}

impl DeltaHeads {
    /// Floats of a `qkv` (conv output) row.
    pub fn width(&self) -> usize {
        2 * self.nk * self.dk + self.nv * self.dv
    }
}

/// The inputs and weights of one layer's delta rule: the conv output (`n x width`), the
/// `ssm_ba` projection (`n x 2 nv`), the output gate `z` (`n x nv dv`), `dt_bias` and
/// `ssm_a` (`nv`), the gated norm's weights (`dv`).
#[derive(Debug, Clone, Copy)]
pub struct DeltaIn<'a> {
    pub conv: DeviceView<'a>,
    pub ba: DeviceView<'a>,
    pub z: DeviceView<'a>,
    pub dt_bias: DeviceView<'a>,
    pub ssm_a: DeviceView<'a>,
    pub norm: DeviceView<'a>,
}

/// `lin_delta_rule` then `lin_gated_norm`: per value head, state row (one warp a row, held in
/// registers over the run) and run of one slot's consecutive tokens, the gates, the q/k
/// l2-norm, the gated delta rule over the slot's recurrent state (`nv x dv x dk` floats at
/// `st`, zero for a run starting at position 0); then `out = norm * RMSNorm(o) * silu(z)`
/// (`n x nv dv`), keeping the state after each of a run's first tokens in `st.ckpt` when
/// given. A pass holds at most one run per slot.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule(
    l: &Launcher<'_>,
    h: DeltaHeads,
    inp: DeltaIn<'_>,
    st: LinSlots<'_>,
    tok: Tokens<'_>,
    out: DeviceView<'_>,
    eps: f32,
) -> Result<(), CudaError> {
    const OP: &str = "delta rule";
    if h.nk == 0 || h.dk == 0 || h.dv == 0 || h.nv == 0 || h.nv % h.nk != 0 {
        return Err(bad(
            OP,
            format!(
                "{} key heads of {} and {} value heads of {}: every count and dim non-zero, value heads a multiple of key heads",
                h.nk, h.dk, h.nv, h.dv
            ),
        ));
    }
    if h.dk > DELTA_MAX_DK {
        return Err(bad(
            OP,
            format!(
                "key head dim {} is over {DELTA_MAX_DK}: a state row is held in the registers of one warp",
                h.dk
            ),
        ));
    }
    let n = tok.n;
    let vd = h.nv * h.dv;
    inp.conv.expect(OP, "conv output", f32s(n * h.width()), 4)?;
    inp.ba.expect(OP, "ba", f32s(n * 2 * h.nv), 4)?;
    inp.z.expect(OP, "z", f32s(n * vd), 4)?;
    inp.dt_bias.expect(OP, "dt_bias", f32s(h.nv), 4)?;
    inp.ssm_a.expect(OP, "ssm_a", f32s(h.nv), 4)?;
    inp.norm.expect(OP, "ssm_norm", f32s(h.dv), 4)?;
    out.expect(OP, "out", f32s(n * vd), 4)?;
    st.check(OP, "the recurrent state", h.nv * h.dv * h.dk)?;
    tok.check(OP)?;
    if n == 0 {
        return Ok(());
    }
    let (cp, bp, zp, dp, ap, np) = (
        inp.conv.ptr(),
        inp.ba.ptr(),
        inp.z.ptr(),
        inp.dt_bias.ptr(),
        inp.ssm_a.ptr(),
        inp.norm.ptr(),
    );
    let (sp, pp, slp, op) = (st.state.ptr(), tok.pos.ptr(), tok.slot.ptr(), out.ptr());
    let n32 = int(OP, "n", n)?;
    let (nk, nv, dk, dv) = (
        int(OP, "key heads", h.nk)?,
        int(OP, "value heads", h.nv)?,
        int(OP, "key head dim", h.dk)?,
        int(OP, "value head dim", h.dv)?,
    );
    let (stride, off) = (st.slot_stride as i64, st.layer_off as i64);
    let (ckp, nck) = st.ckpt_args();
    // One warp a state row: DELTA_ROWS rows a block.
    let groups = h.dv.div_ceil(DELTA_ROWS);
    let grid = (int(OP, "row groups", h.nv * groups)? as u32, n32 as u32, 1);
    launch!(l, "lin_delta_rule", cfg(grid, 32 * DELTA_ROWS as u32, 0);
        &cp, &bp, &dp, &ap, &sp, &pp, &slp, &op,
        &n32, &nk, &nv, &dk, &dv, &stride, &off, &ckp, &nck)?;
    launch!(l, "lin_gated_norm", cfg((nv as u32, n32 as u32, 1), DELTA_THREADS, 0);
        &op, &zp, &np, &nv, &dv, &eps)
}

/// `lin_swiglu`: `g = silu(g) * u` over `total` values.
pub fn swiglu(
    l: &Launcher<'_>,
    g: DeviceView<'_>,
    u: DeviceView<'_>,
    total: usize,
) -> Result<(), CudaError> {
    const OP: &str = "swiglu";
    g.expect(OP, "g", f32s(total), 4)?;
    u.expect(OP, "u", f32s(total), 4)?;
    let (gp, up, t) = (g.ptr(), u.ptr(), total as i64);
    launch!(l, "lin_swiglu", cfg((blocks(total), 1, 1), 256, 0); &gp, &up, &t)
}

/// `lin_concat_rows`: `out[t] = [a[t], b[t]]` over `n` rows of `e` (`out` rows of `2 e`).
pub fn concat_rows(
    l: &Launcher<'_>,
    a: DeviceView<'_>,
    b: DeviceView<'_>,
    out: DeviceView<'_>,
    e: usize,
    n: usize,
) -> Result<(), CudaError> {
    const OP: &str = "concat_rows";
    a.expect(OP, "a", f32s(n * e), 4)?;
    b.expect(OP, "b", f32s(n * e), 4)?;
    out.expect(OP, "out", f32s(2 * n * e), 4)?;
    if n == 0 || e == 0 {
        return Ok(());
    }
    let (ap, bp, op) = (a.ptr(), b.ptr(), out.ptr());
    let (e32, total) = (int(OP, "e", e)?, (2 * n * e) as i64);
    launch!(l, "lin_concat_rows", cfg((blocks(2 * n * e), 1, 1), 256, 0);
        &ap, &bp, &op, &e32, &total)
}

/// `lin_shared_add`: `y[t] += sigmoid(gate_inp . xn[t]) * d[t]` over `n` rows of `e`.
pub fn shared_add(
    l: &Launcher<'_>,
    xn: DeviceView<'_>,
    gate_inp: DeviceView<'_>,
    d: DeviceView<'_>,
    y: DeviceView<'_>,
    e: usize,
    n: usize,
) -> Result<(), CudaError> {
    const OP: &str = "shared expert";
    xn.expect(OP, "xn", f32s(n * e), 4)?;
    gate_inp.expect(OP, "ffn_gate_inp_shexp", f32s(e), 4)?;
    d.expect(OP, "down output", f32s(n * e), 4)?;
    y.expect(OP, "y", f32s(n * e), 4)?;
    if n == 0 {
        return Ok(());
    }
    let (xp, gp, dp, yp) = (xn.ptr(), gate_inp.ptr(), d.ptr(), y.ptr());
    let e32 = int(OP, "e", e)?;
    launch!(l, "lin_shared_add", cfg((int(OP, "n", n)? as u32, 1, 1), 256, 0);
        &xp, &gp, &dp, &yp, &e32)
}
