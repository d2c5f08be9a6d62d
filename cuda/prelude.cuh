// mantissa CUDA prelude: prepended to every kernel file before NVRTC compiles it (sm_80+).
// No CUDA headers: f16 and bf16 are 16-bit storage types converted with inline PTX, and the
// arithmetic runs in f32 (half is a storage format, as on the CPU backend).

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// A kernel file compiles in up to three parts, so that a run compiles only the dtypes it
// uses, and the parts of the files it needs in parallel (src/backend/cuda/compile.rs):
// MANTISSA_PART 0 holds the f32 and integer kernels, 1 the f16 ones, 2 the bf16 ones; without
// it, one unit holds them all. A kernel's part is the first dtype its name spells
// (`cast_f16_float`: 1; `optim_master_float_bf16`: 0), which `PART(T, ...)` around an
// instantiation for dtype T, or `#if PART_HAS_0` around a kernel without one, must follow.
#if !defined(MANTISSA_PART) || MANTISSA_PART == 0
#define PART_HAS_0 1
#define PART_0(...) __VA_ARGS__
#else
#define PART_HAS_0 0
#define PART_0(...)
#endif
#if !defined(MANTISSA_PART) || MANTISSA_PART == 1
#define PART_HAS_1 1
#define PART_1(...) __VA_ARGS__
#else
#define PART_HAS_1 0
#define PART_1(...)
#endif
#if !defined(MANTISSA_PART) || MANTISSA_PART == 2
#define PART_HAS_2 1
#define PART_2(...) __VA_ARGS__
#else
#define PART_HAS_2 0
#define PART_2(...)
#endif
#define PART_float(...) PART_0(__VA_ARGS__)
#define PART_i64(...) PART_0(__VA_ARGS__)
#define PART_u8(...) PART_0(__VA_ARGS__)
#define PART_u16(...) PART_0(__VA_ARGS__)
#define PART_u32(...) PART_0(__VA_ARGS__)
#define PART_u64(...) PART_0(__VA_ARGS__)
#define PART_f16(...) PART_1(__VA_ARGS__)
#define PART_bf16(...) PART_2(__VA_ARGS__)
// The kernels of an instantiation for dtype T, in T's part only.
#define PART(T, ...) PART_##T(__VA_ARGS__)

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

struct __align__(2) f16 { u16 bits; };
struct __align__(2) bf16 { u16 bits; };

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(double x) { return (float)x; }
#ifdef __CUDACC_RTC__
__device__ __forceinline__ float to_f32(f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
#else
// Host builds of the kernel files (tests: src/backend/cuda/host_kernels.rs) define the half
// conversions in cuda/host_shim.h, after this file.
float to_f32(f16 x);
#endif
__device__ __forceinline__ float to_f32(bf16 x) { return __uint_as_float(((u32)x.bits) << 16); }

// Round to nearest even, as the CPU backend's `half` conversions do.
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
#ifdef __CUDACC_RTC__
template <> __device__ __forceinline__ f16 from_f32<f16>(float x) {
    f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) {
    bf16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}
#else
template <> f16 from_f32<f16>(float x);
template <> bf16 from_f32<bf16>(float x);
#endif

// Philox 4x32-10, the generator of src/random.rs: the same (counter, key) gives the same bits
// on the CPU and here.
__device__ __forceinline__ uint4 philox(uint4 c, uint2 k) {
    #pragma unroll
    for (int i = 0; i < 10; ++i) {
        u32 hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        u32 hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
        k.x += 0x9E3779B9u;
        k.y += 0xBB67AE85u;
    }
    return c;
}

// Stochastic rounding of an f32 to bf16 (src/backend/rounding.rs): round up in magnitude when
// the 16 discarded bits exceed r.
__device__ __forceinline__ bf16 bf16_stochastic(float x, u32 r) {
    bf16 out;
    if (!isfinite(x)) return from_f32<bf16>(x);
    u32 b = __float_as_uint(x);
    u32 kept = b & 0xFFFF0000u;
    out.bits = (u16)((kept + (((b & 0xFFFFu) > (r & 0xFFFFu)) ? 0x10000u : 0u)) >> 16);
    return out;
}

// A strided view: element i of the logical (row-major) shape lives at
// offset + sum_d idx_d * strides[d]. Broadcast dims have stride 0.
#define MAX_RANK 8
struct Strided {
    int rank;
    i64 offset;
    i64 shape[MAX_RANK];
    i64 strides[MAX_RANK];
};

__device__ __forceinline__ i64 strided_index(const Strided& l, i64 i) {
    i64 off = l.offset;
    for (int d = l.rank - 1; d >= 0; --d) {
        i64 n = l.shape[d];
        off += (i % n) * l.strides[d];
        i /= n;
    }
    return off;
}

// 16 bytes of T (4 floats, 8 halves), loaded and stored as one vector instruction.
template <typename T> struct __align__(16) Vec16 { T v[16 / sizeof(T)]; };
// Whether every pointer is 16-byte aligned, so Vec16 loads and stores may be used.
__device__ __forceinline__ bool aligned16(const void* a, const void* b, const void* c) {
    return ((((u64)a) | ((u64)b) | ((u64)c)) & 15) == 0;
}
// a / b and a % b, in unsigned 32-bit arithmetic where both are in [0, 2^32): a 64-bit
// division is a long software sequence on the GPU, per element more than the bytes of a
// memory-bound pass cost. Other operands (negative ones included) take the 64-bit division.
__device__ __forceinline__ i64 idiv(i64 a, i64 b) {
    return (u64)(a | b) < 4294967296ULL ? (i64)((u32)a / (u32)b) : a / b;
}
__device__ __forceinline__ i64 imod(i64 a, i64 b) {
    return (u64)(a | b) < 4294967296ULL ? (i64)((u32)a % (u32)b) : a % b;
}
// A grid-stride loop over n elements.
#define FOR_EACH(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

// Index and mask types convert through f32 too (class indices are exact below 2^24).
__device__ __forceinline__ float to_f32(i64 x) { return (float)x; }
__device__ __forceinline__ float to_f32(u8 x) { return (float)x; }
// To the integer types as Rust's `as` (the CPU backend): toward zero, saturating, NaN to 0.
template <> __device__ __forceinline__ i64 from_f32<i64>(float x) {
    if (x != x) return 0;
    if (x >= 9223372036854775807.0f) return 9223372036854775807LL;
    if (x <= -9223372036854775808.0f) return -9223372036854775807LL - 1;
    return (i64)x;
}
template <> __device__ __forceinline__ u8 from_f32<u8>(float x) {
    return x != x || x <= 0.0f ? (u8)0 : (x >= 255.0f ? (u8)255 : (u8)x);
}

// Block-wide reductions for blocks of a multiple of 32 threads (at most 1024); every thread
// gets the result. `scratch` holds 32 floats of shared memory.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// Max and min that propagate NaN, as the CPU backend and PyTorch do (fmaxf drops it).
__device__ __forceinline__ float nan_max(float a, float b) { return a > b || a != a ? a : b; }
__device__ __forceinline__ float nan_min(float a, float b) { return a < b || a != a ? a : b; }
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_min(float v) {
    for (int o = 16; o > 0; o >>= 1) v = nan_min(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// op: 0 sum, 1 max, 2 min.
__device__ __forceinline__ float warp_reduce(int op, float v) {
    return op == 0 ? warp_sum(v) : (op == 1 ? warp_max(v) : warp_min(v));
}
__device__ float block_reduce(int op, float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_reduce(op, v);
    __syncthreads(); // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float id = op == 0 ? 0.0f : (op == 1 ? -INFINITY : INFINITY);
    v = lane < warps ? scratch[lane] : id;
    return warp_reduce(op, v);
}

// The entry of a launch list (the optimizer's, the unscale's, the copies') whose chunks
// include chunk b: entry k's chunks are numbered from start[k], increasing.
__device__ __forceinline__ int list_entry(const i64* start, i64 count, i64 b) {
    int k = 0;
    while (k + 1 < count && start[k + 1] <= b) ++k;
    return k;
}
