// Indexing with indices left on the device (src/backend/cpu/index.rs gives the same results).
// Each kernel checks every index against the indexed size: one out of range writes `slot`
// into `*fault` (its launch's own word; src/backend/cuda/faults.rs reports it at the next
// read) and is skipped. `take` copies elements by width for index_select and gather;
// `add_at` adds with atomics for scatter_add and index_add; `add_groups` adds in a fixed
// order the host lays out, rounding after each addition as the CPU does (the deterministic
// mode: no atomics, repeats bit for bit).

__device__ __forceinline__ bool index_ok(i64 k, i64 size, int* fault, int slot) {
    if (k >= 0 && k < size) return true;
    atomicCAS(fault, 0, slot);
    return false;
}

// Only checks the indices: an op with no elements to move (another dim is empty) still
// rejects an index out of range, as the CPU does.
#if PART_HAS_0
extern "C" __global__ void check_indices(const i64* idx, i64 n, i64 size, int* fault, int slot) {
    FOR_EACH(i, n) { index_ok(idx[i], size, fault, slot); }
}
#endif

// The index of element i: idx[i] (gather, scatter: inner == 0) or idx[(i / inner) % nidx]
// (index_select, index_add: inner = the elements after the indexed dim).
__device__ __forceinline__ i64 index_of(const i64* idx, i64 i, i64 inner, i64 nidx) {
    return inner > 0 ? idx[(i / inner) % nidx] : idx[i];
}

// out[i] = x[base(i) + k * dim_stride]: `base` is the source view in the output's shape with
// stride 0 along the indexed dim; an index out of range gives 0.
#define TAKE(T)                                                                                \
    extern "C" __global__ void take_##T(const T* x, Strided base, const i64* idx, i64 inner,   \
                                        i64 nidx, i64 size, i64 dim_stride, T* out, i64 n,     \
                                        int* fault, int slot) {                                \
        FOR_EACH(i, n) {                                                                       \
            i64 k = index_of(idx, i, inner, nidx);                                             \
            out[i] = index_ok(k, size, fault, slot) ? x[strided_index(base, i) + k * dim_stride] \
                                                    : (T)0;                                    \
        }                                                                                      \
    }
PART(u8, TAKE(u8))
PART(u16, TAKE(u16))
PART(u32, TAKE(u32))
PART(u64, TAKE(u64))

// Atomic `*p += v`, rounding the sum to p's type. Halves go through a compare-and-swap of the
// aligned 32-bit word that holds them, which may reach the 2 bytes after a tensor's last
// element (the caching allocator's blocks are whole 512-byte multiples, and cuMemAlloc's
// are 256-byte aligned, so that word lies inside the allocation).
__device__ __forceinline__ void atomic_add(float* p, float v) { atomicAdd(p, v); }
template <typename T> __device__ __forceinline__ void atomic_add_half(T* p, float v) {
    u32* word = (u32*)((u64)p & ~(u64)3);
    u32 shift = ((u64)p & 2) ? 16 : 0;
    u32 old = *word, assumed;
    do {
        assumed = old;
        T cur;
        cur.bits = (u16)(assumed >> shift);
        T sum = from_f32<T>(to_f32(cur) + v);
        u32 next = (assumed & ~(0xFFFFu << shift)) | ((u32)sum.bits << shift);
        old = atomicCAS(word, assumed, next);
    } while (old != assumed);
}
__device__ __forceinline__ void atomic_add(f16* p, float v) { atomic_add_half(p, v); }
__device__ __forceinline__ void atomic_add(bf16* p, float v) { atomic_add_half(p, v); }

// dst[dbase(i) + k * dim_stride] += src[sview(i)] over the iteration shape (the index's for
// scatter_add, the source's for index_add); dst is contiguous.
#define ADD_AT(T)                                                                              \
    extern "C" __global__ void add_at_##T(T* dst, Strided dbase, i64 dim_stride,               \
                                          const i64* idx, i64 inner, i64 nidx, i64 size,       \
                                          const T* src, Strided sview, i64 n, int* fault,      \
                                          int slot) {                                          \
        FOR_EACH(i, n) {                                                                       \
            i64 k = index_of(idx, i, inner, nidx);                                             \
            if (index_ok(k, size, fault, slot)) {                                              \
                atomic_add(dst + strided_index(dbase, i) + k * dim_stride,                     \
                           to_f32(src[strided_index(sview, i)]));                              \
            }                                                                                  \
        }                                                                                      \
    }
PART(float, ADD_AT(float))
PART(f16, ADD_AT(f16))
PART(bf16, ADD_AT(bf16))

// Group g adds src[src_pos[k]] for k in starts[g] .. starts[g + 1], in that order, into
// dst[dst_pos[g]]. Groups name distinct cells, so threads never share one.
#define ADD_GROUPS(T)                                                                          \
    extern "C" __global__ void add_groups_##T(T* dst, const i64* dst_pos, const i64* starts,  \
                                              const i64* src_pos, const T* src, i64 groups) {  \
        FOR_EACH(g, groups) {                                                                  \
            i64 p = dst_pos[g];                                                                \
            T acc = dst[p];                                                                    \
            for (i64 k = starts[g]; k < starts[g + 1]; k++) {                                  \
                acc = from_f32<T>(to_f32(acc) + to_f32(src[src_pos[k]]));                      \
            }                                                                                  \
            dst[p] = acc;                                                                      \
        }                                                                                      \
    }
PART(float, ADD_GROUPS(float))
PART(f16, ADD_GROUPS(f16))
PART(bf16, ADD_GROUPS(bf16))
