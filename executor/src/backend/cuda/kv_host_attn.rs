//! `--kv-host cpu`: a decode pass (or draft pass) of a stage whose KV spills past
//! `--kv-resident` attends the spilled cells on the host CPU while the device attends its
//! VRAM window, modelled on the hybrid expert path (`hybrid.rs`). Per attention layer: after
//! the QK-norm/RoPE and KV store, the query rows come back (one synchronisation, which also
//! makes the step's own K and V visible in the pinned chunks); `dq_attn_gqa` is queued over
//! the window only; the CPU computes each (token, head)'s partial softmax over the slot's
//! spilled cells straight from the chunks (`backend::cpu::host_attn`, every core); the
//! partials go up into the `kv_host_part` buffer behind the window's splits, and
//! `dq_attn_combine` merges them with the splits (the flash-decoding merge).
//! Invariant: each cell of a token's context is attended exactly once — cells below the
//! window by the device (the kernel's `cpu_part` caps its splits at the window), the rest by
//! the host — and a pass that attends on the host is never captured in a graph (`Stage::run`
//! asks [`CudaStage::kv_cpu_pass`]), so a captured decode graph only ever runs passes whose
//! tokens all sit in the window.

use super::launch::attention::{self, Heads, HostPartial, KvLayer, Splits};
use super::launch::{kty, Launcher};
use super::stage::CudaStage;
use super::{CudaDevice, CudaError, DeviceView};
use crate::backend::cpu::host_attn::{host_partials, scratch_len, SpilledCells};
use crate::backend::WorkBuf;
use strata_schemas::ggml::GgmlType;

/// Fewest cells a piece of a token's spilled cells gets on the host (smaller ones cost more in
/// the pool's hand-offs than they read).
const MIN_PIECE: usize = 64;

fn err(detail: impl Into<String>) -> CudaError {
    CudaError::Shape {
        op: "kv host attention",
        detail: detail.into(),
    }
}

/// The host half's buffers, sized once for decode passes of up to `rows` tokens.
#[derive(Debug)]
pub(crate) struct KvHostCpu {
    ty: GgmlType,
    /// Query rows read back, the pass's slots and context lengths, and the partials (outputs
    /// then (max, sum) pairs) that go up.
    q: Vec<f32>,
    slot: Vec<u32>,
    n_ctx: Vec<u32>,
    part: Vec<f32>,
    /// The pieces' partials before their merge, for up to `max_pieces` pieces a token.
    scratch: Vec<f32>,
    max_pieces: usize,
    /// Layers attended here since start-up.
    pub(crate) layers: u64,
}

impl CudaStage {
    /// Turn the host half on (`on`: the plan's or `--kv-host`'s choice) for this stage's
    /// spilled KV; nothing to do where nothing spills. An error naming the fix when this
    /// plan's buffers or KV type do not allow it.
    pub(crate) fn set_kv_host_cpu(&mut self, on: bool) -> Result<(), CudaError> {
        let Some(spill) = self.kv_spill.as_mut() else {
            return Ok(());
        };
        if !on {
            spill.cpu = None;
            return Ok(());
        }
        let d = self.d;
        let ty = [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0]
            .into_iter()
            .find(|t| kty(*t) == Some(self.kv.ty))
            .ok_or_else(|| {
                err(format!(
                    "the host CPU attends KV rows of f32, f16 or q8_0, not this plan's (kernel type {}): run with --kv-host stream",
                    self.kv.ty
                ))
            })?;
        let rows = self.slots;
        let part = 4 * (rows * d.n_head * (d.hd + 2)) as u64;
        let have = self.bufs.get(&WorkBuf::KvHostPart).map_or(0, |s| s.bytes);
        if have < part || d.hd_v != d.hd {
            return Err(err(format!(
                "the plan's kv_host_part buffer holds {have} bytes but {rows} slots x {} heads of {} (+ max and sum) need {part}: re-plan with this build's strata-plan, or run with --kv-host stream",
                d.n_head, d.hd
            )));
        }
        let max_pieces = rayon::current_num_threads().max(1);
        spill.cpu = Some(std::sync::Mutex::new(KvHostCpu {
            ty,
            q: vec![0.0; rows * d.n_head * d.hd],
            slot: vec![0; rows],
            n_ctx: vec![0; rows],
            part: vec![0.0; rows * d.n_head * (d.hd + 2)],
            scratch: vec![0.0; scratch_len(rows, d.n_head, d.hd, max_pieces)],
            max_pieces,
            layers: 0,
        }));
        Ok(())
    }

    /// Whether the host half is on for this stage.
    pub fn kv_host_cpu(&self) -> bool {
        self.kv_spill.as_ref().is_some_and(|s| s.cpu.is_some())
    }

    /// Layers whose spilled cells the host CPU attended since start-up.
    pub fn kv_host_layers(&self) -> u64 {
        self.kv_spill
            .as_ref()
            .and_then(|s| s.cpu.as_ref())
            .map_or(0, |m| m.lock().map_or(0, |c| c.layers))
    }

    /// Whether the `n`-token pass being issued attends on the host: the host half is on, it
    /// is a decode (or draft) pass, and some token's cell lies past the window.
    pub(crate) fn kv_cpu_pass(&self, n: usize) -> bool {
        let m = self.max_tok;
        let w = self.kv.cells as i64;
        self.decoding()
            && self.kv_host_cpu()
            && self.host_in[m..m + n.min(m)]
                .iter()
                .any(|&p| i64::from(p) >= w)
    }

    /// The decode attention of the pass's `n` tokens with the host half: their QK-normed,
    /// rotated queries `q` and stored K/V (`kv`, this layer), the window's splits `sp` on the
    /// device, the rest on the CPU, merged into `out`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attn_decode_host(
        &self,
        l: &Launcher<'_>,
        h: Heads<'_>,
        q: DeviceView<'_>,
        kv: KvLayer<'_>,
        n_ctx: DeviceView<'_>,
        sp: Splits<'_>,
        out: DeviceView<'_>,
        n: usize,
    ) -> Result<(), CudaError> {
        let spill = self
            .kv_spill
            .as_ref()
            .ok_or_else(|| err("no spilled KV on this stage"))?;
        let mut hc = spill
            .cpu
            .as_ref()
            .ok_or_else(|| err("the host half is off on this stage"))?
            .lock()
            .map_err(|_| err("the host half's buffers were poisoned by an earlier panic"))?;
        let (nh, hd) = (h.n_head, h.hd);
        if n > hc.slot.len() {
            return Err(err(format!(
                "a decode pass of {n} tokens is more than the {} slots the host half was sized for",
                hc.slot.len()
            )));
        }
        let m = self.max_tok;
        for t in 0..n {
            hc.slot[t] = self.host_in[2 * m + t] as u32;
            hc.n_ctx[t] = self.host_in[m + t] as u32 + 1;
        }
        let a = kv.host;
        let chunks = spill.chunk_slices();
        let cells = SpilledCells {
            chunks: &chunks,
            ty: hc.ty,
            cell_bytes: a.cell_bytes as usize,
            per_chunk: a.per_chunk as usize,
            resident: a.resident as usize,
            per_slot: a.per_slot as usize,
            k_off: a.k_off as usize,
            v_off: a.v_off as usize,
            row_bytes: kv.row_bytes as usize,
        };
        let hc = &mut *hc;
        // Enough pieces a token for every core, none shorter than MIN_PIECE cells.
        let longest = hc.n_ctx[..n]
            .iter()
            .map(|&c| (c as usize).saturating_sub(cells.resident))
            .max()
            .unwrap_or(0);
        let pieces = pieces(hc.max_pieces, n * h.n_head_kv, longest);
        let scale = 1.0 / (hd as f32).sqrt();
        let (slot, n_ctx_host, scratch) = (&hc.slot[..n], &hc.n_ctx[..n], &mut hc.scratch);
        let mut partials = |q: &[f32], part: &mut [f32]| {
            let (o, ms) = part.split_at_mut(n * nh * hd);
            host_partials(
                &cells,
                (nh, h.n_head_kv, hd),
                slot,
                n_ctx_host,
                q,
                scale,
                pieces,
                scratch,
                o,
                ms,
            )
            .map_err(|e| err(e.to_string()))
        };
        let side = AttnSide {
            h,
            q,
            kv,
            n_ctx,
            sp,
            out,
            part: self.buf_at(WorkBuf::KvHostPart, 0, (4 * n * nh * (hd + 2)) as u64)?,
            n,
        };
        host_round_trip(l, side, (&mut hc.q, &mut hc.part), &mut partials)?;
        hc.layers += 1;
        Ok(())
    }
}

/// Pieces a token's spilled cells are cut into on the host: enough for `max_pieces` cores
/// over `tasks` (token, KV head) pairs, none shorter than [`MIN_PIECE`] of the `longest`
/// token's cells.
pub(crate) fn pieces(max_pieces: usize, tasks: usize, longest: usize) -> usize {
    max_pieces
        .div_ceil(tasks.max(1))
        .min(longest.div_ceil(MIN_PIECE))
        .clamp(1, max_pieces.max(1))
}

/// The host's part of [`host_round_trip`]: from the queries read back, the partials (outputs
/// then (max, sum) pairs).
pub(crate) type HostPartials<'a> = dyn FnMut(&[f32], &mut [f32]) -> Result<(), CudaError> + 'a;

/// One attention layer's device side with the host half, as the engine runs it.
#[derive(Clone, Copy)]
pub(crate) struct AttnSide<'a> {
    pub(crate) h: Heads<'a>,
    /// The pass's QK-normed, rotated queries and this layer's KV (its `host` naming the
    /// spilled cells), each token's context length, the window's splits and the output.
    pub(crate) q: DeviceView<'a>,
    pub(crate) kv: KvLayer<'a>,
    pub(crate) n_ctx: DeviceView<'a>,
    pub(crate) sp: Splits<'a>,
    pub(crate) out: DeviceView<'a>,
    /// Where the host's partials go up (`n x n_head x hd` outputs, then (max, sum) pairs).
    pub(crate) part: DeviceView<'a>,
    pub(crate) n: usize,
}

/// The round trip of one attention layer whose spilled cells the host attends, one function
/// so that the engine ([`CudaStage::attn_decode_host`]) and the probe's
/// `kv_host_round_trip_us` (`probe/round_trip.rs`) run the same code: the queries back into
/// `q_host` (this waits for the stream, so the step's own K and V are in the chunks too when
/// the CPU reads them), the window's splits queued on the device, `partials` computing the
/// host's part into `part` on the CPU meanwhile, the partials up behind the splits and the
/// flash-decoding merge into `out`.
pub(crate) fn host_round_trip(
    l: &Launcher<'_>,
    a: AttnSide<'_>,
    (q_host, part): (&mut [f32], &mut [f32]),
    partials: &mut HostPartials<'_>,
) -> Result<(), CudaError> {
    let (n, nh, hd) = (a.n, a.h.n_head, a.h.hd);
    let (nq, np) = (n * nh * hd, n * nh * (hd + 2));
    if q_host.len() < nq || part.len() < np {
        return Err(err(format!(
            "the host half's buffers ({} query and {} partial values) are short of {n} tokens' {nq} and {np}",
            q_host.len(),
            part.len()
        )));
    }
    dtoh_rows(l.dev, a.q, &mut q_host[..nq])?;
    // The window on the device meanwhile.
    let mut win = a.kv;
    win.host.cpu_part = 1;
    attention::attn_gqa(l, a.h, a.q, win, a.n_ctx, a.sp, n)?;
    partials(&q_host[..nq], &mut part[..np])?;
    // Up behind the window's splits, then the merge.
    let ob = (4 * nq) as u64;
    let pv = a.part.sub(0, ob + (8 * n * nh) as u64)?;
    queue_up(l.dev, super::pod_bytes(&part[..np]), pv)?;
    let host = HostPartial {
        o: pv.sub(0, ob)?,
        ms: pv.sub(ob, (8 * n * nh) as u64)?,
        window: a.kv.host.resident as u64,
    };
    attention::attn_combine(l, a.h, a.n_ctx, a.sp, Some(host), a.out, n)
}

/// Read `dst.len()` f32 of `src` back, waiting for the stream.
fn dtoh_rows(dev: &CudaDevice, src: DeviceView<'_>, dst: &mut [f32]) -> Result<(), CudaError> {
    let v = src.sub(0, 4 * dst.len() as u64)?;
    dev.dtoh(v, dst)
}

/// Queue a copy of `src` (pageable host memory) into `dst` on the stage's stream, behind
/// everything queued before it.
fn queue_up(dev: &CudaDevice, src: &[u8], dst: DeviceView<'_>) -> Result<(), CudaError> {
    dst.expect_len("kv host partials", src.len() as u64)?;
    // SAFETY: `dst` is a checked view of exactly src.len() bytes inside a live arena of
    // `dev`; `src` is pageable host memory, which htod_raw stages before it returns (on HIP
    // it waits), so the host buffer may change once this returns.
    unsafe { dev.htod_raw("kv host partials", dst.ptr(), src) }
}
