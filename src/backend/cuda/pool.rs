//! Launchers for `cuda/pool.cu`: max, average and adaptive average 2-D pooling and their
//! backward passes over dense NCHW inputs, or NHWC ones for a channels-last input (outputs in
//! the same order; a view in another order is copied first). Where the channels (channels-last)
//! or the rows (NCHW) fill 16-byte vectors, the vector kernels of `cuda/pool_vec.cu` run.

use super::kernels::KernelFile;
use super::profile::elems;
use super::storage::{float_kname, grid, CudaStorage};
use crate::backend::ops::Pool2dParams;
use crate::backend::spec::PoolDims;
use crate::layout::Layout;
use crate::{DType, Error, Result};
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

/// `cuda/pool.cu`'s `PoolArgs`, field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct PoolArgs {
    planes: i64,
    h: i64,
    w: i64,
    ho: i64,
    wo: i64,
    kh: i64,
    kw: i64,
    sh: i64,
    sw: i64,
    ph: i64,
    pw: i64,
    dh: i64,
    dw: i64,
    c: i64,
    count_include_pad: i32,
    channels_last: i32,
}

// SAFETY: plain old data with the C layout the kernels declare.
unsafe impl DeviceRepr for PoolArgs {}

pub(super) fn args(d: &PoolDims, p: Option<&Pool2dParams>) -> PoolArgs {
    let i = |v: usize| v as i64;
    let p = p.copied().unwrap_or(Pool2dParams {
        kernel: [1, 1],
        stride: [1, 1],
        padding: [0, 0],
        dilation: [1, 1],
        ceil_mode: false,
        count_include_pad: false,
    });
    PoolArgs {
        planes: i(d.planes),
        h: i(d.h),
        w: i(d.w),
        ho: i(d.ho),
        wo: i(d.wo),
        kh: i(p.kernel[0]),
        kw: i(p.kernel[1]),
        sh: i(p.stride[0]),
        sw: i(p.stride[1]),
        ph: i(p.padding[0]),
        pw: i(p.padding[1]),
        dh: i(p.dilation[0]),
        dw: i(p.dilation[1]),
        c: i(d.c),
        count_include_pad: p.count_include_pad as i32,
        channels_last: d.channels_last as i32,
    }
}

/// The elements of `x` (an `[n, c, h, w]` view) in the order the kernels read them: NCHW, or
/// NHWC when `d.channels_last` (a borrow when they already are).
fn dense<'a>(
    op: &'static str,
    x: &'a CudaStorage,
    l: &Layout,
    d: &PoolDims,
) -> Result<super::storage::Dense<'a>> {
    match d.channels_last {
        true => x.contiguous(&l.permute(op, &[0, 2, 3, 1])?),
        false => x.contiguous(l),
    }
}

/// Which kernels take a pooling launch: one thread per element (`cuda/pool.cu`), or one per
/// 16-byte vector (`cuda/pool_vec.cu`) of adjacent channels of a channels-last pixel (`_cl_`)
/// or of adjacent cells along an NCHW row (`_rows_`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernels {
    Elements,
    Channels,
    Rows,
}

/// The kernels for a launch in `dtype` over `d`. Channels-last: whole vectors of channels (at
/// least one) and every address (`read`, `written`, device addresses) a multiple of 16 bytes.
/// NCHW, where the op has row kernels (`rows`: the length of the rows its threads write):
/// whole vectors along them and the written addresses aligned. Max pooling's u8 taps (`taps`,
/// one per element) need a multiple of the vector's length where they are read or written as
/// vectors.
fn kernels(
    d: &PoolDims,
    dtype: DType,
    read: &[u64],
    written: &[u64],
    taps: Option<u64>,
    rows: Option<usize>,
) -> Kernels {
    let v = 16 / dtype.size_in_bytes();
    let aligned = |p: &[u64]| p.iter().all(|p| p.is_multiple_of(16));
    let taps_fit = taps.is_none_or(|p| p.is_multiple_of(v as u64));
    match (d.channels_last, rows) {
        (true, _)
            if d.c > 0
                && d.c.is_multiple_of(v)
                && aligned(read)
                && aligned(written)
                && taps_fit =>
        {
            Kernels::Channels
        }
        (false, Some(len)) if len > 0 && len.is_multiple_of(v) && aligned(written) && taps_fit => {
            Kernels::Rows
        }
        _ => Kernels::Elements,
    }
}

/// The file, name and launch of kernel `stem` (with `_backward` for a backward) in `t` over
/// `n` written elements: a thread per element, or per vector of them.
fn plan(
    k: Kernels,
    stem: &'static str,
    backward: bool,
    t: &'static str,
    dtype: DType,
    n: usize,
) -> (KernelFile, &'static str, LaunchConfig) {
    let vectors = grid(n / (16 / dtype.size_in_bytes()));
    let (file, form, cfg) = match k {
        Kernels::Elements => (KernelFile::Pool, "", grid(n)),
        Kernels::Channels => (KernelFile::PoolVec, "_cl", vectors),
        Kernels::Rows => (KernelFile::PoolVec, "_rows", vectors),
    };
    (file, pool_name(stem, form, backward, t), cfg)
}

/// `{stem}{form}{_backward}_{t}` as a `&'static str`, spelled from literals for the pooling
/// kernels `cuda/pool.cu` and `cuda/pool_vec.cu` have (interned past them).
fn pool_name(
    stem: &'static str,
    form: &'static str,
    backward: bool,
    t: &'static str,
) -> &'static str {
    macro_rules! names {
        ($($stem:literal, $form:literal => $fwd:literal, $bwd:literal;)*) => {
            match (stem, form, backward) {
                $(
                    ($stem, $form, false) => kname!($fwd, t),
                    ($stem, $form, true) => kname!($bwd, t),
                )*
                _ => {
                    let dir = if backward { "_backward" } else { "" };
                    super::sites::intern(format!("{stem}{form}{dir}_{t}"))
                }
            }
        };
    }
    names! {
        "max_pool2d", "" => "max_pool2d_", "max_pool2d_backward_";
        "max_pool2d_taps", "" => "max_pool2d_taps_", "max_pool2d_taps_backward_";
        "max_pool2d_taps", "_cl" => "max_pool2d_taps_cl_", "max_pool2d_taps_cl_backward_";
        "max_pool2d_taps", "_rows" => "max_pool2d_taps_rows_", "max_pool2d_taps_rows_backward_";
        "avg_pool2d", "" => "avg_pool2d_", "avg_pool2d_backward_";
        "avg_pool2d", "_cl" => "avg_pool2d_cl_", "avg_pool2d_cl_backward_";
        "adaptive_avg_pool2d", "" => "adaptive_avg_pool2d_", "adaptive_avg_pool2d_backward_";
        "adaptive_avg_pool2d", "_cl" => "adaptive_avg_pool2d_cl_", "adaptive_avg_pool2d_cl_backward_";
        "adaptive_avg_pool2d", "_rows" => "adaptive_avg_pool2d_rows_", "adaptive_avg_pool2d_rows_backward_";
    }
}

/// Which pooling: the kernel's name stem and whether it takes window parameters.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Pool {
    Avg,
    Adaptive,
}

/// Max pooling: values and the flat in-plane index of each maximum (I64), as on the CPU.
pub(crate) fn max_pool2d(
    x: &CudaStorage,
    l: &Layout,
    d: &PoolDims,
    p: &Pool2dParams,
) -> Result<(CudaStorage, CudaStorage)> {
    let t = float_kname("max_pool2d", x.dtype())?;
    let x = dense("max_pool2d", x, l, d)?;
    let n = d.planes * d.ho * d.wo;
    let (kind, stem) = index_kind(p);
    let (y, idx) = (
        CudaStorage::alloc_on(x.rt(), x.dtype(), n)?,
        CudaStorage::alloc_on(x.rt(), kind, n)?,
    );
    let (a, xp, yp, ip) = (args(d, Some(p)), x.ptr(), y.ptr(), idx.ptr());
    let input = elems(d.planes * d.h * d.w, x.dtype());
    let k = match kind {
        DType::U8 => kernels(d, x.dtype(), &[xp], &[yp], Some(ip), Some(d.wo)),
        _ => Kernels::Elements,
    };
    let (file, name, cfg) = plan(k, stem, false, t, x.dtype(), n);
    launch!(
        bytes = input + elems(n, x.dtype()) + elems(n, kind);
        x,
        file,
        name,
        cfg,
        &xp,
        &yp,
        &ip,
        &a
    );
    Ok((y, idx))
}

/// How max pooling records each window's maximum, and its kernels' stem: the tap within the
/// window as a u8 where the window has at most 255 taps (255 is "none"), else the flat
/// in-plane index as an i64. The positions live from forward to backward: a 3 x 3 window's
/// u8 taps take an eighth of the memory and bandwidth of i64 indices.
fn index_kind(p: &Pool2dParams) -> (DType, &'static str) {
    match p.kernel[0].checked_mul(p.kernel[1]) {
        Some(taps) if taps <= 255 => (DType::U8, "max_pool2d_taps"),
        _ => (DType::I64, "max_pool2d"),
    }
}

/// Backward of max pooling: each input cell gathers the gradients of the outputs whose index
/// names it.
pub(crate) fn max_pool2d_backward(
    g: &CudaStorage,
    lg: &Layout,
    idx: &CudaStorage,
    d: &PoolDims,
    p: &Pool2dParams,
) -> Result<CudaStorage> {
    let t = float_kname("max_pool2d_backward", g.dtype())?;
    let (kind, stem) = index_kind(p);
    if idx.dtype() != kind || idx.len() != d.planes * d.ho * d.wo {
        return Err(Error::DType {
            op: "max_pool2d_backward",
            dtype: idx.dtype(),
            expected: "the forward's positions, one per output cell",
        });
    }
    let g = dense("max_pool2d_backward", g, lg, d)?;
    let n = d.planes * d.h * d.w;
    let gx = CudaStorage::alloc_on(g.rt(), g.dtype(), n)?;
    let (a, gp, ip, xp) = (args(d, Some(p)), g.ptr(), idx.ptr(), gx.ptr());
    // The row kernel reads the taps one at a time; the channels' kernel as vectors.
    let k = match (kind, d.channels_last) {
        (DType::U8, true) => kernels(d, g.dtype(), &[gp], &[xp], Some(ip), None),
        (DType::U8, false) => kernels(d, g.dtype(), &[], &[xp], None, Some(d.w)),
        _ => Kernels::Elements,
    };
    let (file, name, cfg) = plan(k, stem, true, t, g.dtype(), n);
    let outputs = d.planes * d.ho * d.wo;
    let bytes = elems(outputs, g.dtype()) + elems(outputs, kind) + elems(n, g.dtype());
    launch!(bytes = bytes; g, file, name, cfg, &gp, &ip, &xp, &a);
    Ok(gx)
}

/// Average (`p` given) or adaptive average (`p` `None`) pooling, forward or backward.
pub(crate) fn avg_pool2d(
    x: &CudaStorage,
    l: &Layout,
    d: &PoolDims,
    kind: Pool,
    p: Option<&Pool2dParams>,
    backward: bool,
) -> Result<CudaStorage> {
    let stem = match kind {
        Pool::Avg => "avg_pool2d",
        Pool::Adaptive => "adaptive_avg_pool2d",
    };
    let t = float_kname(stem, x.dtype())?;
    let x = dense(stem, x, l, d)?;
    let n = match backward {
        true => d.planes * d.h * d.w,
        false => d.planes * d.ho * d.wo,
    };
    let out = CudaStorage::alloc_on(x.rt(), x.dtype(), n)?;
    let (a, xp, op) = (args(d, p), x.ptr(), out.ptr());
    // NCHW rows: the adaptive pool's backward (the head's global pooling) has a kernel.
    let rows = (matches!(kind, Pool::Adaptive) && backward).then_some(d.w);
    let k = kernels(d, x.dtype(), &[xp], &[op], None, rows);
    let (file, name, cfg) = plan(k, stem, backward, t, x.dtype(), n);
    // Reads the other side's cells: the input forward, the gradient of the output backward.
    let read = match backward {
        true => d.planes * d.ho * d.wo,
        false => d.planes * d.h * d.w,
    };
    let bytes = elems(read, x.dtype()) + elems(n, x.dtype());
    launch!(bytes = bytes; x, file, name, cfg, &xp, &op, &a);
    Ok(out)
}
