// gemm_decoders_host.cpp: gemm.cu's pipelined any-type decoders (GmRaw, from registers)
// against quants.cuh's qt_group32_block_inl (from memory), compiled for the host by
// gemm_decoders_host.rs: every value of random blocks of IQ3_S, Q6_K, Q5_K and IQ4_XS, at
// every block alignment rows of 1 to 9 blocks give, must match bit for bit, and every load
// must be aligned for its width and stay inside the matrix.
// Invariant: the device built-ins are modelled exactly (round-to-nearest f32 products, no
// contraction: build with -ffp-contract=off), so a mismatch here is a mismatch on the GPU.
#include <cassert>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#define __device__
#define __forceinline__ inline
#define __noinline__
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
struct uint4 { u32 x, y, z, w; };
struct uint2 { u32 x, y; };
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(u32 i) { float f; memcpy(&f, &i, 4); return f; }
static inline float st_bf2f(u16 h) { return __uint_as_float((u32)h << 16); }
// f16 bits -> f32, exact (normal, subnormal, infinite and NaN).
static inline float st_h2f(u16 h) {
    const u32 s = (u32)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023;
    if (e == 31) return __uint_as_float(s | 0x7f800000u | (m << 13));
    if (e != 0) return __uint_as_float(s | ((e + 112) << 23) | (m << 13));
    const float v = (float)m * (1.0f / 16777216.0f);  // m * 2^-24, exact
    return s ? -v : v;
}
static inline u32 __byte_perm(u32 x, u32 y, u32 s) {
    const uint64_t b = ((uint64_t)y << 32) | x;
    u32 r = 0;
    for (int n = 0; n < 4; ++n) r |= (u32)((b >> (8 * ((s >> (4 * n)) & 7))) & 0xff) << (8 * n);
    return r;
}
static inline u32 __funnelshift_r(u32 lo, u32 hi, u32 sh) {
    return (u32)((((uint64_t)hi << 32) | lo) >> (sh & 31));
}
static const u8* g_lo;
static const u8* g_hi;
static int g_bad_loads;
template <class T>
static inline T __ldg(const T* p) {
    const u8* b = (const u8*)p;
    if ((uintptr_t)p % sizeof(T) != 0 || b < g_lo || b + sizeof(T) > g_hi) ++g_bad_loads;
    T v;
    memcpy(&v, p, sizeof v);
    return v;
}
#include "quant_tables.cuh"
#include "quants.cuh"
#include "gemm_pipe.inc"

// Random blocks (f16 scales set to normal values in [2^-11, 2^-9)) of `rows` rows of `ncb`
// blocks in a 16-byte aligned matrix; returns the values that differ.
template <int T>
static long check(std::mt19937& rng, int ncb, int rows) {
    const int bb = GmRaw<T>::BYTES;
    const size_t n = (size_t)rows * ncb * bb;
    u8* buf = (u8*)aligned_alloc(16, (n + 15) / 16 * 16);
    for (size_t i = 0; i < n; ++i) buf[i] = (u8)rng();
    for (size_t b = 0; b < (size_t)rows * ncb; ++b) {
        u8* blk = buf + b * bb;
        auto scale = [&](int at) {
            const u16 h = (u16)(0x1000 + rng() % 0x800);
            memcpy(blk + at, &h, 2);
        };
        if (T == QT_Q6_K) {
            scale(208);
        } else {
            scale(0);
            if (T == QT_Q5_K) scale(2);
        }
    }
    g_lo = buf;
    g_hi = buf + n;
    long bad = 0;
    for (int r = 0; r < rows; ++r)
        for (int g = 0; g < ncb * 8; ++g) {
            const u8* b = buf + (size_t)r * ncb * bb + (g / 8) * bb;
            GmRaw<T> raw;
            raw.fetch(b, g & 7);
            float v[32], w[32];
            raw.decode(g & 7, v, IQ3S_GRID);
            qt_group32_block_inl(T, b, g & 7, w);
            for (int j = 0; j < 32; ++j)
                if (memcmp(&v[j], &w[j], 4) != 0 && bad++ < 4)
                    printf("type %d row %d group %d value %d: %.9g, want %.9g\n", T, r, g, j,
                           v[j], w[j]);
        }
    free(buf);
    return bad;
}

int main() {
    std::mt19937 rng(7);
    long bad = 0, cases = 0;
    for (int ncb = 1; ncb <= 9; ++ncb)
        for (int rows : {1, 3, 17}) {
            bad += check<QT_IQ3_S>(rng, ncb, rows);
            bad += check<QT_Q6_K>(rng, ncb, rows);
            bad += check<QT_Q5_K>(rng, ncb, rows);
            bad += check<QT_IQ4_XS>(rng, ncb, rows);
            cases += 4;
        }
    printf("%ld cases: %ld values differ, %d loads misaligned or outside the matrix\n", cases,
           bad, g_bad_loads);
    return bad != 0 || g_bad_loads != 0;
}
