//! The loss scaler's two fused steps, as `cuda/amp.cu` runs them on the GPU: PyTorch's
//! `_amp_foreach_non_finite_check_and_unscale_` (one gradient at a time) and
//! `_amp_update_scale_`.

use super::{overwritten_buffer, CpuElem, CpuStorage, CHUNK};
use crate::dtype::Float;
use crate::{DType, Error, Result};
use half::{bf16, f16};
use rayon::prelude::*;
use std::ops::Range;

/// The sum of the squares of elements `range` of `g`, in f64: per chunk in parallel, the
/// chunks joined in order (the same bits whatever the thread count).
pub(crate) fn sum_squares(g: &CpuStorage, range: Range<usize>) -> Result<f64> {
    fn go<S: CpuElem>(v: &[S]) -> f64 {
        let _iso = crate::parallel::Isolated::new();
        let parts: Vec<f64> = v
            .par_chunks(CHUNK)
            .map(|c| {
                c.iter()
                    .map(|x| {
                        let x = x.to_acc().to_f64_();
                        x * x
                    })
                    .sum()
            })
            .collect();
        parts.iter().sum()
    }
    Ok(super::map_float!("clip_grad_norm", g, v => go(&v[range])))
}

/// Elements `range` of `g` (in storage order) times `inv_scale`, computed in the element's
/// arithmetic type (f32 for f32/f16/bf16) and stored as `out`, which is `g`'s dtype or f32,
/// in a new storage of the range's length; and whether any of them is inf or NaN.
pub(crate) fn unscale(
    g: &CpuStorage,
    range: Range<usize>,
    inv_scale: f32,
    out: DType,
) -> Result<(CpuStorage, bool)> {
    fn go<S: CpuElem, D: CpuElem + bytemuck::Pod>(v: &[S], inv: f32) -> (CpuStorage, bool) {
        let _iso = crate::parallel::Isolated::new();
        let inv = <S::Acc as Float>::from_f64_(inv as f64);
        let mut out = overwritten_buffer::<D>(v.len());
        let bad = out
            .par_chunks_mut(CHUNK)
            .zip(v.par_chunks(CHUNK))
            .map(|(o, s)| {
                let mut bad = false;
                for (o, s) in o.iter_mut().zip(s) {
                    let x = s.to_acc();
                    bad |= !num_traits::Float::is_finite(x);
                    // The product in the arithmetic type, rounded once into `D` (the widening
                    // to f64 is exact).
                    *o = D::from_f64((x * inv).to_f64_());
                }
                bad
            })
            .reduce(|| false, |a, b| a | b);
        (D::wrap(out), bad)
    }
    Ok(match (g, out) {
        (CpuStorage::F32(v), DType::F32) => go::<f32, f32>(&v[range], inv_scale),
        (CpuStorage::F16(v), DType::F16) => go::<f16, f16>(&v[range], inv_scale),
        (CpuStorage::F16(v), DType::F32) => go::<f16, f32>(&v[range], inv_scale),
        (CpuStorage::BF16(v), DType::BF16) => go::<bf16, bf16>(&v[range], inv_scale),
        (CpuStorage::BF16(v), DType::F32) => go::<bf16, f32>(&v[range], inv_scale),
        (CpuStorage::F64(v), DType::F64) => go::<f64, f64>(&v[range], inv_scale),
        (g, _) => {
            return Err(Error::DType {
                op: "GradScaler::unscale_",
                dtype: g.dtype(),
                expected: "a float gradient, unscaled into its own dtype or into f32",
            })
        }
    })
}

/// [`unscale`] in place over elements `range` of `g`, in `g`'s own dtype (the same products,
/// rounded once); whether any of them was inf or NaN.
pub(crate) fn unscale_in_place(
    g: &mut CpuStorage,
    range: Range<usize>,
    inv_scale: f32,
) -> Result<bool> {
    fn go<S: CpuElem>(v: &mut [S], inv: f32) -> bool {
        let _iso = crate::parallel::Isolated::new();
        let inv = <S::Acc as Float>::from_f64_(inv as f64);
        v.par_chunks_mut(CHUNK)
            .map(|c| {
                let mut bad = false;
                for s in c.iter_mut() {
                    let x = s.to_acc();
                    bad |= !num_traits::Float::is_finite(x);
                    *s = S::from_f64((x * inv).to_f64_());
                }
                bad
            })
            .reduce(|| false, |a, b| a | b)
    }
    Ok(match g {
        CpuStorage::F32(v) => go(&mut v[range], inv_scale),
        CpuStorage::F16(v) => go(&mut v[range], inv_scale),
        CpuStorage::BF16(v) => go(&mut v[range], inv_scale),
        CpuStorage::F64(v) => go(&mut v[range], inv_scale),
        g => {
            return Err(Error::DType {
                op: "GradScaler::unscale_",
                dtype: g.dtype(),
                expected: "a float gradient",
            })
        }
    })
}

/// PyTorch's `_amp_update_scale_`: back off and restart the count after an overflow; else
/// count a clean step and, every `interval` of them, grow the scale (kept only when finite).
pub(crate) fn update_scale(
    scale: &mut f32,
    tracker: &mut f32,
    found_inf: f32,
    growth: f32,
    backoff: f32,
    interval: i32,
) {
    if found_inf != 0.0 {
        *scale *= backoff;
        *tracker = 0.0;
        return;
    }
    let next = *tracker + 1.0;
    if next >= interval as f32 {
        let grown = *scale * growth;
        if grown.is_finite() {
            *scale = grown;
        }
        *tracker = 0.0;
    } else {
        *tracker = next;
    }
}

/// The value of a 0-d f32 storage (the scaler's scale, tracker and flag).
pub(crate) fn scalar_f32(s: &CpuStorage, op: &'static str) -> Result<f32> {
    match s {
        CpuStorage::F32(v) if v.len() == 1 => Ok(v[0]),
        other => Err(Error::invalid(
            op,
            format!(
                "needs a one-element f32 tensor, got {} elements of {:?}",
                other.len(),
                other.dtype()
            ),
        )),
    }
}
