//! Gradients already summed for a node's inputs, offered to the node's backward while it runs.
//!
//! When an input feeds several ops (a residual block's input: the main branch and the
//! shortcut), its gradient is the sum of their contributions. The engine adds each new
//! contribution to the sum so far; a backward that can add its contribution in the same pass
//! that computes it (cuDNN's backward-data convolution with `beta = 1`) takes the sum so far
//! with [`take`] and returns its input's gradient with the sum included, saving the separate
//! add's read of two tensors and write of one.
//!
//! The engine offers an input's sum only where the input appears once among the node's
//! inputs. A backward that takes one must return that input's gradient (the sum included);
//! one that takes none changes nothing.

use crate::Tensor;
use std::cell::RefCell;

thread_local! {
    /// One frame per running backward (a checkpoint's backward runs a nested engine).
    static FRAMES: RefCell<Vec<Vec<Option<Tensor>>>> = const { RefCell::new(Vec::new()) };
}

/// Pops the frame it pushed, also when the backward panics.
struct Frame;

impl Drop for Frame {
    fn drop(&mut self) {
        FRAMES.with(|f| f.borrow_mut().pop());
    }
}

/// Runs `f` (a node's backward) with `pending` (the sum so far per input, `None` where none
/// is offered) offered to it; returns `f`'s result and what it did not take.
pub(super) fn offer<R>(
    pending: Vec<Option<Tensor>>,
    f: impl FnOnce() -> R,
) -> (R, Vec<Option<Tensor>>) {
    FRAMES.with(|fr| fr.borrow_mut().push(pending));
    let frame = Frame;
    let r = f();
    let left = FRAMES.with(|fr| fr.borrow_mut().last_mut().map(std::mem::take));
    drop(frame);
    (r, left.unwrap_or_default())
}

/// The gradient summed so far for input `i` of the running backward, taken (the engine will
/// not add it again) when there is one and `ok` accepts it. The caller must then return
/// input `i`'s gradient with it included.
pub(crate) fn take(i: usize, ok: impl FnOnce(&Tensor) -> bool) -> Option<Tensor> {
    FRAMES.with(|fr| {
        let mut fr = fr.borrow_mut();
        let slot = fr.last_mut()?.get_mut(i)?;
        match slot {
            Some(t) if ok(t) => slot.take(),
            _ => None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::take;
    use crate::{no_grad, Device, Result, Tensor};

    /// `x -> a = 2x`, read by a probe op (made first, so its backward runs last) and by
    /// `b = 3a`; the probe's forward is `5a`, its backward `probe(g)` builds `a`'s gradient.
    /// Returns x's gradient.
    fn run(
        inputs: usize,
        probe: impl Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
    ) -> Vec<f32> {
        let x = Tensor::from_vec(vec![1.0f32, -2.0, 0.5], &[3], Device::Cpu)
            .unwrap()
            .requires_grad(true)
            .unwrap();
        let a = x.mul(2.0).unwrap();
        let ins = vec![&a; inputs];
        let c = no_grad(|| a.mul(5.0))
            .unwrap()
            .attach("probe", &ins, move |g, _| probe(g));
        let b = a.mul(3.0).unwrap();
        b.add(&c).unwrap().sum_all().unwrap().backward().unwrap();
        x.grad().unwrap().to_vec::<f32>().unwrap()
    }

    #[test]
    fn a_backward_that_takes_the_sum_returns_it_included() {
        let got = run(1, |g| {
            let prev = take(0, |_| true).expect("b's gradient is waiting");
            assert_eq!(prev.to_vec::<f32>()?, vec![3.0; 3]);
            // Taken once: the engine will not add it again.
            assert!(take(0, |_| true).is_none());
            Ok(vec![Some(prev.add(&g.mul(5.0)?)?)])
        });
        assert_eq!(got, vec![16.0; 3]);
    }

    #[test]
    fn a_sum_not_taken_is_added_by_the_engine() {
        let got = run(1, |g| {
            assert!(take(0, |_| false).is_none(), "refused by the predicate");
            Ok(vec![Some(g.mul(5.0)?)])
        });
        assert_eq!(got, vec![16.0; 3]);
        // No gradient from the probe: the waiting sum stays.
        let got = run(1, |_| Ok(vec![None]));
        assert_eq!(got, vec![6.0; 3]);
        // Out of range of the inputs.
        let got = run(1, |g| {
            assert!(take(1, |_| true).is_none());
            Ok(vec![Some(g.mul(5.0)?)])
        });
        assert_eq!(got, vec![16.0; 3]);
    }

    #[test]
    fn an_input_read_twice_by_one_op_is_not_offered() {
        let got = run(2, |g| {
            assert!(take(0, |_| true).is_none() && take(1, |_| true).is_none());
            Ok(vec![Some(g.mul(5.0)?), Some(g.mul(5.0)?)])
        });
        assert_eq!(got, vec![26.0; 3]);
    }

    #[test]
    fn nothing_is_offered_outside_a_backward() {
        assert!(take(0, |_| true).is_none());
    }
}
