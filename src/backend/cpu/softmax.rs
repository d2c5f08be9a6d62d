//! Softmax and log-softmax along one dim. Math runs in the accumulation type (f32 for half
//! storage), max-shifted for stability.

use super::{map_float, CpuElem, CpuStorage, IntoStorage, PAR_MIN};
use crate::layout::Layout;
use crate::Result;
use num_traits::{Float, Zero};
use rayon::prelude::*;

/// Splits a shape around `dim` into (outer, size of dim, inner).
fn around(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    let outer = shape[..dim].iter().product();
    let inner = shape[dim + 1..].iter().product();
    (outer, shape[dim], inner)
}

fn softmax_impl<T: CpuElem>(v: &[T], l: &Layout, dim: usize, log: bool) -> Vec<T> {
    let _iso = crate::parallel::Isolated::new();
    let x: Vec<T> = super::elementwise::map1(v, l, |x| x);
    let (outer, d, inner) = around(l.shape(), dim);
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
                sum += (at(k) - m).exp();
            }
            let lse = m + sum.ln();
            for k in 0..d {
                let y = if log {
                    at(k) - lse
                } else {
                    (at(k) - m).exp() / sum
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

/// Softmax along `dim`; output contiguous.
pub(crate) fn softmax(s: &CpuStorage, l: &Layout, dim: usize) -> Result<CpuStorage> {
    Ok(map_float!("softmax", s, v => softmax_impl(v, l, dim, false).into_storage()))
}

/// Log-softmax along `dim`; output contiguous.
pub(crate) fn log_softmax(s: &CpuStorage, l: &Layout, dim: usize) -> Result<CpuStorage> {
    Ok(map_float!("log_softmax", s, v => softmax_impl(v, l, dim, true).into_storage()))
}
