//! GradScaler: PyTorch's algorithm, skipped steps leave everything bit-unchanged, state
//! machine errors, clipping after unscale_, accumulation, state round trip.

mod common;
use common::*;
use mantissa::amp::{GradScaler, GradScalerConfig};
use mantissa::optim::*;
use mantissa::*;

fn param(v: &[f32]) -> Tensor {
    Tensor::from_vec(v.to_vec(), &[v.len()], Device::Cpu)
        .unwrap()
        .requires_grad(true)
        .unwrap()
}

/// One iteration: loss = sum(w * c) (gradient c), through the scaler.
fn iteration(scaler: &mut GradScaler, opt: &mut dyn Optimizer, w: &Tensor, c: &[f32]) {
    let ct = Tensor::from_vec(c.to_vec(), &[c.len()], Device::Cpu).unwrap();
    opt.zero_grad();
    scaler
        .scale(&w.mul(&ct).unwrap().sum_all().unwrap())
        .unwrap()
        .backward()
        .unwrap();
    scaler.step(opt).unwrap();
    scaler.update().unwrap();
}

#[test]
fn scripted_overflows_follow_the_reference_trajectory() {
    let cfg = GradScalerConfig {
        init_scale: 1024.0,
        growth_interval: 3,
        ..Default::default()
    };
    let mut scaler = GradScaler::new(cfg).unwrap();
    let w = param(&[1.0, 1.0]);
    let mut opt = Sgd::new(vec![w.clone()], SgdConfig::new(0.01)).unwrap();
    let script = [
        false, false, false, true, false, true, true, false, false, false, false, false, false,
        true,
    ];
    let (mut scale, mut tracker) = (1024.0f64, 0usize);
    for (i, &overflow) in script.iter().enumerate() {
        let c = if overflow {
            [f32::INFINITY, 1.0]
        } else {
            [0.5, -0.25]
        };
        iteration(&mut scaler, &mut opt, &w, &c);
        // PyTorch's _amp_update_scale_, written out.
        if overflow {
            scale *= 0.5;
            tracker = 0;
        } else if tracker + 1 == 3 {
            scale *= 2.0;
            tracker = 0;
        } else {
            tracker += 1;
        }
        assert_eq!(
            scaler.current_scale().unwrap(),
            Some(scale),
            "after step {i}"
        );
    }
    // Growth stops at the largest finite f32 scale.
    let cfg = GradScalerConfig {
        init_scale: 2f64.powi(127),
        growth_interval: 1,
        ..Default::default()
    };
    let mut big = GradScaler::new(cfg).unwrap();
    let w2 = param(&[1.0]);
    let mut opt2 = Sgd::new(vec![w2.clone()], SgdConfig::new(0.0)).unwrap();
    iteration(&mut big, &mut opt2, &w2, &[0.0]);
    assert_eq!(big.current_scale().unwrap(), Some(2f64.powi(127)));
}

#[test]
fn skipped_steps_leave_parameters_and_state_bit_unchanged() {
    let w = param(&[0.5, -1.5, 2.0]);
    let mut opt = Adam::new(vec![w.clone()], AdamConfig::adamw(1e-2)).unwrap();
    let mut scaler = GradScaler::new(Default::default()).unwrap();
    iteration(&mut scaler, &mut opt, &w, &[0.1, 0.2, -0.3]);
    let before_w = w.to_vec::<f32>().unwrap();
    let before_state: Vec<(String, Vec<f64>)> = opt
        .state_tensors()
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, t.to_vec_f64().unwrap()))
        .collect();
    iteration(&mut scaler, &mut opt, &w, &[0.1, f32::NAN, 0.3]);
    assert_eq!(w.to_vec::<f32>().unwrap(), before_w);
    let after_state: Vec<(String, Vec<f64>)> = opt
        .state_tensors()
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, t.to_vec_f64().unwrap()))
        .collect();
    assert_eq!(
        after_state, before_state,
        "moments and step count untouched"
    );
    assert_eq!(opt.states()[0].step_count().unwrap(), 1);
    // The next clean step continues as if the bad one never happened.
    iteration(&mut scaler, &mut opt, &w, &[0.1, 0.2, -0.3]);
    assert_eq!(opt.states()[0].step_count().unwrap(), 2);
    assert_ne!(w.to_vec::<f32>().unwrap(), before_w);
    // SGLD adds no noise on a skipped step either.
    let v = param(&[1.0, 2.0]);
    let mut sgld = Sgld::new(vec![v.clone()], SgdConfig::new(0.1), 1.0, 3).unwrap();
    let before = v.to_vec::<f32>().unwrap();
    iteration(&mut scaler, &mut sgld, &v, &[f32::INFINITY, 0.0]);
    assert_eq!(v.to_vec::<f32>().unwrap(), before);
}

#[test]
fn state_machine_errors_and_f16_gradients() {
    let w = param(&[1.0]);
    let mut opt = Sgd::new(vec![w.clone()], SgdConfig::new(0.1)).unwrap();
    let mut s = GradScaler::new(Default::default()).unwrap();
    assert!(s
        .unscale_(&mut opt)
        .unwrap_err()
        .to_string()
        .contains("scale() first"));
    s.scale(&w.sum_all().unwrap()).unwrap().backward().unwrap();
    s.unscale_(&mut opt).unwrap();
    assert!(s
        .unscale_(&mut opt)
        .unwrap_err()
        .to_string()
        .contains("already been called"));
    s.step(&mut opt).unwrap();
    assert!(s
        .step(&mut opt)
        .unwrap_err()
        .to_string()
        .contains("step() has already been called"));
    assert!(s
        .unscale_(&mut opt)
        .unwrap_err()
        .to_string()
        .contains("after step()"));
    s.update().unwrap();
    assert!(s.update().is_err(), "update without a step");
    // f16 gradients are refused: the optimizer must hold f32 masters.
    let h = Tensor::ones(&[2], DType::F16, Device::Cpu)
        .unwrap()
        .requires_grad(true)
        .unwrap();
    let mut hopt = Sgd::new(vec![h.clone()], SgdConfig::new(0.1)).unwrap();
    s.scale(&h.sum_all().unwrap()).unwrap().backward().unwrap();
    assert!(s
        .unscale_(&mut hopt)
        .unwrap_err()
        .to_string()
        .contains("FP16"));
    assert!(GradScaler::new(GradScalerConfig {
        growth_factor: 1.0,
        ..Default::default()
    })
    .is_err());
}

#[test]
fn disabled_scaler_is_a_no_op() {
    let w = param(&[1.0, 2.0]);
    let mut opt = Sgd::new(vec![w.clone()], SgdConfig::new(0.5)).unwrap();
    let mut s = GradScaler::new(GradScalerConfig {
        enabled: false,
        ..Default::default()
    })
    .unwrap();
    let loss = w.sum_all().unwrap();
    let scaled = s.scale(&loss).unwrap();
    assert_eq!(scaled.item().unwrap(), loss.item().unwrap());
    scaled.backward().unwrap();
    s.step(&mut opt).unwrap();
    s.update().unwrap();
    assert_eq!(w.to_vec::<f32>().unwrap(), vec![0.5, 1.5]);
    assert!(s.state_dict().unwrap().is_empty());
    assert!(s.current_scale().unwrap().is_none());
}

#[test]
fn clipping_after_unscale_equals_f32_clipping() {
    let grads = [3.0f32, -4.0, 12.0];
    let run = |scaled: bool| -> Vec<f32> {
        let w = param(&[1.0, 1.0, 1.0]);
        let mut opt = Sgd::new(vec![w.clone()], SgdConfig::new(1.0)).unwrap();
        let ct = Tensor::from_vec(grads.to_vec(), &[3], Device::Cpu).unwrap();
        let loss = w.mul(&ct).unwrap().sum_all().unwrap();
        if scaled {
            let mut s = GradScaler::new(Default::default()).unwrap();
            s.scale(&loss).unwrap().backward().unwrap();
            s.unscale_(&mut opt).unwrap();
            let n = clip_grad_norm(opt.params(), 1.0).unwrap();
            assert!(
                (n.item().unwrap() - 13.0).abs() < 1e-4,
                "the norm of the true gradient"
            );
            s.step(&mut opt).unwrap();
            s.update().unwrap();
        } else {
            loss.backward().unwrap();
            clip_grad_norm(opt.params(), 1.0).unwrap();
            opt.step().unwrap();
        }
        w.to_vec::<f32>().unwrap()
    };
    assert_eq!(run(true), run(false));
}

#[test]
fn accumulating_micro_batches_equals_one_big_batch() {
    let x = Tensor::randn_with(
        &[8, 3],
        0.0,
        1.0,
        DType::F32,
        Device::Cpu,
        &mut Generator::new(1),
    )
    .unwrap();
    let grad_of = |k: usize| -> Vec<f64> {
        let w = Tensor::randn_with(
            &[3, 2],
            0.0,
            1.0,
            DType::F32,
            Device::Cpu,
            &mut Generator::new(2),
        )
        .unwrap()
        .requires_grad(true)
        .unwrap();
        let mut opt = Sgd::new(vec![w.clone()], SgdConfig::new(0.0)).unwrap();
        let mut s = GradScaler::new(Default::default()).unwrap();
        for part in x.split(8 / k, 0).unwrap() {
            let loss = amp::with_autocast(DType::BF16, || part.matmul(&w)?.tanh()?.mean_all())
                .unwrap()
                .unwrap();
            s.scale(&loss.div(k as f64).unwrap())
                .unwrap()
                .backward()
                .unwrap();
        }
        s.unscale_(&mut opt).unwrap();
        vals(&w.grad().unwrap())
    };
    assert_close(
        &grad_of(4),
        &grad_of(1),
        2e-2,
        "4 micro-batches vs one batch (bf16 autocast)",
    );
}

#[test]
fn state_dict_round_trips() {
    let cfg = GradScalerConfig {
        init_scale: 256.0,
        growth_interval: 2,
        ..Default::default()
    };
    let mut s = GradScaler::new(cfg).unwrap();
    let w = param(&[1.0]);
    let mut opt = Sgd::new(vec![w.clone()], SgdConfig::new(0.1)).unwrap();
    iteration(&mut s, &mut opt, &w, &[1.0]);
    let sd = s.state_dict().unwrap();
    let mut t = GradScaler::new(Default::default()).unwrap();
    t.load_state_dict(&sd).unwrap();
    // One more clean step grows both (the tracker came along).
    iteration(&mut s, &mut opt, &w, &[1.0]);
    iteration(&mut t, &mut opt, &w, &[1.0]);
    assert_eq!(s.current_scale().unwrap(), Some(512.0));
    assert_eq!(t.current_scale().unwrap(), Some(512.0));
    assert!(t.load_state_dict(&[]).is_err());
}

#[test]
fn negative_infinity_and_several_optimizers_share_one_backoff() {
    let (a, b) = (param(&[1.0]), param(&[1.0]));
    let mut oa = Sgd::new(vec![a.clone()], SgdConfig::new(0.5)).unwrap();
    let mut ob = Sgd::new(vec![b.clone()], SgdConfig::new(0.5)).unwrap();
    let mut s = GradScaler::new(GradScalerConfig {
        init_scale: 8.0,
        ..Default::default()
    })
    .unwrap();
    let ninf = Tensor::from_vec(vec![f32::NEG_INFINITY], &[1], Device::Cpu).unwrap();
    let loss = a
        .mul(&ninf)
        .unwrap()
        .sum_all()
        .unwrap()
        .add(&b.sum_all().unwrap())
        .unwrap();
    s.scale(&loss).unwrap().backward().unwrap();
    s.step(&mut oa).unwrap();
    s.step(&mut ob).unwrap();
    s.update().unwrap();
    assert_eq!(
        a.to_vec::<f32>().unwrap(),
        vec![1.0],
        "the overflowing optimizer skipped"
    );
    assert_eq!(
        b.to_vec::<f32>().unwrap(),
        vec![0.5],
        "the clean one stepped"
    );
    assert_eq!(
        s.current_scale().unwrap(),
        Some(4.0),
        "one backoff for both"
    );
}

/// Checklist item 11: a whole scaled step (scale, backward, unscale_, clipping, the fused
/// optimizer's step, update), with and without an overflow, and with master weights, reads
/// nothing back to the host: the skip decision and the scale stay on the device.
#[test]
fn a_scaled_step_reads_nothing_back_to_the_host() {
    for masters in [false, true] {
        let w = if masters {
            param(&[0.5, -1.0, 2.0])
                .detach()
                .to_dtype(DType::F16)
                .unwrap()
                .requires_grad(true)
                .unwrap()
        } else {
            param(&[0.5, -1.0, 2.0])
        };
        let mut opt = Adam::new(vec![w.clone()], AdamConfig::adamw(1e-2)).unwrap();
        if masters {
            opt.use_master_weights(Rounding::Nearest).unwrap();
        }
        // 2^10: the default 2^16 overflows f16 gradients on the first step, as in PyTorch.
        let cfg = GradScalerConfig {
            init_scale: 1024.0,
            ..Default::default()
        };
        let mut scaler = GradScaler::new(cfg).unwrap();
        for c in [
            [1.0f32, 2.0, 3.0],
            [f32::INFINITY, 1.0, 1.0],
            [0.5, 0.5, 0.5],
        ] {
            let ct = Tensor::from_vec(c.to_vec(), &[3], Device::Cpu).unwrap();
            let before = host_reads();
            opt.zero_grad();
            let loss = w
                .mul(&ct.to_dtype(w.dtype()).unwrap())
                .unwrap()
                .sum_all()
                .unwrap();
            scaler.scale(&loss).unwrap().backward().unwrap();
            scaler.unscale_(&mut opt).unwrap();
            clip_grad_norm(std::slice::from_ref(&w), 1.0).unwrap();
            scaler.step(&mut opt).unwrap();
            scaler.update().unwrap();
            assert_eq!(
                host_reads(),
                before,
                "host reads in a step (masters: {masters})"
            );
        }
        // The overflow was skipped: two real steps counted.
        assert_eq!(opt.states()[0].step_count().unwrap(), 2);
    }
}

/// Unscaling walks a gradient's storage in one pass: a channels-last gradient stays
/// channels-last, and gradients that are views (transposed, or a part of a larger buffer)
/// come out with the right values; bf16 gradients stay bf16, or become f32 with masters.
/// Scaled gradients of `g` laid out four ways: contiguous, channels-last, transposed, and as
/// part of a larger buffer (whose rest overflows).
fn scaled_views(g: &Tensor, scale: f64) -> [(&'static str, Tensor); 4] {
    [
        ("contiguous", g.mul(scale).unwrap()),
        (
            "channels-last",
            g.mul(scale)
                .unwrap()
                .to_memory_format(MemoryFormat::ChannelsLast)
                .unwrap(),
        ),
        (
            "transposed",
            g.transpose(1, 3)
                .unwrap()
                .mul(scale)
                .unwrap()
                .copy()
                .unwrap()
                .transpose(1, 3)
                .unwrap(),
        ),
        (
            "part of a larger buffer",
            // The rest of the buffer overflows; only the gradient's part is checked.
            Tensor::cat(&[&g.mul(f64::INFINITY).unwrap(), &g.mul(scale).unwrap()], 0)
                .unwrap()
                .narrow(0, 2, 2)
                .unwrap(),
        ),
    ]
}

#[test]
fn unscaling_keeps_layouts_and_reads_views() {
    let shape = [2, 3, 4, 5];
    let n: usize = shape.iter().product();
    let g = f32s(&shape, 5);
    let scale = 65536.0;
    for k in 0..4 {
        for (dtype, masters) in [
            (DType::F32, false),
            (DType::BF16, false),
            (DType::BF16, true),
        ] {
            // Fresh gradients each time: an unscale in place changes them.
            let (what, scaled) = scaled_views(&g, scale)[k].clone();
            let w = Tensor::zeros(&shape, dtype, Device::Cpu)
                .unwrap()
                .requires_grad(true)
                .unwrap();
            let mut opt = Sgd::new(vec![w.clone()], SgdConfig::new(0.1)).unwrap();
            if masters {
                opt.use_master_weights(Rounding::Nearest).unwrap();
            }
            let mut s = GradScaler::new(Default::default()).unwrap();
            s.scale(&w.sum_all().unwrap()).unwrap();
            let grad = scaled.to_dtype(dtype).unwrap();
            let layout = (grad.strides().to_vec(), grad.is_channels_last());
            w.set_grad(Some(grad.clone())).unwrap();
            s.unscale_(&mut opt).unwrap();
            let got = w.grad().unwrap();
            let want_dtype = if masters { DType::F32 } else { dtype };
            assert_eq!(got.dtype(), want_dtype, "{what} {dtype:?}");
            assert_eq!(got.numel(), n);
            let want = g.to_dtype(dtype).unwrap();
            assert_eq!(
                vals(&got),
                vals(&want),
                "{what} {dtype:?} masters {masters}"
            );
            // PyTorch's unscale_ works in place: a gradient that keeps its dtype is the same
            // tensor after it, unscaled wherever it is held, a dense view into a larger
            // buffer too (a data-parallel bucket's; only its range is walked, so the rest of
            // the buffer, which overflows, is not read). Master weights' f32 gradients are
            // new tensors.
            let in_place = !masters;
            assert_eq!(got.shares_storage(&grad), in_place, "{what} {dtype:?}");
            if in_place {
                assert_eq!(vals(&grad), vals(&want), "{what}: held gradient unscaled");
            }
            assert_eq!(got.strides(), &layout.0[..], "{what}: strides kept");
            assert_eq!(got.is_channels_last(), layout.1, "{what}: format kept");
            // Nothing was flagged: the scale does not back off.
            s.step(&mut opt).unwrap();
            s.update().unwrap();
            assert_eq!(
                s.current_scale().unwrap(),
                Some(scale),
                "{what}: no overflow"
            );
        }
    }
}
