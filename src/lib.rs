//! # mantissa
//!
//! A tensor and reverse-mode autograd engine for mixed-precision training. Tensors have
//! shapes, strides and views; dtypes f32, f16, bf16, f64, i64 (indices) and u8 (masks); every
//! operation returns [`Result`]. The CPU backend is first-class: half dtypes store half values
//! and compute in f32, rounding on store, as tensor cores do.
//!
//! ```
//! use mantissa::{Tensor, DType, Device};
//! let w = Tensor::randn(&[3, 2], DType::F32, Device::Cpu)?.requires_grad(true)?;
//! let x = Tensor::ones(&[4, 3], DType::F32, Device::Cpu)?;
//! let loss = x.matmul(&w)?.relu()?.sum_all()?;
//! loss.backward()?;
//! assert_eq!(w.grad().unwrap().shape(), &[3, 2]);
//! # Ok::<(), mantissa::Error>(())
//! ```

pub mod amp;
mod autocast_state;
// Read by the CUDA backend's launchers and graphs; without it only the ops' side is built.
pub mod autograd;
pub mod backend;
#[cfg_attr(not(feature = "cuda-backend"), allow(dead_code))]
mod capture;
pub mod checkpoint;
mod counters;
pub mod data;
mod device;
pub mod distributed;
pub mod dtype;
mod error;
mod frames;
mod fs;
mod grad_mode;
pub mod graph;
pub mod layout;
mod memory_format;
pub mod nn;
pub mod ops;
pub mod optim;
mod parallel;
pub mod profiler;
pub mod random;
mod scope;
mod sync;
mod tensor;
pub mod train;

pub use backend::memory;
pub use counters::host_reads;
pub use device::Device;
pub use dtype::DType;
pub use error::{Error, Result};
pub use grad_mode::{is_grad_enabled, no_grad, NoGradGuard};
pub use memory_format::MemoryFormat;
pub use ops::{
    attention_kernel, cudnn_attention, gemm_epilogues, set_attention_kernel, set_cudnn_attention,
    set_gemm_epilogues, AttentionKernel, AttentionOptions, AvgPool2dOptions, Conv1dOptions,
    Conv2dOptions, ConvTranspose2dOptions, CrossEntropyOptions, MaxPool2dOptions, Operand,
    Reduction,
};
pub use random::{manual_seed, Generator};
pub use tensor::{live_storage_bytes, Tensor};

/// f16 and bf16 element types, re-exported from `half`.
pub use half::{bf16, f16};

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

/// Runs `f` on a thread of the compute pool (rayon's global pool) and returns its result.
///
/// CPU kernels split large ops across the pool's threads. Called from an outside thread, each
/// such op hands its work to the pool and sleeps until it is done, a round trip through the
/// scheduler per op; run from inside the pool, the calling thread does its share and the
/// others steal the rest. A training loop run this way is about 10% faster on a small MLP
/// with 2 cores (`examples/mnist` does it).
///
/// ```
/// let sum = mantissa::in_compute_pool(|| {
///     let x = mantissa::Tensor::ones(&[1000], mantissa::DType::F32, mantissa::Device::Cpu)?;
///     x.sum_all()?.item()
/// })?;
/// assert_eq!(sum, 1000.0);
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn in_compute_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    // `f` runs under the caller's grad mode and autocast on whichever thread picks it up.
    let (grad, low) = (is_grad_enabled(), amp::active_dtype());
    rayon::scope(|_| {
        let _grad = (!grad).then(NoGradGuard::new);
        let _autocast = low.and_then(|d| amp::autocast(d).ok());
        f()
    })
}

/// Asks the C allocator to keep freed memory for reuse instead of returning it to the
/// system: large tensors are then served from already-mapped pages, without the page faults
/// and zeroing a fresh mapping costs on every step (about 10% of a small CNN's CPU training
/// step). It changes the whole process's allocator (glibc `mallopt`: buffers up to 32 MiB
/// from the heap, no trimming), so it is for training binaries to call at start, not for
/// libraries; it does nothing on other C libraries. Returns whether the settings took.
pub fn retain_freed_host_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes allocator tunables; any value is accepted or refused.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX) == 1
                && libc::mallopt(libc::M_TOP_PAD, 64 << 20) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn tensors_cross_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<crate::Tensor>();
        assert_send_sync::<crate::Error>();
    }
}
