// An emulated NCCL (libnccl.so.2) for the data-parallel tests: the ranks are threads of one
// process, each with its emulated device (MANTISSA_EMU_DEVICES), joined by the id rank 0
// makes. A collective is called by every rank; the call first runs the work queued before it
// on its stream (so the send buffer holds what the stream order says), hands its data to the
// round and waits for the other ranks' calls (a barrier on the host: NCCL's calls return at
// once, but every rank must make them in the same order, which this checks), then queues the
// writing of the result on the stream: the result appears when the stream runs there, and
// the compute stream sees it only after waiting for this stream, as on a GPU.
//
// Failures as NCCL reports them: a rank that aborts its communicator (or never comes, past
// MANTISSA_EMU_NCCL_TIMEOUT_S, default 60 s) breaks the clique: waiting calls return
// ncclRemoteError and ncclCommGetAsyncError reports it. Ranks that call different collectives
// (kind, count, dtype, op, root) in the same round get ncclInvalidUsage.
// Sums are taken in double and rounded once to the dtype.

#include "half.h"
#include "queue.h"
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unistd.h>
#include <vector>

#define API extern "C" __attribute__((visibility("default")))

enum { SUCCESS = 0, SYSTEM_ERROR = 2, INVALID_ARGUMENT = 4, INVALID_USAGE = 5, REMOTE_ERROR = 6 };
enum { ALL_REDUCE, BROADCAST, ALL_GATHER, REDUCE_SCATTER };

struct Id {
    char bytes[128];
};

struct Round {
    int kind, dtype, op, root;
    size_t count;
    std::vector<std::vector<double>> data; // by rank
    int arrived = 0, taken = 0;
};

struct Clique {
    int n;
    std::vector<bool> left; // ranks whose communicator was destroyed
    int joined = 0;
    bool failed = false;
    std::string why;
    std::map<uint64_t, Round> rounds;
};

struct Comm {
    std::shared_ptr<Clique> clique;
    int rank;
    uint64_t seq = 0;
};

static std::mutex mu;
static std::condition_variable cv;
static std::map<std::string, std::shared_ptr<Clique>> cliques;

static double timeout_s() {
    const char* v = getenv("MANTISSA_EMU_NCCL_TIMEOUT_S");
    return v ? atof(v) : 60.0;
}

// Waits (lock held) until `done` or the clique fails; false on failure or timeout.
template <typename F> static bool wait_for(std::unique_lock<std::mutex>& g, Clique& c, F done) {
    auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s());
    while (!done() && !c.failed) {
        if (cv.wait_until(g, until) == std::cv_status::timeout && !done()) {
            c.failed = true;
            c.why = "a rank did not come within MANTISSA_EMU_NCCL_TIMEOUT_S";
            cv.notify_all();
        }
    }
    return !c.failed;
}

static size_t elem_size(int dtype) {
    switch (dtype) {
    case 1: return 1;
    case 6: case 9: return 2;
    case 7: return 4;
    case 4: case 8: return 8;
    default: return 0;
    }
}
static double get(const void* p, int dtype, size_t i) {
    switch (dtype) {
    case 1: return ((const uint8_t*)p)[i];
    case 4: return (double)((const int64_t*)p)[i];
    case 6: return load(p, K_F16, i);
    case 7: return ((const float*)p)[i];
    case 8: return ((const double*)p)[i];
    default: return load(p, K_BF16, i);
    }
}
static void put(void* p, int dtype, size_t i, double v) {
    switch (dtype) {
    case 1: ((uint8_t*)p)[i] = (uint8_t)v; break;
    case 4: ((int64_t*)p)[i] = (int64_t)v; break;
    case 6: store(p, K_F16, i, (float)v); break;
    case 7: ((float*)p)[i] = (float)v; break;
    case 8: ((double*)p)[i] = v; break;
    default: store(p, K_BF16, i, (float)v);
    }
}

typedef int (*StreamSync)(void*);
static StreamSync stream_sync() {
    static StreamSync f = (StreamSync)driver_symbol("cuStreamSynchronize");
    return f;
}

API int ncclGetVersion(int* v) {
    *v = 23003;
    return SUCCESS;
}
API const char* ncclGetErrorString(int r) {
    switch (r) {
    case SUCCESS: return "no error";
    case SYSTEM_ERROR: return "unhandled system error (emulated: a rank did not come in time)";
    case INVALID_ARGUMENT: return "invalid argument";
    case INVALID_USAGE: return "invalid usage (emulated: ranks called different collectives)";
    case REMOTE_ERROR: return "remote process exited or there was a network error";
    default: return "unknown result code";
    }
}
API int ncclGetUniqueId(Id* id) {
    static std::atomic<uint64_t> next{1};
    memset(id->bytes, 0, 128);
    snprintf(id->bytes, 128, "emulated-nccl-%d-%llu-%lld", (int)getpid(),
             (unsigned long long)next++,
             (long long)std::chrono::steady_clock::now().time_since_epoch().count());
    return SUCCESS;
}
API int ncclCommInitRank(Comm** out, int n, Id id, int rank) {
    if (n < 1 || rank < 0 || rank >= n) return INVALID_ARGUMENT;
    std::string key(id.bytes, strnlen(id.bytes, 128));
    if (key.rfind("emulated-nccl-", 0) != 0) return INVALID_ARGUMENT;
    std::unique_lock<std::mutex> g(mu);
    auto& c = cliques[key];
    if (!c) c = std::make_shared<Clique>(Clique{n, std::vector<bool>(n)});
    if (c->n != n) return INVALID_USAGE;
    std::shared_ptr<Clique> clique = c;
    clique->joined++;
    cv.notify_all();
    if (!wait_for(g, *clique, [&] { return clique->joined >= clique->n; })) return SYSTEM_ERROR;
    *out = new Comm{clique, rank};
    return SUCCESS;
}
static void break_clique(Comm* c, const char* why) {
    std::lock_guard<std::mutex> g(mu);
    if (!c->clique->failed) {
        c->clique->failed = true;
        c->clique->why = why;
    }
    cv.notify_all();
}
API int ncclCommAbort(Comm* c) {
    if (!c) return SUCCESS;
    break_clique(c, "a rank aborted its communicator");
    delete c;
    return SUCCESS;
}
// A rank that leaves (its process ends) fails the rounds that wait for it, as a peer's
// closed connection does.
API int ncclCommDestroy(Comm* c) {
    if (!c) return SUCCESS;
    {
        std::lock_guard<std::mutex> g(mu);
        c->clique->left[c->rank] = true;
        cv.notify_all();
    }
    delete c;
    return SUCCESS;
}
API int ncclCommGetAsyncError(Comm* c, int* err) {
    std::lock_guard<std::mutex> g(mu);
    *err = c->clique->failed ? REMOTE_ERROR : SUCCESS;
    return SUCCESS;
}

// One rank's part of a collective: see the top of the file.
static int collective(int kind, const void* send, void* recv, size_t count, int dtype, int op,
                      int root, Comm* c, void* stream) {
    size_t es = elem_size(dtype);
    if (!c || es == 0 || op < 0 || op > 4) return INVALID_ARGUMENT;
    stream_sync()(stream); // what the stream order puts before this call
    Clique& q = *c->clique;
    int n = q.n;
    size_t in = kind == REDUCE_SCATTER ? count * n : count;
    std::vector<double> mine(in);
    for (size_t i = 0; i < in; i++) mine[i] = get(send, dtype, i);
    std::unique_lock<std::mutex> g(mu);
    if (q.failed) return REMOTE_ERROR;
    uint64_t seq = c->seq++;
    auto [it, fresh] = q.rounds.try_emplace(seq);
    Round& r = it->second;
    if (fresh) {
        r.kind = kind, r.dtype = dtype, r.op = op, r.root = root, r.count = count;
        r.data.resize(n);
    } else if (r.kind != kind || r.dtype != dtype || r.op != op || r.root != root ||
               r.count != count) {
        q.failed = true;
        q.why = "ranks called different collectives";
        cv.notify_all();
        return INVALID_USAGE;
    }
    r.data[c->rank] = std::move(mine);
    r.arrived++;
    cv.notify_all();
    auto all_here = [&] {
        if (r.arrived == n) return true;
        for (int k = 0; k < n; k++) {
            if (q.left[k] && r.data[k].empty() && count > 0) {
                q.failed = true;
                q.why = "a rank left";
                cv.notify_all();
            }
        }
        return false;
    };
    if (!wait_for(g, q, all_here)) return REMOTE_ERROR;
    size_t out = kind == ALL_GATHER ? count * n : count;
    std::vector<double> res(out);
    auto reduce = [&](size_t i) {
        double v = r.data[0][i];
        for (int k = 1; k < n; k++) {
            double w = r.data[k][i];
            v = op == 1 ? v * w : op == 2 ? std::max(v, w) : op == 3 ? std::min(v, w) : v + w;
        }
        return op == 4 ? v / n : v;
    };
    for (size_t i = 0; i < out; i++) {
        switch (kind) {
        case ALL_REDUCE: res[i] = reduce(i); break;
        case BROADCAST: res[i] = r.data[root][i]; break;
        case ALL_GATHER: res[i] = r.data[i / count][i % count]; break;
        default: res[i] = reduce(c->rank * count + i);
        }
    }
    if (++r.taken == n) q.rounds.erase(it);
    g.unlock();
    later(stream, [recv, dtype, res = std::move(res)] {
        for (size_t i = 0; i < res.size(); i++) put(recv, dtype, i, res[i]);
    });
    return SUCCESS;
}

API int ncclAllReduce(const void* s, void* r, size_t n, int t, int op, Comm* c, void* st) {
    return collective(ALL_REDUCE, s, r, n, t, op, 0, c, st);
}
API int ncclBroadcast(const void* s, void* r, size_t n, int t, int root, Comm* c, void* st) {
    if (!c || root < 0 || root >= c->clique->n) return INVALID_ARGUMENT;
    return collective(BROADCAST, s, r, n, t, 0, root, c, st);
}
API int ncclAllGather(const void* s, void* r, size_t n, int t, Comm* c, void* st) {
    return collective(ALL_GATHER, s, r, n, t, 0, 0, c, st);
}
API int ncclReduceScatter(const void* s, void* r, size_t n, int t, int op, Comm* c, void* st) {
    return collective(REDUCE_SCATTER, s, r, n, t, op, 0, c, st);
}
