//! The fused optimizer kernel: one pass reads parameter (or f32 master), gradient and states,
//! and writes them in place (arithmetic in f32, or f64 for f64), and with master weights also
//! writes the f16/bf16 working copy, rounded to nearest or stochastically.

use super::{CpuElem, CpuStorage, PAR_MIN};
use crate::backend::ops::{OptimUpdate, Prepared, UpdateRule};
use crate::backend::rounding::{bf16_stochastic, stochastic_bits, stochastic_key, Rounding};
use crate::backend::Span;
use crate::dtype::Float as _;
use crate::{DType, Error, Result};
use half::{bf16, f16};
use rayon::prelude::*;

/// Elements per task; a multiple of 8 so stochastic-rounding blocks never straddle chunks.
const CHUNK: usize = 1 << 14;

/// `s` cut in chunks, or `chunks` empty pieces when `s` is empty.
fn pieces<T>(s: &mut [T], chunks: usize) -> Vec<&mut [T]> {
    if s.is_empty() {
        (0..chunks).map(|_| <&mut [T]>::default()).collect()
    } else {
        s.chunks_mut(CHUNK).collect()
    }
}

/// The working copy an update writes besides the f32 master.
enum Working<'a> {
    None,
    F16(&'a mut [f16]),
    BF16(&'a mut [bf16]),
    /// bf16 with stochastic rounding under a Philox key.
    BF16Stochastic(&'a mut [bf16], [u32; 2]),
}

impl<'a> Working<'a> {
    fn chunks(self, chunks: usize) -> Vec<Working<'a>> {
        match self {
            Working::None => (0..chunks).map(|_| Working::None).collect(),
            Working::F16(s) => s.chunks_mut(CHUNK).map(Working::F16).collect(),
            Working::BF16(s) => s.chunks_mut(CHUNK).map(Working::BF16).collect(),
            Working::BF16Stochastic(s, k) => s
                .chunks_mut(CHUNK)
                .map(|c| Working::BF16Stochastic(c, k))
                .collect(),
        }
    }

    /// Writes the rounded `src` (elements `start..` of the tensor) into this copy.
    fn write<T: CpuElem>(self, src: &[T], start: usize) {
        let f = |x: &T| x.to_acc().to_f64_() as f32;
        match self {
            Working::None => {}
            Working::F16(d) => d.iter_mut().zip(src).for_each(|(d, s)| {
                *d = f16::from_f32(f(s));
            }),
            Working::BF16(d) => d.iter_mut().zip(src).for_each(|(d, s)| {
                *d = bf16::from_f32(f(s));
            }),
            Working::BF16Stochastic(d, key) => {
                for (j, (d, s)) in d.chunks_mut(8).zip(src.chunks(8)).enumerate() {
                    let r = stochastic_bits(key, (start / 8 + j) as u64);
                    for ((d, s), r) in d.iter_mut().zip(s).zip(r) {
                        *d = bf16_stochastic(f(s), r);
                    }
                }
            }
        }
    }
}

/// One task: chunks of parameter, gradient, the states (empty when absent; present ones
/// come first) and working copy.
struct Job<'a, T, G> {
    start: usize,
    p: &'a mut [T],
    g: &'a [G],
    s: [&'a mut [T]; 3],
    w: Working<'a>,
}

/// The update loop for one rule with its first `N` states present (monomorphised per rule,
/// gradient type and state count, so the inner loops are branch-free).
fn update<const N: usize, T, G, R>(k: R, j: Job<T, G>)
where
    T: CpuElem,
    G: CpuElem<Acc = T::Acc>,
    R: UpdateRule<T::Acc>,
{
    let z = T::Acc::from_f64_(0.0);
    let Job { start, p, g, s, w } = j;
    let n = p.len();
    // Cut to the parameter's length: the indexing below needs no bounds checks.
    let mut s = s.map(|s| match s.is_empty() {
        true => s,
        false => &mut s[..n],
    });
    for (i, (p, &g)) in p.iter_mut().zip(&g[..n]).enumerate() {
        let (mut a, mut st) = (p.to_acc(), [z; 3]);
        for (v, s) in st.iter_mut().zip(&s).take(N) {
            *v = s[i].to_acc();
        }
        k.apply(&mut a, g.to_acc(), &mut st);
        *p = T::from_acc(a);
        for (v, s) in st.iter().zip(&mut s).take(N) {
            s[i] = T::from_acc(*v);
        }
    }
    w.write(&*p, start);
}

/// Cuts the slices in chunks and runs `f` on each (in parallel for large tensors).
fn for_chunks<'a, T: CpuElem, G: CpuElem>(
    p: &'a mut [T],
    g: &'a [G],
    s: [&'a mut [T]; 3],
    w: Working<'a>,
    f: impl Fn(Job<'a, T, G>) + Sync + Send,
) {
    let _iso = crate::parallel::Isolated::new();
    let n = p.len();
    let chunks = n.div_ceil(CHUNK);
    let [s0, s1, s2] = s;
    let pieces3 = pieces(s0, chunks)
        .into_iter()
        .zip(pieces(s1, chunks))
        .zip(pieces(s2, chunks))
        .map(|((a, b), c)| [a, b, c]);
    let jobs = p
        .chunks_mut(CHUNK)
        .zip(g.chunks(CHUNK))
        .zip(pieces3)
        .zip(w.chunks(chunks))
        .enumerate()
        .map(|(i, (((p, g), s), w))| Job {
            start: i * CHUNK,
            p,
            g,
            s,
            w,
        });
    if n < PAR_MIN {
        jobs.for_each(f);
    } else {
        jobs.collect::<Vec<_>>().into_par_iter().for_each(f);
    }
}

/// Runs rule `k` over the chunks with the first `present` states.
fn run_rule<'a, T, G, R>(
    k: R,
    present: usize,
    p: &'a mut [T],
    g: &'a [G],
    s: [&'a mut [T]; 3],
    w: Working<'a>,
) where
    T: CpuElem,
    G: CpuElem<Acc = T::Acc>,
    R: UpdateRule<T::Acc>,
{
    match present {
        0 => for_chunks(p, g, s, w, |j| update::<0, _, _, _>(k, j)),
        1 => for_chunks(p, g, s, w, |j| update::<1, _, _, _>(k, j)),
        2 => for_chunks(p, g, s, w, |j| update::<2, _, _, _>(k, j)),
        _ => for_chunks(p, g, s, w, |j| update::<3, _, _, _>(k, j)),
    }
}

fn run<T, G>(p: &mut [T], g: &[G], s: [&mut [T]; 3], w: Working, u: &OptimUpdate, steps: f64)
where
    T: CpuElem,
    G: CpuElem<Acc = T::Acc>,
{
    let present = s.iter().take_while(|s| !s.is_empty()).count();
    match u.prepare::<T::Acc>(steps) {
        Prepared::Sgd(k) => run_rule(k, present, p, g, s, w),
        Prepared::Adam(k) => run_rule(k, present, p, g, s, w),
        Prepared::Adadelta(k) => run_rule(k, present, p, g, s, w),
        Prepared::RmsProp(k) => run_rule(k, present, p, g, s, w),
        Prepared::Adagrad(k) => run_rule(k, present, p, g, s, w),
    }
}

/// Reads a one-element f32 storage.
fn scalar(s: &CpuStorage) -> Option<f32> {
    match s {
        CpuStorage::F32(v) if v.len() == 1 => Some(v[0]),
        _ => None,
    }
}

/// The state slices of one update (empty when absent), or `None` on a dtype mismatch or
/// more than three states.
fn state_slices<'a, T: CpuElem>(states: &'a mut [&mut CpuStorage]) -> Option<[&'a mut [T]; 3]> {
    if states.len() > 3 {
        return None;
    }
    let mut out: [&mut [T]; 3] = Default::default();
    for (o, s) in out.iter_mut().zip(states.iter_mut()) {
        *o = T::slice_mut(s)?;
    }
    Some(out)
}

/// Typed slices, length checks and the run; `None` when dtypes or lengths disagree.
fn typed<T, G>(
    p: &mut CpuStorage,
    g: Span<'_, CpuStorage>,
    states: &mut [&mut CpuStorage],
    w: Working,
    u: &OptimUpdate,
    steps: f64,
) -> Option<()>
where
    T: CpuElem,
    G: CpuElem<Acc = T::Acc>,
{
    let g = G::slice(g.storage)?.get(g.range)?;
    let p = T::slice_mut(p)?;
    let s = state_slices::<T>(states)?;
    let n = p.len();
    let fits = |l: usize| l == 0 || l == n;
    let wl = match &w {
        Working::None => n,
        Working::F16(s) => s.len(),
        Working::BF16(s) | Working::BF16Stochastic(s, _) => s.len(),
    };
    if g.len() != n || wl != n || !s.iter().all(|s| fits(s.len())) {
        return None;
    }
    run(p, g, s, w, u, steps);
    Some(())
}

/// The working-copy view of `w` for an update that has taken `steps` updates before.
fn working(w: Option<(&mut CpuStorage, Rounding)>, steps: u64) -> Result<Working<'_>> {
    Ok(match w {
        None => Working::None,
        Some((CpuStorage::F16(v), Rounding::Nearest)) => Working::F16(v),
        Some((CpuStorage::BF16(v), Rounding::Nearest)) => Working::BF16(v),
        Some((CpuStorage::BF16(v), Rounding::Stochastic { seed })) => {
            Working::BF16Stochastic(v, stochastic_key(seed, steps))
        }
        Some((s, r)) => {
            return Err(Error::invalid(
                "optimizer step",
                format!(
                    "a {:?} working copy cannot be written with {r:?} (f16 takes round to \
                     nearest, bf16 either rounding)",
                    s.dtype()
                ),
            ))
        }
    })
}

/// Applies `u` to a contiguous parameter with a contiguous gradient of the same length (a
/// range of its storage) and `u.num_states()` state buffers, then counts the step in `step`
/// (an f32 scalar). The gradient has the parameter's dtype, or f16/bf16 for an f32
/// parameter. With `work`, the parameter is an f32 master and the working copy is written
/// from it in the same pass.
/// When `found_inf` (an f32 scalar) is nonzero nothing changes at all: the skip is decided
/// here, where the flag lives, not by the caller.
pub(crate) fn optim_update(
    p: &mut CpuStorage,
    g: Span<'_, CpuStorage>,
    states: &mut [&mut CpuStorage],
    step: &mut CpuStorage,
    found_inf: Option<&CpuStorage>,
    u: &OptimUpdate,
    work: Option<(&mut CpuStorage, Rounding)>,
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
    let (dtype, gdtype, n) = (p.dtype(), g.storage.dtype(), p.len());
    if work.is_some() && dtype != DType::F32 {
        return Err(Error::invalid(
            "optimizer step",
            format!("a master weight must be F32, got {dtype:?}"),
        ));
    }
    let w = working(work, steps as u64)?;
    use DType::*;
    let ok = match (dtype, gdtype) {
        (F32, F32) => typed::<f32, f32>(p, g, states, w, u, steps),
        (F32, F16) => typed::<f32, f16>(p, g, states, w, u, steps),
        (F32, BF16) => typed::<f32, bf16>(p, g, states, w, u, steps),
        (F16, F16) => typed::<f16, f16>(p, g, states, w, u, steps),
        (BF16, BF16) => typed::<bf16, bf16>(p, g, states, w, u, steps),
        (F64, F64) => typed::<f64, f64>(p, g, states, w, u, steps),
        _ => None,
    };
    ok.ok_or_else(|| {
        Error::invalid(
            "optimizer step",
            format!(
                "parameter {dtype:?} with gradient {gdtype:?}: states must share the \
                 parameter's dtype, and everything its length {n}"
            ),
        )
    })?;
    if let CpuStorage::F32(v) = step {
        v[0] += 1.0;
    }
    Ok(())
}

/// Writes the f32 `master` into its working copy `dst` with `rounding`, with the stochastic
/// bits of the last update counted in `step` (an f32 scalar), as the update kernel did.
pub(crate) fn round_into(
    dst: &mut CpuStorage,
    master: &CpuStorage,
    rounding: Rounding,
    step: &CpuStorage,
) -> Result<()> {
    let _iso = crate::parallel::Isolated::new();
    let steps = scalar(step).ok_or_else(|| {
        Error::invalid(
            "round_into",
            "the step count must be a one-element F32 tensor",
        )
    })?;
    let steps = (steps as u64).saturating_sub(1);
    let n = dst.len();
    let Some(src) = f32::slice(master).filter(|s| s.len() == n) else {
        return Err(Error::invalid(
            "round_into",
            format!(
                "the master must be F32 of length {n}, got {:?} of length {}",
                master.dtype(),
                master.len()
            ),
        ));
    };
    let w = working(Some((dst, rounding)), steps)?;
    let chunks = n.div_ceil(CHUNK);
    let jobs = w.chunks(chunks).into_iter().enumerate();
    let f =
        |(i, w): (usize, Working)| w.write(&src[i * CHUNK..(i * CHUNK + CHUNK).min(n)], i * CHUNK);
    if n < PAR_MIN {
        jobs.for_each(f);
    } else {
        jobs.collect::<Vec<_>>().into_par_iter().for_each(f);
    }
    Ok(())
}
