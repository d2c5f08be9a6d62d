//! max_pool2d, avg_pool2d and adaptive_avg_pool2d over `[n, c, h, w]`.

use super::{dispatch, expect_float, expect_rank, Op};
use crate::backend::ops::{window_out, Pool2dParams};
use crate::backend::{PoolDims, Storage};
use crate::layout::Layout;
use crate::{Error, MemoryFormat, Result, Tensor};

/// Options of [`Tensor::max_pool2d`]; `stride` `None` means the kernel size (PyTorch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxPool2dOptions {
    pub kernel: [usize; 2],
    pub stride: Option<[usize; 2]>,
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    pub ceil_mode: bool,
}

impl MaxPool2dOptions {
    /// A square window of `k` with stride `k`.
    pub fn new(k: usize) -> Self {
        MaxPool2dOptions {
            kernel: [k, k],
            stride: None,
            padding: [0, 0],
            dilation: [1, 1],
            ceil_mode: false,
        }
    }
}

/// Options of [`Tensor::avg_pool2d`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AvgPool2dOptions {
    pub kernel: [usize; 2],
    pub stride: Option<[usize; 2]>,
    pub padding: [usize; 2],
    pub ceil_mode: bool,
    pub count_include_pad: bool,
}

impl AvgPool2dOptions {
    /// A square window of `k` with stride `k`, padding counted (PyTorch's defaults).
    pub fn new(k: usize) -> Self {
        AvgPool2dOptions {
            kernel: [k, k],
            stride: None,
            padding: [0, 0],
            ceil_mode: false,
            count_include_pad: true,
        }
    }
}

fn pool_dims(op: Op, x: &Tensor, p: &Pool2dParams) -> Result<PoolDims> {
    expect_float(op, x)?;
    expect_rank(op, x, 4, "the input")?;
    let s = x.shape();
    if p.kernel.contains(&0) || p.stride.contains(&0) || p.dilation.contains(&0) {
        return Err(Error::invalid(
            op.name(),
            format!("kernel, stride and dilation must be positive: {p:?}"),
        ));
    }
    for i in 0..2 {
        if p.padding[i] > p.kernel[i] / 2 {
            return Err(Error::invalid(
                op.name(),
                format!(
                    "padding {:?} must be at most half the kernel {:?}",
                    p.padding, p.kernel
                ),
            ));
        }
    }
    let ho = window_out(
        s[2],
        p.kernel[0],
        p.stride[0],
        p.padding[0],
        p.dilation[0],
        p.ceil_mode,
    );
    let wo = window_out(
        s[3],
        p.kernel[1],
        p.stride[1],
        p.padding[1],
        p.dilation[1],
        p.ceil_mode,
    );
    if let (Some(ho), Some(wo)) = (ho, wo) {
        crate::layout::checked_numel(op.name(), &[s[0], s[1], ho, wo])?;
    }
    match (ho, wo) {
        (Some(ho), Some(wo)) if s[2] > 0 && s[3] > 0 => Ok(PoolDims {
            planes: s[0] * s[1],
            c: s[1],
            h: s[2],
            w: s[3],
            ho,
            wo,
            channels_last: x.layout().suggests_channels_last(),
        }),
        _ => Err(Error::invalid(
            op.name(),
            format!("window {:?} does not fit the input {s:?}", p.kernel),
        )),
    }
}

impl MaxPool2dOptions {
    /// The window parameters the backends take.
    pub(crate) fn params(&self) -> Pool2dParams {
        Pool2dParams {
            kernel: self.kernel,
            stride: self.stride.unwrap_or(self.kernel),
            padding: self.padding,
            dilation: self.dilation,
            ceil_mode: self.ceil_mode,
            count_include_pad: false,
        }
    }
}

impl AvgPool2dOptions {
    /// The window parameters the backends take.
    pub(crate) fn params(&self) -> Pool2dParams {
        Pool2dParams {
            kernel: self.kernel,
            stride: self.stride.unwrap_or(self.kernel),
            padding: self.padding,
            dilation: [1, 1],
            ceil_mode: self.ceil_mode,
            count_include_pad: self.count_include_pad,
        }
    }
}

/// A pooling result (or input gradient) of `shape`, in the memory format the backends write
/// it in: NHWC for a channels-last input, so the channels-last chain of a network goes on
/// past the pooling layer.
fn pooled(s: Storage, shape: [usize; 4], d: &PoolDims) -> Result<Tensor> {
    let format = match d.channels_last {
        true => MemoryFormat::ChannelsLast,
        false => MemoryFormat::Contiguous,
    };
    let layout = Layout::with_format("pooling", &shape, format)?;
    Ok(Tensor::from_storage_in(s, layout))
}

impl Tensor {
    /// Max pooling of `[n, c, h, w]` (or one image `[c, h, w]`), PyTorch's `F.max_pool2d`.
    pub fn max_pool2d(&self, o: MaxPool2dOptions) -> Result<Tensor> {
        super::per_image(Op::MaxPool2d, self, |x| x.max_pool2d_batch(o))
    }

    fn max_pool2d_batch(&self, o: MaxPool2dOptions) -> Result<Tensor> {
        let _prof = crate::profiler::op(Op::MaxPool2d.name());
        let [x] = dispatch(Op::MaxPool2d, [self])?;
        let p = o.params();
        let d = pool_dims(Op::MaxPool2d, &x, &p)?;
        let (v, idx) = x.storage().max_pool2d(x.layout(), &d, &p)?;
        let s = x.shape();
        let shape = [s[0], s[1], d.ho, d.wo];
        let in_shape = [s[0], s[1], s[2], s[3]];
        let y = pooled(v, shape, &d)?.attach("max_pool2d", &[&x], move |g, _| {
            let gx = g.storage().max_pool2d_backward(g.layout(), &idx, &d, &p)?;
            Ok(vec![Some(pooled(gx, in_shape, &d)?)])
        });
        Ok(y)
    }

    /// Average pooling of `[n, c, h, w]` (or one image `[c, h, w]`), PyTorch's
    /// `F.avg_pool2d`.
    pub fn avg_pool2d(&self, o: AvgPool2dOptions) -> Result<Tensor> {
        super::per_image(Op::AvgPool2d, self, |x| x.avg_pool2d_batch(o))
    }

    fn avg_pool2d_batch(&self, o: AvgPool2dOptions) -> Result<Tensor> {
        let _prof = crate::profiler::op(Op::AvgPool2d.name());
        let [x] = dispatch(Op::AvgPool2d, [self])?;
        let p = o.params();
        let d = pool_dims(Op::AvgPool2d, &x, &p)?;
        let v = x.storage().avg_pool2d(x.layout(), &d, &p)?;
        let s = x.shape();
        let in_shape = [s[0], s[1], s[2], s[3]];
        let y =
            pooled(v, [s[0], s[1], d.ho, d.wo], &d)?.attach("avg_pool2d", &[&x], move |g, _| {
                let gx = g.storage().avg_pool2d_backward(g.layout(), &d, &p)?;
                Ok(vec![Some(pooled(gx, in_shape, &d)?)])
            });
        Ok(y)
    }

    /// Adaptive average pooling of `[n, c, h, w]` (or one image `[c, h, w]`) to `[oh, ow]`
    /// (PyTorch's `F.adaptive_avg_pool2d`).
    pub fn adaptive_avg_pool2d(&self, out: [usize; 2]) -> Result<Tensor> {
        super::per_image(Op::AdaptiveAvgPool2d, self, |x| {
            x.adaptive_avg_pool2d_batch(out)
        })
    }

    fn adaptive_avg_pool2d_batch(&self, out: [usize; 2]) -> Result<Tensor> {
        let _prof = crate::profiler::op(Op::AdaptiveAvgPool2d.name());
        let [x] = dispatch(Op::AdaptiveAvgPool2d, [self])?;
        expect_float(Op::AdaptiveAvgPool2d, &x)?;
        expect_rank(Op::AdaptiveAvgPool2d, &x, 4, "the input")?;
        let s = x.shape().to_vec();
        if out.contains(&0) || s[2] == 0 || s[3] == 0 {
            return Err(Error::invalid(
                "adaptive_avg_pool2d",
                format!("output size {out:?} for input {s:?}"),
            ));
        }
        let d = PoolDims {
            planes: s[0] * s[1],
            c: s[1],
            h: s[2],
            w: s[3],
            ho: out[0],
            wo: out[1],
            channels_last: x.layout().suggests_channels_last(),
        };
        let v = x.storage().adaptive_avg_pool2d(x.layout(), &d, false)?;
        let y = pooled(v, [s[0], s[1], out[0], out[1]], &d)?.attach(
            "adaptive_avg_pool2d",
            &[&x],
            move |g, _| {
                let gs = g.storage();
                let gx = gs.adaptive_avg_pool2d(g.layout(), &d, true)?;
                Ok(vec![Some(pooled(gx, [s[0], s[1], s[2], s[3]], &d)?)])
            },
        );
        Ok(y)
    }
}
