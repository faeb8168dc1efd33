// rows.cu: the CUDA engine's multi-token products over Q8_0 (split layout) and Q4_K weights in
// the device layout (products.cuh): y (+)= W norm?(x) (dq_rows_mv*) and Q/K/V in one launch
// (dq_rows_qkv*) for up to NT = 4, 8 or 16 tokens a grid row (more in chunks of NT on grid.y),
// with the semantics of matvec.cu's dq_mv_body / dq_qkv_body. Each weight is read once per
// launch for all of a chunk's tokens: the block stages RW_KC columns of every token's input in
// shared memory (f32, times the norm weights), and each lane holds RW_TILE / 4 rows x NT
// tokens of accumulators, so a staged value feeds several rows. Every scalar that changes
// between steps is a kernel argument as in the matvec kernels, so a step can be captured.
// Invariant: rows past the matrices' rows and tokens past `n_tok` are never written (rows past
// the end read the last row, and their sums are dropped); columns past `cols` are never read;
// weight loads are aligned (Q8_0 quants 16 bytes, Q4_K blocks of 144 bytes from a 16-byte
// aligned base), input loads are float4 (cols % 32 == 0, x and nw 16-byte aligned).
//
// Layout of a block: RW_WARPS warps; warp w covers row tile w / wc (RW_TILE rows) and the
// column part w % wc of every staged chunk (wc = 1, 2 or 4: the host's column split, so a
// matrix of few rows still gets enough blocks). A chunk holds RW_KC / RW_STEP steps of
// RW_STEP = 128 columns; a warp takes steps part, part + wc, ... Within a warp, lane
// (g = lane / 8, c = lane % 8) reads 16 columns of each of its rows tile + g + 4 i
// (i < RW_R): Q8_0 the 16 quants at step column 16 c (one 16-byte load, one scale); Q4_K the
// 8 quant bytes at 8 c of the step's half block (one 8-byte load: 8 low nibbles at
// 64 (c / 4) + 8 (c % 4) and 8 high nibbles 32 columns further), plus the block's 16 header
// bytes. The 8 lanes of a row group then sum their parts by shuffles, and the warps of one
// row tile through shared memory.

#define RW_LANES 8                       // lanes sharing one row
#define RW_GROUPS (ST_WARP / RW_LANES)   // row groups of a warp
#define RW_R (RW_TILE / RW_GROUPS)       // rows a lane
#define RW_STEP (RW_LANES * 16)          // columns of one step: 16 a lane
#define RW_CHUNK4 (RW_KC / 4)            // float4 of one token's staged chunk

// The float4 slot of staged column group m (4 columns) of a token's chunk. The 8 lanes of a
// row group read 8 float4 at once: Q8_0 m = 32 s + 4 c + j, Q4_K m = 32 s + 16 (c / 4) +
// 2 (c % 4) + j (+ 8); the swizzle (an XOR of bits 0-1 by bits 3-4, within each 128-byte
// line) sends each such set to the 8 distinct 16-byte bank groups, so a load is one
// conflict-free wavefront per distinct line (the row groups read the same addresses).
__device__ __forceinline__ int rw_slot(int m) {
    const int r = (m >> 3) & 3;
    return m ^ ((r >> 1) | ((r & 1) << 1));
}

// Four bytes of v, each 0..15, as exact floats (CUDA: splice each under the exponent of 2^23,
// then subtract 2^23; one byte permute and one add a value).
__device__ __forceinline__ void rw_u4x4_to_f32(u32 v, float* out) {
#ifdef ST_CUDA
    out[0] = __int_as_float(__byte_perm(v, 0x4B000000u, 0x7650)) - 8388608.0f;
    out[1] = __int_as_float(__byte_perm(v, 0x4B000000u, 0x7651)) - 8388608.0f;
    out[2] = __int_as_float(__byte_perm(v, 0x4B000000u, 0x7652)) - 8388608.0f;
    out[3] = __int_as_float(__byte_perm(v, 0x4B000000u, 0x7653)) - 8388608.0f;
#else
    out[0] = (float)(v & 0xff);
    out[1] = (float)((v >> 8) & 0xff);
    out[2] = (float)((v >> 16) & 0xff);
    out[3] = (float)((v >> 24) & 0xff);
#endif
}

// Byte k (0..3) of v.
__device__ __forceinline__ u32 rw_byte(u32 v, int k) { return (v >> (8 * k)) & 0xFFu; }

// ggml's get_scale_min_k4 for sub-block j (0..7) from the 12 scale bytes in s1, s2, s3
// (bytes 0-3, 4-7, 8-11).
__device__ __forceinline__ void rw_scale_min(int j, u32 s1, u32 s2, u32 s3, float* sc,
                                             float* m) {
    const int k = j & 3;
    if (j < 4) {
        *sc = (float)(rw_byte(s1, k) & 63);
        *m = (float)(rw_byte(s2, k) & 63);
    } else {
        *sc = (float)((rw_byte(s3, k) & 0xF) | ((rw_byte(s1, k) >> 6) << 4));
        *m = (float)((rw_byte(s3, k) >> 4) | ((rw_byte(s2, k) >> 6) << 4));
    }
}

// Up to three matrices stacked by rows (dq_rows_mv: one), all of `cols` columns.
struct RwMats {
    const u8* w0;
    const u8* w1;
    const u8* w2;
    float* y0;
    float* y1;
    float* y2;
    int r0, r1, r2;
};

// Stacked row r -> its matrix (0, 1 or 2) with r made local to it.
__device__ __forceinline__ int rw_which(const RwMats& m, int& r) {
    if (r < m.r0) return 0;
    r -= m.r0;
    if (r < m.r1) return 1;
    r -= m.r1;
    return 2;
}

// One step's weights of the lane's rows: the raw quants and per-row factors.
// Q8_0: q[i] the 16 quants, a[i] the block's scale. Q4_K: q[i].x/.y the 8 quant bytes,
// (a, b)[i][0] = (d sc, dmin m) of the low nibbles' sub-block, [1] of the high nibbles'.
struct RwStep {
    u32 q[RW_R][4];
    float a[RW_R][2];
    float b[RW_R][2];
};

// Loads the lane's step at column cb (a multiple of RW_STEP) of each of its rows.
template <bool Q4K>
__device__ __forceinline__ void rw_load(const u8* const (&rw)[RW_R], const u16* const (&rd)[RW_R],
                                        int cols, int cb, int c, RwStep& st) {
    if (!Q4K) {
        const int col = cb + 16 * c;
        const bool in = col < cols;  // cols % 32 == 0: a lane's 16 columns are all in or out
#pragma unroll
        for (int i = 0; i < RW_R; ++i) {
            int4 q = make_int4(0, 0, 0, 0);
            float d = 0.0f;
            if (in) {
                q = __ldg((const int4*)(rw[i] + col));
                d = st_h2f(__ldg(rd[i] + col / QK8_0));
            }
            st.q[i][0] = (u32)q.x;
            st.q[i][1] = (u32)q.y;
            st.q[i][2] = (u32)q.z;
            st.q[i][3] = (u32)q.w;
            st.a[i][0] = d;
        }
    } else {
        // cols % 256 == 0: every step lies inside the row.
        const long blk = (long)(cb / QK_K) * Q4_K_BYTES;
        const int h = (cb / RW_STEP) & 1;  // which half block
        const int j0 = 2 * (2 * h + c / 4);  // the low nibbles' sub-block; j0 + 1 the high's
#pragma unroll
        for (int i = 0; i < RW_R; ++i) {
            const u8* b = rw[i] + blk;
            const uint4 hd = __ldg((const uint4*)b);
            const uint2 q = __ldg((const uint2*)(b + 16 + 64 * h + 8 * c));
            const float d = st_h2f((u16)(hd.x & 0xFFFFu)), dmin = st_h2f((u16)(hd.x >> 16));
            float sc0, m0, sc1, m1;
            rw_scale_min(j0, hd.y, hd.z, hd.w, &sc0, &m0);
            rw_scale_min(j0 + 1, hd.y, hd.z, hd.w, &sc1, &m1);
            st.q[i][0] = q.x;
            st.q[i][1] = q.y;
            st.a[i][0] = d * sc0;
            st.b[i][0] = dmin * m0;
            st.a[i][1] = d * sc1;
            st.b[i][1] = dmin * m1;
        }
    }
}

// Piece j (0..3: 4 of the lane's 16 columns) of row i's step, dequantized.
template <bool Q4K>
__device__ __forceinline__ void rw_piece(const RwStep& st, int i, int j, float (&w)[4]) {
    if (!Q4K) {
        st_i8x4_to_f32((int)st.q[i][j], w);
#pragma unroll
        for (int e = 0; e < 4; ++e) w[e] *= st.a[i][0];
    } else {
        // j 0, 1: low nibbles of quant bytes 0-3, 4-7; j 2, 3: their high nibbles.
        const int hi = j >> 1;
        rw_u4x4_to_f32((st.q[i][j & 1] >> (4 * hi)) & 0x0F0F0F0Fu, w);
#pragma unroll
        for (int e = 0; e < 4; ++e) w[e] = fmaf(w[e], st.a[i][hi], -st.b[i][hi]);
    }
}

// The staged float4 index (before the swizzle) of piece j of lane c at step s of a chunk.
template <bool Q4K>
__device__ __forceinline__ int rw_m(int s, int c, int j) {
    return Q4K ? 32 * s + 16 * (c / 4) + 2 * (c % 4) + (j & 1) + 8 * (j >> 1)
               : 32 * s + 4 * c + j;
}

// The product of one weight type (Q4K or Q8_0). See the file comment for the layout.
template <int NT, bool Q4K>
__device__ __forceinline__ void rw_run(const RwMats& m, int cols, const float* x,
                                       const float* nw, float eps, int n_tok, int add,
                                       float* xn_out, int wc) {
    const int total = m.r0 + m.r1 + m.r2;
    const int warp = threadIdx.x / ST_WARP, lane = threadIdx.x % ST_WARP;
    const int g = lane / RW_LANES, c = lane % RW_LANES;
    const int brows = RW_TILE * (RW_WARPS / wc);
    const int b0 = blockIdx.x * brows;
    const int tile = warp / wc, part = warp % wc;
    const int t0 = blockIdx.y * NT;
    const int nt = min(NT, n_tok - t0);
    x += (long)t0 * cols;

    // The lane's rows (past the end: the last row, whose sums are never written).
    const u8* rw[RW_R];
    const u16* rd[RW_R];
#pragma unroll
    for (int i = 0; i < RW_R; ++i) {
        int r = min(b0 + tile * RW_TILE + g + RW_GROUPS * i, total - 1);
        const int k = rw_which(m, r);
        const u8* W = k == 0 ? m.w0 : k == 1 ? m.w1 : m.w2;
        const long rows = k == 0 ? m.r0 : k == 1 ? m.r1 : m.r2;
        if (Q4K) {
            rw[i] = W + (long)r * (cols / QK_K) * Q4_K_BYTES;
            rd[i] = nullptr;
        } else {
            rw[i] = W + (long)r * cols;
            rd[i] = (const u16*)(W + rows * cols) + (long)r * (cols / QK8_0);
        }
    }

    // Dynamic shared memory: the staged chunk (NT x RW_CHUNK4 float4), then with nw each
    // thread's sums of squares of the inputs it staged (NT x blockDim floats; in shared memory
    // rather than registers, which the product's accumulators need).
    extern __shared__ __align__(16) float4 rw_xs[];
    float* ssp = (float*)(rw_xs + NT * RW_CHUNK4);
    __shared__ float rw_s[NT];  // with nw: the tokens' RMS factors
    float acc[RW_R][NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (nw) ssp[t * blockDim.x + threadIdx.x] = 0.0f;
#pragma unroll
        for (int i = 0; i < RW_R; ++i) acc[i][t] = 0.0f;
    }
    for (int k0 = 0; k0 < cols; k0 += RW_KC) {
        // The warp's first step of the chunk is loaded before the barriers and the staging
        // (weights do not depend on x), so its latency overlaps theirs.
        RwStep st;
        if (k0 + part * RW_STEP < cols) rw_load<Q4K>(rw, rd, cols, k0 + part * RW_STEP, c, st);
        __syncthreads();  // the previous chunk's readers are done
        for (int q = threadIdx.x; q < RW_CHUNK4; q += blockDim.x) {
            const int col = k0 + 4 * q;
            float4 w4 = make_float4(1.0f, 1.0f, 1.0f, 1.0f);
            if (nw && col < cols) w4 = *(const float4*)(nw + col);
#pragma unroll 4
            for (int t = 0; t < NT; ++t) {
                float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (t < nt && col < cols) v = *(const float4*)(x + (long)t * cols + col);
                if (nw)
                    ssp[t * blockDim.x + threadIdx.x] +=
                        v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
                v.x *= w4.x;
                v.y *= w4.y;
                v.z *= w4.z;
                v.w *= w4.w;
                rw_xs[t * RW_CHUNK4 + rw_slot(q)] = v;
            }
        }
        __syncthreads();
#pragma unroll 1
        for (int s = part; s < RW_KC / RW_STEP; s += wc) {
            const int cb = k0 + s * RW_STEP;
            if (cb >= cols) break;
            if (s != part) rw_load<Q4K>(rw, rd, cols, cb, c, st);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float w[RW_R][4];
#pragma unroll
                for (int i = 0; i < RW_R; ++i) rw_piece<Q4K>(st, i, j, w[i]);
                const int slot = rw_slot(rw_m<Q4K>(s, c, j));
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    const float4 xv = rw_xs[t * RW_CHUNK4 + slot];
#pragma unroll
                    for (int i = 0; i < RW_R; ++i) {
                        float a = acc[i][t];
                        a = fmaf(w[i][0], xv.x, a);
                        a = fmaf(w[i][1], xv.y, a);
                        a = fmaf(w[i][2], xv.z, a);
                        a = fmaf(w[i][3], xv.w, a);
                        acc[i][t] = a;
                    }
                }
            }
        }
    }
    // The 8 lanes of a row group sum their columns' parts.
#pragma unroll
    for (int i = 0; i < RW_R; ++i)
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            float v = acc[i][t];
            v += ST_SHFL_XOR(v, 1);
            v += ST_SHFL_XOR(v, 2);
            v += ST_SHFL_XOR(v, 4);
            acc[i][t] = v;
        }
    __syncthreads();  // every warp is done with the staged input: it becomes the partial sums
    float* red = (float*)rw_xs;  // [warp][RW_TILE][NT + 1]
#pragma unroll
    for (int i = 0; i < RW_R; ++i)
#pragma unroll
        for (int t = 0; t < NT; ++t)
            if (t % RW_LANES == c)
                red[(warp * RW_TILE + g + RW_GROUPS * i) * (NT + 1) + t] = acc[i][t];
    if (nw && threadIdx.x < NT) {
        float a = 0.0f;
        for (int k = 0; k < blockDim.x; ++k) a += ssp[threadIdx.x * blockDim.x + k];
        rw_s[threadIdx.x] = 1.0f / sqrtf(a / (float)cols + eps);
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < brows * nt; idx += blockDim.x) {
        const int rl = idx % brows, t = idx / brows;
        int r = b0 + rl;
        if (r >= total) continue;
        const int tl = rl / RW_TILE, rr = rl % RW_TILE;
        float v = 0.0f;
        for (int p = 0; p < wc; ++p) v += red[((tl * wc + p) * RW_TILE + rr) * (NT + 1) + t];
        if (nw) v *= rw_s[t];
        const int k = rw_which(m, r);
        float* y = k == 0 ? m.y0 : k == 1 ? m.y1 : m.y2;
        const long rows = k == 0 ? m.r0 : k == 1 ? m.r1 : m.r2;
        float* o = y + (long)(t0 + t) * rows + r;
        *o = add ? *o + v : v;
    }
    // The blocks of grid column 0 write the normalised inputs (see dq_mv_body).
    if (xn_out && nw && blockIdx.x == 0) {
        xn_out += (long)t0 * cols;
        for (int t = 0; t < nt; ++t) {
            const float s = rw_s[t];
            for (int i = threadIdx.x; i < cols; i += blockDim.x)
                xn_out[(long)t * cols + i] = x[(long)t * cols + i] * s * nw[i];
        }
    }
}

// Prefetches the block's rows into L2 (weights only, so before the wait), waits for the kernel
// ahead, then runs the product of the weight type ty (ST_TY_Q8_0 or ST_TY_Q4_K).
template <int NT>
__device__ __forceinline__ void dq_rows_body(const RwMats& m, int ty, int cols, const float* x,
                                             const float* nw, float eps, int n_tok, int add,
                                             float* xn_out, int wc) {
    const int total = m.r0 + m.r1 + m.r2;
    const int brows = RW_TILE * (RW_WARPS / wc);
    if (blockIdx.y == 0) {
        for (int i = threadIdx.x / ST_WARP; i < brows; i += RW_WARPS) {
            int r = blockIdx.x * brows + i;
            if (r >= total) break;
            const int k = rw_which(m, r);
            const u8* W = k == 0 ? m.w0 : k == 1 ? m.w1 : m.w2;
            const int rows = k == 0 ? m.r0 : k == 1 ? m.r1 : m.r2;
            dq_prefetch_row(W, ty, rows, cols, r);
        }
    }
    st_pdl_enter();
    if (blockIdx.y * NT >= n_tok) return;  // the whole block: before any barrier
    if (ty == ST_TY_Q4_K) rw_run<NT, true>(m, cols, x, nw, eps, n_tok, add, xn_out, wc);
    else rw_run<NT, false>(m, cols, x, nw, eps, n_tok, add, xn_out, wc);
}

// y[t][r] (+)= W_r . norm?(x[t]) for t < n_tok, as dq_mv_body (nw: RMSNorm weights or null;
// add: accumulate into y; xn_out, with nw: grid column 0 also writes the normalised inputs).
// W: rows x cols, Q8_0 (split) or Q4_K. grid: (ceil(rows / (RW_TILE * RW_WARPS / wc)),
// ceil(n_tok / NT)); block: RW_WARPS warps; dynamic shared memory
// NT * (RW_KC + RW_WARPS * ST_WARP) * 4 bytes.

ST_KERNEL void dq_rows_mv4(const u8* W, int ty, int rows, int cols, const float* x,
                           const float* nw, float eps, float* y, int n_tok, int add,
                           float* xn_out, int wc) {
    dq_rows_body<4>(RwMats{W, W, W, y, y, y, rows, 0, 0}, ty, cols, x, nw, eps, n_tok, add,
                     xn_out, wc);
}

ST_KERNEL void dq_rows_mv8(const u8* W, int ty, int rows, int cols, const float* x,
                           const float* nw, float eps, float* y, int n_tok, int add,
                           float* xn_out, int wc) {
    dq_rows_body<8>(RwMats{W, W, W, y, y, y, rows, 0, 0}, ty, cols, x, nw, eps, n_tok, add,
                     xn_out, wc);
}

ST_KERNEL void dq_rows_mv16(const u8* W, int ty, int rows, int cols, const float* x,
                            const float* nw, float eps, float* y, int n_tok, int add,
                            float* xn_out, int wc) {
    dq_rows_body<16>(RwMats{W, W, W, y, y, y, rows, 0, 0}, ty, cols, x, nw, eps, n_tok, add,
                     xn_out, wc);
}

// Q, K and V of n_tok tokens in one launch, as dq_qkv_body: rows [0, rq) from Wq into yq,
// [rq, rq+rk) from Wk into yk, the rest from Wv into yv; x RMS-normalised by nw (if given).
// The three matrices share the type and cols. grid: as dq_rows_mv's over rq + rk + rv rows.

ST_KERNEL void dq_rows_qkv4(const u8* Wq, const u8* Wk, const u8* Wv, int ty, int rq, int rk,
                            int rv, int cols, const float* x, const float* nw, float eps,
                            float* yq, float* yk, float* yv, int n_tok, int wc) {
    dq_rows_body<4>(RwMats{Wq, Wk, Wv, yq, yk, yv, rq, rk, rv}, ty, cols, x, nw, eps, n_tok,
                     0, nullptr, wc);
}

ST_KERNEL void dq_rows_qkv8(const u8* Wq, const u8* Wk, const u8* Wv, int ty, int rq, int rk,
                            int rv, int cols, const float* x, const float* nw, float eps,
                            float* yq, float* yk, float* yv, int n_tok, int wc) {
    dq_rows_body<8>(RwMats{Wq, Wk, Wv, yq, yk, yv, rq, rk, rv}, ty, cols, x, nw, eps, n_tok,
                     0, nullptr, wc);
}

ST_KERNEL void dq_rows_qkv16(const u8* Wq, const u8* Wk, const u8* Wv, int ty, int rq, int rk,
                             int rv, int cols, const float* x, const float* nw, float eps,
                             float* yq, float* yk, float* yv, int n_tok, int wc) {
    dq_rows_body<16>(RwMats{Wq, Wk, Wv, yq, yk, yv, rq, rk, rv}, ty, cols, x, nw, eps, n_tok,
                     0, nullptr, wc);
}
