//! Indexing by an I64 index tensor: the [`IndexOps`] family and its dispatch.

use super::{on_backend, Backend, BackendStorage, Storage};
use crate::layout::Layout;
use crate::Result;

/// Gathers and scatter-adds along one dim, by an I64 index storage of the same backend. An
/// index out of range is an `Err` on the CPU; on CUDA the kernel finds it and the next read
/// of device data reports it.
pub(crate) trait IndexOps: BackendStorage {
    /// `x[.., idx[i], ..]` along `dim`, for a 1-D `idx`.
    fn index_select(&self, l: &Layout, dim: usize, idx: &Self, il: &Layout) -> Result<Self>;
    /// `out[p] = x[p with p[dim] = idx[p]]` over the index's shape.
    fn gather(&self, l: &Layout, dim: usize, idx: &Self, il: &Layout) -> Result<Self>;
    /// `self[p with p[dim] = idx[p]] += src[p]` over the index's shape; `self` is contiguous
    /// `shape`.
    fn scatter_add(
        &mut self,
        shape: &[usize],
        dim: usize,
        idx: (&Self, &Layout),
        src: (&Self, &Layout),
    ) -> Result<()>;
    /// `self[.., idx[i], ..] += src[.., i, ..]` along `dim`; `self` is contiguous `shape`.
    fn index_add(
        &mut self,
        shape: &[usize],
        dim: usize,
        idx: (&Self, &Layout),
        src: (&Self, &Layout),
    ) -> Result<()>;
}

impl Storage {
    /// See [`IndexOps::index_select`].
    pub(crate) fn index_select(
        &self,
        l: &Layout,
        dim: usize,
        idx: &Storage,
        il: &Layout,
    ) -> Result<Storage> {
        on_backend!("index_select", [self, idx], B => {
            Ok(B::part(self).index_select(l, dim, B::part(idx), il)?.wrap())
        })
    }

    /// See [`IndexOps::gather`].
    pub(crate) fn gather(
        &self,
        l: &Layout,
        dim: usize,
        idx: &Storage,
        il: &Layout,
    ) -> Result<Storage> {
        on_backend!("gather", [self, idx], B => {
            Ok(B::part(self).gather(l, dim, B::part(idx), il)?.wrap())
        })
    }

    /// See [`IndexOps::scatter_add`].
    pub(crate) fn scatter_add(
        &mut self,
        shape: &[usize],
        dim: usize,
        (idx, il): (&Storage, &Layout),
        (src, sl): (&Storage, &Layout),
    ) -> Result<()> {
        on_backend!("scatter_add", [self, idx, src], B => {
            B::part_mut(self).scatter_add(shape, dim, (B::part(idx), il), (B::part(src), sl))
        })
    }

    /// See [`IndexOps::index_add`].
    pub(crate) fn index_add(
        &mut self,
        shape: &[usize],
        dim: usize,
        (idx, il): (&Storage, &Layout),
        (src, sl): (&Storage, &Layout),
    ) -> Result<()> {
        on_backend!("index_add", [self, idx, src], B => {
            B::part_mut(self).index_add(shape, dim, (B::part(idx), il), (B::part(src), sl))
        })
    }
}
