// matvec.cu: the CUDA engine's few-token products over weights in the device layout
// (products.cuh): matrix-vector products for 1..8 tokens a launch (optionally RMS-normalising
// the input on the fly and/or adding into the output), Q/K/V in one launch, the embedding
// lookup, and the prefill router's split-K F32 product. Every scalar that changes between
// steps is read from device memory, so a step can be captured in a CUDA graph.
// The *_kq kernels do the same over Q5_K / Q6_K rows (products.cuh's K-quant section).
// Invariant: one warp per output row (the register path and dq_mv1_kq's capped grid: a warp
// walks several rows); rows past `rows` and tokens past `n_tok` are never read or written.

// y[t][r] (+)= W_r . norm?(x[t]) for t < n_tok. W: rows x cols, device layout. One token
// per chunk (dq_mv1) over Q8_0 rows of at most DQ_XR_COLS columns takes the register path,
// where a grid.x smaller than ceil(rows / DQ_WARPS) makes each warp walk several rows.
// nw: RMSNorm weights (cols) or null; add: accumulate into y instead of overwriting;
// xn_out (with nw; may be null): the blocks of grid column 0 also write the normalised
// inputs there, for the kernels that follow (the router's launch hands xn to the experts).
// grid: (ceil(rows / DQ_WARPS), ceil(n_tok / NT)); block: DQ_WARPS warps.
template <int NT, bool ANY = false>
__device__ __forceinline__ void dq_mv_body(const u8* W, int ty, int rows, int cols, const float* x,
                                           const float* nw, float eps, float* y, int n_tok,
                                           int add, float* xn_out) {
    {
        const int r = blockIdx.x * DQ_WARPS + threadIdx.x / ST_WARP;
        if (blockIdx.y == 0 && r < rows) dq_prefetch_row(W, ty, rows, cols, r);
    }
    st_pdl_enter();
    // grid.y: chunks of NT tokens.
    const int t0 = blockIdx.y * NT;
    if (t0 >= n_tok) return;
    x += (long)t0 * cols;
    y += (long)t0 * rows;
    n_tok = min(NT, n_tok - t0);
    DqIn<NT> in;
    in.x = x;
    in.stride = cols;
    in.nw = nw;
    dq_norm_prologue<NT>(in, cols, n_tok, eps);
    if (xn_out && nw && blockIdx.x == 0) {
        xn_out += (long)t0 * cols;
        for (int t = 0; t < n_tok; ++t)
            for (long i = threadIdx.x; i < cols; i += blockDim.x)
                xn_out[t * cols + i] = in.ld1(t, i);
    }
    if (NT == 1 && ty == ST_TY_Q8_0 && cols <= DQ_XR_COLS) {
        // Every row r = blockIdx.x * DQ_WARPS + warp + i * gridDim.x * DQ_WARPS.
        float xr[DQ_XR_PIECES * 16];
        dq_xr_load<NT>(in, cols, xr);
        const int lane = threadIdx.x % ST_WARP;
#pragma unroll 2
        for (int r = blockIdx.x * DQ_WARPS + threadIdx.x / ST_WARP; r < rows;
             r += gridDim.x * DQ_WARPS) {
            const float s = st_warp_sum(dq_row_q8_xr(W, rows, cols, r, xr));
            if (lane == 0) y[r] = add ? y[r] + s : s;
        }
        return;
    }
    // The input staged in shared memory when the host gave room for it (before any return).
    extern __shared__ __align__(16) float4 dq_mv_xs[];
    const bool xs = NT == 1 && ty == ST_TY_Q8_0 && !nw && dq_xs_bytes() >= 4u * cols;
    if (xs) dq_xs_fill(dq_mv_xs, x, cols);
    const int row = blockIdx.x * DQ_WARPS + threadIdx.x / ST_WARP;
    if (row >= rows) return;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
    if (xs) dq_row_dot<NT, true>(W, ty, rows, cols, row, in, n_tok, acc, dq_mv_xs);
    else dq_row_dot<NT, false, ANY>(W, ty, rows, cols, row, in, n_tok, acc);
    const int lane = threadIdx.x % ST_WARP;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (t < n_tok) {
            const float s = st_warp_sum(acc[t]);
            if (lane == 0) {
                float* o = y + (long)t * rows + row;
                *o = add ? *o + s : s;
            }
        }
    }
}

ST_KERNEL void dq_mv1(const u8* W, int ty, int rows, int cols, const float* x, const float* nw,
                      float eps, float* y, int n_tok, int add, float* xn_out) {
    dq_mv_body<1>(W, ty, rows, cols, x, nw, eps, y, n_tok, add, xn_out);
}

ST_KERNEL void dq_mv8(const u8* W, int ty, int rows, int cols, const float* x, const float* nw,
                      float eps, float* y, int n_tok, int add, float* xn_out) {
    dq_mv_body<DQ_MAX_TOK>(W, ty, rows, cols, x, nw, eps, y, n_tok, add, xn_out);
}

// The same products for every weight code, the any-type ones (ST_TY_GGML + GGUF id)
// included: quants.cuh's decoders, 32 columns a lane at a time.
ST_KERNEL void dq_mv1_any(const u8* W, int ty, int rows, int cols, const float* x,
                          const float* nw, float eps, float* y, int n_tok, int add,
                          float* xn_out) {
    dq_mv_body<1, true>(W, ty, rows, cols, x, nw, eps, y, n_tok, add, xn_out);
}

ST_KERNEL void dq_mv8_any(const u8* W, int ty, int rows, int cols, const float* x,
                          const float* nw, float eps, float* y, int n_tok, int add,
                          float* xn_out) {
    dq_mv_body<DQ_MAX_TOK, true>(W, ty, rows, cols, x, nw, eps, y, n_tok, add, xn_out);
}

// The same products over K-quant rows (Q5_K, Q6_K; Q4_K too, though the host gives it
// dq_mv1/dq_mv8): products.cuh's dq_kq_row_dot, 8 values a lane a block, a warp per row.
// A one-token product over a tall matrix (the LM head) may get a capped grid instead
// (gridDim.x * DQ_WARPS < rows): each warp then walks groups of DQ_KQ_ROWS rows, g =
// blockIdx.x * DQ_WARPS + warp + i * gridDim.x * DQ_WARPS, reading each input float4 once
// for the group (dq_kq_rows_dot), from shared memory when the host gave cols * 4 bytes for
// the block to stage its (normalised) input once.
// grid: (ceil(rows / DQ_WARPS), or fewer for NT = 1; ceil(n_tok / NT)).
#define DQ_KQ_ROWS 4
template <int NT>
__device__ __forceinline__ void dq_mv_kq_body(const u8* W, int ty, int rows, int cols,
                                              const float* x, const float* nw, float eps,
                                              float* y, int n_tok, int add, float* xn_out) {
    const bool groups = NT == 1 && (long)gridDim.x * DQ_WARPS < rows;
    if (blockIdx.y == 0) {
        // The warp's first row, or its first group's rows.
        const long w = blockIdx.x * DQ_WARPS + threadIdx.x / ST_WARP;
        if (!groups && w < rows) dq_prefetch_row(W, ty, rows, cols, w);
        for (int r = 0; groups && r < DQ_KQ_ROWS; ++r)
            if (w * DQ_KQ_ROWS + r < rows) dq_prefetch_row(W, ty, rows, cols, w * DQ_KQ_ROWS + r);
    }
    st_pdl_enter();
    const int t0 = blockIdx.y * NT;
    if (t0 >= n_tok) return;
    x += (long)t0 * cols;
    y += (long)t0 * rows;
    n_tok = min(NT, n_tok - t0);
    DqIn<NT> in;
    in.x = x;
    in.stride = cols;
    in.nw = nw;
    dq_norm_prologue<NT>(in, cols, n_tok, eps);
    if (xn_out && nw && blockIdx.x == 0) {
        xn_out += (long)t0 * cols;
        for (int t = 0; t < n_tok; ++t)
            for (long i = threadIdx.x; i < cols; i += blockDim.x)
                xn_out[t * cols + i] = in.ld1(t, i);
    }
    extern __shared__ __align__(16) float4 dq_mv_kq_xs[];
    const bool xs = NT == 1 && dq_xs_bytes() >= 4u * cols;
    if (xs) dq_kq_xs_fill<NT>(dq_mv_kq_xs, in, cols);
    const int lane = threadIdx.x % ST_WARP;
    if (groups) {
        for (long g = blockIdx.x * DQ_WARPS + threadIdx.x / ST_WARP; g * DQ_KQ_ROWS < rows;
             g += (long)gridDim.x * DQ_WARPS) {
            const long r0 = g * DQ_KQ_ROWS;
            const int nr = rows - r0 < DQ_KQ_ROWS ? (int)(rows - r0) : DQ_KQ_ROWS;
            float acc[DQ_KQ_ROWS];
#pragma unroll
            for (int r = 0; r < DQ_KQ_ROWS; ++r) acc[r] = 0.0f;
            if (xs) dq_kq_rows_dot<DQ_KQ_ROWS, true>(W, ty, cols, r0, nr, in, acc, dq_mv_kq_xs);
            else dq_kq_rows_dot<DQ_KQ_ROWS, false>(W, ty, cols, r0, nr, in, acc, nullptr);
#pragma unroll
            for (int r = 0; r < DQ_KQ_ROWS; ++r) {
                if (r < nr) {
                    const float s = st_warp_sum(acc[r]);
                    if (lane == 0) y[r0 + r] = add ? y[r0 + r] + s : s;
                }
            }
        }
        return;
    }
    for (int row = blockIdx.x * DQ_WARPS + threadIdx.x / ST_WARP; row < rows;
         row += gridDim.x * DQ_WARPS) {
        float acc[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
        if (xs) dq_kq_row_dot<NT, true>(W, ty, cols, row, in, n_tok, acc, dq_mv_kq_xs);
        else dq_kq_row_dot<NT, false>(W, ty, cols, row, in, n_tok, acc);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t < n_tok) {
                const float s = st_warp_sum(acc[t]);
                if (lane == 0) {
                    float* o = y + (long)t * rows + row;
                    *o = add ? *o + s : s;
                }
            }
        }
    }
}

ST_KERNEL void dq_mv1_kq(const u8* W, int ty, int rows, int cols, const float* x,
                         const float* nw, float eps, float* y, int n_tok, int add,
                         float* xn_out) {
    dq_mv_kq_body<1>(W, ty, rows, cols, x, nw, eps, y, n_tok, add, xn_out);
}

ST_KERNEL void dq_mv8_kq(const u8* W, int ty, int rows, int cols, const float* x,
                         const float* nw, float eps, float* y, int n_tok, int add,
                         float* xn_out) {
    dq_mv_kq_body<DQ_MAX_TOK>(W, ty, rows, cols, x, nw, eps, y, n_tok, add, xn_out);
}

// Q, K and V of n_tok tokens in one launch: rows [0, rq) from Wq into yq, [rq, rq+rk) from Wk
// into yk, the rest from Wv into yv; x RMS-normalised by nw (if given). dq_qkv1 serves one
// token (fewer registers, more resident warps), dq_qkv8 chunks of up to 8 on grid.y.
// grid: (ceil((rq+rk+rv) / DQ_WARPS), ceil(n_tok / NT)).
template <int NT, bool ANY = false>
__device__ __forceinline__ void dq_qkv_body(const u8* Wq, const u8* Wk, const u8* Wv, int ty,
                                            int rq, int rk, int rv, int cols, const float* x,
                                            const float* nw, float eps, float* yq, float* yk,
                                            float* yv, int n_tok) {
    if (blockIdx.y == 0) {
        const int r = blockIdx.x * DQ_WARPS + threadIdx.x / ST_WARP;
        if (r < rq) dq_prefetch_row(Wq, ty, rq, cols, r);
        else if (r < rq + rk) dq_prefetch_row(Wk, ty, rk, cols, r - rq);
        else if (r < rq + rk + rv) dq_prefetch_row(Wv, ty, rv, cols, r - rq - rk);
    }
    st_pdl_enter();
    const int t0 = blockIdx.y * NT;
    if (t0 >= n_tok) return;
    x += (long)t0 * cols;
    yq += (long)t0 * rq;
    yk += (long)t0 * rk;
    yv += (long)t0 * rv;
    n_tok = min(NT, n_tok - t0);
    DqIn<NT> in;
    in.x = x;
    in.stride = cols;
    in.nw = nw;
    dq_norm_prologue<NT>(in, cols, n_tok, eps);
    // The input staged in shared memory when the host gave room for it (before any return).
    extern __shared__ __align__(16) float4 dq_qkv_xs[];
    const bool xs = NT == 1 && ty == ST_TY_Q8_0 && !nw && dq_xs_bytes() >= 4u * cols;
    if (xs) dq_xs_fill(dq_qkv_xs, x, cols);
    int row = blockIdx.x * DQ_WARPS + threadIdx.x / ST_WARP;
    const u8* W;
    float* y;
    int rows;
    if (row < rq) { W = Wq; y = yq; rows = rq; }
    else if (row < rq + rk) { row -= rq; W = Wk; y = yk; rows = rk; }
    else if (row < rq + rk + rv) { row -= rq + rk; W = Wv; y = yv; rows = rv; }
    else return;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
    if (xs) dq_row_dot<NT, true>(W, ty, rows, cols, row, in, n_tok, acc, dq_qkv_xs);
    else dq_row_dot<NT, false, ANY>(W, ty, rows, cols, row, in, n_tok, acc);
    const int lane = threadIdx.x % ST_WARP;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (t < n_tok) {
            const float s = st_warp_sum(acc[t]);
            if (lane == 0) y[(long)t * rows + row] = s;
        }
    }
}

ST_KERNEL void dq_qkv1(const u8* Wq, const u8* Wk, const u8* Wv, int ty, int rq, int rk, int rv,
                       int cols, const float* x, const float* nw, float eps, float* yq,
                       float* yk, float* yv, int n_tok) {
    dq_qkv_body<1>(Wq, Wk, Wv, ty, rq, rk, rv, cols, x, nw, eps, yq, yk, yv, n_tok);
}

ST_KERNEL void dq_qkv8(const u8* Wq, const u8* Wk, const u8* Wv, int ty, int rq, int rk, int rv,
                       int cols, const float* x, const float* nw, float eps, float* yq,
                       float* yk, float* yv, int n_tok) {
    dq_qkv_body<DQ_MAX_TOK>(Wq, Wk, Wv, ty, rq, rk, rv, cols, x, nw, eps, yq, yk, yv, n_tok);
}

// Q, K and V of one any-type code (ST_TY_GGML + GGUF id).
ST_KERNEL void dq_qkv1_any(const u8* Wq, const u8* Wk, const u8* Wv, int ty, int rq, int rk,
                           int rv, int cols, const float* x, const float* nw, float eps,
                           float* yq, float* yk, float* yv, int n_tok) {
    dq_qkv_body<1, true>(Wq, Wk, Wv, ty, rq, rk, rv, cols, x, nw, eps, yq, yk, yv, n_tok);
}

ST_KERNEL void dq_qkv8_any(const u8* Wq, const u8* Wk, const u8* Wv, int ty, int rq, int rk,
                           int rv, int cols, const float* x, const float* nw, float eps,
                           float* yq, float* yk, float* yv, int n_tok) {
    dq_qkv_body<DQ_MAX_TOK, true>(Wq, Wk, Wv, ty, rq, rk, rv, cols, x, nw, eps, yq, yk, yv,
                                  n_tok);
}

// Q, K and V of K-quant codes (dq_kq_row_dot; the input read from global memory), each
// matrix its own code (ty for Q, ty_k, ty_v: Q4_K_M's layers mix Q4_K with a Q6_K V).
// grid: (ceil((rq+rk+rv) / DQ_WARPS), ceil(n_tok / NT)).
template <int NT>
__device__ __forceinline__ void dq_qkv_kq_body(const u8* Wq, const u8* Wk, const u8* Wv, int ty,
                                               int ty_k, int ty_v,
                                               int rq, int rk, int rv, int cols, const float* x,
                                               const float* nw, float eps, float* yq,
                                               float* yk, float* yv, int n_tok) {
    if (blockIdx.y == 0) {
        const int r = blockIdx.x * DQ_WARPS + threadIdx.x / ST_WARP;
        if (r < rq) dq_prefetch_row(Wq, ty, rq, cols, r);
        else if (r < rq + rk) dq_prefetch_row(Wk, ty_k, rk, cols, r - rq);
        else if (r < rq + rk + rv) dq_prefetch_row(Wv, ty_v, rv, cols, r - rq - rk);
    }
    st_pdl_enter();
    const int t0 = blockIdx.y * NT;
    if (t0 >= n_tok) return;
    x += (long)t0 * cols;
    yq += (long)t0 * rq;
    yk += (long)t0 * rk;
    yv += (long)t0 * rv;
    n_tok = min(NT, n_tok - t0);
    DqIn<NT> in;
    in.x = x;
    in.stride = cols;
    in.nw = nw;
    dq_norm_prologue<NT>(in, cols, n_tok, eps);
    int row = blockIdx.x * DQ_WARPS + threadIdx.x / ST_WARP;
    const u8* W;
    float* y;
    int rows;
    int tyr = ty;
    if (row < rq) { W = Wq; y = yq; rows = rq; }
    else if (row < rq + rk) { row -= rq; W = Wk; y = yk; rows = rk; tyr = ty_k; }
    else if (row < rq + rk + rv) { row -= rq + rk; W = Wv; y = yv; rows = rv; tyr = ty_v; }
    else return;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
    dq_kq_row_dot<NT>(W, tyr, cols, row, in, n_tok, acc);
    const int lane = threadIdx.x % ST_WARP;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (t < n_tok) {
            const float s = st_warp_sum(acc[t]);
            if (lane == 0) y[(long)t * rows + row] = s;
        }
    }
}

ST_KERNEL void dq_qkv1_kq(const u8* Wq, const u8* Wk, const u8* Wv, int ty, int ty_k,
                          int ty_v, int rq, int rk, int rv, int cols, const float* x,
                          const float* nw, float eps, float* yq, float* yk, float* yv,
                          int n_tok) {
    dq_qkv_kq_body<1>(Wq, Wk, Wv, ty, ty_k, ty_v, rq, rk, rv, cols, x, nw, eps, yq, yk, yv,
                          n_tok);
}

ST_KERNEL void dq_qkv8_kq(const u8* Wq, const u8* Wk, const u8* Wv, int ty, int ty_k,
                          int ty_v, int rq, int rk, int rv, int cols, const float* x,
                          const float* nw, float eps, float* yq, float* yk, float* yv,
                          int n_tok) {
    dq_qkv_kq_body<DQ_MAX_TOK>(Wq, Wk, Wv, ty, ty_k, ty_v, rq, rk, rv, cols, x, nw, eps, yq, yk, yv,
                          n_tok);
}

// Embedding lookup: out[t] = row ids[t] of W (rows x cols, device layout), dequantized.
// Any-type codes decode 32 values a thread per step (cols a multiple of 32). grid: n_tok.
ST_KERNEL void dq_get_rows(const u8* W, int ty, int rows, int cols, const int* ids, float* out) {
    st_pdl_enter();
    const long r = ids[blockIdx.x];
    float* o = out + (long)blockIdx.x * cols;
    if (ty >= ST_TY_GGML) {
        const u8* wr = W + r * dq_row_bytes(ty, cols);
        float v[32];
        for (int g = threadIdx.x; g < cols / 32; g += blockDim.x) {
            qt_group32(ty - ST_TY_GGML, wr, g, v);
#pragma unroll
            for (int j = 0; j < 32; ++j) o[32 * g + j] = v[j];
        }
        return;
    }
    // Four elements' loads per thread before their stores (see dq_attn_gqa's query loads).
    for (int i0 = threadIdx.x; i0 < cols; i0 += 4 * blockDim.x) {
        float v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = i0 + u * blockDim.x;
            v[u] = i < cols ? dq_elem(W, ty, rows, cols, r, i) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = i0 + u * blockDim.x;
            if (i < cols) o[i] = v[u];
        }
    }
}


// Prefill router logits as a split-K F32 product (the router's F32 weights are too small for
// the tensor-core path and too large to re-read per 8 tokens): part[s][t][r] = the sum over
// k in split s of x[t][k] * W[r][k], k ascending. A block computes 64 tokens x 32 rows of one
// split through shared-memory tiles of 32 k; each thread 2 tokens x 4 rows.
// grid: (ceil(n_tok / 64), ceil(rows / 32), n_split); block: 256; k_chunk a multiple of 32.
#define SG_TT 64
#define SG_TR 32
#define SG_TK 32
ST_KERNEL void dq_sgemm_split(const float* W, int rows, int cols, const float* x, int n_tok,
                              int k_chunk, float* part) {
    st_pdl_enter();
    __shared__ float xs[SG_TK][SG_TT + 1];
    __shared__ float ws[SG_TK][SG_TR + 1];
    const int t0 = blockIdx.x * SG_TT, r0 = blockIdx.y * SG_TR, s = blockIdx.z;
    const int k_begin = s * k_chunk, k_end = min(cols, k_begin + k_chunk);
    const int tid = threadIdx.x;
    const int tt = tid / 8, tr = tid % 8;
    float acc[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    for (int k0 = k_begin; k0 < k_end; k0 += SG_TK) {
        for (int i = tid; i < SG_TT * SG_TK; i += blockDim.x) {
            const int tk = i / SG_TK, kk = i % SG_TK;
            const int t = t0 + tk, k = k0 + kk;
            xs[kk][tk] = (t < n_tok && k < k_end) ? x[(long)t * cols + k] : 0.0f;
        }
        for (int i = tid; i < SG_TR * SG_TK; i += blockDim.x) {
            const int rr = i / SG_TK, kk = i % SG_TK;
            const int r = r0 + rr, k = k0 + kk;
            ws[kk][rr] = (r < rows && k < k_end) ? W[(long)r * cols + k] : 0.0f;
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < SG_TK; ++kk) {
            const float a0 = xs[kk][tt * 2], a1 = xs[kk][tt * 2 + 1];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float b = ws[kk][tr * 4 + j];
                acc[0][j] += a0 * b;
                acc[1][j] += a1 * b;
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int t = t0 + tt * 2 + i;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int r = r0 + tr * 4 + j;
            if (t < n_tok && r < rows) part[((long)s * n_tok + t) * rows + r] = acc[i][j];
        }
    }
}

// y[i] = the sum over s of part[s * n + i], s ascending (dq_sgemm_split's splits in a fixed
// order, so the result does not depend on scheduling). grid: ceil(n / 256); block: 256.
ST_KERNEL void dq_split_sum(const float* part, int n_split, long n, float* y) {
    st_pdl_enter();
    const long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float a = 0.0f;
    for (int s = 0; s < n_split; ++s) a += part[(long)s * n + i];
    y[i] = a;
}
