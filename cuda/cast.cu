// Casts between element types: contiguous, or from a strided view into a contiguous output.
// Every conversion goes through f32 and rounds to nearest even on store.

template <typename S, typename D>
__device__ void cast_contiguous(const S* __restrict__ src, D* __restrict__ dst, i64 n) {
    FOR_EACH(i, n) dst[i] = from_f32<D>(to_f32(src[i]));
}

template <typename S, typename D>
__device__ void cast_strided(const S* __restrict__ src, Strided l, D* __restrict__ dst, i64 n) {
    FOR_EACH(i, n) dst[i] = from_f32<D>(to_f32(src[strided_index(l, i)]));
}

#define CAST(S, D)                                                                         \
    extern "C" __global__ void cast_##S##_##D(const S* src, D* dst, i64 n) {              \
        cast_contiguous<S, D>(src, dst, n);                                                \
    }                                                                                      \
    extern "C" __global__ void cast_strided_##S##_##D(const S* src, Strided l, D* dst, i64 n) { \
        cast_strided<S, D>(src, l, dst, n);                                                \
    }

#define CAST_FROM(S) CAST(S, float) CAST(S, f16) CAST(S, bf16)
CAST_FROM(float)
CAST_FROM(f16)
CAST_FROM(bf16)
CAST_FROM(i64)
CAST_FROM(u8)
CAST(float, i64)
CAST(float, u8)

// Same-type copies of a strided view into a contiguous output, by element width.
#define COPY(T)                                                                            \
    extern "C" __global__ void copy_strided_##T(const T* src, Strided l, T* dst, i64 n) { \
        FOR_EACH(i, n) dst[i] = src[strided_index(l, i)];                                  \
    }
COPY(u8)
COPY(u16)
COPY(u32)
COPY(u64)

// The reverse: a contiguous source written into a strided view (a narrowed or permuted part
// of a larger tensor), by element width. The view must not overlap itself.
#define COPY_INTO(T)                                                                       \
    extern "C" __global__ void copy_into_strided_##T(const T* src, Strided l, T* dst, i64 n) { \
        FOR_EACH(i, n) dst[strided_index(l, i)] = src[i];                                  \
    }
COPY_INTO(u8)
COPY_INTO(u16)
COPY_INTO(u32)
COPY_INTO(u64)
