//! Batch normalisation's passes over a dense tensor seen as `[outer, channels, inner]`
//! ([`ChannelSplit`]): per-channel moments and gradient sums (the per-channel affine map that
//! gives both the output and the input gradient is in `norm_affine`, which reads the statistics
//! and the fused ReLU's gradient mask, `relu_masked`, from here). The whole batch norm is
//! two reads and a write forward, and three reads and a write backward, instead of the
//! composite's dozen passes.
//!
//! Work is split into blocks of whole `outer` rows of a fixed size (not by thread count), each
//! block reduced in the arithmetic type and the blocks combined in order in f64, so results do
//! not depend on the number of threads.

use super::{map_float, CpuElem, CpuStorage, PAR_MIN};
use crate::backend::norm::{BnForward, BnGrad, BnGradOut, BnSource, FusedRelu};
use crate::backend::spec::ChannelSplit;
use crate::dtype::{Float, WithDType};
use crate::layout::Layout;
use crate::{DType, Error, Result};
use num_traits::Zero;
use rayon::prelude::*;

/// Elements per reduction block (whole `outer` rows, at least one).
pub(super) const BLOCK: usize = 1 << 14;

/// The dtype normalisation statistics are kept in for inputs of `dtype` (both backends): f64
/// for f64, f32 otherwise.
pub(crate) fn stat_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

pub(crate) fn stats_storage(values: Vec<f64>, dtype: DType) -> CpuStorage {
    match stat_dtype(dtype) {
        DType::F64 => CpuStorage::F64(values),
        _ => CpuStorage::F32(values.into_iter().map(|v| v as f32).collect()),
    }
}

/// The sum of `f` over a contiguous run, in 16 independent lanes that vectorise.
#[inline(always)]
fn run_sum<T: Copy, A: Float>(run: &[T], f: impl Fn(T) -> A) -> A {
    let mut lanes = [A::zero(); 16];
    let mut it = run.chunks_exact(16);
    for c in &mut it {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l += f(x);
        }
    }
    for (l, &x) in lanes.iter_mut().zip(it.remainder()) {
        *l += f(x);
    }
    lanes.iter().fold(A::zero(), |a, &b| a + b)
}

/// Adds `f(c, x)` of each element of a block of whole rows to `acc[c]`.
#[inline(always)]
fn per_channel<T: Copy, A: Float>(
    s: ChannelSplit,
    block: &[T],
    acc: &mut [A],
    f: impl Fn(usize, T) -> A + Copy,
) {
    if s.inner == 1 {
        for row in block.chunks_exact(s.channels) {
            for (c, (a, &x)) in acc.iter_mut().zip(row).enumerate() {
                *a += f(c, x);
            }
        }
    } else {
        for row in block.chunks_exact(s.channels * s.inner) {
            for (c, (a, run)) in acc.iter_mut().zip(row.chunks_exact(s.inner)).enumerate() {
                *a += run_sum(run, |x| f(c, x));
            }
        }
    }
}

/// The blocks of `x` (whole rows of `s`), in order.
fn blocks<T>(s: ChannelSplit, x: &[T]) -> std::slice::Chunks<'_, T> {
    let row = (s.channels * s.inner).max(1);
    x.chunks((BLOCK / row).max(1) * row)
}

/// Runs `f` over the blocks of `x`, in parallel when large, and returns the results in order.
fn map_blocks<T: Sync, R: Send>(
    s: ChannelSplit,
    x: &[T],
    f: impl Fn(&[T]) -> R + Sync + Send,
) -> Vec<R> {
    let _iso = crate::parallel::Isolated::new();
    if x.len() >= PAR_MIN {
        blocks(s, x)
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(f)
            .collect()
    } else {
        blocks(s, x).map(f).collect()
    }
}

/// Per-channel mean and biased variance of `x` (`[2, channels]`, means first), in f32 (f64
/// for f64): each block's mean (from deviations to a pilot value) and sum of squared
/// deviations from it, two passes over the block while it is in cache, combined across
/// blocks with Chan's formula.
fn moments(x: &CpuStorage, l: &Layout) -> Result<Vec<f64>> {
    fn go<T: CpuElem>(x: &[T], s: ChannelSplit) -> Vec<f64> {
        let parts = map_blocks(s, x, |b| {
            let n = (b.len() / s.channels) as f64;
            // Sums of deviations from each channel's first element in the block: long sums
            // of values far from zero would lose the mean's low digits.
            let pilot: Vec<T::Acc> = (0..s.channels).map(|c| b[c * s.inner].to_acc()).collect();
            let mut sum = vec![T::Acc::zero(); s.channels];
            per_channel(s, b, &mut sum, |c, v: T| v.to_acc() - pilot[c]);
            let inv = T::Acc::from_f64_(1.0 / n);
            let mean: Vec<T::Acc> = sum.iter().zip(&pilot).map(|(&v, &p)| p + v * inv).collect();
            let mut m2 = vec![T::Acc::zero(); s.channels];
            per_channel(s, b, &mut m2, |c, v: T| {
                let d = v.to_acc() - mean[c];
                d * d
            });
            (n, mean, m2)
        });
        let c = s.channels;
        let (mut count, mut mean, mut m2) = (0.0f64, vec![0.0f64; c], vec![0.0f64; c]);
        for (n, bm, bm2) in parts {
            let total = count + n;
            for k in 0..c {
                let d = bm[k].to_f64_() - mean[k];
                mean[k] += d * n / total;
                m2[k] += bm2[k].to_f64_() + d * d * count * n / total;
            }
            count = total;
        }
        mean.extend(m2.iter().map(|v| v / count));
        mean
    }
    let s = ChannelSplit::of("batch_norm", l)?;
    if s.outer * s.inner == 0 {
        return Err(Error::Empty {
            op: "batch_norm",
            shape: l.shape().to_vec(),
        });
    }
    let range = dense_range(l);
    Ok(map_float!("batch_norm", x, v => go(&v[range], s)))
}

/// Per-channel `[sum dy, sum dy (x - mean)]` (`[2, channels]`) for the backward pass; `dy`
/// and `x` share one dense layout.
fn grad_sums(
    dy: &CpuStorage,
    ld: &Layout,
    x: &CpuStorage,
    lx: &Layout,
    mean: &[f64],
) -> Result<Vec<f64>> {
    fn go<T: CpuElem>(dy: &[T], x: &[T], s: ChannelSplit, mean: &[f64]) -> Vec<f64> {
        let _iso = crate::parallel::Isolated::new();
        let mean: Vec<T::Acc> = mean.iter().map(|&m| T::Acc::from_f64_(m)).collect();
        let rows = (s.channels * s.inner).max(1);
        let step = (BLOCK / rows).max(1) * rows;
        let starts: Vec<usize> = (0..dy.len()).step_by(step).collect();
        let part = |&start: &usize| {
            let end = (start + step).min(dy.len());
            let (db, xb) = (&dy[start..end], &x[start..end]);
            let mut sdy = vec![T::Acc::zero(); s.channels];
            let mut sdx = vec![T::Acc::zero(); s.channels];
            per_channel(s, db, &mut sdy, |_, v: T| v.to_acc());
            per_pair(s, db, xb, &mut sdx, &mean);
            (sdy, sdx)
        };
        let parts: Vec<_> = if dy.len() >= PAR_MIN {
            starts.par_iter().map(part).collect()
        } else {
            starts.iter().map(part).collect()
        };
        let c = s.channels;
        let mut out = vec![0.0f64; 2 * c];
        for (sdy, sdx) in parts {
            for k in 0..c {
                out[k] += sdy[k].to_f64_();
                out[c + k] += sdx[k].to_f64_();
            }
        }
        out
    }
    let s = ChannelSplit::of_pair("batch_norm backward", ld, lx)?;
    let (rd, rx) = (dense_range(ld), dense_range(lx));
    let sums = match (dy, x) {
        (CpuStorage::F32(d), CpuStorage::F32(v)) => go(&d[rd], &v[rx], s, mean),
        (CpuStorage::F16(d), CpuStorage::F16(v)) => go(&d[rd], &v[rx], s, mean),
        (CpuStorage::BF16(d), CpuStorage::BF16(v)) => go(&d[rd], &v[rx], s, mean),
        (CpuStorage::F64(d), CpuStorage::F64(v)) => go(&d[rd], &v[rx], s, mean),
        (d, v) => {
            return Err(Error::DTypeMismatch {
                op: "batch_norm backward",
                lhs: d.dtype(),
                rhs: v.dtype(),
            })
        }
    };
    Ok(sums)
}

/// [`crate::backend::NormOps::batch_norm_stats`]: the statistics (the batch's or the running
/// ones) turned into `[a | mean | b | invstd | var]` in f64, and the running statistics and
/// batch counter updated, as `bn_finalize` (cuda/norm.cu) does in modes 0 and 1.
pub(crate) fn batch_norm_stats(
    x: &CpuStorage,
    lx: &Layout,
    p: BnForward<'_, CpuStorage>,
) -> Result<CpuStorage> {
    let s = ChannelSplit::of("batch_norm", lx)?;
    let c = s.channels;
    let (mean, var) = match &p.source {
        BnSource::Batch { .. } => {
            let m = moments(x, lx)?;
            (m[..c].to_vec(), m[c..].to_vec())
        }
        BnSource::Running(m, v) => (whole_values(m, c)?, whole_values(v, c)?),
    };
    let vector = |v: Option<(&CpuStorage, &Layout)>| v.map(|(v, l)| stat_values(v, l)).transpose();
    let (w, b) = (vector(p.weight)?, vector(p.bias)?);
    let mut out = vec![0.0f64; 5 * c];
    for k in 0..c {
        let invstd = 1.0 / (var[k] + p.eps).sqrt();
        out[k] = invstd * w.as_ref().map_or(1.0, |w| w[k]);
        out[c + k] = mean[k];
        out[2 * c + k] = b.as_ref().map_or(0.0, |b| b[k]);
        out[3 * c + k] = invstd;
        out[4 * c + k] = var[k];
    }
    if let BnSource::Batch {
        running,
        tracked,
        momentum,
        ..
    } = p.source
    {
        let count = (s.outer * s.inner) as f64;
        if let Some((rm, rv)) = running {
            update_whole(rm, c, |k, r| (1.0 - momentum) * r + momentum * mean[k])?;
            let unbias = count / (count - 1.0);
            update_whole(rv, c, |k, r| {
                (1.0 - momentum) * r + momentum * var[k] * unbias
            })?;
        }
        match tracked {
            None => {}
            Some(CpuStorage::I64(t)) if t.len() == 1 => t[0] += 1,
            Some(t) => {
                return Err(Error::invalid(
                    "batch_norm",
                    format!(
                        "num_batches_tracked must be one i64, got {} {:?}",
                        t.len(),
                        t.dtype()
                    ),
                ))
            }
        }
    }
    Ok(stats_storage(out, x.dtype()))
}

/// [`crate::backend::NormOps::batch_norm_grad`]: `bn_finalize`'s modes 2 to 4 in f64.
#[allow(clippy::too_many_arguments)]
pub(crate) fn batch_norm_grad(
    dy: &CpuStorage,
    ld: &Layout,
    x: &CpuStorage,
    lx: &Layout,
    stats: &CpuStorage,
    ls: &Layout,
    mode: BnGrad,
    relu: FusedRelu<'_, CpuStorage>,
) -> Result<BnGradOut<CpuStorage>> {
    // A fused ReLU's masked gradient, made once where the sums read it; it comes back, so the
    // affine pass reads it instead of masking dy again.
    let masked = match mode {
        BnGrad::EvalInputOnly => None,
        _ => relu_masked(dy, ld, (x, lx), relu)?,
    };
    let (dy, ld) = masked.as_ref().map_or((dy, ld), |(d, l)| (d, l));
    let s = ChannelSplit::of_pair("batch_norm backward", ld, lx)?;
    let c = s.channels;
    let st = stat_values(stats, ls)?;
    if st.len() != 5 * c {
        return Err(Error::invalid(
            "batch_norm backward",
            format!("statistics of {} values for {c} channels", st.len()),
        ));
    }
    let (a, mean, invstd) = (&st[..c], &st[c..2 * c], &st[3 * c..4 * c]);
    let sums = match mode {
        BnGrad::EvalInputOnly => None,
        _ => Some(grad_sums(dy, ld, x, lx, mean)?),
    };
    let count = (s.outer * s.inner) as f64;
    let train = mode == BnGrad::Train;
    let mut coef = vec![0.0f64; 4 * c];
    for k in 0..c {
        let (sdy, sdx) = sums.as_ref().map_or((0.0, 0.0), |v| (v[k], v[c + k]));
        if train {
            coef[k] = -a[k] * invstd[k] * invstd[k] * sdx / count;
            coef[2 * c + k] = -a[k] * sdy / count;
        }
        coef[c + k] = mean[k];
        coef[3 * c + k] = a[k];
    }
    let params = sums.map(|v| {
        let dw = (0..c).map(|k| v[c + k] * invstd[k]).collect();
        let db = v[..c].to_vec();
        (stats_storage(dw, x.dtype()), stats_storage(db, x.dtype()))
    });
    Ok(BnGradOut {
        coef: stats_storage(coef, x.dtype()),
        params,
        masked: masked.map(|(m, _)| m),
    })
}

/// The `c` values of a whole statistics storage, as f64.
fn whole_values(v: &CpuStorage, c: usize) -> Result<Vec<f64>> {
    if v.len() != c {
        return Err(Error::invalid(
            "batch_norm",
            format!("running statistics of {} values for {c} channels", v.len()),
        ));
    }
    stat_values(v, &Layout::contiguous(&[c]))
}

/// `v[k] = f(k, v[k])` over a whole f32 or f64 storage of `c` values.
fn update_whole(v: &mut CpuStorage, c: usize, f: impl Fn(usize, f64) -> f64) -> Result<()> {
    match v {
        CpuStorage::F32(v) if v.len() == c => {
            for (k, r) in v.iter_mut().enumerate() {
                *r = f(k, f64::from(*r)) as f32;
            }
        }
        CpuStorage::F64(v) if v.len() == c => {
            for (k, r) in v.iter_mut().enumerate() {
                *r = f(k, *r);
            }
        }
        v => {
            return Err(Error::invalid(
                "batch_norm",
                format!(
                    "running statistics must be {c} f32 or f64 values, got {} {:?}",
                    v.len(),
                    v.dtype()
                ),
            ))
        }
    }
    Ok(())
}

/// Adds `dy (x - mean[c])` of a block to `acc[c]`.
#[inline(always)]
fn per_pair<T: WithDType>(s: ChannelSplit, dy: &[T], x: &[T], acc: &mut [T::Acc], mean: &[T::Acc]) {
    if s.inner == 1 {
        for (dr, xr) in dy.chunks_exact(s.channels).zip(x.chunks_exact(s.channels)) {
            for (((a, &d), &v), &m) in acc.iter_mut().zip(dr).zip(xr).zip(mean) {
                *a += d.to_acc() * (v.to_acc() - m);
            }
        }
        return;
    }
    let row = s.channels * s.inner;
    for (dr, xr) in dy.chunks_exact(row).zip(x.chunks_exact(row)) {
        let runs = dr.chunks_exact(s.inner).zip(xr.chunks_exact(s.inner));
        for (c, (dd, xx)) in runs.enumerate() {
            let m = mean[c];
            let mut lanes = [T::Acc::zero(); 16];
            let (mut di, mut xi) = (dd.chunks_exact(16), xx.chunks_exact(16));
            for (d16, x16) in (&mut di).zip(&mut xi) {
                for ((l, &d), &v) in lanes.iter_mut().zip(d16).zip(x16) {
                    *l += d.to_acc() * (v.to_acc() - m);
                }
            }
            for ((l, &d), &v) in lanes.iter_mut().zip(di.remainder()).zip(xi.remainder()) {
                *l += d.to_acc() * (v.to_acc() - m);
            }
            acc[c] += lanes.iter().fold(T::Acc::zero(), |a, &b| a + b);
        }
    }
}

/// The storage range a dense layout covers.
pub(super) fn dense_range(l: &Layout) -> std::ops::Range<usize> {
    l.offset()..l.offset() + l.numel()
}

/// A statistics vector's values as f64 (any float dtype).
pub(super) fn stat_values(s: &CpuStorage, l: &Layout) -> Result<Vec<f64>> {
    Ok(map_float!("batch_norm", s, v => super::elementwise::map1(v, l, |x| x.to_f64())))
}

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
