//! Matrix products through the `gemm` crate. Half inputs are widened to f32 so the products
//! accumulate in f32 and round once on store, as tensor cores do.

use super::{CpuStorage, IntoStorage};
use crate::dtype::WithDType;
use crate::layout::Layout;
use crate::{Error, Result};
use rayon::prelude::*;

/// A strided matrix inside a slice.
#[derive(Clone, Copy)]
pub(crate) struct MatRef<'a, F> {
    pub data: &'a [F],
    pub off: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<F> MatRef<'_, F> {
    fn check(&self, rows: usize, cols: usize) {
        if rows > 0 && cols > 0 {
            let last = self.off + (rows - 1) * self.rs + (cols - 1) * self.cs;
            assert!(last < self.data.len(), "gemm operand out of bounds");
        }
    }
}

/// Floats `gemm` multiplies natively.
pub(crate) trait GemmFloat: WithDType + std::ops::AddAssign {}
impl GemmFloat for f32 {}
impl GemmFloat for f64 {}

/// `dst (m x n, row-major) = a (m x k) * b (k x n)`, or `+=` when `accumulate`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_into<F: GemmFloat>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [F],
    accumulate: bool,
    a: MatRef<F>,
    b: MatRef<F>,
    parallel: bool,
) {
    assert!(dst.len() >= m * n, "gemm destination too small");
    a.check(m, k);
    b.check(k, n);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst[..m * n].fill(F::zero());
        }
        return;
    }
    let par = if parallel && m * n * k >= 48 * 48 * 48 {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the bounds of all three operands were checked above; dst is exclusively borrowed.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.data.as_ptr().add(a.off),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr().add(b.off),
            b.cs as isize,
            b.rs as isize,
            F::from_f64(1.0),
            F::from_f64(1.0),
            false,
            false,
            false,
            par,
        )
    }
}

fn batched<F: GemmFloat>(a: &[F], la: &Layout, b: &[F], lb: &Layout) -> Vec<F> {
    let r = la.rank();
    let (m, k, n) = (la.shape()[r - 2], la.shape()[r - 1], lb.shape()[r - 1]);
    let batch_shape = &la.shape()[..r - 2];
    let boffs = |l: &Layout| -> Vec<usize> {
        Layout::new(
            batch_shape.to_vec(),
            l.strides()[..r - 2].to_vec(),
            l.offset(),
        )
        .offsets()
        .collect()
    };
    let (oa, ob) = (boffs(la), boffs(lb));
    let (sa, sb) = (la.strides(), lb.strides());
    let mut out = super::overwritten_buffer(oa.len() * m * n);
    let job = |(i, dst): (usize, &mut [F]), parallel: bool| {
        let ma = MatRef {
            data: a,
            off: oa[i],
            rs: sa[r - 2],
            cs: sa[r - 1],
        };
        let mb = MatRef {
            data: b,
            off: ob[i],
            rs: sb[r - 2],
            cs: sb[r - 1],
        };
        gemm_into(m, n, k, dst, false, ma, mb, parallel);
    };
    if m * n == 0 {
        return out;
    }
    let small = m * n * k < 128 * 128 * 128;
    if oa.len() > 1 && small {
        out.par_chunks_mut(m * n)
            .enumerate()
            .for_each(|c| job(c, false));
    } else {
        out.chunks_mut(m * n).enumerate().for_each(|c| job(c, true));
    }
    out
}

/// Batched product of `[..., m, k]` and `[..., k, n]` layouts with equal batch dims (stride 0
/// for broadcast batches allowed). Output is contiguous `[..., m, n]`.
pub(crate) fn matmul(
    a: &CpuStorage,
    la: &Layout,
    b: &CpuStorage,
    lb: &Layout,
) -> Result<CpuStorage> {
    Ok(match (a, b) {
        (CpuStorage::F32(x), CpuStorage::F32(y)) => batched(x, la, y, lb).into_storage(),
        (CpuStorage::F64(x), CpuStorage::F64(y)) => batched(x, la, y, lb).into_storage(),
        (x, y) if x.dtype() == y.dtype() && x.dtype().is_half() => {
            let wide = |s: &CpuStorage, l: &Layout| match s.to_dtype(l, crate::DType::F32) {
                CpuStorage::F32(v) => v,
                _ => unreachable!("to_dtype(F32) gives F32"),
            };
            let (xa, xb) = (wide(x, la), wide(y, lb));
            let (ca, cb) = (
                Layout::contiguous(la.shape()),
                Layout::contiguous(lb.shape()),
            );
            let out = CpuStorage::F32(batched(&xa, &ca, &xb, &cb));
            out.to_dtype(&Layout::contiguous(&[out.len()]), x.dtype())
        }
        (x, y) if x.dtype() != y.dtype() => {
            return Err(Error::DTypeMismatch {
                op: "matmul",
                lhs: x.dtype(),
                rhs: y.dtype(),
            })
        }
        (x, _) => {
            return Err(Error::DType {
                op: "matmul",
                dtype: x.dtype(),
                expected: "a float dtype",
            })
        }
    })
}
