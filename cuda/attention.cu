// Fused scaled dot-product attention without a mask or dropout (src/backend/cuda/attention.rs;
// the CPU's is src/backend/cpu/attention.rs): softmax(q k^T scale) v per batch entry, the
// scores never stored. Inputs are contiguous [B, L, E] (queries), [B, S, E] (keys) and
// [B, S, Ev] (values); with `causal`, query i sees keys 0..=i. Arithmetic in f32.
//
// A block of ATT_TILE threads takes ATT_TILE rows (queries forward and for dq, keys for dk
// and dv); the other side's rows pass through shared memory a tile at a time. Forward keeps
// a running maximum and sum per query (the online softmax) and writes each row's
// log-sum-exp for backward, which recomputes the probabilities from it:
// dv_j = sum_i p_ij do_i, ds_ij = p_ij (do_i . v_j - D_i) with D_i = do_i . o_i,
// dq_i = scale sum_j ds_ij k_j, dk_j = scale sum_i ds_ij q_i. No atomics: every output row
// is one thread's. E and Ev are at most ATT_MAX_E (the launcher checks).

#define ATT_TILE 32
#define ATT_MAX_E 128

// Rows [r0, r0 + ATT_TILE) of a [rows, width] matrix of batch entry b into shared `dst`
// (zeros past the end), read by every thread of the block.
template <typename T>
__device__ __forceinline__ void att_load(float* dst, const T* src, i64 b, i64 r0, i64 rows,
                                         i64 width) {
    for (i64 c = threadIdx.x; c < ATT_TILE * width; c += blockDim.x) {
        i64 r = c / width, e = c % width;
        dst[c] = r0 + r < rows ? to_f32(src[(b * rows + r0 + r) * width + e]) : 0.0f;
    }
}

// The keys a tile of queries from i0 sees: all S, or with `causal` those up to its last query.
__device__ __forceinline__ i64 att_keys_end(i64 i0, i64 S, int causal) {
    return causal && i0 + ATT_TILE < S ? i0 + ATT_TILE : S;
}

__device__ __forceinline__ float att_dot(const float* a, const float* b, i64 n) {
    float s = 0.0f;
    for (i64 e = 0; e < n; e++) s += a[e] * b[e];
    return s;
}

template <typename T>
__device__ void attn_forward(const T* __restrict__ q, const T* __restrict__ k,
                             const T* __restrict__ v, T* __restrict__ out, float* __restrict__ lse,
                             i64 B, i64 L, i64 S, i64 E, i64 Ev, float scale, int causal) {
    __shared__ float ks[ATT_TILE * ATT_MAX_E];
    __shared__ float vs[ATT_TILE * ATT_MAX_E];
    i64 tiles = (L + ATT_TILE - 1) / ATT_TILE;
    for (i64 blk = blockIdx.x; blk < B * tiles; blk += gridDim.x) {
        i64 b = blk / tiles, i0 = (blk % tiles) * ATT_TILE, i = i0 + threadIdx.x;
        bool live = i < L;
        float qr[ATT_MAX_E], acc[ATT_MAX_E];
        for (i64 e = 0; e < E; e++) qr[e] = live ? to_f32(q[(b * L + i) * E + e]) * scale : 0.0f;
        for (i64 e = 0; e < Ev; e++) acc[e] = 0.0f;
        float m = -INFINITY, l = 0.0f;
        i64 end = att_keys_end(i0, S, causal);
        for (i64 j0 = 0; j0 < end; j0 += ATT_TILE) {
            att_load(ks, k, b, j0, S, E);
            att_load(vs, v, b, j0, S, Ev);
            __syncthreads();
            for (i64 r = 0; live && r < ATT_TILE && j0 + r < S && !(causal && j0 + r > i); r++) {
                float s = att_dot(qr, ks + r * E, E);
                if (s > m) { // a new maximum: rescale what was summed
                    float c = expf(m - s);
                    l *= c;
                    for (i64 e = 0; e < Ev; e++) acc[e] *= c;
                    m = s;
                }
                float p = expf(s - m);
                l += p;
                for (i64 e = 0; e < Ev; e++) acc[e] += p * vs[r * Ev + e];
            }
            __syncthreads(); // the tile is read before the next overwrites it
        }
        if (live) {
            for (i64 e = 0; e < Ev; e++) out[(b * L + i) * Ev + e] = from_f32<T>(acc[e] / l);
            lse[b * L + i] = m + logf(l);
        }
    }
}

// dq per query row, and D_i = do_i . o_i (which the dk/dv kernel reads).
template <typename T>
__device__ void attn_backward_q(const T* __restrict__ q, const T* __restrict__ k,
                                const T* __restrict__ v, const T* __restrict__ o,
                                const T* __restrict__ dout, const float* __restrict__ lse,
                                float* __restrict__ dsum, T* __restrict__ dq, i64 B, i64 L, i64 S,
                                i64 E, i64 Ev, float scale, int causal) {
    __shared__ float ks[ATT_TILE * ATT_MAX_E];
    __shared__ float vs[ATT_TILE * ATT_MAX_E];
    i64 tiles = (L + ATT_TILE - 1) / ATT_TILE;
    for (i64 blk = blockIdx.x; blk < B * tiles; blk += gridDim.x) {
        i64 b = blk / tiles, i0 = (blk % tiles) * ATT_TILE, i = i0 + threadIdx.x;
        bool live = i < L;
        i64 row = b * L + i;
        float qr[ATT_MAX_E], dor[ATT_MAX_E], acc[ATT_MAX_E];
        float d = 0.0f, li = live ? lse[row] : 0.0f;
        for (i64 e = 0; e < E; e++) {
            qr[e] = live ? to_f32(q[row * E + e]) * scale : 0.0f;
            acc[e] = 0.0f;
        }
        for (i64 e = 0; e < Ev; e++) {
            dor[e] = live ? to_f32(dout[row * Ev + e]) : 0.0f;
            d += live ? dor[e] * to_f32(o[row * Ev + e]) : 0.0f;
        }
        if (live) dsum[row] = d;
        i64 end = att_keys_end(i0, S, causal);
        for (i64 j0 = 0; j0 < end; j0 += ATT_TILE) {
            att_load(ks, k, b, j0, S, E);
            att_load(vs, v, b, j0, S, Ev);
            __syncthreads();
            for (i64 r = 0; live && r < ATT_TILE && j0 + r < S && !(causal && j0 + r > i); r++) {
                float p = expf(att_dot(qr, ks + r * E, E) - li);
                float ds = p * (att_dot(dor, vs + r * Ev, Ev) - d);
                for (i64 e = 0; e < E; e++) acc[e] += ds * ks[r * E + e];
            }
            __syncthreads();
        }
        if (live)
            for (i64 e = 0; e < E; e++) dq[row * E + e] = from_f32<T>(acc[e] * scale);
    }
}

// dk and dv per key row.
template <typename T>
__device__ void attn_backward_kv(const T* __restrict__ q, const T* __restrict__ k,
                                 const T* __restrict__ v, const T* __restrict__ dout,
                                 const float* __restrict__ lse, const float* __restrict__ dsum,
                                 T* __restrict__ dk, T* __restrict__ dv, i64 B, i64 L, i64 S,
                                 i64 E, i64 Ev, float scale, int causal) {
    __shared__ float qs[ATT_TILE * ATT_MAX_E];
    __shared__ float ds_[ATT_TILE * ATT_MAX_E];
    __shared__ float ls[ATT_TILE], dd[ATT_TILE];
    i64 tiles = (S + ATT_TILE - 1) / ATT_TILE;
    for (i64 blk = blockIdx.x; blk < B * tiles; blk += gridDim.x) {
        i64 b = blk / tiles, j0 = (blk % tiles) * ATT_TILE, j = j0 + threadIdx.x;
        bool live = j < S;
        i64 row = b * S + j;
        float kr[ATT_MAX_E], vr[ATT_MAX_E], gk[ATT_MAX_E], gv[ATT_MAX_E];
        for (i64 e = 0; e < E; e++) {
            kr[e] = live ? to_f32(k[row * E + e]) : 0.0f;
            gk[e] = 0.0f;
        }
        for (i64 e = 0; e < Ev; e++) {
            vr[e] = live ? to_f32(v[row * Ev + e]) : 0.0f;
            gv[e] = 0.0f;
        }
        // Causal: the queries before this tile's first key see none of its keys.
        for (i64 i0 = causal ? j0 : 0; i0 < L; i0 += ATT_TILE) {
            att_load(qs, q, b, i0, L, E);
            att_load(ds_, dout, b, i0, L, Ev);
            for (i64 c = threadIdx.x; c < ATT_TILE; c += blockDim.x) {
                ls[c] = i0 + c < L ? lse[b * L + i0 + c] : 0.0f;
                dd[c] = i0 + c < L ? dsum[b * L + i0 + c] : 0.0f;
            }
            __syncthreads();
            for (i64 r = 0; live && r < ATT_TILE && i0 + r < L; r++) {
                if (causal && j > i0 + r) continue;
                const float* qi = qs + r * E;
                const float* doi = ds_ + r * Ev;
                float p = expf(att_dot(qi, kr, E) * scale - ls[r]);
                float ds = p * (att_dot(doi, vr, Ev) - dd[r]);
                for (i64 e = 0; e < Ev; e++) gv[e] += p * doi[e];
                for (i64 e = 0; e < E; e++) gk[e] += ds * qi[e];
            }
            __syncthreads();
        }
        if (live) {
            for (i64 e = 0; e < E; e++) dk[row * E + e] = from_f32<T>(gk[e] * scale);
            for (i64 e = 0; e < Ev; e++) dv[row * Ev + e] = from_f32<T>(gv[e]);
        }
    }
}

#define ATTENTION(T)                                                                           \
    extern "C" __global__ void attn_forward_##T(const T* q, const T* k, const T* v, T* out,    \
                                                float* lse, i64 B, i64 L, i64 S, i64 E, i64 Ev, \
                                                float scale, int causal) {                     \
        attn_forward<T>(q, k, v, out, lse, B, L, S, E, Ev, scale, causal);                     \
    }                                                                                          \
    extern "C" __global__ void attn_backward_q_##T(const T* q, const T* k, const T* v,         \
                                                   const T* o, const T* dout, const float* lse, \
                                                   float* dsum, T* dq, i64 B, i64 L, i64 S,    \
                                                   i64 E, i64 Ev, float scale, int causal) {   \
        attn_backward_q<T>(q, k, v, o, dout, lse, dsum, dq, B, L, S, E, Ev, scale, causal);    \
    }                                                                                          \
    extern "C" __global__ void attn_backward_kv_##T(const T* q, const T* k, const T* v,        \
                                                    const T* dout, const float* lse,           \
                                                    const float* dsum, T* dk, T* dv, i64 B,    \
                                                    i64 L, i64 S, i64 E, i64 Ev, float scale,  \
                                                    int causal) {                              \
        attn_backward_kv<T>(q, k, v, dout, lse, dsum, dk, dv, B, L, S, E, Ev, scale, causal);  \
    }

PART(float, ATTENTION(float))
PART(f16, ATTENTION(f16))
PART(bf16, ATTENTION(bf16))
