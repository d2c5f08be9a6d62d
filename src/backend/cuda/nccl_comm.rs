//! One rank's NCCL communicator on a stream of its own, with the deadlines PyTorch's watchdog
//! keeps.
//!
//! On one machine NCCL never learns that a peer died: a collective whose peer is gone, or
//! never calls it, waits in its kernel forever, and a blocking `ncclCommInitRank` waits
//! forever for a rank that never joins. So the communicator is made non-blocking
//! (`ncclCommInitRankConfig`, `blocking = 0`) and polled until it is ready under the group's
//! timeout; every collective records an event after itself on the communication stream, and
//! a watchdog thread polls those events: one still pending past the timeout aborts this
//! rank's communicator (its waiting kernels end, their results unwritten) and the rank's next
//! synchronisation, collective or gradient average returns an error naming the collective.
//! The watchdog also aborts on the asynchronous errors NCCL does report (a network peer).

use super::nccl::IN_PROGRESS;
use super::nccl::{api, describe, nccl_type, Api, Collective, CommPtr, Config, UniqueId};
use super::runtime::{CudaRuntime, Health};
use crate::sync::lock;
use crate::{DType, Error, Result};
use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};
use std::collections::VecDeque;
use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

/// A collective queued and not yet seen complete: the event recorded after it.
struct Watched {
    event: CudaEvent,
    op: &'static str,
    seq: u64,
    queued: Instant,
}

/// What the communicator shares with its watchdog. `comm` is null once aborted or destroyed;
/// a call holds the read lock while it uses the communicator, abort and destroy the write
/// lock.
struct Shared {
    comm: RwLock<usize>,
    /// The call that broke the communicator, and why.
    failed: Mutex<Option<(&'static str, String)>>,
    stop: AtomicBool,
    watched: Mutex<VecDeque<Watched>>,
    rank: usize,
    world_size: usize,
    timeout: Duration,
}

impl Shared {
    /// Records why the communicator broke (the first reason stays) and aborts it.
    fn fail(&self, op: &'static str, msg: String) {
        lock(&self.failed).get_or_insert((op, msg));
        self.abort();
    }

    /// Aborts the communicator once (NCCL frees it: later calls find it null). Local, as
    /// NCCL's abort is: the peers are not told.
    fn abort(&self) {
        let mut comm = self.comm.write().unwrap_or_else(|e| e.into_inner());
        if *comm != 0 {
            if let Ok(a) = api() {
                // SAFETY: the communicator is live (non-null under the write lock) and no call
                // uses it meanwhile; NCCL frees it.
                unsafe { (a.comm_abort)(*comm as CommPtr) };
            }
            *comm = 0;
        }
    }

    /// The ranks this one waits for, for messages.
    fn peers(&self) -> String {
        let others: Vec<String> = (0..self.world_size)
            .filter(|&r| r != self.rank)
            .map(|r| r.to_string())
            .collect();
        match others.len() {
            0 => "none".into(),
            1 => format!("rank {}", others[0]),
            _ => format!("ranks {}", others.join(", ")),
        }
    }
}

impl Health for Shared {
    fn failure(&self) -> Option<Error> {
        lock(&self.failed)
            .as_ref()
            .map(|(op, msg)| Error::Distributed {
                op,
                rank: self.rank,
                world_size: self.world_size,
                msg: msg.clone(),
            })
    }
}

/// One rank's communicator on `device`, with its stream.
pub(crate) struct NcclComm {
    shared: Arc<Shared>,
    rt: Arc<CudaRuntime>,
    stream: Arc<CudaStream>,
    /// Collectives called so far (their number in the watchdog's messages).
    calls: AtomicU64,
    watchdog: Option<std::thread::JoinHandle<()>>,
}

/// Polls a non-blocking communicator until its last call is done (`ncclCommGetAsyncError`
/// leaves `ncclInProgress`); an error past `deadline` or when NCCL reports one.
fn settle(a: &Api, comm: CommPtr, deadline: Instant) -> std::result::Result<(), String> {
    let mut pause = Duration::from_micros(50);
    loop {
        let mut state: c_int = 0;
        // SAFETY: the communicator is live (its caller holds it); one int written.
        let r = unsafe { (a.comm_get_async_error)(comm, &mut state) };
        match if r != 0 { r } else { state } {
            0 => return Ok(()),
            IN_PROGRESS if Instant::now() < deadline => {}
            IN_PROGRESS => return Err("still in progress at the deadline".into()),
            code => return Err(describe(code)),
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(10));
    }
}

impl NcclComm {
    /// Joins the communicator of `world_size` ranks with id `id` as `rank` (collective:
    /// returns once every rank has joined, or errors past `timeout`, which every collective
    /// must also meet).
    pub(crate) fn new(
        rt: Arc<CudaRuntime>,
        rank: usize,
        world_size: usize,
        id: &[u8],
        timeout: Duration,
    ) -> Result<NcclComm> {
        let a = api()?;
        let op = match a.comm_init_rank_config {
            Some(_) => "ncclCommInitRankConfig",
            None => "ncclCommInitRank",
        };
        let err = |msg: String| Error::Distributed {
            op,
            rank,
            world_size,
            msg,
        };
        let id: [u8; 128] = id
            .try_into()
            .map_err(|_| err(format!("an id of {} bytes (NCCL's has 128)", id.len())))?;
        let (Ok(n), Ok(r)) = (c_int::try_from(world_size), c_int::try_from(rank)) else {
            return Err(err("more ranks than NCCL counts".into()));
        };
        rt.refuse_in_capture("creating a communicator", "it synchronises the device")?;
        rt.context()
            .bind_to_thread()
            .map_err(|e| err(format!("binding {}: {e}", rt.device())))?;
        let stream = rt
            .context()
            .new_stream()
            .map_err(|e| err(format!("creating the communication stream: {e}")))?;
        let id = UniqueId(id.map(|b| b as c_char));
        let deadline = Instant::now() + timeout;
        let mut comm: CommPtr = std::ptr::null_mut();
        let code = match a.comm_init_rank_config {
            Some(init) => {
                let mut cfg = Config::non_blocking();
                // SAFETY: `comm` receives the handle; the id is the 128 bytes rank 0 made;
                // the config outlives the call; the device's context is current on this
                // thread (above), as NCCL requires.
                unsafe { init(&mut comm, n, id, r, &mut cfg) }
            }
            None => {
                log::warn!(
                    "NCCL {} has no ncclCommInitRankConfig (2.14 and later): a blocking \
                     communicator, whose creation and collectives wait for their peers \
                     without a deadline",
                    super::nccl::version().unwrap_or_default()
                );
                // SAFETY: as above, without a config.
                unsafe { (a.comm_init_rank)(&mut comm, n, id, r) }
            }
        };
        let raw_abort = |comm: CommPtr| {
            if !comm.is_null() {
                // SAFETY: the handle NCCL gave, used by no one else yet; NCCL frees it.
                unsafe { (a.comm_abort)(comm) };
            }
        };
        if (code != 0 && code != IN_PROGRESS) || comm.is_null() {
            raw_abort(comm);
            return Err(err(describe(code)));
        }
        if let Err(why) = settle(a, comm, deadline) {
            raw_abort(comm);
            return Err(err(format!(
                "not every rank joined within {timeout:?} ({why}): a rank failed or never \
                 started (MANTISSA_DIST_TIMEOUT_S, or the group's timeout, sets the limit)"
            )));
        }
        let shared = Arc::new(Shared {
            comm: RwLock::new(comm as usize),
            failed: Mutex::new(None),
            stop: AtomicBool::new(false),
            watched: Mutex::new(VecDeque::new()),
            rank,
            world_size,
            timeout,
        });
        let (watched, ctx) = (shared.clone(), rt.context().clone());
        let watchdog = match std::thread::Builder::new()
            .name(format!("nccl-watchdog-{rank}"))
            .spawn(move || watch(&watched, &ctx))
        {
            Ok(w) => w,
            Err(e) => {
                shared.abort();
                return Err(err(format!("starting the watchdog: {e}")));
            }
        };
        let health: Weak<dyn Health> = Arc::downgrade(&shared) as Weak<dyn Health>;
        rt.watch_health(health);
        Ok(NcclComm {
            shared,
            rt,
            stream,
            calls: AtomicU64::new(0),
            watchdog: Some(watchdog),
        })
    }

    fn err(&self, op: &'static str, msg: String) -> Error {
        Error::Distributed {
            op,
            rank: self.shared.rank,
            world_size: self.shared.world_size,
            msg,
        }
    }

    /// The reason this communicator broke, if it did.
    pub(crate) fn failure(&self) -> Option<String> {
        lock(&self.shared.failed)
            .as_ref()
            .map(|(op, msg)| format!("{op}: {msg}"))
    }

    /// Breaks the communicator (its queued work is abandoned): for a rank that gives up.
    /// Local, as NCCL's abort is: the peers' watchdogs see their collectives miss the
    /// deadline.
    pub(crate) fn abort(&self, why: &str) {
        self.shared.fail("abort", why.to_string());
    }

    /// `Err` when a collective `op` cannot be queued now: the communicator broke, or a CUDA
    /// graph capture is open on this thread (collectives are not captured; refused before
    /// the communication stream joins the capture).
    pub(crate) fn check_usable(&self, op: &'static str) -> Result<()> {
        if let Some(why) = self.failure() {
            return Err(self.err(op, format!("the communicator broke earlier: {why}")));
        }
        self.rt
            .refuse_in_capture(op, "collectives are not captured into CUDA graphs")
    }

    /// Makes the compute stream wait for the collectives queued so far (an error when the
    /// communicator broke: their results are missing).
    pub(crate) fn before_compute(&self) -> Result<()> {
        if let Some(why) = self.failure() {
            return Err(self.err("waiting for collectives", why));
        }
        self.rt
            .stream()
            .join(&self.stream)
            .map_err(|e| self.err("ordering compute after a collective", e.to_string()))
    }

    /// Queues `what` on the communication stream over `count` elements of `dtype`, after the
    /// work queued so far on the compute stream. The caller makes the compute stream wait
    /// for it ([`NcclComm::before_compute`]) and keeps both buffers alive until then.
    pub(crate) fn launch(
        &self,
        what: Collective,
        send: sys::CUdeviceptr,
        recv: sys::CUdeviceptr,
        count: usize,
        dtype: DType,
    ) -> Result<()> {
        let op = what.name();
        self.check_usable(op)?;
        self.stream
            .join(self.rt.stream())
            .map_err(|e| self.err("ordering a collective after compute", e.to_string()))?;
        let ty = nccl_type(dtype);
        let a = api()?;
        let comm = self.shared.comm.read().unwrap_or_else(|e| e.into_inner());
        if *comm == 0 {
            return Err(self.err(op, "the communicator was aborted".into()));
        }
        let c = *comm as CommPtr;
        let s = self.stream.cu_stream();
        let (sp, rp) = (send as *const c_void, recv as *mut c_void);
        // SAFETY: `send` and `recv` address device blocks of this device holding `count`
        // elements of `dtype` (times the world size where NCCL's contract says so), kept
        // alive by the caller until the compute stream waits for this stream; the
        // communicator is live (checked under the read lock held here).
        let code = unsafe {
            match what {
                Collective::AllReduce(o) => (a.all_reduce)(sp, rp, count, ty, o, c, s),
                Collective::Broadcast { root } => {
                    (a.broadcast)(sp, rp, count, ty, root as c_int, c, s)
                }
                Collective::AllGather => (a.all_gather)(sp, rp, count, ty, c, s),
                Collective::ReduceScatter(o) => (a.reduce_scatter)(sp, rp, count, ty, o, c, s),
            }
        };
        // A non-blocking communicator may still be queuing the call: no other call until
        // it is done.
        let outcome = match code {
            0 => Ok(()),
            IN_PROGRESS => settle(a, c, Instant::now() + self.shared.timeout),
            code => Err(describe(code)),
        };
        drop(comm);
        if let Err(msg) = outcome {
            self.shared.fail(op, msg.clone());
            return Err(self.err(op, msg));
        }
        let seq = self.calls.fetch_add(1, Ordering::Relaxed);
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| self.err(op, format!("recording its completion event: {e}")))?;
        lock(&self.shared.watched).push_back(Watched {
            event,
            op,
            seq,
            queued: Instant::now(),
        });
        Ok(())
    }

    /// Waits on the host for the collectives queued so far.
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| self.err("waiting for collectives", e.to_string()))?;
        match self.failure() {
            Some(why) => Err(self.err("waiting for collectives", why)),
            None => Ok(()),
        }
    }

    /// Waits for the collectives queued so far, polling under the deadline (a peer that
    /// left holds them forever): false past it.
    fn quiesce(&self) -> bool {
        let Ok(done) = self.stream.record_event(None) else {
            return false;
        };
        let deadline = Instant::now() + self.shared.timeout;
        let mut pause = Duration::from_micros(50);
        loop {
            match done.try_is_complete() {
                Ok(true) => return true,
                Ok(false) if Instant::now() < deadline => {}
                _ => return false,
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(10));
        }
    }
}

/// The watchdog: polls the communicator's asynchronous error (what NCCL does report: a
/// network peer's failure) and the events after its collectives, and aborts the
/// communicator when NCCL reports an error or a collective misses the deadline, so that work
/// waiting on it ends instead of hanging.
fn watch(s: &Shared, ctx: &Arc<CudaContext>) {
    let tick = (s.timeout / 20).clamp(Duration::from_millis(1), Duration::from_millis(50));
    while !s.stop.load(Ordering::Acquire) {
        std::thread::sleep(tick);
        let Ok(a) = api() else { return };
        let code = {
            let comm = s.comm.read().unwrap_or_else(|e| e.into_inner());
            if *comm == 0 {
                return;
            }
            let mut async_err: c_int = 0;
            // SAFETY: the communicator is live under the read lock; NCCL allows this query
            // from any thread while others use the communicator.
            let r = unsafe { (a.comm_get_async_error)(*comm as CommPtr, &mut async_err) };
            if r != 0 {
                r
            } else {
                async_err
            }
        };
        if code != 0 && code != IN_PROGRESS {
            s.fail(
                "ncclCommGetAsyncError",
                format!("asynchronous {}", describe(code)),
            );
            return;
        }
        if ctx.bind_to_thread().is_err() {
            continue;
        }
        let mut watched = lock(&s.watched);
        while let Some(w) = watched.front() {
            match w.event.try_is_complete() {
                Ok(true) => {
                    watched.pop_front();
                }
                Ok(false) if w.queued.elapsed() <= s.timeout => break,
                outcome => {
                    let (op, seq, after) = (w.op, w.seq, w.queued.elapsed());
                    let why = match outcome {
                        Err(e) => format!("its completion event failed: {e}"),
                        _ => format!(
                            "it did not complete within {:?} (waited {after:.1?}): {} failed, \
                             left, or never called it",
                            s.timeout,
                            s.peers()
                        ),
                    };
                    drop(watched);
                    s.fail(
                        op,
                        format!(
                            "collective #{seq} of this communicator: {why}; the communicator \
                             was aborted (MANTISSA_DIST_TIMEOUT_S, or the group's timeout, \
                             sets the limit)"
                        ),
                    );
                    return;
                }
            }
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
        let healthy = self.failure().is_none() && !std::thread::panicking();
        if healthy && self.quiesce() {
            let mut comm = self.shared.comm.write().unwrap_or_else(|e| e.into_inner());
            if *comm != 0 {
                if let Ok(a) = api() {
                    let c = *comm as CommPtr;
                    // Finalize first where NCCL has it: a non-blocking communicator's destroy
                    // then frees without waiting.
                    let finalized = match a.comm_finalize {
                        // SAFETY: live (write lock held), its work done (quiesced above).
                        Some(f) => match unsafe { f(c) } {
                            0 => true,
                            IN_PROGRESS => {
                                settle(a, c, Instant::now() + self.shared.timeout).is_ok()
                            }
                            _ => false,
                        },
                        None => true,
                    };
                    if finalized {
                        // SAFETY: live, unused (write lock), finalized: NCCL frees it.
                        unsafe { (a.comm_destroy)(c) };
                        *comm = 0;
                    }
                }
            }
        }
        self.shared.abort();
    }
}
