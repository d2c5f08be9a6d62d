//! What the backends say about a [`Device`]: whether it can hold tensors, and whether it
//! computes in bf16. (The `Device` type itself is backend-neutral, in `src/device.rs`.)

#[cfg(not(feature = "cuda-backend"))]
use crate::Error;
use crate::{Device, Result};

impl Device {
    /// Returns `self` when the device can hold tensors, an error otherwise.
    pub fn check_available(self) -> Result<Device> {
        match self {
            Device::Cpu => Ok(self),
            #[cfg(feature = "cuda-backend")]
            Device::Cuda(n) => crate::backend::cuda::runtime::runtime(n).map(|_| self),
            #[cfg(not(feature = "cuda-backend"))]
            Device::Cuda(_) => Err(Error::CudaUnavailable {
                device: self,
                reason: "built without the `cuda` feature; use Device::Cpu".into(),
            }),
        }
    }

    /// Whether the device computes in bf16 (autocast falls back to f16 where it does not):
    /// always on the CPU; on CUDA from compute capability 8.0.
    pub fn supports_bf16(self) -> Result<bool> {
        match self {
            Device::Cpu => Ok(true),
            #[cfg(feature = "cuda-backend")]
            Device::Cuda(n) => Ok(crate::backend::cuda::runtime::runtime(n)?.arch() >= 80),
            #[cfg(not(feature = "cuda-backend"))]
            Device::Cuda(_) => self.check_available().map(|_| false),
        }
    }
}
