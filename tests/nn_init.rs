//! `nn::init`, PyTorch's `torch.nn.init`: fans and gains as PyTorch computes them (the
//! numbers below are PyTorch's), the statistics of each initialisation on large tensors
//! against the distribution it names, bounds, the tensor kept (dtype, `requires_grad`, the
//! tensor itself), seeds, and the errors.

mod common;
use common::vals;
use mantissa::nn::init::{self, FanMode, Nonlinearity};
use mantissa::*;

fn param(shape: &[usize], dt: DType) -> Tensor {
    Tensor::zeros(shape, dt, Device::Cpu)
        .unwrap()
        .requires_grad(true)
        .unwrap()
}

/// Mean and variance (divided by n) of `v`.
fn stats(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    (mean, var)
}

/// The mean within 5 standard errors of `mean`, and the standard deviation within `rel` of
/// `std`.
fn assert_normal_like(v: &[f64], mean: f64, std: f64, rel: f64, what: &str) {
    let (m, var) = stats(v);
    let se = std / (v.len() as f64).sqrt();
    assert!((m - mean).abs() <= 5.0 * se, "{what}: mean {m} vs {mean}");
    let s = var.sqrt();
    assert!((s / std - 1.0).abs() <= rel, "{what}: std {s} vs {std}");
}

#[test]
fn fans_and_gains_are_pytorchs() {
    let t = |s: &[usize]| Tensor::zeros(s, DType::F32, Device::Cpu).unwrap();
    assert_eq!(
        init::fan_in_and_fan_out(&t(&[512, 256])).unwrap(),
        (256, 512)
    );
    assert_eq!(
        init::fan_in_and_fan_out(&t(&[8, 3, 5, 5])).unwrap(),
        (75, 200)
    );
    assert_eq!(init::fan(&t(&[8, 3, 5, 5]), FanMode::FanIn).unwrap(), 75);
    assert_eq!(init::fan(&t(&[8, 3, 5, 5]), FanMode::FanOut).unwrap(), 200);
    for s in [&[5][..], &[]] {
        let e = init::fan_in_and_fan_out(&t(s)).unwrap_err().to_string();
        assert!(
            e.contains("fewer than 2 dims") && e.contains(&format!("{s:?}")),
            "{e}"
        );
    }
    let g = |n, p| init::calculate_gain(n, p).unwrap();
    assert_eq!(g(Nonlinearity::Linear, None), 1.0);
    assert_eq!(g(Nonlinearity::Conv, None), 1.0);
    assert_eq!(g(Nonlinearity::Sigmoid, None), 1.0);
    assert_eq!(g(Nonlinearity::Selu, None), 0.75);
    assert!((g(Nonlinearity::Tanh, None) - 1.6666666666666667).abs() < 1e-15);
    assert!((g(Nonlinearity::Relu, Some(3.0)) - 2f64.sqrt()).abs() < 1e-15);
    assert!((g(Nonlinearity::LeakyRelu, None) - 1.4141428569978354).abs() < 1e-15);
    assert!((g(Nonlinearity::LeakyRelu, Some(0.2)) - 1.3867504905630728).abs() < 1e-15);
    let e = init::calculate_gain(Nonlinearity::LeakyRelu, Some(f64::NAN)).unwrap_err();
    assert!(e.to_string().contains("calculate_gain"), "{e}");
}

#[test]
fn xavier_statistics() {
    let mut g = Generator::new(0);
    let w = param(&[512, 512], DType::F32);
    init::xavier_normal_(&w, 1.0, &mut g).unwrap();
    let std = (2.0f64 / 1024.0).sqrt();
    assert_normal_like(&vals(&w), 0.0, std, 0.01, "xavier_normal");
    init::xavier_normal_(&w, 2.0, &mut g).unwrap();
    assert_normal_like(&vals(&w), 0.0, 2.0 * std, 0.01, "xavier_normal gain 2");
    // Uniform: within the bound, reaching near it, variance bound^2 / 3.
    let w = param(&[256, 128], DType::F32);
    init::xavier_uniform_(&w, 1.0, &mut g).unwrap();
    let bound = (6.0f64 / 384.0).sqrt();
    let v = vals(&w);
    assert!(v.iter().all(|x| x.abs() <= bound));
    assert!(v.iter().any(|x| x.abs() > 0.999 * bound));
    assert_normal_like(&v, 0.0, bound / 3f64.sqrt(), 0.01, "xavier_uniform");
}

#[test]
fn kaiming_statistics() {
    let mut g = Generator::new(1);
    // ReLU, fan in 64: bound sqrt(2) * sqrt(3 / 64).
    let w = param(&[256, 64], DType::F32);
    init::kaiming_uniform_(&w, 0.0, FanMode::FanIn, Nonlinearity::Relu, &mut g).unwrap();
    let bound = 2f64.sqrt() * (3.0f64 / 64.0).sqrt();
    let v = vals(&w);
    assert!(v.iter().all(|x| x.abs() <= bound));
    assert_normal_like(&v, 0.0, bound / 3f64.sqrt(), 0.015, "kaiming_uniform");
    // nn.Linear's own: a = sqrt(5), leaky ReLU, bound 1 / sqrt(fan_in).
    let slope = 5f64.sqrt();
    init::kaiming_uniform_(&w, slope, FanMode::FanIn, Nonlinearity::LeakyRelu, &mut g).unwrap();
    assert!(vals(&w).iter().all(|x| x.abs() <= 1.0 / 8.0 + 1e-7));
    // A convolution's weight, fan out 128 * 9.
    let w = param(&[128, 64, 3, 3], DType::F32);
    init::kaiming_normal_(&w, 0.0, FanMode::FanOut, Nonlinearity::Relu, &mut g).unwrap();
    let std = 2f64.sqrt() / (128.0f64 * 9.0).sqrt();
    assert_normal_like(&vals(&w), 0.0, std, 0.01, "kaiming_normal");
    // A tensor with no elements is left alone, before its fans are looked at.
    let empty = param(&[0], DType::F32);
    init::kaiming_normal_(&empty, 0.0, FanMode::FanIn, Nonlinearity::Relu, &mut g).unwrap();
}

#[test]
fn normal_uniform_and_constants() {
    let mut g = Generator::new(2);
    let w = param(&[200_000], DType::F32);
    init::normal_(&w, 3.0, 0.5, &mut g).unwrap();
    assert_normal_like(&vals(&w), 3.0, 0.5, 0.01, "normal");
    init::uniform_(&w, -1.0, 3.0, &mut g).unwrap();
    let v = vals(&w);
    assert!(v.iter().all(|x| (-1.0..3.0).contains(x)));
    assert_normal_like(&v, 1.0, 4.0 / 12f64.sqrt(), 0.01, "uniform");
    init::uniform_(&w, 0.25, 0.25, &mut g).unwrap();
    assert!(vals(&w).iter().all(|&x| x == 0.25));
    init::ones_(&w).unwrap();
    assert!(vals(&w).iter().all(|&x| x == 1.0));
    init::zeros_(&w).unwrap();
    assert!(vals(&w).iter().all(|&x| x == 0.0));
    init::constant_(&w, -2.5).unwrap();
    assert!(vals(&w).iter().all(|&x| x == -2.5));
    // Integer tensors take constants, not random values.
    let ints = Tensor::zeros(&[3], DType::I64, Device::Cpu).unwrap();
    init::constant_(&ints, 7.0).unwrap();
    assert_eq!(ints.to_vec::<i64>().unwrap(), vec![7, 7, 7]);
    let e = init::normal_(&ints, 0.0, 1.0, &mut g)
        .unwrap_err()
        .to_string();
    assert!(e.contains("init::normal_") && e.contains("I64"), "{e}");
    assert!(init::uniform_(&ints, 0.0, 1.0, &mut g).is_err());
}

#[test]
fn trunc_normal_stays_within_its_bounds() {
    let mut g = Generator::new(3);
    let w = param(&[200_000], DType::F32);
    // Moments of N(0, 1) truncated to each interval, from its density (computed aside).
    for (a, b, mean, var) in [
        (-2.0, 2.0, 0.0, 0.7737413035499232f64),
        (0.0, 3.0, 0.7911568260634169, 0.34740780123580184),
        (5.0, 6.0, 5.183147090677585, 0.029452429692192084),
    ] {
        init::trunc_normal_(&w, 0.0, 1.0, a, b, &mut g).unwrap();
        let v = vals(&w);
        assert!(v.iter().all(|x| (a..=b).contains(x)), "[{a}, {b}]");
        assert_normal_like(&v, mean, var.sqrt(), 0.01, &format!("trunc [{a}, {b}]"));
    }
    // Shifted and scaled: N(1, 0.02^2) cut at two standard deviations.
    init::trunc_normal_(&w, 1.0, 0.02, 0.96, 1.04, &mut g).unwrap();
    let v = vals(&w);
    assert!(v.iter().all(|x| (0.96..=1.04).contains(x)));
    assert_normal_like(
        &v,
        1.0,
        0.02 * 0.7737413035499232f64.sqrt(),
        0.01,
        "trunc shifted",
    );
    for (std, a, b) in [
        (0.0, -1.0, 1.0),
        (1.0, 1.0, 1.0),
        (1.0, 2.0, 1.0),
        (f64::NAN, 0.0, 1.0),
    ] {
        let e = init::trunc_normal_(&w, 0.0, std, a, b, &mut g).unwrap_err();
        assert!(e.to_string().contains("trunc_normal_"), "{e}");
    }
}

#[test]
fn the_tensor_is_written_in_place_and_kept() {
    for dt in [DType::F32, DType::F16, DType::BF16] {
        let w = param(&[16, 8], dt);
        let alias = w.clone();
        let v0 = w.version();
        let mut g = Generator::new(4);
        // Under grad mode, as a user calls them.
        init::xavier_uniform_(&w, 1.0, &mut g).unwrap();
        init::kaiming_normal_(&w, 0.0, FanMode::FanIn, Nonlinearity::Relu, &mut g).unwrap();
        init::trunc_normal_(&w, 0.0, 0.02, -0.04, 0.04, &mut g).unwrap();
        assert!(w.version() > v0);
        assert_eq!(w.dtype(), dt);
        assert!(w.is_leaf() && w.is_requires_grad());
        assert_eq!(vals(&alias), vals(&w));
        assert!(vals(&w).iter().all(|x| x.abs() <= 0.04 + 1e-3));
    }
}

#[test]
fn the_same_seed_gives_the_same_values() {
    type Init = fn(&Tensor, &mut Generator) -> Result<()>;
    let inits: [(&str, Init); 5] = [
        ("normal_", |t, g| init::normal_(t, 0.0, 1.0, g)),
        ("uniform_", |t, g| init::uniform_(t, -1.0, 1.0, g)),
        ("xavier_normal_", |t, g| init::xavier_normal_(t, 1.0, g)),
        ("kaiming_uniform_", |t, g| {
            init::kaiming_uniform_(t, 0.0, FanMode::FanIn, Nonlinearity::Relu, g)
        }),
        ("trunc_normal_", |t, g| {
            init::trunc_normal_(t, 0.0, 1.0, -2.0, 2.0, g)
        }),
    ];
    for (name, f) in inits {
        let run = |seed| {
            let w = param(&[8, 8], DType::F32);
            f(&w, &mut Generator::new(seed)).unwrap();
            vals(&w)
        };
        assert_eq!(run(9), run(9), "{name}");
        assert_ne!(run(9), run(10), "{name}");
    }
}

#[test]
fn fan_based_inits_refuse_a_tensor_of_rank_below_2() {
    let mut g = Generator::new(0);
    let b = param(&[8], DType::F32);
    let errs = [
        init::xavier_uniform_(&b, 1.0, &mut g).unwrap_err(),
        init::xavier_normal_(&b, 1.0, &mut g).unwrap_err(),
        init::kaiming_uniform_(&b, 0.0, FanMode::FanIn, Nonlinearity::Relu, &mut g).unwrap_err(),
        init::kaiming_normal_(&b, 0.0, FanMode::FanOut, Nonlinearity::Relu, &mut g).unwrap_err(),
    ];
    for (e, name) in errs.iter().zip([
        "xavier_uniform_",
        "xavier_normal_",
        "kaiming_uniform_",
        "kaiming_normal_",
    ]) {
        let m = e.to_string();
        assert!(m.contains(name) && m.contains("[8]"), "{m}");
    }
    // Nothing was written.
    assert!(vals(&b).iter().all(|&x| x == 0.0));
}
