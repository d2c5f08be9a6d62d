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
    /// Adds the input's gradient from the output's gradient `gy` and the weight `w` onto
    /// `self` (dense in the input's format, `d.channels_last`, `gy`'s dtype) in the
    /// convolution itself, where the backend can (cuDNN's `beta = 1`); `false` (the
    /// default) where it cannot, and nothing is written.
    fn conv2d_backward_input_acc(
        &mut self,
        _gy: (&Self, &Layout),
        _w: (&Self, &Layout),
        _d: &ConvDims,
    ) -> Result<bool> {
        Ok(false)
    }
    /// The output of input `self` and weight `w` with the per-channel sums of the output and
    /// of its squares (f32 `[2, o]`: `[sum | sum of squares]`) made in the same call, for a
    /// batch norm that reads the output; `None` (the default) where the backend does not
    /// make them for these operands, and nothing was run.
    fn conv2d_with_sums(
        &self,
        _l: &Layout,
        _w: &Self,
        _lw: &Layout,
        _d: &ConvDims,
    ) -> Result<Option<(Self, Self)>> {
        Ok(None)
    }
    /// The weight's gradient where the convolution's input is `alpha[c] (x - center[c]) +
    /// gamma[c]` of `self` (x), clamped below at 0 with `relu` (a batch norm's output), with
    /// `coef = [alpha | center | gamma | ...]` (`[4, c]` f32), the map applied in the
    /// convolution's prologue instead of its result made; `None` (the default) where the
    /// backend has no such call for these operands, and nothing was run.
    fn conv2d_backward_weight_affine(
        &self,
        _l: &Layout,
        _coef: (&Self, &Layout),
        _relu: bool,
        _gy: (&Self, &Layout),
        _d: &ConvDims,
    ) -> Result<Option<Self>> {
        Ok(None)
    }
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

    /// See [`ConvOps::conv2d_with_sums`].
    pub(crate) fn conv2d_with_sums(
        &self,
        l: &Layout,
        w: &Storage,
        lw: &Layout,
        d: &ConvDims,
    ) -> Result<Option<(Storage, Storage)>> {
        on_backend!("conv2d", [self, w], B => {
            let out = B::part(self).conv2d_with_sums(l, B::part(w), lw, d)?;
            Ok(out.map(|(y, s)| (y.wrap(), s.wrap())))
        })
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

    /// See [`ConvOps::conv2d_backward_input_acc`].
    pub(crate) fn conv2d_backward_input_acc(
        &mut self,
        (gy, lg): (&Storage, &Layout),
        (w, lw): (&Storage, &Layout),
        d: &ConvDims,
    ) -> Result<bool> {
        let op = "conv2d_backward_input";
        let device = super::common_device(op, &[&*self, gy, w])?;
        super::on_device!(device, B => {
            B::part_mut(self).conv2d_backward_input_acc((B::part(gy), lg), (B::part(w), lw), d)
        })
    }

    /// See [`ConvOps::conv2d_backward_weight_affine`].
    pub(crate) fn conv2d_backward_weight_affine(
        &self,
        l: &Layout,
        (coef, lc): (&Storage, &Layout),
        relu: bool,
        (gy, lg): (&Storage, &Layout),
        d: &ConvDims,
    ) -> Result<Option<Storage>> {
        on_backend!("conv2d_backward_weight", [self, coef, gy], B => {
            let (c, g) = ((B::part(coef), lc), (B::part(gy), lg));
            let out = B::part(self).conv2d_backward_weight_affine(l, c, relu, g, d)?;
            Ok(out.map(|w| w.wrap()))
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
