// Row reductions: out[r] = reduce(x[r, 0..cols]) for a contiguous [rows, cols] input (the
// launcher moves the reduced dims last). One block per row, f32 accumulation (the CPU backend
// adds compensation; f32 tree sums over a row have error ~log2(cols) ulp).
// op: REDUCE_SUM, REDUCE_MAX, REDUCE_MIN or REDUCE_MEAN (codes from ReduceOp). Max and min
// propagate NaN, as on the CPU.

template <typename T>
__device__ void reduce_rows(int op, const T* __restrict__ x, T* __restrict__ out, i64 rows, i64 cols) {
    __shared__ float scratch[32];
    // block_reduce's op: 0 sum, 1 max, 2 min.
    int bop = op == REDUCE_MAX ? 1 : (op == REDUCE_MIN ? 2 : 0);
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* row = x + r * cols;
        float acc = bop == 0 ? 0.0f : (bop == 1 ? -INFINITY : INFINITY);
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
            float v = to_f32(row[c]);
            acc = bop == 0 ? acc + v : (bop == 1 ? nan_max(acc, v) : nan_min(acc, v));
        }
        acc = block_reduce(bop, acc, scratch);
        if (threadIdx.x == 0) out[r] = from_f32<T>(op == REDUCE_MEAN ? acc / (float)cols : acc);
    }
}

// Index of the first maximum of each row of sign * x (argmax with sign 1, argmin with -1; NaN
// counts as the extreme, as on the CPU), as i64. blockDim.x must be a power of two, <= 1024.
template <typename T>
__device__ void argmax_rows(float sign, const T* __restrict__ x, i64* __restrict__ out, i64 rows,
                            i64 cols) {
    __shared__ float best_v[1024];
    __shared__ i64 best_i[1024];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* row = x + r * cols;
        float bv = -INFINITY;
        i64 bi = 0;
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
            float v = sign * to_f32(row[c]);
            if (v > bv || (isnan(v) && !isnan(bv))) { bv = v; bi = c; }
        }
        best_v[threadIdx.x] = bv;
        best_i[threadIdx.x] = bi;
        __syncthreads();
        for (int s = blockDim.x / 2; s > 0; s >>= 1) {
            if (threadIdx.x < s) {
                float ov = best_v[threadIdx.x + s];
                i64 oi = best_i[threadIdx.x + s];
                float mv = best_v[threadIdx.x];
                i64 mi = best_i[threadIdx.x];
                bool take = isnan(ov) ? (!isnan(mv) || oi < mi)
                                      : (!isnan(mv) && (ov > mv || (ov == mv && oi < mi)));
                if (take) { best_v[threadIdx.x] = ov; best_i[threadIdx.x] = oi; }
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) out[r] = best_i[0];
        __syncthreads();
    }
}

// Reductions over the leading rows of a contiguous [rows, cols] array into out[cols] (a
// bias gradient: the column sums of [T B, 4H]), in two passes instead of a transposing copy
// and one block per column. Pass 1: each work item is a chunk of `chunk` rows of one column,
// neighbouring items neighbouring columns (coalesced reads), reduced into partial[k][col]
// (f32). Pass 2: each column's chunks, in order, into out[col] (MEAN divides by rows).
__device__ __forceinline__ float reduce_init(int bop) {
    return bop == 0 ? 0.0f : (bop == 1 ? -INFINITY : INFINITY);
}
__device__ __forceinline__ float reduce_step(int bop, float acc, float v) {
    return bop == 0 ? acc + v : (bop == 1 ? nan_max(acc, v) : nan_min(acc, v));
}
__device__ __forceinline__ int reduce_bop(int op) {
    return op == REDUCE_MAX ? 1 : (op == REDUCE_MIN ? 2 : 0);
}

template <typename T>
__device__ void reduce_cols_partial(int op, const T* __restrict__ x, float* __restrict__ partial,
                                    i64 rows, i64 cols, i64 chunk) {
    int bop = reduce_bop(op);
    i64 chunks = (rows + chunk - 1) / chunk;
    FOR_EACH(w, chunks * cols) {
        i64 k = w / cols, col = w - k * cols;
        i64 end = (k + 1) * chunk < rows ? (k + 1) * chunk : rows;
        float acc = reduce_init(bop);
        for (i64 r = k * chunk; r < end; ++r) acc = reduce_step(bop, acc, to_f32(x[r * cols + col]));
        partial[w] = acc;
    }
}

template <typename T>
__device__ void reduce_cols_final(int op, const float* __restrict__ partial, T* __restrict__ out,
                                  i64 rows, i64 cols, i64 chunks) {
    int bop = reduce_bop(op);
    FOR_EACH(col, cols) {
        float acc = reduce_init(bop);
        for (i64 k = 0; k < chunks; ++k) acc = reduce_step(bop, acc, partial[k * cols + col]);
        out[col] = from_f32<T>(op == REDUCE_MEAN ? acc / (float)rows : acc);
    }
}

#define REDUCE(T)                                                                            \
    extern "C" __global__ void reduce_rows_##T(int op, const T* x, T* out, i64 rows, i64 cols) { \
        reduce_rows<T>(op, x, out, rows, cols);                                              \
    }                                                                                        \
    extern "C" __global__ void reduce_cols_partial_##T(int op, const T* x, float* partial,  \
                                                       i64 rows, i64 cols, i64 chunk) {     \
        reduce_cols_partial<T>(op, x, partial, rows, cols, chunk);                           \
    }                                                                                        \
    extern "C" __global__ void reduce_cols_final_##T(int op, const float* partial, T* out,  \
                                                     i64 rows, i64 cols, i64 chunks) {      \
        reduce_cols_final<T>(op, partial, out, rows, cols, chunks);                          \
    }                                                                                        \
    extern "C" __global__ void argmax_rows_##T(float sign, const T* x, i64* out, i64 rows,  \
                                               i64 cols) {                                   \
        argmax_rows<T>(sign, x, out, rows, cols);                                            \
    }
PART(float, REDUCE(float))
PART(f16, REDUCE(f16))
PART(bf16, REDUCE(bf16))

// Integer rows (i64, u8), compared exactly in i64: the maximum (REDUCE_MAX) or minimum (REDUCE_MIN) of
// each row into `out` and its first index into `arg` (either may be null). blockDim.x must be
// a power of two, <= 1024; a row must not be empty.
template <typename T>
__device__ void extreme_rows(int op, const T* __restrict__ x, T* __restrict__ out,
                             i64* __restrict__ arg, i64 rows, i64 cols) {
    __shared__ i64 best_v[1024];
    __shared__ i64 best_i[1024];
    bool less = op == REDUCE_MIN;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* row = x + r * cols;
        i64 bv = 0, bi = -1;
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
            i64 v = (i64)row[c];
            if (bi < 0 || (less ? v < bv : v > bv)) { bv = v; bi = c; }
        }
        best_v[threadIdx.x] = bv;
        best_i[threadIdx.x] = bi;
        __syncthreads();
        for (int s = blockDim.x / 2; s > 0; s >>= 1) {
            if (threadIdx.x < s) {
                i64 ov = best_v[threadIdx.x + s], oi = best_i[threadIdx.x + s];
                i64 mv = best_v[threadIdx.x], mi = best_i[threadIdx.x];
                bool take = oi >= 0 && (mi < 0 || (less ? ov < mv : ov > mv) ||
                                        (ov == mv && oi < mi));
                if (take) { best_v[threadIdx.x] = ov; best_i[threadIdx.x] = oi; }
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            if (out) out[r] = (T)best_v[0];
            if (arg) arg[r] = best_i[0];
        }
        __syncthreads();
    }
}

#define EXTREME(T)                                                                           \
    extern "C" __global__ void extreme_rows_##T(int op, const T* x, T* out, i64* arg,       \
                                                i64 rows, i64 cols) {                        \
        extreme_rows<T>(op, x, out, arg, rows, cols);                                        \
    }
PART(i64, EXTREME(i64))
PART(u8, EXTREME(u8))
