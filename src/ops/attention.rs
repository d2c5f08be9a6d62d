//! Scaled dot-product attention (PyTorch's `F.scaled_dot_product_attention`), composed of
//! the batched product, masking and softmax, so it runs wherever those do (cuBLAS products
//! on CUDA, in the low dtype under autocast) with their backward.

use crate::{DType, Error, Result, Tensor};

/// Options of [`Tensor::scaled_dot_product_attention`] (PyTorch's defaults: no mask, no
/// dropout, not causal, scale `1/sqrt(E)`).
#[derive(Debug, Clone, Copy, Default)]
pub struct AttentionOptions<'a> {
    /// Added to the scores when float; when U8, 1 marks the pairs that take part (PyTorch's
    /// boolean `attn_mask`: true attends). Broadcast to `[.., L, S]`.
    pub attn_mask: Option<&'a Tensor>,
    /// Dropout on the attention weights (active whenever it is above 0, as in PyTorch's
    /// functional form).
    pub dropout_p: f64,
    /// Query `i` attends to keys `0..=i` only (the top-left causal mask).
    pub is_causal: bool,
    /// The scores' factor; `None` is `1/sqrt(E)`.
    pub scale: Option<f64>,
}

impl Tensor {
    /// `softmax(q k^T scale + mask) v` for queries `[.., L, E]` (this tensor), keys
    /// `[.., S, E]` and values `[.., S, Ev]`: `[.., L, Ev]`. A row whose keys are all masked
    /// is NaN, as in PyTorch.
    ///
    /// ```
    /// use mantissa::{AttentionOptions, Tensor, DType, Device};
    /// let q = Tensor::randn(&[2, 4, 5, 8], DType::F32, Device::Cpu)?;
    /// let kv = Tensor::randn(&[2, 4, 7, 8], DType::F32, Device::Cpu)?;
    /// let y = q.scaled_dot_product_attention(&kv, &kv, AttentionOptions::default())?;
    /// assert_eq!(y.shape(), &[2, 4, 5, 8]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn scaled_dot_product_attention(
        &self,
        key: &Tensor,
        value: &Tensor,
        o: AttentionOptions<'_>,
    ) -> Result<Tensor> {
        let (q, k, v) = (self, key, value);
        let fits = q.rank() >= 2
            && k.rank() >= 2
            && v.rank() >= 2
            && q.shape()[q.rank() - 1] == k.shape()[k.rank() - 1]
            && k.shape()[k.rank() - 2] == v.shape()[v.rank() - 2];
        if !fits {
            return Err(Error::invalid(
                "scaled_dot_product_attention",
                format!(
                    "needs query [.., L, E], key [.., S, E] and value [.., S, Ev], got {:?}, \
                     {:?} and {:?}",
                    q.shape(),
                    k.shape(),
                    v.shape()
                ),
            ));
        }
        if !(0.0..1.0).contains(&o.dropout_p) {
            return Err(Error::invalid(
                "scaled_dot_product_attention",
                format!("dropout_p {} not in [0, 1)", o.dropout_p),
            ));
        }
        let (l, s) = (q.shape()[q.rank() - 2], k.shape()[k.rank() - 2]);
        let e = q.shape()[q.rank() - 1];
        let scale = o.scale.unwrap_or(1.0 / (e.max(1) as f64).sqrt());
        let mut scores = q.matmul(&k.mt()?)?.mul(scale)?;
        if o.is_causal {
            let rows = Tensor::arange(0.0, l as f64, 1.0, DType::I64, q.device())?;
            let cols = Tensor::arange(0.0, s as f64, 1.0, DType::I64, q.device())?;
            let later = cols.unsqueeze(0)?.gt(&rows.unsqueeze(1)?)?;
            scores = scores.masked_fill(&later, f64::NEG_INFINITY)?;
        }
        if let Some(m) = o.attn_mask {
            scores = match m.dtype() {
                DType::U8 => scores.masked_fill(&m.eq(0)?, f64::NEG_INFINITY)?,
                _ => scores.add(m)?,
            };
        }
        let weights = scores.softmax(-1)?;
        let weights = match o.dropout_p > 0.0 {
            true => weights.dropout(o.dropout_p, true)?,
            false => weights,
        };
        weights.matmul(v)
    }
}
