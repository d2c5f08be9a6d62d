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
