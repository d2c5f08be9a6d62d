//! SGD with momentum, dampening, Nesterov and weight decay (PyTorch's `torch.optim.SGD`), and
//! SGLD.

use super::{check_hyper, Optimizer, ParamState};
use crate::random::Generator;
use crate::{no_grad, Error, Result, Tensor};

/// Hyperparameters of [`Sgd`], with PyTorch's defaults (all zero, no Nesterov).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub weight_decay: f64,
    pub nesterov: bool,
}

impl SgdConfig {
    pub fn new(lr: f64) -> SgdConfig {
        SgdConfig {
            lr,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

/// Stochastic gradient descent:
/// `d = g + wd p; b = m b + (1 - dampening) d` (b = d on the first step);
/// `d = nesterov ? d + m b : b; p -= lr d`.
pub struct Sgd {
    params: Vec<Tensor>,
    states: Vec<ParamState>,
    pub config: SgdConfig,
}

impl Sgd {
    pub fn new(params: Vec<Tensor>, config: SgdConfig) -> Result<Sgd> {
        for (n, v) in [
            ("lr", config.lr),
            ("momentum", config.momentum),
            ("weight_decay", config.weight_decay),
            ("dampening", config.dampening),
        ] {
            check_hyper("Sgd::new", n, v)?;
        }
        if config.nesterov && (config.momentum == 0.0 || config.dampening != 0.0) {
            return Err(Error::invalid(
                "Sgd::new",
                "Nesterov momentum needs momentum > 0 and zero dampening",
            ));
        }
        let states = vec![ParamState::default(); params.len()];
        Ok(Sgd {
            params,
            states,
            config,
        })
    }

    /// The SGD direction for parameter `i` (updates its momentum buffer).
    fn direction(cfg: &SgdConfig, p: &Tensor, g: Tensor, st: &mut ParamState) -> Result<Tensor> {
        let mut d = g;
        if cfg.weight_decay != 0.0 {
            d = d.add(&p.mul(cfg.weight_decay)?)?;
        }
        if cfg.momentum != 0.0 {
            let buf = match st.tensors.get("momentum_buffer") {
                None => d.copy()?,
                Some(b) => b.mul(cfg.momentum)?.add(&d.mul(1.0 - cfg.dampening)?)?,
            };
            st.tensors.insert("momentum_buffer".into(), buf.clone());
            d = if cfg.nesterov {
                d.add(&buf.mul(cfg.momentum)?)?
            } else {
                buf
            };
        }
        st.step += 1;
        Ok(d)
    }
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        no_grad(|| {
            for (p, st) in self.params.iter().zip(&mut self.states) {
                let Some(g) = p.grad() else { continue };
                let d = Sgd::direction(&self.config, p, g, st)?;
                p.copy_(&p.sub(&d.mul(self.config.lr)?)?)?;
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
        self.config.lr
    }
    fn set_lr(&mut self, lr: f64) {
        self.config.lr = lr;
    }
}

/// Stochastic gradient Langevin dynamics: the SGD step (with the same momentum and weight
/// decay options) plus Gaussian noise of standard deviation `sqrt(2 lr temperature)`, drawn
/// from a seeded generator: `p -= lr d; p += sqrt(2 lr T) N(0, 1)`.
pub struct Sgld {
    inner: Sgd,
    pub temperature: f64,
    gen: Generator,
}

impl Sgld {
    pub fn new(
        params: Vec<Tensor>,
        config: SgdConfig,
        temperature: f64,
        seed: u64,
    ) -> Result<Sgld> {
        check_hyper("Sgld::new", "temperature", temperature)?;
        Ok(Sgld {
            inner: Sgd::new(params, config)?,
            temperature,
            gen: Generator::new(seed),
        })
    }
}

impl Optimizer for Sgld {
    fn step(&mut self) -> Result<()> {
        let cfg = self.inner.config;
        let std = (2.0 * cfg.lr * self.temperature).sqrt();
        no_grad(|| {
            for (p, st) in self.inner.params.iter().zip(&mut self.inner.states) {
                let Some(g) = p.grad() else { continue };
                let d = Sgd::direction(&cfg, p, g, st)?;
                let noise =
                    Tensor::randn_with(p.shape(), 0.0, std, p.dtype(), p.device(), &mut self.gen)?;
                p.copy_(&p.sub(&d.mul(cfg.lr)?)?.add(&noise)?)?;
            }
            Ok(())
        })
    }
    fn params(&self) -> &[Tensor] {
        &self.inner.params
    }
    fn states(&self) -> &[ParamState] {
        &self.inner.states
    }
    fn states_mut(&mut self) -> &mut [ParamState] {
        &mut self.inner.states
    }
    fn lr(&self) -> f64 {
        self.inner.config.lr
    }
    fn set_lr(&mut self, lr: f64) {
        self.inner.config.lr = lr;
    }
}
