//! The CUDA backend (feature `cuda`), in progress and not yet run on a GPU: library
//! discovery, device probing and report, the NVRTC kernel compiler with its disk cache, a
//! per-device runtime (context, stream, loaded kernels, caching allocator, cuBLAS handle),
//! device storage with transfers and casts, and kernels for elementwise ops, reductions,
//! softmax, dropout and cuBLAS products. The other ops (convolution, pooling, indexing,
//! optimizer updates) run on a host copy of their inputs until they get kernels.

pub mod conv;
pub mod kernels;
pub mod libs;
pub mod nvrtc;
pub mod ops;
pub mod probe;
pub mod runtime;
pub mod storage;
