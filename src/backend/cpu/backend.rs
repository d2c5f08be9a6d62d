//! The CPU storage as a backend: each family trait of `crate::backend` implemented by this
//! backend's kernels (one module per family beside this file), plus the host-memory checks
//! that come before a kernel allocating without a `Result`.

use super::{amp, host_can_hold, index, layer_norm, norm, norm_affine, CpuStorage, IntoStorage};
use crate::backend::ops::{BinaryOp, CmpOp, OptimUpdate, Pool2dParams, ReduceOp, UnaryOp};
use crate::backend::rounding::Rounding;
use crate::backend::{
    host, AmpOps, AttnDims, Backend, BackendStorage, CellGrads, ConvDims, ConvOps, CopyOps,
    ElementwiseOps, IndexOps, LossOps, MatmulOps, NormOps, OptimOps, PoolDims, PoolOps, ReduceOps,
    RnnOps, SoftmaxOps, Span, Storage,
};
use crate::layout::Layout;
use crate::{DType, Device, Error, Result};
use std::borrow::Cow;

impl Backend for CpuStorage {
    fn wrap(self) -> Storage {
        Storage::Cpu(self)
    }
    fn part(s: &Storage) -> &Self {
        s.as_cpu().expect("the dispatcher checked the device")
    }
    fn part_mut(s: &mut Storage) -> &mut Self {
        s.as_cpu_mut().expect("the dispatcher checked the device")
    }
}

impl BackendStorage for CpuStorage {
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn dtype(&self) -> DType {
        CpuStorage::dtype(self)
    }
    fn len(&self) -> usize {
        CpuStorage::len(self)
    }
    fn to_host(&self, l: &Layout) -> Result<CpuStorage> {
        CopyOps::copy_strided(self, l)
    }
    fn host(&self) -> Result<Cow<'_, CpuStorage>> {
        Ok(Cow::Borrowed(self))
    }
    fn from_host(s: &CpuStorage, l: &Layout, _device: Device) -> Result<Self> {
        CopyOps::copy_strided(s, l)
    }
}

impl CopyOps for CpuStorage {
    fn try_clone(&self) -> Result<Self> {
        Ok(self.clone())
    }
    fn copy_strided(&self, l: &Layout) -> Result<Self> {
        host_can_hold(l.numel(), self.dtype())?;
        Ok(CpuStorage::copy_strided(self, l))
    }
    fn to_dtype(&self, l: &Layout, dtype: DType) -> Result<Self> {
        host_can_hold(l.numel(), dtype)?;
        Ok(CpuStorage::to_dtype(self, l, dtype))
    }
    fn copy_into(&mut self, dl: &Layout, src: &Self, sl: &Layout) -> Result<()> {
        CpuStorage::copy_into(self, dl, src, sl)
    }
    fn to_f64_vec(&self, l: &Layout) -> Result<Vec<f64>> {
        Ok(CpuStorage::to_f64_vec(self, l))
    }
    fn full(_device: Device, value: f64, n: usize, dtype: DType) -> Result<Self> {
        CpuStorage::full(value, n, dtype)
    }
    fn dropout_mask(
        _device: Device,
        n: usize,
        threshold: u64,
        scale: f64,
        stream: (u64, u64),
        dtype: DType,
    ) -> Result<Self> {
        super::dropout_mask(n, threshold, scale, stream, dtype)
    }
    fn normal(
        _device: Device,
        n: usize,
        mean: f64,
        std: f64,
        stream: (u64, u64),
        dtype: DType,
    ) -> Result<Self> {
        host_can_hold(n, dtype)?;
        super::normal(n, mean, std, stream, dtype)
    }
}

impl ElementwiseOps for CpuStorage {
    fn unary(&self, l: &Layout, op: UnaryOp) -> Result<Self> {
        host_can_hold(l.numel(), self.dtype())?;
        super::unary(self, l, op)
    }
    fn unary_grad(&self, l: &Layout, g: &Self, lg: &Layout, op: UnaryOp) -> Result<Self> {
        super::unary_grad(self, l, g, lg, op)
    }
    fn binary(&self, l: &Layout, rhs: &Self, lr: &Layout, op: BinaryOp) -> Result<Self> {
        host_can_hold(l.numel(), self.dtype())?;
        super::binary(self, l, rhs, lr, op)
    }
    fn cmp(&self, l: &Layout, rhs: &Self, lr: &Layout, op: CmpOp) -> Result<Self> {
        host_can_hold(l.numel(), DType::U8)?;
        super::cmp(self, l, rhs, lr, op)
    }
    fn where_cond(&self, l: &Layout, a: &Self, la: &Layout, b: &Self, lb: &Layout) -> Result<Self> {
        super::where_cond(self, l, a, la, b, lb)
    }
}

impl ReduceOps for CpuStorage {
    fn reduce(&self, l: &Layout, dims: &[usize], op: ReduceOp) -> Result<Self> {
        super::reduce(self, l, dims, op)
    }
    fn argsort(&self, l: &Layout, descending: bool) -> Result<Self> {
        super::argsort(self, l, descending)
    }
}

impl SoftmaxOps for CpuStorage {
    fn softmax(&self, l: &Layout, dim: usize, log: bool) -> Result<Self> {
        if log {
            super::log_softmax(self, l, dim)
        } else {
            super::softmax(self, l, dim)
        }
    }
    fn softmax_rows(&self, p: crate::backend::RowSoftmax) -> Result<Self> {
        super::softmax::softmax_rows(self, p)
    }
    fn softmax_rows_backward(&self, g: &Self, p: crate::backend::RowSoftmax) -> Result<Self> {
        super::softmax::softmax_rows_backward(self, g, p)
    }
    fn attention(
        &self,
        lq: &Layout,
        k: (&Self, &Layout),
        v: (&Self, &Layout),
        d: AttnDims,
    ) -> Result<((Self, Layout), Self)> {
        super::attention::attention(self, lq, k, v, d)
    }
    fn attention_backward(
        &self,
        lq: &Layout,
        k: (&Self, &Layout),
        v: (&Self, &Layout),
        o: (&Self, &Layout),
        lse: &Self,
        g: (&Self, &Layout),
        d: AttnDims,
    ) -> Result<[(Self, Layout); 3]> {
        super::attention::attention_backward(self, lq, k, v, o, lse, g, d)
    }
}

impl MatmulOps for CpuStorage {
    fn matmul(
        &self,
        l: &Layout,
        rhs: &Self,
        lr: &Layout,
        bias: Option<(&Self, &Layout)>,
    ) -> Result<Self> {
        super::matmul(self, l, rhs, lr, bias)
    }
    fn matmul_acc(
        &mut self,
        ld: &Layout,
        a: &Self,
        la: &Layout,
        b: &Self,
        lb: &Layout,
    ) -> Result<()> {
        super::matmul_acc(self, ld, a, la, b, lb)
    }
}

impl ConvOps for CpuStorage {
    fn conv2d(&self, l: &Layout, w: &Self, lw: &Layout, d: &ConvDims) -> Result<Self> {
        super::conv2d(self, l, w, lw, d)
    }
    fn conv2d_backward_input(
        &self,
        l: &Layout,
        w: &Self,
        lw: &Layout,
        d: &ConvDims,
    ) -> Result<Self> {
        super::conv2d_backward_input(self, l, w, lw, d)
    }
    fn conv2d_backward_weight(
        &self,
        l: &Layout,
        gy: &Self,
        lg: &Layout,
        d: &ConvDims,
    ) -> Result<Self> {
        super::conv2d_backward_weight(self, l, gy, lg, d)
    }
}

impl PoolOps for CpuStorage {
    fn max_pool2d(&self, l: &Layout, d: &PoolDims, p: &Pool2dParams) -> Result<(Self, Self)> {
        super::max_pool2d(self, l, d, p)
    }
    fn max_pool2d_backward(
        &self,
        l: &Layout,
        idx: &Self,
        d: &PoolDims,
        _p: &Pool2dParams,
    ) -> Result<Self> {
        let CpuStorage::I64(i) = idx else {
            return Err(Error::DType {
                op: "max_pool2d_backward",
                dtype: idx.dtype(),
                expected: "I64 indices",
            });
        };
        super::max_pool2d_backward(self, l, i, d)
    }
    fn avg_pool2d(
        &self,
        l: &Layout,
        d: &PoolDims,
        p: &Pool2dParams,
        backward: bool,
    ) -> Result<Self> {
        if backward {
            super::avg_pool2d_backward(self, l, d, p)
        } else {
            super::avg_pool2d(self, l, d, p)
        }
    }
    fn adaptive_avg_pool2d(&self, l: &Layout, d: &PoolDims, backward: bool) -> Result<Self> {
        if backward {
            super::adaptive_avg_pool2d_backward(self, l, d)
        } else {
            super::adaptive_avg_pool2d(self, l, d)
        }
    }
}

impl NormOps for CpuStorage {
    fn batch_norm_stats(
        &self,
        lx: &Layout,
        p: crate::backend::norm::BnForward<'_, Self>,
    ) -> Result<Self> {
        norm::batch_norm_stats(self, lx, p)
    }
    fn batch_norm_grad(
        &self,
        ld: &Layout,
        x: &Self,
        lx: &Layout,
        stats: &Self,
        ls: &Layout,
        mode: crate::backend::norm::BnGrad,
        relu: crate::backend::norm::FusedRelu<'_, Self>,
    ) -> Result<crate::backend::norm::BnGradOut<Self>> {
        norm::batch_norm_grad(self, ld, x, lx, stats, ls, mode, relu)
    }
    fn channel_affine(
        &self,
        lx: &Layout,
        add: crate::backend::norm::Addend<'_, Self>,
        coef: &Self,
        lc: &Layout,
        relu: crate::backend::norm::FusedRelu<'_, Self>,
    ) -> Result<Self> {
        norm_affine::channel_affine(self, lx, add, coef, lc, relu)
    }
    fn layer_norm(
        &self,
        lx: &Layout,
        cols: usize,
        w: Option<(&Self, &Layout)>,
        b: Option<(&Self, &Layout)>,
        eps: f64,
    ) -> Result<(Self, Self)> {
        layer_norm::layer_norm(self, lx, cols, w, b, eps)
    }
    fn layer_norm_backward(
        &self,
        ld: &Layout,
        x: &Self,
        lx: &Layout,
        cols: usize,
        stats: &Self,
        w: Option<(&Self, &Layout)>,
        want: crate::backend::norm::LnWant,
    ) -> Result<crate::backend::norm::LnGrads<Self>> {
        layer_norm::layer_norm_backward(self, ld, x, lx, cols, stats, w, want)
    }
}

/// The class targets of a CPU storage in order, or an `Err` naming `op` for a non-I64 one.
fn host_targets(op: &'static str, t: &CpuStorage, l: &Layout) -> Result<Vec<i64>> {
    match t {
        CpuStorage::I64(v) => Ok(super::contiguous(v, l).into_owned()),
        other => Err(Error::DType {
            op,
            dtype: other.dtype(),
            expected: "I64 class indices",
        }),
    }
}

impl LossOps for CpuStorage {
    fn cross_entropy(
        &self,
        l: &Layout,
        target: &Self,
        lt: &Layout,
        ignore: i64,
        eps: f64,
    ) -> Result<(Self, Self)> {
        let t = host_targets("cross_entropy", target, lt)?;
        super::cross_entropy(self, l, &t, ignore, eps)
    }
    fn cross_entropy_backward(
        &self,
        l: &Layout,
        target: &Self,
        lt: &Layout,
        lse: &Self,
        g: &Self,
        lg: &Layout,
        ignore: i64,
        eps: f64,
    ) -> Result<Self> {
        let t = host_targets("cross_entropy backward", target, lt)?;
        super::cross_entropy_backward(self, l, &t, lse, g, lg, ignore, eps)
    }
    fn cross_entropy_backward_in_place(
        &mut self,
        cols: usize,
        target: &Self,
        lt: &Layout,
        lse: &Self,
        g: &Self,
        lg: &Layout,
        ignore: i64,
        eps: f64,
    ) -> Result<()> {
        let t = host_targets("cross_entropy backward", target, lt)?;
        super::cross_entropy_backward_in_place(self, cols, &t, lse, g, lg, ignore, eps)
    }
}

impl IndexOps for CpuStorage {
    fn index_select(&self, l: &Layout, dim: usize, idx: &Self, il: &Layout) -> Result<Self> {
        let ids = host::indices("index_select", idx, il, dim, l.shape()[dim])?;
        Ok(index::index_select(self, l, dim, &ids))
    }
    fn gather(&self, l: &Layout, dim: usize, idx: &Self, il: &Layout) -> Result<Self> {
        let ids = host::indices("gather", idx, il, dim, l.shape()[dim])?;
        Ok(index::gather(self, l, dim, &ids, il.shape()))
    }
    fn scatter_add(
        &mut self,
        shape: &[usize],
        dim: usize,
        (idx, il): (&Self, &Layout),
        (src, sl): (&Self, &Layout),
    ) -> Result<()> {
        let ids = host::indices("scatter_add", idx, il, dim, shape[dim])?;
        index::scatter_add(self, shape, dim, &ids, il.shape(), src, sl)
    }
    fn index_add(
        &mut self,
        shape: &[usize],
        dim: usize,
        (idx, il): (&Self, &Layout),
        (src, sl): (&Self, &Layout),
    ) -> Result<()> {
        let ids = host::indices("index_add", idx, il, dim, shape[dim])?;
        index::index_add(self, shape, dim, &ids, src, sl)
    }
}

impl RnnOps for CpuStorage {
    fn lstm_cell(&self, lg: &Layout, c: &Self, lc: &Layout) -> Result<Self> {
        super::lstm_cell(self, lg, c, lc)
    }
    fn lstm_cell_backward(
        &self,
        lg: &Layout,
        c: &Self,
        lc: &Layout,
        d: CellGrads<'_, Self>,
    ) -> Result<Self> {
        super::lstm_cell_backward(self, lg, c, lc, d)
    }
}

impl OptimOps for CpuStorage {
    fn optim_update(
        &mut self,
        grad: Span<'_, Self>,
        states: &mut [&mut Self],
        step: &mut Self,
        found_inf: Option<&Self>,
        u: &OptimUpdate,
        working: Option<(&mut Self, Rounding)>,
    ) -> Result<()> {
        super::optim_update(self, grad, states, step, found_inf, u, working)
    }
    fn round_from_master(&mut self, master: &Self, rounding: Rounding, step: &Self) -> Result<()> {
        super::round_into(self, master, rounding, step)
    }
}

impl AmpOps for CpuStorage {
    fn unscale_grads(
        grads: &[Span<'_, Self>],
        inv_scale: &Self,
        found_inf: &mut Self,
        out: DType,
    ) -> Result<Vec<Self>> {
        const OP: &str = "GradScaler::unscale_";
        let inv = amp::scalar_f32(inv_scale, OP)?;
        amp::scalar_f32(found_inf, OP)?;
        let mut outs = Vec::with_capacity(grads.len());
        let mut any_bad = false;
        for g in grads {
            let (o, bad) = amp::unscale(g.storage, g.range.clone(), inv, out)?;
            outs.push(o);
            any_bad |= bad;
        }
        if any_bad {
            *found_inf = vec![1.0f32].into_storage();
        }
        Ok(outs)
    }
    fn unscale_grads_(
        grads: &mut [&mut Self],
        ranges: &[(usize, std::ops::Range<usize>)],
        inv_scale: &Self,
        found_inf: &mut Self,
    ) -> Result<()> {
        const OP: &str = "GradScaler::unscale_";
        let inv = amp::scalar_f32(inv_scale, OP)?;
        amp::scalar_f32(found_inf, OP)?;
        let mut any_bad = false;
        // One range at a time: ranges on one storage are disjoint (checked by the dispatch).
        for (k, r) in ranges {
            any_bad |= amp::unscale_in_place(grads[*k], r.clone(), inv)?;
        }
        if any_bad {
            *found_inf = vec![1.0f32].into_storage();
        }
        Ok(())
    }
    fn sum_squares(grads: &[Span<'_, Self>]) -> Result<Self> {
        let mut total = 0f64;
        for g in grads {
            total += amp::sum_squares(g.storage, g.range.clone())?;
        }
        Ok(vec![total as f32].into_storage())
    }
    fn update_scale(
        &mut self,
        tracker: &mut Self,
        found_inf: &Self,
        growth: f32,
        backoff: f32,
        interval: i32,
    ) -> Result<()> {
        const OP: &str = "GradScaler::update";
        let mut s = amp::scalar_f32(self, OP)?;
        let mut t = amp::scalar_f32(tracker, OP)?;
        let f = amp::scalar_f32(found_inf, OP)?;
        amp::update_scale(&mut s, &mut t, f, growth, backoff, interval);
        *self = vec![s].into_storage();
        *tracker = vec![t].into_storage();
        Ok(())
    }
}
