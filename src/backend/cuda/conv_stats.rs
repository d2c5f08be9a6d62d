//! A convolution whose epilogue also sums each output channel and its squares, through
//! cuDNN's graph API: `ConvolutionFwd -> GenStats` (the pattern of NVIDIA's ConvBNfprop
//! engine, its scale/bias/ReLU prologue left out). A training batch norm that reads the
//! output then takes its statistics from those sums (`bn_finalize` alone) instead of a
//! pass over the output (`bn_partial`): `ops::conv` keeps them beside the output.
//!
//! cuDNN offers the pattern for f16 only, channels-last, packed, one group, on compute
//! capability 8.0 and up except 8.9; channels a multiple of 8 keep the operands 16-byte
//! aligned as its engines ask. Anything else, and any graph cuDNN declines (remembered per
//! shape), runs the plain convolution and batch norm makes its own statistics.
//!
//! Off by default: [`set_conv_bn_fusion`] switches it on.

use super::conv::{conv_bytes, conv_flops, operands};
use super::conv_desc::Pass;
use super::dnn_graph::{nhwc_strides, tensor, Attr, Built, Desc, Kind, Plan, Ty};
use super::limits::library_index_limit;
use super::storage::CudaStorage;
use crate::backend::spec::ConvDims;
use crate::layout::Layout;
use crate::{DType, Device, Error, Result};
use cudarc::cudnn::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

static ON: AtomicBool = AtomicBool::new(false);

/// Has f16 channels-last convolutions on CUDA also sum each output channel and its squares
/// in their epilogue (cuDNN's graph API), so that a training batch norm right after takes its
/// statistics from those sums instead of reading the output once more. Off by default; where
/// cuDNN declines the graph the convolution runs as before.
///
/// ```
/// use mantissa::backend::cuda::conv_stats::{conv_bn_fusion, set_conv_bn_fusion};
/// assert!(!conv_bn_fusion());
/// set_conv_bn_fusion(true);
/// assert!(conv_bn_fusion());
/// set_conv_bn_fusion(false);
/// ```
pub fn set_conv_bn_fusion(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

/// Whether convolutions sum their output channels for batch norm (see
/// [`set_conv_bn_fusion`]).
pub fn conv_bn_fusion() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Everything a plan depends on: the device (its handle) and the problem.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    device: Device,
    dims: [usize; 9],
    params: [usize; 6],
}

/// Plans by problem; `None`: cuDNN declined it (not asked again).
type Plans = Mutex<HashMap<Key, Option<Arc<Plan>>>>;

fn plans() -> &'static Plans {
    static PLANS: OnceLock<Plans> = OnceLock::new();
    PLANS.get_or_init(Default::default)
}

/// The variant pack's ids of x, w, y, the sums and the sums of squares.
const UIDS: [i64; 5] = [1, 2, 3, 4, 5];

/// Whether the problem is one the fused graph is asked for (f16, channels-last, one group,
/// channels in whole 16-byte vectors, every tensor within cuDNN's 32-bit element limit).
fn eligible(dtype: DType, d: &ConvDims) -> bool {
    let limit = library_index_limit();
    let fits = |dims: [usize; 4]| {
        dims.iter()
            .try_fold(1usize, |a, &v| a.checked_mul(v))
            .is_some_and(|n| n > 0 && n <= limit)
    };
    dtype == DType::F16
        && d.channels_last
        && d.p.groups == 1
        && d.c.is_multiple_of(8)
        && d.o.is_multiple_of(8)
        && fits([d.n, d.c, d.h, d.w])
        && fits([d.n, d.o, d.ho, d.wo])
        && fits([d.o, d.c, d.kh, d.kw])
}

/// The graph `y = conv(x, w); sum, sqsum = genstats(y)` for `d` (f16 NHWC / KRSC, f32
/// sums), built into a plan on `h`.
fn build(h: sys::cudnnHandle_t, d: &ConvDims) -> Result<Built> {
    let i = |v: usize| v as i64;
    let half = sys::cudnnDataType_t::CUDNN_DATA_HALF;
    let float = sys::cudnnDataType_t::CUDNN_DATA_FLOAT;
    let xd = [i(d.n), i(d.c), i(d.h), i(d.w)];
    let wd = [i(d.o), i(d.c), i(d.kh), i(d.kw)];
    let yd = [i(d.n), i(d.o), i(d.ho), i(d.wo)];
    let sd = [1, i(d.o), 1, 1];
    let x = tensor(half, xd, nhwc_strides(xd), UIDS[0])?;
    let w = tensor(half, wd, nhwc_strides(wd), UIDS[1])?;
    let y = tensor(half, yd, nhwc_strides(yd), UIDS[2])?;
    let sum = tensor(float, sd, nhwc_strides(sd), UIDS[3])?;
    let sqsum = tensor(float, sd, nhwc_strides(sd), UIDS[4])?;

    let p = &d.p;
    let conv = Desc::new(Kind::CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR)?;
    conv.enumerated(
        Attr::CUDNN_ATTR_CONVOLUTION_COMP_TYPE,
        Ty::CUDNN_TYPE_DATA_TYPE,
        float,
    )?;
    conv.enumerated(
        Attr::CUDNN_ATTR_CONVOLUTION_CONV_MODE,
        Ty::CUDNN_TYPE_CONVOLUTION_MODE,
        sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
    )?;
    conv.ints(Attr::CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, &[2])?;
    let pad = [i(p.padding[0]), i(p.padding[1])];
    conv.ints(Attr::CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, &pad)?;
    conv.ints(Attr::CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, &pad)?;
    conv.ints(
        Attr::CUDNN_ATTR_CONVOLUTION_DILATIONS,
        &[i(p.dilation[0]), i(p.dilation[1])],
    )?;
    conv.ints(
        Attr::CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES,
        &[i(p.stride[0]), i(p.stride[1])],
    )?;
    if let Err(s) = conv.finalize() {
        return Ok(Built::Declined(format!(
            "the convolution descriptor: {s:?}"
        )));
    }

    let fwd = Desc::new(Kind::CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR)?;
    fwd.descs(Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, &[&x])?;
    fwd.descs(Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, &[&w])?;
    fwd.descs(Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, &[&y])?;
    fwd.descs(
        Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
        &[&conv],
    )?;
    fwd.float(Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, 1.0)?;
    fwd.float(Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA, 0.0)?;
    if let Err(s) = fwd.finalize() {
        return Ok(Built::Declined(format!("the convolution: {s:?}")));
    }

    let stats = Desc::new(Kind::CUDNN_BACKEND_OPERATION_GEN_STATS_DESCRIPTOR)?;
    stats.enumerated(
        Attr::CUDNN_ATTR_OPERATION_GENSTATS_MODE,
        Ty::CUDNN_TYPE_GENSTATS_MODE,
        sys::cudnnGenStatsMode_t::CUDNN_GENSTATS_SUM_SQSUM,
    )?;
    stats.enumerated(
        Attr::CUDNN_ATTR_OPERATION_GENSTATS_MATH_PREC,
        Ty::CUDNN_TYPE_DATA_TYPE,
        float,
    )?;
    stats.descs(Attr::CUDNN_ATTR_OPERATION_GENSTATS_XDESC, &[&y])?;
    stats.descs(Attr::CUDNN_ATTR_OPERATION_GENSTATS_SUMDESC, &[&sum])?;
    stats.descs(Attr::CUDNN_ATTR_OPERATION_GENSTATS_SQSUMDESC, &[&sqsum])?;
    if let Err(s) = stats.finalize() {
        return Ok(Built::Declined(format!("the statistics: {s:?}")));
    }
    // The operations are the last two descriptors.
    Plan::build(h, vec![x, w, y, sum, sqsum, conv, fwd, stats], 2)
}

/// `conv2d` of f16 channels-last `x` and `w` whose epilogue also writes the per-channel sums
/// of the output and of its squares: the output (dense NHWC) and the sums (f32 `[2, o]`,
/// `[sum | sum of squares]`). `None` when the switch is off, the problem is not one cuDNN
/// fuses (see the module), or cuDNN declined it; the caller then runs the plain convolution.
pub(crate) fn conv2d_with_sums(
    x: &CudaStorage,
    lx: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    d: &ConvDims,
) -> Result<Option<(CudaStorage, CudaStorage)>> {
    if !conv_bn_fusion() || !eligible(x.dtype(), d) || w.dtype() != x.dtype() {
        return Ok(None);
    }
    let (a, b) = operands(Pass::Forward, (x, lx), (w, lw), d)?;
    if a.ptr() % 16 != 0 || b.ptr() % 16 != 0 {
        return Ok(None);
    }
    let p = &d.p;
    let key = Key {
        device: x.rt().device(),
        dims: [d.n, d.c, d.h, d.w, d.o, d.kh, d.kw, d.ho, d.wo],
        params: [
            p.stride[0],
            p.stride[1],
            p.padding[0],
            p.padding[1],
            p.dilation[0],
            p.dilation[1],
        ],
    };
    let lock = || plans().lock().unwrap_or_else(|e| e.into_inner());
    let known = lock().get(&key).cloned();
    if let Some(None) = known {
        return Ok(None);
    }
    let rt = x.rt().clone();
    let out_len = d.n * d.o * d.ho * d.wo;
    let y = CudaStorage::alloc_on(&rt, DType::F16, out_len)?;
    let sums = CudaStorage::alloc_on(&rt, DType::F32, 2 * d.o)?;
    let ran = rt.with_cudnn(|h| -> Result<bool> {
        let plan = match known {
            Some(Some(plan)) => plan,
            _ => match build(h, d)? {
                Built::Plan(plan) => {
                    let plan = Arc::new(plan);
                    lock().insert(key.clone(), Some(plan.clone()));
                    plan
                }
                Built::Declined(why) => {
                    if std::env::var_os("MANTISSA_DEBUG_FUSION").is_some() {
                        eprintln!("mantissa: cuDNN declined conv + stats for {d:?}: {why}");
                    }
                    lock().insert(key.clone(), None);
                    return Ok(false);
                }
            },
        };
        let ws = CudaStorage::alloc_on(&rt, DType::U8, plan.workspace.max(1))?;
        let prof = super::profile::library(
            &rt,
            || {
                format!(
                    "cudnn conv+stats n{} c{} {}x{} o{} k{}x{} s{} f16 nhwc",
                    d.n, d.c, d.h, d.w, d.o, d.kh, d.kw, p.stride[0]
                )
            },
            conv_flops(d),
            conv_bytes(d, DType::F16),
        );
        let sq = sums.ptr() + 4 * d.o as u64;
        let ptrs = [a.ptr(), b.ptr(), y.ptr(), sums.ptr(), sq].map(|p| p as *mut c_void);
        // SAFETY: x, w and y are dense f16 NHWC / KRSC buffers of the graph's dims on this
        // device (`operands` made them so; y allocated above with n o ho wo elements), the
        // sums two f32 runs of `o` values inside `sums` (2 o values); the workspace holds the
        // plan's size; the handle's stream is the runtime's, which orders these buffers' uses.
        let run = unsafe { plan.execute(h, &UIDS, &ptrs, ws.ptr() as *mut c_void) };
        match run {
            Ok(()) => {
                if let Some(p) = prof {
                    p.end();
                }
                Ok(true)
            }
            Err(status) => Err(Error::CudaLibraryStatus {
                lib: "cuDNN",
                op: "conv2d",
                device: rt.device(),
                status,
                what: format!("convolution with channel sums, {d:?}"),
            }),
        }
    })??;
    Ok(ran.then_some((y, sums)))
}
