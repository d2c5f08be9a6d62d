//! Fused attention without a mask or dropout on the CPU (`cuda/attention.cu` computes the
//! same): per query, the scores against every key it sees, their softmax and the weighted
//! sum of the values, one row at a time (the `[l, s]` scores are never stored); backward
//! recomputes the probabilities from each query's log-sum-exp. f32 arithmetic for
//! f32/f16/bf16 inputs (converted once), f64 for f64.

use super::{host_can_hold, CpuStorage, PAR_MIN};
use crate::backend::AttnDims;
use crate::layout::Layout;
use crate::{DType, Error, Result};
use rayon::prelude::*;

/// The view as contiguous f32 values (f64 is refused: the op layer composes it).
fn floats(s: &CpuStorage, l: &Layout) -> Result<Vec<f32>> {
    match s.dtype() {
        DType::F32 | DType::F16 | DType::BF16 => match s.to_dtype(l, DType::F32) {
            CpuStorage::F32(v) => Ok(v),
            _ => unreachable!("converted to f32"),
        },
        dtype => Err(Error::DType {
            op: "scaled_dot_product_attention",
            dtype,
            expected: "f32, f16 or bf16",
        }),
    }
}

/// `v` (f32) in `dtype`.
fn back_to(v: Vec<f32>, dtype: DType) -> CpuStorage {
    let n = v.len();
    CpuStorage::F32(v).to_dtype(&Layout::contiguous(&[n]), dtype)
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The keys query `i` sees: `0..=i` when causal, else all `s`.
fn seen(d: &AttnDims, i: usize) -> usize {
    match d.causal {
        true => (i + 1).min(d.s),
        false => d.s,
    }
}

/// Runs `f` on each of `out`'s chunks of `width` with its index, in parallel when large.
fn rows<T: Send>(out: &mut [T], width: usize, work: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    if width == 0 {
        return;
    }
    match work >= PAR_MIN {
        true => out
            .par_chunks_mut(width)
            .enumerate()
            .for_each(|(r, o)| f(r, o)),
        false => out.chunks_mut(width).enumerate().for_each(|(r, o)| f(r, o)),
    }
}

pub(crate) fn attention(
    q: &CpuStorage,
    lq: &Layout,
    (k, lk): (&CpuStorage, &Layout),
    (v, lv): (&CpuStorage, &Layout),
    d: AttnDims,
) -> Result<((CpuStorage, Layout), CpuStorage)> {
    // The output rows with their log-sum-exp (checked against the host's limit first).
    let rows_out = d.b.checked_mul(d.l).and_then(|n| n.checked_mul(d.ev + 1));
    host_can_hold(rows_out.unwrap_or(usize::MAX), DType::F32)?;
    let (qf, kf, vf) = (floats(q, lq)?, floats(k, lk)?, floats(v, lv)?);
    let (e, ev, scale) = (d.e, d.ev, d.scale as f32);
    let work =
        d.b.saturating_mul(d.l)
            .saturating_mul(d.s)
            .saturating_mul(e + ev);
    // Each output row with its log-sum-exp after it.
    let mut out = vec![0f32; d.b * d.l * (ev + 1)];
    rows(&mut out, ev + 1, work, |row, o| {
        let (b, i) = (row / d.l, row % d.l);
        let qi = &qf[row * e..(row + 1) * e];
        let scores: Vec<f32> = (0..seen(&d, i))
            .map(|j| dot(qi, &kf[(b * d.s + j) * e..][..e]) * scale)
            .collect();
        let m = scores.iter().fold(f32::NEG_INFINITY, |a, &s| a.max(s));
        let mut sum = 0.0;
        for (j, s) in scores.iter().enumerate() {
            let p = (s - m).exp();
            sum += p;
            for (acc, x) in o[..ev].iter_mut().zip(&vf[(b * d.s + j) * ev..][..ev]) {
                *acc += p * x;
            }
        }
        o[..ev].iter_mut().for_each(|x| *x /= sum);
        o[ev] = m + sum.ln();
    });
    let lse: Vec<f32> = out.chunks(ev + 1).map(|r| r[ev]).collect();
    let o: Vec<f32> = out.chunks(ev + 1).flat_map(|r| r[..ev].to_vec()).collect();
    Ok((
        (back_to(o, q.dtype()), d.out_layout(lq)),
        CpuStorage::F32(lse),
    ))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_backward(
    q: &CpuStorage,
    lq: &Layout,
    (k, lk): (&CpuStorage, &Layout),
    (v, lv): (&CpuStorage, &Layout),
    (o, lo): (&CpuStorage, &Layout),
    lse: &CpuStorage,
    (g, lg): (&CpuStorage, &Layout),
    d: AttnDims,
) -> Result<[(CpuStorage, Layout); 3]> {
    // dk and dv side by side, the largest buffer (checked against the host's limit first).
    let kv = d.b.checked_mul(d.s).and_then(|n| n.checked_mul(d.e + d.ev));
    host_can_hold(kv.unwrap_or(usize::MAX), DType::F32)?;
    let (qf, kf, vf) = (floats(q, lq)?, floats(k, lk)?, floats(v, lv)?);
    let of = floats(o, lo)?;
    let gf = floats(g, lg)?;
    let lse = floats(lse, &Layout::contiguous(&[d.b * d.l]))?;
    let (e, ev, scale) = (d.e, d.ev, d.scale as f32);
    let work =
        d.b.saturating_mul(d.l)
            .saturating_mul(d.s)
            .saturating_mul(e + ev);
    // D_i = do_i . o_i per query.
    let dsum: Vec<f32> = (0..d.b * d.l)
        .map(|r| dot(&gf[r * ev..][..ev], &of[r * ev..][..ev]))
        .collect();
    // p_ij and ds_ij = p_ij (do_i . v_j - D_i) of query row `row` and key j of its entry.
    let p_ds = |row: usize, j: usize| {
        let b = row / d.l;
        let s = dot(&qf[row * e..][..e], &kf[(b * d.s + j) * e..][..e]) * scale;
        let p = (s - lse[row]).exp();
        let dp = dot(&gf[row * ev..][..ev], &vf[(b * d.s + j) * ev..][..ev]);
        (p, p * (dp - dsum[row]))
    };
    let mut dq = vec![0f32; d.b * d.l * e];
    rows(&mut dq, e, work, |row, out| {
        let b = row / d.l;
        for j in 0..seen(&d, row % d.l) {
            let (_, ds) = p_ds(row, j);
            for (acc, x) in out.iter_mut().zip(&kf[(b * d.s + j) * e..][..e]) {
                *acc += ds * x * scale;
            }
        }
    });
    // dk and dv of each key row, side by side.
    let mut dkv = vec![0f32; d.b * d.s * (e + ev)];
    rows(&mut dkv, e + ev, work, |krow, out| {
        let (b, j) = (krow / d.s, krow % d.s);
        // Causal: only the queries from j on see key j.
        let first = if d.causal { j } else { 0 };
        for i in first..d.l {
            let row = b * d.l + i;
            let (p, ds) = p_ds(row, j);
            let (dk, dv) = out.split_at_mut(e);
            for (acc, x) in dk.iter_mut().zip(&qf[row * e..][..e]) {
                *acc += ds * x * scale;
            }
            for (acc, x) in dv.iter_mut().zip(&gf[row * ev..][..ev]) {
                *acc += p * x;
            }
        }
    });
    let dk: Vec<f32> = dkv.chunks(e + ev).flat_map(|r| r[..e].to_vec()).collect();
    let dv: Vec<f32> = dkv.chunks(e + ev).flat_map(|r| r[e..].to_vec()).collect();
    let t = q.dtype();
    let laid = |l: &Layout| Layout::contiguous(l.shape());
    Ok([
        (back_to(dq, t), laid(lq)),
        (back_to(dk, t), laid(lk)),
        (back_to(dv, t), laid(lv)),
    ])
}
