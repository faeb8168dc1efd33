// attention.cu: KV stores and attention over per-slot KV: the store of K and V (F16, F32,
// Q8_0 with ggml's rounding), QK-norm + RoPE fused with the store, split-KV decode attention
// and the merge of its splits, the same in one launch for F16 KV, and the SIMT prefill
// attention (the tensor-core one is flash.cu's). Slots, positions and context lengths are read
// from device memory, so decode steps can be captured in a CUDA graph.
// Invariant: token t reads only its slot's cells 0..=pos[t]; a store writes only the token's
// own cell.

// Stores elements [e0, e0 + n) of one K or V row (src holds those n floats) into the KV row
// at dst: F16, F32 or Q8_0 (GGUF block layout with ggml's reference rounding; e0 and n
// multiples of 32, one warp per block). Every thread of the block calls it.
__device__ __forceinline__ void dq_store_seg(const float* src, u8* dst, int kv_ty, int e0, int n) {
    if (kv_ty == ST_TY_F16) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) ((u16*)dst)[e0 + i] = st_f2h(src[i]);
    } else if (kv_ty == ST_TY_F32) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) ((float*)dst)[e0 + i] = src[i];
    } else {
        const int lane = threadIdx.x % ST_WARP, warp = threadIdx.x / ST_WARP;
        const int nw = blockDim.x / ST_WARP;
        for (int b = warp; b < n / QK8_0; b += nw) {
            float xv = 0.0f, amax = 0.0f;
            if (lane < QK8_0) {
                xv = src[b * QK8_0 + lane];
                amax = fabsf(xv);
            }
            amax = st_warp_max(amax);
            const float d = amax / 127.0f;
            const float id = d != 0.0f ? 1.0f / d : 0.0f;
            u8* blk = dst + (long)(e0 / QK8_0 + b) * Q8_0_BYTES;
            // The f16 scale as one 16-bit store (rows and blocks are 2-byte aligned). Written
            // as two byte stores of its halves, the low byte came out 0 on the H200 (sm_90,
            // NVRTC 13.0), cutting the scale to 2 mantissa bits (q8_0 KV logits off by 0.13);
            // kv_store_matches_the_host_quantizer_byte_for_byte in cuda_ops guards this.
            if (lane == 0) *(u16*)blk = st_f2h(d);
            if (lane < QK8_0) {
                float qf = roundf(xv * id);
                qf = fminf(fmaxf(qf, -128.0f), 127.0f);
                blk[2 + lane] = (u8)(i8)(int)qf;
            }
        }
    }
}

// KV store: token t's K and V rows (width floats each) into cell pos[t] of slot slot[t]:
// K row at kv + slot*slot_bytes + k_off + pos*row_bytes, V likewise at v_off, or in host
// memory for a cell past kh's VRAM window. F16, F32 or Q8_0 (width a multiple of 32).
// grid: n_tok; block: 128.
ST_KERNEL void dq_kv_store(const float* k, const float* v, u8* kv, const int* slot,
                           const int* pos, long slot_bytes, long k_off, long v_off,
                           long row_bytes, int kv_ty, int width, const ST_GRID_CONST KvHost kh) {
    st_pdl_enter();
    const int t = blockIdx.x;
    u8* base = kv + (long)slot[t] * slot_bytes;
    u8* kr = (u8*)kvh_row(base + k_off, row_bytes, kh, slot[t], pos[t], kh.k_off);
    u8* vr = (u8*)kvh_row(base + v_off, row_bytes, kh, slot[t], pos[t], kh.v_off);
    dq_store_seg(k + (long)t * width, kr, kv_ty, 0, width);
    dq_store_seg(v + (long)t * width, vr, kv_ty, 0, width);
}

// QK-norm + RoPE of Q and K and the KV store in one launch: block (h, t) with h < n_head
// rotates query head h of token t in place; the next n_head_kv blocks rotate K head
// h - n_head in place and store it into the token's KV cell; the last n_head_kv store V
// head h - n_head - n_head_kv. Same arithmetic as qk_norm_rope_f32 + dq_kv_store (Q8_0 needs
// hd a multiple of 32, so every head is whole blocks). grid: (n_head + 2 * n_head_kv, n_tok);
// block: 128; hd <= 1024.
ST_KERNEL void dq_rope_store(float* q, float* k, const float* v, const float* q_norm,
                             const float* k_norm, float eps, const int* pos,
                             const float* inv_freq, float attn_factor, int n_head,
                             int n_head_kv, int hd, int n_rot, u8* kv, const int* slot,
                             long slot_bytes, long k_off, long v_off, long row_bytes,
                             int kv_ty, const ST_GRID_CONST KvHost kh) {
    st_pdl_enter();
    __shared__ float red[32];
    __shared__ float sh[1024];
    const int h = blockIdx.x, t = blockIdx.y;
    const float p = (float)pos[t];
    if (h < n_head) {
        st_head_norm_rope(q + ((long)t * n_head + h) * hd, q_norm, eps, p, inv_freq,
                          attn_factor, hd, n_rot, sh, red);
        return;
    }
    u8* base = kv + (long)slot[t] * slot_bytes;
    if (h < n_head + n_head_kv) {
        const int kvh = h - n_head;
        float* x = k + ((long)t * n_head_kv + kvh) * hd;
        st_head_norm_rope(x, k_norm, eps, p, inv_freq, attn_factor, hd, n_rot, sh, red);
        u8* kr = (u8*)kvh_row(base + k_off, row_bytes, kh, slot[t], pos[t], kh.k_off);
        dq_store_seg(x, kr, kv_ty, kvh * hd, hd);
    } else {
        const int vh = h - n_head - n_head_kv;
        u8* vr = (u8*)kvh_row(base + v_off, row_bytes, kh, slot[t], pos[t], kh.v_off);
        dq_store_seg(v + ((long)t * n_head_kv + vh) * hd, vr, kv_ty, vh * hd, hd);
    }
}

// One online-softmax step of one head, by the calling warp: the scores s[0..n) (n <= 32, one
// per lane; -inf for cells past the context) become exp(s - m') in place, where m' is the
// larger of the running max ml[0] and theirs; the running (max, sum) ml becomes (m', sum * c +
// the new exps' sum) and *c = exp(ml[0] - m') rescales the outputs accumulated so far.
__device__ __forceinline__ void da_softmax_step(float* s, int n, float* ml, float* c) {
    const int lane = threadIdx.x % ST_WARP;
    const float v = lane < n ? s[lane] : ST_NEG_INF;
    const float mo = ml[0];
    const float mn = fmaxf(mo, st_warp_max(v));
    const float p = v == ST_NEG_INF ? 0.0f : expf(v - mn);
    const float l = st_warp_sum(p);
    if (lane < n) s[lane] = p;
    if (lane == 0) {
        const float r = mo == ST_NEG_INF ? 0.0f : expf(mo - mn);
        *c = r;
        ml[0] = mn;
        ml[1] = ml[1] * r + l;
    }
}

// Decode attention over per-slot KV, split over the context, one block per (KV head, split,
// token) serving all G = n_head / n_head_kv query heads that share the KV head, so each K and
// V row is read once per step rather than G times. Token t reads slot slot[t]'s layer at
// kv + slot*slot_bytes + k_off / v_off, its cells past kh's VRAM window from host memory
// (a split may hold both kinds: each split is a partial softmax over its cells wherever they
// live, and dq_attn_combine's merge is the flash-decoding one). Its n_ctx[t] cells are cut
// into gridDim.y splits of da_chunk(n_ctx[t], gridDim.y) cells (computed on the device, so a
// graph captured once spreads any context over all its splits), walked in sub-chunks of
// DA_SUB cells: DA_TPC
// threads score one cell (their dims interleaved, reduced by shuffles), one warp per head
// runs the online softmax, then each thread accumulates P.V for its own dims (V rows read
// coalesced). Writes the split's unnormalised output and (max, sum); splits past the context
// write nothing (dq_attn_combine stops at the last used split).
// grid: (n_head_kv, n_split, n_tok); block: DA_THREADS. G <= DA_MAXG; hd <= ATT_MAX_D.
#define DA_THREADS 128
#define DA_SUB 16
#define DA_TPC (DA_THREADS / DA_SUB)
#define DA_DIMS (ATT_MAX_D / DA_THREADS)
// Cells per split: the context over n_split splits, in whole sub-chunks.
__device__ __forceinline__ int da_chunk(int ctx, int n_split) {
    const int per = (ctx + n_split - 1) / n_split;
    return (per + DA_SUB - 1) / DA_SUB * DA_SUB;
}
ST_KERNEL void dq_attn_gqa(const float* q, const u8* kv, const int* slot, const int* n_ctx,
                           long slot_bytes, long k_off, long v_off, int kv_ty, int n_head,
                           int n_head_kv, int hd, long row_bytes, float scale, float* part_o,
                           float* part_ms, const ST_GRID_CONST KvHost kh) {
    st_pdl_enter();
    __shared__ __align__(16) float qs[DA_MAXG * ATT_MAX_D];
    __shared__ float ps[DA_MAXG][DA_SUB];
    __shared__ float ml[DA_MAXG][2], cf[DA_MAXG];
    const int kvh = blockIdx.x, sp = blockIdx.y, t = blockIdx.z, n_split = gridDim.y;
    const int G = n_head / n_head_kv;
    // With the host part on the CPU the splits cover the window only.
    const int ctx = kh.cpu_part ? min(n_ctx[t], kh.resident) : n_ctx[t];
    const int chunk = da_chunk(ctx, n_split);
    const int c0 = sp * chunk;
    if (c0 >= ctx) return;
    const int c1 = min(c0 + chunk, ctx);
    const u8* kb = kv + (long)slot[t] * slot_bytes + k_off;
    const u8* vb = kv + (long)slot[t] * slot_bytes + v_off;
    const float* qg = q + ((long)t * n_head + (long)kvh * G) * hd;
    // The group's queries, eight loads per thread in flight before the shared stores (a store
    // between loads through a generic pointer, which may alias shared memory, would hold
    // each load back until the store before it).
    for (int i0 = threadIdx.x; i0 < G * hd; i0 += 8 * DA_THREADS) {
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int i = i0 + u * DA_THREADS;
            v[u] = i < G * hd ? qg[i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int i = i0 + u * DA_THREADS;
            if (i < G * hd) qs[i] = v[u] * scale;
        }
    }
    if (threadIdx.x < G) {
        ml[threadIdx.x][0] = ST_NEG_INF;
        ml[threadIdx.x][1] = 0.0f;
    }
    const int warp = threadIdx.x / ST_WARP;
    const int cc = threadIdx.x / DA_TPC, part = threadIdx.x % DA_TPC;
    // F16 rows read 8 halves at a time when every address involved is 16-byte aligned.
    const unsigned long long host_al =
        kh.per_slot > 0 ? (unsigned long long)(kh.cell_bytes | kh.k_off) : 0ull;
    const bool vec = kv_ty == ST_TY_F16 && hd % (8 * DA_TPC) == 0 &&
                     (((unsigned long long)kb | (unsigned long long)row_bytes | host_al |
                       (unsigned long long)(kvh * hd * 2)) & 15) == 0;
    float acc[DA_DIMS][DA_MAXG];
#pragma unroll
    for (int i = 0; i < DA_DIMS; ++i)
#pragma unroll
        for (int g = 0; g < DA_MAXG; ++g) acc[i][g] = 0.0f;
    __syncthreads();
    for (int s0 = c0; s0 < c1; s0 += DA_SUB) {
        const int nc = min(DA_SUB, c1 - s0);
        // Scores of the sub-chunk's cells for every head of the group.
        float sc[DA_MAXG];
#pragma unroll
        for (int g = 0; g < DA_MAXG; ++g) sc[g] = 0.0f;
        if (cc < nc) {
            const u8* kr = kvh_row(kb, row_bytes, kh, slot[t], s0 + cc, kh.k_off);
            if (vec) {
                const uint4* k4 = (const uint4*)(kr + (long)kvh * hd * 2);
                for (int j = part; j < hd / 8; j += DA_TPC) {
                    const uint4 raw = k4[j];
                    const u32 pk[4] = {raw.x, raw.y, raw.z, raw.w};
                    float kf[8];
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        kf[2 * e] = st_h2f((u16)(pk[e] & 0xffff));
                        kf[2 * e + 1] = st_h2f((u16)(pk[e] >> 16));
                    }
#pragma unroll
                    for (int g = 0; g < DA_MAXG; ++g) {
                        if (g < G) {
                            const float4 a = *(const float4*)(qs + g * hd + j * 8);
                            const float4 b = *(const float4*)(qs + g * hd + j * 8 + 4);
                            sc[g] += a.x * kf[0] + a.y * kf[1] + a.z * kf[2] + a.w * kf[3] +
                                     b.x * kf[4] + b.y * kf[5] + b.z * kf[6] + b.w * kf[7];
                        }
                    }
                }
            } else {
                for (int d = part; d < hd; d += DA_TPC) {
                    const float kf = att_elem(kr, kv_ty, kvh * hd + d);
#pragma unroll
                    for (int g = 0; g < DA_MAXG; ++g)
                        if (g < G) sc[g] += qs[g * hd + d] * kf;
                }
            }
        }
#pragma unroll
        for (int g = 0; g < DA_MAXG; ++g) {
            if (g < G) {
                float v = sc[g];
#pragma unroll
                for (int o = DA_TPC / 2; o > 0; o >>= 1) v += ST_SHFL_XOR(v, o);
                if (part == 0) ps[g][cc] = cc < nc ? v : ST_NEG_INF;
            }
        }
        __syncthreads();
        // Online softmax: one warp per head (DA_SUB <= 32 cells, one per lane).
        for (int g = warp; g < G; g += DA_THREADS / ST_WARP)
            da_softmax_step(ps[g], DA_SUB, ml[g], cf + g);
        __syncthreads();
        // P.V for this thread's dims.
#pragma unroll
        for (int i = 0; i < DA_DIMS; ++i) {
            const int d = threadIdx.x + i * DA_THREADS;
            if (d < hd) {
#pragma unroll
                for (int g = 0; g < DA_MAXG; ++g)
                    if (g < G) acc[i][g] *= cf[g];
#pragma unroll 8
                for (int c = 0; c < nc; ++c) {
                    const u8* vr = kvh_row(vb, row_bytes, kh, slot[t], s0 + c, kh.v_off);
                    const float vv = att_elem(vr, kv_ty, kvh * hd + d);
#pragma unroll
                    for (int g = 0; g < DA_MAXG; ++g)
                        if (g < G) acc[i][g] += ps[g][c] * vv;
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < DA_DIMS; ++i) {
        const int d = threadIdx.x + i * DA_THREADS;
        if (d < hd) {
#pragma unroll
            for (int g = 0; g < DA_MAXG; ++g) {
                if (g < G) {
                    const long sl = ((long)t * n_head + (long)kvh * G + g) * n_split + sp;
                    part_o[sl * hd + d] = acc[i][g];
                }
            }
        }
    }
    if (threadIdx.x < G) {
        const long sl = ((long)t * n_head + (long)kvh * G + threadIdx.x) * n_split + sp;
        part_ms[sl * 2] = ml[threadIdx.x][0];
        part_ms[sl * 2 + 1] = ml[threadIdx.x][1];
    }
}

// Merges dq_attn_gqa's splits of token t, head h: those that start inside the context. The
// splits' weights exp(m_s - M) are computed once into shared memory, then every output
// dimension sums its splits with independent loads. With host_o (--kv-host cpu) the splits
// cover the first min(n_ctx[t], win) cells and one more partial, the host CPU's over the
// rest ([n_tok][n_head][hd] outputs, [n_tok][n_head][2] (max, sum); (-inf, 0) when empty),
// joins the merge. grid: (n_head, n_tok); block: 128; n_split <= DA_MAX_SPLIT; out:
// [n_tok][n_head][hd].
ST_KERNEL void dq_attn_combine(const float* part_o, const float* part_ms, const int* n_ctx,
                               int n_head, int hd, int n_split, const float* host_o,
                               const float* host_ms, int win, float* out) {
    st_pdl_enter();
    __shared__ float w[DA_MAX_SPLIT];
    __shared__ float red[32];
    __shared__ float hw;
    const int h = blockIdx.x, t = blockIdx.y;
    const long base = ((long)t * n_head + h) * n_split;
    const long hb = (long)t * n_head + h;
    const int ctx = host_o ? min(n_ctx[t], win) : n_ctx[t];
    const int chunk = da_chunk(ctx, n_split);
    const int used = ctx > 0 ? min(n_split, (ctx + chunk - 1) / chunk) : 0;
    float m = ST_NEG_INF;
    for (int sp = threadIdx.x; sp < used; sp += blockDim.x) m = fmaxf(m, part_ms[(base + sp) * 2]);
    if (host_o && threadIdx.x == 0) m = fmaxf(m, host_ms[hb * 2]);
    const float M = st_block_max(m, red);
    float l = 0.0f;
    for (int sp = threadIdx.x; sp < used; sp += blockDim.x) {
        const float e = expf(part_ms[(base + sp) * 2] - M);
        w[sp] = e;
        l += e * part_ms[(base + sp) * 2 + 1];
    }
    if (threadIdx.x == 0) {
        const float mh = host_o ? host_ms[hb * 2] : ST_NEG_INF;
        hw = mh == ST_NEG_INF ? 0.0f : expf(mh - M);
        if (host_o) l += hw * host_ms[hb * 2 + 1];
    }
    __syncthreads();  // w and hw complete; st_block_sum's barriers also keep red's reuse safe
    const float inv = 1.0f / st_block_sum(l, red);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = 0.0f;
#pragma unroll 16
        for (int sp = 0; sp < used; ++sp) o += w[sp] * part_o[(base + sp) * hd + d];
        if (host_o) o += hw * host_o[hb * hd + d];
        out[((long)t * n_head + h) * hd + d] = o * inv;
    }
}

// Decode attention in one launch per layer: the QK-norm and RoPE of the queries, the KV store
// of the step's own K and V, split-KV attention and the merge of the splits, which
// dq_rope_store + dq_attn_gqa + dq_attn_combine do in three. Block (kvh, sp, t) serves the
// G = n_head / n_head_kv query heads of KV head kvh over cells [sp * chunk, +chunk) of token
// t's context (pos[t] + 1 cells; chunk from df_chunk, at least min_chunk cells), walked in
// tiles of DF_SUB cells of K and V staged in shared memory. Before st_pdl_wait it loads its
// first tile's cells of earlier steps (written by earlier steps' launches, never by this
// step's) and asks L2 for the rest; the block whose split holds the step's own cell
// normalises, rotates and stores K and stores V there first. Each block normalises and rotates its G queries in
// shared memory (q itself is left as the Q/K/V product wrote it). A context of one split
// writes out directly; otherwise every block writes its unnormalised output and (max, sum)
// into part_o / part_ms, and the last of the token's blocks for kvh to finish (counted in
// cnt[t * n_head_kv + kvh], which it resets) merges them into out. F16 KV only, hd <= 128 and
// a multiple of 8, 128 % G == 0 (the host uses the three launches otherwise).
// grid: (n_head_kv, n_split, n_tok); block: DA_THREADS (128).
#define DF_SUB 32
#define DF_TPC (DA_THREADS / DF_SUB)
#define DF_MAXD 128
#define DF_K8 (DF_MAXD / 8 / DF_TPC)
// A tile: DF_SUB cells of the head's K and V rows (16-byte chunks, rows padded by one chunk
// so the score loads of 8 cells spread over the bank groups), DF_TU chunks a thread.
#define DF_ROW (DF_MAXD / 8 + 1)
#define DF_TU (2 * DF_SUB * (DF_MAXD / 8) / DA_THREADS)

// Loads (into registers) of the tile of cells [s0, s0 + nc) of K and V head kvh (the head's
// n8 chunks at byte hoff of each row), leaving out cell `skip`: the thread's chunk i = tid +
// u * DA_THREADS is (K or V, cell, chunk) = (i / (DF_SUB * 16), i / 16 % DF_SUB, i % 16).
__device__ __forceinline__ void df_tile_load(uint4 (&r)[DF_TU], const u8* kb, const u8* vb,
                                             long row_bytes, long hoff, int s0, int nc, int n8,
                                             int skip) {
#pragma unroll
    for (int u = 0; u < DF_TU; ++u) {
        const int i = threadIdx.x + u * DA_THREADS;
        const int cell = i / (DF_MAXD / 8) % DF_SUB, j = i % (DF_MAXD / 8);
        const u8* base = i < DF_SUB * (DF_MAXD / 8) ? kb : vb;
        if (cell < nc && j < n8 && s0 + cell != skip)
            r[u] = *(const uint4*)(base + (long)(s0 + cell) * row_bytes + hoff + j * 16);
    }
}
// ... and their stores into the tile (the same chunks).
__device__ __forceinline__ void df_tile_store(const uint4 (&r)[DF_TU], uint4 (*kt)[DF_ROW],
                                              uint4 (*vt)[DF_ROW], int s0, int nc, int n8,
                                              int skip) {
#pragma unroll
    for (int u = 0; u < DF_TU; ++u) {
        const int i = threadIdx.x + u * DA_THREADS;
        const int cell = i / (DF_MAXD / 8) % DF_SUB, j = i % (DF_MAXD / 8);
        if (cell < nc && j < n8 && s0 + cell != skip)
            (i < DF_SUB * (DF_MAXD / 8) ? kt : vt)[cell][j] = r[u];
    }
}

// Cells per split of dq_attn_fused: the context over n_split splits, at least min_chunk, in
// multiples of 16 (a split of 16 cells fills half a tile). On the H200 at a 600-cell context
// splits of at least 32 cells (the engine's default) beat 16 and 64: 243 against 235 and 224
// tok/s decode.
__device__ __forceinline__ int df_chunk(int ctx, int n_split, int min_chunk) {
    const int per = max((ctx + n_split - 1) / n_split, min_chunk);
    return (per + 15) / 16 * 16;
}

// dst[0..hd) = RoPE(RMSNorm(src) * w) * mul by the calling warp (st_head_norm_rope's
// arithmetic, then the factor mul): the warp's writes to dst are visible to it on return.
__device__ __forceinline__ void df_warp_norm_rope(const float* src, float* dst, const float* w,
                                                  float eps, float p, const float* inv_freq,
                                                  float attn_factor, int hd, int n_rot,
                                                  float mul) {
    const int lane = threadIdx.x % ST_WARP;
    float ss = 0.0f;
    for (int i = lane; i < hd; i += ST_WARP) {
        const float v = src[i];
        dst[i] = v;
        ss += v * v;
    }
    ss = st_warp_sum(ss);
    if (w) {
        const float r = 1.0f / sqrtf(ss / (float)hd + eps);
        for (int i = lane; i < hd; i += ST_WARP) dst[i] = w[i] * (dst[i] * r);
    }
    ST_SYNCWARP();
    const int half = n_rot / 2;
    for (int i = lane; i < half; i += ST_WARP) {
        float s, c;
        sincosf(inv_freq[i] * p, &s, &c);
        c *= attn_factor;
        s *= attn_factor;
        const float a = dst[i], b = dst[i + half];
        const float x0 = a * c - b * s, x1 = b * c + a * s;
        dst[i] = x0 * mul;
        dst[i + half] = x1 * mul;
    }
    if (mul != 1.0f)
        for (int i = n_rot + lane; i < hd; i += ST_WARP) dst[i] *= mul;
    ST_SYNCWARP();
}

ST_KERNEL void dq_attn_fused(const float* q, const float* k, const float* v, const float* q_norm,
                             const float* k_norm, float eps, const int* pos,
                             const float* inv_freq, float attn_factor, int n_head,
                             int n_head_kv, int hd, int n_rot, u8* kv, const int* slot,
                             long slot_bytes, long k_off, long v_off, long row_bytes,
                             float scale, int min_chunk, float* part_o, float* part_ms,
                             unsigned* cnt, float* out) {
    __shared__ __align__(16) float qs[DA_MAXG * DF_MAXD];
    __shared__ __align__(16) uint4 kt[DF_SUB][DF_ROW], vt[DF_SUB][DF_ROW];
    __shared__ float ps[DA_MAXG][DF_SUB + 1];  // + 1: the P.V groups read different rows
    __shared__ float kn[DF_MAXD];
    __shared__ float ml[DA_MAXG][2], cf[DA_MAXG];
    __shared__ int last;
    const int kvh = blockIdx.x, sp = blockIdx.y, t = blockIdx.z, n_split = gridDim.y;
    const int G = n_head / n_head_kv;
    const int lane = threadIdx.x % ST_WARP, warp = threadIdx.x / ST_WARP;
    const int n_warps = DA_THREADS / ST_WARP;
    const int n8 = hd / 8;
    // pos and slot are step inputs, uploaded before the step began.
    const int p = pos[t], ctx = p + 1;
    const int chunk = df_chunk(ctx, n_split, min_chunk);
    const int used = (ctx + chunk - 1) / chunk;
    const int c0 = sp * chunk, c1 = min(c0 + chunk, ctx);
    u8* kb = kv + (long)slot[t] * slot_bytes + k_off;
    u8* vb = kv + (long)slot[t] * slot_bytes + v_off;
    const long hoff = (long)kvh * hd * 2;  // F16: the head's bytes in a row
    // The first tile's cells of earlier steps, loaded while the kernel ahead finishes (earlier
    // steps wrote them); the rest of the split only asked of L2.
    uint4 pre[DF_TU];
    if (c0 < ctx) df_tile_load(pre, kb, vb, row_bytes, hoff, c0, min(DF_SUB, c1 - c0), n8, p);
    for (int c = c0 + DF_SUB + warp; c < min(c1, p); c += n_warps) {
        st_prefetch_l2(kb + (long)c * row_bytes + hoff, hd * 2);
        st_prefetch_l2(vb + (long)c * row_bytes + hoff, hd * 2);
    }
    st_pdl_enter();
    if (c0 >= ctx) return;
    df_tile_store(pre, kt, vt, c0, min(DF_SUB, c1 - c0), n8, p);
    for (int g = warp; g < G; g += n_warps)
        df_warp_norm_rope(q + ((long)t * n_head + (long)kvh * G + g) * hd, qs + g * hd, q_norm,
                          eps, (float)p, inv_freq, attn_factor, hd, n_rot, scale);
    if (c1 == ctx) {
        // This split holds the step's own cell: K normalised and rotated, K and V stored, and
        // when the first tile holds the cell, its row read back into the tile (the block's
        // own stores, visible to it after the barrier).
        if (warp == n_warps - 1)
            df_warp_norm_rope(k + ((long)t * n_head_kv + kvh) * hd, kn, k_norm, eps, (float)p,
                              inv_freq, attn_factor, hd, n_rot, 1.0f);
        __syncthreads();
        u8* cell = kv + (long)slot[t] * slot_bytes + (long)p * row_bytes;
        dq_store_seg(kn, cell + k_off, ST_TY_F16, kvh * hd, hd);
        dq_store_seg(v + ((long)t * n_head_kv + kvh) * hd, cell + v_off, ST_TY_F16, kvh * hd, hd);
        __syncthreads();
        if (p < c0 + DF_SUB && threadIdx.x < 2 * n8) {
            const int j = threadIdx.x % n8;
            const bool is_v = threadIdx.x >= n8;
            (is_v ? vt : kt)[p - c0][j] =
                *(const uint4*)((is_v ? vb : kb) + (long)p * row_bytes + hoff + j * 16);
        }
    }
    if (threadIdx.x < G) {
        ml[threadIdx.x][0] = ST_NEG_INF;
        ml[threadIdx.x][1] = 0.0f;
    }
    __syncthreads();
    // Scores: DF_TPC threads per cell, 8 dims (one 16-byte chunk) at a time.
    const int cc = threadIdx.x / DF_TPC, part = threadIdx.x % DF_TPC;
    // P.V: 128 / G threads per head, 8 dims each at a time.
    const int tph = DA_THREADS / G, pg = threadIdx.x / tph, pj = threadIdx.x % tph;
    float acc[2][8];
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[u][i] = 0.0f;
    for (int s0 = c0; s0 < c1; s0 += DF_SUB) {
        const int nc = min(DF_SUB, c1 - s0);
        if (s0 > c0) {
            // Later tiles (long contexts): loaded now, the step's own cell included.
            uint4 r[DF_TU];
            df_tile_load(r, kb, vb, row_bytes, hoff, s0, nc, n8, -1);
            df_tile_store(r, kt, vt, s0, nc, n8, -1);
            __syncthreads();
        }
        float kf[DF_K8][8];
        if (cc < nc) {
#pragma unroll
            for (int u = 0; u < DF_K8; ++u) {
                const int j = part + u * DF_TPC;
                const uint4 raw = j < n8 ? kt[cc][j] : make_uint4(0, 0, 0, 0);
                const u32 pk[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    kf[u][2 * e] = st_h2f((u16)(pk[e] & 0xffff));
                    kf[u][2 * e + 1] = st_h2f((u16)(pk[e] >> 16));
                }
            }
        }
        for (int g = 0; g < G; ++g) {
            float s = 0.0f;
            if (cc < nc) {
#pragma unroll
                for (int u = 0; u < DF_K8; ++u) {
                    const int j = part + u * DF_TPC;
                    if (j < n8) {
                        const float4 a = *(const float4*)(qs + g * hd + j * 8);
                        const float4 b = *(const float4*)(qs + g * hd + j * 8 + 4);
                        s += a.x * kf[u][0] + a.y * kf[u][1] + a.z * kf[u][2] + a.w * kf[u][3] +
                             b.x * kf[u][4] + b.y * kf[u][5] + b.z * kf[u][6] + b.w * kf[u][7];
                    }
                }
            }
#pragma unroll
            for (int o = DF_TPC / 2; o > 0; o >>= 1) s += ST_SHFL_XOR(s, o);
            if (part == 0) ps[g][cc] = cc < nc ? s : ST_NEG_INF;
        }
        __syncthreads();
        // Online softmax: one warp per head, one cell per lane.
        for (int g = warp; g < G; g += n_warps) da_softmax_step(ps[g], DF_SUB, ml[g], cf + g);
        __syncthreads();
        // P.V: this thread's head pg, dims [8j, 8j + 8) for j = pj, pj + tph (at most two).
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int j = pj + u * tph;
            if (j < n8) {
                const float c = cf[pg];
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[u][i] *= c;
#pragma unroll 4
                for (int cl = 0; cl < nc; ++cl) {
                    const uint4 raw = vt[cl][j];
                    const float pv = ps[pg][cl];
                    const u32 pk[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        acc[u][2 * e] += pv * st_h2f((u16)(pk[e] & 0xffff));
                        acc[u][2 * e + 1] += pv * st_h2f((u16)(pk[e] >> 16));
                    }
                }
            }
        }
        __syncthreads();
    }
    const long head = (long)t * n_head + (long)kvh * G + pg;
    if (used == 1) {
        const float inv = 1.0f / ml[pg][1];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int j = pj + u * tph;
            if (j < n8)
#pragma unroll
                for (int i = 0; i < 8; ++i) out[head * hd + j * 8 + i] = acc[u][i] * inv;
        }
        return;
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int j = pj + u * tph;
        if (j < n8)
#pragma unroll
            for (int i = 0; i < 8; ++i) part_o[(head * n_split + sp) * hd + j * 8 + i] = acc[u][i];
    }
    if (threadIdx.x < G) {
        const long sl = ((long)t * n_head + (long)kvh * G + threadIdx.x) * n_split + sp;
        part_ms[sl * 2] = ml[threadIdx.x][0];
        part_ms[sl * 2 + 1] = ml[threadIdx.x][1];
    }
    __threadfence();  // this split's part is visible before the count says so
    __syncthreads();
    unsigned* c = cnt + (long)t * n_head_kv + kvh;
    if (threadIdx.x == 0) last = atomicAdd(c, 1u) == (unsigned)(used - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (threadIdx.x == 0) *c = 0;
    // The merge: weights exp(m_s - M) per head and split into qs (free now), the sums into ml.
    float* w = qs;
    for (int g = warp; g < G; g += n_warps) {
        const long base = ((long)t * n_head + (long)kvh * G + g) * n_split;
        float m = ST_NEG_INF;
        for (int s = lane; s < used; s += ST_WARP) m = fmaxf(m, st_ldcg(part_ms + (base + s) * 2));
        m = st_warp_max(m);
        float l = 0.0f;
        for (int s = lane; s < used; s += ST_WARP) {
            const float e = expf(st_ldcg(part_ms + (base + s) * 2) - m);
            w[g * DA_MAX_SPLIT + s] = e;
            l += e * st_ldcg(part_ms + (base + s) * 2 + 1);
        }
        l = st_warp_sum(l);
        if (lane == 0) ml[g][1] = l;
    }
    __syncthreads();
    const float inv = 1.0f / ml[pg][1];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int j = pj + u * tph;
        if (j < n8) {
            float o[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = 0.0f;
#pragma unroll 4
            for (int s = 0; s < used; ++s) {
                const float ws = w[pg * DA_MAX_SPLIT + s];
                const float4* src = (const float4*)(part_o + (head * n_split + s) * hd + j * 8);
                const float4 a = st_ldcg(src), b = st_ldcg(src + 1);
                o[0] += ws * a.x; o[1] += ws * a.y; o[2] += ws * a.z; o[3] += ws * a.w;
                o[4] += ws * b.x; o[5] += ws * b.y; o[6] += ws * b.z; o[7] += ws * b.w;
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) out[head * hd + j * 8 + i] = o[i] * inv;
        }
    }
}

// Step inputs derived on the device: n_ctx[t] = pos[t] + 1.
ST_KERNEL void dq_ctx_from_pos(const int* pos, int* n_ctx, int n_tok) {
    st_pdl_enter();
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n_tok) n_ctx[t] = pos[t] + 1;
}

// Prefill attention, flash style (no score matrix): the n_tok query tokens all belong to the
// slot slot[0] and are already in its KV; query t sees cells [0, pos[t]]. K and V tiles of kt
// cells are dequantized into shared memory once per block and shared by its PF_Q queries;
// each warp keeps its queries' running max, sum and output in registers.
// grid: (n_head, ceil(n_tok / PF_Q)); block: PF_WARPS warps;
// dynamic shared: (2 * kt * (hd + 1) + PF_Q * hd) floats; kt <= 32, hd <= ATT_MAX_D.
#define PF_WARPS 4
ST_KERNEL void dq_attn_prefill(const float* q, const u8* kv, const int* slot, const int* pos,
                               long slot_bytes, long k_off, long v_off, int kv_ty, int n_head,
                               int n_head_kv, int hd, long row_bytes, float scale, int kt,
                               int n_tok, float* out, const ST_GRID_CONST KvHost kh) {
    st_pdl_enter();
    extern __shared__ float sm[];
    const int ld = hd + 1;
    float* ks = sm;
    float* vs = ks + kt * ld;
    float* qs = vs + kt * ld;
    const int h = blockIdx.x, t0 = blockIdx.y * PF_Q;
    const int lane = threadIdx.x % ST_WARP, warp = threadIdx.x / ST_WARP;
    const int kvh = h / (n_head / n_head_kv);
    const u8* kb = kv + (long)slot[0] * slot_bytes + k_off;
    const u8* vb = kv + (long)slot[0] * slot_bytes + v_off;
    int cmax = 0;
    for (int i = 0; i < PF_Q && t0 + i < n_tok; ++i) cmax = max(cmax, pos[t0 + i] + 1);
    for (int i = threadIdx.x; i < PF_Q * hd; i += blockDim.x) {
        const int qi = i / hd, d = i % hd;
        qs[i] = t0 + qi < n_tok ? q[((long)(t0 + qi) * n_head + h) * hd + d] : 0.0f;
    }
    constexpr int PER = ATT_MAX_D / ST_WARP;
    constexpr int QW = PF_Q / PF_WARPS;
    float m[QW], l[QW], acc[QW][PER];
    int ctx[QW];
#pragma unroll
    for (int a = 0; a < QW; ++a) {
        m[a] = ST_NEG_INF;
        l[a] = 0.0f;
        const int t = t0 + warp + a * PF_WARPS;
        ctx[a] = t < n_tok ? pos[t] + 1 : 0;
#pragma unroll
        for (int i = 0; i < PER; ++i) acc[a][i] = 0.0f;
    }
    for (int c0 = 0; c0 < cmax; c0 += kt) {
        __syncthreads();
        for (int i = threadIdx.x; i < kt * hd; i += blockDim.x) {
            const int c = i / hd, d = i % hd;
            float kvk = 0.0f, kvv = 0.0f;
            if (c0 + c < cmax) {
                const int s = slot[0];
                kvk = att_elem(kvh_row(kb, row_bytes, kh, s, c0 + c, kh.k_off), kv_ty, kvh * hd + d);
                kvv = att_elem(kvh_row(vb, row_bytes, kh, s, c0 + c, kh.v_off), kv_ty, kvh * hd + d);
            }
            ks[c * ld + d] = kvk;
            vs[c * ld + d] = kvv;
        }
        __syncthreads();
#pragma unroll
        for (int a = 0; a < QW; ++a) {
            if (c0 >= ctx[a]) continue;
            const float* qr = qs + (warp + a * PF_WARPS) * hd;
            const int c = c0 + lane;
            float s = ST_NEG_INF;
            if (lane < kt && c < ctx[a]) {
                float dot = 0.0f;
                for (int d = 0; d < hd; ++d) dot += qr[d] * ks[lane * ld + d];
                s = dot * scale;
            }
            const float nm = fmaxf(m[a], st_warp_max(s));
            const float corr = expf(m[a] - nm);
            const float p = s == ST_NEG_INF ? 0.0f : expf(s - nm);
            l[a] = l[a] * corr + st_warp_sum(p);
            m[a] = nm;
#pragma unroll
            for (int i = 0; i < PER; ++i) acc[a][i] *= corr;
            for (int j = 0; j < kt; ++j) {
                const float pj = ST_SHFL(p, j);
#pragma unroll
                for (int i = 0; i < PER; ++i) {
                    const int d = lane + i * ST_WARP;
                    if (d < hd) acc[a][i] += pj * vs[j * ld + d];
                }
            }
        }
    }
#pragma unroll
    for (int a = 0; a < QW; ++a) {
        const int t = t0 + warp + a * PF_WARPS;
        if (t >= n_tok) continue;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int d = lane + i * ST_WARP;
            if (d < hd) out[((long)t * n_head + h) * hd + d] = acc[a][i] / l[a];
        }
    }
}
