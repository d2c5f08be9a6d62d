// An emulated CUDA driver (libcuda.so.1) for running the CUDA backend's host side on a machine
// without a GPU: device memory is host memory, every call is synchronous (streams and events
// order nothing), and a kernel launch runs the kernel file built for the host by the emulated
// NVRTC (nvrtc.cpp: the same source with cuda/host_shim.h, plus a `NAME__launch(void**)`
// trampoline per kernel). What it checks: the launchers' argument lists, views, offsets and
// sizes, the caching allocator, copies, fault flags, out-of-memory paths. What it cannot:
// speed, the GPU's memory model, stream ordering, cuBLAS and cuDNN (not emulated).
//
// One device, reported as compute capability 9.0 with 132 SMs. MANTISSA_EMU_MEM_BYTES caps
// device memory (default 8 GiB) so that out-of-memory paths can be reached.

#include <barrier>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <map>
#include <mutex>
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
    NOT_SUPPORTED = 801,
};

static std::mutex mu;
static std::map<uintptr_t, size_t> blocks; // device allocations: address -> size
static size_t used = 0;
static size_t budget() {
    const char* v = getenv("MANTISSA_EMU_MEM_BYTES");
    return v ? strtoull(v, nullptr, 10) : (8ull << 30);
}
static int ctx_token;

#define API extern "C" __attribute__((visibility("default")))

API CUresult cuInit(unsigned) { return OK; }
API CUresult cuDriverGetVersion(int* v) {
#ifdef EMU_CUDA12
    *v = 12080;
#else
    *v = 13000;
#endif
    return OK;
}
API CUresult cuDeviceGetCount(int* n) {
    *n = 1;
    return OK;
}
API CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    if (ordinal != 0) return INVALID_DEVICE;
    *d = 0;
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
API CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice) {
    *c = &ctx_token;
    return OK;
}
API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { return OK; }
API CUresult cuCtxSetCurrent(CUcontext) { return OK; }
API CUresult cuCtxGetCurrent(CUcontext* c) {
    *c = &ctx_token;
    return OK;
}
API CUresult cuCtxGetDevice(CUdevice* d) {
    *d = 0;
    return OK;
}
API CUresult cuCtxSynchronize() { return OK; }
API CUresult cuCtxPushCurrent_v2(CUcontext) { return OK; }
API CUresult cuCtxPopCurrent_v2(CUcontext* c) {
    if (c) *c = &ctx_token;
    return OK;
}
API CUresult cuCtxSetFlags(unsigned) { return OK; }
API CUresult cuCtxGetFlags(unsigned* f) {
    *f = 0;
    return OK;
}

API CUresult cuStreamCreate(CUstream* s, unsigned) {
    *s = new int(0);
    return OK;
}
API CUresult cuStreamCreateWithPriority(CUstream* s, unsigned f, int) { return cuStreamCreate(s, f); }
API CUresult cuCtxGetStreamPriorityRange(int* lo, int* hi) {
    *lo = 0;
    *hi = -5;
    return OK;
}
API CUresult cuStreamDestroy_v2(CUstream s) {
    delete (int*)s;
    return OK;
}
API CUresult cuStreamSynchronize(CUstream) { return OK; }
API CUresult cuStreamQuery(CUstream) { return OK; }
API CUresult cuStreamWaitEvent(CUstream, CUevent, unsigned) { return OK; }

// An event holds the time it was recorded at.
typedef std::chrono::steady_clock Clock;
API CUresult cuEventCreate(CUevent* e, unsigned) {
    *e = new Clock::time_point(Clock::now());
    return OK;
}
API CUresult cuEventDestroy_v2(CUevent e) {
    delete (Clock::time_point*)e;
    return OK;
}
API CUresult cuEventRecord(CUevent e, CUstream) {
    *(Clock::time_point*)e = Clock::now();
    return OK;
}
API CUresult cuEventRecordWithFlags(CUevent e, CUstream s, unsigned) { return cuEventRecord(e, s); }
API CUresult cuEventSynchronize(CUevent) { return OK; }
API CUresult cuEventQuery(CUevent) { return OK; }
API CUresult cuEventElapsedTime(float* ms, CUevent a, CUevent b) {
    auto d = *(Clock::time_point*)b - *(Clock::time_point*)a;
    *ms = std::chrono::duration<float, std::milli>(d).count();
    return OK;
}
API CUresult cuEventElapsedTime_v2(float* ms, CUevent a, CUevent b) { return cuEventElapsedTime(ms, a, b); }

// Memory: 256-byte aligned host blocks, counted against the budget.
API CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) {
    std::lock_guard<std::mutex> g(mu);
    size_t size = (bytes + 255) / 256 * 256;
    if (size == 0) size = 256;
    if (used + size > budget()) return OUT_OF_MEMORY;
    void* q = aligned_alloc(256, size);
    if (!q) return OUT_OF_MEMORY;
    // Fresh device memory is not zero: fill it with a NaN pattern, so that a kernel that reads
    // what it never wrote shows.
    memset(q, 0xFF, size);
    blocks[(uintptr_t)q] = size;
    used += size;
    *p = (CUdeviceptr)q;
    return OK;
}
API CUresult cuMemAllocAsync(CUdeviceptr* p, size_t bytes, CUstream) { return cuMemAlloc_v2(p, bytes); }
API CUresult cuMemFree_v2(CUdeviceptr p) {
    std::lock_guard<std::mutex> g(mu);
    auto it = blocks.find((uintptr_t)p);
    if (it == blocks.end()) {
        fprintf(stderr, "emulated cuMemFree: %llx is not an allocation\n", p);
        return INVALID_VALUE;
    }
    used -= it->second;
    blocks.erase(it);
    free((void*)p);
    return OK;
}
API CUresult cuMemFreeAsync(CUdeviceptr p, CUstream) { return cuMemFree_v2(p); }

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
API CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void* h, size_t n) {
    if (!inside(d, n, "cuMemcpyHtoD")) return INVALID_VALUE;
    memcpy((void*)d, h, n);
    return OK;
}
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* h, size_t n, CUstream) { return cuMemcpyHtoD_v2(d, h, n); }
API CUresult cuMemcpyDtoH_v2(void* h, CUdeviceptr d, size_t n) {
    if (!inside(d, n, "cuMemcpyDtoH")) return INVALID_VALUE;
    memcpy(h, (void*)d, n);
    return OK;
}
API CUresult cuMemcpyDtoHAsync_v2(void* h, CUdeviceptr d, size_t n, CUstream) { return cuMemcpyDtoH_v2(h, d, n); }
API CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) {
    if (!inside(d, n, "cuMemcpyDtoD (dst)") || !inside(s, n, "cuMemcpyDtoD (src)")) return INVALID_VALUE;
    memmove((void*)d, (void*)s, n);
    return OK;
}
API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream) { return cuMemcpyDtoD_v2(d, s, n); }
API CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) {
    if (!inside(d, n, "cuMemsetD8")) return INVALID_VALUE;
    memset((void*)d, v, n);
    return OK;
}
API CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream) { return cuMemsetD8_v2(d, v, n); }
API CUresult cuMemsetD16Async(CUdeviceptr d, unsigned short v, size_t n, CUstream) {
    if (!inside(d, 2 * n, "cuMemsetD16")) return INVALID_VALUE;
    for (size_t i = 0; i < n; i++) ((unsigned short*)d)[i] = v;
    return OK;
}
API CUresult cuMemsetD32Async(CUdeviceptr d, unsigned v, size_t n, CUstream) {
    if (!inside(d, 4 * n, "cuMemsetD32")) return INVALID_VALUE;
    for (size_t i = 0; i < n; i++) ((unsigned*)d)[i] = v;
    return OK;
}
API CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned) {
    *p = aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    return *p ? OK : OUT_OF_MEMORY;
}
API CUresult cuMemAllocHost_v2(void** p, size_t bytes) { return cuMemHostAlloc(p, bytes, 0); }
API CUresult cuMemFreeHost(void* p) {
    free(p);
    return OK;
}

// Modules: the "cubin" is the path of the host library the emulated NVRTC built.
struct Module {
    void* lib;
};
struct Function {
    void (*launch)(void**);
    void (*block)(unsigned);
    void (*thread)(unsigned, unsigned, unsigned, unsigned);
    bool cooperative; // it reaches barriers or shuffles: a block's threads run together
    std::string name;
};
API CUresult cuModuleLoadData(CUmodule* m, const void* image) {
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
    std::string tramp = std::string(name) + "__launch";
    auto launch = (void (*)(void**))dlsym(lib, tramp.c_str());
    if (!launch) return NOT_FOUND;
    auto coop = (int*)dlsym(lib, (std::string(name) + "__cooperative").c_str());
    *f = new Function{launch, (void (*)(unsigned))dlsym(lib, "host_block"),
                      (void (*)(unsigned, unsigned, unsigned, unsigned))dlsym(lib, "host_thread"),
                      coop && *coop != 0, name};
    return OK;
}
API CUresult cuFuncGetAttribute(int* v, int, void*) {
    *v = 0;
    return OK;
}
API CUresult cuFuncSetAttribute(void*, int, int) { return OK; }

// A cooperative block runs on `threads` OS threads that wait at a barrier between blocks.
struct Crew {
    unsigned threads;
    std::barrier<>* go;   // threads + the launching thread
    std::barrier<>* done; // likewise
    Function* f = nullptr;
    void** params = nullptr;
    unsigned block = 0, blocks = 0;
    explicit Crew(unsigned n) : threads(n), go(new std::barrier<>(n + 1)), done(new std::barrier<>(n + 1)) {
        for (unsigned t = 0; t < n; t++) {
            std::thread([this, t] {
                for (;;) {
                    go->arrive_and_wait();
                    f->thread(block, t, threads, blocks);
                    f->launch(params);
                    done->arrive_and_wait();
                }
            }).detach();
        }
    }
};
static std::mutex launch_mu;

API CUresult cuLaunchKernel(void* fp, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                            unsigned bz, unsigned, CUstream, void** params, void** extra) {
    if (gy != 1 || gz != 1 || by != 1 || bz != 1 || extra != nullptr || bx == 0 || gx == 0 || bx > 1024) {
        fprintf(stderr, "emulated cuLaunchKernel: unsupported grid (%u,%u,%u) block (%u,%u,%u)\n", gx, gy,
                gz, bx, by, bz);
        return INVALID_VALUE;
    }
    Function* f = (Function*)fp;
    std::lock_guard<std::mutex> g(launch_mu);
    // MANTISSA_EMU_TRACE=1: every launch on stderr.
    static bool trace = getenv("MANTISSA_EMU_TRACE") != nullptr;
    if (trace) fprintf(stderr, "launch %s grid %u block %u%s\n", f->name.c_str(), gx, bx, f->cooperative ? " (cooperative)" : "");
    if (!f->cooperative) {
        for (unsigned b = 0; b < gx; b++) {
            for (unsigned t = 0; t < bx; t++) {
                f->thread(b, t, bx, gx);
                f->launch(params);
            }
        }
        return OK;
    }
    static std::map<unsigned, Crew*> crews;
    Crew*& c = crews[bx];
    if (!c) c = new Crew(bx);
    f->block(bx);
    c->f = f;
    c->params = params;
    c->blocks = gx;
    for (unsigned b = 0; b < gx; b++) {
        c->block = b;
        c->go->arrive_and_wait();
        c->done->arrive_and_wait();
    }
    return OK;
}

API CUresult cuGetErrorString(CUresult e, const char** s) {
    static char buf[64];
    snprintf(buf, sizeof buf, "emulated CUDA error %d", e);
    *s = buf;
    return OK;
}
API CUresult cuGetErrorName(CUresult e, const char** s) { return cuGetErrorString(e, s); }
