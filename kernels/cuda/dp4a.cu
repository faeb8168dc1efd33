// dp4a.cu: the decode products over int8 activations (the default for Q8_0 weights,
// `--kernel-options dp4a` for Q4_K, Q6_K and IQ3_S too): dq_quant_q8a quantizes a product's
// input rows once to blocks of 32 ("q8a": int8 quants, and per block its scale d and s = d *
// the sum of its quants), and the products over Q8_0 (split layout), Q4_K, Q6_K and IQ3_S
// weights dot 4 weight quants with 4 activation quants per dp4a instruction: the one- and
// few-token matrix-vector products (up to three matrices stacked by rows, so Q/K/V is one
// launch), the MoE gate/up with SwiGLU and the MoE down with the weighted sum.
//
// q8a layout of n rows of `cols` (cols % 32 == 0): the quants, n x cols bytes row-major (xq),
// then n x cols / 32 float2 (d, s) (xds). d = amax / 127 and q = round(x * (127 / amax))
// (round half away from zero; an all-zero block has d = 0 and q = 0), so the value a quant
// stands for is d * q, and s is d * sum(q): the products compute W . (d q) exactly up to the
// f32 sums' order. The host's reference of this quantization is launch/dp4a.rs's
// `quantize_q8a`, and its unit tests emulate the lanes' arithmetic below in the same order.
//
// Per lane arithmetic (what the host emulation repeats):
// - Q8_0, a 16-column piece at i0 of a row (block i0 / 32): s = dp4a over the 4 words of the
//   piece (an i32), acc = fmaf(dw * dx, (float)s, acc), dw the weight block's scale, dx the
//   activation block's d.
// - Q4_K, lane l (of 32) of a 256-value block: g = l / 8, j = 4 (l % 8); the lane's quant
//   word at byte 16 + 32 g + j gives 4 low nibbles (columns 64 g + j + 0..3, sub-block 2g,
//   q8a block 8b + 2g) and 4 high nibbles (the same + 32, sub-block 2g + 1). v = (d sc0 dxa)
//   * (float)sa, v = fmaf(d sc1 dxb, (float)sb, v); lanes with l % 8 == 0 add the
//   sub-blocks' mins once: v = fmaf(-(dmin m0), sa_blk, v), v = fmaf(-(dmin m1), sb_blk, v)
//   (the q8a blocks' s); acc += v.
// - Q6_K: see qa_q6k_lane below (two runs of 4 six-bit values minus 32, a scale each).
// - IQ3_S, lane l (of 32) of a 256-value block: gi = l / 4 (its 32-value sub-block, q8a
//   block 8b + gi), h = l % 4; columns 8 l + 0..7 are two grid rows, IQ3S_GRID[qs[k] | ninth
//   bit << 8] and IQ3S_GRID[qs[k + 1] | ...] (k = 8 gi + 2 h, the ninth bits 2h and 2h + 1 of
//   qh[gi]), 4 unsigned bytes each (odd values 1..15), negated where sign bits 0..3 / 4..7
//   of signs[4 gi + h] are set, without branches: m = the bits spread one a byte (0x01),
//   q = (g ^ (m * 0xFF)) + m (two's complement per byte; no carry crosses a byte since no
//   grid byte is 0). s = dp4a(qb, xb, dp4a(qa, xa, 0)) (xa, xb the q8a words at 8 l and
//   8 l + 4), acc = fmaf(k dx, (float)s, acc), k = d (1 + 2 scale nibble gi), dx the q8a
//   block's d; no mins.
// Then a warp's lanes are summed by st_warp_sum (one warp per row), or for the MoE down a
// block's by st_block_sum (one block per output row).
// Invariant: rows past `rows` and tokens past `n_tok` are never read or written; q8a rows are
// 16-byte aligned (the launchers check xq and xds); Q4_K, Q6_K and IQ3_S rows hold whole
// 256-value blocks.

// a . b over 4 signed bytes each, plus c. CUDA: one dp4a instruction (sm_61 on); HIP: the
// same sum byte by byte (portable; AMD's dot4 builtins differ per generation).
__device__ __forceinline__ int st_dp4a(int a, int b, int c) {
#ifdef ST_CUDA
    return __dp4a(a, b, c);
#else
#pragma unroll
    for (int k = 0; k < 4; ++k)
        c += (int)(i8)((a >> (8 * k)) & 0xff) * (int)(i8)((b >> (8 * k)) & 0xff);
    return c;
#endif
}

// Max / sum over the QA_GROUP lanes of the calling lane's group: a q8a block's 32 values
// are quantized by 32 lanes (a whole warp on CUDA, half a wave64 on AMD, whose xor steps below
// 32 stay inside the half).
#define QA_GROUP 32
__device__ __forceinline__ float qa_group_max(float v) {
#pragma unroll
    for (int m = QA_GROUP / 2; m > 0; m >>= 1) v = fmaxf(v, ST_SHFL_XOR(v, m));
    return v;
}
__device__ __forceinline__ int qa_group_isum(int v) {
#pragma unroll
    for (int m = QA_GROUP / 2; m > 0; m >>= 1) v += ST_SHFL_XOR(v, m);
    return v;
}

// x (n rows of cols f32) -> q8a: each group of QA_GROUP lanes quantizes one block (lane i
// its value i). grid: (ceil(cols / 32 / (blockDim / 32)), n); block: a multiple of the warp.
ST_KERNEL void dq_quant_q8a(const float* x, int cols, u8* xq, float2* xds) {
    st_pdl_enter();
    const int t = blockIdx.y, nb = cols / 32;
    const int b = blockIdx.x * (blockDim.x / QA_GROUP) + threadIdx.x / QA_GROUP;
    const int lane = threadIdx.x % QA_GROUP;
    if (b >= nb) return;  // whole groups
    const long i = (long)t * cols + 32 * b + lane;
    const float v = x[i];
    const float amax = qa_group_max(fabsf(v));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const int q = (int)roundf(v * inv);
    const int s = qa_group_isum(q);
    xq[i] = (u8)(i8)q;
    if (lane == 0) {
        const float d = amax / 127.0f;
        xds[(long)t * nb + b] = make_float2(d, d * (float)s);
    }
}

// The lane's part of one Q8_0 weight piece (16 quants q, scale dw, at column i0) . the q8a
// row (xq, xds) of the same columns.
__device__ __forceinline__ float qa_q8_piece(int4 q, float dw, const u8* xq, const float2* xds,
                                             long i0, float acc) {
    const int4 a = *(const int4*)(xq + i0);
    int s = st_dp4a(q.x, a.x, 0);
    s = st_dp4a(q.y, a.y, s);
    s = st_dp4a(q.z, a.z, s);
    s = st_dp4a(q.w, a.w, s);
    return fmaf(dw * xds[i0 / 32].x, (float)s, acc);
}

// Lane l's fixed part of a Q4_K block: its quant words and the scales of its two sub-blocks.
struct QaQ4k {
    int qa, qb;
    float ka, kb, ma, mb;
};

__device__ __forceinline__ void qa_q4k_lane(const u8* blk, int l, QaQ4k& w) {
    const int g = l >> 3, j = 4 * (l & 7);
    const float d = st_h2f(st_ld_u16(blk)), dmin = st_h2f(st_ld_u16(blk + 2));
    float sc0, m0, sc1, m1;
    st_scale_min_k4(2 * g, blk + 4, &sc0, &m0);
    st_scale_min_k4(2 * g + 1, blk + 4, &sc1, &m1);
    const u32 qs = *(const u32*)(blk + 16 + 32 * g + j);
    w.qa = (int)(qs & 0x0F0F0F0Fu);
    w.qb = (int)((qs >> 4) & 0x0F0F0F0Fu);
    w.ka = d * sc0;
    w.kb = d * sc1;
    w.ma = dmin * m0;
    w.mb = dmin * m1;
}

// acc + lane l's part of block b (of a row) . the q8a row (xq, xds): see the file comment.
__device__ __forceinline__ float qa_q4k_dot(const QaQ4k& w, int l, long b, const u8* xq,
                                            const float2* xds, float acc) {
    const int g = l >> 3, j = 4 * (l & 7);
    const long ia = b * QK_K + 64 * g + j;
    const float2 da = xds[b * 8 + 2 * g], db = xds[b * 8 + 2 * g + 1];
    const int sa = st_dp4a(w.qa, *(const int*)(xq + ia), 0);
    const int sb = st_dp4a(w.qb, *(const int*)(xq + ia + 32), 0);
    float v = (w.ka * da.x) * (float)sa;
    v = fmaf(w.kb * db.x, (float)sb, v);
    if ((l & 7) == 0) {
        v = fmaf(-w.ma, da.y, v);
        v = fmaf(-w.mb, db.y, v);
    }
    return acc + v;
}

// Q6_K (210-byte blocks, 2-byte aligned: 4-byte fields read as two u16), lane l (of 32) of a
// 256-value block as products.cuh's dq_kq_lane maps it: n = l / 16, h = (l / 8) % 2, j = 4 (l %
// 8); its ql word at 64 n + 32 h + j and qh word at 128 + 32 n + j give 4 six-bit values at
// columns 128 n + 32 h + j + 0..3 (scale 8 n + 2 h + (l % 8) / 4, q8a block 8b + 4n + h) and 4
// at the same + 64 (scale + 4, q8a block + 2); each minus 32 as a signed byte (a bytewise
// subtraction: each byte lifted by 0x80 first, so no borrow crosses bytes). v = (d sc_a dxa)
// * (float)sa, v = fmaf(d sc_b dxb, (float)sb, v); no mins.
struct QaQ6k {
    int qa, qb;
    float ka, kb;
};

__device__ __forceinline__ int qa_sub32x4(u32 v) {
    return (int)(((v | 0x80808080u) - 0x20202020u) ^ 0x80808080u);
}

__device__ __forceinline__ void qa_q6k_lane(const u8* b, int l, QaQ6k& w) {
    const int n = l >> 4, h = (l >> 3) & 1, j = 4 * (l & 7);
    const u32 ql = dq_ld_u32_a2(b + 64 * n + 32 * h + j);
    const u32 qh = dq_ld_u32_a2(b + 128 + 32 * n + j);
    w.qa = qa_sub32x4((ql & 0x0F0F0F0Fu) | (((qh >> (2 * h)) & 0x03030303u) << 4));
    w.qb = qa_sub32x4(((ql >> 4) & 0x0F0F0F0Fu) | (((qh >> (4 + 2 * h)) & 0x03030303u) << 4));
    const float d = st_h2f(st_ld_u16(b + 208));
    const int sc = 8 * n + 2 * h + ((l & 7) >> 2);
    w.ka = d * (float)(i8)b[192 + sc];
    w.kb = d * (float)(i8)b[192 + sc + 4];
}

__device__ __forceinline__ float qa_q6k_dot(const QaQ6k& w, int l, long b, const u8* xq,
                                            const float2* xds, float acc) {
    const int n = l >> 4, h = (l >> 3) & 1, j = 4 * (l & 7);
    const long ia = b * QK_K + 128 * n + 32 * h + j;
    const float da = xds[b * 8 + 4 * n + h].x, db = xds[b * 8 + 4 * n + h + 2].x;
    const int sa = st_dp4a(w.qa, *(const int*)(xq + ia), 0);
    const int sb = st_dp4a(w.qb, *(const int*)(xq + ia + 64), 0);
    float v = (w.ka * da) * (float)sa;
    v = fmaf(w.kb * db, (float)sb, v);
    return acc + v;
}

#define QA_TY_Q6_K (ST_TY_GGML + QT_Q6_K)

// IQ3_S (110-byte blocks, 2-byte aligned), lane l as products.cuh's dq_kq_lane maps it (the
// file comment gives the arithmetic): the lane's 8 signed grid values as two int8 words and
// the scale of its 32-value sub-block.
struct QaIq3s {
    int qa, qb;
    float k;
};

// 4 grid bytes g (each 1..15) with byte j negated where bit j of `bits` is set.
__device__ __forceinline__ int qa_signed4(u32 g, u32 bits) {
    // (bits & 15) * 0x00204081 puts copies of the nibble at bits 0, 7, 14 and 21 (no overlap,
    // no carry), so bit j lands on bit 8 j: one 0x01 a negated byte.
    const u32 m = ((bits & 0xFu) * 0x00204081u) & 0x01010101u;
    return (int)((g ^ (m * 0xFFu)) + m);
}

__device__ __forceinline__ void qa_iq3s_lane(const u8* b, int l, QaIq3s& w) {
    const int gi = l >> 2, h = l & 3, k = 8 * gi + 2 * h;
    const u32 qs = st_ld_u16(b + 2 + k);
    const u32 qh = b[66 + gi];
    const u32 g0 = IQ3S_GRID[(qs & 0xFFu) | (((qh >> (2 * h)) & 1u) << 8)];
    const u32 g1 = IQ3S_GRID[(qs >> 8) | (((qh >> (2 * h + 1)) & 1u) << 8)];
    const u32 sg = b[74 + 4 * gi + h];
    w.qa = qa_signed4(g0, sg);
    w.qb = qa_signed4(g1, sg >> 4);
    w.k = st_h2f(st_ld_u16(b)) * (float)(1 + 2 * ((b[106 + (gi >> 1)] >> (4 * (gi & 1))) & 15));
}

__device__ __forceinline__ float qa_iq3s_dot(const QaIq3s& w, int l, long b, const u8* xq,
                                             const float2* xds, float acc) {
    const int2 a = *(const int2*)(xq + b * QK_K + 8 * l);
    const int s = st_dp4a(w.qb, a.y, st_dp4a(w.qa, a.x, 0));
    return fmaf(w.k * xds[b * 8 + (l >> 2)].x, (float)s, acc);
}

#define QA_TY_IQ3_S (ST_TY_GGML + QT_IQ3_S)

// Columns of every token's q8a row that a block of the multi-token products (NT > 1) stages
// in shared memory at a time (Q8A_KC, kernels/src/consts.rs): a multiple of a warp's Q8_0
// step (ST_WARP x 16 columns) and of its Q4_K / Q6_K step (ST_WARP / 32 blocks of 256), so
// each lane walks its columns in the order it would over the whole row, and the staged
// products equal the unstaged bit for bit. IQ3_S walks blocks of 256 as the K-quants do.
#define QA_KC Q8A_KC

// acc[t] += the lane's part of row r of W (rows x cols, Q8_0 split, Q4_K, Q6_K or IQ3_S) . q8a
// row t over the columns [c0, c1) (c0 a multiple of QA_KC, c1 of 32, or of 256 for the
// 256-value blocks), for t < n_tok: token t's quants of those columns at xq + t * xstride
// (column c0 first) and its (d, s) pairs at xds + t * dstride (block c0 / 32 first): the
// whole rows in global memory (c0 = 0, c1 = cols, strides cols and cols / 32) or a staged
// chunk.
template <int NT>
__device__ __forceinline__ void qa_row(const u8* __restrict__ W, int ty, long rows, long cols,
                                       long r, long c0, long c1, const u8* xq, long xstride,
                                       const float2* xds, long dstride, int n_tok,
                                       float (&acc)[NT]) {
    const int lane = threadIdx.x % ST_WARP;
    const long nq = cols / 32, b0 = c0 / QK_K;
    if (ty == ST_TY_Q4_K) {
        const int l = lane & 31;
        const u8* wr = W + r * (cols / QK_K) * Q4_K_BYTES;
        for (long b = b0 + (lane >> 5); b < c1 / QK_K; b += ST_WARP / 32) {
            QaQ4k w;
            qa_q4k_lane(wr + b * Q4_K_BYTES, l, w);
#pragma unroll
            for (int t = 0; t < NT; ++t)
                if (t < n_tok)
                    acc[t] = qa_q4k_dot(w, l, b - b0, xq + t * xstride, xds + t * dstride, acc[t]);
        }
        return;
    }
    if (ty == QA_TY_Q6_K) {
        const int l = lane & 31;
        const u8* wr = W + r * (cols / QK_K) * 210;
        for (long b = b0 + (lane >> 5); b < c1 / QK_K; b += ST_WARP / 32) {
            QaQ6k w;
            qa_q6k_lane(wr + b * 210, l, w);
#pragma unroll
            for (int t = 0; t < NT; ++t)
                if (t < n_tok)
                    acc[t] = qa_q6k_dot(w, l, b - b0, xq + t * xstride, xds + t * dstride, acc[t]);
        }
        return;
    }
    if (ty == QA_TY_IQ3_S) {
        const int l = lane & 31;
        const u8* wr = W + r * (cols / QK_K) * 110;
        for (long b = b0 + (lane >> 5); b < c1 / QK_K; b += ST_WARP / 32) {
            QaIq3s w;
            qa_iq3s_lane(wr + b * 110, l, w);
#pragma unroll
            for (int t = 0; t < NT; ++t)
                if (t < n_tok)
                    acc[t] = qa_iq3s_dot(w, l, b - b0, xq + t * xstride, xds + t * dstride, acc[t]);
        }
        return;
    }
    const u8* qs = W + r * cols;
    const u16* ds = (const u16*)(W + rows * cols) + r * nq;
#pragma unroll 2
    for (long i0 = c0 + lane * 16; i0 < c1; i0 += ST_WARP * 16) {
        const int4 q = *(const int4*)(qs + i0);
        const float dw = st_h2f(ds[i0 / 32]);
#pragma unroll
        for (int t = 0; t < NT; ++t)
            if (t < n_tok)
                acc[t] = qa_q8_piece(q, dw, xq + t * xstride, xds + t * dstride, i0 - c0, acc[t]);
    }
}

// Up to three matrices of `cols` stacked by rows, each of its own type (Q/K/V of Q4_K_M: Q4_K
// with a Q6_K V; an IQ3_S file's IQ3_S Q/K with a Q4_K V; a lone product: r1 = r2 = 0).
struct QaMats {
    const u8* w0;
    const u8* w1;
    const u8* w2;
    float* y0;
    float* y1;
    float* y2;
    int r0, r1, r2;
    int t0, t1, t2;  // each matrix's weight code
};

// Stacked row r -> its matrix's weights, output, rows and type, r made local; false past the
// end.
__device__ __forceinline__ bool qa_pick(const QaMats& m, int& r, const u8*& W, float*& y,
                                        int& rows, int& ty) {
    W = m.w0; y = m.y0; rows = m.r0; ty = m.t0;
    if (r >= m.r0) {
        r -= m.r0;
        W = m.w1; y = m.y1; rows = m.r1; ty = m.t1;
        if (r >= m.r1) {
            r -= m.r1;
            W = m.w2; y = m.y2; rows = m.r2; ty = m.t2;
        }
    }
    return r < rows;
}

// y[t0 + t][r] (+)= the warp's sums of acc[t], t < n_tok (lane 0 writes).
template <int NT>
__device__ __forceinline__ void qa_store(float (&acc)[NT], float* y, int rows, int r, int t0,
                                         int n_tok, int add) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (t < n_tok) {
            const float sum = st_warp_sum(acc[t]);
            if (threadIdx.x % ST_WARP == 0) {
                float* o = y + (long)(t0 + t) * rows + r;
                *o = add ? *o + sum : sum;
            }
        }
    }
}

// The multi-token products' loop (qa_mv_body, NT > 1): the block's warps take rows
// g0 + warp for g0 = blockIdx.x * DQ_WARPS, + gridDim.x * DQ_WARPS, ... (uniform over the
// block, so every warp meets the barriers), and for each QA_KC columns the block first stages
// the n_tok tokens' quants (16 bytes a thread a step) and (d, s) pairs in shared memory, so
// each weight is read once and every token's activations come from shared memory rather
// than once per row from L1. xq, xds at token t0 (rows of cols). Static shared memory:
// NT x (QA_KC + QA_KC / 4) bytes (20 KiB at NT = 16).
template <int NT>
__device__ __forceinline__ void qa_mv_staged(const QaMats& m, int cols, const u8* xq,
                                             const float2* xds, int n_tok, int add, int t0) {
    __shared__ __align__(16) u8 sq[NT * QA_KC];
    __shared__ __align__(16) float2 sds[NT * (QA_KC / 32)];
    const int total = m.r0 + m.r1 + m.r2;
    const long nq = cols / 32;
    for (int g0 = blockIdx.x * DQ_WARPS; g0 < total; g0 += gridDim.x * DQ_WARPS) {
        int r = g0 + threadIdx.x / ST_WARP;
        const u8* W;
        float* y;
        int rows, ty;
        const bool mine = r < total && qa_pick(m, r, W, y, rows, ty);
        float acc[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
        for (int c0 = 0; c0 < cols; c0 += QA_KC) {
            const int kc = min(QA_KC, cols - c0);  // a multiple of 32
            const int v16 = kc / 16, nb = kc / 32;
            __syncthreads();  // the previous chunk's readers are done
            for (int i = threadIdx.x; i < n_tok * v16; i += blockDim.x) {
                const int t = i / v16, v = i - t * v16;
                *(int4*)(sq + t * QA_KC + 16 * v) =
                    *(const int4*)(xq + (long)t * cols + c0 + 16 * v);
            }
            for (int i = threadIdx.x; i < n_tok * nb; i += blockDim.x) {
                const int t = i / nb, b = i - t * nb;
                sds[t * (QA_KC / 32) + b] = xds[(long)t * nq + c0 / 32 + b];
            }
            __syncthreads();
            if (mine)
                qa_row<NT>(W, ty, rows, cols, r, c0, c0 + kc, sq, QA_KC, sds, QA_KC / 32, n_tok,
                           acc);
        }
        if (mine) qa_store<NT>(acc, y, rows, r, t0, n_tok, add);
    }
}

// One token over Q8_0 rows of at most QA_XR_COLS columns: the lane's activation pieces (the
// same 16-column pieces at lane * 16 + u * warp * 16 in every row) and their scales held in
// registers while the warp walks its rows (a capped grid over a tall matrix, the LM head).
#define QA_XR_COLS (Q8A_XR_PIECES * ST_WARP * 16)

// y[t][r] (+)= W_r . q8a[t] for t < n_tok over the stacked rows: warp w of the grid takes
// rows w, w + gridDim.x * DQ_WARPS, ... (one each unless the host capped the grid), NT tokens
// a grid row; with NT > 1 and `stage` the block stages the tokens' q8a rows in shared memory
// (qa_mv_staged; the same sums bit for bit), else each warp reads them from global memory.
// grid: (at most ceil((r0 + r1 + r2) / DQ_WARPS), ceil(n_tok / NT)); block: DQ_WARPS warps.
template <int NT>
__device__ __forceinline__ void qa_mv_body(const QaMats& m, int cols, const u8* xq,
                                           const float2* xds, int n_tok, int add, int stage) {
    const int total = m.r0 + m.r1 + m.r2;
    const int w0 = blockIdx.x * DQ_WARPS + threadIdx.x / ST_WARP;
    const int stride = gridDim.x * DQ_WARPS;
    const int lane = threadIdx.x % ST_WARP;
    {
        int r = w0;
        const u8* W;
        float* y;
        int rows, ty;
        if (blockIdx.y == 0 && qa_pick(m, r, W, y, rows, ty)) dq_prefetch_row(W, ty, rows, cols, r);
    }
    st_pdl_enter();
    const int t0 = blockIdx.y * NT;
    if (t0 >= n_tok) return;
    n_tok = min(NT, n_tok - t0);
    xq += (long)t0 * cols;
    xds += (long)t0 * (cols / 32);
    const bool q8 = m.t0 == ST_TY_Q8_0 && m.t1 == ST_TY_Q8_0 && m.t2 == ST_TY_Q8_0;
    if (NT == 1 && q8 && cols <= QA_XR_COLS) {
        int4 xr[Q8A_XR_PIECES];
        float xd[Q8A_XR_PIECES];
#pragma unroll
        for (int u = 0; u < Q8A_XR_PIECES; ++u) {
            const int i0 = lane * 16 + u * ST_WARP * 16;
            xr[u] = make_int4(0, 0, 0, 0);
            xd[u] = 0.0f;
            if (i0 < cols) {
                xr[u] = *(const int4*)(xq + i0);
                xd[u] = xds[i0 / 32].x;
            }
        }
        for (int g = w0; g < total; g += stride) {
            int r = g;
            const u8* W;
            float* y;
            int rows, ty;
            qa_pick(m, r, W, y, rows, ty);
            const u8* qs = W + (long)r * cols;
            const u16* ds = (const u16*)(W + (long)rows * cols) + (long)r * (cols / 32);
            float acc = 0.0f;
#pragma unroll
            for (int u = 0; u < Q8A_XR_PIECES; ++u) {
                const int i0 = lane * 16 + u * ST_WARP * 16;
                if (i0 < cols) {
                    const int4 q = *(const int4*)(qs + i0);
                    const float dw = st_h2f(ds[i0 / 32]);
                    int s = st_dp4a(q.x, xr[u].x, 0);
                    s = st_dp4a(q.y, xr[u].y, s);
                    s = st_dp4a(q.z, xr[u].z, s);
                    s = st_dp4a(q.w, xr[u].w, s);
                    acc = fmaf(dw * xd[u], (float)s, acc);
                }
            }
            const float sum = st_warp_sum(acc);
            if (lane == 0) {
                float* o = y + (long)t0 * rows + r;
                *o = add ? *o + sum : sum;
            }
        }
        return;
    }
    if (NT > 1 && stage) {
        qa_mv_staged<NT>(m, cols, xq, xds, n_tok, add, t0);
        return;
    }
    for (int g = w0; g < total; g += stride) {
        int r = g;
        const u8* W;
        float* y;
        int rows, ty;
        qa_pick(m, r, W, y, rows, ty);
        float acc[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
        qa_row<NT>(W, ty, rows, cols, r, 0, cols, xq, cols, xds, cols / 32, n_tok, acc);
        qa_store<NT>(acc, y, rows, r, t0, n_tok, add);
    }
}

ST_KERNEL void dq4_mv1(const u8* w0, const u8* w1, const u8* w2, int t0, int t1, int t2,
                        int r0, int r1, int r2, int cols, const u8* xq, const float2* xds,
                        float* y0, float* y1, float* y2, int n_tok, int add, int stage) {
    qa_mv_body<1>(QaMats{w0, w1, w2, y0, y1, y2, r0, r1, r2, t0, t1, t2}, cols, xq, xds,
                    n_tok, add, stage);
}

ST_KERNEL void dq4_mv4(const u8* w0, const u8* w1, const u8* w2, int t0, int t1, int t2,
                        int r0, int r1, int r2, int cols, const u8* xq, const float2* xds,
                        float* y0, float* y1, float* y2, int n_tok, int add, int stage) {
    qa_mv_body<4>(QaMats{w0, w1, w2, y0, y1, y2, r0, r1, r2, t0, t1, t2}, cols, xq, xds,
                    n_tok, add, stage);
}

ST_KERNEL void dq4_mv8(const u8* w0, const u8* w1, const u8* w2, int t0, int t1, int t2,
                        int r0, int r1, int r2, int cols, const u8* xq, const float2* xds,
                        float* y0, float* y1, float* y2, int n_tok, int add, int stage) {
    qa_mv_body<8>(QaMats{w0, w1, w2, y0, y1, y2, r0, r1, r2, t0, t1, t2}, cols, xq, xds,
                    n_tok, add, stage);
}

ST_KERNEL void dq4_mv16(const u8* w0, const u8* w1, const u8* w2, int t0, int t1, int t2,
                        int r0, int r1, int r2, int cols, const u8* xq, const float2* xds,
                        float* y0, float* y1, float* y2, int n_tok, int add, int stage) {
    qa_mv_body<16>(QaMats{w0, w1, w2, y0, y1, y2, r0, r1, r2, t0, t1, t2}, cols, xq, xds,
                    n_tok, add, stage);
}

// One token, row r of two Q8_0 matrices (F x E, the experts' gate and up): g and u += the
// lane's parts of G_r . q8a and U_r . q8a, the two rows' loads in flight together (each
// row's arithmetic as qa_row<1>'s, in the same order).
__device__ __forceinline__ void qa_pair_q8(const u8* __restrict__ G, const u8* __restrict__ U,
                                           long F, long E, long r, const u8* xq,
                                           const float2* xds, float& g, float& u) {
    const int lane = threadIdx.x % ST_WARP;
    const u8* gq = G + r * E;
    const u8* uq = U + r * E;
    const u16* gd = (const u16*)(G + F * E) + r * (E / 32);
    const u16* ud = (const u16*)(U + F * E) + r * (E / 32);
#pragma unroll 2
    for (long i0 = lane * 16; i0 < E; i0 += ST_WARP * 16) {
        const int4 qg = *(const int4*)(gq + i0);
        const int4 qu = *(const int4*)(uq + i0);
        const float dg = st_h2f(gd[i0 / 32]), du = st_h2f(ud[i0 / 32]);
        g = qa_q8_piece(qg, dg, xq, xds, i0, g);
        u = qa_q8_piece(qu, du, xq, xds, i0, u);
    }
}

// One token, row r of two IQ3_S matrices (F x E, the experts' gate and up): g and u += the
// lane's parts of G_r . q8a and U_r . q8a, the two rows' loads in flight together, two blocks
// at a time (each row's arithmetic as qa_row<1>'s, in the same order).
__device__ __forceinline__ void qa_pair_iq3s(const u8* __restrict__ G, const u8* __restrict__ U,
                                             long E, long r, const u8* xq, const float2* xds,
                                             float& g, float& u) {
    const int lane = threadIdx.x % ST_WARP, l = lane & 31;
    const long rb = (E / QK_K) * 110;
    const u8* gr = G + r * rb;
    const u8* ur = U + r * rb;
#pragma unroll 2
    for (long b = lane >> 5; b < E / QK_K; b += ST_WARP / 32) {
        QaIq3s wg, wu;
        qa_iq3s_lane(gr + b * 110, l, wg);
        qa_iq3s_lane(ur + b * 110, l, wu);
        g = qa_iq3s_dot(wg, l, b, xq, xds, g);
        u = qa_iq3s_dot(wu, l, b, xq, xds, u);
    }
}

// MoE gate and up with SwiGLU over q8a inputs: for assignment a = t*k + j (grid.y), e =
// ids[a], h[a][r] = silu(G_e,r . q8a[t]) * (U_e,r . q8a[t]); gate and up of one type ty
// (Q8_0, Q4_K, Q6_K or IQ3_S), F x E each. eptr as dq_moe_gate_up's.
// grid: (ceil(F / DQ_WARPS), n_tok * k).
ST_KERNEL void dq4_moe_gate_up(const unsigned long long* eptr, int ty, int F, int E,
                               const int* ids, int k, const u8* xq, const float2* xds,
                               float* h) {
    st_pdl_enter();  // the expert ids come from a kernel ahead
    const int a = blockIdx.y, t = a / k;
    const int row = blockIdx.x * DQ_WARPS + threadIdx.x / ST_WARP;
    if (row >= F) return;
    const int e = ids[a];
    const u8* G = (const u8*)eptr[(long)e * 3 + 0];
    const u8* U = (const u8*)eptr[(long)e * 3 + 1];
    const u8* xt = xq + (long)t * E;
    const float2* dt = xds + (long)t * (E / 32);
    float g[1] = {0.0f}, u[1] = {0.0f};
    if (ty == ST_TY_Q8_0) {
        qa_pair_q8(G, U, F, E, row, xt, dt, g[0], u[0]);
    } else if (ty == QA_TY_IQ3_S) {
        qa_pair_iq3s(G, U, E, row, xt, dt, g[0], u[0]);
    } else {
        qa_row<1>(G, ty, F, E, row, 0, E, xt, E, dt, E / 32, 1, g);
        qa_row<1>(U, ty, F, E, row, 0, E, xt, E, dt, E / 32, 1, u);
    }
    const float gs = st_warp_sum(g[0]), us = st_warp_sum(u[0]);
    if (threadIdx.x % ST_WARP == 0) h[(long)a * F + row] = dq_silu(gs) * us;
}

// MoE down over q8a expert rows (h quantized: n_tok * k rows of F), a block per output row:
// y[t][r] += sum_j wts[t*k+j] * (D_{ids[t*k+j]},r . q8a[t*k+j]). Q8_0: the k experts'
// 16-quant pieces spread over the block's threads; Q4_K, Q6_K, IQ3_S: their 256-value blocks
// over its warps (32 lanes a block). Each thread's terms are weighted (tot = fmaf(w_j, part,
// tot)), then summed by st_block_sum. grid: (E, n_tok); block: 128; k <= DQ_DOWN_MAXK.
ST_KERNEL void dq4_moe_down(const unsigned long long* eptr, int ty, int E, int F,
                            const int* ids, const float* wts, int k, const u8* hq,
                            const float2* hds, float* y) {
    __shared__ const u8* dm[DQ_DOWN_MAXK];
    __shared__ float dw[DQ_DOWN_MAXK];
    __shared__ float red[32];
    const int row = blockIdx.x, t = blockIdx.y;
    const long rb = ty == ST_TY_Q4_K    ? (long)(F / QK_K) * Q4_K_BYTES
                    : ty == QA_TY_Q6_K  ? (long)(F / QK_K) * 210
                    : ty == QA_TY_IQ3_S ? (long)(F / QK_K) * 110
                                        : F;
    // Before the wait, as dq_moe_down_rows: the ids were written kernels ahead (complete by
    // now, see st_pdl_wait), read through L2; the warps prefetch the experts' rows in turn.
    for (int j = threadIdx.x / ST_WARP; j < k; j += blockDim.x / ST_WARP) {
        const u8* D = (const u8*)eptr[(long)st_ldcg(ids + (long)t * k + j) * 3 + 2];
        dq_prefetch_row(D, ty, E, F, row);
    }
    st_pdl_enter();
    if (threadIdx.x < k) {
        const long a = (long)t * k + threadIdx.x;
        dm[threadIdx.x] = (const u8*)eptr[(long)ids[a] * 3 + 2];
        dw[threadIdx.x] = wts[a];
    }
    __syncthreads();
    const long nq = F / 32;
    const u8* hqt = hq + (long)t * k * F;
    const float2* hdt = hds + (long)t * k * nq;
    float tot = 0.0f;
    if (ty == ST_TY_Q4_K || ty == QA_TY_Q6_K || ty == QA_TY_IQ3_S) {
        const int lane = threadIdx.x % ST_WARP, l = lane & 31;
        const int nb = F / QK_K, span = ST_WARP / 32;
        const int step = (blockDim.x / ST_WARP) * span;
        for (int p = (threadIdx.x / ST_WARP) * span + (lane >> 5); p < k * nb; p += step) {
            const int j = p / nb, b = p - j * nb;
            float part;
            if (ty == QA_TY_IQ3_S) {
                QaIq3s w;
                qa_iq3s_lane(dm[j] + (long)row * rb + (long)b * 110, l, w);
                part = qa_iq3s_dot(w, l, b, hqt + (long)j * F, hdt + j * nq, 0.0f);
            } else if (ty == QA_TY_Q6_K) {
                QaQ6k w;
                qa_q6k_lane(dm[j] + (long)row * rb + (long)b * 210, l, w);
                part = qa_q6k_dot(w, l, b, hqt + (long)j * F, hdt + j * nq, 0.0f);
            } else {
                QaQ4k w;
                qa_q4k_lane(dm[j] + (long)row * rb + (long)b * Q4_K_BYTES, l, w);
                part = qa_q4k_dot(w, l, b, hqt + (long)j * F, hdt + j * nq, 0.0f);
            }
            tot = fmaf(dw[j], part, tot);
        }
    } else {
        const int per = F / 16;
#pragma unroll 4
        for (int p = threadIdx.x; p < k * per; p += blockDim.x) {
            const int j = p / per, i0 = (p - j * per) * 16;
            const u8* D = dm[j];
            const int4 q = *(const int4*)(D + (long)row * F + i0);
            const float d = st_h2f(((const u16*)(D + (long)E * F))[(long)row * nq + i0 / 32]);
            const float part = qa_q8_piece(q, d, hqt + (long)j * F, hdt + j * nq, i0, 0.0f);
            tot = fmaf(dw[j], part, tot);
        }
    }
    tot = st_block_sum(tot, red);
    if (threadIdx.x == 0) y[(long)t * E + row] += tot;
}
