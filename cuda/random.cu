// Random tensors drawn from the Philox stream of src/random.rs, so the CPU and the GPU give
// the same values for the same generator state.

// Dropout multipliers (src/backend/cpu/mod.rs, dropout_mask): element i is `scale` when word
// i % 4 of block start + i / 4 of the stream keyed by `seed` is at least `threshold`, else 0.
// One thread per block of four words. `threshold` is p * 2^32 rounded up; it may be 2^32
// (nothing kept), hence 64 bits.
// In a CUDA graph the generator's state is read when the replay runs: `state` (else null)
// points at its [seed, offset], and `start` is then the draw's offset within the step.
#define DROPOUT(T)                                                                             \
    extern "C" __global__ void dropout_mask_##T(u64 seed, u64 start, u64 threshold,            \
                                                float scale, T* out, i64 n, const u64* state) {   \
        if (state) seed = state[0], start += state[1];                                      \
        T keep = from_f32<T>(scale), drop = from_f32<T>(0.0f);                                 \
        uint2 key = make_uint2((u32)seed, (u32)(seed >> 32));                                  \
        FOR_EACH(b, (n + 3) / 4) {                                                             \
            u64 ctr = start + (u64)b;                                                          \
            uint4 w = philox(make_uint4((u32)ctr, (u32)(ctr >> 32), 0u, 0u), key);             \
            u32 words[4] = {w.x, w.y, w.z, w.w};                                               \
            for (int l = 0; l < 4; ++l) {                                                      \
                i64 i = 4 * b + l;                                                             \
                if (i < n) out[i] = (u64)words[l] >= threshold ? keep : drop;                  \
            }                                                                                  \
        }                                                                                      \
    }

PART(float, DROPOUT(float))
PART(f16, DROPOUT(f16))
PART(bf16, DROPOUT(bf16))

// Normal draws (src/backend/cpu/random.rs, normal; src/random.rs, box_muller): elements 2j
// and 2j + 1 are mean + std * (r cos t, r sin t) with r = sqrt(-2 ln(1 - u0)), t = 2 pi u1,
// where u0 and u1 are the 53-bit uniforms of words (0, 1) and (2, 3) of block start + j. In
// f64 as on the host, rounded once to T. One thread per block. `state` as for dropout.
__device__ __forceinline__ double unit53(u32 hi, u32 lo) {
    return (double)((((u64)hi << 21) ^ ((u64)lo >> 11)) & ((1ull << 53) - 1)) *
           1.1102230246251565e-16;  // 2^-53
}

#define NORMAL(T)                                                                              \
    extern "C" __global__ void normal_##T(u64 seed, u64 start, double mean, double std_,       \
                                          T* out, i64 n, const u64* state) {                   \
        if (state) seed = state[0], start += state[1];                                      \
        uint2 key = make_uint2((u32)seed, (u32)(seed >> 32));                                  \
        FOR_EACH(b, (n + 1) / 2) {                                                             \
            u64 ctr = start + (u64)b;                                                          \
            uint4 w = philox(make_uint4((u32)ctr, (u32)(ctr >> 32), 0u, 0u), key);             \
            double r = sqrt(-2.0 * log(1.0 - unit53(w.x, w.y)));                               \
            double t = 6.283185307179586 * unit53(w.z, w.w);                                   \
            i64 i = 2 * b;                                                                     \
            out[i] = from_f32<T>((float)(mean + std_ * (r * cos(t))));                         \
            if (i + 1 < n) out[i + 1] = from_f32<T>((float)(mean + std_ * (r * sin(t))));      \
        }                                                                                      \
    }

PART(float, NORMAL(float))
PART(f16, NORMAL(f16))
PART(bf16, NORMAL(bf16))
