// elementwise.cu: SwiGLU, embedding lookup with dequantization, and greedy sampling (argmax).
// Invariant: grid-stride loops, so any n and any grid size are correct.

// out = silu(g) * u, silu(v) = v / (1 + exp(-v)).
ST_KERNEL void swiglu_f32(const float* g, const float* u, float* out, long n) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x) {
        const float v = g[i];
        out[i] = v / (1.0f + expf(-v)) * u[i];
    }
}

// out[t] = dequantized row ids[t] of W (row_bytes per row, cols elements).
// grid: n_tok; the host checked every id < rows.
ST_KERNEL void get_rows(const u8* W, int ty, long row_bytes, const int* ids, float* out, int cols) {
    const u8* row = W + (long)ids[blockIdx.x] * row_bytes;
    float* o = out + (long)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) o[i] = st_row_elem(row, ty, i);
}

// out[t] = the lowest index of the largest of logits[t*n .. t*n+n). grid: n_tok.
ST_KERNEL void argmax_f32(const float* logits, int n, int* out) {
    __shared__ float bv[32];
    __shared__ int bi[32];
    const float* x = logits + (long)blockIdx.x * n;
    float best = ST_NEG_INF;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = x[i];
        if (v > best) { best = v; idx = i; }
    }
    for (int m = ST_WARP / 2; m > 0; m >>= 1) {
        const float ov = ST_SHFL_XOR(best, m);
        const int oi = ST_SHFL_XOR(idx, m);
        if (ov > best || (ov == best && oi < idx)) { best = ov; idx = oi; }
    }
    const int lane = threadIdx.x % ST_WARP, warp = threadIdx.x / ST_WARP;
    if (lane == 0) { bv[warp] = best; bi[warp] = idx; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int wi = 1; wi < (int)(blockDim.x / ST_WARP); ++wi) {
            if (bv[wi] > best || (bv[wi] == best && bi[wi] < idx)) { best = bv[wi]; idx = bi[wi]; }
        }
        out[blockIdx.x] = idx == 0x7fffffff ? 0 : idx;
    }
}
