//! The cuDNN descriptors of one convolution problem (`conv.rs`): input, filter, output and
//! the convolution itself, in NCHW / KCRS or NHWC / KRSC, destroyed on drop.

use crate::backend::spec::ConvDims;
use crate::{DType, Device, Error, Result};
use cudarc::cudnn::{result as dnn, sys};

/// Which of the three convolution passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Pass {
    Forward,
    Data,
    Filter,
}

impl Pass {
    pub(super) fn op(self) -> &'static str {
        match self {
            Pass::Forward => "conv2d",
            Pass::Data => "conv2d_backward_input",
            Pass::Filter => "conv2d_backward_weight",
        }
    }
}

/// The tensor, filter and convolution descriptors of one problem, destroyed on drop.
pub(super) struct Descriptors {
    pub(super) x: sys::cudnnTensorDescriptor_t,
    pub(super) w: sys::cudnnFilterDescriptor_t,
    pub(super) y: sys::cudnnTensorDescriptor_t,
    pub(super) conv: sys::cudnnConvolutionDescriptor_t,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created by `Descriptors::new` and is destroyed once;
        // a null one (creation failed part-way) is skipped.
        unsafe {
            if !self.x.is_null() {
                let _ = dnn::destroy_tensor_descriptor(self.x);
            }
            if !self.y.is_null() {
                let _ = dnn::destroy_tensor_descriptor(self.y);
            }
            if !self.w.is_null() {
                let _ = dnn::destroy_filter_descriptor(self.w);
            }
            if !self.conv.is_null() {
                let _ = dnn::destroy_convolution_descriptor(self.conv);
            }
        }
    }
}

/// cuDNN's `status` for `what` (a call or descriptor) in one pass, as the library said it.
pub(super) fn dnn_err(
    pass: Pass,
    device: Device,
    what: &str,
    status: impl std::fmt::Debug,
) -> Error {
    Error::CudaLibraryStatus {
        lib: "cuDNN",
        op: pass.op(),
        device,
        status: format!("{status:?}"),
        what: what.to_string(),
    }
}

/// A dim or convolution parameter as cuDNN's `int`.
fn int(pass: Pass, d: &ConvDims, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        Error::too_large(
            pass.op(),
            &[d.n, d.c, d.h, d.w],
            format!("cuDNN takes sizes up to i32::MAX, got {v}"),
        )
    })
}

impl Descriptors {
    pub(super) fn new(
        pass: Pass,
        device: Device,
        dtype: DType,
        tf32: bool,
        d: &ConvDims,
    ) -> Result<Self> {
        let err = |what: &str, e: sys::cudnnStatus_t| dnn_err(pass, device, what, e);
        let data = match dtype {
            DType::F32 => sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
            DType::F16 => sys::cudnnDataType_t::CUDNN_DATA_HALF,
            _ => sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
        };
        let math = match dtype {
            DType::F32 if tf32 => sys::cudnnMathType_t::CUDNN_DEFAULT_MATH,
            DType::F32 => sys::cudnnMathType_t::CUDNN_FMA_MATH,
            _ => sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
        };
        let i = |v: usize| int(pass, d, v);
        let p = &d.p;
        let mut s = Descriptors {
            x: std::ptr::null_mut(),
            w: std::ptr::null_mut(),
            y: std::ptr::null_mut(),
            conv: std::ptr::null_mut(),
        };
        // Dims are given in NCHW / KCRS order either way; the format says how they sit in
        // memory (NHWC / KRSC for channels-last).
        let format = match d.channels_last {
            true => sys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
            false => sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW,
        };
        s.x = dnn::create_tensor_descriptor().map_err(|e| err("tensor descriptor", e.0))?;
        s.y = dnn::create_tensor_descriptor().map_err(|e| err("tensor descriptor", e.0))?;
        s.w = dnn::create_filter_descriptor().map_err(|e| err("filter descriptor", e.0))?;
        s.conv =
            dnn::create_convolution_descriptor().map_err(|e| err("convolution descriptor", e.0))?;
        // SAFETY: the descriptors were created above and are alive.
        unsafe {
            dnn::set_tensor4d_descriptor(s.x, format, data, [i(d.n)?, i(d.c)?, i(d.h)?, i(d.w)?])
                .map_err(|e| err("input descriptor", e.0))?;
            let y = [i(d.n)?, i(d.o)?, i(d.ho)?, i(d.wo)?];
            dnn::set_tensor4d_descriptor(s.y, format, data, y)
                .map_err(|e| err("output descriptor", e.0))?;
            let cg = d.c / p.groups;
            let k = [i(d.o)?, i(cg)?, i(d.kh)?, i(d.kw)?];
            dnn::set_filter4d_descriptor(s.w, data, format, k)
                .map_err(|e| err("filter descriptor", e.0))?;
            dnn::set_convolution2d_descriptor(
                s.conv,
                i(p.padding[0])?,
                i(p.padding[1])?,
                i(p.stride[0])?,
                i(p.stride[1])?,
                i(p.dilation[0])?,
                i(p.dilation[1])?,
                sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
            )
            .map_err(|e| err("convolution descriptor", e.0))?;
            dnn::set_convolution_math_type(s.conv, math).map_err(|e| err("math type", e.0))?;
            dnn::set_convolution_group_count(s.conv, i(p.groups)?)
                .map_err(|e| err("group count", e.0))?;
        }
        Ok(s)
    }
}
