//! Launchers for `cuda/rnn.cu`: the fused LSTM cell, forward and backward, over contiguous
//! copies of its operands.
//!
//! Unverified: written after the GPU session ended; not yet run on a GPU.

use super::ops::same_dtype as same;
use super::storage::{float_kname, grid, CudaStorage};
use crate::layout::Layout;
use crate::{Error, Result};
use cudarc::driver::PushKernelArg;

/// `[h | c']` `[B, 2H]` from gates `[B, 4H]` and the cell state `[B, H]`.
pub(crate) fn lstm_cell(
    g: &CudaStorage,
    lg: &Layout,
    c: &CudaStorage,
    lc: &Layout,
) -> Result<CudaStorage> {
    same("lstm_cell", g, c)?;
    let t = float_kname("lstm_cell", g.dtype())?;
    let (batch, h) = (lc.shape()[0], lc.shape()[1]);
    let (g, c) = (g.contiguous(lg)?, c.contiguous(lc)?);
    let out = CudaStorage::alloc_on(g.rt(), g.dtype(), batch * 2 * h)?;
    let (gp, cp, op, b64, h64) = (g.ptr(), c.ptr(), out.ptr(), batch as i64, h as i64);
    let name = format!("lstm_cell_{t}");
    launch!(g, "rnn", name, grid(batch * h), &gp, &cp, &op, &b64, &h64);
    Ok(out)
}

/// `[d gates | d c]` `[B, 5H]` from the gradient of `[h | c']`.
pub(crate) fn lstm_cell_backward(
    g: &CudaStorage,
    lg: &Layout,
    c: &CudaStorage,
    lc: &Layout,
    d: &CudaStorage,
    ld: &Layout,
) -> Result<CudaStorage> {
    same("lstm_cell backward", g, c)?;
    same("lstm_cell backward", g, d)?;
    let t = float_kname("lstm_cell backward", g.dtype())?;
    let (batch, h) = (lc.shape()[0], lc.shape()[1]);
    let (g, c, d) = (g.contiguous(lg)?, c.contiguous(lc)?, d.contiguous(ld)?);
    let out = CudaStorage::alloc_on(g.rt(), g.dtype(), batch * 5 * h)?;
    let (gp, cp, dp, op) = (g.ptr(), c.ptr(), d.ptr(), out.ptr());
    let (b64, h64) = (batch as i64, h as i64);
    let name = format!("lstm_cell_backward_{t}");
    launch!(
        g,
        "rnn",
        name,
        grid(batch * h),
        &gp,
        &cp,
        &dp,
        &op,
        &b64,
        &h64
    );
    Ok(out)
}
