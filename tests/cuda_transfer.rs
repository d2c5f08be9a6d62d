//! Host-to-device uploads that the host does not wait for: staging through the pinned pool,
//! pinned loader batches uploaded on the compute stream, and the pool's fences. Without a GPU
//! each test prints `skipped: no CUDA device` and passes (tests/data.rs runs the loader's
//! device batches on the GPU too, where there is one).
#![cfg(feature = "cuda-backend")]

mod common;
use common::parity::{emulated, gpu};
use mantissa::backend::cpu::CpuStorage;
use mantissa::backend::cuda::runtime::runtime;
use mantissa::data::{DataLoader, DataLoaderConfig, Dataset, HostBatch, HostBuffer};
use mantissa::*;
use std::sync::Arc;

/// Keeps the device busy for a while: products of 2048^2 f32 matrices (a few ms each); of
/// 64^2 ones on the emulated device (tests/emulator), whose naive product of the full size
/// would take minutes (its queued work waits anyway, until the host waits for it).
fn busy(d: Device) -> Tensor {
    let size = match emulated(d) {
        true => 64,
        false => 2048,
    };
    let a = Tensor::randn(&[size, size], DType::F32, d).unwrap();
    let mut c = a.matmul(&a).unwrap();
    for _ in 0..20 {
        c = c.matmul(&a).unwrap().mul(1e-3).unwrap();
    }
    c
}

/// One test at a time: they share the device's compute stream and pinned pool, and one's
/// waits for the stream would let the other's fenced blocks go back early.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The runtime of CUDA device `d` with its caches (device and pinned) emptied.
fn emptied(d: Device) -> Arc<mantissa::backend::cuda::runtime::CudaRuntime> {
    let Device::Cuda(n) = d else {
        unreachable!("a CUDA device")
    };
    let rt = runtime(n).unwrap();
    rt.empty_cache().unwrap();
    rt
}

fn pattern(n: usize, k: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7 + k * 13) % 1009) as f32 - 500.0)
        .collect()
}

#[test]
fn staged_uploads_arrive_intact_behind_busy_work() {
    let Some(d) = gpu() else { return };
    let _one = one_at_a_time();
    // No cached pinned blocks to start from, so each staging block below is a new one.
    let rt = emptied(d);
    let _work = busy(d);
    let before = rt.pinned_stats();
    // Two uploads of one size while the device is busy: the first one's staging block is
    // still fenced, so the second gets another block.
    let size = 1 << 20;
    let a = Tensor::from_vec(pattern(size, 1), &[size], d).unwrap();
    let b = Tensor::from_vec(pattern(size, 2), &[size], d).unwrap();
    let grew = rt.pinned_stats().reserved - before.reserved;
    assert!(
        grew >= 8 * size,
        "two fenced 4 MB blocks, not one reused: grew {grew}"
    );
    // Many more, of many sizes, their host vectors dropped at once.
    let mut kept = vec![(a, pattern(size, 1)), (b, pattern(size, 2))];
    for k in 0..60 {
        let len = 1 + (k * 7919) % 300_000;
        let t = Tensor::from_vec(pattern(len, k), &[len], d).unwrap();
        if k % 3 == 0 {
            drop(t); // its device block goes back while the copy may still be queued
        } else {
            kept.push((t, pattern(len, k)));
        }
    }
    for (t, want) in &kept {
        assert_eq!(&t.to_vec::<f32>().unwrap(), want);
    }
    // Once the copies have run, the pool hands the same blocks out again.
    rt.synchronize().unwrap();
    let hits = rt.pinned_stats().cache_hits;
    for k in 0..5 {
        let t = Tensor::from_vec(pattern(size, k), &[size], d).unwrap();
        rt.synchronize().unwrap();
        assert_eq!(t.to_vec::<f32>().unwrap(), pattern(size, k));
    }
    assert!(rt.pinned_stats().cache_hits >= hits + 5);
    rt.empty_cache().unwrap();
    let s = rt.pinned_stats();
    assert_eq!(
        s.reserved, s.allocated,
        "empty_cache releases the cached pinned blocks"
    );
}

#[test]
fn large_uploads_go_through_a_ring_of_pinned_chunks() {
    use mantissa::backend::cuda::pinned::{STAGE_CHUNK_BYTES, STAGE_RING};
    use mantissa::backend::cuda::storage::STAGE_MAX_BYTES;
    let Some(d) = gpu() else { return };
    let _one = one_at_a_time();
    let rt = emptied(d);
    let _work = busy(d);
    // Above the whole-block limit and not a whole number of chunks: 5.5 chunks' worth of
    // f32 more than the limit.
    let len = (STAGE_MAX_BYTES + STAGE_CHUNK_BYTES * 11 / 2) / 4 + 3;
    let want = pattern(len, 3);
    let before = rt.pinned_stats();
    let t = Tensor::from_vec(want.clone(), &[len], d).unwrap();
    let grew = rt.pinned_stats().reserved - before.reserved;
    assert!(
        grew <= STAGE_RING * STAGE_CHUNK_BYTES,
        "the ring's pinned memory, not the upload's size: grew {grew}"
    );
    assert!(grew > 0, "staged through the pinned pool: grew {grew}");
    assert!(
        t.to_vec::<f32>().unwrap() == want,
        "every chunk arrived in place"
    );
    // A second upload reuses the ring's blocks once their copies have run.
    rt.synchronize().unwrap();
    let hits = rt.pinned_stats().cache_hits;
    let again = pattern(len, 4);
    let u = Tensor::from_vec(again.clone(), &[len], d).unwrap();
    assert!(rt.pinned_stats().cache_hits >= hits + STAGE_RING as u64);
    assert!(u.to_vec::<f32>().unwrap() == again);
    rt.empty_cache().unwrap();
}

struct Rows;
impl Dataset for Rows {
    fn len(&self) -> usize {
        40
    }
    fn sample_shape(&self) -> Vec<usize> {
        vec![3, 5]
    }
    fn fill(&self, i: usize, x: &mut [f32]) -> Result<i64> {
        for (j, v) in x.iter_mut().enumerate() {
            *v = (i * 100 + j) as f32;
        }
        Ok(i as i64 % 7)
    }
}

#[test]
fn pinned_batches_upload_on_either_stream() {
    let Some(d) = gpu() else { return };
    let _one = one_at_a_time();
    let cfg = DataLoaderConfig {
        num_workers: 2,
        pin_memory: Some(d),
        ..DataLoaderConfig::new(8)
    };
    let mut dl = DataLoader::new(Arc::new(Rows), cfg).unwrap();
    let _work = busy(d);
    let mut it = dl.epoch(0);
    let mut k = 0;
    while let Some(h) = it.next_host() {
        let h = h.unwrap();
        assert!(h.x.is_pinned());
        let want_x: Vec<f32> = bytemuck::pod_collect_to_vec(h.x.as_bytes());
        let want_y: Vec<i64> = bytemuck::pod_collect_to_vec(h.y.as_bytes());
        let b = h.into_batch(d).unwrap();
        assert_eq!(b.x.shape(), &[8, 3, 5]);
        assert_eq!(b.x.to_vec::<f32>().unwrap(), want_x, "batch {k}");
        assert_eq!(b.y.to_vec::<i64>().unwrap(), want_y, "batch {k}");
        k += 1;
    }
    assert_eq!(k, 5);
    // A pinned batch taken to the CPU is a copy of the same values.
    let h = dl.epoch(0).next_host().unwrap().unwrap();
    let want: Vec<f32> = bytemuck::pod_collect_to_vec(h.x.as_bytes());
    let b = h.into_batch(Device::Cpu).unwrap();
    assert_eq!(b.x.to_vec::<f32>().unwrap(), want);
    // A buffer of the wrong length for its shape is refused before any copy.
    let Device::Cuda(n) = d else { unreachable!() };
    let buf = runtime(n).unwrap().pinned_buffer(16).unwrap();
    let label = || HostBuffer::Heap(CpuStorage::I64(vec![0]));
    let bad = HostBatch {
        x: HostBuffer::Pinned {
            buf,
            dtype: DType::F32,
            len: 4,
        },
        y: label(),
        shape: vec![1, 5],
        y_shape: vec![1],
    };
    assert!(bad.into_batch(d).is_err());
    // So is one whose length runs past its pinned block, without reading past it.
    let buf = runtime(n).unwrap().pinned_buffer(16).unwrap();
    let past = HostBatch {
        x: HostBuffer::Pinned {
            buf,
            dtype: DType::F32,
            len: 9,
        },
        y: label(),
        shape: vec![1, 9],
        y_shape: vec![1],
    };
    assert_eq!(past.x.len(), 4);
    assert!(past.into_batch(d).is_err());
}
