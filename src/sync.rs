//! Locks that survive a panic elsewhere.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, taking the data as it is when a thread panicked while holding it: the values
/// behind these locks (gradient slots, caches, handle maps) stay valid between statements, so
/// a poisoned lock is used as is rather than spreading the panic.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
