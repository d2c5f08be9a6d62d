//! `state_dict` and `load_state_dict` as PyTorch has them: parameters and buffers by their
//! dotted names (`0.weight`, `bn.running_mean`), so weights move between the two (through
//! safetensors: [`crate::checkpoint::write_tensors`] and [`crate::checkpoint::read`]).

use super::{Module, TensorKind};
use crate::{Error, Result, Tensor};
use std::collections::BTreeMap;

/// What [`Module::load_state_dict`] left aside without `strict`: the module's tensors the
/// state did not have, and the state's entries the module has no tensor for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadReport {
    pub missing: Vec<String>,
    pub unexpected: Vec<String>,
}

/// The module's parameters and buffers, detached, by name (generator states are not part
/// of PyTorch's `state_dict`; checkpoints keep them).
pub(super) fn state_dict(m: &(impl Module + ?Sized)) -> BTreeMap<String, Tensor> {
    let mut out = BTreeMap::new();
    m.visit("", &mut |n, t, k| {
        if k != TensorKind::Generator {
            out.insert(n, t.detach());
        }
    });
    out
}

/// Copies `state` into the module's tensors (converted to each one's dtype and device);
/// every problem is found before anything is written, so a refused state changes nothing.
pub(super) fn load_state_dict(
    m: &mut (impl Module + ?Sized),
    state: &BTreeMap<String, Tensor>,
    strict: bool,
) -> Result<LoadReport> {
    let mut report = LoadReport::default();
    let mut problems = Vec::new();
    let mut staged: Vec<(Tensor, Tensor)> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    m.visit("", &mut |n, t, k| {
        if k == TensorKind::Generator {
            return;
        }
        match state.get(&n) {
            None => report.missing.push(n.clone()),
            Some(s) if s.shape() != t.shape() => problems.push(format!(
                "{n}: the state has shape {:?}, the module {:?}",
                s.shape(),
                t.shape()
            )),
            Some(s) => match unconvertible(s, t.dtype()) {
                Some(why) => problems.push(format!("{n}: {why}")),
                None => staged.push((t.clone(), s.clone())),
            },
        }
        seen.insert(n);
    });
    report.unexpected = state
        .keys()
        .filter(|k| !seen.contains(*k))
        .cloned()
        .collect();
    if strict {
        problems.extend(report.missing.iter().map(|n| format!("missing {n}")));
        problems.extend(report.unexpected.iter().map(|n| format!("unexpected {n}")));
    }
    if !problems.is_empty() {
        return Err(Error::invalid("load_state_dict", problems.join("; ")));
    }
    // Moved to each tensor's device first: a failed copy there leaves the module as it was.
    let moved = staged
        .into_iter()
        .map(|(t, s)| Ok((s.to_device(t.device())?.to_dtype(t.dtype())?, t)))
        .collect::<Result<Vec<_>>>()?;
    crate::no_grad(|| moved.iter().try_for_each(|(s, t)| t.copy_(s)))?;
    Ok(report)
}

/// Why the state entry `s` cannot become a tensor of `dtype` unchanged in value (a float
/// into an integer tensor must hold whole numbers in its range: a float
/// `num_batches_tracked` converts, 2.5 or NaN does not), or `None`. Float to float rounds,
/// as PyTorch's `copy_`.
fn unconvertible(s: &Tensor, dtype: crate::DType) -> Option<String> {
    use crate::DType;
    let widening = s.dtype() == dtype || (s.dtype() == DType::U8 && dtype == DType::I64);
    if dtype.is_float() || widening {
        return None;
    }
    let (lo, hi) = match dtype {
        DType::U8 => (0.0, 255.0),
        _ => (i64::MIN as f64, i64::MAX as f64),
    };
    let values = match s.to_vec_f64() {
        Ok(v) => v,
        Err(e) => return Some(format!("its values could not be read: {e}")),
    };
    let bad = values
        .iter()
        .find(|v| !(v.fract() == 0.0 && (lo..=hi).contains(*v)))?;
    Some(format!(
        "the state is {:?} holding {bad}, which the module's {dtype:?} cannot hold",
        s.dtype()
    ))
}
