//! Finding GPUs and describing them: never a panic, an error that says what is missing.

use super::libs::{self, Lib};
use super::nvrtc;
use crate::{Device, Error, Result};
use cudarc::driver::{sys, CudaContext};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// What a CUDA device is and which libraries the backend found for it.
#[derive(Debug, Clone)]
pub struct DeviceReport {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub multiprocessors: i32,
    pub total_memory: usize,
    /// The driver's CUDA version, e.g. 13000 for 13.0.
    pub driver_version: i32,
    /// Versions of the libraries that loaded, or why one did not.
    pub nvrtc: std::result::Result<(i32, i32), String>,
    pub cublaslt: std::result::Result<usize, String>,
    pub cudnn: std::result::Result<usize, String>,
}

impl DeviceReport {
    /// bf16 arithmetic (and TF32 tensor cores) from compute capability 8.0 (Ampere).
    pub fn supports_bf16(&self) -> bool {
        self.compute_capability.0 >= 8
    }
    pub fn supports_tf32(&self) -> bool {
        self.compute_capability.0 >= 8
    }
}

impl std::fmt::Display for DeviceReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (ma, mi) = self.compute_capability;
        let v = |r: &std::result::Result<String, String>| match r {
            Ok(s) => s.clone(),
            Err(e) => format!("not found ({e})"),
        };
        writeln!(
            f,
            "cuda:{} {} | sm_{ma}{mi}, {} SMs, {:.1} GiB | driver CUDA {}.{}",
            self.ordinal,
            self.name,
            self.multiprocessors,
            self.total_memory as f64 / (1u64 << 30) as f64,
            self.driver_version / 1000,
            self.driver_version % 1000 / 10
        )?;
        writeln!(
            f,
            "NVRTC {} | cuBLASLt {} | cuDNN {}",
            v(&self.nvrtc.clone().map(|(a, b)| format!("{a}.{b}"))),
            v(&self.cublaslt.clone().map(|x| x.to_string())),
            v(&self.cudnn.clone().map(|x| x.to_string()))
        )?;
        write!(
            f,
            "bf16 {} | TF32 {}",
            if self.supports_bf16() { "yes" } else { "no" },
            if self.supports_tf32() { "yes" } else { "no" }
        )
    }
}

fn unavailable(device: Device, reason: impl Into<String>) -> Error {
    Error::CudaUnavailable {
        device,
        reason: reason.into(),
    }
}

/// Runs a driver call, turning a panic (a symbol the installed driver lacks) into an error.
fn guarded<T>(device: Device, f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        Err(unavailable(
            device,
            "the CUDA driver library is too old for this build (a call panicked)",
        ))
    })
}

/// The number of CUDA devices; an error when the driver library is missing or fails.
pub fn device_count() -> Result<usize> {
    let d = Device::Cuda(0);
    libs::load(Lib::Driver).map_err(|e| unavailable(d, e.to_string()))?;
    guarded(d, || {
        CudaContext::device_count()
            .map(|n| n.max(0) as usize)
            .map_err(|e| unavailable(d, format!("cuInit / cuDeviceGetCount failed: {e}")))
    })
}

/// Describes device `n` (creating its primary context).
pub fn report(n: usize) -> Result<DeviceReport> {
    let d = Device::Cuda(n);
    let count = device_count().map_err(|e| match e {
        Error::CudaUnavailable { reason, .. } => unavailable(d, reason),
        e => e,
    })?;
    if n >= count {
        return Err(unavailable(d, format!("{count} CUDA device(s) found")));
    }
    guarded(d, || {
        let err =
            |what: &str, e: cudarc::driver::DriverError| unavailable(d, format!("{what}: {e}"));
        let ctx = CudaContext::new(n).map_err(|e| err("creating the context", e))?;
        let mut driver_version = 0;
        // SAFETY: a valid out-pointer; the driver is initialised by the context above.
        unsafe { sys::cuDriverGetVersion(&mut driver_version) }
            .result()
            .map_err(|e| err("cuDriverGetVersion", e))?;
        let sms = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
        Ok(DeviceReport {
            ordinal: n,
            name: ctx.name().map_err(|e| err("device name", e))?,
            compute_capability: ctx
                .compute_capability()
                .map_err(|e| err("compute capability", e))?,
            multiprocessors: ctx.attribute(sms).map_err(|e| err("SM count", e))?,
            total_memory: ctx.total_mem().map_err(|e| err("memory size", e))?,
            driver_version,
            nvrtc: nvrtc::version().map_err(|e| e.to_string()),
            cublaslt: libs::load(Lib::CublasLt)
                .map_err(|e| e.to_string())
                // SAFETY: the library is loaded; the call has no arguments.
                .map(|_| unsafe { cudarc::cublaslt::sys::cublasLtGetVersion() }),
            cudnn: libs::load(Lib::Cudnn)
                .map_err(|e| e.to_string())
                .map(|_| cudarc::cudnn::result::get_version()),
        })
    })
}
