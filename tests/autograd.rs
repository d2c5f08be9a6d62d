//! Autograd semantics: accumulation, explicit gradients, no_grad, detach, freeing the graph,
//! views sharing storage.

use mantissa::*;

fn v(x: Vec<f32>, s: &[usize]) -> Tensor {
    Tensor::from_vec(x, s, Device::Cpu).unwrap()
}

#[test]
fn gradients_accumulate_on_leaves_until_cleared() {
    let x = v(vec![1.0, 2.0], &[2]).requires_grad(true).unwrap();
    for _ in 0..2 {
        x.mul(3.0).unwrap().sum_all().unwrap().backward().unwrap();
    }
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), vec![6.0, 6.0]);
    x.zero_grad();
    assert!(x.grad().is_none());
    // A tensor used twice gets both contributions.
    x.mul(&x)
        .unwrap()
        .add(&x)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), vec![3.0, 5.0]);
}

#[test]
fn backward_with_explicit_gradient_and_non_scalar_error() {
    let x = v(vec![1.0, 2.0, 3.0], &[3]).requires_grad(true).unwrap();
    let y = x.sqr().unwrap();
    let err = y.backward().unwrap_err().to_string();
    assert!(err.contains("scalar"), "{err}");
    y.backward_with(&v(vec![1.0, 0.5, 0.0], &[3])).unwrap();
    assert_eq!(
        x.grad().unwrap().to_vec::<f32>().unwrap(),
        vec![2.0, 2.0, 0.0]
    );
}

#[test]
fn graph_is_freed_after_backward() {
    let x = v(vec![1.0, 2.0], &[2]).requires_grad(true).unwrap();
    let loss = x.exp().unwrap().sum_all().unwrap();
    loss.backward().unwrap();
    let err = loss.backward().unwrap_err().to_string();
    assert!(
        err.contains("`sum` a second time") && err.contains("retain_graph"),
        "{err}"
    );
    // Every node the pass ran is freed, intermediate ones included: a new graph built on an
    // intermediate cannot go back through it.
    let y = v(vec![1.0, 2.0], &[2]).requires_grad(true).unwrap();
    let tmp = y.mul(2.0).unwrap();
    tmp.exp().unwrap().sum_all().unwrap().backward().unwrap();
    let err = tmp.sum_all().unwrap().backward().unwrap_err().to_string();
    assert!(err.contains("`mul`"), "{err}");
}

/// `backward_retain_graph` keeps every node for another pass, through ops that save their
/// inputs, a checkpointed block that recomputes, and a custom op: two passes give twice
/// the gradient one gives, and a pass without it then frees the graph.
#[test]
fn retain_graph_runs_backward_twice() {
    let grads = |passes: usize| {
        let x = v(vec![0.5, -1.0, 2.0, 0.25], &[2, 2])
            .requires_grad(true)
            .unwrap();
        let w = v(vec![1.5, -0.5, 0.75, 2.0], &[2, 2])
            .requires_grad(true)
            .unwrap();
        let ww = w.clone();
        let h = mantissa::autograd::checkpoint(&[&x], move |xs| xs[0].matmul(&ww)?.tanh()).unwrap();
        let cube = mantissa::autograd::custom_op(
            "cube",
            &[&h],
            |hs| Ok((hs[0].pow(3.0)?, hs[0].clone())),
            |g, h| Ok(vec![Some(g.mul(&h.sqr()?.mul(3.0)?)?)]),
        )
        .unwrap();
        let loss = cube
            .mul(&x)
            .unwrap()
            .softmax(1)
            .unwrap()
            .log()
            .unwrap()
            .sum_all()
            .unwrap();
        for _ in 1..passes {
            loss.backward_retain_graph().unwrap();
        }
        loss.backward().unwrap();
        let err = loss.backward().unwrap_err().to_string();
        assert!(err.contains("a second time"), "{err}");
        let read = |t: &Tensor| t.grad().unwrap().to_vec::<f32>().unwrap();
        (read(&x), read(&w))
    };
    let (x1, w1) = grads(1);
    let (x3, w3) = grads(3);
    assert!(
        x1.iter().chain(&w1).any(|g| g.abs() > 1e-3),
        "{x1:?} {w1:?}"
    );
    for (one, three) in x1.iter().chain(&w1).zip(x3.iter().chain(&w3)) {
        assert!(
            (three - 3.0 * one).abs() <= 1e-5 * (1.0 + one.abs()),
            "{one} {three}"
        );
    }
}

#[test]
fn no_grad_and_detach_cut_the_graph() {
    let x = v(vec![1.0], &[1]).requires_grad(true).unwrap();
    let y = no_grad(|| x.mul(2.0)).unwrap();
    assert!(!y.is_requires_grad() && y.is_leaf());
    assert!(is_grad_enabled());
    {
        let _g = NoGradGuard::new();
        assert!(!is_grad_enabled());
        {
            let _inner = NoGradGuard::new();
        }
        assert!(!is_grad_enabled(), "inner guard restores the outer state");
    }
    assert!(is_grad_enabled());
    let d = x.mul(2.0).unwrap().detach();
    assert!(!d.is_requires_grad());
    let err = d.exp().unwrap().sum_all().unwrap().backward().unwrap_err();
    assert!(err.to_string().contains("does not require grad"));
    // Setting requires_grad on a non-leaf is refused; on an integer tensor too.
    assert!(x.mul(2.0).unwrap().requires_grad(true).is_err());
    let i = Tensor::from_vec(vec![1i64], &[1], Device::Cpu).unwrap();
    assert!(i.requires_grad(true).is_err());
}

#[test]
fn views_share_storage_and_in_place_copies_show_through() {
    let base = Tensor::arange(0.0, 6.0, 1.0, DType::F32, Device::Cpu)
        .unwrap()
        .reshape(&[2, 3])
        .unwrap();
    let col = base.narrow(1, 1, 1).unwrap();
    assert!(col.shares_storage(&base));
    assert!(!col.is_contiguous());
    let before = base.version();
    col.copy_(&v(vec![10.0, 20.0], &[2, 1])).unwrap();
    assert!(base.version() > before);
    assert_eq!(
        base.to_vec::<f32>().unwrap(),
        vec![0.0, 10.0, 2.0, 3.0, 20.0, 5.0]
    );
    let t = base.t().unwrap();
    assert_eq!(t.shape(), &[3, 2]);
    assert_eq!(
        t.to_vec::<f32>().unwrap(),
        vec![0.0, 3.0, 10.0, 20.0, 2.0, 5.0]
    );
    let e = v(vec![1.0, 2.0], &[2, 1]).expand(&[2, 3]).unwrap();
    assert_eq!(e.strides(), &[1, 0]);
    assert_eq!(
        e.contiguous().unwrap().to_vec::<f32>().unwrap(),
        vec![1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    );
}

#[test]
fn seeded_random_tensors_repeat() {
    manual_seed(42);
    let a = Tensor::randn(&[5], DType::F32, Device::Cpu).unwrap();
    manual_seed(42);
    let b = Tensor::randn(&[5], DType::F32, Device::Cpu).unwrap();
    assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    let c = Tensor::randn(&[5], DType::F32, Device::Cpu).unwrap();
    assert_ne!(a.to_vec::<f32>().unwrap(), c.to_vec::<f32>().unwrap());
    let mut g = Generator::new(1);
    let d = Tensor::ones(&[10000], DType::F32, Device::Cpu)
        .unwrap()
        .dropout_with(0.25, true, &mut g)
        .unwrap();
    let kept = d
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .filter(|&&x| x != 0.0)
        .count();
    assert!((7300..7700).contains(&kept), "{kept}");
    assert!(d
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .all(|&x| x == 0.0 || (x - 4.0 / 3.0).abs() < 1e-6));
    let e = Tensor::ones(&[4], DType::F32, Device::Cpu)
        .unwrap()
        .dropout(0.5, false)
        .unwrap();
    assert_eq!(e.to_vec::<f32>().unwrap(), vec![1.0; 4]);
}

/// The block counter runs modulo 2^64, as Philox's does: a generator at its last block
/// draws every value asked for, going on from block 0, on the host, in tensors and through a
/// state saved as a checkpoint saves it (issue 40, item 7: 0 values, or an overflow panic).
#[test]
fn generator_streams_wrap_at_the_end_of_the_counter() {
    let end = u64::MAX;
    let mut g = Generator::at(3, end);
    let got = g.normal(4);
    let want = [Generator::at(3, end).normal(2), Generator::new(3).normal(2)].concat();
    assert_eq!(got, want);
    assert_eq!(g.offset(), 1);
    let words = Generator::at(3, end - 1).next_u32s(16);
    assert_eq!(words[8..], Generator::new(3).next_u32s(8)[..]);
    assert_eq!(Generator::at(3, end).uniform(5).len(), 5);
    let mut g = Generator::at(3, end);
    let t = Tensor::randn_with(&[5], 0.0, 1.0, DType::F64, Device::Cpu, &mut g).unwrap();
    assert_eq!(t.to_vec::<f64>().unwrap(), Generator::at(3, end).normal(5));
    assert_eq!(g.offset(), 2);
    let mut g = Generator::at(3, end);
    let t = Tensor::rand_with(&[3], 0.0, 1.0, DType::F64, Device::Cpu, &mut g).unwrap();
    assert_eq!(t.to_vec::<f64>().unwrap(), Generator::at(3, end).uniform(3));
    let x = Tensor::ones(&[8], DType::F32, Device::Cpu).unwrap();
    let y = x
        .dropout_with(0.5, true, &mut Generator::at(3, end))
        .unwrap();
    assert_eq!(y.numel(), 8);
    let saved = Generator::at(3, end).to_tensor().unwrap();
    let mut back = Generator::from_tensor(&saved).unwrap();
    assert_eq!(back.normal(4), want);
}

/// Dropout's mask follows its stream definition: element `i` is kept when word `i` of the
/// generator's Philox stream (block `i / 4`, lane `i % 4`, from the generator's offset on) is
/// at least `p * 2^32`; the generator then moves past those blocks. Checked over several
/// parallel chunks, for f32 and bf16, and after an earlier draw.
#[test]
fn dropout_mask_follows_the_philox_stream() {
    for (dtype, p, n) in [(DType::F32, 0.3, 50_001), (DType::BF16, 0.75, 9_000)] {
        let mut g = Generator::new(77);
        g.next_u32s(8); // two blocks used before
        let x = Tensor::full(&[n], 2.0, dtype, Device::Cpu).unwrap();
        let y = x.dropout_with(p, true, &mut g).unwrap();
        let y = y.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(g.offset(), 2 + n.div_ceil(4) as u64);
        let threshold = (p * 4_294_967_296.0).ceil() as u64;
        let scaled = half::bf16::from_f64(2.0 / (1.0 - p)).to_f64();
        for (i, v) in y.iter().enumerate() {
            let b = 2 + (i / 4) as u64;
            let w = mantissa::random::philox([b as u32, (b >> 32) as u32, 0, 0], [77, 0])[i % 4];
            let want = if w as u64 >= threshold { scaled } else { 0.0 };
            assert!(
                (*v as f64 - want).abs() <= 0.01 * want,
                "{dtype:?} element {i}: {v} vs {want}"
            );
        }
        let kept = y.iter().filter(|v| **v != 0.0).count() as f64 / n as f64;
        assert!((kept - (1.0 - p)).abs() < 0.02, "{dtype:?} kept {kept}");
    }
}

#[test]
fn scalar_conversions_and_item() {
    let x = Tensor::full(&[1, 1], 2.5, DType::BF16, Device::Cpu).unwrap();
    assert_eq!(x.item().unwrap(), 2.5);
    assert!(Tensor::ones(&[2], DType::F32, Device::Cpu)
        .unwrap()
        .item()
        .is_err());
    assert!(x.to_vec::<f32>().is_err());
    assert_eq!(x.to_vec::<bf16>().unwrap(), vec![bf16::from_f32(2.5)]);
    let i = Tensor::arange(0.0, 3.0, 1.0, DType::F32, Device::Cpu)
        .unwrap()
        .to_dtype(DType::I64)
        .unwrap();
    assert_eq!(i.to_vec::<i64>().unwrap(), vec![0, 1, 2]);
}

/// Gradients of products large enough that the backward runs its two products side by side
/// on the CPU equal those computed directly in f64, from the test thread, from inside the
/// compute pool and with autocast active around the backward call (backward ops run in the
/// forward's dtypes).
#[test]
fn matmul_gradients_computed_side_by_side_are_exact() {
    let mut gen = Generator::new(7);
    let mut r = |s: &[usize]| Tensor::randn_with(s, 0.0, 1.0, DType::F32, Device::Cpu, &mut gen);
    let (x, w, b, wy) = (
        r(&[128, 512]).unwrap(),
        r(&[384, 512]).unwrap(),
        r(&[384]).unwrap(),
        r(&[128, 384]).unwrap(),
    );
    let (a3, b3, wz) = (
        r(&[4, 64, 128]).unwrap(),
        r(&[4, 128, 256]).unwrap(),
        r(&[4, 64, 256]).unwrap(),
    );
    let f64s = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
    let close = |got: &Tensor, want: Tensor, what: &str| {
        let (g, w) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
        assert_eq!(got.shape(), want.shape(), "{what}");
        let num: f64 = g.iter().zip(&w).map(|(a, b)| (a - b).powi(2)).sum();
        let den: f64 = w.iter().map(|b| b * b).sum();
        let err = (num / den).sqrt();
        assert!(err < 1e-6, "{what}: relative error {err:e}");
    };
    // d/dx sum(wy * (x w^T + b)) = wy w, d/dw = wy^T x, d/db = column sums of wy; for
    // sum(wz * (a3 @ b3)): wz b3^T and a3^T wz.
    let want = [
        f64s(&wy).matmul(&f64s(&w)).unwrap(),
        f64s(&wy).t().unwrap().matmul(&f64s(&x)).unwrap(),
        f64s(&wy).sum(&[0], false).unwrap(),
        f64s(&wz)
            .matmul(&f64s(&b3).transpose(1, 2).unwrap())
            .unwrap(),
        f64s(&a3)
            .transpose(1, 2)
            .unwrap()
            .matmul(&f64s(&wz))
            .unwrap(),
    ];
    let run = |in_autocast: bool| {
        let leaves = [&x, &w, &b, &a3, &b3].map(|t| t.detach().requires_grad(true).unwrap());
        let y = leaves[0].linear(&leaves[1], Some(&leaves[2])).unwrap();
        let z = leaves[3].matmul(&leaves[4]).unwrap();
        let loss = y.mul(&wy).unwrap().sum_all().unwrap();
        let loss = loss.add(&z.mul(&wz).unwrap().sum_all().unwrap()).unwrap();
        match in_autocast {
            true => amp::with_autocast(DType::BF16, || loss.backward()).unwrap(),
            false => loss.backward(),
        }
        .unwrap();
        leaves.map(|l| l.grad().unwrap())
    };
    let names = ["x", "w", "bias", "a", "b"];
    for (mode, grads) in [
        ("test thread", run(false)),
        ("compute pool", in_compute_pool(|| run(false))),
        ("backward under autocast", run(true)),
    ] {
        for ((g, want), name) in grads.iter().zip(want.clone()).zip(names) {
            assert_eq!(g.dtype(), DType::F32, "{mode}: {name}");
            close(g, want, &format!("{mode}: gradient of {name}"));
        }
    }
}

/// A tensor a backward reads (an op's input or output), written in place after the forward,
/// makes backward an `Err` naming the op (PyTorch's saved-tensor version check) instead of a
/// silently wrong gradient; ops that read nothing (add) still run, and writes after
/// backward are fine.
#[test]
fn in_place_writes_to_saved_tensors_fail_backward() {
    let ones = |n: usize| v(vec![1.0; n], &[n]);
    let m = |r: Result<()>| r.unwrap_err().to_string();
    // exp reads its input.
    let x = v(vec![0.5, -1.0, 2.0, 0.0], &[4])
        .requires_grad(true)
        .unwrap();
    let a = x.mul(2.0).unwrap();
    let y = a.exp().unwrap();
    a.detach().copy_(&ones(4)).unwrap();
    let e = m(y.sum_all().unwrap().backward());
    assert!(
        e.contains("`exp`") && e.contains("modified in place"),
        "{e}"
    );
    // matmul reads both operands: a constant input written before backward.
    let w = v(vec![0.5; 6], &[3, 2]).requires_grad(true).unwrap();
    let h = v(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let out = h.matmul(&w).unwrap();
    h.copy_(&v(vec![0.0; 6], &[2, 3])).unwrap();
    let e = m(out.sum_all().unwrap().backward());
    assert!(e.contains("`matmul`") && e.contains("[2, 3]"), "{e}");
    // An optimizer step between forward and backward writes the weight linear reads (for
    // the gradient of an input that requires grad).
    let w = v(vec![0.5; 6], &[2, 3]).requires_grad(true).unwrap();
    let mut opt = optim::Sgd::new(vec![w.clone()], optim::SgdConfig::new(0.1)).unwrap();
    let h = v(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])
        .requires_grad(true)
        .unwrap();
    let out = h.linear(&w, None).unwrap().sum_all().unwrap();
    w.set_grad(Some(v(vec![1.0; 6], &[2, 3]))).unwrap();
    optim::Optimizer::step(&mut opt).unwrap();
    let e = m(out.backward());
    assert!(e.contains("`linear`"), "{e}");
    // softmax reads its output.
    let z = v(vec![0.1, 0.2, 0.3], &[3]).requires_grad(true).unwrap();
    let s = z.softmax(0).unwrap();
    // A tensor in the graph is not written in place with grad mode on (as in PyTorch)...
    let e = s.copy_(&ones(3)).unwrap_err().to_string();
    assert!(e.contains("copy_") && e.contains("no_grad"), "{e}");
    let e = z.copy_(&ones(3)).unwrap_err().to_string();
    assert!(e.contains("leaf"), "{e}");
    // ...but its storage can be, through a detached view, and then backward refuses.
    s.detach().copy_(&ones(3)).unwrap();
    let e = m(s.mul(&ones(3)).unwrap().sum_all().unwrap().backward());
    assert!(e.contains("softmax"), "{e}");
    // add reads no values: its inputs may change, as in PyTorch.
    let p = v(vec![1.0, 2.0], &[2]).requires_grad(true).unwrap();
    let q = v(vec![3.0, 4.0], &[2]);
    let sum = p.add(&q).unwrap().sum_all().unwrap();
    q.copy_(&ones(2)).unwrap();
    sum.backward().unwrap();
    assert_eq!(p.grad().unwrap().to_vec::<f32>().unwrap(), vec![1.0, 1.0]);
    // After backward the graph is gone and writes are free.
    let r = v(vec![1.0, 2.0], &[2]).requires_grad(true).unwrap();
    let t = r.mul(&r).unwrap();
    t.sum_all().unwrap().backward().unwrap();
    r.detach().copy_(&ones(2)).unwrap();
    assert_eq!(r.grad().unwrap().to_vec::<f32>().unwrap(), vec![2.0, 4.0]);
}
