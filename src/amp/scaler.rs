//! Dynamic loss scaling with PyTorch's `GradScaler` semantics.
//!
//! The scale, the growth tracker and the found-inf flag are 0-d f32 tensors on the
//! parameters' device. `unscale_` multiplies the gradients by `1 / scale` and sets the flag
//! when any of them is not finite; `step` hands the flag to the optimizer, whose fused kernels
//! skip the update by themselves; `update` grows or backs off the scale. Unscaling is one
//! pass per gradient and the update one step, as PyTorch's `_amp_*` kernels (`cuda/amp.cu` on
//! the GPU). No step reads a value back to the host.

use crate::optim::Optimizer;
use crate::{no_grad, DType, Device, Error, Result, Tensor};
use std::collections::HashMap;

/// Hyperparameters of a [`GradScaler`], PyTorch's defaults in `Default`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerConfig {
    pub init_scale: f64,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: usize,
    /// When false every method is a no-op (scale returns the loss, step steps).
    pub enabled: bool,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        GradScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Unscaled,
    Stepped,
}

/// The loss scaler. One scaler serves any number of losses and optimizers; call `update`
/// once per iteration.
///
/// ```
/// use mantissa::{amp::GradScaler, optim::{Optimizer, Sgd, SgdConfig}, Tensor, Device};
/// let w = Tensor::from_vec(vec![1.0f32, 2.0], &[2], Device::Cpu)?.requires_grad(true)?;
/// let mut opt = Sgd::new(vec![w.clone()], SgdConfig::new(0.1))?;
/// let mut scaler = GradScaler::new(Default::default())?;
/// let loss = w.sqr()?.sum_all()?;
/// scaler.scale(&loss)?.backward()?;
/// scaler.step(&mut opt)?;
/// scaler.update()?;
/// assert_eq!(w.to_vec::<f32>()?, vec![0.8, 1.6]);
/// # Ok::<(), mantissa::Error>(())
/// ```
pub struct GradScaler {
    cfg: GradScalerConfig,
    scale: Option<Tensor>,
    tracker: Option<Tensor>,
    /// Per optimizer (by address): its stage and found-inf flag since the last update.
    per_opt: HashMap<usize, (Stage, Tensor)>,
}

fn key(opt: &dyn Optimizer) -> usize {
    opt as *const dyn Optimizer as *const () as usize
}

fn scalar(v: f64, device: Device) -> Result<Tensor> {
    Tensor::scalar(v, DType::F32, device)
}

impl GradScaler {
    pub fn new(cfg: GradScalerConfig) -> Result<GradScaler> {
        let ok = cfg.init_scale.is_finite()
            && cfg.init_scale > 0.0
            && cfg.growth_factor > 1.0
            && cfg.backoff_factor > 0.0
            && cfg.backoff_factor < 1.0
            && cfg.growth_interval > 0;
        if !ok {
            return Err(Error::invalid(
                "GradScaler::new",
                format!("need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval > 0; got {cfg:?}"),
            ));
        }
        Ok(GradScaler {
            cfg,
            scale: None,
            tracker: None,
            per_opt: HashMap::new(),
        })
    }

    pub fn is_enabled(&self) -> bool {
        self.cfg.enabled
    }

    /// `loss * scale` (the scale is created on the loss's device on first use, and moved
    /// there if it was loaded on another).
    pub fn scale(&mut self, loss: &Tensor) -> Result<Tensor> {
        if !self.cfg.enabled {
            return Ok(loss.clone());
        }
        let s = match &self.scale {
            Some(s) if s.device() == loss.device() => s.clone(),
            // A state loaded on another device (a checkpoint read on the host, say) moves to
            // the loss's device, as PyTorch's scaler does.
            Some(s) => {
                let s = s.to_device(loss.device())?.copy()?;
                let t = match &self.tracker {
                    Some(t) => t.to_device(loss.device())?.copy()?,
                    None => scalar(0.0, loss.device())?,
                };
                self.tracker = Some(t);
                self.scale = Some(s.clone());
                s
            }
            None => {
                let s = scalar(self.cfg.init_scale, loss.device())?;
                self.tracker = Some(scalar(0.0, loss.device())?);
                self.scale = Some(s.clone());
                s
            }
        };
        // f32 scale times the loss, in f32: an f16 loss is promoted (65536 does not fit in
        // f16), whatever its shape (a 0-d f32 factor alone would not promote a loss with dims).
        let _ac = crate::amp::autocast_disabled();
        let loss = match loss.dtype() {
            DType::F16 | DType::BF16 => loss.to_dtype(DType::F32)?,
            _ => loss.clone(),
        };
        loss.mul(&s)
    }

    /// The current scale (a host read, for logging), or `None` before the first `scale`.
    pub fn current_scale(&self) -> Result<Option<f64>> {
        self.scale.as_ref().map(|s| s.item()).transpose()
    }

    /// Divides `opt`'s gradients by the scale in place and records whether any is inf/NaN.
    /// Call it before clipping; `step` then does not unscale again.
    pub fn unscale_(&mut self, opt: &mut dyn Optimizer) -> Result<()> {
        let _prof = crate::profiler::op("grad_scaler.unscale_");
        if !self.cfg.enabled {
            return Ok(());
        }
        match self.per_opt.get(&key(opt)).map(|s| s.0) {
            Some(Stage::Unscaled) => {
                return Err(Error::invalid(
                    "GradScaler::unscale_",
                    "unscale_() has already been called on this optimizer since the last update()",
                ))
            }
            Some(Stage::Stepped) => {
                return Err(Error::invalid(
                    "GradScaler::unscale_",
                    "unscale_() is being called after step()",
                ))
            }
            None => {}
        }
        let Some(scale) = self.scale.clone() else {
            return Err(Error::invalid(
                "GradScaler::unscale_",
                "no scaled loss yet: call scale() first",
            ));
        };
        let found = no_grad(|| -> Result<Tensor> {
            let _ac = crate::amp::autocast_disabled();
            // PyTorch takes 1 / scale in f64 and rounds it to f32; an IEEE f32 division
            // gives the same bits (a correctly rounded quotient survives double rounding
            // from f64), and works on devices without f64.
            let inv = scale.recip()?;
            let found = scalar(0.0, scale.device())?;
            let masters = opt.master_weights().is_some();
            let mut params = Vec::new();
            let mut grads = Vec::new();
            for p in opt.params() {
                let Some(g) = p.grad() else { continue };
                if g.dtype() == DType::F16 && !masters {
                    return Err(Error::DType {
                        op: "GradScaler::unscale_",
                        dtype: DType::F16,
                        expected: "f32 gradients (attempting to unscale FP16 gradients: keep f32 parameters, or turn on Optimizer::use_master_weights)",
                    });
                }
                // Each gradient is walked where it lies, a dense range of its storage (its
                // memory format kept; a view of a data-parallel bucket is not copied); one
                // whose elements are not one dense range is copied first.
                grads.push(crate::optim::in_storage_order(g)?);
                params.push(p);
            }
            // One fused pass over every gradient (PyTorch's
            // _amp_foreach_non_finite_check_and_unscale_): one launch per dtype and list of
            // gradients on CUDA, in place as PyTorch's. With fp32 master weights the unscaled
            // gradients are new f32 ones (Apex O2's master gradients), so f16 gradients are
            // fine there.
            let out = masters.then_some(DType::F32);
            let op = "GradScaler::unscale_";
            crate::optim::scale_grads(op, &params, &grads, &inv, &found, out)?;
            Ok(found)
        })?;
        self.per_opt.insert(key(opt), (Stage::Unscaled, found));
        Ok(())
    }

    /// Unscales (unless done already) and steps `opt`, which skips the update when a gradient
    /// was not finite. A second call before `update` is an error.
    pub fn step(&mut self, opt: &mut dyn Optimizer) -> Result<()> {
        if !self.cfg.enabled {
            return opt.step();
        }
        match self.per_opt.get(&key(opt)).map(|s| s.0) {
            Some(Stage::Stepped) => {
                return Err(Error::invalid(
                    "GradScaler::step",
                    "step() has already been called since the last update()",
                ))
            }
            Some(Stage::Unscaled) => {}
            None => self.unscale_(opt)?,
        }
        let entry = self.per_opt.get_mut(&key(opt)).expect("unscaled above");
        opt.step_unless(Some(&entry.1))?;
        entry.0 = Stage::Stepped;
        Ok(())
    }

    /// Adjusts the scale: backoff when any optimizer saw an inf/NaN, growth after
    /// `growth_interval` clean steps (only to a finite value); then readies the next step.
    pub fn update(&mut self) -> Result<()> {
        let _prof = crate::profiler::op("grad_scaler.update");
        if !self.cfg.enabled {
            return Ok(());
        }
        let (Some(scale), Some(tracker)) = (self.scale.clone(), self.tracker.clone()) else {
            return Ok(());
        };
        let flags: Vec<Tensor> = self.per_opt.drain().map(|(_, (_, f))| f).collect();
        if flags.is_empty() {
            return Err(Error::invalid(
                "GradScaler::update",
                "no optimizer was stepped or unscaled since the last update()",
            ));
        }
        let c = &self.cfg;
        no_grad(|| -> Result<()> {
            let _ac = crate::amp::autocast_disabled();
            let mut found = flags[0].clone();
            for f in &flags[1..] {
                found = found.maximum(f)?;
            }
            // PyTorch's _amp_update_scale_, in one step on the device.
            Tensor::write_many("GradScaler::update", &[&scale, &tracker], |s| {
                let (sc, tr) = s.split_at_mut(1);
                let f = found.storage();
                sc[0].update_scale(
                    tr[0],
                    &f,
                    c.growth_factor,
                    c.backoff_factor,
                    c.growth_interval,
                )
            })
        })
    }

    /// `scale`, `growth_factor`, `backoff_factor`, `growth_interval`, `_growth_tracker`
    /// (empty when disabled).
    pub fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        if !self.cfg.enabled {
            return Ok(Vec::new());
        }
        let dev = self.scale.as_ref().map_or(Device::Cpu, |s| s.device());
        let scale = match &self.scale {
            Some(s) => s.copy()?,
            None => scalar(self.cfg.init_scale, dev)?,
        };
        let tracker = match &self.tracker {
            Some(t) => t.copy()?,
            None => scalar(0.0, dev)?,
        };
        Ok(vec![
            ("scale".into(), scale),
            ("growth_factor".into(), scalar(self.cfg.growth_factor, dev)?),
            (
                "backoff_factor".into(),
                scalar(self.cfg.backoff_factor, dev)?,
            ),
            (
                "growth_interval".into(),
                scalar(self.cfg.growth_interval as f64, dev)?,
            ),
            ("_growth_tracker".into(), tracker),
        ])
    }

    /// Restores a [`GradScaler::state_dict`].
    pub fn load_state_dict(&mut self, entries: &[(String, Tensor)]) -> Result<()> {
        if entries.is_empty() {
            return Err(Error::invalid(
                "GradScaler::load_state_dict",
                "the state is empty (saved from a disabled scaler)",
            ));
        }
        let get = |k: &str| {
            entries
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, t)| t.clone())
                .ok_or_else(|| {
                    Error::invalid("GradScaler::load_state_dict", format!("missing entry {k}"))
                })
        };
        // Everything is read and checked before the scaler changes: a refused state leaves
        // it as it was.
        let interval = get("growth_interval")?.item()?;
        if !((1.0..=u32::MAX as f64).contains(&interval) && interval.fract() == 0.0) {
            return Err(Error::invalid(
                "GradScaler::load_state_dict",
                format!("growth_interval {interval} is not a positive integer"),
            ));
        }
        let cfg = GradScalerConfig {
            init_scale: self.cfg.init_scale,
            growth_factor: get("growth_factor")?.item()?,
            backoff_factor: get("backoff_factor")?.item()?,
            growth_interval: interval as usize,
            enabled: true,
        };
        let one = |k: &str| -> Result<Tensor> {
            let t = get(k)?;
            if t.numel() != 1 {
                return Err(Error::invalid(
                    "GradScaler::load_state_dict",
                    format!("{k} has shape {:?}, expected one element", t.shape()),
                ));
            }
            t.to_dtype(DType::F32)?.copy()
        };
        let (scale, tracker) = (one("scale")?, one("_growth_tracker")?);
        let mut fresh = GradScaler::new(cfg)?;
        fresh.scale = Some(scale);
        fresh.tracker = Some(tracker);
        *self = fresh;
        Ok(())
    }
}
