// decode.cu: the fused kernels of the CUDA engine's forward pass over weights in the device
// layout (Q8_0 "split": per matrix rows x cols int8 quants, then rows x cols/32 f16 scales;
// Q4_K, F32, F16, BF16 as in GGUF): embedding lookup, matrix-vector products for 1..8 tokens
// (optionally RMS-normalising the input on the fly and/or adding into the output), the MoE
// expert products with expert ids read on the device, KV stores and decode attention over
// per-slot KV. Every scalar that changes between steps (token ids, positions, slots, context
// lengths, expert ids) is read from device memory, so a step can be captured in a CUDA graph.
// Invariant: one warp per output row; rows past `rows` and tokens past `n_tok` are never read
// or written; Q8_0 split rows are 16-byte aligned (the host checks the base pointers).

#define DQ_MAX_TOK 8
#define DQ_WARPS 4

__device__ __forceinline__ float dq_silu(float v) { return v / (1.0f + expf(-v)); }

// Element i of row r of a matrix (rows x cols) in the device layout.
__device__ __forceinline__ float dq_elem(const u8* W, int ty, long rows, long cols, long r, long i) {
    if (ty == ST_TY_Q8_0) {
        const i8 q = (i8)W[r * cols + i];
        const u16 d = ((const u16*)(W + rows * cols))[r * (cols / QK8_0) + i / QK8_0];
        return st_h2f(d) * (float)q;
    }
    long rb;
    switch (ty) {
        case ST_TY_F32: rb = cols * 4; break;
        case ST_TY_Q4_K: rb = cols / QK_K * Q4_K_BYTES; break;
        default: rb = cols * 2; break;
    }
    return st_row_elem(W + r * rb, ty, i);
}

// L2 prefetch of row r of a matrix in the device layout (the calling warp's lanes share it):
// for Q8_0 its quants and its scales, else its bytes. Weights only, so allowed before
// st_pdl_wait().
__device__ __forceinline__ void dq_prefetch_row(const u8* W, int ty, long rows, long cols, long r) {
    if (ty == ST_TY_Q8_0) {
        st_prefetch_l2(W + r * cols, cols);
        st_prefetch_l2(W + rows * cols + r * (cols / QK8_0) * 2, cols / QK8_0 * 2);
        return;
    }
    long rb;
    switch (ty) {
        case ST_TY_F32: rb = cols * 4; break;
        case ST_TY_Q4_K: rb = cols / QK_K * Q4_K_BYTES; break;
        default: rb = cols * 2; break;
    }
    st_prefetch_l2(W + r * rb, rb);
}

// Per-token input scaling: x[t][i] * s[t] * nw[i] when nw is given (RMSNorm folded into the
// product), else x[t][i].
template <int NT>
struct DqIn {
    const float* x;
    long stride;
    const float* nw;  // null: no norm
    float s[NT];
    __device__ __forceinline__ float4 ld(int t, long i) const {
        float4 v = *(const float4*)(x + t * stride + i);
        if (nw) {
            const float4 w = *(const float4*)(nw + i);
            v.x *= s[t] * w.x; v.y *= s[t] * w.y; v.z *= s[t] * w.z; v.w *= s[t] * w.w;
        }
        return v;
    }
    __device__ __forceinline__ float ld1(int t, long i) const {
        const float v = x[t * stride + i];
        return nw ? v * s[t] * nw[i] : v;
    }
};

// The input of a one-token Q8_0 product staged in shared memory ("xs"), when the host gives the
// launch at least cols * 4 bytes of dynamic shared memory (dq_xs_bytes reads what it gave).
// A lane of the Q8_0 loops reads the 16 floats of its 16-column piece, 64 bytes from its
// neighbour's: from global memory each such float4 load touches 16 lines, which bound the
// products by L1 throughput on the H200. In shared memory float4 m sits at dq_xs_slot(m), so
// every 8 lanes of such a load hit the 8 distinct 16-byte bank groups: 4 wavefronts a load.
// The values and the arithmetic are the same, so the outputs are bit for bit the same.
__device__ __forceinline__ unsigned dq_xs_bytes() {
    unsigned v = 0;
#ifdef ST_CUDA
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(v));
#endif
    return v;
}
__device__ __forceinline__ int dq_xs_slot(int m) { return m ^ ((m >> 3) & 7); }
// xs = x[0..cols) (cols % 4 == 0) by every thread of the block; ends with a barrier. Eight
// loads per thread are in flight before their stores.
__device__ __forceinline__ void dq_xs_fill(float4* xs, const float* x, int cols) {
    const int n4 = cols / 4;
    for (int m0 = threadIdx.x; m0 < n4; m0 += 8 * blockDim.x) {
        float4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int m = m0 + u * blockDim.x;
            if (m < n4) v[u] = *(const float4*)(x + 4 * m);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int m = m0 + u * blockDim.x;
            if (m < n4) xs[dq_xs_slot(m)] = v[u];
        }
    }
    __syncthreads();
}

// acc[t] += W_r . in(t) over the warp's lanes (not yet reduced across the warp). XS (one
// token, no norm, Q8_0): the input is read from xs instead (dq_xs_fill); a separate
// instantiation, so the plain loop's code is what it was without the staging.
template <int NT, bool XS = false>
__device__ __forceinline__ void dq_row_dot(const u8* __restrict__ W, int ty, long rows, long cols,
                                           long r, const DqIn<NT>& in, int n_tok,
                                           float (&acc)[NT], const float4* xs = nullptr) {
    const int lane = threadIdx.x % ST_WARP;
    if (ty == ST_TY_Q8_0) {
        const u8* qs = W + r * cols;
        const u16* ds = (const u16*)(W + rows * cols) + r * (cols / QK8_0);
#pragma unroll 4
        for (long i0 = lane * 16; i0 < cols; i0 += ST_WARP * 16) {
            const int4 q = *(const int4*)(qs + i0);
            const float d = st_h2f(ds[i0 / QK8_0]);
            const int qw[4] = {q.x, q.y, q.z, q.w};
            float w[16];
#pragma unroll
            for (int j = 0; j < 4; ++j) st_i8x4_to_f32(qw[j], w + 4 * j);
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < n_tok) {
                    float s = 0.0f;
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const float4 xv = XS ? xs[dq_xs_slot((int)(i0 / 4) + j)]
                                             : in.ld(t, i0 + 4 * j);
                        s += w[4 * j] * xv.x + w[4 * j + 1] * xv.y + w[4 * j + 2] * xv.z +
                             w[4 * j + 3] * xv.w;
                    }
                    acc[t] += d * s;
                }
            }
        }
    } else if (ty == ST_TY_Q4_K) {
        const long nb = cols / QK_K;
        const u8* wr = W + r * nb * Q4_K_BYTES;
        const int g = lane / 8, j = (lane % 8) * 4;
        for (long b = 0; b < nb; ++b) {
            const u8* blk = wr + b * Q4_K_BYTES;
            const float d = st_h2f(st_ld_u16(blk)), dmin = st_h2f(st_ld_u16(blk + 2));
            float sc0, m0, sc1, m1;
            st_scale_min_k4(2 * g, blk + 4, &sc0, &m0);
            st_scale_min_k4(2 * g + 1, blk + 4, &sc1, &m1);
            const u32 qq = *(const u32*)(blk + 16 + 32 * g + j);
            const float d1 = d * sc0, mm1 = dmin * m0, d2 = d * sc1, mm2 = dmin * m1;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < n_tok) {
                    const long ia = b * QK_K + 64 * g + j;
                    const float4 xa = in.ld(t, ia);
                    const float4 xh = in.ld(t, ia + 32);
                    const float qa = (float)(qq & 0xF) * xa.x + (float)((qq >> 8) & 0xF) * xa.y +
                                     (float)((qq >> 16) & 0xF) * xa.z +
                                     (float)((qq >> 24) & 0xF) * xa.w;
                    const float qh = (float)((qq >> 4) & 0xF) * xh.x +
                                     (float)((qq >> 12) & 0xF) * xh.y +
                                     (float)((qq >> 20) & 0xF) * xh.z +
                                     (float)((qq >> 28) & 0xF) * xh.w;
                    const float sa = xa.x + xa.y + xa.z + xa.w;
                    const float sh = xh.x + xh.y + xh.z + xh.w;
                    acc[t] += d1 * qa - mm1 * sa + d2 * qh - mm2 * sh;
                }
            }
        }
    } else if (ty == ST_TY_F32 && cols % 4 == 0) {
        const float* wr = (const float*)W + r * cols;
#pragma unroll 4
        for (long i0 = lane * 4; i0 < cols; i0 += ST_WARP * 4) {
            const float4 w = *(const float4*)(wr + i0);
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < n_tok) {
                    const float4 xv = in.ld(t, i0);
                    acc[t] += w.x * xv.x + w.y * xv.y + w.z * xv.z + w.w * xv.w;
                }
            }
        }
    } else if (ty != ST_TY_F32 && cols % 8 == 0) {
        const u16* wr = (const u16*)W + r * cols;
#pragma unroll 4
        for (long i0 = lane * 8; i0 < cols; i0 += ST_WARP * 8) {
            const uint4 raw = *(const uint4*)(wr + i0);
            const u32 pk[4] = {raw.x, raw.y, raw.z, raw.w};
            float w[8];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u16 lo = (u16)(pk[j] & 0xffff), hi = (u16)(pk[j] >> 16);
                w[2 * j] = ty == ST_TY_F16 ? st_h2f(lo) : st_bf2f(lo);
                w[2 * j + 1] = ty == ST_TY_F16 ? st_h2f(hi) : st_bf2f(hi);
            }
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < n_tok) {
                    const float4 a = in.ld(t, i0), b = in.ld(t, i0 + 4);
                    acc[t] += w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x +
                              w[5] * b.y + w[6] * b.z + w[7] * b.w;
                }
            }
        }
    } else {
        const int esz = ty == ST_TY_F32 ? 4 : 2;
        const u8* wr = W + r * cols * esz;
        for (long i = lane; i < cols; i += ST_WARP) {
            float w;
            if (ty == ST_TY_F32) w = ((const float*)wr)[i];
            else if (ty == ST_TY_F16) w = st_h2f(((const u16*)wr)[i]);
            else w = st_bf2f(((const u16*)wr)[i]);
#pragma unroll
            for (int t = 0; t < NT; ++t)
                if (t < n_tok) acc[t] += w * in.ld1(t, i);
        }
    }
}

// Q8_0 products of one token with the input held in registers: a lane of dq_row_dot's Q8_0
// loop reads the same columns of x (its 16-column pieces, 512 apart) in every row, so a warp
// that walks many rows keeps those pieces in registers and reads only weights per row (x's
// float4 loads, each touching 16 cache lines, bound the one-row-per-warp kernels by L1
// throughput). Used by dq_mv1 over the LM head, whose 151936 rows give every warp dozens
// (measured on the H200: head 198 -> 169 us a token; the same path in dq_qkv1 and the MoE
// gate/up, with 3 and 1 rows a warp, cost more than it saved: gate/up 16.5 -> 22.4 us).
// Rows of at most DQ_XR_COLS columns; same arithmetic, in the same order, as dq_row_dot<1>.
#define DQ_XR_PIECES 4
#define DQ_XR_COLS (DQ_XR_PIECES * ST_WARP * 16)

template <int NT>
__device__ __forceinline__ void dq_xr_load(const DqIn<NT>& in, long cols,
                                           float (&xr)[DQ_XR_PIECES * 16]) {
    const int lane = threadIdx.x % ST_WARP;
#pragma unroll
    for (int u = 0; u < DQ_XR_PIECES; ++u) {
        const long i0 = lane * 16 + (long)u * ST_WARP * 16;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (i0 < cols) v = in.ld(0, i0 + 4 * j);
            xr[u * 16 + 4 * j] = v.x;
            xr[u * 16 + 4 * j + 1] = v.y;
            xr[u * 16 + 4 * j + 2] = v.z;
            xr[u * 16 + 4 * j + 3] = v.w;
        }
    }
}

// The lane's part of row r (of a rows x cols split Q8_0 matrix) . x, x in xr (dq_xr_load).
__device__ __forceinline__ float dq_row_q8_xr(const u8* W, long rows, long cols, long r,
                                              const float (&xr)[DQ_XR_PIECES * 16]) {
    const int lane = threadIdx.x % ST_WARP;
    const u8* qs = W + r * cols;
    const u16* ds = (const u16*)(W + rows * cols) + r * (cols / QK8_0);
    float acc = 0.0f;
#pragma unroll
    for (int u = 0; u < DQ_XR_PIECES; ++u) {
        const long i0 = lane * 16 + (long)u * ST_WARP * 16;
        if (i0 < cols) {
            // Read-only loads (ld.global.nc), so the next row's can be issued ahead of this
            // row's output store.
            const int4 q = __ldg((const int4*)(qs + i0));
            const float d = st_h2f(__ldg(ds + i0 / QK8_0));
            const int qw[4] = {q.x, q.y, q.z, q.w};
            float w[16];
#pragma unroll
            for (int j = 0; j < 4; ++j) st_i8x4_to_f32(qw[j], w + 4 * j);
            float s = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; ++j)
                s += w[4 * j] * xr[u * 16 + 4 * j] + w[4 * j + 1] * xr[u * 16 + 4 * j + 1] +
                     w[4 * j + 2] * xr[u * 16 + 4 * j + 2] + w[4 * j + 3] * xr[u * 16 + 4 * j + 3];
            acc += d * s;
        }
    }
    return acc;
}

// The block's per-token RMS factors 1/sqrt(mean(x^2) + eps) into in.s (nw non-null only).
template <int NT>
__device__ __forceinline__ void dq_norm_prologue(DqIn<NT>& in, long cols, int n_tok, float eps) {
    __shared__ float red[32];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        in.s[t] = 1.0f;
        if (in.nw && t < n_tok) {
            float ss = 0.0f;
            for (long i = threadIdx.x; i < cols; i += blockDim.x) {
                const float v = in.x[t * in.stride + i];
                ss += v * v;
            }
            ss = st_block_sum(ss, red);
            in.s[t] = 1.0f / sqrtf(ss / (float)cols + eps);
        }
    }
}

// y[t][r] (+)= W_r . norm?(x[t]) for t < n_tok. W: rows x cols, device layout. One token
// per chunk (dq_mv1) over Q8_0 rows of at most DQ_XR_COLS columns takes the register path,
// where a grid.x smaller than ceil(rows / DQ_WARPS) makes each warp walk several rows.
// nw: RMSNorm weights (cols) or null; add: accumulate into y instead of overwriting;
// xn_out (with nw; may be null): the blocks of grid column 0 also write the normalised
// inputs there, for the kernels that follow (the router's launch hands xn to the experts).
// grid: (ceil(rows / DQ_WARPS), ceil(n_tok / NT)); block: DQ_WARPS warps.
template <int NT>
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
    else dq_row_dot<NT>(W, ty, rows, cols, row, in, n_tok, acc);
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

// Q, K and V of n_tok tokens in one launch: rows [0, rq) from Wq into yq, [rq, rq+rk) from Wk
// into yk, the rest from Wv into yv; x RMS-normalised by nw (if given). dq_qkv1 serves one
// token (fewer registers, more resident warps), dq_qkv8 chunks of up to 8 on grid.y.
// grid: (ceil((rq+rk+rv) / DQ_WARPS), ceil(n_tok / NT)).
template <int NT>
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
    else dq_row_dot<NT>(W, ty, rows, cols, row, in, n_tok, acc);
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

// 16 Q8_0 weights (one 16-byte load of a split-layout row) dotted with x[0..16), or (XS)
// with float4s m4 .. m4 + 3 of xs (dq_xs_fill).
template <bool XS = false>
__device__ __forceinline__ float dq_dot16_q8(const int4 q, const float* x,
                                             const float4* xs = nullptr, int m4 = 0) {
    const int qw[4] = {q.x, q.y, q.z, q.w};
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float4 xv = XS ? xs[dq_xs_slot(m4 + j)] : *(const float4*)(x + 4 * j);
        float w[4];
        st_i8x4_to_f32(qw[j], w);
        s += w[0] * xv.x + w[1] * xv.y + w[2] * xv.z + w[3] * xv.w;
    }
    return s;
}

// The lane's parts of G_row . x and U_row . x for Q8_0 gate/up matrices (F x E): their loads
// in flight together; x from global memory, or (XS) staged in xs.
template <bool XS>
__device__ __forceinline__ void dq_gate_up_q8(const u8* G, const u8* U, int F, int E, int row,
                                              const float* x, const float4* xs, float& g,
                                              float& u) {
    const int lane = threadIdx.x % ST_WARP;
    const u8* gq = G + (long)row * E;
    const u8* uq = U + (long)row * E;
    const u16* gd = (const u16*)(G + (long)F * E) + (long)row * (E / QK8_0);
    const u16* ud = (const u16*)(U + (long)F * E) + (long)row * (E / QK8_0);
#pragma unroll 4
    for (int i0 = lane * 16; i0 < E; i0 += ST_WARP * 16) {
        const int4 qg = *(const int4*)(gq + i0);
        const int4 qu = *(const int4*)(uq + i0);
        const float dg = st_h2f(gd[i0 / QK8_0]), du = st_h2f(ud[i0 / QK8_0]);
        g += dg * dq_dot16_q8<XS>(qg, x + i0, xs, i0 / 4);
        u += du * dq_dot16_q8<XS>(qu, x + i0, xs, i0 / 4);
    }
}

// MoE gate and up with SwiGLU: for assignment a = t*k + j (grid.y, a < n_tok*k), expert
// e = ids[a], h[a][r] = silu(G_e,r . n(x[t])) * (U_e,r . n(x[t])). eptr[e*3 + 0/1/2] are the
// device addresses of expert e's gate, up and down matrices (gate/up: F x E, down: E x F).
// Q8_0 reads the gate and up rows in one loop (their loads in flight together).
// grid: (ceil(F / DQ_WARPS), n_tok * k).
ST_KERNEL void dq_moe_gate_up(const unsigned long long* eptr, int ty, int F, int E,
                              const int* ids, int k, const float* x, const float* nw, float eps,
                              float* h) {
    st_pdl_enter();  // the expert ids come from the kernel just ahead
    const int a = blockIdx.y;
    const int t = a / k;
    DqIn<1> in;
    in.x = x + (long)t * E;
    in.stride = E;
    in.nw = nw;
    dq_norm_prologue<1>(in, E, 1, eps);
    // The expert's matrices first (their loads need no barrier), then the input staged in
    // shared memory when the host gave room for it (before any return).
    const int e = ids[a];
    const u8* G = (const u8*)eptr[(long)e * 3 + 0];
    const u8* U = (const u8*)eptr[(long)e * 3 + 1];
    extern __shared__ __align__(16) float4 dq_gu_xs[];
    const bool xs = ty == ST_TY_Q8_0 && !nw && dq_xs_bytes() >= 4u * E;
    if (xs) dq_xs_fill(dq_gu_xs, in.x, E);
    const int row = blockIdx.x * DQ_WARPS + threadIdx.x / ST_WARP;
    if (row >= F) return;
    const int lane = threadIdx.x % ST_WARP;
    float g[1] = {0.0f}, u[1] = {0.0f};
    if (ty == ST_TY_Q8_0 && !nw) {
        if (xs) dq_gate_up_q8<true>(G, U, F, E, row, in.x, dq_gu_xs, g[0], u[0]);
        else dq_gate_up_q8<false>(G, U, F, E, row, in.x, nullptr, g[0], u[0]);
    } else {
        dq_row_dot<1>(G, ty, F, E, row, in, 1, g);
        dq_row_dot<1>(U, ty, F, E, row, in, 1, u);
    }
    const float gs = st_warp_sum(g[0]), us = st_warp_sum(u[0]);
    if (lane == 0) h[(long)a * F + row] = dq_silu(gs) * us;
}

#define DQ_DOWN_MAXK 32
// MoE down and weighted sum, added into the residual stream:
// y[t][r] += sum_j wts[t*k+j] * (D_{ids[t*k+j]},r . h[t*k+j]), one warp per row, any weight
// type (Q8_0 with k <= DQ_DOWN_MAXK takes dq_moe_down_rows). grid: (ceil(E / DQ_WARPS), n_tok).
ST_KERNEL void dq_moe_down(const unsigned long long* eptr, int ty, int E, int F, const int* ids,
                           const float* wts, int k, const float* h, float* y) {
    st_pdl_enter();
    const int t = blockIdx.y;
    const int row = blockIdx.x * DQ_WARPS + threadIdx.x / ST_WARP;
    if (row >= E) return;
    float tot = 0.0f;
    for (int j = 0; j < k; ++j) {
        const long a = (long)t * k + j;
        const u8* D = (const u8*)eptr[(long)ids[a] * 3 + 2];
        DqIn<1> in;
        in.x = h + a * F;
        in.stride = F;
        in.nw = nullptr;
        in.s[0] = 1.0f;
        float acc[1] = {0.0f};
        dq_row_dot<1>(D, ty, E, F, row, in, 1, acc);
        tot += wts[a] * st_warp_sum(acc[0]);
    }
    if (threadIdx.x % ST_WARP == 0) y[(long)t * E + row] += tot;
}

// MoE down for Q8_0 experts with one block per output row, the k experts' 16-byte pieces
// spread over the whole block (a few loads per thread, all in flight) and summed by a block
// reduction: y[t][r] += sum_j wts[t*k+j] * (D_{ids[t*k+j]},r . h[t*k+j]). Same function as
// dq_moe_down with four times the warps in flight. grid: (E, n_tok); block: 128; k <= 32.
ST_KERNEL void dq_moe_down_rows(const unsigned long long* eptr, int E, int F, const int* ids,
                                const float* wts, int k, const float* h, float* y) {
    __shared__ const u8* dm[DQ_DOWN_MAXK];
    __shared__ float dw[DQ_DOWN_MAXK];
    __shared__ float red[32];
    const int row = blockIdx.x, t = blockIdx.y;
    // Before the wait: the expert ids were written two kernels ahead (complete by now, see
    // st_pdl_wait), read through L2 (__ldcg) since this SM's L1 may hold older lines; each
    // of the first k warps prefetches its expert's row.
    if (threadIdx.x / ST_WARP < k) {
        const int j = threadIdx.x / ST_WARP;
        const u8* D = (const u8*)eptr[(long)st_ldcg(ids + (long)t * k + j) * 3 + 2];
        dq_prefetch_row(D, ST_TY_Q8_0, E, F, row);
    }
    st_pdl_enter();
    if (threadIdx.x < k) {
        const long a = (long)t * k + threadIdx.x;
        dm[threadIdx.x] = (const u8*)eptr[(long)ids[a] * 3 + 2];
        dw[threadIdx.x] = wts[a];
    }
    __syncthreads();
    const int per = F / 16;
    const float* ht = h + (long)t * k * F;
    float tot = 0.0f;
#pragma unroll 4
    for (int p = threadIdx.x; p < k * per; p += blockDim.x) {
        const int j = p / per, i0 = (p - j * per) * 16;
        const u8* D = dm[j];
        const int4 q = *(const int4*)(D + (long)row * F + i0);
        const float d = st_h2f(((const u16*)(D + (long)E * F))[(long)row * (F / QK8_0) + i0 / QK8_0]);
        tot += dw[j] * d * dq_dot16_q8(q, ht + (long)j * F + i0);
    }
    tot = st_block_sum(tot, red);
    if (threadIdx.x == 0) y[(long)t * E + row] += tot;
}

__device__ void dq_topk_warp(const float* x, int n_expert, int k, int norm, int* idx_out,
                             float* w_out);

// The router's logits for F32 weights, one block per (row, token): the block computes token
// t's RMS factor, dots its 16-byte slices of the row with x * s * nw, reduces; block (0, t)
// also writes xn[t] = x[t] * s * nw for the experts. (One warp per row over 128 rows left
// the whole GPU waiting on 32 blocks.) With cnt (n_tok counters, zero between launches): the
// last block of token t to finish (counted in cnt[t], which it resets) also runs the
// softmax and top-k of dq_router_topk into idx_out / w_out, saving that launch.
// grid: (rows, n_tok); block: 128; cols % 4 == 0; with cnt, rows <= 32 * DQ_RT_PER, k <= 32.
ST_KERNEL void dq_router_rows(const float* W, int rows, int cols, const float* x,
                              const float* nw, float eps, float* y, float* xn_out, int* cnt,
                              int k, int norm, int* idx_out, float* w_out) {
    __shared__ float red[32];
    __shared__ int last;
    const int r = blockIdx.x, t = blockIdx.y;
    if (t == 0 && threadIdx.x < ST_WARP) st_prefetch_l2(W + (long)r * cols, (long)cols * 4);
    st_pdl_enter();
    const float* xt = x + (long)t * cols;
    float ss = 0.0f;
    for (int i = threadIdx.x * 4; i < cols; i += blockDim.x * 4) {
        const float4 v = *(const float4*)(xt + i);
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    const float sc = 1.0f / sqrtf(st_block_sum(ss, red) / (float)cols + eps);
    const float* wr = W + (long)r * cols;
    float acc = 0.0f;
#pragma unroll 4
    for (int i = threadIdx.x * 4; i < cols; i += blockDim.x * 4) {
        const float4 v = *(const float4*)(xt + i);
        const float4 g = *(const float4*)(nw + i);
        const float4 w = *(const float4*)(wr + i);
        const float4 n = make_float4(v.x * sc * g.x, v.y * sc * g.y, v.z * sc * g.z, v.w * sc * g.w);
        acc += w.x * n.x + w.y * n.y + w.z * n.z + w.w * n.w;
    }
    // The normalised input in a loop of its own: a store inside the product's loop would keep
    // each iteration's loads from being issued before the previous iteration's store.
    if (r == 0) {
        for (int i = threadIdx.x * 4; i < cols; i += blockDim.x * 4) {
            const float4 v = *(const float4*)(xt + i);
            const float4 g = *(const float4*)(nw + i);
            *(float4*)(xn_out + (long)t * cols + i) =
                make_float4(v.x * sc * g.x, v.y * sc * g.y, v.z * sc * g.z, v.w * sc * g.w);
        }
    }
    acc = st_block_sum(acc, red);
    if (!cnt) {
        if (threadIdx.x == 0) y[(long)t * rows + r] = acc;
        return;
    }
    if (threadIdx.x == 0) {
        y[(long)t * rows + r] = acc;
        __threadfence();  // this logit is visible before the count says so
        last = atomicAdd(cnt + t, 1) == rows - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (threadIdx.x < ST_WARP)
        dq_topk_warp(y + (long)t * rows, rows, k, norm, idx_out + (long)t * k, w_out + (long)t * k);
    if (threadIdx.x == 0) cnt[t] = 0;
}

// Embedding lookup: out[t] = row ids[t] of W (rows x cols, device layout), dequantized.
// grid: n_tok.
ST_KERNEL void dq_get_rows(const u8* W, int ty, int rows, int cols, const int* ids, float* out) {
    st_pdl_enter();
    const long r = ids[blockIdx.x];
    float* o = out + (long)blockIdx.x * cols;
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

// Stores elements [e0, e0 + n) of one K or V row (src holds those n floats) into the KV row
// at dst: F16, F32 or Q8_0 (GGUF block layout with ggml's reference rounding; e0 and n
// multiples of 32, one warp per block). Every thread of the block calls it.
__device__ __forceinline__ void dq_store_seg(const float* src, u8* dst, int kv_ty, int e0, int n) {
    if (kv_ty == ST_TY_F16) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) ((u16*)dst)[e0 + i] = st_f2h(src[i]);
    } else if (kv_ty == ST_TY_F32) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) ((float*)dst)[e0 + i] = src[i];
    } else {
        const int lane = threadIdx.x % ST_WARP, warp = threadIdx.x / ST_WARP;
        const int nw = blockDim.x / ST_WARP;
        for (int b = warp; b < n / QK8_0; b += nw) {
            float xv = 0.0f, amax = 0.0f;
            if (lane < QK8_0) {
                xv = src[b * QK8_0 + lane];
                amax = fabsf(xv);
            }
            amax = st_warp_max(amax);
            const float d = amax / 127.0f;
            const float id = d != 0.0f ? 1.0f / d : 0.0f;
            u8* blk = dst + (long)(e0 / QK8_0 + b) * Q8_0_BYTES;
            // The f16 scale as one 16-bit store (rows and blocks are 2-byte aligned). Written
            // as two byte stores of its halves, the low byte came out 0 on the H200 (sm_90,
            // NVRTC 13.0), cutting the scale to 2 mantissa bits (q8_0 KV logits off by 0.13);
            // kv_store_matches_the_host_quantizer_byte_for_byte in cuda_ops guards this.
            if (lane == 0) *(u16*)blk = st_f2h(d);
            if (lane < QK8_0) {
                float qf = roundf(xv * id);
                qf = fminf(fmaxf(qf, -128.0f), 127.0f);
                blk[2 + lane] = (u8)(i8)(int)qf;
            }
        }
    }
}

// KV store: token t's K and V rows (width floats each) into cell pos[t] of slot slot[t]:
// K row at kv + slot*slot_bytes + k_off + pos*row_bytes, V likewise at v_off. F16, F32 or
// Q8_0 (width a multiple of 32). grid: n_tok; block: 128.
ST_KERNEL void dq_kv_store(const float* k, const float* v, u8* kv, const int* slot,
                           const int* pos, long slot_bytes, long k_off, long v_off,
                           long row_bytes, int kv_ty, int width) {
    st_pdl_enter();
    const int t = blockIdx.x;
    u8* base = kv + (long)slot[t] * slot_bytes + (long)pos[t] * row_bytes;
    dq_store_seg(k + (long)t * width, base + k_off, kv_ty, 0, width);
    dq_store_seg(v + (long)t * width, base + v_off, kv_ty, 0, width);
}

// QK-norm + RoPE of Q and K and the KV store in one launch: block (h, t) with h < n_head
// rotates query head h of token t in place; the next n_head_kv blocks rotate K head
// h - n_head in place and store it into the token's KV cell; the last n_head_kv store V
// head h - n_head - n_head_kv. Same arithmetic as qk_norm_rope_f32 + dq_kv_store (Q8_0 needs
// hd a multiple of 32, so every head is whole blocks). grid: (n_head + 2 * n_head_kv, n_tok);
// block: 128; hd <= 1024.
ST_KERNEL void dq_rope_store(float* q, float* k, const float* v, const float* q_norm,
                             const float* k_norm, float eps, const int* pos,
                             const float* inv_freq, float attn_factor, int n_head,
                             int n_head_kv, int hd, int n_rot, u8* kv, const int* slot,
                             long slot_bytes, long k_off, long v_off, long row_bytes,
                             int kv_ty) {
    st_pdl_enter();
    __shared__ float red[32];
    __shared__ float sh[1024];
    const int h = blockIdx.x, t = blockIdx.y;
    const float p = (float)pos[t];
    if (h < n_head) {
        st_head_norm_rope(q + ((long)t * n_head + h) * hd, q_norm, eps, p, inv_freq,
                          attn_factor, hd, n_rot, sh, red);
        return;
    }
    u8* cell = kv + (long)slot[t] * slot_bytes + (long)pos[t] * row_bytes;
    if (h < n_head + n_head_kv) {
        const int kh = h - n_head;
        float* x = k + ((long)t * n_head_kv + kh) * hd;
        st_head_norm_rope(x, k_norm, eps, p, inv_freq, attn_factor, hd, n_rot, sh, red);
        dq_store_seg(x, cell + k_off, kv_ty, kh * hd, hd);
    } else {
        const int vh = h - n_head - n_head_kv;
        dq_store_seg(v + ((long)t * n_head_kv + vh) * hd, cell + v_off, kv_ty, vh * hd, hd);
    }
}

// One online-softmax step of one head, by the calling warp: the scores s[0..n) (n <= 32, one
// per lane; -inf for cells past the context) become exp(s - m') in place, where m' is the
// larger of the running max ml[0] and theirs; the running (max, sum) ml becomes (m', sum * c +
// the new exps' sum) and *c = exp(ml[0] - m') rescales the outputs accumulated so far.
__device__ __forceinline__ void da_softmax_step(float* s, int n, float* ml, float* c) {
    const int lane = threadIdx.x % ST_WARP;
    const float v = lane < n ? s[lane] : ST_NEG_INF;
    const float mo = ml[0];
    const float mn = fmaxf(mo, st_warp_max(v));
    const float p = v == ST_NEG_INF ? 0.0f : expf(v - mn);
    const float l = st_warp_sum(p);
    if (lane < n) s[lane] = p;
    if (lane == 0) {
        const float r = mo == ST_NEG_INF ? 0.0f : expf(mo - mn);
        *c = r;
        ml[0] = mn;
        ml[1] = ml[1] * r + l;
    }
}

// Decode attention over per-slot KV, split over the context, one block per (KV head, split,
// token) serving all G = n_head / n_head_kv query heads that share the KV head, so each K and
// V row is read once per step rather than G times. Token t reads slot slot[t]'s layer at
// kv + slot*slot_bytes + k_off / v_off. Its n_ctx[t] cells are cut into gridDim.y splits of
// da_chunk(n_ctx[t], gridDim.y) cells (computed on the device, so a graph captured once
// spreads any context over all its splits), walked in sub-chunks of DA_SUB cells: DA_TPC
// threads score one cell (their dims interleaved, reduced by shuffles), one warp per head
// runs the online softmax, then each thread accumulates P.V for its own dims (V rows read
// coalesced). Writes the split's unnormalised output and (max, sum); splits past the context
// write nothing (dq_attn_combine stops at the last used split).
// grid: (n_head_kv, n_split, n_tok); block: DA_THREADS. G <= DA_MAXG; hd <= ATT_MAX_D.
#define DA_THREADS 128
#define DA_SUB 16
#define DA_TPC (DA_THREADS / DA_SUB)
#define DA_MAXG 16
#define DA_DIMS (ATT_MAX_D / DA_THREADS)
// Cells per split: the context over n_split splits, in whole sub-chunks.
__device__ __forceinline__ int da_chunk(int ctx, int n_split) {
    const int per = (ctx + n_split - 1) / n_split;
    return (per + DA_SUB - 1) / DA_SUB * DA_SUB;
}
ST_KERNEL void dq_attn_gqa(const float* q, const u8* kv, const int* slot, const int* n_ctx,
                           long slot_bytes, long k_off, long v_off, int kv_ty, int n_head,
                           int n_head_kv, int hd, long row_bytes, float scale, float* part_o,
                           float* part_ms) {
    st_pdl_enter();
    __shared__ __align__(16) float qs[DA_MAXG * ATT_MAX_D];
    __shared__ float ps[DA_MAXG][DA_SUB];
    __shared__ float ml[DA_MAXG][2], cf[DA_MAXG];
    const int kvh = blockIdx.x, sp = blockIdx.y, t = blockIdx.z, n_split = gridDim.y;
    const int G = n_head / n_head_kv;
    const int ctx = n_ctx[t];
    const int chunk = da_chunk(ctx, n_split);
    const int c0 = sp * chunk;
    if (c0 >= ctx) return;
    const int c1 = min(c0 + chunk, ctx);
    const u8* kb = kv + (long)slot[t] * slot_bytes + k_off;
    const u8* vb = kv + (long)slot[t] * slot_bytes + v_off;
    const float* qg = q + ((long)t * n_head + (long)kvh * G) * hd;
    // The group's queries, eight loads per thread in flight before the shared stores (a store
    // between loads through a generic pointer, which may alias shared memory, would hold
    // each load back until the store before it).
    for (int i0 = threadIdx.x; i0 < G * hd; i0 += 8 * DA_THREADS) {
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int i = i0 + u * DA_THREADS;
            v[u] = i < G * hd ? qg[i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int i = i0 + u * DA_THREADS;
            if (i < G * hd) qs[i] = v[u] * scale;
        }
    }
    if (threadIdx.x < G) {
        ml[threadIdx.x][0] = ST_NEG_INF;
        ml[threadIdx.x][1] = 0.0f;
    }
    const int warp = threadIdx.x / ST_WARP;
    const int cc = threadIdx.x / DA_TPC, part = threadIdx.x % DA_TPC;
    // F16 rows read 8 halves at a time when every address involved is 16-byte aligned.
    const bool vec = kv_ty == ST_TY_F16 && hd % (8 * DA_TPC) == 0 &&
                     (((unsigned long long)kb | (unsigned long long)row_bytes |
                       (unsigned long long)(kvh * hd * 2)) & 15) == 0;
    float acc[DA_DIMS][DA_MAXG];
#pragma unroll
    for (int i = 0; i < DA_DIMS; ++i)
#pragma unroll
        for (int g = 0; g < DA_MAXG; ++g) acc[i][g] = 0.0f;
    __syncthreads();
    for (int s0 = c0; s0 < c1; s0 += DA_SUB) {
        const int nc = min(DA_SUB, c1 - s0);
        // Scores of the sub-chunk's cells for every head of the group.
        float sc[DA_MAXG];
#pragma unroll
        for (int g = 0; g < DA_MAXG; ++g) sc[g] = 0.0f;
        if (cc < nc) {
            const u8* kr = kb + (long)(s0 + cc) * row_bytes;
            if (vec) {
                const uint4* k4 = (const uint4*)(kr + (long)kvh * hd * 2);
                for (int j = part; j < hd / 8; j += DA_TPC) {
                    const uint4 raw = k4[j];
                    const u32 pk[4] = {raw.x, raw.y, raw.z, raw.w};
                    float kf[8];
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        kf[2 * e] = st_h2f((u16)(pk[e] & 0xffff));
                        kf[2 * e + 1] = st_h2f((u16)(pk[e] >> 16));
                    }
#pragma unroll
                    for (int g = 0; g < DA_MAXG; ++g) {
                        if (g < G) {
                            const float4 a = *(const float4*)(qs + g * hd + j * 8);
                            const float4 b = *(const float4*)(qs + g * hd + j * 8 + 4);
                            sc[g] += a.x * kf[0] + a.y * kf[1] + a.z * kf[2] + a.w * kf[3] +
                                     b.x * kf[4] + b.y * kf[5] + b.z * kf[6] + b.w * kf[7];
                        }
                    }
                }
            } else {
                for (int d = part; d < hd; d += DA_TPC) {
                    const float kf = att_elem(kr, kv_ty, kvh * hd + d);
#pragma unroll
                    for (int g = 0; g < DA_MAXG; ++g)
                        if (g < G) sc[g] += qs[g * hd + d] * kf;
                }
            }
        }
#pragma unroll
        for (int g = 0; g < DA_MAXG; ++g) {
            if (g < G) {
                float v = sc[g];
#pragma unroll
                for (int o = DA_TPC / 2; o > 0; o >>= 1) v += ST_SHFL_XOR(v, o);
                if (part == 0) ps[g][cc] = cc < nc ? v : ST_NEG_INF;
            }
        }
        __syncthreads();
        // Online softmax: one warp per head (DA_SUB <= 32 cells, one per lane).
        for (int g = warp; g < G; g += DA_THREADS / ST_WARP)
            da_softmax_step(ps[g], DA_SUB, ml[g], cf + g);
        __syncthreads();
        // P.V for this thread's dims.
#pragma unroll
        for (int i = 0; i < DA_DIMS; ++i) {
            const int d = threadIdx.x + i * DA_THREADS;
            if (d < hd) {
#pragma unroll
                for (int g = 0; g < DA_MAXG; ++g)
                    if (g < G) acc[i][g] *= cf[g];
#pragma unroll 8
                for (int c = 0; c < nc; ++c) {
                    const float vv = att_elem(vb + (long)(s0 + c) * row_bytes, kv_ty, kvh * hd + d);
#pragma unroll
                    for (int g = 0; g < DA_MAXG; ++g)
                        if (g < G) acc[i][g] += ps[g][c] * vv;
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < DA_DIMS; ++i) {
        const int d = threadIdx.x + i * DA_THREADS;
        if (d < hd) {
#pragma unroll
            for (int g = 0; g < DA_MAXG; ++g) {
                if (g < G) {
                    const long sl = ((long)t * n_head + (long)kvh * G + g) * n_split + sp;
                    part_o[sl * hd + d] = acc[i][g];
                }
            }
        }
    }
    if (threadIdx.x < G) {
        const long sl = ((long)t * n_head + (long)kvh * G + threadIdx.x) * n_split + sp;
        part_ms[sl * 2] = ml[threadIdx.x][0];
        part_ms[sl * 2 + 1] = ml[threadIdx.x][1];
    }
}

// Merges dq_attn_gqa's splits of token t, head h: those that start inside the context. The
// splits' weights exp(m_s - M) are computed once into shared memory, then every output
// dimension sums its splits with independent loads. grid: (n_head, n_tok); block: 128;
// n_split <= DA_MAX_SPLIT; out: [n_tok][n_head][hd].
#define DA_MAX_SPLIT 128
ST_KERNEL void dq_attn_combine(const float* part_o, const float* part_ms, const int* n_ctx,
                               int n_head, int hd, int n_split, float* out) {
    st_pdl_enter();
    __shared__ float w[DA_MAX_SPLIT];
    __shared__ float red[32];
    const int h = blockIdx.x, t = blockIdx.y;
    const long base = ((long)t * n_head + h) * n_split;
    const int chunk = da_chunk(n_ctx[t], n_split);
    const int used = min(n_split, (n_ctx[t] + chunk - 1) / chunk);
    float m = ST_NEG_INF;
    for (int sp = threadIdx.x; sp < used; sp += blockDim.x) m = fmaxf(m, part_ms[(base + sp) * 2]);
    const float M = st_block_max(m, red);
    float l = 0.0f;
    for (int sp = threadIdx.x; sp < used; sp += blockDim.x) {
        const float e = expf(part_ms[(base + sp) * 2] - M);
        w[sp] = e;
        l += e * part_ms[(base + sp) * 2 + 1];
    }
    __syncthreads();  // w complete; st_block_sum's barriers also keep red's reuse safe
    const float inv = 1.0f / st_block_sum(l, red);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = 0.0f;
#pragma unroll 16
        for (int sp = 0; sp < used; ++sp) o += w[sp] * part_o[(base + sp) * hd + d];
        out[((long)t * n_head + h) * hd + d] = o * inv;
    }
}

// Decode attention in one launch per layer: the QK-norm and RoPE of the queries, the KV store
// of the step's own K and V, split-KV attention and the merge of the splits, which
// dq_rope_store + dq_attn_gqa + dq_attn_combine do in three. Block (kvh, sp, t) serves the
// G = n_head / n_head_kv query heads of KV head kvh over cells [sp * chunk, +chunk) of token
// t's context (pos[t] + 1 cells; chunk from df_chunk, at least min_chunk cells), walked in
// tiles of DF_SUB cells of K and V staged in shared memory. Before st_pdl_wait it loads its
// first tile's cells of earlier steps (written by earlier steps' launches, never by this
// step's) and asks L2 for the rest; the block whose split holds the step's own cell
// normalises, rotates and stores K and stores V there first. Each block normalises and rotates its G queries in
// shared memory (q itself is left as the Q/K/V product wrote it). A context of one split
// writes out directly; otherwise every block writes its unnormalised output and (max, sum)
// into part_o / part_ms, and the last of the token's blocks for kvh to finish (counted in
// cnt[t * n_head_kv + kvh], which it resets) merges them into out. F16 KV only, hd <= 128 and
// a multiple of 8, 128 % G == 0 (the host uses the three launches otherwise).
// grid: (n_head_kv, n_split, n_tok); block: DA_THREADS (128).
#define DF_SUB 32
#define DF_TPC (DA_THREADS / DF_SUB)
#define DF_MAXD 128
#define DF_K8 (DF_MAXD / 8 / DF_TPC)
// A tile: DF_SUB cells of the head's K and V rows (16-byte chunks, rows padded by one chunk
// so the score loads of 8 cells spread over the bank groups), DF_TU chunks a thread.
#define DF_ROW (DF_MAXD / 8 + 1)
#define DF_TU (2 * DF_SUB * (DF_MAXD / 8) / DA_THREADS)

// Loads (into registers) of the tile of cells [s0, s0 + nc) of K and V head kvh (the head's
// n8 chunks at byte hoff of each row), leaving out cell `skip`: the thread's chunk i = tid +
// u * DA_THREADS is (K or V, cell, chunk) = (i / (DF_SUB * 16), i / 16 % DF_SUB, i % 16).
__device__ __forceinline__ void df_tile_load(uint4 (&r)[DF_TU], const u8* kb, const u8* vb,
                                             long row_bytes, long hoff, int s0, int nc, int n8,
                                             int skip) {
#pragma unroll
    for (int u = 0; u < DF_TU; ++u) {
        const int i = threadIdx.x + u * DA_THREADS;
        const int cell = i / (DF_MAXD / 8) % DF_SUB, j = i % (DF_MAXD / 8);
        const u8* base = i < DF_SUB * (DF_MAXD / 8) ? kb : vb;
        if (cell < nc && j < n8 && s0 + cell != skip)
            r[u] = *(const uint4*)(base + (long)(s0 + cell) * row_bytes + hoff + j * 16);
    }
}
// ... and their stores into the tile (the same chunks).
__device__ __forceinline__ void df_tile_store(const uint4 (&r)[DF_TU], uint4 (*kt)[DF_ROW],
                                              uint4 (*vt)[DF_ROW], int s0, int nc, int n8,
                                              int skip) {
#pragma unroll
    for (int u = 0; u < DF_TU; ++u) {
        const int i = threadIdx.x + u * DA_THREADS;
        const int cell = i / (DF_MAXD / 8) % DF_SUB, j = i % (DF_MAXD / 8);
        if (cell < nc && j < n8 && s0 + cell != skip)
            (i < DF_SUB * (DF_MAXD / 8) ? kt : vt)[cell][j] = r[u];
    }
}

// Cells per split of dq_attn_fused: the context over n_split splits, at least min_chunk, in
// multiples of 16 (a split of 16 cells fills half a tile). On the H200 at a 600-cell context
// splits of at least 32 cells (the engine's default) beat 16 and 64: 243 against 235 and 224
// tok/s decode.
__device__ __forceinline__ int df_chunk(int ctx, int n_split, int min_chunk) {
    const int per = max((ctx + n_split - 1) / n_split, min_chunk);
    return (per + 15) / 16 * 16;
}

// dst[0..hd) = RoPE(RMSNorm(src) * w) * mul by the calling warp (st_head_norm_rope's
// arithmetic, then the factor mul): the warp's writes to dst are visible to it on return.
__device__ __forceinline__ void df_warp_norm_rope(const float* src, float* dst, const float* w,
                                                  float eps, float p, const float* inv_freq,
                                                  float attn_factor, int hd, int n_rot,
                                                  float mul) {
    const int lane = threadIdx.x % ST_WARP;
    float ss = 0.0f;
    for (int i = lane; i < hd; i += ST_WARP) {
        const float v = src[i];
        dst[i] = v;
        ss += v * v;
    }
    ss = st_warp_sum(ss);
    if (w) {
        const float r = 1.0f / sqrtf(ss / (float)hd + eps);
        for (int i = lane; i < hd; i += ST_WARP) dst[i] = w[i] * (dst[i] * r);
    }
    ST_SYNCWARP();
    const int half = n_rot / 2;
    for (int i = lane; i < half; i += ST_WARP) {
        float s, c;
        sincosf(inv_freq[i] * p, &s, &c);
        c *= attn_factor;
        s *= attn_factor;
        const float a = dst[i], b = dst[i + half];
        const float x0 = a * c - b * s, x1 = b * c + a * s;
        dst[i] = x0 * mul;
        dst[i + half] = x1 * mul;
    }
    if (mul != 1.0f)
        for (int i = n_rot + lane; i < hd; i += ST_WARP) dst[i] *= mul;
    ST_SYNCWARP();
}

ST_KERNEL void dq_attn_fused(const float* q, const float* k, const float* v, const float* q_norm,
                             const float* k_norm, float eps, const int* pos,
                             const float* inv_freq, float attn_factor, int n_head,
                             int n_head_kv, int hd, int n_rot, u8* kv, const int* slot,
                             long slot_bytes, long k_off, long v_off, long row_bytes,
                             float scale, int min_chunk, float* part_o, float* part_ms,
                             unsigned* cnt, float* out) {
    __shared__ __align__(16) float qs[DA_MAXG * DF_MAXD];
    __shared__ __align__(16) uint4 kt[DF_SUB][DF_ROW], vt[DF_SUB][DF_ROW];
    __shared__ float ps[DA_MAXG][DF_SUB + 1];  // + 1: the P.V groups read different rows
    __shared__ float kn[DF_MAXD];
    __shared__ float ml[DA_MAXG][2], cf[DA_MAXG];
    __shared__ int last;
    const int kvh = blockIdx.x, sp = blockIdx.y, t = blockIdx.z, n_split = gridDim.y;
    const int G = n_head / n_head_kv;
    const int lane = threadIdx.x % ST_WARP, warp = threadIdx.x / ST_WARP;
    const int n_warps = DA_THREADS / ST_WARP;
    const int n8 = hd / 8;
    // pos and slot are step inputs, uploaded before the step began.
    const int p = pos[t], ctx = p + 1;
    const int chunk = df_chunk(ctx, n_split, min_chunk);
    const int used = (ctx + chunk - 1) / chunk;
    const int c0 = sp * chunk, c1 = min(c0 + chunk, ctx);
    u8* kb = kv + (long)slot[t] * slot_bytes + k_off;
    u8* vb = kv + (long)slot[t] * slot_bytes + v_off;
    const long hoff = (long)kvh * hd * 2;  // F16: the head's bytes in a row
    // The first tile's cells of earlier steps, loaded while the kernel ahead finishes (earlier
    // steps wrote them); the rest of the split only asked of L2.
    uint4 pre[DF_TU];
    if (c0 < ctx) df_tile_load(pre, kb, vb, row_bytes, hoff, c0, min(DF_SUB, c1 - c0), n8, p);
    for (int c = c0 + DF_SUB + warp; c < min(c1, p); c += n_warps) {
        st_prefetch_l2(kb + (long)c * row_bytes + hoff, hd * 2);
        st_prefetch_l2(vb + (long)c * row_bytes + hoff, hd * 2);
    }
    st_pdl_enter();
    if (c0 >= ctx) return;
    df_tile_store(pre, kt, vt, c0, min(DF_SUB, c1 - c0), n8, p);
    for (int g = warp; g < G; g += n_warps)
        df_warp_norm_rope(q + ((long)t * n_head + (long)kvh * G + g) * hd, qs + g * hd, q_norm,
                          eps, (float)p, inv_freq, attn_factor, hd, n_rot, scale);
    if (c1 == ctx) {
        // This split holds the step's own cell: K normalised and rotated, K and V stored, and
        // when the first tile holds the cell, its row read back into the tile (the block's
        // own stores, visible to it after the barrier).
        if (warp == n_warps - 1)
            df_warp_norm_rope(k + ((long)t * n_head_kv + kvh) * hd, kn, k_norm, eps, (float)p,
                              inv_freq, attn_factor, hd, n_rot, 1.0f);
        __syncthreads();
        u8* cell = kv + (long)slot[t] * slot_bytes + (long)p * row_bytes;
        dq_store_seg(kn, cell + k_off, ST_TY_F16, kvh * hd, hd);
        dq_store_seg(v + ((long)t * n_head_kv + kvh) * hd, cell + v_off, ST_TY_F16, kvh * hd, hd);
        __syncthreads();
        if (p < c0 + DF_SUB && threadIdx.x < 2 * n8) {
            const int j = threadIdx.x % n8;
            const bool is_v = threadIdx.x >= n8;
            (is_v ? vt : kt)[p - c0][j] =
                *(const uint4*)((is_v ? vb : kb) + (long)p * row_bytes + hoff + j * 16);
        }
    }
    if (threadIdx.x < G) {
        ml[threadIdx.x][0] = ST_NEG_INF;
        ml[threadIdx.x][1] = 0.0f;
    }
    __syncthreads();
    // Scores: DF_TPC threads per cell, 8 dims (one 16-byte chunk) at a time.
    const int cc = threadIdx.x / DF_TPC, part = threadIdx.x % DF_TPC;
    // P.V: 128 / G threads per head, 8 dims each at a time.
    const int tph = DA_THREADS / G, pg = threadIdx.x / tph, pj = threadIdx.x % tph;
    float acc[2][8];
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[u][i] = 0.0f;
    for (int s0 = c0; s0 < c1; s0 += DF_SUB) {
        const int nc = min(DF_SUB, c1 - s0);
        if (s0 > c0) {
            // Later tiles (long contexts): loaded now, the step's own cell included.
            uint4 r[DF_TU];
            df_tile_load(r, kb, vb, row_bytes, hoff, s0, nc, n8, -1);
            df_tile_store(r, kt, vt, s0, nc, n8, -1);
            __syncthreads();
        }
        float kf[DF_K8][8];
        if (cc < nc) {
#pragma unroll
            for (int u = 0; u < DF_K8; ++u) {
                const int j = part + u * DF_TPC;
                const uint4 raw = j < n8 ? kt[cc][j] : make_uint4(0, 0, 0, 0);
                const u32 pk[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    kf[u][2 * e] = st_h2f((u16)(pk[e] & 0xffff));
                    kf[u][2 * e + 1] = st_h2f((u16)(pk[e] >> 16));
                }
            }
        }
        for (int g = 0; g < G; ++g) {
            float s = 0.0f;
            if (cc < nc) {
#pragma unroll
                for (int u = 0; u < DF_K8; ++u) {
                    const int j = part + u * DF_TPC;
                    if (j < n8) {
                        const float4 a = *(const float4*)(qs + g * hd + j * 8);
                        const float4 b = *(const float4*)(qs + g * hd + j * 8 + 4);
                        s += a.x * kf[u][0] + a.y * kf[u][1] + a.z * kf[u][2] + a.w * kf[u][3] +
                             b.x * kf[u][4] + b.y * kf[u][5] + b.z * kf[u][6] + b.w * kf[u][7];
                    }
                }
            }
#pragma unroll
            for (int o = DF_TPC / 2; o > 0; o >>= 1) s += ST_SHFL_XOR(s, o);
            if (part == 0) ps[g][cc] = cc < nc ? s : ST_NEG_INF;
        }
        __syncthreads();
        // Online softmax: one warp per head, one cell per lane.
        for (int g = warp; g < G; g += n_warps) da_softmax_step(ps[g], DF_SUB, ml[g], cf + g);
        __syncthreads();
        // P.V: this thread's head pg, dims [8j, 8j + 8) for j = pj, pj + tph (at most two).
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int j = pj + u * tph;
            if (j < n8) {
                const float c = cf[pg];
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[u][i] *= c;
#pragma unroll 4
                for (int cl = 0; cl < nc; ++cl) {
                    const uint4 raw = vt[cl][j];
                    const float pv = ps[pg][cl];
                    const u32 pk[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        acc[u][2 * e] += pv * st_h2f((u16)(pk[e] & 0xffff));
                        acc[u][2 * e + 1] += pv * st_h2f((u16)(pk[e] >> 16));
                    }
                }
            }
        }
        __syncthreads();
    }
    const long head = (long)t * n_head + (long)kvh * G + pg;
    if (used == 1) {
        const float inv = 1.0f / ml[pg][1];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int j = pj + u * tph;
            if (j < n8)
#pragma unroll
                for (int i = 0; i < 8; ++i) out[head * hd + j * 8 + i] = acc[u][i] * inv;
        }
        return;
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int j = pj + u * tph;
        if (j < n8)
#pragma unroll
            for (int i = 0; i < 8; ++i) part_o[(head * n_split + sp) * hd + j * 8 + i] = acc[u][i];
    }
    if (threadIdx.x < G) {
        const long sl = ((long)t * n_head + (long)kvh * G + threadIdx.x) * n_split + sp;
        part_ms[sl * 2] = ml[threadIdx.x][0];
        part_ms[sl * 2 + 1] = ml[threadIdx.x][1];
    }
    __threadfence();  // this split's part is visible before the count says so
    __syncthreads();
    unsigned* c = cnt + (long)t * n_head_kv + kvh;
    if (threadIdx.x == 0) last = atomicAdd(c, 1u) == (unsigned)(used - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (threadIdx.x == 0) *c = 0;
    // The merge: weights exp(m_s - M) per head and split into qs (free now), the sums into ml.
    float* w = qs;
    for (int g = warp; g < G; g += n_warps) {
        const long base = ((long)t * n_head + (long)kvh * G + g) * n_split;
        float m = ST_NEG_INF;
        for (int s = lane; s < used; s += ST_WARP) m = fmaxf(m, st_ldcg(part_ms + (base + s) * 2));
        m = st_warp_max(m);
        float l = 0.0f;
        for (int s = lane; s < used; s += ST_WARP) {
            const float e = expf(st_ldcg(part_ms + (base + s) * 2) - m);
            w[g * DA_MAX_SPLIT + s] = e;
            l += e * st_ldcg(part_ms + (base + s) * 2 + 1);
        }
        l = st_warp_sum(l);
        if (lane == 0) ml[g][1] = l;
    }
    __syncthreads();
    const float inv = 1.0f / ml[pg][1];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int j = pj + u * tph;
        if (j < n8) {
            float o[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = 0.0f;
#pragma unroll 4
            for (int s = 0; s < used; ++s) {
                const float ws = w[pg * DA_MAX_SPLIT + s];
                const float4* src = (const float4*)(part_o + (head * n_split + s) * hd + j * 8);
                const float4 a = st_ldcg(src), b = st_ldcg(src + 1);
                o[0] += ws * a.x; o[1] += ws * a.y; o[2] += ws * a.z; o[3] += ws * a.w;
                o[4] += ws * b.x; o[5] += ws * b.y; o[6] += ws * b.z; o[7] += ws * b.w;
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) out[head * hd + j * 8 + i] = o[i] * inv;
        }
    }
}

// Greedy token choice on the device: out[r] = the index of the largest of x[r][0..cols)
// (lowest index on ties; NaN and -inf never win; a row with neither a finite value nor +inf
// gives 0, as sampler::argmax on the host). Block (b, r) reduces its slice of row r to a
// (value, index) pair in part_v / part_i[r * gridDim.x + b]; the last of row r's blocks to
// finish (counted in cnt[r], which it resets) reduces the row's pairs into out[r].
// grid: (blocks per row, rows); block: AM_THREADS.
#define AM_THREADS 256
#define AM_NONE 0x7fffffff
__device__ __forceinline__ void am_take(float& bv, int& bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) {
        bv = v;
        bi = i;
    }
}
// The block's best pair, in thread 0 (every thread calls it).
__device__ __forceinline__ void am_block(float& bv, int& bi, float* sv, int* si) {
    const int lane = threadIdx.x % ST_WARP, warp = threadIdx.x / ST_WARP;
#pragma unroll
    for (int o = ST_WARP / 2; o > 0; o >>= 1) {
        const float ov = ST_SHFL_XOR(bv, o);
        const int oi = ST_SHFL_XOR(bi, o);
        am_take(bv, bi, ov, oi);
    }
    __syncthreads();  // sv / si free (a previous call's readers are done)
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x / ST_WARP;
        bv = lane < nw ? sv[lane] : ST_NEG_INF;
        bi = lane < nw ? si[lane] : AM_NONE;
#pragma unroll
        for (int o = ST_WARP / 2; o > 0; o >>= 1) {
            const float ov = ST_SHFL_XOR(bv, o);
            const int oi = ST_SHFL_XOR(bi, o);
            am_take(bv, bi, ov, oi);
        }
    }
}
ST_KERNEL void dq_argmax_rows(const float* x, int cols, float* part_v, int* part_i,
                              unsigned* cnt, int* out) {
    st_pdl_enter();
    __shared__ float sv[AM_THREADS / 32];
    __shared__ int si[AM_THREADS / 32];
    __shared__ int last;
    const int r = blockIdx.y, nb = gridDim.x;
    const long per = ((long)cols + nb - 1) / nb;
    const long c0 = (long)blockIdx.x * per, c1 = min((long)cols, c0 + per);
    const float* row = x + (long)r * cols;
    float bv = ST_NEG_INF;
    int bi = AM_NONE;
    for (long c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
        const float v = row[c];
        if (v > ST_NEG_INF) am_take(bv, bi, v, (int)c);
    }
    am_block(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        part_v[(long)r * nb + blockIdx.x] = bv;
        part_i[(long)r * nb + blockIdx.x] = bi;
        __threadfence();  // the pair is visible before the count says so
        last = atomicAdd(cnt + r, 1u) == (unsigned)(nb - 1);
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    bv = ST_NEG_INF;
    bi = AM_NONE;
    for (int b = threadIdx.x; b < nb; b += blockDim.x)
        am_take(bv, bi, st_ldcg(part_v + (long)r * nb + b), st_ldcg(part_i + (long)r * nb + b));
    am_block(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        out[r] = bi == AM_NONE ? 0 : bi;
        cnt[r] = 0;
    }
}

// Step inputs derived on the device: n_ctx[t] = pos[t] + 1.
ST_KERNEL void dq_ctx_from_pos(const int* pos, int* n_ctx, int n_tok) {
    st_pdl_enter();
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n_tok) n_ctx[t] = pos[t] + 1;
}

// Prefill attention, flash style (no score matrix): the n_tok query tokens all belong to the
// slot slot[0] and are already in its KV; query t sees cells [0, pos[t]]. K and V tiles of kt
// cells are dequantized into shared memory once per block and shared by its PF_Q queries;
// each warp keeps its queries' running max, sum and output in registers.
// grid: (n_head, ceil(n_tok / PF_Q)); block: PF_WARPS warps;
// dynamic shared: (2 * kt * (hd + 1) + PF_Q * hd) floats; kt <= 32, hd <= ATT_MAX_D.
#define PF_Q 16
#define PF_WARPS 4
ST_KERNEL void dq_attn_prefill(const float* q, const u8* kv, const int* slot, const int* pos,
                               long slot_bytes, long k_off, long v_off, int kv_ty, int n_head,
                               int n_head_kv, int hd, long row_bytes, float scale, int kt,
                               int n_tok, float* out) {
    st_pdl_enter();
    extern __shared__ float sm[];
    const int ld = hd + 1;
    float* ks = sm;
    float* vs = ks + kt * ld;
    float* qs = vs + kt * ld;
    const int h = blockIdx.x, t0 = blockIdx.y * PF_Q;
    const int lane = threadIdx.x % ST_WARP, warp = threadIdx.x / ST_WARP;
    const int kvh = h / (n_head / n_head_kv);
    const u8* kb = kv + (long)slot[0] * slot_bytes + k_off;
    const u8* vb = kv + (long)slot[0] * slot_bytes + v_off;
    int cmax = 0;
    for (int i = 0; i < PF_Q && t0 + i < n_tok; ++i) cmax = max(cmax, pos[t0 + i] + 1);
    for (int i = threadIdx.x; i < PF_Q * hd; i += blockDim.x) {
        const int qi = i / hd, d = i % hd;
        qs[i] = t0 + qi < n_tok ? q[((long)(t0 + qi) * n_head + h) * hd + d] : 0.0f;
    }
    constexpr int PER = ATT_MAX_D / ST_WARP;
    constexpr int QW = PF_Q / PF_WARPS;
    float m[QW], l[QW], acc[QW][PER];
    int ctx[QW];
#pragma unroll
    for (int a = 0; a < QW; ++a) {
        m[a] = ST_NEG_INF;
        l[a] = 0.0f;
        const int t = t0 + warp + a * PF_WARPS;
        ctx[a] = t < n_tok ? pos[t] + 1 : 0;
#pragma unroll
        for (int i = 0; i < PER; ++i) acc[a][i] = 0.0f;
    }
    for (int c0 = 0; c0 < cmax; c0 += kt) {
        __syncthreads();
        for (int i = threadIdx.x; i < kt * hd; i += blockDim.x) {
            const int c = i / hd, d = i % hd;
            float kvk = 0.0f, kvv = 0.0f;
            if (c0 + c < cmax) {
                kvk = att_elem(kb + (long)(c0 + c) * row_bytes, kv_ty, kvh * hd + d);
                kvv = att_elem(vb + (long)(c0 + c) * row_bytes, kv_ty, kvh * hd + d);
            }
            ks[c * ld + d] = kvk;
            vs[c * ld + d] = kvv;
        }
        __syncthreads();
#pragma unroll
        for (int a = 0; a < QW; ++a) {
            if (c0 >= ctx[a]) continue;
            const float* qr = qs + (warp + a * PF_WARPS) * hd;
            const int c = c0 + lane;
            float s = ST_NEG_INF;
            if (lane < kt && c < ctx[a]) {
                float dot = 0.0f;
                for (int d = 0; d < hd; ++d) dot += qr[d] * ks[lane * ld + d];
                s = dot * scale;
            }
            const float nm = fmaxf(m[a], st_warp_max(s));
            const float corr = expf(m[a] - nm);
            const float p = s == ST_NEG_INF ? 0.0f : expf(s - nm);
            l[a] = l[a] * corr + st_warp_sum(p);
            m[a] = nm;
#pragma unroll
            for (int i = 0; i < PER; ++i) acc[a][i] *= corr;
            for (int j = 0; j < kt; ++j) {
                const float pj = ST_SHFL(p, j);
#pragma unroll
                for (int i = 0; i < PER; ++i) {
                    const int d = lane + i * ST_WARP;
                    if (d < hd) acc[a][i] += pj * vs[j * ld + d];
                }
            }
        }
    }
#pragma unroll
    for (int a = 0; a < QW; ++a) {
        const int t = t0 + warp + a * PF_WARPS;
        if (t >= n_tok) continue;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int d = lane + i * ST_WARP;
            if (d < hd) out[((long)t * n_head + h) * hd + d] = acc[a][i] / l[a];
        }
    }
}

// MoE combine for prefill: x[t][i] += sum_j wts[t*k+j] * y[(t*k+j)][i] (y: one row of width n
// per assignment). grid: n_tok; block: 256.
ST_KERNEL void dq_moe_combine(const float* y, const float* wts, int k, int n, float* x) {
    st_pdl_enter();
    const long t = blockIdx.x;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float s = 0.0f;
        for (int j = 0; j < k; ++j) s += wts[t * k + j] * y[(t * k + j) * n + i];
        x[t * n + i] += s;
    }
}

// The MoE router for one token per warp: softmax over n_expert logits, the top k (ties to
// the lower index), renormalised when norm != 0 — what router.cu computes, without block
// barriers. grid: ceil(n_tok / 4); block: 128 (4 warps). n_expert <= 32 * DQ_RT_PER, k <= 32.
#define DQ_RT_PER 8
ST_KERNEL void dq_router_topk(const float* logits, int n_expert, int k, int norm, int n_tok,
                              int* idx_out, float* w_out) {
    st_pdl_enter();
    const int t = blockIdx.x * (blockDim.x / ST_WARP) + threadIdx.x / ST_WARP;
    if (t >= n_tok) return;
    dq_topk_warp(logits + (long)t * n_expert, n_expert, k, norm, idx_out + (long)t * k,
                 w_out + (long)t * k);
}

// Softmax over one token's n_expert logits x and its top k by the calling warp, written to
// idx_out[0..k) / w_out[0..k). Reads x through L2, so logits written by other blocks of the
// same launch (dq_router_rows) are seen once their writers' fences are.
__device__ void dq_topk_warp(const float* x, int n_expert, int k, int norm, int* idx_out,
                             float* w_out) {
    const int lane = threadIdx.x % ST_WARP;
    float p[DQ_RT_PER];
    float m = ST_NEG_INF;
#pragma unroll
    for (int i = 0; i < DQ_RT_PER; ++i) {
        const int e = lane + i * ST_WARP;
        p[i] = e < n_expert ? st_ldcg(x + e) : ST_NEG_INF;
        m = fmaxf(m, p[i]);
    }
    m = st_warp_max(m);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < DQ_RT_PER; ++i) {
        const int e = lane + i * ST_WARP;
        p[i] = e < n_expert ? expf(p[i] - m) : 0.0f;
        s += p[i];
    }
    s = st_warp_sum(s);
#pragma unroll
    for (int i = 0; i < DQ_RT_PER; ++i) {
        const int e = lane + i * ST_WARP;
        p[i] = e < n_expert ? p[i] / s : -1.0f;
    }
    float mine = 0.0f;  // lane j keeps the j-th chosen weight
    float tot = 0.0f;
    for (int j = 0; j < k; ++j) {
        float best = -2.0f;
        int bi = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < DQ_RT_PER; ++i) {
            const int e = lane + i * ST_WARP;
            if (p[i] > best) { best = p[i]; bi = e; }
        }
        for (int o = ST_WARP / 2; o > 0; o >>= 1) {
            const float ov = ST_SHFL_XOR(best, o);
            const int oi = ST_SHFL_XOR(bi, o);
            if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
        }
#pragma unroll
        for (int i = 0; i < DQ_RT_PER; ++i)
            if (lane + i * ST_WARP == bi) p[i] = -1.0f;
        if (lane == j) mine = best;
        tot += best;
        if (lane == 0) idx_out[j] = bi;
    }
    if (lane < k) w_out[lane] = norm ? mine / tot : mine;
}

// Profiling aid: keep the stream busy for `ns` nanoseconds so that the host queues the next
// kernel and its events before the GPU reaches them (the events then time the kernel alone,
// not the host's launch latency). grid: 1; block: 1.
ST_KERNEL void dq_spin(long long ns) {
    const unsigned long long t0 = st_globaltimer_ns();
    while ((long long)(st_globaltimer_ns() - t0) < ns) {
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
