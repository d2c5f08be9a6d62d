//! Fused optimizer updates: what one update is ([`OptimUpdate`], its per-element rules in the
//! arithmetic type), the [`OptimOps`] family and its dispatch.

use super::rounding::Rounding;
use super::spec::check_within;
use super::{on_device, Backend, BackendStorage, Span, Storage};
use crate::dtype::Float;
use crate::Result;

/// In-place optimizer updates on a parameter (or its f32 master) and its states.
pub(crate) trait OptimOps: BackendStorage {
    /// Applies `u` in place (`self` is the parameter, or its f32 master when `working` is
    /// given: then the f16/bf16 working copy is written in the same pass) and counts it in
    /// `step`, unless `found_inf` holds a nonzero flag. The gradient is a range of its
    /// storage (a view of a data-parallel bucket, say), the other operands whole storages.
    fn optim_update(
        &mut self,
        grad: Span<'_, Self>,
        states: &mut [&mut Self],
        step: &mut Self,
        found_inf: Option<&Self>,
        u: &OptimUpdate,
        working: Option<(&mut Self, Rounding)>,
    ) -> Result<()>;
    /// [`OptimOps::optim_update`] of every item, with one overflow flag. Backends with
    /// multi-tensor kernels update many parameters per launch; by default, one at a time.
    fn optim_update_many(
        items: &mut [OptimItem<'_, Self>],
        found_inf: Option<&Self>,
        u: &OptimUpdate,
    ) -> Result<()> {
        for it in items.iter_mut() {
            let working = it.working.as_mut().map(|(w, r)| (&mut **w, *r));
            let grad = it.grad.clone();
            it.param
                .optim_update(grad, &mut it.states, it.step, found_inf, u, working)?;
        }
        Ok(())
    }
    /// Writes the f32 `master` into this f16/bf16 working copy with `rounding`, drawing the
    /// stochastic bits of the last update counted in `step` (an f32 scalar).
    fn round_from_master(&mut self, master: &Self, rounding: Rounding, step: &Self) -> Result<()>;
}

/// One parameter's operands of an update: the parameter (or its f32 master), its gradient
/// (a range of its storage, which may hold more: a data-parallel bucket), the states the
/// update reads and writes, its step count and, for a master, the working copy with its
/// rounding. Everything but the gradient fills its storage.
pub(crate) struct OptimItem<'a, S> {
    pub param: &'a mut S,
    pub grad: Span<'a, S>,
    pub states: Vec<&'a mut S>,
    pub step: &'a mut S,
    pub working: Option<(&'a mut S, Rounding)>,
}

impl Storage {
    /// See [`OptimOps::optim_update_many`]: every operand on one device.
    pub(crate) fn optim_update_many(
        items: Vec<OptimItem<'_, Storage>>,
        found_inf: Option<&Storage>,
        u: &OptimUpdate,
    ) -> Result<()> {
        let mut all: Vec<&Storage> = found_inf.into_iter().collect();
        for it in &items {
            check_within("optimizer step", &it.grad.range, it.grad.storage.len())?;
            all.extend([&*it.param, it.grad.storage, &*it.step]);
            all.extend(it.states.iter().map(|s| &**s));
            all.extend(it.working.as_ref().map(|(w, _)| &**w));
        }
        if all.is_empty() {
            return Ok(());
        }
        let device = super::common_device("optim_update", &all)?;
        on_device!(device, B => {
            let mut parts: Vec<OptimItem<'_, B>> = items
                .into_iter()
                .map(|it| OptimItem {
                    param: B::part_mut(it.param),
                    grad: it.grad.map(B::part),
                    states: it.states.into_iter().map(B::part_mut).collect(),
                    step: B::part_mut(it.step),
                    working: it.working.map(|(w, r)| (B::part_mut(w), r)),
                })
                .collect();
            B::optim_update_many(&mut parts, found_inf.map(B::part), u)
        })
    }

    /// See [`OptimOps::round_from_master`].
    pub(crate) fn round_from_master(
        &mut self,
        master: &Storage,
        rounding: Rounding,
        step: &Storage,
    ) -> Result<()> {
        super::on_backend!("round_from_master", [self, master, step], B => {
            B::part_mut(self).round_from_master(B::part(master), rounding, B::part(step))
        })
    }
}

/// One optimizer update, applied elementwise in place by a fused kernel (the formulas are
/// PyTorch's; see `crate::optim`). States are passed in the order listed per variant.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimUpdate {
    /// States: `[momentum_buffer]` when `momentum != 0`, else none. On the first step
    /// (step count 0) the buffer takes the gradient as it is.
    Sgd {
        lr: f64,
        momentum: f64,
        dampening: f64,
        weight_decay: f64,
        nesterov: bool,
    },
    /// States: `[exp_avg, exp_avg_sq]`; the bias corrections `1 - beta^t` come from the step
    /// count the kernel reads.
    Adam {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        decoupled: bool,
    },
    /// States: `[square_avg, acc_delta]`.
    Adadelta {
        lr: f64,
        rho: f64,
        eps: f64,
        weight_decay: f64,
    },
    /// States: `[square_avg]`, then `grad_avg` when centered, then `momentum_buffer` when
    /// `momentum != 0`.
    RmsProp {
        lr: f64,
        alpha: f64,
        eps: f64,
        weight_decay: f64,
        momentum: f64,
        centered: bool,
    },
    /// States: `[sum]`; the learning rate of the update after `t` earlier ones is
    /// `lr / (1 + t lr_decay)`, from the step count the kernel reads.
    Adagrad {
        lr: f64,
        lr_decay: f64,
        eps: f64,
        weight_decay: f64,
    },
}

impl OptimUpdate {
    /// How many state tensors the update reads and writes.
    pub fn num_states(&self) -> usize {
        match self {
            OptimUpdate::Sgd { momentum, .. } => (*momentum != 0.0) as usize,
            OptimUpdate::Adam { .. } | OptimUpdate::Adadelta { .. } => 2,
            OptimUpdate::RmsProp {
                momentum, centered, ..
            } => 1 + *centered as usize + (*momentum != 0.0) as usize,
            OptimUpdate::Adagrad { .. } => 1,
        }
    }

    /// The learning rate.
    pub fn lr(&self) -> f64 {
        match *self {
            OptimUpdate::Sgd { lr, .. }
            | OptimUpdate::Adam { lr, .. }
            | OptimUpdate::Adadelta { lr, .. }
            | OptimUpdate::RmsProp { lr, .. }
            | OptimUpdate::Adagrad { lr, .. } => lr,
        }
    }

    /// The same update with learning rate `lr`.
    pub fn with_lr(mut self, new: f64) -> OptimUpdate {
        match &mut self {
            OptimUpdate::Sgd { lr, .. }
            | OptimUpdate::Adam { lr, .. }
            | OptimUpdate::Adadelta { lr, .. }
            | OptimUpdate::RmsProp { lr, .. }
            | OptimUpdate::Adagrad { lr, .. } => *lr = new,
        }
        self
    }

    /// The same update with weight decay `wd` (a parameter group's).
    pub fn with_weight_decay(mut self, wd: f64) -> OptimUpdate {
        match &mut self {
            OptimUpdate::Sgd { weight_decay, .. }
            | OptimUpdate::Adam { weight_decay, .. }
            | OptimUpdate::Adadelta { weight_decay, .. }
            | OptimUpdate::RmsProp { weight_decay, .. }
            | OptimUpdate::Adagrad { weight_decay, .. } => *weight_decay = wd,
        }
        self
    }

    /// What the CUDA kernel takes of the learning rate: `lr` and AdamW's decay `1 - lr wd`
    /// (1 for the others), each rounded once from f64 to f32. A CUDA graph's replay writes
    /// these into device memory for the captured kernel to read.
    pub fn lr_words(&self) -> [f32; 2] {
        let decay = match *self {
            OptimUpdate::Adam {
                lr,
                weight_decay,
                decoupled: true,
                ..
            } => 1.0 - lr * weight_decay,
            _ => 1.0,
        };
        [self.lr() as f32, decay as f32]
    }

    /// The constants of the update in the arithmetic type, for a parameter that has already
    /// taken `steps` updates (the kernel reads the count from the step state).
    pub fn prepare<A: Float>(&self, steps: f64) -> Prepared<A> {
        let c = |v: f64| A::from_f64_(v);
        let t = steps as i32 + 1;
        match *self {
            OptimUpdate::Sgd {
                lr,
                momentum,
                dampening,
                weight_decay,
                nesterov,
            } => Prepared::Sgd(SgdRule {
                lr: c(lr),
                momentum: c(momentum),
                keep: c(1.0 - dampening),
                wd: c(weight_decay),
                use_momentum: momentum != 0.0,
                nesterov,
                first: steps == 0.0,
            }),
            OptimUpdate::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                decoupled,
            } => Prepared::Adam(AdamRule {
                decay: c(if decoupled {
                    1.0 - lr * weight_decay
                } else {
                    1.0
                }),
                wd: c(if decoupled { 0.0 } else { weight_decay }),
                b1: c(beta1),
                b1c: c(1.0 - beta1),
                b2: c(beta2),
                b2c: c(1.0 - beta2),
                inv_bc2: c(1.0 / (1.0 - beta2.powi(t))),
                eps: c(eps),
                step: c(lr / (1.0 - beta1.powi(t))),
            }),
            OptimUpdate::Adadelta {
                lr,
                rho,
                eps,
                weight_decay,
            } => Prepared::Adadelta(AdadeltaRule {
                lr: c(lr),
                rho: c(rho),
                rho_c: c(1.0 - rho),
                eps: c(eps),
                wd: c(weight_decay),
            }),
            OptimUpdate::RmsProp {
                lr,
                alpha,
                eps,
                weight_decay,
                momentum,
                centered,
            } => Prepared::RmsProp(RmsPropRule {
                lr: c(lr),
                alpha: c(alpha),
                alpha_c: c(1.0 - alpha),
                eps: c(eps),
                wd: c(weight_decay),
                momentum: c(momentum),
                use_momentum: momentum != 0.0,
                centered,
            }),
            OptimUpdate::Adagrad {
                lr,
                lr_decay,
                eps,
                weight_decay,
            } => Prepared::Adagrad(AdagradRule {
                clr: c(lr / (1.0 + steps * lr_decay)),
                eps: c(eps),
                wd: c(weight_decay),
            }),
        }
    }
}

/// The elementwise rule of an optimizer: parameter `p`, gradient `g`, states `s` (in/out).
pub trait UpdateRule<A>: Copy + Send + Sync {
    fn apply(&self, p: &mut A, g: A, s: &mut [A; 3]);
}

/// An [`OptimUpdate`] with its constants in the arithmetic type `A`.
#[derive(Debug, Clone, Copy)]
pub enum Prepared<A> {
    Sgd(SgdRule<A>),
    Adam(AdamRule<A>),
    Adadelta(AdadeltaRule<A>),
    RmsProp(RmsPropRule<A>),
    Adagrad(AdagradRule<A>),
}

#[derive(Debug, Clone, Copy)]
pub struct SgdRule<A> {
    lr: A,
    momentum: A,
    keep: A,
    wd: A,
    use_momentum: bool,
    nesterov: bool,
    first: bool,
}

impl<A: Float> UpdateRule<A> for SgdRule<A> {
    #[inline(always)]
    fn apply(&self, p: &mut A, g: A, s: &mut [A; 3]) {
        let mut d = g + self.wd * *p;
        if self.use_momentum {
            s[0] = if self.first {
                d
            } else {
                self.momentum * s[0] + self.keep * d
            };
            d = if self.nesterov {
                d + self.momentum * s[0]
            } else {
                s[0]
            };
        }
        *p = *p - self.lr * d;
    }
}

#[derive(Debug, Clone, Copy)]
pub struct AdamRule<A> {
    decay: A,
    wd: A,
    b1: A,
    b1c: A,
    b2: A,
    b2c: A,
    inv_bc2: A,
    eps: A,
    step: A,
}

impl<A: Float> UpdateRule<A> for AdamRule<A> {
    #[inline(always)]
    fn apply(&self, p: &mut A, g: A, s: &mut [A; 3]) {
        let g = g + self.wd * *p;
        s[0] = self.b1 * s[0] + self.b1c * g;
        s[1] = self.b2 * s[1] + self.b2c * g * g;
        *p = *p * self.decay - self.step * s[0] / ((s[1] * self.inv_bc2).sqrt() + self.eps);
    }
}

#[derive(Debug, Clone, Copy)]
pub struct AdadeltaRule<A> {
    lr: A,
    rho: A,
    rho_c: A,
    eps: A,
    wd: A,
}

impl<A: Float> UpdateRule<A> for AdadeltaRule<A> {
    #[inline(always)]
    fn apply(&self, p: &mut A, g: A, s: &mut [A; 3]) {
        let g = g + self.wd * *p;
        s[0] = self.rho * s[0] + self.rho_c * g * g;
        let d = (s[1] + self.eps).sqrt() / (s[0] + self.eps).sqrt() * g;
        s[1] = self.rho * s[1] + self.rho_c * d * d;
        *p = *p - self.lr * d;
    }
}

#[derive(Debug, Clone, Copy)]
pub struct RmsPropRule<A> {
    lr: A,
    alpha: A,
    alpha_c: A,
    eps: A,
    wd: A,
    momentum: A,
    use_momentum: bool,
    centered: bool,
}

impl<A: Float> UpdateRule<A> for RmsPropRule<A> {
    #[inline(always)]
    fn apply(&self, p: &mut A, g: A, s: &mut [A; 3]) {
        let g = g + self.wd * *p;
        s[0] = self.alpha * s[0] + self.alpha_c * g * g;
        let avg = match self.centered {
            true => {
                s[1] = self.alpha * s[1] + self.alpha_c * g;
                (s[0] - s[1] * s[1]).sqrt() + self.eps
            }
            false => s[0].sqrt() + self.eps,
        };
        let d = match self.use_momentum {
            true => {
                let b = 1 + self.centered as usize;
                s[b] = self.momentum * s[b] + g / avg;
                s[b]
            }
            false => g / avg,
        };
        *p = *p - self.lr * d;
    }
}

#[derive(Debug, Clone, Copy)]
pub struct AdagradRule<A> {
    clr: A,
    eps: A,
    wd: A,
}

impl<A: Float> UpdateRule<A> for AdagradRule<A> {
    #[inline(always)]
    fn apply(&self, p: &mut A, g: A, s: &mut [A; 3]) {
        let g = g + self.wd * *p;
        let sum = s[0] + g * g;
        s[0] = sum;
        *p = *p - self.clr * g / (sum.sqrt() + self.eps);
    }
}

impl<A: Float> Prepared<A> {
    /// The update of one element (dispatching on the variant; kernels call the rule itself).
    #[inline(always)]
    pub fn apply(&self, p: &mut A, g: A, s: &mut [A; 3]) {
        match self {
            Prepared::Sgd(r) => r.apply(p, g, s),
            Prepared::Adam(r) => r.apply(p, g, s),
            Prepared::Adadelta(r) => r.apply(p, g, s),
            Prepared::RmsProp(r) => r.apply(p, g, s),
            Prepared::Adagrad(r) => r.apply(p, g, s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::{CpuStorage, IntoStorage};

    fn cpu(v: Vec<f32>) -> Storage {
        Storage::Cpu(v.into_storage())
    }

    fn f32s(s: &Storage) -> Vec<f32> {
        match s {
            Storage::Cpu(CpuStorage::F32(v)) => v.clone(),
            _ => unreachable!("an f32 CPU storage"),
        }
    }

    #[test]
    fn a_gradient_is_read_as_a_range_of_a_larger_storage() {
        let u = OptimUpdate::Adam {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            decoupled: true,
        };
        // Two parameters whose gradients sit side by side in one buffer (a bucket), against
        // the same gradients each in a storage of its own.
        let bucket = cpu(vec![9.0, 0.5, -1.0, 2.0, 0.25, -3.0, 9.0]);
        let own = [cpu(vec![0.5, -1.0, 2.0]), cpu(vec![0.25, -3.0])];
        let mut runs = Vec::new();
        for as_views in [true, false] {
            let mut params = [cpu(vec![1.0, 2.0, 3.0]), cpu(vec![-1.0, 4.0])];
            let mut states: Vec<Storage> = [3, 3, 2, 2].map(|n| cpu(vec![0.0; n])).into();
            let mut steps = [cpu(vec![0.0]), cpu(vec![0.0])];
            let grads = match as_views {
                true => [
                    Span {
                        storage: &bucket,
                        range: 1..4,
                    },
                    Span {
                        storage: &bucket,
                        range: 4..6,
                    },
                ],
                false => [Span::whole(&own[0], 3), Span::whole(&own[1], 2)],
            };
            let [s0, s1, s2, s3] = &mut states[..] else {
                unreachable!("four states")
            };
            let [p0, p1] = &mut params;
            let [t0, t1] = &mut steps;
            let [g0, g1] = grads;
            let items = vec![
                OptimItem {
                    param: p0,
                    grad: g0,
                    states: vec![s0, s1],
                    step: t0,
                    working: None,
                },
                OptimItem {
                    param: p1,
                    grad: g1,
                    states: vec![s2, s3],
                    step: t1,
                    working: None,
                },
            ];
            Storage::optim_update_many(items, None, &u).unwrap();
            runs.push((
                params.each_ref().map(f32s),
                states.iter().map(f32s).collect::<Vec<_>>(),
            ));
        }
        assert_eq!(runs[0], runs[1]);
        assert_ne!(runs[0].0[0], vec![1.0, 2.0, 3.0]);
        // A range past the end of its storage is refused by name.
        let mut p = cpu(vec![1.0]);
        let mut t = cpu(vec![0.0]);
        let items = vec![OptimItem {
            param: &mut p,
            grad: Span {
                storage: &bucket,
                range: 6..8,
            },
            states: Vec::new(),
            step: &mut t,
            working: None,
        }];
        let sgd = OptimUpdate::Sgd {
            lr: 0.1,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        };
        let e = Storage::optim_update_many(items, None, &sgd).unwrap_err();
        assert!(e.to_string().contains("outside a storage of 7"), "{e}");
    }
}
