//! The options of the recurrent layers ([`super::Gru`], [`super::Lstm`]), as PyTorch's
//! `nn.GRU` and `nn.LSTM` take them, and their checks.

use crate::{Error, Result};

/// Options of [`super::Gru::with_options`] and [`super::Lstm::with_options`], PyTorch's
/// keyword arguments of `nn.GRU` / `nn.LSTM` with the same defaults: one layer, biases,
/// sequence-first, no dropout, one direction, no projection.
///
/// - `num_layers`: layers stacked, each one's output the next one's input.
/// - `bias`: whether the layers have `bias_ih_l*` and `bias_hh_l*` (without, no such
///   parameters exist at all, as in PyTorch).
/// - `batch_first`: input and output `[batch, seq, features]` instead of `[seq, batch,
///   features]` (the states stay `[layers * directions, batch, hidden]`).
/// - `dropout`: the probability of dropout on each layer's output but the last one's, in
///   training mode only; in `[0, 1]`.
/// - `bidirectional`: a second direction per layer that reads the sequence backwards, its
///   parameters named `*_reverse`; outputs hold both directions' features, forward first.
/// - `proj_size`: [`super::Lstm`] only, and smaller than the hidden size when not 0: each
///   step's `h` is projected to `proj_size` features by `weight_hr_l*`.
///
/// ```
/// use mantissa::nn::{Gru, Module, RnnOptions};
/// use mantissa::{DType, Device, Generator, Tensor};
/// let opts = RnnOptions { num_layers: 2, bidirectional: true, ..Default::default() };
/// let gru = Gru::with_options(3, 5, opts, &mut Generator::new(0))?;
/// let x = Tensor::ones(&[7, 4, 3], DType::F32, Device::Cpu)?;
/// let (y, h) = gru.forward_with_state(&x, None)?;
/// // Both directions' features; the states of layer 0 forward, layer 0 reverse, layer 1 ...
/// assert_eq!((y.shape(), h.shape()), (&[7, 4, 10][..], &[4, 4, 5][..]));
/// assert!(gru.state_dict().contains_key("weight_hh_l1_reverse"));
/// # Ok::<(), mantissa::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RnnOptions {
    pub num_layers: usize,
    pub bias: bool,
    pub batch_first: bool,
    pub dropout: f64,
    pub bidirectional: bool,
    pub proj_size: usize,
}

impl Default for RnnOptions {
    fn default() -> Self {
        RnnOptions {
            num_layers: 1,
            bias: true,
            batch_first: false,
            dropout: 0.0,
            bidirectional: false,
            proj_size: 0,
        }
    }
}

impl RnnOptions {
    /// The number of directions: 2 when bidirectional.
    pub fn directions(&self) -> usize {
        if self.bidirectional {
            2
        } else {
            1
        }
    }

    /// The features of `h` per direction: `proj_size` when projected, else `hidden`.
    pub fn output_size(&self, hidden: usize) -> usize {
        match self.proj_size {
            0 => hidden,
            p => p,
        }
    }

    /// Refuses what PyTorch refuses, naming `op` and the values: empty sizes, a dropout
    /// outside `[0, 1]`, a projection on a layer without one (`projects` false: the GRU) or
    /// not smaller than `hidden`.
    pub(super) fn check(
        &self,
        op: &'static str,
        input_size: usize,
        hidden: usize,
        projects: bool,
    ) -> Result<()> {
        let n = self.num_layers;
        if input_size == 0 || hidden == 0 || n == 0 {
            return Err(Error::invalid(
                op,
                format!("input {input_size}, hidden {hidden}, layers {n}"),
            ));
        }
        // NaN is not in the range either.
        if !(0.0..=1.0).contains(&self.dropout) {
            return Err(Error::invalid(
                op,
                format!("dropout {} not in [0, 1]", self.dropout),
            ));
        }
        match self.proj_size {
            0 => Ok(()),
            p if !projects => Err(Error::invalid(
                op,
                format!("proj_size {p}: only an LSTM projects its state (proj_size must be 0)"),
            )),
            p if p >= hidden => Err(Error::invalid(
                op,
                format!("proj_size {p} must be smaller than hidden {hidden}"),
            )),
            _ => Ok(()),
        }
    }
}
