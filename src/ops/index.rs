//! cat, stack, index_select, gather, scatter_add, embedding.

use super::{dispatch, Op};
use crate::layout::normalize_dim;
use crate::{DType, Error, Result, Tensor};

fn expect_index(op: Op, idx: &Tensor) -> Result<()> {
    if idx.dtype() == DType::I64 {
        Ok(())
    } else {
        Err(Error::DType {
            op: op.name(),
            dtype: idx.dtype(),
            expected: "I64 indices",
        })
    }
}

impl Tensor {
    /// Concatenates along `dim`; every other dim must agree. Floating inputs of mixed dtypes
    /// are promoted.
    ///
    /// ```
    /// use mantissa::{Tensor, DType, Device};
    /// let a = Tensor::ones(&[2, 1], DType::F32, Device::Cpu)?;
    /// let b = Tensor::zeros(&[2, 3], DType::F32, Device::Cpu)?;
    /// assert_eq!(Tensor::cat(&[&a, &b], 1)?.shape(), &[2, 4]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn cat(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        let _prof = crate::profiler::op(Op::Cat.name());
        let Some(first) = tensors.first() else {
            return Err(Error::invalid("cat", "no tensors given"));
        };
        let d = normalize_dim("cat", dim, first.shape())?;
        let dtype = tensors
            .iter()
            .map(|t| t.dtype())
            .reduce(DType::promote)
            .unwrap();
        let mut inputs = Vec::with_capacity(tensors.len());
        for t in tensors {
            let [t, _] = dispatch(Op::Cat, [t, first])?;
            let same_rest = t.rank() == first.rank()
                && (0..t.rank()).all(|i| i == d || t.shape()[i] == first.shape()[i]);
            if !same_rest {
                return Err(Error::ShapeMismatch {
                    op: "cat",
                    lhs: first.shape().to_vec(),
                    rhs: t.shape().to_vec(),
                });
            }
            inputs.push(t.to_dtype(dtype)?);
        }
        let mut shape = first.shape().to_vec();
        shape[d] = inputs
            .iter()
            .try_fold(0usize, |acc, t| acc.checked_add(t.shape()[d]))
            .ok_or_else(|| {
                Error::too_large("cat", first.shape(), "the concatenated size overflows")
            })?;
        let out = Tensor::zeros(&shape, dtype, first.device())?;
        let mut start = 0;
        let mut starts = Vec::with_capacity(inputs.len());
        let mut places = Vec::with_capacity(inputs.len());
        for t in &inputs {
            places.push(out.layout().narrow("cat", d, start, t.shape()[d])?);
            starts.push((start, t.shape()[d]));
            start += t.shape()[d];
        }
        // Every input into its place at once (on CUDA, many per launch).
        let sources: Vec<_> = inputs.iter().map(|t| t.storage()).collect();
        let parts: Vec<_> = places
            .iter()
            .zip(&sources)
            .zip(&inputs)
            .map(|((dl, s), t)| (dl, &**s, t.layout()))
            .collect();
        out.0.storage.write(|s| s.copy_many_into(&parts))?;
        let refs: Vec<&Tensor> = inputs.iter().collect();
        Ok(out.attach("cat", &refs, move |g, needs| {
            starts
                .iter()
                .zip(needs)
                .map(|(&(s, n), &need)| need.then(|| g.narrow(d as isize, s, n)).transpose())
                .collect()
        }))
    }

    /// Stacks equal-shape tensors along a new dim.
    pub fn stack(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        let parts: Vec<Tensor> = tensors
            .iter()
            .map(|t| t.unsqueeze(dim))
            .collect::<Result<_>>()?;
        let refs: Vec<&Tensor> = parts.iter().collect();
        Tensor::cat(&refs, dim)
    }

    /// Picks entries `index` (1-D, I64) along `dim`.
    pub fn index_select(&self, dim: isize, index: &Tensor) -> Result<Tensor> {
        let _prof = crate::profiler::op(Op::IndexSelect.name());
        let [x, idx] = dispatch(Op::IndexSelect, [self, index])?;
        expect_index(Op::IndexSelect, &idx)?;
        super::expect_rank(Op::IndexSelect, &idx, 1, "the index")?;
        let d = normalize_dim("index_select", dim, x.shape())?;
        let mut shape = x.shape().to_vec();
        shape[d] = idx.numel();
        // Rows of a (possibly expanded) input times (possibly expanded) indices: the output's
        // size is checked before a kernel allocates it.
        let n = crate::layout::checked_numel("index_select", &shape)?;
        crate::layout::checked_bytes("index_select", &shape, n, x.dtype())?;
        if x.device() == crate::Device::Cpu {
            crate::backend::cpu::host_can_hold(n, x.dtype())?;
        }
        let s = x
            .storage()
            .index_select(x.layout(), d, &idx.storage(), idx.layout())?;
        let in_shape = x.shape().to_vec();
        let read = idx.clone();
        Ok(Tensor::from_storage(s, &shape).attach_saving(
            "index_select",
            &[&x],
            &[&read],
            move |g, _| {
                let z = Tensor::zeros(&in_shape, g.dtype(), g.device())?;
                let (gs, is) = (g.storage(), idx.storage());
                z.0.storage
                    .write(|s| s.index_add(&in_shape, d, (&is, idx.layout()), (&gs, g.layout())))?;
                Ok(vec![Some(z)])
            },
        ))
    }

    /// `out[i][j] = self[index[i][j]][j]` for `dim = 0` (and so on): PyTorch's `gather`.
    pub fn gather(&self, dim: isize, index: &Tensor) -> Result<Tensor> {
        let _prof = crate::profiler::op(Op::Gather.name());
        let [x, idx] = dispatch(Op::Gather, [self, index])?;
        expect_index(Op::Gather, &idx)?;
        let d = normalize_dim("gather", dim, x.shape())?;
        check_index_shape("gather", &idx, x.shape(), d, None)?;
        let s = x
            .storage()
            .gather(x.layout(), d, &idx.storage(), idx.layout())?;
        let (in_shape, saved) = (x.shape().to_vec(), idx.clone());
        Ok(Tensor::from_storage(s, idx.shape()).attach_saving(
            "gather",
            &[&x],
            &[&idx],
            move |g, _| {
                let z = Tensor::zeros(&in_shape, g.dtype(), g.device())?;
                Ok(vec![Some(z.scatter_add(d as isize, &saved, g)?)])
            },
        ))
    }

    /// A copy of `self` with `src` added at the positions `index` names along `dim`
    /// (PyTorch's out-of-place `scatter_add`).
    pub fn scatter_add(&self, dim: isize, index: &Tensor, src: &Tensor) -> Result<Tensor> {
        let _prof = crate::profiler::op(Op::ScatterAdd.name());
        let [x, idx, src] = dispatch(Op::ScatterAdd, [self, index, src])?;
        expect_index(Op::ScatterAdd, &idx)?;
        super::expect_same_dtype(Op::ScatterAdd, &x, &src)?;
        let d = normalize_dim("scatter_add", dim, x.shape())?;
        check_index_shape("scatter_add", &idx, x.shape(), d, Some(src.shape()))?;
        let mut s = x.storage().copy_strided(x.layout())?;
        s.scatter_add(
            x.shape(),
            d,
            (&idx.storage(), idx.layout()),
            (&src.storage(), src.layout()),
        )?;
        let saved = idx.clone();
        let src_shape = src.shape().to_vec();
        Ok(Tensor::from_storage(s, x.shape()).attach_saving(
            "scatter_add",
            &[&x, &src],
            &[&idx],
            move |g, needs| {
                let gs = match needs[1] {
                    true => Some(g.gather(d as isize, &saved)?.pad_to(&src_shape)?),
                    false => None,
                };
                Ok(vec![Some(g.clone()), gs])
            },
        ))
    }

    /// Zero-pads a tensor at the end of each dim up to `shape` (for an index smaller than src).
    fn pad_to(&self, shape: &[usize]) -> Result<Tensor> {
        let mut t = self.clone();
        for (d, &n) in shape.iter().enumerate() {
            if t.shape()[d] != n {
                let mut s = t.shape().to_vec();
                s[d] = n;
                t = t.pad_into(&s, d, 0)?;
            }
        }
        Ok(t)
    }

    /// Rows of `weight` (`[num, dim]`) for each index: output `index.shape + [dim]`. An index
    /// outside `0..num` is an [`Error::IndexOutOfRange`] of `embedding` naming it and `num`
    /// (on a CUDA device the check runs in the kernel, and its error comes at the next read
    /// from the device, as the gather's does).
    ///
    /// ```
    /// use mantissa::{Device, DType, Tensor};
    /// let w = Tensor::arange(0.0, 6.0, 1.0, DType::F32, Device::Cpu)?.reshape(&[3, 2])?;
    /// let idx = Tensor::from_vec(vec![2i64, 0], &[2], Device::Cpu)?;
    /// assert_eq!(Tensor::embedding(&idx, &w)?.to_vec::<f32>()?, vec![4.0, 5.0, 0.0, 1.0]);
    /// let bad = Tensor::from_vec(vec![3i64], &[1], Device::Cpu)?;
    /// let e = Tensor::embedding(&bad, &w).unwrap_err().to_string();
    /// assert!(e.contains("embedding") && e.contains("index 3") && e.contains("size 3"), "{e}");
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn embedding(index: &Tensor, weight: &Tensor) -> Result<Tensor> {
        let _prof = crate::profiler::op(Op::Embedding.name());
        let [w, idx] = dispatch(Op::Embedding, [weight, index])?;
        expect_index(Op::Embedding, &idx)?;
        super::expect_rank(Op::Embedding, &w, 2, "the weight")?;
        let flat = idx.flatten(0, -1)?;
        // The gather's range error, told as the embedding's: the user called this.
        let rows = w.index_select(0, &flat).map_err(|e| match e {
            Error::IndexOutOfRange {
                index, dim, size, ..
            } => Error::IndexOutOfRange {
                op: Op::Embedding.name(),
                index,
                dim,
                size,
            },
            e => e,
        })?;
        let mut shape = idx.shape().to_vec();
        shape.push(w.shape()[1]);
        rows.reshape(&shape)
    }

    /// [`Tensor::embedding`] with PyTorch's `padding_idx`: the positions whose index is
    /// `padding_idx` read that row as usual but send it no gradient, so the row's gradient is
    /// always zero (`None`: plain [`Tensor::embedding`]). `padding_idx` must be a row of
    /// `weight`.
    ///
    /// ```
    /// use mantissa::{Device, DType, Tensor};
    /// let w = Tensor::ones(&[3, 2], DType::F32, Device::Cpu)?.requires_grad(true)?;
    /// let idx = Tensor::from_vec(vec![0i64, 1, 0], &[3], Device::Cpu)?;
    /// Tensor::embedding_padded(&idx, &w, Some(0))?.sum_all()?.backward()?;
    /// assert_eq!(w.grad().unwrap().to_vec::<f32>()?, vec![0.0, 0.0, 1.0, 1.0, 0.0, 0.0]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn embedding_padded(
        index: &Tensor,
        weight: &Tensor,
        padding_idx: Option<usize>,
    ) -> Result<Tensor> {
        let rows = Tensor::embedding(index, weight)?;
        let Some(p) = padding_idx else {
            return Ok(rows);
        };
        let num = weight.shape()[0];
        if p >= num {
            return Err(Error::invalid(
                Op::Embedding.name(),
                format!(
                    "padding_idx {p} out of range for a weight of {num} rows (shape {:?})",
                    weight.shape()
                ),
            ));
        }
        if !rows.is_requires_grad() {
            return Ok(rows);
        }
        // The same values everywhere; at the padding positions they come from a detached
        // copy of the output, so no gradient reaches the padding row through them.
        let keep = index.ne(p as i64)?.unsqueeze(-1)?;
        Tensor::where_cond(&keep, &rows, &rows.detach())
    }
}

/// PyTorch's rule for gather/scatter indices: same rank, and no larger than the source (and
/// than the destination outside `dim`).
fn check_index_shape(
    op: &'static str,
    idx: &Tensor,
    shape: &[usize],
    dim: usize,
    src: Option<&[usize]>,
) -> Result<()> {
    let bad = |other: &[usize]| Error::ShapeMismatch {
        op,
        lhs: other.to_vec(),
        rhs: idx.shape().to_vec(),
    };
    if idx.rank() != shape.len() {
        return Err(bad(shape));
    }
    for (i, &n) in idx.shape().iter().enumerate() {
        if i != dim && n > shape[i] {
            return Err(bad(shape));
        }
    }
    if let Some(src) = src {
        if src.len() != idx.rank() || idx.shape().iter().zip(src).any(|(a, b)| a > b) {
            return Err(bad(src));
        }
    }
    Ok(())
}
