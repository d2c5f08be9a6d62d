//! A loader's batches on the host (features and targets in ordinary or pinned memory) and
//! their move to a device: [`HostBatch::into_batch`] one batch at a time on the compute
//! stream, or [`DeviceBatches`], which uploads the next batches on a copy stream while the
//! compute stream works on the current one.

use super::{Dataset, SampleMut};
use crate::backend::cpu::CpuStorage;
#[cfg(feature = "cuda-backend")]
use crate::backend::cuda::{pinned::PinnedBuffer, runtime::CudaRuntime};
use crate::backend::Storage;
use crate::layout::checked_numel;
use crate::{DType, Device, Error, Result, Tensor};
#[cfg(feature = "cuda-backend")]
use std::sync::Arc;

/// A batch's features or targets on the host: ordinary memory, or a block of pinned memory
/// from a CUDA device's pool (DataLoaderConfig's `pin_memory`), which uploads without a
/// staging copy and without making the host wait.
pub enum HostBuffer {
    /// Ordinary memory, moved into a CPU tensor without a copy.
    Heap(CpuStorage),
    #[cfg(feature = "cuda-backend")]
    Pinned {
        buf: PinnedBuffer,
        dtype: DType,
        /// Elements.
        len: usize,
    },
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (kind, dtype, len) = (self.kind(), self.dtype(), self.len());
        write!(f, "HostBuffer::{kind}({len} x {dtype:?})")
    }
}

impl HostBuffer {
    /// `len` zeros of `dtype`, pinned when `pin` names a CUDA device's pool.
    fn zeros(dtype: DType, len: usize, pin: &PinTarget) -> Result<HostBuffer> {
        #[cfg(feature = "cuda-backend")]
        if let Some(rt) = &pin.rt {
            let bytes = len.checked_mul(dtype.size_in_bytes()).ok_or_else(|| {
                Error::invalid("DataLoader", format!("{len} {dtype:?} elements overflow"))
            })?;
            let mut buf = rt.pinned_buffer(bytes)?;
            buf.as_bytes_mut()?.fill(0);
            return Ok(HostBuffer::Pinned { buf, dtype, len });
        }
        let _ = pin;
        Ok(HostBuffer::Heap(CpuStorage::full(0.0, len, dtype)?))
    }

    fn kind(&self) -> &'static str {
        match self.is_pinned() {
            true => "Pinned",
            false => "Heap",
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            HostBuffer::Heap(s) => s.dtype(),
            #[cfg(feature = "cuda-backend")]
            HostBuffer::Pinned { dtype, .. } => *dtype,
        }
    }

    /// Elements (of a pinned buffer: at most what its block holds, whatever `len` says).
    pub fn len(&self) -> usize {
        self.as_bytes().len() / self.dtype().size_in_bytes()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements' bytes, in the host's order. A pinned `len` beyond its block shows what
    /// the block holds; the batch's shape check then refuses it.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            HostBuffer::Heap(s) => s.as_bytes(),
            #[cfg(feature = "cuda-backend")]
            HostBuffer::Pinned { buf, dtype, len } => {
                let b = buf.as_bytes();
                let size = dtype.size_in_bytes();
                &b[..len.saturating_mul(size).min(b.len() / size * size)]
            }
        }
    }

    fn as_bytes_mut(&mut self) -> Result<&mut [u8]> {
        match self {
            HostBuffer::Heap(s) => Ok(s.as_bytes_mut()),
            #[cfg(feature = "cuda-backend")]
            HostBuffer::Pinned { buf, dtype, len } => {
                let bytes = len.saturating_mul(dtype.size_in_bytes());
                Ok(&mut buf.as_bytes_mut()?[..bytes])
            }
        }
    }

    /// Whether the elements are in pinned memory.
    pub fn is_pinned(&self) -> bool {
        !matches!(self, HostBuffer::Heap(_))
    }

    /// The elements as ordinary host storage (a copy when pinned).
    pub fn into_storage(self) -> Result<CpuStorage> {
        match self {
            HostBuffer::Heap(s) => Ok(s),
            #[cfg(feature = "cuda-backend")]
            p @ HostBuffer::Pinned { .. } => CpuStorage::from_le_bytes(p.as_bytes(), p.dtype())
                .ok_or_else(|| Error::invalid("HostBuffer", "a partial element")),
        }
    }

    /// The buffer as a tensor of `shape` on `device` (a pinned block of that device uploads
    /// from where it is, on the compute stream).
    fn into_tensor(self, shape: &[usize], device: Device) -> Result<Tensor> {
        match (self, device) {
            #[cfg(feature = "cuda-backend")]
            (
                HostBuffer::Pinned {
                    mut buf,
                    dtype,
                    len,
                },
                d,
            ) if buf.device() == d => {
                use crate::backend::cuda::storage::CudaStorage;
                let s = CudaStorage::from_pinned(&mut buf, dtype, len)?;
                Ok(Tensor::from_storage(Storage::Cuda(s), shape))
            }
            (b, d) => Tensor::from_storage(Storage::Cpu(b.into_storage()?), shape).to_device(d),
        }
    }
}

/// Where a loader's workers put the features: the pinned pool of a CUDA device's runtime, or
/// ordinary memory.
#[derive(Clone, Default)]
pub(crate) struct PinTarget {
    #[cfg(feature = "cuda-backend")]
    rt: Option<Arc<CudaRuntime>>,
}

impl PinTarget {
    /// For DataLoaderConfig's `pin_memory`: `Some(Cuda(n))` pins in device n's pool (an
    /// error when the device cannot be used); `None` and `Some(Cpu)` keep ordinary memory,
    /// as PyTorch ignores `pin_memory` without an accelerator.
    pub(crate) fn new(pin: Option<Device>) -> Result<PinTarget> {
        match pin {
            None | Some(Device::Cpu) => Ok(PinTarget::default()),
            #[cfg(feature = "cuda-backend")]
            Some(Device::Cuda(n)) => Ok(PinTarget {
                rt: Some(crate::backend::cuda::runtime::runtime(n)?),
            }),
            #[cfg(not(feature = "cuda-backend"))]
            Some(d) => d.check_available().map(|_| PinTarget::default()),
        }
    }
}

/// One batch's host buffers, filled by a worker.
#[derive(Debug)]
pub struct HostBatch {
    /// Features, `shape` row-major.
    pub x: HostBuffer,
    /// Targets, `y_shape` row-major.
    pub y: HostBuffer,
    /// `[n, sample_shape...]`.
    pub shape: Vec<usize>,
    /// `[n, target_shape...]` (`[n]` for class labels).
    pub y_shape: Vec<usize>,
}

impl HostBatch {
    pub(crate) fn load(ds: &dyn Dataset, indices: &[usize], pin: &PinTarget) -> Result<HostBatch> {
        let n = indices.len();
        let (sample, target) = (ds.sample_shape(), ds.target_shape());
        let (per_x, per_y) = (
            checked_numel("DataLoader", &sample)?,
            checked_numel("DataLoader", &target)?,
        );
        let (dx, dy) = (ds.feature_dtype(), ds.target_dtype());
        let total = |per: usize| {
            per.checked_mul(n).ok_or_else(|| {
                Error::invalid(
                    "DataLoader",
                    format!("{n} samples of {per} elements overflow"),
                )
            })
        };
        let mut x = HostBuffer::zeros(dx, total(per_x)?, pin)?;
        let mut y = HostBuffer::zeros(dy, total(per_y)?, pin)?;
        let (rx, ry) = (per_x * dx.size_in_bytes(), per_y * dy.size_in_bytes());
        let (bx, by) = (x.as_bytes_mut()?, y.as_bytes_mut()?);
        for (k, &i) in indices.iter().enumerate() {
            let mut xs = SampleMut::new(&mut bx[k * rx..(k + 1) * rx], dx)?;
            let mut ys = SampleMut::new(&mut by[k * ry..(k + 1) * ry], dy)?;
            ds.fill_sample(i, &mut xs, &mut ys)?;
        }
        let shape = [&[n][..], &sample].concat();
        let y_shape = [&[n][..], &target].concat();
        Ok(HostBatch {
            x,
            y,
            shape,
            y_shape,
        })
    }

    fn check(&self, op: &'static str) -> Result<()> {
        let fits =
            |b: &HostBuffer, shape: &[usize]| checked_numel(op, shape).is_ok_and(|n| n == b.len());
        if !fits(&self.x, &self.shape)
            || !fits(&self.y, &self.y_shape)
            || self.shape.first() != self.y_shape.first()
        {
            return Err(Error::invalid(
                op,
                format!(
                    "{} features and {} targets do not fit shapes {:?} and {:?}",
                    self.x.len(),
                    self.y.len(),
                    self.shape,
                    self.y_shape
                ),
            ));
        }
        Ok(())
    }

    /// The batch as tensors on `device`. On the CPU ordinary buffers are moved, not copied;
    /// on a CUDA device the upload is queued on the compute stream and the host does not
    /// wait (pinned buffers are copied from where they are, others through a pinned
    /// staging block).
    pub fn into_batch(self, device: Device) -> Result<Batch> {
        self.check("HostBatch::into_batch")?;
        let y = self.y.into_tensor(&self.y_shape, device)?;
        let x = self.x.into_tensor(&self.shape, device)?;
        Ok(Batch { x, y })
    }
}

/// A batch of features and targets.
pub struct Batch {
    pub x: Tensor,
    pub y: Tensor,
}

/// Batches moved to a device ahead of use ([`super::EpochIter::to_device`]). On a CUDA
/// device the next [`DeviceBatches::AHEAD`] batches are uploaded on the runtime's copy
/// stream while the compute stream works on the current one; the compute stream waits for
/// a batch's upload (on the device, not the host) when the batch is handed out. Each
/// upload first waits, on the copy stream, for the compute work queued before it, since
/// its device blocks may have been freed by that work. On the CPU the batches' buffers move
/// into the tensors as they are, and the same number of batches is held ahead.
pub struct DeviceBatches<'a> {
    epoch: super::EpochIter<'a>,
    device: Device,
    ahead: std::collections::VecDeque<Result<Uploaded>>,
}

/// A batch whose upload was queued, and what the compute stream must wait for before using
/// it.
struct Uploaded {
    // Dropped before the batch: the compute stream is ordered after the upload before the
    // batch's device blocks go back to the pool.
    #[cfg(feature = "cuda-backend")]
    ready: Option<Ready>,
    batch: Batch,
}

/// The end of a batch's upload on the copy stream; dropping it unused still makes the
/// compute stream wait, so the batch's device blocks are not reused under the copy.
#[cfg(feature = "cuda-backend")]
struct Ready {
    event: cudarc::driver::CudaEvent,
    compute: Arc<cudarc::driver::CudaStream>,
    device: Device,
    waited: bool,
}

#[cfg(feature = "cuda-backend")]
impl Ready {
    fn wait(mut self) -> Result<()> {
        self.waited = true;
        self.compute
            .wait(&self.event)
            .map_err(|e| Error::CudaDriver {
                op: "ordering the compute stream after an upload",
                device: self.device,
                msg: e.to_string(),
            })
    }
}

#[cfg(feature = "cuda-backend")]
impl Drop for Ready {
    fn drop(&mut self) {
        if !self.waited {
            let _ = self.compute.wait(&self.event);
        }
    }
}

impl<'a> DeviceBatches<'a> {
    /// Batches whose uploads are queued ahead of the one handed out.
    pub const AHEAD: usize = 2;

    pub(crate) fn new(epoch: super::EpochIter<'a>, device: Device) -> DeviceBatches<'a> {
        DeviceBatches {
            epoch,
            device,
            ahead: Default::default(),
        }
    }

    fn upload(&self, host: HostBatch) -> Result<Uploaded> {
        match self.device {
            #[cfg(feature = "cuda-backend")]
            Device::Cuda(n) => upload_on_copy_stream(host, n),
            d => Ok(Uploaded {
                batch: host.into_batch(d)?,
                #[cfg(feature = "cuda-backend")]
                ready: None,
            }),
        }
    }
}

/// `b` in a pinned block of `device`: its own block, or a staging copy; `b` back when
/// the pinned pool is out of memory.
#[cfg(feature = "cuda-backend")]
fn in_pinned_block(
    rt: &Arc<CudaRuntime>,
    b: HostBuffer,
    device: Device,
) -> Result<std::result::Result<PinnedBuffer, HostBuffer>> {
    match b {
        HostBuffer::Pinned { buf, .. } if buf.device() == device => Ok(Ok(buf)),
        b => match crate::backend::cuda::pinned::staged(rt, b.as_bytes()) {
            Ok(buf) => Ok(Ok(buf)),
            Err(Error::OutOfMemory { .. }) => Ok(Err(b)),
            Err(e) => Err(e),
        },
    }
}

/// Queues `host`'s upload to device `n` on the copy stream (each buffer from its pinned
/// block, or through a staging block). The pinned blocks go back to their pool once the
/// copies from them have run.
#[cfg(feature = "cuda-backend")]
fn upload_on_copy_stream(host: HostBatch, n: usize) -> Result<Uploaded> {
    use crate::backend::cuda::storage::CudaStorage;
    host.check("DeviceBatches")?;
    let device = Device::Cuda(n);
    let rt = crate::backend::cuda::runtime::runtime(n)?;
    let copy = rt.copy_stream()?;
    let driver = |op, e: cudarc::driver::DriverError| Error::CudaDriver {
        op,
        device,
        msg: e.to_string(),
    };
    let HostBatch {
        x,
        y,
        shape,
        y_shape,
    } = host;
    let ((xd, xl), (yd, yl)) = ((x.dtype(), x.len()), (y.dtype(), y.len()));
    let (xb, yb) = (
        in_pinned_block(&rt, x, device)?,
        in_pinned_block(&rt, y, device)?,
    );
    let (mut xbuf, mut ybuf) = match (xb, yb) {
        (Ok(a), Ok(b)) => (a, b),
        // Out of pinned memory: the compute stream's path, which falls back to pageable.
        (a, b) => {
            let back = |r, dtype, len| match r {
                Ok(buf) => HostBuffer::Pinned { buf, dtype, len },
                Err(h) => h,
            };
            let (x, y) = (back(a, xd, xl), back(b, yd, yl));
            let host = HostBatch {
                x,
                y,
                shape,
                y_shape,
            };
            return host
                .into_batch(device)
                .map(|batch| Uploaded { batch, ready: None });
        }
    };
    let xs = CudaStorage::alloc(n, xd, xl)?;
    let ys = CudaStorage::alloc(n, yd, yl)?;
    // Recorded after the blocks above were handed out: every kernel that used them before
    // they were freed is queued before this point.
    let queued = rt
        .stream()
        .record_event(None)
        .map_err(|e| driver("recording the compute stream's progress", e))?;
    copy.wait(&queued)
        .map_err(|e| driver("ordering the copy stream after the compute stream", e))?;
    if xl > 0 {
        xbuf.upload(xs.ptr(), xl * xd.size_in_bytes(), &copy)?;
    }
    if yl > 0 {
        ybuf.upload(ys.ptr(), yl * yd.size_in_bytes(), &copy)?;
    }
    let x = Tensor::from_storage(Storage::Cuda(xs), &shape);
    let y = Tensor::from_storage(Storage::Cuda(ys), &y_shape);
    let event = copy
        .record_event(None)
        .map_err(|e| driver("recording an upload's end", e))?;
    Ok(Uploaded {
        batch: Batch { x, y },
        ready: Some(Ready {
            event,
            compute: rt.stream().clone(),
            device,
            waited: false,
        }),
    })
}

impl Iterator for DeviceBatches<'_> {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        while self.ahead.len() <= Self::AHEAD {
            match self.epoch.next_host() {
                Some(h) => {
                    let u = h.and_then(|h| self.upload(h));
                    self.ahead.push_back(u);
                }
                None => break,
            }
        }
        let u = match self.ahead.pop_front()? {
            Ok(u) => u,
            Err(e) => return Some(Err(e)),
        };
        // The batch once its upload has landed (a host batch is ready as it is).
        #[cfg(feature = "cuda-backend")]
        if let Some(r) = u.ready {
            if let Err(e) = r.wait() {
                return Some(Err(e));
            }
        }
        Some(Ok(u.batch))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.epoch.size_hint().0 + self.ahead.len();
        (n, Some(n))
    }
}
