//! The recorded graph's node, which a tensor made by an op holds: the op's inputs as edges and
//! its backward closure (run once, or again with `retain_graph`). `crate::autograd` records
//! nodes and runs them.

use crate::sync::lock;
use crate::{Error, Result, Tensor};
use std::sync::{Arc, Mutex};

/// Computes the inputs' gradients from the output's gradient. `needs[i]` tells whether input
/// `i` wants one; entries for the others may be `None`.
pub(crate) type BackwardFn =
    Arc<dyn Fn(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static>;

/// Where the gradient of one op input goes. An edge holds the input's producing node or its
/// gradient slot, never the input's data: a graph keeps alive only what the backward
/// closures saved.
#[derive(Clone)]
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
    pub(crate) fn of(t: &Tensor) -> Edge {
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

/// Makes an op's output again, bit for bit, from what the op's own backward keeps: see
/// [`crate::autograd::saved`]. The output is the tensor with id `of`.
#[derive(Clone)]
pub(crate) struct Recipe {
    pub(crate) of: u64,
    pub(crate) make: Arc<dyn Fn() -> Result<Tensor> + Send + Sync>,
    /// Where the output is a per-channel affine map of one tensor: its parts, so that the op
    /// that reads the output can apply the map itself (a convolution's prologue) instead of
    /// having the output made.
    pub(crate) affine: Option<AffineParts>,
}

static NEXT_NODE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// The id the next node recorded will have: every node recorded before has a lower one.
pub(crate) fn next_node_id() -> u64 {
    NEXT_NODE.load(std::sync::atomic::Ordering::Relaxed)
}

/// One recorded op.
pub(crate) struct Node {
    pub(crate) id: u64,
    pub(crate) name: &'static str,
    state: Mutex<Option<(Vec<Edge>, BackwardFn)>>,
    /// The tensors the backward reads (inputs or outputs), with their storage versions when
    /// they were saved: an in-place write since then would make the gradient wrong, so
    /// backward refuses it (PyTorch's saved-tensor version check).
    saved: Vec<(Tensor, u64)>,
    /// How to make the output again, where the op offers it (until the node has run).
    recipe: Mutex<Option<Recipe>>,
    /// The output's gradient slot, where its gradient taps are found
    /// (`crate::autograd::taps`); weak, so the graph does not keep the output alive.
    pub(crate) out: std::sync::Weak<Mutex<Option<Tensor>>>,
}

impl Node {
    pub(crate) fn new(
        name: &'static str,
        edges: Vec<Edge>,
        f: BackwardFn,
        saved: &[&Tensor],
        out: std::sync::Weak<Mutex<Option<Tensor>>>,
    ) -> Node {
        Node {
            id: NEXT_NODE.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            name,
            state: Mutex::new(Some((edges, f))),
            // Detached: a saved output must not hold its own node (a reference cycle).
            saved: saved.iter().map(|t| (t.detach(), t.version())).collect(),
            recipe: Mutex::new(None),
            out,
        }
    }

    /// Offers `r` to the ops that save this node's output for their backward.
    pub(crate) fn set_recipe(&self, r: Recipe) {
        *lock(&self.recipe) = Some(r);
    }

    /// The recipe of the output with id `of`, while the node has not run.
    pub(crate) fn recipe_of(&self, of: u64) -> Option<Recipe> {
        lock(&self.recipe).clone().filter(|r| r.of == of)
    }

    /// `Err` when a saved tensor was written in place after it was saved.
    pub(crate) fn check_saved(&self) -> Result<()> {
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

    /// `f` of each edge that gives `Some`, while the node has not run (then nothing).
    fn edges_where<T>(&self, f: impl Fn(&Edge) -> Option<T>) -> Vec<T> {
        lock(&self.state)
            .as_ref()
            .map(|(edges, _)| edges.iter().filter_map(&f).collect())
            .unwrap_or_default()
    }

    /// Keys of the leaves this node's backward may send gradients to (see
    /// `autograd::hooks`): the gradient slots of its leaf edges, and the storages of what it
    /// saved (a checkpoint saves the parameters its recomputation reads).
    pub(crate) fn leaf_keys(&self) -> Vec<usize> {
        let mut keys: Vec<usize> = self
            .leaf_slots()
            .iter()
            .map(|g| Arc::as_ptr(g) as usize)
            .collect();
        keys.extend(self.saved.iter().map(|(t, _)| t.storage_addr()));
        keys
    }

    /// The gradient slots of the leaves this node sends gradients to.
    pub(crate) fn leaf_slots(&self) -> Vec<Arc<Mutex<Option<Tensor>>>> {
        self.edges_where(|e| match e {
            Edge::Leaf { grad, .. } => Some(grad.clone()),
            _ => None,
        })
    }

    /// The nodes this one sends gradients to.
    pub(crate) fn children(&self) -> Vec<Arc<Node>> {
        self.edges_where(|e| match e {
            Edge::Node { node, .. } => Some(node.clone()),
            _ => None,
        })
    }

    /// The edges and the backward closure, once; the recipe goes with them (what it holds
    /// is freed with the rest of the node's state).
    pub(crate) fn take(&self) -> Option<(Vec<Edge>, BackwardFn)> {
        lock(&self.recipe).take();
        lock(&self.state).take()
    }

    /// The edges and the backward closure, left in place for another backward (PyTorch's
    /// `retain_graph=True`).
    pub(crate) fn get(&self) -> Option<(Vec<Edge>, BackwardFn)> {
        lock(&self.state).clone()
    }
}

/// An output `alpha[c] (x - center[c]) + gamma[c]`, clamped below at 0 with `relu`:
/// batch norm's, as its [`Recipe`] offers it.
#[derive(Clone)]
pub(crate) struct AffineParts {
    /// The input, as the forward read it (`unchanged` checks that it still is).
    pub(crate) x: Tensor,
    /// `[alpha | center | gamma | beta]`, `[4, c]` in f32 (beta is not part of the map).
    pub(crate) coef: Tensor,
    pub(crate) relu: bool,
    /// `Err` where `x` was written in place since the forward (the recipe's own check).
    pub(crate) unchanged: Arc<dyn Fn() -> Result<()> + Send + Sync>,
}
