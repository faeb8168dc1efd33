//! `CudaStage`: one planned device on a CUDA GPU as a pipeline drives it — its arena, the
//! working buffers bound from the plan's scratch by name, its KV region, the step's inputs,
//! decode passes captured once per token count as CUDA graphs and replayed, the hand-off of
//! hidden states to the next stage, and token picks on the device. Its ops (`forward_ops`)
//! and weight binding (`bind`) are in files of their own.
//! Invariant: after start-up the stage allocates no device memory and its kernels touch only
//! its own arena; a captured graph is replayed only for the token count it was captured for.

use super::handoff::Link;
use super::kv_spill::{KvHostArg, KvSpill};
use super::launch::decode::PickScratch;
use super::launch::{Launcher, Prof, ProfTotals};
use super::options::KernelOptions;
use super::runtime::GpuGraph;
use super::{CudaDevice, CudaError, DeviceArena, DeviceView};
use crate::backend::{Stage, StepKind, WorkBuf};
use crate::sampler::Draw;
use std::collections::HashMap;
use std::sync::Arc;
use strata_schemas::dims::Dims;
use strata_schemas::workset::ARGMAX_BLOCKS;

/// A planned buffer's place in the arena.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Span {
    pub off: u64,
    pub bytes: u64,
}

/// The KV region of a stage: per slot, per KV layer, `cells` K rows then `cells` V rows
/// (the VRAM window); a slot's cells past it in the pinned chunks `host` addresses.
#[derive(Debug, Clone)]
pub(crate) struct KvGeo {
    pub region: Span,
    pub slot_bytes: u64,
    pub row_bytes: u64,
    /// Cells of a slot in VRAM (the whole context unless the plan spills).
    pub cells: u64,
    /// Kernel type code (F16 1, Q8_0 3).
    pub ty: i32,
    /// The spilled cells' kernel argument (layer 0's offsets), `KvHostArg::none()` when
    /// nothing spills.
    pub host: KvHostArg,
}

impl KvGeo {
    /// Byte offsets of KV layer `l`'s K and V rows inside a slot.
    pub fn layer(&self, l: usize) -> (u64, u64) {
        let span = self.cells * self.row_bytes;
        (2 * l as u64 * span, (2 * l as u64 + 1) * span)
    }

    /// The kernels' `KvHost` for KV layer `l`: `host` holds layer 0's K and V offsets inside
    /// a spilled cell (0 and one row for the main layers; past them for the MTP block's).
    pub fn host_arg(&self, l: usize) -> KvHostArg {
        let mut a = self.host;
        if a.spills() {
            let past = (2 * l as u64 * self.row_bytes) as i64;
            a.k_off += past;
            a.v_off += past;
        }
        a
    }

    /// KV layers a slot holds.
    pub fn layers(&self) -> usize {
        let span = self.cells * self.row_bytes;
        if span == 0 {
            0
        } else {
            (self.slot_bytes / (2 * span)) as usize
        }
    }
}

/// The linear-attention state region of a stage (Qwen3-Next): per slot, per linear layer of
/// the stage, the conv state then the recurrent state (f32), then, with MTP speculation,
/// `checkpoints` copies of each slot's state (copy `j` of slot `s` the `s * checkpoints + j`th
/// after the live states) — the layout of the CPU backend's `LinearState` and exactly the
/// bytes the plan's `linear_state` region holds for it.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct LinGeo {
    pub region: Span,
    /// Linear layers on the stage.
    pub layers: usize,
    /// Floats of one layer's conv and recurrent state of one slot.
    pub conv: usize,
    pub rec: usize,
    /// The plan's `prefix_checkpoint` region: one more copy of each slot's state, in the
    /// same layout (none when the plan places no prefix checkpoint).
    pub prefix: Option<Span>,
    /// Checkpoints kept per slot (the plan's `--spec` with `--mtp`; 0 without).
    pub checkpoints: usize,
}

impl LinGeo {
    /// The geometry of `layers` linear layers of `d` for `slots` slots with `checkpoints`
    /// copies each at `region`; an error naming the sizes when the region is short.
    pub fn new(
        d: &Dims,
        layers: usize,
        slots: usize,
        checkpoints: usize,
        region: Span,
    ) -> Result<Self, CudaError> {
        let (conv, rec) = crate::backend::cpu::linear_state::layer_floats(d);
        let g = Self {
            region,
            layers,
            conv,
            rec,
            prefix: None,
            checkpoints,
        };
        let need = 4 * ((1 + checkpoints) * slots * g.slot_floats()) as u64;
        if region.bytes < need || region.off % 16 != 0 {
            return Err(CudaError::Shape {
                op: "bind",
                detail: format!(
                    "the linear_state region holds {} bytes at offset {} but {slots} slots x {layers} linear layers x {} copies (1 + MTP checkpoints) need {need} (16-byte aligned): re-plan with this build's strata-plan",
                    region.bytes, region.off, 1 + checkpoints
                ),
            });
        }
        Ok(g)
    }

    /// Byte offset (in the arena) of checkpoint `j` of `slot` among `slots` slots.
    pub fn checkpoint_off(&self, slots: usize, slot: usize, j: usize) -> u64 {
        let per = 4 * self.slot_floats() as u64;
        self.region.off + (slots + slot * self.checkpoints + j) as u64 * per
    }

    /// Floats of one slot's state (every linear layer of the stage).
    pub fn slot_floats(&self) -> usize {
        self.layers * (self.conv + self.rec)
    }

    /// The same geometry with each slot's prefix checkpoint at `region`; an error naming the
    /// sizes when the region is short.
    pub fn with_prefix(mut self, slots: usize, region: Span) -> Result<Self, CudaError> {
        let need = 4 * (slots * self.slot_floats()) as u64;
        if region.bytes < need || region.off % 16 != 0 {
            return Err(CudaError::Shape {
                op: "bind",
                detail: format!(
                    "the prefix_checkpoint region holds {} bytes at offset {} but {slots} slots x {} linear layers need {need} (16-byte aligned): re-plan with this build's strata-plan",
                    region.bytes, region.off, self.layers
                ),
            });
        }
        self.prefix = Some(region);
        Ok(self)
    }
}

/// A captured decode pass.
pub(crate) struct Graph(GpuGraph);

// SAFETY: a graph is only launched by the stage's owner, one call at a time (`&mut self`);
// moving the stage to another thread moves its graphs with it, and the device binds its
// context (CUDA) or makes itself current (HIP) on the calling thread before each launch.
unsafe impl Send for Graph {}

/// How this stage's passes run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RunFlags {
    pub graphs: bool,
    pub pdl: bool,
    /// Prefill passes of `GEMM_MIN_TOK` tokens or more use the tensor-core products where the
    /// weights allow.
    pub gemm: bool,
    /// Decode attention in one launch (the options ask for it and the model allows it).
    pub fused_attention: bool,
}

/// One planned device on a CUDA GPU.
pub struct CudaStage {
    pub(crate) dev: Arc<CudaDevice>,
    pub(crate) arena: DeviceArena,
    pub(crate) bufs: HashMap<WorkBuf, Span>,
    pub(crate) d: Dims,
    pub(crate) opts: KernelOptions,
    pub(crate) flags: RunFlags,
    pub(crate) attn_factor: f32,
    pub(crate) kv: KvGeo,
    /// The MTP block's KV (one layer, in the plan's `mtp` region), when the stage speculates:
    /// the stage's KV layer after its main full-attention layers.
    pub(crate) mtp_kv: Option<KvGeo>,
    /// Each slot's linear-attention state (no layers for models without linear attention).
    pub(crate) lin: LinGeo,
    pub(crate) max_tok: usize,
    pub(crate) att_splits: usize,
    pub(crate) slots: usize,
    /// The pass being issued.
    pub(crate) kind: StepKind,
    pub(crate) host_in: Vec<i32>,
    /// Captured passes by (kind, token count): decode passes and the MTP block's two kinds of
    /// draft pass, which issue different ops for the same count.
    graphs: HashMap<(StepKind, usize), Graph>,
    pub(crate) prof: Option<Prof>,
    prof_totals: ProfTotals,
    /// The hand-off into this stage (none on the first).
    pub(crate) link_in: Option<Link>,
    /// While binding weights: the model's host view, the tensors placed here (name ->
    /// offset) and the next free bytes of the `tables` and `norms` buffers.
    pub(crate) binder: Option<super::bind::Binder>,
    /// The expert cache, when the plan serves some of this stage's experts from host memory.
    pub(crate) xcache: Option<super::expert_cache::CudaExpertCache>,
    /// The pinned, mapped chunks of the KV cells past the VRAM window (`kv.host` addresses
    /// them), when the plan spills.
    pub(crate) kv_spill: Option<KvSpill>,
}

impl CudaStage {
    /// A stage over `arena` on `dev` with its working buffers at `bufs`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        dev: Arc<CudaDevice>,
        arena: DeviceArena,
        bufs: HashMap<WorkBuf, Span>,
        d: Dims,
        opts: KernelOptions,
        flags: RunFlags,
        attn_factor: f32,
        kv: KvGeo,
        max_tok: usize,
        att_splits: usize,
        slots: usize,
        profile: bool,
        binder: super::bind::Binder,
    ) -> Self {
        Self {
            dev,
            arena,
            bufs,
            d,
            opts,
            flags,
            attn_factor,
            kv,
            mtp_kv: None,
            lin: LinGeo::default(),
            max_tok,
            att_splits,
            slots,
            kind: StepKind::Prefill,
            host_in: vec![0; 3 * max_tok],
            graphs: HashMap::new(),
            prof: profile.then(Prof::default),
            prof_totals: ProfTotals::new(),
            link_in: None,
            xcache: None,
            kv_spill: None,
            binder: Some(binder),
        }
    }

    /// Bind the slots' linear-attention state to `lin` and zero it.
    pub(crate) fn set_linear_state(&mut self, lin: LinGeo) -> Result<(), CudaError> {
        if lin.layers > 0 {
            let bytes = 4 * (self.slots * lin.slot_floats()) as u64;
            for off in std::iter::once(lin.region.off).chain(lin.prefix.map(|p| p.off)) {
                let v = self.view(off, bytes)?;
                self.dev.memset(v, 0)?;
            }
        }
        self.lin = lin;
        Ok(())
    }

    /// Copy `slot`'s linear-attention state into its prefix checkpoint (`save`) or back: one
    /// device-to-device copy on the compute stream, after every pass queued before it.
    /// `Ok(true)` on a stage without linear layers, `Ok(false)` without a checkpoint region.
    fn prefix_checkpoint_copy(&mut self, slot: usize, save: bool) -> Result<bool, CudaError> {
        let lin = self.lin;
        if lin.layers == 0 {
            return Ok(true);
        }
        let Some(ck) = lin.prefix else {
            return Ok(false);
        };
        if slot >= self.slots {
            return Ok(false);
        }
        let b = 4 * lin.slot_floats() as u64;
        let live = self.view(lin.region.off + slot as u64 * b, b)?;
        let copy = self.view(ck.off + slot as u64 * b, b)?;
        let (src, dst) = if save { (live, copy) } else { (copy, live) };
        self.dev.dtod(src, dst)?;
        Ok(true)
    }

    /// The device this stage runs on.
    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    /// Bytes of the stage's arena.
    pub fn arena_bytes(&self) -> u64 {
        self.arena.size()
    }

    /// How the hidden state arrives (`same stream`, `peer copy`, `pinned host`), if it does.
    pub fn handoff_in(&self) -> Option<&'static str> {
        self.link_in.as_ref().map(|l| l.kind())
    }

    /// Whether decode attention runs as one launch per layer.
    pub fn fused_attention(&self) -> bool {
        self.flags.fused_attention
    }

    /// Whether prefill passes of 16 tokens or more may take the tensor-core products.
    pub fn tensor_core_prefill(&self) -> bool {
        self.flags.gemm
    }

    /// Whether the pass being issued is one token per slot on the decode kernels (a decode
    /// pass, or the MTP block's draft pass).
    pub(crate) fn decoding(&self) -> bool {
        matches!(self.kind, StepKind::Decode | StepKind::Draft { .. })
    }

    /// Launchers for the pass being issued: programmatic dependent launch in decode passes
    /// only (measured on the H200: decode 224 -> 233 tok/s with it; prefill passes lost 4%
    /// with it, so they launch in strict order).
    pub(crate) fn launcher(&self) -> Launcher<'_> {
        Launcher {
            dev: &self.dev,
            pdl: self.flags.pdl && self.decoding(),
            prof: self.prof.as_ref(),
            q4k_lanes: self.opts.q4k_lanes,
        }
    }

    /// Launchers in strict stream order (the token picks, after the pass).
    pub(crate) fn plain_launcher(&self) -> Launcher<'_> {
        Launcher {
            pdl: false,
            ..self.launcher()
        }
    }

    /// The bound buffer `b` as a view.
    pub(crate) fn buf(&self, b: WorkBuf) -> Result<DeviceView<'_>, CudaError> {
        let s = self.bufs.get(&b).ok_or_else(|| CudaError::Shape {
            op: "bind",
            detail: format!(
                "the plan's scratch has no `{}` buffer: re-plan with this build's strata-plan",
                b.name()
            ),
        })?;
        self.arena.view(s.off, s.bytes)
    }

    /// `len` bytes of buffer `b` from byte `at`.
    pub(crate) fn buf_at(
        &self,
        b: WorkBuf,
        at: u64,
        len: u64,
    ) -> Result<DeviceView<'_>, CudaError> {
        self.buf(b)?.sub(at, len)
    }

    /// The arena window `[off, off + len)`.
    pub(crate) fn view(&self, off: u64, len: u64) -> Result<DeviceView<'_>, CudaError> {
        self.arena.view(off, len)
    }

    /// The step inputs: token ids, positions and slots (`max_tok` i32 each).
    pub(crate) fn inputs(&self) -> Result<[DeviceView<'_>; 3], CudaError> {
        let m = 4 * self.max_tok as u64;
        Ok([
            self.buf_at(WorkBuf::Inputs, 0, m)?,
            self.buf_at(WorkBuf::Inputs, m, m)?,
            self.buf_at(WorkBuf::Inputs, 2 * m, m)?,
        ])
    }

    /// The pick buffers for `rows` rows: per row ARGMAX_BLOCKS partial values and as many
    /// indices, then a counter and the chosen token per row, for as many rows as the planned
    /// `argmax` buffer holds (every slot's, and with MTP speculation a verify pass's).
    pub(crate) fn pick_scratch(&self, rows: usize) -> Result<PickScratch<'_>, CudaError> {
        let nb = ARGMAX_BLOCKS;
        let held = self.buf(WorkBuf::Argmax)?.len() / (nb * 8 + 8);
        if rows as u64 > held {
            return Err(CudaError::Shape {
                op: "pick",
                detail: format!(
                    "{rows} rows but the plan's `argmax` buffer holds {held}: re-plan with this build's strata-plan"
                ),
            });
        }
        let slots = held;
        let a = WorkBuf::Argmax;
        let (pv, pi) = (0, slots * nb * 4);
        let cnt = pi + slots * nb * 4;
        Ok(PickScratch {
            part_v: self.buf_at(a, pv, slots * nb * 4)?,
            part_i: self.buf_at(a, pi, slots * nb * 4)?,
            counters: self.buf_at(a, cnt, slots * 4)?,
            out: self.buf_at(a, cnt + slots * 4, slots * 4)?,
        })
    }

    /// Copy `out.len()` u32s from `src` back and wait for the stream.
    pub(crate) fn back_u32(&self, src: DeviceView<'_>, out: &mut [u32]) -> Result<(), CudaError> {
        src.expect("pick", "tokens", 4 * out.len() as u64, 4)?;
        // SAFETY: `src` holds out.len() u32s (checked above); dtoh_raw waits for the copy.
        unsafe {
            self.dev
                .dtoh_raw("picked tokens", src.ptr(), super::pod_bytes_mut(out))
        }
    }

    /// Capture a decode pass of `n` tokens.
    fn capture(
        &mut self,
        forward: &mut dyn FnMut(&mut Self) -> Result<(), CudaError>,
    ) -> Result<Graph, CudaError> {
        self.dev.begin_capture()?;
        let r = forward(self);
        let g = self.dev.end_capture();
        r?;
        Ok(Graph(g?))
    }

    /// Profiling: wait for the pass, add each launch's time to the totals.
    fn prof_collect(&mut self) -> Result<(), CudaError> {
        let Some(p) = &self.prof else {
            return Ok(());
        };
        self.dev.synchronize()?;
        let decode = self.decoding();
        for (name, e0, e1) in p.borrow_mut().drain(..) {
            let ms = e0.elapsed_ms(&e1)? as f64;
            let t = self.prof_totals.entry((decode, name)).or_insert((0, 0.0));
            t.0 += 1;
            t.1 += ms;
        }
        Ok(())
    }
}

impl Drop for CudaStage {
    fn drop(&mut self) {
        // No copy or kernel may still use the arena or a pinned staging buffer (the expert
        // cache's copy stream included: a prefetch's copies are waited on only later).
        let _ = self.dev.synchronize();
        if let Some(c) = &self.xcache {
            c.quiesce();
        }
        if self.prof.is_none() {
            return;
        }
        let tot = &self.prof_totals;
        for decode in [false, true] {
            let all: f64 = tot
                .iter()
                .filter(|((dd, _), _)| *dd == decode)
                .map(|(_, v)| v.1)
                .sum();
            eprintln!(
                "profile {}: {:.3} ms in kernels",
                if decode { "decode" } else { "prefill" },
                all
            );
            let mut rows: Vec<_> = tot.iter().filter(|((dd, _), _)| *dd == decode).collect();
            rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
            for ((_, name), (count, ms)) in rows {
                eprintln!(
                    "  {name:<24} {count:>8} launches {ms:>10.3} ms {:>6.1}% {:>8.2} us/launch",
                    100.0 * ms / all.max(1e-12),
                    1000.0 * ms / *count as f64
                );
            }
        }
    }
}

impl Stage for CudaStage {
    fn upload_inputs(
        &mut self,
        kind: StepKind,
        tokens: &[u32],
        slots: &[u32],
        pos: &[u32],
    ) -> Result<(), CudaError> {
        let (n, m) = (slots.len(), self.max_tok);
        if n == 0 || n > m || pos.len() != n || (!tokens.is_empty() && tokens.len() != n) {
            return Err(CudaError::Shape {
                op: "step inputs",
                detail: format!(
                    "{} tokens, {n} slots and {} positions for passes of at most {m}",
                    tokens.len(),
                    pos.len()
                ),
            });
        }
        for i in 0..n {
            self.host_in[i] = tokens.get(i).map_or(0, |&t| t as i32);
            self.host_in[m + i] = pos[i] as i32;
            self.host_in[2 * m + i] = slots[i] as i32;
        }
        self.kind = kind;
        let dst = self.buf_at(WorkBuf::Inputs, 0, 12 * m as u64)?.ptr();
        // SAFETY: `inputs` holds 3 x max_tok i32s (a view of exactly that was taken above);
        // htod_raw returns once the host bytes are staged, so `host_in` may change afterwards.
        unsafe {
            self.dev
                .htod_raw("step inputs", dst, super::pod_bytes(&self.host_in[..]))
        }
    }

    fn run(
        &mut self,
        kind: StepKind,
        n: usize,
        forward: &mut dyn FnMut(&mut Self) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        self.kind = kind;
        let key = (kind, n);
        // A pass that attends spilled KV on the host CPU synchronises mid-pass: uncaptured.
        if self.decoding() && self.flags.graphs && self.prof.is_none() && !self.kv_cpu_pass(n) {
            if !self.graphs.contains_key(&key) {
                let g = match self.capture(forward) {
                    Ok(g) => g,
                    Err(e) if self.flags.pdl => {
                        eprintln!(
                            "warning: capturing a decode step with programmatic dependent launch failed ({e}); capturing it without (as --no-pdl would)"
                        );
                        self.flags.pdl = false;
                        self.capture(forward)?
                    }
                    // HIP graphs have never been exercised on AMD hardware: a failed capture
                    // turns them off for this stage, said once, and the step runs uncaptured.
                    Err(e) if self.dev.vendor() == super::Vendor::Amd => {
                        eprintln!(
                            "warning: capturing a decode step as a HIP graph failed ({e}); decode steps on GPU {} run uncaptured from now on (as --no-graphs would)",
                            self.dev.ordinal()
                        );
                        self.flags.graphs = false;
                        forward(self)?;
                        return self.prof_collect();
                    }
                    Err(e) => return Err(e),
                };
                self.graphs.insert(key, g);
            }
            return self.dev.launch_graph(&self.graphs[&key].0);
        }
        forward(self)?;
        self.prof_collect()
    }

    fn send_hidden(&mut self, next: &mut Self, x: WorkBuf, n: usize) -> Result<(), CudaError> {
        let bytes = (n * self.d.e * 4) as u64;
        let src = self.buf_at(x, 0, bytes)?.ptr();
        let dst = next.buf_at(x, 0, bytes)?.ptr();
        let link = next.link_in.as_ref().ok_or_else(|| CudaError::Shape {
            op: "stage hand-off",
            detail: "the receiving stage has no link".into(),
        })?;
        link.copy(&self.dev, &next.dev, src, dst, bytes)
    }

    fn read_logits(&mut self, rows: usize, out: &mut [f32]) -> Result<(), CudaError> {
        let n = rows * self.d.vocab;
        let src = self.buf_at(WorkBuf::Logits, 0, 4 * n as u64)?.ptr();
        // SAFETY: the logits buffer holds `rows x vocab` floats (a view of exactly that was
        // taken above); dtoh_raw waits for the copy.
        unsafe {
            self.dev
                .dtoh_raw("logits", src, super::pod_bytes_mut(&mut out[..n]))
        }
    }

    fn pick_greedy(&mut self, scratch: &mut [f32], out: &mut [u32]) -> Result<(), CudaError> {
        self.pick_on_device(None, None, scratch, out)
    }

    fn pick_sample(
        &mut self,
        draws: &[Draw],
        scratch: &mut [f32],
        out: &mut [u32],
    ) -> Result<(), CudaError> {
        self.pick_on_device(Some(draws), None, scratch, out)
    }

    fn pick_proc(
        &mut self,
        draws: &[Draw],
        procs: &[crate::pick::RowProc],
        scratch: &mut [f32],
        out: &mut [u32],
    ) -> Result<(), CudaError> {
        self.pick_on_device(Some(draws), Some(procs), scratch, out)
    }

    fn copy_slot(&mut self, from: usize, to: usize, cells: usize) -> Result<bool, CudaError> {
        let (kv, lin) = (self.kv.clone(), self.lin);
        let ctx = kv.cells + self.kv_spill.as_ref().map_or(0, |s| s.layout.per_slot);
        if from == to || from >= self.slots || to >= self.slots || cells as u64 > ctx {
            return Ok(false);
        }
        if let Some(sp) = self.kv_spill.as_mut() {
            // The spilled cells on the host, once every kernel queued so far has passed.
            self.dev.synchronize()?;
            sp.copy_cells(from as u64, to as u64, cells as u64);
        }
        // Device-to-device copies on the compute stream: per full-attention layer (the MTP
        // block's too) the first `cells` K rows and V rows held in VRAM, then the slot's
        // whole linear-attention state.
        for geo in std::iter::once(&kv).chain(self.mtp_kv.as_ref()) {
            let n = cells.min(geo.cells as usize) as u64 * geo.row_bytes;
            let slot_at = |s: usize| geo.region.off + s as u64 * geo.slot_bytes;
            for l in 0..geo.layers() {
                let (k, v) = geo.layer(l);
                for off in [k, v] {
                    if n > 0 {
                        let src = self.view(slot_at(from) + off, n)?;
                        let dst = self.view(slot_at(to) + off, n)?;
                        self.dev.dtod(src, dst)?;
                    }
                }
            }
        }
        if lin.layers > 0 {
            let b = 4 * lin.slot_floats() as u64;
            let src = self.view(lin.region.off + from as u64 * b, b)?;
            let dst = self.view(lin.region.off + to as u64 * b, b)?;
            self.dev.dtod(src, dst)?;
        }
        Ok(true)
    }

    fn sync(&mut self) -> Result<(), CudaError> {
        self.dev.synchronize()
    }

    fn write_buf(&mut self, b: WorkBuf, data: &[f32]) -> Result<(), CudaError> {
        let v = self.buf_at(b, 0, 4 * data.len() as u64)?;
        self.dev.htod(data, v)
    }

    fn save_linear_checkpoint(&mut self, slot: usize) -> Result<bool, CudaError> {
        self.prefix_checkpoint_copy(slot, true)
    }

    fn restore_linear_checkpoint(&mut self, slot: usize) -> Result<bool, CudaError> {
        self.prefix_checkpoint_copy(slot, false)
    }

    /// One device-to-device copy on the compute stream: the slot's checkpoint `keep` (every
    /// linear layer of the stage) over its live state.
    fn rollback_linear(&mut self, slot: usize, keep: usize) -> Result<(), CudaError> {
        let lin = self.lin;
        if lin.layers == 0 {
            return Ok(());
        }
        if slot >= self.slots || keep >= lin.checkpoints {
            return Err(CudaError::Shape {
                op: "rollback_linear",
                detail: format!(
                    "rollback of slot {slot} to verify token {keep}: the stage keeps {} linear-state checkpoints of {} slots (the plan's --spec and --batch)",
                    lin.checkpoints, self.slots
                ),
            });
        }
        let b = 4 * lin.slot_floats() as u64;
        let src = self.view(lin.checkpoint_off(self.slots, slot, keep), b)?;
        let dst = self.view(lin.region.off + slot as u64 * b, b)?;
        self.dev.dtod(src, dst)
    }

    fn read_buf(&mut self, b: WorkBuf, out: &mut [f32]) -> Result<(), CudaError> {
        let v = self.buf_at(b, 0, 4 * out.len() as u64)?;
        self.dev.dtoh(v, out)
    }

    fn expert_counters(&self) -> (u64, u64) {
        self.xcache.as_ref().map_or((0, 0), |c| c.hits_misses())
    }

    fn expert_misses_cpu(&self) -> u64 {
        self.xcache.as_ref().map_or(0, |c| c.misses_cpu())
    }

    fn expert_bytes_streamed(&self) -> u64 {
        self.xcache
            .as_ref()
            .map_or(0, |c| c.counters.bytes_streamed)
    }

    fn routing(&self) -> Option<&crate::routing::RoutingTally> {
        self.xcache.as_ref().map(|c| c.tally())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_schemas::gguf::testutil::tiny_qwen3next;
    use strata_schemas::inventory::HParams;

    fn next_dims() -> Dims {
        let hp = HParams {
            nextn_predict_layers: 0,
            ..tiny_qwen3next()
        };
        Dims::of(&hp)
    }

    #[test]
    fn linear_state_geometry_is_the_planned_bytes_and_a_short_region_is_refused() {
        let d = next_dims();
        // Per layer: conv 3 x (2 x 2 x 16 + 64) floats, recurrent 4 x 16 x 16 floats; the
        // planner's `linear_state_bytes_per_layer` counts the same bytes.
        let per_layer = 4 * (3 * 128 + 4 * 16 * 16) as u64;
        let need = 3 * 2 * per_layer;
        let g = LinGeo::new(
            &d,
            2,
            3,
            0,
            Span {
                off: 256,
                bytes: need,
            },
        )
        .unwrap();
        assert_eq!((g.conv, g.rec), (3 * 128, 4 * 16 * 16));
        assert_eq!(4 * g.slot_floats() as u64, 2 * per_layer);
        let short = Span {
            off: 256,
            bytes: need - 4,
        };
        let e = LinGeo::new(&d, 2, 3, 0, short).unwrap_err().to_string();
        assert!(
            e.contains("re-plan") && e.contains(&need.to_string()),
            "{e}"
        );
        let odd = Span {
            off: 260,
            bytes: need,
        };
        assert!(LinGeo::new(&d, 2, 3, 0, odd).is_err());
        // Two checkpoints per slot: three copies of every slot's state, the checkpoints after
        // the live states in the CPU backend's order (slot-major).
        let three = Span {
            off: 256,
            bytes: 3 * need,
        };
        assert!(LinGeo::new(
            &d,
            2,
            3,
            2,
            Span {
                off: 256,
                bytes: 3 * need - 4
            }
        )
        .is_err());
        let g = LinGeo::new(&d, 2, 3, 2, three).unwrap();
        let per = 2 * per_layer;
        assert_eq!(g.checkpoint_off(3, 0, 0), 256 + 3 * per);
        assert_eq!(g.checkpoint_off(3, 1, 1), 256 + (3 + 3) * per);
        assert_eq!(g.checkpoint_off(3, 2, 1) + per, 256 + 3 * need);
    }
}
