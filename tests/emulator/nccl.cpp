// An emulated NCCL (libnccl.so.2) for the data-parallel tests: the ranks are threads of one
// process, each with its emulated device (MANTISSA_EMU_DEVICES), joined by the id rank 0
// makes. As NCCL's, a collective call checks its arguments, takes its place in the
// communicator's sequence and returns at once; its work is queued on the stream
// (later_waiting): when the stream reaches it, it reads the send buffer, hands its data to
// the round and waits (stays queued, as a kernel that spins on the GPU) until every rank's
// part has come, then writes the result. The compute stream sees it only after waiting for
// this stream, as on a GPU.
//
// Failures as NCCL on one node shows them: none crosses to the peers. A rank that aborts or
// destroys its communicator, or never calls a collective, leaves the others' collectives
// waiting forever (the driver stops the process past MANTISSA_EMU_HANG_S, as a test run must
// not hang): their own watchdog must give up and abort their communicator, which ends their
// waiting work (its result unwritten). ncclCommAbort returns at once; ncclCommDestroy waits
// for the communicator's queued collectives, as NCCL's does. A communicator made by
// ncclCommInitRankConfig with blocking = 0 is ready once every rank has joined
// (ncclCommGetAsyncError says ncclInProgress until then); ncclCommInitRank waits for them (at
// most MANTISSA_EMU_NCCL_TIMEOUT_S, default 60 s). MANTISSA_EMU_NCCL_LOST_RANK=r makes rank r's
// init fail without joining, as a process that dies between the rendezvous and NCCL's init.
// Stricter than NCCL: ranks that call different collectives (kind, count, dtype, op, root)
// in the same round get ncclInvalidUsage (NCCL would hang or mix the data), as does a
// collective on a communicator that has not finished joining.
// Sums are taken in double and rounded once to the dtype.

#include "half.h"
#include "queue.h"
#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unistd.h>
#include <vector>

#define API extern "C" __attribute__((visibility("default")))

enum {
    SUCCESS = 0,
    SYSTEM_ERROR = 2,
    INVALID_ARGUMENT = 4,
    INVALID_USAGE = 5,
    REMOTE_ERROR = 6,
    IN_PROGRESS = 7
};
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
    int joined = 0;
    bool misused = false; // ranks called different collectives
    std::map<uint64_t, Round> rounds;
};

// One rank's communicator; its queued collectives share it, and outlive an abort.
struct State {
    std::shared_ptr<Clique> clique;
    int rank;
    bool aborted = false;
    uint64_t seq = 0;       // collectives called so far
    int inflight = 0;       // queued and not yet run
    void* stream = nullptr; // of the latest collective
};
struct Comm {
    std::shared_ptr<State> s;
};

static std::mutex mu;
static std::condition_variable cv;
static std::map<std::string, std::shared_ptr<Clique>> cliques;

static double timeout_s() {
    const char* v = getenv("MANTISSA_EMU_NCCL_TIMEOUT_S");
    return v ? atof(v) : 60.0;
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
    *v = 21903;
    return SUCCESS;
}
API const char* ncclGetErrorString(int r) {
    switch (r) {
    case SUCCESS: return "no error";
    case SYSTEM_ERROR: return "unhandled system error (emulated: a rank did not join in time, or was lost)";
    case INVALID_ARGUMENT: return "invalid argument";
    case INVALID_USAGE: return "invalid usage (emulated: ranks called different collectives, or a collective before the communicator was ready)";
    case REMOTE_ERROR: return "remote process exited or there was a network error";
    case IN_PROGRESS: return "NCCL operation in progress";
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
// ncclConfig_t's first fields (NCCL reads those its size and version cover).
struct Config {
    size_t size;
    unsigned magic, version;
    int blocking;
};
static int init(Comm** out, int n, Id id, int rank, bool blocking) {
    *out = nullptr;
    if (n < 1 || rank < 0 || rank >= n) return INVALID_ARGUMENT;
    std::string key(id.bytes, strnlen(id.bytes, 128));
    if (key.rfind("emulated-nccl-", 0) != 0) return INVALID_ARGUMENT;
    const char* lost = getenv("MANTISSA_EMU_NCCL_LOST_RANK");
    if (lost && atoi(lost) == rank) return SYSTEM_ERROR;
    std::unique_lock<std::mutex> g(mu);
    auto& c = cliques[key];
    if (!c) c = std::make_shared<Clique>(Clique{n});
    if (c->n != n) return INVALID_USAGE;
    std::shared_ptr<Clique> clique = c;
    clique->joined++;
    cv.notify_all();
    auto ready = [&] { return clique->joined >= clique->n; };
    if (blocking) {
        auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s());
        if (!cv.wait_until(g, until, ready)) {
            clique->joined--;
            return SYSTEM_ERROR;
        }
    }
    *out = new Comm{std::make_shared<State>(State{clique, rank})};
    return ready() ? SUCCESS : IN_PROGRESS;
}
API int ncclCommInitRank(Comm** out, int n, Id id, int rank) { return init(out, n, id, rank, true); }
API int ncclCommInitRankConfig(Comm** out, int n, Id id, int rank, Config* cfg) {
    bool blocking = true;
    if (cfg) {
        if (cfg->size < sizeof(Config) || cfg->magic != 0xcafebeef) {
            fprintf(stderr, "emulated ncclCommInitRankConfig: a config not made as NCCL_CONFIG_INITIALIZER makes it\n");
            return INVALID_ARGUMENT;
        }
        if (cfg->version >= 21400 && cfg->blocking != INT_MIN) blocking = cfg->blocking != 0;
    }
    return init(out, n, id, rank, blocking);
}
// Local, as NCCL's: the peers are not told. The communicator's queued work ends unwritten.
API int ncclCommAbort(Comm* c) {
    if (!c) return SUCCESS;
    {
        std::lock_guard<std::mutex> g(mu);
        c->s->aborted = true;
    }
    delete c;
    return SUCCESS;
}
// Waits for the communicator's queued collectives (the stream runs them), then frees it; a
// collective whose peers never come keeps it waiting, as NCCL's does.
API int ncclCommDestroy(Comm* c) {
    if (!c) return SUCCESS;
    void* stream = nullptr;
    {
        std::lock_guard<std::mutex> g(mu);
        if (c->s->inflight > 0) stream = c->s->stream;
    }
    if (stream) stream_sync()(stream);
    {
        std::lock_guard<std::mutex> g(mu);
        c->s->aborted = true;
    }
    delete c;
    return SUCCESS;
}
API int ncclCommFinalize(Comm* c) {
    if (!c) return INVALID_ARGUMENT;
    std::lock_guard<std::mutex> g(mu);
    return c->s->inflight > 0 ? IN_PROGRESS : SUCCESS;
}
API int ncclCommGetAsyncError(Comm* c, int* err) {
    if (!c || !err) return INVALID_ARGUMENT;
    std::lock_guard<std::mutex> g(mu);
    const Clique& q = *c->s->clique;
    *err = q.misused ? INVALID_USAGE : q.joined < q.n ? IN_PROGRESS : SUCCESS;
    return SUCCESS;
}

// One rank's part of a collective: see the top of the file.
static int collective(int kind, const void* send, void* recv, size_t count, int dtype, int op,
                      int root, Comm* c, void* stream) {
    size_t es = elem_size(dtype);
    if (!c || es == 0 || op < 0 || op > 4) return INVALID_ARGUMENT;
    std::shared_ptr<State> st = c->s;
    uint64_t seq;
    {
        std::lock_guard<std::mutex> g(mu);
        const Clique& q = *st->clique;
        if (q.joined < q.n) {
            fprintf(stderr, "emulated NCCL: a collective on a communicator that is still joining "
                            "(poll ncclCommGetAsyncError until ncclSuccess first)\n");
            return INVALID_USAGE;
        }
        if (q.misused) return INVALID_USAGE;
        seq = st->seq++;
        st->inflight++;
        st->stream = stream;
    }
    later_waiting(stream, [=, deposited = false]() mutable {
        std::lock_guard<std::mutex> g(mu);
        Clique& q = *st->clique;
        int n = q.n;
        auto finish = [&] { return st->inflight--, true; };
        if (st->aborted || q.misused) return finish();
        if (!deposited) {
            // The stream's earlier work has run: the send buffer holds what its order says.
            size_t in = kind == REDUCE_SCATTER ? count * n : count;
            std::vector<double> mine(in);
            for (size_t i = 0; i < in; i++) mine[i] = get(send, dtype, i);
            auto [it, fresh] = q.rounds.try_emplace(seq);
            Round& r = it->second;
            if (fresh) {
                r.kind = kind, r.dtype = dtype, r.op = op, r.root = root, r.count = count;
                r.data.resize(n);
            } else if (r.kind != kind || r.dtype != dtype || r.op != op || r.root != root ||
                       r.count != count) {
                fprintf(stderr, "emulated NCCL: ranks called different collectives in round %llu\n",
                        (unsigned long long)seq);
                q.misused = true;
                return finish();
            }
            r.data[st->rank] = std::move(mine);
            r.arrived++;
            deposited = true;
        }
        auto it = q.rounds.find(seq);
        Round& r = it->second;
        if (r.arrived < n) return false; // waits for the other ranks
        size_t out = kind == ALL_GATHER ? count * n : count;
        auto reduce = [&](size_t i) {
            double v = r.data[0][i];
            for (int k = 1; k < n; k++) {
                double w = r.data[k][i];
                v = op == 1 ? v * w : op == 2 ? std::max(v, w) : op == 3 ? std::min(v, w) : v + w;
            }
            return op == 4 ? v / n : v;
        };
        for (size_t i = 0; i < out; i++) {
            double v;
            switch (kind) {
            case ALL_REDUCE: v = reduce(i); break;
            case BROADCAST: v = r.data[root][i]; break;
            case ALL_GATHER: v = r.data[i / count][i % count]; break;
            default: v = reduce(st->rank * count + i);
            }
            put(recv, dtype, i, v);
        }
        if (++r.taken == n) q.rounds.erase(it);
        return finish();
    });
    return SUCCESS;
}

API int ncclAllReduce(const void* s, void* r, size_t n, int t, int op, Comm* c, void* st) {
    return collective(ALL_REDUCE, s, r, n, t, op, 0, c, st);
}
API int ncclBroadcast(const void* s, void* r, size_t n, int t, int root, Comm* c, void* st) {
    if (!c || root < 0 || root >= c->s->clique->n) return INVALID_ARGUMENT;
    return collective(BROADCAST, s, r, n, t, 0, root, c, st);
}
API int ncclAllGather(const void* s, void* r, size_t n, int t, Comm* c, void* st) {
    return collective(ALL_GATHER, s, r, n, t, 0, 0, c, st);
}
API int ncclReduceScatter(const void* s, void* r, size_t n, int t, int op, Comm* c, void* st) {
    return collective(REDUCE_SCATTER, s, r, n, t, op, 0, c, st);
}
