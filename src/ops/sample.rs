//! `multinomial`: indices drawn from rows of category weights, on the weights' device, from an
//! engine [`Generator`]. With replacement, by inverse CDF: one uniform value per sample,
//! scaled to the row's total, against the row's running sums; without, PyTorch's way: each
//! category's weight divided by an Exponential(1) draw, the largest keys taken (the order of
//! an exponential race is that of drawing one at a time without replacement).

use crate::random::Generator;
use crate::{DType, Error, Result, Tensor};

/// PyTorch's limit on the number of categories.
const MAX_CATEGORIES: usize = 1 << 24;

/// With replacement, the samples compared against the running sums in pieces of at most
/// this many `[row, sample, category]` elements.
const PIECE: usize = 1 << 24;

impl Tensor {
    /// `num_samples` category indices (I64) per row of non-negative weights (PyTorch's
    /// `torch.multinomial`): weights `[C]` give `[num_samples]`, `[R, C]` give
    /// `[R, num_samples]`. The weights need not sum to 1; a category is drawn with probability
    /// its weight over the row's sum, so a zero weight is never drawn. With `replacement`
    /// the draws are independent; without, a row's indices are distinct, in the order a
    /// one-at-a-time draw would give them. The draws run on the weights' device, their
    /// random numbers from `gen` ([`Tensor::rand_with`]), so the same seed gives the same
    /// indices.
    ///
    /// Errors, as PyTorch's: weights that are not a float dtype or not of rank 1 or 2, a
    /// negative, infinite or NaN weight, a row summing to 0, `num_samples` 0, more than
    /// 2^24 categories, and, without replacement, more samples than the row has categories
    /// of positive weight. The weights are checked on the host: one small read back of a
    /// few numbers per row.
    ///
    /// ```
    /// use mantissa::{Device, Generator, Tensor};
    /// let w = Tensor::from_vec(vec![0.0f32, 3.0, 1.0, 0.0], &[4], Device::Cpu)?;
    /// let mut g = Generator::new(0);
    /// let draws = w.multinomial(1000, true, &mut g)?.to_vec::<i64>()?;
    /// assert!(draws.iter().all(|&i| i == 1 || i == 2));
    /// let mut both = w.multinomial(2, false, &mut g)?.to_vec::<i64>()?;
    /// both.sort();
    /// assert_eq!(both, vec![1, 2]);
    /// assert!(w.multinomial(3, false, &mut g).is_err()); // two categories can be drawn
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn multinomial(
        &self,
        num_samples: usize,
        replacement: bool,
        gen: &mut Generator,
    ) -> Result<Tensor> {
        let op = "multinomial";
        let _prof = crate::profiler::op(op);
        if !self.dtype().is_float() {
            return Err(Error::DType {
                op,
                dtype: self.dtype(),
                expected: "float weights",
            });
        }
        let (rows, c) = match *self.shape() {
            [c] => (1, c),
            [r, c] => (r, c),
            _ => {
                return Err(Error::invalid(
                    op,
                    format!("needs weights [C] or [R, C], got shape {:?}", self.shape()),
                ))
            }
        };
        if num_samples == 0 {
            return Err(Error::invalid(op, "cannot draw 0 samples"));
        }
        if c > MAX_CATEGORIES {
            return Err(Error::invalid(
                op,
                format!(
                    "{c} categories (shape {:?}) is more than 2^24",
                    self.shape()
                ),
            ));
        }
        if !replacement && num_samples > c {
            return Err(Error::invalid(
                op,
                format!(
                    "cannot draw {num_samples} samples without replacement from {c} categories \
                     (shape {:?})",
                    self.shape()
                ),
            ));
        }
        crate::no_grad(|| {
            // Rows of `[R, C]` in the dtype the arithmetic runs in (f32 for half weights).
            let dt = match self.dtype() {
                DType::F64 => DType::F64,
                _ => DType::F32,
            };
            let w = self.detach().to_dtype(dt)?.reshape(&[rows, c])?;
            let pos = w.gt(0.0)?;
            check_rows(&w, &pos, num_samples, replacement, self.shape())?;
            let out = if rows == 0 {
                Tensor::zeros(&[0, num_samples], DType::I64, self.device())
            } else if replacement {
                with_replacement(&w, &pos, num_samples, gen)
            } else {
                without_replacement(&w, &pos, num_samples, gen)
            }?;
            match self.rank() {
                1 => out.reshape(&[num_samples]),
                _ => Ok(out),
            }
        })
    }
}

/// Reads back, per row, the count of negative, infinite or NaN weights, the sum and the
/// count of positive weights, and refuses a row PyTorch refuses.
fn check_rows(
    w: &Tensor,
    pos: &Tensor,
    n: usize,
    replacement: bool,
    shape: &[usize],
) -> Result<()> {
    let op = "multinomial";
    // NaN is the one value unequal to itself.
    let bad = w
        .lt(0.0)?
        .add(&w.ne(w)?)?
        .add(&w.abs()?.eq(f64::INFINITY)?)?
        .sum(&[-1], false)?;
    let sum = w.sum(&[-1], false)?;
    let positive = pos.sum(&[-1], false)?;
    let stats = Tensor::stack(&[&bad, &sum, &positive], -1)?.to_vec_f64()?;
    for (r, s) in stats.chunks_exact(3).enumerate() {
        let (bad, sum, positive) = (s[0], s[1], s[2]);
        let row = match shape.len() {
            1 => String::from("the weights"),
            _ => format!("row {r} of the weights"),
        };
        if bad > 0.0 {
            return Err(Error::invalid(
                op,
                format!("{row} (shape {shape:?}) hold a negative, infinite or NaN value"),
            ));
        }
        if sum <= 0.0 {
            return Err(Error::invalid(
                op,
                format!("{row} (shape {shape:?}) sum to 0: there is nothing to draw"),
            ));
        }
        if !replacement && positive < n as f64 {
            return Err(Error::invalid(
                op,
                format!(
                    "{row} (shape {shape:?}) have {positive} categories of positive weight, \
                     fewer than the {n} samples drawn without replacement"
                ),
            ));
        }
    }
    Ok(())
}

/// `n` independent draws per row of `w` (`[R, C]`, checked): sample `s` of row `r` is the
/// first category whose running sum passes `u * total` (`u` uniform in [0, 1)). A zero
/// weight never passes (its running sum is taken as -1), and the row's last positive
/// category always does (its running sum as +inf), so rounding in the running sums can
/// neither pick a zero weight nor run past the end.
fn with_replacement(w: &Tensor, pos: &Tensor, n: usize, gen: &mut Generator) -> Result<Tensor> {
    let (rows, c) = (w.shape()[0], w.shape()[1]);
    let dev = w.device();
    let cdf = w.cumsum(-1)?;
    let total = cdf.narrow(1, c - 1, 1)?;
    // The last positive category: positive, and the running count of positives is the
    // row's count there.
    let count = pos.cumsum(-1)?;
    let last = pos.mul(&count.eq(&count.narrow(1, c - 1, 1)?)?)?;
    let cdf = cdf.masked_fill(&pos.eq(0)?, -1.0)?;
    let cdf = cdf.masked_fill(&last, f64::INFINITY)?.unsqueeze(1)?;
    let u = Tensor::rand_with(&[rows, n], 0.0, 1.0, w.dtype(), dev, gen)?.mul(&total)?;
    let piece = (PIECE / (rows * c)).max(1);
    let mut parts = Vec::with_capacity(n.div_ceil(piece));
    let mut start = 0;
    while start < n {
        let len = piece.min(n - start);
        let target = u.narrow(1, start, len)?.unsqueeze(2)?;
        // [R, len, C]: 1 where the running sum passes the target; the first 1 is the draw.
        let passes = cdf.gt(&target)?.to_dtype(DType::F32)?;
        parts.push(passes.argmax(-1, false)?);
        start += len;
    }
    let refs: Vec<&Tensor> = parts.iter().collect();
    Tensor::cat(&refs, 1)
}

/// `n` distinct draws per row of `w` (`[R, C]`, checked, with at least `n` positive
/// weights): the `n` largest keys `w / e`, `e` drawn from Exponential(1) as `-ln(1 - u)`.
/// Zero weights get key -1, below every positive weight's key (>= 0), so they are never
/// taken.
fn without_replacement(w: &Tensor, pos: &Tensor, n: usize, gen: &mut Generator) -> Result<Tensor> {
    let u = Tensor::rand_with(w.shape(), 0.0, 1.0, w.dtype(), w.device(), gen)?;
    let e = u.rsub(1.0)?.log()?.neg()?;
    let keys = w.div(&e)?.masked_fill(&pos.eq(0)?, -1.0)?;
    Ok(keys.topk(n, -1, true)?.1)
}
