//! The CUDA engine's working set on one planned device: the buffers it carves from the
//! device's scratch region (in carve order, with their sizes) and the persistent tables it
//! keeps there. The engine carves exactly these; the planner sizes an NVIDIA device's scratch
//! region to hold them for a pass of the planned ubatch, besides the packed forward graph.
//! Invariant: [`stage_bytes`] is what the engine needs, to the byte, and never shrinks when a
//! pass carries more tokens, more slots or more attention splits.

use crate::graph::{SPLIT_KV_CELLS_PER_SPLIT, SPLIT_KV_MAX_SPLITS};
use crate::inventory::HParams;

/// Alignment of every carved buffer (the kernels' widest loads are 16 bytes).
pub const CARVE_ALIGN: u64 = 16;
/// Tokens (or expert assignments) per tensor-core tile, and so per MoE tile (gemm.cu's
/// GM_BN).
pub const MOE_TILE_TOKENS: usize = 64;

/// Model dimensions that size the working set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkDims {
    /// Hidden width.
    pub e: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    /// Head dimension (K and V alike).
    pub hd: usize,
    /// Rotated dimensions of a head.
    pub n_rot: usize,
    pub n_expert: usize,
    /// Experts per token.
    pub k: usize,
    /// Expert width.
    pub f: usize,
    pub vocab: usize,
}

impl WorkDims {
    pub fn of(hp: &HParams) -> Self {
        Self {
            e: hp.n_embd as usize,
            n_head: hp.n_head as usize,
            n_head_kv: hp.n_head_kv as usize,
            hd: hp.head_dim_k as usize,
            n_rot: hp.rope_dim.unwrap_or(hp.head_dim_k) as usize,
            n_expert: hp.n_expert as usize,
            k: hp.n_expert_used as usize,
            f: hp.n_ff_exp as usize,
            vocab: hp.n_vocab as usize,
        }
    }
}

/// Whether the CUDA engine runs `arch` with these parameters (qwen3moe, every layer MoE), so
/// that its working set is worth planning.
pub fn cuda_runs(arch: &str, hp: &HParams) -> bool {
    arch == "qwen3moe" && hp.n_expert > 0 && hp.n_leading_dense == 0
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
}

/// Blocks per logit row of the device's greedy choice (the CUDA engine's `dq_argmax_rows`).
pub const ARGMAX_BLOCKS: u64 = 64;

/// Bytes of one slot's sampling draw on the device (`sampler::Draw`, sample.cu's SampleDraw).
pub const DRAW_BYTES: u64 = 32;

/// The buffers of one stage's pass, in carve order: `(name, bytes)`, sizes before alignment.
pub fn buffers(d: &WorkDims, p: &Pass) -> Vec<(&'static str, u64)> {
    let f = 4u64;
    let t = p.tokens;
    let dec = p.slots.max(1) as u64;
    let g = |b: u64| if p.gemm { b } else { 0 };
    let q_out = d.n_head * d.hd;
    vec![
        // The normalised input shares `att`'s memory when it fits: xn lives from a norm to
        // the products that read it, att from attention to the output projection, and the
        // two never overlap.
        (
            "xn",
            if q_out >= d.e {
                0
            } else {
                f * (t * d.e) as u64
            },
        ),
        ("xh", g(2 * (t * d.e.max(q_out)).max(t * d.k * d.f) as u64)),
        ("tmp", g(f * (t * d.e) as u64)),
        ("yd", g(f * (t * d.k * d.e) as u64)),
        ("sorted", g(MoeScratch::new(t, d.k, d.n_expert).bytes)),
        ("inputs", 3 * 4 * t as u64),
        ("n_ctx", 4 * t as u64),
        ("x", f * (t * d.e) as u64),
        ("q", f * (t * d.n_head * d.hd) as u64),
        ("k", f * (t * d.n_head_kv * d.hd) as u64),
        ("v", f * (t * d.n_head_kv * d.hd) as u64),
        ("att", f * (t * d.n_head * d.hd) as u64),
        ("part_o", f * dec * (d.n_head * p.att_splits * d.hd) as u64),
        ("part_ms", f * dec * (d.n_head * p.att_splits * 2) as u64),
        ("router", f * (t * d.n_expert) as u64),
        ("ids", 4 * (t * d.k) as u64),
        ("wts", f * (t * d.k) as u64),
        ("h", f * (t * d.k * d.f) as u64),
        ("logits", f * (p.logit_rows * d.vocab) as u64),
        ("inv_freq", f * (d.n_rot / 2).max(1) as u64),
        // The counters of the kernels whose last block finishes the work of the others,
        // zero between launches: one u32 per token for the router's top-k, then one per
        // token and KV head for the decode attention's merge of its splits.
        ("counters", 4 * (t * (1 + d.n_head_kv)) as u64),
        // Greedy decode on the device, per decoding slot: ARGMAX_BLOCKS (value, index)
        // pairs, a counter (zero between launches) and the chosen token.
        ("argmax", dec * (ARGMAX_BLOCKS * 8 + 8)),
        // Sampling on the device: one 32-byte draw (settings and noise key) per slot.
        ("draws", dec * DRAW_BYTES),
    ]
}

fn align(v: u64) -> u64 {
    v.div_ceil(CARVE_ALIGN) * CARVE_ALIGN
}

/// Persistent bytes of a stage of `n_layer` layers: its expert tables, and its norm vectors
/// converted to f32 unless the file stores them so.
pub fn fixed_bytes(d: &WorkDims, n_layer: usize, f32_norms: bool) -> u64 {
    let a = |b: usize| align(b as u64);
    let tables = a(d.n_expert * 3 * 8) * n_layer as u64;
    let norms = if f32_norms {
        0
    } else {
        (a(d.e * 4) * 2 + a(d.hd * 4) * 2) * n_layer as u64 + a(d.e * 4)
    };
    tables + norms
}

/// Scratch bytes a stage of `n_layer` layers needs for passes up to `p`: the persistent
/// tables plus every buffer, each aligned to [`CARVE_ALIGN`].
pub fn stage_bytes(d: &WorkDims, n_layer: usize, f32_norms: bool, p: &Pass) -> u64 {
    fixed_bytes(d, n_layer, f32_norms) + buffers(d, p).iter().map(|(_, b)| align(*b)).sum::<u64>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Qwen3-30B-A3B's shapes.
    fn a3b() -> WorkDims {
        WorkDims {
            e: 2048,
            n_head: 32,
            n_head_kv: 4,
            hd: 128,
            n_rot: 128,
            n_expert: 128,
            k: 8,
            f: 768,
            vocab: 151_936,
        }
    }

    #[test]
    fn a_512_token_pass_of_qwen3_30b_by_hand() {
        let p = Pass {
            tokens: 512,
            logit_rows: 1,
            att_splits: 64,
            slots: 1,
            gemm: true,
        };
        const MIB: u64 = 1 << 20;
        let b: std::collections::BTreeMap<_, _> = buffers(&a3b(), &p).into_iter().collect();
        // The expert outputs before they are combined: 512 tokens x 8 experts x 2048 f32.
        assert_eq!(b["yd"], 32 * MIB);
        // The experts' hidden rows: 512 x 8 x 768 f32.
        assert_eq!(b["h"], 12 * MIB);
        // 16-bit product inputs: the widest is 512 x 8 x 768 (the down projection's).
        assert_eq!(b["xh"], 6 * MIB);
        // q_out (4096) >= hidden (2048): xn lives in att.
        assert_eq!(b["xn"], 0);
        // Decode partials: 1 slot x 32 heads x 64 splits x (128 + 2) f32.
        assert_eq!(b["part_o"] + b["part_ms"], 32 * 64 * 130 * 4);
        let total = stage_bytes(&a3b(), 48, true, &p);
        // yd 32 + h 12 + q 8 + att 8 + xh 6 + x 4 + tmp 4 + k 1 + v 1 = 76 MiB, then the
        // partials (1.02), logits (0.58), router (0.25) and 48 layers' expert tables (0.14):
        // just over 78 MiB.
        assert!((78 * MIB..78 * MIB + MIB / 10).contains(&total), "{total}");
        // The matrix-vector path alone (no tensor-core buffers) needs 42 MiB less.
        let mv = stage_bytes(&a3b(), 48, true, &Pass { gemm: false, ..p });
        assert!((36 * MIB..36 * MIB + MIB / 10).contains(&mv), "{mv}");
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
        /// Planning for a larger pass never leaves the engine short for a smaller one.
        #[test]
        fn more_of_anything_never_needs_less(
            tokens in 1usize..600, more in 0usize..300,
            slots in 1usize..8, splits in 1usize..64, gemm: bool,
        ) {
            let d = a3b();
            let p = Pass { tokens, logit_rows: slots, att_splits: splits, slots, gemm };
            let base = stage_bytes(&d, 4, false, &p);
            let bigger = [
                Pass { tokens: tokens + more, ..p },
                Pass { att_splits: splits + 1, ..p },
                Pass { slots: slots + 1, logit_rows: slots + 1, ..p },
                Pass { gemm: true, ..p },
            ];
            for q in bigger {
                prop_assert!(stage_bytes(&d, 4, false, &q) >= base, "{q:?}");
            }
        }
    }
}
