//! The LSTM cell's pointwise part, fused: from the gate pre-activations `[B, 4H]` (input,
//! forget, cell, output blocks, PyTorch's order) and the previous cell state `[B, H]` to
//! `[h | c]` `[B, 2H]`, and back. Math runs in the accumulation type (f32 for half storage);
//! the activations are recomputed in the backward pass rather than saved.

use super::{contiguous, map_pair, CpuElem, CpuStorage, IntoStorage, PAR_MIN};
use crate::backend::CellGrads;
use crate::dtype::Float;
use crate::layout::Layout;
use crate::Result;
use rayon::prelude::*;

/// A row of gates as its four blocks of `h`: input, forget, cell, output.
#[inline(always)]
fn gate_blocks<T>(row: &[T], h: usize) -> [&[T]; 4] {
    let (a, rest) = row.split_at(h);
    let (b, rest) = rest.split_at(h);
    let (c, d) = rest.split_at(h);
    [a, b, c, &d[..h]]
}

/// The four activations of element `j` (f32 ones branch-free, so the loops over `j`
/// vectorise: `Float::sigmoid_act`, `Float::tanh_act`).
#[inline(always)]
fn acts<T: CpuElem>(g: &[&[T]; 4], j: usize) -> [T::Acc; 4] {
    [
        g[0][j].to_acc().sigmoid_act(),
        g[1][j].to_acc().sigmoid_act(),
        g[2][j].to_acc().tanh_act(),
        g[3][j].to_acc().sigmoid_act(),
    ]
}

/// One batch row of a cell kernel: `row(b, gates_row, c_row, out_row)`. `row` is
/// `#[inline(always)]` in each kernel so that [`rows`] compiles it for the CPU's widest
/// vector unit (`pulp`'s dispatch inlines it into an AVX2 or AVX-512 copy).
trait Row<T>: Sync {
    fn row(&self, b: usize, g: &[T], c: &[T], out: &mut [T]);
}

/// A [`Row`] call as `pulp` runs it.
struct OnRow<'a, K, T> {
    k: &'a K,
    b: usize,
    g: &'a [T],
    c: &'a [T],
    out: &'a mut [T],
}

impl<K: Row<T>, T> pulp::WithSimd for OnRow<'_, K, T> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        self.k.row(self.b, self.g, self.c, self.out)
    }
}

/// Runs `k` over the batch rows, in parallel when large.
fn rows<T: CpuElem>(
    batch: usize,
    width: usize,
    g: &[T],
    c: Rows<'_, T>,
    h: usize,
    k: &impl Row<T>,
) -> Vec<T> {
    let _iso = crate::parallel::Isolated::new();
    let mut out = vec![T::default(); batch * width];
    if width == 0 {
        return out;
    }
    let arch = pulp::Arch::new();
    let job = |(b, out): (usize, &mut [T])| {
        let (g, c) = (&g[b * 4 * h..(b + 1) * 4 * h], c.row(b, h));
        arch.dispatch(OnRow { k, b, g, c, out })
    };
    if g.len() >= PAR_MIN {
        out.par_chunks_mut(width).enumerate().for_each(job);
    } else {
        out.chunks_mut(width).enumerate().for_each(job);
    }
    out
}

/// The forward cell: `[h | c']` rows.
struct Forward(usize);

impl<T: CpuElem> Row<T> for Forward {
    #[inline(always)]
    fn row(&self, _: usize, gr: &[T], cr: &[T], out: &mut [T]) {
        let h = self.0;
        let (g, cr) = (gate_blocks(gr, h), &cr[..h]);
        let (oh, oc) = out.split_at_mut(h);
        let oc = &mut oc[..h];
        for j in 0..h {
            let [i, f, gg, o] = acts(&g, j);
            let c2 = f * cr[j].to_acc() + i * gg;
            oh[j] = T::from_acc(o * c2.tanh_act());
            oc[j] = T::from_acc(c2);
        }
    }
}

/// `[h | c']` with `c' = f c + i g` and `h = o tanh(c')`.
pub(crate) fn lstm_cell(
    gates: &CpuStorage,
    lg: &Layout,
    c: &CpuStorage,
    lc: &Layout,
) -> Result<CpuStorage> {
    fn go<T: CpuElem>(g: &[T], lg: &Layout, c: &[T], lc: &Layout) -> CpuStorage {
        let (g, c) = (contiguous(g, lg), row_view(c, lc));
        let (batch, h) = (lc.shape()[0], lc.shape()[1]);
        rows(batch, 2 * h, &g, rows_of(&c), h, &Forward(h)).into_storage()
    }
    Ok(map_pair!("lstm_cell", gates, c, g, cs => go(g, lg, cs, lc)))
}

/// Rows of a `[B, H]` operand: row `b` starts at `off + b * stride`.
#[derive(Clone, Copy)]
struct Rows<'a, T> {
    data: &'a [T],
    off: usize,
    stride: usize,
}

impl<'a, T> Rows<'a, T> {
    #[inline(always)]
    fn row(&self, b: usize, h: usize) -> &'a [T] {
        &self.data[self.off + b * self.stride..][..h]
    }
}

/// A `[B, H]` operand's elements with a row stride: the view itself when its rows are unit
/// stride, else a dense copy.
fn row_view<'a, T: CpuElem>(v: &'a [T], l: &Layout) -> (std::borrow::Cow<'a, [T]>, usize, usize) {
    let (shape, st) = (l.shape(), l.strides());
    if shape.len() == 2 && (st[1] == 1 || shape[1] <= 1) {
        return (std::borrow::Cow::Borrowed(v), l.offset(), st[0]);
    }
    (contiguous(v, l), 0, shape.last().copied().unwrap_or(1))
}

/// A gradient operand's elements as `T`, or an error naming both dtypes.
fn typed<'a, T: CpuElem>(
    s: &'a CpuStorage,
    l: &Layout,
) -> Result<(std::borrow::Cow<'a, [T]>, usize, usize)> {
    let v = T::slice(s).ok_or(crate::Error::DTypeMismatch {
        op: "lstm_cell backward",
        lhs: T::DTYPE,
        rhs: s.dtype(),
    })?;
    Ok(row_view(v, l))
}

/// [`Rows`] over what [`row_view`] gave.
fn rows_of<'a, T: Clone>(v: &'a (std::borrow::Cow<'_, [T]>, usize, usize)) -> Rows<'a, T> {
    Rows {
        data: &v.0[..],
        off: v.1,
        stride: v.2,
    }
}

/// The backward cell: `[d gates | d c]` rows from the rows of `dh` (plus `dh2`'s, when
/// given) and `dc`.
struct Backward<'a, T> {
    h: usize,
    dh: Rows<'a, T>,
    dh2: Option<Rows<'a, T>>,
    dc: Rows<'a, T>,
    /// `h` zeros, for a missing `dh2`.
    zeros: Vec<T>,
}

impl<T: CpuElem> Row<T> for Backward<'_, T> {
    #[inline(always)]
    fn row(&self, b: usize, gr: &[T], cr: &[T], out: &mut [T]) {
        let h = self.h;
        let one = <T::Acc as num_traits::One>::one();
        let (dh, dc) = (self.dh.row(b, h), self.dc.row(b, h));
        let (g, cr) = (gate_blocks(gr, h), &cr[..h]);
        let (oi, rest) = out.split_at_mut(h);
        let (of, rest) = rest.split_at_mut(h);
        let (og, rest) = rest.split_at_mut(h);
        let (oo, oc) = rest.split_at_mut(h);
        let oc = &mut oc[..h];
        // Without a second h gradient, a row of zeros stands in (one loop, which
        // vectorises; adding +0 changes no value but the sign of a zero).
        let dh2 = self.dh2.map_or(&self.zeros[..h], |r| r.row(b, h));
        for j in 0..h {
            let [i, f, gg, o] = acts(&g, j);
            let cp = cr[j].to_acc();
            let c2 = f * cp + i * gg;
            let th = c2.tanh_act();
            let dh = dh[j].to_acc() + dh2[j].to_acc();
            let dc = dc[j].to_acc() + dh * o * (one - th * th);
            oi[j] = T::from_acc(dc * gg * i * (one - i));
            of[j] = T::from_acc(dc * cp * f * (one - f));
            og[j] = T::from_acc(dc * i * (one - gg * gg));
            oo[j] = T::from_acc(dh * th * o * (one - o));
            oc[j] = T::from_acc(dc * f);
        }
    }
}

/// Gradients of the gates `[B, 4H]` and of the previous cell state `[B, H]`, concatenated as
/// `[B, 5H]`, from the gradients of `h` and `c'` ([`CellGrads`]).
pub(crate) fn lstm_cell_backward(
    gates: &CpuStorage,
    lg: &Layout,
    c: &CpuStorage,
    lc: &Layout,
    d: CellGrads<'_, CpuStorage>,
) -> Result<CpuStorage> {
    fn go<T: CpuElem>(
        g: &[T],
        lg: &Layout,
        c: &[T],
        lc: &Layout,
        d: &CellGrads<'_, CpuStorage>,
    ) -> Result<CpuStorage> {
        let (g, c) = (contiguous(g, lg), row_view(c, lc));
        let (batch, h) = (lc.shape()[0], lc.shape()[1]);
        let dh = typed::<T>(d.dh.0, d.dh.1)?;
        let dc = typed::<T>(d.dc.0, d.dc.1)?;
        let dh2 = d.dh2.map(|(s, l)| typed::<T>(s, l)).transpose()?;
        let k = Backward {
            h,
            dh: rows_of(&dh),
            dh2: dh2.as_ref().map(rows_of),
            dc: rows_of(&dc),
            zeros: vec![T::default(); h],
        };
        Ok(rows(batch, 5 * h, &g, rows_of(&c), h, &k).into_storage())
    }
    Ok(map_pair!("lstm_cell backward", gates, c, g, cs => go(g, lg, cs, lc, &d)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pulp::WithSimd;

    /// Row 0 of `k` through the dispatch (the CPU's vector unit) and through the plain build,
    /// as bits.
    fn both<K: Row<f32>>(k: &K, g: &[f32], c: &[f32], width: usize) -> [Vec<u32>; 2] {
        let (mut fast, mut plain) = (vec![0.0f32; width], vec![0.0f32; width]);
        let on = |out| OnRow { k, b: 0, g, c, out };
        pulp::Arch::new().dispatch(on(&mut fast));
        on(&mut plain).with_simd(pulp::Scalar::new());
        assert!(fast.iter().all(|x| x.is_finite()) && fast.iter().any(|&x| x != 0.0));
        [fast, plain].map(|v| v.iter().map(|x| x.to_bits()).collect())
    }

    /// The cell rows compiled for the CPU's vector unit give the same bits as the plain build.
    #[test]
    fn vector_builds_give_the_plain_builds_bits() {
        let h = 37;
        let wave =
            |n: usize, k: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * k).sin() * 6.0).collect() };
        let (g, c, d) = (wave(4 * h, 0.37), wave(h, 1.3), wave(2 * h, 0.71));
        let [fast, plain] = both(&Forward(h), &g, &c, 2 * h);
        assert_eq!(fast, plain, "forward");
        let at = |off| Rows {
            data: &d,
            off,
            stride: 2 * h,
        };
        for dh2 in [None, Some(at(h / 2))] {
            let k = Backward {
                h,
                dh: at(0),
                dh2,
                dc: at(h),
                zeros: vec![0.0; h],
            };
            let [fast, plain] = both(&k, &g, &c, 5 * h);
            assert_eq!(
                fast,
                plain,
                "backward, a second h gradient: {}",
                dh2.is_some()
            );
        }
    }
}
