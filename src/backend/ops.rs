//! The primitive ops a backend implements, with their scalar math written once in the
//! arithmetic type (f32 or f64). The CPU kernels call these; the CUDA kernels mirror them.

use crate::dtype::Float;

pub use super::optim::{
    AdadeltaRule, AdagradRule, AdamRule, OptimUpdate, Prepared, RmsPropRule, SgdRule, UpdateRule,
};
pub use super::spec::{window_out, Conv2dParams, Pool2dParams};

/// Elementwise functions of one input (some carry a scalar parameter).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum UnaryOp {
    Neg,
    Abs,
    Exp,
    Log,
    Log1p,
    Sqrt,
    Rsqrt,
    Recip,
    Sin,
    Cos,
    Tanh,
    Sigmoid,
    /// `max(x, 0)`; NaN stays NaN.
    Relu,
    /// `x` for x > 0, `slope * x` otherwise.
    LeakyRelu(f64),
    /// `0.5 x (1 + erf(x / sqrt 2))`.
    GeluErf,
    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
    GeluTanh,
    Silu,
    /// `ln(1 + e^x)`, and `x` itself above 20 (PyTorch's `softplus` with `beta = 1`,
    /// `threshold = 20`).
    Softplus,
    /// `mul * x + add`.
    Affine {
        mul: f64,
        add: f64,
    },
    /// `x ^ p`.
    PowScalar(f64),
    /// `s ^ x`.
    ScalarPow(f64),
    /// `max(x, s)`; NaN stays NaN.
    MaxScalar(f64),
    /// `min(x, s)`; NaN stays NaN.
    MinScalar(f64),
}

#[inline(always)]
fn c<A: Float>(v: f64) -> A {
    A::from_f64_(v)
}

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const GELU_C: f64 = 0.044715;

impl UnaryOp {
    /// The op's name in graph nodes, errors and profiles.
    pub fn name(self) -> &'static str {
        use UnaryOp::*;
        match self {
            Neg => "neg",
            Abs => "abs",
            Exp => "exp",
            Log => "log",
            Log1p => "log1p",
            Sqrt => "sqrt",
            Rsqrt => "rsqrt",
            Recip => "recip",
            Sin => "sin",
            Cos => "cos",
            Tanh => "tanh",
            Sigmoid => "sigmoid",
            Relu => "relu",
            LeakyRelu(_) => "leaky_relu",
            GeluErf => "gelu",
            GeluTanh => "gelu_tanh",
            Silu => "silu",
            Softplus => "softplus",
            Affine { .. } => "affine",
            PowScalar(_) => "pow_scalar",
            ScalarPow(_) => "scalar_pow",
            MaxScalar(_) => "clamp_min",
            MinScalar(_) => "clamp_max",
        }
    }

    /// Every unary op, in the order of their kernel codes (parameters are samples). The CUDA
    /// kernels name the codes `UNARY_<NAME>` (`#define`s generated from this list).
    pub const ALL: [UnaryOp; 23] = [
        UnaryOp::Neg,
        UnaryOp::Abs,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Log1p,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Recip,
        UnaryOp::Sin,
        UnaryOp::Cos,
        UnaryOp::Tanh,
        UnaryOp::Sigmoid,
        UnaryOp::Relu,
        UnaryOp::LeakyRelu(0.1),
        UnaryOp::GeluErf,
        UnaryOp::GeluTanh,
        UnaryOp::Silu,
        UnaryOp::Affine {
            mul: 1.5,
            add: -0.25,
        },
        UnaryOp::PowScalar(1.7),
        UnaryOp::ScalarPow(1.3),
        UnaryOp::MaxScalar(1.0),
        UnaryOp::MinScalar(1.0),
        UnaryOp::Softplus,
    ];

    /// The op's code in the kernels: its place in [`UnaryOp::ALL`].
    pub fn code(self) -> i32 {
        let d = std::mem::discriminant(&self);
        let i = Self::ALL
            .iter()
            .position(|o| std::mem::discriminant(o) == d);
        i.expect("UnaryOp::ALL lists every variant") as i32
    }

    /// The scalar parameters `(a, b)` the kernels take (0 where the op has none).
    pub fn params(self) -> (f64, f64) {
        match self {
            UnaryOp::LeakyRelu(s)
            | UnaryOp::PowScalar(s)
            | UnaryOp::ScalarPow(s)
            | UnaryOp::MaxScalar(s)
            | UnaryOp::MinScalar(s) => (s, 0.0),
            UnaryOp::Affine { mul, add } => (mul, add),
            _ => (0.0, 0.0),
        }
    }

    /// The function value.
    #[inline(always)]
    pub fn f<A: Float>(self, x: A) -> A {
        let one = A::one();
        let half: A = c(0.5);
        match self {
            UnaryOp::Neg => -x,
            UnaryOp::Abs => x.abs(),
            UnaryOp::Exp => x.exp(),
            UnaryOp::Log => x.ln(),
            UnaryOp::Log1p => x.ln_1p(),
            UnaryOp::Sqrt => x.sqrt(),
            UnaryOp::Rsqrt => one / x.sqrt(),
            UnaryOp::Recip => one / x,
            UnaryOp::Sin => x.sin(),
            UnaryOp::Cos => x.cos(),
            // The activations run branch-free polynomials (within a few ulp in f32) that the
            // compiler vectorises, as PyTorch's CPU kernels run vectorised ones; libm's are
            // one call per element.
            UnaryOp::Tanh => x.tanh_act(),
            UnaryOp::Sigmoid => x.sigmoid_act(),
            // Written as selects so that NaN stays NaN (as in PyTorch; `max` drops it).
            UnaryOp::Relu => {
                if x < A::zero() {
                    A::zero()
                } else {
                    x
                }
            }
            UnaryOp::LeakyRelu(s) => {
                if x > A::zero() {
                    x
                } else {
                    x * c(s)
                }
            }
            UnaryOp::GeluErf => half * x * (one + (x * c(std::f64::consts::FRAC_1_SQRT_2)).erf()),
            UnaryOp::GeluTanh => {
                half * x
                    * (one + (c::<A>(SQRT_2_OVER_PI) * (x + c::<A>(GELU_C) * x * x * x)).tanh_act())
            }
            UnaryOp::Silu => x * x.sigmoid_act(),
            UnaryOp::Softplus => {
                if x > c(20.0) {
                    x
                } else {
                    x.exp().ln_1p()
                }
            }
            UnaryOp::Affine { mul, add } => x * c(mul) + c(add),
            UnaryOp::PowScalar(p) => {
                if p == 2.0 {
                    x * x
                } else {
                    x.powf(c(p))
                }
            }
            UnaryOp::ScalarPow(s) => c::<A>(s).powf(x),
            UnaryOp::MaxScalar(s) => {
                if x < c(s) {
                    c(s)
                } else {
                    x
                }
            }
            UnaryOp::MinScalar(s) => {
                if x > c(s) {
                    c(s)
                } else {
                    x
                }
            }
        }
    }

    /// `g f'(x)`: the op's backward at `x` for the incoming gradient `g`. Where the
    /// derivative is a mask (ReLU, the scalar clamps) or zero by definition (`x^0`), the
    /// gradient is selected rather than multiplied, so an infinite or NaN `g` there gives 0, as
    /// PyTorch's `threshold_backward`, clamp and pow backward do (`inf * 0` would be NaN).
    #[inline(always)]
    pub fn grad<A: Float>(self, x: A, g: A) -> A {
        let d = self.df(x);
        let selects = matches!(
            self,
            UnaryOp::Relu | UnaryOp::MaxScalar(_) | UnaryOp::MinScalar(_)
        ) || matches!(self, UnaryOp::PowScalar(p) if p == 0.0);
        if selects && d == A::zero() {
            A::zero()
        } else {
            g * d
        }
    }

    /// The derivative d f / d x at `x`.
    #[inline(always)]
    pub fn df<A: Float>(self, x: A) -> A {
        let one = A::one();
        let zero = A::zero();
        let half: A = c(0.5);
        match self {
            UnaryOp::Neg => -one,
            UnaryOp::Abs => {
                if x > zero {
                    one
                } else if x < zero {
                    -one
                } else {
                    zero
                }
            }
            UnaryOp::Exp => x.exp(),
            UnaryOp::Log => one / x,
            UnaryOp::Log1p => one / (one + x),
            UnaryOp::Sqrt => half / x.sqrt(),
            UnaryOp::Rsqrt => -half / (x * x.sqrt()),
            UnaryOp::Recip => -one / (x * x),
            UnaryOp::Sin => x.cos(),
            UnaryOp::Cos => -x.sin(),
            UnaryOp::Tanh => {
                let t = x.tanh_act();
                one - t * t
            }
            UnaryOp::Sigmoid => {
                let s = x.sigmoid_act();
                s * (one - s)
            }
            // Zero where x <= 0, else one: a NaN input passes its gradient on, as PyTorch's
            // threshold_backward does.
            UnaryOp::Relu => {
                if x <= zero {
                    zero
                } else {
                    one
                }
            }
            UnaryOp::LeakyRelu(s) => {
                if x > zero {
                    one
                } else {
                    c(s)
                }
            }
            UnaryOp::GeluErf => {
                let cdf = half * (one + (x * c(std::f64::consts::FRAC_1_SQRT_2)).erf());
                let pdf = (-(x * x) * half).exp() * c(0.398_942_280_401_432_7);
                cdf + x * pdf
            }
            UnaryOp::GeluTanh => {
                let k: A = c(SQRT_2_OVER_PI);
                let inner = k * (x + c::<A>(GELU_C) * x * x * x);
                let t = inner.tanh_act();
                let dinner = k * (one + c::<A>(3.0 * GELU_C) * x * x);
                half * (one + t) + half * x * (one - t * t) * dinner
            }
            UnaryOp::Silu => {
                let s = x.sigmoid_act();
                s * (one + x * (one - s))
            }
            UnaryOp::Softplus => {
                if x > c(20.0) {
                    one
                } else {
                    one / (one + (-x).exp())
                }
            }
            UnaryOp::Affine { mul, .. } => c(mul),
            UnaryOp::PowScalar(p) => {
                // Squares (variances, norms) without a powf per element.
                if p == 0.0 {
                    zero
                } else if p == 2.0 {
                    c::<A>(2.0) * x
                } else {
                    c::<A>(p) * x.powf(c(p - 1.0))
                }
            }
            // d/dx s^x = s^x ln s; for s = 0 and x >= 0 PyTorch takes 0 (not 0 * -inf).
            UnaryOp::ScalarPow(s) if s == 0.0 && x >= zero => zero,
            UnaryOp::ScalarPow(s) => c::<A>(s).powf(x) * c::<A>(s).ln(),
            UnaryOp::MaxScalar(s) => {
                if x > c(s) {
                    one
                } else {
                    zero
                }
            }
            UnaryOp::MinScalar(s) => {
                if x < c(s) {
                    one
                } else {
                    zero
                }
            }
        }
    }
}

/// Elementwise functions of two inputs of the same (broadcast) shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Max,
    Min,
}

impl BinaryOp {
    /// Every binary op, in the order of their kernel codes (`BINARY_<NAME>` in the kernels).
    pub const ALL: [BinaryOp; 7] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Pow,
        BinaryOp::Max,
        BinaryOp::Min,
    ];

    /// The op's name in the kernels' code names.
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Pow => "pow",
            BinaryOp::Max => "max",
            BinaryOp::Min => "min",
        }
    }

    /// The op's code in the kernels (its place in [`BinaryOp::ALL`]).
    pub fn code(self) -> i32 {
        self as i32
    }

    #[inline(always)]
    pub fn f<A: Float>(self, a: A, b: A) -> A {
        match self {
            BinaryOp::Add => a + b,
            BinaryOp::Sub => a - b,
            BinaryOp::Mul => a * b,
            BinaryOp::Div => a / b,
            BinaryOp::Pow => a.powf(b),
            // NaN in either operand gives NaN, as PyTorch's maximum/minimum. `|`, not `||`: without
            // the branch the loop vectorises (twice as fast).
            BinaryOp::Max => {
                if (a > b) | a.is_nan() {
                    a
                } else {
                    b
                }
            }
            BinaryOp::Min => {
                if (a < b) | a.is_nan() {
                    a
                } else {
                    b
                }
            }
        }
    }
}

/// Comparisons; they give a `U8` mask of 0 and 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmpOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl CmpOp {
    /// Every comparison, in the order of their kernel codes (`CMP_<NAME>` in the kernels).
    pub const ALL: [CmpOp; 6] = [
        CmpOp::Eq,
        CmpOp::Ne,
        CmpOp::Lt,
        CmpOp::Le,
        CmpOp::Gt,
        CmpOp::Ge,
    ];

    /// The comparison's name in the kernels' code names.
    pub fn name(self) -> &'static str {
        match self {
            CmpOp::Eq => "eq",
            CmpOp::Ne => "ne",
            CmpOp::Lt => "lt",
            CmpOp::Le => "le",
            CmpOp::Gt => "gt",
            CmpOp::Ge => "ge",
        }
    }

    /// The comparison's code in the kernels (its place in [`CmpOp::ALL`]).
    pub fn code(self) -> i32 {
        self as i32
    }

    #[inline(always)]
    pub fn f<A: PartialOrd>(self, a: A, b: A) -> bool {
        match self {
            CmpOp::Eq => a == b,
            CmpOp::Ne => a != b,
            CmpOp::Lt => a < b,
            CmpOp::Le => a <= b,
            CmpOp::Gt => a > b,
            CmpOp::Ge => a >= b,
        }
    }
}

/// Reductions over a set of dims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the count, in the accumulation type (no overflow for half storage).
    Mean,
    Max,
    Min,
    /// Index (i64) of the first maximum.
    ArgMax,
    /// Index (i64) of the first minimum.
    ArgMin,
}

impl ReduceOp {
    /// Every reduction, in the order of their kernel codes (`REDUCE_<NAME>` in the kernels).
    pub const ALL: [ReduceOp; 6] = [
        ReduceOp::Sum,
        ReduceOp::Mean,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::ArgMax,
        ReduceOp::ArgMin,
    ];

    /// The reduction's name in errors and the kernels' code names.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::ArgMax => "argmax",
            ReduceOp::ArgMin => "argmin",
        }
    }

    /// The reduction's code in the kernels (its place in [`ReduceOp::ALL`]).
    pub fn code(self) -> i32 {
        self as i32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derivatives_match_finite_differences() {
        let ops = [
            UnaryOp::Exp,
            UnaryOp::Log,
            UnaryOp::Log1p,
            UnaryOp::Sqrt,
            UnaryOp::Rsqrt,
            UnaryOp::Recip,
            UnaryOp::Sin,
            UnaryOp::Cos,
            UnaryOp::Tanh,
            UnaryOp::Sigmoid,
            UnaryOp::GeluErf,
            UnaryOp::GeluTanh,
            UnaryOp::Silu,
            UnaryOp::Softplus,
            UnaryOp::PowScalar(1.7),
            UnaryOp::ScalarPow(2.5),
        ];
        for op in ops {
            for &x in &[0.3f64, 0.9, 1.7] {
                let h = 1e-6;
                let fd = (op.f(x + h) - op.f(x - h)) / (2.0 * h);
                assert!((fd - op.df(x)).abs() < 1e-6, "{op:?} at {x}");
            }
        }
    }

    #[test]
    fn kernel_codes_are_the_places_in_all() {
        for (i, op) in UnaryOp::ALL.iter().enumerate() {
            assert_eq!(op.code(), i as i32, "{op:?}");
        }
        for (i, op) in BinaryOp::ALL.iter().enumerate() {
            assert_eq!(op.code(), i as i32, "{op:?}");
        }
        for (i, op) in CmpOp::ALL.iter().enumerate() {
            assert_eq!(op.code(), i as i32, "{op:?}");
        }
        for (i, op) in ReduceOp::ALL.iter().enumerate() {
            assert_eq!(op.code(), i as i32, "{op:?}");
        }
        assert_eq!(UnaryOp::LeakyRelu(0.3).code(), UnaryOp::ALL[13].code());
        assert_eq!(UnaryOp::Affine { mul: 2.0, add: 3.0 }.params(), (2.0, 3.0));
    }

    #[test]
    fn conv_output_sizes() {
        assert_eq!(window_out(28, 3, 1, 0, 1, false), Some(26));
        assert_eq!(window_out(5, 2, 2, 0, 1, true), Some(3));
        assert_eq!(window_out(2, 5, 1, 0, 1, false), None);
    }
}
