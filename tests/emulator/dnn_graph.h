// The emulated cuDNN's graph (backend) API, what its files share (dnn_graph.cpp: the
// descriptors and the convolution graphs; dnn_sdpa.cpp: scaled dot-product attention): the
// descriptor kinds, attribute names and types as cuDNN's headers number them, and the
// descriptor every kind is held in.
#pragma once
#include "dnn.h"
#include <map>

namespace dg {
enum Kind {
    POINTWISE = 0,
    CONVOLUTION = 1,
    ENGINE = 2,
    ENGINECFG = 3,
    ENGINEHEUR = 4,
    EXECUTION_PLAN = 5,
    OP_CONV_FWD = 10,
    OP_CONV_BWD_FILTER = 11,
    OP_POINTWISE = 13,
    OP_GEN_STATS = 14,
    OPERATIONGRAPH = 15,
    VARIANT_PACK = 16,
    TENSOR = 17,
    MATMUL = 18,
    OP_MATMUL = 19,
    REDUCTION = 21,
    OP_REDUCTION = 22,
    OP_RESHAPE = 31,
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
    T_NUMERICAL_NOTE = 11,
    T_POINTWISE_MODE = 14,
    T_BACKEND_DESCRIPTOR = 15,
    T_GENSTATS_MODE = 16,
    T_REDUCTION_OPERATOR = 18,
};
enum Attr {
    PW_MODE = 0,
    PW_PREC = 1,
    PW_AXIS = 9,
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
    ENGINECFG_ENGINE = 300,
    PLAN_HANDLE = 400,
    PLAN_ENGINE_CONFIG = 401,
    PLAN_WORKSPACE_SIZE = 402,
    FWD_ALPHA = 700,
    FWD_BETA = 701,
    FWD_CONV = 702,
    FWD_W = 703,
    FWD_X = 704,
    FWD_Y = 705,
    WGRAD_ALPHA = 712,
    WGRAD_BETA = 713,
    WGRAD_CONV = 714,
    WGRAD_DW = 715,
    WGRAD_X = 716,
    WGRAD_DY = 717,
    OP_PW = 750,
    OP_PW_X = 751,
    OP_PW_B = 752,
    OP_PW_Y = 753,
    OP_PW_T = 758,
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
    TENSOR_BY_VALUE = 908,
    PACK_UIDS = 1000,
    PACK_POINTERS = 1001,
    PACK_WORKSPACE = 1003,
    ENGINE_NUMERICAL_NOTE = 1303,
    MATMUL_COMP_TYPE = 1500,
    OP_MATMUL_A = 1520,
    OP_MATMUL_B = 1521,
    OP_MATMUL_C = 1522,
    OP_MATMUL_DESC = 1523,
    REDUCTION_OPERATOR = 1600,
    REDUCTION_COMP_TYPE = 1601,
    OP_REDUCTION_X = 1610,
    OP_REDUCTION_Y = 1611,
    OP_REDUCTION_DESC = 1612,
    OP_RESHAPE_X = 2200,
    OP_RESHAPE_Y = 2201,
};
enum { CROSS_CORRELATION = 1, GENSTATS_SUM_SQSUM = 0 };
enum {
    PW_ADD = 0,
    PW_MUL = 1,
    PW_DIV = 6,
    PW_SUB = 9,
    PW_EXP = 13,
    PW_LOG = 15,
    PW_IDENTITY = 21,
    PW_RELU_FWD = 100,
    PW_CMP_GE = 303,
    PW_GEN_INDEX = 501,
    PW_BINARY_SELECT = 601,
};
enum { INT32 = 4, BOOLEAN = 11 };
enum { REDUCE_ADD = 0, REDUCE_MAX = 3 };
enum { NOTE_TENSOR_CORE = 0, NOTE_NONDETERMINISTIC = 4 };
constexpr int64_t WORKSPACE = 64 << 10;

// Bytes of one element of an attribute type: pointers and 64-bit values 8, bool 1, enums 4.
inline size_t type_size(int t) {
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
    bool virt = false, by_value = false;
    std::vector<int64_t> dims, strides; // a tensor's, as set
    Conv conv;
    int pw_mode = -1; // a pointwise descriptor's mode
    int64_t axis = -1; // a GEN_INDEX pointwise descriptor's axis
    int reduce_op = -1; // a reduction descriptor's operator
    const Desc* graph = nullptr;
    int engines = 0; // an operation graph: how many engine configurations the heuristics offer
    int engine = 0;  // an engine, its configuration or a plan: which of the graph's engines

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

// Descriptor kinds of the attention graphs (dnn_sdpa.cpp): finalizing a matmul, reduction or
// reshape, or their operations; NOT_SUPPORTED for a kind it does not know.
Status finalize_sdpa_kind(Desc& d);
// How many engines the emulated cuDNN offers finalized operation graph g as an attention graph
// (0: it is none, or one the fused attention engines refuse), with why on stderr when asked.
int sdpa_engines(const Desc& g);
// Queues the attention graph of plan `graph` on h's stream over the pack's addresses.
Status run_sdpa(Handle* h, const Desc& graph, const Desc* pack);
// The address the pack gives tensor t: 16-byte aligned, or null (said on stderr).
void* address(const Desc* pack, const Desc* t);
} // namespace dg
