//! cuBLASLt products with work done in the epilogue ([`Epi`]): Linear's `x W^T + b` in one
//! call, the bias added to the f32 accumulator before the result is rounded to the output
//! dtype, instead of a broadcast copy of the bias followed by a GEMM with `beta = 1`; with the
//! ReLU, `Sequential`'s Linear + ReLU pairs in one call too; and a transformer MLP's GELU
//! (tanh form) with its pre-activation kept, its backward and bias gradients
//! (`epilogue.rs`). The cuBLAS path in `matmul.rs` remains for everything else and whenever
//! cuBLASLt offers no algorithm. Each shape's descriptors and algorithm are built once and
//! cached; the products run in the workspace the runtime gives cuBLAS (`libraries.rs`).

use super::runtime::CudaRuntime;
use super::tf32::product_tf32;
use crate::sync::lock;
use crate::{DType, Device, Error, Result};
use cudarc::cublaslt::result::{self as lt, CublasError};
use cudarc::cublaslt::sys;
use cudarc::driver::sys::CUdeviceptr;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// How cuBLAS reads one operand: its batch stride and, per matrix, whether it is stored
/// row-major (`false`) or as the transpose of a row-major matrix (`true`), with the leading
/// dimension.
pub(crate) struct Operand {
    pub(crate) ptr: u64,
    pub(crate) batch_stride: i64,
    pub(crate) transposed: bool,
    pub(crate) ld: i64,
}

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

/// What cuBLASLt does after the product `out [m, n] = a [m, k] b [k, n]` (row-major terms;
/// `n` is the features of an output row, which cuBLASLt sees as D's rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Epi {
    /// `+ bias[n]` (`CUBLASLT_EPILOGUE_BIAS`).
    Bias,
    /// `relu(. + bias[n])` (`RELU_BIAS`).
    ReluBias,
    /// `gelu_tanh(. + bias[n])`, with `. + bias` written to the aux matrix, rows `aux_ld`
    /// elements apart (`GELU_AUX_BIAS`).
    GeluAuxBias { aux_ld: i64 },
    /// `. * gelu_tanh'(aux)`, and that result's sums over the `m` rows written to the bias
    /// pointer (`DGELU_BGRAD`).
    DGeluBGrad { aux_ld: i64 },
    /// The product unchanged, and `a`'s sums over `k` (`m` of them) written to the bias
    /// pointer (`BGRADB`: cuBLASLt's B is `a`).
    BGradB,
}

impl Epi {
    fn code(self) -> sys::cublasLtEpilogue_t {
        use sys::cublasLtEpilogue_t as E;
        match self {
            Epi::Bias => E::CUBLASLT_EPILOGUE_BIAS,
            Epi::ReluBias => E::CUBLASLT_EPILOGUE_RELU_BIAS,
            Epi::GeluAuxBias { .. } => E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            Epi::DGeluBGrad { .. } => E::CUBLASLT_EPILOGUE_DGELU_BGRAD,
            Epi::BGradB => E::CUBLASLT_EPILOGUE_BGRADB,
        }
    }

    /// The aux matrix's leading dimension, for the epilogues that have one.
    fn aux_ld(self) -> Option<i64> {
        match self {
            Epi::GeluAuxBias { aux_ld } | Epi::DGeluBGrad { aux_ld } => Some(aux_ld),
            _ => None,
        }
    }

    /// A few words for the profiler and errors.
    fn name(self) -> &'static str {
        match self {
            Epi::Bias => "+bias",
            Epi::ReluBias => "+bias relu",
            Epi::GeluAuxBias { .. } => "+bias gelu aux",
            Epi::DGeluBGrad { .. } => " dgelu bgrad",
            Epi::BGradB => " bgradb",
        }
    }
}

/// The addresses one epilogue product reads and writes besides its operands: the bias
/// (read by `Bias`, `ReluBias` and `GeluAuxBias`, written by the gradient epilogues), the aux
/// matrix (written by `GeluAuxBias`, read by `DGeluBGrad`; 0 otherwise) and the output.
pub(crate) struct LtPtrs {
    pub(crate) bias: CUdeviceptr,
    pub(crate) aux: CUdeviceptr,
    pub(crate) out: CUdeviceptr,
}

/// Everything a product's descriptors and algorithm depend on.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    device: Device,
    dtype: DType,
    tf32: bool,
    mnk: (usize, usize, usize),
    /// Each operand's transpose and leading dimension (`a`, then `b`).
    ops: [(bool, i64); 2],
    epi: Epi,
    /// Of `b`, `a`, the output (cuBLASLt's A, B, C and D), the bias and the aux matrix.
    aligns: [u32; 5],
    workspace: usize,
}

/// A product's layouts, descriptor and chosen algorithm, built once per [`Key`]. The bias and
/// aux pointers are set on `desc` at each call, under the device's cuBLASLt lock.
struct Plan {
    la: Layout,
    lb: Layout,
    ld: Layout,
    desc: Desc,
    algo: sys::cublasLtMatmulAlgo_t,
}

// SAFETY: a plan's descriptors are host objects cuBLASLt does not tie to a thread; the one
// changes made after they are built (the bias and aux pointers) and every use happen under the
// cuBLASLt handle's lock of the plan's device (`with_blas_lt`), one thread at a time.
unsafe impl Send for Plan {}
// SAFETY: as above: shared references only reach the descriptors under that lock.
unsafe impl Sync for Plan {}

/// The plans built so far; `None` where cuBLASLt offered no algorithm (not asked again).
fn plans() -> &'static Mutex<HashMap<Key, Option<Arc<Plan>>>> {
    static PLANS: OnceLock<Mutex<HashMap<Key, Option<Arc<Plan>>>>> = OnceLock::new();
    PLANS.get_or_init(Default::default)
}

/// How many product shapes have their cuBLASLt descriptors and algorithm cached (each is
/// built once, at its first product, not per call).
pub(crate) fn plans_cached() -> usize {
    lock(plans()).len()
}

/// The compute and data types cuBLASLt takes for `dtype` (TF32 with `tf32`).
fn types(dtype: DType, tf32: bool) -> (sys::cudaDataType_t, sys::cublasComputeType_t) {
    use sys::cublasComputeType_t::{CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32};
    use sys::cudaDataType_t::{CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F};
    match dtype {
        DType::F32 if tf32 => (CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_TF32),
        DType::F32 => (CUDA_R_32F, CUBLAS_COMPUTE_32F),
        DType::F16 => (CUDA_R_16F, CUBLAS_COMPUTE_32F),
        _ => (CUDA_R_16BF, CUBLAS_COMPUTE_32F),
    }
}

/// Builds the plan for `key` on `h`: `Ok(None)` when cuBLASLt has no algorithm for it.
fn build(
    h: sys::cublasLtHandle_t,
    key: &Key,
    ptrs: &LtPtrs,
    fail: &dyn Fn(&str, CublasError) -> Error,
) -> Result<Option<Plan>> {
    let (ty, compute) = types(key.dtype, key.tf32);
    let (m, n, k) = key.mnk;
    let [(ta, lda), (tb, ldb)] = key.ops;
    // Row-major `out = a b` is column-major `out^T = b^T a^T`: cuBLASLt's A is `b` (n x k
    // after its op), its B is `a` (k x m), its D is `out^T` (n x m, ld n); the bias runs
    // along D's rows, the output features.
    let stored = |transposed: bool, rows: usize, cols: usize| match transposed {
        true => (cols as u64, rows as u64),
        false => (rows as u64, cols as u64),
    };
    let (ar, ac) = stored(tb, n, k);
    let (br, bc) = stored(ta, k, m);
    let layout = |r: u64, c: u64, ld: i64| {
        lt::create_matrix_layout(ty, r, c, ld)
            .map(Layout)
            .map_err(|e| fail("a matrix layout", e))
    };
    let (la, lb, ld) = (
        layout(ar, ac, ldb)?,
        layout(br, bc, lda)?,
        layout(n as u64, m as u64, n as i64)?,
    );
    let desc = lt::create_matmul_desc(compute, sys::cudaDataType_t::CUDA_R_32F)
        .map(Desc)
        .map_err(|e| fail("a matmul descriptor", e))?;
    let pref = lt::create_matmul_pref()
        .map(Pref)
        .map_err(|e| fail("a preference", e))?;
    // cublasOperation_t as its value: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1.
    let (op_a, op_b) = (tb as i32, ta as i32);
    use sys::cublasLtMatmulDescAttributes_t as D;
    use sys::cublasLtMatmulPreferenceAttributes_t as P;
    let epilogue = key.epi.code();
    let [align_a, align_b, align_d, ..] = key.aligns;
    let size = key.workspace;
    // SAFETY: each attribute value is a live local of the size passed with it; the
    // descriptors are alive until the end of this function or kept in the plan.
    let heuristic = unsafe {
        for (a, (p, s)) in [
            (D::CUBLASLT_MATMUL_DESC_TRANSA, attr(&op_a)),
            (D::CUBLASLT_MATMUL_DESC_TRANSB, attr(&op_b)),
            (D::CUBLASLT_MATMUL_DESC_EPILOGUE, attr(&epilogue)),
        ] {
            lt::set_matmul_desc_attribute(desc.0, a, p, s)
                .map_err(|e| fail("a descriptor attribute", e))?;
        }
        if let Some(aux_ld) = key.epi.aux_ld() {
            let (p, s) = attr(&aux_ld);
            lt::set_matmul_desc_attribute(desc.0, D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, p, s)
                .map_err(|e| fail("the aux leading dimension", e))?;
        }
        // The heuristic reads the bias and aux pointers' values for their alignment: this
        // call's, whose alignment classes are in the key.
        set_pointers(desc.0, ptrs, fail)?;
        for (a, (p, s)) in [
            (P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, attr(&size)),
            (
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                attr(&align_a),
            ),
            (
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                attr(&align_b),
            ),
            (
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                attr(&align_d),
            ),
            (
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                attr(&align_d),
            ),
        ] {
            lt::set_matmul_pref_attribute(pref.0, a, p, s)
                .map_err(|e| fail("a preference attribute", e))?;
        }
        lt::get_matmul_algo_heuristic(h, desc.0, la.0, lb.0, ld.0, ld.0, pref.0)
    };
    match heuristic {
        Ok(found) => Ok(Some(Plan {
            la,
            lb,
            ld,
            desc,
            algo: found.algo,
        })),
        Err(CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)) => Ok(None),
        Err(e) => Err(fail("choosing an algorithm", e)),
    }
}

/// Sets `ptrs`' bias and aux addresses (those not 0) on `desc`.
///
/// # Safety
/// `desc` is a live descriptor that no other thread uses meanwhile.
unsafe fn set_pointers(
    desc: sys::cublasLtMatmulDesc_t,
    ptrs: &LtPtrs,
    fail: &dyn Fn(&str, CublasError) -> Error,
) -> Result<()> {
    use sys::cublasLtMatmulDescAttributes_t as D;
    for (a, v, name) in [
        (
            D::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
            &ptrs.bias,
            "the bias pointer",
        ),
        (
            D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
            &ptrs.aux,
            "the aux pointer",
        ),
    ] {
        if *v != 0 {
            let (p, s) = attr(v);
            // SAFETY: the value is a live local of its size; `desc` is live and unshared
            // (this function's contract).
            unsafe { lt::set_matmul_desc_attribute(desc, a, p, s) }.map_err(|e| fail(name, e))?;
        }
    }
    Ok(())
}

/// An attribute value's address and size.
fn attr<T>(v: &T) -> (*const std::ffi::c_void, usize) {
    (v as *const T as *const _, std::mem::size_of::<T>())
}

/// `out [m, n] (row-major, contiguous) = a [m, k] b [k, n]` followed by `epi` (with the
/// bias and aux addresses of `ptrs`), for operands cuBLAS can read in place (`oa`, `ob`,
/// batch 1), in the runtime's cuBLAS workspace. `Ok(false)` when cuBLASLt has no algorithm
/// for it: the caller then takes another path. The descriptors and the algorithm are built at
/// the first product of each shape and reused ([`plans_cached`]).
pub(crate) fn gemm_lt(
    rt: &Arc<CudaRuntime>,
    dtype: DType,
    (m, n, k): (usize, usize, usize),
    (oa, ob): (&Operand, &Operand),
    ptrs: &LtPtrs,
    epi: Epi,
) -> Result<bool> {
    let device = rt.device();
    let (ws, workspace) = rt.blas_workspace().unwrap_or((0, 0));
    let key = Key {
        device,
        dtype,
        tf32: dtype == DType::F32 && product_tf32(),
        mnk: (m, n, k),
        ops: [(oa.transposed, oa.ld), (ob.transposed, ob.ld)],
        epi,
        aligns: [ob.ptr, oa.ptr, ptrs.out, ptrs.bias, ptrs.aux].map(alignment),
        workspace,
    };
    let what = epi.name();
    let fail = |stage: &str, e: CublasError| Error::CudaLibraryStatus {
        lib: "cuBLASLt",
        op: "matmul",
        device,
        status: format!("{:?}", e.0),
        what: format!("{stage} ({m}x{k} @ {k}x{n} {what}, {dtype:?})"),
    };
    let known = lock(plans()).get(&key).cloned();
    let plan = match known {
        Some(plan) => plan,
        None => {
            let built = rt
                .with_blas_lt(|h| build(h, &key, ptrs, &fail))??
                .map(Arc::new);
            lock(plans()).insert(key, built.clone());
            built
        }
    };
    let Some(plan) = plan else {
        return Ok(false);
    };
    let (alpha, beta) = (1.0f32, 0.0f32);
    let stream = rt.stream().cu_stream() as sys::cudaStream_t;
    let elem = dtype.size_in_bytes() as u64;
    let (m64, n64, k64) = (m as u64, n as u64, k as u64);
    let prof = super::profile::library(
        rt,
        || {
            let d = super::profile::short(dtype);
            format!("cublasLt matmul{what} {m}x{k}x{n} {d}")
        },
        2 * m64 * n64 * k64,
        (m64 * k64 + k64 * n64 + m64 * n64 + n64) * elem,
    );
    rt.with_blas_lt(|h| {
        // SAFETY: the pointers are live locals of their size; the descriptor is the plan's,
        // changed and used only under this handle's lock (held here). The operands address
        // matrices of the stated shapes on this device, `out` `m * n` elements, the bias `n`
        // (or `m` for `BGradB`) and the aux matrix `m` rows of its leading dimension, as the
        // callers in `matmul.rs` and `epilogue.rs` allocate them; the workspace holds
        // `workspace` bytes for the runtime's life.
        unsafe {
            set_pointers(plan.desc.0, ptrs, &fail)?;
            lt::matmul(
                h,
                plan.desc.0,
                &alpha as *const f32 as *const _,
                &beta as *const f32 as *const _,
                ob.ptr as *const _,
                plan.la.0,
                oa.ptr as *const _,
                plan.lb.0,
                ptrs.out as *const _,
                plan.ld.0,
                ptrs.out as *mut _,
                plan.ld.0,
                &plan.algo,
                ws as *mut _,
                workspace,
                stream,
            )
            .map_err(|e| fail("cublasLtMatmul", e))
        }
    })??;
    if let Some(p) = prof {
        p.end();
    }
    Ok(true)
}
