//! The CUDA backend (feature `cuda`), in progress: library discovery, device probing and
//! report, and the NVRTC kernel compiler with its disk cache. Storage, allocator, GEMM and
//! convolution come next; until then `Device::Cuda` stays unavailable.

pub mod kernels;
pub mod libs;
pub mod nvrtc;
pub mod probe;
