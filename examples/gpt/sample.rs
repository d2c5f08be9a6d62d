//! Text from a GPT: greedy, or sampled with temperature, top-k and top-p on the device, one
//! position per new token through the layers' key/value caches.

use super::model::Gpt;
use mantissa::{no_grad, DType, Device, Error, Generator, Result, Tensor};

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleOptions {
    /// Tokens to add after the prompt.
    pub new_tokens: usize,
    /// The largest logit's token every time (temperature and the cuts do not apply).
    pub greedy: bool,
    /// Logits are divided by it before sampling (below 1 sharper, above 1 flatter).
    pub temperature: f64,
    /// Only the `k` most likely tokens can be drawn.
    pub top_k: Option<usize>,
    /// Only the most likely tokens whose probabilities add up to `p` can be drawn (nucleus
    /// sampling; the most likely one always can).
    pub top_p: Option<f64>,
}

impl SampleOptions {
    /// An error naming the option out of range.
    pub fn check(&self, vocab: usize) -> Result<()> {
        let bad = |msg: String| {
            Err(Error::Invalid {
                op: "gpt sample",
                msg,
            })
        };
        if !(self.temperature > 0.0 && self.temperature.is_finite()) {
            return bad(format!(
                "temperature {} (must be above 0)",
                self.temperature
            ));
        }
        if let Some(k) = self.top_k.filter(|&k| k == 0 || k > vocab) {
            return bad(format!("top-k {k} (the vocabulary has {vocab} tokens)"));
        }
        if let Some(p) = self.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            return bad(format!("top-p {p} (must be in (0, 1])"));
        }
        Ok(())
    }
}

/// The next token's index `[1, 1]` (I64) from last-position logits `[1, V]`.
fn pick(logits: &Tensor, o: &SampleOptions, g: &mut Generator) -> Result<Tensor> {
    let logits = logits.to_dtype(DType::F32)?;
    if o.greedy {
        return logits.argmax(-1, true);
    }
    let mut l = logits.div(o.temperature)?;
    if let Some(k) = o.top_k {
        let (top, _) = l.topk(k, -1, true)?;
        let kth = top.narrow(-1, k - 1, 1)?;
        l = l.masked_fill(&l.lt(&kth)?, f64::NEG_INFINITY)?;
    }
    let Some(p) = o.top_p else {
        return l.softmax(-1)?.multinomial(1, true, g);
    };
    // Sorted, most likely first: a token is cut when the ones before it already hold `p`.
    let (sorted, order) = l.sort(-1, true)?;
    let probs = sorted.softmax(-1)?;
    let before = probs.cumsum(-1)?.sub(&probs)?;
    let kept = sorted.masked_fill(&before.gt(p)?, f64::NEG_INFINITY)?;
    let k = kept.softmax(-1)?.multinomial(1, true, g)?;
    order.gather(-1, &k)
}

/// `prompt` followed by `o.new_tokens` tokens from `net` (in evaluation mode, without
/// gradients, under `low`'s autocast when given). Each new token runs one position through
/// the layers' key/value caches; once the context is full, the last `block_size` tokens run
/// again each time (their positions moved), as nanoGPT's `generate` crops them. `on_token`
/// sees each new token as it comes.
pub fn generate(
    net: &Gpt,
    prompt: &[u32],
    o: &SampleOptions,
    low: Option<DType>,
    g: &mut Generator,
    mut on_token: impl FnMut(u32),
) -> Result<Vec<u32>> {
    o.check(net.config.vocab_size)?;
    if prompt.is_empty() {
        return Err(Error::Invalid {
            op: "gpt sample",
            msg: "an empty prompt: give at least one token".into(),
        });
    }
    let device = net.wte.weight.device();
    let block = net.config.block_size;
    let tokens_of = |t: &[u32]| -> Result<Tensor> {
        let v: Vec<i64> = t.iter().map(|&k| k as i64).collect();
        Tensor::from_vec(v, &[1, t.len()], Device::Cpu)?.to_device(device)
    };
    let mut seq = prompt.to_vec();
    let mut caches = net.new_caches();
    let mut cached = 0;
    let run = |x: &Tensor, caches: &mut [super::model::KvCache]| {
        no_grad(|| mantissa::train::autocast_maybe(low, || net.forward_cached(x, Some(caches))))
    };
    let window = &seq[seq.len().saturating_sub(block)..];
    let mut logits = run(&tokens_of(window)?, &mut caches)?;
    cached += window.len();
    for k in 0..o.new_tokens {
        let t = logits.shape()[1];
        let last = logits.narrow(1, t - 1, 1)?.squeeze(1)?;
        let next = no_grad(|| pick(&last, o, g))?.to_vec::<i64>()?[0] as u32;
        seq.push(next);
        on_token(next);
        if k + 1 == o.new_tokens {
            break;
        }
        if cached < block {
            logits = run(&tokens_of(&[next])?, &mut caches)?;
            cached += 1;
        } else {
            caches = net.new_caches();
            logits = run(&tokens_of(&seq[seq.len() - block..])?, &mut caches)?;
        }
    }
    Ok(seq)
}
