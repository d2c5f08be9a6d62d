//! Softmax and log-softmax along one dim.

use super::{dispatch, expect_float, Op};
use crate::backend::RowSoftmax;
use crate::layout::normalize_dim;
use crate::{Result, Tensor};

impl Tensor {
    fn softmax_impl(&self, dim: isize, log: bool) -> Result<Tensor> {
        let kind = if log { Op::LogSoftmax } else { Op::Softmax };
        let _prof = crate::profiler::op(kind.name());
        let [x] = dispatch(kind, [self])?;
        expect_float(kind, &x)?;
        let d = normalize_dim(kind.name(), dim, x.shape())?;
        let s = x.storage().softmax(x.layout(), d, log)?;
        let out = Tensor::from_storage(s, x.shape());
        // Saved output, detached so the graph holds no cycle.
        let y = out.detach();
        let di = d as isize;
        let read = y.clone();
        Ok(
            out.attach_saving(kind.name(), &[&x], &[&read], move |g, _| {
                // Along the last dim: one pass per row.
                if d + 1 == y.rank() && y.numel() > 0 {
                    let p = RowSoftmax {
                        cols: y.shape()[d],
                        scale: 1.0,
                        causal: None,
                        log,
                    };
                    let g = g.to_dtype(y.dtype())?.row_major_whole()?;
                    let dx = y.storage().softmax_rows_backward(&g.storage(), p)?;
                    return Ok(vec![Some(Tensor::from_storage(dx, y.shape()))]);
                }
                let gx = if log {
                    g.sub(&y.exp()?.mul(&g.sum(&[di], true)?)?)?
                } else {
                    y.mul(&g.sub(&g.mul(&y)?.sum(&[di], true)?)?)?
                };
                Ok(vec![Some(gx)])
            }),
        )
    }

    /// Softmax along `dim` (computed in f32 for half inputs, stable for large values).
    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        self.softmax_impl(dim, false)
    }

    /// Log-softmax along `dim`.
    pub fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        self.softmax_impl(dim, true)
    }
}
