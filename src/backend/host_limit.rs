//! The most bytes one host allocation may ask for. A request past it is refused with
//! [`crate::Error::OutOfMemory`] before any memory is touched.
//!
//! The engine must not rely on the operating system to refuse an allocation the machine can
//! never hold: a host that overcommits memory (Linux `vm.overcommit_memory = 1`, usual on GPU
//! machines) grants a request of terabytes, and the kernel that fills it then runs for hours
//! or is killed. The default limit is the machine's physical memory plus its swap, read once;
//! `MANTISSA_HOST_MEMORY_LIMIT` (bytes) replaces it at start-up, and
//! [`set_host_memory_limit`] at run time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// The limit set at run time; `usize::MAX` when none was (the default then applies).
static SET: AtomicUsize = AtomicUsize::new(usize::MAX);

/// The limit when none was set: `MANTISSA_HOST_MEMORY_LIMIT`, else physical memory plus
/// swap, else no limit (a system that says neither).
fn default_limit() -> usize {
    static DEFAULT: OnceLock<usize> = OnceLock::new();
    *DEFAULT.get_or_init(|| {
        std::env::var("MANTISSA_HOST_MEMORY_LIMIT")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .or_else(machine_bytes)
            .unwrap_or(usize::MAX)
    })
}

/// Physical memory plus swap, from `/proc/meminfo` (`MemTotal` + `SwapTotal`, in KiB).
fn machine_bytes() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = |key: &str| -> Option<usize> {
        let line = text.lines().find(|l| l.starts_with(key))?;
        line[key.len()..].split_whitespace().next()?.parse().ok()
    };
    let total = kib("MemTotal:")?.checked_add(kib("SwapTotal:").unwrap_or(0))?;
    total.checked_mul(1024)
}

/// The most bytes one host allocation of the engine may request: what
/// [`set_host_memory_limit`] set, else `MANTISSA_HOST_MEMORY_LIMIT`, else the machine's
/// physical memory plus swap.
///
/// ```
/// let limit = mantissa::memory::host_memory_limit();
/// assert!(limit > 0);
/// ```
pub fn host_memory_limit() -> usize {
    match SET.load(Ordering::Relaxed) {
        usize::MAX => default_limit(),
        n => n,
    }
}

/// Sets the most bytes one host allocation may request (process-wide); `None` goes back to
/// the default ([`host_memory_limit`]). A lower limit makes oversized requests fail fast, as
/// a test or a service sharing its machine may want; a higher one lets the engine ask for
/// more than the machine holds, where the system can back it some other way.
///
/// ```
/// use mantissa::{memory, DType, Device, Error, Tensor};
/// memory::set_host_memory_limit(Some(1 << 20));
/// let big = Tensor::ones(&[1], DType::F32, Device::Cpu)?.expand(&[1 << 20])?;
/// assert!(matches!(big.exp(), Err(Error::OutOfMemory { .. })));
/// memory::set_host_memory_limit(None);
/// assert!(big.exp().is_ok());
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn set_host_memory_limit(bytes: Option<usize>) {
    // usize::MAX itself means "no limit set"; as a limit it refuses nothing either way.
    SET.store(bytes.unwrap_or(usize::MAX), Ordering::Relaxed);
}

/// `Ok` when a host request of `bytes` is within the limit; otherwise the error naming the
/// request and the limit.
pub(crate) fn check(bytes: usize) -> crate::Result<()> {
    let limit = host_memory_limit();
    if bytes <= limit {
        return Ok(());
    }
    Err(crate::Error::OutOfMemory {
        device: crate::Device::Cpu,
        requested: bytes,
        stats: format!(
            "one host allocation may take at most {limit} bytes (physical memory plus swap, \
             or MANTISSA_HOST_MEMORY_LIMIT / memory::set_host_memory_limit)"
        ),
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_machine_reports_its_memory() {
        // Linux always has /proc/meminfo; elsewhere there is no default limit to read.
        if cfg!(target_os = "linux") {
            let bytes = super::machine_bytes().expect("MemTotal in /proc/meminfo");
            assert!(bytes >= 64 << 20, "{bytes} bytes");
        }
    }
}
