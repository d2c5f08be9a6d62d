//! `tril` and `triu`: the lower and upper triangles of the last two dims, the rest zeroed.
//! Both are a `where` against a `[rows, cols]` mask made on the tensor's device, so they work
//! for every dtype and device, and their gradient is the same mask applied to the output's
//! gradient (the `where`'s backward).

use crate::{DType, Error, Result, Tensor};

impl Tensor {
    /// The lower triangle of the last two dims (PyTorch's `tril(diagonal)`): element
    /// `[.., i, j]` is kept where `j - i <= diagonal` and zero elsewhere. `diagonal` 0 keeps
    /// the main diagonal, a positive one diagonals above it too, a negative one drops
    /// diagonals below it. Rank 2 or more (the dims before the last two are a batch); any
    /// dtype; differentiable.
    ///
    /// ```
    /// use mantissa::{Tensor, DType, Device};
    /// let x = Tensor::ones(&[3, 3], DType::F32, Device::Cpu)?;
    /// assert_eq!(x.tril(0)?.to_vec::<f32>()?, vec![1., 0., 0., 1., 1., 0., 1., 1., 1.]);
    /// assert_eq!(x.tril(-1)?.to_vec::<f32>()?, vec![0., 0., 0., 1., 0., 0., 1., 1., 0.]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn tril(&self, diagonal: i64) -> Result<Tensor> {
        self.triangle("tril", diagonal, false)
    }

    /// The upper triangle of the last two dims (PyTorch's `triu(diagonal)`): element
    /// `[.., i, j]` is kept where `j - i >= diagonal` and zero elsewhere. As [`Tensor::tril`]
    /// otherwise. `ones([T, T]).triu(1)` marks the keys a causal attention leaves out.
    ///
    /// ```
    /// use mantissa::{Tensor, DType, Device};
    /// let x = Tensor::ones(&[2, 3], DType::I64, Device::Cpu)?;
    /// assert_eq!(x.triu(1)?.to_vec::<i64>()?, vec![0, 1, 1, 0, 0, 1]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn triu(&self, diagonal: i64) -> Result<Tensor> {
        self.triangle("triu", diagonal, true)
    }

    /// `0, 1, .., n - 1` as I64, made on `device` by a fill and a running sum: nothing is
    /// uploaded from the host, so an op that builds its masks from it (the triangles, the
    /// causal attention mask) can be captured in a CUDA graph.
    pub(crate) fn ramp(n: usize, device: crate::Device) -> Result<Tensor> {
        Tensor::ones(&[n], DType::I64, device)?.cumsum(0)?.sub(1)
    }

    /// Zeroes the elements of the last two dims outside the triangle: below `diagonal`
    /// (`upper`) or above it.
    fn triangle(&self, op: &'static str, diagonal: i64, upper: bool) -> Result<Tensor> {
        let r = self.rank();
        if r < 2 {
            return Err(Error::invalid(
                op,
                format!(
                    "needs a tensor of rank 2 or more (the last two dims are the matrix), got \
                     shape {:?}",
                    self.shape()
                ),
            ));
        }
        let _prof = crate::profiler::op(op);
        let (rows, cols) = (self.shape()[r - 2], self.shape()[r - 1]);
        // Past -rows and cols every diagonal gives the same mask; clamped, the bounds stay
        // small whole numbers.
        let d = diagonal.clamp(-(rows as i64), cols as i64);
        // Column j of row i is kept where j <= i + d (lower) or j >= i + d (upper).
        let dev = self.device();
        let edge = Tensor::ramp(rows, dev)?.add(d)?.reshape(&[rows, 1])?;
        let j = Tensor::ramp(cols, dev)?.reshape(&[1, cols])?;
        let keep = match upper {
            true => j.ge(&edge)?,
            false => j.le(&edge)?,
        };
        let zero = Tensor::zeros(&[], self.dtype(), dev)?;
        Tensor::where_cond(&keep, self, &zero)
    }
}
