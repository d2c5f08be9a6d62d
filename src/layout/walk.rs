//! Walking a strided layout's storage offsets: one layout element by element
//! ([`StridedIter`]), or several same-shape layouts row by row ([`Rows`]).

use super::Layout;

impl Layout {
    /// Merges adjacent dims that are contiguous with each other and drops size-1 dims, giving
    /// the shortest (shape, strides) that walks the same offsets.
    fn coalesced(&self) -> (Vec<usize>, Vec<usize>) {
        let mut shape: Vec<usize> = Vec::with_capacity(self.rank());
        let mut strides: Vec<usize> = Vec::with_capacity(self.rank());
        for (&d, &s) in self.shape.iter().zip(&self.strides) {
            if d == 1 {
                continue;
            }
            match (shape.last_mut(), strides.last_mut()) {
                (Some(pd), Some(ps)) if *ps == s * d => {
                    *pd *= d;
                    *ps = s;
                }
                _ => {
                    shape.push(d);
                    strides.push(s);
                }
            }
        }
        (shape, strides)
    }

    /// Iterator over the storage offsets of the elements, in row-major order.
    pub fn offsets(&self) -> StridedIter {
        StridedIter::new(self, 0, self.numel())
    }

    /// Offsets of the row-major elements `start..start + len`.
    pub fn offsets_range(&self, start: usize, len: usize) -> StridedIter {
        StridedIter::new(self, start, len)
    }
}

/// Walks the storage offsets of a strided layout in row-major order.
pub struct StridedIter {
    shape: Vec<usize>,
    strides: Vec<usize>,
    index: Vec<usize>,
    next: usize,
    remaining: usize,
}

impl StridedIter {
    fn new(layout: &Layout, start: usize, len: usize) -> StridedIter {
        let (shape, strides) = layout.coalesced();
        let mut index = vec![0; shape.len()];
        if len == 0 {
            return StridedIter {
                shape,
                strides,
                index,
                next: 0,
                remaining: 0,
            };
        }
        let mut rest = start;
        let mut next = layout.offset;
        for i in (0..shape.len()).rev() {
            index[i] = rest % shape[i];
            rest /= shape[i];
            next += index[i] * strides[i];
        }
        StridedIter {
            shape,
            strides,
            index,
            next,
            remaining: len,
        }
    }
}

impl Iterator for StridedIter {
    type Item = usize;

    #[inline]
    fn next(&mut self) -> Option<usize> {
        if self.remaining == 0 {
            return None;
        }
        self.remaining -= 1;
        let cur = self.next;
        for d in (0..self.shape.len()).rev() {
            self.index[d] += 1;
            self.next += self.strides[d];
            if self.index[d] < self.shape[d] {
                break;
            }
            self.next -= self.strides[d] * self.shape[d];
            self.index[d] = 0;
        }
        Some(cur)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.remaining, Some(self.remaining))
    }
}

impl ExactSizeIterator for StridedIter {}

/// Rows of several same-shape layouts walked together: the dims are coalesced jointly (two
/// dims merge only where every layout allows it) and the last one is the row. Kernels loop
/// over rows with the per-layout row offsets and inner strides, so broadcast and transposed
/// operands cost a multiply-add per row, not per element.
#[derive(Debug, Clone)]
pub struct Rows<const N: usize> {
    outer_shape: Vec<usize>,
    outer_strides: Vec<[usize; N]>,
    offsets: [usize; N],
    /// Elements per row.
    pub len: usize,
    /// Inner (row) stride of each layout.
    pub inner: [usize; N],
}

impl<const N: usize> Rows<N> {
    /// `layouts` must share one shape.
    pub fn new(layouts: [&Layout; N]) -> Rows<N> {
        let shape = layouts[0].shape();
        let mut dims: Vec<(usize, [usize; N])> = Vec::with_capacity(shape.len());
        for (d, &size) in shape.iter().enumerate() {
            if size == 1 {
                continue;
            }
            let strides: [usize; N] = std::array::from_fn(|k| layouts[k].strides()[d]);
            match dims.last_mut() {
                Some((ps, pst)) if (0..N).all(|k| pst[k] == strides[k] * size) => {
                    *ps *= size;
                    *pst = strides;
                }
                _ => dims.push((size, strides)),
            }
        }
        let (len, inner) = dims.pop().unwrap_or((1, [0; N]));
        Rows {
            outer_shape: dims.iter().map(|d| d.0).collect(),
            outer_strides: dims.iter().map(|d| d.1).collect(),
            offsets: std::array::from_fn(|k| layouts[k].offset()),
            len,
            inner,
        }
    }

    /// Number of rows.
    pub fn count(&self) -> usize {
        self.outer_shape.iter().product()
    }

    /// Calls `f(row, offsets)` for rows `start..end` in order.
    #[inline]
    pub fn for_each(&self, start: usize, end: usize, mut f: impl FnMut(usize, [usize; N])) {
        if start >= end {
            return;
        }
        let r = self.outer_shape.len();
        let mut idx = vec![0; r];
        let mut offs = self.offsets;
        let mut rest = start;
        for d in (0..r).rev() {
            idx[d] = rest % self.outer_shape[d];
            rest /= self.outer_shape[d];
            for (k, o) in offs.iter_mut().enumerate() {
                *o += idx[d] * self.outer_strides[d][k];
            }
        }
        for row in start..end {
            f(row, offs);
            for d in (0..r).rev() {
                idx[d] += 1;
                for (k, o) in offs.iter_mut().enumerate() {
                    *o += self.outer_strides[d][k];
                }
                if idx[d] < self.outer_shape[d] {
                    break;
                }
                for (k, o) in offs.iter_mut().enumerate() {
                    *o -= self.outer_strides[d][k] * self.outer_shape[d];
                }
                idx[d] = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_walk_matches_index_arithmetic() {
        let base = Layout::contiguous(&[2, 3, 4]);
        let t = base.permute("t", &[2, 0, 1]).unwrap();
        let got: Vec<usize> = t.offsets().collect();
        let mut want = vec![];
        for k in 0..4 {
            for i in 0..2 {
                for j in 0..3 {
                    want.push(i * 12 + j * 4 + k);
                }
            }
        }
        assert_eq!(got, want);
        let part: Vec<usize> = t.offsets_range(5, 7).collect();
        assert_eq!(part, want[5..12]);
    }

    #[test]
    fn rows_walk_the_same_offsets_as_the_strided_iterator() {
        let a = Layout::contiguous(&[3, 4, 5])
            .permute("t", &[1, 0, 2])
            .unwrap();
        let b = Layout::contiguous(&[4, 1, 5])
            .broadcast_as("t", &[4, 3, 5])
            .unwrap();
        let rows = Rows::new([&a, &b]);
        let (mut ga, mut gb) = (vec![], vec![]);
        rows.for_each(0, rows.count(), |_, [oa, ob]| {
            for i in 0..rows.len {
                ga.push(oa + i * rows.inner[0]);
                gb.push(ob + i * rows.inner[1]);
            }
        });
        assert_eq!(ga, a.offsets().collect::<Vec<_>>());
        assert_eq!(gb, b.offsets().collect::<Vec<_>>());
        let mut part = vec![];
        rows.for_each(2, 5, |r, [oa, _]| part.push((r, oa)));
        assert_eq!(part.len(), 3);
        assert_eq!(part[0].1, ga[2 * rows.len]);
    }
}
