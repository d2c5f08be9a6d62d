//! Group normalisation (PyTorch's `F.group_norm`), made of the fused layer norm: each
//! sample's channels in `groups` groups, each group normalised over its channels and
//! positions, then a per-channel affine map.

use crate::{Error, Result, Tensor};

impl Tensor {
    /// Group norm of `[n, c, ...]`: `c` split into `groups` groups normalised each (biased
    /// variance, `eps`), then `weight[c] * y + bias[c]` when given.
    ///
    /// ```
    /// use mantissa::{Tensor, DType, Device};
    /// let x = Tensor::randn(&[2, 4, 3], DType::F32, Device::Cpu)?;
    /// let y = x.group_norm(2, None, None, 1e-5)?;
    /// let m = y.reshape(&[2, 2, 6])?.mean(&[2], false)?.to_vec::<f32>()?;
    /// assert!(m.iter().all(|m| m.abs() < 1e-5));
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn group_norm(
        &self,
        groups: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        let shape = self.shape().to_vec();
        if shape.len() < 2 || groups == 0 || !shape[1].is_multiple_of(groups) {
            return Err(Error::invalid(
                "group_norm",
                format!("{groups} groups for an input of shape {shape:?}: needs [n, c, ...] with c a multiple of the groups"),
            ));
        }
        let c = shape[1];
        for (name, t) in [("weight", weight), ("bias", bias)] {
            if let Some(t) = t.filter(|t| t.shape() != [c]) {
                return Err(Error::ShapeMismatch {
                    op: if name == "weight" {
                        "group_norm (weight)"
                    } else {
                        "group_norm (bias)"
                    },
                    lhs: vec![c],
                    rhs: t.shape().to_vec(),
                });
            }
        }
        let per_group = self.numel() / shape[0].max(1) / groups;
        let y = match self.numel() {
            0 => self.clone(),
            _ => self
                .reshape(&[shape[0], groups, per_group])?
                .layer_norm(&[per_group], None, None, eps)?
                .reshape(&shape)?,
        };
        // The per-channel map, broadcast over the positions.
        let mut cshape = vec![1; shape.len()];
        cshape[1] = c;
        let y = match weight {
            Some(w) => y.mul(&w.reshape(&cshape)?)?,
            None => y,
        };
        match bias {
            Some(b) => y.add(&b.reshape(&cshape)?),
            None => Ok(y),
        }
    }
}
