//! `MultiheadAttention` as PyTorch's `nn.MultiheadAttention` (same parameter names and
//! initialisation, so weights move across with `state_dict`), on
//! [`Tensor::scaled_dot_product_attention`].

use super::{join, uniform_param, Linear, Module, TensorKind, Visitor, VisitorMut};
use crate::{AttentionOptions, DType, Device, Error, Generator, Result, Tensor};

/// Constructor options of [`MultiheadAttention::with_options`]: PyTorch's
/// `nn.MultiheadAttention` keywords, with its defaults.
///
/// ```
/// use mantissa::nn::{MhaOptions, MultiheadAttention};
/// use mantissa::Generator;
/// let o = MhaOptions { kdim: Some(6), vdim: Some(4), add_bias_kv: true, ..Default::default() };
/// let mha = MultiheadAttention::with_options(8, 2, o, &mut Generator::new(0))?;
/// assert!(mha.in_proj_weight.is_none() && mha.k_proj_weight.as_ref().unwrap().shape() == [8, 6]);
/// # Ok::<(), mantissa::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MhaOptions {
    /// Dropout on the attention weights in training mode.
    pub dropout: f64,
    /// Biases on the input and output projections.
    pub bias: bool,
    /// A learned key and value (`bias_k`, `bias_v`, `[1, 1, E]`) appended to every sequence.
    pub add_bias_kv: bool,
    /// A zero key and value appended to every sequence, after the heads are split.
    pub add_zero_attn: bool,
    /// Features of the key; `None` is the embedding size.
    pub kdim: Option<usize>,
    /// Features of the value; `None` is the embedding size.
    pub vdim: Option<usize>,
    /// Inputs `[N, L, E]` instead of `[L, N, E]`.
    pub batch_first: bool,
}

impl Default for MhaOptions {
    fn default() -> Self {
        MhaOptions {
            dropout: 0.0,
            bias: true,
            add_bias_kv: false,
            add_zero_attn: false,
            kdim: None,
            vdim: None,
            batch_first: false,
        }
    }
}

/// Multi-head attention, PyTorch's `nn.MultiheadAttention`: queries, keys and values
/// projected (by `in_proj_weight`, `[3E, E]`, the three stacked, or, when the key or value
/// size is not E, by `q_proj_weight`, `k_proj_weight` and `v_proj_weight`) with
/// `in_proj_bias`, split into `heads` heads, attended, joined and projected by `out_proj`.
/// Inputs are `[L, N, E]`, or `[N, L, E]` with `batch_first`, or unbatched `[L, E]`. The
/// parameters have PyTorch's names and initialisation, so weights move across with
/// `state_dict`.
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
    /// The query, key and value projections stacked, `[3E, E]`, when the key and value
    /// sizes are E.
    pub in_proj_weight: Option<Tensor>,
    /// The query projection `[E, E]` when the key or value size is not E.
    pub q_proj_weight: Option<Tensor>,
    /// The key projection `[E, kdim]` when the key or value size is not E.
    pub k_proj_weight: Option<Tensor>,
    /// The value projection `[E, vdim]` when the key or value size is not E.
    pub v_proj_weight: Option<Tensor>,
    /// The three projections' biases, stacked (`[3E]`), unless built without biases.
    pub in_proj_bias: Option<Tensor>,
    /// The learned key appended to every sequence (`add_bias_kv`), `[1, 1, E]`.
    pub bias_k: Option<Tensor>,
    /// The learned value appended to every sequence (`add_bias_kv`), `[1, 1, E]`.
    pub bias_v: Option<Tensor>,
    pub out_proj: Linear,
    pub heads: usize,
    pub batch_first: bool,
    /// Dropout on the attention weights in training mode.
    pub dropout: f64,
    /// A zero key and value appended to every sequence after the heads are split.
    pub add_zero_attn: bool,
    training: bool,
}

/// Arguments of [`MultiheadAttention::forward_with`]: PyTorch's `forward` keywords, with its
/// defaults (weights returned, averaged over the heads).
#[derive(Debug, Clone, Copy)]
pub struct MhaForward<'a> {
    /// `[N, S]` (`[S]` unbatched): U8 with 1 for a key left out (PyTorch's `True`), or float,
    /// added to the scores.
    pub key_padding_mask: Option<&'a Tensor>,
    /// `[L, S]` or `[N * heads, L, S]` (`[heads, L, S]` unbatched): U8 with 1 for a pair left
    /// out, or float, added to the scores.
    pub attn_mask: Option<&'a Tensor>,
    /// Return the attention weights too (`[N, L, S]`, or per head `[N, heads, L, S]`).
    pub need_weights: bool,
    /// Average the returned weights over the heads.
    pub average_attn_weights: bool,
    /// Query `i` attends to keys `0..=i` only (the top-left causal mask), as a GPT block
    /// wants. PyTorch takes `is_causal` as a hint that `attn_mask` is the causal mask and
    /// requires that mask; here `is_causal` alone applies it, and with an `attn_mask` both
    /// apply (the same result as PyTorch's when the mask given is the causal one). Keys
    /// appended by `add_bias_kv` or `add_zero_attn` stay visible to every query.
    pub is_causal: bool,
}

impl Default for MhaForward<'_> {
    fn default() -> Self {
        MhaForward {
            key_padding_mask: None,
            attn_mask: None,
            need_weights: true,
            average_attn_weights: true,
            is_causal: false,
        }
    }
}

impl MultiheadAttention {
    /// PyTorch's defaults apart from `batch_first`: [`MultiheadAttention::with_options`].
    pub fn new(
        embed: usize,
        heads: usize,
        batch_first: bool,
        gen: &mut Generator,
    ) -> Result<MultiheadAttention> {
        let o = MhaOptions {
            batch_first,
            ..Default::default()
        };
        MultiheadAttention::with_options(embed, heads, o, gen)
    }

    /// PyTorch's initialisation: Xavier-uniform input projections, zero biases, the output
    /// projection as a Linear's weight, Xavier-normal `bias_k` and `bias_v`.
    pub fn with_options(
        embed: usize,
        heads: usize,
        o: MhaOptions,
        gen: &mut Generator,
    ) -> Result<MultiheadAttention> {
        let op = "MultiheadAttention::new";
        if heads == 0 || embed == 0 || !embed.is_multiple_of(heads) {
            return Err(Error::invalid(
                op,
                format!("embed_dim {embed} must be a positive multiple of num_heads {heads}"),
            ));
        }
        let (kdim, vdim) = (o.kdim.unwrap_or(embed), o.vdim.unwrap_or(embed));
        if kdim == 0 || vdim == 0 || !(0.0..1.0).contains(&o.dropout) {
            return Err(Error::invalid(
                op,
                format!(
                    "kdim {kdim} and vdim {vdim} must be positive and dropout {} in [0, 1)",
                    o.dropout
                ),
            ));
        }
        let xavier = |rows: usize, cols: usize, gen: &mut Generator| {
            uniform_param(&[rows, cols], (6.0 / (rows + cols) as f64).sqrt(), gen)
        };
        let zeros = |n: usize| Tensor::zeros(&[n], DType::F32, Device::Cpu)?.requires_grad(true);
        let packed = kdim == embed && vdim == embed;
        let (mut in_proj, mut q, mut k, mut v) = (None, None, None, None);
        if packed {
            in_proj = Some(xavier(3 * embed, embed, gen)?);
        } else {
            q = Some(xavier(embed, embed, gen)?);
            k = Some(xavier(embed, kdim, gen)?);
            v = Some(xavier(embed, vdim, gen)?);
        }
        let out_w = uniform_param(&[embed, embed], 1.0 / (embed as f64).sqrt(), gen)?;
        // Xavier-normal of a [1, 1, E] tensor: fan in and fan out are both E.
        let mut bias_kv = || -> Result<Tensor> {
            let std = (1.0 / embed as f64).sqrt();
            Tensor::randn_with(&[1, 1, embed], 0.0, std, DType::F32, Device::Cpu, gen)?
                .requires_grad(true)
        };
        let (bias_k, bias_v) = match o.add_bias_kv {
            true => (Some(bias_kv()?), Some(bias_kv()?)),
            false => (None, None),
        };
        Ok(MultiheadAttention {
            in_proj_weight: in_proj,
            q_proj_weight: q,
            k_proj_weight: k,
            v_proj_weight: v,
            in_proj_bias: o.bias.then(|| zeros(3 * embed)).transpose()?,
            bias_k,
            bias_v,
            out_proj: Linear {
                weight: out_w,
                bias: o.bias.then(|| zeros(embed)).transpose()?,
            },
            heads,
            batch_first: o.batch_first,
            dropout: o.dropout,
            add_zero_attn: o.add_zero_attn,
            training: true,
        })
    }

    /// The embedding size E.
    pub fn embed_dim(&self) -> usize {
        self.out_proj.weight.shape()[0]
    }

    /// The key and value feature sizes (`kdim`, `vdim`).
    pub fn kv_dims(&self) -> (usize, usize) {
        match (&self.k_proj_weight, &self.v_proj_weight) {
            (Some(k), Some(v)) => (k.shape()[1], v.shape()[1]),
            _ => (self.embed_dim(), self.embed_dim()),
        }
    }

    /// Attention of `query` over `key`/`value` without the weights (PyTorch's
    /// `forward(query, key, value, key_padding_mask, attn_mask, need_weights=False)[0]`):
    /// [`MultiheadAttention::forward_with`].
    pub fn attend(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        key_padding_mask: Option<&Tensor>,
        attn_mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let a = MhaForward {
            key_padding_mask,
            attn_mask,
            need_weights: false,
            ..Default::default()
        };
        Ok(self.forward_with(query, key, value, a)?.0)
    }

    /// PyTorch's `forward(query, key, value, ...)`: the output (`[L, N, E]`, `[N, L, E]` with
    /// `batch_first`, `[L, E]` unbatched) and, with `need_weights`, the attention weights
    /// (`[N, L, S]` averaged over the heads or `[N, heads, L, S]`, without the batch dim
    /// unbatched; S counts the appended `bias_k` and zero keys). The weights are those the
    /// values were averaged with: after dropout in training mode. A query whose keys are
    /// all masked gets weights 0 and an output of `out_proj`'s bias, as PyTorch's
    /// `need_weights=False` path gives (its weights path gives NaN there).
    ///
    /// ```
    /// use mantissa::nn::{MhaForward, MultiheadAttention};
    /// use mantissa::{DType, Device, Generator, Tensor};
    /// let mha = MultiheadAttention::new(8, 2, false, &mut Generator::new(0))?;
    /// let x = Tensor::randn(&[5, 8], DType::F32, Device::Cpu)?; // unbatched [L, E]
    /// let (y, w) = mha.forward_with(&x, &x, &x, MhaForward::default())?;
    /// assert_eq!((y.shape(), w.unwrap().shape()), (&[5, 8][..], &[5, 5][..]));
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn forward_with(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        a: MhaForward<'_>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (e, h) = (self.embed_dim(), self.heads);
        let (kdim, vdim) = self.kv_dims();
        let unbatched = query.rank() == 2;
        let rank = if unbatched { 2 } else { 3 };
        let ok = [query, key, value].iter().all(|t| t.rank() == rank)
            && query.shape()[rank - 1] == e
            && key.shape()[rank - 1] == kdim
            && value.shape()[rank - 1] == vdim
            && key.shape()[..rank - 1] == value.shape()[..rank - 1]
            && (unbatched || query.shape()[self.batch_dim()] == key.shape()[self.batch_dim()]);
        if !ok {
            return Err(Error::invalid(
                "MultiheadAttention",
                format!(
                    "needs query [L, N, {e}], key [S, N, {kdim}] and value [S, N, {vdim}]                      (batch first: [N, L, ..]; unbatched: [L, {e}], [S, {kdim}], [S, {vdim}]),                      got {:?}, {:?} and {:?}",
                    query.shape(),
                    key.shape(),
                    value.shape()
                ),
            ));
        }
        // [N, T, features] from any layout.
        let batch = |t: &Tensor| match (unbatched, self.batch_first) {
            (true, _) => t.unsqueeze(0),
            (false, true) => Ok(t.clone()),
            (false, false) => t.transpose(0, 1),
        };
        let (q, k, v) = (batch(query)?, batch(key)?, batch(value)?);
        let (n, l, s) = (q.shape()[0], q.shape()[1], k.shape()[1]);
        let padding = match (a.key_padding_mask, unbatched) {
            (Some(p), true) => Some(p.unsqueeze(0)?),
            (p, _) => p.cloned(),
        };
        // The mask in the projections' dtype (the low one under autocast).
        let (q, k, v, extra) = self.project(&q, &k, &v)?;
        let mask = self.additive_mask(padding.as_ref(), a.attn_mask, (n, l, s), q.dtype())?;
        // The causal mask goes to the attention itself (where the fused op applies it
        // without a mask tensor) when it is the only mask and no key was appended; else it
        // joins the additive mask, before the appended keys' columns.
        let causal_alone = a.is_causal && mask.is_none() && extra == 0;
        let mask = match a.is_causal && !causal_alone {
            true => {
                let c = causal_mask(l, s, q.dtype(), q.device())?;
                Some(match mask {
                    Some(m) => m.add(&c)?,
                    None => c,
                })
            }
            false => mask,
        };
        let mask = match (mask, extra) {
            (Some(m), 1..) => Some(pad_last(&m, extra)?),
            (m, _) => m,
        };
        let o = AttentionOptions {
            attn_mask: mask.as_ref(),
            dropout_p: if self.training { self.dropout } else { 0.0 },
            is_causal: causal_alone,
            ..Default::default()
        };
        let (y, w) = match a.need_weights {
            true => {
                let scale = 1.0 / ((e / h) as f64).sqrt();
                let w = crate::ops::attention_weights(&q, &k, scale, o, true)?;
                (w.matmul(&v)?, Some(w))
            }
            false => (q.scaled_dot_product_attention(&k, &v, o)?, None),
        };
        let y = self
            .out_proj
            .forward(&y.transpose(1, 2)?.reshape(&[n, l, e])?)?;
        let y = match (unbatched, self.batch_first) {
            (true, _) => y.squeeze(0)?,
            (false, true) => y,
            (false, false) => y.transpose(0, 1)?,
        };
        let w = match w {
            Some(w) if a.average_attn_weights => Some(w.mean(&[1], false)?),
            w => w,
        };
        let w = match (w, unbatched) {
            (Some(w), true) => Some(w.squeeze(0)?),
            (w, _) => w,
        };
        Ok((y, w))
    }

    fn batch_dim(&self) -> usize {
        usize::from(!self.batch_first)
    }

    /// Queries, keys and values `[N, T, ..]` projected and split into heads
    /// (`[N, heads, T, E / heads]`), with `bias_k`/`bias_v` and the zero key and value
    /// appended to the keys and values; and how many keys were appended.
    fn project(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor, usize)> {
        let (e, h) = (self.embed_dim(), self.heads);
        let ws = match (
            &self.in_proj_weight,
            &self.q_proj_weight,
            &self.k_proj_weight,
            &self.v_proj_weight,
        ) {
            (Some(w), ..) => w.chunk(3, 0)?,
            (None, Some(q), Some(k), Some(v)) => vec![q.clone(), k.clone(), v.clone()],
            _ => {
                return Err(Error::invalid(
                    "MultiheadAttention",
                    "needs in_proj_weight, or q_proj_weight, k_proj_weight and v_proj_weight",
                ))
            }
        };
        let bs = match &self.in_proj_bias {
            Some(b) => b.chunk(3, 0)?.into_iter().map(Some).collect(),
            None => vec![None, None, None],
        };
        let q = q.linear(&ws[0], bs[0].as_ref())?;
        let mut k = k.linear(&ws[1], bs[1].as_ref())?;
        let mut v = v.linear(&ws[2], bs[2].as_ref())?;
        let n = q.shape()[0];
        let mut extra = 0;
        if let (Some(bk), Some(bv)) = (&self.bias_k, &self.bias_v) {
            let append = |x: &Tensor, b: &Tensor| {
                let b = b.to_dtype(x.dtype())?.expand(&[n, 1, e])?;
                Tensor::cat(&[x, &b], 1)
            };
            k = append(&k, bk)?;
            v = append(&v, bv)?;
            extra += 1;
        }
        let split = |x: &Tensor| {
            let t = x.shape()[1];
            x.reshape(&[n, t, h, e / h])?.transpose(1, 2)
        };
        let (q, mut k, mut v) = (split(&q)?, split(&k)?, split(&v)?);
        if self.add_zero_attn {
            let zero = Tensor::zeros(&[n, h, 1, e / h], k.dtype(), k.device())?;
            k = Tensor::cat(&[&k, &zero], 2)?;
            v = Tensor::cat(&[&v, &zero], 2)?;
            extra += 1;
        }
        Ok((q, k, v, extra))
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
            if p.shape() != [n, s] || !(p.dtype() == DType::U8 || p.dtype().is_float()) {
                return Err(Error::invalid(
                    "MultiheadAttention",
                    format!(
                        "key_padding_mask must be U8 or float [{n}, {s}] ([{s}] unbatched), got {:?} \
                         {:?}",
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

/// The additive top-left causal mask `[l, s]`: 0 where key `j <= i` of query `i`, -inf after.
fn causal_mask(l: usize, s: usize, dtype: DType, device: Device) -> Result<Tensor> {
    let rows = Tensor::ramp(l, device)?.reshape(&[l, 1])?;
    let cols = Tensor::ramp(s, device)?.reshape(&[1, s])?;
    Tensor::zeros(&[l, s], dtype, device)?.masked_fill(&cols.gt(&rows)?, f64::NEG_INFINITY)
}

/// `m` with `extra` columns of zeros appended to its last dim: the appended keys are
/// never masked.
fn pad_last(m: &Tensor, extra: usize) -> Result<Tensor> {
    let mut shape = m.shape().to_vec();
    *shape.last_mut().expect("a mask has a last dim") = extra;
    Tensor::cat(&[m, &Tensor::zeros(&shape, m.dtype(), m.device())?], -1)
}

impl MultiheadAttention {
    /// The parameters by PyTorch's names, in its `state_dict` order (`out_proj` last).
    fn own_params(&self) -> [(&'static str, Option<&Tensor>); 7] {
        [
            ("in_proj_weight", self.in_proj_weight.as_ref()),
            ("q_proj_weight", self.q_proj_weight.as_ref()),
            ("k_proj_weight", self.k_proj_weight.as_ref()),
            ("v_proj_weight", self.v_proj_weight.as_ref()),
            ("in_proj_bias", self.in_proj_bias.as_ref()),
            ("bias_k", self.bias_k.as_ref()),
            ("bias_v", self.bias_v.as_ref()),
        ]
    }
}

impl Module for MultiheadAttention {
    /// Self-attention: `x` as query, key and value.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.attend(x, x, x, None, None)
    }
    fn visit(&self, p: &str, f: &mut Visitor) {
        for (name, t) in self.own_params() {
            if let Some(t) = t {
                f(join(p, name), t, TensorKind::Parameter);
            }
        }
        self.out_proj.visit(&join(p, "out_proj"), f);
    }
    fn visit_mut(&mut self, p: &str, f: &mut VisitorMut) -> Result<()> {
        if let Some(on) = super::mode_being_set() {
            self.training = on;
        }
        for (name, t) in [
            ("in_proj_weight", &mut self.in_proj_weight),
            ("q_proj_weight", &mut self.q_proj_weight),
            ("k_proj_weight", &mut self.k_proj_weight),
            ("v_proj_weight", &mut self.v_proj_weight),
            ("in_proj_bias", &mut self.in_proj_bias),
            ("bias_k", &mut self.bias_k),
            ("bias_v", &mut self.bias_v),
        ] {
            if let Some(t) = t {
                f(join(p, name), t, TensorKind::Parameter)?;
            }
        }
        self.out_proj.visit_mut(&join(p, "out_proj"), f)
    }
}
