//! Launchers for the kernels of `cuda/`: elementwise, reductions, softmax, dropout, and the
//! cuBLAS GEMM. Each takes device storages and layouts as the CPU backend's functions do and
//! returns a contiguous result.
//!
//! tests/cuda_parity.rs compares each launcher with the CPU backend.

use super::profile::{elems, view_bytes};
use super::storage::{float_kname, grid, kname, CudaStorage, Strided};
use crate::backend::ops::{BinaryOp, CmpOp, ReduceOp, UnaryOp};
use crate::layout::Layout;
use crate::{DType, Error, Result};
use cudarc::cublas::{result as blas_result, sys as bs};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use std::sync::atomic::{AtomicBool, Ordering};

static ALLOW_TF32: AtomicBool = AtomicBool::new(false);

/// Lets f32 matrix products use TF32 tensor cores (10-bit mantissa products, f32
/// accumulation), as `torch.backends.cuda.matmul.allow_tf32 = True` does. Off by default:
/// f32 products are exact f32 unless the user allows this.
///
/// ```
/// mantissa::backend::cuda::ops::set_allow_tf32(true);
/// assert!(mantissa::backend::cuda::ops::allow_tf32());
/// mantissa::backend::cuda::ops::set_allow_tf32(false);
/// ```
pub fn set_allow_tf32(allow: bool) {
    ALLOW_TF32.store(allow, Ordering::Relaxed);
}

/// Whether f32 products may use TF32 (see [`set_allow_tf32`]).
pub fn allow_tf32() -> bool {
    ALLOW_TF32.load(Ordering::Relaxed)
}

/// The kernel's op code and scalar parameters (`unary_f` in `cuda/elementwise.cu`).
pub(super) fn unary_code(op: UnaryOp) -> (i32, f32, f32) {
    match op {
        UnaryOp::Neg => (0, 0.0, 0.0),
        UnaryOp::Abs => (1, 0.0, 0.0),
        UnaryOp::Exp => (2, 0.0, 0.0),
        UnaryOp::Log => (3, 0.0, 0.0),
        UnaryOp::Log1p => (4, 0.0, 0.0),
        UnaryOp::Sqrt => (5, 0.0, 0.0),
        UnaryOp::Rsqrt => (6, 0.0, 0.0),
        UnaryOp::Recip => (7, 0.0, 0.0),
        UnaryOp::Sin => (8, 0.0, 0.0),
        UnaryOp::Cos => (9, 0.0, 0.0),
        UnaryOp::Tanh => (10, 0.0, 0.0),
        UnaryOp::Sigmoid => (11, 0.0, 0.0),
        UnaryOp::Relu => (12, 0.0, 0.0),
        UnaryOp::LeakyRelu(s) => (13, s as f32, 0.0),
        UnaryOp::GeluErf => (14, 0.0, 0.0),
        UnaryOp::GeluTanh => (15, 0.0, 0.0),
        UnaryOp::Silu => (16, 0.0, 0.0),
        UnaryOp::Affine { mul, add } => (17, mul as f32, add as f32),
        UnaryOp::PowScalar(p) => (18, p as f32, 0.0),
        UnaryOp::ScalarPow(s) => (19, s as f32, 0.0),
        UnaryOp::MaxScalar(s) => (20, s as f32, 0.0),
        UnaryOp::MinScalar(s) => (21, s as f32, 0.0),
    }
}

pub(super) fn binary_code(op: BinaryOp) -> i32 {
    match op {
        BinaryOp::Add => 0,
        BinaryOp::Sub => 1,
        BinaryOp::Mul => 2,
        BinaryOp::Div => 3,
        BinaryOp::Pow => 4,
        BinaryOp::Max => 5,
        BinaryOp::Min => 6,
    }
}

fn cmp_code(op: CmpOp) -> i32 {
    match op {
        CmpOp::Eq => 0,
        CmpOp::Ne => 1,
        CmpOp::Lt => 2,
        CmpOp::Le => 3,
        CmpOp::Gt => 4,
        CmpOp::Ge => 5,
    }
}

/// `Err` naming `op` and both dtypes when they differ.
pub(crate) fn same_dtype(op: &'static str, a: &CudaStorage, b: &CudaStorage) -> Result<()> {
    crate::backend::same_dtypes(op, a.dtype(), b.dtype())
}

pub(crate) fn unary(x: &CudaStorage, l: &Layout, op: UnaryOp) -> Result<CudaStorage> {
    let t = float_kname("unary", x.dtype())?;
    let n = l.numel();
    let out = CudaStorage::alloc_on(x.rt(), x.dtype(), n)?;
    let ((code, a, b), dst, n64) = (unary_code(op), out.ptr(), n as i64);
    if l.is_contiguous() {
        let src = x.ptr_at(l.offset());
        launch!(
            bytes = 2 * elems(n, x.dtype());
            x,
            "elementwise",
            format!("unary_{t}"),
            // At least four elements a thread (one vector of f32, half of one of f16).
            grid(n.div_ceil(4)),
            &code,
            &a,
            &b,
            &src,
            &dst,
            &n64
        );
    } else {
        let (src, st) = (x.ptr(), Strided::new("unary", l)?);
        let name = format!("unary_strided_{t}");
        launch!(
            bytes = view_bytes(l, x.dtype()) + elems(n, x.dtype());
            x,
            "elementwise",
            name,
            grid(n),
            &code,
            &a,
            &b,
            &src,
            &st,
            &dst,
            &n64
        );
    }
    Ok(out)
}

pub(crate) fn unary_grad(
    x: &CudaStorage,
    lx: &Layout,
    g: &CudaStorage,
    lg: &Layout,
    op: UnaryOp,
) -> Result<CudaStorage> {
    same_dtype("unary_grad", x, g)?;
    let t = float_kname("unary_grad", x.dtype())?;
    let n = lx.numel();
    let out = CudaStorage::alloc_on(x.rt(), x.dtype(), n)?;
    let ((code, a, _), dst, n64) = (unary_code(op), out.ptr(), n as i64);
    let (xp, sx, gp, sg) = (
        x.ptr(),
        Strided::new("unary_grad", lx)?,
        g.ptr(),
        Strided::new("unary_grad", lg)?,
    );
    let name = format!("unary_grad_{t}");
    launch!(
        bytes = view_bytes(lx, x.dtype()) + view_bytes(lg, g.dtype()) + elems(n, x.dtype());
        x,
        "elementwise",
        name,
        grid(n),
        &code,
        &a,
        &xp,
        &sx,
        &gp,
        &sg,
        &dst,
        &n64
    );
    Ok(out)
}

pub(crate) fn binary(
    x: &CudaStorage,
    lx: &Layout,
    y: &CudaStorage,
    ly: &Layout,
    op: BinaryOp,
) -> Result<CudaStorage> {
    same_dtype("binary", x, y)?;
    if let DType::I64 | DType::U8 = x.dtype() {
        // Integer counters (a batch-norm's batches tracked) and masks stay on the device too,
        // with the CPU's integer arithmetic (truncated, saturated).
        let out = CudaStorage::alloc_on(x.rt(), x.dtype(), lx.numel())?;
        let name = format!("binary_strided_{}", kname("binary", x.dtype())?);
        strided_pair(x, lx, y, ly, binary_code(op), name, &out)?;
        return Ok(out);
    }
    let t = float_kname("binary", x.dtype())?;
    let n = lx.numel();
    let out = CudaStorage::alloc_on(x.rt(), x.dtype(), n)?;
    let (code, dst, n64) = (binary_code(op), out.ptr(), n as i64);
    if lx.is_contiguous() && ly.is_contiguous() {
        let (a, b) = (x.ptr_at(lx.offset()), y.ptr_at(ly.offset()));
        launch!(
            bytes = 3 * elems(n, x.dtype());
            x,
            "elementwise",
            format!("binary_{t}"),
            grid(n.div_ceil(4)),
            &code,
            &a,
            &b,
            &dst,
            &n64
        );
    } else {
        strided_pair(x, lx, y, ly, code, format!("binary_strided_{t}"), &out)?;
    }
    Ok(out)
}

pub(crate) fn cmp(
    x: &CudaStorage,
    lx: &Layout,
    y: &CudaStorage,
    ly: &Layout,
    op: CmpOp,
) -> Result<CudaStorage> {
    same_dtype("cmp", x, y)?;
    let t = kname("cmp", x.dtype())?;
    let out = CudaStorage::alloc_on(x.rt(), DType::U8, lx.numel())?;
    strided_pair(x, lx, y, ly, cmp_code(op), format!("cmp_{t}"), &out)?;
    Ok(out)
}

/// Launches a two-input kernel `name(op, x, lx, y, ly, out, n)` over strided views (the
/// `binary_strided_*` and `cmp_*` kernels).
fn strided_pair(
    x: &CudaStorage,
    lx: &Layout,
    y: &CudaStorage,
    ly: &Layout,
    code: i32,
    name: String,
    out: &CudaStorage,
) -> Result<()> {
    let n = lx.numel();
    let (dst, n64) = (out.ptr(), n as i64);
    let (a, sa) = (x.ptr(), Strided::new("binary", lx)?);
    let (b, sb) = (y.ptr(), Strided::new("binary", ly)?);
    let bytes = view_bytes(lx, x.dtype()) + view_bytes(ly, y.dtype()) + elems(n, out.dtype());
    launch!(
        bytes = bytes;
        x,
        "elementwise",
        name,
        grid(n),
        &code,
        &a,
        &sa,
        &b,
        &sb,
        &dst,
        &n64
    );
    Ok(())
}

pub(crate) fn where_cond(
    c: &CudaStorage,
    lc: &Layout,
    x: &CudaStorage,
    lx: &Layout,
    y: &CudaStorage,
    ly: &Layout,
) -> Result<CudaStorage> {
    if c.dtype() != DType::U8 {
        return Err(Error::DType {
            op: "where",
            dtype: c.dtype(),
            expected: "U8 (a mask)",
        });
    }
    same_dtype("where", x, y)?;
    let t = kname("where", x.dtype())?;
    let n = lx.numel();
    let out = CudaStorage::alloc_on(x.rt(), x.dtype(), n)?;
    let (dst, n64) = (out.ptr(), n as i64);
    let (m, sm) = (c.ptr(), Strided::new("where", lc)?);
    let (a, sa) = (x.ptr(), Strided::new("where", lx)?);
    let (b, sb) = (y.ptr(), Strided::new("where", ly)?);
    let name = format!("where_{t}");
    let bytes = view_bytes(lc, DType::U8)
        + view_bytes(lx, x.dtype())
        + view_bytes(ly, y.dtype())
        + elems(n, x.dtype());
    launch!(
        bytes = bytes;
        x,
        "elementwise",
        name,
        grid(n),
        &m,
        &sm,
        &a,
        &sa,
        &b,
        &sb,
        &dst,
        &n64
    );
    Ok(out)
}

/// One block of 256 threads per row (at most 65,535 blocks; the kernels loop over rows).
pub(crate) fn rows_grid(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.clamp(1, 65_535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The view with `last` moved to the end (the others in order), as a contiguous storage.
fn with_dims_last(x: &CudaStorage, l: &Layout, last: &[usize]) -> Result<CudaStorage> {
    let mut perm: Vec<usize> = (0..l.rank()).filter(|d| !last.contains(d)).collect();
    perm.extend_from_slice(last);
    x.copy_strided(&l.permute("reduce", &perm)?)
}

pub(crate) fn reduce(
    x: &CudaStorage,
    l: &Layout,
    dims: &[usize],
    op: ReduceOp,
) -> Result<CudaStorage> {
    if matches!(x.dtype(), DType::I64 | DType::U8) {
        return int_extreme(x, l, dims, op);
    }
    let t = float_kname("reduce", x.dtype())?;
    let (rows, cols) = rows_cols(l, dims);
    let dense = with_dims_last(x, l, dims)?;
    let (src, r64, c64) = (dense.ptr(), rows as i64, cols as i64);
    let code = match op {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 1,
        ReduceOp::Min => 2,
        ReduceOp::Mean => 3,
        ReduceOp::ArgMax | ReduceOp::ArgMin => {
            let sign: f32 = if op == ReduceOp::ArgMax { 1.0 } else { -1.0 };
            let out = CudaStorage::alloc_on(x.rt(), DType::I64, rows)?;
            let dst = out.ptr();
            let name = format!("argmax_rows_{t}");
            launch!(
                bytes = elems(rows * cols, x.dtype()) + elems(rows, DType::I64);
                x,
                "reduce",
                name,
                rows_grid(rows),
                &sign,
                &src,
                &dst,
                &r64,
                &c64
            );
            return Ok(out);
        }
    };
    let out = CudaStorage::alloc_on(x.rt(), x.dtype(), rows)?;
    let dst = out.ptr();
    let name = format!("reduce_rows_{t}");
    launch!(
        bytes = elems(rows * cols, x.dtype()) + elems(rows, x.dtype());
        x,
        "reduce",
        name,
        rows_grid(rows),
        &code,
        &src,
        &dst,
        &r64,
        &c64
    );
    Ok(out)
}

/// The rows' count and length of `dims` reduced in `l`: the kept dims' product, not numel /
/// cols (a sum over an empty dim still has one output per kept position).
fn rows_cols(l: &Layout, dims: &[usize]) -> (usize, usize) {
    let cols = dims.iter().map(|&d| l.shape()[d]).product();
    let rows = (0..l.rank())
        .filter(|d| !dims.contains(d))
        .map(|d| l.shape()[d])
        .product();
    (rows, cols)
}

/// Max, min, argmax or argmin of an integer tensor (compared exactly, as on the CPU); sums
/// of integers are not defined here (the ops reject them first).
fn int_extreme(x: &CudaStorage, l: &Layout, dims: &[usize], op: ReduceOp) -> Result<CudaStorage> {
    let t = kname("reduce", x.dtype())?;
    let (code, index) = match op {
        ReduceOp::Max => (1, false),
        ReduceOp::Min => (2, false),
        ReduceOp::ArgMax => (1, true),
        ReduceOp::ArgMin => (2, true),
        ReduceOp::Sum | ReduceOp::Mean => {
            return Err(Error::DType {
                op: "reduce",
                dtype: x.dtype(),
                expected: "f32, f16 or bf16 (integers: max, min, argmax, argmin)",
            })
        }
    };
    let (rows, cols) = rows_cols(l, dims);
    if cols == 0 && rows > 0 {
        return Err(Error::invalid("reduce", "an extreme of no elements"));
    }
    let out = match index {
        true => CudaStorage::alloc_on(x.rt(), DType::I64, rows)?,
        false => CudaStorage::alloc_on(x.rt(), x.dtype(), rows)?,
    };
    if rows == 0 {
        return Ok(out);
    }
    let dense = with_dims_last(x, l, dims)?;
    let (vals, args) = match index {
        true => (0u64, out.ptr()),
        false => (out.ptr(), 0u64),
    };
    let (src, r64, c64) = (dense.ptr(), rows as i64, cols as i64);
    launch!(
        x,
        "reduce",
        format!("extreme_rows_{t}"),
        rows_grid(rows),
        &code,
        &src,
        &vals,
        &args,
        &r64,
        &c64
    );
    Ok(out)
}

/// Softmax or log-softmax along `dim`, output contiguous in the view's shape.
pub(crate) fn softmax(x: &CudaStorage, l: &Layout, dim: usize, log: bool) -> Result<CudaStorage> {
    let t = float_kname("softmax", x.dtype())?;
    let cols = l.shape()[dim];
    let rows = l.numel() / cols.max(1);
    let dense = with_dims_last(x, l, &[dim])?;
    let out = CudaStorage::alloc_on(x.rt(), x.dtype(), l.numel())?;
    let (src, dst, r64, c64, lg) = (dense.ptr(), out.ptr(), rows as i64, cols as i64, log as i32);
    let name = format!("softmax_rows_{t}");
    launch!(
        x,
        "softmax_xent",
        name,
        rows_grid(rows),
        &src,
        &dst,
        &r64,
        &c64,
        &lg
    );
    if dim + 1 == l.rank() {
        return Ok(out);
    }
    // Back from [kept..., dim] to the view's order.
    let mut moved: Vec<usize> = (0..l.rank()).filter(|&d| d != dim).collect();
    moved.push(dim);
    let shape: Vec<usize> = moved.iter().map(|&d| l.shape()[d]).collect();
    let mut inverse = vec![0; l.rank()];
    for (i, &d) in moved.iter().enumerate() {
        inverse[d] = i;
    }
    out.copy_strided(&Layout::contiguous(&shape).permute("softmax", &inverse)?)
}

/// `n` dropout multipliers from the Philox stream (the CPU's definition, element for element).
pub(crate) fn dropout_mask(
    ordinal: usize,
    n: usize,
    threshold: u64,
    scale: f64,
    (seed, start): (u64, u64),
    dtype: DType,
) -> Result<CudaStorage> {
    let t = float_kname("dropout", dtype)?;
    let out = CudaStorage::alloc(ordinal, dtype, n)?;
    let (dst, n64, sc) = (out.ptr(), n as i64, scale as f32);
    let name = format!("dropout_mask_{t}");
    launch!(
        out,
        "random",
        name,
        grid(n.div_ceil(4)),
        &seed,
        &start,
        &threshold,
        &sc,
        &dst,
        &n64
    );
    Ok(out)
}

/// How cuBLAS reads one operand: its batch stride and, per matrix, whether it is stored
/// row-major (`false`) or as the transpose of a row-major matrix (`true`), with the leading
/// dimension.
pub(crate) struct Operand {
    pub(crate) ptr: u64,
    pub(crate) batch_stride: i64,
    pub(crate) transposed: bool,
    pub(crate) ld: i64,
}

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
fn readable<'a>(
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
    let done = super::blaslt::gemm_bias(
        a.rt(),
        a.dtype(),
        (m, n, k),
        (oa, ob),
        bias.ptr(),
        out.ptr(),
        relu,
    )?;
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
        DType::F32 if allow_tf32() => (
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
    let batch32 = int("batch", batch as i64)?;
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
    // Row-major C = A B is column-major C^T = B^T A^T: cuBLAS's first operand is b.
    // SAFETY: the pointers address `batch` matrices of the stated shapes and strides on this
    // device; the handle's stream is the runtime's stream.
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
                ob.ptr as *const _,
                ty,
                ldb,
                ob.batch_stride,
                oa.ptr as *const _,
                ty,
                lda,
                oa.batch_stride,
                &beta as *const f32 as *const _,
                c as *mut _,
                ty,
                ldc,
                (m * n) as i64,
                batch32,
                compute,
                bs::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        })?
        .map_err(|e| Error::CudaDriver {
            op: "cublasGemmStridedBatchedEx",
            device: a.device(),
            msg: format!("{e:?} ({m}x{k} @ {k}x{n}, batch {batch}, {:?})", a.dtype()),
        })?;
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
