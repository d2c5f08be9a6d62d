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
/// Wrap the parameters the model trains with: after moving it to its device, dtype and
/// memory format (which make new tensors), as with PyTorch's DDP.
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

    /// Copies rank 0's `buffers` (a model's batch norm running statistics, say:
    /// `named_tensors(TensorKind::Buffer)`) to every rank, as PyTorch's DDP does before each
    /// forward with `broadcast_buffers`: each rank's statistics come from its own shard.
    pub fn broadcast_buffers(&self, buffers: &[Tensor]) -> Result<()> {
        crate::no_grad(|| {
            buffers
                .iter()
                .try_for_each(|b| self.reducer.group.broadcast(&b.detach(), 0))
        })
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
                // The bucket has the parameter's dtype (one dtype per bucket).
                let g = from_memory_order(&flat.narrow(0, at, n)?, p.shape(), p.memory_format())?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Device, Generator};

    fn param(shape: &[usize], dtype: DType) -> Tensor {
        Tensor::randn(shape, DType::F32, Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .requires_grad(true)
            .unwrap()
    }

    #[test]
    fn buckets_go_in_reverse_order_within_their_caps() {
        let plan = |ps: &[Tensor]| -> Vec<Vec<usize>> {
            plan_buckets(ps, BUCKET_CAP_BYTES)
                .into_iter()
                .map(|b| b.params)
                .collect()
        };
        let mib = |quarters: usize| param(&[quarters, 65536], DType::F32); // 4-byte elements
                                                                           // Backward's last gradients (the first parameters) fill the small first bucket:
                                                                           // 0.25 + 0.5 MiB fit in 1 MiB, 0.75 more do not; the rest fill 25 MiB buckets.
        let ps = vec![mib(40), mib(40), mib(3), mib(2), mib(1)];
        assert_eq!(plan(&ps), vec![vec![4, 3], vec![2, 1, 0]]);
        // A parameter past the first bucket's cap has it alone; another dtype starts a bucket.
        let ps = vec![
            param(&[8], DType::F16),
            mib(3),
            mib(2),
            mib(40),
            mib(40),
            mib(40),
        ];
        assert_eq!(plan(&ps), vec![vec![5], vec![4, 3, 2, 1], vec![0]]);
        // 3 x 10 MiB: two fit in 25 MiB.
        let ps = vec![mib(40), mib(40), mib(40), mib(1)];
        assert_eq!(plan(&ps), vec![vec![3], vec![2, 1], vec![0]]);
    }

    #[test]
    fn a_world_of_one_leaves_gradients_as_backward_made_them() {
        let mut g = Generator::new(5);
        let make = |g: &mut Generator| -> Vec<Tensor> {
            let w = Tensor::randn_with(&[4, 3, 3, 3], 0.0, 1.0, DType::F32, Device::Cpu, g)
                .unwrap()
                .to_memory_format(MemoryFormat::ChannelsLast)
                .unwrap();
            let v = Tensor::randn_with(&[6], 0.0, 1.0, DType::F32, Device::Cpu, g).unwrap();
            let unused = Tensor::randn_with(&[2], 0.0, 1.0, DType::F32, Device::Cpu, g).unwrap();
            [w, v, unused]
                .into_iter()
                .map(|t| t.requires_grad(true).unwrap())
                .collect()
        };
        let x = Tensor::randn_with(&[2, 3, 5, 5], 0.0, 1.0, DType::F32, Device::Cpu, &mut g)
            .unwrap()
            .to_memory_format(MemoryFormat::ChannelsLast)
            .unwrap();
        let loss = |p: &[Tensor]| {
            let y = x.conv2d(&p[0], None, Default::default()).unwrap();
            let s = y.sum_all().unwrap();
            s.mul(&p[1].sum_all().unwrap()).unwrap()
        };
        let plain = make(&mut Generator::new(1));
        loss(&plain).backward().unwrap();
        let wrapped = make(&mut Generator::new(1));
        let ddp = DistributedDataParallel::with_bucket_cap(
            &ProcessGroup::single(Device::Cpu),
            &wrapped,
            20,
        )
        .unwrap();
        assert_eq!(ddp.buckets(), 3);
        loss(&wrapped).backward().unwrap();
        for (a, b) in plain.iter().zip(&wrapped).take(2) {
            let (ga, gb) = (a.grad().unwrap(), b.grad().unwrap());
            assert_eq!(ga.to_vec::<f32>().unwrap(), gb.to_vec::<f32>().unwrap());
            assert_eq!(ga.memory_format(), gb.memory_format());
        }
        // A parameter backward did not reach averages as zeros (all ranks send something).
        assert!(plain[2].grad().is_none());
        assert_eq!(
            wrapped[2].grad().unwrap().to_vec::<f32>().unwrap(),
            vec![0.0; 2]
        );
        // Accumulation: the second backward (under no_sync, then synced) adds up.
        ddp.no_sync(|| loss(&wrapped).backward()).unwrap();
        let twice: Vec<f32> = plain[1].grad().unwrap().mul(2.0).unwrap().to_vec().unwrap();
        assert_eq!(wrapped[1].grad().unwrap().to_vec::<f32>().unwrap(), twice);
    }

    #[test]
    fn bad_parameters_are_refused_by_name() {
        let pg = ProcessGroup::single(Device::Cpu);
        let p = param(&[3], DType::F32);
        let msg = |r: Result<DistributedDataParallel>| r.err().unwrap().to_string();
        assert!(
            msg(DistributedDataParallel::new(&pg, &[p.clone(), p.clone()]))
                .contains("shares its storage")
        );
        let frozen = Tensor::ones(&[2], DType::F32, Device::Cpu).unwrap();
        assert!(msg(DistributedDataParallel::new(&pg, &[frozen])).contains("requires grad"));
        let not_leaf = p.mul(2.0).unwrap();
        assert!(msg(DistributedDataParallel::new(&pg, &[not_leaf])).contains("parameter 0"));
        assert!(msg(DistributedDataParallel::with_bucket_cap(&pg, &[p], 0)).contains("cap of 0"));
    }
}
