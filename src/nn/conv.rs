//! Conv2d and the pooling layers.

use super::{uniform_param, visit_weight_bias, visit_weight_bias_mut, Module, Visitor, VisitorMut};
use crate::{AvgPool2dOptions, Conv2dOptions, Error, Generator, MaxPool2dOptions, Result, Tensor};

/// 2-D convolution (`nn.Conv2d`), weight `[out, in / groups, k, k]`.
pub struct Conv2d {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub options: Conv2dOptions,
}

impl Conv2d {
    /// PyTorch's initialisation: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with
    /// `fan_in = in / groups * k * k`.
    pub fn new(
        inputs: usize,
        outputs: usize,
        kernel: usize,
        options: Conv2dOptions,
        bias: bool,
        gen: &mut Generator,
    ) -> Result<Conv2d> {
        let g = options.groups;
        if g == 0 || !inputs.is_multiple_of(g) || !outputs.is_multiple_of(g) || kernel == 0 {
            return Err(Error::invalid(
                "Conv2d::new",
                format!("in {inputs}, out {outputs}, kernel {kernel}, groups {g}"),
            ));
        }
        let fan_in = inputs / g * kernel * kernel;
        let bound = 1.0 / (fan_in as f64).sqrt();
        Ok(Conv2d {
            weight: uniform_param(&[outputs, inputs / g, kernel, kernel], bound, gen)?,
            bias: if bias {
                Some(uniform_param(&[outputs], bound, gen)?)
            } else {
                None
            },
            options,
        })
    }
}

impl Module for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.conv2d(&self.weight, self.bias.as_ref(), self.options)
    }
    fn visit(&self, p: &str, f: &mut Visitor) {
        visit_weight_bias(p, f, &self.weight, self.bias.as_ref())
    }
    fn visit_mut(&mut self, p: &str, f: &mut VisitorMut) -> Result<()> {
        visit_weight_bias_mut(p, f, &mut self.weight, self.bias.as_mut())
    }
}

macro_rules! stateless {
    ($name:ident, $opts:ty, $doc:literal, |$s:ident, $x:ident| $body:expr) => {
        #[doc = $doc]
        #[derive(Debug, Clone, Copy)]
        pub struct $name(pub $opts);

        impl Module for $name {
            fn forward(&self, $x: &Tensor) -> Result<Tensor> {
                let $s = self;
                $body
            }
            fn visit(&self, _: &str, _: &mut Visitor) {}
            fn visit_mut(&mut self, _: &str, _: &mut VisitorMut) -> Result<()> {
                Ok(())
            }
        }
    };
}

stateless!(
    MaxPool2d,
    MaxPool2dOptions,
    "Max pooling (`nn.MaxPool2d`).",
    |s, x| x.max_pool2d(s.0)
);
stateless!(
    AvgPool2d,
    AvgPool2dOptions,
    "Average pooling (`nn.AvgPool2d`).",
    |s, x| x.avg_pool2d(s.0)
);
stateless!(
    AdaptiveAvgPool2d,
    [usize; 2],
    "Adaptive average pooling to a fixed output size (`nn.AdaptiveAvgPool2d`).",
    |s, x| x.adaptive_avg_pool2d(s.0)
);
