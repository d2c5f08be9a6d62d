//! Learning-rate schedules as pure functions of the step (or epoch) index, with PyTorch's
//! formulas. Apply with `opt.set_lr(schedule.lr(step))`; [`LrSchedule::check`] refuses
//! settings PyTorch would (a negative factor, a zero period).

use crate::{Error, Result};
use std::f64::consts::PI;

/// A learning rate for each step.
pub trait LrSchedule: Send + Sync {
    fn lr(&self, step: usize) -> f64;

    /// Every parameter group's rate at `step`, for groups whose rates before scheduling were
    /// `initial` (the first group's first), as PyTorch's schedulers set each group from its
    /// own initial rate; apply with [`super::Optimizer::set_param_group_lrs`]. By default each
    /// group follows this schedule's rate in its initial ratio to the first group (PyTorch's
    /// rule for the schedules that multiply a rate: [`StepLr`], [`MultiStepLr`],
    /// [`LinearWarmup`]); [`CosineAnnealing`] anneals each group toward the same `eta_min`,
    /// and [`OneCycle`] gives every group its one `max_lr` cycle, as PyTorch's do.
    ///
    /// ```
    /// use mantissa::optim::{CosineAnnealing, LrSchedule};
    /// let s = CosineAnnealing { base: 0.1, t_max: 10, eta_min: 0.001 };
    /// let lrs = s.group_lrs(10, &[0.1, 0.01]);
    /// assert!(lrs.iter().all(|lr| (lr - 0.001).abs() < 1e-12));
    /// ```
    fn group_lrs(&self, step: usize, initial: &[f64]) -> Vec<f64> {
        let lr = self.lr(step);
        match initial.first() {
            Some(&first) if first != 0.0 => initial.iter().map(|&b| lr * (b / first)).collect(),
            _ => vec![lr; initial.len()],
        }
    }

    /// `Err` naming the setting when one is out of its range (a rate or factor that is
    /// negative or not finite, a zero period): what a command line's flags go through.
    ///
    /// ```
    /// use mantissa::optim::{LrSchedule, StepLr};
    /// assert!(StepLr { base: 0.1, step_size: 1, gamma: -0.7 }.check().is_err());
    /// ```
    fn check(&self) -> Result<()> {
        Ok(())
    }
}

/// `Err` unless every `(name, value)` is finite and not negative.
fn nonnegative(op: &'static str, values: &[(&str, f64)]) -> Result<()> {
    values
        .iter()
        .try_for_each(|&(name, v)| super::check_hyper(op, name, v))
}

/// `Err` when a count that divides the steps is zero.
fn positive(op: &'static str, name: &str, v: usize) -> Result<()> {
    match v {
        0 => Err(Error::invalid(op, format!("{name} must be at least 1"))),
        _ => Ok(()),
    }
}

/// The same rate at every step.
#[derive(Debug, Clone, Copy)]
pub struct ConstantLr(pub f64);

impl LrSchedule for ConstantLr {
    fn lr(&self, _: usize) -> f64 {
        self.0
    }
    fn check(&self) -> Result<()> {
        nonnegative("ConstantLr", &[("lr", self.0)])
    }
}

/// `base * gamma^(step / step_size)` (`StepLR`).
#[derive(Debug, Clone, Copy)]
pub struct StepLr {
    pub base: f64,
    pub step_size: usize,
    pub gamma: f64,
}

impl LrSchedule for StepLr {
    fn lr(&self, step: usize) -> f64 {
        self.base * self.gamma.powi((step / self.step_size.max(1)) as i32)
    }
    fn check(&self) -> Result<()> {
        nonnegative("StepLr", &[("base", self.base), ("gamma", self.gamma)])?;
        positive("StepLr", "step_size", self.step_size)
    }
}

/// `eta_min + (base - eta_min) (1 + cos(pi t / t_max)) / 2` (`CosineAnnealingLR`, one
/// half-period; constant at `eta_min` after `t_max`).
#[derive(Debug, Clone, Copy)]
pub struct CosineAnnealing {
    pub base: f64,
    pub t_max: usize,
    pub eta_min: f64,
}

impl LrSchedule for CosineAnnealing {
    fn lr(&self, step: usize) -> f64 {
        let t = step.min(self.t_max) as f64 / self.t_max.max(1) as f64;
        self.eta_min + (self.base - self.eta_min) * (1.0 + (PI * t).cos()) / 2.0
    }
    fn group_lrs(&self, step: usize, initial: &[f64]) -> Vec<f64> {
        let each = |base| CosineAnnealing { base, ..*self }.lr(step);
        initial.iter().map(|&b| each(b)).collect()
    }
    fn check(&self) -> Result<()> {
        nonnegative(
            "CosineAnnealing",
            &[("base", self.base), ("eta_min", self.eta_min)],
        )?;
        positive("CosineAnnealing", "t_max", self.t_max)
    }
}

/// `OneCycleLR` with cosine annealing: from `max_lr / div_factor` up to `max_lr` over the
/// first `pct_start` of the steps, then down to `initial / final_div_factor`. The learning
/// rate only: PyTorch's `cycle_momentum=False` (its default also cycles momentum or Adam's
/// beta1).
#[derive(Debug, Clone, Copy)]
pub struct OneCycle {
    pub max_lr: f64,
    pub total_steps: usize,
    pub pct_start: f64,
    pub div_factor: f64,
    pub final_div_factor: f64,
}

impl OneCycle {
    /// PyTorch's defaults: pct_start 0.3, div_factor 25, final_div_factor 1e4.
    pub fn new(max_lr: f64, total_steps: usize) -> OneCycle {
        OneCycle {
            max_lr,
            total_steps,
            pct_start: 0.3,
            div_factor: 25.0,
            final_div_factor: 1e4,
        }
    }
}

fn cos_anneal(start: f64, end: f64, pct: f64) -> f64 {
    end + (start - end) / 2.0 * (1.0 + (PI * pct.clamp(0.0, 1.0)).cos())
}

impl LrSchedule for OneCycle {
    /// Every group the same cycle: PyTorch's `OneCycleLR` with one `max_lr` replaces the
    /// groups' own rates.
    fn group_lrs(&self, step: usize, initial: &[f64]) -> Vec<f64> {
        vec![self.lr(step); initial.len()]
    }
    fn lr(&self, step: usize) -> f64 {
        let initial = self.max_lr / self.div_factor;
        let min = initial / self.final_div_factor;
        let up_end = self.pct_start * self.total_steps as f64 - 1.0;
        let down_end = self.total_steps as f64 - 1.0;
        let s = step as f64;
        if s <= up_end {
            cos_anneal(initial, self.max_lr, s / up_end.max(1e-12))
        } else {
            cos_anneal(
                self.max_lr,
                min,
                (s - up_end) / (down_end - up_end).max(1e-12),
            )
        }
    }
    fn check(&self) -> Result<()> {
        nonnegative("OneCycle", &[("max_lr", self.max_lr)])?;
        let ok = (0.0..=1.0).contains(&self.pct_start)
            && self.div_factor > 0.0
            && self.final_div_factor > 0.0;
        match ok && self.div_factor.is_finite() && self.final_div_factor.is_finite() {
            true => Ok(()),
            false => Err(Error::invalid(
                "OneCycle",
                format!(
                    "pct_start {} must be in [0, 1], div_factor {} and final_div_factor {} \
                     positive",
                    self.pct_start, self.div_factor, self.final_div_factor
                ),
            )),
        }
    }
}

/// Scales another schedule linearly from `start_factor` to 1 over `warmup` steps (`LinearLR`
/// chained before it).
pub struct LinearWarmup<S: LrSchedule> {
    pub inner: S,
    pub warmup: usize,
    pub start_factor: f64,
}

impl<S: LrSchedule> LrSchedule for LinearWarmup<S> {
    fn lr(&self, step: usize) -> f64 {
        let f = if step >= self.warmup {
            1.0
        } else {
            self.start_factor + (1.0 - self.start_factor) * step as f64 / self.warmup as f64
        };
        self.inner.lr(step) * f
    }
    fn check(&self) -> Result<()> {
        nonnegative("LinearWarmup", &[("start_factor", self.start_factor)])?;
        self.inner.check()
    }
}

/// `base * gamma^k`, `k` the number of milestones at or before the step (`MultiStepLR`).
///
/// ```
/// use mantissa::optim::{LrSchedule, MultiStepLr};
/// let s = MultiStepLr { base: 0.1, milestones: vec![2, 5], gamma: 0.5 };
/// let lrs: Vec<f64> = (0..6).map(|t| s.lr(t)).collect();
/// assert_eq!(lrs, vec![0.1, 0.1, 0.05, 0.05, 0.05, 0.025]);
/// ```
#[derive(Debug, Clone)]
pub struct MultiStepLr {
    pub base: f64,
    pub milestones: Vec<usize>,
    pub gamma: f64,
}

impl LrSchedule for MultiStepLr {
    fn lr(&self, step: usize) -> f64 {
        let passed = self.milestones.iter().filter(|&&m| m <= step).count();
        self.base * self.gamma.powi(passed as i32)
    }
    fn check(&self) -> Result<()> {
        nonnegative("MultiStepLr", &[("base", self.base), ("gamma", self.gamma)])
    }
}
