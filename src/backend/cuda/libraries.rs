//! A device runtime's library handles (`runtime.rs` holds them): cuBLAS on the compute
//! stream with a workspace of its own, cuBLASLt sharing that workspace, and cuDNN on the
//! compute stream, each created at its first use and never inside a stream capture.
//!
//! cuBLAS without a workspace set by `cublasSetWorkspace_v2` allocates one itself, and inside
//! a capture that becomes a memory node outside the caching allocator (possibly out of memory
//! at replay) and may choose other kernels than the eager steps did. So, as PyTorch does,
//! each handle gets a workspace from the caching allocator's general pool for its life:
//! 32 MiB on sm_90 and later, 4 MiB before, which cuBLASLt's products are offered too.

use super::handles::{DnnHandle, LtHandle};
use super::libs::{self, Lib};
use super::runtime::CudaRuntime;
use crate::sync::lock;
use crate::{Error, Result};
use cudarc::cublas::{sys as bs, CudaBlas};
use cudarc::driver::sys;

/// The cuBLAS (and cuBLASLt) workspace for a device of architecture `arch` (`sm_XY` as XY).
pub(crate) fn workspace_bytes(arch: u32) -> usize {
    match arch {
        90.. => 32 << 20,
        _ => 4 << 20,
    }
}

/// The smallest workspace tried when the device is short of memory.
const MIN_WORKSPACE: usize = 64 << 10;

impl CudaRuntime {
    /// Makes this device's context current on the calling thread, as a library call needs.
    fn bind(&self) -> Result<()> {
        self.context()
            .bind_to_thread()
            .map_err(|e| self.driver("binding the context", e))
    }

    /// The workspace cuBLAS and cuBLASLt share, allocated once (the first of their handles):
    /// [`workspace_bytes`], at most a 64th of the device's memory (a small device, such as
    /// the emulated one of a test, keeps room for its tensors), or the largest power-of-two
    /// fraction of that the device can hold, down to 64 KiB (`None` below: the libraries
    /// then allocate their own, outside captures only).
    pub(crate) fn blas_workspace(&self) -> Option<(sys::CUdeviceptr, usize)> {
        let mut ws = lock(&self.blas_workspace);
        if ws.is_none() && !self.capturing() {
            let total = self.mem_get_info().map_or(usize::MAX, |(_, total)| total);
            let cap = (total / 64).max(MIN_WORKSPACE);
            let mut bytes = workspace_bytes(self.arch());
            while bytes > cap {
                bytes /= 2;
            }
            while bytes >= MIN_WORKSPACE {
                if let Ok((ptr, _)) = self.alloc(bytes) {
                    *ws = Some((ptr, bytes));
                    break;
                }
                bytes /= 2;
            }
            if ws.is_none() {
                log::warn!(
                    "{}: no memory for a cuBLAS workspace of {} MiB or less; cuBLAS \
                     allocates its own",
                    self.device(),
                    workspace_bytes(self.arch()) >> 20
                );
            }
        }
        *ws
    }

    /// Runs `f` with this device's cuBLAS handle (bound to the compute stream, with the
    /// runtime's workspace; calls are serialised, as a handle is not safe to share between
    /// threads). Creating it inside a capture is refused ([`Error::NotCapturable`]).
    pub fn with_blas<R>(&self, f: impl FnOnce(bs::cublasHandle_t) -> R) -> Result<R> {
        let mut blas = lock(&self.blas);
        if blas.is_none() {
            self.refuse_in_capture(
                "creating the cuBLAS handle at the first product",
                "cublasCreate allocates device memory, which a capture does not allow; the \
                 step's eager warm-up calls create it",
            )?;
            // Found first where the loader path lacks it (cudarc opens it by name only).
            libs::load(Lib::CublasLt)?;
            libs::load(Lib::Cublas)?;
            let handle = CudaBlas::new(self.stream().clone()).map_err(|e| Error::CudaLibrary {
                lib: "cuBLAS",
                msg: format!("creating a handle on {}: {e:?}", self.device()),
            })?;
            if let Some((ptr, bytes)) = self.blas_workspace() {
                // SAFETY: the handle is live; the block holds `bytes` bytes of this device
                // and stays allocated for the runtime's life (never freed), which outlives
                // the handle.
                let status =
                    unsafe { bs::cublasSetWorkspace_v2(*handle.handle(), ptr as *mut _, bytes) };
                if status != bs::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                    return Err(Error::CudaLibrary {
                        lib: "cuBLAS",
                        msg: format!(
                            "setting a workspace of {bytes} bytes on {}: {status:?}",
                            self.device()
                        ),
                    });
                }
            }
            *blas = Some(handle);
        }
        self.bind()?;
        Ok(f(*blas.as_ref().expect("set above").handle()))
    }

    /// Runs `f` with this device's cuBLASLt handle (calls are serialised; each names the
    /// stream and the workspace itself). Errors, naming the library and how to install it,
    /// when it is missing; creating it inside a capture is refused.
    pub(crate) fn with_blas_lt<R>(
        &self,
        f: impl FnOnce(cudarc::cublaslt::sys::cublasLtHandle_t) -> R,
    ) -> Result<R> {
        let mut lt = lock(&self.lt);
        self.bind()?;
        if lt.is_none() {
            self.refuse_in_capture(
                "creating the cuBLASLt handle at the first product with an epilogue",
                "the step's eager warm-up calls create it",
            )?;
            *lt = Some(LtHandle::new(self.device())?);
        }
        Ok(f(lt.as_ref().expect("set above").0))
    }

    /// Runs `f` with this device's cuDNN handle (bound to the compute stream; calls are
    /// serialised). Errors, naming the library and how to install it, when cuDNN is missing;
    /// creating it inside a capture is refused.
    pub fn with_cudnn<R>(
        &self,
        f: impl FnOnce(cudarc::cudnn::sys::cudnnHandle_t) -> R,
    ) -> Result<R> {
        let mut dnn = lock(&self.dnn);
        self.bind()?;
        if dnn.is_none() {
            self.refuse_in_capture(
                "creating the cuDNN handle at the first convolution",
                "cudnnCreate allocates device memory, which a capture does not allow; the \
                 step's eager warm-up calls create it",
            )?;
            libs::load(Lib::Cudnn)?;
            let err = |what: &str, e: cudarc::cudnn::result::CudnnError| Error::CudaLibrary {
                lib: "cuDNN",
                msg: format!("{what} on {}: {e:?}", self.device()),
            };
            let h =
                cudarc::cudnn::result::create_handle().map_err(|e| err("creating a handle", e))?;
            let h = DnnHandle(h);
            // SAFETY: the handle was just created; the stream lives as long as this runtime.
            unsafe { cudarc::cudnn::result::set_stream(h.0, self.stream().cu_stream() as _) }
                .map_err(|e| err("setting the stream", e))?;
            *dnn = Some(h);
        }
        Ok(f(dnn.as_ref().expect("set above").0))
    }
}
