// gemm.cu: prefill matrix-matrix products on the tensor cores (mma.sync m16n8k16 through
// inline PTX, f32 accumulate): Y[t][r] = W_r . X[t] for W in the Q8_0 split device layout
// (quants then f16 scales, see executor/src/backend/cuda/layout.rs), Q4_K in the GGUF layout
// (144-byte blocks of 256 columns: f16 d, f16 dmin, 12 bytes of packed 6-bit scales and mins,
// 128 bytes of nibbles; cols a multiple of 256), BF16 row-major, or any other ggml type in
// the GGUF layout (GM_ANY: decoded to f16 by quants.cuh as each stage is loaded; IQ3_S,
// Q6_K, Q5_K and IQ4_XS by default through the pipelined loader GmPipe below), X converted
// once to f16 (quantized weights) or bf16 (BF16 weights) by gemm_cvt_x, Y f32; Q8_0 and Q4_K
// weights are dequantized to f16 in registers from the pipeline stage in shared memory. And the grouped
// MoE form: moe_sort (counting sort of the router's choices into per-expert tiles, all on the
// device) then moe_gemm over the tile list, gathering X rows and scattering Y rows.
// Invariant: rows past `rows`, tokens past a tile's count and columns past `cols` are never
// read from global memory (cp.async zero-fills them; GmPipe's aligned words may reach up to
// 3 bytes past a field, inside its block) nor written; every launch has fixed
// arguments (the MoE grid is sized by a host upper bound; surplus CTAs exit), so a CUDA graph
// can capture it. CUDA only (the mma and cp.async PTX have no HIP counterpart here).

#ifdef ST_CUDA

// GM_BN tokens per CTA tile, GM_BK columns per pipeline stage, GM_STAGES-deep cp.async
// pipeline: from the generated prelude.
#define GM_Q8_WSTRIDE 80   // bytes per W row in shared memory (64 int8 + pad: no bank conflicts)
#define GM_H_STRIDE 160    // bytes per row of 64 16-bit values (128 + pad)
// Q4_K: bytes per W row in shared memory: the block's 16-byte header (d, dmin, scales), then
// the stage's 32 bytes of nibbles (12 words apart: the 8 rows x 4 words a warp reads at once
// fall in 32 distinct banks).
#define GM_Q4_WSTRIDE 48
#define GM_Q4K_BLOCK 144   // bytes per Q4_K block of 256 columns

// Weight types of the templates. GM_ANY: every other ggml type (its GGUF id `gt` passed at
// run time), decoded 32 columns at a time by quants.cuh into f16 in shared memory.
#define GM_BF16 0
#define GM_Q8 1
#define GM_Q4K 2
#define GM_ANY 3

__device__ __forceinline__ u32 gm_smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global -> shared; only `src_bytes` (0 or 16) are read, the rest zero-filled.
__device__ __forceinline__ void gm_cp16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(gm_smem_addr(dst)),
                 "l"(src), "r"(src_bytes));
}

// 4 bytes global -> shared; `src_bytes` of 0, 2 or 4 read, the rest zero-filled.
__device__ __forceinline__ void gm_cp4(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(gm_smem_addr(dst)),
                 "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void gm_commit() { asm volatile("cp.async.commit_group;\n" ::); }

__device__ __forceinline__ void gm_wait_stages() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(GM_STAGES - 2));
}

// Four int8 quants (one 32-bit word) times the f16 scale `d` -> two f16x2 registers:
// lo = (q0, q1) * d, hi = (q2, q3) * d. Exact int -> f16 via the 1024 + u magic, then one
// rounding in the multiply.
__device__ __forceinline__ void gm_dq4(u32 w, u32 d2, u32& lo, u32& hi) {
    const u32 u = w ^ 0x80808080u;
    u32 a = __byte_perm(u, 0x64646464u, 0x4140);
    u32 b = __byte_perm(u, 0x64646464u, 0x4342);
    asm("sub.f16x2 %0, %0, %1;" : "+r"(a) : "r"(0x64806480u));
    asm("sub.f16x2 %0, %0, %1;" : "+r"(b) : "r"(0x64806480u));
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(lo) : "r"(a), "r"(d2));
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(hi) : "r"(b), "r"(d2));
}

// Four Q4_K nibbles (the low (hi == 0) or high halves of one 32-bit word of quants) times
// the sub-block's (d * sc, -dmin * m) pair `sm` -> two f16x2 registers (lo = columns 0, 1,
// hi = columns 2, 3): q exact via the 1024 + q magic, then one fma rounding.
__device__ __forceinline__ void gm_dq4k(u32 w, int hi, u32 sm, u32& lo, u32& h) {
    const u32 q = hi ? (w >> 4) & 0x0f0f0f0fu : w & 0x0f0f0f0fu;
    u32 a = __byte_perm(q, 0x64646464u, 0x4140);
    u32 b = __byte_perm(q, 0x64646464u, 0x4342);
    asm("sub.f16x2 %0, %0, %1;" : "+r"(a) : "r"(0x64006400u));
    asm("sub.f16x2 %0, %0, %1;" : "+r"(b) : "r"(0x64006400u));
    const u32 s2 = __byte_perm(sm, 0, 0x1010), m2 = __byte_perm(sm, 0, 0x3232);
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(lo) : "r"(a), "r"(s2), "r"(m2));
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(h) : "r"(b), "r"(s2), "r"(m2));
}

// A Q4_K block header (h.x = d | dmin << 16, h.y..h.w the 12 scale bytes) -> the f16x2 pairs
// (d * sc[j], -dmin * m[j]) of sub-blocks j = 2c (s0) and 2c + 1 (s1), c the 64-column chunk;
// the 6-bit unpacking of ggml's get_scale_min_k4 done four bytes at a time. sc and m are
// exact in f16, so each product is rounded once.
__device__ __forceinline__ void gm_q4k_scales(uint4 h, int c, u32& s0, u32& s1) {
    u32 sc, mn;  // bytes: scales / mins of sub-blocks 0..3 (c < 2) or 4..7
    if (c < 2) {
        sc = h.y & 0x3f3f3f3fu;
        mn = h.z & 0x3f3f3f3fu;
    } else {
        sc = (h.w & 0x0f0f0f0fu) | ((h.y >> 2) & 0x30303030u);
        mn = ((h.w >> 4) & 0x0f0f0f0fu) | ((h.z >> 2) & 0x30303030u);
    }
    // [sc_j, mn_j, sc_j+1, mn_j+1] for j = 2c mod 4.
    const u32 p = __byte_perm(sc, mn, (c & 1) ? 0x7362 : 0x5140);
    u32 a = __byte_perm(p, 0x64646464u, 0x4140);
    u32 b = __byte_perm(p, 0x64646464u, 0x4342);
    asm("sub.f16x2 %0, %0, %1;" : "+r"(a) : "r"(0x64006400u));
    asm("sub.f16x2 %0, %0, %1;" : "+r"(b) : "r"(0x64006400u));
    const u32 dd = h.x ^ 0x80000000u;  // (d, -dmin)
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(s0) : "r"(a), "r"(dd));
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(s1) : "r"(b), "r"(dd));
}

// f16 operands (Q8_0 and Q4_K weights) or bf16 (BF16 weights).
template <bool F16>
__device__ __forceinline__ void gm_mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if (F16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// ---- The pipelined any-type loader (GM_ANY with a type fixed at compile time) ----
// The synchronous GM_ANY loader decodes each stage straight from global memory inside the
// stage's load (quants.cuh's run-time switch, its 32 values through local memory for the
// out-of-line types), so every stage waits on dependent global-load latency while the
// cp.async pipeline covers only X. For the types llama.cpp's mixes use (IQ3_S, Q6_K, Q5_K,
// IQ4_XS) the tiles below take the type as a template argument QT and split the load: each
// thread holds the raw bytes of its groups of the next stage in registers (GmRaw<QT>::fetch,
// vector loads where the block alignment allows), decodes them to f16 into shared memory
// (GmRaw<QT>::decode) after the current stage's mmas, and at once fetches the stage after:
// at the end of iteration kt it stores stage kt + 1 and fetches stage kt + 2, so those loads
// are in flight across the barrier and stage kt + 1's mmas, one stage's raw bytes live at a
// time, and the 32 values stay in registers. W is double-buffered (stage kt + 1's decode
// writes the buffer stage kt - 1 was read from; the barrier at the top of each iteration
// orders both), which with X's GM_STAGES cp.async slots takes 70 KiB of the fused M64 tile's
// shared memory instead of 90 (three CTAs a multiprocessor instead of two, at the ~160
// registers ptxas gives these tiles). n-fragments wholly past a tile's tokens skip their mmas
// (~10 tokens an expert at the 80B's pp512 fill one or two of eight). The decoders read
// registers but are quants.cuh's qt_group32_block_inl formulas operation for operation (the
// same __fmul_rn / __fsub_rn in the same order, the same tables; small integers become floats
// by a byte permute and an add, gm_b2f, exactly as a conversion would, and two values share
// one cvt.rn.f16x2.f32: conversions run at a quarter of the adds' rate and were two of every
// value's ~7 instructions), so every f16 equals the synchronous loader's bit for bit
// (tests/cuda_gemm's any_load asserts it on a GPU; a host build of these decoders against
// quants.cuh's matched every value of random blocks at every alignment). Not yet run on a GPU
// when written: `--kernel-options any-sync` keeps the synchronous loader for comparison.

__device__ __forceinline__ u32 gm_ld16(const u8* p) { return __ldg((const unsigned short*)p); }

// Byte k of w (an integer u below 256) as the float u - off, exactly: the bits of 2^23 + u
// minus 2^23 + off, a byte permute and an add instead of a conversion (a quarter of the rate
// of the adds); exact, as the conversion is, so the values equal quants.cuh's `(float)q`.
template <int K>
__device__ __forceinline__ float gm_b2f(u32 w, float off) {
    return __int_as_float(__byte_perm(w, 0x4B000000u, 0x7650 + K)) - (8388608.0f + off);
}

// N little-endian 32-bit words of the bytes at p (any alignment), read as N (p 4-byte
// aligned) or N + 1 aligned words and shifted into place; the extra word reaches at most 3
// bytes past the range, inside the same aligned word (callers' ranges are followed by more
// of the same block).
template <int N>
struct GmWords {
    u32 w[N + 1], sh;
    __device__ __forceinline__ void fetch(const u8* p) {
        const unsigned long long a = (unsigned long long)p;
        const u32* q = (const u32*)(a & ~3ull);
        sh = (u32)(a & 3) * 8;
#pragma unroll
        for (int i = 0; i < N; ++i) w[i] = __ldg(q + i);
        w[N] = sh ? __ldg(q + N) : 0u;
    }
    __device__ __forceinline__ u32 word(int i) const { return __funnelshift_r(w[i], w[i + 1], sh); }
};

// One group's raw bytes: fetch(b, gi) from block b (BYTES bytes) group gi (0..8, 256-value
// blocks), decode(gi, v, grid) its 32 values (`grid`: IQ3_S's grid, a copy of IQ3S_GRID in
// shared memory; the others ignore it). The primary template is the synchronous loader's
// placeholder (never fetched).
template <int T>
struct GmRaw {
    static constexpr int BYTES = 0;
    __device__ __forceinline__ void fetch(const u8*, int) {}
    __device__ __forceinline__ void decode(int, float (&v)[32], const u32*) const {}
};

// IQ3_S (110-byte blocks, 2-byte aligned): d, the group's 8 grid indices, the byte of their
// 9th bits, its 4 sign bytes and the byte of its scale nibble, as 16-bit loads.
template <>
struct GmRaw<QT_IQ3_S> {
    static constexpr int BYTES = 110;
    u32 d, qs[4], qh, sg[2], sc;
    __device__ __forceinline__ void fetch(const u8* b, int gi) {
        d = gm_ld16(b);
#pragma unroll
        for (int l = 0; l < 4; ++l) qs[l] = gm_ld16(b + 2 + 8 * gi + 2 * l);
        qh = gm_ld16(b + 66 + (gi & ~1));
        sg[0] = gm_ld16(b + 74 + 4 * gi);
        sg[1] = gm_ld16(b + 76 + 4 * gi);
        sc = gm_ld16(b + 106 + ((gi >> 1) & ~1));
    }
    __device__ __forceinline__ void decode(int gi, float (&v)[32], const u32* grid) const {
        const int nsc = (sc >> (8 * ((gi >> 1) & 1) + 4 * (gi & 1))) & 15;
        const float db = qt_mul(st_h2f((u16)d), (float)(1 + 2 * nsc));
        const u32 h = qh >> (8 * (gi & 1));
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const int i0 = (qs[l] & 0xff) | (((h >> (2 * l)) & 1) << 8);
            const int i1 = ((qs[l] >> 8) & 0xff) | (((h >> (2 * l + 1)) & 1) << 8);
            const u32 g[2] = {grid[i0], grid[i1]};
            const u32 signs = sg[l >> 1] >> (8 * (l & 1));
            // qt_put8: (db * grid[j]) * sign_j.
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float gf = (j & 3) == 0   ? gm_b2f<0>(g[j >> 2], 0.0f)
                                 : (j & 3) == 1 ? gm_b2f<1>(g[j >> 2], 0.0f)
                                 : (j & 3) == 2 ? gm_b2f<2>(g[j >> 2], 0.0f)
                                                : gm_b2f<3>(g[j >> 2], 0.0f);
                const float x = qt_mul(db, gf);
                v[8 * l + j] = (signs >> j) & 1 ? -x : x;
            }
        }
    }
};

// Q6_K (210-byte blocks, 2-byte aligned): the group's 32 bytes of low nibbles and 32 bytes
// of high bit pairs as words, its two scale bytes and d.
template <>
struct GmRaw<QT_Q6_K> {
    static constexpr int BYTES = 210;
    GmWords<8> ql, qh;
    u32 sc, d;
    __device__ __forceinline__ void fetch(const u8* b, int gi) {
        const int h = gi >> 2;
        ql.fetch(b + 64 * h + 32 * (gi & 1));
        qh.fetch(b + 128 + 32 * h);
        sc = gm_ld16(b + 192 + 2 * gi);
        d = gm_ld16(b + 208);
    }
    __device__ __forceinline__ void decode(int gi, float (&v)[32], const u32*) const {
        const float dd = st_h2f((u16)d);
        const float dl0 = qt_mul(dd, (float)(i8)(sc & 0xff));
        const float dl1 = qt_mul(dd, (float)(i8)((sc >> 8) & 0xff));
        const int ls = 4 * ((gi >> 1) & 1), hs = 2 * (gi & 3);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            // Four 6-bit quants, one a byte.
            const u32 q = ((ql.word(i) >> ls) & 0x0f0f0f0fu) | (((qh.word(i) >> hs) & 0x03030303u) << 4);
            const float dl = i < 4 ? dl0 : dl1;
            v[4 * i] = qt_mul(dl, gm_b2f<0>(q, 32.0f));
            v[4 * i + 1] = qt_mul(dl, gm_b2f<1>(q, 32.0f));
            v[4 * i + 2] = qt_mul(dl, gm_b2f<2>(q, 32.0f));
            v[4 * i + 3] = qt_mul(dl, gm_b2f<3>(q, 32.0f));
        }
    }
};

// Q5_K (176-byte blocks, 16-byte aligned as every row and matrix is): the 16-byte header
// (d, dmin, 12 scale bytes), the 32 bytes of fifth bits and the group's 32 bytes of nibbles.
template <>
struct GmRaw<QT_Q5_K> {
    static constexpr int BYTES = 176;
    uint4 hd, qh[2], qs[2];
    __device__ __forceinline__ void fetch(const u8* b, int gi) {
        const uint4* p = (const uint4*)b;
        hd = __ldg(p);
        qh[0] = __ldg(p + 1);
        qh[1] = __ldg(p + 2);
        const uint4* q = (const uint4*)(b + 48 + 32 * (gi >> 1));
        qs[0] = __ldg(q);
        qs[1] = __ldg(q + 1);
    }
    __device__ __forceinline__ void decode(int gi, float (&v)[32], const u32*) const {
        const float dd = st_h2f((u16)(hd.x & 0xffff)), dmin = st_h2f((u16)(hd.x >> 16));
        // qt_scale_min(gi, scales): bytes gi & 3 of scale words 0, 1, 2.
        const int s = 8 * (gi & 3);
        const int b0 = (hd.y >> s) & 0xff, b4 = (hd.z >> s) & 0xff, b8 = (hd.w >> s) & 0xff;
        const int sc = gi < 4 ? b0 & 63 : (b8 & 15) | ((b0 >> 6) << 4);
        const int m = gi < 4 ? b4 & 63 : (b8 >> 4) | ((b4 >> 6) << 4);
        const float dl = qt_mul(dd, (float)sc), ml = qt_mul(dmin, (float)m);
        const u32 qw[8] = {qs[0].x, qs[0].y, qs[0].z, qs[0].w, qs[1].x, qs[1].y, qs[1].z, qs[1].w};
        const u32 hw[8] = {qh[0].x, qh[0].y, qh[0].z, qh[0].w, qh[1].x, qh[1].y, qh[1].z, qh[1].w};
        const int shift = 4 * (gi & 1);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            // Four 5-bit quants, one a byte.
            const u32 q = ((qw[i] >> shift) & 0x0f0f0f0fu) | (((hw[i] >> gi) & 0x01010101u) << 4);
            v[4 * i] = __fsub_rn(qt_mul(dl, gm_b2f<0>(q, 0.0f)), ml);
            v[4 * i + 1] = __fsub_rn(qt_mul(dl, gm_b2f<1>(q, 0.0f)), ml);
            v[4 * i + 2] = __fsub_rn(qt_mul(dl, gm_b2f<2>(q, 0.0f)), ml);
            v[4 * i + 3] = __fsub_rn(qt_mul(dl, gm_b2f<3>(q, 0.0f)), ml);
        }
    }
};

// IQ4_XS (136-byte blocks, 8-byte aligned as every row and matrix is): the 8-byte header
// (d, the high scale bits, the low scale nibbles) and the group's 16 bytes of nibbles.
template <>
struct GmRaw<QT_IQ4_XS> {
    static constexpr int BYTES = 136;
    uint2 hd, qs[2];
    __device__ __forceinline__ void fetch(const u8* b, int gi) {
        hd = __ldg((const uint2*)b);
        const uint2* q = (const uint2*)(b + 8 + 16 * gi);
        qs[0] = __ldg(q);
        qs[1] = __ldg(q + 1);
    }
    __device__ __forceinline__ void decode(int gi, float (&v)[32], const u32*) const {
        const int lo = (hd.y >> (8 * (gi >> 1) + 4 * (gi & 1))) & 15;
        const int hi = (hd.x >> (16 + 2 * gi)) & 3;
        const float dl = qt_mul(st_h2f((u16)(hd.x & 0xffff)), (float)((lo | (hi << 4)) - 32));
        const u32 qw[4] = {qs[0].x, qs[0].y, qs[1].x, qs[1].y};
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            const int jj = j & 15;
            const int q = (qw[jj >> 2] >> (8 * (jj & 3) + 4 * (j >> 4))) & 15;
            // The table's value + 128 as a byte, then exactly as a float.
            const u32 b = (u32)(KVALUES_IQ4NL[q] + 128);
            v[j] = qt_mul(dl, gm_b2f<0>(b, 128.0f));
        }
    }
};

// 32 values -> f16 (round to nearest even) at dst (16-byte aligned): the layout of one
// 32-column half of a 16-bit W row, as both any-type loaders store it.
__device__ __forceinline__ void gm_store_h32(u8* dst, const float (&v)[32]) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        u32 h[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
            h[j] = (u32)st_f2h(v[8 * q + 2 * j]) | ((u32)st_f2h(v[8 * q + 2 * j + 1]) << 16);
        ((uint4*)dst)[q] = make_uint4(h[0], h[1], h[2], h[3]);
    }
}

// gm_store_h32 with two values a conversion (cvt.rn.f16x2.f32: each rounded to nearest even
// as st_f2h rounds it, so the same bits), for the pipelined loader.
__device__ __forceinline__ void gm_store_h32x2(u8* dst, const float (&v)[32]) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        u32 h[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)  // the first operand goes to the upper half
            asm("cvt.rn.f16x2.f32 %0, %1, %2;"
                : "=r"(h[j])
                : "f"(v[8 * q + 2 * j + 1]), "f"(v[8 * q + 2 * j]));
        ((uint4*)dst)[q] = make_uint4(h[0], h[1], h[2], h[3]);
    }
}

// One thread's share of a stage of the pipelined loader: groups c = tid + i * NT (i < NG) of
// the BM rows x 2 halves of GM_BK = 64 columns, of each of the NW matrices; groups past
// `rows` or `cols` are never fetched and store zeros.
template <int QT, int BM, int NT, int NW>
struct GmPipe {
    static constexpr int NG = BM * 2 / NT;
    static_assert(NG * NT == BM * 2, "each thread owns whole groups");
    GmRaw<QT> raw[NW][NG];

    __device__ __forceinline__ void fetch(const u8* W, const u8* W2, int rows, int cols,
                                          int row0, int k0, int tid) {
        const long rb = (long)(cols / 256) * GmRaw<QT>::BYTES;
#pragma unroll
        for (int m = 0; m < NW; ++m)
#pragma unroll
            for (int i = 0; i < NG; ++i) {
                const int c = tid + i * NT, gr = row0 + (c >> 1), kk = k0 + (c & 1) * 32;
                if (gr < rows && kk < cols)
                    raw[m][i].fetch((m == 0 ? W : W2) + gr * rb + (kk / 256) * GmRaw<QT>::BYTES,
                                    (kk / 32) & 7);
            }
    }

    // Decodes the fetched groups into the W buffer `wb` (matrix m at wb + m * wbytes).
    __device__ __forceinline__ void store(u8* wb, int wbytes, int rows, int cols, int row0,
                                          int k0, int tid, const u32* grid) const {
#pragma unroll
        for (int m = 0; m < NW; ++m)
#pragma unroll
            for (int i = 0; i < NG; ++i) {
                const int c = tid + i * NT, row = c >> 1, part = c & 1;
                const int gr = row0 + row, kk = k0 + part * 32;
                float v[32];
                if (gr < rows && kk < cols) {
                    raw[m][i].decode((kk / 32) & 7, v, grid);
                } else {
#pragma unroll
                    for (int j = 0; j < 32; ++j) v[j] = 0.0f;
                }
                gm_store_h32x2(wb + m * wbytes + row * GM_H_STRIDE + part * 64, v);
            }
    }
};

// Shared-memory bytes of one pipeline stage.
// With GLU two weight tiles (gate, then up) each of W + S bytes.
template <int WT, int BM, bool GLU>
struct GmStage {
    static constexpr int W = WT == GM_Q8    ? BM * GM_Q8_WSTRIDE
                             : WT == GM_Q4K ? BM * GM_Q4_WSTRIDE
                                            : BM * GM_H_STRIDE;
    static constexpr int S = WT == GM_Q8 ? BM * 4 : 0;  // Q8_0: two f16 scales per row
    static constexpr int X = GM_BN * GM_H_STRIDE;
    static constexpr int NW = GLU ? 2 : 1;
    static constexpr int BYTES = NW * (W + S) + X;
};

// One CTA tile: rows [row0, row0 + BM) of the matrix at `W` times the GM_BN X rows named by
// xrow[] (n_valid of them), written to Y rows yrow[] (row length ldy), or added to them when
// `add_y` (one K part only: each element then has one writer, so the sum is deterministic).
// X16 holds 16-bit rows of `cols`. Threads: BM * WN (warps BM/32 along the rows x WN along
// the tokens, each warp 32 rows x 64/WN tokens).
//
// K order inside one mma: the 16 logical k of a m16n8k16 step map to physical columns so that
// every thread's A pair (k 2t, 2t+1) and (k 2t+8, 2t+9) and B pair are 4 consecutive
// columns 4t..4t+3; A and B use the same map, so the products are unchanged and each
// fragment is one 32-bit (int8 W) or 64-bit (16-bit W, X) shared load. Q4_K: the 32 quant
// bytes of a 64-column chunk hold columns 0..31 in their low nibbles and 32..63 in their
// high ones, so steps 0, 1 read the low and steps 2, 3 the high nibbles of the same words
// (sub-blocks 2c and 2c + 1), one 32-bit load per fragment.
// GLU: W2 is a second matrix (up) of the same shape as W (gate); the tile writes
// silu(W_r . x) * (W2_r . x).
template <int WT, int BM, int WN, bool GLU, int QT = 0>
__device__ __forceinline__ void gm_tile(const u8* __restrict__ W, const u8* __restrict__ W2,
                                        int rows, int cols, int row0,
                                        const u16* __restrict__ X16, const int* xrow,
                                        const int* yrow, int n_valid, float* __restrict__ Y,
                                        int ldy, u8* smem, int kpart, int kparts, int add_y,
                                        int gt = 0) {
    constexpr bool Q8 = WT == GM_Q8, Q4K = WT == GM_Q4K, ANY = WT == GM_ANY;
    // The pipelined any-type loader (GmPipe): W double-buffered after the X slots.
    constexpr bool PIPE = ANY && QT != 0;
    typedef GmStage<WT, BM, GLU> St;
    constexpr int NT = BM * WN;         // threads: BM/32 warps along the rows x WN
    // Bytes between X slots and X's offset in its slot; PIPE's W buffers start at WB0.
    constexpr int XSTEP = PIPE ? St::X : St::BYTES;
    constexpr int X0 = PIPE ? 0 : St::NW * (St::W + St::S);
    constexpr int WB0 = GM_STAGES * St::X;
    constexpr int NI = GM_BN / 8 / WN;  // n-fragments (8 tokens) per warp
    const int tid = threadIdx.x;
    const int nb = cols / QK8_0;
    // This CTA's share of the K stages (split-K: kparts CTAs add into a zeroed Y).
    const int kt_all = (cols + GM_BK - 1) / GM_BK;
    const int kt_lo = kt_all * kpart / kparts, kt_n = kt_all * (kpart + 1) / kparts - kt_lo;

    // Stage kt (absolute) into slot: W (but PIPE's, which GmPipe loads) and X.
    auto load = [&](int slot, int kt) {
        const int k0 = kt * GM_BK;
#pragma unroll
        for (int m = 0; m < (PIPE ? 0 : St::NW); ++m) {
        u8* st = smem + slot * St::BYTES + m * (St::W + St::S);
        const u8* Wm = m == 0 ? W : W2;
        const u8* scales = Wm + (long)rows * cols;
        if (Q8) {
            for (int c = tid; c < BM * 4; c += NT) {
                const int row = c >> 2, part = c & 3;
                const int gr = row0 + row, kk = k0 + part * 16;
                const bool ok = gr < rows && kk < cols;
                const u8* src = ok ? Wm + (long)gr * cols + kk : Wm;
                gm_cp16(st + row * GM_Q8_WSTRIDE + part * 16, src, ok ? 16 : 0);
            }
            u16* ss = (u16*)(st + St::W);
            const int kb = k0 / QK8_0;
            if ((nb & 1) == 0) {
                for (int row = tid; row < BM; row += NT) {
                    const int gr = row0 + row;
                    const bool ok = gr < rows;
                    const u8* src = ok ? scales + ((long)gr * nb + kb) * 2 : Wm;
                    gm_cp4(ss + row * 2, src, ok ? 4 : 0);
                }
            } else {
                // Odd block count: a row's scale pair is only 2-byte aligned; plain loads.
                for (int row = tid; row < BM; row += NT) {
                    const int gr = row0 + row;
                    u16 s0 = 0, s1 = 0;
                    if (gr < rows) {
                        const u16* p = (const u16*)(scales + ((long)gr * nb + kb) * 2);
                        s0 = p[0];
                        if (kb + 1 < nb) s1 = p[1];
                    }
                    ss[row * 2] = s0;
                    ss[row * 2 + 1] = s1;
                }
            }
        } else if (Q4K) {
            // Per row: the block's header, then the stage's 32 bytes of quants (chunk
            // c = kt mod 4 of block kt / 4). cols is a multiple of 256, so k0 < cols.
            const long rb = (long)(cols / 256) * GM_Q4K_BLOCK;
            const int kb = k0 / 256, ch = (k0 / 64) & 3;
            for (int c = tid; c < BM * 3; c += NT) {
                const int row = c / 3, part = c - row * 3;
                const int gr = row0 + row;
                const bool ok = gr < rows;
                const int off = part == 0 ? 0 : 16 + 32 * ch + 16 * (part - 1);
                const u8* src = ok ? Wm + gr * rb + kb * GM_Q4K_BLOCK + off : Wm;
                gm_cp16(st + row * GM_Q4_WSTRIDE + part * 16, src, ok ? 16 : 0);
            }
        } else if (ANY) {
            // Each thread decodes 32-column groups of the stage's rows (quants.cuh: the CPU
            // reference's values) and stores them as f16 in the 16-bit layout, with plain
            // shared stores: the barrier at the top of the iteration that reads this slot
            // orders them, as the cp.async wait does for the other types. Groups past `rows`
            // or `cols` are zeros.
            int be, bb;
            qt_block(gt, &be, &bb);
            const long rb = (long)(cols / be) * bb;
            for (int c = tid; c < BM * 2; c += NT) {
                const int row = c >> 1, part = c & 1;
                const int gr = row0 + row, kk = k0 + part * 32;
                uint4* dst = (uint4*)(st + row * GM_H_STRIDE + part * 64);
                float v[32];
                if (gr < rows && kk < cols) {
                    qt_group32_common(gt, Wm + (long)gr * rb, kk / 32, v);
                } else {
#pragma unroll
                    for (int j = 0; j < 32; ++j) v[j] = 0.0f;
                }
                gm_store_h32((u8*)dst, v);
            }
        } else {
            for (int c = tid; c < BM * 8; c += NT) {
                const int row = c >> 3, part = c & 7;
                const int gr = row0 + row, kk = k0 + part * 8;
                const bool ok = gr < rows && kk < cols;
                const u8* src = ok ? Wm + ((long)gr * cols + kk) * 2 : Wm;
                gm_cp16(st + row * GM_H_STRIDE + part * 16, src, ok ? 16 : 0);
            }
        }
        }
        u8* sx = smem + slot * XSTEP + X0;
        for (int c = tid; c < GM_BN * 8; c += NT) {
            const int n = c >> 3, part = c & 7;
            const int kk = k0 + part * 8;
            const bool ok = n < n_valid && kk < cols;
            const u16* src = ok ? X16 + (long)xrow[n] * cols + kk : X16;
            gm_cp16(sx + n * GM_H_STRIDE + part * 16, src, ok ? 16 : 0);
        }
    };

    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, tg = lane & 3;
    const int wm = warp / WN, wn = warp % WN;
    float acc[St::NW][2][NI][4];
#pragma unroll
    for (int m = 0; m < St::NW; ++m)
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < NI; ++j)
#pragma unroll
                for (int v = 0; v < 4; ++v) acc[m][i][j][v] = 0.0f;

#pragma unroll
    for (int s = 0; s < GM_STAGES - 1; ++s) {
        if (s < kt_n) load(s, kt_lo + s);
        gm_commit();
    }
    // PIPE (while X's first stages arrive): stage 0's W decoded into buffer 0 and stage 1's
    // raw bytes fetched; then the end of iteration kt stores stage kt + 1's into buffer
    // (kt + 1) & 1 and fetches stage kt + 2's, whose loads are in flight across the next
    // barrier and stage kt + 1's mmas.
    // IQ3_S: its 2 KiB grid copied to shared memory once a tile, where the 32 lanes' scattered
    // lookups cost a few bank conflicts instead of a cache wavefront per 128-byte line.
    const u32* grid = IQ3S_GRID;
    if constexpr (PIPE && QT == QT_IQ3_S) {
        __shared__ u32 gm_iq3s_grid[512];
        for (int i = tid; i < 512; i += NT) gm_iq3s_grid[i] = IQ3S_GRID[i];
        __syncthreads();
        grid = gm_iq3s_grid;
    }
    GmPipe<QT, BM, NT, St::NW> pipe;
    if (PIPE && kt_n > 0) {
        pipe.fetch(W, W2, rows, cols, row0, kt_lo * GM_BK, tid);
        pipe.store(smem + WB0, St::W, rows, cols, row0, kt_lo * GM_BK, tid, grid);
        if (kt_n > 1) pipe.fetch(W, W2, rows, cols, row0, (kt_lo + 1) * GM_BK, tid);
    }
    for (int kt = 0; kt < kt_n; ++kt) {
        gm_wait_stages();
        __syncthreads();
        {
            const int nk = kt + GM_STAGES - 1;
            if (nk < kt_n) load(nk % GM_STAGES, kt_lo + nk);
            gm_commit();
        }
        // This stage's W of matrix m.
        auto wst = [&](int m) -> const u8* {
            return PIPE ? smem + WB0 + ((kt & 1) * St::NW + m) * St::W
                        : smem + (kt % GM_STAGES) * St::BYTES + m * (St::W + St::S);
        };
        const u8* sx = smem + (kt % GM_STAGES) * XSTEP + X0;
        // Q4_K: (d * sc, -dmin * m) of this stage's two sub-blocks for each row a thread
        // reads: [m][mi][row r0 / r1][sub-block].
        u32 q4s[St::NW][2][2][2];
        if (Q4K) {
            const int ch = (kt_lo + kt) & 3;
#pragma unroll
            for (int m = 0; m < St::NW; ++m) {
                const u8* st = wst(m);
#pragma unroll
                for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int r = wm * 32 + mi * 16 + g + h * 8;
                        const uint4 hd = *(const uint4*)(st + r * GM_Q4_WSTRIDE);
                        gm_q4k_scales(hd, ch, q4s[m][mi][h][0], q4s[m][mi][h][1]);
                    }
            }
        }
#pragma unroll
        for (int s = 0; s < GM_BK / 16; ++s) {
#pragma unroll
          for (int m = 0; m < St::NW; ++m) {
            const u8* st = wst(m);
            u32 a[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                const int r0 = wm * 32 + mi * 16 + g, r1 = r0 + 8;
                if (Q8) {
                    const u16* ss = (const u16*)(st + St::W);
                    const u32 w0 = *(const u32*)(st + r0 * GM_Q8_WSTRIDE + s * 16 + tg * 4);
                    const u32 w1 = *(const u32*)(st + r1 * GM_Q8_WSTRIDE + s * 16 + tg * 4);
                    const u32 d0 = ss[r0 * 2 + (s >> 1)], d1 = ss[r1 * 2 + (s >> 1)];
                    gm_dq4(w0, d0 | (d0 << 16), a[mi][0], a[mi][2]);
                    gm_dq4(w1, d1 | (d1 << 16), a[mi][1], a[mi][3]);
                } else if (Q4K) {
                    const int o = 16 + (s & 1) * 16 + tg * 4;
                    const u32 w0 = *(const u32*)(st + r0 * GM_Q4_WSTRIDE + o);
                    const u32 w1 = *(const u32*)(st + r1 * GM_Q4_WSTRIDE + o);
                    gm_dq4k(w0, s >> 1, q4s[m][mi][0][s >> 1], a[mi][0], a[mi][2]);
                    gm_dq4k(w1, s >> 1, q4s[m][mi][1][s >> 1], a[mi][1], a[mi][3]);
                } else {
                    const uint2 v0 = *(const uint2*)(st + r0 * GM_H_STRIDE + s * 32 + tg * 8);
                    const uint2 v1 = *(const uint2*)(st + r1 * GM_H_STRIDE + s * 32 + tg * 8);
                    a[mi][0] = v0.x;
                    a[mi][2] = v0.y;
                    a[mi][1] = v1.x;
                    a[mi][3] = v1.y;
                }
            }
#pragma unroll
            for (int ni = 0; ni < NI; ++ni) {
                // PIPE: n-fragments wholly past the tile's tokens are skipped (warp-uniform;
                // their sums would be of zero X rows, never written).
                if (PIPE && wn * (GM_BN / WN) + ni * 8 >= n_valid) continue;
                const int n = wn * (GM_BN / WN) + ni * 8 + g;
                const uint2 b = *(const uint2*)(sx + n * GM_H_STRIDE + s * 32 + tg * 8);
#pragma unroll
                for (int mi = 0; mi < 2; ++mi)
                    gm_mma<WT != GM_BF16>(acc[m][mi][ni], a[mi], b.x, b.y);
            }
          }
        }
        if (PIPE && kt + 1 < kt_n) {
            pipe.store(smem + WB0 + ((kt + 1) & 1) * St::NW * St::W, St::W, rows, cols, row0,
                       (kt_lo + kt + 1) * GM_BK, tid, grid);
            if (kt + 2 < kt_n)
                pipe.fetch(W, W2, rows, cols, row0, (kt_lo + kt + 2) * GM_BK, tid);
        }
    }
    asm volatile("cp.async.wait_all;\n" ::);

#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                const int r = row0 + wm * 32 + mi * 16 + g + (v >> 1) * 8;
                const int n = wn * (GM_BN / WN) + ni * 8 + tg * 2 + (v & 1);
                float o = acc[0][mi][ni][v];
                if (GLU) o = o / (1.0f + expf(-o)) * acc[St::NW - 1][mi][ni][v];
                if (r < rows && n < n_valid) {
                    if (kparts > 1) atomicAdd(&Y[(long)yrow[n] * ldy + r], o);
                    else if (add_y) Y[(long)yrow[n] * ldy + r] += o;
                    else Y[(long)yrow[n] * ldy + r] = o;
                }
            }
        }
    }
}

// Dense: grid (ceil(rows / BM), ceil(n_tok / GM_BN), K parts), block BM * WN, dynamic shared
// memory GM_STAGES * GmStage::BYTES. With more than one K part Y must be zeroed first; two
// parts keep the result deterministic (0 + a + b == 0 + b + a).
template <int WT, int BM, int WN, int QT = 0>
__device__ __forceinline__ void gm_dense(const u8* W, const u16* X16, float* Y, int rows,
                                         int cols, int n_tok, int acc, int gt = 0) {
    extern __shared__ __align__(16) u8 gm_smem[];
    __shared__ int xrow[GM_BN];
    const int t0 = blockIdx.y * GM_BN;
    const int n_valid = min(GM_BN, n_tok - t0);
    if (threadIdx.x < GM_BN) xrow[threadIdx.x] = t0 + threadIdx.x;
    __syncthreads();
    gm_tile<WT, BM, WN, false, QT>(W, W, rows, cols, blockIdx.x * BM, X16, xrow, xrow, n_valid, Y,
                               rows, gm_smem, blockIdx.z, gridDim.z, acc, gt);
}

// Grouped: grid (ceil(rows / BM), max_tiles), block 2 * BM. Tile y covers assignments
// perm[pos0 .. pos0 + count) of expert e = tiles[2y] (pos0 = tiles[2y + 1]); CTAs past the
// device-side tile count exit. Expert e's matrix starts at byte e * mat_bytes of W (W2), or,
// when tab (tab2) is not null, at the address tab[3 e] (tab2[3 e]): an expert table of
// (gate, up, down) pointers as the expert cache keeps it, tab pointing at the column read.
template <int WT, int BM, int WN, bool GLU, int QT = 0>
__device__ __forceinline__ void gm_moe(const u8* W, const u8* W2, long mat_bytes,
                                       const u16* X16, float* Y,
                                       int rows, int cols, const int* offsets, const int* perm,
                                       const int* tiles, const int* n_tiles, int k,
                                       int gather, const unsigned long long* tab,
                                       const unsigned long long* tab2, int gt = 0) {
    extern __shared__ __align__(16) u8 gm_smem[];
    __shared__ int xrow[GM_BN], yrow[GM_BN];
    const int tile = blockIdx.y;
    if (tile >= *n_tiles) return;
    const int e = tiles[2 * tile], pos0 = tiles[2 * tile + 1];
    const int n_valid = min(GM_BN, offsets[e + 1] - pos0);
    if (threadIdx.x < GM_BN) {
        const int a = threadIdx.x < n_valid ? perm[pos0 + threadIdx.x] : 0;
        xrow[threadIdx.x] = gather ? a / k : a;
        yrow[threadIdx.x] = a;
    }
    __syncthreads();
    const u8* We = tab ? (const u8*)tab[3 * e] : W + (long)e * mat_bytes;
    const u8* W2e = tab2 ? (const u8*)tab2[3 * e] : W2 + (long)e * mat_bytes;
    gm_tile<WT, BM, WN, GLU, QT>(We, W2e, rows, cols,
                         blockIdx.x * BM, X16, xrow, yrow, n_valid, Y, rows, gm_smem, 0, 1, 0,
                         gt);
}

// Entry points. Dense: W, X16 (n_tok rows of cols 16-bit values), Y (n_tok x rows f32),
// `acc`: add into Y instead of overwriting it (launched with one K part).
ST_KERNEL void gemm_q8_0_m64(const u8* __restrict__ W, const u16* __restrict__ X16,
                             float* __restrict__ Y, int rows, int cols, int n_tok, int acc) {
    gm_dense<GM_Q8, 64, 2>(W, X16, Y, rows, cols, n_tok, acc);
}
ST_KERNEL void gemm_q8_0_m128(const u8* __restrict__ W, const u16* __restrict__ X16,
                              float* __restrict__ Y, int rows, int cols, int n_tok, int acc) {
    gm_dense<GM_Q8, 128, 2>(W, X16, Y, rows, cols, n_tok, acc);
}
ST_KERNEL void gemm_q4_k_m64(const u8* __restrict__ W, const u16* __restrict__ X16,
                             float* __restrict__ Y, int rows, int cols, int n_tok, int acc) {
    gm_dense<GM_Q4K, 64, 2>(W, X16, Y, rows, cols, n_tok, acc);
}
ST_KERNEL void gemm_q4_k_m128(const u8* __restrict__ W, const u16* __restrict__ X16,
                              float* __restrict__ Y, int rows, int cols, int n_tok, int acc) {
    gm_dense<GM_Q4K, 128, 2>(W, X16, Y, rows, cols, n_tok, acc);
}
ST_KERNEL void gemm_bf16_m64(const u8* __restrict__ W, const u16* __restrict__ X16,
                             float* __restrict__ Y, int rows, int cols, int n_tok, int acc) {
    gm_dense<GM_BF16, 64, 2>(W, X16, Y, rows, cols, n_tok, acc);
}
ST_KERNEL void gemm_bf16_m128(const u8* __restrict__ W, const u16* __restrict__ X16,
                              float* __restrict__ Y, int rows, int cols, int n_tok, int acc) {
    gm_dense<GM_BF16, 128, 2>(W, X16, Y, rows, cols, n_tok, acc);
}

// 128 rows, one warp along the tokens (4 warps of 32 rows x 64 tokens): fewer instructions
// per mma than the 32 x 32 warp tiles above.
ST_KERNEL void gemm_q8_0_m128w(const u8* __restrict__ W, const u16* __restrict__ X16,
                               float* __restrict__ Y, int rows, int cols, int n_tok, int acc) {
    gm_dense<GM_Q8, 128, 1>(W, X16, Y, rows, cols, n_tok, acc);
}
ST_KERNEL void gemm_q4_k_m128w(const u8* __restrict__ W, const u16* __restrict__ X16,
                               float* __restrict__ Y, int rows, int cols, int n_tok, int acc) {
    gm_dense<GM_Q4K, 128, 1>(W, X16, Y, rows, cols, n_tok, acc);
}
ST_KERNEL void gemm_bf16_m128w(const u8* __restrict__ W, const u16* __restrict__ X16,
                               float* __restrict__ Y, int rows, int cols, int n_tok, int acc) {
    gm_dense<GM_BF16, 128, 1>(W, X16, Y, rows, cols, n_tok, acc);
}

// Grouped: W the 3-D expert tensor, X16 (n_tok rows when gather, else n_tok * k), Y
// (n_tok * k rows of `rows` f32, indexed by assignment), the rest from moe_sort.
#define GM_MOE_ARGS                                                                          \
    const u8 *__restrict__ W, long mat_bytes, const u16 *__restrict__ X16,                   \
        float *__restrict__ Y, int rows, int cols, const int *__restrict__ offsets,          \
        const int *__restrict__ perm, const int *__restrict__ tiles,                         \
        const int *__restrict__ n_tiles, int k, int gather,                                   \
        const unsigned long long *__restrict__ tab, const unsigned long long *__restrict__ tab2
#define GM_MOE_PASS                                                                          \
    mat_bytes, X16, Y, rows, cols, offsets, perm, tiles, n_tiles, k, gather, tab, tab2
ST_KERNEL void moe_gemm_q8_0_m64(GM_MOE_ARGS) {
    gm_moe<GM_Q8, 64, 2, false>(W, W, GM_MOE_PASS);
}
ST_KERNEL void moe_gemm_q8_0_m128(GM_MOE_ARGS) {
    gm_moe<GM_Q8, 128, 2, false>(W, W, GM_MOE_PASS);
}
ST_KERNEL void moe_gemm_q8_0_m128w(GM_MOE_ARGS) {
    gm_moe<GM_Q8, 128, 1, false>(W, W, GM_MOE_PASS);
}
ST_KERNEL void moe_gemm_q4_k_m64(GM_MOE_ARGS) {
    gm_moe<GM_Q4K, 64, 2, false>(W, W, GM_MOE_PASS);
}
ST_KERNEL void moe_gemm_q4_k_m128(GM_MOE_ARGS) {
    gm_moe<GM_Q4K, 128, 2, false>(W, W, GM_MOE_PASS);
}
ST_KERNEL void moe_gemm_q4_k_m128w(GM_MOE_ARGS) {
    gm_moe<GM_Q4K, 128, 1, false>(W, W, GM_MOE_PASS);
}
ST_KERNEL void moe_gemm_bf16_m64(GM_MOE_ARGS) {
    gm_moe<GM_BF16, 64, 2, false>(W, W, GM_MOE_PASS);
}
ST_KERNEL void moe_gemm_bf16_m128(GM_MOE_ARGS) {
    gm_moe<GM_BF16, 128, 2, false>(W, W, GM_MOE_PASS);
}
ST_KERNEL void moe_gemm_bf16_m128w(GM_MOE_ARGS) {
    gm_moe<GM_BF16, 128, 1, false>(W, W, GM_MOE_PASS);
}

// Fused gate + up (SwiGLU): Y[a][r] = silu(Wg_e,r . xrow(a)) * (Wu_e,r . xrow(a)), Wg and Wu
// two expert tensors of the same shape and type (W is the gate tensor).
ST_KERNEL void moe_gemm_glu_q8_0_m64(const u8* __restrict__ Wu, GM_MOE_ARGS) {
    gm_moe<GM_Q8, 64, 2, true>(W, Wu, GM_MOE_PASS);
}
ST_KERNEL void moe_gemm_glu_q4_k_m64(const u8* __restrict__ Wu, GM_MOE_ARGS) {
    gm_moe<GM_Q4K, 64, 2, true>(W, Wu, GM_MOE_PASS);
}
ST_KERNEL void moe_gemm_glu_bf16_m64(const u8* __restrict__ Wu, GM_MOE_ARGS) {
    gm_moe<GM_BF16, 64, 2, true>(W, Wu, GM_MOE_PASS);
}

// Any other ggml type (GGUF id `gt`, cols a multiple of 32, whole blocks per row): the same
// products with the weights decoded to f16 in the loader (X16 f16).
ST_KERNEL void gemm_any_m64(const u8* __restrict__ W, const u16* __restrict__ X16,
                            float* __restrict__ Y, int rows, int cols, int n_tok, int acc, int gt) {
    gm_dense<GM_ANY, 64, 2>(W, X16, Y, rows, cols, n_tok, acc, gt);
}
ST_KERNEL void gemm_any_m128(const u8* __restrict__ W, const u16* __restrict__ X16,
                             float* __restrict__ Y, int rows, int cols, int n_tok, int acc, int gt) {
    gm_dense<GM_ANY, 128, 2>(W, X16, Y, rows, cols, n_tok, acc, gt);
}
ST_KERNEL void gemm_any_m128w(const u8* __restrict__ W, const u16* __restrict__ X16,
                              float* __restrict__ Y, int rows, int cols, int n_tok, int acc, int gt) {
    gm_dense<GM_ANY, 128, 1>(W, X16, Y, rows, cols, n_tok, acc, gt);
}
ST_KERNEL void moe_gemm_any_m64(GM_MOE_ARGS, int gt) {
    gm_moe<GM_ANY, 64, 2, false>(W, W, GM_MOE_PASS, gt);
}
ST_KERNEL void moe_gemm_any_m128(GM_MOE_ARGS, int gt) {
    gm_moe<GM_ANY, 128, 2, false>(W, W, GM_MOE_PASS, gt);
}
ST_KERNEL void moe_gemm_any_m128w(GM_MOE_ARGS, int gt) {
    gm_moe<GM_ANY, 128, 1, false>(W, W, GM_MOE_PASS, gt);
}
ST_KERNEL void moe_gemm_glu_any_m64(const u8* __restrict__ Wu, GM_MOE_ARGS, int gt) {
    gm_moe<GM_ANY, 64, 2, true>(W, Wu, GM_MOE_PASS, gt);
}

// The pipelined any-type loader (GmPipe) for the types it covers, in the tiles the engine
// uses for them (dense M64 and M128, grouped M128W, fused gate + up M64): the arguments of
// the any-type kernels (gt, which must be the kernel's type, unused), the same results bit
// for bit. The other tiles, and every tile with `--kernel-options any-sync`, run the *_any_* kernels.
ST_KERNEL void gemm_iq3_s_p_m64(const u8* __restrict__ W, const u16* __restrict__ X16,
                            float* __restrict__ Y, int rows, int cols, int n_tok, int acc, int gt) {
    gm_dense<GM_ANY, 64, 2, QT_IQ3_S>(W, X16, Y, rows, cols, n_tok, acc, gt);
}
ST_KERNEL void gemm_iq3_s_p_m128(const u8* __restrict__ W, const u16* __restrict__ X16,
                             float* __restrict__ Y, int rows, int cols, int n_tok, int acc, int gt) {
    gm_dense<GM_ANY, 128, 2, QT_IQ3_S>(W, X16, Y, rows, cols, n_tok, acc, gt);
}
ST_KERNEL void moe_gemm_iq3_s_p_m128w(GM_MOE_ARGS, int gt) {
    gm_moe<GM_ANY, 128, 1, false, QT_IQ3_S>(W, W, GM_MOE_PASS, gt);
}
ST_KERNEL void moe_gemm_glu_iq3_s_p_m64(const u8* __restrict__ Wu, GM_MOE_ARGS, int gt) {
    gm_moe<GM_ANY, 64, 2, true, QT_IQ3_S>(W, Wu, GM_MOE_PASS, gt);
}
ST_KERNEL void gemm_q6_k_p_m64(const u8* __restrict__ W, const u16* __restrict__ X16,
                            float* __restrict__ Y, int rows, int cols, int n_tok, int acc, int gt) {
    gm_dense<GM_ANY, 64, 2, QT_Q6_K>(W, X16, Y, rows, cols, n_tok, acc, gt);
}
ST_KERNEL void gemm_q6_k_p_m128(const u8* __restrict__ W, const u16* __restrict__ X16,
                             float* __restrict__ Y, int rows, int cols, int n_tok, int acc, int gt) {
    gm_dense<GM_ANY, 128, 2, QT_Q6_K>(W, X16, Y, rows, cols, n_tok, acc, gt);
}
ST_KERNEL void moe_gemm_q6_k_p_m128w(GM_MOE_ARGS, int gt) {
    gm_moe<GM_ANY, 128, 1, false, QT_Q6_K>(W, W, GM_MOE_PASS, gt);
}
ST_KERNEL void moe_gemm_glu_q6_k_p_m64(const u8* __restrict__ Wu, GM_MOE_ARGS, int gt) {
    gm_moe<GM_ANY, 64, 2, true, QT_Q6_K>(W, Wu, GM_MOE_PASS, gt);
}
ST_KERNEL void gemm_q5_k_p_m64(const u8* __restrict__ W, const u16* __restrict__ X16,
                            float* __restrict__ Y, int rows, int cols, int n_tok, int acc, int gt) {
    gm_dense<GM_ANY, 64, 2, QT_Q5_K>(W, X16, Y, rows, cols, n_tok, acc, gt);
}
ST_KERNEL void gemm_q5_k_p_m128(const u8* __restrict__ W, const u16* __restrict__ X16,
                             float* __restrict__ Y, int rows, int cols, int n_tok, int acc, int gt) {
    gm_dense<GM_ANY, 128, 2, QT_Q5_K>(W, X16, Y, rows, cols, n_tok, acc, gt);
}
ST_KERNEL void moe_gemm_q5_k_p_m128w(GM_MOE_ARGS, int gt) {
    gm_moe<GM_ANY, 128, 1, false, QT_Q5_K>(W, W, GM_MOE_PASS, gt);
}
ST_KERNEL void moe_gemm_glu_q5_k_p_m64(const u8* __restrict__ Wu, GM_MOE_ARGS, int gt) {
    gm_moe<GM_ANY, 64, 2, true, QT_Q5_K>(W, Wu, GM_MOE_PASS, gt);
}
ST_KERNEL void gemm_iq4_xs_p_m64(const u8* __restrict__ W, const u16* __restrict__ X16,
                            float* __restrict__ Y, int rows, int cols, int n_tok, int acc, int gt) {
    gm_dense<GM_ANY, 64, 2, QT_IQ4_XS>(W, X16, Y, rows, cols, n_tok, acc, gt);
}
ST_KERNEL void gemm_iq4_xs_p_m128(const u8* __restrict__ W, const u16* __restrict__ X16,
                             float* __restrict__ Y, int rows, int cols, int n_tok, int acc, int gt) {
    gm_dense<GM_ANY, 128, 2, QT_IQ4_XS>(W, X16, Y, rows, cols, n_tok, acc, gt);
}
ST_KERNEL void moe_gemm_iq4_xs_p_m128w(GM_MOE_ARGS, int gt) {
    gm_moe<GM_ANY, 128, 1, false, QT_IQ4_XS>(W, W, GM_MOE_PASS, gt);
}
ST_KERNEL void moe_gemm_glu_iq4_xs_p_m64(const u8* __restrict__ Wu, GM_MOE_ARGS, int gt) {
    gm_moe<GM_ANY, 64, 2, true, QT_IQ4_XS>(W, Wu, GM_MOE_PASS, gt);
}

// X f32 -> f16 (bf16 != 0: bf16), round to nearest even; n a multiple of 4, both 16-byte
// aligned. Grid-stride.
ST_KERNEL void gemm_cvt_x(const float* __restrict__ x, u16* __restrict__ out, long n, int bf16) {
    const long n4 = n / 4;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n4;
         i += (long)gridDim.x * blockDim.x) {
        const float4 v = ((const float4*)x)[i];
        u16 h0, h1, h2, h3;
        if (bf16) {
            asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h0) : "f"(v.x));
            asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h1) : "f"(v.y));
            asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h2) : "f"(v.z));
            asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h3) : "f"(v.w));
        } else {
            h0 = st_f2h(v.x);
            h1 = st_f2h(v.y);
            h2 = st_f2h(v.z);
            h3 = st_f2h(v.w);
        }
        ((uint2*)out)[i] = make_uint2((u32)h0 | ((u32)h1 << 16), (u32)h2 | ((u32)h3 << 16));
    }
}

// Inclusive warp prefix sum.
__device__ __forceinline__ int gm_warp_scan(int v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int o = __shfl_up_sync(0xffffffffu, v, d);
        if (lane >= d) v += o;
    }
    return v;
}

// Exclusive block prefix sum of one int per thread (blockDim a multiple of 32); `tot` gets
// the block total. `red` is shared scratch of 32 ints.
__device__ __forceinline__ int gm_block_scan(int v, int* red, int* tot) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int inc = gm_warp_scan(v);
    __syncthreads();
    if (lane == 31) red[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        const int w = lane < nw ? red[lane] : 0;
        const int wi = gm_warp_scan(w);
        red[lane] = wi - w;
        if (lane == 31) red[32] = wi;
    }
    __syncthreads();
    *tot = red[32];
    return red[warp] + inc - v;
}

// Counting sort of the router's choices, one block (any multiple of 32 threads up to 1024).
// ids: n_assign = n_tok * k expert ids (assignment a = t * k + j). Writes offsets
// [n_expert + 1] (offsets[n_expert] = the number of valid assignments; ids outside
// [0, n_expert) are left out of perm), perm [n_assign] (assignments grouped by expert,
// ascending expert; order inside one expert unspecified), tiles (pairs (expert, first
// position) of up to bn assignments each, ascending expert) and n_tiles [1]. Dynamic shared
// memory: 3 * n_expert ints.
ST_KERNEL void moe_sort(const int* __restrict__ ids, int n_assign, int n_expert, int bn,
                        int* __restrict__ offsets, int* __restrict__ perm,
                        int* __restrict__ tiles, int* __restrict__ n_tiles) {
    extern __shared__ int gm_sort_smem[];
    __shared__ int red[33];
    int* cnt = gm_sort_smem;
    int* cur = cnt + n_expert;
    int* toff = cur + n_expert;
    const int tid = threadIdx.x, nt = blockDim.x;
    for (int e = tid; e < n_expert; e += nt) cnt[e] = 0;
    __syncthreads();
    for (int a = tid; a < n_assign; a += nt) {
        const int e = ids[a];
        if ((unsigned)e < (unsigned)n_expert) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    // Each thread owns a contiguous run of experts; scan the runs' sums over the block.
    const int per = (n_expert + nt - 1) / nt;
    const int e0 = min(tid * per, n_expert), e1 = min(e0 + per, n_expert);
    int s = 0, ts = 0;
    for (int e = e0; e < e1; ++e) {
        s += cnt[e];
        ts += (cnt[e] + bn - 1) / bn;
    }
    int total, total_tiles;
    int o = gm_block_scan(s, red, &total);
    int to = gm_block_scan(ts, red, &total_tiles);
    for (int e = e0; e < e1; ++e) {
        offsets[e] = o;
        cur[e] = o;
        toff[e] = to;
        o += cnt[e];
        to += (cnt[e] + bn - 1) / bn;
    }
    if (tid == 0) {
        offsets[n_expert] = total;
        *n_tiles = total_tiles;
    }
    __syncthreads();
    for (int a = tid; a < n_assign; a += nt) {
        const int e = ids[a];
        if ((unsigned)e < (unsigned)n_expert) perm[atomicAdd(&cur[e], 1)] = a;
    }
    __syncthreads();
    for (int e = tid; e < n_expert; e += nt) {
        const int c = cnt[e], base = cur[e] - c;
        for (int i = 0; i * bn < c; ++i) {
            tiles[2 * (toff[e] + i)] = e;
            tiles[2 * (toff[e] + i) + 1] = base + i * bn;
        }
    }
}

#endif  // ST_CUDA
