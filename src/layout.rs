//! Shapes, strides and offsets: how a tensor's elements sit in its storage, and the strided
//! walk every CPU kernel uses to read views without copying them.

use crate::{Error, Result};

/// Shape, element strides and starting offset of a tensor view into its storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
}

/// The element count of `shape`, or [`Error::TooLarge`] naming `op` when it passes
/// `isize::MAX` (no allocation can hold more elements than that, even of bytes).
///
/// The product of the non-zero dims must fit too, so that an empty tensor's strides (the
/// products of its trailing dims) cannot wrap either. Every shape that comes from a caller
/// goes through here (or [`Layout::check_within`]) before anything is allocated or read, so
/// the unchecked [`Layout::numel`] and stride arithmetic of any layout a tensor holds cannot
/// wrap.
pub fn checked_numel(op: &'static str, shape: &[usize]) -> Result<usize> {
    let fits = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d.max(1)))
        .is_some_and(|n| n <= isize::MAX as usize);
    match fits {
        true => Ok(shape.iter().product()),
        false => Err(Error::too_large(op, shape, "the element count overflows")),
    }
}

/// Bytes of `n` elements of `dtype`, or [`Error::TooLarge`] past `isize::MAX` (the most one
/// allocation can hold, host or device).
pub fn checked_bytes(
    op: &'static str,
    shape: &[usize],
    n: usize,
    dtype: crate::DType,
) -> Result<usize> {
    n.checked_mul(dtype.size_in_bytes())
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| {
            Error::too_large(
                op,
                shape,
                format!("{n} elements of {dtype:?} exceed isize::MAX bytes"),
            )
        })
}

/// Row-major strides of a contiguous tensor of `shape`.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1;
    for (s, &d) in strides.iter_mut().zip(shape).rev() {
        *s = acc;
        acc *= d;
    }
    strides
}

/// The broadcast shape of two shapes (numpy rules), or an error naming `op`.
pub fn broadcast_shapes(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let db = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => {
                return Err(Error::Broadcast {
                    op,
                    lhs: a.to_vec(),
                    rhs: b.to_vec(),
                })
            }
        };
    }
    checked_numel(op, &out)?;
    Ok(out)
}

/// Normalises a possibly negative dimension index against `rank`.
pub fn normalize_dim(op: &'static str, dim: isize, shape: &[usize]) -> Result<usize> {
    let rank = shape.len() as isize;
    let d = if dim < 0 { dim + rank } else { dim };
    if d < 0 || d >= rank {
        return Err(Error::DimOutOfRange {
            op,
            dim,
            rank: shape.len(),
            shape: shape.to_vec(),
        });
    }
    Ok(d as usize)
}

/// Normalises a list of dims, rejecting duplicates. An empty list means every dim.
pub fn normalize_dims(op: &'static str, dims: &[isize], shape: &[usize]) -> Result<Vec<usize>> {
    if dims.is_empty() {
        return Ok((0..shape.len()).collect());
    }
    let mut out = Vec::with_capacity(dims.len());
    for &d in dims {
        let d = normalize_dim(op, d, shape)?;
        if out.contains(&d) {
            return Err(Error::invalid(
                op,
                format!("dimension {d} repeated in {dims:?}"),
            ));
        }
        out.push(d);
    }
    out.sort_unstable();
    Ok(out)
}

impl Layout {
    /// A contiguous row-major layout starting at offset 0.
    pub fn contiguous(shape: &[usize]) -> Layout {
        Layout {
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: 0,
        }
    }

    pub(crate) fn new(shape: Vec<usize>, strides: Vec<usize>, offset: usize) -> Layout {
        Layout {
            shape,
            strides,
            offset,
        }
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    pub fn offset(&self) -> usize {
        self.offset
    }
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Checks that every element this layout selects lies in a storage of `len` elements:
    /// the element count and the last offset are computed without wrapping. This is the
    /// condition the kernels' unchecked (and `unsafe`) indexing relies on; [`Tensor`]
    /// construction asserts it.
    ///
    /// [`Tensor`]: crate::Tensor
    pub fn check_within(&self, op: &'static str, len: usize) -> Result<()> {
        let n = checked_numel(op, &self.shape)?;
        if n == 0 {
            return Ok(());
        }
        let last = self
            .shape
            .iter()
            .zip(&self.strides)
            .try_fold(self.offset, |acc, (&d, &s)| {
                (d - 1).checked_mul(s).and_then(|x| acc.checked_add(x))
            });
        match last {
            Some(last) if last < len => Ok(()),
            _ => Err(Error::too_large(
                op,
                &self.shape,
                format!(
                    "strides {:?} from offset {} reach past a storage of {len} elements",
                    self.strides, self.offset
                ),
            )),
        }
    }

    /// True when the elements are laid out row-major without gaps (size-1 dims ignored).
    pub fn is_contiguous(&self) -> bool {
        let mut acc = 1;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 && s != acc {
                return false;
            }
            acc *= d;
        }
        true
    }

    /// The range of storage this contiguous layout covers.
    pub fn contiguous_range(&self) -> Option<std::ops::Range<usize>> {
        self.is_contiguous()
            .then(|| self.offset..self.offset + self.numel())
    }

    /// The layout broadcast to `shape` (new leading dims and size-1 dims get stride 0).
    pub fn broadcast_as(&self, op: &'static str, shape: &[usize]) -> Result<Layout> {
        let err = || Error::Broadcast {
            op,
            lhs: self.shape.clone(),
            rhs: shape.to_vec(),
        };
        if shape.len() < self.rank() {
            return Err(err());
        }
        checked_numel(op, shape)?;
        let extra = shape.len() - self.rank();
        let mut strides = vec![0; shape.len()];
        for i in 0..self.rank() {
            let (d, s) = (self.shape[i], self.strides[i]);
            strides[extra + i] = if d == shape[extra + i] {
                s
            } else if d == 1 {
                0
            } else {
                return Err(err());
            };
        }
        Ok(Layout::new(shape.to_vec(), strides, self.offset))
    }

    /// Reorders the dims: output dim `i` is input dim `perm[i]`.
    pub fn permute(&self, op: &'static str, perm: &[usize]) -> Result<Layout> {
        let mut seen = vec![false; self.rank()];
        if perm.len() != self.rank() {
            return Err(Error::invalid(
                op,
                format!(
                    "permutation {perm:?} for a tensor of shape {:?}",
                    self.shape
                ),
            ));
        }
        for &p in perm {
            if p >= self.rank() || seen[p] {
                return Err(Error::invalid(
                    op,
                    format!("{perm:?} is not a permutation of 0..{}", self.rank()),
                ));
            }
            seen[p] = true;
        }
        Ok(Layout::new(
            perm.iter().map(|&p| self.shape[p]).collect(),
            perm.iter().map(|&p| self.strides[p]).collect(),
            self.offset,
        ))
    }

    /// Elements `start..start + len` of dimension `dim`.
    pub fn narrow(&self, op: &'static str, dim: usize, start: usize, len: usize) -> Result<Layout> {
        // `start + len` is checked: a start near usize::MAX must not wrap past the bound.
        if !matches!(start.checked_add(len), Some(end) if end <= self.shape[dim]) {
            return Err(Error::invalid(
                op,
                format!(
                    "range {start}..{start}+{len} out of bounds for dimension {dim} of shape {:?}",
                    self.shape
                ),
            ));
        }
        let mut shape = self.shape.clone();
        shape[dim] = len;
        Ok(Layout::new(
            shape,
            self.strides.clone(),
            self.offset + start * self.strides[dim],
        ))
    }

    /// Every `step`-th element of `dim` from `start`, `len` of them (Python's
    /// `start:start + step * len:step`). The range was checked by the caller.
    pub(crate) fn stepped(&self, dim: usize, start: usize, len: usize, step: usize) -> Layout {
        let mut shape = self.shape.clone();
        let mut strides = self.strides.clone();
        shape[dim] = len;
        strides[dim] *= step;
        let offset = match len {
            0 => self.offset,
            _ => self.offset + start * self.strides[dim],
        };
        Layout::new(shape, strides, offset)
    }

    /// A view with a new shape over the same elements, when strides allow it without a copy.
    pub fn reshape_view(&self, shape: &[usize]) -> Option<Layout> {
        if self.is_contiguous() {
            return Some(Layout::new(
                shape.to_vec(),
                contiguous_strides(shape),
                self.offset,
            ));
        }
        None
    }

    /// A view of the same elements with `shape` (the same count), when the strides allow it
    /// without a copy: PyTorch's rule for `view` (its `computeStride`). The dims are cut into
    /// chunks of dims that are contiguous among themselves (each stride the next one's times
    /// its size); a new dim may split or merge dims only within one chunk. So the transpose
    /// of a `[4, 6]` tensor views as `[6, 2, 2]` (its dim of 4 splits), but not as `[24]`.
    ///
    /// ```
    /// use mantissa::layout::Layout;
    /// let t = Layout::contiguous(&[4, 6]).permute("t", &[1, 0]).unwrap();
    /// assert_eq!(t.view_as(&[6, 2, 2]).unwrap().strides(), &[1, 12, 6]);
    /// assert!(t.view_as(&[24]).is_none());
    /// ```
    pub fn view_as(&self, shape: &[usize]) -> Option<Layout> {
        let contiguous = |s: &[usize]| Layout::new(s.to_vec(), contiguous_strides(s), self.offset);
        if self.numel() == 0 || self.rank() == 0 {
            // No element to place (or one): any strides will do.
            return Some(contiguous(shape));
        }
        let (old, old_strides) = (&self.shape, &self.strides);
        let mut strides = vec![0usize; shape.len()];
        let mut view_d = shape.len() as isize - 1;
        let mut chunk_base = *old_strides.last()?;
        let (mut tensor_numel, mut view_numel) = (1usize, 1usize);
        for d in (0..old.len()).rev() {
            tensor_numel *= old[d];
            // The end of a chunk: the dim before does not continue it.
            let ends =
                d == 0 || (old[d - 1] != 1 && old_strides[d - 1] != tensor_numel * chunk_base);
            if ends {
                while view_d >= 0 && (view_numel < tensor_numel || shape[view_d as usize] == 1) {
                    strides[view_d as usize] = view_numel * chunk_base;
                    view_numel *= shape[view_d as usize];
                    view_d -= 1;
                }
                if view_numel != tensor_numel {
                    return None;
                }
                if d > 0 {
                    chunk_base = old_strides[d - 1];
                    (tensor_numel, view_numel) = (1, 1);
                }
            }
        }
        match view_d {
            -1 => Some(Layout::new(shape.to_vec(), strides, self.offset)),
            _ => None,
        }
    }

    /// Inserts a size-1 dim at `dim`.
    pub fn unsqueeze(&self, dim: usize) -> Layout {
        let mut shape = self.shape.clone();
        let mut strides = self.strides.clone();
        let s = if dim < self.rank() {
            self.strides[dim] * self.shape[dim]
        } else {
            1
        };
        shape.insert(dim, 1);
        strides.insert(dim, s);
        Layout::new(shape, strides, self.offset)
    }

    /// Removes dim `dim` (which must have size 1).
    pub fn squeeze(&self, dim: usize) -> Layout {
        let mut shape = self.shape.clone();
        let mut strides = self.strides.clone();
        shape.remove(dim);
        strides.remove(dim);
        Layout::new(shape, strides, self.offset)
    }

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
    fn broadcasting_rules() {
        assert_eq!(broadcast_shapes("t", &[3, 1], &[4]).unwrap(), vec![3, 4]);
        assert!(broadcast_shapes("t", &[3, 2], &[4]).is_err());
        let l = Layout::contiguous(&[3, 1])
            .broadcast_as("t", &[2, 3, 4])
            .unwrap();
        assert_eq!(l.strides(), &[0, 1, 0]);
    }
}

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
mod rows_tests {
    use super::*;

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
