// Softmax / log-softmax over the last dim and the fused cross-entropy (src/ops/nn.rs and
// src/ops/loss.rs): one block per row, max-subtracted, f32 throughout.

// Each row's values are first multiplied by `scale`; with `causal` > 0, row r's columns past
// r % causal are -inf (a causal attention's scores, `causal` queries per matrix: query i sees
// keys 0..=i).
template <typename T>
__device__ void softmax_rows(const T* __restrict__ x, T* __restrict__ out, i64 rows, i64 cols, int log,
                             float scale, i64 causal) {
    __shared__ float scratch[32];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* row = x + r * cols;
        // Columns from `last` on are masked.
        i64 last = causal > 0 ? r % causal + 1 : cols;
        if (last > cols) last = cols;
        float m = -INFINITY;
        for (i64 c = threadIdx.x; c < last; c += blockDim.x) m = fmaxf(m, to_f32(row[c]) * scale);
        m = block_reduce(1, m, scratch);
        float s = 0.0f;
        for (i64 c = threadIdx.x; c < last; c += blockDim.x) s += expf(to_f32(row[c]) * scale - m);
        s = block_reduce(0, s, scratch);
        float lse = m + logf(s);
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
            float v = c < last ? to_f32(row[c]) * scale : -INFINITY;
            out[r * cols + c] = from_f32<T>(log ? v - lse : expf(v - lse));
        }
    }
}

// The input gradient of softmax_rows from its output y and the output's gradient g (both
// [rows, cols], contiguous): scale y (g - sum_j g_j y_j) for softmax, scale (g - exp(y)
// sum_j g_j) for log-softmax. A causally masked column of softmax has y = 0, so it gets 0
// (causal masks come with softmax only: Storage::softmax_rows refuses them with log).
template <typename T>
__device__ void softmax_backward(const T* __restrict__ y, const T* __restrict__ g, T* __restrict__ dx,
                                 i64 rows, i64 cols, int log, float scale) {
    __shared__ float scratch[32];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* yr = y + r * cols;
        const T* gr = g + r * cols;
        float s = 0.0f;
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x)
            s += log ? to_f32(gr[c]) : to_f32(gr[c]) * to_f32(yr[c]);
        s = block_reduce(0, s, scratch);
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
            float yv = to_f32(yr[c]), gv = to_f32(gr[c]);
            float d = log ? gv - expf(yv) * s : yv * (gv - s);
            dx[r * cols + c] = from_f32<T>(scale * d);
        }
    }
}

// Cross-entropy per row with label smoothing `eps` and `ignore_index`:
// loss = (1 - eps) (lse - x[t]) + eps (lse - mean_j x[j]); 0 for an ignored row. Also writes
// the row's log-sum-exp for the backward. A target out of [0, cols) that is not ignore_index
// makes the row's loss NaN and writes `slot` into `*fault` if no earlier launch did
// (src/backend/cuda/faults.rs reports it at the next read).
template <typename T>
__device__ void xent_rows(const T* __restrict__ x, const i64* __restrict__ target, float* __restrict__ loss,
                          float* __restrict__ lse_out, i64 rows, i64 cols, i64 ignore_index, float eps,
                          int* fault, int slot) {
    __shared__ float scratch[32];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* row = x + r * cols;
        float m = -INFINITY, sum_x = 0.0f;
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
            float v = to_f32(row[c]);
            m = fmaxf(m, v);
            sum_x += v;
        }
        m = block_reduce(1, m, scratch);
        sum_x = block_reduce(0, sum_x, scratch);
        float s = 0.0f;
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x) s += expf(to_f32(row[c]) - m);
        s = block_reduce(0, s, scratch);
        if (threadIdx.x == 0) {
            float lse = m + logf(s);
            i64 t = target[r];
            lse_out[r] = lse;
            if (t == ignore_index) {
                loss[r] = 0.0f;
            } else if (t < 0 || t >= cols) {
                loss[r] = __int_as_float(0x7fc00000);
                atomicCAS(fault, 0, slot);
            } else {
                // The smoothing term only when asked for: with a -inf logit it is 0 * inf.
                float l = (1.0f - eps) * (lse - to_f32(row[t]));
                loss[r] = eps != 0.0f ? l + eps * (lse - sum_x / (float)cols) : l;
            }
        }
    }
}

// d loss_r / d x[r, j] = g[r] (softmax_j - (1 - eps) [j == t] - eps / cols); 0 for ignored
// rows and rows whose target is out of range (the forward reported those). `g` holds each
// row's incoming gradient (the reduction's scale folded in). `dx` may be `x` itself (the
// gradient written over the logits): each element is read, then written, by one thread.
template <typename T>
__device__ void xent_backward(const T* x, const i64* __restrict__ target,
                              const float* __restrict__ lse, const float* __restrict__ g,
                              T* dx, i64 rows, i64 cols, i64 ignore_index, float eps) {
    FOR_EACH(i, rows * cols) {
        i64 r = i / cols, j = i % cols, t = target[r];
        float d = 0.0f;
        if (!(t == ignore_index || t < 0 || t >= cols)) {
            float p = expf(to_f32(x[i]) - lse[r]);
            d = g[r] * (p - (j == t ? 1.0f - eps : 0.0f) - eps / (float)cols);
        }
        dx[i] = from_f32<T>(d);
    }
}

#define SOFTMAX(T)                                                                              \
    extern "C" __global__ void softmax_rows_##T(const T* x, T* out, i64 rows, i64 cols, int log, \
                                                float scale, i64 causal) {                      \
        softmax_rows<T>(x, out, rows, cols, log, scale, causal);                                \
    }                                                                                           \
    extern "C" __global__ void softmax_backward_##T(const T* y, const T* g, T* dx, i64 rows,    \
                                                    i64 cols, int log, float scale) {           \
        softmax_backward<T>(y, g, dx, rows, cols, log, scale);                                  \
    }                                                                                           \
    extern "C" __global__ void xent_rows_##T(const T* x, const i64* target, float* loss, float* lse, \
                                             i64 rows, i64 cols, i64 ignore_index, float eps,     \
                                             int* fault, int slot) {                            \
        xent_rows<T>(x, target, loss, lse, rows, cols, ignore_index, eps, fault, slot);         \
    }                                                                                           \
    extern "C" __global__ void xent_backward_##T(const T* x, const i64* target, const float* lse, \
                                                 const float* g, T* dx, i64 rows, i64 cols,     \
                                                 i64 ignore_index, float eps) {                 \
        xent_backward<T>(x, target, lse, g, dx, rows, cols, ignore_index, eps);                 \
    }
PART(float, SOFTMAX(float))
PART(f16, SOFTMAX(f16))
PART(bf16, SOFTMAX(bf16))
