//! Losses: cross-entropy (class indices, label smoothing, ignore_index), NLL, MSE and BCE with
//! logits. All reduce in f32 or wider.

use super::{dispatch, expect_float, Op};
use crate::autograd::reuse::Reusable;
use crate::{DType, Error, Result, Tensor};

/// How per-element losses are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reduction {
    /// Mean over the (non-ignored) elements.
    #[default]
    Mean,
    Sum,
    /// Per-element losses, unreduced.
    None,
}

/// Options of [`Tensor::cross_entropy`], with PyTorch's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CrossEntropyOptions {
    pub reduction: Reduction,
    /// Targets equal to this contribute nothing (and are not counted by the mean).
    pub ignore_index: i64,
    /// Mixes the one-hot target with the uniform distribution: `(1 - e) y + e / C`.
    pub label_smoothing: f64,
}

impl Default for CrossEntropyOptions {
    fn default() -> Self {
        CrossEntropyOptions {
            reduction: Reduction::Mean,
            ignore_index: -100,
            label_smoothing: 0.0,
        }
    }
}

/// Moves the class dim (1) last and flattens: `[N, C, d...]` to `[N * d..., C]`, and the
/// target `[N, d...]` to `[N * d...]`. Logits of rank 3 or more whose target does not fit that
/// reading but is their shape without the last dim are read with the classes last, as a
/// language model's `[B, T, V]` logits with `[B, T]` targets (nanoGPT's
/// `logits.view(-1, V)`): `[B * T, V]`. When both readings fit (T == V), PyTorch's wins.
fn flatten_classes(op: Op, logits: &Tensor, target: &Tensor) -> Result<(Tensor, Tensor)> {
    if target.dtype() != DType::I64 {
        return Err(Error::DType {
            op: op.name(),
            dtype: target.dtype(),
            expected: "I64 class indices",
        });
    }
    let r = logits.rank();
    // One unbatched sample (logits `[C]`, a scalar target) is a batch of one, as in PyTorch.
    let class_dim = usize::from(r >= 2);
    let mut want = logits.shape().to_vec();
    if r >= 1 {
        want.remove(class_dim);
    }
    let class_last =
        r >= 3 && target.shape() != want.as_slice() && target.shape() == &logits.shape()[..r - 1];
    if r < 1 {
        return Err(Error::invalid(
            op.name(),
            format!(
                "logits of shape {:?} have no class dim (targets {:?})",
                logits.shape(),
                target.shape()
            ),
        ));
    }
    if target.shape() != want.as_slice() && !class_last {
        return Err(Error::invalid(
            op.name(),
            format!(
                "logits {:?} need targets {want:?} (classes in dim 1, as PyTorch's) or, with \
                 the classes last, {:?}; got targets {:?}",
                logits.shape(),
                &logits.shape()[..r - 1],
                target.shape()
            ),
        ));
    }
    let class_dim = if class_last { r - 1 } else { class_dim };
    let c = logits.shape()[class_dim];
    if c == 0 && target.numel() > 0 {
        return Err(Error::invalid(
            op.name(),
            format!(
                "logits {:?} have no classes for {} targets",
                logits.shape(),
                target.numel()
            ),
        ));
    }
    let x = if r == 1 {
        logits.reshape(&[1, c])?
    } else if r == 2 {
        logits.clone()
    } else if class_last {
        logits.reshape(&[target.numel(), c])?
    } else {
        let mut perm: Vec<usize> = (0..r).filter(|&d| d != 1).collect();
        perm.push(1);
        logits.permute(&perm)?.reshape(&[target.numel(), c])?
    };
    Ok((x, target.flatten(0, -1)?))
}

fn reduce(
    op: Op,
    per: Tensor,
    weight_sum: Option<Tensor>,
    reduction: Reduction,
    shape: &[usize],
) -> Result<Tensor> {
    match reduction {
        Reduction::None => per.reshape(shape),
        Reduction::Sum => per.sum_all(),
        Reduction::Mean => match weight_sum {
            Some(n) => per.sum_all()?.div(&n),
            None => {
                super::expect_nonempty(op, &per)?;
                per.mean_all()
            }
        },
    }
}

/// Per-row NLL of flattened log-probabilities (ignored rows give 0) and the row weights
/// (1 for counted rows, 0 for ignored ones).
fn nll_rows(lp: &Tensor, t: &Tensor, ignore_index: i64) -> Result<(Tensor, Tensor)> {
    let valid = t.ne(ignore_index as f64)?;
    // Ignored rows read class 0 and are masked out; gather checks the other targets' range.
    let zero = Tensor::scalar(0.0, DType::I64, t.device())?;
    let safe = Tensor::where_cond(&valid, t, &zero)?;
    let picked = lp.gather(1, &safe.unsqueeze(1)?)?.squeeze(1)?;
    let w = valid.to_dtype(lp.dtype())?;
    Ok((picked.neg()?.mul(&w)?, w))
}

impl Tensor {
    /// Negative log-likelihood of log-probabilities `[N, C]` (or `[N, C, d...]`, or one
    /// unbatched `[C]`) and I64 targets `[N]` (or `[N, d...]`, or a scalar). Log-probabilities
    /// `[B, T, V]` with targets `[B, T]` are read with the classes last when the first reading
    /// does not fit, as in [`Tensor::cross_entropy`].
    ///
    /// ```
    /// use mantissa::{Device, DType, Reduction, Tensor};
    /// let lp = Tensor::zeros(&[2, 3, 5], DType::F32, Device::Cpu)?.log_softmax(-1)?;
    /// let target = Tensor::zeros(&[2, 3], DType::I64, Device::Cpu)?; // [B, T]: classes last
    /// let loss = lp.nll_loss(&target, Reduction::Mean, -100)?;
    /// assert!((loss.item()? - 5f64.ln()).abs() < 1e-6);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn nll_loss(
        &self,
        target: &Tensor,
        reduction: Reduction,
        ignore_index: i64,
    ) -> Result<Tensor> {
        let _prof = crate::profiler::op(Op::NllLoss.name());
        let [lp] = dispatch(Op::NllLoss, [self])?;
        expect_float(Op::NllLoss, &lp)?;
        let (lp, t) = flatten_classes(Op::NllLoss, &lp, target)?;
        let (per, w) = nll_rows(&lp, &t, ignore_index)?;
        reduce(
            Op::NllLoss,
            per,
            Some(w.sum_all()?),
            reduction,
            target.shape(),
        )
    }

    /// Cross-entropy of raw logits against class indices (PyTorch's `F.cross_entropy`):
    /// logits `[N, C]`, `[N, C, d...]` or one unbatched `[C]`, I64 targets of the logits'
    /// shape without the class dim.
    ///
    /// A language model's logits `[B, T, V]` with targets `[B, T]` (the logits' shape without
    /// the last dim) are read with the classes last, as `logits.view(-1, V)` against
    /// `targets.view(-1)` would be in PyTorch: ignore_index, label smoothing, the reductions
    /// (the mean over the positions counted) and the gradient as for `[B * T, V]`. Where both
    /// readings fit (T == V), PyTorch's `[N, C, d]` reading is taken, as PyTorch would: give
    /// such logits flattened to `[B * T, V]`.
    ///
    /// ```
    /// use mantissa::{Tensor, Device, CrossEntropyOptions};
    /// let logits = Tensor::from_vec(vec![2.0f32, 0.0, 0.0, 2.0], &[2, 2], Device::Cpu)?;
    /// let target = Tensor::from_vec(vec![0i64, 1], &[2], Device::Cpu)?;
    /// let loss = logits.cross_entropy(&target, CrossEntropyOptions::default())?;
    /// assert!((loss.item()? - (1.0 + (-2.0f64).exp()).ln()).abs() < 1e-6);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn cross_entropy(&self, target: &Tensor, opts: CrossEntropyOptions) -> Result<Tensor> {
        let _prof = crate::profiler::op(Op::CrossEntropy.name());
        // Under autocast, f16/bf16 logits are read as they are: the kernels compute in f32
        // whatever the storage, so the loss and gradient are those of the logits cast to f32
        // first (PyTorch's autocast rule for the loss), bit for bit, without that f32 copy
        // of `[tokens, vocabulary]` and its f32 gradient. The loss is f32, as autocast's.
        let autocast_low = crate::amp::active_dtype().is_some() && self.dtype().is_half();
        let [x] = match autocast_low {
            true => {
                let _off = crate::amp::autocast_disabled();
                dispatch(Op::CrossEntropy, [self])?
            }
            false => dispatch(Op::CrossEntropy, [self])?,
        };
        expect_float(Op::CrossEntropy, &x)?;
        let e = opts.label_smoothing;
        if !(0.0..=1.0).contains(&e) {
            return Err(Error::invalid(
                "cross_entropy",
                format!("label_smoothing {e} not in [0, 1]"),
            ));
        }
        let (x, t) = flatten_classes(Op::CrossEntropy, &x, target)?;
        let ignore = opts.ignore_index;
        // One fused op per row (log-sum-exp, the target's logit, the row's sum) in the
        // arithmetic dtype; its backward writes the logits' gradient in one pass, over the
        // logits themselves when nothing else holds them any more (`autograd::reuse`).
        let (loss, lse) =
            x.storage()
                .cross_entropy(x.layout(), &t.storage(), t.layout(), ignore, e)?;
        let rows = x.shape()[0];
        let lse = Tensor::from_storage(lse, &[rows]);
        let (xs, ts) = (Reusable::new("cross_entropy", &x), t.clone());
        let per = Tensor::from_storage(loss, &[rows]).attach_saving(
            "cross_entropy",
            &[&x],
            &[&t],
            move |g, _| {
                let (tl, gl) = (ts.layout(), g.layout());
                let (tst, z, gs) = (ts.storage(), lse.storage(), g.storage());
                let x = xs.get()?;
                if xs.writable() {
                    let cols = x.shape()[1];
                    x.0.storage.write(|st| {
                        st.cross_entropy_backward_in_place(cols, &tst, tl, &z, &gs, gl, ignore, e)
                    })?;
                    return Ok(vec![Some(x.view_with(x.layout().clone()))]);
                }
                let s = x.storage().cross_entropy_backward(
                    x.layout(),
                    &tst,
                    tl,
                    &z,
                    &gs,
                    gl,
                    ignore,
                    e,
                )?;
                Ok(vec![Some(Tensor::from_storage(s, x.shape()))])
            },
        );
        // Reduced in the arithmetic dtype, then returned in the logits' dtype (f32 under
        // autocast).
        let w = t.ne(ignore as f64)?.to_dtype(per.dtype())?;
        let out = reduce(
            Op::CrossEntropy,
            per,
            Some(w.sum_all()?),
            opts.reduction,
            target.shape(),
        )?;
        match autocast_low {
            true => out.to_dtype(DType::F32),
            false => out.to_dtype(x.dtype()),
        }
    }

    /// Mean squared error.
    pub fn mse_loss(&self, target: &Tensor, reduction: Reduction) -> Result<Tensor> {
        let _prof = crate::profiler::op(Op::MseLoss.name());
        let [x, y] = dispatch(Op::MseLoss, [self, target])?;
        expect_float(Op::MseLoss, &x)?;
        if x.shape() != y.shape() {
            return Err(Error::ShapeMismatch {
                op: "mse_loss",
                lhs: x.shape().to_vec(),
                rhs: y.shape().to_vec(),
            });
        }
        let shape = x.shape().to_vec();
        reduce(Op::MseLoss, x.sub(&y)?.sqr()?, None, reduction, &shape)
    }

    /// Binary cross-entropy of logits (stable form `max(x,0) - x y + log(1 + e^-|x|)`).
    pub fn bce_with_logits(&self, target: &Tensor, reduction: Reduction) -> Result<Tensor> {
        let _prof = crate::profiler::op(Op::BceWithLogits.name());
        let [x, y] = dispatch(Op::BceWithLogits, [self, target])?;
        expect_float(Op::BceWithLogits, &x)?;
        let y = y.to_dtype(x.dtype())?;
        if x.shape() != y.shape() {
            return Err(Error::ShapeMismatch {
                op: "binary_cross_entropy_with_logits",
                lhs: x.shape().to_vec(),
                rhs: y.shape().to_vec(),
            });
        }
        let per = crate::no_grad(|| {
            x.relu()?
                .sub(&x.mul(&y)?)?
                .add(&x.abs()?.neg()?.exp()?.log1p()?)
        })?;
        // The gradients as PyTorch writes them: d/dx = sigmoid(x) - y, d/dy = -x. (The
        // stable form's own pieces, relu and abs, would give -y at x = 0 instead of 0.5 - y.)
        let (xs, ys) = (x.detach(), y.detach());
        let per = per.attach_saving(
            "binary_cross_entropy_with_logits",
            &[&x, &y],
            &[&x, &y],
            move |g, needs| {
                let dx = needs[0]
                    .then(|| g.mul(&xs.sigmoid()?.sub(&ys)?))
                    .transpose()?;
                let dy = needs[1].then(|| g.mul(&xs)?.neg()).transpose()?;
                Ok(vec![dx, dy])
            },
        );
        let shape = x.shape().to_vec();
        reduce(Op::BceWithLogits, per, None, reduction, &shape)
    }
}
