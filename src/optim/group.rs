//! The optimizers' parameters and states ([`ParamGroup`]), their groups, and the fused update
//! every optimizer's step runs: operands checked and put in each parameter's memory order,
//! then one multi-tensor update per group.

use super::Rounding;
use crate::backend::ops::OptimUpdate;
use crate::backend::optim::OptimItem;
use crate::backend::{Span, Storage};
use crate::{DType, Error, Result, Tensor};
use std::collections::BTreeMap;

/// State of one parameter: named tensors. `step` (an f32 scalar on the parameter's device,
/// as PyTorch keeps it) counts the updates applied; the fused kernel reads and advances it,
/// so a step skipped on a device-side overflow flag needs no host round trip.
#[derive(Default, Clone)]
pub struct ParamState {
    pub tensors: BTreeMap<String, Tensor>,
}

impl ParamState {
    /// Updates applied so far (reads the device counter).
    pub fn step_count(&self) -> Result<u64> {
        match self.tensors.get("step") {
            Some(t) => Ok(t.item()? as u64),
            None => Ok(0),
        }
    }
}

/// The parameters an optimizer updates and their states: the parameters given to the
/// constructor (the default group), then those of each group added with
/// [`Optimizer::add_param_group`](super::Optimizer::add_param_group), in one list (states
/// and checkpoint entries are numbered along it).
#[derive(Default)]
pub struct ParamGroup {
    pub params: Vec<Tensor>,
    pub states: Vec<ParamState>,
    /// With fp32 master weights on, how working copies are rounded (see
    /// [`Optimizer::use_master_weights`](super::Optimizer::use_master_weights)).
    pub(crate) masters: Option<Rounding>,
    /// The learning rate as [`Optimizer::set_lr`](super::Optimizer::set_lr) last set it (or
    /// the last step used), shared with the CUDA graphs that captured a step, whose replays
    /// read it.
    pub(crate) lr: LrCell,
    /// The groups added after the default one, in order, each over the next `len` params.
    groups: Vec<Group>,
}

/// Options of a parameter group (an entry of PyTorch's `param_groups`); what is not set is
/// the optimizer's own.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GroupOptions {
    /// The group's learning rate now. A schedule sets the optimizer's rate; the group's
    /// follows in the same ratio (as PyTorch's schedulers scale each group's initial rate).
    pub lr: Option<f64>,
    /// The group's weight decay (`Some(0.0)` keeps biases and norms out of decay).
    pub weight_decay: Option<f64>,
}

/// A group after the default one.
struct Group {
    len: usize,
    /// Its learning rate over the optimizer's.
    lr_scale: f64,
    weight_decay: Option<f64>,
    /// Its learning rate, for the captured steps that read it.
    lr: LrCell,
}

/// A learning rate shared between an optimizer and the captured steps that read it.
#[derive(Clone, Default)]
pub(crate) struct LrCell(std::sync::Arc<std::sync::atomic::AtomicU64>);

impl LrCell {
    pub(crate) fn get(&self) -> f64 {
        f64::from_bits(self.0.load(std::sync::atomic::Ordering::Relaxed))
    }

    pub(crate) fn set(&self, lr: f64) {
        self.0
            .store(lr.to_bits(), std::sync::atomic::Ordering::Relaxed);
    }
}

/// `Err` naming `op` and the parameter unless every tensor of `params` can be trained: a leaf
/// (PyTorch: "can't optimize a non-leaf Tensor") that requires grad (one that does not would
/// never get a gradient, so never move), and not given twice (a tied weight listed under both
/// of its names: `Module::parameters` lists it once). `first` numbers the parameters in the
/// messages (those of a group added later follow the optimizer's).
pub(crate) fn check_params(op: &'static str, params: &[Tensor], first: usize) -> Result<()> {
    for (k, p) in params.iter().enumerate() {
        let why = if !p.is_leaf() {
            "is not a leaf (the result of an op; PyTorch cannot optimize it either): give the \
             tensor it was computed from, or a detached copy that requires grad"
        } else if !p.is_requires_grad() {
            "does not require grad, so it would never be updated: call requires_grad(true) on \
             it first, or leave it out"
        } else {
            match params[..k].iter().position(|q| q.shares_storage(p)) {
                Some(i) => {
                    return Err(Error::invalid(
                        op,
                        format!(
                            "parameter {} (shape {:?}) is parameter {} again (a weight tied \
                             to another, listed twice?): give each parameter once, as \
                             Module::parameters lists a tied weight",
                            first + k,
                            p.shape(),
                            first + i
                        ),
                    ))
                }
                None => continue,
            }
        };
        return Err(Error::invalid(
            op,
            format!("parameter {} (shape {:?}) {why}", first + k, p.shape()),
        ));
    }
    Ok(())
}

impl ParamGroup {
    /// The parameters, checked by [`check_params`] under `op`'s name.
    pub(crate) fn checked(op: &'static str, params: Vec<Tensor>) -> Result<ParamGroup> {
        check_params(op, &params, 0)?;
        Ok(ParamGroup::new(params))
    }

    pub fn new(params: Vec<Tensor>) -> ParamGroup {
        let states = vec![ParamState::default(); params.len()];
        ParamGroup {
            params,
            states,
            masters: None,
            lr: LrCell::default(),
            groups: Vec::new(),
        }
    }

    /// Appends a group of `params` with `options`, for an optimizer whose rate is `base_lr`.
    pub(crate) fn add_group(
        &mut self,
        params: Vec<Tensor>,
        options: GroupOptions,
        base_lr: f64,
    ) -> Result<()> {
        const OP: &str = "add_param_group";
        for (name, v) in [("lr", options.lr), ("weight_decay", options.weight_decay)] {
            if let Some(v) = v {
                super::check_hyper(OP, name, v)?;
            }
        }
        let lr_scale = match options.lr {
            None => 1.0,
            Some(lr) if base_lr > 0.0 => lr / base_lr,
            Some(lr) => {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "a group rate ({lr}) is kept as a ratio to the optimizer's, which is 0: \
                         give the optimizer a positive lr first"
                    ),
                ))
            }
        };
        check_params(OP, &params, self.params.len())?;
        for (k, p) in params.iter().enumerate() {
            if let Some(i) = self.params.iter().position(|q| q.shares_storage(p)) {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "parameter {k} of the new group (shape {:?}) is already parameter {i} \
                         of the optimizer: a parameter belongs to one group",
                        p.shape()
                    ),
                ));
            }
        }
        let first = self.params.len();
        self.states
            .extend(std::iter::repeat_with(ParamState::default).take(params.len()));
        self.params.extend(params);
        if self.masters.is_some() {
            for i in first..self.params.len() {
                self.target(i)?;
            }
        }
        let lr = LrCell::default();
        lr.set(self.lr.get() * lr_scale);
        self.groups.push(Group {
            len: self.params.len() - first,
            lr_scale,
            weight_decay: options.weight_decay,
            lr,
        });
        Ok(())
    }

    /// Sets each group's learning rate (`lrs`, the default group first) as its ratio to the
    /// first's, which [`ParamGroup::set_lr`] then applies: for a scheduler that moves the
    /// groups apart (a floor reached by one). A rate of 0 for the first group with a nonzero
    /// one elsewhere cannot be kept as a ratio and is refused.
    pub(crate) fn set_ratios(&mut self, lrs: &[f64]) -> Result<()> {
        const OP: &str = "set_param_group_lrs";
        if lrs.len() != self.groups.len() + 1 {
            return Err(Error::invalid(
                OP,
                format!(
                    "{} rates for {} parameter groups",
                    lrs.len(),
                    self.groups.len() + 1
                ),
            ));
        }
        for &lr in lrs {
            super::check_hyper(OP, "lr", lr)?;
        }
        let base = lrs[0];
        if base == 0.0 && lrs[1..].iter().any(|&lr| lr != 0.0) {
            return Err(Error::invalid(
                OP,
                format!(
                    "the first group's rate is 0 while others are not ({lrs:?}): the groups' \
                     rates are kept as ratios to the first's"
                ),
            ));
        }
        if base > 0.0 {
            for (g, &lr) in self.groups.iter_mut().zip(&lrs[1..]) {
                g.lr_scale = lr / base;
            }
        }
        Ok(())
    }

    /// Sets the optimizer's learning rate; each added group's follows in its ratio.
    pub(crate) fn set_lr(&self, lr: f64) {
        self.lr.set(lr);
        for g in &self.groups {
            g.lr.set(lr * g.lr_scale);
        }
    }

    /// Each group's first parameter index, length, ratio of learning rates, weight decay and
    /// rate cell, the default group first.
    fn spans(&self) -> Vec<(usize, usize, f64, Option<f64>, LrCell)> {
        let added: usize = self.groups.iter().map(|g| g.len).sum();
        let mut start = self.params.len() - added;
        let mut out = vec![(0, start, 1.0, None, self.lr.clone())];
        for g in &self.groups {
            out.push((start, g.len, g.lr_scale, g.weight_decay, g.lr.clone()));
            start += g.len;
        }
        out
    }

    /// Every group's learning rate for an optimizer whose rate is `base_lr`, the default
    /// group first.
    pub(crate) fn group_lrs(&self, base_lr: f64) -> Vec<f64> {
        self.spans().iter().map(|s| base_lr * s.2).collect()
    }

    /// The learning rate over the optimizer's of the group parameter `i` belongs to.
    pub(crate) fn lr_scale_of(&self, i: usize) -> f64 {
        let added: usize = self.groups.iter().map(|g| g.len).sum();
        let mut end = self.params.len() - added;
        if i < end {
            return 1.0;
        }
        for g in &self.groups {
            end += g.len;
            if i < end {
                return g.lr_scale;
            }
        }
        1.0
    }

    /// Applies the fused update `u` to every parameter that has a gradient, each group with
    /// its own learning rate and weight decay; the update reads and writes the states
    /// `names`. With `found_inf`, the kernels skip when it is nonzero.
    pub(crate) fn fused_steps(
        &mut self,
        names: &[&str],
        u: OptimUpdate,
        found_inf: Option<&Tensor>,
    ) -> Result<()> {
        self.lr.set(u.lr());
        for (start, len, scale, wd, cell) in self.spans() {
            let mut ug = u.with_lr(u.lr() * scale);
            if let Some(wd) = wd {
                ug = ug.with_weight_decay(wd);
            }
            cell.set(ug.lr());
            self.fused_span(start..start + len, names, ug, &cell, found_inf)?;
        }
        Ok(())
    }

    /// [`ParamGroup::fused_steps`] of the parameters `range`, whose rate `lr` holds.
    fn fused_span(
        &mut self,
        range: std::ops::Range<usize>,
        names: &[&str],
        u: OptimUpdate,
        lr: &LrCell,
        found_inf: Option<&Tensor>,
    ) -> Result<()> {
        // Captured, the kernels read the learning rate from the replay's prologue, which
        // each replay fills from the rate set then (a schedule needs no re-capture).
        let hyper = match crate::capture::active() {
            true => {
                let lr = lr.clone();
                let fill = move |b: &mut [u8]| {
                    let w = u.with_lr(lr.get()).lr_words();
                    b[..4].copy_from_slice(&w[0].to_le_bytes());
                    b[4..8].copy_from_slice(&w[1].to_le_bytes());
                    Ok(())
                };
                Some(crate::capture::slot(8, Box::new(fill))?)
            }
            false => None,
        };
        let _hyper = crate::capture::HyperGuard::set(hyper);
        crate::no_grad(|| {
            let mut items = Vec::with_capacity(range.len());
            for i in range {
                let Some(g) = self.params[i].grad() else {
                    continue;
                };
                let (target, working) = self.target(i)?;
                items.push(prepare(target, &g, &mut self.states[i], names, working)?);
            }
            apply(&items, found_inf, u)
        })
    }
}

/// One parameter's operands of a fused update, checked and in the parameter's memory order.
struct Prepared {
    /// The parameter, or its f32 master.
    target: Tensor,
    grad: Tensor,
    /// The range of its storage the gradient fills in the parameter's order (its storage may
    /// hold more: a data-parallel bucket).
    grad_range: std::ops::Range<usize>,
    states: Vec<Tensor>,
    step: Tensor,
    /// A master's f16/bf16 working copy, written in the same pass.
    working: Option<(Tensor, Rounding)>,
}

/// Checks the operands of the fused update of parameter `p` (or f32 master, when `working`
/// names the f16/bf16 working copy to write in the same pass) with gradient `g`, creating
/// the states `names` (zeros, the shape and dtype of `p`) and the step count on first use.
fn prepare(
    target: Tensor,
    g: &Tensor,
    st: &mut ParamState,
    names: &[&str],
    working: Option<(Tensor, Rounding)>,
) -> Result<Prepared> {
    let p = &target;
    if !p.fills_storage() {
        return Err(Error::invalid(
            "optimizer step",
            format!(
                "parameters must be whole contiguous or channels-last tensors (got a view of \
                 shape {:?}, strides {:?})",
                p.shape(),
                p.strides()
            ),
        ));
    }
    // The update walks parameter, gradient, states and working copy as flat arrays: all in
    // the parameter's memory order.
    let format = p.memory_format();
    if let Some((w, _)) = &working {
        if !w.fills_storage() || w.memory_format() != format {
            return Err(Error::invalid(
                "optimizer step",
                format!(
                    "the working copy (strides {:?}) is not in its master's order ({:?})",
                    w.strides(),
                    p.strides()
                ),
            ));
        }
    }
    if g.shape() != p.shape() {
        return Err(Error::ShapeMismatch {
            op: "optimizer step",
            lhs: p.shape().to_vec(),
            rhs: g.shape().to_vec(),
        });
    }
    // An f32 master reads half gradients as they are; anything else in the update's dtype.
    let g = if p.dtype() == DType::F32 && g.dtype().is_half() {
        g.clone()
    } else {
        g.to_dtype(p.dtype())?
    };
    // A gradient that lies in the parameter's order is read where it is, even as a range of
    // a larger storage (a view of a data-parallel bucket); any other is copied into that order.
    let g = match g.range_in(format) {
        Some(_) => g,
        None => g.filled_in(format)?,
    };
    let grad_range = g.range_in(format).ok_or_else(|| {
        Error::invalid(
            "optimizer step",
            format!(
                "the gradient (strides {:?}) is not in {format:?} order",
                g.strides()
            ),
        )
    })?;
    let mut states = Vec::with_capacity(names.len());
    for &n in names {
        let t = match st.tensors.get(n) {
            // A state in another order (loaded from a checkpoint, say) is put in the
            // parameter's.
            Some(t) if t.shape() == p.shape() && t.dtype() == p.dtype() => t.filled_in(format)?,
            Some(t) => {
                return Err(Error::invalid(
                    "optimizer step",
                    format!(
                        "state {n} is {:?} {:?}, the parameter {:?} {:?}",
                        t.shape(),
                        t.dtype(),
                        p.shape(),
                        p.dtype()
                    ),
                ))
            }
            None => p.zeros_like()?.filled_in(format)?,
        };
        st.tensors.insert(n.to_string(), t.clone());
        states.push(t);
    }
    let step = match st.tensors.get("step") {
        Some(t) => t.clone(),
        None => Tensor::zeros(&[], DType::F32, p.device())?,
    };
    st.tensors.insert("step".into(), step.clone());
    Ok(Prepared {
        target,
        grad: g,
        grad_range,
        states,
        step,
        working,
    })
}

/// Applies the fused update `u` in place to every prepared parameter, skipped on the device
/// when `found_inf` is nonzero; on CUDA, one launch per list of parameters of one dtype
/// combination.
fn apply(items: &[Prepared], found_inf: Option<&Tensor>, u: OptimUpdate) -> Result<()> {
    let flag = found_inf.map(|f| f.to_dtype(DType::F32)).transpose()?;
    let fs = flag.as_ref().map(|f| f.storage());
    let grads: Vec<_> = items.iter().map(|it| it.grad.storage()).collect();
    let mut all: Vec<&Tensor> = Vec::new();
    for it in items {
        all.extend([&it.target, &it.step]);
        all.extend(it.working.as_ref().map(|w| &w.0));
        all.extend(it.states.iter());
    }
    Tensor::write_many("optimizer step", &all, |s| {
        let mut rest = s;
        let mut ops = Vec::with_capacity(items.len());
        for (it, g) in items.iter().zip(&grads) {
            let k = 2 + usize::from(it.working.is_some()) + it.states.len();
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(k);
            rest = tail;
            let [param, step, more @ ..] = head else {
                unreachable!("parameter and step come first")
            };
            let (working, states) = match &it.working {
                Some((_, rounding)) => {
                    let [w, states @ ..] = more else {
                        unreachable!("the working copy follows the step")
                    };
                    (Some((&mut **w, *rounding)), states)
                }
                None => (None, more),
            };
            ops.push(OptimItem {
                param: &mut **param,
                grad: Span {
                    storage: &**g,
                    range: it.grad_range.clone(),
                },
                states: states.iter_mut().map(|s| &mut **s).collect(),
                step: &mut **step,
                working,
            });
        }
        Storage::optim_update_many(ops, fs.as_deref(), &u)
    })
}
