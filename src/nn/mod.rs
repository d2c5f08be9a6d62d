//! Neural-network modules: the [`Module`] trait, layers with PyTorch's default initialisation,
//! and [`Sequential`].
//!
//! Parameters are leaf tensors with `requires_grad`; optimizers update them in place, so a
//! module always sees its current weights. Tensors are named as in PyTorch's `state_dict`
//! (`0.weight`, `bn.running_mean`, ...), which checkpoints use.

mod attention;
mod checkpointed;
mod conv;
mod fields;
mod gru;
pub mod init;
mod linear;
mod lstm;
mod more;
mod norm;
mod recurrent;
mod residual;
mod rnn_options;
mod state;

pub use attention::{MhaForward, MhaOptions, MultiheadAttention};
pub use checkpointed::Checkpointed;
pub use conv::{AdaptiveAvgPool2d, AvgPool2d, Conv2d, MaxPool2d};
pub use fields::Fields;
pub use gru::Gru;
pub use linear::{Embedding, Linear};
pub use lstm::Lstm;
pub use more::{BatchNorm1d, Conv1d, GroupNorm, ModuleList};
pub use norm::{BatchNorm2d, Dropout, LayerNorm};
pub use residual::Residual;
pub use rnn_options::RnnOptions;
pub use state::LoadReport;

use crate::{DType, Device, Generator, MemoryFormat, Result, Tensor};

/// Whether a module tensor is trained (parameter), only carried (buffer, e.g. running stats),
/// or a random generator's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorKind {
    Parameter,
    Buffer,
    /// A generator's (seed, offset) as two i64 on the host (see [`Generator::to_tensor`]),
    /// such as [`Dropout`]'s: saved in checkpoints, never moved or converted.
    Generator,
}

thread_local! {
    /// The mode [`Module::set_training`]'s default walk is setting on this thread.
    static MODE_BEING_SET: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Inside [`Module::set_training`]'s default walk, the mode it sets: a module with a mode of
/// its own takes it at the start of its `visit_mut`.
pub(crate) fn mode_being_set() -> Option<bool> {
    MODE_BEING_SET.with(|m| m.get())
}

/// Callback of [`Module::visit`]: dotted name, tensor, kind.
pub type Visitor<'a> = dyn FnMut(String, &Tensor, TensorKind) + 'a;
/// Callback of [`Module::visit_mut`].
pub type VisitorMut<'a> = dyn FnMut(String, &mut Tensor, TensorKind) -> Result<()> + 'a;

/// `prefix.name`, or `name` at the top level.
pub fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// A layer or a network of layers.
///
/// Implementors provide `forward`, and `visit`/`visit_mut` over their own tensors and their
/// children's; everything else (parameters, modes, dtype and device moves) is derived.
pub trait Module: Send + Sync {
    /// Applies the module.
    fn forward(&self, x: &Tensor) -> Result<Tensor>;

    /// Calls `f` for every tensor of this module and its children, with dotted names.
    fn visit(&self, prefix: &str, f: &mut Visitor);

    /// Like [`Module::visit`], with the tensors open for replacement.
    fn visit_mut(&mut self, prefix: &str, f: &mut VisitorMut) -> Result<()>;

    /// Switches training mode (dropout, batch statistics) on or off, children included.
    ///
    /// The default walks [`Module::visit_mut`], the traversal that finds the parameters:
    /// every module with a mode of its own ([`Dropout`], [`BatchNorm2d`]) takes the new mode
    /// as the walk reaches it, so a module that forwards `visit_mut` to its children switches
    /// them without writing this method.
    fn set_training(&mut self, on: bool) {
        /// Puts back the mode an enclosing walk was setting, if any.
        struct Restore(Option<bool>);
        impl Drop for Restore {
            fn drop(&mut self) {
                let _ = MODE_BEING_SET.try_with(|m| m.set(self.0));
            }
        }
        let _restore = Restore(MODE_BEING_SET.with(|m| m.replace(Some(on))));
        // The walk only switches modes; it touches no tensor, so it cannot fail.
        let _ = self.visit_mut("", &mut |_, _, _| Ok(()));
    }

    /// `relu(self.forward(x))` in one fused op, for modules that have one (a Linear with a
    /// bias: [`Tensor::linear_relu`]); `None` otherwise. [`Sequential`] calls it for a module
    /// followed by [`Activation::Relu`].
    fn forward_relu(&self, _x: &Tensor) -> Option<Result<Tensor>> {
        None
    }

    /// `relu(self.forward(x) + residual)` in one fused op, for modules that have one
    /// ([`BatchNorm2d`] when the residual matches its output); `None` otherwise. [`Residual`]
    /// calls it on its main branch's last layer.
    fn forward_add_relu(&self, _x: &Tensor, _residual: &Tensor) -> Option<Result<Tensor>> {
        None
    }

    /// Whether this module is [`Activation::Relu`] (so the module before it may fuse it).
    fn is_relu(&self) -> bool {
        false
    }

    /// The tensors of one kind with their names, in a stable order.
    fn named_tensors(&self, kind: TensorKind) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        self.visit("", &mut |n, t, k| {
            if k == kind {
                out.push((n, t.clone()))
            }
        });
        out
    }

    /// Parameters with their names. A parameter reached under two names (a weight tied to
    /// another, as GPT-2's head to its token embedding: `head.weight = wte.weight.clone()`) is
    /// listed once, under its first name, as PyTorch's `named_parameters` removes duplicates,
    /// so that clipping counts its gradient once and an optimizer gets it once;
    /// [`Module::state_dict`] keeps both names.
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut out: Vec<(String, Tensor)> = Vec::new();
        for (name, t) in self.named_tensors(TensorKind::Parameter) {
            // The same tensor: one storage seen through one layout.
            let same = |(_, k): &(String, Tensor)| k.shares_storage(&t) && k.layout() == t.layout();
            if !out.iter().any(same) {
                out.push((name, t));
            }
        }
        out
    }

    /// Parameters, in a stable order.
    fn parameters(&self) -> Vec<Tensor> {
        self.named_parameters()
            .into_iter()
            .map(|(_, t)| t)
            .collect()
    }

    /// Buffers (running statistics and the like) with their names.
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        self.named_tensors(TensorKind::Buffer)
    }

    /// Generator states (a [`Dropout`]'s stream position) with their names.
    fn named_generators(&self) -> Vec<(String, Tensor)> {
        self.named_tensors(TensorKind::Generator)
    }

    /// Number of trainable scalars.
    fn num_parameters(&self) -> usize {
        self.parameters().iter().map(|p| p.numel()).sum()
    }

    /// Training mode.
    fn train(&mut self) {
        self.set_training(true)
    }

    /// Evaluation mode.
    fn eval(&mut self) {
        self.set_training(false)
    }

    /// Moves every tensor to `device` (parameters stay trainable leaves; generator states
    /// stay on the host).
    ///
    /// A tensor reached under two names (a tied weight) stays one tensor: both names get
    /// the same moved tensor, as in PyTorch, where `model.to(...)` moves each parameter once.
    fn to_device(&mut self, device: Device) -> Result<()> {
        let mut once = ConvertOnce::default();
        self.visit_mut("", &mut |_, t, k| {
            if k == TensorKind::Generator {
                return Ok(());
            }
            *t = once.convert(t, k, |t| renew(t.to_device(device)?, k))?;
            Ok(())
        })
    }

    /// Puts every 4-D tensor (convolution weights) in `format` (PyTorch's
    /// `model.to(memory_format=torch.channels_last)`); parameters stay trainable leaves.
    /// With channels-last weights and input, a GPU convolution reads its weight as it is,
    /// without a reorder per call. Call it before making the optimizer, which keeps the
    /// parameters it was given.
    ///
    /// ```
    /// use mantissa::nn::{Conv2d, Module};
    /// use mantissa::{Generator, MemoryFormat};
    /// let mut conv = Conv2d::new(3, 8, 3, Default::default(), true, &mut Generator::new(0))?;
    /// conv.to_memory_format(MemoryFormat::ChannelsLast)?;
    /// assert!(conv.parameters()[0].is_channels_last());
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    fn to_memory_format(&mut self, format: MemoryFormat) -> Result<()> {
        let mut once = ConvertOnce::default();
        self.visit_mut("", &mut |_, t, k| {
            if t.rank() == 4 && k != TensorKind::Generator {
                *t = once.convert(t, k, |t| renew(t.to_memory_format(format)?, k))?;
            }
            Ok(())
        })
    }

    /// Converts the floating tensors to `dtype` (integer buffers stay as they are). A tied
    /// weight stays one tensor, as in [`Module::to_device`].
    ///
    /// ```
    /// use mantissa::nn::{Linear, Module, Sequential};
    /// use mantissa::{DType, Generator};
    /// let mut g = Generator::new(0);
    /// let (a, mut b) = (Linear::new(4, 4, false, &mut g)?, Linear::new(4, 4, false, &mut g)?);
    /// b.weight = a.weight.clone(); // tied
    /// let mut net = Sequential::new().push(a).push(b);
    /// net.to_dtype(DType::F16)?;
    /// assert_eq!(net.parameters().len(), 1);
    /// assert_eq!(net.state_dict().len(), 2);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    fn to_dtype(&mut self, dtype: DType) -> Result<()> {
        let mut once = ConvertOnce::default();
        self.visit_mut("", &mut |_, t, k| {
            if t.dtype().is_float() && k != TensorKind::Generator {
                *t = once.convert(t, k, |t| renew(t.to_dtype(dtype)?, k))?;
            }
            Ok(())
        })
    }

    /// The parameters and buffers by PyTorch's names, detached (PyTorch's `state_dict`;
    /// generator states are left out, as PyTorch has none).
    ///
    /// ```
    /// use mantissa::nn::{BatchNorm2d, Module};
    /// let bn = BatchNorm2d::new(3)?;
    /// let names: Vec<String> = bn.state_dict().into_keys().collect();
    /// assert_eq!(names, ["bias", "num_batches_tracked", "running_mean", "running_var", "weight"]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    fn state_dict(&self) -> std::collections::BTreeMap<String, Tensor> {
        state::state_dict(self)
    }

    /// Copies `state` (names as [`Module::state_dict`] gives them) into this module's
    /// tensors, each converted to its tensor's dtype and device (PyTorch's
    /// `load_state_dict`: a float `num_batches_tracked` goes into the i64 buffer). A shape
    /// that differs is an error, and so is a value the tensor's dtype cannot hold unchanged
    /// (a float that is not a whole number, or out of range, for an integer tensor); so,
    /// with `strict`, is a missing or unexpected name; without it those are returned.
    /// Nothing is written unless all is well.
    ///
    /// ```
    /// use mantissa::nn::{Linear, Module};
    /// use mantissa::Generator;
    /// let a = Linear::new(4, 2, true, &mut Generator::new(0))?;
    /// let mut b = Linear::new(4, 2, true, &mut Generator::new(1))?;
    /// b.load_state_dict(&a.state_dict(), true)?;
    /// assert_eq!(a.parameters()[0].to_vec::<f32>()?, b.parameters()[0].to_vec::<f32>()?);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    fn load_state_dict(
        &mut self,
        state: &std::collections::BTreeMap<String, Tensor>,
        strict: bool,
    ) -> Result<LoadReport> {
        state::load_state_dict(self, state, strict)
    }

    /// Clears every parameter's gradient.
    fn zero_grad(&self) {
        for p in self.parameters() {
            p.zero_grad()
        }
    }
}

/// Visits a layer's `weight` and optional `bias` parameters.
fn visit_weight_bias(p: &str, f: &mut Visitor, weight: &Tensor, bias: Option<&Tensor>) {
    f(join(p, "weight"), weight, TensorKind::Parameter);
    if let Some(b) = bias {
        f(join(p, "bias"), b, TensorKind::Parameter);
    }
}

/// Mutable twin of [`visit_weight_bias`].
fn visit_weight_bias_mut(
    p: &str,
    f: &mut VisitorMut,
    weight: &mut Tensor,
    bias: Option<&mut Tensor>,
) -> Result<()> {
    f(join(p, "weight"), weight, TensorKind::Parameter)?;
    match bias {
        Some(b) => f(join(p, "bias"), b, TensorKind::Parameter),
        None => Ok(()),
    }
}

/// The conversions a walk over a module's tensors has made, by the tensor converted: a
/// tensor met again under another name (a tied weight: the same storage seen through the same
/// layout, as [`Module::named_parameters`] tells them apart, and of the same kind) gets the
/// tensor made the first time, so the two names still hold one tensor afterwards.
#[derive(Default)]
struct ConvertOnce {
    done: Vec<(Tensor, TensorKind, Tensor)>,
}

impl ConvertOnce {
    /// `f(t)`, or what it gave for the same tensor of the same kind before.
    fn convert(
        &mut self,
        t: &Tensor,
        kind: TensorKind,
        f: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let same = |(old, k, _): &&(Tensor, TensorKind, Tensor)| {
            *k == kind && old.shares_storage(t) && old.layout() == t.layout()
        };
        if let Some((.., new)) = self.done.iter().find(same) {
            return Ok(new.clone());
        }
        let new = f(t)?;
        self.done.push((t.clone(), kind, new.clone()));
        Ok(new)
    }
}

/// A fresh leaf with the data of `t`, trainable when it is a parameter.
fn renew(t: Tensor, kind: TensorKind) -> Result<Tensor> {
    t.detach().requires_grad(kind == TensorKind::Parameter)
}

/// A parameter drawn from U(-bound, bound), as PyTorch's `kaiming_uniform_(a=sqrt(5))` and
/// bias initialisation do with `bound = 1 / sqrt(fan_in)`.
pub fn uniform_param(shape: &[usize], bound: f64, gen: &mut Generator) -> Result<Tensor> {
    Tensor::rand_with(shape, -bound, bound, DType::F32, Device::Cpu, gen)?.requires_grad(true)
}

/// Elementwise activations as modules.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activation {
    Relu,
    LeakyRelu(f64),
    Gelu,
    GeluTanh,
    Silu,
    Tanh,
    Sigmoid,
}

impl Module for Activation {
    fn is_relu(&self) -> bool {
        matches!(self, Activation::Relu)
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match *self {
            Activation::Relu => x.relu(),
            Activation::LeakyRelu(s) => x.leaky_relu(s),
            Activation::Gelu => x.gelu(),
            Activation::GeluTanh => x.gelu_tanh(),
            Activation::Silu => x.silu(),
            Activation::Tanh => x.tanh(),
            Activation::Sigmoid => x.sigmoid(),
        }
    }
    fn visit(&self, _: &str, _: &mut Visitor) {}
    fn visit_mut(&mut self, _: &str, _: &mut VisitorMut) -> Result<()> {
        Ok(())
    }
}

/// Flattens every dim after the first (`nn.Flatten()`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Flatten;

impl Module for Flatten {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.flatten(1, -1)
    }
    fn visit(&self, _: &str, _: &mut Visitor) {}
    fn visit_mut(&mut self, _: &str, _: &mut VisitorMut) -> Result<()> {
        Ok(())
    }
}

/// Modules applied in order; children are named `0`, `1`, ...
///
/// ```
/// use mantissa::nn::{Activation, Linear, Module, Sequential};
/// use mantissa::{Generator, Tensor, DType, Device};
/// let mut g = Generator::new(0);
/// let net = Sequential::new()
///     .push(Linear::new(4, 8, true, &mut g)?)
///     .push(Activation::Relu)
///     .push(Linear::new(8, 2, true, &mut g)?);
/// let y = net.forward(&Tensor::ones(&[3, 4], DType::F32, Device::Cpu)?)?;
/// assert_eq!(y.shape(), &[3, 2]);
/// assert_eq!(net.named_parameters()[2].0, "2.weight");
/// # Ok::<(), mantissa::Error>(())
/// ```
#[derive(Default)]
pub struct Sequential {
    layers: Vec<Box<dyn Module>>,
}

/// `layers` applied in order; a layer followed by a ReLU runs both in one op where it has a
/// fused form ([`Module::forward_relu`]).
fn run_layers(layers: &[Box<dyn Module>], x: &Tensor) -> Result<Tensor> {
    let mut h = x.clone();
    let mut i = 0;
    while i < layers.len() {
        let relu_next = layers.get(i + 1).is_some_and(|l| l.is_relu());
        if let Some(y) = relu_next.then(|| layers[i].forward_relu(&h)).flatten() {
            h = y?;
            i += 2;
            continue;
        }
        h = layers[i].forward(&h)?;
        i += 1;
    }
    Ok(h)
}

impl Sequential {
    pub fn new() -> Sequential {
        Sequential::default()
    }

    /// The layers but the last applied to `x` (fused as in `forward`), and the last layer:
    /// `None` when it is empty or ends in a ReLU (which the layer before it fuses).
    pub(crate) fn split_last(&self, x: &Tensor) -> Option<Result<(Tensor, &dyn Module)>> {
        let (last, init) = self.layers.split_last()?;
        if last.is_relu() {
            return None;
        }
        Some(run_layers(init, x).map(|h| (h, &**last)))
    }

    /// Appends a module.
    #[allow(clippy::should_implement_trait)]
    pub fn push(mut self, m: impl Module + 'static) -> Sequential {
        self.layers.push(Box::new(m));
        self
    }

    pub fn len(&self) -> usize {
        self.layers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
}

impl Module for Sequential {
    /// Applies the layers in order; a layer followed by a ReLU runs both in one op where it
    /// has a fused form (a Linear with a bias on CUDA: [`Tensor::linear_relu`]).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        run_layers(&self.layers, x)
    }
    fn visit(&self, prefix: &str, f: &mut Visitor) {
        for (i, l) in self.layers.iter().enumerate() {
            l.visit(&join(prefix, &i.to_string()), f);
        }
    }
    fn visit_mut(&mut self, prefix: &str, f: &mut VisitorMut) -> Result<()> {
        for (i, l) in self.layers.iter_mut().enumerate() {
            l.visit_mut(&join(prefix, &i.to_string()), f)?;
        }
        Ok(())
    }
    fn set_training(&mut self, on: bool) {
        for l in &mut self.layers {
            l.set_training(on);
        }
    }
}
