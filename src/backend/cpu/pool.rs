//! Pooling kernels: max, average and adaptive average over `[n, c, h, w]` planes (NHWC in
//! `pool_nhwc.rs`). Math runs in the accumulation type (f32 for half storage).

use super::pool_nhwc;
use super::pool_window::{adaptive_window, avg_divisor, avg_window};
use super::{contiguous, map_float, overwritten_buffer, CpuElem, CpuStorage, IntoStorage, PAR_MIN};
use crate::backend::ops::Pool2dParams;
use crate::backend::spec::PoolDims;
use crate::layout::Layout;
use crate::Result;
use num_traits::{Float, Zero};
use rayon::prelude::*;

/// Runs `f(in_plane, out_plane)` over every (n, c) plane, in parallel when large.
fn per_plane<T: Copy + Send + Sync, U: Copy + Send + Sync + Default>(
    x: &[T],
    d: &PoolDims,
    out_plane: usize,
    f: impl Fn(&[T], &mut [U]) + Sync,
) -> Vec<U> {
    let _iso = crate::parallel::Isolated::new();
    let mut out = vec![U::default(); d.planes * out_plane];
    if out_plane == 0 {
        return out;
    }
    let in_plane = d.h * d.w;
    let job = |(p, dst): (usize, &mut [U])| f(&x[p * in_plane..(p + 1) * in_plane], dst);
    if x.len() >= PAR_MIN {
        out.par_chunks_mut(out_plane).enumerate().for_each(job);
    } else {
        out.chunks_mut(out_plane).enumerate().for_each(job);
    }
    out
}

/// The layout to read a pooling operand through: the view itself (NCHW planes), or its
/// NHWC walk when the pooling is channels-last (a borrow when it is stored so).
fn read_as(l: &Layout, d: &PoolDims) -> Result<Layout> {
    match d.channels_last {
        true => l.permute("pooling", &[0, 2, 3, 1]),
        false => Ok(l.clone()),
    }
}

/// Max pooling: values and the flat in-plane index of each maximum (I64).
pub(crate) fn max_pool2d(
    s: &CpuStorage,
    l: &Layout,
    d: &PoolDims,
    p: &Pool2dParams,
) -> Result<(CpuStorage, CpuStorage)> {
    fn go<T: CpuElem + bytemuck::Pod>(
        v: &[T],
        l: &Layout,
        d: &PoolDims,
        p: &Pool2dParams,
    ) -> (CpuStorage, CpuStorage) {
        let _iso = crate::parallel::Isolated::new();
        let x = contiguous(v, l);
        if d.channels_last {
            let (vals, idx) = pool_nhwc::max_pool(&x, d, p);
            return (vals.into_storage(), idx.into_storage());
        }
        let out_plane = d.ho * d.wo;
        // Every output cell is written below (an empty window writes -inf and index -1).
        let mut vals = overwritten_buffer::<T>(d.planes * out_plane);
        let mut idx = overwritten_buffer::<i64>(d.planes * out_plane);
        if out_plane == 0 {
            return (vals.into_storage(), idx.into_storage());
        }
        let in_plane = d.h * d.w;
        // Without padding, dilation or ceil mode every window lies inside the plane: no
        // bounds tests; the common 2x2 window with stride 2 has its own unrolled loop.
        let plain = p.padding == [0, 0] && p.dilation == [1, 1] && !p.ceil_mode;
        let two_by_two = plain && p.kernel == [2, 2] && p.stride == [2, 2];
        let plane = |(pl, (dv, di)): (usize, (&mut [T], &mut [i64]))| {
            let src = &x[pl * in_plane..(pl + 1) * in_plane];
            if two_by_two {
                max_pool_2x2(src, d, dv, di);
                return;
            }
            if plain {
                let [kh, kw] = p.kernel;
                for oy in 0..d.ho {
                    for ox in 0..d.wo {
                        let k0 = oy * p.stride[0] * d.w + ox * p.stride[1];
                        let (mut bv, mut bi) = (src[k0].to_acc(), k0);
                        for ky in 0..kh {
                            let row = &src[k0 + ky * d.w..k0 + ky * d.w + kw];
                            for (kx, v) in row.iter().enumerate() {
                                let val = v.to_acc();
                                if val > bv || val.is_nan() && !bv.is_nan() {
                                    (bv, bi) = (val, k0 + ky * d.w + kx);
                                }
                            }
                        }
                        dv[oy * d.wo + ox] = T::from_acc(bv);
                        di[oy * d.wo + ox] = bi as i64;
                    }
                }
                return;
            }
            for oy in 0..d.ho {
                for ox in 0..d.wo {
                    let mut best = (T::Acc::neg_infinity(), -1i64);
                    for ky in 0..p.kernel[0] {
                        let iy = (oy * p.stride[0] + ky * p.dilation[0]) as isize
                            - p.padding[0] as isize;
                        if iy < 0 || iy >= d.h as isize {
                            continue;
                        }
                        for kx in 0..p.kernel[1] {
                            let ix = (ox * p.stride[1] + kx * p.dilation[1]) as isize
                                - p.padding[1] as isize;
                            if ix < 0 || ix >= d.w as isize {
                                continue;
                            }
                            let k = iy as usize * d.w + ix as usize;
                            let val = src[k].to_acc();
                            if best.1 < 0 || val > best.0 || val.is_nan() && !best.0.is_nan() {
                                best = (val, k as i64);
                            }
                        }
                    }
                    dv[oy * d.wo + ox] = T::from_acc(best.0);
                    di[oy * d.wo + ox] = best.1;
                }
            }
        };
        let jobs = vals.chunks_mut(out_plane).zip(idx.chunks_mut(out_plane));
        if x.len() >= PAR_MIN {
            jobs.enumerate()
                .collect::<Vec<_>>()
                .into_par_iter()
                .for_each(plane);
        } else {
            jobs.enumerate().for_each(plane);
        }
        (vals.into_storage(), idx.into_storage())
    }
    let l = &read_as(l, d)?;
    Ok(map_float!("max_pool2d", s, v => go(v, l, d, p)))
}

/// One plane of a 2x2, stride-2 max pool without padding: the same choice as the general loop
/// (the first maximum in row-major window order; a NaN wins and the first NaN is kept), with
/// the window unrolled.
fn max_pool_2x2<T: CpuElem>(src: &[T], d: &PoolDims, dv: &mut [T], di: &mut [i64]) {
    // Branch-free, on slices of exactly the lengths read, so the loop vectorises.
    #[inline(always)]
    fn pick<A: Float>(a: (A, i64), b: (A, i64)) -> (A, i64) {
        let take = (b.0 > a.0) | (b.0.is_nan() & !a.0.is_nan());
        (if take { b.0 } else { a.0 }, if take { b.1 } else { a.1 })
    }
    let w = d.w as i64;
    for oy in 0..d.ho {
        let top = 2 * oy * d.w;
        let (r0, r1) = (&src[top..][..2 * d.wo], &src[top + d.w..][..2 * d.wo]);
        let dv = &mut dv[oy * d.wo..][..d.wo];
        let di = &mut di[oy * d.wo..][..d.wo];
        for ox in 0..d.wo {
            let (x, i) = (2 * ox, (top + 2 * ox) as i64);
            let upper = pick((r0[x].to_acc(), i), (r0[x + 1].to_acc(), i + 1));
            let lower = pick((r1[x].to_acc(), i + w), (r1[x + 1].to_acc(), i + w + 1));
            let best = pick(upper, lower);
            dv[ox] = T::from_acc(best.0);
            di[ox] = best.1;
        }
    }
}

/// The backward of a pooling op: for every plane, `f(plane, g_plane, acc)` adds the output
/// gradients into an f32 (or f64) accumulator of the input plane, which is then rounded into
/// the input gradient.
fn scatter_planes<T: CpuElem + bytemuck::Pod>(
    g: &[T],
    lg: &Layout,
    d: &PoolDims,
    f: impl Fn(usize, &[T], &mut [T::Acc]) + Sync,
) -> CpuStorage {
    let _iso = crate::parallel::Isolated::new();
    let g = contiguous(g, lg);
    let (in_plane, out_plane) = (d.h * d.w, d.ho * d.wo);
    // Every plane is written whole from its accumulator.
    let mut gx = overwritten_buffer::<T>(d.planes * in_plane);
    if in_plane > 0 {
        gx.par_chunks_mut(in_plane)
            .enumerate()
            .for_each(|(p, dst)| {
                let mut acc = vec![T::Acc::zero(); in_plane];
                f(p, &g[p * out_plane..(p + 1) * out_plane], &mut acc);
                for (o, a) in dst.iter_mut().zip(acc) {
                    *o = T::from_acc(a);
                }
            });
    }
    gx.into_storage()
}

/// Backward of max pooling: each output gradient goes to the input cell its index names.
pub(crate) fn max_pool2d_backward(
    g: &CpuStorage,
    lg: &Layout,
    idx: &[i64],
    d: &PoolDims,
) -> Result<CpuStorage> {
    fn go<T: CpuElem>(g: &[T], lg: &Layout, idx: &[i64], d: &PoolDims) -> CpuStorage {
        if d.channels_last {
            return pool_nhwc::max_pool_backward(&contiguous(g, lg), idx, d).into_storage();
        }
        let out_plane = d.ho * d.wo;
        scatter_planes(g, lg, d, |p, g, acc| {
            for (k, gv) in g.iter().enumerate() {
                let i = idx[p * out_plane + k];
                if i >= 0 {
                    acc[i as usize] += gv.to_acc();
                }
            }
        })
    }
    let lg = &read_as(lg, d)?;
    Ok(map_float!("max_pool2d_backward", g, v => go(v, lg, idx, d)))
}

/// Average pooling.
pub(crate) fn avg_pool2d(
    s: &CpuStorage,
    l: &Layout,
    d: &PoolDims,
    p: &Pool2dParams,
) -> Result<CpuStorage> {
    fn go<T: CpuElem>(v: &[T], l: &Layout, d: &PoolDims, p: &Pool2dParams) -> CpuStorage {
        let x = contiguous(v, l);
        if d.channels_last {
            return pool_nhwc::avg_pool(&x, d, pool_nhwc::avg_windows(p, d)).into_storage();
        }
        per_plane(&x, d, d.ho * d.wo, |src, dst: &mut [T]| {
            for oy in 0..d.ho {
                let wy = avg_window(oy, p.kernel[0], p.stride[0], p.padding[0], d.h);
                for ox in 0..d.wo {
                    let wx = avg_window(ox, p.kernel[1], p.stride[1], p.padding[1], d.w);
                    let mut sum = T::Acc::zero();
                    for iy in wy.0..wy.1 {
                        for ix in wx.0..wx.1 {
                            sum += src[iy * d.w + ix].to_acc();
                        }
                    }
                    let div = <T::Acc as crate::dtype::Float>::from_f64_(avg_divisor(p, wy, wx));
                    dst[oy * d.wo + ox] = T::from_acc(sum / div);
                }
            }
        })
        .into_storage()
    }
    let l = &read_as(l, d)?;
    Ok(map_float!("avg_pool2d", s, v => go(v, l, d, p)))
}

/// Backward of average pooling.
pub(crate) fn avg_pool2d_backward(
    g: &CpuStorage,
    lg: &Layout,
    d: &PoolDims,
    p: &Pool2dParams,
) -> Result<CpuStorage> {
    fn go<T: CpuElem>(g: &[T], lg: &Layout, d: &PoolDims, p: &Pool2dParams) -> CpuStorage {
        if d.channels_last {
            let windows = pool_nhwc::avg_windows(p, d);
            return pool_nhwc::avg_pool_backward(&contiguous(g, lg), d, windows).into_storage();
        }
        scatter_planes(g, lg, d, |_, g, acc| {
            for oy in 0..d.ho {
                let wy = avg_window(oy, p.kernel[0], p.stride[0], p.padding[0], d.h);
                for ox in 0..d.wo {
                    let wx = avg_window(ox, p.kernel[1], p.stride[1], p.padding[1], d.w);
                    let div = <T::Acc as crate::dtype::Float>::from_f64_(avg_divisor(p, wy, wx));
                    let gv = g[oy * d.wo + ox].to_acc() / div;
                    for iy in wy.0..wy.1 {
                        for ix in wx.0..wx.1 {
                            acc[iy * d.w + ix] += gv;
                        }
                    }
                }
            }
        })
    }
    let lg = &read_as(lg, d)?;
    Ok(map_float!("avg_pool2d_backward", g, v => go(v, lg, d, p)))
}

/// Adaptive average pooling to `[ho, wo]`.
pub(crate) fn adaptive_avg_pool2d(s: &CpuStorage, l: &Layout, d: &PoolDims) -> Result<CpuStorage> {
    fn go<T: CpuElem>(v: &[T], l: &Layout, d: &PoolDims) -> CpuStorage {
        let x = contiguous(v, l);
        if d.channels_last {
            return pool_nhwc::avg_pool(&x, d, pool_nhwc::adaptive_windows(d)).into_storage();
        }
        per_plane(&x, d, d.ho * d.wo, |src, dst: &mut [T]| {
            for oy in 0..d.ho {
                let (y0, y1) = adaptive_window(oy, d.ho, d.h);
                for ox in 0..d.wo {
                    let (x0, x1) = adaptive_window(ox, d.wo, d.w);
                    let mut sum = T::Acc::zero();
                    for iy in y0..y1 {
                        for ix in x0..x1 {
                            sum += src[iy * d.w + ix].to_acc();
                        }
                    }
                    let n =
                        <T::Acc as crate::dtype::Float>::from_f64_(((y1 - y0) * (x1 - x0)) as f64);
                    dst[oy * d.wo + ox] = T::from_acc(sum / n);
                }
            }
        })
        .into_storage()
    }
    let l = &read_as(l, d)?;
    Ok(map_float!("adaptive_avg_pool2d", s, v => go(v, l, d)))
}

/// Backward of adaptive average pooling.
pub(crate) fn adaptive_avg_pool2d_backward(
    g: &CpuStorage,
    lg: &Layout,
    d: &PoolDims,
) -> Result<CpuStorage> {
    fn go<T: CpuElem>(g: &[T], lg: &Layout, d: &PoolDims) -> CpuStorage {
        if d.channels_last {
            let windows = pool_nhwc::adaptive_windows(d);
            return pool_nhwc::avg_pool_backward(&contiguous(g, lg), d, windows).into_storage();
        }
        scatter_planes(g, lg, d, |_, g, acc| {
            for oy in 0..d.ho {
                let (y0, y1) = adaptive_window(oy, d.ho, d.h);
                for ox in 0..d.wo {
                    let (x0, x1) = adaptive_window(ox, d.wo, d.w);
                    let n =
                        <T::Acc as crate::dtype::Float>::from_f64_(((y1 - y0) * (x1 - x0)) as f64);
                    let gv = g[oy * d.wo + ox].to_acc() / n;
                    for iy in y0..y1 {
                        for ix in x0..x1 {
                            acc[iy * d.w + ix] += gv;
                        }
                    }
                }
            }
        })
    }
    let lg = &read_as(lg, d)?;
    Ok(map_float!("adaptive_avg_pool2d_backward", g, v => go(v, lg, d)))
}
