// norm.cu: RMSNorm over rows (optionally fused with the residual add) and Qwen3's per-head
// QK-norm fused with NEOX rotary embedding (YaRN enters only through the host's inv_freq and
// attn_factor). Invariant: one block per row or head; every element is read and written by
// the same thread, so in-place use (out == x, h_out == res) is safe.

// Elements per thread a row may have for the register path of rmsnorm_f32.
#define RN_PER 16

// h = x (+ res); out = w * (h / sqrt(mean(h^2) + eps)); h_out (if non-null) gets h.
// grid: n_rows; block: a multiple of the warp size.
ST_KERNEL void rmsnorm_f32(const float* __restrict__ x, const float* res, float* h_out,
                           const float* __restrict__ w, float* out, int n, float eps) {
    st_pdl_enter();
    __shared__ float red[32];
    const long base = (long)blockIdx.x * n;
    if (n <= (int)blockDim.x * RN_PER) {
        // Every load of the row first, into registers, so they are all in flight at once (a
        // loop that stores h_out between loads waits a memory round trip per element). Same
        // per-thread order of the squares as the loop below, so the same result.
        float h[RN_PER];
#pragma unroll
        for (int j = 0; j < RN_PER; ++j) {
            const int i = threadIdx.x + j * blockDim.x;
            h[j] = 0.0f;
            if (i < n) {
                h[j] = x[base + i];
                if (res) h[j] += res[base + i];
            }
        }
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < RN_PER; ++j) ss += h[j] * h[j];
        ss = st_block_sum(ss, red);
        const float r = 1.0f / sqrtf(ss / (float)n + eps);
#pragma unroll
        for (int j = 0; j < RN_PER; ++j) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i < n) {
                if (h_out) h_out[base + i] = h[j];
                out[base + i] = w[i] * (h[j] * r);
            }
        }
        return;
    }
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float h = x[base + i];
        if (res) h += res[base + i];
        if (h_out) h_out[base + i] = h;
        ss += h * h;
    }
    ss = st_block_sum(ss, red);
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float h;
        if (h_out) {
            h = h_out[base + i];
        } else {
            h = x[base + i];
            if (res) h += res[base + i];
        }
        out[base + i] = w[i] * (h * r);
    }
}

// x: n_tok x n_head x head_dim, in place. Optional RMSNorm of each head by w (head_dim
// weights; null skips it), then NEOX RoPE of the first n_rot dims at pos[t]:
// pair (i, i + n_rot/2) rotated by angle inv_freq[i] * pos, cos/sin scaled by attn_factor.
// grid: (n_head, n_tok); block: a multiple of the warp size; head_dim <= 1024.
ST_KERNEL void qk_norm_rope_f32(float* x, const float* w, float eps, const int* pos,
                                const float* inv_freq, float attn_factor, int n_head,
                                int head_dim, int n_rot) {
    st_pdl_enter();
    __shared__ float red[32];
    __shared__ float sh[1024];
    const long base = ((long)blockIdx.y * n_head + blockIdx.x) * head_dim;
    st_head_norm_rope(x + base, w, eps, (float)pos[blockIdx.y], inv_freq, attn_factor, head_dim,
                      n_rot, sh, red);
}
