// linear.cu: Qwen3-Next's ops around its two attention kinds — the gated full attention's
// query/gate split and sigmoid output gate; the Gated DeltaNet's causal depthwise conv1d + SiLU
// with each slot's rolling conv state, and its gated delta rule (gates, q/k l2-norm, the
// recurrent rule over each slot's state, the gated RMSNorm of the output); the shared
// expert's SwiGLU and its sigmoid-gated add.
// Invariant: the CPU backend's math (backend/cpu/{attn_gate,conv,delta_net,norms,
// shared_expert}.rs), token by token in the recurrent form; a slot's state is read and written
// by exactly one block per (op, head or channel block), its tokens in order, and a token at
// position 0 starts it from zero. Runs are consecutive tokens of one slot (the CPU's rule);
// a pass holds at most one run per slot (one prefill, or decode of distinct slots); only
// the block at a run's first token works, so the launch shape depends only on the token
// count (graph replay) and slots and positions are read from device memory. With n_ckpt > 0
// (an MTP verify pass) the conv and delta rule also write the slot's state after each of the
// run's first min(n_ckpt, len - 1) tokens into its checkpoints (checkpoint j of slot s at
// ckpt + (s * n_ckpt + j) * slot_stride + layer_off floats: the CPU backend's LinearState
// layout), so a rejected draft is undone by copying one back.

// LIN_MAX_CONV (consts.rs): the largest conv width (taps) lin_conv_silu takes.

__device__ __forceinline__ float lin_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float lin_silu(float x) { return x / (1.0f + expf(-x)); }
// PyTorch's F.softplus (threshold 20).
__device__ __forceinline__ float lin_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Whether token t starts a run (its slot differs from the token before), and the run's end.
__device__ __forceinline__ bool lin_run(const u32* slot, int t, int n, int* end) {
    if (t > 0 && slot[t - 1] == slot[t]) return false;
    int e = t + 1;
    while (e < n && slot[e] == slot[t]) ++e;
    *end = e;
    return true;
}

// qg: n x n_head x 2 hd (per head the query then its gate) -> q, gate: n x n_head x hd.
// grid: (n_head, n); block: any.
ST_KERNEL void lin_split_qg(const float* __restrict__ qg, float* __restrict__ q,
                            float* __restrict__ gate, int n_head, int hd) {
    const long h = (long)blockIdx.y * n_head + blockIdx.x;
    const float* src = qg + h * 2 * hd;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        q[h * hd + i] = src[i];
        gate[h * hd + i] = src[hd + i];
    }
}

// x[i] *= sigmoid(gate[i]) for i < total. grid-stride; any grid and block.
ST_KERNEL void lin_sigmoid_gate(float* x, const float* __restrict__ gate, long total) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long)gridDim.x * blockDim.x)
        x[i] *= lin_sigmoid(gate[i]);
}

// The causal depthwise conv1d + SiLU of n tokens of `ch` channels (qkv: n x ch; w: ch x k taps,
// the last tap on the current token), each run over its slot's conv state ((k - 1) x ch f32,
// row 0 the oldest input, at state + slot * slot_stride + layer_off floats), which it rolls
// forward; out: n x ch; the conv state after each of the first tokens into the checkpoints
// when n_ckpt > 0 (see above). grid: (ceil(ch / blockDim.x), n); block: any. One thread per
// channel.
ST_KERNEL void lin_conv_silu(const float* __restrict__ qkv, const float* __restrict__ w,
                             float* state, const u32* __restrict__ pos,
                             const u32* __restrict__ slot, float* __restrict__ out, int n, int ch,
                             int k, long slot_stride, long layer_off, float* __restrict__ ckpt,
                             int n_ckpt) {
    const int t0 = blockIdx.y;
    int t1;
    if (!lin_run(slot, t0, n, &t1)) return;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= ch) return;
    const int hist = k - 1, len = t1 - t0;
    float* st = state + (long)slot[t0] * slot_stride + layer_off;
    const bool fresh = pos[t0] == 0;
    float tap[LIN_MAX_CONV];
    for (int i = 0; i < k; ++i) tap[i] = w[(long)c * k + i];
    // Input j of concat(state, the run's tokens).
    auto in = [&](int j) -> float {
        if (j < hist) return fresh ? 0.0f : st[(long)j * ch + c];
        return qkv[(long)(t0 + j - hist) * ch + c];
    };
    for (int t = 0; t < len; ++t) {
        float acc = 0.0f;
        for (int i = 0; i < k; ++i) acc += tap[i] * in(t + i);
        out[(long)(t0 + t) * ch + c] = lin_silu(acc);
        if (t < n_ckpt && t + 1 < len) {
            // The state after token t: the hist inputs ending with it.
            float* ck = ckpt + ((long)slot[t0] * n_ckpt + t) * slot_stride + layer_off;
            for (int r = 0; r < hist; ++r) ck[(long)r * ch + c] = in(t + 1 + r);
        }
    }
    // Keep the last hist inputs: row r takes input len + r, which (when still in the state)
    // is a later row than r, not yet overwritten.
    for (int r = 0; r < hist; ++r) st[(long)r * ch + c] = in(len + r);
}

// The gated delta rule for the run starting at token blockIdx.y, one row j of one value
// head h's state per warp (rows are independent: only the output norm couples them, and
// that is lin_gated_norm's): blockIdx.x = h * ceil(dv / LIN_DR_ROWS) + the row group, the
// row held in registers for the whole run (LIN_DR_MAXL values a lane, so dk <= 32 *
// LIN_DR_MAXL). Per token: q and k (key head h / (nv / nk)) l2-normalized, beta = sigmoid(b),
// g = ssm_a * softplus(a + dt_bias) from the ssm_ba row (per key head r b's then r a's),
// S_j <- exp(g) S_j; d = beta (v_j - S_j k); S_j <- S_j + k d; o_j = S_j q / sqrt(dk) into
// out (the state stored as dv rows of dk, at state + slot * slot_stride + layer_off floats,
// head after head). conv: n x (2 nk dk + nv dv) (all q heads, all k heads, all v heads);
// ba: n x 2 nv; out: n x nv x dv; the row after each of the first tokens into the
// checkpoints when n_ckpt > 0 (see above). No block-level synchronisation: a warp past dv
// leaves at once. grid: (nv * ceil(dv / LIN_DR_ROWS), n); block: LIN_DR_ROWS warps.
#define LIN_DR_ROWS 4
#define LIN_DR_MAXL 8
ST_KERNEL void lin_delta_rule(const float* __restrict__ conv, const float* __restrict__ ba,
                              const float* __restrict__ dt_bias,
                              const float* __restrict__ ssm_a, float* state,
                              const u32* __restrict__ pos, const u32* __restrict__ slot,
                              float* __restrict__ out, int n, int nk, int nv, int dk, int dv,
                              long slot_stride, long layer_off, float* __restrict__ ckpt,
                              int n_ckpt) {
    const int t0 = blockIdx.y;
    int t1;
    if (!lin_run(slot, t0, n, &t1)) return;
    const int rb = (dv + LIN_DR_ROWS - 1) / LIN_DR_ROWS;
    const int h = blockIdx.x / rb;
    const int lane = threadIdx.x % ST_WARP, warp = threadIdx.x / ST_WARP;
    const int j = (blockIdx.x % rb) * LIN_DR_ROWS + warp;
    if (j >= dv) return;
    const int r = nv / nk, kh = h / r, j_in = h % r;
    const long kd = (long)nk * dk, width = 2 * kd + (long)nv * dv;
    const float scale = 1.0f / sqrtf((float)dk);
    const long row_off = ((long)h * dv + j) * dk;
    float* sr = state + (long)slot[t0] * slot_stride + layer_off + row_off;
    const bool fresh = pos[t0] == 0;
    float s[LIN_DR_MAXL];
#pragma unroll
    for (int c = 0; c < LIN_DR_MAXL; ++c) {
        const int i = lane + c * ST_WARP;
        s[c] = (!fresh && i < dk) ? sr[i] : 0.0f;
    }
    for (int t = t0; t < t1; ++t) {
        const float* row = conv + (long)t * width;
        float q[LIN_DR_MAXL], k[LIN_DR_MAXL];
        float sq = 0.0f, sk = 0.0f;
#pragma unroll
        for (int c = 0; c < LIN_DR_MAXL; ++c) {
            const int i = lane + c * ST_WARP;
            q[c] = i < dk ? row[(long)kh * dk + i] : 0.0f;
            k[c] = i < dk ? row[kd + (long)kh * dk + i] : 0.0f;
            sq += q[c] * q[c];
            sk += k[c] * k[c];
        }
        sq = st_warp_sum(sq);
        sk = st_warp_sum(sk);
        const float rq = 1.0f / sqrtf(sq + 1e-6f), rk = 1.0f / sqrtf(sk + 1e-6f);
        const float* bar = ba + (long)t * 2 * nv + (long)kh * 2 * r;
        const float beta = lin_sigmoid(bar[j_in]);
        const float decay = expf(ssm_a[h] * lin_softplus(bar[r + j_in] + dt_bias[h]));
        const float vj = row[2 * kd + (long)h * dv + j];
        float mem = 0.0f;
#pragma unroll
        for (int c = 0; c < LIN_DR_MAXL; ++c) mem += (s[c] * decay) * (k[c] * rk);
        mem = st_warp_sum(mem);
        const float d = beta * (vj - mem);
        // The checkpoint this token's state is kept in (none past the first n_ckpt tokens,
        // nor for the run's last).
        float* ck = (t - t0 < n_ckpt && t + 1 < t1)
                        ? ckpt + ((long)slot[t0] * n_ckpt + (t - t0)) * slot_stride + layer_off +
                              row_off
                        : nullptr;
        float acc = 0.0f;
#pragma unroll
        for (int c = 0; c < LIN_DR_MAXL; ++c) {
            const int i = lane + c * ST_WARP;
            s[c] = s[c] * decay + (k[c] * rk) * d;
            if (ck && i < dk) ck[i] = s[c];
            acc += s[c] * (q[c] * rq);
        }
        acc = st_warp_sum(acc);
        if (lane == 0) out[((long)t * nv + h) * dv + j] = acc * scale;
    }
#pragma unroll
    for (int c = 0; c < LIN_DR_MAXL; ++c) {
        const int i = lane + c * ST_WARP;
        if (i < dk) sr[i] = s[c];
    }
}

// The delta rule's gated output norm, in place: out = norm * o / rms(o) * silu(z) over the
// dv values of value head blockIdx.x of token blockIdx.y (o from lin_delta_rule).
// z, out: n x nv x dv. grid: (nv, n); block: a multiple of the warp size.
ST_KERNEL void lin_gated_norm(float* __restrict__ out, const float* __restrict__ z,
                              const float* __restrict__ norm, int nv, int dv, float eps) {
    __shared__ float red[32];
    const long o = ((long)blockIdx.y * nv + blockIdx.x) * dv;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < dv; j += blockDim.x) ss += out[o + j] * out[o + j];
    ss = st_block_sum(ss, red);
    const float rr = 1.0f / sqrtf(ss / (float)dv + eps);
    for (int j = threadIdx.x; j < dv; j += blockDim.x)
        out[o + j] = norm[j] * (out[o + j] * rr) * lin_silu(z[o + j]);
}

// g[i] = silu(g[i]) * u[i] for i < total. grid-stride; any grid and block.
ST_KERNEL void lin_swiglu(float* g, const float* __restrict__ u, long total) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long)gridDim.x * blockDim.x)
        g[i] = lin_silu(g[i]) * u[i];
}

// out[t] = [a[t], b[t]] over n rows of e (the MTP block's eh_proj input), one launch rather
// than copies (a captured draft graph then holds kernels only). grid-stride over n x 2e.
ST_KERNEL void lin_concat_rows(const float* __restrict__ a, const float* __restrict__ b,
                               float* __restrict__ out, int e, long total) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long)gridDim.x * blockDim.x) {
        const long t = i / (2 * e), c = i % (2 * e);
        out[i] = c < e ? a[t * e + c] : b[t * e + c - e];
    }
}

// The shared expert's gated add of token blockIdx.x: y += sigmoid(gate_inp . xn) * d over rows
// of e. grid: n; block: a multiple of the warp size.
ST_KERNEL void lin_shared_add(const float* __restrict__ xn, const float* __restrict__ gate_inp,
                              const float* __restrict__ d, float* y, int e) {
    __shared__ float red[32];
    const long b = (long)blockIdx.x * e;
    float s = 0.0f;
    for (int i = threadIdx.x; i < e; i += blockDim.x) s += gate_inp[i] * xn[b + i];
    s = st_block_sum(s, red);
    const float wg = lin_sigmoid(s);
    for (int i = threadIdx.x; i < e; i += blockDim.x) y[b + i] += wg * d[b + i];
}
