//! Launchers for the fused cross-entropy of `cuda/softmax_xent.cu` (the CPU's
//! `backend/cpu/loss.rs` computes the same). Targets stay on the device: a target out of range
//! is found by the kernel and reported at the next read of device data (`faults.rs`), so a
//! training step reads nothing back for its loss.

use super::kernels::KernelFile;
use super::profile::elems;
use super::storage::rows_grid;
use super::storage::{float_kname, grid, CudaStorage};
use crate::layout::Layout;
use crate::{DType, Error, Result};
use cudarc::driver::PushKernelArg;

fn expect(op: &'static str, s: &CudaStorage, dtype: DType, expected: &'static str) -> Result<()> {
    if s.dtype() != dtype {
        return Err(Error::DType {
            op,
            dtype: s.dtype(),
            expected,
        });
    }
    Ok(())
}

/// `(loss, lse)` per row of `x [rows, C]`, both f32.
pub(crate) fn cross_entropy(
    x: &CudaStorage,
    l: &Layout,
    target: &CudaStorage,
    lt: &Layout,
    ignore: i64,
    eps: f64,
) -> Result<(CudaStorage, CudaStorage)> {
    let op = "cross_entropy";
    let t = float_kname(op, x.dtype())?;
    expect(op, target, DType::I64, "I64 class indices")?;
    let (rows, cols) = (l.shape()[0], l.shape()[1]);
    let (x, target) = (x.contiguous(l)?, target.contiguous(lt)?);
    let loss = CudaStorage::alloc_on(x.rt(), DType::F32, rows)?;
    let lse = CudaStorage::alloc_on(x.rt(), DType::F32, rows)?;
    if rows == 0 {
        return Ok((loss, lse));
    }
    let msg = format!("a target out of range for {cols} classes (ignore_index {ignore})");
    let (xp, tp, lp, zp) = (x.ptr(), target.ptr(), loss.ptr(), lse.ptr());
    let (r64, c64, e32) = (rows as i64, cols as i64, eps as f32);
    // The logits and targets in, the loss and log-sum-exp of each row out.
    let bytes =
        elems(rows * cols, x.dtype()) + elems(rows, DType::I64) + elems(2 * rows, DType::F32);
    x.rt().checked_launch(op, msg, |fault, slot| {
        launch!(
            bytes = bytes;
            x,
            KernelFile::SoftmaxXent,
            kname!("xent_rows_", t),
            rows_grid(rows),
            &xp,
            &tp,
            &lp,
            &zp,
            &r64,
            &c64,
            &ignore,
            &e32,
            &fault,
            &slot
        );
        Ok(())
    })?;
    Ok((loss, lse))
}

/// The gradient of `x [rows, C]` (contiguous, `x`'s dtype) from each row's f32 gradient `g`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn cross_entropy_backward(
    x: &CudaStorage,
    l: &Layout,
    target: &CudaStorage,
    lt: &Layout,
    lse: &CudaStorage,
    g: &CudaStorage,
    lg: &Layout,
    ignore: i64,
    eps: f64,
) -> Result<CudaStorage> {
    let (rows, cols) = (l.shape()[0], l.shape()[1]);
    let x = x.contiguous(l)?;
    let dx = CudaStorage::alloc_on(x.rt(), x.dtype(), rows * cols)?;
    let rows_in = Rows {
        rows,
        cols,
        target,
        lt,
        lse,
        g,
        lg,
    };
    launch_backward(&x, &dx, rows_in, ignore, eps)?;
    Ok(dx)
}

/// [`cross_entropy_backward`] written over the logits `x` (row-major `[rows, cols]`, filling
/// the storage): the kernel reads each logit and writes its gradient in the same place.
#[allow(clippy::too_many_arguments)]
pub(crate) fn cross_entropy_backward_in_place(
    x: &mut CudaStorage,
    cols: usize,
    target: &CudaStorage,
    lt: &Layout,
    lse: &CudaStorage,
    g: &CudaStorage,
    lg: &Layout,
    ignore: i64,
    eps: f64,
) -> Result<()> {
    let rows = lt.numel();
    if rows.checked_mul(cols) != Some(x.len()) {
        return Err(Error::invalid(
            "cross_entropy backward",
            format!(
                "{rows} rows of {cols} logits written in place over a storage of {}",
                x.len()
            ),
        ));
    }
    let rows_in = Rows {
        rows,
        cols,
        target,
        lt,
        lse,
        g,
        lg,
    };
    launch_backward(x, x, rows_in, ignore, eps)
}

/// What the backward reads besides the logits: their shape, and per row the target, the
/// forward's log-sum-exp and the incoming gradient.
struct Rows<'a> {
    rows: usize,
    cols: usize,
    target: &'a CudaStorage,
    lt: &'a Layout,
    lse: &'a CudaStorage,
    g: &'a CudaStorage,
    lg: &'a Layout,
}

/// Launches `xent_backward` from the contiguous logits `x` into `dx` (which may be `x`).
fn launch_backward(
    x: &CudaStorage,
    dx: &CudaStorage,
    r: Rows<'_>,
    ignore: i64,
    eps: f64,
) -> Result<()> {
    let op = "cross_entropy backward";
    let t = float_kname(op, x.dtype())?;
    expect(op, r.target, DType::I64, "I64 class indices")?;
    expect(op, r.lse, DType::F32, "F32 log-sum-exps")?;
    expect(op, r.g, DType::F32, "an F32 gradient per row")?;
    let (target, g) = (r.target.contiguous(r.lt)?, r.g.contiguous(r.lg)?);
    let n = r.rows * r.cols;
    if n == 0 {
        return Ok(());
    }
    let (xp, tp, zp, gp, dp) = (x.ptr(), target.ptr(), r.lse.ptr(), g.ptr(), dx.ptr());
    let (r64, c64, e32) = (r.rows as i64, r.cols as i64, eps as f32);
    // The logits, targets, log-sum-exps and row gradients in, the logits' gradient out.
    let bytes = 2 * elems(n, x.dtype()) + elems(r.rows, DType::I64) + elems(2 * r.rows, DType::F32);
    launch!(
        bytes = bytes;
        x,
        KernelFile::SoftmaxXent,
        kname!("xent_backward_", t),
        grid(n),
        &xp,
        &tp,
        &zp,
        &gp,
        &dp,
        &r64,
        &c64,
        &ignore,
        &e32
    );
    Ok(())
}
