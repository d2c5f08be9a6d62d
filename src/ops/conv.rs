//! conv2d and conv_transpose2d, forward and backward, NCHW or channels-last (NHWC).

use super::{dispatch, expect_float, expect_rank, expect_same_dtype, Op};
use crate::autograd::saved::{held, kept, kept_for, Saved};
use crate::backend::ops::{window_out, Conv2dParams};
use crate::backend::{ConvDims, Storage};
use crate::layout::Layout;
use crate::MemoryFormat;
use crate::{Error, Result, Tensor};

/// Options of [`Tensor::conv2d`] (PyTorch's defaults: stride 1, no padding, dilation 1, one
/// group).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2dOptions {
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    pub groups: usize,
}

impl Default for Conv2dOptions {
    fn default() -> Self {
        Conv2dOptions {
            stride: [1, 1],
            padding: [0, 0],
            dilation: [1, 1],
            groups: 1,
        }
    }
}

/// Options of [`Tensor::conv1d`] (PyTorch's defaults: stride 1, no padding, dilation 1,
/// one group).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv1dOptions {
    pub stride: usize,
    pub padding: usize,
    pub dilation: usize,
    pub groups: usize,
}

impl Default for Conv1dOptions {
    fn default() -> Self {
        Conv1dOptions {
            stride: 1,
            padding: 0,
            dilation: 1,
            groups: 1,
        }
    }
}

/// Options of [`Tensor::conv_transpose2d`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvTranspose2dOptions {
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    /// Extra rows/cols added to one side of the output (must be < stride or < dilation).
    pub output_padding: [usize; 2],
    pub dilation: [usize; 2],
    pub groups: usize,
}

impl Default for ConvTranspose2dOptions {
    fn default() -> Self {
        ConvTranspose2dOptions {
            stride: [1, 1],
            padding: [0, 0],
            output_padding: [0, 0],
            dilation: [1, 1],
            groups: 1,
        }
    }
}

fn check_params(op: &'static str, p: &Conv2dParams) -> Result<()> {
    if p.stride.contains(&0) || p.dilation.contains(&0) || p.groups == 0 {
        return Err(Error::invalid(
            op,
            format!(
                "stride {:?}, dilation {:?} and groups {} must be positive",
                p.stride, p.dilation, p.groups
            ),
        ));
    }
    Ok(())
}

/// Geometry of the convolution `x [n,c,h,w] * w [o, c/g, kh, kw]`, checked.
fn conv_dims(op: &'static str, x: &[usize], w: &[usize], p: Conv2dParams) -> Result<ConvDims> {
    check_params(op, &p)?;
    let (n, c, h, wd) = (x[0], x[1], x[2], x[3]);
    let (o, cg, kh, kw) = (w[0], w[1], w[2], w[3]);
    if h == 0 || wd == 0 {
        return Err(Error::invalid(
            op,
            format!("input {x:?} has no pixels (only an empty batch is allowed)"),
        ));
    }
    if o == 0 || cg == 0 {
        return Err(Error::invalid(
            op,
            format!(
                "weight {w:?} is empty: at least one output channel and one input channel per \
                 group are needed (input {x:?})"
            ),
        ));
    }
    if c % p.groups != 0
        || o % p.groups != 0
        || cg.checked_mul(p.groups) != Some(c)
        || kh == 0
        || kw == 0
    {
        return Err(Error::invalid(
            op,
            format!(
                "input {x:?} and weight {w:?} do not fit groups={}",
                p.groups
            ),
        ));
    }
    let ho = window_out(h, kh, p.stride[0], p.padding[0], p.dilation[0], false);
    let wo = window_out(wd, kw, p.stride[1], p.padding[1], p.dilation[1], false);
    if let (Some(ho), Some(wo)) = (ho, wo) {
        let out = [n, o, ho, wo];
        let count = crate::layout::checked_numel(op, &out)?;
        // Bytes at the widest float dtype: the output must be addressable whatever it holds.
        crate::layout::checked_bytes(op, &out, count, crate::DType::F64)?;
    }
    match (ho, wo) {
        (Some(ho), Some(wo)) => Ok(ConvDims {
            n,
            c,
            h,
            w: wd,
            o,
            kh,
            kw,
            ho,
            wo,
            p,
            channels_last: false,
        }),
        _ => Err(Error::invalid(
            op,
            format!("kernel {:?} larger than the padded input {x:?}", [kh, kw]),
        )),
    }
}

/// Adds a per-channel bias `[o]` to `y [n, o, h, w]`.
fn add_bias(op: &'static str, y: Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let Some(b) = bias else { return Ok(y) };
    if b.shape() != [y.shape()[1]] {
        return Err(Error::ShapeMismatch {
            op,
            lhs: vec![y.shape()[1]],
            rhs: b.shape().to_vec(),
        });
    }
    y.add(&b.reshape(&[1, y.shape()[1], 1, 1])?)
}

/// An activation, or a weight gradient, the backend wrote in the convolution's memory format.
fn activation(s: Storage, shape: [usize; 4], d: &ConvDims) -> Result<Tensor> {
    Ok(Tensor::from_storage_in(s, activation_layout(shape, d)?))
}

/// The layout of an activation of `shape` (or its gradient) in `d`'s format, dense.
fn activation_layout(shape: [usize; 4], d: &ConvDims) -> Result<Layout> {
    let format = match d.channels_last {
        true => MemoryFormat::ChannelsLast,
        false => MemoryFormat::Contiguous,
    };
    Layout::with_format("conv2d", &shape, format)
}

/// Channels-last when the input or the weight is (PyTorch's rule; a tensor whose strides fit
/// both formats, such as an `[o, 1, 1, 1]` weight, counts as NCHW): the output, and the
/// gradients of the activations, are then NHWC, and cuDNN runs its NHWC kernels.
fn with_format(mut d: ConvDims, x: &Tensor, w: &Tensor) -> ConvDims {
    d.channels_last = x.layout().suggests_channels_last() || w.layout().suggests_channels_last();
    d
}

/// `x` convolved with `weight` given the geometry: the forward of conv2d and the backward of
/// conv_transpose2d.
/// On the host, checks that a convolution's output and one image's unfolded columns
/// (`c kh kw` rows of `ho wo`) can be held before the kernels allocate them without a
/// `Result` (a huge padding makes both large from a small input).
fn host_room(x: &Tensor, d: &ConvDims) -> Result<()> {
    if x.device() != crate::Device::Cpu {
        return Ok(());
    }
    let plane = d.ho.saturating_mul(d.wo);
    let out = d.n.saturating_mul(d.o.max(d.c)).saturating_mul(plane);
    let col =
        d.c.saturating_mul(d.kh)
            .saturating_mul(d.kw)
            .saturating_mul(plane);
    let bytes = out
        .saturating_add(col)
        .saturating_mul(x.dtype().size_in_bytes());
    crate::backend::cpu::host_can_hold_bytes(bytes)
}

fn conv_fwd(x: &Tensor, w: &Tensor, d: ConvDims) -> Result<Tensor> {
    host_room(x, &d)?;
    // Where the backend can, the output's per-channel sums come with it, for a batch norm
    // that reads it (kept beside the output's storage: Tensor::channel_sums).
    let (s, sums) = match d.n {
        0 => (Storage::full(x.device(), 0.0, 0, x.dtype())?, None),
        _ => {
            let (xs, ws) = (x.storage(), w.storage());
            match xs.conv2d_with_sums(x.layout(), &ws, w.layout(), &d)? {
                Some((y, sums)) => (y, Some(sums)),
                None => (xs.conv2d(x.layout(), &ws, w.layout(), &d)?, None),
            }
        }
    };
    // The input, read only for the weight's gradient: kept or (a batch norm's output) made
    // again in backward (autograd::saved); the weight, read only for the input's gradient.
    let xs = w.is_requires_grad().then(|| Saved::new(x));
    let ws = kept_for(x.is_requires_grad(), w);
    let kept_x = xs.as_ref().and_then(|xs| xs.kept().cloned());
    let reads = held(&[&kept_x, &ws]);
    let reads: Vec<&Tensor> = reads.iter().collect();
    let y = activation(s, [d.n, d.o, d.ho, d.wo], &d)?.attach_saving(
        "conv2d",
        &[x, w],
        &reads,
        move |g, needs| {
            let gx = needs[0]
                .then(|| conv_bwd_input_onto(g, kept("conv2d", &ws)?, d))
                .transpose()?;
            let gw = needs[1]
                .then(|| match &xs {
                    Some(xs) => conv_bwd_weight_saved(xs, g, d),
                    None => kept("conv2d", &None).cloned(),
                })
                .transpose()?;
            Ok(vec![gx, gw])
        },
    );
    if let Some(sums) = sums {
        y.set_channel_sums(sums);
    }
    Ok(y)
}

/// The input's gradient in conv2d's backward. Where the input's gradient from the other ops
/// that read it is waiting (`autograd::pending`: a residual block's input, whose shortcut's
/// gradient came first), lies exactly as this gradient would, and is no other tensor's
/// storage, the convolution adds onto it in its own pass (cuDNN's `beta = 1`) and that is
/// the gradient returned, sum included: no separate add. Otherwise [`conv_bwd_input`].
fn conv_bwd_input_onto(gy: &Tensor, w: &Tensor, d: ConvDims) -> Result<Tensor> {
    if gy.device() == crate::Device::Cpu || d.n == 0 {
        return conv_bwd_input(gy, w, d);
    }
    let layout = activation_layout([d.n, d.c, d.h, d.w], &d)?;
    let fits = |p: &Tensor| {
        p.dtype() == gy.dtype()
            && p.layout() == &layout
            && p.storage().len() == p.numel()
            && p.is_sole_owner()
    };
    let Some(prev) = crate::autograd::pending::take(0, fits) else {
        return conv_bwd_input(gy, w, d);
    };
    let (gs, ws) = (gy.storage(), w.storage());
    let done = prev
        .0
        .storage
        .write(|st| st.conv2d_backward_input_acc((&gs, gy.layout()), (&ws, w.layout()), &d))?;
    match done {
        true => Ok(prev),
        false => prev.add(&conv_bwd_input(gy, w, d)?),
    }
}

/// The adjoint of [`conv_fwd`] in `x`: the forward of conv_transpose2d.
fn conv_bwd_input(gy: &Tensor, w: &Tensor, d: ConvDims) -> Result<Tensor> {
    host_room(gy, &d)?;
    let s = match d.n {
        0 => Storage::full(gy.device(), 0.0, 0, gy.dtype())?,
        _ => gy
            .storage()
            .conv2d_backward_input(gy.layout(), &w.storage(), w.layout(), &d)?,
    };
    // Each operand is read only for the other's gradient.
    let gs = kept_for(w.is_requires_grad(), gy);
    let ws = kept_for(gy.is_requires_grad(), w);
    let reads = held(&[&gs, &ws]);
    let reads: Vec<&Tensor> = reads.iter().collect();
    Ok(activation(s, [d.n, d.c, d.h, d.w], &d)?.attach_saving(
        "conv_transpose2d",
        &[gy, w],
        &reads,
        move |g, needs| {
            let name = "conv_transpose2d";
            let ggy = needs[0]
                .then(|| conv_fwd(g, kept(name, &ws)?, d))
                .transpose()?;
            let gw = needs[1]
                .then(|| conv_bwd_weight(g, kept(name, &gs)?, d))
                .transpose()?;
            Ok(vec![ggy, gw])
        },
    ))
}

/// The weight's gradient from the saved input: where it is a batch norm's output made again
/// for backward, the backend may apply batch norm's map in the convolution's prologue
/// (`ConvOps::conv2d_backward_weight_affine`) instead of making the output; otherwise the
/// input is made (or was kept) and [`conv_bwd_weight`] runs.
fn conv_bwd_weight_saved(xs: &Saved, gy: &Tensor, d: ConvDims) -> Result<Tensor> {
    if let (Some(a), true) = (xs.affine(), d.n > 0 && gy.device() != crate::Device::Cpu) {
        (a.unchanged)()?;
        let (x, coef) = (&a.x, &a.coef);
        let (cs, gs) = (coef.storage(), gy.storage());
        let out = x.storage().conv2d_backward_weight_affine(
            x.layout(),
            (&cs, coef.layout()),
            a.relu,
            (&gs, gy.layout()),
            &d,
        )?;
        if let Some(s) = out {
            return activation(s, [d.o, d.c / d.p.groups, d.kh, d.kw], &d);
        }
    }
    conv_bwd_weight(&xs.get()?, gy, d)
}

fn conv_bwd_weight(x: &Tensor, gy: &Tensor, d: ConvDims) -> Result<Tensor> {
    // An empty batch contributes nothing (no backend is asked: cuDNN refuses a batch of 0).
    let s = match d.n {
        0 => Storage::full(
            x.device(),
            0.0,
            d.o * (d.c / d.p.groups) * d.kh * d.kw,
            x.dtype(),
        )?,
        _ => x
            .storage()
            .conv2d_backward_weight(x.layout(), &gy.storage(), gy.layout(), &d)?,
    };
    // In the convolution's format: a channels-last weight's gradient matches it, so the
    // optimizer walks both in one order.
    activation(s, [d.o, d.c / d.p.groups, d.kh, d.kw], &d)
}

impl Tensor {
    /// 1-D convolution of `[n, c, l]` (or one `[c, l]` sequence) with `weight: [out, c /
    /// groups, k]` (PyTorch's `F.conv1d`): the 2-D convolution of a height-1 image, so it
    /// runs where [`Tensor::conv2d`] does.
    ///
    /// ```
    /// use mantissa::{Conv1dOptions, Tensor, Device};
    /// let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[1, 1, 4], Device::Cpu)?;
    /// let w = Tensor::from_vec(vec![1.0f32, -1.0], &[1, 1, 2], Device::Cpu)?;
    /// assert_eq!(x.conv1d(&w, None, Conv1dOptions::default())?.to_vec::<f32>()?, vec![-1.0; 3]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn conv1d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        o: Conv1dOptions,
    ) -> Result<Tensor> {
        let unbatched = self.rank() == 2;
        if !(self.rank() == 3 || unbatched) || weight.rank() != 3 {
            return Err(Error::invalid(
                    "conv1d",
                    format!(
                        "needs an input [n, c, l] or [c, l] and a weight [out, c / groups, k], got {:?} and {:?}",
                        self.shape(),
                        weight.shape()
                    ),
                ));
        }
        let x = match unbatched {
            true => self.unsqueeze(0)?,
            false => self.clone(),
        };
        let o2 = Conv2dOptions {
            stride: [1, o.stride],
            padding: [0, o.padding],
            dilation: [1, o.dilation],
            groups: o.groups,
        };
        let y = x
            .unsqueeze(2)?
            .conv2d(&weight.unsqueeze(2)?, bias, o2)?
            .squeeze(2)?;
        match unbatched {
            true => y.squeeze(0),
            false => Ok(y),
        }
    }

    /// 2-D convolution of `self [n, c, h, w]` (or one image `[c, h, w]`) with `weight [o, c/groups, kh, kw]` plus an
    /// optional `bias [o]` (PyTorch's `F.conv2d`).
    ///
    /// ```
    /// use mantissa::{Tensor, DType, Device, Conv2dOptions};
    /// let x = Tensor::ones(&[1, 1, 4, 4], DType::F32, Device::Cpu)?;
    /// let w = Tensor::ones(&[2, 1, 3, 3], DType::F32, Device::Cpu)?;
    /// let y = x.conv2d(&w, None, Conv2dOptions { padding: [1, 1], ..Default::default() })?;
    /// assert_eq!(y.shape(), &[1, 2, 4, 4]);
    /// assert_eq!(y.to_vec::<f32>()?[5], 9.0);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn conv2d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        o: Conv2dOptions,
    ) -> Result<Tensor> {
        super::per_image(Op::Conv2d, self, |x| x.conv2d_batch(weight, bias, o))
    }

    fn conv2d_batch(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        o: Conv2dOptions,
    ) -> Result<Tensor> {
        let _prof = crate::profiler::op(Op::Conv2d.name());
        let [x, w] = dispatch(Op::Conv2d, [self, weight])?;
        expect_float(Op::Conv2d, &x)?;
        expect_same_dtype(Op::Conv2d, &x, &w)?;
        expect_rank(Op::Conv2d, &x, 4, "the input")?;
        expect_rank(Op::Conv2d, &w, 4, "the weight")?;
        let p = Conv2dParams {
            stride: o.stride,
            padding: o.padding,
            dilation: o.dilation,
            groups: o.groups,
        };
        let d = with_format(conv_dims("conv2d", x.shape(), w.shape(), p)?, &x, &w);
        let bias = super::dispatch_opt(Op::Conv2d, bias)?;
        add_bias("conv2d", conv_fwd(&x, &w, d)?, bias.as_ref())
    }

    /// Transposed 2-D convolution of `self [n, c, h, w]` (or one image `[c, h, w]`) with `weight [c, o/groups, kh, kw]`
    /// (PyTorch's `F.conv_transpose2d`): the gradient of conv2d with respect to its input.
    pub fn conv_transpose2d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        o: ConvTranspose2dOptions,
    ) -> Result<Tensor> {
        super::per_image(Op::ConvTranspose2d, self, |x| {
            x.conv_transpose2d_batch(weight, bias, o)
        })
    }

    fn conv_transpose2d_batch(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        o: ConvTranspose2dOptions,
    ) -> Result<Tensor> {
        let _prof = crate::profiler::op(Op::ConvTranspose2d.name());
        let [x, w] = dispatch(Op::ConvTranspose2d, [self, weight])?;
        expect_float(Op::ConvTranspose2d, &x)?;
        expect_same_dtype(Op::ConvTranspose2d, &x, &w)?;
        expect_rank(Op::ConvTranspose2d, &x, 4, "the input")?;
        expect_rank(Op::ConvTranspose2d, &w, 4, "the weight")?;
        let p = Conv2dParams {
            stride: o.stride,
            padding: o.padding,
            dilation: o.dilation,
            groups: o.groups,
        };
        check_params("conv_transpose2d", &p)?;
        let (n, c, h, wd) = (x.shape()[0], x.shape()[1], x.shape()[2], x.shape()[3]);
        let (wc, og, kh, kw) = (w.shape()[0], w.shape()[1], w.shape()[2], w.shape()[3]);
        if wc != c || c % p.groups != 0 {
            return Err(Error::ShapeMismatch {
                op: "conv_transpose2d",
                lhs: x.shape().to_vec(),
                rhs: w.shape().to_vec(),
            });
        }
        for i in 0..2 {
            if o.output_padding[i] >= o.stride[i].max(o.dilation[i]) {
                return Err(Error::invalid(
                    "conv_transpose2d",
                    format!(
                        "output_padding {:?} must be smaller than stride or dilation",
                        o.output_padding
                    ),
                ));
            }
        }
        if h == 0 || wd == 0 || kh == 0 || kw == 0 {
            return Err(Error::Empty {
                op: "conv_transpose2d",
                shape: if kh == 0 || kw == 0 {
                    w.shape().to_vec()
                } else {
                    x.shape().to_vec()
                },
            });
        }
        // Checked throughout: huge strides, dilations or paddings must not wrap.
        let size = |len: usize, i: usize, k: usize| -> Option<usize> {
            (len - 1)
                .checked_mul(p.stride[i])?
                .checked_add(p.dilation[i].checked_mul(k - 1)?)?
                .checked_add(o.output_padding[i] + 1)?
                .checked_sub(p.padding[i].checked_mul(2)?)
        };
        let (Some(ho), Some(wo)) = (size(h, 0, kh), size(wd, 1, kw)) else {
            return Err(Error::invalid(
                "conv_transpose2d",
                "padding larger than the output",
            ));
        };
        if ho == 0 || wo == 0 {
            return Err(Error::invalid(
                "conv_transpose2d",
                "padding leaves an empty output",
            ));
        }
        // The equivalent convolution maps the output [n, og*g, ho, wo] to the input [n, c, h, w].
        let d = conv_dims(
            "conv_transpose2d",
            &[
                n,
                og.checked_mul(p.groups).ok_or_else(|| {
                    Error::too_large("conv_transpose2d", w.shape(), "channels overflow")
                })?,
                ho,
                wo,
            ],
            w.shape(),
            p,
        )?;
        let d = with_format(d, &x, &w);
        if d.ho != h || d.wo != wd {
            return Err(Error::invalid(
                "conv_transpose2d",
                "inconsistent output size",
            ));
        }
        let bias = super::dispatch_opt(Op::ConvTranspose2d, bias)?;
        add_bias(
            "conv_transpose2d",
            conv_bwd_input(&x, &w, d)?,
            bias.as_ref(),
        )
    }
}
