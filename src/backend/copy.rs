//! Copies, casts, transfers and fills: the [`CopyOps`] family and its dispatch.

use super::{on_backend, on_device, Backend, BackendStorage, CpuStorage, CudaStorage, Storage};
use crate::layout::Layout;
use crate::{DType, Device, Result};

/// Copies and casts within one backend, and the storages it makes from nothing.
pub(crate) trait CopyOps: BackendStorage {
    /// A copy of the whole storage (copy-on-write of a shared tensor).
    fn try_clone(&self) -> Result<Self>;
    /// A contiguous copy of the elements `l` selects.
    fn copy_strided(&self, l: &Layout) -> Result<Self>;
    /// A contiguous copy of the elements `l` selects, converted to `dtype`.
    fn to_dtype(&self, l: &Layout, dtype: DType) -> Result<Self>;
    /// Copies the elements of `src` (under `sl`) into the places `dl` selects in `self`.
    fn copy_into(&mut self, dl: &Layout, src: &Self, sl: &Layout) -> Result<()>;
    /// [`CopyOps::copy_into`] of each `(dl, src, sl)`, the views `dl` not overlapping one
    /// another (`cat`'s inputs into the output). By default one at a time; a backend may
    /// batch them.
    fn copy_many_into(&mut self, parts: &[(&Layout, &Self, &Layout)]) -> Result<()> {
        for &(dl, src, sl) in parts {
            self.copy_into(dl, src, sl)?;
        }
        Ok(())
    }
    /// Every selected element as f64, row-major.
    fn to_f64_vec(&self, l: &Layout) -> Result<Vec<f64>>;
    /// `n` copies of `value` (rounded to `dtype`) on `device`.
    fn full(device: Device, value: f64, n: usize, dtype: DType) -> Result<Self>;
    /// `n` dropout multipliers of a float `dtype` on `device`: `scale` where the element's
    /// Philox word from block `start` of `seed`'s stream is at least `threshold`, else 0.
    fn dropout_mask(
        device: Device,
        n: usize,
        threshold: u64,
        scale: f64,
        stream: (u64, u64),
        dtype: DType,
    ) -> Result<Self>;
    /// `n` draws from N(`mean`, `std`²) of a float `dtype` on `device`: elements `2j` and
    /// `2j + 1` from block `start + j` of `seed`'s Philox stream (Box-Muller, as
    /// [`crate::Generator::normal`]).
    fn normal(
        device: Device,
        n: usize,
        mean: f64,
        std: f64,
        stream: (u64, u64),
        dtype: DType,
    ) -> Result<Self>;
}

impl Storage {
    /// A copy of the whole storage on the same device (copy-on-write of a shared tensor).
    pub(crate) fn try_clone(&self) -> Result<Storage> {
        on_backend!("clone", [self], B => Ok(CopyOps::try_clone(B::part(self))?.wrap()))
    }

    pub(crate) fn full(device: Device, value: f64, n: usize, dtype: DType) -> Result<Storage> {
        let device = device.check_available()?;
        on_device!(device, B => Ok(<B as CopyOps>::full(device, value, n, dtype)?.wrap()))
    }

    /// `n` dropout multipliers (see [`CopyOps::dropout_mask`]).
    pub(crate) fn dropout_mask(
        device: Device,
        n: usize,
        threshold: u64,
        scale: f64,
        stream: (u64, u64),
        dtype: DType,
    ) -> Result<Storage> {
        let device = device.check_available()?;
        on_device!(device, B => {
            let s = <B as CopyOps>::dropout_mask(device, n, threshold, scale, stream, dtype)?;
            Ok(s.wrap())
        })
    }

    /// `n` normal draws (see [`CopyOps::normal`]).
    pub(crate) fn normal(
        device: Device,
        n: usize,
        mean: f64,
        std: f64,
        stream: (u64, u64),
        dtype: DType,
    ) -> Result<Storage> {
        let device = device.check_available()?;
        on_device!(device, B => {
            Ok(<B as CopyOps>::normal(device, n, mean, std, stream, dtype)?.wrap())
        })
    }

    pub(crate) fn from_f64s(
        device: Device,
        values: impl Iterator<Item = f64>,
        dtype: DType,
    ) -> Result<Storage> {
        let device = device.check_available()?;
        Storage::place(CpuStorage::from_f64s(values, dtype)?, device)
    }

    /// The elements `layout` selects, contiguous, on `device`: a kernel copy within a device,
    /// a transfer between the host and a device, and through the host between two devices.
    pub(crate) fn to_device(&self, layout: &Layout, device: Device) -> Result<Storage> {
        let device = device.check_available()?;
        if device == self.device() {
            return self.copy_strided(layout);
        }
        match self {
            Storage::Cpu(s) => Ok(CudaStorage::from_host(s, layout, device)?.wrap()),
            Storage::Cuda(s) if device == Device::Cpu => Ok(Storage::Cpu(s.to_host(layout)?)),
            Storage::Cuda(s) => {
                let host = s.to_host(layout)?;
                let whole = Layout::contiguous(layout.shape());
                Ok(CudaStorage::from_host(&host, &whole, device)?.wrap())
            }
        }
    }

    pub(crate) fn copy_strided(&self, l: &Layout) -> Result<Storage> {
        on_backend!("contiguous", [self], B => Ok(CopyOps::copy_strided(B::part(self), l)?.wrap()))
    }

    pub(crate) fn to_dtype(&self, l: &Layout, dtype: DType) -> Result<Storage> {
        on_backend!("to_dtype", [self], B => Ok(CopyOps::to_dtype(B::part(self), l, dtype)?.wrap()))
    }

    pub(crate) fn copy_into(&mut self, dl: &Layout, src: &Storage, sl: &Layout) -> Result<()> {
        on_backend!("copy", [self, src], B => CopyOps::copy_into(B::part_mut(self), dl, B::part(src), sl))
    }

    /// See [`CopyOps::copy_many_into`]: every source on this storage's device.
    pub(crate) fn copy_many_into(&mut self, parts: &[(&Layout, &Storage, &Layout)]) -> Result<()> {
        let mut all: Vec<&Storage> = vec![&*self];
        all.extend(parts.iter().map(|p| p.1));
        let device = super::common_device("copy", &all)?;
        on_device!(device, B => {
            let parts: Vec<(&Layout, &B, &Layout)> =
                parts.iter().map(|&(dl, s, sl)| (dl, B::part(s), sl)).collect();
            CopyOps::copy_many_into(B::part_mut(self), &parts)
        })
    }

    /// Every selected element as f64, row-major (used for `to_vec` and printing).
    pub(crate) fn to_f64_vec(&self, l: &Layout) -> Result<Vec<f64>> {
        on_backend!("to_vec", [self], B => CopyOps::to_f64_vec(B::part(self), l))
    }
}
