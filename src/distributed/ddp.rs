//! The data-parallel wrapper: gradients averaged over the ranks in buckets, each launched as
//! soon as backward has produced all of its gradients (PyTorch's `DistributedDataParallel`).

use super::group::{ProcessGroup, ReduceOp};
use crate::autograd::hooks::{self, GradReady, Registration};
use crate::sync::lock;
use crate::{DType, MemoryFormat, Result, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// The size of a gradient bucket, as PyTorch's `bucket_cap_mb=25`.
pub const BUCKET_CAP_BYTES: usize = 25 << 20;
/// The size of the first bucket (the last gradients backward makes), as PyTorch's
/// `_DEFAULT_FIRST_BUCKET_BYTES`: they then do not wait behind a large bucket.
pub const FIRST_BUCKET_BYTES: usize = 1 << 20;

/// Averages the gradients of `params` over the ranks of a [`ProcessGroup`] during backward.
///
/// At construction every rank's parameters are overwritten with rank 0's. The parameters go
/// into buckets of about [`BUCKET_CAP_BYTES`] (the first [`FIRST_BUCKET_BYTES`]), in reverse
/// order (backward makes the last layers' gradients first), one dtype per bucket. During
/// each `backward()`, once every gradient of a bucket is complete its all-reduce (mean) is
/// queued on the group's communication stream while backward goes on; buckets go in index
/// order on every rank, as NCCL needs. When backward ends the rest are launched, the compute
/// stream waits for them, and each parameter's `.grad()` becomes its averaged gradient (a view
/// of its bucket), so the optimizer step that follows is the same on every rank.
///
/// Works with autocast and [`crate::amp::GradScaler`]: the scaled gradients are averaged, so
/// an inf or NaN on one rank reaches every rank and all skip the step together. With gradient
/// accumulation, the micro-steps before the last run under [`DistributedDataParallel::no_sync`]
/// (no communication; gradients add up locally), as in PyTorch. Gradient checkpointing works
/// (a checkpoint's parameters are ready once its recomputation has run). A parameter that
/// gets no gradient in a backward counts as zeros (PyTorch's `find_unused_parameters`).
///
/// ```
/// use mantissa::distributed::{DistributedDataParallel, ProcessGroup};
/// use mantissa::{DType, Device, Tensor};
/// let pg = ProcessGroup::single(Device::Cpu);
/// let w = Tensor::randn(&[3, 2], DType::F32, Device::Cpu)?.requires_grad(true)?;
/// let ddp = DistributedDataParallel::new(&pg, &[w.clone()])?;
/// let x = Tensor::ones(&[4, 3], DType::F32, Device::Cpu)?;
/// x.matmul(&w)?.sum_all()?.backward()?; // w.grad() is the mean over the ranks
/// assert_eq!(w.grad().unwrap().to_vec::<f32>()?, vec![4.0; 6]);
/// assert_eq!(ddp.buckets(), 1);
/// # Ok::<(), mantissa::Error>(())
/// ```
pub struct DistributedDataParallel {
    reducer: Arc<Reducer>,
    _hooks: Registration,
}

struct Bucket {
    /// Parameter indices, in the order their gradients sit in the flat buffer.
    params: Vec<usize>,
    dtype: DType,
}

struct Reducer {
    group: ProcessGroup,
    params: Vec<Tensor>,
    buckets: Vec<Bucket>,
    /// `(bucket, place in it)` of each parameter.
    place: Vec<(usize, usize)>,
    sync: AtomicBool,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The backward these marks belong to.
    backward: u64,
    ready: Vec<bool>,
    left: Vec<usize>,
    /// The flat buffers of the buckets launched so far, in order.
    launched: Vec<Tensor>,
}

impl DistributedDataParallel {
    /// Wraps `params` (on the group's device), broadcasting rank 0's values to every rank.
    pub fn new(group: &ProcessGroup, params: &[Tensor]) -> Result<DistributedDataParallel> {
        DistributedDataParallel::with_bucket_cap(group, params, BUCKET_CAP_BYTES)
    }

    /// [`DistributedDataParallel::new`] with buckets of about `cap` bytes (the first one
    /// [`FIRST_BUCKET_BYTES`] or `cap`, the smaller).
    pub fn with_bucket_cap(
        group: &ProcessGroup,
        params: &[Tensor],
        cap: usize,
    ) -> Result<DistributedDataParallel> {
        if cap == 0 {
            return Err(group.err("DistributedDataParallel", "a bucket cap of 0 bytes"));
        }
        for (i, p) in params.iter().enumerate() {
            if p.device() != group.device() {
                return Err(group.err(
                    "DistributedDataParallel",
                    format!(
                        "parameter {i} (shape {:?}) is on {}, the group's device is {}",
                        p.shape(),
                        p.device(),
                        group.device()
                    ),
                ));
            }
            if !p.is_leaf() || !p.is_requires_grad() || !p.dtype().is_float() {
                return Err(group.err(
                    "DistributedDataParallel",
                    format!(
                        "parameter {i} (shape {:?}, {:?}) is not a float leaf that requires grad",
                        p.shape(),
                        p.dtype()
                    ),
                ));
            }
            if params[..i].iter().any(|q| q.shares_storage(p)) {
                return Err(group.err(
                    "DistributedDataParallel",
                    format!("parameter {i} shares its storage with an earlier one"),
                ));
            }
        }
        crate::no_grad(|| {
            params
                .iter()
                .try_for_each(|p| group.broadcast(&p.detach(), 0))
        })?;
        let buckets = plan_buckets(params, cap);
        let mut place = vec![(0, 0); params.len()];
        for (b, bucket) in buckets.iter().enumerate() {
            for (k, &i) in bucket.params.iter().enumerate() {
                place[i] = (b, k);
            }
        }
        let reducer = Arc::new(Reducer {
            group: group.clone(),
            params: params.to_vec(),
            buckets,
            place,
            sync: AtomicBool::new(true),
            state: Mutex::new(State::default()),
        });
        let observer: Arc<dyn GradReady> = reducer.clone();
        let hooks = hooks::register(params, &observer);
        Ok(DistributedDataParallel {
            reducer,
            _hooks: hooks,
        })
    }

    /// The process group.
    pub fn group(&self) -> &ProcessGroup {
        &self.reducer.group
    }

    /// The number of buckets.
    pub fn buckets(&self) -> usize {
        self.reducer.buckets.len()
    }

    /// The parameter indices of each bucket, in launch order.
    pub fn bucket_params(&self) -> Vec<Vec<usize>> {
        self.reducer
            .buckets
            .iter()
            .map(|b| b.params.clone())
            .collect()
    }

    /// Runs `f` (a micro-step's forward and backward) without averaging gradients: they add
    /// up locally, and the next backward outside `no_sync` averages the sum (PyTorch's
    /// `no_sync()` context).
    pub fn no_sync<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Restore<'a>(&'a AtomicBool, bool);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                self.0.store(self.1, Ordering::Release);
            }
        }
        let _restore = Restore(
            &self.reducer.sync,
            self.reducer.sync.swap(false, Ordering::AcqRel),
        );
        f()
    }
}

/// Buckets in reverse parameter order: a new one when the dtype changes or the cap would be
/// passed (a parameter larger than the cap gets one of its own).
fn plan_buckets(params: &[Tensor], cap: usize) -> Vec<Bucket> {
    let mut out: Vec<Bucket> = Vec::new();
    let mut bytes = 0usize;
    for i in (0..params.len()).rev() {
        let p = &params[i];
        let size = p.numel().saturating_mul(p.dtype().size_in_bytes());
        // While the first bucket fills, its own smaller cap.
        let limit = match out.len() {
            1 => FIRST_BUCKET_BYTES.min(cap),
            _ => cap,
        };
        let fits = out
            .last()
            .is_some_and(|b| b.dtype == p.dtype() && bytes.saturating_add(size) <= limit);
        if fits {
            out.last_mut().expect("checked").params.push(i);
            bytes += size;
        } else {
            out.push(Bucket {
                params: vec![i],
                dtype: p.dtype(),
            });
            bytes = size;
        }
    }
    out
}

impl Reducer {
    /// Starts the marks of backward `id` (a backward that failed part-way leaves marks and
    /// launched buckets behind: the compute stream waits for those before they go).
    fn begin(&self, st: &mut State, id: u64) -> Result<()> {
        if st.backward == id && !st.ready.is_empty() {
            return Ok(());
        }
        if !st.launched.is_empty() {
            self.group.join_compute()?;
        }
        st.backward = id;
        st.ready = vec![false; self.params.len()];
        st.left = self.buckets.iter().map(|b| b.params.len()).collect();
        st.launched.clear();
        Ok(())
    }

    /// Flattens bucket `b`'s gradients (zeros for a missing one), each in its parameter's
    /// memory order, and queues their mean over the ranks.
    fn launch(&self, st: &mut State, b: usize) -> Result<()> {
        let _prof = crate::profiler::op("ddp.all_reduce");
        let bucket = &self.buckets[b];
        let flats: Vec<Tensor> = bucket
            .params
            .iter()
            .map(|&i| {
                let p = &self.params[i];
                let g = match p.grad() {
                    Some(g) => g.to_dtype(bucket.dtype)?,
                    None => Tensor::zeros(p.shape(), bucket.dtype, p.device())?,
                };
                in_memory_order(&g, p.memory_format())
            })
            .collect::<Result<_>>()?;
        let refs: Vec<&Tensor> = flats.iter().collect();
        let flat = Tensor::cat(&refs, 0)?;
        self.group.all_reduce_queued(&flat, ReduceOp::Mean)?;
        st.launched.push(flat);
        Ok(())
    }

    /// Launches every bucket from the next unlaunched one on whose gradients are complete
    /// (all of them with `all`).
    fn launch_ready(&self, st: &mut State, all: bool) -> Result<()> {
        while st.launched.len() < self.buckets.len() {
            let b = st.launched.len();
            if !all && st.left[b] > 0 {
                break;
            }
            self.launch(st, b)?;
        }
        Ok(())
    }
}

impl GradReady for Reducer {
    fn ready(&self, index: usize, backward: u64) -> Result<()> {
        if !self.sync.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut st = lock(&self.state);
        self.begin(&mut st, backward)?;
        if std::mem::replace(&mut st.ready[index], true) {
            return Ok(());
        }
        let (b, _) = self.place[index];
        st.left[b] -= 1;
        self.launch_ready(&mut st, false)
    }

    fn done(&self, backward: u64) -> Result<()> {
        if !self.sync.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut st = lock(&self.state);
        self.begin(&mut st, backward)?;
        self.launch_ready(&mut st, true)?;
        self.group.join_compute()?;
        let launched = std::mem::take(&mut st.launched);
        st.ready.clear();
        for (bucket, flat) in self.buckets.iter().zip(launched) {
            let mut at = 0;
            for &i in &bucket.params {
                let p = &self.params[i];
                let n = p.numel();
                let g = from_memory_order(&flat.narrow(0, at, n)?, p.shape(), p.memory_format())?;
                let g = match g.dtype() == p.dtype() {
                    true => g,
                    false => g.to_dtype(p.dtype())?,
                };
                p.set_grad(Some(g))?;
                at += n;
            }
        }
        Ok(())
    }
}

/// `g` as a 1-D tensor of its elements in `format`'s order (the parameter's).
fn in_memory_order(g: &Tensor, format: MemoryFormat) -> Result<Tensor> {
    match format {
        MemoryFormat::ChannelsLast if g.rank() == 4 => g
            .to_memory_format(MemoryFormat::ChannelsLast)?
            .permute(&[0, 2, 3, 1])?
            .reshape(&[g.numel()]),
        _ => g.contiguous()?.reshape(&[g.numel()]),
    }
}

/// The inverse of [`in_memory_order`]: a view of `flat` of `shape` in `format`.
fn from_memory_order(flat: &Tensor, shape: &[usize], format: MemoryFormat) -> Result<Tensor> {
    match format {
        MemoryFormat::ChannelsLast if shape.len() == 4 => flat
            .reshape(&[shape[0], shape[2], shape[3], shape[1]])?
            .permute(&[0, 3, 1, 2]),
        _ => flat.reshape(shape),
    }
}
