//! Fused optimizer updates: the [`OptimOps`] family and its dispatch.

use super::ops::OptimUpdate;
use super::rounding::Rounding;
use super::{on_device, BackendStorage, Storage};
use crate::Result;

/// In-place optimizer updates on a parameter (or its f32 master) and its states.
pub(crate) trait OptimOps: BackendStorage {
    /// Applies `u` in place (`self` is the parameter, or its f32 master when `working` is
    /// given: then the f16/bf16 working copy is written in the same pass) and counts it in
    /// `step`, unless `found_inf` holds a nonzero flag.
    fn optim_update(
        &mut self,
        grad: &Self,
        states: &mut [&mut Self],
        step: &mut Self,
        found_inf: Option<&Self>,
        u: &OptimUpdate,
        working: Option<(&mut Self, Rounding)>,
    ) -> Result<()>;
    /// Writes the f32 `master` into this f16/bf16 working copy with `rounding`, drawing the
    /// stochastic bits of the last update counted in `step` (an f32 scalar).
    fn round_from_master(&mut self, master: &Self, rounding: Rounding, step: &Self) -> Result<()>;
}

impl Storage {
    /// See [`OptimOps::optim_update`].
    pub(crate) fn optim_update(
        &mut self,
        grad: &Storage,
        states: &mut [&mut Storage],
        step: &mut Storage,
        found_inf: Option<&Storage>,
        u: &OptimUpdate,
        working: Option<(&mut Storage, Rounding)>,
    ) -> Result<()> {
        let mut all: Vec<&Storage> = vec![&*self, grad, &*step];
        all.extend(states.iter().map(|s| &**s));
        all.extend(found_inf);
        if let Some((w, _)) = &working {
            all.push(&**w);
        }
        let device = super::common_device("optim_update", &all)?;
        on_device!(device, B => {
            let mut st: Vec<&mut B> = states.iter_mut().map(|s| B::part_mut(s)).collect();
            B::part_mut(self).optim_update(
                B::part(grad),
                &mut st,
                B::part_mut(step),
                found_inf.map(B::part),
                u,
                working.map(|(w, r)| (B::part_mut(w), r)),
            )
        })
    }

    /// See [`OptimOps::round_from_master`].
    pub(crate) fn round_from_master(
        &mut self,
        master: &Storage,
        rounding: Rounding,
        step: &Storage,
    ) -> Result<()> {
        super::on_backend!("round_from_master", [self, master, step], B => {
            B::part_mut(self).round_from_master(B::part(master), rounding, B::part(step))
        })
    }
}
