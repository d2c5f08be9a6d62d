//! Launchers of `cuda/reduce.cu` and the softmax rows of `cuda/softmax_xent.cu`: reductions
//! over dims and softmax along one dim, contiguous results.

use super::kernels::KernelFile;
use super::profile::elems;
use super::storage::{float_kname, grid, kname, rows_grid, CudaStorage};
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
    // Leading dims of a contiguous tensor, reduced in place (no transposing copy).
    let leading = dims.iter().enumerate().all(|(i, &d)| d == i);
    let arg = matches!(op, ReduceOp::ArgMax | ReduceOp::ArgMin);
    // Enough kept values for the columns to fill warps; a reduction to a few values (a total)
    // stays with the row kernel's block-wide tree.
    if l.is_contiguous() && leading && rows >= 64 && cols > 0 && !arg {
        return reduce_leading(x, l, (cols, rows), op, t);
    }
    let dense = with_dims_last(x, l, dims)?;
    let (src, r64, c64) = (dense.ptr(), rows as i64, cols as i64);
    let code = match op {
        ReduceOp::Sum | ReduceOp::Max | ReduceOp::Min | ReduceOp::Mean => op.code(),
        ReduceOp::ArgMax | ReduceOp::ArgMin => {
            let sign: f32 = if op == ReduceOp::ArgMax { 1.0 } else { -1.0 };
            let out = CudaStorage::alloc_on(x.rt(), DType::I64, rows)?;
            let dst = out.ptr();
            let name = kname!("argmax_rows_", t);
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
    let name = kname!("reduce_rows_", t);
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

/// Rows of one pass-1 work item of [`reduce_leading`], at least: enough to amortise the
/// item's index arithmetic, few enough that a [6400, 2048] bias gradient makes 100 x 2048
/// items. Taller inputs take taller chunks, so that pass 2 reads at most 256 per column.
const CHUNK: usize = 64;

/// `op` over the leading `reduced` rows of the contiguous `[reduced, kept]` view `l`, into
/// `kept` values: two passes of `cuda/reduce.cu` (`reduce_cols_partial_*`, then
/// `reduce_cols_final_*` over the f32 partials).
fn reduce_leading(
    x: &CudaStorage,
    l: &Layout,
    (reduced, kept): (usize, usize),
    op: ReduceOp,
    t: &str,
) -> Result<CudaStorage> {
    let chunk = CHUNK.max(reduced.div_ceil(256));
    let chunks = reduced.div_ceil(chunk);
    let items = chunks.checked_mul(kept).ok_or_else(|| {
        Error::invalid(
            "reduce",
            format!("{chunks} chunks of {kept} columns overflow"),
        )
    })?;
    let partial = CudaStorage::alloc_on(x.rt(), DType::F32, items)?;
    let out = CudaStorage::alloc_on(x.rt(), x.dtype(), kept)?;
    let (code, src) = (op.code(), x.ptr_at(l.offset()));
    let (r64, c64, k64, n64) = (reduced as i64, kept as i64, chunk as i64, chunks as i64);
    let (pp, dst) = (partial.ptr(), out.ptr());
    launch!(
        bytes = elems(reduced * kept, x.dtype()) + elems(items, DType::F32);
        x,
        KernelFile::Reduce,
        kname!("reduce_cols_partial_", t),
        grid(items),
        &code,
        &src,
        &pp,
        &r64,
        &c64,
        &k64
    );
    launch!(
        bytes = elems(items, DType::F32) + elems(kept, x.dtype());
        x,
        KernelFile::Reduce,
        kname!("reduce_cols_final_", t),
        grid(kept),
        &code,
        &pp,
        &dst,
        &r64,
        &c64,
        &n64
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
        kname!("extreme_rows_", t),
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
