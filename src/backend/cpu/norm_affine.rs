//! Batch normalisation's affine pass, `alpha[c] (x - center[c]) + gamma[c]` plus an addend,
//! which gives the output forward and the input's gradient backward, and a fused ReLU's part
//! in it: the clamp forward, and backward the mask of where the forward's output was positive
//! (read from the kept output, or recomputed from the input and the forward's statistics).

use super::norm::{dense_range, relu_masked, stat_values, BLOCK};
use super::{map_float, CpuElem, CpuStorage, PAR_MIN};
use crate::backend::norm::{Addend, FusedRelu};
use crate::backend::spec::ChannelSplit;
use crate::dtype::{Float, WithDType};
use crate::layout::Layout;
use crate::{Error, Result};
use num_traits::Zero;
use rayon::prelude::*;

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
        let _iso = crate::parallel::Isolated::new();
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
