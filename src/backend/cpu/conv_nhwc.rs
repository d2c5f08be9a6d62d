//! Channels-last (NHWC) convolution on the CPU, read and written in place: each output
//! pixel's window is one row of the unfolded matrix, its channels side by side, so an image's
//! product is `[pixels, kh kw c] x [kh kw c, o]` straight into the NHWC output, and the
//! weight's gradient comes out KRSC, the channels-last weight's own order. A 1x1 convolution
//! with stride 1 and no padding needs no unfolding at all: the whole batch is one product.
//!
//! The NCHW kernels are in `conv.rs`; both give the same values up to summation order.

use super::conv_common::{images_per_group, mat, sum_over_images, valid_cols};
use super::matmul::{gemm_into, gemm_into_ld, GemmFloat};
use super::{overwritten_buffer, per_chunk};
use crate::backend::spec::ConvDims;

/// Whether the convolution is a plain product over pixels: 1x1, stride 1, no padding, one
/// group (dilation does not matter for a 1x1 window).
fn pointwise(d: &ConvDims) -> bool {
    d.kh == 1 && d.kw == 1 && d.p.stride == [1, 1] && d.p.padding == [0, 0] && d.p.groups == 1
}

/// Where a window's taps fall in the input: `row` and `col` give the input row and column of
/// a tap of an output pixel, `None` in the padding.
struct Window {
    sh: usize,
    sw: usize,
    ph: isize,
    pw: isize,
    dh: usize,
    dw: usize,
}

impl Window {
    fn new(d: &ConvDims) -> Window {
        Window {
            sh: d.p.stride[0],
            sw: d.p.stride[1],
            ph: d.p.padding[0] as isize,
            pw: d.p.padding[1] as isize,
            dh: d.p.dilation[0],
            dw: d.p.dilation[1],
        }
    }
    fn row(&self, oy: usize, ky: usize, h: usize) -> Option<usize> {
        let iy = (oy * self.sh + ky * self.dh) as isize - self.ph;
        (0..h as isize).contains(&iy).then_some(iy as usize)
    }
    fn col(&self, ox: usize, kx: usize, w: usize) -> Option<usize> {
        let ix = (ox * self.sw + kx * self.dw) as isize - self.pw;
        (0..w as isize).contains(&ix).then_some(ix as usize)
    }
}

/// Unfolds group `g` of one NHWC image into `col`, `[ho wo, kh kw cg]`.
fn im2col<F: GemmFloat>(x: &[F], d: &ConvDims, g: usize, col: &mut [F]) {
    let (cg, win) = (d.c / d.p.groups, Window::new(d));
    let kr = d.kh * d.kw * cg;
    // Whole window rows at once where they are one run of the input: one group, taps side
    // by side, and the row inside the image.
    let runs = d.p.groups == 1 && win.dw == 1;
    let first = valid_cols(d.wo, d.w, win.sw, 0, win.pw as usize);
    let last = valid_cols(d.wo, d.w, win.sw, (d.kw - 1) * win.dw, win.pw as usize);
    for oy in 0..d.ho {
        for ox in 0..d.wo {
            let row = &mut col[(oy * d.wo + ox) * kr..][..kr];
            let whole = runs && first.contains(&ox) && last.contains(&ox);
            for ky in 0..d.kh {
                let taps = &mut row[ky * d.kw * cg..][..d.kw * cg];
                let Some(iy) = win.row(oy, ky, d.h) else {
                    taps.fill(F::zero());
                    continue;
                };
                let line = &x[iy * d.w * d.c..][..d.w * d.c];
                if whole {
                    let ix = ox * win.sw - win.pw as usize;
                    taps.copy_from_slice(&line[ix * d.c..][..d.kw * d.c]);
                    continue;
                }
                for (kx, dst) in taps.chunks_mut(cg).enumerate() {
                    match win.col(ox, kx, d.w) {
                        Some(ix) => dst.copy_from_slice(&line[ix * d.c + g * cg..][..cg]),
                        None => dst.fill(F::zero()),
                    }
                }
            }
        }
    }
}

/// The adjoint of [`im2col`]: adds each entry of `col` back into its cell of group `g` of
/// the NHWC image `x`.
fn col2im<F: GemmFloat>(col: &[F], d: &ConvDims, g: usize, x: &mut [F]) {
    let (cg, win) = (d.c / d.p.groups, Window::new(d));
    let kr = d.kh * d.kw * cg;
    for oy in 0..d.ho {
        for ox in 0..d.wo {
            let row = &col[(oy * d.wo + ox) * kr..][..kr];
            for ky in 0..d.kh {
                let Some(iy) = win.row(oy, ky, d.h) else {
                    continue;
                };
                for kx in 0..d.kw {
                    let Some(ix) = win.col(ox, kx, d.w) else {
                        continue;
                    };
                    let src = &row[(ky * d.kw + kx) * cg..][..cg];
                    let dst = &mut x[(iy * d.w + ix) * d.c + g * cg..][..cg];
                    for (a, &v) in dst.iter_mut().zip(src) {
                        *a += v;
                    }
                }
            }
        }
    }
}

/// `y [n, ho, wo, o] = conv(x [n, h, w, c], w [o, kh, kw, c / groups])`.
pub(super) fn forward<F: GemmFloat>(x: &[F], w: &[F], d: &ConvDims) -> Vec<F> {
    let (cg, og, plane) = (d.c / d.p.groups, d.o / d.p.groups, d.ho * d.wo);
    let kr = d.kh * d.kw * cg;
    let mut out = overwritten_buffer(d.n * plane * d.o);
    if pointwise(d) {
        // y [n h w, o] = x [n h w, c] w^T.
        let wt = mat(w, 0, 1, d.c);
        gemm_into(
            d.n * plane,
            d.o,
            d.c,
            &mut out,
            false,
            mat(x, 0, d.c, 1),
            wt,
            true,
        );
        return out;
    }
    // Several small images' rows stacked into one product (see `images_per_group`); their
    // outputs are consecutive rows of the NHWC output.
    let (img_in, per) = (d.h * d.w * d.c, images_per_group(d));
    per_chunk(&mut out, per * plane * d.o, d.n > per, |k, dst| {
        let images = dst.len() / (plane * d.o);
        let mut col = overwritten_buffer(images * plane * kr);
        for g in 0..d.p.groups {
            for (i, n) in (k * per..k * per + images).enumerate() {
                im2col(
                    &x[n * img_in..][..img_in],
                    d,
                    g,
                    &mut col[i * plane * kr..][..plane * kr],
                );
            }
            // This group's output channels: y_g [rows, og] = col [rows, kr] w_g^T.
            let wt = mat(w, g * og * kr, 1, kr);
            let a = mat(&col, 0, kr, 1);
            let dst = &mut dst[g * og..];
            gemm_into_ld(images * plane, og, kr, dst, d.o, false, a, wt, d.n <= per);
        }
    });
    out
}

/// `gx [n, h, w, c]` from `gy [n, ho, wo, o]` and `w [o, kh, kw, c / groups]`.
pub(super) fn backward_input<F: GemmFloat>(gy: &[F], w: &[F], d: &ConvDims) -> Vec<F> {
    let (og, plane) = (d.o / d.p.groups, d.ho * d.wo);
    let kr = d.kh * d.kw * d.c / d.p.groups;
    if pointwise(d) {
        // gx [n h w, c] = gy [n h w, o] w [o, c].
        let mut gx = overwritten_buffer(d.n * plane * d.c);
        let (a, b) = (mat(gy, 0, d.o, 1), mat(w, 0, d.c, 1));
        gemm_into(d.n * plane, d.c, d.o, &mut gx, false, a, b, true);
        return gx;
    }
    let (img_in, per) = (d.h * d.w * d.c, images_per_group(d));
    let mut gx = vec![F::zero(); d.n * img_in];
    per_chunk(&mut gx, per * img_in, d.n > per, |k, dst| {
        let images = dst.len() / img_in;
        let rows = images * plane;
        let mut col = overwritten_buffer(rows * kr);
        for g in 0..d.p.groups {
            // col [rows, kr] = gy_g [rows, og] w_g [og, kr].
            let a = mat(gy, k * per * plane * d.o + g * og, d.o, 1);
            let b = mat(w, g * og * kr, kr, 1);
            gemm_into(rows, kr, og, &mut col, false, a, b, d.n <= per);
            for (i, img) in dst.chunks_exact_mut(img_in).enumerate() {
                col2im(&col[i * plane * kr..][..plane * kr], d, g, img);
            }
        }
    });
    gx
}

/// `gw [o, kh, kw, c / groups]` (KRSC) from `x [n, h, w, c]` and `gy [n, ho, wo, o]`.
pub(super) fn backward_weight<F: GemmFloat>(x: &[F], gy: &[F], d: &ConvDims) -> Vec<F> {
    let (og, plane) = (d.o / d.p.groups, d.ho * d.wo);
    let kr = d.kh * d.kw * d.c / d.p.groups;
    let wlen = d.o * kr;
    if pointwise(d) {
        // gw [o, c] = gy^T [o, n h w] x [n h w, c].
        let mut gw = overwritten_buffer(wlen);
        let (a, b) = (mat(gy, 0, 1, d.o), mat(x, 0, d.c, 1));
        gemm_into(d.o, d.c, d.n * plane, &mut gw, false, a, b, true);
        return gw;
    }
    let (img_in, per) = (d.h * d.w * d.c, images_per_group(d));
    let partial = |images: std::ops::Range<usize>, parallel: bool| -> Vec<F> {
        let mut gw = vec![F::zero(); wlen];
        let mut col = overwritten_buffer(per.min(images.len()) * plane * kr);
        for first in images.clone().step_by(per) {
            let group = first..(first + per).min(images.end);
            let rows = group.len() * plane;
            for g in 0..d.p.groups {
                for (i, n) in group.clone().enumerate() {
                    im2col(
                        &x[n * img_in..][..img_in],
                        d,
                        g,
                        &mut col[i * plane * kr..][..plane * kr],
                    );
                }
                // gw_g [og, kr] += gy_g^T [og, rows] col [rows, kr].
                let a = mat(gy, first * plane * d.o + g * og, 1, d.o);
                let dst = &mut gw[g * og * kr..][..og * kr];
                gemm_into(og, kr, rows, dst, true, a, mat(&col, 0, kr, 1), parallel);
            }
        }
        gw
    };
    sum_over_images(d.n, wlen, partial)
}
