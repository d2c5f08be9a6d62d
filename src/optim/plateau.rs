//! `ReduceLROnPlateau`: the learning rate cut when a watched metric stops improving. Unlike
//! the schedules, it depends on the metrics seen, so it keeps a state.

use super::Optimizer;
use crate::{Error, Result};

/// Whether the watched metric improves downwards (a loss) or upwards (an accuracy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlateauMode {
    Min,
    Max,
}

/// Whether `threshold` is relative to the best value so far or absolute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThresholdMode {
    Rel,
    Abs,
}

/// PyTorch's `ReduceLROnPlateau`: after more than `patience` epochs without an improvement
/// (beyond `threshold`) the rate is multiplied by `factor`, not below `min_lr`, and the count
/// waits `cooldown` epochs before it starts again. Call [`ReduceLrOnPlateau::step`] once per
/// epoch with the metric and give the rate it returns to the optimizer, or, for an optimizer
/// with parameter groups, [`ReduceLrOnPlateau::step_optimizer`], which cuts each group's rate
/// with its own floor (`min_lr`, or one value per group in `group_min_lrs`), as PyTorch's.
///
/// ```
/// use mantissa::optim::ReduceLrOnPlateau;
/// let mut plateau = ReduceLrOnPlateau::new(0.1);
/// plateau.patience = 1;
/// let lrs: Vec<f64> = [1.0, 0.5, 0.6, 0.7, 0.4]
///     .iter()
///     .map(|&loss| plateau.step(loss))
///     .collect::<Result<_, _>>()?;
/// assert_eq!(lrs, vec![0.1, 0.1, 0.1, 0.010000000000000002, 0.010000000000000002]);
/// // opt.set_lr(plateau.step(val_loss)?) in a training loop.
/// # Ok::<(), mantissa::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct ReduceLrOnPlateau {
    pub mode: PlateauMode,
    pub factor: f64,
    pub patience: usize,
    pub threshold: f64,
    pub threshold_mode: ThresholdMode,
    pub cooldown: usize,
    pub min_lr: f64,
    /// Each parameter group's floor for [`ReduceLrOnPlateau::step_optimizer`] (PyTorch's
    /// `min_lr` given as a list); empty: `min_lr` for every group.
    pub group_min_lrs: Vec<f64>,
    /// A cut smaller than this is not made.
    pub eps: f64,
    lr: f64,
    /// The best metric so far (none before the first).
    best: Option<f64>,
    bad_epochs: usize,
    cooldown_left: usize,
}

impl ReduceLrOnPlateau {
    /// Starting at rate `lr`, with PyTorch's defaults: mode min, factor 0.1, patience 10,
    /// threshold 1e-4 relative, no cooldown, min_lr 0, eps 1e-8.
    pub fn new(lr: f64) -> ReduceLrOnPlateau {
        ReduceLrOnPlateau {
            mode: PlateauMode::Min,
            factor: 0.1,
            patience: 10,
            threshold: 1e-4,
            threshold_mode: ThresholdMode::Rel,
            cooldown: 0,
            min_lr: 0.0,
            group_min_lrs: Vec::new(),
            eps: 1e-8,
            lr,
            best: None,
            bad_epochs: 0,
            cooldown_left: 0,
        }
    }

    /// The rate now.
    pub fn lr(&self) -> f64 {
        self.lr
    }

    /// Takes one epoch's metric and returns the rate for the next. A NaN metric counts as
    /// no improvement, as in PyTorch.
    pub fn step(&mut self, metric: f64) -> Result<f64> {
        self.check()?;
        if self.observe(metric) {
            self.lr = self.cut(self.lr, self.min_lr);
        }
        Ok(self.lr)
    }

    /// Takes one epoch's metric and, on a plateau, cuts every parameter group's rate of
    /// `opt` by `factor`, each not below its own floor (`group_min_lrs`, or `min_lr`), as
    /// PyTorch's scheduler does over `param_groups`: a group that reaches its floor stays
    /// there while the others go on. Returns the groups' rates for the next epoch.
    ///
    /// ```
    /// use mantissa::{nn::{Linear, Module}, optim::*, Generator};
    /// let model = Linear::new(4, 2, true, &mut Generator::new(0))?;
    /// let mut p = model.parameters();
    /// let bias = p.pop().unwrap();
    /// let mut opt = Sgd::new(p, SgdConfig::new(1.0))?;
    /// opt.add_param_group(vec![bias], GroupOptions { lr: Some(0.5), ..Default::default() })?;
    /// let mut plateau = ReduceLrOnPlateau::new(1.0);
    /// (plateau.patience, plateau.factor) = (0, 0.5);
    /// plateau.group_min_lrs = vec![0.1, 0.2];
    /// for loss in [1.0, 1.0, 1.0] {
    ///     plateau.step_optimizer(loss, &mut opt)?;
    /// }
    /// // Group 1 stopped at its floor of 0.2; group 0 went on to 0.25.
    /// assert_eq!(opt.param_group_lrs(), vec![0.25, 0.2]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn step_optimizer(&mut self, metric: f64, opt: &mut dyn Optimizer) -> Result<Vec<f64>> {
        self.check()?;
        let lrs = opt.param_group_lrs();
        let floors = match self.group_min_lrs.len() {
            0 => vec![self.min_lr; lrs.len()],
            n if n == lrs.len() => self.group_min_lrs.clone(),
            n => {
                return Err(Error::invalid(
                    "ReduceLrOnPlateau::step_optimizer",
                    format!(
                        "{n} values in group_min_lrs for an optimizer of {} parameter groups",
                        lrs.len()
                    ),
                ))
            }
        };
        if self.observe(metric) {
            let cut: Vec<f64> = lrs
                .iter()
                .zip(&floors)
                .map(|(&lr, &floor)| self.cut(lr, floor))
                .collect();
            opt.set_param_group_lrs(&cut)?;
            self.lr = cut[0];
        }
        Ok(opt.param_group_lrs())
    }

    /// Counts one epoch's metric: true when the rates are to be cut now.
    fn observe(&mut self, metric: f64) -> bool {
        if self.better(metric) {
            self.best = Some(metric);
            self.bad_epochs = 0;
        } else {
            self.bad_epochs += 1;
        }
        if self.cooldown_left > 0 {
            self.cooldown_left -= 1;
            self.bad_epochs = 0;
        }
        if self.bad_epochs > self.patience {
            self.cooldown_left = self.cooldown;
            self.bad_epochs = 0;
            return true;
        }
        false
    }

    /// `lr` times `factor`, not below `floor`; `lr` itself when the cut is `eps` or less.
    fn cut(&self, lr: f64, floor: f64) -> f64 {
        let cut = (lr * self.factor).max(floor);
        match lr - cut > self.eps {
            true => cut,
            false => lr,
        }
    }

    /// The state to save with a checkpoint: rate, best metric (NaN before the first),
    /// epochs without improvement, cooldown epochs left.
    pub fn state(&self) -> [f64; 4] {
        [
            self.lr,
            self.best.unwrap_or(f64::NAN),
            self.bad_epochs as f64,
            self.cooldown_left as f64,
        ]
    }

    /// Restores a state [`ReduceLrOnPlateau::state`] gave.
    pub fn load_state(&mut self, state: [f64; 4]) -> Result<()> {
        let [lr, best, bad, cool] = state;
        let count = |v: f64| v >= 0.0 && v.fract() == 0.0 && v < u32::MAX as f64;
        if !(lr.is_finite() && lr >= 0.0 && count(bad) && count(cool)) {
            return Err(Error::invalid(
                "ReduceLrOnPlateau::load_state",
                format!("not a state: lr {lr}, best {best}, counts {bad} and {cool}"),
            ));
        }
        (self.lr, self.best) = (lr, (!best.is_nan()).then_some(best));
        (self.bad_epochs, self.cooldown_left) = (bad as usize, cool as usize);
        Ok(())
    }

    fn better(&self, a: f64) -> bool {
        let (t, worst) = match self.mode {
            PlateauMode::Min => (self.threshold, f64::INFINITY),
            PlateauMode::Max => (self.threshold, f64::NEG_INFINITY),
        };
        let best = self.best.unwrap_or(worst);
        match (self.mode, self.threshold_mode) {
            (PlateauMode::Min, ThresholdMode::Rel) => a < best * (1.0 - t),
            (PlateauMode::Min, ThresholdMode::Abs) => a < best - t,
            (PlateauMode::Max, ThresholdMode::Rel) => a > best * (1.0 + t),
            (PlateauMode::Max, ThresholdMode::Abs) => a > best + t,
        }
    }

    fn check(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::invalid("ReduceLrOnPlateau::step", msg));
        if !(self.factor >= 0.0 && self.factor < 1.0) {
            return bad(format!("factor {} must be in [0, 1)", self.factor));
        }
        for (name, v) in [
            ("threshold", self.threshold),
            ("min_lr", self.min_lr),
            ("eps", self.eps),
        ] {
            super::check_hyper("ReduceLrOnPlateau::step", name, v)?;
        }
        for &v in &self.group_min_lrs {
            super::check_hyper("ReduceLrOnPlateau::step", "group_min_lrs", v)?;
        }
        Ok(())
    }
}
