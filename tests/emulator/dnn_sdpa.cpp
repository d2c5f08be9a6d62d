// The emulated cuDNN's scaled dot-product attention through the graph API: the operation
// graphs cudnn-frontend lowers its composite SDPA node to for a cuDNN 9.0-9.20 runtime
// (forward: Q K^T, the scale, the optional top-left causal mask as GEN_INDEX, CMP_GE and
// BINARY_SELECT, the softmax as reductions and pointwise operations with the log-sum-exp
// Stats as an output, then P V; backward: rowsum(dO O), the scores again, P from Stats, dV,
// dP, dS, dK and dQ, with P^T and dS^T as RESHAPE operations, dQ straight from its product or
// through an f32 accumulator and an IDENTITY).
//
// Finalizing checks each operation's operands as cuDNN does (a matmul's dims agree, a
// reduction's output keeps or collapses each dim, a reshape keeps the element count). The
// heuristics offer one engine for a graph whose operations come in one of those orders and
// that the fused attention engines take, and none otherwise, so that the backend falls back
// (sdpa_engines). The rules are the documented support surface for f16/bf16 on the emulated
// device (compute capability 9.0; this library reports version 9.1.0): Q, K, V and O of one
// type, f16 or bf16, each with its last stride 1; head sizes a multiple of 8 up to 256;
// Stats and the intermediates f32, except P (the second product's operand), which must have
// the I/O type; no causal forward of one query (up to 9.9); before 9.5.1, a backward's
// output gradient with the output's strides. One more is this emulator's assumption: a
// backward whose key count is not a multiple of 128 is refused, as a runtime up to 9.15
// needs cudnn-frontend's padding-mask workaround there, which the graph does not carry.
//
// Executing checks each tensor in memory has a 16-byte aligned address (a by-value one, a
// host address), reads the by-value scalars then, and queues an interpreter of the graph on
// the handle's stream: every operation in order, on the host, in f32, each virtual tensor in
// a buffer of its own laid out by its strides (rounded to its type), a reshape re-reading its
// input's memory through its output's strides. So what the graph computes is what its
// operations say, not a built-in attention.

#include "dnn_graph.h"
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>

namespace dg {
namespace {

bool debug() { return getenv("MANTISSA_DEBUG_FUSION") != nullptr; }

// Says why a graph is not an attention graph an engine takes, when asked; returns 0.
int refuse(const char* why) {
    if (debug()) fprintf(stderr, "emulated cuDNN: no attention engine: %s\n", why);
    return 0;
}

Status finalize_matmul(Desc& d) {
    std::vector<int> comp;
    if (!d.get(MATMUL_COMP_TYPE, T_DATA_TYPE, comp, 1)) return BAD_PARAM;
    return comp[0] == FLOAT ? SUCCESS : NOT_SUPPORTED;
}

Status finalize_reduction(Desc& d) {
    std::vector<int> op, comp;
    if (!d.get(REDUCTION_OPERATOR, T_REDUCTION_OPERATOR, op, 1) || !d.get(REDUCTION_COMP_TYPE, T_DATA_TYPE, comp, 1))
        return BAD_PARAM;
    if (op[0] != REDUCE_ADD && op[0] != REDUCE_MAX) return NOT_SUPPORTED;
    d.reduce_op = op[0];
    return comp[0] == FLOAT ? SUCCESS : NOT_SUPPORTED;
}

// C = A B over the last two dims, the others equal or broadcast from 1.
Status finalize_op_matmul(const Desc& d) {
    const Desc *a = d.desc(OP_MATMUL_A, TENSOR), *b = d.desc(OP_MATMUL_B, TENSOR), *c = d.desc(OP_MATMUL_C, TENSOR);
    if (!a || !b || !c || !d.desc(OP_MATMUL_DESC, MATMUL)) return BAD_PARAM;
    const auto &A = a->dims, &B = b->dims, &C = c->dims;
    if (A.size() != 4 || B.size() != 4 || C.size() != 4) return BAD_PARAM;
    for (int i = 0; i < 2; i++)
        if ((A[i] != C[i] && A[i] != 1) || (B[i] != C[i] && B[i] != 1)) return BAD_PARAM;
    return A[2] == C[2] && B[3] == C[3] && A[3] == B[2] ? SUCCESS : BAD_PARAM;
}

// Y keeps each of X's dims or collapses it to 1.
Status finalize_op_reduction(const Desc& d) {
    const Desc *x = d.desc(OP_REDUCTION_X, TENSOR), *y = d.desc(OP_REDUCTION_Y, TENSOR);
    if (!x || !y || !d.desc(OP_REDUCTION_DESC, REDUCTION) || x->dims.size() != y->dims.size()) return BAD_PARAM;
    for (size_t i = 0; i < x->dims.size(); i++)
        if (y->dims[i] != x->dims[i] && y->dims[i] != 1) return BAD_PARAM;
    return SUCCESS;
}

int64_t count(const std::vector<int64_t>& dims) {
    int64_t n = 1;
    for (int64_t v : dims) n *= v;
    return n;
}

Status finalize_op_reshape(const Desc& d) {
    const Desc *x = d.desc(OP_RESHAPE_X, TENSOR), *y = d.desc(OP_RESHAPE_Y, TENSOR);
    return x && y && count(x->dims) == count(y->dims) ? SUCCESS : BAD_PARAM;
}

// The operations of graph g, in order.
std::vector<const Desc*> operations(const Desc& g) {
    std::vector<Desc*> ops;
    g.get(GRAPH_OPS, T_BACKEND_DESCRIPTOR, ops);
    return {ops.begin(), ops.end()};
}

// An operation's code in a graph's signature: 'M' a matmul, 'R' a reshape, '+'/'x' a sum or
// max reduction, a pointwise operation by its mode's letter.
char code(const Desc* o) {
    switch (o->kind) {
    case OP_MATMUL: return 'M';
    case OP_RESHAPE: return 'R';
    case OP_REDUCTION: return o->desc(OP_REDUCTION_DESC, REDUCTION)->reduce_op == REDUCE_MAX ? 'x' : '+';
    case OP_POINTWISE:
        switch (o->desc(OP_PW, POINTWISE)->pw_mode) {
        case PW_ADD: return 'a';
        case PW_MUL: return 'm';
        case PW_DIV: return 'd';
        case PW_SUB: return 's';
        case PW_EXP: return 'e';
        case PW_LOG: return 'l';
        case PW_IDENTITY: return 'i';
        case PW_CMP_GE: return 'c';
        case PW_GEN_INDEX: return 'g';
        case PW_BINARY_SELECT: return 'b';
        default: return '?';
        }
    default: return '?';
    }
}

// The orders of operations an attention engine takes: forward, then backward with dQ
// straight from its product, then with the f32 accumulator; the causal mask ("ggcb") sits
// after the scale in the forward and after the subtraction of Stats in the backward.
const std::string mask = "ggcb";

bool sdpa_signature(const std::string& s, bool& backward) {
    const std::string fwd[] = {"Mm" + std::string("xse+ladM"), "Mm" + mask + "xse+ladM"};
    const std::string bwd_head = "m+mMms", bwd_tail = "eRMMsmmRMRM";
    for (const std::string& f : fwd)
        if (s == f) return backward = false, true;
    for (const std::string& m : {std::string(), mask})
        for (const std::string& end : {std::string(), std::string("i")})
            if (s == bwd_head + m + bwd_tail + end) return backward = true, true;
    return false;
}

bool io_type(int t) { return t == HALF || t == BFLOAT16; }
bool in_memory(const Desc* t) { return t && !t->virt && !t->by_value; }
} // namespace

Status finalize_sdpa_kind(Desc& d) {
    switch (d.kind) {
    case MATMUL: return finalize_matmul(d);
    case REDUCTION: return finalize_reduction(d);
    case OP_MATMUL: return finalize_op_matmul(d);
    case OP_REDUCTION: return finalize_op_reduction(d);
    case OP_RESHAPE: return finalize_op_reshape(d);
    default: return NOT_SUPPORTED;
    }
}

int sdpa_engines(const Desc& g) {
    std::vector<const Desc*> ops = operations(g);
    std::string sig;
    for (const Desc* o : ops) sig += code(o);
    bool backward = false;
    if (!sdpa_signature(sig, backward)) return 0;
    // The first product reads Q and K^T (K's dims and strides swapped) in both directions.
    const Desc* first = ops[backward ? 3 : 0];
    const Desc *q = first->desc(OP_MATMUL_A, TENSOR), *kt = first->desc(OP_MATMUL_B, TENSOR);
    if (!in_memory(q) || !in_memory(kt)) return refuse("Q or K is not in memory");
    int io = q->t.type;
    if (!io_type(io) || kt->t.type != io) return refuse("Q and K are not both f16 or both bf16");
    if (q->strides[3] != 1 || kt->strides[2] != 1) return refuse("a last stride of Q or K is not 1");
    int64_t d = q->dims[3];
    if (d % 8 != 0 || d > 256) return refuse("the head size is not a multiple of 8 up to 256");
    for (const Desc* o : ops) {
        // Every tensor in memory other than Stats and the backward's f32 row sums and
        // accumulator has the I/O type and a last stride of 1 (K and V enter the backward
        // transposed: their stride 1 is the third).
        const Desc* ts[] = {o->desc(OP_MATMUL_A, TENSOR),  o->desc(OP_MATMUL_B, TENSOR), o->desc(OP_MATMUL_C, TENSOR),
                            o->desc(OP_PW_X, TENSOR),      o->desc(OP_PW_B, TENSOR),     o->desc(OP_PW_Y, TENSOR),
                            o->desc(OP_REDUCTION_X, TENSOR), o->desc(OP_RESHAPE_X, TENSOR)};
        for (const Desc* t : ts) {
            if (!in_memory(t) || t->t.type == FLOAT) continue;
            if (t->t.type != io) return refuse("the tensors in memory are not of one type");
            if (t->strides[3] != 1 && t->strides[2] != 1) return refuse("a tensor's last stride is not 1");
        }
    }
    if (!backward) {
        if (q->dims[2] == 1 && sig.find(mask) != std::string::npos)
            return refuse("a causal forward of one query on a runtime up to 9.9");
        const Desc* p = ops.back()->desc(OP_MATMUL_A, TENSOR);
        if (!p->virt || p->t.type != io) return refuse("the second product's P does not have the I/O type");
        const Desc* v = ops.back()->desc(OP_MATMUL_B, TENSOR);
        if (v->dims[3] % 8 != 0 || v->dims[3] > 256) return refuse("the value head size");
    } else {
        if (kt->dims[3] % 128 != 0)
            return refuse("a backward whose key count is not a multiple of 128 on a runtime up to 9.15");
        // The backward's first operation is dO times O.
        const Desc *dout = ops[0]->desc(OP_PW_X, TENSOR), *o = ops[0]->desc(OP_PW_B, TENSOR);
        if (!in_memory(dout) || !in_memory(o) || dout->strides != o->strides)
            return refuse("before 9.5.1 the output gradient must have the output's strides");
    }
    return 1;
}

namespace {
// A tensor of an interpreted graph: its type, dims and strides, and where its values are
// (device memory, a buffer of its own, or a by-value scalar's copy).
struct Val {
    int type = FLOAT;
    std::vector<int64_t> dims, strides;
    void* at = nullptr;
    std::shared_ptr<std::vector<char>> own;
    int64_t span() const {
        int64_t s = 1;
        for (size_t i = 0; i < dims.size(); i++) s += (dims[i] - 1) * strides[i];
        return s;
    }
    // Element idx (broadcast: a dim of 1 reads index 0).
    int64_t off(const int64_t* idx) const {
        int64_t o = 0;
        for (size_t i = 0; i < dims.size(); i++) o += (dims[i] == 1 ? 0 : idx[i]) * strides[i];
        return o;
    }
    // The storage type: masks and indices are held as f32.
    int storage() const { return type == HALF || type == BFLOAT16 ? type : FLOAT; }
    float get(const int64_t* idx) const { return load(at, storage(), off(idx)); }
    void put(const int64_t* idx, float v) { store(at, storage(), off(idx), v); }
};

struct Step {
    int kind = 0, mode = -1, red = -1;
    int64_t axis = -1;
    int x = -1, b = -1, t = -1, y = -1; // a matmul: A, B, C as x, b, y
};

// Runs `f` over every index of dims (4-D).
template <typename F> void each(const std::vector<int64_t>& dims, F f) {
    int64_t i[4];
    for (i[0] = 0; i[0] < dims[0]; i[0]++)
        for (i[1] = 0; i[1] < dims[1]; i[1]++)
            for (i[2] = 0; i[2] < dims[2]; i[2]++)
                for (i[3] = 0; i[3] < dims[3]; i[3]++) f(i);
}

float pointwise(int mode, float x, float b, float t, int64_t index) {
    switch (mode) {
    case PW_ADD: return x + b;
    case PW_MUL: return x * b;
    case PW_DIV: return x / b;
    case PW_SUB: return x - b;
    case PW_EXP: return expf(x);
    case PW_LOG: return logf(x);
    case PW_IDENTITY: return x;
    case PW_RELU_FWD: return x > 0.0f ? x : 0.0f;
    case PW_CMP_GE: return x >= b ? 1.0f : 0.0f;
    case PW_GEN_INDEX: return (float)index;
    case PW_BINARY_SELECT: return t != 0.0f ? x : b;
    default: return NAN;
    }
}

void interpret(std::vector<Val>& vals, const std::vector<Step>& steps) {
    for (Val& v : vals)
        if (!v.at) {
            v.own = std::make_shared<std::vector<char>>(v.span() * (v.storage() == FLOAT ? 4 : 2));
            v.at = v.own->data();
        }
    for (const Step& s : steps) {
        Val& y = vals[s.y];
        if (s.kind == OP_POINTWISE) {
            const Val *x = &vals[s.x], *b = s.b >= 0 ? &vals[s.b] : nullptr, *t = s.t >= 0 ? &vals[s.t] : nullptr;
            each(y.dims, [&](const int64_t* i) {
                float xv = x->get(i), bv = b ? b->get(i) : 0.0f, tv = t ? t->get(i) : 0.0f;
                y.put(i, pointwise(s.mode, xv, bv, tv, s.axis >= 0 ? i[s.axis] : 0));
            });
        } else if (s.kind == OP_REDUCTION) {
            const Val& x = vals[s.x];
            std::vector<float> acc(y.span(), s.red == REDUCE_MAX ? -INFINITY : 0.0f);
            each(x.dims, [&](const int64_t* i) {
                float v = x.get(i);
                float& a = acc[y.off(i)];
                a = s.red == REDUCE_MAX ? std::max(a, v) : a + v;
            });
            each(y.dims, [&](const int64_t* i) { y.put(i, acc[y.off(i)]); });
        } else if (s.kind == OP_MATMUL) {
            const Val &a = vals[s.x], &b = vals[s.b];
            int64_t k = a.dims[3];
            each(y.dims, [&](const int64_t* i) {
                float sum = 0.0f;
                int64_t ai[4] = {i[0], i[1], i[2], 0}, bi[4] = {i[0], i[1], 0, i[3]};
                for (ai[3] = 0, bi[2] = 0; ai[3] < k; ai[3]++, bi[2]++) sum += a.get(ai) * b.get(bi);
                y.put(i, sum);
            });
        } else if (s.kind == OP_RESHAPE) {
            // The output's own strides over the input's memory, in the output's type.
            const Val& x = vals[s.x];
            for (int64_t j = 0; j < y.span(); j++) store(y.at, y.storage(), j, load(x.at, x.storage(), j));
        }
    }
}
} // namespace

Status run_sdpa(Handle* h, const Desc& graph, const Desc* pack) {
    std::vector<Val> vals;
    std::vector<const Desc*> seen;
    std::vector<int64_t> uids;
    std::vector<void*> ptrs;
    pack->get(PACK_UIDS, T_INT64, uids);
    pack->get(PACK_POINTERS, T_VOID_PTR, ptrs);
    bool ok = true;
    // The index of tensor t among the values, added at first sight.
    auto index = [&](const Desc* t) -> int {
        if (!t) return -1;
        for (size_t i = 0; i < seen.size(); i++)
            if (seen[i] == t) return (int)i;
        Val v;
        v.type = t->t.type, v.dims = t->dims, v.strides = t->strides;
        if (t->by_value) {
            void* host = nullptr;
            for (size_t k = 0; k < uids.size(); k++)
                if (uids[k] == t->uid) host = ptrs[k];
            if (!host || t->t.type != FLOAT) ok = false;
            v.own = std::make_shared<std::vector<char>>(4);
            if (host) memcpy(v.own->data(), host, 4);
            v.at = v.own->data(), v.strides = std::vector<int64_t>(t->dims.size(), 0);
        } else if (!t->virt) {
            if (!(v.at = address(pack, t))) ok = false;
        }
        seen.push_back(t);
        vals.push_back(v);
        return (int)vals.size() - 1;
    };
    std::vector<Step> steps;
    for (const Desc* o : operations(graph)) {
        Step s;
        s.kind = o->kind;
        if (o->kind == OP_POINTWISE) {
            const Desc* pw = o->desc(OP_PW, POINTWISE);
            s.mode = pw->pw_mode, s.axis = pw->axis;
            s.x = index(o->desc(OP_PW_X, TENSOR)), s.b = index(o->desc(OP_PW_B, TENSOR));
            s.t = index(o->desc(OP_PW_T, TENSOR)), s.y = index(o->desc(OP_PW_Y, TENSOR));
        } else if (o->kind == OP_REDUCTION) {
            s.red = o->desc(OP_REDUCTION_DESC, REDUCTION)->reduce_op;
            s.x = index(o->desc(OP_REDUCTION_X, TENSOR)), s.y = index(o->desc(OP_REDUCTION_Y, TENSOR));
        } else if (o->kind == OP_MATMUL) {
            s.x = index(o->desc(OP_MATMUL_A, TENSOR)), s.b = index(o->desc(OP_MATMUL_B, TENSOR));
            s.y = index(o->desc(OP_MATMUL_C, TENSOR));
        } else if (o->kind == OP_RESHAPE) {
            s.x = index(o->desc(OP_RESHAPE_X, TENSOR)), s.y = index(o->desc(OP_RESHAPE_Y, TENSOR));
            // Only a reshape over memory already there: its input's span covers its output's.
            if (vals[s.y].span() > vals[s.x].span()) ok = false;
        }
        steps.push_back(s);
    }
    if (!ok) return BAD_PARAM;
    later(h->stream, [vals, steps]() mutable { interpret(vals, steps); });
    return SUCCESS;
}
} // namespace dg
