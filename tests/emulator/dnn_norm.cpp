// The emulated cuDNN's batch normalisation (training, spatial): cudnnBatchNormalization-
// ForwardTrainingEx and BackwardEx with their size queries, the derived per-channel
// descriptor and ReLU activation descriptors, computed naively on the host (f64 moments, f32
// outputs). It checks what the backend passes (descriptors that agree, a workspace and a
// reserve space of the sizes it asked for, both running statistics or neither, the output
// for a fused activation's backward) and models one restriction the backend must survive: the
// fused operations (BN + ReLU, BN + add + ReLU) are offered only for NHWC f16/bf16 with a
// multiple of 4 channels, NOT_SUPPORTED otherwise, so the backend's fallback runs. That
// restriction is this emulator's assumption, not cuDNN's published support matrix. The
// fused ReLU's mask lives in the reserve space, one bit per element, as the backward reads
// it. The work runs when its stream does (queue.h).

#include "dnn.h"
#include <cmath>

enum { SPATIAL = 1, SPATIAL_PERSISTENT = 2 };
enum { OPS_BN = 0, OPS_BN_ACTIVATION = 1, OPS_BN_ADD_ACTIVATION = 2 };
enum { ACTIVATION_RELU = 1 };

struct Activation {
    int mode = -1, nan = 0;
    double coef = 0.0;
};

API Status cudnnCreateActivationDescriptor(Activation** a) {
    *a = new Activation;
    return SUCCESS;
}
API Status cudnnDestroyActivationDescriptor(Activation* a) {
    delete a;
    return SUCCESS;
}
API Status cudnnSetActivationDescriptor(Activation* a, int mode, int nan, double coef) {
    *a = Activation{mode, nan, coef};
    return SUCCESS;
}

// The per-channel descriptor of x's statistics and affine parameters: 1 x C x 1 x 1 in f32.
API Status cudnnDeriveBNTensorDescriptor(Tensor* d, const Tensor* x, int mode) {
    if (mode != SPATIAL && mode != SPATIAL_PERSISTENT) return BAD_PARAM;
    *d = Tensor{NCHW, FLOAT, 1, x->c, 1, 1};
    return SUCCESS;
}

// The operation can run on these descriptors: x and the others agree, the per-channel one is
// x's derived one, a fused activation is a ReLU on a layout this emulator offers it for.
static Status supported(int mode, int ops, const Tensor& x, const Tensor* others[], int count,
                        const Tensor* bn, const Activation* act) {
    if (mode != SPATIAL && mode != SPATIAL_PERSISTENT) return BAD_PARAM;
    if (ops < OPS_BN || ops > OPS_BN_ADD_ACTIVATION) return BAD_PARAM;
    for (int i = 0; i < count; i++) {
        const Tensor* t = others[i];
        if (!t) continue;
        if (t->format != x.format || t->type != x.type || t->n != x.n || t->c != x.c || t->h != x.h ||
            t->w != x.w) {
            fprintf(stderr, "emulated cuDNN: batch norm descriptors do not agree\n");
            return BAD_PARAM;
        }
    }
    if (bn && (bn->type != FLOAT || bn->n != 1 || bn->c != x.c || bn->h != 1 || bn->w != 1)) return BAD_PARAM;
    if (ops != OPS_BN) {
        if (!act || act->mode != ACTIVATION_RELU) return BAD_PARAM;
        if (x.format != NHWC || x.type == FLOAT || x.c % 4 != 0 || mode != SPATIAL_PERSISTENT) return NOT_SUPPORTED;
    }
    return SUCCESS;
}

static const size_t FORWARD_WORKSPACE = 4096, BACKWARD_WORKSPACE = 8192;
static size_t reserve_bytes(int ops, const Tensor& x) {
    return ops == OPS_BN ? 0 : (size_t)((x.size() + 127) / 128 * 16);
}

API Status cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(void*, int mode, int ops, const Tensor* x,
                                                                    const Tensor* z, const Tensor* y,
                                                                    const Tensor* bn, const Activation* act,
                                                                    size_t* size) {
    const Tensor* others[] = {ops == OPS_BN_ADD_ACTIVATION ? z : nullptr, y};
    Status s = supported(mode, ops, *x, others, 2, bn, act);
    if (s == SUCCESS) *size = FORWARD_WORKSPACE;
    return s;
}
API Status cudnnGetBatchNormalizationTrainingExReserveSpaceSize(void*, int mode, int ops, const Activation* act,
                                                                const Tensor* x, size_t* size) {
    Status s = supported(mode, ops, *x, nullptr, 0, nullptr, act);
    if (s == SUCCESS) *size = reserve_bytes(ops, *x);
    return s;
}
API Status cudnnGetBatchNormalizationBackwardExWorkspaceSize(void*, int mode, int ops, const Tensor* x,
                                                             const Tensor* y, const Tensor* dy, const Tensor* dz,
                                                             const Tensor* dx, const Tensor* bn,
                                                             const Activation* act, size_t* size) {
    const Tensor* others[] = {ops != OPS_BN ? y : nullptr, dy, ops == OPS_BN_ADD_ACTIVATION ? dz : nullptr, dx};
    Status s = supported(mode, ops, *x, others, 4, bn, act);
    if (s == SUCCESS) *size = BACKWARD_WORKSPACE;
    return s;
}

// Element (row, channel) of an NCHW or NHWC tensor, rows being (n, h, w) in order.
static int64_t index(const Tensor& t, int64_t row, int c) {
    int64_t hw = (int64_t)t.h * t.w, n = row / hw, p = row % hw;
    return t.format == NHWC ? row * t.c + c : (n * t.c + c) * hw + p;
}

// Per channel: the mean and 1 / sqrt(var + eps) (biased variance), by two passes in f64.
static void moments(const Tensor& x, const void* xp, double eps, std::vector<double>& mean,
                    std::vector<double>& invstd, std::vector<double>& var) {
    int64_t rows = (int64_t)x.n * x.h * x.w;
    for (int c = 0; c < x.c; c++) {
        double s = 0.0, q = 0.0;
        for (int64_t r = 0; r < rows; r++) s += load(xp, x.type, index(x, r, c));
        double m = s / rows;
        for (int64_t r = 0; r < rows; r++) {
            double d = load(xp, x.type, index(x, r, c)) - m;
            q += d * d;
        }
        mean[c] = m;
        var[c] = q / rows;
        invstd[c] = 1.0 / std::sqrt(var[c] + eps);
    }
}

struct ForwardCall {
    int ops;
    float alpha, beta;
    Tensor x;
    const void* xp;
    const void* zp;
    void* yp;
    const float *scale, *bias;
    double factor;
    float *rmean, *rvar;
    double eps;
    float *smean, *sinv;
    uint8_t* reserve;
};

static void forward(const ForwardCall& f) {
    const Tensor& x = f.x;
    std::vector<double> mean(x.c), invstd(x.c), var(x.c);
    moments(x, f.xp, f.eps, mean, invstd, var);
    int64_t rows = (int64_t)x.n * x.h * x.w;
    for (int c = 0; c < x.c; c++) {
        double a = invstd[c] * f.scale[c];
        for (int64_t r = 0; r < rows; r++) {
            int64_t i = index(x, r, c);
            float v = (float)(a * (load(f.xp, x.type, i) - mean[c]) + f.bias[c]);
            if (f.ops == OPS_BN_ADD_ACTIVATION) v += load(f.zp, x.type, i);
            if (f.ops != OPS_BN) {
                bool on = v > 0.0f;
                if (!on) v = v != v ? v : 0.0f;
                // The mask bit of element i (in memory order).
                if (on) f.reserve[i / 8] |= (uint8_t)(1u << (i % 8));
                else f.reserve[i / 8] &= (uint8_t)~(1u << (i % 8));
            }
            float out = f.alpha * v;
            if (f.beta != 0.0f) out += f.beta * load(f.yp, x.type, i);
            store(f.yp, x.type, i, out);
        }
        if (f.rmean) {
            double unbiased = var[c] * rows / (rows - 1);
            f.rmean[c] = (float)((1.0 - f.factor) * f.rmean[c] + f.factor * mean[c]);
            f.rvar[c] = (float)((1.0 - f.factor) * f.rvar[c] + f.factor * unbiased);
        }
        if (f.smean) {
            f.smean[c] = (float)mean[c];
            f.sinv[c] = (float)invstd[c];
        }
    }
}

API Status cudnnBatchNormalizationForwardTrainingEx(
    Handle* h, int mode, int ops, const float* alpha, const float* beta, const Tensor* xd, const void* x,
    const Tensor* zd, const void* z, const Tensor* yd, void* y, const Tensor* bnd, const void* scale,
    const void* bias, double factor, void* rmean, void* rvar, double eps, void* smean, void* sinv,
    const Activation* act, void* ws, size_t ws_size, void* reserve, size_t reserve_size) {
    const Tensor* others[] = {ops == OPS_BN_ADD_ACTIVATION ? zd : nullptr, yd};
    Status s = supported(mode, ops, *xd, others, 2, bnd, act);
    if (s != SUCCESS) return s;
    bool bad = !x || !y || !scale || !bias || (ops == OPS_BN_ADD_ACTIVATION && !z) || (!rmean != !rvar) ||
               (!smean != !sinv) || eps <= 0.0 || factor < 0.0 || factor > 1.0 || !ws ||
               ws_size < FORWARD_WORKSPACE || reserve_size < reserve_bytes(ops, *xd) ||
               (ops != OPS_BN && !reserve) || xd->n * xd->h * xd->w < 2;
    if (bad) return BAD_PARAM;
    ForwardCall f{.ops = ops, .alpha = *alpha, .beta = *beta, .x = *xd, .xp = x, .zp = z, .yp = y,
                  .scale = (const float*)scale, .bias = (const float*)bias, .factor = factor,
                  .rmean = (float*)rmean, .rvar = (float*)rvar, .eps = eps, .smean = (float*)smean,
                  .sinv = (float*)sinv, .reserve = (uint8_t*)reserve};
    later(h->stream, [=] { forward(f); });
    return SUCCESS;
}

struct BackwardCall {
    int ops;
    float ad, bd, ap, bp;
    Tensor x;
    const void *xp, *dyp;
    void *dzp, *dxp;
    const float* scale;
    float *dscale, *dbias;
    const float *smean, *sinv;
    const uint8_t* reserve;
};

static void backward(const BackwardCall& b) {
    const Tensor& x = b.x;
    int64_t rows = (int64_t)x.n * x.h * x.w;
    for (int c = 0; c < x.c; c++) {
        double mean = b.smean[c], invstd = b.sinv[c];
        auto dy = [&](int64_t i) {
            bool on = b.ops == OPS_BN || ((b.reserve[i / 8] >> (i % 8)) & 1u);
            return on ? (double)load(b.dyp, x.type, i) : 0.0;
        };
        double sdy = 0.0, sdx = 0.0;
        for (int64_t r = 0; r < rows; r++) {
            int64_t i = index(x, r, c);
            double g = dy(i), xhat = (load(b.xp, x.type, i) - mean) * invstd;
            sdy += g;
            sdx += g * xhat;
            if (b.ops == OPS_BN_ADD_ACTIVATION) store(b.dzp, x.type, i, (float)g);
        }
        double k = b.scale[c] * invstd;
        for (int64_t r = 0; r < rows; r++) {
            int64_t i = index(x, r, c);
            double xhat = (load(b.xp, x.type, i) - mean) * invstd;
            float v = b.ad * (float)(k * (dy(i) - sdy / rows - xhat * sdx / rows));
            if (b.bd != 0.0f) v += b.bd * load(b.dxp, x.type, i);
            store(b.dxp, x.type, i, v);
        }
        b.dscale[c] = b.ap * (float)sdx + (b.bp != 0.0f ? b.bp * b.dscale[c] : 0.0f);
        b.dbias[c] = b.ap * (float)sdy + (b.bp != 0.0f ? b.bp * b.dbias[c] : 0.0f);
    }
}

API Status cudnnBatchNormalizationBackwardEx(
    Handle* h, int mode, int ops, const float* ad, const float* bd, const float* ap, const float* bp,
    const Tensor* xd, const void* x, const Tensor* yd, const void* y, const Tensor* dyd, const void* dy,
    const Tensor* dzd, void* dz, const Tensor* dxd, void* dx, const Tensor* bnd, const void* scale,
    const void* bias, void* dscale, void* dbias, double eps, const void* smean, const void* sinv,
    const Activation* act, void* ws, size_t ws_size, void* reserve, size_t reserve_size) {
    const Tensor* others[] = {ops != OPS_BN ? yd : nullptr, dyd, ops == OPS_BN_ADD_ACTIVATION ? dzd : nullptr,
                              dxd};
    Status s = supported(mode, ops, *xd, others, 4, bnd, act);
    if (s != SUCCESS) return s;
    // The emulator needs the saved statistics (cuDNN may recompute them without).
    bool bad = !x || !dy || !dx || !scale || !dscale || !dbias || !smean || !sinv || eps <= 0.0 ||
               (ops != OPS_BN && (!y || !bias || !reserve)) || (ops == OPS_BN_ADD_ACTIVATION && !dz) || !ws ||
               ws_size < BACKWARD_WORKSPACE || reserve_size < reserve_bytes(ops, *xd);
    if (bad) return BAD_PARAM;
    BackwardCall b{.ops = ops, .ad = *ad, .bd = *bd, .ap = *ap, .bp = *bp, .x = *xd, .xp = x, .dyp = dy,
                   .dzp = dz, .dxp = dx, .scale = (const float*)scale, .dscale = (float*)dscale,
                   .dbias = (float*)dbias, .smean = (const float*)smean, .sinv = (const float*)sinv,
                   .reserve = (const uint8_t*)reserve};
    later(h->stream, [=] { backward(b); });
    return SUCCESS;
}
