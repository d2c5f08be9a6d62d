//! Reverse-mode autograd over the dynamic graph the ops record.
//!
//! Each op whose inputs need gradients attaches a `Node` to its output: the inputs plus a
//! one-shot backward closure. [`Tensor::backward`] sorts the graph, runs the closures in reverse
//! order under `no_grad`, accumulates into the leaves' `.grad()`, and frees every node it ran
//! (saved tensors included), as PyTorch does without `retain_graph`.

pub(crate) mod checkpoint;

mod function;
pub(crate) mod hooks;
pub(crate) mod join;
pub(crate) mod pending;
pub(crate) mod reuse;
pub(crate) mod saved;
pub(crate) mod taps;

pub use checkpoint::checkpoint;
pub use function::custom_op;
pub use saved::{recompute, set_recompute, Recompute};
pub use taps::HookHandle;

pub use crate::grad_mode::{is_grad_enabled, no_grad, NoGradGuard};
use crate::sync::lock;
use crate::tensor::node::{BackwardFn, Edge, Node};
use crate::{Error, Result, Tensor};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

impl Tensor {
    /// Attaches a backward closure when grad mode is on and an input requires grad.
    pub(crate) fn attach(
        self,
        name: &'static str,
        inputs: &[&Tensor],
        backward: impl Fn(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
    ) -> Tensor {
        self.attach_saving(name, inputs, &[], backward)
    }

    /// [`Tensor::attach`] for a backward that reads `saved` (inputs, or the output). Their
    /// versions are recorded, and backward refuses to run this op when one of them was
    /// written in place since.
    pub(crate) fn attach_saving(
        self,
        name: &'static str,
        inputs: &[&Tensor],
        saved: &[&Tensor],
        backward: impl Fn(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
    ) -> Tensor {
        note_reads(inputs.iter().copied());
        if !is_grad_enabled() || !inputs.iter().any(|t| t.is_requires_grad()) {
            return self;
        }
        self.attach_node(name, inputs, saved, Arc::new(backward))
    }

    /// [`Tensor::attach`] whenever grad mode is on, even when no input requires grad: for a
    /// checkpoint, whose function may use tensors that do (a module's parameters).
    pub(crate) fn attach_always(
        self,
        name: &'static str,
        inputs: &[&Tensor],
        saved: &[&Tensor],
        backward: impl Fn(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
    ) -> Tensor {
        note_reads(inputs.iter().copied());
        if !is_grad_enabled() {
            return self;
        }
        self.attach_node(name, inputs, saved, Arc::new(backward))
    }

    fn attach_node(
        mut self,
        name: &'static str,
        inputs: &[&Tensor],
        saved: &[&Tensor],
        backward: BackwardFn,
    ) -> Tensor {
        let node = Node::new(
            name,
            inputs.iter().map(|t| Edge::of(t)).collect(),
            backward,
            saved,
            Arc::downgrade(&self.0.grad),
        );
        match Arc::get_mut(&mut self.0) {
            Some(inner) => inner.node = Some(Arc::new(node)),
            None => unreachable!("attach is called on a freshly made tensor"),
        }
        self
    }

    /// Computes the gradient of this scalar with respect to every leaf that requires grad and
    /// adds it to their `.grad()`. The graph is freed afterwards: a second backward through
    /// it is an error (use [`Tensor::backward_retain_graph`] to keep it).
    ///
    /// ```
    /// use mantissa::{Tensor, Device};
    /// let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3], Device::Cpu)?.requires_grad(true)?;
    /// x.mul(&x)?.sum_all()?.backward()?;
    /// assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![2.0, 4.0, 6.0]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn backward(&self) -> Result<()> {
        self.backward_seeded(None, false)
    }

    /// [`Tensor::backward`] that keeps the graph, so that backward can run through it again
    /// (PyTorch's `backward(retain_graph=True)`); the saved tensors stay alive until the
    /// graph's last tensor is dropped or a backward without it frees them.
    ///
    /// ```
    /// use mantissa::{Tensor, Device};
    /// let x = Tensor::from_vec(vec![1.0f32, 2.0], &[2], Device::Cpu)?.requires_grad(true)?;
    /// let y = x.mul(&x)?.sum_all()?;
    /// y.backward_retain_graph()?;
    /// y.backward()?; // the gradients add up: 2 x twice
    /// assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![4.0, 8.0]);
    /// assert!(y.backward().is_err()); // freed by the second
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn backward_retain_graph(&self) -> Result<()> {
        self.backward_seeded(None, true)
    }

    /// Backward with an explicit gradient of this tensor's shape and dtype.
    pub fn backward_with(&self, grad: &Tensor) -> Result<()> {
        self.backward_seeded(Some(grad), false)
    }

    /// [`Tensor::backward_with`] that keeps the graph (see [`Tensor::backward_retain_graph`]).
    pub fn backward_with_retain_graph(&self, grad: &Tensor) -> Result<()> {
        self.backward_seeded(Some(grad), true)
    }

    fn backward_seeded(&self, grad: Option<&Tensor>, retain: bool) -> Result<()> {
        let seed;
        let grad = match grad {
            Some(g) => g,
            None if self.numel() != 1 => {
                return Err(Error::Autograd(format!(
                    "backward() needs a scalar output, got shape {:?}; pass a gradient with \
                     backward_with",
                    self.shape()
                )))
            }
            None => {
                seed = crate::no_grad(|| Tensor::ones(self.shape(), self.dtype(), self.device()))?;
                &seed
            }
        };
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
            let grad = taps::apply(&self.0.grad, grad, false)?;
            return accumulate(&self.0.grad, grad);
        };
        run(root, grad, 0, retain).map(|_| ())
    }

    /// Backward through the nodes recorded from id `inside` on only (a checkpoint's
    /// recomputation): the gradients that reach older nodes (the outer graph's) are returned
    /// by node id instead of sent on; leaves get theirs as in [`Tensor::backward_with`].
    pub(crate) fn backward_until(
        &self,
        grad: &Tensor,
        inside: u64,
    ) -> Result<HashMap<u64, Tensor>> {
        let _ng = crate::NoGradGuard::new();
        let _ac = crate::amp::autocast_disabled();
        let grad = grad.detach().to_dtype(self.dtype())?;
        match self.0.node.clone() {
            Some(root) if root.id >= inside => run(root, grad, inside, false),
            Some(root) => Ok(HashMap::from([(root.id, grad)])),
            None => accumulate(&self.0.grad, grad).map(|_| HashMap::new()),
        }
    }
}

/// Runs the backward of every node reachable from `root` whose id is at least `inside`,
/// seeded with `grad`; returns the gradients that reached older nodes, by id. With `retain`,
/// the nodes keep their closures for another backward.
fn run(root: Arc<Node>, grad: Tensor, inside: u64, retain: bool) -> Result<HashMap<u64, Tensor>> {
    let mut grads: HashMap<u64, Tensor> = HashMap::new();
    grads.insert(root.id, grad);
    let order = topo_order(root, inside);
    // Gradient-ready notifications, from the outermost backward only (a checkpoint's nested
    // one runs inside a node of it, which counts for the leaves it reaches).
    let plan = match inside {
        0 => hooks::Plan::new(order.iter().map(|n| n.leaf_keys())),
        _ => None,
    };
    let mut leaves = taps::active().then(|| LeafTaps::new(&order));
    for (pos, node) in order.into_iter().enumerate() {
        run_node(&node, &mut grads, retain, leaves.as_mut())?;
        if let Some(l) = &mut leaves {
            l.flush(pos)?;
        }
        if let Some(p) = &plan {
            p.after(pos)?;
        }
    }
    if let Some(p) = &plan {
        p.done()?;
    }
    grads.retain(|id, _| *id < inside);
    Ok(grads)
}

/// Runs one node's backward with the gradient that reached it (none: nothing to do) and
/// sends its input gradients on: into `grads` for nodes, into the slots of leaves.
fn run_node(
    node: &Arc<Node>,
    grads: &mut HashMap<u64, Tensor>,
    retain: bool,
    mut leaves: Option<&mut LeafTaps>,
) -> Result<()> {
    {
        let state = match retain {
            true => node.get(),
            false => node.take(),
        };
        let Some((edges, f)) = state else {
            return Err(Error::Autograd(format!(
                "backward through `{}` a second time: its graph was freed by the first \
                 backward(); call backward_retain_graph() the first time to keep it \
                 (PyTorch's retain_graph=True), or run the forward again",
                node.name
            )));
        };
        let Some(mut g) = grads.remove(&node.id) else {
            return Ok(());
        };
        // The output's hooks and retain_grad.
        if taps::active() {
            if let Some(slot) = node.out.upgrade() {
                g = taps::apply(&slot, g, true)?;
            }
        }
        // The backward and the accumulation of its input gradients, as one span.
        let _prof = crate::profiler::backward(node.name);
        node.check_saved()?;
        let needs: Vec<bool> = edges.iter().map(|e| !matches!(e, Edge::None)).collect();
        // The sums so far of the inputs that appear once, offered to the backward
        // (`pending`); what it does not take is added below as usual.
        // (An op has a handful of inputs: a scan, no map.)
        let id = |e: &Edge| match e {
            Edge::Node { node, .. } => Some(node.id),
            _ => None,
        };
        let offered = edges
            .iter()
            .map(|e| match id(e) {
                Some(i) if edges.iter().filter(|f| id(f) == Some(i)).count() == 1 => {
                    grads.remove(&i)
                }
                _ => None,
            })
            .collect();
        let (in_grads, mut left) =
            reuse::running(retain, || pending::offer(offered, || f(&g, &needs)));
        let mut in_grads = in_grads?.into_iter();
        for (i, edge) in edges.iter().enumerate() {
            let ig = in_grads.next().flatten();
            let prev = left.get_mut(i).and_then(Option::take);
            match edge {
                Edge::None => {}
                Edge::Node {
                    node: input,
                    shape,
                    dtype,
                } => {
                    let prev = prev.or_else(|| grads.remove(&input.id));
                    let sum = match (prev, ig) {
                        (Some(prev), Some(ig)) => {
                            prev.add(&conform(node.name, shape, *dtype, ig)?)?
                        }
                        (None, Some(ig)) => conform(node.name, shape, *dtype, ig)?,
                        (Some(prev), None) => prev,
                        (None, None) => continue,
                    };
                    grads.insert(input.id, sum);
                }
                Edge::Leaf {
                    grad,
                    shape,
                    dtype,
                    format,
                } => {
                    let Some(ig) = ig else { continue };
                    let ig = conform(node.name, shape, *dtype, ig)?;
                    // A channels-last parameter gets a channels-last gradient and an
                    // NCHW one an NCHW gradient, whichever format the op produced.
                    let ig = match ig.memory_format() == *format {
                        true => ig,
                        false => ig.to_memory_format(*format)?,
                    };
                    match leaves.as_deref_mut().filter(|l| l.holds(grad)) {
                        Some(l) => l.add(grad, ig)?,
                        None => accumulate(grad, ig)?,
                    }
                }
            }
        }
    }
    Ok(())
}

/// The gradients of this backward for leaves with taps (hooks), summed apart and given to
/// the hooks once each leaf's last node has run, then accumulated.
struct LeafTaps {
    /// Slot key -> position of the last node sending it a gradient.
    last: HashMap<usize, usize>,
    /// Slot key -> the slot and the sum so far.
    sums: HashMap<usize, (Arc<taps::Slot>, Tensor)>,
}

impl LeafTaps {
    fn new(order: &[Arc<Node>]) -> LeafTaps {
        let mut last = HashMap::new();
        for (pos, node) in order.iter().enumerate() {
            for slot in node.leaf_slots() {
                if taps::tapped(&slot) {
                    last.insert(Arc::as_ptr(&slot) as usize, pos);
                }
            }
        }
        LeafTaps {
            last,
            sums: HashMap::new(),
        }
    }

    fn holds(&self, slot: &Arc<taps::Slot>) -> bool {
        self.last.contains_key(&(Arc::as_ptr(slot) as usize))
    }

    fn add(&mut self, slot: &Arc<taps::Slot>, g: Tensor) -> Result<()> {
        let k = Arc::as_ptr(slot) as usize;
        let sum = match self.sums.remove(&k) {
            Some((_, prev)) => prev.add(&g)?,
            None => g,
        };
        self.sums.insert(k, (slot.clone(), sum));
        Ok(())
    }

    /// Hands on the sums of the leaves whose last node is at `pos`.
    fn flush(&mut self, pos: usize) -> Result<()> {
        let done: Vec<usize> = self
            .last
            .iter()
            .filter(|(_, &p)| p == pos)
            .map(|(&k, _)| k)
            .collect();
        for k in done {
            self.last.remove(&k);
            if let Some((slot, sum)) = self.sums.remove(&k) {
                let g = taps::apply(&slot, sum, false)?;
                accumulate(&slot, g)?;
            }
        }
        Ok(())
    }
}

/// Notes, inside a checkpoint's forward, the tensors an op reads: each made outside the
/// checkpoint is kept with its version (see `crate::frames`).
pub(crate) fn note_reads<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) {
    if !crate::frames::recording() {
        return;
    }
    for t in tensors {
        crate::frames::note_read(t.id(), || Box::new((t.clone(), t.version())));
    }
}

/// Adds `g` to a leaf's gradient slot. The slot's lock is never held while the sum is
/// computed (a CPU kernel's wait may run another task on this thread, one that accumulates
/// into the same leaf): the gradient so far is taken out, added to, and put back, again if
/// another thread put one meanwhile.
fn accumulate(slot: &Mutex<Option<Tensor>>, g: Tensor) -> Result<()> {
    let mut g = g;
    loop {
        let prev = {
            let mut s = lock(slot);
            match s.take() {
                None => {
                    *s = Some(g);
                    return Ok(());
                }
                Some(prev) => prev,
            }
        };
        match prev.add(&g) {
            Ok(sum) => g = sum,
            Err(e) => {
                // Nothing accumulated so far is lost.
                let mut s = lock(slot);
                *s = Some(match s.take() {
                    Some(other) => match other.add(&prev) {
                        Ok(sum) => sum,
                        Err(_) => other,
                    },
                    None => prev,
                });
                return Err(e);
            }
        }
    }
}

/// Checks an input gradient's shape and casts it to the input's dtype.
fn conform(op: &'static str, shape: &[usize], dtype: crate::DType, g: Tensor) -> Result<Tensor> {
    // A gradient never carries a graph (a user's backward may return a tensor with one).
    let g = match g.is_requires_grad() {
        true => g.detach(),
        false => g,
    };
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

/// Nodes reachable from `root` through nodes with ids of at least `inside`, each after every
/// node that feeds it a gradient.
fn topo_order(root: Arc<Node>, inside: u64) -> Vec<Arc<Node>> {
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
            if c.id >= inside && !seen.contains(&c.id) {
                stack.push((c, false));
            }
        }
    }
    post.reverse();
    post
}
