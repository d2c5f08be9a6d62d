//! cuBLASLt's GELU and bias-gradient epilogues (`set_gemm_epilogues`): a transformer MLP,
//! `mlp_gelu_tanh`, in two products forward (bias + GELU with the pre-activation kept, then
//! bias) and four backward (`BGRADB` for the second layer's weight and bias, `DGELU_BGRAD` for
//! the pre-activation's gradient and the first bias's, then the first layer's two products),
//! and a Linear's bias gradient from its weight gradient's product. Each is compared with the
//! f32 composition of the same rounded inputs on the CPU, the profiler shows which products
//! ran, and a hidden width cuBLASLt's aux matrix does not allow (not a multiple of 8) falls
//! back to the composed ops. On the emulated device in CI (tests/emulator/blas.cpp implements
//! the epilogues); without a CUDA device each test prints `skipped: no CUDA device` and
//! passes.
#![cfg(feature = "cuda-backend")]

mod common;
use common::parity::{band, gpu, input, FLOATS};
use common::{assert_close, vals};
use mantissa::profiler;
use mantissa::*;

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Holds the lock with the epilogues set to `on`; turns them off again when dropped.
struct Epilogues(#[allow(dead_code)] std::sync::MutexGuard<'static, ()>);

impl Epilogues {
    fn set(on: bool) -> Epilogues {
        let guard = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        set_gemm_epilogues(on);
        Epilogues(guard)
    }
}

impl Drop for Epilogues {
    fn drop(&mut self) {
        set_gemm_epilogues(false);
    }
}

/// An MLP's operands `[x, fc_w, fc_b, proj_w, proj_b, g]` for `x [2, 5, c]`, `hidden`
/// features, in `dt`, each passed through `to`; all but `g` (the loss's weights) require
/// grad. Weights scaled to keep the activations near 1 (GELU's curved part).
fn operands(dt: DType, c: usize, hidden: usize, to: impl Fn(Tensor) -> Tensor) -> [Tensor; 6] {
    let make = |shape: &[usize], k: u64, scale: f64| {
        to(input(shape, DType::F32, 100 + k)
            .mul(scale)
            .unwrap()
            .to_dtype(dt)
            .unwrap())
    };
    let leaf =
        |shape: &[usize], k: u64, scale: f64| make(shape, k, scale).requires_grad(true).unwrap();
    [
        leaf(&[2, 5, c], 1, 1.0),
        leaf(&[hidden, c], 2, 2.0 / (c as f64).sqrt()),
        leaf(&[hidden], 3, 0.5),
        leaf(&[c, hidden], 4, 1.0 / (hidden as f64).sqrt()),
        leaf(&[c], 5, 0.5),
        make(&[2, 5, c], 6, 1.0),
    ]
}

/// `y` and the gradients of `sum(y * g)` for x, fc_w, fc_b, proj_w, proj_b (`g` given as
/// the output's gradient: no other kernel runs).
fn mlp(ops: &[Tensor; 6]) -> Vec<Vec<f64>> {
    let [x, w1, b1, w2, b2, g] = ops;
    let y = x.mlp_gelu_tanh((w1, b1), (w2, b2)).unwrap();
    y.backward_with(g).unwrap();
    let mut out = vec![vals(&y)];
    out.extend([x, w1, b1, w2, b2].map(|t| vals(&t.grad().unwrap())));
    out
}

/// The MLP on `d` in `dt` with the epilogues `on`: the values and the kernels' names.
fn run_mlp(d: Device, dt: DType, hidden: usize, on: bool) -> (Vec<Vec<f64>>, Vec<String>) {
    let _e = Epilogues::set(on);
    let ops = operands(dt, 24, hidden, |t| t.to_device(d).unwrap().copy().unwrap());
    let (v, p) = profiler::profile(|_| mlp(&ops)).unwrap();
    (v, kernel_names(&p))
}

/// The same MLP composed in f32 on the CPU from the inputs rounded to `dt`.
fn reference(dt: DType, hidden: usize) -> Vec<Vec<f64>> {
    let _e = Epilogues::set(false);
    mlp(&operands(dt, 24, hidden, |t| {
        t.to_dtype(DType::F32).unwrap()
    }))
}

/// The kernels and library calls a profile saw, without the copies that read results back.
fn kernel_names(p: &profiler::Profile) -> Vec<String> {
    let all = p.kernels().iter().map(|k| k.name.clone());
    all.filter(|n| !n.starts_with("memcpy")).collect()
}

const NAMES: [&str; 6] = ["y", "dx", "dfc_w", "dfc_b", "dproj_w", "dproj_b"];

fn count(kernels: &[String], part: &str) -> usize {
    kernels.iter().filter(|k| k.contains(part)).count()
}

#[test]
fn mlp_with_epilogues_matches_the_f32_composition_in_six_products() {
    let Some(d) = gpu() else {
        return;
    };
    for dt in FLOATS {
        let (got, kernels) = run_mlp(d, dt, 32, true);
        let want = reference(dt, 32);
        for ((g, w), name) in got.iter().zip(&want).zip(NAMES) {
            assert_close(g, w, band(dt), &format!("{dt:?} {name}"));
        }
        for part in ["+bias gelu aux", "dgelu bgrad", "bgradb"] {
            assert_eq!(count(&kernels, part), 1, "{dt:?} {part} in {kernels:?}");
        }
        // With the second layer's forward product and the first layer's two gradient
        // products: six products and nothing else.
        assert_eq!(count(&kernels, "cublas"), 6, "{dt:?}: {kernels:?}");
        assert_eq!(
            kernels.len(),
            6,
            "{dt:?}: nothing but the products ran: {kernels:?}"
        );
    }
}

#[test]
fn mlp_on_an_input_that_does_not_require_grad_trains_its_parameters() {
    let Some(d) = gpu() else {
        return;
    };
    // The reference first: it takes the switch's lock itself.
    let want = reference(DType::F32, 32);
    let _e = Epilogues::set(true);
    let ops = operands(DType::F32, 24, 32, |t| {
        t.to_device(d).unwrap().copy().unwrap()
    });
    let [x, w1, b1, w2, b2, g] = &ops;
    let x = x.detach();
    let y = x.mlp_gelu_tanh((w1, b1), (w2, b2)).unwrap();
    y.backward_with(g).unwrap();
    assert!(x.grad().is_none());
    for (t, (w, name)) in [w1, b1, w2, b2]
        .iter()
        .zip(want[2..].iter().zip(&NAMES[2..]))
    {
        assert_close(&vals(&t.grad().unwrap()), w, band(DType::F32), name);
    }
}

#[test]
fn without_the_switch_or_with_a_hidden_width_cublaslt_refuses_the_ops_are_composed() {
    let Some(d) = gpu() else {
        return;
    };
    for dt in [DType::F32, DType::BF16] {
        // Off: the composed ops (more launches), the same values as before.
        let (off, kernels) = run_mlp(d, dt, 32, false);
        for part in ["gelu aux", "dgelu", "bgradb"] {
            assert_eq!(count(&kernels, part), 0, "{dt:?} {part} ran: {kernels:?}");
        }
        assert!(kernels.len() > 6, "{dt:?}: {kernels:?}");
        let want = reference(dt, 32);
        for ((g, w), name) in off.iter().zip(&want).zip(NAMES) {
            assert_close(g, w, band(dt), &format!("{dt:?} {name} (off)"));
        }
        // A hidden width of 20: the aux matrix's rows would not be a multiple of 8.
        let (odd, kernels) = run_mlp(d, dt, 20, true);
        assert_eq!(count(&kernels, "gelu aux"), 0, "{dt:?}: {kernels:?}");
        assert_eq!(count(&kernels, "dgelu"), 0, "{dt:?}: {kernels:?}");
        let want = reference(dt, 20);
        for ((g, w), name) in odd.iter().zip(&want).zip(NAMES) {
            assert_close(g, w, band(dt), &format!("{dt:?} {name} (hidden 20)"));
        }
    }
}

#[test]
fn linear_bias_gradient_comes_from_the_weight_gradient_product() {
    let Some(d) = gpu() else {
        return;
    };
    for dt in FLOATS {
        let x = input(&[3, 7, 40], dt, 1);
        let w = input(&[24, 40], dt, 2);
        let b = input(&[24], dt, 3);
        let g = input(&[3, 7, 24], dt, 4);
        let grads = |dev: Device, f32_: bool, on: bool| {
            let _e = Epilogues::set(on);
            let cast = |t: &Tensor| match f32_ {
                true => t.to_dtype(DType::F32).unwrap().copy().unwrap(),
                false => t.to_device(dev).unwrap().copy().unwrap(),
            };
            // The input requires grad too (a hidden layer's): its gradient is a product of
            // its own beside the fused one.
            let (x, g) = (cast(&x).requires_grad(true).unwrap(), cast(&g));
            let (w, b) = (
                cast(&w).requires_grad(true).unwrap(),
                cast(&b).requires_grad(true).unwrap(),
            );
            let (_, p) = profiler::profile(|_| {
                x.linear(&w, Some(&b)).unwrap().backward_with(&g).unwrap();
            })
            .unwrap();
            let names = kernel_names(&p);
            ([vals(&w.grad().unwrap()), vals(&b.grad().unwrap())], names)
        };
        let (want, _) = grads(Device::Cpu, true, false);
        let (got, kernels) = grads(d, false, true);
        assert_eq!(count(&kernels, "bgradb"), 1, "{dt:?}: {kernels:?}");
        assert_close(&got[0], &want[0], band(dt), &format!("{dt:?} dw"));
        assert_close(&got[1], &want[1], band(dt), &format!("{dt:?} db"));
        // Under autocast from f32 parameters too (the gradient reaches the f32 bias through
        // the cast's backward).
        if dt == DType::BF16 {
            let _e = Epilogues::set(true);
            let own = |t: &Tensor| t.to_dtype(DType::F32).unwrap().to_device(d).unwrap();
            let (wf, bf) = (
                own(&w).copy().unwrap().requires_grad(true).unwrap(),
                own(&b).copy().unwrap().requires_grad(true).unwrap(),
            );
            let xf = own(&x).copy().unwrap().requires_grad(true).unwrap();
            let gf = g.to_device(d).unwrap();
            let (_, p) = profiler::profile(|_| {
                let y = amp::with_autocast(DType::BF16, || xf.linear(&wf, Some(&bf)))
                    .unwrap()
                    .unwrap();
                y.backward_with(&gf).unwrap();
            })
            .unwrap();
            let kernels = kernel_names(&p);
            assert_eq!(count(&kernels, "bgradb"), 1, "autocast: {kernels:?}");
            assert_close(
                &vals(&bf.grad().unwrap()),
                &want[1],
                band(dt),
                "autocast db",
            );
        }
        // A broadcast output gradient (from a sum): laid out first, so that cuBLASLt reads
        // it transposed, which its bias-gradient epilogue needs.
        {
            let _e = Epilogues::set(true);
            let own = |t: &Tensor| t.to_device(d).unwrap().copy().unwrap();
            let (wd, bd) = (
                own(&w).requires_grad(true).unwrap(),
                own(&b).requires_grad(true).unwrap(),
            );
            let xd = own(&x);
            let (_, p) = profiler::profile(|_| {
                let y = xd.linear(&wd, Some(&bd)).unwrap();
                y.sum_all().unwrap().backward().unwrap();
            })
            .unwrap();
            let kernels = kernel_names(&p);
            assert_eq!(count(&kernels, "bgradb"), 1, "{dt:?} summed: {kernels:?}");
            let rows = (3 * 7) as f64;
            let got = vals(&bd.grad().unwrap());
            assert!(got.iter().all(|&v| v == rows), "{dt:?}: {got:?}");
        }
        // Without the switch: no epilogue, the bias gradient from a sum.
        let (off, kernels) = grads(d, false, false);
        assert_eq!(count(&kernels, "bgradb"), 0, "{dt:?}: {kernels:?}");
        assert_close(&off[1], &want[1], band(dt), &format!("{dt:?} db (off)"));
    }
}

#[test]
fn under_autocast_the_fused_mlp_gives_f32_parameters_their_gradients() {
    let Some(d) = gpu() else {
        return;
    };
    let run = |on: bool| {
        let _e = Epilogues::set(on);
        let ops = operands(DType::F32, 24, 32, |t| {
            t.to_device(d).unwrap().copy().unwrap()
        });
        let [x, w1, b1, w2, b2, g] = &ops;
        let y = amp::with_autocast(DType::BF16, || x.mlp_gelu_tanh((w1, b1), (w2, b2)))
            .unwrap()
            .unwrap();
        assert_eq!(y.dtype(), DType::BF16);
        let loss = y
            .to_dtype(DType::F32)
            .unwrap()
            .mul(g)
            .unwrap()
            .sum_all()
            .unwrap();
        loss.backward().unwrap();
        let mut out = vec![vals(&y)];
        for t in [x, w1, b1, w2, b2] {
            let gr = t.grad().unwrap();
            assert_eq!(
                gr.dtype(),
                DType::F32,
                "a parameter's gradient keeps its dtype"
            );
            out.push(vals(&gr));
        }
        out
    };
    let (fused, composed) = (run(true), run(false));
    for ((f, c), name) in fused.iter().zip(&composed).zip(NAMES) {
        assert_close(f, c, band(DType::BF16), &format!("autocast {name}"));
    }
}
