//! 2-D convolution through cuDNN: forward, backward data and backward filter, with the
//! algorithm for each shape chosen once and cached. By default cuDNN's heuristics choose;
//! [`set_cudnn_benchmark`] times the candidates instead (PyTorch's `cudnn.benchmark = True`),
//! and [`set_cudnn_deterministic`] keeps only deterministic algorithms. Workspaces come from
//! the caching allocator, so a step reuses the previous step's blocks.
//!
//! f32 convolutions may use TF32 tensor cores, as PyTorch's do by default
//! (`torch.backends.cudnn.allow_tf32 = True`); [`set_cudnn_allow_tf32`]`(false)` makes them
//! exact f32 (FMA math). f16 and bf16 use tensor cores with f32 accumulation.

use super::conv_desc::{dnn_err, list, Algo, Candidate, Descriptors, Pass};
use super::limits::{aligned_items, items_per_call, library_index_limit, LIBRARY_ALIGN};
use super::storage::{float_kname, CudaStorage, Dense};
pub use super::tf32::{cudnn_allow_tf32, set_cudnn_allow_tf32};
use crate::backend::spec::ConvDims;
use crate::layout::Layout;
use crate::{DType, Device, Error, Result};
use cudarc::cudnn::{result as dnn, sys};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

static BENCHMARK: AtomicBool = AtomicBool::new(false);
static DETERMINISTIC: AtomicBool = AtomicBool::new(false);

/// Times cuDNN's candidate algorithms at the first convolution of each shape and keeps the
/// fastest (PyTorch's `torch.backends.cudnn.benchmark = True`). Off by default: cuDNN's
/// heuristics choose without running anything.
///
/// ```
/// mantissa::backend::cuda::conv::set_cudnn_benchmark(true);
/// assert!(mantissa::backend::cuda::conv::cudnn_benchmark());
/// mantissa::backend::cuda::conv::set_cudnn_benchmark(false);
/// ```
pub fn set_cudnn_benchmark(on: bool) {
    BENCHMARK.store(on, Ordering::Relaxed);
}

/// Whether convolution algorithms are chosen by timing (see [`set_cudnn_benchmark`]).
pub fn cudnn_benchmark() -> bool {
    BENCHMARK.load(Ordering::Relaxed)
}

/// Restricts convolutions to deterministic algorithms, so a run repeats bit for bit
/// (PyTorch's `torch.backends.cudnn.deterministic = True`): cuDNN's backward algorithms
/// that add with atomics (reported `CUDNN_NON_DETERMINISTIC`) are never chosen, by the
/// heuristics or by [`set_cudnn_benchmark`]'s timing (cuDNN's search times every algorithm;
/// the fastest deterministic one is kept), and the graph API's fused convolutions
/// ([`super::conv_stats::set_conv_bn_fusion`]) run only on engines without the numerical
/// note `NONDETERMINISTIC`, or unfused. Choices are remembered per shape and per setting of
/// this switch. Off by default; read at each convolution, so set it before the runs that
/// must agree (a process-wide switch).
///
/// ```
/// use mantissa::backend::cuda::conv::{cudnn_deterministic, set_cudnn_deterministic};
/// set_cudnn_deterministic(true);
/// assert!(cudnn_deterministic());
/// set_cudnn_deterministic(false);
/// ```
pub fn set_cudnn_deterministic(on: bool) {
    DETERMINISTIC.store(on, Ordering::Relaxed);
}

/// Whether only deterministic convolution algorithms are used.
pub fn cudnn_deterministic() -> bool {
    DETERMINISTIC.load(Ordering::Relaxed)
}

/// Everything the algorithm choice depends on.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    device: Device,
    pass: Pass,
    dtype: DType,
    dims: [usize; 9],
    params: [usize; 7],
    channels_last: bool,
    tf32: bool,
    benchmark: bool,
    deterministic: bool,
}

fn chosen() -> &'static Mutex<HashMap<Key, Candidate>> {
    static CHOSEN: OnceLock<Mutex<HashMap<Key, Candidate>>> = OnceLock::new();
    CHOSEN.get_or_init(Default::default)
}

/// Runs one pass: `a` and `b` are the two inputs (forward: x, w; data: dy, w; filter: x, dy),
/// `out` the result (`beta` times its previous values added: 0 or 1), all dense on one
/// device: NCHW / KCRS, or NHWC / KRSC when `d.channels_last`.
///
/// A batch whose activations pass cuDNN's 32-bit element limit runs as several calls over
/// pieces of the batch that fit (the batch is the outermost dim in both layouts, so a piece
/// is a contiguous range); the weight's gradient adds each piece's part onto the first's.
/// One image past the limit, or a weight past it, is [`Error::TooLarge`].
///
/// Every piece starts on a 16-byte boundary, as cuDNN's tensor-core kernels require: the
/// pieces hold a whole number of the images after which both activations line up again
/// (`limits::aligned_items`: 8 images of an odd number of f16 elements). Where even that
/// many images pass the limit (huge images of such sizes), a piece that would start
/// unaligned runs on aligned copies of its images instead ([`run_staged`]), at the cost of
/// a piece's worth of memory and copies.
fn run(
    pass: Pass,
    d: &ConvDims,
    a: &CudaStorage,
    b: &CudaStorage,
    out: &CudaStorage,
    beta: f32,
) -> Result<()> {
    let (input, output) = (d.c * d.h * d.w, d.o * d.ho * d.wo);
    let weight = d.o * d.cg() * d.kh * d.kw;
    let limit = library_index_limit();
    let per_call = match items_per_call(input.max(output)) {
        Some(k) if weight <= limit => k,
        _ => {
            return Err(Error::too_large(
                pass.op(),
                &[d.n, d.c, d.h, d.w],
                format!(
                    "one image ({input} input and {output} output elements) or the weight \
                     ({weight} elements) passes cuDNN's limit of {limit} elements per tensor"
                ),
            ))
        }
    };
    let ptrs = (a.ptr(), b.ptr(), out.ptr());
    if d.n <= per_call {
        return run_piece(pass, d, a.rt(), a.dtype(), ptrs, beta);
    }
    let elem_bytes = a.dtype().size_in_bytes();
    let (per_call, staged) = match aligned_items(per_call, elem_bytes, &[input, output]) {
        0 => (per_call, true),
        k => (k, false),
    };
    let elem = elem_bytes as u64;
    for start in (0..d.n).step_by(per_call) {
        let piece = ConvDims {
            n: per_call.min(d.n - start),
            ..*d
        };
        // Byte offsets of the piece's first image in the input and output activations
        // (below the storages' sizes, which are below isize::MAX).
        let (i, o) = (
            (start * input) as u64 * elem,
            (start * output) as u64 * elem,
        );
        let (pa, pb, po) = ptrs;
        let (ptrs, beta) = match pass {
            Pass::Forward => ((pa + i, pb, po + o), beta),
            Pass::Data => ((pa + o, pb, po + i), beta),
            // Every piece adds its part of the weight's gradient onto the first's.
            Pass::Filter => ((pa + i, pb + o, po), if start == 0 { beta } else { 1.0 }),
        };
        let aligned = [ptrs.0, ptrs.1, ptrs.2]
            .iter()
            .all(|p| p % LIBRARY_ALIGN as u64 == 0);
        match staged && !aligned {
            true => run_staged(pass, &piece, start, (a, b, out), beta)?,
            false => run_piece(pass, &piece, a.rt(), a.dtype(), ptrs, beta)?,
        }
    }
    Ok(())
}

/// The piece of `piece.n` images from image `start` of a split batch (see [`run`]) over
/// 16-byte aligned copies of its operands that are split with the batch: their images copied
/// out, the result computed into a copy (of its previous values where `beta` adds onto them)
/// and copied back into place.
fn run_staged(
    pass: Pass,
    piece: &ConvDims,
    start: usize,
    (a, b, out): (&CudaStorage, &CudaStorage, &CudaStorage),
    beta: f32,
) -> Result<()> {
    let (input, output) = (piece.c * piece.h * piece.w, piece.o * piece.ho * piece.wo);
    // Elements per image of the operands split with the batch (a, b, out; the weight or
    // its gradient is not).
    let (ea, eb, eo) = match pass {
        Pass::Forward => (Some(input), None, Some(output)),
        Pass::Data => (Some(output), None, Some(input)),
        Pass::Filter => (Some(input), Some(output), None),
    };
    // The piece's images of `s` (`e` elements each) as a new, aligned storage.
    let images = |s: &CudaStorage, e: usize| {
        s.copy_strided(&Layout::new(vec![piece.n * e], vec![1], start * e))
    };
    let ta = ea.map(|e| images(a, e)).transpose()?;
    let tb = eb.map(|e| images(b, e)).transpose()?;
    let to = match eo {
        Some(e) if beta != 0.0 => Some(images(out, e)?),
        Some(e) => Some(CudaStorage::alloc_on(out.rt(), out.dtype(), piece.n * e)?),
        None => None,
    };
    let at = |t: &Option<CudaStorage>, s: &CudaStorage| t.as_ref().map_or(s.ptr(), |t| t.ptr());
    let ptrs = (at(&ta, a), at(&tb, b), at(&to, out));
    run_piece(pass, piece, a.rt(), a.dtype(), ptrs, beta)?;
    match (to, eo) {
        (Some(t), Some(e)) => out.write_at(start * e, &t),
        _ => Ok(()),
    }
}

/// One cuDNN call of `pass` over the problem `d`, whose tensors fit cuDNN's limits: the
/// inputs at device addresses `pa` and `pb`, the result at `po` (see [`run`]).
fn run_piece(
    pass: Pass,
    d: &ConvDims,
    rt: &std::sync::Arc<super::runtime::CudaRuntime>,
    dtype: DType,
    (pa, pb, po): (u64, u64, u64),
    beta: f32,
) -> Result<()> {
    let (device, rt) = (rt.device(), rt.clone());
    // Before any cuDNN call: cudarc would otherwise open the library by name only, and panic
    // where the loader path lacks it.
    super::libs::load(super::libs::Lib::Cudnn)?;
    // The TF32 switch read once: the math type and the cache key agree.
    let tf32 = dtype == DType::F32 && cudnn_allow_tf32();
    let s = Descriptors::new(pass, device, dtype, tf32, d)?;
    let p = &d.p;
    let (dims, params) = d.key();
    let key = Key {
        device,
        pass,
        dtype,
        dims,
        params,
        channels_last: d.channels_last,
        tf32,
        benchmark: cudnn_benchmark(),
        deterministic: cudnn_deterministic(),
    };
    let known = chosen()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&key)
        .copied();
    if known.is_none() && key.benchmark {
        rt.refuse_in_capture(
            &format!(
                "cuDNN's benchmark search for a new {} convolution",
                pass.op()
            ),
            "it times the candidates, synchronising the device; the step's eager warm-up \
             calls choose every shape's algorithm",
        )?;
    }
    rt.with_cudnn(|h| -> Result<()> {
        let candidates = match known {
            Some(c) => vec![c],
            None => {
                let (status, mut list) = list(h, pass, &s, key.benchmark);
                if status != sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
                    return Err(dnn_err(pass, device, "choosing an algorithm", status));
                }
                if key.deterministic {
                    list.retain(|c| c.deterministic);
                }
                // Exact f32 was asked for: no algorithm that would round operands to TF32.
                if dtype == DType::F32 && !key.tf32 {
                    list.retain(|c| c.math == sys::cudnnMathType_t::CUDNN_FMA_MATH);
                }
                list
            }
        };
        let mut last = None;
        for c in candidates {
            // SAFETY: the descriptor is alive.
            unsafe { dnn::set_convolution_math_type(s.conv, c.math) }
                .map_err(|e| dnn_err(pass, device, "math type", e.0))?;
            // A workspace the device cannot hold rules the algorithm out; the next one may
            // need less.
            let ws = match CudaStorage::alloc_on(&rt, DType::U8, c.workspace.max(1)) {
                Ok(ws) => ws,
                Err(e) => {
                    last = Some(e);
                    continue;
                }
            };
            let one = 1.0f32;
            let (alpha, beta) = (
                &one as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
            );
            let (pa, pb, po) = (pa as *const c_void, pb as *const c_void, po as *mut c_void);
            let wsp = ws.ptr() as *mut c_void;
            let prof = super::profile::library(
                &rt,
                || {
                    let layout = if d.channels_last { "nhwc" } else { "nchw" };
                    format!(
                        "cudnn conv {:?} n{} c{} {}x{} o{} k{}x{} s{} {} {layout} {:?}",
                        pass,
                        d.n,
                        d.c,
                        d.h,
                        d.w,
                        d.o,
                        d.kh,
                        d.kw,
                        p.stride[0],
                        super::profile::short(dtype),
                        c.algo
                    )
                },
                conv_flops(d),
                conv_bytes(d, dtype),
            );
            // SAFETY: the pointers address contiguous NCHW (NHWC) buffers of the shapes in
            // the descriptors, on this device (a piece of the batch starts inside its
            // storage: `run` offsets by whole images below `d.n`, or `run_staged` passes
            // copies of the piece); the workspace holds `c.workspace` bytes; the handle's
            // stream is the runtime's stream, which orders these buffers' uses.
            let status = unsafe {
                match c.algo {
                    Algo::Forward(al) => sys::cudnnConvolutionForward(
                        h,
                        alpha,
                        s.x,
                        pa,
                        s.w,
                        pb,
                        s.conv,
                        al,
                        wsp,
                        c.workspace,
                        beta,
                        s.y,
                        po,
                    ),
                    Algo::Data(al) => sys::cudnnConvolutionBackwardData(
                        h,
                        alpha,
                        s.w,
                        pb,
                        s.y,
                        pa,
                        s.conv,
                        al,
                        wsp,
                        c.workspace,
                        beta,
                        s.x,
                        po,
                    ),
                    Algo::Filter(al) => sys::cudnnConvolutionBackwardFilter(
                        h,
                        alpha,
                        s.x,
                        pa,
                        s.y,
                        pb,
                        s.conv,
                        al,
                        wsp,
                        c.workspace,
                        beta,
                        s.w,
                        po,
                    ),
                }
            };
            if status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
                if let Some(p) = prof {
                    p.end();
                }
                chosen()
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(key.clone(), c);
                return Ok(());
            }
            last = Some(dnn_err(pass, device, &format!("{:?}", c.algo), status));
        }
        Err(last.unwrap_or_else(|| Error::CudaLibraryStatus {
            lib: "cuDNN",
            op: pass.op(),
            device,
            status: "no algorithm".into(),
            what: format!("{dtype:?} {d:?} deterministic={}", key.deterministic),
        }))
    })?
}

/// Multiply-adds times two of one pass (each pass does the forward's products).
pub(super) fn conv_flops(d: &ConvDims) -> u64 {
    let cpg = d.c / d.p.groups.max(1);
    [d.n, d.o, d.ho, d.wo, cpg, d.kh, d.kw, 2]
        .iter()
        .fold(1u64, |acc, &v| acc.saturating_mul(v as u64))
}

/// Bytes of the three tensors a pass reads or writes once each.
pub(super) fn conv_bytes(d: &ConvDims, dtype: DType) -> u64 {
    let cpg = d.c / d.p.groups.max(1);
    let elems = d.n * d.c * d.h * d.w + d.o * cpg * d.kh * d.kw + d.n * d.o * d.ho * d.wo;
    (elems * dtype.size_in_bytes()) as u64
}

/// Forward convolution; output `[n, o, ho, wo]`, NHWC when `d.channels_last`.
pub(crate) fn conv2d(
    x: &CudaStorage,
    lx: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    d: &ConvDims,
) -> Result<CudaStorage> {
    pass(Pass::Forward, (x, lx), (w, lw), d.n * d.o * d.ho * d.wo, d)
}

/// Gradient with respect to the input, `[n, c, h, w]`, NHWC when `d.channels_last`.
pub(crate) fn conv2d_backward_input(
    gy: &CudaStorage,
    lgy: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    d: &ConvDims,
) -> Result<CudaStorage> {
    pass(Pass::Data, (gy, lgy), (w, lw), d.n * d.c * d.h * d.w, d)
}

/// Adds the gradient with respect to the input onto `out` (`[n, c, h, w]`, dense NCHW, or
/// NHWC when `d.channels_last`, in `gy`'s dtype) in the convolution itself (`beta = 1`).
pub(crate) fn conv2d_backward_input_acc(
    gy: &CudaStorage,
    lgy: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    d: &ConvDims,
    out: &mut CudaStorage,
) -> Result<()> {
    let op = Pass::Data.op();
    let n = d.n * d.c * d.h * d.w;
    if out.dtype() != gy.dtype() || out.len() != n {
        let (len, dt) = (out.len(), out.dtype());
        let msg = format!("internal: accumulating into {len} {dt:?} values, need {n}");
        return Err(Error::invalid(op, msg));
    }
    let (a, b) = operands(Pass::Data, (gy, lgy), (w, lw), d)?;
    run(Pass::Data, d, &a, &b, out, 1.0)
}

/// Gradient with respect to the weight, `[o, c / groups, kh, kw]`, KRSC when
/// `d.channels_last`.
pub(crate) fn conv2d_backward_weight(
    x: &CudaStorage,
    lx: &Layout,
    gy: &CudaStorage,
    lgy: &Layout,
    d: &ConvDims,
) -> Result<CudaStorage> {
    let n = d.o * (d.c / d.p.groups) * d.kh * d.kw;
    pass(Pass::Filter, (x, lx), (gy, lgy), n, d)
}

fn pass(
    pass: Pass,
    a: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
    out_len: usize,
    d: &ConvDims,
) -> Result<CudaStorage> {
    let (a, b) = operands(pass, a, b, d)?;
    let out = CudaStorage::alloc_on(a.rt(), a.dtype(), out_len)?;
    run(pass, d, &a, &b, &out, 0.0)?;
    // The weight's gradient comes out KRSC, which is the channels-last weight's own order.
    Ok(out)
}

/// A pass's two operands, of one float dtype, dense in its order: NCHW / KCRS, or NHWC /
/// KRSC when `d.channels_last` (a borrow when an operand already is, as the activations of a
/// channels-last network are; the weights are reordered per call).
pub(super) fn operands<'a>(
    pass: Pass,
    (a, la): (&'a CudaStorage, &Layout),
    (b, lb): (&'a CudaStorage, &Layout),
    d: &ConvDims,
) -> Result<(Dense<'a>, Dense<'a>)> {
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op: pass.op(),
            lhs: a.dtype(),
            rhs: b.dtype(),
        });
    }
    float_kname(pass.op(), a.dtype())?;
    if !d.channels_last {
        return Ok((a.contiguous(la)?, b.contiguous(lb)?));
    }
    let nhwc = |l: &Layout| l.permute(pass.op(), &NHWC);
    Ok((a.contiguous(&nhwc(la)?)?, b.contiguous(&nhwc(lb)?)?))
}

/// The dims of an NCHW / KCRS tensor in NHWC / KRSC memory order, outermost first.
const NHWC: [usize; 4] = [0, 2, 3, 1];
