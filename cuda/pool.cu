// 2-D pooling over dense NCHW inputs, or NHWC ones (`channels_last`: outputs and input
// gradients in the same order), src/backend/cpu/pool.rs giving the same results: max pooling
// with the position of each maximum (max_pool2d_*: the flat in-plane index, i64;
// max_pool2d_taps_*: for windows of at most 255 taps, the tap ky kw + kx, u8, 8 times
// smaller, since the positions live from forward to backward), average pooling, and adaptive
// average pooling. The backward kernels gather: one thread per input cell sums the output cells
// whose window holds it, in the order the CPU adds them, so they need no atomics and repeat
// bit for bit.

struct PoolArgs {
    i64 planes, h, w, ho, wo;
    i64 kh, kw, sh, sw, ph, pw, dh, dw;
    i64 c;
    int count_include_pad;
    int channels_last;
};

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

// Row and column of in-plane pixel k of a plane `w` wide.
__device__ __forceinline__ void row_col(i64 k, i64 w, i64* y, i64* x) {
    *y = idiv(k, w);
    *x = k - *y * w;
}

// The first output index along one axis whose window (start o*s - p, taps every d) can
// reach input i, and the last; the caller checks each tap exactly.
__device__ __forceinline__ void reach(i64 i, i64 k, i64 s, i64 p, i64 d, i64 out, i64* lo, i64* hi) {
    i64 top = i + p;                  // o*s + t*d == top for some tap t in [0, k)
    i64 first = top - (k - 1) * d;    // smallest o*s
    *lo = first <= 0 ? 0 : idiv(first + s - 1, s);
    *hi = idiv(top, s);
    if (*hi > out - 1) *hi = out - 1;
}

// Where max pooling records window o's maximum: at in-plane index k, tap `tap` of the
// window (both -1 when the window holds no input: 255 as a tap).
__device__ __forceinline__ void put_max(i64* idx, i64 o, i64 k, i64 tap) { idx[o] = k; }
__device__ __forceinline__ void put_max(u8* idx, i64 o, i64 k, i64 tap) {
    idx[o] = tap < 0 ? (u8)255 : (u8)tap;
}

// The tap along one axis (0 <= t < kn) whose offset from the window's start is `off` with
// taps `d` apart, or -1 when no tap lies there.
__device__ __forceinline__ i64 tap_at(i64 off, i64 d, i64 kn) {
    if (d != 1) {
        if (off % d != 0) return -1;
        off /= d;
    }
    return off >= 0 && off < kn ? off : -1;
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
        for (i64 ky = 0; ky < a.kh; ky++) {
            i64 iy = oy * a.sh + ky * a.dh - a.ph;
            if (iy < 0 || iy >= a.h) continue;
            for (i64 kx = 0; kx < a.kw; kx++) {
                i64 ix = ox * a.sw + kx * a.dw - a.pw;
                if (ix < 0 || ix >= a.w) continue;
                i64 k = iy * a.w + ix;
                float v = to_f32(x[P.base + k * P.stride]);
                if (bi < 0 || v > best || (isnan(v) && !isnan(best))) {
                    best = v;
                    bi = k;
                    bt = ky * a.kw + kx;
                }
            }
        }
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

// Average window of output o along one axis: [*a0, *a1) inside the input, *full the length
// before clipping to the input (the divisor with count_include_pad).
__device__ __forceinline__ void avg_window(i64 o, i64 k, i64 s, i64 p, i64 len, i64* a0, i64* a1,
                                           i64* full) {
    i64 start = o * s - p;
    i64 end = start + k < len + p ? start + k : len + p;
    *full = end - start;
    *a0 = start > 0 ? start : 0;
    i64 e = end < len ? end : len;
    *a1 = e > *a0 ? e : *a0;
}

__device__ __forceinline__ float avg_divisor(PoolArgs a, i64 y0, i64 y1, i64 fy, i64 x0, i64 x1, i64 fx) {
    if (a.count_include_pad) return (float)(fy * fx);
    i64 c = (y1 - y0) * (x1 - x0);
    return (float)(c > 1 ? c : 1);
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
        i64 ylo, yhi, xlo, xhi;
        reach(iy, a.kh, a.sh, a.ph, 1, a.ho, &ylo, &yhi);
        reach(ix, a.kw, a.sw, a.pw, 1, a.wo, &xlo, &xhi);
        float acc = 0.0f;
        for (i64 oy = ylo; oy <= yhi; oy++) {
            i64 y0, y1, fy;
            avg_window(oy, a.kh, a.sh, a.ph, a.h, &y0, &y1, &fy);
            if (iy < y0 || iy >= y1) continue;
            for (i64 ox = xlo; ox <= xhi; ox++) {
                i64 x0, x1, fx;
                avg_window(ox, a.kw, a.sw, a.pw, a.w, &x0, &x1, &fx);
                if (ix < x0 || ix >= x1) continue;
                float div = avg_divisor(a, y0, y1, fy, x0, x1, fx);
                acc += to_f32(g[P.base + (oy * a.wo + ox) * P.stride]) / div;
            }
        }
        gx[i] = from_f32<T>(acc);
    }
}

// Adaptive window of output o: [o*len/out, ceil((o+1)*len/out)).
__device__ __forceinline__ i64 adaptive_start(i64 o, i64 out, i64 len) { return idiv(o * len, out); }
__device__ __forceinline__ i64 adaptive_end(i64 o, i64 out, i64 len) {
    return idiv((o + 1) * len + out - 1, out);
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
        // Outputs whose window holds iy: floor(iy*ho/h) .. ceil((iy+1)*ho/h) - 1.
        i64 ylo = idiv(iy * a.ho, a.h), yhi = idiv((iy + 1) * a.ho + a.h - 1, a.h) - 1;
        i64 xlo = idiv(ix * a.wo, a.w), xhi = idiv((ix + 1) * a.wo + a.w - 1, a.w) - 1;
        float acc = 0.0f;
        for (i64 oy = ylo; oy <= yhi && oy < a.ho; oy++) {
            i64 y0 = adaptive_start(oy, a.ho, a.h), y1 = adaptive_end(oy, a.ho, a.h);
            if (iy < y0 || iy >= y1) continue;
            for (i64 ox = xlo; ox <= xhi && ox < a.wo; ox++) {
                i64 x0 = adaptive_start(ox, a.wo, a.w), x1 = adaptive_end(ox, a.wo, a.w);
                if (ix < x0 || ix >= x1) continue;
                float cnt = (float)((y1 - y0) * (x1 - x0));
                acc += to_f32(g[P.base + (oy * a.wo + ox) * P.stride]) / cnt;
            }
        }
        gx[i] = from_f32<T>(acc);
    }
}

// Channels-last pooling in vectors: a thread takes V = 16 / sizeof(T) adjacent channels of
// one pixel (C % V == 0 and every operand aligned, which the launcher checks), so each load
// and store moves 16 bytes and the index arithmetic (the pixel, the windows that reach it) is
// done once per V channels instead of once per element. Same results as the element kernels
// above, bit for bit: the same taps in the same order.

// Window taps of V channels (max pooling's u8 positions), loaded and stored as one word.
template <int V> struct alignas(V) TapVec { u8 v[V]; };

// Unit u of a vector kernel over `pixels` per image: its image n, in-image pixel k and first
// channel c0. Units walk memory in order: the unit's elements start at u * V.
struct ClUnit {
    i64 n, k, c0;
};
__device__ __forceinline__ ClUnit cl_unit(i64 u, i64 groups, i64 pixels, int V) {
    ClUnit q;
    i64 r = idiv(u, groups);
    q.c0 = (u - r * groups) * V;
    q.n = idiv(r, pixels);
    q.k = r - q.n * pixels;
    return q;
}

// Units of a vector kernel: V channels of every pixel of every image.
__device__ __forceinline__ i64 cl_units(const PoolArgs& a, i64 pixels, int V) {
    return idiv(a.planes, a.c) * pixels * (a.c / V);
}

template <typename T>
__device__ void max_pool_cl(const T* x, T* y, u8* idx, PoolArgs a) {
    const int V = 16 / sizeof(T);
    FOR_EACH(u, cl_units(a, a.ho * a.wo, V)) {
        ClUnit q = cl_unit(u, a.c / V, a.ho * a.wo, V);
        i64 oy, ox;
        row_col(q.k, a.wo, &oy, &ox);
        const T* xn = x + q.n * a.h * a.w * a.c + q.c0;
        float best[V];
        int bt[V];
        #pragma unroll
        for (int j = 0; j < V; ++j) {
            best[j] = -INFINITY;
            bt[j] = -1;
        }
        for (i64 ky = 0; ky < a.kh; ky++) {
            i64 iy = oy * a.sh + ky * a.dh - a.ph;
            if (iy < 0 || iy >= a.h) continue;
            for (i64 kx = 0; kx < a.kw; kx++) {
                i64 ix = ox * a.sw + kx * a.dw - a.pw;
                if (ix < 0 || ix >= a.w) continue;
                Vec16<T> v = *reinterpret_cast<const Vec16<T>*>(xn + (iy * a.w + ix) * a.c);
                int tap = (int)(ky * a.kw + kx);
                #pragma unroll
                for (int j = 0; j < V; ++j) {
                    float f = to_f32(v.v[j]);
                    if (bt[j] < 0 || f > best[j] || (isnan(f) && !isnan(best[j]))) {
                        best[j] = f;
                        bt[j] = tap;
                    }
                }
            }
        }
        Vec16<T> out;
        TapVec<V> t;
        #pragma unroll
        for (int j = 0; j < V; ++j) {
            out.v[j] = from_f32<T>(best[j]);
            t.v[j] = bt[j] < 0 ? (u8)255 : (u8)bt[j];
        }
        *reinterpret_cast<Vec16<T>*>(y + u * V) = out;
        *reinterpret_cast<TapVec<V>*>(idx + u * V) = t;
    }
}

// A gather without a search per element: the windows that reach the unit's pixel are found
// once for its V channels, and a window's gradients are read only when one of its taps names
// the pixel.
template <typename T>
__device__ void max_pool_cl_backward(const T* g, const u8* idx, T* gx, PoolArgs a) {
    const int V = 16 / sizeof(T);
    FOR_EACH(u, cl_units(a, a.h * a.w, V)) {
        ClUnit q = cl_unit(u, a.c / V, a.h * a.w, V);
        i64 iy, ix, y0, y1, x0, x1;
        row_col(q.k, a.w, &iy, &ix);
        reach(iy, a.kh, a.sh, a.ph, a.dh, a.ho, &y0, &y1);
        reach(ix, a.kw, a.sw, a.pw, a.dw, a.wo, &x0, &x1);
        i64 base = q.n * a.ho * a.wo;
        float acc[V];
        #pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = 0.0f;
        for (i64 oy = y0; oy <= y1; oy++) {
            i64 ky = tap_at(iy + a.ph - oy * a.sh, a.dh, a.kh);
            if (ky < 0) continue;
            for (i64 ox = x0; ox <= x1; ox++) {
                i64 kx = tap_at(ix + a.pw - ox * a.sw, a.dw, a.kw);
                if (kx < 0) continue;
                u8 want = (u8)(ky * a.kw + kx);
                i64 o = (base + oy * a.wo + ox) * a.c + q.c0;
                TapVec<V> t = *reinterpret_cast<const TapVec<V>*>(idx + o);
                bool any = false;
                #pragma unroll
                for (int j = 0; j < V; ++j) any |= t.v[j] == want;
                if (!any) continue;
                Vec16<T> gv = *reinterpret_cast<const Vec16<T>*>(g + o);
                #pragma unroll
                for (int j = 0; j < V; ++j)
                    if (t.v[j] == want) acc[j] += to_f32(gv.v[j]);
            }
        }
        Vec16<T> out;
        #pragma unroll
        for (int j = 0; j < V; ++j) out.v[j] = from_f32<T>(acc[j]);
        *reinterpret_cast<Vec16<T>*>(gx + u * V) = out;
    }
}

// Adds V channels over the input rectangle [y0, y1) x [x0, x1) of an image (its unit's first
// channel at xn) into acc, rows then columns, as the element kernels add.
template <typename T, int V>
__device__ __forceinline__ void cl_box_sum(const T* xn, const PoolArgs& a, i64 y0, i64 y1,
                                           i64 x0, i64 x1, float* acc) {
    for (i64 iy = y0; iy < y1; iy++)
        for (i64 ix = x0; ix < x1; ix++) {
            Vec16<T> v = *reinterpret_cast<const Vec16<T>*>(xn + (iy * a.w + ix) * a.c);
            #pragma unroll
            for (int j = 0; j < V; ++j) acc[j] += to_f32(v.v[j]);
        }
}

// Adds V channels of g at an output cell (its unit's first channel at gv), each divided by
// the cell's divisor, into acc: a backward's term.
template <typename T, int V>
__device__ __forceinline__ void cl_add_div(const T* gv, float div, float* acc) {
    Vec16<T> v = *reinterpret_cast<const Vec16<T>*>(gv);
    #pragma unroll
    for (int j = 0; j < V; ++j) acc[j] += to_f32(v.v[j]) / div;
}

// Stores acc / div as a unit's V outputs at out.
template <typename T, int V>
__device__ __forceinline__ void cl_store_div(T* out, const float* acc, float div) {
    Vec16<T> r;
    #pragma unroll
    for (int j = 0; j < V; ++j) r.v[j] = from_f32<T>(acc[j] / div);
    *reinterpret_cast<Vec16<T>*>(out) = r;
}

template <typename T>
__device__ void avg_pool_cl(const T* x, T* y, PoolArgs a) {
    const int V = 16 / sizeof(T);
    FOR_EACH(u, cl_units(a, a.ho * a.wo, V)) {
        ClUnit q = cl_unit(u, a.c / V, a.ho * a.wo, V);
        i64 oy, ox, y0, y1, fy, x0, x1, fx;
        row_col(q.k, a.wo, &oy, &ox);
        avg_window(oy, a.kh, a.sh, a.ph, a.h, &y0, &y1, &fy);
        avg_window(ox, a.kw, a.sw, a.pw, a.w, &x0, &x1, &fx);
        float acc[V];
        #pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = 0.0f;
        cl_box_sum<T, V>(x + q.n * a.h * a.w * a.c + q.c0, a, y0, y1, x0, x1, acc);
        cl_store_div<T, V>(y + u * V, acc, avg_divisor(a, y0, y1, fy, x0, x1, fx));
    }
}

template <typename T>
__device__ void avg_pool_cl_backward(const T* g, T* gx, PoolArgs a) {
    const int V = 16 / sizeof(T);
    FOR_EACH(u, cl_units(a, a.h * a.w, V)) {
        ClUnit q = cl_unit(u, a.c / V, a.h * a.w, V);
        i64 iy, ix, ylo, yhi, xlo, xhi;
        row_col(q.k, a.w, &iy, &ix);
        reach(iy, a.kh, a.sh, a.ph, 1, a.ho, &ylo, &yhi);
        reach(ix, a.kw, a.sw, a.pw, 1, a.wo, &xlo, &xhi);
        const T* gn = g + q.n * a.ho * a.wo * a.c + q.c0;
        float acc[V];
        #pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = 0.0f;
        for (i64 oy = ylo; oy <= yhi; oy++) {
            i64 y0, y1, fy;
            avg_window(oy, a.kh, a.sh, a.ph, a.h, &y0, &y1, &fy);
            if (iy < y0 || iy >= y1) continue;
            for (i64 ox = xlo; ox <= xhi; ox++) {
                i64 x0, x1, fx;
                avg_window(ox, a.kw, a.sw, a.pw, a.w, &x0, &x1, &fx);
                if (ix < x0 || ix >= x1) continue;
                float div = avg_divisor(a, y0, y1, fy, x0, x1, fx);
                cl_add_div<T, V>(gn + (oy * a.wo + ox) * a.c, div, acc);
            }
        }
        cl_store_div<T, V>(gx + u * V, acc, 1.0f);
    }
}

template <typename T>
__device__ void adaptive_avg_pool_cl(const T* x, T* y, PoolArgs a) {
    const int V = 16 / sizeof(T);
    FOR_EACH(u, cl_units(a, a.ho * a.wo, V)) {
        ClUnit q = cl_unit(u, a.c / V, a.ho * a.wo, V);
        i64 oy, ox;
        row_col(q.k, a.wo, &oy, &ox);
        i64 y0 = adaptive_start(oy, a.ho, a.h), y1 = adaptive_end(oy, a.ho, a.h);
        i64 x0 = adaptive_start(ox, a.wo, a.w), x1 = adaptive_end(ox, a.wo, a.w);
        float acc[V];
        #pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = 0.0f;
        cl_box_sum<T, V>(x + q.n * a.h * a.w * a.c + q.c0, a, y0, y1, x0, x1, acc);
        cl_store_div<T, V>(y + u * V, acc, (float)((y1 - y0) * (x1 - x0)));
    }
}

template <typename T>
__device__ void adaptive_avg_pool_cl_backward(const T* g, T* gx, PoolArgs a) {
    const int V = 16 / sizeof(T);
    FOR_EACH(u, cl_units(a, a.h * a.w, V)) {
        ClUnit q = cl_unit(u, a.c / V, a.h * a.w, V);
        i64 iy, ix;
        row_col(q.k, a.w, &iy, &ix);
        // Outputs whose window holds iy: floor(iy*ho/h) .. ceil((iy+1)*ho/h) - 1.
        i64 ylo = idiv(iy * a.ho, a.h), yhi = idiv((iy + 1) * a.ho + a.h - 1, a.h) - 1;
        i64 xlo = idiv(ix * a.wo, a.w), xhi = idiv((ix + 1) * a.wo + a.w - 1, a.w) - 1;
        const T* gn = g + q.n * a.ho * a.wo * a.c + q.c0;
        float acc[V];
        #pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = 0.0f;
        for (i64 oy = ylo; oy <= yhi && oy < a.ho; oy++) {
            i64 y0 = adaptive_start(oy, a.ho, a.h), y1 = adaptive_end(oy, a.ho, a.h);
            if (iy < y0 || iy >= y1) continue;
            for (i64 ox = xlo; ox <= xhi && ox < a.wo; ox++) {
                i64 x0 = adaptive_start(ox, a.wo, a.w), x1 = adaptive_end(ox, a.wo, a.w);
                if (ix < x0 || ix >= x1) continue;
                float cnt = (float)((y1 - y0) * (x1 - x0));
                cl_add_div<T, V>(gn + (oy * a.wo + ox) * a.c, cnt, acc);
            }
        }
        cl_store_div<T, V>(gx + u * V, acc, 1.0f);
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

// The vector kernels, for channels-last inputs whose channels fill whole vectors.
#define POOL_CL(T)                                                                              \
    extern "C" __global__ void max_pool2d_taps_cl_##T(const T* x, T* y, u8* idx, PoolArgs a) {  \
        max_pool_cl<T>(x, y, idx, a);                                                           \
    }                                                                                           \
    extern "C" __global__ void max_pool2d_taps_cl_backward_##T(const T* g, const u8* idx,      \
                                                               T* gx, PoolArgs a) {            \
        max_pool_cl_backward<T>(g, idx, gx, a);                                                 \
    }                                                                                           \
    extern "C" __global__ void avg_pool2d_cl_##T(const T* x, T* y, PoolArgs a) {                \
        avg_pool_cl<T>(x, y, a);                                                                \
    }                                                                                           \
    extern "C" __global__ void avg_pool2d_cl_backward_##T(const T* g, T* gx, PoolArgs a) {      \
        avg_pool_cl_backward<T>(g, gx, a);                                                      \
    }                                                                                           \
    extern "C" __global__ void adaptive_avg_pool2d_cl_##T(const T* x, T* y, PoolArgs a) {       \
        adaptive_avg_pool_cl<T>(x, y, a);                                                       \
    }                                                                                           \
    extern "C" __global__ void adaptive_avg_pool2d_cl_backward_##T(const T* g, T* gx,          \
                                                                   PoolArgs a) {               \
        adaptive_avg_pool_cl_backward<T>(g, gx, a);                                             \
    }

PART(float, POOL_CL(float))
PART(f16, POOL_CL(f16))
PART(bf16, POOL_CL(bf16))
