//! Attention over one packed q/k/v product (a GPT's `c_attn` output): the heads are views of
//! the `[B, T, 3C]` tensor, the output comes back `[B, T, C]` with the heads merged. Where
//! the fused op runs, it is one node on the packed tensor whose backward writes q's, k's and
//! v's gradients side by side into one `[B, T, 3C]` gradient (one concatenation), instead of
//! three `narrow` backwards that each fill a zero `[B, T, 3C]` tensor and two additions.

use super::attention::FusedRun;
use crate::{AttentionOptions, Error, Result, Tensor};

impl Tensor {
    /// `scaled_dot_product_attention` of the `heads` heads of a packed `[B, T, 3C]` tensor
    /// (queries, keys and values side by side, as nanoGPT's `c_attn` makes them:
    /// `q, k, v = x.split(C, 2)`, each viewed as `[B, heads, T, C / heads]`), with the
    /// output's heads merged back to `[B, T, C]`. The same values and gradients as that
    /// composition; where the fused op runs ([`crate::set_attention_kernel`]), one node whose
    /// backward writes the packed tensor's gradient in one piece.
    ///
    /// ```
    /// use mantissa::{AttentionOptions, DType, Device, Tensor};
    /// let qkv = Tensor::randn(&[2, 5, 3 * 8], DType::F32, Device::Cpu)?;
    /// let opts = AttentionOptions { is_causal: true, ..Default::default() };
    /// let y = qkv.packed_attention(2, opts)?;
    /// assert_eq!(y.shape(), &[2, 5, 8]);
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn packed_attention(&self, heads: usize, o: AttentionOptions<'_>) -> Result<Tensor> {
        let s = self.shape();
        let fits =
            s.len() == 3 && s[2].is_multiple_of(3) && heads > 0 && (s[2] / 3).is_multiple_of(heads);
        if !fits || s[2] == 0 {
            return Err(Error::invalid(
                "packed_attention",
                format!(
                    "needs [B, T, 3C] with C a positive multiple of the {heads} heads, got {s:?}"
                ),
            ));
        }
        let (b, t, c) = (s[0], s[1], s[2] / 3);
        let e = c / heads;
        let split = |x: &Tensor| -> Result<Vec<Tensor>> {
            (0..3)
                .map(|i| {
                    x.narrow(2, i * c, c)?
                        .reshape(&[b, t, heads, e])?
                        .transpose(1, 2)
                })
                .collect()
        };
        let merge = move |y: &Tensor| y.transpose(1, 2)?.reshape(&[b, t, c]);
        let detached = self.detach();
        let parts = split(&detached)?;
        let scale = o.scale.unwrap_or(1.0 / (e as f64).sqrt());
        let fused = if o.is_causal && o.attn_mask.is_some() {
            None
        } else {
            FusedRun::start(&parts[0], &parts[1], &parts[2], scale, o)?
        };
        let Some((out, run)) = fused else {
            // The composition, through the views' own graph (and its argument checks).
            let parts = split(self)?;
            return merge(&parts[0].scaled_dot_product_attention(&parts[1], &parts[2], o)?);
        };
        let dtype = self.dtype();
        let read = [self.clone(), out.detach()];
        let out = out.attach_saving(
            "packed_attention",
            &[self],
            &read.iter().collect::<Vec<_>>(),
            move |g, _| {
                let grads = run.grads(g)?;
                let merged = grads.iter().map(merge).collect::<Result<Vec<_>>>()?;
                let packed = Tensor::cat(&merged.iter().collect::<Vec<_>>(), 2)?;
                // Autocast may have cast the parts: the gradient in the packed tensor's dtype.
                Ok(vec![Some(packed.to_dtype(dtype)?)])
            },
        );
        merge(&out)
    }
}
