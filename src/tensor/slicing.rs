//! Views that pick parts of a tensor, as PyTorch's indexing does: `select` (`x[i]` along a
//! dim), `slice` (`x[a:b:step]`), `chunk`, `view` (a reshape that never copies) and `repeat`
//! (a copy). Each is differentiable.

use crate::layout::{checked_numel, normalize_dim};
use crate::{Error, Result, Tensor};

impl Tensor {
    /// The slice at `index` of `dim`, with that dim removed (PyTorch's `x.select(dim, i)`,
    /// `x[i]` for dim 0); a negative index counts from the end. A view.
    ///
    /// ```
    /// use mantissa::{Tensor, Device};
    /// let x = Tensor::arange(0.0, 6.0, 1.0, mantissa::DType::F32, Device::Cpu)?.reshape(&[2, 3])?;
    /// assert_eq!(x.select(1, -1)?.to_vec::<f32>()?, vec![2.0, 5.0]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn select(&self, dim: isize, index: i64) -> Result<Tensor> {
        let d = normalize_dim("select", dim, self.shape())?;
        let size = self.shape()[d];
        let i = match index < 0 {
            true => index + size as i64,
            false => index,
        };
        if i < 0 || i >= size as i64 {
            return Err(Error::IndexOutOfRange {
                op: "select",
                index,
                dim: d,
                size,
            });
        }
        self.narrow(d as isize, i as usize, 1)?.squeeze(d as isize)
    }

    /// Every `step`-th element of `dim` from `start` up to (not including) `end`, as Python's
    /// `x[start:end:step]`: negative bounds count from the end, bounds past the size are
    /// clamped to it, `end = None` is the end, and `step` must be positive. A view; its
    /// gradient is scattered back into the positions it took.
    ///
    /// ```
    /// use mantissa::{Tensor, Device, DType};
    /// let x = Tensor::arange(0.0, 10.0, 1.0, DType::F32, Device::Cpu)?;
    /// assert_eq!(x.slice(0, 1, Some(-2), 3)?.to_vec::<f32>()?, vec![1.0, 4.0, 7.0]);
    /// assert_eq!(x.slice(0, -3, None, 1)?.to_vec::<f32>()?, vec![7.0, 8.0, 9.0]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn slice(&self, dim: isize, start: i64, end: Option<i64>, step: usize) -> Result<Tensor> {
        let d = normalize_dim("slice", dim, self.shape())?;
        if step == 0 {
            return Err(Error::invalid("slice", "step must be positive, got 0"));
        }
        let size = self.shape()[d] as i64;
        let clamp = |v: i64| match v < 0 {
            true => (v + size).max(0),
            false => v.min(size),
        };
        let (a, b) = (clamp(start), clamp(end.unwrap_or(size)));
        let len = match b > a {
            true => ((b - a) as usize).div_ceil(step),
            false => 0,
        };
        let a = (a as usize).min(self.shape()[d]);
        self.stepped(d, a, len, step)
    }

    /// `chunks` pieces along `dim` of `ceil(size / chunks)` each, the last possibly shorter
    /// and fewer pieces when the size runs out (PyTorch's `chunk`). Views.
    pub fn chunk(&self, chunks: usize, dim: isize) -> Result<Vec<Tensor>> {
        let d = normalize_dim("chunk", dim, self.shape())?;
        if chunks == 0 {
            return Err(Error::invalid(
                "chunk",
                "the number of chunks must be positive",
            ));
        }
        let size = self.shape()[d];
        if size == 0 {
            return Ok(vec![self.clone()]);
        }
        self.split(size.div_ceil(chunks), dim)
    }

    /// This tensor with another shape over the same memory, never a copy (PyTorch's `view`):
    /// one `-1` entry is inferred. A dim may be split, or dims merged, where the dims
    /// involved are contiguous among themselves, as PyTorch's rule allows
    /// ([`Layout::view_as`](crate::layout::Layout::view_as)); any other shape is an error
    /// that says to use [`Tensor::reshape`] (which copies when it must) or `contiguous`.
    ///
    /// ```
    /// use mantissa::{Tensor, Device, DType};
    /// let x = Tensor::zeros(&[2, 6], DType::F32, Device::Cpu)?;
    /// assert_eq!(x.view(&[3, -1])?.shape(), &[3, 4]);
    /// assert_eq!(x.t()?.view(&[3, 2, 2])?.strides(), &[2, 1, 6]);
    /// assert!(x.t()?.view(&[12]).is_err());
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn view(&self, shape: &[isize]) -> Result<Tensor> {
        let dims = self.inferred("view", shape)?;
        let numel: usize = dims.iter().product();
        if numel != self.numel() {
            return Err(Error::Reshape {
                op: "view",
                from: self.shape().to_vec(),
                from_numel: self.numel(),
                to: dims,
            });
        }
        let Some(layout) = self.layout().view_as(&dims) else {
            return Err(Error::invalid(
                "view",
                format!(
                    "a tensor of shape {:?} with strides {:?} has no view of shape {shape:?} \
                     (its dims are not contiguous where that shape splits or merges them); use \
                     reshape (which copies) or contiguous() first",
                    self.shape(),
                    self.strides()
                ),
            ));
        };
        let orig = self.shape().to_vec();
        Ok(self.view_with(layout).attach("view", &[self], move |g, _| {
            Ok(vec![Some(g.reshape(&orig)?)])
        }))
    }

    /// This tensor tiled `repeats[i]` times along each dim (PyTorch's `repeat`); `repeats`
    /// may be longer than the rank (new leading dims). A new tensor; the gradient sums the
    /// tiles.
    ///
    /// ```
    /// use mantissa::{Tensor, Device};
    /// let x = Tensor::from_vec(vec![1.0f32, 2.0], &[2], Device::Cpu)?;
    /// assert_eq!(x.repeat(&[2, 2])?.to_vec::<f32>()?, vec![1.0, 2.0, 1.0, 2.0, 1.0, 2.0, 1.0, 2.0]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn repeat(&self, repeats: &[usize]) -> Result<Tensor> {
        if repeats.len() < self.rank() {
            return Err(Error::invalid(
                "repeat",
                format!(
                    "{} repeats given for a tensor of rank {} (shape {:?}): give one per dim",
                    repeats.len(),
                    self.rank(),
                    self.shape()
                ),
            ));
        }
        let lead = repeats.len() - self.rank();
        let mut shape = vec![1; lead];
        shape.extend_from_slice(self.shape());
        // [.., 1, s_i, ..] expanded to [.., r_i, s_i, ..], then merged to r_i * s_i.
        let mut split = Vec::with_capacity(2 * shape.len());
        let mut tiled = Vec::with_capacity(2 * shape.len());
        let mut out = Vec::with_capacity(shape.len());
        for (&s, &r) in shape.iter().zip(repeats) {
            split.extend([1, s]);
            tiled.extend([r, s]);
            out.push(r.checked_mul(s).ok_or_else(|| {
                Error::too_large("repeat", &shape, format!("{r} repeats of {s} overflow"))
            })?);
        }
        checked_numel("repeat", &out)?;
        self.reshape(&split)?
            .expand(&tiled)?
            .contiguous()?
            .reshape(&out)
    }
}
