//! One CUDA device in use: its context and compute stream, the kernel modules loaded so far
//! (compiled by NVRTC for the device's own architecture, in parts, through the disk cache:
//! `compile.rs`), and the caching allocator over the device's memory (`cuMemAlloc` /
//! `cuMemFree` underneath).

use super::capturing::{CaptureCounts, OpenCapture};
use super::faults::{Faults, GraphFaults};
use super::handles::{DnnHandle, LtHandle, PinnedMemory};
// The device memory source of the runtime's caching allocator, public here as before.
pub use super::handles::DriverMemory;
use super::{compile, kernels, nvrtc, probe};
use crate::backend::caching::{CachingAllocator, Fence, MemoryStats};
use crate::sync::lock;
use crate::{Device, Error, Result};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{result, sys, CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// A device's context, stream, loaded kernels and memory.
pub struct CudaRuntime {
    device: Device,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// `sm_XY` as XY.
    arch: u32,
    /// Kernel modules loaded so far, by file and part ([`kernels::part_of`]).
    modules: Mutex<HashMap<(&'static str, usize), Arc<CudaModule>>>,
    /// Kernels looked up so far, by "file/name" (one driver lookup per kernel, not per launch).
    functions: Mutex<HashMap<String, CudaFunction>>,
    memory: Mutex<CachingAllocator<DriverMemory>>,
    /// Pinned host blocks for uploads (staging, and the loaders' batches).
    pinned: Mutex<CachingAllocator<PinnedMemory>>,
    /// The stream batches are uploaded on ahead of the compute stream, created at first use.
    copy_stream: Mutex<Option<Arc<CudaStream>>>,
    /// The cuBLAS handle on `stream`, created at the first product (`libraries.rs`).
    pub(super) blas: Mutex<Option<CudaBlas>>,
    /// The cuDNN handle on `stream`, created at the first convolution.
    pub(super) dnn: Mutex<Option<DnnHandle>>,
    /// The cuBLASLt handle, created at the first product with a bias epilogue.
    pub(super) lt: Mutex<Option<LtHandle>>,
    /// The workspace cuBLAS and cuBLASLt share for the runtime's life (address, bytes),
    /// allocated with the first of their handles.
    pub(super) blas_workspace: Mutex<Option<(sys::CUdeviceptr, usize)>>,
    /// Faults kernels found, reported at the next synchronisation.
    faults: Mutex<Faults>,
    /// The stream capture open on the compute stream, if any (`graph.rs`).
    capture: Mutex<Option<OpenCapture>>,
    capturing: AtomicBool,
    /// The live graphs: the allocator's request count when each began its capture (blocks
    /// handed out before it may be used by its replays), and its life token.
    graphs: Mutex<Vec<(u64, Weak<()>)>>,
    /// The fault words of the live graphs replayed since the last synchronisation.
    replayed: Mutex<Vec<Weak<GraphFaults>>>,
    /// What may break outside any op on this device (the NCCL communicators), checked at
    /// each synchronisation.
    health: Mutex<Vec<Weak<dyn Health>>>,
}

/// Something on a device that may break outside any op, whose failure the device's next
/// [`CudaRuntime::synchronize`] reports: an NCCL communicator its watchdog aborted, whose
/// collectives' results are then missing.
pub(crate) trait Health: Send + Sync {
    fn failure(&self) -> Option<Error>;
}

/// `MANTISSA_NO_CUDA_MEMORY_CACHING=1` (as PyTorch's `PYTORCH_NO_CUDA_MEMORY_CACHING`): device
/// memory straight from the driver, block by block, without the cache; for debugging.
fn no_caching() -> bool {
    std::env::var_os("MANTISSA_NO_CUDA_MEMORY_CACHING").is_some_and(|v| v == "1")
}

/// The runtime of device `ordinal`, created on first use and shared afterwards. Errors (never
/// panics) when the driver, the device or NVRTC is missing.
///
/// ```no_run
/// # fn main() -> mantissa::Result<()> {
/// let rt = mantissa::backend::cuda::runtime::runtime(0)?;
/// let f = rt.function("cast", "cast_float_bf16")?;
/// println!("{}", rt.memory_stats());
/// # Ok(()) }
/// ```
pub fn runtime(ordinal: usize) -> Result<Arc<CudaRuntime>> {
    static RUNTIMES: OnceLock<Mutex<HashMap<usize, Arc<CudaRuntime>>>> = OnceLock::new();
    let mut all = lock(RUNTIMES.get_or_init(Default::default));
    if let Some(rt) = all.get(&ordinal) {
        return Ok(rt.clone());
    }
    let report = probe::report(ordinal)?;
    nvrtc::version()?;
    let device = Device::Cuda(ordinal);
    let ctx = CudaContext::new(ordinal).map_err(|e| Error::CudaDriver {
        op: "creating the context",
        device,
        msg: e.to_string(),
    })?;
    let stream = ctx.new_stream().map_err(|e| Error::CudaDriver {
        op: "creating the compute stream",
        device,
        msg: e.to_string(),
    })?;
    let (major, minor) = report.compute_capability;
    let rt = Arc::new(CudaRuntime {
        device,
        memory: Mutex::new(
            CachingAllocator::new(DriverMemory { ctx: ctx.clone() }, device)
                .with_caching(!no_caching()),
        ),
        pinned: Mutex::new(CachingAllocator::new(
            PinnedMemory { ctx: ctx.clone() },
            Device::Cpu,
        )),
        copy_stream: Mutex::new(None),
        ctx,
        stream,
        arch: (major * 10 + minor) as u32,
        modules: Mutex::new(HashMap::new()),
        functions: Mutex::new(HashMap::new()),
        blas: Mutex::new(None),
        dnn: Mutex::new(None),
        lt: Mutex::new(None),
        blas_workspace: Mutex::new(None),
        faults: Mutex::new(Faults::default()),
        capture: Mutex::new(None),
        capturing: AtomicBool::new(false),
        graphs: Mutex::new(Vec::new()),
        replayed: Mutex::new(Vec::new()),
        health: Mutex::new(Vec::new()),
    });
    // Every run makes f32 tensors: the f32 and integer part of the kernel files starts
    // compiling now, in the background, while the caller builds its model.
    compile::prefetch(rt.arch, &[0]);
    all.insert(ordinal, rt.clone());
    Ok(rt)
}

impl CudaRuntime {
    pub fn device(&self) -> Device {
        self.device
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every op of this device runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device's architecture, `sm_XY` as XY.
    pub fn arch(&self) -> u32 {
        self.arch
    }

    /// Kernel `name` of the kernel file `file` (a name in [`kernels::KERNELS`]), compiling and
    /// loading the part of the file that holds it on first use ([`compile`]: the other
    /// files' same part compile meanwhile, in the background).
    pub fn function(&self, file: &str, name: &str) -> Result<CudaFunction> {
        let key = format!("{file}/{name}");
        if let Some(f) = lock(&self.functions).get(&key) {
            return Ok(f.clone());
        }
        let part = kernels::part_of(name);
        let f = match self.module(file, part)?.load_function(name) {
            Ok(f) => f,
            // Not where its name says: a kernel file whose `PART` guards do not follow
            // `part_of` (tests/host_kernels checks they do). The other parts are searched,
            // so the kernel still runs, only compiled later than it could have been.
            Err(e) => {
                let mut found = None;
                for p in (0..compile::PARTS).filter(|&p| p != part) {
                    if let Ok(f) = self.module(file, p)?.load_function(name) {
                        log::warn!("kernel {name} of {file}.cu is in part {p}, not {part}");
                        found = Some(f);
                        break;
                    }
                }
                found.ok_or_else(|| self.driver("finding a kernel", e))?
            }
        };
        lock(&self.functions).insert(key, f.clone());
        Ok(f)
    }

    /// Part `part` of kernel file `file`, compiled (or waited for) and loaded on first use.
    fn module(&self, file: &str, part: usize) -> Result<Arc<CudaModule>> {
        let (name, _) = kernels::KERNELS
            .iter()
            .find(|(n, _)| *n == file)
            .ok_or_else(|| {
                Error::invalid("CudaRuntime::function", format!("no kernel file {file}"))
            })?;
        if let Some(m) = lock(&self.modules).get(&(*name, part)) {
            return Ok(m.clone());
        }
        self.refuse_in_capture(
            &format!("loading kernel file {name}.cu (part {part}) at its first use"),
            "a module load (and its NVRTC compile) is not allowed while a stream is captured; \
             the step's eager warm-up calls load what it uses",
        )?;
        // Compiled without the lock held: other threads may load other parts meanwhile.
        let bin = compile::cubin(name, part, self.arch)?;
        let mut modules = lock(&self.modules);
        if let Some(m) = modules.get(&(*name, part)) {
            return Ok(m.clone());
        }
        let m = self
            .ctx
            .load_module(Ptx::from_binary(bin.to_vec()))
            .map_err(|e| self.driver("loading a kernel module", e))?;
        modules.insert((*name, part), m.clone());
        Ok(m)
    }

    /// A device block of at least `bytes` from the caching allocator, for this runtime's
    /// stream; [`Error::OutOfMemory`] (naming the request and the statistics) when even an
    /// emptied cache cannot serve it.
    pub fn alloc(&self, bytes: usize) -> Result<(sys::CUdeviceptr, usize)> {
        if !self.capturing() {
            return lock(&self.memory).alloc(bytes, 0);
        }
        // During a capture, from the graph's private pool; a new segment's cuMemAlloc is
        // made in relaxed capture mode (it is not stream work; the graph keeps the block).
        let pool = lock(&self.capture).as_ref().map_or(0, |c| c.pool);
        let _relaxed = super::capturing::Relaxed::new();
        lock(&self.memory).alloc(bytes, pool)
    }

    /// Returns a block from [`CudaRuntime::alloc`] to the cache. Work on the stream that
    /// still reads it is ordered before any later use of the block, since every op runs on
    /// the compute stream (an upload on the copy stream first waits for the compute work
    /// queued before it).
    ///
    /// While a CUDA graph lives, a block handed out before its capture began goes back to
    /// the cache only when the graph is gone: its replays may still read or write it.
    pub fn free(&self, ptr: sys::CUdeviceptr) -> Result<()> {
        let graphs = lock(&self.graphs);
        let mut memory = lock(&self.memory);
        let holders: Vec<Weak<()>> = match (graphs.is_empty(), memory.born(ptr)) {
            (false, Some((born, 0))) => graphs
                .iter()
                .filter(|(epoch, t)| born <= *epoch && t.strong_count() > 0)
                .map(|(_, t)| t.clone())
                .collect(),
            _ => Vec::new(),
        };
        match holders.is_empty() {
            true => memory.free(ptr),
            false => memory.free_after(ptr, Box::new(super::capturing::GraphsGone(holders))),
        }
    }

    /// Allocated, reserved and peak bytes, as `torch.cuda.memory_stats` counts them.
    pub fn memory_stats(&self) -> MemoryStats {
        lock(&self.memory).stats()
    }

    pub fn reset_peak_stats(&self) {
        lock(&self.memory).reset_peak_stats()
    }

    /// Gives the cached blocks back to the driver (`torch.cuda.empty_cache`), after the
    /// streams have finished with them; cached pinned host blocks go too.
    pub fn empty_cache(&self) -> Result<()> {
        self.refuse_in_capture("empty_cache", "it frees device memory")?;
        self.synchronize()?;
        if let Some(copy) = lock(&self.copy_stream).as_ref() {
            copy.synchronize()
                .map_err(|e| self.driver("synchronize the copy stream", e))?;
        }
        lock(&self.memory).empty_cache();
        lock(&self.pinned).empty_cache();
        Ok(())
    }

    /// The device's free and total bytes as the driver counts them (`torch.cuda.mem_get_info`):
    /// free excludes what this process's cache holds.
    pub fn mem_get_info(&self) -> Result<(usize, usize)> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.driver("binding the context", e))?;
        result::mem_get_info().map_err(|e| self.driver("cuMemGetInfo", e))
    }

    /// The host address of a block of at least `bytes` (one at least) of pinned memory from
    /// this device's pool, for [`CudaRuntime::pinned_buffer`]; [`Error::OutOfMemory`] when
    /// the driver refuses even after the pool's cache is released.
    pub(crate) fn alloc_pinned(&self, bytes: usize) -> Result<usize> {
        let (ptr, _) = lock(&self.pinned).alloc(bytes.max(1), 0)?;
        // The pool's addresses are the host pointers `PinnedMemory::alloc` made into u64s.
        Ok(ptr as usize)
    }

    /// Returns a pinned block, after `fence` when a copy may still read it.
    pub(crate) fn free_pinned(&self, ptr: usize, fence: Option<Box<dyn Fence>>) {
        let mut pool = lock(&self.pinned);
        // Both fail only for a block that is not live, which a PinnedBuffer's single drop
        // rules out.
        let _ = match fence {
            Some(f) => pool.free_after(ptr as u64, f),
            None => pool.free(ptr as u64),
        };
    }

    /// The pinned host pool's statistics (blocks whose uploads are still queued count as
    /// allocated).
    pub fn pinned_stats(&self) -> MemoryStats {
        let mut pool = lock(&self.pinned);
        pool.pending(); // moves the blocks whose uploads have run back into the cache
        pool.stats()
    }

    /// The stream uploads run on ahead of the compute stream ([`crate::data::DeviceBatches`]),
    /// created at first use.
    pub fn copy_stream(&self) -> Result<Arc<CudaStream>> {
        let mut copy = lock(&self.copy_stream);
        if let Some(s) = copy.as_ref() {
            return Ok(s.clone());
        }
        self.refuse_in_capture("creating the copy stream", "it synchronises the device")?;
        let s = self
            .ctx
            .new_stream()
            .map_err(|e| self.driver("creating the copy stream", e))?;
        *copy = Some(s.clone());
        Ok(s)
    }

    /// Waits for all work queued on the stream; `Err` when a kernel found a fault in its
    /// input meanwhile (an index or class target out of range: the kernels record it on the
    /// device and this reports it, naming the op).
    pub fn synchronize(&self) -> Result<()> {
        self.refuse_in_capture(
            "a host synchronisation",
            "the host would wait for work that has not run (item, to_vec, a host read)",
        )?;
        self.stream
            .synchronize()
            .map_err(|e| self.driver("synchronize", e))?;
        lock(&self.faults).check(&self.stream, self.device)?;
        // Every replayed graph's words are read (and cleared); the first fault is reported.
        let replayed = std::mem::take(&mut *lock(&self.replayed));
        let mut first = Ok(());
        for g in replayed.iter().filter_map(Weak::upgrade) {
            let r = g.check(&self.stream, self.device);
            if first.is_ok() {
                first = r;
            }
        }
        first?;
        let mut health = lock(&self.health);
        health.retain(|h| h.strong_count() > 0);
        match health.iter().find_map(|h| h.upgrade()?.failure()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Has [`CudaRuntime::synchronize`] report `h`'s failure while `h` lives.
    pub(crate) fn watch_health(&self, h: Weak<dyn Health>) {
        lock(&self.health).push(h);
    }

    /// Whether a stream capture is open on the compute stream and this thread is the one
    /// capturing (its capture scope is open): other threads (a loader's workers) allocate
    /// from the general cache and upload as ever meanwhile.
    pub(crate) fn capturing(&self) -> bool {
        self.capturing.load(Ordering::Relaxed) && crate::capture::active()
    }

    /// `Err` ([`Error::NotCapturable`], naming `op`) while a capture is open: for work that
    /// cannot go into a graph. The capture then fails.
    pub(crate) fn refuse_in_capture(&self, op: &str, why: &str) -> Result<()> {
        match self.capturing() {
            false => Ok(()),
            true => Err(crate::capture::refuse(op, why)),
        }
    }

    /// Counts a launch or library call into the open capture (for the replay's profile).
    pub(crate) fn count_captured(&self, library: bool) {
        if let Some(c) = lock(&self.capture).as_mut() {
            match library {
                true => c.counts.calls += 1,
                false => c.counts.kernels += 1,
            }
        }
    }

    /// Opens a capture of the compute stream (`graph.rs`): after the queued work and its
    /// faults are checked, blocks come from a new private pool, no segment is given back,
    /// and checked launches get the graph's own fault words. Returns the pool and the
    /// graph's life token.
    pub(crate) fn open_capture(&self) -> Result<(u64, Arc<()>)> {
        if no_caching() {
            return Err(Error::NotCapturable {
                op: "a CUDA graph".into(),
                device: self.device,
                why: "MANTISSA_NO_CUDA_MEMORY_CACHING=1 frees every block at once, which a \
                      captured step's memory cannot allow"
                    .into(),
            });
        }
        self.synchronize()?;
        let mut capture = lock(&self.capture);
        if capture.is_some() {
            return Err(Error::invalid(
                "CapturedStep",
                format!("a capture is already open on {}", self.device),
            ));
        }
        let pool = super::capturing::next_pool();
        let token = Arc::new(());
        let epoch = {
            let mut memory = lock(&self.memory);
            // The general cache's free segments go back to the driver first, as PyTorch
            // empties its cache before a graph: the graph's pool takes new segments, which
            // the cached ones would otherwise keep from it (a step that uses more than half
            // the device could not be captured, and each capture would leave its
            // predecessor's pool cached beside its own).
            memory.empty_cache();
            memory.hold_stream(pool);
            memory.keep_segments(true);
            memory.stats().requests
        };
        // Locked after the allocator is released: `free` takes the two the other way round.
        lock(&self.graphs).push((epoch, Arc::downgrade(&token)));
        let begun = lock(&self.faults)
            .begin_capture(&self.ctx, &self.stream, self.device)
            .and_then(|()| {
                self.stream
                    .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                    .map_err(|e| self.driver("beginning a stream capture", e))
            });
        if let Err(e) = begun {
            lock(&self.faults).end_capture();
            lock(&self.memory).keep_segments(false);
            self.release_pool(pool);
            return Err(e);
        }
        *capture = Some(OpenCapture {
            pool,
            counts: CaptureCounts::default(),
        });
        self.capturing.store(true, Ordering::Relaxed);
        Ok((pool, token))
    }

    /// Ends the open capture: the instantiated graph (None when the driver refused it; the
    /// error says why), the graph's fault words and the launches it holds.
    pub(crate) fn close_capture(
        &self,
    ) -> (
        Result<cudarc::driver::CudaGraph>,
        Option<GraphFaults>,
        CaptureCounts,
    ) {
        let open = lock(&self.capture).take();
        self.capturing.store(false, Ordering::Relaxed);
        lock(&self.memory).keep_segments(false);
        let faults = lock(&self.faults).end_capture();
        let graph = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(|e| self.driver("ending a stream capture", e))
            .and_then(|g| g.ok_or_else(|| self.empty_capture()))
            .and_then(|g| {
                let mut nodes = 0usize;
                // SAFETY: the graph is live (owned by `g`); a null array asks for the count.
                unsafe { sys::cuGraphGetNodes(g.cu_graph(), std::ptr::null_mut(), &mut nodes) }
                    .result()
                    .map_err(|e| self.driver("counting a graph's nodes", e))?;
                match nodes {
                    0 => Err(self.empty_capture()),
                    _ => Ok(g),
                }
            });
        (graph, faults, open.map(|o| o.counts).unwrap_or_default())
    }

    fn empty_capture(&self) -> Error {
        Error::NotCapturable {
            op: "a CUDA graph".into(),
            device: self.device,
            why: "the step queued no work on this device (a step on the CPU, or on another \
                  device?)"
                .into(),
        }
    }

    /// Gives a graph's private pool to the general cache (the graph is gone).
    pub(crate) fn release_pool(&self, pool: u64) {
        lock(&self.memory).release_stream(pool);
        lock(&self.graphs).retain(|(_, t)| t.strong_count() > 0);
    }

    /// Notes a replay, whose fault words the next synchronisation reads.
    pub(crate) fn replayed(&self, faults: &Arc<GraphFaults>) {
        let mut r = lock(&self.replayed);
        if !r.iter().any(|w| w.as_ptr() == Arc::as_ptr(faults)) {
            r.push(Arc::downgrade(faults));
        }
    }

    /// Queues a launch whose kernel checks its input on the device (`op` and `msg` say what
    /// a fault would mean): `launch` gets the fault word and slot number to pass the kernel.
    /// The slot is given and the launch queued under the faults' lock, so no other thread's
    /// check runs between the two (it would clear the slot before the kernel wrote it); the
    /// next [`synchronize`] on the launching thread reports the fault. `launch` must only
    /// queue work (no synchronisation, no read: it would wait for this lock).
    ///
    /// [`synchronize`]: CudaRuntime::synchronize
    pub(crate) fn checked_launch<R>(
        &self,
        op: &'static str,
        msg: String,
        launch: impl FnOnce(sys::CUdeviceptr, i32) -> Result<R>,
    ) -> Result<R> {
        let mut faults = lock(&self.faults);
        let (word, slot) = faults.slot(&self.ctx, &self.stream, self.device, op, msg)?;
        let r = launch(word, slot);
        if r.is_err() {
            faults.unslot(slot);
        }
        r
    }

    pub(super) fn driver(&self, op: &'static str, e: cudarc::driver::DriverError) -> Error {
        Error::CudaDriver {
            op,
            device: self.device,
            msg: e.to_string(),
        }
    }
}
