//! Linear and Embedding.

use super::{
    join, uniform_param, visit_weight_bias, visit_weight_bias_mut, Module, TensorKind, Visitor,
    VisitorMut,
};
use crate::{DType, Device, Error, Generator, Result, Tensor};

/// `y = x W^T + b` with `W: [out, in]` (`nn.Linear`).
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
}

impl Linear {
    /// PyTorch's initialisation: weight and bias from U(-1/sqrt(in), 1/sqrt(in)).
    pub fn new(inputs: usize, outputs: usize, bias: bool, gen: &mut Generator) -> Result<Linear> {
        if inputs == 0 || outputs == 0 {
            return Err(Error::invalid(
                "Linear::new",
                format!("sizes {inputs} -> {outputs}"),
            ));
        }
        let bound = 1.0 / (inputs as f64).sqrt();
        Ok(Linear {
            weight: uniform_param(&[outputs, inputs], bound, gen)?,
            bias: if bias {
                Some(uniform_param(&[outputs], bound, gen)?)
            } else {
                None
            },
        })
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.linear(&self.weight, self.bias.as_ref())
    }
    fn forward_relu(&self, x: &Tensor) -> Option<Result<Tensor>> {
        let b = self.bias.as_ref()?;
        Some(x.linear_relu(&self.weight, b))
    }
    fn visit(&self, p: &str, f: &mut Visitor) {
        visit_weight_bias(p, f, &self.weight, self.bias.as_ref())
    }
    fn visit_mut(&mut self, p: &str, f: &mut VisitorMut) -> Result<()> {
        visit_weight_bias_mut(p, f, &mut self.weight, self.bias.as_mut())
    }
}

/// A lookup table of `num` vectors of size `dim` (`nn.Embedding`, N(0, 1) init).
pub struct Embedding {
    pub weight: Tensor,
}

impl Embedding {
    pub fn new(num: usize, dim: usize, gen: &mut Generator) -> Result<Embedding> {
        let w = Tensor::randn_with(&[num, dim], 0.0, 1.0, DType::F32, Device::Cpu, gen)?;
        Ok(Embedding {
            weight: w.requires_grad(true)?,
        })
    }
}

impl Module for Embedding {
    /// `x` holds I64 indices; the output has shape `x.shape + [dim]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Tensor::embedding(x, &self.weight)
    }
    fn visit(&self, p: &str, f: &mut Visitor) {
        f(join(p, "weight"), &self.weight, TensorKind::Parameter);
    }
    fn visit_mut(&mut self, p: &str, f: &mut VisitorMut) -> Result<()> {
        f(join(p, "weight"), &mut self.weight, TensorKind::Parameter)
    }
}
