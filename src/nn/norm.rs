//! BatchNorm2d, LayerNorm and Dropout.

use super::{join, Module, TensorKind, Visitor, VisitorMut};
use crate::sync::lock;
use crate::{DType, Device, Error, Generator, Result, Tensor};
use std::sync::Mutex;

/// Batch normalisation over `[n, c, h, w]` (`nn.BatchNorm2d`): affine weight 1 and bias 0,
/// running mean 0 and variance 1, momentum 0.1, eps 1e-5.
pub struct BatchNorm2d {
    pub weight: Tensor,
    pub bias: Tensor,
    pub running_mean: Tensor,
    pub running_var: Tensor,
    /// Training steps taken (PyTorch's `num_batches_tracked`).
    pub num_batches_tracked: Tensor,
    pub momentum: f64,
    pub eps: f64,
    training: bool,
}

impl BatchNorm2d {
    pub fn new(channels: usize) -> Result<BatchNorm2d> {
        let v = |x: f64| Tensor::full(&[channels], x, DType::F32, Device::Cpu);
        Ok(BatchNorm2d {
            weight: v(1.0)?.requires_grad(true)?,
            bias: v(0.0)?.requires_grad(true)?,
            running_mean: v(0.0)?,
            running_var: v(1.0)?,
            num_batches_tracked: Tensor::zeros(&[], DType::I64, Device::Cpu)?,
            momentum: 0.1,
            eps: 1e-5,
            training: true,
        })
    }
}

impl BatchNorm2d {
    fn forward_fused(&self, x: &Tensor, residual: Option<&Tensor>, relu: bool) -> Result<Tensor> {
        // A checkpoint's recomputation normalises by the batch again but counts it once: the
        // forward already updated the running statistics.
        let count = self.training && !crate::frames::recomputing();
        let keep = !self.training || count;
        // The batch is counted on the tensor's device (no read back per step on a GPU), in
        // the launch that updates the running statistics where it can be.
        let call = crate::ops::norm_call::BnCall {
            training: self.training,
            momentum: self.momentum,
            eps: self.eps,
            relu,
        };
        x.batch_norm_counted(
            (
                keep.then_some(&self.running_mean),
                keep.then_some(&self.running_var),
            ),
            (Some(&self.weight), Some(&self.bias)),
            count.then_some(&self.num_batches_tracked),
            residual,
            call,
        )
    }
}

impl Module for BatchNorm2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_fused(x, None, false)
    }
    /// `relu(batch_norm(x))` in the same passes: one output write forward, and the ReLU's
    /// backward folded into batch norm's.
    fn forward_relu(&self, x: &Tensor) -> Option<Result<Tensor>> {
        Some(self.forward_fused(x, None, true))
    }
    /// `relu(batch_norm(x) + residual)` in the same passes where the residual matches the
    /// output (shape, dtype, device); `None` otherwise, for the caller's unfused path.
    fn forward_add_relu(&self, x: &Tensor, residual: &Tensor) -> Option<Result<Tensor>> {
        let fits = residual.shape() == x.shape()
            && residual.dtype() == x.dtype()
            && residual.device() == x.device();
        fits.then(|| self.forward_fused(x, Some(residual), true))
    }
    fn visit(&self, p: &str, f: &mut Visitor) {
        f(join(p, "weight"), &self.weight, TensorKind::Parameter);
        f(join(p, "bias"), &self.bias, TensorKind::Parameter);
        f(
            join(p, "running_mean"),
            &self.running_mean,
            TensorKind::Buffer,
        );
        f(
            join(p, "running_var"),
            &self.running_var,
            TensorKind::Buffer,
        );
        f(
            join(p, "num_batches_tracked"),
            &self.num_batches_tracked,
            TensorKind::Buffer,
        );
    }
    fn visit_mut(&mut self, p: &str, f: &mut VisitorMut) -> Result<()> {
        if let Some(on) = super::mode_being_set() {
            self.training = on;
        }
        f(join(p, "weight"), &mut self.weight, TensorKind::Parameter)?;
        f(join(p, "bias"), &mut self.bias, TensorKind::Parameter)?;
        f(
            join(p, "running_mean"),
            &mut self.running_mean,
            TensorKind::Buffer,
        )?;
        f(
            join(p, "running_var"),
            &mut self.running_var,
            TensorKind::Buffer,
        )?;
        f(
            join(p, "num_batches_tracked"),
            &mut self.num_batches_tracked,
            TensorKind::Buffer,
        )
    }
    fn set_training(&mut self, on: bool) {
        self.training = on;
    }
}

/// Layer normalisation over the trailing dims (`nn.LayerNorm`): each row of the last
/// `shape.len()` dims normalised to mean 0 and variance 1 (`eps` added to the variance), then
/// scaled by `weight` (init 1) and shifted by `bias` (init 0) when they are present.
///
/// ```
/// use mantissa::nn::{LayerNorm, Module};
/// use mantissa::{DType, Device, Tensor};
/// let ln = LayerNorm::new(&[4])?;
/// assert!(ln.weight.is_some() && ln.bias.is_some());
/// let y = ln.forward(&Tensor::randn(&[2, 4], DType::F32, Device::Cpu)?)?;
/// assert_eq!(y.shape(), &[2, 4]);
/// # Ok::<(), mantissa::Error>(())
/// ```
pub struct LayerNorm {
    /// The elementwise scale (`[shape]`), absent without `elementwise_affine`.
    pub weight: Option<Tensor>,
    /// The elementwise shift (`[shape]`), absent without `elementwise_affine` or `bias`.
    pub bias: Option<Tensor>,
    pub shape: Vec<usize>,
    pub eps: f64,
}

impl LayerNorm {
    /// PyTorch's defaults: eps 1e-5, weight and bias.
    pub fn new(shape: &[usize]) -> Result<LayerNorm> {
        LayerNorm::with_options(shape, 1e-5, true, true)
    }

    /// PyTorch's `nn.LayerNorm(shape, eps, elementwise_affine, bias)`: a weight only with
    /// `elementwise_affine`, a bias only with both (GPT-2 style blocks without biases use
    /// `bias: false`). The shape must be non-empty without zeros, `eps` finite and `>= 0`.
    ///
    /// ```
    /// use mantissa::nn::{LayerNorm, Module};
    /// let ln = LayerNorm::with_options(&[8], 1e-5, true, false)?;
    /// assert!(ln.bias.is_none());
    /// assert_eq!(ln.state_dict().into_keys().collect::<Vec<_>>(), ["weight"]);
    /// assert!(LayerNorm::with_options(&[8], -1.0, true, true).is_err());
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn with_options(
        shape: &[usize],
        eps: f64,
        elementwise_affine: bool,
        bias: bool,
    ) -> Result<LayerNorm> {
        if shape.is_empty() || shape.contains(&0) || !eps.is_finite() || eps < 0.0 {
            return Err(Error::invalid(
                "LayerNorm::with_options",
                format!(
                    "normalized shape {shape:?} must be non-empty without zeros, and eps \
                     {eps} finite and >= 0"
                ),
            ));
        }
        let param = |v: f64| Tensor::full(shape, v, DType::F32, Device::Cpu)?.requires_grad(true);
        Ok(LayerNorm {
            weight: elementwise_affine.then(|| param(1.0)).transpose()?,
            bias: (elementwise_affine && bias)
                .then(|| param(0.0))
                .transpose()?,
            shape: shape.to_vec(),
            eps,
        })
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.layer_norm(
            &self.shape,
            self.weight.as_ref(),
            self.bias.as_ref(),
            self.eps,
        )
    }
    fn visit(&self, p: &str, f: &mut Visitor) {
        for (name, t) in [("weight", &self.weight), ("bias", &self.bias)] {
            if let Some(t) = t {
                f(join(p, name), t, TensorKind::Parameter);
            }
        }
    }
    fn visit_mut(&mut self, p: &str, f: &mut VisitorMut) -> Result<()> {
        for (name, t) in [("weight", &mut self.weight), ("bias", &mut self.bias)] {
            if let Some(t) = t {
                f(join(p, name), t, TensorKind::Parameter)?;
            }
        }
        Ok(())
    }
}

/// Dropout with its own seeded generator (`nn.Dropout`); identity in eval mode.
///
/// The generator's state is a module tensor, `generator` (kind [`TensorKind::Generator`]:
/// two i64 on the host), so a checkpoint saves where the stream stands and a resumed run
/// draws the masks an uninterrupted run would.
///
/// ```
/// use mantissa::nn::{Dropout, Module};
/// use mantissa::{Device, DType, Tensor};
/// let drop = Dropout::new(0.5, 7);
/// let x = Tensor::ones(&[8], DType::F32, Device::Cpu)?;
/// let first = drop.forward(&x)?.to_vec::<f32>()?;
/// assert!(first.iter().all(|&v| v == 0.0 || v == 2.0));
/// assert_eq!(drop.named_generators()[0].0, "generator");
/// # Ok::<(), mantissa::Error>(())
/// ```
pub struct Dropout {
    pub p: f64,
    generator: Tensor,
    /// Serialises the read-draw-write of the generator state between threads.
    drawing: Mutex<()>,
    training: bool,
}

impl Dropout {
    pub fn new(p: f64, seed: u64) -> Dropout {
        Dropout {
            p,
            generator: Generator::new(seed).state_tensor(),
            drawing: Mutex::new(()),
            training: true,
        }
    }
}

impl Module for Dropout {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if !self.training {
            return x.dropout_with(self.p, false, &mut Generator::new(0));
        }
        // The stream is reserved under the lock and the mask drawn after it is released: a
        // task this thread runs while the mask's kernel waits may use this module too.
        x.dropout_from(self.p, true, |blocks| {
            let _drawing = lock(&self.drawing);
            crate::tensor::state_stream(&self.generator, blocks)
        })
    }
    fn visit(&self, p: &str, f: &mut Visitor) {
        f(join(p, "generator"), &self.generator, TensorKind::Generator);
    }
    fn visit_mut(&mut self, p: &str, f: &mut VisitorMut) -> Result<()> {
        if let Some(on) = super::mode_being_set() {
            self.training = on;
        }
        f(
            join(p, "generator"),
            &mut self.generator,
            TensorKind::Generator,
        )
    }
    fn set_training(&mut self, on: bool) {
        self.training = on;
    }
}
