//! Launchers for `cuda/index.cu`. Indices stay on the device: each kernel checks them against
//! the indexed size and an index out of range is reported at the next read of device data
//! (`faults.rs`), so none of these ops reads back. index_select and gather copy; scatter_add
//! and index_add add with atomics, in an order that varies from run to run (as PyTorch's do),
//! unless [`set_deterministic_index_add`] asks for the CPU's order, laid out on the host from
//! the indices (one read of them per call).

use super::kernels::KernelFile;
use super::storage::{float_kname, grid, CudaStorage, Strided};
use crate::backend::host::indices;
use crate::backend::host::CpuStorage;
use crate::backend::spec::{offset_with, step};
use crate::layout::Layout;
use crate::{DType, Error, Result};
use cudarc::driver::PushKernelArg;
use std::sync::atomic::{AtomicBool, Ordering};

static DETERMINISTIC: AtomicBool = AtomicBool::new(false);

/// Makes scatter_add and index_add on CUDA (the backward of gather, index_select and
/// embedding) add in a fixed order, the CPU's, so a run repeats bit for bit (PyTorch's
/// `torch.use_deterministic_algorithms(True)` for these ops). It costs a read of the indices
/// into host memory per call, which waits for the queued work. Off by default: atomics.
///
/// ```
/// use mantissa::backend::cuda::index::{deterministic_index_add, set_deterministic_index_add};
/// set_deterministic_index_add(true);
/// assert!(deterministic_index_add());
/// set_deterministic_index_add(false);
/// ```
pub fn set_deterministic_index_add(on: bool) {
    DETERMINISTIC.store(on, Ordering::Relaxed);
}

/// Whether scatter_add and index_add on CUDA add in a fixed order.
pub fn deterministic_index_add() -> bool {
    DETERMINISTIC.load(Ordering::Relaxed)
}

/// `values` as an I64 buffer on `like`'s device.
fn upload(like: &CudaStorage, values: Vec<i64>) -> Result<CudaStorage> {
    let n = values.len();
    CudaStorage::from_cpu(
        &CpuStorage::I64(values),
        &Layout::contiguous(&[n]),
        like.ordinal(),
    )
}

fn expect_indices(op: &'static str, idx: &CudaStorage) -> Result<()> {
    match idx.dtype() {
        DType::I64 => Ok(()),
        dtype => Err(Error::DType {
            op,
            dtype,
            expected: "I64 indices",
        }),
    }
}

/// The message of an index out of range, for the fault slot.
fn out_of_range(dim: usize, size: usize) -> String {
    format!("an index out of range for dimension {dim} of size {size}")
}

/// The view `l` with `dim`'s stride set to 0, seen in `shape`, and that stride.
pub(super) fn base(
    op: &'static str,
    l: &Layout,
    shape: &[usize],
    dim: usize,
) -> Result<(Strided, i64)> {
    let mut strides = l.strides().to_vec();
    let dim_stride = strides[dim] as i64;
    strides[dim] = 0;
    let b = Strided::new(op, &Layout::new(shape.to_vec(), strides, l.offset()))?;
    Ok((b, dim_stride))
}

/// `out[p] = x[p with p[dim] = k(p)]` over `out_shape`: `k` is `idx[p[dim]]` (index_select)
/// or `idx[p]` (gather, `select` false).
#[allow(clippy::too_many_arguments)]
fn take(
    op: &'static str,
    x: &CudaStorage,
    l: &Layout,
    dim: usize,
    idx: &CudaStorage,
    il: &Layout,
    out_shape: &[usize],
    select: bool,
) -> Result<CudaStorage> {
    expect_indices(op, idx)?;
    let width = match x.dtype().size_in_bytes() {
        1 => "u8",
        2 => "u16",
        4 => "u32",
        _ => "u64",
    };
    let n: usize = out_shape.iter().product();
    let out = CudaStorage::alloc_on(x.rt(), x.dtype(), n)?;
    if n == 0 {
        check_only(op, x, idx, il, dim, l.shape()[dim])?;
        return Ok(out);
    }
    let (base, dim_stride) = base(op, l, out_shape, dim)?;
    let inner: i64 = match select {
        true => out_shape[dim + 1..].iter().product::<usize>() as i64,
        false => 0,
    };
    let (nidx, size) = (il.numel() as i64, l.shape()[dim] as i64);
    let idx = idx.contiguous(il)?;
    let (xp, ip, op_, n64) = (x.ptr(), idx.ptr(), out.ptr(), n as i64);
    x.rt()
        .checked_launch(op, out_of_range(dim, l.shape()[dim]), |fault, slot| {
            launch!(
                x,
                KernelFile::Index,
                kname!("take_", width),
                grid(n),
                &xp,
                &base,
                &ip,
                &inner,
                &nidx,
                &size,
                &dim_stride,
                &op_,
                &n64,
                &fault,
                &slot
            );
            Ok(())
        })?;
    Ok(out)
}

/// Checks the indices of an op with no elements to move (another dim is empty) against
/// `size`, as the CPU does; an index out of range is reported at the next read.
fn check_only(
    op: &'static str,
    like: &CudaStorage,
    idx: &CudaStorage,
    il: &Layout,
    dim: usize,
    size: usize,
) -> Result<()> {
    let n = il.numel();
    if n == 0 {
        return Ok(());
    }
    let idx = idx.contiguous(il)?;
    let (ip, n64, s64) = (idx.ptr(), n as i64, size as i64);
    like.rt()
        .checked_launch(op, out_of_range(dim, size), |fault, slot| {
            launch!(
                like,
                KernelFile::Index,
                "check_indices",
                grid(n),
                &ip,
                &n64,
                &s64,
                &fault,
                &slot
            );
            Ok(())
        })
}

/// `out[.., i, ..] = x[.., idx[i], ..]` along `dim`.
pub(crate) fn index_select(
    x: &CudaStorage,
    l: &Layout,
    dim: usize,
    idx: &CudaStorage,
    il: &Layout,
) -> Result<CudaStorage> {
    let mut shape = l.shape().to_vec();
    shape[dim] = il.numel();
    take("index_select", x, l, dim, idx, il, &shape, true)
}

/// `out[p] = x[p with p[dim] = idx[p]]`; the output has the index's shape.
pub(crate) fn gather(
    x: &CudaStorage,
    l: &Layout,
    dim: usize,
    idx: &CudaStorage,
    il: &Layout,
) -> Result<CudaStorage> {
    take("gather", x, l, dim, idx, il, il.shape(), false)
}

/// Atomically adds, for each element `i` of the source view `sview` (in the iteration
/// shape), `src[sview(i)]` into `dst[p(i) with p[dim] = k]`, `k` as in [`take`] (`inner` 0:
/// `idx[i]`); `dst` is contiguous `dst_shape`.
#[allow(clippy::too_many_arguments)]
fn add_at(
    op: &'static str,
    dst: &mut CudaStorage,
    dst_shape: &[usize],
    dim: usize,
    idx: &CudaStorage,
    il: &Layout,
    src: &CudaStorage,
    sview: &Layout,
    inner: i64,
) -> Result<()> {
    let t = same_float(op, dst, src)?;
    let n = sview.numel();
    if n == 0 {
        return check_only(op, dst, idx, il, dim, dst_shape[dim]);
    }
    let (dbase, dim_stride) = base(op, &Layout::contiguous(dst_shape), sview.shape(), dim)?;
    let sv = Strided::new(op, sview)?;
    let (nidx, size) = (il.numel() as i64, dst_shape[dim] as i64);
    let idx = idx.contiguous(il)?;
    let (dp, ip, sp, n64) = (dst.ptr(), idx.ptr(), src.ptr(), n as i64);
    dst.rt()
        .checked_launch(op, out_of_range(dim, dst_shape[dim]), |fault, slot| {
            launch!(
                dst,
                KernelFile::Index,
                kname!("add_at_", t),
                grid(n),
                &dp,
                &dbase,
                &dim_stride,
                &ip,
                &inner,
                &nidx,
                &size,
                &sp,
                &sv,
                &n64,
                &fault,
                &slot
            );
            Ok(())
        })?;
    Ok(())
}

fn same_float(op: &'static str, dst: &CudaStorage, src: &CudaStorage) -> Result<&'static str> {
    if dst.dtype() != src.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: dst.dtype(),
            rhs: src.dtype(),
        });
    }
    float_kname(op, dst.dtype())
}

/// The indices read into host memory and checked (the deterministic path).
fn host_indices(
    op: &'static str,
    idx: &CudaStorage,
    il: &Layout,
    dim: usize,
    size: usize,
) -> Result<Vec<usize>> {
    expect_indices(op, idx)?;
    let host = idx.to_cpu(il)?;
    indices(op, &host, &Layout::contiguous(il.shape()), dim, size)
}

/// Adds `src[s]` into `dst[d]` for each `(d, s)` of `pairs`, in the pairs' order per cell.
fn add_pairs(
    op: &'static str,
    dst: &mut CudaStorage,
    src: &CudaStorage,
    pairs: Vec<(usize, usize)>,
) -> Result<()> {
    let t = same_float(op, dst, src)?;
    if pairs.is_empty() {
        return Ok(());
    }
    let (dst_pos, starts, src_pos) = groups(pairs);
    let groups = dst_pos.len();
    let (dp, st, sp) = (
        upload(dst, dst_pos)?,
        upload(dst, starts)?,
        upload(dst, src_pos)?,
    );
    let (dptr, dpp, stp, spp, srcp, g64) = (
        dst.ptr(),
        dp.ptr(),
        st.ptr(),
        sp.ptr(),
        src.ptr(),
        groups as i64,
    );
    launch!(
        dst,
        KernelFile::Index,
        kname!("add_groups_", t),
        grid(groups),
        &dptr,
        &dpp,
        &stp,
        &spp,
        &srcp,
        &g64
    );
    Ok(())
}

/// The (destination, source) pairs grouped by destination cell: the distinct cells, where each
/// cell's sources start in the third list (plus the end), and the sources. A stable sort keeps
/// each cell's additions in the pairs' order, which is the order the CPU adds them in.
pub(super) fn groups(mut pairs: Vec<(usize, usize)>) -> (Vec<i64>, Vec<i64>, Vec<i64>) {
    pairs.sort_by_key(|&(d, _)| d);
    let (mut dst_pos, mut starts) = (Vec::new(), Vec::new());
    for (k, &(d, _)) in pairs.iter().enumerate() {
        if dst_pos.last() != Some(&(d as i64)) {
            dst_pos.push(d as i64);
            starts.push(k as i64);
        }
    }
    starts.push(pairs.len() as i64);
    let src_pos = pairs.iter().map(|&(_, s)| s as i64).collect();
    (dst_pos, starts, src_pos)
}

/// `dst[p with p[dim] = idx[p]] += src[p]` over the index's shape; `dst` is contiguous.
pub(crate) fn scatter_add(
    dst: &mut CudaStorage,
    dst_shape: &[usize],
    dim: usize,
    idx: &CudaStorage,
    il: &Layout,
    src: &CudaStorage,
    sl: &Layout,
) -> Result<()> {
    let op = "scatter_add";
    expect_indices(op, idx)?;
    if !deterministic_index_add() {
        // The source seen in the index's shape (it may be larger).
        let sview = Layout::new(il.shape().to_vec(), sl.strides().to_vec(), sl.offset());
        return add_at(op, dst, dst_shape, dim, idx, il, src, &sview, 0);
    }
    let ids = host_indices(op, idx, il, dim, dst_shape[dim])?;
    add_pairs(
        op,
        dst,
        src,
        scatter_pairs(dst_shape, dim, &ids, il.shape(), sl),
    )
}

/// scatter_add's (destination, source) element offsets, in the index's order: `ids` is the
/// checked index of shape `ishape`, `sl` the source's view.
pub(super) fn scatter_pairs(
    dst_shape: &[usize],
    dim: usize,
    ids: &[usize],
    ishape: &[usize],
    sl: &Layout,
) -> Vec<(usize, usize)> {
    let dl = Layout::contiguous(dst_shape);
    let mut pos = vec![0; ishape.len()];
    let mut pairs = Vec::with_capacity(ids.len());
    for &i in ids {
        pairs.push((
            offset_with(&dl, &pos, dim, i),
            offset_with(sl, &pos, usize::MAX, 0),
        ));
        step(&mut pos, ishape);
    }
    pairs
}

/// `dst[.., idx[i], ..] += src[.., i, ..]` along `dim`; `dst` is contiguous.
pub(crate) fn index_add(
    dst: &mut CudaStorage,
    dst_shape: &[usize],
    dim: usize,
    idx: &CudaStorage,
    il: &Layout,
    src: &CudaStorage,
    sl: &Layout,
) -> Result<()> {
    let op = "index_add";
    expect_indices(op, idx)?;
    let shape = sl.shape();
    if !deterministic_index_add() {
        let inner = shape[dim + 1..].iter().product::<usize>() as i64;
        return add_at(op, dst, dst_shape, dim, idx, il, src, sl, inner);
    }
    let ids = host_indices(op, idx, il, dim, dst_shape[dim])?;
    add_pairs(op, dst, src, index_add_pairs(dst_shape, dim, &ids, sl))
}

/// index_add's (destination, source) element offsets, in the source's order: `ids` is the
/// checked index, `sl` the source's view.
pub(super) fn index_add_pairs(
    dst_shape: &[usize],
    dim: usize,
    ids: &[usize],
    sl: &Layout,
) -> Vec<(usize, usize)> {
    let shape = sl.shape();
    let dl = Layout::contiguous(dst_shape);
    let n: usize = shape.iter().product();
    let mut pos = vec![0; shape.len()];
    let mut pairs = Vec::with_capacity(n);
    for so in sl.offsets().take(n) {
        pairs.push((offset_with(&dl, &pos, dim, ids[pos[dim]]), so));
        step(&mut pos, shape);
    }
    pairs
}

#[cfg(test)]
mod tests {
    use super::groups;

    #[test]
    fn groups_keep_each_cells_sources_in_order() {
        let pairs = vec![(7, 0), (2, 1), (7, 2), (0, 3), (2, 4), (7, 5)];
        let (cells, starts, sources) = groups(pairs);
        assert_eq!(cells, [0, 2, 7]);
        assert_eq!(starts, [0, 1, 3, 6]);
        assert_eq!(sources, [3, 1, 4, 0, 2, 5]);
    }
}
