//! Shapes, strides and offsets: how a tensor's elements sit in its storage, and the strided
//! walk every CPU kernel uses to read views without copying them.

use crate::{Error, Result};

mod walk;
pub use walk::{Rows, StridedIter};

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
}

#[cfg(test)]
mod tests {
    use super::*;

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
