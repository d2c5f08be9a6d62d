//! CPU-vs-CUDA agreement on edge semantics and on the ops tests/cuda_parity.rs leaves out:
//! NaN through max/min/relu/clamp and the max/min reductions, float to integer casts
//! (truncating, saturating, NaN to 0), and the remaining elementwise, comparison, reduction
//! and loss ops; the loss scaler's fused kernels. Without a GPU each test prints
//! `skipped: no CUDA device` and passes.
#![cfg(feature = "cuda-backend")]
// `&[x.clone()]` reads better than `std::slice::from_ref(&x)` beside multi-input calls.
#![allow(clippy::cloned_ref_to_slice_refs)]

mod common;
use common::parity::*;
use common::*;
use mantissa::*;

/// Equal element for element, NaN equal to NaN.
fn assert_same(got: &[f64], want: &[f64], what: &str) {
    let same = got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|(g, w)| g == w || g.is_nan() && w.is_nan());
    assert!(same, "{what}:\n got  {got:?}\n want {want:?}");
}

/// `f` on the CPU tensors and on GPU copies of them, compared element for element.
fn same_on_both(what: &str, d: Device, xs: &[Tensor], f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    let on = |dev: Device| -> Vec<f64> {
        let xs: Vec<Tensor> = xs.iter().map(|x| x.to_device(dev).unwrap()).collect();
        let y = f(&xs).unwrap_or_else(|e| panic!("{what} on {dev}: {e}"));
        assert_eq!(y.device(), dev, "{what}: output device");
        vals(&y)
    };
    assert_same(&on(d), &on(Device::Cpu), what);
}

#[test]
fn nan_propagates_alike() {
    let Some(d) = gpu() else { return };
    let nan = f64::NAN;
    for dt in FLOATS {
        let t = |v: Vec<f64>| {
            Tensor::from_vec(v, &[2, 4], Device::Cpu)
                .unwrap()
                .to_dtype(dt)
                .unwrap()
        };
        let x = t(vec![-2.0, nan, 0.5, 3.0, 1.0, -1.0, 0.25, 2.0]);
        let y = t(vec![1.0, 1.0, nan, -1.0, 0.5, nan, 0.5, 0.5]);
        let xy = [x.clone(), y];
        type Op = fn(&[Tensor]) -> Result<Tensor>;
        let ops: [(&str, Op); 13] = [
            ("relu", |x| x[0].relu()),
            ("clamp", |x| x[0].clamp(-1.0, 1.0)),
            ("maximum scalar", |x| x[0].maximum(0.0)),
            ("minimum scalar", |x| x[0].minimum(0.0)),
            ("maximum", |x| x[0].maximum(&x[1])),
            ("minimum", |x| x[0].minimum(&x[1])),
            ("max", |x| Ok(x[0].max(1, false)?.0)),
            ("min", |x| Ok(x[0].min(1, false)?.0)),
            ("argmax", |x| x[0].argmax(1, false)),
            ("argmin", |x| x[0].argmin(1, false)),
            ("max_all", |x| x[0].max_all()),
            ("min_all", |x| x[0].min_all()),
            ("sum", |x| x[0].sum(&[1], false)),
        ];
        for (name, op) in ops {
            same_on_both(&format!("{name} ({dt:?})"), d, &xy, op);
        }
        // relu's gradient passes at NaN and stops where x <= 0, on both devices.
        let relu_grad = |dev: Device| {
            let xg = own(&x, dev).requires_grad(true).unwrap();
            xg.relu().unwrap().sum_all().unwrap().backward().unwrap();
            vals(&xg.grad().unwrap())
        };
        let want = [0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0];
        assert_same(
            &relu_grad(Device::Cpu),
            &want,
            &format!("relu gradient ({dt:?})"),
        );
        assert_same(
            &relu_grad(d),
            &want,
            &format!("relu gradient on {d} ({dt:?})"),
        );
        // A NaN in a row makes that whole softmax row NaN, and only that row.
        let s = x.to_device(d).unwrap().softmax(1).unwrap();
        let s = vals(&s);
        assert!(s[..4].iter().all(|v| v.is_nan()), "softmax row 0: {s:?}");
        assert!(s[4..].iter().all(|v| v.is_finite()), "softmax row 1: {s:?}");
    }
}

#[test]
fn integer_casts_truncate_and_saturate_alike() {
    let Some(d) = gpu() else { return };
    let v = vec![
        -3.7,
        2.9,
        300.7,
        255.5,
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        1e20,
        -1e20,
        0.49,
        -0.0,
        7.0,
    ];
    let n = v.len();
    let x = Tensor::from_vec(v, &[n], Device::Cpu).unwrap();
    for from in FLOATS {
        let x = x.to_dtype(from).unwrap();
        for to in [DType::U8, DType::I64] {
            same_on_both(&format!("{from:?} -> {to:?}"), d, &[x.clone()], |x| {
                x[0].to_dtype(to)
            });
            // From a strided view too.
            same_on_both(
                &format!("{from:?} -> {to:?} strided"),
                d,
                &[x.clone()],
                |x| x[0].reshape(&[3, 4])?.t()?.to_dtype(to),
            );
        }
    }
    let ints = Tensor::from_vec(vec![-5i64, 0, 7, 70_000, 2049], &[5], Device::Cpu).unwrap();
    let mask = Tensor::from_vec(vec![0u8, 1, 255, 3], &[4], Device::Cpu).unwrap();
    for to in FLOATS {
        same_on_both(&format!("I64 -> {to:?}"), d, &[ints.clone()], |x| {
            x[0].to_dtype(to)
        });
        same_on_both(&format!("U8 -> {to:?}"), d, &[mask.clone()], |x| {
            x[0].to_dtype(to)
        });
    }
}

#[test]
fn remaining_ops_match() {
    let Some(d) = gpu() else { return };
    for dt in FLOATS {
        let (a, b) = (input(&[5, 37], dt, 90), input(&[5, 37], dt, 91));
        parity("log1p", d, &[a.clone()], |x| x[0].abs()?.log1p());
        parity("scalar_pow", d, &[a.clone()], |x| x[0].scalar_pow(1.3));
        parity("sqr", d, &[a.clone()], |x| x[0].sqr());
        parity("rsub", d, &[a.clone()], |x| x[0].rsub(2.0));
        parity("std", d, &[a.clone()], |x| x[0].std(&[1], 1, false));
        parity("mean_all", d, &[a.clone()], |x| x[0].mean_all());
        parity("max_all", d, &[a.clone()], |x| x[0].max_all());
        parity("min_all", d, &[a.clone()], |x| x[0].min_all());
        parity("sum_to", d, &[a.clone()], |x| x[0].sum_to(&[1, 37]));
        // Comparisons, on values with ties (a rounded copy compared with itself shifted).
        let r = a
            .mul(2.0)
            .unwrap()
            .to_dtype(DType::I64)
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        let rs = Tensor::cat(
            &[&r.narrow(1, 1, 36).unwrap(), &r.narrow(1, 0, 1).unwrap()],
            1,
        )
        .unwrap();
        type Cmp = fn(&Tensor, &Tensor) -> Result<Tensor>;
        let cmps: [(&str, Cmp); 6] = [
            ("eq", |a, b| a.eq(b)),
            ("ne", |a, b| a.ne(b)),
            ("lt", |a, b| a.lt(b)),
            ("le", |a, b| a.le(b)),
            ("gt", |a, b| a.gt(b)),
            ("ge", |a, b| a.ge(b)),
        ];
        for (name, op) in cmps {
            same_on_both(name, d, &[r.clone(), rs.clone()], |x| op(&x[0], &x[1]));
        }
        type CmpScalar = fn(&Tensor) -> Result<Tensor>;
        let scalar_cmps: [(&str, CmpScalar); 3] = [
            ("eq scalar", |a| a.eq(1.0)),
            ("lt scalar", |a| a.lt(1.0)),
            ("ge scalar", |a| a.ge(-1.0)),
        ];
        for (name, op) in scalar_cmps {
            same_on_both(name, d, &[r.clone()], |x| op(&x[0]));
        }
        let target = Tensor::from_vec(vec![4i64, -100, 0, 36, 2], &[5], Device::Cpu).unwrap();
        parity("nll_loss", d, &[b.clone(), target], |x| {
            x[0].log_softmax(-1)?.nll_loss(&x[1], Reduction::Mean, -100)
        });
        let range = |dev| vals(&Tensor::arange(-3.0, 7.0, 0.75, dt, dev).unwrap());
        assert_same(&range(d), &range(Device::Cpu), "arange");
    }
}

/// The loss scaler on the device (fused unscale and update kernels) follows the CPU: the
/// same scale after each step, an overflow skipped on both, the same parameters; f32
/// parameters, and bf16 ones with f32 masters.
#[test]
fn loss_scaling_matches() {
    use mantissa::amp::{GradScaler, GradScalerConfig};
    use mantissa::optim::*;
    let Some(d) = gpu() else { return };
    let n = 1000;
    let run = |dev: Device, dtype: DType| -> (Vec<f64>, Vec<f64>) {
        let w = input(&[n], dtype, 7)
            .to_device(dev)
            .unwrap()
            .requires_grad(true)
            .unwrap();
        let mut opt = Adam::new(vec![w.clone()], AdamConfig::adamw(1e-2)).unwrap();
        if dtype != DType::F32 {
            opt.use_master_weights(Rounding::Nearest).unwrap();
        }
        let cfg = GradScalerConfig {
            growth_interval: 2,
            ..Default::default()
        };
        let mut s = GradScaler::new(cfg).unwrap();
        let mut scales = Vec::new();
        for step in 0..6 {
            let mut c = input(&[n], DType::F32, 20 + step).to_vec::<f32>().unwrap();
            if step == 2 {
                c[n / 3] = f32::INFINITY;
            }
            let c = Tensor::from_vec(c, &[n], dev).unwrap();
            opt.zero_grad();
            let loss = w
                .to_dtype(DType::F32)
                .unwrap()
                .mul(&c)
                .unwrap()
                .sum_all()
                .unwrap();
            s.scale(&loss).unwrap().backward().unwrap();
            s.step(&mut opt).unwrap();
            s.update().unwrap();
            scales.push(s.current_scale().unwrap().unwrap());
        }
        (scales, vals(&w))
    };
    for dtype in [DType::F32, DType::BF16] {
        let (want_s, want_w) = run(Device::Cpu, dtype);
        assert!(want_s[2] < want_s[1], "step 2 overflows: {want_s:?}");
        let (got_s, got_w) = run(d, dtype);
        assert_eq!(got_s, want_s, "scales ({dtype:?})");
        assert_close(
            &got_w,
            &want_w,
            band(dtype),
            &format!("parameters ({dtype:?})"),
        );
    }
}

/// Linear + ReLU fused in cuBLASLt's ReLU-bias epilogue keeps NaN as the unfused ops do (a
/// NaN input row gives a NaN output row on both devices).
#[test]
fn fused_linear_relu_keeps_nan() {
    let Some(d) = gpu() else { return };
    for dt in FLOATS {
        let mut x = input(&[4, 16], DType::F32, 30).to_vec::<f32>().unwrap();
        x[16 + 5] = f32::NAN;
        let x = Tensor::from_vec(x, &[4, 16], Device::Cpu)
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        let (w, b) = (input(&[8, 16], dt, 31), input(&[8], dt, 32));
        let on = |dev: Device| {
            let [x, w, b] = [&x, &w, &b].map(|t| t.to_device(dev).unwrap());
            vals(&x.linear_relu(&w, &b).unwrap())
        };
        let (got, want) = (on(d), on(Device::Cpu));
        let nan_rows = |v: &[f64]| -> Vec<bool> {
            v.chunks(8).map(|r| r.iter().all(|x| x.is_nan())).collect()
        };
        assert_eq!(
            nan_rows(&want),
            vec![false, true, false, false],
            "CPU ({dt:?})"
        );
        assert_eq!(nan_rows(&got), nan_rows(&want), "{dt:?}: {got:?}");
    }
}

/// A scaler state read on the host (from a checkpoint) moves to the device of the loss it
/// scales, as PyTorch's does, and the steps after it run there.
#[test]
fn a_scaler_state_read_on_the_host_follows_the_loss() {
    use mantissa::amp::{GradScaler, GradScalerConfig};
    use mantissa::optim::*;
    let Some(d) = gpu() else { return };
    let cfg = GradScalerConfig {
        init_scale: 1024.0,
        ..Default::default()
    };
    let mut saved = GradScaler::new(cfg).unwrap();
    saved
        .scale(&Tensor::scalar(1.0, DType::F32, Device::Cpu).unwrap())
        .unwrap();
    let state = saved.state_dict().unwrap();
    assert!(state.iter().all(|(_, t)| t.device() == Device::Cpu));
    let mut s = GradScaler::new(Default::default()).unwrap();
    s.load_state_dict(&state).unwrap();
    let w = input(&[10], DType::F32, 40)
        .to_device(d)
        .unwrap()
        .requires_grad(true)
        .unwrap();
    let mut opt = Sgd::new(vec![w.clone()], SgdConfig::new(0.1)).unwrap();
    let loss = w.mul(2.0).unwrap().sum_all().unwrap();
    let scaled = s.scale(&loss).unwrap();
    assert_eq!(scaled.device(), d);
    assert_eq!(scaled.item().unwrap(), loss.item().unwrap() * 1024.0);
    scaled.backward().unwrap();
    s.step(&mut opt).unwrap();
    s.update().unwrap();
    assert_eq!(s.current_scale().unwrap(), Some(1024.0));
    assert_close(
        &vals(&w.grad().unwrap()),
        &[2.0; 10],
        0.0,
        "unscaled gradient",
    );
}

/// Empty batches and empty channel sets: a convolution of an empty batch is an empty output
/// with a zero weight gradient on the device too (cuDNN is not asked: it refuses a batch of
/// 0), and pooling an empty batch launches nothing harmful.
#[test]
fn empty_batches_convolve_and_pool_to_nothing() {
    let Some(d) = gpu() else { return };
    for format in [MemoryFormat::Contiguous, MemoryFormat::ChannelsLast] {
        let x = Tensor::ones(&[0, 3, 6, 6], DType::F16, d)
            .unwrap()
            .to_memory_format(format)
            .unwrap()
            .detach()
            .requires_grad(true)
            .unwrap();
        let w = own(&input(&[4, 3, 3, 3], DType::F16, 90), d)
            .requires_grad(true)
            .unwrap();
        let y = x.conv2d(&w, None, Conv2dOptions::default()).unwrap();
        assert_eq!((y.shape(), y.device()), (&[0, 4, 4, 4][..], d));
        let p = y.max_pool2d(MaxPool2dOptions::new(2)).unwrap();
        let a = y.adaptive_avg_pool2d([1, 1]).unwrap();
        assert_eq!(
            (p.shape(), a.shape()),
            (&[0, 4, 2, 2][..], &[0, 4, 1, 1][..])
        );
        p.sum_all()
            .unwrap()
            .add(&a.sum_all().unwrap())
            .unwrap()
            .backward()
            .unwrap();
        assert_eq!(x.grad().unwrap().shape(), &[0, 3, 6, 6]);
        let gw = w.grad().unwrap();
        assert_eq!(gw.device(), d);
        assert_same(
            &vals(&gw),
            &[0.0; 4 * 3 * 3 * 3],
            &format!("{format:?} weight gradient"),
        );
    }
}

/// Reductions and products with an empty extent, on the device as on the CPU: a sum over an
/// empty dim is one zero per kept position (the reduction's row count is the kept dims'
/// product, not numel / reduced), a non-empty dim of an empty tensor reduces to nothing, and a
/// Linear without input features gives its bias rows.
#[test]
fn empty_extents_reduce_and_multiply_alike() {
    let Some(d) = gpu() else { return };
    for dt in FLOATS {
        let empty_cols = Tensor::ones(&[3, 0], dt, Device::Cpu).unwrap();
        let empty_rows = Tensor::ones(&[0, 3], dt, Device::Cpu).unwrap();
        same_on_both(
            &format!("sum over an empty dim {dt:?}"),
            d,
            &[empty_cols.clone()],
            |x| x[0].sum(&[1], false),
        );
        same_on_both(
            &format!("mean over a full dim {dt:?}"),
            d,
            &[empty_rows.clone()],
            |x| x[0].mean(&[1], false),
        );
        same_on_both(
            &format!("argmax over a full dim {dt:?}"),
            d,
            &[empty_rows],
            |x| x[0].argmax(1, false),
        );
        let w = Tensor::ones(&[4, 0], dt, Device::Cpu).unwrap();
        let b = input(&[4], dt, 91);
        same_on_both(
            &format!("linear without inputs {dt:?}"),
            d,
            &[empty_cols, w, b],
            |x| x[0].linear(&x[1], Some(&x[2])),
        );
    }
}

/// `f` on the CPU tensors and on GPU copies of them, compared byte for byte (integers past
/// f64's exact range included), or both failing (an error may come at the read).
fn bytes_on_both(what: &str, d: Device, xs: &[Tensor], f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    let on = |dev: Device| -> Result<(Vec<u8>, DType)> {
        let xs: Vec<Tensor> = xs.iter().map(|x| x.to_device(dev).unwrap()).collect();
        let y = f(&xs)?;
        assert_eq!(y.device(), dev, "{what}: output device");
        Ok((y.to_le_bytes()?, y.dtype()))
    };
    match (on(d), on(Device::Cpu)) {
        (Ok(got), Ok(want)) => assert_eq!(got, want, "{what}"),
        (Err(_), Err(_)) => {}
        (got, want) => panic!("{what}:\n on {d}: {got:?}\n on the CPU: {want:?}"),
    }
}

/// Integer max, min and their first indices compare exactly on the device (an i64 past 2^53
/// is not rounded through a float); an index_select with nothing to copy (another dim is
/// empty) still rejects an index out of range; copy_ into a view whose elements share memory
/// (an expanded one) writes in order, as on the CPU; integer arithmetic wraps alike.
#[test]
fn integer_ops_empty_gathers_and_overlapping_writes_match() {
    let Some(d) = gpu() else { return };
    let big = (1i64 << 53) + 1;
    let v = vec![big, big - 1, -7, big, 3, i64::MIN, i64::MAX, 0, 5, 5, -2, 5];
    let wide = Tensor::from_vec(v, &[3, 4], Device::Cpu).unwrap();
    let bytes: Vec<u8> = (0..60u32).map(|i| ((i * 37 + 11) % 7 * 40) as u8).collect();
    let narrow = Tensor::from_vec(bytes, &[3, 4, 5], Device::Cpu).unwrap();
    for x in [
        wide.clone(),
        wide.t().unwrap(),
        narrow.clone(),
        narrow.permute(&[2, 0, 1]).unwrap(),
    ] {
        let dt = x.dtype();
        for dim in 0..x.rank() as isize {
            let xs = [x.clone()];
            for keep in [false, true] {
                let what = |op: &str| format!("{op} of {dt:?} {:?} along {dim}", x.shape());
                bytes_on_both(&what("max"), d, &xs, |x| Ok(x[0].max(dim, keep)?.0));
                bytes_on_both(&what("max index"), d, &xs, |x| Ok(x[0].max(dim, keep)?.1));
                bytes_on_both(&what("min"), d, &xs, |x| Ok(x[0].min(dim, keep)?.0));
                bytes_on_both(&what("min index"), d, &xs, |x| Ok(x[0].min(dim, keep)?.1));
                bytes_on_both(&what("argmax"), d, &xs, |x| x[0].argmax(dim, keep));
                bytes_on_both(&what("argmin"), d, &xs, |x| x[0].argmin(dim, keep));
            }
        }
        bytes_on_both(&format!("max_all of {dt:?}"), d, &[x.clone()], |x| {
            x[0].max_all()
        });
        bytes_on_both(&format!("min_all of {dt:?}"), d, &[x.clone()], |x| {
            x[0].min_all()
        });
    }
    // Both devices give the same values, so check one against the definition too.
    let got = wide.to_device(d).unwrap().max(1, false).unwrap();
    assert_eq!(got.0.to_vec::<i64>().unwrap(), vec![big, i64::MAX, 5]);
    assert_eq!(got.1.to_vec::<i64>().unwrap(), vec![0, 2, 0]);

    let table = Tensor::ones(&[4, 0], DType::F32, Device::Cpu).unwrap();
    for (index, ok) in [(vec![3i64, 0], true), (vec![-1], false), (vec![4], false)] {
        let what = format!("index_select of {index:?} from [4, 0]");
        let n = index.len();
        let idx = Tensor::from_vec(index, &[n], Device::Cpu).unwrap();
        let xs = [table.clone(), idx];
        let cpu = xs[0].index_select(0, &xs[1]).and_then(|t| t.to_vec_f64());
        assert_eq!(cpu.is_ok(), ok, "{what} on the CPU: {cpu:?}");
        bytes_on_both(&what, d, &xs, |x| x[0].index_select(0, &x[1]));
        bytes_on_both(&format!("embedding, {what}"), d, &xs, |x| {
            Tensor::embedding(&x[1], &x[0])
        });
    }

    // Byte arithmetic wraps modulo 256 on both (0 - 5 = 251, 200 * 5 = 232), with a
    // broadcast operand; i64 alike.
    let a = Tensor::from_vec(vec![0u8, 3, 7, 200, 255, 16], &[2, 3], Device::Cpu).unwrap();
    let b = Tensor::from_vec(vec![5u8, 2, 0], &[3], Device::Cpu).unwrap();
    let (ai, bi) = (
        a.to_dtype(DType::I64).unwrap(),
        b.to_dtype(DType::I64).unwrap(),
    );
    type Op = fn(&[Tensor]) -> Result<Tensor>;
    let ops: [(&str, Op); 7] = [
        ("add", |x| x[0].add(&x[1])),
        ("sub", |x| x[0].sub(&x[1])),
        ("mul", |x| x[0].mul(&x[1])),
        ("div", |x| x[0].div(&x[1])),
        ("pow", |x| x[0].pow(&x[1])),
        ("maximum", |x| x[0].maximum(&x[1])),
        ("minimum", |x| x[0].minimum(&x[1])),
    ];
    for (name, f) in ops {
        for xs in [[a.clone(), b.clone()], [ai.clone(), bi.clone()]] {
            bytes_on_both(&format!("{name} of {:?}", xs[0].dtype()), d, &xs, f);
        }
    }
    let (ga, gb) = (a.to_device(d).unwrap(), b.to_device(d).unwrap());
    let sub = ga.sub(&gb).unwrap().to_vec::<u8>().unwrap();
    assert_eq!(sub, vec![251, 1, 7, 195, 253, 16]);
    let mul = ga.mul(&gb).unwrap().to_vec::<u8>().unwrap();
    assert_eq!(mul, vec![0, 6, 0, 232, 254, 0]);
    // Division is true division, in f32, as in PyTorch.
    let div = ga.div(&gb).unwrap().to_vec::<f32>().unwrap();
    let inf = f32::INFINITY;
    assert_eq!(div, vec![0.0, 1.5, inf, 40.0, 127.5, inf]);

    for dt in FLOATS {
        let src = input(&[3, 4], dt, 93);
        bytes_on_both(
            &format!("copy_ into an expanded view ({dt:?})"),
            d,
            &[src],
            |x| {
                let dst = Tensor::zeros(&[1, 4], dt, x[0].device())?.expand(&[3, 4])?;
                dst.copy_(&x[0])?;
                Ok(dst)
            },
        );
    }
}

/// ReLU's and the clamps' backward select on the device as on the CPU: an infinite or NaN
/// incoming gradient where the mask is off gives 0 (PyTorch's threshold_backward), through the
/// contiguous and the strided kernels.
#[test]
fn mask_gradients_select_on_the_device() {
    let Some(d) = gpu() else { return };
    let mut g = input(&[6, 8], DType::F32, 34).to_vec::<f32>().unwrap();
    for (k, v) in g.iter_mut().enumerate() {
        match k % 4 {
            0 => *v = f32::INFINITY,
            1 => *v = f32::NEG_INFINITY,
            2 => *v = f32::NAN,
            _ => {}
        }
    }
    let g = Tensor::from_vec(g, &[6, 8], Device::Cpu).unwrap();
    for dt in FLOATS {
        let x = input(&[6, 8], dt, 33);
        let g = g.to_dtype(dt).unwrap();
        // (what, a view of x, the op): a column slice takes the strided kernel.
        type Op = fn(&Tensor) -> Result<Tensor>;
        let cases: [(&str, bool, Op); 3] = [
            ("relu", false, |x| x.relu()),
            ("relu, strided", true, |x| x.relu()),
            ("clamp_min, strided", true, |x| x.maximum(0.1)),
        ];
        for (what, strided, op) in cases {
            let run = |dev: Device| {
                let x = x
                    .to_device(dev)
                    .unwrap()
                    .detach()
                    .requires_grad(true)
                    .unwrap();
                let (xv, gv) = match strided {
                    true => (x.narrow(1, 1, 5).unwrap(), g.narrow(1, 1, 5).unwrap()),
                    false => (x.clone(), g.clone()),
                };
                let y = op(&xv).unwrap();
                y.backward_with(&gv.to_device(dev).unwrap()).unwrap();
                vals(&x.grad().unwrap())
            };
            let (got, want) = (run(d), run(Device::Cpu));
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a == b || a.is_nan() && b.is_nan());
            assert!(same, "{what} {dt:?}: {got:?} vs {want:?}");
            let zeros = want.iter().filter(|v| **v == 0.0).count();
            assert!(zeros > 10, "{what} {dt:?}: masked off");
            assert!(
                want.iter().filter(|v| v.is_nan()).count() < 8,
                "{what} {dt:?}: NaN only where the mask is on: {want:?}"
            );
        }
    }
}
