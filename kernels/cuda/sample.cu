// sample.cu: token picks on the device — the greedy argmax of each row (dq_argmax_rows), and
// sampling (temperature, top-k, top-p), step for step the
// host's executor/src/sampler.rs `sample_into`: thresholds on the logits' order keys found by
// radix selection (the top-k one by counts, the top-p one by fixed-point softmax mass), then
// the Gumbel-max pick among the kept tokens with noise hashed from the draw's key and the id,
// that last pass split over the row's blocks and merged by the last block to finish.
// Invariant: the same f32 and integer arithmetic as the host in the same order (no fused
// multiply-adds in the scores, integer mass sums that no order can change), so host and
// device differ only where an exp/log last-place difference moves a near-tie; greedy draws
// (temperature <= 0 or NaN) and rows without a finite logit give exactly `sampler::argmax`;
// a row holding NaN or +inf gives ST_NON_FINITE (sampler::NON_FINITE), as the host's
// row-level pickers do; the per-row counters are zero again after every launch.
// Row processing (executor/src/pick.rs's RowProc, in the plan's `sample_proc` buffer, one
// SpProc row a slot): sp_edits writes each row's sparse edits into its logits first; the pick
// kernels then read the row's token mask (a disallowed token is -inf) and its min_p cut (a
// token below max + min_p_off is dropped) as they scan. Soundness (NaN, +inf) is judged before
// the mask, as RowProc::pick does on the host.

#define SP_HISTS 8  // histograms in shared memory, one per four warps
#define SP_BINS 256
#define SP_NONE 0x7fffffff
// sampler::NON_FINITE (u32::MAX - 1) as the int the pickers write.
#define ST_NON_FINITE ((int)0xfffffffe)

// sampler.rs's Draw (32 bytes).
struct SampleDraw {
    float temperature;
    u32 top_k;
    float top_p;
    u32 pad;
    unsigned long long key;
    unsigned long long pad2;
};

// pick.rs's RowProc as one row of the `sample_proc` buffer (u32 words): the header {flags,
// edit count, min_p offset's bits, 0}, then the mask words (bit i % 32 of word i / 32; a row
// of `vocab` tokens has sp_mask_words(vocab) of them, a multiple of four), then the edits.
#define SP_PROC_MASK 1u
#define SP_PROC_MIN_P 2u
struct SpEdit {  // pick.rs's Edit
    u32 id;
    float bias;
    float rep;
    float pen;
};
__device__ __forceinline__ long sp_mask_words(int vocab) { return ((long)vocab + 127) / 128 * 4; }
// The mask of row r (nullptr when it has none), or of no row at all when `proc` is nullptr.
__device__ __forceinline__ const u32* sp_row_mask(const u32* proc, long proc_words, int r) {
    if (!proc) return nullptr;
    const u32* p = proc + (long)r * proc_words;
    return (p[0] & SP_PROC_MASK) ? p + 4 : nullptr;
}
__device__ __forceinline__ bool sp_masked(const u32* mk, int i) {
    return mk && !((mk[i >> 5] >> (i & 31)) & 1u);
}

// Each row's edits written into its logits (pick.rs's Edit::apply, the same f32 operations
// in the same order; ids are distinct within a row, ids >= vocab skipped), before the pick
// kernels. grid: rows; block: 256.
ST_KERNEL void sp_edits(float* logits, int vocab, const u32* __restrict__ proc, long proc_words) {
    const int r = blockIdx.x;
    const u32* p = proc + (long)r * proc_words;
    const u32 n = p[1];
    const SpEdit* e = (const SpEdit*)(p + 4 + sp_mask_words(vocab));
    float* row = logits + (long)r * vocab;
    for (u32 j = threadIdx.x; j < n; j += blockDim.x) {
        const SpEdit ed = e[j];
        if (ed.id >= (u32)vocab) continue;
        float v = __fadd_rn(row[ed.id], ed.bias);
        v = v > 0.0f ? __fdiv_rn(v, ed.rep) : __fmul_rn(v, ed.rep);
        row[ed.id] = __fsub_rn(v, ed.pen);
    }
}

// sampler::order_key: u32 order = the floats' total order.
__device__ __forceinline__ u32 sp_key(float v) {
    const u32 u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float sp_from_key(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
__device__ __forceinline__ bool sp_finite(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}

// sampler::gumbel.
__device__ __forceinline__ float sp_gumbel(unsigned long long key, u32 i) {
    unsigned long long z = key + ((unsigned long long)i + 1ull) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float v = __fmul_rn(__ull2float_rn((z >> 11) | 1ull), 1.0f / 9007199254740992.0f);
    return -logf(-log1pf(-v));
}

// sampler::mass: the fixed-point weight exp((v - mx) / t) * 2^32.
__device__ __forceinline__ unsigned long long sp_mass(float v, float mx, float t) {
    return (unsigned long long)__fmul_rn(expf(__fdiv_rn(__fsub_rn(v, mx), t)), 4294967296.0f);
}

// sampler::argmax's pair rule: the larger value, the lower index on ties.
__device__ __forceinline__ void sp_take(float& bv, int& bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) {
        bv = v;
        bi = i;
    }
}

// The block's best pair, in every thread.
__device__ __forceinline__ void sp_best(float& bv, int& bi, float* sv, int* si) {
    const int lane = threadIdx.x % ST_WARP, warp = threadIdx.x / ST_WARP;
#pragma unroll
    for (int o = ST_WARP / 2; o > 0; o >>= 1) {
        const float ov = ST_SHFL_XOR(bv, o);
        const int oi = ST_SHFL_XOR(bi, o);
        sp_take(bv, bi, ov, oi);
    }
    __syncthreads();
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    bv = ST_NEG_INF;
    bi = SP_NONE;
    for (int w = 0; w < (int)(blockDim.x / ST_WARP); ++w) sp_take(bv, bi, sv[w], si[w]);
}

// Block sum of a u64, in every thread (`red` holds 32).
__device__ __forceinline__ unsigned long long sp_sum(unsigned long long v,
                                                     unsigned long long* red) {
    const int lane = threadIdx.x % ST_WARP, warp = threadIdx.x / ST_WARP;
#pragma unroll
    for (int o = ST_WARP / 2; o > 0; o >>= 1) v += ST_SHFL_XOR(v, o);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = 0;
    for (int w = 0; w < (int)(blockDim.x / ST_WARP); ++w) v += red[w];
    return v;
}

// Block max of a u32, in every thread.
__device__ __forceinline__ u32 sp_umax(u32 v, unsigned long long* red) {
    const int lane = threadIdx.x % ST_WARP, warp = threadIdx.x / ST_WARP;
#pragma unroll
    for (int o = ST_WARP / 2; o > 0; o >>= 1) v = max(v, (u32)ST_SHFL_XOR(v, o));
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = 0;
    for (int w = 0; w < (int)(blockDim.x / ST_WARP); ++w) v = max(v, (u32)red[w]);
    return v;
}

// Every element of row[lo, hi) through f(v, i, raw), SP_UNROLL loads in flight per thread
// (one load at a time leaves a block waiting out a round trip per element): `raw` the logit,
// `v` the same or -inf where the mask `mk` (nullptr: none) disallows it. Past-the-end
// elements come as NaN, which every caller skips. Warp w takes elements of the 32-wide chunks
// w, w + 32, w + 64, ... of the range.
#define SP_UNROLL 8
template <class F>
__device__ __forceinline__ void sp_scan(const float* row, const u32* mk, int lo, int hi, F f) {
    const int lane = threadIdx.x % ST_WARP, w0 = threadIdx.x - lane;
    const int step = blockDim.x * SP_UNROLL;
    for (int b0 = lo + w0; b0 < hi; b0 += step) {
        float v[SP_UNROLL];
        u32 off = 0;  // bit u: element u is masked out
#pragma unroll
        for (int u = 0; u < SP_UNROLL; ++u) {
            const int i = b0 + u * blockDim.x + lane;
            v[u] = i < hi ? row[i] : __int_as_float(0x7fc00000);
            if (i < hi && sp_masked(mk, i)) off |= 1u << u;
        }
#pragma unroll
        for (int u = 0; u < SP_UNROLL; ++u)
            f(((off >> u) & 1u) ? ST_NEG_INF : v[u], b0 + u * blockDim.x + lane, v[u]);
    }
}

// Histograms count in u32 (64-bit shared-memory atomics are compare-and-swap loops): a
// count is one part, a mass (at most 2^32) two parts of 16 bits. Each histogram takes the
// elements of every SP_HISTS-th warp, at most SP_MAX_VOCAB / SP_HISTS of them, so a part's
// sum stays below 2^32. (Summing a warp's lanes of the same bin first, with match_any or
// with rounds of ballots and warp reductions, measured 2.5-3x slower on an H200 than these
// plain atomics.)
#define SP_PARTS 2
typedef u32 SpHist[SP_HISTS][SP_PARTS][SP_BINS];

// h[.][bin] += w (a count, or a mass's parts when `by_mass`).
__device__ __forceinline__ void sp_hist_add(u32 (*h)[SP_BINS], u32 bin, unsigned long long w,
                                            bool by_mass) {
    if (!by_mass) {
        atomicAdd(&h[0][bin], 1u);
        return;
    }
    const u32 lo = (u32)(w & 0xffff), hi = (u32)(w >> 16);
    if (lo) atomicAdd(&h[0][bin], lo);
    if (hi) atomicAdd(&h[1][bin], hi);
}

// Radix selection, highest key first, over the finite logits with key >= lo: the key of the
// element at which the running total (of counts, or of masses when `by_mass`) first reaches
// `rem` (1 <= rem <= the total). Four passes of 8 bits, each a histogram of the candidates
// still matching the chosen high bits.
__device__ __forceinline__ u32 sp_select(const float* row, const u32* mk, int vocab, u32 lo,
                                         bool by_mass,
                                         float mx, float t, unsigned long long rem,
                                         SpHist& hist, unsigned long long* tot, u32* s_sel,
                                         unsigned long long* s_rem) {
    u32(*hw)[SP_BINS] = hist[(threadIdx.x / ST_WARP) % SP_HISTS];  // see sp_scan's element order
    u32 prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        u32* flat = &hist[0][0][0];
        for (int i = threadIdx.x; i < SP_HISTS * SP_PARTS * SP_BINS; i += blockDim.x) flat[i] = 0;
        __syncthreads();
        sp_scan(row, mk, 0, vocab, [&](float v, int, float) {
            const u32 k = sp_key(v);
            if (sp_finite(v) && k >= lo && (k & mask) == prefix)
                sp_hist_add(hw, (k >> shift) & 0xff, by_mass ? sp_mass(v, mx, t) : 1ull, by_mass);
        });
        __syncthreads();
        for (int b = threadIdx.x; b < SP_BINS; b += blockDim.x) {
            unsigned long long s = 0;
            for (int j = 0; j < SP_HISTS; ++j)
                s += (unsigned long long)hist[j][0][b] + ((unsigned long long)hist[j][1][b] << 16);
            tot[b] = s;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned long long cum = 0;
            u32 sel = 0;
            for (int b = SP_BINS - 1; b >= 0; --b) {
                if (cum + tot[b] >= rem) {
                    sel = (u32)b;
                    break;
                }
                cum += tot[b];
            }
            *s_sel = sel;
            *s_rem = rem - cum;
        }
        __syncthreads();
        prefix |= *s_sel << shift;
        mask |= 0xffu << shift;
        rem = *s_rem;
        __syncthreads();
    }
    return prefix;
}

// out[r] = the token of draws[r] from logits row r, processed by row r of `proc` (mask and
// min_p; nullptr: no processing; its edits already written by sp_edits). Every block of row r works out the row's
// statistics and thresholds itself (passes over the whole row, read from L2 in parallel by
// the row's blocks), then takes the Gumbel-max pick over its own 1/nb of the row (the costly
// pass: a hash and two logarithms an element) into (part_v, part_i)[r * nb + b]; the last
// block to finish (counted in cnt[r], which it resets to zero) merges the nb pairs.
// grid: (nb, rows); block: SP_THREADS; vocab <= SP_MAX_VOCAB. Launched after the step's
// graph, without PDL.
ST_KERNEL void sample_rows(const float* __restrict__ logits, int vocab,
                           const SampleDraw* __restrict__ draws, const u32* __restrict__ proc,
                           long proc_words, float* part_v, int* part_i, unsigned* cnt_done,
                           int* __restrict__ out) {
    __shared__ SpHist hist;
    __shared__ unsigned long long tot[SP_BINS];
    __shared__ unsigned long long red[32];
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ u32 s_sel;
    __shared__ unsigned long long s_rem;
    __shared__ int last;
    const int r = blockIdx.y, nb = gridDim.x;
    const float* row = logits + (long)r * vocab;
    const SampleDraw d = draws[r];
    const u32* mk = sp_row_mask(proc, proc_words, r);
    const u32 flags = proc ? proc[(long)r * proc_words] : 0u;

    // The argmax (the greedy pick and the fallback), the largest finite logit and their count.
    float bv = ST_NEG_INF;
    int bi = SP_NONE;
    u32 kmax = 0;
    unsigned long long cnt = 0;
    u32 unsound = 0;  // NaN or +inf seen (past-the-end NaNs carry i >= vocab)
    sp_scan(row, mk, 0, vocab, [&](float v, int i, float raw) {
        if (i < vocab && !sp_finite(raw) && !(raw < 0.0f)) unsound = 1;
        if (v > ST_NEG_INF) sp_take(bv, bi, v, i);
        if (sp_finite(v)) {
            kmax = max(kmax, sp_key(v));
            ++cnt;
        }
    });
    sp_best(bv, bi, sv, si);
    kmax = sp_umax(kmax, red);
    cnt = sp_sum(cnt, red);
    unsound = sp_umax(unsound, red);
    const int greedy_pick = bi == SP_NONE ? 0 : bi;
    const float t = d.temperature;
    if (unsound || !(t > 0.0f) || cnt == 0) {
        // The same in every block of the row: block 0 answers, no counting.
        if (threadIdx.x == 0 && blockIdx.x == 0) out[r] = unsound ? ST_NON_FINITE : greedy_pick;
        return;
    }
    const float mx = sp_from_key(kmax);
    u32 thr = 0;
    if (flags & SP_PROC_MIN_P) {
        // RowProc's `l < max + min_p_off` drops l: keep keys >= the cut's (either zero keeps
        // -0, which `<` does not drop), and count what is left.
        const float cut = __fadd_rn(mx, __uint_as_float(proc[(long)r * proc_words + 2]));
        thr = cut == 0.0f ? sp_key(-0.0f) : sp_key(cut);
        unsigned long long c = 0;
        sp_scan(row, mk, 0, vocab, [&](float v, int, float) {
            if (sp_finite(v) && sp_key(v) >= thr) ++c;
        });
        cnt = sp_sum(c, red);
        if (cnt == 0) {  // every token cut: the host's argmax of a row of -inf
            if (threadIdx.x == 0 && blockIdx.x == 0) out[r] = 0;
            return;
        }
    }
    if (d.top_k > 0 && (unsigned long long)d.top_k < cnt)
        thr = sp_select(row, mk, vocab, thr, false, mx, t, d.top_k, hist, tot, &s_sel, &s_rem);
    if (d.top_p < 1.0f) {
        unsigned long long m = 0;
        sp_scan(row, mk, 0, vocab, [&](float v, int, float) {
            if (sp_finite(v) && sp_key(v) >= thr) m += sp_mass(v, mx, t);
        });
        const unsigned long long total = sp_sum(m, red);
        const double want = ceil((double)fmaxf(d.top_p, 0.0f) * (double)total);
        unsigned long long target = (unsigned long long)want;
        target = min(max(target, 1ull), max(total, 1ull));
        thr = max(thr,
                  sp_select(row, mk, vocab, thr, true, mx, t, target, hist, tot, &s_sel, &s_rem));
    }
    // Gumbel-max among the kept, over this block's share of the row.
    const int per = (vocab + nb - 1) / nb;
    const int c0 = min(vocab, blockIdx.x * per), c1 = min(vocab, c0 + per);
    bv = ST_NEG_INF;
    bi = SP_NONE;
    sp_scan(row, mk, c0, c1, [&](float v, int i, float) {
        if (!sp_finite(v) || sp_key(v) < thr) return;
        const float s = __fadd_rn(__fdiv_rn(__fsub_rn(v, mx), t), sp_gumbel(d.key, (u32)i));
        sp_take(bv, bi, s, i);
    });
    sp_best(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        part_v[(long)r * nb + blockIdx.x] = bv;
        part_i[(long)r * nb + blockIdx.x] = bi;
        __threadfence();  // the pair is visible before the count says so
        last = atomicAdd(cnt_done + r, 1u) == (unsigned)(nb - 1);
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    bv = ST_NEG_INF;
    bi = SP_NONE;
    for (int b = threadIdx.x; b < nb; b += blockDim.x)
        sp_take(bv, bi, st_ldcg(part_v + (long)r * nb + b), st_ldcg(part_i + (long)r * nb + b));
    sp_best(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        out[r] = bi == SP_NONE ? greedy_pick : bi;
        cnt_done[r] = 0;
    }
}

// Greedy token choice on the device: out[r] = the index of the largest of x[r][0..cols)
// (lowest index on ties; a row holding NaN or +inf gives ST_NON_FINITE, a row of -inf alone
// gives 0, as sampler::argmax_rows on the host), among the tokens row r of `proc` allows
// (nullptr: every token; min_p never moves a greedy pick; the edits are sp_edits'). Block (b, r) reduces its slice of row r to a
// (value, index) pair in part_v / part_i[r * gridDim.x + b]; the last of row r's blocks to
// finish (counted in cnt[r], which it resets) reduces the row's pairs into out[r].
// grid: (blocks per row, rows); block: AM_THREADS.
#define AM_NONE 0x7fffffff
#define AM_BAD -1  // the pair of a slice holding NaN or +inf: wins every comparison
__device__ __forceinline__ void am_take(float& bv, int& bi, float v, int i) {
    if (bi == AM_BAD) return;
    if (i == AM_BAD || v > bv || (v == bv && i < bi)) {
        bv = v;
        bi = i;
    }
}
// The block's best pair, in thread 0 (every thread calls it).
__device__ __forceinline__ void am_block(float& bv, int& bi, float* sv, int* si) {
    const int lane = threadIdx.x % ST_WARP, warp = threadIdx.x / ST_WARP;
#pragma unroll
    for (int o = ST_WARP / 2; o > 0; o >>= 1) {
        const float ov = ST_SHFL_XOR(bv, o);
        const int oi = ST_SHFL_XOR(bi, o);
        am_take(bv, bi, ov, oi);
    }
    __syncthreads();  // sv / si free (a previous call's readers are done)
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x / ST_WARP;
        bv = lane < nw ? sv[lane] : ST_NEG_INF;
        bi = lane < nw ? si[lane] : AM_NONE;
#pragma unroll
        for (int o = ST_WARP / 2; o > 0; o >>= 1) {
            const float ov = ST_SHFL_XOR(bv, o);
            const int oi = ST_SHFL_XOR(bi, o);
            am_take(bv, bi, ov, oi);
        }
    }
}
ST_KERNEL void dq_argmax_rows(const float* x, int cols, const u32* proc, long proc_words,
                              float* part_v, int* part_i, unsigned* cnt, int* out) {
    st_pdl_enter();
    __shared__ float sv[AM_THREADS / 32];
    __shared__ int si[AM_THREADS / 32];
    __shared__ int last;
    const int r = blockIdx.y, nb = gridDim.x;
    const long per = ((long)cols + nb - 1) / nb;
    const long c0 = (long)blockIdx.x * per, c1 = min((long)cols, c0 + per);
    const float* row = x + (long)r * cols;
    const u32* mk = sp_row_mask(proc, proc_words, r);
    float bv = ST_NEG_INF;
    int bi = AM_NONE;
    for (long c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
        const float v = row[c];
        if (!(v < __int_as_float(0x7f800000)) && !(v == ST_NEG_INF)) {
            am_take(bv, bi, v, AM_BAD);  // NaN or +inf
        } else if (sp_masked(mk, (int)c)) {
            // disallowed: -inf, never picked
        } else if (v > ST_NEG_INF) {
            am_take(bv, bi, v, (int)c);
        }
    }
    am_block(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        part_v[(long)r * nb + blockIdx.x] = bv;
        part_i[(long)r * nb + blockIdx.x] = bi;
        __threadfence();  // the pair is visible before the count says so
        last = atomicAdd(cnt + r, 1u) == (unsigned)(nb - 1);
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    bv = ST_NEG_INF;
    bi = AM_NONE;
    for (int b = threadIdx.x; b < nb; b += blockDim.x)
        am_take(bv, bi, st_ldcg(part_v + (long)r * nb + b), st_ldcg(part_i + (long)r * nb + b));
    am_block(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        out[r] = bi == AM_BAD ? ST_NON_FINITE : (bi == AM_NONE ? 0 : bi);
        cnt[r] = 0;
    }
}
