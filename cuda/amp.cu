// Loss-scaler kernels (src/amp/scaler.rs, PyTorch's _amp_foreach_non_finite_check_and_unscale_
// and _amp_update_scale_): unscale with the overflow check in one pass, and the scale update,
// both reading and writing device scalars only.

// out[i] = g[i] * inv_scale; found_inf = 1 when any g[i] is inf or NaN. `out` may alias `g`
// (same dtype), or be an f32 buffer (master weights: f32 gradients).
template <typename G, typename O>
__device__ void unscale(const G* g, O* out, const float* inv_scale, float* found_inf, i64 n) {
    float inv = *inv_scale;
    bool bad = false;
    FOR_EACH(i, n) {
        float v = to_f32(g[i]);
        bad |= !isfinite(v);
        out[i] = from_f32<O>(v * inv);
    }
    if (bad) *found_inf = 1.0f; // benign race: every writer stores 1
}

#define UNSCALE(G, O)                                                                         \
    extern "C" __global__ void amp_unscale_##G##_##O(const G* g, O* out, const float* inv_scale, \
                                                     float* found_inf, i64 n) {               \
        unscale<G, O>(g, out, inv_scale, found_inf, n);                                       \
    }
UNSCALE(float, float)
UNSCALE(bf16, bf16)
UNSCALE(f16, float)
UNSCALE(bf16, float)

// PyTorch's _amp_update_scale_: back off on overflow, grow after `interval` clean steps
// unless the grown scale would not be finite. One thread.
extern "C" __global__ void amp_update_scale(float* scale, float* tracker, const float* found_inf,
                                            float growth, float backoff, int interval) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    if (*found_inf != 0.0f) {
        *scale *= backoff;
        *tracker = 0.0f;
    } else {
        float next = *tracker + 1.0f;
        if (next >= (float)interval) {
            float grown = *scale * growth;
            if (isfinite(grown)) *scale = grown;
            *tracker = 0.0f;
        } else {
            *tracker = next;
        }
    }
}
