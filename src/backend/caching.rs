//! A caching allocator over a raw device allocator (the CUDA backend's `cuMemAlloc`, or a
//! pinned-host pool): freed blocks are kept in size classes per stream and handed out again,
//! so a training step that allocates the same shapes every iteration stops calling the
//! driver after the first. Statistics follow PyTorch's `torch.cuda.memory_*` names.
//!
//! A block is reused only on the stream it was allocated for: work on one stream runs in
//! order, so a block freed there can be handed to that stream's next op at once. A block used
//! on another stream must not be freed before that stream is done with it (the caller's
//! concern, as with PyTorch's `record_stream`).

use crate::profiler::{self, Owner};
use crate::{Device, Error, Result};
use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

/// The raw allocator underneath: allocate and free whole blocks.
pub trait RawMemory {
    /// A block's address.
    type Ptr: Copy + Eq + Hash + std::fmt::Debug;
    /// Allocates `bytes`; an error string says why not (out of memory, driver error).
    fn alloc(&mut self, bytes: usize) -> std::result::Result<Self::Ptr, String>;
    fn free(&mut self, ptr: Self::Ptr);
}

/// Tells whether the work that still uses a freed block has finished (a CUDA event
/// recorded after the last use).
pub trait Fence: Send {
    /// `Ok(true)` once the work is done; an `Err` (a failed event query) says the fence
    /// cannot tell, and the allocator then keeps the block out of use: a copy into it may
    /// still be in flight.
    fn is_done(&self) -> std::result::Result<bool, String>;
}

/// Byte counts of the allocator, as PyTorch reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes in blocks handed out and not yet freed (rounded sizes).
    pub allocated: usize,
    /// Bytes held from the raw allocator: allocated plus cached.
    pub reserved: usize,
    pub peak_allocated: usize,
    pub peak_reserved: usize,
    /// Allocation requests, and how many the cache served.
    pub requests: u64,
    pub cache_hits: u64,
    /// Times the raw allocator failed and the cache was released to retry.
    pub retries: u64,
}

impl std::fmt::Display for MemoryStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        write!(
            f,
            "allocated {:.1} MiB (peak {:.1}), reserved {:.1} MiB (peak {:.1}), cached {:.1} MiB",
            mib(self.allocated),
            mib(self.peak_allocated),
            mib(self.reserved),
            mib(self.peak_reserved),
            mib(self.reserved - self.allocated)
        )
    }
}

/// The size class of a request: 512-byte granularity below 4 KiB, then four classes per
/// power of two, so a reused block wastes at most a quarter of its size.
pub fn size_class(bytes: usize) -> usize {
    let bytes = bytes.max(1);
    if bytes <= 4096 {
        return bytes.div_ceil(512) * 512;
    }
    let step = (bytes.next_power_of_two() / 8).max(512);
    bytes.div_ceil(step) * step
}

/// The caching allocator of one device.
pub struct CachingAllocator<M: RawMemory> {
    raw: M,
    device: Device,
    /// Cached blocks by (stream, size class).
    free: BTreeMap<(u64, usize), Vec<M::Ptr>>,
    /// Live blocks: size class, stream, and the op that allocated it while a profile ran.
    live: HashMap<M::Ptr, (usize, u64, Option<Owner>)>,
    /// Blocks freed while work still used them, with their fences; they count as allocated
    /// until the fence reports done.
    pending: Vec<(M::Ptr, Box<dyn Fence>)>,
    stats: MemoryStats,
    /// Off: every block is exactly the size asked for and goes back to the raw allocator
    /// when freed ([`CachingAllocator::with_caching`]).
    caching: bool,
}

impl<M: RawMemory> CachingAllocator<M> {
    pub fn new(raw: M, device: Device) -> Self {
        CachingAllocator {
            raw,
            device,
            free: BTreeMap::new(),
            live: HashMap::new(),
            pending: Vec::new(),
            stats: MemoryStats::default(),
            caching: true,
        }
    }

    /// With `false`, no caching, as `PYTORCH_NO_CUDA_MEMORY_CACHING=1`: each request gets a
    /// block of exactly its size from the raw allocator and each free gives it back, so that
    /// a tool watching the raw allocations (a sanitizer on the emulated device) sees an
    /// access past a tensor's end. Slow; for debugging.
    pub fn with_caching(mut self, on: bool) -> Self {
        self.caching = on;
        self
    }

    /// A block of at least `bytes` for work on `stream`: a cached one of the same class when
    /// there is one, else a new one; when the raw allocator fails, the cache is released and
    /// the request tried once more before [`Error::OutOfMemory`] (which names the request and
    /// these statistics).
    pub fn alloc(&mut self, bytes: usize, stream: u64) -> Result<(M::Ptr, usize)> {
        let size = match self.caching {
            true => size_class(bytes),
            false => bytes.max(1),
        };
        self.stats.requests += 1;
        if let Err(why) = self.collect_pending() {
            return Err(Error::CudaDriver {
                op: "querying a freed block's fence",
                device: self.device,
                msg: why,
            });
        }
        let cached = self.free.get_mut(&(stream, size)).and_then(|v| v.pop());
        let ptr = match cached {
            Some(p) => {
                self.stats.cache_hits += 1;
                p
            }
            None => {
                let p = match self.raw.alloc(size) {
                    Ok(p) => p,
                    Err(_) => {
                        self.stats.retries += 1;
                        self.empty_cache();
                        self.raw.alloc(size).map_err(|why| Error::OutOfMemory {
                            device: self.device,
                            requested: bytes,
                            stats: format!("{} ({why})", self.stats),
                        })?
                    }
                };
                self.stats.reserved += size;
                self.stats.peak_reserved = self.stats.peak_reserved.max(self.stats.reserved);
                p
            }
        };
        self.stats.allocated += size;
        self.stats.peak_allocated = self.stats.peak_allocated.max(self.stats.allocated);
        let owner = self.profiled().then(|| {
            let st = self.stats;
            profiler::memory_alloc(self.device, size, st.allocated, st.reserved)
        });
        self.live.insert(ptr, (size, stream, owner.flatten()));
        Ok((ptr, size))
    }

    /// Returns a block to the cache of the stream it was allocated for.
    pub fn free(&mut self, ptr: M::Ptr) -> Result<()> {
        if self.pending.iter().any(|(p, _)| *p == ptr) {
            return Err(Error::invalid(
                "CachingAllocator::free",
                format!("{ptr:?} was already freed and waits for its fence"),
            ));
        }
        self.release(ptr)
    }

    fn release(&mut self, ptr: M::Ptr) -> Result<()> {
        let (size, stream, owner) = self.live.remove(&ptr).ok_or_else(|| {
            Error::invalid(
                "CachingAllocator::free",
                format!("{ptr:?} is not a live block of this allocator (double free?)"),
            )
        })?;
        self.stats.allocated -= size;
        if self.caching {
            self.free.entry((stream, size)).or_default().push(ptr);
        } else {
            self.raw.free(ptr);
            self.stats.reserved -= size;
        }
        if self.profiled() {
            let st = self.stats;
            profiler::memory_free(self.device, size, owner, st.allocated, st.reserved);
        }
        Ok(())
    }

    /// Device allocators report to a running profile (a pinned host pool does not).
    fn profiled(&self) -> bool {
        self.device != Device::Cpu && profiler::enabled()
    }

    /// Returns a block to the cache once `fence` reports that the work using it is done;
    /// until then it is not handed out and counts as allocated.
    pub fn free_after(&mut self, ptr: M::Ptr, fence: Box<dyn Fence>) -> Result<()> {
        if !self.live.contains_key(&ptr) {
            return Err(Error::invalid(
                "CachingAllocator::free_after",
                format!("{ptr:?} is not a live block of this allocator (double free?)"),
            ));
        }
        if self.pending.iter().any(|(p, _)| *p == ptr) {
            return Err(Error::invalid(
                "CachingAllocator::free_after",
                format!("{ptr:?} was already freed and waits for its fence"),
            ));
        }
        self.pending.push((ptr, fence));
        Ok(())
    }

    /// Moves the pending blocks whose fences report done into the cache. A fence whose
    /// query fails keeps its block pending (never reused, never freed) and its error is
    /// returned, after the other blocks were looked at.
    fn collect_pending(&mut self) -> std::result::Result<(), String> {
        let (mut k, mut failed) = (0, None);
        while k < self.pending.len() {
            match self.pending[k].1.is_done() {
                Ok(true) => {
                    let (ptr, _) = self.pending.swap_remove(k);
                    self.release(ptr).expect("a pending block is live");
                }
                Ok(false) => k += 1,
                Err(why) => {
                    failed.get_or_insert(why);
                    k += 1;
                }
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// Blocks freed with [`CachingAllocator::free_after`] whose fences have not yet reported
    /// done (after moving those that have into the cache).
    pub fn pending(&mut self) -> usize {
        // A failed fence keeps its block counted here.
        let _ = self.collect_pending();
        self.pending.len()
    }

    /// Gives every cached (free) block back to the raw allocator; pending blocks whose
    /// fences report done go with them, the others stay.
    pub fn empty_cache(&mut self) {
        // A failed fence keeps its block: it is neither cached nor freed.
        let _ = self.collect_pending();
        for ((_, size), ptrs) in std::mem::take(&mut self.free) {
            for p in ptrs {
                self.raw.free(p);
                self.stats.reserved -= size;
            }
        }
    }

    pub fn stats(&self) -> MemoryStats {
        self.stats
    }

    /// Starts the peaks again from the current values.
    pub fn reset_peak_stats(&mut self) {
        self.stats.peak_allocated = self.stats.allocated;
        self.stats.peak_reserved = self.stats.reserved;
    }
}

impl<M: RawMemory> Drop for CachingAllocator<M> {
    fn drop(&mut self) {
        self.empty_cache();
        for (p, _) in std::mem::take(&mut self.live) {
            self.raw.free(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// A raw allocator with a capacity, counting calls.
    #[derive(Clone, Default)]
    struct Fake(Arc<Mutex<(usize, usize, usize, usize)>>); // (capacity, used, next, raw calls)

    impl Fake {
        fn with_capacity(c: usize) -> Fake {
            Fake(Arc::new(Mutex::new((c, 0, 1, 0))))
        }
        fn used(&self) -> usize {
            self.0.lock().unwrap().1
        }
        fn calls(&self) -> usize {
            self.0.lock().unwrap().3
        }
    }

    impl RawMemory for Fake {
        type Ptr = (usize, usize);
        fn alloc(&mut self, bytes: usize) -> std::result::Result<(usize, usize), String> {
            let mut s = self.0.lock().unwrap();
            s.3 += 1;
            if s.1 + bytes > s.0 {
                return Err(format!("only {} bytes free", s.0 - s.1));
            }
            s.1 += bytes;
            s.2 += 1;
            Ok((s.2, bytes))
        }
        fn free(&mut self, p: (usize, usize)) {
            self.0.lock().unwrap().1 -= p.1;
        }
    }

    #[test]
    fn size_classes_waste_at_most_a_quarter() {
        assert_eq!(size_class(1), 512);
        assert_eq!(size_class(4096), 4096);
        for b in [4097usize, 5000, 65_537, 1 << 20, (1 << 20) + 1, 123_456_789] {
            let c = size_class(b);
            assert!(c >= b && (c - b) * 4 <= c, "{b} -> {c}");
        }
    }

    #[test]
    fn blocks_are_reused_per_stream_and_counted() {
        let raw = Fake::with_capacity(1 << 30);
        let mut a = CachingAllocator::new(raw.clone(), Device::Cuda(0));
        let (p, size) = a.alloc(1000, 0).unwrap();
        assert_eq!(size, 1024);
        a.free(p).unwrap();
        let (q, _) = a.alloc(900, 0).unwrap(); // same class: served from the cache
        assert_eq!(q, p);
        assert_eq!(raw.calls(), 1);
        let (r, _) = a.alloc(900, 1).unwrap(); // another stream: a new block
        assert_ne!(r, p);
        let s = a.stats();
        assert_eq!(
            (s.allocated, s.reserved, s.cache_hits, s.requests),
            (2048, 2048, 1, 3)
        );
        a.free(q).unwrap();
        a.free(r).unwrap();
        assert_eq!(a.stats().allocated, 0);
        assert_eq!(a.stats().peak_allocated, 2048);
        a.reset_peak_stats();
        assert_eq!(a.stats().peak_allocated, 0);
        a.empty_cache();
        assert_eq!((a.stats().reserved, raw.used()), (0, 0));
        assert!(a.free(q).is_err(), "double free is an error, not a panic");
    }

    #[test]
    fn without_caching_blocks_are_exact_and_go_straight_back() {
        let raw = Fake::with_capacity(1 << 30);
        let mut a = CachingAllocator::new(raw.clone(), Device::Cuda(0)).with_caching(false);
        let (p, size) = a.alloc(1000, 0).unwrap();
        assert_eq!((size, p.1, raw.used()), (1000, 1000, 1000));
        a.free(p).unwrap();
        assert_eq!(
            (raw.used(), a.stats().reserved, a.stats().allocated),
            (0, 0, 0)
        );
        let (q, _) = a.alloc(1000, 0).unwrap();
        assert_ne!(q, p, "a new raw block, not a cached one");
        assert_eq!((raw.calls(), a.stats().cache_hits), (2, 0));
        // A fenced block goes back once its fence opens.
        let open = Arc::new(Mutex::new(false));
        a.free_after(q, Box::new(Gate(open.clone()))).unwrap();
        assert_eq!(raw.used(), 1000);
        *open.lock().unwrap() = true;
        assert_eq!(a.pending(), 0);
        assert_eq!((raw.used(), a.stats().reserved), (0, 0));
        let (z, size) = a.alloc(0, 0).unwrap();
        assert_eq!((size, z.1), (1, 1), "an empty request still gets a block");
    }

    /// A fence the test opens by hand.
    struct Gate(Arc<Mutex<bool>>);

    impl Fence for Gate {
        fn is_done(&self) -> std::result::Result<bool, String> {
            Ok(*self.0.lock().unwrap())
        }
    }

    /// A fence whose query fails (a broken context).
    struct Broken;

    impl Fence for Broken {
        fn is_done(&self) -> std::result::Result<bool, String> {
            Err("CUDA_ERROR_ILLEGAL_ADDRESS".into())
        }
    }

    #[test]
    fn a_fence_that_cannot_tell_keeps_its_block() {
        let raw = Fake::with_capacity(1 << 30);
        let mut a = CachingAllocator::new(raw.clone(), Device::Cpu);
        let (p, _) = a.alloc(1000, 0).unwrap();
        a.free_after(p, Box::new(Broken)).unwrap();
        let e = a.alloc(1000, 0).unwrap_err().to_string();
        assert!(e.contains("ILLEGAL_ADDRESS"), "{e}");
        a.empty_cache();
        assert_eq!(a.pending(), 1, "the block is neither reused nor freed");
        assert_eq!(raw.used(), 1024);
    }

    #[test]
    fn a_fenced_block_is_reused_only_after_its_fence() {
        let raw = Fake::with_capacity(1 << 30);
        let mut a = CachingAllocator::new(raw.clone(), Device::Cpu);
        let open = Arc::new(Mutex::new(false));
        let (p, _) = a.alloc(1000, 0).unwrap();
        a.free_after(p, Box::new(Gate(open.clone()))).unwrap();
        assert!(a.free(p).is_err(), "a pending block cannot be freed again");
        assert!(a.free_after(p, Box::new(Gate(open.clone()))).is_err());
        assert_eq!(a.pending(), 1);
        assert_eq!(
            a.stats().allocated,
            1024,
            "pending blocks count as allocated"
        );
        let (q, _) = a.alloc(1000, 0).unwrap();
        assert_ne!(q, p, "the fenced block is not handed out before its fence");
        a.empty_cache();
        assert_eq!(
            raw.used(),
            2048,
            "empty_cache keeps a block whose fence is closed"
        );
        *open.lock().unwrap() = true;
        let (r, _) = a.alloc(1000, 0).unwrap();
        assert_eq!(r, p, "once the fence opens the block is reused");
        assert_eq!(a.pending(), 0);
        a.free(q).unwrap();
        a.free_after(r, Box::new(Gate(open))).unwrap();
        a.empty_cache();
        assert_eq!((raw.used(), a.stats().allocated), (0, 0));
    }

    #[test]
    fn out_of_memory_releases_the_cache_then_names_the_request() {
        let raw = Fake::with_capacity(10_000);
        let mut a = CachingAllocator::new(raw.clone(), Device::Cuda(0));
        let (p, _) = a.alloc(6000, 0).unwrap(); // class 6144
        a.free(p).unwrap();
        // 6144 cached + 7168 > 10000: the cache is released and the retry succeeds.
        let (q, _) = a.alloc(7000, 0).unwrap();
        assert_eq!(a.stats().retries, 1);
        assert_eq!(a.stats().reserved, 7168);
        let e = a.alloc(7000, 0).unwrap_err().to_string();
        assert!(
            e.contains("7000 bytes requested") && e.contains("allocated 0.0 MiB"),
            "{e}"
        );
        assert!(e.contains("cuda:0") && e.contains("bytes free"), "{e}");
        a.free(q).unwrap();
        drop(a);
        assert_eq!(raw.used(), 0, "dropping the allocator returns everything");
    }
}
