//! The raw resources a device runtime (`runtime.rs`) owns: device memory and pinned host
//! memory straight from the driver, for its caching allocators, and its cuDNN and cuBLASLt
//! handles, each destroyed on drop. A leaf of the CUDA backend: the runtime imports it, and it
//! imports nothing of the runtime's.

use super::libs::{self, Lib};
use crate::backend::caching::RawMemory;
use crate::{Device, Error, Result};
use cudarc::cublaslt::result as lt;
use cudarc::driver::{result, sys, CudaContext};
use std::ffi::c_void;
use std::sync::Arc;

/// Device memory straight from the driver, for the caching allocator.
pub struct DriverMemory {
    pub(crate) ctx: Arc<CudaContext>,
}

impl RawMemory for DriverMemory {
    fn alloc(&mut self, bytes: usize) -> std::result::Result<sys::CUdeviceptr, String> {
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: the context is current on this thread; the block is freed by `free`.
        unsafe { result::malloc_sync(bytes) }.map_err(|e| e.to_string())
    }

    fn free(&mut self, ptr: sys::CUdeviceptr) {
        // A failure here leaves the block to the driver's teardown; there is nothing better
        // to do with it, and the error is sticky, so the next checked call reports it.
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from `alloc` and the allocator frees it once.
            let _ = unsafe { result::free_sync(ptr) };
        }
    }
}

/// Pinned host memory straight from the driver (`cuMemHostAlloc`), for the caching pool.
pub struct PinnedMemory {
    pub(crate) ctx: Arc<CudaContext>,
}

impl RawMemory for PinnedMemory {
    fn alloc(&mut self, bytes: usize) -> std::result::Result<u64, String> {
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        // Portable: usable by every context. Not write-combined: the host reads these blocks
        // too (a loader's batches), and write-combined memory is slow to read.
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: the context is current on this thread; the block is freed by `free`.
        unsafe { result::malloc_host(bytes, flags) }
            .map(|p| p as usize as u64)
            .map_err(|e| e.to_string())
    }

    fn free(&mut self, ptr: u64) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from `alloc`, and the pool frees it once, after the fences
            // of the copies that read it.
            let _ = unsafe { result::free_host(ptr as usize as *mut c_void) };
        }
    }
}

/// A cuDNN handle, destroyed on drop. Used only under its runtime's lock, one thread at a time.
pub(crate) struct DnnHandle(pub(crate) cudarc::cudnn::sys::cudnnHandle_t);

// SAFETY: a cuDNN handle may move between threads; the mutex around it keeps uses serial.
unsafe impl Send for DnnHandle {}

impl Drop for DnnHandle {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `with_cudnn` and is destroyed once, here.
        let _ = unsafe { cudarc::cudnn::result::destroy_handle(self.0) };
    }
}

/// A cuBLASLt handle, destroyed on drop; used under its runtime's lock, one thread at a time.
pub(crate) struct LtHandle(pub(crate) cudarc::cublaslt::sys::cublasLtHandle_t);

// SAFETY: the handle may move between threads; the runtime's mutex keeps uses serial.
unsafe impl Send for LtHandle {}

impl LtHandle {
    pub(crate) fn new(device: Device) -> Result<LtHandle> {
        libs::load(Lib::CublasLt)?;
        lt::create_handle()
            .map(LtHandle)
            .map_err(|e| Error::CudaLibrary {
                lib: "cuBLASLt",
                msg: format!("creating a handle on {device}: {e:?}"),
            })
    }
}

impl Drop for LtHandle {
    fn drop(&mut self) {
        // SAFETY: created by `new`, destroyed once, here.
        let _ = unsafe { lt::destroy_handle(self.0) };
    }
}
