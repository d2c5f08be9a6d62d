//! CUDA graphs of the compute stream: a capture (`cuStreamBeginCapture` in thread-local
//! mode, so that other threads' allocations are not refused) records every launch and library
//! call a step queues; the instantiated graph replays them with one `cuGraphLaunch`.
//!
//! What a capture needs from the runtime (`runtime.rs`): blocks allocated during it come from
//! a pool private to the graph (its own key in the caching allocator), which the replays
//! reuse in the capture's order and which goes to the general cache only when the graph is
//! dropped; a block handed out before the capture and freed while the graph lives waits for
//! the graph to go (`capturing::GraphsGone`); no segment is given back to the driver during the
//! capture; the checked launches write fault words of the graph's own. A replay first uploads
//! its prologue (`crate::capture`: generator states and learning rates), then launches.

use super::capturing::CaptureCounts;
use super::faults::GraphFaults;
use super::runtime::CudaRuntime;
use crate::capture as scope;
use crate::profiler::{DeviceWork, Launch};
use crate::{Error, Result};
use cudarc::driver::{result, CudaGraph};
use std::sync::Arc;

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
        if values.len() > PROLOGUE_BYTES {
            return Err(Error::invalid(
                "CapturedStep",
                format!(
                    "{} bytes of replay values for a buffer of {PROLOGUE_BYTES}",
                    values.len()
                ),
            ));
        }
        // Through a pinned block, so that the host does not wait (a copy from pageable memory
        // waits for the stream first); from pageable memory when pinned memory runs out.
        let staged = match values.is_empty() {
            true => Ok(()),
            false => super::pinned::staged(rt, values)
                .and_then(|mut b| b.upload(self.prologue, values.len(), stream)),
        };
        match staged {
            Ok(()) => {}
            Err(Error::OutOfMemory { .. }) => {
                // SAFETY: the prologue buffer holds PROLOGUE_BYTES >= values.len() bytes
                // (checked above); a pageable source is staged before the call returns.
                unsafe { result::memcpy_htod_async(self.prologue, values, stream.cu_stream()) }
                    .map_err(|e| driver(rt, "uploading a replay's values", e))?;
            }
            Err(e) => return Err(e),
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
