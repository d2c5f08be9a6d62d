//! Ops defined by the user with their own backward (PyTorch's `torch.autograd.Function`).

use crate::{no_grad, Error, Result, Tensor};

/// Runs a differentiable op whose backward you write: `forward` gets the inputs (detached:
/// nothing it does is recorded) and returns the output with whatever its backward needs
/// (PyTorch's `ctx.save_for_backward`); `backward` gets the output's gradient and that state,
/// and returns one gradient per input (`None` for an input that needs none). The engine
/// checks each gradient's shape and dtype against its input, and sums gradients that meet.
///
/// Without grad mode, or when no input requires grad, only `forward` runs; an integer output
/// gets no graph. As PyTorch checks what `save_for_backward` kept, backward checks the
/// inputs: one written in place after the forward makes it an error (the state may hold it,
/// and a gradient from the new values would be wrong). The gradients `backward` returns are
/// detached.
///
/// ```
/// use mantissa::autograd::custom_op;
/// use mantissa::{Device, Tensor};
/// // y = x^3 with a hand-written gradient 3 x^2.
/// let x = Tensor::from_vec(vec![1.0f32, 2.0], &[2], Device::Cpu)?.requires_grad(true)?;
/// let y = custom_op(
///     "cube",
///     &[&x],
///     |xs| Ok((xs[0].pow(3.0)?, xs[0].clone())),
///     |g, x| Ok(vec![Some(g.mul(&x.sqr()?.mul(3.0)?)?)]),
/// )?;
/// y.sum_all()?.backward()?;
/// assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![3.0, 12.0]);
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn custom_op<S: Send + Sync + 'static>(
    name: &'static str,
    inputs: &[&Tensor],
    forward: impl FnOnce(&[Tensor]) -> Result<(Tensor, S)>,
    backward: impl Fn(&Tensor, &S) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
) -> Result<Tensor> {
    let _prof = crate::profiler::op(name);
    let detached: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
    let (out, state) = no_grad(|| forward(&detached))?;
    // The output as a tensor of its own, so the node attaches to it alone.
    let out = out.detach();
    if !out.dtype().is_float() {
        return Ok(out);
    }
    let n = inputs.len();
    Ok(out.attach_saving(name, inputs, inputs, move |g, _| {
        let grads = backward(g, &state)?;
        if grads.len() != n {
            return Err(Error::Autograd(format!(
                "the backward of `{name}` returned {} gradients for {n} inputs",
                grads.len()
            )));
        }
        Ok(grads)
    }))
}
