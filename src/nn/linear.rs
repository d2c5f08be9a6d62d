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

/// A lookup table of `num` vectors of size `dim` (`nn.Embedding`, N(0, 1) init). With a
/// `padding_idx`, that row starts at zero and never receives a gradient (PyTorch's
/// `padding_idx`): an index equal to it reads the row as it is but trains nothing.
///
/// ```
/// use mantissa::nn::{Embedding, Module};
/// use mantissa::{Device, Generator, Tensor};
/// let emb = Embedding::with_padding_idx(10, 4, Some(-1), &mut Generator::new(0))?;
/// assert_eq!(emb.padding_idx, Some(9));
/// let idx = Tensor::from_vec(vec![9i64, 3], &[2], Device::Cpu)?;
/// let y = emb.forward(&idx)?;
/// assert_eq!(y.select(0, 0)?.to_vec::<f32>()?, vec![0.0; 4]);
/// y.sum_all()?.backward()?;
/// assert_eq!(emb.weight.grad().unwrap().select(0, 9)?.to_vec::<f32>()?, vec![0.0; 4]);
/// # Ok::<(), mantissa::Error>(())
/// ```
pub struct Embedding {
    pub weight: Tensor,
    /// The row that reads as padding: zero at first, never given a gradient.
    pub padding_idx: Option<usize>,
}

impl Embedding {
    /// `num` rows of size `dim` from N(0, 1), no padding row.
    pub fn new(num: usize, dim: usize, gen: &mut Generator) -> Result<Embedding> {
        Embedding::with_padding_idx(num, dim, None, gen)
    }

    /// PyTorch's `nn.Embedding(num, dim, padding_idx)`: the rows drawn from N(0, 1) (the
    /// same draws as [`Embedding::new`]), then the padding row set to zero. A negative
    /// `padding_idx` counts from the end (`-1` is the last row); one outside `-num..num` is
    /// an error.
    pub fn with_padding_idx(
        num: usize,
        dim: usize,
        padding_idx: Option<i64>,
        gen: &mut Generator,
    ) -> Result<Embedding> {
        let padding_idx = padding_idx
            .map(|p| {
                let n = num as i64;
                match p {
                    p if (0..n).contains(&p) => Ok(p as usize),
                    p if (-n..0).contains(&p) => Ok((p + n) as usize),
                    p => Err(Error::invalid(
                        "Embedding::with_padding_idx",
                        format!("padding_idx {p} out of range for {num} embeddings"),
                    )),
                }
            })
            .transpose()?;
        let w = Tensor::randn_with(&[num, dim], 0.0, 1.0, DType::F32, Device::Cpu, gen)?;
        if let Some(p) = padding_idx {
            w.narrow(0, p, 1)?.zero_()?;
        }
        Ok(Embedding {
            weight: w.requires_grad(true)?,
            padding_idx,
        })
    }
}

impl Module for Embedding {
    /// `x` holds I64 indices; the output has shape `x.shape + [dim]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Tensor::embedding_padded(x, &self.weight, self.padding_idx)
    }
    fn visit(&self, p: &str, f: &mut Visitor) {
        f(join(p, "weight"), &self.weight, TensorKind::Parameter);
    }
    fn visit_mut(&mut self, p: &str, f: &mut VisitorMut) -> Result<()> {
        f(join(p, "weight"), &mut self.weight, TensorKind::Parameter)
    }
}
