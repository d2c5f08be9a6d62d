//! 2-D pooling: the [`PoolOps`] family and its dispatch.

use super::ops::Pool2dParams;
use super::{on_backend, Backend, BackendStorage, PoolDims, Storage};
use crate::layout::Layout;
use crate::Result;

/// Max, average and adaptive average pooling over the planes of [`PoolDims`].
pub(crate) trait PoolOps: BackendStorage {
    /// The pooled values and, per output, the I64 flat input position of its maximum.
    fn max_pool2d(&self, l: &Layout, d: &PoolDims, p: &Pool2dParams) -> Result<(Self, Self)>;
    /// The input's gradient from the output's gradient `self` and the forward's positions.
    fn max_pool2d_backward(
        &self,
        l: &Layout,
        idx: &Self,
        d: &PoolDims,
        p: &Pool2dParams,
    ) -> Result<Self>;
    /// Average pooling, or (`backward`) the input's gradient from the output's gradient.
    fn avg_pool2d(
        &self,
        l: &Layout,
        d: &PoolDims,
        p: &Pool2dParams,
        backward: bool,
    ) -> Result<Self>;
    /// Adaptive average pooling to `d`'s output size, or (`backward`) its input's gradient.
    fn adaptive_avg_pool2d(&self, l: &Layout, d: &PoolDims, backward: bool) -> Result<Self>;
}

impl Storage {
    /// See [`PoolOps::max_pool2d`].
    pub(crate) fn max_pool2d(
        &self,
        l: &Layout,
        d: &PoolDims,
        p: &Pool2dParams,
    ) -> Result<(Storage, Storage)> {
        on_backend!("max_pool2d", [self], B => {
            let (v, i) = B::part(self).max_pool2d(l, d, p)?;
            Ok((v.wrap(), i.wrap()))
        })
    }

    /// See [`PoolOps::max_pool2d_backward`].
    pub(crate) fn max_pool2d_backward(
        &self,
        l: &Layout,
        idx: &Storage,
        d: &PoolDims,
        p: &Pool2dParams,
    ) -> Result<Storage> {
        on_backend!("max_pool2d_backward", [self, idx], B => {
            Ok(B::part(self).max_pool2d_backward(l, B::part(idx), d, p)?.wrap())
        })
    }

    pub(crate) fn avg_pool2d(&self, l: &Layout, d: &PoolDims, p: &Pool2dParams) -> Result<Storage> {
        on_backend!("avg_pool2d", [self], B => Ok(B::part(self).avg_pool2d(l, d, p, false)?.wrap()))
    }

    pub(crate) fn avg_pool2d_backward(
        &self,
        l: &Layout,
        d: &PoolDims,
        p: &Pool2dParams,
    ) -> Result<Storage> {
        on_backend!("avg_pool2d backward", [self], B => {
            Ok(B::part(self).avg_pool2d(l, d, p, true)?.wrap())
        })
    }

    /// See [`PoolOps::adaptive_avg_pool2d`].
    pub(crate) fn adaptive_avg_pool2d(
        &self,
        l: &Layout,
        d: &PoolDims,
        backward: bool,
    ) -> Result<Storage> {
        on_backend!("adaptive_avg_pool2d", [self], B => {
            Ok(B::part(self).adaptive_avg_pool2d(l, d, backward)?.wrap())
        })
    }
}
