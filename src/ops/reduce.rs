//! Reductions: sum, mean, max/min (with indices), argmax/argmin, var, and `sum_to`.

use super::{dispatch, expect_float, expect_nonempty_reduction, Op};
use crate::backend::ops::ReduceOp;
use crate::layout::{normalize_dim, normalize_dims};
use crate::{DType, Error, Result, Tensor};

impl Tensor {
    /// Runs a reduction kernel; the result has the reduced dims kept as size 1.
    fn reduce_raw(&self, dims: &[usize], op: ReduceOp) -> Result<Tensor> {
        let s = self.storage().reduce(self.layout(), dims, op)?;
        let mut shape = self.shape().to_vec();
        for &d in dims {
            shape[d] = 1;
        }
        Ok(Tensor::from_storage(s, &shape))
    }

    /// Drops the reduced dims from a keepdim result unless `keepdim`.
    fn finish(&self, t: Tensor, dims: &[usize], keepdim: bool) -> Result<Tensor> {
        if keepdim {
            return Ok(t);
        }
        let shape: Vec<usize> = (0..self.rank())
            .filter(|d| !dims.contains(d))
            .map(|d| self.shape()[d])
            .collect();
        t.reshape(&shape)
    }

    fn sum_like(&self, dims: &[isize], keepdim: bool, op: ReduceOp, kind: Op) -> Result<Tensor> {
        let _prof = crate::profiler::op(kind.name());
        let [x] = dispatch(kind, [self])?;
        expect_float(kind, &x)?;
        let d = normalize_dims(kind.name(), dims, x.shape())?;
        let count: usize = d.iter().map(|&i| x.shape()[i]).product();
        let r = x.reduce_raw(&d, op)?;
        let shape = x.shape().to_vec();
        let kshape = r.shape().to_vec();
        // The reduced dims dropped before the node is attached: the result's node is the
        // reduction's own (what an error about the graph names).
        let r = x.finish(r, &d, keepdim)?;
        Ok(r.attach(kind.name(), &[&x], move |g, _| {
            let g = g.reshape(&kshape)?.expand(&shape)?;
            let g = if op == ReduceOp::Mean {
                g.div(count as f64)?
            } else {
                g
            };
            Ok(vec![Some(g)])
        }))
    }

    /// Sum over `dims` (all dims when empty).
    ///
    /// ```
    /// use mantissa::{Tensor, Device};
    /// let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2], Device::Cpu)?;
    /// assert_eq!(x.sum(&[1], false)?.to_vec::<f32>()?, vec![3.0, 7.0]);
    /// assert_eq!(x.sum(&[0], true)?.shape(), &[1, 2]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    ///
    /// An integer or U8 (bool) tensor sums to I64, modulo 2^64, as PyTorch's integer and bool
    /// sums do.
    pub fn sum(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        if !self.dtype().is_float() {
            return self.int_sum(dims, keepdim);
        }
        self.sum_like(dims, keepdim, ReduceOp::Sum, Op::Sum)
    }

    /// [`Tensor::sum`] of an integer tensor: in I64, a tree of pairwise adds along each
    /// reduced dim (exact integer adds on every backend).
    fn int_sum(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let _prof = crate::profiler::op(Op::Sum.name());
        let mut d = normalize_dims("sum", dims, self.shape())?;
        if d.is_empty() {
            d = (0..self.rank()).collect();
        }
        let mut y = self.to_dtype(DType::I64)?;
        for &i in &d {
            y = match y.shape()[i] {
                0 => {
                    let mut shape = y.shape().to_vec();
                    shape[i] = 1;
                    Tensor::zeros(&shape, DType::I64, y.device())?
                }
                _ => y.pairwise(i, |a, b| a.add(b))?,
            };
        }
        self.finish(y, &d, keepdim)
    }

    /// Sum of every element (a 0-d tensor).
    pub fn sum_all(&self) -> Result<Tensor> {
        self.sum(&[], false)
    }

    /// Mean over `dims` (all dims when empty); errors on an empty reduction (no elements
    /// to average), not on an empty result (`[0, 3]` averaged over dim 1 is `[0]`).
    pub fn mean(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let d = normalize_dims("mean", dims, self.shape())?;
        expect_nonempty_reduction(Op::Mean, self, &d)?;
        self.sum_like(dims, keepdim, ReduceOp::Mean, Op::Mean)
    }

    /// Mean of every element.
    pub fn mean_all(&self) -> Result<Tensor> {
        self.mean(&[], false)
    }

    /// Variance over `dims` with `correction` (1 = unbiased, PyTorch's default; 0 = biased).
    pub fn var(&self, dims: &[isize], correction: usize, keepdim: bool) -> Result<Tensor> {
        let _prof = crate::profiler::op(Op::Var.name());
        let [x] = dispatch(Op::Var, [self])?;
        let d = normalize_dims("var", dims, x.shape())?;
        expect_nonempty_reduction(Op::Var, &x, &d)?;
        let n: usize = d.iter().map(|&i| x.shape()[i]).product();
        if n <= correction {
            return Err(Error::invalid(
                "var",
                format!("{n} elements with correction {correction}"),
            ));
        }
        let di: Vec<isize> = d.iter().map(|&i| i as isize).collect();
        let centred = x.sub(&x.mean(&di, true)?)?;
        centred
            .sqr()?
            .sum(&di, keepdim)?
            .div((n - correction) as f64)
    }

    /// Standard deviation (see [`Tensor::var`]).
    pub fn std(&self, dims: &[isize], correction: usize, keepdim: bool) -> Result<Tensor> {
        let v = self.var(dims, correction, keepdim)?;
        let s = crate::no_grad(|| v.sqrt())?;
        if !v.is_requires_grad() || !crate::is_grad_enabled() {
            return Ok(s);
        }
        // d std = d var / (2 std), and 0 where std is 0 (PyTorch's convention; the plain
        // square root's derivative would make it 0 * inf = NaN for a constant slice).
        let out = s.detach();
        Ok(s.attach_saving("std", &[&v], &[], move |g, _| {
            let dv = g.div(&out.mul(2.0)?)?.masked_fill(&out.eq(0.0)?, 0.0)?;
            Ok(vec![Some(dv)])
        }))
    }

    fn extreme(&self, dim: isize, keepdim: bool, max: bool) -> Result<(Tensor, Tensor)> {
        let _prof = crate::profiler::op(Op::MaxMin.name());
        let [x] = dispatch(Op::MaxMin, [self])?;
        let d = normalize_dim("max/min", dim, x.shape())?;
        expect_nonempty_reduction(Op::MaxMin, &x, &[d])?;
        let (vop, iop) = if max {
            (ReduceOp::Max, ReduceOp::ArgMax)
        } else {
            (ReduceOp::Min, ReduceOp::ArgMin)
        };
        let idx = x.reduce_raw(&[d], iop)?;
        let vals = x.reduce_raw(&[d], vop)?;
        let vals = if x.dtype().is_float() {
            let (shape, saved_idx) = (x.shape().to_vec(), idx.clone());
            let name = if max { "max" } else { "min" };
            vals.attach_saving(name, &[&x], &[&idx], move |g, _| {
                let z = Tensor::zeros(&shape, g.dtype(), g.device())?;
                Ok(vec![Some(z.scatter_add(d as isize, &saved_idx, g)?)])
            })
        } else {
            vals
        };
        Ok((
            x.finish(vals, &[d], keepdim)?,
            x.finish(idx, &[d], keepdim)?,
        ))
    }

    /// Maximum along `dim`: values and their (first) indices.
    pub fn max(&self, dim: isize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        self.extreme(dim, keepdim, true)
    }

    /// Minimum along `dim`: values and their (first) indices.
    pub fn min(&self, dim: isize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        self.extreme(dim, keepdim, false)
    }

    /// Maximum of every element, a 0-d tensor. As in PyTorch, the gradient is shared evenly
    /// by every element equal to the maximum (by the NaNs when it is NaN).
    ///
    /// ```
    /// use mantissa::{Tensor, Device};
    /// let x = Tensor::from_vec(vec![3.0f32, 1.0, 3.0], &[3], Device::Cpu)?.requires_grad(true)?;
    /// x.max_all()?.backward()?;
    /// assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![0.5, 0.0, 0.5]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn max_all(&self) -> Result<Tensor> {
        self.extreme_all(true)
    }

    /// Minimum of every element, a 0-d tensor; ties share the gradient, as in [`Tensor::max_all`].
    pub fn min_all(&self) -> Result<Tensor> {
        self.extreme_all(false)
    }

    fn extreme_all(&self, max: bool) -> Result<Tensor> {
        let name = if max { "max" } else { "min" };
        let flat = self.flatten(0, -1)?;
        let v = crate::no_grad(|| match max {
            true => flat.max(0, false),
            false => flat.min(0, false),
        })?
        .0;
        if !self.is_requires_grad() || !crate::is_grad_enabled() {
            return Ok(v);
        }
        let (xs, vs) = (self.detach(), v.detach());
        Ok(v.attach_saving(name, &[self], &[self], move |g, _| {
            // The elements equal to the result; when it is NaN, the NaNs.
            let dt = xs.dtype();
            let equal = xs.eq(&vs)?.to_dtype(dt)?;
            let nans = xs.ne(&xs)?.to_dtype(dt)?;
            let v_nan = vs.ne(&vs)?.to_dtype(dt)?;
            let mask = equal.add(&nans.sub(&equal)?.mul(&v_nan)?)?;
            let share = g.to_dtype(dt)?.div(&mask.sum_all()?)?;
            Ok(vec![Some(mask.mul(&share)?)])
        }))
    }

    /// Index (I64) of the first maximum along `dim`.
    pub fn argmax(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        Ok(self.max(dim, keepdim)?.1)
    }

    /// Index (I64) of the first minimum along `dim`.
    pub fn argmin(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        Ok(self.min(dim, keepdim)?.1)
    }

    /// Sums a broadcast result back to `shape` (the adjoint of `expand`).
    pub fn sum_to(&self, shape: &[usize]) -> Result<Tensor> {
        if self.shape() == shape {
            return Ok(self.clone());
        }
        let err = || Error::Broadcast {
            op: "sum_to",
            lhs: self.shape().to_vec(),
            rhs: shape.to_vec(),
        };
        if shape.len() > self.rank() {
            return Err(err());
        }
        let extra = self.rank() - shape.len();
        let mut dims: Vec<isize> = (0..extra as isize).collect();
        for (i, &s) in shape.iter().enumerate() {
            let d = self.shape()[extra + i];
            if s == 1 && d != 1 {
                dims.push((extra + i) as isize);
            } else if s != d {
                return Err(err());
            }
        }
        if dims.is_empty() {
            return self.reshape(shape);
        }
        self.sum(&dims, true)?.reshape(shape)
    }
}
