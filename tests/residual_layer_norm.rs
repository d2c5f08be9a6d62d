//! `add_layer_norm`, a pre-LayerNorm transformer's residual add and the layer norm after it,
//! on CUDA in one kernel (`ln_residual_forward`): against the composed ops (`add`, then
//! `layer_norm`) bit for bit, values and gradients, for an f32 residual stream with an f32,
//! bf16 or f16 branch and for half streams, with and without affine parameters, rows wider
//! than a block; with one launch where the composition makes two or three. Operands it does
//! not take (a broadcast branch, a half sum under autocast) run composed. On the emulated
//! device in CI; without a CUDA device each test prints `skipped: no CUDA device` and passes.
#![cfg(feature = "cuda-backend")]

mod common;
use common::parity::{gpu, input};
use common::vals;
use mantissa::profiler;
use mantissa::*;

/// One profile at a time: the tests hold this while they profile.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// `[x, branch, w, b, gs, gy]` on `d`: x and the branch (dtypes `xdt`, `rdt`) and the affine
/// parameters (in `xdt`) require grad; `gs` and `gy` weigh the sum and the output in the loss.
fn operands(d: Device, shape: &[usize], (xdt, rdt): (DType, DType), seed: u64) -> [Tensor; 6] {
    let c = *shape.last().unwrap();
    let make = |shape: &[usize], dt: DType, k: u64| {
        input(shape, dt, seed + k)
            .to_device(d)
            .unwrap()
            .copy()
            .unwrap()
    };
    let leaf = |shape: &[usize], dt: DType, k: u64| make(shape, dt, k).requires_grad(true).unwrap();
    [
        leaf(shape, xdt, 1),
        leaf(shape, rdt, 2),
        leaf(&[c], xdt, 3),
        leaf(&[c], xdt, 4),
        make(shape, xdt, 5),
        make(shape, xdt, 6),
    ]
}

struct Run {
    bits: Vec<Vec<u64>>,
    kernels: Vec<String>,
}

/// `(s, y)` of the fused op (`fused`) or the composed ops with the affine parameters when
/// `affine`, and the gradients of `sum(s gs) + sum(y gy)`: the values' bits and the forward's
/// kernels.
fn run(ops: &[Tensor; 6], affine: bool, fused: bool) -> Run {
    let [x, r, w, b, gs, gy] = ops;
    let c = *x.shape().last().unwrap();
    let (w, b) = match affine {
        true => (Some(w), Some(b)),
        false => (None, None),
    };
    let ((s, y), p) = profiler::profile(|_| match fused {
        true => x.add_layer_norm(r, &[c], w, b, 1e-5).unwrap(),
        false => {
            let s = x.add(r).unwrap();
            let y = s.layer_norm(&[c], w, b, 1e-5).unwrap();
            (s, y)
        }
    })
    .unwrap();
    let kernels = p.kernels().iter().map(|k| k.name.clone()).collect();
    let loss = s.mul(gs).unwrap().sum_all().unwrap();
    let loss = loss.add(&y.mul(gy).unwrap().sum_all().unwrap()).unwrap();
    loss.backward().unwrap();
    let mut leaves = vec![x, r];
    leaves.extend(w.into_iter().chain(b));
    let mut all = vec![s, y];
    all.extend(leaves.iter().map(|t| t.grad().unwrap()));
    for t in leaves {
        t.set_grad(None).unwrap();
    }
    let bits = all
        .iter()
        .map(|t| vals(t).iter().map(|v| v.to_bits()).collect())
        .collect();
    Run { bits, kernels }
}

#[test]
fn the_fused_residual_layer_norm_is_the_composed_ops_bit_for_bit_in_one_launch() {
    let Some(d) = gpu() else {
        return;
    };
    let _serial = serial();
    let pairs = [
        (DType::F32, DType::F32),
        (DType::F32, DType::BF16),
        (DType::F32, DType::F16),
        (DType::BF16, DType::BF16),
        (DType::F16, DType::F16),
    ];
    for (i, dts) in pairs.into_iter().enumerate() {
        // 600 columns (an f32 stream with a bf16 branch, GPT's under autocast): more than a
        // block's 256 threads, each thread several elements.
        let mut shapes = vec![vec![3, 5, 40]];
        if dts == (DType::F32, DType::BF16) {
            shapes.push(vec![2, 600]);
        }
        for shape in shapes {
            for affine in [true, false] {
                let what = format!("{dts:?} {shape:?} affine {affine}");
                let ops = operands(d, &shape, dts, 10 * i as u64);
                let fused = run(&ops, affine, true);
                let composed = run(&ops, affine, false);
                assert_eq!(fused.bits, composed.bits, "{what}");
                assert_eq!(fused.kernels.len(), 1, "{what}: {:?}", fused.kernels);
                assert!(
                    fused.kernels[0].starts_with("ln_residual_forward"),
                    "{what}"
                );
                // The add and the layer norm, and the branch's promotion where it has one.
                let cast = usize::from(dts.0 != dts.1);
                assert_eq!(
                    composed.kernels.len(),
                    2 + cast,
                    "{what}: {:?}",
                    composed.kernels
                );
            }
        }
    }
}

#[test]
fn operands_the_kernel_does_not_take_run_composed() {
    let Some(d) = gpu() else {
        return;
    };
    let _serial = serial();
    // A branch broadcast along the rows.
    let x = input(&[4, 24], DType::F32, 1).to_device(d).unwrap();
    let r = input(&[24], DType::F32, 2).to_device(d).unwrap();
    let ((s, y), p) =
        profiler::profile(|_| x.add_layer_norm(&r, &[24], None, None, 1e-5).unwrap()).unwrap();
    assert!(p
        .kernels()
        .iter()
        .all(|k| !k.name.starts_with("ln_residual")));
    let want = x.add(&r).unwrap();
    assert_eq!(vals(&s), vals(&want));
    assert_eq!(
        vals(&y),
        vals(&want.layer_norm(&[24], None, None, 1e-5).unwrap())
    );
    // A bf16 sum under autocast: its layer norm runs in f32, as the composed op's does.
    let (xb, rb) = (
        x.to_dtype(DType::BF16).unwrap(),
        r.expand(&[4, 24]).unwrap().to_dtype(DType::BF16).unwrap(),
    );
    let (s, y) = amp::with_autocast(DType::BF16, || {
        xb.add_layer_norm(&rb, &[24], None, None, 1e-5)
    })
    .unwrap()
    .unwrap();
    assert_eq!((s.dtype(), y.dtype()), (DType::BF16, DType::F32));
    // Mismatched shapes are the add's error.
    let short = input(&[4, 23], DType::F32, 3).to_device(d).unwrap();
    let err = x
        .add_layer_norm(&short, &[24], None, None, 1e-5)
        .unwrap_err();
    assert!(err.to_string().contains("add"), "{err}");
}
