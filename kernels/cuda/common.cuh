// common.cuh: the small vendor layer every kernel source is prefixed with (the embedding crate
// concatenates it; no #include is needed at run time, so NVRTC and hiprtc need no header path).
// Invariant: vendor specifics (half conversion, warp shuffles, warp size) live only here.

#if defined(__HIPCC__) || defined(__HIP_DEVICE_COMPILE__) || defined(__HIPCC_RTC__)
#define ST_HIP 1
// The wave size is the host's to say: RDNA (gfx10/11/12) runs wave32 by default and wave64
// with -mwavefrontsize64, CDNA (gfx9) only wave64, and LLVM no longer tells the source which
// one it compiles for. The host passes -DST_WARP=<the device's warpSize> (and
// -mwavefrontsize64 where that is 64 on RDNA); st_wave_check() traps on a mismatch.
#ifndef ST_WARP
#error "HIP: compile with -DST_WARP=32 or -DST_WARP=64 (the device's warpSize)"
#endif
#if ST_WARP != 32 && ST_WARP != 64
#error "HIP: ST_WARP must be 32 or 64"
#endif
#define ST_SHFL_XOR(v, m) __shfl_xor((v), (m), ST_WARP)
#define ST_SHFL(v, l) __shfl((v), (l), ST_WARP)
// A wavefront runs in lockstep; the barrier orders its shared-memory accesses.
#define ST_SYNCWARP() __builtin_amdgcn_wave_barrier()
#else
#define ST_CUDA 1
#define ST_WARP 32
#define ST_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#define ST_SHFL(v, l) __shfl_sync(0xffffffffu, (v), (l))
#define ST_SYNCWARP() __syncwarp()
#endif

#define ST_KERNEL extern "C" __global__

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;

// A load that skips this SM's / CU's L1, for data another block of the same kernel (or the
// kernel ahead, under PDL) wrote: CUDA's __ldcg; on HIP a relaxed agent-scope atomic load,
// which the compiler issues as a load that bypasses the CU's vector L1.
#ifdef ST_CUDA
#define st_ldcg(p) __ldcg(p)
#else
template <typename T>
__device__ __forceinline__ T st_ldcg(const T* p) {
    return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
__device__ __forceinline__ float4 st_ldcg(const float4* p) {
    const float* f = (const float*)p;
    return make_float4(st_ldcg(f), st_ldcg(f + 1), st_ldcg(f + 2), st_ldcg(f + 3));
}
#endif

// A device clock in nanoseconds, for profiling aids only: CUDA's %globaltimer; on HIP the
// constant-rate wall clock, 100 MHz on every AMD GPU ROCm supports
// (hipDeviceAttributeWallClockRate reports it in kHz), hence 10 ns a tick.
__device__ __forceinline__ unsigned long long st_globaltimer_ns() {
#ifdef ST_CUDA
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
#else
    return (unsigned long long)wall_clock64() * 10ull;
#endif
}

// Programmatic dependent launch (sm_90 and later; a no-op elsewhere and when the host
// launched the kernel without the attribute). The host may start a kernel before the one
// ahead of it on the stream has finished; such a kernel may only prefetch weights (never
// written during a step) before st_pdl_wait(), which returns once the kernel ahead has
// completed and its writes are visible. Every kernel the host launches this way calls
// st_pdl_wait() on every path, and st_pdl_launch() only after it, so the kernel after it
// starts no earlier than this one's wait: when a kernel's pre-wait code runs, the kernel two
// ahead of it has completed.
__device__ __forceinline__ void st_pdl_wait() {
#if defined(ST_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void st_pdl_launch() {
#if defined(ST_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// Wait for the kernel ahead, then let the next one start (the usual kernel entry).
__device__ __forceinline__ void st_pdl_enter() {
    st_pdl_wait();
    st_pdl_launch();
}

// Ask L2 to fetch [p, p + bytes): the calling warp's lanes take one 128-byte line each in
// turn. Only a hint (L2 is the GPU's point of coherence, so it can never make a later load
// stale), hence allowed before st_pdl_wait().
__device__ __forceinline__ void st_prefetch_l2(const void* p, long bytes) {
#ifdef ST_CUDA
    const char* c = (const char*)p;
    for (long o = (long)(threadIdx.x % ST_WARP) * 128; o < bytes; o += ST_WARP * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(c + o));
#endif
}

#define ST_NEG_INF (__int_as_float(0xff800000))

// f16 bits -> f32, exact.
__device__ __forceinline__ float st_h2f(u16 h) {
#ifdef ST_CUDA
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    _Float16 v = __builtin_bit_cast(_Float16, h);
    return (float)v;
#endif
}

// f32 -> f16 bits, round to nearest even.
__device__ __forceinline__ u16 st_f2h(float f) {
#ifdef ST_CUDA
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    return __builtin_bit_cast(u16, (_Float16)f);
#endif
}

// bf16 bits -> f32, exact.
__device__ __forceinline__ float st_bf2f(u16 b) {
    return __uint_as_float(((u32)b) << 16);
}

// Little-endian u16 at a byte address with only 2-byte alignment guaranteed.
__device__ __forceinline__ u16 st_ld_u16(const u8* p) {
    return *(const u16*)p;
}

// Traps when the source's wave size (ST_WARP) is not the one the code runs in: every warp
// reduction assumes they agree. Folded away at compile time (the builtin is a constant of
// the target), so it costs nothing when they do.
__device__ __forceinline__ void st_wave_check() {
#ifdef ST_HIP
    if (__builtin_amdgcn_wavefrontsize() != ST_WARP) __builtin_trap();
#endif
}

__device__ __forceinline__ float st_warp_sum(float v) {
    st_wave_check();
#pragma unroll
    for (int m = ST_WARP / 2; m > 0; m >>= 1) v += ST_SHFL_XOR(v, m);
    return v;
}

__device__ __forceinline__ float st_warp_max(float v) {
    st_wave_check();
#pragma unroll
    for (int m = ST_WARP / 2; m > 0; m >>= 1) v = fmaxf(v, ST_SHFL_XOR(v, m));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of the warp size, at most 32 warps).
// `red` is shared scratch of at least 32 floats. Every thread gets the result.
__device__ __forceinline__ float st_block_sum(float v, float* red) {
    const int lane = threadIdx.x % ST_WARP, warp = threadIdx.x / ST_WARP;
    const int nw = blockDim.x / ST_WARP;
    v = st_warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < nw ? red[lane] : 0.0f;
    return st_warp_sum(v);
}

__device__ __forceinline__ float st_block_max(float v, float* red) {
    const int lane = threadIdx.x % ST_WARP, warp = threadIdx.x / ST_WARP;
    const int nw = blockDim.x / ST_WARP;
    v = st_warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < nw ? red[lane] : ST_NEG_INF;
    return st_warp_max(v);
}

// The four signed bytes of q as exact floats, without the quarter-rate integer-to-float
// conversion: flip each byte's sign bit (b + 128, 0..255), splice it under the exponent of
// 2^23 (the float 2^23 + b + 128, exact), subtract 2^23 + 128. One byte permute and one add
// per value, both full-rate on CUDA cores.
__device__ __forceinline__ void st_i8x4_to_f32(int q, float* out) {
#ifdef ST_CUDA
    const u32 u = (u32)q ^ 0x80808080u;
    out[0] = __int_as_float(__byte_perm(u, 0x4B000000u, 0x7650)) - 8388736.0f;
    out[1] = __int_as_float(__byte_perm(u, 0x4B000000u, 0x7651)) - 8388736.0f;
    out[2] = __int_as_float(__byte_perm(u, 0x4B000000u, 0x7652)) - 8388736.0f;
    out[3] = __int_as_float(__byte_perm(u, 0x4B000000u, 0x7653)) - 8388736.0f;
#else
    out[0] = (float)(i8)(q & 0xff);
    out[1] = (float)(i8)((q >> 8) & 0xff);
    out[2] = (float)(i8)((q >> 16) & 0xff);
    out[3] = (float)(i8)((q >> 24) & 0xff);
#endif
}

// The four unsigned bytes of q minus `sub` (an integer 0..255) as exact floats: on CUDA the
// byte spliced under the exponent of 2^23 (the float 2^23 + b, exact) less 2^23 + sub, one
// byte permute and one add per value (st_i8x4_to_f32's trick, for the K-quants' unsigned
// 4- to 6-bit fields).
__device__ __forceinline__ void st_u8x4_to_f32(u32 q, float sub, float* out) {
#ifdef ST_CUDA
    const float off = 8388608.0f + sub;
    out[0] = __int_as_float(__byte_perm(q, 0x4B000000u, 0x7650)) - off;
    out[1] = __int_as_float(__byte_perm(q, 0x4B000000u, 0x7651)) - off;
    out[2] = __int_as_float(__byte_perm(q, 0x4B000000u, 0x7652)) - off;
    out[3] = __int_as_float(__byte_perm(q, 0x4B000000u, 0x7653)) - off;
#else
    out[0] = (float)(q & 0xff) - sub;
    out[1] = (float)((q >> 8) & 0xff) - sub;
    out[2] = (float)((q >> 16) & 0xff) - sub;
    out[3] = (float)(q >> 24) - sub;
#endif
}

// GGUF block constants.
#define QK8_0 32
#define Q8_0_BYTES 34
#define QK_K 256
#define Q4_K_BYTES 144

// ggml's get_scale_min_k4: 6-bit scale and min of sub-block j (0..8) of a Q4_K block.
__device__ __forceinline__ void st_scale_min_k4(int j, const u8* q, float* sc, float* m) {
    if (j < 4) {
        *sc = (float)(q[j] & 63);
        *m = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

// Weight types as the kernels number them (the host passes these, not ggml ids): ST_TY_F32,
// ST_TY_F16, ST_TY_BF16, ST_TY_Q8_0, ST_TY_Q4_K from the generated prelude.

// Element i of a row of type ty (ST_TY_*), dequantized.
__device__ __forceinline__ float st_row_elem(const u8* row, int ty, long i) {
    switch (ty) {
        case ST_TY_F32: return ((const float*)row)[i];
        case ST_TY_F16: return st_h2f(st_ld_u16(row + 2 * i));
        case ST_TY_BF16: return st_bf2f(st_ld_u16(row + 2 * i));
        case ST_TY_Q8_0: {
            const u8* blk = row + (i / QK8_0) * Q8_0_BYTES;
            return st_h2f(st_ld_u16(blk)) * (float)(i8)blk[2 + i % QK8_0];
        }
        case ST_TY_Q4_K: {
            const u8* blk = row + (i / QK_K) * Q4_K_BYTES;
            const int r = (int)(i % QK_K), g = r / 64, hi = (r % 64) >= 32, l = r % 32;
            float sc, m;
            st_scale_min_k4(2 * g + hi, blk + 4, &sc, &m);
            const u8 q = blk[16 + 32 * g + l];
            const float d = st_h2f(st_ld_u16(blk)), dmin = st_h2f(st_ld_u16(blk + 2));
            return (d * sc) * (float)(hi ? (q >> 4) : (q & 0xF)) - dmin * m;
        }
    }
    return 0.0f;
}

// Attention: warps per block of the decode kernels (ATT_MAX_D, the largest head dimension,
// from the generated prelude).
#define ATT_WARPS 4

// KV cells beyond the VRAM window (`--kv-resident`): cells [0, resident) of a slot live in
// its VRAM rows; cell c >= resident is spilled cell i = slot * per_slot + (c - resident) of
// the device's pinned host chunks, mapped into the device's address space: cell i % per_chunk
// of chunk i / per_chunk, each cell cell_bytes long and holding every KV layer of the stage
// (layer l's K row at 2 l row_bytes, its V row next), this launch's layer's rows at k_off /
// v_off. per_slot 0: nothing spilled (resident is the whole context). Passed by value; CUDA
// (sm_70 on) reads it in place (__grid_constant__: no per-thread copy of the table), HIP
// copies it.
struct KvHost {
    unsigned long long chunk[KVH_MAX_CHUNKS];
    long cell_bytes;
    long k_off;
    long v_off;
    int resident;
    int per_slot;
    int per_chunk;
    // 1: the host CPU attends the cells past `resident` (`--kv-host cpu`): dq_attn_gqa walks
    // only the window, and dq_attn_combine merges the host's partial.
    int cpu_part;
};
#if defined(ST_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
#define ST_GRID_CONST __grid_constant__
#else
#define ST_GRID_CONST
#endif

// The K (or V: base and host_off the V ones) row of cell c of slot slot: base + c * row_bytes
// in the VRAM window, else the spilled cell's row in host memory.
__device__ __forceinline__ const u8* kvh_row(const u8* base, long row_bytes, const KvHost& h,
                                             int slot, int c, long host_off) {
    if (c < h.resident) return base + (long)c * row_bytes;
    const long i = (long)slot * h.per_slot + (c - h.resident);
    return (const u8*)h.chunk[i / h.per_chunk] + (i % h.per_chunk) * h.cell_bytes + host_off;
}

__device__ __forceinline__ float att_elem(const u8* row, int ty, int i) {
    if (ty == ST_TY_F16) return st_h2f(st_ld_u16(row + 2 * i));
    if (ty == ST_TY_F32) return ((const float*)row)[i];
    const u8* blk = row + (i / QK8_0) * Q8_0_BYTES;
    return st_h2f(st_ld_u16(blk)) * (float)(i8)blk[2 + i % QK8_0];
}

// Qwen3's per-head QK-norm and NEOX RoPE of one head, in place: x[0..hd) RMS-normalised by w
// (hd weights; null skips it), then the first n_rot dims rotated in pairs (i, i + n_rot/2) by
// angle inv_freq[i] * p with cos/sin scaled by attn_factor. Every thread of the block calls
// it; sh holds hd floats of shared memory, red 32. Ends with the block's writes to x visible
// to the whole block.
__device__ __forceinline__ void st_head_norm_rope(float* x, const float* w, float eps, float p,
                                                  const float* inv_freq, float attn_factor,
                                                  int hd, int n_rot, float* sh, float* red) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        const float v = x[i];
        sh[i] = v;
        ss += v * v;
    }
    ss = st_block_sum(ss, red);
    if (w) {
        const float r = 1.0f / sqrtf(ss / (float)hd + eps);
        for (int i = threadIdx.x; i < hd; i += blockDim.x) sh[i] = w[i] * (sh[i] * r);
    }
    __syncthreads();
    const int half = n_rot / 2;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        if (i < half) {
            float s, c;
            sincosf(inv_freq[i] * p, &s, &c);
            c *= attn_factor;
            s *= attn_factor;
            const float a = sh[i], b = sh[i + half];
            x[i] = a * c - b * s;
            x[i + half] = b * c + a * s;
        } else if (i >= n_rot) {
            x[i] = sh[i];
        }
    }
    __syncthreads();
}
