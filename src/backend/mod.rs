//! Backends behind one interface: [`Storage`] is an enum over the backends' storages, and each
//! method here is the single place an op crosses from the device-independent op definitions
//! (`crate::ops`) into a device's kernels. The CUDA backend adds a variant and an arm per
//! method; op definitions do not change.

pub mod caching;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod ops;
pub mod rounding;

use crate::layout::Layout;
use crate::{DType, Device, Error, Result};
use cpu::CpuStorage;
pub(crate) use cpu::{ConvDims, PoolDims};
use ops::{BinaryOp, CmpOp, OptimUpdate, Pool2dParams, ReduceOp, UnaryOp};

/// A tensor's data on some device.
#[derive(Debug, Clone)]
pub enum Storage {
    Cpu(CpuStorage),
}

/// Unwraps same-device storages, or returns a device-mismatch error naming the op.
macro_rules! cpu2 {
    ($op:expr, $a:expr, $b:expr) => {
        match ($a, $b) {
            (Storage::Cpu(a), Storage::Cpu(b)) => (a, b),
        }
    };
}

impl Storage {
    pub fn device(&self) -> Device {
        match self {
            Storage::Cpu(_) => Device::Cpu,
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            Storage::Cpu(s) => s.dtype(),
        }
    }

    /// Number of elements held (not the number a view selects).
    pub fn len(&self) -> usize {
        match self {
            Storage::Cpu(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn full(device: Device, value: f64, n: usize, dtype: DType) -> Result<Storage> {
        match device.check_available()? {
            Device::Cpu => Ok(Storage::Cpu(CpuStorage::full(value, n, dtype))),
            d => Err(unavailable(d)),
        }
    }

    /// `n` dropout multipliers (see [`cpu::dropout_mask`]): `scale` where the element's Philox
    /// word from block `start` of `seed`'s stream is at least `threshold`, else 0.
    pub(crate) fn dropout_mask(
        device: Device,
        n: usize,
        threshold: u64,
        scale: f64,
        stream: (u64, u64),
        dtype: DType,
    ) -> Result<Storage> {
        match device.check_available()? {
            Device::Cpu => Ok(Storage::Cpu(cpu::dropout_mask(
                n, threshold, scale, stream, dtype,
            )?)),
            d => Err(unavailable(d)),
        }
    }

    pub(crate) fn from_f64s(
        device: Device,
        values: impl Iterator<Item = f64>,
        dtype: DType,
    ) -> Result<Storage> {
        match device.check_available()? {
            Device::Cpu => Ok(Storage::Cpu(CpuStorage::from_f64s(values, dtype))),
            d => Err(unavailable(d)),
        }
    }

    pub(crate) fn to_device(&self, layout: &Layout, device: Device) -> Result<Storage> {
        match (self, device.check_available()?) {
            (Storage::Cpu(s), Device::Cpu) => Ok(Storage::Cpu(s.copy_strided(layout))),
            (_, d) => Err(unavailable(d)),
        }
    }

    // The copies and conversions below cannot fail on the CPU; they return `Result` because
    // a device's can (a launch or a copy).
    pub(crate) fn copy_strided(&self, l: &Layout) -> Result<Storage> {
        match self {
            Storage::Cpu(s) => Ok(Storage::Cpu(s.copy_strided(l))),
        }
    }

    pub(crate) fn to_dtype(&self, l: &Layout, dtype: DType) -> Result<Storage> {
        match self {
            Storage::Cpu(s) => Ok(Storage::Cpu(s.to_dtype(l, dtype))),
        }
    }

    pub(crate) fn copy_into(&mut self, dl: &Layout, src: &Storage, sl: &Layout) -> Result<()> {
        let (d, s) = cpu2!("copy", self, src);
        d.copy_into(dl, s, sl)
    }

    /// Every selected element as f64, row-major (used for `to_vec` and printing).
    pub(crate) fn to_f64_vec(&self, l: &Layout) -> Result<Vec<f64>> {
        match self {
            Storage::Cpu(s) => Ok(s.to_f64_vec(l)),
        }
    }

    pub(crate) fn unary(&self, l: &Layout, op: UnaryOp) -> Result<Storage> {
        match self {
            Storage::Cpu(s) => Ok(Storage::Cpu(cpu::unary(s, l, op)?)),
        }
    }

    pub(crate) fn unary_grad(
        &self,
        l: &Layout,
        g: &Storage,
        lg: &Layout,
        op: UnaryOp,
    ) -> Result<Storage> {
        let (x, g) = cpu2!("unary_grad", self, g);
        Ok(Storage::Cpu(cpu::unary_grad(x, l, g, lg, op)?))
    }

    pub(crate) fn binary(
        &self,
        l: &Layout,
        rhs: &Storage,
        lr: &Layout,
        op: BinaryOp,
    ) -> Result<Storage> {
        let (a, b) = cpu2!("binary", self, rhs);
        Ok(Storage::Cpu(cpu::binary(a, l, b, lr, op)?))
    }

    pub(crate) fn cmp(&self, l: &Layout, rhs: &Storage, lr: &Layout, op: CmpOp) -> Result<Storage> {
        let (a, b) = cpu2!("cmp", self, rhs);
        Ok(Storage::Cpu(cpu::cmp(a, l, b, lr, op)?))
    }

    pub(crate) fn where_cond(
        &self,
        l: &Layout,
        a: &Storage,
        la: &Layout,
        b: &Storage,
        lb: &Layout,
    ) -> Result<Storage> {
        let (c, a) = cpu2!("where", self, a);
        let Storage::Cpu(b) = b;
        Ok(Storage::Cpu(cpu::where_cond(c, l, a, la, b, lb)?))
    }

    pub(crate) fn reduce(&self, l: &Layout, dims: &[usize], op: ReduceOp) -> Result<Storage> {
        match self {
            Storage::Cpu(s) => Ok(Storage::Cpu(cpu::reduce(s, l, dims, op)?)),
        }
    }

    pub(crate) fn matmul(&self, l: &Layout, rhs: &Storage, lr: &Layout) -> Result<Storage> {
        let (a, b) = cpu2!("matmul", self, rhs);
        Ok(Storage::Cpu(cpu::matmul(a, l, b, lr, None)?))
    }

    /// `self @ rhs + bias` with the bias added in the product's accumulator (a GEMM epilogue
    /// on CUDA): `bias` has as many elements as the product has columns.
    pub(crate) fn matmul_bias(
        &self,
        l: &Layout,
        rhs: &Storage,
        lr: &Layout,
        bias: &Storage,
        lb: &Layout,
    ) -> Result<Storage> {
        let (a, b) = cpu2!("linear", self, rhs);
        let (_, c) = cpu2!("linear", self, bias);
        Ok(Storage::Cpu(cpu::matmul(a, l, b, lr, Some((c, lb)))?))
    }

    /// Reads an I64 index tensor, checking each entry lies in `0..size`.
    pub(crate) fn indices(
        &self,
        op: &'static str,
        l: &Layout,
        dim: usize,
        size: usize,
    ) -> Result<Vec<usize>> {
        match self {
            Storage::Cpu(s) => cpu::index::indices(op, s, l, dim, size),
        }
    }

    pub(crate) fn index_select(&self, l: &Layout, dim: usize, idx: &[usize]) -> Result<Storage> {
        match self {
            Storage::Cpu(s) => Ok(Storage::Cpu(cpu::index_select(s, l, dim, idx))),
        }
    }

    pub(crate) fn gather(
        &self,
        l: &Layout,
        dim: usize,
        idx: &[usize],
        idx_shape: &[usize],
    ) -> Storage {
        match self {
            Storage::Cpu(s) => Storage::Cpu(cpu::gather(s, l, dim, idx, idx_shape)),
        }
    }

    pub(crate) fn scatter_add(
        &mut self,
        shape: &[usize],
        dim: usize,
        idx: &[usize],
        idx_shape: &[usize],
        src: &Storage,
        sl: &Layout,
    ) -> Result<()> {
        let (d, s) = cpu2!("scatter_add", self, src);
        cpu::scatter_add(d, shape, dim, idx, idx_shape, s, sl)
    }

    pub(crate) fn index_add(
        &mut self,
        shape: &[usize],
        dim: usize,
        idx: &[usize],
        src: &Storage,
        sl: &Layout,
    ) -> Result<()> {
        let (d, s) = cpu2!("index_add", self, src);
        cpu::index_add(d, shape, dim, idx, s, sl)
    }

    /// Applies a fused optimizer update in place (`self` is the parameter, or its f32 master
    /// when `working` is given: then the f16/bf16 working copy is written in the same pass)
    /// and counts it in `step`, unless `found_inf` holds a nonzero flag.
    pub(crate) fn optim_update(
        &mut self,
        grad: &Storage,
        states: &mut [&mut Storage],
        step: &mut Storage,
        found_inf: Option<&Storage>,
        u: &OptimUpdate,
        working: Option<(&mut Storage, rounding::Rounding)>,
    ) -> Result<()> {
        let Storage::Cpu(p) = self;
        let working = working.map(|(w, r)| match w {
            Storage::Cpu(c) => (c, r),
        });
        let Storage::Cpu(g) = grad;
        let Storage::Cpu(step) = step;
        let found_inf = found_inf.map(|f| match f {
            Storage::Cpu(c) => c,
        });
        let mut cpu: Vec<&mut CpuStorage> = states
            .iter_mut()
            .map(|s| match &mut **s {
                Storage::Cpu(c) => c,
            })
            .collect();
        cpu::optim_update(p, g, &mut cpu, step, found_inf, u, working)
    }

    /// Writes the f32 `master` into this f16/bf16 working copy with `rounding`, drawing the
    /// stochastic bits of the last update counted in `step` (an f32 scalar), as the update
    /// kernel did.
    pub(crate) fn round_from_master(
        &mut self,
        master: &Storage,
        rounding: rounding::Rounding,
        step: &Storage,
    ) -> Result<()> {
        let (_, step) = cpu2!("round_from_master", master, step);
        let (d, s) = cpu2!("round_from_master", self, master);
        cpu::round_into(d, s, rounding, step)
    }

    pub(crate) fn softmax(&self, l: &Layout, dim: usize, log: bool) -> Result<Storage> {
        match self {
            Storage::Cpu(s) if log => Ok(Storage::Cpu(cpu::log_softmax(s, l, dim)?)),
            Storage::Cpu(s) => Ok(Storage::Cpu(cpu::softmax(s, l, dim)?)),
        }
    }

    pub(crate) fn conv2d(
        &self,
        l: &Layout,
        w: &Storage,
        lw: &Layout,
        d: &ConvDims,
    ) -> Result<Storage> {
        let (x, w) = cpu2!("conv2d", self, w);
        Ok(Storage::Cpu(cpu::conv2d(x, l, w, lw, d)?))
    }

    pub(crate) fn conv2d_backward_input(
        &self,
        l: &Layout,
        w: &Storage,
        lw: &Layout,
        d: &ConvDims,
    ) -> Result<Storage> {
        let (g, w) = cpu2!("conv2d_backward_input", self, w);
        Ok(Storage::Cpu(cpu::conv2d_backward_input(g, l, w, lw, d)?))
    }

    pub(crate) fn conv2d_backward_weight(
        &self,
        l: &Layout,
        gy: &Storage,
        lg: &Layout,
        d: &ConvDims,
    ) -> Result<Storage> {
        let (x, g) = cpu2!("conv2d_backward_weight", self, gy);
        Ok(Storage::Cpu(cpu::conv2d_backward_weight(x, l, g, lg, d)?))
    }

    pub(crate) fn max_pool2d(
        &self,
        l: &Layout,
        d: &PoolDims,
        p: &Pool2dParams,
    ) -> Result<(Storage, Storage)> {
        match self {
            Storage::Cpu(s) => {
                let (v, i) = cpu::max_pool2d(s, l, d, p)?;
                Ok((Storage::Cpu(v), Storage::Cpu(i)))
            }
        }
    }

    pub(crate) fn max_pool2d_backward(
        &self,
        l: &Layout,
        idx: &Storage,
        d: &PoolDims,
    ) -> Result<Storage> {
        let (g, i) = cpu2!("max_pool2d_backward", self, idx);
        let CpuStorage::I64(i) = i else {
            return Err(Error::DType {
                op: "max_pool2d_backward",
                dtype: i.dtype(),
                expected: "I64 indices",
            });
        };
        Ok(Storage::Cpu(cpu::max_pool2d_backward(g, l, i, d)?))
    }

    pub(crate) fn avg_pool2d(&self, l: &Layout, d: &PoolDims, p: &Pool2dParams) -> Result<Storage> {
        match self {
            Storage::Cpu(s) => Ok(Storage::Cpu(cpu::avg_pool2d(s, l, d, p)?)),
        }
    }

    pub(crate) fn avg_pool2d_backward(
        &self,
        l: &Layout,
        d: &PoolDims,
        p: &Pool2dParams,
    ) -> Result<Storage> {
        match self {
            Storage::Cpu(s) => Ok(Storage::Cpu(cpu::avg_pool2d_backward(s, l, d, p)?)),
        }
    }

    pub(crate) fn adaptive_avg_pool2d(
        &self,
        l: &Layout,
        d: &PoolDims,
        backward: bool,
    ) -> Result<Storage> {
        match self {
            Storage::Cpu(s) if backward => {
                Ok(Storage::Cpu(cpu::adaptive_avg_pool2d_backward(s, l, d)?))
            }
            Storage::Cpu(s) => Ok(Storage::Cpu(cpu::adaptive_avg_pool2d(s, l, d)?)),
        }
    }
}

fn unavailable(device: Device) -> Error {
    Error::CudaUnavailable {
        device,
        reason: "no backend for this device in this build".into(),
    }
}
