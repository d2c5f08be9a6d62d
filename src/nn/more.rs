//! Layers PyTorch users reach for beside the core ones: `Conv1d`, `BatchNorm1d`,
//! `GroupNorm`, and the `ModuleList` container.

use super::{
    join, uniform_param, visit_weight_bias, visit_weight_bias_mut, BatchNorm2d, Module, TensorKind,
    Visitor, VisitorMut,
};
use crate::{Conv1dOptions, DType, Device, Error, Generator, Result, Tensor};

/// 1-D convolution (`nn.Conv1d`), weight `[out, in / groups, k]`, on `[n, c, l]` or one
/// `[c, l]` sequence.
///
/// ```
/// use mantissa::nn::{Conv1d, Module};
/// use mantissa::{Conv1dOptions, DType, Device, Generator, Tensor};
/// let conv = Conv1d::new(3, 8, 5, Conv1dOptions { padding: 2, ..Default::default() }, true,
///     &mut Generator::new(0))?;
/// let y = conv.forward(&Tensor::randn(&[2, 3, 16], DType::F32, Device::Cpu)?)?;
/// assert_eq!(y.shape(), &[2, 8, 16]);
/// # Ok::<(), mantissa::Error>(())
/// ```
pub struct Conv1d {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub options: Conv1dOptions,
}

impl Conv1d {
    /// PyTorch's initialisation: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with
    /// `fan_in = in / groups * k`.
    pub fn new(
        inputs: usize,
        outputs: usize,
        kernel: usize,
        options: Conv1dOptions,
        bias: bool,
        gen: &mut Generator,
    ) -> Result<Conv1d> {
        let g = options.groups;
        if g == 0 || !inputs.is_multiple_of(g) || !outputs.is_multiple_of(g) || kernel == 0 {
            return Err(Error::invalid(
                "Conv1d::new",
                format!("in {inputs}, out {outputs}, kernel {kernel}, groups {g}"),
            ));
        }
        let bound = 1.0 / ((inputs / g * kernel) as f64).sqrt();
        Ok(Conv1d {
            weight: uniform_param(&[outputs, inputs / g, kernel], bound, gen)?,
            bias: bias
                .then(|| uniform_param(&[outputs], bound, gen))
                .transpose()?,
            options,
        })
    }
}

impl Module for Conv1d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.conv1d(&self.weight, self.bias.as_ref(), self.options)
    }
    fn visit(&self, p: &str, f: &mut Visitor) {
        visit_weight_bias(p, f, &self.weight, self.bias.as_ref())
    }
    fn visit_mut(&mut self, p: &str, f: &mut VisitorMut) -> Result<()> {
        visit_weight_bias_mut(p, f, &mut self.weight, self.bias.as_mut())
    }
}

/// Batch norm over `[n, c]` or `[n, c, l]` (`nn.BatchNorm1d`): [`BatchNorm2d`]'s tensors,
/// names and statistics (its fields are reached through this one), on 2-D or 3-D input.
pub struct BatchNorm1d(BatchNorm2d);

impl BatchNorm1d {
    pub fn new(channels: usize) -> Result<BatchNorm1d> {
        Ok(BatchNorm1d(BatchNorm2d::new(channels)?))
    }
}

impl std::ops::Deref for BatchNorm1d {
    type Target = BatchNorm2d;
    fn deref(&self) -> &BatchNorm2d {
        &self.0
    }
}

impl std::ops::DerefMut for BatchNorm1d {
    fn deref_mut(&mut self) -> &mut BatchNorm2d {
        &mut self.0
    }
}

impl Module for BatchNorm1d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if !matches!(x.rank(), 2 | 3) {
            return Err(Error::invalid(
                "BatchNorm1d",
                format!("needs [n, c] or [n, c, l] input, got {:?}", x.shape()),
            ));
        }
        self.0.forward(x)
    }
    fn visit(&self, p: &str, f: &mut Visitor) {
        self.0.visit(p, f)
    }
    fn visit_mut(&mut self, p: &str, f: &mut VisitorMut) -> Result<()> {
        self.0.visit_mut(p, f)
    }
}

/// Group norm (`nn.GroupNorm`): see [`Tensor::group_norm`]; `weight` (ones) and `bias`
/// (zeros) per channel when affine.
pub struct GroupNorm {
    pub groups: usize,
    pub weight: Option<Tensor>,
    pub bias: Option<Tensor>,
    pub eps: f64,
}

impl GroupNorm {
    pub fn new(groups: usize, channels: usize, affine: bool) -> Result<GroupNorm> {
        if groups == 0 || !channels.is_multiple_of(groups) {
            return Err(Error::invalid(
                "GroupNorm::new",
                format!("{channels} channels do not split into {groups} groups"),
            ));
        }
        let v = |x: f64| Tensor::full(&[channels], x, DType::F32, Device::Cpu)?.requires_grad(true);
        Ok(GroupNorm {
            groups,
            weight: affine.then(|| v(1.0)).transpose()?,
            bias: affine.then(|| v(0.0)).transpose()?,
            eps: 1e-5,
        })
    }
}

impl Module for GroupNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.group_norm(
            self.groups,
            self.weight.as_ref(),
            self.bias.as_ref(),
            self.eps,
        )
    }
    fn visit(&self, p: &str, f: &mut Visitor) {
        if let (Some(w), Some(b)) = (&self.weight, &self.bias) {
            f(join(p, "weight"), w, TensorKind::Parameter);
            f(join(p, "bias"), b, TensorKind::Parameter);
        }
    }
    fn visit_mut(&mut self, p: &str, f: &mut VisitorMut) -> Result<()> {
        if let (Some(w), Some(b)) = (&mut self.weight, &mut self.bias) {
            f(join(p, "weight"), w, TensorKind::Parameter)?;
            f(join(p, "bias"), b, TensorKind::Parameter)?;
        }
        Ok(())
    }
}

/// Modules held in a list and named by their index (`nn.ModuleList`): their tensors are
/// found, moved and saved as a [`super::Sequential`]'s are, and the caller decides how to
/// apply them (`forward` is an error).
///
/// ```
/// use mantissa::nn::{Linear, Module, ModuleList};
/// use mantissa::{DType, Device, Generator, Tensor};
/// let mut g = Generator::new(0);
/// let mut blocks = ModuleList::new();
/// for _ in 0..3 {
///     blocks.push(Linear::new(4, 4, true, &mut g)?);
/// }
/// let mut h = Tensor::randn(&[2, 4], DType::F32, Device::Cpu)?;
/// for b in blocks.iter() {
///     h = h.add(&b.forward(&h)?)?;
/// }
/// assert_eq!(blocks.named_parameters()[2].0, "1.weight");
/// # Ok::<(), mantissa::Error>(())
/// ```
#[derive(Default)]
pub struct ModuleList {
    items: Vec<Box<dyn Module>>,
}

impl ModuleList {
    pub fn new() -> ModuleList {
        ModuleList::default()
    }

    /// Appends a module.
    pub fn push(&mut self, m: impl Module + 'static) {
        self.items.push(Box::new(m));
    }

    /// The module at `i`.
    pub fn get(&self, i: usize) -> Option<&dyn Module> {
        self.items.get(i).map(|m| &**m)
    }

    /// The modules in order.
    pub fn iter(&self) -> impl Iterator<Item = &dyn Module> {
        self.items.iter().map(|m| &**m)
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

impl Module for ModuleList {
    fn forward(&self, _x: &Tensor) -> Result<Tensor> {
        Err(Error::invalid(
            "ModuleList::forward",
            "a ModuleList has no forward of its own: apply its modules (iter) as the model \
             needs, or use Sequential",
        ))
    }
    fn visit(&self, prefix: &str, f: &mut Visitor) {
        for (i, m) in self.items.iter().enumerate() {
            m.visit(&join(prefix, &i.to_string()), f);
        }
    }
    fn visit_mut(&mut self, prefix: &str, f: &mut VisitorMut) -> Result<()> {
        for (i, m) in self.items.iter_mut().enumerate() {
            m.visit_mut(&join(prefix, &i.to_string()), f)?;
        }
        Ok(())
    }
}
