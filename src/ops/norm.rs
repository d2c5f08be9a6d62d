//! batch_norm and layer_norm, composed from differentiable ops (statistics in f32 or wider).

use super::{dispatch, expect_float, Op};
use crate::{no_grad, Error, Result, Tensor};

/// Reshapes a per-channel vector `[c]` to broadcast against `[n, c, ...]`.
fn per_channel(v: &Tensor, rank: usize) -> Result<Tensor> {
    let mut shape = vec![1; rank];
    shape[1] = v.numel();
    v.reshape(&shape)
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
        let [x] = dispatch(Op::BatchNorm, [self])?;
        expect_float(Op::BatchNorm, &x)?;
        if x.rank() < 2 {
            return Err(Error::invalid(
                "batch_norm",
                format!("input must be [n, c, ...], got {:?}", x.shape()),
            ));
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
        let dims: Vec<isize> = (0..x.rank() as isize).filter(|&d| d != 1).collect();
        let count = x.numel() / c.max(1);
        let (mean, var) = if training {
            if count <= 1 {
                return Err(Error::invalid(
                    "batch_norm",
                    format!(
                        "expected more than one value per channel in training, got input {:?}",
                        x.shape()
                    ),
                ));
            }
            let mean = x.mean(&dims, false)?;
            let var = x.var(&dims, 0, false)?;
            no_grad(|| -> Result<()> {
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
            })?;
            (mean, var)
        } else {
            match (running_mean, running_var) {
                (Some(m), Some(v)) => (m.to_dtype(x.dtype())?, v.to_dtype(x.dtype())?),
                _ => {
                    return Err(Error::invalid(
                        "batch_norm",
                        "eval mode needs running_mean and running_var",
                    ))
                }
            }
        };
        let r = x.rank();
        let xhat = x
            .sub(&per_channel(&mean, r)?)?
            .mul(&per_channel(&var.add(eps)?.rsqrt()?, r)?)?;
        let y = match weight {
            Some(w) => xhat.mul(&per_channel(w, r)?)?,
            None => xhat,
        };
        let y = match bias {
            Some(b) => y.add(&per_channel(b, r)?)?,
            None => y,
        };
        // Statistics and affine parameters may be wider (f32 under autocast); the output keeps
        // the input's dtype, as cuDNN's batch norm does.
        y.to_dtype(x.dtype())
    }

    /// Layer normalisation over the trailing `normalized_shape` dims (PyTorch's
    /// `F.layer_norm`), with optional elementwise affine parameters of that shape.
    pub fn layer_norm(
        &self,
        normalized_shape: &[usize],
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        let [x] = dispatch(Op::LayerNorm, [self])?;
        expect_float(Op::LayerNorm, &x)?;
        let k = normalized_shape.len();
        if k == 0 || k > x.rank() || x.shape()[x.rank() - k..] != *normalized_shape {
            return Err(Error::ShapeMismatch {
                op: "layer_norm",
                lhs: x.shape().to_vec(),
                rhs: normalized_shape.to_vec(),
            });
        }
        for v in [weight, bias].into_iter().flatten() {
            if v.shape() != normalized_shape {
                return Err(Error::ShapeMismatch {
                    op: "layer_norm (affine)",
                    lhs: normalized_shape.to_vec(),
                    rhs: v.shape().to_vec(),
                });
            }
        }
        if normalized_shape.contains(&0) {
            return Err(Error::Empty {
                op: "layer_norm",
                shape: x.shape().to_vec(),
            });
        }
        let dims: Vec<isize> = (-(k as isize)..0).collect();
        let mean = x.mean(&dims, true)?;
        let var = x.var(&dims, 0, true)?;
        let y = x.sub(&mean)?.mul(&var.add(eps)?.rsqrt()?)?;
        let y = match weight {
            Some(w) => y.mul(w)?,
            None => y,
        };
        match bias {
            Some(b) => y.add(b),
            None => Ok(y),
        }
    }
}
