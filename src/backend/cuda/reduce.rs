//! Launchers of `cuda/reduce.cu` and the softmax rows of `cuda/softmax_xent.cu`: reductions
//! over dims and softmax along one dim, contiguous results.

use super::kernels::KernelFile;
use super::profile::elems;
use super::storage::{float_kname, kname, rows_grid, CudaStorage};
use crate::backend::ops::ReduceOp;
use crate::layout::Layout;
use crate::{DType, Error, Result};
use cudarc::driver::PushKernelArg;

/// The view with `last` moved to the end (the others in order), as a contiguous storage.
pub(super) fn with_dims_last(x: &CudaStorage, l: &Layout, last: &[usize]) -> Result<CudaStorage> {
    let mut perm: Vec<usize> = (0..l.rank()).filter(|d| !last.contains(d)).collect();
    perm.extend_from_slice(last);
    x.copy_strided(&l.permute("reduce", &perm)?)
}

pub(crate) fn reduce(
    x: &CudaStorage,
    l: &Layout,
    dims: &[usize],
    op: ReduceOp,
) -> Result<CudaStorage> {
    if matches!(x.dtype(), DType::I64 | DType::U8) {
        return int_extreme(x, l, dims, op);
    }
    let t = float_kname("reduce", x.dtype())?;
    let (rows, cols) = rows_cols(l, dims);
    let dense = with_dims_last(x, l, dims)?;
    let (src, r64, c64) = (dense.ptr(), rows as i64, cols as i64);
    let code = match op {
        ReduceOp::Sum | ReduceOp::Max | ReduceOp::Min | ReduceOp::Mean => op.code(),
        ReduceOp::ArgMax | ReduceOp::ArgMin => {
            let sign: f32 = if op == ReduceOp::ArgMax { 1.0 } else { -1.0 };
            let out = CudaStorage::alloc_on(x.rt(), DType::I64, rows)?;
            let dst = out.ptr();
            let name = format!("argmax_rows_{t}");
            launch!(
                bytes = elems(rows * cols, x.dtype()) + elems(rows, DType::I64);
                x,
                KernelFile::Reduce,
                name,
                rows_grid(rows),
                &sign,
                &src,
                &dst,
                &r64,
                &c64
            );
            return Ok(out);
        }
    };
    let out = CudaStorage::alloc_on(x.rt(), x.dtype(), rows)?;
    let dst = out.ptr();
    let name = format!("reduce_rows_{t}");
    launch!(
        bytes = elems(rows * cols, x.dtype()) + elems(rows, x.dtype());
        x,
        KernelFile::Reduce,
        name,
        rows_grid(rows),
        &code,
        &src,
        &dst,
        &r64,
        &c64
    );
    Ok(out)
}

/// The rows' count and length of `dims` reduced in `l`: the kept dims' product, not numel /
/// cols (a sum over an empty dim still has one output per kept position).
fn rows_cols(l: &Layout, dims: &[usize]) -> (usize, usize) {
    let cols = dims.iter().map(|&d| l.shape()[d]).product();
    let rows = (0..l.rank())
        .filter(|d| !dims.contains(d))
        .map(|d| l.shape()[d])
        .product();
    (rows, cols)
}

/// Max, min, argmax or argmin of an integer tensor (compared exactly, as on the CPU); sums
/// of integers are not defined here (the ops reject them first).
fn int_extreme(x: &CudaStorage, l: &Layout, dims: &[usize], op: ReduceOp) -> Result<CudaStorage> {
    let t = kname("reduce", x.dtype())?;
    let (code, index) = match op {
        ReduceOp::Max => (ReduceOp::Max.code(), false),
        ReduceOp::Min => (ReduceOp::Min.code(), false),
        ReduceOp::ArgMax => (ReduceOp::Max.code(), true),
        ReduceOp::ArgMin => (ReduceOp::Min.code(), true),
        ReduceOp::Sum | ReduceOp::Mean => {
            return Err(Error::DType {
                op: "reduce",
                dtype: x.dtype(),
                expected: "f32, f16 or bf16 (integers: max, min, argmax, argmin)",
            })
        }
    };
    let (rows, cols) = rows_cols(l, dims);
    if cols == 0 && rows > 0 {
        return Err(Error::invalid("reduce", "an extreme of no elements"));
    }
    let out = match index {
        true => CudaStorage::alloc_on(x.rt(), DType::I64, rows)?,
        false => CudaStorage::alloc_on(x.rt(), x.dtype(), rows)?,
    };
    if rows == 0 {
        return Ok(out);
    }
    let dense = with_dims_last(x, l, dims)?;
    let (vals, args) = match index {
        true => (0u64, out.ptr()),
        false => (out.ptr(), 0u64),
    };
    let (src, r64, c64) = (dense.ptr(), rows as i64, cols as i64);
    launch!(
        x,
        KernelFile::Reduce,
        format!("extreme_rows_{t}"),
        rows_grid(rows),
        &code,
        &src,
        &vals,
        &args,
        &r64,
        &c64
    );
    Ok(out)
}
