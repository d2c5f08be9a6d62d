//! Gradient clipping by global norm, and the multi-tensor gradient scaling it shares with the
//! loss scaler.

use crate::backend::spec::Taken;
use crate::backend::{Span, Storage};
use crate::layout::Layout;
use crate::{DType, Error, Result, Tensor};
use std::ops::Range;
use std::sync::Arc;

/// Scales the gradients of `params` so that their global L2 norm is at most `max_norm`, and
/// returns the norm before clipping (a 0-d f32 tensor; `.item()` reads it).
///
/// PyTorch's `clip_grad_norm_` with its foreach kernels: the sum of squares of every gradient
/// in one pass per dtype and list of gradients (accumulated in f32, f64 on the CPU, joined in
/// a fixed order), and the scaling by `min(1, max_norm / (norm + 1e-6))` in one more; the
/// coefficient stays on the device (no host read). f64 gradients take a per-tensor path.
///
/// ```
/// use mantissa::{Tensor, Device, optim::clip_grad_norm};
/// let p = Tensor::from_vec(vec![0.0f32, 0.0], &[2], Device::Cpu)?.requires_grad(true)?;
/// p.set_grad(Some(Tensor::from_vec(vec![3.0f32, 4.0], &[2], Device::Cpu)?))?;
/// let norm = clip_grad_norm(&[p.clone()], 1.0)?;
/// assert_eq!(norm.item()?, 5.0);
/// assert!((p.grad().unwrap().to_vec::<f32>()?[1] - 0.8).abs() < 1e-6);
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> Result<Tensor> {
    if max_norm.is_nan() || max_norm <= 0.0 {
        return Err(Error::invalid(
            "clip_grad_norm",
            format!("max_norm {max_norm} must be positive"),
        ));
    }
    crate::no_grad(|| {
        let device = params.first().map(|p| p.device()).unwrap_or_default();
        let with_grad: Vec<(&Tensor, Tensor)> = params
            .iter()
            .filter_map(|p| p.grad().map(|g| (p, g)))
            .collect();
        if with_grad.is_empty() {
            return Tensor::zeros(&[], DType::F32, device);
        }
        let listed = |d: DType| matches!(d, DType::F32 | DType::F16 | DType::BF16);
        if !with_grad.iter().all(|(_, g)| listed(g.dtype())) {
            return clip_per_tensor(&with_grad, max_norm, device);
        }
        let grads = with_grad
            .iter()
            .map(|(_, g)| in_storage_order(g.clone()))
            .collect::<Result<Vec<_>>>()?;
        let total = {
            let storages: Vec<_> = grads.iter().map(|g| g.storage()).collect();
            let spans = spans("clip_grad_norm", &grads, &storages)?;
            Tensor::from_storage(Storage::sum_squares(&spans)?, &[])
        };
        let norm = total.sqrt()?;
        // coef = min(1, max_norm / (norm + 1e-6)), applied without reading the norm back.
        let coef = norm.add(1e-6)?.recip()?.mul(max_norm)?.minimum(1.0)?;
        // The scaler's multi-tensor pass scales them all; its overflow flag is not wanted.
        let flag = Tensor::zeros(&[], DType::F32, device)?;
        let params: Vec<&Tensor> = with_grad.iter().map(|(p, _)| *p).collect();
        scale_grads("clip_grad_norm", &params, &grads, &coef, &flag, None)?;
        Ok(norm)
    })
}

/// Multiplies the gradients `grads` of `params` (each one dense range of its storage: see
/// [`in_storage_order`]) by the f32 scalar `factor`, a device tensor, in one multi-tensor pass
/// per dtype, and sets `flag` (an f32 scalar) to 1 when an element is inf or NaN. In place,
/// as PyTorch's foreach kernels: whoever holds a gradient sees it change, and gradients that
/// are views of one buffer (a data-parallel bucket) are scaled where they lie. A gradient
/// that is not its parameter's own (`in_storage_order` copied it), or whose range another
/// listed gradient's overlaps (one gradient shared by two parameters), is scaled as a copy
/// of its own that becomes the parameter's gradient. With `out` (master weights: f32), every
/// gradient becomes a new one of that dtype.
pub(crate) fn scale_grads(
    op: &'static str,
    params: &[&Tensor],
    grads: &[Tensor],
    factor: &Tensor,
    flag: &Tensor,
    out: Option<DType>,
) -> Result<()> {
    if let Some(out) = out {
        let scaled = {
            let storages: Vec<_> = grads.iter().map(|g| g.storage()).collect();
            let spans = spans(op, grads, &storages)?;
            Tensor::write_many(op, &[flag], |f| {
                Storage::unscale_grads(&spans, &factor.storage(), f[0], out)
            })?
        };
        for ((p, g), s) in params.iter().zip(grads).zip(scaled) {
            // The new storage holds the gradient's range alone: its strides from offset 0.
            let l = Layout::new(g.shape().to_vec(), g.strides().to_vec(), 0);
            p.set_grad(Some(Tensor::from_storage_in(s, l)))?;
        }
        return Ok(());
    }
    let mut taken = Taken::default();
    let mut owned: Vec<(Tensor, Range<usize>)> = Vec::with_capacity(grads.len());
    for (p, g) in params.iter().zip(grads) {
        let r = dense(op, g)?;
        let (g, r) = match taken.take(g.storage_addr(), &r) {
            true => (g.clone(), r),
            false => {
                let own = own_copy(g, &r)?;
                let whole = 0..own.numel();
                taken.take(own.storage_addr(), &whole);
                (own, whole)
            }
        };
        let is_own = p
            .grad()
            .is_some_and(|h| h.shares_storage(&g) && h.layout() == g.layout());
        if !is_own {
            p.set_grad(Some(g.clone()))?;
        }
        owned.push((g, r));
    }
    // Each storage once among the written tensors (after the flag); each range names its
    // storage's place there.
    let mut written = vec![flag];
    let mut place: std::collections::HashMap<usize, usize> = Default::default();
    let mut ranges = Vec::with_capacity(owned.len());
    for (g, r) in &owned {
        let k = *place.entry(g.storage_addr()).or_insert_with(|| {
            written.push(g);
            written.len() - 2
        });
        ranges.push((k, r.clone()));
    }
    Tensor::write_many(op, &written, |w| {
        let (flag, grads) = w.split_first_mut().expect("the flag comes first");
        Storage::unscale_grads_(grads, &ranges, &factor.storage(), flag)
    })
}

/// The range of its storage gradient `g` fills densely (an `Err` naming `op` for one that
/// [`in_storage_order`] did not give).
fn dense(op: &'static str, g: &Tensor) -> Result<Range<usize>> {
    g.dense_range().ok_or_else(|| {
        Error::invalid(
            op,
            format!(
                "a gradient of shape {:?} and strides {:?} is not dense",
                g.shape(),
                g.strides()
            ),
        )
    })
}

/// Each gradient of `grads` as its range of its storage (`storages`, read from them).
fn spans<'a>(
    op: &'static str,
    grads: &[Tensor],
    storages: &'a [Arc<Storage>],
) -> Result<Vec<Span<'a, Storage>>> {
    grads
        .iter()
        .zip(storages)
        .map(|(g, s)| {
            Ok(Span {
                storage: &**s,
                range: dense(op, g)?,
            })
        })
        .collect()
}

/// A copy of range `r` of `g`'s storage (`g`'s elements) in a storage of its own, seen with
/// `g`'s strides.
fn own_copy(g: &Tensor, r: &Range<usize>) -> Result<Tensor> {
    let flat = Layout::new(vec![r.len()], vec![1], r.start);
    let s = g.storage().copy_strided(&flat)?;
    let l = Layout::new(g.shape().to_vec(), g.strides().to_vec(), 0);
    Ok(Tensor::from_storage_in(s, l))
}

/// [`clip_grad_norm`] a gradient at a time, for dtypes the multi-tensor passes do not take.
fn clip_per_tensor(
    with_grad: &[(&Tensor, Tensor)],
    max_norm: f64,
    device: crate::Device,
) -> Result<Tensor> {
    let mut total = Tensor::zeros(&[], DType::F32, device)?;
    for (_, g) in with_grad {
        total = total.add(&g.to_dtype(DType::F32)?.sqr()?.sum_all()?)?;
    }
    let norm = total.sqrt()?;
    let coef = norm.add(1e-6)?.recip()?.mul(max_norm)?.minimum(1.0)?;
    for (p, g) in with_grad {
        p.set_grad(Some(g.mul(&coef.to_dtype(g.dtype())?)?))?;
    }
    Ok(norm)
}

/// `g`, or a copy of it, whose elements fill one range of its storage in a dense order (its
/// memory format kept; the storage may hold more, as a data-parallel bucket does): what the
/// multi-tensor passes walk, element by element, without a copy.
pub(crate) fn in_storage_order(g: Tensor) -> Result<Tensor> {
    match g.dense_range() {
        Some(_) => Ok(g),
        None => g.copy(),
    }
}
