//! Elementwise kernels over strided (and broadcast) inputs.

use super::{map_float, map_pair, CpuElem, CpuStorage, IntoStorage, CHUNK, PAR_MIN};
use crate::backend::ops::{BinaryOp, CmpOp, UnaryOp};
use crate::dtype::WithDType;
use crate::layout::Layout;
use crate::Result;
use rayon::prelude::*;

/// Runs `f(chunk_start, out_chunk)` over `out` in parallel chunks when it is large.
#[inline]
pub(crate) fn fill_chunks<U: Send>(out: &mut [U], f: impl Fn(usize, &mut [U]) + Sync) {
    if out.len() < PAR_MIN {
        f(0, out);
    } else {
        out.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(i, c)| f(i * CHUNK, c));
    }
}

/// `out[i] = f(src[layout[i]])`.
pub(crate) fn map1<T: Copy + Sync, U: WithDType>(
    src: &[T],
    l: &Layout,
    f: impl Fn(T) -> U + Sync,
) -> Vec<U> {
    let mut out = vec![U::zero(); l.numel()];
    match l.contiguous_range() {
        Some(r) => {
            let src = &src[r];
            fill_chunks(&mut out, |start, o| {
                let n = o.len();
                for (o, &x) in o.iter_mut().zip(&src[start..start + n]) {
                    *o = f(x);
                }
            })
        }
        None => fill_chunks(&mut out, |start, o| {
            let n = o.len();
            for (o, off) in o.iter_mut().zip(l.offsets_range(start, n)) {
                *o = f(src[off]);
            }
        }),
    }
    out
}

/// `out[i] = f(a[la[i]], b[lb[i]])`; `la` and `lb` have the same shape.
pub(crate) fn map2<A: Copy + Sync, B: Copy + Sync, U: WithDType>(
    a: &[A],
    la: &Layout,
    b: &[B],
    lb: &Layout,
    f: impl Fn(A, B) -> U + Sync,
) -> Vec<U> {
    debug_assert_eq!(la.shape(), lb.shape());
    let mut out = vec![U::zero(); la.numel()];
    match (la.contiguous_range(), lb.contiguous_range()) {
        (Some(ra), Some(rb)) => {
            let (a, b) = (&a[ra], &b[rb]);
            fill_chunks(&mut out, |s, o| {
                let n = o.len();
                for ((o, &x), &y) in o.iter_mut().zip(&a[s..s + n]).zip(&b[s..s + n]) {
                    *o = f(x, y);
                }
            })
        }
        (Some(ra), None) => {
            let a = &a[ra];
            fill_chunks(&mut out, |s, o| {
                let n = o.len();
                for ((o, &x), ob) in o.iter_mut().zip(&a[s..s + n]).zip(lb.offsets_range(s, n)) {
                    *o = f(x, b[ob]);
                }
            })
        }
        _ => fill_chunks(&mut out, |s, o| {
            let n = o.len();
            let offs = la.offsets_range(s, n).zip(lb.offsets_range(s, n));
            for (o, (oa, ob)) in o.iter_mut().zip(offs) {
                *o = f(a[oa], b[ob]);
            }
        }),
    }
    out
}

pub(crate) fn cast<S: WithDType, D: CpuElem>(v: &[S], l: &Layout) -> CpuStorage {
    // Through f64: exact for every source value, one correct rounding into the target.
    map1(v, l, |x| D::from_f64(x.to_f64())).into_storage()
}

/// Calls `$go` with the op made a compile-time constant for the parameterless variants, so the
/// per-element `match` folds away.
macro_rules! specialize_unary {
    ($op:expr, $go:ident) => {
        match $op {
            UnaryOp::Neg => $go(UnaryOp::Neg),
            UnaryOp::Abs => $go(UnaryOp::Abs),
            UnaryOp::Exp => $go(UnaryOp::Exp),
            UnaryOp::Log => $go(UnaryOp::Log),
            UnaryOp::Sqrt => $go(UnaryOp::Sqrt),
            UnaryOp::Tanh => $go(UnaryOp::Tanh),
            UnaryOp::Sigmoid => $go(UnaryOp::Sigmoid),
            UnaryOp::Relu => $go(UnaryOp::Relu),
            UnaryOp::GeluErf => $go(UnaryOp::GeluErf),
            UnaryOp::GeluTanh => $go(UnaryOp::GeluTanh),
            UnaryOp::Silu => $go(UnaryOp::Silu),
            op => $go(op),
        }
    };
}

/// `f(x)` elementwise, computed in the accumulation type.
pub(crate) fn unary(s: &CpuStorage, l: &Layout, op: UnaryOp) -> Result<CpuStorage> {
    fn go<T: CpuElem>(v: &[T], l: &Layout, op: UnaryOp) -> CpuStorage {
        let run = |op: UnaryOp| map1(v, l, move |x: T| T::from_acc(op.f(x.to_acc())));
        specialize_unary!(op, run).into_storage()
    }
    Ok(map_float!("unary", s, v => go(v, l, op)))
}

/// `g * f'(x)` elementwise: the backward of a unary op.
pub(crate) fn unary_grad(
    x: &CpuStorage,
    lx: &Layout,
    g: &CpuStorage,
    lg: &Layout,
    op: UnaryOp,
) -> Result<CpuStorage> {
    fn go<T: CpuElem>(x: &[T], lx: &Layout, g: &[T], lg: &Layout, op: UnaryOp) -> CpuStorage {
        let run = |op: UnaryOp| {
            map2(x, lx, g, lg, move |x: T, g: T| {
                T::from_acc(g.to_acc() * op.df(x.to_acc()))
            })
        };
        specialize_unary!(op, run).into_storage()
    }
    if !x.dtype().is_float() {
        return Err(crate::Error::DType {
            op: "unary_grad",
            dtype: x.dtype(),
            expected: "a float dtype",
        });
    }
    Ok(map_pair!("unary_grad", x, g, a, b => go(a, lx, b, lg, op)))
}

/// `a op b` elementwise over same-shape (already broadcast) layouts.
pub(crate) fn binary(
    a: &CpuStorage,
    la: &Layout,
    b: &CpuStorage,
    lb: &Layout,
    op: BinaryOp,
) -> Result<CpuStorage> {
    fn go<T: CpuElem>(a: &[T], la: &Layout, b: &[T], lb: &Layout, op: BinaryOp) -> CpuStorage {
        let run = |op: BinaryOp| {
            map2(a, la, b, lb, move |x: T, y: T| {
                T::from_acc(op.f(x.to_acc(), y.to_acc()))
            })
        };
        match op {
            BinaryOp::Add => run(BinaryOp::Add),
            BinaryOp::Sub => run(BinaryOp::Sub),
            BinaryOp::Mul => run(BinaryOp::Mul),
            BinaryOp::Div => run(BinaryOp::Div),
            op => run(op),
        }
        .into_storage()
    }
    Ok(map_pair!("binary", a, b, x, y => go(x, la, y, lb, op)))
}

/// `a op b` as a U8 mask.
pub(crate) fn cmp(
    a: &CpuStorage,
    la: &Layout,
    b: &CpuStorage,
    lb: &Layout,
    op: CmpOp,
) -> Result<CpuStorage> {
    fn go<T: CpuElem>(a: &[T], la: &Layout, b: &[T], lb: &Layout, op: CmpOp) -> CpuStorage {
        map2(a, la, b, lb, move |x: T, y: T| op.f(x, y) as u8).into_storage()
    }
    Ok(map_pair!("cmp", a, b, x, y => go(x, la, y, lb, op)))
}

/// `cond ? a : b` elementwise; all three layouts have the same shape.
pub(crate) fn where_cond(
    cond: &CpuStorage,
    lc: &Layout,
    a: &CpuStorage,
    la: &Layout,
    b: &CpuStorage,
    lb: &Layout,
) -> Result<CpuStorage> {
    let CpuStorage::U8(c) = cond else {
        return Err(crate::Error::DType {
            op: "where",
            dtype: cond.dtype(),
            expected: "U8 (a mask)",
        });
    };
    fn go<T: CpuElem>(
        c: &[u8],
        lc: &Layout,
        a: &[T],
        la: &Layout,
        b: &[T],
        lb: &Layout,
    ) -> CpuStorage {
        let mut out = vec![T::zero(); la.numel()];
        fill_chunks(&mut out, |s, o| {
            let n = o.len();
            let offs = lc
                .offsets_range(s, n)
                .zip(la.offsets_range(s, n))
                .zip(lb.offsets_range(s, n));
            for (o, ((oc, oa), ob)) in o.iter_mut().zip(offs) {
                *o = if c[oc] != 0 { a[oa] } else { b[ob] };
            }
        });
        out.into_storage()
    }
    Ok(map_pair!("where", a, b, x, y => go(c, lc, x, la, y, lb)))
}
