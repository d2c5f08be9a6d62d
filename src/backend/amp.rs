//! The gradient scaler's device work: the [`AmpOps`] family and its dispatch.

use super::{on_backend, Backend, BackendStorage, Storage};
use crate::{DType, Result};

/// PyTorch's two AMP kernels, on f32 scalar storages of the backend.
pub(crate) trait AmpOps: BackendStorage {
    /// `_amp_foreach_non_finite_check_and_unscale_` for one gradient (`self`, walked in
    /// storage order): every element times `inv_scale`, stored as `out` (the gradient's dtype
    /// or f32) in the same order; `found_inf` becomes 1 when an element is inf or NaN and is
    /// left as it is otherwise.
    fn unscale_grad(&self, inv_scale: &Self, found_inf: &mut Self, out: DType) -> Result<Self>;
    /// `_amp_update_scale_` (`self` is the scale): back off after an overflow, else grow
    /// every `interval` clean steps while finite.
    fn update_scale(
        &mut self,
        tracker: &mut Self,
        found_inf: &Self,
        growth: f32,
        backoff: f32,
        interval: i32,
    ) -> Result<()>;
}

impl Storage {
    /// See [`AmpOps::unscale_grad`]: one pass, and no host read on CUDA.
    pub(crate) fn unscale_grad(
        &self,
        inv_scale: &Storage,
        found_inf: &mut Storage,
        out: DType,
    ) -> Result<Storage> {
        on_backend!("GradScaler::unscale_", [self, inv_scale, found_inf], B => {
            let g = B::part(self);
            Ok(g.unscale_grad(B::part(inv_scale), B::part_mut(found_inf), out)?.wrap())
        })
    }

    /// See [`AmpOps::update_scale`].
    pub(crate) fn update_scale(
        &mut self,
        tracker: &mut Storage,
        found_inf: &Storage,
        growth: f64,
        backoff: f64,
        interval: usize,
    ) -> Result<()> {
        let interval = i32::try_from(interval).unwrap_or(i32::MAX);
        let (growth, backoff) = (growth as f32, backoff as f32);
        on_backend!("GradScaler::update", [self, tracker, found_inf], B => {
            B::part_mut(self).update_scale(
                B::part_mut(tracker),
                B::part(found_inf),
                growth,
                backoff,
                interval,
            )
        })
    }
}
