//! A module run under gradient checkpointing.

use super::{Module, Visitor, VisitorMut};
use crate::autograd::checkpoint;
use crate::{Result, Tensor};
use std::sync::{Arc, RwLock, RwLockReadGuard};

/// Runs the wrapped module under [`checkpoint`]: its activations are not kept for backward,
/// which runs its forward again (PyTorch's `torch.utils.checkpoint` around a block). Its
/// tensors keep the wrapped module's names, so checkpoints load either way.
///
/// ```
/// use mantissa::nn::{Checkpointed, Linear, Module};
/// use mantissa::{Device, Generator, Tensor};
/// let layer = Checkpointed::new(Linear::new(4, 2, true, &mut Generator::new(0))?);
/// let x = Tensor::ones(&[3, 4], mantissa::DType::F32, Device::Cpu)?;
/// layer.forward(&x)?.sum_all()?.backward()?;
/// assert!(layer.parameters().iter().all(|p| p.grad().is_some()));
/// # Ok::<(), mantissa::Error>(())
/// ```
pub struct Checkpointed<M> {
    // Shared with the recomputation a recorded graph holds; written only through `&mut self`.
    inner: Arc<RwLock<M>>,
}

impl<M: Module + 'static> Checkpointed<M> {
    pub fn new(module: M) -> Checkpointed<M> {
        Checkpointed {
            inner: Arc::new(RwLock::new(module)),
        }
    }

    /// The wrapped module.
    pub fn inner(&self) -> RwLockReadGuard<'_, M> {
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }
}

impl<M: Module + 'static> Module for Checkpointed<M> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let m = Arc::clone(&self.inner);
        checkpoint(&[x], move |xs| {
            let m = m.read().unwrap_or_else(|e| e.into_inner());
            m.forward(&xs[0])
        })
    }
    fn visit(&self, prefix: &str, f: &mut Visitor) {
        self.inner().visit(prefix, f)
    }
    fn visit_mut(&mut self, prefix: &str, f: &mut VisitorMut) -> Result<()> {
        let mut m = self.inner.write().unwrap_or_else(|e| e.into_inner());
        m.visit_mut(prefix, f)
    }
    fn set_training(&mut self, on: bool) {
        let mut m = self.inner.write().unwrap_or_else(|e| e.into_inner());
        m.set_training(on)
    }
}
