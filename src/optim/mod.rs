//! Optimizers (SGD, Adam, AdamW, SGLD, Adadelta), learning-rate schedules and gradient clipping.
//!
//! Optimizers own the list of parameters they update and a state per parameter (momentum
//! buffers, moments, step counts), exposed as named tensors for checkpoints. Updates are done
//! in place under `no_grad`, so modules holding the parameters see the new values.

mod adadelta;
mod adam;
mod master;
mod schedule;
mod sgd;

pub use crate::backend::rounding::Rounding;
pub use adadelta::Adadelta;
pub use adam::{Adam, AdamConfig};
pub use schedule::{ConstantLr, CosineAnnealing, LinearWarmup, LrSchedule, OneCycle, StepLr};
pub use sgd::{Sgd, SgdConfig, Sgld};

use crate::backend::ops::OptimUpdate;
use crate::backend::optim::OptimItem;
use crate::backend::Storage;
use crate::{DType, Error, Generator, Result, Tensor};
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

/// The parameters an optimizer updates and their states.
#[derive(Default)]
pub struct ParamGroup {
    pub params: Vec<Tensor>,
    pub states: Vec<ParamState>,
    /// With fp32 master weights on, how working copies are rounded (see
    /// [`Optimizer::use_master_weights`]).
    pub(crate) masters: Option<Rounding>,
    /// The learning rate as [`Optimizer::set_lr`] last set it (or the last step used),
    /// shared with the CUDA graphs that captured a step, whose replays read it.
    pub(crate) lr: LrCell,
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

impl ParamGroup {
    pub fn new(params: Vec<Tensor>) -> ParamGroup {
        let states = vec![ParamState::default(); params.len()];
        ParamGroup {
            params,
            states,
            masters: None,
            lr: LrCell::default(),
        }
    }

    /// Applies the fused update `u` to every parameter that has a gradient; the update reads
    /// and writes the states `names`. With `found_inf`, the kernels skip when it is nonzero.
    pub(crate) fn fused_steps(
        &mut self,
        names: &[&str],
        u: OptimUpdate,
        found_inf: Option<&Tensor>,
    ) -> Result<()> {
        self.lr.set(u.lr());
        // Captured, the kernels read the learning rate from the replay's prologue, which
        // each replay fills from the rate set then (a schedule needs no re-capture).
        let hyper = match crate::capture::active() {
            true => {
                let lr = self.lr.clone();
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
            let mut items = Vec::with_capacity(self.params.len());
            for i in 0..self.params.len() {
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

/// The common interface of the optimizers.
pub trait Optimizer {
    /// Applies one update to every parameter that has a gradient, unless `found_inf` (an f32
    /// scalar on the parameters' device, as [`crate::amp::GradScaler`] keeps it) is nonzero:
    /// then parameters and states stay bit-unchanged. The decision is taken by the update
    /// kernels, without reading the flag back to the host.
    fn step_unless(&mut self, found_inf: Option<&Tensor>) -> Result<()>;
    /// The parameters and their states.
    fn group(&self) -> &ParamGroup;
    fn group_mut(&mut self) -> &mut ParamGroup;
    fn lr(&self) -> f64;
    fn set_lr(&mut self, lr: f64);

    /// Turns on fp32 master weights: every f16/bf16 parameter becomes the working copy of an
    /// f32 master the optimizer keeps (state `master`, initialised from the parameter), the
    /// moments are kept in f32, and each update writes master, moments and working copy in
    /// one pass, rounding the working copy with `rounding` ([`Rounding::Stochastic`] needs
    /// bf16 parameters). f32 and f64 parameters are their own masters. Gradients may be
    /// f16/bf16 or f32 (the [`crate::amp::GradScaler`] unscales into f32 in this mode).
    ///
    /// ```
    /// use mantissa::{nn::{Linear, Module}, optim::{Adam, AdamConfig, Optimizer, Rounding}};
    /// use mantissa::{DType, Generator};
    /// let mut model = Linear::new(4, 2, true, &mut Generator::new(0))?;
    /// model.to_dtype(DType::BF16)?;
    /// let mut opt = Adam::new(model.parameters(), AdamConfig::adamw(1e-3))?;
    /// opt.use_master_weights(Rounding::Stochastic { seed: 0 })?;
    /// assert_eq!(opt.states()[0].tensors["master"].dtype(), DType::F32);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    fn use_master_weights(&mut self, rounding: Rounding) -> Result<()> {
        self.group_mut().use_master_weights(rounding)
    }
    /// The working-copy rounding when master weights are on.
    fn master_weights(&self) -> Option<Rounding> {
        self.group().masters
    }

    /// Applies one update to every parameter that has a gradient.
    fn step(&mut self) -> Result<()> {
        self.step_unless(None)
    }

    /// The parameters, in the order they were given.
    fn params(&self) -> &[Tensor] {
        &self.group().params
    }
    /// Per-parameter states, aligned with [`Optimizer::params`].
    fn states(&self) -> &[ParamState] {
        &self.group().states
    }
    /// Mutable states (for loading a checkpoint).
    fn states_mut(&mut self) -> &mut [ParamState] {
        &mut self.group_mut().states
    }

    /// Drops every parameter's gradient (frees the memory, like `set_to_none=True`).
    fn zero_grad(&mut self) {
        for p in self.params() {
            p.zero_grad();
        }
    }

    /// The optimizer's own random generator, where it draws (SGLD's noise): saved with the
    /// state as `generator`, so a resumed run draws what an uninterrupted one would.
    fn generator(&self) -> Option<Generator> {
        None
    }

    /// Puts the generator [`Optimizer::generator`] reports at `gen`'s state; optimizers
    /// without one ignore it.
    fn set_generator(&mut self, _gen: Generator) {}

    /// The state as named tensors, `{i}.{name}` per parameter (`{i}.step` included), and
    /// `generator` for an optimizer that draws.
    fn state_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for (i, s) in self.states().iter().enumerate() {
            for (k, t) in &s.tensors {
                out.push((format!("{i}.{k}"), t.clone()));
            }
        }
        if let Some(g) = self.generator() {
            out.push((GENERATOR.to_string(), g.state_tensor()));
        }
        Ok(out)
    }

    /// Checks a state for [`Optimizer::load_state_tensors`] without changing anything: every
    /// entry is `{i}.{name}` with `i` below the parameter count, `step` is a one-element
    /// counter, every other state has its parameter's shape and a float dtype, and a master
    /// weight is present only with master weights on. Every problem is listed.
    fn check_state_tensors(&self, named: &BTreeMap<String, Tensor>) -> Result<()> {
        let params = self.params();
        let n = params.len();
        let mut problems = Vec::new();
        for (name, t) in named {
            if name == GENERATOR {
                match self.generator() {
                    None => {
                        problems.push("a generator state, for an optimizer that draws none".into())
                    }
                    Some(_) => {
                        if let Err(e) = Generator::from_tensor(t) {
                            problems.push(e.to_string());
                        }
                    }
                }
                continue;
            }
            let Some((i, key)) = state_entry(name, n) else {
                problems.push(format!("unexpected entry {name:?} for {n} parameters"));
                continue;
            };
            let p = &params[i];
            if key == "step" {
                if t.numel() != 1 {
                    problems.push(format!(
                        "{name} has shape {:?}, expected one element",
                        t.shape()
                    ));
                }
            } else if t.shape() != p.shape() || !t.dtype().is_float() {
                problems.push(format!(
                    "{name} is {:?} {:?}, its parameter {:?} {:?}",
                    t.shape(),
                    t.dtype(),
                    p.shape(),
                    p.dtype()
                ));
            } else if key == "master" && self.master_weights().is_none() {
                problems.push(format!(
                    "parameter {i} has a master weight in the state: call use_master_weights \
                     before loading"
                ));
            }
        }
        match problems.is_empty() {
            true => Ok(()),
            false => Err(Error::invalid("load_state_tensors", problems.join("; "))),
        }
    }

    /// Restores a state written by [`Optimizer::state_tensors`]; parameter counts must match.
    /// The state is checked first ([`Optimizer::check_state_tensors`]) and copied to the
    /// parameters' devices before the optimizer's own is replaced, so a refused state changes
    /// nothing. With master weights on, the working copies are then regenerated from the
    /// masters (bit-exactly as the last update wrote them, stochastic rounding included).
    fn load_state_tensors(&mut self, named: &BTreeMap<String, Tensor>) -> Result<()> {
        self.check_state_tensors(named)?;
        let devices: Vec<_> = self.params().iter().map(|p| p.device()).collect();
        let mut fresh = vec![ParamState::default(); devices.len()];
        let generator = named
            .get(GENERATOR)
            .map(Generator::from_tensor)
            .transpose()?;
        if generator.is_none() && self.generator().is_some() {
            log::warn!(
                "load_state_tensors: the state has no generator; the optimizer's random \
                 stream goes on from where it stands"
            );
        }
        for (name, t) in named {
            let Some((i, key)) = state_entry(name, devices.len()) else {
                continue; // the generator, or refused by check_state_tensors above
            };
            fresh[i]
                .tensors
                .insert(key.to_string(), t.to_device(devices[i])?.copy()?);
        }
        if let Some(gen) = generator {
            self.set_generator(gen);
        }
        let g = self.group_mut();
        g.states.clone_from_slice(&fresh);
        if g.masters.is_some() {
            g.adopt_masters()?;
            g.sync_working_copies()?;
        }
        Ok(())
    }
}

/// The name of an optimizer's generator state in [`Optimizer::state_tensors`].
const GENERATOR: &str = "generator";

/// Parameter index and state name of a `{i}.{name}` state entry, for `n` parameters.
fn state_entry(name: &str, n: usize) -> Option<(usize, &str)> {
    name.split_once('.')
        .and_then(|(i, k)| Some((i.parse::<usize>().ok()?, k)))
        .filter(|(i, _)| *i < n)
}

/// One parameter's operands of a fused update, checked and in the parameter's memory order.
struct Prepared {
    /// The parameter, or its f32 master.
    target: Tensor,
    grad: Tensor,
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
    let g = g.filled_in(format)?;
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
                grad: g,
                states: states.iter_mut().map(|s| &mut **s).collect(),
                step: &mut **step,
                working,
            });
        }
        Storage::optim_update_many(ops, fs.as_deref(), &u)
    })
}

/// Scales the gradients of `params` so that their global L2 norm is at most `max_norm`, and
/// returns the norm before clipping (a 0-d f32 tensor; `.item()` reads it).
///
/// PyTorch's `clip_grad_norm_` with its foreach kernels: the sum of squares of every gradient
/// in one pass per dtype and list of gradients (accumulated in f32, f64 on the CPU, joined in
/// a fixed order), and the scaling by `min(1, max_norm / (norm + 1e-6))` in one more; the
/// coefficient stays on the device (no host read). f64 gradients take a per-tensor path.
///
/// ```
/// use mantissa::{Tensor, Device, optim::clip_grad_norm};
/// let p = Tensor::from_vec(vec![0.0f32, 0.0], &[2], Device::Cpu)?.requires_grad(true)?;
/// p.set_grad(Some(Tensor::from_vec(vec![3.0f32, 4.0], &[2], Device::Cpu)?))?;
/// let norm = clip_grad_norm(&[p.clone()], 1.0)?;
/// assert_eq!(norm.item()?, 5.0);
/// assert!((p.grad().unwrap().to_vec::<f32>()?[1] - 0.8).abs() < 1e-6);
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> Result<Tensor> {
    if max_norm.is_nan() || max_norm <= 0.0 {
        return Err(Error::invalid(
            "clip_grad_norm",
            format!("max_norm {max_norm} must be positive"),
        ));
    }
    crate::no_grad(|| {
        let device = params.first().map(|p| p.device()).unwrap_or_default();
        let with_grad: Vec<(&Tensor, Tensor)> = params
            .iter()
            .filter_map(|p| p.grad().map(|g| (p, g)))
            .collect();
        if with_grad.is_empty() {
            return Tensor::zeros(&[], DType::F32, device);
        }
        let listed = |d: DType| matches!(d, DType::F32 | DType::F16 | DType::BF16);
        if !with_grad.iter().all(|(_, g)| listed(g.dtype())) {
            return clip_per_tensor(&with_grad, max_norm, device);
        }
        let grads = with_grad
            .iter()
            .map(|(_, g)| in_storage_order(g.clone()))
            .collect::<Result<Vec<_>>>()?;
        let storages: Vec<_> = grads.iter().map(|g| g.storage()).collect();
        let refs: Vec<&Storage> = storages.iter().map(|s| &**s).collect();
        let total = Tensor::from_storage(Storage::sum_squares(&refs)?, &[]);
        drop(storages);
        let norm = total.sqrt()?;
        // coef = min(1, max_norm / (norm + 1e-6)), applied without reading the norm back.
        let coef = norm.add(1e-6)?.recip()?.mul(max_norm)?.minimum(1.0)?;
        // The scaler's multi-tensor pass scales them all; its overflow flag is not wanted.
        let flag = Tensor::zeros(&[], DType::F32, device)?;
        let params: Vec<&Tensor> = with_grad.iter().map(|(p, _)| *p).collect();
        scale_grads("clip_grad_norm", &params, &grads, &coef, &flag, None)?;
        Ok(norm)
    })
}

/// Multiplies the gradients `grads` of `params` (each filling its storage: see
/// [`in_storage_order`]) by the f32 scalar `factor`, a device tensor, in one multi-tensor pass
/// per dtype, and sets `flag` (an f32 scalar) to 1 when an element is inf or NaN. In place,
/// as PyTorch's foreach kernels: whoever holds a gradient sees it change. A gradient that is
/// not its parameter's own (`in_storage_order` copied it), or whose storage another listed
/// gradient shares, is scaled as a copy of its own that becomes the parameter's gradient.
/// With `out` (master weights: f32), every gradient becomes a new one of that dtype.
pub(crate) fn scale_grads(
    op: &'static str,
    params: &[&Tensor],
    grads: &[Tensor],
    factor: &Tensor,
    flag: &Tensor,
    out: Option<DType>,
) -> Result<()> {
    if let Some(out) = out {
        let storages: Vec<_> = grads.iter().map(|g| g.storage()).collect();
        let refs: Vec<&Storage> = storages.iter().map(|s| &**s).collect();
        let scaled = Tensor::write_many(op, &[flag], |f| {
            Storage::unscale_grads(&refs, &factor.storage(), f[0], out)
        })?;
        drop(storages);
        for ((p, g), s) in params.iter().zip(grads).zip(scaled) {
            p.set_grad(Some(Tensor::from_storage_in(s, g.layout().clone())))?;
        }
        return Ok(());
    }
    let mut seen = std::collections::HashSet::with_capacity(grads.len());
    let mut owned = Vec::with_capacity(grads.len());
    for (p, g) in params.iter().zip(grads) {
        let g = match seen.insert(g.storage_addr()) {
            true => g.clone(),
            false => Tensor::from_storage_in(g.storage().try_clone()?, g.layout().clone()),
        };
        if !p.grad().is_some_and(|h| h.shares_storage(&g)) {
            p.set_grad(Some(g.clone()))?;
        }
        owned.push(g);
    }
    let mut written = vec![flag];
    written.extend(&owned);
    Tensor::write_many(op, &written, |w| {
        let (flag, grads) = w.split_first_mut().expect("the flag comes first");
        Storage::unscale_grads_(grads, &factor.storage(), flag)
    })
}

/// [`clip_grad_norm`] a gradient at a time, for dtypes the multi-tensor passes do not take.
fn clip_per_tensor(
    with_grad: &[(&Tensor, Tensor)],
    max_norm: f64,
    device: crate::Device,
) -> Result<Tensor> {
    let mut total = Tensor::zeros(&[], DType::F32, device)?;
    for (_, g) in with_grad {
        total = total.add(&g.to_dtype(DType::F32)?.sqr()?.sum_all()?)?;
    }
    let norm = total.sqrt()?;
    let coef = norm.add(1e-6)?.recip()?.mul(max_norm)?.minimum(1.0)?;
    for (p, g) in with_grad {
        p.set_grad(Some(g.mul(&coef.to_dtype(g.dtype())?)?))?;
    }
    Ok(norm)
}

/// `g`, or a copy of it, whose storage holds exactly its elements in a dense order (its
/// memory format kept): what the multi-tensor passes walk, element by element.
pub(crate) fn in_storage_order(g: Tensor) -> Result<Tensor> {
    let dense = g.is_contiguous() || g.layout().dense_order().is_some();
    let fills = g.layout().offset() == 0 && g.storage().len() == g.numel();
    if dense && fills {
        Ok(g)
    } else {
        g.copy()
    }
}

/// Checks a hyperparameter is finite and not negative.
pub(crate) fn check_hyper(op: &'static str, name: &str, v: f64) -> Result<()> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(Error::invalid(
            op,
            format!("{name} = {v} must be finite and >= 0"),
        ))
    }
}
