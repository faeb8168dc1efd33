// products.cuh: what the product kernels share (matvec.cu, moe.cu): the weight layouts read in
// place (Q8_0 "split": per matrix rows x cols int8 quants, then rows x cols/32 f16 scales;
// Q4_K, F32, F16, BF16 as in GGUF; every other ggml type, code ST_TY_GGML + its GGUF id, as
// in GGUF through quants.cuh's decoders), one row's dot product with 1..8 tokens' inputs (RMS
// normalised on the fly when the kernel is given norm weights), the input staged in shared
// memory or held in registers for one-token Q8_0 products, and the K-quant rows (Q4_K, Q5_K,
// Q6_K) of the *_kq kernels, 32 lanes a super-block.
// Invariant: one warp per output row (or per group of rows, dq_kq_rows_dot); rows past `rows`
// and tokens past `n_tok` are never read or written; Q8_0 split rows are 16-byte aligned (the
// host checks the base pointers).

// DQ_MAX_TOK, DQ_WARPS and DQ_XR_PIECES come from the generated prelude.

__device__ __forceinline__ float dq_silu(float v) { return v / (1.0f + expf(-v)); }

// Bytes of one row of `cols` values of weight code ty in the GGUF layout (every code but
// ST_TY_Q8_0, whose device rows are split): an any-type code's whole blocks (quants.cuh).
__device__ __forceinline__ long dq_row_bytes(int ty, long cols) {
    if (ty >= ST_TY_GGML) {
        int be, bb;
        qt_block(ty - ST_TY_GGML, &be, &bb);
        return be ? cols / be * bb : 0;
    }
    switch (ty) {
        case ST_TY_F32: return cols * 4;
        case ST_TY_Q4_K: return cols / QK_K * Q4_K_BYTES;
        default: return cols * 2;
    }
}

// Element i of row r of a matrix (rows x cols) in the device layout, for the five codes with
// element decoders (any-type codes decode 32 values at a time: qt_group32).
__device__ __forceinline__ float dq_elem(const u8* W, int ty, long rows, long cols, long r, long i) {
    if (ty == ST_TY_Q8_0) {
        const i8 q = (i8)W[r * cols + i];
        const u16 d = ((const u16*)(W + rows * cols))[r * (cols / QK8_0) + i / QK8_0];
        return st_h2f(d) * (float)q;
    }
    return st_row_elem(W + r * dq_row_bytes(ty, cols), ty, i);
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
    const long rb = dq_row_bytes(ty, cols);
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
// The lane's part of one row . x for a row of a quantized type (GGUF id T, or gt at run time
// when T < 0): lane l decodes the 32-value groups l, l + warp, ... and dots each with every
// token's input.
template <int NT, int T>
__device__ __forceinline__ void dq_dot_qt(const u8* __restrict__ wr, long cols, int gt,
                                          const DqIn<NT>& in, int n_tok, float (&acc)[NT]) {
    const int lane = threadIdx.x % ST_WARP;
    for (long g = lane; g < cols / 32; g += ST_WARP) {
        float w[32];
        if (T >= 0) qt_group32_fixed<(T < 0 ? QT_Q4_0 : T)>(wr, (int)g, w);
        else qt_group32(gt, wr, (int)g, w);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t < n_tok) {
                float s = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float4 xv = in.ld(t, 32 * g + 4 * j);
                    s += w[4 * j] * xv.x + w[4 * j + 1] * xv.y + w[4 * j + 2] * xv.z +
                         w[4 * j + 3] * xv.w;
                }
                acc[t] += s;
            }
        }
    }
}

// ANY: the any-type codes' branch is compiled in (the *_any kernels only, so the fast kernels'
// register budget stays what it was without it).
template <int NT, bool XS = false, bool ANY = false>
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
    } else if (ANY && ty >= ST_TY_GGML) {
        // Any other type (cols a multiple of 32, whole blocks): quants.cuh's decoders (the
        // values the CPU reference decodes, bit for bit), inlined for the types of llama.cpp's
        // common mixes, out of line for the rest.
        const u8* wr = W + r * dq_row_bytes(ty, cols);
        switch (ty - ST_TY_GGML) {
            case QT_Q6_K: dq_dot_qt<NT, QT_Q6_K>(wr, cols, 0, in, n_tok, acc); break;
            case QT_Q5_K: dq_dot_qt<NT, QT_Q5_K>(wr, cols, 0, in, n_tok, acc); break;
            case QT_IQ4_XS: dq_dot_qt<NT, QT_IQ4_XS>(wr, cols, 0, in, n_tok, acc); break;
            case QT_IQ3_S: dq_dot_qt<NT, QT_IQ3_S>(wr, cols, 0, in, n_tok, acc); break;
            default: dq_dot_qt<NT, -1>(wr, cols, ty - ST_TY_GGML, in, n_tok, acc); break;
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

// ---- K-quant rows (Q4_K, Q5_K, Q6_K) for the *_kq kernels ----
// One 256-value super-block is read by 32 lanes (a 64-wide wave reads two blocks a step), 8
// values a lane in two runs of 4 consecutive values, at column oa(l) and ob(l) of the block:
// - Q4_K / Q5_K: lane l reads quant bytes 4(l%8)..+4 of 64-value group g = l/8; their low
//   nibbles are values 64g + 4(l%8) + 0..3 (sub-block 2g), their high nibbles the same + 32
//   (sub-block 2g + 1); Q5_K's fifth bits are bits 2g and 2g + 1 of the qh bytes 4(l%8)..+4.
// - Q6_K: lane l reads ql bytes 32h + 4(l%8)..+4 of half n = l/16 (h = (l/8)%2) and qh bytes
//   4(l%8)..+4 of that half; low nibbles (qh bits 2h, 2h+1) are values 128n + 32h + 4(l%8) +
//   0..3, high nibbles (qh bits 4+2h, 5+2h) the same + 64; scales 8n + 2h + (l%8)/4 and +4.
// The scales multiply each run's 4-term dot product once: W.x = ka (qa . xa) - ma sum(xa) +
// kb (qb . xb) - mb sum(xb) (no mins for Q6_K), f32 throughout (the CPU reference's values;
// the sums in another order). Q6_K's 210-byte blocks are 2-byte aligned only, so its 4-byte
// fields are read as two u16 (as llama.cpp's get_int_b2); Q4_K's and Q5_K's are u32 loads.

// The kq code (QT_Q4_K, QT_Q5_K, QT_Q6_K or QT_IQ3_S) of weight code ty (ST_TY_Q4_K or
// ST_TY_GGML + id).
__device__ __forceinline__ int dq_kq_type(int ty) { return ty == ST_TY_Q4_K ? QT_Q4_K : ty - ST_TY_GGML; }

template <int T>
__device__ __forceinline__ int dq_kq_bytes() {
    return T == QT_Q6_K ? 210 : T == QT_Q5_K ? 176 : T == QT_IQ3_S ? 110 : Q4_K_BYTES;
}

// Column of lane l's first run in a block, and the gap to its second.
template <int T>
__device__ __forceinline__ int dq_kq_oa(int l) {
    if (T == QT_IQ3_S) return 8 * l;
    return T == QT_Q6_K ? 128 * (l >> 4) + 32 * ((l >> 3) & 1) + 4 * (l & 7) : 64 * (l >> 3) + 4 * (l & 7);
}
template <int T>
__device__ __forceinline__ int dq_kq_gap() { return T == QT_Q6_K ? 64 : T == QT_IQ3_S ? 4 : 32; }

__device__ __forceinline__ u32 dq_ld_u32_a2(const u8* p) {
    return (u32)st_ld_u16(p) | ((u32)st_ld_u16(p + 2) << 16);
}

// Lane l's 8 values of one block: the two runs' quants as exact floats (Q6_K: q - 32), their
// scales and (Q4_K, Q5_K) mins.
struct DqKq {
    float qa[4], qb[4];
    float ka, kb, ma, mb;
};

template <int T>
__device__ __forceinline__ void dq_kq_lane(const u8* __restrict__ b, int l, DqKq& q) {
    if (T == QT_IQ3_S) {
        // Lane l: values 8l..8l+8, two grid rows (indices qs[k], qs[k + 1], ninth bits in
        // qh[gi]) with the sign bits of signs[4gi + h]; one scale per 32 values.
        const int gi = l >> 2, h = l & 3, k = 8 * gi + 2 * h;
        const u32 qs = st_ld_u16(b + 2 + k);
        const u32 qh = b[66 + gi];
        const u32 g0 = IQ3S_GRID[(qs & 0xFFu) | (((qh >> (2 * h)) & 1u) << 8)];
        const u32 g1 = IQ3S_GRID[(qs >> 8) | (((qh >> (2 * h + 1)) & 1u) << 8)];
        const u32 sg = b[74 + 4 * gi + h];
        st_u8x4_to_f32(g0, 0.0f, q.qa);
        st_u8x4_to_f32(g1, 0.0f, q.qb);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if ((sg >> j) & 1u) q.qa[j] = -q.qa[j];
            if ((sg >> (j + 4)) & 1u) q.qb[j] = -q.qb[j];
        }
        q.ka = st_h2f(st_ld_u16(b)) * (float)(1 + 2 * ((b[106 + (gi >> 1)] >> (4 * (gi & 1))) & 15));
        q.kb = q.ka;
        q.ma = 0.0f;
        q.mb = 0.0f;
    } else if (T == QT_Q6_K) {
        const int n = l >> 4, h = (l >> 3) & 1, j = 4 * (l & 7);
        const u32 ql = dq_ld_u32_a2(b + 64 * n + 32 * h + j);
        const u32 qh = dq_ld_u32_a2(b + 128 + 32 * n + j);
        st_u8x4_to_f32((ql & 0x0F0F0F0Fu) | (((qh >> (2 * h)) & 0x03030303u) << 4), 32.0f, q.qa);
        st_u8x4_to_f32(((ql >> 4) & 0x0F0F0F0Fu) | (((qh >> (4 + 2 * h)) & 0x03030303u) << 4),
                       32.0f, q.qb);
        const float d = st_h2f(st_ld_u16(b + 208));
        const int s = 8 * n + 2 * h + ((l & 7) >> 2);
        q.ka = d * (float)(i8)b[192 + s];
        q.kb = d * (float)(i8)b[192 + s + 4];
        q.ma = 0.0f;
        q.mb = 0.0f;
    } else {
        const int g = l >> 3, j = 4 * (l & 7);
        const float d = st_h2f(st_ld_u16(b)), dmin = st_h2f(st_ld_u16(b + 2));
        float sc0, m0, sc1, m1;
        st_scale_min_k4(2 * g, b + 4, &sc0, &m0);
        st_scale_min_k4(2 * g + 1, b + 4, &sc1, &m1);
        u32 qa, qb;
        if (T == QT_Q5_K) {
            const u32 qs = *(const u32*)(b + 48 + 32 * g + j);
            const u32 qh = *(const u32*)(b + 16 + j);
            qa = (qs & 0x0F0F0F0Fu) | (((qh >> (2 * g)) & 0x01010101u) << 4);
            qb = ((qs >> 4) & 0x0F0F0F0Fu) | (((qh >> (2 * g + 1)) & 0x01010101u) << 4);
        } else {
            const u32 qs = *(const u32*)(b + 16 + 32 * g + j);
            qa = qs & 0x0F0F0F0Fu;
            qb = (qs >> 4) & 0x0F0F0F0Fu;
        }
        st_u8x4_to_f32(qa, 0.0f, q.qa);
        st_u8x4_to_f32(qb, 0.0f, q.qb);
        q.ka = d * sc0;
        q.ma = dmin * m0;
        q.kb = d * sc1;
        q.mb = dmin * m1;
    }
}

// The lane's 8 values of a block (dq_kq_lane) dotted with xa = x[oa..oa+4), xb = x[ob..ob+4).
template <int T>
__device__ __forceinline__ float dq_kq_dot(const DqKq& q, float4 xa, float4 xb) {
    float r = q.ka * (q.qa[0] * xa.x + q.qa[1] * xa.y + q.qa[2] * xa.z + q.qa[3] * xa.w) +
              q.kb * (q.qb[0] * xb.x + q.qb[1] * xb.y + q.qb[2] * xb.z + q.qb[3] * xb.w);
    if (T != QT_Q6_K && T != QT_IQ3_S)
        r -= q.ma * (xa.x + xa.y + xa.z + xa.w) + q.mb * (xb.x + xb.y + xb.z + xb.w);
    return r;
}

// acc[t] += the lane's part of row wr . in(t) over a row of `cols` (a multiple of 256) of
// K-quant T; XS (one token): the input from xs (dq_kq_xs_fill) instead.
template <int NT, int T, bool XS>
__device__ __forceinline__ void dq_kq_row_t(const u8* __restrict__ wr, long cols,
                                            const DqIn<NT>& in, int n_tok, float (&acc)[NT],
                                            const float4* xs) {
    const int lane = threadIdx.x % ST_WARP, l = lane & 31;
    const int oa = dq_kq_oa<T>(l), ob = oa + dq_kq_gap<T>();
    const long nb = cols / QK_K;
#pragma unroll 2
    for (long b = lane >> 5; b < nb; b += ST_WARP / 32) {
        DqKq q;
        dq_kq_lane<T>(wr + b * dq_kq_bytes<T>(), l, q);
        const long i = b * QK_K;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t < n_tok) {
                const float4 xa = XS ? xs[(i + oa) / 4] : in.ld(t, i + oa);
                const float4 xb = XS ? xs[(i + ob) / 4] : in.ld(t, i + ob);
                acc[t] += dq_kq_dot<T>(q, xa, xb);
            }
        }
    }
}

// acc[t] += the lane's part of row r of W (rows of `cols` of K-quant code ty: ST_TY_Q4_K or
// ST_TY_GGML + QT_Q5_K / QT_Q6_K) . in(t), not yet reduced across the warp.
template <int NT, bool XS = false>
__device__ __forceinline__ void dq_kq_row_dot(const u8* __restrict__ W, int ty, long cols, long r,
                                              const DqIn<NT>& in, int n_tok, float (&acc)[NT],
                                              const float4* xs = nullptr) {
    const u8* wr = W + r * dq_row_bytes(ty, cols);
    switch (dq_kq_type(ty)) {
        case QT_Q6_K: dq_kq_row_t<NT, QT_Q6_K, XS>(wr, cols, in, n_tok, acc, xs); break;
        case QT_IQ3_S: dq_kq_row_t<NT, QT_IQ3_S, XS>(wr, cols, in, n_tok, acc, xs); break;
        case QT_Q5_K: dq_kq_row_t<NT, QT_Q5_K, XS>(wr, cols, in, n_tok, acc, xs); break;
        default: dq_kq_row_t<NT, QT_Q4_K, XS>(wr, cols, in, n_tok, acc, xs); break;
    }
}

// One token, row r of two matrices of one K-quant T (the experts' gate and up): g and u +=
// the lane's parts of G_r . in(0) and U_r . in(0), each input float4 read once for both and
// the two rows' loads in flight together.
template <int T>
__device__ __forceinline__ void dq_kq_pair_t(const u8* __restrict__ G, const u8* __restrict__ U,
                                             long cols, long r, const DqIn<1>& in, float& g,
                                             float& u) {
    const int lane = threadIdx.x % ST_WARP, l = lane & 31;
    const int oa = dq_kq_oa<T>(l), ob = oa + dq_kq_gap<T>();
    const long nb = cols / QK_K, rb = nb * dq_kq_bytes<T>();
    const u8* gr = G + r * rb;
    const u8* ur = U + r * rb;
#pragma unroll 2
    for (long b = lane >> 5; b < nb; b += ST_WARP / 32) {
        DqKq qg, qu;
        dq_kq_lane<T>(gr + b * dq_kq_bytes<T>(), l, qg);
        dq_kq_lane<T>(ur + b * dq_kq_bytes<T>(), l, qu);
        const long i = b * QK_K;
        const float4 xa = in.ld(0, i + oa), xb = in.ld(0, i + ob);
        g += dq_kq_dot<T>(qg, xa, xb);
        u += dq_kq_dot<T>(qu, xa, xb);
    }
}

// One token, several rows a warp (the one-token kernels' walk over a tall matrix): acc[r] +=
// the lane's part of row r0 + r . in(0) (token 0 of any DqIn) for r < nr (at most R; warp-uniform), each block's
// input float4s read once for the R rows (from xs when XS), the R rows' loads in flight
// together.
template <int R, int T, bool XS, int NT>
__device__ __forceinline__ void dq_kq_rows_t(const u8* __restrict__ W, long rb, long cols,
                                             long r0, int nr, const DqIn<NT>& in,
                                             float (&acc)[R], const float4* xs) {
    const int lane = threadIdx.x % ST_WARP, l = lane & 31;
    const int oa = dq_kq_oa<T>(l), ob = oa + dq_kq_gap<T>();
    const long nb = cols / QK_K;
    const u8* w0 = W + r0 * rb;
#pragma unroll 2
    for (long b = lane >> 5; b < nb; b += ST_WARP / 32) {
        const long i = b * QK_K;
        const float4 xa = XS ? xs[(i + oa) / 4] : in.ld(0, i + oa);
        const float4 xb = XS ? xs[(i + ob) / 4] : in.ld(0, i + ob);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r < nr) {
                DqKq q;
                dq_kq_lane<T>(w0 + r * rb + b * dq_kq_bytes<T>(), l, q);
                acc[r] += dq_kq_dot<T>(q, xa, xb);
            }
        }
    }
}

template <int R, bool XS, int NT>
__device__ __forceinline__ void dq_kq_rows_dot(const u8* __restrict__ W, int ty, long cols,
                                               long r0, int nr, const DqIn<NT>& in,
                                               float (&acc)[R], const float4* xs) {
    const long rb = dq_row_bytes(ty, cols);
    switch (dq_kq_type(ty)) {
        case QT_Q6_K: dq_kq_rows_t<R, QT_Q6_K, XS>(W, rb, cols, r0, nr, in, acc, xs); break;
        case QT_IQ3_S: dq_kq_rows_t<R, QT_IQ3_S, XS>(W, rb, cols, r0, nr, in, acc, xs); break;
        case QT_Q5_K: dq_kq_rows_t<R, QT_Q5_K, XS>(W, rb, cols, r0, nr, in, acc, xs); break;
        default: dq_kq_rows_t<R, QT_Q4_K, XS>(W, rb, cols, r0, nr, in, acc, xs); break;
    }
}

// xs[m] = in(0)[4m..4m+4) for m < cols / 4 (norm applied), by every thread of the block, in
// plain order (a quarter-warp of dq_kq_row_t reads 8 consecutive float4s: no bank conflict);
// ends with a barrier.
template <int NT>
__device__ __forceinline__ void dq_kq_xs_fill(float4* xs, const DqIn<NT>& in, long cols) {
    for (long m = threadIdx.x; m < cols / 4; m += blockDim.x) xs[m] = in.ld(0, 4 * m);
    __syncthreads();
}

// Q8_0 products of one token with the input held in registers: a lane of dq_row_dot's Q8_0
// loop reads the same columns of x (its 16-column pieces, 512 apart) in every row, so a warp
// that walks many rows keeps those pieces in registers and reads only weights per row (x's
// float4 loads, each touching 16 cache lines, bound the one-row-per-warp kernels by L1
// throughput). Used by dq_mv1 over the LM head, whose 151936 rows give every warp dozens
// (measured on the H200: head 198 -> 169 us a token; the same path in dq_qkv1 and the MoE
// gate/up, with 3 and 1 rows a warp, cost more than it saved: gate/up 16.5 -> 22.4 us).
// Rows of at most DQ_XR_COLS columns; same arithmetic, in the same order, as dq_row_dot<1>.
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
