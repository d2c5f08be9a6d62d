//! Launchers for `cuda/amp.cu`: the loss scaler's unscale with its overflow check (one pass
//! per gradient) and its scale update (one thread), on device scalars: no host read.
//!
//! `tests/host_kernels/amp.rs` runs the kernels on the host against the CPU backend.

use super::kernels::KernelFile;
use super::storage::{grid, kname, one_thread, CudaStorage};
use crate::{DType, Error, Result};
use cudarc::driver::PushKernelArg;

/// Checks that `s` is the one-element f32 storage the scaler keeps its values in.
fn scalar(op: &'static str, s: &CudaStorage) -> Result<()> {
    if s.dtype() != DType::F32 || s.len() != 1 {
        return Err(Error::invalid(
            op,
            format!(
                "needs a one-element f32 tensor, got {} elements of {:?}",
                s.len(),
                s.dtype()
            ),
        ));
    }
    Ok(())
}

/// Every element of `g` (in storage order) times `inv_scale`, as `out`; sets `found_inf` to 1
/// when an element is inf or NaN. Kernels exist for every pair the scaler asks for: f32 and
/// bf16 into their own dtype, and f16/bf16 into f32 (master weights).
pub(crate) fn unscale_grad(
    g: &CudaStorage,
    inv_scale: &CudaStorage,
    found_inf: &CudaStorage,
    out: DType,
) -> Result<CudaStorage> {
    const OP: &str = "GradScaler::unscale_";
    scalar(OP, inv_scale)?;
    scalar(OP, found_inf)?;
    let supported = matches!(
        (g.dtype(), out),
        (DType::F32, DType::F32)
            | (DType::BF16, DType::BF16)
            | (DType::F16, DType::F32)
            | (DType::BF16, DType::F32)
    );
    if !supported {
        return Err(Error::DType {
            op: OP,
            dtype: g.dtype(),
            expected: "f32 or bf16 gradients unscaled into their own dtype, or f16/bf16 into f32",
        });
    }
    let name = format!("amp_unscale_{}_{}", kname(OP, g.dtype())?, kname(OP, out)?);
    let o = CudaStorage::alloc_on(g.rt(), out, g.len())?;
    let (gp, op, ip, fp, n) = (
        g.ptr(),
        o.ptr(),
        inv_scale.ptr(),
        found_inf.ptr(),
        g.len() as i64,
    );
    launch!(
        g,
        KernelFile::Amp,
        name,
        grid(g.len()),
        &gp,
        &op,
        &ip,
        &fp,
        &n
    );
    Ok(o)
}

/// PyTorch's `_amp_update_scale_` on the device scalars `scale` and `tracker`.
pub(crate) fn update_scale(
    scale: &CudaStorage,
    tracker: &CudaStorage,
    found_inf: &CudaStorage,
    growth: f32,
    backoff: f32,
    interval: i32,
) -> Result<()> {
    const OP: &str = "GradScaler::update";
    for s in [scale, tracker, found_inf] {
        scalar(OP, s)?;
    }
    let (sp, tp, fp) = (scale.ptr(), tracker.ptr(), found_inf.ptr());
    let name = "amp_update_scale".to_string();
    launch!(
        scale,
        KernelFile::Amp,
        name,
        one_thread(),
        &sp,
        &tp,
        &fp,
        &growth,
        &backoff,
        &interval
    );
    Ok(())
}
