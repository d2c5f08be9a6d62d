//! A convolution's weight gradient whose input is a batch norm's output, with batch norm's
//! map applied in the convolution's prologue through cuDNN's graph API: `x * scale + bias ->
//! ReLU -> ConvolutionBwdFilter` (the pattern of NVIDIA's ConvBNwgrad engine), so that the
//! output, which a GPU does not keep between the passes (`autograd::saved`), is not made
//! again for it.
//!
//! Under the same switch and on the same problems as the forward's statistics
//! (`conv_stats`: `set_conv_bn_fusion`, f16 channels-last, one group, channels in whole
//! vectors). cuDNN's operands are f16 here, scale and bias included: `bn_scale_bias_f16`
//! rounds them from batch norm's f32 coefficients, so the input the convolution sees differs
//! from the made output by that rounding (relative 2^-11 of `alpha x` and of the bias, which
//! grows with |mean| / std). A channel whose scale or bias would pass f16's range is given
//! divided by a power of two and its gradient multiplied back after the graph
//! (`wgrad_rescale_f16`: one small pass over the weight's gradient), so it stays finite and
//! equal to the unfused path's. Anything else, and any graph cuDNN declines (remembered per
//! shape), makes the output and runs the plain weight gradient.

use super::conv::operands;
use super::conv_desc::Pass;
use super::conv_stats::{conv_bn_fusion, eligible, Fused};
use super::dnn_graph::{
    cached, conv_dims, convolution, op_ready, plan_for, pointwise_desc, tensor, Attr, Built,
    ConvKey, Desc, Kind, Plan, Plans,
};
use super::kernels::KernelFile;
use super::profile::elems;
use super::storage::CudaStorage;
use crate::backend::spec::ConvDims;
use crate::layout::Layout;
use crate::{DType, Error, Result};
use cudarc::cudnn::sys;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use std::ffi::c_void;
use std::sync::OnceLock;

/// Plans with and without the ReLU.
fn plans(relu: bool) -> &'static Plans {
    static PLANS: [OnceLock<Plans>; 2] = [OnceLock::new(), OnceLock::new()];
    PLANS[usize::from(relu)].get_or_init(Default::default)
}

/// The variant pack's ids of x, the scale, the bias, dy and dw; the virtual intermediates
/// (x scaled, biased, clamped) come after.
const UIDS: [i64; 5] = [1, 2, 3, 4, 5];
const VIRTUAL: [i64; 3] = [6, 7, 8];

/// A pointwise operation `mode` of `x` (and `b`, a per-channel operand) into `y`, in f32.
fn pointwise(
    mode: sys::cudnnPointwiseMode_t,
    x: &Desc,
    b: Option<&Desc>,
    y: &Desc,
) -> Result<(Desc, Desc)> {
    let pw = pointwise_desc(mode, sys::cudnnDataType_t::CUDNN_DATA_FLOAT, None)?;
    let op = Desc::new(Kind::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)?;
    op.descs(Attr::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &[&pw])?;
    op.descs(Attr::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, &[x])?;
    if let Some(b) = b {
        op.descs(Attr::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, &[b])?;
    }
    op.descs(Attr::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, &[y])?;
    Ok((pw, op))
}

/// The graph `dw = wgrad(relu?(x * scale + bias), dy)` for `d` (f16 NHWC x and dy, f16
/// `[1, c, 1, 1]` scale and bias, f16 KRSC dw; the intermediates virtual, in f32), built into
/// a plan on `h` (on a deterministic engine when `deterministic`).
fn build(h: sys::cudnnHandle_t, d: &ConvDims, relu: bool, deterministic: bool) -> Result<Built> {
    use sys::cudnnPointwiseMode_t::{
        CUDNN_POINTWISE_ADD, CUDNN_POINTWISE_MUL, CUDNN_POINTWISE_RELU_FWD,
    };
    let half = sys::cudnnDataType_t::CUDNN_DATA_HALF;
    let float = sys::cudnnDataType_t::CUDNN_DATA_FLOAT;
    let [xd, wd, yd] = conv_dims(d);
    let cd = [1, xd[1], 1, 1];
    let x = tensor(half, xd, UIDS[0], false)?;
    let scale = tensor(half, cd, UIDS[1], false)?;
    let bias = tensor(half, cd, UIDS[2], false)?;
    let dy = tensor(half, yd, UIDS[3], false)?;
    let dw = tensor(half, wd, UIDS[4], false)?;
    let scaled = tensor(float, xd, VIRTUAL[0], true)?;
    let biased = tensor(float, xd, VIRTUAL[1], true)?;
    let clamped = relu
        .then(|| tensor(float, xd, VIRTUAL[2], true))
        .transpose()?;
    let (pw_mul, mul) = pointwise(CUDNN_POINTWISE_MUL, &x, Some(&scale), &scaled)?;
    let (pw_add, add) = pointwise(CUDNN_POINTWISE_ADD, &scaled, Some(&bias), &biased)?;
    let clamp = match &clamped {
        Some(c) => Some(pointwise(CUDNN_POINTWISE_RELU_FWD, &biased, None, c)?),
        None => None,
    };
    let conv = match convolution(d)? {
        Ok(conv) => conv,
        Err(why) => return Ok(Built::Declined(why)),
    };
    // The convolution reads the biased value, or its ReLU.
    let input = clamped.as_ref().unwrap_or(&biased);
    let wgrad = Desc::new(Kind::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR)?;
    wgrad.descs(
        Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
        &[input],
    )?;
    wgrad.descs(Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY, &[&dy])?;
    wgrad.descs(Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW, &[&dw])?;
    wgrad.descs(
        Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
        &[&conv],
    )?;
    wgrad.float(Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA, 1.0)?;
    wgrad.float(Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA, 0.0)?;
    let mut descs = vec![x, scale, bias, dy, dw, scaled, biased, pw_mul, pw_add, conv];
    let mut ops = vec![(mul, "the scale"), (add, "the bias")];
    descs.extend(clamped);
    if let Some((pw, op)) = clamp {
        descs.push(pw);
        ops.push((op, "the ReLU"));
    }
    ops.push((wgrad, "the weight's gradient"));
    for (op, what) in &ops {
        if let Err(why) = op_ready(op, what) {
            return Ok(Built::Declined(why));
        }
    }
    let n = ops.len();
    descs.extend(ops.into_iter().map(|(op, _)| op));
    // The operations are the last `n` descriptors.
    Plan::build(h, descs, n, deterministic)
}

/// The f16 scale and bias `[2, c]` of batch norm's map from its coefficients `coef` (`[4, c]`
/// f32, dense at `lc`'s offset), and the f32 factor `[c]` each channel's pair was divided by
/// to stay within f16's range (1 for all but extreme channels): `bn_scale_bias_f16`.
fn scale_bias(
    x: &CudaStorage,
    coef: &CudaStorage,
    lc: &Layout,
    c: usize,
) -> Result<(CudaStorage, CudaStorage)> {
    let op = "conv2d_backward_weight";
    let dense = lc.shape() == [4, c] && lc.is_contiguous();
    if coef.dtype() != DType::F32 || !dense || coef.len() < lc.offset() + 3 * c {
        return Err(Error::invalid(
            op,
            format!(
                "internal: batch norm coefficients must be [4, {c}] dense f32, got {:?} {:?}",
                lc.shape(),
                coef.dtype()
            ),
        ));
    }
    let out = CudaStorage::alloc_on(x.rt(), DType::F16, 2 * c)?;
    let factor = CudaStorage::alloc_on(x.rt(), DType::F32, c)?;
    let (cp, op_, fp) = (coef.ptr_at(lc.offset()), out.ptr(), factor.ptr());
    let ci = c as i64;
    let bytes = elems(3 * c, DType::F32) + elems(2 * c, DType::F16) + elems(c, DType::F32);
    launch!(
        bytes = bytes;
        x, KernelFile::Norm, "bn_scale_bias_f16", grid(c), &cp, &op_, &fp, &ci
    );
    Ok((out, factor))
}

/// A block of 256 threads per 256 items, at most 65,535 blocks (the kernels stride).
fn grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 65_535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// See [`crate::backend::ConvOps::conv2d_backward_weight_affine`]: the weight's gradient of
/// the convolution of `relu?(alpha (x - center) + gamma)` through cuDNN's graph, or `None`
/// when the switch is off, the problem is not one cuDNN fuses (see the module), or cuDNN
/// declined it.
pub(crate) fn conv2d_backward_weight_affine(
    x: &CudaStorage,
    lx: &Layout,
    (coef, lc): (&CudaStorage, &Layout),
    relu: bool,
    (gy, lg): (&CudaStorage, &Layout),
    d: &ConvDims,
) -> Result<Option<CudaStorage>> {
    if !conv_bn_fusion() || !eligible(x.dtype(), d) || gy.dtype() != x.dtype() {
        return Ok(None);
    }
    let key = ConvKey::new(x.rt().device(), d);
    let known = cached(plans(relu), &key);
    if matches!(known, Some(None)) {
        return Ok(None);
    }
    let (a, b) = operands(Pass::Filter, (x, lx), (gy, lg), d)?;
    if a.ptr() % 16 != 0 || b.ptr() % 16 != 0 {
        return Ok(None);
    }
    let rt = x.rt().clone();
    let what = "weight gradient with batch norm's map in its prologue";
    let plan = match known {
        Some(plan) => plan,
        None => rt.with_cudnn(|h| {
            plan_for(plans(relu), &key, what, || {
                build(h, d, relu, key.deterministic())
            })
        })??,
    };
    let Some(plan) = plan else {
        return Ok(None);
    };
    let (sb, factor) = scale_bias(x, coef, lc, d.c)?;
    let dw = CudaStorage::alloc_on(&rt, DType::F16, d.o * d.c * d.kh * d.kw)?;
    let fused = Fused {
        plans: plans(relu),
        key: &key,
        what,
        op: "conv2d_backward_weight",
        label: "wgrad+bn",
    };
    let bias = sb.ptr() + 2 * d.c as u64;
    let ptrs = [a.ptr(), sb.ptr(), bias, b.ptr(), dw.ptr()].map(|p| p as *mut c_void);
    // SAFETY: x and dy are dense f16 NHWC buffers of the graph's dims on this device
    // (`operands` made them so), scale and bias two f16 runs of c values inside `sb` (2 c
    // values; c % 8 == 0 keeps the second 16-byte aligned), dw holds o c kh kw f16 values;
    // the handle's stream is the runtime's, which orders these buffers' uses (the scale and
    // bias kernel ran on it before).
    let done = rt.with_cudnn(|h| unsafe { fused.run(&rt, h, &plan, d, &UIDS, &ptrs) })??;
    if !done {
        return Ok(None);
    }
    // The channels whose scale and bias were divided to fit f16 get their gradient
    // multiplied back.
    let (dp, fp) = (dw.ptr(), factor.ptr());
    let (n, ci) = ((d.o * d.c * d.kh * d.kw) as i64, d.c as i64);
    launch!(
        bytes = elems(d.c, DType::F32);
        x, KernelFile::Norm, "wgrad_rescale_f16", grid(n as usize), &dp, &fp, &n, &ci
    );
    Ok(Some(dw))
}
