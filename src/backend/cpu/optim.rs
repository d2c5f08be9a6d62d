//! The fused optimizer kernel: one pass reads parameter, gradient and states, and writes the
//! parameter and states in place (arithmetic in f32, or f64 for f64).

use super::{CpuElem, CpuStorage, PAR_MIN};
use crate::backend::ops::{OptimUpdate, Prepared, UpdateRule};
use crate::dtype::Float as _;
use crate::{DType, Error, Result};
use half::{bf16, f16};
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

fn run<T: CpuElem>(p: &mut [T], g: &[T], s0: &mut [T], s1: &mut [T], u: &OptimUpdate, steps: f64) {
    match u.prepare::<T::Acc>(steps) {
        Prepared::Sgd(k) => go(k, p, g, s0, s1),
        Prepared::Adam(k) => go(k, p, g, s0, s1),
        Prepared::Adadelta(k) => go(k, p, g, s0, s1),
    }
}

/// Reads a one-element f32 storage.
fn scalar(s: &CpuStorage) -> Option<f32> {
    match s {
        CpuStorage::F32(v) if v.len() == 1 => Some(v[0]),
        _ => None,
    }
}

/// Parameter, gradient and the two state slices of one update.
type Slices<'a, T> = (&'a mut [T], &'a [T], &'a mut [T], &'a mut [T]);

/// The typed slices of one update, or `None` when dtypes or lengths disagree.
fn typed<'a, T: CpuElem>(
    p: &'a mut CpuStorage,
    g: &'a CpuStorage,
    states: &'a mut [&mut CpuStorage],
) -> Option<Slices<'a, T>> {
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
    let fits = |s: &[T]| s.is_empty() || s.len() == n;
    (g.len() == n && fits(s0) && fits(s1)).then_some((p, g, s0, s1))
}

/// Applies `u` to a contiguous parameter with a contiguous gradient of the same dtype and
/// length and `u.num_states()` state buffers, then counts the step in `step` (an f32 scalar).
/// When `found_inf` (an f32 scalar) is nonzero nothing changes at all: the skip is decided
/// here, where the flag lives, not by the caller.
pub(crate) fn optim_update(
    p: &mut CpuStorage,
    g: &CpuStorage,
    states: &mut [&mut CpuStorage],
    step: &mut CpuStorage,
    found_inf: Option<&CpuStorage>,
    u: &OptimUpdate,
) -> Result<()> {
    let bad = |what: &str| {
        Error::invalid(
            "optimizer step",
            format!("{what} must be a one-element F32 tensor"),
        )
    };
    if let Some(f) = found_inf {
        if scalar(f).ok_or_else(|| bad("found_inf"))? != 0.0 {
            return Ok(());
        }
    }
    let steps = scalar(step).ok_or_else(|| bad("the step count"))? as f64;
    let (dtype, n) = (p.dtype(), p.len());
    let ok = match dtype {
        DType::F32 => typed::<f32>(p, g, states).map(|(p, g, a, b)| run(p, g, a, b, u, steps)),
        DType::F16 => typed::<f16>(p, g, states).map(|(p, g, a, b)| run(p, g, a, b, u, steps)),
        DType::BF16 => typed::<bf16>(p, g, states).map(|(p, g, a, b)| run(p, g, a, b, u, steps)),
        DType::F64 => typed::<f64>(p, g, states).map(|(p, g, a, b)| run(p, g, a, b, u, steps)),
        _ => None,
    };
    ok.ok_or_else(|| {
        Error::invalid(
            "optimizer step",
            format!("parameter, gradient and states must share dtype {dtype:?} and length {n}"),
        )
    })?;
    if let CpuStorage::F32(v) = step {
        v[0] += 1.0;
    }
    Ok(())
}
