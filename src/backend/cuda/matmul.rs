//! Matrix products through cuBLAS (strided batched GEMM) and cuBLASLt (bias and ReLU
//! epilogues, `blaslt.rs`), and the TF32 switch for f32 products (PyTorch's
//! `torch.backends.cuda.matmul.allow_tf32`, off by default; the products of a cuDNN-class op,
//! the LSTM layer, follow `torch.backends.cudnn.allow_tf32` instead, on by default).

use super::blaslt::Operand;
use super::storage::{float_kname, same_dtype, CudaStorage};
use super::tf32::product_tf32;
pub use super::tf32::{allow_tf32, set_allow_tf32};
use crate::layout::Layout;
use crate::{DType, Error, Result};
use cudarc::cublas::{result as blas_result, sys as bs};

/// `l` as a batch of matrices cuBLAS can read in place, or `None` when a copy is needed.
fn operand(s: &CudaStorage, l: &Layout) -> Option<Operand> {
    let r = l.rank();
    let (rows, cols) = (l.shape()[r - 2], l.shape()[r - 1]);
    let (rs, cs) = (l.strides()[r - 2], l.strides()[r - 1]);
    let (transposed, ld) = if cs == 1 && rs >= cols.max(1) {
        (false, rs)
    } else if rs == 1 && cs >= rows.max(1) {
        (true, cs)
    } else {
        return None;
    };
    // The batch dims must step by one stride (0 for a broadcast operand).
    let batch: Vec<(usize, usize)> = l.shape()[..r - 2]
        .iter()
        .zip(&l.strides()[..r - 2])
        .filter(|(&n, _)| n > 1)
        .map(|(&n, &st)| (n, st))
        .collect();
    let stride = batch.last().map_or(0, |&(_, st)| st);
    let mut expect = stride;
    for &(n, st) in batch.iter().rev() {
        if st != expect {
            return None;
        }
        expect = st * n;
    }
    Some(Operand {
        ptr: s.ptr_at(l.offset()),
        batch_stride: stride as i64,
        transposed,
        ld: ld as i64,
    })
}

/// `l` as an operand cuBLAS reads in place, or a contiguous copy of it kept in `keep`.
pub(super) fn readable<'a>(
    s: &'a CudaStorage,
    l: &Layout,
    keep: &'a mut Option<CudaStorage>,
) -> Result<Operand> {
    if let Some(o) = operand(s, l) {
        return Ok(o);
    }
    let copy = keep.insert(s.copy_strided(l)?);
    Ok(operand(copy, &Layout::contiguous(l.shape())).expect("contiguous is readable"))
}

/// How many product shapes have their cuBLASLt descriptors and algorithm built and cached
/// (Linear's bias epilogue): each is built at its first product, not per call.
///
/// ```
/// # #[cfg(feature = "cuda-backend")]
/// let _shapes = mantissa::backend::cuda::matmul::cublaslt_plans_cached();
/// ```
pub fn cublaslt_plans_cached() -> usize {
    super::blaslt::plans_cached()
}

/// `a @ b + bias` for one matrix, then ReLU with `relu`, in cuBLASLt's epilogue; `None` when
/// cuBLASLt offers no algorithm (or the product is empty).
fn lt_bias(
    a: &CudaStorage,
    (oa, ob): (&Operand, &Operand),
    (m, n, k): (usize, usize, usize),
    (s, l): (&CudaStorage, &Layout),
    relu: bool,
) -> Result<Option<CudaStorage>> {
    same_dtype("matmul (bias)", a, s)?;
    if [m, n, k].contains(&0) {
        return Ok(None);
    }
    // `contiguous` borrows only a whole storage and copies any other view, so the bias
    // starts a block (aligned as the epilogue may need).
    let bias = s.contiguous(l)?;
    let out = CudaStorage::alloc_on(a.rt(), a.dtype(), m * n)?;
    let ptrs = super::blaslt::LtPtrs {
        bias: bias.ptr(),
        aux: 0,
        out: out.ptr(),
    };
    let epi = match relu {
        true => super::blaslt::Epi::ReluBias,
        false => super::blaslt::Epi::Bias,
    };
    let done = super::blaslt::gemm_lt(a.rt(), a.dtype(), (m, n, k), (oa, ob), &ptrs, epi)?;
    Ok(done.then_some(out))
}

/// `relu(a @ b + bias)` for 2-D operands in one cuBLASLt call (Linear followed by ReLU);
/// `None` when cuBLASLt offers no algorithm, and the caller composes the ops.
pub(crate) fn linear_relu(
    a: &CudaStorage,
    la: &Layout,
    b: &CudaStorage,
    lb: &Layout,
    bias: (&CudaStorage, &Layout),
) -> Result<Option<CudaStorage>> {
    same_dtype("linear_relu", a, b)?;
    float_kname("linear_relu", a.dtype())?;
    if la.rank() != 2 || lb.rank() != 2 {
        return Ok(None);
    }
    let (m, k, n) = (la.shape()[0], la.shape()[1], lb.shape()[1]);
    if [m, n, k].contains(&0) {
        return Ok(None);
    }
    let (mut ca, mut cb) = (None, None);
    let oa = readable(a, la, &mut ca)?;
    let ob = readable(b, lb, &mut cb)?;
    lt_bias(a, (&oa, &ob), (m, n, k), bias, true)
}

/// `a @ b` over the batch dims through cuBLAS (`cublasGemmStridedBatchedEx`, f32
/// accumulation; f16/bf16 on tensor cores, f32 exact or TF32 when allowed). With `bias`
/// (`n` elements) and one matrix, cuBLASLt adds the bias in its epilogue (`blaslt.rs`);
/// otherwise every output row starts from the bias and the product is added (`beta = 1`).
pub(crate) fn matmul(
    a: &CudaStorage,
    la: &Layout,
    b: &CudaStorage,
    lb: &Layout,
    bias: Option<(&CudaStorage, &Layout)>,
) -> Result<CudaStorage> {
    same_dtype("matmul", a, b)?;
    float_kname("matmul", a.dtype())?;
    let r = la.rank();
    let (m, k, n) = (la.shape()[r - 2], la.shape()[r - 1], lb.shape()[r - 1]);
    let batch: usize = la.shape()[..r - 2].iter().product();
    if [m, n, k, batch].contains(&0) {
        // Nothing to multiply (and empty operands need not be readable): every output row is
        // the bias, or zero.
        return match bias {
            Some((s, l)) => {
                same_dtype("matmul (bias)", a, s)?;
                s.contiguous(l)?
                    .copy_strided(&Layout::new(vec![batch * m, n], vec![0, 1], 0))
            }
            None => CudaStorage::full(a.ordinal(), 0.0, batch * m * n, a.dtype()),
        };
    }
    let (mut ca, mut cb) = (None, None);
    let oa = readable(a, la, &mut ca)?;
    let ob = readable(b, lb, &mut cb)?;
    if let (Some(bias), 1) = (bias, batch) {
        // Linear's case: the bias in cuBLASLt's epilogue, one call.
        if let Some(out) = lt_bias(a, (&oa, &ob), (m, n, k), bias, false)? {
            return Ok(out);
        }
    }
    let out = match bias {
        Some((s, l)) => {
            same_dtype("matmul (bias)", a, s)?;
            // Every output row starts as the bias: a broadcast copy (row stride 0).
            let dense = s.contiguous(l)?;
            dense.copy_strided(&Layout::new(vec![batch * m, n], vec![0, 1], 0))?
        }
        None => CudaStorage::alloc_on(a.rt(), a.dtype(), batch * m * n)?,
    };
    let (beta, c) = (if bias.is_some() { 1.0f32 } else { 0.0 }, out.ptr());
    gemm(a, (&oa, &ob), (m, n, k, batch), (c, n), beta)?;
    Ok(out)
}

/// One cuBLAS call `C = a @ b + beta C` over `batch` matrices (`cublasGemmStridedBatchedEx`,
/// f32 accumulation; f16/bf16 on tensor cores, f32 exact or TF32 when allowed), with `C` at
/// address `c`, rows `ldc` apart, matrices `m * n` apart.
fn gemm(
    a: &CudaStorage,
    (oa, ob): (&Operand, &Operand),
    (m, n, k, batch): (usize, usize, usize, usize),
    (c, ldc): (cudarc::driver::sys::CUdeviceptr, usize),
    beta: f32,
) -> Result<()> {
    let (ty, compute) = match a.dtype() {
        DType::F32 if product_tf32() => (
            bs::cudaDataType_t::CUDA_R_32F,
            bs::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        ),
        DType::F32 => (
            bs::cudaDataType_t::CUDA_R_32F,
            bs::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        DType::F16 => (
            bs::cudaDataType_t::CUDA_R_16F,
            bs::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        _ => (
            bs::cudaDataType_t::CUDA_R_16BF,
            bs::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
    };
    let op = |t: bool| match t {
        true => bs::cublasOperation_t::CUBLAS_OP_T,
        false => bs::cublasOperation_t::CUBLAS_OP_N,
    };
    // cuBLAS takes its sizes, leading dimensions and batch count as i32: a size past
    // i32::MAX is an error naming the limit, never truncated.
    let int = |what: &str, v: i64| {
        i32::try_from(v).map_err(|_| {
            Error::too_large(
                "matmul",
                &[batch, m, k, n],
                format!("cuBLAS takes {what} up to i32::MAX, got {v}"),
            )
        })
    };
    // Every size here is at most isize::MAX (checked where shapes are made), so `as i64`
    // is exact.
    let (n32, m32, k32) = (
        int("n", n as i64)?,
        int("m", m as i64)?,
        int("k", k as i64)?,
    );
    let (lda, ldb, ldc) = (
        int("lda", oa.ld)?,
        int("ldb", ob.ld)?,
        int("ldc", ldc as i64)?,
    );
    let alpha = 1.0f32;
    let elem = a.dtype().size_in_bytes() as u64;
    let [m64, n64, k64, b64] = [m, n, k, batch].map(|v| v as u64);
    let prof = super::profile::library(
        a.rt(),
        || {
            let d = super::profile::short(a.dtype());
            format!("cublas gemm {batch}x {m}x{k}x{n} {d}")
        },
        2 * b64 * m64 * n64 * k64,
        b64 * (m64 * k64 + k64 * n64 + m64 * n64) * elem,
    );
    // cuBLAS counts the batch in an i32: a larger batch runs as several calls, each from
    // its first matrix's address (batch strides are non-negative element counts).
    let per_call = i32::MAX as usize;
    for start in (0..batch).step_by(per_call) {
        let count = per_call.min(batch - start);
        let at = |o: &Operand| o.ptr + (start as i64 * o.batch_stride) as u64 * elem;
        let (pa, pb, pc) = (at(oa), at(ob), c + (start * m * n) as u64 * elem);
        // `count` fits an i32 by the step above.
        let batch32 = count as i32;
        // Row-major C = A B is column-major C^T = B^T A^T: cuBLAS's first operand is b.
        // SAFETY: the pointers address `count` matrices of the stated shapes and strides on
        // this device (a piece of the `batch` the operands hold); the handle's stream is the
        // runtime's stream.
        a.rt()
            .with_blas(|handle| unsafe {
                blas_result::gemm_strided_batched_ex(
                    handle,
                    op(ob.transposed),
                    op(oa.transposed),
                    n32,
                    m32,
                    k32,
                    &alpha as *const f32 as *const _,
                    pb as *const _,
                    ty,
                    ldb,
                    ob.batch_stride,
                    pa as *const _,
                    ty,
                    lda,
                    oa.batch_stride,
                    &beta as *const f32 as *const _,
                    pc as *mut _,
                    ty,
                    ldc,
                    (m * n) as i64,
                    batch32,
                    compute,
                    bs::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            })?
            .map_err(|e| Error::CudaLibraryStatus {
                lib: "cuBLAS",
                op: "matmul",
                device: a.device(),
                status: format!("{:?}", e.0),
                what: format!(
                    "cublasGemmStridedBatchedEx ({m}x{k} @ {k}x{n}, batch {batch}, {:?})",
                    a.dtype()
                ),
            })?;
    }
    if let Some(p) = prof {
        p.end();
    }
    Ok(())
}

/// `dst[ld] += a @ b` in place: one cuBLAS call with `beta = 1` whose `C` is the view
/// (checked by `Storage::matmul_acc`: 2-D operands, unit-stride destination rows).
pub(crate) fn matmul_acc(
    dst: &mut CudaStorage,
    ld: &Layout,
    a: &CudaStorage,
    la: &Layout,
    b: &CudaStorage,
    lb: &Layout,
) -> Result<()> {
    same_dtype("matmul (accumulate)", dst, a)?;
    same_dtype("matmul (accumulate)", a, b)?;
    float_kname("matmul (accumulate)", a.dtype())?;
    let (m, k, n) = (la.shape()[0], la.shape()[1], lb.shape()[1]);
    if [m, n, k].contains(&0) {
        return Ok(()); // adds nothing
    }
    let (mut ca, mut cb) = (None, None);
    let oa = readable(a, la, &mut ca)?;
    let ob = readable(b, lb, &mut cb)?;
    let ldc = ld.strides()[0].max(n);
    gemm(
        a,
        (&oa, &ob),
        (m, n, k, 1),
        (dst.ptr_at(ld.offset()), ldc),
        1.0,
    )
}
