// Elementwise ops on contiguous (vectorised) or strided (broadcast) inputs into a contiguous
// output, arithmetic in f32.
// The op codes (UNARY_*, BINARY_*, CMP_*) are defined from UnaryOp / BinaryOp / CmpOp in
// src/backend/ops.rs (`kernels::op_codes`), and the formulas are the ones written there.

#define SQRT_2_OVER_PI 0.7978845608028654f
#define GELU_C 0.044715f
#define FRAC_1_SQRT_2 0.7071067811865476f
#define INV_SQRT_2PI 0.3989422804014327f

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ __forceinline__ float unary_f(int op, float a, float b, float x) {
    switch (op) {
    case UNARY_NEG: return -x;
    case UNARY_ABS: return fabsf(x);
    case UNARY_EXP: return expf(x);
    case UNARY_LOG: return logf(x);
    case UNARY_LOG1P: return log1pf(x);
    case UNARY_SQRT: return sqrtf(x);
    case UNARY_RSQRT: return rsqrtf(x);
    case UNARY_RECIP: return 1.0f / x;
    case UNARY_SIN: return sinf(x);
    case UNARY_COS: return cosf(x);
    case UNARY_TANH: return tanhf(x);
    case UNARY_SIGMOID: return sigmoid(x);
    case UNARY_RELU: return x < 0.0f ? 0.0f : x; // NaN stays NaN, as in PyTorch
    case UNARY_LEAKY_RELU: return x > 0.0f ? x : x * a;
    case UNARY_GELU: return 0.5f * x * (1.0f + erff(x * FRAC_1_SQRT_2));
    case UNARY_GELU_TANH: return 0.5f * x * (1.0f + tanhf(SQRT_2_OVER_PI * (x + GELU_C * x * x * x)));
    case UNARY_SILU: return x * sigmoid(x);
    case UNARY_AFFINE: return x * a + b;
    case UNARY_POW_SCALAR: return a == 2.0f ? x * x : powf(x, a);
    case UNARY_SCALAR_POW: return powf(a, x);
    case UNARY_CLAMP_MIN: return x < a ? a : x;
    case UNARY_SOFTPLUS: return x > 20.0f ? x : log1pf(expf(x));
    case UNARY_CLAMP_MAX: default: return x > a ? a : x;
    }
}

// d f / d x at x.
__device__ __forceinline__ float unary_df(int op, float a, float x) {
    switch (op) {
    case UNARY_NEG: return -1.0f;
    case UNARY_ABS: return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f);
    case UNARY_EXP: return expf(x);
    case UNARY_LOG: return 1.0f / x;
    case UNARY_LOG1P: return 1.0f / (1.0f + x);
    case UNARY_SQRT: return 0.5f / sqrtf(x);
    case UNARY_RSQRT: return -0.5f / (x * sqrtf(x));
    case UNARY_RECIP: return -1.0f / (x * x);
    case UNARY_SIN: return cosf(x);
    case UNARY_COS: return -sinf(x);
    case UNARY_TANH: { float t = tanhf(x); return 1.0f - t * t; }
    case UNARY_SIGMOID: { float s = sigmoid(x); return s * (1.0f - s); }
    case UNARY_RELU: return x <= 0.0f ? 0.0f : 1.0f; // NaN passes the gradient, as in PyTorch
    case UNARY_LEAKY_RELU: return x > 0.0f ? 1.0f : a;
    case UNARY_GELU: return 0.5f * (1.0f + erff(x * FRAC_1_SQRT_2)) + x * expf(-0.5f * x * x) * INV_SQRT_2PI;
    case UNARY_GELU_TANH: {
        float t = tanhf(SQRT_2_OVER_PI * (x + GELU_C * x * x * x));
        float dinner = SQRT_2_OVER_PI * (1.0f + 3.0f * GELU_C * x * x);
        return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * dinner;
    }
    case UNARY_SILU: { float s = sigmoid(x); return s * (1.0f + x * (1.0f - s)); }
    case UNARY_AFFINE: return a;
    case UNARY_POW_SCALAR: return a == 0.0f ? 0.0f : a * powf(x, a - 1.0f);
    case UNARY_SCALAR_POW: return a == 0.0f && x >= 0.0f ? 0.0f : powf(a, x) * logf(a); // PyTorch's 0^x
    case UNARY_CLAMP_MIN: return x > a ? 1.0f : 0.0f;
    case UNARY_SOFTPLUS: return x > 20.0f ? 1.0f : sigmoid(x);
    case UNARY_CLAMP_MAX: default: return x < a ? 1.0f : 0.0f;
    }
}

// g f'(x): where the derivative is a mask (ReLU, the scalar clamps) or zero by definition
// (x^0) the gradient is selected, so an infinite or NaN g there gives 0, as PyTorch's
// threshold_backward, clamp and pow backward do (src/backend/ops.rs: UnaryOp::grad).
__device__ __forceinline__ float unary_grad_f(int op, float a, float x, float g) {
    float d = unary_df(op, a, x);
    bool selects = op == UNARY_RELU || op == UNARY_CLAMP_MIN || op == UNARY_CLAMP_MAX ||
                   (op == UNARY_POW_SCALAR && a == 0.0f);
    return selects && d == 0.0f ? 0.0f : d * g;
}

__device__ __forceinline__ float binary_f(int op, float a, float b) {
    switch (op) {
    case BINARY_ADD: return a + b;
    case BINARY_SUB: return a - b;
    case BINARY_MUL: return a * b;
    case BINARY_DIV: return a / b;
    case BINARY_POW: return powf(a, b);
    case BINARY_MAX: return nan_max(a, b);
    case BINARY_MIN: default: return nan_min(a, b);
    }
}

template <typename V> __device__ __forceinline__ bool cmp_v(int op, V a, V b) {
    switch (op) {
    case CMP_EQ: return a == b;
    case CMP_NE: return a != b;
    case CMP_LT: return a < b;
    case CMP_LE: return a <= b;
    case CMP_GT: return a > b;
    case CMP_GE: default: return a >= b;
    }
}

// Contiguous operands: 16-byte vector loads and stores when every pointer is aligned (a
// fresh block always is), the tail and unaligned views element by element.
template <typename T>
__device__ void unary_contiguous(int op, float a, float b, const T* x, T* out, i64 n) {
    const int V = 16 / sizeof(T);
    i64 nv = aligned16(x, out, out) ? n / V : 0;
    FOR_EACH(i, nv) {
        Vec16<T> v = reinterpret_cast<const Vec16<T>*>(x)[i];
        #pragma unroll
        for (int j = 0; j < V; ++j) v.v[j] = from_f32<T>(unary_f(op, a, b, to_f32(v.v[j])));
        reinterpret_cast<Vec16<T>*>(out)[i] = v;
    }
    FOR_EACH(i, n - nv * V) {
        i64 k = nv * V + i;
        out[k] = from_f32<T>(unary_f(op, a, b, to_f32(x[k])));
    }
}

// out[i] = f(x[i], y[i]) on contiguous operands: 16-byte vector loads where all three are
// aligned, no index arithmetic (the strided kernels' 64-bit divisions per dimension cost more
// than the bytes). `f` takes and returns f32.
template <typename T, typename F>
__device__ void pair_contiguous(const T* x, const T* y, T* out, i64 n, F f) {
    const int V = 16 / sizeof(T);
    i64 nv = aligned16(x, y, out) ? n / V : 0;
    FOR_EACH(i, nv) {
        Vec16<T> u = reinterpret_cast<const Vec16<T>*>(x)[i];
        Vec16<T> w = reinterpret_cast<const Vec16<T>*>(y)[i];
        #pragma unroll
        for (int j = 0; j < V; ++j) u.v[j] = from_f32<T>(f(to_f32(u.v[j]), to_f32(w.v[j])));
        reinterpret_cast<Vec16<T>*>(out)[i] = u;
    }
    FOR_EACH(i, n - nv * V) {
        i64 k = nv * V + i;
        out[k] = from_f32<T>(f(to_f32(x[k]), to_f32(y[k])));
    }
}

template <typename T>
__device__ void binary_contiguous(int op, const T* x, const T* y, T* out, i64 n) {
    pair_contiguous(x, y, out, n, [=](float u, float w) { return binary_f(op, u, w); });
}

// out[i] = f'(x[i]) * g[i] on contiguous operands.
template <typename T>
__device__ void unary_grad_contiguous(int op, float a, const T* x, const T* g, T* out, i64 n) {
    pair_contiguous(x, g, out, n, [=](float u, float w) { return unary_grad_f(op, a, u, w); });
}

#define ELEMENTWISE(T)                                                                         \
    /* out[i] = f(x[i]); contiguous input. */                                                   \
    extern "C" __global__ void unary_##T(int op, float a, float b, const T* x, T* out, i64 n) { \
        unary_contiguous<T>(op, a, b, x, out, n);                                              \
    }                                                                                          \
    extern "C" __global__ void unary_strided_##T(int op, float a, float b, const T* x,          \
                                                 Strided lx, T* out, i64 n) {                   \
        FOR_EACH(i, n) out[i] = from_f32<T>(unary_f(op, a, b, to_f32(x[strided_index(lx, i)]))); \
    }                                                                                          \
    /* out[i] = f'(x[i]) * g[i]: the backward of a unary op. */                                \
    extern "C" __global__ void unary_grad_contiguous_##T(int op, float a, const T* x,           \
                                                         const T* g, T* out, i64 n) {           \
        unary_grad_contiguous<T>(op, a, x, g, out, n);                                         \
    }                                                                                          \
    extern "C" __global__ void unary_grad_##T(int op, float a, const T* x, Strided lx,          \
                                              const T* g, Strided lg, T* out, i64 n) {          \
        FOR_EACH(i, n) {                                                                       \
            float xv = to_f32(x[strided_index(lx, i)]);                                        \
            out[i] = from_f32<T>(unary_grad_f(op, a, xv, to_f32(g[strided_index(lg, i)])));    \
        }                                                                                      \
    }                                                                                          \
    extern "C" __global__ void binary_##T(int op, const T* x, const T* y, T* out, i64 n) {     \
        binary_contiguous<T>(op, x, y, out, n);                                                \
    }                                                                                          \
    extern "C" __global__ void binary_strided_##T(int op, const T* x, Strided lx, const T* y,  \
                                                  Strided ly, T* out, i64 n) {                  \
        FOR_EACH(i, n) {                                                                       \
            float a = to_f32(x[strided_index(lx, i)]), b = to_f32(y[strided_index(ly, i)]);    \
            out[i] = from_f32<T>(binary_f(op, a, b));                                          \
        }                                                                                      \
    }

PART(float, ELEMENTWISE(float))
PART(f16, ELEMENTWISE(f16))
PART(bf16, ELEMENTWISE(bf16))

/* I64 arithmetic as the CPU backend does it: in f64 (exact below 2^53), the result truncated
   toward zero and saturated (cvt.rzi), so 7 / 2 = 3 and x / 0 saturates. */
__device__ __forceinline__ double binary_d(int op, double a, double b) {
    switch (op) {
    case BINARY_ADD: return a + b;
    case BINARY_SUB: return a - b;
    case BINARY_MUL: return a * b;
    case BINARY_DIV: return a / b;
    case BINARY_POW: return pow(a, b);
    case BINARY_MAX: return fmax(a, b);
    case BINARY_MIN: default: return fmin(a, b);
    }
}
/* Integer powers exactly, as the CPU's `pow_i64`: square-and-multiply wrapping on overflow
   (unsigned arithmetic: signed overflow is undefined); a negative exponent gives 1 / a^-b
   truncated (1, +-1 or 0), as PyTorch's powi. */
__device__ __forceinline__ i64 pow_i64(i64 a, i64 b) {
    if (b < 0) return a == 1 ? 1 : a == -1 ? ((b & 1) ? -1 : 1) : 0;
    unsigned long long base = (unsigned long long)a, acc = 1, e = (unsigned long long)b;
    while (e) {
        if (e & 1) acc *= base;
        base *= base;
        e >>= 1;
    }
    return (i64)acc;
}
/* u8 powers modulo 256, as the CPU's `pow_u8`. */
__device__ __forceinline__ u8 pow_u8(u8 a, u8 b) {
    unsigned int base = a, acc = 1, e = b;
    while (e) {
        if (e & 1) acc = (acc * base) & 255u;
        base = (base * base) & 255u;
        e >>= 1;
    }
    return (u8)acc;
}
/* Integer arithmetic as the CPU's `int_op_i64`: sums, differences and products modulo 2^64
   (unsigned arithmetic: signed overflow is undefined), maximum and minimum exactly, powers
   exactly; division (which the ops promote to a float first) through f64, truncated. */
#if PART_HAS_0
extern "C" __global__ void binary_strided_i64(int op, const i64* x, Strided lx, const i64* y,
                                              Strided ly, i64* out, i64 n) {
    FOR_EACH(i, n) {
        i64 a = x[strided_index(lx, i)], b = y[strided_index(ly, i)];
        unsigned long long ua = (unsigned long long)a, ub = (unsigned long long)b;
        switch (op) {
        case BINARY_ADD: out[i] = (i64)(ua + ub); continue;
        case BINARY_SUB: out[i] = (i64)(ua - ub); continue;
        case BINARY_MUL: out[i] = (i64)(ua * ub); continue;
        case BINARY_MAX: out[i] = a > b ? a : b; continue;
        case BINARY_MIN: out[i] = a < b ? a : b; continue;
        case BINARY_POW: out[i] = pow_i64(a, b); continue;
        default: break;
        }
        double r = binary_d(op, (double)a, (double)b);
        i64 v;
#ifdef __CUDACC_RTC__
        asm("cvt.rzi.s64.f64 %0, %1;" : "=l"(v) : "d"(r));
#else
        v = host_f64_to_i64(r);
#endif
        out[i] = v;
    }
}
#endif

/* U8 arithmetic as the CPU's `int_op_u8`: modulo 256 (0 - 5 = 251), maximum and minimum
   exactly; division through f32, the result truncated toward zero and saturated to 0..255,
   NaN to 0 (Rust's `as u8`), so 7 / 2 = 3 and x / 0 = 255. */
#if PART_HAS_0
extern "C" __global__ void binary_strided_u8(int op, const u8* x, Strided lx, const u8* y,
                                             Strided ly, u8* out, i64 n) {
    FOR_EACH(i, n) {
        unsigned int a = x[strided_index(lx, i)], b = y[strided_index(ly, i)];
        switch (op) {
        case BINARY_ADD: out[i] = (u8)((a + b) & 255u); continue;
        case BINARY_SUB: out[i] = (u8)((a - b) & 255u); continue;
        case BINARY_MUL: out[i] = (u8)((a * b) & 255u); continue;
        case BINARY_MAX: out[i] = (u8)(a > b ? a : b); continue;
        case BINARY_MIN: out[i] = (u8)(a < b ? a : b); continue;
        case BINARY_POW: out[i] = pow_u8((u8)a, (u8)b); continue;
        default: break;
        }
        float r = binary_f(op, (float)a, (float)b);
        out[i] = r != r || r <= 0.0f ? 0 : r >= 255.0f ? 255 : (u8)r;
    }
}
#endif

/* A U8 mask of 0 and 1; floats compare as f32, integers exactly. `V` is the compared type. */
#define COMPARE(T, V)                                                                          \
    extern "C" __global__ void cmp_##T(int op, const T* x, Strided lx, const T* y, Strided ly, \
                                       u8* out, i64 n) {                                        \
        FOR_EACH(i, n) {                                                                       \
            V a = (V)compared(x[strided_index(lx, i)]);                                  \
            V b = (V)compared(y[strided_index(ly, i)]);                                  \
            out[i] = cmp_v<V>(op, a, b) ? 1 : 0;                                               \
        }                                                                                      \
    }                                                                                          \
    /* out = mask ? x : y. */                                                                  \
    extern "C" __global__ void where_##T(const u8* m, Strided lm, const T* x, Strided lx,      \
                                         const T* y, Strided ly, T* out, i64 n) {               \
        FOR_EACH(i, n) {                                                                       \
            out[i] = m[strided_index(lm, i)] ? x[strided_index(lx, i)] : y[strided_index(ly, i)]; \
        }                                                                                      \
    }

__device__ __forceinline__ float compared(f16 x) { return to_f32(x); }
__device__ __forceinline__ float compared(bf16 x) { return to_f32(x); }
__device__ __forceinline__ float compared(float x) { return x; }
__device__ __forceinline__ i64 compared(i64 x) { return x; }
__device__ __forceinline__ int compared(u8 x) { return x; }

PART(float, COMPARE(float, float))
PART(f16, COMPARE(f16, float))
PART(bf16, COMPARE(bf16, float))
PART(i64, COMPARE(i64, i64))
PART(u8, COMPARE(u8, int))
