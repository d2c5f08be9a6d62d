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
use super::dnn_graph::{
    cached, conv_dims, convolution, op_ready, plan_for, ran, tensor, Attr, Built, ConvKey, Desc,
    Kind, Plan, Plans, Ty,
};
use super::limits::library_index_limit;
use super::runtime::CudaRuntime;
use super::storage::CudaStorage;
use crate::backend::spec::ConvDims;
use crate::layout::Layout;
use crate::{DType, Error, Result};
use cudarc::cudnn::sys;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

static ON: AtomicBool = AtomicBool::new(false);

/// Folds training batch norm into f16 channels-last convolutions on CUDA through cuDNN's
/// graph API: a convolution also sums each output channel and its squares in its epilogue, so
/// that a training batch norm right after takes its statistics from those sums instead of
/// reading the output once more; and a convolution whose input is a batch norm's output
/// applies batch norm's map in its weight gradient's prologue instead of having the output
/// made again in backward (`conv_wgrad`). Off by default; where cuDNN declines a graph the
/// operations run as before.
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

fn plans() -> &'static Plans {
    static PLANS: OnceLock<Plans> = OnceLock::new();
    PLANS.get_or_init(Default::default)
}

/// The variant pack's ids of x, w, y, the sums and the sums of squares.
const UIDS: [i64; 5] = [1, 2, 3, 4, 5];

/// Whether a problem is one the fused graphs are asked for (forward here, the weight's
/// gradient in `conv_wgrad`): f16, channels-last, one group, channels in whole 16-byte
/// vectors, every tensor within cuDNN's 32-bit element limit.
pub(super) fn eligible(dtype: DType, d: &ConvDims) -> bool {
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
/// sums), built into a plan on `h` (on a deterministic engine when `deterministic`).
fn build(h: sys::cudnnHandle_t, d: &ConvDims, deterministic: bool) -> Result<Built> {
    let half = sys::cudnnDataType_t::CUDNN_DATA_HALF;
    let float = sys::cudnnDataType_t::CUDNN_DATA_FLOAT;
    let [xd, wd, yd] = conv_dims(d);
    let sd = [1, yd[1], 1, 1];
    let x = tensor(half, xd, UIDS[0], false)?;
    let w = tensor(half, wd, UIDS[1], false)?;
    let y = tensor(half, yd, UIDS[2], false)?;
    let sum = tensor(float, sd, UIDS[3], false)?;
    let sqsum = tensor(float, sd, UIDS[4], false)?;
    let conv = match convolution(d)? {
        Ok(conv) => conv,
        Err(why) => return Ok(Built::Declined(why)),
    };

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
    if let Err(why) = op_ready(&fwd, "the convolution") {
        return Ok(Built::Declined(why));
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
    if let Err(why) = op_ready(&stats, "the statistics") {
        return Ok(Built::Declined(why));
    }
    // The operations are the last two descriptors.
    Plan::build(
        h,
        vec![x, w, y, sum, sqsum, conv, fwd, stats],
        2,
        deterministic,
    )
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
    let key = ConvKey::new(x.rt().device(), d);
    if matches!(cached(plans(), &key), Some(None)) {
        return Ok(None);
    }
    let (a, b) = operands(Pass::Forward, (x, lx), (w, lw), d)?;
    if a.ptr() % 16 != 0 || b.ptr() % 16 != 0 {
        return Ok(None);
    }
    let rt = x.rt().clone();
    let y = CudaStorage::alloc_on(&rt, DType::F16, d.n * d.o * d.ho * d.wo)?;
    let sums = CudaStorage::alloc_on(&rt, DType::F32, 2 * d.o)?;
    let ran = rt.with_cudnn(|h| -> Result<bool> {
        let what = "convolution with channel sums";
        let Some(plan) = plan_for(plans(), &key, what, || build(h, d, key.deterministic()))? else {
            return Ok(false);
        };
        let sq = sums.ptr() + 4 * d.o as u64;
        let ptrs = [a.ptr(), b.ptr(), y.ptr(), sums.ptr(), sq].map(|p| p as *mut c_void);
        let fused = Fused {
            plans: plans(),
            key: &key,
            what,
            op: "conv2d",
            label: "conv+stats",
        };
        // SAFETY: x, w and y are dense f16 NHWC / KRSC buffers of the graph's dims on this
        // device (`operands` made them so; y allocated above with n o ho wo elements), the
        // sums two f32 runs of `o` values inside `sums` (2 o values); the handle's stream is
        // the runtime's, which orders these buffers' uses.
        unsafe { fused.run(&rt, h, &plan, d, &UIDS, &ptrs) }
    })??;
    Ok(ran.then_some((y, sums)))
}

/// One fused convolution graph's run: its plan cache and problem, its name in messages
/// (`what`), the op its errors name, and its profiler label (`cudnn {label} n.. c.. ..`).
pub(super) struct Fused<'a> {
    pub(super) plans: &'a Plans,
    pub(super) key: &'a ConvKey,
    pub(super) what: &'a str,
    pub(super) op: &'static str,
    pub(super) label: &'a str,
}

impl Fused<'_> {
    /// Runs `plan` (for `d`) on handle `h` over the device addresses `ptrs` of the tensors
    /// `uids`, with a workspace of the plan's size, as one profiled library call; `Ok(false)`
    /// where cuDNN refused to run it (then remembered as declined: `dnn_graph::ran`), `Err`
    /// naming the op for any other status.
    ///
    /// # Safety
    /// As [`Plan::execute`]: each address holds the tensor its uid names, on `rt`'s device,
    /// alive until the stream has run the plan; `h` is `rt`'s handle, on `rt`'s stream.
    pub(super) unsafe fn run(
        &self,
        rt: &Arc<CudaRuntime>,
        h: sys::cudnnHandle_t,
        plan: &Plan,
        d: &ConvDims,
        uids: &[i64],
        ptrs: &[*mut c_void],
    ) -> Result<bool> {
        let ws = CudaStorage::alloc_on(rt, DType::U8, plan.workspace.max(1))?;
        let prof = super::profile::library(
            rt,
            || {
                // A plan on a non-deterministic engine says so (what deterministic mode
                // avoids: `conv::set_cudnn_deterministic`).
                let nondet = if plan.nondeterministic {
                    " nondeterministic"
                } else {
                    ""
                };
                format!(
                    "cudnn {} n{} c{} {}x{} o{} k{}x{} s{} f16 nhwc{nondet}",
                    self.label, d.n, d.c, d.h, d.w, d.o, d.kh, d.kw, d.p.stride[0]
                )
            },
            conv_flops(d),
            conv_bytes(d, DType::F16),
        );
        // SAFETY: the addresses are the caller's (this function's contract); the workspace
        // holds the plan's size and lives until the stream has run it (the caching
        // allocator reuses a block only in stream order).
        let run = unsafe { plan.execute(h, uids, ptrs, ws.ptr() as *mut c_void) };
        let done = ran(self.plans, self.key, self.what, run).map_err(|status| {
            Error::CudaLibraryStatus {
                lib: "cuDNN",
                op: self.op,
                device: rt.device(),
                status,
                what: format!("{}, {d:?}", self.what),
            }
        })?;
        if let (Some(p), true) = (prof, done) {
            p.end();
        }
        Ok(done)
    }
}
