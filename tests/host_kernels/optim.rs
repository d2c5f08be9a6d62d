//! The fused optimizer kernel, every update kind and dtype combination, against the CPU's
//! update, for two steps (the second reads the step count and states the first wrote).

use super::{function, library, randn};
use crate::backend::cuda::optim::{args, kernel, OptimArgs};
use crate::backend::ops::OptimUpdate;
use crate::backend::rounding::Rounding;
use crate::backend::Storage;
use crate::{DType, Tensor};
use std::ffi::c_void;

type Update = unsafe extern "C" fn(
    OptimArgs,
    *mut c_void,
    *const c_void,
    *mut c_void,
    *mut c_void,
    *mut c_void,
    *const f32,
    *const f32,
    i64,
) -> ();
type Count = unsafe extern "C" fn(*mut f32, *const f32) -> ();

/// A tensor's storage, for the CPU update to write in place.
fn storage(t: &Tensor) -> Storage {
    t.storage().try_clone().unwrap()
}

/// The raw elements of a CPU storage, as the kernel reads them.
fn ptr(s: &mut Storage) -> *mut c_void {
    use crate::backend::cpu::CpuStorage::*;
    match s.as_cpu_mut().unwrap() {
        F32(v) => v.as_mut_ptr().cast(),
        F16(v) => v.as_mut_ptr().cast(),
        BF16(v) => v.as_mut_ptr().cast(),
        _ => unreachable!("float storages"),
    }
}

fn values(s: &Storage) -> Vec<f64> {
    let n = s.len();
    Tensor::from_storage(s.try_clone().unwrap(), &[n])
        .to_vec_f64()
        .unwrap()
}

#[test]
fn optimizer_kernel_matches_the_cpu_update() {
    let Some(lib) = library("optim") else { return };
    let updates = [
        OptimUpdate::Sgd {
            lr: 0.1,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        },
        OptimUpdate::Sgd {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.1,
            weight_decay: 0.01,
            nesterov: false,
        },
        OptimUpdate::Sgd {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: true,
        },
        OptimUpdate::Adam {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            decoupled: false,
        },
        OptimUpdate::Adam {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            decoupled: true,
        },
        OptimUpdate::Adadelta {
            lr: 1.0,
            rho: 0.9,
            eps: 1e-6,
            weight_decay: 0.0,
        },
    ];
    use DType::*;
    // (parameter, gradient, working copy and its rounding)
    let combos = [
        (F32, F32, None),
        (BF16, BF16, None),
        (F16, F16, None),
        (F32, F16, Some((F16, Rounding::Nearest))),
        (F32, BF16, Some((BF16, Rounding::Stochastic { seed: 11 }))),
        (F32, F32, Some((BF16, Rounding::Nearest))),
    ];
    let n = 45;
    for u in &updates {
        for &(pd, gd, work) in &combos {
            let what = format!("{u:?} {pd:?}/{gd:?}/{work:?}");
            let name = kernel(pd, gd, work.map(|w| w.0)).expect("a kernel");
            let f: Update = function(lib, name);
            let count: Count = function(lib, "optim_count");
            let p0 = randn(&[n], 20).to_dtype(pd).unwrap();
            // Two copies of everything: the CPU's and the kernel's.
            let mk = |t: &Tensor| (storage(t), storage(t));
            let (mut pc, mut pk) = mk(&p0);
            let zeros = Tensor::zeros(&[n], pd, crate::Device::Cpu).unwrap();
            let mut sc: Vec<Storage> = (0..u.num_states()).map(|_| storage(&zeros)).collect();
            let mut sk: Vec<Storage> = (0..u.num_states()).map(|_| storage(&zeros)).collect();
            let w0 = work.map(|(d, _)| p0.to_dtype(d).unwrap());
            let (mut wc, mut wk) = match &w0 {
                Some(w) => (Some(storage(w)), Some(storage(w))),
                None => (None, None),
            };
            let steps = Tensor::zeros(&[1], F32, crate::Device::Cpu).unwrap();
            let (mut tc, mut tk) = mk(&steps);
            for step in 0..2 {
                let g = randn(&[n], 21 + step).to_dtype(gd).unwrap();
                let gs = storage(&g);
                let mut refs: Vec<&mut Storage> = sc.iter_mut().collect();
                let working = wc.as_mut().zip(work).map(|(w, (_, r))| (w, r));
                pc.optim_update(&gs, &mut refs, &mut tc, None, u, working)
                    .unwrap();
                let a = args(u, work.map(|w| w.1));
                let mut gk = storage(&g);
                let null = std::ptr::null_mut();
                let s0 = sk.get_mut(0).map_or(null, ptr);
                let s1 = sk.get_mut(1).map_or(null, ptr);
                let w = wk.as_mut().map_or(null, ptr);
                let t = ptr(&mut tk).cast::<f32>();
                // SAFETY: every buffer holds n elements of the kernel's types; the step count
                // one f32; no overflow flag.
                unsafe {
                    f(
                        a,
                        ptr(&mut pk),
                        ptr(&mut gk),
                        s0,
                        s1,
                        w,
                        t,
                        std::ptr::null(),
                        n as i64,
                    );
                    count(t, std::ptr::null());
                }
            }
            let tol = if pd == F32 { 1e-6 } else { 1e-3 };
            let close = |a: &Storage, b: &Storage, part: &str| {
                let (x, y) = (values(a), values(b));
                let num: f64 = x.iter().zip(&y).map(|(a, b)| (a - b) * (a - b)).sum();
                let den: f64 = y.iter().map(|b| b * b).sum::<f64>().max(1e-30);
                assert!((num / den).sqrt() <= tol, "{what} {part}: {x:?} vs {y:?}");
            };
            close(&pk, &pc, "parameter");
            for (i, (a, b)) in sk.iter().zip(&sc).enumerate() {
                close(a, b, &format!("state {i}"));
            }
            if let (Some(a), Some(b)) = (&wk, &wc) {
                close(a, b, "working copy");
            }
            assert_eq!(values(&tk), values(&tc), "{what} step count");
        }
    }
}

#[test]
fn working_copy_rounding_kernels_match_the_cpu() {
    let Some(lib) = library("optim") else { return };
    type F16 = unsafe extern "C" fn(*const f32, *mut c_void, i64) -> ();
    type BF16 = unsafe extern "C" fn(*const f32, *mut c_void, i32, u64, *const f32, i64) -> ();
    let n = 29;
    let master = randn(&[n], 40);
    let ms = master.to_vec::<f32>().unwrap();
    let step = Tensor::full(&[1], 3.0, DType::F32, crate::Device::Cpu).unwrap();
    for (dtype, rounding) in [
        (DType::F16, Rounding::Nearest),
        (DType::BF16, Rounding::Nearest),
        (DType::BF16, Rounding::Stochastic { seed: 5 }),
    ] {
        let zeros = Tensor::zeros(&[n], dtype, crate::Device::Cpu).unwrap();
        let (mut want, mut got) = (storage(&zeros), storage(&zeros));
        want.round_from_master(&storage(&master), rounding, &storage(&step))
            .unwrap();
        let steps = [3.0f32];
        // SAFETY: the master holds n f32s, the working copy n halves, the step one f32.
        unsafe {
            match (dtype, rounding) {
                (DType::F16, _) => {
                    let f: F16 = function(lib, "round_master_f16");
                    f(ms.as_ptr(), ptr(&mut got), n as i64);
                }
                (_, r) => {
                    let (sr, seed) = match r {
                        Rounding::Stochastic { seed } => (1, seed),
                        Rounding::Nearest => (0, 0),
                    };
                    let f: BF16 = function(lib, "round_master_bf16");
                    f(
                        ms.as_ptr(),
                        ptr(&mut got),
                        sr,
                        seed,
                        steps.as_ptr(),
                        n as i64,
                    );
                }
            }
        }
        assert_eq!(values(&got), values(&want), "{dtype:?} {rounding:?}");
    }
}
