//! Integer arithmetic as PyTorch computes it: sums, differences, products and powers wrap
//! modulo 2^64 (i64) or 256 (u8); maximum and minimum are exact. The CPU kernels and the
//! host-side checks of the CUDA kernels share these.

use super::ops::BinaryOp;

/// `a ^ b` for i64, exactly (PyTorch's `powi`): square-and-multiply wrapping on overflow as
/// PyTorch's integer arithmetic does; a negative exponent gives `1 / a^-b` truncated, so 1
/// for `a = 1`, +-1 for `a = -1` and 0 otherwise. (PyTorch refuses a negative *scalar*
/// exponent of an integer tensor; [`crate::Tensor::pow`] does too.)
pub fn pow_i64(a: i64, b: i64) -> i64 {
    if b < 0 {
        return match a {
            1 => 1,
            -1 if b % 2 != 0 => -1,
            -1 => 1,
            _ => 0,
        };
    }
    square_and_multiply(a, b as u64, 1, i64::wrapping_mul)
}

/// `a ^ e` by square and multiply with `mul` (wrapping), starting from `one`.
fn square_and_multiply<T: Copy>(a: T, mut e: u64, one: T, mul: fn(T, T) -> T) -> T {
    let (mut base, mut acc) = (a, one);
    while e > 0 {
        if e & 1 == 1 {
            acc = mul(acc, base);
        }
        base = mul(base, base);
        e >>= 1;
    }
    acc
}

/// `a ^ b` for u8, modulo 256 as PyTorch's integer arithmetic (2^9 is 0): square and
/// multiply, wrapping.
pub fn pow_u8(a: u8, b: u8) -> u8 {
    square_and_multiply(a, b as u64, 1, u8::wrapping_mul)
}

/// `a op b` for i64 as PyTorch computes it: sums, differences and products modulo 2^64
/// (wrapping), maximum and minimum exactly; `None` for the ops computed through f64 (true
/// division, which the ops promote to a float dtype first; powers: [`pow_i64`]).
pub fn int_op_i64(op: BinaryOp) -> Option<fn(i64, i64) -> i64> {
    Some(match op {
        BinaryOp::Add => i64::wrapping_add,
        BinaryOp::Sub => i64::wrapping_sub,
        BinaryOp::Mul => i64::wrapping_mul,
        BinaryOp::Max => std::cmp::max,
        BinaryOp::Min => std::cmp::min,
        BinaryOp::Pow => pow_i64,
        BinaryOp::Div => return None,
    })
}

/// [`int_op_i64`] for u8: modulo 256 (`0 - 200` is 56).
pub fn int_op_u8(op: BinaryOp) -> Option<fn(u8, u8) -> u8> {
    Some(match op {
        BinaryOp::Add => u8::wrapping_add,
        BinaryOp::Sub => u8::wrapping_sub,
        BinaryOp::Mul => u8::wrapping_mul,
        BinaryOp::Max => std::cmp::max,
        BinaryOp::Min => std::cmp::min,
        BinaryOp::Pow => pow_u8,
        BinaryOp::Div => return None,
    })
}
