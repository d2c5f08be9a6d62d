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
PART(float, CAST_FROM(float))
PART(f16, CAST_FROM(f16))
PART(bf16, CAST_FROM(bf16))
PART(i64, CAST_FROM(i64))
PART(u8, CAST_FROM(u8))
PART(float, CAST(float, i64))
PART(float, CAST(float, u8))

// Same-type copies of a strided view into a contiguous output, by element width.
#define COPY(T)                                                                            \
    extern "C" __global__ void copy_strided_##T(const T* src, Strided l, T* dst, i64 n) { \
        FOR_EACH(i, n) dst[i] = src[strided_index(l, i)];                                  \
    }
PART(u8, COPY(u8))
PART(u16, COPY(u16))
PART(u32, COPY(u32))
PART(u64, COPY(u64))

// The reverse: a contiguous source written into a strided view (a narrowed or permuted part
// of a larger tensor), by element width. The view must not overlap itself.
#define COPY_INTO(T)                                                                       \
    extern "C" __global__ void copy_into_strided_##T(const T* src, Strided l, T* dst, i64 n) { \
        FOR_EACH(i, n) dst[strided_index(l, i)] = src[i];                                  \
    }
PART(u8, COPY_INTO(u8))
PART(u16, COPY_INTO(u16))
PART(u32, COPY_INTO(u32))
PART(u64, COPY_INTO(u64))

// Up to COPY_LIST two-dimensional copies per launch (cat's inputs into their places in the
// output): copy k moves rows[k] x cols[k] elements from src[k] (row stride sld[k]) to dst[k]
// (row stride dld[k]), in chunks of COPY_CHUNK numbered from start[k]; the destinations do
// not overlap. At most 4 KB of kernel parameters. By element width.
#define COPY_LIST 64
#define COPY_CHUNK 8192
struct CopyList {
    i64 count;
    i64 chunks;
    const void* src[COPY_LIST];
    void* dst[COPY_LIST];
    i64 rows[COPY_LIST];
    i64 cols[COPY_LIST];
    i64 sld[COPY_LIST];
    i64 dld[COPY_LIST];
    i64 start[COPY_LIST];
};

template <typename T>
__device__ void copy_list(const CopyList& L) {
    for (i64 b = blockIdx.x; b < L.chunks; b += gridDim.x) {
        int k = list_entry(L.start, L.count, b);
        i64 n = L.rows[k] * L.cols[k], cols = L.cols[k];
        i64 begin = (b - L.start[k]) * COPY_CHUNK;
        i64 end = begin + COPY_CHUNK < n ? begin + COPY_CHUNK : n;
        const T* src = (const T*)L.src[k];
        T* dst = (T*)L.dst[k];
        for (i64 e = begin + threadIdx.x; e < end; e += blockDim.x) {
            i64 r = e / cols, c = e - r * cols;
            dst[r * L.dld[k] + c] = src[r * L.sld[k] + c];
        }
    }
}

#define COPY_LIST_OF(T) \
    extern "C" __global__ void copy_list_##T(CopyList list) { copy_list<T>(list); }
PART(u8, COPY_LIST_OF(u8))
PART(u16, COPY_LIST_OF(u16))
PART(u32, COPY_LIST_OF(u32))
PART(u64, COPY_LIST_OF(u64))
