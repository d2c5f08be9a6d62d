//! Gradient checkpointing and custom autograd ops (`mantissa::autograd`): a checkpointed
//! function gives the gradients of the plain one (f32, and f16 under autocast with dropout),
//! keeps no activations for backward, and a custom op's hand-written gradient passes
//! gradcheck.

mod common;
use common::*;
use mantissa::autograd::{checkpoint, custom_op};
use mantissa::*;
use std::sync::Mutex;

/// The memory test reads a process-wide byte count: the tests here run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn param(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    f32s(shape, seed)
        .mul(0.3)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .requires_grad(true)
        .unwrap()
}

/// Two layers with a dropout between them: `tanh(x w1) -> dropout -> (.) w2`, then gelu.
fn block(x: &Tensor, w1: &Tensor, w2: &Tensor, p: f64) -> Result<Tensor> {
    x.matmul(w1)?.tanh()?.dropout(p, true)?.matmul(w2)?.gelu()
}

/// The input's and both weights' gradients of `sum(y * g)`, with `y` from the block run
/// plainly or checkpointed, the default generator seeded the same way before each.
fn grads(dtype: DType, autocast: Option<DType>, p: f64, checkpointed: bool) -> Vec<Vec<f64>> {
    let x = param(&[6, 8], 1, dtype);
    let (w1, w2) = (param(&[8, 16], 2, dtype), param(&[16, 4], 3, dtype));
    let g = f32s(&[6, 4], 4);
    manual_seed(77);
    let _ac = autocast.map(|dt| amp::autocast(dt).unwrap());
    let y = if checkpointed {
        let (a, b) = (w1.clone(), w2.clone());
        checkpoint(&[&x], move |xs| block(&xs[0], &a, &b, p)).unwrap()
    } else {
        block(&x, &w1, &w2, p).unwrap()
    };
    // Draws after the checkpoint see the generator as the plain run left it.
    let after = Tensor::ones(&[64], DType::F32, Device::Cpu)
        .unwrap()
        .dropout(0.5, true)
        .unwrap();
    drop(_ac);
    let mut out = output_and_grads(&y, &g, &[&x, &w1, &w2]);
    out.push(vals(&after));
    out
}

#[test]
fn checkpointed_and_plain_backward_give_identical_gradients() {
    let _s = serial();
    for p in [0.0, 0.3] {
        let plain = grads(DType::F32, None, p, false);
        let ckpt = grads(DType::F32, None, p, true);
        assert_eq!(ckpt, plain, "f32, dropout {p}");
    }
    // f16 under autocast (the matmuls in f16, tanh/gelu as the policy says), with dropout.
    let plain = grads(DType::F32, Some(DType::F16), 0.3, false);
    let ckpt = grads(DType::F32, Some(DType::F16), 0.3, true);
    assert_eq!(ckpt, plain, "f16 autocast, dropout 0.3");
    // And f16 tensors themselves.
    assert_eq!(
        grads(DType::F16, None, 0.3, true),
        grads(DType::F16, None, 0.3, false)
    );
}

#[test]
fn parameters_get_gradients_when_the_input_needs_none() {
    let _s = serial();
    let x = f32s(&[3, 5], 5);
    let w = param(&[5, 2], 6, DType::F32);
    let wc = w.clone();
    let y = checkpoint(&[&x], move |xs| xs[0].matmul(&wc)?.relu()).unwrap();
    y.sum_all().unwrap().backward().unwrap();
    let got = vals(&w.grad().expect("a gradient for the parameter"));
    w.zero_grad();
    x.matmul(&w)
        .unwrap()
        .relu()
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(got, vals(&w.grad().unwrap()));
    assert!(x.grad().is_none());
}

#[test]
fn nested_checkpoints_equal_the_plain_function() {
    let _s = serial();
    let run = |nested: bool| {
        let x = param(&[4, 6], 7, DType::F32);
        let w = param(&[6, 6], 8, DType::F32);
        manual_seed(5);
        let wc = w.clone();
        let inner = move |t: &Tensor, w: &Tensor| t.matmul(w)?.dropout(0.2, true)?.sin();
        let y = if nested {
            checkpoint(&[&x], move |xs| {
                let w2 = wc.clone();
                let h = checkpoint(&[&xs[0]], move |ys| inner(&ys[0], &w2))?;
                inner(&h, &wc)
            })
            .unwrap()
        } else {
            inner(&inner(&x, &w).unwrap(), &w).unwrap()
        };
        output_and_grads(&y, &f32s(&[4, 6], 9), &[&x, &w])
    };
    assert_eq!(run(true), run(false));
}

#[test]
fn a_checkpoint_keeps_no_activations_for_backward() {
    let _s = serial();
    let x = param(&[64, 256], 10, DType::F32);
    let ws: Vec<Tensor> = (0..6)
        .map(|i| param(&[256, 256], 20 + i, DType::F32))
        .collect();
    let deep = |x: &Tensor, ws: &[Tensor]| -> Result<Tensor> {
        ws.iter().try_fold(x.clone(), |h, w| h.matmul(w)?.tanh())
    };
    let before = live_storage_bytes();
    let plain = deep(&x, &ws).unwrap();
    let kept_plain = live_storage_bytes() - before;
    drop(plain);
    let before = live_storage_bytes();
    let wc = ws.clone();
    let ck = checkpoint(&[&x], move |xs| deep(&xs[0], &wc)).unwrap();
    let kept_ckpt = live_storage_bytes() - before;
    // Plain: each layer's product and tanh output (64 x 256 f32 = 64 KiB each) stay for
    // backward; checkpointed: the output alone.
    let act = 64 * 256 * 4;
    assert!(kept_plain >= 11 * act, "plain kept {kept_plain} bytes");
    assert!(kept_ckpt <= act, "checkpoint kept {kept_ckpt} bytes");
    ck.sum_all().unwrap().backward().unwrap();
    assert!(x.grad().is_some() && ws.iter().all(|w| w.grad().is_some()));
}

#[test]
fn without_grad_mode_a_checkpoint_is_the_plain_call() {
    let _s = serial();
    let x = param(&[2, 3], 11, DType::F32);
    let y = no_grad(|| checkpoint(&[&x], |xs| xs[0].exp())).unwrap();
    assert!(!y.is_requires_grad());
    assert_eq!(vals(&y), vals(&x.exp().unwrap()));
}

#[test]
fn a_custom_ops_gradient_passes_gradcheck() {
    let _s = serial();
    // f(x, y) = x * sin(y), with its gradients written by hand.
    let op = |xs: &[Tensor]| {
        custom_op(
            "x_sin_y",
            &[&xs[0], &xs[1]],
            |v| Ok((v[0].mul(&v[1].sin()?)?, (v[0].clone(), v[1].clone()))),
            |g, (x, y)| {
                let gx = g.mul(&y.sin()?)?;
                let gy = g.mul(&x.mul(&y.cos()?)?)?;
                Ok(vec![Some(gx), Some(gy)])
            },
        )
    };
    gradcheck(&[leaf(&[3, 4], 12), leaf(&[3, 4], 13)], op);
    // Forward alone records nothing and gives the values.
    let (a, b) = (leaf(&[5], 14), leaf(&[5], 15));
    let want: Vec<f64> = vals(&a)
        .iter()
        .zip(vals(&b))
        .map(|(x, y)| x * y.sin())
        .collect();
    assert_close(&vals(&op(&[a, b]).unwrap()), &want, 1e-15, "x sin y");
}

#[test]
fn custom_op_gradient_mistakes_are_errors() {
    let _s = serial();
    let x = leaf(&[3], 16);
    let too_few = custom_op(
        "two_in",
        &[&x, &x],
        |v| Ok((v[0].add(&v[1])?, ())),
        |g, _| Ok(vec![Some(g.clone())]),
    )
    .unwrap();
    let e = too_few
        .sum_all()
        .unwrap()
        .backward()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("two_in") && e.contains("1 gradients for 2 inputs"),
        "{e}"
    );
    let bad_shape = custom_op(
        "bad_shape",
        &[&x],
        |v| Ok((v[0].exp()?, ())),
        |_, _| Ok(vec![Some(Tensor::ones(&[4], DType::F64, Device::Cpu)?)]),
    )
    .unwrap();
    let e = bad_shape
        .sum_all()
        .unwrap()
        .backward()
        .unwrap_err()
        .to_string();
    assert!(e.contains("bad_shape"), "{e}");
}

/// A conv - batch norm - relu - conv block (the shape of a ResNet block's main branch).
fn conv_block(seed: u64) -> nn::Sequential {
    let mut g = Generator::new(seed);
    let opts = Conv2dOptions {
        padding: [1, 1],
        ..Default::default()
    };
    nn::Sequential::new()
        .push(nn::Conv2d::new(3, 8, 3, opts, false, &mut g).unwrap())
        .push(nn::BatchNorm2d::new(8).unwrap())
        .push(nn::Activation::Relu)
        .push(nn::Conv2d::new(8, 4, 3, opts, true, &mut g).unwrap())
}

#[test]
fn a_checkpointed_module_trains_like_the_module() {
    use nn::Module;
    let _s = serial();
    let plain = conv_block(21);
    let ckpt = nn::Checkpointed::new(conv_block(21));
    let names = |m: &dyn Module| -> Vec<String> {
        m.named_parameters().into_iter().map(|(n, _)| n).collect()
    };
    assert_eq!(names(&ckpt), names(&plain), "the wrapped module's names");
    let x = f32s(&[2, 3, 6, 6], 22).requires_grad(true).unwrap();
    let g = f32s(&[2, 4, 6, 6], 23);
    let run = |m: &dyn Module| {
        let mut leaves = vec![x.clone()];
        leaves.extend(m.parameters());
        let refs: Vec<&Tensor> = leaves.iter().collect();
        let mut out = output_and_grads(&m.forward(&x).unwrap(), &g, &refs);
        // The running statistics: updated once for the one training step.
        out.extend(m.named_buffers().iter().map(|(_, b)| vals(b)));
        out
    };
    assert_eq!(run(&ckpt), run(&plain));
    let counted = ckpt.named_buffers();
    let nbt = counted
        .iter()
        .find(|(n, _)| n.ends_with("num_batches_tracked"))
        .unwrap();
    assert_eq!(vals(&nbt.1), vec![1.0]);
}
