//! Multi-layer LSTM (`nn.LSTM`), gates in PyTorch's order (input, forget, cell, output).

use super::recurrent::RnnLayer;
use super::recurrent::{initial, layer_of, new_layers, seq_first, visit_layers, visit_layers_mut};
use super::{Module, Visitor, VisitorMut};
use crate::{Generator, Result, Tensor};

/// A stack of LSTM layers. Input `[seq, batch, in]`, or `[batch, seq, in]` with `batch_first`.
///
/// ```
/// use mantissa::nn::Lstm;
/// use mantissa::{Generator, Tensor, DType, Device};
/// let lstm = Lstm::new(3, 5, 2, true, &mut Generator::new(0))?;
/// let x = Tensor::ones(&[4, 7, 3], DType::F32, Device::Cpu)?;
/// let (y, (h, c)) = lstm.forward_with_state(&x, None)?;
/// assert_eq!((y.shape(), h.shape(), c.shape()), (&[4, 7, 5][..], &[2, 4, 5][..], &[2, 4, 5][..]));
/// # Ok::<(), mantissa::Error>(())
/// ```
pub struct Lstm {
    layers: Vec<RnnLayer>,
    pub input_size: usize,
    pub hidden: usize,
    pub batch_first: bool,
}

impl Lstm {
    /// Every weight and bias from U(-1/sqrt(hidden), 1/sqrt(hidden)), as PyTorch does.
    pub fn new(
        input_size: usize,
        hidden: usize,
        num_layers: usize,
        batch_first: bool,
        gen: &mut Generator,
    ) -> Result<Lstm> {
        Ok(Lstm {
            layers: new_layers("Lstm::new", 4, (input_size, hidden, num_layers), gen)?,
            input_size,
            hidden,
            batch_first,
        })
    }

    /// Runs the sequence from `state` (`(h0, c0)`, each `[layers, batch, hidden]`; zeros when
    /// `None`) and returns the output sequence and the final `(h, c)`.
    pub fn forward_with_state(
        &self,
        x: &Tensor,
        state: Option<(&Tensor, &Tensor)>,
    ) -> Result<(Tensor, (Tensor, Tensor))> {
        let x = seq_first("lstm", x, self.input_size, self.batch_first)?;
        let want = [self.layers.len(), x.shape()[1], self.hidden];
        let op = "lstm (initial state)";
        let h0 = initial(op, state.map(|s| s.0), want, &x)?;
        let c0 = initial(op, state.map(|s| s.1), want, &x)?;
        // Each layer is one op over the whole sequence (`Tensor::lstm_layer`).
        let (mut seq, mut hn, mut cn) = (x, Vec::new(), Vec::new());
        for (l, layer) in self.layers.iter().enumerate() {
            let b = layer.b_ih.add(&layer.b_hh)?;
            let (h, c) = (layer_of(&h0, l)?, layer_of(&c0, l)?);
            let (y, h, c) = Tensor::lstm_layer(&seq, &h, &c, &layer.w_ih, &layer.w_hh, &b)?;
            seq = y;
            hn.push(h);
            cn.push(c);
        }
        let out = if self.batch_first {
            seq.transpose(0, 1)?
        } else {
            seq
        };
        let stack = |v: &[Tensor]| Tensor::stack(&v.iter().collect::<Vec<_>>(), 0);
        Ok((out, (stack(&hn)?, stack(&cn)?)))
    }
}

impl Module for Lstm {
    /// The output sequence from a zero state.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.forward_with_state(x, None)?.0)
    }
    fn visit(&self, p: &str, f: &mut Visitor) {
        visit_layers(&self.layers, p, f);
    }
    fn visit_mut(&mut self, p: &str, f: &mut VisitorMut) -> Result<()> {
        visit_layers_mut(&mut self.layers, p, f)
    }
}
