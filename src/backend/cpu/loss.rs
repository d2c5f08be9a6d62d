//! Fused cross-entropy over rows of logits `[rows, C]` against class indices, with label
//! smoothing and `ignore_index`: one pass per row forward (log-sum-exp, the target's logit,
//! the row's sum) and one backward, in the element's arithmetic type (f32 for half storage,
//! f64 for f64). `cuda/softmax_xent.cu` computes the same.

use super::{contiguous, map_float, CpuElem, CpuStorage, PAR_MIN};
use crate::dtype::DType;
use crate::layout::Layout;
use crate::{Error, Result};
use num_traits::{Float, One, ToPrimitive, Zero};
use rayon::prelude::*;

/// Values of the arithmetic dtype of `x` (f64 for f64, f32 otherwise) as a storage.
fn acc_storage(like: DType, v: Vec<f64>) -> CpuStorage {
    match like {
        DType::F64 => CpuStorage::F64(v),
        _ => CpuStorage::F32(v.into_iter().map(|a| a as f32).collect()),
    }
}

/// An f32 or f64 storage's values as f64.
fn f64s(op: &'static str, s: &CpuStorage, l: &Layout) -> Result<Vec<f64>> {
    Ok(match s {
        CpuStorage::F32(v) => contiguous(v, l).iter().map(|&a| a as f64).collect(),
        CpuStorage::F64(v) => contiguous(v, l).into_owned(),
        other => {
            return Err(Error::DType {
                op,
                dtype: other.dtype(),
                expected: "F32 or F64",
            })
        }
    })
}

/// Whether row `t`'s target counts (not `ignore_index`); `Err` for a target out of `[0, c)`.
fn counted(t: i64, c: usize, ignore: i64) -> Result<bool> {
    if t == ignore {
        return Ok(false);
    }
    if t < 0 || t as usize >= c {
        return Err(Error::invalid(
            "cross_entropy",
            format!("target {t} is out of range for {c} classes (ignore_index {ignore})"),
        ));
    }
    Ok(true)
}

/// Runs `f(row index, row)` over the `rows` rows of `c` values of `x`, one output per row.
fn per_row<T: CpuElem>(
    x: &[T],
    rows: usize,
    c: usize,
    f: impl Fn(usize, &[T]) -> f64 + Sync,
) -> Vec<f64> {
    let _iso = crate::parallel::Isolated::new();
    let job = |(r, row): (usize, &[T])| f(r, row);
    if c == 0 {
        (0..rows).map(|r| f(r, &[])).collect()
    } else if x.len() >= PAR_MIN {
        x.par_chunks(c).enumerate().map(job).collect()
    } else {
        x.chunks(c).enumerate().map(job).collect()
    }
}

/// `(loss, lse)` per row, in the arithmetic dtype: `loss = (1 - eps)(lse - x[t]) +
/// eps (lse - mean_j x[j])`, 0 for ignored rows; `lse` is the row's log-sum-exp.
pub(crate) fn cross_entropy(
    x: &CpuStorage,
    l: &Layout,
    target: &[i64],
    ignore: i64,
    eps: f64,
) -> Result<(CpuStorage, CpuStorage)> {
    let c = l.shape()[1];
    let valid = target
        .iter()
        .map(|&t| counted(t, c, ignore))
        .collect::<Result<Vec<bool>>>()?;
    fn lse<T: CpuElem>(row: &[T]) -> T::Acc {
        let m = row
            .iter()
            .fold(T::Acc::neg_infinity(), |m, v| m.max(v.to_acc()));
        if m == T::Acc::neg_infinity() {
            return m;
        }
        let s = row
            .iter()
            .fold(T::Acc::zero(), |s, v| s + (v.to_acc() - m).exp());
        m + s.ln()
    }
    fn go<T: CpuElem>(
        x: &[T],
        l: &Layout,
        c: usize,
        target: &[i64],
        valid: &[bool],
        eps: f64,
    ) -> (Vec<f64>, Vec<f64>) {
        let x = contiguous(x, l);
        let lses = per_row(&x, target.len(), c, |_, row| {
            lse(row).to_f64().unwrap_or(f64::NAN)
        });
        let eps_a = <T::Acc as num_traits::NumCast>::from(eps).expect("eps is finite");
        let cn = <T::Acc as num_traits::NumCast>::from(c).expect("class count fits");
        let loss = per_row(&x, target.len(), c, |r, row| {
            if !valid[r] {
                return 0.0;
            }
            let z = lse(row);
            let mut v = (T::Acc::one() - eps_a) * (z - row[target[r] as usize].to_acc());
            if eps > 0.0 {
                let sum = row.iter().fold(T::Acc::zero(), |s, v| s + v.to_acc());
                v += eps_a * (z - sum / cn);
            }
            v.to_f64().unwrap_or(f64::NAN)
        });
        (loss, lses)
    }
    let (loss, lses) = map_float!("cross_entropy", x, v => go(v, l, c, target, &valid, eps));
    Ok((acc_storage(x.dtype(), loss), acc_storage(x.dtype(), lses)))
}

/// The logits' gradient `[rows, C]` (contiguous, `x`'s dtype) from each row's incoming
/// gradient `g` (arithmetic dtype): `g (softmax - (1 - eps) onehot(t) - eps / C)`, 0 for
/// ignored rows.
#[allow(clippy::too_many_arguments)]
pub(crate) fn cross_entropy_backward(
    x: &CpuStorage,
    l: &Layout,
    target: &[i64],
    lse: &CpuStorage,
    g: &CpuStorage,
    lg: &Layout,
    ignore: i64,
    eps: f64,
) -> Result<CpuStorage> {
    let op = "cross_entropy backward";
    let (lse, g) = row_values(op, target.len(), lse, g, lg)?;
    let c = l.shape()[1];
    Ok(map_float!(op, x, v => {
        let mut out = contiguous(v, l).into_owned();
        grad_in_place(&mut out, c, target, &lse, &g, ignore, eps);
        CpuElem::wrap(out)
    }))
}

/// [`cross_entropy_backward`] written over the logits `x` themselves (row-major `[rows, C]`,
/// filling the storage), which the caller no longer needs.
#[allow(clippy::too_many_arguments)]
pub(crate) fn cross_entropy_backward_in_place(
    x: &mut CpuStorage,
    c: usize,
    target: &[i64],
    lse: &CpuStorage,
    g: &CpuStorage,
    lg: &Layout,
    ignore: i64,
    eps: f64,
) -> Result<()> {
    let op = "cross_entropy backward";
    let (lse, g) = row_values(op, target.len(), lse, g, lg)?;
    map_float!(op, x, v => grad_in_place(v, c, target, &lse, &g, ignore, eps));
    Ok(())
}

/// The forward's log-sum-exps and the rows' incoming gradients as f64.
fn row_values(
    op: &'static str,
    rows: usize,
    lse: &CpuStorage,
    g: &CpuStorage,
    lg: &Layout,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let lse = f64s(op, lse, &Layout::contiguous(&[rows]))?;
    Ok((lse, f64s(op, g, lg)?))
}

/// Overwrites each row of logits in `x` (`[rows, c]`, row-major) with its gradient (see
/// [`cross_entropy_backward`]); ignored rows become 0.
fn grad_in_place<T: CpuElem>(
    x: &mut [T],
    c: usize,
    target: &[i64],
    lse: &[f64],
    g: &[f64],
    ignore: i64,
    eps: f64,
) {
    if c == 0 {
        return; // No classes, no gradient to write.
    }
    let _iso = crate::parallel::Isolated::new();
    let num = |v: f64| <T::Acc as num_traits::NumCast>::from(v).expect("finite or inf");
    let (eps_a, off) = (num(eps), num(eps / c as f64));
    let job = |(r, row): (usize, &mut [T])| {
        let t = target[r];
        if t == ignore {
            row.fill(T::zero());
            return;
        }
        let (z, gr) = (num(lse[r]), num(g[r]));
        for (j, v) in row.iter_mut().enumerate() {
            let hot = if j as i64 == t {
                T::Acc::one() - eps_a
            } else {
                T::Acc::zero()
            };
            *v = T::from_acc(gr * ((v.to_acc() - z).exp() - hot - off));
        }
    };
    if x.len() >= PAR_MIN {
        x.par_chunks_mut(c).enumerate().for_each(job);
    } else {
        x.chunks_mut(c).enumerate().for_each(job);
    }
}
