//! Softmax along one dim: the [`SoftmaxOps`] family and its dispatch.

use super::{on_backend, Backend, BackendStorage, Storage};
use crate::layout::Layout;
use crate::Result;

/// Softmax and log-softmax along one dim.
pub(crate) trait SoftmaxOps: BackendStorage {
    /// Softmax (log-softmax when `log`) along `dim`, contiguous in the view's shape.
    fn softmax(&self, l: &Layout, dim: usize, log: bool) -> Result<Self>;
}

impl Storage {
    /// See [`SoftmaxOps::softmax`].
    pub(crate) fn softmax(&self, l: &Layout, dim: usize, log: bool) -> Result<Storage> {
        on_backend!("softmax", [self], B => Ok(B::part(self).softmax(l, dim, log)?.wrap()))
    }
}
