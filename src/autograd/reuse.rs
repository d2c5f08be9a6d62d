//! A tensor an op's backward reads and may then overwrite with its result, instead of
//! allocating one of the same size: the cross-entropy over a language model's vocabulary
//! writes the logits' gradient over the logits (`[tokens, vocabulary]`, the largest tensor of
//! a GPT step), as llm.c's fused classifier does. That is safe only when nothing else can
//! see the tensor any more: no handle to it or to a view of its storage outside the
//! backward's closure, and a graph that is not kept for another backward
//! (`backward_retain_graph`), which would read it again.

use crate::{Error, Result, Tensor};
use std::cell::Cell;

thread_local! {
    /// Whether the backward running on this thread keeps its graph.
    static RETAINED: Cell<bool> = const { Cell::new(false) };
}

/// Marks, for the backward closure `f` run on this thread, whether its graph is kept.
pub(crate) fn running<R>(retain: bool, f: impl FnOnce() -> R) -> R {
    let before = RETAINED.with(|r| r.replace(retain));
    let out = f();
    RETAINED.with(|r| r.set(before));
    out
}

/// A tensor saved by an op for its backward that the backward may overwrite (see the
/// module's notes). Unlike the tensors an op saves through `attach_saving`, the node keeps no
/// handle of its own to it, so that the closure holding this one can be the only holder.
pub(crate) struct Reusable {
    t: Tensor,
    version: u64,
    op: &'static str,
}

impl Reusable {
    /// Saves `t` (detached) for the backward of `op`.
    pub(crate) fn new(op: &'static str, t: &Tensor) -> Reusable {
        Reusable {
            t: t.detach(),
            version: t.version(),
            op,
        }
    }

    /// The saved tensor, or the error backward gives when it was written in place since it
    /// was saved (the check `attach_saving` makes for the tensors it saves).
    pub(crate) fn get(&self) -> Result<&Tensor> {
        let now = self.t.version();
        if now != self.version {
            return Err(Error::Autograd(format!(
                "the input of `{}` (shape {:?}, {:?}), which its backward reads, was modified \
                 in place after the forward (version {}, now {now}), so the gradient would \
                 be wrong; write into a clone instead, or make the change after backward()",
                self.op,
                self.t.shape(),
                self.t.dtype(),
                self.version
            )));
        }
        Ok(&self.t)
    }

    /// Whether the backward may write over the saved tensor: this closure holds the only
    /// handle to its storage, the tensor fills that storage in row-major order, and the
    /// running backward does not keep the graph.
    pub(crate) fn writable(&self) -> bool {
        !RETAINED.with(Cell::get)
            && self.t.is_sole_owner()
            && self.t.is_contiguous()
            && self.t.layout().offset() == 0
            && self.t.storage().len() == self.t.numel()
    }
}
