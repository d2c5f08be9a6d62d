//! RMSprop and Adagrad (PyTorch's `torch.optim.RMSprop` and `torch.optim.Adagrad`).

use super::{check_hyper, Optimizer, ParamGroup};
use crate::backend::ops::OptimUpdate;
use crate::{Error, Result, Tensor};

/// RMSprop: `v = alpha v + (1-alpha) g^2`; centered, `m = alpha m + (1-alpha) g` and the
/// denominator `sqrt(v - m^2) + eps`, else `sqrt(v) + eps`; with momentum,
/// `b = momentum b + g / denom; p -= lr b`, else `p -= lr g / denom` (and `g += wd p` first
/// when weight decay is set). Defaults as PyTorch's: lr 1e-2, alpha 0.99, eps 1e-8.
///
/// ```
/// use mantissa::{nn::{Linear, Module}, optim::{Optimizer, RmsProp}, Generator};
/// let model = Linear::new(4, 2, true, &mut Generator::new(0))?;
/// let mut opt = RmsProp::new(model.parameters(), 1e-2)?;
/// opt.momentum = 0.9;
/// opt.centered = true;
/// # Ok::<(), mantissa::Error>(())
/// ```
pub struct RmsProp {
    group: ParamGroup,
    pub lr: f64,
    pub alpha: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub momentum: f64,
    pub centered: bool,
}

impl RmsProp {
    pub fn new(params: Vec<Tensor>, lr: f64) -> Result<RmsProp> {
        check_hyper("RmsProp::new", "lr", lr)?;
        Ok(RmsProp {
            group: ParamGroup::checked("RmsProp::new", params)?,
            lr,
            alpha: 0.99,
            eps: 1e-8,
            weight_decay: 0.0,
            momentum: 0.0,
            centered: false,
        })
    }
}

impl RmsProp {
    /// The states its update keeps, in the update's order.
    fn names(&self) -> Vec<&'static str> {
        let mut names = vec!["square_avg"];
        if self.centered {
            names.push("grad_avg");
        }
        if self.momentum != 0.0 {
            names.push("momentum_buffer");
        }
        names
    }
}

impl Optimizer for RmsProp {
    fn name(&self) -> &'static str {
        "RMSprop"
    }
    fn state_names(&self) -> Option<Vec<&'static str>> {
        Some(self.names())
    }
    fn step_unless(&mut self, found_inf: Option<&Tensor>) -> Result<()> {
        let _prof = crate::profiler::op("rmsprop.step");
        for (n, v) in [
            ("eps", self.eps),
            ("weight_decay", self.weight_decay),
            ("momentum", self.momentum),
        ] {
            check_hyper("RmsProp::step", n, v)?;
        }
        if !(0.0..=1.0).contains(&self.alpha) {
            return Err(Error::invalid(
                "RmsProp::step",
                format!("alpha {} not in [0, 1]", self.alpha),
            ));
        }
        let u = OptimUpdate::RmsProp {
            lr: self.lr,
            alpha: self.alpha,
            eps: self.eps,
            weight_decay: self.weight_decay,
            momentum: self.momentum,
            centered: self.centered,
        };
        let names = self.names();
        self.group.fused_steps(&names, u, found_inf)
    }
    fn group(&self) -> &ParamGroup {
        &self.group
    }
    fn group_mut(&mut self) -> &mut ParamGroup {
        &mut self.group
    }
    fn lr(&self) -> f64 {
        self.lr
    }
    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
        self.group.set_lr(lr);
    }
}

/// Adagrad: `s += g^2; p -= clr g / (sqrt(s) + eps)` with `clr = lr / (1 + (t-1) lr_decay)` at
/// the `t`-th update (and `g += wd p` first when weight decay is set); `s` starts at
/// `initial_accumulator_value`. Defaults as PyTorch's: lr 1e-2, eps 1e-10.
///
/// ```
/// use mantissa::{nn::{Linear, Module}, optim::{Adagrad, Optimizer}, Generator};
/// let model = Linear::new(4, 2, true, &mut Generator::new(0))?;
/// let mut opt = Adagrad::new(model.parameters(), 1e-2)?;
/// opt.initial_accumulator_value = 0.1;
/// # Ok::<(), mantissa::Error>(())
/// ```
pub struct Adagrad {
    group: ParamGroup,
    pub lr: f64,
    pub lr_decay: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// The sum's value before the first update (read when a parameter's state is made).
    pub initial_accumulator_value: f64,
}

impl Adagrad {
    pub fn new(params: Vec<Tensor>, lr: f64) -> Result<Adagrad> {
        check_hyper("Adagrad::new", "lr", lr)?;
        Ok(Adagrad {
            group: ParamGroup::checked("Adagrad::new", params)?,
            lr,
            lr_decay: 0.0,
            eps: 1e-10,
            weight_decay: 0.0,
            initial_accumulator_value: 0.0,
        })
    }
}

impl Optimizer for Adagrad {
    fn name(&self) -> &'static str {
        "Adagrad"
    }
    fn state_names(&self) -> Option<Vec<&'static str>> {
        Some(vec!["sum"])
    }
    fn step_unless(&mut self, found_inf: Option<&Tensor>) -> Result<()> {
        let _prof = crate::profiler::op("adagrad.step");
        for (n, v) in [
            ("lr_decay", self.lr_decay),
            ("eps", self.eps),
            ("weight_decay", self.weight_decay),
            ("initial_accumulator_value", self.initial_accumulator_value),
        ] {
            check_hyper("Adagrad::step", n, v)?;
        }
        let init = self.initial_accumulator_value;
        if init != 0.0 {
            // The sums not made yet start at the initial value (the update makes zeros).
            for i in 0..self.group.params.len() {
                let fresh = !self.group.states[i].tensors.contains_key("sum");
                if fresh && self.group.params[i].grad().is_some() {
                    let (target, _) = self.group.target(i)?;
                    let sum = crate::no_grad(|| target.zeros_like()?.add(init))?;
                    self.group.states[i].tensors.insert("sum".into(), sum);
                }
            }
        }
        let u = OptimUpdate::Adagrad {
            lr: self.lr,
            lr_decay: self.lr_decay,
            eps: self.eps,
            weight_decay: self.weight_decay,
        };
        self.group.fused_steps(&["sum"], u, found_inf)
    }
    fn group(&self) -> &ParamGroup {
        &self.group
    }
    fn group_mut(&mut self) -> &mut ParamGroup {
        &mut self.group
    }
    fn lr(&self) -> f64 {
        self.lr
    }
    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
        self.group.set_lr(lr);
    }
}
