//! 2-D convolution by im2col + GEMM: forward, backward to the input, backward to the weight.
//! Half inputs are computed in f32 and rounded once on store.

use super::conv_common::{images_per_group, mat, sum_over_images, valid_cols};
use super::conv_nhwc;
use super::matmul::{gemm_into, GemmFloat};
use super::{contiguous, overwritten_buffer, CpuStorage, IntoStorage};
use crate::backend::spec::ConvDims;
use crate::layout::Layout;
use crate::{DType, Error, Result};
use rayon::prelude::*;
use std::borrow::Cow;

/// Unfolds one group of an image (`x` starts at its first channel) into `col`, `[kr, ho*wo]`
/// with rows `ld` apart (`ld > ho*wo` when several images sit side by side).
fn im2col<F: GemmFloat>(x: &[F], d: &ConvDims, col: &mut [F], ld: usize) {
    let (sh, sw) = (d.p.stride[0], d.p.stride[1]);
    let (ph, pw) = (d.p.padding[0] as isize, d.p.padding[1] as isize);
    let (dh, dw) = (d.p.dilation[0], d.p.dilation[1]);
    let plane = d.plane();
    for c in 0..d.cg() {
        let xc = &x[c * d.h * d.w..(c + 1) * d.h * d.w];
        for ky in 0..d.kh {
            for kx in 0..d.kw {
                let row = (c * d.kh + ky) * d.kw + kx;
                let dst = &mut col[row * ld..row * ld + plane];
                let cols = valid_cols(d.wo, d.w, sw, kx * dw, pw as usize);
                for oy in 0..d.ho {
                    let iy = (oy * sh + ky * dh) as isize - ph;
                    let drow = &mut dst[oy * d.wo..(oy + 1) * d.wo];
                    if iy < 0 || iy >= d.h as isize || cols.is_empty() {
                        drow.fill(F::zero());
                        continue;
                    }
                    let xr = &xc[iy as usize * d.w..(iy as usize + 1) * d.w];
                    drow[..cols.start].fill(F::zero());
                    drow[cols.end..].fill(F::zero());
                    let first = cols.start * sw + kx * dw - pw as usize;
                    if sw == 1 {
                        drow[cols.clone()].copy_from_slice(&xr[first..first + cols.len()]);
                    } else {
                        for (k, v) in drow[cols.clone()].iter_mut().enumerate() {
                            *v = xr[first + k * sw];
                        }
                    }
                }
            }
        }
    }
}

/// The adjoint of [`im2col`]: adds each column entry back to its input cell.
fn col2im<F: GemmFloat>(col: &[F], d: &ConvDims, x: &mut [F], ld: usize) {
    let (sh, sw) = (d.p.stride[0], d.p.stride[1]);
    let (ph, pw) = (d.p.padding[0] as isize, d.p.padding[1] as isize);
    let (dh, dw) = (d.p.dilation[0], d.p.dilation[1]);
    let plane = d.plane();
    for c in 0..d.cg() {
        let xc = &mut x[c * d.h * d.w..(c + 1) * d.h * d.w];
        for ky in 0..d.kh {
            for kx in 0..d.kw {
                let row = (c * d.kh + ky) * d.kw + kx;
                let src = &col[row * ld..row * ld + plane];
                let cols = valid_cols(d.wo, d.w, sw, kx * dw, pw as usize);
                if cols.is_empty() {
                    continue;
                }
                let first = cols.start * sw + kx * dw - pw as usize;
                for oy in 0..d.ho {
                    let iy = (oy * sh + ky * dh) as isize - ph;
                    if iy < 0 || iy >= d.h as isize {
                        continue;
                    }
                    let xr = &mut xc[iy as usize * d.w..(iy as usize + 1) * d.w];
                    let s = &src[oy * d.wo + cols.start..oy * d.wo + cols.end];
                    if sw == 1 {
                        // Contiguous on both sides: a plain vectorisable add.
                        for (a, &v) in xr[first..first + s.len()].iter_mut().zip(s) {
                            *a += v;
                        }
                    } else {
                        for (k, &v) in s.iter().enumerate() {
                            xr[first + k * sw] += v;
                        }
                    }
                }
            }
        }
    }
}

/// One group's output gradient of `images` images, `[og, images x plane]`: the images side
/// by side, as [`im2col`] lays out their columns. Borrowed for a single image.
fn gather_rows<'a, F: GemmFloat>(
    gy: &'a [F],
    d: &ConvDims,
    images: std::ops::Range<usize>,
    g: usize,
) -> (Cow<'a, [F]>, usize) {
    let (og, plane) = (d.og(), d.plane());
    let at = |n: usize| n * d.o * plane + g * og * plane;
    if images.len() == 1 {
        return (Cow::Borrowed(&gy[at(images.start)..]), plane);
    }
    let ld = images.len() * plane;
    let mut out = overwritten_buffer(og * ld);
    for (i, n) in images.enumerate() {
        let src = &gy[at(n)..at(n) + og * plane];
        for (dst, row) in out.chunks_exact_mut(ld).zip(src.chunks_exact(plane)) {
            dst[i * plane..(i + 1) * plane].copy_from_slice(row);
        }
    }
    (Cow::Owned(out), ld)
}

fn forward<F: GemmFloat>(x: &[F], w: &[F], d: &ConvDims) -> Vec<F> {
    let _iso = crate::parallel::Isolated::new();
    let (cg, og, kr, plane) = (d.cg(), d.og(), d.krows(), d.plane());
    let img_in = d.c * d.h * d.w;
    let mut out = overwritten_buffer(d.n * d.o * plane);
    let per = images_per_group(d);
    let par_groups = d.n > per;
    let job = |(k, dst): (usize, &mut [F])| {
        let images = dst.len() / (d.o * plane);
        let ld = images * plane;
        let mut col = overwritten_buffer(kr * ld);
        let mut res = overwritten_buffer(if images > 1 { og * ld } else { 0 });
        for g in 0..d.p.groups {
            for i in 0..images {
                let n = k * per + i;
                im2col(
                    &x[n * img_in + g * cg * d.h * d.w..],
                    d,
                    &mut col[i * plane..],
                    ld,
                );
            }
            let a = mat(w, g * og * kr, kr, 1);
            let b = mat(&col, 0, ld, 1);
            if images == 1 {
                let dst_g = &mut dst[g * og * plane..(g + 1) * og * plane];
                gemm_into(og, plane, kr, dst_g, false, a, b, !par_groups);
                continue;
            }
            gemm_into(og, ld, kr, &mut res, false, a, b, !par_groups);
            // Each image's rows of the product to its own output block.
            for (i, img) in dst.chunks_exact_mut(d.o * plane).enumerate() {
                let img_g = &mut img[g * og * plane..(g + 1) * og * plane];
                for (to, row) in img_g.chunks_exact_mut(plane).zip(res.chunks_exact(ld)) {
                    to.copy_from_slice(&row[i * plane..(i + 1) * plane]);
                }
            }
        }
    };
    if par_groups {
        out.par_chunks_mut(per * d.o * plane)
            .enumerate()
            .for_each(job);
    } else {
        out.chunks_mut(per * d.o * plane).enumerate().for_each(job);
    }
    out
}

fn backward_input<F: GemmFloat>(gy: &[F], w: &[F], d: &ConvDims) -> Vec<F> {
    let _iso = crate::parallel::Isolated::new();
    let (cg, og, kr, plane) = (d.cg(), d.og(), d.krows(), d.plane());
    let img_in = d.c * d.h * d.w;
    let mut gx = vec![F::zero(); d.n * img_in];
    let per = images_per_group(d);
    let par_groups = d.n > per;
    let job = |(k, dst): (usize, &mut [F])| {
        let images = dst.len() / img_in;
        let ld = images * plane;
        let mut col = overwritten_buffer(kr * ld);
        for g in 0..d.p.groups {
            // col (kr x images*plane) = W_g^T (kr x og) * gy_g (og x images*plane)
            let wt = mat(w, g * og * kr, 1, kr);
            let (rows, rs) = gather_rows(gy, d, k * per..k * per + images, g);
            let gyg = mat(&rows, 0, rs, 1);
            gemm_into(kr, ld, og, &mut col, false, wt, gyg, !par_groups);
            for (i, img) in dst.chunks_exact_mut(img_in).enumerate() {
                col2im(&col[i * plane..], d, &mut img[g * cg * d.h * d.w..], ld);
            }
        }
    };
    if par_groups {
        gx.par_chunks_mut(per * img_in).enumerate().for_each(job);
    } else {
        gx.chunks_mut(per * img_in).enumerate().for_each(job);
    }
    gx
}

fn backward_weight<F: GemmFloat>(x: &[F], gy: &[F], d: &ConvDims) -> Vec<F> {
    let (cg, og, kr, plane) = (d.cg(), d.og(), d.krows(), d.plane());
    let img_in = d.c * d.h * d.w;
    let wlen = d.o * kr;
    let per = images_per_group(d);
    let partial = |images: std::ops::Range<usize>, parallel: bool| -> Vec<F> {
        let mut gw = vec![F::zero(); wlen];
        let mut col = overwritten_buffer(kr * per.min(images.len()) * plane);
        for first in images.clone().step_by(per) {
            let group = first..(first + per).min(images.end);
            let ld = group.len() * plane;
            for g in 0..d.p.groups {
                for (i, n) in group.clone().enumerate() {
                    let xn = &x[n * img_in + g * cg * d.h * d.w..];
                    im2col(xn, d, &mut col[i * plane..], ld);
                }
                // gW_g (og x kr) += gy_g (og x images*plane) * col^T (images*plane x kr)
                let (rows, rs) = gather_rows(gy, d, group.clone(), g);
                let gyg = mat(&rows, 0, rs, 1);
                let colt = mat(&col, 0, 1, ld);
                let dst = &mut gw[g * og * kr..(g + 1) * og * kr];
                gemm_into(og, kr, ld, dst, true, gyg, colt, parallel);
            }
        }
        gw
    };
    sum_over_images(d.n, wlen, partial)
}

/// An operand in its compute type (f32 for f32/f16/bf16, f64 for f64), contiguous: borrowed
/// when the storage already is that, so f32 and f64 convolutions copy nothing.
enum Wide<'a> {
    F32(Cow<'a, [f32]>),
    F64(Cow<'a, [f64]>),
}

fn widen<'a>(op: &'static str, s: &'a CpuStorage, l: &Layout) -> Result<Wide<'a>> {
    Ok(match s {
        CpuStorage::F64(v) => Wide::F64(contiguous(v, l)),
        CpuStorage::F32(v) => Wide::F32(contiguous(v, l)),
        CpuStorage::F16(_) | CpuStorage::BF16(_) => match s.to_dtype(l, DType::F32) {
            CpuStorage::F32(v) => Wide::F32(Cow::Owned(v)),
            _ => unreachable!("to_dtype(F32) gives F32"),
        },
        _ => {
            return Err(Error::DType {
                op,
                dtype: s.dtype(),
                expected: "a float dtype",
            })
        }
    })
}

/// Runs `f32_fn` or `f64_fn` on the widened operands and narrows the result back.
fn run2(
    op: &'static str,
    a: (&CpuStorage, &Layout),
    b: (&CpuStorage, &Layout),
    f32_fn: impl FnOnce(&[f32], &[f32]) -> Vec<f32>,
    f64_fn: impl FnOnce(&[f64], &[f64]) -> Vec<f64>,
) -> Result<CpuStorage> {
    if a.0.dtype() != b.0.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: a.0.dtype(),
            rhs: b.0.dtype(),
        });
    }
    let out = match (widen(op, a.0, a.1)?, widen(op, b.0, b.1)?) {
        (Wide::F32(x), Wide::F32(y)) => f32_fn(&x, &y).into_storage(),
        (Wide::F64(x), Wide::F64(y)) => f64_fn(&x, &y).into_storage(),
        _ => unreachable!("same dtype widens alike"),
    };
    Ok(if out.dtype() == a.0.dtype() {
        out
    } else {
        out.to_dtype(&Layout::contiguous(&[out.len()]), a.0.dtype())
    })
}

/// The layout of an `[n, c, h, w]` (or `[o, c, kh, kw]`) view read in NHWC (KRSC) order.
fn nhwc(op: &'static str, l: &Layout) -> Result<Layout> {
    l.permute(op, &[0, 2, 3, 1])
}

/// Runs a pass with both operands read in the convolution's memory format: NCHW / KCRS
/// (`conv.rs`'s kernels), or NHWC / KRSC (`conv_nhwc.rs`'s) when `d.channels_last`. The
/// result is in the same format.
fn pass<P: ConvPass>(
    d: &ConvDims,
    (a, la): (&CpuStorage, &Layout),
    (b, lb): (&CpuStorage, &Layout),
) -> Result<CpuStorage> {
    if !d.channels_last {
        let (f, g) = (
            |x: &[f32], y: &[f32]| P::nchw(x, y, d),
            |x: &[f64], y: &[f64]| P::nchw(x, y, d),
        );
        return run2(P::OP, (a, la), (b, lb), f, g);
    }
    let (la, lb) = (nhwc(P::OP, la)?, nhwc(P::OP, lb)?);
    let (f, g) = (
        |x: &[f32], y: &[f32]| P::nhwc(x, y, d),
        |x: &[f64], y: &[f64]| P::nhwc(x, y, d),
    );
    run2(P::OP, (a, &la), (b, &lb), f, g)
}

/// One of the three passes, with its kernel in each memory format.
trait ConvPass {
    const OP: &'static str;
    fn nchw<F: GemmFloat>(a: &[F], b: &[F], d: &ConvDims) -> Vec<F>;
    fn nhwc<F: GemmFloat>(a: &[F], b: &[F], d: &ConvDims) -> Vec<F>;
}

struct Forward;
impl ConvPass for Forward {
    const OP: &'static str = "conv2d";
    fn nchw<F: GemmFloat>(x: &[F], w: &[F], d: &ConvDims) -> Vec<F> {
        forward(x, w, d)
    }
    fn nhwc<F: GemmFloat>(x: &[F], w: &[F], d: &ConvDims) -> Vec<F> {
        conv_nhwc::forward(x, w, d)
    }
}

struct Input;
impl ConvPass for Input {
    const OP: &'static str = "conv2d_backward_input";
    fn nchw<F: GemmFloat>(gy: &[F], w: &[F], d: &ConvDims) -> Vec<F> {
        backward_input(gy, w, d)
    }
    fn nhwc<F: GemmFloat>(gy: &[F], w: &[F], d: &ConvDims) -> Vec<F> {
        conv_nhwc::backward_input(gy, w, d)
    }
}

struct Weight;
impl ConvPass for Weight {
    const OP: &'static str = "conv2d_backward_weight";
    fn nchw<F: GemmFloat>(x: &[F], gy: &[F], d: &ConvDims) -> Vec<F> {
        backward_weight(x, gy, d)
    }
    fn nhwc<F: GemmFloat>(x: &[F], gy: &[F], d: &ConvDims) -> Vec<F> {
        conv_nhwc::backward_weight(x, gy, d)
    }
}

/// Forward convolution; output `[n, o, ho, wo]` in the activations' format.
pub(crate) fn conv2d(
    x: &CpuStorage,
    lx: &Layout,
    w: &CpuStorage,
    lw: &Layout,
    d: &ConvDims,
) -> Result<CpuStorage> {
    pass::<Forward>(d, (x, lx), (w, lw))
}

/// Gradient with respect to the input, `[n, c, h, w]` in the activations' format.
pub(crate) fn conv2d_backward_input(
    gy: &CpuStorage,
    lgy: &Layout,
    w: &CpuStorage,
    lw: &Layout,
    d: &ConvDims,
) -> Result<CpuStorage> {
    pass::<Input>(d, (gy, lgy), (w, lw))
}

/// Gradient with respect to the weight, `[o, c / groups, kh, kw]` in the convolution's
/// format (KRSC when channels-last, as the GPU's cuDNN gives it).
pub(crate) fn conv2d_backward_weight(
    x: &CpuStorage,
    lx: &Layout,
    gy: &CpuStorage,
    lgy: &Layout,
    d: &ConvDims,
) -> Result<CpuStorage> {
    pass::<Weight>(d, (x, lx), (gy, lgy))
}
