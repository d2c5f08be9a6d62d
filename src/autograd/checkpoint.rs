//! Gradient checkpointing (PyTorch's `torch.utils.checkpoint`): a function's activations are
//! not kept for backward; backward runs the function again, recording this time, and
//! backpropagates through the recomputation.

use crate::frames::{with_frame, Frame, Recording, Replaying};
use crate::grad_mode::EnableGradGuard;
use crate::{is_grad_enabled, no_grad, Error, Result, Tensor};

/// `f(inputs)` without keeping its activations for backward: the forward runs without
/// recording a graph, and backward runs `f` again on the same inputs, recording, then
/// backpropagates through it. Memory for `f`'s intermediate tensors is traded for a second
/// forward, as `torch.utils.checkpoint` does.
///
/// Gradients reach the inputs and every tensor `f` uses that requires grad: a module's
/// parameters, and tensors made by recorded ops outside `f` (a weight computed from a
/// parameter), whose gradients go on through the outer graph once. The recomputation runs
/// under the autocast state of the forward, and every random draw inside `f` (dropout,
/// [`Tensor::randn`], [`Tensor::rand`], any [`crate::Generator`]'s) gets the same numbers
/// both times, the recomputation leaving the generators where they stand (PyTorch's
/// `preserve_rng_state`); a recomputation that draws differently is an error. A batch norm
/// in training mode updates its running statistics once, in the forward.
///
/// Backward refuses to run when a tensor `f` read from outside (an input, a parameter, any
/// captured tensor) was written in place after the forward: the recomputation would read the
/// new values, and the gradient would be wrong without a word. `f` must compute the same
/// function both times. An integer output gets no graph. [`crate::nn::Checkpointed`] wraps a
/// module this way.
///
/// ```
/// use mantissa::autograd::checkpoint;
/// use mantissa::{Device, Tensor};
/// let w = Tensor::from_vec(vec![0.5f32, -1.0], &[2], Device::Cpu)?.requires_grad(true)?;
/// let x = Tensor::from_vec(vec![1.0f32, 2.0], &[2], Device::Cpu)?.requires_grad(true)?;
/// let wc = w.clone();
/// let y = checkpoint(&[&x], move |xs| xs[0].mul(&wc)?.tanh())?;
/// y.sum_all()?.backward()?;
/// assert!(x.grad().is_some() && w.grad().is_some());
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn checkpoint(
    inputs: &[&Tensor],
    f: impl Fn(&[Tensor]) -> Result<Tensor> + Send + Sync + 'static,
) -> Result<Tensor> {
    if !is_grad_enabled() {
        let xs: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
        return f(&xs);
    }
    let _prof = crate::profiler::op("checkpoint");
    let autocast = crate::amp::active_dtype();
    let detached: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
    let boundary = crate::tensor::next_tensor_id();
    let (out, frame) = with_frame(Frame::record(boundary), || {
        let out = no_grad(|| f(&detached))?;
        // An output from outside returned as it is counts as read.
        super::note_reads([&out]);
        Ok(out)
    });
    let Frame::Record(Recording { draws, reads, .. }) = frame else {
        unreachable!("a record frame stays one")
    };
    let out = out?.detach();
    // What `f` wrote itself while it ran (a batch norm's running statistics, in training
    // mode) is state it updates, not an input of the recomputation: only what it read
    // unchanged is checked.
    let reads: Vec<Tensor> = reads
        .into_iter()
        .filter_map(|r| r.downcast::<(Tensor, u64)>().ok())
        .filter(|r| r.0.version() == r.1)
        .map(|r| r.0)
        .collect();
    if !out.dtype().is_float() {
        // No gradient flows through an integer output (PyTorch's non-differentiable output).
        return Ok(out);
    }
    // The tensors from outside that `f` read: the node saves their versions as of now (an
    // in-place write before backward would change what the recomputation reads, so backward
    // refuses it), and those made by recorded ops (a weight computed from a parameter) are
    // edges of the node, so the outer backward sends their gradients on once this node has
    // run, and only then. Parameters (leaves) get theirs from the recomputation's backward.
    let captured: Vec<Tensor> = reads
        .iter()
        .filter(|t| t.0.node.is_some())
        .cloned()
        .collect();
    let captured_nodes: Vec<u64> = captured
        .iter()
        .filter_map(|t| t.0.node.as_ref().map(|n| n.id))
        .collect();
    let mut edges: Vec<&Tensor> = inputs.to_vec();
    edges.extend(captured.iter());
    let saved: Vec<&Tensor> = inputs.iter().copied().chain(reads.iter()).collect();
    // An output of parameters alone still needs a node (recording is on): they get their
    // gradients from the nested backward below.
    Ok(
        out.attach_always("checkpoint", &edges, &saved, move |g, needs| {
            let _grad = EnableGradGuard::new();
            let _ac = match autocast {
                Some(dt) => crate::amp::autocast(dt)?,
                None => crate::amp::autocast_disabled(),
            };
            let xs: Vec<Tensor> = detached
                .iter()
                .zip(needs)
                .map(|(x, &need)| x.detach().requires_grad(need && x.dtype().is_float()))
                .collect::<Result<_>>()?;
            // Nodes the recomputation records have ids from here on; the ones below are the
            // outer graph's, where its backward stops.
            let inside = crate::tensor::node::next_node_id();
            let replay = Replaying {
                draws: draws.clone().into(),
                diverged: None,
            };
            let (y, frame) = with_frame(Frame::Replay(replay), || f(&xs));
            if let Frame::Replay(Replaying {
                diverged: Some(how),
                ..
            }) = frame
            {
                return Err(Error::Autograd(format!(
                    "checkpoint: recomputing the function for backward, {how}; a checkpointed \
                 function must draw the same random numbers both times"
                )));
            }
            let y = y?;
            let mut reached = match y.is_requires_grad() {
                true => y.backward_until(g, inside)?,
                false => Default::default(),
            };
            let mut grads: Vec<Option<Tensor>> = xs.iter().map(|x| x.grad()).collect();
            grads.extend(captured_nodes.iter().map(|id| reached.remove(id)));
            if !reached.is_empty() {
                return Err(Error::Autograd(
                    "checkpoint: recomputing the function for backward, it read a tensor made \
                 by a recorded op that its forward did not read; a checkpointed function \
                 must compute the same thing both times"
                        .into(),
                ));
            }
            Ok(grads)
        }),
    )
}
