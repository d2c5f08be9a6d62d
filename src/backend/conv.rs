//! 2-D convolution: the [`ConvOps`] family and its dispatch.

use super::{on_backend, Backend, BackendStorage, ConvDims, Storage};
use crate::layout::Layout;
use crate::Result;

/// A 2-D convolution of the sizes in [`ConvDims`] and its two gradients.
pub(crate) trait ConvOps: BackendStorage {
    /// The output of input `self` and weight `w`.
    fn conv2d(&self, l: &Layout, w: &Self, lw: &Layout, d: &ConvDims) -> Result<Self>;
    /// The input's gradient from the output's gradient `self` and the weight `w`.
    fn conv2d_backward_input(
        &self,
        l: &Layout,
        w: &Self,
        lw: &Layout,
        d: &ConvDims,
    ) -> Result<Self>;
    /// The weight's gradient from the input `self` and the output's gradient `gy`.
    fn conv2d_backward_weight(
        &self,
        l: &Layout,
        gy: &Self,
        lg: &Layout,
        d: &ConvDims,
    ) -> Result<Self>;
}

impl Storage {
    /// See [`ConvOps::conv2d`].
    pub(crate) fn conv2d(
        &self,
        l: &Layout,
        w: &Storage,
        lw: &Layout,
        d: &ConvDims,
    ) -> Result<Storage> {
        on_backend!("conv2d", [self, w], B => Ok(B::part(self).conv2d(l, B::part(w), lw, d)?.wrap()))
    }

    /// See [`ConvOps::conv2d_backward_input`].
    pub(crate) fn conv2d_backward_input(
        &self,
        l: &Layout,
        w: &Storage,
        lw: &Layout,
        d: &ConvDims,
    ) -> Result<Storage> {
        on_backend!("conv2d_backward_input", [self, w], B => {
            Ok(B::part(self).conv2d_backward_input(l, B::part(w), lw, d)?.wrap())
        })
    }

    /// See [`ConvOps::conv2d_backward_weight`].
    pub(crate) fn conv2d_backward_weight(
        &self,
        l: &Layout,
        gy: &Storage,
        lg: &Layout,
        d: &ConvDims,
    ) -> Result<Storage> {
        on_backend!("conv2d_backward_weight", [self, gy], B => {
            Ok(B::part(self).conv2d_backward_weight(l, B::part(gy), lg, d)?.wrap())
        })
    }
}
