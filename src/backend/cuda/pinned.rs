//! Page-locked ("pinned") host memory from a caching pool, and uploads from it that the host
//! does not wait for.
//!
//! A copy from pageable memory makes the driver stage it through a pinned buffer of its own,
//! and it may wait for the stream first: every upload would wait for the work queued before
//! it. A copy from a pinned block is a plain DMA queued on the stream. The block must then
//! stay untouched until the copy has run, so each upload records an event after it, and the
//! pool hands the block out again only once that event has completed
//! ([`CachingAllocator::free_after`](crate::backend::caching::CachingAllocator::free_after)).

// The pinned pool's memory source, public here as before.
pub use super::handles::PinnedMemory;
use super::runtime::CudaRuntime;
use crate::backend::caching::Fence;
use crate::profiler::DeviceWork;
use crate::{Device, Error, Result};
use cudarc::driver::{sys, CudaEvent, CudaStream};
use std::ffi::c_void;
use std::sync::Arc;

/// A recorded event as the pool's fence.
struct EventFence(CudaEvent);

impl Fence for EventFence {
    fn is_done(&self) -> std::result::Result<bool, String> {
        // A failed query is not "done": the caching pool keeps the buffer out of use.
        self.0.try_is_complete().map_err(|e| format!("{e:?}"))
    }
}

/// A block of pinned host memory from a device runtime's pool
/// ([`CudaRuntime::pinned_buffer`]), returned to the pool when dropped, once the copies
/// queued from it have run.
pub struct PinnedBuffer {
    rt: Arc<CudaRuntime>,
    ptr: usize,
    bytes: usize,
    /// Recorded after the last copy queued from this buffer.
    fence: Option<CudaEvent>,
}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PinnedBuffer({} bytes for {})",
            self.bytes,
            self.rt.device()
        )
    }
}

impl CudaRuntime {
    /// A block of at least `bytes` of pinned host memory from this device's pool, handed
    /// back when the buffer is dropped (once the uploads queued from it have run).
    /// [`Error::OutOfMemory`] when the driver refuses even after the pool's cache is
    /// released.
    pub fn pinned_buffer(self: &Arc<Self>, bytes: usize) -> Result<PinnedBuffer> {
        let ptr = self.alloc_pinned(bytes)?;
        Ok(PinnedBuffer::new(self.clone(), ptr, bytes))
    }
}

impl PinnedBuffer {
    pub(crate) fn new(rt: Arc<CudaRuntime>, ptr: usize, bytes: usize) -> PinnedBuffer {
        PinnedBuffer {
            rt,
            ptr,
            bytes,
            fence: None,
        }
    }

    /// The runtime whose pool the block came from.
    pub(crate) fn runtime(&self) -> &Arc<CudaRuntime> {
        &self.rt
    }

    /// The device whose runtime the block came from.
    pub fn device(&self) -> Device {
        self.rt.device()
    }

    pub fn len(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The bytes (a copy queued from them may still be reading them, which is harmless).
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: the block holds at least `bytes` bytes and lives as long as `self`; the
        // only writes are through `as_bytes_mut`, which borrows `self` mutably.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.bytes) }
    }

    /// The bytes, for writing: waits first for the copies queued from them.
    pub fn as_bytes_mut(&mut self) -> Result<&mut [u8]> {
        if let Some(fence) = self.fence.take() {
            fence.synchronize().map_err(|e| Error::CudaDriver {
                op: "waiting for an upload from pinned memory",
                device: self.rt.device(),
                msg: e.to_string(),
            })?;
        }
        // SAFETY: as in `as_bytes`, and no copy reads the block any more.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.bytes) })
    }

    /// The first `len` elements of type `T`, for writing (waits as `as_bytes_mut`).
    pub fn as_mut_slice<T: bytemuck::Pod>(&mut self, len: usize) -> Result<&mut [T]> {
        let bytes = len * std::mem::size_of::<T>();
        let have = self.bytes;
        let b = self.as_bytes_mut()?;
        b.get_mut(..bytes)
            .and_then(|b| bytemuck::try_cast_slice_mut(b).ok())
            .ok_or_else(|| {
                Error::invalid(
                    "PinnedBuffer::as_mut_slice",
                    format!(
                        "{len} elements of {} bytes do not fit {have} bytes",
                        std::mem::size_of::<T>()
                    ),
                )
            })
    }

    /// Queues a copy of the first `bytes` bytes to device address `dst` on `stream`, and
    /// records the event the block's reuse waits for. The host does not wait.
    pub(crate) fn upload(
        &mut self,
        dst: sys::CUdeviceptr,
        bytes: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        let driver = |op, e: cudarc::driver::DriverError| Error::CudaDriver {
            op,
            device: self.rt.device(),
            msg: e.to_string(),
        };
        if bytes > self.bytes {
            return Err(Error::invalid(
                "PinnedBuffer::upload",
                format!("{bytes} bytes asked of a {}-byte buffer", self.bytes),
            ));
        }
        self.rt
            .context()
            .bind_to_thread()
            .map_err(|e| driver("binding the context", e))?;
        let prof = super::profile::copy(&self.rt, stream, DeviceWork::HostToDevice, bytes);
        // SAFETY: `dst` holds at least `bytes` bytes on the device (the caller's contract);
        // the source stays allocated and unwritten until the event recorded below has
        // completed (`as_bytes_mut` and the pool both wait for it).
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, self.ptr as *const c_void, bytes, stream.cu_stream())
        }
        .result()
        .map_err(|e| driver("copying from pinned memory to the device", e))?;
        if let Some(p) = prof {
            p.end();
        }
        let event = stream
            .record_event(None)
            .map_err(|e| driver("recording an upload's event", e))?;
        self.fence = Some(event);
        Ok(())
    }
}

/// A pinned buffer from `rt`'s pool holding a copy of `bytes`.
pub(crate) fn staged(rt: &Arc<CudaRuntime>, bytes: &[u8]) -> Result<PinnedBuffer> {
    let mut buf = rt.pinned_buffer(bytes.len())?;
    copy_parallel(&mut buf.as_bytes_mut()?[..bytes.len()], bytes);
    Ok(buf)
}

/// Bytes of one staging chunk of an upload from ordinary memory above
/// [`STAGE_MAX_BYTES`](super::storage::STAGE_MAX_BYTES), which goes through a ring of them.
pub const STAGE_CHUNK_BYTES: usize = 16 << 20;
/// Staging chunks in flight at once: the pinned memory a large upload holds is
/// `STAGE_RING * STAGE_CHUNK_BYTES`, whatever its size.
pub const STAGE_RING: usize = 4;

/// Uploads `bytes` to device address `dst` on `stream` through a ring of [`STAGE_RING`]
/// pinned chunks of [`STAGE_CHUNK_BYTES`] from `rt`'s pool: the host copies chunk k + 1 while the
/// DMA of chunk k runs, and waits only when a ring slot's previous DMA has not run yet. The
/// driver's own path for ordinary (pageable) memory stages through a small buffer of its own
/// and copies and transfers in turn. `Err(OutOfMemory)` before anything is queued when the
/// pool cannot give the ring.
pub(crate) fn upload_chunked(
    rt: &Arc<CudaRuntime>,
    bytes: &[u8],
    dst: sys::CUdeviceptr,
    stream: &Arc<CudaStream>,
) -> Result<()> {
    let chunk = STAGE_CHUNK_BYTES.min(bytes.len().max(1));
    let slots = bytes.len().div_ceil(chunk).clamp(1, STAGE_RING);
    let mut ring = (0..slots)
        .map(|_| rt.pinned_buffer(chunk))
        .collect::<Result<Vec<_>>>()?;
    for (k, piece) in bytes.chunks(chunk).enumerate() {
        let buf = &mut ring[k % slots];
        // Waits for this slot's previous DMA, if it has not run yet.
        copy_parallel(&mut buf.as_bytes_mut()?[..piece.len()], piece);
        // `k * chunk + piece.len() <= bytes.len()`: the destination holds the whole upload.
        buf.upload(dst + (k * chunk) as u64, piece.len(), stream)?;
    }
    // The buffers go back to the pool fenced by their last uploads.
    Ok(())
}

/// `dst.copy_from_slice(src)` on the rayon pool in pieces of 1 MiB: one thread's copy does
/// not reach the host's memory bandwidth.
fn copy_parallel(dst: &mut [u8], src: &[u8]) {
    let _iso = crate::parallel::Isolated::new();
    use rayon::prelude::*;
    const PIECE: usize = 1 << 20;
    if src.len() <= PIECE {
        dst.copy_from_slice(src);
        return;
    }
    dst.par_chunks_mut(PIECE)
        .zip(src.par_chunks(PIECE))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let fence = self
            .fence
            .take()
            .map(|e| Box::new(EventFence(e)) as Box<dyn Fence>);
        self.rt.free_pinned(self.ptr, fence);
    }
}
