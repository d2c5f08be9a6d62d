//! Launchers for `cuda/norm.cu`'s layer normalisation: one block per row of `cols`
//! contiguous elements, forward (output and per-row statistics) and backward (the input's
//! gradient).

use super::kernels::KernelFile;
use super::profile::elems;
use super::storage::{float_kname, same_dtype, CudaStorage, Dense};
use crate::layout::Layout;
use crate::{DType, Error, Result};
use cudarc::driver::{sys, PushKernelArg};

/// A vector operand's address in `x`'s dtype (a contiguous copy when it is a strided view),
/// or null.
fn vector_ptr<'a>(
    op: &'static str,
    x: &CudaStorage,
    v: Option<(&'a CudaStorage, &Layout)>,
) -> Result<(Option<Dense<'a>>, sys::CUdeviceptr)> {
    let Some((v, l)) = v else {
        return Ok((None, 0));
    };
    same_dtype(op, x, v)?;
    let d = v.contiguous(l)?;
    let p = d.ptr();
    Ok((Some(d), p))
}

/// Layer norm over rows of `cols` contiguous elements: `(y, stats)` with stats `[rows, 2]`
/// (mean, 1 / sqrt(var + eps)) in f32.
pub(crate) fn layer_norm(
    x: &CudaStorage,
    lx: &Layout,
    cols: usize,
    w: Option<(&CudaStorage, &Layout)>,
    b: Option<(&CudaStorage, &Layout)>,
    eps: f64,
) -> Result<(CudaStorage, CudaStorage)> {
    let op = "layer_norm";
    let t = float_kname(op, x.dtype())?;
    let x = x.contiguous(lx)?;
    let rows = lx.numel() / cols;
    let (_w, wp) = vector_ptr(op, &x, w)?;
    let (_b, bp) = vector_ptr(op, &x, b)?;
    let y = CudaStorage::alloc_on(x.rt(), x.dtype(), lx.numel())?;
    let stats = CudaStorage::alloc_on(x.rt(), DType::F32, 2 * rows)?;
    let (xp, yp, sp) = (x.ptr(), y.ptr(), stats.ptr());
    let (r64, c64, e32) = (rows as i64, cols as i64, eps as f32);
    let name = kname!("ln_forward_", t);
    let cfg = super::storage::rows_grid(rows);
    let vectors = [wp, bp].iter().filter(|&&p| p != 0).count() as u64;
    let bytes = 2 * elems(lx.numel(), x.dtype())
        + vectors * elems(cols, x.dtype())
        + elems(2 * rows, DType::F32);
    launch!(
        bytes = bytes;
        x, KernelFile::Norm, name, cfg, &xp, &wp, &bp, &yp, &sp, &r64, &c64, &e32
    );
    Ok((y, stats))
}

/// The input's gradient of [`layer_norm`] from the output's, the statistics and `w`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_norm_backward(
    dy: &CudaStorage,
    ld: &Layout,
    x: &CudaStorage,
    lx: &Layout,
    cols: usize,
    stats: &CudaStorage,
    w: Option<(&CudaStorage, &Layout)>,
) -> Result<CudaStorage> {
    let op = "layer_norm backward";
    let t = float_kname(op, x.dtype())?;
    same_dtype(op, dy, x)?;
    if stats.dtype() != DType::F32 {
        return Err(Error::DType {
            op,
            dtype: stats.dtype(),
            expected: "f32 statistics",
        });
    }
    let (dy, x) = (dy.contiguous(ld)?, x.contiguous(lx)?);
    let rows = lx.numel() / cols;
    let (_w, wp) = vector_ptr(op, &x, w)?;
    let dx = CudaStorage::alloc_on(x.rt(), x.dtype(), lx.numel())?;
    let (dp, xp, sp, op_) = (dy.ptr(), x.ptr(), stats.ptr(), dx.ptr());
    let (r64, c64) = (rows as i64, cols as i64);
    let name = kname!("ln_backward_", t);
    let cfg = super::storage::rows_grid(rows);
    let vectors = u64::from(wp != 0);
    let bytes = 3 * elems(lx.numel(), x.dtype())
        + vectors * elems(cols, x.dtype())
        + elems(2 * rows, DType::F32);
    launch!(
        bytes = bytes;
        x, KernelFile::Norm, name, cfg, &dp, &xp, &wp, &sp, &op_, &r64, &c64
    );
    Ok(dx)
}
