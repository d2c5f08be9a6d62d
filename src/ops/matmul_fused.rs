//! Products with their elementwise neighbours done in the GEMM's epilogue (cuBLASLt on CUDA),
//! behind one switch, [`set_gemm_epilogues`]: a transformer MLP ([`Tensor::mlp_gelu_tanh`])
//! in two products forward and four backward, and a Linear's bias gradient summed by its
//! weight gradient's product. Off by default: whether an epilogue beats a separate kernel
//! depends on the GPU and the shape (llm.c keeps its GELU epilogue off by default), so it is
//! turned on where a measurement shows it pays. Where the switch is off, the device is the
//! CPU or cuBLASLt declines a shape, the same ops run composed, with the same results up to
//! rounding and the same errors.

use super::{dispatch, dispatch_opt, Op};
use crate::autograd::saved::{held, kept, kept_for};
use crate::backend::ops::UnaryOp;
use crate::backend::Fused;
use crate::{Device, Result, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};

static GEMM_EPILOGUES: AtomicBool = AtomicBool::new(false);

/// Lets products on CUDA do their neighbouring elementwise work in cuBLASLt's epilogue:
/// [`Tensor::mlp_gelu_tanh`]'s bias + GELU forward (keeping the pre-activation), GELU's
/// derivative and the bias gradient in its backward, and every [`Tensor::linear`]'s bias
/// gradient in its weight gradient's product. Off by default (see the module's doc); a
/// Linear's forward bias is in the epilogue either way.
///
/// ```
/// mantissa::set_gemm_epilogues(true);
/// assert!(mantissa::gemm_epilogues());
/// mantissa::set_gemm_epilogues(false);
/// ```
pub fn set_gemm_epilogues(on: bool) {
    GEMM_EPILOGUES.store(on, Ordering::Relaxed);
}

/// Whether [`set_gemm_epilogues`] turned the epilogues on.
pub fn gemm_epilogues() -> bool {
    GEMM_EPILOGUES.load(Ordering::Relaxed)
}

/// The weight's and the bias's gradients of a Linear from the output's `g [rows, out]` and
/// the input `x [rows, in]` in one product (`g^T x` with the bias gradient, `g`'s sums over
/// the rows, in its epilogue) where [`gemm_epilogues`] is on and the device does it; `None`
/// otherwise, and the caller computes them apart.
pub(crate) fn weight_and_bias_grads(g: &Tensor, x: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
    if !gemm_epilogues() || g.device() == Device::Cpu || g.rank() != 2 || x.rank() != 2 {
        return Ok(None);
    }
    if g.dtype() != x.dtype() {
        return Ok(None);
    }
    // cuBLASLt sums the bias gradient only from a transposed operand (BGRADB with
    // TRANSB = T): `g`'s rows laid out as they are, which a broadcast gradient is not.
    let gt = g.contiguous()?.t()?;
    let fused = gt
        .storage()
        .matmul_fused(gt.layout(), &x.storage(), x.layout(), Fused::SumLhs)?;
    Ok(fused.map(|(gw, gb)| {
        let (o, i) = (g.shape()[1], x.shape()[1]);
        (
            Tensor::from_storage(gw, &[o, i]),
            Tensor::from_storage(gb, &[o]),
        )
    }))
}

impl Tensor {
    /// A transformer's MLP, `gelu_tanh(x fc_w^T + fc_b) proj_w^T + proj_b` (nanoGPT's `MLP`
    /// without dropout): [`Tensor::linear`], [`Tensor::gelu_tanh`] and [`Tensor::linear`]
    /// again. With [`set_gemm_epilogues`] on CUDA, two cuBLASLt products forward (the bias and
    /// GELU in the first's epilogue, which keeps the pre-activation) and four backward
    /// (GELU's derivative and the first bias's gradient in the epilogue of the hidden
    /// layer's gradient, the second bias's gradient in its weight gradient's product);
    /// otherwise the three ops.
    ///
    /// ```
    /// use mantissa::{Device, Tensor};
    /// let x = Tensor::from_vec(vec![1.0f32, -2.0], &[1, 2], Device::Cpu)?;
    /// let fc_w = Tensor::from_vec(vec![1.0f32, 0.0, 0.0, 1.0, 1.0, 1.0], &[3, 2], Device::Cpu)?;
    /// let fc_b = Tensor::zeros(&[3], mantissa::DType::F32, Device::Cpu)?;
    /// let proj_w = Tensor::ones(&[2, 3], mantissa::DType::F32, Device::Cpu)?;
    /// let proj_b = Tensor::zeros(&[2], mantissa::DType::F32, Device::Cpu)?;
    /// let y = x.mlp_gelu_tanh((&fc_w, &fc_b), (&proj_w, &proj_b))?;
    /// let h = x.linear(&fc_w, Some(&fc_b))?.gelu_tanh()?;
    /// assert_eq!(y.to_vec::<f32>()?, h.linear(&proj_w, Some(&proj_b))?.to_vec::<f32>()?);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn mlp_gelu_tanh(
        &self,
        (fc_w, fc_b): (&Tensor, &Tensor),
        (proj_w, proj_b): (&Tensor, &Tensor),
    ) -> Result<Tensor> {
        let composed = || {
            self.linear(fc_w, Some(fc_b))?
                .gelu_tanh()?
                .linear(proj_w, Some(proj_b))
        };
        if !gemm_epilogues() || self.device() == Device::Cpu {
            return composed();
        }
        let _prof = crate::profiler::op("mlp_gelu_tanh");
        let [x, w1, w2] = dispatch(Op::Linear, [self, fc_w, proj_w])?;
        let b1 = dispatch_opt(Op::Linear, Some(fc_b))?.expect("a bias was given");
        let b2 = dispatch_opt(Op::Linear, Some(proj_b))?.expect("a bias was given");
        let dt = x.dtype();
        let c = x.shape().last().copied().unwrap_or(0);
        let hidden = w1.shape().first().copied().unwrap_or(0);
        let fits = x.rank() >= 2
            && dt.is_float()
            && [&w1, &b1, &w2, &b2].iter().all(|t| t.dtype() == dt)
            && w1.shape() == [hidden, c]
            && b1.shape() == [hidden]
            && w2.rank() == 2
            && w2.shape()[1] == hidden
            && b2.shape() == [w2.shape()[0]];
        if !fits {
            // The composed ops, with their errors for what does not fit.
            return composed();
        }
        let out_c = w2.shape()[0];
        let rows = x.numel() / c.max(1);
        let x2 = x.reshape(&[rows, c])?;
        let w1t = w1.layout().permute("mlp_gelu_tanh", &[1, 0])?;
        let first = {
            let (b1s, w1s) = (b1.storage(), w1.storage());
            let f = Fused::GeluAuxBias((&*b1s, b1.layout()));
            x2.storage().matmul_fused(x2.layout(), &w1s, &w1t, f)?
        };
        let Some((h, pre)) = first else {
            return composed();
        };
        let h = Tensor::from_storage(h, &[rows, hidden]);
        let pre = Tensor::from_storage(pre, &[rows, hidden]);
        // The second product as a Linear (the bias in its epilogue), without a node of its
        // own: this op's node takes every gradient.
        let y = crate::grad_mode::no_grad(|| h.linear(&w2, Some(&b2)))?;
        let xs = kept_for(w1.is_requires_grad(), &x2);
        let w1s = kept_for(x2.is_requires_grad(), &w1);
        let mut reads = held(&[&xs, &w1s]);
        reads.push(w2.clone());
        let w2k = w2.clone();
        let backward = move |g: &Tensor, needs: &[bool]| {
            let w2 = &w2k;
            let g = g.contiguous()?;
            // The second layer's weight and bias gradients from one product where it can.
            let (gw2, gb2) = match (needs[3] || needs[4])
                .then(|| weight_and_bias_grads(&g, &h))
                .transpose()?
                .flatten()
            {
                Some((gw, gb)) => (Some(gw), Some(gb)),
                None => (
                    needs[3].then(|| g.t()?.matmul(&h)).transpose()?,
                    needs[4].then(|| g.sum(&[0], false)).transpose()?,
                ),
            };
            let (mut gx, mut gw1, mut gb1) = (None, None, None);
            if needs[0] || needs[1] || needs[2] {
                // The pre-activation's gradient and the first bias's in one product.
                let f = {
                    let ps = pre.storage();
                    let f = Fused::DGeluBGrad((&*ps, pre.layout()));
                    g.storage()
                        .matmul_fused(g.layout(), &w2.storage(), w2.layout(), f)?
                };
                let (gpre, gb) = match f {
                    Some((gp, gb)) => (
                        Tensor::from_storage(gp, &[rows, hidden]),
                        Tensor::from_storage(gb, &[hidden]),
                    ),
                    None => {
                        let gh = g.matmul(w2)?;
                        let s = pre.storage().unary_grad(
                            pre.layout(),
                            &gh.storage(),
                            gh.layout(),
                            UnaryOp::GeluTanh,
                        )?;
                        let gp = Tensor::from_storage(s, &[rows, hidden]);
                        let gb = gp.sum(&[0], false)?;
                        (gp, gb)
                    }
                };
                gx = needs[0]
                    .then(|| gpre.matmul(kept("mlp_gelu_tanh", &w1s)?))
                    .transpose()?;
                gw1 = needs[1]
                    .then(|| gpre.t()?.matmul(kept("mlp_gelu_tanh", &xs)?))
                    .transpose()?;
                gb1 = needs[2].then_some(gb);
            }
            Ok(vec![gx, gw1, gb1, gw2, gb2])
        };
        let reads: Vec<&Tensor> = reads.iter().collect();
        let y = y.attach_saving(
            "mlp_gelu_tanh",
            &[&x2, &w1, &b1, &w2, &b2],
            &reads,
            backward,
        );
        let mut shape = x.shape().to_vec();
        *shape.last_mut().expect("rank >= 2") = out_c;
        y.reshape(&shape)
    }
}
