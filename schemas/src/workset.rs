//! The executor's working set: the named scratch buffers a backend binds on one planned device,
//! with their sizes for a pass of the planned shape. The planner packs exactly these into the
//! device's scratch region and records each (name, offset, bytes) in the plan; the executor
//! binds them by name ([`WorkBuf::from_name`]) and sizes nothing itself.
//! Invariant: [`buffers`] is the single definition of what a backend binds; every size is
//! monotone in the pass (more tokens, slots, splits or the tensor-core path never need less),
//! so a plan made for a pass holds every smaller one.

use crate::dims::Dims;
use crate::graph::{SPLIT_KV_CELLS_PER_SPLIT, SPLIT_KV_MAX_SPLITS};
use crate::inventory::HParams;

/// Alignment of every carved buffer (the kernels' widest loads are 16 bytes).
pub const CARVE_ALIGN: u64 = 16;
/// Tokens (or expert assignments) per tensor-core tile, and so per MoE tile (gemm.cu's
/// GM_BN).
pub const MOE_TILE_TOKENS: usize = 64;
/// Blocks per logit row of the device's greedy choice (the CUDA backend's `dq_argmax_rows`).
pub const ARGMAX_BLOCKS: u64 = 64;
/// Bytes of one slot's sampling draw on the device (`sampler::Draw`, sample.cu's SampleDraw).
pub const DRAW_BYTES: u64 = 32;
/// Sparse logit edits (`logit_bias`, penalties) one row of [`WorkBuf::SampleProc`] holds: a
/// request touching more tokens in a step (a repetition penalty over a long prompt) is picked
/// on the host that step (`executor/src/pick.rs`).
pub const SAMPLE_EDITS: u64 = 16_384;
/// Bytes of one edit (`pick::Edit`: token id, bias, repetition factor, penalty).
pub const EDIT_BYTES: u64 = 16;

/// Bytes of one row of [`WorkBuf::SampleProc`] at a vocabulary of `vocab`: a 16-byte header
/// (flags, edit count, `min_p` offset), the token mask (one bit a token, u32 words, rounded up
/// to 16 bytes), then [`SAMPLE_EDITS`] edits (sample.cu's `SpProc` layout).
pub fn sample_proc_row_bytes(vocab: u64) -> u64 {
    16 + vocab.div_ceil(128) * 16 + SAMPLE_EDITS * EDIT_BYTES
}

/// Which executor backend a working set is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum BackendKind {
    /// The CPU reference backend (`vendor = "cpu"` devices).
    Cpu,
    /// The GPU backend (CUDA on `nvidia` devices; HIP shares it on `amd` devices).
    Gpu,
}

impl BackendKind {
    /// The backend that runs a planned device of this vendor.
    pub fn for_vendor(vendor: &str) -> Self {
        if vendor == "cpu" {
            BackendKind::Cpu
        } else {
            BackendKind::Gpu
        }
    }
}

macro_rules! work_bufs {
    ($($(#[$m:meta])* $v:ident = $name:literal,)*) => {
        /// A named buffer of a backend's working set.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum WorkBuf { $($(#[$m])* $v,)* }

        impl WorkBuf {
            /// Every buffer, in declaration order.
            pub const ALL: &'static [WorkBuf] = &[$(WorkBuf::$v,)*];

            /// The name the plan records.
            pub fn name(self) -> &'static str {
                match self { $(WorkBuf::$v => $name,)* }
            }

            /// The buffer a plan's name stands for.
            pub fn from_name(name: &str) -> Option<Self> {
                match name { $($name => Some(WorkBuf::$v),)* _ => None }
            }
        }
    };
}

work_bufs! {
    /// GPU: step inputs: token ids, positions, slots (u32 x tokens each, back to back).
    Inputs = "inputs",
    /// The residual stream (f32, tokens x hidden).
    X = "x",
    /// A normalised copy of `x` (f32, tokens x hidden).
    Xn = "xn",
    /// Queries, keys, values (f32, tokens x heads x head dim).
    Q = "q",
    K = "k",
    V = "v",
    /// Attention output (f32, tokens x query heads x value head dim).
    Att = "att",
    /// Router logits (f32, tokens x experts).
    Router = "router",
    /// The top-k experts (u32) and their weights (f32), tokens x k.
    Ids = "ids",
    Wts = "wts",
    /// Expert hidden rows (f32, tokens x k x expert width).
    H = "h",
    /// Logits of the rows the head computes per pass (f32, rows x vocab).
    Logits = "logits",
    /// CPU: a product's output before it is added into `x` (f32, tokens x hidden).
    Proj = "proj",
    /// CPU: the row-major partials of a product of several tokens.
    Tmp = "tmp",
    /// CPU: the tokens of one expert's group, their weights and gathered inputs, and the
    /// expert's gate, up and down outputs.
    ExTok = "ex_tok",
    ExW = "ex_w",
    ExX = "ex_x",
    ExG = "ex_g",
    ExU = "ex_u",
    ExD = "ex_d",
    /// GPU: context length per token (i32).
    NCtx = "n_ctx",
    /// GPU: split-KV decode attention partials (outputs; max and sum).
    PartO = "part_o",
    PartMs = "part_ms",
    /// GPU: the decode attention's partial over a slot's cells past `--kv-resident` when the
    /// host CPU computes it (`--kv-host cpu`): per token and head the unnormalised output,
    /// then per token and head (max, sum) (f32, slots x heads x (head dim + 2)).
    KvHostPart = "kv_host_part",
    /// GPU: RoPE inverse frequencies (f32, rotated dims / 2).
    InvFreq = "inv_freq",
    /// GPU: counters of the last-block-finishes kernels, zero between launches.
    Counters = "counters",
    /// GPU: the device's token picks (partial pairs, counters, chosen tokens).
    Argmax = "argmax",
    /// GPU: one sampling draw per slot.
    Draws = "draws",
    /// GPU: per slot, the row's processing before the device pick (grammar mask, sparse
    /// logit edits, `min_p`; [`sample_proc_row_bytes`]).
    SampleProc = "sample_proc",
    /// GPU: 16-bit product inputs of the tensor-core path.
    Xh = "xh",
    /// GPU: the experts' outputs before they are combined, and split-K partials.
    Yd = "yd",
    /// GPU: the router's choices grouped by expert (`MoeScratch`).
    Sorted = "sorted",
    /// GPU: per layer, the device addresses of each expert's gate, up and down matrices.
    Tables = "tables",
    /// GPU: norm vectors converted to f32 (when the file stores them otherwise).
    Norms = "norms",
    /// Gated full attention (Qwen3-Next): the `attn_q` output, per head the query then its
    /// gate (f32, tokens x 2 x query width), and the gate split off it (tokens x query width).
    Qg = "qg",
    Gate = "gate",
    /// Linear attention: the `attn_qkv`, `attn_gate` (z) and `ssm_ba` projections (f32,
    /// tokens x conv channels / value width / 2 x value heads) and the gated delta net's
    /// normed output (tokens x value width).
    Qkv = "qkv",
    Z = "z",
    Ba = "ba",
    Lin = "lin",
    /// The conv's output (f32, tokens x conv channels); CPU: the per-head gates (beta then g,
    /// tokens x value heads each), the delta rule's output before its norm, and the chunked
    /// rule's scratch.
    ConvOut = "conv_out",
    Gbeta = "gbeta",
    DeltaOut = "delta_out",
    DeltaScratch = "delta_scratch",
    /// The shared expert's rows: CPU its gate, up, down and partial rows and per-token gate
    /// scalars; GPU its gate, up and down rows (tokens x (2 x shared width + hidden)).
    ShScratch = "sh_scratch",
    /// MTP draft block (Qwen3-Next `--mtp`): the hidden states it drafts from (f32, tokens x
    /// hidden), and its `eh_proj` input, the normed embedding then the normed hidden state
    /// side by side (f32, tokens x 2 x hidden). Only in a pass with `mtp`.
    MtpHidden = "mtp_hidden",
    MtpCat = "mtp_cat",
}

/// Tokens per chunk of the chunked gated delta rule (HF's and llama.cpp's 64).
pub const DELTA_CHUNK: usize = 64;

/// What one pass of a stage carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    /// Tokens of the largest pass (a prefill chunk, or every slot's decode token).
    pub tokens: usize,
    /// Rows of logits the head computes per pass.
    pub logit_rows: usize,
    /// Decode-attention splits (see [`att_splits`]).
    pub att_splits: usize,
    /// Decode slots (rows of split-attention partials).
    pub slots: usize,
    /// Prefill through the tensor-core products (their 16-bit inputs, sorted MoE tiles and
    /// per-assignment outputs).
    pub gemm: bool,
    /// The stage runs the MTP draft block (its `mtp_hidden` and `mtp_cat` buffers).
    pub mtp: bool,
}

/// Whether this build's executor has a forward pass for `arch` with these parameters on
/// `backend`, so that its working set (rather than the forward graph's estimate) is planned.
pub fn runs(backend: BackendKind, arch: &str, hp: &HParams) -> bool {
    let moe = arch == "qwen3moe" && hp.n_expert > 0;
    let next = arch == "qwen3next" && hp.n_expert > 0 && hp.ssm.is_some();
    match backend {
        BackendKind::Cpu => moe || next,
        BackendKind::Gpu => (moe || next) && hp.n_leading_dense == 0,
    }
}

/// Splits of the decode attention for contexts up to `ctx` cells: one per
/// [`SPLIT_KV_CELLS_PER_SPLIT`] cells, at most [`SPLIT_KV_MAX_SPLITS`] (the forward graph's
/// rule for decode steps).
pub fn att_splits(ctx: usize) -> usize {
    (ctx as u64)
        .div_ceil(SPLIT_KV_CELLS_PER_SPLIT)
        .clamp(1, SPLIT_KV_MAX_SPLITS) as usize
}

/// Where `moe_sort` puts its outputs inside one scratch view (byte offsets, 16-aligned):
/// `offsets` i32 `[n_expert + 1]` (assignments of expert e are `perm[offsets[e] ..
/// offsets[e + 1]]`; `offsets[n_expert]` counts the valid ones), `perm` i32 `[n_assign]`,
/// `tiles` i32 pairs `(expert, first position)` `[max_tiles]`, `n_tiles` one i32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeScratch {
    pub n_assign: usize,
    pub n_expert: usize,
    /// Host upper bound of the tile count: `min(ceil(n_assign / MOE_TILE_TOKENS) + n_expert,
    /// n_assign)`; it sizes the MoE grid.
    pub max_tiles: usize,
    pub offsets: u64,
    pub perm: u64,
    pub tiles: u64,
    pub n_tiles: u64,
    /// Total bytes.
    pub bytes: u64,
}

impl MoeScratch {
    /// The layout for `n_tok` tokens of `k` choices among `n_expert` experts.
    pub fn new(n_tok: usize, k: usize, n_expert: usize) -> Self {
        let n_assign = n_tok * k;
        let max_tiles = (n_assign.div_ceil(MOE_TILE_TOKENS) + n_expert).min(n_assign);
        let al = |b: u64| b.div_ceil(16) * 16;
        let offsets = 0u64;
        let perm = al(offsets + 4 * (n_expert as u64 + 1));
        let tiles = al(perm + 4 * n_assign as u64);
        let n_tiles = al(tiles + 8 * max_tiles as u64);
        let bytes = al(n_tiles + 4);
        Self {
            n_assign,
            n_expert,
            max_tiles,
            offsets,
            perm,
            tiles,
            n_tiles,
            bytes,
        }
    }
}

/// Bytes of one layer's expert table on the GPU (three u64 addresses per expert), aligned.
pub fn table_bytes(d: &Dims) -> u64 {
    align(d.n_expert as u64 * 3 * 8)
}

/// Whether the GPU backend reads tensor `name` as f32 (in place when the file stores it as
/// F32, else converted into the `norms` buffer): the norm vectors, and Qwen3-Next's conv
/// taps, `ssm_a`, `ssm_dt.bias` and shared-expert gate row.
pub fn small_f32(name: &str) -> bool {
    name.ends_with("norm.weight")
        || name.ends_with("ssm_conv1d.weight")
        || name.ends_with(".ssm_a")
        || name.ends_with("ssm_dt.bias")
        || name.ends_with("ffn_gate_inp_shexp.weight")
}

/// Bytes of the f32 norm vectors of `n_layer` layers and the output norm (each aligned):
/// the GPU backend's `norms` buffer when the file does not store them as F32. A model with
/// linear attention (Qwen3-Next) adds, per layer, its other small f32 tensors: the conv taps,
/// `ssm_norm`, `ssm_dt.bias`, `ssm_a` and the shared expert's gate row (counted for every
/// layer, an upper bound).
pub fn norm_bytes(d: &Dims, n_layer: usize) -> u64 {
    let a = |n: usize| align(4 * n as u64);
    let lin = if d.linear() {
        a(d.lin_qkv() * d.conv_k) + a(d.lin_hv) + 2 * a(d.lin_v_heads) + a(d.e)
    } else {
        0
    };
    (2 * a(d.e) + 2 * a(d.hd) + lin) * n_layer as u64 + a(d.e)
}

/// The buffers `backend` binds on a stage of `n_layer` layers for passes up to `p`, in
/// carve order: `(buffer, bytes)`, sizes before alignment. `f32_norms`: the file stores every
/// norm vector as F32 (the GPU backend then reads them in place).
pub fn buffers(
    backend: BackendKind,
    d: &Dims,
    n_layer: usize,
    f32_norms: bool,
    p: &Pass,
) -> Vec<(WorkBuf, u64)> {
    use WorkBuf::*;
    let f = 4u64;
    let t = p.tokens as u64;
    let u = |n: usize| n as u64;
    let shared = [
        (X, f * t * u(d.e)),
        (Xn, f * t * u(d.e)),
        (Q, f * t * u(d.q_out())),
        (K, f * t * u(d.k_out())),
        (V, f * t * u(d.v_out())),
        (Att, f * t * u(d.att_out())),
        (Router, f * t * u(d.n_expert)),
        (Ids, 4 * t * u(d.k)),
        (Wts, f * t * u(d.k)),
        (Logits, f * u(p.logit_rows) * u(d.vocab)),
        (Qg, if d.linear() { f * t * u(d.q_proj()) } else { 0 }),
        (Gate, if d.linear() { f * t * u(d.q_out()) } else { 0 }),
        (Qkv, f * t * u(d.lin_qkv())),
        (Z, f * t * u(d.lin_v())),
        (Ba, f * t * 2 * u(d.lin_v_heads)),
        (Lin, f * t * u(d.lin_v())),
    ];
    let mut out: Vec<(WorkBuf, u64)> = shared.to_vec();
    if p.mtp {
        // Listed only when asked for, so plans without MTP keep their exact buffer list.
        out.extend([(MtpHidden, f * t * u(d.e)), (MtpCat, 2 * f * t * u(d.e))]);
    }
    match backend {
        BackendKind::Cpu => {
            let widest = [
                d.e,
                d.q_proj(),
                d.k_out(),
                d.v_out(),
                d.n_expert,
                d.ff_max(),
                d.lin_qkv(),
            ]
            .into_iter()
            .max()
            .unwrap_or(0);
            let ff = u(d.ff_max());
            let (nv, c) = (u(d.lin_v_heads), u(DELTA_CHUNK));
            // The chunked delta rule, per value head: gates, k·beta, T, new values,
            // k_cumdecay (a chunk each) and the head's outputs.
            let delta = nv * (c + c * u(d.lin_hk) + c * c + c * u(d.lin_hv) + c * u(d.lin_hk))
                + nv * t * u(d.lin_hv);
            let sh = u(d.n_ff_shexp);
            let shared = if sh > 0 {
                t * (2 * sh + u(d.e) + sh.max(u(d.e))) + t
            } else {
                0
            };
            out.extend([
                (Proj, f * t * u(d.e)),
                (
                    Tmp,
                    (f * t * u(widest)).max(f * u(p.logit_rows) * u(d.vocab)),
                ),
                (ExTok, 4 * t),
                (ExW, f * t),
                (ExX, f * t * u(d.e)),
                (ExG, f * t * ff),
                (ExU, f * t * ff),
                (ExD, f * t * u(d.e)),
                (ConvOut, f * t * u(d.lin_qkv())),
                (Gbeta, f * 2 * t * nv),
                (DeltaOut, f * t * u(d.lin_v())),
                (DeltaScratch, f * delta),
                (ShScratch, f * shared),
            ]);
        }
        BackendKind::Gpu => {
            let dec = p.slots.max(1) as u64;
            let g = |b: u64| if p.gemm { b } else { 0 };
            out.extend([
                (Inputs, 3 * 4 * t),
                (H, f * t * u(d.k) * u(d.f)),
                (NCtx, 4 * t),
                (
                    PartO,
                    f * dec * u(d.n_head) * u(p.att_splits) * u(d.hd_v.max(d.hd)),
                ),
                (PartMs, f * dec * u(d.n_head) * u(p.att_splits) * 2),
                (
                    KvHostPart,
                    f * dec * u(d.n_head) * (u(d.hd_v.max(d.hd)) + 2),
                ),
                (InvFreq, f * u((d.n_rot / 2).max(1))),
                // One u32 per token for the router's top-k, then one per token and KV head
                // for the decode attention's merge of its splits.
                (Counters, 4 * t * (1 + u(d.n_head_kv))),
                // Per picked row (every decoding slot's, and an MTP verify pass's N + 1 rows
                // of a slot): ARGMAX_BLOCKS (value, index) pairs, a counter and the chosen
                // token.
                (
                    Argmax,
                    dec.max(p.logit_rows as u64) * (ARGMAX_BLOCKS * 8 + 8),
                ),
                (Draws, dec * DRAW_BYTES),
                (SampleProc, dec * sample_proc_row_bytes(u(d.vocab))),
                (
                    Xh,
                    // The widest product input: the hidden row, the attention output, the
                    // experts' hidden rows, and (Qwen3-Next) the delta net's output and the
                    // shared expert's hidden row.
                    g(
                        2 * (t * u(d.e.max(d.att_out()).max(d.lin_v()).max(d.n_ff_shexp)))
                            .max(t * u(d.k) * u(d.f)),
                    ),
                ),
                (Yd, g(f * t * u(d.k) * u(d.e))),
                (Sorted, g(MoeScratch::new(p.tokens, d.k, d.n_expert).bytes)),
                // A stage that holds the MTP block binds its MoE layer's expert table and
                // its norms (the layer's, and `enorm`, `hnorm`, `shared_head_norm`) too.
                (
                    Tables,
                    table_bytes(d) * (n_layer + usize::from(p.mtp)) as u64,
                ),
                (
                    Norms,
                    if f32_norms {
                        0
                    } else {
                        norm_bytes(d, n_layer + usize::from(p.mtp))
                            + if p.mtp { 3 * align(4 * u(d.e)) } else { 0 }
                    },
                ),
                (ConvOut, f * t * u(d.lin_qkv())),
                (
                    ShScratch,
                    if d.n_ff_shexp > 0 {
                        f * t * (2 * u(d.n_ff_shexp) + u(d.e))
                    } else {
                        0
                    },
                ),
            ]);
        }
    }
    out
}

fn align(v: u64) -> u64 {
    v.div_ceil(CARVE_ALIGN) * CARVE_ALIGN
}

/// Scratch bytes of [`buffers`] carved back to back, each aligned to [`CARVE_ALIGN`].
pub fn stage_bytes(
    backend: BackendKind,
    d: &Dims,
    n_layer: usize,
    f32_norms: bool,
    p: &Pass,
) -> u64 {
    buffers(backend, d, n_layer, f32_norms, p)
        .iter()
        .map(|(_, b)| align(*b))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Qwen3-30B-A3B's shapes.
    fn a3b() -> Dims {
        Dims {
            n_layer: 48,
            e: 2048,
            vocab: 151_936,
            n_head: 32,
            n_head_kv: 4,
            hd: 128,
            hd_v: 128,
            n_rot: 128,
            n_expert: 128,
            k: 8,
            f: 768,
            n_ff: 0,
            n_ff_shexp: 0,
            eps: 1e-6,
            norm_topk: true,
            rope_theta: 1e6,
            n_ctx_train: 40_960,
            lin_k_heads: 0,
            lin_v_heads: 0,
            lin_hk: 0,
            lin_hv: 0,
            conv_k: 0,
        }
    }

    /// A stage holding the MTP block binds one more MoE layer (its expert table) and, where
    /// the file's norms are not F32, the block's norms: the H200 run of the 80B-shaped file
    /// was refused at bind, 12,288 bytes (512 experts x 3 pointers) short.
    #[test]
    fn the_mtp_block_has_its_expert_table_and_norms_planned() {
        let mut p = Pass {
            tokens: 4,
            logit_rows: 4,
            att_splits: 1,
            slots: 1,
            gemm: false,
            mtp: false,
        };
        let d = Dims {
            n_expert: 512,
            ..a3b()
        };
        let of = |p: &Pass, f32_norms: bool| -> std::collections::BTreeMap<_, _> {
            buffers(BackendKind::Gpu, &d, 12, f32_norms, p)
                .into_iter()
                .collect()
        };
        let (plain, plain_n) = (of(&p, true), of(&p, false));
        p.mtp = true;
        let (mtp, mtp_n) = (of(&p, true), of(&p, false));
        assert_eq!(plain[&WorkBuf::Tables], 12 * 512 * 24);
        assert_eq!(mtp[&WorkBuf::Tables], 13 * 512 * 24);
        assert_eq!(mtp[&WorkBuf::Norms], 0);
        let a = |n: usize| align(4 * n as u64);
        assert_eq!(
            mtp_n[&WorkBuf::Norms] - plain_n[&WorkBuf::Norms],
            2 * a(d.e) + 2 * a(d.hd) + 3 * a(d.e)
        );
    }

    #[test]
    fn a_512_token_pass_of_qwen3_30b_by_hand() {
        let p = Pass {
            tokens: 512,
            logit_rows: 1,
            att_splits: 64,
            slots: 1,
            gemm: true,
            mtp: false,
        };
        const MIB: u64 = 1 << 20;
        let b: std::collections::BTreeMap<_, _> = buffers(BackendKind::Gpu, &a3b(), 48, true, &p)
            .into_iter()
            .collect();
        // The expert outputs before they are combined: 512 tokens x 8 experts x 2048 f32.
        assert_eq!(b[&WorkBuf::Yd], 32 * MIB);
        // The experts' hidden rows: 512 x 8 x 768 f32.
        assert_eq!(b[&WorkBuf::H], 12 * MIB);
        // 16-bit product inputs: the widest is 512 x 8 x 768 (the down projection's).
        assert_eq!(b[&WorkBuf::Xh], 6 * MIB);
        assert_eq!(b[&WorkBuf::Xn], 4 * MIB);
        // Decode partials: 1 slot x 32 heads x 64 splits x (128 + 2) f32.
        assert_eq!(b[&WorkBuf::PartO] + b[&WorkBuf::PartMs], 32 * 64 * 130 * 4);
        // One slot's row processing: a 16-byte header, 151,936 mask bits (18,992 bytes) and
        // 16,384 edits of 16 bytes.
        assert_eq!(b[&WorkBuf::SampleProc], 16 + 18_992 + 16_384 * 16);
        let total = stage_bytes(BackendKind::Gpu, &a3b(), 48, true, &p);
        // yd 32 + h 12 + q 8 + att 8 + xh 6 + x 4 + xn 4 + k 1 + v 1 = 76 MiB, then the
        // partials (1.02), logits (0.58), router (0.25), 48 layers' expert tables (0.14) and
        // the sample_proc row (0.27): 78.3 MiB.
        assert!(
            (78 * MIB + 3 * MIB / 10..78 * MIB + 4 * MIB / 10).contains(&total),
            "{total}"
        );
        // The matrix-vector path alone (no tensor-core buffers) needs 38 MiB less.
        let mv = stage_bytes(
            BackendKind::Gpu,
            &a3b(),
            48,
            true,
            &Pass { gemm: false, ..p },
        );
        assert!(
            (40 * MIB + 3 * MIB / 10..40 * MIB + 4 * MIB / 10).contains(&mv),
            "{mv}"
        );
    }

    #[test]
    fn names_round_trip_and_are_unique() {
        let mut seen = std::collections::BTreeSet::new();
        for &b in WorkBuf::ALL {
            assert_eq!(WorkBuf::from_name(b.name()), Some(b));
            assert!(seen.insert(b.name()), "{} twice", b.name());
        }
        assert_eq!(WorkBuf::from_name("attn.q"), None);
    }

    #[test]
    fn each_backend_binds_each_buffer_once() {
        let p = Pass {
            tokens: 7,
            logit_rows: 2,
            att_splits: 3,
            slots: 2,
            gemm: true,
            mtp: false,
        };
        for be in [BackendKind::Cpu, BackendKind::Gpu] {
            let list = buffers(be, &a3b(), 2, false, &p);
            let set: std::collections::BTreeSet<_> = list.iter().map(|(b, _)| *b).collect();
            assert_eq!(set.len(), list.len(), "{be:?}");
        }
    }

    #[test]
    fn splits_follow_the_forward_graph() {
        assert_eq!(att_splits(0), 1);
        assert_eq!(att_splits(16), 1);
        assert_eq!(att_splits(17), 2);
        assert_eq!(att_splits(256), 16);
        assert_eq!(att_splits(1 << 20), 64);
    }

    #[test]
    fn moe_scratch_layout_is_ordered_and_aligned() {
        let m = MoeScratch::new(512, 8, 128);
        assert_eq!(m.n_assign, 4096);
        assert_eq!(m.max_tiles, 4096 / 64 + 128);
        assert!(m.offsets < m.perm && m.perm < m.tiles && m.tiles < m.n_tiles);
        assert!(m.n_tiles < m.bytes);
        for o in [m.perm, m.tiles, m.n_tiles, m.bytes] {
            assert_eq!(o % 16, 0);
        }
        assert_eq!(m.perm, 4 * 129u64.next_multiple_of(4));
        // One token of one choice: one tile at most.
        assert_eq!(MoeScratch::new(1, 1, 128).max_tiles, 1);
    }

    proptest! {
        /// Planning for a larger pass never leaves a backend short for a smaller one.
        #[test]
        fn more_of_anything_never_needs_less(
            tokens in 1usize..600, more in 0usize..300,
            slots in 1usize..8, splits in 1usize..64, gemm: bool, cpu: bool,
        ) {
            let d = a3b();
            let be = if cpu { BackendKind::Cpu } else { BackendKind::Gpu };
            let p = Pass { tokens, logit_rows: slots, att_splits: splits, slots, gemm, mtp: false };
            let base = buffers(be, &d, 4, false, &p);
            let bigger = [
                Pass { tokens: tokens + more, ..p },
                Pass { att_splits: splits + 1, ..p },
                Pass { slots: slots + 1, logit_rows: slots + 1, ..p },
                Pass { gemm: true, ..p },
            ];
            for q in bigger {
                let more = buffers(be, &d, 4, false, &q);
                for ((b, x), (c, y)) in base.iter().zip(&more) {
                    prop_assert_eq!(b, c);
                    prop_assert!(y >= x, "{:?}: {} < {} for {:?}", b, y, x, q);
                }
            }
        }
    }
}
