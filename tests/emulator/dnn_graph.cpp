// The emulated cuDNN's graph (backend) API, for the convolution graphs the engine builds (its
// attention graphs are dnn_sdpa.cpp's; the descriptors are dnn_graph.h's): a forward
// convolution whose output's per-channel sums and sums of squares come with it
// (ConvolutionFwd -> GenStats, the pattern of cuDNN's ConvBNfprop engine), and a weight
// gradient whose input is x * scale + bias, clamped at 0 or not (Mul -> Add [-> ReLU] ->
// ConvolutionBwdFilter, ConvBNwgrad's). Descriptors keep their attributes as set; finalizing
// checks what each kind needs and that the operands agree, as the real library does. The
// heuristics offer engine configurations for either graph in f16 (f32 sums, f32 virtual
// intermediates), packed NHWC activations and KRSC weights, without dilation, and none for
// anything else, so that the backend's unfused path runs (match_graph; the dilation rule is
// this emulator's assumption, not a published one of cuDNN's): one for the forward with its
// sums, two for the weight gradient, the first with the numerical note NONDETERMINISTIC (its
// sum over the batch in another order each run, as dnn.cpp's non-deterministic algorithms),
// the second without, so that the backend's deterministic mode must read the engines' notes
// (CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE) to skip it. A plan asks for a 64 KiB
// workspace, so the backend's workspace path runs; executing checks that every tensor that is
// not virtual has an address, 16-byte aligned (what the engines ask for), and queues the work
// on the handle's stream: the convolution (dnn.cpp) and the sums of its stored output in f64
// written as f32; or the prologue in f32 (scale and bias read as f16) rounded to f16, as the
// convolution's f16 operand, then the weight's gradient. With MANTISSA_EMU_GRAPH_EXECUTE=
// not-supported every execution is refused (NOT_SUPPORTED), for the backend's fallback.

#include "dnn_graph.h"

namespace dg {
namespace {
// A tensor descriptor: 4 dims and strides, a data type, an id; NHWC when the strides are the
// packed channels-last ones, NCHW when packed row-major, else no format (-1).
Status finalize_tensor(Desc& d) {
    std::vector<int> dt;
    std::vector<int64_t> dims, strides, uid;
    if (!d.get(TENSOR_DTYPE, T_DATA_TYPE, dt, 1) || !d.get(TENSOR_DIMS, T_INT64, dims, 4) ||
        !d.get(TENSOR_STRIDES, T_INT64, strides, 4) || !d.get(TENSOR_UID, T_INT64, uid, 1))
        return BAD_PARAM;
    int64_t n = 1;
    for (int64_t v : dims) {
        if (v <= 0) return BAD_PARAM;
        n *= v;
    }
    // As the legacy descriptors (dnn.cpp): 32-bit element counts.
    if (n > index_limit()) return NOT_SUPPORTED;
    int64_t c = dims[1], h = dims[2], w = dims[3];
    int format = -1;
    if (strides == std::vector<int64_t>{h * w * c, 1, w * c, c}) format = NHWC;
    else if (strides == std::vector<int64_t>{c * h * w, h * w, w, 1}) format = NCHW;
    d.t = Tensor{format, dt[0], (int)dims[0], (int)c, (int)h, (int)w};
    d.uid = uid[0];
    d.dims = dims, d.strides = strides;
    auto flag = [&](int name) {
        auto it = d.attrs.find(name);
        return it != d.attrs.end() && it->second.first == T_BOOLEAN && !it->second.second.empty() &&
               it->second.second[0] != 0;
    };
    d.virt = flag(TENSOR_VIRTUAL), d.by_value = flag(TENSOR_BY_VALUE);
    // A by-value tensor is a scalar in host memory: one element, never virtual.
    if (d.by_value && (d.virt || n != 1)) return BAD_PARAM;
    return SUCCESS;
}

Status finalize_conv(Desc& d) {
    std::vector<int> comp, mode;
    std::vector<int64_t> dims, pre, post, dil, str;
    if (!d.get(CONV_COMP_TYPE, T_DATA_TYPE, comp, 1) || !d.get(CONV_MODE, T_CONVOLUTION_MODE, mode, 1) ||
        !d.get(CONV_SPATIAL_DIMS, T_INT64, dims, 1) || !d.get(CONV_PRE_PADDINGS, T_INT64, pre, 2) ||
        !d.get(CONV_POST_PADDINGS, T_INT64, post, 2) || !d.get(CONV_DILATIONS, T_INT64, dil, 2) ||
        !d.get(CONV_FILTER_STRIDES, T_INT64, str, 2))
        return BAD_PARAM;
    if (comp[0] != FLOAT || mode[0] != CROSS_CORRELATION || dims[0] != 2 || pre != post || pre[0] < 0 ||
        pre[1] < 0 || dil[0] <= 0 || dil[1] <= 0 || str[0] <= 0 || str[1] <= 0)
        return BAD_PARAM;
    d.conv.pad_h = (int)pre[0], d.conv.pad_w = (int)pre[1], d.conv.dil_h = (int)dil[0];
    d.conv.dil_w = (int)dil[1], d.conv.u = (int)str[0], d.conv.v = (int)str[1];
    return SUCCESS;
}

// The output size of convolution k over x with filter w agrees with y (one group).
bool conv_agrees(const Tensor& x, const Tensor& w, const Conv& k, const Tensor& y) {
    int ho = (x.h + 2 * k.pad_h - k.dil_h * (w.h - 1) - 1) / k.u + 1;
    int wo = (x.w + 2 * k.pad_w - k.dil_w * (w.w - 1) - 1) / k.v + 1;
    bool ok = x.c == w.c && y.n == x.n && y.c == w.n && y.h == ho && y.w == wo;
    if (!ok) fprintf(stderr, "emulated cuDNN graph: the convolution's tensors do not agree\n");
    return ok;
}

// A forward convolution: x, w, y and the geometry agree, one data type.
Status finalize_conv_fwd(const Desc& d) {
    const Desc *x = d.desc(FWD_X, TENSOR), *w = d.desc(FWD_W, TENSOR), *y = d.desc(FWD_Y, TENSOR);
    const Desc* c = d.desc(FWD_CONV, CONVOLUTION);
    std::vector<float> alpha, beta;
    if (!x || !w || !y || !c || !d.get(FWD_ALPHA, T_FLOAT, alpha, 1) || !d.get(FWD_BETA, T_FLOAT, beta, 1))
        return BAD_PARAM;
    bool ok = x->t.type == w->t.type && w->t.type == y->t.type && conv_agrees(x->t, w->t, c->conv, y->t);
    return ok ? SUCCESS : BAD_PARAM;
}

// A weight gradient: x (of any type: a virtual intermediate's is f32), dy and dw agree.
Status finalize_wgrad(const Desc& d) {
    const Desc *x = d.desc(WGRAD_X, TENSOR), *dy = d.desc(WGRAD_DY, TENSOR), *dw = d.desc(WGRAD_DW, TENSOR);
    const Desc* c = d.desc(WGRAD_CONV, CONVOLUTION);
    std::vector<float> alpha, beta;
    if (!x || !dy || !dw || !c || !d.get(WGRAD_ALPHA, T_FLOAT, alpha, 1) || !d.get(WGRAD_BETA, T_FLOAT, beta, 1))
        return BAD_PARAM;
    return dy->t.type == dw->t.type && conv_agrees(x->t, dw->t, c->conv, dy->t) ? SUCCESS : BAD_PARAM;
}

// Per-channel sums of x: [1, c, 1, 1] f32 each.
Status finalize_stats(const Desc& d) {
    const Desc *x = d.desc(STATS_X, TENSOR), *s = d.desc(STATS_SUM, TENSOR), *q = d.desc(STATS_SQSUM, TENSOR);
    std::vector<int> mode, prec;
    if (!x || !s || !q || !d.get(STATS_MODE, T_GENSTATS_MODE, mode, 1) || !d.get(STATS_PREC, T_DATA_TYPE, prec, 1))
        return BAD_PARAM;
    for (const Desc* v : {s, q})
        if (v->t.n != 1 || v->t.c != x->t.c || v->t.h != 1 || v->t.w != 1) return BAD_PARAM;
    return mode[0] == GENSTATS_SUM_SQSUM && prec[0] == FLOAT ? SUCCESS : BAD_PARAM;
}

Status finalize_pointwise(Desc& d) {
    std::vector<int> mode, prec;
    if (!d.get(PW_MODE, T_POINTWISE_MODE, mode, 1) || !d.get(PW_PREC, T_DATA_TYPE, prec, 1)) return BAD_PARAM;
    switch (mode[0]) {
    case PW_ADD:
    case PW_MUL:
    case PW_DIV:
    case PW_SUB:
    case PW_EXP:
    case PW_LOG:
    case PW_IDENTITY:
    case PW_RELU_FWD:
    case PW_CMP_GE:
    case PW_BINARY_SELECT: break;
    case PW_GEN_INDEX: {
        std::vector<int64_t> axis;
        if (!d.get(PW_AXIS, T_INT64, axis, 1) || axis[0] < 0 || axis[0] > 3) return BAD_PARAM;
        d.axis = axis[0];
        break;
    }
    default: return NOT_SUPPORTED;
    }
    d.pw_mode = mode[0];
    return SUCCESS;
}

// Whether operand dims `b` broadcast to `y` (each equal, or 1).
bool broadcasts(const std::vector<int64_t>& b, const std::vector<int64_t>& y) {
    if (b.size() != y.size()) return false;
    for (size_t i = 0; i < y.size(); i++)
        if (b[i] != y[i] && b[i] != 1) return false;
    return true;
}

// A pointwise operation: y has x's dims; the modes of two operands take b (three:
// BINARY_SELECT, with its condition t), which broadcasts to y; the others take neither.
Status finalize_op_pointwise(const Desc& d) {
    const Desc *pw = d.desc(OP_PW, POINTWISE), *x = d.desc(OP_PW_X, TENSOR), *y = d.desc(OP_PW_Y, TENSOR);
    const Desc *b = d.desc(OP_PW_B, TENSOR), *t = d.desc(OP_PW_T, TENSOR);
    if (!pw || !x || !y || x->dims != y->dims) return BAD_PARAM;
    switch (pw->pw_mode) {
    case PW_RELU_FWD:
    case PW_EXP:
    case PW_LOG:
    case PW_IDENTITY:
    case PW_GEN_INDEX: return b || t ? BAD_PARAM : SUCCESS;
    case PW_BINARY_SELECT:
        return b && t && broadcasts(b->dims, y->dims) && broadcasts(t->dims, y->dims) ? SUCCESS : BAD_PARAM;
    default: return b && !t && broadcasts(b->dims, y->dims) ? SUCCESS : BAD_PARAM;
    }
}

// The graphs an engine runs (see the top of the file), their operations.
struct Match {
    enum { NONE, FWD_STATS, WGRAD } kind = NONE;
    const Desc *fwd = nullptr, *stats = nullptr, *mul = nullptr, *add = nullptr, *relu = nullptr,
               *wgrad = nullptr;
};

bool half_nhwc(const Desc* t) { return t && !t->virt && t->t.type == HALF && t->t.format == NHWC; }
bool f32_virtual(const Desc* t) { return t && t->virt && t->t.type == FLOAT; }
bool no_dilation(const Desc* op, int attr) {
    const Conv& k = op->desc(attr, CONVOLUTION)->conv;
    return k.dil_h == 1 && k.dil_w == 1;
}

Match match_graph(const Desc& g) {
    std::vector<Desc*> ops;
    Match m;
    if (!g.get(GRAPH_OPS, T_BACKEND_DESCRIPTOR, ops)) return m;
    for (Desc* o : ops) {
        if (o->kind == OP_CONV_FWD) m.fwd = o;
        else if (o->kind == OP_GEN_STATS) m.stats = o;
        else if (o->kind == OP_CONV_BWD_FILTER) m.wgrad = o;
        else if (o->kind == OP_POINTWISE) {
            int mode = o->desc(OP_PW, POINTWISE)->pw_mode;
            (mode == PW_MUL ? m.mul : mode == PW_ADD ? m.add : m.relu) = o;
        }
    }
    if (ops.size() == 2 && m.fwd && m.stats) {
        const Desc *x = m.fwd->desc(FWD_X, TENSOR), *w = m.fwd->desc(FWD_W, TENSOR), *y = m.fwd->desc(FWD_Y, TENSOR);
        const Desc *s = m.stats->desc(STATS_SUM, TENSOR), *q = m.stats->desc(STATS_SQSUM, TENSOR);
        bool ok = m.stats->desc(STATS_X, TENSOR) == y && half_nhwc(x) && half_nhwc(w) && half_nhwc(y) &&
                  s->t.type == FLOAT && q->t.type == FLOAT && !s->virt && !q->virt && no_dilation(m.fwd, FWD_CONV);
        if (ok) m.kind = Match::FWD_STATS;
        return m;
    }
    if (ops.size() == 3u + (m.relu ? 1u : 0u) && m.mul && m.add && m.wgrad) {
        // x * scale -> + bias -> [ReLU] -> the weight gradient's x, the intermediates virtual.
        const Desc *x = m.mul->desc(OP_PW_X, TENSOR), *t1 = m.mul->desc(OP_PW_Y, TENSOR);
        const Desc *t2 = m.add->desc(OP_PW_Y, TENSOR), *in = m.wgrad->desc(WGRAD_X, TENSOR);
        const Desc* last = m.relu ? m.relu->desc(OP_PW_Y, TENSOR) : t2;
        bool ok = half_nhwc(x) && !m.mul->desc(OP_PW_B, TENSOR)->virt && m.mul->desc(OP_PW_B, TENSOR)->t.type == HALF &&
                  !m.add->desc(OP_PW_B, TENSOR)->virt && m.add->desc(OP_PW_B, TENSOR)->t.type == HALF &&
                  f32_virtual(t1) && m.add->desc(OP_PW_X, TENSOR) == t1 && f32_virtual(t2) &&
                  (!m.relu || (m.relu->desc(OP_PW_X, TENSOR) == t2 && f32_virtual(last))) && in == last &&
                  half_nhwc(m.wgrad->desc(WGRAD_DY, TENSOR)) && half_nhwc(m.wgrad->desc(WGRAD_DW, TENSOR)) &&
                  no_dilation(m.wgrad, WGRAD_CONV);
        if (ok) m.kind = Match::WGRAD;
    }
    return m;
}

Status finalize(Desc& d) {
    std::vector<void*> p;
    switch (d.kind) {
    case TENSOR: return finalize_tensor(d);
    case CONVOLUTION: return finalize_conv(d);
    case POINTWISE: return finalize_pointwise(d);
    case OP_CONV_FWD: return finalize_conv_fwd(d);
    case OP_CONV_BWD_FILTER: return finalize_wgrad(d);
    case OP_POINTWISE: return finalize_op_pointwise(d);
    case OP_GEN_STATS: return finalize_stats(d);
    case OPERATIONGRAPH: {
        std::vector<Desc*> ops;
        if (!d.get(GRAPH_HANDLE, T_HANDLE, p, 1) || !d.get(GRAPH_OPS, T_BACKEND_DESCRIPTOR, ops) || ops.empty())
            return BAD_PARAM;
        for (Desc* o : ops)
            if (!o || !o->final) return BAD_PARAM;
        Match m = match_graph(d);
        d.engines = m.kind == Match::WGRAD ? 2 : m.kind == Match::FWD_STATS ? 1 : sdpa_engines(d);
        return SUCCESS;
    }
    case ENGINEHEUR: {
        std::vector<int> mode;
        const Desc* g = d.desc(HEUR_GRAPH, OPERATIONGRAPH);
        if (!g || !d.get(HEUR_MODE, T_HEUR_MODE, mode, 1)) return BAD_PARAM;
        d.graph = g;
        return SUCCESS;
    }
    case EXECUTION_PLAN: {
        const Desc* cfg = d.desc(PLAN_ENGINE_CONFIG, ENGINECFG);
        if (!d.get(PLAN_HANDLE, T_HANDLE, p, 1) || !cfg || !cfg->graph) return BAD_PARAM;
        d.graph = cfg->graph, d.engine = cfg->engine;
        return SUCCESS;
    }
    case VARIANT_PACK: {
        std::vector<int64_t> uids;
        std::vector<void*> ws;
        bool ok = d.get(PACK_UIDS, T_INT64, uids) && d.get(PACK_POINTERS, T_VOID_PTR, p, (int)uids.size()) &&
                  d.get(PACK_WORKSPACE, T_VOID_PTR, ws, 1);
        return ok ? SUCCESS : BAD_PARAM;
    }
    default: return finalize_sdpa_kind(d);
    }
}

// Whether the engine of an engine descriptor or a plan adds in another order each run: the
// weight gradient's first (see the top of the file).
bool nondeterministic(const Desc& d) { return d.engine == 0 && match_graph(*d.graph).kind == Match::WGRAD; }

} // namespace

void* address(const Desc* pack, const Desc* t) {
    std::vector<int64_t> uids;
    std::vector<void*> ptrs;
    pack->get(PACK_UIDS, T_INT64, uids);
    pack->get(PACK_POINTERS, T_VOID_PTR, ptrs);
    for (size_t k = 0; k < uids.size(); k++)
        if (uids[k] == t->uid && ptrs[k] && (uintptr_t)ptrs[k] % 16 == 0) return ptrs[k];
    fprintf(stderr, "emulated cuDNN graph: tensor %lld has no 16-byte aligned address\n", (long long)t->uid);
    return nullptr;
}

namespace {
// The addresses of the five tensors ts in the pack, all found and aligned (else false).
bool addresses(const Desc* pack, const Desc* const (&ts)[5], void* (&at)[5]) {
    for (int i = 0; i < 5; i++)
        if (!(at[i] = address(pack, ts[i]))) return false;
    return true;
}

// Queues the forward convolution and its output's sums.
Status run_fwd_stats(Handle* h, const Match& m, const Desc* pack) {
    const Desc* ts[] = {m.fwd->desc(FWD_X, TENSOR), m.fwd->desc(FWD_W, TENSOR), m.fwd->desc(FWD_Y, TENSOR),
                        m.stats->desc(STATS_SUM, TENSOR), m.stats->desc(STATS_SQSUM, TENSOR)};
    void* at[5] = {};
    if (!addresses(pack, ts, at)) return BAD_PARAM;
    std::vector<float> alpha, beta;
    m.fwd->get(FWD_ALPHA, T_FLOAT, alpha);
    m.fwd->get(FWD_BETA, T_FLOAT, beta);
    Tensor x = ts[0]->t, w = ts[1]->t, y = ts[2]->t;
    Conv c = m.fwd->desc(FWD_CONV, CONVOLUTION)->conv;
    float al = alpha[0], be = beta[0];
    later(h->stream, [=] {
        conv_compute(FORWARD, al, be, x, at[0], w, at[1], c, y, at[2]);
        std::vector<double> s(y.c, 0.0), q(y.c, 0.0);
        for (int a = 0; a < y.n; a++)
            for (int b = 0; b < y.c; b++)
                for (int yy = 0; yy < y.h; yy++)
                    for (int xx = 0; xx < y.w; xx++) {
                        double v = load(at[2], y.type, y.at(a, b, yy, xx));
                        s[b] += v, q[b] += v * v;
                    }
        for (int b = 0; b < y.c; b++) ((float*)at[3])[b] = (float)s[b], ((float*)at[4])[b] = (float)q[b];
    });
    return SUCCESS;
}

// Queues the prologue (x * scale + bias, clamped with a ReLU, in f32, rounded to f16 as the
// convolution's operand) and the weight's gradient.
Status run_wgrad(Handle* h, const Match& m, const Desc* pack, bool vary) {
    const Desc* ts[] = {m.mul->desc(OP_PW_X, TENSOR), m.mul->desc(OP_PW_B, TENSOR), m.add->desc(OP_PW_B, TENSOR),
                        m.wgrad->desc(WGRAD_DY, TENSOR), m.wgrad->desc(WGRAD_DW, TENSOR)};
    void* at[5] = {};
    if (!addresses(pack, ts, at)) return BAD_PARAM;
    std::vector<float> alpha, beta;
    m.wgrad->get(WGRAD_ALPHA, T_FLOAT, alpha);
    m.wgrad->get(WGRAD_BETA, T_FLOAT, beta);
    Tensor x = ts[0]->t, dy = ts[3]->t, dw = ts[4]->t;
    Conv c = m.wgrad->desc(WGRAD_CONV, CONVOLUTION)->conv;
    float al = alpha[0], be = beta[0];
    bool relu = m.relu != nullptr;
    later(h->stream, [=] {
        std::vector<uint16_t> in(x.size());
        for (int a = 0; a < x.n; a++)
            for (int b = 0; b < x.c; b++) {
                float sc = load(at[1], HALF, b), bi = load(at[2], HALF, b);
                for (int yy = 0; yy < x.h; yy++)
                    for (int xx = 0; xx < x.w; xx++) {
                        int64_t i = x.at(a, b, yy, xx);
                        float v = load(at[0], HALF, i) * sc + bi;
                        store(in.data(), HALF, i, relu && v < 0.0f ? 0.0f : v);
                    }
            }
        conv_compute(FILTER, al, be, x, in.data(), dw, at[4], c, dy, at[3], vary);
    });
    return SUCCESS;
}
} // namespace
} // namespace dg
using namespace dg;

API Status cudnnBackendCreateDescriptor(int kind, Desc** d) {
    switch (kind) {
    case POINTWISE:
    case CONVOLUTION:
    case ENGINE:
    case ENGINECFG:
    case ENGINEHEUR:
    case EXECUTION_PLAN:
    case OP_CONV_FWD:
    case OP_CONV_BWD_FILTER:
    case OP_POINTWISE:
    case OP_GEN_STATS:
    case OPERATIONGRAPH:
    case VARIANT_PACK:
    case TENSOR:
    case MATMUL:
    case OP_MATMUL:
    case REDUCTION:
    case OP_REDUCTION:
    case OP_RESHAPE: *d = new Desc{kind}; return SUCCESS;
    default: return NOT_SUPPORTED;
    }
}
API Status cudnnBackendDestroyDescriptor(Desc* d) {
    delete d;
    return SUCCESS;
}
API Status cudnnBackendSetAttribute(Desc* d, int name, int type, int64_t count, const void* values) {
    if (!d || d->final || count < 0 || (count > 0 && !values)) return BAD_PARAM;
    std::vector<char> b(count * type_size(type));
    if (!b.empty()) memcpy(b.data(), values, b.size());
    d->attrs[name] = {type, std::move(b)};
    return SUCCESS;
}
API Status cudnnBackendFinalize(Desc* d) {
    if (!d || d->final) return BAD_PARAM;
    Status s = finalize(*d);
    d->final = s == SUCCESS;
    return s;
}
API Status cudnnBackendGetAttribute(const Desc* d, int name, int type, int64_t requested, int64_t* count,
                                    void* out) {
    if (!d || !d->final || !count) return BAD_PARAM;
    if (d->kind == ENGINEHEUR && name == HEUR_RESULTS && type == T_BACKEND_DESCRIPTOR) {
        int64_t n = d->graph->engines;
        if (requested == 0) return *count = n, SUCCESS;
        *count = std::min(n, requested);
        for (int64_t i = 0; i < *count; i++) {
            Desc* cfg = ((Desc**)out)[i];
            if (!cfg || cfg->kind != ENGINECFG) return BAD_PARAM;
            cfg->graph = d->graph, cfg->engine = (int)i, cfg->final = true;
        }
        return SUCCESS;
    }
    // A configuration's engine, copied into the caller's engine descriptor.
    if (d->kind == ENGINECFG && name == ENGINECFG_ENGINE && type == T_BACKEND_DESCRIPTOR && requested >= 1) {
        Desc* e = ((Desc**)out)[0];
        if (!e || e->kind != ENGINE) return BAD_PARAM;
        e->graph = d->graph, e->engine = d->engine, e->final = true;
        return *count = 1, SUCCESS;
    }
    // An engine's numerical notes: tensor cores, and NONDETERMINISTIC for the weight
    // gradient's first engine.
    if (d->kind == ENGINE && name == ENGINE_NUMERICAL_NOTE && type == T_NUMERICAL_NOTE) {
        std::vector<int> notes{NOTE_TENSOR_CORE};
        if (nondeterministic(*d)) notes.push_back(NOTE_NONDETERMINISTIC);
        *count = std::min<int64_t>((int64_t)notes.size(), requested);
        if (*count > 0) memcpy(out, notes.data(), *count * sizeof(int));
        return SUCCESS;
    }
    if (d->kind == EXECUTION_PLAN && name == PLAN_WORKSPACE_SIZE && type == T_INT64 && requested >= 1) {
        *count = 1;
        *(int64_t*)out = WORKSPACE;
        return SUCCESS;
    }
    return NOT_SUPPORTED;
}
API Status cudnnBackendExecute(Handle* h, const Desc* plan, const Desc* pack) {
    if (!h || !plan || !pack || plan->kind != EXECUTION_PLAN || !plan->final || pack->kind != VARIANT_PACK ||
        !pack->final)
        return BAD_PARAM;
    std::vector<void*> ws;
    pack->get(PACK_WORKSPACE, T_VOID_PTR, ws);
    if (ws.empty() || !ws[0]) return BAD_PARAM;
    // MANTISSA_EMU_GRAPH_EXECUTE=not-supported: every execution refused, as a cuDNN whose
    // engine finalized a plan may still refuse operands at run time.
    if (const char* e = getenv("MANTISSA_EMU_GRAPH_EXECUTE"); e && !strcmp(e, "not-supported")) return NOT_SUPPORTED;
    Match m = match_graph(*plan->graph);
    switch (m.kind) {
    case Match::FWD_STATS: return run_fwd_stats(h, m, pack);
    case Match::WGRAD: return run_wgrad(h, m, pack, nondeterministic(*plan));
    default: return plan->graph->engines > 0 ? run_sdpa(h, *plan->graph, pack) : BAD_PARAM;
    }
}
