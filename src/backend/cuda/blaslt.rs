//! cuBLASLt products with the bias (and a ReLU) in the epilogue: Linear's `x W^T + b` in one
//! call, the bias added to the f32 accumulator before the result is rounded to the output
//! dtype, instead of a broadcast copy of the bias followed by a GEMM with `beta = 1`; with the
//! ReLU, `Sequential`'s Linear + ReLU pairs in one call too. The cuBLAS path in `ops.rs`
//! remains for everything else and whenever cuBLASLt offers no algorithm.

use super::runtime::CudaRuntime;
use super::storage::CudaStorage;
use super::tf32::product_tf32;
use crate::{DType, Error, Result};
use cudarc::cublaslt::result::{self as lt, CublasError};
use cudarc::cublaslt::sys;
use cudarc::driver::sys::CUdeviceptr;
use std::sync::Arc;

/// How cuBLAS reads one operand: its batch stride and, per matrix, whether it is stored
/// row-major (`false`) or as the transpose of a row-major matrix (`true`), with the leading
/// dimension.
pub(crate) struct Operand {
    pub(crate) ptr: u64,
    pub(crate) batch_stride: i64,
    pub(crate) transposed: bool,
    pub(crate) ld: i64,
}

/// Workspace offered to cuBLASLt's algorithms (from the caching allocator, per call).
const WORKSPACE: usize = 4 << 20;

/// Descriptors destroyed on drop.
struct Layout(sys::cublasLtMatrixLayout_t);
impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created by `create_matrix_layout`, destroyed once.
        let _ = unsafe { lt::destroy_matrix_layout(self.0) };
    }
}
struct Desc(sys::cublasLtMatmulDesc_t);
impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by `create_matmul_desc`, destroyed once.
        let _ = unsafe { lt::destroy_matmul_desc(self.0) };
    }
}
struct Pref(sys::cublasLtMatmulPreference_t);
impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created by `create_matmul_pref`, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

/// The largest power of two (at most 256) that divides `ptr`: the alignment cuBLASLt may
/// assume for an operand (it assumes 256 unless told).
fn alignment(ptr: CUdeviceptr) -> u32 {
    match ptr {
        0 => 256,
        p => 1u32 << p.trailing_zeros().min(8),
    }
}

/// `out [m, n] (row-major, contiguous) = a [m, k] b [k, n] + bias [n]`, then ReLU with
/// `relu`, for operands cuBLAS can read in place (`oa`, `ob`, batch 1). `Ok(false)` when
/// cuBLASLt has no algorithm for it: the caller then takes another path.
pub(crate) fn gemm_bias(
    rt: &Arc<CudaRuntime>,
    dtype: DType,
    (m, n, k): (usize, usize, usize),
    (oa, ob): (&Operand, &Operand),
    bias: CUdeviceptr,
    out: CUdeviceptr,
    relu: bool,
) -> Result<bool> {
    let device = rt.device();
    let (ty, compute) = match dtype {
        DType::F32 if product_tf32() => (
            sys::cudaDataType_t::CUDA_R_32F,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        ),
        DType::F32 => (
            sys::cudaDataType_t::CUDA_R_32F,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        DType::F16 => (
            sys::cudaDataType_t::CUDA_R_16F,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        _ => (
            sys::cudaDataType_t::CUDA_R_16BF,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
    };
    let ws = CudaStorage::alloc_on(rt, DType::U8, WORKSPACE)?;
    let fail = |what: &str, e: CublasError| Error::CudaLibraryStatus {
        lib: "cuBLASLt",
        op: "matmul",
        device,
        status: format!("{:?}", e.0),
        what: format!("{what} ({m}x{k} @ {k}x{n} + bias, relu {relu}, {dtype:?})"),
    };
    // Row-major `out = a b` is column-major `out^T = b^T a^T`: cuBLASLt's A is `b` (n x k
    // after its op), its B is `a` (k x m), its D is `out^T` (n x m, ld n); the bias runs
    // along D's rows, the output features.
    let stored = |o: &Operand, rows: usize, cols: usize| match o.transposed {
        true => (cols as u64, rows as u64),
        false => (rows as u64, cols as u64),
    };
    let (ar, ac) = stored(ob, n, k);
    let (br, bc) = stored(oa, k, m);
    let layout = |r: u64, c: u64, ld: i64| {
        lt::create_matrix_layout(ty, r, c, ld)
            .map(Layout)
            .map_err(|e| fail("a matrix layout", e))
    };
    let (la, lb, ld) = (
        layout(ar, ac, ob.ld)?,
        layout(br, bc, oa.ld)?,
        layout(n as u64, m as u64, n as i64)?,
    );
    let desc = lt::create_matmul_desc(compute, sys::cudaDataType_t::CUDA_R_32F)
        .map(Desc)
        .map_err(|e| fail("a matmul descriptor", e))?;
    let pref = lt::create_matmul_pref()
        .map(Pref)
        .map_err(|e| fail("a preference", e))?;
    // cublasOperation_t as its value: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1.
    let op = |t: bool| t as i32;
    use sys::cublasLtMatmulDescAttributes_t as D;
    use sys::cublasLtMatmulPreferenceAttributes_t as P;
    let (ta, tb) = (op(ob.transposed), op(oa.transposed));
    let epilogue = match relu {
        true => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_RELU_BIAS,
        false => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
    };
    let aligns = [ob.ptr, oa.ptr, out, out].map(alignment);
    // SAFETY: each attribute value is a live local of the size passed with it; the handles
    // are alive until the end of this function.
    let heuristic = unsafe {
        fn attr<T>(v: &T) -> (*const std::ffi::c_void, usize) {
            (v as *const T as *const _, std::mem::size_of::<T>())
        }
        for (a, (p, s)) in [
            (D::CUBLASLT_MATMUL_DESC_TRANSA, attr(&ta)),
            (D::CUBLASLT_MATMUL_DESC_TRANSB, attr(&tb)),
            (D::CUBLASLT_MATMUL_DESC_EPILOGUE, attr(&epilogue)),
            (D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, attr(&bias)),
        ] {
            lt::set_matmul_desc_attribute(desc.0, a, p, s)
                .map_err(|e| fail("a descriptor attribute", e))?;
        }
        let size = WORKSPACE;
        for (a, (p, s)) in [
            (P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, attr(&size)),
            (
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                attr(&aligns[0]),
            ),
            (
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                attr(&aligns[1]),
            ),
            (
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                attr(&aligns[2]),
            ),
            (
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                attr(&aligns[3]),
            ),
        ] {
            lt::set_matmul_pref_attribute(pref.0, a, p, s)
                .map_err(|e| fail("a preference attribute", e))?;
        }
        rt.with_blas_lt(|h| {
            lt::get_matmul_algo_heuristic(h, desc.0, la.0, lb.0, ld.0, ld.0, pref.0)
        })?
    };
    let heuristic = match heuristic {
        Ok(h) => h,
        Err(CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)) => return Ok(false),
        Err(e) => return Err(fail("choosing an algorithm", e)),
    };
    let (alpha, beta) = (1.0f32, 0.0f32);
    let stream = rt.stream().cu_stream() as sys::cudaStream_t;
    let elem = dtype.size_in_bytes() as u64;
    let (m64, n64, k64) = (m as u64, n as u64, k as u64);
    let prof = super::profile::library(
        rt,
        || {
            let relu = if relu { " relu" } else { "" };
            let d = super::profile::short(dtype);
            format!("cublasLt matmul+bias{relu} {m}x{k}x{n} {d}")
        },
        2 * m64 * n64 * k64,
        (m64 * k64 + k64 * n64 + m64 * n64 + n64) * elem,
    );
    // SAFETY: the operands address matrices of the stated shapes on this device, the bias `n`
    // elements, `out` `m * n`; the workspace outlives the call's work on the stream (a freed
    // block is reused only by later work on the same stream).
    rt.with_blas_lt(|h| unsafe {
        lt::matmul(
            h,
            desc.0,
            &alpha as *const f32 as *const _,
            &beta as *const f32 as *const _,
            ob.ptr as *const _,
            la.0,
            oa.ptr as *const _,
            lb.0,
            out as *const _,
            ld.0,
            out as *mut _,
            ld.0,
            &heuristic.algo,
            ws.ptr() as *mut _,
            WORKSPACE,
            stream,
        )
    })?
    .map_err(|e| fail("cublasLtMatmul", e))?;
    if let Some(p) = prof {
        p.end();
    }
    Ok(true)
}
