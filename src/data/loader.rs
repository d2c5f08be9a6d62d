//! The DataLoader: seeded shuffling, batching, worker threads that live across epochs, and a
//! bounded number of batches prepared ahead, handed over in order.

use super::host::{Batch, DeviceBatches, HostBatch, PinTarget};
use super::Dataset;
use crate::random::philox_block;
use crate::{Device, Error, Result};
use std::any::Any;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Options of a [`DataLoader`] (PyTorch's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataLoaderConfig {
    pub batch_size: usize,
    /// Reshuffle every epoch (the order depends only on `seed` and the epoch number).
    pub shuffle: bool,
    pub seed: u64,
    /// Drop the last incomplete batch.
    pub drop_last: bool,
    /// Worker threads (at most 1024); 0 loads on the calling thread. Batch `k` of an epoch
    /// goes to worker `k % num_workers` (PyTorch's round robin), and each worker's default
    /// generator (the one [`crate::Tensor::rand`] and friends draw from in a dataset's code)
    /// is seeded once, when the worker starts, with [`DataLoader::worker_seed`]: distinct per
    /// worker, and the same draws run to run for the same `seed`.
    pub num_workers: usize,
    /// Batches prepared ahead per worker.
    pub prefetch_factor: usize,
    /// PyTorch's `pin_memory` with `pin_memory_device`: `Some(Device::Cuda(n))` has the
    /// workers write features into pinned host memory from device n's pool, which uploads
    /// without a staging copy ([`EpochIter::to_device`]). `None`, and `Some(Device::Cpu)`
    /// (as PyTorch ignores the flag without an accelerator), keep ordinary memory.
    pub pin_memory: Option<Device>,
    /// This rank's share of every epoch in data-parallel training (PyTorch's
    /// `DistributedSampler`): the epoch's order, shuffled alike on every rank, is split
    /// between the ranks. `None`: every sample.
    pub sampler: Option<crate::distributed::DistributedSampler>,
}

impl DataLoaderConfig {
    pub fn new(batch_size: usize) -> DataLoaderConfig {
        DataLoaderConfig {
            batch_size,
            shuffle: false,
            seed: 0,
            drop_last: false,
            num_workers: 0,
            prefetch_factor: 2,
            pin_memory: None,
            sampler: None,
        }
    }
}

/// The most worker threads a loader starts: far past any useful count, and short of the
/// thousands of threads a mistyped count would start before the system refused one.
const MAX_WORKERS: usize = 1024;

type Job = (u64, usize, Vec<usize>);
type Done = (u64, usize, Result<HostBatch>);

/// Batches of a [`Dataset`], optionally shuffled, prepared by worker threads.
///
/// ```
/// use mantissa::data::{DataLoader, DataLoaderConfig, Dataset};
/// use std::sync::Arc;
/// struct Squares;
/// impl Dataset for Squares {
///     fn len(&self) -> usize { 10 }
///     fn sample_shape(&self) -> Vec<usize> { vec![1] }
///     fn fill(&self, i: usize, x: &mut [f32]) -> mantissa::Result<i64> { x[0] = (i * i) as f32; Ok(i as i64) }
/// }
/// let cfg = DataLoaderConfig { num_workers: 2, ..DataLoaderConfig::new(4) };
/// let mut dl = DataLoader::new(Arc::new(Squares), cfg)?;
/// let labels: Vec<i64> = dl.epoch(0).flat_map(|b| b.unwrap().y.to_vec::<i64>().unwrap()).collect();
/// assert_eq!(labels, (0..10).collect::<Vec<i64>>());
/// # Ok::<(), mantissa::Error>(())
/// ```
pub struct DataLoader {
    dataset: Arc<dyn Dataset>,
    cfg: DataLoaderConfig,
    /// One job queue per worker (empty without workers).
    jobs: Vec<Sender<Job>>,
    done: Option<Receiver<Done>>,
    workers: Vec<JoinHandle<()>>,
    pin: PinTarget,
    /// Identifies the epoch iteration results belong to (stale ones are dropped).
    generation: u64,
}

impl DataLoader {
    pub fn new(dataset: Arc<dyn Dataset>, cfg: DataLoaderConfig) -> Result<DataLoader> {
        if cfg.batch_size == 0 || cfg.prefetch_factor == 0 {
            return Err(Error::invalid(
                "DataLoader::new",
                format!(
                    "batch_size {} and prefetch_factor {} must be positive",
                    cfg.batch_size, cfg.prefetch_factor
                ),
            ));
        }
        if cfg.num_workers > MAX_WORKERS {
            return Err(Error::invalid(
                "DataLoader::new",
                format!(
                    "num_workers {} is more than {MAX_WORKERS} threads",
                    cfg.num_workers
                ),
            ));
        }
        // The batches in flight, num_workers * prefetch_factor, must be countable (a wrapped
        // product would submit nothing and wait forever).
        if cfg.num_workers.checked_mul(cfg.prefetch_factor).is_none() {
            return Err(Error::invalid(
                "DataLoader::new",
                format!(
                    "num_workers {} times prefetch_factor {} overflows",
                    cfg.num_workers, cfg.prefetch_factor
                ),
            ));
        }
        let mut dl = DataLoader {
            dataset,
            cfg,
            jobs: Vec::new(),
            done: None,
            workers: Vec::new(),
            pin: PinTarget::new(cfg.pin_memory)?,
            generation: 0,
        };
        if cfg.num_workers > 0 {
            let (done_tx, done_rx) = channel::<Done>();
            for w in 0..cfg.num_workers {
                let (job_tx, rx) = channel::<Job>();
                let (tx, ds) = (done_tx.clone(), dl.dataset.clone());
                let (pin, seed) = (dl.pin.clone(), dl.worker_seed(w));
                let handle = std::thread::Builder::new()
                    .name(format!("mantissa-loader-{w}"))
                    .spawn(move || {
                        crate::random::manual_seed(seed);
                        worker_loop(w, rx, tx, ds, pin)
                    })
                    .map_err(|e| {
                        Error::invalid("DataLoader::new", format!("cannot start a worker: {e}"))
                    })?;
                dl.workers.push(handle);
                dl.jobs.push(job_tx);
            }
            dl.done = Some(done_rx);
        }
        Ok(dl)
    }

    /// The seed of worker `worker`'s default generator: the loader's seed mixed into a base
    /// (so that worker streams differ from the shuffle's), plus the worker's index, as
    /// PyTorch's `base_seed + worker_id`.
    pub fn worker_seed(&self, worker: usize) -> u64 {
        const WORKERS: usize = 0x574f_524b; // "WORK": a stream of its own
        crate::backend::rounding::stream_seed(self.cfg.seed, WORKERS).wrapping_add(worker as u64)
    }

    /// Number of batches per epoch.
    pub fn len(&self) -> usize {
        let n = self.dataset.len();
        let n = self.cfg.sampler.map_or(n, |s| s.num_samples(n));
        let b = self.cfg.batch_size;
        if self.cfg.drop_last {
            n / b
        } else {
            n.div_ceil(b)
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn config(&self) -> &DataLoaderConfig {
        &self.cfg
    }

    /// The sample order of `epoch`: a seeded permutation when shuffling, else `0..len`; with
    /// a [`DataLoaderConfig::sampler`], this rank's shard of it.
    ///
    /// A dataset too large to index on this host (its order alone past the host memory
    /// limit, see [`crate::memory::host_memory_limit`]) is an error, not an abort.
    pub fn order(&self, epoch: usize) -> Result<Vec<usize>> {
        let n = self.dataset.len();
        let mut idx: Vec<usize> = crate::backend::host::try_vec(n).map_err(|e| {
            Error::invalid(
                "DataLoader",
                format!("a dataset of {n} samples is too large to index on this host: {e}"),
            )
        })?;
        idx.extend(0..n);
        if self.cfg.shuffle {
            // Fisher-Yates from the top, each swap drawing the two words 2i and 2i + 1 of the
            // epoch's Philox stream (four words a block), made as the loop reaches them.
            let seed = self.cfg.seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            // Swaps 2j + 1 and 2j share block j: it is made once for both.
            let mut block = (usize::MAX, [0u32; 4]);
            for i in (1..n).rev() {
                if block.0 != i / 2 {
                    block = (i / 2, philox_block(seed, (i / 2) as u64));
                }
                let (block, lane) = (block.1, 2 * (i % 2));
                let v = ((block[lane] as u64) << 32) | block[lane + 1] as u64;
                idx.swap(i, (v % (i as u64 + 1)) as usize);
            }
        }
        match self.cfg.sampler {
            Some(s) => s.shard(&idx),
            None => Ok(idx),
        }
    }

    /// Iterates over the batches of `epoch` in order (host batches as CPU tensors). An
    /// epoch that cannot be ordered yields its error once.
    pub fn epoch(&mut self, epoch: usize) -> EpochIter<'_> {
        self.generation += 1;
        let (batches, failed) = match self.order(epoch) {
            Ok(order) => {
                let bs = self.cfg.batch_size;
                let batches = order
                    .chunks(bs)
                    .take(self.len())
                    .map(|c| c.to_vec())
                    .collect();
                (batches, None)
            }
            Err(e) => (Vec::new(), Some(e)),
        };
        EpochIter {
            dl: self,
            batches,
            failed,
            next_submit: 0,
            next_yield: 0,
            ready: BTreeMap::new(),
        }
    }
}

/// Worker `w`'s loop: loads the batches of its queue until the queue closes or the loader
/// stops listening.
fn worker_loop(
    w: usize,
    rx: Receiver<Job>,
    tx: Sender<Done>,
    ds: Arc<dyn Dataset>,
    pin: PinTarget,
) {
    while let Ok((generation, k, idx)) = rx.recv() {
        // A panic in the dataset's code becomes this batch's error (PyTorch re-raises a
        // worker's exception too); the worker lives on, so the epoch neither hangs waiting
        // for the batch nor loses a worker.
        let load = || HostBatch::load(ds.as_ref(), &idx, &pin);
        let batch = catch_unwind(AssertUnwindSafe(load))
            .unwrap_or_else(|p| Err(worker_panic(w, &idx, p.as_ref())));
        if tx.send((generation, k, batch)).is_err() {
            return;
        }
    }
}

/// The error for a batch whose loading panicked in worker `w`.
fn worker_panic(w: usize, idx: &[usize], payload: &(dyn Any + Send)) -> Error {
    let what = payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
        .unwrap_or("a panic without a message");
    Error::invalid(
        "DataLoader",
        format!(
            "worker {w} panicked loading a batch of {} samples (the first is sample {}): {what}",
            idx.len(),
            idx.first().copied().unwrap_or(0)
        ),
    )
}

impl Drop for DataLoader {
    fn drop(&mut self) {
        self.jobs.clear(); // closes the job channels: workers return
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// The batches of one epoch, in order.
pub struct EpochIter<'a> {
    dl: &'a mut DataLoader,
    batches: Vec<Vec<usize>>,
    /// Why the epoch has no batches, yielded once.
    failed: Option<Error>,
    next_submit: usize,
    next_yield: usize,
    ready: BTreeMap<usize, Result<HostBatch>>,
}

impl<'a> EpochIter<'a> {
    /// The next batch's host buffers (before they become tensors).
    pub fn next_host(&mut self) -> Option<Result<HostBatch>> {
        if let Some(e) = self.failed.take() {
            return Some(Err(e));
        }
        if self.next_yield >= self.batches.len() {
            return None;
        }
        let (false, Some(done)) = (self.dl.jobs.is_empty(), &self.dl.done) else {
            let k = self.next_yield;
            self.next_yield += 1;
            return Some(HostBatch::load(
                self.dl.dataset.as_ref(),
                &self.batches[k],
                &self.dl.pin,
            ));
        };
        let jobs = &self.dl.jobs;
        // Checked in DataLoader::new not to overflow.
        let ahead = self.dl.cfg.num_workers * self.dl.cfg.prefetch_factor;
        while self.next_submit < self.batches.len()
            && self.next_submit < self.next_yield.saturating_add(ahead)
        {
            let k = self.next_submit;
            if jobs[k % jobs.len()]
                .send((self.dl.generation, k, std::mem::take(&mut self.batches[k])))
                .is_err()
            {
                return Some(self.workers_gone());
            }
            self.next_submit += 1;
        }
        while !self.ready.contains_key(&self.next_yield) {
            match done.recv() {
                Ok((g, k, b)) if g == self.dl.generation => {
                    self.ready.insert(k, b);
                }
                Ok(_) => {} // from an abandoned epoch
                Err(_) => return Some(self.workers_gone()),
            }
        }
        let b = self.ready.remove(&self.next_yield);
        self.next_yield += 1;
        b
    }

    /// The error when the worker threads have gone; the epoch ends with it (an iterator
    /// that kept returning it would never end).
    fn workers_gone(&mut self) -> Result<HostBatch> {
        self.next_yield = self.batches.len();
        Err(Error::invalid("DataLoader", "worker threads are gone"))
    }

    /// The batches as tensors on `device`. On a CUDA device the next batches' uploads run
    /// on a copy stream while the current batch is in use ([`DeviceBatches`]); set
    /// `pin_memory` in the loader's config to the same device so that they need no staging
    /// copy. On the CPU the batches are the plain iterator's, a few taken ahead.
    ///
    /// ```
    /// use mantissa::data::{DataLoader, DataLoaderConfig, Dataset};
    /// use mantissa::Device;
    /// use std::sync::Arc;
    /// struct Halves;
    /// impl Dataset for Halves {
    ///     fn len(&self) -> usize { 6 }
    ///     fn sample_shape(&self) -> Vec<usize> { vec![2] }
    ///     fn fill(&self, i: usize, x: &mut [f32]) -> mantissa::Result<i64> {
    ///         x.fill(i as f32 / 2.0);
    ///         Ok(i as i64)
    ///     }
    /// }
    /// let device = Device::best();
    /// let cfg = DataLoaderConfig { pin_memory: Some(device), ..DataLoaderConfig::new(4) };
    /// let mut dl = DataLoader::new(Arc::new(Halves), cfg)?;
    /// for b in dl.epoch(0).to_device(device) {
    ///     let b = b?;
    ///     assert_eq!(b.x.device(), device);
    ///     assert_eq!(b.x.shape()[1], 2);
    /// }
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn to_device(self, device: Device) -> DeviceBatches<'a> {
        DeviceBatches::new(self, device)
    }
}

impl Iterator for EpochIter<'_> {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        self.next_host()
            .map(|b| b.and_then(|b| b.into_batch(Device::Cpu)))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.batches.len() - self.next_yield + usize::from(self.failed.is_some());
        (n, Some(n))
    }
}
