//! The CUDA storage as a backend: each family trait of `crate::backend` implemented by this
//! backend's launchers (one module per family beside this file). The cases without a kernel
//! go through the host round trips of `backend/fallback.rs`.

use super::pool::Pool;
use super::storage::CudaStorage;
use super::{
    amp, attention, conv, elementwise, index, layer_norm, loss, matmul, norm, optim, pool, random,
    reduce, rnn, softmax, sort,
};
use crate::backend::ops::{BinaryOp, CmpOp, OptimUpdate, Pool2dParams, ReduceOp, UnaryOp};
use crate::backend::rounding::Rounding;
use crate::backend::{
    fallback, AmpOps, AttnDims, Backend, BackendStorage, CellGrads, ConvDims, ConvOps, CopyOps,
    CpuStorage, ElementwiseOps, IndexOps, LossOps, MatmulOps, NormOps, OptimOps, PoolDims, PoolOps,
    ReduceOps, RnnOps, SoftmaxOps, Span, Storage,
};
use crate::layout::Layout;
use crate::{DType, Device, Error, Result};
use std::borrow::Cow;

/// The ordinal of a CUDA `device`; the CPU is an error naming `op`.
fn ordinal(op: &'static str, device: Device) -> Result<usize> {
    match device {
        Device::Cuda(n) => Ok(n),
        Device::Cpu => Err(Error::invalid(op, "a CUDA storage requested on the CPU")),
    }
}

impl Backend for CudaStorage {
    fn wrap(self) -> Storage {
        Storage::Cuda(self)
    }
    fn part(s: &Storage) -> &Self {
        match s {
            Storage::Cuda(s) => s,
            Storage::Cpu(_) => unreachable!("the dispatcher checked the device"),
        }
    }
    fn part_mut(s: &mut Storage) -> &mut Self {
        match s {
            Storage::Cuda(s) => s,
            Storage::Cpu(_) => unreachable!("the dispatcher checked the device"),
        }
    }
}

impl BackendStorage for CudaStorage {
    fn device(&self) -> Device {
        CudaStorage::device(self)
    }
    fn dtype(&self) -> DType {
        CudaStorage::dtype(self)
    }
    fn len(&self) -> usize {
        CudaStorage::len(self)
    }
    fn to_host(&self, l: &Layout) -> Result<CpuStorage> {
        self.to_cpu(l)
    }
    fn host(&self) -> Result<Cow<'_, CpuStorage>> {
        Ok(Cow::Owned(self.to_cpu(&Layout::contiguous(&[self.len()]))?))
    }
    fn from_host(s: &CpuStorage, l: &Layout, device: Device) -> Result<Self> {
        CudaStorage::from_cpu(s, l, ordinal("to_device", device)?)
    }
}

impl CopyOps for CudaStorage {
    fn try_clone(&self) -> Result<Self> {
        CudaStorage::try_clone(self)
    }
    fn copy_strided(&self, l: &Layout) -> Result<Self> {
        CudaStorage::copy_strided(self, l)
    }
    fn to_dtype(&self, l: &Layout, dtype: DType) -> Result<Self> {
        CudaStorage::to_dtype(self, l, dtype)
    }
    fn copy_into(&mut self, dl: &Layout, src: &Self, sl: &Layout) -> Result<()> {
        CudaStorage::copy_into(self, dl, src, sl)
    }
    fn copy_many_into(&mut self, parts: &[(&Layout, &Self, &Layout)]) -> Result<()> {
        CudaStorage::copy_many_into(self, parts)
    }
    fn to_f64_vec(&self, l: &Layout) -> Result<Vec<f64>> {
        Ok(self.to_cpu(l)?.to_f64_vec(&Layout::contiguous(l.shape())))
    }
    fn full(device: Device, value: f64, n: usize, dtype: DType) -> Result<Self> {
        CudaStorage::full(ordinal("full", device)?, value, n, dtype)
    }
    fn dropout_mask(
        device: Device,
        n: usize,
        threshold: u64,
        scale: f64,
        stream: (u64, u64),
        dtype: DType,
    ) -> Result<Self> {
        let o = ordinal("dropout", device)?;
        random::dropout_mask(o, n, threshold, scale, stream, dtype)
    }
    fn normal(
        device: Device,
        n: usize,
        mean: f64,
        std: f64,
        stream: (u64, u64),
        dtype: DType,
    ) -> Result<Self> {
        if dtype == DType::F64 {
            return fallback::normal(device, n, mean, std, stream, dtype);
        }
        random::normal(ordinal("randn", device)?, n, mean, std, stream, dtype)
    }
}

impl ElementwiseOps for CudaStorage {
    fn unary(&self, l: &Layout, op: UnaryOp) -> Result<Self> {
        elementwise::unary(self, l, op)
    }
    fn unary_grad(&self, l: &Layout, g: &Self, lg: &Layout, op: UnaryOp) -> Result<Self> {
        elementwise::unary_grad(self, l, g, lg, op)
    }
    fn binary(&self, l: &Layout, rhs: &Self, lr: &Layout, op: BinaryOp) -> Result<Self> {
        elementwise::binary(self, l, rhs, lr, op)
    }
    fn cmp(&self, l: &Layout, rhs: &Self, lr: &Layout, op: CmpOp) -> Result<Self> {
        elementwise::cmp(self, l, rhs, lr, op)
    }
    fn where_cond(&self, l: &Layout, a: &Self, la: &Layout, b: &Self, lb: &Layout) -> Result<Self> {
        elementwise::where_cond(self, l, a, la, b, lb)
    }
}

impl ReduceOps for CudaStorage {
    fn reduce(&self, l: &Layout, dims: &[usize], op: ReduceOp) -> Result<Self> {
        reduce::reduce(self, l, dims, op)
    }
    fn argsort(&self, l: &Layout, descending: bool) -> Result<Self> {
        sort::argsort(self, l, descending)
    }
}

impl SoftmaxOps for CudaStorage {
    fn softmax(&self, l: &Layout, dim: usize, log: bool) -> Result<Self> {
        softmax::softmax(self, l, dim, log)
    }
    fn softmax_rows(&self, p: crate::backend::RowSoftmax) -> Result<Self> {
        softmax::softmax_rows(self, p)
    }
    fn softmax_rows_backward(&self, g: &Self, p: crate::backend::RowSoftmax) -> Result<Self> {
        softmax::softmax_rows_backward(self, g, p)
    }
    fn attention(
        &self,
        lq: &Layout,
        k: (&Self, &Layout),
        v: (&Self, &Layout),
        d: AttnDims,
    ) -> Result<((Self, Layout), Self)> {
        attention::attention(self, lq, k, v, d)
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
        attention::attention_backward(self, lq, k, v, o, lse, g, d)
    }
}

impl MatmulOps for CudaStorage {
    fn matmul(
        &self,
        l: &Layout,
        rhs: &Self,
        lr: &Layout,
        bias: Option<(&Self, &Layout)>,
    ) -> Result<Self> {
        matmul::matmul(self, l, rhs, lr, bias)
    }
    fn linear_relu(
        &self,
        l: &Layout,
        rhs: &Self,
        lr: &Layout,
        bias: (&Self, &Layout),
    ) -> Result<Option<Self>> {
        matmul::linear_relu(self, l, rhs, lr, bias)
    }
    fn matmul_fused(
        &self,
        l: &Layout,
        rhs: &Self,
        lr: &Layout,
        f: crate::backend::Fused<'_, Self>,
    ) -> Result<Option<(Self, Self)>> {
        super::epilogue::matmul_fused(self, l, rhs, lr, f)
    }
    fn matmul_acc(
        &mut self,
        ld: &Layout,
        a: &Self,
        la: &Layout,
        b: &Self,
        lb: &Layout,
    ) -> Result<()> {
        matmul::matmul_acc(self, ld, a, la, b, lb)
    }
}

impl ConvOps for CudaStorage {
    fn conv2d(&self, l: &Layout, w: &Self, lw: &Layout, d: &ConvDims) -> Result<Self> {
        conv::conv2d(self, l, w, lw, d)
    }
    fn conv2d_with_sums(
        &self,
        l: &Layout,
        w: &Self,
        lw: &Layout,
        d: &ConvDims,
    ) -> Result<Option<(Self, Self)>> {
        super::conv_stats::conv2d_with_sums(self, l, w, lw, d)
    }
    fn conv2d_backward_weight_affine(
        &self,
        l: &Layout,
        coef: (&Self, &Layout),
        relu: bool,
        gy: (&Self, &Layout),
        d: &ConvDims,
    ) -> Result<Option<Self>> {
        super::conv_wgrad::conv2d_backward_weight_affine(self, l, coef, relu, gy, d)
    }
    fn conv2d_backward_input(
        &self,
        l: &Layout,
        w: &Self,
        lw: &Layout,
        d: &ConvDims,
    ) -> Result<Self> {
        conv::conv2d_backward_input(self, l, w, lw, d)
    }
    fn conv2d_backward_input_acc(
        &mut self,
        (gy, lg): (&Self, &Layout),
        (w, lw): (&Self, &Layout),
        d: &ConvDims,
    ) -> Result<bool> {
        conv::conv2d_backward_input_acc(gy, lg, w, lw, d, self)?;
        Ok(true)
    }
    fn conv2d_backward_weight(
        &self,
        l: &Layout,
        gy: &Self,
        lg: &Layout,
        d: &ConvDims,
    ) -> Result<Self> {
        conv::conv2d_backward_weight(self, l, gy, lg, d)
    }
}

impl PoolOps for CudaStorage {
    fn max_pool2d(&self, l: &Layout, d: &PoolDims, p: &Pool2dParams) -> Result<(Self, Self)> {
        pool::max_pool2d(self, l, d, p)
    }
    fn max_pool2d_backward(
        &self,
        l: &Layout,
        idx: &Self,
        d: &PoolDims,
        p: &Pool2dParams,
    ) -> Result<Self> {
        pool::max_pool2d_backward(self, l, idx, d, p)
    }
    fn avg_pool2d(
        &self,
        l: &Layout,
        d: &PoolDims,
        p: &Pool2dParams,
        backward: bool,
    ) -> Result<Self> {
        pool::avg_pool2d(self, l, d, Pool::Avg, Some(p), backward)
    }
    fn adaptive_avg_pool2d(&self, l: &Layout, d: &PoolDims, backward: bool) -> Result<Self> {
        pool::avg_pool2d(self, l, d, Pool::Adaptive, None, backward)
    }
}

impl NormOps for CudaStorage {
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
        norm::channel_affine(self, lx, add, coef, lc, relu)
    }
    fn batch_norm_fused(
        &self,
        lx: &Layout,
        p: crate::backend::norm::FusedBn<'_, Self>,
    ) -> Result<Option<crate::backend::norm::FusedBnOut<Self>>> {
        super::dnn_norm::batch_norm_fused(self, lx, p)
    }
    fn batch_norm_fused_backward(
        &self,
        ld: &Layout,
        b: crate::backend::norm::FusedBnBack<'_, Self>,
    ) -> Result<crate::backend::norm::FusedBnGrads<Self>> {
        super::dnn_norm::batch_norm_fused_backward(self, ld, b)
    }
    fn add_layer_norm(
        &self,
        lx: &Layout,
        r: (&Self, &Layout),
        cols: usize,
        w: Option<(&Self, &Layout)>,
        b: Option<(&Self, &Layout)>,
        eps: f64,
    ) -> Result<Option<(Self, Self, Self)>> {
        super::layer_norm::add_layer_norm(self, lx, r, cols, w, b, eps)
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

impl LossOps for CudaStorage {
    fn cross_entropy(
        &self,
        l: &Layout,
        target: &Self,
        lt: &Layout,
        ignore: i64,
        eps: f64,
    ) -> Result<(Self, Self)> {
        loss::cross_entropy(self, l, target, lt, ignore, eps)
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
        loss::cross_entropy_backward(self, l, target, lt, lse, g, lg, ignore, eps)
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
        loss::cross_entropy_backward_in_place(self, cols, target, lt, lse, g, lg, ignore, eps)
    }
}

impl IndexOps for CudaStorage {
    fn index_select(&self, l: &Layout, dim: usize, idx: &Self, il: &Layout) -> Result<Self> {
        index::index_select(self, l, dim, idx, il)
    }
    fn gather(&self, l: &Layout, dim: usize, idx: &Self, il: &Layout) -> Result<Self> {
        index::gather(self, l, dim, idx, il)
    }
    /// Float sums in a kernel; integer sums through the host.
    fn scatter_add(
        &mut self,
        shape: &[usize],
        dim: usize,
        (idx, il): (&Self, &Layout),
        (src, sl): (&Self, &Layout),
    ) -> Result<()> {
        if !self.dtype().is_float() {
            return fallback::scatter_add(self, shape, dim, (idx, il), (src, sl));
        }
        index::scatter_add(self, shape, dim, idx, il, src, sl)
    }
    /// Float sums in a kernel; integer sums through the host.
    fn index_add(
        &mut self,
        shape: &[usize],
        dim: usize,
        (idx, il): (&Self, &Layout),
        (src, sl): (&Self, &Layout),
    ) -> Result<()> {
        if !self.dtype().is_float() {
            return fallback::index_add(self, shape, dim, (idx, il), (src, sl));
        }
        index::index_add(self, shape, dim, idx, il, src, sl)
    }
}

impl RnnOps for CudaStorage {
    fn lstm_cell(&self, lg: &Layout, c: &Self, lc: &Layout) -> Result<Self> {
        rnn::lstm_cell(self, lg, c, lc)
    }
    fn lstm_cell_backward(
        &self,
        lg: &Layout,
        c: &Self,
        lc: &Layout,
        d: CellGrads<'_, Self>,
    ) -> Result<Self> {
        rnn::lstm_cell_backward(self, lg, c, lc, d)
    }
}

use crate::backend::optim::OptimItem;

impl OptimOps for CudaStorage {
    /// The fused kernels where they cover the dtypes, else the host.
    fn optim_update(
        &mut self,
        grad: Span<'_, Self>,
        states: &mut [&mut Self],
        step: &mut Self,
        found_inf: Option<&Self>,
        u: &OptimUpdate,
        working: Option<(&mut Self, Rounding)>,
    ) -> Result<()> {
        let item = OptimItem {
            param: self,
            grad,
            states: states.iter_mut().map(|s| &mut **s).collect(),
            step,
            working,
        };
        Self::optim_update_many(&mut [item], found_inf, u)
    }
    /// The list kernels for every item they cover, the host for the others.
    fn optim_update_many(
        items: &mut [OptimItem<'_, Self>],
        found_inf: Option<&Self>,
        u: &OptimUpdate,
    ) -> Result<()> {
        for i in optim::optim_update_many(items, found_inf, u)? {
            let it = &mut items[i];
            let working = it.working.as_mut().map(|(w, r)| (&mut **w, *r));
            fallback::optim_update(
                it.param,
                it.grad.clone(),
                &mut it.states,
                it.step,
                found_inf,
                u,
                working,
            )?;
        }
        Ok(())
    }
    /// The rounding kernel where it covers the dtypes, else the host.
    fn round_from_master(&mut self, master: &Self, rounding: Rounding, step: &Self) -> Result<()> {
        if optim::round_from_master(self, master, rounding, step)? {
            return Ok(());
        }
        fallback::round_from_master(self, master, rounding, step)
    }
}

impl AmpOps for CudaStorage {
    fn unscale_grads(
        grads: &[Span<'_, Self>],
        inv_scale: &Self,
        found_inf: &mut Self,
        out: DType,
    ) -> Result<Vec<Self>> {
        amp::unscale_grads(grads, inv_scale, found_inf, out)
    }
    fn unscale_grads_(
        grads: &mut [&mut Self],
        ranges: &[(usize, std::ops::Range<usize>)],
        inv_scale: &Self,
        found_inf: &mut Self,
    ) -> Result<()> {
        let grads: Vec<&Self> = grads.iter().map(|g| &**g).collect();
        amp::unscale_grads_(&grads, ranges, inv_scale, found_inf)
    }
    fn sum_squares(grads: &[Span<'_, Self>]) -> Result<Self> {
        amp::sum_squares(grads)
    }
    fn update_scale(
        &mut self,
        tracker: &mut Self,
        found_inf: &Self,
        growth: f32,
        backoff: f32,
        interval: i32,
    ) -> Result<()> {
        amp::update_scale(self, tracker, found_inf, growth, backoff, interval)
    }
}
