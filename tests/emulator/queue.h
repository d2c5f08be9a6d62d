// Queuing work on a stream of the emulated driver (driver.cpp's emu_enqueue), for the emulated
// cuBLAS, cuDNN and NCCL: their calls check their arguments at once and compute when the
// stream runs, as the real libraries' kernels do; and the driver's capture rules for them.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <dlfcn.h>
#include <utility>

// A library handle: the stream its calls queue on (cublasSetStream, cudnnSetStream), and the
// workspace cublasSetWorkspace gave it.
struct Handle {
    void* stream = nullptr;
    void* workspace = nullptr;
    size_t workspace_bytes = 0;
};

static int destroy_handle(Handle* h) { return delete h, 0; }
static int set_handle_stream(Handle* h, void* stream) { return h->stream = stream, 0; }

// The emulated driver's function `name` (the driver is loaded first, by the engine); an
// emulated library without it cannot work, so it stops the process.
static void* driver_symbol(const char* name) {
    void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    void* sym = driver ? dlsym(driver, name) : nullptr;
    if (!sym) {
        fprintf(stderr, "emulated library: the emulated driver (%s) is not loaded\n", name);
        abort();
    }
    return sym;
}

// The emulated driver's rule for a call that allocates device memory or loads code: nonzero
// (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, and the capture invalidated) while a capture this
// thread's calls would break is open, as cudaMalloc inside a capture is.
static int capture_refuses(const char* what) {
    typedef int (*Check)(const char*);
    static Check check = (Check)driver_symbol("emu_unsafe_call");
    return check(what);
}
// Whether `stream` is being captured.
static bool capturing(void* stream) {
    typedef int (*IsCapturing)(void*, int*);
    static IsCapturing f = (IsCapturing)driver_symbol("cuStreamIsCapturing");
    int status = 0;
    return f(stream, &status) == 0 && status != 0;
}

// Creating and destroying a handle and setting its stream: 0 (success) in both libraries; a
// handle is not created inside a capture (both libraries allocate device memory for it).
static int create_handle(Handle** h, const char* what, int refused) {
    if (capture_refuses(what)) return refused;
    return *h = new Handle, 0;
}

// Queues `f` (a callable that owns copies of everything it reads on the host) on `stream`.
// A stream being captured records it into the graph instead, which may run it many times:
// the driver frees the copy of `f` when the last queue or graph holding it is done with it.
template <typename F> static void later(void* stream, F f) {
    typedef int (*Enqueue)(void*, void (*)(void*), void*, void (*)(void*));
    static Enqueue enqueue = (Enqueue)driver_symbol("emu_enqueue");
    auto run = [](void* c) { (*(F*)c)(); };
    auto drop = [](void* c) { delete (F*)c; };
    enqueue(stream, run, new F(std::move(f)), drop);
}
// Queues `f` (returning true once it has run, false while it waits for work of another
// device: it is tried again at the next wait) on `stream`, for the emulated NCCL.
template <typename F> static void later_waiting(void* stream, F f) {
    typedef int (*Enqueue)(void*, int (*)(void*), void*, void (*)(void*));
    static Enqueue enqueue = (Enqueue)driver_symbol("emu_enqueue_waiting");
    auto run = [](void* c) { return (*(F*)c)() ? 1 : 0; };
    auto drop = [](void* c) { delete (F*)c; };
    enqueue(stream, run, new F(std::move(f)), drop);
}
