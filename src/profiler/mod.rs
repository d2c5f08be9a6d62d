//! Where a step's time and memory go: per op and per kernel host and device time, launches,
//! copies, the memory held at the peak by the op that allocated it, a key_averages-style
//! table and a Chrome trace (Perfetto, chrome://tracing), like `torch.profiler`.
//!
//! ```
//! use mantissa::{profiler, Device, DType, Tensor};
//! let w = Tensor::randn(&[64, 32], DType::F32, Device::Cpu)?.requires_grad(true)?;
//! let x = Tensor::randn(&[8, 64], DType::F32, Device::Cpu)?;
//! let prof = profiler::Profiler::start()?;
//! x.matmul(&w)?.relu()?.sum_all()?.backward()?;
//! prof.step();
//! let profile = prof.stop()?;
//! println!("{}", profile.table(profiler::SortBy::HostTime, 10));
//! assert_eq!(profile.op("relu").unwrap().count, 1);
//! # Ok::<(), mantissa::Error>(())
//! ```
//!
//! Ops are the autograd-visible ops (`matmul`, `relu`, `relu.backward`, `adam.step`), with
//! host time on every device. On a GPU each kernel launch, cuBLAS/cuDNN call and copy gets
//! CUDA events on its stream, read back only when the profile stops, so profiling adds no
//! host synchronisation inside a step. When no profile runs, an op pays one relaxed atomic
//! load.

mod report;
mod session;
mod table;
mod trace;

pub use report::{KernelStat, MemoryAtPeak, OpStat, Profile, StepStat, TimeStat, OUTSIDE_OPS};
pub(crate) use session::{DeviceTimer, Launch};
pub use session::{DeviceWork, Pass};
pub use table::SortBy;

use crate::{Device, Error, Result};
use session::{DeviceRecord, OpRecord, Session};
use std::any::Any;
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

static ENABLED: AtomicBool = AtomicBool::new(false);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);
static SESSION: Mutex<Option<Session>> = Mutex::new(None);

thread_local! {
    /// This thread's open op spans: the session they belong to and their record indices.
    static OPEN: RefCell<(u64, Vec<usize>)> = const { RefCell::new((0, Vec::new())) };
    static THREAD_ID: Cell<u64> = const { Cell::new(0) };
}

/// True while a profile runs (one relaxed load: the cost of profiling when it is off).
#[inline]
pub(crate) fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

fn session() -> MutexGuard<'static, Option<Session>> {
    // A panic while the lock was held leaves records that are still well-formed.
    SESSION.lock().unwrap_or_else(|p| p.into_inner())
}

/// A small per-thread number for the trace's host tracks.
fn thread_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    THREAD_ID.with(|t| {
        if t.get() == 0 {
            t.set(NEXT.fetch_add(1, Ordering::Relaxed));
        }
        t.get()
    })
}

/// The innermost open op span of this thread in session `id`.
fn current_op(id: u64) -> Option<usize> {
    OPEN.with(|o| {
        let o = o.borrow();
        (o.0 == id).then(|| o.1.last().copied()).flatten()
    })
}

/// The outermost open op span of this thread in session `id`: the op the user called.
fn outermost_op(id: u64) -> Option<usize> {
    OPEN.with(|o| {
        let o = o.borrow();
        (o.0 == id).then(|| o.1.first().copied()).flatten()
    })
}

/// A running profile. Dropping it without [`Profiler::stop`] discards what it recorded.
///
/// One profile runs at a time in a process; it records every thread's ops.
#[must_use = "a profile records until it is stopped or dropped"]
pub struct Profiler {
    id: u64,
    // A guard belongs to the thread that started it, as `no_grad`'s does.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Profiler {
    /// Starts recording. `Err` when a profile is already running.
    pub fn start() -> Result<Profiler> {
        let mut s = session();
        if let Some(running) = s.as_ref() {
            return Err(Error::invalid(
                "profiler::start",
                format!(
                    "a profile is already running (started {:.3} s ago); stop it first",
                    running.t0.elapsed().as_secs_f64()
                ),
            ));
        }
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        *s = Some(Session::new(id));
        ENABLED.store(true, Ordering::SeqCst);
        Ok(Profiler {
            id,
            _not_send: std::marker::PhantomData,
        })
    }

    /// Marks the end of a training step: the per-step summary counts from one mark to the
    /// next (the first step from the start).
    pub fn step(&self) {
        if let Some(s) = session().as_mut().filter(|s| s.id == self.id) {
            let now = s.now();
            s.step_ends.push(now);
        }
    }

    /// Stops recording, waits for the devices' recorded events and returns the profile.
    /// Work after the last [`Profiler::step`] mark is a last, partial step.
    pub fn stop(self) -> Result<Profile> {
        let s = self.take();
        let Some(mut s) = s else {
            return Err(Error::invalid("profiler::stop", "the profile was lost"));
        };
        // Records after the last mark make one more, partial step.
        let last = s.step_ends.len();
        if s.ops.iter().any(|o| o.step == last) || s.records.iter().any(|r| r.step == last) {
            let end = s.now();
            s.step_ends.push(end);
        }
        report::build(s)
    }

    fn take(&self) -> Option<Session> {
        let mut guard = session();
        if guard.as_ref().map(|s| s.id) != Some(self.id) {
            return None;
        }
        ENABLED.store(false, Ordering::SeqCst);
        guard.take()
    }
}

impl Drop for Profiler {
    fn drop(&mut self) {
        let _ = self.take();
    }
}

/// Runs `f` under a profile and returns its result with the profile (the closure form of
/// [`Profiler::start`] / [`Profiler::stop`]); `f` may mark steps on the profiler it gets.
///
/// ```
/// use mantissa::{profiler, Device, DType, Tensor};
/// let (y, profile) = profiler::profile(|p| {
///     let y = Tensor::ones(&[4], DType::F32, Device::Cpu)?.exp()?;
///     p.step();
///     Ok::<_, mantissa::Error>(y)
/// })?;
/// assert_eq!(profile.op("exp").unwrap().count, 1);
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn profile<R>(f: impl FnOnce(&Profiler) -> R) -> Result<(R, Profile)> {
    let p = Profiler::start()?;
    let r = f(&p);
    Ok((r, p.stop()?))
}

/// An open op span; it ends when dropped.
pub(crate) struct OpSpan {
    session: u64,
    index: usize,
}

/// Opens a span for op `name` on this thread (None when no profile runs).
#[inline]
pub(crate) fn op(name: &'static str) -> Option<OpSpan> {
    match enabled() {
        true => open(name, Pass::Forward),
        false => None,
    }
}

/// Opens a span for the backward of op `name`.
#[inline]
pub(crate) fn backward(name: &'static str) -> Option<OpSpan> {
    match enabled() {
        true => open(name, Pass::Backward),
        false => None,
    }
}

fn open(name: &'static str, pass: Pass) -> Option<OpSpan> {
    let thread = thread_id();
    let mut guard = session();
    let s = guard.as_mut()?;
    let id = s.id;
    let parent = current_op(id);
    let index = s.ops.len();
    let (start_ns, step) = (s.now(), s.step());
    s.ops.push(OpRecord {
        name,
        pass,
        thread,
        parent,
        start_ns,
        end_ns: None,
        step,
    });
    drop(guard);
    OPEN.with(|o| {
        let mut o = o.borrow_mut();
        if o.0 != id {
            *o = (id, Vec::new());
        }
        o.1.push(index);
    });
    Some(OpSpan { session: id, index })
}

impl Drop for OpSpan {
    fn drop(&mut self) {
        OPEN.with(|o| {
            let mut o = o.borrow_mut();
            if o.0 == self.session {
                // Spans close in any order (a guard may outlive an inner one).
                if let Some(k) = o.1.iter().rposition(|&i| i == self.index) {
                    o.1.remove(k);
                }
            }
        });
        if let Some(s) = session().as_mut().filter(|s| s.id == self.session) {
            let now = s.now();
            s.ops[self.index].end_ns = Some(now);
        }
    }
}

/// A device record being made: from just before a launch, library call or copy is queued to
/// just after (the device backends make them; a build without one has none).
#[cfg_attr(not(feature = "cuda-backend"), allow(dead_code))]
pub(crate) struct DeviceSpan {
    session: u64,
    launch: Launch,
    op: Option<usize>,
    thread: u64,
    start_ns: u64,
}

/// Opens a device record (None when no profile runs). The launch site calls `launch` only
/// when profiling, so that naming costs nothing otherwise.
#[cfg_attr(not(feature = "cuda-backend"), allow(dead_code))]
#[inline]
pub(crate) fn device_work(launch: impl FnOnce() -> Launch) -> Option<DeviceSpan> {
    if !enabled() {
        return None;
    }
    let thread = thread_id();
    let guard = session();
    let s = guard.as_ref()?;
    Some(DeviceSpan {
        session: s.id,
        op: current_op(s.id),
        start_ns: s.now(),
        thread,
        launch: launch(),
    })
}

#[cfg_attr(not(feature = "cuda-backend"), allow(dead_code))]
impl DeviceSpan {
    /// Ends the record: `timer` reads its device times when the profile stops. A span
    /// dropped without `finish` (its launch failed) records nothing.
    pub(crate) fn finish(self, timer: Option<Box<dyn DeviceTimer>>) {
        if let Some(s) = session().as_mut().filter(|s| s.id == self.session) {
            let (host_end_ns, step) = (s.now(), s.step());
            s.records.push(DeviceRecord {
                launch: self.launch,
                op: self.op,
                thread: self.thread,
                step,
                host_start_ns: self.start_ns,
                host_end_ns,
                timer,
            });
        }
    }
}

/// The base mark of `device` in the running profile: made by `make` (an event recorded on
/// the device's stream) the first time the profile records work there. Device times are
/// read relative to it and placed on the host timeline at the host time it was made.
#[cfg_attr(not(feature = "cuda-backend"), allow(dead_code))]
pub(crate) fn device_base(
    device: Device,
    make: impl FnOnce() -> Option<Arc<dyn Any + Send + Sync>>,
) -> Option<Arc<dyn Any + Send + Sync>> {
    if let Some((_, b)) = session().as_ref()?.bases.get(&device) {
        return Some(b.clone());
    }
    let made = make()?;
    let mut guard = session();
    let s = guard.as_mut()?;
    let now = s.now();
    Some(s.bases.entry(device).or_insert((now, made)).1.clone())
}

/// Who allocated a device block: the profile and the op, kept with the block until it is
/// freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Owner {
    session: u64,
    owner: u32,
}

/// A device allocator handed out a block of `size` bytes and now holds `allocated` and
/// `reserved`: the block's owner is this thread's outermost op, the one the user called
/// (`conv2d`, not the `add` of its bias inside; `linear.backward`, not its `matmul`), None
/// when no profile runs or outside any op.
pub(crate) fn memory_alloc(
    device: Device,
    size: usize,
    allocated: usize,
    reserved: usize,
) -> Option<Owner> {
    if !enabled() {
        return None;
    }
    let mut guard = session();
    let s = guard.as_mut()?;
    let owner = outermost_op(s.id).map(|i| {
        let key = (s.ops[i].name, s.ops[i].pass);
        s.owner(key)
    });
    s.memory_change(device, owner, size, true, allocated, reserved);
    owner.map(|owner| Owner {
        session: s.id,
        owner,
    })
}

/// A device allocator took back a block of `size` bytes that `owner` allocated.
pub(crate) fn memory_free(
    device: Device,
    size: usize,
    owner: Option<Owner>,
    allocated: usize,
    reserved: usize,
) {
    if !enabled() {
        return;
    }
    if let Some(s) = session().as_mut() {
        let owner = owner.filter(|o| o.session == s.id).map(|o| o.owner);
        s.memory_change(device, owner, size, false, allocated, reserved);
    }
}
