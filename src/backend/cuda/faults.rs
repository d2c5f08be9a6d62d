//! Faults that kernels find in their input (a class index out of range) without stopping the
//! stream: a kernel that can find one gets a slot number and a device flag; the first launch
//! that finds one writes its number into the flag (`atomicCAS` from 0), and the next read of
//! device data into host memory reports it as an `Err` naming that launch. This is how CUDA
//! reports device-side errors (at the next synchronisation), minus the poisoned context, and
//! it keeps such ops free of a host read per step.
//!
//! Unverified: written with no GPU lent; not yet run on a GPU.

use crate::{Device, Error, Result};
use cudarc::driver::{result, sys, CudaContext, CudaStream};
use std::sync::Arc;

/// Checked launches kept before a check is forced (a read of 4 bytes, a synchronisation).
const MAX_PENDING: usize = 4096;

/// The flag and what each slot number stands for.
#[derive(Default)]
pub(crate) struct Faults {
    /// 4 bytes of device memory straight from the driver (outside the caching allocator, so
    /// its statistics are the user's memory alone), allocated at the first checked launch.
    flag: Option<sys::CUdeviceptr>,
    /// Slot `i + 1`'s op and message.
    pending: Vec<(&'static str, String)>,
}

impl Faults {
    /// A slot for a launch that may find a fault (`op` and `msg` say what it would mean),
    /// and the flag to pass it; the flag is zeroed on the stream when first allocated.
    pub(crate) fn slot(
        &mut self,
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        device: Device,
        op: &'static str,
        msg: String,
    ) -> Result<(sys::CUdeviceptr, i32)> {
        if self.pending.len() >= MAX_PENDING {
            self.check(stream, device)?;
        }
        let flag = match self.flag {
            Some(f) => f,
            None => {
                let driver = |e: cudarc::driver::DriverError| Error::CudaDriver {
                    op: "allocating the fault flag",
                    device,
                    msg: e.to_string(),
                };
                ctx.bind_to_thread().map_err(driver)?;
                // SAFETY: the context is current; the 4 bytes live as long as the runtime
                // (runtimes are never dropped) and are zeroed on the stream before any use.
                let f = unsafe { result::malloc_sync(4) }.map_err(driver)?;
                unsafe { result::memset_d8_async(f, 0, 4, stream.cu_stream()) }.map_err(driver)?;
                self.flag = Some(f);
                f
            }
        };
        self.pending.push((op, msg));
        Ok((flag, self.pending.len() as i32))
    }

    /// Reads the flag when a checked launch ran since the last check (the stream must be
    /// synchronised, as after a copy to the host) and clears it; `Err` for the fault found.
    pub(crate) fn check(&mut self, stream: &Arc<CudaStream>, device: Device) -> Result<()> {
        let Some(flag) = self.flag.filter(|_| !self.pending.is_empty()) else {
            return Ok(());
        };
        let driver = |e: cudarc::driver::DriverError| Error::CudaDriver {
            op: "reading the fault flag",
            device,
            msg: e.to_string(),
        };
        let mut v = [0i32; 1];
        // SAFETY: `flag` holds 4 bytes; the copy and the reset are ordered on the stream and
        // the synchronisation ends both before `v` is read.
        unsafe {
            result::memcpy_dtoh_async(&mut v, flag, stream.cu_stream()).map_err(driver)?;
            result::memset_d8_async(flag, 0, 4, stream.cu_stream()).map_err(driver)?;
        }
        stream.synchronize().map_err(driver)?;
        let pending = std::mem::take(&mut self.pending);
        match usize::try_from(v[0])
            .ok()
            .and_then(|i| pending.get(i.wrapping_sub(1)))
        {
            None if v[0] == 0 => Ok(()),
            None => Err(Error::invalid(
                "device fault",
                format!("unknown fault code {} on {device}", v[0]),
            )),
            Some((op, msg)) => Err(Error::invalid(
                op,
                format!("{msg} on {device} (found by the kernel, reported at this read)"),
            )),
        }
    }
}
