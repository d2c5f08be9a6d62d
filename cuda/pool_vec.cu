// Pooling in 16-byte vectors (the element kernels of cuda/pool.cu give the same results,
// bit for bit: the same taps, added in the same order), for the layouts whose rows or
// channels fill whole vectors (src/backend/cuda/pool.rs checks which).

// Channels-last pooling in vectors: a thread takes V = 16 / sizeof(T) adjacent channels of
// one pixel (C % V == 0 and every operand aligned, which the launcher checks), so each load
// and store moves 16 bytes and the index arithmetic (the pixel, the windows that reach it) is
// done once per V channels instead of once per element.

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

// Units of a vector kernel: V channels of every pixel of every image (none without channels).
__device__ __forceinline__ i64 cl_units(const PoolArgs& a, i64 pixels, int V) {
    if (a.c <= 0) return 0;
    return idiv(a.planes, a.c) * pixels * (a.c / V);
}

// Max pooling's running maximum of V lanes (channels or cells): none yet (tap -1), then tap
// `tap` with value f taken where it beats the one so far, NaN beating any number (the first
// of equal values stays, as on the CPU); stored with the taps as one word (255: no input).
template <int V> struct MaxLanes {
    float best[V];
    int tap[V];
    __device__ __forceinline__ void init() {
        #pragma unroll
        for (int j = 0; j < V; ++j) {
            best[j] = -INFINITY;
            tap[j] = -1;
        }
    }
    __device__ __forceinline__ void take(int j, float f, int t) {
        if (tap[j] < 0 || f > best[j] || (isnan(f) && !isnan(best[j]))) {
            best[j] = f;
            tap[j] = t;
        }
    }
    template <typename T> __device__ __forceinline__ void store(T* y, u8* idx) const {
        Vec16<T> out;
        TapVec<V> t;
        #pragma unroll
        for (int j = 0; j < V; ++j) {
            out.v[j] = from_f32<T>(best[j]);
            t.v[j] = tap[j] < 0 ? (u8)255 : (u8)tap[j];
        }
        *reinterpret_cast<Vec16<T>*>(y) = out;
        *reinterpret_cast<TapVec<V>*>(idx) = t;
    }
};

template <typename T>
__device__ void max_pool_cl(const T* x, T* y, u8* idx, PoolArgs a) {
    const int V = 16 / sizeof(T);
    FOR_EACH(u, cl_units(a, a.ho * a.wo, V)) {
        ClUnit q = cl_unit(u, a.c / V, a.ho * a.wo, V);
        i64 oy, ox;
        row_col(q.k, a.wo, &oy, &ox);
        const T* xn = x + q.n * a.h * a.w * a.c + q.c0;
        MaxLanes<V> m;
        m.init();
        max_window_taps(a, oy, ox, [&](i64 iy, i64 ix, i64 tap) {
            Vec16<T> v = *reinterpret_cast<const Vec16<T>*>(xn + (iy * a.w + ix) * a.c);
            #pragma unroll
            for (int j = 0; j < V; ++j) m.take(j, to_f32(v.v[j]), (int)tap);
        });
        m.store(y + u * V, idx + u * V);
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

// The backward of average (ADAPTIVE false) or adaptive average pooling over channels-last
// vectors: each unit adds the gradients of the windows that hold its pixel, each divided by
// the window's divisor.
template <typename T, bool ADAPTIVE>
__device__ void box_pool_cl_backward(const T* g, T* gx, PoolArgs a) {
    const int V = 16 / sizeof(T);
    FOR_EACH(u, cl_units(a, a.h * a.w, V)) {
        ClUnit q = cl_unit(u, a.c / V, a.h * a.w, V);
        i64 iy, ix;
        row_col(q.k, a.w, &iy, &ix);
        const T* gn = g + q.n * a.ho * a.wo * a.c + q.c0;
        float acc[V];
        #pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = 0.0f;
        auto add = [&](i64 o, float div) { cl_add_div<T, V>(gn + o * a.c, div, acc); };
        if (ADAPTIVE)
            adaptive_windows_of(a, iy, ix, add);
        else
            avg_windows_of(a, iy, ix, add);
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

// Row-major (NCHW) pooling in vectors along a row: a thread takes V = 16 / sizeof(T) adjacent
// cells of one row of one plane (the row's length a multiple of V and the written operand
// aligned, which the launcher checks), so its stores are 16-byte vectors and the row, the
// plane and the windows' reach along y are found once per V cells. Unit u's cells start at
// u * V; `len` is the row's length, `rows` the rows per plane.
struct RowUnit {
    i64 pl, y, x0;
};
__device__ __forceinline__ RowUnit row_unit(i64 u, i64 len, i64 rows, int V) {
    RowUnit q;
    i64 groups = len / V, r = idiv(u, groups);
    q.x0 = (u - r * groups) * V;
    q.pl = idiv(r, rows);
    q.y = r - q.pl * rows;
    return q;
}

template <typename T>
__device__ void max_pool_rows(const T* x, T* y, u8* idx, PoolArgs a) {
    const int V = 16 / sizeof(T);
    FOR_EACH(u, a.planes * a.ho * (a.wo / V)) {
        RowUnit q = row_unit(u, a.wo, a.ho, V);
        const T* xp = x + q.pl * a.h * a.w;
        MaxLanes<V> m;
        m.init();
        for (i64 ky = 0; ky < a.kh; ky++) {
            i64 iy = q.y * a.sh + ky * a.dh - a.ph;
            if (iy < 0 || iy >= a.h) continue;
            const T* xr = xp + iy * a.w;
            for (i64 kx = 0; kx < a.kw; kx++) {
                #pragma unroll
                for (int j = 0; j < V; ++j) {
                    i64 ix = (q.x0 + j) * a.sw + kx * a.dw - a.pw;
                    if (ix >= 0 && ix < a.w) m.take(j, to_f32(xr[ix]), (int)(ky * a.kw + kx));
                }
            }
        }
        m.store(y + u * V, idx + u * V);
    }
}

// The gather of max_pool_cl_backward along a row: the windows that can reach any of the V
// cells are visited once, in the order each cell's own windows come (rows, then columns), and
// a window's gradient is read only when its tap names one of the cells.
template <typename T>
__device__ void max_pool_rows_backward(const T* g, const u8* idx, T* gx, PoolArgs a) {
    const int V = 16 / sizeof(T);
    FOR_EACH(u, a.planes * a.h * (a.w / V)) {
        RowUnit q = row_unit(u, a.w, a.h, V);
        i64 y0, y1, x0, x1, lo, hi;
        reach(q.y, a.kh, a.sh, a.ph, a.dh, a.ho, &y0, &y1);
        reach(q.x0, a.kw, a.sw, a.pw, a.dw, a.wo, &x0, &hi);
        reach(q.x0 + V - 1, a.kw, a.sw, a.pw, a.dw, a.wo, &lo, &x1);
        i64 base = q.pl * a.ho * a.wo;
        float acc[V];
        #pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = 0.0f;
        for (i64 oy = y0; oy <= y1; oy++) {
            i64 ky = tap_at(q.y + a.ph - oy * a.sh, a.dh, a.kh);
            if (ky < 0) continue;
            for (i64 ox = x0; ox <= x1; ox++) {
                i64 o = base + oy * a.wo + ox;
                int t = idx[o];
                bool hit[V];
                bool any = false;
                #pragma unroll
                for (int j = 0; j < V; ++j) {
                    i64 kx = tap_at(q.x0 + j + a.pw - ox * a.sw, a.dw, a.kw);
                    hit[j] = kx >= 0 && t == ky * a.kw + kx;
                    any |= hit[j];
                }
                if (!any) continue;
                float gv = to_f32(g[o]);
                #pragma unroll
                for (int j = 0; j < V; ++j)
                    if (hit[j]) acc[j] += gv;
            }
        }
        Vec16<T> out;
        #pragma unroll
        for (int j = 0; j < V; ++j) out.v[j] = from_f32<T>(acc[j]);
        *reinterpret_cast<Vec16<T>*>(gx + u * V) = out;
    }
}

// adaptive_avg_pool_backward along a row: the windows over any of the V cells, each cell's in
// its own order.
template <typename T>
__device__ void adaptive_avg_pool_rows_backward(const T* g, T* gx, PoolArgs a) {
    const int V = 16 / sizeof(T);
    FOR_EACH(u, a.planes * a.h * (a.w / V)) {
        RowUnit q = row_unit(u, a.w, a.h, V);
        // Outputs whose window holds row y: floor(y*ho/h) .. ceil((y+1)*ho/h) - 1; columns
        // likewise from the first cell's first to the last cell's last.
        i64 ylo = idiv(q.y * a.ho, a.h), yhi = idiv((q.y + 1) * a.ho + a.h - 1, a.h) - 1;
        i64 xlo = idiv(q.x0 * a.wo, a.w), xhi = idiv((q.x0 + V) * a.wo + a.w - 1, a.w) - 1;
        const T* gp = g + q.pl * a.ho * a.wo;
        float acc[V];
        #pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = 0.0f;
        for (i64 oy = ylo; oy <= yhi && oy < a.ho; oy++) {
            i64 y0 = adaptive_start(oy, a.ho, a.h), y1 = adaptive_end(oy, a.ho, a.h);
            if (q.y < y0 || q.y >= y1) continue;
            for (i64 ox = xlo; ox <= xhi && ox < a.wo; ox++) {
                i64 x0 = adaptive_start(ox, a.wo, a.w), x1 = adaptive_end(ox, a.wo, a.w);
                float cnt = (float)((y1 - y0) * (x1 - x0));
                float gv = to_f32(gp[oy * a.wo + ox]);
                #pragma unroll
                for (int j = 0; j < V; ++j)
                    if (q.x0 + j >= x0 && q.x0 + j < x1) acc[j] += gv / cnt;
            }
        }
        cl_store_div<T, V>(gx + u * V, acc, 1.0f);
    }
}

// The vector kernels along NCHW rows.
#define POOL_ROWS(T)                                                                            \
    extern "C" __global__ void max_pool2d_taps_rows_##T(const T* x, T* y, u8* idx, PoolArgs a) { \
        max_pool_rows<T>(x, y, idx, a);                                                         \
    }                                                                                           \
    extern "C" __global__ void max_pool2d_taps_rows_backward_##T(const T* g, const u8* idx,    \
                                                                 T* gx, PoolArgs a) {          \
        max_pool_rows_backward<T>(g, idx, gx, a);                                               \
    }                                                                                           \
    extern "C" __global__ void adaptive_avg_pool2d_rows_backward_##T(const T* g, T* gx,        \
                                                                     PoolArgs a) {             \
        adaptive_avg_pool_rows_backward<T>(g, gx, a);                                           \
    }

PART(float, POOL_ROWS(float))
PART(f16, POOL_ROWS(f16))
PART(bf16, POOL_ROWS(bf16))

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
        box_pool_cl_backward<T, false>(g, gx, a);                                               \
    }                                                                                           \
    extern "C" __global__ void adaptive_avg_pool2d_cl_##T(const T* x, T* y, PoolArgs a) {       \
        adaptive_avg_pool_cl<T>(x, y, a);                                                       \
    }                                                                                           \
    extern "C" __global__ void adaptive_avg_pool2d_cl_backward_##T(const T* g, T* gx,          \
                                                                   PoolArgs a) {               \
        box_pool_cl_backward<T, true>(g, gx, a);                                                \
    }

PART(float, POOL_CL(float))
PART(f16, POOL_CL(f16))
PART(bf16, POOL_CL(bf16))
