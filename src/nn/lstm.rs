//! Multi-layer LSTM (`nn.LSTM`), gates in PyTorch's order (input, forget, cell, output).

use super::{join, uniform_param, Module, TensorKind, Visitor, VisitorMut};
use crate::{Error, Generator, Result, Tensor};

struct Layer {
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor,
    b_hh: Tensor,
}

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
    layers: Vec<Layer>,
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
        if input_size == 0 || hidden == 0 || num_layers == 0 {
            return Err(Error::invalid(
                "Lstm::new",
                format!("input {input_size}, hidden {hidden}, layers {num_layers}"),
            ));
        }
        let k = 1.0 / (hidden as f64).sqrt();
        let layers = (0..num_layers)
            .map(|l| {
                let inp = if l == 0 { input_size } else { hidden };
                Ok(Layer {
                    w_ih: uniform_param(&[4 * hidden, inp], k, gen)?,
                    w_hh: uniform_param(&[4 * hidden, hidden], k, gen)?,
                    b_ih: uniform_param(&[4 * hidden], k, gen)?,
                    b_hh: uniform_param(&[4 * hidden], k, gen)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Lstm {
            layers,
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
        if x.rank() != 3 || x.shape()[2] != self.input_size {
            return Err(Error::invalid(
                "lstm",
                format!(
                    "input must be 3-D with {} features, got {:?}",
                    self.input_size,
                    x.shape()
                ),
            ));
        }
        let given = x.shape().to_vec();
        let x = if self.batch_first {
            x.transpose(0, 1)?
        } else {
            x.clone()
        };
        let (steps, batch) = (x.shape()[0], x.shape()[1]);
        if steps == 0 {
            // PyTorch refuses it too: there would be no final state to return.
            return Err(Error::invalid(
                "lstm",
                format!("a sequence of length 0 (input {given:?})"),
            ));
        }
        let want = [self.layers.len(), batch, self.hidden];
        let (h0, c0) = match state {
            Some((h, c)) if h.shape() == want && c.shape() == want => (h.clone(), c.clone()),
            Some((h, c)) => {
                let bad = if h.shape() != want { h } else { c };
                return Err(Error::ShapeMismatch {
                    op: "lstm (initial state)",
                    lhs: want.to_vec(),
                    rhs: bad.shape().to_vec(),
                });
            }
            None => {
                let z = Tensor::zeros(&want, x.dtype(), x.device())?;
                (z.clone(), z)
            }
        };
        // Each layer is one op over the whole sequence (`Tensor::lstm_layer`).
        let (mut seq, mut hn, mut cn) = (x, Vec::new(), Vec::new());
        for (l, layer) in self.layers.iter().enumerate() {
            let b = layer.b_ih.add(&layer.b_hh)?;
            let (h, c) = (
                h0.narrow(0, l, 1)?.squeeze(0)?,
                c0.narrow(0, l, 1)?.squeeze(0)?,
            );
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
        for (l, layer) in self.layers.iter().enumerate() {
            f(
                join(p, &format!("weight_ih_l{l}")),
                &layer.w_ih,
                TensorKind::Parameter,
            );
            f(
                join(p, &format!("weight_hh_l{l}")),
                &layer.w_hh,
                TensorKind::Parameter,
            );
            f(
                join(p, &format!("bias_ih_l{l}")),
                &layer.b_ih,
                TensorKind::Parameter,
            );
            f(
                join(p, &format!("bias_hh_l{l}")),
                &layer.b_hh,
                TensorKind::Parameter,
            );
        }
    }
    fn visit_mut(&mut self, p: &str, f: &mut VisitorMut) -> Result<()> {
        for (l, layer) in self.layers.iter_mut().enumerate() {
            f(
                join(p, &format!("weight_ih_l{l}")),
                &mut layer.w_ih,
                TensorKind::Parameter,
            )?;
            f(
                join(p, &format!("weight_hh_l{l}")),
                &mut layer.w_hh,
                TensorKind::Parameter,
            )?;
            f(
                join(p, &format!("bias_ih_l{l}")),
                &mut layer.b_ih,
                TensorKind::Parameter,
            )?;
            f(
                join(p, &format!("bias_hh_l{l}")),
                &mut layer.b_hh,
                TensorKind::Parameter,
            )?;
        }
        Ok(())
    }
}
