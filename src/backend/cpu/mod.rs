//! The CPU backend: one `Vec` per dtype, generic kernels, rayon for threads.
//!
//! Dtype dispatch is written once, in the `map_*` macros below: a kernel is a generic function
//! over [`CpuElem`], and the macro expands its call for every storage variant it accepts.

pub(crate) mod amp;
mod conv;
mod conv_nhwc;
mod elementwise;
pub(crate) mod index;
pub(crate) mod layer_norm;
mod loss;
mod matmul;
mod nn;
pub(crate) mod norm;
mod optim;
mod pool_nhwc;
mod reduce;
mod rnn;
pub(crate) mod vmath;

pub(crate) use conv::{conv2d, conv2d_backward_input, conv2d_backward_weight};
pub(crate) use loss::{cross_entropy, cross_entropy_backward};
pub(crate) use nn::{
    adaptive_avg_pool2d, adaptive_avg_pool2d_backward, avg_pool2d, avg_pool2d_backward,
    log_softmax, max_pool2d, max_pool2d_backward, softmax,
};
pub(crate) use rnn::{lstm_cell, lstm_cell_backward};

use crate::dtype::WithDType;
use crate::layout::Layout;
use crate::{DType, Error, Result};
use half::{bf16, f16};

/// Below this many elements a kernel runs on the calling thread.
pub(crate) const PAR_MIN: usize = 1 << 15;
/// Elements per parallel work item.
pub(crate) const CHUNK: usize = 1 << 13;

/// Host storage of a tensor.
#[derive(Debug, Clone)]
pub enum CpuStorage {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    F64(Vec<f64>),
    I64(Vec<i64>),
    U8(Vec<u8>),
}

/// An element type the CPU backend stores.
pub trait CpuElem: WithDType {
    fn wrap(v: Vec<Self>) -> CpuStorage;
    fn slice(s: &CpuStorage) -> Option<&[Self]>;
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut Vec<Self>>;
}

macro_rules! cpu_elem {
    ($t:ty, $v:ident) => {
        impl CpuElem for $t {
            fn wrap(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$v(v)
            }
            fn slice(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$v(v) => Some(v),
                    _ => None,
                }
            }
            fn slice_mut(s: &mut CpuStorage) -> Option<&mut Vec<Self>> {
                match s {
                    CpuStorage::$v(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
cpu_elem!(f32, F32);
cpu_elem!(f16, F16);
cpu_elem!(bf16, BF16);
cpu_elem!(f64, F64);
cpu_elem!(i64, I64);
cpu_elem!(u8, U8);

/// Expands `$body` for every dtype, with `$v` bound to the typed vector.
macro_rules! map_all {
    ($s:expr, $v:ident => $body:expr) => {
        match $s {
            CpuStorage::F32($v) => $body,
            CpuStorage::F16($v) => $body,
            CpuStorage::BF16($v) => $body,
            CpuStorage::F64($v) => $body,
            CpuStorage::I64($v) => $body,
            CpuStorage::U8($v) => $body,
        }
    };
}

/// Expands `$body` for the float dtypes; other dtypes give an error naming `$op`.
macro_rules! map_float {
    ($op:expr, $s:expr, $v:ident => $body:expr) => {
        match $s {
            CpuStorage::F32($v) => $body,
            CpuStorage::F16($v) => $body,
            CpuStorage::BF16($v) => $body,
            CpuStorage::F64($v) => $body,
            other => {
                return Err($crate::Error::DType {
                    op: $op,
                    dtype: other.dtype(),
                    expected: "a float dtype",
                })
            }
        }
    };
}

/// Expands `$body` for pairs of same-dtype storages (`$a`, `$b` typed alike).
macro_rules! map_pair {
    ($op:expr, $x:expr, $y:expr, $a:ident, $b:ident => $body:expr) => {
        match ($x, $y) {
            (CpuStorage::F32($a), CpuStorage::F32($b)) => $body,
            (CpuStorage::F16($a), CpuStorage::F16($b)) => $body,
            (CpuStorage::BF16($a), CpuStorage::BF16($b)) => $body,
            (CpuStorage::F64($a), CpuStorage::F64($b)) => $body,
            (CpuStorage::I64($a), CpuStorage::I64($b)) => $body,
            (CpuStorage::U8($a), CpuStorage::U8($b)) => $body,
            (x, y) => {
                return Err($crate::Error::DTypeMismatch {
                    op: $op,
                    lhs: x.dtype(),
                    rhs: y.dtype(),
                })
            }
        }
    };
}
pub(crate) use {map_all, map_float, map_pair};

/// An empty vector with room for `n` elements, or [`crate::Error::OutOfMemory`] when the host
/// allocator refuses (instead of the abort or capacity panic of `vec![x; n]`).
pub(crate) fn try_vec<T>(n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| crate::Error::host_oom(n.saturating_mul(std::mem::size_of::<T>())))?;
    Ok(v)
}

/// Checks that the host can hold `n` elements of `dtype` before a kernel that allocates them
/// without a `Result` runs: requests from 256 MiB up are reserved once and released, so one
/// the allocator refuses becomes [`crate::Error::OutOfMemory`] instead of an abort.
pub(crate) fn host_can_hold(n: usize, dtype: DType) -> Result<()> {
    host_can_hold_bytes(n.saturating_mul(dtype.size_in_bytes()))
}

/// [`host_can_hold`] for a byte count.
pub(crate) fn host_can_hold_bytes(bytes: usize) -> Result<()> {
    if bytes >= 256 << 20 {
        drop(try_vec::<u8>(bytes)?);
    }
    Ok(())
}

impl CpuStorage {
    pub fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::F64(_) => DType::F64,
            CpuStorage::I64(_) => DType::I64,
            CpuStorage::U8(_) => DType::U8,
        }
    }

    pub fn len(&self) -> usize {
        map_all!(self, v => v.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `n` copies of `value` (rounded to `dtype`); [`crate::Error::OutOfMemory`] when the host
    /// cannot hold them.
    pub fn full(value: f64, n: usize, dtype: DType) -> Result<CpuStorage> {
        fn go<T: CpuElem>(value: f64, n: usize) -> Result<CpuStorage> {
            let mut v = try_vec(n)?;
            v.resize(n, T::from_f64(value));
            Ok(T::wrap(v))
        }
        match dtype {
            DType::F32 => go::<f32>(value, n),
            DType::F16 => go::<f16>(value, n),
            DType::BF16 => go::<bf16>(value, n),
            DType::F64 => go::<f64>(value, n),
            DType::I64 => go::<i64>(value, n),
            DType::U8 => go::<u8>(value, n),
        }
    }

    /// Builds storage of `dtype` from f64 values (rounding on store), reserving the
    /// iterator's lower size bound up front (an [`crate::Error::OutOfMemory`] when refused).
    pub fn from_f64s(values: impl Iterator<Item = f64>, dtype: DType) -> Result<CpuStorage> {
        fn go<T: CpuElem>(values: impl Iterator<Item = f64>) -> Result<CpuStorage> {
            let mut v = try_vec(values.size_hint().0)?;
            v.extend(values.map(T::from_f64));
            Ok(T::wrap(v))
        }
        match dtype {
            DType::F32 => go::<f32>(values),
            DType::F16 => go::<f16>(values),
            DType::BF16 => go::<bf16>(values),
            DType::F64 => go::<f64>(values),
            DType::I64 => go::<i64>(values),
            DType::U8 => go::<u8>(values),
        }
    }

    /// A contiguous copy of the elements `layout` selects.
    pub fn copy_strided(&self, layout: &Layout) -> CpuStorage {
        map_all!(self, v => elementwise::map1(v, layout, |x| x).into_storage())
    }

    /// A contiguous copy converted to `dtype`.
    pub fn to_dtype(&self, layout: &Layout, dtype: DType) -> CpuStorage {
        fn go<S: CpuElem>(v: &[S], l: &Layout, dtype: DType) -> CpuStorage {
            match dtype {
                DType::F32 => elementwise::cast::<S, f32>(v, l),
                DType::F16 => elementwise::cast::<S, f16>(v, l),
                DType::BF16 => elementwise::cast::<S, bf16>(v, l),
                DType::F64 => elementwise::cast::<S, f64>(v, l),
                DType::I64 => elementwise::cast::<S, i64>(v, l),
                DType::U8 => elementwise::cast::<S, u8>(v, l),
            }
        }
        // The casts mixed precision runs every step go through f32 directly (the half crate
        // uses the hardware conversions there); the rest through f64.
        use elementwise::map1;
        match (self, dtype) {
            (CpuStorage::F32(v), DType::F16) => map1(v, layout, f16::from_f32).into_storage(),
            (CpuStorage::F32(v), DType::BF16) => map1(v, layout, bf16::from_f32).into_storage(),
            (CpuStorage::F16(v), DType::F32) => map1(v, layout, f16::to_f32).into_storage(),
            (CpuStorage::BF16(v), DType::F32) => map1(v, layout, bf16::to_f32).into_storage(),
            (s, _) => map_all!(s, v => go(v, layout, dtype)),
        }
    }

    /// Copies the elements of `src` (under `src_l`) into the places `dst_l` selects in `self`.
    pub fn copy_into(&mut self, dst_l: &Layout, src: &CpuStorage, src_l: &Layout) -> Result<()> {
        if dst_l.shape() != src_l.shape() {
            return Err(Error::ShapeMismatch {
                op: "copy",
                lhs: dst_l.shape().to_vec(),
                rhs: src_l.shape().to_vec(),
            });
        }
        map_pair!("copy", self, src, d, s => {
            if let (Some(rd), Some(rs)) = (dst_l.contiguous_range(), src_l.contiguous_range()) {
                d[rd].copy_from_slice(&s[rs]);
            } else {
                let rows = crate::layout::Rows::new([dst_l, src_l]);
                let [sd, ss] = rows.inner;
                let n = rows.len;
                rows.for_each(0, rows.count(), |_, [od, os]| {
                    if sd == 1 && ss == 1 {
                        d[od..od + n].copy_from_slice(&s[os..os + n]);
                    } else {
                        for i in 0..n {
                            d[od + i * sd] = s[os + i * ss];
                        }
                    }
                });
            }
        });
        Ok(())
    }

    /// The raw little-endian bytes of the elements (the host is little-endian on every target
    /// this crate supports).
    pub fn to_le_bytes(&self, layout: &Layout) -> Vec<u8> {
        map_all!(self.copy_strided(layout), v => bytemuck::cast_slice(&v).to_vec())
    }

    /// The whole storage's bytes, borrowed (little-endian, as `to_le_bytes`).
    pub fn as_bytes(&self) -> &[u8] {
        map_all!(self, v => bytemuck::cast_slice(v))
    }

    /// Storage of `dtype` from raw little-endian bytes; `None` if the length does not fit.
    pub fn from_le_bytes(bytes: &[u8], dtype: DType) -> Option<CpuStorage> {
        fn go<T: CpuElem>(b: &[u8]) -> Option<CpuStorage> {
            if b.len() % std::mem::size_of::<T>() != 0 {
                return None;
            }
            let mut v = vec![T::zero(); b.len() / std::mem::size_of::<T>()];
            bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(b);
            Some(T::wrap(v))
        }
        match dtype {
            DType::F32 => go::<f32>(bytes),
            DType::F16 => go::<f16>(bytes),
            DType::BF16 => go::<bf16>(bytes),
            DType::F64 => go::<f64>(bytes),
            DType::I64 => go::<i64>(bytes),
            DType::U8 => go::<u8>(bytes),
        }
    }

    /// Every element as f64, in the row-major order of `layout`.
    pub fn to_f64_vec(&self, layout: &Layout) -> Vec<f64> {
        map_all!(self, v => layout.offsets().map(|o| v[o].to_f64()).collect())
    }
}

/// Runs `f(k, chunk)` on each `chunk`-element piece `k` of `out` (an image, a plane), on the
/// compute pool when `parallel`; nothing when `chunk` is 0.
pub(crate) fn per_chunk<U: Send>(
    out: &mut [U],
    chunk: usize,
    parallel: bool,
    f: impl Fn(usize, &mut [U]) + Sync,
) {
    if chunk == 0 {
        return;
    }
    if parallel {
        use rayon::prelude::*;
        out.par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(k, c)| f(k, c));
    } else {
        out.chunks_mut(chunk).enumerate().for_each(|(k, c)| f(k, c));
    }
}

/// A buffer of `n` elements whose every element the caller writes before reading any (GEMM
/// outputs without accumulation, im2col columns, rows a kernel fills): skips zeroing memory
/// that is overwritten anyway, which is most of an allocation's cost for large short-lived
/// buffers.
///
/// A refused allocation panics with [`crate::Error::OutOfMemory`]'s message instead of
/// aborting the process (the kernels that call this return no `Result`); the sizes reaching
/// here were checked when their shapes were made.
pub(crate) fn overwritten_buffer<F: bytemuck::Pod>(n: usize) -> Vec<F> {
    let mut v = try_vec(n).unwrap_or_else(|e| panic!("{e}"));
    // SAFETY: Pod types have no invalid bit patterns, and callers write every element before
    // reading it (see above).
    #[allow(clippy::uninit_vec)]
    unsafe {
        v.set_len(n)
    };
    v
}

pub(crate) use elementwise::{binary, cmp, unary, unary_grad, where_cond};
pub(crate) use index::{gather, index_add, index_select, scatter_add};
pub(crate) use matmul::{matmul, matmul_acc};
pub(crate) use optim::{optim_update, round_into};
pub(crate) use reduce::reduce;

/// Helper to turn a typed vector into storage.
pub(crate) trait IntoStorage {
    fn into_storage(self) -> CpuStorage;
}
impl<T: CpuElem> IntoStorage for Vec<T> {
    fn into_storage(self) -> CpuStorage {
        T::wrap(self)
    }
}

/// The elements of `(v, l)` in row-major order: borrowed when the layout already is that.
pub(crate) fn contiguous<'a, T: CpuElem>(v: &'a [T], l: &Layout) -> std::borrow::Cow<'a, [T]> {
    if l.is_contiguous() {
        std::borrow::Cow::Borrowed(&v[l.offset()..l.offset() + l.numel()])
    } else {
        std::borrow::Cow::Owned(elementwise::map1(v, l, |x| x))
    }
}

/// `n` dropout multipliers of `dtype`: element `i` is `scale` when word `i` of the Philox
/// stream of `seed` from block `start` on (four words a block) is at least `threshold`, else
/// 0. Chunks of the output are drawn in parallel; the result does not depend on the split.
pub(crate) fn dropout_mask(
    n: usize,
    threshold: u64,
    scale: f64,
    (seed, start): (u64, u64),
    dtype: DType,
) -> Result<CpuStorage> {
    fn go<T: CpuElem + bytemuck::Pod>(
        n: usize,
        threshold: u64,
        scale: f64,
        (seed, start): (u64, u64),
    ) -> Vec<T> {
        use rayon::prelude::*;
        let (keep, drop) = (T::from_f64(scale), T::from_f64(0.0));
        let mut out = overwritten_buffer::<T>(n);
        out.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(c, chunk)| {
                let first = (c * CHUNK / 4) as u64;
                for (b, quad) in chunk.chunks_mut(4).enumerate() {
                    let words = crate::random::philox_block(seed, start + first + b as u64);
                    for (o, w) in quad.iter_mut().zip(words) {
                        *o = if w as u64 >= threshold { keep } else { drop };
                    }
                }
            });
        out
    }
    let stream = (seed, start);
    Ok(match dtype {
        DType::F32 => go::<f32>(n, threshold, scale, stream).into_storage(),
        DType::F16 => go::<f16>(n, threshold, scale, stream).into_storage(),
        DType::BF16 => go::<bf16>(n, threshold, scale, stream).into_storage(),
        DType::F64 => go::<f64>(n, threshold, scale, stream).into_storage(),
        dtype => {
            return Err(Error::DType {
                op: "dropout",
                dtype,
                expected: "a float dtype",
            })
        }
    })
}
