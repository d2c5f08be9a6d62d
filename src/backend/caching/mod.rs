//! A caching allocator over a raw device allocator (the CUDA backend's `cuMemAlloc`, or a
//! pinned-host pool), laid out as PyTorch's: the raw allocator hands out segments, and the
//! cache carves them into blocks. A freed block is merged with its free neighbours and
//! handed out again, whole or split, to the next request it fits best, so a training step
//! that allocates the same shapes every iteration stops calling the driver after the first,
//! and memory freed by one shape serves another. Statistics follow PyTorch's
//! `torch.cuda.memory_*` names.
//!
//! Sizes, as PyTorch's defaults: a request is rounded up to 512 bytes. Requests up to 1 MiB
//! come from 2 MiB segments of a small pool; larger ones from a large pool, whose segments
//! are 20 MiB for requests below 10 MiB and the request rounded up to 2 MiB above. A block is
//! split when what remains is worth keeping (at least 512 bytes in the small pool, over
//! 1 MiB in the large one), so a block handed out exceeds its request by less than 1 MiB.
//!
//! A block is reused only on the stream it was allocated for: work on one stream runs in
//! order, so a block freed there can be handed to that stream's next op at once. A block used
//! on another stream must not be freed before that stream is done with it (the caller's
//! concern, as with PyTorch's `record_stream`).

use crate::profiler::{self, Owner};
use crate::{Device, Error, Result};
use std::collections::{BTreeMap, BTreeSet};

/// The raw allocator underneath: allocate and free whole segments, by address.
pub trait RawMemory {
    /// Allocates `bytes`, aligned to at least 512 bytes; an error string says why not (out
    /// of memory, driver error).
    fn alloc(&mut self, bytes: usize) -> std::result::Result<u64, String>;
    /// Frees a segment `alloc` returned.
    fn free(&mut self, addr: u64);
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

/// Every block's size is a multiple of this (PyTorch's `kMinBlockSize`).
pub const BLOCK_ALIGN: usize = 512;
/// Requests up to this size are served by the small pool.
const SMALL_REQUEST: usize = 1 << 20;
/// A small-pool segment.
const SMALL_SEGMENT: usize = 2 << 20;
/// Large requests below this share a [`MID_SEGMENT`].
const MID_REQUEST: usize = 10 << 20;
const MID_SEGMENT: usize = 20 << 20;
/// Larger requests get a segment of their own, rounded up to this.
const LARGE_ROUND: usize = 2 << 20;

/// The size of the block that serves a request of `bytes` when nothing is split off it: the
/// request rounded up to [`BLOCK_ALIGN`] (at least one). `None` when that overflows.
pub fn block_size(bytes: usize) -> Option<usize> {
    bytes.max(1).checked_next_multiple_of(BLOCK_ALIGN)
}

/// The segment the raw allocator is asked for when no cached block fits a `block`.
fn segment_size(block: usize) -> Option<usize> {
    match block {
        b if b <= SMALL_REQUEST => Some(SMALL_SEGMENT),
        b if b < MID_REQUEST => Some(MID_SEGMENT),
        b => b.checked_next_multiple_of(LARGE_ROUND),
    }
}

/// Small requests and large ones never share a segment, so that small blocks kept for a long
/// time cannot pin down a large segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Pool {
    Small,
    Large,
}

impl Pool {
    fn of(block: usize) -> Pool {
        match block <= SMALL_REQUEST {
            true => Pool::Small,
            false => Pool::Large,
        }
    }

    /// Whether `remaining` bytes are worth splitting off a block as a free block of their own.
    fn splits(self, remaining: usize) -> bool {
        match self {
            Pool::Small => remaining >= BLOCK_ALIGN,
            Pool::Large => remaining > SMALL_REQUEST,
        }
    }
}

/// Where a block is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Cached: can serve a request on its stream.
    Free,
    /// Handed out, with the op that allocated it while a profile ran.
    Live(Option<Owner>),
    /// Freed while work may still use it: counted as allocated until its fence opens.
    Pending(Option<Owner>),
}

/// A piece of a segment.
#[derive(Debug, Clone, Copy)]
struct Block {
    size: usize,
    /// The address of the segment it belongs to: only blocks of one segment merge.
    segment: u64,
    stream: u64,
    pool: Pool,
    state: State,
    /// The allocator's request count when the block was last handed out
    /// ([`CachingAllocator::born`]).
    born: u64,
}

/// A cached block as the best-fit search orders it: stream, pool, size, address.
type FreeKey = (u64, Pool, usize, u64);

/// The caching allocator of one device.
pub struct CachingAllocator<M: RawMemory> {
    raw: M,
    device: Device,
    /// Every block, live or free, by address.
    blocks: BTreeMap<u64, Block>,
    /// The free blocks, for the best-fit search.
    free: BTreeSet<FreeKey>,
    /// Segment sizes by address.
    segments: BTreeMap<u64, usize>,
    /// Fences of the [`State::Pending`] blocks.
    fences: Vec<(u64, Box<dyn Fence>)>,
    stats: MemoryStats,
    /// Off: every block is exactly the size asked for and goes back to the raw allocator
    /// when freed ([`CachingAllocator::with_caching`]).
    caching: bool,
    /// Streams whose segments stay reserved whatever happens (the private pools of CUDA
    /// graphs: [`CachingAllocator::hold_stream`]).
    held: BTreeSet<u64>,
    /// No segment goes back to the raw allocator (a stream capture is open).
    keep_segments: bool,
}

impl<M: RawMemory> CachingAllocator<M> {
    pub fn new(raw: M, device: Device) -> Self {
        CachingAllocator {
            raw,
            device,
            blocks: BTreeMap::new(),
            free: BTreeSet::new(),
            segments: BTreeMap::new(),
            fences: Vec::new(),
            stats: MemoryStats::default(),
            caching: true,
            held: BTreeSet::new(),
            keep_segments: false,
        }
    }

    /// With `false`, no caching, as `PYTORCH_NO_CUDA_MEMORY_CACHING=1`: each request gets a
    /// segment of exactly its size from the raw allocator and each free gives it back, so
    /// that a tool watching the raw allocations (a sanitizer on the emulated device) sees an
    /// access past a tensor's end. Slow; for debugging.
    pub fn with_caching(mut self, on: bool) -> Self {
        self.caching = on;
        self
    }

    /// A block of at least `bytes` for work on `stream`, and its size: the smallest cached
    /// block that fits (split when the rest is worth keeping), else a new segment; when the
    /// raw allocator fails, the cache is released and the request tried once more before
    /// [`Error::OutOfMemory`] (which names the request and these statistics).
    pub fn alloc(&mut self, bytes: usize, stream: u64) -> Result<(u64, usize)> {
        let device = self.device;
        let too_large = |why: String, stats: MemoryStats| Error::OutOfMemory {
            device,
            requested: bytes,
            stats: format!("{stats} ({why})"),
        };
        let size = match self.caching {
            true => block_size(bytes),
            false => Some(bytes.max(1)),
        };
        let size = size.ok_or_else(|| too_large("no block size that large".into(), self.stats))?;
        self.stats.requests += 1;
        if let Err(why) = self.collect_pending() {
            return Err(Error::CudaDriver {
                op: "querying a freed block's fence",
                device: self.device,
                msg: why,
            });
        }
        let pool = Pool::of(size);
        let fit = match self.caching {
            true => self.free.range((stream, pool, size, 0)..).next().copied(),
            false => None,
        };
        let addr = match fit.filter(|&(s, p, _, _)| (s, p) == (stream, pool)) {
            Some(key) => {
                self.stats.cache_hits += 1;
                self.free.remove(&key);
                key.3
            }
            None => {
                let seg = match self.caching {
                    true => segment_size(size),
                    false => Some(size),
                };
                let seg =
                    seg.ok_or_else(|| too_large("no segment that large".into(), self.stats))?;
                let (addr, seg) = match self.raw.alloc(seg) {
                    Ok(a) => (a, seg),
                    Err(why) if self.keep_segments => {
                        return Err(too_large(
                            format!("{why}; the cache is not emptied during a capture"),
                            self.stats,
                        ))
                    }
                    Err(_) => {
                        self.stats.retries += 1;
                        self.empty_cache();
                        self.alloc_segment(seg, size)
                            .map_err(|why| too_large(why, self.stats))?
                    }
                };
                self.segments.insert(addr, seg);
                self.stats.reserved += seg;
                self.stats.peak_reserved = self.stats.peak_reserved.max(self.stats.reserved);
                let block = Block {
                    size: seg,
                    segment: addr,
                    stream,
                    pool,
                    state: State::Free,
                    born: 0,
                };
                self.blocks.insert(addr, block);
                addr
            }
        };
        let block = self
            .blocks
            .get_mut(&addr)
            .expect("a cached block is listed");
        let rest = block.size - size;
        let tail = pool.splits(rest).then(|| {
            block.size = size;
            Block {
                size: rest,
                ..*block
            }
        });
        let size = block.size;
        if let Some(tail) = tail {
            // `size` is below the segment's size, so the sum stays inside the segment.
            let at = addr + size as u64;
            self.blocks.insert(at, tail);
            self.free.insert((stream, pool, rest, at));
        }
        self.stats.allocated += size;
        self.stats.peak_allocated = self.stats.peak_allocated.max(self.stats.allocated);
        let owner = self.profiled().then(|| {
            let st = self.stats;
            profiler::memory_alloc(self.device, size, st.allocated, st.reserved)
        });
        let block = self.blocks.get_mut(&addr).expect("listed above");
        block.state = State::Live(owner.flatten());
        block.born = self.stats.requests;
        Ok((addr, size))
    }

    /// A new segment of `seg` bytes, or when the raw allocator refuses that, one of the
    /// block's own `size`: near the device's capacity a segment of exactly the request may
    /// still fit where a shared one does not.
    fn alloc_segment(
        &mut self,
        seg: usize,
        size: usize,
    ) -> std::result::Result<(u64, usize), String> {
        match self.raw.alloc(seg) {
            Ok(a) => Ok((a, seg)),
            Err(_) if size < seg => self.raw.alloc(size).map(|a| (a, size)),
            Err(why) => Err(why),
        }
    }

    /// Returns a block to the cache of the stream it was allocated for.
    pub fn free(&mut self, addr: u64) -> Result<()> {
        match self.blocks.get(&addr).map(|b| b.state) {
            Some(State::Live(_)) => self.release(addr),
            Some(State::Pending(_)) => Err(Error::invalid(
                "CachingAllocator::free",
                format!("{addr:#x} was already freed and waits for its fence"),
            )),
            _ => Err(not_live("CachingAllocator::free", addr)),
        }
    }

    /// Makes a live or pending block free: merged with its free neighbours in the cache, or
    /// given back to the raw allocator when caching is off.
    fn release(&mut self, addr: u64) -> Result<()> {
        let block = self
            .blocks
            .get_mut(&addr)
            .filter(|b| b.state != State::Free);
        let block = block.ok_or_else(|| not_live("CachingAllocator::free", addr))?;
        let (State::Live(owner) | State::Pending(owner)) = block.state else {
            unreachable!("filtered above")
        };
        block.state = State::Free;
        let mut block = *block;
        self.stats.allocated -= block.size;
        if self.profiled() {
            let st = self.stats;
            profiler::memory_free(self.device, block.size, owner, st.allocated, st.reserved);
        }
        if !self.caching && !self.keep_segments && !self.held.contains(&block.stream) {
            self.blocks.remove(&addr);
            self.segments.remove(&addr);
            self.raw.free(addr);
            self.stats.reserved -= block.size;
            return Ok(());
        }
        let mut start = addr;
        let next = addr + block.size as u64;
        if let Some(n) = self.take_free(next, block.segment) {
            block.size += n.size;
        }
        let before = self.blocks.range(..addr).next_back().map(|(&a, b)| (a, *b));
        if let Some((a, p)) = before.filter(|(a, p)| *a + p.size as u64 == addr) {
            if self.take_free(a, block.segment).is_some() {
                self.blocks.remove(&addr);
                start = a;
                block.size += p.size;
            }
        }
        self.blocks.insert(start, block);
        self.free
            .insert((block.stream, block.pool, block.size, start));
        Ok(())
    }

    /// Removes the free block at `addr` of `segment` from the cache, if there is one.
    fn take_free(&mut self, addr: u64, segment: u64) -> Option<Block> {
        let b = *self.blocks.get(&addr)?;
        if b.segment != segment || b.state != State::Free {
            return None;
        }
        self.free.remove(&(b.stream, b.pool, b.size, addr));
        self.blocks.remove(&addr)
    }

    /// Device allocators report to a running profile (a pinned host pool does not).
    fn profiled(&self) -> bool {
        self.device != Device::Cpu && profiler::enabled()
    }

    /// Returns a block to the cache once `fence` reports that the work using it is done;
    /// until then it is not handed out and counts as allocated.
    pub fn free_after(&mut self, addr: u64, fence: Box<dyn Fence>) -> Result<()> {
        let block = self.blocks.get_mut(&addr);
        match block.as_ref().map(|b| b.state) {
            Some(State::Live(owner)) => {
                block.expect("matched").state = State::Pending(owner);
                self.fences.push((addr, fence));
                Ok(())
            }
            Some(State::Pending(_)) => Err(Error::invalid(
                "CachingAllocator::free_after",
                format!("{addr:#x} was already freed and waits for its fence"),
            )),
            _ => Err(not_live("CachingAllocator::free_after", addr)),
        }
    }

    /// Moves the pending blocks whose fences report done into the cache. A fence whose
    /// query fails keeps its block pending (never reused, never freed) and its error is
    /// returned, after the other blocks were looked at.
    fn collect_pending(&mut self) -> std::result::Result<(), String> {
        let (mut k, mut failed) = (0, None);
        while k < self.fences.len() {
            match self.fences[k].1.is_done() {
                Ok(true) => {
                    let (addr, _) = self.fences.swap_remove(k);
                    self.release(addr).expect("a pending block is listed");
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
        self.fences.len()
    }

    /// Gives every wholly free segment back to the raw allocator; pending blocks whose
    /// fences report done are freed first, the others stay, and so do their segments.
    pub fn empty_cache(&mut self) {
        if self.keep_segments {
            return;
        }
        // A failed fence keeps its block: it is neither cached nor freed.
        let _ = self.collect_pending();
        let whole: Vec<(u64, usize)> = self
            .segments
            .iter()
            .filter(|&(a, &size)| {
                let b = self.blocks.get(a);
                b.is_some_and(|b| {
                    b.state == State::Free && b.size == size && !self.held.contains(&b.stream)
                })
            })
            .map(|(&a, &s)| (a, s))
            .collect();
        for (addr, size) in whole {
            let b = self.blocks.remove(&addr).expect("checked above");
            self.free.remove(&(b.stream, b.pool, b.size, addr));
            self.segments.remove(&addr);
            self.raw.free(addr);
            self.stats.reserved -= size;
        }
    }

    pub fn stats(&self) -> MemoryStats {
        self.stats
    }

    /// The request count when the live block at `addr` was handed out, and its stream: a
    /// block born before a mark ([`MemoryStats::requests`] then) existed at that time.
    pub fn born(&self, addr: u64) -> Option<(u64, u64)> {
        let b = self.blocks.get(&addr)?;
        matches!(b.state, State::Live(_)).then_some((b.born, b.stream))
    }

    /// While `on`, no segment goes back to the raw allocator (neither by
    /// [`CachingAllocator::empty_cache`] nor on a failed request): for a stream capture,
    /// during which a free of device memory is refused.
    pub fn keep_segments(&mut self, on: bool) {
        self.keep_segments = on;
    }

    /// Keeps the segments of `stream` (a graph's private pool) reserved until
    /// [`CachingAllocator::release_stream`]: its blocks serve its own requests only.
    pub fn hold_stream(&mut self, stream: u64) {
        self.held.insert(stream);
    }

    /// Gives `stream`'s blocks to stream 0, the general cache: its free blocks serve anyone
    /// from now on and its live ones go there when freed.
    pub fn release_stream(&mut self, stream: u64) {
        self.held.remove(&stream);
        let addrs: Vec<u64> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.stream == stream)
            .map(|(&a, _)| a)
            .collect();
        for a in addrs {
            let b = self.blocks.get_mut(&a).expect("listed above");
            if b.state == State::Free {
                self.free.remove(&(stream, b.pool, b.size, a));
                self.free.insert((0, b.pool, b.size, a));
            }
            b.stream = 0;
        }
    }

    /// Starts the peaks again from the current values.
    pub fn reset_peak_stats(&mut self) {
        self.stats.peak_allocated = self.stats.allocated;
        self.stats.peak_reserved = self.stats.reserved;
    }
}

fn not_live(op: &'static str, addr: u64) -> Error {
    Error::invalid(
        op,
        format!("{addr:#x} is not a live block of this allocator (double free?)"),
    )
}

impl<M: RawMemory> Drop for CachingAllocator<M> {
    fn drop(&mut self) {
        for (addr, _) in std::mem::take(&mut self.segments) {
            self.raw.free(addr);
        }
    }
}

#[cfg(test)]
mod tests;
