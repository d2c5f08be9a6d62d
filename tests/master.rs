//! fp32 master weights (amp-semantics.md §6 items 15-17): the master-weight optimizer matches
//! a plain f32 optimizer on the masters, working copies are RN(master) or a stochastic
//! neighbour, tiny updates accumulate, and checkpoints restore the working copies bit-exactly.

mod common;
use common::*;
use mantissa::amp::{GradScaler, GradScalerConfig};
use mantissa::nn::{Activation, Linear, Module, Sequential};
use mantissa::optim::*;
use mantissa::*;
use proptest::prelude::*;

/// A half leaf parameter with the values of `v` (rounded).
fn half_param(v: &Tensor, dtype: DType) -> Tensor {
    v.to_dtype(dtype).unwrap().requires_grad(true).unwrap()
}

fn bits(t: &Tensor) -> Vec<u16> {
    match t.dtype() {
        DType::F16 => t
            .to_vec::<f16>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect(),
        DType::BF16 => t
            .to_vec::<bf16>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect(),
        d => panic!("not a half dtype: {d:?}"),
    }
}

fn master(opt: &dyn Optimizer, i: usize) -> Tensor {
    opt.states()[i].tensors["master"].clone()
}

/// The optimizers under test, built on `params`.
fn make(kind: usize, params: Vec<Tensor>) -> Box<dyn Optimizer> {
    match kind {
        0 => {
            let cfg = SgdConfig {
                momentum: 0.9,
                weight_decay: 1e-2,
                nesterov: true,
                ..SgdConfig::new(0.05)
            };
            Box::new(Sgd::new(params, cfg).unwrap())
        }
        1 => Box::new(Adam::new(params, AdamConfig::adam(1e-2)).unwrap()),
        2 => Box::new(Adam::new(params, AdamConfig::adamw(1e-2)).unwrap()),
        3 => {
            let mut o = Adadelta::new(params, 1.0).unwrap();
            o.weight_decay = 1e-3;
            Box::new(o)
        }
        _ => Box::new(Sgld::new(params, SgdConfig::new(1e-2), 1e-3, 7).unwrap()),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Item 15: masters follow the f32 optimizer fed the same (half) gradients, and with
    /// round to nearest the working copy is RN(master).
    #[test]
    fn masters_match_the_f32_optimizer(
        kind in 0usize..5,
        bf in any::<bool>(),
        n in 1usize..300,
        seed in 0u64..1000,
    ) {
        let dtype = if bf { DType::BF16 } else { DType::F16 };
        let w = half_param(&f32s(&[n], seed), dtype);
        let reference = w.detach().to_dtype(DType::F32).unwrap().requires_grad(true).unwrap();
        let mut opt = make(kind, vec![w.clone()]);
        opt.use_master_weights(Rounding::Nearest).unwrap();
        let mut ref_opt = make(kind, vec![reference.clone()]);
        for k in 0..4 {
            let g = f32s(&[n], seed + 100 + k).to_dtype(dtype).unwrap();
            w.set_grad(Some(g.clone())).unwrap();
            reference.set_grad(Some(g.to_dtype(DType::F32).unwrap())).unwrap();
            opt.step().unwrap();
            ref_opt.step().unwrap();
        }
        let m = master(&*opt, 0);
        prop_assert_eq!(m.dtype(), DType::F32);
        assert_close(&vals(&m), &vals(&reference), 1e-6, "master vs f32 optimizer");
        prop_assert_eq!(bits(&w), bits(&m.to_dtype(dtype).unwrap()));
        for (name, t) in &opt.states()[0].tensors {
            prop_assert_eq!(t.dtype(), DType::F32, "state {} is not f32", name);
        }
    }
}

/// An SGD step of `lr * g` on a bf16 working copy of `start` (n elements) with masters.
fn sr_step(start: f32, grad: f32, n: usize, seed: u64) -> (Tensor, Box<dyn Optimizer>) {
    let w = Tensor::full(&[n], start as f64, DType::BF16, Device::Cpu)
        .unwrap()
        .requires_grad(true)
        .unwrap();
    let mut opt: Box<dyn Optimizer> =
        Box::new(Sgd::new(vec![w.clone()], SgdConfig::new(1.0)).unwrap());
    opt.use_master_weights(Rounding::Stochastic { seed })
        .unwrap();
    w.set_grad(Some(
        Tensor::full(&[n], grad as f64, DType::BF16, Device::Cpu).unwrap(),
    ))
    .unwrap();
    opt.step().unwrap();
    (w, opt)
}

/// Item 16: stochastic rounding picks a neighbour, is unbiased, and is deterministic per seed.
#[test]
fn stochastic_rounding_is_unbiased_and_seeded() {
    let n = 1 << 16;
    // 1.0 - (-2^-9) = 1 + 2^-9: a quarter of the way from 1.0 to the next bf16, 1 + 2^-7.
    let (w, opt) = sr_step(1.0, -(2f32.powi(-9)), n, 3);
    let target = 1.0 + 2f64.powi(-9);
    assert_eq!(vals(&master(&*opt, 0))[0], target);
    let v = vals(&w);
    let (lo, hi) = (1.0, 1.0 + 2f64.powi(-7));
    assert!(v.iter().all(|&x| x == lo || x == hi), "not a neighbour");
    let up = v.iter().filter(|&&x| x == hi).count() as f64 / n as f64;
    // Binomial(65536, 1/4): sd 0.0017; allow 5 sd.
    assert!((up - 0.25).abs() < 0.0085, "rounded up {up}, expected 0.25");
    let mean = v.iter().sum::<f64>() / n as f64;
    assert!((mean - target).abs() < 5e-5, "mean {mean} vs {target}");
    let (again, _) = sr_step(1.0, -(2f32.powi(-9)), n, 3);
    assert_eq!(bits(&w), bits(&again), "same seed, different bits");
    let (other, _) = sr_step(1.0, -(2f32.powi(-9)), n, 4);
    assert_ne!(bits(&w), bits(&other), "different seeds, same bits");
}

/// Item 17: updates below half a bf16 ulp are lost in a bf16-only run but kept by the master.
#[test]
fn tiny_updates_accumulate_in_the_master() {
    let n = 4096;
    let run = |masters: Option<Rounding>| {
        let w = Tensor::ones(&[n], DType::BF16, Device::Cpu)
            .unwrap()
            .requires_grad(true)
            .unwrap();
        let mut opt = Sgd::new(vec![w.clone()], SgdConfig::new(1e-4)).unwrap();
        if let Some(r) = masters {
            opt.use_master_weights(r).unwrap();
        }
        for _ in 0..100 {
            w.set_grad(Some(Tensor::ones(&[n], DType::BF16, Device::Cpu).unwrap()))
                .unwrap();
            opt.step().unwrap();
        }
        let m = opt.states()[0].tensors.get("master").map(vals);
        (vals(&w), m)
    };
    let (plain, none) = run(None);
    assert!(none.is_none());
    assert!(plain.iter().all(|&x| x == 1.0), "bf16-only run moved");
    let (rn, m) = run(Some(Rounding::Nearest));
    let m = m.unwrap();
    assert!((m[0] - 0.99).abs() < 1e-5, "master {}", m[0]);
    assert_eq!(rn[0], bf16::from_f64(m[0]).to_f64());
    assert!(rn[0] < 1.0);
    let (sr, m) = run(Some(Rounding::Stochastic { seed: 1 }));
    let mean = sr.iter().sum::<f64>() / n as f64;
    assert!((mean - m.unwrap()[0]).abs() < 2e-4, "SR mean {mean}");
}

fn mlp(seed: u64) -> Sequential {
    let mut g = Generator::new(seed);
    let mut m = Sequential::new()
        .push(Linear::new(6, 16, true, &mut g).unwrap())
        .push(Activation::Tanh)
        .push(Linear::new(16, 3, true, &mut g).unwrap());
    m.to_dtype(DType::BF16).unwrap();
    m
}

fn train_steps(model: &Sequential, opt: &mut dyn Optimizer, from: u64, to: u64) {
    for s in from..to {
        let x = f32s(&[8, 6], 50 + s);
        let y = Tensor::from_vec(vec![0i64, 1, 2, 0, 1, 2, 0, 1], &[8], Device::Cpu).unwrap();
        opt.zero_grad();
        let logits = amp::with_autocast(DType::BF16, || model.forward(&x))
            .unwrap()
            .unwrap();
        logits
            .cross_entropy(&y, Default::default())
            .unwrap()
            .backward()
            .unwrap();
        opt.step().unwrap();
    }
}

fn model_bits(m: &Sequential) -> Vec<Vec<u16>> {
    m.parameters().iter().map(bits).collect()
}

/// Item 17: masters, moments and step counts checkpointed; loading them regenerates the
/// stochastically rounded working copies bit-exactly, and training continues identically.
#[test]
fn checkpoint_restores_working_copies_bit_exactly() {
    let path = std::env::temp_dir().join(format!(
        "mantissa-master-{}.safetensors",
        std::process::id()
    ));
    let sr = Rounding::Stochastic { seed: 11 };
    let model = mlp(1);
    let mut opt = Adam::new(model.parameters(), AdamConfig::adamw(3e-3)).unwrap();
    opt.use_master_weights(sr).unwrap();
    train_steps(&model, &mut opt, 0, 5);
    checkpoint::save(&path, &model, Some(&opt), &[]).unwrap();
    let saved = model_bits(&model);

    // The optimizer state alone rebuilds the working copies, whatever the model holds.
    let mut other = mlp(2);
    let mut opt2 = Adam::new(other.parameters(), AdamConfig::adamw(3e-3)).unwrap();
    opt2.use_master_weights(sr).unwrap();
    let (file, _) = checkpoint::read(&path).unwrap();
    let state = file
        .iter()
        .filter_map(|(k, t)| k.strip_prefix("optim.").map(|k| (k.to_string(), t.clone())))
        .collect();
    opt2.load_state_tensors(&state).unwrap();
    assert_eq!(model_bits(&other), saved);

    // Through checkpoint::load too, then both runs go on identically.
    other = mlp(3);
    let mut opt3 = Adam::new(other.parameters(), AdamConfig::adamw(3e-3)).unwrap();
    opt3.use_master_weights(sr).unwrap();
    checkpoint::load(&path, &mut other, Some(&mut opt3)).unwrap();
    train_steps(&model, &mut opt, 5, 8);
    train_steps(&other, &mut opt3, 5, 8);
    assert_eq!(model_bits(&other), model_bits(&model));
    assert_eq!(vals(&master(&opt3, 0)), vals(&master(&opt, 0)));
    std::fs::remove_file(&path).unwrap();
}

/// f16 working copies under the GradScaler: unscale_ writes f32 gradients (no FP16 error),
/// clipping sees the unscaled norm, and an overflow leaves masters, moments and working
/// copies bit-unchanged.
#[test]
fn scaler_with_f16_masters() {
    let w = half_param(&f32s(&[64], 5), DType::F16);
    let mut opt = Adam::new(vec![w.clone()], AdamConfig::adam(1e-2)).unwrap();
    let cfg = GradScalerConfig {
        init_scale: 1024.0,
        ..Default::default()
    };
    let mut scaler = GradScaler::new(cfg).unwrap();
    let c = f32s(&[64], 6).to_dtype(DType::F16).unwrap();
    let loss = |w: &Tensor| w.mul(&c).unwrap().sum_all().unwrap();

    // Without masters, f16 gradients are refused (pytorch#74739).
    scaler.scale(&loss(&w)).unwrap().backward().unwrap();
    assert!(scaler.unscale_(&mut opt).is_err());

    opt.use_master_weights(Rounding::Nearest).unwrap();
    let mut scaler = GradScaler::new(cfg).unwrap();
    opt.zero_grad();
    scaler.scale(&loss(&w)).unwrap().backward().unwrap();
    scaler.unscale_(&mut opt).unwrap();
    let g = w.grad().unwrap();
    assert_eq!(g.dtype(), DType::F32);
    assert_close(&vals(&g), &vals(&c), 1e-6, "unscaled gradient");
    let norm = clip_grad_norm(std::slice::from_ref(&w), 1.0)
        .unwrap()
        .item()
        .unwrap();
    let want = vals(&c).iter().map(|x| x * x).sum::<f64>().sqrt();
    assert!((norm - want).abs() < 1e-3 * want, "norm {norm} vs {want}");
    scaler.step(&mut opt).unwrap();
    scaler.update().unwrap();
    assert_eq!(
        bits(&w),
        bits(&master(&opt, 0).to_dtype(DType::F16).unwrap())
    );

    let before: Vec<_> = opt
        .state_tensors()
        .unwrap()
        .iter()
        .map(|(_, t)| vals(t))
        .collect();
    let wb = bits(&w);
    opt.zero_grad();
    let inf = Tensor::full(&[64], f64::INFINITY, DType::F16, Device::Cpu).unwrap();
    scaler
        .scale(&w.mul(&inf).unwrap().sum_all().unwrap())
        .unwrap()
        .backward()
        .unwrap();
    scaler.step(&mut opt).unwrap();
    scaler.update().unwrap();
    let after: Vec<_> = opt
        .state_tensors()
        .unwrap()
        .iter()
        .map(|(_, t)| vals(t))
        .collect();
    assert_eq!(bits(&w), wb);
    assert_eq!(format!("{after:?}"), format!("{before:?}"));
}

#[test]
fn master_weight_errors() {
    let w = half_param(&f32s(&[4], 1), DType::F16);
    let mut opt = Sgd::new(vec![w.clone()], SgdConfig::new(0.1)).unwrap();
    let e = opt
        .use_master_weights(Rounding::Stochastic { seed: 0 })
        .unwrap_err()
        .to_string();
    assert!(e.contains("F16") && e.contains("stochastic"), "{e}");
    // A state with masters cannot go into an optimizer without them.
    let mut with = Sgd::new(vec![w.clone()], SgdConfig::new(0.1)).unwrap();
    with.use_master_weights(Rounding::Nearest).unwrap();
    w.set_grad(Some(f32s(&[4], 2))).unwrap();
    with.step().unwrap();
    let state = with.state_tensors().unwrap().into_iter().collect();
    let e = opt.load_state_tensors(&state).unwrap_err().to_string();
    assert!(e.contains("master"), "{e}");
    // f32 parameters are their own masters: no state entry, same update as without.
    let p = f32s(&[4], 3).requires_grad(true).unwrap();
    let mut o = Sgd::new(vec![p.clone()], SgdConfig::new(0.1)).unwrap();
    o.use_master_weights(Rounding::Nearest).unwrap();
    let before = vals(&p);
    p.set_grad(Some(Tensor::ones(&[4], DType::F32, Device::Cpu).unwrap()))
        .unwrap();
    o.step().unwrap();
    assert!(!o.states()[0].tensors.contains_key("master"));
    let want: Vec<f64> = before
        .iter()
        .map(|x| ((*x as f32) - 0.1f32) as f64)
        .collect();
    assert_eq!(vals(&p), want);
}
