//! Matrix products: `matmul` with PyTorch's 1-D and batch-broadcast rules, and `linear`.

use super::{dispatch, expect_float, expect_same_dtype, Op};
use crate::autograd::saved::{held, kept, kept_for};
use crate::backend::ops::UnaryOp;
use crate::layout::broadcast_shapes;
use crate::{Device, Error, Result, Tensor};

/// Multiply-adds per gradient product from which a backward runs its two products side by side
/// on the CPU; smaller ones stay on one thread each, one after the other (waking a second
/// thread for two 128 x 512 x 10 products cost more than it saved).
const SIDE_BY_SIDE_WORK: usize = 1 << 20;

impl Tensor {
    /// Product of `[..., m, k]` and `[..., k, n]` with equal batch dims.
    fn bmm(&self, rhs: &Tensor) -> Result<Tensor> {
        let r = self.rank();
        let k = self.shape()[r - 1];
        let mut shape = self.shape()[..r - 1].to_vec();
        shape.push(rhs.shape()[r - 1]);
        let s = self
            .storage()
            .matmul(self.layout(), &rhs.storage(), rhs.layout())?;
        // Each operand is read only for the other's gradient.
        let a = kept_for(rhs.is_requires_grad(), self);
        let b = kept_for(self.is_requires_grad(), rhs);
        let reads = held(&[&a, &b]);
        let reads: Vec<&Tensor> = reads.iter().collect();
        Ok(Tensor::from_storage(s, &shape).attach_saving(
            "matmul",
            &[self, rhs],
            &reads,
            move |g, needs| {
                let (a, b) = (&a, &b);
                // The two products are independent: side by side on the CPU.
                let (ga, gb) = crate::autograd::join::join_backward(
                    g.device() == Device::Cpu
                        && needs[0]
                        && needs[1]
                        && g.numel() * k >= SIDE_BY_SIDE_WORK,
                    || {
                        needs[0]
                            .then(|| g.bmm(&kept("matmul", b)?.mt()?))
                            .transpose()
                    },
                    || {
                        needs[1]
                            .then(|| kept("matmul", a)?.mt()?.bmm(g))
                            .transpose()
                    },
                );
                Ok(vec![ga?, gb?])
            },
        ))
    }

    /// Matrix product with PyTorch's rules: 1-D operands are promoted to matrices and the
    /// added dim removed afterwards; batch dims broadcast.
    ///
    /// ```
    /// use mantissa::{Tensor, DType, Device};
    /// let a = Tensor::ones(&[5, 2, 3], DType::F32, Device::Cpu)?;
    /// let b = Tensor::ones(&[3, 4], DType::F32, Device::Cpu)?;
    /// assert_eq!(a.matmul(&b)?.shape(), &[5, 2, 4]);
    /// assert!(b.matmul(&a).is_err());
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        let _prof = crate::profiler::op(Op::Matmul.name());
        let [a, b] = dispatch(Op::Matmul, [self, rhs])?;
        expect_float(Op::Matmul, &a)?;
        expect_same_dtype(Op::Matmul, &a, &b)?;
        if a.rank() == 0 || b.rank() == 0 {
            return Err(Error::invalid(
                "matmul",
                format!(
                    "both operands need rank >= 1, got {:?} and {:?}",
                    a.shape(),
                    b.shape()
                ),
            ));
        }
        let (a1, b1) = (a.rank() == 1, b.rank() == 1);
        let a2 = if a1 { a.unsqueeze(0)? } else { a.clone() };
        let b2 = if b1 { b.unsqueeze(1)? } else { b.clone() };
        let (ra, rb) = (a2.rank(), b2.rank());
        let (m, k) = (a2.shape()[ra - 2], a2.shape()[ra - 1]);
        let (k2, n) = (b2.shape()[rb - 2], b2.shape()[rb - 1]);
        if k != k2 {
            return Err(Error::InnerDims {
                op: "matmul",
                lhs: a.shape().to_vec(),
                rhs: b.shape().to_vec(),
                k_lhs: k,
                k_rhs: k2,
                rhs_dim: if b1 { "only dim" } else { "second-to-last dim" },
            });
        }
        let batch = broadcast_shapes("matmul", &a2.shape()[..ra - 2], &b2.shape()[..rb - 2])?;
        let full = |x: &Tensor, r: usize, c: usize| -> Result<Tensor> {
            let mut s = batch.clone();
            s.extend([r, c]);
            x.expand(&s)
        };
        let out = full(&a2, m, k)?.bmm(&full(&b2, k, n)?)?;
        let mut shape = batch.clone();
        if !a1 {
            shape.push(m);
        }
        if !b1 {
            shape.push(n);
        }
        out.reshape(&shape)
    }

    /// `relu(x @ weight^T + bias)`: [`Tensor::linear`] followed by [`Tensor::relu`], in one
    /// cuBLASLt call (the bias and the ReLU in the GEMM's epilogue) for a 2-D input on CUDA
    /// whose operands share a dtype; elsewhere the two ops, with the same results and errors.
    /// `nn::Sequential` uses it for each Linear followed by a ReLU.
    ///
    /// ```
    /// use mantissa::{Tensor, Device};
    /// let x = Tensor::from_vec(vec![1.0f32, -1.0], &[1, 2], Device::Cpu)?;
    /// let w = Tensor::from_vec(vec![1.0f32, 0.0, 0.0, 1.0], &[2, 2], Device::Cpu)?;
    /// let b = Tensor::from_vec(vec![0.5f32, 0.5], &[2], Device::Cpu)?;
    /// assert_eq!(x.linear_relu(&w, &b)?.to_vec::<f32>()?, vec![1.5, 0.0]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn linear_relu(&self, weight: &Tensor, bias: &Tensor) -> Result<Tensor> {
        if self.device() == Device::Cpu {
            return self.linear(weight, Some(bias))?.relu();
        }
        let _prof = crate::profiler::op(Op::Linear.name());
        let [x, w] = dispatch(Op::Linear, [self, weight])?;
        let b = super::dispatch_opt(Op::Linear, Some(bias))?.expect("a bias was given");
        let fits = x.rank() == 2
            && w.rank() == 2
            && x.shape()[1] == w.shape()[1]
            && b.shape() == [w.shape()[0]]
            && x.dtype() == w.dtype()
            && b.dtype() == x.dtype()
            && x.dtype().is_float();
        if fits {
            let wt = w.layout().permute("linear_relu", &[1, 0])?;
            let fused =
                x.storage()
                    .linear_relu(x.layout(), &w.storage(), &wt, &b.storage(), b.layout())?;
            if let Some(s) = fused {
                let y = Tensor::from_storage(s, &[x.shape()[0], w.shape()[0]]);
                let xs = kept_for(w.is_requires_grad(), &x);
                let ws = kept_for(x.is_requires_grad(), &w);
                let ys = y.detach();
                let mut reads = held(&[&xs, &ws]);
                reads.push(ys.clone());
                let backward = move |g: &Tensor, needs: &[bool]| {
                    // relu'(pre) = [y > 0]: the pre-activation's gradient from the output.
                    let s = ys.storage().unary_grad(
                        ys.layout(),
                        &g.storage(),
                        g.layout(),
                        UnaryOp::Relu,
                    )?;
                    let gp = Tensor::from_storage(s, ys.shape());
                    let gx = needs[0]
                        .then(|| gp.matmul(kept("linear_relu", &ws)?))
                        .transpose()?;
                    let gw = needs[1]
                        .then(|| gp.t()?.matmul(kept("linear_relu", &xs)?))
                        .transpose()?;
                    let gb = needs[2].then(|| gp.sum(&[0], false)).transpose()?;
                    Ok(vec![gx, gw, gb])
                };
                let reads: Vec<&Tensor> = reads.iter().collect();
                return Ok(y.attach_saving("linear_relu", &[&x, &w, &b], &reads, backward));
            }
        }
        x.linear(&w, Some(&b))?.relu()
    }

    /// `x @ weight^T + bias` with `weight: [out, in]`, `bias: [out]` (PyTorch's `F.linear`).
    /// Its backward produces the weight gradient directly in the weight's `[out, in]` layout.
    pub fn linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let _prof = crate::profiler::op(Op::Linear.name());
        let [x, w] = dispatch(Op::Linear, [self, weight])?;
        let bias = super::dispatch_opt(Op::Linear, bias)?;
        let bias = bias.as_ref();
        expect_float(Op::Linear, &x)?;
        expect_same_dtype(Op::Linear, &x, &w)?;
        if w.rank() != 2 || x.rank() == 0 {
            return Err(Error::invalid(
                "linear",
                format!(
                    "needs an input of rank >= 1 and a weight [out_features, in_features], got \
                     {:?} and {:?}",
                    x.shape(),
                    w.shape()
                ),
            ));
        }
        if x.shape()[x.rank() - 1] != w.shape()[1] {
            return Err(Error::InnerDims {
                op: "linear",
                lhs: x.shape().to_vec(),
                rhs: w.shape().to_vec(),
                k_lhs: x.shape()[x.rank() - 1],
                k_rhs: w.shape()[1],
                rhs_dim: "in_features, dim 1",
            });
        }
        let (inputs, outputs) = (w.shape()[1], w.shape()[0]);
        if let Some(b) = bias.filter(|b| b.shape() != [outputs]) {
            return Err(Error::ShapeMismatch {
                op: "linear (bias)",
                lhs: w.shape().to_vec(),
                rhs: b.shape().to_vec(),
            });
        }
        // Rows as the product of the leading dims: with no input features, numel is 0 but
        // the rows (each just the bias) are not.
        let rows: usize = x.shape()[..x.rank() - 1].iter().product();
        let x2 = x.reshape(&[rows, inputs])?;
        let wt = w.layout().permute("linear", &[1, 0])?;
        // A bias of the same dtype is added in the product's accumulator (one pass, as
        // PyTorch's addmm and cuBLASLt's bias epilogue do); another dtype is added after,
        // with the usual promotion.
        let fused = bias.filter(|b| b.dtype() == x.dtype());
        let s = match fused {
            Some(b) => x2.storage().matmul_bias(
                x2.layout(),
                &w.storage(),
                &wt,
                &b.storage(),
                b.layout(),
            )?,
            None => x2.storage().matmul(x2.layout(), &w.storage(), &wt)?,
        };
        // The input is read only for the weight's gradient, the weight only for the input's.
        let xs = kept_for(w.is_requires_grad(), &x2);
        let ws = kept_for(x2.is_requires_grad(), &w);
        let reads = held(&[&xs, &ws]);
        let backward = move |g: &Tensor, needs: &[bool]| {
            // The weight's and the bias's gradients from one product where the epilogues
            // are on (`matmul_fused.rs`).
            if needs[1] && needs.get(2) == Some(&true) {
                let fused = super::matmul_fused::weight_and_bias_grads(g, kept("linear", &xs)?)?;
                if let Some((gw, gb)) = fused {
                    let gx = needs[0]
                        .then(|| g.matmul(kept("linear", &ws)?))
                        .transpose()?;
                    return Ok(vec![gx, Some(gw), Some(gb)]);
                }
            }
            // The input's and the weight's gradients are independent products of equal
            // size: side by side on the CPU.
            let (gx, gw) = crate::autograd::join::join_backward(
                g.device() == Device::Cpu
                    && needs[0]
                    && needs[1]
                    && g.numel() * inputs >= SIDE_BY_SIDE_WORK,
                || needs[0].then(|| g.matmul(kept("linear", &ws)?)).transpose(),
                || {
                    needs[1]
                        .then(|| g.t()?.matmul(kept("linear", &xs)?))
                        .transpose()
                },
            );
            let gb = match needs.get(2) {
                Some(true) => Some(g.sum(&[0], false)?),
                _ => None,
            };
            Ok(vec![gx?, gw?, gb])
        };
        let out = Tensor::from_storage(s, &[x2.shape()[0], outputs]);
        let reads: Vec<&Tensor> = reads.iter().collect();
        let y = match fused {
            Some(b) => out.attach_saving("linear", &[&x2, &w, b], &reads, backward),
            None => out.attach_saving("linear", &[&x2, &w], &reads, backward),
        };
        let mut shape = x.shape().to_vec();
        *shape.last_mut().expect("rank >= 1") = outputs;
        let y = y.reshape(&shape)?;
        match bias {
            Some(b) if fused.is_none() => y.add(b),
            _ => Ok(y),
        }
    }
}
