//! Backends behind one interface: [`Storage`] is an enum over the backends' storages, and each
//! method here is the single place an op crosses from the device-independent op definitions
//! (`crate::ops`) into a device's kernels. The CUDA backend adds a variant and an arm per
//! method; op definitions do not change.

pub mod caching;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub(crate) mod host;
mod loss;
pub(crate) mod norm;
pub mod ops;
pub mod rounding;
pub(crate) mod spec;

use crate::layout::Layout;
use crate::{DType, Device, Error, Result};
use cpu::CpuStorage;
#[cfg(feature = "cuda")]
use cuda::storage::CudaStorage;
use ops::{BinaryOp, CmpOp, OptimUpdate, Pool2dParams, ReduceOp, UnaryOp};
pub(crate) use spec::{CellGrads, ConvDims, PoolDims};

/// A tensor's data on some device.
#[derive(Debug)]
pub enum Storage {
    Cpu(CpuStorage),
    #[cfg(feature = "cuda")]
    Cuda(CudaStorage),
}

/// Unwraps two same-device storages into `Cpu(a, b)` or `Cuda(a, b)`, or returns a
/// device-mismatch error naming the op.
enum Pair<'a> {
    Cpu(&'a CpuStorage, &'a CpuStorage),
    #[cfg(feature = "cuda")]
    Cuda(&'a CudaStorage, &'a CudaStorage),
}

fn pair<'a>(op: &'static str, a: &'a Storage, b: &'a Storage) -> Result<Pair<'a>> {
    #[allow(unreachable_patterns)]
    match (a, b) {
        (Storage::Cpu(x), Storage::Cpu(y)) => Ok(Pair::Cpu(x, y)),
        #[cfg(feature = "cuda")]
        (Storage::Cuda(x), Storage::Cuda(y)) if x.device() == y.device() => Ok(Pair::Cuda(x, y)),
        _ => Err(Error::DeviceMismatch {
            op,
            lhs: a.device(),
            rhs: b.device(),
        }),
    }
}

/// `Err` naming `op` and both dtypes when they differ (the backends' operand check).
pub(crate) fn same_dtypes(op: &'static str, a: DType, b: DType) -> Result<()> {
    if a != b {
        return Err(Error::DTypeMismatch { op, lhs: a, rhs: b });
    }
    Ok(())
}

/// The one device of `storages`, or a device-mismatch error naming the op.
fn common_device(op: &'static str, storages: &[&Storage]) -> Result<Device> {
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

/// Checks that the product of `[.., m, k]` and `[.., k, n]` views has a representable
/// output `[.., m, n]` (two expanded operands can each be small in memory while `m * n`
/// overflows) before a kernel sizes its output from it; on the host, that it can be held.
fn product_fits(op: &'static str, s: &Storage, l: &Layout, lr: &Layout) -> Result<()> {
    let (a, b) = (l.shape(), lr.shape());
    let mut out = a[..a.len().saturating_sub(1)].to_vec();
    out.extend(b.last());
    let n = crate::layout::checked_numel(op, &out)?;
    crate::layout::checked_bytes(op, &out, n, s.dtype())?;
    match s {
        Storage::Cpu(_) => cpu::host_can_hold(n, s.dtype()),
        #[cfg(feature = "cuda")]
        Storage::Cuda(_) => Ok(()),
    }
}

impl Storage {
    pub fn device(&self) -> Device {
        match self {
            Storage::Cpu(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.device(),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            Storage::Cpu(s) => s.dtype(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.dtype(),
        }
    }

    /// Number of elements held (not the number a view selects).
    pub fn len(&self) -> usize {
        match self {
            Storage::Cpu(s) => s.len(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The host storage, if this is one.
    pub(crate) fn as_cpu(&self) -> Option<&CpuStorage> {
        match self {
            Storage::Cpu(s) => Some(s),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => None,
        }
    }

    pub(crate) fn as_cpu_mut(&mut self) -> Option<&mut CpuStorage> {
        match self {
            Storage::Cpu(s) => Some(s),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => None,
        }
    }

    #[cfg(feature = "cuda")]
    fn as_cuda(&self) -> Option<&CudaStorage> {
        match self {
            Storage::Cuda(s) => Some(s),
            _ => None,
        }
    }

    #[cfg(feature = "cuda")]
    fn as_cuda_mut(&mut self) -> Option<&mut CudaStorage> {
        match self {
            Storage::Cuda(s) => Some(s),
            _ => None,
        }
    }

    /// A copy of the whole storage on the same device (copy-on-write of a shared tensor).
    pub(crate) fn try_clone(&self) -> Result<Storage> {
        match self {
            Storage::Cpu(s) => Ok(Storage::Cpu(s.clone())),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => Ok(Storage::Cuda(s.try_clone()?)),
        }
    }

    /// The whole storage on the host: borrowed on the CPU, downloaded from a device. Ops
    /// without a device kernel yet run on the host this way and [`Storage::place`] their
    /// result back (correct, and slow: a transfer each way).
    fn host(&self) -> Result<std::borrow::Cow<'_, CpuStorage>> {
        match self {
            Storage::Cpu(s) => Ok(std::borrow::Cow::Borrowed(s)),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => Ok(std::borrow::Cow::Owned(
                s.to_cpu(&Layout::contiguous(&[s.len()]))?,
            )),
        }
    }

    /// A host storage moved to `device` (whole, in order).
    fn place(s: CpuStorage, device: Device) -> Result<Storage> {
        match device {
            Device::Cpu => Ok(Storage::Cpu(s)),
            #[cfg(feature = "cuda")]
            Device::Cuda(n) => Ok(Storage::Cuda(CudaStorage::from_cpu(
                &s,
                &Layout::contiguous(&[s.len()]),
                n,
            )?)),
            #[cfg(not(feature = "cuda"))]
            d => Err(unavailable(d)),
        }
    }

    pub(crate) fn full(device: Device, value: f64, n: usize, dtype: DType) -> Result<Storage> {
        match device.check_available()? {
            #[cfg(feature = "cuda")]
            Device::Cuda(o) => Ok(Storage::Cuda(CudaStorage::full(o, value, n, dtype)?)),
            d => Storage::place(CpuStorage::full(value, n, dtype)?, d),
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
            #[cfg(feature = "cuda")]
            Device::Cuda(o) => Ok(Storage::Cuda(cuda::ops::dropout_mask(
                o, n, threshold, scale, stream, dtype,
            )?)),
            #[cfg(not(feature = "cuda"))]
            d => Err(unavailable(d)),
        }
    }

    pub(crate) fn from_f64s(
        device: Device,
        values: impl Iterator<Item = f64>,
        dtype: DType,
    ) -> Result<Storage> {
        let device = device.check_available()?;
        Storage::place(CpuStorage::from_f64s(values, dtype)?, device)
    }

    pub(crate) fn to_device(&self, layout: &Layout, device: Device) -> Result<Storage> {
        match (self, device.check_available()?) {
            (Storage::Cpu(_), Device::Cpu) => self.copy_strided(layout),
            #[cfg(feature = "cuda")]
            (Storage::Cpu(s), Device::Cuda(n)) => {
                Ok(Storage::Cuda(CudaStorage::from_cpu(s, layout, n)?))
            }
            #[cfg(feature = "cuda")]
            (Storage::Cuda(s), Device::Cpu) => Ok(Storage::Cpu(s.to_cpu(layout)?)),
            #[cfg(feature = "cuda")]
            (Storage::Cuda(s), d) if d == s.device() => Ok(Storage::Cuda(s.copy_strided(layout)?)),
            #[cfg(feature = "cuda")]
            (Storage::Cuda(s), Device::Cuda(n)) => Ok(Storage::Cuda(CudaStorage::from_cpu(
                &s.to_cpu(layout)?,
                &Layout::contiguous(layout.shape()),
                n,
            )?)),
            #[cfg(not(feature = "cuda"))]
            (_, d) => Err(unavailable(d)),
        }
    }

    pub(crate) fn copy_strided(&self, l: &Layout) -> Result<Storage> {
        match self {
            Storage::Cpu(s) => {
                cpu::host_can_hold(l.numel(), s.dtype())?;
                Ok(Storage::Cpu(s.copy_strided(l)))
            }
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => Ok(Storage::Cuda(s.copy_strided(l)?)),
        }
    }

    pub(crate) fn to_dtype(&self, l: &Layout, dtype: DType) -> Result<Storage> {
        match self {
            Storage::Cpu(s) => {
                cpu::host_can_hold(l.numel(), dtype)?;
                Ok(Storage::Cpu(s.to_dtype(l, dtype)))
            }
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => Ok(Storage::Cuda(s.to_dtype(l, dtype)?)),
        }
    }

    pub(crate) fn copy_into(&mut self, dl: &Layout, src: &Storage, sl: &Layout) -> Result<()> {
        #[allow(unreachable_patterns)]
        match (&mut *self, src) {
            (Storage::Cpu(d), Storage::Cpu(s)) => d.copy_into(dl, s, sl),
            #[cfg(feature = "cuda")]
            (Storage::Cuda(d), Storage::Cuda(s)) if d.device() == s.device() => {
                d.copy_into(dl, s, sl)
            }
            (d, s) => Err(Error::DeviceMismatch {
                op: "copy",
                lhs: d.device(),
                rhs: s.device(),
            }),
        }
    }

    /// Every selected element as f64, row-major (used for `to_vec` and printing).
    pub(crate) fn to_f64_vec(&self, l: &Layout) -> Result<Vec<f64>> {
        match self {
            Storage::Cpu(s) => Ok(s.to_f64_vec(l)),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => Ok(s.to_cpu(l)?.to_f64_vec(&Layout::contiguous(l.shape()))),
        }
    }

    pub(crate) fn unary(&self, l: &Layout, op: UnaryOp) -> Result<Storage> {
        match self {
            Storage::Cpu(s) => {
                cpu::host_can_hold(l.numel(), s.dtype())?;
                Ok(Storage::Cpu(cpu::unary(s, l, op)?))
            }
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => Ok(Storage::Cuda(cuda::ops::unary(s, l, op)?)),
        }
    }

    pub(crate) fn unary_grad(
        &self,
        l: &Layout,
        g: &Storage,
        lg: &Layout,
        op: UnaryOp,
    ) -> Result<Storage> {
        match pair("unary_grad", self, g)? {
            Pair::Cpu(x, g) => Ok(Storage::Cpu(cpu::unary_grad(x, l, g, lg, op)?)),
            #[cfg(feature = "cuda")]
            Pair::Cuda(x, g) => Ok(Storage::Cuda(cuda::ops::unary_grad(x, l, g, lg, op)?)),
        }
    }

    pub(crate) fn binary(
        &self,
        l: &Layout,
        rhs: &Storage,
        lr: &Layout,
        op: BinaryOp,
    ) -> Result<Storage> {
        match pair("binary", self, rhs)? {
            Pair::Cpu(a, b) => {
                cpu::host_can_hold(l.numel(), a.dtype())?;
                Ok(Storage::Cpu(cpu::binary(a, l, b, lr, op)?))
            }
            #[cfg(feature = "cuda")]
            Pair::Cuda(a, b) => Ok(Storage::Cuda(cuda::ops::binary(a, l, b, lr, op)?)),
        }
    }

    pub(crate) fn cmp(&self, l: &Layout, rhs: &Storage, lr: &Layout, op: CmpOp) -> Result<Storage> {
        match pair("cmp", self, rhs)? {
            Pair::Cpu(a, b) => {
                cpu::host_can_hold(l.numel(), DType::U8)?;
                Ok(Storage::Cpu(cpu::cmp(a, l, b, lr, op)?))
            }
            #[cfg(feature = "cuda")]
            Pair::Cuda(a, b) => Ok(Storage::Cuda(cuda::ops::cmp(a, l, b, lr, op)?)),
        }
    }

    pub(crate) fn where_cond(
        &self,
        l: &Layout,
        a: &Storage,
        la: &Layout,
        b: &Storage,
        lb: &Layout,
    ) -> Result<Storage> {
        common_device("where", &[self, a, b])?;
        match (pair("where", self, a)?, b) {
            (Pair::Cpu(c, a), Storage::Cpu(b)) => {
                Ok(Storage::Cpu(cpu::where_cond(c, l, a, la, b, lb)?))
            }
            #[cfg(feature = "cuda")]
            (Pair::Cuda(c, a), Storage::Cuda(b)) => {
                Ok(Storage::Cuda(cuda::ops::where_cond(c, l, a, la, b, lb)?))
            }
            #[allow(unreachable_patterns)]
            _ => unreachable!("common_device checked the devices"),
        }
    }

    pub(crate) fn reduce(&self, l: &Layout, dims: &[usize], op: ReduceOp) -> Result<Storage> {
        match self {
            Storage::Cpu(s) => Ok(Storage::Cpu(cpu::reduce(s, l, dims, op)?)),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => Ok(Storage::Cuda(cuda::ops::reduce(s, l, dims, op)?)),
        }
    }

    pub(crate) fn matmul(&self, l: &Layout, rhs: &Storage, lr: &Layout) -> Result<Storage> {
        product_fits("matmul", self, l, lr)?;
        match pair("matmul", self, rhs)? {
            Pair::Cpu(a, b) => Ok(Storage::Cpu(cpu::matmul(a, l, b, lr, None)?)),
            #[cfg(feature = "cuda")]
            Pair::Cuda(a, b) => Ok(Storage::Cuda(cuda::ops::matmul(a, l, b, lr, None)?)),
        }
    }

    /// `relu(self @ rhs + bias)` in one fused call where the device has one (cuBLASLt's
    /// ReLU-bias epilogue on CUDA); `None` where it has not (the CPU), and the caller
    /// composes the ops.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(crate) fn linear_relu(
        &self,
        l: &Layout,
        rhs: &Storage,
        lr: &Layout,
        bias: &Storage,
        lb: &Layout,
    ) -> Result<Option<Storage>> {
        common_device("linear_relu", &[self, rhs, bias])?;
        product_fits("linear_relu", self, l, lr)?;
        match (pair("linear_relu", self, rhs)?, bias) {
            (Pair::Cpu(..), _) => Ok(None),
            #[cfg(feature = "cuda")]
            (Pair::Cuda(a, b), Storage::Cuda(c)) => {
                Ok(cuda::ops::linear_relu(a, l, b, lr, (c, lb))?.map(Storage::Cuda))
            }
            #[allow(unreachable_patterns)]
            _ => unreachable!("common_device checked the devices"),
        }
    }

    /// `self[ld] += a @ b` in place: `a [m, k]`, `b [k, n]`, and a destination view
    /// `[m, n]` with unit-stride rows (an LSTM layer adds each step's recurrent product onto
    /// its input projection this way; on CUDA it is one cuBLAS call with `beta = 1`).
    pub(crate) fn matmul_acc(
        &mut self,
        ld: &Layout,
        a: &Storage,
        la: &Layout,
        b: &Storage,
        lb: &Layout,
    ) -> Result<()> {
        let op = "matmul (accumulate)";
        common_device(op, &[&*self, a, b])?;
        let (sa, sb, sd) = (la.shape(), lb.shape(), ld.shape());
        let fits = sa.len() == 2
            && sb.len() == 2
            && sa[1] == sb[0]
            && sd == [sa[0], sb[1]]
            && (ld.strides()[1] == 1 || sd[1] <= 1)
            && (sd[0] <= 1 || ld.strides()[0] >= sd[1]);
        if !fits {
            return Err(Error::invalid(
                op,
                format!(
                    "{sa:?} @ {sb:?} onto a [{}] view with strides {:?}",
                    sd.iter()
                        .map(|d| d.to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                    ld.strides()
                ),
            ));
        }
        match (self, a, b) {
            (Storage::Cpu(d), Storage::Cpu(x), Storage::Cpu(y)) => {
                cpu::matmul_acc(d, ld, x, la, y, lb)
            }
            #[cfg(feature = "cuda")]
            (Storage::Cuda(d), Storage::Cuda(x), Storage::Cuda(y)) => {
                cuda::ops::matmul_acc(d, ld, x, la, y, lb)
            }
            #[allow(unreachable_patterns)]
            _ => unreachable!("common_device checked the devices"),
        }
    }

    /// `self @ rhs + bias` with the bias added in the product's accumulator (on CUDA the
    /// output starts as the bias rows and cuBLAS adds the product, `beta = 1`): `bias` has as
    /// many elements as the product has columns.
    pub(crate) fn matmul_bias(
        &self,
        l: &Layout,
        rhs: &Storage,
        lr: &Layout,
        bias: &Storage,
        lb: &Layout,
    ) -> Result<Storage> {
        common_device("linear", &[self, rhs, bias])?;
        product_fits("linear", self, l, lr)?;
        match (pair("linear", self, rhs)?, bias) {
            (Pair::Cpu(a, b), Storage::Cpu(c)) => {
                Ok(Storage::Cpu(cpu::matmul(a, l, b, lr, Some((c, lb)))?))
            }
            #[cfg(feature = "cuda")]
            (Pair::Cuda(a, b), Storage::Cuda(c)) => Ok(Storage::Cuda(cuda::ops::matmul(
                a,
                l,
                b,
                lr,
                Some((c, lb)),
            )?)),
            #[allow(unreachable_patterns)]
            _ => unreachable!("common_device checked the devices"),
        }
    }

    /// `x[.., idx[i], ..]` along `dim`, for a 1-D I64 `idx` on the same device. On the CPU
    /// an index out of range is an `Err` here; on CUDA the kernel finds it and the next read
    /// of device data reports it.
    pub(crate) fn index_select(
        &self,
        l: &Layout,
        dim: usize,
        idx: &Storage,
        il: &Layout,
    ) -> Result<Storage> {
        match pair("index_select", self, idx)? {
            Pair::Cpu(x, i) => {
                let ids = host::indices("index_select", i, il, dim, l.shape()[dim])?;
                Ok(Storage::Cpu(cpu::index_select(x, l, dim, &ids)))
            }
            #[cfg(feature = "cuda")]
            Pair::Cuda(x, i) => Ok(Storage::Cuda(cuda::index::index_select(x, l, dim, i, il)?)),
        }
    }

    /// `out[p] = x[p with p[dim] = idx[p]]` over the index's shape (errors as index_select).
    pub(crate) fn gather(
        &self,
        l: &Layout,
        dim: usize,
        idx: &Storage,
        il: &Layout,
    ) -> Result<Storage> {
        match pair("gather", self, idx)? {
            Pair::Cpu(x, i) => {
                let ids = host::indices("gather", i, il, dim, l.shape()[dim])?;
                Ok(Storage::Cpu(cpu::gather(x, l, dim, &ids, il.shape())))
            }
            #[cfg(feature = "cuda")]
            Pair::Cuda(x, i) => Ok(Storage::Cuda(cuda::index::gather(x, l, dim, i, il)?)),
        }
    }

    /// Runs an in-place host op on this storage (a device storage is downloaded, updated and
    /// uploaded again).
    fn update_on_host(&mut self, f: impl FnOnce(&mut CpuStorage) -> Result<()>) -> Result<()> {
        match self {
            Storage::Cpu(s) => f(s),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => {
                let mut host = self.host()?.into_owned();
                f(&mut host)?;
                *self = Storage::place(host, self.device())?;
                Ok(())
            }
        }
    }

    /// `self[p with p[dim] = idx[p]] += src[p]` over the index's shape; `self` is contiguous
    /// `shape`.
    pub(crate) fn scatter_add(
        &mut self,
        shape: &[usize],
        dim: usize,
        (idx, il): (&Storage, &Layout),
        (src, sl): (&Storage, &Layout),
    ) -> Result<()> {
        common_device("scatter_add", &[self, idx, src])?;
        #[cfg(feature = "cuda")]
        if let (Storage::Cuda(d), Storage::Cuda(i), Storage::Cuda(s)) = (&mut *self, idx, src) {
            if d.dtype().is_float() {
                return cuda::index::scatter_add(d, shape, dim, i, il, s, sl);
            }
        }
        // Integer sums on a device go through the host.
        let (s, i) = (src.host()?, idx.host()?);
        let ids = host::indices("scatter_add", &i, il, dim, shape[dim])?;
        self.update_on_host(|d| cpu::scatter_add(d, shape, dim, &ids, il.shape(), &s, sl))
    }

    /// `self[.., idx[i], ..] += src[.., i, ..]` along `dim`; `self` is contiguous `shape`.
    pub(crate) fn index_add(
        &mut self,
        shape: &[usize],
        dim: usize,
        (idx, il): (&Storage, &Layout),
        (src, sl): (&Storage, &Layout),
    ) -> Result<()> {
        common_device("index_add", &[self, idx, src])?;
        #[cfg(feature = "cuda")]
        if let (Storage::Cuda(d), Storage::Cuda(i), Storage::Cuda(s)) = (&mut *self, idx, src) {
            if d.dtype().is_float() {
                return cuda::index::index_add(d, shape, dim, i, il, s, sl);
            }
        }
        // Integer sums on a device go through the host.
        let (s, i) = (src.host()?, idx.host()?);
        let ids = host::indices("index_add", &i, il, dim, shape[dim])?;
        self.update_on_host(|d| cpu::index_add(d, shape, dim, &ids, &s, sl))
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
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))] mut working: Option<(
            &mut Storage,
            rounding::Rounding,
        )>,
    ) -> Result<()> {
        let mut all: Vec<&Storage> = vec![&*self, grad, &*step];
        all.extend(states.iter().map(|s| &**s));
        all.extend(found_inf);
        if let Some((w, _)) = &working {
            all.push(&**w);
        }
        let device = common_device("optim_update", &all)?;
        if device == Device::Cpu {
            const ALL_CPU: &str = "common_device: all on the CPU";
            let g = grad.as_cpu().expect(ALL_CPU);
            let found_inf = found_inf.map(|f| f.as_cpu().expect(ALL_CPU));
            let step = step.as_cpu_mut().expect(ALL_CPU);
            let p = self.as_cpu_mut().expect(ALL_CPU);
            let working = working.map(|(w, r)| (w.as_cpu_mut().expect(ALL_CPU), r));
            let mut host: Vec<&mut CpuStorage> = states
                .iter_mut()
                .map(|s| s.as_cpu_mut().expect(ALL_CPU))
                .collect();
            return cpu::optim_update(p, g, &mut host, step, found_inf, u, working);
        }
        #[cfg(feature = "cuda")]
        {
            const ALL_CUDA: &str = "common_device: all on one CUDA device";
            let mut st: Vec<&mut CudaStorage> = states
                .iter_mut()
                .map(|s| s.as_cuda_mut().expect(ALL_CUDA))
                .collect();
            let done = cuda::optim::optim_update(
                self.as_cuda_mut().expect(ALL_CUDA),
                grad.as_cuda().expect(ALL_CUDA),
                &mut st,
                step.as_cuda_mut().expect(ALL_CUDA),
                found_inf.map(|f| f.as_cuda().expect(ALL_CUDA)),
                u,
                working
                    .as_mut()
                    .map(|(w, r)| (w.as_cuda_mut().expect(ALL_CUDA), *r)),
            )?;
            if done {
                return Ok(());
            }
        }
        // No kernel for these dtypes: the whole update on host copies, written back.
        let g = grad.host()?;
        let found = match found_inf {
            Some(f) => Some(f.host()?),
            None => None,
        };
        let mut p = self.host()?.into_owned();
        let mut st = step.host()?.into_owned();
        let mut hs: Vec<CpuStorage> = states
            .iter()
            .map(|s| s.host().map(|h| h.into_owned()))
            .collect::<Result<_>>()?;
        let (mut w, r) = match &working {
            Some((w, r)) => (Some(w.host()?.into_owned()), Some(*r)),
            None => (None, None),
        };
        {
            let mut refs: Vec<&mut CpuStorage> = hs.iter_mut().collect();
            let wk = w.as_mut().zip(r);
            cpu::optim_update(&mut p, &g, &mut refs, &mut st, found.as_deref(), u, wk)?;
        }
        *self = Storage::place(p, device)?;
        *step = Storage::place(st, device)?;
        for (s, h) in states.iter_mut().zip(hs) {
            **s = Storage::place(h, device)?;
        }
        if let (Some((dst, _)), Some(h)) = (working, w) {
            *dst = Storage::place(h, device)?;
        }
        Ok(())
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
        common_device("round_from_master", &[self, master, step])?;
        #[cfg(feature = "cuda")]
        if let (Storage::Cuda(w), Storage::Cuda(m), Storage::Cuda(st)) = (&mut *self, master, step)
        {
            if cuda::optim::round_from_master(w, m, rounding, st)? {
                return Ok(());
            }
        }
        let (m, st) = (master.host()?, step.host()?);
        self.update_on_host(|d| cpu::round_into(d, &m, rounding, &st))
    }

    /// PyTorch's `_amp_foreach_non_finite_check_and_unscale_` for one gradient (`self`, walked
    /// in storage order): every element times `inv_scale` (an f32 scalar), stored as `out`
    /// (the gradient's dtype or f32) in the same order; `found_inf` (an f32 scalar) becomes 1
    /// when an element is inf or NaN and is left as it is otherwise. One pass, no host read
    /// on CUDA.
    pub(crate) fn unscale_grad(
        &self,
        inv_scale: &Storage,
        found_inf: &mut Storage,
        out: DType,
    ) -> Result<Storage> {
        const OP: &str = "GradScaler::unscale_";
        let device = common_device(OP, &[self, inv_scale, found_inf])?;
        #[cfg(feature = "cuda")]
        if let (Storage::Cuda(g), Storage::Cuda(inv), Storage::Cuda(f)) =
            (self, inv_scale, &*found_inf)
        {
            return Ok(Storage::Cuda(cuda::amp::unscale_grad(g, inv, f, out)?));
        }
        let inv = cpu::amp::scalar_f32(&*inv_scale.host()?, OP)?;
        cpu::amp::scalar_f32(&*found_inf.host()?, OP)?;
        let (o, bad) = cpu::amp::unscale(&*self.host()?, inv, out)?;
        if bad {
            *found_inf = Storage::place(CpuStorage::F32(vec![1.0]), device)?;
        }
        Storage::place(o, device)
    }

    /// PyTorch's `_amp_update_scale_` on the scaler's f32 scalars (`self` is the scale): back
    /// off after an overflow, else grow every `interval` clean steps while finite.
    pub(crate) fn update_scale(
        &mut self,
        tracker: &mut Storage,
        found_inf: &Storage,
        growth: f64,
        backoff: f64,
        interval: usize,
    ) -> Result<()> {
        const OP: &str = "GradScaler::update";
        let device = common_device(OP, &[self, tracker, found_inf])?;
        let interval = i32::try_from(interval).unwrap_or(i32::MAX);
        let (growth, backoff) = (growth as f32, backoff as f32);
        #[cfg(feature = "cuda")]
        if let (Storage::Cuda(s), Storage::Cuda(t), Storage::Cuda(f)) =
            (&*self, &*tracker, found_inf)
        {
            return cuda::amp::update_scale(s, t, f, growth, backoff, interval);
        }
        let mut s = cpu::amp::scalar_f32(&*self.host()?, OP)?;
        let mut t = cpu::amp::scalar_f32(&*tracker.host()?, OP)?;
        let f = cpu::amp::scalar_f32(&*found_inf.host()?, OP)?;
        cpu::amp::update_scale(&mut s, &mut t, f, growth, backoff, interval);
        *self = Storage::place(CpuStorage::F32(vec![s]), device)?;
        *tracker = Storage::place(CpuStorage::F32(vec![t]), device)?;
        Ok(())
    }

    pub(crate) fn softmax(&self, l: &Layout, dim: usize, log: bool) -> Result<Storage> {
        match self {
            Storage::Cpu(s) if log => Ok(Storage::Cpu(cpu::log_softmax(s, l, dim)?)),
            Storage::Cpu(s) => Ok(Storage::Cpu(cpu::softmax(s, l, dim)?)),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => Ok(Storage::Cuda(cuda::ops::softmax(s, l, dim, log)?)),
        }
    }

    /// The fused LSTM cell: `[h | c']` from gates `[B, 4H]` and the cell state `[B, H]`.
    pub(crate) fn lstm_cell(&self, lg: &Layout, c: &Storage, lc: &Layout) -> Result<Storage> {
        match pair("lstm_cell", self, c)? {
            Pair::Cpu(g, c) => Ok(Storage::Cpu(cpu::lstm_cell(g, lg, c, lc)?)),
            #[cfg(feature = "cuda")]
            Pair::Cuda(g, c) => Ok(Storage::Cuda(cuda::rnn::lstm_cell(g, lg, c, lc)?)),
        }
    }

    /// `[d gates | d c]` `[B, 5H]` of the fused LSTM cell from the gradients of `h` and `c'`.
    pub(crate) fn lstm_cell_backward(
        &self,
        lg: &Layout,
        c: &Storage,
        lc: &Layout,
        d: CellGrads<'_, Storage>,
    ) -> Result<Storage> {
        let mut all = vec![self, c, d.dh.0, d.dc.0];
        all.extend(d.dh2.map(|x| x.0));
        common_device("lstm_cell backward", &all)?;
        match (self, c) {
            (Storage::Cpu(g), Storage::Cpu(c)) => {
                let d = d.map(|s| match s {
                    Storage::Cpu(x) => x,
                    #[allow(unreachable_patterns)]
                    _ => unreachable!("common_device checked the devices"),
                });
                Ok(Storage::Cpu(cpu::lstm_cell_backward(g, lg, c, lc, d)?))
            }
            #[cfg(feature = "cuda")]
            (Storage::Cuda(g), Storage::Cuda(c)) => {
                let d = d.map(|s| match s {
                    Storage::Cuda(x) => x,
                    _ => unreachable!("common_device checked the devices"),
                });
                Ok(Storage::Cuda(cuda::rnn::lstm_cell_backward(
                    g, lg, c, lc, d,
                )?))
            }
            #[allow(unreachable_patterns)]
            _ => unreachable!("common_device checked the devices"),
        }
    }

    pub(crate) fn conv2d(
        &self,
        l: &Layout,
        w: &Storage,
        lw: &Layout,
        d: &ConvDims,
    ) -> Result<Storage> {
        match pair("conv2d", self, w)? {
            Pair::Cpu(x, y) => Ok(Storage::Cpu(cpu::conv2d(x, l, y, lw, d)?)),
            #[cfg(feature = "cuda")]
            Pair::Cuda(x, y) => Ok(Storage::Cuda(cuda::conv::conv2d(x, l, y, lw, d)?)),
        }
    }

    pub(crate) fn conv2d_backward_input(
        &self,
        l: &Layout,
        w: &Storage,
        lw: &Layout,
        d: &ConvDims,
    ) -> Result<Storage> {
        match pair("conv2d_backward_input", self, w)? {
            Pair::Cpu(x, y) => Ok(Storage::Cpu(cpu::conv2d_backward_input(x, l, y, lw, d)?)),
            #[cfg(feature = "cuda")]
            Pair::Cuda(x, y) => Ok(Storage::Cuda(cuda::conv::conv2d_backward_input(
                x, l, y, lw, d,
            )?)),
        }
    }

    pub(crate) fn conv2d_backward_weight(
        &self,
        l: &Layout,
        gy: &Storage,
        lg: &Layout,
        d: &ConvDims,
    ) -> Result<Storage> {
        match pair("conv2d_backward_weight", self, gy)? {
            Pair::Cpu(x, y) => Ok(Storage::Cpu(cpu::conv2d_backward_weight(x, l, y, lg, d)?)),
            #[cfg(feature = "cuda")]
            Pair::Cuda(x, y) => Ok(Storage::Cuda(cuda::conv::conv2d_backward_weight(
                x, l, y, lg, d,
            )?)),
        }
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
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => {
                let (v, i) = cuda::pool::max_pool2d(s, l, d, p)?;
                Ok((Storage::Cuda(v), Storage::Cuda(i)))
            }
        }
    }

    pub(crate) fn max_pool2d_backward(
        &self,
        l: &Layout,
        idx: &Storage,
        d: &PoolDims,
        #[cfg_attr(not(feature = "cuda"), allow(unused))] p: &Pool2dParams,
    ) -> Result<Storage> {
        match pair("max_pool2d_backward", self, idx)? {
            Pair::Cpu(g, i) => {
                let CpuStorage::I64(i) = i else {
                    return Err(Error::DType {
                        op: "max_pool2d_backward",
                        dtype: i.dtype(),
                        expected: "I64 indices",
                    });
                };
                Ok(Storage::Cpu(cpu::max_pool2d_backward(g, l, i, d)?))
            }
            #[cfg(feature = "cuda")]
            Pair::Cuda(g, i) => Ok(Storage::Cuda(cuda::pool::max_pool2d_backward(
                g, l, i, d, p,
            )?)),
        }
    }

    pub(crate) fn avg_pool2d(&self, l: &Layout, d: &PoolDims, p: &Pool2dParams) -> Result<Storage> {
        match self {
            Storage::Cpu(s) => Ok(Storage::Cpu(cpu::avg_pool2d(s, l, d, p)?)),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => Ok(Storage::Cuda(cuda::pool::avg_pool2d(
                s,
                l,
                d,
                cuda::pool::Pool::Avg,
                Some(p),
                false,
            )?)),
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
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => Ok(Storage::Cuda(cuda::pool::avg_pool2d(
                s,
                l,
                d,
                cuda::pool::Pool::Avg,
                Some(p),
                true,
            )?)),
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
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => Ok(Storage::Cuda(cuda::pool::avg_pool2d(
                s,
                l,
                d,
                cuda::pool::Pool::Adaptive,
                None,
                backward,
            )?)),
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn unavailable(device: Device) -> Error {
    Error::CudaUnavailable {
        device,
        reason: "no backend for this device in this build".into(),
    }
}
