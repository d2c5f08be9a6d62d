//! Argsort along the last dim: each row's indices in a stable order (ties in index order),
//! NaN after every number ascending and before every number descending, as PyTorch's
//! `torch.sort(stable=True)`. `cuda/sort.cu` sorts by the same order.

use super::{contiguous, host_can_hold, map_all, CpuElem, CpuStorage, IntoStorage, PAR_MIN};
use crate::layout::Layout;
use crate::{DType, Result};
use rayon::prelude::*;
use std::cmp::Ordering;

/// The order of `a` and `b` in an ascending (or `descending`) sort, NaN counted as larger
/// than every number (a NaN is told by comparing unordered with itself; -0 equals +0).
pub(crate) fn sort_order<T: PartialOrd>(a: &T, b: &T, descending: bool) -> Ordering {
    let (a_nan, b_nan) = (a.partial_cmp(a).is_none(), b.partial_cmp(b).is_none());
    let up = match (a_nan, b_nan) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Greater,
        (false, true) => Ordering::Less,
        (false, false) => a.partial_cmp(b).unwrap_or(Ordering::Equal),
    };
    match descending {
        true => up.reverse(),
        false => up,
    }
}

fn argsort_rows<T: CpuElem>(v: &[T], l: &Layout, descending: bool) -> Vec<i64> {
    let n = l.shape().last().copied().unwrap_or(1);
    let x = contiguous(v, l);
    let mut out = vec![0i64; l.numel()];
    if n == 0 {
        return out;
    }
    let sort_row = |(row, idx): (&[T], &mut [i64])| {
        let mut order: Vec<usize> = (0..n).collect();
        // A stable sort: equal elements keep their index order.
        order.sort_by(|&i, &j| sort_order(&row[i], &row[j], descending));
        for (o, i) in idx.iter_mut().zip(order) {
            *o = i as i64;
        }
    };
    let rows = x.chunks(n).zip(out.chunks_mut(n));
    if l.numel() >= PAR_MIN {
        rows.collect::<Vec<_>>().into_par_iter().for_each(sort_row);
    } else {
        rows.for_each(sort_row);
    }
    out
}

/// The indices (I64, contiguous in the view's shape) that sort each row of the view `l`
/// along its last dim.
pub(crate) fn argsort(s: &CpuStorage, l: &Layout, descending: bool) -> Result<CpuStorage> {
    host_can_hold(l.numel(), DType::I64)?;
    Ok(map_all!(s, v => argsort_rows(v, l, descending).into_storage()))
}
