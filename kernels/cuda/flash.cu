// flash.cu: prefill attention on the tensor cores (flash-attention style, mma.sync m16n8k16
// through inline PTX, f16 operands, f32 accumulate): the same function as decode.cu's
// dq_attn_prefill. The n_tok query tokens all belong to the slot slot[0] and their K/V are
// already stored there; query t (q f32 [n_tok][n_head][hd]) sees the cells c <= pos[t] of that
// slot (K row of cell c at kv + slot[0]*slot_bytes + k_off + c*row_bytes, V at v_off; each row
// n_head_kv*hd elements of kv_ty: F16, F32 or Q8_0 in GGUF blocks); query head h reads KV head
// h / (n_head / n_head_kv); out f32 [n_tok][n_head*hd] = softmax(scale * q.K^T) V.
// Each CTA owns one query head and FA_BQ consecutive tokens (4 warps of 16 rows). Q is
// rounded to f16 once and kept in registers; per tile of FA_BKV cells the CTA dequantizes K
// (row-major) and V (transposed) into f16 shared tiles; the scores and probabilities stay in
// registers (P rounded to f16 for the second product), with the running max and sum in f32.
// Invariant: no score matrix in memory; every position is read per token from pos[] (nothing
// assumes pos[t] = pos[0] + t); cells past the largest position of the CTA's tokens and
// tokens past n_tok are never read, and rows past n_tok are never written; Q8_0 rows are only
// assumed 2-byte aligned (F16/F32 rows take 16-byte loads only when base and stride allow).
// hd is 64 or 128 (the host checks; other head sizes use dq_attn_prefill). CUDA only.

#ifdef ST_CUDA

// FA_BQ query tokens per CTA (FA_WARPS warps x 16 rows), FA_BKV KV cells per shared tile:
// from the generated prelude.

// Two f32 -> one f16x2 register (lo in the low half), round to nearest even.
__device__ __forceinline__ u32 fa_pack(float lo, float hi) {
    return (u32)st_f2h(lo) | ((u32)st_f2h(hi) << 16);
}

// c += A (16 x 16, row) * B (16 x 8, col); f16 inputs, f32 accumulators.
__device__ __forceinline__ void fa_mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                       u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Elements [e, e + 8) of a KV row of type ty as eight f16 (element e in the low half of .x).
// vec: the row address and element offset allow one 16-byte (F16) or two (F32) loads.
__device__ __forceinline__ uint4 fa_ld8(const u8* row, int ty, int e, bool vec) {
    uint4 r;
    if (ty == ST_TY_F16) {
        if (vec) return *(const uint4*)(row + 2 * e);
        const u16* p = (const u16*)(row + 2 * e);
        r.x = (u32)p[0] | ((u32)p[1] << 16);
        r.y = (u32)p[2] | ((u32)p[3] << 16);
        r.z = (u32)p[4] | ((u32)p[5] << 16);
        r.w = (u32)p[6] | ((u32)p[7] << 16);
    } else if (ty == ST_TY_F32) {
        const float* p = (const float*)row + e;
        float f[8];
        if (vec) {
            const float4 a = *(const float4*)p, b = *(const float4*)(p + 4);
            f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
            f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) f[i] = p[i];
        }
        r.x = fa_pack(f[0], f[1]);
        r.y = fa_pack(f[2], f[3]);
        r.z = fa_pack(f[4], f[5]);
        r.w = fa_pack(f[6], f[7]);
    } else {
        // Q8_0: e is a multiple of 8, so the 8 quants lie in one block, 2-byte aligned.
        const u8* blk = row + (e / QK8_0) * Q8_0_BYTES;
        const float d = st_h2f(st_ld_u16(blk));
        const u16* qs = (const u16*)(blk + 2 + e % QK8_0);
        u32 w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u16 v = qs[i];
            w[i] = fa_pack(d * (float)(i8)(v & 0xff), d * (float)(i8)(v >> 8));
        }
        r = make_uint4(w[0], w[1], w[2], w[3]);
    }
    return r;
}

// One KV tile: cells [c0, c0 + FA_BKV) (those at or past cend zero-filled, not read) of KV
// head kvh into ks ([FA_BKV][HD + 8] f16, row-major) and vt ([HD][FA_BKV + 8] f16, V
// transposed so that the second product's B fragments are single 32-bit loads).
template <int HD>
__device__ __forceinline__ void fa_load_tile(u16* ks, u16* vt, const u8* kb, const u8* vb,
                                             int ty, long row_bytes, int kvh, int c0, int cend,
                                             bool vec) {
    constexpr int KS = HD + 8, VS = FA_BKV + 8, CH = HD / 8;
    constexpr int NK = FA_BKV * CH / (FA_WARPS * 32), NV = NK / 2;  // tasks per thread
    constexpr int B = 4;  // loads in flight per thread (more costs registers and occupancy)
    const int tid = threadIdx.x;
    // K: consecutive threads take consecutive 8-element chunks of a row (coalesced reads).
#pragma unroll 1
    for (int j0 = 0; j0 < NK; j0 += B) {
        uint4 w[B];
#pragma unroll
        for (int j = 0; j < B; ++j) {
            const int i = tid + (j0 + j) * FA_WARPS * 32, c = i / CH, ch = i % CH;
            w[j] = make_uint4(0, 0, 0, 0);
            if (c0 + c < cend)
                w[j] = fa_ld8(kb + (long)(c0 + c) * row_bytes, ty, kvh * HD + ch * 8, vec);
        }
#pragma unroll
        for (int j = 0; j < B; ++j) {
            const int i = tid + (j0 + j) * FA_WARPS * 32, c = i / CH, ch = i % CH;
            *(uint4*)(ks + c * KS + ch * 8) = w[j];
        }
    }
    // V: a warp takes 32 cell pairs of one 8-element chunk; each thread writes 8 words
    // (dim, cell pair), one bank per lane.
#pragma unroll 1
    for (int j0 = 0; j0 < NV; j0 += B / 2) {
        uint4 w[B];
#pragma unroll
        for (int j = 0; j < B / 2; ++j) {
            const int i = tid + (j0 + j) * FA_WARPS * 32, cp = i % (FA_BKV / 2);
            const int ch = i / (FA_BKV / 2), c = c0 + 2 * cp;
            w[2 * j] = make_uint4(0, 0, 0, 0);
            w[2 * j + 1] = make_uint4(0, 0, 0, 0);
            if (c < cend) w[2 * j] = fa_ld8(vb + (long)c * row_bytes, ty, kvh * HD + ch * 8, vec);
            if (c + 1 < cend)
                w[2 * j + 1] = fa_ld8(vb + (long)(c + 1) * row_bytes, ty, kvh * HD + ch * 8, vec);
        }
#pragma unroll
        for (int j = 0; j < B / 2; ++j) {
            const int i = tid + (j0 + j) * FA_WARPS * 32, cp = i % (FA_BKV / 2);
            const int ch = i / (FA_BKV / 2);
            const uint4 a = w[2 * j], b = w[2 * j + 1];
            const u32 aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
            u16* dst = vt + (ch * 8) * VS + 2 * cp;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                *(u32*)(dst + (2 * k) * VS) = (aw[k] & 0xffffu) | (bw[k] << 16);
                *(u32*)(dst + (2 * k + 1) * VS) = (aw[k] >> 16) | (bw[k] & 0xffff0000u);
            }
        }
    }
}

// Dynamic shared memory: (FA_BKV * (HD + 8) + HD * (FA_BKV + 8)) f16; the K region holds the
// CTA's Q tile first (FA_BQ == FA_BKV rows of the same stride).
template <int HD>
__device__ __forceinline__ void fa_body(const float* __restrict__ q, const u8* __restrict__ kv,
                                        const int* __restrict__ slot,
                                        const int* __restrict__ pos, long slot_bytes, long k_off,
                                        long v_off, int kv_ty, int n_head, int n_head_kv,
                                        long row_bytes, float scale, int n_tok,
                                        float* __restrict__ out) {
    static_assert(FA_BQ == FA_BKV && FA_BQ == FA_WARPS * 16, "tile shapes");
    static_assert(FA_BKV * (HD / 8) % (4 * FA_WARPS * 32) == 0, "whole load batches per thread");
    constexpr int KS = HD + 8, VS = FA_BKV + 8, KK = HD / 16, NT = FA_BKV / 8, DT = HD / 8;
    extern __shared__ __align__(16) u8 fa_smem[];
    __shared__ int spos[FA_BQ];
    u16* ks = (u16*)fa_smem;
    u16* vt = ks + FA_BKV * KS;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tg = lane & 3;
    const int h = blockIdx.x;
    // The last token tiles see the most cells: launch them first.
    const int t0 = (gridDim.y - 1 - blockIdx.y) * FA_BQ;
    const int kvh = h / (n_head / n_head_kv);
    const u8* kb = kv + (long)slot[0] * slot_bytes + k_off;
    const u8* vb = kv + (long)slot[0] * slot_bytes + v_off;
    const bool vec =
        (((unsigned long long)kb | (unsigned long long)vb | (unsigned long long)row_bytes) &
         15) == 0;

    // Positions (-1: no token, sees nothing) and the Q tile, rounded to f16, into shared.
    if (tid < FA_BQ) spos[tid] = t0 + tid < n_tok ? pos[t0 + tid] : -1;
    for (int i = tid; i < FA_BQ * HD / 4; i += FA_WARPS * 32) {
        const int r = i / (HD / 4), c4 = (i % (HD / 4)) * 4;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (t0 + r < n_tok) v = *(const float4*)(q + ((long)(t0 + r) * n_head + h) * HD + c4);
        *(uint2*)(ks + r * KS + c4) = make_uint2(fa_pack(v.x, v.y), fa_pack(v.z, v.w));
    }
    __syncthreads();
    // This warp's A fragments of Q (rows warp*16 + g and + 8), kept for the whole pass.
    u32 qf[KK][4];
    {
        const u16* q0 = ks + (warp * 16 + g) * KS + 2 * tg;
        const u16* q1 = q0 + 8 * KS;
#pragma unroll
        for (int k = 0; k < KK; ++k) {
            qf[k][0] = *(const u32*)(q0 + k * 16);
            qf[k][1] = *(const u32*)(q1 + k * 16);
            qf[k][2] = *(const u32*)(q0 + k * 16 + 8);
            qf[k][3] = *(const u32*)(q1 + k * 16 + 8);
        }
    }
    const int p_lo = spos[warp * 16 + g], p_hi = spos[warp * 16 + g + 8];
    int bmax = -1, wmax = -1, wmin = 0x7fffffff;
    for (int i = 0; i < FA_BQ; ++i) bmax = max(bmax, spos[i]);
    for (int i = 0; i < 16; ++i) {
        wmax = max(wmax, spos[warp * 16 + i]);
        wmin = min(wmin, spos[warp * 16 + i]);
    }
    const int cend = bmax + 1;  // the CTA reads cells [0, cend)
    const float sl2 = scale * 1.4426950408889634f;  // scores in log2 units

    float o[DT][4];
#pragma unroll
    for (int d = 0; d < DT; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
    float m_lo = ST_NEG_INF, m_hi = ST_NEG_INF, l_lo = 0.0f, l_hi = 0.0f;

    for (int c0 = 0; c0 < cend; c0 += FA_BKV) {
        __syncthreads();  // the previous tile (or the Q tile) is no longer read
        fa_load_tile<HD>(ks, vt, kb, vb, kv_ty, row_bytes, kvh, c0, cend, vec);
        __syncthreads();
        if (c0 > wmax) continue;  // every cell of the tile is past this warp's tokens

        // S = Q K^T for 16 rows x FA_BKV cells (8-cell blocks past wmax skipped: all masked).
        float s[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
            if (c0 + n * 8 <= wmax) {
                const u16* kr = ks + (n * 8 + g) * KS + 2 * tg;
#pragma unroll
                for (int k = 0; k < KK; ++k) {
                    const u32 b0 = *(const u32*)(kr + k * 16);
                    const u32 b1 = *(const u32*)(kr + k * 16 + 8);
                    fa_mma(s[n], qf[k][0], qf[k][1], qf[k][2], qf[k][3], b0, b1);
                }
            }
        }
        // Causal mask (only where some cell of the tile lies past a token of the warp), then
        // the online softmax; thread rows g (lo: s[.][0..1]) and g + 8 (hi: s[.][2..3]).
        const bool mask = c0 + FA_BKV - 1 > wmin;
        float mx_lo = m_lo, mx_hi = m_hi;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                const int c = c0 + n * 8 + 2 * tg + (v & 1);
                float x = s[n][v] * sl2;
                if (mask && c > (v < 2 ? p_lo : p_hi)) x = ST_NEG_INF;
                s[n][v] = x;
            }
            mx_lo = fmaxf(mx_lo, fmaxf(s[n][0], s[n][1]));
            mx_hi = fmaxf(mx_hi, fmaxf(s[n][2], s[n][3]));
        }
        // The four threads of a quad share rows g and g + 8.
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
        // A row that has seen no cell yet keeps max -inf; subtract 0 then (all p = 0).
        const float b_lo = mx_lo == ST_NEG_INF ? 0.0f : mx_lo;
        const float b_hi = mx_hi == ST_NEG_INF ? 0.0f : mx_hi;
        const float corr_lo = exp2f(m_lo - b_lo), corr_hi = exp2f(m_hi - b_hi);
        m_lo = mx_lo;
        m_hi = mx_hi;
        float rs_lo = 0.0f, rs_hi = 0.0f;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            s[n][0] = exp2f(s[n][0] - b_lo);
            s[n][1] = exp2f(s[n][1] - b_lo);
            s[n][2] = exp2f(s[n][2] - b_hi);
            s[n][3] = exp2f(s[n][3] - b_hi);
            rs_lo += s[n][0] + s[n][1];
            rs_hi += s[n][2] + s[n][3];
        }
        l_lo = l_lo * corr_lo + rs_lo;  // this thread's columns only; summed over the quad last
        l_hi = l_hi * corr_hi + rs_hi;
#pragma unroll
        for (int d = 0; d < DT; ++d) {
            o[d][0] *= corr_lo;
            o[d][1] *= corr_lo;
            o[d][2] *= corr_hi;
            o[d][3] *= corr_hi;
        }
        // O += P V: the S accumulators of cells [16k, 16k + 16) are the A fragment of step k.
#pragma unroll
        for (int k = 0; k < FA_BKV / 16; ++k) {
            if (c0 + k * 16 <= wmax) {
                const u32 a0 = fa_pack(s[2 * k][0], s[2 * k][1]);
                const u32 a1 = fa_pack(s[2 * k][2], s[2 * k][3]);
                const u32 a2 = fa_pack(s[2 * k + 1][0], s[2 * k + 1][1]);
                const u32 a3 = fa_pack(s[2 * k + 1][2], s[2 * k + 1][3]);
                const u16* vr = vt + g * VS + k * 16 + 2 * tg;
#pragma unroll
                for (int d = 0; d < DT; ++d) {
                    const u32 b0 = *(const u32*)(vr + d * 8 * VS);
                    const u32 b1 = *(const u32*)(vr + d * 8 * VS + 8);
                    fa_mma(o[d], a0, a1, a2, a3, b0, b1);
                }
            }
        }
    }

    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
    const int t_lo = t0 + warp * 16 + g, t_hi = t_lo + 8;
    const float i_lo = l_lo > 0.0f ? 1.0f / l_lo : 0.0f;
    const float i_hi = l_hi > 0.0f ? 1.0f / l_hi : 0.0f;
#pragma unroll
    for (int d = 0; d < DT; ++d) {
        const int col = d * 8 + 2 * tg;
        if (t_lo < n_tok)
            *(float2*)(out + ((long)t_lo * n_head + h) * HD + col) =
                make_float2(o[d][0] * i_lo, o[d][1] * i_lo);
        if (t_hi < n_tok)
            *(float2*)(out + ((long)t_hi * n_head + h) * HD + col) =
                make_float2(o[d][2] * i_hi, o[d][3] * i_hi);
    }
}

// Arguments as dq_attn_prefill's (less kt). q and out 16-byte aligned; hd 64 or 128.
// grid: (n_head, ceil(n_tok / FA_BQ)); block: FA_WARPS * 32 threads;
// dynamic shared: 2 * (FA_BKV * (hd + 8) + hd * (FA_BKV + 8)) bytes.
ST_KERNEL void fa_prefill(const float* q, const u8* kv, const int* slot, const int* pos,
                          long slot_bytes, long k_off, long v_off, int kv_ty, int n_head,
                          int n_head_kv, int hd, long row_bytes, float scale, int n_tok,
                          float* out) {
    if (hd == 128)
        fa_body<128>(q, kv, slot, pos, slot_bytes, k_off, v_off, kv_ty, n_head, n_head_kv,
                     row_bytes, scale, n_tok, out);
    else if (hd == 64)
        fa_body<64>(q, kv, slot, pos, slot_bytes, k_off, v_off, kv_ty, n_head, n_head_kv,
                    row_bytes, scale, n_tok, out);
}

#endif  // ST_CUDA
