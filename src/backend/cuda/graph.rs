//! CUDA graphs of the compute stream: a capture (`cuStreamBeginCapture` in thread-local
//! mode, so that other threads' allocations are not refused) records every launch and library
//! call a step queues; the instantiated graph replays them with one `cuGraphLaunch`.
//!
//! What a capture needs from the runtime (`runtime.rs`): blocks allocated during it come from
//! a pool private to the graph (its own key in the caching allocator), which the replays
//! reuse in the capture's order and which goes to the general cache only when the graph is
//! dropped; a block handed out before the capture and freed while the graph lives waits for
//! the graph to go ([`GraphsGone`]); no segment is given back to the driver during the
//! capture; the checked launches write fault words of the graph's own. A replay first uploads
//! its prologue (`crate::graph::scope`: generator states and learning rates), then launches.

use super::faults::GraphFaults;
use super::runtime::CudaRuntime;
use crate::backend::caching::Fence;
use crate::graph::scope;
use crate::profiler::{DeviceWork, Launch};
use crate::{Error, Result};
use cudarc::driver::{result, sys, CudaGraph};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

/// The launches and library calls a capture recorded.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct CaptureCounts {
    pub(crate) kernels: u32,
    pub(crate) calls: u32,
}

/// The capture open on a runtime's compute stream.
pub(crate) struct OpenCapture {
    pub(crate) pool: u64,
    pub(crate) counts: CaptureCounts,
}

/// A new private pool key (the caching allocator's stream key; 0 is the general cache).
pub(crate) fn next_pool() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// This thread in relaxed capture mode while it lives: `cuMemAlloc` is then allowed during
/// the thread's capture (a new segment for the graph's pool), as PyTorch's allocator does.
pub(crate) struct Relaxed(sys::CUstreamCaptureMode);

impl Relaxed {
    pub(crate) fn new() -> Relaxed {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: exchanges this thread's mode through a valid pointer; restored on drop.
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        Relaxed(mode)
    }
}

impl Drop for Relaxed {
    fn drop(&mut self) {
        // SAFETY: as in `new`, putting back the mode found there.
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut self.0) };
    }
}

/// Open once every graph that may use a freed block is gone.
pub(crate) struct GraphsGone(pub(crate) Vec<Weak<()>>);

impl Fence for GraphsGone {
    fn is_done(&self) -> std::result::Result<bool, String> {
        Ok(self.0.iter().all(|t| t.strong_count() == 0))
    }
}

/// An instantiated graph of a captured step and what it holds: its pool, its prologue buffer
/// and its fault words. Not `Send` (cudarc's graph is not).
pub(crate) struct DeviceGraph {
    graph: Option<CudaGraph>,
    rt: Arc<CudaRuntime>,
    pool: u64,
    token: Option<Arc<()>>,
    prologue: u64,
    faults: Option<Arc<GraphFaults>>,
    counts: CaptureCounts,
}

/// The bytes of replay values a step may hold (16 per generator, 8 per optimizer update).
pub(crate) const PROLOGUE_BYTES: usize = 4096;

impl DeviceGraph {
    /// Captures what `step` queues on `rt`'s compute stream. Whatever happens the capture
    /// is closed; on an error (the step's, a refusal, or the driver's) nothing is kept.
    pub(crate) fn capture<R>(
        rt: &Arc<CudaRuntime>,
        step: impl FnOnce() -> Result<R>,
    ) -> Result<(DeviceGraph, scope::Prologue, R)> {
        let (prologue, _) = rt.alloc(PROLOGUE_BYTES)?;
        let (pool, token) = match rt.open_capture() {
            Ok(p) => p,
            Err(e) => {
                rt.free(prologue)?;
                return Err(e);
            }
        };
        scope::open(rt.device(), prologue, PROLOGUE_BYTES);
        let r = step();
        let values = scope::close();
        let (graph, faults, counts) = rt.close_capture();
        let mut g = DeviceGraph {
            graph: None,
            rt: rt.clone(),
            pool,
            token: Some(token),
            prologue,
            faults: faults.map(Arc::new),
            counts,
        };
        // The step's own error first; then a refusal it swallowed; then the driver's.
        let r = r?;
        let values = values?;
        g.graph = Some(graph?);
        if let Some(graph) = &g.graph {
            graph
                .upload()
                .map_err(|e| driver(rt, "uploading a graph", e))?;
        }
        Ok((g, values, r))
    }

    /// The launches and library calls one replay queues.
    pub(crate) fn counts(&self) -> (u32, u32) {
        (self.counts.kernels, self.counts.calls)
    }

    /// Queues a replay: `values` (the prologue's bytes) uploaded, then the graph launched.
    pub(crate) fn launch(&self, values: &[u8]) -> Result<()> {
        let graph = self.graph.as_ref().expect("a DeviceGraph holds its graph");
        let rt = &self.rt;
        rt.context()
            .bind_to_thread()
            .map_err(|e| driver(rt, "binding the context", e))?;
        let stream = rt.stream();
        let (kernels, calls) = self.counts();
        let prof = super::profile::begin(rt, stream, || Launch {
            name: format!("cuda_graph.replay ({kernels} kernels, {calls} library calls)"),
            work: DeviceWork::Graph { kernels, calls },
            device: rt.device(),
            config: None,
            bytes: None,
            flops: None,
        });
        if !values.is_empty() {
            // SAFETY: the prologue buffer holds PROLOGUE_BYTES >= values.len() bytes (the
            // scope hands out no more); a pageable source is staged by the driver before
            // the call returns.
            unsafe { result::memcpy_htod_async(self.prologue, values, stream.cu_stream()) }
                .map_err(|e| driver(rt, "uploading a replay's values", e))?;
        }
        graph
            .launch()
            .map_err(|e| driver(rt, "launching a graph", e))?;
        if let Some(p) = prof {
            p.end();
        }
        if let Some(f) = &self.faults {
            rt.replayed(f);
        }
        Ok(())
    }
}

impl Drop for DeviceGraph {
    fn drop(&mut self) {
        // The graph first (its replays still queued finish: the driver keeps what they
        // use), then its pool and the blocks it held to the general cache, whose later users
        // are ordered after the replays on the one stream.
        drop(self.graph.take());
        drop(self.token.take());
        self.rt.release_pool(self.pool);
        let _ = self.rt.free(self.prologue);
        drop(self.faults.take());
    }
}

fn driver(rt: &CudaRuntime, op: &'static str, e: cudarc::driver::DriverError) -> Error {
    Error::CudaDriver {
        op,
        device: rt.device(),
        msg: e.to_string(),
    }
}
