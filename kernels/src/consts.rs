//! The constants the kernels and their Rust launchers share (weight type codes, tile and
//! block sizes, limits), defined here once: the kernels get them as `#define`s from
//! [`prelude`], prepended to every module, and the launchers use these Rust values.
//! Invariant: no kernel source defines any of these names itself (a test checks), so the two
//! sides cannot drift apart.

/// Weight and KV row types as the kernels number them (the host passes these, not ggml ids).
pub const ST_TY_F32: i32 = 0;
pub const ST_TY_F16: i32 = 1;
pub const ST_TY_BF16: i32 = 2;
pub const ST_TY_Q8_0: i32 = 3;
pub const ST_TY_Q4_K: i32 = 4;
/// Every other weight type: `ST_TY_GGML + its GGUF type id`, read through quants.cuh's
/// 32-value decoders (the five codes above keep their dedicated fast paths).
pub const ST_TY_GGML: i32 = 256;

/// Tokens one few-token product launch handles per grid row (`dq_mv8`, `dq_qkv8`).
pub const DQ_MAX_TOK: usize = 8;
/// Warps per block of the one-row-per-warp products.
pub const DQ_WARPS: u32 = 4;
/// 16-column pieces per lane of the register path of the one-token Q8_0 products (rows of
/// at most `DQ_XR_PIECES x warp x 16` columns take it).
pub const DQ_XR_PIECES: usize = 4;
/// 16-column pieces per lane of the one-token int8-activation Q8_0 product's register path
/// (`dq4_mv1`, dp4a.cu: rows of at most `Q8A_XR_PIECES x warp x 16` columns).
pub const Q8A_XR_PIECES: usize = 8;
/// Columns of each token's q8a row the multi-token int8-activation products (`dq4_mv4/8/16`,
/// dp4a.cu) stage in shared memory at a time: a multiple of a warp's step over Q8_0 (warp x
/// 16) and over the K-quants (256 x warp / 32) for 32- and 64-lane warps, so each lane's sums
/// run in the order of the unstaged loop.
pub const Q8A_KC: usize = 1024;
/// Warps per block of the multi-token products (`dq_rows_mv*`, `dq_rows_qkv*`, rows.cu).
pub const RW_WARPS: u32 = 4;
/// Output rows per warp tile of the multi-token products (each lane holds a quarter of them).
pub const RW_TILE: usize = 16;
/// Input columns the multi-token products stage in shared memory at a time (f32, per token).
pub const RW_KC: usize = 512;
/// Largest top-k of `dq_moe_down_rows` and `dq_moe_down_kq`.
pub const DQ_DOWN_MAXK: usize = 32;
/// Largest head dimension of the attention kernels.
pub const ATT_MAX_D: usize = 256;
/// Largest number of query heads per KV head of the decode attention.
pub const DA_MAXG: usize = 16;
/// Most splits `dq_attn_combine` merges.
pub const DA_MAX_SPLIT: usize = 128;
/// Threads per block of `dq_argmax_rows`.
pub const AM_THREADS: u32 = 256;
/// Threads per block of `sample_rows`.
pub const SP_THREADS: u32 = 1024;
/// Largest vocabulary `sample_rows` takes (its histogram parts count in u32).
pub const SP_MAX_VOCAB: usize = 1 << 19;
/// Tokens (or expert assignments) per tensor-core tile (the planner's MoE tile too).
pub const GM_BN: usize = 64;
/// Columns per tensor-core pipeline stage.
pub const GM_BK: usize = 64;
/// Tensor-core pipeline depth.
pub const GM_STAGES: usize = 3;
/// Query tokens per block of the SIMT prefill attention (`dq_attn_prefill`).
pub const PF_Q: usize = 16;
/// Query tokens and KV cells per tile of the tensor-core prefill attention, and its warps.
pub const FA_BQ: usize = 64;
pub const FA_BKV: usize = 64;
pub const FA_WARPS: u32 = 4;
/// Largest conv width (taps) of the Gated DeltaNet's conv (`lin_conv_silu`).
pub const LIN_MAX_CONV: usize = 16;
/// Most pinned `kv_spill` chunks of one device the KV kernels address (`KvHost`'s table,
/// passed by value: 8 bytes a chunk of the 4 KiB kernel parameter space).
pub const KVH_MAX_CHUNKS: usize = 128;

/// Every shared constant as (name, value), in prelude order.
pub fn all() -> Vec<(&'static str, String)> {
    vec![
        ("ST_TY_F32", ST_TY_F32.to_string()),
        ("ST_TY_F16", ST_TY_F16.to_string()),
        ("ST_TY_BF16", ST_TY_BF16.to_string()),
        ("ST_TY_Q8_0", ST_TY_Q8_0.to_string()),
        ("ST_TY_Q4_K", ST_TY_Q4_K.to_string()),
        ("ST_TY_GGML", ST_TY_GGML.to_string()),
        ("DQ_MAX_TOK", DQ_MAX_TOK.to_string()),
        ("DQ_WARPS", DQ_WARPS.to_string()),
        ("DQ_XR_PIECES", DQ_XR_PIECES.to_string()),
        ("Q8A_XR_PIECES", Q8A_XR_PIECES.to_string()),
        ("Q8A_KC", Q8A_KC.to_string()),
        ("RW_WARPS", RW_WARPS.to_string()),
        ("RW_TILE", RW_TILE.to_string()),
        ("RW_KC", RW_KC.to_string()),
        ("DQ_DOWN_MAXK", DQ_DOWN_MAXK.to_string()),
        ("ATT_MAX_D", ATT_MAX_D.to_string()),
        ("DA_MAXG", DA_MAXG.to_string()),
        ("DA_MAX_SPLIT", DA_MAX_SPLIT.to_string()),
        ("AM_THREADS", AM_THREADS.to_string()),
        ("SP_THREADS", SP_THREADS.to_string()),
        ("SP_MAX_VOCAB", SP_MAX_VOCAB.to_string()),
        ("GM_BN", GM_BN.to_string()),
        ("GM_BK", GM_BK.to_string()),
        ("GM_STAGES", GM_STAGES.to_string()),
        ("PF_Q", PF_Q.to_string()),
        ("FA_BQ", FA_BQ.to_string()),
        ("FA_BKV", FA_BKV.to_string()),
        ("FA_WARPS", FA_WARPS.to_string()),
        ("LIN_MAX_CONV", LIN_MAX_CONV.to_string()),
        ("KVH_MAX_CHUNKS", KVH_MAX_CHUNKS.to_string()),
    ]
}

/// The `#define`s every kernel module is compiled with.
pub fn prelude() -> String {
    let mut s = String::from("// Generated from strata-kernels' consts.rs.\n");
    for (name, value) in all() {
        s.push_str(&format!("#define {name} {value}\n"));
    }
    s
}
