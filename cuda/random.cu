// Random tensors drawn from the Philox stream of src/random.rs, so the CPU and the GPU give
// the same values for the same generator state.

// Dropout multipliers (src/backend/cpu/mod.rs, dropout_mask): element i is `scale` when word
// i % 4 of block start + i / 4 of the stream keyed by `seed` is at least `threshold`, else 0.
// One thread per block of four words. `threshold` is p * 2^32 rounded up; it may be 2^32
// (nothing kept), hence 64 bits.
#define DROPOUT(T)                                                                             \
    extern "C" __global__ void dropout_mask_##T(u64 seed, u64 start, u64 threshold,            \
                                                float scale, T* out, i64 n) {                   \
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

DROPOUT(float)
DROPOUT(f16)
DROPOUT(bf16)
