//! Reductions and softmax: the [`ReduceOps`] family and its dispatch.

use super::ops::ReduceOp;
use super::{on_backend, BackendStorage, Storage};
use crate::layout::Layout;
use crate::Result;

/// Reductions over dims, and softmax along one dim.
pub(crate) trait ReduceOps: BackendStorage {
    /// `op` over `dims`, kept as size-1 dims.
    fn reduce(&self, l: &Layout, dims: &[usize], op: ReduceOp) -> Result<Self>;
    /// Softmax (log-softmax when `log`) along `dim`, contiguous.
    fn softmax(&self, l: &Layout, dim: usize, log: bool) -> Result<Self>;
}

impl Storage {
    pub(crate) fn reduce(&self, l: &Layout, dims: &[usize], op: ReduceOp) -> Result<Storage> {
        on_backend!("reduce", [self], B => Ok(B::part(self).reduce(l, dims, op)?.wrap()))
    }

    pub(crate) fn softmax(&self, l: &Layout, dim: usize, log: bool) -> Result<Storage> {
        on_backend!("softmax", [self], B => Ok(B::part(self).softmax(l, dim, log)?.wrap()))
    }
}
