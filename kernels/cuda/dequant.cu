// dequant.cu: kernels for every weight type of quants.cuh, simple and correct first (the
// decode and prefill kernels get their fused versions from the same decoders):
//   dequant_rows: out[r] = dequantize(W row ids[r]) (ids null: row r), f32 rows of `cols`;
//   mv_any: y[r] = W_r . x for one token, a warp per row, each weight byte read once.
// Invariant: `cols` is a multiple of 32 and every row a whole number of blocks of `ty` (the
// launchers in executor/src/backend/cuda/quants.rs check both, and the ids, on the host).

// grid: n_rows blocks; block: any multiple of 32 threads (one 32-value group per thread
// per step).
ST_KERNEL void dequant_rows(const u8* __restrict__ W, int ty, long row_bytes,
                            const int* __restrict__ ids, float* __restrict__ out, int cols,
                            int n_rows) {
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    const long src = ids ? (long)ids[r] : (long)r;
    const u8* row = W + src * row_bytes;
    float* o = out + (long)r * cols;
    float v[32];
    for (int g = threadIdx.x; g < cols / 32; g += blockDim.x) {
        qt_group32(ty, row, g, v);
#pragma unroll
        for (int j = 0; j < 32; ++j) o[32 * g + j] = v[j];
    }
}

// grid: ceil(rows / warps per block); block: a multiple of the warp size. Lane l takes the
// 32-value groups l, l + warp, ... of its row; the partial sums meet in a warp reduction.
ST_KERNEL void mv_any(const u8* __restrict__ W, int ty, long row_bytes,
                      const float* __restrict__ x, float* __restrict__ y, int rows, int cols) {
    const int lane = threadIdx.x % ST_WARP;
    const int row = blockIdx.x * (blockDim.x / ST_WARP) + threadIdx.x / ST_WARP;
    if (row >= rows) return;
    const u8* wr = W + (long)row * row_bytes;
    float acc = 0.0f, v[32];
    for (int g = lane; g < cols / 32; g += ST_WARP) {
        qt_group32(ty, wr, g, v);
        const float* xs = x + 32 * g;
#pragma unroll
        for (int j = 0; j < 32; ++j) acc += v[j] * xs[j];
    }
    acc = st_warp_sum(acc);
    if (lane == 0) y[row] = acc;
}
