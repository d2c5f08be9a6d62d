//! The [`Tensor`] type: a strided view into shared storage, plus its autograd links.

mod create;
mod create_more;
mod display;
mod generator_state;
mod inplace;
pub(crate) use generator_state::state_stream;
pub(crate) mod node;
mod slicing;
mod view;

use crate::backend::Storage;
use crate::dtype::WithDType;
use crate::layout::Layout;
use crate::sync::lock;
use crate::{DType, Device, Error, Result};
use node::Node;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// Storage shared by a tensor and its views, with a version counter bumped by every in-place
/// write (so caches keyed on it never serve stale data).
///
/// Readers take a snapshot (`Arc<Storage>`) and hold no lock while a kernel runs, so an op may
/// read the same storage twice (`x * x`) and a writer never deadlocks a reader; a write while a
/// snapshot is alive copies the data first (copy-on-write).
pub(crate) struct StorageCell {
    data: RwLock<Arc<Storage>>,
    version: AtomicU64,
    bytes: usize,
    /// Per-channel sums the op that wrote the storage made on the way (see
    /// [`Tensor::channel_sums`]).
    sums: Mutex<Option<ChannelSums>>,
}

/// The per-channel sums and sums of squares of a tensor's values (f32 `[2, c]`), made by the
/// op that wrote it (a convolution's epilogue) for a batch norm that reads it: valid for the
/// storage's version and the view they were made for.
struct ChannelSums {
    version: u64,
    layout: Layout,
    sums: Arc<Storage>,
}

/// Bytes of tensor storage alive in this process (all devices), for memory accounting.
static LIVE_BYTES: AtomicU64 = AtomicU64::new(0);

/// Bytes held by live tensor storages (a view counts once with its base). Measuring it
/// before and after a forward pass gives the activations the graph keeps for backward.
pub fn live_storage_bytes() -> u64 {
    LIVE_BYTES.load(Ordering::Relaxed)
}

impl Drop for StorageCell {
    fn drop(&mut self) {
        LIVE_BYTES.fetch_sub(self.bytes as u64, Ordering::Relaxed);
    }
}

impl StorageCell {
    pub(crate) fn new(s: Storage) -> Arc<StorageCell> {
        let bytes = s.len() * s.dtype().size_in_bytes();
        LIVE_BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
        Arc::new(StorageCell {
            data: RwLock::new(Arc::new(s)),
            version: AtomicU64::new(0),
            bytes,
            sums: Mutex::new(None),
        })
    }
    pub(crate) fn read(&self) -> Arc<Storage> {
        self.data.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
    /// Runs `f` on the storage for writing and bumps the version.
    pub(crate) fn write<R>(&self, f: impl FnOnce(&mut Storage) -> Result<R>) -> Result<R> {
        let mut g = self.data.write().unwrap_or_else(|e| e.into_inner());
        self.version.fetch_add(1, Ordering::Relaxed);
        f(unique(&mut g)?)
    }
}

/// The storage behind `arc` for writing, copied first when a reader's snapshot shares it
/// (copy-on-write; the copy is on the storage's device and can fail there).
fn unique(arc: &mut Arc<Storage>) -> Result<&mut Storage> {
    if Arc::get_mut(arc).is_none() {
        *arc = Arc::new(arc.try_clone()?);
    }
    Ok(Arc::get_mut(arc).expect("just made unique"))
}

pub(crate) struct Inner {
    id: u64,
    pub(crate) storage: Arc<StorageCell>,
    pub(crate) layout: Layout,
    dtype: DType,
    device: Device,
    requires_grad: AtomicBool,
    pub(crate) node: Option<Arc<Node>>,
    /// The accumulated gradient of a leaf, shared with the graph edges that feed it.
    pub(crate) grad: Arc<Mutex<Option<Tensor>>>,
}

/// An n-dimensional array on a device, with reverse-mode autograd.
///
/// Cloning a `Tensor` is cheap (a reference count); views (`reshape`, `permute`, `narrow`,
/// `expand`, ...) share storage with their source. Every operation returns `Result`.
///
/// ```
/// use mantissa::{Tensor, Device};
/// let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2], Device::Cpu)?;
/// let b = a.matmul(&a.t()?)?;
/// assert_eq!(b.to_vec::<f32>()?, vec![5.0, 11.0, 11.0, 25.0]);
/// # Ok::<(), mantissa::Error>(())
/// ```
#[derive(Clone)]
pub struct Tensor(pub(crate) Arc<Inner>);

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The id the next tensor made will have: every tensor made before has a lower one.
pub(crate) fn next_tensor_id() -> u64 {
    NEXT_ID.load(Ordering::Relaxed)
}

impl Tensor {
    /// A tensor over `storage` seen through `layout`, not part of any graph.
    ///
    /// Panics when `layout` reaches outside the storage: every caller checks user sizes
    /// before this point (shapes with [`crate::layout::checked_numel`], views with checked
    /// bounds), so a failure here is an engine bug, stopped before a kernel reads out of
    /// bounds.
    pub(crate) fn from_parts(storage: Arc<StorageCell>, layout: Layout) -> Tensor {
        let (dtype, device) = {
            let s = storage.read();
            if let Err(e) = layout.check_within("tensor", s.len()) {
                panic!("mantissa internal error: a view outside its storage: {e}");
            }
            (s.dtype(), s.device())
        };
        Tensor(Arc::new(Inner {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            storage,
            layout,
            dtype,
            device,
            requires_grad: AtomicBool::new(false),
            node: None,
            grad: Arc::new(Mutex::new(None)),
        }))
    }

    /// A contiguous tensor owning fresh storage.
    pub(crate) fn from_storage(storage: Storage, shape: &[usize]) -> Tensor {
        Tensor::from_parts(StorageCell::new(storage), Layout::contiguous(shape))
    }

    /// A tensor owning fresh storage, seen through `layout` (a dense layout over all of it).
    pub(crate) fn from_storage_in(storage: Storage, layout: Layout) -> Tensor {
        Tensor::from_parts(StorageCell::new(storage), layout)
    }

    /// A new view of this tensor's storage (no graph link; callers attach one).
    pub(crate) fn view_with(&self, layout: Layout) -> Tensor {
        Tensor::from_parts(self.0.storage.clone(), layout)
    }

    pub(crate) fn id(&self) -> u64 {
        self.0.id
    }
    pub(crate) fn layout(&self) -> &Layout {
        &self.0.layout
    }
    pub(crate) fn storage(&self) -> Arc<Storage> {
        self.0.storage.read()
    }

    pub fn shape(&self) -> &[usize] {
        self.0.layout.shape()
    }
    pub fn strides(&self) -> &[usize] {
        self.0.layout.strides()
    }
    pub fn rank(&self) -> usize {
        self.0.layout.rank()
    }
    pub fn numel(&self) -> usize {
        self.0.layout.numel()
    }
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }
    pub fn device(&self) -> Device {
        self.0.device
    }
    pub fn is_contiguous(&self) -> bool {
        self.0.layout.is_contiguous()
    }

    /// Size of dimension `dim` (negative counts from the end).
    pub fn dim(&self, dim: isize) -> Result<usize> {
        Ok(self.shape()[crate::layout::normalize_dim("dim", dim, self.shape())?])
    }

    /// Version of the underlying storage: bumped by every in-place write.
    pub fn version(&self) -> u64 {
        self.0.storage.version.load(Ordering::Relaxed)
    }

    /// Keeps `sums`, the per-channel sums and sums of squares of this tensor's values (f32
    /// `[2, c]`), beside its storage for [`Tensor::channel_sums`].
    pub(crate) fn set_channel_sums(&self, sums: Storage) {
        *lock(&self.0.storage.sums) = Some(ChannelSums {
            version: self.version(),
            layout: self.layout().clone(),
            sums: Arc::new(sums),
        });
    }

    /// The sums [`Tensor::set_channel_sums`] kept, if this is the view they were made for
    /// and nothing wrote the storage since.
    pub(crate) fn channel_sums(&self) -> Option<Arc<Storage>> {
        let kept = lock(&self.0.storage.sums);
        let k = kept.as_ref()?;
        (k.version == self.version() && &k.layout == self.layout()).then(|| k.sums.clone())
    }

    /// True when this and `other` share storage.
    pub fn shares_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0.storage, &other.0.storage)
    }

    /// The address of this tensor's storage: equal for tensors that share one.
    pub(crate) fn storage_addr(&self) -> usize {
        Arc::as_ptr(&self.0.storage) as *const () as usize
    }

    /// Whether gradients flow to or through this tensor.
    pub fn is_requires_grad(&self) -> bool {
        self.0.node.is_some() || self.0.requires_grad.load(Ordering::Relaxed)
    }

    /// True for tensors not produced by a recorded op.
    pub fn is_leaf(&self) -> bool {
        self.0.node.is_none()
    }

    /// Marks a leaf as requiring grad (returns the same tensor, for chaining).
    pub fn requires_grad(self, on: bool) -> Result<Tensor> {
        if !self.is_leaf() {
            return Err(Error::Autograd(
                "requires_grad can only be set on a leaf; use detach() first".into(),
            ));
        }
        if on && !self.dtype().is_float() {
            return Err(Error::DType {
                op: "requires_grad",
                dtype: self.dtype(),
                expected: "a float dtype (only floats have gradients)",
            });
        }
        self.0.requires_grad.store(on, Ordering::Relaxed);
        Ok(self)
    }

    /// The accumulated gradient of a leaf, if any.
    pub fn grad(&self) -> Option<Tensor> {
        lock(&self.0.grad).clone()
    }

    /// Clears the accumulated gradient (frees its memory).
    pub fn zero_grad(&self) {
        *lock(&self.0.grad) = None;
    }

    /// Replaces the accumulated gradient.
    pub fn set_grad(&self, g: Option<Tensor>) -> Result<()> {
        if let Some(g) = &g {
            if g.shape() != self.shape() {
                return Err(Error::ShapeMismatch {
                    op: "set_grad",
                    lhs: self.shape().to_vec(),
                    rhs: g.shape().to_vec(),
                });
            }
        }
        *lock(&self.0.grad) = g;
        Ok(())
    }

    /// The same data, cut from the graph.
    pub fn detach(&self) -> Tensor {
        self.view_with(self.layout().clone())
    }

    /// Name of the op that produced this tensor (`None` for leaves).
    pub fn op_name(&self) -> Option<&'static str> {
        self.0.node.as_ref().map(|n| n.name)
    }

    /// Elements in row-major order as `T`, which must be this tensor's dtype.
    pub fn to_vec<T: WithDType>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype() {
            return Err(Error::DTypeMismatch {
                op: "to_vec",
                lhs: self.dtype(),
                rhs: T::DTYPE,
            });
        }
        // Read as stored (through f64, an i64 past 2^53 would round).
        Ok(bytemuck::pod_collect_to_vec(&self.to_le_bytes()?))
    }

    /// Elements in row-major order converted to f64.
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        // A device storage counts its own copy to the host.
        if self.device() == Device::Cpu {
            crate::counters::count_host_read();
        }
        crate::backend::cpu::host_can_hold(self.numel(), DType::F64)?;
        self.storage().to_f64_vec(self.layout())
    }

    /// The single value of a one-element tensor, as f64.
    pub fn item(&self) -> Result<f64> {
        if self.numel() != 1 {
            return Err(Error::invalid(
                "item",
                format!("needs exactly one element, shape is {:?}", self.shape()),
            ));
        }
        Ok(self.to_vec_f64()?[0])
    }

    /// Copies `src` into this tensor's elements in place (no graph is recorded; shapes must
    /// match, dtypes are converted). Meant for parameter and buffer updates: as in PyTorch,
    /// a tensor that requires grad (a parameter, or an op's output in the graph) is written
    /// only under [`crate::no_grad`], since the graph would not see the write.
    ///
    /// ```
    /// use mantissa::{no_grad, Tensor, Device};
    /// let w = Tensor::from_vec(vec![1.0f32, 2.0], &[2], Device::Cpu)?.requires_grad(true)?;
    /// let zeros = Tensor::from_vec(vec![0.0f32; 2], &[2], Device::Cpu)?;
    /// assert!(w.copy_(&zeros).is_err());
    /// no_grad(|| w.copy_(&zeros))?;
    /// assert_eq!(w.to_vec::<f32>()?, vec![0.0, 0.0]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn copy_(&self, src: &Tensor) -> Result<()> {
        if crate::is_grad_enabled() && self.is_requires_grad() {
            return Err(Error::invalid(
                "copy_",
                format!(
                    "cannot write in place into a {} {:?} that requires grad while grad mode \
                     is on (the graph would not see the write); wrap parameter updates in \
                     no_grad, or write into a detach()ed or cloned tensor",
                    if self.is_leaf() {
                        "leaf"
                    } else {
                        "recorded op's output"
                    },
                    self.shape()
                ),
            ));
        }
        if src.shape() != self.shape() {
            return Err(Error::ShapeMismatch {
                op: "copy_",
                lhs: self.shape().to_vec(),
                rhs: src.shape().to_vec(),
            });
        }
        if src.device() != self.device() {
            return Err(Error::DeviceMismatch {
                op: "copy_",
                lhs: self.device(),
                rhs: src.device(),
            });
        }
        let src = src.to_dtype(self.dtype())?;
        let s = src.storage();
        self.0
            .storage
            .write(|d| d.copy_into(self.layout(), &s, src.layout()))
    }
}

impl Tensor {
    /// True when the tensor's elements fill its whole storage in its memory format's order
    /// (row-major or channels-last): a tensor the fused optimizer may walk as a flat array.
    pub(crate) fn fills_storage(&self) -> bool {
        (self.is_contiguous() || self.is_channels_last())
            && self.layout().offset() == 0
            && self.storage().len() == self.numel()
    }

    /// This tensor when it fills its storage in row-major order, else a row-major copy (a
    /// `copy` node in the graph): what a kernel that walks a whole storage reads.
    pub(crate) fn row_major_whole(&self) -> Result<Tensor> {
        match self.is_contiguous() && self.fills_storage() {
            true => Ok(self.clone()),
            false => self.copy(),
        }
    }

    /// The range of its storage this tensor's elements fill, one each, in `format`'s order
    /// (row-major or channels-last), whatever else the storage holds (a gradient that is a
    /// view of a data-parallel bucket); `None` when they are not laid out so. What the fused
    /// optimizer may walk as a gradient, beside a parameter in `format`.
    pub(crate) fn range_in(&self, format: crate::MemoryFormat) -> Option<Range<usize>> {
        let laid =
            self.memory_format() == format && (self.is_contiguous() || self.is_channels_last());
        let at = self.layout().offset();
        laid.then(|| at..at + self.numel())
    }

    /// The range of its storage this tensor's elements fill, one each, in some dense order
    /// (row-major, channels-last, a transpose of either), whatever else the storage holds;
    /// `None` for a layout with gaps, overlaps or broadcast dims. What a pass that treats
    /// every element alike (the loss scaler's unscale, clipping) may walk in storage order.
    pub(crate) fn dense_range(&self) -> Option<Range<usize>> {
        let dense = self.is_contiguous() || self.layout().dense_order().is_some();
        let at = self.layout().offset();
        dense.then(|| at..at + self.numel())
    }

    /// True when nothing else can see this tensor's storage: no other handle to this tensor
    /// and no other tensor on its storage, so an in-place write changes this tensor only.
    pub(crate) fn is_sole_owner(&self) -> bool {
        Arc::strong_count(&self.0) == 1 && Arc::strong_count(&self.0.storage) == 1
    }

    /// This tensor's values as a tensor that fills its own storage in `format`'s order (this
    /// tensor itself when it already does).
    pub(crate) fn filled_in(&self, format: crate::MemoryFormat) -> Result<Tensor> {
        if self.fills_storage() && self.memory_format() == format {
            return Ok(self.clone());
        }
        let t = self.copy()?.to_memory_format(format)?;
        debug_assert!(t.fills_storage());
        Ok(t)
    }

    /// The elements' raw little-endian bytes, row-major (copied to the host).
    pub fn to_le_bytes(&self) -> Result<Vec<u8>> {
        // A device storage counts its own copy to the host (in `to_device`).
        if self.device() == Device::Cpu {
            crate::counters::count_host_read();
        }
        // The bytes, and the host copy of a view (the same count again).
        crate::backend::cpu::host_can_hold(self.numel().saturating_mul(2), self.dtype())?;
        let host = self.to_device(Device::Cpu)?;
        let storage = host.storage();
        let s = storage
            .as_cpu()
            .expect("to_device(Cpu) gives a host storage");
        Ok(s.to_le_bytes(host.layout()))
    }

    /// Runs `f` with write access to the storages of `tensors` (distinct storages only),
    /// bumping each version.
    pub(crate) fn write_many<R>(
        op: &'static str,
        tensors: &[&Tensor],
        f: impl FnOnce(&mut [&mut Storage]) -> Result<R>,
    ) -> Result<R> {
        // One pass over the storages' addresses (an optimizer step writes hundreds).
        let mut seen = std::collections::HashSet::with_capacity(tensors.len());
        if !tensors.iter().all(|t| seen.insert(t.storage_addr())) {
            return Err(Error::invalid(
                op,
                "the same storage appears twice among the written tensors",
            ));
        }
        let mut guards: Vec<_> = tensors
            .iter()
            .map(|t| {
                t.0.storage.version.fetch_add(1, Ordering::Relaxed);
                t.0.storage.data.write().unwrap_or_else(|e| e.into_inner())
            })
            .collect();
        let mut refs: Vec<&mut Storage> = guards
            .iter_mut()
            .map(|g| unique(g))
            .collect::<Result<_>>()?;
        f(&mut refs)
    }
}
