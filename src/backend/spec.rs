//! Backend-neutral descriptors that both backends read: the geometry of a convolution or
//! pooling window as the user gives it, the sizes of a convolution and of a
//! pooling op, the `[outer, channels, inner]` view of batch norm, the gradients an LSTM
//! cell's backward starts from, the multi-index walk over a layout that the indexing
//! kernels' host sides share, and the ranges of storages the multi-tensor passes walk.
//! Neither backend imports the other's internals for these.

use crate::layout::Layout;
use crate::{Error, Result};
use std::ops::Range;

/// Elements `range` of `storage`, in storage order: one tensor of a multi-tensor pass (the
/// loss scaler's unscale, clipping's sum of squares, the fused optimizer's gradient). The
/// storage may hold more than the range: a gradient that is a view of a data-parallel
/// bucket is walked where it lies, without a copy.
pub(crate) struct Span<'a, S> {
    pub storage: &'a S,
    pub range: Range<usize>,
}

impl<'a, S> Span<'a, S> {
    /// The whole of `storage`, of `len` elements.
    #[cfg_attr(not(feature = "cuda-backend"), allow(dead_code))]
    pub(crate) fn whole(storage: &'a S, len: usize) -> Span<'a, S> {
        Span {
            storage,
            range: 0..len,
        }
    }

    /// The number of elements.
    #[cfg_attr(not(feature = "cuda-backend"), allow(dead_code))]
    pub(crate) fn len(&self) -> usize {
        self.range.len()
    }

    /// The same range of `f(storage)` (another view of the same storage: a backend's part).
    pub(crate) fn map<T>(&self, f: impl FnOnce(&'a S) -> &'a T) -> Span<'a, T> {
        Span {
            storage: f(self.storage),
            range: self.range.clone(),
        }
    }
}

impl<S> Clone for Span<'_, S> {
    fn clone(&self) -> Self {
        Span {
            storage: self.storage,
            range: self.range.clone(),
        }
    }
}

/// `Err` naming `op` unless `range` lies within a storage of `len` elements.
pub(crate) fn check_within(op: &'static str, range: &Range<usize>, len: usize) -> Result<()> {
    if range.start > range.end || range.end > len {
        return Err(Error::invalid(
            op,
            format!("elements {range:?} are outside a storage of {len}"),
        ));
    }
    Ok(())
}

/// The ranges taken so far on each storage (named by a key: an index or an address), to
/// tell whether a new one overlaps them.
#[derive(Default)]
pub(crate) struct Taken(std::collections::HashMap<usize, std::collections::BTreeMap<usize, usize>>);

impl Taken {
    /// Takes `r` on storage `key` and returns true, or returns false (taking nothing) when
    /// it overlaps a range taken there before. An empty range overlaps nothing.
    pub(crate) fn take(&mut self, key: usize, r: &Range<usize>) -> bool {
        if r.is_empty() {
            return true;
        }
        // Ranges on one storage by start (each start once: they do not overlap).
        let taken = self.0.entry(key).or_default();
        let before = taken.range(..=r.start).next_back();
        let after = taken.range(r.start..).next();
        let overlaps = before.is_some_and(|(_, &end)| end > r.start)
            || after.is_some_and(|(&start, _)| start < r.end);
        if !overlaps {
            taken.insert(r.start, r.end);
        }
        !overlaps
    }
}

/// `Err` naming `op` when two of the ranges `(storage index, range)`, written in place in one
/// pass, overlap on one storage (an element would be written twice, or by two blocks at once).
pub(crate) fn check_disjoint(op: &'static str, ranges: &[(usize, Range<usize>)]) -> Result<()> {
    let mut taken = Taken::default();
    for (storage, r) in ranges {
        if !taken.take(*storage, r) {
            return Err(Error::invalid(
                op,
                format!(
                    "elements {r:?} of storage {storage} overlap another range written in place"
                ),
            ));
        }
    }
    Ok(())
}

/// Geometry of a 2-D convolution (also used by conv_transpose2d).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2dParams {
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    pub groups: usize,
}

/// Geometry of a 2-D pooling window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pool2dParams {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    pub ceil_mode: bool,
    /// Average pooling only: count padded cells in the divisor.
    pub count_include_pad: bool,
}

/// Output length of a convolution or pooling window along one axis, `None` if not positive.
pub fn window_out(
    len: usize,
    kernel: usize,
    stride: usize,
    pad: usize,
    dil: usize,
    ceil: bool,
) -> Option<usize> {
    // Checked: a huge padding or dilation from the caller must not wrap into a small size.
    let eff = dil.checked_mul(kernel.checked_sub(1)?)?.checked_add(1)?;
    let padded = pad.checked_mul(2)?.checked_add(len)?;
    if padded < eff || stride == 0 {
        return None;
    }
    let span = padded - eff;
    let mut out = if ceil {
        span.div_ceil(stride)
    } else {
        span / stride
    } + 1;
    // PyTorch: the last window must start inside the input or the left padding.
    if ceil && (out - 1) * stride >= len + pad {
        out -= 1;
    }
    Some(out)
}

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
    /// The sizes and geometry a cache of per-problem choices (cuDNN's algorithms and plans)
    /// is keyed by: `[n, c, h, w, o, kh, kw, ho, wo]` and `[stride, padding, dilation,
    /// groups]`.
    #[cfg(feature = "cuda-backend")]
    pub(crate) fn key(&self) -> ([usize; 9], [usize; 7]) {
        let p = &self.p;
        (
            [
                self.n, self.c, self.h, self.w, self.o, self.kh, self.kw, self.ho, self.wo,
            ],
            [
                p.stride[0],
                p.stride[1],
                p.padding[0],
                p.padding[1],
                p.dilation[0],
                p.dilation[1],
                p.groups,
            ],
        )
    }
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

/// A dense tensor `[n, c, ...]` seen as `[outer, channels, inner]`: element `(o, c, i)` at
/// storage offset `offset + (o * channels + c) * inner + i`. Row-major: `outer = n`, `inner`
/// the product of the trailing dims; channels-last: `outer = n h w`, `inner = 1`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ChannelSplit {
    pub outer: usize,
    pub channels: usize,
    pub inner: usize,
}

impl ChannelSplit {
    /// The split of a row-major or channels-last layout of rank >= 2; any other layout is an
    /// error (callers make their operands dense first).
    pub(crate) fn of(op: &'static str, l: &Layout) -> Result<ChannelSplit> {
        let shape = l.shape();
        if shape.len() < 2 {
            return Err(Error::invalid(
                op,
                format!("expected [n, c, ...], got {shape:?}"),
            ));
        }
        let (n, c) = (shape[0], shape[1]);
        let rest: usize = shape[2..].iter().product();
        if l.is_contiguous() {
            Ok(ChannelSplit {
                outer: n,
                channels: c,
                inner: rest,
            })
        } else if l.is_channels_last() {
            Ok(ChannelSplit {
                outer: n * rest,
                channels: c,
                inner: 1,
            })
        } else {
            Err(Error::invalid(
                op,
                format!(
                    "internal: expected a row-major or channels-last layout, got shape {shape:?} \
                     strides {:?}",
                    l.strides()
                ),
            ))
        }
    }

    /// The split of two layouts that must agree (shape and strides; offsets may differ).
    pub(crate) fn of_pair(op: &'static str, a: &Layout, b: &Layout) -> Result<ChannelSplit> {
        if a.shape() != b.shape() || a.strides() != b.strides() {
            return Err(Error::invalid(
                op,
                format!(
                    "internal: operands differ in layout: {:?} strides {:?} vs {:?} strides {:?}",
                    a.shape(),
                    a.strides(),
                    b.shape(),
                    b.strides()
                ),
            ));
        }
        ChannelSplit::of(op, a)
    }
}

/// The gradients an LSTM cell's backward pass starts from, each `[B, H]` with any row stride
/// (views such as a step of a sequence need no copy): of `h`, optionally a second one of `h`
/// that is added to it (in f32), and of `c'`.
pub(crate) struct CellGrads<'a, S> {
    pub dh: (&'a S, &'a Layout),
    pub dh2: Option<(&'a S, &'a Layout)>,
    pub dc: (&'a S, &'a Layout),
}

impl<'a, S> CellGrads<'a, S> {
    /// The same operands seen as another storage type (a backend's).
    pub(crate) fn map<U>(&self, f: impl Fn(&'a S) -> &'a U) -> CellGrads<'a, U> {
        CellGrads {
            dh: (f(self.dh.0), self.dh.1),
            dh2: self.dh2.map(|(s, l)| (f(s), l)),
            dc: (f(self.dc.0), self.dc.1),
        }
    }
}
