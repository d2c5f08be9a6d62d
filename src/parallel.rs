//! How many of the compute pool's threads a CPU kernel started on this thread splits its work
//! across: all of them, or a share set by `autograd::join` when two parts of one backward run
//! side by side.

use std::cell::Cell;

thread_local! {
    /// How many pool threads an op started on this thread may split its work across; 0 means
    /// all of them.
    static SHARE: Cell<usize> = const { Cell::new(0) };
}

/// How many pool threads a CPU kernel started on this thread should split its work across.
pub(crate) fn threads() -> usize {
    match SHARE.with(|s| s.get()) {
        0 => rayon::current_num_threads(),
        n => n,
    }
}

/// Sets this thread's share for as long as it lives.
pub(crate) struct ShareGuard(usize);

impl ShareGuard {
    pub(crate) fn new(share: usize) -> ShareGuard {
        ShareGuard(SHARE.with(|s| s.replace(share)))
    }
}

impl Drop for ShareGuard {
    fn drop(&mut self) {
        SHARE.with(|s| s.set(self.0));
    }
}

/// The thread-local modes an op reads (grad mode, autocast regions, checkpoint frames),
/// taken off this thread for as long as it lives and put back when dropped.
///
/// A thread waiting in a parallel section (a CPU kernel's rayon loop, a `rayon::join`) runs
/// other tasks of the pool meanwhile, a user's rayon task among them; without this, that task
/// would see the waiting op's modes (no grad inside a backward, an autocast region, a
/// checkpoint's recording) as its own. Every CPU kernel opens one before it enters a parallel
/// section; the pool's share ([`threads`]) stays, as the kernel reads it. (The pending sums of
/// a running backward, `autograd::pending`, need none: a backward pushes its own frame before
/// its nodes can take from the top one.)
#[must_use = "the modes come back when the guard is dropped"]
pub(crate) struct Isolated {
    grad: Option<crate::scope::Stashed<bool>>,
    autocast: Option<crate::scope::Stashed<crate::autocast_state::State>>,
    frames: Option<crate::frames::Stash>,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Isolated {
    pub(crate) fn new() -> Isolated {
        Isolated {
            grad: Some(crate::grad_mode::stash()),
            autocast: Some(crate::autocast_state::stash()),
            frames: Some(crate::frames::stash()),
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for Isolated {
    fn drop(&mut self) {
        if let Some(s) = self.frames.take() {
            crate::frames::unstash(s);
        }
        if let Some(s) = self.autocast.take() {
            crate::autocast_state::unstash(s);
        }
        if let Some(s) = self.grad.take() {
            crate::grad_mode::unstash(s);
        }
    }
}
