//! NCCL, loaded at run time: the entry points the collectives use, and a communicator of one
//! rank on its own stream, watched for asynchronous errors.
//!
//! cudarc has NCCL bindings, but its loader tries `libnccl.so` and CUDA-versioned names,
//! never `libnccl.so.2`, NCCL's soname and the only file pip's `nvidia-nccl-cu12/13` wheels
//! ship; its `Comm` is not `Send` and aborts (panicking on error) when dropped. So the few
//! entry points used are looked up here in the library `libs` found (the same search as every
//! CUDA library), with NCCL's C types: results as plain integers, so an unknown code is an
//! error, never an invalid enum value.

use super::libs::{self, Lib};
use super::runtime::CudaRuntime;
use crate::sync::lock;
use crate::{DType, Error, Result};
use cudarc::driver::{sys, CudaStream};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Duration;

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId([c_char; 128]);

type CommPtr = *mut c_void;
type Stream = sys::CUstream;

/// `ncclAllReduce`, `ncclReduceScatter` (send, receive, count, type, op, ...) and
/// `ncclBroadcast` (the same with a root rank for the op).
type Reduction =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, CommPtr, Stream) -> c_int;

/// The entry points, as NCCL 2.x declares them.
struct Api {
    get_version: unsafe extern "C" fn(*mut c_int) -> c_int,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> c_int,
    comm_init_rank: unsafe extern "C" fn(*mut CommPtr, c_int, UniqueId, c_int) -> c_int,
    comm_abort: unsafe extern "C" fn(CommPtr) -> c_int,
    comm_destroy: unsafe extern "C" fn(CommPtr) -> c_int,
    comm_get_async_error: unsafe extern "C" fn(CommPtr, *mut c_int) -> c_int,
    get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    all_reduce: Reduction,
    broadcast: Reduction,
    all_gather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, CommPtr, Stream) -> c_int,
    reduce_scatter: Reduction,
}

const IN_PROGRESS: c_int = 7;

fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    let api = API.get_or_init(|| {
        libs::with_library(Lib::Nccl, |l| {
            macro_rules! sym {
                ($name:literal) => {
                    // SAFETY: the symbol is NCCL's function of that name, whose C signature
                    // is the field's type (nccl.h, 2.x); the library stays open for the life
                    // of the process (`libs`).
                    *unsafe { l.get($name) }.map_err(|e| {
                        format!(
                            "{}: {e}",
                            String::from_utf8_lossy(&$name[..$name.len() - 1])
                        )
                    })?
                };
            }
            Ok(Api {
                get_version: sym!(b"ncclGetVersion\0"),
                get_unique_id: sym!(b"ncclGetUniqueId\0"),
                comm_init_rank: sym!(b"ncclCommInitRank\0"),
                comm_abort: sym!(b"ncclCommAbort\0"),
                comm_destroy: sym!(b"ncclCommDestroy\0"),
                comm_get_async_error: sym!(b"ncclCommGetAsyncError\0"),
                get_error_string: sym!(b"ncclGetErrorString\0"),
                all_reduce: sym!(b"ncclAllReduce\0"),
                broadcast: sym!(b"ncclBroadcast\0"),
                all_gather: sym!(b"ncclAllGather\0"),
                reduce_scatter: sym!(b"ncclReduceScatter\0"),
            })
        })
        .map_err(|e| e.to_string())
        .and_then(|r| r)
    });
    api.as_ref().map_err(|msg| Error::CudaLibrary {
        lib: "libnccl",
        msg: msg.clone(),
    })
}

/// NCCL's text for a result code.
fn describe(code: c_int) -> String {
    let text = api().ok().map(|a| {
        // SAFETY: ncclGetErrorString returns a static string for any code.
        let p = unsafe { (a.get_error_string)(code) };
        match p.is_null() {
            true => String::new(),
            // SAFETY: non-null, NUL-terminated and static (above).
            false => unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned(),
        }
    });
    format!("NCCL error {code} ({})", text.unwrap_or_default())
}

/// NCCL's version as `major.minor.patch`.
pub fn version() -> Result<String> {
    let a = api()?;
    let mut v: c_int = 0;
    // SAFETY: one int written through a valid pointer.
    let r = unsafe { (a.get_version)(&mut v) };
    if r != 0 {
        return Err(Error::CudaLibrary {
            lib: "libnccl",
            msg: describe(r),
        });
    }
    Ok(format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100))
}

/// A new unique id (rank 0 makes it; the rendezvous hands it to the others).
pub fn unique_id() -> Result<Vec<u8>> {
    let a = api()?;
    let mut id = UniqueId([0; 128]);
    // SAFETY: writes the 128 bytes of `id`.
    let r = unsafe { (a.get_unique_id)(&mut id) };
    if r != 0 {
        return Err(Error::CudaLibrary {
            lib: "libnccl",
            msg: format!("ncclGetUniqueId: {}", describe(r)),
        });
    }
    Ok(id.0.iter().map(|&c| c as u8).collect())
}

/// What a collective does.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Collective {
    /// `ncclAllReduce` with an op: 0 sum, 2 max, 3 min, 4 average.
    AllReduce(c_int),
    Broadcast {
        root: usize,
    },
    /// `count` is each rank's part.
    AllGather,
    /// `count` is each rank's part of the result.
    ReduceScatter(c_int),
}

/// The communicator, shared with its watchdog. `comm` is null once aborted or destroyed; a
/// call holds the read lock while it uses the communicator, abort and destroy the write lock.
struct Shared {
    comm: RwLock<usize>,
    failed: Mutex<Option<String>>,
    stop: AtomicBool,
}

/// One rank's communicator on `device`, with its stream.
pub(crate) struct NcclComm {
    shared: Arc<Shared>,
    rt: Arc<CudaRuntime>,
    stream: Arc<CudaStream>,
    rank: usize,
    world_size: usize,
    watchdog: Option<std::thread::JoinHandle<()>>,
}

impl NcclComm {
    /// Joins the communicator of `world_size` ranks with id `id` as `rank` (collective:
    /// returns once every rank has joined).
    pub(crate) fn new(
        rt: Arc<CudaRuntime>,
        rank: usize,
        world_size: usize,
        id: &[u8],
    ) -> Result<NcclComm> {
        let a = api()?;
        let err = |msg: String| Error::Distributed {
            op: "ncclCommInitRank",
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
        let mut comm: CommPtr = std::ptr::null_mut();
        // SAFETY: `comm` receives the handle; the id is the 128 bytes rank 0 made; the
        // device's context is current on this thread (above), as NCCL requires.
        let code =
            unsafe { (a.comm_init_rank)(&mut comm, n, UniqueId(id.map(|b| b as c_char)), r) };
        if code != 0 || comm.is_null() {
            return Err(err(describe(code)));
        }
        let shared = Arc::new(Shared {
            comm: RwLock::new(comm as usize),
            failed: Mutex::new(None),
            stop: AtomicBool::new(false),
        });
        let watched = shared.clone();
        let watchdog = match std::thread::Builder::new()
            .name(format!("nccl-watchdog-{rank}"))
            .spawn(move || watch(&watched))
        {
            Ok(w) => w,
            Err(e) => {
                abort(&shared);
                return Err(err(format!("starting the watchdog: {e}")));
            }
        };
        Ok(NcclComm {
            shared,
            rt,
            stream,
            rank,
            world_size,
            watchdog: Some(watchdog),
        })
    }

    fn err(&self, op: &'static str, msg: String) -> Error {
        Error::Distributed {
            op,
            rank: self.rank,
            world_size: self.world_size,
            msg,
        }
    }

    /// The reason this communicator broke, if it did.
    pub(crate) fn failure(&self) -> Option<String> {
        lock(&self.shared.failed).clone()
    }

    /// Breaks the communicator (its queued work is abandoned): for a rank that gives up, so
    /// that its peers error instead of waiting.
    pub(crate) fn abort(&self, why: &str) {
        lock(&self.shared.failed).get_or_insert_with(|| why.to_string());
        abort(&self.shared);
    }

    /// Makes the communication stream wait for the work queued so far on the compute stream.
    pub(crate) fn after_compute(&self) -> Result<()> {
        self.stream
            .join(self.rt.stream())
            .map_err(|e| self.err("ordering a collective after compute", e.to_string()))
    }

    /// Makes the compute stream wait for the collectives queued so far.
    pub(crate) fn before_compute(&self) -> Result<()> {
        self.rt
            .stream()
            .join(&self.stream)
            .map_err(|e| self.err("ordering compute after a collective", e.to_string()))
    }

    /// Queues `what` on the communication stream over `count` elements of `dtype`. The
    /// caller orders it against the compute stream ([`NcclComm::after_compute`],
    /// [`NcclComm::before_compute`]) and keeps both buffers alive until the compute stream
    /// has waited for it.
    pub(crate) fn launch(
        &self,
        what: Collective,
        send: sys::CUdeviceptr,
        recv: sys::CUdeviceptr,
        count: usize,
        dtype: DType,
    ) -> Result<()> {
        let op = match what {
            Collective::AllReduce(_) => "ncclAllReduce",
            Collective::Broadcast { .. } => "ncclBroadcast",
            Collective::AllGather => "ncclAllGather",
            Collective::ReduceScatter(_) => "ncclReduceScatter",
        };
        if let Some(why) = self.failure() {
            return Err(self.err(op, format!("the communicator broke earlier: {why}")));
        }
        self.rt
            .refuse_in_capture(op, "collectives are not captured into CUDA graphs")?;
        let ty: c_int = match dtype {
            DType::U8 => 1,
            DType::I64 => 4,
            DType::F16 => 6,
            DType::F32 => 7,
            DType::F64 => 8,
            DType::BF16 => 9,
        };
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
        drop(comm);
        if code != 0 {
            let msg = describe(code);
            self.abort(&format!("{op}: {msg}"));
            return Err(self.err(op, msg));
        }
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
}

/// Aborts the communicator once (NCCL frees it: later calls find it null).
fn abort(s: &Shared) {
    let mut comm = s.comm.write().unwrap_or_else(|e| e.into_inner());
    if *comm != 0 {
        if let Ok(a) = api() {
            // SAFETY: the communicator is live (non-null under the write lock) and no call
            // uses it meanwhile; NCCL frees it.
            unsafe { (a.comm_abort)(*comm as CommPtr) };
        }
        *comm = 0;
    }
}

/// The watchdog: polls the communicator's asynchronous error (a peer that died, a network
/// failure) and aborts it, so that work waiting on it fails instead of hanging.
fn watch(s: &Shared) {
    while !s.stop.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(50));
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
            lock(&s.failed).get_or_insert_with(|| format!("asynchronous {}", describe(code)));
            abort(s);
            return;
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
        if healthy && self.stream.synchronize().is_ok() {
            let mut comm = self.shared.comm.write().unwrap_or_else(|e| e.into_inner());
            if *comm != 0 {
                if let Ok(a) = api() {
                    // SAFETY: live, unused (write lock), its work done (synchronised above).
                    unsafe { (a.comm_destroy)(*comm as CommPtr) };
                }
                *comm = 0;
            }
        }
        abort(&self.shared);
    }
}
