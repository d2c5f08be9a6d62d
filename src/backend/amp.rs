//! The gradient scaler's device work: the [`AmpOps`] family and its dispatch.

use super::{on_backend, Backend, BackendStorage, Storage};
use crate::{DType, Result};

/// PyTorch's two AMP kernels, on f32 scalar storages of the backend.
pub(crate) trait AmpOps: BackendStorage {
    /// `_amp_foreach_non_finite_check_and_unscale_` (each gradient walked in storage order):
    /// every element times `inv_scale`, stored as `out` (the gradient's dtype or f32) in the
    /// same order, one new storage per gradient; `found_inf` becomes 1 when an element is inf
    /// or NaN and is left as it is otherwise.
    fn unscale_grads(
        grads: &[&Self],
        inv_scale: &Self,
        found_inf: &mut Self,
        out: DType,
    ) -> Result<Vec<Self>>;
    /// [`AmpOps::unscale_grads`] in place: each gradient (walked in storage order) times
    /// `inv_scale` in its own dtype, written over itself.
    fn unscale_grads_(
        grads: &mut [&mut Self],
        inv_scale: &Self,
        found_inf: &mut Self,
    ) -> Result<()>;
    /// The sum of the squares of every element of every gradient (each walked in storage
    /// order), accumulated in f32 or wider: a one-element f32 storage (gradient clipping's
    /// total, PyTorch's `_foreach_norm`). Needs at least one gradient.
    fn sum_squares(grads: &[&Self]) -> Result<Self>;
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
    /// See [`AmpOps::unscale_grads`]: one pass, and no host read on CUDA.
    pub(crate) fn unscale_grads(
        grads: &[&Storage],
        inv_scale: &Storage,
        found_inf: &mut Storage,
        out: DType,
    ) -> Result<Vec<Storage>> {
        let mut all = grads.to_vec();
        all.extend([inv_scale, &*found_inf]);
        let device = super::common_device("GradScaler::unscale_", &all)?;
        super::on_device!(device, B => {
            let parts: Vec<&B> = grads.iter().map(|g| B::part(g)).collect();
            let f = B::part_mut(found_inf);
            let outs = B::unscale_grads(&parts, B::part(inv_scale), f, out)?;
            Ok(outs.into_iter().map(|s| s.wrap()).collect())
        })
    }

    /// See [`AmpOps::unscale_grads_`]: one pass, and no host read on CUDA.
    pub(crate) fn unscale_grads_(
        grads: &mut [&mut Storage],
        inv_scale: &Storage,
        found_inf: &mut Storage,
    ) -> Result<()> {
        let mut all: Vec<&Storage> = grads.iter().map(|g| &**g).collect();
        all.extend([inv_scale, &*found_inf]);
        let device = super::common_device("GradScaler::unscale_", &all)?;
        super::on_device!(device, B => {
            let mut parts: Vec<&mut B> = grads.iter_mut().map(|g| B::part_mut(g)).collect();
            B::unscale_grads_(&mut parts, B::part(inv_scale), B::part_mut(found_inf))
        })
    }

    /// See [`AmpOps::sum_squares`]: no host read on CUDA.
    pub(crate) fn sum_squares(grads: &[&Storage]) -> Result<Storage> {
        if grads.is_empty() {
            return Err(crate::Error::invalid(
                "clip_grad_norm",
                "no gradients to sum",
            ));
        }
        let device = super::common_device("clip_grad_norm", grads)?;
        super::on_device!(device, B => {
            let parts: Vec<&B> = grads.iter().map(|g| B::part(g)).collect();
            Ok(B::sum_squares(&parts)?.wrap())
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
