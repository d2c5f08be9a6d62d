//! Softmax and log-softmax along one dim. Math runs in the accumulation type (f32 for half
//! storage), max-shifted for stability.

use super::{map_float, CpuElem, CpuStorage, IntoStorage, PAR_MIN};
use crate::backend::RowSoftmax;
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
        let p = RowSoftmax {
            cols: d,
            scale: 1.0,
            causal: None,
            log,
        };
        if let Some(r) = l.contiguous_range() {
            return softmax_last(&v[r], p);
        }
        return softmax_last(&super::elementwise::map1(v, l, |x| x), p);
    }
    let x: Vec<T> = super::elementwise::map1(v, l, |x| x);
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

/// The softmax `p` describes (the values scaled, a causal mask, or log-softmax) of each row
/// of `p.cols` values of `x`: the row's maximum, its exponentials once into a scratch row
/// (the branch-free `exp` the compiler vectorises), summed in eight lanes, then scaled by
/// the sum's reciprocal.
fn softmax_last<T: CpuElem>(x: &[T], p: RowSoftmax) -> Vec<T> {
    let d = p.cols;
    let mut out = vec![T::zero(); x.len()];
    let rows_per_job = (PAR_MIN / d).max(1);
    let chunk = rows_per_job * d;
    let job = |(k, (src, dst)): (usize, (&[T], &mut [T]))| {
        let row0 = k * rows_per_job;
        pulp::Arch::new().dispatch(Rows { src, dst, p, row0 })
    };
    if x.len() >= PAR_MIN && x.len() > chunk {
        x.par_chunks(chunk)
            .zip(out.par_chunks_mut(chunk))
            .enumerate()
            .for_each(job);
    } else {
        job((0, (x, &mut out)));
    }
    out
}

/// The rows of one task of [`softmax_last`], the first of them row `row0` of the whole, for
/// `pulp` to compile with the CPU's widest vector unit (the exponentials 8 or 16 lanes
/// wide).
struct Rows<'a, T> {
    src: &'a [T],
    dst: &'a mut [T],
    p: RowSoftmax,
    row0: usize,
}

impl<T: CpuElem> pulp::WithSimd for Rows<'_, T> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let Rows { src, dst, p, row0 } = self;
        let d = p.cols;
        let scale = T::Acc::from_f64_(p.scale);
        let mut e = vec![T::Acc::zero(); d];
        for (k, (s, o)) in src.chunks_exact(d).zip(dst.chunks_exact_mut(d)).enumerate() {
            // The columns from `last` on are masked.
            let last = p.causal.map_or(d, |l| ((row0 + k) % l + 1).min(d));
            let e = &mut e[..last];
            for (a, &v) in e.iter_mut().zip(s) {
                *a = v.to_acc() * scale;
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
            let (kept, masked) = o.split_at_mut(last);
            if p.log {
                let lse = m + sum.ln();
                for (o, &v) in kept.iter_mut().zip(s) {
                    *o = T::from_acc(v.to_acc() * scale - lse);
                }
                masked.fill(T::from_acc(T::Acc::neg_infinity()));
            } else {
                let r = T::Acc::one() / sum;
                for (o, &a) in kept.iter_mut().zip(e.iter()) {
                    *o = T::from_acc(a * r);
                }
                masked.fill(T::zero());
            }
        }
    }
}

/// [`SoftmaxOps::softmax_rows`](crate::backend::SoftmaxOps::softmax_rows): the softmax `p`
/// describes of each row of the contiguous `s`.
pub(crate) fn softmax_rows(s: &CpuStorage, p: RowSoftmax) -> Result<CpuStorage> {
    Ok(map_float!("softmax", s, v => match p.cols {
        0 => Vec::new(),
        _ => softmax_last(v, p),
    }.into_storage()))
}

/// [`SoftmaxOps::softmax_rows_backward`](crate::backend::SoftmaxOps::softmax_rows_backward):
/// the input's gradient from the output `y` and the output's gradient `g`, per row.
pub(crate) fn softmax_rows_backward(
    y: &CpuStorage,
    g: &CpuStorage,
    p: RowSoftmax,
) -> Result<CpuStorage> {
    fn go<T: CpuElem>(y: &[T], g: &CpuStorage, p: RowSoftmax) -> Vec<T> {
        let g = T::slice(g).expect("checked dtype");
        let d = p.cols;
        let scale = T::Acc::from_f64_(p.scale);
        let mut out = vec![T::zero(); y.len()];
        if d == 0 {
            return out;
        }
        let _iso = crate::parallel::Isolated::new();
        let row = |((o, yr), gr): ((&mut [T], &[T]), &[T])| {
            let s = yr
                .iter()
                .zip(gr)
                .fold(T::Acc::zero(), |s, (&y, &g)| match p.log {
                    true => s + g.to_acc(),
                    false => s + g.to_acc() * y.to_acc(),
                });
            for ((o, &y), &g) in o.iter_mut().zip(yr).zip(gr) {
                let (y, g) = (y.to_acc(), g.to_acc());
                let dx = match p.log {
                    true => g - y.exp() * s,
                    false => y * (g - s),
                };
                *o = T::from_acc(scale * dx);
            }
        };
        if y.len() >= PAR_MIN {
            out.par_chunks_mut(d)
                .zip(y.par_chunks(d))
                .zip(g.par_chunks(d))
                .for_each(row);
        } else {
            out.chunks_mut(d)
                .zip(y.chunks(d))
                .zip(g.chunks(d))
                .for_each(row);
        }
        out
    }
    crate::backend::same_dtypes("softmax backward", y.dtype(), g.dtype())?;
    Ok(map_float!("softmax backward", y, v => go(v, g, p).into_storage()))
}

/// Softmax along `dim`; output contiguous.
pub(crate) fn softmax(s: &CpuStorage, l: &Layout, dim: usize) -> Result<CpuStorage> {
    Ok(map_float!("softmax", s, v => softmax_impl(v, l, dim, false).into_storage()))
}

/// Log-softmax along `dim`; output contiguous.
pub(crate) fn log_softmax(s: &CpuStorage, l: &Layout, dim: usize) -> Result<CpuStorage> {
    Ok(map_float!("log_softmax", s, v => softmax_impl(v, l, dim, true).into_storage()))
}
