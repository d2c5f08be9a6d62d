//! Faults that kernels find in their input (a class index out of range) without stopping the
//! stream: a launch that can find one gets a slot number and its own word of a device array;
//! the kernel writes the slot number into that word (`atomicCAS` from 0), and the next read
//! of device data into host memory reports it as an `Err` naming that launch. This is how
//! CUDA reports device-side errors (at the next synchronisation), minus the poisoned context,
//! and it keeps such ops free of a host read per step.
//!
//! The array is the device's, shared by every thread that queues work on it; a fault is told
//! to the thread that queued the launch: when another thread's read finds it, it is kept and
//! that thread's next read reports it (the first fault of each thread between its reads).

use crate::{Device, Error, Result};
use cudarc::driver::{result, sys, CudaContext, CudaStream};
use std::collections::HashMap;
use std::sync::Arc;
use std::thread::{self, ThreadId};

/// Checked launches kept before a check is forced (a read of the words, a synchronisation);
/// the device array holds this many 4-byte words.
const MAX_PENDING: usize = 4096;

/// The flag words and what each slot number stands for.
#[derive(Default)]
pub(crate) struct Faults {
    /// `MAX_PENDING` words of device memory straight from the driver (outside the caching
    /// allocator, so its statistics are the user's memory alone), allocated at the first
    /// checked launch; slot `i + 1` writes word `i`.
    words: Option<sys::CUdeviceptr>,
    /// Slot `i + 1`'s op, message and the thread that queued the launch.
    pending: Vec<Pending>,
    /// Faults found by one thread's check in another thread's launch, kept for that thread.
    found: HashMap<ThreadId, Error>,
    /// While a step is captured: the graph's own words and slots (see [`GraphFaults`]).
    capture: Option<GraphFaults>,
}

/// The fault words of a CUDA graph's checked launches: a replay writes them, never the
/// device's shared array, whose slots are handed to other launches meanwhile. The runtime
/// reads them at each synchronisation after a replay.
pub(crate) struct GraphFaults {
    words: sys::CUdeviceptr,
    pending: Vec<Pending>,
    ctx: Arc<CudaContext>,
}

impl GraphFaults {
    /// Reads and clears the words after a replay (the stream must be synchronised); `Err`
    /// for the first fault, naming the op and that it ran in a graph.
    pub(crate) fn check(&self, stream: &Arc<CudaStream>, device: Device) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let driver = |e: cudarc::driver::DriverError| Error::CudaDriver {
            op: "reading a graph's fault flags",
            device,
            msg: e.to_string(),
        };
        let mut v = vec![0i32; self.pending.len()];
        // SAFETY: `words` holds MAX_PENDING >= v.len() words; copy, reset and the
        // synchronisation are ordered on the stream before `v` is read.
        unsafe {
            result::memcpy_dtoh_async(&mut v, self.words, stream.cu_stream()).map_err(driver)?;
            result::memset_d8_async(self.words, 0, 4 * v.len(), stream.cu_stream())
                .map_err(driver)?;
        }
        stream.synchronize().map_err(driver)?;
        match v.iter().position(|&c| c != 0) {
            None => Ok(()),
            Some(i) => {
                let p = &self.pending[i];
                let msg = format!(
                    "{} on {device} (found by the kernel in a CUDA graph's replay, reported \
                     at this read)",
                    p.msg
                );
                Err(Error::invalid(p.op, msg))
            }
        }
    }
}

impl Drop for GraphFaults {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `words` came from `malloc_sync` in `begin_capture` and is freed once;
            // the synchronous free waits for any replay still writing it.
            let _ = unsafe { result::free_sync(self.words) };
        }
    }
}

struct Pending {
    op: &'static str,
    msg: String,
    thread: ThreadId,
}

impl Faults {
    /// A slot for a launch that may find a fault (`op` and `msg` say what it would mean): the
    /// word to pass the kernel and the number it writes there. The words are zeroed on the
    /// stream when first allocated and after each check; the launch must be queued before
    /// the next check (`CudaRuntime::checked_launch` holds the lock across both).
    pub(crate) fn slot(
        &mut self,
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        device: Device,
        op: &'static str,
        msg: String,
    ) -> Result<(sys::CUdeviceptr, i32)> {
        if let Some(c) = self.capture.as_mut() {
            if c.pending.len() >= MAX_PENDING {
                return Err(Error::NotCapturable {
                    op: op.to_string(),
                    device,
                    why: format!("more than {MAX_PENDING} checked launches in one step"),
                });
            }
            c.pending.push(Pending {
                op,
                msg,
                thread: thread::current().id(),
            });
            return Ok((
                c.words + 4 * (c.pending.len() as u64 - 1),
                c.pending.len() as i32,
            ));
        }
        if self.pending.len() >= MAX_PENDING {
            self.check(stream, device)?;
        }
        let words = match self.words {
            Some(w) => w,
            None => {
                let driver = |e: cudarc::driver::DriverError| Error::CudaDriver {
                    op: "allocating the fault flags",
                    device,
                    msg: e.to_string(),
                };
                let bytes = 4 * MAX_PENDING;
                ctx.bind_to_thread().map_err(driver)?;
                // SAFETY: the context is current; the words live as long as the runtime
                // (runtimes are never dropped) and are zeroed on the stream before any use.
                let w = unsafe { result::malloc_sync(bytes) }.map_err(driver)?;
                unsafe { result::memset_d8_async(w, 0, bytes, stream.cu_stream()) }
                    .map_err(driver)?;
                self.words = Some(w);
                w
            }
        };
        let word = words + 4 * self.pending.len() as u64;
        self.pending.push(Pending {
            op,
            msg,
            thread: thread::current().id(),
        });
        Ok((word, self.pending.len() as i32))
    }

    /// Diverts the slots to words of a graph's own, zeroed, until [`Faults::end_capture`]:
    /// called before the capture begins (it allocates).
    pub(crate) fn begin_capture(
        &mut self,
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        device: Device,
    ) -> Result<()> {
        let driver = |e: cudarc::driver::DriverError| Error::CudaDriver {
            op: "allocating a graph's fault flags",
            device,
            msg: e.to_string(),
        };
        let bytes = 4 * MAX_PENDING;
        ctx.bind_to_thread().map_err(driver)?;
        // SAFETY: the context is current; `GraphFaults` frees the words once, on drop.
        let words = unsafe { result::malloc_sync(bytes) }.map_err(driver)?;
        let faults = GraphFaults {
            words,
            pending: Vec::new(),
            ctx: ctx.clone(),
        };
        // SAFETY: `words` holds `bytes` bytes; zeroed on the stream before the graph runs.
        unsafe { result::memset_d8_async(words, 0, bytes, stream.cu_stream()) }.map_err(driver)?;
        self.capture = Some(faults);
        Ok(())
    }

    /// The graph's words and slots, back to the shared array for later launches.
    pub(crate) fn end_capture(&mut self) -> Option<GraphFaults> {
        self.capture.take()
    }

    /// Takes back the last slot given, whose launch failed (the kernel never ran).
    pub(crate) fn unslot(&mut self, slot: i32) {
        if let Some(c) = self.capture.as_mut() {
            if usize::try_from(slot) == Ok(c.pending.len()) {
                c.pending.pop();
            }
            return;
        }
        if usize::try_from(slot) == Ok(self.pending.len()) {
            self.pending.pop();
        }
    }

    /// Reads the words of the launches checked since the last check (the stream must be
    /// synchronised, as after a copy to the host) and clears them; `Err` for the first fault
    /// found in a launch this thread queued, now or by another thread's check before.
    pub(crate) fn check(&mut self, stream: &Arc<CudaStream>, device: Device) -> Result<()> {
        let me = thread::current().id();
        if let Some(e) = self.found.remove(&me) {
            return Err(e);
        }
        let Some(words) = self.words.filter(|_| !self.pending.is_empty()) else {
            return Ok(());
        };
        let driver = |e: cudarc::driver::DriverError| Error::CudaDriver {
            op: "reading the fault flags",
            device,
            msg: e.to_string(),
        };
        let mut v = vec![0i32; self.pending.len()];
        // SAFETY: `words` holds MAX_PENDING >= v.len() words; the copy and the reset are
        // ordered on the stream and the synchronisation ends both before `v` is read.
        unsafe {
            result::memcpy_dtoh_async(&mut v, words, stream.cu_stream()).map_err(driver)?;
            result::memset_d8_async(words, 0, 4 * v.len(), stream.cu_stream()).map_err(driver)?;
        }
        stream.synchronize().map_err(driver)?;
        let pending = std::mem::take(&mut self.pending);
        for (i, (&code, p)) in v.iter().zip(&pending).enumerate() {
            if code == 0 {
                continue;
            }
            let e = if code as usize == i + 1 {
                let msg = format!(
                    "{} on {device} (found by the kernel, reported at this read)",
                    p.msg
                );
                Error::invalid(p.op, msg)
            } else {
                let msg = format!(
                    "unknown fault code {code} in the word of slot {} on {device}",
                    i + 1
                );
                Error::invalid("device fault", msg)
            };
            self.found.entry(p.thread).or_insert(e);
        }
        match self.found.remove(&me) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
