//! Multi-layer LSTM (`nn.LSTM`), gates in PyTorch's order (input, forget, cell, output).

use super::recurrent::{in_order, reversed, steps, RnnLayer, Stack};
use super::{Module, RnnOptions, Visitor, VisitorMut};
use crate::{Generator, Result, Tensor};

/// A stack of LSTM layers, PyTorch's `nn.LSTM`. Input `[seq, batch, in]`, `[batch, seq, in]`
/// with `batch_first`, or unbatched `[seq, in]`; PyTorch's variants through [`RnnOptions`]
/// (bidirectional, no biases, dropout between layers, a projection of `h` with `proj_size`)
/// and PyTorch's parameter names (`weight_ih_l0`, `weight_hr_l1_reverse`, ...), so weights
/// move across with `state_dict`.
///
/// Without a projection each layer and direction is one op over the whole sequence
/// ([`Tensor::lstm_layer`]; a layer without biases passes a zero bias, which adds nothing
/// and keeps the fused op). With one, the steps are compositions of existing ops: the
/// recurrent product, [`Tensor::lstm_cell`] and the product with `weight_hr`.
///
/// ```
/// use mantissa::nn::{Lstm, RnnOptions};
/// use mantissa::{Generator, Tensor, DType, Device};
/// let lstm = Lstm::new(3, 5, 2, true, &mut Generator::new(0))?;
/// let x = Tensor::ones(&[4, 7, 3], DType::F32, Device::Cpu)?;
/// let (y, (h, c)) = lstm.forward_with_state(&x, None)?;
/// assert_eq!((y.shape(), h.shape(), c.shape()), (&[4, 7, 5][..], &[2, 4, 5][..], &[2, 4, 5][..]));
///
/// // Projected to 2 features, both directions: h is [layers * 2, batch, 2], c keeps 5.
/// let opts = RnnOptions { bidirectional: true, proj_size: 2, batch_first: true, ..Default::default() };
/// let lstm = Lstm::with_options(3, 5, opts, &mut Generator::new(0))?;
/// let (y, (h, c)) = lstm.forward_with_state(&x, None)?;
/// assert_eq!((y.shape(), h.shape(), c.shape()), (&[4, 7, 4][..], &[2, 4, 2][..], &[2, 4, 5][..]));
/// # Ok::<(), mantissa::Error>(())
/// ```
pub struct Lstm {
    stack: Stack,
    pub input_size: usize,
    pub hidden: usize,
    pub batch_first: bool,
}

impl Lstm {
    /// `num_layers` layers with biases, one direction, no dropout, no projection; every
    /// weight and bias from U(-1/sqrt(hidden), 1/sqrt(hidden)), as PyTorch does.
    pub fn new(
        input_size: usize,
        hidden: usize,
        num_layers: usize,
        batch_first: bool,
        gen: &mut Generator,
    ) -> Result<Lstm> {
        let opts = RnnOptions {
            num_layers,
            batch_first,
            ..Default::default()
        };
        Lstm::make("Lstm::new", input_size, hidden, opts, gen)
    }

    /// PyTorch's `nn.LSTM(input_size, hidden, **opts)`, initialised as PyTorch does. Refuses
    /// a `proj_size` not smaller than `hidden` and a dropout outside `[0, 1]`.
    pub fn with_options(
        input_size: usize,
        hidden: usize,
        opts: RnnOptions,
        gen: &mut Generator,
    ) -> Result<Lstm> {
        Lstm::make("Lstm::with_options", input_size, hidden, opts, gen)
    }

    fn make(
        op: &'static str,
        input_size: usize,
        hidden: usize,
        opts: RnnOptions,
        gen: &mut Generator,
    ) -> Result<Lstm> {
        opts.check(op, input_size, hidden, true)?;
        Ok(Lstm {
            stack: Stack::new(op, 4, (input_size, hidden), &opts, gen)?,
            input_size,
            hidden,
            batch_first: opts.batch_first,
        })
    }

    /// The options the module was made with.
    pub fn options(&self) -> RnnOptions {
        self.stack.options(self.batch_first)
    }

    /// Runs the sequence from `state` (`(h0, c0)`: `[layers * directions, batch, out]` and
    /// `[layers * directions, batch, hidden]`, with `out` the `proj_size` when projected
    /// and `hidden` otherwise, without the batch dim for an unbatched input; zeros when
    /// `None`) and returns the output sequence (`directions * out` features) and the final
    /// `(h, c)`, shaped as `(h0, c0)`.
    pub fn forward_with_state(
        &self,
        x: &Tensor,
        state: Option<(&Tensor, &Tensor)>,
    ) -> Result<(Tensor, (Tensor, Tensor))> {
        let out = self.options().output_size(self.hidden);
        let (y, mut s) = self.stack.run(
            ("lstm", "lstm (initial state)"),
            x,
            (self.input_size, self.batch_first),
            &[(state.map(|s| s.0), out), (state.map(|s| s.1), self.hidden)],
            |seq, w, reverse, s| {
                let (y, h, c) = match &w.w_hr {
                    None => fused_layer(seq, &s[0], &s[1], w, reverse)?,
                    Some(w_hr) => projected_layer(seq, &s[0], &s[1], w, w_hr, reverse)?,
                };
                Ok((y, vec![h, c]))
            },
        )?;
        let c = s.remove(1);
        Ok((y, (s.remove(0), c)))
    }
}

/// One layer in one direction as one op ([`Tensor::lstm_layer`]): the outputs `[seq, batch,
/// hidden]` in sequence order and the final `(h, c)`. The reverse direction runs the op on
/// the reversed sequence and reverses its outputs back.
fn fused_layer(
    seq: &Tensor,
    h: &Tensor,
    c: &Tensor,
    w: &RnnLayer,
    reverse: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    let b = match w.bias_sum()? {
        Some(b) => b,
        None => Tensor::zeros(&[w.w_ih.shape()[0]], w.w_ih.dtype(), w.w_ih.device())?,
    };
    if !reverse {
        return Tensor::lstm_layer(seq, h, c, &w.w_ih, &w.w_hh, &b);
    }
    let (y, h, c) = Tensor::lstm_layer(&reversed(seq)?, h, c, &w.w_ih, &w.w_hh, &b)?;
    Ok((reversed(&y)?, h, c))
}

/// One layer in one direction with a projection, step by step: the gates from the input's
/// projection (all steps in one product) and `W_hh h`, the cell ([`Tensor::lstm_cell`]),
/// then `h = W_hr (o * tanh(c))`. Returns the outputs `[seq, batch, proj_size]` in sequence
/// order and the final `(h, c)`.
fn projected_layer(
    seq: &Tensor,
    h: &Tensor,
    c: &Tensor,
    w: &RnnLayer,
    w_hr: &Tensor,
    reverse: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    let xi = seq.linear(&w.w_ih, w.bias_sum()?.as_ref())?;
    let (mut h, mut c) = (h.clone(), c.clone());
    let mut outs = Vec::with_capacity(seq.shape()[0]);
    for t in steps(seq.shape()[0], reverse) {
        let gates = xi.select(0, t as i64)?.add(&h.linear(&w.w_hh, None)?)?;
        let (full, c2) = Tensor::lstm_cell(&gates, &c)?;
        h = full.linear(w_hr, None)?;
        c = c2;
        outs.push(h.clone());
    }
    Ok((in_order(outs, reverse)?, h, c))
}

impl Module for Lstm {
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
