//! SGD with momentum, dampening, Nesterov and weight decay (PyTorch's `torch.optim.SGD`), and
//! SGLD.

use super::{check_hyper, Optimizer, ParamGroup};
use crate::backend::ops::OptimUpdate;
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
    group: ParamGroup,
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
        Ok(Sgd {
            group: ParamGroup::checked("Sgd::new", params)?,
            config,
        })
    }

    /// The fused update.
    fn update(cfg: &SgdConfig) -> OptimUpdate {
        OptimUpdate::Sgd {
            lr: cfg.lr,
            momentum: cfg.momentum,
            dampening: cfg.dampening,
            weight_decay: cfg.weight_decay,
            nesterov: cfg.nesterov,
        }
    }

    fn names(cfg: &SgdConfig) -> &'static [&'static str] {
        if cfg.momentum != 0.0 {
            &["momentum_buffer"]
        } else {
            &[]
        }
    }
}

impl Optimizer for Sgd {
    fn name(&self) -> &'static str {
        "SGD"
    }
    fn state_names(&self) -> Option<Vec<&'static str>> {
        Some(Sgd::names(&self.config).to_vec())
    }
    fn step_unless(&mut self, found_inf: Option<&Tensor>) -> Result<()> {
        let _prof = crate::profiler::op("sgd.step");
        let cfg = self.config;
        self.group
            .fused_steps(Sgd::names(&cfg), Sgd::update(&cfg), found_inf)
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

/// Stochastic gradient Langevin dynamics: the SGD step (with the same momentum and weight
/// decay options) plus Gaussian noise of standard deviation `sqrt(2 lr temperature)`, drawn
/// from a seeded generator: `p -= lr d; p += sqrt(2 lr T) N(0, 1)`.
pub struct Sgld {
    inner: Sgd,
    pub temperature: f64,
    /// The noise generator's state (two i64 on the host), kept as a tensor so that a CUDA
    /// graph of the step can advance it at each replay.
    gen: Tensor,
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
            gen: Generator::new(seed).state_tensor(),
        })
    }
}

impl Optimizer for Sgld {
    fn name(&self) -> &'static str {
        "SGLD"
    }
    fn state_names(&self) -> Option<Vec<&'static str>> {
        self.inner.state_names()
    }
    fn step_unless(&mut self, found_inf: Option<&Tensor>) -> Result<()> {
        let _prof = crate::profiler::op("sgld.step");
        let cfg = self.inner.config;
        let std = (2.0 * cfg.lr * self.temperature).sqrt();
        // The noise scale is frozen into a captured step: a replay after it changed (a
        // learning-rate schedule) captures the step again.
        if crate::capture::active() {
            let (lr, temperature) = (self.inner.group.lr.clone(), self.temperature);
            crate::capture::watch(
                "SGLD's noise scale (learning rate)",
                Box::new(move || (2.0 * lr.get() * temperature).sqrt() == std),
            );
        }
        self.inner.step_unless(found_inf)?;
        // The noise is masked by the flag too, so a skipped step adds none.
        let keep = found_inf.map(|f| f.rsub(1.0)).transpose()?;
        no_grad(|| {
            let group = &mut self.inner.group;
            for i in 0..group.params.len() {
                if group.params[i].grad().is_none() {
                    continue;
                }
                // With master weights the noise goes into the master, then the working copy.
                // A group's rate scales its noise's variance.
                let std = std * group.lr_scale_of(i).sqrt();
                let (p, working) = group.target(i)?;
                let gen = &self.gen;
                let mut noise =
                    Tensor::randn_from(p.shape(), 0.0, std, p.dtype(), p.device(), |b| {
                        crate::tensor::state_stream(gen, b)
                    })?;
                if let Some(k) = &keep {
                    noise = noise.mul(&k.to_dtype(p.dtype())?)?;
                }
                p.copy_(&p.add(&noise)?)?;
                if working.is_some() {
                    group.resync(i)?;
                }
            }
            Ok(())
        })
    }
    fn generator(&self) -> Option<Generator> {
        // The state tensor is always two i64 on the host.
        Generator::from_tensor(&self.gen).ok()
    }
    fn set_generator(&mut self, gen: Generator) {
        // Written in place: a captured step holding the state sees the new one.
        if no_grad(|| self.gen.copy_(&gen.state_tensor())).is_err() {
            self.gen = gen.state_tensor();
        }
    }
    fn group(&self) -> &ParamGroup {
        &self.inner.group
    }
    fn group_mut(&mut self) -> &mut ParamGroup {
        &mut self.inner.group
    }
    fn lr(&self) -> f64 {
        self.inner.config.lr
    }
    fn set_lr(&mut self, lr: f64) {
        self.inner.set_lr(lr);
    }
}
