//! Reductions over dims and sorts along one: the [`ReduceOps`] family and its dispatch.

use super::ops::ReduceOp;
use super::{on_backend, Backend, BackendStorage, Storage};
use crate::layout::Layout;
use crate::Result;

/// Reductions over dims, and sorts along one.
pub(crate) trait ReduceOps: BackendStorage {
    /// `op` over `dims`, kept as size-1 dims.
    fn reduce(&self, l: &Layout, dims: &[usize], op: ReduceOp) -> Result<Self>;
    /// The indices (I64, contiguous in the view's shape) that sort each row of the view `l`
    /// along its last dim: ascending (or `descending`), ties in index order, NaN after every
    /// number ascending and before every number descending.
    fn argsort(&self, l: &Layout, descending: bool) -> Result<Self>;
}

impl Storage {
    pub(crate) fn reduce(&self, l: &Layout, dims: &[usize], op: ReduceOp) -> Result<Storage> {
        on_backend!("reduce", [self], B => Ok(B::part(self).reduce(l, dims, op)?.wrap()))
    }

    /// See [`ReduceOps::argsort`].
    pub(crate) fn argsort(&self, l: &Layout, descending: bool) -> Result<Storage> {
        on_backend!("argsort", [self], B => Ok(B::part(self).argsort(l, descending)?.wrap()))
    }
}
