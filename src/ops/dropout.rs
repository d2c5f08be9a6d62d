//! Dropout: a Philox mask drawn on the tensor's device, multiplied in.

use super::{dispatch, expect_float, Op};
use crate::backend::Storage;
use crate::random::{default_stream, Generator};
use crate::{Error, Result, Tensor};

impl Tensor {
    /// Zeroes each element with probability `p` and scales the rest by `1 / (1 - p)` when
    /// `training`; identity otherwise. Draws from `gen`.
    pub fn dropout_with(&self, p: f64, training: bool, gen: &mut Generator) -> Result<Tensor> {
        self.dropout_from(p, training, |b| Ok(gen.stream(b)))
    }

    /// Dropout drawing from this thread's default generator.
    pub fn dropout(&self, p: f64, training: bool) -> Result<Tensor> {
        self.dropout_from(p, training, |b| Ok(default_stream(b)))
    }

    /// Dropout with its mask from the stream `draw(blocks)` gives, taken before the mask's
    /// kernel runs (so `draw` may hold a lock: nothing runs while it does).
    pub(crate) fn dropout_from(
        &self,
        p: f64,
        training: bool,
        draw: impl FnOnce(u64) -> Result<(u64, u64)>,
    ) -> Result<Tensor> {
        if !(0.0..=1.0).contains(&p) {
            return Err(Error::invalid(
                "dropout",
                format!("probability {p} not in [0, 1]"),
            ));
        }
        let _prof = crate::profiler::op(Op::Dropout.name());
        let [x] = dispatch(Op::Dropout, [self])?;
        expect_float(Op::Dropout, &x)?;
        if !training || p == 0.0 {
            return Ok(x);
        }
        if p == 1.0 {
            return x.mul(0.0);
        }
        // One Philox word per element, kept when the word is at least p * 2^32; the mask
        // holds 1 / (1 - p) or 0 in x's dtype and is drawn in one parallel pass. Inside a
        // gradient checkpoint the stream is recorded, and replayed when backward recomputes:
        // the same mask both times.
        let n = x.numel();
        let stream = draw(n.div_ceil(4) as u64)?;
        let threshold = (p * 4_294_967_296.0).ceil() as u64;
        let storage =
            Storage::dropout_mask(x.device(), n, threshold, 1.0 / (1.0 - p), stream, x.dtype())?;
        x.mul(&Tensor::from_storage(storage, x.shape()))
    }
}
