//! Reductions and scans built from other ops, so they run wherever those do (CPU and CUDA)
//! with their backward for free: `cumsum` (a log-step scan), `prod` (a pairwise tree, exact
//! through zeros), `logsumexp`, `all`, `any`. Half inputs are computed in f32 and rounded
//! once at the end.

use crate::layout::{normalize_dim, normalize_dims};
use crate::{DType, Error, Result, Tensor};

impl Tensor {
    /// Dim `dim` (not empty) combined to size 1 by a tree of pairwise `op`s (half against
    /// half, an odd last element carried up): `ceil(log2(n))` passes, each one op.
    pub(crate) fn pairwise(
        &self,
        dim: usize,
        op: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let (di, mut n, mut y) = (dim as isize, self.shape()[dim], self.clone());
        while n > 1 {
            let h = n / 2;
            let mut z = op(&y.narrow(di, 0, h)?, &y.narrow(di, h, h)?)?;
            if n % 2 == 1 {
                z = Tensor::cat(&[&z, &y.narrow(di, 2 * h, 1)?], di)?;
            }
            y = z;
            n = h + n % 2;
        }
        Ok(y)
    }

    /// This tensor, in I64 when it is U8: the result type of PyTorch's integer and bool
    /// sums, products and scans.
    fn widened(&self) -> Result<Tensor> {
        match self.dtype() {
            DType::U8 => self.to_dtype(DType::I64),
            _ => Ok(self.clone()),
        }
    }

    /// Runs `f` on this tensor in f32 when it is f16/bf16, and casts the result back.
    fn in_f32(&self, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
        match self.dtype().is_half() {
            true => f(&self.to_dtype(DType::F32)?)?.to_dtype(self.dtype()),
            false => f(self),
        }
    }

    /// Running sums along `dim` (PyTorch's `cumsum`): element `i` is the sum of elements
    /// `0..=i`. Computed in `ceil(log2(n))` passes of shifted adds.
    ///
    /// ```
    /// use mantissa::{Tensor, Device};
    /// let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2], Device::Cpu)?;
    /// assert_eq!(x.cumsum(1)?.to_vec::<f32>()?, vec![1.0, 3.0, 3.0, 7.0]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    ///
    /// A U8 (bool) tensor's running sums are I64, as PyTorch's; integer sums wrap modulo
    /// 2^64.
    pub fn cumsum(&self, dim: isize) -> Result<Tensor> {
        let d = normalize_dim("cumsum", dim, self.shape())? as isize;
        let n = self.shape()[d as usize];
        self.widened()?.in_f32(|x| {
            let mut y = x.clone();
            let mut k = 1;
            while k < n {
                let shifted = y.narrow(d, k, n - k)?.add(&y.narrow(d, 0, n - k)?)?;
                y = Tensor::cat(&[&y.narrow(d, 0, k)?, &shifted], d)?;
                k *= 2;
            }
            Ok(y)
        })
    }

    /// The product along `dim` (PyTorch's `prod(dim)`), as a tree of pairwise products: its
    /// gradient is exact where elements are zero. An empty dim gives ones.
    ///
    /// ```
    /// use mantissa::{Tensor, Device};
    /// let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 0.5, 0.0, 4.0], &[2, 3], Device::Cpu)?;
    /// assert_eq!(x.prod(1, false)?.to_vec::<f32>()?, vec![6.0, 0.0]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    ///
    /// A U8 (bool) tensor's product is I64, as PyTorch's; integer products wrap modulo 2^64.
    pub fn prod(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        let d = normalize_dim("prod", dim, self.shape())?;
        let di = d as isize;
        let y = self.widened()?.in_f32(|x| {
            if x.shape()[d] == 0 {
                let mut shape = x.shape().to_vec();
                shape[d] = 1;
                return Tensor::ones(&shape, x.dtype(), x.device());
            }
            x.pairwise(d, |a, b| a.mul(b))
        })?;
        match keepdim {
            true => Ok(y),
            false => y.squeeze(di),
        }
    }

    /// The product of every element (a 0-d tensor).
    pub fn prod_all(&self) -> Result<Tensor> {
        self.reshape(&[self.numel()])?.prod(0, false)
    }

    /// `log(sum(exp(x)))` over `dims` (all when empty), computed stably around the maximum
    /// (PyTorch's `logsumexp`); its gradient is the softmax over those dims.
    ///
    /// ```
    /// use mantissa::{Tensor, Device};
    /// let x = Tensor::from_vec(vec![1000.0f32, 1000.0], &[2], Device::Cpu)?;
    /// let y = x.logsumexp(&[0], false)?.item()?;
    /// assert!((y - (1000.0 + 2f64.ln())).abs() < 1e-3);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn logsumexp(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let mut d = normalize_dims("logsumexp", dims, self.shape())?;
        if d.is_empty() {
            d = (0..self.rank()).collect();
        }
        if !self.dtype().is_float() {
            return Err(Error::DType {
                op: "logsumexp",
                dtype: self.dtype(),
                expected: "a float dtype",
            });
        }
        let y = self.in_f32(|x| {
            // The shift: each slice's maximum, 0 where it is infinite (all -inf, or +inf).
            let m = crate::no_grad(|| {
                let mut m = x.clone();
                for &i in &d {
                    m = match m.shape()[i] {
                        0 => {
                            let mut shape = m.shape().to_vec();
                            shape[i] = 1;
                            Tensor::zeros(&shape, m.dtype(), m.device())?
                        }
                        _ => m.max(i as isize, true)?.0,
                    };
                }
                let finite = m.abs()?.lt(f64::INFINITY)?;
                Tensor::where_cond(&finite, &m, &m.zeros_like()?)
            })?;
            let dd: Vec<isize> = d.iter().map(|&i| i as isize).collect();
            x.sub(&m)?.exp()?.sum(&dd, true)?.log()?.add(&m)
        })?;
        match keepdim {
            true => Ok(y),
            false => {
                let shape: Vec<usize> = (0..self.rank())
                    .filter(|i| !d.contains(i))
                    .map(|i| self.shape()[i])
                    .collect();
                y.reshape(&shape)
            }
        }
    }

    /// Whether every element over `dims` (all when empty) is nonzero, as a U8 mask
    /// (PyTorch's `all`, with U8 for bool); NaN counts as nonzero, an empty slice as true.
    ///
    /// ```
    /// use mantissa::{Tensor, Device};
    /// let x = Tensor::from_vec(vec![1.0f32, 0.0, 2.0, 3.0], &[2, 2], Device::Cpu)?;
    /// assert_eq!(x.all(&[1], false)?.to_vec::<u8>()?, vec![0, 1]);
    /// assert_eq!(x.any(&[], false)?.to_vec::<u8>()?, vec![1]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn all(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        // The count of zeros: a sum of nonnegative terms is 0 only when every term is.
        let zeros = self.eq(0)?.to_dtype(DType::F32)?;
        zeros.sum(dims, keepdim)?.eq(0)
    }

    /// Whether any element over `dims` (all when empty) is nonzero, as a U8 mask (PyTorch's
    /// `any`); an empty slice is false. See [`Tensor::all`].
    pub fn any(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let nonzero = self.ne(0)?.to_dtype(DType::F32)?;
        nonzero.sum(dims, keepdim)?.gt(0)
    }
}
