// 2-D pooling over dense NCHW inputs, or NHWC ones (`channels_last`: outputs and input
// gradients in the same order), src/backend/cpu/pool.rs giving the same results: max pooling
// with the position of each maximum (max_pool2d_*: the flat in-plane index, i64;
// max_pool2d_taps_*: for windows of at most 255 taps, the tap ky kw + kx, u8, 8 times
// smaller, since the positions live from forward to backward), average pooling, and adaptive
// average pooling. The backward kernels gather: one thread per input cell sums the output cells
// whose window holds it, in the order the CPU adds them, so they need no atomics and repeat
// bit for bit.
// The arguments and window arithmetic are in cuda/pool.cuh; the vector kernels for dense
// rows and channels-last are in cuda/pool_vec.cu.

// Where plane pl (= n * c + channel) of planes of `pixels` starts in memory, and the
// distance between its pixels: NCHW planes one after another (stride 1), or NHWC with each
// pixel's channels side by side (stride c). Found once per output or input cell, so the
// taps need no division.
struct PlaneAt {
    i64 base, stride;
};
__device__ __forceinline__ PlaneAt plane_at(const PoolArgs& a, i64 pl, i64 pixels) {
    if (!a.channels_last) return {pl * pixels, 1};
    return {idiv(pl, a.c) * pixels * a.c + imod(pl, a.c), a.c};
}

// The plane and pixel at memory position i (the inverse of plane_at): threads walk memory in
// order, so a warp reads and writes neighbouring elements in either format. 32-bit division
// where the sizes allow (idiv).
__device__ __forceinline__ void plane_pixel(const PoolArgs& a, i64 i, i64 pixels, i64* pl, i64* k) {
    if (!a.channels_last) {
        *pl = idiv(i, pixels);
        *k = i - *pl * pixels;
        return;
    }
    i64 r = idiv(i, a.c), ch = i - r * a.c;
    i64 n = idiv(r, pixels);
    *k = r - n * pixels;
    *pl = n * a.c + ch;
}

// Where max pooling records window o's maximum: at in-plane index k, tap `tap` of the
// window (both -1 when the window holds no input: 255 as a tap).
__device__ __forceinline__ void put_max(i64* idx, i64 o, i64 k, i64 tap) { idx[o] = k; }
__device__ __forceinline__ void put_max(u8* idx, i64 o, i64 k, i64 tap) {
    idx[o] = tap < 0 ? (u8)255 : (u8)tap;
}

// Whether window o's recorded maximum is input cell k, at offsets (ty, tx) from the window's
// start.
__device__ __forceinline__ bool is_max(const i64* idx, i64 o, i64 k, i64, i64, const PoolArgs&) {
    return idx[o] == k;
}
__device__ __forceinline__ bool is_max(const u8* idx, i64 o, i64, i64 ty, i64 tx,
                                       const PoolArgs& a) {
    i64 ky = tap_at(ty, a.dh, a.kh), kx = tap_at(tx, a.dw, a.kw);
    return ky >= 0 && kx >= 0 && (i64)idx[o] == ky * a.kw + kx;
}

template <typename T, typename I>
__device__ void max_pool(const T* x, T* y, I* idx, PoolArgs a) {
    i64 n = a.planes * a.ho * a.wo;
    FOR_EACH(o, n) {
        i64 pl, q;
        plane_pixel(a, o, a.ho * a.wo, &pl, &q);
        i64 ox, oy;
        row_col(q, a.wo, &oy, &ox);
        PlaneAt P = plane_at(a, pl, a.h * a.w);
        float best = -INFINITY;
        i64 bi = -1, bt = -1;
        max_window_taps(a, oy, ox, [&](i64 iy, i64 ix, i64 tap) {
            i64 k = iy * a.w + ix;
            float v = to_f32(x[P.base + k * P.stride]);
            if (bi < 0 || v > best || (isnan(v) && !isnan(best))) {
                best = v;
                bi = k;
                bt = tap;
            }
        });
        y[o] = from_f32<T>(best);
        put_max(idx, o, bi, bt);
    }
}

template <typename T, typename I>
__device__ void max_pool_backward(const T* g, const I* idx, T* gx, PoolArgs a) {
    i64 n = a.planes * a.h * a.w;
    FOR_EACH(i, n) {
        i64 pl, k, y0, y1, x0, x1;
        plane_pixel(a, i, a.h * a.w, &pl, &k);
        i64 ix, iy;
        row_col(k, a.w, &iy, &ix);
        PlaneAt P = plane_at(a, pl, a.ho * a.wo);
        reach(iy, a.kh, a.sh, a.ph, a.dh, a.ho, &y0, &y1);
        reach(ix, a.kw, a.sw, a.pw, a.dw, a.wo, &x0, &x1);
        float acc = 0.0f;
        for (i64 oy = y0; oy <= y1; oy++) {
            i64 ty = iy + a.ph - oy * a.sh;
            for (i64 ox = x0; ox <= x1; ox++) {
                i64 o = P.base + (oy * a.wo + ox) * P.stride;
                if (is_max(idx, o, k, ty, ix + a.pw - ox * a.sw, a)) acc += to_f32(g[o]);
            }
        }
        gx[i] = from_f32<T>(acc);
    }
}

template <typename T>
__device__ void avg_pool(const T* x, T* y, PoolArgs a) {
    i64 n = a.planes * a.ho * a.wo;
    FOR_EACH(o, n) {
        i64 pl, q;
        plane_pixel(a, o, a.ho * a.wo, &pl, &q);
        i64 ox, oy;
        row_col(q, a.wo, &oy, &ox);
        PlaneAt P = plane_at(a, pl, a.h * a.w);
        i64 y0, y1, fy, x0, x1, fx;
        avg_window(oy, a.kh, a.sh, a.ph, a.h, &y0, &y1, &fy);
        avg_window(ox, a.kw, a.sw, a.pw, a.w, &x0, &x1, &fx);
        float sum = 0.0f;
        for (i64 iy = y0; iy < y1; iy++)
            for (i64 ix = x0; ix < x1; ix++) sum += to_f32(x[P.base + (iy * a.w + ix) * P.stride]);
        y[o] = from_f32<T>(sum / avg_divisor(a, y0, y1, fy, x0, x1, fx));
    }
}

template <typename T>
__device__ void avg_pool_backward(const T* g, T* gx, PoolArgs a) {
    i64 n = a.planes * a.h * a.w;
    FOR_EACH(i, n) {
        i64 pl, k;
        plane_pixel(a, i, a.h * a.w, &pl, &k);
        i64 ix, iy;
        row_col(k, a.w, &iy, &ix);
        PlaneAt P = plane_at(a, pl, a.ho * a.wo);
        float acc = 0.0f;
        avg_windows_of(a, iy, ix, [&](i64 o, float div) {
            acc += to_f32(g[P.base + o * P.stride]) / div;
        });
        gx[i] = from_f32<T>(acc);
    }
}

template <typename T>
__device__ void adaptive_avg_pool(const T* x, T* y, PoolArgs a) {
    i64 n = a.planes * a.ho * a.wo;
    FOR_EACH(o, n) {
        i64 pl, q;
        plane_pixel(a, o, a.ho * a.wo, &pl, &q);
        i64 ox, oy;
        row_col(q, a.wo, &oy, &ox);
        PlaneAt P = plane_at(a, pl, a.h * a.w);
        i64 y0 = adaptive_start(oy, a.ho, a.h), y1 = adaptive_end(oy, a.ho, a.h);
        i64 x0 = adaptive_start(ox, a.wo, a.w), x1 = adaptive_end(ox, a.wo, a.w);
        float sum = 0.0f;
        for (i64 iy = y0; iy < y1; iy++)
            for (i64 ix = x0; ix < x1; ix++) sum += to_f32(x[P.base + (iy * a.w + ix) * P.stride]);
        y[o] = from_f32<T>(sum / (float)((y1 - y0) * (x1 - x0)));
    }
}

template <typename T>
__device__ void adaptive_avg_pool_backward(const T* g, T* gx, PoolArgs a) {
    i64 n = a.planes * a.h * a.w;
    FOR_EACH(i, n) {
        i64 pl, k;
        plane_pixel(a, i, a.h * a.w, &pl, &k);
        i64 ix, iy;
        row_col(k, a.w, &iy, &ix);
        PlaneAt P = plane_at(a, pl, a.ho * a.wo);
        float acc = 0.0f;
        adaptive_windows_of(a, iy, ix, [&](i64 o, float cnt) {
            acc += to_f32(g[P.base + o * P.stride]) / cnt;
        });
        gx[i] = from_f32<T>(acc);
    }
}

#define POOL(T)                                                                                 \
    extern "C" __global__ void max_pool2d_##T(const T* x, T* y, i64* idx, PoolArgs a) {         \
        max_pool<T, i64>(x, y, idx, a);                                                         \
    }                                                                                           \
    extern "C" __global__ void max_pool2d_backward_##T(const T* g, const i64* idx, T* gx,       \
                                                       PoolArgs a) {                            \
        max_pool_backward<T, i64>(g, idx, gx, a);                                               \
    }                                                                                           \
    extern "C" __global__ void max_pool2d_taps_##T(const T* x, T* y, u8* idx, PoolArgs a) {     \
        max_pool<T, u8>(x, y, idx, a);                                                          \
    }                                                                                           \
    extern "C" __global__ void max_pool2d_taps_backward_##T(const T* g, const u8* idx, T* gx,   \
                                                            PoolArgs a) {                       \
        max_pool_backward<T, u8>(g, idx, gx, a);                                                \
    }                                                                                           \
    extern "C" __global__ void avg_pool2d_##T(const T* x, T* y, PoolArgs a) {                   \
        avg_pool<T>(x, y, a);                                                                   \
    }                                                                                           \
    extern "C" __global__ void avg_pool2d_backward_##T(const T* g, T* gx, PoolArgs a) {         \
        avg_pool_backward<T>(g, gx, a);                                                         \
    }                                                                                           \
    extern "C" __global__ void adaptive_avg_pool2d_##T(const T* x, T* y, PoolArgs a) {          \
        adaptive_avg_pool<T>(x, y, a);                                                          \
    }                                                                                           \
    extern "C" __global__ void adaptive_avg_pool2d_backward_##T(const T* g, T* gx, PoolArgs a) { \
        adaptive_avg_pool_backward<T>(g, gx, a);                                                \
    }

PART(float, POOL(float))
PART(f16, POOL(f16))
PART(bf16, POOL(bf16))
