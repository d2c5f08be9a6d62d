//! Device records for [`crate::profiler`]: a CUDA event recorded on the work's stream before
//! and after each kernel launch, library call and copy, read back when the profile stops
//! (never inside a step), relative to a base event per device.

use super::runtime::CudaRuntime;
use crate::layout::Layout;
use crate::profiler::{self, DeviceTimer, DeviceWork, Launch};
use crate::DType;
use cudarc::driver::{sys, CudaEvent, CudaStream, LaunchConfig};
use std::any::Any;
use std::sync::Arc;

const TIMING: Option<sys::CUevent_flags> = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);

struct EventTimer {
    base: Arc<dyn Any + Send + Sync>,
    start: CudaEvent,
    end: CudaEvent,
}

impl DeviceTimer for EventTimer {
    fn elapsed_ms(&self) -> std::result::Result<(f64, f64), String> {
        let base = self
            .base
            .downcast_ref::<CudaEvent>()
            .ok_or("the device's base mark is not a CUDA event")?;
        let a = base.elapsed_ms(&self.start).map_err(|e| e.to_string())?;
        let b = base.elapsed_ms(&self.end).map_err(|e| e.to_string())?;
        Ok((a as f64, b as f64))
    }
}

/// A device record in the making: its start event is on the stream.
pub(crate) struct Timed {
    span: profiler::DeviceSpan,
    timing: Option<(Arc<dyn Any + Send + Sync>, CudaEvent)>,
    stream: Arc<CudaStream>,
}

/// Starts a record of work about to be queued on `stream` of `rt` (None when no profile
/// runs). An event that cannot be recorded leaves the record without device times.
pub(crate) fn begin(
    rt: &CudaRuntime,
    stream: &Arc<CudaStream>,
    launch: impl FnOnce() -> Launch,
) -> Option<Timed> {
    let span = profiler::device_work(launch)?;
    let base = profiler::device_base(rt.device(), || {
        let e = stream.record_event(TIMING).ok()?;
        Some(Arc::new(e) as Arc<dyn Any + Send + Sync>)
    });
    let timing = match base {
        Some(b) => stream.record_event(TIMING).ok().map(|start| (b, start)),
        None => None,
    };
    Some(Timed {
        span,
        timing,
        stream: stream.clone(),
    })
}

impl Timed {
    /// Ends the record after the work was queued.
    pub(crate) fn end(self) {
        let timer = match (self.timing, self.stream.record_event(TIMING).ok()) {
            (Some((base, start)), Some(end)) => {
                Some(Box::new(EventTimer { base, start, end }) as Box<dyn DeviceTimer>)
            }
            _ => None,
        };
        self.span.finish(timer);
    }
}

/// Starts the record of a launch of our kernel `name` (made only when profiling) on the
/// compute stream.
pub(crate) fn kernel(
    rt: &CudaRuntime,
    name: impl FnOnce() -> String,
    cfg: &LaunchConfig,
    bytes: Option<u64>,
) -> Option<Timed> {
    // Captured work is profiled as its graph's replays.
    if rt.capturing() {
        rt.count_captured(false);
        return None;
    }
    begin(rt, rt.stream(), || Launch {
        name: name(),
        work: DeviceWork::Kernel,
        device: rt.device(),
        config: Some((cfg.grid_dim.0, cfg.block_dim.0)),
        bytes,
        flops: None,
    })
}

/// The bytes of the distinct elements a view selects (a broadcast dim, stride 0, reads its
/// elements once): what a kernel reading the view must move at least.
pub(crate) fn view_bytes(l: &Layout, dtype: DType) -> u64 {
    let distinct = l
        .shape()
        .iter()
        .zip(l.strides())
        .filter(|(&d, &s)| s != 0 || d == 0)
        .fold(1u64, |acc, (&d, _)| acc.saturating_mul(d as u64));
    distinct.saturating_mul(dtype.size_in_bytes() as u64)
}

/// The bytes of `n` elements of `dtype`.
pub(crate) fn elems(n: usize, dtype: DType) -> u64 {
    (n as u64).saturating_mul(dtype.size_in_bytes() as u64)
}

/// Starts the record of a library call on the compute stream: `name` (made only when
/// profiling) says the call, its shape and dtype; `flops` and `bytes` as far as known.
pub(crate) fn library(
    rt: &CudaRuntime,
    name: impl FnOnce() -> String,
    flops: u64,
    bytes: u64,
) -> Option<Timed> {
    if rt.capturing() {
        rt.count_captured(true);
        return None;
    }
    begin(rt, rt.stream(), || Launch {
        name: name(),
        work: DeviceWork::Library,
        device: rt.device(),
        config: None,
        bytes: Some(bytes),
        flops: Some(flops),
    })
}

/// Starts the record of a copy of `bytes` on `stream`.
pub(crate) fn copy(
    rt: &CudaRuntime,
    stream: &Arc<CudaStream>,
    work: DeviceWork,
    bytes: usize,
) -> Option<Timed> {
    if rt.capturing() {
        return None;
    }
    begin(rt, stream, || Launch {
        name: format!("memcpy {}", work.label().trim_start_matches("copy ")),
        work,
        device: rt.device(),
        config: None,
        bytes: Some(bytes as u64),
        flops: None,
    })
}

/// A dtype as call names write it (`f16`).
pub(crate) fn short(d: DType) -> String {
    format!("{d:?}").to_lowercase()
}
