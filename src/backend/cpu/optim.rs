//! The fused optimizer kernel: one pass reads parameter, gradient and states, and writes the
//! parameter and states in place (arithmetic in f32, or f64 for f64).

use super::{CpuElem, CpuStorage, PAR_MIN};
use crate::backend::ops::{OptimUpdate, Prepared, UpdateRule};
use crate::dtype::Float as _;
use crate::{Error, Result};
use rayon::prelude::*;

const CHUNK: usize = 1 << 14;

/// `s` cut in chunks, or `chunks` empty pieces when `s` is empty.
fn pieces<T>(s: &mut [T], chunks: usize) -> Vec<&mut [T]> {
    if s.is_empty() {
        (0..chunks).map(|_| <&mut [T]>::default()).collect()
    } else {
        s.chunks_mut(CHUNK).collect()
    }
}

/// One chunk of each of parameter, gradient, state 0 and state 1.
type Pieces<'a, T> = (((&'a mut [T], &'a [T]), &'a mut [T]), &'a mut [T]);

/// Runs `f(p, g, s0, s1)` over chunks of the four slices (missing states are empty).
fn chunked<T: CpuElem>(
    p: &mut [T],
    g: &[T],
    s0: &mut [T],
    s1: &mut [T],
    f: impl Fn(&mut [T], &[T], &mut [T], &mut [T]) + Sync,
) {
    let chunks = p.len().div_ceil(CHUNK);
    let (v0, v1) = (pieces(s0, chunks), pieces(s1, chunks));
    let body = |(((p, g), s0), s1): Pieces<T>| f(p, g, s0, s1);
    if p.len() < PAR_MIN {
        p.chunks_mut(CHUNK)
            .zip(g.chunks(CHUNK))
            .zip(v0)
            .zip(v1)
            .for_each(body);
    } else {
        p.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .zip(v0.into_par_iter())
            .zip(v1.into_par_iter())
            .for_each(body);
    }
}

/// The update loop for one rule, written once per state count (monomorphised per rule, so
/// the inner loops are branch-free).
fn go<T: CpuElem, R: UpdateRule<T::Acc>>(k: R, p: &mut [T], g: &[T], s0: &mut [T], s1: &mut [T]) {
    let z = T::Acc::from_f64_(0.0);
    match (s0.is_empty(), s1.is_empty()) {
        (true, _) => chunked(p, g, s0, s1, |p, g, _, _| {
            for (p, &g) in p.iter_mut().zip(g) {
                let (mut a, mut st) = (p.to_acc(), [z, z]);
                k.apply(&mut a, g.to_acc(), &mut st);
                *p = T::from_acc(a);
            }
        }),
        (false, true) => chunked(p, g, s0, s1, |p, g, s0, _| {
            for ((p, &g), s0) in p.iter_mut().zip(g).zip(s0) {
                let (mut a, mut st) = (p.to_acc(), [s0.to_acc(), z]);
                k.apply(&mut a, g.to_acc(), &mut st);
                *p = T::from_acc(a);
                *s0 = T::from_acc(st[0]);
            }
        }),
        (false, false) => chunked(p, g, s0, s1, |p, g, s0, s1| {
            for (((p, &g), s0), s1) in p.iter_mut().zip(g).zip(s0).zip(s1) {
                let (mut a, mut st) = (p.to_acc(), [s0.to_acc(), s1.to_acc()]);
                k.apply(&mut a, g.to_acc(), &mut st);
                *p = T::from_acc(a);
                *s0 = T::from_acc(st[0]);
                *s1 = T::from_acc(st[1]);
            }
        }),
    }
}

fn run<T: CpuElem>(p: &mut [T], g: &[T], s0: &mut [T], s1: &mut [T], u: &OptimUpdate) {
    match u.prepare::<T::Acc>() {
        Prepared::Sgd(k) => go(k, p, g, s0, s1),
        Prepared::Adam(k) => go(k, p, g, s0, s1),
        Prepared::Adadelta(k) => go(k, p, g, s0, s1),
    }
}

/// Applies `u` to a contiguous parameter with a contiguous gradient of the same dtype and
/// length, and `u.num_states()` state buffers.
pub(crate) fn optim_update(
    p: &mut CpuStorage,
    g: &CpuStorage,
    states: &mut [&mut CpuStorage],
    u: &OptimUpdate,
) -> Result<()> {
    fn go<T: CpuElem>(
        p: &mut CpuStorage,
        g: &CpuStorage,
        states: &mut [&mut CpuStorage],
        u: &OptimUpdate,
    ) -> Option<()> {
        let g = T::slice(g)?;
        let p = T::slice_mut(p)?;
        let mut it = states.iter_mut();
        let s0: &mut [T] = match it.next() {
            Some(s) => T::slice_mut(s)?,
            None => &mut [],
        };
        let s1: &mut [T] = match it.next() {
            Some(s) => T::slice_mut(s)?,
            None => &mut [],
        };
        let n = p.len();
        if g.len() != n || (!s0.is_empty() && s0.len() != n) || (!s1.is_empty() && s1.len() != n) {
            return None;
        }
        run(p, g, s0, s1, u);
        Some(())
    }
    let dtype = p.dtype();
    let ok = match dtype {
        crate::DType::F32 => go::<f32>(p, g, states, u),
        crate::DType::F16 => go::<half::f16>(p, g, states, u),
        crate::DType::BF16 => go::<half::bf16>(p, g, states, u),
        crate::DType::F64 => go::<f64>(p, g, states, u),
        _ => None,
    };
    ok.ok_or_else(|| {
        Error::invalid(
            "optimizer step",
            format!(
                "parameter, gradient and states must share dtype {dtype:?} and length {}",
                p.len()
            ),
        )
    })
}
