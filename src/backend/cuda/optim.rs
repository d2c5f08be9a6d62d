//! The fused optimizer update on CUDA (`cuda/optim.cu`): one launch per list of up to
//! 48 parameters of one dtype combination reads their step counts and the overflow flag
//! on the device and updates parameters, states and working copies in one pass, and one more
//! counts their steps, so a step never waits for the host.
//! Constants that f32 would round (`1 - beta`, `ln beta`, AdamW's decay) are computed on the
//! host in f64 and passed in; `tests/host_kernels/optim.rs` runs the kernel on the host against the
//! CPU backend.

use super::kernels::KernelFile;
use super::profile::elems;
use super::storage::{grid, rows_grid, CudaStorage};
use crate::backend::ops::OptimUpdate;
use crate::backend::rounding::Rounding;
use crate::{DType, Error, Result};
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

/// `cuda/optim.cu`'s `OptimArgs`, field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct OptimArgs {
    kind: i32,
    flags: i32,
    stochastic: i32,
    lr: f32,
    a: f32,
    b: f32,
    eps: f32,
    wd: f32,
    ac: f32,
    bc: f32,
    log_a: f32,
    log_b: f32,
    decay: f32,
}

// SAFETY: plain old data with the C layout the kernel declares.
unsafe impl DeviceRepr for OptimArgs {}

pub(super) fn args(u: &OptimUpdate, rounding: Option<Rounding>) -> OptimArgs {
    let [lr, decay] = u.lr_words();
    let stochastic = matches!(rounding, Some(Rounding::Stochastic { .. })) as i32;
    let base = OptimArgs {
        kind: 0,
        flags: 0,
        stochastic,
        lr: 0.0,
        a: 0.0,
        b: 0.0,
        eps: 0.0,
        wd: 0.0,
        ac: 0.0,
        bc: 0.0,
        log_a: 0.0,
        log_b: 0.0,
        decay: 1.0,
    };
    // The complements, logarithms and AdamW's decay in f64, as the CPU's rules have them.
    let with = |a: f64, b: f64, args: OptimArgs| OptimArgs {
        a: a as f32,
        b: b as f32,
        ac: (1.0 - a) as f32,
        bc: (1.0 - b) as f32,
        log_a: a.ln() as f32,
        log_b: b.ln() as f32,
        ..args
    };
    match *u {
        OptimUpdate::Sgd {
            lr: _,
            momentum,
            dampening,
            weight_decay,
            nesterov,
        } => with(
            momentum,
            dampening,
            OptimArgs {
                flags: nesterov as i32 | if momentum != 0.0 { 4 } else { 0 },
                lr,
                wd: weight_decay as f32,
                ..base
            },
        ),
        OptimUpdate::Adam {
            lr: _,
            beta1,
            beta2,
            eps,
            weight_decay,
            decoupled,
        } => with(
            beta1,
            beta2,
            OptimArgs {
                kind: 1,
                flags: if decoupled { 2 } else { 0 },
                lr,
                eps: eps as f32,
                wd: weight_decay as f32,
                decay,
                ..base
            },
        ),
        OptimUpdate::Adadelta {
            lr: _,
            rho,
            eps,
            weight_decay,
        } => with(
            rho,
            0.0,
            OptimArgs {
                kind: 2,
                lr,
                eps: eps as f32,
                wd: weight_decay as f32,
                ..base
            },
        ),
        OptimUpdate::RmsProp {
            lr: _,
            alpha,
            eps,
            weight_decay,
            momentum,
            centered,
        } => with(
            alpha,
            momentum,
            OptimArgs {
                kind: 3,
                flags: if momentum != 0.0 { 4 } else { 0 } | if centered { 8 } else { 0 },
                lr,
                eps: eps as f32,
                wd: weight_decay as f32,
                ..base
            },
        ),
        OptimUpdate::Adagrad {
            lr: _,
            lr_decay,
            eps,
            weight_decay,
        } => OptimArgs {
            kind: 4,
            lr,
            b: lr_decay as f32,
            eps: eps as f32,
            wd: weight_decay as f32,
            ..base
        },
    }
}

/// The kernel for (parameter, gradient, working copy) dtypes; `None` where `optim.cu` has
/// none (the caller then updates on host copies).
pub(super) fn kernel(p: DType, g: DType, w: Option<DType>) -> Option<&'static str> {
    use DType::*;
    Some(match (p, g, w) {
        (F32, F32, None) => "optim_float_float",
        (F16, F16, None) => "optim_f16_f16",
        (BF16, BF16, None) => "optim_bf16_bf16",
        (F32, F16, Some(F16)) => "optim_master_f16_f16",
        (F32, F32, Some(F16)) => "optim_master_float_f16",
        (F32, BF16, Some(BF16)) => "optim_master_bf16_bf16",
        (F32, F32, Some(BF16)) => "optim_master_float_bf16",
        _ => return None,
    })
}

fn one_f32(what: &str, s: &CudaStorage) -> Result<()> {
    if s.dtype() != DType::F32 || s.len() != 1 {
        return Err(Error::invalid(
            "optimizer step",
            format!("{what} must be a one-element F32 tensor"),
        ));
    }
    Ok(())
}

/// Tensors per launch of the list kernels (`OPTIM_LIST` in `cuda/optim.cu`).
pub(super) const LIST: usize = 48;
/// Elements per block-sized chunk of a listed tensor (`OPTIM_CHUNK`).
pub(super) const CHUNK: usize = 16384;

/// `cuda/optim.cu`'s `OptimList`, field for field: device addresses of each tensor's element
/// 0 (0 for none), its length and the first of its chunks. With `OptimArgs` and two pointers,
/// 3,928 bytes: within the 4 KB of kernel parameters every CUDA version takes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct OptimList {
    pub(super) count: i64,
    chunks: i64,
    p: [u64; LIST],
    g: [u64; LIST],
    s0: [u64; LIST],
    s1: [u64; LIST],
    s2: [u64; LIST],
    w: [u64; LIST],
    step: [u64; LIST],
    n: [i64; LIST],
    start: [i64; LIST],
    seed: [u64; LIST],
}

// SAFETY: plain old data with the C layout the kernel declares.
unsafe impl DeviceRepr for OptimList {}

// The update kernels take the arguments, the list and two pointers: within the 4,096 bytes
// of parameters a launch may pass on every CUDA version (the emulated driver refuses more).
const _: () =
    assert!(std::mem::size_of::<OptimArgs>() + std::mem::size_of::<OptimList>() + 16 <= 4096);

/// One tensor's operands for [`OptimList`]: addresses of parameter, gradient, up to three states, working
/// copy and step count (0 for an absent state or working copy), its length and its stochastic
/// rounding seed.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct ListEntry {
    pub(super) p: u64,
    pub(super) g: u64,
    pub(super) s0: u64,
    pub(super) s1: u64,
    pub(super) s2: u64,
    pub(super) w: u64,
    pub(super) step: u64,
    pub(super) n: usize,
    pub(super) seed: u64,
}

/// The entries in lists of at most [`LIST`] tensors, in order.
pub(super) fn lists(entries: &[ListEntry]) -> Vec<OptimList> {
    entries
        .chunks(LIST)
        .map(|part| {
            let mut l = OptimList {
                count: part.len() as i64,
                chunks: 0,
                p: [0; LIST],
                g: [0; LIST],
                s0: [0; LIST],
                s1: [0; LIST],
                s2: [0; LIST],
                w: [0; LIST],
                step: [0; LIST],
                n: [0; LIST],
                start: [0; LIST],
                seed: [0; LIST],
            };
            for (k, e) in part.iter().enumerate() {
                (l.p[k], l.g[k], l.w[k]) = (e.p, e.g, e.w);
                (l.s0[k], l.s1[k], l.s2[k]) = (e.s0, e.s1, e.s2);
                (l.step[k], l.n[k], l.seed[k]) = (e.step, e.n as i64, e.seed);
                l.start[k] = l.chunks;
                l.chunks += e.n.div_ceil(CHUNK) as i64;
            }
            l
        })
        .collect()
}

type OptimItem<'a> = crate::backend::optim::OptimItem<'a, CudaStorage>;

/// Checks one item against the update and returns its kernel (`None`: no kernel covers its
/// dtypes) and list entry.
fn entry(it: &OptimItem<'_>, u: &OptimUpdate) -> Result<Option<(&'static str, bool, ListEntry)>> {
    let (p, g) = (&*it.param, &it.grad);
    let Some(name) = kernel(
        p.dtype(),
        g.storage.dtype(),
        it.working.as_ref().map(|(w, _)| w.dtype()),
    ) else {
        return Ok(None);
    };
    let (stochastic, seed) = match &it.working {
        Some((w, Rounding::Stochastic { seed })) => {
            if w.dtype() != DType::BF16 {
                return Err(Error::invalid(
                    "optimizer step",
                    format!(
                        "a {:?} working copy cannot be written with stochastic rounding (bf16 only)",
                        w.dtype()
                    ),
                ));
            }
            (true, *seed)
        }
        _ => (false, 0),
    };
    one_f32("the step count", it.step)?;
    let n = p.len();
    let lens_ok = g.len() == n
        && it.states.len() == u.num_states()
        && it
            .states
            .iter()
            .all(|s| s.len() == n && s.dtype() == p.dtype())
        && it.working.as_ref().is_none_or(|(w, _)| w.len() == n);
    if !lens_ok {
        return Err(Error::invalid(
            "optimizer step",
            format!(
                "parameter of {n} {:?} elements, gradient of {} {:?}, states {:?}: lengths or \
                 dtypes disagree",
                p.dtype(),
                g.len(),
                g.storage.dtype(),
                it.states
                    .iter()
                    .map(|s| (s.len(), s.dtype()))
                    .collect::<Vec<_>>()
            ),
        ));
    }
    let state = |i: usize| it.states.get(i).map_or(0, |s| s.ptr());
    let e = ListEntry {
        p: p.ptr(),
        // The gradient's range may start inside its storage (a data-parallel bucket).
        g: g.storage.ptr_at(g.range.start),
        s0: state(0),
        s1: state(1),
        s2: state(2),
        w: it.working.as_ref().map_or(0, |(w, _)| w.ptr()),
        step: it.step.ptr(),
        n,
        seed,
    };
    Ok(Some((name, stochastic, e)))
}

/// Applies `u` in place to every item (see `cpu::optim_update` for the contract of one):
/// the items the fused kernels cover in one launch per kernel and list of [`LIST`] tensors,
/// then one launch counting their steps; every item is checked before anything runs. Returns
/// the indices of the items no kernel covers, untouched, for the caller to update elsewhere.
pub(crate) fn optim_update_many(
    items: &[OptimItem<'_>],
    found_inf: Option<&CudaStorage>,
    u: &OptimUpdate,
) -> Result<Vec<usize>> {
    if let Some(f) = found_inf {
        one_f32("found_inf", f)?;
    }
    let mut rest = Vec::new();
    // (kernel, stochastic rounding) -> entries, in the order the items come.
    let mut groups: Vec<((&'static str, bool), Vec<ListEntry>)> = Vec::new();
    for (i, it) in items.iter().enumerate() {
        match entry(it, u)? {
            None => rest.push(i),
            Some((name, sr, e)) => match groups.iter_mut().find(|(k, _)| *k == (name, sr)) {
                Some((_, v)) => v.push(e),
                None => groups.push(((name, sr), vec![e])),
            },
        }
    }
    let Some(first) = items.first() else {
        return Ok(rest);
    };
    let s = &*first.param;
    let fp = found_inf.map_or(0u64, |f| f.ptr());
    // In a captured step the learning rate is read from the replay's prologue.
    let hyper = crate::capture::hyper();
    for ((name, sr), entries) in groups {
        let a = args(u, sr.then_some(Rounding::Stochastic { seed: 0 }));
        for (list, part) in lists(&entries).iter().zip(entries.chunks(LIST)) {
            // Parameter and states read and written, gradient read, working copy written
            // (counted in the parameter's dtype: an estimate for the profile).
            let states = u.num_states() as u64;
            let bytes: u64 = part
                .iter()
                .map(|e| {
                    let planes = 3 + 2 * states + u64::from(e.w != 0);
                    planes * elems(e.n, s.dtype())
                })
                .sum();
            // A block of 256 threads per chunk (the kernel strides past 65,535).
            let cfg = rows_grid(list.chunks as usize);
            launch!(bytes = bytes; s, KernelFile::Optim, name, cfg, &a, list, &fp, &hyper);
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (LIST as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(s, KernelFile::Optim, "optim_count", cfg, list, &fp);
        }
    }
    Ok(rest)
}

/// Writes the f32 `master` into the f16/bf16 working copy `w` with `rounding`, drawing the
/// stochastic bits of the last update counted in `step`.
pub(crate) fn round_from_master(
    w: &mut CudaStorage,
    master: &CudaStorage,
    rounding: Rounding,
    step: &CudaStorage,
) -> Result<bool> {
    one_f32("the step count", step)?;
    if master.dtype() != DType::F32 || master.len() != w.len() {
        return Err(Error::invalid(
            "round_from_master",
            format!(
                "master of {} {:?} elements for a working copy of {} {:?}",
                master.len(),
                master.dtype(),
                w.len(),
                w.dtype()
            ),
        ));
    }
    let n = w.len();
    let (mp, wp, sp, n64) = (master.ptr(), w.ptr(), step.ptr(), n as i64);
    match (w.dtype(), rounding) {
        (DType::F16, Rounding::Nearest) => {
            launch!(
                w,
                KernelFile::Optim,
                "round_master_f16",
                grid(n),
                &mp,
                &wp,
                &n64
            );
        }
        (DType::BF16, r) => {
            let (stochastic, seed) = match r {
                Rounding::Stochastic { seed } => (1i32, seed),
                Rounding::Nearest => (0, 0),
            };
            launch!(
                w,
                KernelFile::Optim,
                "round_master_bf16",
                grid(n),
                &mp,
                &wp,
                &stochastic,
                &seed,
                &sp,
                &n64
            );
        }
        _ => return Ok(false),
    }
    Ok(true)
}
