//! Launcher of the softmax rows of `cuda/softmax_xent.cu` (the file the fused cross-entropy
//! shares): softmax or log-softmax along one dim.

use super::kernels::KernelFile;
use super::reduce::with_dims_last;
use super::storage::{float_kname, rows_grid, CudaStorage};
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
        &lg
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
