//! `+ - * /` and unary `-` on tensors, as candle writes them: each gives a `Result`, so
//! `(&a + &b)?` and `(&x * 2.0)?` read like the methods they call ([`Tensor::add`],
//! [`Tensor::sub`], [`Tensor::mul`], [`Tensor::div`], [`Tensor::neg`]), with the same
//! broadcasting, dtype promotion and autograd.
//!
//! ```
//! use mantissa::{Device, Tensor};
//! let a = Tensor::from_vec(vec![1.0f32, 2.0], &[2], Device::Cpu)?;
//! let b = Tensor::from_vec(vec![10.0f32, 20.0], &[2], Device::Cpu)?;
//! let y = ((&a + &b)? * 2.0)?;
//! assert_eq!(y.to_vec::<f32>()?, vec![22.0, 44.0]);
//! let z = (1.0 - &a)?;
//! assert_eq!(z.to_vec::<f32>()?, vec![0.0, -1.0]);
//! # Ok::<(), mantissa::Error>(())
//! ```

use super::elementwise::Operand;
use crate::{DType, Result, Tensor};
use std::ops::{Add, Div, Mul, Neg, Sub};

/// `tensor op rhs` for a tensor reference or an owned tensor on the left, and on the right
/// anything the method takes (a tensor reference, `f64`, `f32`, `i64`, `i32`) or an owned
/// tensor.
macro_rules! tensor_operator {
    ($trait:ident, $method:ident) => {
        impl<'a, R: Into<Operand<'a>>> $trait<R> for &Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: R) -> Result<Tensor> {
                Tensor::$method(self, rhs)
            }
        }
        impl<'a, R: Into<Operand<'a>>> $trait<R> for Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: R) -> Result<Tensor> {
                Tensor::$method(&self, rhs)
            }
        }
        impl $trait<Tensor> for &Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: Tensor) -> Result<Tensor> {
                Tensor::$method(self, &rhs)
            }
        }
        impl $trait<Tensor> for Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: Tensor) -> Result<Tensor> {
                Tensor::$method(&self, &rhs)
            }
        }
    };
}

tensor_operator!(Add, add);
tensor_operator!(Sub, sub);
tensor_operator!(Mul, mul);
tensor_operator!(Div, div);

/// `scalar op tensor` for an `f64` on the left: `s + x`, `s - x` ([`Tensor::rsub`]),
/// `s * x` and `s / x`, typed as PyTorch types a Python float and a tensor, the same on
/// either side: an integer or bool tensor gives f32, a float tensor keeps its dtype, and the
/// scalar is never rounded to the tensor's dtype first (`1e6 / f16` computes in f32 and
/// rounds the quotient).
macro_rules! scalar_operators {
    ($($s:ty),*) => {$(
        impl Add<&Tensor> for $s {
            type Output = Result<Tensor>;
            fn add(self, x: &Tensor) -> Result<Tensor> {
                x.add(self as f64)
            }
        }
        impl Sub<&Tensor> for $s {
            type Output = Result<Tensor>;
            fn sub(self, x: &Tensor) -> Result<Tensor> {
                x.rsub(self as f64)
            }
        }
        impl Mul<&Tensor> for $s {
            type Output = Result<Tensor>;
            fn mul(self, x: &Tensor) -> Result<Tensor> {
                x.mul(self as f64)
            }
        }
        impl Div<&Tensor> for $s {
            type Output = Result<Tensor>;
            fn div(self, x: &Tensor) -> Result<Tensor> {
                scalar_div(self as f64, x)
            }
        }
    )*};
}

/// `s / x`: true division in f32 for an integer or bool `x`; in f32, rounded to `x`'s dtype
/// once, for f16 and bf16 (a large `s` would overflow them); in `x`'s dtype otherwise.
fn scalar_div(s: f64, x: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    let wide = match dtype {
        DType::F32 | DType::F64 => return Tensor::full(&[], s, dtype, x.device())?.div(x),
        _ => x.to_dtype(DType::F32)?,
    };
    let q = Tensor::full(&[], s, DType::F32, x.device())?.div(&wide)?;
    match dtype.is_float() {
        true => q.to_dtype(dtype),
        false => Ok(q),
    }
}

// Only f64, so that a float literal on the left (`2.0 * &x`) needs no annotation.
scalar_operators!(f64);

impl Neg for &Tensor {
    type Output = Result<Tensor>;
    fn neg(self) -> Result<Tensor> {
        Tensor::neg(self)
    }
}

impl Neg for Tensor {
    type Output = Result<Tensor>;
    fn neg(self) -> Result<Tensor> {
        Tensor::neg(&self)
    }
}
