//! The fused optimizer kernel: one pass reads parameter, gradient and states, and writes the
//! parameter and states in place (arithmetic in f32, or f64 for f64).

use super::{CpuElem, CpuStorage, PAR_MIN};
use crate::backend::ops::OptimUpdate;
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

fn run<T: CpuElem>(p: &mut [T], g: &[T], s0: &mut [T], s1: &mut [T], u: &OptimUpdate) {
    let body = |(((p, g), s0), s1): Pieces<T>| {
        let zero = T::Acc::from_f64_(0.0);
        for i in 0..p.len() {
            let mut acc = p[i].to_acc();
            let mut st = [
                s0.get(i).map_or(zero, |v| v.to_acc()),
                s1.get(i).map_or(zero, |v| v.to_acc()),
            ];
            u.apply(&mut acc, g[i].to_acc(), &mut st);
            p[i] = T::from_acc(acc);
            if let Some(v) = s0.get_mut(i) {
                *v = T::from_acc(st[0]);
            }
            if let Some(v) = s1.get_mut(i) {
                *v = T::from_acc(st[1]);
            }
        }
    };
    // A missing state is an empty slice; every chunk of it is empty too.
    let chunks = p.len().div_ceil(CHUNK);
    let (v0, v1) = (pieces(s0, chunks), pieces(s1, chunks));
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

use crate::dtype::Float as _;

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
