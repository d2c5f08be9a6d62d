//! Views: new shapes and strides over the same storage. Each records its backward.

use super::Tensor;
use crate::layout::{checked_numel, normalize_dim, Layout};
use crate::{Error, Result};

impl Tensor {
    /// A contiguous tensor with the same values (this tensor itself when already contiguous).
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        let _prof = crate::profiler::op("contiguous");
        let s = self.storage().copy_strided(self.layout())?;
        Ok(Tensor::from_storage(s, self.shape())
            .attach("contiguous", &[self], |g, _| Ok(vec![Some(g.clone())])))
    }

    /// The same elements in a new shape; a view when the layout allows, a copy otherwise.
    ///
    /// ```
    /// use mantissa::{Tensor, DType, Device};
    /// let t = Tensor::arange(0.0, 6.0, 1.0, DType::F32, Device::Cpu)?.reshape(&[2, 3])?;
    /// assert_eq!(t.shape(), &[2, 3]);
    /// assert!(t.reshape(&[4, 2]).is_err());
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        let numel = checked_numel("reshape", shape)?;
        if numel != self.numel() {
            return Err(Error::Reshape {
                op: "reshape",
                from: self.shape().to_vec(),
                from_numel: self.numel(),
                to: shape.to_vec(),
            });
        }
        if shape == self.shape() {
            return Ok(self.clone());
        }
        let src = self.contiguous()?;
        let layout = src.layout().reshape_view(shape).expect("contiguous");
        let orig = self.shape().to_vec();
        Ok(src
            .view_with(layout)
            .attach("reshape", &[&src], move |g, _| {
                Ok(vec![Some(g.reshape(&orig)?)])
            }))
    }

    /// Reshape where one entry may be `-1` (inferred from the element count).
    pub fn reshape_infer(&self, shape: &[isize]) -> Result<Tensor> {
        let dims = self.inferred("reshape", shape)?;
        self.reshape(&dims)
    }

    /// `shape` with its `-1` entry (at most one) inferred from the element count.
    pub(crate) fn inferred(&self, op: &'static str, shape: &[isize]) -> Result<Vec<usize>> {
        let known_dims: Vec<usize> = shape
            .iter()
            .filter(|&&d| d >= 0)
            .map(|&d| d as usize)
            .collect();
        let known = checked_numel(op, &known_dims)?;
        let holes = shape.iter().filter(|&&d| d < 0).count();
        let bad = || Error::invalid(op, format!("cannot infer {shape:?} for {:?}", self.shape()));
        if holes > 1 || shape.iter().any(|&d| d < -1) {
            return Err(bad());
        }
        shape
            .iter()
            .map(|&d| {
                if d >= 0 {
                    Ok(d as usize)
                } else if known == 0 || !self.numel().is_multiple_of(known) {
                    Err(bad())
                } else {
                    Ok(self.numel() / known)
                }
            })
            .collect()
    }

    /// Flattens dims `start..=end` into one.
    pub fn flatten(&self, start: isize, end: isize) -> Result<Tensor> {
        if self.rank() == 0 {
            return self.reshape(&[1]);
        }
        let s = normalize_dim("flatten", start, self.shape())?;
        let e = normalize_dim("flatten", end, self.shape())?;
        if s > e {
            return Err(Error::invalid(
                "flatten",
                format!("start {start} after end {end}"),
            ));
        }
        let mut shape = self.shape()[..s].to_vec();
        shape.push(self.shape()[s..=e].iter().product());
        shape.extend_from_slice(&self.shape()[e + 1..]);
        self.reshape(&shape)
    }

    /// Reorders dims: output dim `i` is input dim `perm[i]`.
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        let layout = self.layout().permute("permute", perm)?;
        let mut inv = vec![0; perm.len()];
        for (i, &p) in perm.iter().enumerate() {
            inv[p] = i;
        }
        Ok(self
            .view_with(layout)
            .attach("permute", &[self], move |g, _| {
                Ok(vec![Some(g.permute(&inv)?)])
            }))
    }

    /// Swaps two dims.
    pub fn transpose(&self, d0: isize, d1: isize) -> Result<Tensor> {
        let a = normalize_dim("transpose", d0, self.shape())?;
        let b = normalize_dim("transpose", d1, self.shape())?;
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        perm.swap(a, b);
        self.permute(&perm)
    }

    /// The transpose of a matrix, as PyTorch's `t()`: a 2-D tensor's two dims swapped, a 0-D
    /// or 1-D tensor as it is, and an Err for more dims (use [`Tensor::mt`] there).
    ///
    /// ```
    /// use mantissa::{Tensor, DType, Device};
    /// let a = Tensor::zeros(&[2, 3], DType::F32, Device::Cpu)?;
    /// assert_eq!(a.t()?.shape(), &[3, 2]);
    /// assert_eq!(Tensor::zeros(&[3], DType::F32, Device::Cpu)?.t()?.shape(), &[3]);
    /// assert!(Tensor::zeros(&[2, 3, 4], DType::F32, Device::Cpu)?.t().is_err());
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn t(&self) -> Result<Tensor> {
        match self.rank() {
            0 | 1 => Ok(self.clone()),
            2 => self.transpose(0, 1),
            _ => Err(Error::invalid(
                "t",
                format!(
                    "expects at most 2 dims, shape is {:?} (mt() transposes the last two)",
                    self.shape()
                ),
            )),
        }
    }

    /// The last two dims swapped, for a batch of matrices (PyTorch's `.mT`); rank >= 2.
    ///
    /// ```
    /// use mantissa::{Tensor, DType, Device};
    /// let a = Tensor::zeros(&[5, 2, 3], DType::F32, Device::Cpu)?;
    /// assert_eq!(a.mt()?.shape(), &[5, 3, 2]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn mt(&self) -> Result<Tensor> {
        if self.rank() < 2 {
            return Err(Error::invalid(
                "mt",
                format!("needs rank >= 2, shape is {:?}", self.shape()),
            ));
        }
        self.transpose(-2, -1)
    }

    /// Elements `start..start + len` of `dim` (a view).
    pub fn narrow(&self, dim: isize, start: usize, len: usize) -> Result<Tensor> {
        let d = normalize_dim("narrow", dim, self.shape())?;
        let layout = self.layout().narrow("narrow", d, start, len)?;
        let shape = self.shape().to_vec();
        Ok(self
            .view_with(layout)
            .attach("narrow", &[self], move |g, _| {
                Ok(vec![Some(g.pad_into(&shape, d, start)?)])
            }))
    }

    /// A zero tensor of `shape` with this tensor written at `start` along `dim` (the adjoint
    /// of `narrow`; differentiable).
    pub(crate) fn pad_into(&self, shape: &[usize], dim: usize, start: usize) -> Result<Tensor> {
        Layout::contiguous(shape).narrow("narrow_backward", dim, start, self.shape()[dim])?;
        self.place_into(shape, dim, start, 1)
    }

    /// Every `step`-th element of `dim` from `start`, `len` of them, as a view (the caller
    /// checked the range); its gradient is placed back where the elements were.
    pub(crate) fn stepped(
        &self,
        dim: usize,
        start: usize,
        len: usize,
        step: usize,
    ) -> Result<Tensor> {
        if step == 1 {
            return self.narrow(dim as isize, start, len);
        }
        let layout = self.layout().stepped(dim, start, len, step);
        let shape = self.shape().to_vec();
        Ok(self
            .view_with(layout)
            .attach("slice", &[self], move |g, _| {
                Ok(vec![Some(g.place_into(&shape, dim, start, step)?)])
            }))
    }

    /// A zero tensor of `shape` with this tensor written at every `step`-th position of `dim`
    /// from `start` (the adjoint of [`Tensor::stepped`]; differentiable). The positions are
    /// within `shape`: the callers checked them.
    fn place_into(&self, shape: &[usize], dim: usize, start: usize, step: usize) -> Result<Tensor> {
        let out = Tensor::zeros(shape, self.dtype(), self.device())?;
        let len = self.shape()[dim];
        let dst = out.layout().stepped(dim, start, len, step);
        let src = self.storage();
        out.0
            .storage
            .write(|s| s.copy_into(&dst, &src, self.layout()))?;
        let name = match step {
            1 => "pad",
            _ => "slice_backward",
        };
        Ok(out.attach(name, &[self], move |g, _| {
            Ok(vec![Some(g.stepped(dim, start, len, step)?)])
        }))
    }

    /// Splits `dim` into chunks of `size` (the last may be shorter).
    pub fn split(&self, size: usize, dim: isize) -> Result<Vec<Tensor>> {
        let d = normalize_dim("split", dim, self.shape())?;
        if size == 0 {
            return Err(Error::invalid("split", "chunk size 0"));
        }
        (0..self.shape()[d])
            .step_by(size)
            .map(|s| self.narrow(dim, s, size.min(self.shape()[d] - s)))
            .collect()
    }

    /// Broadcasts to `shape` (a view with stride 0 on repeated dims).
    pub fn expand(&self, shape: &[usize]) -> Result<Tensor> {
        if shape == self.shape() {
            return Ok(self.clone());
        }
        let layout = self.layout().broadcast_as("expand", shape)?;
        let orig = self.shape().to_vec();
        Ok(self
            .view_with(layout)
            .attach("expand", &[self], move |g, _| {
                Ok(vec![Some(g.sum_to(&orig)?)])
            }))
    }

    /// Inserts a size-1 dim at `dim` (`-1` appends).
    pub fn unsqueeze(&self, dim: isize) -> Result<Tensor> {
        let r = self.rank() as isize + 1;
        let d = if dim < 0 { dim + r } else { dim };
        if d < 0 || d >= r {
            return Err(Error::DimOutOfRange {
                op: "unsqueeze",
                dim,
                rank: self.rank(),
                shape: self.shape().to_vec(),
            });
        }
        let layout = self.layout().unsqueeze(d as usize);
        let orig = self.shape().to_vec();
        Ok(self
            .view_with(layout)
            .attach("unsqueeze", &[self], move |g, _| {
                Ok(vec![Some(g.reshape(&orig)?)])
            }))
    }

    /// Removes dim `dim` if it has size 1 (otherwise returns the tensor unchanged, as PyTorch).
    pub fn squeeze(&self, dim: isize) -> Result<Tensor> {
        let d = normalize_dim("squeeze", dim, self.shape())?;
        if self.shape()[d] != 1 {
            return Ok(self.clone());
        }
        let layout: Layout = self.layout().squeeze(d);
        let orig = self.shape().to_vec();
        Ok(self
            .view_with(layout)
            .attach("squeeze", &[self], move |g, _| {
                Ok(vec![Some(g.reshape(&orig)?)])
            }))
    }

    /// Removes every size-1 dim.
    pub fn squeeze_all(&self) -> Result<Tensor> {
        let shape: Vec<usize> = self.shape().iter().copied().filter(|&d| d != 1).collect();
        self.reshape(&shape)
    }
}

impl Tensor {
    /// A contiguous copy with its own storage (PyTorch's `clone()`; differentiable).
    pub fn copy(&self) -> Result<Tensor> {
        let s = self.storage().copy_strided(self.layout())?;
        Ok(Tensor::from_storage(s, self.shape())
            .attach("copy", &[self], |g, _| Ok(vec![Some(g.clone())])))
    }
}
