//! Adadelta (PyTorch's `torch.optim.Adadelta`), the optimizer of the pytorch/examples MNIST CNN.

use super::{check_hyper, fused_step, Optimizer, ParamState};
use crate::backend::ops::OptimUpdate;
use crate::{no_grad, Error, Result, Tensor};

/// `s = rho s + (1-rho) g^2; d = sqrt(u + eps) / sqrt(s + eps) g; u = rho u + (1-rho) d^2;
/// p -= lr d` (with `g += wd p` when weight decay is set). Defaults: lr 1.0, rho 0.9, eps 1e-6.
pub struct Adadelta {
    params: Vec<Tensor>,
    states: Vec<ParamState>,
    pub lr: f64,
    pub rho: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Adadelta {
    pub fn new(params: Vec<Tensor>, lr: f64) -> Result<Adadelta> {
        check_hyper("Adadelta::new", "lr", lr)?;
        let states = vec![ParamState::default(); params.len()];
        Ok(Adadelta {
            params,
            states,
            lr,
            rho: 0.9,
            eps: 1e-6,
            weight_decay: 0.0,
        })
    }
}

impl Optimizer for Adadelta {
    fn step(&mut self) -> Result<()> {
        if !(0.0..=1.0).contains(&self.rho) {
            return Err(Error::invalid(
                "Adadelta::step",
                format!("rho {} not in [0, 1]", self.rho),
            ));
        }
        let (rho, eps) = (self.rho, self.eps);
        no_grad(|| {
            for (p, st) in self.params.iter().zip(&mut self.states) {
                let Some(g) = p.grad() else { continue };
                let u = OptimUpdate::Adadelta {
                    lr: self.lr,
                    rho,
                    eps,
                    weight_decay: self.weight_decay,
                };
                fused_step(p, &g, st, &["square_avg", "acc_delta"], u)?;
            }
            Ok(())
        })
    }
    fn params(&self) -> &[Tensor] {
        &self.params
    }
    fn states(&self) -> &[ParamState] {
        &self.states
    }
    fn states_mut(&mut self) -> &mut [ParamState] {
        &mut self.states
    }
    fn lr(&self) -> f64 {
        self.lr
    }
    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }
}
