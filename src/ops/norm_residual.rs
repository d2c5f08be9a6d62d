//! A pre-LayerNorm transformer's residual step, `s = x + branch` and `layer_norm(s)`, with
//! both computed by one kernel on CUDA (llm.c's fused residual forward): the branch is read
//! once, the sum written once and normalised while its rows are in cache, and a half branch
//! added to an f32 residual stream (autocast's usual case) is read as it is, without the cast
//! the composed add makes first. The graph is the composed ops' (an add, then a layer norm),
//! so the gradients are theirs.

use super::norm_layer::layer_norm_node;
use crate::{DType, Device, Result, Tensor};

impl Tensor {
    /// `(s, s.layer_norm(normalized_shape, weight, bias, eps))` with `s = self + branch`
    /// (PyTorch: `x = x + branch; y = F.layer_norm(x, ...)`). `branch` has `self`'s shape; the
    /// sum has `self`'s dtype when `branch` promotes into it (a bf16 branch into an f32
    /// residual stream). On CUDA one kernel computes both; elsewhere, or for operands it does
    /// not take (broadcasting, another promotion, a half sum under autocast, whose layer norm
    /// runs in f32), the two ops, with their results and errors.
    ///
    /// ```
    /// use mantissa::{Device, Tensor};
    /// let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2], Device::Cpu)?;
    /// let r = Tensor::from_vec(vec![1.0f32, 0.0, 0.0, 2.0], &[2, 2], Device::Cpu)?;
    /// let (s, y) = x.add_layer_norm(&r, &[2], None, None, 1e-5)?;
    /// assert_eq!(s.to_vec::<f32>()?, vec![2.0, 2.0, 3.0, 6.0]);
    /// let want = x.add(&r)?.layer_norm(&[2], None, None, 1e-5)?;
    /// assert_eq!(y.to_vec::<f32>()?, want.to_vec::<f32>()?);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn add_layer_norm(
        &self,
        branch: &Tensor,
        normalized_shape: &[usize],
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<(Tensor, Tensor)> {
        let composed = || {
            let s = self.add(branch)?;
            let y = s.layer_norm(normalized_shape, weight, bias, eps)?;
            Ok((s, y))
        };
        let dt = self.dtype();
        let k = normalized_shape.len();
        let params = [weight, bias].into_iter().flatten();
        let fits = self.device() != Device::Cpu
            && branch.device() == self.device()
            && branch.shape() == self.shape()
            && dt.is_float()
            && dt != DType::F64
            && dt.promote(branch.dtype()) == dt
            && (dt == DType::F32 || crate::amp::active_dtype().is_none())
            && k > 0
            && k <= self.rank()
            && self.shape()[self.rank() - k..] == *normalized_shape
            && !normalized_shape.contains(&0)
            && params.clone().all(|v| {
                v.shape() == normalized_shape && v.dtype() == dt && v.device() == self.device()
            });
        if !fits {
            return composed();
        }
        let _prof = crate::profiler::op("add_layer_norm");
        let cols: usize = normalized_shape.iter().product();
        let whole = |v: Option<&Tensor>| v.map(|v| v.contiguous()).transpose();
        let (w, b) = (whole(weight)?, whole(bias)?);
        let out = {
            let (xs, rs) = (self.storage(), branch.storage());
            let (ws, bs) = (
                w.as_ref().map(|w| w.storage()),
                b.as_ref().map(|b| b.storage()),
            );
            let wp = ws.as_deref().zip(w.as_ref().map(|t| t.layout()));
            let bp = bs.as_deref().zip(b.as_ref().map(|t| t.layout()));
            let r = (&*rs, branch.layout());
            xs.add_layer_norm(self.layout(), r, cols, wp, bp, eps)?
        };
        let Some((sum, y, stats)) = out else {
            return composed();
        };
        // The add's node: the sum's gradient to each input, in its dtype (the composed add's
        // promotion cast and its backward).
        let bdt = branch.dtype();
        let s = Tensor::from_storage(sum, self.shape()).attach(
            "add",
            &[self, branch],
            move |g, needs| {
                Ok(vec![
                    needs[0].then(|| g.clone()),
                    needs[1].then(|| g.to_dtype(bdt)).transpose()?,
                ])
            },
        );
        let y = layer_norm_node(&s, (w, b), (y, stats), normalized_shape, dt);
        Ok((s, y))
    }
}
