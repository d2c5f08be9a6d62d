// Indexing with indices the host has already checked (src/backend/cpu/index.rs gives the same
// results): `take` copies elements by width for index_select and gather; `add_groups` adds
// source elements into destination cells in a fixed order the host lays out, rounding after
// each addition as the CPU does, so scatter_add and index_add need no atomics and repeat bit
// for bit.

// out[i] = x[base(i) + k * dim_stride]: `base` is the source view in the output's shape with
// stride 0 along the indexed dim; k is idx[i] (gather, inner == 0) or idx[(i / inner) % nidx]
// (index_select, inner = the output's elements after the indexed dim).
#define TAKE(T)                                                                                \
    extern "C" __global__ void take_##T(const T* x, Strided base, const i64* idx, i64 inner,   \
                                        i64 nidx, i64 dim_stride, T* out, i64 n) {             \
        FOR_EACH(i, n) {                                                                       \
            i64 k = inner > 0 ? idx[(i / inner) % nidx] : idx[i];                             \
            out[i] = x[strided_index(base, i) + k * dim_stride];                               \
        }                                                                                      \
    }
TAKE(u8)
TAKE(u16)
TAKE(u32)
TAKE(u64)

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
ADD_GROUPS(float)
ADD_GROUPS(f16)
ADD_GROUPS(bf16)
