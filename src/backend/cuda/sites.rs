//! The launch path's kernel handles: each `launch!` site keeps the kernels it has launched,
//! by device and name, so that a launch finds its function with a few compares and no lock,
//! map or formatted string ([`Site`]); only a site's first launch of a kernel on a device
//! asks the runtime ([`CudaRuntime::function`]: its map, and the module load on first use),
//! which [`kernel_lookups`] counts. Kernel names are `&'static str`s made by `kname!`
//! (`mod.rs`) from the literal dtype suffixes; a name outside them is interned once.

use super::kernels::KernelFile;
use super::runtime::CudaRuntime;
use crate::sync::lock;
use crate::Result;
use cudarc::driver::CudaFunction;
use std::cell::Cell;
use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// Kernels one site keeps (a site launches a kernel per dtype at most, on each device);
/// past them it asks the runtime each time.
const SLOTS: usize = 16;

/// The kernels one launch site has looked up: (device ordinal, the name's address, function).
pub(crate) struct Site {
    slots: [OnceLock<(usize, usize, CudaFunction)>; SLOTS],
    next: AtomicUsize,
}

thread_local! {
    /// This thread's lookups through the runtime so far.
    static LOOKUPS: Cell<u64> = const { Cell::new(0) };
}

/// How many launches on this thread so far had to look their kernel up through the runtime
/// (a map under a lock, and the module load on first use): each launch site's first launch
/// of each kernel on each device. Later launches find theirs at the site.
///
/// ```
/// # #[cfg(feature = "cuda-backend")]
/// let _first_launches = mantissa::backend::cuda::sites::kernel_lookups();
/// ```
pub fn kernel_lookups() -> u64 {
    LOOKUPS.with(Cell::get)
}

impl Site {
    pub(crate) const fn new() -> Site {
        Site {
            slots: [const { OnceLock::new() }; SLOTS],
            next: AtomicUsize::new(0),
        }
    }

    /// Kernel `name` of `file` on `rt`'s device.
    pub(crate) fn function(
        &self,
        rt: &CudaRuntime,
        file: KernelFile,
        name: &'static str,
    ) -> Result<CudaFunction> {
        let ordinal = match rt.device() {
            crate::Device::Cuda(n) => n,
            crate::Device::Cpu => usize::MAX,
        };
        let key = (ordinal, name.as_ptr() as usize);
        for slot in &self.slots {
            match slot.get() {
                Some((d, n, f)) if (*d, *n) == key => return Ok(f.clone()),
                Some(_) => {}
                // Slots fill in order (one being filled by another thread ends the scan
                // early: the runtime then answers, as for a first launch).
                None => break,
            }
        }
        LOOKUPS.with(|n| n.set(n.get() + 1));
        rt.context()
            .bind_to_thread()
            .map_err(|e| rt.driver("binding the context", e))?;
        let f = rt.function(file.name(), name)?;
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        if let Some(slot) = self.slots.get(i) {
            let _ = slot.set((key.0, key.1, f.clone()));
        }
        Ok(f)
    }
}

/// `name` as a `&'static str`, the same one for equal names: for kernel names `kname!` does
/// not spell from literals (made once each; kernel names are finitely many).
pub(crate) fn intern(name: String) -> &'static str {
    static NAMES: OnceLock<Mutex<HashSet<&'static str>>> = OnceLock::new();
    let mut names = lock(NAMES.get_or_init(Default::default));
    if let Some(n) = names.get(name.as_str()) {
        return n;
    }
    let n: &'static str = Box::leak(name.into_boxed_str());
    names.insert(n);
    n
}
