// The fused optimizer update (src/backend/cpu/optim.rs and the rules in src/backend/ops.rs):
// one pass reads parameter or f32 master, gradient and states, computes in f32, and writes
// them back, plus the f16/bf16 working copy of a master (round to nearest or stochastic), for
// a list of tensors per launch.
// The step count and the overflow flag are read on the device: a set flag skips everything,
// and `optim_count` (launched after the update) advances the count, so no host read is needed.

struct OptimArgs {
    int kind;       // 0 SGD, 1 Adam, 2 Adadelta, 3 RMSprop, 4 Adagrad
    int flags;      // 1 nesterov, 2 decoupled weight decay, 4 momentum buffer in use, 8 centered
    int stochastic; // working copy rounding: 0 nearest, 1 stochastic (bf16)
    // SGD: a momentum, b dampening; Adam: a beta1, b beta2; Adadelta: a rho; RMSprop: a alpha,
    // b momentum; Adagrad: b lr_decay.
    float lr, a, b, eps, wd;
    // Computed in f64 on the host, as the CPU's rules are (1 - 0.999 in f32 is off by 1.3e-5):
    float ac, bc;       // 1 - a, 1 - b
    float log_a, log_b; // ln a, ln b: Adam's bias corrections 1 - a^t = -expm1(t ln a)
    float decay;        // AdamW's 1 - lr wd
};

// The key of the update that follows `steps` earlier ones (rounding.rs: stochastic_key).
__device__ __forceinline__ uint2 stochastic_key(u64 seed, u64 steps) {
    uint4 r = philox(make_uint4((u32)steps, (u32)(steps >> 32), 0x53524e44u, 0u),
                     make_uint2((u32)seed, (u32)(seed >> 32)));
    return make_uint2(r.x, r.y);
}

// Sixteen random bits for element i (rounding.rs: stochastic_bits, 8 elements per block).
__device__ __forceinline__ u32 stochastic_bits(uint2 key, i64 i) {
    u64 block = (u64)i >> 3;
    uint4 r = philox(make_uint4((u32)block, (u32)(block >> 32), 0u, 0u), key);
    int j = (int)(i & 7);
    u32 w = (j < 2) ? r.x : (j < 4) ? r.y : (j < 6) ? r.z : r.w;
    return (w >> (16 * (j & 1))) & 0xFFFFu;
}

template <typename W> __device__ __forceinline__ void write_working(W* w, i64 i, float v, bool sr, uint2 key);
template <> __device__ __forceinline__ void write_working<f16>(f16* w, i64 i, float v, bool, uint2) {
    w[i] = from_f32<f16>(v);
}
template <> __device__ __forceinline__ void write_working<bf16>(bf16* w, i64 i, float v, bool sr, uint2 key) {
    w[i] = sr ? bf16_stochastic(v, stochastic_bits(key, i)) : from_f32<bf16>(v);
}
template <> __device__ __forceinline__ void write_working<float>(float*, i64, float, bool, uint2) {}

// Updates elements i0, i0 + stride, ... below n of one tensor, after `steps` earlier updates,
// drawing stochastic rounding bits from `seed`'s stream.
template <typename P, typename G, typename W>
__device__ void optim_span(const OptimArgs& a, P* p, const G* g, P* s0, P* s1, P* s2, W* w,
                           float steps, u64 seed, i64 i0, i64 n, i64 stride) {
    bool first = steps == 0.0f;
    float t = steps + 1.0f;
    uint2 key = stochastic_key(seed, (u64)steps);
    // Adam's constants (ops.rs: AdamRule), computed per thread from the device step count.
    float decay = (a.flags & 2) ? a.decay : 1.0f;
    float l2 = (a.flags & 2) ? 0.0f : a.wd;
    float inv_bc2 = 1.0f / -expm1f(t * a.log_b);
    float step_size = a.lr / -expm1f(t * a.log_a);
    // Adagrad's decayed rate after `steps` earlier updates.
    float clr = a.lr / (1.0f + steps * a.b);
    for (i64 i = i0; i < n; i += stride) {
        float x = to_f32(p[i]), gi = to_f32(g[i]);
        if (a.kind == 0) {
            float d = gi + a.wd * x;
            if (a.flags & 4) {
                float m = first ? d : a.a * to_f32(s0[i]) + a.bc * d;
                s0[i] = from_f32<P>(m);
                d = (a.flags & 1) ? d + a.a * m : m;
            }
            x = x - a.lr * d;
        } else if (a.kind == 1) {
            float gg = gi + l2 * x;
            float m = a.a * to_f32(s0[i]) + a.ac * gg;
            float v = a.b * to_f32(s1[i]) + a.bc * gg * gg;
            s0[i] = from_f32<P>(m);
            s1[i] = from_f32<P>(v);
            x = x * decay - step_size * m / (sqrtf(v * inv_bc2) + a.eps);
        } else if (a.kind == 2) {
            float gg = gi + a.wd * x;
            float sq = a.a * to_f32(s0[i]) + a.ac * gg * gg;
            float d = sqrtf(to_f32(s1[i]) + a.eps) / sqrtf(sq + a.eps) * gg;
            s0[i] = from_f32<P>(sq);
            s1[i] = from_f32<P>(a.a * to_f32(s1[i]) + a.ac * d * d);
            x = x - a.lr * d;
        } else if (a.kind == 3) {
            // RMSprop: square_avg in s0, then grad_avg (centered), then the momentum buffer.
            float gg = gi + a.wd * x;
            float sq = a.a * to_f32(s0[i]) + a.ac * gg * gg;
            s0[i] = from_f32<P>(sq);
            float avg;
            if (a.flags & 8) {
                float ga = a.a * to_f32(s1[i]) + a.ac * gg;
                s1[i] = from_f32<P>(ga);
                avg = sqrtf(sq - ga * ga) + a.eps;
            } else {
                avg = sqrtf(sq) + a.eps;
            }
            float d = gg / avg;
            if (a.flags & 4) {
                P* buf = (a.flags & 8) ? s2 : s1;
                d = a.b * to_f32(buf[i]) + d;
                buf[i] = from_f32<P>(d);
            }
            x = x - a.lr * d;
        } else {
            float gg = gi + a.wd * x;
            float sum = to_f32(s0[i]) + gg * gg;
            s0[i] = from_f32<P>(sum);
            x = x - clr * gg / (sqrtf(sum) + a.eps);
        }
        p[i] = from_f32<P>(x);
        if (w != nullptr) write_working<W>(w, i, x, a.stochastic != 0, key);
    }
}

// Up to OPTIM_LIST tensors updated by one launch (PyTorch's multi_tensor_apply): tensor k
// has n[k] elements in chunks of OPTIM_CHUNK, its chunks numbered from start[k] (start is
// increasing; `chunks` in all). Pointers are to each tensor's element 0; s0, s1, s2, w may
// be null as in the update's rules. At most 4 KB of kernel parameters with OptimArgs.
#define OPTIM_LIST 48
#define OPTIM_CHUNK 16384
struct OptimList {
    i64 count;
    i64 chunks;
    void* p[OPTIM_LIST];
    const void* g[OPTIM_LIST];
    void* s0[OPTIM_LIST];
    void* s1[OPTIM_LIST];
    void* s2[OPTIM_LIST];
    void* w[OPTIM_LIST];
    float* step[OPTIM_LIST];
    i64 n[OPTIM_LIST];
    i64 start[OPTIM_LIST];
    u64 seed[OPTIM_LIST];
};

// Every listed tensor's update, skipped whole when found_inf is set. A block takes chunks
// b, b + gridDim, ...; the step counts are read here and advanced by optim_count after.
template <typename P, typename G, typename W>
__device__ void optim_list(OptimArgs a, const OptimList& L, const float* found_inf) {
    if (found_inf != nullptr && *found_inf != 0.0f) return;
    for (i64 b = blockIdx.x; b < L.chunks; b += gridDim.x) {
        int k = list_entry(L.start, L.count, b);
        i64 begin = (b - L.start[k]) * OPTIM_CHUNK;
        i64 end = begin + OPTIM_CHUNK < L.n[k] ? begin + OPTIM_CHUNK : L.n[k];
        optim_span<P, G, W>(a, (P*)L.p[k], (const G*)L.g[k], (P*)L.s0[k], (P*)L.s1[k],
                            (P*)L.s2[k], (W*)L.w[k], *L.step[k], L.seed[k], begin + threadIdx.x, end,
                            blockDim.x);
    }
}

// `hyper` (else null): [lr, decay] in device memory, which a CUDA graph's replay writes
// before it runs (src/graph), in place of the values captured in `a`.
#define OPTIM(name, P, G, W)                                                                 \
    extern "C" __global__ void name(OptimArgs a, OptimList list, const float* found_inf,     \
                                    const float* hyper) {                                    \
        if (hyper) a.lr = hyper[0], a.decay = hyper[1];                                      \
        optim_list<P, G, W>(a, list, found_inf);                                             \
    }

PART(float, OPTIM(optim_float_float, float, float, float))
PART(f16, OPTIM(optim_f16_f16, f16, f16, float))
PART(bf16, OPTIM(optim_bf16_bf16, bf16, bf16, float))
// f32 masters with their working copies, gradients in the working dtype or in f32.
PART(f16, OPTIM(optim_master_f16_f16, float, f16, f16))
PART(float, OPTIM(optim_master_float_f16, float, float, f16))
PART(bf16, OPTIM(optim_master_bf16_bf16, float, bf16, bf16))
PART(float, OPTIM(optim_master_float_bf16, float, float, bf16))

// Counts the update of every listed tensor, unless it was skipped. One thread per tensor.
#if PART_HAS_0
extern "C" __global__ void optim_count(OptimList list, const float* found_inf) {
    i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (k < list.count && (found_inf == nullptr || *found_inf == 0.0f)) *list.step[k] += 1.0f;
}
#endif

// Rewrites a working copy from its master with the bits of the last counted update
// (master.rs: resync; after a checkpoint load or SGLD's noise).
#if PART_HAS_1
extern "C" __global__ void round_master_f16(const float* m, f16* w, i64 n) {
    FOR_EACH(i, n) w[i] = from_f32<f16>(m[i]);
}
#endif
#if PART_HAS_2
extern "C" __global__ void round_master_bf16(const float* m, bf16* w, int stochastic, u64 seed,
                                             const float* step, i64 n) {
    float s = *step;
    uint2 key = stochastic_key(seed, s >= 1.0f ? (u64)s - 1 : 0);
    FOR_EACH(i, n) write_working<bf16>(w, i, m[i], stochastic != 0, key);
}
#endif
