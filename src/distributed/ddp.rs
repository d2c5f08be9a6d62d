//! The data-parallel wrapper: gradients averaged over the ranks in buckets, each launched as
//! soon as backward has produced all of its gradients (PyTorch's `DistributedDataParallel`
//! with `gradient_as_bucket_view`).

use super::bucket::{self, Bucket, BUCKET_CAP_BYTES};
use super::group::{ProcessGroup, ReduceOp};
use crate::autograd::hooks::{self, GradReady, Registration};
use crate::sync::lock;
use crate::{DType, Result, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Averages the gradients of `params` over the ranks of a [`ProcessGroup`] during backward.
///
/// At construction every rank's parameters are overwritten with rank 0's (one broadcast per
/// dtype). The parameters go into buckets of about [`BUCKET_CAP_BYTES`] (the first
/// [`FIRST_BUCKET_BYTES`](super::FIRST_BUCKET_BYTES)), in reverse order (backward makes the
/// last layers' gradients first), one dtype per bucket; each bucket has a flat buffer,
/// allocated once, with a place for each of its parameters' gradients. During each `backward()`, once every gradient of a
/// bucket is complete it is copied into its place (unless it is that place already) and the
/// bucket's all-reduce (mean) is queued on the group's communication stream, in place, while
/// backward goes on; buckets go in index order on every rank, as NCCL needs. When backward
/// ends the rest are launched, the compute stream waits for them, and each parameter's
/// `.grad()` is its place in its bucket (PyTorch's `gradient_as_bucket_view`: a view of the
/// parameter's shape and memory format, the same storage every step), so the optimizer step
/// that follows is the same on every rank and reads the gradients where they lie, with no
/// copy. As in PyTorch, a gradient kept from one step (`let g = p.grad()`) is overwritten by
/// the next synchronised backward: copy it to keep it.
///
/// Works with autocast and [`crate::amp::GradScaler`]: the scaled gradients are averaged, so
/// an inf or NaN on one rank reaches every rank and all skip the step together. With gradient
/// accumulation, the micro-steps before the last run under [`DistributedDataParallel::no_sync`]
/// (no communication; gradients add up locally), as in PyTorch. Gradient checkpointing works
/// (a checkpoint's parameters are ready once its recomputation has run). A parameter that
/// gets no gradient in a backward counts as zeros (PyTorch's `find_unused_parameters`). A
/// backward that fails part-way may leave the buckets it launched averaged and the others
/// not: zero the gradients before the next step.
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

struct Reducer {
    group: ProcessGroup,
    params: Vec<Tensor>,
    buckets: Vec<Bucket>,
    /// Each bucket's flat buffer, made once: its gradients are averaged there.
    flats: Vec<Tensor>,
    /// Each parameter's place in its bucket's buffer (see [`bucket::buffers`]): its gradient
    /// after each synchronised backward.
    views: Vec<Tensor>,
    /// The bucket of each parameter.
    bucket_of: Vec<usize>,
    sync: AtomicBool,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The backward these marks belong to.
    backward: u64,
    ready: Vec<bool>,
    left: Vec<usize>,
    /// The buckets launched so far (the first ones, in order).
    launched: usize,
}

impl DistributedDataParallel {
    /// Wraps `params` (on the group's device), broadcasting rank 0's values to every rank.
    pub fn new(group: &ProcessGroup, params: &[Tensor]) -> Result<DistributedDataParallel> {
        DistributedDataParallel::with_bucket_cap(group, params, BUCKET_CAP_BYTES)
    }

    /// [`DistributedDataParallel::new`] with buckets of about `cap` bytes (the first one
    /// [`FIRST_BUCKET_BYTES`](super::FIRST_BUCKET_BYTES) or `cap`, the smaller).
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
        bucket::broadcast_coalesced(group, "DistributedDataParallel", params)?;
        let buckets = bucket::plan_buckets(params, cap);
        let (flats, views) = bucket::buffers(params, &buckets)?;
        let mut bucket_of = vec![0; params.len()];
        for (b, bucket) in buckets.iter().enumerate() {
            for &i in &bucket.params {
                bucket_of[i] = b;
            }
        }
        let reducer = Arc::new(Reducer {
            group: group.clone(),
            params: params.to_vec(),
            buckets,
            flats,
            views,
            bucket_of,
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
    /// forward with `broadcast_buffers`: each rank's statistics come from its own shard. One
    /// collective per dtype (the buffers flattened into one, and copied back).
    pub fn broadcast_buffers(&self, buffers: &[Tensor]) -> Result<()> {
        bucket::broadcast_coalesced(&self.reducer.group, "broadcast_buffers", buffers)
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

impl Reducer {
    /// Starts the marks of backward `id` (a backward that failed part-way leaves marks and
    /// launched buckets behind: the compute stream waits for those before they go).
    fn begin(&self, st: &mut State, id: u64) -> Result<()> {
        if st.backward == id && !st.ready.is_empty() {
            return Ok(());
        }
        if st.launched > 0 {
            self.group.join_compute()?;
        }
        st.backward = id;
        st.ready = vec![false; self.params.len()];
        st.left = self.buckets.iter().map(|b| b.params.len()).collect();
        st.launched = 0;
        Ok(())
    }

    /// Writes bucket `b`'s gradients into their places in its buffer and queues the
    /// buffer's mean over the ranks, in place.
    fn launch(&self, st: &mut State, b: usize) -> Result<()> {
        let _prof = crate::profiler::op("ddp.all_reduce");
        crate::no_grad(|| self.fill(b))?;
        self.group
            .all_reduce_queued(&self.flats[b], ReduceOp::Mean)?;
        st.launched += 1;
        Ok(())
    }

    /// Copies each gradient of bucket `b` into its place (see [`bucket::fill`]).
    fn fill(&self, b: usize) -> Result<()> {
        let bucket = &self.buckets[b];
        let source = |g: Tensor| self.source(g, bucket.dtype);
        bucket::fill(&self.flats[b], bucket, &self.params, &self.views, source)
    }

    /// Gradient `g` in the bucket's `dtype`, on a storage that is no bucket's buffer: one on
    /// a buffer (another parameter's place, set by hand) is copied out first, after the
    /// all-reduces queued so far (one may be writing it), since the buffers are written next.
    fn source(&self, g: Tensor, dtype: DType) -> Result<Tensor> {
        if self.flats.iter().any(|f| f.shares_storage(&g)) {
            self.group.join_compute()?;
            return g.copy()?.to_dtype(dtype);
        }
        g.to_dtype(dtype)
    }

    /// Launches every bucket from the next unlaunched one on whose gradients are complete
    /// (all of them with `all`).
    fn launch_ready(&self, st: &mut State, all: bool) -> Result<()> {
        while st.launched < self.buckets.len() {
            let b = st.launched;
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
        st.left[self.bucket_of[index]] -= 1;
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
        st.launched = 0;
        st.ready.clear();
        // Each gradient is its place in its bucket, averaged.
        for (p, place) in self.params.iter().zip(&self.views) {
            p.set_grad(Some(place.clone()))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amp::{GradScaler, GradScalerConfig};
    use crate::backend::{cpu::CpuStorage, Storage};
    use crate::optim::{clip_grad_norm, Optimizer, Sgd, SgdConfig};
    use crate::{Device, Generator, MemoryFormat};

    fn param(shape: &[usize], dtype: DType) -> Tensor {
        Tensor::randn(shape, DType::F32, Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .requires_grad(true)
            .unwrap()
    }

    #[test]
    fn a_world_of_one_leaves_gradients_as_backward_made_them() {
        let mut g = Generator::new(5);
        let x = Tensor::randn_with(&[2, 3, 5, 5], 0.0, 1.0, DType::F32, Device::Cpu, &mut g)
            .unwrap()
            .to_memory_format(MemoryFormat::ChannelsLast)
            .unwrap();
        let loss = |p: &[Tensor]| {
            let y = x.conv2d(&p[0], None, Default::default()).unwrap();
            let s = y.sum_all().unwrap();
            s.mul(&p[1].sum_all().unwrap()).unwrap()
        };
        let plain = params_from(&mut Generator::new(1));
        loss(&plain).backward().unwrap();
        let wrapped = params_from(&mut Generator::new(1));
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
        // Accumulation: a backward under no_sync adds up locally (a new tensor, the sum),
        // and the next synced one puts the sum of all three in the bucket.
        ddp.no_sync(|| loss(&wrapped).backward()).unwrap();
        let times =
            |k: f64| -> Vec<f32> { plain[1].grad().unwrap().mul(k).unwrap().to_vec().unwrap() };
        assert_eq!(
            wrapped[1].grad().unwrap().to_vec::<f32>().unwrap(),
            times(2.0)
        );
        loss(&wrapped).backward().unwrap();
        let g = wrapped[1].grad().unwrap();
        assert!(g.shares_storage(&ddp.reducer.views[1]));
        assert_eq!(g.to_vec::<f32>().unwrap(), times(3.0));
    }

    /// The address of a CPU f32 tensor's data: the same while its storage is written in
    /// place, another after a copy-on-write or a new allocation.
    fn data_addr(t: &Tensor) -> usize {
        match &*t.storage() {
            Storage::Cpu(CpuStorage::F32(v)) => v.as_ptr() as usize,
            _ => unreachable!("a CPU f32 tensor"),
        }
    }

    /// A channels-last convolution weight, a vector and a parameter no loss reaches.
    fn three_params() -> Vec<Tensor> {
        params_from(&mut Generator::new(9))
    }

    /// [`three_params`] drawn from `g`.
    fn params_from(g: &mut Generator) -> Vec<Tensor> {
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
    }

    #[test]
    fn gradients_stay_views_of_one_bucket_through_the_scaler_clipping_and_the_optimizer() {
        let g = &mut Generator::new(4);
        let x = Tensor::randn_with(&[2, 3, 5, 5], 0.0, 1.0, DType::F32, Device::Cpu, g)
            .unwrap()
            .to_memory_format(MemoryFormat::ChannelsLast)
            .unwrap();
        let loss = |p: &[Tensor], k: usize| {
            let y = x.conv2d(&p[0], None, Default::default()).unwrap();
            let s = y.sqr().unwrap().sum_all().unwrap();
            s.mul(&p[1].sum_all().unwrap())
                .unwrap()
                .mul(k as f64 + 1.0)
                .unwrap()
        };
        // One bucket: [unused, v, w] (reverse order), so v and w sit at offsets 2 and 8.
        let plain = three_params();
        let wrapped = three_params();
        let pg = ProcessGroup::single(Device::Cpu);
        let ddp = DistributedDataParallel::with_bucket_cap(&pg, &wrapped, 1024).unwrap();
        assert_eq!(ddp.bucket_params(), vec![vec![2, 1, 0]]);
        let flat = ddp.reducer.flats[0].clone();
        let data = data_addr(&flat);
        let views = &ddp.reducer.views;
        assert_eq!(
            (views[1].layout().offset(), views[0].layout().offset()),
            (2, 8)
        );
        let sgd = SgdConfig {
            momentum: 0.9,
            ..SgdConfig::new(0.05)
        };
        let mut opts = [
            Sgd::new(plain.clone(), sgd).unwrap(),
            Sgd::new(wrapped.clone(), sgd).unwrap(),
        ];
        let cfg = GradScalerConfig::default();
        let mut scalers = [GradScaler::new(cfg).unwrap(), GradScaler::new(cfg).unwrap()];
        // Each gradient is its place in the bucket: the same tensor, storage and data.
        let in_bucket = |what: &str| {
            for (i, p) in wrapped.iter().enumerate() {
                let g = p.grad().unwrap();
                assert!(
                    g.shares_storage(&flat),
                    "{what}: gradient {i} left its bucket"
                );
                assert_eq!(g.layout(), views[i].layout(), "{what}: gradient {i}");
            }
            assert_eq!(data_addr(&flat), data, "{what}: the bucket was reallocated");
        };
        for step in 0..2 {
            for (k, (params, (opt, scaler))) in [&plain, &wrapped]
                .into_iter()
                .zip(opts.iter_mut().zip(scalers.iter_mut()))
                .enumerate()
            {
                opt.zero_grad();
                scaler
                    .scale(&loss(params, step))
                    .unwrap()
                    .backward()
                    .unwrap();
                if k == 1 {
                    in_bucket("after backward");
                }
                scaler.unscale_(opt).unwrap();
                if k == 1 {
                    in_bucket("after unscale_");
                }
                // A small cap: the gradients are scaled down.
                clip_grad_norm(params, 0.5).unwrap();
                if k == 1 {
                    in_bucket("after clip_grad_norm");
                }
                scaler.step(opt).unwrap();
                scaler.update().unwrap();
            }
            in_bucket("after the step");
            assert!(wrapped[0].grad().unwrap().is_channels_last());
            // The same numbers as without the wrapper (a world of one averages nothing),
            // bit for bit: the multi-tensor passes read the same values where they lie.
            for (i, (a, b)) in plain.iter().zip(&wrapped).enumerate() {
                let v = |t: &Tensor| t.to_vec::<f32>().unwrap();
                assert_eq!(v(a), v(b), "step {step}: parameter {i}");
                if let Some(ga) = a.grad() {
                    assert_eq!(v(&ga), v(&b.grad().unwrap()), "step {step}: gradient {i}");
                }
            }
            assert_ne!(
                wrapped[0].to_vec::<f32>().unwrap(),
                three_params()[0].to_vec::<f32>().unwrap()
            );
        }
    }

    #[test]
    fn replaced_and_borrowed_gradients_are_copied_into_their_places() {
        let ps = three_params();
        let pg = ProcessGroup::single(Device::Cpu);
        let ddp = DistributedDataParallel::with_bucket_cap(&pg, &ps, 1024).unwrap();
        let x = Tensor::ones(&[1, 3, 3, 3], DType::F32, Device::Cpu).unwrap();
        let run = || {
            let y = x
                .conv2d(&ps[0], None, Default::default())
                .unwrap()
                .sum_all();
            y.unwrap()
                .add(&ps[1].sum_all().unwrap())
                .unwrap()
                .backward()
                .unwrap();
        };
        run();
        let views = &ddp.reducer.views;
        // A gradient replaced by hand adds to what backward sends; the sum goes into its
        // place, which becomes the gradient again.
        let own = Tensor::full(&[6], 2.0, DType::F32, Device::Cpu).unwrap();
        ps[1].set_grad(Some(own.clone())).unwrap();
        run();
        let g = ps[1].grad().unwrap();
        assert!(g.shares_storage(&views[1]) && !g.shares_storage(&own));
        assert_eq!(g.to_vec::<f32>().unwrap(), vec![3.0; 6]);
        // A gradient that is another parameter's place (set by hand, without backward
        // reaching it) is read out before the bucket is written.
        ps[2]
            .set_grad(Some(views[1].narrow(0, 0, 2).unwrap()))
            .unwrap();
        ps[1].zero_grad();
        run();
        assert_eq!(ps[2].grad().unwrap().to_vec::<f32>().unwrap(), vec![3.0; 2]);
        assert_eq!(ps[1].grad().unwrap().to_vec::<f32>().unwrap(), vec![1.0; 6]);
        // The convolution's gradient, never zeroed, holds three backwards' sum.
        assert_eq!(
            ps[0].grad().unwrap().to_vec::<f32>().unwrap(),
            vec![3.0; 108]
        );
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
