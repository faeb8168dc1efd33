// router.cu: the MoE router: softmax over all experts, then the top k (ties to the lower
// expert index), renormalised when norm != 0. Invariant: one block per token; the probability
// row lives in dynamic shared memory (n_expert floats), so the host checks n_expert fits.

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
