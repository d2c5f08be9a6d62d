// Queuing work on a stream of the emulated driver (driver.cpp's emu_enqueue), for the emulated
// cuBLAS and cuDNN: their calls check their arguments at once and compute when the stream
// runs, as the real libraries' kernels do.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <dlfcn.h>
#include <utility>

// A library handle: the stream its calls queue on (cublasSetStream, cudnnSetStream).
struct Handle {
    void* stream = nullptr;
};

// Creating and destroying a handle and setting its stream: 0 (success) in both libraries.
static int create_handle(Handle** h) { return *h = new Handle, 0; }
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
