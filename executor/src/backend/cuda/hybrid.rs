//! The hybrid miss path of the expert cache (`expert_cache.rs`): in a decode group, up to the
//! policy's count of missed experts per token are computed on the host CPU from the mapped
//! model file (`backend::cpu::host_experts`, every core) instead of being copied into a slot,
//! while the GPU computes the hits and the streamed misses; the CPU's weighted sum is copied
//! up and added into the layer's output (`dq_moe_combine` with one unit weight a row).
//! Invariant: a pick computed on the host is computed once: on the device its id is
//! replaced by an expert of the group that sits in a slot and its weight by 0 (so the device
//! adds exactly 0 for it) before the products run; the host's partial sum lands in `h` after
//! the products that read `h` (stream order) and is added into `y` before anything else runs.

use super::launch::{decode, Launcher};
use super::stage::CudaStage;
use super::{pod_bytes, CudaDevice, CudaError, DeviceView};
use crate::backend::cpu::host_experts::{host_experts, HostPick};
use crate::backend::cpu::ops::Matrix;
use crate::backend::WorkBuf;
use crate::load::HostModel;
use strata_schemas::ggml::GgmlType;

fn err(detail: impl Into<String>) -> CudaError {
    CudaError::Shape {
        op: "hybrid experts",
        detail: detail.into(),
    }
}

/// The host half's state and buffers, sized once for passes of `max_tok` tokens.
pub(crate) struct HostHalf {
    /// Misses per token of a decode group computed here (0: every miss is streamed).
    pub(crate) per_token: u32,
    /// The group's experts computed here, and a flag per expert.
    pub(crate) experts: Vec<u32>,
    on_host: Vec<bool>,
    /// Rows of the pass read back (`xn`, `wts`), a group's ids and weights written back for
    /// the device, its picks, their hidden values and the partial sum followed by one unit
    /// weight a row.
    xn: Vec<f32>,
    wts: Vec<f32>,
    ids_dev: Vec<u32>,
    wts_dev: Vec<f32>,
    picks: Vec<HostPick>,
    h: Vec<f32>,
    out: Vec<f32>,
    /// Misses computed here since start-up.
    pub(crate) computed: u64,
}

impl HostHalf {
    /// `per_token` misses per token on the host for decode passes of up to `rows` tokens
    /// (the plan's slots); `(e, f, k, n_expert)` the model's widths. The partial sum and its
    /// unit weights travel through the `h` buffer (`max_tok x k x f` f32), so the path needs
    /// `rows x (e + 1) <= max_tok x k x f`; a policy that would use it where that fails is
    /// refused with the flag that avoids it.
    pub(crate) fn new(
        per_token: u32,
        (max_tok, rows): (usize, usize),
        (e, f, k, ne): (usize, usize, usize, usize),
    ) -> Result<Self, CudaError> {
        if per_token > 0 && rows * (e + 1) > max_tok * k * f {
            return Err(err(format!(
                "the hybrid miss path carries the CPU's sum of {e} values for each of {rows} slots through the experts' hidden buffer of {max_tok} x {k} x {f} values, which is too small for this plan: run with --miss-policy stream"
            )));
        }
        let on = per_token > 0;
        let n = |v: usize| if on { v } else { 0 };
        Ok(Self {
            per_token,
            experts: Vec::with_capacity(n(ne)),
            on_host: vec![false; n(ne)],
            xn: vec![0.0; n(max_tok * e)],
            wts: vec![0.0; n(max_tok * k)],
            ids_dev: vec![0; n(max_tok * k)],
            wts_dev: vec![0.0; n(max_tok * k)],
            picks: Vec::with_capacity(n(max_tok * k)),
            h: vec![0.0; n(max_tok * k * f)],
            out: vec![0.0; n(max_tok * e + max_tok)],
            computed: 0,
        })
    }

    /// How many misses of a group of `tokens` tokens may go to the host.
    pub(crate) fn cap(&self, tokens: usize) -> usize {
        (self.per_token as usize).saturating_mul(tokens)
    }

    /// Whether expert `x` is computed on the host in the current group.
    pub(crate) fn takes(&self, x: u32) -> bool {
        self.on_host.get(x as usize).copied().unwrap_or(false)
    }

    /// Take `x` onto the host for the current group.
    pub(crate) fn take(&mut self, x: u32) {
        if let Some(f) = self.on_host.get_mut(x as usize) {
            *f = true;
            self.experts.push(x);
        }
    }

    /// End the group: no expert is on the host any more.
    pub(crate) fn clear(&mut self) {
        for &x in &self.experts {
            self.on_host[x as usize] = false;
        }
        self.experts.clear();
    }
}

/// The bytes of one expert's gate, up and down in `host`'s stacks of `layer`, as matrices
/// (`mats`: (type, rows, cols, bytes of one expert) each).
fn expert_mats<'h>(
    host: &'h dyn HostModel,
    layer: u32,
    x: u32,
    mats: &[(GgmlType, usize, usize, u64); 3],
) -> Result<[Matrix<'h>; 3], CudaError> {
    let mut out = Vec::with_capacity(3);
    for (&(ty, rows, cols, per), part) in mats.iter().zip(["gate", "up", "down"]) {
        let name = format!("blk.{layer}.ffn_{part}_exps.weight");
        let stack = host
            .tensor_bytes(&name)
            .ok_or_else(|| err(format!("`{name}` is missing from the model")))?;
        let per = per as usize;
        let src = stack
            .get(x as usize * per..(x as usize + 1) * per)
            .ok_or_else(|| err(format!("`{name}` holds no expert {x}")))?;
        out.push(Matrix::new(ty, cols, rows, src).map_err(|e| err(format!("`{name}`: {e}")))?);
    }
    Ok([out[0], out[1], out[2]])
}

impl CudaStage {
    /// Right after the pass's picks came back (the stream idle, nothing of the layer's
    /// copies queued yet): read the `xn` and `wts` rows of its `n` tokens back, so that no
    /// later read waits for the streamed misses' copies.
    pub(crate) fn hybrid_rows(
        &self,
        hh: &mut HostHalf,
        n: usize,
        [xn, wts]: [WorkBuf; 2],
    ) -> Result<(), CudaError> {
        let (e, k) = (self.d.e, self.d.k);
        if n * e > hh.xn.len() {
            return Err(err(format!(
                "a decode pass of {n} tokens is more than the {} the host half was sized for",
                hh.xn.len() / e.max(1)
            )));
        }
        let xv = self.buf_at(xn, 0, (4 * n * e) as u64)?;
        let wv = self.buf_at(wts, 0, (4 * n * k) as u64)?;
        rows_back(
            &self.dev,
            [xv, wv],
            [&mut hh.xn[..n * e], &mut hh.wts[..n * k]],
        )
    }

    /// Before a decode group's products (`g` tokens from `t0`, picks `ids` as read back, its
    /// rows read by [`Self::hybrid_rows`]): on the device, point every pick the host computes
    /// at an expert of the group in a slot (`stand_in`) with weight 0. Returns whether any
    /// pick is left for the device.
    pub(crate) fn hybrid_prepare(
        &self,
        hh: &mut HostHalf,
        ids: &[u32],
        (t0, g): (usize, usize),
        [ids_buf, wts]: [WorkBuf; 2],
        stand_in: Option<u32>,
    ) -> Result<bool, CudaError> {
        let k = self.d.k;
        hh.picks.clear();
        let mut device_left = false;
        for t in 0..g {
            for j in 0..k {
                let (x, w) = (ids[t * k + j], hh.wts[(t0 + t) * k + j]);
                if hh.takes(x) {
                    hh.picks.push(HostPick {
                        token: t as u32,
                        expert: x,
                        weight: w,
                    });
                    hh.ids_dev[t * k + j] = stand_in.unwrap_or(x);
                    hh.wts_dev[t * k + j] = 0.0;
                } else {
                    hh.ids_dev[t * k + j] = x;
                    hh.wts_dev[t * k + j] = w;
                    device_left = true;
                }
            }
        }
        if device_left {
            let iv = self.buf_at(ids_buf, (4 * t0 * k) as u64, (4 * g * k) as u64)?;
            let wv = self.buf_at(wts, (4 * t0 * k) as u64, (4 * g * k) as u64)?;
            picks_up(
                &self.dev,
                (&hh.ids_dev[..g * k], &hh.wts_dev[..g * k]),
                [iv, wv],
            )?;
        }
        Ok(device_left)
    }

    /// After the group's device products are queued: compute the host's picks on the CPU
    /// (the device runs meanwhile), copy the sum up into `h` behind the products and add it
    /// into rows `t0..t0 + g` of `y`.
    pub(crate) fn hybrid_finish(
        &self,
        hh: &mut HostHalf,
        host: &dyn HostModel,
        layer: u32,
        mats: &[(GgmlType, usize, usize, u64); 3],
        (t0, g): (usize, usize),
        y: WorkBuf,
    ) -> Result<(), CudaError> {
        let (e, f) = (self.d.e, self.d.f);
        let weights = hh
            .picks
            .iter()
            .map(|p| expert_mats(host, layer, p.expert, mats))
            .collect::<Result<Vec<_>, _>>()?;
        let (xs, out) = (&hh.xn[t0 * e..(t0 + g) * e], &mut hh.out[..g * e + g]);
        host_experts(&weights, &hh.picks, xs, g, (e, f), &mut hh.h, out)
            .map_err(|e| err(format!("layer {layer}: {e}")))?;
        hh.computed += hh.experts.len() as u64;
        let hv = self.buf_at(WorkBuf::H, 0, (4 * (g * e + g)) as u64)?;
        let yv = self.buf_at(y, (4 * t0 * e) as u64, (4 * g * e) as u64)?;
        sum_up(&self.launcher(), &mut hh.out[..g * e + g], hv, yv, (g, e))
    }
}

/// The device side of a hybrid decode layer, one function a step so that the engine (the
/// methods above) and the probe's `host_round_trip_us` (`probe/round_trip.rs`) run the same
/// code. First: the pass's `xn` and router weight rows back into `host` (each read waits for
/// the stream: the layer's synchronisation).
pub(crate) fn rows_back(
    dev: &CudaDevice,
    [xv, wv]: [DeviceView<'_>; 2],
    [xn, wts]: [&mut [f32]; 2],
) -> Result<(), CudaError> {
    dev.dtoh(xv, xn)?;
    dev.dtoh(wv, wts)
}

/// Second: the group's picks as the device computes them (host picks pointed at a stand-in
/// with weight 0) up into `iv` and `wv`, queued on the stream.
pub(crate) fn picks_up(
    dev: &CudaDevice,
    (ids, wts): (&[u32], &[f32]),
    [iv, wv]: [DeviceView<'_>; 2],
) -> Result<(), CudaError> {
    queue_up(dev, pod_bytes(ids), iv)?;
    queue_up(dev, pod_bytes(wts), wv)
}

/// Last: the host's sum of `g` rows of `e` (`out`'s first `g x e` values; its last `g` are
/// set to the unit weights here) up into `hv` behind the device's products, and added into
/// `yv` by `dq_moe_combine`.
pub(crate) fn sum_up(
    l: &Launcher<'_>,
    out: &mut [f32],
    hv: DeviceView<'_>,
    yv: DeviceView<'_>,
    (g, e): (usize, usize),
) -> Result<(), CudaError> {
    if out.len() != g * e + g {
        return Err(err(format!(
            "the host's sum holds {} values, not {g} rows of {e} plus {g} weights",
            out.len()
        )));
    }
    out[g * e..].fill(1.0);
    queue_up(l.dev, pod_bytes(out), hv)?;
    let part = hv.sub(0, (4 * g * e) as u64)?;
    let ones = hv.sub((4 * g * e) as u64, (4 * g) as u64)?;
    decode::moe_combine(l, part, ones, 1, e, yv, g)
}

/// Queue a copy of `src` (pageable host memory) into `dst` on the device's stream, behind
/// everything queued before it.
fn queue_up(dev: &CudaDevice, src: &[u8], dst: DeviceView<'_>) -> Result<(), CudaError> {
    dst.expect_len("hybrid experts copy", src.len() as u64)?;
    // SAFETY: `dst` is a checked view of exactly src.len() bytes inside a live arena of
    // `dev`; `src` is pageable host memory, which htod_raw stages before it returns (on HIP
    // it waits), so the host buffer may change once this returns.
    unsafe { dev.htod_raw("hybrid experts", dst.ptr(), src) }
}
