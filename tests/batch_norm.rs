//! The fused batch norm against its definition, composed in f64 from differentiable ops:
//! outputs and gradients (input, weight, bias) in training and eval mode, row-major and
//! channels-last, ranks 2 to 4, sizes that split into several blocks and run in parallel,
//! and inputs far from zero mean.

mod common;

use common::{assert_outputs_close, output_and_grads, vals};
use mantissa::{DType, Device, Generator, MemoryFormat, Result, Tensor};

/// `x (mean m, spread s)` of `dtype`, in `format`, requiring grad.
fn input(shape: &[usize], dtype: DType, m: f64, s: f64, seed: u64, cl: bool) -> Tensor {
    let mut g = Generator::new(seed);
    let x = Tensor::randn_with(shape, m, s, DType::F64, Device::Cpu, &mut g).unwrap();
    let x = x.to_dtype(dtype).unwrap();
    let x = match cl {
        true => x.to_memory_format(MemoryFormat::ChannelsLast).unwrap(),
        false => x,
    };
    x.requires_grad(true).unwrap()
}

/// The definition: (x - mean) / sqrt(var + eps) w + b over every dim but 1, in f64.
fn reference(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    stats: Option<(&Tensor, &Tensor)>,
) -> Result<Tensor> {
    let dims: Vec<isize> = (0..x.rank() as isize).filter(|&d| d != 1).collect();
    let (mean, var) = match stats {
        Some((m, v)) => (m.clone(), v.clone()),
        None => (x.mean(&dims, false)?, x.var(&dims, 0, false)?),
    };
    let mut shape = vec![1; x.rank()];
    shape[1] = w.numel();
    let c = |t: &Tensor| t.reshape(&shape);
    x.sub(&c(&mean)?)?
        .mul(&c(&var.add(1e-5)?.rsqrt()?)?)?
        .mul(&c(w)?)?
        .add(&c(b)?)
}

/// Outputs and gradients (x, w, b) of `f` with the upstream gradient `g`.
fn run(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    g: &Tensor,
    f: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
) -> Vec<Vec<f64>> {
    let y = f(x, w, b).unwrap();
    assert_eq!(y.dtype(), x.dtype(), "the output keeps the input dtype");
    output_and_grads(&y, g, &[x, w, b])
}

fn check(shape: &[usize], cl: bool, dtype: DType, mean: f64, tol: f64) {
    let c = shape[1];
    let what = format!("{shape:?} cl={cl} {dtype:?} mean {mean}");
    let x = input(shape, dtype, mean, 2.0, 1, cl);
    let x64 = Tensor::from_vec(vals(&x), shape, Device::Cpu)
        .unwrap()
        .requires_grad(true)
        .unwrap();
    // Parameters in f32 (f64 for f64 input), as a module's master weights.
    let pdt = if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let w = input(&[c], pdt, 1.0, 0.5, 2, false);
    let b = input(&[c], pdt, 0.0, 1.0, 3, false);
    let (w64, b64) = (
        input(&[c], DType::F64, 1.0, 0.5, 2, false),
        input(&[c], DType::F64, 0.0, 1.0, 3, false),
    );
    let g = input(shape, DType::F64, 0.0, 1.0, 4, false);
    let fused = run(&x, &w, &b, &g, |x, w, b| {
        let y = x.batch_norm(None, None, Some(w), Some(b), true, 0.1, 1e-5)?;
        assert_eq!(
            y.is_channels_last(),
            cl,
            "{what}: the output keeps the format"
        );
        Ok(y)
    });
    let want = run(&x64, &w64, &b64, &g, |x, w, b| reference(x, w, b, None));
    assert_outputs_close(&fused, &want, tol, &what);

    // Eval mode with running statistics: the statistics are constants.
    let rm = Tensor::from_vec(vec![mean as f32; c], &[c], Device::Cpu).unwrap();
    let rv = Tensor::from_vec((0..c).map(|k| 3.0 + k as f32).collect(), &[c], Device::Cpu).unwrap();
    let (rm64, rv64) = (
        rm.to_dtype(DType::F64).unwrap(),
        rv.to_dtype(DType::F64).unwrap(),
    );
    let fused = run(&x, &w, &b, &g, |x, w, b| {
        x.batch_norm(Some(&rm), Some(&rv), Some(w), Some(b), false, 0.1, 1e-5)
    });
    let want = run(&x64, &w64, &b64, &g, |x, w, b| {
        reference(x, w, b, Some((&rm64, &rv64)))
    });
    assert_outputs_close(&fused, &want, tol, &format!("{what} eval"));

    // BatchNorm2d followed by ReLU in a Sequential runs as one fused op: the definition
    // followed by relu, in training and eval. (Not for inputs far from zero mean: there an
    // output within rounding of 0 may take the other side of the ReLU than the f64
    // definition's, and its gradient with it.)
    let evals = if mean.abs() < 10.0 {
        vec![None, Some((&rm, &rv))]
    } else {
        vec![]
    };
    for eval in evals {
        let fused = run(&x, &w, &b, &g, |x, w, b| bn_relu(x, w, b, eval));
        let want = run(&x64, &w64, &b64, &g, |x, w, b| {
            reference(x, w, b, eval.map(|_| (&rm64, &rv64)))?.relu()
        });
        let what = format!("{what} with ReLU, eval {}", eval.is_some());
        assert_outputs_close(&fused, &want, tol, &what);

        // A Residual block whose main branch ends in the batch norm: relu(bn(x) + x) as one
        // op; the input's gradient comes through both branches.
        let fused = run(&x, &w, &b, &g, |x, w, b| bn_add_relu(x, w, b, eval));
        let want = run(&x64, &w64, &b64, &g, |x, w, b| {
            reference(x, w, b, eval.map(|_| (&rm64, &rv64)))?
                .add(x)?
                .relu()
        });
        assert_outputs_close(&fused, &want, tol, &format!("{what}, residual added"));
    }
}

/// `Residual { main: [BatchNorm2d (w, b; running statistics `eval` in eval mode)], identity }`:
/// `relu(bn(x) + x)`, checked to run as the fused op.
fn bn_add_relu(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    eval: Option<(&Tensor, &Tensor)>,
) -> Result<Tensor> {
    use mantissa::nn::{Module, Residual, Sequential};
    let bn = batch_norm_module(w, b, eval)?;
    let mut block = Residual::new(Sequential::new().push(bn), None);
    block.set_training(eval.is_none());
    let y = block.forward(x)?;
    assert_eq!(y.op_name(), Some("batch_norm_add_relu"), "one fused op");
    assert!(y.to_vec_f64()?.contains(&0.0), "the ReLU clamps some");
    Ok(y)
}

/// A BatchNorm2d with weight w and bias b, and running statistics `eval` for eval mode.
fn batch_norm_module(
    w: &Tensor,
    b: &Tensor,
    eval: Option<(&Tensor, &Tensor)>,
) -> Result<mantissa::nn::BatchNorm2d> {
    let mut bn = mantissa::nn::BatchNorm2d::new(w.numel())?;
    (bn.weight, bn.bias) = (w.clone(), b.clone());
    if let Some((m, v)) = eval {
        (bn.running_mean, bn.running_var) = (m.copy()?, v.copy()?);
    }
    Ok(bn)
}

/// `Sequential [BatchNorm2d (weight w, bias b; running statistics `eval` in eval mode), ReLU]`.
fn bn_relu(x: &Tensor, w: &Tensor, b: &Tensor, eval: Option<(&Tensor, &Tensor)>) -> Result<Tensor> {
    use mantissa::nn::{Activation, Module, Sequential};
    let bn = batch_norm_module(w, b, eval)?;
    let mut net = Sequential::new().push(bn).push(Activation::Relu);
    net.set_training(eval.is_none());
    let y = net.forward(x)?;
    assert!(y.to_vec_f64()?.contains(&0.0), "the ReLU clamps some");
    Ok(y)
}

#[test]
fn fused_batch_norm_matches_its_definition() {
    // [16, 8, 24, 24] is 73,728 elements: several blocks, in parallel.
    for (shape, cl) in [
        (&[16, 8, 24, 24][..], false),
        (&[16, 8, 24, 24][..], true),
        (&[4, 3, 5, 7][..], false),
        (&[4, 3, 5, 7][..], true),
        (&[64, 40][..], false),
        (&[12, 6, 700][..], false),
    ] {
        check(shape, cl, DType::F64, 0.5, 1e-12);
        check(shape, cl, DType::F32, 0.5, 1e-5);
        check(shape, cl, DType::BF16, 0.5, 2e-2);
        check(shape, cl, DType::F16, 0.5, 3e-3);
    }
}

#[test]
fn statistics_far_from_zero_keep_their_precision() {
    // A mean of 1,000 and spread 2: E[x^2] - E[x]^2 in f32 would lose about half the digits
    // of the variance; the per-block deviations keep them.
    for cl in [false, true] {
        check(&[16, 8, 24, 24], cl, DType::F32, 1000.0, 3e-5);
    }
}

#[test]
fn fused_batch_norm_does_not_depend_on_the_thread_count() {
    let x = input(&[16, 8, 24, 24], DType::F32, 0.5, 2.0, 9, true);
    let f = || {
        let y = x
            .batch_norm(None, None, None, None, true, 0.1, 1e-5)
            .unwrap();
        y.sum_all().unwrap().backward().unwrap();
        let out = (vals(&y), vals(&x.grad().unwrap()));
        x.zero_grad();
        out
    };
    let pool = f();
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
        .install(f);
    assert!(pool == one, "one thread gives the pool's bits");
}

#[test]
fn residual_in_eval_without_parameter_gradients_matches_its_definition() {
    // Eval mode with frozen affine parameters: the backward has no sums' pass, so the masked
    // gradient comes from ReLU's own backward.
    for cl in [false, true] {
        let shape = [4, 3, 5, 6];
        let x = input(&shape, DType::F32, 0.5, 2.0, 11, cl);
        let x64 = Tensor::from_vec(vals(&x), &shape, Device::Cpu)
            .unwrap()
            .requires_grad(true)
            .unwrap();
        let w = input(&[3], DType::F32, 1.0, 0.5, 12, false).detach();
        let b = input(&[3], DType::F32, 0.0, 1.0, 13, false).detach();
        let rm = Tensor::from_vec(vec![0.3f32, -0.2, 0.1], &[3], Device::Cpu).unwrap();
        let rv = Tensor::from_vec(vec![2.0f32, 3.0, 4.0], &[3], Device::Cpu).unwrap();
        let g = input(&shape, DType::F64, 0.0, 1.0, 14, false);
        let y = bn_add_relu(&x, &w, &b, Some((&rm, &rv))).unwrap();
        let got = output_and_grads(&y, &g, &[&x]);
        let f64s = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
        let want_y = reference(&x64, &f64s(&w), &f64s(&b), Some((&f64s(&rm), &f64s(&rv))))
            .unwrap()
            .add(&x64)
            .unwrap()
            .relu()
            .unwrap();
        let want = output_and_grads(&want_y, &g, &[&x64]);
        assert_outputs_close(&got, &want, 1e-5, &format!("eval, frozen, cl={cl}"));
    }
}
