//! What the recurrent layers (`Lstm`, `Gru`) share: PyTorch's weights per layer and
//! direction with their names and initialisation, the input and state checks (batched,
//! batch-first or unbatched), the walk over layers and directions, and the dropout between
//! layers.

use super::{join, uniform_param, RnnOptions, TensorKind, Visitor, VisitorMut};
use crate::sync::lock;
use crate::{Error, Generator, Result, Tensor};
use std::sync::Mutex;

/// One layer's weights in one direction: `w_ih` `[gates * hidden, in]`, `w_hh`
/// `[gates * hidden, out]` (`out` is `hidden`, or `proj_size` when projected), the biases of
/// `gates * hidden` when the layer has them, and the projection `w_hr` `[proj_size, hidden]`
/// when it projects; the gate blocks in PyTorch's order.
pub(super) struct RnnLayer {
    pub w_ih: Tensor,
    pub w_hh: Tensor,
    pub b_ih: Option<Tensor>,
    pub b_hh: Option<Tensor>,
    pub w_hr: Option<Tensor>,
}

impl RnnLayer {
    /// The two biases summed (they are always added together before a gate), if any.
    pub fn bias_sum(&self) -> Result<Option<Tensor>> {
        match (&self.b_ih, &self.b_hh) {
            (Some(a), Some(b)) => Ok(Some(a.add(b)?)),
            _ => Ok(None),
        }
    }
}

/// The layers of a recurrent module in PyTorch's order (layer 0 forward, layer 0 reverse,
/// layer 1 forward, ...), with its mode and the generator of its dropout masks.
pub(super) struct Stack {
    pub layers: Vec<RnnLayer>,
    pub directions: usize,
    /// The dropout between layers; its generator exists where it can act (a probability
    /// above 0 and more than one layer).
    pub dropout: f64,
    generator: Option<Tensor>,
    /// Serialises the read-draw-write of the generator state between threads.
    drawing: Mutex<()>,
    training: bool,
}

impl Stack {
    /// `opts.num_layers` layers of `gates` gate blocks per direction, every weight and bias
    /// from U(-1/sqrt(hidden), 1/sqrt(hidden)) in PyTorch's order; then, where dropout can
    /// act, the seed of its generator from `gen`. `opts` must have passed
    /// [`RnnOptions::check`].
    pub fn new(
        op: &'static str,
        gates: usize,
        (input_size, hidden): (usize, usize),
        opts: &RnnOptions,
        gen: &mut Generator,
    ) -> Result<Stack> {
        let k = 1.0 / (hidden as f64).sqrt();
        let g = gates
            .checked_mul(hidden)
            .ok_or_else(|| Error::invalid(op, format!("hidden {hidden} is too large")))?;
        let (dirs, out) = (opts.directions(), opts.output_size(hidden));
        let mut layers = Vec::with_capacity(opts.num_layers * dirs);
        for l in 0..opts.num_layers {
            let inp = if l == 0 { input_size } else { out * dirs };
            for _ in 0..dirs {
                let w_ih = uniform_param(&[g, inp], k, gen)?;
                let w_hh = uniform_param(&[g, out], k, gen)?;
                let (b_ih, b_hh) = match opts.bias {
                    true => (
                        Some(uniform_param(&[g], k, gen)?),
                        Some(uniform_param(&[g], k, gen)?),
                    ),
                    false => (None, None),
                };
                let w_hr = match opts.proj_size {
                    0 => None,
                    p => Some(uniform_param(&[p, hidden], k, gen)?),
                };
                layers.push(RnnLayer {
                    w_ih,
                    w_hh,
                    b_ih,
                    b_hh,
                    w_hr,
                });
            }
        }
        let generator = (opts.dropout > 0.0 && opts.num_layers > 1).then(|| {
            let w = gen.next_u32s(2);
            Generator::new(((w[0] as u64) << 32) | w[1] as u64).state_tensor()
        });
        Ok(Stack {
            layers,
            directions: dirs,
            dropout: opts.dropout,
            generator,
            drawing: Mutex::new(()),
            training: true,
        })
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len() / self.directions
    }

    /// The options the stack was made with (`batch_first` from the module).
    pub fn options(&self, batch_first: bool) -> RnnOptions {
        let first = &self.layers[0];
        RnnOptions {
            num_layers: self.num_layers(),
            bias: first.b_ih.is_some(),
            batch_first,
            dropout: self.dropout,
            bidirectional: self.directions == 2,
            proj_size: first.w_hr.as_ref().map_or(0, |w| w.shape()[0]),
        }
    }

    /// Runs the stack over `x`: `[seq, batch, in]`, `[batch, seq, in]` with `batch_first`,
    /// or unbatched `[seq, in]`. `states` are the initial states (`h`, and `c` for an LSTM)
    /// with their widths: each given one `[layers * directions, batch, width]` (2-D without
    /// the batch for an unbatched input), zeros when `None`. `layer` runs one layer in one
    /// direction over `[seq, batch, in]` (backwards when told) from that layer's states
    /// `[batch, width]`, and returns its outputs `[seq, batch, out]` in sequence order and
    /// its final states. Returns the last layer's outputs (both directions' features,
    /// forward first) in the input's layout and the final states in the initial ones'.
    /// Errors name `op`, or `state_op` for an initial state.
    pub fn run(
        &self,
        (op, state_op): (&'static str, &'static str),
        x: &Tensor,
        (input_size, batch_first): (usize, bool),
        states: &[(Option<&Tensor>, usize)],
        layer: impl Fn(&Tensor, &RnnLayer, bool, Vec<Tensor>) -> Result<(Tensor, Vec<Tensor>)>,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let unbatched = x.rank() == 2;
        let seq = match (x.rank(), batch_first) {
            (2, _) => Some(x.unsqueeze(1)?),
            (3, true) => Some(x.transpose(0, 1)?),
            (3, false) => Some(x.clone()),
            _ => None,
        };
        let Some(mut seq) = seq.filter(|s| s.shape()[2] == input_size) else {
            return Err(Error::invalid(
                op,
                format!(
                    "input must be [seq, batch, {input_size}] (batch first: [batch, seq, \
                     {input_size}]) or unbatched [seq, {input_size}], got {:?}",
                    x.shape()
                ),
            ));
        };
        if seq.shape()[0] == 0 {
            // PyTorch refuses it too: there would be no final state to return.
            return Err(Error::invalid(
                op,
                format!("a sequence of length 0 (input {:?})", x.shape()),
            ));
        }
        let batch = seq.shape()[1];
        let n = self.layers.len();
        let init = states
            .iter()
            .map(|&(s, width)| initial(state_op, s, (n, batch, width), unbatched, &seq))
            .collect::<Result<Vec<_>>>()?;
        let mut finals: Vec<Vec<Tensor>> = vec![Vec::with_capacity(n); states.len()];
        for (l, dirs) in self.layers.chunks(self.directions).enumerate() {
            let mut outs = Vec::with_capacity(self.directions);
            for (d, weights) in dirs.iter().enumerate() {
                let i = l * self.directions + d;
                let s0 = init.iter().map(|s| s.select(0, i as i64));
                let (y, s) = layer(&seq, weights, d == 1, s0.collect::<Result<_>>()?)?;
                outs.push(y);
                for (f, s) in finals.iter_mut().zip(s) {
                    f.push(s);
                }
            }
            seq = match outs.len() {
                1 => outs.remove(0),
                _ => Tensor::cat(&outs.iter().collect::<Vec<_>>(), -1)?,
            };
            if l + 1 < self.num_layers() {
                seq = self.drop(&seq)?;
            }
        }
        let out = match (unbatched, batch_first) {
            (true, _) => seq.squeeze(1)?,
            (false, true) => seq.transpose(0, 1)?,
            (false, false) => seq,
        };
        let finals = finals
            .iter()
            .map(|f| {
                let s = Tensor::stack(&f.iter().collect::<Vec<_>>(), 0)?;
                if unbatched {
                    s.squeeze(1)
                } else {
                    Ok(s)
                }
            })
            .collect::<Result<_>>()?;
        Ok((out, finals))
    }

    /// Dropout on a layer's output in training mode, from the stack's generator.
    fn drop(&self, x: &Tensor) -> Result<Tensor> {
        match &self.generator {
            Some(g) if self.training && self.dropout > 0.0 => {
                // The stream is reserved under the lock and the mask drawn after it is
                // released, as `Dropout` does.
                x.dropout_from(self.dropout, true, |blocks| {
                    let _drawing = lock(&self.drawing);
                    crate::tensor::state_stream(g, blocks)
                })
            }
            _ => Ok(x.clone()),
        }
    }

    /// The weights by PyTorch's names (`weight_ih_l0`, `bias_hh_l1_reverse`, `weight_hr_l0`,
    /// ...) in PyTorch's order, then the dropout generator's state.
    pub fn visit(&self, p: &str, f: &mut Visitor) {
        for (i, layer) in self.layers.iter().enumerate() {
            let suffix = self.suffix(i);
            for (name, t) in [
                ("weight_ih", Some(&layer.w_ih)),
                ("weight_hh", Some(&layer.w_hh)),
                ("bias_ih", layer.b_ih.as_ref()),
                ("bias_hh", layer.b_hh.as_ref()),
                ("weight_hr", layer.w_hr.as_ref()),
            ] {
                if let Some(t) = t {
                    f(
                        join(p, &format!("{name}{suffix}")),
                        t,
                        TensorKind::Parameter,
                    );
                }
            }
        }
        if let Some(g) = &self.generator {
            f(join(p, "generator"), g, TensorKind::Generator);
        }
    }

    /// [`Stack::visit`], mutably; takes the mode a [`super::Module::set_training`] walk sets.
    pub fn visit_mut(&mut self, p: &str, f: &mut VisitorMut) -> Result<()> {
        if let Some(on) = super::mode_being_set() {
            self.training = on;
        }
        for i in 0..self.layers.len() {
            let suffix = self.suffix(i);
            let layer = &mut self.layers[i];
            for (name, t) in [
                ("weight_ih", Some(&mut layer.w_ih)),
                ("weight_hh", Some(&mut layer.w_hh)),
                ("bias_ih", layer.b_ih.as_mut()),
                ("bias_hh", layer.b_hh.as_mut()),
                ("weight_hr", layer.w_hr.as_mut()),
            ] {
                if let Some(t) = t {
                    f(
                        join(p, &format!("{name}{suffix}")),
                        t,
                        TensorKind::Parameter,
                    )?;
                }
            }
        }
        match &mut self.generator {
            Some(g) => f(join(p, "generator"), g, TensorKind::Generator),
            None => Ok(()),
        }
    }

    pub fn set_training(&mut self, on: bool) {
        self.training = on;
    }

    /// `_l{layer}`, with `_reverse` for the second direction.
    fn suffix(&self, i: usize) -> String {
        let l = i / self.directions;
        match i % self.directions {
            0 => format!("_l{l}"),
            _ => format!("_l{l}_reverse"),
        }
    }
}

/// An initial state `[layers, batch, width]`: the one given (`[layers, width]` for an
/// unbatched input), checked, or zeros like `seq`.
fn initial(
    op: &'static str,
    state: Option<&Tensor>,
    (layers, batch, width): (usize, usize, usize),
    unbatched: bool,
    seq: &Tensor,
) -> Result<Tensor> {
    let want = match unbatched {
        true => vec![layers, width],
        false => vec![layers, batch, width],
    };
    match state {
        Some(s) if s.shape() == want && unbatched => s.unsqueeze(1),
        Some(s) if s.shape() == want => Ok(s.clone()),
        Some(s) => Err(Error::ShapeMismatch {
            op,
            lhs: want,
            rhs: s.shape().to_vec(),
        }),
        None => Tensor::zeros(&[layers, batch, width], seq.dtype(), seq.device()),
    }
}

/// The step indices of a sequence of `len` in the order a direction reads them.
pub(super) fn steps(len: usize, reverse: bool) -> Box<dyn Iterator<Item = usize>> {
    match reverse {
        true => Box::new((0..len).rev()),
        false => Box::new(0..len),
    }
}

/// The per-step outputs `[batch, out]`, collected in reading order, as `[seq, batch, out]`
/// in sequence order.
pub(super) fn in_order(mut outs: Vec<Tensor>, reverse: bool) -> Result<Tensor> {
    if reverse {
        outs.reverse();
    }
    Tensor::stack(&outs.iter().collect::<Vec<_>>(), 0)
}

/// `seq` with its steps (dim 0) in reverse order.
pub(super) fn reversed(seq: &Tensor) -> Result<Tensor> {
    let n = seq.shape()[0];
    let idx: Vec<i64> = (0..n as i64).rev().collect();
    seq.index_select(0, &Tensor::from_vec(idx, &[n], seq.device())?)
}
