//! Training batch norm through cuDNN's NHWC batch norm (`cudnnBatchNormalizationForward-
//! TrainingEx` / `BackwardEx`, spatial persistent mode), with its fused operations: BN + ReLU
//! and BN + residual add + ReLU, the ReLU's mask kept in cuDNN's reserve space. The running
//! statistics are updated in the forward call; the batch counter takes one small launch.
//!
//! Off by default: [`set_cudnn_batch_norm`] switches it on (the engine's own kernels,
//! `norm.rs`, run otherwise). Where cuDNN does not offer an operation for the operands
//! (`CUDNN_STATUS_NOT_SUPPORTED` from a size query or the call), the caller falls back to the
//! engine's kernels.

use super::norm::whole_f32;
use super::profile::elems;
use super::storage::{float_kname, CudaStorage};
use crate::backend::norm::{FusedBn, FusedBnBack, FusedBnGrads, FusedBnOut};
use crate::layout::Layout;
use crate::{DType, Device, Error, Result};
use cudarc::cudnn::{result as dnn, sys};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};

static ON: AtomicBool = AtomicBool::new(false);

/// Runs training batch norm on channels-last 4-D tensors through cuDNN's NHWC batch norm
/// (PyTorch's choice for channels-last input), its ReLU and residual-add + ReLU fusions
/// included, instead of the engine's own kernels. Off by default; eval mode and other layouts
/// always use the engine's kernels, and so does any case cuDNN declines.
///
/// ```
/// use mantissa::backend::cuda::dnn_norm::{cudnn_batch_norm, set_cudnn_batch_norm};
/// assert!(!cudnn_batch_norm());
/// set_cudnn_batch_norm(true);
/// assert!(cudnn_batch_norm());
/// set_cudnn_batch_norm(false);
/// ```
pub fn set_cudnn_batch_norm(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

/// Whether training batch norm runs through cuDNN (see [`set_cudnn_batch_norm`]).
pub fn cudnn_batch_norm() -> bool {
    ON.load(Ordering::Relaxed)
}

const MODE: sys::cudnnBatchNormMode_t =
    sys::cudnnBatchNormMode_t::CUDNN_BATCHNORM_SPATIAL_PERSISTENT;
const OK: sys::cudnnStatus_t = sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS;
const DECLINED: sys::cudnnStatus_t = sys::cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED;

fn dnn_err(op: &'static str, device: Device, what: &str, status: sys::cudnnStatus_t) -> Error {
    Error::CudaLibraryStatus {
        lib: "cuDNN",
        op,
        device,
        status: format!("{status:?}"),
        what: what.to_string(),
    }
}

/// The operation cuDNN runs: plain, with a ReLU, or with the residual added before it.
fn ops(residual: bool, relu: bool) -> Option<sys::cudnnBatchNormOps_t> {
    use sys::cudnnBatchNormOps_t::*;
    match (residual, relu) {
        (false, false) => Some(CUDNN_BATCHNORM_OPS_BN),
        (false, true) => Some(CUDNN_BATCHNORM_OPS_BN_ACTIVATION),
        (true, true) => Some(CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION),
        // cuDNN has no add without the activation.
        (true, false) => None,
    }
}

/// The operation's name in profiles.
fn label(ops: sys::cudnnBatchNormOps_t) -> &'static str {
    use sys::cudnnBatchNormOps_t::*;
    match ops {
        CUDNN_BATCHNORM_OPS_BN => "batch_norm",
        CUDNN_BATCHNORM_OPS_BN_ACTIVATION => "batch_norm_relu",
        _ => "batch_norm_add_relu",
    }
}

/// The descriptors of one call: x's (NHWC; y, z, dy, dx and dz share it), the derived
/// per-channel one, and a ReLU's (null without one); destroyed on drop.
struct Descriptors {
    x: sys::cudnnTensorDescriptor_t,
    bn: sys::cudnnTensorDescriptor_t,
    act: sys::cudnnActivationDescriptor_t,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created by `Descriptors::new` and is destroyed once; a
        // null one (not made, or creation failed part-way) is skipped.
        unsafe {
            for t in [self.x, self.bn] {
                if !t.is_null() {
                    let _ = dnn::destroy_tensor_descriptor(t);
                }
            }
            if !self.act.is_null() {
                let _ = sys::cudnnDestroyActivationDescriptor(self.act);
            }
        }
    }
}

impl Descriptors {
    /// The descriptors for x of `shape` (`[n, c, h, w]`) in `dtype`; `None` when a size does
    /// not fit cuDNN's `int` or the tensor passes its element limit (the engine's kernels,
    /// which index in 64 bits, run instead).
    fn new(
        op: &'static str,
        device: Device,
        dtype: DType,
        shape: &[usize],
        relu: bool,
    ) -> Result<Option<Self>> {
        let err = |what: &str, e: sys::cudnnStatus_t| dnn_err(op, device, what, e);
        let dims: Vec<i32> = match shape.iter().map(|&d| i32::try_from(d)).collect() {
            Ok(d) => d,
            Err(_) => return Ok(None),
        };
        let elems = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if elems.is_none_or(|n| n > super::limits::library_index_limit()) {
            return Ok(None);
        }
        let data = match dtype {
            DType::F32 => sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
            DType::F16 => sys::cudnnDataType_t::CUDNN_DATA_HALF,
            _ => sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
        };
        let mut s = Descriptors {
            x: std::ptr::null_mut(),
            bn: std::ptr::null_mut(),
            act: std::ptr::null_mut(),
        };
        s.x = dnn::create_tensor_descriptor().map_err(|e| err("tensor descriptor", e.0))?;
        s.bn = dnn::create_tensor_descriptor().map_err(|e| err("tensor descriptor", e.0))?;
        let nhwc = sys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC;
        // SAFETY: the descriptors were created above and are alive.
        unsafe {
            dnn::set_tensor4d_descriptor(s.x, nhwc, data, [dims[0], dims[1], dims[2], dims[3]])
                .map_err(|e| err("input descriptor", e.0))?;
            let status = sys::cudnnDeriveBNTensorDescriptor(s.bn, s.x, MODE);
            if status != OK {
                return Err(err("per-channel descriptor", status));
            }
        }
        if relu {
            s.act = dnn::create_activation_descriptor().map_err(|e| err("activation", e.0))?;
            // SAFETY: the descriptor was created above and is alive.
            unsafe {
                dnn::set_activation_descriptor(
                    s.act,
                    sys::cudnnActivationMode_t::CUDNN_ACTIVATION_RELU,
                    sys::cudnnNanPropagation_t::CUDNN_PROPAGATE_NAN,
                    0.0,
                )
            }
            .map_err(|e| err("activation", e.0))?;
        }
        Ok(Some(s))
    }
}

impl Descriptors {
    /// cuDNN's workspace size for the forward or the `backward` call of `ops` on these
    /// descriptors (x's for every tensor), with the query's status.
    fn workspace_size(
        &self,
        h: sys::cudnnHandle_t,
        ops: sys::cudnnBatchNormOps_t,
        backward: bool,
    ) -> (sys::cudnnStatus_t, usize) {
        let (x, mut bytes) = (self.x, 0usize);
        // SAFETY: the handle (the caller's, from `with_cudnn`) and the descriptors are
        // alive; the out-pointer is a local.
        let status = unsafe {
            match backward {
                false => sys::cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(
                    h, MODE, ops, x, x, x, self.bn, self.act, &mut bytes,
                ),
                true => sys::cudnnGetBatchNormalizationBackwardExWorkspaceSize(
                    h, MODE, ops, x, x, x, x, x, self.bn, self.act, &mut bytes,
                ),
            }
        };
        (status, bytes)
    }

    /// cuDNN's reserve-space size for `ops` on these descriptors, with the query's status.
    fn reserve_size(
        &self,
        h: sys::cudnnHandle_t,
        ops: sys::cudnnBatchNormOps_t,
    ) -> (sys::cudnnStatus_t, usize) {
        let mut bytes = 0usize;
        // SAFETY: the handle (the caller's, from `with_cudnn`) and the descriptors are
        // alive; the out-pointer is a local.
        let status = unsafe {
            sys::cudnnGetBatchNormalizationTrainingExReserveSpaceSize(
                h, MODE, ops, self.act, self.x, &mut bytes,
            )
        };
        (status, bytes)
    }
}

/// The address of a whole f32 storage of `n` values, as cuDNN takes it.
fn channel_vector(op: &'static str, what: &str, v: &CudaStorage, n: usize) -> Result<*mut c_void> {
    Ok(whole_f32(op, what, v, n)? as *mut c_void)
}

/// Where the saved inverse deviations start after the means, in f32: a multiple of 8 (32
/// bytes), so both vectors are as aligned as a fresh allocation's start.
fn saved_stride(c: usize) -> usize {
    c.next_multiple_of(8)
}

/// x's shape `[n, c, h, w]` when it is a dense channels-last 4-D layout.
fn nhwc_shape(l: &Layout) -> Option<[usize; 4]> {
    let s = l.shape();
    (s.len() == 4 && l.is_channels_last()).then(|| [s[0], s[1], s[2], s[3]])
}

/// Whether two layouts put the same element at the same place past their offsets: the same
/// shape, and the same strides wherever a dim has more than one element (a size-1 dim's
/// stride is never used, and two dense channels-last tensors may disagree on it).
fn same_order(a: &Layout, b: &Layout) -> bool {
    a.shape() == b.shape()
        && a.shape()
            .iter()
            .zip(a.strides().iter().zip(b.strides()))
            .all(|(&d, (sa, sb))| d <= 1 || sa == sb)
}

/// A size query's answer: the bytes, `None` where cuDNN declines, an error otherwise.
fn size(
    op: &'static str,
    device: Device,
    what: &str,
    status: sys::cudnnStatus_t,
    bytes: usize,
) -> Result<Option<usize>> {
    match status {
        OK => Ok(Some(bytes)),
        DECLINED => Ok(None),
        s => Err(dnn_err(op, device, what, s)),
    }
}

/// See [`crate::backend::NormOps::batch_norm_fused`]; `None` when switched off, when x is
/// not a dense channels-last 4-D tensor, and when cuDNN declines.
pub(crate) fn batch_norm_fused(
    x: &CudaStorage,
    lx: &Layout,
    p: FusedBn<'_, CudaStorage>,
) -> Result<Option<FusedBnOut<CudaStorage>>> {
    let op = "batch_norm";
    float_kname(op, x.dtype())?;
    let (Some(ops), Some(shape), true) = (
        ops(p.residual.is_some(), p.relu),
        nhwc_shape(lx),
        cudnn_batch_norm(),
    ) else {
        return Ok(None);
    };
    if let Some((r, lr)) = p.residual {
        if r.dtype() != x.dtype() || !same_order(lr, lx) {
            return Ok(None);
        }
    }
    let (device, rt, c) = (x.device(), x.rt().clone(), shape[1]);
    super::libs::load(super::libs::Lib::Cudnn)?;
    let Some(d) = Descriptors::new(op, device, x.dtype(), &shape, p.relu)? else {
        return Ok(None);
    };
    let (scale, bias) = (
        channel_vector(op, "weight", p.weight, c)?,
        channel_vector(op, "bias", p.bias, c)?,
    );
    let (rmean, rvar) = match &p.running {
        Some((m, v)) => (
            channel_vector(op, "running_mean", m, c)?,
            channel_vector(op, "running_var", v, c)?,
        ),
        None => (std::ptr::null_mut(), std::ptr::null_mut()),
    };
    let n = lx.numel();
    let out = rt.with_cudnn(|h| -> Result<Option<FusedBnOut<CudaStorage>>> {
        let (s1, ws_bytes) = d.workspace_size(h, ops, false);
        let (s2, reserve_bytes) = d.reserve_size(h, ops);
        let (Some(ws_bytes), Some(reserve_bytes)) = (
            size(op, device, "workspace size", s1, ws_bytes)?,
            size(op, device, "reserve size", s2, reserve_bytes)?,
        ) else {
            return Ok(None);
        };
        let y = CudaStorage::alloc_on(&rt, x.dtype(), n)?;
        let saved = CudaStorage::alloc_on(&rt, DType::F32, 2 * saved_stride(c))?;
        let ws = CudaStorage::alloc_on(&rt, DType::U8, ws_bytes)?;
        let reserve = CudaStorage::alloc_on(&rt, DType::U8, reserve_bytes)?;
        let (one, zero) = (1.0f32, 0.0f32);
        let z = p.residual.map_or(std::ptr::null(), |(r, lr)| {
            r.ptr_at(lr.offset()) as *const c_void
        });
        let prof = super::profile::library(
            &rt,
            || {
                format!(
                    "cudnn {} {shape:?} {}",
                    label(ops),
                    super::profile::short(x.dtype())
                )
            },
            0,
            bytes(x.dtype(), n, 2 + usize::from(p.residual.is_some())),
        );
        // SAFETY: x, z and y address dense NHWC buffers of `n` elements in x's dtype on this
        // device (x and z: `nhwc_shape` and the residual's layout checked above; y: allocated
        // here); the per-channel vectors hold `c` f32 each (`channel_vector`); `saved` holds
        // the mean and the inverse deviation, `c` each, `saved_stride(c)` apart; the
        // workspace and the reserve space have the sizes cuDNN asked for; the handle's stream
        // is the runtime's, which orders these buffers' uses.
        let status = unsafe {
            let sp = saved.ptr() as *mut c_void;
            sys::cudnnBatchNormalizationForwardTrainingEx(
                h,
                MODE,
                ops,
                &one as *const f32 as *const c_void,
                &zero as *const f32 as *const c_void,
                d.x,
                x.ptr_at(lx.offset()) as *const c_void,
                d.x,
                z,
                d.x,
                y.ptr() as *mut c_void,
                d.bn,
                scale,
                bias,
                p.momentum,
                rmean,
                rvar,
                p.eps,
                sp,
                sp.cast::<f32>().add(saved_stride(c)).cast(),
                d.act,
                ws.ptr() as *mut c_void,
                ws_bytes,
                reserve.ptr() as *mut c_void,
                reserve_bytes,
            )
        };
        match status {
            OK => {}
            DECLINED => return Ok(None),
            s => return Err(dnn_err(op, device, "forward", s)),
        }
        if let Some(p) = prof {
            p.end();
        }
        Ok(Some(FusedBnOut { y, saved, reserve }))
    })??;
    if let (Some(_), Some(t)) = (&out, p.tracked) {
        super::norm::count_batch(x, t)?;
    }
    Ok(out)
}

/// Bytes a batch norm call moves for `tensors` full passes over `n` elements (cuDNN's
/// persistent kernels read x once, where the data fits on chip).
fn bytes(dtype: DType, n: usize, tensors: usize) -> u64 {
    elems(n, dtype).saturating_mul(tensors as u64)
}

/// See [`crate::backend::NormOps::batch_norm_fused_backward`].
pub(crate) fn batch_norm_fused_backward(
    dy: &CudaStorage,
    ld: &Layout,
    b: FusedBnBack<'_, CudaStorage>,
) -> Result<FusedBnGrads<CudaStorage>> {
    let op = "batch_norm backward";
    let (x, lx) = b.x;
    let internal = |what: &str| Error::invalid(op, format!("internal: {what}"));
    let ops = ops(b.residual, b.relu).ok_or_else(|| internal("an add without a ReLU"))?;
    let shape = nhwc_shape(lx).ok_or_else(|| internal("x is not dense channels-last"))?;
    if dy.dtype() != x.dtype()
        || !same_order(ld, lx)
        || b.y
            .is_some_and(|(y, l)| y.dtype() != x.dtype() || !same_order(l, lx))
    {
        return Err(internal("dy or y differs from x in dtype or layout"));
    }
    if b.relu != b.y.is_some() {
        return Err(internal(
            "a fused ReLU's backward reads the forward's output",
        ));
    }
    let (device, rt, c, n) = (x.device(), x.rt().clone(), shape[1], lx.numel());
    let d = Descriptors::new(op, device, x.dtype(), &shape, b.relu)?
        .ok_or_else(|| internal("sizes past cuDNN's int"))?;
    let (scale, bias) = (
        channel_vector(op, "weight", b.weight, c)?,
        channel_vector(op, "bias", b.bias, c)?,
    );
    let saved = channel_vector(op, "saved statistics", b.saved, 2 * saved_stride(c))?;
    if b.reserve.dtype() != DType::U8 {
        return Err(internal("the reserve space is not bytes"));
    }
    let dx = CudaStorage::alloc_on(&rt, x.dtype(), n)?;
    let dz = match b.residual {
        true => Some(CudaStorage::alloc_on(&rt, x.dtype(), n)?),
        false => None,
    };
    let dweight = CudaStorage::alloc_on(&rt, DType::F32, c)?;
    let dbias = CudaStorage::alloc_on(&rt, DType::F32, c)?;
    rt.with_cudnn(|h| -> Result<()> {
        let (status, reserve_bytes) = d.reserve_size(h, ops);
        if status != OK {
            return Err(dnn_err(op, device, "reserve size", status));
        }
        if b.reserve.len() < reserve_bytes {
            let (have, want) = (b.reserve.len(), reserve_bytes);
            return Err(internal(&format!(
                "a reserve space of {have} bytes, cuDNN wants {want}"
            )));
        }
        let (status, ws_bytes) = d.workspace_size(h, ops, true);
        if status != OK {
            return Err(dnn_err(op, device, "workspace size", status));
        }
        let ws = CudaStorage::alloc_on(&rt, DType::U8, ws_bytes)?;
        let (one, zero) = (1.0f32, 0.0f32);
        let (one, zero) = (
            &one as *const f32 as *const c_void,
            &zero as *const f32 as *const c_void,
        );
        let y = b.y.map_or(std::ptr::null(), |(y, l)| {
            y.ptr_at(l.offset()) as *const c_void
        });
        let dzp = dz
            .as_ref()
            .map_or(std::ptr::null_mut(), |z| z.ptr() as *mut c_void);
        let tensors = 3 + usize::from(b.relu) + usize::from(b.residual);
        let prof = super::profile::library(
            &rt,
            || {
                format!(
                    "cudnn {} backward {shape:?} {}",
                    label(ops),
                    super::profile::short(x.dtype())
                )
            },
            0,
            bytes(x.dtype(), n, tensors),
        );
        // SAFETY: x, y, dy address dense NHWC buffers of `n` elements in x's dtype on this
        // device (layouts checked above); dx and dz were allocated here with `n`; the
        // per-channel vectors hold `c` f32 (`saved`: the mean, then the inverse deviation
        // `saved_stride(c)` further, checked by `channel_vector`); the reserve space holds
        // at least what cuDNN asks for this call (checked above); the workspace has the size
        // cuDNN asked for; the handle's stream is the runtime's.
        let status = unsafe {
            sys::cudnnBatchNormalizationBackwardEx(
                h,
                MODE,
                ops,
                one,
                zero,
                one,
                zero,
                d.x,
                x.ptr_at(lx.offset()) as *const c_void,
                d.x,
                y,
                d.x,
                dy.ptr_at(ld.offset()) as *const c_void,
                d.x,
                dzp,
                d.x,
                dx.ptr() as *mut c_void,
                d.bn,
                scale,
                bias,
                dweight.ptr() as *mut c_void,
                dbias.ptr() as *mut c_void,
                b.eps,
                saved,
                saved.cast::<f32>().add(saved_stride(c)).cast(),
                d.act,
                ws.ptr() as *mut c_void,
                ws_bytes,
                b.reserve.ptr() as *mut c_void,
                b.reserve.len(),
            )
        };
        if status != OK {
            return Err(dnn_err(op, device, "backward", status));
        }
        if let Some(p) = prof {
            p.end();
        }
        Ok(())
    })??;
    Ok(FusedBnGrads {
        dx,
        dweight,
        dbias,
        dz,
    })
}
