//! Every op a backend runs through the host instead of a kernel of its own, in one place:
//! the operands are downloaded whole, the CPU backend's kernel runs on them, and what it
//! wrote is uploaded back (correct, and slow: a transfer each way). A backend calls these
//! from its trait implementation for the cases it has no kernel for:
//!
//! | op | CUDA runs it here for |
//! |----|-----------------------|
//! | [`scatter_add`], [`index_add`] | integer dtypes (the kernels sum floats with atomics) |
//! | [`optim_update`] | dtype combinations the fused kernels do not cover |
//! | [`round_from_master`] | working copies the rounding kernel does not cover |
//! | [`normal`] | f64 (the normal kernels draw f32, f16 and bf16) |

use super::ops::OptimUpdate;
use super::rounding::Rounding;
use super::{cpu, host, BackendStorage, CpuStorage, Span};
use crate::layout::Layout;
use crate::Result;

/// Replaces `dst`'s contents with the host storage `h` on `dst`'s device.
fn upload<B: BackendStorage>(dst: &mut B, h: CpuStorage) -> Result<()> {
    let whole = Layout::contiguous(&[h.len()]);
    *dst = B::from_host(&h, &whole, dst.device())?;
    Ok(())
}

/// [`super::IndexOps::scatter_add`] on the host.
pub(crate) fn scatter_add<B: BackendStorage>(
    dst: &mut B,
    shape: &[usize],
    dim: usize,
    (idx, il): (&B, &Layout),
    (src, sl): (&B, &Layout),
) -> Result<()> {
    let (s, i) = (src.host()?, idx.host()?);
    let ids = host::indices("scatter_add", &i, il, dim, shape[dim])?;
    let mut d = dst.host()?.into_owned();
    cpu::scatter_add(&mut d, shape, dim, &ids, il.shape(), &s, sl)?;
    upload(dst, d)
}

/// [`super::IndexOps::index_add`] on the host.
pub(crate) fn index_add<B: BackendStorage>(
    dst: &mut B,
    shape: &[usize],
    dim: usize,
    (idx, il): (&B, &Layout),
    (src, sl): (&B, &Layout),
) -> Result<()> {
    let (s, i) = (src.host()?, idx.host()?);
    let ids = host::indices("index_add", &i, il, dim, shape[dim])?;
    let mut d = dst.host()?.into_owned();
    cpu::index_add(&mut d, shape, dim, &ids, &s, sl)?;
    upload(dst, d)
}

/// [`super::OptimOps::optim_update`] on host copies of every operand (of the gradient, its
/// range), written back.
pub(crate) fn optim_update<B: BackendStorage>(
    p: &mut B,
    grad: Span<'_, B>,
    states: &mut [&mut B],
    step: &mut B,
    found_inf: Option<&B>,
    u: &OptimUpdate,
    working: Option<(&mut B, Rounding)>,
) -> Result<()> {
    let range = Layout::new(vec![grad.len()], vec![1], grad.range.start);
    let g = grad.storage.to_host(&range)?;
    let found = match found_inf {
        Some(f) => Some(f.host()?),
        None => None,
    };
    let mut hp = p.host()?.into_owned();
    let mut hstep = step.host()?.into_owned();
    let mut hs: Vec<CpuStorage> = states
        .iter()
        .map(|s| s.host().map(|h| h.into_owned()))
        .collect::<Result<_>>()?;
    let (mut hw, r) = match &working {
        Some((w, r)) => (Some(w.host()?.into_owned()), Some(*r)),
        None => (None, None),
    };
    {
        let mut refs: Vec<&mut CpuStorage> = hs.iter_mut().collect();
        let wk = hw.as_mut().zip(r);
        let g = Span::whole(&g, g.len());
        cpu::optim_update(&mut hp, g, &mut refs, &mut hstep, found.as_deref(), u, wk)?;
    }
    upload(p, hp)?;
    upload(step, hstep)?;
    for (s, h) in states.iter_mut().zip(hs) {
        upload(&mut **s, h)?;
    }
    if let (Some((dst, _)), Some(h)) = (working, hw) {
        upload(dst, h)?;
    }
    Ok(())
}

/// [`super::OptimOps::round_from_master`] on the host.
pub(crate) fn round_from_master<B: BackendStorage>(
    dst: &mut B,
    master: &B,
    rounding: Rounding,
    step: &B,
) -> Result<()> {
    let (m, st) = (master.host()?, step.host()?);
    let mut d = dst.host()?.into_owned();
    cpu::round_into(&mut d, &m, rounding, &st)?;
    upload(dst, d)
}

/// [`super::CopyOps::normal`] on the host, uploaded to `device`.
pub(crate) fn normal<B: BackendStorage>(
    device: crate::Device,
    n: usize,
    mean: f64,
    std: f64,
    stream: (u64, u64),
    dtype: crate::DType,
) -> Result<B> {
    let h = cpu::normal(n, mean, std, stream, dtype)?;
    B::from_host(&h, &Layout::contiguous(&[n]), device)
}
