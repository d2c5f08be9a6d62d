//! What a backward does with one tensor's gradient besides sending it on: the hooks a user
//! registered on the tensor (PyTorch's `Tensor.register_hook`), which see the gradient and
//! may replace it, and `retain_grad`, which keeps a non-leaf's gradient in its `.grad()`.
//!
//! Taps are kept in a registry keyed by the tensor's gradient slot, which the graph reaches
//! from both sides: a leaf's edges hold the slot, and the node that made a tensor holds a
//! weak link to it. A leaf's hooks see its whole gradient of one backward (the sum of what
//! every use sends), once, when the last node that sends it one has run; a non-leaf's, the
//! gradient of its node when that node runs.

use crate::sync::lock;
use crate::{Error, Result, Tensor};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// A gradient hook: gets the gradient, returns a replacement or `None` to keep it.
pub(crate) type Hook = Arc<dyn Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync>;

pub(crate) type Slot = Mutex<Option<Tensor>>;

struct Taps {
    /// The tensor's gradient slot, held weakly: while the entry exists its address is not
    /// reused, and a dead slot marks the entry for removal.
    slot: Weak<Slot>,
    hooks: Vec<(u64, Hook)>,
    retain: bool,
}

fn registry() -> &'static Mutex<HashMap<usize, Taps>> {
    static R: OnceLock<Mutex<HashMap<usize, Taps>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

/// Entries in the registry: backward skips every lookup while there are none.
static COUNT: AtomicUsize = AtomicUsize::new(0);
static NEXT_HOOK: AtomicU64 = AtomicU64::new(1);

fn key(slot: &Arc<Slot>) -> usize {
    Arc::as_ptr(slot) as usize
}

/// Runs `f` on the taps of `slot`, made when missing; entries of dropped tensors go.
fn with_taps<R>(slot: &Arc<Slot>, f: impl FnOnce(&mut Taps) -> R) -> R {
    let mut r = lock(registry());
    r.retain(|_, t| t.slot.strong_count() > 0);
    let t = r.entry(key(slot)).or_insert_with(|| Taps {
        slot: Arc::downgrade(slot),
        hooks: Vec::new(),
        retain: false,
    });
    let out = f(t);
    COUNT.store(r.len(), Ordering::Relaxed);
    out
}

/// Whether any tensor has taps (a relaxed read: registration happens before backward).
pub(crate) fn active() -> bool {
    COUNT.load(Ordering::Relaxed) > 0
}

/// Whether the slot has hooks or retains its gradient.
pub(crate) fn tapped(slot: &Arc<Slot>) -> bool {
    active() && lock(registry()).contains_key(&key(slot))
}

/// Applies the hooks of `slot`, in the order they were registered, to `g`; then keeps it
/// in the slot when it retains (a non-leaf's `retain_grad`). The hooks run without the
/// registry's lock held (a hook may register another).
pub(crate) fn apply(slot: &Arc<Slot>, g: Tensor, keep: bool) -> Result<Tensor> {
    let (hooks, retain) = match lock(registry()).get(&key(slot)) {
        None => return Ok(g),
        Some(t) => (t.hooks.clone(), t.retain),
    };
    let mut g = g;
    for (_, h) in hooks {
        if let Some(new) = h(&g)? {
            if new.shape() != g.shape() {
                return Err(Error::Autograd(format!(
                    "a gradient hook returned shape {:?} for a gradient of shape {:?}",
                    new.shape(),
                    g.shape()
                )));
            }
            g = new.detach().to_dtype(g.dtype())?;
        }
    }
    if keep && retain {
        // A copy: the gradient sent on may be summed into in place further down.
        super::accumulate(slot, g.copy()?)?;
    }
    Ok(g)
}

impl Tensor {
    /// Keeps this non-leaf tensor's gradient in [`Tensor::grad`] after backward (PyTorch's
    /// `retain_grad`); leaves always keep theirs. A tensor that does not require grad is an
    /// error.
    ///
    /// ```
    /// use mantissa::{Tensor, Device};
    /// let x = Tensor::from_vec(vec![1.0f32, 2.0], &[2], Device::Cpu)?.requires_grad(true)?;
    /// let y = x.mul(3.0)?;
    /// y.retain_grad()?;
    /// y.sqr()?.sum_all()?.backward()?;
    /// assert_eq!(y.grad().unwrap().to_vec::<f32>()?, vec![6.0, 12.0]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn retain_grad(&self) -> Result<()> {
        if !self.is_requires_grad() {
            return Err(Error::Autograd(format!(
                "retain_grad on a tensor of shape {:?} that does not require grad",
                self.shape()
            )));
        }
        if !self.is_leaf() {
            with_taps(&self.0.grad, |t| t.retain = true);
        }
        Ok(())
    }

    /// Registers `hook`, called with this tensor's gradient during each backward; it may
    /// return a replacement (same shape) that is sent on instead, or `None` (PyTorch's
    /// `register_hook`). For a leaf, the hook sees the whole gradient of the backward once
    /// and what it returns is accumulated into `.grad()`.
    ///
    /// ```
    /// use mantissa::{Tensor, Device};
    /// let x = Tensor::from_vec(vec![1.0f32, 2.0], &[2], Device::Cpu)?.requires_grad(true)?;
    /// let handle = x.register_hook(|g| Ok(Some(g.clamp(-1.0, 1.0)?)))?;
    /// x.mul(5.0)?.sum_all()?.backward()?;
    /// assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![1.0, 1.0]);
    /// handle.remove();
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn register_hook(
        &self,
        hook: impl Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync + 'static,
    ) -> Result<HookHandle> {
        if !self.is_requires_grad() {
            return Err(Error::Autograd(format!(
                "register_hook on a tensor of shape {:?} that does not require grad",
                self.shape()
            )));
        }
        let id = NEXT_HOOK.fetch_add(1, Ordering::Relaxed);
        with_taps(&self.0.grad, |t| t.hooks.push((id, Arc::new(hook))));
        Ok(HookHandle {
            slot: Arc::downgrade(&self.0.grad),
            id,
        })
    }
}

/// A hook registered with [`Tensor::register_hook`]; [`HookHandle::remove`] takes it off
/// (dropping the handle leaves it on, as in PyTorch).
pub struct HookHandle {
    slot: Weak<Slot>,
    id: u64,
}

impl HookHandle {
    /// Takes the hook off its tensor.
    pub fn remove(self) {
        if let Some(slot) = self.slot.upgrade() {
            let mut r = lock(registry());
            if let Some(t) = r.get_mut(&key(&slot)) {
                t.hooks.retain(|(id, _)| *id != self.id);
                if t.hooks.is_empty() && !t.retain {
                    r.remove(&key(&slot));
                }
            }
            COUNT.store(r.len(), Ordering::Relaxed);
        }
    }
}
