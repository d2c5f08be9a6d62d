//! Backend-neutral descriptors that both backends read: the sizes of a convolution and of a
//! pooling op, and the multi-index walk over a layout that the indexing kernels' host sides
//! share. Neither backend imports the other's internals for these.

use crate::backend::ops::Conv2dParams;
use crate::layout::Layout;

/// Sizes of one convolution: input `[n, c, h, w]`, weight `[o, c / groups, kh, kw]`,
/// output `[n, o, ho, wo]`, and the memory format of the activations (input, output and
/// their gradients) and of the weight's gradient: NCHW / KCRS, or NHWC / KRSC when
/// `channels_last`. Weights are read as their layouts say.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConvDims {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub o: usize,
    pub kh: usize,
    pub kw: usize,
    pub ho: usize,
    pub wo: usize,
    pub p: Conv2dParams,
    pub channels_last: bool,
}

impl ConvDims {
    /// Input channels per group.
    pub(crate) fn cg(&self) -> usize {
        self.c / self.p.groups
    }
    /// Output channels per group.
    pub(crate) fn og(&self) -> usize {
        self.o / self.p.groups
    }
    /// Rows of one group's unfolded input (`cg * kh * kw`).
    pub(crate) fn krows(&self) -> usize {
        self.cg() * self.kh * self.kw
    }
    /// Output positions per image and channel (`ho * wo`).
    pub(crate) fn plane(&self) -> usize {
        self.ho * self.wo
    }
}

/// Input and output plane sizes of a pooling op over `[n, c, h, w]`, and whether the input
/// is channels-last: then both backends pool NHWC in place and return NHWC outputs and
/// input gradients (`cpu/pool_nhwc.rs` on the CPU).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PoolDims {
    pub planes: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub ho: usize,
    pub wo: usize,
    pub channels_last: bool,
}

/// Storage offset, under `l`, of the element at multi-index `pos` with `pos[dim]` replaced by
/// `at`.
pub(crate) fn offset_with(l: &Layout, pos: &[usize], dim: usize, at: usize) -> usize {
    let mut o = l.offset();
    for (d, (&p, &s)) in pos.iter().zip(l.strides()).enumerate() {
        o += if d == dim { at } else { p } * s;
    }
    o
}

/// Advances a row-major multi-index over `shape`.
pub(crate) fn step(pos: &mut [usize], shape: &[usize]) {
    for d in (0..shape.len()).rev() {
        pos[d] += 1;
        if pos[d] < shape[d] {
            return;
        }
        pos[d] = 0;
    }
}
