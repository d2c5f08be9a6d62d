//! A loader's batches on the host (features in ordinary or pinned memory) and their move to a
//! device: [`HostBatch::into_batch`] one batch at a time on the compute stream, or
//! [`DeviceBatches`], which uploads the next batches on a copy stream while the compute
//! stream works on the current one.

use super::Dataset;
#[cfg(feature = "cuda-backend")]
use crate::backend::cuda::{pinned::PinnedBuffer, runtime::CudaRuntime};
use crate::{Device, Error, Result, Tensor};
#[cfg(feature = "cuda-backend")]
use std::sync::Arc;

/// A batch's features on the host: an ordinary vector, or a block of pinned memory from a
/// CUDA device's pool (DataLoaderConfig's `pin_memory`), which uploads without a staging
/// copy and without making the host wait.
pub enum HostBuffer {
    Heap(Vec<f32>),
    #[cfg(feature = "cuda-backend")]
    Pinned {
        buf: PinnedBuffer,
        len: usize,
    },
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HostBuffer::Heap(v) => write!(f, "HostBuffer::Heap({} floats)", v.len()),
            #[cfg(feature = "cuda-backend")]
            HostBuffer::Pinned { buf, len } => {
                write!(f, "HostBuffer::Pinned({len} floats, {buf:?})")
            }
        }
    }
}

impl std::ops::Deref for HostBuffer {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match self {
            HostBuffer::Heap(v) => v,
            // Pinned blocks are page-aligned, so the cast cannot fail on alignment. A `len`
            // beyond the buffer (a hand-made HostBuffer) shows what is there; the batch's
            // shape check then refuses it.
            #[cfg(feature = "cuda-backend")]
            HostBuffer::Pinned { buf, len } => {
                let b = buf.as_bytes();
                bytemuck::cast_slice(&b[..(len * 4).min(b.len() / 4 * 4)])
            }
        }
    }
}

impl HostBuffer {
    /// `len` zeros, pinned when `pin` names a CUDA device's pool.
    fn zeros(len: usize, pin: &PinTarget) -> Result<HostBuffer> {
        #[cfg(feature = "cuda-backend")]
        if let Some(rt) = &pin.rt {
            let mut buf = rt.pinned_buffer(len * 4)?;
            buf.as_mut_slice::<f32>(len)?.fill(0.0);
            return Ok(HostBuffer::Pinned { buf, len });
        }
        let _ = pin;
        Ok(HostBuffer::Heap(vec![0.0; len]))
    }

    fn as_mut_slice(&mut self) -> Result<&mut [f32]> {
        match self {
            HostBuffer::Heap(v) => Ok(v),
            #[cfg(feature = "cuda-backend")]
            HostBuffer::Pinned { buf, len } => buf.as_mut_slice(*len),
        }
    }

    /// Whether the features are in pinned memory.
    pub fn is_pinned(&self) -> bool {
        !matches!(self, HostBuffer::Heap(_))
    }

    /// The features as an ordinary vector (a copy when pinned).
    pub fn into_vec(self) -> Vec<f32> {
        match self {
            HostBuffer::Heap(v) => v,
            #[cfg(feature = "cuda-backend")]
            p @ HostBuffer::Pinned { .. } => p.to_vec(),
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
    /// Features, `[n, sample_shape...]` row-major.
    pub x: HostBuffer,
    /// Labels, `[n]`.
    pub y: Vec<i64>,
    pub shape: Vec<usize>,
}

impl HostBatch {
    pub(crate) fn load(ds: &dyn Dataset, indices: &[usize], pin: &PinTarget) -> Result<HostBatch> {
        let sample = ds.sample_shape();
        let per: usize = sample.iter().product();
        let mut x = HostBuffer::zeros(per * indices.len(), pin)?;
        let mut y = Vec::with_capacity(indices.len());
        for (row, &i) in x.as_mut_slice()?.chunks_mut(per.max(1)).zip(indices) {
            y.push(ds.fill(i, row)?);
        }
        let mut shape = vec![indices.len()];
        shape.extend(sample);
        Ok(HostBatch { x, y, shape })
    }

    fn check(&self, op: &'static str) -> Result<()> {
        let want: usize = self.shape.iter().product();
        if self.x.len() != want || self.shape.first() != Some(&self.y.len()) {
            return Err(Error::invalid(
                op,
                format!(
                    "{} features and {} labels do not fit shape {:?}",
                    self.x.len(),
                    self.y.len(),
                    self.shape
                ),
            ));
        }
        Ok(())
    }

    /// The batch as tensors on `device`. On the CPU ordinary buffers are moved, not copied;
    /// on a CUDA device the upload is queued on the compute stream and the host does not
    /// wait (pinned features are copied from where they are, others through a pinned
    /// staging block).
    pub fn into_batch(self, device: Device) -> Result<Batch> {
        self.check("HostBatch::into_batch")?;
        let n = self.y.len();
        let y = Tensor::from_vec(self.y, &[n], device)?;
        let x = match (self.x, device) {
            #[cfg(feature = "cuda-backend")]
            (HostBuffer::Pinned { mut buf, len }, d) if buf.device() == d => {
                use crate::backend::{cuda::storage::CudaStorage, Storage};
                let s = CudaStorage::from_pinned(&mut buf, crate::DType::F32, len)?;
                Tensor::from_storage(Storage::Cuda(s), &self.shape)
            }
            (x, d) => Tensor::from_vec(x.into_vec(), &self.shape, d)?,
        };
        Ok(Batch { x, y })
    }
}

/// A batch of features and labels.
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

/// Queues `host`'s upload to device `n` on the copy stream (features from their pinned
/// block, or through a staging block; labels through a staging block). The pinned blocks
/// go back to their pool once the copies from them have run.
#[cfg(feature = "cuda-backend")]
fn upload_on_copy_stream(host: HostBatch, n: usize) -> Result<Uploaded> {
    use crate::backend::{cuda::pinned::staged, cuda::storage::CudaStorage, Storage};
    use crate::DType;
    host.check("DeviceBatches")?;
    let device = Device::Cuda(n);
    let rt = crate::backend::cuda::runtime::runtime(n)?;
    let copy = rt.copy_stream()?;
    let driver = |op, e: cudarc::driver::DriverError| Error::CudaDriver {
        op,
        device,
        msg: e.to_string(),
    };
    let (mut xbuf, len) = match host.x {
        HostBuffer::Pinned { buf, len } if buf.device() == device => (buf, len),
        x => match staged(&rt, bytemuck::cast_slice(&x)) {
            Ok(buf) => (buf, x.len()),
            // Out of pinned memory: the compute stream's path, which falls back to pageable.
            Err(Error::OutOfMemory { .. }) => {
                let host = HostBatch { x, ..host };
                return host
                    .into_batch(device)
                    .map(|batch| Uploaded { batch, ready: None });
            }
            Err(e) => return Err(e),
        },
    };
    let mut ybuf = staged(&rt, bytemuck::cast_slice(&host.y))?;
    let ny = host.y.len();
    let xs = CudaStorage::alloc(n, DType::F32, len)?;
    let ys = CudaStorage::alloc(n, DType::I64, ny)?;
    // Recorded after the blocks above were handed out: every kernel that used them before
    // they were freed is queued before this point.
    let queued = rt
        .stream()
        .record_event(None)
        .map_err(|e| driver("recording the compute stream's progress", e))?;
    copy.wait(&queued)
        .map_err(|e| driver("ordering the copy stream after the compute stream", e))?;
    if len > 0 {
        xbuf.upload(xs.ptr(), len * 4, &copy)?;
    }
    if ny > 0 {
        ybuf.upload(ys.ptr(), ny * 8, &copy)?;
    }
    let x = Tensor::from_storage(Storage::Cuda(xs), &host.shape);
    let y = Tensor::from_storage(Storage::Cuda(ys), &[ny]);
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
