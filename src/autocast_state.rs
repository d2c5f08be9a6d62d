//! The per-thread autocast regions of [`crate::amp`], kept apart from `amp` so that a CPU
//! kernel can put them away while it waits in a parallel section (`crate::parallel::Isolated`)
//! without importing `amp`.

use crate::scope::{ScopeEntry, ScopeStack, Stashed};
use crate::DType;
use std::cell::{Cell, RefCell};

/// One autocast region's setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct State {
    pub enabled: bool,
    pub dtype: DType,
}

/// Outside every region: autocast off.
const DEFAULT: State = State {
    enabled: false,
    dtype: DType::F16,
};

thread_local! {
    /// The state in force: a cache of [`REGIONS`]'s top, read at every op's dispatch.
    static STATE: Cell<State> = const { Cell::new(DEFAULT) };
    static REGIONS: RefCell<ScopeStack<State>> = const { RefCell::new(ScopeStack::new()) };
}

/// The state in force on this thread.
pub(crate) fn current() -> State {
    STATE.with(|s| s.get())
}

/// Whether no region is open on this thread.
pub(crate) fn outside_regions() -> bool {
    REGIONS.with(|r| r.borrow().top().is_none())
}

fn set_state(top: Option<State>) {
    let _ = STATE.try_with(|s| s.set(top.unwrap_or(DEFAULT)));
}

/// Opens a region with `state` on this thread.
pub(crate) fn enter(state: State) -> ScopeEntry<State> {
    ScopeEntry::push(&REGIONS, state, set_state)
}

/// Closes the region of `entry`.
pub(crate) fn leave(entry: &ScopeEntry<State>) {
    entry.pop(set_state);
}

/// Takes this thread's regions off it (autocast off, as on a fresh thread). The weight-cast
/// cache stays: its entries are keyed by tensor and version, right for any region.
pub(crate) fn stash() -> Stashed<State> {
    crate::scope::stash(&REGIONS, set_state)
}

/// Puts back what [`stash`] took.
pub(crate) fn unstash(saved: Stashed<State>) {
    crate::scope::unstash(&REGIONS, saved, set_state)
}
