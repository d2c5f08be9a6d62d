use super::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

const MIB: usize = 1 << 20;

/// What the fake raw allocator holds.
#[derive(Default)]
struct Raw {
    capacity: usize,
    used: usize,
    /// The next address handed out; segments are spaced apart so that no two are adjacent.
    next: u64,
    calls: usize,
    segments: HashMap<u64, usize>,
}

/// A raw allocator with a capacity, counting calls and checking frees.
#[derive(Clone, Default)]
struct Fake(Arc<Mutex<Raw>>);

impl Fake {
    fn with_capacity(capacity: usize) -> Fake {
        Fake(Arc::new(Mutex::new(Raw {
            capacity,
            next: 1 << 40,
            ..Raw::default()
        })))
    }
    fn used(&self) -> usize {
        self.0.lock().unwrap().used
    }
    fn calls(&self) -> usize {
        self.0.lock().unwrap().calls
    }
    fn segment(&self, addr: u64) -> Option<usize> {
        self.0.lock().unwrap().segments.get(&addr).copied()
    }
}

impl RawMemory for Fake {
    fn alloc(&mut self, bytes: usize) -> std::result::Result<u64, String> {
        let mut s = self.0.lock().unwrap();
        s.calls += 1;
        if s.used + bytes > s.capacity {
            return Err(format!("only {} bytes free", s.capacity - s.used));
        }
        s.used += bytes;
        let addr = s.next;
        s.next += (bytes as u64).next_multiple_of(1 << 30) + (1 << 30);
        s.segments.insert(addr, bytes);
        Ok(addr)
    }
    fn free(&mut self, addr: u64) {
        let mut s = self.0.lock().unwrap();
        let bytes = s
            .segments
            .remove(&addr)
            .expect("a segment this allocator made");
        s.used -= bytes;
    }
}

fn allocator(capacity: usize) -> (Fake, CachingAllocator<Fake>) {
    let raw = Fake::with_capacity(capacity);
    (raw.clone(), CachingAllocator::new(raw, Device::Cuda(0)))
}

#[test]
fn requests_round_to_512_bytes_and_pick_their_segment() {
    assert_eq!(block_size(0), Some(512));
    assert_eq!(block_size(512), Some(512));
    assert_eq!(block_size(513), Some(1024));
    assert_eq!(block_size(usize::MAX), None);
    assert_eq!(segment_size(512), Some(2 * MIB));
    assert_eq!(segment_size(MIB), Some(2 * MIB));
    assert_eq!(segment_size(MIB + 512), Some(20 * MIB));
    assert_eq!(segment_size(10 * MIB), Some(10 * MIB));
    assert_eq!(segment_size(10 * MIB + 512), Some(12 * MIB));
    assert_eq!(segment_size(usize::MAX - 511), None);
}

#[test]
fn blocks_are_reused_per_stream_and_counted() {
    let (raw, mut a) = allocator(1 << 30);
    let (p, size) = a.alloc(1000, 0).unwrap();
    assert_eq!(size, 1024);
    a.free(p).unwrap();
    let (q, _) = a.alloc(900, 0).unwrap(); // fits the freed block
    assert_eq!(q, p);
    assert_eq!(raw.calls(), 1);
    let (r, _) = a.alloc(900, 1).unwrap(); // another stream: a segment of its own
    assert_eq!(raw.calls(), 2);
    assert!(raw.segment(r).is_some());
    let s = a.stats();
    assert_eq!(
        (s.allocated, s.reserved, s.cache_hits, s.requests),
        (2048, 4 * MIB, 1, 3)
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
fn small_requests_share_a_segment_and_merge_back() {
    let (raw, mut a) = allocator(1 << 30);
    let (p, _) = a.alloc(100 << 10, 0).unwrap();
    let (q, _) = a.alloc(100 << 10, 0).unwrap();
    let (r, _) = a.alloc(100 << 10, 0).unwrap();
    assert_eq!(
        (q, r),
        (p + (100 << 10), p + (200 << 10)),
        "carved in order"
    );
    assert_eq!(raw.calls(), 1);
    assert!(
        a.free(p + 512).is_err(),
        "an address inside a block is not a block"
    );
    a.free(p).unwrap();
    a.free(r).unwrap();
    a.empty_cache();
    assert_eq!(a.stats().reserved, 2 * MIB, "a segment in use stays");
    a.free(q).unwrap();
    // The three blocks and the segment's rest are one free block again: a request of their
    // combined size fits at the segment's start.
    let (big, size) = a.alloc(300 << 10, 0).unwrap();
    assert_eq!((big, size, raw.calls()), (p, 300 << 10, 1));
    a.free(big).unwrap();
    a.empty_cache();
    assert_eq!((raw.used(), a.stats().reserved), (0, 0));
}

#[test]
fn a_freed_large_block_serves_smaller_requests() {
    let (raw, mut a) = allocator(1 << 30);
    let (p, size) = a.alloc(64 * MIB, 0).unwrap();
    assert_eq!((size, raw.segment(p)), (64 * MIB, Some(64 * MIB)));
    a.free(p).unwrap();
    let (q, qs) = a.alloc(30 * MIB, 0).unwrap();
    let (r, rs) = a.alloc(30 * MIB, 0).unwrap();
    assert_eq!((q, r), (p, p + 30 * MIB as u64));
    assert_eq!((qs, rs), (30 * MIB, 30 * MIB));
    // 4 MiB remain; a request 0.5 MiB short of them takes the whole rest (not worth a split).
    let (t, ts) = a.alloc(3 * MIB + MIB / 2, 0).unwrap();
    assert_eq!((t, ts), (p + 60 * MIB as u64, 4 * MIB));
    assert_eq!((raw.calls(), a.stats().reserved), (1, 64 * MIB));
    assert_eq!(a.stats().allocated, 64 * MIB);
    // A small request never splits a large block.
    a.free(t).unwrap();
    let (s, _) = a.alloc(1000, 0).unwrap();
    assert_eq!(raw.segment(s), Some(2 * MIB));
    // Mid-sized requests get 20 MiB segments.
    let (m, ms) = a.alloc(3 * MIB, 1).unwrap();
    assert_eq!((ms, raw.segment(m)), (3 * MIB, Some(20 * MIB)));
}

#[test]
fn the_smallest_free_block_that_fits_is_chosen() {
    let (raw, mut a) = allocator(1 << 30);
    let (big, _) = a.alloc(16 * MIB, 0).unwrap();
    let (small, _) = a.alloc(12 * MIB, 0).unwrap();
    let (huge, _) = a.alloc(40 * MIB, 0).unwrap();
    for p in [big, small, huge] {
        a.free(p).unwrap();
    }
    assert_eq!(a.alloc(11 * MIB, 0).unwrap(), (small, 12 * MIB));
    assert_eq!(a.alloc(13 * MIB, 0).unwrap().0, big);
    assert_eq!(a.alloc(13 * MIB, 0).unwrap().0, huge);
    assert_eq!(raw.calls(), 3);
}

#[test]
fn without_caching_blocks_are_exact_and_go_straight_back() {
    let raw = Fake::with_capacity(1 << 30);
    let mut a = CachingAllocator::new(raw.clone(), Device::Cuda(0)).with_caching(false);
    let (p, size) = a.alloc(1000, 0).unwrap();
    assert_eq!((size, raw.segment(p), raw.used()), (1000, Some(1000), 1000));
    a.free(p).unwrap();
    assert_eq!(
        (raw.used(), a.stats().reserved, a.stats().allocated),
        (0, 0, 0)
    );
    let (q, _) = a.alloc(1000, 0).unwrap();
    assert_ne!(q, p, "a new raw block, not a cached one");
    let (q2, _) = a.alloc(1000, 0).unwrap();
    assert_eq!(
        raw.segment(q2),
        Some(1000),
        "never carved from another block"
    );
    a.free(q2).unwrap();
    assert_eq!((raw.calls(), a.stats().cache_hits), (3, 0));
    // A fenced block goes back once its fence opens.
    let open = Arc::new(Mutex::new(false));
    a.free_after(q, Box::new(Gate(open.clone()))).unwrap();
    assert_eq!(raw.used(), 1000);
    *open.lock().unwrap() = true;
    assert_eq!(a.pending(), 0);
    assert_eq!((raw.used(), a.stats().reserved), (0, 0));
    let (z, size) = a.alloc(0, 0).unwrap();
    assert_eq!(
        (size, raw.segment(z)),
        (1, Some(1)),
        "an empty request still gets a block"
    );
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
    assert_eq!((raw.used(), a.stats().allocated), (2 * MIB, 1024));
}

#[test]
fn a_fenced_block_is_reused_only_after_its_fence() {
    let raw = Fake::with_capacity(1 << 30);
    let mut a = CachingAllocator::new(raw.clone(), Device::Cpu);
    let open = Arc::new(Mutex::new(false));
    let (p, _) = a.alloc(4 * MIB, 0).unwrap();
    a.free_after(p, Box::new(Gate(open.clone()))).unwrap();
    assert!(a.free(p).is_err(), "a pending block cannot be freed again");
    assert!(a.free_after(p, Box::new(Gate(open.clone()))).is_err());
    assert_eq!(a.pending(), 1);
    assert_eq!(
        a.stats().allocated,
        4 * MIB,
        "pending blocks count as allocated"
    );
    let (q, _) = a.alloc(4 * MIB, 0).unwrap();
    assert_eq!(
        q,
        p + 4 * MIB as u64,
        "the fenced block is not handed out before its fence"
    );
    a.free(q).unwrap();
    a.empty_cache();
    assert_eq!(
        raw.used(),
        20 * MIB,
        "empty_cache keeps a segment with a closed fence"
    );
    *open.lock().unwrap() = true;
    let (r, _) = a.alloc(4 * MIB, 0).unwrap();
    assert_eq!(r, p, "once the fence opens the block is reused");
    assert_eq!(a.pending(), 0);
    a.free_after(r, Box::new(Gate(open))).unwrap();
    a.empty_cache();
    assert_eq!((raw.used(), a.stats().allocated), (0, 0));
}

#[test]
fn out_of_memory_releases_the_cache_then_names_the_request() {
    let (raw, mut a) = allocator(50 * MIB);
    let (p, _) = a.alloc(30 * MIB, 0).unwrap();
    a.free(p).unwrap();
    // 30 MiB cached + 40 MiB > 50 MiB: the cache is released and the retry succeeds.
    let (q, _) = a.alloc(40 * MIB, 0).unwrap();
    assert_eq!(a.stats().retries, 1);
    assert_eq!(a.stats().reserved, 40 * MIB);
    let e = a.alloc(40 * MIB, 0).unwrap_err().to_string();
    assert!(
        e.contains(&format!("{} bytes requested", 40 * MIB)) && e.contains("allocated 40.0 MiB"),
        "{e}"
    );
    assert!(e.contains("cuda:0") && e.contains("bytes free"), "{e}");
    for huge in [usize::MAX, usize::MAX - (1 << 20)] {
        let e = a.alloc(huge, 0).unwrap_err().to_string();
        assert!(e.contains(&format!("{huge} bytes requested")), "{e}");
    }
    a.free(q).unwrap();
    drop(a);
    assert_eq!(raw.used(), 0, "dropping the allocator returns everything");
}

/// A fixed pseudo-random sequence (a 64-bit LCG's high bits).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) as usize) % n
    }
}

/// Random requests of every pool, freed in random order: live blocks never overlap and lie
/// inside a segment, the statistics are the sums of the blocks and segments, and everything
/// goes back to the raw allocator at the end.
#[test]
fn random_traffic_keeps_blocks_apart_and_counts_exact() {
    let (raw, mut a) = allocator(usize::MAX / 2);
    let mut rng = Lcg(7);
    let mut live: Vec<(u64, usize, usize, u64)> = Vec::new(); // addr, request, size, stream
    for step in 0..4000 {
        if live.is_empty() || rng.below(5) < 3 {
            let bytes = match rng.below(3) {
                0 => rng.below(MIB) + 1,
                1 => rng.below(9 * MIB) + MIB,
                _ => rng.below(64 * MIB) + 10 * MIB,
            };
            let stream = rng.below(2) as u64;
            let (p, size) = a.alloc(bytes, stream).unwrap();
            assert!(
                size >= bytes && size - bytes <= MIB + 511,
                "{bytes} -> {size}"
            );
            assert_eq!(p % BLOCK_ALIGN as u64, 0);
            live.push((p, bytes, size, stream));
        } else {
            let (p, ..) = live.swap_remove(rng.below(live.len()));
            a.free(p).unwrap();
        }
        if step % 97 == 0 {
            a.empty_cache();
        }
        let mut spans: Vec<(u64, u64)> = live.iter().map(|l| (l.0, l.0 + l.2 as u64)).collect();
        spans.sort();
        assert!(
            spans.windows(2).all(|w| w[0].1 <= w[1].0),
            "overlap at step {step}"
        );
        let st = a.stats();
        assert_eq!(st.allocated, live.iter().map(|l| l.2).sum::<usize>());
        assert_eq!(st.reserved, raw.used());
        assert!(st.reserved >= st.allocated);
    }
    let segments = raw.0.lock().unwrap().segments.clone();
    for (p, _, size, _) in &live {
        let inside = segments
            .iter()
            .any(|(&s, &n)| s <= *p && p + *size as u64 <= s + n as u64);
        assert!(inside, "{p:#x} + {size} lies in no segment");
    }
    for (p, ..) in live.drain(..) {
        a.free(p).unwrap();
    }
    a.empty_cache();
    assert_eq!(
        (raw.used(), a.stats().reserved, a.stats().allocated),
        (0, 0, 0)
    );
}

#[test]
fn near_capacity_a_segment_of_the_request_alone_is_tried() {
    let (raw, mut a) = allocator(8 * MIB);
    let (p, size) = a.alloc(3 * MIB, 0).unwrap(); // a 20 MiB segment does not fit
    assert_eq!((size, raw.segment(p)), (3 * MIB, Some(3 * MIB)));
    let (q, size) = a.alloc(1000, 0).unwrap(); // a 2 MiB one does
    assert_eq!((size, raw.segment(q)), (1024, Some(2 * MIB)));
    let (r, size) = a.alloc(3 * MIB - 600, 0).unwrap(); // 3 MiB - 512 B, not a 20 MiB segment
    assert_eq!((size, raw.segment(r)), (3 * MIB - 512, Some(3 * MIB - 512)));
    assert_eq!(a.stats().retries, 2);
    let (s, _) = a.alloc(MIB, 0).unwrap(); // the small segment's rest
    assert_eq!(s, q + 1024);
    let e = a.alloc(MIB + 1, 0).unwrap_err().to_string(); // 512 bytes left
    assert!(e.contains(&format!("{} bytes requested", MIB + 1)), "{e}");
    for p in [p, q, r, s] {
        a.free(p).unwrap();
    }
}

#[test]
fn a_held_stream_keeps_its_segments_until_released_to_the_general_cache() {
    let (raw, mut a) = allocator(1 << 30);
    // A graph's pool (stream 7): its blocks serve its own requests only and stay reserved.
    a.hold_stream(7);
    let (p, _) = a.alloc(1000, 7).unwrap();
    assert_eq!(a.born(p), Some((1, 7)));
    a.free(p).unwrap();
    a.empty_cache();
    assert_eq!(raw.used(), 2 * MIB, "a held stream's segment went back");
    let (q, _) = a.alloc(1000, 0).unwrap();
    assert_ne!(q, p, "the general cache took a held stream's block");
    assert_eq!(a.born(q), Some((2, 0)));
    // Released: the pool's segment is the general cache's, which empty_cache may free.
    a.release_stream(7);
    a.empty_cache();
    assert_eq!(raw.used(), 2 * MIB, "the released pool's segment stayed");
    a.free(q).unwrap();
    assert_eq!(a.born(q), None, "a freed block has no birth");
    a.empty_cache();
    assert_eq!(raw.used(), 0);
}

#[test]
fn no_segment_goes_back_while_segments_are_kept() {
    let (raw, mut a) = allocator(4 * MIB);
    a.keep_segments(true);
    let (p, _) = a.alloc(MIB, 0).unwrap();
    a.free(p).unwrap();
    a.empty_cache();
    assert_eq!(
        raw.used(),
        2 * MIB,
        "empty_cache freed a segment during a capture"
    );
    // A request the raw allocator refuses fails instead of emptying the cache.
    let e = a.alloc(3 * MIB, 0).unwrap_err().to_string();
    assert!(e.contains("not emptied during a capture"), "{e}");
    assert_eq!(raw.used(), 2 * MIB);
    a.keep_segments(false);
    let (q, _) = a.alloc(3 * MIB, 0).unwrap(); // the cache is emptied for it now
    a.free(q).unwrap();
}
