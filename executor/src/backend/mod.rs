//! The backend seam: the handful of operations a forward pass is written in ([`Ops`]), and
//! what a pipeline needs of one planned device's backend to drive a step ([`Stage`]). A
//! model's forward pass (`model::*`) is written once over `Ops`; each backend implements it
//! (`cpu` plainly, as the reference; `cuda` with its fused kernels, graphs and launch tricks
//! kept private).
//! Invariant: ops read and write only the named working buffers they are given (bound from
//! the plan's scratch by [`WorkBuf`] name), the weights bound at start-up, and the stage's
//! own KV; no op allocates or sizes memory, and every op checks its buffers against the rows
//! it is asked for before it starts. `view`, `pcie` and `kernel_cache` are the vendor-neutral
//! pieces the GPU backends share (bounds-checked device views, the PCIe link from sysfs, the
//! on-disk cache of compiled kernels).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "hip")]
pub mod hip;
pub mod kernel_cache;
pub mod pcie;
pub mod view;

pub use strata_schemas::workset::WorkBuf;

/// What a forward step carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StepKind {
    /// Consecutive prompt tokens of one slot (positions ascending).
    Prefill,
    /// One token for each of several distinct slots.
    Decode,
    /// The MTP block's draft pass: one token for each of several distinct slots through the
    /// block alone (what `Decode` is to the main layers), `chained` when it drafts from the
    /// block's own last hidden state rather than the main model's (another final norm). A
    /// backend that records decode passes per token count records each of these apart, since
    /// they issue other ops.
    Draft { chained: bool },
    /// A speculative step's verify pass: one slot's token and its drafts (positions
    /// ascending). Linear attention runs token by token (as decode does, so the result is
    /// the same as decoding them one at a time) and keeps the slot's state after each of the
    /// first tokens, so [`Stage::rollback_linear`] can drop the rejected ones.
    Verify,
    /// A mixed pass (chunked prefill beside decoding): rows `0..prefill` are consecutive
    /// prompt tokens of one slot (positions ascending), every row after them one decode token
    /// of a distinct other slot. Row-wise ops run once over every row; attention and linear
    /// attention give the prefill rows what a [`StepKind::Prefill`] pass would and each decode
    /// row what a [`StepKind::Decode`] pass would (sub-ranges of the same buffers), so the
    /// results equal the two passes run apart. Never recorded as a graph.
    Mixed { prefill: usize },
}

impl StepKind {
    /// Whether the pass carries prompt rows (a prefill or a mixed pass): what decides the
    /// prefill-sized choices (tensor-core products, expert misses fetched rather than
    /// computed on the host).
    pub fn prefills(self) -> bool {
        matches!(self, StepKind::Prefill | StepKind::Mixed { .. })
    }
}

/// The attention op of one layer: per-head RMSNorm of Q and K (when the model has it),
/// rotary embedding, the store of K and V into the stage's KV at each token's (slot,
/// position), then causal attention of each token over its slot's cells `0..=pos`.
#[derive(Debug, Clone, Copy)]
pub struct Attention<V> {
    /// The layer's index among the stage's KV layers (its place in the stage's KV).
    pub kv_layer: usize,
    pub q: WorkBuf,
    pub k: WorkBuf,
    pub v: WorkBuf,
    pub q_norm: Option<V>,
    pub k_norm: Option<V>,
    /// Attention output: `n x n_head x head_dim_v`.
    pub out: WorkBuf,
}

/// The router of a MoE layer: `xn = RMSNorm(x) * norm`, router logits `W xn`, softmax over
/// every expert, the top-k (ties to the lower index), renormalised when the model says so.
#[derive(Debug, Clone, Copy)]
pub struct Route<M, V> {
    /// The residual stream it normalises.
    pub x: WorkBuf,
    pub norm: V,
    pub router: M,
    pub xn: WorkBuf,
    /// Chosen experts (u32) and their weights (f32), `n x k`.
    pub ids: WorkBuf,
    pub wts: WorkBuf,
}

/// The Gated DeltaNet core of one linear-attention layer (Qwen3-Next), after the `attn_qkv`,
/// `attn_gate` and `ssm_ba` projections: causal depthwise conv1d + SiLU over `qkv` with the
/// slot's rolling conv state, l2-normalised q and k heads, the gates `beta = sigmoid(b)`,
/// `g = ssm_a * softplus(a + dt_bias)`, the gated delta rule over the slot's recurrent state,
/// then `out = norm * RMSNorm(o) * silu(z)` per value head (see docs/QWEN3NEXT.md). The
/// state of a slot is zeroed by its token at position 0 (a new sequence).
#[derive(Debug, Clone, Copy)]
pub struct LinearAttention<V> {
    /// The layer's index among the stage's linear-attention layers (its place in the stage's
    /// linear state).
    pub lin_layer: usize,
    pub qkv: WorkBuf,
    pub z: WorkBuf,
    pub ba: WorkBuf,
    /// `ssm_conv1d` as f32, conv channels x conv width.
    pub conv: V,
    pub dt_bias: V,
    pub ssm_a: V,
    /// The gated norm's weights (`ssm_norm`, one value head).
    pub norm: V,
    /// Output: `n x value width`.
    pub out: WorkBuf,
}

/// A shared expert (Qwen3-Next): `y += sigmoid(gate_inp . xn) * down(silu(gate xn) * up xn)`.
#[derive(Debug, Clone, Copy)]
pub struct SharedFfn<M, V> {
    /// `ffn_gate_inp_shexp`: one row of the hidden width.
    pub gate_inp: V,
    pub gate: M,
    pub up: M,
    pub down: M,
}

/// The operations of a forward pass on one planned device. Buffers hold rows of f32 (`n`
/// rows of the width the op implies) unless said otherwise.
pub trait Ops {
    /// A weight matrix bound at start-up (`rows x cols` of some ggml type).
    type Mat: Copy + std::fmt::Debug;
    /// A vector of f32 bound at start-up (a norm's weights).
    type Vector: Copy + std::fmt::Debug;
    /// One layer's routed experts, wherever the backend keeps them.
    type Experts: Copy + std::fmt::Debug;
    type Error: std::error::Error + Send + Sync + 'static;

    /// Start a pass of `n` tokens whose inputs were uploaded ([`Stage::upload_inputs`]).
    fn pass_start(&mut self, n: usize) -> Result<(), Self::Error>;
    /// `out[i] = table[token i]` for the pass's tokens.
    fn embed(&mut self, table: Self::Mat, out: WorkBuf, n: usize) -> Result<(), Self::Error>;
    /// `out[i] = RMSNorm(x[first + i]) * w` for `i < n`.
    fn rms_norm(
        &mut self,
        x: WorkBuf,
        first: usize,
        w: Self::Vector,
        out: WorkBuf,
        n: usize,
    ) -> Result<(), Self::Error>;
    /// `y_j = W_j x` for every `(W_j, y_j)`; every `W_j` takes x's width.
    fn project(
        &mut self,
        x: WorkBuf,
        outs: &[(Self::Mat, WorkBuf)],
        n: usize,
    ) -> Result<(), Self::Error>;
    /// `y += W x`.
    fn project_add(
        &mut self,
        w: Self::Mat,
        x: WorkBuf,
        y: WorkBuf,
        n: usize,
    ) -> Result<(), Self::Error>;
    /// See [`Attention`].
    fn attention(&mut self, a: &Attention<Self::Vector>, n: usize) -> Result<(), Self::Error>;
    /// See [`Route`].
    fn route(&mut self, r: &Route<Self::Mat, Self::Vector>, n: usize) -> Result<(), Self::Error>;
    /// `y[i] += sum_j wts[i][j] * down_e(silu(gate_e xn[i]) * up_e xn[i])` over token i's
    /// chosen experts `e = ids[i][j]` of `layer` (the model's layer index).
    #[allow(clippy::too_many_arguments)]
    fn experts(
        &mut self,
        layer: u32,
        e: &Self::Experts,
        xn: WorkBuf,
        ids: WorkBuf,
        wts: WorkBuf,
        y: WorkBuf,
        n: usize,
    ) -> Result<(), Self::Error>;
    /// A dense SwiGLU FFN: `y += down(silu(gate xn) * up xn)`.
    fn dense_ffn(
        &mut self,
        gate: Self::Mat,
        up: Self::Mat,
        down: Self::Mat,
        xn: WorkBuf,
        y: WorkBuf,
        n: usize,
    ) -> Result<(), Self::Error>;
    /// Split a gated query projection `qg` (per head the query then its gate, each
    /// `head_dim`) into `q` and `gate` (`n x n_head x head_dim` each).
    fn split_query_gate(
        &mut self,
        qg: WorkBuf,
        q: WorkBuf,
        gate: WorkBuf,
        n: usize,
    ) -> Result<(), Self::Error>;
    /// `x *= sigmoid(gate)` over `n` rows of the attention output's width.
    fn sigmoid_gate(&mut self, x: WorkBuf, gate: WorkBuf, n: usize) -> Result<(), Self::Error>;
    /// See [`LinearAttention`].
    fn linear_attention(
        &mut self,
        a: &LinearAttention<Self::Vector>,
        n: usize,
    ) -> Result<(), Self::Error>;
    /// `out[i] = [a[i], b[i]]`: two rows of the hidden width side by side (the MTP block's
    /// `eh_proj` input).
    fn concat_rows(
        &mut self,
        a: WorkBuf,
        b: WorkBuf,
        out: WorkBuf,
        n: usize,
    ) -> Result<(), Self::Error>;
    /// See [`SharedFfn`].
    fn shared_expert(
        &mut self,
        s: &SharedFfn<Self::Mat, Self::Vector>,
        xn: WorkBuf,
        y: WorkBuf,
        n: usize,
    ) -> Result<(), Self::Error>;
}

/// How the weights a forward pass names are bound on a backend (at start-up only).
pub trait Bind: Ops {
    /// The tensor `name` as a matrix of `rows x cols` (GGUF dims `[cols, rows]`).
    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Self::Mat, Self::Error>;
    /// The tensor `name` (dims `[n]`) as f32.
    fn vector(&mut self, name: &str, n: usize) -> Result<Self::Vector, Self::Error>;
    /// The tensor `name` (dims `[cols, rows]`) as `rows x cols` f32, row-major (small 2-D
    /// tensors an op reads whole, such as a conv's taps).
    fn table(&mut self, name: &str, rows: usize, cols: usize) -> Result<Self::Vector, Self::Error>;
    /// The routed experts of `layer` (the stacks `blk.L.ffn_{gate,up,down}_exps.weight`, of
    /// `n_expert` matrices: gate/up `f x e`, down `e x f`), wherever this device keeps them.
    fn experts_of(&mut self, layer: u32) -> Result<Self::Experts, Self::Error>;
    /// Whether the model has a tensor called `name`.
    fn has(&self, name: &str) -> bool;
}

/// One planned device's backend as a pipeline drives it.
pub trait Stage: Ops {
    /// Put the step's inputs where the pass reads them: token `i` of slot `slots[i]` at
    /// position `pos[i]` (`tokens` may be empty on stages that take hidden states).
    fn upload_inputs(
        &mut self,
        kind: StepKind,
        tokens: &[u32],
        slots: &[u32],
        pos: &[u32],
    ) -> Result<(), Self::Error>;
    /// Run one pass of `kind` over `n` tokens: `forward` issues its ops. A backend may record
    /// the ops of a decode or draft pass once per (`kind`, `n`) and replay them (CUDA
    /// graphs); `forward` must then issue the same ops for the same `kind` and `n`.
    fn run(
        &mut self,
        kind: StepKind,
        n: usize,
        forward: &mut dyn FnMut(&mut Self) -> Result<(), Self::Error>,
    ) -> Result<(), Self::Error>;
    /// Hand the first `n` rows of `x` to the next stage's `x`.
    fn send_hidden(&mut self, next: &mut Self, x: WorkBuf, n: usize) -> Result<(), Self::Error>;
    /// Copy the first `rows` rows of the logits buffer to `out` (`rows x vocab`), after every
    /// queued op is done.
    fn read_logits(&mut self, rows: usize, out: &mut [f32]) -> Result<(), Self::Error>;
    /// The argmax of each of the first `out.len()` logit rows (lowest id on ties, NaN never
    /// wins). Backends that pick on their device override it; this reads the logits back.
    fn pick_greedy(&mut self, scratch: &mut [f32], out: &mut [u32]) -> Result<(), Self::Error> {
        let rows = out.len();
        let v = scratch.len() / rows.max(1);
        self.read_logits(rows, &mut scratch[..rows * v])?;
        crate::sampler::argmax_rows(&scratch[..rows * v], v, out);
        Ok(())
    }
    /// `out[i]` = the token `draws[i]` picks from logit row `i`. Backends that sample on their
    /// device override it; this reads the logits back and samples on the host.
    fn pick_sample(
        &mut self,
        draws: &[crate::sampler::Draw],
        scratch: &mut [f32],
        out: &mut [u32],
    ) -> Result<(), Self::Error> {
        let rows = out.len();
        let v = scratch.len() / rows.max(1);
        self.read_logits(rows, &mut scratch[..rows * v])?;
        crate::sampler::sample_rows(&scratch[..rows * v], v, &draws[..rows], out);
        Ok(())
    }
    /// `out[i]` = the token `draws[i]` picks from logit row `i` after `procs[i]` (the
    /// row's mask, edits and `min_p`; see [`crate::pick::RowProc`]). Backends that sample on
    /// their device override it (falling back to this for a row they cannot process there);
    /// this, the reference, reads the logits back and processes and picks on the host.
    fn pick_proc(
        &mut self,
        draws: &[crate::sampler::Draw],
        procs: &[crate::pick::RowProc],
        scratch: &mut [f32],
        out: &mut [u32],
    ) -> Result<(), Self::Error> {
        let rows = out.len();
        let v = scratch.len() / rows.max(1);
        self.read_logits(rows, &mut scratch[..rows * v])?;
        crate::pick::pick_rows(&mut scratch[..rows * v], v, &draws[..rows], procs, out);
        Ok(())
    }
    /// Copy slot `from`'s first `cells` context cells (every KV layer of this stage) and its
    /// whole linear-attention state into slot `to`, so `to` continues `from`'s sequence from
    /// position `cells` (`n` choices of one prompt prefilled once). `Ok(false)`, with nothing
    /// written, where this backend cannot (the caller prefills instead).
    fn copy_slot(&mut self, from: usize, to: usize, cells: usize) -> Result<bool, Self::Error> {
        let _ = (from, to, cells);
        Ok(false)
    }
    /// Wait for everything queued.
    fn sync(&mut self) -> Result<(), Self::Error>;
    /// Copy `data` into working buffer `b` from its first element (op checks and debugging;
    /// integer buffers take their values' bits).
    fn write_buf(&mut self, b: WorkBuf, data: &[f32]) -> Result<(), Self::Error>;
    /// Copy the first `out.len()` elements of working buffer `b` out, after every queued op is
    /// done.
    fn read_buf(&mut self, b: WorkBuf, out: &mut [f32]) -> Result<(), Self::Error>;
    /// After a [`StepKind::Verify`] pass of `slot`, set its linear-attention state to what it
    /// was after the pass's token `keep` (0-based; the tokens after it were rejected drafts).
    /// `keep` below the number of checkpoints the backend keeps per slot. Stages without
    /// linear attention have nothing to roll back; backends that cannot checkpoint refuse.
    fn rollback_linear(&mut self, slot: usize, keep: usize) -> Result<(), Self::Error>;
    /// Save `slot`'s linear-attention state into its prefix checkpoint (the plan's
    /// `prefix_checkpoint` region), after every op queued before. `Ok(true)` also on a stage
    /// without linear layers (nothing to keep); `Ok(false)`, nothing written, where this stage
    /// keeps no prefix checkpoint.
    fn save_linear_checkpoint(&mut self, slot: usize) -> Result<bool, Self::Error> {
        let _ = slot;
        Ok(false)
    }
    /// Set `slot`'s linear-attention state to its prefix checkpoint (whatever the last
    /// [`Stage::save_linear_checkpoint`] of the slot saved); the same answers.
    fn restore_linear_checkpoint(&mut self, slot: usize) -> Result<bool, Self::Error> {
        let _ = slot;
        Ok(false)
    }
    /// Expert cache counters (hits, misses) since start-up.
    fn expert_counters(&self) -> (u64, u64) {
        (0, 0)
    }
    /// Expert-cache misses computed on the host CPU instead of streamed (the hybrid path)
    /// since start-up.
    fn expert_misses_cpu(&self) -> u64 {
        0
    }
    /// Bytes of expert weights copied from host memory into the device's cache for misses
    /// since start-up.
    fn expert_bytes_streamed(&self) -> u64 {
        0
    }
    /// The router's picks counted since start-up (for `strata-exec profile`), where this
    /// backend counts them.
    fn routing(&self) -> Option<&crate::routing::RoutingTally> {
        None
    }
}
