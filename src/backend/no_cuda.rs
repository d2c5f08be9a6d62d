//! The CUDA storage of a build without the `cuda` feature: an uninhabited type, so
//! `Storage::Cuda` cannot be built and every dispatch arm for it compiles to nothing. Its
//! constructors fail with [`Error::CudaUnavailable`] (`Device::check_available` reports the
//! same before they are reached).

use super::ops::{BinaryOp, CmpOp, OptimUpdate, Pool2dParams, ReduceOp, UnaryOp};
use super::rounding::Rounding;
use super::{
    AmpOps, AttnDims, Backend, BackendStorage, CellGrads, ConvDims, ConvOps, CopyOps, CpuStorage,
    ElementwiseOps, IndexOps, LossOps, MatmulOps, NormOps, OptimOps, PoolDims, PoolOps, ReduceOps,
    RnnOps, SoftmaxOps, Span, Storage,
};
use crate::layout::Layout;
use crate::{DType, Device, Error, Result};
use std::borrow::Cow;

/// A CUDA storage, which this build cannot hold.
#[derive(Debug)]
pub enum CudaStorage {}

fn unavailable(device: Device) -> Error {
    Error::CudaUnavailable {
        device,
        reason: "built without the `cuda` feature; use Device::Cpu".into(),
    }
}

/// Methods whose `self` cannot exist: each body is the empty match on it.
macro_rules! uninhabited {
    () => {};
    (fn $name:ident(&mut $s:ident $(, $arg:ident: $ty:ty)* $(,)?) -> $ret:ty; $($rest:tt)*) => {
        fn $name(&mut $s $(, $arg: $ty)*) -> $ret {
            match *$s {}
        }
        uninhabited! { $($rest)* }
    };
    (fn $name:ident(&$s:ident $(, $arg:ident: $ty:ty)* $(,)?) -> $ret:ty; $($rest:tt)*) => {
        fn $name(&$s $(, $arg: $ty)*) -> $ret {
            match *$s {}
        }
        uninhabited! { $($rest)* }
    };
}

impl Backend for CudaStorage {
    fn wrap(self) -> Storage {
        match self {}
    }
    fn part(_s: &Storage) -> &Self {
        unreachable!("a Storage::Cuda cannot be built without the cuda feature")
    }
    fn part_mut(_s: &mut Storage) -> &mut Self {
        unreachable!("a Storage::Cuda cannot be built without the cuda feature")
    }
}

impl BackendStorage for CudaStorage {
    uninhabited! {
        fn device(&self) -> Device;
        fn dtype(&self) -> DType;
        fn len(&self) -> usize;
        fn to_host(&self, _l: &Layout) -> Result<CpuStorage>;
        fn host(&self) -> Result<Cow<'_, CpuStorage>>;
    }
    fn from_host(_s: &CpuStorage, _l: &Layout, device: Device) -> Result<Self> {
        Err(unavailable(device))
    }
}

impl CopyOps for CudaStorage {
    uninhabited! {
        fn try_clone(&self) -> Result<Self>;
        fn copy_strided(&self, _l: &Layout) -> Result<Self>;
        fn to_dtype(&self, _l: &Layout, _dtype: DType) -> Result<Self>;
        fn copy_into(&mut self, _dl: &Layout, _src: &Self, _sl: &Layout) -> Result<()>;
        fn to_f64_vec(&self, _l: &Layout) -> Result<Vec<f64>>;
    }
    fn full(device: Device, _value: f64, _n: usize, _dtype: DType) -> Result<Self> {
        Err(unavailable(device))
    }
    fn dropout_mask(
        device: Device,
        _n: usize,
        _threshold: u64,
        _scale: f64,
        _stream: (u64, u64),
        _dtype: DType,
    ) -> Result<Self> {
        Err(unavailable(device))
    }
    fn normal(
        device: Device,
        _n: usize,
        _mean: f64,
        _std: f64,
        _stream: (u64, u64),
        _dtype: DType,
    ) -> Result<Self> {
        Err(unavailable(device))
    }
}

impl ElementwiseOps for CudaStorage {
    uninhabited! {
        fn unary(&self, _l: &Layout, _op: UnaryOp) -> Result<Self>;
        fn unary_grad(&self, _l: &Layout, _g: &Self, _lg: &Layout, _op: UnaryOp) -> Result<Self>;
        fn binary(&self, _l: &Layout, _r: &Self, _lr: &Layout, _op: BinaryOp) -> Result<Self>;
        fn cmp(&self, _l: &Layout, _r: &Self, _lr: &Layout, _op: CmpOp) -> Result<Self>;
        fn where_cond(&self, _l: &Layout, _a: &Self, _la: &Layout, _b: &Self, _lb: &Layout)
            -> Result<Self>;
    }
}

impl ReduceOps for CudaStorage {
    uninhabited! {
        fn reduce(&self, _l: &Layout, _dims: &[usize], _op: ReduceOp) -> Result<Self>;
        fn argsort(&self, _l: &Layout, _descending: bool) -> Result<Self>;
    }
}

impl SoftmaxOps for CudaStorage {
    uninhabited! {
        fn softmax(&self, _l: &Layout, _dim: usize, _log: bool) -> Result<Self>;
        fn softmax_rows(&self, _p: crate::backend::RowSoftmax) -> Result<Self>;
        fn softmax_rows_backward(&self, _g: &Self, _p: crate::backend::RowSoftmax) -> Result<Self>;
        fn attention(&self, _lq: &Layout, _k: (&Self, &Layout), _v: (&Self, &Layout), _d: AttnDims)
            -> Result<((Self, Layout), Self)>;
        fn attention_backward(&self, _lq: &Layout, _k: (&Self, &Layout), _v: (&Self, &Layout),
            _o: (&Self, &Layout), _lse: &Self, _g: (&Self, &Layout), _d: AttnDims)
            -> Result<[(Self, Layout); 3]>;
    }
}

impl MatmulOps for CudaStorage {
    uninhabited! {
        fn matmul(&self, _l: &Layout, _r: &Self, _lr: &Layout, _b: Option<(&Self, &Layout)>)
            -> Result<Self>;
        fn matmul_acc(&mut self, _ld: &Layout, _a: &Self, _la: &Layout, _b: &Self, _lb: &Layout)
            -> Result<()>;
    }
}

impl ConvOps for CudaStorage {
    uninhabited! {
        fn conv2d(&self, _l: &Layout, _w: &Self, _lw: &Layout, _d: &ConvDims) -> Result<Self>;
        fn conv2d_backward_input(&self, _l: &Layout, _w: &Self, _lw: &Layout, _d: &ConvDims)
            -> Result<Self>;
        fn conv2d_backward_weight(&self, _l: &Layout, _g: &Self, _lg: &Layout, _d: &ConvDims)
            -> Result<Self>;
    }
}

impl PoolOps for CudaStorage {
    uninhabited! {
        fn max_pool2d(&self, _l: &Layout, _d: &PoolDims, _p: &Pool2dParams)
            -> Result<(Self, Self)>;
        fn max_pool2d_backward(&self, _l: &Layout, _i: &Self, _d: &PoolDims, _p: &Pool2dParams)
            -> Result<Self>;
        fn avg_pool2d(&self, _l: &Layout, _d: &PoolDims, _p: &Pool2dParams, _back: bool)
            -> Result<Self>;
        fn adaptive_avg_pool2d(&self, _l: &Layout, _d: &PoolDims, _back: bool) -> Result<Self>;
    }
}

impl NormOps for CudaStorage {
    uninhabited! {
        fn batch_norm_stats(&self, _l: &Layout, _p: crate::backend::norm::BnForward<'_, Self>)
            -> Result<Self>;
        fn batch_norm_grad(&self, _ld: &Layout, _x: &Self, _lx: &Layout, _s: &Self, _ls: &Layout,
            _m: crate::backend::norm::BnGrad, _r: crate::backend::norm::FusedRelu<'_, Self>)
            -> Result<crate::backend::norm::BnGradOut<Self>>;
        fn channel_affine(&self, _lx: &Layout, _a: crate::backend::norm::Addend<'_, Self>, _c: &Self, _lc: &Layout,
            _r: crate::backend::norm::FusedRelu<'_, Self>) -> Result<Self>;
        fn layer_norm(&self, _lx: &Layout, _cols: usize, _w: Option<(&Self, &Layout)>,
            _b: Option<(&Self, &Layout)>, _eps: f64) -> Result<(Self, Self)>;
        fn layer_norm_backward(&self, _ld: &Layout, _x: &Self, _lx: &Layout, _cols: usize,
            _s: &Self, _w: Option<(&Self, &Layout)>, _want: crate::backend::norm::LnWant)
            -> Result<crate::backend::norm::LnGrads<Self>>;
    }
}

impl LossOps for CudaStorage {
    uninhabited! {
        fn cross_entropy(&self, _l: &Layout, _t: &Self, _lt: &Layout, _ignore: i64, _eps: f64)
            -> Result<(Self, Self)>;
        fn cross_entropy_backward(&self, _l: &Layout, _t: &Self, _lt: &Layout, _z: &Self,
            _g: &Self, _lg: &Layout, _ignore: i64, _eps: f64) -> Result<Self>;
        fn cross_entropy_backward_in_place(&mut self, _c: usize, _t: &Self, _lt: &Layout,
            _z: &Self, _g: &Self, _lg: &Layout, _ignore: i64, _eps: f64) -> Result<()>;
    }
}

impl IndexOps for CudaStorage {
    uninhabited! {
        fn index_select(&self, _l: &Layout, _dim: usize, _i: &Self, _il: &Layout) -> Result<Self>;
        fn gather(&self, _l: &Layout, _dim: usize, _i: &Self, _il: &Layout) -> Result<Self>;
        fn scatter_add(&mut self, _shape: &[usize], _dim: usize, _i: (&Self, &Layout),
            _s: (&Self, &Layout)) -> Result<()>;
        fn index_add(&mut self, _shape: &[usize], _dim: usize, _i: (&Self, &Layout),
            _s: (&Self, &Layout)) -> Result<()>;
    }
}

impl RnnOps for CudaStorage {
    uninhabited! {
        fn lstm_cell(&self, _lg: &Layout, _c: &Self, _lc: &Layout) -> Result<Self>;
        fn lstm_cell_backward(&self, _lg: &Layout, _c: &Self, _lc: &Layout,
            _d: CellGrads<'_, Self>) -> Result<Self>;
    }
}

impl OptimOps for CudaStorage {
    uninhabited! {
        fn optim_update(&mut self, _g: Span<'_, Self>, _st: &mut [&mut Self], _step: &mut Self,
            _f: Option<&Self>, _u: &OptimUpdate, _w: Option<(&mut Self, Rounding)>) -> Result<()>;
        fn round_from_master(&mut self, _m: &Self, _r: Rounding, _step: &Self) -> Result<()>;
    }
}

impl AmpOps for CudaStorage {
    fn unscale_grads(
        _g: &[Span<'_, Self>],
        inv: &Self,
        _f: &mut Self,
        _out: DType,
    ) -> Result<Vec<Self>> {
        match *inv {}
    }
    fn unscale_grads_(
        _g: &mut [&mut Self],
        _r: &[(usize, std::ops::Range<usize>)],
        inv: &Self,
        _f: &mut Self,
    ) -> Result<()> {
        match *inv {}
    }
    fn sum_squares(grads: &[Span<'_, Self>]) -> Result<Self> {
        match *grads[0].storage {}
    }
    uninhabited! {
        fn update_scale(&mut self, _t: &mut Self, _f: &Self, _g: f32, _b: f32, _i: i32)
            -> Result<()>;
    }
}
