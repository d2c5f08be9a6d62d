//! Autocast: region state, the per-op cast policy, the weight-cast cache, and gradients under
//! autocast against f32 gradients.

mod common;
use common::*;
use mantissa::nn::*;
use mantissa::*;
use proptest::prelude::*;

#[test]
fn regions_nest_disable_and_restore_on_every_exit() {
    assert_eq!(amp::active_dtype(), None);
    {
        let _a = amp::autocast(DType::BF16).unwrap();
        assert_eq!(amp::active_dtype(), Some(DType::BF16));
        {
            let _b = amp::autocast(DType::F16).unwrap();
            assert_eq!(amp::active_dtype(), Some(DType::F16));
            {
                let _off = amp::autocast_disabled();
                assert_eq!(amp::active_dtype(), None);
            }
            assert_eq!(amp::active_dtype(), Some(DType::F16));
        }
        assert_eq!(amp::active_dtype(), Some(DType::BF16));
    }
    assert_eq!(amp::active_dtype(), None);
    // An error inside the closure form, and a panic inside a region, both restore the state.
    let r: Result<Result<()>> =
        amp::with_autocast(DType::F16, || Err(Error::Autograd("boom".into())));
    assert!(r.unwrap().is_err());
    assert_eq!(amp::active_dtype(), None);
    let caught = std::panic::catch_unwind(|| {
        let _g = amp::autocast(DType::F16).unwrap();
        panic!("inside a region");
    });
    assert!(caught.is_err());
    assert_eq!(amp::active_dtype(), None);
    assert!(amp::autocast(DType::F32).is_err());
}

#[test]
fn ops_follow_the_cast_policy() {
    let (a, b) = (f32s(&[4, 3], 1), f32s(&[3, 5], 2));
    let bias = f32s(&[5], 3);
    let img = f32s(&[2, 3, 6, 6], 4);
    let k = f32s(&[4, 3, 3, 3], 5);
    let t = Tensor::from_vec(vec![0i64, 2, 1, 4], &[4], Device::Cpu).unwrap();
    for low in [DType::F16, DType::BF16] {
        let _g = amp::autocast(low).unwrap();
        let h = a.to_dtype(low).unwrap();
        // Lower precision.
        assert_eq!(a.matmul(&b).unwrap().dtype(), low);
        assert_eq!(
            a.linear(&b.t().unwrap(), Some(&bias)).unwrap().dtype(),
            low,
            "bias cast too"
        );
        assert_eq!(
            img.conv2d(&k, None, Conv2dOptions::default())
                .unwrap()
                .dtype(),
            low
        );
        // f32.
        assert_eq!(h.exp().unwrap().dtype(), DType::F32);
        assert_eq!(h.softplus().unwrap().dtype(), DType::F32);
        assert_eq!(h.softmax(1).unwrap().dtype(), DType::F32);
        assert_eq!(h.log_softmax(1).unwrap().dtype(), DType::F32);
        assert_eq!(h.sum_all().unwrap().dtype(), DType::F32);
        let logits = a.matmul(&b).unwrap();
        assert_eq!(
            logits
                .cross_entropy(&t, Default::default())
                .unwrap()
                .dtype(),
            DType::F32
        );
        assert_eq!(
            h.layer_norm(&[3], None, None, 1e-5).unwrap().dtype(),
            DType::F32
        );
        // Promote and passthrough.
        assert_eq!(h.add(&a).unwrap().dtype(), DType::F32);
        assert_eq!(h.relu().unwrap().dtype(), low);
        assert_eq!(a.relu().unwrap().dtype(), DType::F32);
        let hi = img.to_dtype(low).unwrap();
        assert_eq!(
            hi.batch_norm(None, None, None, None, true, 0.1, 1e-5)
                .unwrap()
                .dtype(),
            low
        );
        // f64 and integer inputs are never cast.
        let d = a.to_dtype(DType::F64).unwrap();
        assert_eq!(
            d.matmul(&b.to_dtype(DType::F64).unwrap()).unwrap().dtype(),
            DType::F64
        );
        assert_eq!(d.exp().unwrap().dtype(), DType::F64);
        assert_eq!(
            a.index_select(0, &Tensor::from_vec(vec![1i64], &[1], Device::Cpu).unwrap())
                .unwrap()
                .dtype(),
            DType::F32
        );
    }
    // Outside the region nothing is cast.
    assert_eq!(a.matmul(&b).unwrap().dtype(), DType::F32);
}

#[test]
fn weights_are_cast_once_per_region_and_never_stale() {
    let w = f32s(&[3, 4], 6).requires_grad(true).unwrap();
    let x = f32s(&[2, 4], 7);
    {
        let _g = amp::autocast(DType::F16).unwrap();
        let y1 = x.linear(&w, None).unwrap();
        let y2 = x.linear(&w, None).unwrap();
        assert_eq!(amp::cached_casts(), 1, "one cast for two uses");
        assert_eq!(vals(&y1), vals(&y2));
        // An in-place update changes the version: the next use casts the new values.
        no_grad(|| w.copy_(&w.mul(2.0).unwrap())).unwrap();
        let y3 = x.linear(&w, None).unwrap();
        assert_eq!(amp::cached_casts(), 2);
        let want = vals(&y1).iter().map(|v| 2.0 * v).collect::<Vec<_>>();
        assert_close(&vals(&y3), &want, 1e-3, "fresh cast after the update");
        // Not filled under no_grad; kept through a nested region.
        no_grad(|| {
            x.linear(
                &w.mul(1.0).unwrap().detach().requires_grad(true).unwrap(),
                None,
            )
        })
        .unwrap();
        assert_eq!(amp::cached_casts(), 2);
        {
            let _inner = amp::autocast(DType::F16).unwrap();
        }
        assert_eq!(amp::cached_casts(), 2, "only the outermost exit clears");
    }
    assert_eq!(amp::cached_casts(), 0);
}

/// Gradients of a small model's parameters, with the loss computed under `low` autocast
/// (or in f32 when `None`).
fn grads(model: &dyn Module, x: &Tensor, y: &Tensor, low: Option<DType>) -> Vec<Vec<f64>> {
    model.zero_grad();
    let loss = match low {
        Some(d) => amp::with_autocast(d, || model.forward(x)?.cross_entropy(y, Default::default()))
            .unwrap(),
        None => model
            .forward(x)
            .and_then(|o| o.cross_entropy(y, Default::default())),
    }
    .unwrap();
    assert_eq!(loss.dtype(), DType::F32);
    loss.backward().unwrap();
    model
        .parameters()
        .iter()
        .map(|p| {
            let g = p.grad().unwrap();
            assert_eq!(
                g.dtype(),
                DType::F32,
                "gradients of f32 parameters stay f32"
            );
            vals(&g)
        })
        .collect()
}

/// Norm-wise bands over the whole model's gradient (one vector of every parameter's
/// gradient; a single small bias gradient is a sum with cancellation, so its own relative
/// error says little): half rounding of activations and of the low-precision GEMM operands
/// through two or three layers (f16 has 11 significant bits, bf16 8).
fn compare(model: &dyn Module, x: &Tensor, y: &Tensor) {
    let reference = grads(model, x, y, None).concat();
    for (low, band) in [(DType::F16, 1e-2), (DType::BF16, 5e-2)] {
        let got = grads(model, x, y, Some(low)).concat();
        assert_close(&got, &reference, band, &format!("{low:?} model gradient"));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 8, ..ProptestConfig::default() })]

    #[test]
    fn mlp_gradients_under_autocast_match_f32(batch in 4usize..16, hidden in 8usize..48, seed in any::<u64>()) {
        let mut g = Generator::new(seed);
        let model = Sequential::new()
            .push(Linear::new(20, hidden, true, &mut g).unwrap())
            .push(Activation::Gelu)
            .push(Linear::new(hidden, 5, true, &mut g).unwrap());
        let x = f32s(&[batch, 20], seed ^ 1);
        let labels: Vec<i64> = g.next_u32s(batch).iter().map(|v| (v % 5) as i64).collect();
        let y = Tensor::from_vec(labels, &[batch], Device::Cpu).unwrap();
        compare(&model, &x, &y);
    }

    #[test]
    fn lstm_gradients_under_autocast_match_f32(batch in 2usize..5, steps in 2usize..6, hidden in 4usize..12, seed in any::<u64>()) {
        let mut g = Generator::new(seed);
        let model = Sequential::new()
            .push(Lstm::new(6, hidden, 2, true, &mut g).unwrap())
            .push(Flatten)
            .push(Linear::new(steps * hidden, 3, true, &mut g).unwrap());
        let x = f32s(&[batch, steps, 6], seed ^ 3);
        let labels: Vec<i64> = g.next_u32s(batch).iter().map(|v| (v % 3) as i64).collect();
        let y = Tensor::from_vec(labels, &[batch], Device::Cpu).unwrap();
        compare(&model, &x, &y);
    }

    #[test]
    fn cnn_gradients_under_autocast_match_f32(batch in 2usize..5, ch in 2usize..6, seed in any::<u64>()) {
        // Smooth activation and average pooling: a max or ReLU kink may route a gradient
        // elsewhere once the input is rounded, which is correct behaviour but not a rounding
        // error a band can bound.
        let mut g = Generator::new(seed);
        let model = Sequential::new()
            .push(Conv2d::new(1, ch, 3, Conv2dOptions::default(), true, &mut g).unwrap())
            .push(Activation::Tanh)
            .push(AvgPool2d(AvgPool2dOptions::new(2)))
            .push(Flatten)
            .push(Linear::new(ch * 9, 4, true, &mut g).unwrap());
        let x = f32s(&[batch, 1, 8, 8], seed ^ 2);
        let labels: Vec<i64> = g.next_u32s(batch).iter().map(|v| (v % 4) as i64).collect();
        let y = Tensor::from_vec(labels, &[batch], Device::Cpu).unwrap();
        compare(&model, &x, &y);
    }
}

#[test]
fn autocast_state_is_per_thread_and_fp32_ops_survive_half_overflow() {
    let _g = amp::autocast(DType::F16).unwrap();
    let other = std::thread::spawn(amp::active_dtype).join().unwrap();
    assert_eq!(
        other, None,
        "another thread does not see this thread's region"
    );
    // 1e5 overflows f16 (max 65504); softmax and cross-entropy run in f32 and stay finite.
    let big = Tensor::from_vec(vec![1e5f32, 0.0, -1e5], &[1, 3], Device::Cpu).unwrap();
    assert!(vals(&big.softmax(1).unwrap()).iter().all(|v| v.is_finite()));
    let t = Tensor::from_vec(vec![0i64], &[1], Device::Cpu).unwrap();
    assert!(big
        .cross_entropy(&t, Default::default())
        .unwrap()
        .item()
        .unwrap()
        .is_finite());
}

/// Item 7: the graph keeps half tensors for backward, while gradients of f32 leaves are f32
/// (the cast's backward widens them) and equal the f32 gradients within f16 rounding.
#[test]
fn gradients_of_f32_leaves_are_f32() {
    let w = f32s(&[5, 4], 21).requires_grad(true).unwrap();
    let b = f32s(&[5], 22).requires_grad(true).unwrap();
    let x = f32s(&[3, 4], 23).requires_grad(true).unwrap();
    let y = amp::with_autocast(DType::F16, || x.linear(&w, Some(&b)).unwrap()).unwrap();
    assert_eq!(y.dtype(), DType::F16);
    let backward = |y: Tensor| {
        let y = y.to_dtype(DType::F32).unwrap();
        y.sqr().unwrap().sum_all().unwrap().backward().unwrap()
    };
    backward(y);
    let low: Vec<_> = [&w, &b, &x].iter().map(|t| t.grad().unwrap()).collect();
    for t in [&w, &b, &x] {
        t.zero_grad();
    }
    backward(x.linear(&w, Some(&b)).unwrap());
    for (g, t) in low.iter().zip([&w, &b, &x]) {
        assert_eq!(g.dtype(), DType::F32);
        assert_close(
            &vals(g),
            &vals(&t.grad().unwrap()),
            3e-3,
            "f16 vs f32 gradient",
        );
    }
}
