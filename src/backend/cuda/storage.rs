//! Tensor storage on a CUDA device: a block from the runtime's caching allocator, its dtype
//! and element count, and the transfers and copies every op builds on.
//!
//! tests/cuda_parity.rs checks transfers and casts bit for bit against the CPU.

use super::kernels::KernelFile;
use super::pinned::PinnedBuffer;
use super::profile::{elems, view_bytes};
use super::runtime::{runtime, CudaRuntime};
use crate::backend::host::CpuStorage;
use crate::layout::Layout;
use crate::profiler::DeviceWork;
use crate::{DType, Device, Error, Result};
use cudarc::driver::{result, sys, DeviceRepr, LaunchConfig, PushKernelArg};
use half::{bf16, f16};
use std::sync::Arc;

/// Uploads up to this size are staged whole through one block of the pinned pool (the host
/// does not wait); larger ones through a ring of pinned chunks
/// ([`STAGE_CHUNK_BYTES`](super::pinned::STAGE_CHUNK_BYTES)).
pub const STAGE_MAX_BYTES: usize = 64 << 20;

/// A device block, returned to the cache when the last storage using it is dropped.
struct Block {
    rt: Arc<CudaRuntime>,
    ptr: sys::CUdeviceptr,
}

impl Drop for Block {
    fn drop(&mut self) {
        // Every op runs on the runtime's compute stream, so work still queued on this block
        // is ordered before any later use of it there (an upload on the copy stream waits
        // for the compute work queued before it); a failed free only leaves it to the driver.
        let _ = self.rt.free(self.ptr);
    }
}

/// `len` elements of `dtype` on one CUDA device (f32, f16, bf16, and i64 / u8 for indices
/// and masks).
pub struct CudaStorage {
    block: Block,
    dtype: DType,
    len: usize,
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaStorage({} x {:?} on {})",
            self.len,
            self.dtype,
            self.rt().device()
        )
    }
}

/// The kernel-name suffix of a dtype (the C type in `cuda/prelude.cuh`).
pub(crate) fn kname(op: &'static str, dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "float",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::I64 => "i64",
        DType::U8 => "u8",
        DType::F64 => {
            return Err(Error::DType {
                op,
                dtype,
                expected: "f32, f16, bf16, i64 or u8 (no f64 on CUDA)",
            })
        }
    })
}

/// A float dtype's kernel suffix; integer storages are refused.
pub(crate) fn float_kname(op: &'static str, dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => kname(op, dtype),
        _ => Err(Error::DType {
            op,
            dtype,
            expected: "f32, f16 or bf16",
        }),
    }
}

/// A contiguous storage: the original, or a copy made for the op.
pub(crate) enum Dense<'a> {
    Borrowed(&'a CudaStorage),
    Owned(CudaStorage),
}

impl std::ops::Deref for Dense<'_> {
    type Target = CudaStorage;
    fn deref(&self) -> &CudaStorage {
        match self {
            Dense::Borrowed(s) => s,
            Dense::Owned(s) => s,
        }
    }
}

/// `cuda/prelude.cuh`'s `Strided`: a view's shape, strides and offset, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Strided {
    rank: i32,
    offset: i64,
    shape: [i64; 8],
    strides: [i64; 8],
}
// SAFETY: plain old data with the C layout the kernels declare (int, then 8-aligned i64s).
unsafe impl DeviceRepr for Strided {}

impl Strided {
    pub(crate) fn new(op: &'static str, l: &Layout) -> Result<Strided> {
        if l.rank() > 8 {
            return Err(Error::NotOnDevice {
                op,
                device: Device::Cuda(0),
                what: format!("views of rank {} (at most 8)", l.rank()),
            });
        }
        let mut s = Strided {
            rank: l.rank() as i32,
            offset: l.offset() as i64,
            shape: [1; 8],
            strides: [0; 8],
        };
        for (d, (&n, &st)) in l.shape().iter().zip(l.strides()).enumerate() {
            s.shape[d] = n as i64;
            s.strides[d] = st as i64;
        }
        Ok(s)
    }
}

/// One thread per element in blocks of 256, at most 65,535 blocks (kernels loop over the
/// rest).
pub(crate) fn grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n.max(1) as u64).div_ceil(256).min(65_535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block of 256 threads per row (at most 65,535 blocks; the kernels loop over rows).
pub(crate) fn rows_grid(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.clamp(1, 65_535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `Err` naming `op` and both dtypes when they differ.
pub(crate) fn same_dtype(op: &'static str, a: &CudaStorage, b: &CudaStorage) -> Result<()> {
    crate::backend::same_dtypes(op, a.dtype(), b.dtype())
}

/// A single thread: the scalar kernels (a step count, the loss scale) that must not race.
pub(crate) fn one_thread() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaStorage {
    /// An uninitialised storage of `len` elements on device `ordinal`.
    pub(crate) fn alloc(ordinal: usize, dtype: DType, len: usize) -> Result<CudaStorage> {
        let rt = runtime(ordinal)?;
        Self::alloc_on(&rt, dtype, len)
    }

    pub(crate) fn alloc_on(rt: &Arc<CudaRuntime>, dtype: DType, len: usize) -> Result<CudaStorage> {
        // The one place device byte sizes are made: checked here, so every later
        // `n * size_in_bytes()` and element address of this storage stays below isize::MAX.
        let bytes = crate::layout::checked_bytes("alloc", &[len], len, dtype)?;
        let (ptr, _) = rt.alloc(bytes.max(1))?;
        Ok(CudaStorage {
            block: Block {
                rt: rt.clone(),
                ptr,
            },
            dtype,
            len,
        })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn device(&self) -> Device {
        self.rt().device()
    }

    pub(crate) fn rt(&self) -> &Arc<CudaRuntime> {
        &self.block.rt
    }

    /// The address of element `offset`.
    pub(crate) fn ptr_at(&self, offset: usize) -> sys::CUdeviceptr {
        self.block.ptr + (offset * self.dtype.size_in_bytes()) as u64
    }

    pub(crate) fn ptr(&self) -> sys::CUdeviceptr {
        self.block.ptr
    }

    fn driver(&self, op: &'static str, e: cudarc::driver::DriverError) -> Error {
        Error::CudaDriver {
            op,
            device: self.device(),
            msg: e.to_string(),
        }
    }

    /// Copies the selected elements of a host storage to device `ordinal`, row-major. Up to
    /// [`STAGE_MAX_BYTES`] are copied into a pinned block from the runtime's pool and uploaded
    /// from there on the compute stream, and the host does not wait (the driver's own path
    /// for pageable memory may wait for the stream first). Larger uploads go through a ring
    /// of pinned chunks, the host copy of one overlapping the DMA of the one before
    /// ([`super::pinned::upload_chunked`]). When pinned memory runs out, the driver's
    /// pageable path.
    pub(crate) fn from_cpu(s: &CpuStorage, l: &Layout, ordinal: usize) -> Result<CudaStorage> {
        let rt = runtime(ordinal)?;
        rt.refuse_in_capture(
            "an upload from host memory (from_vec, to_device, a host fallback's result)",
            "a graph would read the host buffer at every replay; copy each batch into the \
             step's static inputs before replaying instead",
        )?;
        let host = if l.is_contiguous() && l.offset() == 0 && l.numel() == s.len() {
            std::borrow::Cow::Borrowed(s)
        } else {
            std::borrow::Cow::Owned(s.copy_strided(l))
        };
        kname("to_device", host.dtype())?;
        let out = Self::alloc_on(&rt, host.dtype(), l.numel())?;
        let bytes = host.as_bytes();
        if bytes.is_empty() {
            return Ok(out);
        }
        let staged = if bytes.len() <= STAGE_MAX_BYTES {
            super::pinned::staged(&rt, bytes)
                .and_then(|mut staging| staging.upload(out.ptr(), bytes.len(), rt.stream()))
        } else {
            super::pinned::upload_chunked(&rt, bytes, out.ptr(), rt.stream())
        };
        match staged {
            Ok(()) => return Ok(out),
            Err(Error::OutOfMemory { .. }) => {} // the pageable path below
            Err(e) => return Err(e),
        }
        rt.context()
            .bind_to_thread()
            .map_err(|e| out.driver("binding the context", e))?;
        let stream = rt.stream().cu_stream();
        let prof = super::profile::copy(&rt, rt.stream(), DeviceWork::HostToDevice, bytes.len());
        // SAFETY: `out` holds `bytes.len()` bytes; a pageable source is staged by the driver
        // before the call returns.
        unsafe { result::memcpy_htod_async(out.ptr(), bytes, stream) }
            .map_err(|e| out.driver("copying to the device", e))?;
        if let Some(p) = prof {
            p.end();
        }
        Ok(out)
    }

    /// `len` elements of `dtype` uploaded from the start of a pinned buffer on the compute
    /// stream. The host does not wait.
    pub(crate) fn from_pinned(
        buf: &mut PinnedBuffer,
        dtype: DType,
        len: usize,
    ) -> Result<CudaStorage> {
        kname("to_device", dtype)?;
        buf.runtime().refuse_in_capture(
            "an upload from a pinned buffer",
            "the buffer is reused for the next batch while the graph would read it at every \
             replay",
        )?;
        let out = Self::alloc_on(buf.runtime(), dtype, len)?;
        if len > 0 {
            buf.upload(out.ptr(), len * dtype.size_in_bytes(), out.rt().stream())?;
        }
        Ok(out)
    }

    /// `n` elements of `value` (rounded to `dtype` as the CPU rounds it), written by a memset
    /// of the element's bit pattern on the stream: no host buffer and no transfer, so
    /// `zeros` / `full` on a GPU cost a fill at memory bandwidth. A 64-bit pattern whose
    /// halves differ (an I64 other than 0 or -1) is uploaded instead.
    pub(crate) fn full(ordinal: usize, value: f64, n: usize, dtype: DType) -> Result<CudaStorage> {
        kname("full", dtype)?;
        let one = CpuStorage::full(value, 1, dtype)?.to_le_bytes(&Layout::contiguous(&[1]));
        let (lo, hi) = match one.len() {
            8 => (&one[..4], &one[4..]),
            _ => (&one[..], &one[..]),
        };
        let rt = runtime(ordinal)?;
        let out = Self::alloc_on(&rt, dtype, n)?;
        if n == 0 {
            return Ok(out);
        }
        rt.context()
            .bind_to_thread()
            .map_err(|e| out.driver("binding the context", e))?;
        let (ptr, stream) = (out.ptr(), rt.stream().cu_stream());
        let bytes = n * dtype.size_in_bytes();
        let word = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        // SAFETY: `out` holds `bytes` bytes on this device; the memsets are ordered on the
        // stream before any use of `out`. An 8-byte value whose halves differ is two strided
        // fills of 4-byte words (n rows 8 bytes apart, one word each): no host buffer, so a
        // CUDA graph can hold it.
        let r = unsafe {
            match lo.len() {
                _ if lo != hi => sys::cuMemsetD2D32Async(ptr, 8, word(lo), 1, n, stream)
                    .result()
                    .and_then(|()| {
                        sys::cuMemsetD2D32Async(ptr + 4, 8, word(hi), 1, n, stream).result()
                    }),
                1 => result::memset_d8_async(ptr, lo[0], bytes, stream),
                2 => sys::cuMemsetD16Async(
                    ptr,
                    u16::from_le_bytes([lo[0], lo[1]]),
                    bytes / 2,
                    stream,
                )
                .result(),
                _ => sys::cuMemsetD32Async(ptr, word(lo), bytes / 4, stream).result(),
            }
        };
        r.map_err(|e| out.driver("filling", e))?;
        Ok(out)
    }

    /// The selected elements, row-major, copied to the host (waits for the stream).
    pub(crate) fn to_cpu(&self, l: &Layout) -> Result<CpuStorage> {
        self.rt().refuse_in_capture(
            "a read into host memory (item, to_vec, to_device(cpu), a host fallback)",
            "the graph runs after the capture: the value does not exist yet",
        )?;
        // Every read of device data counts, the engine's own included (`host_reads`).
        crate::counters::count_host_read();
        let dense = self.contiguous(l)?;
        let src = dense.ptr();
        let stream = self.rt().stream().cu_stream();
        fn read<T: Clone + Default>(
            s: &CudaStorage,
            src: sys::CUdeviceptr,
            n: usize,
            stream: sys::CUstream,
        ) -> Result<Vec<T>> {
            let mut v = vec![T::default(); n];
            let bytes = n * std::mem::size_of::<T>();
            let prof =
                super::profile::copy(s.rt(), s.rt().stream(), DeviceWork::DeviceToHost, bytes);
            // SAFETY: `src` holds `n` elements of T; the copy into pageable memory completes
            // before the call returns, and the synchronize below covers any queued work.
            unsafe { result::memcpy_dtoh_async(&mut v, src, stream) }
                .map_err(|e| s.driver("copying to the host", e))?;
            if let Some(p) = prof {
                p.end();
            }
            s.rt().synchronize()?;
            Ok(v)
        }
        let n = l.numel();
        Ok(match self.dtype {
            DType::F32 => CpuStorage::F32(read::<f32>(self, src, n, stream)?),
            DType::F16 => CpuStorage::F16(read::<f16>(self, src, n, stream)?),
            DType::BF16 => CpuStorage::BF16(read::<bf16>(self, src, n, stream)?),
            DType::I64 => CpuStorage::I64(read::<i64>(self, src, n, stream)?),
            DType::U8 => CpuStorage::U8(read::<u8>(self, src, n, stream)?),
            DType::F64 => unreachable!("no f64 storage on CUDA"),
        })
    }

    /// A device copy of the whole storage (copy-on-write of a shared tensor).
    pub(crate) fn try_clone(&self) -> Result<CudaStorage> {
        let out = Self::alloc_on(self.rt(), self.dtype, self.len)?;
        self.dtod(out.ptr(), self.ptr(), self.len)?;
        Ok(out)
    }

    fn dtod(&self, dst: sys::CUdeviceptr, src: sys::CUdeviceptr, n: usize) -> Result<()> {
        if n == 0 {
            // An empty view's pointer may lie just past its block (or be an empty block's):
            // nothing to copy, and nothing for the driver to check.
            return Ok(());
        }
        self.rt()
            .context()
            .bind_to_thread()
            .map_err(|e| self.driver("binding the context", e))?;
        let bytes = n * self.dtype.size_in_bytes();
        let prof = super::profile::copy(
            self.rt(),
            self.rt().stream(),
            DeviceWork::DeviceToDevice,
            bytes,
        );
        // SAFETY: both ranges hold `n` elements on this device; the copy is stream-ordered.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.rt().stream().cu_stream()) }
            .map_err(|e| self.driver("copying on the device", e))?;
        if let Some(p) = prof {
            p.end();
        }
        Ok(())
    }

    /// Writes all of `src` (same dtype) over this storage's elements from `offset` on, by a
    /// device copy.
    pub(crate) fn write_at(&self, offset: usize, src: &CudaStorage) -> Result<()> {
        if src.dtype != self.dtype || offset + src.len > self.len {
            let (n, t, len, dt) = (src.len, src.dtype, self.len, self.dtype);
            let msg = format!("internal: writing {n} {t:?} values at {offset} of {len} {dt:?}");
            return Err(Error::invalid("copy", msg));
        }
        self.dtod(self.ptr_at(offset), src.ptr(), src.len)
    }

    /// The view `l` as a new contiguous storage (a device copy, or a strided-copy kernel).
    pub(crate) fn copy_strided(&self, l: &Layout) -> Result<CudaStorage> {
        let n = l.numel();
        let out = Self::alloc_on(self.rt(), self.dtype, n)?;
        if l.is_contiguous() {
            self.dtod(out.ptr(), self.ptr_at(l.offset()), n)?;
            return Ok(out);
        }
        let width = match self.dtype.size_in_bytes() {
            1 => "u8",
            2 => "u16",
            4 => "u32",
            _ => "u64",
        };
        let (src, st, dst, n64) = (self.ptr(), Strided::new("copy", l)?, out.ptr(), n as i64);
        // The kernel reads the view's elements and writes `n` of the same width.
        launch!(
            bytes = view_bytes(l, self.dtype) + elems(n, self.dtype);
            self, KernelFile::Cast, kname!("copy_strided_", width), grid(n), &src, &st, &dst, &n64
        );
        Ok(out)
    }

    /// `self` when the view is the whole storage in order, otherwise a contiguous copy.
    pub(crate) fn contiguous(&self, l: &Layout) -> Result<Dense<'_>> {
        if l.is_contiguous() && l.offset() == 0 && l.numel() == self.len {
            Ok(Dense::Borrowed(self))
        } else {
            Ok(Dense::Owned(self.copy_strided(l)?))
        }
    }

    /// The view converted to `dtype` (round to nearest even), contiguous.
    pub(crate) fn to_dtype(&self, l: &Layout, dtype: DType) -> Result<CudaStorage> {
        if dtype == self.dtype {
            return self.copy_strided(l);
        }
        let (from, to) = (kname("to_dtype", self.dtype)?, kname("to_dtype", dtype)?);
        let direct = matches!(self.dtype, DType::F32 | DType::F16 | DType::BF16)
            && matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
            || matches!(self.dtype, DType::I64 | DType::U8)
                && matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
            || self.dtype == DType::F32;
        if !direct {
            // Half to an integer type goes through f32, as on the CPU.
            let wide = self.to_dtype(l, DType::F32)?;
            return wide.to_dtype(&Layout::contiguous(&[wide.len]), dtype);
        }
        let n = l.numel();
        let out = Self::alloc_on(self.rt(), dtype, n)?;
        let (dst, n64) = (out.ptr(), n as i64);
        if l.is_contiguous() {
            let src = self.ptr_at(l.offset());
            // `n` elements in, `n` out, of the kernel's types.
            launch!(
                bytes = elems(n, self.dtype) + elems(n, dtype);
                self, KernelFile::Cast, kname!("cast_", from, "_", to), grid(n), &src, &dst, &n64
            );
        } else {
            let (src, st) = (self.ptr(), Strided::new("to_dtype", l)?);
            // As above, reading through the view.
            launch!(
                bytes = view_bytes(l, self.dtype) + elems(n, dtype);
                self, KernelFile::Cast, kname!("cast_strided_", from, "_", to), grid(n), &src, &st, &dst, &n64
            );
        }
        Ok(out)
    }

    /// Writes `src` (viewed by `sl`) into the view `dl` of this storage, on the device: a
    /// copy when `dl` is contiguous, a strided-write kernel otherwise (a narrowed or permuted
    /// part of a tensor, as `cat` writes). A view whose elements may share offsets goes
    /// through the host.
    pub(crate) fn copy_into(&mut self, dl: &Layout, src: &CudaStorage, sl: &Layout) -> Result<()> {
        let dense = src.to_dtype(sl, self.dtype)?;
        let n = dl.numel();
        if dl.is_contiguous() || n == 0 {
            return self.dtod(self.ptr_at(dl.offset()), dense.ptr(), n);
        }
        if overlaps(dl) {
            // Elements may share an offset (or interleave in a way the check cannot tell):
            // the host writes them in order, as the CPU backend does.
            let mut host = self.to_cpu(&Layout::contiguous(&[self.len]))?;
            let vals = dense.to_cpu(&Layout::contiguous(&[dense.len]))?;
            host.copy_into(dl, &vals, &Layout::contiguous(dl.shape()))?;
            *self = Self::from_cpu(&host, &Layout::contiguous(&[self.len]), self.ordinal())?;
            return Ok(());
        }
        let width = match self.dtype.size_in_bytes() {
            1 => "u8",
            2 => "u16",
            4 => "u32",
            _ => "u64",
        };
        let (src, st, dst, n64) = (
            dense.ptr(),
            Strided::new("copy_", dl)?,
            self.ptr(),
            n as i64,
        );
        // The kernel reads `n` elements of `dense` and writes the `n` distinct elements of
        // the view `dl`, which lies inside this storage.
        let name = kname!("copy_into_strided_", width);
        launch!(bytes = 2 * elems(n, self.dtype); self, KernelFile::Cast, name, grid(n), &src, &st, &dst, &n64);
        Ok(())
    }

    pub(crate) fn ordinal(&self) -> usize {
        match self.device() {
            Device::Cuda(n) => n,
            Device::Cpu => unreachable!("a CUDA storage is on a CUDA device"),
        }
    }
}

/// Whether two elements of `l` may share a storage offset: true when, with the dims sorted
/// by stride, one's stride does not clear the span of the dims inside it (a broadcast dim,
/// say). Conservative: a few interleaved layouts without overlap also answer true.
fn overlaps(l: &Layout) -> bool {
    let mut dims: Vec<(usize, usize)> = l
        .shape()
        .iter()
        .zip(l.strides())
        .filter(|(&d, _)| d > 1)
        .map(|(&d, &s)| (s, d))
        .collect();
    dims.sort_unstable();
    let mut span = 1;
    for (stride, size) in dims {
        if stride < span {
            return true;
        }
        span += stride * (size - 1);
    }
    false
}

#[cfg(test)]
mod tests {
    use super::overlaps;
    use crate::layout::Layout;

    #[test]
    fn overlap_check_tells_views_apart() {
        let base = Layout::contiguous(&[4, 6]);
        assert!(!overlaps(&base));
        assert!(!overlaps(&base.narrow("t", 1, 2, 3).unwrap()));
        assert!(!overlaps(&base.permute("t", &[1, 0]).unwrap()));
        let col = Layout::contiguous(&[4, 1]);
        assert!(overlaps(&col.broadcast_as("t", &[4, 5]).unwrap()));
        // Strides 2 and 3 over [2, 2] reach 0, 2, 3, 5: no overlap.
        assert!(!overlaps(&Layout::new(vec![2, 2], vec![3, 2], 0)));
        // Over [2, 3] they reach 4 twice.
        assert!(overlaps(&Layout::new(vec![2, 3], vec![2, 2], 0)));
    }
}
