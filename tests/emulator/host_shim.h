// Host stand-ins for the CUDA built-ins the kernel files use, so that a kernel file (with the
// prelude, exactly as NVRTC gets it) compiles as C++ and runs on the CPU. For tests only
// (tests/host_kernels/ and the emulated driver in tests/emulator/): they check the
// kernels' index arithmetic without a GPU. Called directly, a kernel runs as a grid of one
// thread. Through host_run_grid, a block's threads run as fibers on the calling OS thread,
// taking turns: each runs until it reaches __syncthreads, ends, or is about to compare-and-swap
// (so that CAS loops meet other threads' writes and retry, as on the GPU); the block passes a
// barrier when every live thread has reached it. __shared__ memory is a static, atomics are
// real atomics, and a warp shuffle an exchange through memory between two block-wide barriers
// (so every thread of the block must reach each shuffle, as block_reduce's callers do).
// Included twice: before the kernel source, and after it with MANTISSA_HOST_TAIL defined (the
// half conversions the prelude declares need its types).
#ifndef MANTISSA_HOST_TAIL
#include <atomic>
#include <cstddef>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <vector>

#ifndef __global__
#define __global__
#endif
#define __device__
#define __forceinline__ inline
#define __align__(n) alignas(n)
#define __shared__ static

using std::isfinite;
using std::isnan;

struct HostDim3 {
    unsigned x, y, z;
};
static thread_local HostDim3 blockIdx = {0, 0, 0}, threadIdx = {0, 0, 0};
static thread_local HostDim3 blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
static thread_local float host_lanes[1024];

// On each thread, before it calls the kernel: its place in the grid.
extern "C" void host_thread(unsigned block, unsigned thread, unsigned threads, unsigned blocks) {
    blockIdx = {block, 0, 0};
    threadIdx = {thread, 0, 0};
    blockDim = {threads, 1, 1};
    gridDim = {blocks, 1, 1};
}

// Fibers. host_fiber_switch(from, to) saves the running fiber's registers on its stack and its
// stack pointer in *from, then resumes the fiber whose stack pointer is `to`.
#if defined(__x86_64__)
extern "C" void host_fiber_switch(void** from, void* to);
asm(R"(
    .text
    .p2align 4
    .hidden host_fiber_switch
    .globl host_fiber_switch
    .type host_fiber_switch, @function
host_fiber_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size host_fiber_switch, .-host_fiber_switch
)");
#else
#include <ucontext.h>
#endif
#include <sys/mman.h>

struct HostFiber {
    void* sp;   // where it stopped (x86-64)
    char* base; // its stack: a guard page, then the stack
    bool done;
    bool waiting; // at a barrier
#if !defined(__x86_64__)
    ucontext_t ctx;
#endif
};
static constexpr std::size_t HOST_FIBER_STACK = 256 * 1024;
static thread_local void* host_scheduler_sp;
static thread_local HostFiber* host_fiber = nullptr; // the running one; null outside run_grid
static thread_local void (*host_body)(void*);
static thread_local void* host_body_arg;
#if !defined(__x86_64__)
static thread_local ucontext_t host_scheduler_ctx;
#endif

static void host_yield() {
#if defined(__x86_64__)
    host_fiber_switch(&host_fiber->sp, host_scheduler_sp);
#else
    swapcontext(&host_fiber->ctx, &host_scheduler_ctx);
#endif
}

static void host_fiber_main() {
    host_body(host_body_arg);
    host_fiber->done = true;
    host_yield(); // never resumed
    __builtin_trap();
}

static void host_fiber_start(HostFiber& f) {
    f.done = false;
    f.waiting = false;
    char* top = f.base + 4096 + HOST_FIBER_STACK;
#if defined(__x86_64__)
    // The frame host_fiber_switch pops: control words, six registers, then "returns" into
    // host_fiber_main with the stack as just after a call (a zero return address above).
    void** sp = (void**)top;
    *--sp = nullptr;
    *--sp = (void*)&host_fiber_main;
    for (int i = 0; i < 6; i++) *--sp = nullptr;
    std::uint32_t mxcsr;
    std::uint16_t fpcw;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fpcw));
    *--sp = nullptr;
    std::memcpy((char*)sp, &mxcsr, 4);
    std::memcpy((char*)sp + 4, &fpcw, 2);
    f.sp = sp;
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.base + 4096;
    f.ctx.uc_stack.ss_size = HOST_FIBER_STACK;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, host_fiber_main, 0);
#endif
}

static void host_fiber_resume(HostFiber& f) {
    host_fiber = &f;
#if defined(__x86_64__)
    host_fiber_switch(&host_scheduler_sp, f.sp);
#else
    swapcontext(&host_scheduler_ctx, &f.ctx);
#endif
    host_fiber = nullptr;
}

// This OS thread's fiber stacks: kept from grid to grid, unmapped when the thread ends.
struct HostStacks {
    HostFiber* fibers = nullptr;
    unsigned have = 0;
    // At least `threads` stacks; false (and as before) when the memory cannot be had.
    bool reserve(unsigned threads) {
        if (have >= threads) return true;
        HostFiber* more = new HostFiber[threads];
        for (unsigned t = 0; t < threads; t++) {
            if (t < have) {
                more[t].base = fibers[t].base;
                continue;
            }
            void* m = mmap(nullptr, 4096 + HOST_FIBER_STACK, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (m == MAP_FAILED) {
                for (unsigned u = have; u < t; u++) munmap(more[u].base, 4096 + HOST_FIBER_STACK);
                delete[] more;
                return false;
            }
            mprotect(m, 4096, PROT_NONE); // an overflow faults instead of writing elsewhere
            more[t].base = (char*)m;
        }
        delete[] fibers;
        fibers = more;
        have = threads;
        return true;
    }
    ~HostStacks() {
        for (unsigned t = 0; t < have; t++) munmap(fibers[t].base, 4096 + HOST_FIBER_STACK);
        delete[] fibers;
    }
};

// Runs body(arg) as every thread of a grid of `blocks` blocks of `threads` threads, a block at
// a time, its threads as fibers on this OS thread. 0 on success, -1 when stacks cannot be had.
// Shared memory is static: one grid of a library at a time.
extern "C" int host_run_grid(unsigned blocks, unsigned threads, void (*body)(void*), void* arg) {
    static thread_local HostStacks stacks;
    if (!stacks.reserve(threads)) return -1;
    HostFiber* fibers = stacks.fibers;
    host_body = body;
    host_body_arg = arg;
    for (unsigned b = 0; b < blocks; b++) {
        for (unsigned t = 0; t < threads; t++) host_fiber_start(fibers[t]);
        for (unsigned live = threads; live > 0;) {
            unsigned waiting = 0;
            for (unsigned t = 0; t < threads; t++) {
                if (fibers[t].done || fibers[t].waiting) {
                    waiting += fibers[t].waiting;
                    continue;
                }
                host_thread(b, t, threads, blocks);
                host_fiber_resume(fibers[t]);
                live -= fibers[t].done;
                waiting += fibers[t].waiting;
            }
            if (waiting == live) { // all there: through the barrier
                for (unsigned t = 0; t < threads; t++) fibers[t].waiting = false;
            }
        }
    }
    host_thread(0, 0, 1, 1); // a direct call on this thread is a grid of one thread again
    return 0;
}

struct uint2 {
    unsigned x, y;
};
struct alignas(16) uint4 { // 16-byte aligned, as CUDA's
    unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline unsigned __umulhi(unsigned a, unsigned b) {
    return (unsigned)(((unsigned long long)a * b) >> 32);
}
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline float __int_as_float(int u) { return __uint_as_float((unsigned)u); }
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
// Atomics (C++20 atomic_ref). In a fiber, a compare-and-swap first lets the block's other
// threads run, so that a CAS loop sees their writes between its load and its swap and retries,
// as it does on the GPU. A failed compare-exchange loads the current value into `compare`, so
// it holds the old value either way.
inline int atomicCAS(int* p, int compare, int value) {
    if (host_fiber) host_yield();
    std::atomic_ref<int>(*p).compare_exchange_strong(compare, value);
    return compare;
}
inline unsigned atomicCAS(unsigned* p, unsigned compare, unsigned value) {
    if (host_fiber) host_yield();
    std::atomic_ref<unsigned>(*p).compare_exchange_strong(compare, value);
    return compare;
}
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline void __syncthreads() {
    if (host_fiber) {
        host_fiber->waiting = true;
        host_yield();
    }
}
// cvt.rzi.s64.f64: toward zero, saturating, NaN to 0.
inline long long host_f64_to_i64(double r) {
    if (r != r) return 0;
    if (r >= 9223372036854775807.0) return INT64_MAX;
    if (r <= -9223372036854775808.0) return INT64_MIN;
    return (long long)r;
}
inline float __shfl_xor_sync(unsigned, float v, int mask) {
    host_lanes[threadIdx.x] = v;
    __syncthreads();
    float r = host_lanes[threadIdx.x ^ mask];
    __syncthreads();
    return r;
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16} (cuda/flash.cu: d += a b for one warp,
// its fragments in the PTX ISA's layouts): each thread leaves its A and B registers in
// memory, and after a block-wide barrier computes its own four accumulators from its warp's
// 32 lanes (so, as with shuffles, every thread of the block must reach each product).
// Internal linkage: every kernel library has its own copy, bound to its own threadIdx.
static void host_mma_m16n8k16(float* d, const unsigned* a, const unsigned* b, bool bf);

// cp.async.cg.shared.global of 16 bytes, commit_group and wait_group (cuda/flash.cu): a
// copy is in flight from its issue to the wait that covers its group. Meanwhile its
// destination holds 0xFF bytes (NaN as f16 and bf16), so that a thread reading its own copy
// before its wait shows in the results; the data (or zeros) arrives at the wait. Hazards
// between threads are not caught: the emulated mma and ldmatrix pass block-wide barriers
// themselves, so the block runs in lockstep around them. Both addresses must be 16-byte
// aligned, as on the GPU (which faults otherwise).
static void host_check_aligned16(const void* p, const char* what) {
    if (((std::uintptr_t)p & 15u) != 0) {
        std::fprintf(stderr, "emulated %s: address %p is not 16-byte aligned\n", what, p);
        std::abort();
    }
}
struct HostCopy {
    void* dst;
    const void* src; // null: zeros
    unsigned group;
};
static thread_local std::vector<HostCopy> host_copies[1024];
static thread_local unsigned host_copy_groups[1024]; // committed so far, per thread
static void host_cp_async16(void* dst, const void* src, bool live) {
    host_check_aligned16(dst, "cp.async destination");
    if (live) host_check_aligned16(src, "cp.async source");
    host_copies[threadIdx.x].push_back({dst, live ? src : nullptr, host_copy_groups[threadIdx.x]});
    std::memset(dst, 0xFF, 16);
}
static void host_cp_commit() { host_copy_groups[threadIdx.x]++; }
// Completes every committed group but the newest n.
static void host_cp_wait(unsigned n) {
    std::vector<HostCopy>& q = host_copies[threadIdx.x];
    unsigned committed = host_copy_groups[threadIdx.x];
    std::size_t kept = 0;
    for (HostCopy& c : q) {
        if (c.group + n < committed) {
            if (c.src) std::memcpy(c.dst, c.src, 16);
            else std::memset(c.dst, 0, 16);
        } else {
            q[kept++] = c;
        }
    }
    q.resize(kept);
}

// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16 (cuda/flash.cu): lanes 8j..8j+7 give the
// row addresses of matrix j; after a block-wide barrier each lane reads its four registers
// from its warp's rows (row l/4, columns 2(l%4)..+1; transposed, column l/4 of rows
// 2(l%4)..+1).
static thread_local const unsigned short* host_ldm_rows[1024];
static void host_ldmatrix_x4(unsigned* r, const unsigned short* p, bool trans) {
    unsigned self = threadIdx.x, warp = self & ~31u, l = self & 31u;
    host_check_aligned16(p, "ldmatrix row");
    host_ldm_rows[self] = p;
    __syncthreads();
    for (unsigned j = 0; j < 4; j++) {
        const unsigned short* const* rows = host_ldm_rows + warp + 8 * j;
        unsigned lo, hi;
        if (trans) {
            lo = rows[2 * (l % 4)][l / 4];
            hi = rows[2 * (l % 4) + 1][l / 4];
        } else {
            lo = rows[l / 4][2 * (l % 4)];
            hi = rows[l / 4][2 * (l % 4) + 1];
        }
        r[j] = lo | (hi << 16);
    }
    __syncthreads(); // every lane has read before the addresses are written again
}

#else

// Fragment registers of the block's threads: A's four, then B's two.
static thread_local unsigned host_mma_regs[1024][6];
// A 16-bit value (low or high half of a register) as f32.
static float host_half(unsigned reg, int high, bool bf) {
    unsigned bits = (reg >> (16 * high)) & 0xFFFFu;
    if (bf) return __uint_as_float(bits << 16);
    f16 h;
    h.bits = (u16)bits;
    return to_f32(h);
}
static void host_mma_m16n8k16(float* d, const unsigned* a, const unsigned* b, bool bf) {
    unsigned self = threadIdx.x, warp = self & ~31u, lane = self & 31u;
    for (int r = 0; r < 4; r++) host_mma_regs[self][r] = a[r];
    for (int r = 0; r < 2; r++) host_mma_regs[self][4 + r] = b[r];
    __syncthreads();
    unsigned g = lane >> 2, t = lane & 3u;
    for (int i = 0; i < 4; i++) {
        // Accumulator i is row g (+ 8 for i >= 2), column 2t + i % 2. A's (row, k) lives in
        // lane (row % 8) * 4 + (k % 8) / 2, register row / 8 + 2 (k / 8), half k % 2; B's
        // (k, column) in lane column * 4 + (k % 8) / 2, register 4 + k / 8, half k % 2.
        unsigned row = g + 8 * (i / 2), col = 2 * t + i % 2;
        float s = 0.0f;
        for (unsigned k = 0; k < 16; k++) {
            unsigned ar = host_mma_regs[warp + (row % 8) * 4 + (k % 8) / 2][row / 8 + 2 * (k / 8)];
            unsigned br = host_mma_regs[warp + col * 4 + (k % 8) / 2][4 + k / 8];
            s += host_half(ar, k % 2, bf) * host_half(br, k % 2, bf);
        }
        d[i] += s;
    }
    __syncthreads(); // every lane has read before the registers are written again
}

// By table: the compiler's conversion is a library call without F16C.
static float host_f16_values[65536];
static const bool host_f16_filled = [] {
    for (unsigned b = 0; b < 65536; b++) {
        u16 bits = (u16)b;
        _Float16 h;
        std::memcpy(&h, &bits, 2);
        host_f16_values[b] = (float)h;
    }
    return true;
}();
float to_f32(f16 x) { return host_f16_values[x.bits]; }
template <> f16 from_f32<f16>(float x) {
    _Float16 h = (_Float16)x;
    f16 r;
    std::memcpy(&r.bits, &h, 2);
    return r;
}
template <> bf16 from_f32<bf16>(float x) {
    unsigned b = __float_as_uint(x);
    bf16 r;
    if (std::isnan(x)) {
        r.bits = 0x7FFF;
        return r;
    }
    b += 0x7FFFu + ((b >> 16) & 1u);
    r.bits = (u16)(b >> 16);
    return r;
}

#endif
