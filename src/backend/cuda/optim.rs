//! The fused optimizer update on CUDA (`cuda/optim.cu`): one kernel per parameter reads the
//! step count and the overflow flag on the device, updates parameter, states and working copy
//! in one pass, and a one-thread kernel counts the step, so a step never waits for the host.
//! Constants that f32 would round (`1 - beta`, `ln beta`, AdamW's decay) are computed on the
//! host in f64 and passed in; `tests/host_kernels/optim.rs` runs the kernel on the host against the
//! CPU backend.

use super::kernels::KernelFile;
use super::profile::elems;
use super::storage::{grid, one_thread, CudaStorage};
use crate::backend::ops::OptimUpdate;
use crate::backend::rounding::Rounding;
use crate::{DType, Error, Result};
use cudarc::driver::{DeviceRepr, PushKernelArg};

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
    seed: u64,
}

// SAFETY: plain old data with the C layout the kernel declares.
unsafe impl DeviceRepr for OptimArgs {}

pub(super) fn args(u: &OptimUpdate, rounding: Option<Rounding>) -> OptimArgs {
    let (stochastic, seed) = match rounding {
        Some(Rounding::Stochastic { seed }) => (1, seed),
        _ => (0, 0),
    };
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
        seed,
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
            lr,
            momentum,
            dampening,
            weight_decay,
            nesterov,
        } => with(
            momentum,
            dampening,
            OptimArgs {
                flags: nesterov as i32 | if momentum != 0.0 { 4 } else { 0 },
                lr: lr as f32,
                wd: weight_decay as f32,
                ..base
            },
        ),
        OptimUpdate::Adam {
            lr,
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
                lr: lr as f32,
                eps: eps as f32,
                wd: weight_decay as f32,
                decay: (1.0 - lr * weight_decay) as f32,
                ..base
            },
        ),
        OptimUpdate::Adadelta {
            lr,
            rho,
            eps,
            weight_decay,
        } => with(
            rho,
            0.0,
            OptimArgs {
                kind: 2,
                lr: lr as f32,
                eps: eps as f32,
                wd: weight_decay as f32,
                ..base
            },
        ),
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

/// Applies `u` in place (see `cpu::optim_update` for the contract). Returns `Ok(false)`,
/// touching nothing, when no kernel covers the dtypes.
pub(crate) fn optim_update(
    p: &mut CudaStorage,
    g: &CudaStorage,
    states: &mut [&mut CudaStorage],
    step: &mut CudaStorage,
    found_inf: Option<&CudaStorage>,
    u: &OptimUpdate,
    working: Option<(&mut CudaStorage, Rounding)>,
) -> Result<bool> {
    let rounding = working.as_ref().map(|(_, r)| *r);
    let Some(name) = kernel(
        p.dtype(),
        g.dtype(),
        working.as_ref().map(|(w, _)| w.dtype()),
    ) else {
        return Ok(false);
    };
    if let Some((w, Rounding::Stochastic { .. })) = &working {
        if w.dtype() != DType::BF16 {
            return Err(Error::invalid(
                "optimizer step",
                format!(
                    "a {:?} working copy cannot be written with stochastic rounding (bf16 only)",
                    w.dtype()
                ),
            ));
        }
    }
    one_f32("the step count", step)?;
    if let Some(f) = found_inf {
        one_f32("found_inf", f)?;
    }
    let n = p.len();
    let lens_ok = g.len() == n
        && states.len() == u.num_states()
        && states
            .iter()
            .all(|s| s.len() == n && s.dtype() == p.dtype())
        && working.as_ref().is_none_or(|(w, _)| w.len() == n);
    if !lens_ok {
        return Err(Error::invalid(
            "optimizer step",
            format!(
                "parameter of {n} {:?} elements, gradient of {} {:?}, states {:?}: lengths or \
                 dtypes disagree",
                p.dtype(),
                g.len(),
                g.dtype(),
                states
                    .iter()
                    .map(|s| (s.len(), s.dtype()))
                    .collect::<Vec<_>>()
            ),
        ));
    }
    let a = args(u, rounding);
    let null = 0u64;
    let ptr = |i: usize| states.get(i).map_or(null, |s| s.ptr());
    let (s0, s1) = (ptr(0), ptr(1));
    let w = working.as_ref().map_or(null, |(w, _)| w.ptr());
    let (pp, gp, sp) = (p.ptr(), g.ptr(), step.ptr());
    let fp = found_inf.map_or(null, |f| f.ptr());
    let n64 = n as i64;
    // The parameter and each state read and written, the gradient read, the working copy
    // written.
    let bytes = 2 * (1 + states.len() as u64) * elems(n, p.dtype())
        + elems(n, g.dtype())
        + working.as_ref().map_or(0, |(w, _)| elems(n, w.dtype()));
    launch!(
        bytes = bytes;
        p,
        KernelFile::Optim,
        name.to_string(),
        grid(n),
        &a,
        &pp,
        &gp,
        &s0,
        &s1,
        &w,
        &sp,
        &fp,
        &n64
    );
    launch!(
        p,
        KernelFile::Optim,
        "optim_count".to_string(),
        one_thread(),
        &sp,
        &fp
    );
    Ok(true)
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
                "round_master_f16".to_string(),
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
                "round_master_bf16".to_string(),
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
