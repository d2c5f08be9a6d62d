//! The process group: this rank's place in the job and its communicator, with collectives on
//! tensors.

use super::launch::LaunchEnv;
use super::rendezvous::{self, Meeting};
use crate::{Device, Error, Result, Tensor};
use std::time::Duration;

#[cfg(feature = "cuda-backend")]
use crate::backend::cuda::{
    nccl::{self, Collective},
    nccl_comm::NcclComm,
};
#[cfg(feature = "cuda-backend")]
use crate::backend::Storage;
#[cfg(feature = "cuda-backend")]
use std::sync::Arc;

/// How a collective combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// The sum divided by the world size (NCCL's `ncclAvg`); float dtypes only.
    Mean,
    Max,
    Min,
}

impl ReduceOp {
    #[cfg(feature = "cuda-backend")]
    fn nccl(self) -> std::ffi::c_int {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Max => 2,
            ReduceOp::Min => 3,
            ReduceOp::Mean => 4,
        }
    }
}

/// How the ranks talk: nobody to talk to (world size 1), or NCCL.
#[derive(Clone)]
pub(crate) enum Comm {
    Single,
    #[cfg(feature = "cuda-backend")]
    Nccl(Arc<NcclComm>),
}

/// This process's rank in a job of `world_size` processes, one device each, and the
/// communicator that joins them (NCCL on CUDA devices; none is needed for a world of one).
///
/// ```
/// use mantissa::distributed::{ProcessGroup, ReduceOp};
/// use mantissa::{Device, Tensor};
/// // Launched by torchrun, srun or mpirun: the launcher's ranks; else a world of one.
/// let pg = ProcessGroup::from_env()?.unwrap_or_else(|| ProcessGroup::single(Device::Cpu));
/// let t = Tensor::from_vec(vec![1.0f32, 2.0], &[2], pg.device())?;
/// pg.all_reduce(&t, ReduceOp::Mean)?;
/// # Ok::<(), mantissa::Error>(())
/// ```
#[derive(Clone)]
pub struct ProcessGroup {
    rank: usize,
    world_size: usize,
    local_rank: usize,
    device: Device,
    timeout: Duration,
    pub(crate) comm: Comm,
}

/// How long the rendezvous, a communicator's creation and each collective wait for every
/// rank by default (`MANTISSA_DIST_TIMEOUT_S` changes it), as PyTorch's default
/// process-group timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("device", &self.device)
            .finish()
    }
}

impl ProcessGroup {
    /// A world of one on `device`: every collective leaves its tensor as it is.
    pub fn single(device: Device) -> ProcessGroup {
        ProcessGroup {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            device,
            timeout: DEFAULT_TIMEOUT,
            comm: Comm::Single,
        }
    }

    /// The group a launcher started this process in ([`LaunchEnv::from_env`]), on
    /// `cuda:LOCAL_RANK` (the CPU when CUDA cannot be used and the world is one); `Ok(None)`
    /// without a launcher.
    pub fn from_env() -> Result<Option<ProcessGroup>> {
        let Some(env) = LaunchEnv::from_env()? else {
            return Ok(None);
        };
        let device = match Device::cuda(env.local_rank) {
            Ok(d) => d,
            Err(_) if env.world_size == 1 => Device::Cpu,
            Err(e) => return Err(e),
        };
        ProcessGroup::from_env_on(device)
    }

    /// [`ProcessGroup::from_env`] on `device` (a CUDA device per rank beyond a world of one).
    pub fn from_env_on(device: Device) -> Result<Option<ProcessGroup>> {
        let Some(env) = LaunchEnv::from_env()? else {
            return Ok(None);
        };
        let timeout = match std::env::var("MANTISSA_DIST_TIMEOUT_S") {
            Ok(v) => Duration::from_secs_f64(
                v.trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|s| s.is_finite() && *s > 0.0)
                    .ok_or_else(|| {
                        Error::invalid(
                            "ProcessGroup::from_env",
                            format!(
                                "MANTISSA_DIST_TIMEOUT_S={v:?} is not a positive number of seconds"
                            ),
                        )
                    })?,
            ),
            Err(_) => DEFAULT_TIMEOUT,
        };
        ProcessGroup::init(&env, device, timeout).map(Some)
    }

    /// Joins the group `env` describes with `device` (rank 0 hands NCCL's id to the others
    /// through the rendezvous). Every wait is bounded by `timeout`: the rendezvous, the
    /// communicator's creation, and each collective, which a watchdog thread follows as
    /// PyTorch's does: one that has not completed within `timeout` (a peer failed, left or
    /// never called it) aborts this rank's communicator, and the rank's next synchronisation
    /// or collective returns [`Error::Distributed`] naming it. A world of more than one
    /// needs a CUDA device per rank (NCCL): the CPU is refused. A world of one on a CUDA
    /// device has an NCCL communicator of one rank when NCCL loads (as PyTorch's: the same
    /// path as many ranks, for measuring the wrapper), else none ([`ProcessGroup::backend`]
    /// says which); on the CPU, none.
    pub fn init(env: &LaunchEnv, device: Device, timeout: Duration) -> Result<ProcessGroup> {
        let err = |msg: String| Error::Distributed {
            op: "ProcessGroup::init",
            rank: env.rank,
            world_size: env.world_size,
            msg,
        };
        let ordinal = match device {
            Device::Cuda(n) => n,
            Device::Cpu if env.world_size == 1 => {
                return Ok(ProcessGroup {
                    timeout,
                    ..ProcessGroup::single(device)
                })
            }
            Device::Cpu => {
                return Err(err(
                    "a world of more than one process needs a CUDA device per rank (NCCL); \
                     this rank has the CPU"
                        .into(),
                ))
            }
        };
        let meeting = Meeting {
            addr: env.master_addr.clone(),
            port: env.port,
            rank: env.rank,
            world_size: env.world_size,
            job: rendezvous::job_key(&env.job),
            timeout,
        };
        #[cfg(feature = "cuda-backend")]
        {
            let joined = crate::backend::cuda::runtime::runtime(ordinal).and_then(|rt| {
                let id = rendezvous::share(&meeting, nccl::unique_id)?;
                NcclComm::new(rt, env.rank, env.world_size, &id, timeout)
            });
            let comm = match joined {
                Ok(c) => Comm::Nccl(Arc::new(c)),
                Err(e) if env.world_size == 1 => {
                    log::warn!("a world of one on {device} without a communicator: {e}");
                    Comm::Single
                }
                Err(e) => return Err(e),
            };
            Ok(ProcessGroup {
                rank: env.rank,
                world_size: env.world_size,
                local_rank: env.local_rank,
                device,
                timeout,
                comm,
            })
        }
        #[cfg(not(feature = "cuda-backend"))]
        {
            let _ = (meeting, ordinal);
            match env.world_size {
                1 => Ok(ProcessGroup {
                    timeout,
                    ..ProcessGroup::single(device)
                }),
                _ => Err(err("this build has no CUDA backend (feature `cuda`)".into())),
            }
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The rank within this machine.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// The device this rank's tensors live on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// How long a collective (and the group's creation) may wait for the other ranks.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// What joins the ranks: `"none (world of one)"`, or `"NCCL 2.x.y"`.
    pub fn backend(&self) -> String {
        match &self.comm {
            Comm::Single => "none (world of one)".into(),
            #[cfg(feature = "cuda-backend")]
            Comm::Nccl(_) => match nccl::version() {
                Ok(v) => format!("NCCL {v}"),
                Err(_) => "NCCL".into(),
            },
        }
    }

    /// True on rank 0, the one that writes checkpoints, metrics and plots.
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }

    pub(crate) fn err(&self, op: &'static str, msg: impl Into<String>) -> Error {
        Error::Distributed {
            op,
            rank: self.rank,
            world_size: self.world_size,
            msg: msg.into(),
        }
    }

    /// Checks a collective's tensor: on this rank's device, contiguous (or, for the
    /// element-wise collectives, filling its storage in its memory format: a channels-last
    /// parameter), not a graph input.
    fn check(&self, op: &'static str, t: &Tensor) -> Result<()> {
        self.check_with(
            op,
            t,
            matches!(op, "all_reduce" | "broadcast") && t.fills_storage(),
        )
    }

    fn check_with(&self, op: &'static str, t: &Tensor, dense: bool) -> Result<()> {
        if t.device() != self.device {
            return Err(Error::DeviceMismatch {
                op,
                lhs: t.device(),
                rhs: self.device,
            });
        }
        if !t.is_contiguous() && !dense {
            return Err(self.err(
                op,
                format!("a non-contiguous tensor of shape {:?}", t.shape()),
            ));
        }
        if crate::is_grad_enabled() && t.is_requires_grad() {
            return Err(self.err(
                op,
                "writes in place into a tensor that requires grad while grad mode is on; \
                 wrap it in no_grad or pass a detach()ed tensor",
            ));
        }
        Ok(())
    }

    /// Combines `t` over every rank with `op`, in place: every rank ends with the result.
    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<()> {
        self.check("all_reduce", t)?;
        if op == ReduceOp::Mean && !t.dtype().is_float() {
            return Err(Error::DType {
                op: "all_reduce",
                dtype: t.dtype(),
                expected: "a float dtype for ReduceOp::Mean",
            });
        }
        self.all_reduce_queued(t, op)?;
        self.join_compute()
    }

    /// [`ProcessGroup::all_reduce`] queued on the communication stream, which the compute
    /// stream does not wait for until [`ProcessGroup::join_compute`]: `t` must live till then.
    #[cfg_attr(not(feature = "cuda-backend"), allow(unused_variables))]
    pub(crate) fn all_reduce_queued(&self, t: &Tensor, op: ReduceOp) -> Result<()> {
        match &self.comm {
            Comm::Single => Ok(()),
            #[cfg(feature = "cuda-backend")]
            Comm::Nccl(c) => {
                c.check_usable("ncclAllReduce")?;
                in_place(t, |p, n| {
                    c.launch(Collective::AllReduce(op.nccl()), p, p, n, t.dtype())
                })
            }
        }
    }

    /// Makes later compute wait for the collectives queued so far.
    pub(crate) fn join_compute(&self) -> Result<()> {
        match &self.comm {
            Comm::Single => Ok(()),
            #[cfg(feature = "cuda-backend")]
            Comm::Nccl(c) => c.before_compute(),
        }
    }

    /// Copies `root`'s `t` into every rank's `t`.
    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<()> {
        self.check("broadcast", t)?;
        if root >= self.world_size {
            return Err(self.err("broadcast", format!("root {root} is not a rank")));
        }
        match &self.comm {
            Comm::Single => Ok(()),
            #[cfg(feature = "cuda-backend")]
            Comm::Nccl(c) => {
                c.check_usable("ncclBroadcast")?;
                in_place(t, |p, n| {
                    c.launch(Collective::Broadcast { root }, p, p, n, t.dtype())
                })?;
                c.before_compute()
            }
        }
    }

    /// Every rank's `t`, concatenated along dimension 0 in rank order.
    pub fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        self.check("all_gather", t)?;
        let mut shape = t.shape().to_vec();
        if shape.is_empty() {
            shape.push(1);
        }
        shape[0] = shape[0]
            .checked_mul(self.world_size)
            .ok_or_else(|| self.err("all_gather", "the gathered size overflows"))?;
        let out = crate::no_grad(|| Tensor::zeros(&shape, t.dtype(), self.device))?;
        match &self.comm {
            Comm::Single => crate::no_grad(|| out.copy_(&t.reshape(&shape)?))?,
            #[cfg(feature = "cuda-backend")]
            Comm::Nccl(c) => {
                // NCCL counts all-gather's elements per rank: the input's.
                out_of_place(c, Collective::AllGather, t, &out, t.numel())?
            }
        }
        Ok(out)
    }

    /// `t` combined over every rank with `op`, split along dimension 0 into `world_size`
    /// parts: rank r gets part r. `t`'s first dimension must divide by the world size.
    #[cfg_attr(not(feature = "cuda-backend"), allow(unused_variables))]
    pub fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.check("reduce_scatter", t)?;
        let first = t.shape().first().copied().unwrap_or(1);
        if first % self.world_size != 0 {
            return Err(self.err(
                "reduce_scatter",
                format!(
                    "dimension 0 of shape {:?} does not divide by the world size",
                    t.shape()
                ),
            ));
        }
        let mut shape = t.shape().to_vec();
        if shape.is_empty() {
            shape.push(1);
        }
        shape[0] /= self.world_size;
        match &self.comm {
            Comm::Single => crate::no_grad(|| t.reshape(&shape)?.copy()),
            #[cfg(feature = "cuda-backend")]
            Comm::Nccl(c) => {
                let out = crate::no_grad(|| Tensor::zeros(&shape, t.dtype(), self.device))?;
                // ... and reduce-scatter's per rank: the output's.
                let what = Collective::ReduceScatter(op.nccl());
                out_of_place(c, what, t, &out, out.numel())?;
                Ok(out)
            }
        }
    }

    /// Returns once every rank has reached it (an all-reduce of one element, waited for).
    pub fn barrier(&self) -> Result<()> {
        match &self.comm {
            Comm::Single => Ok(()),
            #[cfg(feature = "cuda-backend")]
            Comm::Nccl(c) => {
                let one = Tensor::ones(&[1], crate::DType::F32, self.device)?;
                self.all_reduce(&one, ReduceOp::Sum)?;
                c.synchronize()
            }
        }
    }

    /// Breaks the communicator, so that the other ranks' collectives fail instead of waiting
    /// for this one: for a rank that stops on an error. Later collectives here fail too.
    #[cfg_attr(not(feature = "cuda-backend"), allow(unused_variables))]
    pub fn abort(&self, why: &str) {
        match &self.comm {
            Comm::Single => {}
            #[cfg(feature = "cuda-backend")]
            Comm::Nccl(c) => c.abort(why),
        }
    }
}

/// Runs `what` from `t` into `out` over `count` elements per rank, ordered after the compute
/// queued so far, with compute after it waiting for it.
#[cfg(feature = "cuda-backend")]
fn out_of_place(
    c: &NcclComm,
    what: Collective,
    t: &Tensor,
    out: &Tensor,
    count: usize,
) -> Result<()> {
    c.check_usable(what.name())?;
    let src = t.storage();
    let Storage::Cuda(s) = &*src else {
        unreachable!("checked: on this rank's CUDA device")
    };
    let sp = s.ptr_at(t.layout().offset());
    in_place(out, |p, _| c.launch(what, sp, p, count, t.dtype()))?;
    c.before_compute()
}

/// Runs `f` with the device address of `t`'s first element and its element count, `t`'s
/// storage held for writing (its version bumped: the collective writes it).
#[cfg(feature = "cuda-backend")]
fn in_place(
    t: &Tensor,
    f: impl FnOnce(cudarc::driver::sys::CUdeviceptr, usize) -> Result<()>,
) -> Result<()> {
    let offset = t.layout().offset();
    let n = t.numel();
    t.0.storage.write(|s| match s {
        Storage::Cuda(s) => f(s.ptr_at(offset), n),
        Storage::Cpu(_) => unreachable!("a communicator's tensors are on its CUDA device"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::Launcher;

    fn env(rank: usize, world_size: usize) -> LaunchEnv {
        LaunchEnv {
            launcher: Launcher::Torchrun,
            rank,
            world_size,
            local_rank: rank,
            master_addr: "127.0.0.1".into(),
            port: 1,
            job: String::new(),
        }
    }

    #[test]
    fn a_world_of_one_on_the_cpu_leaves_tensors_as_they_are() {
        let pg = ProcessGroup::init(&env(0, 1), Device::Cpu, DEFAULT_TIMEOUT).unwrap();
        assert_eq!((pg.rank(), pg.world_size(), pg.is_main()), (0, 1, true));
        assert_eq!(pg.backend(), "none (world of one)");
        let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2], Device::Cpu).unwrap();
        pg.all_reduce(&t, ReduceOp::Mean).unwrap();
        pg.broadcast(&t, 0).unwrap();
        pg.barrier().unwrap();
        assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
        let g = pg.all_gather(&t).unwrap();
        assert_eq!(g.shape(), &[2, 2]);
        assert_eq!(
            pg.reduce_scatter(&t, ReduceOp::Sum)
                .unwrap()
                .to_vec::<f32>()
                .unwrap(),
            vec![1.0, 2.0, 3.0, 4.0]
        );
    }

    #[test]
    fn mistakes_are_named() {
        let e = ProcessGroup::init(&env(1, 2), Device::Cpu, DEFAULT_TIMEOUT).unwrap_err();
        assert!(
            e.to_string().contains("needs a CUDA device per rank"),
            "{e}"
        );
        let pg = ProcessGroup::single(Device::Cpu);
        let t = Tensor::from_vec(vec![1.0f32, 2.0], &[2], Device::Cpu).unwrap();
        let msg = |r: Result<()>| r.unwrap_err().to_string();
        assert!(msg(pg.broadcast(&t, 1)).contains("root 1 is not a rank"));
        let ints = Tensor::from_vec(vec![1i64, 2], &[2], Device::Cpu).unwrap();
        assert!(msg(pg.all_reduce(&ints, ReduceOp::Mean)).contains("float dtype"));
        let w = t.clone().requires_grad(true).unwrap();
        assert!(msg(pg.all_reduce(&w, ReduceOp::Sum)).contains("requires grad"));
        let strided = Tensor::from_vec(vec![1.0f32; 6], &[2, 3], Device::Cpu)
            .unwrap()
            .t()
            .unwrap();
        assert!(msg(pg.all_reduce(&strided, ReduceOp::Sum)).contains("non-contiguous"));
    }
}
