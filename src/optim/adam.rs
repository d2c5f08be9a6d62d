//! Adam and AdamW (PyTorch's `torch.optim.Adam` / `AdamW`).

use super::{check_hyper, Optimizer, ParamGroup};
use crate::backend::ops::OptimUpdate;
use crate::{Error, Result, Tensor};

/// Hyperparameters of [`Adam`]; PyTorch's defaults via [`AdamConfig::adam`] and
/// [`AdamConfig::adamw`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Decoupled weight decay (AdamW: `p *= 1 - lr wd`) instead of L2 (`g += wd p`).
    pub decoupled: bool,
}

impl AdamConfig {
    /// Adam: betas (0.9, 0.999), eps 1e-8, no weight decay.
    pub fn adam(lr: f64) -> AdamConfig {
        AdamConfig {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: false,
        }
    }

    /// AdamW: as Adam with decoupled weight decay 0.01.
    pub fn adamw(lr: f64) -> AdamConfig {
        AdamConfig {
            weight_decay: 0.01,
            decoupled: true,
            ..AdamConfig::adam(lr)
        }
    }
}

/// Adam / AdamW:
/// `m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)`.
pub struct Adam {
    group: ParamGroup,
    pub config: AdamConfig,
}

impl Adam {
    pub fn new(params: Vec<Tensor>, config: AdamConfig) -> Result<Adam> {
        for (n, v) in [
            ("lr", config.lr),
            ("eps", config.eps),
            ("weight_decay", config.weight_decay),
        ] {
            check_hyper("Adam::new", n, v)?;
        }
        for b in [config.beta1, config.beta2] {
            if !(0.0..1.0).contains(&b) {
                return Err(Error::invalid(
                    "Adam::new",
                    format!("beta {b} not in [0, 1)"),
                ));
            }
        }
        Ok(Adam {
            group: ParamGroup::checked("Adam::new", params)?,
            config,
        })
    }
}

impl Optimizer for Adam {
    fn name(&self) -> &'static str {
        match self.config.decoupled {
            true => "AdamW",
            false => "Adam",
        }
    }
    fn state_names(&self) -> Option<Vec<&'static str>> {
        Some(vec!["exp_avg", "exp_avg_sq"])
    }
    fn step_unless(&mut self, found_inf: Option<&Tensor>) -> Result<()> {
        let _prof = crate::profiler::op(match self.config.decoupled {
            true => "adamw.step",
            false => "adam.step",
        });
        let c = self.config;
        let u = OptimUpdate::Adam {
            lr: c.lr,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            weight_decay: c.weight_decay,
            decoupled: c.decoupled,
        };
        self.group
            .fused_steps(&["exp_avg", "exp_avg_sq"], u, found_inf)
    }
    fn group(&self) -> &ParamGroup {
        &self.group
    }
    fn group_mut(&mut self) -> &mut ParamGroup {
        &mut self.group
    }
    fn lr(&self) -> f64 {
        self.config.lr
    }
    fn set_lr(&mut self, lr: f64) {
        self.config.lr = lr;
        self.group.set_lr(lr);
    }
}
