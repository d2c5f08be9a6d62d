//! Softmax and log-softmax along one dim. Math runs in the accumulation type (f32 for half
//! storage), max-shifted for stability.

use super::{map_float, CpuElem, CpuStorage, IntoStorage, PAR_MIN};
use crate::dtype::Float as _;
use crate::layout::Layout;
use crate::Result;
use num_traits::{Float, One, Zero};
use rayon::prelude::*;

/// Splits a shape around `dim` into (outer, size of dim, inner).
fn around(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    let outer = shape[..dim].iter().product();
    let inner = shape[dim + 1..].iter().product();
    (outer, shape[dim], inner)
}

fn softmax_impl<T: CpuElem>(v: &[T], l: &Layout, dim: usize, log: bool) -> Vec<T> {
    let _iso = crate::parallel::Isolated::new();
    let (outer, d, inner) = around(l.shape(), dim);
    if inner == 1 && d > 0 {
        // Along the last dim of a contiguous tensor (attention scores, logits): rows read in
        // place.
        if let Some(r) = l.contiguous_range() {
            return softmax_last(&v[r], d, log);
        }
    }
    let x: Vec<T> = super::elementwise::map1(v, l, |x| x);
    if inner == 1 && d > 0 {
        return softmax_last(&x, d, log);
    }
    let mut out = vec![T::zero(); x.len()];
    let block = d * inner;
    let job = |(o, dst): (usize, &mut [T])| {
        let src = &x[o * block..(o + 1) * block];
        for i in 0..inner {
            let at = |k: usize| src[k * inner + i].to_acc();
            let mut m = T::Acc::neg_infinity();
            for k in 0..d {
                m = m.max(at(k));
            }
            let mut sum = T::Acc::zero();
            for k in 0..d {
                sum += (at(k) - m).exp_act();
            }
            let lse = m + sum.ln();
            for k in 0..d {
                let y = if log {
                    at(k) - lse
                } else {
                    (at(k) - m).exp_act() / sum
                };
                dst[k * inner + i] = T::from_acc(y);
            }
        }
    };
    if block == 0 {
        return out;
    }
    if x.len() >= PAR_MIN && outer > 1 {
        out.par_chunks_mut(block).enumerate().for_each(job);
    } else {
        out.chunks_mut(block).enumerate().for_each(job);
    }
    out
}

/// Softmax (or log-softmax) of each row of `d` values of `x`: the row's maximum, its
/// exponentials once into a scratch row (the branch-free `exp` the compiler vectorises),
/// summed in eight lanes, then scaled by the sum's reciprocal.
fn softmax_last<T: CpuElem>(x: &[T], d: usize, log: bool) -> Vec<T> {
    let mut out = vec![T::zero(); x.len()];
    let rows_per_job = (PAR_MIN / d).max(1);
    let job = |(src, dst): (&[T], &mut [T])| pulp::Arch::new().dispatch(Rows { src, dst, d, log });
    let chunk = rows_per_job * d;
    if x.len() >= PAR_MIN && x.len() > chunk {
        x.par_chunks(chunk)
            .zip(out.par_chunks_mut(chunk))
            .for_each(job);
    } else {
        job((x, &mut out));
    }
    out
}

/// The rows of one task of [`softmax_last`], for `pulp` to compile with the CPU's widest
/// vector unit (the exponentials 8 or 16 lanes wide).
struct Rows<'a, T> {
    src: &'a [T],
    dst: &'a mut [T],
    d: usize,
    log: bool,
}

impl<T: CpuElem> pulp::WithSimd for Rows<'_, T> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let Rows { src, dst, d, log } = self;
        let mut e = vec![T::Acc::zero(); d];
        for (s, o) in src.chunks_exact(d).zip(dst.chunks_exact_mut(d)) {
            for (a, &v) in e.iter_mut().zip(s) {
                *a = v.to_acc();
            }
            let m = e.iter().fold(T::Acc::neg_infinity(), |m, &v| m.max(v));
            let mut lanes = [T::Acc::zero(); 8];
            for chunk in e.chunks_mut(8) {
                for (a, lane) in chunk.iter_mut().zip(lanes.iter_mut()) {
                    *a = (*a - m).exp_act();
                    *lane += *a;
                }
            }
            let sum: T::Acc = lanes.iter().copied().sum();
            if log {
                let lse = m + sum.ln();
                for (o, &v) in o.iter_mut().zip(s) {
                    *o = T::from_acc(v.to_acc() - lse);
                }
            } else {
                let r = T::Acc::one() / sum;
                for (o, &a) in o.iter_mut().zip(&e) {
                    *o = T::from_acc(a * r);
                }
            }
        }
    }
}

/// Softmax along `dim`; output contiguous.
pub(crate) fn softmax(s: &CpuStorage, l: &Layout, dim: usize) -> Result<CpuStorage> {
    Ok(map_float!("softmax", s, v => softmax_impl(v, l, dim, false).into_storage()))
}

/// Log-softmax along `dim`; output contiguous.
pub(crate) fn log_softmax(s: &CpuStorage, l: &Layout, dim: usize) -> Result<CpuStorage> {
    Ok(map_float!("log_softmax", s, v => softmax_impl(v, l, dim, true).into_storage()))
}
