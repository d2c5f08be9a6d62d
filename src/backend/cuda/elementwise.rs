//! Launchers of `cuda/elementwise.cu`: unary and binary maps, their gradients, comparisons
//! and `where`. Each takes device storages and layouts as the CPU backend's functions do and
//! returns a contiguous result; tests/cuda_parity.rs compares each with the CPU backend.

use super::kernels::KernelFile;
use super::profile::{elems, view_bytes};
use super::storage::{float_kname, grid, kname, same_dtype, CudaStorage, Strided};
use crate::backend::ops::{BinaryOp, CmpOp, UnaryOp};
use crate::layout::Layout;
use crate::{DType, Error, Result};
use cudarc::driver::PushKernelArg;

/// The kernel's op code and scalar parameters (`unary_f` in `cuda/elementwise.cu`).
pub(super) fn unary_code(op: UnaryOp) -> (i32, f32, f32) {
    let (a, b) = op.params();
    (op.code(), a as f32, b as f32)
}

pub(crate) fn unary(x: &CudaStorage, l: &Layout, op: UnaryOp) -> Result<CudaStorage> {
    let t = float_kname("unary", x.dtype())?;
    let n = l.numel();
    let out = CudaStorage::alloc_on(x.rt(), x.dtype(), n)?;
    let ((code, a, b), dst, n64) = (unary_code(op), out.ptr(), n as i64);
    if l.is_contiguous() {
        let src = x.ptr_at(l.offset());
        launch!(
            bytes = 2 * elems(n, x.dtype());
            x,
            KernelFile::Elementwise,
            kname!("unary_", t),
            // At least four elements a thread (one vector of f32, half of one of f16).
            grid(n.div_ceil(4)),
            &code,
            &a,
            &b,
            &src,
            &dst,
            &n64
        );
    } else {
        let (src, st) = (x.ptr(), Strided::new("unary", l)?);
        let name = kname!("unary_strided_", t);
        launch!(
            bytes = view_bytes(l, x.dtype()) + elems(n, x.dtype());
            x,
            KernelFile::Elementwise,
            name,
            grid(n),
            &code,
            &a,
            &b,
            &src,
            &st,
            &dst,
            &n64
        );
    }
    Ok(out)
}

pub(crate) fn unary_grad(
    x: &CudaStorage,
    lx: &Layout,
    g: &CudaStorage,
    lg: &Layout,
    op: UnaryOp,
) -> Result<CudaStorage> {
    same_dtype("unary_grad", x, g)?;
    let t = float_kname("unary_grad", x.dtype())?;
    let n = lx.numel();
    let out = CudaStorage::alloc_on(x.rt(), x.dtype(), n)?;
    let ((code, a, _), dst, n64) = (unary_code(op), out.ptr(), n as i64);
    if lx.is_contiguous() && lg.is_contiguous() {
        let (xp, gp) = (x.ptr_at(lx.offset()), g.ptr_at(lg.offset()));
        launch!(
            bytes = 3 * elems(n, x.dtype());
            x,
            KernelFile::Elementwise,
            kname!("unary_grad_contiguous_", t),
            // At least four elements a thread, as the forward.
            grid(n.div_ceil(4)),
            &code,
            &a,
            &xp,
            &gp,
            &dst,
            &n64
        );
        return Ok(out);
    }
    let (xp, sx, gp, sg) = (
        x.ptr(),
        Strided::new("unary_grad", lx)?,
        g.ptr(),
        Strided::new("unary_grad", lg)?,
    );
    let name = kname!("unary_grad_", t);
    launch!(
        bytes = view_bytes(lx, x.dtype()) + view_bytes(lg, g.dtype()) + elems(n, x.dtype());
        x,
        KernelFile::Elementwise,
        name,
        grid(n),
        &code,
        &a,
        &xp,
        &sx,
        &gp,
        &sg,
        &dst,
        &n64
    );
    Ok(out)
}

pub(crate) fn binary(
    x: &CudaStorage,
    lx: &Layout,
    y: &CudaStorage,
    ly: &Layout,
    op: BinaryOp,
) -> Result<CudaStorage> {
    same_dtype("binary", x, y)?;
    if let DType::I64 | DType::U8 = x.dtype() {
        // Integer counters (a batch-norm's batches tracked) and masks stay on the device too,
        // with the CPU's integer arithmetic (wrapping; division truncated and saturated).
        let out = CudaStorage::alloc_on(x.rt(), x.dtype(), lx.numel())?;
        let name = kname!("binary_strided_", kname("binary", x.dtype())?);
        strided_pair(x, lx, y, ly, op.code(), name, &out)?;
        return Ok(out);
    }
    let t = float_kname("binary", x.dtype())?;
    let n = lx.numel();
    let out = CudaStorage::alloc_on(x.rt(), x.dtype(), n)?;
    let (code, dst, n64) = (op.code(), out.ptr(), n as i64);
    if lx.is_contiguous() && ly.is_contiguous() {
        let (a, b) = (x.ptr_at(lx.offset()), y.ptr_at(ly.offset()));
        launch!(
            bytes = 3 * elems(n, x.dtype());
            x,
            KernelFile::Elementwise,
            kname!("binary_", t),
            grid(n.div_ceil(4)),
            &code,
            &a,
            &b,
            &dst,
            &n64
        );
    } else {
        strided_pair(x, lx, y, ly, code, kname!("binary_strided_", t), &out)?;
    }
    Ok(out)
}

pub(crate) fn cmp(
    x: &CudaStorage,
    lx: &Layout,
    y: &CudaStorage,
    ly: &Layout,
    op: CmpOp,
) -> Result<CudaStorage> {
    same_dtype("cmp", x, y)?;
    let t = kname("cmp", x.dtype())?;
    let out = CudaStorage::alloc_on(x.rt(), DType::U8, lx.numel())?;
    strided_pair(x, lx, y, ly, op.code(), kname!("cmp_", t), &out)?;
    Ok(out)
}

/// Launches a two-input kernel `name(op, x, lx, y, ly, out, n)` over strided views (the
/// `binary_strided_*` and `cmp_*` kernels).
fn strided_pair(
    x: &CudaStorage,
    lx: &Layout,
    y: &CudaStorage,
    ly: &Layout,
    code: i32,
    name: &'static str,
    out: &CudaStorage,
) -> Result<()> {
    let n = lx.numel();
    let (dst, n64) = (out.ptr(), n as i64);
    let (a, sa) = (x.ptr(), Strided::new("binary", lx)?);
    let (b, sb) = (y.ptr(), Strided::new("binary", ly)?);
    let bytes = view_bytes(lx, x.dtype()) + view_bytes(ly, y.dtype()) + elems(n, out.dtype());
    launch!(
        bytes = bytes;
        x,
        KernelFile::Elementwise,
        name,
        grid(n),
        &code,
        &a,
        &sa,
        &b,
        &sb,
        &dst,
        &n64
    );
    Ok(())
}

pub(crate) fn where_cond(
    c: &CudaStorage,
    lc: &Layout,
    x: &CudaStorage,
    lx: &Layout,
    y: &CudaStorage,
    ly: &Layout,
) -> Result<CudaStorage> {
    if c.dtype() != DType::U8 {
        return Err(Error::DType {
            op: "where",
            dtype: c.dtype(),
            expected: "U8 (a mask)",
        });
    }
    same_dtype("where", x, y)?;
    let t = kname("where", x.dtype())?;
    let n = lx.numel();
    let out = CudaStorage::alloc_on(x.rt(), x.dtype(), n)?;
    let (dst, n64) = (out.ptr(), n as i64);
    let (m, sm) = (c.ptr(), Strided::new("where", lc)?);
    let (a, sa) = (x.ptr(), Strided::new("where", lx)?);
    let (b, sb) = (y.ptr(), Strided::new("where", ly)?);
    let name = kname!("where_", t);
    let bytes = view_bytes(lc, DType::U8)
        + view_bytes(lx, x.dtype())
        + view_bytes(ly, y.dtype())
        + elems(n, x.dtype());
    launch!(
        bytes = bytes;
        x,
        KernelFile::Elementwise,
        name,
        grid(n),
        &m,
        &sm,
        &a,
        &sa,
        &b,
        &sb,
        &dst,
        &n64
    );
    Ok(out)
}
