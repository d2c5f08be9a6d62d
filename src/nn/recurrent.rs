//! What the recurrent layers (`Lstm`, `Gru`) share: PyTorch's weights per layer with their
//! names and initialisation, the input check, and the initial state.

use super::{join, uniform_param, TensorKind, Visitor, VisitorMut};
use crate::{Error, Generator, Result, Tensor};

/// One layer's weights: `[gates * hidden, in]`, `[gates * hidden, hidden]` and two biases of
/// `gates * hidden`, the gate blocks in PyTorch's order.
pub(super) struct RnnLayer {
    pub w_ih: Tensor,
    pub w_hh: Tensor,
    pub b_ih: Tensor,
    pub b_hh: Tensor,
}

/// `num_layers` layers of `gates` gate blocks, every weight and bias from
/// U(-1/sqrt(hidden), 1/sqrt(hidden)), as PyTorch does.
pub(super) fn new_layers(
    op: &'static str,
    gates: usize,
    (input_size, hidden, num_layers): (usize, usize, usize),
    gen: &mut Generator,
) -> Result<Vec<RnnLayer>> {
    if input_size == 0 || hidden == 0 || num_layers == 0 {
        return Err(Error::invalid(
            op,
            format!("input {input_size}, hidden {hidden}, layers {num_layers}"),
        ));
    }
    let k = 1.0 / (hidden as f64).sqrt();
    let g = gates
        .checked_mul(hidden)
        .ok_or_else(|| Error::invalid(op, format!("hidden {hidden} is too large")))?;
    (0..num_layers)
        .map(|l| {
            let inp = if l == 0 { input_size } else { hidden };
            Ok(RnnLayer {
                w_ih: uniform_param(&[g, inp], k, gen)?,
                w_hh: uniform_param(&[g, hidden], k, gen)?,
                b_ih: uniform_param(&[g], k, gen)?,
                b_hh: uniform_param(&[g], k, gen)?,
            })
        })
        .collect()
}

/// The input as `[seq, batch, in]` (transposed from `[batch, seq, in]` with `batch_first`),
/// checked: 3-D, `input_size` features, at least one step.
pub(super) fn seq_first(
    op: &'static str,
    x: &Tensor,
    input_size: usize,
    batch_first: bool,
) -> Result<Tensor> {
    if x.rank() != 3 || x.shape()[2] != input_size {
        return Err(Error::invalid(
            op,
            format!(
                "input must be 3-D with {input_size} features, got {:?}",
                x.shape()
            ),
        ));
    }
    let seq = match batch_first {
        true => x.transpose(0, 1)?,
        false => x.clone(),
    };
    if seq.shape()[0] == 0 {
        // PyTorch refuses it too: there would be no final state to return.
        return Err(Error::invalid(
            op,
            format!("a sequence of length 0 (input {:?})", x.shape()),
        ));
    }
    Ok(seq)
}

/// An initial state `[layers, batch, hidden]`: the one given, checked, or zeros like `seq`.
pub(super) fn initial(
    op: &'static str,
    state: Option<&Tensor>,
    want: [usize; 3],
    seq: &Tensor,
) -> Result<Tensor> {
    match state {
        Some(s) if s.shape() == want => Ok(s.clone()),
        Some(s) => Err(Error::ShapeMismatch {
            op,
            lhs: want.to_vec(),
            rhs: s.shape().to_vec(),
        }),
        None => Tensor::zeros(&want, seq.dtype(), seq.device()),
    }
}

/// Layer `l` of a state `[layers, batch, hidden]`: `[batch, hidden]`.
pub(super) fn layer_of(state: &Tensor, l: usize) -> Result<Tensor> {
    state.narrow(0, l, 1)?.squeeze(0)
}

/// The layers' weights by PyTorch's names (`weight_ih_l0`, `bias_hh_l1`, ...).
pub(super) fn visit_layers(layers: &[RnnLayer], p: &str, f: &mut Visitor) {
    for (l, layer) in layers.iter().enumerate() {
        for (name, t) in [
            ("weight_ih", &layer.w_ih),
            ("weight_hh", &layer.w_hh),
            ("bias_ih", &layer.b_ih),
            ("bias_hh", &layer.b_hh),
        ] {
            f(join(p, &format!("{name}_l{l}")), t, TensorKind::Parameter);
        }
    }
}

/// [`visit_layers`], mutably.
pub(super) fn visit_layers_mut(layers: &mut [RnnLayer], p: &str, f: &mut VisitorMut) -> Result<()> {
    for (l, layer) in layers.iter_mut().enumerate() {
        for (name, t) in [
            ("weight_ih", &mut layer.w_ih),
            ("weight_hh", &mut layer.w_hh),
            ("bias_ih", &mut layer.b_ih),
            ("bias_hh", &mut layer.b_hh),
        ] {
            f(join(p, &format!("{name}_l{l}")), t, TensorKind::Parameter)?;
        }
    }
    Ok(())
}
