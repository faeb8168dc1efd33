// matvec.cu: y[t][r] = W_r . x[t] for 1..MV_MAX_TOK tokens against GGUF-layout weights (rows
// of `cols` elements, each row a whole number of blocks): Q8_0, Q4_K and F32/F16/BF16.
// Invariant: one warp per weight row, every lane's partial sums reduced within the warp;
// rows past `rows` and blocks past the row's end are never read (ragged tails are guarded).
// The host splits larger token counts into chunks of MV_MAX_TOK.

#define MV_MAX_TOK 8

__device__ __forceinline__ void mv_store(float (&acc)[MV_MAX_TOK], float* y, int rows, int row,
                                         int n_tok) {
    const int lane = threadIdx.x % ST_WARP;
#pragma unroll
    for (int t = 0; t < MV_MAX_TOK; ++t) {
        if (t < n_tok) {
            const float s = st_warp_sum(acc[t]);
            if (lane == 0) y[(long)t * rows + row] = s;
        }
    }
}

// grid: ceil(rows / warps per block); block: a multiple of 32 threads (8 lanes per block of
// 32 quants, 4 Q8_0 blocks per warp step).
ST_KERNEL void mv_q8_0(const u8* __restrict__ W, const float* __restrict__ x,
                       float* __restrict__ y, int rows, int cols, int n_tok) {
    const int lane = threadIdx.x % ST_WARP;
    const int row = blockIdx.x * (blockDim.x / ST_WARP) + threadIdx.x / ST_WARP;
    if (row >= rows) return;
    const int nb = cols / QK8_0;
    const u8* wr = W + (long)row * nb * Q8_0_BYTES;
    float acc[MV_MAX_TOK];
#pragma unroll
    for (int t = 0; t < MV_MAX_TOK; ++t) acc[t] = 0.0f;
    const int per = ST_WARP / 8;  // blocks per warp step
    for (int b0 = 0; b0 < nb; b0 += per) {
        const int b = b0 + lane / 8;
        if (b < nb) {
            const u8* blk = wr + (long)b * Q8_0_BYTES;
            const int j = (lane % 8) * 4;
            const float d = st_h2f(st_ld_u16(blk));
            const float q0 = (float)(i8)blk[2 + j], q1 = (float)(i8)blk[3 + j];
            const float q2 = (float)(i8)blk[4 + j], q3 = (float)(i8)blk[5 + j];
#pragma unroll
            for (int t = 0; t < MV_MAX_TOK; ++t) {
                if (t < n_tok) {
                    const float* xs = x + (long)t * cols + (long)b * QK8_0 + j;
                    acc[t] += d * (q0 * xs[0] + q1 * xs[1] + q2 * xs[2] + q3 * xs[3]);
                }
            }
        }
    }
    mv_store(acc, y, rows, row, n_tok);
}

// One Q4_K super-block (256 quants) per warp step: lane l takes 4 bytes of group l/8, i.e.
// 4 low-nibble quants of sub-block 2g and 4 high-nibble quants of sub-block 2g+1.
ST_KERNEL void mv_q4_k(const u8* __restrict__ W, const float* __restrict__ x,
                       float* __restrict__ y, int rows, int cols, int n_tok) {
    const int lane = threadIdx.x % ST_WARP;
    const int row = blockIdx.x * (blockDim.x / ST_WARP) + threadIdx.x / ST_WARP;
    if (row >= rows) return;
    const int nb = cols / QK_K;
    const u8* wr = W + (long)row * nb * Q4_K_BYTES;
    float acc[MV_MAX_TOK];
#pragma unroll
    for (int t = 0; t < MV_MAX_TOK; ++t) acc[t] = 0.0f;
    // With a 64-lane warp, two super-blocks per step.
    const int per = ST_WARP / 32;
    const int sl = lane % 32;
    const int g = sl / 8, j = (sl % 8) * 4;
    for (int b0 = 0; b0 < nb; b0 += per) {
        const int b = b0 + lane / 32;
        if (b < nb) {
            const u8* blk = wr + (long)b * Q4_K_BYTES;
            const float d = st_h2f(st_ld_u16(blk)), dmin = st_h2f(st_ld_u16(blk + 2));
            float sc0, m0, sc1, m1;
            st_scale_min_k4(2 * g, blk + 4, &sc0, &m0);
            st_scale_min_k4(2 * g + 1, blk + 4, &sc1, &m1);
            const u8* q = blk + 16 + 32 * g + j;
            const u8 b0q = q[0], b1q = q[1], b2q = q[2], b3q = q[3];
            const float d1 = d * sc0, mm1 = dmin * m0, d2 = d * sc1, mm2 = dmin * m1;
#pragma unroll
            for (int t = 0; t < MV_MAX_TOK; ++t) {
                if (t < n_tok) {
                    const float* xa = x + (long)t * cols + (long)b * QK_K + 64 * g + j;
                    const float* xh = xa + 32;
                    const float qa = (float)(b0q & 0xF) * xa[0] + (float)(b1q & 0xF) * xa[1] +
                                     (float)(b2q & 0xF) * xa[2] + (float)(b3q & 0xF) * xa[3];
                    const float qh = (float)(b0q >> 4) * xh[0] + (float)(b1q >> 4) * xh[1] +
                                     (float)(b2q >> 4) * xh[2] + (float)(b3q >> 4) * xh[3];
                    const float sa = xa[0] + xa[1] + xa[2] + xa[3];
                    const float sh = xh[0] + xh[1] + xh[2] + xh[3];
                    acc[t] += d1 * qa - mm1 * sa + d2 * qh - mm2 * sh;
                }
            }
        }
    }
    mv_store(acc, y, rows, row, n_tok);
}

// Plain types (block of one element): ty is ST_TY_F32, ST_TY_F16 or ST_TY_BF16.
ST_KERNEL void mv_plain(const u8* __restrict__ W, int ty, const float* __restrict__ x,
                        float* __restrict__ y, int rows, int cols, int n_tok) {
    const int lane = threadIdx.x % ST_WARP;
    const int row = blockIdx.x * (blockDim.x / ST_WARP) + threadIdx.x / ST_WARP;
    if (row >= rows) return;
    const int esz = ty == ST_TY_F32 ? 4 : 2;
    const u8* wr = W + (long)row * cols * esz;
    float acc[MV_MAX_TOK];
#pragma unroll
    for (int t = 0; t < MV_MAX_TOK; ++t) acc[t] = 0.0f;
    for (int i = lane; i < cols; i += ST_WARP) {
        float w;
        if (ty == ST_TY_F32) w = ((const float*)wr)[i];
        else if (ty == ST_TY_F16) w = st_h2f(st_ld_u16(wr + 2 * i));
        else w = st_bf2f(st_ld_u16(wr + 2 * i));
#pragma unroll
        for (int t = 0; t < MV_MAX_TOK; ++t) {
            if (t < n_tok) acc[t] += w * x[(long)t * cols + i];
        }
    }
    mv_store(acc, y, rows, row, n_tok);
}
