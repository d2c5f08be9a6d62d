// An emulated cuDNN 9 for the emulated driver (driver.cpp): 2-D cross-correlation forward,
// backward data and backward filter in NCHW/KCRS or NHWC/KRSC, with groups, stride, padding
// and dilation, computed naively on the host with f32 accumulation. It offers two
// "algorithms" per pass, the first without a workspace, the second with a 1 MiB one, so that
// the backend's choice and workspace paths run. Both forward algorithms are deterministic, as
// the real library documents all of its own; of backward data and backward filter, algorithm 0 is
// reported non-deterministic (the real ALGO_0 of both adds with atomics) and sums in another
// order each time it runs (the batch and output-channel loops rotated and reversed by a hash
// of a call counter), so that two runs of the same call differ in their last f32 bits, and
// algorithm 1 is deterministic. The heuristics and the timed search list algorithm 0 first.
// It checks the descriptors the backend builds (shapes agree, one format, one data type),
// not cuDNN itself, and refuses (BAD_PARAM, said on stderr) a call whose data pointers are
// not 16-byte aligned, as the real library's tensor-core kernels require (a piece of a split
// batch must start aligned). The convolutions run when their stream does (queue.h).

#include "dnn.h"
#include <atomic>


API size_t cudnnGetVersion() { return 90100; }
// cuDNN 9's CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED: the handle's device memory.
API Status cudnnCreate(Handle** h) { return create_handle(h, "cudnnCreate", 4001); }
API Status cudnnDestroy(Handle* h) { return destroy_handle(h); }
API Status cudnnSetStream(Handle* h, void* stream) { return set_handle_stream(h, stream); }
API const char* cudnnGetErrorString(Status) { return "emulated cuDNN error"; }

API Status cudnnCreateTensorDescriptor(Tensor** t) {
    *t = new Tensor;
    return SUCCESS;
}
API Status cudnnDestroyTensorDescriptor(Tensor* t) {
    delete t;
    return SUCCESS;
}
API Status cudnnCreateFilterDescriptor(Tensor** t) { return cudnnCreateTensorDescriptor(t); }
API Status cudnnDestroyFilterDescriptor(Tensor* t) { return cudnnDestroyTensorDescriptor(t); }
static bool dtype_ok(int t) { return t == FLOAT || t == HALF || t == BFLOAT16; }
API Status cudnnSetTensor4dDescriptor(Tensor* t, int format, int type, int n, int c, int h, int w) {
    if ((format != NCHW && format != NHWC) || !dtype_ok(type) || n <= 0 || c <= 0 || h <= 0 || w <= 0)
        return BAD_PARAM;
    // As the real one: a tensor of more than 2^31 - 1 elements is not supported (its strides
    // and offsets are 32-bit).
    if ((int64_t)n * c * h * w > index_limit()) {
        fprintf(stderr, "emulated cuDNN: a tensor of %lld elements passes the 32-bit limit\n",
                (long long)n * c * h * w);
        return NOT_SUPPORTED;
    }
    *t = Tensor{format, type, n, c, h, w};
    return SUCCESS;
}
API Status cudnnSetFilter4dDescriptor(Tensor* t, int type, int format, int k, int c, int h, int w) {
    return cudnnSetTensor4dDescriptor(t, format, type, k, c, h, w);
}
API Status cudnnCreateConvolutionDescriptor(Conv** c) {
    *c = new Conv;
    return SUCCESS;
}
API Status cudnnDestroyConvolutionDescriptor(Conv* c) {
    delete c;
    return SUCCESS;
}
API Status cudnnSetConvolution2dDescriptor(Conv* c, int ph, int pw, int u, int v, int dh, int dw, int mode,
                                           int compute) {
    if (ph < 0 || pw < 0 || u <= 0 || v <= 0 || dh <= 0 || dw <= 0 || mode != 1 || compute != FLOAT)
        return BAD_PARAM;
    c->pad_h = ph, c->pad_w = pw, c->u = u, c->v = v, c->dil_h = dh, c->dil_w = dw;
    return SUCCESS;
}
API Status cudnnSetConvolutionMathType(Conv* c, int math) {
    c->math = math;
    return SUCCESS;
}
API Status cudnnSetConvolutionGroupCount(Conv* c, int g) {
    if (g <= 0) return BAD_PARAM;
    c->groups = g;
    return SUCCESS;
}

// The descriptors agree: one format and data type, the filter's channels times the groups
// are the input's, the output has the size the convolution gives.
static bool agree(const Tensor& x, const Tensor& w, const Conv& c, const Tensor& y) {
    bool ok = x.format == w.format && w.format == y.format && x.type == w.type && w.type == y.type &&
              w.c * c.groups == x.c && w.n % c.groups == 0 && y.n == x.n && y.c == w.n;
    int ho = (x.h + 2 * c.pad_h - c.dil_h * (w.h - 1) - 1) / c.u + 1;
    int wo = (x.w + 2 * c.pad_w - c.dil_w * (w.w - 1) - 1) / c.v + 1;
    ok = ok && y.h == ho && y.w == wo;
    if (!ok) fprintf(stderr, "emulated cuDNN: the descriptors do not agree\n");
    return ok;
}

struct Perf {
    int algo;
    Status status;
    float time;
    size_t memory;
    int determinism;
    int math;
    int reserved[3];
};
// Whether algorithm `algo` of `pass` gives the same bits every run (see the top of the file).
static bool deterministic(Pass pass, int algo) { return pass == FORWARD || algo == 1; }
// The two algorithms, fastest (algorithm 0) first: its workspace, determinism and math type.
static Status candidates(Pass pass, const Tensor& x, const Tensor& w, const Conv& c, const Tensor& y,
                         int requested, int* count, Perf* out) {
    if (!agree(x, w, c, y)) return BAD_PARAM;
    *count = requested < 2 ? requested : 2;
    for (int i = 0; i < *count; i++)
        out[i] = Perf{i, SUCCESS, 0.1f * (i + 1), i == 0 ? 0u : 1u << 20, deterministic(pass, i), c.math, {0, 0, 0}};
    return SUCCESS;
}
#define QUERIES(NAME, PASS, A, B, C, D)                                                            \
    API Status NAME(void*, const Tensor* A, const Tensor* B, const Conv* C, const Tensor* D, int n, \
                    int* count, Perf* out) {                                                        \
        return candidates(PASS, *x, *w, *c, *y, n, count, out);                                     \
    }
QUERIES(cudnnGetConvolutionForwardAlgorithm_v7, FORWARD, x, w, c, y)
QUERIES(cudnnFindConvolutionForwardAlgorithm, FORWARD, x, w, c, y)
QUERIES(cudnnGetConvolutionBackwardDataAlgorithm_v7, DATA, w, y, c, x)
QUERIES(cudnnFindConvolutionBackwardDataAlgorithm, DATA, w, y, c, x)
QUERIES(cudnnGetConvolutionBackwardFilterAlgorithm_v7, FILTER, x, y, c, w)
QUERIES(cudnnFindConvolutionBackwardFilterAlgorithm, FILTER, x, y, c, w)

// The summation order of a non-deterministic run: a hash (splitmix64) of how many such runs
// came before it in this process, so that no two runs are likely to share one.
static uint64_t next_order() {
    static std::atomic<uint64_t> runs{0};
    uint64_t z = runs.fetch_add(1) + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
// The i-th of m loop indices in the order `v`: rotated by v % m, reversed when bit 40 is set;
// v = 0 is the plain order.
static int nth(int i, int m, uint64_t v) {
    int j = (int)((i + v % (uint64_t)m) % (uint64_t)m);
    return (v >> 40) & 1 ? m - 1 - j : j;
}

// A tensor's values as f32 in NCHW (KCRS) order, whatever its format.
static std::vector<float> unpack(const Tensor& t, const void* p) {
    std::vector<float> v(t.size());
    for (int a = 0; a < t.n; a++)
        for (int b = 0; b < t.c; b++)
            for (int y = 0; y < t.h; y++)
                for (int x = 0; x < t.w; x++) v[(((int64_t)a * t.c + b) * t.h + y) * t.w + x] = load(p, t.type, t.at(a, b, y, x));
    return v;
}
void conv_compute(Pass pass, float alpha, float beta, const Tensor& x, const void* xp, const Tensor& w,
                  const void* wp, const Conv& c, const Tensor& y, const void* yp, bool vary) {
    // The two inputs as f32 NCHW; the result accumulated in f32 NCHW. f32 inputs are rounded
    // to TF32 unless the math type is FMA (exact f32), as tensor cores read them.
    std::vector<float> X = pass == DATA ? std::vector<float>(x.size(), 0.0f) : unpack(x, xp);
    std::vector<float> W = pass == FILTER ? std::vector<float>(w.size(), 0.0f) : unpack(w, wp);
    std::vector<float> Y = pass == FORWARD ? std::vector<float>(y.size(), 0.0f) : unpack(y, yp);
    if (x.type == FLOAT && c.math != FMA_MATH) {
        for (std::vector<float>* in : {&X, &W, &Y})
            if (!(in == &X && pass == DATA) && !(in == &W && pass == FILTER) && !(in == &Y && pass == FORWARD))
                for (float& v : *in) v = tf32(v);
    }
    int kg = w.n / c.groups;
    // The batch and output-channel loops in this run's order: the weight's gradient adds the
    // images' parts, the input's gradient the output channels', in that order.
    uint64_t order = vary ? next_order() : 0;
    for (int in = 0; in < y.n; in++)
        for (int ik = 0; ik < y.c; ik++)
            for (int ci = 0, n = nth(in, y.n, order), k = nth(ik, y.c, order >> 8); ci < w.c; ci++) {
                int xc = (k / kg) * w.c + ci;
                for (int r = 0; r < w.h; r++)
                    for (int s = 0; s < w.w; s++) {
                        int64_t wi = (((int64_t)k * w.c + ci) * w.h + r) * w.w + s;
                        float wv = W[wi], dw = 0.0f;
                        // The outputs whose input column iw = ow * v + off is inside the row.
                        int off = s * c.dil_w - c.pad_w;
                        int lo = off >= 0 ? 0 : (-off + c.v - 1) / c.v;
                        int hi = std::min(y.w, (x.w - off + c.v - 1) / c.v);
                        for (int oh = 0; oh < y.h; oh++) {
                            int ih = oh * c.u - c.pad_h + r * c.dil_h;
                            if (ih < 0 || ih >= x.h) continue;
                            float* __restrict__ xr = X.data() + (((int64_t)n * x.c + xc) * x.h + ih) * x.w;
                            float* __restrict__ yr = Y.data() + (((int64_t)n * y.c + k) * y.h + oh) * y.w;
                            switch (pass) {
                            case FORWARD:
                                for (int ow = lo; ow < hi; ow++) yr[ow] += xr[ow * c.v + off] * wv;
                                break;
                            case DATA:
                                for (int ow = lo; ow < hi; ow++) xr[ow * c.v + off] += yr[ow] * wv;
                                break;
                            case FILTER:
                                for (int ow = lo; ow < hi; ow++) dw += yr[ow] * xr[ow * c.v + off];
                                break;
                            }
                        }
                        if (pass == FILTER) W[wi] += dw;
                    }
            }
    const Tensor& o = pass == FORWARD ? y : pass == DATA ? x : w;
    const std::vector<float>& R = pass == FORWARD ? Y : pass == DATA ? X : W;
    void* op = (void*)(pass == FORWARD ? yp : pass == DATA ? xp : wp);
    for (int a = 0; a < o.n; a++)
        for (int b = 0; b < o.c; b++)
            for (int yy = 0; yy < o.h; yy++)
                for (int xx = 0; xx < o.w; xx++) {
                    int64_t i = o.at(a, b, yy, xx);
                    float v = alpha * R[(((int64_t)a * o.c + b) * o.h + yy) * o.w + xx];
                    if (beta != 0.0f) v += beta * load(op, o.type, i);
                    store(op, o.type, i, v);
                }
}
// Checks the call now; queues the convolution, with copies of the descriptors and scalars.
static Status run(Handle* h, Pass pass, const float* alpha, const float* beta, const Tensor& x,
                  const void* xp, const Tensor& w, const void* wp, const Conv& c, const Tensor& y,
                  const void* yp, int algo, size_t ws) {
    if (!agree(x, w, c, y) || algo < 0 || algo > 1) return BAD_PARAM;
    if (algo == 1 && ws < (1u << 20)) return BAD_PARAM;
    for (const void* p : {xp, wp, yp})
        if ((uintptr_t)p % 16 != 0) {
            fprintf(stderr, "emulated cuDNN: a convolution's data pointer %p is not 16-byte aligned\n", p);
            return BAD_PARAM;
        }
    float al = *alpha, be = *beta;
    bool vary = !deterministic(pass, algo);
    later(h->stream, [=] { conv_compute(pass, al, be, x, xp, w, wp, c, y, yp, vary); });
    return SUCCESS;
}
API Status cudnnConvolutionForward(Handle* h, const float* alpha, const Tensor* xd, const void* x, const Tensor* wd,
                                   const void* w, const Conv* c, int algo, void*, size_t ws, const float* beta,
                                   const Tensor* yd, void* y) {
    return run(h, FORWARD, alpha, beta, *xd, x, *wd, w, *c, *yd, y, algo, ws);
}
API Status cudnnConvolutionBackwardData(Handle* h, const float* alpha, const Tensor* wd, const void* w,
                                        const Tensor* yd, const void* dy, const Conv* c, int algo, void*,
                                        size_t ws, const float* beta, const Tensor* xd, void* dx) {
    return run(h, DATA, alpha, beta, *xd, dx, *wd, w, *c, *yd, dy, algo, ws);
}
API Status cudnnConvolutionBackwardFilter(Handle* h, const float* alpha, const Tensor* xd, const void* x,
                                          const Tensor* yd, const void* dy, const Conv* c, int algo, void*,
                                          size_t ws, const float* beta, const Tensor* wd, void* dw) {
    return run(h, FILTER, alpha, beta, *xd, x, *wd, dw, *c, *yd, dy, algo, ws);
}
