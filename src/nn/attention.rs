//! `MultiheadAttention` as PyTorch's `nn.MultiheadAttention` (same parameter names and
//! initialisation, so weights move across with `state_dict`), on
//! [`Tensor::scaled_dot_product_attention`].

use super::{join, uniform_param, Linear, Module, TensorKind, Visitor, VisitorMut};
use crate::{AttentionOptions, DType, Device, Error, Generator, Result, Tensor};

/// Multi-head attention: queries, keys and values projected by `in_proj_weight` (`[3E, E]`,
/// the three stacked) and `in_proj_bias`, split into `heads` heads, attended, joined and
/// projected by `out_proj`. Inputs are `[L, N, E]`, or `[N, L, E]` with `batch_first`.
///
/// ```
/// use mantissa::nn::{Module, MultiheadAttention};
/// use mantissa::{DType, Device, Generator, Tensor};
/// let mha = MultiheadAttention::new(16, 4, true, &mut Generator::new(0))?;
/// let x = Tensor::randn(&[2, 10, 16], DType::F32, Device::Cpu)?;
/// assert_eq!(mha.forward(&x)?.shape(), &[2, 10, 16]); // self-attention
/// # Ok::<(), mantissa::Error>(())
/// ```
pub struct MultiheadAttention {
    pub in_proj_weight: Tensor,
    pub in_proj_bias: Tensor,
    pub out_proj: Linear,
    pub heads: usize,
    pub batch_first: bool,
    /// Dropout on the attention weights in training mode.
    pub dropout: f64,
    training: bool,
}

impl MultiheadAttention {
    /// PyTorch's initialisation: Xavier-uniform input projections, zero biases, the output
    /// projection as a Linear's weight.
    pub fn new(
        embed: usize,
        heads: usize,
        batch_first: bool,
        gen: &mut Generator,
    ) -> Result<MultiheadAttention> {
        if heads == 0 || !embed.is_multiple_of(heads) {
            return Err(Error::invalid(
                "MultiheadAttention::new",
                format!("embed_dim {embed} must be a positive multiple of num_heads {heads}"),
            ));
        }
        let xavier = (6.0 / (4 * embed) as f64).sqrt();
        let zeros = |n: usize| Tensor::zeros(&[n], DType::F32, Device::Cpu)?.requires_grad(true);
        Ok(MultiheadAttention {
            in_proj_weight: uniform_param(&[3 * embed, embed], xavier, gen)?,
            in_proj_bias: zeros(3 * embed)?,
            out_proj: Linear {
                weight: uniform_param(&[embed, embed], 1.0 / (embed as f64).sqrt(), gen)?,
                bias: Some(zeros(embed)?),
            },
            heads,
            batch_first,
            dropout: 0.0,
            training: true,
        })
    }

    /// Attention of `query` over `key`/`value` (PyTorch's `forward(query, key, value,
    /// key_padding_mask, attn_mask)` with `need_weights=False`): `key_padding_mask` `[N, S]`
    /// and a U8 `attn_mask` `[L, S]` or `[N * heads, L, S]` mark with 1 what is left out
    /// (PyTorch's `True`); a float `attn_mask` is added to the scores.
    pub fn attend(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        key_padding_mask: Option<&Tensor>,
        attn_mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let e = self.in_proj_weight.shape()[1];
        let h = self.heads;
        let bad = |why: String| Err(Error::invalid("MultiheadAttention", why));
        if query.rank() != 3 || key.rank() != 3 || value.rank() != 3 || query.shape()[2] != e {
            return bad(format!(
                "needs 3-D query, key and value of embedding {e}, got {:?}, {:?} and {:?}",
                query.shape(),
                key.shape(),
                value.shape()
            ));
        }
        // [N, L, E] from either layout.
        let batch = |t: &Tensor| match self.batch_first {
            true => Ok(t.clone()),
            false => t.transpose(0, 1),
        };
        let (q, k, v) = (batch(query)?, batch(key)?, batch(value)?);
        let (n, l, s) = (q.shape()[0], q.shape()[1], k.shape()[1]);
        let w = self.in_proj_weight.chunk(3, 0)?;
        let b = self.in_proj_bias.chunk(3, 0)?;
        // [N, T, E] -> [N, heads, T, E / heads].
        let heads = |x: &Tensor, i: usize, t: usize| {
            x.linear(&w[i], Some(&b[i]))?
                .reshape(&[n, t, h, e / h])?
                .transpose(1, 2)
        };
        let (q, k, v) = (heads(&q, 0, l)?, heads(&k, 1, s)?, heads(&v, 2, s)?);
        let mask = self.additive_mask(key_padding_mask, attn_mask, (n, l, s), q.dtype())?;
        let o = AttentionOptions {
            attn_mask: mask.as_ref(),
            dropout_p: if self.training { self.dropout } else { 0.0 },
            ..Default::default()
        };
        let y = q.scaled_dot_product_attention(&k, &v, o)?;
        let y = self
            .out_proj
            .forward(&y.transpose(1, 2)?.reshape(&[n, l, e])?)?;
        match self.batch_first {
            true => Ok(y),
            false => y.transpose(0, 1),
        }
    }

    /// The masks as one additive `[N, heads, L, S]`-broadcastable mask (0 or -inf, or the
    /// float mask's values), or none.
    fn additive_mask(
        &self,
        padding: Option<&Tensor>,
        attn: Option<&Tensor>,
        (n, l, s): (usize, usize, usize),
        dtype: DType,
    ) -> Result<Option<Tensor>> {
        let h = self.heads;
        let to_add = |m: &Tensor| -> Result<Tensor> {
            match m.dtype() {
                DType::U8 => m
                    .zeros_like()?
                    .to_dtype(dtype)?
                    .masked_fill(m, f64::NEG_INFINITY),
                _ => m.to_dtype(dtype),
            }
        };
        let mut total: Option<Tensor> = None;
        if let Some(p) = padding {
            if p.shape() != [n, s] || p.dtype() != DType::U8 {
                return Err(Error::invalid(
                    "MultiheadAttention",
                    format!(
                        "key_padding_mask must be U8 [{n}, {s}], got {:?} {:?}",
                        p.dtype(),
                        p.shape()
                    ),
                ));
            }
            total = Some(to_add(p)?.reshape(&[n, 1, 1, s])?);
        }
        if let Some(a) = attn {
            let a = match a.shape() {
                [al, as_] if *al == l && *as_ == s => to_add(a)?,
                [b, al, as_] if *b == n * h && *al == l && *as_ == s => {
                    to_add(a)?.reshape(&[n, h, l, s])?
                }
                other => {
                    return Err(Error::invalid(
                        "MultiheadAttention",
                        format!(
                            "attn_mask must be [{l}, {s}] or [{}, {l}, {s}], got {other:?}",
                            n * h
                        ),
                    ))
                }
            };
            total = Some(match total {
                Some(t) => t.add(&a)?,
                None => a,
            });
        }
        Ok(total)
    }
}

impl Module for MultiheadAttention {
    /// Self-attention: `x` as query, key and value.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.attend(x, x, x, None, None)
    }
    fn visit(&self, p: &str, f: &mut Visitor) {
        f(
            join(p, "in_proj_weight"),
            &self.in_proj_weight,
            TensorKind::Parameter,
        );
        f(
            join(p, "in_proj_bias"),
            &self.in_proj_bias,
            TensorKind::Parameter,
        );
        self.out_proj.visit(&join(p, "out_proj"), f);
    }
    fn visit_mut(&mut self, p: &str, f: &mut VisitorMut) -> Result<()> {
        if let Some(on) = super::mode_being_set() {
            self.training = on;
        }
        f(
            join(p, "in_proj_weight"),
            &mut self.in_proj_weight,
            TensorKind::Parameter,
        )?;
        f(
            join(p, "in_proj_bias"),
            &mut self.in_proj_bias,
            TensorKind::Parameter,
        )?;
        self.out_proj.visit_mut(&join(p, "out_proj"), f)
    }
}
