//! batch_norm, a fused pass of the backends forward and backward, with statistics in f32 or
//! wider (layer_norm is in `norm_layer.rs`).

use super::norm_call::{BnCall, InPlace};
use super::{dispatch, expect_float, Op};
use crate::backend::cpu::norm::stat_dtype;
use crate::backend::norm::{Addend, BnForward, BnGrad, BnSource, FusedRelu};
use crate::backend::ops::UnaryOp;
use crate::layout::Layout;
use crate::tensor::node::{AffineParts, Recipe};
use crate::{no_grad, Error, MemoryFormat, Result, Tensor};

/// `running = (1 - momentum) running + momentum batch`, with the unbiased batch variance.
fn update_running(
    running_mean: Option<&Tensor>,
    running_var: Option<&Tensor>,
    mean: &Tensor,
    var: &Tensor,
    momentum: f64,
    count: usize,
) -> Result<()> {
    if let Some(rm) = running_mean {
        rm.copy_(
            &rm.mul(1.0 - momentum)?
                .add(&mean.to_dtype(rm.dtype())?.mul(momentum)?)?,
        )?;
    }
    if let Some(rv) = running_var {
        let unbiased = var
            .mul(count as f64 / (count - 1) as f64)?
            .to_dtype(rv.dtype())?;
        rv.copy_(&rv.mul(1.0 - momentum)?.add(&unbiased.mul(momentum)?)?)?;
    }
    Ok(())
}

/// The training statistics `[5, c]` of `x` (see `NormOps::batch_norm_stats`). Running
/// statistics and a counter the pass can write ([`InPlace`]) are updated in it; others
/// (another dtype or device, a view) by tensor ops after it.
fn batch_stats(
    x: &Tensor,
    (running_mean, running_var): (Option<&Tensor>, Option<&Tensor>),
    tracked: Option<&Tensor>,
    (w, b): (Option<&Tensor>, Option<&Tensor>),
    momentum: f64,
    eps: f64,
) -> Result<Tensor> {
    let c = x.shape()[1];
    let here = InPlace::of(x, (running_mean, running_var), tracked);
    let (in_place, count_here) = (here.running, here.tracked);
    // Every operand read is taken before the written ones are locked.
    let (xs, ws, bs) = (x.storage(), w.map(|t| t.storage()), b.map(|t| t.storage()));
    // The sums the op that made x kept (a convolution's epilogue), if x is still as it made it.
    let sums = x.channel_sums();
    let stats = here.write(|running, tracked| {
        let p = BnForward {
            weight: ws.as_deref().zip(w.map(|t| t.layout())),
            bias: bs.as_deref().zip(b.map(|t| t.layout())),
            source: BnSource::Batch {
                running,
                tracked,
                momentum,
                sums: sums.as_deref(),
            },
            eps,
        };
        xs.batch_norm_stats(x.layout(), p)
    })?;
    let stats = Tensor::from_storage(stats, &[5, c]);
    let count = x.numel() / c;
    no_grad(|| {
        if in_place.is_none() && (running_mean.is_some() || running_var.is_some()) {
            let plane = |k| stats.narrow(0, k, 1)?.reshape(&[c]);
            let (mean, var) = (plane(1)?, plane(4)?);
            update_running(running_mean, running_var, &mean, &var, momentum, count)?;
        }
        if let (None, Some(t)) = (count_here, tracked) {
            t.copy_(&t.add(&Tensor::scalar(1.0, t.dtype(), t.device())?)?)?;
        }
        Ok(())
    })?;
    Ok(stats)
}

/// Errs unless the residual added to batch norm's output matches the input in shape, dtype
/// and device.
fn check_residual(x: &Tensor, r: &Tensor) -> Result<()> {
    if r.shape() != x.shape() {
        return Err(Error::ShapeMismatch {
            op: "batch_norm (residual)",
            lhs: x.shape().to_vec(),
            rhs: r.shape().to_vec(),
        });
    }
    if r.dtype() != x.dtype() {
        return Err(Error::DTypeMismatch {
            op: "batch_norm (residual)",
            lhs: x.dtype(),
            rhs: r.dtype(),
        });
    }
    if r.device() != x.device() {
        return Err(Error::DeviceMismatch {
            op: "batch_norm (residual)",
            lhs: x.device(),
            rhs: r.device(),
        });
    }
    Ok(())
}

/// ReLU's own backward from its output `y` (`g` times the derivative: 1 where `y > 0` or NaN,
/// else 0), in `y`'s format.
fn relu_grad(y: &Tensor, g: &Tensor) -> Result<Tensor> {
    let (s, l) =
        crate::memory_format::elementwise("relu backward", [y.layout(), g.layout()], |[ly, lg]| {
            y.storage().unary_grad(ly, &g.storage(), lg, UnaryOp::Relu)
        })?;
    Ok(Tensor::from_storage_in(s, l))
}

fn check_vec(op: &'static str, what: &str, v: Option<&Tensor>, n: usize) -> Result<()> {
    match v {
        Some(v) if v.shape() != [n] => Err(Error::invalid(
            op,
            format!("{what} must have shape [{n}], got {:?}", v.shape()),
        )),
        _ => Ok(()),
    }
}

impl Tensor {
    /// Batch normalisation over `[n, c, ...]` (PyTorch's `F.batch_norm`). In training mode it
    /// normalises with the batch statistics and, when given, updates the running statistics
    /// in place (`running = (1 - momentum) running + momentum batch`, unbiased variance); in
    /// eval mode it uses the running statistics.
    ///
    /// Fused: the backend computes the per-channel statistics in one read of the input (f32,
    /// or f64 for f64 input; Chan's combination of per-block moments) and the output in one
    /// more pass; the backward pass is one reduction and one pass. A channels-last input gives
    /// a channels-last output; any other layout is made row-major first.
    ///
    /// ```
    /// use mantissa::{Tensor, DType, Device};
    /// let x = Tensor::randn(&[8, 3, 4, 4], DType::F32, Device::Cpu)?.mul(5.0)?.add(2.0)?;
    /// let y = x.batch_norm(None, None, None, None, true, 0.1, 1e-5)?;
    /// // Each channel of the output has mean 0 and variance 1.
    /// let m = y.mean(&[0, 2, 3], false)?.to_vec::<f32>()?;
    /// let v = y.var(&[0, 2, 3], 0, false)?.to_vec::<f32>()?;
    /// assert!(m.iter().all(|m| m.abs() < 1e-5) && v.iter().all(|v| (v - 1.0).abs() < 1e-3));
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn batch_norm(
        &self,
        running_mean: Option<&Tensor>,
        running_var: Option<&Tensor>,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        training: bool,
        momentum: f64,
        eps: f64,
    ) -> Result<Tensor> {
        let (running, params) = ((running_mean, running_var), (weight, bias));
        let mode = BnCall {
            training,
            momentum,
            eps,
            relu: false,
        };
        self.batch_norm_counted(running, params, None, None, mode)
    }

    /// [`Tensor::batch_norm`] that, in training, also counts the batch in `tracked` (a
    /// one-element i64 tensor, `BatchNorm2d`'s `num_batches_tracked`): on a device in the
    /// launch that updates the running statistics. With `residual` (same shape, dtype and
    /// device as the input), the output is `batch_norm(x) + residual` from the same pass (a
    /// ResNet block's shortcut), rounded once. With `relu`, it is then clamped at 0
    /// (`relu(batch_norm(x) [+ residual])`), and the backward keeps the output's gradient
    /// where the output was positive, as ReLU's own backward does: with a residual from the
    /// saved output, without one from the output recomputed from the saved input and
    /// statistics (one tensor fewer read in each backward pass).
    pub(crate) fn batch_norm_counted(
        &self,
        (running_mean, running_var): (Option<&Tensor>, Option<&Tensor>),
        (weight, bias): (Option<&Tensor>, Option<&Tensor>),
        tracked: Option<&Tensor>,
        residual: Option<&Tensor>,
        BnCall {
            training,
            momentum,
            eps,
            relu,
        }: BnCall,
    ) -> Result<Tensor> {
        let name = match (residual.is_some(), relu) {
            (true, true) => "batch_norm_add_relu",
            (true, false) => "batch_norm_add",
            (false, true) => "batch_norm_relu",
            (false, false) => Op::BatchNorm.name(),
        };
        let _prof = crate::profiler::op(name);
        let [x] = dispatch(Op::BatchNorm, [self])?;
        expect_float(Op::BatchNorm, &x)?;
        if x.rank() < 2 {
            return Err(Error::invalid(
                "batch_norm",
                format!("input must be [n, c, ...], got {:?}", x.shape()),
            ));
        }
        if let Some(r) = residual {
            check_residual(&x, r)?;
        }
        let c = x.shape()[1];
        for (what, v) in [
            ("running_mean", running_mean),
            ("running_var", running_var),
            ("weight", weight),
            ("bias", bias),
        ] {
            check_vec("batch_norm", what, v, c)?;
        }
        let count = x.numel() / c.max(1);
        if training && count <= 1 {
            return Err(Error::invalid(
                "batch_norm",
                format!(
                    "expected more than one value per channel in training, got input {:?}",
                    x.shape()
                ),
            ));
        }
        if !training && (running_mean.is_none() || running_var.is_none()) {
            return Err(Error::invalid(
                "batch_norm",
                "eval mode needs running_mean and running_var",
            ));
        }
        if x.numel() == 0 {
            // An empty batch in eval mode: nothing to normalise.
            return match residual {
                Some(r) => x.mul(0.0)?.add(r),
                None => x.mul(0.0),
            };
        }
        // The fused passes work on a dense row-major or channels-last tensor; the output
        // keeps that format.
        let format = if x.layout().suggests_channels_last() {
            MemoryFormat::ChannelsLast
        } else {
            MemoryFormat::Contiguous
        };
        let x = x.to_memory_format(format)?;
        let r = residual.map(|r| r.to_memory_format(format)).transpose()?;
        let sd = stat_dtype(x.dtype());
        // The affine parameters in the statistics dtype (their gradients come from the
        // backward's sums, not through these casts).
        let cast = |v: Option<&Tensor>| v.map(|v| v.detach().to_dtype(sd)).transpose();
        let (w, b) = (cast(weight)?, cast(bias)?);
        if format == MemoryFormat::ChannelsLast {
            let call = BnCall {
                training,
                momentum,
                eps,
                relu,
            };
            let (running, params) = ((running_mean, running_var), (weight, bias));
            let (rr, wb) = (r.as_ref(), (w.as_ref(), b.as_ref()));
            let fused = super::norm_fused::batch_norm_fused(
                name, &x, rr, running, tracked, params, wb, call,
            )?;
            if let Some(y) = fused {
                return Ok(y);
            }
        }
        let stats = if training {
            let (running, params) = ((running_mean, running_var), (w.as_ref(), b.as_ref()));
            batch_stats(&x, running, tracked, params, momentum, eps)?
        } else {
            // Checked above: both are given in eval mode.
            let whole = |v: &Tensor| v.detach().to_dtype(sd)?.filled_in(MemoryFormat::Contiguous);
            let (m, v) = (whole(running_mean.unwrap())?, whole(running_var.unwrap())?);
            let (ms, vs) = (m.storage(), v.storage());
            let (ws, bs) = (
                w.as_ref().map(|t| t.storage()),
                b.as_ref().map(|t| t.storage()),
            );
            let p = BnForward {
                weight: ws.as_deref().zip(w.as_ref().map(|t| t.layout())),
                bias: bs.as_deref().zip(b.as_ref().map(|t| t.layout())),
                source: BnSource::Running(&ms, &vs),
                eps,
            };
            Tensor::from_storage(x.storage().batch_norm_stats(x.layout(), p)?, &[5, c])
        };
        // y = a (x - mean) + b: the first three planes of the statistics.
        let coef = stats.narrow(0, 0, 4)?;
        let fused = if relu {
            FusedRelu::Output
        } else {
            FusedRelu::None
        };
        let y = {
            let rs = r.as_ref().map(|r| r.storage());
            let add = match (&rs, &r) {
                (Some(s), Some(r)) => Addend::Residual(&**s, r.layout()),
                _ => Addend::None,
            };
            let (cs, cl) = (coef.storage(), coef.layout());
            x.storage()
                .channel_affine(x.layout(), add, &cs, cl, fused)?
        };
        let y = Tensor::from_storage_in(y, Layout::with_format("batch_norm", x.shape(), format)?);
        // With a residual, the fused ReLU's backward reads the output (what the next op keeps
        // anyway): the residual's part of it cannot be recomputed from x. Without one, the
        // backward recomputes the output's sign from x and the statistics.
        let out = (relu && r.is_some()).then(|| y.detach());
        let mut inputs = vec![&x];
        inputs.extend(weight);
        inputs.extend(bias);
        inputs.extend(r.as_ref());
        let (wdt, bdt) = (weight.map(|w| w.dtype()), bias.map(|b| b.dtype()));
        let rdt = r.as_ref().map(|r| r.dtype());
        let nparams = usize::from(weight.is_some()) + usize::from(bias.is_some());
        let xs = x.detach();
        let fused_relu = relu;
        let read_out = out.clone();
        let mut reads = vec![&x];
        reads.extend(read_out.as_ref());
        // Without a residual the output is the affine pass over x alone: offered to the ops
        // that read it in backward (autograd::saved), made again there from x and the
        // coefficients, which this node keeps anyway.
        let recipe = r.is_none().then(|| {
            let (xs, coef, seen) = (x.detach(), coef.clone(), x.version());
            let layout = y.layout().clone();
            let x_read = xs.clone();
            let unchanged = std::sync::Arc::new(move || {
                if x_read.version() != seen {
                    return Err(Error::Autograd(format!(
                        "the input of `batch_norm` (shape {:?}, {:?}), from which its output \
                         is made again for a backward that reads it, was modified in place \
                         after the forward (version {seen}, now {}); write into a clone \
                         instead, or make the change after backward()",
                        x_read.shape(),
                        x_read.dtype(),
                        x_read.version()
                    )));
                }
                Ok(())
            });
            let affine = AffineParts {
                x: xs.clone(),
                coef: coef.clone(),
                relu: fused_relu,
                unchanged: unchanged.clone(),
            };
            move |of: u64| Recipe {
                of,
                affine: Some(affine),
                make: std::sync::Arc::new(move || {
                    let _prof = crate::profiler::op("batch_norm.recompute");
                    unchanged()?;
                    let (cs, cl) = (coef.storage(), coef.layout());
                    let fused = match fused_relu {
                        true => FusedRelu::Output,
                        false => FusedRelu::None,
                    };
                    let y =
                        xs.storage()
                            .channel_affine(xs.layout(), Addend::None, &cs, cl, fused)?;
                    Ok(Tensor::from_storage_in(y, layout.clone()))
                }),
            }
        });
        let y = y.attach_saving(name, &inputs, &reads, move |dy, needs| {
            let dy = dy.to_dtype(xs.dtype())?.to_memory_format(format)?;
            let wants_params = needs[1..1 + nparams].iter().any(|&n| n);
            let mode = match (training, wants_params) {
                (true, _) => BnGrad::Train,
                (false, true) => BnGrad::EvalWithParams,
                (false, false) => BnGrad::EvalInputOnly,
            };
            // With a residual, the ReLU's masked gradient is both the residual's gradient and
            // what the affine pass reads: the sums' pass writes it as it reads dy, or, in the
            // mode without that pass, ReLU's backward makes it.
            let (dy, out) = match &out {
                Some(y) if mode == BnGrad::EvalInputOnly => (relu_grad(y, &dy)?, None),
                _ => (dy, out.clone()),
            };
            let (ys, ss) = (out.as_ref().map(|y| y.storage()), stats.storage());
            let relu = match (&ys, &out) {
                (Some(s), Some(y)) => FusedRelu::GradKept(&**s, y.layout()),
                _ if fused_relu && rdt.is_none() => FusedRelu::Recompute(&*ss, stats.layout()),
                _ => FusedRelu::None,
            };
            let g = dy.storage().batch_norm_grad(
                dy.layout(),
                &xs.storage(),
                xs.layout(),
                &ss,
                stats.layout(),
                mode,
                relu,
            )?;
            let (coef, params) = (g.coef, g.params);
            // The masked gradient lies as dy does, from its storage's start.
            let (dy, relu) = match g.masked {
                Some(m) => {
                    let l = Layout::new(dy.shape().to_vec(), dy.layout().strides().to_vec(), 0);
                    (Tensor::from_storage_in(m, l), FusedRelu::None)
                }
                None => (dy.clone(), relu),
            };
            let mask = || relu;
            let dx = match needs[0] {
                false => None,
                true => {
                    let coef = Tensor::from_storage(coef, &[4, c]);
                    let dx = xs.storage().channel_affine(
                        xs.layout(),
                        Addend::Scaled(&dy.storage(), dy.layout()),
                        &coef.storage(),
                        coef.layout(),
                        mask(),
                    )?;
                    let layout = Layout::with_format("batch_norm", xs.shape(), format)?;
                    Some(Tensor::from_storage_in(dx, layout))
                }
            };
            let mut grads = vec![dx];
            let (dw, db) = match params {
                Some((dw, db)) => (
                    Some(Tensor::from_storage(dw, &[c])),
                    Some(Tensor::from_storage(db, &[c])),
                ),
                None => (None, None),
            };
            if let Some(wdt) = wdt {
                grads.push(dw.map(|g| g.to_dtype(wdt)).transpose()?);
            }
            if let Some(bdt) = bdt {
                grads.push(db.map(|g| g.to_dtype(bdt)).transpose()?);
            }
            if let Some(rdt) = rdt {
                let wanted = needs[1 + nparams];
                grads.push(wanted.then(|| dy.to_dtype(rdt)).transpose()?);
            }
            Ok(grads)
        });
        if let (Some(node), Some(recipe)) = (&y.0.node, recipe) {
            node.set_recipe(recipe(y.id()));
        }
        Ok(y)
    }
}
