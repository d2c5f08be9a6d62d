// Loss-scaler kernels (src/amp/scaler.rs, PyTorch's _amp_foreach_non_finite_check_and_unscale_
// and _amp_update_scale_): unscale with the overflow check in one pass over a list of
// gradients, and the scale update, both reading and writing device scalars only.

// Up to UNSCALE_LIST gradients per launch (PyTorch's multi_tensor_apply): gradient k has n[k]
// elements in chunks of UNSCALE_CHUNK, numbered from start[k] (increasing; `chunks` in all).
// At most 4 KB of kernel parameters.
#define UNSCALE_LIST 96
#define UNSCALE_CHUNK 16384
struct UnscaleList {
    i64 count;
    i64 chunks;
    const void* g[UNSCALE_LIST];
    void* out[UNSCALE_LIST];
    i64 n[UNSCALE_LIST];
    i64 start[UNSCALE_LIST];
};

// out[k][i] = g[k][i] * inv_scale for every listed gradient; found_inf = 1 when any element
// is inf or NaN. `out` may alias `g` (same dtype), or be an f32 buffer (master weights: f32
// gradients). A block takes chunks b, b + gridDim, ...
template <typename G, typename O>
__device__ void unscale(const UnscaleList& L, const float* inv_scale, float* found_inf) {
    float inv = *inv_scale;
    bool bad = false;
    for (i64 b = blockIdx.x; b < L.chunks; b += gridDim.x) {
        int k = list_entry(L.start, L.count, b);
        i64 begin = (b - L.start[k]) * UNSCALE_CHUNK;
        i64 end = begin + UNSCALE_CHUNK < L.n[k] ? begin + UNSCALE_CHUNK : L.n[k];
        const G* g = (const G*)L.g[k];
        O* out = (O*)L.out[k];
        for (i64 i = begin + threadIdx.x; i < end; i += blockDim.x) {
            float v = to_f32(g[i]);
            bad |= !isfinite(v);
            out[i] = from_f32<O>(v * inv);
        }
    }
    if (bad) *found_inf = 1.0f; // benign race: every writer stores 1
}

#define UNSCALE(G, O)                                                                         \
    extern "C" __global__ void amp_unscale_##G##_##O(UnscaleList list, const float* inv_scale, \
                                                     float* found_inf) {                      \
        unscale<G, O>(list, inv_scale, found_inf);                                            \
    }
PART(float, UNSCALE(float, float))
PART(f16, UNSCALE(f16, f16))
PART(bf16, UNSCALE(bf16, bf16))
PART(f16, UNSCALE(f16, float))
PART(bf16, UNSCALE(bf16, float))

// Gradient clipping's total (PyTorch's _foreach_norm): partial[b] = sum of g^2 over chunk b of
// the listed gradients (`out` unused), accumulated in f32; a reduction over the partials
// finishes it in a fixed order. No atomics: the result does not depend on timing.
template <typename G>
__device__ void sum_squares(const UnscaleList& L, float* partial) {
    __shared__ float scratch[32];
    for (i64 b = blockIdx.x; b < L.chunks; b += gridDim.x) {
        int k = list_entry(L.start, L.count, b);
        i64 begin = (b - L.start[k]) * UNSCALE_CHUNK;
        i64 end = begin + UNSCALE_CHUNK < L.n[k] ? begin + UNSCALE_CHUNK : L.n[k];
        const G* g = (const G*)L.g[k];
        float s = 0.0f;
        for (i64 i = begin + threadIdx.x; i < end; i += blockDim.x) {
            float v = to_f32(g[i]);
            s += v * v;
        }
        s = block_reduce(0, s, scratch);
        if (threadIdx.x == 0) partial[b] = s;
    }
}

#define SUM_SQUARES(G)                                                                         \
    extern "C" __global__ void amp_sum_squares_##G(UnscaleList list, float* partial) {         \
        sum_squares<G>(list, partial);                                                         \
    }
PART(float, SUM_SQUARES(float))
PART(f16, SUM_SQUARES(f16))
PART(bf16, SUM_SQUARES(bf16))

// PyTorch's _amp_update_scale_: back off on overflow, grow after `interval` clean steps
// unless the grown scale would not be finite. One thread.
#if PART_HAS_0
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
#endif
