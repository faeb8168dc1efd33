// attention.cu: decode attention (one query row per token and head) over a KV layer stored as
// F16 or Q8_0 rows (`n_cells` K rows then V rows, each holding every KV head), split over the
// KV length: attn_decode_partial computes, per (head, split, token), the running max, sum and
// unnormalised output of its chunk of cells; attn_decode_combine merges the splits.
// Invariant: token t reads cells [0, n_ctx[t]) only; an empty split contributes weight 0.

// grid: (n_head, n_split, n_tok); block: ATT_WARPS warps. hdk, hdv <= ATT_MAX_D.
// part_o: [n_tok][n_head][n_split][hdv]; part_ms: [n_tok][n_head][n_split][2] (max, sum).
ST_KERNEL void attn_decode_partial(const float* q, const u8* k, const u8* v, int kv_ty,
                                   const int* n_ctx, int n_head, int n_head_kv, int hdk, int hdv,
                                   long k_row_bytes, long v_row_bytes, float scale, int chunk,
                                   float* part_o, float* part_ms) {
    __shared__ float wm[ATT_WARPS], ws[ATT_WARPS];
    __shared__ float wo[ATT_WARPS][ATT_MAX_D];
    const int h = blockIdx.x, sp = blockIdx.y, t = blockIdx.z, n_split = gridDim.y;
    const int lane = threadIdx.x % ST_WARP, warp = threadIdx.x / ST_WARP;
    const int kvh = h / (n_head / n_head_kv);
    const int ctx = n_ctx[t];
    const int c0 = sp * chunk;
    const int c1 = min(c0 + chunk, ctx);
    const float* qh = q + ((long)t * n_head + h) * hdk;
    constexpr int PER = ATT_MAX_D / ST_WARP;
    float qr[PER], acc[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int d = lane + i * ST_WARP;
        qr[i] = d < hdk ? qh[d] : 0.0f;
        acc[i] = 0.0f;
    }
    float m = ST_NEG_INF, s = 0.0f;
    for (int c = c0 + warp; c < c1; c += ATT_WARPS) {
        const u8* kr = k + (long)c * k_row_bytes;
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int d = lane + i * ST_WARP;
            if (d < hdk) dot += qr[i] * att_elem(kr, kv_ty, kvh * hdk + d);
        }
        const float sc = st_warp_sum(dot) * scale;
        const float nm = fmaxf(m, sc);
        const float corr = expf(m - nm);
        const float pw = expf(sc - nm);
        s = s * corr + pw;
        const u8* vr = v + (long)c * v_row_bytes;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int d = lane + i * ST_WARP;
            if (d < hdv) acc[i] = acc[i] * corr + pw * att_elem(vr, kv_ty, kvh * hdv + d);
        }
        m = nm;
    }
    if (lane == 0) { wm[warp] = m; ws[warp] = s; }
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int d = lane + i * ST_WARP;
        if (d < hdv) wo[warp][d] = acc[i];
    }
    __syncthreads();
    float M = ST_NEG_INF;
    for (int w = 0; w < ATT_WARPS; ++w) M = fmaxf(M, wm[w]);
    const long slot = ((long)t * n_head + h) * n_split + sp;
    float S = 0.0f;
    float f[ATT_WARPS];
    for (int w = 0; w < ATT_WARPS; ++w) {
        f[w] = wm[w] == ST_NEG_INF ? 0.0f : expf(wm[w] - M);
        S += f[w] * ws[w];
    }
    for (int d = threadIdx.x; d < hdv; d += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < ATT_WARPS; ++w) o += f[w] * wo[w][d];
        part_o[slot * hdv + d] = o;
    }
    if (threadIdx.x == 0) {
        part_ms[slot * 2] = M;
        part_ms[slot * 2 + 1] = S;
    }
}

// grid: (n_head, n_tok); out: [n_tok][n_head][hdv].
ST_KERNEL void attn_decode_combine(const float* part_o, const float* part_ms, int n_head,
                                   int hdv, int n_split, float* out) {
    const int h = blockIdx.x, t = blockIdx.y;
    const long base = ((long)t * n_head + h) * n_split;
    float M = ST_NEG_INF;
    for (int sp = 0; sp < n_split; ++sp) M = fmaxf(M, part_ms[(base + sp) * 2]);
    float S = 0.0f;
    for (int sp = 0; sp < n_split; ++sp) {
        const float ms = part_ms[(base + sp) * 2];
        if (ms != ST_NEG_INF) S += expf(ms - M) * part_ms[(base + sp) * 2 + 1];
    }
    for (int d = threadIdx.x; d < hdv; d += blockDim.x) {
        float o = 0.0f;
        for (int sp = 0; sp < n_split; ++sp) {
            const float ms = part_ms[(base + sp) * 2];
            if (ms != ST_NEG_INF) o += expf(ms - M) * part_o[(base + sp) * hdv + d];
        }
        out[((long)t * n_head + h) * hdv + d] = o / S;
    }
}
