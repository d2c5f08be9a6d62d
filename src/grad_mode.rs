//! Graph recording on or off, per thread: [`no_grad`] and [`NoGradGuard`] (PyTorch's
//! `torch.no_grad()`). Every op reads [`is_grad_enabled`] before it records a node.

use crate::scope::{ScopeEntry, ScopeStack, Stashed};
use std::cell::{Cell, RefCell};

thread_local! {
    /// The grad mode in force: a cache of [`NO_GRAD`]'s top, read by every op.
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
    static NO_GRAD: RefCell<ScopeStack<bool>> = const { RefCell::new(ScopeStack::new()) };
}

/// True unless inside a [`no_grad`] scope on this thread.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Disables graph recording on this thread until dropped.
///
/// Guards nest and may be dropped in any order: gradients stay off while any guard of this
/// thread is alive and come back once all are gone. A guard is not `Send`: it belongs to the
/// thread whose grad mode it changed.
///
/// ```
/// use mantissa::{is_grad_enabled, NoGradGuard};
/// let a = NoGradGuard::new();
/// let b = NoGradGuard::new();
/// drop(a);
/// assert!(!is_grad_enabled());
/// drop(b);
/// assert!(is_grad_enabled());
/// ```
#[must_use = "gradients are off as long as the guard lives"]
pub struct NoGradGuard {
    _mode: GradMode,
}

impl NoGradGuard {
    #[allow(clippy::new_without_default)]
    pub fn new() -> NoGradGuard {
        NoGradGuard {
            _mode: GradMode::push(false),
        }
    }
}

/// A grad mode pushed on this thread's stack until dropped: what both guards hold.
struct GradMode {
    entry: ScopeEntry<bool>,
}

impl GradMode {
    fn push(enabled: bool) -> GradMode {
        GradMode {
            entry: ScopeEntry::push(&NO_GRAD, enabled, set_grad_mode),
        }
    }
}

impl Drop for GradMode {
    fn drop(&mut self) {
        self.entry.pop(set_grad_mode);
    }
}

fn set_grad_mode(top: Option<bool>) {
    let _ = GRAD_ENABLED.try_with(|g| g.set(top.unwrap_or(true)));
}

/// Takes this thread's grad-mode scopes off it (recording on, as on a fresh thread) while it
/// waits in a parallel section: see `crate::parallel::Isolated`.
pub(crate) fn stash() -> Stashed<bool> {
    crate::scope::stash(&NO_GRAD, set_grad_mode)
}

/// Puts back what [`stash`] took.
pub(crate) fn unstash(saved: Stashed<bool>) {
    crate::scope::unstash(&NO_GRAD, saved, set_grad_mode)
}

/// Runs `f` without recording the graph (like `with torch.no_grad():`).
///
/// ```
/// use mantissa::{no_grad, Tensor};
/// let w = Tensor::ones(&[2], mantissa::DType::F32, mantissa::Device::Cpu).unwrap().requires_grad(true).unwrap();
/// let y = no_grad(|| w.mul(2.0)).unwrap();
/// assert!(!y.is_requires_grad());
/// ```
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    let _g = NoGradGuard::new();
    f()
}

/// Turns graph recording back on for this thread until dropped (PyTorch's
/// `torch.enable_grad()`): a checkpoint's recomputation records its graph inside a backward.
#[must_use = "gradients are on as long as the guard lives"]
pub(crate) struct EnableGradGuard {
    _mode: GradMode,
}

impl EnableGradGuard {
    pub(crate) fn new() -> EnableGradGuard {
        EnableGradGuard {
            _mode: GradMode::push(true),
        }
    }
}
