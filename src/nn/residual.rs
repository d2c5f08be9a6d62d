//! Residual blocks: `relu(main(x) + shortcut(x))`.

use super::{join, Module, Sequential, Visitor, VisitorMut};
use crate::{Error, Result, Tensor};

/// `relu(main(x) + shortcut(x))`, the shape of ResNet's basic and bottleneck blocks: the
/// shortcut is the identity when `None`, or a projection (torchvision's `downsample`, a 1x1
/// convolution and a batch norm) where the main branch changes the shape. Children are named
/// `main` and `shortcut` (`main.0.weight`, `shortcut.1.running_mean`, ...).
///
/// ```
/// use mantissa::nn::{Activation, Linear, Module, Residual, Sequential};
/// use mantissa::{DType, Device, Generator, Tensor};
/// let mut g = Generator::new(0);
/// let block = Residual::new(
///     Sequential::new()
///         .push(Linear::new(4, 4, true, &mut g)?)
///         .push(Activation::Relu)
///         .push(Linear::new(4, 4, true, &mut g)?),
///     None,
/// );
/// let y = block.forward(&Tensor::ones(&[2, 4], DType::F32, Device::Cpu)?)?;
/// assert_eq!(y.shape(), &[2, 4]);
/// assert_eq!(block.named_parameters()[0].0, "main.0.weight");
/// # Ok::<(), mantissa::Error>(())
/// ```
pub struct Residual {
    pub main: Sequential,
    pub shortcut: Option<Sequential>,
}

impl Residual {
    pub fn new(main: Sequential, shortcut: Option<Sequential>) -> Residual {
        Residual { main, shortcut }
    }
}

impl Residual {
    /// `relu(y + s)`, erring with both shapes when they differ.
    fn add_relu(&self, y: Tensor, s: &Tensor) -> Result<Tensor> {
        if y.shape() != s.shape() {
            let what = if self.shortcut.is_some() {
                "projection"
            } else {
                "identity"
            };
            return Err(Error::invalid(
                "Residual",
                format!(
                    "main branch gives {:?}, {what} shortcut {:?}",
                    y.shape(),
                    s.shape()
                ),
            ));
        }
        y.add(s)?.relu()
    }
}

impl Module for Residual {
    /// Errs, naming both shapes, when the branches' outputs differ in shape (no broadcasting:
    /// a block whose shortcut does not match is a mistake in the network). Where the main
    /// branch ends in a [`BatchNorm2d`](super::BatchNorm2d), the add and the ReLU run in its
    /// passes (`relu(bn(h) + s)`, rounded once).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let shortcut = || match &self.shortcut {
            Some(m) => m.forward(x),
            None => Ok(x.clone()),
        };
        // The main branch's last layer may take the add and the ReLU into its own passes (a
        // batch norm: one output write, no sum kept); the shortcut runs just before it.
        if let Some(split) = self.main.split_last(x) {
            let (h, last) = split?;
            let s = shortcut()?;
            if let Some(y) = last.forward_add_relu(&h, &s) {
                return y;
            }
            return self.add_relu(last.forward(&h)?, &s);
        }
        let y = self.main.forward(x)?;
        self.add_relu(y, &shortcut()?)
    }
    fn visit(&self, prefix: &str, f: &mut Visitor) {
        self.main.visit(&join(prefix, "main"), f);
        if let Some(m) = &self.shortcut {
            m.visit(&join(prefix, "shortcut"), f);
        }
    }
    fn visit_mut(&mut self, prefix: &str, f: &mut VisitorMut) -> Result<()> {
        self.main.visit_mut(&join(prefix, "main"), f)?;
        match &mut self.shortcut {
            Some(m) => m.visit_mut(&join(prefix, "shortcut"), f),
            None => Ok(()),
        }
    }
    fn set_training(&mut self, on: bool) {
        self.main.set_training(on);
        if let Some(m) = &mut self.shortcut {
            m.set_training(on);
        }
    }
}
