//! Launchers for `cuda/norm.cu`'s layer normalisation: one block per row of `cols`
//! contiguous elements, forward (output and per-row statistics; also after a residual add, in
//! the same kernel) and backward (the input's gradient, and the parameters').

use super::kernels::KernelFile;
use super::profile::elems;
use super::storage::{float_kname, grid, same_dtype, CudaStorage, Dense};
use crate::backend::norm::{LnGrads, LnWant};
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

/// The residual add `x + r` and the layer norm of the sum in one kernel: `(sum, y, stats)`.
/// `r` has `x`'s dtype or, with an f32 `x`, f16 or bf16 (added as the composed add promotes
/// it); `None` for another pair of dtypes (the caller composes the ops).
#[allow(clippy::too_many_arguments)]
pub(crate) fn add_layer_norm(
    x: &CudaStorage,
    lx: &Layout,
    (r, lr): (&CudaStorage, &Layout),
    cols: usize,
    w: Option<(&CudaStorage, &Layout)>,
    b: Option<(&CudaStorage, &Layout)>,
    eps: f64,
) -> Result<Option<(CudaStorage, CudaStorage, CudaStorage)>> {
    let op = "layer_norm (residual)";
    let t = float_kname(op, x.dtype())?;
    let rk: i32 = match (x.dtype(), r.dtype()) {
        (a, b) if a == b => 0,
        (DType::F32, DType::F16) => 1,
        (DType::F32, DType::BF16) => 2,
        _ => return Ok(None),
    };
    if lx.shape() != lr.shape() {
        return Ok(None);
    }
    let (x, r) = (x.contiguous(lx)?, r.contiguous(lr)?);
    let rows = lx.numel() / cols;
    let (_w, wp) = vector_ptr(op, &x, w)?;
    let (_b, bp) = vector_ptr(op, &x, b)?;
    let sum = CudaStorage::alloc_on(x.rt(), x.dtype(), lx.numel())?;
    let y = CudaStorage::alloc_on(x.rt(), x.dtype(), lx.numel())?;
    let stats = CudaStorage::alloc_on(x.rt(), DType::F32, 2 * rows)?;
    let (xp, rp, sp, yp, tp) = (x.ptr(), r.ptr(), sum.ptr(), y.ptr(), stats.ptr());
    let (r64, c64, e32) = (rows as i64, cols as i64, eps as f32);
    let cfg = super::storage::rows_grid(rows);
    let vectors = [wp, bp].iter().filter(|&&p| p != 0).count() as u64;
    let bytes = 3 * elems(lx.numel(), x.dtype())
        + elems(lx.numel(), r.dtype())
        + vectors * elems(cols, x.dtype())
        + elems(2 * rows, DType::F32);
    if rows > 0 {
        launch!(
            bytes = bytes;
            x, KernelFile::Norm, kname!("ln_residual_forward_", t), cfg,
            &xp, &rp, &rk, &wp, &bp, &sp, &yp, &tp, &r64, &c64, &e32
        );
    }
    Ok(Some((sum, y, stats)))
}

/// Most blocks `ln_backward` runs when it sums the weight's and bias's gradients (each writes
/// `2 * cols` f32 partial sums): a fixed number, so that the sums' order, and their value, is
/// the same on every device.
const PARAM_BLOCKS: usize = 1024;

/// The columns each thread of `ln_backward` keeps the parameters' sums of (cuda/norm.cu's
/// `LN_K`): past `LN_K` times the block's threads it does not sum them.
const LN_K: usize = 8;

/// The gradients of [`layer_norm`] from the output's (`dy`), the statistics and `w`: the
/// input's when `want.dx`, and with `want.params` the weight's and bias's (in `x`'s dtype),
/// all in one pass over `dy` and `x`; no parameter gradients past `LN_K` columns a thread.
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_norm_backward(
    dy: &CudaStorage,
    ld: &Layout,
    x: &CudaStorage,
    lx: &Layout,
    cols: usize,
    stats: &CudaStorage,
    w: Option<(&CudaStorage, &Layout)>,
    want: LnWant,
) -> Result<LnGrads<CudaStorage>> {
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
    let rows = lx.numel() / cols;
    // No rows: the caller's sums of nothing.
    let mut cfg = super::storage::rows_grid(rows);
    let params = want.params && cols <= LN_K * cfg.block_dim.0 as usize && rows > 0;
    if !want.dx && !params {
        return Ok(LnGrads::default());
    }
    let (dy, x) = (dy.contiguous(ld)?, x.contiguous(lx)?);
    let (_w, wp) = vector_ptr(op, &x, w)?;
    let dx = match want.dx {
        true => Some(CudaStorage::alloc_on(x.rt(), x.dtype(), lx.numel())?),
        false => None,
    };
    if params {
        cfg.grid_dim.0 = cfg.grid_dim.0.min(PARAM_BLOCKS as u32);
    }
    let blocks = cfg.grid_dim.0 as usize;
    let part = match params {
        true => Some(CudaStorage::alloc_on(
            x.rt(),
            DType::F32,
            blocks * 2 * cols,
        )?),
        false => None,
    };
    let ptr = |s: &Option<CudaStorage>| s.as_ref().map_or(0, |s| s.ptr());
    let (dp, xp, sp, op_, pp) = (dy.ptr(), x.ptr(), stats.ptr(), ptr(&dx), ptr(&part));
    let (r64, c64) = (rows as i64, cols as i64);
    let name = kname!("ln_backward_", t);
    let n = lx.numel();
    let bytes = (2 + u64::from(want.dx)) * elems(n, x.dtype())
        + u64::from(wp != 0) * elems(cols, x.dtype())
        + elems(2 * rows, DType::F32)
        + elems(blocks * 2 * cols, DType::F32) * u64::from(params);
    if n > 0 {
        launch!(
            bytes = bytes;
            x, KernelFile::Norm, name, cfg, &dp, &xp, &wp, &sp, &op_, &pp, &r64, &c64
        );
    }
    let params = match part {
        Some(part) => {
            let dw = CudaStorage::alloc_on(x.rt(), x.dtype(), cols)?;
            let db = CudaStorage::alloc_on(x.rt(), x.dtype(), cols)?;
            let (pp, wp, bp) = (part.ptr(), dw.ptr(), db.ptr());
            let b64 = blocks as i64;
            let bytes = elems(blocks * 2 * cols, DType::F32) + 2 * elems(cols, x.dtype());
            launch!(
                bytes = bytes;
                x, KernelFile::Norm, kname!("ln_params_", t), grid(2 * cols),
                &pp, &wp, &bp, &b64, &c64
            );
            Some((dw, db))
        }
        None => None,
    };
    Ok(LnGrads { dx, params })
}
