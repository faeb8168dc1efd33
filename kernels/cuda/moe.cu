// moe.cu: the MoE router and experts of decode and short prefill passes: router logits with
// the norm folded in (and the top-k in the last block), the softmax top-k (one warp per
// token, or a block per token past 256 experts), the experts' gate/up SwiGLU and down
// products reading expert ids and the expert table on the device (Q8_0 and K-quant down
// products a block per output row), and the prefill combine of the grouped products' outputs.
// Invariant: the top-k breaks ties to the lower expert index and renormalises only when
// asked; expert ids past n_expert are never read; every output row is written by one warp
// or block.

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
// ty / ty_u: the gate's and the up matrices' weight codes (a quantizer's mix may differ).
// Q8_0 reads the gate and up rows in one loop (their loads in flight together).
// grid: (ceil(F / DQ_WARPS), n_tok * k).
// (dq_moe_gate_up_any: the same for every weight code, the any-type ones included.)
template <bool ANY>
__device__ __forceinline__ void dq_moe_gate_up_body(const unsigned long long* eptr, int ty,
                                                    int ty_u, int F, int E, const int* ids,
                                                    int k, const float* x, const float* nw,
                                                    float eps, float* h) {
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
    const bool q8 = ty == ST_TY_Q8_0 && ty_u == ST_TY_Q8_0;
    const bool xs = q8 && !nw && dq_xs_bytes() >= 4u * E;
    if (xs) dq_xs_fill(dq_gu_xs, in.x, E);
    const int row = blockIdx.x * DQ_WARPS + threadIdx.x / ST_WARP;
    if (row >= F) return;
    const int lane = threadIdx.x % ST_WARP;
    float g[1] = {0.0f}, u[1] = {0.0f};
    if (q8 && !nw) {
        if (xs) dq_gate_up_q8<true>(G, U, F, E, row, in.x, dq_gu_xs, g[0], u[0]);
        else dq_gate_up_q8<false>(G, U, F, E, row, in.x, nullptr, g[0], u[0]);
    } else {
        dq_row_dot<1, false, ANY>(G, ty, F, E, row, in, 1, g);
        dq_row_dot<1, false, ANY>(U, ty_u, F, E, row, in, 1, u);
    }
    const float gs = st_warp_sum(g[0]), us = st_warp_sum(u[0]);
    if (lane == 0) h[(long)a * F + row] = dq_silu(gs) * us;
}

ST_KERNEL void dq_moe_gate_up(const unsigned long long* eptr, int ty, int ty_u, int F, int E,
                              const int* ids, int k, const float* x, const float* nw, float eps,
                              float* h) {
    dq_moe_gate_up_body<false>(eptr, ty, ty_u, F, E, ids, k, x, nw, eps, h);
}

ST_KERNEL void dq_moe_gate_up_any(const unsigned long long* eptr, int ty, int ty_u, int F,
                                  int E, const int* ids, int k, const float* x,
                                  const float* nw, float eps, float* h) {
    dq_moe_gate_up_body<true>(eptr, ty, ty_u, F, E, ids, k, x, nw, eps, h);
}

// MoE gate and up with SwiGLU over K-quant experts (gate and up each Q4_K, Q5_K or Q6_K, not
// both Q4_K: those take dq_moe_gate_up): dq_moe_gate_up's function through products.cuh's
// K-quant rows, the input read from global memory (once for both rows when gate and up share
// their type). grid: (ceil(F / DQ_WARPS), n_tok * k).
ST_KERNEL void dq_moe_gate_up_kq(const unsigned long long* eptr, int ty, int ty_u, int F, int E,
                                 const int* ids, int k, const float* x, const float* nw,
                                 float eps, float* h) {
    st_pdl_enter();
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
    if (ty == ty_u) {
        switch (dq_kq_type(ty)) {
            case QT_Q6_K: dq_kq_pair_t<QT_Q6_K>(G, U, E, row, in, g[0], u[0]); break;
            case QT_IQ3_S: dq_kq_pair_t<QT_IQ3_S>(G, U, E, row, in, g[0], u[0]); break;
            case QT_Q5_K: dq_kq_pair_t<QT_Q5_K>(G, U, E, row, in, g[0], u[0]); break;
            default: dq_kq_pair_t<QT_Q4_K>(G, U, E, row, in, g[0], u[0]); break;
        }
    } else {
        dq_kq_row_dot<1>(G, ty, E, row, in, 1, g);
        dq_kq_row_dot<1>(U, ty_u, E, row, in, 1, u);
    }
    const float gs = st_warp_sum(g[0]), us = st_warp_sum(u[0]);
    if (threadIdx.x % ST_WARP == 0) h[(long)a * F + row] = dq_silu(gs) * us;
}

// MoE down and weighted sum, added into the residual stream:
// y[t][r] += sum_j wts[t*k+j] * (D_{ids[t*k+j]},r . h[t*k+j]), one warp per row, any weight
// type (Q8_0 with k <= DQ_DOWN_MAXK takes dq_moe_down_rows). grid: (ceil(E / DQ_WARPS), n_tok).
// (dq_moe_down_any: the same for every weight code, the any-type ones included.)
template <bool ANY>
__device__ __forceinline__ void dq_moe_down_body(const unsigned long long* eptr, int ty, int E,
                                                 int F, const int* ids, const float* wts, int k,
                                                 const float* h, float* y) {
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
        dq_row_dot<1, false, ANY>(D, ty, E, F, row, in, 1, acc);
        tot += wts[a] * st_warp_sum(acc[0]);
    }
    if (threadIdx.x % ST_WARP == 0) y[(long)t * E + row] += tot;
}

ST_KERNEL void dq_moe_down(const unsigned long long* eptr, int ty, int E, int F, const int* ids,
                           const float* wts, int k, const float* h, float* y) {
    dq_moe_down_body<false>(eptr, ty, E, F, ids, wts, k, h, y);
}

ST_KERNEL void dq_moe_down_any(const unsigned long long* eptr, int ty, int E, int F,
                               const int* ids, const float* wts, int k, const float* h,
                               float* y) {
    dq_moe_down_body<true>(eptr, ty, E, F, ids, wts, k, h, y);
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

// The block's part of sum_j dw[j] * (D_j,row . ht[j]) over K-quant T rows of F columns
// starting at byte roff of each dm[j]: the k * F / 256 super-blocks spread over the block's
// warps (32 lanes a block, dq_kq_lane's mapping), their loads in flight together.
template <int T>
__device__ __forceinline__ float dq_moe_down_kq_part(const u8* const* dm, const float* dw, int k,
                                                     int F, long roff, const float* ht) {
    const int lane = threadIdx.x % ST_WARP, l = lane & 31;
    const int oa = dq_kq_oa<T>(l), ob = oa + dq_kq_gap<T>();
    const int nb = F / QK_K, span = ST_WARP / 32;
    const int step = (blockDim.x / ST_WARP) * span;
    float tot = 0.0f;
#pragma unroll 4
    for (int p = (threadIdx.x / ST_WARP) * span + (lane >> 5); p < k * nb; p += step) {
        const int j = p / nb, b = p - j * nb;
        DqKq q;
        dq_kq_lane<T>(dm[j] + roff + (long)b * dq_kq_bytes<T>(), l, q);
        const float* xb = ht + (long)j * F + b * QK_K;
        tot += dw[j] * dq_kq_dot<T>(q, *(const float4*)(xb + oa), *(const float4*)(xb + ob));
    }
    return tot;
}

// MoE down for K-quant experts (Q4_K, Q5_K, Q6_K, and IQ3_S on the same lane mapping) with one block per output row, as
// dq_moe_down_rows does for Q8_0: y[t][r] += sum_j wts[t*k+j] * (D_{ids[t*k+j]},r . h[t*k+j]),
// the k experts' super-blocks spread over the block's warps and summed by a block reduction
// (a warp per row left a decode step's 2048 rows with too few loads in flight).
// grid: (E, n_tok); block: 128; k <= DQ_DOWN_MAXK; F a multiple of 256.
ST_KERNEL void dq_moe_down_kq(const unsigned long long* eptr, int ty, int E, int F,
                              const int* ids, const float* wts, int k, const float* h,
                              float* y) {
    __shared__ const u8* dm[DQ_DOWN_MAXK];
    __shared__ float dw[DQ_DOWN_MAXK];
    __shared__ float red[32];
    const int row = blockIdx.x, t = blockIdx.y;
    const long rb = dq_row_bytes(ty, F), roff = (long)row * rb;
    // Before the wait, as dq_moe_down_rows: the ids were written two kernels ahead; the
    // block's warps prefetch the experts' rows in turn.
    for (int j = threadIdx.x / ST_WARP; j < k; j += blockDim.x / ST_WARP) {
        const u8* D = (const u8*)eptr[(long)st_ldcg(ids + (long)t * k + j) * 3 + 2];
        st_prefetch_l2(D + roff, rb);
    }
    st_pdl_enter();
    if (threadIdx.x < k) {
        const long a = (long)t * k + threadIdx.x;
        dm[threadIdx.x] = (const u8*)eptr[(long)ids[a] * 3 + 2];
        dw[threadIdx.x] = wts[a];
    }
    __syncthreads();
    const float* ht = h + (long)t * k * F;
    float tot;
    switch (dq_kq_type(ty)) {
        case QT_Q6_K: tot = dq_moe_down_kq_part<QT_Q6_K>(dm, dw, k, F, roff, ht); break;
        case QT_IQ3_S: tot = dq_moe_down_kq_part<QT_IQ3_S>(dm, dw, k, F, roff, ht); break;
        case QT_Q5_K: tot = dq_moe_down_kq_part<QT_Q5_K>(dm, dw, k, F, roff, ht); break;
        default: tot = dq_moe_down_kq_part<QT_Q4_K>(dm, dw, k, F, roff, ht); break;
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


// grid: n_tok; block: a multiple of the warp size; dynamic shared: n_expert * 4 bytes.
// idx_out / w_out: n_tok x k. k <= 64.
ST_KERNEL void router_softmax_topk(const float* logits, int n_expert, int k, int norm,
                                   int* idx_out, float* w_out) {
    st_pdl_enter();
    extern __shared__ float p[];
    __shared__ float red[32];
    __shared__ float bv[32];
    __shared__ int bi[32];
    __shared__ float wsel[64];
    const float* x = logits + (long)blockIdx.x * n_expert;
    float m = ST_NEG_INF;
    for (int i = threadIdx.x; i < n_expert; i += blockDim.x) m = fmaxf(m, x[i]);
    m = st_block_max(m, red);
    float s = 0.0f;
    for (int i = threadIdx.x; i < n_expert; i += blockDim.x) {
        const float e = expf(x[i] - m);
        p[i] = e;
        s += e;
    }
    s = st_block_sum(s, red);
    for (int i = threadIdx.x; i < n_expert; i += blockDim.x) p[i] = p[i] / s;
    __syncthreads();
    const int lane = threadIdx.x % ST_WARP, warp = threadIdx.x / ST_WARP;
    for (int j = 0; j < k; ++j) {
        float best = -1.0f;
        int idx = 0x7fffffff;
        for (int i = threadIdx.x; i < n_expert; i += blockDim.x) {
            const float v = p[i];
            if (v > best) { best = v; idx = i; }
        }
        for (int o = ST_WARP / 2; o > 0; o >>= 1) {
            const float ov = ST_SHFL_XOR(best, o);
            const int oi = ST_SHFL_XOR(idx, o);
            if (ov > best || (ov == best && oi < idx)) { best = ov; idx = oi; }
        }
        if (lane == 0) { bv[warp] = best; bi[warp] = idx; }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int wi = 1; wi < (int)(blockDim.x / ST_WARP); ++wi) {
                if (bv[wi] > best || (bv[wi] == best && bi[wi] < idx)) { best = bv[wi]; idx = bi[wi]; }
            }
            idx_out[(long)blockIdx.x * k + j] = idx;
            wsel[j] = best;
            p[idx] = -1.0f;  // chosen: below every probability
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (int j = 0; j < k; ++j) sum += wsel[j];
        for (int j = 0; j < k; ++j) w_out[(long)blockIdx.x * k + j] = norm ? wsel[j] / sum : wsel[j];
    }
}
