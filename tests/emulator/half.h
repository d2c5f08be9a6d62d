// Element loads and stores for the emulated libraries (blas.cpp, dnn.cpp): f32, f16 and bf16
// (round to nearest even; NaN stays NaN), by kind. Each library maps its own type codes.
#pragma once
#include <cstdint>
#include <cstring>

enum Kind { K_F32, K_F16, K_BF16 };

// f16 to f32 by table: the compiler's conversion is a library call without F16C.
static float f16_values[65536];
static const bool f16_filled = [] {
    for (uint32_t b = 0; b < 65536; b++) {
        uint16_t bits = (uint16_t)b;
        _Float16 h;
        memcpy(&h, &bits, 2);
        f16_values[b] = (float)h;
    }
    return true;
}();

static inline float load(const void* p, Kind k, int64_t i) {
    switch (k) {
    case K_F32: return ((const float*)p)[i];
    case K_F16: return f16_values[((const uint16_t*)p)[i]];
    default: {
        uint32_t b = (uint32_t)((const uint16_t*)p)[i] << 16;
        float f;
        memcpy(&f, &b, 4);
        return f;
    }
    }
}
static inline void store(void* p, Kind k, int64_t i, float v) {
    switch (k) {
    case K_F32: ((float*)p)[i] = v; break;
    case K_F16: ((_Float16*)p)[i] = (_Float16)v; break;
    default: {
        uint32_t b;
        memcpy(&b, &v, 4);
        ((uint16_t*)p)[i] = v != v ? 0x7FFF : (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
    }
    }
}

// An f32 rounded to TF32 (10 explicit mantissa bits, round to nearest even), as a tensor core
// reads an f32 operand when TF32 is allowed. Infinities and NaNs pass unchanged.
static inline float tf32(float v) {
    uint32_t b;
    memcpy(&b, &v, 4);
    if ((b & 0x7F800000u) == 0x7F800000u) return v;
    b = (b + 0xFFFu + ((b >> 13) & 1u)) & ~0x1FFFu;
    memcpy(&v, &b, 4);
    return v;
}

// The most elements one tensor may have in a library call with 32-bit sizes (cuDNN's
// descriptors: 2^31 - 1), or the lower limit of MANTISSA_CUDA_INDEX_LIMIT, which the engine
// reads too (so that its split into pieces is tested without gigabytes of data).
#include <cstdlib>
static inline int64_t index_limit() {
    const char* v = getenv("MANTISSA_CUDA_INDEX_LIMIT");
    int64_t lim = v ? strtoll(v, nullptr, 10) : 0;
    return lim > 0 && lim < INT32_MAX ? lim : INT32_MAX;
}
