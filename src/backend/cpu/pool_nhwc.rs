//! Channels-last (NHWC) pooling on the CPU, read and written in place: every window tap is a
//! run of `c` channels side by side, so each step is one vectorisable pass over a pixel's
//! channels. Outputs and input gradients are NHWC; max pooling's indices are the flat
//! in-plane positions (as in NCHW), stored one per output element in NHWC order.
//!
//! The NCHW kernels are in `nn.rs`; both pick the same cells (the first maximum in row-major
//! window order, a NaN over any number) and sum windows in the same order.

use super::pool_window::{adaptive_window, avg_divisor, avg_window};
use super::{overwritten_buffer, per_chunk, CpuElem, PAR_MIN};
use crate::backend::ops::Pool2dParams;
use crate::backend::spec::PoolDims;
use crate::dtype::Float as _;
use num_traits::{Float, Zero};
use rayon::prelude::*;
use std::ops::Range;

/// The input cells (row, column) of output cell `(oy, ox)`'s window, in row-major order,
/// skipping the padding.
fn taps(
    p: &Pool2dParams,
    d: &PoolDims,
    (oy, ox): (usize, usize),
) -> impl Iterator<Item = (usize, usize)> {
    let p = *p;
    let at = move |o: usize, k: usize, a: usize, len: usize| {
        let i = (o * p.stride[a] + k * p.dilation[a]) as isize - p.padding[a] as isize;
        (0..len as isize).contains(&i).then_some(i as usize)
    };
    let (kh, kw, h, w) = (p.kernel[0], p.kernel[1], d.h, d.w);
    (0..kh)
        .filter_map(move |ky| at(oy, ky, 0, h))
        .flat_map(move |iy| (0..kw).filter_map(move |kx| at(ox, kx, 1, w).map(|ix| (iy, ix))))
}

/// Max pooling of NHWC `x`: values and flat in-plane indices, both NHWC.
pub(super) fn max_pool<T: CpuElem>(x: &[T], d: &PoolDims, p: &Pool2dParams) -> (Vec<T>, Vec<i64>) {
    let _iso = crate::parallel::Isolated::new();
    let (c, n) = (d.c, d.planes / d.c.max(1));
    let (img_in, img_out) = (d.h * d.w * c, d.ho * d.wo * c);
    let mut vals = overwritten_buffer::<T>(n * img_out);
    let mut idx = overwritten_buffer::<i64>(n * img_out);
    let mut both: Vec<(&mut [T], &mut [i64])> = vals
        .chunks_mut(img_out.max(1))
        .zip(idx.chunks_mut(img_out.max(1)))
        .collect();
    let job = |i: usize, (dv, di): &mut (&mut [T], &mut [i64])| {
        let x = &x[i * img_in..][..img_in];
        let mut cells = Vec::with_capacity(p.kernel[0] * p.kernel[1]);
        for oy in 0..d.ho {
            for ox in 0..d.wo {
                cells.clear();
                cells.extend(taps(p, d, (oy, ox)).map(|(iy, ix)| iy * d.w + ix));
                let at = (oy * d.wo + ox) * c;
                let (dv, di) = (&mut dv[at..][..c], &mut di[at..][..c]);
                if cells.is_empty() {
                    // A window wholly in the padding, as the NCHW loop leaves it.
                    dv.fill(T::from_acc(T::Acc::neg_infinity()));
                    di.fill(-1);
                    continue;
                }
                // Channels in groups of LANES kept in registers, then the rest one by one.
                let whole = c / LANES * LANES;
                for c0 in (0..whole).step_by(LANES) {
                    window_max::<T, LANES>(x, c, c0, &cells, &mut dv[c0..], &mut di[c0..]);
                }
                for c0 in whole..c {
                    window_max::<T, 1>(x, c, c0, &cells, &mut dv[c0..], &mut di[c0..]);
                }
            }
        }
    };
    if n * img_in >= PAR_MIN {
        both.par_iter_mut().enumerate().for_each(|(i, b)| job(i, b));
    } else {
        both.iter_mut().enumerate().for_each(|(i, b)| job(i, b));
    }
    (vals, idx)
}

/// Channels a max pool compares at once.
const LANES: usize = 16;

/// The maximum over the window `cells` (flat in-plane positions, row-major order) of
/// channels `c0..c0 + L` of the NHWC image `x` of `c` channels, and the position of each:
/// the first maximum, or the first NaN. The choices are selects on `L`-element arrays, which
/// stay in vector registers.
fn window_max<T: CpuElem, const L: usize>(
    x: &[T],
    c: usize,
    c0: usize,
    cells: &[usize],
    dv: &mut [T],
    di: &mut [i64],
) {
    let load = |k: usize| -> [T::Acc; L] {
        let src = &x[k * c + c0..][..L];
        std::array::from_fn(|j| src[j].to_acc())
    };
    let (mut best, mut which) = (load(cells[0]), [0u32; L]);
    for (t, &k) in cells.iter().enumerate().skip(1) {
        let v = load(k);
        for j in 0..L {
            let take = (v[j] > best[j]) | (v[j].is_nan() & !best[j].is_nan());
            best[j] = if take { v[j] } else { best[j] };
            which[j] = if take { t as u32 } else { which[j] };
        }
    }
    for j in 0..L {
        dv[j] = T::from_acc(best[j]);
        di[j] = cells[which[j] as usize] as i64;
    }
}

/// The input gradient of a max pool: each output gradient added to the cell its index names.
pub(super) fn max_pool_backward<T: CpuElem>(g: &[T], idx: &[i64], d: &PoolDims) -> Vec<T> {
    let c = d.c;
    let (img_in, img_out) = (d.h * d.w * c, d.ho * d.wo * c);
    let mut gx = overwritten_buffer::<T>(d.planes * d.h * d.w);
    let parallel = gx.len() >= PAR_MIN;
    per_chunk(&mut gx, img_in, parallel, |i, dst| {
        let mut acc = vec![T::Acc::zero(); img_in];
        let (g, idx) = (&g[i * img_out..][..img_out], &idx[i * img_out..][..img_out]);
        for (gs, is) in g.chunks_exact(c).zip(idx.chunks_exact(c)) {
            for (ch, (gv, &k)) in gs.iter().zip(is).enumerate() {
                if k >= 0 {
                    acc[k as usize * c + ch] += gv.to_acc();
                }
            }
        }
        for (o, a) in dst.iter_mut().zip(acc) {
            *o = T::from_acc(a);
        }
    });
    gx
}

/// An averaging window: input rows, input columns and the divisor.
type AvgWindow = (Range<usize>, Range<usize>, f64);

/// The windows of average pooling with `p`.
pub(super) fn avg_windows(p: &Pool2dParams, d: &PoolDims) -> impl Fn(usize, usize) -> AvgWindow {
    let (p, d) = (*p, *d);
    move |oy, ox| {
        let wy = avg_window(oy, p.kernel[0], p.stride[0], p.padding[0], d.h);
        let wx = avg_window(ox, p.kernel[1], p.stride[1], p.padding[1], d.w);
        (wy.0..wy.1, wx.0..wx.1, avg_divisor(&p, wy, wx))
    }
}

/// The windows of adaptive average pooling to `[d.ho, d.wo]`.
pub(super) fn adaptive_windows(d: &PoolDims) -> impl Fn(usize, usize) -> AvgWindow {
    let d = *d;
    move |oy, ox| {
        let (y0, y1) = adaptive_window(oy, d.ho, d.h);
        let (x0, x1) = adaptive_window(ox, d.wo, d.w);
        (y0..y1, x0..x1, ((y1 - y0) * (x1 - x0)) as f64)
    }
}

/// Average pooling of NHWC `x` over `window`s (average or adaptive), NHWC out.
pub(super) fn avg_pool<T: CpuElem>(
    x: &[T],
    d: &PoolDims,
    window: impl Fn(usize, usize) -> AvgWindow + Sync,
) -> Vec<T> {
    let c = d.c;
    let (img_in, img_out) = (d.h * d.w * c, d.ho * d.wo * c);
    let mut y = overwritten_buffer::<T>(d.planes * d.ho * d.wo);
    let parallel = y.len() >= PAR_MIN;
    per_chunk(&mut y, img_out, parallel, |i, dst| {
        let x = &x[i * img_in..][..img_in];
        let mut sum = vec![T::Acc::zero(); c];
        for oy in 0..d.ho {
            for ox in 0..d.wo {
                let (rows, cols, div) = window(oy, ox);
                sum.fill(T::Acc::zero());
                for iy in rows {
                    for ix in cols.clone() {
                        let src = &x[(iy * d.w + ix) * c..][..c];
                        for (s, v) in sum.iter_mut().zip(src) {
                            *s += v.to_acc();
                        }
                    }
                }
                let div = T::Acc::from_f64_(div);
                let out = &mut dst[(oy * d.wo + ox) * c..][..c];
                for (o, &s) in out.iter_mut().zip(&sum) {
                    *o = T::from_acc(s / div);
                }
            }
        }
    });
    y
}

/// The input gradient of [`avg_pool`]: each output gradient spread over its window.
pub(super) fn avg_pool_backward<T: CpuElem>(
    g: &[T],
    d: &PoolDims,
    window: impl Fn(usize, usize) -> AvgWindow + Sync,
) -> Vec<T> {
    let c = d.c;
    let (img_in, img_out) = (d.h * d.w * c, d.ho * d.wo * c);
    let mut gx = overwritten_buffer::<T>(d.planes * d.h * d.w);
    let parallel = gx.len() >= PAR_MIN;
    per_chunk(&mut gx, img_in, parallel, |i, dst| {
        let g = &g[i * img_out..][..img_out];
        let mut acc = vec![T::Acc::zero(); img_in];
        let mut share = vec![T::Acc::zero(); c];
        for oy in 0..d.ho {
            for ox in 0..d.wo {
                let (rows, cols, div) = window(oy, ox);
                let div = T::Acc::from_f64_(div);
                let gs = &g[(oy * d.wo + ox) * c..][..c];
                for (s, v) in share.iter_mut().zip(gs) {
                    *s = v.to_acc() / div;
                }
                for iy in rows {
                    for ix in cols.clone() {
                        let a = &mut acc[(iy * d.w + ix) * c..][..c];
                        for (a, &s) in a.iter_mut().zip(&share) {
                            *a += s;
                        }
                    }
                }
            }
        }
        for (o, a) in dst.iter_mut().zip(acc) {
            *o = T::from_acc(a);
        }
    });
    gx
}
