//! Gradient checkpointing (PyTorch's `torch.utils.checkpoint`): a function's activations are
//! not kept for backward; backward runs the function again, recording this time, and
//! backpropagates through the recomputation.

use crate::grad_mode::EnableGradGuard;
use crate::random::Generator;
use crate::{is_grad_enabled, no_grad, Result, Tensor};
use std::cell::RefCell;
use std::collections::VecDeque;

/// The dropout streams `(seed, first block)` a checkpointed function drew, in order:
/// recorded while its forward runs, replayed while backward recomputes it, so each dropout
/// mask comes out the same both times whatever generator it draws from.
enum Frame {
    Record(Vec<(u64, u64)>),
    Replay(VecDeque<(u64, u64)>),
}

thread_local! {
    static FRAMES: RefCell<Vec<Frame>> = const { RefCell::new(Vec::new()) };
}

/// The stream for a dropout mask of `blocks` Philox blocks: replayed inside a checkpoint's
/// recomputation, else drawn from `gen` (and recorded for every checkpoint in forward).
pub(crate) fn dropout_stream(gen: &mut Generator, blocks: u64) -> (u64, u64) {
    FRAMES.with(|f| {
        let mut frames = f.borrow_mut();
        let replayed = frames.iter_mut().rev().find_map(|fr| match fr {
            Frame::Replay(q) => Some(q.pop_front()),
            Frame::Record(_) => None,
        });
        let stream = match replayed.flatten() {
            Some(s) => s,
            None => (gen.seed(), gen.reserve(blocks)),
        };
        for fr in frames.iter_mut() {
            if let Frame::Record(v) = fr {
                v.push(stream);
            }
        }
        stream
    })
}

/// Whether this thread is recomputing a checkpointed function for backward (a batch norm
/// then leaves its running statistics alone: the forward already counted this batch).
pub(crate) fn recomputing() -> bool {
    FRAMES.with(|f| f.borrow().iter().any(|fr| matches!(fr, Frame::Replay(_))))
}

/// Runs `f` with `frame` on top of this thread's checkpoint frames; returns `f`'s result and
/// the frame as `f` left it (the frame is popped even when `f` panics).
fn with_frame<R>(frame: Frame, f: impl FnOnce() -> R) -> (R, Frame) {
    struct PopOnUnwind(bool);
    impl Drop for PopOnUnwind {
        fn drop(&mut self) {
            if !self.0 {
                FRAMES.with(|fr| fr.borrow_mut().pop());
            }
        }
    }
    FRAMES.with(|fr| fr.borrow_mut().push(frame));
    let mut guard = PopOnUnwind(false);
    let r = f();
    guard.0 = true;
    let frame = FRAMES.with(|fr| fr.borrow_mut().pop());
    (r, frame.expect("the frame pushed above"))
}

/// `f(inputs)` without keeping its activations for backward: the forward runs without
/// recording a graph, and backward runs `f` again on the same inputs, recording, then
/// backpropagates through it. Memory for `f`'s intermediate tensors is traded for a second
/// forward, as `torch.utils.checkpoint` does.
///
/// Gradients reach the inputs and every tensor `f` uses that requires grad (a module's
/// parameters). The recomputation runs under the autocast state of the forward, and each
/// dropout inside `f` draws the same mask both times; a batch norm in training mode updates
/// its running statistics once, in the forward. `f` must compute the same function both
/// times (no other state it reads may change in between). [`crate::nn::Checkpointed`] wraps
/// a module this way.
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
    f: impl Fn(&[Tensor]) -> Result<Tensor> + Send + 'static,
) -> Result<Tensor> {
    if !is_grad_enabled() {
        let xs: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
        return f(&xs);
    }
    let _prof = crate::profiler::op("checkpoint");
    let autocast = crate::amp::active_dtype();
    let detached: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
    let (out, frame) = with_frame(Frame::Record(Vec::new()), || no_grad(|| f(&detached)));
    let Frame::Record(streams) = frame else {
        unreachable!("a record frame stays one")
    };
    let out = out?.detach();
    // The node records every input; a parameter `f` uses gets its gradient from the nested
    // backward below, so an output of parameters alone still needs a node: recording is on.
    let recorded: Vec<&Tensor> = inputs.to_vec();
    Ok(out.attach_always("checkpoint", &recorded, move |g, needs| {
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
        let (y, _) = with_frame(Frame::Replay(streams.into()), || f(&xs));
        let y = y?;
        if y.is_requires_grad() {
            y.backward_with(g)?;
        }
        Ok(xs.iter().map(|x| x.grad()).collect())
    }))
}
