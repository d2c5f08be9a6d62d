//! Device memory as PyTorch's `torch.cuda` reports it: what the caching allocator has handed
//! out and holds, their peaks, emptying its cache, and the driver's free and total bytes.
//! Each function takes the device; the CPU has no caching allocator, and asking about it is
//! an error (`live_storage_bytes()` counts the bytes of live tensors on any device).
//!
//! The host has one setting of its own: [`host_memory_limit`], the most bytes one host
//! allocation may request (physical memory plus swap by default), which refuses what the
//! machine could never hold even where the OS would grant it.
//!
//! ```
//! use mantissa::{memory, Device};
//! if let Ok(d) = Device::cuda(0) {
//!     let x = mantissa::Tensor::zeros(&[1024], mantissa::DType::F32, d)?;
//!     assert!(memory::memory_allocated(d)? >= 4096);
//!     println!("{}", memory::memory_stats(d)?);
//! }
//! assert!(memory::memory_allocated(Device::Cpu).is_err());
//! # Ok::<(), mantissa::Error>(())
//! ```

pub use super::caching::MemoryStats;
pub use super::host_limit::{host_memory_limit, set_host_memory_limit};
use crate::{Device, Error, Result};

#[cfg(feature = "cuda-backend")]
use super::cuda::runtime::CudaRuntime as Runtime;

/// A CUDA runtime, which a build without CUDA cannot have.
#[cfg(not(feature = "cuda-backend"))]
enum Runtime {}

#[cfg(not(feature = "cuda-backend"))]
impl Runtime {
    fn memory_stats(&self) -> MemoryStats {
        match *self {}
    }
    fn reset_peak_stats(&self) {
        match *self {}
    }
    fn empty_cache(&self) -> Result<()> {
        match *self {}
    }
    fn mem_get_info(&self) -> Result<(usize, usize)> {
        match *self {}
    }
}

/// Runs `f` on the runtime of `device`; the CPU, or a CUDA device this build or machine
/// cannot use, is an error naming `op` or saying why.
fn with_runtime<R>(
    op: &'static str,
    device: Device,
    f: impl FnOnce(&Runtime) -> Result<R>,
) -> Result<R> {
    match device {
        Device::Cpu => Err(Error::invalid(
            op,
            "the CPU has no caching allocator; live_storage_bytes() counts live tensors' bytes",
        )),
        #[cfg(feature = "cuda-backend")]
        Device::Cuda(n) => f(&*super::cuda::runtime::runtime(n)?),
        #[cfg(not(feature = "cuda-backend"))]
        Device::Cuda(_) => {
            drop(f);
            Err(device.check_available().expect_err("no CUDA in this build"))
        }
    }
}

/// The allocator's byte counts on `device` (`torch.cuda.memory_stats`).
pub fn memory_stats(device: Device) -> Result<MemoryStats> {
    stats("memory_stats", device)
}

/// The byte counts, for an error naming the function asked.
fn stats(op: &'static str, device: Device) -> Result<MemoryStats> {
    with_runtime(op, device, |rt| Ok(rt.memory_stats()))
}

/// Bytes in blocks handed out to tensors and not yet freed (`torch.cuda.memory_allocated`).
pub fn memory_allocated(device: Device) -> Result<usize> {
    Ok(stats("memory_allocated", device)?.allocated)
}

/// The most [`memory_allocated`] has been since the start or the last
/// [`reset_peak_memory_stats`] (`torch.cuda.max_memory_allocated`).
pub fn max_memory_allocated(device: Device) -> Result<usize> {
    Ok(stats("max_memory_allocated", device)?.peak_allocated)
}

/// Bytes the allocator holds from the driver: allocated plus cached
/// (`torch.cuda.memory_reserved`).
pub fn memory_reserved(device: Device) -> Result<usize> {
    Ok(stats("memory_reserved", device)?.reserved)
}

/// The most [`memory_reserved`] has been (`torch.cuda.max_memory_reserved`).
pub fn max_memory_reserved(device: Device) -> Result<usize> {
    Ok(stats("max_memory_reserved", device)?.peak_reserved)
}

/// Starts the peaks again from the current counts (`torch.cuda.reset_peak_memory_stats`).
pub fn reset_peak_memory_stats(device: Device) -> Result<()> {
    with_runtime("reset_peak_memory_stats", device, |rt| {
        rt.reset_peak_stats();
        Ok(())
    })
}

/// Gives the cached blocks back to the driver once the device has finished with them
/// (`torch.cuda.empty_cache`); tensors keep their memory.
pub fn empty_cache(device: Device) -> Result<()> {
    with_runtime("empty_cache", device, |rt| rt.empty_cache())
}

/// The device's free and total bytes as the driver counts them (`torch.cuda.mem_get_info`).
pub fn mem_get_info(device: Device) -> Result<(usize, usize)> {
    with_runtime("mem_get_info", device, |rt| rt.mem_get_info())
}
