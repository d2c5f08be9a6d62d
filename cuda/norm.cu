// Batch normalisation's fused passes (src/backend/cpu/norm.rs gives the same results up to
// summation order) over a dense tensor seen as [outer, C, inner]: element (o, c, i) at
// (o * C + c) * inner + i. Row-major [n, c, ...]: outer = n; channels-last: outer = n h w,
// inner = 1. Statistics and coefficients are f32; partial results are combined in f64.
//
// The reductions run in two kernels: bn_partial_T reduces one chunk of `chunk` outer rows per
// block, for one channel (inner > 1: threads along the contiguous runs), for tg groups of
// 16-byte vectors of channels (inner == 1 with tg > 0: bn_partial_vec) or for 32 channels
// (inner == 1 otherwise: each warp reads 32 adjacent channels of a row), and bn_finalize joins the
// chunks, one block per channel, and finishes the per-channel bookkeeping in the same launch.
// No atomics: the result does not depend on timing.
// Blocks are a multiple of 32 threads, at most 256 (the launcher uses 256).

// The sum over the block's warps of each lane's value (inner == 1: lane = channel); every
// thread gets its lane's total.
__device__ float bn_lane_sum(float v, float (*red)[33]) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __syncthreads(); // red may still be read by a previous call
    red[warp][lane] = v;
    __syncthreads();
    if (warp == 0) {
        float t = 0.0f;
        for (int w = 0; w < warps; ++w) t += red[w][lane];
        red[8][lane] = t;
    }
    __syncthreads();
    return red[8][lane];
}

// The affine output before any addend or clamp, alpha (x - center) + gamma, with coef =
// [alpha | center | gamma | ...] per channel: bn_affine's forward value, and what a fused
// ReLU's backward recomputes to find where the forward's output was positive.
__device__ __forceinline__ float bn_pre_k(float x, float alpha, float center, float gamma) {
    return alpha * (x - center) + gamma;
}
__device__ __forceinline__ float bn_pre(float x, const float* __restrict__ coef, i64 C, i64 c) {
    return bn_pre_k(x, coef[c], coef[C + c], coef[2 * C + c]);
}

// Whether a fused ReLU's backward drops dy at an element of channel c: where the forward's
// output was <= 0 (NaN passes, as threshold_backward). That output is read from the saved
// output m (mv its element), or, without m, recomputed from x with the forward's
// coefficients fc (a ReLU right after batch norm: no output kept for it). Neither: kept.
template <typename T>
__device__ __forceinline__ bool relu_off(const T* __restrict__ m, T mv,
                                         const float* __restrict__ fc, i64 C, i64 c, float x) {
    if (m) return to_f32(mv) <= 0.0f;
    return fc && bn_pre(x, fc, C, c) <= 0.0f;
}

// Calls f(x, d) for every element of channel c's chunk in a block: `rows` runs of `inner`
// contiguous elements, C * inner apart, the block's threads striding over them (16-byte
// vectors when the runs allow, 32-bit index arithmetic). d is dy's element, 0 where a fused
// ReLU drops it (relu_off: the mask mb or the coefficients fc) or dy is null; with `ob`, d is
// also stored there (the masked gradient, laid out as dy).
template <typename T, typename F>
__device__ __forceinline__ void bn_runs(const T* __restrict__ xb, const T* __restrict__ db,
                                        const T* __restrict__ mb, const float* __restrict__ fc,
                                        T* __restrict__ ob, i64 rows, i64 C, i64 c, i64 inner,
                                        F f) {
    const int V = 16 / sizeof(T);
    i64 n = rows * inner;
    if (inner % V == 0 && aligned16(xb, db ? db : xb, mb ? mb : xb) && aligned16(ob ? ob : xb, xb, xb)) {
        i64 iv = inner / V;
        for (i64 j = threadIdx.x; j < n / V; j += blockDim.x) {
            i64 r = idiv(j, iv);
            i64 off = r * C * inner + (j - r * iv) * V;
            Vec16<T> xv = *reinterpret_cast<const Vec16<T>*>(xb + off), dv;
            Vec16<T> mv = {}; // read only with a mask; zero so that no copy reads garbage
            if (db) dv = *reinterpret_cast<const Vec16<T>*>(db + off);
            if (mb) mv = *reinterpret_cast<const Vec16<T>*>(mb + off);
            #pragma unroll
            for (int q = 0; q < V; ++q) {
                float v = to_f32(xv.v[q]);
                bool on = db && !relu_off(mb, mv.v[q], fc, C, c, v);
                float d = on ? to_f32(dv.v[q]) : 0.0f;
                if (ob) dv.v[q] = from_f32<T>(d);
                f(v, d);
            }
            if (ob) *reinterpret_cast<Vec16<T>*>(ob + off) = dv;
        }
        return;
    }
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
        i64 r = idiv(j, inner);
        i64 off = r * C * inner + (j - r * inner);
        float v = to_f32(xb[off]);
        bool on = db && !relu_off(mb, mb ? mb[off] : T(), fc, C, c, v);
        float d = on ? to_f32(db[off]) : 0.0f;
        if (ob) ob[off] = from_f32<T>(d);
        f(v, d);
    }
}

// bn_partial's channels-last path in 16-byte vectors (inner == 1, C % V == 0, every pointer
// 16-byte aligned; tg divides blockDim <= 256 and tg V <= blockDim). A tile is tg groups of V
// adjacent channels; thread (g = tid % tg, lane row = tid / tg) reads group g of rows lr,
// lr + R, ... (R = blockDim / tg), so a warp reads 32 / tg whole rows of its tile, one
// contiguous run. Mode 0 makes one pass: the sums are shifted by the chunk's first row (K),
// which all threads of a channel share, so that the chunk's mean is K + S1 / n and its sum of
// squared deviations S2 - S1^2 / n without the cancellation of unshifted sums. The threads'
// sums are joined in shared memory in a fixed order. Modes and operands as bn_partial's.
template <typename T, int MODE>
__device__ void bn_partial_vec_mode(const T* __restrict__ x, const T* __restrict__ dy,
                                    const T* __restrict__ mask, T* __restrict__ masked,
                                    const float* __restrict__ fc, float* __restrict__ part,
                                    i64 outer, i64 C, i64 chunk, int tg, float (*red)[256][9]) {
    const int V = 16 / sizeof(T);
    int g = threadIdx.x % tg, lr = threadIdx.x / tg, R = blockDim.x / tg;
    i64 groups = C / V, tiles = (groups + tg - 1) / tg;
    i64 chunks = (outer + chunk - 1) / chunk;
    for (i64 b = blockIdx.x; b < chunks * tiles; b += gridDim.x) {
        i64 k = b / tiles, t = b % tiles;
        i64 o0 = k * chunk;
        int rows = (int)(outer - o0 < chunk ? outer - o0 : chunk);
        i64 grp = t * tg + g;
        float s1[V], s2[V], m[V];
        #pragma unroll
        for (int q = 0; q < V; ++q) s1[q] = s2[q] = m[q] = 0.0f;
        if (grp < groups) {
            i64 c0 = grp * V;
            // Mode 0: the shift K, the chunk's first row; modes 1 and 2: the channels' means.
            if (MODE == 0) {
                Vec16<T> kv = *reinterpret_cast<const Vec16<T>*>(x + o0 * C + c0);
                #pragma unroll
                for (int q = 0; q < V; ++q) m[q] = to_f32(kv.v[q]);
            } else {
                #pragma unroll
                for (int q = 0; q < V; ++q) m[q] = fc[C + c0 + q];
            }
            // Mode 2: the forward's alpha and gamma, in registers for the whole tile, so the
            // recomputed ReLU costs no loads per element (m holds the centers).
            float ra[V], rg[V];
            #pragma unroll
            for (int q = 0; q < V; ++q) {
                ra[q] = MODE == 2 ? fc[c0 + q] : 0.0f;
                rg[q] = MODE == 2 ? fc[2 * C + c0 + q] : 0.0f;
            }
            #pragma unroll 4
            for (int r = lr; r < rows; r += R) {
                i64 off = (o0 + r) * C + c0;
                Vec16<T> xv = *reinterpret_cast<const Vec16<T>*>(x + off), dv;
                Vec16<T> mv = {}; // read only with a mask; zero so that no copy reads garbage
                if (MODE == 0) {
                    #pragma unroll
                    for (int q = 0; q < V; ++q) {
                        float d = to_f32(xv.v[q]) - m[q];
                        s1[q] += d;
                        s2[q] += d * d;
                    }
                    continue;
                }
                dv = *reinterpret_cast<const Vec16<T>*>(dy + off);
                if (mask) mv = *reinterpret_cast<const Vec16<T>*>(mask + off);
                #pragma unroll
                for (int q = 0; q < V; ++q) {
                    float v = to_f32(xv.v[q]);
                    bool off = mask ? to_f32(mv.v[q]) <= 0.0f
                                    : MODE == 2 && bn_pre_k(v, ra[q], m[q], rg[q]) <= 0.0f;
                    float d = off ? 0.0f : to_f32(dv.v[q]);
                    if (masked) dv.v[q] = from_f32<T>(d);
                    s1[q] += d;
                    s2[q] += d * (v - m[q]);
                }
                if (masked) *reinterpret_cast<Vec16<T>*>(masked + off) = dv;
            }
        }
        __syncthreads(); // red may still be read for the previous tile
        #pragma unroll
        for (int q = 0; q < V; ++q) {
            red[0][threadIdx.x][q] = s1[q];
            red[1][threadIdx.x][q] = s2[q];
        }
        __syncthreads();
        // Thread j < tg V totals channel j of the tile over the R lane rows, in order.
        int j = threadIdx.x;
        i64 c = t * tg * V + j;
        if (j < tg * V && c < C) {
            int gj = j / V, q = j % V;
            float a1 = 0.0f, a2 = 0.0f;
            for (int l = 0; l < R; ++l) {
                a1 += red[0][l * tg + gj][q];
                a2 += red[1][l * tg + gj][q];
            }
            if (MODE == 0) {
                float kc = to_f32(x[o0 * C + c]), n = (float)rows;
                part[(k * C + c) * 2] = kc + a1 / n;
                part[(k * C + c) * 2 + 1] = fmaxf(a2 - a1 * a1 / n, 0.0f);
            } else {
                part[(k * C + c) * 2] = a1;
                part[(k * C + c) * 2 + 1] = a2;
            }
        }
    }
}

// bn_partial_vec for one mode, known at compile time: each mode's loop holds only the
// registers it uses (mode 0 reads x alone), so more threads fit on a multiprocessor and more
// loads are in flight. The shared sums are the caller's, one array for all three.
template <typename T>
__device__ void bn_partial_vec(int mode, const T* __restrict__ x, const T* __restrict__ dy,
                               const T* __restrict__ mask, T* __restrict__ masked,
                               const float* __restrict__ fc, float* __restrict__ part,
                               i64 outer, i64 C, i64 chunk, int tg) {
    __shared__ float red[2][256][9];
    if (mode == 0)
        bn_partial_vec_mode<T, 0>(x, dy, mask, masked, fc, part, outer, C, chunk, tg, red);
    else if (mode == 1)
        bn_partial_vec_mode<T, 1>(x, dy, mask, masked, fc, part, outer, C, chunk, tg, red);
    else
        bn_partial_vec_mode<T, 2>(x, dy, mask, masked, fc, part, outer, C, chunk, tg, red);
}

// mode 0: part = (mean of the chunk, sum of squared deviations from it) of x;
// mode 1: part = (sum dy, sum dy (x - mean[c])). part[(k * C + c) * 2 + {0, 1}] for chunk k.
// fc = the forward's statistics [alpha | center | gamma | ...] (center = mean), read in modes
// 1 and 2. With `mask` (a fused ReLU's output, laid out as dy), dy counts only where mask > 0
// (NaN included, as threshold_backward); with `masked` too, the masked dy is stored there,
// laid out as dy (a residual's gradient, which the affine pass then reads instead of dy).
// Mode 2 is mode 1 with a fused ReLU whose output was not kept: dy counts only where the
// output recomputed from x (bn_pre with fc) is > 0 or NaN.
template <typename T>
__device__ void bn_partial(int mode, const T* __restrict__ x, const T* __restrict__ dy,
                           const T* __restrict__ mask, T* __restrict__ masked,
                           const float* __restrict__ fc, float* __restrict__ part, i64 outer,
                           i64 C, i64 inner, i64 chunk, int tg) {
    const int V = 16 / sizeof(T);
    // The vector path's conditions (else the element paths below, which any chunk suits).
    bool tile_fits = tg > 0 && tg <= 32 && blockDim.x <= 256 && blockDim.x % tg == 0 &&
                     tg * V <= (int)blockDim.x;
    if (tile_fits && inner == 1 && C % V == 0 && aligned16(x, dy ? dy : x, mask ? mask : x) &&
        aligned16(masked ? masked : x, x, x)) {
        bn_partial_vec(mode, x, dy, mask, masked, fc, part, outer, C, chunk, tg);
        return;
    }
    const float* relu = mode == 2 ? fc : 0;
    __shared__ float scratch[32];
    __shared__ float red[9][33];
    i64 chunks = (outer + chunk - 1) / chunk;
    i64 tiles = inner == 1 ? (C + 31) / 32 : C;
    for (i64 b = blockIdx.x; b < chunks * tiles; b += gridDim.x) {
        i64 k = b / tiles, t = b % tiles;
        i64 o0 = k * chunk;
        i64 rows = outer - o0 < chunk ? outer - o0 : chunk;
        if (inner > 1) {
            // One channel: rows runs of `inner` contiguous elements, C * inner apart.
            i64 c = t, n = rows * inner;
            const T* xb = x + (o0 * C + c) * inner;
            const T* db = dy ? dy + (o0 * C + c) * inner : 0;
            const T* mb = mask ? mask + (o0 * C + c) * inner : 0;
            T* ob = masked ? masked + (o0 * C + c) * inner : 0;
            float m = mode != 0 ? fc[C + c] : 0.0f;
            float s1 = 0.0f, s2 = 0.0f;
            if (mode == 0) {
                bn_runs(xb, db, mb, relu, (T*)0, rows, C, c, inner,
                        [&](float v, float) { s1 += v; });
            } else {
                bn_runs(xb, db, mb, relu, ob, rows, C, c, inner, [&](float v, float d) {
                    s1 += d;
                    s2 += d * (v - m);
                });
            }
            s1 = block_reduce(0, s1, scratch);
            if (mode == 0) {
                m = s1 / (float)n;
                bn_runs(xb, db, mb, relu, (T*)0, rows, C, c, inner,
                        [&](float v, float) { s2 += (v - m) * (v - m); });
            }
            s2 = block_reduce(0, s2, scratch);
            if (threadIdx.x == 0) {
                part[(k * C + c) * 2] = mode == 0 ? m : s1;
                part[(k * C + c) * 2 + 1] = s2;
            }
        } else {
            // 32 channels: warp w of W reads rows w, w + W, ...; lane l is channel 32 t + l.
            int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
            i64 c = t * 32 + lane;
            bool on = c < C;
            float m = mode != 0 && on ? fc[C + c] : 0.0f;
            float s1 = 0.0f, s2 = 0.0f;
            if (on) {
                for (i64 r = warp; r < rows; r += warps) {
                    i64 off = (o0 + r) * C + c;
                    float v = to_f32(x[off]);
                    if (mode == 0) {
                        s1 += v;
                    } else {
                        bool drop = relu_off(mask, mask ? mask[off] : T(), relu, C, c, v);
                        float d = drop ? 0.0f : to_f32(dy[off]);
                        if (masked) masked[off] = from_f32<T>(d);
                        s1 += d;
                        s2 += d * (v - m);
                    }
                }
            }
            s1 = bn_lane_sum(s1, red);
            if (mode == 0) {
                m = s1 / (float)rows;
                if (on) {
                    for (i64 r = warp; r < rows; r += warps) {
                        float d = to_f32(x[(o0 + r) * C + c]) - m;
                        s2 += d * d;
                    }
                }
            }
            s2 = bn_lane_sum(s2, red);
            if (warp == 0 && on) {
                part[(k * C + c) * 2] = mode == 0 ? m : s1;
                part[(k * C + c) * 2 + 1] = s2;
            }
        }
    }
}

// What bn_finalize computes from the chunks' partials (src/backend/norm.rs: BnMode).
struct BnArgs {
    int mode;           // 0 forward on the batch, 1 forward on the running statistics,
                        // 2 backward (training), 3 backward (eval) with sums, 4 without,
                        // 5 forward on the batch from its sums (stats = [sum | sum of
                        // squares], f32 [2, C], as a convolution's epilogue made them)
    double momentum;    // mode 0: running = (1 - momentum) running + momentum batch
    double eps;
    double count;       // elements per channel
    const float* weight; // forward: per-channel scale and shift (null: 1 and 0)
    const float* bias;
    float* running_mean; // mode 0: updated in place (null: not kept); mode 1: read
    float* running_var;  // (the update takes the unbiased variance)
    i64* tracked;        // mode 0: num_batches_tracked, counted once (null: none)
    const float* stats;  // backward: the forward's [a | mean | b | invstd | var]; mode 5
                         // the sums
    float* out;          // forward [a | mean | b | invstd | var], backward [alpha | mean | gamma | beta]
    float* dweight;      // backward: sum dy xhat and sum dy per channel (null: not wanted)
    float* dbias;
};

// (n, mean, m2) += (n2, mean2, m22): Chan's combination of two sets' moments.
__device__ __forceinline__ void bn_chan(double& n, double& mean, double& m2, double n2,
                                        double mean2, double m22) {
    if (n2 == 0.0) return;
    if (n == 0.0) {
        n = n2;
        mean = mean2;
        m2 = m22;
        return;
    }
    double total = n + n2, d = mean2 - mean;
    mean += d * n2 / total;
    m2 += m22 + d * d * n * n2 / total;
    n = total;
}

// One block per channel (the grid strides over channels; blockDim a power of two, at most
// 256): the block's threads take the chunks' partials k = t, t + blockDim, ... (moments by
// Chan's combination, sums added), a tree over the threads in a fixed order joins them, and
// thread 0 turns the channel's statistics into the coefficients the affine pass reads, with
// the running statistics updated in the same launch. No atomics: the result does not depend
// on timing. `part` is null in modes 1 and 4.
#if PART_HAS_0
extern "C" __global__ void bn_finalize(const float* __restrict__ part, BnArgs a, i64 outer,
                                       i64 C, i64 inner, i64 chunk) {
    __shared__ double sn[256], sa[256], sb[256];
    int t = threadIdx.x;
    i64 chunks = part ? (outer + chunk - 1) / chunk : 0;
    bool moments = a.mode == 0 || a.mode == 5;
    for (i64 c = blockIdx.x; c < C; c += gridDim.x) {
        double n = 0.0, x = 0.0, y = 0.0;
        if (a.mode == 5 && t == 0) {
            // Mean and m2 from the sums, in f64: m2 = sum of squares - sum * mean, clamped
            // at 0 (the f32 sums carry rounding that can make it slightly negative; NaN
            // stays NaN).
            n = a.count;
            x = (double)a.stats[c] / n;
            y = (double)a.stats[C + c] - (double)a.stats[c] * x;
            if (y < 0.0) y = 0.0;
        }
        for (i64 k = t; k < chunks; k += blockDim.x) {
            double pa = part[(k * C + c) * 2], pb = part[(k * C + c) * 2 + 1];
            if (moments) {
                i64 rows = outer - k * chunk < chunk ? outer - k * chunk : chunk;
                bn_chan(n, x, y, (double)(rows * inner), pa, pb);
            } else {
                x += pa;
                y += pb;
            }
        }
        sn[t] = n;
        sa[t] = x;
        sb[t] = y;
        __syncthreads();
        for (int s = blockDim.x / 2; s > 0; s >>= 1) {
            if (t < s) {
                if (moments) {
                    bn_chan(sn[t], sa[t], sb[t], sn[t + s], sa[t + s], sb[t + s]);
                } else {
                    sa[t] += sa[t + s];
                    sb[t] += sb[t + s];
                }
            }
            __syncthreads();
        }
        if (t == 0) {
            if (a.mode <= 1 || a.mode == 5) {
                double mean = moments ? sa[0] : (double)a.running_mean[c];
                double var = moments ? sb[0] / sn[0] : (double)a.running_var[c];
                double invstd = 1.0 / sqrt(var + a.eps);
                double w = a.weight ? (double)a.weight[c] : 1.0;
                a.out[c] = (float)(invstd * w);
                a.out[C + c] = (float)mean;
                a.out[2 * C + c] = a.bias ? a.bias[c] : 0.0f;
                a.out[3 * C + c] = (float)invstd;
                a.out[4 * C + c] = (float)var;
                if (moments && a.running_mean) {
                    double r = a.running_mean[c];
                    a.running_mean[c] = (float)((1.0 - a.momentum) * r + a.momentum * mean);
                }
                if (moments && a.running_var) {
                    double r = a.running_var[c], unbiased = var * a.count / (a.count - 1.0);
                    a.running_var[c] = (float)((1.0 - a.momentum) * r + a.momentum * unbiased);
                }
            } else {
                // dx = alpha (x - mean) + gamma + beta dy; training folds in the statistics'
                // own gradients (PyTorch's batch_norm_backward), eval has dx = a dy.
                double sdy = sa[0], sdx = sb[0];
                double k = a.stats[c], invstd = a.stats[3 * C + c];
                bool train = a.mode == 2;
                a.out[c] = train ? (float)(-k * invstd * invstd * sdx / a.count) : 0.0f;
                a.out[C + c] = a.stats[C + c];
                a.out[2 * C + c] = train ? (float)(-k * sdy / a.count) : 0.0f;
                a.out[3 * C + c] = (float)k;
                if (a.dweight) a.dweight[c] = (float)(sdx * invstd);
                if (a.dbias) a.dbias[c] = (float)sdy;
            }
        }
        __syncthreads(); // the next channel reuses the shared arrays
    }
    if (moments && a.tracked && blockIdx.x == 0 && t == 0) *a.tracked += 1;
}
#endif

// One output of bn_affine: alpha (x - center) + gamma for channel c, plus the addend d
// (beta[c] d, or d itself for a residual) unless a fused ReLU's backward drops it
// (masked_off), clamped below at 0 for a fused ReLU forward (NaN stays NaN).
struct BnAffineFlags {
    bool relu, plain;
};
// One channel's coefficients, [alpha | center | gamma | beta] (beta 0 where not read).
struct BnCoef {
    float alpha, center, gamma, beta;
};
__device__ __forceinline__ BnCoef bn_coef(const float* __restrict__ coef, i64 C, i64 c,
                                          bool beta) {
    return {coef[c], coef[C + c], coef[2 * C + c], beta ? coef[3 * C + c] : 0.0f};
}
__device__ __forceinline__ float bn_affine_k(float x, BnCoef k, bool has_add, float d,
                                             bool masked_off, BnAffineFlags f) {
    float v = bn_pre_k(x, k.alpha, k.center, k.gamma);
    if (has_add && !masked_off) v += (f.plain ? 1.0f : k.beta) * d;
    if (f.relu && v < 0.0f) v = 0.0f;
    return v;
}
__device__ __forceinline__ float bn_affine_one(float x, const float* __restrict__ coef, i64 C,
                                               i64 c, bool has_add, float d, bool masked_off,
                                               BnAffineFlags f) {
    return bn_affine_k(x, bn_coef(coef, C, c, has_add && !f.plain), has_add, d, masked_off, f);
}

// bn_affine's channels-last vectors when the grid's stride is a whole number of rows
// (stride % run == 0, run = C / V vectors per row): each thread then meets the same V
// channels at every step, so their coefficients (and, with FC, a recomputed ReLU's forward
// ones) are loaded once into registers instead of once per element. Per element, those loads
// gather from V-strided addresses across the warp, several cache lines each: a bound far
// below memory speed where the vectors hold many channels. `first` < nv.
template <typename T, bool FC>
__device__ void bn_affine_rows(const T* __restrict__ x, const T* __restrict__ add,
                               const T* __restrict__ mask, const float* __restrict__ fc,
                               const float* __restrict__ coef, T* __restrict__ out, i64 nv,
                               i64 C, i64 run, i64 first, BnAffineFlags f) {
    const int V = 16 / sizeof(T);
    i64 c0 = imod(first, run) * V, stride = (i64)gridDim.x * blockDim.x;
    BnCoef k[V], fk[V];
    #pragma unroll
    for (int j = 0; j < V; ++j) {
        k[j] = bn_coef(coef, C, c0 + j, add && !f.plain);
        if (FC) fk[j] = bn_coef(fc, C, c0 + j, false);
    }
    #pragma unroll 2
    for (i64 i = first; i < nv; i += stride) {
        Vec16<T> xv = reinterpret_cast<const Vec16<T>*>(x)[i], av;
        Vec16<T> mv = {}; // read only with a mask; zero so that no copy reads garbage
        if (add) av = reinterpret_cast<const Vec16<T>*>(add)[i];
        if (mask) mv = reinterpret_cast<const Vec16<T>*>(mask)[i];
        #pragma unroll
        for (int j = 0; j < V; ++j) {
            float v = to_f32(xv.v[j]);
            bool off = false;
            if (FC) off = bn_pre_k(v, fk[j].alpha, fk[j].center, fk[j].gamma) <= 0.0f;
            else if (mask) off = to_f32(mv.v[j]) <= 0.0f;
            float d = add ? to_f32(av.v[j]) : 0.0f;
            xv.v[j] = from_f32<T>(bn_affine_k(v, k[j], add, d, off, f));
        }
        reinterpret_cast<Vec16<T>*>(out)[i] = xv;
    }
}

// out = alpha[c] (x - center[c]) + gamma[c], plus `add` when it is not null: beta[c] add
// (backward: add is dy), or add itself with flags bit 1 (forward: a residual). coef =
// [alpha | center | gamma | beta]: the output forward, the input's gradient backward. Flags
// bit 0, a fused ReLU forward: the output is clamped below at 0 (NaN stays). A fused ReLU
// backward: dy counts only where the forward's output was > 0 (or NaN), read from `mask` or,
// without it, recomputed from x with the forward's coefficients `fc` (relu_off); neither, all.
// Memory speed: 16-byte vectors where each lies in one channel's run (inner % V == 0) or
// holds V adjacent channels of a row (channels-last, C % V == 0) and every operand is
// aligned; the channel comes from 32-bit index arithmetic once per vector, or, channels-last
// with a stride of whole rows (the launcher sizes the grid so), once per thread
// (bn_affine_rows). FC: the kernel for a fused ReLU's backward that recomputes its mask from
// x (fc given, no mask), whose whole-row path holds those coefficients too; the other kernel
// takes every other call, with fewer registers. Either gives the right result for any call.
template <typename T, bool FC>
__device__ void bn_affine(const T* __restrict__ x, const T* __restrict__ add,
                          const T* __restrict__ mask, const float* __restrict__ fc,
                          const float* __restrict__ coef, T* __restrict__ out, i64 n, i64 C,
                          i64 inner, int flags) {
    const int V = 16 / sizeof(T);
    BnAffineFlags f = {(flags & 1) != 0, (flags & 2) != 0};
    bool fits = inner == 1 ? C % V == 0 : inner % V == 0;
    bool aligned = aligned16(x, out, add ? add : x) && aligned16(mask ? mask : x, x, x);
    i64 nv = fits && aligned ? n / V : 0;
    // Vectors per channels-last row, or per channel run.
    i64 run = inner == 1 ? C / V : inner / V;
    bool rows = inner == 1 && nv > 0 && ((i64)gridDim.x * blockDim.x) % run == 0;
    if (rows && FC == (fc && !mask)) {
        i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x;
        if (first < nv) bn_affine_rows<T, FC>(x, add, mask, fc, coef, out, nv, C, run, first, f);
        return; // n == nv V: no elements are left over
    }
    FOR_EACH(i, nv) {
        Vec16<T> xv = reinterpret_cast<const Vec16<T>*>(x)[i], av;
        Vec16<T> mv = {}; // read only with a mask; zero so that no copy reads garbage
        if (add) av = reinterpret_cast<const Vec16<T>*>(add)[i];
        if (mask) mv = reinterpret_cast<const Vec16<T>*>(mask)[i];
        if (inner == 1) {
            i64 c0 = imod(i, run) * V;
            #pragma unroll
            for (int j = 0; j < V; ++j) {
                float v = to_f32(xv.v[j]);
                bool off = relu_off(mask, mv.v[j], fc, C, c0 + j, v);
                float d = add ? to_f32(av.v[j]) : 0.0f;
                xv.v[j] = from_f32<T>(bn_affine_one(v, coef, C, c0 + j, add, d, off, f));
            }
        } else {
            i64 c = imod(idiv(i, run), C);
            #pragma unroll
            for (int j = 0; j < V; ++j) {
                float v = to_f32(xv.v[j]);
                bool off = relu_off(mask, mv.v[j], fc, C, c, v);
                float d = add ? to_f32(av.v[j]) : 0.0f;
                xv.v[j] = from_f32<T>(bn_affine_one(v, coef, C, c, add, d, off, f));
            }
        }
        reinterpret_cast<Vec16<T>*>(out)[i] = xv;
    }
    // Whatever the vectors did not cover, one element at a time.
    FOR_EACH(k, n - nv * V) {
        i64 i = nv * V + k;
        i64 c = inner == 1 ? imod(i, C) : imod(idiv(i, inner), C);
        float v = to_f32(x[i]);
        bool off = relu_off(mask, mask ? mask[i] : T(), fc, C, c, v);
        float d = add ? to_f32(add[i]) : 0.0f;
        out[i] = from_f32<T>(bn_affine_one(v, coef, C, c, add, d, off, f));
    }
}

// Layer normalisation (src/backend/cpu/layer_norm.rs): one block per row of `cols` contiguous
// elements; stats[2 r] = mean, stats[2 r + 1] = 1 / sqrt(var + eps). w and b may be null.

// Row r of layer norm from its elements xr (not restrict: ln_residual_forward passes the row
// it has just written) and this thread's share s of their sum: the mean, the variance as the
// mean of squared deviations (a second read of the row, not E[x^2] - mean^2), the output row
// and the statistics.
template <typename T>
__device__ void ln_row(const T* xr, float s, const T* __restrict__ w,
                       const T* __restrict__ b, T* __restrict__ yr, float* __restrict__ st,
                       i64 cols, float eps, float* scratch) {
    float m = block_reduce(0, s, scratch) / (float)cols;
    float q = 0.0f;
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
        float d = to_f32(xr[c]) - m;
        q += d * d;
    }
    float rstd = 1.0f / sqrtf(block_reduce(0, q, scratch) / (float)cols + eps);
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = (to_f32(xr[c]) - m) * rstd;
        if (w) v *= to_f32(w[c]);
        if (b) v += to_f32(b[c]);
        yr[c] = from_f32<T>(v);
    }
    if (threadIdx.x == 0) {
        st[0] = m;
        st[1] = rstd;
    }
}

template <typename T>
__device__ void ln_forward(const T* __restrict__ x, const T* __restrict__ w,
                           const T* __restrict__ b, T* __restrict__ y, float* __restrict__ stats,
                           i64 rows, i64 cols, float eps) {
    __shared__ float scratch[32];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * cols;
        float s = 0.0f;
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x) s += to_f32(xr[c]);
        ln_row<T>(xr, s, w, b, y + r * cols, stats + 2 * r, cols, eps, scratch);
    }
}

// A residual branch's element i: of dtype T (rk 0), f16 (rk 1) or bf16 (rk 2).
template <typename T>
__device__ __forceinline__ float branch_at(const void* __restrict__ br, int rk, i64 i) {
    switch (rk) {
    case 1: return to_f32(((const f16*)br)[i]);
    case 2: return to_f32(((const bf16*)br)[i]);
    default: return to_f32(((const T*)br)[i]);
    }
}

// The residual add and the layer norm after it in one kernel (llm.c's fused residual
// forward): sum = x + br, written in T, then ln_forward's normalisation of sum's rounded rows
// into y, each thread reading back only the elements it wrote. br is T or, added to an f32
// residual stream, f16/bf16 (rk as branch_at), promoted as the composed add promotes it.
template <typename T>
__device__ void ln_residual_forward(const T* __restrict__ x, const void* __restrict__ br, int rk,
                                    const T* __restrict__ w, const T* __restrict__ b,
                                    T* __restrict__ sum, T* __restrict__ y,
                                    float* __restrict__ stats, i64 rows, i64 cols, float eps) {
    __shared__ float scratch[32];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        T* sr = sum + r * cols;
        float s = 0.0f;
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
            T v = from_f32<T>(to_f32(x[r * cols + c]) + branch_at<T>(br, rk, r * cols + c));
            sr[c] = v;
            s += to_f32(v);
        }
        ln_row<T>(sr, s, w, b, y + r * cols, stats + 2 * r, cols, eps, scratch);
    }
}

// The columns one thread keeps the weight's and bias's gradient sums of, in registers, when
// ln_backward makes them (cols <= LN_K * blockDim.x; the launcher checks).
#define LN_K 8

// dx = rstd (g - mean(g) - xhat mean(g xhat)) per row, with g = dy w (dy when w is null),
// when dx is not null. When part is not null, also the sums over this block's rows of dy xhat
// and dy per column, written to part[blockIdx.x][0][c] and part[blockIdx.x][1][c] (f32,
// [gridDim.x, 2, cols]): each thread adds its own columns in a fixed order, so the sums
// are the same every run; ln_params adds the blocks' sums up.
template <typename T>
__device__ void ln_backward(const T* __restrict__ dy, const T* __restrict__ x,
                            const T* __restrict__ w, const float* __restrict__ stats,
                            T* __restrict__ dx, float* __restrict__ part, i64 rows, i64 cols) {
    __shared__ float scratch[32];
    float acc_w[LN_K], acc_b[LN_K];
#pragma unroll
    for (int k = 0; k < LN_K; ++k) acc_w[k] = acc_b[k] = 0.0f;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * cols;
        const T* dr = dy + r * cols;
        float m = stats[2 * r], rstd = stats[2 * r + 1];
        float s1 = 0.0f, s2 = 0.0f;
        if (dx) {
            for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
                float g = to_f32(dr[c]) * (w ? to_f32(w[c]) : 1.0f);
                s1 += g;
                s2 += g * (to_f32(xr[c]) - m) * rstd;
            }
            s1 = block_reduce(0, s1, scratch) / (float)cols;
            s2 = block_reduce(0, s2, scratch) / (float)cols;
        }
        if (part) {
#pragma unroll
            for (int k = 0; k < LN_K; ++k) {
                i64 c = threadIdx.x + (i64)k * blockDim.x;
                if (c < cols) {
                    float d = to_f32(dr[c]);
                    float xhat = (to_f32(xr[c]) - m) * rstd;
                    acc_w[k] += d * xhat;
                    acc_b[k] += d;
                    if (dx) dx[r * cols + c] = from_f32<T>(rstd * (d * (w ? to_f32(w[c]) : 1.0f) - s1 - xhat * s2));
                }
            }
        } else {
            for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
                float g = to_f32(dr[c]) * (w ? to_f32(w[c]) : 1.0f);
                float xhat = (to_f32(xr[c]) - m) * rstd;
                dx[r * cols + c] = from_f32<T>(rstd * (g - s1 - xhat * s2));
            }
        }
    }
    if (part) {
        float* pw = part + (i64)blockIdx.x * 2 * cols;
#pragma unroll
        for (int k = 0; k < LN_K; ++k) {
            i64 c = threadIdx.x + (i64)k * blockDim.x;
            if (c < cols) {
                pw[c] = acc_w[k];
                pw[cols + c] = acc_b[k];
            }
        }
    }
}

// The weight's and bias's gradients of layer norm: the sums of ln_backward's blocks
// (part [blocks, 2, cols]) in block order, rounded once.
template <typename T>
__device__ void ln_params(const float* __restrict__ part, T* __restrict__ dw, T* __restrict__ db,
                          i64 blocks, i64 cols) {
    FOR_EACH(j, 2 * cols) {
        float s = 0.0f;
        for (i64 b = 0; b < blocks; ++b) s += part[b * 2 * cols + j];
        if (j < cols) dw[j] = from_f32<T>(s);
        else db[j - cols] = from_f32<T>(s);
    }
}

#define BN(T)                                                                                  \
    extern "C" __global__ void bn_partial_##T(int mode, const T* x, const T* dy, const T* mask, \
                                              T* masked, const float* fc, float* part,         \
                                              i64 outer, i64 C, i64 inner, i64 chunk, int tg) {\
        bn_partial<T>(mode, x, dy, mask, masked, fc, part, outer, C, inner, chunk, tg);        \
    }                                                                                          \
    extern "C" __global__ void bn_affine_##T(const T* x, const T* add, const T* mask,          \
                                             const float* fc, const float* coef, T* out, i64 n, \
                                             i64 C, i64 inner, int flags) {                    \
        bn_affine<T, false>(x, add, mask, fc, coef, out, n, C, inner, flags);                  \
    }                                                                                          \
    extern "C" __global__ void bn_affine_fc_##T(const T* x, const T* add, const T* mask,       \
                                                const float* fc, const float* coef, T* out,     \
                                                i64 n, i64 C, i64 inner, int flags) {           \
        bn_affine<T, true>(x, add, mask, fc, coef, out, n, C, inner, flags);                   \
    }                                                                                          \
    extern "C" __global__ void ln_forward_##T(const T* x, const T* w, const T* b, T* y,         \
                                              float* stats, i64 rows, i64 cols, float eps) {    \
        ln_forward<T>(x, w, b, y, stats, rows, cols, eps);                                     \
    }                                                                                          \
    extern "C" __global__ void ln_residual_forward_##T(const T* x, const void* br, int rk,       \
                                                       const T* w, const T* b, T* sum, T* y,   \
                                                       float* stats, i64 rows, i64 cols,       \
                                                       float eps) {                            \
        ln_residual_forward<T>(x, br, rk, w, b, sum, y, stats, rows, cols, eps);               \
    }                                                                                          \
    extern "C" __global__ void ln_backward_##T(const T* dy, const T* x, const T* w,             \
                                               const float* stats, T* dx, float* part, i64 rows, \
                                               i64 cols) {                                      \
        ln_backward<T>(dy, x, w, stats, dx, part, rows, cols);                                 \
    }                                                                                          \
    extern "C" __global__ void ln_params_##T(const float* part, T* dw, T* db, i64 blocks,       \
                                             i64 cols) {                                        \
        ln_params<T>(part, dw, db, blocks, cols);                                              \
    }
PART(float, BN(float))
PART(f16, BN(f16))
PART(bf16, BN(bf16))

// Batch norm's affine map alpha (x - center) + gamma, from coef = [alpha | center | gamma |
// ...] (f32, [4, C] or longer), as f16 scale and bias, out = [alpha | gamma - alpha center]
// ([2, C]): the map a convolution applies in its prologue in cuDNN's graph, whose operands
// there are f16 (src/backend/cuda/conv_wgrad.rs). The bias is formed in f32, rounded once.
// A channel whose scale or bias passes f16's range (an almost constant channel far from
// zero: |mean| / std of 65504 or more) is stored divided by a power of two, factor[c] (else
// 1), so that its map stays finite: the convolution's weight gradient is linear in each
// input channel and ReLU commutes with a positive factor, so wgrad_rescale_f16 multiplies
// that channel's gradient back, exactly (a power of two).
#if PART_HAS_1
extern "C" __global__ void bn_scale_bias_f16(const float* __restrict__ coef, f16* __restrict__ out,
                                             float* __restrict__ factor, i64 C) {
    for (i64 c = blockIdx.x * (i64)blockDim.x + threadIdx.x; c < C; c += (i64)gridDim.x * blockDim.x) {
        float a = coef[c];
        float b = coef[2 * C + c] - a * coef[C + c];
        // The smallest power of two that brings both within 2^15 (well inside f16, and the
        // smaller of the two as far from f16's subnormals as it can be). A value that is not
        // finite already stays as it is.
        float m = fmaxf(fabsf(a), fabsf(b)), e = 1.0f;
        if (!(m <= 3.0e38f)) m = 0.0f;
        while (m / e > 32768.0f) e *= 2.0f;
        out[c] = from_f32<f16>(a / e);
        out[C + c] = from_f32<f16>(b / e);
        factor[c] = e;
    }
}

// dw (f16, KRSC: the input channel innermost, C of them) times factor[c] where it is not 1
// (bn_scale_bias_f16's): a read of the factors alone when no channel was scaled.
extern "C" __global__ void wgrad_rescale_f16(f16* __restrict__ dw, const float* __restrict__ factor,
                                             i64 n, i64 C) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float e = factor[i % C];
        if (e != 1.0f) dw[i] = from_f32<f16>(to_f32(dw[i]) * e);
    }
}
#endif
