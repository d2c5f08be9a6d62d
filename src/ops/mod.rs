//! Op definitions: forward (through [`crate::backend::Storage`]), backward (recorded with
//! `attach`), and each op's cast policy. Every op enters through `dispatch`, the one place
//! where inputs are checked for device agreement, cast by an active autocast region according
//! to [`Op::cast_policy`], and brought to a common dtype.

mod attention;
mod attention_packed;
mod conv;
mod dropout;
mod elementwise;
mod index;
mod loss;
mod matmul;
mod matmul_fused;
pub(crate) mod norm;
pub(crate) mod norm_call;
mod norm_fused;
mod norm_group;
mod norm_layer;
mod norm_residual;
mod operators;
mod pool;
mod reduce;
mod reduce_more;
mod rnn;
mod sample;
mod softmax;
mod sort;
mod triangle;

pub(crate) use attention::attention_weights;
pub use attention::{
    attention_kernel, cudnn_attention, set_attention_kernel, set_cudnn_attention, AttentionKernel,
    AttentionOptions,
};
pub use conv::{Conv1dOptions, Conv2dOptions, ConvTranspose2dOptions};
pub use elementwise::Operand;
pub use loss::{CrossEntropyOptions, Reduction};
pub use matmul_fused::{gemm_epilogues, set_gemm_epilogues};
pub use pool::{AvgPool2dOptions, MaxPool2dOptions};

use crate::{DType, Error, Result, Tensor};

/// How an op treats the dtypes of its floating inputs (PyTorch's autocast categories).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CastPolicy {
    /// Runs in the low-precision dtype under autocast (GEMM-like ops).
    LowerPrecision,
    /// Runs in f32 under autocast (numerically sensitive ops).
    Fp32,
    /// Runs in the widest floating input dtype.
    Promote,
    /// Runs in its input's dtype.
    Passthrough,
}

/// Every op that goes through `dispatch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Op {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Maximum,
    Minimum,
    Compare,
    Where,
    Exp,
    Log,
    Log1p,
    Sqrt,
    Rsqrt,
    Recip,
    PowScalar,
    Softplus,
    Unary,
    Sum,
    Mean,
    MaxMin,
    Var,
    Matmul,
    Linear,
    Conv2d,
    ConvTranspose2d,
    Cat,
    IndexSelect,
    Gather,
    ScatterAdd,
    Embedding,
    Softmax,
    LogSoftmax,
    CrossEntropy,
    NllLoss,
    MseLoss,
    BceWithLogits,
    MaxPool2d,
    AvgPool2d,
    AdaptiveAvgPool2d,
    BatchNorm,
    LayerNorm,
    Dropout,
    LstmCell,
    LstmLayer,
    Attention,
}

impl Op {
    /// The op's autocast category: the policy table, in one place.
    pub fn cast_policy(self) -> CastPolicy {
        use Op::*;
        match self {
            Matmul | Linear | Conv2d | ConvTranspose2d | LstmCell | LstmLayer | Attention => {
                CastPolicy::LowerPrecision
            }
            Exp | Log | Log1p | Rsqrt | Recip | Pow | PowScalar | Softplus | Sum | Softmax
            | LogSoftmax | CrossEntropy | NllLoss | MseLoss | BceWithLogits | LayerNorm | Var => {
                CastPolicy::Fp32
            }
            Add | Sub | Mul | Div | Maximum | Minimum | Compare | Where | Cat | ScatterAdd => {
                CastPolicy::Promote
            }
            Sqrt | Unary | Mean | MaxMin | IndexSelect | Gather | Embedding | MaxPool2d
            | AvgPool2d | AdaptiveAvgPool2d | BatchNorm | Dropout => CastPolicy::Passthrough,
        }
    }

    /// True for ops whose integer inputs are indices or masks, never values to promote.
    pub fn has_index_inputs(self) -> bool {
        use Op::*;
        matches!(
            self,
            Where | ScatterAdd | Gather | IndexSelect | Embedding | CrossEntropy | NllLoss
        )
    }

    /// The name used in error messages and graph nodes.
    pub fn name(self) -> &'static str {
        use Op::*;
        match self {
            Add => "add",
            Sub => "sub",
            Mul => "mul",
            Div => "div",
            Pow => "pow",
            Maximum => "maximum",
            Minimum => "minimum",
            Compare => "compare",
            Where => "where",
            Exp => "exp",
            Log => "log",
            Log1p => "log1p",
            Sqrt => "sqrt",
            Rsqrt => "rsqrt",
            Recip => "reciprocal",
            PowScalar => "pow_scalar",
            Softplus => "softplus",
            Unary => "unary",
            Sum => "sum",
            Mean => "mean",
            MaxMin => "max/min",
            Var => "var",
            Matmul => "matmul",
            Linear => "linear",
            Conv2d => "conv2d",
            ConvTranspose2d => "conv_transpose2d",
            Cat => "cat",
            IndexSelect => "index_select",
            Gather => "gather",
            ScatterAdd => "scatter_add",
            Embedding => "embedding",
            Softmax => "softmax",
            LogSoftmax => "log_softmax",
            CrossEntropy => "cross_entropy",
            NllLoss => "nll_loss",
            MseLoss => "mse_loss",
            BceWithLogits => "binary_cross_entropy_with_logits",
            MaxPool2d => "max_pool2d",
            AvgPool2d => "avg_pool2d",
            AdaptiveAvgPool2d => "adaptive_avg_pool2d",
            BatchNorm => "batch_norm",
            LayerNorm => "layer_norm",
            Dropout => "dropout",
            LstmCell => "lstm_cell",
            LstmLayer => "lstm_layer",
            Attention => "scaled_dot_product_attention",
        }
    }
}

/// The entry of every op: checks that the inputs share a device; inside an autocast region,
/// casts the floating non-f64 inputs of lower-precision and f32 ops (weights through the
/// region's cache); and gives the inputs of `Promote` ops a common dtype. Integer and mask
/// inputs (indices, conditions) pass as they are.
/// A host view that selects far more elements than its storage holds (an expanded one)
/// gives outputs of its full size, which the CPU kernels allocate without a `Result`: from
/// 256 MiB up (at 4 bytes an element or more, the widest an op's output takes), the host
/// must be able to hold one, or the op is [`Error::OutOfMemory`]. Views no larger than their
/// storage pass without a look (their outputs are no bigger than memory already held).
/// The check is conservative: an op that would read such a view without making it (a sum)
/// is refused too when the host could not hold the view.
fn host_holds_view(op: &'static str, t: &Tensor) -> Result<()> {
    let out = match t.dtype().size_in_bytes() {
        1 | 2 => DType::F32,
        _ => t.dtype(),
    };
    if t.device() != crate::Device::Cpu || t.numel().saturating_mul(8) < 256 << 20 {
        return Ok(());
    }
    if t.numel() <= t.storage().len() {
        return Ok(());
    }
    match t.numel().checked_mul(out.size_in_bytes()) {
        Some(bytes) if bytes <= isize::MAX as usize => {
            crate::backend::cpu::host_can_hold_bytes(bytes)
        }
        _ => Err(Error::OutOfMemory {
            device: crate::Device::Cpu,
            requested: usize::MAX,
            stats: format!(
                "{op}: a view of shape {:?} is past what the host can address",
                t.shape()
            ),
        }),
    }
}

pub(crate) fn dispatch<const N: usize>(op: Op, inputs: [&Tensor; N]) -> Result<[Tensor; N]> {
    if let Some(first) = inputs.first() {
        for t in &inputs[1..] {
            if t.device() != first.device() {
                return Err(Error::DeviceMismatch {
                    op: op.name(),
                    lhs: first.device(),
                    rhs: t.device(),
                });
            }
        }
    }
    for t in &inputs {
        host_holds_view(op.name(), t)?;
    }
    // A checkpoint's forward keeps the tensors from outside that its function reads.
    crate::autograd::note_reads(inputs.iter().copied());
    let mut out = inputs.map(|t| t.clone());
    if let Some(low) = crate::amp::active_dtype() {
        // Autocast: only floating, non-f64 inputs change dtype.
        let target = match op.cast_policy() {
            CastPolicy::LowerPrecision => Some(low),
            CastPolicy::Fp32 => Some(DType::F32),
            CastPolicy::Promote | CastPolicy::Passthrough => None,
        };
        if let Some(target) = target {
            for t in out.iter_mut() {
                if t.dtype().is_float() && t.dtype() != DType::F64 && t.dtype() != target {
                    *t = crate::amp::cache::cast(t, target)?;
                }
            }
        }
    }
    // pow promotes too (its autocast policy is f32, which outside autocast leaves the
    // operands as they are).
    if op.cast_policy() != CastPolicy::Promote && op != Op::Pow {
        return Ok(out);
    }
    // Ops with index or mask inputs promote only their floating inputs; the others promote
    // every input (an i64 added to an f16 becomes f16, as in PyTorch).
    let values = |d: &DType| d.is_float() || !op.has_index_inputs();
    let promote = |rank0: bool| {
        out.iter()
            .filter(|t| (t.rank() == 0) == rank0)
            .map(|t| t.dtype())
            .filter(values)
            .reduce(DType::promote)
    };
    // PyTorch's rule for 0-d tensors: they take part only when they are of a higher category
    // (float over integer) than every tensor with dims, so an f16 tensor times an f32 0-d
    // tensor stays f16, and an i64 tensor plus an f64 0-d tensor becomes f64.
    let target = match (promote(false), promote(true)) {
        (Some(d), Some(z)) if !d.is_float() && z.is_float() => Some(d.promote(z)),
        (Some(d), _) => Some(d),
        (None, z) => z,
    };
    if let Some(target) = target {
        for t in out.iter_mut() {
            if values(&t.dtype()) && t.dtype() != target {
                *t = t.to_dtype(target)?;
            }
        }
    }
    Ok(out)
}

/// [`dispatch`] for an optional input (a bias).
pub(crate) fn dispatch_opt(op: Op, t: Option<&Tensor>) -> Result<Option<Tensor>> {
    t.map(|t| dispatch(op, [t]).map(|[t]| t)).transpose()
}

/// Errors unless `t` has a float dtype.
pub(crate) fn expect_float(op: Op, t: &Tensor) -> Result<()> {
    if t.dtype().is_float() {
        Ok(())
    } else {
        Err(Error::DType {
            op: op.name(),
            dtype: t.dtype(),
            expected: "a float dtype",
        })
    }
}

/// Errors unless `a` and `b` share a dtype.
pub(crate) fn expect_same_dtype(op: Op, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.dtype() == b.dtype() {
        Ok(())
    } else {
        Err(Error::DTypeMismatch {
            op: op.name(),
            lhs: a.dtype(),
            rhs: b.dtype(),
        })
    }
}

/// Runs the image op `f` on `x`: a batch `[n, c, h, w]` as it is, one unbatched image
/// `[c, h, w]` as a batch of one whose result loses the batch dim again (as PyTorch's conv
/// and pooling functions take either).
pub(crate) fn per_image(
    op: Op,
    x: &Tensor,
    f: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    match x.rank() {
        4 => f(x),
        3 => f(&x.unsqueeze(0)?)?.squeeze(0),
        _ => Err(Error::invalid(
            op.name(),
            format!(
                "the input must be [n, c, h, w] or one image [c, h, w], got shape {:?}",
                x.shape()
            ),
        )),
    }
}

/// Errors unless `t` has rank `rank`.
pub(crate) fn expect_rank(op: Op, t: &Tensor, rank: usize, what: &str) -> Result<()> {
    if t.rank() == rank {
        Ok(())
    } else {
        Err(Error::invalid(
            op.name(),
            format!("{what} must have rank {rank}, got shape {:?}", t.shape()),
        ))
    }
}

/// Errors if `t` has no elements.
pub(crate) fn expect_nonempty(op: Op, t: &Tensor) -> Result<()> {
    if t.numel() == 0 {
        Err(Error::Empty {
            op: op.name(),
            shape: t.shape().to_vec(),
        })
    } else {
        Ok(())
    }
}

/// `Err` when reducing `dims` of `t` would reduce over no elements (an empty result, where
/// another dim is 0, is fine).
pub(crate) fn expect_nonempty_reduction(op: Op, t: &Tensor, dims: &[usize]) -> Result<()> {
    if dims.iter().any(|&d| t.shape()[d] == 0) {
        return Err(Error::Empty {
            op: op.name(),
            shape: t.shape().to_vec(),
        });
    }
    Ok(())
}
