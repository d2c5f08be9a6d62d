//! The fused optimizer kernel, every update kind and dtype combination, against the CPU's
//! update, for two steps (the second reads the step count and states the first wrote), on a
//! list of two tensors, one of several chunks.

use super::{function, library, randn, run_grid};
use crate::backend::cuda::optim::{args, kernel, lists, ListEntry, OptimArgs, OptimList, CHUNK};
use crate::backend::ops::OptimUpdate;
use crate::backend::optim::OptimItem;
use crate::backend::rounding::Rounding;
use crate::backend::{Span, Storage};
use crate::{DType, Tensor};
use std::ffi::c_void;

type Update = unsafe extern "C" fn(OptimArgs, OptimList, *const f32, *const f32) -> ();
type Count = unsafe extern "C" fn(OptimList, *const f32) -> ();

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
        OptimUpdate::RmsProp {
            lr: 1e-2,
            alpha: 0.99,
            eps: 1e-8,
            weight_decay: 0.0,
            momentum: 0.0,
            centered: false,
        },
        OptimUpdate::RmsProp {
            lr: 1e-2,
            alpha: 0.9,
            eps: 1e-6,
            weight_decay: 0.01,
            momentum: 0.8,
            centered: false,
        },
        OptimUpdate::RmsProp {
            lr: 1e-2,
            alpha: 0.9,
            eps: 1e-6,
            weight_decay: 0.01,
            momentum: 0.8,
            centered: true,
        },
        OptimUpdate::RmsProp {
            lr: 1e-2,
            alpha: 0.9,
            eps: 1e-6,
            weight_decay: 0.0,
            momentum: 0.0,
            centered: true,
        },
        OptimUpdate::Adagrad {
            lr: 1e-2,
            lr_decay: 0.1,
            eps: 1e-10,
            weight_decay: 0.01,
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
    // Two tensors in one list: one short, one over two chunks.
    let sizes = [45, CHUNK + 7];
    for u in &updates {
        for &(pd, gd, work) in &combos {
            let what = format!("{u:?} {pd:?}/{gd:?}/{work:?}");
            let name = kernel(pd, gd, work.map(|w| w.0)).expect("a kernel");
            let f: Update = function(lib, name);
            let count: Count = function(lib, "optim_count");
            // Per tensor, two copies of everything: the CPU's and the kernel's.
            let mut t: Vec<Operands> = sizes
                .iter()
                .enumerate()
                .map(|(k, &n)| Operands::new(n, 20 + k as u64, pd, u.num_states(), work))
                .collect();
            for step in 0..2 {
                let grads: Vec<Tensor> = sizes
                    .iter()
                    .enumerate()
                    .map(|(k, &n)| randn(&[n], 30 + 2 * k as u64 + step).to_dtype(gd).unwrap())
                    .collect();
                let gs: Vec<Storage> = grads.iter().map(storage).collect();
                let items: Vec<OptimItem<'_, Storage>> = t
                    .iter_mut()
                    .zip(&gs)
                    .map(|(o, g)| OptimItem {
                        param: &mut o.pc,
                        grad: Span::whole(g, g.len()),
                        states: o.sc.iter_mut().collect(),
                        step: &mut o.tc,
                        working: o.wc.as_mut().zip(work).map(|(w, (_, r))| (w, r)),
                    })
                    .collect();
                Storage::optim_update_many(items, None, u).unwrap();
                let mut gk: Vec<Storage> = grads.iter().map(storage).collect();
                let entries: Vec<ListEntry> = t
                    .iter_mut()
                    .zip(&mut gk)
                    .map(|(o, g)| o.entry(g, work))
                    .collect();
                let list = lists(&entries)[0];
                let a = args(u, work.map(|w| w.1));
                // SAFETY: every listed buffer holds its tensor's n elements of the kernel's
                // types, each step count one f32; no overflow flag. Called directly the update
                // runs as one thread over every chunk; the count needs a thread per tensor.
                // The second step reads the learning rate from memory, as a CUDA graph's
                // replay has it, over arguments that carry another.
                let hyper = u.lr_words();
                let (a, hp) = match step {
                    0 => (a, std::ptr::null()),
                    _ => (args(&u.with_lr(9.0), work.map(|w| w.1)), hyper.as_ptr()),
                };
                unsafe { f(a, list, std::ptr::null(), hp) };
                run_grid(lib, 1, 64, || unsafe { count(list, std::ptr::null()) });
            }
            let tol = if pd == F32 { 1e-6 } else { 1e-3 };
            let close = |a: &Storage, b: &Storage, part: &str| {
                let (x, y) = (values(a), values(b));
                let num: f64 = x.iter().zip(&y).map(|(a, b)| (a - b) * (a - b)).sum();
                let den: f64 = y.iter().map(|b| b * b).sum::<f64>().max(1e-30);
                assert!((num / den).sqrt() <= tol, "{what} {part}: {x:?} vs {y:?}");
            };
            for (k, o) in t.iter().enumerate() {
                close(&o.pk, &o.pc, &format!("tensor {k} parameter"));
                for (i, (a, b)) in o.sk.iter().zip(&o.sc).enumerate() {
                    close(a, b, &format!("tensor {k} state {i}"));
                }
                if let (Some(a), Some(b)) = (&o.wk, &o.wc) {
                    close(a, b, &format!("tensor {k} working copy"));
                }
                assert_eq!(values(&o.tk), values(&o.tc), "{what} tensor {k} step count");
                assert_eq!(values(&o.tk), vec![2.0], "{what} tensor {k} counted twice");
            }
        }
    }
}

/// One tensor's operands, the CPU's (`*c`) and the kernel's (`*k`).
struct Operands {
    pc: Storage,
    pk: Storage,
    sc: Vec<Storage>,
    sk: Vec<Storage>,
    wc: Option<Storage>,
    wk: Option<Storage>,
    tc: Storage,
    tk: Storage,
}

impl Operands {
    fn new(n: usize, seed: u64, pd: DType, states: usize, work: Option<(DType, Rounding)>) -> Self {
        let p0 = randn(&[n], seed).to_dtype(pd).unwrap();
        let zeros = Tensor::zeros(&[n], pd, crate::Device::Cpu).unwrap();
        let w0 = work.map(|(d, _)| p0.to_dtype(d).unwrap());
        let steps = Tensor::zeros(&[1], DType::F32, crate::Device::Cpu).unwrap();
        Operands {
            pc: storage(&p0),
            pk: storage(&p0),
            sc: (0..states).map(|_| storage(&zeros)).collect(),
            sk: (0..states).map(|_| storage(&zeros)).collect(),
            wc: w0.as_ref().map(storage),
            wk: w0.as_ref().map(storage),
            tc: storage(&steps),
            tk: storage(&steps),
        }
    }

    /// The kernel's copies as a list entry, with gradient `g`.
    fn entry(&mut self, g: &mut Storage, work: Option<(DType, Rounding)>) -> ListEntry {
        let state = |s: Option<&mut Storage>| s.map_or(0, |s| ptr(s) as u64);
        let seed = match work {
            Some((_, Rounding::Stochastic { seed })) => seed,
            _ => 0,
        };
        ListEntry {
            p: ptr(&mut self.pk) as u64,
            g: ptr(g) as u64,
            s0: state(self.sk.get_mut(0)),
            s1: state(self.sk.get_mut(1)),
            s2: state(self.sk.get_mut(2)),
            w: state(self.wk.as_mut()),
            step: ptr(&mut self.tk) as u64,
            n: self.pk.len(),
            seed,
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
