//! Reverse-mode autograd over the dynamic graph the ops record.
//!
//! Each op whose inputs need gradients attaches a [`Node`] to its output: the inputs plus a
//! one-shot backward closure. [`Tensor::backward`] sorts the graph, runs the closures in reverse
//! order under `no_grad`, accumulates into the leaves' `.grad()`, and frees every node it ran
//! (saved tensors included), as PyTorch does without `retain_graph`.

use crate::{Error, Result, Tensor};
use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

/// Computes the inputs' gradients from the output's gradient. `needs[i]` tells whether input
/// `i` wants one; entries for the others may be `None`.
pub(crate) type BackwardFn =
    Box<dyn FnOnce(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + 'static>;

/// One recorded op.
pub(crate) struct Node {
    pub(crate) name: &'static str,
    state: Mutex<Option<(Vec<Tensor>, BackwardFn)>>,
}

impl Node {
    pub(crate) fn new(name: &'static str, inputs: Vec<Tensor>, f: BackwardFn) -> Node {
        Node {
            name,
            state: Mutex::new(Some((inputs, f))),
        }
    }

    fn inputs(&self) -> Vec<Tensor> {
        lock(&self.state)
            .as_ref()
            .map(|(i, _)| i.clone())
            .unwrap_or_default()
    }

    fn take(&self) -> Option<(Vec<Tensor>, BackwardFn)> {
        lock(&self.state).take()
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// True unless inside a [`no_grad`] scope on this thread.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Disables graph recording on this thread until dropped; restores the previous mode.
pub struct NoGradGuard {
    prev: bool,
}

impl NoGradGuard {
    #[allow(clippy::new_without_default)]
    pub fn new() -> NoGradGuard {
        let prev = GRAD_ENABLED.with(|g| g.replace(false));
        NoGradGuard { prev }
    }
}

impl Drop for NoGradGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|g| g.set(self.prev));
    }
}

/// Runs `f` without recording the graph (like `with torch.no_grad():`).
///
/// ```
/// use mantissa::{no_grad, Tensor};
/// let w = Tensor::ones(&[2], mantissa::DType::F32, mantissa::Device::Cpu).unwrap().requires_grad(true).unwrap();
/// let y = no_grad(|| w.mul(2.0)).unwrap();
/// assert!(!y.is_requires_grad());
/// ```
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    let _g = NoGradGuard::new();
    f()
}

impl Tensor {
    /// Attaches a backward closure when grad mode is on and an input requires grad.
    pub(crate) fn attach(
        mut self,
        name: &'static str,
        inputs: &[&Tensor],
        backward: impl FnOnce(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + 'static,
    ) -> Tensor {
        if !is_grad_enabled() || !inputs.iter().any(|t| t.is_requires_grad()) {
            return self;
        }
        let node = Node::new(
            name,
            inputs.iter().map(|t| (*t).clone()).collect(),
            Box::new(backward),
        );
        match Arc::get_mut(&mut self.0) {
            Some(inner) => inner.node = Some(Arc::new(node)),
            None => unreachable!("attach is called on a freshly made tensor"),
        }
        self
    }

    /// Computes the gradient of this scalar with respect to every leaf that requires grad and
    /// adds it to their `.grad()`. The graph is freed afterwards.
    ///
    /// ```
    /// use mantissa::{Tensor, Device};
    /// let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3], Device::Cpu)?.requires_grad(true)?;
    /// x.mul(&x)?.sum_all()?.backward()?;
    /// assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![2.0, 4.0, 6.0]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn backward(&self) -> Result<()> {
        if self.numel() != 1 {
            return Err(Error::Autograd(format!(
                "backward() needs a scalar output, got shape {:?}; pass a gradient with backward_with",
                self.shape()
            )));
        }
        let seed = crate::no_grad(|| Tensor::ones(self.shape(), self.dtype(), self.device()))?;
        self.backward_with(&seed)
    }

    /// Backward with an explicit gradient of this tensor's shape and dtype.
    pub fn backward_with(&self, grad: &Tensor) -> Result<()> {
        if !self.is_requires_grad() {
            return Err(Error::Autograd(
                "backward() on a tensor that does not require grad (no input had requires_grad, or it was made under no_grad)".into(),
            ));
        }
        if grad.shape() != self.shape() {
            return Err(Error::ShapeMismatch {
                op: "backward",
                lhs: self.shape().to_vec(),
                rhs: grad.shape().to_vec(),
            });
        }
        let _ng = crate::NoGradGuard::new();
        // Backward ops run in the forward's dtypes, never re-cast by an enclosing autocast.
        let _ac = crate::amp::autocast_disabled();
        let grad = grad.detach().to_dtype(self.dtype())?;
        let order = topo_order(self);
        let mut grads: HashMap<u64, Tensor> = HashMap::new();
        grads.insert(self.id(), grad);
        for t in order {
            let node =
                t.0.node
                    .as_ref()
                    .expect("topo_order yields tensors with nodes");
            let Some((inputs, f)) = node.take() else {
                return Err(Error::Autograd(format!(
                    "the graph through `{}` was already freed by an earlier backward()",
                    node.name
                )));
            };
            let Some(g) = grads.remove(&t.id()) else {
                continue;
            };
            let needs: Vec<bool> = inputs.iter().map(|i| i.is_requires_grad()).collect();
            let in_grads = f(&g, &needs)?;
            for ((input, ig), need) in inputs.iter().zip(in_grads).zip(needs) {
                let (Some(ig), true) = (ig, need) else {
                    continue;
                };
                let ig = conform(node.name, input, ig)?;
                if input.0.node.is_some() {
                    match grads.remove(&input.id()) {
                        Some(prev) => grads.insert(input.id(), prev.add(&ig)?),
                        None => grads.insert(input.id(), ig),
                    };
                } else {
                    input.accumulate_grad(ig)?;
                }
            }
        }
        if self.0.node.is_none() {
            // Backward on a leaf: its gradient is the seed.
            if let Some(g) = grads.remove(&self.id()) {
                self.accumulate_grad(g)?;
            }
        }
        Ok(())
    }

    fn accumulate_grad(&self, g: Tensor) -> Result<()> {
        let mut slot = lock(&self.0.grad);
        *slot = Some(match slot.take() {
            Some(prev) => prev.add(&g)?,
            None => g,
        });
        Ok(())
    }
}

/// Checks an input gradient's shape and casts it to the input's dtype.
fn conform(op: &'static str, input: &Tensor, g: Tensor) -> Result<Tensor> {
    if g.shape() != input.shape() {
        return Err(Error::Autograd(format!(
            "backward of `{op}` produced a gradient of shape {:?} for an input of shape {:?}",
            g.shape(),
            input.shape()
        )));
    }
    if g.dtype() != input.dtype() {
        return g.to_dtype(input.dtype());
    }
    Ok(g)
}

/// Tensors with nodes reachable from `root`, each after every tensor that uses it.
fn topo_order(root: &Tensor) -> Vec<Tensor> {
    let mut post: Vec<Tensor> = Vec::new();
    let mut seen: HashSet<u64> = HashSet::new();
    // Iterative DFS (graphs of long sequences are deep).
    let mut stack: Vec<(Tensor, bool)> = vec![(root.clone(), false)];
    while let Some((t, expanded)) = stack.pop() {
        if expanded {
            post.push(t);
            continue;
        }
        let Some(node) = t.0.node.clone() else {
            continue;
        };
        if !seen.insert(t.id()) {
            continue;
        }
        stack.push((t, true));
        for i in node.inputs() {
            if i.0.node.is_some() && !seen.contains(&i.id()) {
                stack.push((i, false));
            }
        }
    }
    post.reverse();
    post
}
