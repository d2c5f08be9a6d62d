//! Launchers for `cuda/index.cu`: index_select and gather copy on the device; scatter_add and
//! index_add add in the CPU's order through groups laid out on the host. The indices arrive
//! checked on the host (`Storage::indices`), so only they cross to the device, never the data.
//!
//! Unverified: written after the GPU session ended; not yet run on a GPU.

use super::storage::{float_kname, grid, CudaStorage, Strided};
use crate::backend::cpu::index::{offset_with, step};
use crate::backend::cpu::CpuStorage;
use crate::layout::Layout;
use crate::{Error, Result};
use cudarc::driver::PushKernelArg;

/// `values` as an I64 buffer on `like`'s device.
fn upload(like: &CudaStorage, values: Vec<i64>) -> Result<CudaStorage> {
    let n = values.len();
    CudaStorage::from_cpu(
        &CpuStorage::I64(values),
        &Layout::contiguous(&[n]),
        like.ordinal(),
    )
}

fn as_i64(idx: &[usize]) -> Vec<i64> {
    idx.iter().map(|&i| i as i64).collect()
}

/// `out[p] = x[p with p[dim] = k(p)]` over `out_shape`: `k` is `idx[p[dim]]` (index_select)
/// or `idx[p]` (gather, `select` false).
fn take(
    op: &'static str,
    x: &CudaStorage,
    l: &Layout,
    dim: usize,
    idx: &[usize],
    out_shape: &[usize],
    select: bool,
) -> Result<CudaStorage> {
    let width = x.dtype().size_in_bytes() * 8;
    let n: usize = out_shape.iter().product();
    let out = CudaStorage::alloc_on(x.rt(), x.dtype(), n)?;
    if n == 0 {
        return Ok(out);
    }
    let mut strides = l.strides().to_vec();
    let dim_stride = strides[dim] as i64;
    strides[dim] = 0;
    let base = Strided::new(op, &Layout::new(out_shape.to_vec(), strides, l.offset()))?;
    let inner: i64 = match select {
        true => out_shape[dim + 1..].iter().product::<usize>() as i64,
        false => 0,
    };
    let nidx = idx.len() as i64;
    let d_idx = upload(x, as_i64(idx))?;
    let (xp, ip, op_, n64) = (x.ptr(), d_idx.ptr(), out.ptr(), n as i64);
    launch!(
        x,
        "index",
        format!("take_u{width}"),
        grid(n),
        &xp,
        &base,
        &ip,
        &inner,
        &nidx,
        &dim_stride,
        &op_,
        &n64
    );
    Ok(out)
}

/// `out[.., i, ..] = x[.., idx[i], ..]` along `dim`.
pub(crate) fn index_select(
    x: &CudaStorage,
    l: &Layout,
    dim: usize,
    idx: &[usize],
) -> Result<CudaStorage> {
    let mut shape = l.shape().to_vec();
    shape[dim] = idx.len();
    take("index_select", x, l, dim, idx, &shape, true)
}

/// `out[p] = x[p with p[dim] = idx[p]]`; the output has the index's shape.
pub(crate) fn gather(
    x: &CudaStorage,
    l: &Layout,
    dim: usize,
    idx: &[usize],
    idx_shape: &[usize],
) -> Result<CudaStorage> {
    take("gather", x, l, dim, idx, idx_shape, false)
}

/// Adds `src[s]` into `dst[d]` for each `(d, s)` of `pairs`, in the pairs' order per cell.
fn add_pairs(
    op: &'static str,
    dst: &mut CudaStorage,
    src: &CudaStorage,
    pairs: Vec<(usize, usize)>,
) -> Result<()> {
    if dst.dtype() != src.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: dst.dtype(),
            rhs: src.dtype(),
        });
    }
    let t = float_kname(op, dst.dtype())?;
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
        "index",
        format!("add_groups_{t}"),
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
fn groups(mut pairs: Vec<(usize, usize)>) -> (Vec<i64>, Vec<i64>, Vec<i64>) {
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
    idx: &[usize],
    idx_shape: &[usize],
    src: &CudaStorage,
    sl: &Layout,
) -> Result<()> {
    let dl = Layout::contiguous(dst_shape);
    let mut pos = vec![0; idx_shape.len()];
    let mut pairs = Vec::with_capacity(idx.len());
    for &i in idx {
        pairs.push((
            offset_with(&dl, &pos, dim, i),
            offset_with(sl, &pos, usize::MAX, 0),
        ));
        step(&mut pos, idx_shape);
    }
    add_pairs("scatter_add", dst, src, pairs)
}

/// `dst[.., idx[i], ..] += src[.., i, ..]` along `dim`; `dst` is contiguous.
pub(crate) fn index_add(
    dst: &mut CudaStorage,
    dst_shape: &[usize],
    dim: usize,
    idx: &[usize],
    src: &CudaStorage,
    sl: &Layout,
) -> Result<()> {
    let dl = Layout::contiguous(dst_shape);
    let shape = sl.shape();
    let n: usize = shape.iter().product();
    let mut pos = vec![0; shape.len()];
    let mut pairs = Vec::with_capacity(n);
    for so in sl.offsets().take(n) {
        pairs.push((offset_with(&dl, &pos, dim, idx[pos[dim]]), so));
        step(&mut pos, shape);
    }
    add_pairs("index_add", dst, src, pairs)
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
