//! Adadelta (PyTorch's `torch.optim.Adadelta`), the optimizer of the pytorch/examples MNIST CNN.

use super::{check_hyper, Optimizer, ParamGroup};
use crate::backend::ops::OptimUpdate;
use crate::{Error, Result, Tensor};

/// `s = rho s + (1-rho) g^2; d = sqrt(u + eps) / sqrt(s + eps) g; u = rho u + (1-rho) d^2;
/// p -= lr d` (with `g += wd p` when weight decay is set). Defaults: lr 1.0, rho 0.9, eps 1e-6.
pub struct Adadelta {
    group: ParamGroup,
    pub lr: f64,
    pub rho: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Adadelta {
    pub fn new(params: Vec<Tensor>, lr: f64) -> Result<Adadelta> {
        check_hyper("Adadelta::new", "lr", lr)?;
        Ok(Adadelta {
            group: ParamGroup::checked("Adadelta::new", params)?,
            lr,
            rho: 0.9,
            eps: 1e-6,
            weight_decay: 0.0,
        })
    }
}

impl Optimizer for Adadelta {
    fn name(&self) -> &'static str {
        "Adadelta"
    }
    fn state_names(&self) -> Option<Vec<&'static str>> {
        Some(vec!["square_avg", "acc_delta"])
    }
    fn step_unless(&mut self, found_inf: Option<&Tensor>) -> Result<()> {
        let _prof = crate::profiler::op("adadelta.step");
        if !(0.0..=1.0).contains(&self.rho) {
            return Err(Error::invalid(
                "Adadelta::step",
                format!("rho {} not in [0, 1]", self.rho),
            ));
        }
        let u = OptimUpdate::Adadelta {
            lr: self.lr,
            rho: self.rho,
            eps: self.eps,
            weight_decay: self.weight_decay,
        };
        self.group
            .fused_steps(&["square_avg", "acc_delta"], u, found_inf)
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
