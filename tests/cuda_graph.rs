//! Whole training steps captured as CUDA graphs and replayed ([`mantissa::graph`]): N steps
//! through a `CapturedStep` give the same losses, parameters, optimizer and scaler states and
//! generator states, bit for bit, as the same N steps run eagerly, in fp32, fp16 with the
//! loss scaler (a step skipped on an inf included), bf16 with fp32 master weights, with
//! dropout and SGLD's noise, with a learning-rate schedule, and for an MLP, a convolution with
//! batch norm and pooling (the ResNet example's pieces) and an LSTM whose gradients are
//! clipped (the LSTM example's step); work that cannot be captured
//! is refused by name; replays allocate nothing; the profiler shows a replay as one record.
//! The comparisons run with cuDNN's deterministic algorithms only (`set_cudnn_deterministic`,
//! as the examples' `--cudnn-deterministic`): on the emulated device the non-deterministic
//! backward algorithms sum in another order each run, and the f32 convolution case differs
//! without it.
//! Without a GPU each test prints `skipped: no CUDA device` and passes; on the emulated device
//! (tests/emulator) the graphs are recorded and replayed by the emulated driver.
#![cfg(feature = "cuda-backend")]
#![allow(clippy::cloned_ref_to_slice_refs)]

mod common;
use common::parity::{gpu, CudnnDeterministic};
use mantissa::amp::{GradScaler, GradScalerConfig};
use mantissa::graph::CapturedStep;
use mantissa::nn::{
    Activation, BatchNorm2d, Conv2d, Dropout, Flatten, Linear, Lstm, MaxPool2d, Module, Sequential,
};
use mantissa::optim::{Adam, AdamConfig, Optimizer, Rounding, Sgd, SgdConfig, Sgld};
use mantissa::train::classify_step;
use mantissa::*;
use std::cell::RefCell;
use std::rc::Rc;

/// Held by each test: a capture records everything queued on the device's one compute
/// stream, whichever thread queues it, so one thread drives the device while it is open.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// The network trained.
#[derive(Clone, Copy, Default, PartialEq)]
enum Arch {
    /// Linear, ReLU, (dropout), linear on [16, 12].
    #[default]
    Mlp,
    /// Convolution, batch norm, ReLU, max pool, linear on [16, 3, 8, 8] in channels-last.
    Conv,
    /// A 2-layer LSTM over 6 steps of [16, 12] and a linear read-out of the last, the
    /// gradients clipped to norm 1 (the LSTM example's step).
    Lstm,
}

/// An LSTM and a linear read-out of its last step.
struct LastStep {
    lstm: Lstm,
    head: Linear,
}

impl Module for LastStep {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.lstm.forward(x)?;
        let (n, t, h) = (y.shape()[0], y.shape()[1], y.shape()[2]);
        self.head.forward(&y.narrow(1, t - 1, 1)?.reshape(&[n, h])?)
    }
    fn visit(&self, p: &str, f: &mut mantissa::nn::Visitor) {
        self.lstm.visit(&format!("{p}lstm."), f);
        self.head.visit(&format!("{p}head."), f);
    }
    fn visit_mut(&mut self, p: &str, f: &mut mantissa::nn::VisitorMut) -> Result<()> {
        self.lstm.visit_mut(&format!("{p}lstm."), f)?;
        self.head.visit_mut(&format!("{p}head."), f)
    }
}

/// One training configuration.
#[derive(Clone, Copy, Default)]
struct Setup {
    arch: Arch,
    low: Option<DType>,
    /// bf16 parameters with f32 masters.
    masters: bool,
    dropout: bool,
    /// SGLD instead of Adam.
    sgld: bool,
    /// The learning rate set before each step.
    schedule: bool,
    /// The step whose batch holds an inf (the scaler skips it).
    inf_at: Option<usize>,
}

const STEPS: usize = 7;

/// The bits of every listed tensor, read on the host.
fn bits(ts: &[Tensor]) -> Vec<Vec<u64>> {
    ts.iter()
        .map(|t| {
            t.to_vec_f64()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        })
        .collect()
}

/// The batch of step `k`: inputs [16, 12] and labels of 5 classes, on `d`.
fn batch(k: usize, d: Device, inf: bool) -> [Tensor; 2] {
    batch_of(Arch::Mlp, k, d, inf)
}

/// The batch of step `k` for `arch`: 16 inputs and labels of 5 classes, on `d`.
fn batch_of(arch: Arch, k: usize, d: Device, inf: bool) -> [Tensor; 2] {
    let shape: &[usize] = match arch {
        Arch::Mlp => &[16, 12],
        Arch::Conv => &[16, 3, 8, 8],
        Arch::Lstm => &[16, 6, 12],
    };
    let n = shape.iter().product();
    let mut g = Generator::new(100 + k as u64);
    let mut x: Vec<f32> = g.normal(n).iter().map(|v| *v as f32).collect();
    if inf {
        x[5] = f32::INFINITY;
    }
    let y: Vec<i64> = g.next_u32s(16).iter().map(|v| (v % 5) as i64).collect();
    let mut x = Tensor::from_vec(x, shape, d).unwrap();
    if arch == Arch::Conv {
        x = x.to_memory_format(MemoryFormat::ChannelsLast).unwrap();
    }
    [x, Tensor::from_vec(y, &[16], d).unwrap()]
}

/// The network of `s`, on `d`.
fn network(s: Setup, d: Device, g: &mut Generator) -> Box<dyn Module> {
    let mut net: Box<dyn Module> = match s.arch {
        Arch::Mlp => {
            let mut net = Sequential::new()
                .push(Linear::new(12, 24, true, g).unwrap())
                .push(Activation::Relu);
            if s.dropout {
                net = net.push(Dropout::new(0.25, 77));
            }
            Box::new(net.push(Linear::new(24, 5, true, g).unwrap()))
        }
        Arch::Conv => Box::new(
            Sequential::new()
                .push(Conv2d::new(3, 8, 3, Conv2dOptions::default(), true, g).unwrap())
                .push(BatchNorm2d::new(8).unwrap())
                .push(Activation::Relu)
                .push(MaxPool2d(MaxPool2dOptions::new(2)))
                .push(Flatten)
                .push(Linear::new(8 * 3 * 3, 5, true, g).unwrap()),
        ),
        Arch::Lstm => Box::new(LastStep {
            lstm: Lstm::new(12, 24, 2, true, g).unwrap(),
            head: Linear::new(24, 5, true, g).unwrap(),
        }),
    };
    net.to_device(d).unwrap();
    if s.arch == Arch::Conv {
        net.to_memory_format(MemoryFormat::ChannelsLast).unwrap();
    }
    net
}

/// What a run ends with: per step the loss, then parameters, optimizer states, the
/// scaler's state and the generators' states.
struct Outcome {
    losses: Vec<u64>,
    state: Vec<Vec<u64>>,
    captures: usize,
    replays: usize,
}

/// Trains `STEPS` steps of `s` on `d`, eagerly or through a `CapturedStep`.
fn train(d: Device, s: Setup, captured: bool) -> Outcome {
    manual_seed(9);
    let mut g = Generator::new(1);
    let mut net = network(s, d, &mut g);
    if s.masters {
        net.to_dtype(DType::BF16).unwrap();
    }
    let opt: Box<dyn Optimizer> = match s.sgld {
        true => Box::new(Sgld::new(net.parameters(), SgdConfig::new(0.05), 1e-4, 5).unwrap()),
        false => Box::new(Adam::new(net.parameters(), AdamConfig::adamw(1e-2)).unwrap()),
    };
    let opt = Rc::new(RefCell::new(opt));
    if s.masters {
        opt.borrow_mut()
            .use_master_weights(Rounding::Stochastic { seed: 3 })
            .unwrap();
    }
    let enabled = s.low == Some(DType::F16);
    let scaler = Rc::new(RefCell::new(
        GradScaler::new(GradScalerConfig {
            enabled,
            init_scale: 1024.0,
            ..Default::default()
        })
        .unwrap(),
    ));
    let net = Rc::new(net);
    let (n2, o2, s2) = (net.clone(), opt.clone(), scaler.clone());
    let low = s.low;
    let arch = s.arch;
    let mut step_fn = move |b: &[Tensor]| -> Result<Vec<Tensor>> {
        let mut opt = o2.borrow_mut();
        let (loss, hits) = match arch {
            Arch::Lstm => clipped_step(&**n2, &mut **opt, &mut s2.borrow_mut(), low, b)?,
            _ => classify_step(&**n2, &mut **opt, &mut s2.borrow_mut(), low, &b[0], &b[1])?,
        };
        // A draw from the default generator inside the step too.
        let noise = Tensor::randn(&[4], DType::F32, b[0].device())?;
        Ok(vec![loss, hits, noise])
    };
    let mut stepper = CapturedStep::new(d, &mut step_fn)
        .unwrap()
        .with_warmup(2)
        .watch(&net.parameters());
    let mut losses = Vec::new();
    for k in 0..STEPS {
        if s.schedule {
            opt.borrow_mut().set_lr(0.02 * 0.7f64.powi(k as i32));
        }
        let b = batch_of(s.arch, k, d, s.inf_at == Some(k));
        let out = match captured {
            true => stepper.run(&b).unwrap(),
            false => stepper_eager(&mut stepper, &b),
        };
        losses.extend(out.iter().flat_map(|t| bits(&[t.clone()])).flatten());
    }
    let (captures, replays) = (stepper.captures(), stepper.replays());
    if captured && s.arch == Arch::Conv {
        // The static input keeps the batch's channels-last order: the eager step's paths.
        assert!(stepper.graph().inputs()[0].is_channels_last());
    }
    drop(stepper);
    let mut state = bits(&net.parameters());
    let opt = opt.borrow();
    for (_, t) in opt.state_tensors().unwrap() {
        state.extend(bits(&[t]));
    }
    for (_, t) in scaler.borrow().state_dict().unwrap() {
        state.extend(bits(&[t]));
    }
    for (_, t) in net.named_tensors(mantissa::nn::TensorKind::Generator) {
        state.extend(bits(&[t]));
    }
    let default = Tensor::randn(&[3], DType::F32, d).unwrap();
    state.extend(bits(&[default]));
    Outcome {
        losses,
        state,
        captures,
        replays,
    }
}

/// The LSTM example's step: loss under autocast, scaled backward, unscale, clip to norm 1,
/// optimizer step through the scaler, scale update. Returns the loss and the clipped norm.
fn clipped_step(
    net: &dyn Module,
    opt: &mut dyn Optimizer,
    scaler: &mut GradScaler,
    low: Option<DType>,
    b: &[Tensor],
) -> Result<(Tensor, Tensor)> {
    let loss = mantissa::train::autocast_maybe(low, || {
        net.forward(&b[0])?
            .cross_entropy(&b[1], CrossEntropyOptions::default())
    })?;
    opt.zero_grad();
    scaler.scale(&loss)?.backward()?;
    scaler.unscale_(opt)?;
    let norm = mantissa::optim::clip_grad_norm(&net.parameters(), 1.0)?;
    scaler.step(opt)?;
    scaler.update()?;
    Ok((loss, norm))
}

/// The eager run calls the step closure directly, through the same wrapper.
fn stepper_eager<F: FnMut(&[Tensor]) -> Result<Vec<Tensor>>>(
    step: &mut CapturedStep<F>,
    b: &[Tensor],
) -> Vec<Tensor> {
    step.run_eagerly(b).unwrap()
}

fn same_as_eager(what: &str, s: Setup) {
    let _serial = serial();
    let Some(d) = gpu() else { return };
    // Bit for bit only through cuDNN's deterministic algorithms.
    let _deterministic = CudnnDeterministic::on();
    let eager = train(d, s, false);
    let graphed = train(d, s, true);
    assert_eq!(eager.captures, 0, "{what}: the eager run captured");
    assert_eq!(graphed.captures, 1, "{what}: one capture");
    assert_eq!(
        graphed.replays,
        STEPS - 2,
        "{what}: replays after two warm-up steps"
    );
    assert!(
        eager.losses == graphed.losses,
        "{what}: the losses differ between the eager and the captured run"
    );
    assert_eq!(
        eager.state.len(),
        graphed.state.len(),
        "{what}: state entries"
    );
    for (i, (a, b)) in eager.state.iter().zip(&graphed.state).enumerate() {
        assert!(a == b, "{what}: state entry {i} differs");
    }
}

#[test]
fn fp32_steps_replay_bit_identical() {
    same_as_eager("fp32", Setup::default());
}

#[test]
fn fp16_with_the_scaler_and_a_skipped_step_replay_bit_identical() {
    same_as_eager(
        "fp16 + scaler, inf at step 4",
        Setup {
            low: Some(DType::F16),
            inf_at: Some(4),
            ..Default::default()
        },
    );
}

#[test]
fn bf16_master_weights_replay_bit_identical() {
    same_as_eager(
        "bf16 + masters",
        Setup {
            low: Some(DType::BF16),
            masters: true,
            ..Default::default()
        },
    );
}

#[test]
fn dropout_draws_new_numbers_each_replay() {
    same_as_eager(
        "dropout",
        Setup {
            dropout: true,
            ..Default::default()
        },
    );
}

#[test]
fn a_learning_rate_schedule_needs_no_recapture() {
    same_as_eager(
        "schedule",
        Setup {
            schedule: true,
            dropout: true,
            ..Default::default()
        },
    );
}

#[test]
fn a_convolution_and_batch_norm_step_replays_bit_identical() {
    same_as_eager(
        "conv + batch norm fp16 channels-last",
        Setup {
            arch: Arch::Conv,
            low: Some(DType::F16),
            ..Default::default()
        },
    );
    // In f32 a weight gradient summed in another order shows in its last bits.
    same_as_eager(
        "conv + batch norm fp32 channels-last",
        Setup {
            arch: Arch::Conv,
            ..Default::default()
        },
    );
}

#[test]
fn an_lstm_step_with_clipping_replays_bit_identical() {
    same_as_eager(
        "lstm fp16, clipped, schedule",
        Setup {
            arch: Arch::Lstm,
            low: Some(DType::F16),
            schedule: true,
            ..Default::default()
        },
    );
    same_as_eager(
        "lstm fp32",
        Setup {
            arch: Arch::Lstm,
            ..Default::default()
        },
    );
}

#[test]
fn sgld_noise_replays_and_its_scale_recaptures() {
    same_as_eager(
        "sgld",
        Setup {
            sgld: true,
            ..Default::default()
        },
    );
    // A schedule changes SGLD's noise scale, frozen in the graph: captured again, still
    // the eager run's numbers.
    let _serial = serial();
    let Some(d) = gpu() else { return };
    let s = Setup {
        sgld: true,
        schedule: true,
        ..Default::default()
    };
    let _deterministic = CudnnDeterministic::on();
    let (eager, graphed) = (train(d, s, false), train(d, s, true));
    assert!(graphed.captures > 1, "SGLD under a schedule captured once");
    assert!(eager.losses == graphed.losses && eager.state == graphed.state);
}

/// A step whose capture must fail with `NotCapturable` naming `needle`.
fn refused(d: Device, needle: &str, step: impl FnMut(&[Tensor]) -> Result<Vec<Tensor>>) {
    let x = Tensor::ones(&[4], DType::F32, d).unwrap();
    let mut s = CapturedStep::new(d, step).unwrap().with_warmup(1);
    s.run(&[x.clone()]).unwrap(); // the eager warm-up runs it fine
    match s.run(&[x.clone()]) {
        Err(e @ Error::NotCapturable { .. }) => {
            assert!(
                e.to_string().contains(needle),
                "{e} does not name {needle:?}"
            )
        }
        other => panic!("expected a refusal naming {needle:?}, got {other:?}"),
    }
    // The device goes on working eagerly.
    assert_eq!(x.add(1.0).unwrap().sum_all().unwrap().item().unwrap(), 8.0);
}

#[test]
fn host_reads_uploads_and_value_generators_are_refused() {
    let _serial = serial();
    let Some(d) = gpu() else { return };
    refused(d, "read into host memory", |b| {
        let v = b[0].sum_all()?.item()?;
        Ok(vec![b[0].mul(v)?])
    });
    refused(d, "upload from host memory", |b| {
        let c = Tensor::from_vec(vec![1.0f32; 4], &[4], Device::Cpu)?.to_device(b[0].device())?;
        Ok(vec![b[0].add(&c)?])
    });
    let mut g = Generator::new(4);
    refused(d, "Generator value", move |b| {
        Ok(vec![b[0].dropout_with(0.5, true, &mut g)?])
    });
    refused(d, "queued no work on this device", |_| {
        Ok(vec![Tensor::ones(&[2], DType::F32, Device::Cpu)?])
    });
    // CapturedStep is for CUDA devices.
    let e = CapturedStep::new(Device::Cpu, |b: &[Tensor]| Ok(b.to_vec())).err();
    assert!(e.is_some_and(|e| e.to_string().contains("CUDA device")));
}

#[test]
fn replays_allocate_nothing_and_profile_as_one_record() {
    let _serial = serial();
    let Some(d) = gpu() else { return };
    let mut g = Generator::new(2);
    let net = Linear::new(12, 5, true, &mut g).unwrap();
    let mut net = net;
    net.to_device(d).unwrap();
    let mut opt = Sgd::new(net.parameters(), SgdConfig::new(0.1)).unwrap();
    let mut step = CapturedStep::new(d, move |b: &[Tensor]| {
        opt.zero_grad();
        let loss = net
            .forward(&b[0])?
            .cross_entropy(&b[1], CrossEntropyOptions::default())?;
        loss.backward()?;
        opt.step()?;
        Ok(vec![loss])
    })
    .unwrap()
    .with_warmup(1);
    for k in 0..3 {
        step.run(&batch(k, d, false)).unwrap();
    }
    let (kernels, calls) = step.graph_size();
    assert!(
        kernels > 0 && calls > 0,
        "graph of {kernels} kernels, {calls} calls"
    );
    let before = backend::memory::memory_stats(d).unwrap();
    let batches: Vec<_> = (0..10).map(|k| batch(k, d, false)).collect();
    let mid = backend::memory::memory_stats(d).unwrap().allocated;
    for b in &batches {
        step.run(b).unwrap();
    }
    let after = backend::memory::memory_stats(d).unwrap();
    assert_eq!(after.allocated, mid, "replays allocated");
    assert_eq!(after.reserved, before.reserved, "replays reserved more");
    let (_, p) = profiler::profile(|prof| {
        step.run(&batches[0]).unwrap();
        prof.step();
    })
    .unwrap();
    let replay: Vec<_> = p
        .kernels()
        .iter()
        .filter(|k| k.name.starts_with("cuda_graph.replay"))
        .collect();
    assert_eq!(replay.len(), 1, "one replay record");
    assert!(
        matches!(replay[0].work, profiler::DeviceWork::Graph { kernels: k, .. } if k == kernels)
    );
    let launches: u64 = p.steps().iter().map(|s| s.launches).sum();
    assert_eq!(
        launches,
        u64::from(kernels),
        "the step's launches are the graph's"
    );
}

#[test]
fn a_fault_found_in_a_replay_is_reported_at_the_next_read() {
    let _serial = serial();
    let Some(d) = gpu() else { return };
    let mut g = Generator::new(3);
    let mut net = Linear::new(12, 5, true, &mut g).unwrap();
    net.to_device(d).unwrap();
    let mut step = CapturedStep::new(d, move |b: &[Tensor]| {
        let loss = net
            .forward(&b[0])?
            .cross_entropy(&b[1], CrossEntropyOptions::default())?;
        Ok(vec![loss])
    })
    .unwrap()
    .with_warmup(1);
    for k in 0..2 {
        step.run(&batch(k, d, false)).unwrap();
    }
    assert_eq!(step.replays(), 1);
    // Class 7 of 5: the replayed cross-entropy kernel flags it on the device.
    let [x, _] = batch(2, d, false);
    let y = Tensor::from_vec(vec![7i64; 16], &[16], Device::Cpu)
        .unwrap()
        .to_device(d)
        .unwrap();
    let out = step.run(&[x, y]).unwrap();
    let e = out[0].item().unwrap_err().to_string();
    assert!(e.contains("CUDA graph's replay"), "{e}");
    // Reported once: a clean replay reads clean.
    let out = step.run(&batch(3, d, false)).unwrap();
    assert!(out[0].item().unwrap().is_finite());
}
