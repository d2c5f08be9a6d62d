//! Layer normalisation (PyTorch's `F.layer_norm`): one fused pass of the backends forward,
//! one backward (the input's gradient and the parameters' sums together on CUDA), statistics
//! in f32 or wider; its node is shared with the residual form (`norm_residual.rs`).

use super::{dispatch, expect_float, Op};
use crate::backend::norm::LnWant;
use crate::backend::Storage;
use crate::{DType, Error, Result, Tensor};

impl Tensor {
    /// Layer normalisation over the trailing `normalized_shape` dims (PyTorch's
    /// `F.layer_norm`), with optional elementwise affine parameters of that shape.
    pub fn layer_norm(
        &self,
        normalized_shape: &[usize],
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        let _prof = crate::profiler::op(Op::LayerNorm.name());
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
        // One dtype for every operand (PyTorch's promotion: f16 input with f32 parameters
        // gives f32); under autocast the input is f32 already.
        let dt = [weight, bias]
            .into_iter()
            .flatten()
            .fold(x.dtype(), |d, v| d.promote(v.dtype()));
        let x = x.to_dtype(dt)?.contiguous()?;
        let cast = |v: Option<&Tensor>| v.map(|v| v.to_dtype(dt)?.contiguous()).transpose();
        let (w, b) = (cast(weight)?, cast(bias)?);
        let cols: usize = normalized_shape.iter().product();
        let (y, stats) = {
            let (xs, ws, bs) = (
                x.storage(),
                w.as_ref().map(|w| w.storage()),
                b.as_ref().map(|b| b.storage()),
            );
            let wp = ws.as_deref().zip(w.as_ref().map(|t| t.layout()));
            let bp = bs.as_deref().zip(b.as_ref().map(|t| t.layout()));
            xs.layer_norm(x.layout(), cols, wp, bp, eps)?
        };
        Ok(layer_norm_node(
            &x,
            (w, b),
            (y, stats),
            normalized_shape,
            dt,
        ))
    }
}

/// Layer norm's node in the graph: its output `y` and statistics from `x` (contiguous, in
/// `dt`, as are the affine parameters `w` and `b`), with the backward of the ops in
/// `normalized_shape`'s trailing dims. [`Tensor::layer_norm`] and the residual form
/// (`norm_residual.rs`) make it.
pub(super) fn layer_norm_node(
    x: &Tensor,
    (w, b): (Option<Tensor>, Option<Tensor>),
    (y, stats): (Storage, Storage),
    normalized_shape: &[usize],
    dt: DType,
) -> Tensor {
    let cols: usize = normalized_shape.iter().product();
    let rows = x.numel() / cols;
    let y = Tensor::from_storage(y, x.shape());
    let stats = Tensor::from_storage(stats, &[rows, 2]);
    let mut inputs = vec![x];
    inputs.extend(w.as_ref());
    inputs.extend(b.as_ref());
    let (xs, ws) = (x.detach(), w.as_ref().map(|w| w.detach()));
    let (has_w, has_b) = (w.is_some(), b.is_some());
    let pshape = normalized_shape.to_vec();
    let mut reads = vec![x];
    reads.extend(w.as_ref());
    y.attach_saving("layer_norm", &inputs, &reads, move |dy, needs| {
        let dy = dy.to_dtype(dt)?.contiguous()?;
        // The input's gradient and the parameters' sums from one kernel on CUDA.
        let want_w = has_w && needs[1];
        let want_b = has_b && needs[1 + usize::from(has_w)];
        let want = LnWant {
            dx: needs[0],
            params: want_w || want_b,
        };
        let g = {
            let (ds, xst, ss) = (dy.storage(), xs.storage(), stats.storage());
            let wst = ws.as_ref().map(|w| w.storage());
            let wpart = wst.as_deref().zip(ws.as_ref().map(|w| w.layout()));
            ds.layer_norm_backward(dy.layout(), &xst, xs.layout(), cols, &ss, wpart, want)?
        };
        let dx = g.dx.map(|s| Tensor::from_storage(s, xs.shape()));
        let mut grads = vec![dx];
        let params = match g.params {
            Some((dw, db)) => Some((
                Tensor::from_storage(dw, &pshape),
                Tensor::from_storage(db, &pshape),
            )),
            None if want.params => Some(param_grads(&dy, &xs, &stats, (rows, cols))?),
            None => None,
        };
        let (dw, db) = params.unzip();
        if has_w {
            let dw = dw.filter(|_| want_w);
            grads.push(dw.map(|g| g.to_dtype(dt)?.reshape(&pshape)).transpose()?);
        }
        if has_b {
            let db = db.filter(|_| want_b);
            grads.push(db.map(|g| g.to_dtype(dt)?.reshape(&pshape)).transpose()?);
        }
        Ok(grads)
    })
}

/// Layer norm's weight and bias gradients by composition, where the backend's pass leaves
/// them out: the sums over the rows of `dy xhat` and `dy` in the statistics' dtype.
fn param_grads(
    dy: &Tensor,
    x: &Tensor,
    stats: &Tensor,
    (rows, cols): (usize, usize),
) -> Result<(Tensor, Tensor)> {
    let sd = stats.dtype();
    let dy2 = dy.reshape(&[rows, cols])?.to_dtype(sd)?;
    let mean = stats.narrow(1, 0, 1)?;
    let rstd = stats.narrow(1, 1, 1)?;
    let xhat = x
        .reshape(&[rows, cols])?
        .to_dtype(sd)?
        .sub(&mean)?
        .mul(&rstd)?;
    Ok((dy2.mul(&xhat)?.sum(&[0], false)?, dy2.sum(&[0], false)?))
}
