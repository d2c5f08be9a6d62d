//! Process counters the engine keeps for its users: reads of tensor data into host memory.

thread_local! {
    static HOST_READS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

pub(crate) fn count_host_read() {
    HOST_READS.with(|c| c.set(c.get() + 1));
}

/// How many times this thread has read tensor data back into host memory (`item`, `to_vec`,
/// `to_vec_f64`, `to_le_bytes`, and on a GPU every copy of device data to the host, the
/// engine's own included: indices an op lays out on the host, an op run on a host copy). On a
/// GPU each such read waits for the device, so a training step meant to be free of
/// synchronisation can be checked by comparing the count before and after it (the role of
/// PyTorch's `set_sync_debug_mode`).
///
/// ```
/// use mantissa::{host_reads, Tensor, DType, Device};
/// let x = Tensor::ones(&[3], DType::F32, Device::Cpu)?;
/// let before = host_reads();
/// let y = x.mul(2.0)?.sum_all()?; // no read
/// assert_eq!(host_reads(), before);
/// y.item()?;
/// assert_eq!(host_reads(), before + 1);
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn host_reads() -> u64 {
    HOST_READS.with(|c| c.get())
}
