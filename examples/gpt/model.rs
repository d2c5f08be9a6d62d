//! A decoder-only transformer as nanoGPT and GPT-2 write it: token and position embeddings,
//! pre-LayerNorm blocks (causal self-attention, a 4x MLP with tanh-approximated GELU), a
//! final LayerNorm and a head tied to the token embedding. Its tensors carry nanoGPT's names
//! (`transformer.h.0.attn.c_attn.weight`, ..., `lm_head.weight`), so a nanoGPT state dict
//! loads as it is; [`hf`](self::hf_names) names and layouts are converted on load and save.

use mantissa::nn::*;
use mantissa::*;

/// The shape of a GPT.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptConfig {
    pub vocab_size: usize,
    /// The longest context (positions learned).
    pub block_size: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    /// Dropout on the embeddings, the attention weights and the residual branches.
    pub dropout: f64,
}

impl GptConfig {
    /// GPT-2 124M: 12 layers, 12 heads, 768 wide, context 1024, GPT-2's 50,257 tokens
    /// padded to 50,304 (a multiple of 64, as nanoGPT pads it for faster products).
    pub fn gpt2() -> GptConfig {
        GptConfig {
            vocab_size: 50_304,
            block_size: 1024,
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            dropout: 0.0,
        }
    }

    /// GPT-2 medium (350M): 24 layers, 16 heads, 1024 wide.
    pub fn gpt2_medium() -> GptConfig {
        GptConfig {
            n_layer: 24,
            n_head: 16,
            n_embd: 1024,
            ..GptConfig::gpt2()
        }
    }

    /// An error naming what does not fit (a width the heads do not divide, a zero size).
    pub fn check(&self) -> Result<()> {
        let GptConfig {
            vocab_size: v,
            block_size: t,
            n_layer: l,
            n_head: h,
            n_embd: c,
            dropout: p,
        } = *self;
        if v == 0 || t == 0 || l == 0 || h == 0 || c == 0 || c % h != 0 || !(0.0..1.0).contains(&p)
        {
            return Err(Error::Invalid {
                op: "gpt",
                msg: format!(
                    "vocabulary {v}, context {t}, {l} layers, {h} heads of width {c} / {h}, \
                     dropout {p}: every size at least 1, the width a multiple of the heads, \
                     dropout in [0, 1)"
                ),
            });
        }
        Ok(())
    }
}

/// Causal self-attention: one projection to queries, keys and values (`c_attn`), heads of
/// `n_embd / n_head`, `scaled_dot_product_attention` with the causal mask, `c_proj` out.
pub struct CausalSelfAttention {
    pub c_attn: Linear,
    pub c_proj: Linear,
    n_head: usize,
    dropout: f64,
    resid_drop: Dropout,
    training: bool,
}

/// A layer's keys and values so far, `[B, heads, T, head width]` each.
pub type KvCache = Option<(Tensor, Tensor)>;

impl CausalSelfAttention {
    /// `x: [B, T, C]` to `[B, T, C]`. With `cache`, the keys and values of the positions
    /// before these are taken from it (the new ones attend to all of them and, causally, to
    /// each other) and the cache is extended with this call's.
    pub fn forward_cached(&self, x: &Tensor, cache: Option<&mut KvCache>) -> Result<Tensor> {
        let (b, t, c) = (x.shape()[0], x.shape()[1], x.shape()[2]);
        let h = self.n_head;
        let dropout_p = if self.training { self.dropout } else { 0.0 };
        let Some(cache) = cache else {
            // Training and full reruns: the heads as views of the packed product, whose
            // gradient the fused op's backward writes in one piece.
            let opts = AttentionOptions {
                is_causal: t > 1,
                dropout_p,
                ..Default::default()
            };
            let y = self.c_attn.forward(x)?.packed_attention(h, opts)?;
            return dropped(&self.resid_drop, &self.c_proj.forward(&y)?);
        };
        let heads = |u: &Tensor| u.reshape(&[b, t, h, c / h])?.transpose(1, 2);
        let qkv = self.c_attn.forward(x)?.split(c, 2)?;
        let (q, mut k, mut v) = (heads(&qkv[0])?, heads(&qkv[1])?, heads(&qkv[2])?);
        let mut past = 0;
        if let Some((pk, pv)) = cache.as_ref() {
            past = pk.shape()[2];
            k = Tensor::cat(&[pk, &k], 2)?;
            v = Tensor::cat(&[pv, &v], 2)?;
        }
        *cache = Some((k.clone(), v.clone()));
        // One new position attends to every cached one: no mask. Several new positions
        // after a cache would need the causal mask shifted by `past`.
        if past > 0 && t > 1 {
            return Err(Error::Invalid {
                op: "gpt",
                msg: format!("{t} new positions after {past} cached ones (one at a time)"),
            });
        }
        let y = q.scaled_dot_product_attention(
            &k,
            &v,
            AttentionOptions {
                is_causal: past == 0 && t > 1,
                dropout_p,
                ..Default::default()
            },
        )?;
        let y = y.transpose(1, 2)?.reshape(&[b, t, c])?;
        dropped(&self.resid_drop, &self.c_proj.forward(&y)?)
    }
}

/// `d` applied to `x`, skipped when its rate is 0 (no stream drawn, no mask made).
fn dropped(d: &Dropout, x: &Tensor) -> Result<Tensor> {
    match d.p {
        0.0 => Ok(x.clone()),
        _ => d.forward(x),
    }
}

/// The MLP of a block: `c_fc` to 4x the width, GELU (tanh approximation), `c_proj` back.
pub struct Mlp {
    pub c_fc: Linear,
    pub c_proj: Linear,
    drop: Dropout,
}

/// A pre-LayerNorm transformer block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`.
pub struct Block {
    pub ln_1: LayerNorm,
    pub attn: CausalSelfAttention,
    pub ln_2: LayerNorm,
    pub mlp: Mlp,
}

// Their tensors by nanoGPT's names, written from the fields by `visit_fields!`.
impl Module for CausalSelfAttention {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_cached(x, None)
    }
    mantissa::visit_fields!(c_attn, c_proj, resid_drop as "resid_dropout");
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // One op for the three (its products do the bias and GELU work in their epilogues
        // under `set_gemm_epilogues`; the same three ops otherwise).
        let y = match (&self.c_fc.bias, &self.c_proj.bias) {
            (Some(b1), Some(b2)) => {
                x.mlp_gelu_tanh((&self.c_fc.weight, b1), (&self.c_proj.weight, b2))?
            }
            _ => self.c_proj.forward(&self.c_fc.forward(x)?.gelu_tanh()?)?,
        };
        dropped(&self.drop, &y)
    }
    mantissa::visit_fields!(c_fc, c_proj, drop as "dropout");
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_cached(x, None)
    }
    mantissa::visit_fields!(ln_1, attn, ln_2, mlp);
}

/// `(x + branch, ln(x + branch))` as one op (`add_layer_norm`: one kernel on CUDA).
fn add_ln(x: &Tensor, branch: &Tensor, ln: &LayerNorm) -> Result<(Tensor, Tensor)> {
    x.add_layer_norm(
        branch,
        &ln.shape,
        ln.weight.as_ref(),
        ln.bias.as_ref(),
        ln.eps,
    )
}

impl Block {
    fn forward_cached(&self, x: &Tensor, cache: Option<&mut KvCache>) -> Result<Tensor> {
        let a = self.attn.forward_cached(&self.ln_1.forward(x)?, cache)?;
        let (x, h) = add_ln(x, &a, &self.ln_2)?;
        x.add(&self.mlp.forward(&h)?)
    }

    /// The block on `x`, given `normed = ln_1(x)`: `(y, next(y))` for its output `y`, where
    /// `next` is the layer norm that reads `y` (the next block's `ln_1`, or the final one),
    /// each residual add and the layer norm after it as one op.
    fn forward_chained(
        &self,
        x: &Tensor,
        normed: &Tensor,
        next: &LayerNorm,
        cache: Option<&mut KvCache>,
    ) -> Result<(Tensor, Tensor)> {
        let a = self.attn.forward_cached(normed, cache)?;
        let (x, h) = add_ln(x, &a, &self.ln_2)?;
        add_ln(&x, &self.mlp.forward(&h)?, next)
    }
}

/// The GPT. `lm_head` is the token embedding's weight itself (one tensor under two names),
/// so the logits are `x wte^T` and the head adds no parameter.
pub struct Gpt {
    pub config: GptConfig,
    pub wte: Embedding,
    pub wpe: Embedding,
    drop: Dropout,
    pub h: Vec<Block>,
    pub ln_f: LayerNorm,
    lm_head: Tensor,
}

/// An embedding of `rows` vectors of `cols` with GPT-2's initialisation, N(0, 0.02).
fn embedding(rows: usize, cols: usize, g: &mut Generator) -> Result<Embedding> {
    let e = Embedding::new(rows, cols, g)?;
    init::normal_(&e.weight, 0.0, 0.02, g)?;
    Ok(e)
}

/// A Linear with GPT-2's initialisation: weight from N(0, std), bias zero.
fn linear(inputs: usize, outputs: usize, std: f64, g: &mut Generator) -> Result<Linear> {
    let l = Linear::new(inputs, outputs, true, g)?;
    init::normal_(&l.weight, 0.0, std, g)?;
    if let Some(b) = &l.bias {
        init::zeros_(b)?;
    }
    Ok(l)
}

impl Gpt {
    /// A GPT with GPT-2's initialisation: every weight from N(0, 0.02), the residual
    /// projections' (`c_proj`) from N(0, 0.02 / sqrt(2 n_layer)), biases zero, LayerNorms
    /// one and zero. Dropout streams are seeded from `seed`.
    pub fn new(config: GptConfig, g: &mut Generator, seed: u64) -> Result<Gpt> {
        config.check()?;
        let c = config.n_embd;
        let proj_std = 0.02 / (2.0 * config.n_layer as f64).sqrt();
        let p = config.dropout;
        let drop = |k: u64| Dropout::new(p, seed.wrapping_mul(1000).wrapping_add(k));
        let wte = embedding(config.vocab_size, c, g)?;
        let wpe = embedding(config.block_size, c, g)?;
        let mut h = Vec::with_capacity(config.n_layer);
        for l in 0..config.n_layer as u64 {
            h.push(Block {
                ln_1: LayerNorm::new(&[c])?,
                attn: CausalSelfAttention {
                    c_attn: linear(c, 3 * c, 0.02, g)?,
                    c_proj: linear(c, c, proj_std, g)?,
                    n_head: config.n_head,
                    dropout: p,
                    resid_drop: drop(3 * l + 1),
                    training: true,
                },
                ln_2: LayerNorm::new(&[c])?,
                mlp: Mlp {
                    c_fc: linear(c, 4 * c, 0.02, g)?,
                    c_proj: linear(4 * c, c, proj_std, g)?,
                    drop: drop(3 * l + 2),
                },
            });
        }
        let lm_head = wte.weight.clone();
        Ok(Gpt {
            config,
            wte,
            wpe,
            drop: drop(0),
            h,
            ln_f: LayerNorm::new(&[c])?,
            lm_head,
        })
    }

    /// Logits `[B, T, vocab]` for tokens `[B, T]` (I64), `T` at most the context. With
    /// `caches` (one per layer), the tokens follow the cached positions, whose number is the
    /// caches' length.
    pub fn forward_cached(&self, idx: &Tensor, caches: Option<&mut [KvCache]>) -> Result<Tensor> {
        if idx.rank() != 2 {
            return Err(Error::Invalid {
                op: "gpt",
                msg: format!("tokens [batch, time] expected, got shape {:?}", idx.shape()),
            });
        }
        let t = idx.shape()[1];
        let past = caches
            .as_ref()
            .and_then(|c| c.first())
            .and_then(|c| c.as_ref())
            .map_or(0, |(k, _)| k.shape()[2]);
        if past + t > self.config.block_size {
            return Err(Error::Invalid {
                op: "gpt",
                msg: format!(
                    "{} positions, the context is {}",
                    past + t,
                    self.config.block_size
                ),
            });
        }
        // Positions past..past + t are those rows of the position table: a view, nothing
        // uploaded (so the step can be captured as a CUDA graph).
        let pos = self.wpe.weight.narrow(0, past, t)?;
        let mut x = dropped(&self.drop, &self.wte.forward(idx)?.add(&pos)?)?;
        if let Some(c) = caches.as_ref().filter(|c| c.len() != self.h.len()) {
            return Err(Error::Invalid {
                op: "gpt",
                msg: format!("{} key/value caches for {} layers", c.len(), self.h.len()),
            });
        }
        // Each block's last residual add computes the next layer norm's output with it.
        let first = self.h.first().map_or(&self.ln_f, |b| &b.ln_1);
        let mut normed = first.forward(&x)?;
        let mut caches = caches.map(|c| c.iter_mut());
        for (i, block) in self.h.iter().enumerate() {
            let next = self.h.get(i + 1).map_or(&self.ln_f, |b| &b.ln_1);
            let cache = caches.as_mut().and_then(|c| c.next());
            (x, normed) = block.forward_chained(&x, &normed, next, cache)?;
        }
        normed.linear(&self.lm_head, None)
    }

    /// Empty key/value caches, one per layer.
    pub fn new_caches(&self) -> Vec<KvCache> {
        vec![None; self.h.len()]
    }

    /// The mean cross-entropy of the next-token logits for `x` against `y` (`[B, T]` each),
    /// with the logits.
    pub fn loss(&self, x: &Tensor, y: &Tensor) -> Result<(Tensor, Tensor)> {
        let logits = self.forward(x)?;
        // `[B, T, V]` logits against `[B, T]` targets: the classes are the last dim.
        let loss = logits.cross_entropy(y, CrossEntropyOptions::default())?;
        Ok((loss, logits))
    }

    /// The parameters AdamW decays (matrices and embeddings, 2-D) and those it does not
    /// (biases and LayerNorm weights), as nanoGPT's `configure_optimizers` splits them.
    pub fn decay_groups(&self) -> (Vec<Tensor>, Vec<Tensor>) {
        self.parameters().into_iter().partition(|p| p.rank() >= 2)
    }

    /// Parameters without the position embedding, as GPT-2's paper counts them.
    pub fn num_parameters_without_positions(&self) -> usize {
        self.num_parameters() - self.wpe.weight.numel()
    }
}

impl Module for Gpt {
    fn forward(&self, idx: &Tensor) -> Result<Tensor> {
        self.forward_cached(idx, None)
    }
    fn visit(&self, p: &str, f: &mut Visitor) {
        let tr = join(p, "transformer");
        self.wte.visit(&join(&tr, "wte"), f);
        self.wpe.visit(&join(&tr, "wpe"), f);
        self.drop.visit(&join(&tr, "drop"), f);
        self.h.visit_as(&join(&tr, "h"), f);
        self.ln_f.visit(&join(&tr, "ln_f"), f);
        f(
            join(p, "lm_head.weight"),
            &self.lm_head,
            TensorKind::Parameter,
        );
    }
    fn visit_mut(&mut self, p: &str, f: &mut VisitorMut) -> Result<()> {
        let tr = join(p, "transformer");
        self.wte.visit_mut(&join(&tr, "wte"), f)?;
        self.wpe.visit_mut(&join(&tr, "wpe"), f)?;
        self.drop.visit_mut(&join(&tr, "drop"), f)?;
        self.h.visit_as_mut(&join(&tr, "h"), f)?;
        self.ln_f.visit_mut(&join(&tr, "ln_f"), f)?;
        // The head is the token embedding's weight: it follows whatever the walk made of it
        // (moved, converted, loaded in place), so the two stay one tensor even under a walk
        // that does not keep ties.
        f(
            join(p, "lm_head.weight"),
            &mut self.lm_head,
            TensorKind::Parameter,
        )?;
        self.lm_head = self.wte.weight.clone();
        Ok(())
    }
    /// Dropout modules and the attention's dropout on or off.
    fn set_training(&mut self, on: bool) {
        self.drop.set_training(on);
        for b in &mut self.h {
            b.attn.training = on;
            b.attn.resid_drop.set_training(on);
            b.mlp.drop.set_training(on);
        }
    }
}
