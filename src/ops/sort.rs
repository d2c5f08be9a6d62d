//! Sorting along a dim: `argsort`, `sort` and `topk`. The indices come from the backend's
//! argsort kernel (a stable order, NaN as the largest value, as PyTorch's
//! `sort(stable=True)`); the values are a `gather` of them, whose backward scatters the
//! gradient back to the places the values came from.

use crate::layout::normalize_dim;
use crate::{Error, Result, Tensor};

impl Tensor {
    /// The indices (I64) that sort `dim` in ascending order (descending with `descending`),
    /// PyTorch's `argsort(dim, descending, stable=True)`: equal elements keep their order,
    /// NaN counts as larger than every number (last ascending, first descending). Works for
    /// every dtype; the indices carry no gradient.
    ///
    /// ```
    /// use mantissa::{Tensor, Device};
    /// let x = Tensor::from_vec(vec![3.0f32, 1.0, 2.0, 1.0], &[4], Device::Cpu)?;
    /// assert_eq!(x.argsort(0, false)?.to_vec::<i64>()?, vec![1, 3, 2, 0]);
    /// assert_eq!(x.argsort(-1, true)?.to_vec::<i64>()?, vec![0, 2, 1, 3]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn argsort(&self, dim: isize, descending: bool) -> Result<Tensor> {
        let _prof = crate::profiler::op("argsort");
        if self.rank() == 0 {
            normalize_dim("argsort", dim, &[1])?;
            return self.reshape(&[1])?.argsort(0, descending)?.reshape(&[]);
        }
        let d = normalize_dim("argsort", dim, self.shape())?;
        let last = self.rank() - 1;
        // The sorted dim last (a view), sorted by rows, and put back in its place.
        let moved = self.detach().transpose(d as isize, last as isize)?;
        let idx = moved.storage().argsort(moved.layout(), descending)?;
        let idx = Tensor::from_storage(idx, moved.shape());
        match d == last {
            true => Ok(idx),
            false => idx.transpose(d as isize, last as isize)?.contiguous(),
        }
    }

    /// The elements sorted along `dim` and the indices they came from (PyTorch's
    /// `sort(dim, descending, stable=True)`; order as [`Tensor::argsort`]). The values have a
    /// gradient: each element's goes back to where it came from.
    ///
    /// ```
    /// use mantissa::{Tensor, Device};
    /// let x = Tensor::from_vec(vec![3.0f32, 1.0, 2.0, 5.0, 4.0, 6.0], &[2, 3], Device::Cpu)?;
    /// let (values, indices) = x.sort(1, true)?;
    /// assert_eq!(values.to_vec::<f32>()?, vec![3.0, 2.0, 1.0, 6.0, 5.0, 4.0]);
    /// assert_eq!(indices.to_vec::<i64>()?, vec![0, 2, 1, 2, 0, 1]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn sort(&self, dim: isize, descending: bool) -> Result<(Tensor, Tensor)> {
        let idx = self.argsort(dim, descending)?;
        let dim = match self.rank() {
            0 => return Ok((self.clone(), idx)),
            _ => dim,
        };
        Ok((self.gather(dim, &idx)?, idx))
    }

    /// The `k` largest elements along `dim` (the smallest with `largest` false), in order
    /// (largest first, or smallest first), and their indices: PyTorch's `topk(k, dim,
    /// largest, sorted=True)`. Among equal elements the earlier ones are taken first; NaN
    /// counts as the largest value. The values have a gradient.
    ///
    /// ```
    /// use mantissa::{Tensor, Device};
    /// let x = Tensor::from_vec(vec![0.1f32, 0.7, 0.2, 0.9], &[4], Device::Cpu)?;
    /// let (values, indices) = x.topk(2, 0, true)?;
    /// assert_eq!(values.to_vec::<f32>()?, vec![0.9, 0.7]);
    /// assert_eq!(indices.to_vec::<i64>()?, vec![3, 1]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn topk(&self, k: usize, dim: isize, largest: bool) -> Result<(Tensor, Tensor)> {
        let shape = match self.rank() {
            0 => vec![1],
            _ => self.shape().to_vec(),
        };
        let d = normalize_dim("topk", dim, &shape)?;
        if k > shape[d] {
            return Err(Error::Invalid {
                op: "topk",
                msg: format!(
                    "k {k} is more than dim {d} of {:?} holds ({})",
                    self.shape(),
                    shape[d]
                ),
            });
        }
        if self.rank() == 0 {
            // A 0-d tensor is its own top element, as in PyTorch.
            return self.sort(dim, largest);
        }
        let idx = self.argsort(dim, largest)?;
        let idx = idx.narrow(d as isize, 0, k)?.contiguous()?;
        Ok((self.gather(d as isize, &idx)?, idx))
    }
}
