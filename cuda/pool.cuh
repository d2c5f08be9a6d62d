// What the pooling kernel files share (cuda/pool.cu: one thread per element; cuda/pool_vec.cu:
// a thread per 16-byte vector): the launcher's arguments (src/backend/cuda/pool.rs) and the
// window arithmetic along one axis.

struct PoolArgs {
    i64 planes, h, w, ho, wo;
    i64 kh, kw, sh, sw, ph, pw, dh, dw;
    i64 c;
    int count_include_pad;
    int channels_last;
};

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

// The tap along one axis (0 <= t < kn) whose offset from the window's start is `off` with
// taps `d` apart, or -1 when no tap lies there.
__device__ __forceinline__ i64 tap_at(i64 off, i64 d, i64 kn) {
    if (d != 1) {
        if (off % d != 0) return -1;
        off /= d;
    }
    return off >= 0 && off < kn ? off : -1;
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

// Adaptive window of output o: [o*len/out, ceil((o+1)*len/out)).
__device__ __forceinline__ i64 adaptive_start(i64 o, i64 out, i64 len) { return idiv(o * len, out); }
__device__ __forceinline__ i64 adaptive_end(i64 o, i64 out, i64 len) {
    return idiv((o + 1) * len + out - 1, out);
}

// Calls f(o, div) for every average-pooling window that holds input cell (iy, ix), o its
// in-plane output index and div its divisor, rows then columns: the order the CPU adds them.
template <typename F>
__device__ __forceinline__ void avg_windows_of(const PoolArgs& a, i64 iy, i64 ix, F f) {
    i64 ylo, yhi, xlo, xhi;
    reach(iy, a.kh, a.sh, a.ph, 1, a.ho, &ylo, &yhi);
    reach(ix, a.kw, a.sw, a.pw, 1, a.wo, &xlo, &xhi);
    for (i64 oy = ylo; oy <= yhi; oy++) {
        i64 y0, y1, fy;
        avg_window(oy, a.kh, a.sh, a.ph, a.h, &y0, &y1, &fy);
        if (iy < y0 || iy >= y1) continue;
        for (i64 ox = xlo; ox <= xhi; ox++) {
            i64 x0, x1, fx;
            avg_window(ox, a.kw, a.sw, a.pw, a.w, &x0, &x1, &fx);
            if (ix < x0 || ix >= x1) continue;
            f(oy * a.wo + ox, avg_divisor(a, y0, y1, fy, x0, x1, fx));
        }
    }
}

// Calls f(o, count) for every adaptive window that holds input cell (iy, ix), as above.
template <typename F>
__device__ __forceinline__ void adaptive_windows_of(const PoolArgs& a, i64 iy, i64 ix, F f) {
    // Outputs whose window holds iy: floor(iy*ho/h) .. ceil((iy+1)*ho/h) - 1.
    i64 ylo = idiv(iy * a.ho, a.h), yhi = idiv((iy + 1) * a.ho + a.h - 1, a.h) - 1;
    i64 xlo = idiv(ix * a.wo, a.w), xhi = idiv((ix + 1) * a.wo + a.w - 1, a.w) - 1;
    for (i64 oy = ylo; oy <= yhi && oy < a.ho; oy++) {
        i64 y0 = adaptive_start(oy, a.ho, a.h), y1 = adaptive_end(oy, a.ho, a.h);
        if (iy < y0 || iy >= y1) continue;
        for (i64 ox = xlo; ox <= xhi && ox < a.wo; ox++) {
            i64 x0 = adaptive_start(ox, a.wo, a.w), x1 = adaptive_end(ox, a.wo, a.w);
            if (ix < x0 || ix >= x1) continue;
            f(oy * a.wo + ox, (float)((y1 - y0) * (x1 - x0)));
        }
    }
}

// Calls f(iy, ix, tap) for every tap of max-pooling window (oy, ox) that lies inside the
// input, tap = ky kw + kx, rows then columns: the order in which the first maximum wins.
template <typename F>
__device__ __forceinline__ void max_window_taps(const PoolArgs& a, i64 oy, i64 ox, F f) {
    for (i64 ky = 0; ky < a.kh; ky++) {
        i64 iy = oy * a.sh + ky * a.dh - a.ph;
        if (iy < 0 || iy >= a.h) continue;
        for (i64 kx = 0; kx < a.kw; kx++) {
            i64 ix = ox * a.sw + kx * a.dw - a.pw;
            if (ix < 0 || ix >= a.w) continue;
            f(iy, ix, ky * a.kw + kx);
        }
    }
}
