//! Reverse-mode autograd over the dynamic graph the ops record.
//!
//! Each op whose inputs need gradients attaches a `Node` to its output: the inputs plus a
//! one-shot backward closure. [`Tensor::backward`] sorts the graph, runs the closures in reverse
//! order under `no_grad`, accumulates into the leaves' `.grad()`, and frees every node it ran
//! (saved tensors included), as PyTorch does without `retain_graph`.

pub(crate) mod join;

use crate::scope::{ScopeEntry, ScopeStack};
use crate::{Error, Result, Tensor};
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

/// Computes the inputs' gradients from the output's gradient. `needs[i]` tells whether input
/// `i` wants one; entries for the others may be `None`.
pub(crate) type BackwardFn =
    Box<dyn FnOnce(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + 'static>;

/// Where the gradient of one op input goes. An edge holds the input's producing node or its
/// gradient slot, never the input's data: a graph keeps alive only what the backward
/// closures saved.
pub(crate) enum Edge {
    /// The input was made by a recorded op.
    Node {
        node: Arc<Node>,
        shape: Vec<usize>,
        dtype: crate::DType,
    },
    /// The input is a leaf that requires grad.
    Leaf {
        grad: Arc<Mutex<Option<Tensor>>>,
        shape: Vec<usize>,
        dtype: crate::DType,
        /// The leaf's memory format, which its gradient takes (PyTorch's layout contract).
        format: crate::MemoryFormat,
    },
    /// The input needs no gradient.
    None,
}

impl Edge {
    fn of(t: &Tensor) -> Edge {
        let (shape, dtype) = (t.shape().to_vec(), t.dtype());
        match &t.0.node {
            Some(node) => Edge::Node {
                node: node.clone(),
                shape,
                dtype,
            },
            None if t.is_requires_grad() => Edge::Leaf {
                grad: t.0.grad.clone(),
                shape,
                dtype,
                format: t.memory_format(),
            },
            None => Edge::None,
        }
    }
}

static NEXT_NODE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// One recorded op.
pub(crate) struct Node {
    id: u64,
    pub(crate) name: &'static str,
    state: Mutex<Option<(Vec<Edge>, BackwardFn)>>,
    /// The tensors the backward reads (inputs or outputs), with their storage versions when
    /// they were saved: an in-place write since then would make the gradient wrong, so
    /// backward refuses it (PyTorch's saved-tensor version check).
    saved: Vec<(Tensor, u64)>,
}

impl Node {
    fn new(name: &'static str, edges: Vec<Edge>, f: BackwardFn, saved: &[&Tensor]) -> Node {
        Node {
            id: NEXT_NODE.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            name,
            state: Mutex::new(Some((edges, f))),
            // Detached: a saved output must not hold its own node (a reference cycle).
            saved: saved.iter().map(|t| (t.detach(), t.version())).collect(),
        }
    }

    /// `Err` when a saved tensor was written in place after it was saved.
    fn check_saved(&self) -> Result<()> {
        for (i, (t, v)) in self.saved.iter().enumerate() {
            let now = t.version();
            if now != *v {
                return Err(Error::Autograd(format!(
                    "operand {i} of `{}` (shape {:?}, {:?}), which its backward reads, was \
                     modified in place after the forward (version {v}, now {now}), so the \
                     gradient would be wrong; write into a clone instead, or make the change \
                     after backward()",
                    self.name,
                    t.shape(),
                    t.dtype()
                )));
            }
        }
        Ok(())
    }

    /// The nodes this one sends gradients to.
    fn children(&self) -> Vec<Arc<Node>> {
        lock(&self.state)
            .as_ref()
            .map(|(edges, _)| {
                edges
                    .iter()
                    .filter_map(|e| match e {
                        Edge::Node { node, .. } => Some(node.clone()),
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    fn take(&self) -> Option<(Vec<Edge>, BackwardFn)> {
        lock(&self.state).take()
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

thread_local! {
    /// The grad mode in force: a cache of [`NO_GRAD`]'s top, read by every op.
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
    static NO_GRAD: RefCell<ScopeStack<bool>> = const { RefCell::new(ScopeStack::new()) };
}

/// True unless inside a [`no_grad`] scope on this thread.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Disables graph recording on this thread until dropped.
///
/// Guards nest and may be dropped in any order: gradients stay off while any guard of this
/// thread is alive and come back once all are gone. A guard is not `Send`: it belongs to the
/// thread whose grad mode it changed.
///
/// ```
/// use mantissa::{is_grad_enabled, NoGradGuard};
/// let a = NoGradGuard::new();
/// let b = NoGradGuard::new();
/// drop(a);
/// assert!(!is_grad_enabled());
/// drop(b);
/// assert!(is_grad_enabled());
/// ```
#[must_use = "gradients are off as long as the guard lives"]
pub struct NoGradGuard {
    entry: ScopeEntry<bool>,
}

impl NoGradGuard {
    #[allow(clippy::new_without_default)]
    pub fn new() -> NoGradGuard {
        NoGradGuard {
            entry: ScopeEntry::push(&NO_GRAD, false, set_grad_mode),
        }
    }
}

fn set_grad_mode(top: Option<bool>) {
    let _ = GRAD_ENABLED.try_with(|g| g.set(top.unwrap_or(true)));
}

impl Drop for NoGradGuard {
    fn drop(&mut self) {
        self.entry.pop(set_grad_mode);
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
        self,
        name: &'static str,
        inputs: &[&Tensor],
        backward: impl FnOnce(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + 'static,
    ) -> Tensor {
        self.attach_saving(name, inputs, &[], backward)
    }

    /// [`Tensor::attach`] for a backward that reads `saved` (inputs, or the output). Their
    /// versions are recorded, and backward refuses to run this op when one of them was
    /// written in place since.
    pub(crate) fn attach_saving(
        mut self,
        name: &'static str,
        inputs: &[&Tensor],
        saved: &[&Tensor],
        backward: impl FnOnce(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + 'static,
    ) -> Tensor {
        if !is_grad_enabled() || !inputs.iter().any(|t| t.is_requires_grad()) {
            return self;
        }
        let node = Node::new(
            name,
            inputs.iter().map(|t| Edge::of(t)).collect(),
            Box::new(backward),
            saved,
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
        let Some(root) = self.0.node.clone() else {
            // Backward on a leaf: its gradient is the seed.
            return accumulate(&self.0.grad, grad);
        };
        let mut grads: HashMap<u64, Tensor> = HashMap::new();
        grads.insert(root.id, grad);
        for node in topo_order(root) {
            let Some((edges, f)) = node.take() else {
                return Err(Error::Autograd(format!(
                    "the graph through `{}` was already freed by an earlier backward()",
                    node.name
                )));
            };
            let Some(g) = grads.remove(&node.id) else {
                continue;
            };
            // The backward and the accumulation of its input gradients, as one span.
            let _prof = crate::profiler::backward(node.name);
            node.check_saved()?;
            let needs: Vec<bool> = edges.iter().map(|e| !matches!(e, Edge::None)).collect();
            let in_grads = f(&g, &needs)?;
            for (edge, ig) in edges.iter().zip(in_grads) {
                let Some(ig) = ig else { continue };
                match edge {
                    Edge::None => {}
                    Edge::Node {
                        node: input,
                        shape,
                        dtype,
                    } => {
                        let ig = conform(node.name, shape, *dtype, ig)?;
                        let sum = match grads.remove(&input.id) {
                            Some(prev) => prev.add(&ig)?,
                            None => ig,
                        };
                        grads.insert(input.id, sum);
                    }
                    Edge::Leaf {
                        grad,
                        shape,
                        dtype,
                        format,
                    } => {
                        let ig = conform(node.name, shape, *dtype, ig)?;
                        // A channels-last parameter gets a channels-last gradient and an
                        // NCHW one an NCHW gradient, whichever format the op produced.
                        let ig = match ig.memory_format() == *format {
                            true => ig,
                            false => ig.to_memory_format(*format)?,
                        };
                        accumulate(grad, ig)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// Adds `g` to a leaf's gradient slot.
fn accumulate(slot: &Mutex<Option<Tensor>>, g: Tensor) -> Result<()> {
    let mut slot = lock(slot);
    *slot = Some(match slot.take() {
        Some(prev) => prev.add(&g)?,
        None => g,
    });
    Ok(())
}

/// Checks an input gradient's shape and casts it to the input's dtype.
fn conform(op: &'static str, shape: &[usize], dtype: crate::DType, g: Tensor) -> Result<Tensor> {
    if g.shape() != shape {
        return Err(Error::Autograd(format!(
            "backward of `{op}` produced a gradient of shape {:?} for an input of shape {shape:?}",
            g.shape()
        )));
    }
    if g.dtype() != dtype {
        return g.to_dtype(dtype);
    }
    Ok(g)
}

/// Nodes reachable from `root`, each after every node that feeds it a gradient.
fn topo_order(root: Arc<Node>) -> Vec<Arc<Node>> {
    let mut post: Vec<Arc<Node>> = Vec::new();
    let mut seen: HashSet<u64> = HashSet::new();
    // Iterative DFS (graphs of long sequences are deep).
    let mut stack: Vec<(Arc<Node>, bool)> = vec![(root, false)];
    while let Some((n, expanded)) = stack.pop() {
        if expanded {
            post.push(n);
            continue;
        }
        if !seen.insert(n.id) {
            continue;
        }
        let children = n.children();
        stack.push((n, true));
        for c in children {
            if !seen.contains(&c.id) {
                stack.push((c, false));
            }
        }
    }
    post.reverse();
    post
}
