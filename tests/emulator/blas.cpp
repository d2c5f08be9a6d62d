// An emulated cuBLAS / cuBLASLt for the emulated driver (driver.cpp): the few calls the
// backend makes (cublasGemmStridedBatchedEx, and GemmEx / Sgemm for gpu_check; cuBLASLt's
// matmul with the BIAS, RELU_BIAS, GELU_AUX_BIAS, DGELU_BGRAD and BGRADB epilogues), computed
// naively on the host in column-major order with f32 accumulation. It checks what the backend asks for (transposes, leading
// dimensions, batch strides, the bias's side), not cuBLAS itself. The products run when their
// stream does (queue.h). Built as both libcublas and libcublasLt.

#include "half.h"
#include "queue.h"
#include <cstdint>
#include <cstdio>
#include <cmath>
#include <cstring>
#include <vector>

typedef int Status;
enum { SUCCESS = 0, NOT_INITIALIZED = 1, INVALID_VALUE = 7, NOT_SUPPORTED = 15 };
enum { R_32F = 0, R_16F = 2, R_16BF = 14 };
enum { COMPUTE_32F_FAST_TF32 = 77 };

#define API extern "C" __attribute__((visibility("default")))

// A type code as an element kind (see half.h).
static Kind kind(int type) { return type == R_32F ? K_F32 : type == R_16F ? K_F16 : K_BF16; }
static float load(const void* p, int type, int64_t i) { return load(p, kind(type), i); }
static void store(void* p, int type, int64_t i, float v) { store(p, kind(type), i, v); }
static bool known(int type) { return type == R_32F || type == R_16F || type == R_16BF; }

// C = alpha op(A) op(B) + beta C, column-major, one matrix; then + bias[row] and ReLU.
// With `tf32`, f32 operands are rounded to TF32 first, as the tensor cores of a
// CUBLAS_COMPUTE_32F_FAST_TF32 product read them.
static void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const void* a, int at,
                 int64_t lda, const void* b, int bt, int64_t ldb, float beta, const void* c, void* d,
                 int dt, int64_t ldc, int64_t ldd, const void* bias, bool relu, bool tf) {
    for (int64_t j = 0; j < n; j++) {
        for (int64_t i = 0; i < m; i++) {
            float acc = 0.0f;
            for (int64_t l = 0; l < k; l++) {
                float x = load(a, at, ta ? l + i * lda : i + l * lda);
                float y = load(b, bt, tb ? j + l * ldb : l + j * ldb);
                if (tf) x = tf32(x), y = tf32(y);
                acc += x * y;
            }
            float v = alpha * acc;
            if (beta != 0.0f) v += beta * load(c, dt, i + j * ldc);
            if (bias) v += load(bias, dt, i);
            if (relu && v < 0.0f) v = 0.0f;
            store(d, dt, i + j * ldd, v);
        }
    }
}

API Status cublasCreate_v2(Handle** h) { return create_handle(h, "cublasCreate", NOT_INITIALIZED); }
API Status cublasDestroy_v2(Handle* h) { return destroy_handle(h); }
API Status cublasSetStream_v2(Handle* h, void* stream) { return set_handle_stream(h, stream); }
API Status cublasSetMathMode(void*, int) { return SUCCESS; }
API Status cublasSetWorkspace_v2(Handle* h, void* ws, size_t bytes) {
    if (bytes > 0 && (!ws || (uintptr_t)ws % 256 != 0)) return INVALID_VALUE;
    h->workspace = ws, h->workspace_bytes = bytes;
    return SUCCESS;
}
// A product queued into a capture on a handle without a workspace of its own: real cuBLAS
// would allocate one inside the capture (a memory node outside the caching allocator, and
// possibly other kernels than the eager steps chose), so it is refused here.
static bool unplanned_capture(const Handle* h, const char* what) {
    if (h->workspace_bytes > 0 || !capturing(h->stream)) return false;
    fprintf(stderr, "emulated %s: a product captured on a handle without cublasSetWorkspace\n", what);
    return true;
}

API Status cublasGemmStridedBatchedEx(Handle* h, int ta, int tb, int m, int n, int k, const void* alpha,
                                      const void* a, int at, int lda, long long sa, const void* b, int bt,
                                      int ldb, long long sb, const void* beta, void* c, int ct, int ldc,
                                      long long sc, int batch, int compute, int) {
    if (!known(at) || at != bt || bt != ct || m < 0 || n < 0 || k < 0 || batch < 0) return INVALID_VALUE;
    // A is m x k after its op: stored m x k (N) or k x m (T); lda must cover the stored rows.
    if (lda < (ta ? k : m) || ldb < (tb ? n : k) || ldc < m) {
        fprintf(stderr, "emulated cublasGemmStridedBatchedEx: bad leading dimension\n");
        return INVALID_VALUE;
    }
    if (unplanned_capture(h, "cublasGemmStridedBatchedEx")) return NOT_SUPPORTED;
    int size = at == R_32F ? 4 : 2;
    float al = *(const float*)alpha, be = *(const float*)beta; // host scalars: read now
    bool tf = at == R_32F && compute == COMPUTE_32F_FAST_TF32;
    later(h->stream, [=] {
        for (int bi = 0; bi < batch; bi++) {
            gemm(ta != 0, tb != 0, m, n, k, al, (const char*)a + bi * sa * size, at, lda,
                 (const char*)b + bi * sb * size, bt, ldb, be, (const char*)c + bi * sc * size,
                 (char*)c + bi * sc * size, ct, ldc, ldc, nullptr, false, tf);
        }
    });
    return SUCCESS;
}

// One product: a batch of one (gpu_check's GEMM figure calls these through cudarc).
API Status cublasGemmEx(Handle* h, int ta, int tb, int m, int n, int k, const void* alpha, const void* a,
                        int at, int lda, const void* b, int bt, int ldb, const void* beta, void* c, int ct,
                        int ldc, int compute, int algo) {
    return cublasGemmStridedBatchedEx(h, ta, tb, m, n, k, alpha, a, at, lda, 0, b, bt, ldb, 0, beta, c, ct,
                                      ldc, 0, 1, compute, algo);
}
API Status cublasSgemm_v2(Handle* h, int ta, int tb, int m, int n, int k, const float* alpha, const float* a,
                          int lda, const float* b, int ldb, const float* beta, float* c, int ldc) {
    return cublasGemmEx(h, ta, tb, m, n, k, alpha, a, R_32F, lda, b, R_32F, ldb, beta, c, R_32F, ldc, 0, 0);
}

// cuBLASLt: descriptors are plain structs.
struct LtLayout {
    int type;
    uint64_t rows, cols;
    int64_t ld;
};
struct LtDesc {
    int ta = 0, tb = 0, epilogue = 1, compute = 0;
    const void* bias = nullptr;
    void* aux = nullptr;
    int64_t aux_ld = 0;
};
// cublasLtEpilogue_t values the emulation implements.
enum { EP_DEFAULT = 1, EP_RELU = 2, EP_BIAS = 4, EP_RELU_BIAS = 6, EP_GELU_AUX_BIAS = 164,
       EP_DGELU_BGRAD = 208, EP_BGRADB = 512 };
static bool known_epilogue(int e) {
    return e == EP_DEFAULT || e == EP_RELU || e == EP_BIAS || e == EP_RELU_BIAS || e == EP_GELU_AUX_BIAS ||
           e == EP_DGELU_BGRAD || e == EP_BGRADB;
}
static bool has_aux(int e) { return e == EP_GELU_AUX_BIAS || e == EP_DGELU_BGRAD; }
API size_t cublasLtGetVersion() { return 130000; }
static int handle_token;
API Status cublasLtCreate(void** h) {
    if (capture_refuses("cublasLtCreate")) return NOT_INITIALIZED;
    *h = &handle_token;
    return SUCCESS;
}
API Status cublasLtDestroy(void*) { return SUCCESS; }
API Status cublasLtMatrixLayoutCreate(LtLayout** l, int type, uint64_t rows, uint64_t cols, int64_t ld) {
    if (!known(type) || ld < (int64_t)rows) return INVALID_VALUE;
    *l = new LtLayout{type, rows, cols, ld};
    return SUCCESS;
}
API Status cublasLtMatrixLayoutDestroy(LtLayout* l) {
    delete l;
    return SUCCESS;
}
API Status cublasLtMatmulDescCreate(LtDesc** d, int compute, int) {
    *d = new LtDesc;
    (*d)->compute = compute;
    return SUCCESS;
}
API Status cublasLtMatmulDescDestroy(LtDesc* d) {
    delete d;
    return SUCCESS;
}
API Status cublasLtMatmulDescSetAttribute(LtDesc* d, int attr, const void* v, size_t size) {
    switch (attr) {
    case 3: if (size != 4) return INVALID_VALUE; memcpy(&d->ta, v, 4); break;
    case 4: if (size != 4) return INVALID_VALUE; memcpy(&d->tb, v, 4); break;
    case 7: if (size != 4) return INVALID_VALUE; memcpy(&d->epilogue, v, 4); break;
    case 8: if (size != 8) return INVALID_VALUE; memcpy(&d->bias, v, 8); break;
    case 11: if (size != 8) return INVALID_VALUE; memcpy(&d->aux, v, 8); break;
    case 12: if (size != 8) return INVALID_VALUE; memcpy(&d->aux_ld, v, 8); break;
    default: break;
    }
    return SUCCESS;
}
API Status cublasLtMatmulPreferenceCreate(void** p) {
    *p = new int(0);
    return SUCCESS;
}
API Status cublasLtMatmulPreferenceDestroy(void* p) {
    delete (int*)p;
    return SUCCESS;
}
API Status cublasLtMatmulPreferenceSetAttribute(void*, int, const void*, size_t) { return SUCCESS; }

struct Heuristic {
    uint64_t algo[8];
    size_t workspace;
    Status state;
    float waves;
    int reserved[4];
};
// The shapes must agree: op(A) is m x k, op(B) k x n, C and D m x n.
static bool shapes(const LtDesc* d, const LtLayout* a, const LtLayout* b, const LtLayout* c,
                   const LtLayout* dl) {
    uint64_t m = dl->rows, n = dl->cols;
    uint64_t am = d->ta ? a->cols : a->rows, ak = d->ta ? a->rows : a->cols;
    uint64_t bk = d->tb ? b->cols : b->rows, bn = d->tb ? b->rows : b->cols;
    return am == m && bn == n && ak == bk && c->rows == m && c->cols == n && a->type == b->type &&
           b->type == dl->type;
}
API Status cublasLtMatmulAlgoGetHeuristic(void*, LtDesc* d, LtLayout* a, LtLayout* b, LtLayout* c,
                                          LtLayout* dl, void*, int requested, Heuristic* out, int* count) {
    if (requested < 1) return INVALID_VALUE;
    if (!shapes(d, a, b, c, dl)) {
        fprintf(stderr, "emulated cublasLtMatmulAlgoGetHeuristic: shapes do not agree\n");
        return INVALID_VALUE;
    }
    if (!known_epilogue(d->epilogue)) return NOT_SUPPORTED;
    // BGRADB reduces B only when it is read transposed (hardware answers NOT_SUPPORTED for
    // op(B) = N).
    if (d->epilogue == EP_BGRADB && d->tb == 0) return NOT_SUPPORTED;
    // cublasLtMatmulDescAttributes_t: the aux matrix's leading dimension is a multiple of 8
    // and covers D's rows.
    if (has_aux(d->epilogue) && (d->aux_ld % 8 != 0 || d->aux_ld < (int64_t)dl->rows)) {
        fprintf(stderr, "emulated cublasLtMatmulAlgoGetHeuristic: aux ld %lld for %llu rows\n",
                (long long)d->aux_ld, (unsigned long long)dl->rows);
        return INVALID_VALUE;
    }
    memset(out, 0, sizeof *out);
    *count = 1;
    return SUCCESS;
}
// GELU, tanh form, and its derivative (cuda/elementwise.cu's UNARY_GELU_TANH).
static float gelu_tanh(float x) {
    const float c = 0.7978845608028654f; // sqrt(2 / pi)
    return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
}
static float gelu_tanh_grad(float x) {
    const float c = 0.7978845608028654f;
    float t = tanhf(c * (x + 0.044715f * x * x * x));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * c * (1.0f + 3.0f * 0.044715f * x * x);
}

// The epilogues past bias and ReLU, after `gemm` wrote D = alpha op(A) op(B) (beta = 0,
// checked by the caller) in f32 to `acc` (m x n, ld m): GELU_AUX_BIAS writes acc + bias to
// aux (rounded) and GELU of its f32 value to D; DGELU_BGRAD writes acc * GELU'(aux) to D and
// its sums over the n columns to bias (m); BGRADB writes D and op(B)'s sums over k to bias
// (n), all f32 sums rounded once to D's type.
static void lt_epilogue(const LtDesc& d, int64_t m, int64_t n, int64_t k, const float* acc, void* out,
                        int dt, int64_t ldd, const void* b, int bt, int64_t ldb) {
    if (d.epilogue == EP_BGRADB) {
        for (int64_t j = 0; j < n; j++) {
            float s = 0.0f;
            for (int64_t l = 0; l < k; l++) s += load(b, bt, d.tb ? j + l * ldb : l + j * ldb);
            store((void*)d.bias, dt, j, s);
        }
    }
    for (int64_t i = 0; i < m; i++) {
        float s = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            float v = acc[i + j * m];
            if (d.epilogue == EP_GELU_AUX_BIAS) {
                v += load(d.bias, dt, i);
                store(d.aux, dt, i + j * d.aux_ld, v);
                v = gelu_tanh(v);
            } else if (d.epilogue == EP_DGELU_BGRAD) {
                v *= gelu_tanh_grad(load(d.aux, dt, i + j * d.aux_ld));
                s += v;
            }
            store(out, dt, i + j * ldd, v);
        }
        if (d.epilogue == EP_DGELU_BGRAD) store((void*)d.bias, dt, i, s);
    }
}

API Status cublasLtMatmul(void*, LtDesc* d, const void* alpha, const void* a, LtLayout* al, const void* b,
                          LtLayout* bl, const void* beta, const void* c, LtLayout* cl, void* out,
                          LtLayout* dl, const void*, void*, size_t, void* stream) {
    if (!shapes(d, al, bl, cl, dl) || !known_epilogue(d->epilogue)) return INVALID_VALUE;
    int ep = d->epilogue;
    bool bias = ep == EP_BIAS || ep == EP_RELU_BIAS, relu = ep == EP_RELU || ep == EP_RELU_BIAS;
    bool wide = ep == EP_GELU_AUX_BIAS || ep == EP_DGELU_BGRAD || ep == EP_BGRADB;
    if ((bias || wide) && !d->bias) return INVALID_VALUE;
    if (has_aux(ep) && !d->aux) return INVALID_VALUE;
    int64_t k = d->ta ? al->rows : al->cols;
    // The descriptors and host scalars as they are now: the caller may change or free them.
    LtDesc dd = *d;
    LtLayout A = *al, B = *bl, C = *cl, D = *dl;
    float alv = *(const float*)alpha, bev = *(const float*)beta;
    if (wide && bev != 0.0f) {
        // cuBLASLt allows it; this emulation implements these epilogues for beta = 0 only,
        // as the engine calls them.
        fprintf(stderr, "emulated cublasLtMatmul: epilogue %d with beta != 0 is not emulated\n", ep);
        return NOT_SUPPORTED;
    }
    later(stream, [=] {
        if (!wide) {
            gemm(dd.ta != 0, dd.tb != 0, D.rows, D.cols, k, alv, a, A.type, A.ld, b, B.type, B.ld, bev, c,
                 out, D.type, C.ld, D.ld, bias ? dd.bias : nullptr, relu,
                 A.type == R_32F && dd.compute == COMPUTE_32F_FAST_TF32);
            return;
        }
        // The product in f32 first (the epilogue reads the unrounded accumulator).
        std::vector<float> acc(D.rows * D.cols);
        gemm(dd.ta != 0, dd.tb != 0, D.rows, D.cols, k, alv, a, A.type, A.ld, b, B.type, B.ld, 0.0f,
             nullptr, acc.data(), R_32F, D.rows, D.rows, nullptr, false,
             A.type == R_32F && dd.compute == COMPUTE_32F_FAST_TF32);
        lt_epilogue(dd, D.rows, D.cols, k, acc.data(), out, D.type, D.ld, b, B.type, B.ld);
    });
    return SUCCESS;
}
