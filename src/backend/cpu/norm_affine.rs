//! Batch normalisation's affine pass, `alpha[c] (x - center[c]) + gamma[c]` plus an addend,
//! which gives the output forward and the input's gradient backward, and a fused ReLU's part
//! in it: the clamp forward, and backward the mask of where the forward's output was positive
//! (read from the kept output, or recomputed from the input and the forward's statistics).

use super::norm::{dense_range, stat_values, BLOCK};
use super::{map_float, CpuElem, CpuStorage, PAR_MIN};
use crate::backend::norm::{Addend, FusedRelu};
use crate::backend::spec::ChannelSplit;
use crate::dtype::{Float, WithDType};
use crate::layout::Layout;
use crate::{Error, Result};
use num_traits::Zero;
use rayon::prelude::*;

/// `dy` where a fused ReLU's forward output was above 0 (or NaN), else 0, as a dense storage
/// in `dy`'s format, from offset 0 (`None` without a fused ReLU): what ReLU's own backward
/// would pass on. The output is the kept `y` ([`FusedRelu::GradKept`]) or is recomputed from
/// `x` (the batch norm's input, laid out as `dy`) with the forward's statistics
/// ([`FusedRelu::Recompute`]) as [`channel_affine`] computed it, before rounding and clamping.
pub(super) fn relu_masked(
    dy: &CpuStorage,
    ld: &Layout,
    (x, lx): (&CpuStorage, &Layout),
    relu: FusedRelu<'_, CpuStorage>,
) -> Result<Option<(CpuStorage, Layout)>> {
    const OP: &str = "batch_norm backward (ReLU)";
    /// `d` where `on(i, k)` (the element's index in storage order and `y` or `x` there).
    fn go<T: CpuElem>(d: &[T], y: &[T], on: impl Fn(usize, T) -> bool) -> Vec<T> {
        let zero = T::from_acc(T::Acc::zero());
        d.iter()
            .zip(y)
            .enumerate()
            .map(|(i, (&d, &y))| if on(i, y) { d } else { zero })
            .collect()
    }
    /// Whether ReLU's backward passes the gradient at output `v`: above 0, or NaN.
    fn passes<A: Float>(v: A) -> bool {
        v > A::zero() || v.is_nan()
    }
    /// Kept where the saved output is above 0 (NaN included).
    fn by_output<T: CpuElem>(d: &[T], y: &[T]) -> Vec<T> {
        go(d, y, |_, y| passes(y.to_acc()))
    }
    /// Kept where `alpha (x - center) + gamma` of the element's channel is above 0 (or NaN).
    fn by_input<T: CpuElem>(d: &[T], x: &[T], s: ChannelSplit, st: &[f64]) -> Vec<T> {
        let c = s.channels;
        let k: Vec<T::Acc> = st[..3 * c].iter().map(|&v| T::Acc::from_f64_(v)).collect();
        let (alpha, center, gamma) = (&k[..c], &k[c..2 * c], &k[2 * c..]);
        go(d, x, |i, x| {
            let ch = (i / s.inner) % c;
            passes(alpha[ch] * (x.to_acc() - center[ch]) + gamma[ch])
        })
    }
    let (y, ly) = match (relu.mask(), relu.stats()) {
        (Some((y, ly)), _) => (y, ly),
        (None, Some(_)) => (x, lx),
        (None, None) => return Ok(None),
    };
    let split = ChannelSplit::of_pair(OP, ld, ly)?;
    let st = match relu.stats() {
        Some((st, ls)) => {
            let st = stat_values(st, ls)?;
            if st.len() != 5 * split.channels {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "statistics of {} values for input {:?}",
                        st.len(),
                        ly.shape()
                    ),
                ));
            }
            Some(st)
        }
        None => None,
    };
    let (rd, ry) = (dense_range(ld), dense_range(ly));
    macro_rules! pick {
        ($d:expr, $v:expr) => {
            match &st {
                Some(st) => by_input(&$d[rd], &$v[ry], split, st),
                None => by_output(&$d[rd], &$v[ry]),
            }
        };
    }
    let masked = match (dy, y) {
        (CpuStorage::F32(d), CpuStorage::F32(v)) => CpuStorage::F32(pick!(d, v)),
        (CpuStorage::F16(d), CpuStorage::F16(v)) => CpuStorage::F16(pick!(d, v)),
        (CpuStorage::BF16(d), CpuStorage::BF16(v)) => CpuStorage::BF16(pick!(d, v)),
        (CpuStorage::F64(d), CpuStorage::F64(v)) => CpuStorage::F64(pick!(d, v)),
        (d, v) => {
            return Err(Error::DTypeMismatch {
                op: OP,
                lhs: d.dtype(),
                rhs: v.dtype(),
            })
        }
    };
    let at_zero = Layout::new(ld.shape().to_vec(), ld.strides().to_vec(), 0);
    Ok(Some((masked, at_zero)))
}

/// Clamps every element below at 0 (NaN stays): a fused ReLU's forward.
fn clamp_relu<T: CpuElem>(v: &mut [T]) {
    let zero = T::Acc::zero();
    for x in v {
        if x.to_acc() < zero {
            *x = T::from_acc(zero);
        }
    }
}

/// `alpha[c] (x - center[c]) + gamma[c]` plus the addend (`beta[c] dy`, or a residual as it
/// is) in `x`'s dtype and dense layout (the addend shares it); `coef` holds
/// `[alpha | center | gamma | beta]`.
pub(crate) fn channel_affine(
    x: &CpuStorage,
    lx: &Layout,
    add: Addend<'_, CpuStorage>,
    coef: &CpuStorage,
    lc: &Layout,
    relu: FusedRelu<'_, CpuStorage>,
) -> Result<CpuStorage> {
    let masked = match add {
        Addend::Scaled(d, ld) => relu_masked(d, ld, (x, lx), relu)?,
        _ => None,
    };
    let dy = masked.as_ref().map(|(d, l)| (d, l)).or(add.operand());
    let mut coef = stat_values(coef, lc)?;
    if let Addend::Residual(..) = add {
        // A residual is added as it is: beta = 1.
        let c = coef.len() / 4;
        coef[3 * c..].fill(1.0);
    }
    let mut out = affine(x, lx, dy, &coef)?;
    if let FusedRelu::Output = relu {
        map_float!("batch_norm", &mut out, v => clamp_relu(v));
    }
    Ok(out)
}

/// [`channel_affine`] without a ReLU, with the coefficients as f64 values.
fn affine(
    x: &CpuStorage,
    lx: &Layout,
    dy: Option<(&CpuStorage, &Layout)>,
    coef: &[f64],
) -> Result<CpuStorage> {
    fn go<T: CpuElem>(x: &[T], dy: Option<&[T]>, s: ChannelSplit, coef: &[f64]) -> CpuStorage {
        let c = s.channels;
        let k: Vec<T::Acc> = coef.iter().map(|&v| T::Acc::from_f64_(v)).collect();
        let (alpha, center, gamma, beta) = (&k[..c], &k[c..2 * c], &k[2 * c..3 * c], &k[3 * c..]);
        let mut out = super::overwritten_buffer::<T>(x.len());
        let row = (c * s.inner).max(1);
        let step = (BLOCK / row).max(1) * row;
        let job = |(b, o): (usize, &mut [T])| {
            let span = b * step..b * step + o.len();
            let (xb, db) = (&x[span.clone()], dy.map(|d| &d[span]));
            for (r, orow) in o.chunks_exact_mut(row).enumerate() {
                let xrow = &xb[r * row..(r + 1) * row];
                let drow = db.map(|d| &d[r * row..(r + 1) * row]);
                if s.inner == 1 {
                    affine_columns(orow, xrow, drow, alpha, center, gamma, beta);
                    continue;
                }
                for ch in 0..c {
                    let run = ch * s.inner..(ch + 1) * s.inner;
                    let (a, m, g, bb) = (alpha[ch], center[ch], gamma[ch], beta[ch]);
                    let (o, xr) = (&mut orow[run.clone()], &xrow[run.clone()]);
                    match drow {
                        None => {
                            for (o, &v) in o.iter_mut().zip(xr) {
                                *o = T::from_acc(a * (v.to_acc() - m) + g);
                            }
                        }
                        Some(drow) => {
                            for ((o, &v), &d) in o.iter_mut().zip(xr).zip(&drow[run]) {
                                *o = T::from_acc(a * (v.to_acc() - m) + g + bb * d.to_acc());
                            }
                        }
                    }
                }
            }
        };
        if x.len() >= PAR_MIN {
            out.par_chunks_mut(step).enumerate().for_each(job);
        } else {
            out.chunks_mut(step).enumerate().for_each(job);
        }
        T::wrap(out)
    }
    let s = match dy {
        Some((_, ld)) => ChannelSplit::of_pair("batch_norm backward", lx, ld)?,
        None => ChannelSplit::of("batch_norm", lx)?,
    };
    let rx = dense_range(lx);
    Ok(match (x, dy.map(|(d, ld)| (d, dense_range(ld)))) {
        (x, None) => map_float!("batch_norm", x, v => go(&v[rx], None, s, coef)),
        (CpuStorage::F32(x), Some((CpuStorage::F32(d), rd))) => go(&x[rx], Some(&d[rd]), s, coef),
        (CpuStorage::F16(x), Some((CpuStorage::F16(d), rd))) => go(&x[rx], Some(&d[rd]), s, coef),
        (CpuStorage::BF16(x), Some((CpuStorage::BF16(d), rd))) => go(&x[rx], Some(&d[rd]), s, coef),
        (CpuStorage::F64(x), Some((CpuStorage::F64(d), rd))) => go(&x[rx], Some(&d[rd]), s, coef),
        (x, Some((d, _))) => {
            return Err(Error::DTypeMismatch {
                op: "batch_norm backward",
                lhs: x.dtype(),
                rhs: d.dtype(),
            })
        }
    })
}

/// One channels-last row (`inner == 1`): channel `c` is element `c`.
#[inline(always)]
fn affine_columns<T: WithDType>(
    o: &mut [T],
    x: &[T],
    dy: Option<&[T]>,
    alpha: &[T::Acc],
    center: &[T::Acc],
    gamma: &[T::Acc],
    beta: &[T::Acc],
) {
    let coefs = alpha.iter().zip(center).zip(gamma);
    match dy {
        None => {
            for ((o, &v), ((&a, &m), &g)) in o.iter_mut().zip(x).zip(coefs) {
                *o = T::from_acc(a * (v.to_acc() - m) + g);
            }
        }
        Some(dy) => {
            let coefs = coefs.zip(beta);
            for (((o, &v), &d), (((&a, &m), &g), &bb)) in o.iter_mut().zip(x).zip(dy).zip(coefs) {
                *o = T::from_acc(a * (v.to_acc() - m) + g + bb * d.to_acc());
            }
        }
    }
}
