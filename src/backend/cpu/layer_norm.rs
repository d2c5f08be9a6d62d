//! Layer normalisation, fused: each row of `cols` elements normalised in one task while it is
//! in cache (mean from deviations to its first element, variance from deviations to the
//! mean, then the output), and its input gradient likewise (two row sums, then one pass).
//! Operands share one dtype; the statistics `[rows, 2]` (mean, 1 / sqrt(var + eps)) are f32
//! (f64 for f64).

use super::norm::stats_storage;
use super::{contiguous, map_float, CpuElem, CpuStorage, PAR_MIN};
use crate::backend::norm::{LnGrads, LnWant};
use crate::dtype::{Float, WithDType};
use crate::layout::Layout;
use crate::Result;
use num_traits::{Float as _, One, Zero};
use rayon::prelude::*;

/// The sum of `f(a[k], b[k], c[k])` over three rows of one length, in 16 lanes that
/// vectorise.
#[inline(always)]
fn sum3<T: WithDType>(
    a: &[T],
    b: &[T],
    c: &[T],
    f: impl Fn(T::Acc, T::Acc, T::Acc) -> T::Acc,
) -> T::Acc {
    let mut lanes = [T::Acc::zero(); 16];
    let (mut ia, mut ib, mut ic) = (a.chunks_exact(16), b.chunks_exact(16), c.chunks_exact(16));
    for ((x, y), z) in (&mut ia).zip(&mut ib).zip(&mut ic) {
        for (l, ((&x, &y), &z)) in lanes.iter_mut().zip(x.iter().zip(y).zip(z)) {
            *l += f(x.to_acc(), y.to_acc(), z.to_acc());
        }
    }
    let rest = ia
        .remainder()
        .iter()
        .zip(ib.remainder())
        .zip(ic.remainder());
    for (l, ((&x, &y), &z)) in lanes.iter_mut().zip(rest) {
        *l += f(x.to_acc(), y.to_acc(), z.to_acc());
    }
    lanes.iter().fold(T::Acc::zero(), |a, &b| a + b)
}

/// Runs `f(row_index, out_row, stat_row)` over the rows, in parallel when large.
fn each_row<T: Send, S: Send>(
    out: &mut [T],
    stats: &mut [S],
    cols: usize,
    per_stat: usize,
    f: impl Fn(usize, &mut [T], &mut [S]) + Sync + Send,
) {
    let _iso = crate::parallel::Isolated::new();
    if out.len() >= PAR_MIN {
        out.par_chunks_mut(cols)
            .zip(stats.par_chunks_mut(per_stat))
            .enumerate()
            .for_each(|(r, (o, s))| f(r, o, s));
    } else {
        out.chunks_mut(cols)
            .zip(stats.chunks_mut(per_stat))
            .enumerate()
            .for_each(|(r, (o, s))| f(r, o, s));
    }
}

fn same_dtype(op: &'static str, a: &CpuStorage, b: &CpuStorage) -> Result<()> {
    crate::backend::same_dtypes(op, a.dtype(), b.dtype())
}

/// `(y, stats)`: each row of `x` (`[rows, cols]` in order) normalised, times `w` plus `b`
/// (vectors of `cols`) when given.
pub(crate) fn layer_norm(
    x: &CpuStorage,
    lx: &Layout,
    cols: usize,
    w: Option<(&CpuStorage, &Layout)>,
    b: Option<(&CpuStorage, &Layout)>,
    eps: f64,
) -> Result<(CpuStorage, CpuStorage)> {
    fn go<T: CpuElem>(
        x: &[T],
        lx: &Layout,
        cols: usize,
        w: Option<(&CpuStorage, &Layout)>,
        b: Option<(&CpuStorage, &Layout)>,
        eps: f64,
    ) -> (CpuStorage, Vec<f64>) {
        let x = contiguous(x, lx);
        let vector = |v: Option<(&CpuStorage, &Layout)>| {
            v.map(|(s, l)| contiguous(T::slice(s).expect("checked dtype"), l).into_owned())
        };
        let rows = x.len() / cols;
        // Absent parameters are ones and zeros, so that one loop serves every case.
        let ones = || vec![T::from_f64(1.0); cols];
        let (w, b) = (
            vector(w).unwrap_or_else(ones),
            vector(b).unwrap_or_else(|| vec![T::from_f64(0.0); cols]),
        );
        let mut out = super::overwritten_buffer::<T>(x.len());
        let mut stats = vec![0.0f64; 2 * rows];
        let n = T::Acc::from_f64_(cols as f64);
        let eps = T::Acc::from_f64_(eps);
        each_row(&mut out, &mut stats, cols, 2, |r, o, st| {
            let xr = &x[r * cols..(r + 1) * cols];
            let pilot = xr[0].to_acc();
            let m = pilot + sum3(xr, xr, xr, |v, _, _| v - pilot) / n;
            let var = sum3(xr, xr, xr, |v, _, _| (v - m) * (v - m)) / n;
            let rstd = T::Acc::one() / (var + eps).sqrt();
            for (o, ((&v, &wk), &bk)) in o.iter_mut().zip(xr.iter().zip(&w).zip(&b)) {
                *o = T::from_acc((v.to_acc() - m) * rstd * wk.to_acc() + bk.to_acc());
            }
            st[0] = m.to_f64_();
            st[1] = rstd.to_f64_();
        });
        (T::wrap(out), stats)
    }
    for v in [w, b].into_iter().flatten() {
        same_dtype("layer_norm", x, v.0)?;
    }
    let (y, stats) = map_float!("layer_norm", x, v => go(v, lx, cols, w, b, eps));
    Ok((y, stats_storage(stats, x.dtype())))
}

/// Rows per group of the parameters' gradient sums: each group sums its rows in order, then
/// the groups' sums are added in order, so the result does not depend on the thread count.
const PARAM_ROWS: usize = 64;

/// Groups of [`PARAM_ROWS`] summed in parallel at a time.
const PARAM_BATCH: usize = 64;

/// The gradients of [`layer_norm`] from the output's (`dy`, laid out as `x`), the forward's
/// statistics and `w`, as `want` asks: the input's, per row `rstd (g - mean(g) - xhat
/// mean(g xhat))` with `g = dy w`; the weight's and bias's, the sums over the rows of
/// `dy xhat` and `dy` in the arithmetic dtype.
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_norm_backward(
    dy: &CpuStorage,
    ld: &Layout,
    x: &CpuStorage,
    lx: &Layout,
    cols: usize,
    stats: &CpuStorage,
    w: Option<(&CpuStorage, &Layout)>,
    want: LnWant,
) -> Result<LnGrads<CpuStorage>> {
    fn go<T: CpuElem>(
        d: &[T],
        ld: &Layout,
        x: &CpuStorage,
        lx: &Layout,
        cols: usize,
        stats: &[f64],
        w: Option<(&CpuStorage, &Layout)>,
        want: LnWant,
    ) -> LnGrads<CpuStorage> {
        let x = contiguous(T::slice(x).expect("checked dtype"), lx);
        let d = contiguous(d, ld);
        let rows = x.len() / cols;
        let row = |r: usize| {
            let (m, rstd) = (stats[2 * r], stats[2 * r + 1]);
            let span = r * cols..(r + 1) * cols;
            (
                &x[span.clone()],
                &d[span],
                T::Acc::from_f64_(m),
                T::Acc::from_f64_(rstd),
            )
        };
        let dx = want.dx.then(|| {
            let w = match w {
                Some((s, l)) => contiguous(T::slice(s).expect("checked dtype"), l).into_owned(),
                None => vec![T::from_f64(1.0); cols],
            };
            let mut out = super::overwritten_buffer::<T>(x.len());
            let mut unused = vec![(); rows];
            let n = T::Acc::from_f64_(cols as f64);
            each_row(&mut out, &mut unused, cols, 1, |r, o, _| {
                let (xr, dr, m, rstd) = row(r);
                let s1 = sum3(dr, &w, xr, |dv, wk, _| dv * wk) / n;
                let s2 = sum3(dr, &w, xr, |dv, wk, xv| dv * wk * (xv - m) * rstd) / n;
                for (o, ((&dv, &wk), &xv)) in o.iter_mut().zip(dr.iter().zip(&w).zip(xr)) {
                    let xhat = (xv.to_acc() - m) * rstd;
                    *o = T::from_acc(rstd * (dv.to_acc() * wk.to_acc() - s1 - xhat * s2));
                }
            });
            T::wrap(out)
        });
        let params = want.params.then(|| {
            // [dw | db] of one group of rows.
            let group = |g: usize| {
                let mut acc = vec![T::Acc::zero(); 2 * cols];
                let (dw, db) = acc.split_at_mut(cols);
                for r in g * PARAM_ROWS..((g + 1) * PARAM_ROWS).min(rows) {
                    let (xr, dr, m, rstd) = row(r);
                    for (((w, b), &dv), &xv) in dw.iter_mut().zip(db.iter_mut()).zip(dr).zip(xr) {
                        let dv = dv.to_acc();
                        *w += dv * (xv.to_acc() - m) * rstd;
                        *b += dv;
                    }
                }
                acc
            };
            let _iso = crate::parallel::Isolated::new();
            let mut sum = vec![T::Acc::zero(); 2 * cols];
            // The groups' sums made in parallel a batch at a time (so that what is held at
            // once does not grow with the rows), each batch's added in order.
            let groups = rows.div_ceil(PARAM_ROWS);
            for batch in (0..groups).step_by(PARAM_BATCH) {
                let ids = batch..(batch + PARAM_BATCH).min(groups);
                let parts: Vec<Vec<T::Acc>> = match x.len() >= PAR_MIN {
                    true => ids.into_par_iter().map(group).collect(),
                    false => ids.map(group).collect(),
                };
                for g in &parts {
                    for (s, &v) in sum.iter_mut().zip(g) {
                        *s += v;
                    }
                }
            }
            let (dw, db) = sum.split_at(cols);
            let out = |v: &[T::Acc]| T::wrap(v.iter().map(|&a| T::from_acc(a)).collect());
            (out(dw), out(db))
        });
        LnGrads { dx, params }
    }
    same_dtype("layer_norm backward", dy, x)?;
    if let Some((w, _)) = w {
        same_dtype("layer_norm backward", x, w)?;
    }
    let stats: Vec<f64> = map_float!("layer_norm backward", stats, v => {
        v.iter().map(|s| s.to_f64()).collect()
    });
    Ok(map_float!("layer_norm backward", dy, v => go(v, ld, x, lx, cols, &stats, w, want)))
}
