//! The pooling windows both layouts' kernels share (`pool.rs` for NCHW, `pool_nhwc.rs` for
//! NHWC): where an output cell's window lies in the input, and an average's divisor.

use crate::backend::ops::Pool2dParams;

/// The window of output cell `o` along one axis: (start, end) clipped to the input, and the
/// divisor contribution before clipping.
pub(super) fn avg_window(
    o: usize,
    k: usize,
    s: usize,
    pad: usize,
    len: usize,
) -> (usize, usize, usize) {
    let start = (o * s) as isize - pad as isize;
    let end = (start + k as isize).min((len + pad) as isize);
    let full = (end - start) as usize;
    let (a, b) = (start.max(0) as usize, end.min(len as isize).max(0) as usize);
    (a, b.max(a), full)
}

/// An average's divisor over the window `wy` x `wx` (from [`avg_window`]): the full window
/// with `count_include_pad`, else the cells inside the input.
pub(super) fn avg_divisor(
    p: &Pool2dParams,
    wy: (usize, usize, usize),
    wx: (usize, usize, usize),
) -> f64 {
    if p.count_include_pad {
        (wy.2 * wx.2) as f64
    } else {
        ((wy.1 - wy.0) * (wx.1 - wx.0)).max(1) as f64
    }
}

/// Adaptive pooling's window of output cell `o` of `out` over an axis of `len`: PyTorch's
/// floor(o len / out) .. ceil((o + 1) len / out).
pub(super) fn adaptive_window(o: usize, out: usize, len: usize) -> (usize, usize) {
    ((o * len) / out, ((o + 1) * len).div_ceil(out))
}
