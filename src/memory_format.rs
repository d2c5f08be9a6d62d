//! Memory formats: the order in which a tensor's elements sit in memory, apart from its shape
//! (PyTorch's `torch.memory_format`).
//!
//! A 4-D `[n, c, h, w]` tensor in [`MemoryFormat::ChannelsLast`] keeps the shape but stores
//! the channels of each pixel next to each other (NHWC), the layout cuDNN's tensor-core
//! convolutions read fastest in f16 and bf16. Convolutions follow their input's format, and
//! elementwise ops write their output in the dense order of their first full-size operand, so
//! a chain `conv2d -> batch_norm -> relu -> conv2d` stays channels-last without copies.

use crate::layout::Layout;
use crate::{Error, Result, Tensor};

/// The order of a tensor's elements in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MemoryFormat {
    /// Row-major: the last dimension varies fastest (NCHW for images).
    #[default]
    Contiguous,
    /// For `[n, c, h, w]` tensors: channels vary fastest, then width, height and batch (NHWC).
    ChannelsLast,
}

/// Dims of an `[n, c, h, w]` tensor from outermost to innermost in channels-last order.
const NHWC: [usize; 4] = [0, 2, 3, 1];
/// The inverse of [`NHWC`].
const NCHW_FROM_NHWC: [usize; 4] = [0, 3, 1, 2];

/// The permutation that undoes `perm`.
fn inverse(perm: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        inv[p] = i;
    }
    inv
}

impl Layout {
    /// A dense layout of `shape` in `format`, starting at offset 0. Channels-last needs a
    /// 4-D shape.
    ///
    /// ```
    /// use mantissa::{layout::Layout, MemoryFormat};
    /// let l = Layout::with_format("example", &[2, 3, 4, 5], MemoryFormat::ChannelsLast)?;
    /// assert_eq!(l.strides(), &[60, 1, 15, 3]);
    /// assert!(l.is_channels_last());
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn with_format(op: &'static str, shape: &[usize], format: MemoryFormat) -> Result<Layout> {
        match format {
            MemoryFormat::Contiguous => Ok(Layout::contiguous(shape)),
            MemoryFormat::ChannelsLast if shape.len() == 4 => {
                let nhwc: Vec<usize> = NHWC.iter().map(|&d| shape[d]).collect();
                Layout::contiguous(&nhwc).permute(op, &NCHW_FROM_NHWC)
            }
            MemoryFormat::ChannelsLast => Err(Error::invalid(
                op,
                format!("channels-last needs a 4-D [n, c, h, w] tensor, got shape {shape:?}"),
            )),
        }
    }

    /// True for a 4-D layout whose strides are exactly the channels-last strides of its shape
    /// (as [`Layout::with_format`] makes them; the offset may be anything). A tensor with one
    /// channel, or one pixel, can be both this and contiguous: its strides tell which it was
    /// made as.
    pub fn is_channels_last(&self) -> bool {
        self.rank() == 4
            && Layout::with_format("is_channels_last", self.shape(), MemoryFormat::ChannelsLast)
                .is_ok_and(|l| l.strides() == self.strides())
    }

    /// Whether an op that follows its input's format (convolution, pooling) should work
    /// channels-last: [`Layout::is_channels_last`], except where the channels-last strides
    /// are also exactly the row-major ones (`[n, 1, 1, 1]`), which stay NCHW, as PyTorch's
    /// `suggest_memory_format` decides.
    pub(crate) fn suggests_channels_last(&self) -> bool {
        self.is_channels_last() && self.strides() != Layout::contiguous(self.shape()).strides()
    }

    /// The format this layout is in: channels-last when [`Layout::is_channels_last`], else
    /// contiguous (also for layouts that are neither).
    pub fn memory_format(&self) -> MemoryFormat {
        if self.is_channels_last() {
            MemoryFormat::ChannelsLast
        } else {
            MemoryFormat::Contiguous
        }
    }

    /// For a dense layout that is not row-major (channels-last, a transpose of a contiguous
    /// tensor), the permutation `p` such that `self.permute(p)` is contiguous; `None` for
    /// row-major layouts and for layouts with gaps, overlaps or broadcast dims.
    pub(crate) fn dense_order(&self) -> Option<Vec<usize>> {
        if self.is_channels_last() {
            return Some(NHWC.to_vec());
        }
        if self.is_contiguous() {
            return None;
        }
        // Size-1 dims go outermost (their stride is meaningless); the others by stride,
        // largest first.
        let (mut ones, mut rest): (Vec<usize>, Vec<usize>) =
            (0..self.rank()).partition(|&d| self.shape()[d] == 1);
        rest.sort_by(|&a, &b| self.strides()[b].cmp(&self.strides()[a]));
        ones.extend(rest);
        let permuted = self.permute("dense_order", &ones).ok()?;
        permuted.is_contiguous().then_some(ones)
    }
}

/// True when `l` spans its whole shape: no broadcast (stride-0) dim of size above 1.
fn spans(l: &Layout) -> bool {
    l.shape()
        .iter()
        .zip(l.strides())
        .all(|(&d, &s)| s != 0 || d <= 1)
}

/// Runs the elementwise kernel `f` over `layouts` (all of one shape) and returns its output
/// with the output's layout. The output is written in the dense order of the first operand
/// that spans the shape (PyTorch's memory-format propagation), so a channels-last or
/// transposed input gives an output of the same strides; otherwise it is row-major. Either
/// way `f` sees layouts whose row-major walk is the output's storage order.
pub(crate) fn elementwise<const N: usize, S>(
    op: &'static str,
    layouts: [&Layout; N],
    f: impl FnOnce([&Layout; N]) -> Result<S>,
) -> Result<(S, Layout)> {
    let shape = layouts[0].shape().to_vec();
    let order = layouts
        .iter()
        .find(|l| spans(l))
        .and_then(|l| l.dense_order());
    let Some(perm) = order else {
        return Ok((f(layouts)?, Layout::contiguous(&shape)));
    };
    let permuted = layouts
        .iter()
        .map(|l| l.permute(op, &perm))
        .collect::<Result<Vec<_>>>()?;
    let out = f(std::array::from_fn(|i| &permuted[i]))?;
    let dense = Layout::contiguous(permuted[0].shape());
    Ok((out, dense.permute(op, &inverse(&perm))?))
}

impl Tensor {
    /// True when this is a 4-D tensor in channels-last (NHWC) order; see [`MemoryFormat`].
    pub fn is_channels_last(&self) -> bool {
        self.layout().is_channels_last()
    }

    /// The memory format of this tensor's layout (contiguous unless it is channels-last).
    pub fn memory_format(&self) -> MemoryFormat {
        self.layout().memory_format()
    }

    /// The same values laid out in `format` (PyTorch's `x.contiguous(memory_format=...)`):
    /// this tensor when it already is; a view when the elements already sit in that order
    /// (one channel, say); a copy otherwise. Differentiable. Channels-last needs a 4-D tensor.
    ///
    /// ```
    /// use mantissa::{Tensor, DType, Device, MemoryFormat};
    /// let x = Tensor::randn(&[2, 3, 4, 4], DType::F32, Device::Cpu)?;
    /// let y = x.to_memory_format(MemoryFormat::ChannelsLast)?;
    /// assert!(y.is_channels_last() && !y.is_contiguous());
    /// assert_eq!(y.to_vec::<f32>()?, x.to_vec::<f32>()?);
    /// // Elementwise ops keep the format.
    /// assert!(y.relu()?.mul(2.0)?.is_channels_last());
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn to_memory_format(&self, format: MemoryFormat) -> Result<Tensor> {
        const OP: &str = "to_memory_format";
        let target = Layout::with_format(OP, self.shape(), format)?;
        if self.layout().strides() == target.strides() {
            return Ok(self.clone());
        }
        let _prof = crate::profiler::op(OP);
        // Already in this order (up to size-1 dims): the same storage with the format's strides.
        let order: Vec<usize> = match format {
            MemoryFormat::Contiguous => (0..self.rank()).collect(),
            MemoryFormat::ChannelsLast => NHWC.to_vec(),
        };
        let src = self.layout().permute(OP, &order)?;
        if src.is_contiguous() {
            let view = Layout::new(
                target.shape().to_vec(),
                target.strides().to_vec(),
                self.layout().offset(),
            );
            return Ok(self
                .view_with(view)
                .attach(OP, &[self], |g, _| Ok(vec![Some(g.clone())])));
        }
        let s = self.storage().copy_strided(&src)?;
        Ok(
            Tensor::from_storage_in(s, target)
                .attach(OP, &[self], |g, _| Ok(vec![Some(g.clone())])),
        )
    }
}
