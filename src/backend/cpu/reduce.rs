//! Reductions over any set of dims of a strided tensor, accumulating in f32 (f64 for f64).

use super::{map_all, CpuElem, CpuStorage, IntoStorage, CHUNK, PAR_MIN};
use crate::backend::ops::ReduceOp;
use crate::dtype::{Float, WithDType};
use crate::layout::Layout;
use crate::Result;
use num_traits::{Float as _, Zero};
use rayon::prelude::*;

/// Partial result of a reduction: the value and, for arg-reductions, its index.
#[derive(Clone, Copy)]
struct Acc<A> {
    v: A,
    i: usize,
}

fn better<A: Float>(op: ReduceOp, x: A, best: A) -> bool {
    if best.is_nan() {
        return false;
    }
    x.is_nan()
        || match op {
            ReduceOp::Max | ReduceOp::ArgMax => x > best,
            _ => x < best,
        }
}

fn fold<T: WithDType>(
    op: ReduceOp,
    v: &[T],
    offs: impl Iterator<Item = usize>,
    base: usize,
) -> Acc<T::Acc> {
    match op {
        ReduceOp::Sum | ReduceOp::Mean => {
            // Neumaier-compensated sum: the error stays at a few ulps however long the row,
            // even for the worst case of many equal values.
            let (mut sum, mut comp) = (T::Acc::zero(), T::Acc::zero());
            for o in offs {
                let x = v[o].to_acc();
                let t = sum + x;
                comp += if sum.abs() >= x.abs() {
                    (sum - t) + x
                } else {
                    (x - t) + sum
                };
                sum = t;
            }
            Acc {
                v: sum + comp,
                i: 0,
            }
        }
        _ => {
            let mut best = Acc {
                v: <T::Acc as num_traits::Float>::nan(),
                i: usize::MAX,
            };
            for (k, o) in offs.enumerate() {
                let x = v[o].to_acc();
                if best.i == usize::MAX || better(op, x, best.v) {
                    best = Acc { v: x, i: base + k };
                }
            }
            best
        }
    }
}

fn combine<A: Float>(op: ReduceOp, a: Acc<A>, b: Acc<A>) -> Acc<A> {
    match op {
        ReduceOp::Sum | ReduceOp::Mean => Acc { v: a.v + b.v, i: 0 },
        _ if a.i == usize::MAX => b,
        _ if b.i == usize::MAX => a,
        // Chunks are combined in order, so on ties the earlier index wins.
        _ if better(op, b.v, a.v) => b,
        _ => a,
    }
}

/// Reduces `dims` (sorted, unique) of the tensor under `l`. The result is contiguous with the
/// reduced dims kept as size 1; `ArgMax`/`ArgMin` give I64 indices into the flattened reduced
/// dims, the others keep the dtype.
pub(crate) fn reduce(
    s: &CpuStorage,
    l: &Layout,
    dims: &[usize],
    op: ReduceOp,
) -> Result<CpuStorage> {
    let kept: Vec<usize> = (0..l.rank()).filter(|d| !dims.contains(d)).collect();
    let perm: Vec<usize> = kept.iter().chain(dims).copied().collect();
    let pl = l.permute("reduce", &perm)?;
    let r: usize = dims.iter().map(|&d| l.shape()[d]).product();
    let o: usize = kept.iter().map(|&d| l.shape()[d]).product();

    fn go<T: CpuElem>(v: &[T], pl: &Layout, o: usize, r: usize, op: ReduceOp) -> CpuStorage {
        let one = |row: usize| -> Acc<T::Acc> {
            if o == 1 && r >= PAR_MIN {
                (0..r.div_ceil(CHUNK))
                    .into_par_iter()
                    .map(|c| {
                        let n = CHUNK.min(r - c * CHUNK);
                        fold(op, v, pl.offsets_range(c * CHUNK, n), c * CHUNK)
                    })
                    .collect::<Vec<_>>()
                    .into_iter()
                    .reduce(|a, b| combine(op, a, b))
                    .unwrap_or(Acc {
                        v: T::Acc::zero(),
                        i: 0,
                    })
            } else {
                fold(op, v, pl.offsets_range(row * r, r), 0)
            }
        };
        let rows: Vec<Acc<T::Acc>> = if o * r >= PAR_MIN && o > 1 {
            (0..o).into_par_iter().map(one).collect()
        } else {
            (0..o).map(one).collect()
        };
        match op {
            ReduceOp::ArgMax | ReduceOp::ArgMin => rows
                .into_iter()
                .map(|a| a.i as i64)
                .collect::<Vec<i64>>()
                .into_storage(),
            ReduceOp::Mean => {
                let n = <T::Acc as Float>::from_f64_(r as f64);
                rows.into_iter()
                    .map(|a| T::from_acc(a.v / n))
                    .collect::<Vec<T>>()
                    .into_storage()
            }
            _ => rows
                .into_iter()
                .map(|a| T::from_acc(a.v))
                .collect::<Vec<T>>()
                .into_storage(),
        }
    }
    Ok(map_all!(s, v => go(v, &pl, o, r, op)))
}
