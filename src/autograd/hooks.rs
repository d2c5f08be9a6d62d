//! Gradient-ready notifications: an observer registered on leaves is told, during backward,
//! as soon as a leaf's gradient for this backward is complete (the last node that could send
//! it one has run), and once the backward is over. The data-parallel wrapper launches a
//! bucket's all-reduce from these, while backward goes on (PyTorch's reducer hooks).
//!
//! A leaf is keyed by its gradient slot (the graph's leaf edges hold it) and by its storage
//! (a checkpoint's node saves the parameters its recomputation reads, whose gradients arrive
//! when that node runs). Only the outermost backward notifies: a checkpoint's nested one is
//! inside a node of it.

use crate::sync::lock;
use crate::{Result, Tensor};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// Told about the leaves it was registered on.
pub(crate) trait GradReady: Send + Sync {
    /// Leaf `index`'s gradient for backward `backward` (an id, new for each backward) is
    /// complete (it may have none).
    fn ready(&self, index: usize, backward: u64) -> Result<()>;
    /// Backward `backward`, which reached some of its leaves, is over (each is ready by then).
    fn done(&self, backward: u64) -> Result<()>;
}

type Entry = (Weak<dyn GradReady>, usize, u64);
/// The leaves to notify: observer and leaf index.
type Notices = Vec<(Arc<dyn GradReady>, usize)>;

struct Registry {
    by_key: HashMap<usize, Entry>,
    next: u64,
}

fn registry() -> &'static Mutex<Registry> {
    static R: OnceLock<Mutex<Registry>> = OnceLock::new();
    R.get_or_init(|| {
        Mutex::new(Registry {
            by_key: HashMap::new(),
            next: 0,
        })
    })
}

/// Registered keys, so that a backward with none to notify skips the lookups.
static COUNT: AtomicUsize = AtomicUsize::new(0);

/// The registration of leaves with an observer: dropping it unregisters them.
pub(crate) struct Registration {
    keys: Vec<usize>,
    id: u64,
}

/// Registers `leaves[i]` as index `i` of `observer`.
pub(crate) fn register(leaves: &[Tensor], observer: &Arc<dyn GradReady>) -> Registration {
    let mut r = lock(registry());
    let id = r.next;
    r.next += 1;
    let mut keys = Vec::with_capacity(2 * leaves.len());
    for (i, t) in leaves.iter().enumerate() {
        for key in [Arc::as_ptr(&t.0.grad) as usize, t.storage_addr()] {
            r.by_key.insert(key, (Arc::downgrade(observer), i, id));
            keys.push(key);
        }
    }
    COUNT.fetch_add(keys.len(), Ordering::Relaxed);
    Registration { keys, id }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut r = lock(registry());
        for k in &self.keys {
            if r.by_key.get(k).is_some_and(|e| e.2 == self.id) {
                r.by_key.remove(k);
            }
        }
        COUNT.fetch_sub(self.keys.len(), Ordering::Relaxed);
    }
}

/// The notifications of one backward: for each node position, the leaves whose last
/// possible sender it is.
pub(crate) struct Plan {
    id: u64,
    at: HashMap<usize, Notices>,
    observers: Vec<Arc<dyn GradReady>>,
}

impl Plan {
    /// The plan for nodes run in this order (`None` when nothing is registered on any leaf
    /// they reach).
    pub(crate) fn new(keys_of_nodes: impl Iterator<Item = Vec<usize>>) -> Option<Plan> {
        if COUNT.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let r = lock(registry());
        // (observer id, leaf index) -> (observer, last position)
        let mut last: HashMap<(u64, usize), (Arc<dyn GradReady>, usize)> = HashMap::new();
        for (pos, keys) in keys_of_nodes.enumerate() {
            for k in keys {
                if let Some((obs, i, id)) = r.by_key.get(&k) {
                    if let Some(o) = obs.upgrade() {
                        last.insert((*id, *i), (o, pos));
                    }
                }
            }
        }
        drop(r);
        if last.is_empty() {
            return None;
        }
        let mut at: HashMap<usize, Notices> = HashMap::new();
        let mut observers: Vec<(u64, Arc<dyn GradReady>)> = Vec::new();
        let mut entries: Vec<_> = last.into_iter().collect();
        entries.sort_by_key(|((id, i), (_, pos))| (*pos, *id, *i));
        for ((id, i), (o, pos)) in entries {
            if !observers.iter().any(|(oid, _)| *oid == id) {
                observers.push((id, o.clone()));
            }
            at.entry(pos).or_default().push((o, i));
        }
        static BACKWARDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Some(Plan {
            id: BACKWARDS.fetch_add(1, Ordering::Relaxed),
            at,
            observers: observers.into_iter().map(|(_, o)| o).collect(),
        })
    }

    /// Notifies the leaves whose last sender ran at position `pos`.
    pub(crate) fn after(&self, pos: usize) -> Result<()> {
        for (o, i) in self.at.get(&pos).into_iter().flatten() {
            o.ready(*i, self.id)?;
        }
        Ok(())
    }

    /// The backward is over.
    pub(crate) fn done(&self) -> Result<()> {
        for o in &self.observers {
            o.done(self.id)?;
        }
        Ok(())
    }
}
