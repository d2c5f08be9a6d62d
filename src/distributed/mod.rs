//! Data-parallel training over several GPUs, as PyTorch's `torch.distributed` and
//! `DistributedDataParallel`: one process per GPU, started by the launchers people already
//! use (torchrun, Slurm's srun, Open MPI's mpirun), joined by NCCL.
//!
//! - [`LaunchEnv`]: the rank, world size and device a launcher gave this process.
//! - [`ProcessGroup`]: the communicator (rank 0 hands NCCL's id to the others over TCP on
//!   `MASTER_ADDR:MASTER_PORT`), with collectives on tensors: all-reduce, broadcast,
//!   all-gather, reduce-scatter, barrier, on a stream of their own ordered against compute.
//! - [`DistributedDataParallel`]: parameters broadcast from rank 0, gradients averaged in
//!   buckets launched during backward.
//! - [`DistributedSampler`]: each rank its shard of every epoch.

mod bucket;
mod ddp;
mod group;
mod launch;
// Used by the NCCL process group only (a build without CUDA has worlds of one).
#[cfg_attr(not(feature = "cuda-backend"), allow(dead_code))]
pub(crate) mod rendezvous;
mod sampler;

pub use bucket::{BUCKET_CAP_BYTES, FIRST_BUCKET_BYTES};
pub use ddp::DistributedDataParallel;
pub use group::{ProcessGroup, ReduceOp, DEFAULT_TIMEOUT};
pub use launch::{LaunchEnv, Launcher, DEFAULT_PORT};
pub use sampler::DistributedSampler;
