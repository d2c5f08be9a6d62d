//! Element types: the runtime [`DType`] tag and the [`WithDType`] trait every storage type
//! implements, so that kernels are written once as generic functions.

mod vmath;

use half::{bf16, f16};

/// The element type of a tensor.
///
/// `F16` and `BF16` are storage formats: arithmetic on them runs in f32 and rounds on store,
/// as tensor cores do. `I64` holds class indices, `U8` holds boolean masks (0 or 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    F64,
    I64,
    U8,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F64 | DType::I64 => 8,
            DType::U8 => 1,
        }
    }

    /// True for the floating dtypes (the ones autograd differentiates).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16 | DType::F64)
    }

    /// True for f16 and bf16.
    pub fn is_half(self) -> bool {
        matches!(self, DType::F16 | DType::BF16)
    }

    /// The dtype two operands are computed in (PyTorch's promotion for the types we have):
    /// floats beat integers, wider floats beat narrower ones, and f16 with bf16 gives f32.
    pub fn promote(self, other: DType) -> DType {
        use DType::*;
        if self == other {
            return self;
        }
        let rank = |d: DType| match d {
            U8 => 0,
            I64 => 1,
            F16 | BF16 => 2,
            F32 => 3,
            F64 => 4,
        };
        match (self, other) {
            (F16, BF16) | (BF16, F16) => F32,
            _ if rank(self) >= rank(other) => self,
            _ => other,
        }
    }
}

/// The arithmetic type used for a storage type: f32 for f32/f16/bf16/u8, f64 for f64/i64.
pub trait Float:
    num_traits::Float
    + num_traits::FromPrimitive
    + std::iter::Sum
    + std::ops::AddAssign
    + std::ops::MulAssign
    + Send
    + Sync
    + std::fmt::Debug
    + 'static
{
    /// The error function.
    fn erf(self) -> Self;
    /// Converts from f64 (rounding for f32).
    fn from_f64_(v: f64) -> Self;
    /// Converts to f64.
    fn to_f64_(self) -> f64;
    /// `1 / (1 + e^-x)` for kernels that compute many per element: branch-free and
    /// vectorisable for f32 (within a few ulp), libm for f64.
    fn sigmoid_act(self) -> Self;
    /// `tanh x`, as [`Float::sigmoid_act`].
    fn tanh_act(self) -> Self;
    /// `e^x`, as [`Float::sigmoid_act`] (within 2 ulp for f32).
    fn exp_act(self) -> Self;
}

impl Float for f32 {
    fn erf(self) -> Self {
        libm::erff(self)
    }
    fn from_f64_(v: f64) -> Self {
        v as f32
    }
    fn to_f64_(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn sigmoid_act(self) -> Self {
        vmath::sigmoid(self)
    }
    #[inline(always)]
    fn tanh_act(self) -> Self {
        vmath::tanh(self)
    }
    #[inline(always)]
    fn exp_act(self) -> Self {
        vmath::exp(self)
    }
}

impl Float for f64 {
    fn erf(self) -> Self {
        libm::erf(self)
    }
    fn from_f64_(v: f64) -> Self {
        v
    }
    fn to_f64_(self) -> f64 {
        self
    }
    fn sigmoid_act(self) -> Self {
        1.0 / (1.0 + (-self).exp())
    }
    fn tanh_act(self) -> Self {
        self.tanh()
    }
    fn exp_act(self) -> Self {
        self.exp()
    }
}

/// A Rust type that can be a tensor element.
pub trait WithDType:
    Copy + Default + Send + Sync + PartialOrd + std::fmt::Debug + bytemuck::Pod + 'static
{
    /// The runtime tag of this type.
    const DTYPE: DType;
    /// The type arithmetic on this element runs in.
    type Acc: Float;
    /// Widens to the arithmetic type.
    fn to_acc(self) -> Self::Acc;
    /// Narrows from the arithmetic type (round to nearest for half types, truncation toward
    /// zero for integers, saturation for u8).
    fn from_acc(v: Self::Acc) -> Self;
    /// Converts to f64 (exact for every type but i64 beyond 2^53).
    fn to_f64(self) -> f64;
    /// Converts from f64 with the same rounding rules as [`WithDType::from_acc`].
    fn from_f64(v: f64) -> Self;
    /// Zero.
    fn zero() -> Self {
        Self::from_f64(0.0)
    }
}

macro_rules! with_dtype {
    ($t:ty, $dt:ident, $acc:ty, $to_acc:expr, $from_acc:expr, $to_f64:expr, $from_f64:expr) => {
        impl WithDType for $t {
            const DTYPE: DType = DType::$dt;
            type Acc = $acc;
            #[inline(always)]
            fn to_acc(self) -> $acc {
                $to_acc(self)
            }
            #[inline(always)]
            fn from_acc(v: $acc) -> Self {
                $from_acc(v)
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                $to_f64(self)
            }
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                $from_f64(v)
            }
        }
    };
}

with_dtype!(f32, F32, f32, |x| x, |x| x, |x: f32| x as f64, |x| x as f32);
with_dtype!(f64, F64, f64, |x| x, |x| x, |x| x, |x| x);
with_dtype!(
    f16,
    F16,
    f32,
    f16::to_f32,
    f16::from_f32,
    f16::to_f64,
    f16::from_f64
);
with_dtype!(
    bf16,
    BF16,
    f32,
    bf16::to_f32,
    bf16::from_f32,
    bf16::to_f64,
    bf16::from_f64
);
with_dtype!(
    i64,
    I64,
    f64,
    |x: i64| x as f64,
    |x: f64| x as i64,
    |x: i64| x as f64,
    |x: f64| x as i64
);
with_dtype!(
    u8,
    U8,
    f32,
    |x: u8| x as f32,
    |x: f32| x as u8,
    |x: u8| x as f64,
    |x: f64| x as u8
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn promotion_follows_pytorch() {
        assert_eq!(DType::F16.promote(DType::F32), DType::F32);
        assert_eq!(DType::BF16.promote(DType::F16), DType::F32);
        assert_eq!(DType::I64.promote(DType::F16), DType::F16);
        assert_eq!(DType::U8.promote(DType::I64), DType::I64);
        assert_eq!(DType::F64.promote(DType::F32), DType::F64);
    }

    #[test]
    fn half_rounds_to_nearest() {
        // 1 + 2^-11 is exactly half-way between two f16 values: ties go to even (1.0).
        assert_eq!(f16::from_acc(1.0 + 2f32.powi(-11)).to_f32(), 1.0);
        assert_eq!(
            f16::from_acc(1.0 + 3.0 * 2f32.powi(-11)).to_f32(),
            1.0 + 2f32.powi(-9)
        );
        assert_eq!(u8::from_acc(300.0), 255);
    }
}
