//! The everyday tensor API beyond the PyTorch cases of `tests/torch_reference.rs`: gradients
//! of the new views, scans and reductions by finite differences, printing, in-place
//! arithmetic with its version checks, `randint`, and sums through infinities.

mod common;
use common::*;
use mantissa::*;

#[test]
fn views_scans_and_reductions_pass_gradcheck() {
    let x = || grid_leaf(&[4, 6], 11, 0.37);
    gradcheck(&[x()], |t| t[0].slice(1, -5, Some(6), 2));
    gradcheck(&[x()], |t| {
        t[0].slice(0, 1, None, 3)?.mul(&t[0].select(0, 2)?)
    });
    gradcheck(&[x()], |t| {
        Tensor::cat(&t[0].chunk(4, 1)?.iter().rev().collect::<Vec<_>>(), 1)
    });
    gradcheck(&[x()], |t| t[0].repeat(&[2, 1, 3]));
    gradcheck(&[x()], |t| t[0].view(&[3, -1])?.sqr());
    gradcheck(&[x()], |t| t[0].cumsum(1)?.mul(&t[0]));
    gradcheck(&[x()], |t| t[0].cumsum(0));
    gradcheck(&[x()], |t| t[0].prod(1, false));
    gradcheck(&[x()], |t| t[0].prod(0, true));
    gradcheck(&[grid_leaf(&[3, 2], 12, 0.61)], |t| t[0].prod_all());
    gradcheck(&[x()], |t| t[0].logsumexp(&[1], false));
    gradcheck(&[x()], |t| t[0].logsumexp(&[], true));
}

/// A product's gradient where elements are zero: with one zero in a row, only the zero's
/// entry is nonzero (the product of the others); with two, all are zero.
#[test]
fn prod_gradient_through_zeros() {
    let x = Tensor::from_vec(vec![2.0f64, 0.0, 3.0, 0.0, 0.0, 5.0], &[2, 3], Device::Cpu)
        .unwrap()
        .requires_grad(true)
        .unwrap();
    x.prod(1, false)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(vals(&x.grad().unwrap()), vec![0.0, 6.0, 0.0, 0.0, 0.0, 0.0]);
}

#[test]
fn scans_in_half_precision_stay_close_to_f32() {
    let x = f32s(&[3, 200], 4);
    let want = vals(&x.cumsum(1).unwrap());
    for dt in [DType::F16, DType::BF16] {
        let h = x.to_dtype(dt).unwrap();
        let got = h.cumsum(1).unwrap();
        assert_eq!(got.dtype(), dt);
        // The sums are accumulated in f32: the error is the inputs' and the output's rounding.
        let from_rounded = vals(&h.to_dtype(DType::F32).unwrap().cumsum(1).unwrap());
        let tol = if dt == DType::F16 { 2e-3 } else { 1.6e-2 };
        assert!(rel_err(&vals(&got), &from_rounded) < tol, "{dt:?}");
        assert!(rel_err(&vals(&got), &want) < 4.0 * tol, "{dt:?}");
    }
}

#[test]
fn indexing_mistakes_are_errors() {
    let x = f32s(&[3, 4], 1);
    let e = x.select(1, 4).unwrap_err().to_string();
    assert!(e.contains("select") && e.contains("index 4"), "{e}");
    assert!(x.select(1, -5).is_err());
    assert!(x.select(2, 0).is_err());
    let e = x.slice(0, 0, None, 0).unwrap_err().to_string();
    assert!(e.contains("step"), "{e}");
    assert_eq!(x.slice(0, 5, Some(9), 1).unwrap().shape(), &[0, 4]);
    assert!(x.chunk(0, 0).is_err());
    let e = x.t().unwrap().view(&[12]).unwrap_err().to_string();
    assert!(e.contains("reshape"), "{e}");
    assert!(x.view(&[5, -1]).is_err());
    let e = x.repeat(&[2]).unwrap_err().to_string();
    assert!(e.contains("one per dim"), "{e}");
    assert!(x.repeat(&[usize::MAX, 2]).is_err());
    assert!(x.logsumexp(&[2], false).is_err());
    assert!(x.cumsum(-3).is_err());
    let i = Tensor::from_vec(vec![1i64, 2], &[2], Device::Cpu).unwrap();
    assert!(i.logsumexp(&[], false).is_err());
}

#[test]
fn sums_through_infinities_are_infinite() {
    // Long enough for the blocked, compensated path (blocks of 1024) as well as short rows.
    for n in [3, 5000] {
        let mut v = vec![0.5f32; n];
        v[n / 2] = f32::INFINITY;
        let x = Tensor::from_vec(v.clone(), &[1, n], Device::Cpu).unwrap();
        assert_eq!(x.sum_all().unwrap().item().unwrap(), f64::INFINITY, "{n}");
        assert_eq!(vals(&x.sum(&[1], false).unwrap()), vec![f64::INFINITY]);
        assert_eq!(x.mean_all().unwrap().item().unwrap(), f64::INFINITY);
        v[0] = f32::NEG_INFINITY;
        let y = Tensor::from_vec(v, &[n], Device::Cpu).unwrap();
        assert!(y.sum_all().unwrap().item().unwrap().is_nan(), "inf - inf");
    }
    let x = Tensor::from_vec(vec![1.0f32, f32::INFINITY, 2.0], &[3], Device::Cpu).unwrap();
    assert_eq!(
        x.logsumexp(&[], false).unwrap().item().unwrap(),
        f64::INFINITY
    );
}

#[test]
fn printing_shows_values_shape_dtype_and_graph() {
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3], Device::Cpu)
        .unwrap()
        .requires_grad(true)
        .unwrap();
    assert_eq!(
        x.to_string(),
        "tensor([1., 2., 3.], shape=[3], dtype=F32, requires_grad=true)"
    );
    let y = x.mul(1e-5).unwrap();
    assert_eq!(
        format!("{y:?}"),
        "tensor([1.0000e-05, 2.0000e-05, 3.0000e-05], shape=[3], dtype=F32, grad_fn=<mul>)"
    );
    let i = Tensor::arange(0.0, 12.0, 1.0, DType::I64, Device::Cpu)
        .unwrap()
        .reshape(&[2, 2, 3])
        .unwrap();
    assert_eq!(
        i.to_string(),
        "tensor([[[ 0,  1,  2],\n         [ 3,  4,  5]],\n\n        [[ 6,  7,  8],\n         \
         [ 9, 10, 11]]], shape=[2, 2, 3], dtype=I64)"
    );
    // Past 1000 elements, long dims show their first and last three; 1999 over 1 is past
    // 1000, so scientific form, rows wrapped at 80 columns (PyTorch 2.15's output for
    // `torch.arange(2000.).reshape(2, 1000)`, then the engine's suffix).
    let big = Tensor::arange(0.0, 2000.0, 1.0, DType::F32, Device::Cpu)
        .unwrap()
        .reshape(&[2, 1000])
        .unwrap();
    assert_eq!(
        big.to_string(),
        concat!(
            "tensor([[0.0000e+00, 1.0000e+00, 2.0000e+00,  ..., 9.9700e+02, 9.9800e+02,\n",
            "         9.9900e+02],\n",
            "        [1.0000e+03, 1.0010e+03, 1.0020e+03,  ..., 1.9970e+03, 1.9980e+03,\n",
            "         1.9990e+03]], shape=[2, 1000], dtype=F32)",
        )
    );
    let h = Tensor::full(&[], f64::NAN, DType::BF16, Device::Cpu).unwrap();
    assert_eq!(h.to_string(), "tensor(nan, shape=[], dtype=BF16)");
}

#[test]
fn in_place_arithmetic_bumps_versions_and_guards_the_graph() {
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2], Device::Cpu).unwrap();
    let v0 = x.version();
    let row = Tensor::from_vec(vec![10.0f32, 20.0], &[2], Device::Cpu).unwrap();
    x.add_(&row).unwrap();
    x.mul_(0.5).unwrap();
    assert_eq!(vals(&x), vec![5.5, 11.0, 6.5, 12.0]);
    assert!(x.version() >= v0 + 2);
    // A view shares the write.
    let first = x.select(0, 0).unwrap();
    first.fill_(-1.0).unwrap();
    assert_eq!(vals(&x), vec![-1.0, -1.0, 6.5, 12.0]);
    x.zero_().unwrap();
    assert_eq!(vals(&x), vec![0.0; 4]);
    // The result must fit: [2] += [2, 2] does not, nor a float into an integer tensor.
    let e = row.add_(&x).unwrap_err().to_string();
    assert!(e.contains("add_"), "{e}");
    let idx = Tensor::from_vec(vec![1i64, 2], &[2], Device::Cpu).unwrap();
    idx.add_(1).unwrap();
    assert_eq!(idx.to_vec::<i64>().unwrap(), vec![2, 3]);
    assert!(idx.mul_(0.5).is_err());
    // A parameter is written only under no_grad; an operand that requires grad is refused.
    let w = x.detach().requires_grad(true).unwrap();
    assert!(w.add_(1.0).is_err());
    no_grad(|| w.add_(1.0)).unwrap();
    assert_eq!(vals(&w), vec![1.0; 4]);
    let e = x.add_(&w).unwrap_err().to_string();
    assert!(e.contains("requires grad"), "{e}");
    // A tensor a backward reads, changed in place, makes that backward an error.
    let a = f32s(&[3], 2).requires_grad(true).unwrap();
    let b = f32s(&[3], 3);
    let y = a.mul(&b).unwrap().sum_all().unwrap();
    b.mul_(2.0).unwrap();
    let e = y.backward().unwrap_err().to_string();
    assert!(e.contains("modified in place"), "{e}");
}

#[test]
fn randint_eye_and_linspace() {
    let mut g = Generator::new(7);
    let t = Tensor::randint(-3, 4, &[4000], DType::I64, Device::Cpu, &mut g).unwrap();
    let v = t.to_vec::<i64>().unwrap();
    for k in -3..4 {
        let count = v.iter().filter(|&&x| x == k).count();
        // 4000 / 7 = 571 each; a binomial's standard deviation is about 22.
        assert!((470..680).contains(&count), "{k}: {count}");
    }
    let again = Tensor::randint(
        -3,
        4,
        &[4000],
        DType::I64,
        Device::Cpu,
        &mut Generator::new(7),
    );
    assert_eq!(again.unwrap().to_vec::<i64>().unwrap(), v, "seeded");
    assert!(Tensor::randint(3, 3, &[2], DType::I64, Device::Cpu, &mut g).is_err());
    assert!(Tensor::randint(0, 300, &[2], DType::U8, Device::Cpu, &mut g).is_err());
    assert!(Tensor::randint(0, 1 << 60, &[2], DType::I64, Device::Cpu, &mut g).is_err());
    let f = Tensor::randint(0, 10, &[50], DType::F32, Device::Cpu, &mut g).unwrap();
    assert!(vals(&f)
        .iter()
        .all(|x| x.fract() == 0.0 && (0.0..10.0).contains(x)));
    assert_eq!(
        Tensor::eye(2, 2, DType::I64, Device::Cpu)
            .unwrap()
            .to_vec::<i64>()
            .unwrap(),
        vec![1, 0, 0, 1]
    );
    assert!(Tensor::linspace(0.0, f64::INFINITY, 3, DType::F32, Device::Cpu).is_err());
    let l = Tensor::linspace(-1.0, 1.0, 7, DType::F64, Device::Cpu).unwrap();
    assert_eq!(vals(&l)[0], -1.0);
    assert_eq!(vals(&l)[6], 1.0);
}

#[test]
fn sorting_passes_gradcheck_and_refuses_a_k_past_the_dim() {
    // Normal values: no two equal, so the sorted order is locally constant.
    let x = || leaf(&[4, 6], 13);
    gradcheck(&[x()], |t| t[0].sort(1, false)?.0.mul(&t[0]));
    gradcheck(&[x()], |t| Ok(t[0].sort(0, true)?.0));
    gradcheck(&[x()], |t| Ok(t[0].topk(3, 1, true)?.0));
    gradcheck(&[x()], |t| t[0].topk(2, 0, false)?.0.sqr());
    let x = f32s(&[3, 4], 1);
    let e = x.topk(5, 1, true).unwrap_err().to_string();
    assert!(e.contains("topk") && e.contains("k 5"), "{e}");
    assert!(x.sort(2, false).is_err() && x.argsort(-3, false).is_err());
    // A 0-d tensor sorts to itself, index 0; its top 1 is itself.
    let s = Tensor::scalar(2.5, DType::F32, Device::Cpu).unwrap();
    let (v, i) = s.sort(0, true).unwrap();
    assert_eq!((v.shape(), i.shape()), (&[][..], &[][..]));
    assert_eq!(
        (v.item().unwrap(), i.to_vec::<i64>().unwrap()),
        (2.5, vec![0])
    );
    assert_eq!(s.topk(1, -1, true).unwrap().0.item().unwrap(), 2.5);
    assert!(s.topk(2, 0, true).is_err());
    // An empty dim sorts to nothing; an empty other dim too.
    for shape in [[3, 0], [0, 4]] {
        let e = Tensor::zeros(&shape, DType::F32, Device::Cpu).unwrap();
        let (v, i) = e.sort(1, false).unwrap();
        assert_eq!((v.shape(), i.shape()), (&shape[..], &shape[..]));
    }
    // Integers sort too (no gradient), stably.
    let n = Tensor::from_vec(vec![2i64, -1, 2, 0, -1], &[5], Device::Cpu).unwrap();
    let (v, i) = n.sort(0, true).unwrap();
    assert_eq!(v.to_vec::<i64>().unwrap(), vec![2, 2, 0, -1, -1]);
    assert_eq!(i.to_vec::<i64>().unwrap(), vec![0, 2, 3, 1, 4]);
}
