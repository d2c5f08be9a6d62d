//! A transformer MLP's products with their elementwise work in cuBLASLt's epilogue
//! (`blaslt.rs`): the first product adds the bias, applies GELU (tanh form) and keeps the
//! pre-activation for backward (`GELU_AUX_BIAS`); the input gradient of the second product
//! multiplies by GELU's derivative there and sums the first layer's bias gradient
//! (`DGELU_BGRAD`); a weight gradient's product also sums the bias gradient (`BGRADB`). Each
//! returns `None` where cuBLASLt offers no algorithm or the shape does not meet its rules
//! (the aux matrix's rows a multiple of 8 elements), and the caller composes the ops.

use super::blaslt::{gemm_lt, Epi, LtPtrs};
use super::matmul::readable;
use super::storage::{float_kname, same_dtype, CudaStorage};
use crate::backend::Fused;
use crate::layout::Layout;
use crate::Result;

/// cuBLASLt's rule for the aux matrix's leading dimension (`CUBLASLT_MATMUL_DESC_EPILOGUE_
/// AUX_LD`): a multiple of 8 elements.
const AUX_LD_MULTIPLE: usize = 8;

/// `a [m, k] @ b [k, n]` with `f`'s work in cuBLASLt's epilogue: the product (after the
/// epilogue) and `f`'s second result (see [`Fused`]); `None` when cuBLASLt declines it.
pub(crate) fn matmul_fused(
    a: &CudaStorage,
    la: &Layout,
    b: &CudaStorage,
    lb: &Layout,
    f: Fused<'_, CudaStorage>,
) -> Result<Option<(CudaStorage, CudaStorage)>> {
    let op = "matmul (fused)";
    same_dtype(op, a, b)?;
    float_kname(op, a.dtype())?;
    if la.rank() != 2 || lb.rank() != 2 || la.shape()[1] != lb.shape()[0] {
        return Ok(None);
    }
    let (m, k, n) = (la.shape()[0], la.shape()[1], lb.shape()[1]);
    if [m, n, k].contains(&0) {
        return Ok(None);
    }
    let aux_ok = n % AUX_LD_MULTIPLE == 0;
    let (rt, dtype) = (a.rt(), a.dtype());
    // The operand the epilogue reads beside the operands (a contiguous copy where the
    // caller's view is not one whole block, kept alive until the product is queued), the
    // second result it writes, and the addresses it takes.
    let alloc = |len: usize| CudaStorage::alloc_on(rt, dtype, len);
    let (read, extra, epi) = match f {
        Fused::GeluAuxBias((bias, lb)) if aux_ok && lb.shape() == [n] => {
            same_dtype(op, a, bias)?;
            let epi = Epi::GeluAuxBias { aux_ld: n as i64 };
            (Some(bias.contiguous(lb)?), alloc(m * n)?, epi)
        }
        Fused::DGeluBGrad((pre, lp)) if aux_ok && lp.shape() == [m, n] => {
            same_dtype(op, a, pre)?;
            let epi = Epi::DGeluBGrad { aux_ld: n as i64 };
            (Some(pre.contiguous(lp)?), alloc(n)?, epi)
        }
        Fused::SumLhs => (None, alloc(m)?, Epi::BGradB),
        _ => return Ok(None),
    };
    let out = alloc(m * n)?;
    let read_ptr = read.as_ref().map_or(0, |r| r.ptr());
    let ptrs = match epi {
        // The bias is read, the pre-activation written to the aux matrix.
        Epi::GeluAuxBias { .. } => LtPtrs {
            bias: read_ptr,
            aux: extra.ptr(),
            out: out.ptr(),
        },
        // The pre-activation is read from the aux matrix, the bias gradient written.
        _ => LtPtrs {
            bias: extra.ptr(),
            aux: read_ptr,
            out: out.ptr(),
        },
    };
    let (mut ca, mut cb) = (None, None);
    let oa = readable(a, la, &mut ca)?;
    let ob = readable(b, lb, &mut cb)?;
    if epi == Epi::BGradB && !oa.transposed {
        // cuBLASLt reduces its B (our `a`) only when it reads it transposed.
        return Ok(None);
    }
    let done = gemm_lt(rt, dtype, (m, n, k), (&oa, &ob), &ptrs, epi)?;
    Ok(done.then_some((out, extra)))
}
