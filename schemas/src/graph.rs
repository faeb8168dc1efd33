//! The forward graph: per-architecture ops of one forward step and the transient buffers each
//! reads and writes, with lifetimes derived from the def-use graph. It sizes what no executor
//! binds: the scratch estimate of a model that no backend of this build runs (the planner's
//! fallback; `workset.rs` is what the executor binds, and the planner packs that wherever a
//! backend runs the model) and the per-slot session bytes.
//! Invariant: a buffer lives from the op that first writes it to the last op that reads it
//! (widened over the whole layer stack when its value is carried from layer to layer).
//!
//! Shape of a step. Ops run in the order listed: `inp.upload`, `embed`, then one
//! *representative* layer of each kind (qwen3next: the gated delta-net layer, then the
//! full-attention layer; qwen3moe: the full-attention layer), then the head. The real model
//! runs its layers by repeating these sections; transient buffers die at the end of their
//! layer, so the scratch of a step is the max over layer kinds packed once, plus the head.
//! Buffers whose value crosses a layer boundary (`hidden`, the step inputs read by every
//! layer) are kept live across the whole layer span so any interleaving of layer kinds is safe.
//!
//! Weights, the KV cache, linear-attention state and per-slot session buffers are not
//! scratch: ops that touch them (`attn.kv_store`, `linear.conv`, `linear.delta_net`,
//! `head.sample`) read and write those planned regions directly.
//! Dequantization scratch for quantized matmuls is not needed: the kernels dequantize weight
//! blocks on the fly in registers/shared memory, so no buffer is listed for it.
//! Attention masks are not materialized either: the attention kernels derive causality and
//! sequence membership from `inp.pos` and `inp.seq`.
//!
//! Buffer sizes are f32 unless noted (`i32`/`u32` index buffers are 4 B per element) and are
//! rounded up to [`SCRATCH_ALIGN`].

use crate::inventory::{HParams, InventoryError};
use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::visit::EdgeRef;
use std::collections::BTreeMap;

/// Alignment of every scratch buffer's size and offset, in bytes.
pub const SCRATCH_ALIGN: u64 = 256;
/// KV cells one split covers in split-KV decode attention at the longest context (the CUDA
/// decode kernel's sub-chunk; more splits keep more of the GPU busy at batch 1).
pub const SPLIT_KV_CELLS_PER_SPLIT: u64 = 16;
/// Most KV splits per (token, head).
pub const SPLIT_KV_MAX_SPLITS: u64 = 64;
/// Split-KV attention is used only when a step has at most this many query tokens; above
/// it the grid over (tokens x heads) already fills the GPU and attention runs unsplit.
pub const SPLIT_KV_MAX_TOKENS: u64 = 64;
/// Tokens per chunk of the chunked gated delta-net (prefill).
pub const DELTA_NET_CHUNK: u64 = 64;
/// Sampler candidates kept per slot (top-k before top-p / min-p).
pub const SAMPLER_CANDIDATES: u64 = 256;
/// Token-history ring per slot (repetition penalties, on-device stop-token checks).
pub const TOKEN_HISTORY: u64 = 256;
/// Architectures this module describes.
pub const SUPPORTED_ARCHS: &str = "qwen3moe, qwen3next";

const F32: u64 = 4;
const I32: u64 = 4;

/// What sizes one step's scratch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphParams {
    /// Query tokens in the step: the ubatch for prefill, `slots * (1 + spec)` for decode.
    pub tokens: u64,
    /// Rows that need logits: one per slot times `(1 + spec)` in decode, one per sequence in
    /// prefill, or every position when the caller asks for all logits. At most `tokens`.
    pub logits_rows: u64,
    /// KV cells the longest sequence of the step attends to (sizes split-KV partials).
    pub ctx_cells: u64,
}

/// One scratch buffer with its lifetime (op indices, inclusive).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferSpec {
    /// Stable, unique name the executor binds by (`hidden`, `attn.q`, `linear.z`, ...).
    pub name: String,
    /// Size, a multiple of [`SCRATCH_ALIGN`] (0 for an empty buffer).
    pub bytes: u64,
    pub first_op: u32,
    pub last_op: u32,
}

/// The ops of one forward step, in execution order, and the scratch buffers they use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardGraph {
    pub ops: Vec<String>,
    pub buffers: Vec<BufferSpec>,
}

impl ForwardGraph {
    /// A buffer by name.
    pub fn buffer(&self, name: &str) -> Option<&BufferSpec> {
        self.buffers.iter().find(|b| b.name == name)
    }

    /// Index of an op by name.
    pub fn op_index(&self, name: &str) -> Option<u32> {
        self.ops
            .iter()
            .position(|o| o == name)
            .and_then(|i| u32::try_from(i).ok())
    }

    /// Sum of all buffer sizes (what scratch would take with no reuse).
    pub fn total_unpacked_bytes(&self) -> u64 {
        self.buffers
            .iter()
            .fold(0u64, |a, b| a.saturating_add(b.bytes))
    }

    /// Largest sum of bytes live at one op: a lower bound for any packing.
    pub fn peak_live_bytes(&self) -> u64 {
        (0..self.ops.len() as u64)
            .map(|op| {
                self.buffers
                    .iter()
                    .filter(|b| u64::from(b.first_op) <= op && op <= u64::from(b.last_op))
                    .fold(0u64, |a, b| a.saturating_add(b.bytes))
            })
            .max()
            .unwrap_or(0)
    }
}

/// KV splits per (token, head) for split-KV flash attention at these parameters: 1 (no
/// split, no partials buffer) above [`SPLIT_KV_MAX_TOKENS`] query tokens, else
/// `ceil(ctx_cells / 16)` clamped to `1..=64`.
pub fn kv_splits(p: &GraphParams) -> u64 {
    if p.tokens > SPLIT_KV_MAX_TOKENS {
        return 1;
    }
    p.ctx_cells
        .div_ceil(SPLIT_KV_CELLS_PER_SPLIT)
        .clamp(1, SPLIT_KV_MAX_SPLITS)
}

/// Parallel chunk lanes of the chunked delta-net: `ceil(tokens / 64)`. The executor runs at
/// most this many 64-token chunks (each of one sequence) at once and loops if a ubatch's
/// sequences split into more chunks.
pub fn delta_net_lanes(p: &GraphParams) -> u64 {
    p.tokens.div_ceil(DELTA_NET_CHUNK).max(1)
}

/// The forward graph of one step of `arch` at `p`.
pub fn forward_graph(
    arch: &str,
    hp: &HParams,
    p: &GraphParams,
) -> Result<ForwardGraph, InventoryError> {
    let next = match arch {
        "qwen3moe" => false,
        "qwen3next" => true,
        other => {
            return Err(InventoryError::UnsupportedArch {
                arch: other.to_string(),
                supported: SUPPORTED_ARCHS.to_string(),
            })
        }
    };
    check_params(hp, p, next)?;
    let mut g = Builder::default();
    let t = p.tokens;
    let r = p.logits_rows;
    let e = hp.n_embd;

    // Prologue: host uploads the step inputs, then the embedding lookup.
    g.section("inp", false);
    let tokens = g.buf("inp.tokens", &[t], I32)?; // i32 token ids
    let pos = g.buf("inp.pos", &[t], I32)?; // i32 positions
    let seq = g.buf("inp.seq", &[t], I32)?; // i32 slot index of each token
    let out_rows = g.buf("inp.out_rows", &[r], I32)?; // i32 rows that need logits
    g.op("inp.upload", &[], &[tokens, pos, seq, out_rows], &[])?;
    let hidden = g.buf("hidden", &[t, e], F32)?; // residual stream
    g.op("embed", &[tokens], &[hidden], &[])?;

    let inputs = Inputs { hidden, pos, seq };
    if next {
        // qwen3next runs three delta-net layers per full-attention layer.
        linear_layer(&mut g, hp, p, inputs)?;
    }
    attention_layer(&mut g, hp, p, inputs, next)?;

    // Head: final norm of the rows that need logits, the LM head, sampling.
    g.section("head", false);
    let norm_out = g.buf("head.norm_out", &[r, e], F32)?;
    g.op("head.output_norm", &[hidden, out_rows], &[norm_out], &[])?;
    let logits = g.buf("head.logits", &[r, hp.n_vocab], F32)?;
    g.op("head.lm_head", &[norm_out], &[logits], &[])?;
    // Sampler state (candidates, RNG, history) is per-slot session memory, not scratch.
    let sampled = g.buf("head.sampled", &[r], I32)?; // i32 sampled ids
    g.op("head.sample", &[logits], &[sampled], &[])?;
    g.op("head.readback", &[sampled], &[], &[])?;

    g.finish()
}

#[derive(Clone, Copy)]
struct Inputs {
    hidden: usize,
    pos: usize,
    seq: usize,
}

/// Full-attention layer (GQA, per-head q/k RMS norm, RoPE, flash attention) + MoE.
fn attention_layer(
    g: &mut Builder,
    hp: &HParams,
    p: &GraphParams,
    inp: Inputs,
    gated_q: bool,
) -> Result<(), InventoryError> {
    let t = p.tokens;
    let e = hp.n_embd;
    let q_width = hp.n_head * hp.head_dim_k * if gated_q { 2 } else { 1 };
    g.section("attn", true);
    let norm_out = g.buf("attn.norm_out", &[t, e], F32)?;
    g.op("attn.norm", &[inp.hidden], &[norm_out], &[])?;
    // qwen3next: per head, [query | gate] of head_dim each (the gate multiplies the output).
    let q = g.buf("attn.q", &[t, q_width], F32)?;
    g.op("attn.q_proj", &[norm_out], &[q], &[])?;
    let k = g.buf("attn.k", &[t, hp.n_head_kv, hp.head_dim_k], F32)?;
    g.op("attn.k_proj", &[norm_out], &[k], &[])?;
    let v = g.buf("attn.v", &[t, hp.n_head_kv, hp.head_dim_v], F32)?;
    g.op("attn.v_proj", &[norm_out], &[v], &[])?;
    g.op("attn.qk_norm", &[q, k], &[q, k], &[])?;
    g.op("attn.rope", &[q, k, inp.pos], &[q, k], &[])?;
    // Writes K and V into the planned KV cache (not scratch).
    g.op("attn.kv_store", &[k, v, inp.pos, inp.seq], &[], &[])?;
    let out = g.buf("attn.out", &[t, hp.n_head, hp.head_dim_v], F32)?;
    let splits = kv_splits(p);
    if splits > 1 {
        // Per (token, head, split): head_dim_v partial output + running max + running sum.
        let partials = g.buf(
            "attn.fa_partials",
            &[t, hp.n_head, splits, hp.head_dim_v + 2],
            F32,
        )?;
        g.op("attn.flash_split", &[q, inp.pos, inp.seq], &[partials], &[])?;
        g.op("attn.flash_combine", &[partials], &[out], &[])?;
    } else {
        g.op("attn.flash", &[q, inp.pos, inp.seq], &[out], &[])?;
    }
    if gated_q {
        g.op("attn.out_gate", &[out, q], &[out], &[])?;
    }
    let proj = g.buf("attn.proj", &[t, e], F32)?;
    g.op("attn.o_proj", &[out], &[proj], &[])?;
    g.op("attn.residual", &[proj, inp.hidden], &[inp.hidden], &[])?;
    moe_block(g, hp, p, inp, "attn")
}

/// Gated delta-net linear-attention layer (qwen3next) + MoE.
fn linear_layer(
    g: &mut Builder,
    hp: &HParams,
    p: &GraphParams,
    inp: Inputs,
) -> Result<(), InventoryError> {
    let Some(s) = &hp.ssm else {
        return Err(bad("ssm", "qwen3next needs the ssm.* parameters"));
    };
    let t = p.tokens;
    let e = hp.n_embd;
    g.section("linear", true);
    let norm_out = g.buf("linear.norm_out", &[t, e], F32)?;
    g.op("linear.norm", &[inp.hidden], &[norm_out], &[])?;
    // q, k (group_count x state_size each) and v (inner_size), before the conv.
    let qkv = g.buf("linear.qkv_mixed", &[t, s.conv_channels()], F32)?;
    g.op("linear.qkv_proj", &[norm_out], &[qkv], &[])?;
    let z = g.buf("linear.z", &[t, s.inner_size], F32)?; // output gate
    g.op("linear.z_proj", &[norm_out], &[z], &[])?;
    let ba = g.buf("linear.ba_raw", &[t, 2 * s.time_step_rank], F32)?;
    g.op("linear.ba_proj", &[norm_out], &[ba], &[])?;
    let beta = g.buf("linear.beta", &[t, s.time_step_rank], F32)?; // sigmoid(b)
    let alpha = g.buf("linear.alpha", &[t, s.time_step_rank], F32)?; // A * softplus(a + dt)
    g.op("linear.gates", &[ba], &[beta, alpha], &[])?;
    // Depthwise causal conv + SiLU; reads and updates the slot's conv state (linear state).
    let conv = g.buf("linear.conv_out", &[t, s.conv_channels()], F32)?;
    g.op("linear.conv", &[qkv, inp.seq], &[conv], &[])?;
    g.op("linear.qk_l2norm", &[conv], &[conv], &[])?;
    // The kernel broadcasts the group_count key heads over the time_step_rank value heads;
    // no repeated q/k copy is made. Chunked prefill workspace per lane and value head: the
    // 64 x 64 intra-chunk attention-like matrix plus 64 x head_v_dim corrected values.
    let chunk = DELTA_NET_CHUNK;
    let ws_per_head = chunk * chunk + chunk * s.head_v_dim();
    let ws = g.buf(
        "linear.chunk_ws",
        &[delta_net_lanes(p), s.time_step_rank, ws_per_head],
        F32,
    )?;
    let out = g.buf("linear.delta_out", &[t, s.inner_size], F32)?;
    // Reads and updates the slot's recurrent state (linear state region).
    g.op(
        "linear.delta_net",
        &[conv, beta, alpha, inp.seq],
        &[out],
        &[ws],
    )?;
    // Per-head RMS norm times SiLU(z), in place.
    g.op("linear.out_norm_gate", &[out, z], &[out], &[])?;
    let proj = g.buf("linear.proj", &[t, e], F32)?;
    g.op("linear.out_proj", &[out], &[proj], &[])?;
    g.op("linear.residual", &[proj, inp.hidden], &[inp.hidden], &[])?;
    moe_block(g, hp, p, inp, "linear")
}

/// Routed experts (top-k of n_expert, SwiGLU) plus the optional shared expert.
fn moe_block(
    g: &mut Builder,
    hp: &HParams,
    p: &GraphParams,
    inp: Inputs,
    prefix: &str,
) -> Result<(), InventoryError> {
    let t = p.tokens;
    let e = hp.n_embd;
    let k = hp.n_expert_used;
    let n = |s: &str| format!("{prefix}.{s}");
    let norm_out = g.buf(&n("ffn_norm_out"), &[t, e], F32)?;
    g.op(&n("ffn_norm"), &[inp.hidden], &[norm_out], &[])?;
    let logits = g.buf(&n("router_logits"), &[t, hp.n_expert], F32)?;
    g.op(&n("router"), &[norm_out], &[logits], &[])?;
    let ids = g.buf(&n("topk_ids"), &[t, k], I32)?; // i32
    let weights = g.buf(&n("topk_weights"), &[t, k], F32)?;
    g.op(&n("topk"), &[logits], &[ids, weights], &[])?;
    // Rows grouped by expert: per-expert start offsets (u32, n_expert + 1), the source token
    // of each sorted row (u32) and the sorted row of each (token, choice) (u32).
    let offsets = g.buf(&n("expert_offsets"), &[hp.n_expert + 1], I32)?;
    let gather = g.buf(&n("expert_gather_idx"), &[t, k], I32)?;
    let scatter = g.buf(&n("expert_scatter_idx"), &[t, k], I32)?;
    g.op(&n("expert_sort"), &[ids], &[offsets, gather, scatter], &[])?;

    let mut combine_reads = Vec::new();
    if hp.n_ff_shexp > 0 {
        let sg = g.buf(&n("shexp_gate"), &[t, hp.n_ff_shexp], F32)?;
        g.op(&n("shexp_gate_proj"), &[norm_out], &[sg], &[])?;
        let su = g.buf(&n("shexp_up"), &[t, hp.n_ff_shexp], F32)?;
        g.op(&n("shexp_up_proj"), &[norm_out], &[su], &[])?;
        let sa = g.buf(&n("shexp_act"), &[t, hp.n_ff_shexp], F32)?;
        g.op(&n("shexp_swiglu"), &[sg, su], &[sa], &[])?;
        let so = g.buf(&n("shexp_out"), &[t, e], F32)?;
        g.op(&n("shexp_down_proj"), &[sa], &[so], &[])?;
        // Per-token scalar gate of the shared expert (sigmoid of n_embd -> 1).
        let ss = g.buf(&n("shexp_scale"), &[t], F32)?;
        g.op(&n("shexp_gate_inp"), &[norm_out], &[ss], &[])?;
        combine_reads.extend([so, ss]);
    }

    // Grouped GEMMs read their input rows of ffn_norm_out through the gather index: the
    // routed input is not copied.
    let rows = [t, k, hp.n_ff_exp];
    let xg = g.buf(&n("expert_gate"), &rows, F32)?;
    g.op(
        &n("expert_gate_proj"),
        &[norm_out, offsets, gather],
        &[xg],
        &[],
    )?;
    let xu = g.buf(&n("expert_up"), &rows, F32)?;
    g.op(
        &n("expert_up_proj"),
        &[norm_out, offsets, gather],
        &[xu],
        &[],
    )?;
    let xa = g.buf(&n("expert_act"), &rows, F32)?;
    g.op(&n("expert_swiglu"), &[xg, xu], &[xa], &[])?;
    // Down projection per (token, choice) in sorted order; reduced in a fixed order below
    // (no atomics, so results are deterministic).
    let xd = g.buf(&n("expert_down_out"), &[t, k, e], F32)?;
    g.op(&n("expert_down_proj"), &[xa, offsets], &[xd], &[])?;
    let moe_out = g.buf(&n("moe_out"), &[t, e], F32)?;
    combine_reads.extend([xd, weights, scatter]);
    g.op(&n("moe_combine"), &combine_reads, &[moe_out], &[])?;
    g.op(
        &n("ffn_residual"),
        &[moe_out, inp.hidden],
        &[inp.hidden],
        &[],
    )?;
    Ok(())
}

fn bad(key: &str, reason: impl Into<String>) -> InventoryError {
    InventoryError::BadHParam {
        key: key.to_string(),
        reason: reason.into(),
    }
}

fn check_params(hp: &HParams, p: &GraphParams, next: bool) -> Result<(), InventoryError> {
    let positive = [
        ("embedding_length", hp.n_embd),
        ("vocab_size", hp.n_vocab),
        ("attention.head_count", hp.n_head),
        ("attention.head_count_kv", hp.n_head_kv),
        ("attention.key_length", hp.head_dim_k),
        ("attention.value_length", hp.head_dim_v),
        ("expert_count", hp.n_expert),
        ("expert_used_count", hp.n_expert_used),
        ("expert_feed_forward_length", hp.n_ff_exp),
    ];
    for (key, v) in positive {
        if v == 0 {
            return Err(bad(key, "must be > 0 to build the forward graph"));
        }
    }
    if hp.n_expert_used > hp.n_expert {
        return Err(bad(
            "expert_used_count",
            format!(
                "{} experts used per token but only {} exist",
                hp.n_expert_used, hp.n_expert
            ),
        ));
    }
    if p.tokens == 0 {
        return Err(bad(
            "tokens",
            "a step needs at least one token (ubatch or slots x (1 + spec))",
        ));
    }
    if p.logits_rows > p.tokens {
        return Err(bad(
            "logits_rows",
            format!(
                "{} rows of logits asked for a step of {} tokens; at most one row per token",
                p.logits_rows, p.tokens
            ),
        ));
    }
    if next {
        let Some(s) = &hp.ssm else {
            return Err(bad("ssm", "qwen3next needs the ssm.* parameters"));
        };
        let ssm = [
            ("ssm.state_size", s.state_size),
            ("ssm.group_count", s.group_count),
            ("ssm.time_step_rank", s.time_step_rank),
            ("ssm.inner_size", s.inner_size),
        ];
        for (key, v) in ssm {
            if v == 0 {
                return Err(bad(key, "must be > 0 for a gated delta-net layer"));
            }
        }
        if s.inner_size % s.time_step_rank != 0 {
            return Err(bad(
                "ssm.inner_size",
                format!(
                    "{} is not a multiple of ssm.time_step_rank {}",
                    s.inner_size, s.time_step_rank
                ),
            ));
        }
    }
    Ok(())
}

/// Product of `dims` times `elem` bytes, rounded up to [`SCRATCH_ALIGN`]; `None` on overflow.
fn aligned_bytes(dims: &[u64], elem: u64) -> Option<u64> {
    let raw = dims.iter().try_fold(elem, |a, d| a.checked_mul(*d))?;
    raw.checked_next_multiple_of(SCRATCH_ALIGN)
}

struct OpDef {
    name: String,
    /// Index into `Builder::sections`.
    section: usize,
    reads: Vec<usize>,
    writes: Vec<usize>,
    /// Buffers used only inside this op (written and read by it, dead after).
    workspace: Vec<usize>,
}

struct Section {
    /// Repeated once per layer of this kind.
    repeated: bool,
}

#[derive(Default)]
struct Builder {
    sections: Vec<Section>,
    ops: Vec<OpDef>,
    buffers: Vec<(String, u64)>,
    by_name: BTreeMap<String, usize>,
}

/// Why a builder's graph is inconsistent: a bug in this file, reported instead of panicking.
fn internal(reason: String) -> InventoryError {
    bad(
        "forward_graph",
        format!("internal graph inconsistency: {reason}"),
    )
}

impl Builder {
    fn section(&mut self, _name: &str, repeated: bool) {
        self.sections.push(Section { repeated });
    }

    fn buf(&mut self, name: &str, dims: &[u64], elem: u64) -> Result<usize, InventoryError> {
        let bytes = aligned_bytes(dims, elem).ok_or_else(|| {
            bad(
                "forward_graph",
                format!("buffer `{name}` of {dims:?} x {elem} B overflows u64: lower tokens"),
            )
        })?;
        if self.by_name.contains_key(name) {
            return Err(internal(format!("buffer `{name}` defined twice")));
        }
        let id = self.buffers.len();
        self.buffers.push((name.to_string(), bytes));
        self.by_name.insert(name.to_string(), id);
        Ok(id)
    }

    fn op(
        &mut self,
        name: &str,
        reads: &[usize],
        writes: &[usize],
        workspace: &[usize],
    ) -> Result<(), InventoryError> {
        if self.ops.iter().any(|o| o.name == name) {
            return Err(internal(format!("op `{name}` defined twice")));
        }
        self.ops.push(OpDef {
            name: name.to_string(),
            section: self.sections.len().saturating_sub(1),
            reads: reads.to_vec(),
            writes: writes.to_vec(),
            workspace: workspace.to_vec(),
        });
        Ok(())
    }

    /// Build the def-use graph (ops as nodes, one edge per read from the op whose write it
    /// sees) and derive each buffer's lifetime from it.
    fn finish(self) -> Result<ForwardGraph, InventoryError> {
        let nb = self.buffers.len();
        let bname = |b: usize| self.buffers[b].0.as_str();
        let mut graph: DiGraph<usize, usize> = DiGraph::new();
        let nodes: Vec<NodeIndex> = (0..self.ops.len()).map(|i| graph.add_node(i)).collect();
        let mut last_writer: Vec<Option<usize>> = vec![None; nb];
        let mut read_since_write = vec![false; nb];
        let mut first_write: Vec<Option<usize>> = vec![None; nb];
        let mut workspace_op: Vec<Option<usize>> = vec![None; nb];

        for (i, op) in self.ops.iter().enumerate() {
            for &b in &op.reads {
                let Some(w) = last_writer[b] else {
                    return Err(internal(format!(
                        "op `{}` reads `{}` before any op writes it",
                        op.name,
                        bname(b)
                    )));
                };
                graph.add_edge(nodes[w], nodes[i], b);
                read_since_write[b] = true;
            }
            for &b in &op.writes {
                if let Some(w) = last_writer[b] {
                    if !read_since_write[b] {
                        return Err(internal(format!(
                            "op `{}` overwrites `{}` that op `{}` wrote and nothing read",
                            op.name,
                            bname(b),
                            self.ops[w].name
                        )));
                    }
                }
                last_writer[b] = Some(i);
                read_since_write[b] = false;
                first_write[b].get_or_insert(i);
            }
            for &b in &op.workspace {
                if workspace_op[b].is_some() || first_write[b].is_some() {
                    return Err(internal(format!(
                        "workspace `{}` of op `{}` is used by another op",
                        bname(b),
                        op.name
                    )));
                }
                workspace_op[b] = Some(i);
            }
        }
        for b in 0..nb {
            if last_writer[b].is_some() && !read_since_write[b] {
                return Err(internal(format!(
                    "`{}` is written last by op `{}` and never read",
                    bname(b),
                    last_writer[b]
                        .map(|w| self.ops[w].name.as_str())
                        .unwrap_or("?")
                )));
            }
        }
        if petgraph::algo::toposort(&graph, None).is_err() {
            return Err(internal("the def-use graph has a cycle".to_string()));
        }

        // The span of repeated (per-layer) sections, in op indices.
        let repeated: Vec<usize> = (0..self.ops.len())
            .filter(|&i| self.sections[self.ops[i].section].repeated)
            .collect();
        let span = repeated.first().copied().zip(repeated.last().copied());

        let mut life: Vec<Option<(usize, usize)>> = vec![None; nb];
        for b in 0..nb {
            if let (Some(w), Some(ws)) = (first_write[b], workspace_op[b]) {
                return Err(internal(format!(
                    "`{}` is both workspace of `{}` and written by `{}`",
                    bname(b),
                    self.ops[ws].name,
                    self.ops[w].name
                )));
            }
            if let Some(i) = workspace_op[b] {
                life[b] = Some((i, i));
            }
        }
        for edge in graph.edge_references() {
            let b = *edge.weight();
            let src = graph[edge.source()];
            let dst = graph[edge.target()];
            let (lo, hi) = life[b].get_or_insert((src, dst));
            *lo = (*lo).min(src);
            *hi = (*hi).max(dst);
            // A value that enters a per-layer section from outside it is carried from layer
            // to layer: keep it live over every layer, whatever order the kinds interleave in.
            let dst_section = self.ops[dst].section;
            if self.sections[dst_section].repeated && self.ops[src].section != dst_section {
                if let Some((s0, s1)) = span {
                    *lo = (*lo).min(s0.max(src));
                    *hi = (*hi).max(s1);
                }
            }
        }

        let mut buffers = Vec::with_capacity(nb);
        for (b, (name, bytes)) in self.buffers.iter().enumerate() {
            let Some((lo, hi)) = life[b] else {
                return Err(internal(format!("buffer `{name}` is never used")));
            };
            let to_u32 = |x: usize| {
                u32::try_from(x).map_err(|_| internal(format!("op index {x} exceeds u32")))
            };
            buffers.push(BufferSpec {
                name: name.clone(),
                bytes: *bytes,
                first_op: to_u32(lo)?,
                last_op: to_u32(hi)?,
            });
        }
        Ok(ForwardGraph {
            ops: self.ops.into_iter().map(|o| o.name).collect(),
            buffers,
        })
    }
}

/// One per-slot session buffer: bytes a slot keeps on device between steps, outside the KV
/// cache and the linear-attention state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionTerm {
    /// Stable name the executor binds by (`slot.sampler_candidates`, ...).
    pub name: &'static str,
    /// Bytes, rounded up to [`SCRATCH_ALIGN`].
    pub bytes: u64,
}

/// The per-slot session buffers of `arch` with `spec` draft tokens per step:
/// - `slot.sampler_candidates`: top-k candidates kept for top-p/min-p and logprobs,
///   [`SAMPLER_CANDIDATES`] x (u32 id + f32 prob) = 8 B each;
/// - `slot.rng`: the sampler's counter-based RNG state (key + counter), 16 B;
/// - `slot.token_history`: ring of the last [`TOKEN_HISTORY`] token ids (u32) for repetition
///   penalties and stop-token detection on device (stop *strings* are matched on the host);
/// - `slot.draft` (only with `spec > 0`): the drafted token ids (u32) and their draft
///   probabilities (f32) kept for verification, `spec` x 8 B;
/// - `slot.mtp_hidden` (only with `spec > 0` on an architecture with an MTP head, i.e.
///   qwen3next with `nextn_predict_layers > 0`): the main model's last hidden state for each of
///   the `1 + spec` positions of a step, f32 x n_embd, handed to the MTP draft block next step.
///
/// Any other architecture gets the terms that do not depend on the model.
pub fn per_slot_session_terms(arch: &str, hp: &HParams, spec: u32) -> Vec<SessionTerm> {
    let al = |x: u64| x.saturating_add(SCRATCH_ALIGN - 1) / SCRATCH_ALIGN * SCRATCH_ALIGN;
    let spec = u64::from(spec);
    let mut terms = vec![
        SessionTerm {
            name: "slot.sampler_candidates",
            bytes: al(SAMPLER_CANDIDATES * 8),
        },
        SessionTerm {
            name: "slot.rng",
            bytes: al(16),
        },
        SessionTerm {
            name: "slot.token_history",
            bytes: al(TOKEN_HISTORY * 4),
        },
    ];
    if spec > 0 {
        terms.push(SessionTerm {
            name: "slot.draft",
            bytes: al(spec.saturating_mul(8)),
        });
        if arch == "qwen3next" && hp.nextn_predict_layers > 0 {
            terms.push(SessionTerm {
                name: "slot.mtp_hidden",
                bytes: al((1 + spec).saturating_mul(hp.n_embd).saturating_mul(F32)),
            });
        }
    }
    terms
}

/// Total bytes of [`per_slot_session_terms`].
pub fn per_slot_session_bytes(arch: &str, hp: &HParams, spec: u32) -> u64 {
    per_slot_session_terms(arch, hp, spec)
        .iter()
        .fold(0u64, |a, t| a.saturating_add(t.bytes))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    pub(crate) use crate::known::{
        qwen3_30b_a3b as qwen3moe_30b, qwen3_next_80b_a3b as qwen3next_80b,
    };

    const MIB: u64 = 1 << 20;

    fn prefill() -> GraphParams {
        GraphParams {
            tokens: 512,
            logits_rows: 1,
            ctx_cells: 4096,
        }
    }

    fn decode() -> GraphParams {
        GraphParams {
            tokens: 1,
            logits_rows: 1,
            ctx_cells: 4096,
        }
    }

    fn life(g: &ForwardGraph, name: &str) -> (u32, u32) {
        let b = g.buffer(name).unwrap_or_else(|| panic!("no buffer {name}"));
        (b.first_op, b.last_op)
    }

    fn op(g: &ForwardGraph, name: &str) -> u32 {
        g.op_index(name).unwrap_or_else(|| panic!("no op {name}"))
    }

    #[test]
    fn qwen3moe_prefill_sizes_from_hand_arithmetic() {
        let g = forward_graph("qwen3moe", &qwen3moe_30b(), &prefill()).unwrap();
        let bytes = |n: &str| g.buffer(n).unwrap().bytes;
        assert_eq!(bytes("hidden"), 512 * 2048 * 4); // 4 MiB
        assert_eq!(bytes("attn.q"), 512 * 32 * 128 * 4); // 8 MiB
        assert_eq!(bytes("attn.k"), 512 * 4 * 128 * 4); // 1 MiB
        assert_eq!(bytes("attn.out"), 8 * MIB);
        assert_eq!(bytes("attn.router_logits"), 512 * 128 * 4);
        assert_eq!(bytes("attn.expert_gate"), 512 * 8 * 768 * 4); // 12 MiB
        assert_eq!(bytes("attn.expert_down_out"), 512 * 8 * 2048 * 4); // 32 MiB
        assert_eq!(bytes("attn.expert_offsets"), 768); // 129 x 4 = 516 -> 768
        assert_eq!(bytes("head.logits"), (151936 * 4u64).next_multiple_of(256));
        // 512 query tokens: attention runs unsplit, no partials.
        assert!(g.buffer("attn.fa_partials").is_none());
        assert!(g.buffer("linear.z").is_none());
        assert!(g.buffer("attn.shexp_out").is_none());
        for b in &g.buffers {
            assert_eq!(b.bytes % SCRATCH_ALIGN, 0, "{}", b.name);
            assert!(b.first_op <= b.last_op, "{}", b.name);
            assert!((b.last_op as usize) < g.ops.len());
        }
        // Peak by hand at attn.expert_down_proj: hidden 4 + expert_act 12 + down_out 32 MiB
        // plus small index buffers.
        let peak = g.peak_live_bytes();
        assert!((48 * MIB..49 * MIB).contains(&peak), "peak {peak}");
    }

    #[test]
    fn lifetimes_are_def_to_last_use() {
        let g = forward_graph("qwen3moe", &qwen3moe_30b(), &prefill()).unwrap();
        assert_eq!(life(&g, "inp.tokens"), (0, op(&g, "embed")));
        assert_eq!(
            life(&g, "attn.k"),
            (op(&g, "attn.k_proj"), op(&g, "attn.kv_store"))
        );
        assert_eq!(
            life(&g, "attn.q"),
            (op(&g, "attn.q_proj"), op(&g, "attn.flash"))
        );
        assert_eq!(
            life(&g, "attn.expert_gate"),
            (
                op(&g, "attn.expert_gate_proj"),
                op(&g, "attn.expert_swiglu")
            )
        );
        assert_eq!(
            life(&g, "attn.ffn_norm_out"),
            (op(&g, "attn.ffn_norm"), op(&g, "attn.expert_up_proj"))
        );
        assert_eq!(
            life(&g, "hidden"),
            (op(&g, "embed"), op(&g, "head.output_norm"))
        );
        assert_eq!(
            life(&g, "head.logits"),
            (op(&g, "head.lm_head"), op(&g, "head.sample"))
        );
        // Positions are read by every attention layer: live over the whole layer span.
        assert_eq!(life(&g, "inp.pos"), (0, op(&g, "attn.ffn_residual")));
        assert_eq!(g.ops.last().map(String::as_str), Some("head.readback"));
    }

    #[test]
    fn names_unique_and_stable_across_sizes() {
        for (arch, hp) in [("qwen3moe", qwen3moe_30b()), ("qwen3next", qwen3next_80b())] {
            let a = forward_graph(arch, &hp, &prefill()).unwrap();
            let mut names: Vec<&str> = a.buffers.iter().map(|b| b.name.as_str()).collect();
            names.sort_unstable();
            let n = names.len();
            names.dedup();
            assert_eq!(names.len(), n, "{arch}: duplicate buffer names");
            let b = forward_graph(
                arch,
                &hp,
                &GraphParams {
                    tokens: 256,
                    logits_rows: 256,
                    ctx_cells: 100,
                },
            )
            .unwrap();
            assert_eq!(a.ops, b.ops);
            let an: Vec<_> = a.buffers.iter().map(|x| &x.name).collect();
            let bn: Vec<_> = b.buffers.iter().map(|x| &x.name).collect();
            assert_eq!(an, bn);
        }
    }

    #[test]
    fn qwen3next_layers_and_carried_values() {
        let hp = qwen3next_80b();
        let g = forward_graph("qwen3next", &hp, &prefill()).unwrap();
        let bytes = |n: &str| g.buffer(n).unwrap().bytes;
        assert_eq!(bytes("attn.q"), 512 * 16 * 256 * 2 * 4); // gated q, 16 MiB
        assert_eq!(bytes("linear.qkv_mixed"), 512 * 8192 * 4); // 16 MiB
        assert_eq!(bytes("linear.z"), 512 * 4096 * 4);
        assert_eq!(bytes("linear.beta"), 512 * 32 * 4);
        // 8 lanes x 32 v-heads x (64x64 + 64x128) f32 = 12 MiB.
        assert_eq!(bytes("linear.chunk_ws"), 8 * 32 * (4096 + 8192) * 4);
        assert_eq!(bytes("linear.shexp_out"), 512 * 2048 * 4);
        assert_eq!(bytes("attn.expert_down_out"), 512 * 10 * 2048 * 4); // 40 MiB
                                                                        // The gate half of q lives until the output gate, after attention.
        assert_eq!(
            life(&g, "attn.q"),
            (op(&g, "attn.q_proj"), op(&g, "attn.out_gate"))
        );
        let ws = op(&g, "linear.delta_net");
        assert_eq!(life(&g, "linear.chunk_ws"), (ws, ws));
        // The linear section comes first; inp.pos (read only by attention) and inp.seq must
        // still cover the whole layer span because layer kinds interleave.
        let span_end = op(&g, "attn.ffn_residual");
        assert_eq!(life(&g, "inp.seq"), (0, span_end));
        assert_eq!(life(&g, "inp.pos"), (0, span_end));
        // Transients of the two layer kinds never overlap in time.
        let lin_end = life(&g, "linear.moe_out").1;
        let att_start = life(&g, "attn.norm_out").0;
        assert!(lin_end < att_start);
        // Peak by hand: MoE down projection, hidden 4 + act 10 + down_out 40 + shexp_out 4
        // MiB + indices ~ 58 MiB.
        let peak = g.peak_live_bytes();
        assert!((58 * MIB..60 * MIB).contains(&peak), "peak {peak}");
    }

    #[test]
    fn split_kv_partials_only_for_small_steps() {
        let hp = qwen3moe_30b();
        let g = forward_graph("qwen3moe", &hp, &decode()).unwrap();
        // ctx 4096 -> 64 splits (the cap; 256 of 16 cells); 1 token x 32 heads x 64 x
        // (128 + 2) f32.
        assert_eq!(kv_splits(&decode()), 64);
        assert_eq!(
            g.buffer("attn.fa_partials").unwrap().bytes,
            (32 * 64 * 130 * 4u64).next_multiple_of(256)
        );
        let short = GraphParams {
            ctx_cells: 100,
            ..decode()
        };
        assert_eq!(kv_splits(&short), 7, "ceil(100 / 16)");
        assert_eq!(
            life(&g, "attn.fa_partials"),
            (op(&g, "attn.flash_split"), op(&g, "attn.flash_combine"))
        );
        let huge = GraphParams {
            tokens: 4,
            logits_rows: 4,
            ctx_cells: 1 << 20,
        };
        assert_eq!(kv_splits(&huge), 64);
        let tiny = GraphParams {
            ctx_cells: 0,
            ..huge
        };
        assert_eq!(kv_splits(&tiny), 1);
        assert!(forward_graph("qwen3moe", &hp, &tiny)
            .unwrap()
            .buffer("attn.fa_partials")
            .is_none());
    }

    #[test]
    fn decode_is_much_smaller_than_prefill() {
        for (arch, hp) in [("qwen3moe", qwen3moe_30b()), ("qwen3next", qwen3next_80b())] {
            let big = forward_graph(arch, &hp, &prefill())
                .unwrap()
                .peak_live_bytes();
            let small = forward_graph(arch, &hp, &decode())
                .unwrap()
                .peak_live_bytes();
            assert!(small * 20 < big, "{arch}: decode {small} vs prefill {big}");
            assert!(small < 4 * MIB, "{arch}: decode {small}");
        }
    }

    #[test]
    fn all_logits_rows_size_the_head() {
        let hp = qwen3moe_30b();
        let p = GraphParams {
            tokens: 512,
            logits_rows: 512,
            ctx_cells: 4096,
        };
        let g = forward_graph("qwen3moe", &hp, &p).unwrap();
        assert_eq!(g.buffer("head.logits").unwrap().bytes, 512 * 151936 * 4);
        assert!(g.peak_live_bytes() > 296 * MIB);
    }

    #[test]
    fn bad_inputs_are_errors() {
        let hp = qwen3moe_30b();
        match forward_graph("llama", &hp, &prefill()) {
            Err(InventoryError::UnsupportedArch { arch, supported }) => {
                assert_eq!(arch, "llama");
                assert!(supported.contains("qwen3moe") && supported.contains("qwen3next"));
            }
            other => panic!("{other:?}"),
        }
        let p = GraphParams {
            tokens: 4,
            logits_rows: 5,
            ctx_cells: 1,
        };
        assert!(matches!(
            forward_graph("qwen3moe", &hp, &p),
            Err(InventoryError::BadHParam { key, .. }) if key == "logits_rows"
        ));
        let p = GraphParams {
            tokens: 0,
            logits_rows: 0,
            ctx_cells: 1,
        };
        assert!(forward_graph("qwen3moe", &hp, &p).is_err());
        // qwen3next without ssm parameters.
        assert!(matches!(
            forward_graph("qwen3next", &hp, &prefill()),
            Err(InventoryError::BadHParam { key, .. }) if key == "ssm"
        ));
        let mut zero = hp.clone();
        zero.n_expert_used = 0;
        assert!(forward_graph("qwen3moe", &zero, &prefill()).is_err());
        let p = GraphParams {
            tokens: u64::MAX / 2,
            logits_rows: 1,
            ctx_cells: 1,
        };
        assert!(matches!(
            forward_graph("qwen3moe", &hp, &p),
            Err(InventoryError::BadHParam { key, .. }) if key == "forward_graph"
        ));
    }

    #[test]
    fn builder_rejects_read_before_write_and_dead_writes() {
        let mut b = Builder::default();
        b.section("s", false);
        let x = b.buf("x", &[1], 4).unwrap();
        b.op("reads_x", &[x], &[], &[]).unwrap();
        assert!(b.finish().is_err());

        let mut b = Builder::default();
        b.section("s", false);
        let x = b.buf("x", &[1], 4).unwrap();
        b.op("w1", &[], &[x], &[]).unwrap();
        b.op("w2", &[], &[x], &[]).unwrap();
        b.op("r", &[x], &[], &[]).unwrap();
        assert!(b.finish().is_err());

        let mut b = Builder::default();
        b.section("s", false);
        let x = b.buf("x", &[1], 4).unwrap();
        b.op("w", &[], &[x], &[]).unwrap();
        assert!(b.finish().is_err());

        let mut b = Builder::default();
        b.section("s", false);
        b.buf("x", &[1], 4).unwrap();
        assert!(b.buf("x", &[1], 4).is_err());
    }

    #[test]
    fn session_terms_are_small_and_documented() {
        let next = qwen3next_80b();
        let base = per_slot_session_bytes("qwen3next", &next, 0);
        assert_eq!(base, 2048 + 256 + 1024);
        // spec 2: + draft (256 after alignment) + 3 x 2048 x 4 hidden rows.
        let with = per_slot_session_bytes("qwen3next", &next, 2);
        assert_eq!(with, base + 256 + 3 * 2048 * 4);
        // qwen3moe has no MTP head: no hidden hand-off.
        let moe = qwen3moe_30b();
        assert_eq!(per_slot_session_bytes("qwen3moe", &moe, 2), base + 256);
        let names: Vec<_> = per_slot_session_terms("qwen3next", &next, 2)
            .iter()
            .map(|t| t.name)
            .collect();
        assert!(names.contains(&"slot.mtp_hidden"));
    }
}
