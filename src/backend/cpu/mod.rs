//! The CPU backend: one `Vec` per dtype ([`CpuStorage`], in `backend/host.rs`), generic
//! kernels, rayon for threads; one module per op family behind the backend traits
//! (`backend.rs`).
//!
//! Dtype dispatch is written once, in the `map_*` macros of `host.rs`: a kernel is a generic
//! function over [`CpuElem`], and the macro expands its call for every storage variant it
//! accepts.

pub(crate) mod amp;
mod attention;
mod backend;
mod conv;
mod conv_common;
mod conv_nhwc;
mod elementwise;
pub(crate) mod index;
pub(crate) mod layer_norm;
mod loss;
mod matmul;
pub(crate) mod norm;
mod norm_affine;
mod optim;
mod pool;
mod pool_nhwc;
mod pool_window;
mod random;
mod reduce;
mod rnn;
mod softmax;
mod sort;

pub(crate) use conv::{conv2d, conv2d_backward_input, conv2d_backward_weight};
pub(crate) use loss::{cross_entropy, cross_entropy_backward, cross_entropy_backward_in_place};
pub(crate) use pool::{
    adaptive_avg_pool2d, adaptive_avg_pool2d_backward, avg_pool2d, avg_pool2d_backward, max_pool2d,
    max_pool2d_backward,
};
pub(crate) use random::{dropout_mask, normal};
pub(crate) use rnn::{lstm_cell, lstm_cell_backward};
pub(crate) use softmax::{log_softmax, softmax};

use crate::layout::Layout;
use crate::{DType, Error, Result};
use half::{bf16, f16};

pub(crate) use super::host::{
    host_can_hold, host_can_hold_bytes, map_all, map_float, map_pair, try_vec, IntoStorage,
};
pub use super::host::{CpuElem, CpuStorage};

/// Below this many elements a kernel runs on the calling thread.
pub(crate) const PAR_MIN: usize = 1 << 15;
/// Elements per parallel work item.
pub(crate) const CHUNK: usize = 1 << 13;

impl CpuStorage {
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
        let _iso = crate::parallel::Isolated::new();
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
pub(crate) use index::{index_add, scatter_add};
pub(crate) use matmul::{matmul, matmul_acc};
pub(crate) use optim::{optim_update, round_into};
pub(crate) use reduce::reduce;
pub(crate) use sort::argsort;

/// The elements of `(v, l)` in row-major order: borrowed when the layout already is that.
pub(crate) fn contiguous<'a, T: CpuElem>(v: &'a [T], l: &Layout) -> std::borrow::Cow<'a, [T]> {
    if l.is_contiguous() {
        std::borrow::Cow::Borrowed(&v[l.offset()..l.offset() + l.numel()])
    } else {
        std::borrow::Cow::Owned(elementwise::map1(v, l, |x| x))
    }
}
