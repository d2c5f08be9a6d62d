//! Multi-layer GRU (`nn.GRU`), gates in PyTorch's order (reset, update, new).

use super::recurrent::RnnLayer;
use super::recurrent::{initial, layer_of, new_layers, seq_first, visit_layers, visit_layers_mut};
use super::{Module, Visitor, VisitorMut};
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
/// Input `[seq, batch, in]`, or `[batch, seq, in]` with `batch_first`; the same parameter
/// names as PyTorch (`weight_ih_l0`, ...), so weights move across with `state_dict`. Each
/// layer projects the whole input sequence in one product; the steps are compositions of
/// existing ops (one product with `W_hh` and a few elementwise ops each), on any device.
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
    layers: Vec<RnnLayer>,
    pub input_size: usize,
    pub hidden: usize,
    pub batch_first: bool,
}

impl Gru {
    /// Every weight and bias from U(-1/sqrt(hidden), 1/sqrt(hidden)), as PyTorch does.
    pub fn new(
        input_size: usize,
        hidden: usize,
        num_layers: usize,
        batch_first: bool,
        gen: &mut Generator,
    ) -> Result<Gru> {
        Ok(Gru {
            layers: new_layers("Gru::new", 3, (input_size, hidden, num_layers), gen)?,
            input_size,
            hidden,
            batch_first,
        })
    }

    /// Runs the sequence from `h0` (`[layers, batch, hidden]`; zeros when `None`) and returns
    /// the output sequence and the final state `[layers, batch, hidden]`.
    pub fn forward_with_state(&self, x: &Tensor, h0: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        let x = seq_first("gru", x, self.input_size, self.batch_first)?;
        let want = [self.layers.len(), x.shape()[1], self.hidden];
        let h0 = initial("gru (initial state)", h0, want, &x)?;
        let mut seq = x;
        let mut hn = Vec::new();
        for (l, layer) in self.layers.iter().enumerate() {
            let (y, h) = gru_layer(&seq, layer_of(&h0, l)?, layer)?;
            seq = y;
            hn.push(h);
        }
        let out = match self.batch_first {
            true => seq.transpose(0, 1)?,
            false => seq,
        };
        Ok((out, Tensor::stack(&hn.iter().collect::<Vec<_>>(), 0)?))
    }
}

/// One layer over the sequence `[seq, batch, in]` from `h` `[batch, hidden]`: the outputs
/// `[seq, batch, hidden]` and the last state.
fn gru_layer(seq: &Tensor, mut h: Tensor, w: &RnnLayer) -> Result<(Tensor, Tensor)> {
    // Every step's input projection in one product.
    let xi = seq.linear(&w.w_ih, Some(&w.b_ih))?;
    let mut outs = Vec::with_capacity(seq.shape()[0]);
    for t in 0..seq.shape()[0] {
        let x = xi.select(0, t as i64)?.chunk(3, -1)?;
        let hh = h.linear(&w.w_hh, Some(&w.b_hh))?.chunk(3, -1)?;
        let r = x[0].add(&hh[0])?.sigmoid()?;
        let z = x[1].add(&hh[1])?.sigmoid()?;
        let n = x[2].add(&r.mul(&hh[2])?)?.tanh()?;
        // (1 - z) n + z h, as n + z (h - n).
        h = n.add(&z.mul(&h.sub(&n)?)?)?;
        outs.push(h.clone());
    }
    let y = Tensor::stack(&outs.iter().collect::<Vec<_>>(), 0)?;
    Ok((y, h))
}

impl Module for Gru {
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
