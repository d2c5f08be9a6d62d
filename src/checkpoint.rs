//! Checkpoints in the safetensors format: model parameters, buffers and generator states
//! (`model.<name>`), optimizer state (`optim.<i>.<name>`, `optim.generator`) and string
//! metadata, written atomically.
//!
//! ```no_run
//! use mantissa::{checkpoint, nn::{Linear, Module}, optim::{Sgd, SgdConfig}, Generator};
//! let mut model = Linear::new(4, 2, true, &mut Generator::new(0))?;
//! let mut opt = Sgd::new(model.parameters(), SgdConfig::new(0.1))?;
//! checkpoint::save("run/ckpt.safetensors", &model, Some(&opt), &[("epoch", "3".into())])?;
//! let meta = checkpoint::load("run/ckpt.safetensors", &mut model, Some(&mut opt))?;
//! assert_eq!(meta["epoch"], "3");
//! # Ok::<(), mantissa::Error>(())
//! ```

use crate::backend::cpu::CpuStorage;
use crate::backend::Storage;
use crate::nn::{Module, TensorKind};
use crate::optim::Optimizer;
use crate::{DType, Error, Result, Tensor};
use safetensors::tensor::{Dtype, TensorView};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::F64 => Dtype::F64,
        DType::I64 => Dtype::I64,
        DType::U8 => Dtype::U8,
    }
}

fn our_dtype(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::F64 => DType::F64,
        Dtype::I64 => DType::I64,
        Dtype::U8 => DType::U8,
        _ => return None,
    })
}

// The atomic write checkpoints use, public here where checkpoint users look for it.
pub use crate::fs::write_atomic;

/// The metadata key naming the optimizer whose state a checkpoint holds.
const OPTIMIZER: &str = "mantissa.optimizer";

/// Saves the model's tensors, the optimizer's state (when given, with its name in the
/// metadata as `mantissa.optimizer`) and `metadata`.
pub fn save(
    path: impl AsRef<Path>,
    model: &dyn Module,
    optim: Option<&dyn Optimizer>,
    metadata: &[(&str, String)],
) -> Result<()> {
    save_with(path, model, optim, &[], metadata)
}

/// [`save`] plus `extra` tensors stored under `extra.<name>` (a loss scaler's state, say);
/// [`read`] gives them back.
pub fn save_with(
    path: impl AsRef<Path>,
    model: &dyn Module,
    optim: Option<&dyn Optimizer>,
    extra: &[(String, Tensor)],
    metadata: &[(&str, String)],
) -> Result<()> {
    let mut named: Vec<(String, Tensor)> = extra
        .iter()
        .map(|(n, t)| (format!("extra.{n}"), t.clone()))
        .collect();
    model.visit("", &mut |n, t, _| {
        named.push((format!("model.{n}"), t.clone()))
    });
    let mut metadata = metadata.to_vec();
    if let Some(o) = optim {
        for (n, t) in o.state_tensors()? {
            named.push((format!("optim.{n}"), t));
        }
        // Which optimizer wrote the state: loading it into another is refused.
        metadata.retain(|(k, _)| *k != OPTIMIZER);
        metadata.push((OPTIMIZER, o.name().to_string()));
    }
    write_tensors(path, named.iter().map(|(n, t)| (n.as_str(), t)), &metadata)
}

/// Writes `tensors` by name into a safetensors file (atomically), with `metadata`: a
/// [`crate::nn::Module::state_dict`] for PyTorch's `safetensors.torch.load_file`, say.
/// [`read`] reads it back.
///
/// ```
/// use mantissa::{checkpoint, nn::{Linear, Module}, Generator};
/// let model = Linear::new(3, 2, true, &mut Generator::new(0))?;
/// let path = std::env::temp_dir().join("mantissa-doc-state.safetensors");
/// checkpoint::write_tensors(&path, &model.state_dict(), &[])?;
/// let (tensors, _) = checkpoint::read(&path)?;
/// assert_eq!(tensors["weight"].shape(), &[2, 3]);
/// # std::fs::remove_file(&path).ok();
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn write_tensors<'a, K: AsRef<str>>(
    path: impl AsRef<Path>,
    tensors: impl IntoIterator<Item = (K, &'a Tensor)>,
    metadata: &[(&str, String)],
) -> Result<()> {
    let bytes: Vec<(String, Vec<u8>, Vec<usize>, DType)> = tensors
        .into_iter()
        .map(|(n, t)| {
            let n = n.as_ref().to_string();
            Ok((n, t.to_le_bytes()?, t.shape().to_vec(), t.dtype()))
        })
        .collect::<Result<_>>()?;
    let views = bytes
        .iter()
        .map(|(n, b, s, d)| {
            Ok((
                n.clone(),
                TensorView::new(st_dtype(*d), s.clone(), b)
                    .map_err(|e| Error::invalid("checkpoint::save", e.to_string()))?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let info: HashMap<String, String> = metadata
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    let buf = safetensors::serialize(views, Some(info))
        .map_err(|e| Error::invalid("checkpoint::save", e.to_string()))?;
    write_atomic(path.as_ref(), &buf)
}

/// Reads every tensor of a safetensors file, with its metadata.
pub fn read(path: impl AsRef<Path>) -> Result<(BTreeMap<String, Tensor>, HashMap<String, String>)> {
    let path = path.as_ref();
    let buf = std::fs::read(path).map_err(|e| Error::io("checkpoint::read", path, e))?;
    let bad = |e: safetensors::SafeTensorError| {
        Error::format("checkpoint::read", path, unreadable(&buf, &e))
    };
    let (_, meta) = safetensors::SafeTensors::read_metadata(&buf).map_err(bad)?;
    let st = safetensors::SafeTensors::deserialize(&buf).map_err(bad)?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let dtype = our_dtype(view.dtype()).ok_or_else(|| {
            Error::format(
                "checkpoint::read",
                path,
                format!("{name}: unsupported dtype {:?}", view.dtype()),
            )
        })?;
        let numel = crate::layout::checked_numel("checkpoint::read", view.shape())
            .map_err(|e| Error::format("checkpoint::read", path, format!("{name}: {e}")))?;
        let s = CpuStorage::from_le_bytes(view.data(), dtype)
            .filter(|s| s.len() == numel)
            .ok_or_else(|| {
                Error::format("checkpoint::read", path, format!("{name}: bad data length"))
            })?;
        out.insert(name, Tensor::from_storage(Storage::Cpu(s), view.shape()));
    }
    Ok((out, meta.metadata().clone().unwrap_or_default()))
}

/// Why `buf`, which safetensors refused with `e`, cannot be read, in a user's words: a file
/// cut short says "truncated" with the sizes, one that is no safetensors file says so.
fn unreadable(buf: &[u8], e: &safetensors::SafeTensorError) -> String {
    use safetensors::SafeTensorError as E;
    let len = buf.len();
    if buf.starts_with(b"PK\x03\x04") {
        return "not a mantissa checkpoint: a zip archive (as torch.save writes); mantissa reads \
                safetensors files"
            .into();
    }
    if len <= 8 {
        return format!(
            "truncated: {len} bytes, not even the header a safetensors file starts with"
        );
    }
    let n = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
    if buf[8] != b'{' || matches!(e, E::HeaderTooLarge) {
        return "not a mantissa checkpoint: not a safetensors file (no JSON header after its \
                first 8 bytes)"
            .into();
    }
    let header = usize::try_from(n).ok().and_then(|n| buf.get(8..8 + n));
    let Some(header) = header else {
        return format!("truncated: {len} bytes, less than its own {n}-byte header");
    };
    match e {
        E::MetadataIncompleteBuffer => match data_end(header) {
            Some(end) if 8 + header.len() + end > len => format!(
                "truncated: {len} bytes, its header describes {}",
                8 + header.len() + end
            ),
            Some(end) => format!(
                "{} bytes after the last tensor's data: not a file a safetensors writer made",
                len - 8 - header.len() - end
            ),
            None => format!("the header does not cover the file's {len} bytes ({e})"),
        },
        _ => format!("not a mantissa checkpoint: its safetensors header is malformed ({e})"),
    }
}

/// The end of the last tensor's data, as a safetensors header's `data_offsets` say.
fn data_end(header: &[u8]) -> Option<usize> {
    let text = std::str::from_utf8(header).ok()?;
    let mut end = None;
    for (at, _) in text.match_indices("\"data_offsets\"") {
        let rest = text[at + 14..].trim_start().strip_prefix(':')?.trim_start();
        let rest = rest.strip_prefix('[')?;
        let (_, second) = rest.split_once(']')?.0.split_once(',')?;
        let e: usize = second.trim().parse().ok()?;
        end = Some(end.map_or(e, |m: usize| m.max(e)));
    }
    end
}

/// Loads a checkpoint into `model` (and `optim`), checking names, shapes and dtypes first: if
/// anything does not match, nothing is changed and the error lists every problem. Returns the
/// metadata.
pub fn load(
    path: impl AsRef<Path>,
    model: &mut dyn Module,
    optim: Option<&mut dyn Optimizer>,
) -> Result<HashMap<String, String>> {
    let path = path.as_ref();
    let (mut file, meta) = read(path)?;
    if !file.is_empty() && !file.keys().any(|k| k.starts_with("model.")) {
        return Err(Error::format(
            "checkpoint::load",
            path,
            format!(
                "not a mantissa checkpoint: none of its {} tensors is a model.* entry \
                 (checkpoint::read reads any safetensors file's tensors)",
                file.len()
            ),
        ));
    }
    let mut problems = Vec::new();
    let mut targets: Vec<(String, Tensor)> = Vec::new();
    let mut generators = Vec::new();
    model.visit("", &mut |n, t, k| {
        if k == TensorKind::Generator {
            generators.push(n.clone());
        }
        targets.push((n, t.clone()))
    });
    // A checkpoint written before modules saved their generators has none: the model is
    // loaded, and those streams go on from where they stand (said once, as a warning).
    let key = |n: &str| format!("model.{n}");
    let missing: Vec<&String> = generators
        .iter()
        .filter(|n| !file.contains_key(&key(n)))
        .collect();
    if !missing.is_empty() {
        log::warn!(
            "{}: no state for the generators {missing:?}; their random streams are not \
             restored, so a resumed run draws other dropout masks than an uninterrupted one",
            path.display()
        );
    }
    targets.retain(|(n, _)| file.contains_key(&key(n)) || !generators.contains(n));
    for (n, t) in &targets {
        match file.get(&format!("model.{n}")) {
            None => problems.push(format!(
                "missing model tensor {n} {:?} {:?}",
                t.shape(),
                t.dtype()
            )),
            Some(f) if f.shape() != t.shape() || f.dtype() != t.dtype() => problems.push(format!(
                "{n}: checkpoint has {:?} {:?}, model has {:?} {:?}",
                f.shape(),
                f.dtype(),
                t.shape(),
                t.dtype()
            )),
            Some(_) => {}
        }
    }
    let known: std::collections::HashSet<String> =
        targets.iter().map(|(n, _)| format!("model.{n}")).collect();
    for k in file
        .keys()
        .filter(|k| k.starts_with("model.") && !known.contains(*k))
    {
        problems.push(format!("unexpected tensor {k} in the checkpoint"));
    }
    let optim_state: BTreeMap<String, Tensor> = file
        .iter()
        .filter_map(|(k, t)| k.strip_prefix("optim.").map(|n| (n.to_string(), t.clone())))
        .collect();
    match &optim {
        Some(_) if optim_state.is_empty() => {
            problems.push("no optimizer state in the checkpoint".into())
        }
        Some(o) => match meta.get(OPTIMIZER) {
            Some(theirs) if theirs != o.name() => problems.push(format!(
                "the optimizer state is {theirs}'s, and this optimizer is {}: make a {theirs} \
                 to resume, or load the model alone (no optimizer) to start a new one",
                o.name()
            )),
            _ => {
                if let Err(e) = o.check_state_tensors(&optim_state) {
                    problems.push(format!("optimizer state: {e}"));
                }
            }
        },
        None => {}
    }
    if !problems.is_empty() {
        return Err(Error::Checkpoint {
            path: path.display().to_string(),
            problems,
        });
    }
    // Every model tensor is moved to its device before the first write, so a failed copy
    // there (out of memory, say) also leaves the model as it was.
    let mut staged = Vec::with_capacity(targets.len());
    for (n, t) in &targets {
        match file.remove(&format!("model.{n}")) {
            Some(src) => staged.push((t, src.to_device(t.device())?)),
            None => unreachable!("every model tensor was found above"),
        }
    }
    crate::no_grad(|| -> Result<()> {
        for (t, src) in &staged {
            t.copy_(src)?;
        }
        Ok(())
    })?;
    if let Some(o) = optim {
        o.load_state_tensors(&optim_state)
            .map_err(|e| Error::Checkpoint {
                path: path.display().to_string(),
                problems: vec![e.to_string()],
            })?;
    }
    Ok(meta)
}
