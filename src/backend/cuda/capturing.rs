//! What a runtime (`runtime.rs`) keeps and needs while a stream capture is open on its
//! compute stream (`graph.rs` makes and replays the graphs): the capture's pool and counts,
//! the relaxed capture mode for a new segment, and the fence of blocks a live graph may use.
//! A leaf of the CUDA backend's graph family: the runtime and `graph.rs` import it.

use crate::backend::caching::Fence;
use cudarc::driver::sys;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Weak;

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
