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

// acc[t] += W_r . in(t) over the warp's lanes (not yet reduced across the warp).
template <int NT>
__device__ __forceinline__ void dq_row_dot(const u8* __restrict__ W, int ty, long rows, long cols,
                                           long r, const DqIn<NT>& in, int n_tok,
                                           float (&acc)[NT]) {
    const int lane = threadIdx.x % ST_WARP;
    if (ty == ST_TY_Q8_0) {
        const u8* qs = W + r * cols;
        const u16* ds = (const u16*)(W + rows * cols) + r * (cols / QK8_0);
#pragma unroll 2
        for (long i0 = lane * 16; i0 < cols; i0 += ST_WARP * 16) {
            const int4 q = *(const int4*)(qs + i0);
            const float d = st_h2f(ds[i0 / QK8_0]);
            const int qw[4] = {q.x, q.y, q.z, q.w};
            float w[16];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                w[4 * j + 0] = (float)(i8)(qw[j] & 0xff);
                w[4 * j + 1] = (float)(i8)((qw[j] >> 8) & 0xff);
                w[4 * j + 2] = (float)(i8)((qw[j] >> 16) & 0xff);
                w[4 * j + 3] = (float)(i8)((qw[j] >> 24) & 0xff);
            }
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < n_tok) {
                    float s = 0.0f;
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const float4 xv = in.ld(t, i0 + 4 * j);
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

// y[t][r] (+)= W_r . norm?(x[t]) for t < n_tok. W: rows x cols, device layout.
// nw: RMSNorm weights (cols) or null; add: accumulate into y instead of overwriting.
// grid: (ceil(rows / DQ_WARPS), ceil(n_tok / NT)); block: DQ_WARPS warps.
template <int NT>
__device__ __forceinline__ void dq_mv_body(const u8* W, int ty, int rows, int cols, const float* x,
                                           const float* nw, float eps, float* y, int n_tok,
                                           int add) {
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
    const int row = blockIdx.x * DQ_WARPS + threadIdx.x / ST_WARP;
    if (row >= rows) return;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
    dq_row_dot<NT>(W, ty, rows, cols, row, in, n_tok, acc);
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
                      float eps, float* y, int n_tok, int add) {
    dq_mv_body<1>(W, ty, rows, cols, x, nw, eps, y, n_tok, add);
}

ST_KERNEL void dq_mv8(const u8* W, int ty, int rows, int cols, const float* x, const float* nw,
                      float eps, float* y, int n_tok, int add) {
    dq_mv_body<DQ_MAX_TOK>(W, ty, rows, cols, x, nw, eps, y, n_tok, add);
}

// Q, K and V of n_tok tokens in one launch: rows [0, rq) from Wq into yq, [rq, rq+rk) from Wk
// into yk, the rest from Wv into yv; x RMS-normalised by nw (if given).
// grid: (ceil((rq+rk+rv) / DQ_WARPS), ceil(n_tok / 8)).
ST_KERNEL void dq_qkv8(const u8* Wq, const u8* Wk, const u8* Wv, int ty, int rq, int rk, int rv,
                       int cols, const float* x, const float* nw, float eps, float* yq,
                       float* yk, float* yv, int n_tok) {
    // grid.y: chunks of DQ_MAX_TOK tokens.
    const int t0 = blockIdx.y * DQ_MAX_TOK;
    if (t0 >= n_tok) return;
    x += (long)t0 * cols;
    yq += (long)t0 * rq;
    yk += (long)t0 * rk;
    yv += (long)t0 * rv;
    n_tok = min(DQ_MAX_TOK, n_tok - t0);
    DqIn<DQ_MAX_TOK> in;
    in.x = x;
    in.stride = cols;
    in.nw = nw;
    dq_norm_prologue<DQ_MAX_TOK>(in, cols, n_tok, eps);
    int row = blockIdx.x * DQ_WARPS + threadIdx.x / ST_WARP;
    const u8* W;
    float* y;
    int rows;
    if (row < rq) { W = Wq; y = yq; rows = rq; }
    else if (row < rq + rk) { row -= rq; W = Wk; y = yk; rows = rk; }
    else if (row < rq + rk + rv) { row -= rq + rk; W = Wv; y = yv; rows = rv; }
    else return;
    float acc[DQ_MAX_TOK];
#pragma unroll
    for (int t = 0; t < DQ_MAX_TOK; ++t) acc[t] = 0.0f;
    dq_row_dot<DQ_MAX_TOK>(W, ty, rows, cols, row, in, n_tok, acc);
    const int lane = threadIdx.x % ST_WARP;
#pragma unroll
    for (int t = 0; t < DQ_MAX_TOK; ++t) {
        if (t < n_tok) {
            const float s = st_warp_sum(acc[t]);
            if (lane == 0) y[(long)t * rows + row] = s;
        }
    }
}

// MoE gate and up with SwiGLU: for assignment a = t*k + j (grid.y, a < n_tok*k), expert
// e = ids[a], h[a][r] = silu(G_e,r . n(x[t])) * (U_e,r . n(x[t])). eptr[e*3 + 0/1/2] are the
// device addresses of expert e's gate, up and down matrices (gate/up: F x E, down: E x F).
// grid: (ceil(F / DQ_WARPS), n_tok * k).
ST_KERNEL void dq_moe_gate_up(const unsigned long long* eptr, int ty, int F, int E,
                              const int* ids, int k, const float* x, const float* nw, float eps,
                              float* h) {
    const int a = blockIdx.y;
    const int t = a / k;
    DqIn<1> in;
    in.x = x + (long)t * E;
    in.stride = E;
    in.nw = nw;
    dq_norm_prologue<1>(in, E, 1, eps);
    const int row = blockIdx.x * DQ_WARPS + threadIdx.x / ST_WARP;
    if (row >= F) return;
    const int e = ids[a];
    const u8* G = (const u8*)eptr[(long)e * 3 + 0];
    const u8* U = (const u8*)eptr[(long)e * 3 + 1];
    float g[1] = {0.0f}, u[1] = {0.0f};
    dq_row_dot<1>(G, ty, F, E, row, in, 1, g);
    dq_row_dot<1>(U, ty, F, E, row, in, 1, u);
    const float gs = st_warp_sum(g[0]), us = st_warp_sum(u[0]);
    if (threadIdx.x % ST_WARP == 0) h[(long)a * F + row] = dq_silu(gs) * us;
}

// MoE down and weighted sum, added into the residual stream:
// y[t][r] += sum_j wts[t*k+j] * (D_{ids[t*k+j]},r . h[t*k+j]). grid: (ceil(E / DQ_WARPS), n_tok).
ST_KERNEL void dq_moe_down(const unsigned long long* eptr, int ty, int E, int F, const int* ids,
                           const float* wts, int k, const float* h, float* y) {
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

// Embedding lookup: out[t] = row ids[t] of W (rows x cols, device layout), dequantized.
// grid: n_tok.
ST_KERNEL void dq_get_rows(const u8* W, int ty, int rows, int cols, const int* ids, float* out) {
    const long r = ids[blockIdx.x];
    float* o = out + (long)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) o[i] = dq_elem(W, ty, rows, cols, r, i);
}

// KV store: token t's K and V rows (width floats each) into cell pos[t] of slot slot[t]:
// K row at kv + slot*slot_bytes + k_off + pos*row_bytes, V likewise at v_off. F16 or Q8_0
// (GGUF block layout, ggml's reference rounding). grid: n_tok; block: 128.
ST_KERNEL void dq_kv_store(const float* k, const float* v, u8* kv, const int* slot,
                           const int* pos, long slot_bytes, long k_off, long v_off,
                           long row_bytes, int kv_ty, int width) {
    const int t = blockIdx.x;
    u8* base = kv + (long)slot[t] * slot_bytes + (long)pos[t] * row_bytes;
    for (int which = 0; which < 2; ++which) {
        const float* src = (which ? v : k) + (long)t * width;
        u8* dst = base + (which ? v_off : k_off);
        if (kv_ty == ST_TY_F16) {
            for (int i = threadIdx.x; i < width; i += blockDim.x)
                ((u16*)dst)[i] = st_f2h(src[i]);
        } else if (kv_ty == ST_TY_F32) {
            for (int i = threadIdx.x; i < width; i += blockDim.x) ((float*)dst)[i] = src[i];
        } else {
            // One warp per 32-element block.
            const int lane = threadIdx.x % ST_WARP, warp = threadIdx.x / ST_WARP;
            const int nw = blockDim.x / ST_WARP;
            for (int b = warp; b < width / QK8_0; b += nw) {
                float xv = 0.0f, amax = 0.0f;
                if (lane < QK8_0) {
                    xv = src[b * QK8_0 + lane];
                    amax = fabsf(xv);
                }
                amax = st_warp_max(amax);
                const float d = amax / 127.0f;
                const float id = d != 0.0f ? 1.0f / d : 0.0f;
                u8* blk = dst + (long)b * Q8_0_BYTES;
                if (lane == 0) {
                    const u16 dh = st_f2h(d);
                    blk[0] = (u8)(dh & 0xff);
                    blk[1] = (u8)(dh >> 8);
                }
                if (lane < QK8_0) {
                    float qf = roundf(xv * id);
                    qf = fminf(fmaxf(qf, -128.0f), 127.0f);
                    blk[2 + lane] = (u8)(i8)(int)qf;
                }
            }
        }
    }
}

// Decode attention over per-slot KV, split over the context: like attention.cu's
// attn_decode_partial, but token t reads slot slot[t]'s layer at kv + slot*slot_bytes +
// k_off / v_off, cells [0, n_ctx[t]). grid: (n_head, n_split, n_tok); block: ATT_WARPS warps.
ST_KERNEL void dq_attn_partial(const float* q, const u8* kv, const int* slot, const int* n_ctx,
                               long slot_bytes, long k_off, long v_off, int kv_ty, int n_head,
                               int n_head_kv, int hd, long row_bytes, float scale, int chunk,
                               float* part_o, float* part_ms) {
    __shared__ float wm[ATT_WARPS], ws[ATT_WARPS];
    __shared__ float wo[ATT_WARPS][ATT_MAX_D];
    const int h = blockIdx.x, sp = blockIdx.y, t = blockIdx.z, n_split = gridDim.y;
    const int lane = threadIdx.x % ST_WARP, warp = threadIdx.x / ST_WARP;
    const int kvh = h / (n_head / n_head_kv);
    const int ctx = n_ctx[t];
    const int c0 = sp * chunk;
    const int c1 = min(c0 + chunk, ctx);
    const u8* k = kv + (long)slot[t] * slot_bytes + k_off;
    const u8* v = kv + (long)slot[t] * slot_bytes + v_off;
    const float* qh = q + ((long)t * n_head + h) * hd;
    constexpr int PER = ATT_MAX_D / ST_WARP;
    float qr[PER], acc[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int d = lane + i * ST_WARP;
        qr[i] = d < hd ? qh[d] : 0.0f;
        acc[i] = 0.0f;
    }
    float m = ST_NEG_INF, s = 0.0f;
    for (int c = c0 + warp; c < c1; c += ATT_WARPS) {
        const u8* kr = k + (long)c * row_bytes;
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int d = lane + i * ST_WARP;
            if (d < hd) dot += qr[i] * att_elem(kr, kv_ty, kvh * hd + d);
        }
        const float sc = st_warp_sum(dot) * scale;
        const float nm = fmaxf(m, sc);
        const float corr = expf(m - nm);
        const float pw = expf(sc - nm);
        s = s * corr + pw;
        const u8* vr = v + (long)c * row_bytes;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int d = lane + i * ST_WARP;
            if (d < hd) acc[i] = acc[i] * corr + pw * att_elem(vr, kv_ty, kvh * hd + d);
        }
        m = nm;
    }
    if (lane == 0) { wm[warp] = m; ws[warp] = s; }
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int d = lane + i * ST_WARP;
        if (d < hd) wo[warp][d] = acc[i];
    }
    __syncthreads();
    float M = ST_NEG_INF;
    for (int w = 0; w < ATT_WARPS; ++w) M = fmaxf(M, wm[w]);
    const long sl = ((long)t * n_head + h) * n_split + sp;
    float S = 0.0f;
    float f[ATT_WARPS];
    for (int w = 0; w < ATT_WARPS; ++w) {
        f[w] = wm[w] == ST_NEG_INF ? 0.0f : expf(wm[w] - M);
        S += f[w] * ws[w];
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < ATT_WARPS; ++w) o += f[w] * wo[w][d];
        part_o[sl * hd + d] = o;
    }
    if (threadIdx.x == 0) {
        part_ms[sl * 2] = M;
        part_ms[sl * 2 + 1] = S;
    }
}

// Step inputs derived on the device: n_ctx[t] = pos[t] + 1.
ST_KERNEL void dq_ctx_from_pos(const int* pos, int* n_ctx, int n_tok) {
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
                const float pj = __shfl_sync(0xffffffffu, p, j);
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
    const int lane = threadIdx.x % ST_WARP;
    const int t = blockIdx.x * (blockDim.x / ST_WARP) + threadIdx.x / ST_WARP;
    if (t >= n_tok) return;
    const float* x = logits + (long)t * n_expert;
    float p[DQ_RT_PER];
    float m = ST_NEG_INF;
#pragma unroll
    for (int i = 0; i < DQ_RT_PER; ++i) {
        const int e = lane + i * ST_WARP;
        p[i] = e < n_expert ? x[e] : ST_NEG_INF;
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
        if (lane == 0) idx_out[(long)t * k + j] = bi;
    }
    if (lane < k) w_out[(long)t * k + lane] = norm ? mine / tot : mine;
}
