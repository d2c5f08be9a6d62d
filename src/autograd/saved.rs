//! What an op's backward reads of its inputs: the tensor itself, kept from the forward, or,
//! where the input's producer can make it again bit for bit from what its own backward keeps
//! anyway, a recipe run in backward. Batch norm offers one for its output
//! (`(x - mean) * invstd * weight + bias`, clamped with a fused ReLU, from its input and
//! coefficients): a convolution that reads a batch norm's output then keeps nothing of its
//! own between the passes, and the output is freed as soon as the forward has used it. In
//! ResNet-50 that is two of every bottleneck's three convolution inputs, about a sixth of what
//! a training step keeps, for one more pass over each in backward. Batch norm's recipe also
//! names its parts (input, coefficients, ReLU): a convolution may apply that map in its
//! weight gradient's prologue instead of having the output made (`conv_stats`'s switch).

use crate::tensor::node::{AffineParts, Recipe};
use crate::{Device, Result, Tensor};
use std::sync::atomic::{AtomicU8, Ordering};

/// Where outputs that can be made again in backward are, instead of kept from the forward
/// (the process-wide policy; [`set_recompute`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Recompute {
    /// On a GPU (the default): device memory is what bounds the batch there, and a pass
    /// costs little; on the CPU the outputs are kept.
    #[default]
    Gpu,
    /// On every device.
    Always,
    /// Nowhere: everything a backward reads is kept, as PyTorch does.
    Never,
}

static POLICY: AtomicU8 = AtomicU8::new(0);

/// Sets where batch norm outputs read by the next op's backward (a convolution's input) are
/// made again in backward instead of kept: less memory between the passes for one more pass
/// over each such output. Gradients are the same either way, bit for bit. It applies to the
/// graphs recorded after the call.
///
/// ```
/// use mantissa::autograd::{recompute, set_recompute, Recompute};
/// assert_eq!(recompute(), Recompute::Gpu);
/// set_recompute(Recompute::Never);
/// assert_eq!(recompute(), Recompute::Never);
/// set_recompute(Recompute::Gpu);
/// ```
pub fn set_recompute(r: Recompute) {
    let v = match r {
        Recompute::Gpu => 0,
        Recompute::Always => 1,
        Recompute::Never => 2,
    };
    POLICY.store(v, Ordering::Relaxed);
}

/// The policy [`set_recompute`] set.
pub fn recompute() -> Recompute {
    match POLICY.load(Ordering::Relaxed) {
        1 => Recompute::Always,
        2 => Recompute::Never,
        _ => Recompute::Gpu,
    }
}

/// A tensor a backward closure reads: kept, or made again from its producer's recipe.
pub(crate) enum Saved {
    Kept(Tensor),
    Recomputed(Recipe),
}

impl Saved {
    /// `t` as a backward will read it: recomputed where the policy allows it on `t`'s device
    /// and `t` is the very output its producer offers a recipe for (not a view of it), else
    /// kept.
    pub(crate) fn new(t: &Tensor) -> Saved {
        let wanted = match recompute() {
            Recompute::Gpu => t.device() != Device::Cpu,
            Recompute::Always => true,
            Recompute::Never => false,
        };
        let recipe = match (&t.0.node, wanted) {
            (Some(node), true) => node.recipe_of(t.id()),
            _ => None,
        };
        match recipe {
            Some(r) => Saved::Recomputed(r),
            None => Saved::Kept(t.clone()),
        }
    }

    /// The kept tensor (whose version the node checks), or `None` when it is recomputed (the
    /// recipe checks the versions of what it reads).
    pub(crate) fn kept(&self) -> Option<&Tensor> {
        match self {
            Saved::Kept(t) => Some(t),
            Saved::Recomputed(_) => None,
        }
    }

    /// The parts of the affine map the recipe applies, where it is one (batch norm's): an
    /// op may apply it itself instead of calling [`Saved::get`].
    pub(crate) fn affine(&self) -> Option<&AffineParts> {
        match self {
            Saved::Recomputed(r) => r.affine.as_ref(),
            Saved::Kept(_) => None,
        }
    }

    /// The tensor, made again where it was not kept.
    pub(crate) fn get(&self) -> Result<Tensor> {
        match self {
            Saved::Kept(t) => Ok(t.clone()),
            Saved::Recomputed(r) => (r.make)(),
        }
    }
}

/// An input that a backward reads only for another input's gradient (`x` of `x * w` is read
/// for `w`'s): kept when that other input requires grad, else `None`, so that an in-place
/// write to it afterwards is no error and its memory is not held (PyTorch's saved sets: a
/// frozen layer keeps no copy of its input).
pub(crate) fn kept_for(other_requires_grad: bool, t: &Tensor) -> Option<Tensor> {
    other_requires_grad.then(|| t.clone())
}

/// The input [`kept_for`] kept, or an error naming `op` when backward asks for a gradient
/// the forward did not keep it for (an input's requirement is fixed when the op records).
pub(crate) fn kept<'a>(op: &'static str, t: &'a Option<Tensor>) -> Result<&'a Tensor> {
    t.as_ref().ok_or_else(|| {
        crate::Error::Autograd(format!(
            "backward of {op} needs an input that the forward did not keep: no input that \
             reads it required grad then"
        ))
    })
}

/// The inputs among `kept` that were kept, as [`crate::Tensor::attach_saving`]'s version
/// checks take them.
pub(crate) fn held(kept: &[&Option<Tensor>]) -> Vec<Tensor> {
    kept.iter().copied().flatten().cloned().collect()
}
