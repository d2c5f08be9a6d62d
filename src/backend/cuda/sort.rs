//! Launchers of `cuda/sort.cu`: argsort along the last dim. A row of up to 2,048 elements
//! sorts in shared memory, one block per row (one launch); a longer row is padded to a power
//! of two `p` in a global workspace (a key and an index per place) and sorted by one launch
//! per stage of the bitonic network, `log2(p) (log2(p) + 1) / 2` of them.

use super::kernels::KernelFile;
use super::storage::{grid, kname, rows_grid, CudaStorage};
use crate::layout::Layout;
use crate::{DType, Error, Result};
use cudarc::driver::PushKernelArg;

/// The longest row sorted in shared memory (`SORT_SHARED` in `cuda/sort.cu`).
const SHARED: usize = 2048;

/// The indices (I64, contiguous in the view's shape) that sort each row of the view `l`
/// along its last dim; see `ReduceOps::argsort`.
pub(crate) fn argsort(x: &CudaStorage, l: &Layout, descending: bool) -> Result<CudaStorage> {
    let t = kname("argsort", x.dtype())?;
    let n = l.shape().last().copied().unwrap_or(1);
    let total = l.numel();
    let out = CudaStorage::alloc_on(x.rt(), DType::I64, total)?;
    if total == 0 {
        return Ok(out);
    }
    let rows = total / n;
    let dense = x.contiguous(l)?;
    let np2 = n.checked_next_power_of_two().ok_or_else(|| too_long(l))?;
    let (xp, r64, n64, p64, desc) = (
        dense.ptr(),
        rows as i64,
        n as i64,
        np2 as i64,
        descending as i32,
    );
    if np2 <= SHARED {
        let op_ = out.ptr();
        launch!(
            x,
            KernelFile::Sort,
            kname!("argsort_rows_", t),
            rows_grid(rows),
            &xp,
            &op_,
            &r64,
            &n64,
            &p64,
            &desc
        );
        return Ok(out);
    }
    // The workspace: a key (f32 for the float dtypes, i64 for the integers) and an index per
    // padded place.
    let places = rows.checked_mul(np2).ok_or_else(|| too_long(l))?;
    let (key_dtype, k) = match x.dtype() {
        DType::I64 | DType::U8 => (DType::I64, "i64"),
        _ => (DType::F32, "float"),
    };
    let keys = CudaStorage::alloc_on(x.rt(), key_dtype, places)?;
    let ids = CudaStorage::alloc_on(x.rt(), DType::I64, places)?;
    let (kp, ip) = (keys.ptr(), ids.ptr());
    launch!(
        x,
        KernelFile::Sort,
        kname!("argsort_init_", t),
        grid(places),
        &xp,
        &kp,
        &ip,
        &r64,
        &n64,
        &p64
    );
    let mut stage = 2;
    while stage <= np2 {
        let mut j = stage / 2;
        while j > 0 {
            let (j64, s64) = (j as i64, stage as i64);
            launch!(
                x,
                KernelFile::Sort,
                kname!("argsort_step_", k),
                grid(places / 2),
                &kp,
                &ip,
                &r64,
                &n64,
                &p64,
                &j64,
                &s64,
                &desc
            );
            j /= 2;
        }
        stage *= 2;
    }
    // The first n places of each padded row.
    ids.copy_strided(&Layout::new(vec![rows, n], vec![np2, 1], 0))
}

fn too_long(l: &Layout) -> Error {
    Error::too_large(
        "argsort",
        l.shape(),
        "the rows padded to a power of two do not fit in memory",
    )
}
