//! Indexing kernels: index_select, gather, scatter_add, index_add.

use super::{map_all, map_pair, CpuElem, CpuStorage, IntoStorage};
use crate::backend::spec::{offset_with, step};
use crate::layout::Layout;
use crate::Result;

/// `out[.., i, ..] = src[.., idx[i], ..]` along `dim`.
pub(crate) fn index_select(s: &CpuStorage, l: &Layout, dim: usize, idx: &[usize]) -> CpuStorage {
    fn go<T: CpuElem>(v: &[T], l: &Layout, dim: usize, idx: &[usize]) -> CpuStorage {
        let mut shape = l.shape().to_vec();
        shape[dim] = idx.len();
        let n: usize = shape.iter().product();
        let mut out = Vec::with_capacity(n);
        let mut pos = vec![0; shape.len()];
        for _ in 0..n {
            out.push(v[offset_with(l, &pos, dim, idx[pos[dim]])]);
            step(&mut pos, &shape);
        }
        out.into_storage()
    }
    map_all!(s, v => go(v, l, dim, idx))
}

/// `out[p] = src[p with p[dim] = idx[p]]`; the output has the index's shape.
pub(crate) fn gather(
    s: &CpuStorage,
    l: &Layout,
    dim: usize,
    idx: &[usize],
    idx_shape: &[usize],
) -> CpuStorage {
    fn go<T: CpuElem>(
        v: &[T],
        l: &Layout,
        dim: usize,
        idx: &[usize],
        shape: &[usize],
    ) -> CpuStorage {
        let mut out = Vec::with_capacity(idx.len());
        let mut pos = vec![0; shape.len()];
        for &i in idx {
            out.push(v[offset_with(l, &pos, dim, i)]);
            step(&mut pos, shape);
        }
        out.into_storage()
    }
    map_all!(s, v => go(v, l, dim, idx, idx_shape))
}

/// `dst[p with p[dim] = idx[p]] += src[p]` for every p of the index's shape; `dst` is a
/// contiguous buffer of `dst_shape`.
pub(crate) fn scatter_add(
    dst: &mut CpuStorage,
    dst_shape: &[usize],
    dim: usize,
    idx: &[usize],
    idx_shape: &[usize],
    src: &CpuStorage,
    src_l: &Layout,
) -> Result<()> {
    fn go<T: CpuElem>(
        d: &mut [T],
        dl: &Layout,
        dim: usize,
        idx: &[usize],
        shape: &[usize],
        s: &[T],
        sl: &Layout,
    ) {
        let mut pos = vec![0; shape.len()];
        for &i in idx {
            let o = offset_with(dl, &pos, dim, i);
            let so = offset_with(sl, &pos, usize::MAX, 0);
            d[o] = T::from_acc(d[o].to_acc() + s[so].to_acc());
            step(&mut pos, shape);
        }
    }
    let dl = Layout::contiguous(dst_shape);
    map_pair!("scatter_add", dst, src, d, s => go(d, &dl, dim, idx, idx_shape, s, src_l));
    Ok(())
}

/// `dst[.., idx[i], ..] += src[.., i, ..]` along `dim`; `dst` is contiguous of `dst_shape`.
pub(crate) fn index_add(
    dst: &mut CpuStorage,
    dst_shape: &[usize],
    dim: usize,
    idx: &[usize],
    src: &CpuStorage,
    src_l: &Layout,
) -> Result<()> {
    fn go<T: CpuElem>(d: &mut [T], dl: &Layout, dim: usize, idx: &[usize], s: &[T], sl: &Layout) {
        let shape = sl.shape();
        let n: usize = shape.iter().product();
        let mut pos = vec![0; shape.len()];
        for so in sl.offsets().take(n) {
            let o = offset_with(dl, &pos, dim, idx[pos[dim]]);
            d[o] = T::from_acc(d[o].to_acc() + s[so].to_acc());
            step(&mut pos, shape);
        }
    }
    let dl = Layout::contiguous(dst_shape);
    map_pair!("index_add", dst, src, d, s => go(d, &dl, dim, idx, s, src_l));
    Ok(())
}
