// Host stand-ins for the CUDA built-ins the kernel files use, so that a kernel file (with the
// prelude, exactly as NVRTC gets it) compiles as C++ and runs on the CPU. For tests only
// (src/backend/cuda/host_kernels/): they check the kernels' index arithmetic against the CPU
// backend without a GPU. Called directly, a kernel runs as a grid of one thread. Through
// run_grid, one OS thread per CUDA thread, a block at a time (host_block, host_thread):
// __syncthreads is a barrier, __shared__ memory a static, atomics are real atomics, and a
// warp shuffle an exchange through memory between two block-wide barriers (so every thread
// of the block must reach each shuffle, as block_reduce's callers do).
// Included twice: before the kernel source, and after it with MANTISSA_HOST_TAIL defined (the
// half conversions the prelude declares need its types).

#ifndef MANTISSA_HOST_TAIL
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>

#ifndef __global__
#define __global__
#endif
#define __device__
#define __forceinline__ inline
#define __align__(n) alignas(n)
#define __shared__ static

using std::isfinite;
using std::isnan;

struct HostDim3 {
    unsigned x, y, z;
};
static thread_local HostDim3 blockIdx = {0, 0, 0}, threadIdx = {0, 0, 0};
static thread_local HostDim3 blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
static std::barrier<>* host_barrier = nullptr;
static float host_lanes[1024];

// Before a block's threads start: a barrier for `threads` of them.
extern "C" void host_block(unsigned threads) {
    delete host_barrier;
    host_barrier = threads > 1 ? new std::barrier<>(threads) : nullptr;
}
// On each thread, before it calls the kernel: its place in the grid.
extern "C" void host_thread(unsigned block, unsigned thread, unsigned threads, unsigned blocks) {
    blockIdx = {block, 0, 0};
    threadIdx = {thread, 0, 0};
    blockDim = {threads, 1, 1};
    gridDim = {blocks, 1, 1};
}

struct uint2 {
    unsigned x, y;
};
struct uint4 {
    unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline unsigned __umulhi(unsigned a, unsigned b) {
    return (unsigned)(((unsigned long long)a * b) >> 32);
}
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline float __int_as_float(int u) { return __uint_as_float((unsigned)u); }
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
// Real atomics (C++20 atomic_ref), so that kernels run by many emulated threads at once
// (run_grid) contend as on the GPU. A failed compare-exchange loads the current value into
// `compare`, so it holds the old value either way.
inline int atomicCAS(int* p, int compare, int value) {
    std::atomic_ref<int>(*p).compare_exchange_strong(compare, value);
    return compare;
}
inline unsigned atomicCAS(unsigned* p, unsigned compare, unsigned value) {
    std::atomic_ref<unsigned>(*p).compare_exchange_strong(compare, value);
    return compare;
}
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline void __syncthreads() {
    if (host_barrier) host_barrier->arrive_and_wait();
}
// cvt.rzi.s64.f64: toward zero, saturating, NaN to 0.
inline long long host_f64_to_i64(double r) {
    if (r != r) return 0;
    if (r >= 9223372036854775807.0) return INT64_MAX;
    if (r <= -9223372036854775808.0) return INT64_MIN;
    return (long long)r;
}
inline float __shfl_xor_sync(unsigned, float v, int mask) {
    host_lanes[threadIdx.x] = v;
    __syncthreads();
    float r = host_lanes[threadIdx.x ^ mask];
    __syncthreads();
    return r;
}

#else

float to_f32(f16 x) {
    _Float16 h;
    std::memcpy(&h, &x.bits, 2);
    return (float)h;
}
template <> f16 from_f32<f16>(float x) {
    _Float16 h = (_Float16)x;
    f16 r;
    std::memcpy(&r.bits, &h, 2);
    return r;
}
template <> bf16 from_f32<bf16>(float x) {
    unsigned b = __float_as_uint(x);
    bf16 r;
    if (std::isnan(x)) {
        r.bits = 0x7FFF;
        return r;
    }
    b += 0x7FFFu + ((b >> 16) & 1u);
    r.bits = (u16)(b >> 16);
    return r;
}

#endif
