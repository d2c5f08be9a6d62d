//! Reductions over dims: the [`ReduceOps`] family and its dispatch.

use super::ops::ReduceOp;
use super::{on_backend, Backend, BackendStorage, Storage};
use crate::layout::Layout;
use crate::Result;

/// Reductions over dims.
pub(crate) trait ReduceOps: BackendStorage {
    /// `op` over `dims`, kept as size-1 dims.
    fn reduce(&self, l: &Layout, dims: &[usize], op: ReduceOp) -> Result<Self>;
}

impl Storage {
    pub(crate) fn reduce(&self, l: &Layout, dims: &[usize], op: ReduceOp) -> Result<Storage> {
        on_backend!("reduce", [self], B => Ok(B::part(self).reduce(l, dims, op)?.wrap()))
    }
}
