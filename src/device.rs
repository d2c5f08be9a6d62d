//! Devices a tensor can live on. Whether one can be used is the backend's to say
//! (`Device::check_available` and `Device::supports_bf16` are in `backend/device.rs`).

use crate::{Error, Result};

/// Where a tensor's storage lives.
///
/// `Cuda(n)` names the n-th GPU. Where there is none (no driver library, no device, no
/// NVRTC), placing data there returns [`Error::CudaUnavailable`], whose reason names what is
/// missing. On CUDA, elementwise ops, casts, reductions, softmax, dropout, matrix products
/// (cuBLAS), convolutions (cuDNN), pooling, indexing and optimizer updates have device
/// kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    #[default]
    Cpu,
    Cuda(usize),
}

impl Device {
    /// The n-th CUDA device, or an error saying why it cannot be used.
    ///
    /// ```
    /// use mantissa::Device;
    /// match Device::cuda(0) {
    ///     Ok(d) => println!("using {d}"),
    ///     Err(e) => println!("no GPU: {e}"),
    /// }
    /// ```
    pub fn cuda(n: usize) -> Result<Device> {
        Device::Cuda(n).check_available()
    }

    /// The best device available: `cuda:0` when it can be used, else the CPU.
    ///
    /// ```
    /// use mantissa::Device;
    /// let d = Device::best();
    /// assert!(d == Device::Cpu || d == Device::Cuda(0));
    /// ```
    pub fn best() -> Device {
        Device::Cuda(0).check_available().unwrap_or(Device::Cpu)
    }

    /// Parses `cpu`, `cuda`, `cuda:N` (as PyTorch writes devices).
    pub fn parse(s: &str) -> Result<Device> {
        let s = s.trim();
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Device::Cuda(n)),
                _ => Err(Error::invalid(
                    "Device::parse",
                    format!("unknown device {s:?}; expected cpu, cuda or cuda:N"),
                )),
            },
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}
