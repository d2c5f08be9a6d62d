//! Optimizers against hand-computed steps, schedules against their formulas, clipping.

mod common;
use common::*;
use mantissa::optim::*;
use mantissa::*;

fn param(v: &[f64]) -> Tensor {
    Tensor::from_vec(v.to_vec(), &[v.len()], Device::Cpu)
        .unwrap()
        .requires_grad(true)
        .unwrap()
}

fn set_grad(p: &Tensor, g: &[f64]) {
    p.set_grad(Some(
        Tensor::from_vec(g.to_vec(), &[g.len()], Device::Cpu).unwrap(),
    ))
    .unwrap();
}

#[test]
fn sgd_momentum_dampening_nesterov_weight_decay() {
    let grads = [[0.5, -1.0], [0.25, 2.0], [-1.0, 0.5]];
    for (momentum, dampening, nesterov, wd) in [
        (0.0, 0.0, false, 0.0),
        (0.9, 0.0, false, 0.0),
        (0.9, 0.1, false, 0.01),
        (0.8, 0.0, true, 0.05),
    ] {
        let cfg = SgdConfig {
            lr: 0.1,
            momentum,
            dampening,
            weight_decay: wd,
            nesterov,
        };
        let p = param(&[1.0, -2.0]);
        let mut opt = Sgd::new(vec![p.clone()], cfg).unwrap();
        // Reference, written out.
        let (mut w, mut buf) = ([1.0f64, -2.0], [0.0f64; 2]);
        for (step, g) in grads.iter().enumerate() {
            set_grad(&p, g);
            opt.step().unwrap();
            for i in 0..2 {
                let mut d = g[i] + wd * w[i];
                if momentum != 0.0 {
                    buf[i] = if step == 0 {
                        d
                    } else {
                        momentum * buf[i] + (1.0 - dampening) * d
                    };
                    d = if nesterov {
                        d + momentum * buf[i]
                    } else {
                        buf[i]
                    };
                }
                w[i] -= 0.1 * d;
            }
            assert_close(&vals(&p), &w, 1e-15, &format!("sgd step {step} {cfg:?}"));
        }
    }
    assert!(Sgd::new(
        vec![],
        SgdConfig {
            nesterov: true,
            ..SgdConfig::new(0.1)
        }
    )
    .is_err());
    assert!(Sgd::new(vec![], SgdConfig::new(-1.0)).is_err());
}

#[test]
fn adam_and_adamw_match_the_update_rule() {
    for cfg in [
        AdamConfig::adam(0.01),
        AdamConfig {
            weight_decay: 0.1,
            ..AdamConfig::adam(0.01)
        },
        AdamConfig::adamw(0.01),
    ] {
        let p = param(&[0.5, -1.5, 2.0]);
        let mut opt = Adam::new(vec![p.clone()], cfg).unwrap();
        let mut w = [0.5f64, -1.5, 2.0];
        let (mut m, mut v) = ([0.0f64; 3], [0.0f64; 3]);
        for (t, g) in [[0.1, -0.2, 0.3], [0.5, 0.5, -0.5], [-0.3, 0.1, 0.0]]
            .iter()
            .enumerate()
        {
            set_grad(&p, g);
            opt.step().unwrap();
            let t = t as i32 + 1;
            for i in 0..3 {
                let mut gi = g[i];
                if cfg.decoupled {
                    w[i] *= 1.0 - cfg.lr * cfg.weight_decay;
                } else {
                    gi += cfg.weight_decay * w[i];
                }
                m[i] = cfg.beta1 * m[i] + (1.0 - cfg.beta1) * gi;
                v[i] = cfg.beta2 * v[i] + (1.0 - cfg.beta2) * gi * gi;
                let mh = m[i] / (1.0 - cfg.beta1.powi(t));
                let vh = v[i] / (1.0 - cfg.beta2.powi(t));
                w[i] -= cfg.lr * mh / (vh.sqrt() + cfg.eps);
            }
            assert_close(&vals(&p), &w, 1e-14, &format!("adam step {t} {cfg:?}"));
        }
        assert_eq!(opt.states()[0].step_count().unwrap(), 3);
    }
}

#[test]
fn sgld_adds_seeded_noise_of_the_stated_size() {
    let n = 20000;
    let run = |seed| {
        let p = Tensor::zeros(&[n], DType::F64, Device::Cpu)
            .unwrap()
            .requires_grad(true)
            .unwrap();
        let mut opt = Sgld::new(vec![p.clone()], SgdConfig::new(0.02), 0.5, seed).unwrap();
        p.set_grad(Some(Tensor::ones(&[n], DType::F64, Device::Cpu).unwrap()))
            .unwrap();
        opt.step().unwrap();
        vals(&p)
    };
    let a = run(3);
    assert_eq!(a, run(3), "same seed, same noise");
    assert_ne!(a, run(4));
    let mean = a.iter().sum::<f64>() / n as f64;
    let std = (a.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64).sqrt();
    assert!((mean + 0.02).abs() < 0.003, "drift -lr*g: {mean}");
    assert!(
        (std - (2.0f64 * 0.02 * 0.5).sqrt()).abs() < 0.005,
        "std {std}"
    );
}

#[test]
fn params_without_gradients_are_left_alone_and_zero_grad_frees() {
    let (a, b) = (param(&[1.0]), param(&[2.0]));
    let mut opt = Sgd::new(vec![a.clone(), b.clone()], SgdConfig::new(0.5)).unwrap();
    set_grad(&a, &[1.0]);
    opt.step().unwrap();
    assert_eq!((vals(&a)[0], vals(&b)[0]), (0.5, 2.0));
    opt.zero_grad();
    assert!(a.grad().is_none());
}

#[test]
fn schedules_follow_their_formulas() {
    let s = StepLr {
        base: 0.1,
        step_size: 30,
        gamma: 0.1,
    };
    assert_eq!([s.lr(0), s.lr(29)], [0.1, 0.1]);
    assert!((s.lr(30) - 0.01).abs() < 1e-15 && (s.lr(65) - 0.001).abs() < 1e-15);
    let c = CosineAnnealing {
        base: 1.0,
        t_max: 10,
        eta_min: 0.1,
    };
    assert_eq!(c.lr(0), 1.0);
    assert!((c.lr(5) - 0.55).abs() < 1e-12);
    assert!((c.lr(10) - 0.1).abs() < 1e-12 && (c.lr(20) - 0.1).abs() < 1e-12);
    let o = OneCycle::new(1.0, 100);
    assert!((o.lr(0) - 0.04).abs() < 1e-12, "starts at max / 25");
    assert!(
        (o.lr(29) - 1.0).abs() < 1e-12,
        "peaks at pct_start * total - 1"
    );
    assert!(
        (o.lr(99) - 0.04 / 1e4).abs() < 1e-15,
        "ends at initial / final_div"
    );
    assert!(o.lr(10) < o.lr(20) && o.lr(50) > o.lr(80));
    let w = LinearWarmup {
        inner: ConstantLr(0.2),
        warmup: 4,
        start_factor: 0.25,
    };
    let lrs: Vec<f64> = (0..6).map(|i| w.lr(i)).collect();
    assert_close(
        &lrs,
        &[0.05, 0.0875, 0.125, 0.1625, 0.2, 0.2],
        1e-12,
        "warmup",
    );
}

#[test]
fn clip_grad_norm_scales_only_above_the_limit() {
    let (a, b) = (param(&[0.0, 0.0]), param(&[0.0]));
    set_grad(&a, &[3.0, 0.0]);
    set_grad(&b, &[4.0]);
    let n = clip_grad_norm(&[a.clone(), b.clone()], 10.0).unwrap();
    assert!((n.item().unwrap() - 5.0).abs() < 1e-6);
    assert_eq!(
        vals(&a.grad().unwrap()),
        vec![3.0, 0.0],
        "below the limit: unchanged"
    );
    let n = clip_grad_norm(&[a.clone(), b.clone()], 2.5).unwrap();
    assert!((n.item().unwrap() - 5.0).abs() < 1e-6);
    let total: f64 = [vals(&a.grad().unwrap()), vals(&b.grad().unwrap())]
        .concat()
        .iter()
        .map(|x| x * x)
        .sum();
    assert!((total.sqrt() - 2.5).abs() < 1e-5);
    assert!(clip_grad_norm(&[a], 0.0).is_err());
}

#[test]
fn clip_grad_norm_matches_f64_in_every_dtype_and_layout() {
    for max_norm in [1.0, 1e6] {
        let params = clip_params(Device::Cpu);
        let before: Vec<Vec<f64>> = params.iter().map(|p| vals(&p.grad().unwrap())).collect();
        let formats: Vec<MemoryFormat> = params
            .iter()
            .map(|p| p.grad().unwrap().memory_format())
            .collect();
        let want_norm = before.iter().flatten().map(|x| x * x).sum::<f64>().sqrt();
        let held: Vec<Tensor> = params.iter().map(|p| p.grad().unwrap()).collect();
        let norm = clip_grad_norm(&params, max_norm).unwrap();
        // In place, as PyTorch's: the held gradients are the clipped ones, except the view
        // (parameter 2), which is copied first.
        for (k, (p, h)) in params.iter().zip(&held).enumerate() {
            assert_eq!(p.grad().unwrap().shares_storage(h), k != 2, "gradient {k}");
        }
        assert_eq!(norm.dtype(), DType::F32);
        let got = norm.item().unwrap();
        assert!(
            ((got - want_norm) / want_norm).abs() < 1e-6,
            "norm {got} vs {want_norm}"
        );
        let coef = (max_norm / (want_norm + 1e-6)).min(1.0);
        let tols = [1e-6, 1e-3, 8e-3, 1e-6];
        for (((p, g0), tol), format) in params.iter().zip(&before).zip(tols).zip(&formats) {
            let g = p.grad().unwrap();
            let want: Vec<f64> = g0.iter().map(|x| x * coef).collect();
            assert_close(&vals(&g), &want, tol, &format!("{:?} gradient", g.dtype()));
            assert_eq!(g.dtype(), p.dtype(), "the gradient keeps its dtype");
            assert_eq!(g.memory_format(), *format, "and its memory format");
        }
    }
    // f64 gradients take the per-tensor path, with the same result.
    let p = param(&[0.0, 0.0]);
    set_grad(&p, &[3.0, 4.0]);
    assert_eq!(
        clip_grad_norm(std::slice::from_ref(&p), 1.0)
            .unwrap()
            .item()
            .unwrap(),
        5.0
    );
    assert_close(&vals(&p.grad().unwrap()), &[0.6, 0.8], 1e-6, "f64");
    // No gradients: norm 0.
    let q = param(&[1.0]);
    assert_eq!(clip_grad_norm(&[q], 1.0).unwrap().item().unwrap(), 0.0);
}

#[test]
fn optimizer_state_round_trips_through_named_tensors() {
    let p = param(&[1.0, 2.0]);
    let mut opt = Adam::new(vec![p.clone()], AdamConfig::adam(0.1)).unwrap();
    set_grad(&p, &[0.5, 0.5]);
    opt.step().unwrap();
    let named: std::collections::BTreeMap<String, Tensor> =
        opt.state_tensors().unwrap().into_iter().collect();
    assert_eq!(
        named.keys().cloned().collect::<Vec<_>>(),
        vec!["0.exp_avg", "0.exp_avg_sq", "0.step"]
    );
    let q = param(&[1.0, 2.0]);
    let mut other = Adam::new(vec![q.clone()], AdamConfig::adam(0.1)).unwrap();
    other.load_state_tensors(&named).unwrap();
    assert_eq!(other.states()[0].step_count().unwrap(), 1);
    let mut bad = named.clone();
    bad.insert(
        "7.exp_avg".into(),
        Tensor::zeros(&[2], DType::F64, Device::Cpu).unwrap(),
    );
    assert!(other.load_state_tensors(&bad).is_err());
}

#[test]
fn adadelta_matches_the_update_rule() {
    let p = param(&[1.0, -1.0]);
    let mut opt = Adadelta::new(vec![p.clone()], 1.0).unwrap();
    let (mut w, mut s, mut u) = ([1.0f64, -1.0], [0.0f64; 2], [0.0f64; 2]);
    for g in [[0.3, -0.1], [0.2, 0.4]] {
        set_grad(&p, &g);
        opt.step().unwrap();
        for i in 0..2 {
            s[i] = 0.9 * s[i] + 0.1 * g[i] * g[i];
            let d = (u[i] + 1e-6f64).sqrt() / (s[i] + 1e-6f64).sqrt() * g[i];
            u[i] = 0.9 * u[i] + 0.1 * d * d;
            w[i] -= d;
        }
        assert_close(&vals(&p), &w, 1e-14, "adadelta");
    }
}
