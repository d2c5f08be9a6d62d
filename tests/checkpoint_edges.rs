//! The edges of checkpointing and custom ops: in-place writes after the forward are refused as
//! the plain graph refuses them, random draws replay, tensors made outside a checkpoint get
//! their gradients once, integer outputs have no graph, and everything holds from rayon
//! tasks on a pool of 8 threads.

mod common;
use common::*;
use mantissa::autograd::{checkpoint, custom_op};
use mantissa::*;
use rayon::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

fn t(v: Vec<f32>) -> Tensor {
    Tensor::from_vec(v.clone(), &[v.len()], Device::Cpu).unwrap()
}

fn param(v: Vec<f32>) -> Tensor {
    t(v).requires_grad(true).unwrap()
}

fn grad(x: &Tensor) -> Vec<f64> {
    vals(&x.grad().expect("a gradient"))
}

/// Errors naming an in-place write after the forward.
fn assert_modified_in_place(r: Result<()>, what: &str) {
    let e = r.expect_err(what).to_string();
    assert!(e.contains("modified in place"), "{what}: {e}");
}

#[test]
fn checkpoint_refuses_what_its_function_read_being_written_after_the_forward() {
    for dtype in [DType::F32, DType::F16] {
        // The input, squared (the case: without the check x.grad was [20, 40]).
        let x = t(vec![1., 2.]).to_dtype(dtype).unwrap();
        let x = x.requires_grad(true).unwrap();
        let y = checkpoint(&[&x], |xs| xs[0].sqr()).unwrap();
        let new = t(vec![10., 20.]).to_dtype(dtype).unwrap();
        no_grad(|| x.copy_(&new)).unwrap();
        assert_modified_in_place(y.sum_all().unwrap().backward(), "input");
        assert!(x.grad().is_none(), "nothing reached the input");
        // The plain graph refuses the same.
        let x = param(vec![1., 2.]);
        let y = x.sqr().unwrap();
        no_grad(|| x.copy_(&t(vec![10., 20.]))).unwrap();
        assert_modified_in_place(y.sum_all().unwrap().backward(), "plain");
    }
    // A captured parameter, and a captured constant that needs no gradient.
    let (x, w) = (param(vec![1., 2.]), param(vec![3., 4.]));
    let wc = w.clone();
    let y = checkpoint(&[&x], move |xs| xs[0].mul(&wc)?.exp()).unwrap();
    no_grad(|| w.copy_(&t(vec![0., 0.]))).unwrap();
    assert_modified_in_place(y.sum_all().unwrap().backward(), "parameter");
    let (x, c) = (param(vec![1., 2.]), t(vec![3., 4.]));
    let cc = c.clone();
    let y = checkpoint(&[&x], move |xs| xs[0].mul(&cc)).unwrap();
    c.copy_(&t(vec![5., 5.])).unwrap();
    assert_modified_in_place(y.sum_all().unwrap().backward(), "constant");
    // Written after backward: nothing to refuse, and the gradient is the forward's.
    let x = param(vec![1., 2.]);
    let y = checkpoint(&[&x], |xs| xs[0].sqr()).unwrap();
    y.sum_all().unwrap().backward().unwrap();
    no_grad(|| x.copy_(&t(vec![10., 20.]))).unwrap();
    assert_eq!(grad(&x), vec![2., 4.]);
}

#[test]
fn custom_op_refuses_inputs_written_after_the_forward() {
    let cube = |x: &Tensor| {
        custom_op(
            "cube",
            &[x],
            |xs| Ok((xs[0].pow(3.0)?, xs[0].clone())),
            |g, x| Ok(vec![Some(g.mul(&x.sqr()?.mul(3.0)?)?)]),
        )
    };
    let x = param(vec![1., 2.]);
    let y = cube(&x).unwrap();
    no_grad(|| x.copy_(&t(vec![10., 20.]))).unwrap();
    assert_modified_in_place(y.sum_all().unwrap().backward(), "cube");
    // Two inputs, the second written; a view of the input written counts too.
    let (a, b) = (param(vec![1., 2., 3.]), param(vec![4., 5., 6.]));
    let y = custom_op(
        "mul",
        &[&a, &b],
        |xs| Ok((xs[0].mul(&xs[1])?, (xs[0].clone(), xs[1].clone()))),
        |g, (a, b)| Ok(vec![Some(g.mul(b)?), Some(g.mul(a)?)]),
    )
    .unwrap();
    let view = b.detach().narrow(0, 1, 2).unwrap();
    view.copy_(&t(vec![0., 0.])).unwrap();
    assert_modified_in_place(y.sum_all().unwrap().backward(), "second input");
    // Untouched: the hand-written gradient.
    let x = param(vec![1., 2.]);
    cube(&x).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(grad(&x), vec![3., 12.]);
}

/// `x * noise * extra` where the noise comes from every kind of draw, and the generator's
/// next draw after backward; checkpointed or plain, from the same seed.
fn noisy(checkpointed: bool, low: Option<DType>) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    manual_seed(31);
    let own = Arc::new(Mutex::new(Generator::new(4)));
    let x = param(vec![1., -2., 3., 0.5]);
    let f = move |xs: &[Tensor]| -> Result<Tensor> {
        let n = Tensor::randn(&[4], DType::F32, Device::Cpu)?;
        let u = Tensor::rand(&[4], DType::F32, Device::Cpu)?;
        let mut g = own.lock().unwrap();
        let m = Tensor::randn_with(&[4], 1.0, 0.5, DType::F32, Device::Cpu, &mut g)?;
        let host = t(g.normal(4).iter().map(|&v| v as f32).collect());
        xs[0]
            .mul(&n)?
            .add(&u)?
            .mul(&m)?
            .mul(&host)?
            .dropout(0.5, true)
    };
    let _ac = low.map(|d| amp::autocast(d).unwrap());
    let y = match checkpointed {
        true => checkpoint(&[&x], f).unwrap(),
        false => f(std::slice::from_ref(&x)).unwrap(),
    };
    drop(_ac);
    y.sum_all().unwrap().backward().unwrap();
    let next = vals(&Tensor::randn(&[3], DType::F32, Device::Cpu).unwrap());
    (vals(&y), grad(&x), next)
}

#[test]
fn every_random_draw_replays_when_a_checkpoint_recomputes() {
    for low in [None, Some(DType::F16), Some(DType::BF16)] {
        let plain = noisy(false, low);
        let ckpt = noisy(true, low);
        assert_eq!(ckpt, plain, "autocast {low:?}");
        assert!(plain.1.iter().any(|&g| g != 0.0));
    }
    // A recomputation that draws differently from its forward is an error, not a gradient
    // through other noise.
    let calls = Arc::new(AtomicUsize::new(0));
    let x = param(vec![1., 2.]);
    let c = calls.clone();
    let y = checkpoint(&[&x], move |xs| {
        let n = 2 + c.fetch_add(1, Ordering::Relaxed) * 8;
        let noise = Tensor::randn(&[n], DType::F32, Device::Cpu)?.narrow(0, 0, 2)?;
        xs[0].mul(&noise)
    })
    .unwrap();
    let e = y.sum_all().unwrap().backward().unwrap_err().to_string();
    assert!(e.contains("draw the same random numbers"), "{e}");
}

/// `p`'s gradient of `sum(f(w) + g(w))` with `w = 3 p` computed outside, each of `f` and `g`
/// checkpointed or not.
fn shared_weight(ck: [bool; 2], shared_input: bool, low: Option<DType>) -> Vec<f64> {
    let p = param(vec![0.5, -1.0, 2.0]);
    let x = param(vec![1.0, 2.0, 3.0]);
    let w = p.mul(3.0).unwrap();
    let _ac = low.map(|d| amp::autocast(d).unwrap());
    // tanh(x w) + x . w (a product autocast runs in the low dtype).
    let f = |x: &Tensor, w: &Tensor| {
        let dot = x.reshape(&[1, 3])?.matmul(&w.reshape(&[3, 1])?)?;
        x.mul(w)?
            .tanh()?
            .add(&dot.reshape(&[1])?.to_dtype(DType::F32)?)
    };
    let g = |x: &Tensor, w: &Tensor| x.add(w)?.sqr()?.sin();
    let one = |on: bool, k: usize| {
        let wc = w.clone();
        let body = move |xs: &[Tensor]| match (k, shared_input) {
            (0, false) => f(&xs[0], &wc),
            (0, true) => f(&xs[0], &xs[1]),
            _ => g(&xs[0], &wc),
        };
        let ins: Vec<&Tensor> = match shared_input {
            true => vec![&x, &w],
            false => vec![&x],
        };
        match on {
            true => checkpoint(&ins, body).unwrap(),
            false => body(&[x.clone(), w.clone()]).unwrap(),
        }
    };
    let y = one(ck[0], 0).add(&one(ck[1], 1)).unwrap();
    // A use of w outside every checkpoint too.
    let y = y.add(&w.mul(0.25).unwrap()).unwrap();
    drop(_ac);
    y.sum_all().unwrap().backward().unwrap();
    let mut out = grad(&p);
    out.extend(grad(&x));
    out
}

#[test]
fn a_tensor_made_outside_reaches_its_parameter_once() {
    for low in [None, Some(DType::F16)] {
        for shared_input in [false, true] {
            let plain = shared_weight([false, false], shared_input, low);
            for ck in [[true, false], [false, true], [true, true]] {
                let got = shared_weight(ck, shared_input, low);
                assert_eq!(got, plain, "{ck:?} shared input {shared_input}, {low:?}");
            }
        }
    }
    // Nested: the inner checkpoint captures the outer's captured weight.
    let p = param(vec![0.5, -1.0]);
    let x = param(vec![1.0, 2.0]);
    let w = p.exp().unwrap();
    let wc = w.clone();
    let y = checkpoint(&[&x], move |xs| {
        let w2 = wc.clone();
        let h = checkpoint(&[&xs[0]], move |ys| ys[0].mul(&w2))?;
        h.mul(&wc)?.add(&wc)
    })
    .unwrap();
    y.add(&w).unwrap().sum_all().unwrap().backward().unwrap();
    let (pv, xv) = ([0.5f64, -1.0], [1.0f64, 2.0]);
    let want: Vec<f64> = (0..2)
        .map(|i| {
            let e = pv[i].exp();
            // d/dp (x e^2p + 2 e^p) = 2 x e^2p + 2 e^p
            2.0 * xv[i] * e * e + 2.0 * e
        })
        .collect();
    assert_close(&grad(&p), &want, 1e-6, "nested");
    // A tensor made outside, returned as it is.
    let p = param(vec![0.5, -1.0]);
    let w = p.mul(2.0).unwrap();
    let wc = w.clone();
    let y = checkpoint(&[&x], move |_| Ok(wc.clone())).unwrap();
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(grad(&p), vec![2.0, 2.0]);
}

#[test]
fn integer_outputs_have_no_graph_and_gradients_none() {
    let x = param(vec![1.5, 2.5]);
    let y = checkpoint(&[&x], |xs| xs[0].to_dtype(DType::I64)).unwrap();
    assert!(!y.is_requires_grad());
    let y = custom_op(
        "floor_i64",
        &[&x],
        |xs| Ok((xs[0].to_dtype(DType::I64)?, ())),
        |_, _| Ok(vec![None]),
    )
    .unwrap();
    assert!(!y.is_requires_grad());
    // A backward returning a tensor with a graph: its gradient arrives detached.
    let w = param(vec![2.0, 3.0]);
    let wc = w.clone();
    let y = custom_op(
        "leaky",
        &[&x],
        |xs| Ok((xs[0].mul(2.0)?, ())),
        move |g, _| Ok(vec![Some(g.mul(&wc)?)]),
    )
    .unwrap();
    y.sum_all().unwrap().backward().unwrap();
    let gx = x.grad().unwrap();
    assert!(!gx.is_requires_grad());
    assert_eq!(vals(&gx), vec![2.0, 3.0]);
}

/// A small training computation: its loss and the gradients of its two leaves.
fn fwd_bwd(seed: u64, ckpt: bool) -> Vec<f64> {
    let x = f32s(&[16, 32], seed).requires_grad(true).unwrap();
    let w = f32s(&[32, 32], seed + 1).requires_grad(true).unwrap();
    let gen = Arc::new(Mutex::new(Generator::new(seed)));
    let wc = w.clone();
    let f = move |xs: &[Tensor]| {
        let mut g = gen.lock().unwrap();
        xs[0].matmul(&wc)?.tanh()?.dropout_with(0.25, true, &mut g)
    };
    let y = match ckpt {
        true => checkpoint(&[&x], f).unwrap(),
        false => f(std::slice::from_ref(&x)).unwrap(),
    };
    assert!(
        y.is_requires_grad(),
        "a forward with grad on records its graph"
    );
    let loss = y.sqr().unwrap().mean_all().unwrap();
    loss.backward().unwrap();
    let mut out = vals(&loss);
    out.extend(grad(&x));
    out.extend(grad(&w));
    out
}

#[test]
fn draws_autograd_and_checkpoints_from_rayon_tasks() {
    for threads in [4, 8] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            // The default generator from tasks whose kernels run in parallel.
            (0..64).into_par_iter().for_each(|_| {
                let r = Tensor::randn(&[1 << 16], DType::F32, Device::Cpu).unwrap();
                assert_eq!(r.numel(), 1 << 16);
            });
            // Forward and backward, checkpointed and not, side by side: every forward with
            // grad on records a graph, and a checkpoint gives the plain gradients.
            let got: Vec<(Vec<f64>, Vec<f64>)> = (0..48u64)
                .into_par_iter()
                .map(|i| (fwd_bwd(i % 6, true), fwd_bwd(i % 6, false)))
                .collect();
            for (i, (ck, plain)) in got.iter().enumerate() {
                assert_eq!(ck, plain, "task {i}, {threads} threads");
            }
            // Forwards with grad off in some tasks leave the others' grad mode alone.
            let graphs: Vec<bool> = (0..96)
                .into_par_iter()
                .map(|i| {
                    let x = f32s(&[64, 64], i).requires_grad(true).unwrap();
                    let y = if i % 2 == 0 {
                        no_grad(|| x.matmul(&x).unwrap().tanh().unwrap().sum_all().unwrap());
                        x.matmul(&x).unwrap()
                    } else {
                        x.matmul(&x).unwrap().sum_all().unwrap()
                    };
                    y.is_requires_grad()
                })
                .collect();
            assert!(graphs.iter().all(|&g| g), "{graphs:?}");
        });
    }
}

/// One batch norm (training mode) and one dropout used by two checkpointed segments: the
/// running statistics each forward updates are the module's own state, not a tensor read
/// and then changed, so backward runs, and the gradients are the plain ones.
#[test]
fn a_module_shared_by_two_checkpoints_trains_as_without_them() {
    use mantissa::nn::{BatchNorm2d, Dropout, Module};
    let run = |ckpt: bool| {
        let bn = Arc::new(BatchNorm2d::new(4).unwrap());
        let drop = Arc::new(Dropout::new(0.3, 9));
        let x = f32s(&[3, 4, 2, 2], 1).requires_grad(true).unwrap();
        let seg = {
            let (bn, drop) = (bn.clone(), drop.clone());
            move |xs: &[Tensor]| drop.forward(&bn.forward(&xs[0])?.tanh()?)
        };
        let seg2 = seg.clone();
        let h = match ckpt {
            true => checkpoint(&[&x], seg).unwrap(),
            false => seg(std::slice::from_ref(&x)).unwrap(),
        };
        let y = match ckpt {
            true => checkpoint(&[&h], seg2).unwrap(),
            false => seg2(std::slice::from_ref(&h)).unwrap(),
        };
        y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        let mut out = grad(&x);
        out.extend(bn.parameters().iter().flat_map(grad));
        out.extend(bn.named_buffers().iter().flat_map(|(_, t)| vals(t)));
        out
    };
    assert_eq!(run(true), run(false));
}

/// Runs `f` on another thread: its result, or a failure after `secs` (a deadlock must fail
/// the test, not hang it).
fn within<R: Send + 'static>(secs: u64, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(secs))
        .expect("finished in time (no lock held across a parallel kernel)")
}

/// Rayon tasks that share one model (a dropout module in training mode) and its parameters,
/// each running forward and backward with kernels large enough to split across the pool:
/// no task waits on a lock the thread it was stolen onto holds, and the parameters'
/// gradients are the sum of every task's.
#[test]
fn tasks_sharing_a_model_and_its_leaves() {
    use mantissa::nn::{Dropout, Linear, Module};
    let got = within(240, || {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(8)
            .build()
            .unwrap();
        let lin = Arc::new(Linear::new(256, 256, true, &mut Generator::new(2)).unwrap());
        let drop = Arc::new(Dropout::new(0.5, 3));
        let xs: Vec<Tensor> = (0..32).map(|i| f32s(&[256, 256], 10 + i)).collect();
        pool.install(|| {
            xs.par_iter().for_each(|x| {
                let y = drop.forward(&lin.forward(x).unwrap()).unwrap();
                y.sqr().unwrap().mean_all().unwrap().backward().unwrap();
            });
        });
        let with_dropout = lin.parameters().iter().map(grad).collect::<Vec<_>>();
        lin.parameters().iter().for_each(|p| p.zero_grad());
        // Without dropout: the sum of the tasks' gradients, whatever their order.
        pool.install(|| {
            xs.par_iter().for_each(|x| {
                let y = lin.forward(x).unwrap();
                y.sqr().unwrap().mean_all().unwrap().backward().unwrap();
            });
        });
        let parallel = lin.parameters().iter().map(grad).collect::<Vec<_>>();
        lin.parameters().iter().for_each(|p| p.zero_grad());
        for x in &xs {
            let y = lin.forward(x).unwrap();
            y.sqr().unwrap().mean_all().unwrap().backward().unwrap();
        }
        let serial = lin.parameters().iter().map(grad).collect::<Vec<_>>();
        (with_dropout, parallel, serial)
    });
    let (with_dropout, parallel, serial) = got;
    assert!(with_dropout.iter().flatten().all(|v| v.is_finite()));
    for (p, s) in parallel.iter().zip(&serial) {
        assert_close(p, s, 1e-5, "summed gradient");
    }
}
