//! A module's tensors from its fields, without a hand-written `visit`/`visit_mut`: the
//! [`visit_fields!`](crate::visit_fields) macro writes both from a list of fields, each a
//! module, a `Vec` or `Option` of them, or a tensor (a parameter).

use super::{join, Module, TensorKind, Visitor, VisitorMut};
use crate::{Result, Tensor};

/// A field [`visit_fields!`](crate::visit_fields) can walk: a module, a `Vec` of fields
/// (named `name.0`, `name.1`, ... as PyTorch's `ModuleList` names them), an `Option` of one
/// (nothing when `None`), or a tensor (a parameter, named `name`).
pub trait Fields {
    /// Calls `f` for every tensor under `name`.
    fn visit_as(&self, name: &str, f: &mut Visitor);
    /// Like [`Fields::visit_as`], with the tensors open for replacement.
    fn visit_as_mut(&mut self, name: &str, f: &mut VisitorMut) -> Result<()>;
}

impl<M: Module> Fields for M {
    fn visit_as(&self, name: &str, f: &mut Visitor) {
        self.visit(name, f)
    }
    fn visit_as_mut(&mut self, name: &str, f: &mut VisitorMut) -> Result<()> {
        self.visit_mut(name, f)
    }
}

impl<T: Fields> Fields for Vec<T> {
    fn visit_as(&self, name: &str, f: &mut Visitor) {
        for (i, m) in self.iter().enumerate() {
            m.visit_as(&join(name, &i.to_string()), f);
        }
    }
    fn visit_as_mut(&mut self, name: &str, f: &mut VisitorMut) -> Result<()> {
        for (i, m) in self.iter_mut().enumerate() {
            m.visit_as_mut(&join(name, &i.to_string()), f)?;
        }
        Ok(())
    }
}

impl<T: Fields> Fields for Option<T> {
    fn visit_as(&self, name: &str, f: &mut Visitor) {
        if let Some(m) = self {
            m.visit_as(name, f);
        }
    }
    fn visit_as_mut(&mut self, name: &str, f: &mut VisitorMut) -> Result<()> {
        match self {
            Some(m) => m.visit_as_mut(name, f),
            None => Ok(()),
        }
    }
}

impl Fields for Tensor {
    fn visit_as(&self, name: &str, f: &mut Visitor) {
        f(name.to_string(), self, TensorKind::Parameter);
    }
    fn visit_as_mut(&mut self, name: &str, f: &mut VisitorMut) -> Result<()> {
        f(name.to_string(), self, TensorKind::Parameter)
    }
}

/// Writes a [`Module`]'s `visit` and `visit_mut` from its fields, inside `impl Module for
/// ..`: each field is visited under its own name, or under the dotted name given after `as`
/// (to match a checkpoint's names). A field may be a module, a `Vec` of modules (as
/// PyTorch's `ModuleList`: `h.0`, `h.1`, ...; the elements keep their type), an `Option` of
/// one, or a tensor, which is a parameter. [`Module::set_training`] and every other walk
/// follow the fields through these two methods.
///
/// ```
/// use mantissa::nn::{Linear, Module};
/// use mantissa::{Generator, Result, Tensor};
/// struct Mlp {
///     fc: Linear,
///     blocks: Vec<Linear>,
///     proj: Linear,
///     scale: Tensor,
/// }
/// impl Module for Mlp {
///     fn forward(&self, x: &Tensor) -> Result<Tensor> {
///         let mut h = self.fc.forward(x)?.relu()?;
///         for b in &self.blocks {
///             h = h.add(&b.forward(&h)?)?;
///         }
///         self.proj.forward(&h)?.mul(&self.scale)
///     }
///     mantissa::visit_fields!(fc, blocks, proj as "head.proj", scale);
/// }
/// let g = &mut Generator::new(0);
/// let net = Mlp {
///     fc: Linear::new(4, 8, true, g)?,
///     blocks: vec![Linear::new(8, 8, true, g)?, Linear::new(8, 8, false, g)?],
///     proj: Linear::new(8, 2, true, g)?,
///     scale: Tensor::ones(&[2], mantissa::DType::F32, mantissa::Device::Cpu)?.requires_grad(true)?,
/// };
/// let names: Vec<String> = net.named_parameters().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(
///     names,
///     ["fc.weight", "fc.bias", "blocks.0.weight", "blocks.0.bias", "blocks.1.weight",
///      "head.proj.weight", "head.proj.bias", "scale"]
/// );
/// # Ok::<(), mantissa::Error>(())
/// ```
#[macro_export]
macro_rules! visit_fields {
    (@name $field:ident $name:literal) => {
        $name
    };
    (@name $field:ident) => {
        stringify!($field)
    };
    ($($field:ident $(as $name:literal)?),* $(,)?) => {
        fn visit(&self, prefix: &str, f: &mut $crate::nn::Visitor) {
            $(
                let name = $crate::visit_fields!(@name $field $($name)?);
                $crate::nn::Fields::visit_as(&self.$field, &$crate::nn::join(prefix, name), f);
            )*
        }
        fn visit_mut(
            &mut self,
            prefix: &str,
            f: &mut $crate::nn::VisitorMut,
        ) -> $crate::Result<()> {
            $(
                let name = $crate::visit_fields!(@name $field $($name)?);
                $crate::nn::Fields::visit_as_mut(
                    &mut self.$field,
                    &$crate::nn::join(prefix, name),
                    f,
                )?;
            )*
            Ok(())
        }
    };
}
