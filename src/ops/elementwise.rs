//! Elementwise ops with broadcasting, scalars, activations, comparisons and `where`.

use super::{dispatch, expect_float, Op};
use crate::autograd::saved::{held, kept, kept_for};
use crate::backend::ops::{BinaryOp, CmpOp, UnaryOp};
use crate::layout::broadcast_shapes;
use crate::memory_format::elementwise;
use crate::{DType, Error, Result, Tensor};

/// The right-hand side of a binary op: a tensor, a float scalar or an integer scalar. As in
/// PyTorch, a scalar takes the tensor's dtype, except that a float scalar with an integer
/// tensor gives f32; an integer scalar keeps an integer tensor integer.
///
/// ```
/// use mantissa::{Tensor, DType, Device};
/// let x = Tensor::from_vec(vec![1.0f32, 2.0], &[2], Device::Cpu)?;
/// assert_eq!(x.add(1.0)?.to_vec::<f32>()?, vec![2.0, 3.0]);
/// assert_eq!(x.add(&x)?.to_vec::<f32>()?, vec![2.0, 4.0]);
/// let i = Tensor::from_vec(vec![3i64, 4], &[2], Device::Cpu)?;
/// assert_eq!(i.add(1)?.to_vec::<i64>()?, vec![4, 5]);
/// assert_eq!(i.mul(0.5)?.dtype(), DType::F32);
/// # Ok::<(), mantissa::Error>(())
/// ```
#[derive(Clone, Copy)]
pub enum Operand<'a> {
    Tensor(&'a Tensor),
    Scalar(f64),
    Int(i64),
}

impl<'a> From<&'a Tensor> for Operand<'a> {
    fn from(t: &'a Tensor) -> Self {
        Operand::Tensor(t)
    }
}
impl From<f64> for Operand<'_> {
    fn from(v: f64) -> Self {
        Operand::Scalar(v)
    }
}
impl From<f32> for Operand<'_> {
    fn from(v: f32) -> Self {
        Operand::Scalar(v as f64)
    }
}
impl From<i64> for Operand<'_> {
    fn from(v: i64) -> Self {
        Operand::Int(v)
    }
}
impl From<i32> for Operand<'_> {
    fn from(v: i32) -> Self {
        Operand::Int(v as i64)
    }
}

impl Operand<'_> {
    /// The operand for an op on `x`: a 0-d tensor of `x`'s dtype for an integer scalar with
    /// an integer tensor (integer arithmetic), a float scalar otherwise; and `x` itself, or
    /// `x` in f32 when a float scalar meets an integer tensor (PyTorch's result type).
    fn resolve(self, x: &Tensor) -> Result<(Tensor, Resolved)> {
        let int = !x.dtype().is_float();
        Ok(match self {
            Operand::Tensor(t) => (x.clone(), Resolved::Tensor(t.clone())),
            Operand::Int(v) if int => {
                let s = Tensor::scalar(v as f64, x.dtype(), x.device())?;
                (x.clone(), Resolved::Tensor(s))
            }
            Operand::Int(v) => (x.clone(), Resolved::Scalar(v as f64)),
            Operand::Scalar(v) if int => (x.to_dtype(DType::F32)?, Resolved::Scalar(v)),
            Operand::Scalar(v) => (x.clone(), Resolved::Scalar(v)),
        })
    }
}

/// An [`Operand`] made ready for a tensor: a tensor or a float scalar.
enum Resolved {
    Tensor(Tensor),
    Scalar(f64),
}

/// The user op a unary kernel runs as when called on its own (`Tensor::exp`, `Tensor::relu`):
/// the ops with their own autocast category are named, the rest are [`Op::Unary`] (the node
/// takes the function's own name).
fn unary_kind(op: UnaryOp) -> Op {
    match op {
        UnaryOp::Exp => Op::Exp,
        UnaryOp::Log => Op::Log,
        UnaryOp::Log1p => Op::Log1p,
        UnaryOp::Sqrt => Op::Sqrt,
        UnaryOp::Rsqrt => Op::Rsqrt,
        UnaryOp::Recip => Op::Recip,
        UnaryOp::PowScalar(_) => Op::PowScalar,
        UnaryOp::ScalarPow(_) => Op::Pow,
        UnaryOp::Softplus => Op::Softplus,
        _ => Op::Unary,
    }
}

impl Tensor {
    /// Applies a unary op and records its backward (`g * f'(x)`, one fused kernel).
    /// `op` on its own: as the user op [`unary_kind`] names (its autocast category and node
    /// name).
    pub(crate) fn unary(&self, op: UnaryOp) -> Result<Tensor> {
        self.unary_op(op, unary_kind(op))
    }

    /// `op` as part of the user op `kind` (a scalar operand of `add`, `pow`, ...).
    pub(crate) fn unary_op(&self, op: UnaryOp, kind: Op) -> Result<Tensor> {
        // `Op::Unary` covers many functions: the function names the node (`relu`).
        let name = match kind {
            Op::Unary => op.name(),
            _ => kind.name(),
        };
        let _prof = crate::profiler::op(name);
        let [x] = dispatch(kind, [self])?;
        expect_float(kind, &x)?;
        let (s, l) = elementwise(name, [x.layout()], |[l]| x.storage().unary(l, op))?;
        let y = Tensor::from_storage_in(s, l);
        // ReLU's derivative reads as well from its output: y <= 0 exactly where x <= 0, and a
        // NaN stays NaN and passes the gradient either way. The output is what the next op
        // (a convolution, a product) usually keeps too, so saving it instead of the input
        // lets the input go (a batch norm's output in a ResNet: a third of its activations).
        // A constant derivative (negation, `mul * x + add`) reads nothing: an in-place write
        // to the input afterwards is no error, as in PyTorch.
        let saved = match op {
            UnaryOp::Relu => Some(y.detach()),
            UnaryOp::Neg | UnaryOp::Affine { .. } => None,
            _ => Some(x.clone()),
        };
        let reads = held(&[&saved]);
        let reads: Vec<&Tensor> = reads.iter().collect();
        Ok(y.attach_saving(name, &[&x], &reads, move |g, _| {
            let Some(saved) = &saved else {
                let mul = match op {
                    UnaryOp::Affine { mul, .. } => mul,
                    _ => -1.0,
                };
                return Ok(vec![Some(g.unary(UnaryOp::Affine { mul, add: 0.0 })?)]);
            };
            let (s, l) = elementwise(name, [saved.layout(), g.layout()], |[ls, lg]| {
                saved.storage().unary_grad(ls, &g.storage(), lg, op)
            })?;
            Ok(vec![Some(Tensor::from_storage_in(s, l))])
        }))
    }

    fn binary_op(&self, rhs: &Tensor, op: BinaryOp, kind: Op) -> Result<Tensor> {
        let _prof = crate::profiler::op(kind.name());
        let [a, b] = dispatch(kind, [self, rhs])?;
        super::expect_same_dtype(kind, &a, &b)?;
        let name = kind.name();
        let shape = broadcast_shapes(name, a.shape(), b.shape())?;
        let la = a.layout().broadcast_as(name, &shape)?;
        let lb = b.layout().broadcast_as(name, &shape)?;
        let (s, l) = elementwise(name, [&la, &lb], |[la, lb]| {
            a.storage().binary(la, &b.storage(), lb, op)
        })?;
        let out = Tensor::from_storage_in(s, l);
        if !a.dtype().is_float() {
            return Ok(out);
        }
        let shapes = (a.shape().to_vec(), b.shape().to_vec());
        // What the backward reads, as PyTorch keeps it: sums and differences read no input
        // values; a product reads each operand only for the other's gradient; a quotient
        // reads the divisor always and the dividend for the divisor's gradient; powers,
        // maximum and minimum read both.
        let (ra, rb) = (a.is_requires_grad(), b.is_requires_grad());
        let (keep_a, keep_b) = match op {
            BinaryOp::Add | BinaryOp::Sub => (false, false),
            BinaryOp::Mul => (rb, ra),
            BinaryOp::Div => (rb, true),
            BinaryOp::Pow | BinaryOp::Max | BinaryOp::Min => (true, true),
        };
        let saved = (kept_for(keep_a, &a), kept_for(keep_b, &b));
        let reads = held(&[&saved.0, &saved.1]);
        let reads: Vec<&Tensor> = reads.iter().collect();
        Ok(out.attach_saving(name, &[&a, &b], &reads, move |g, needs| {
            let (ga, gb) = binary_grads(op, (&saved.0, &saved.1), g, needs)?;
            let ga = ga.map(|t| t.sum_to(&shapes.0)).transpose()?;
            let gb = gb.map(|t| t.sum_to(&shapes.1)).transpose()?;
            Ok(vec![ga, gb])
        }))
    }

    fn binary_or_scalar(
        &self,
        rhs: Operand,
        op: BinaryOp,
        kind: Op,
        scalar: impl Fn(f64) -> UnaryOp,
    ) -> Result<Tensor> {
        let (x, rhs) = rhs.resolve(self)?;
        match rhs {
            Resolved::Tensor(t) => x.binary_op(&t, op, kind),
            Resolved::Scalar(v) => x.unary_op(scalar(v), kind),
        }
    }

    /// `self + rhs` with broadcasting.
    pub fn add<'a>(&self, rhs: impl Into<Operand<'a>>) -> Result<Tensor> {
        self.binary_or_scalar(rhs.into(), BinaryOp::Add, Op::Add, |v| UnaryOp::Affine {
            mul: 1.0,
            add: v,
        })
    }
    /// `self - rhs` with broadcasting.
    pub fn sub<'a>(&self, rhs: impl Into<Operand<'a>>) -> Result<Tensor> {
        self.binary_or_scalar(rhs.into(), BinaryOp::Sub, Op::Sub, |v| UnaryOp::Affine {
            mul: 1.0,
            add: -v,
        })
    }
    /// `self * rhs` with broadcasting.
    pub fn mul<'a>(&self, rhs: impl Into<Operand<'a>>) -> Result<Tensor> {
        self.binary_or_scalar(rhs.into(), BinaryOp::Mul, Op::Mul, |v| UnaryOp::Affine {
            mul: v,
            add: 0.0,
        })
    }
    /// `self / rhs` with broadcasting. True division, as in PyTorch: integer tensors divided
    /// by integer tensors or by scalars give f32.
    ///
    /// ```
    /// use mantissa::{Tensor, DType, Device};
    /// let a = Tensor::from_vec(vec![1i64, -3], &[2], Device::Cpu)?;
    /// let q = a.div(2.0)?;
    /// assert_eq!((q.dtype(), q.to_vec::<f32>()?), (DType::F32, vec![0.5, -1.5]));
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn div<'a>(&self, rhs: impl Into<Operand<'a>>) -> Result<Tensor> {
        let rhs = rhs.into();
        let integer = match rhs {
            Operand::Tensor(t) => !t.dtype().is_float(),
            Operand::Scalar(_) | Operand::Int(_) => true,
        };
        if !self.dtype().is_float() && integer {
            return self.to_dtype(DType::F32)?.div(rhs);
        }
        self.binary_or_scalar(rhs, BinaryOp::Div, Op::Div, |v| UnaryOp::Affine {
            mul: 1.0 / v,
            add: 0.0,
        })
    }
    /// `self ^ rhs` with broadcasting.
    pub fn pow<'a>(&self, rhs: impl Into<Operand<'a>>) -> Result<Tensor> {
        let rhs = rhs.into();
        if let (Operand::Int(v), false) = (&rhs, self.dtype().is_float()) {
            if *v < 0 {
                // PyTorch: "Integers to negative integer powers are not allowed."
                return Err(Error::invalid(
                    "pow",
                    format!(
                        "integers to negative integer powers are not allowed ({:?} tensor ** {v})",
                        self.dtype()
                    ),
                ));
            }
        }
        let (x, rhs) = rhs.resolve(self)?;
        match rhs {
            Resolved::Tensor(t) => x.binary_op(&t, BinaryOp::Pow, Op::Pow),
            Resolved::Scalar(v) => x.unary(UnaryOp::PowScalar(v)),
        }
    }
    /// Elementwise maximum (ties split the gradient evenly; NaN in either operand gives NaN,
    /// as in PyTorch).
    pub fn maximum<'a>(&self, rhs: impl Into<Operand<'a>>) -> Result<Tensor> {
        self.binary_or_scalar(rhs.into(), BinaryOp::Max, Op::Maximum, UnaryOp::MaxScalar)
    }
    /// Elementwise minimum (ties split the gradient evenly; NaN in either operand gives NaN).
    pub fn minimum<'a>(&self, rhs: impl Into<Operand<'a>>) -> Result<Tensor> {
        self.binary_or_scalar(rhs.into(), BinaryOp::Min, Op::Minimum, UnaryOp::MinScalar)
    }
    /// `scalar - self` (an integer or bool tensor gives f32, as `self.sub(scalar)` does).
    pub fn rsub(&self, scalar: f64) -> Result<Tensor> {
        if !self.dtype().is_float() {
            return self.to_dtype(DType::F32)?.rsub(scalar);
        }
        self.unary_op(
            UnaryOp::Affine {
                mul: -1.0,
                add: scalar,
            },
            Op::Sub,
        )
    }
    /// `scalar ^ self`.
    pub fn scalar_pow(&self, scalar: f64) -> Result<Tensor> {
        self.unary(UnaryOp::ScalarPow(scalar))
    }
    /// Clamps into `[lo, hi]`: `min(max(self, lo), hi)` (NaN stays NaN). As in PyTorch, when
    /// `lo > hi` every element becomes `hi` (and gets no gradient).
    ///
    /// ```
    /// use mantissa::{Tensor, Device};
    /// let x = Tensor::from_vec(vec![-2.0f32, 0.5, 3.0], &[3], Device::Cpu)?;
    /// assert_eq!(x.clamp(-1.0, 1.0)?.to_vec::<f32>()?, vec![-1.0, 0.5, 1.0]);
    /// assert_eq!(x.clamp(1.0, -1.0)?.to_vec::<f32>()?, vec![-1.0, -1.0, -1.0]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn clamp(&self, lo: f64, hi: f64) -> Result<Tensor> {
        self.maximum(lo)?.minimum(hi)
    }

    /// `-self`. An integer tensor stays integer, wrapping as PyTorch's does (`-u8 200` is 56).
    pub fn neg(&self) -> Result<Tensor> {
        match self.dtype() {
            // 0 - x, which integer arithmetic wraps.
            d if !d.is_float() => Tensor::zeros(self.shape(), d, self.device())?.sub(self),
            _ => self.unary(UnaryOp::Neg),
        }
    }
    pub fn abs(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Abs)
    }
    pub fn exp(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Exp)
    }
    pub fn log(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Log)
    }
    pub fn log1p(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Log1p)
    }
    pub fn sqrt(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Sqrt)
    }
    pub fn rsqrt(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Rsqrt)
    }
    pub fn recip(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Recip)
    }
    pub fn sqr(&self) -> Result<Tensor> {
        // Not `pow`: autocast leaves `square` in its input dtype (PyTorch runs `pow` in f32).
        self.unary_op(UnaryOp::PowScalar(2.0), Op::Unary)
    }
    pub fn sin(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Sin)
    }
    pub fn cos(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Cos)
    }
    pub fn tanh(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Tanh)
    }
    pub fn sigmoid(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Sigmoid)
    }
    /// `max(x, 0)`. NaN stays NaN, as in PyTorch, so a diverging forward pass shows in the
    /// loss.
    pub fn relu(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Relu)
    }
    /// `x` for positive x, `slope * x` otherwise.
    pub fn leaky_relu(&self, slope: f64) -> Result<Tensor> {
        self.unary(UnaryOp::LeakyRelu(slope))
    }
    /// GELU, exact (erf) form, PyTorch's default.
    pub fn gelu(&self) -> Result<Tensor> {
        self.unary(UnaryOp::GeluErf)
    }
    /// GELU, tanh approximation (`approximate="tanh"`).
    pub fn gelu_tanh(&self) -> Result<Tensor> {
        self.unary(UnaryOp::GeluTanh)
    }
    pub fn silu(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Silu)
    }
    /// `ln(1 + e^x)` elementwise, and `x` itself where `x > 20` (PyTorch's
    /// `torch.nn.functional.softplus` with `beta = 1`, `threshold = 20`). Autocast runs it in
    /// f32, as PyTorch does.
    ///
    /// ```
    /// # use mantissa::{Device, Tensor};
    /// let x = Tensor::from_vec(vec![0.0f32, 30.0], &[2], Device::Cpu)?;
    /// let y = x.softplus()?.to_vec::<f32>()?;
    /// assert!((y[0] - 2f32.ln()).abs() < 1e-6 && y[1] == 30.0);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn softplus(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Softplus)
    }

    fn compare<'a>(&self, rhs: impl Into<Operand<'a>>, op: CmpOp) -> Result<Tensor> {
        let scalar;
        let rhs = match rhs.into() {
            Operand::Tensor(t) => t,
            // An integer tensor against a fractional scalar compares as f32 (PyTorch compares
            // in the promoted type: 2 == 2.5 is false).
            Operand::Scalar(v) if !self.dtype().is_float() && v.fract() != 0.0 => {
                return self.to_dtype(DType::F32)?.compare(v, op);
            }
            Operand::Scalar(v) => {
                scalar = Tensor::scalar(v, self.dtype(), self.device())?;
                &scalar
            }
            Operand::Int(v) => {
                scalar = Tensor::scalar(v as f64, self.dtype(), self.device())?;
                &scalar
            }
        };
        let _prof = crate::profiler::op(Op::Compare.name());
        let [a, b] = dispatch(Op::Compare, [self, rhs])?;
        let [a, b] = if a.dtype() == b.dtype() {
            [a, b]
        } else {
            let d = a.dtype().promote(b.dtype());
            [a.to_dtype(d)?, b.to_dtype(d)?]
        };
        let shape = broadcast_shapes("compare", a.shape(), b.shape())?;
        let la = a.layout().broadcast_as("compare", &shape)?;
        let lb = b.layout().broadcast_as("compare", &shape)?;
        let (s, l) = elementwise("compare", [&la, &lb], |[la, lb]| {
            a.storage().cmp(la, &b.storage(), lb, op)
        })?;
        Ok(Tensor::from_storage_in(s, l))
    }

    /// `self == rhs` as a U8 mask.
    pub fn eq<'a>(&self, rhs: impl Into<Operand<'a>>) -> Result<Tensor> {
        self.compare(rhs, CmpOp::Eq)
    }
    pub fn ne<'a>(&self, rhs: impl Into<Operand<'a>>) -> Result<Tensor> {
        self.compare(rhs, CmpOp::Ne)
    }
    pub fn lt<'a>(&self, rhs: impl Into<Operand<'a>>) -> Result<Tensor> {
        self.compare(rhs, CmpOp::Lt)
    }
    pub fn le<'a>(&self, rhs: impl Into<Operand<'a>>) -> Result<Tensor> {
        self.compare(rhs, CmpOp::Le)
    }
    pub fn gt<'a>(&self, rhs: impl Into<Operand<'a>>) -> Result<Tensor> {
        self.compare(rhs, CmpOp::Gt)
    }
    pub fn ge<'a>(&self, rhs: impl Into<Operand<'a>>) -> Result<Tensor> {
        self.compare(rhs, CmpOp::Ge)
    }

    /// `cond ? a : b` elementwise with broadcasting; `cond` is a U8 mask (nonzero = true).
    ///
    /// ```
    /// use mantissa::{Tensor, Device};
    /// let x = Tensor::from_vec(vec![-1.0f32, 2.0], &[2], Device::Cpu)?;
    /// let y = Tensor::where_cond(&x.gt(0.0)?, &x, &x.neg()?)?;
    /// assert_eq!(y.to_vec::<f32>()?, vec![1.0, 2.0]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn where_cond(cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        if cond.dtype() != DType::U8 {
            return Err(Error::DType {
                op: "where",
                dtype: cond.dtype(),
                expected: "U8 (a mask from a comparison)",
            });
        }
        let _prof = crate::profiler::op(Op::Where.name());
        let [c, a, b] = dispatch(Op::Where, [cond, a, b])?;
        super::expect_same_dtype(Op::Where, &a, &b)?;
        let s1 = broadcast_shapes("where", c.shape(), a.shape())?;
        let shape = broadcast_shapes("where", &s1, b.shape())?;
        let lc = c.layout().broadcast_as("where", &shape)?;
        let la = a.layout().broadcast_as("where", &shape)?;
        let lb = b.layout().broadcast_as("where", &shape)?;
        // The values decide the output's order before the mask does.
        let (s, l) = elementwise("where", [&la, &lb, &lc], |[la, lb, lc]| {
            c.storage()
                .where_cond(lc, &a.storage(), la, &b.storage(), lb)
        })?;
        let out = Tensor::from_storage_in(s, l);
        if !a.dtype().is_float() {
            return Ok(out);
        }
        let (sa, sb, sc) = (a.shape().to_vec(), b.shape().to_vec(), c.clone());
        Ok(
            out.attach_saving("where", &[&a, &b], &[&c], move |g, needs| {
                let zero = Tensor::zeros(&[], g.dtype(), g.device())?;
                let ga = match needs[0] {
                    true => Some(Tensor::where_cond(&sc, g, &zero)?.sum_to(&sa)?),
                    false => None,
                };
                let gb = match needs[1] {
                    true => Some(Tensor::where_cond(&sc, &zero, g)?.sum_to(&sb)?),
                    false => None,
                };
                Ok(vec![ga, gb])
            }),
        )
    }

    /// Replaces the elements where `mask` is nonzero with `value`.
    pub fn masked_fill(&self, mask: &Tensor, value: f64) -> Result<Tensor> {
        let v = Tensor::scalar(value, self.dtype(), self.device())?;
        let out = Tensor::where_cond(mask, &v, self)?;
        if out.shape() != self.shape() {
            return Err(Error::Broadcast {
                op: "masked_fill",
                lhs: self.shape().to_vec(),
                rhs: mask.shape().to_vec(),
            });
        }
        Ok(out)
    }
}

/// Gradients of `a op b` before reduction to the input shapes.
/// `saved` holds the inputs for the ops whose gradients need them (all but add and sub).
fn binary_grads(
    op: BinaryOp,
    saved: (&Option<Tensor>, &Option<Tensor>),
    g: &Tensor,
    needs: &[bool],
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let want = |i: usize, f: &dyn Fn() -> Result<Tensor>| -> Result<Option<Tensor>> {
        if needs[i] {
            f().map(Some)
        } else {
            Ok(None)
        }
    };
    match op {
        BinaryOp::Add => return Ok((want(0, &|| Ok(g.clone()))?, want(1, &|| Ok(g.clone()))?)),
        BinaryOp::Sub => return Ok((want(0, &|| Ok(g.clone()))?, want(1, &|| g.neg())?)),
        _ => {}
    }
    // Each operand as the forward kept it (`kept_for`), read only by the gradients that
    // need it.
    let name = op.name();
    let a = || kept(name, saved.0);
    let b = || kept(name, saved.1);
    let dt = g.dtype();
    Ok(match op {
        BinaryOp::Add | BinaryOp::Sub => unreachable!("returned above"),
        BinaryOp::Mul => (want(0, &|| g.mul(b()?))?, want(1, &|| g.mul(a()?))?),
        BinaryOp::Div => (
            want(0, &|| g.div(b()?))?,
            want(1, &|| g.mul(a()?)?.div(&b()?.sqr()?)?.neg())?,
        ),
        // PyTorch's conventions: no gradient to the base where the exponent is 0, none to
        // the exponent where the base is 0 and the exponent >= 0 (not 0 * inf = NaN).
        BinaryOp::Pow => {
            let (a, b) = (a()?, b()?);
            (
                want(0, &|| {
                    g.mul(b)?
                        .mul(&a.pow(&b.sub(1.0)?)?)?
                        .masked_fill(&b.eq(0.0)?, 0.0)
                })?,
                want(1, &|| {
                    let zero_base = a.eq(0.0)?.to_dtype(dt)?.mul(&b.ge(0.0)?.to_dtype(dt)?)?;
                    g.mul(&a.pow(b)?)?
                        .mul(&a.log()?)?
                        .masked_fill(&zero_base.gt(0.5)?, 0.0)
                })?,
            )
        }
        BinaryOp::Max | BinaryOp::Min => {
            let (a, b) = (a()?, b()?);
            let win = if op == BinaryOp::Max {
                a.gt(b)?
            } else {
                a.lt(b)?
            };
            // Share of the gradient that goes to `a`: 1 where a wins, 1/2 on ties.
            let s = win.to_dtype(dt)?.add(&a.eq(b)?.to_dtype(dt)?.mul(0.5)?)?;
            (want(0, &|| g.mul(&s))?, want(1, &|| g.mul(&s.rsub(1.0)?))?)
        }
    })
}
