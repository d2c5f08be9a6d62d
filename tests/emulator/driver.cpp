// An emulated CUDA driver (libcuda.so.1) for running the CUDA backend's host side on a machine
// without a GPU: device memory is host memory, streams run their queued work lazily (see
// "Streams" below), and a kernel launch runs the kernel file built for the host by the
// emulated NVRTC (nvrtc.cpp: the same source with host_shim.h, plus per-kernel
// trampolines). What it checks: the launchers' argument lists, views, offsets and sizes, the
// caching allocator, copies, fault flags, out-of-memory paths, and that the host waits for
// the work whose results it reads. What it cannot: speed, the GPU's memory model, work of two
// streams running at once. cuBLAS(Lt) and cuDNN are emulated apart (blas.cpp, dnn.cpp) and
// queue their work here (emu_enqueue). Stream capture and graph replay are in graph.inc.
//
// MANTISSA_EMU_DEVICES devices (default one), reported as compute capability 9.0 with 132 SMs. MANTISSA_EMU_MEM_BYTES caps
// device memory (default 8 GiB) so that out-of-memory paths can be reached.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <dlfcn.h>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void* CUcontext;
typedef void* CUstream;
typedef void* CUmodule;
typedef void* CUevent;

enum {
    OK = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    NOT_INITIALIZED = 3,
    INVALID_DEVICE = 101,
    INVALID_HANDLE = 400,
    NOT_FOUND = 500,
    NOT_READY = 600,
    NOT_SUPPORTED = 801,
    ILLEGAL_STATE = 401,
    CAPTURE_UNSUPPORTED = 900,
    CAPTURE_INVALIDATED = 901,
    CAPTURE_ISOLATION = 905,
    CAPTURE_IMPLICIT = 906,
};

static std::mutex mu;
static std::map<uintptr_t, size_t> blocks; // device allocations: address -> size
static size_t used = 0;
static size_t budget() {
    const char* v = getenv("MANTISSA_EMU_MEM_BYTES");
    return v ? strtoull(v, nullptr, 10) : (8ull << 30);
}

#define API extern "C" __attribute__((visibility("default")))
typedef std::chrono::steady_clock Clock;

API CUresult cuInit(unsigned) { return OK; }
API CUresult cuDriverGetVersion(int* v) {
#ifdef EMU_CUDA12
    *v = 12080;
#else
    *v = 13000;
#endif
    return OK;
}
// MANTISSA_EMU_DEVICES devices (default 1, at most 16), alike; their memory is one pool.
static int device_count() {
    const char* v = getenv("MANTISSA_EMU_DEVICES");
    int n = v ? atoi(v) : 1;
    return n < 1 ? 1 : n > 16 ? 16 : n;
}
API CUresult cuDeviceGetCount(int* n) {
    *n = device_count();
    return OK;
}
API CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    if (ordinal < 0 || ordinal >= device_count()) return INVALID_DEVICE;
    *d = ordinal;
    return OK;
}
API CUresult cuDeviceGetName(char* name, int len, CUdevice) {
    snprintf(name, len, "mantissa emulated GPU (host)");
    return OK;
}
API CUresult cuDeviceGetUuid(char* uuid, CUdevice) {
    memset(uuid, 7, 16);
    return OK;
}
API CUresult cuDeviceGetUuid_v2(char* uuid, CUdevice d) { return cuDeviceGetUuid(uuid, d); }
API CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice) {
    *bytes = budget();
    return OK;
}
API CUresult cuMemGetInfo_v2(size_t* free_, size_t* total) {
    std::lock_guard<std::mutex> g(mu);
    *total = budget();
    *free_ = *total > used ? *total - used : 0;
    return OK;
}
API CUresult cuDeviceGetAttribute(int* v, int attr, CUdevice) {
    switch (attr) {
    case 1: *v = 1024; break;            // max threads per block
    case 2: *v = 1024; break;            // max block dim x
    case 5: *v = 2147483647; break;      // max grid dim x
    case 8: *v = 49152; break;           // shared memory per block
    case 10: *v = 32; break;             // warp size
    case 16: *v = 132; break;            // SMs
    case 36: *v = 2619000; break;        // memory clock (kHz)
    case 37: *v = 5120; break;           // memory bus width
    case 75: *v = 9; break;              // compute capability
    case 76: *v = 0; break;
    case 97: *v = 232448; break;         // shared memory per block, opt-in
    case 115: *v = 0; break;             // memory pools: no (plain cuMemAlloc)
    default: *v = 0;
    }
    return OK;
}
// One primary context per device; each thread has its current one (device 0's until set).
static int ctx_tokens[16];
static thread_local CUcontext current = nullptr;
static CUcontext cur() { return current ? current : &ctx_tokens[0]; }
API CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
    if (d < 0 || d >= device_count()) return INVALID_DEVICE;
    *c = &ctx_tokens[d];
    return OK;
}
API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { return OK; }
API CUresult cuCtxSetCurrent(CUcontext c) {
    current = c;
    return OK;
}
API CUresult cuCtxGetCurrent(CUcontext* c) {
    *c = cur();
    return OK;
}
API CUresult cuCtxGetDevice(CUdevice* d) {
    *d = (int)((int*)cur() - ctx_tokens);
    return OK;
}
API CUresult cuCtxPushCurrent_v2(CUcontext c) {
    current = c;
    return OK;
}
API CUresult cuCtxPopCurrent_v2(CUcontext* c) {
    if (c) *c = cur();
    return OK;
}
API CUresult cuCtxSetFlags(unsigned) { return OK; }
API CUresult cuCtxGetFlags(unsigned* f) {
    *f = 0;
    return OK;
}

// Streams run lazily, as a GPU may: work is queued, and runs only when the host waits for it
// (a stream, event or context synchronisation, an event or stream query, a synchronous
// copy, a free) or another stream waits on an event after it. So a host read without the
// wait it needs sees device memory as it was, and a copy from pinned memory reads the
// buffer when it runs, not when it was queued. The streams cudarc makes are non-blocking:
// they do not wait for the legacy stream's synchronous copies, nor those for them.
// MANTISSA_EMU_STREAMS=others-first: when the host waits for a stream, the other streams'
// queued work runs first (as far as its own waits allow), so that work the host did not
// order after the stream runs before it; the default runs only what the wait needs, so that
// work the host did not order before it has not run yet.
struct Graph;
// A piece of queued work: true once it has run, false while it waits for another device's
// work (an emulated collective whose peers have not come): it then stays at the front of its
// queue, as a GPU kernel that spins, and is tried again at the next wait.
typedef std::function<bool()> Work;
struct Stream {
    std::deque<Work> q;
    bool blocking; // synchronises with the legacy stream (not CU_STREAM_NON_BLOCKING)
    Graph* capture = nullptr; // while a capture records this stream's work (see "Graphs")
};
// One event record: done once the work queued before it has run.
struct Marker {
    bool done = false;
    Clock::time_point at;
};
struct Event {
    Stream* stream = nullptr; // of the latest record
    std::shared_ptr<Marker> last;
    Graph* captured = nullptr; // the capture its latest record went into, if any
};
// Every queue, and running queued work, under one lock (recursive: queued work calls back
// in). A host wait for work that cannot run yet lets go of it between tries (yield_run_lock),
// so that the threads of the other devices queue and run the work it waits for.
static std::recursive_mutex run_mu;
static thread_local int run_depth = 0; // how many times this thread holds run_mu
struct RunLock {
    RunLock() { run_mu.lock(), run_depth++; }
    ~RunLock() { run_depth--, run_mu.unlock(); }
};
static void yield_run_lock() {
    int d = run_depth;
    for (int i = 0; i < d; i++) run_mu.unlock();
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    for (int i = 0; i < d; i++) run_mu.lock();
}
// MANTISSA_EMU_TRACE=1: launches (as they are queued), host waits and event queries on stderr.
static bool trace() {
    static bool on = getenv("MANTISSA_EMU_TRACE") != nullptr;
    return on;
}
static Stream legacy{{}, true, nullptr};
static std::set<Stream*> streams = {&legacy};

static Stream* S(CUstream s) { // 0, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD: the legacy stream
    return (uintptr_t)s <= 2 ? &legacy : (Stream*)s;
}
// Runs the front of `s`'s queue: true when it ran (and left the queue), false when it waits.
static bool run_front(Stream* s) {
    auto f = std::move(s->q.front());
    s->q.pop_front();
    if (f()) return true;
    s->q.push_front(std::move(f));
    return false;
}
// Runs `s`'s queue as far as it can: true when it is empty.
static bool drain(Stream* s) {
    while (!s->q.empty()) {
        if (!run_front(s)) return false;
    }
    return true;
}
static bool drain_all() {
    for (bool progress = true; progress;) {
        progress = false;
        for (Stream* s : streams) {
            size_t before = s->q.size();
            drain(s);
            if (s->q.size() != before) progress = true;
        }
    }
    for (Stream* s : streams) {
        if (!s->q.empty()) return false;
    }
    return true;
}
// The host waits until `step` (which runs queued work and says whether the wait is over)
// succeeds, letting the other threads at the queues between tries. A GPU would wait forever
// for a collective whose peers never come; here, past MANTISSA_EMU_HANG_S (default 120 s),
// the process stops with a message instead of hanging the test run.
template <typename F> static void host_loop(const char* what, F step) {
    static double limit = [] {
        const char* v = getenv("MANTISSA_EMU_HANG_S");
        return v ? atof(v) : 120.0;
    }();
    auto start = Clock::now();
    while (!step()) {
        yield_run_lock();
        if (std::chrono::duration<double>(Clock::now() - start).count() > limit) {
            fprintf(stderr, "emulated driver: %s waited %g s for work that cannot run (a collective "
                            "whose peers never came?): the GPU would hang here\n", what, limit);
            abort();
        }
    }
}
// Before work on the legacy stream: the blocking streams' queued work (and the reverse is
// left out: the backend's streams are non-blocking).
static void legacy_waits() {
    for (Stream* s : streams) {
        if (s->blocking) host_loop("the legacy stream", [s] { return drain(s); });
    }
}
// The host waits for `s` (up to the record `m`, when given).
static void host_waits(Stream* s, const std::shared_ptr<Marker>& m = nullptr) {
    if (trace()) fprintf(stderr, "host waits for stream %p (%zu queued)%s\n", (void*)s, s->q.size(), m ? " up to an event" : "");
    static bool others_first = [] {
        const char* v = getenv("MANTISSA_EMU_STREAMS");
        return v && strcmp(v, "others-first") == 0;
    }();
    if (others_first) {
        for (Stream* o : streams) {
            if (o != s) drain(o);
        }
    }
    if (s == &legacy) legacy_waits();
    host_loop("a host wait", [&] {
        if (!m) return drain(s);
        while (!m->done) {
            if (!run_front(s)) return false;
        }
        return true;
    });
}
static void record(Graph* g, Work f);
static void enqueue_work(CUstream s, Work f) {
    RunLock g;
    Stream* st = S(s);
    if (st->capture) {
        record(st->capture, std::move(f));
        return;
    }
    if (st == &legacy) {
        legacy_waits();
        host_loop("a synchronous call", f);
        return;
    }
    st->q.push_back(std::move(f));
}
// Work that always runs when its turn comes.
static void enqueue(CUstream s, std::function<void()> f) {
    enqueue_work(s, [f = std::move(f)] { return f(), true; });
}
// For the emulated cuBLAS and cuDNN: queue run(ctx) on stream s; drop(ctx) once no queue or
// graph holds it any more (a captured call runs at every replay).
API int emu_enqueue(CUstream s, void (*run)(void*), void* ctx, void (*drop)(void*)) {
    std::shared_ptr<void> held(ctx, drop);
    enqueue(s, [run, held] { run(held.get()); });
    return 0;
}
// For the emulated NCCL: queue try_run(ctx) on stream s, which returns nonzero once it has
// run and 0 while it waits for the other ranks (it is tried again at the next wait, as a
// collective kernel spins on the GPU); drop(ctx) as above.
API int emu_enqueue_waiting(CUstream s, int (*try_run)(void*), void* ctx, void (*drop)(void*)) {
    std::shared_ptr<void> held(ctx, drop);
    enqueue_work(s, [try_run, held] { return try_run(held.get()) != 0; });
    return 0;
}
// Runs now, after the legacy stream's queued work: a synchronous call.
static void now(std::function<void()> f) { enqueue(nullptr, std::move(f)); }

#include "graph.inc" // Graphs: stream capture and replay

API CUresult cuCtxSynchronize() {
    RunLock g;
    if (!capturing.empty()) {
        invalidate("cuCtxSynchronize");
        return CAPTURE_UNSUPPORTED;
    }
    host_loop("cuCtxSynchronize", drain_all);
    return OK;
}
API CUresult cuStreamCreate(CUstream* s, unsigned flags) {
    RunLock g;
    Stream* st = new Stream{{}, (flags & 1) == 0};
    streams.insert(st);
    *s = st;
    return OK;
}
API CUresult cuStreamCreateWithPriority(CUstream* s, unsigned f, int) { return cuStreamCreate(s, f); }
API CUresult cuCtxGetStreamPriorityRange(int* lo, int* hi) {
    *lo = 0;
    *hi = -5;
    return OK;
}
API CUresult cuStreamDestroy_v2(CUstream s) { // its queued work still runs
    RunLock g;
    Stream* st = S(s);
    if (st == &legacy) return INVALID_HANDLE;
    if (st->capture) return ILLEGAL_STATE;
    host_loop("cuStreamDestroy", [st] { return drain(st); });
    streams.erase(st);
    delete st;
    return OK;
}
API CUresult cuStreamSynchronize(CUstream s) {
    RunLock g;
    if (CUresult r = on_captured(S(s), "cuStreamSynchronize")) return r;
    host_waits(S(s));
    return OK;
}
// Not ready while work is queued; each query runs one piece, so that polling ends.
API CUresult cuStreamQuery(CUstream s) {
    RunLock g;
    Stream* st = S(s);
    if (CUresult r = on_captured(st, "cuStreamQuery")) return r;
    if (st->q.empty()) return OK;
    run_front(st);
    return st->q.empty() ? OK : NOT_READY;
}

API CUresult cuEventCreate(CUevent* e, unsigned) {
    *e = new Event;
    return OK;
}
API CUresult cuEventDestroy_v2(CUevent e) { // a queued record still completes
    RunLock g;
    delete (Event*)e;
    return OK;
}
API CUresult cuEventRecord(CUevent e, CUstream s) {
    RunLock g;
    Event* ev = (Event*)e;
    auto m = std::make_shared<Marker>();
    ev->stream = S(s);
    ev->last = m;
    ev->captured = S(s)->capture;
    enqueue(s, [m] {
        m->at = Clock::now();
        m->done = true;
    });
    return OK;
}
API CUresult cuEventRecordWithFlags(CUevent e, CUstream s, unsigned) { return cuEventRecord(e, s); }
// Runs `st`'s queue up to the record `m` (already run when the stream is gone): false while
// the work before it waits.
static bool reach(Stream* st, const std::shared_ptr<Marker>& m) {
    while (m && !m->done) {
        if (!run_front(st)) return false;
    }
    return true;
}
API CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned) {
    RunLock g;
    Event* ev = (Event*)e;
    if (!ev->last) return OK; // never recorded: nothing to wait for
    Stream* waiter = S(s);
    if (waiter->capture && ev->captured != waiter->capture) {
        invalidate("a wait on an event recorded outside the capture");
        return CAPTURE_ISOLATION;
    }
    if (!waiter->capture && ev->captured && capturing.count(ev->captured)) {
        invalidate("a wait joining another stream to the capture (one stream per capture here)");
        return CAPTURE_UNSUPPORTED;
    }
    Stream* from = ev->stream;
    auto m = ev->last;
    enqueue_work(s, [from, m] { return reach(from, m); });
    return OK;
}
API CUresult cuEventSynchronize(CUevent e) {
    RunLock g;
    Event* ev = (Event*)e;
    if (ev->captured && capturing.count(ev->captured)) {
        invalidate("cuEventSynchronize on a captured event");
        return CAPTURE_UNSUPPORTED;
    }
    if (ev->last) host_waits(ev->stream, ev->last);
    return OK;
}
API CUresult cuEventQuery(CUevent e) {
    RunLock g;
    Event* ev = (Event*)e;
    if (ev->captured && capturing.count(ev->captured)) {
        invalidate("cuEventQuery on a captured event");
        return CAPTURE_UNSUPPORTED;
    }
    if (trace()) fprintf(stderr, "query event %p: %s, %zu queued\n", e, !ev->last ? "unrecorded" : ev->last->done ? "done" : "pending", ev->stream ? ev->stream->q.size() : 0);
    if (!ev->last || ev->last->done) return OK;
    run_front(ev->stream);
    return ev->last->done ? OK : NOT_READY;
}
API CUresult cuEventElapsedTime(float* ms, CUevent a, CUevent b) {
    RunLock g;
    auto ma = ((Event*)a)->last, mb = ((Event*)b)->last;
    if (!ma || !mb) return INVALID_HANDLE;
    if (!ma->done || !mb->done) return NOT_READY;
    *ms = std::chrono::duration<float, std::milli>(mb->at - ma->at).count();
    return OK;
}
API CUresult cuEventElapsedTime_v2(float* ms, CUevent a, CUevent b) { return cuEventElapsedTime(ms, a, b); }

// Memory: 256-byte aligned host blocks, counted against the budget in whole 256 bytes.
static size_t counted(size_t bytes) { return bytes == 0 ? 256 : (bytes + 255) / 256 * 256; }
API CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) {
    if (CUresult r = unsafe_call("cuMemAlloc")) return r;
    std::lock_guard<std::mutex> g(mu);
    size_t size = counted(bytes);
    if (used + size > budget()) return OUT_OF_MEMORY;
    // The bytes asked for, to a whole 4, so that a sanitizer run (run.sh) sees an access past
    // them; a half's atomic add (a CAS of the 32-bit word that holds it) may touch the 2 bytes
    // after the last, which the GPU's 256-byte granules allow.
    size_t exact = (bytes + 3) / 4 * 4;
    void* q = nullptr;
    if (posix_memalign(&q, 256, exact ? exact : 4) != 0) return OUT_OF_MEMORY;
    // Fresh device memory is not zero: fill it with a NaN pattern, so that a kernel that reads
    // what it never wrote shows.
    memset(q, 0xFF, exact);
    blocks[(uintptr_t)q] = bytes;
    used += size;
    *p = (CUdeviceptr)q;
    return OK;
}
API CUresult cuMemAllocAsync(CUdeviceptr* p, size_t bytes, CUstream) { return cuMemAlloc_v2(p, bytes); }
// Gives a block back (after the work that may use it, which the callers see to).
static CUresult release(CUdeviceptr p) {
    std::lock_guard<std::mutex> g(mu);
    auto it = blocks.find((uintptr_t)p);
    if (it == blocks.end()) {
        fprintf(stderr, "emulated cuMemFree: %llx is not an allocation\n", p);
        return INVALID_VALUE;
    }
    used -= counted(it->second);
    blocks.erase(it);
    free((void*)p);
    return OK;
}
API CUresult cuMemFree_v2(CUdeviceptr p) { // waits for all queued work, as the GPU's does
    RunLock g;
    if (!capturing.empty()) { // memory a graph may use is never freed under its capture
        invalidate("cuMemFree");
        return CAPTURE_UNSUPPORTED;
    }
    host_loop("cuMemFree", drain_all);
    return release(p);
}
API CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) {
    RunLock g;
    if (S(s)->capture) { // not a graph allocation: a free node cannot take it
        invalidate("cuMemFreeAsync of memory not allocated in the graph");
        return INVALID_VALUE;
    }
    Stream* st = S(s);
    host_loop("cuMemFreeAsync", [st] { return drain(st); });
    return release(p);
}

// A copy or fill must stay inside one allocation (device side), as on the GPU.
static bool inside(CUdeviceptr p, size_t bytes, const char* what) {
    std::lock_guard<std::mutex> g(mu);
    auto it = blocks.upper_bound((uintptr_t)p);
    if (it != blocks.begin()) {
        --it;
        if ((uintptr_t)p >= it->first && (uintptr_t)p + bytes <= it->first + it->second) return true;
    }
    fprintf(stderr, "emulated %s: [%llx, +%zu) is outside every allocation\n", what, p, bytes);
    return false;
}
// Pinned host memory (cuMemHostAlloc): address -> size.
static std::map<uintptr_t, size_t> pinned;
static bool is_pinned(const void* h, size_t n) {
    std::lock_guard<std::mutex> g(mu);
    auto it = pinned.upper_bound((uintptr_t)h);
    if (it == pinned.begin()) return false;
    --it;
    return (uintptr_t)h >= it->first && (uintptr_t)h + n <= it->first + it->second;
}

API CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void* h, size_t n) {
    if (CUresult r = unsafe_call("cuMemcpyHtoD")) return r;
    if (!inside(d, n, "cuMemcpyHtoD")) return INVALID_VALUE;
    now([=] { memcpy((void*)d, h, n); });
    return OK;
}
// From pinned memory the copy reads the buffer when it runs; from pageable memory the driver
// stages it first, so the buffer is free again on return.
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* h, size_t n, CUstream s) {
    if (!inside(d, n, "cuMemcpyHtoDAsync")) return INVALID_VALUE;
    if (S(s)->capture && !is_pinned(h, n)) {
        RunLock g;
        invalidate("a copy from pageable host memory into a captured stream");
        return CAPTURE_UNSUPPORTED;
    }
    if (is_pinned(h, n)) {
        enqueue(s, [=] { memcpy((void*)d, h, n); });
    } else {
        auto staged = std::make_shared<std::vector<char>>((const char*)h, (const char*)h + n);
        enqueue(s, [=] { memcpy((void*)d, staged->data(), n); });
    }
    return OK;
}
API CUresult cuMemcpyDtoH_v2(void* h, CUdeviceptr d, size_t n) {
    if (CUresult r = unsafe_call("cuMemcpyDtoH")) return r;
    if (!inside(d, n, "cuMemcpyDtoH")) return INVALID_VALUE;
    now([=] { memcpy(h, (void*)d, n); });
    return OK;
}
// Into pinned memory the copy lands when it runs; into pageable memory the call returns once
// it has (after the stream's earlier work).
API CUresult cuMemcpyDtoHAsync_v2(void* h, CUdeviceptr d, size_t n, CUstream s) {
    if (!inside(d, n, "cuMemcpyDtoHAsync")) return INVALID_VALUE;
    RunLock g;
    if (!is_pinned(h, n)) {
        if (CUresult r = on_captured(S(s), "a copy into pageable host memory (the host waits for it)")) return r;
    }
    enqueue(s, [=] { memcpy(h, (void*)d, n); });
    if (!is_pinned(h, n)) host_waits(S(s));
    return OK;
}
API CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr src, size_t n) {
    if (CUresult r = unsafe_call("cuMemcpyDtoD")) return r;
    if (!inside(d, n, "cuMemcpyDtoD (dst)") || !inside(src, n, "cuMemcpyDtoD (src)")) return INVALID_VALUE;
    now([=] { memmove((void*)d, (void*)src, n); });
    return OK;
}
API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr src, size_t n, CUstream s) {
    if (!inside(d, n, "cuMemcpyDtoDAsync (dst)") || !inside(src, n, "cuMemcpyDtoDAsync (src)"))
        return INVALID_VALUE;
    enqueue(s, [=] { memmove((void*)d, (void*)src, n); });
    return OK;
}
// Fills of 1, 2 or 4 bytes.
template <typename T> static CUresult fill(CUdeviceptr d, T v, size_t n, CUstream s, bool sync, const char* what) {
    if (sync) {
        if (CUresult r = unsafe_call(what)) return r;
    }
    if (!inside(d, sizeof(T) * n, what)) return INVALID_VALUE;
    auto run = [=] {
        for (size_t i = 0; i < n; i++) ((T*)d)[i] = v;
    };
    sync ? now(run) : enqueue(s, run);
    return OK;
}
API CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { return fill(d, v, n, nullptr, true, "cuMemsetD8"); }
API CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream s) {
    return fill(d, v, n, s, false, "cuMemsetD8Async");
}
API CUresult cuMemsetD16Async(CUdeviceptr d, unsigned short v, size_t n, CUstream s) {
    return fill(d, v, n, s, false, "cuMemsetD16Async");
}
API CUresult cuMemsetD32Async(CUdeviceptr d, unsigned v, size_t n, CUstream s) {
    return fill(d, v, n, s, false, "cuMemsetD32Async");
}
// `height` rows of `width` 4-byte words, `pitch` bytes apart.
API CUresult cuMemsetD2D32Async(CUdeviceptr d, size_t pitch, unsigned v, size_t width, size_t height, CUstream s) {
    if (height == 0 || width == 0) return OK;
    if (pitch < 4 * width || !inside(d, pitch * (height - 1) + 4 * width, "cuMemsetD2D32Async")) return INVALID_VALUE;
    enqueue(s, [=] {
        for (size_t r = 0; r < height; r++) {
            for (size_t c = 0; c < width; c++) ((unsigned*)(d + r * pitch))[c] = v;
        }
    });
    return OK;
}
API CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned) {
    if (CUresult r = unsafe_call("cuMemHostAlloc")) return r;
    size_t size = (bytes + 4095) / 4096 * 4096;
    *p = aligned_alloc(4096, size ? size : 4096);
    if (!*p) return OUT_OF_MEMORY;
    std::lock_guard<std::mutex> g(mu);
    pinned[(uintptr_t)*p] = size;
    return OK;
}
API CUresult cuMemAllocHost_v2(void** p, size_t bytes) { return cuMemHostAlloc(p, bytes, 0); }
API CUresult cuMemFreeHost(void* p) { // waits for all queued work, as the GPU's does
    RunLock g;
    if (!capturing.empty()) {
        invalidate("cuMemFreeHost");
        return CAPTURE_UNSUPPORTED;
    }
    host_loop("cuMemFreeHost", drain_all);
    std::lock_guard<std::mutex> m(mu);
    if (pinned.erase((uintptr_t)p) == 0) return INVALID_VALUE;
    free(p);
    return OK;
}

// Modules: the "cubin" is the path of the host library the emulated NVRTC built.
struct Module {
    void* lib;
};
struct Function {
    void* (*bind)(void**);  // a copy of the launch's arguments
    void (*run)(void*);     // one thread's call with them
    void (*release)(void*); // frees the copy
    int (*run_grid)(unsigned, unsigned, void (*)(void*), void*);
    void (*thread)(unsigned, unsigned, unsigned, unsigned);
    bool cooperative; // it reaches barriers, shuffles or CAS: a block's threads take turns
    std::string name;
    size_t param_bytes; // its parameter buffer
};
// Loading a module while a capture is open is refused, as the driver refuses it (it may
// synchronise and allocate device memory for the module).
API CUresult cuModuleLoadData(CUmodule* m, const void* image) {
    if (CUresult r = unsafe_call("cuModuleLoadData")) return r;
    void* lib = dlopen((const char*)image, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "emulated cuModuleLoadData: %s\n", dlerror());
        return INVALID_VALUE;
    }
    *m = new Module{lib};
    return OK;
}
API CUresult cuModuleUnload(CUmodule) { return OK; } // launched functions may still be held
API CUresult cuModuleGetFunction(void** f, CUmodule m, const char* name) {
    void* lib = ((Module*)m)->lib;
    auto sym = [&](const char* suffix) { return dlsym(lib, (std::string(name) + suffix).c_str()); };
    void *bind = sym("__bind"), *run = sym("__run"), *release = sym("__release");
    if (!bind || !run || !release) return NOT_FOUND;
    auto coop = (int*)sym("__cooperative");
    auto param_bytes = (size_t*)sym("__param_bytes");
    *f = new Function{(void* (*)(void**))bind,
                      (void (*)(void*))run,
                      (void (*)(void*))release,
                      (int (*)(unsigned, unsigned, void (*)(void*), void*))dlsym(lib, "host_run_grid"),
                      (void (*)(unsigned, unsigned, unsigned, unsigned))dlsym(lib, "host_thread"),
                      coop && *coop != 0,
                      name,
                      param_bytes ? *param_bytes : 0};
    return OK;
}
API CUresult cuFuncGetAttribute(int* v, int, void*) {
    *v = 0;
    return OK;
}
API CUresult cuFuncSetAttribute(void*, int, int) { return OK; }

API CUresult cuLaunchKernel(void* fp, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                            unsigned bz, unsigned, CUstream s, void** params, void** extra) {
    if (gy != 1 || gz != 1 || by != 1 || bz != 1 || extra != nullptr || bx == 0 || gx == 0 || bx > 1024) {
        fprintf(stderr, "emulated cuLaunchKernel: unsupported grid (%u,%u,%u) block (%u,%u,%u)\n", gx, gy,
                gz, bx, by, bz);
        return INVALID_VALUE;
    }
    Function* f = (Function*)fp;
    // The 4 KB of kernel parameters every CUDA version and GPU takes (larger lists need
    // CUDA 12.1 and Volta or later, up to 32 KB).
    if (f->param_bytes > 4096) {
        fprintf(stderr, "emulated cuLaunchKernel: %s takes %zu bytes of parameters, past the 4096 a launch may pass\n",
                f->name.c_str(), f->param_bytes);
        return INVALID_VALUE;
    }
    if (trace()) fprintf(stderr, "launch %s grid %u block %u%s\n", f->name.c_str(), gx, bx, f->cooperative ? " (cooperative)" : "");
    // The arguments are copied now, as the driver does; the grid runs when the stream does.
    std::shared_ptr<void> held(f->bind(params), f->release);
    enqueue(s, [f, held, gx, bx] {
        void* args = held.get();
        if (!f->cooperative) {
            for (unsigned b = 0; b < gx; b++) {
                for (unsigned t = 0; t < bx; t++) {
                    f->thread(b, t, bx, gx);
                    f->run(args);
                }
            }
        } else {
            // The others: a block at a time, its threads as fibers (host_shim.h).
            struct Call {
                Function* f;
                void* args;
            } call{f, args};
            auto body = [](void* c) { ((Call*)c)->f->run(((Call*)c)->args); };
            if (f->run_grid(gx, bx, body, &call) != 0) {
                fprintf(stderr, "emulated cuLaunchKernel: no stacks for %u fibers\n", bx);
                abort();
            }
        }
    });
    return OK;
}

API CUresult cuGetErrorString(CUresult e, const char** s) {
    static char buf[64];
    snprintf(buf, sizeof buf, "emulated CUDA error %d", e);
    *s = buf;
    return OK;
}
API CUresult cuGetErrorName(CUresult e, const char** s) { return cuGetErrorString(e, s); }
