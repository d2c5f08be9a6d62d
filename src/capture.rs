//! What the ops tell an open CUDA graph capture (this thread's, while
//! [`crate::graph::StepGraph`] records a step): the values a replay must read from device
//! memory instead of the kernel arguments frozen at capture, and the work that cannot be
//! captured. A leaf: the ops, the generators and the CUDA backend import it, it imports none
//! of them (a generator's state is reached through [`GenState`]).
//!
//! A replay starts with a *prologue*: one upload, on the compute stream before the graph's
//! launch, of a small device buffer the captured kernels read. It holds, per generator the
//! step draws from, `[seed, offset]` as the generator stands before the replay (the kernels
//! add the offset their draw had within the captured step), and per optimizer update its
//! learning rate as the update's kernel takes it. So every replay draws new numbers, the same
//! an eager step would, and a learning-rate schedule needs no re-capture. Values that stay
//! frozen in the graph and may change between steps (SGLD's noise scale) are *watched*: a
//! replay after one changed captures the step again.

use crate::{Device, Error, Result};
use std::cell::RefCell;

/// Where a generator's state lives, so that a replay can read and advance it: this thread's
/// default generator, or a state tensor a module or optimizer keeps (shared by clones).
pub(crate) trait GenState {
    /// `(seed, offset)` as it stands.
    fn state(&self) -> Result<(u64, u64)>;
    /// Puts the generator at `(seed, offset)`.
    fn set_state(&self, state: (u64, u64)) -> Result<()>;
    /// Equal for two handles on the same generator.
    fn key(&self) -> usize;
}

/// Writes a replay-time value into its bytes of the prologue.
pub(crate) type Fill = Box<dyn Fn(&mut [u8]) -> Result<()>>;

/// One generator the step draws from: its state before the step's first draw, and where the
/// prologue puts `[seed, offset]`.
struct Rng {
    source: Box<dyn GenState>,
    /// `(seed, offset)` at the step's first draw.
    before: (u64, u64),
    at: usize,
}

/// The open capture's registry.
pub(crate) struct Scope {
    device: Device,
    /// The prologue buffer on the device, its size and the bytes handed out.
    base: u64,
    capacity: usize,
    used: usize,
    rngs: Vec<Rng>,
    /// Each draw: seed, first block, generator index, and its offset within the step.
    draws: Vec<(u64, u64, usize, u64)>,
    fills: Vec<(usize, Fill)>,
    watched: Vec<(String, Box<dyn Fn() -> bool>)>,
    refused: Option<Error>,
}

thread_local! {
    static OPEN: RefCell<Option<Scope>> = const { RefCell::new(None) };
    static HYPER: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// The device address of the learning rate the optimizer update being queued reads in a
/// captured step (0: none, the kernel takes its arguments' value).
pub(crate) fn hyper() -> u64 {
    HYPER.with(|h| h.get())
}

/// Sets [`hyper`] for the optimizer update queued while it lives.
pub(crate) struct HyperGuard(u64);

impl HyperGuard {
    pub(crate) fn set(at: Option<u64>) -> HyperGuard {
        HyperGuard(HYPER.with(|h| h.replace(at.unwrap_or(0))))
    }
}

impl Drop for HyperGuard {
    fn drop(&mut self) {
        HYPER.with(|h| h.set(self.0));
    }
}

/// Whether this thread is capturing a step.
pub(crate) fn active() -> bool {
    OPEN.with(|o| o.borrow().is_some())
}

pub(crate) fn open(device: Device, base: u64, capacity: usize) {
    OPEN.with(|o| {
        *o.borrow_mut() = Some(Scope {
            device,
            base,
            capacity,
            used: 0,
            rngs: Vec::new(),
            draws: Vec::new(),
            fills: Vec::new(),
            watched: Vec::new(),
            refused: None,
        })
    });
}

/// Ends this thread's capture scope: the generators it drew from are put back where they
/// stood before the step (the capture ran nothing; each replay draws and advances them), and
/// the prologue is returned, or the first refusal.
pub(crate) fn close() -> Result<Prologue> {
    let scope = OPEN.with(|o| o.borrow_mut().take());
    let Some(s) = scope else {
        return Err(Error::invalid(
            "CapturedStep",
            "no capture is open on this thread",
        ));
    };
    let mut rngs = Vec::with_capacity(s.rngs.len());
    for r in s.rngs {
        let (_, now) = r.source.state()?;
        let per_step = now.wrapping_sub(r.before.1);
        r.source.set_state(r.before)?;
        rngs.push((r.source, r.at, per_step));
    }
    if let Some(e) = s.refused {
        return Err(e);
    }
    Ok(Prologue {
        bytes: s.used,
        rngs,
        fills: s.fills,
        watched: s.watched,
    })
}

/// Records that `op` cannot be captured (`why`); the capture then fails with this error.
/// Returns the error for the caller to return as well.
pub(crate) fn refuse(op: impl Into<String>, why: impl Into<String>) -> Error {
    let (op, why) = (op.into(), why.into());
    // MANTISSA_DEBUG_CAPTURE=1: where the refused work was asked for.
    if std::env::var_os("MANTISSA_DEBUG_CAPTURE").is_some_and(|v| v == "1") {
        eprintln!(
            "not capturable: {op}\n{}",
            std::backtrace::Backtrace::force_capture()
        );
    }
    OPEN.with(|o| {
        let mut o = o.borrow_mut();
        let device = o.as_ref().map_or(Device::Cpu, |s| s.device);
        let e = || Error::NotCapturable {
            op: op.clone(),
            device,
            why: why.clone(),
        };
        if let Some(s) = o.as_mut() {
            s.refused.get_or_insert_with(e);
        }
        e()
    })
}

/// `bytes` (a multiple of 8 at most) of the prologue, written at each replay by `fill`: the
/// device address the captured kernel reads.
pub(crate) fn slot(bytes: usize, fill: Fill) -> Result<u64> {
    OPEN.with(|o| {
        let mut o = o.borrow_mut();
        let s = o
            .as_mut()
            .ok_or_else(|| Error::invalid("CapturedStep", "a replay value outside a capture"))?;
        let at = s.used.next_multiple_of(8);
        if at + bytes > s.capacity {
            let why = format!(
                "the step needs more than {} bytes of replay values (generators and \
                 learning rates)",
                s.capacity
            );
            s.refused.get_or_insert_with(|| Error::NotCapturable {
                op: "a replay value".into(),
                device: s.device,
                why: why.clone(),
            });
            return Err(Error::invalid("CapturedStep", why));
        }
        s.used = at + bytes;
        s.fills.push((at, fill));
        Ok(s.base + at as u64)
    })
}

/// Watches a value frozen into the graph: `same` reports whether it still holds; a replay
/// after it stopped holding captures the step again.
pub(crate) fn watch(what: impl Into<String>, same: Box<dyn Fn() -> bool>) {
    OPEN.with(|o| {
        if let Some(s) = o.borrow_mut().as_mut() {
            s.watched.push((what.into(), same));
        }
    });
}

/// Notes a draw from the generator `source` at `(seed, start)` made during the capture
/// (`source` is made only then).
pub(crate) fn draw(source: impl FnOnce() -> Box<dyn GenState>, seed: u64, start: u64) {
    OPEN.with(|o| {
        let mut o = o.borrow_mut();
        let Some(s) = o.as_mut() else { return };
        let source = source();
        let k = match s.rngs.iter().position(|r| r.source.key() == source.key()) {
            Some(k) => k,
            None => {
                let at = s.used.next_multiple_of(8);
                if at + 16 > s.capacity {
                    s.refused.get_or_insert_with(|| Error::NotCapturable {
                        op: "a random draw".into(),
                        device: s.device,
                        why: "too many generators in one step".into(),
                    });
                    return;
                }
                s.used = at + 16;
                s.rngs.push(Rng {
                    source,
                    before: (seed, start),
                    at,
                });
                s.rngs.len() - 1
            }
        };
        let intra = start.wrapping_sub(s.rngs[k].before.1);
        s.draws.push((seed, start, k, intra));
    });
}

/// For a kernel about to draw from `(seed, start)` under a capture: the device address of
/// its generator's `[seed, offset]` in the prologue and the offset of the draw within the
/// step. `None` outside a capture; a draw the capture was not told of (a generator the
/// replay cannot advance) is refused.
pub(crate) fn rng_arg(seed: u64, start: u64) -> Result<Option<(u64, u64)>> {
    OPEN.with(|o| {
        let o = o.borrow();
        let Some(s) = o.as_ref() else {
            return Ok(None);
        };
        match s.draws.iter().rev().find(|d| d.0 == seed && d.1 == start) {
            Some(&(_, _, k, intra)) => Ok(Some((s.base + s.rngs[k].at as u64, intra))),
            None => Err(()),
        }
    })
    .map_err(|()| {
        refuse(
            "a random draw",
            "from a Generator value (rand_with, randn_with, dropout_with): a replay cannot \
             advance it; draw from the default generator or use nn::Dropout, whose states \
             the replay advances",
        )
    })
}

/// What a replay does before launching the graph.
pub(crate) struct Prologue {
    pub(crate) bytes: usize,
    rngs: Vec<(Box<dyn GenState>, usize, u64)>,
    fills: Vec<(usize, Fill)>,
    watched: Vec<(String, Box<dyn Fn() -> bool>)>,
}

impl Prologue {
    /// The first watched value that changed since the capture, if any.
    pub(crate) fn stale(&self) -> Option<&str> {
        self.watched
            .iter()
            .find(|(_, same)| !same())
            .map(|(w, _)| w.as_str())
    }

    /// The bytes to upload before a replay: each generator's state (then advanced past the
    /// step's draws, as an eager step would) and each replay value.
    pub(crate) fn fill(&self) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; self.bytes];
        for (source, at, per_step) in &self.rngs {
            let (seed, offset) = source.state()?;
            buf[*at..at + 8].copy_from_slice(&seed.to_le_bytes());
            buf[at + 8..at + 16].copy_from_slice(&offset.to_le_bytes());
            source.set_state((seed, offset.wrapping_add(*per_step)))?;
        }
        for (at, fill) in &self.fills {
            fill(&mut buf[*at..])?;
        }
        Ok(buf)
    }
}
