//! The CUDA backend (feature `cuda`), in progress: library discovery, device probing and
//! report, the NVRTC kernel compiler with its disk cache, and a per-device runtime (context,
//! stream, loaded kernels, caching allocator). Storage, GEMM and convolution come next; until
//! then `Device::Cuda` stays unavailable.

pub mod kernels;
pub mod libs;
pub mod nvrtc;
pub mod probe;
pub mod runtime;
