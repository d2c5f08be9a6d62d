// The LSTM cell's pointwise part, fused (src/backend/cpu/rnn.rs gives the same results): gate
// pre-activations [B, 4H] (input, forget, cell, output) and the previous cell state [B, H] to
// [h | c'] [B, 2H], and the backward to [d gates | d c] [B, 5H]. One thread per (b, j); gates
// contiguous, the [B, H] operands with a row stride each (sc, ...); math in f32.

__device__ __forceinline__ float lstm_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <typename T>
__device__ void lstm_forward(const T* g, const T* c, i64 sc, T* out, i64 batch, i64 h) {
    FOR_EACH(t, batch * h) {
        i64 b = t / h, j = t % h;
        const T* gr = g + b * 4 * h;
        float i = lstm_sigmoid(to_f32(gr[j])), f = lstm_sigmoid(to_f32(gr[h + j]));
        float gg = tanhf(to_f32(gr[2 * h + j])), o = lstm_sigmoid(to_f32(gr[3 * h + j]));
        float c2 = f * to_f32(c[b * sc + j]) + i * gg;
        out[b * 2 * h + j] = from_f32<T>(o * tanhf(c2));
        out[b * 2 * h + h + j] = from_f32<T>(c2);
    }
}

// The gradients of h and c' come as separate [B, H] operands, each with its own row stride
// (views of larger tensors need no copy); `dh2`, when not null, is a second gradient of h,
// added in f32 (an LSTM layer's output gradient plus the next step's recurrent one).
template <typename T>
__device__ void lstm_backward(const T* g, const T* c, i64 sc, const T* dhp, i64 sdh,
                              const T* dh2p, i64 sdh2, const T* dcp, i64 sdc, T* out, i64 batch,
                              i64 h) {
    FOR_EACH(t, batch * h) {
        i64 b = t / h, j = t % h;
        const T* gr = g + b * 4 * h;
        float i = lstm_sigmoid(to_f32(gr[j])), f = lstm_sigmoid(to_f32(gr[h + j]));
        float gg = tanhf(to_f32(gr[2 * h + j])), o = lstm_sigmoid(to_f32(gr[3 * h + j]));
        float cp = to_f32(c[b * sc + j]);
        float th = tanhf(f * cp + i * gg);
        float dh = to_f32(dhp[b * sdh + j]);
        if (dh2p) dh += to_f32(dh2p[b * sdh2 + j]);
        float dc = to_f32(dcp[b * sdc + j]) + dh * o * (1.0f - th * th);
        T* orow = out + b * 5 * h;
        orow[j] = from_f32<T>(dc * gg * i * (1.0f - i));
        orow[h + j] = from_f32<T>(dc * cp * f * (1.0f - f));
        orow[2 * h + j] = from_f32<T>(dc * i * (1.0f - gg * gg));
        orow[3 * h + j] = from_f32<T>(dh * th * o * (1.0f - o));
        orow[4 * h + j] = from_f32<T>(dc * f);
    }
}

#define LSTM(T)                                                                                \
    extern "C" __global__ void lstm_cell_##T(const T* g, const T* c, i64 sc, T* out, i64 batch,  \
                                             i64 h) {                                          \
        lstm_forward<T>(g, c, sc, out, batch, h);                                              \
    }                                                                                          \
    extern "C" __global__ void lstm_cell_backward_##T(                                         \
        const T* g, const T* c, i64 sc, const T* dh, i64 sdh, const T* dh2, i64 sdh2,          \
        const T* dc, i64 sdc, T* out, i64 batch, i64 h) {                                      \
        lstm_backward<T>(g, c, sc, dh, sdh, dh2, sdh2, dc, sdc, out, batch, h);                \
    }
PART(float, LSTM(float))
PART(f16, LSTM(f16))
PART(bf16, LSTM(bf16))
