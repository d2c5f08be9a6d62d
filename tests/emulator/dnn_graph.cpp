// The emulated cuDNN's graph (backend) API, for the graph the engine builds: a forward
// convolution whose output's per-channel sums and sums of squares come with it
// (ConvolutionFwd -> GenStats, the pattern of cuDNN's ConvBNfprop engine). Descriptors keep
// their attributes as set; finalizing checks what each kind needs and that the operands
// agree, as the real library does. The heuristics offer one engine configuration for that
// graph in f16, packed NHWC x and y, KRSC w, f32 [1, k, 1, 1] sums, without dilation, and
// none for anything else, so that the backend's unfused path runs (engine_for).
// A plan asks for a 64 KiB workspace, so the backend's workspace path runs; executing checks
// that every tensor has an address, 16-byte aligned (what the engine asks for), and queues
// the work on the handle's stream: the convolution (dnn.cpp), then the sums of the stored
// output in f64, written as f32.

#include "dnn.h"
#include <map>

namespace {
enum Kind {
    CONVOLUTION = 1,
    ENGINECFG = 3,
    ENGINEHEUR = 4,
    EXECUTION_PLAN = 5,
    OP_CONV_FWD = 10,
    OP_GEN_STATS = 14,
    OPERATIONGRAPH = 15,
    VARIANT_PACK = 16,
    TENSOR = 17,
};
enum Type {
    T_HANDLE = 0,
    T_DATA_TYPE = 1,
    T_BOOLEAN = 2,
    T_INT64 = 3,
    T_FLOAT = 4,
    T_DOUBLE = 5,
    T_VOID_PTR = 6,
    T_CONVOLUTION_MODE = 7,
    T_HEUR_MODE = 8,
    T_BACKEND_DESCRIPTOR = 15,
    T_GENSTATS_MODE = 16,
};
enum Attr {
    CONV_COMP_TYPE = 100,
    CONV_MODE = 101,
    CONV_DILATIONS = 102,
    CONV_FILTER_STRIDES = 103,
    CONV_POST_PADDINGS = 104,
    CONV_PRE_PADDINGS = 105,
    CONV_SPATIAL_DIMS = 106,
    HEUR_MODE = 200,
    HEUR_GRAPH = 201,
    HEUR_RESULTS = 202,
    PLAN_HANDLE = 400,
    PLAN_ENGINE_CONFIG = 401,
    PLAN_WORKSPACE_SIZE = 402,
    FWD_ALPHA = 700,
    FWD_BETA = 701,
    FWD_CONV = 702,
    FWD_W = 703,
    FWD_X = 704,
    FWD_Y = 705,
    STATS_MODE = 770,
    STATS_PREC = 771,
    STATS_X = 772,
    STATS_SUM = 773,
    STATS_SQSUM = 774,
    GRAPH_HANDLE = 800,
    GRAPH_OPS = 801,
    TENSOR_ALIGNMENT = 900,
    TENSOR_DTYPE = 901,
    TENSOR_DIMS = 902,
    TENSOR_STRIDES = 903,
    TENSOR_UID = 906,
    TENSOR_VIRTUAL = 907,
    PACK_UIDS = 1000,
    PACK_POINTERS = 1001,
    PACK_WORKSPACE = 1003,
};
enum { CROSS_CORRELATION = 1, GENSTATS_SUM_SQSUM = 0 };
constexpr int64_t WORKSPACE = 64 << 10;

// Bytes of one element of an attribute type: pointers and 64-bit values 8, bool 1, enums 4.
size_t type_size(int t) {
    switch (t) {
    case T_HANDLE:
    case T_INT64:
    case T_DOUBLE:
    case T_VOID_PTR:
    case T_BACKEND_DESCRIPTOR: return 8;
    case T_BOOLEAN: return 1;
    default: return 4;
    }
}

struct Desc {
    int kind;
    bool final = false;
    std::map<int, std::pair<int, std::vector<char>>> attrs; // name -> (type, values)
    // What finalizing found: a tensor's descriptor, uid and element strides; a convolution's
    // geometry; an engine configuration's graph (set by the heuristics).
    Tensor t;
    int64_t uid = 0;
    Conv conv;
    const Desc* graph = nullptr;
    bool supported = false; // an operation graph: the heuristics offer an engine for it

    // Attribute `name` as `n` values of type T (n < 0: any count), if set with type `type`.
    template <typename T> bool get(int name, int type, std::vector<T>& out, int n = -1) const {
        auto it = attrs.find(name);
        if (it == attrs.end() || it->second.first != type) return false;
        const std::vector<char>& b = it->second.second;
        out.resize(b.size() / sizeof(T));
        if (!b.empty()) memcpy(out.data(), b.data(), b.size());
        return n < 0 || (int)out.size() == n;
    }
    // A finalized descriptor of `kind` in attribute `name`, or null.
    const Desc* desc(int name, int kind) const {
        std::vector<Desc*> v;
        if (!get(name, T_BACKEND_DESCRIPTOR, v, 1) || !v[0] || v[0]->kind != kind || !v[0]->final) return nullptr;
        return v[0];
    }
};

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

// A forward convolution: x, w, y and the geometry agree (one group), one data type.
Status finalize_conv_fwd(const Desc& d) {
    const Desc *x = d.desc(FWD_X, TENSOR), *w = d.desc(FWD_W, TENSOR), *y = d.desc(FWD_Y, TENSOR);
    const Desc* c = d.desc(FWD_CONV, CONVOLUTION);
    std::vector<float> alpha, beta;
    if (!x || !w || !y || !c || !d.get(FWD_ALPHA, T_FLOAT, alpha, 1) || !d.get(FWD_BETA, T_FLOAT, beta, 1))
        return BAD_PARAM;
    const Conv& k = c->conv;
    int ho = (x->t.h + 2 * k.pad_h - k.dil_h * (w->t.h - 1) - 1) / k.u + 1;
    int wo = (x->t.w + 2 * k.pad_w - k.dil_w * (w->t.w - 1) - 1) / k.v + 1;
    bool ok = x->t.type == w->t.type && w->t.type == y->t.type && x->t.c == w->t.c && y->t.n == x->t.n &&
              y->t.c == w->t.n && y->t.h == ho && y->t.w == wo;
    if (!ok) fprintf(stderr, "emulated cuDNN graph: the convolution's tensors do not agree\n");
    return ok ? SUCCESS : BAD_PARAM;
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

// The graph's forward convolution and statistics, when it is exactly that pair with the
// statistics over the convolution's output.
bool conv_and_stats(const Desc& g, const Desc** fwd, const Desc** stats) {
    std::vector<Desc*> ops;
    if (!g.get(GRAPH_OPS, T_BACKEND_DESCRIPTOR, ops, 2)) return false;
    *fwd = *stats = nullptr;
    for (Desc* o : ops) {
        if (o->kind == OP_CONV_FWD) *fwd = o;
        if (o->kind == OP_GEN_STATS) *stats = o;
    }
    return *fwd && *stats && (*fwd)->desc(FWD_Y, TENSOR) == (*stats)->desc(STATS_X, TENSOR);
}

// Whether an engine runs the graph: the pair above in f16, packed NHWC x and y, KRSC w, f32
// sums, distinct ids, no dilation. The last is this emulator's assumption, not a published
// rule of cuDNN's: it makes a graph the backend builds be declined, so its fallback runs.
bool engine_for(const Desc& g) {
    const Desc *fwd, *stats;
    if (!conv_and_stats(g, &fwd, &stats)) return false;
    const Conv& k = fwd->desc(FWD_CONV, CONVOLUTION)->conv;
    if (k.dil_h != 1 || k.dil_w != 1) return false;
    const Desc *x = fwd->desc(FWD_X, TENSOR), *w = fwd->desc(FWD_W, TENSOR), *y = fwd->desc(FWD_Y, TENSOR);
    const Desc *s = stats->desc(STATS_SUM, TENSOR), *q = stats->desc(STATS_SQSUM, TENSOR);
    for (const Desc* v : {x, w, y})
        if (v->t.type != HALF || v->t.format != NHWC) return false;
    for (const Desc* v : {s, q})
        if (v->t.type != FLOAT) return false;
    int64_t ids[] = {x->uid, w->uid, y->uid, s->uid, q->uid};
    for (int i = 0; i < 5; i++)
        for (int j = 0; j < i; j++)
            if (ids[i] == ids[j]) return false;
    return true;
}

Status finalize(Desc& d) {
    std::vector<void*> p;
    switch (d.kind) {
    case TENSOR: return finalize_tensor(d);
    case CONVOLUTION: return finalize_conv(d);
    case OP_CONV_FWD: return finalize_conv_fwd(d);
    case OP_GEN_STATS: return finalize_stats(d);
    case OPERATIONGRAPH: {
        std::vector<Desc*> ops;
        if (!d.get(GRAPH_HANDLE, T_HANDLE, p, 1) || !d.get(GRAPH_OPS, T_BACKEND_DESCRIPTOR, ops) || ops.empty())
            return BAD_PARAM;
        for (Desc* o : ops)
            if (!o || !o->final) return BAD_PARAM;
        d.supported = engine_for(d);
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
        d.graph = cfg->graph;
        return SUCCESS;
    }
    case VARIANT_PACK: {
        std::vector<int64_t> uids;
        std::vector<void*> ws;
        bool ok = d.get(PACK_UIDS, T_INT64, uids) && d.get(PACK_POINTERS, T_VOID_PTR, p, (int)uids.size()) &&
                  d.get(PACK_WORKSPACE, T_VOID_PTR, ws, 1);
        return ok ? SUCCESS : BAD_PARAM;
    }
    default: return NOT_SUPPORTED;
    }
}
} // namespace

API Status cudnnBackendCreateDescriptor(int kind, Desc** d) {
    switch (kind) {
    case CONVOLUTION:
    case ENGINECFG:
    case ENGINEHEUR:
    case EXECUTION_PLAN:
    case OP_CONV_FWD:
    case OP_GEN_STATS:
    case OPERATIONGRAPH:
    case VARIANT_PACK:
    case TENSOR: *d = new Desc{kind}; return SUCCESS;
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
        int64_t n = d->graph->supported ? 1 : 0;
        if (requested == 0) return *count = n, SUCCESS;
        *count = std::min(n, requested);
        for (int64_t i = 0; i < *count; i++) {
            Desc* cfg = ((Desc**)out)[i];
            if (!cfg || cfg->kind != ENGINECFG) return BAD_PARAM;
            cfg->graph = d->graph, cfg->final = true;
        }
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
    const Desc *fwd, *stats;
    if (!conv_and_stats(*plan->graph, &fwd, &stats)) return BAD_PARAM;
    std::vector<int64_t> uids;
    std::vector<void*> ptrs, ws;
    pack->get(PACK_UIDS, T_INT64, uids);
    pack->get(PACK_POINTERS, T_VOID_PTR, ptrs);
    pack->get(PACK_WORKSPACE, T_VOID_PTR, ws);
    if (!ws[0]) return BAD_PARAM;
    const Desc* ts[] = {fwd->desc(FWD_X, TENSOR), fwd->desc(FWD_W, TENSOR), fwd->desc(FWD_Y, TENSOR),
                        stats->desc(STATS_SUM, TENSOR), stats->desc(STATS_SQSUM, TENSOR)};
    void* at[5] = {};
    for (int i = 0; i < 5; i++) {
        for (size_t k = 0; k < uids.size(); k++)
            if (uids[k] == ts[i]->uid) at[i] = ptrs[k];
        if (!at[i] || (uintptr_t)at[i] % 16 != 0) {
            fprintf(stderr, "emulated cuDNN graph: tensor %lld has no 16-byte aligned address\n",
                    (long long)ts[i]->uid);
            return BAD_PARAM;
        }
    }
    std::vector<float> alpha, beta;
    fwd->get(FWD_ALPHA, T_FLOAT, alpha);
    fwd->get(FWD_BETA, T_FLOAT, beta);
    Tensor x = ts[0]->t, w = ts[1]->t, y = ts[2]->t;
    Conv c = fwd->desc(FWD_CONV, CONVOLUTION)->conv;
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
