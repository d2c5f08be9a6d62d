//! fp32 master weights: the optimizer keeps an f32 master (state `master`) for each f16/bf16
//! parameter, which then is only the working copy the model computes with. The fused update
//! writes master, f32 moments and the rounded working copy in one pass.

use super::{ParamGroup, Rounding};
use crate::backend::rounding::stream_seed;
use crate::{DType, Error, Result, Tensor};

/// An owned f32 copy of `t`.
fn f32_copy(t: &Tensor) -> Result<Tensor> {
    let c = t.detach().to_dtype(DType::F32)?;
    if c.fills_storage() && !c.shares_storage(t) {
        Ok(c)
    } else {
        c.copy()?.filled_in(t.memory_format())
    }
}

impl ParamGroup {
    /// Turns master weights on (see [`super::Optimizer::use_master_weights`]).
    pub(crate) fn use_master_weights(&mut self, rounding: Rounding) -> Result<()> {
        if let Rounding::Stochastic { .. } = rounding {
            if let Some((i, p)) = self
                .params
                .iter()
                .enumerate()
                .find(|(_, p)| p.dtype() == DType::F16)
            {
                return Err(Error::invalid(
                    "use_master_weights",
                    format!(
                        "stochastic rounding writes bf16 working copies; parameter {i} {:?} \
                         is F16 (use Rounding::Nearest)",
                        p.shape()
                    ),
                ));
            }
        }
        self.masters = Some(rounding);
        self.adopt_masters()
    }

    /// Gives every half parameter an f32 master (from its current value) if it has none, and
    /// widens its other states to f32.
    pub(crate) fn adopt_masters(&mut self) -> Result<()> {
        crate::no_grad(|| {
            for (p, st) in self.params.iter().zip(&mut self.states) {
                if !p.dtype().is_half() {
                    continue;
                }
                if !p.fills_storage() {
                    return Err(Error::invalid(
                        "use_master_weights",
                        format!(
                            "parameters must be whole contiguous or channels-last tensors (got \
                             a view of shape {:?}, strides {:?})",
                            p.shape(),
                            p.strides()
                        ),
                    ));
                }
                for (name, t) in st.tensors.iter_mut() {
                    if name != "step" && t.dtype() != DType::F32 {
                        *t = f32_copy(t)?;
                    }
                }
                if !st.tensors.contains_key("master") {
                    st.tensors.insert("master".into(), f32_copy(p)?);
                }
            }
            Ok(())
        })
    }

    /// The rounding of parameter `i`'s working copy: stochastic streams differ per parameter.
    fn rounding_for(&self, i: usize) -> Option<Rounding> {
        self.masters.map(|r| match r {
            Rounding::Stochastic { seed } => Rounding::Stochastic {
                seed: stream_seed(seed, i),
            },
            Rounding::Nearest => Rounding::Nearest,
        })
    }

    /// The tensor the update of parameter `i` computes on (its master, or the parameter
    /// itself) and, with a master, the working copy to write with its rounding.
    pub(crate) fn target(&mut self, i: usize) -> Result<(Tensor, Option<(Tensor, Rounding)>)> {
        let p = self.params[i].clone();
        let Some(rounding) = self.rounding_for(i).filter(|_| p.dtype().is_half()) else {
            return Ok((p, None));
        };
        if !self.states[i].tensors.contains_key("master") {
            self.adopt_masters()?;
        }
        let mut master = self.states[i].tensors["master"].clone();
        if master.shape() == p.shape() && master.memory_format() != p.memory_format() {
            // The update walks master and working copy together: one memory order.
            master = master.filled_in(p.memory_format())?;
            self.states[i]
                .tensors
                .insert("master".into(), master.clone());
        }
        if master.shape() != p.shape() || master.dtype() != DType::F32 {
            return Err(Error::invalid(
                "optimizer step",
                format!(
                    "master weight {i} is {:?} {:?}, its parameter {:?}",
                    master.shape(),
                    master.dtype(),
                    p.shape()
                ),
            ));
        }
        Ok((master, Some((p, rounding))))
    }

    /// Rewrites every working copy from its master, with the rounding (and stochastic bits)
    /// of the last update, so a restored checkpoint gives back the same working weights.
    pub(crate) fn sync_working_copies(&mut self) -> Result<()> {
        (0..self.params.len()).try_for_each(|i| self.resync(i))
    }

    /// Rewrites parameter `i`'s working copy from its master (after a load, or after the
    /// master was changed outside the fused update, as SGLD's noise does), with the bits of
    /// the last update; the kernel reads the step count itself, so no host read is needed.
    pub(crate) fn resync(&mut self, i: usize) -> Result<()> {
        let (master, Some((p, rounding))) = self.target(i)? else {
            return Ok(());
        };
        let step = match self.states[i].tensors.get("step") {
            Some(t) => t.to_dtype(DType::F32)?,
            None => Tensor::zeros(&[], DType::F32, p.device())?,
        };
        let (ms, ss) = (master.storage(), step.storage());
        Tensor::write_many("sync working copy", &[&p], |s| {
            s[0].round_from_master(&ms, rounding, &ss)
        })
    }
}
