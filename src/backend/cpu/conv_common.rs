//! What the two layouts' convolution kernels share (`conv.rs` for NCHW, `conv_nhwc.rs` for
//! NHWC): the output columns a filter tap reaches, matrix views for the products, how many
//! images one product takes, and a weight gradient summed over images.

use super::matmul::{GemmFloat, MatRef};
use crate::backend::spec::ConvDims;
use rayon::prelude::*;

/// The output columns `ox` whose input column `ox * stride + off - pad` lies in `0..w`.
pub(super) fn valid_cols(
    wo: usize,
    w: usize,
    stride: usize,
    off: usize,
    pad: usize,
) -> std::ops::Range<usize> {
    // ix = ox * stride + off - pad >= 0  <=>  ox >= (pad - off) / stride, rounded up.
    let lo = if pad > off {
        (pad - off).div_ceil(stride)
    } else {
        0
    };
    // ix < w  <=>  ox * stride < w + pad - off.
    let hi = if w + pad > off {
        (w + pad - off).div_ceil(stride).min(wo)
    } else {
        0
    };
    lo.min(hi)..hi
}

/// The matrix at `off` in `data` with row stride `rs` and column stride `cs`.
pub(super) fn mat<F>(data: &[F], off: usize, rs: usize, cs: usize) -> MatRef<'_, F> {
    MatRef { data, off, rs, cs }
}

/// Images unfolded together into one product, so that its columns (`images x ho*wo`)
/// number about 256: with a few output pixels per image (a ResNet's last stages: 4 or 16),
/// a product per image is too narrow to fill the vector lanes, and reads the whole weight
/// once per image. At most `n / threads` images a group, so every thread gets one.
pub(super) fn images_per_group(d: &ConvDims) -> usize {
    let per_thread = d.n.div_ceil(crate::parallel::threads().max(1));
    256usize.div_ceil(d.plane()).min(per_thread).max(1)
}

/// A weight gradient summed over `n` images: the images split across the pool, each part
/// summed by `partial(images, parallel)` (its products single-threaded), then the parts added;
/// a single image is one part with parallel products.
pub(super) fn sum_over_images<F: GemmFloat>(
    n: usize,
    wlen: usize,
    partial: impl Fn(std::ops::Range<usize>, bool) -> Vec<F> + Sync,
) -> Vec<F> {
    let _iso = crate::parallel::Isolated::new();
    if n <= 1 {
        return partial(0..n, true);
    }
    let per = n.div_ceil(rayon::current_num_threads().max(1));
    let parts: Vec<Vec<F>> = (0..n.div_ceil(per))
        .into_par_iter()
        .map(|t| partial(t * per..((t + 1) * per).min(n), false))
        .collect();
    let mut gw = vec![F::zero(); wlen];
    for p in parts {
        for (a, b) in gw.iter_mut().zip(p) {
            *a += b;
        }
    }
    gw
}
