//! Optimizers (SGD, Adam, AdamW, SGLD, Adadelta, RMSprop, Adagrad), learning-rate schedules and
//! gradient clipping.
//!
//! Optimizers own the list of parameters they update and a state per parameter (momentum
//! buffers, moments, step counts), exposed as named tensors for checkpoints. Updates are done
//! in place under `no_grad`, so modules holding the parameters see the new values.

mod adadelta;
mod adam;
mod clip;
mod group;
mod master;
mod plateau;
mod rmsprop;
mod schedule;
mod sgd;

pub use crate::backend::rounding::Rounding;
pub use adadelta::Adadelta;
pub use adam::{Adam, AdamConfig};
pub use clip::clip_grad_norm;
pub(crate) use clip::{in_storage_order, scale_grads};
pub use group::{GroupOptions, ParamGroup, ParamState};
pub use plateau::{PlateauMode, ReduceLrOnPlateau, ThresholdMode};
pub use rmsprop::{Adagrad, RmsProp};
pub use schedule::{
    ConstantLr, CosineAnnealing, LinearWarmup, LrSchedule, MultiStepLr, OneCycle, StepLr,
};
pub use sgd::{Sgd, SgdConfig, Sgld};

use crate::{Error, Generator, Result, Tensor};
use std::collections::BTreeMap;

/// The common interface of the optimizers.
pub trait Optimizer {
    /// Applies one update to every parameter that has a gradient, unless `found_inf` (an f32
    /// scalar on the parameters' device, as [`crate::amp::GradScaler`] keeps it) is nonzero:
    /// then parameters and states stay bit-unchanged. The decision is taken by the update
    /// kernels, without reading the flag back to the host.
    fn step_unless(&mut self, found_inf: Option<&Tensor>) -> Result<()>;
    /// The parameters and their states.
    fn group(&self) -> &ParamGroup;
    fn group_mut(&mut self) -> &mut ParamGroup;
    fn lr(&self) -> f64;
    fn set_lr(&mut self, lr: f64);

    /// The optimizer's name, as PyTorch's class is named (`SGD`, `Adam`, `AdamW`, ...);
    /// checkpoints record it, and loading another optimizer's state is refused.
    fn name(&self) -> &'static str {
        "optimizer"
    }

    /// The states its update keeps per parameter besides `step` (and `master`), with its
    /// current settings (SGD's momentum buffer only with momentum): what
    /// [`Optimizer::check_state_tensors`] expects. `None` skips that check.
    fn state_names(&self) -> Option<Vec<&'static str>> {
        None
    }

    /// Turns on fp32 master weights: every f16/bf16 parameter becomes the working copy of an
    /// f32 master the optimizer keeps (state `master`, initialised from the parameter), the
    /// moments are kept in f32, and each update writes master, moments and working copy in
    /// one pass, rounding the working copy with `rounding` ([`Rounding::Stochastic`] needs
    /// bf16 parameters). f32 and f64 parameters are their own masters. Gradients may be
    /// f16/bf16 or f32 (the [`crate::amp::GradScaler`] unscales into f32 in this mode).
    ///
    /// ```
    /// use mantissa::{nn::{Linear, Module}, optim::{Adam, AdamConfig, Optimizer, Rounding}};
    /// use mantissa::{DType, Generator};
    /// let mut model = Linear::new(4, 2, true, &mut Generator::new(0))?;
    /// model.to_dtype(DType::BF16)?;
    /// let mut opt = Adam::new(model.parameters(), AdamConfig::adamw(1e-3))?;
    /// opt.use_master_weights(Rounding::Stochastic { seed: 0 })?;
    /// assert_eq!(opt.states()[0].tensors["master"].dtype(), DType::F32);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    fn use_master_weights(&mut self, rounding: Rounding) -> Result<()> {
        self.group_mut().use_master_weights(rounding)
    }
    /// The working-copy rounding when master weights are on.
    fn master_weights(&self) -> Option<Rounding> {
        self.group().masters
    }

    /// Adds a group of parameters with its own learning rate or weight decay (PyTorch's
    /// `add_param_group`). Its rate follows the optimizer's in the ratio given now, so a
    /// schedule's [`Optimizer::set_lr`] moves every group; states and checkpoint entries
    /// number the group's parameters after those already held.
    ///
    /// ```
    /// use mantissa::{nn::{Linear, Module}, optim::{GroupOptions, Optimizer, Sgd, SgdConfig}};
    /// use mantissa::Generator;
    /// let model = Linear::new(4, 2, true, &mut Generator::new(0))?;
    /// // Weights decay, biases (and norms) do not.
    /// let (decay, no_decay): (Vec<_>, Vec<_>) =
    ///     model.parameters().into_iter().partition(|p| p.rank() > 1);
    /// let cfg = SgdConfig { weight_decay: 1e-4, ..SgdConfig::new(0.1) };
    /// let mut opt = Sgd::new(decay, cfg)?;
    /// opt.add_param_group(no_decay, GroupOptions { weight_decay: Some(0.0), lr: Some(0.2) })?;
    /// opt.set_lr(0.05);
    /// assert_eq!(opt.param_group_lrs(), vec![0.05, 0.1]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    fn add_param_group(&mut self, params: Vec<Tensor>, options: GroupOptions) -> Result<()> {
        let lr = self.lr();
        self.group_mut().add_group(params, options, lr)
    }

    /// Every group's learning rate, the constructor's parameters' first.
    fn param_group_lrs(&self) -> Vec<f64> {
        self.group().group_lrs(self.lr())
    }

    /// Sets every group's learning rate (one per group, the constructor's parameters'
    /// first), as PyTorch's schedulers set `param_groups[i]['lr']` each: what
    /// [`ReduceLrOnPlateau::step_optimizer`] does when a floor keeps one group from falling
    /// with the others. Later [`Optimizer::set_lr`] calls move the groups in the new ratios.
    ///
    /// ```
    /// use mantissa::{nn::{Linear, Module}, optim::{GroupOptions, Optimizer, Sgd, SgdConfig}};
    /// use mantissa::Generator;
    /// let model = Linear::new(4, 2, true, &mut Generator::new(0))?;
    /// let mut p = model.parameters();
    /// let bias = p.pop().unwrap();
    /// let mut opt = Sgd::new(p, SgdConfig::new(0.1))?;
    /// opt.add_param_group(vec![bias], GroupOptions { lr: Some(0.2), ..Default::default() })?;
    /// opt.set_param_group_lrs(&[0.01, 0.05])?;
    /// assert_eq!(opt.param_group_lrs(), vec![0.01, 0.05]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    fn set_param_group_lrs(&mut self, lrs: &[f64]) -> Result<()> {
        self.group_mut().set_ratios(lrs)?;
        self.set_lr(lrs[0]);
        Ok(())
    }

    /// Applies one update to every parameter that has a gradient.
    fn step(&mut self) -> Result<()> {
        self.step_unless(None)
    }

    /// The parameters, in the order they were given.
    fn params(&self) -> &[Tensor] {
        &self.group().params
    }
    /// Per-parameter states, aligned with [`Optimizer::params`].
    fn states(&self) -> &[ParamState] {
        &self.group().states
    }
    /// Mutable states (for loading a checkpoint).
    fn states_mut(&mut self) -> &mut [ParamState] {
        &mut self.group_mut().states
    }

    /// Drops every parameter's gradient (frees the memory, like `set_to_none=True`).
    fn zero_grad(&mut self) {
        for p in self.params() {
            p.zero_grad();
        }
    }

    /// The optimizer's own random generator, where it draws (SGLD's noise): saved with the
    /// state as `generator`, so a resumed run draws what an uninterrupted one would.
    fn generator(&self) -> Option<Generator> {
        None
    }

    /// Puts the generator [`Optimizer::generator`] reports at `gen`'s state; optimizers
    /// without one ignore it.
    fn set_generator(&mut self, _gen: Generator) {}

    /// The state as named tensors, `{i}.{name}` per parameter (`{i}.step` included), and
    /// `generator` for an optimizer that draws.
    fn state_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for (i, s) in self.states().iter().enumerate() {
            for (k, t) in &s.tensors {
                out.push((format!("{i}.{k}"), t.clone()));
            }
        }
        if let Some(g) = self.generator() {
            out.push((GENERATOR.to_string(), g.state_tensor()));
        }
        Ok(out)
    }

    /// Checks a state for [`Optimizer::load_state_tensors`] without changing anything: every
    /// entry is `{i}.{name}` with `i` below the parameter count, `step` is a one-element
    /// counter, every other state has its parameter's shape and a float dtype, and a master
    /// weight is present only with master weights on. Every problem is listed.
    fn check_state_tensors(&self, named: &BTreeMap<String, Tensor>) -> Result<()> {
        let params = self.params();
        let n = params.len();
        let mut problems = Vec::new();
        for (name, t) in named {
            if name == GENERATOR {
                match self.generator() {
                    None => {
                        problems.push("a generator state, for an optimizer that draws none".into())
                    }
                    Some(_) => {
                        if let Err(e) = Generator::from_tensor(t) {
                            problems.push(e.to_string());
                        }
                    }
                }
                continue;
            }
            let Some((i, key)) = state_entry(name, n) else {
                problems.push(format!("unexpected entry {name:?} for {n} parameters"));
                continue;
            };
            let p = &params[i];
            if key == "step" {
                if t.numel() != 1 {
                    problems.push(format!(
                        "{name} has shape {:?}, expected one element",
                        t.shape()
                    ));
                }
            } else if t.shape() != p.shape() || !t.dtype().is_float() {
                problems.push(format!(
                    "{name} is {:?} {:?}, its parameter {:?} {:?}",
                    t.shape(),
                    t.dtype(),
                    p.shape(),
                    p.dtype()
                ));
            } else if key == "master" && self.master_weights().is_none() {
                problems.push(format!(
                    "parameter {i} has a master weight in the state: call use_master_weights \
                     before loading"
                ));
            }
        }
        if let Some(keeps) = self.state_names() {
            problems.extend(foreign_states(self.name(), &keeps, named, n));
        }
        match problems.is_empty() {
            true => Ok(()),
            false => Err(Error::invalid("load_state_tensors", problems.join("; "))),
        }
    }

    /// Restores a state written by [`Optimizer::state_tensors`]; parameter counts must match.
    /// The state is checked first ([`Optimizer::check_state_tensors`]) and copied to the
    /// parameters' devices before the optimizer's own is replaced, so a refused state changes
    /// nothing. With master weights on, the working copies are then regenerated from the
    /// masters (bit-exactly as the last update wrote them, stochastic rounding included).
    fn load_state_tensors(&mut self, named: &BTreeMap<String, Tensor>) -> Result<()> {
        self.check_state_tensors(named)?;
        let devices: Vec<_> = self.params().iter().map(|p| p.device()).collect();
        let mut fresh = vec![ParamState::default(); devices.len()];
        let generator = named
            .get(GENERATOR)
            .map(Generator::from_tensor)
            .transpose()?;
        if generator.is_none() && self.generator().is_some() {
            log::warn!(
                "load_state_tensors: the state has no generator; the optimizer's random \
                 stream goes on from where it stands"
            );
        }
        for (name, t) in named {
            let Some((i, key)) = state_entry(name, devices.len()) else {
                continue; // the generator, or refused by check_state_tensors above
            };
            fresh[i]
                .tensors
                .insert(key.to_string(), t.to_device(devices[i])?.copy()?);
        }
        if let Some(gen) = generator {
            self.set_generator(gen);
        }
        let g = self.group_mut();
        g.states.clone_from_slice(&fresh);
        if g.masters.is_some() {
            g.adopt_masters()?;
            g.sync_working_copies()?;
        }
        Ok(())
    }
}

/// The name of an optimizer's generator state in [`Optimizer::state_tensors`].
const GENERATOR: &str = "generator";

/// The problems of a state written by another optimizer, or the same one with other
/// settings, for one that is `name` and keeps `keeps` beside `step` and `master`: states it
/// does not keep (they would be dropped) and, for a parameter that has taken steps, states
/// it keeps that are missing (they would start from zero mid-run).
fn foreign_states(
    name: &str,
    keeps: &[&str],
    named: &BTreeMap<String, Tensor>,
    n: usize,
) -> Vec<String> {
    let mut by_param: BTreeMap<usize, Vec<&str>> = BTreeMap::new();
    for entry in named.keys() {
        if let Some((i, key)) = state_entry(entry, n) {
            by_param.entry(i).or_default().push(key);
        }
    }
    let mut problems = Vec::new();
    for (i, keys) in by_param {
        for k in keys.iter().filter(|k| !matches!(**k, "step" | "master")) {
            if !keeps.contains(k) {
                problems.push(format!(
                    "{i}.{k}: {name} keeps no state {k:?} (it keeps {keeps:?}): the state is \
                     another optimizer's, or one with other settings"
                ));
            }
        }
        if keys.contains(&"step") {
            for k in keeps.iter().filter(|k| !keys.contains(k)) {
                problems.push(format!(
                    "{i}.{k} is missing: {name} needs it beside the step count (the state is \
                     another optimizer's, or one with other settings)"
                ));
            }
        }
    }
    problems
}

/// Parameter index and state name of a `{i}.{name}` state entry, for `n` parameters.
fn state_entry(name: &str, n: usize) -> Option<(usize, &str)> {
    name.split_once('.')
        .and_then(|(i, k)| Some((i.parse::<usize>().ok()?, k)))
        .filter(|(i, _)| *i < n)
}

/// Checks a hyperparameter is finite and not negative.
pub(crate) fn check_hyper(op: &'static str, name: &str, v: f64) -> Result<()> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(Error::invalid(
            op,
            format!("{name} = {v} must be finite and >= 0"),
        ))
    }
}
