//! Backends behind one interface. Each op family has a trait (`ElementwiseOps` in
//! `elementwise.rs`, `ConvOps` in `conv.rs`, ...) that both backend storages implement: the
//! CPU's in `cpu/backend.rs`, CUDA's in `cuda/backend.rs` (and, in builds without the `cuda`
//! feature, the uninhabited stand-in of `no_cuda.rs`). [`Storage`] is the enum over the
//! backend storages, and each family file also holds its `impl Storage` block: the one place
//! an op crosses from the device-independent op definitions (`crate::ops`) into a device's
//! kernels, checking that its operands share a device and picking the backend with
//! `on_backend!`. Ops a backend runs through the host instead of a kernel of its own are
//! listed in `fallback.rs`.

mod amp;
pub mod caching;
mod conv;
mod copy;
pub mod cpu;
#[cfg(feature = "cuda-backend")]
pub mod cuda;
mod device;
mod elementwise;
#[cfg_attr(not(feature = "cuda-backend"), allow(dead_code))]
mod fallback;
pub(crate) mod host;
pub(crate) mod host_limit;
mod index;
mod int_arith;
mod loss;
mod matmul;
pub mod memory;
#[cfg(not(feature = "cuda-backend"))]
mod no_cuda;
pub(crate) mod norm;
pub mod ops;
pub(crate) mod optim;
mod pool;
mod reduce;
mod rnn;
pub mod rounding;
pub(crate) mod softmax;
pub(crate) mod spec;

use crate::layout::Layout;
use crate::{DType, Device, Error, Result};
use cpu::CpuStorage;
#[cfg(feature = "cuda-backend")]
pub(crate) use cuda::storage::CudaStorage;
#[cfg(not(feature = "cuda-backend"))]
pub(crate) use no_cuda::CudaStorage;
pub(crate) use spec::{CellGrads, ConvDims, PoolDims, Span};

pub(crate) use amp::AmpOps;
pub(crate) use conv::ConvOps;
pub(crate) use copy::CopyOps;
pub(crate) use elementwise::ElementwiseOps;
pub(crate) use index::IndexOps;
pub(crate) use loss::LossOps;
#[cfg(feature = "cuda-backend")]
pub(crate) use matmul::in_cudnn_class;
pub(crate) use matmul::{as_cudnn_class, Fused, MatmulOps};
pub(crate) use norm::NormOps;
pub(crate) use optim::OptimOps;
pub(crate) use pool::PoolOps;
pub(crate) use reduce::ReduceOps;
pub(crate) use rnn::RnnOps;
pub(crate) use softmax::{AttnDims, RowSoftmax, SoftmaxOps};

/// A tensor's data on some device.
#[derive(Debug)]
pub enum Storage {
    Cpu(CpuStorage),
    /// Data on a CUDA device (a variant that cannot be built without the `cuda` feature).
    Cuda(CudaStorage),
}

/// What every backend storage is, besides its op families: its device and dtype, and its way
/// to and from the host.
pub(crate) trait BackendStorage: Sized {
    fn device(&self) -> Device;
    fn dtype(&self) -> DType;
    /// Number of elements held (not the number a view selects).
    fn len(&self) -> usize;
    /// The elements `l` selects, contiguous, in host memory.
    fn to_host(&self, l: &Layout) -> Result<CpuStorage>;
    /// The whole storage on the host: borrowed on the CPU, downloaded from a device.
    fn host(&self) -> Result<std::borrow::Cow<'_, CpuStorage>>;
    /// The elements `l` selects in `s`, contiguous, on `device` (of this backend).
    fn from_host(s: &CpuStorage, l: &Layout, device: Device) -> Result<Self>;
}

/// Every op family: what a storage must implement to be a backend (each backend says
/// `impl Backend for ...`, so a family it lacks is a compile error there).
pub(crate) trait Backend:
    BackendStorage
    + CopyOps
    + ElementwiseOps
    + ReduceOps
    + SoftmaxOps
    + MatmulOps
    + ConvOps
    + PoolOps
    + NormOps
    + LossOps
    + IndexOps
    + RnnOps
    + OptimOps
    + AmpOps
{
    /// This storage in a [`Storage`].
    fn wrap(self) -> Storage;
    /// The storage of this backend inside `s`. Called only after the caller checked the
    /// device (see [`on_backend!`]); another backend's storage is a bug, and panics.
    fn part(s: &Storage) -> &Self;
    /// [`Backend::part`], mutably.
    fn part_mut(s: &mut Storage) -> &mut Self;
}

/// Evaluates `$body` with the type `$B` naming the backend storage of `$device`. The body is
/// written once and compiled for each backend.
macro_rules! on_device {
    ($device:expr, $B:ident => $body:expr) => {
        match $device {
            $crate::Device::Cpu => {
                type $B = $crate::backend::cpu::CpuStorage;
                $body
            }
            $crate::Device::Cuda(_) => {
                type $B = $crate::backend::CudaStorage;
                $body
            }
        }
    };
}

/// Checks that the storages `[$x, ..]` share one device (an `Err` naming `$op` otherwise) and
/// evaluates `$body` with `$B` naming that device's backend storage: the body takes each
/// operand's part with `$B::part(x)` / `$B::part_mut(x)` and wraps a result with `$B::wrap`.
macro_rules! on_backend {
    ($op:expr, [$($x:expr),+ $(,)?], $B:ident => $body:expr) => {
        $crate::backend::on_device!(
            $crate::backend::common_device($op, &[$(&*$x),+])?,
            $B => $body
        )
    };
}
pub(crate) use {on_backend, on_device};

/// `Err` naming `op` and both dtypes when they differ (the backends' operand check).
pub(crate) fn same_dtypes(op: &'static str, a: DType, b: DType) -> Result<()> {
    if a != b {
        return Err(Error::DTypeMismatch { op, lhs: a, rhs: b });
    }
    Ok(())
}

/// The one device of `storages`, or a device-mismatch error naming the op.
pub(crate) fn common_device(op: &'static str, storages: &[&Storage]) -> Result<Device> {
    let d = storages[0].device();
    match storages.iter().find(|s| s.device() != d) {
        Some(other) => Err(Error::DeviceMismatch {
            op,
            lhs: d,
            rhs: other.device(),
        }),
        None => Ok(d),
    }
}

impl Storage {
    pub fn device(&self) -> Device {
        match self {
            Storage::Cpu(s) => BackendStorage::device(s),
            Storage::Cuda(s) => BackendStorage::device(s),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            Storage::Cpu(s) => BackendStorage::dtype(s),
            Storage::Cuda(s) => BackendStorage::dtype(s),
        }
    }

    /// Number of elements held (not the number a view selects).
    pub fn len(&self) -> usize {
        match self {
            Storage::Cpu(s) => BackendStorage::len(s),
            Storage::Cuda(s) => BackendStorage::len(s),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The host storage, if this is one.
    pub(crate) fn as_cpu(&self) -> Option<&CpuStorage> {
        match self {
            Storage::Cpu(s) => Some(s),
            Storage::Cuda(_) => None,
        }
    }

    pub(crate) fn as_cpu_mut(&mut self) -> Option<&mut CpuStorage> {
        match self {
            Storage::Cpu(s) => Some(s),
            Storage::Cuda(_) => None,
        }
    }

    /// A host storage moved to `device` (whole, in order).
    fn place(s: CpuStorage, device: Device) -> Result<Storage> {
        if device == Device::Cpu {
            return Ok(Storage::Cpu(s));
        }
        let whole = Layout::contiguous(&[s.len()]);
        on_device!(device, B => Ok(B::from_host(&s, &whole, device)?.wrap()))
    }
}
