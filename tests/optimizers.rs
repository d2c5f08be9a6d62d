//! RMSprop, Adagrad, parameter groups and ReduceLROnPlateau beyond the PyTorch cases of
//! `tests/torch_reference.rs`: each optimizer trains a model, in f16/bf16 with fp32 master
//! weights too; groups keep their own rates and decay, refuse a parameter twice and
//! checkpoint with the rest; mistakes are errors.

mod common;
use common::*;
use mantissa::nn::{Activation, Linear, Module, Sequential};
use mantissa::optim::*;
use mantissa::*;

/// A two-layer MLP on a fixed regression problem: `y = sum(sin(x))` per row.
fn problem(dtype: DType) -> (Sequential, Tensor, Tensor) {
    let mut g = Generator::new(3);
    let mut m = Sequential::new()
        .push(Linear::new(4, 16, true, &mut g).unwrap())
        .push(Activation::Tanh)
        .push(Linear::new(16, 1, true, &mut g).unwrap());
    m.to_dtype(dtype).unwrap();
    let x = f32s(&[32, 4], 5);
    let y = x.sin().unwrap().sum(&[1], true).unwrap();
    (m, x.to_dtype(dtype).unwrap(), y.to_dtype(dtype).unwrap())
}

/// The loss before and after `steps` steps of `opt` on [`problem`].
fn train(
    m: &Sequential,
    x: &Tensor,
    y: &Tensor,
    opt: &mut dyn Optimizer,
    steps: usize,
) -> (f64, f64) {
    let loss = |m: &Sequential| m.forward(x).unwrap().mse_loss(y, Reduction::Mean).unwrap();
    let first = loss(m).item().unwrap();
    for _ in 0..steps {
        opt.zero_grad();
        loss(m).backward().unwrap();
        opt.step().unwrap();
    }
    (first, loss(m).item().unwrap())
}

type Make = fn(Vec<Tensor>) -> Box<dyn Optimizer>;

fn rmsprop(p: Vec<Tensor>) -> Box<dyn Optimizer> {
    let mut o = RmsProp::new(p, 3e-3).unwrap();
    o.momentum = 0.5;
    o.centered = true;
    Box::new(o)
}

fn adagrad(p: Vec<Tensor>) -> Box<dyn Optimizer> {
    let mut o = Adagrad::new(p, 0.05).unwrap();
    o.initial_accumulator_value = 0.1;
    Box::new(o)
}

#[test]
fn rmsprop_and_adagrad_train_in_every_dtype() {
    let makes: [(&str, Make); 2] = [("rmsprop", rmsprop), ("adagrad", adagrad)];
    for (name, make) in makes {
        let (m, x, y) = problem(DType::F32);
        let mut opt = make(m.parameters());
        let (before, after) = train(&m, &x, &y, opt.as_mut(), 60);
        assert!(after < 0.2 * before, "{name}: loss {before} -> {after}");
        for dt in [DType::F16, DType::BF16] {
            let (m, x, y) = problem(dt);
            let mut opt = make(m.parameters());
            opt.use_master_weights(Rounding::Nearest).unwrap();
            let (b, a) = train(&m, &x, &y, opt.as_mut(), 60);
            assert!(
                a < 0.25 * b,
                "{name} {dt:?} with master weights: loss {b} -> {a}"
            );
            let master = &opt.states()[0].tensors["master"];
            assert_eq!(master.dtype(), DType::F32, "{name} {dt:?}");
            // The states are kept in f32 beside the master.
            for (k, t) in &opt.states()[0].tensors {
                assert_eq!(t.dtype(), DType::F32, "{name} {dt:?} state {k}");
            }
        }
    }
}

#[test]
fn rmsprop_states_are_named_as_pytorch_and_round_trip() {
    let (m, x, y) = problem(DType::F32);
    let mut opt = rmsprop(m.parameters());
    train(&m, &x, &y, opt.as_mut(), 3);
    let keys: Vec<String> = opt.states()[0].tensors.keys().cloned().collect();
    assert_eq!(keys, ["grad_avg", "momentum_buffer", "square_avg", "step"]);
    let named = opt.state_tensors().unwrap().into_iter().collect();
    let (m2, _, _) = problem(DType::F32);
    let mut other = rmsprop(m2.parameters());
    other.load_state_tensors(&named).unwrap();
    assert_eq!(other.states()[0].step_count().unwrap(), 3);
    // Adagrad's sum starts at its initial value.
    let p = Tensor::from_vec(vec![1.0f32, -2.0], &[2], Device::Cpu)
        .unwrap()
        .requires_grad(true)
        .unwrap();
    let mut ada = Adagrad::new(vec![p.clone()], 0.1).unwrap();
    ada.initial_accumulator_value = 0.5;
    p.set_grad(Some(
        Tensor::from_vec(vec![1.0f32, 2.0], &[2], Device::Cpu).unwrap(),
    ))
    .unwrap();
    ada.step().unwrap();
    assert_close(
        &vals(&ada.states()[0].tensors["sum"]),
        &[1.5, 4.5],
        1e-7,
        "sum",
    );
    let want = [
        1.0 - 0.1 / (1.5f64.sqrt() + 1e-10),
        -2.0 - 0.2 / (4.5f64.sqrt() + 1e-10),
    ];
    assert_close(&vals(&p), &want, 1e-6, "adagrad step");
}

#[test]
fn hyperparameter_mistakes_are_errors() {
    let p = || vec![f32s(&[2], 1).requires_grad(true).unwrap()];
    assert!(RmsProp::new(p(), -1.0).is_err());
    assert!(Adagrad::new(p(), f64::NAN).is_err());
    let params = p();
    params[0].set_grad(Some(f32s(&[2], 2))).unwrap();
    let mut r = RmsProp::new(params.clone(), 0.1).unwrap();
    r.alpha = 1.5;
    let e = r.step().unwrap_err().to_string();
    assert!(e.contains("RmsProp") && e.contains("alpha 1.5"), "{e}");
    let before = vals(&params[0]);
    let mut a = Adagrad::new(params.clone(), 0.1).unwrap();
    a.lr_decay = -0.5;
    let e = a.step().unwrap_err().to_string();
    assert!(e.contains("lr_decay"), "{e}");
    assert_eq!(vals(&params[0]), before, "a refused step changes nothing");
}

/// Group rates follow the optimizer's; a group's weight decay replaces the optimizer's; a
/// parameter in two groups, or a ratio to a zero rate, is refused.
#[test]
fn parameter_groups_keep_their_rate_and_decay() {
    let w = Tensor::from_vec(vec![1.0f32, 2.0], &[2], Device::Cpu)
        .unwrap()
        .requires_grad(true)
        .unwrap();
    let b = Tensor::from_vec(vec![3.0f32], &[1], Device::Cpu)
        .unwrap()
        .requires_grad(true)
        .unwrap();
    let cfg = SgdConfig {
        weight_decay: 0.5,
        ..SgdConfig::new(0.1)
    };
    let mut opt = Sgd::new(vec![w.clone()], cfg).unwrap();
    let group = GroupOptions {
        lr: Some(0.4),
        weight_decay: Some(0.0),
    };
    opt.add_param_group(vec![b.clone()], group).unwrap();
    assert_eq!(opt.param_group_lrs(), vec![0.1, 0.4]);
    opt.set_lr(0.05);
    assert_eq!(opt.param_group_lrs(), vec![0.05, 0.2]);
    w.set_grad(Some(
        Tensor::from_vec(vec![1.0f32, 1.0], &[2], Device::Cpu).unwrap(),
    ))
    .unwrap();
    b.set_grad(Some(
        Tensor::from_vec(vec![1.0f32], &[1], Device::Cpu).unwrap(),
    ))
    .unwrap();
    opt.step().unwrap();
    // w: 0.05 (g + 0.5 w); b: 0.2 g, no decay.
    assert_close(&vals(&w), &[1.0 - 0.05 * 1.5, 2.0 - 0.05 * 2.0], 1e-7, "w");
    assert_close(&vals(&b), &[3.0 - 0.2], 1e-7, "b");
    assert_eq!(opt.params().len(), 2);
    let names: Vec<String> = opt
        .state_tensors()
        .unwrap()
        .into_iter()
        .map(|n| n.0)
        .collect();
    assert_eq!(names, ["0.step", "1.step"]);

    let e = opt
        .add_param_group(vec![w.clone()], GroupOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("already parameter 0"), "{e}");
    let e = opt
        .add_param_group(
            vec![f32s(&[1], 3)],
            GroupOptions {
                lr: Some(-1.0),
                weight_decay: None,
            },
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("add_param_group") && e.contains("lr"), "{e}");
    let trainable = |seed| f32s(&[1], seed).requires_grad(true).unwrap();
    let mut zero = Sgd::new(vec![trainable(4)], SgdConfig::new(0.0)).unwrap();
    let e = zero
        .add_param_group(
            vec![trainable(5)],
            GroupOptions {
                lr: Some(0.1),
                weight_decay: None,
            },
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("is 0"), "{e}");
    assert_eq!(zero.params().len(), 1, "a refused group adds nothing");
}

/// A model with its biases in a no-decay group trains, and a checkpoint of it restores both
/// groups' states.
#[test]
fn grouped_training_checkpoints_and_resumes() {
    let (m, x, y) = problem(DType::F32);
    let split = |m: &Sequential| -> (Vec<Tensor>, Vec<Tensor>) {
        m.parameters().into_iter().partition(|p| p.rank() > 1)
    };
    let make = |m: &Sequential| {
        let (decay, no_decay) = split(m);
        let mut opt = Adam::new(decay, AdamConfig::adamw(1e-2)).unwrap();
        let group = GroupOptions {
            lr: Some(2e-2),
            weight_decay: Some(0.0),
        };
        opt.add_param_group(no_decay, group).unwrap();
        opt
    };
    let mut opt = make(&m);
    let (before, after) = train(&m, &x, &y, &mut opt, 40);
    assert!(after < 0.2 * before, "loss {before} -> {after}");
    let path = temp_checkpoint("optimizers", "groups");
    checkpoint::save(&path, &m, Some(&opt), &[]).unwrap();
    let (mut m2, _, _) = problem(DType::F32);
    let mut opt2 = make(&m2);
    checkpoint::load(&path, &mut m2, Some(&mut opt2)).unwrap();
    train(&m, &x, &y, &mut opt, 5);
    train(&m2, &x, &y, &mut opt2, 5);
    for (a, b) in m.parameters().iter().zip(m2.parameters()) {
        assert_eq!(vals(a), vals(&b), "resumed training is bit-exact");
    }
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

#[test]
fn plateau_cuts_the_rate_and_refuses_bad_settings() {
    let mut p = ReduceLrOnPlateau::new(1.0);
    p.patience = 0;
    p.factor = 0.5;
    p.min_lr = 0.3;
    let lrs: Vec<f64> = [3.0, 2.0, 2.5, 2.5, 2.5, 1.0]
        .iter()
        .map(|&m| p.step(m).unwrap())
        .collect();
    assert_eq!(lrs, vec![1.0, 1.0, 0.5, 0.3, 0.3, 0.3]);
    let saved = p.state();
    let mut q = ReduceLrOnPlateau::new(1.0);
    q.load_state(saved).unwrap();
    assert_eq!(q.lr(), 0.3);
    assert!(q.load_state([-1.0, 0.0, 0.0, 0.0]).is_err());
    assert!(q.load_state([0.1, 0.0, 0.5, 0.0]).is_err());
    let mut bad = ReduceLrOnPlateau::new(0.1);
    bad.factor = 1.0;
    let e = bad.step(1.0).unwrap_err().to_string();
    assert!(e.contains("factor 1"), "{e}");
}

/// With parameter groups, each group's rate is cut with its own floor (PyTorch's
/// `min_lr` as a list, or one value for all): a group at its floor stays there while the
/// others go on, and the SGD steps take each group's rate.
#[test]
fn plateau_floors_each_parameter_group_on_its_own() {
    let w = Tensor::ones(&[2], DType::F32, Device::Cpu)
        .unwrap()
        .requires_grad(true)
        .unwrap();
    let b = Tensor::ones(&[1], DType::F32, Device::Cpu)
        .unwrap()
        .requires_grad(true)
        .unwrap();
    let mut opt = Sgd::new(vec![w.clone()], SgdConfig::new(1.0)).unwrap();
    let group = GroupOptions {
        lr: Some(0.4),
        ..Default::default()
    };
    opt.add_param_group(vec![b.clone()], group).unwrap();
    let mut p = ReduceLrOnPlateau::new(1.0);
    (p.patience, p.factor) = (0, 0.5);
    p.group_min_lrs = vec![0.05, 0.15];
    let mut seen = Vec::new();
    for m in [3.0, 3.0, 3.0, 3.0, 3.0] {
        seen.push(p.step_optimizer(m, &mut opt).unwrap());
    }
    // Group 1 reaches its floor at the second cut (0.4, 0.2, then 0.15 not 0.1); group 0
    // goes on to its own (0.05).
    assert_eq!(
        seen,
        vec![
            vec![1.0, 0.4],
            vec![0.5, 0.2],
            vec![0.25, 0.15],
            vec![0.125, 0.15],
            vec![0.0625, 0.15]
        ]
    );
    // The update uses each group's rate: a gradient of 1 moves w by 0.0625, b by 0.15.
    (w.mul(1.0).unwrap().sum_all().unwrap())
        .add(&b.sum_all().unwrap())
        .unwrap()
        .backward()
        .unwrap();
    opt.step().unwrap();
    assert_eq!(w.to_vec::<f32>().unwrap(), vec![0.9375; 2]);
    assert_eq!(b.to_vec::<f32>().unwrap(), vec![0.85]);
    // One scalar floor for all; a list of the wrong length and a rate of 0 for the first
    // group beside a nonzero one are refused by name.
    p.group_min_lrs = vec![0.1];
    let e = p.step_optimizer(3.0, &mut opt).unwrap_err().to_string();
    assert!(
        e.contains("1 values in group_min_lrs for an optimizer of 2"),
        "{e}"
    );
    let e = opt
        .set_param_group_lrs(&[0.0, 0.1])
        .unwrap_err()
        .to_string();
    assert!(e.contains("the first group's rate is 0"), "{e}");
    assert!(opt.set_param_group_lrs(&[0.1]).is_err());
    assert!(opt.set_param_group_lrs(&[0.1, -1.0]).is_err());
}

/// A checkpoint's optimizer state resumes only into the optimizer that wrote it, with the
/// settings that make the same states: another one's state would be dropped, or its own
/// started from zero mid-run.
#[test]
fn another_optimizers_state_is_refused_on_resume() {
    let (m, x, y) = problem(DType::F32);
    let mut adam = Adam::new(m.parameters(), AdamConfig::adam(1e-2)).unwrap();
    train(&m, &x, &y, &mut adam, 2);
    let path = temp_checkpoint("optimizers", "mismatch");
    checkpoint::save(&path, &m, Some(&adam), &[]).unwrap();
    let (_, meta) = checkpoint::read(&path).unwrap();
    assert_eq!(meta["mantissa.optimizer"], "Adam");
    let (mut m2, _, _) = problem(DType::F32);
    let before: Vec<Vec<f64>> = m2.parameters().iter().map(vals).collect();
    let mut sgd = Sgd::new(m2.parameters(), SgdConfig::new(0.1)).unwrap();
    let e = checkpoint::load(&path, &mut m2, Some(&mut sgd))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("Adam's") && e.contains("this optimizer is SGD"),
        "{e}"
    );
    let after: Vec<Vec<f64>> = m2.parameters().iter().map(vals).collect();
    assert_eq!(before, after, "a refused checkpoint changes nothing");
    // Without the metadata (state tensors alone), the state names tell.
    let named = adam.state_tensors().unwrap().into_iter().collect();
    let e = sgd.load_state_tensors(&named).unwrap_err().to_string();
    assert!(e.contains("SGD keeps no state \"exp_avg\""), "{e}");
    // The same optimizer with other settings: SGD with momentum needs its buffers.
    let mut plain = Sgd::new(m.parameters(), SgdConfig::new(0.1)).unwrap();
    train(&m, &x, &y, &mut plain, 1);
    let named = plain.state_tensors().unwrap().into_iter().collect();
    let cfg = SgdConfig {
        momentum: 0.9,
        ..SgdConfig::new(0.1)
    };
    let mut momentum = Sgd::new(m.parameters(), cfg).unwrap();
    let e = momentum.load_state_tensors(&named).unwrap_err().to_string();
    assert!(e.contains("0.momentum_buffer is missing"), "{e}");
    // The AdamW of the same file is another optimizer too.
    let (mut m3, _, _) = problem(DType::F32);
    let mut adamw = Adam::new(m3.parameters(), AdamConfig::adamw(1e-2)).unwrap();
    assert!(checkpoint::load(&path, &mut m3, Some(&mut adamw)).is_err());
    let mut same = Adam::new(m3.parameters(), AdamConfig::adam(1e-2)).unwrap();
    checkpoint::load(&path, &mut m3, Some(&mut same)).unwrap();
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

#[test]
fn schedule_settings_are_checked() {
    let ok = StepLr {
        base: 0.1,
        step_size: 2,
        gamma: 0.5,
    };
    ok.check().unwrap();
    let e = StepLr {
        gamma: f64::NAN,
        ..ok
    }
    .check()
    .unwrap_err()
    .to_string();
    assert!(e.contains("StepLr") && e.contains("gamma"), "{e}");
    assert!(StepLr { step_size: 0, ..ok }.check().is_err());
    let cos = CosineAnnealing {
        base: 0.1,
        t_max: 0,
        eta_min: 0.0,
    };
    assert!(cos.check().unwrap_err().to_string().contains("t_max"));
    let mut cycle = OneCycle::new(0.1, 100);
    cycle.check().unwrap();
    cycle.pct_start = 1.5;
    assert!(cycle.check().is_err());
    let warm = LinearWarmup {
        inner: MultiStepLr {
            base: 0.1,
            milestones: vec![3],
            gamma: -2.0,
        },
        warmup: 5,
        start_factor: 0.1,
    };
    assert!(warm
        .check()
        .unwrap_err()
        .to_string()
        .contains("MultiStepLr"));
    assert!(ConstantLr(-1.0).check().is_err());
}

/// Schedules set each parameter group's rate as PyTorch's schedulers do: PyTorch 2.15's
/// `param_groups[i]['lr']` for groups starting at 0.1 and 0.01, step by step.
#[test]
fn schedules_set_each_group_as_pytorch_does() {
    let p = |v: f32| {
        Tensor::from_vec(vec![v], &[1], Device::Cpu)
            .unwrap()
            .requires_grad(true)
            .unwrap()
    };
    let check = |s: &dyn LrSchedule, want: &[[f64; 2]]| {
        let mut opt = Sgd::new(vec![p(1.0)], SgdConfig::new(0.1)).unwrap();
        let g = GroupOptions {
            lr: Some(0.01),
            ..Default::default()
        };
        opt.add_param_group(vec![p(2.0)], g).unwrap();
        let initial = opt.param_group_lrs();
        for (t, w) in want.iter().enumerate() {
            opt.set_param_group_lrs(&s.group_lrs(t, &initial)).unwrap();
            let got = opt.param_group_lrs();
            for (g, w) in got.iter().zip(w) {
                assert!(
                    (g - w).abs() <= 1e-12 * w.abs().max(1.0),
                    "step {t}: {got:?} vs {w:?}"
                );
            }
        }
    };
    // CosineAnnealingLR(T_max=4, eta_min=0.002): each group anneals to the same floor.
    let cos = CosineAnnealing {
        base: 0.1,
        t_max: 4,
        eta_min: 0.002,
    };
    check(
        &cos,
        &[
            [0.1, 0.01],
            [0.08564823227814083, 0.008828427124746189],
            [0.051000000000000004, 0.005999999999999999],
            [0.016351767721859173, 0.00317157287525381],
            [0.002, 0.002],
        ],
    );
    // OneCycleLR(max_lr=0.5, total_steps=6, cycle_momentum=False): one cycle for all groups.
    check(
        &OneCycle::new(0.5, 6),
        &[
            [0.020000000000000018, 0.020000000000000018],
            [0.49720771772545586, 0.49720771772545586],
            [0.4058728269748815, 0.4058728269748815],
            [0.23131855133348753, 0.23131855133348753],
            [0.0667387650944153, 0.0667387650944153],
            [2e-06, 2e-06],
        ],
    );
    // StepLR(step_size=2, gamma=0.5): the groups keep their ratio.
    let step = StepLr {
        base: 0.1,
        step_size: 2,
        gamma: 0.5,
    };
    check(
        &step,
        &[
            [0.1, 0.01],
            [0.1, 0.01],
            [0.05, 0.005],
            [0.05, 0.005],
            [0.025, 0.0025],
        ],
    );
}

/// A token embedding and a head that share one weight, as GPT-2 ties them.
struct Tied {
    emb: mantissa::nn::Embedding,
    head: Linear,
}

impl Module for Tied {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.head.forward(&self.emb.forward(ids)?)
    }
    fn visit(&self, p: &str, f: &mut mantissa::nn::Visitor) {
        self.emb.visit(&mantissa::nn::join(p, "emb"), f);
        self.head.visit(&mantissa::nn::join(p, "head"), f);
    }
    fn visit_mut(&mut self, p: &str, f: &mut mantissa::nn::VisitorMut) -> Result<()> {
        self.emb.visit_mut(&mantissa::nn::join(p, "emb"), f)?;
        self.head.visit_mut(&mantissa::nn::join(p, "head"), f)
    }
}

#[test]
fn a_tied_weight_is_one_parameter_clipped_and_updated_once() {
    let mut g = Generator::new(7);
    let emb = mantissa::nn::Embedding::new(10, 4, &mut g).unwrap();
    let mut head = Linear::new(4, 10, true, &mut g).unwrap();
    head.weight = emb.weight.clone();
    let m = Tied { emb, head };
    let names: Vec<String> = m.named_parameters().into_iter().map(|p| p.0).collect();
    assert_eq!(names, vec!["emb.weight", "head.bias"]);
    // state_dict keeps both names, as PyTorch's does.
    let sd = m.state_dict();
    assert!(sd.contains_key("emb.weight") && sd.contains_key("head.weight"));
    let ids = Tensor::from_vec(vec![1i64, 3, 3, 9], &[4], Device::Cpu).unwrap();
    let logits = m.forward(&ids).unwrap();
    let loss = logits.sqr().unwrap().mean_all().unwrap();
    loss.backward().unwrap();
    let params = m.parameters();
    // The norm over the distinct gradients: each counted once.
    let want: f64 = params
        .iter()
        .map(|p| {
            let g = p.grad().unwrap().to_vec_f64().unwrap();
            g.iter().map(|v| v * v).sum::<f64>()
        })
        .sum::<f64>()
        .sqrt();
    let norm = clip_grad_norm(&params, 1e9).unwrap().item().unwrap();
    assert!((norm - want).abs() <= 1e-6 * want, "{norm} vs {want}");
    let before = m.head.weight.to_vec::<f32>().unwrap();
    let mut opt = Sgd::new(params, SgdConfig::new(0.1)).unwrap();
    opt.step().unwrap();
    // One update, seen through both modules.
    let after = m.emb.weight.to_vec::<f32>().unwrap();
    assert_ne!(before, after);
    assert_eq!(after, m.head.weight.to_vec::<f32>().unwrap());
}

#[test]
fn optimizers_refuse_by_name_what_they_could_never_train() {
    let leaf = Tensor::from_vec(vec![1.0f32, 2.0], &[2], Device::Cpu)
        .unwrap()
        .requires_grad(true)
        .unwrap();
    let plain = Tensor::from_vec(vec![1.0f32; 3], &[3], Device::Cpu).unwrap();
    let e = Sgd::new(vec![leaf.clone(), plain], SgdConfig::new(0.1))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("Sgd::new") && e.contains("parameter 1") && e.contains("[3]"),
        "{e}"
    );
    assert!(e.contains("does not require grad"), "{e}");
    let computed = leaf.mul(2.0).unwrap();
    let e = Adam::new(vec![computed], AdamConfig::adam(0.1))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("parameter 0") && e.contains("not a leaf"), "{e}");
    let e = Sgd::new(vec![leaf.clone(), leaf.clone()], SgdConfig::new(0.1))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("parameter 1") && e.contains("is parameter 0 again"),
        "{e}"
    );
    // A group added later is checked the same way, numbered after the optimizer's.
    let mut opt = Sgd::new(vec![leaf], SgdConfig::new(0.1)).unwrap();
    let frozen = Tensor::from_vec(vec![1.0f32; 2], &[2], Device::Cpu).unwrap();
    let e = opt
        .add_param_group(vec![frozen], GroupOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("parameter 1") && e.contains("does not require grad"),
        "{e}"
    );
}
