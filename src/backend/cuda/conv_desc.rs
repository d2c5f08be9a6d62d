//! The cuDNN descriptors of one convolution problem (`conv.rs`): input, filter, output and
//! the convolution itself, in NCHW / KCRS or NHWC / KRSC, destroyed on drop; and the
//! algorithms cuDNN lists for them ([`list`]), with their workspace, determinism and math
//! type.

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

/// A cuDNN algorithm of one pass (its name in the profiler's label of the call).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Algo {
    Forward(sys::cudnnConvolutionFwdAlgo_t),
    Data(sys::cudnnConvolutionBwdDataAlgo_t),
    Filter(sys::cudnnConvolutionBwdFilterAlgo_t),
}

/// One algorithm cuDNN offers for a problem.
#[derive(Debug, Clone, Copy)]
pub(super) struct Candidate {
    pub(super) algo: Algo,
    pub(super) workspace: usize,
    pub(super) deterministic: bool,
    /// The math type cuDNN chose the algorithm with; set on the descriptor before it runs
    /// (cuDNN picks tensor-core kernels from the algorithm and this together).
    pub(super) math: sys::cudnnMathType_t,
}

/// Up to this many candidates are asked for (cuDNN has at most 8 per pass).
const MAX_ALGOS: usize = 10;

/// Runs a cuDNN `Get*_v7` (heuristic) or `Find*` (timed) query `$f($args.., n, count, perf)`
/// and lists the candidates that can run, best first.
macro_rules! candidates {
    ($perf:ty, $variant:path, $f:path, $($arg:expr),+) => {{
        // SAFETY: the perf structs are plain C data (all-zero is a valid value of each field);
        // the handle and descriptors in the arguments are alive and the buffer holds
        // MAX_ALGOS entries.
        let mut perf: Vec<$perf> = vec![unsafe { std::mem::zeroed() }; MAX_ALGOS];
        let mut count = 0i32;
        let status = unsafe { $f($($arg),+, MAX_ALGOS as i32, &mut count, perf.as_mut_ptr()) };
        let list = perf[..count.max(0) as usize]
            .iter()
            .filter(|p| p.status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS)
            .map(|p| Candidate {
                algo: $variant(p.algo),
                workspace: p.memory,
                deterministic: p.determinism == sys::cudnnDeterminism_t::CUDNN_DETERMINISTIC,
                math: p.mathType,
            })
            .collect::<Vec<Candidate>>();
        (status, list)
    }};
}

/// The candidates cuDNN lists for `pass` of the problem `s` on handle `h`, best first: by its
/// heuristics, or timed (`cudnnFind*`: every algorithm run once) when `timed`; with the
/// query's status.
pub(super) fn list(
    h: sys::cudnnHandle_t,
    pass: Pass,
    s: &Descriptors,
    timed: bool,
) -> (sys::cudnnStatus_t, Vec<Candidate>) {
    use sys::{
        cudnnConvolutionBwdDataAlgoPerf_t as DataPerf,
        cudnnConvolutionBwdFilterAlgoPerf_t as FilterPerf,
        cudnnConvolutionFwdAlgoPerf_t as FwdPerf,
    };
    let (x, w, y, c) = (s.x, s.w, s.y, s.conv);
    match (pass, timed) {
        (Pass::Forward, false) => candidates!(
            FwdPerf,
            Algo::Forward,
            sys::cudnnGetConvolutionForwardAlgorithm_v7,
            h,
            x,
            w,
            c,
            y
        ),
        (Pass::Forward, true) => candidates!(
            FwdPerf,
            Algo::Forward,
            sys::cudnnFindConvolutionForwardAlgorithm,
            h,
            x,
            w,
            c,
            y
        ),
        (Pass::Data, false) => candidates!(
            DataPerf,
            Algo::Data,
            sys::cudnnGetConvolutionBackwardDataAlgorithm_v7,
            h,
            w,
            y,
            c,
            x
        ),
        (Pass::Data, true) => candidates!(
            DataPerf,
            Algo::Data,
            sys::cudnnFindConvolutionBackwardDataAlgorithm,
            h,
            w,
            y,
            c,
            x
        ),
        (Pass::Filter, false) => candidates!(
            FilterPerf,
            Algo::Filter,
            sys::cudnnGetConvolutionBackwardFilterAlgorithm_v7,
            h,
            x,
            y,
            c,
            w
        ),
        (Pass::Filter, true) => candidates!(
            FilterPerf,
            Algo::Filter,
            sys::cudnnFindConvolutionBackwardFilterAlgorithm,
            h,
            x,
            y,
            c,
            w
        ),
    }
}
