// Host stand-ins for the CUDA built-ins the kernel files use, so that a kernel file (with the
// prelude, exactly as NVRTC gets it) compiles as C++ and runs on one CPU thread. For tests
// only (src/backend/cuda/host_kernels.rs): they check the kernels' index arithmetic against the
// CPU backend without a GPU; a grid is one thread, atomics are plain read-modify-writes, and
// warp shuffles are not emulated (kernels with block reductions are not run this way).
// Included twice: before the kernel source, and after it with MANTISSA_HOST_TAIL defined (the
// half conversions the prelude declares need its types).

#ifndef MANTISSA_HOST_TAIL
#include <cmath>
#include <cstdint>
#include <cstring>

#define __global__
#define __device__
#define __forceinline__ inline
#define __align__(n) alignas(n)

using std::isfinite;
using std::isnan;

struct HostDim3 {
    unsigned x, y, z;
};
static const HostDim3 blockIdx = {0, 0, 0}, threadIdx = {0, 0, 0};
static const HostDim3 blockDim = {1, 1, 1}, gridDim = {1, 1, 1};

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
inline int atomicCAS(int* p, int compare, int value) {
    int old = *p;
    if (old == compare) *p = value;
    return old;
}
inline unsigned atomicCAS(unsigned* p, unsigned compare, unsigned value) {
    unsigned old = *p;
    if (old == compare) *p = value;
    return old;
}
inline float atomicAdd(float* p, float v) {
    float old = *p;
    *p = old + v;
    return old;
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline void __syncthreads() {}
// cvt.rzi.s64.f64: toward zero, saturating, NaN to 0.
inline long long host_f64_to_i64(double r) {
    if (r != r) return 0;
    if (r >= 9223372036854775807.0) return INT64_MAX;
    if (r <= -9223372036854775808.0) return INT64_MIN;
    return (long long)r;
}
inline float __shfl_xor_sync(unsigned, float v, int) { return v; }

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
