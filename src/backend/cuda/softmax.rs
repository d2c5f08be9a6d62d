//! Launcher of the softmax rows of `cuda/softmax_xent.cu` (the file the fused cross-entropy
//! shares): softmax or log-softmax along one dim.

use super::kernels::KernelFile;
use super::profile::elems;
use super::reduce::with_dims_last;
use super::storage::{float_kname, rows_grid, same_dtype, CudaStorage};
use crate::backend::RowSoftmax;
use crate::layout::Layout;
use crate::{Error, Result};
use cudarc::driver::PushKernelArg;

/// Softmax or log-softmax along `dim`, output contiguous in the view's shape.
pub(crate) fn softmax(x: &CudaStorage, l: &Layout, dim: usize, log: bool) -> Result<CudaStorage> {
    let t = float_kname("softmax", x.dtype())?;
    let cols = l.shape()[dim];
    let rows = l.numel() / cols.max(1);
    let dense = with_dims_last(x, l, &[dim])?;
    let out = CudaStorage::alloc_on(x.rt(), x.dtype(), l.numel())?;
    let (src, dst, r64, c64, lg) = (dense.ptr(), out.ptr(), rows as i64, cols as i64, log as i32);
    let (scale, causal) = (1f32, 0i64);
    let name = kname!("softmax_rows_", t);
    launch!(
        x,
        KernelFile::SoftmaxXent,
        name,
        rows_grid(rows),
        &src,
        &dst,
        &r64,
        &c64,
        &lg,
        &scale,
        &causal
    );
    if dim + 1 == l.rank() {
        return Ok(out);
    }
    // Back from [kept..., dim] to the view's order.
    let mut moved: Vec<usize> = (0..l.rank()).filter(|&d| d != dim).collect();
    moved.push(dim);
    let shape: Vec<usize> = moved.iter().map(|&d| l.shape()[d]).collect();
    let mut inverse = vec![0; l.rank()];
    for (i, &d) in moved.iter().enumerate() {
        inverse[d] = i;
    }
    out.copy_strided(&Layout::contiguous(&shape).permute("softmax", &inverse)?)
}

/// [`SoftmaxOps::softmax_rows`](crate::backend::SoftmaxOps::softmax_rows) of the contiguous
/// `x`: one block per row.
pub(crate) fn softmax_rows(x: &CudaStorage, p: RowSoftmax) -> Result<CudaStorage> {
    let t = float_kname("softmax", x.dtype())?;
    let out = CudaStorage::alloc_on(x.rt(), x.dtype(), x.len())?;
    let rows = x.len() / p.cols.max(1);
    if rows == 0 || p.cols == 0 {
        return Ok(out);
    }
    let (src, dst, r64, c64, lg) = (x.ptr(), out.ptr(), rows as i64, p.cols as i64, p.log as i32);
    let (scale, causal) = (p.scale as f32, p.causal.map_or(0, |l| l as i64));
    let bytes = 2 * elems(x.len(), x.dtype());
    launch!(
        bytes = bytes;
        x,
        KernelFile::SoftmaxXent,
        kname!("softmax_rows_", t),
        rows_grid(rows),
        &src,
        &dst,
        &r64,
        &c64,
        &lg,
        &scale,
        &causal
    );
    Ok(out)
}

/// [`SoftmaxOps::softmax_rows_backward`](crate::backend::SoftmaxOps::softmax_rows_backward)
/// from the output `y` and its gradient `g` (contiguous, `y`'s dtype): one block per row.
pub(crate) fn softmax_rows_backward(
    y: &CudaStorage,
    g: &CudaStorage,
    p: RowSoftmax,
) -> Result<CudaStorage> {
    let t = float_kname("softmax backward", y.dtype())?;
    same_dtype("softmax backward", y, g)?;
    let dx = CudaStorage::alloc_on(y.rt(), y.dtype(), y.len())?;
    let rows = y.len() / p.cols.max(1);
    if rows == 0 || p.cols == 0 {
        return Ok(dx);
    }
    let (yp, gp, dp) = (y.ptr(), g.ptr(), dx.ptr());
    let (r64, c64, lg, scale) = (rows as i64, p.cols as i64, p.log as i32, p.scale as f32);
    let bytes = 3 * elems(y.len(), y.dtype());
    launch!(
        bytes = bytes;
        y,
        KernelFile::SoftmaxXent,
        kname!("softmax_backward_", t),
        rows_grid(rows),
        &yp,
        &gp,
        &dp,
        &r64,
        &c64,
        &lg,
        &scale
    );
    Ok(dx)
}
