//! Matrix products: `matmul` with PyTorch's 1-D and batch-broadcast rules, and `linear`.

use super::{dispatch, expect_float, expect_same_dtype, Op};
use crate::layout::broadcast_shapes;
use crate::{Error, Result, Tensor};

impl Tensor {
    /// Product of `[..., m, k]` and `[..., k, n]` with equal batch dims.
    fn bmm(&self, rhs: &Tensor) -> Result<Tensor> {
        let r = self.rank();
        let mut shape = self.shape()[..r - 1].to_vec();
        shape.push(rhs.shape()[r - 1]);
        let s = self
            .storage()
            .matmul(self.layout(), &rhs.storage(), rhs.layout())?;
        let (a, b) = (self.clone(), rhs.clone());
        Ok(
            Tensor::from_storage(s, &shape).attach("matmul", &[self, rhs], move |g, needs| {
                let ga = if needs[0] {
                    Some(g.bmm(&b.t()?)?)
                } else {
                    None
                };
                let gb = if needs[1] { Some(a.t()?.bmm(g)?) } else { None };
                Ok(vec![ga, gb])
            }),
        )
    }

    /// Matrix product with PyTorch's rules: 1-D operands are promoted to matrices and the
    /// added dim removed afterwards; batch dims broadcast.
    ///
    /// ```
    /// use mantissa::{Tensor, DType, Device};
    /// let a = Tensor::ones(&[5, 2, 3], DType::F32, Device::Cpu)?;
    /// let b = Tensor::ones(&[3, 4], DType::F32, Device::Cpu)?;
    /// assert_eq!(a.matmul(&b)?.shape(), &[5, 2, 4]);
    /// assert!(b.matmul(&a).is_err());
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        let [a, b] = dispatch(Op::Matmul, [self, rhs])?;
        expect_float(Op::Matmul, &a)?;
        expect_same_dtype(Op::Matmul, &a, &b)?;
        if a.rank() == 0 || b.rank() == 0 {
            return Err(Error::invalid(
                "matmul",
                format!(
                    "both operands need rank >= 1, got {:?} and {:?}",
                    a.shape(),
                    b.shape()
                ),
            ));
        }
        let (a1, b1) = (a.rank() == 1, b.rank() == 1);
        let a2 = if a1 { a.unsqueeze(0)? } else { a.clone() };
        let b2 = if b1 { b.unsqueeze(1)? } else { b.clone() };
        let (ra, rb) = (a2.rank(), b2.rank());
        let (m, k) = (a2.shape()[ra - 2], a2.shape()[ra - 1]);
        let (k2, n) = (b2.shape()[rb - 2], b2.shape()[rb - 1]);
        if k != k2 {
            return Err(Error::ShapeMismatch {
                op: "matmul",
                lhs: a.shape().to_vec(),
                rhs: b.shape().to_vec(),
            });
        }
        let batch = broadcast_shapes("matmul", &a2.shape()[..ra - 2], &b2.shape()[..rb - 2])?;
        let full = |x: &Tensor, r: usize, c: usize| -> Result<Tensor> {
            let mut s = batch.clone();
            s.extend([r, c]);
            x.expand(&s)
        };
        let out = full(&a2, m, k)?.bmm(&full(&b2, k, n)?)?;
        let mut shape = batch.clone();
        if !a1 {
            shape.push(m);
        }
        if !b1 {
            shape.push(n);
        }
        out.reshape(&shape)
    }

    /// `x @ weight^T + bias` with `weight: [out, in]`, `bias: [out]` (PyTorch's `F.linear`).
    pub fn linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let [x, w] = dispatch(Op::Linear, [self, weight])?;
        if w.rank() != 2 || x.rank() == 0 || x.shape()[x.rank() - 1] != w.shape()[1] {
            return Err(Error::ShapeMismatch {
                op: "linear",
                lhs: x.shape().to_vec(),
                rhs: w.shape().to_vec(),
            });
        }
        let y = x.matmul(&w.t()?)?;
        match bias {
            Some(b) if b.shape() != [w.shape()[0]] => Err(Error::ShapeMismatch {
                op: "linear (bias)",
                lhs: w.shape().to_vec(),
                rhs: b.shape().to_vec(),
            }),
            Some(b) => y.add(b),
            None => Ok(y),
        }
    }
}
