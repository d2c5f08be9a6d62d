//! A GPT's weights in and out under the names people share them by: nanoGPT's
//! (`transformer.h.0.attn.c_attn.weight`, weights `[out, in]` as `nn.Linear` stores them) and
//! Hugging Face's GPT-2 (the same names, with or without `transformer.`, whose `Conv1D`
//! layers store their weights transposed, `[in, out]`), in safetensors files.

use super::model::{Gpt, GptConfig};
use mantissa::nn::Module;
use mantissa::{checkpoint, Error, Result, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

/// The layers Hugging Face's GPT-2 writes as `Conv1D`, weight `[in, out]`.
const CONV1D: [&str; 4] = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"];

fn is_conv1d_weight(name: &str) -> bool {
    CONV1D
        .iter()
        .any(|l| name.ends_with(&format!("{l}.weight")))
}

fn bad(path: &Path, msg: String) -> Error {
    Error::Format {
        op: "gpt weights",
        path: path.display().to_string(),
        msg,
    }
}

/// A GPT's state from `path` under nanoGPT's names and layouts, whichever of the two ways it
/// was written: names without `transformer.` (or with `torch.compile`'s `_orig_mod.`) get it;
/// the causal-mask buffers of older Hugging Face files (`.attn.bias`, `.attn.masked_bias`)
/// are dropped; Hugging Face's transposed `Conv1D` weights (told by `c_attn` being
/// `[C, 3C]`) are turned back; a missing `lm_head.weight` is the tied token embedding.
/// With the state, the number of heads when the file's metadata says it (`n_head`, as
/// [`save_hf`] and `bench/gpt_peer.py` write it).
pub fn read_gpt_state(path: &Path) -> Result<(BTreeMap<String, Tensor>, Option<usize>)> {
    let (raw, meta) = checkpoint::read(path)?;
    let heads = meta.get("n_head").and_then(|h| h.parse().ok());
    let mut state = BTreeMap::new();
    for (name, t) in raw {
        let name = name.strip_prefix("_orig_mod.").unwrap_or(&name).to_string();
        if name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") {
            continue;
        }
        let name = match name.starts_with("transformer.") || name.starts_with("lm_head.") {
            true => name,
            false => format!("transformer.{name}"),
        };
        state.insert(name, t);
    }
    let wte = state
        .get("transformer.wte.weight")
        .ok_or_else(|| {
            bad(
                path,
                "no token embedding (wte.weight): not a GPT's state".into(),
            )
        })?
        .clone();
    let c = wte.shape()[1];
    let hf = match state
        .get("transformer.h.0.attn.c_attn.weight")
        .map(|t| t.shape())
    {
        Some([rows, cols]) if *rows == c && *cols == 3 * c => true,
        Some([rows, cols]) if *rows == 3 * c && *cols == c => false,
        other => {
            return Err(bad(
                path,
                format!("transformer.h.0.attn.c_attn.weight has shape {other:?}, width {c}"),
            ))
        }
    };
    if hf {
        for (name, t) in state.iter_mut() {
            if is_conv1d_weight(name) {
                *t = t.t()?.contiguous()?;
            }
        }
    }
    state.entry("lm_head.weight".into()).or_insert(wte);
    Ok((state, heads))
}

/// The shape of the GPT a state holds: vocabulary, context, width and depth from its tensors;
/// the heads are not in the weights, so `n_head` (when `None`: 64 wide, as GPT-2's).
pub fn config_of(
    state: &BTreeMap<String, Tensor>,
    n_head: Option<usize>,
    dropout: f64,
    path: &Path,
) -> Result<GptConfig> {
    let dims = |n: &str| state.get(n).map(|t| t.shape().to_vec());
    let (Some(wte), Some(wpe)) = (
        dims("transformer.wte.weight"),
        dims("transformer.wpe.weight"),
    ) else {
        return Err(bad(path, "no wte.weight or wpe.weight".into()));
    };
    let n_layer = (0..)
        .take_while(|l| state.contains_key(&format!("transformer.h.{l}.ln_1.weight")))
        .count();
    let config = GptConfig {
        vocab_size: wte[0],
        block_size: wpe[0],
        n_layer,
        n_head: n_head.unwrap_or((wte[1] / 64).max(1)),
        n_embd: wte[1],
        dropout,
    };
    config.check()?;
    Ok(config)
}

/// A GPT built from the weights in `path` (see [`read_gpt_state`]); every tensor of the model
/// must be in the file.
pub fn load_gpt(path: &Path, n_head: Option<usize>, dropout: f64, seed: u64) -> Result<Gpt> {
    let (state, heads) = read_gpt_state(path)?;
    let config = config_of(&state, n_head.or(heads), dropout, path)?;
    let mut net = Gpt::new(config, &mut mantissa::Generator::new(seed), seed)?;
    net.load_state_dict(&state, true)?;
    Ok(net)
}

/// Writes `net`'s weights as Hugging Face's `GPT2LMHeadModel` names them (`transformer.`...,
/// `Conv1D` weights transposed to `[in, out]`, the tied head left out), in f32.
pub fn save_hf(net: &Gpt, path: &Path) -> Result<()> {
    let mut out: Vec<(String, Tensor)> = Vec::new();
    for (name, t) in net.state_dict() {
        if name == "lm_head.weight" {
            continue;
        }
        let t = t
            .to_device(mantissa::Device::Cpu)?
            .to_dtype(mantissa::DType::F32)?;
        let t = match is_conv1d_weight(&name) {
            true => t.t()?.contiguous()?,
            false => t,
        };
        out.push((name, t));
    }
    checkpoint::write_tensors(
        path,
        out.iter().map(|(n, t)| (n.as_str(), t)),
        &[
            ("format", "pt".to_string()),
            ("n_head", net.config.n_head.to_string()),
        ],
    )
}
