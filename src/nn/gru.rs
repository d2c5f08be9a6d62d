//! Multi-layer GRU (`nn.GRU`), gates in PyTorch's order (reset, update, new).

use super::recurrent::{in_order, steps, RnnLayer, Stack};
use super::{Module, RnnOptions, Visitor, VisitorMut};
use crate::{Generator, Result, Tensor};

/// A stack of GRU layers, PyTorch's `nn.GRU`: per step, with `x` the layer's input and `h`
/// its state,
///
/// ```text
/// r = sigmoid(W_ir x + b_ir + W_hr h + b_hr)
/// z = sigmoid(W_iz x + b_iz + W_hz h + b_hz)
/// n = tanh(W_in x + b_in + r * (W_hn h + b_hn))
/// h' = (1 - z) * n + z * h
/// ```
///
/// Input `[seq, batch, in]`, `[batch, seq, in]` with `batch_first`, or unbatched `[seq, in]`;
/// PyTorch's variants through [`RnnOptions`] (bidirectional, no biases, dropout between
/// layers) and the same parameter names as PyTorch (`weight_ih_l0`, `bias_hh_l1_reverse`,
/// ...), so weights move across with `state_dict`. Each layer projects the whole input
/// sequence in one product; the steps are compositions of existing ops (one product with
/// `W_hh` and a few elementwise ops each), on any device.
///
/// ```
/// use mantissa::nn::Gru;
/// use mantissa::{Generator, Tensor, DType, Device};
/// let gru = Gru::new(3, 5, 2, true, &mut Generator::new(0))?;
/// let x = Tensor::ones(&[4, 7, 3], DType::F32, Device::Cpu)?;
/// let (y, h) = gru.forward_with_state(&x, None)?;
/// assert_eq!((y.shape(), h.shape()), (&[4, 7, 5][..], &[2, 4, 5][..]));
/// # Ok::<(), mantissa::Error>(())
/// ```
pub struct Gru {
    stack: Stack,
    pub input_size: usize,
    pub hidden: usize,
    pub batch_first: bool,
}

impl Gru {
    /// `num_layers` layers with biases, one direction, no dropout; every weight and bias
    /// from U(-1/sqrt(hidden), 1/sqrt(hidden)), as PyTorch does.
    pub fn new(
        input_size: usize,
        hidden: usize,
        num_layers: usize,
        batch_first: bool,
        gen: &mut Generator,
    ) -> Result<Gru> {
        let opts = RnnOptions {
            num_layers,
            batch_first,
            ..Default::default()
        };
        Gru::make("Gru::new", input_size, hidden, opts, gen)
    }

    /// PyTorch's `nn.GRU(input_size, hidden, **opts)`, initialised as PyTorch does. Refuses
    /// a `proj_size` (PyTorch's GRU has none) and a dropout outside `[0, 1]`.
    pub fn with_options(
        input_size: usize,
        hidden: usize,
        opts: RnnOptions,
        gen: &mut Generator,
    ) -> Result<Gru> {
        Gru::make("Gru::with_options", input_size, hidden, opts, gen)
    }

    fn make(
        op: &'static str,
        input_size: usize,
        hidden: usize,
        opts: RnnOptions,
        gen: &mut Generator,
    ) -> Result<Gru> {
        opts.check(op, input_size, hidden, false)?;
        Ok(Gru {
            stack: Stack::new(op, 3, (input_size, hidden), &opts, gen)?,
            input_size,
            hidden,
            batch_first: opts.batch_first,
        })
    }

    /// The options the module was made with.
    pub fn options(&self) -> RnnOptions {
        self.stack.options(self.batch_first)
    }

    /// Runs the sequence from `h0` (`[layers * directions, batch, hidden]`, or `[layers *
    /// directions, hidden]` for an unbatched input; zeros when `None`) and returns the output
    /// sequence (`directions * hidden` features) and the final state, shaped as `h0`.
    pub fn forward_with_state(&self, x: &Tensor, h0: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        let (y, mut states) = self.stack.run(
            ("gru", "gru (initial state)"),
            x,
            (self.input_size, self.batch_first),
            &[(h0, self.hidden)],
            |seq, w, reverse, mut s| Ok((gru_layer(seq, &mut s[0], w, reverse)?, s)),
        )?;
        Ok((y, states.remove(0)))
    }
}

/// One layer in one direction over the sequence `[seq, batch, in]` from `h` `[batch,
/// hidden]`, which becomes the last state: the outputs `[seq, batch, hidden]`.
fn gru_layer(seq: &Tensor, h: &mut Tensor, w: &RnnLayer, reverse: bool) -> Result<Tensor> {
    // Every step's input projection in one product.
    let xi = seq.linear(&w.w_ih, w.b_ih.as_ref())?;
    let mut outs = Vec::with_capacity(seq.shape()[0]);
    for t in steps(seq.shape()[0], reverse) {
        let x = xi.select(0, t as i64)?.chunk(3, -1)?;
        let hh = h.linear(&w.w_hh, w.b_hh.as_ref())?.chunk(3, -1)?;
        let r = x[0].add(&hh[0])?.sigmoid()?;
        let z = x[1].add(&hh[1])?.sigmoid()?;
        let n = x[2].add(&r.mul(&hh[2])?)?.tanh()?;
        // (1 - z) n + z h, as n + z (h - n).
        *h = n.add(&z.mul(&h.sub(&n)?)?)?;
        outs.push(h.clone());
    }
    in_order(outs, reverse)
}

impl Module for Gru {
    /// The output sequence from a zero state.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.forward_with_state(x, None)?.0)
    }
    fn visit(&self, p: &str, f: &mut Visitor) {
        self.stack.visit(p, f);
    }
    fn visit_mut(&mut self, p: &str, f: &mut VisitorMut) -> Result<()> {
        self.stack.visit_mut(p, f)
    }
    fn set_training(&mut self, on: bool) {
        self.stack.set_training(on);
    }
}
