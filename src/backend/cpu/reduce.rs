//! Reductions over any set of dims of a strided tensor, accumulating in f32 (f64 for f64).

use super::{map_all, CpuElem, CpuStorage, IntoStorage, CHUNK, PAR_MIN};
use crate::backend::ops::ReduceOp;
use crate::dtype::{Float, WithDType};
use crate::layout::{Layout, Rows};
use crate::Result;
use num_traits::Zero;
use rayon::prelude::*;

/// Partial result of a reduction: the value and, for arg-reductions, its index.
#[derive(Clone, Copy)]
struct Acc<A> {
    v: A,
    i: usize,
}

/// A running compensated (Neumaier) sum.
#[derive(Clone, Copy)]
struct Neumaier<A> {
    sum: A,
    comp: A,
}

impl<A: Float> Neumaier<A> {
    fn new() -> Self {
        Neumaier {
            sum: A::zero(),
            comp: A::zero(),
        }
    }

    /// Adds `x`. Once the sum is infinite or NaN it is the result (as a plain sum's): the
    /// compensation of an infinite sum would be `inf - inf`, a NaN.
    #[inline(always)]
    fn add(&mut self, x: A) {
        let t = self.sum + x;
        if t.is_finite() {
            self.comp += if self.sum.abs() >= x.abs() {
                (self.sum - t) + x
            } else {
                (x - t) + self.sum
            };
        }
        self.sum = t;
    }
    fn value(&self) -> A {
        self.sum + self.comp
    }
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
            // Blocks of 1024 with Neumaier compensation, then a compensated sum of the
            // blocks: a few ulps of error however long the row, even for many equal values
            // (one long compensation term would itself drift).
            let mut outer = Neumaier::new();
            let mut block = Neumaier::new();
            for (k, o) in offs.enumerate() {
                block.add(v[o].to_acc());
                if k % 1024 == 1023 {
                    outer.add(block.value());
                    block = Neumaier::new();
                }
            }
            outer.add(block.value());
            Acc {
                v: outer.value(),
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

/// The sum of a contiguous run: 16 independent f32 (f64) lanes over blocks of 256 elements,
/// which vectorise, with a compensated sum of the blocks (each block's rounding error is at
/// most about 20 ulp of its absolute sum; the compensation keeps long rows from drifting).
#[inline(always)]
fn sum_run<T: WithDType>(run: &[T], total: &mut Neumaier<T::Acc>) {
    for block in run.chunks(256) {
        let mut lanes = [T::Acc::zero(); 16];
        let mut it = block.chunks_exact(16);
        for c in &mut it {
            for (l, x) in lanes.iter_mut().zip(c) {
                *l += x.to_acc();
            }
        }
        for (l, x) in lanes.iter_mut().zip(it.remainder()) {
            *l += x.to_acc();
        }
        let mut w = 16;
        while w > 1 {
            w /= 2;
            for i in 0..w {
                lanes[i] += lanes[i + w];
            }
        }
        total.add(lanes[0]);
    }
}

/// [`fold`] over the rows starting at `base + starts[k]`, with a vectorised path for sums of
/// contiguous rows.
fn fold_rows<T: WithDType>(
    op: ReduceOp,
    v: &[T],
    base: usize,
    starts: &[usize],
    (len, inner): (usize, usize),
    first: usize,
) -> Acc<T::Acc> {
    if inner == 1 && matches!(op, ReduceOp::Sum | ReduceOp::Mean) {
        return Acc {
            v: pulp::Arch::new().dispatch(SumRuns {
                v,
                base,
                starts,
                len,
            }),
            i: 0,
        };
    }
    fold(op, v, walk(base, starts, len, inner), first)
}

/// The compensated sum of the runs of `len` starting at `base + starts[k]`, compiled for the
/// CPU's widest vector unit (`pulp` inlines `with_simd` into an AVX2 or AVX-512 copy).
struct SumRuns<'a, T> {
    v: &'a [T],
    base: usize,
    starts: &'a [usize],
    len: usize,
}

impl<T: WithDType> pulp::WithSimd for SumRuns<'_, T> {
    type Output = T::Acc;
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) -> T::Acc {
        let mut total = Neumaier::new();
        for &s in self.starts {
            let at = self.base + s;
            sum_run(&self.v[at..at + self.len], &mut total);
        }
        total.value()
    }
}

/// Rows per task of [`reduce_columns`]: a multiple of the 256-row sum blocks, and fixed, so
/// a sum's bits depend on the shape alone, not on the thread count.
const COLUMN_ROWS: usize = 4096;

/// Reductions for `cols` outputs whose inputs sit side by side (the outputs' own stride is
/// 1, as for a bias gradient `[batch, features] -> [features]` or a max down the columns of
/// a matrix): each reduced row updates per-column accumulators from a contiguous slice,
/// which vectorises, instead of walking every column down its stride. The rows are taken in
/// tasks of [`COLUMN_ROWS`], and the columns in blocks when there are enough of them per
/// thread; the tasks' results are combined per column in row order (compensated, for sums).
fn reduce_columns<T: WithDType>(
    op: ReduceOp,
    v: &[T],
    base: usize,
    cols: usize,
    starts: &[usize],
    (len, inner): (usize, usize),
) -> Vec<Acc<T::Acc>> {
    let _iso = crate::parallel::Isolated::new();
    let rows = starts.len() * len;
    let tasks = rows.div_ceil(COLUMN_ROWS);
    let parallel = cols * rows >= PAR_MIN;
    // Column blocks of at least 64: two threads that sum parts of the same rows pull the
    // same cache lines, so with fewer columns per thread the rows are split instead.
    let width = match parallel {
        false => cols,
        true => cols
            .div_ceil(crate::parallel::threads().max(1))
            .next_multiple_of(16)
            .max(64),
    };
    let blocks = cols.div_ceil(width);
    let part = |t: usize| {
        let (r, c) = (t / blocks * COLUMN_ROWS, t % blocks * width);
        let at = |k: usize| base + starts[k / len] + k % len * inner + c;
        pulp::Arch::new().dispatch(ColumnPart {
            op,
            v,
            at,
            rows: r..rows.min(r + COLUMN_ROWS),
            w: width.min(cols - c),
        })
    };
    // parts[task * blocks + block][column in the block]
    let parts: Vec<Vec<Acc<T::Acc>>> = match parallel {
        false => (0..tasks * blocks).map(part).collect(),
        true => (0..tasks * blocks).into_par_iter().map(part).collect(),
    };
    (0..cols)
        .map(|j| {
            let mut chunks = (0..tasks).map(|t| parts[t * blocks + j / width][j % width]);
            match op {
                ReduceOp::Sum | ReduceOp::Mean => {
                    let mut total = Neumaier::new();
                    chunks.for_each(|a| total.add(a.v));
                    Acc {
                        v: total.value(),
                        i: 0,
                    }
                }
                _ => {
                    let first = chunks.next().expect("at least one row");
                    chunks.fold(first, |a, b| combine(op, a, b))
                }
            }
        })
        .collect()
}

/// One task of [`reduce_columns`], for `pulp` to compile [`column_part`] for the CPU's widest
/// vector unit (as [`SumRuns`]).
struct ColumnPart<'a, T, F> {
    op: ReduceOp,
    v: &'a [T],
    at: F,
    rows: std::ops::Range<usize>,
    w: usize,
}

impl<T: WithDType, F: Fn(usize) -> usize> pulp::WithSimd for ColumnPart<'_, T, F> {
    type Output = Vec<Acc<T::Acc>>;
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) -> Self::Output {
        let ColumnPart { op, v, at, rows, w } = self;
        column_part(op, v, at, rows, w)
    }
}

/// Rows `rows` (row `k` starts at `at(k)`), `w` columns. Sums add blocks of 256 rows plainly
/// and the blocks with compensation, as in [`sum_run`]; extremes keep the first best of each
/// column, with its row (the index into the reduced dims, which arg-reductions walk in the
/// view's order).
#[inline(always)]
fn column_part<T: WithDType>(
    op: ReduceOp,
    v: &[T],
    at: impl Fn(usize) -> usize,
    rows: std::ops::Range<usize>,
    w: usize,
) -> Vec<Acc<T::Acc>> {
    if matches!(op, ReduceOp::Sum | ReduceOp::Mean) {
        let mut total = vec![Neumaier::new(); w];
        let mut block = vec![T::Acc::zero(); w];
        let flush = |total: &mut [Neumaier<T::Acc>], block: &mut [T::Acc]| {
            for (t, b) in total.iter_mut().zip(block.iter_mut()) {
                t.add(*b);
                *b = T::Acc::zero();
            }
        };
        for (n, k) in rows.enumerate() {
            let a = at(k);
            for (b, x) in block.iter_mut().zip(&v[a..a + w]) {
                *b += x.to_acc();
            }
            if n % 256 == 255 {
                flush(&mut total, &mut block);
            }
        }
        flush(&mut total, &mut block);
        return total.iter().map(|t| Acc { v: t.value(), i: 0 }).collect();
    }
    // Tiles of TILE rows by 16 columns, whose best values and rows stay in vector registers
    // (picked branch-free, as `better` picks); the rest of the columns one at a time. Rows
    // count from the task's first, as u32: the width of an f32 lane. (Picks stored straight
    // back to memory row by row become a conditional store per lane, which does not
    // vectorise: 3.5x slower.)
    const TILE: usize = 64;
    let max = matches!(op, ReduceOp::Max | ReduceOp::ArgMax);
    let nan = <T::Acc as num_traits::Float>::is_nan;
    let a = at(rows.start);
    let mut best: Vec<T::Acc> = v[a..a + w].iter().map(|x| x.to_acc()).collect();
    let mut row = vec![0u32; w];
    let wide = w / 16 * 16;
    for t0 in (rows.start + 1..rows.end).step_by(TILE) {
        let tile: Vec<(usize, u32)> = (t0..rows.end.min(t0 + TILE))
            .map(|k| (at(k), (k - rows.start) as u32))
            .collect();
        for j0 in (0..wide).step_by(16) {
            let mut b: [T::Acc; 16] = best[j0..j0 + 16].try_into().unwrap();
            let mut r: [u32; 16] = row[j0..j0 + 16].try_into().unwrap();
            for &(a, k) in &tile {
                let src = &v[a + j0..a + j0 + 16];
                for j in 0..16 {
                    let x = src[j].to_acc();
                    let beats = if max { x > b[j] } else { x < b[j] };
                    let take = beats | (nan(x) & !nan(b[j]));
                    b[j] = if take { x } else { b[j] };
                    r[j] = if take { k } else { r[j] };
                }
            }
            best[j0..j0 + 16].copy_from_slice(&b);
            row[j0..j0 + 16].copy_from_slice(&r);
        }
        for &(a, k) in &tile {
            for j in wide..w {
                let x = v[a + j].to_acc();
                if better(op, x, best[j]) {
                    (best[j], row[j]) = (x, k);
                }
            }
        }
    }
    best.into_iter()
        .zip(row)
        .map(|(v, i)| Acc {
            v,
            i: rows.start + i as usize,
        })
        .collect()
}

/// Storage offsets of the rows starting at `base + starts[k]`, each `len` long with stride
/// `inner`.
fn walk(
    base: usize,
    starts: &[usize],
    len: usize,
    inner: usize,
) -> impl Iterator<Item = usize> + '_ {
    starts
        .iter()
        .flat_map(move |&s| (0..len).map(move |i| base + s + i * inner))
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
    let pick = |ds: &[usize], of: &[usize]| -> Vec<usize> { ds.iter().map(|&d| of[d]).collect() };
    // The reduced dims as a sub-layout walked in rows (shared by every output), and the
    // storage offset where each output's elements start. Sums and extremes walk them in
    // storage order (outermost stride first), so a channels-last or transposed input is read
    // in runs; arg-reductions keep the view's order, which their indices count in.
    let mut walk = dims.to_vec();
    if !matches!(op, ReduceOp::ArgMax | ReduceOp::ArgMin) {
        walk.sort_by_key(|&d| std::cmp::Reverse(l.strides()[d]));
    }
    let sub = Layout::new(pick(&walk, l.shape()), pick(&walk, l.strides()), 0);
    let rows = Rows::new([&sub]);
    let (len, inner) = (rows.len, rows.inner[0]);
    let mut starts = Vec::with_capacity(rows.count());
    rows.for_each(0, rows.count(), |_, [s]| starts.push(s));
    let bases: Vec<usize> =
        Layout::new(pick(&kept, l.shape()), pick(&kept, l.strides()), l.offset())
            .offsets()
            .collect();
    let r: usize = sub.numel();

    fn go<T: CpuElem>(
        v: &[T],
        bases: &[usize],
        starts: &[usize],
        len: usize,
        inner: usize,
        r: usize,
        op: ReduceOp,
    ) -> CpuStorage {
        let _iso = crate::parallel::Isolated::new();
        let o = bases.len();
        let one = |row: usize| -> Acc<T::Acc> {
            if r == 0 {
                return fold(op, v, std::iter::empty(), 0);
            }
            if o == 1 && r >= PAR_MIN {
                let per = (CHUNK / len).max(1);
                starts
                    .par_chunks(per)
                    .enumerate()
                    .map(|(c, rs)| fold_rows(op, v, bases[0], rs, (len, inner), c * per * len))
                    .collect::<Vec<_>>()
                    .into_iter()
                    .reduce(|a, b| combine(op, a, b))
                    .unwrap_or(Acc {
                        v: T::Acc::zero(),
                        i: 0,
                    })
            } else {
                fold_rows(op, v, bases[row], starts, (len, inner), 0)
            }
        };
        let columns = o >= 16 && r > 1 && bases.windows(2).all(|w| w[1] == w[0] + 1);
        let rows: Vec<Acc<T::Acc>> = if columns {
            reduce_columns(op, v, bases[0], o, starts, (len, inner))
        } else if o * r >= PAR_MIN && o > 1 {
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
    if let (CpuStorage::I64(v), false) = (s, matches!(op, ReduceOp::Sum | ReduceOp::Mean)) {
        return Ok(i64_extremes(v, &bases, &starts, (len, inner), op));
    }
    Ok(map_all!(s, v => go(v, &bases, &starts, len, inner, r, op)))
}

/// Max, min and their first indices of i64 rows, compared as integers (through f64, a value
/// past 2^53 would round to its neighbour).
fn i64_extremes(
    v: &[i64],
    bases: &[usize],
    starts: &[usize],
    (len, inner): (usize, usize),
    op: ReduceOp,
) -> CpuStorage {
    let _iso = crate::parallel::Isolated::new();
    let max = matches!(op, ReduceOp::Max | ReduceOp::ArgMax);
    let one = |&base: &usize| -> (i64, usize) {
        let mut best: Option<(i64, usize)> = None;
        for (k, o) in walk(base, starts, len, inner).enumerate() {
            let x = v[o];
            if best.is_none_or(|(b, _)| if max { x > b } else { x < b }) {
                best = Some((x, k));
            }
        }
        best.unwrap_or((0, 0))
    };
    let rows: Vec<(i64, usize)> = if bases.len() * starts.len() * len >= PAR_MIN {
        bases.par_iter().map(one).collect()
    } else {
        bases.iter().map(one).collect()
    };
    match op {
        ReduceOp::ArgMax | ReduceOp::ArgMin => rows
            .into_iter()
            .map(|(_, i)| i as i64)
            .collect::<Vec<_>>()
            .into_storage(),
        _ => rows
            .into_iter()
            .map(|(x, _)| x)
            .collect::<Vec<_>>()
            .into_storage(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pulp::WithSimd;

    /// Values with many magnitudes and signs, some repeated (ties for the extremes).
    fn values(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 % 1013) as f32 - 506.3) * 1.37e-3 * (1 + i % 5) as f32)
            .collect()
    }

    /// The copies compiled for the CPU's vector unit give the same bits as the plain build
    /// (same operations in the same order; nothing fused into an FMA), so a result does not
    /// depend on the machine.
    #[test]
    fn vector_builds_give_the_plain_builds_bits() {
        let v = values(7000);
        let starts = [0usize, 1700, 3100];
        let runs = || SumRuns {
            v: &v,
            base: 3,
            starts: &starts,
            len: 1500,
        };
        let (fast, plain) = (
            pulp::Arch::new().dispatch(runs()),
            runs().with_simd(pulp::Scalar::new()),
        );
        assert_eq!(fast.to_bits(), plain.to_bits());
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::ArgMin] {
            let part = || ColumnPart {
                op,
                v: &v,
                at: |k: usize| k * 70 + 1,
                rows: 2..99,
                w: 67,
            };
            let (fast, plain) = (
                pulp::Arch::new().dispatch(part()),
                part().with_simd(pulp::Scalar::new()),
            );
            assert_eq!(fast.len(), 67);
            for (a, b) in fast.iter().zip(&plain) {
                assert_eq!((a.v.to_bits(), a.i), (b.v.to_bits(), b.i), "{op:?}");
            }
        }
    }
}
