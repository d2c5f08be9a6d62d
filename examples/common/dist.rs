//! Data-parallel runs of the examples: launched by torchrun, srun or mpirun, each process
//! trains on `cuda:LOCAL_RANK` with its shard of every epoch, gradients averaged by
//! `DistributedDataParallel`; rank 0 alone prints, writes metrics, plots and checkpoints.
//! Without a launcher an example runs as one process, as ever.

use mantissa::distributed::{
    DistributedDataParallel, DistributedSampler, LaunchEnv, ProcessGroup, ReduceOp,
};
use mantissa::train::EpochMetrics;
use mantissa::{DType, Device, Error, Result, Tensor};

/// This process's place in a data-parallel run (a world of one without a launcher).
pub struct Dist {
    pub group: ProcessGroup,
    /// Started by a launcher (even a world of one: the wrapper then runs, for measuring it).
    pub launched: bool,
}

/// The device a launched process takes (`cuda:LOCAL_RANK`) when a launcher started more
/// than one process; `None` otherwise.
pub fn launched_device(flag: &str) -> Result<Option<Device>> {
    let Some(env) = LaunchEnv::from_env()? else {
        return Ok(None);
    };
    // A world of one takes the device the flags say (`auto`: cuda:0, or the CPU).
    if env.world_size == 1 {
        return Ok(None);
    }
    if flag != "auto" && !flag.starts_with("cuda") {
        return Err(Error::Invalid {
            op: "--device",
            msg: format!(
                "launched by {} as {} processes, which need a CUDA device each (got --device {flag})",
                env.launcher, env.world_size
            ),
        });
    }
    Device::cuda(env.local_rank).map(Some)
}

impl Dist {
    /// Joins the launcher's group on `device` (the one [`launched_device`] chose, or the
    /// flags' for a world of one).
    pub fn join(device: Device, example: &'static str) -> Result<Dist> {
        let Some(group) = ProcessGroup::from_env_on(device)? else {
            return Ok(Dist {
                group: ProcessGroup::single(device),
                launched: false,
            });
        };
        if group.is_main() {
            println!(
                "{example}: data-parallel over {} process{} ({}), rank 0 on {}",
                group.world_size(),
                if group.world_size() == 1 { "" } else { "es" },
                group.backend(),
                group.device()
            );
        }
        Ok(Dist {
            group,
            launched: true,
        })
    }

    pub fn is_main(&self) -> bool {
        self.group.is_main()
    }

    /// This rank's shard of every epoch (none in a world of one).
    pub fn sampler(&self) -> Option<DistributedSampler> {
        (self.group.world_size() > 1).then(|| DistributedSampler::for_group(&self.group))
    }

    /// The wrapper over `params` when launched, else `None`.
    pub fn wrap(&self, params: &[Tensor]) -> Result<Option<DistributedDataParallel>> {
        if !self.launched {
            return Ok(None);
        }
        let ddp = DistributedDataParallel::new(&self.group, params)?;
        if self.is_main() {
            let mib = |ids: &[usize]| {
                let bytes: usize = ids
                    .iter()
                    .map(|&i| params[i].numel() * params[i].dtype().size_in_bytes())
                    .sum();
                format!("{:.2}", bytes as f64 / 1048576.0)
            };
            let sizes: Vec<String> = ddp.bucket_params().iter().map(|b| mib(b)).collect();
            println!(
                "gradients of {} parameters averaged in {} buckets (MiB, in launch order: {})",
                params.len(),
                ddp.buckets(),
                sizes.join(", ")
            );
        }
        Ok(Some(ddp))
    }

    /// Rank 0's buffers (batch norm running statistics) on every rank: before evaluating,
    /// so that every rank tests, and rank 0 saves, the same model.
    pub fn sync_buffers(
        &self,
        ddp: Option<&DistributedDataParallel>,
        net: &dyn mantissa::nn::Module,
    ) -> Result<()> {
        let Some(ddp) = ddp else { return Ok(()) };
        let buffers: Vec<Tensor> = net
            .named_tensors(mantissa::nn::TensorKind::Buffer)
            .into_iter()
            .map(|(_, t)| t)
            .collect();
        ddp.broadcast_buffers(&buffers)
    }

    /// Refuses flags the data-parallel run does not take.
    pub fn check_flags(&self, cuda_graph: bool, example: &'static str) -> Result<()> {
        if self.launched && cuda_graph {
            return Err(Error::Invalid {
                op: example,
                msg: "--cuda-graph is not available in data-parallel runs (collectives are \
                      not captured)"
                    .into(),
            });
        }
        Ok(())
    }

    /// `values` combined over every rank with `op` (as they are in a world of one).
    pub fn combine(&self, values: &[f64], op: ReduceOp) -> Result<Vec<f64>> {
        if self.group.world_size() == 1 {
            return Ok(values.to_vec());
        }
        let t = Tensor::from_vec(values.to_vec(), &[values.len()], Device::Cpu)?
            .to_dtype(DType::F32)?
            .to_device(self.group.device())?;
        self.group.all_reduce(&t, op)?;
        Ok(t.to_vec::<f32>()?.into_iter().map(f64::from).collect())
    }

    /// The epoch's training figures over every rank: loss and accuracy averaged (the
    /// ranks' shards are the same size), throughput summed.
    pub fn reduce(&self, m: &mut EpochMetrics) -> Result<()> {
        let sums = self.combine(&[m.train_loss, m.train_acc, m.samples_per_s], ReduceOp::Sum)?;
        let ranks = self.group.world_size() as f64;
        (m.train_loss, m.train_acc) = (sums[0] / ranks, sums[1] / ranks);
        m.samples_per_s = sums[2];
        Ok(())
    }
}
