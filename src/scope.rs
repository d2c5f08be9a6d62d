//! Per-thread scoped settings (grad mode, autocast) as a stack of live guards.
//!
//! Each guard pushes the setting it opens and, when dropped, removes its own entry wherever
//! it sits; the setting in force is the newest live entry's, or the default when none is
//! live. Guards dropped out of order therefore never leave a setting behind once all of them
//! are gone (a guard that saved "the previous value" and restored it would: drop the outer
//! one first and the inner one's restore brings back the outer region's setting).

use std::cell::RefCell;
use std::marker::PhantomData;
use std::thread::LocalKey;

/// The live entries of one setting on one thread, oldest first.
pub(crate) struct ScopeStack<T> {
    entries: Vec<(u64, T)>,
    next_id: u64,
}

impl<T: Copy> ScopeStack<T> {
    pub(crate) const fn new() -> Self {
        ScopeStack {
            entries: Vec::new(),
            next_id: 0,
        }
    }

    /// The newest live setting.
    pub(crate) fn top(&self) -> Option<T> {
        self.entries.last().map(|e| e.1)
    }
}

/// A guard's handle on its entry in a thread-local [`ScopeStack`]. It is neither `Send` nor
/// `Sync`: the entry lives on the thread that opened it, so the guard must be dropped there.
pub(crate) struct ScopeEntry<T: 'static> {
    stack: &'static LocalKey<RefCell<ScopeStack<T>>>,
    id: u64,
    _not_send: PhantomData<*const ()>,
}

impl<T: Copy + 'static> ScopeEntry<T> {
    /// Pushes `value` on this thread's `stack`; `changed` runs with the new top.
    pub(crate) fn push(
        stack: &'static LocalKey<RefCell<ScopeStack<T>>>,
        value: T,
        changed: impl FnOnce(Option<T>),
    ) -> Self {
        let id = stack.with(|s| {
            let mut s = s.borrow_mut();
            let id = s.next_id;
            s.next_id += 1;
            s.entries.push((id, value));
            id
        });
        changed(Some(value));
        ScopeEntry {
            stack,
            id,
            _not_send: PhantomData,
        }
    }

    /// Removes this entry; `changed` runs with the new top (`None`: no entry is live).
    pub(crate) fn pop(&self, changed: impl FnOnce(Option<T>)) {
        // `try_with`: at thread exit the stack may already be gone, and then so is the setting.
        let top = self.stack.try_with(|s| {
            let mut s = s.borrow_mut();
            s.entries.retain(|e| e.0 != self.id);
            s.top()
        });
        if let Ok(top) = top {
            changed(top);
        }
    }
}

/// A thread's live entries of one setting, taken off the thread by [`stash`] while it waits in
/// a parallel section, and put back by [`unstash`].
pub(crate) struct Stashed<T>(ScopeStack<T>);

/// Takes this thread's live entries of `stack` off it, leaving the default in force (`changed`
/// runs with `None`). Entry ids keep counting, so a guard opened while the entries are away
/// and one opened before never share an id.
pub(crate) fn stash<T: Copy + 'static>(
    stack: &'static LocalKey<RefCell<ScopeStack<T>>>,
    changed: impl FnOnce(Option<T>),
) -> Stashed<T> {
    let taken = stack.with(|s| {
        let mut s = s.borrow_mut();
        ScopeStack {
            entries: std::mem::take(&mut s.entries),
            next_id: s.next_id,
        }
    });
    changed(None);
    Stashed(taken)
}

/// Puts `saved` back on this thread's `stack` (below any entry still live, which a guard
/// leaked while the entries were away would leave); `changed` runs with the new top.
pub(crate) fn unstash<T: Copy + 'static>(
    stack: &'static LocalKey<RefCell<ScopeStack<T>>>,
    saved: Stashed<T>,
    changed: impl FnOnce(Option<T>),
) {
    let top = stack.try_with(|s| {
        let mut s = s.borrow_mut();
        let mut entries = saved.0.entries;
        entries.append(&mut s.entries);
        s.entries = entries;
        s.next_id = s.next_id.max(saved.0.next_id);
        s.top()
    });
    if let Ok(top) = top {
        changed(top);
    }
}
