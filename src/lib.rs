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
pub mod autograd;
pub mod backend;
pub mod checkpoint;
pub mod data;
mod device;
pub mod dtype;
mod error;
pub mod layout;
pub mod nn;
pub mod ops;
pub mod optim;
pub mod random;
mod tensor;
pub mod train;

pub use autograd::{is_grad_enabled, no_grad, NoGradGuard};
pub use device::Device;
pub use dtype::DType;
pub use error::{Error, Result};
pub use ops::{
    AvgPool2dOptions, Conv2dOptions, ConvTranspose2dOptions, CrossEntropyOptions, MaxPool2dOptions,
    Operand, Reduction,
};
pub use random::{manual_seed, Generator};
pub use tensor::{host_reads, live_storage_bytes, Tensor};

/// f16 and bf16 element types, re-exported from `half`.
pub use half::{bf16, f16};

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

#[cfg(test)]
mod tests {
    #[test]
    fn tensors_cross_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<crate::Tensor>();
        assert_send_sync::<crate::Error>();
    }
}
