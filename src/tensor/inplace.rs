//! In-place arithmetic as PyTorch spells it (`add_`, `mul_`, `fill_`, `zero_`): each writes
//! the tensor's own elements, bumps its storage's version (so a backward that saved the
//! tensor refuses to run on the new values), and records no graph. As with
//! [`Tensor::copy_`], a tensor that requires grad is written only under
//! [`crate::no_grad`].

use crate::{Error, Operand, Result, Tensor};

impl Tensor {
    /// `self += other` in place; `other` (a tensor or a scalar) broadcasts to this shape and
    /// the result keeps this dtype (a float result into an integer tensor is an error, as in
    /// PyTorch).
    ///
    /// ```
    /// use mantissa::{Tensor, Device};
    /// let x = Tensor::from_vec(vec![1.0f32, 2.0], &[2], Device::Cpu)?;
    /// let v = x.version();
    /// x.add_(0.5)?;
    /// assert_eq!(x.to_vec::<f32>()?, vec![1.5, 2.5]);
    /// assert!(x.version() > v);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn add_<'a>(&self, other: impl Into<Operand<'a>>) -> Result<()> {
        let other = other.into();
        self.update_("add_", &other, |x| x.add(other))
    }

    /// `self *= other` in place (see [`Tensor::add_`]).
    pub fn mul_<'a>(&self, other: impl Into<Operand<'a>>) -> Result<()> {
        let other = other.into();
        self.update_("mul_", &other, |x| x.mul(other))
    }

    /// Sets every element to `value` in place.
    pub fn fill_(&self, value: f64) -> Result<()> {
        let full = Tensor::full(self.shape(), value, self.dtype(), self.device())?;
        self.write_checked("fill_")?;
        self.copy_(&full)
    }

    /// Sets every element to zero in place.
    pub fn zero_(&self) -> Result<()> {
        self.fill_(0.0)
    }

    /// Refuses an in-place write into a tensor the graph would not see change.
    fn write_checked(&self, op: &'static str) -> Result<()> {
        if crate::is_grad_enabled() && self.is_requires_grad() {
            return Err(Error::invalid(
                op,
                format!(
                    "cannot write in place into a tensor of shape {:?} that requires grad \
                     while grad mode is on (the graph would not see the write); wrap it in \
                     no_grad, or use the out-of-place op",
                    self.shape()
                ),
            ));
        }
        Ok(())
    }

    /// Writes `f(self)` into this tensor, checked as [`Tensor::add_`] documents.
    fn update_(
        &self,
        op: &'static str,
        other: &Operand<'_>,
        f: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<()> {
        self.write_checked(op)?;
        if let Operand::Tensor(t) = other {
            if crate::is_grad_enabled() && t.is_requires_grad() {
                return Err(Error::invalid(
                    op,
                    format!(
                        "the operand of shape {:?} requires grad, and an in-place op records \
                         no graph: use the out-of-place op",
                        t.shape()
                    ),
                ));
            }
        }
        let y = crate::no_grad(|| f(self))?;
        if y.shape() != self.shape() {
            return Err(Error::Broadcast {
                op,
                lhs: self.shape().to_vec(),
                rhs: match other {
                    Operand::Tensor(t) => t.shape().to_vec(),
                    _ => vec![],
                },
            });
        }
        if y.dtype().is_float() && !self.dtype().is_float() {
            return Err(Error::invalid(
                op,
                format!(
                    "the result is {:?}, which cannot be written into a {:?} tensor",
                    y.dtype(),
                    self.dtype()
                ),
            ));
        }
        self.copy_(&y)
    }
}
