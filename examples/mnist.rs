//! Trains an MLP or the pytorch/examples CNN on MNIST.
//!
//! `cargo run --release --example mnist -- --model cnn --epochs 3`
//! Writes `metrics.csv` and `curves.png` to `--out`, and a checkpoint each epoch with
//! `--save PATH` (resume with `--resume PATH`). Data-parallel on several GPUs when
//! launched so: `torchrun --standalone --nproc-per-node 2 --no-python
//! target/release/examples/mnist ...` (or under srun / mpirun); `--batch-size` is then each
//! process's.

use clap::{Parser, ValueEnum};
use mantissa::amp::{GradScaler, GradScalerConfig};
use mantissa::data::mnist::{locate_or_fetch, Mnist};
use mantissa::data::{DataLoader, DataLoaderConfig, Dataset};
use mantissa::nn::*;
use mantissa::optim::*;
use mantissa::train::{
    classifier_fits, classify_micro_step, classify_step, evaluate_classifier, plot_metrics,
    Accumulation, EpochProgress, LossUnit,
};
use mantissa::*;
use std::sync::Arc;

mod common;
use common::files::FileFlags;
use common::{BatchSize, RunFlags};

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum Model {
    Mlp,
    Cnn,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum Opt {
    Sgd,
    Adam,
    Adamw,
    Adadelta,
    Sgld,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum Schedule {
    /// Per-epoch StepLR with factor --gamma.
    Step,
    /// Per-step one-cycle: cosine up to --lr over 30% of the steps, then down.
    OneCycle,
}

#[derive(Parser, Debug)]
#[command(about = "Train on MNIST with mantissa")]
struct Args {
    #[arg(long, value_enum, default_value = "cnn")]
    model: Model,
    #[arg(long, default_value_t = 3)]
    epochs: usize,
    /// A number, or `auto`: the largest batch whose training step fits in the GPU's memory.
    #[arg(long, default_value = "64")]
    batch_size: BatchSize,
    /// Learning rate, the peak one with the one-cycle schedule (default: 1.0 for adadelta,
    /// 0.05 for sgd/sgld, 3e-3 for adam/adamw with one-cycle and 1e-3 without).
    #[arg(long)]
    lr: Option<f64>,
    /// Optimizer (default: adam for the CNN, SGD with momentum 0.9 for the MLP).
    #[arg(long, value_enum)]
    optimizer: Option<Opt>,
    /// Learning-rate schedule (default: one-cycle for the CNN, step for the MLP).
    #[arg(long, value_enum)]
    schedule: Option<Schedule>,
    /// StepLR factor applied after every epoch with `--schedule step` (default: 0.7 for the
    /// CNN, as pytorch/examples; 0.3 for the MLP).
    #[arg(long)]
    gamma: Option<f64>,
    /// With fp16/bf16: the parameters themselves become f16/bf16 working copies of f32
    /// masters the optimizer keeps (moments in f32; bf16 copies stochastically rounded).
    #[arg(long)]
    master_weights: bool,
    #[command(flatten)]
    run: RunFlags,
    /// A fast run for trying things: 10k training and 2k test images, one epoch.
    #[arg(long)]
    quick: bool,
    #[command(flatten)]
    files: FileFlags,
}

fn build(model: Model, gen: &mut Generator, seed: u64) -> Result<Sequential> {
    Ok(match model {
        Model::Mlp => Sequential::new()
            .push(Flatten)
            .push(Linear::new(784, 512, true, gen)?)
            .push(Activation::Relu)
            .push(Linear::new(512, 512, true, gen)?)
            .push(Activation::Relu)
            .push(Linear::new(512, 10, true, gen)?),
        Model::Cnn => Sequential::new()
            .push(Conv2d::new(1, 32, 3, Conv2dOptions::default(), true, gen)?)
            .push(Activation::Relu)
            .push(Conv2d::new(32, 64, 3, Conv2dOptions::default(), true, gen)?)
            .push(Activation::Relu)
            .push(MaxPool2d(MaxPool2dOptions::new(2)))
            .push(Dropout::new(0.25, seed ^ 1))
            .push(Flatten)
            .push(Linear::new(9216, 128, true, gen)?)
            .push(Activation::Relu)
            .push(Dropout::new(0.5, seed ^ 2))
            .push(Linear::new(128, 10, true, gen)?),
    })
}

fn optimizer(kind: Opt, params: Vec<Tensor>, lr: f64, seed: u64) -> Result<Box<dyn Optimizer>> {
    Ok(match kind {
        Opt::Sgd => Box::new(Sgd::new(
            params,
            SgdConfig {
                momentum: 0.9,
                ..SgdConfig::new(lr)
            },
        )?),
        Opt::Sgld => Box::new(Sgld::new(
            params,
            SgdConfig {
                momentum: 0.9,
                ..SgdConfig::new(lr)
            },
            1e-6,
            seed,
        )?),
        Opt::Adam => Box::new(Adam::new(params, AdamConfig::adam(lr))?),
        Opt::Adamw => Box::new(Adam::new(params, AdamConfig::adamw(lr))?),
        Opt::Adadelta => Box::new(Adadelta::new(params, lr)?),
    })
}

fn run(args: Args) -> Result<()> {
    let (device, low, format) = args.run.open()?;
    let dist = common::dist::Dist::join(device, "mnist")?;
    dist.check_flags(args.run.cuda_graph, "mnist")?;
    let name = match low {
        None => "fp32",
        Some(DType::F16) => "fp16",
        Some(_) => "bf16",
    };
    let precision = match (args.master_weights, low) {
        (false, _) => name.to_string(),
        (true, Some(_)) => format!("{name} master-weights"),
        (true, None) => {
            return Err(Error::Invalid {
                op: "mnist",
                msg: "--master-weights needs --precision fp16 or bf16".into(),
            })
        }
    };
    if args.model == Model::Mlp {
        args.run.refuse_convolution_flags("mnist --model mlp")?;
    }
    let model_name = format!("{:?}", args.model).to_lowercase();
    let out = args
        .files
        .prepare(&format!("runs/mnist-{model_name}"), None)?;
    // bf16 keeps f32's exponent range: no loss scaling (as PyTorch practice and llm.c).
    let mut scaler = GradScaler::new(GradScalerConfig {
        enabled: low == Some(DType::F16),
        ..Default::default()
    })?;
    let dir = locate_or_fetch()?;
    let (mut train, mut test) = (Mnist::load(&dir, true)?, Mnist::load(&dir, false)?);
    let mut epochs = args.epochs;
    if args.quick {
        train = train.take(10_000);
        test = test.take(2_000);
        epochs = 1;
    }
    let mut gen = Generator::new(args.run.seed);
    let mut net = build(args.model, &mut gen, args.run.seed)?;
    net.to_device(device)?;
    // Channels-last weights too (before the optimizer takes the parameters).
    net.to_memory_format(format)?;
    let cnn = args.model == Model::Cnn;
    let kind = args
        .optimizer
        .unwrap_or(if cnn { Opt::Adam } else { Opt::Sgd });
    let schedule = args.schedule.unwrap_or(if cnn {
        Schedule::OneCycle
    } else {
        Schedule::Step
    });
    let one_cycle = schedule == Schedule::OneCycle;
    let lr = args.lr.unwrap_or(match kind {
        Opt::Adadelta => 1.0,
        Opt::Sgd | Opt::Sgld => 0.05,
        Opt::Adam | Opt::Adamw if one_cycle => 3e-3,
        Opt::Adam | Opt::Adamw => 1e-3,
    });
    if let (true, Some(d)) = (args.master_weights, low) {
        net.to_dtype(d)?;
    }
    let mut opt = optimizer(kind, net.parameters(), lr, args.run.seed)?;
    match low {
        Some(DType::BF16) if args.master_weights => {
            opt.use_master_weights(Rounding::Stochastic {
                seed: args.run.seed,
            })?
        }
        Some(_) if args.master_weights => opt.use_master_weights(Rounding::Nearest)?,
        _ => {}
    }
    // The trial batches are random images and labels 0; the device also holds the loader's
    // two prefetched batches, counted in each trial.
    let batch_size = args.batch_size.resolve(device, train.len(), |b| {
        let x = || Tensor::randn(&[b, 1, 28, 28], DType::F32, device)?.to_memory_format(format);
        let _prefetched = (x()?, x()?);
        let y = Tensor::zeros(&[b], DType::I64, device)?;
        classifier_fits(&net, opt.as_mut(), low, &x()?, &y)
    })?;
    let gamma = args.gamma.unwrap_or(if cnn { 0.7 } else { 0.3 });
    let epoch_schedule = StepLr {
        base: lr,
        step_size: 1,
        gamma,
    };
    epoch_schedule.check()?;
    let (start_epoch, mut log) =
        args.files
            .resume(&out, &mut net, opt.as_mut(), &mut scaler, LossUnit::Nats)?;
    // Every rank has loaded the same checkpoint; the wrapper broadcasts rank 0's
    // parameters anyway (as PyTorch's DDP), so the ranks start equal whatever they loaded.
    let ddp = dist.wrap(&net.parameters())?;
    if dist.is_main() {
        println!(
        "model {:?} ({} parameters), optimizer {kind:?} lr {lr} schedule {schedule:?}, batch {}, {} workers, device {device}, precision {precision}, {format:?} memory format, {} threads",
        args.model,
        net.num_parameters(),
        batch_size,
        args.run.workers,
        rayon::current_num_threads()
    );
    }
    let cfg = DataLoaderConfig {
        sampler: dist.sampler(),
        shuffle: true,
        seed: args.run.seed,
        num_workers: args.run.workers,
        pin_memory: Some(device),
        ..DataLoaderConfig::new(batch_size)
    };
    let mut train_dl = DataLoader::new(Arc::new(train), cfg)?;
    let mut test_dl = DataLoader::new(
        Arc::new(test),
        DataLoaderConfig {
            num_workers: args.run.workers,
            pin_memory: Some(device),
            ..DataLoaderConfig::new(1000)
        },
    )?;
    // With --cuda-graph the step is captured after a few eager ones and replayed for every
    // full batch (a short last batch runs eagerly: its shape would capture again).
    let mut graph = common::step_graph(&args.run, device, &net.parameters(), "mnist")?;
    let cycle = OneCycle::new(lr, epochs * train_dl.len());
    let mut profile = common::StepProfile::new(&args.run, &out)?;
    let mut acc = Accumulation::new(args.run.accumulate)?;
    let steps = train_dl.len();
    for epoch in start_epoch..epochs {
        opt.set_lr(epoch_schedule.lr(epoch));
        net.train();
        let mut bar = EpochProgress::new(
            &format!("epoch {}/{epochs} {precision}", epoch + 1),
            train_dl.len(),
        )
        .quiet(!dist.is_main());
        bar.show_memory(device);
        let first_step = epoch * train_dl.len();
        for (k, b) in train_dl.epoch(epoch).to_device(device).enumerate() {
            let b = b?;
            if one_cycle {
                opt.set_lr(cycle.lr(first_step + k));
            }
            let (x, y) = (b.x.to_memory_format(format)?, b.y);
            let last = k + 1 == steps;
            let (loss, hits) = match graph.as_mut().filter(|_| y.numel() == batch_size) {
                Some(g) => {
                    let out = g.run(&[x, y.clone()], &mut |b| {
                        let (loss, hits) =
                            classify_step(&net, opt.as_mut(), &mut scaler, low, &b[0], &b[1])?;
                        Ok(vec![loss, hits])
                    })?;
                    (out[0].clone(), out[1].clone())
                }
                None => {
                    // The micro-batches before a group's last add up their gradients
                    // locally; the last one's backward averages the sum over the ranks.
                    let sync = acc.steps_next(last);
                    let mut step = || {
                        classify_micro_step(
                            &net,
                            opt.as_mut(),
                            &mut scaler,
                            low,
                            (&x, &y),
                            &mut acc,
                            last,
                        )
                    };
                    match (&ddp, sync) {
                        (Some(ddp), false) => ddp.no_sync(step)?,
                        _ => step()?,
                    }
                }
            };
            if scaler.is_enabled() && k % 50 == 0 {
                bar.set_extra(format!("scale {}", scaler.current_scale()?.unwrap_or(0.0)));
            }
            // Summed where they live and read every few steps: no host sync per step.
            bar.step_tensors(y.numel(), &loss, &hits)?;
            profile.step()?;
        }
        bar.finish()?;
        dist.sync_buffers(ddp.as_ref(), &net)?;
        net.eval();
        let (test_loss, test_acc) = evaluate_classifier(&net, &mut test_dl, device, low, format)?;
        let mut m = bar.metrics(epoch + 1, (test_loss, test_acc), opt.lr());
        dist.reduce(&mut m)?;
        if !dist.is_main() {
            continue;
        }
        println!(
            "epoch {}: train loss {:.4} acc {:.2}% | test loss {:.4} acc {:.2}% | {:.1} s, {:.0} samples/s",
            m.epoch,
            m.train_loss,
            100.0 * m.train_acc,
            m.test_loss,
            100.0 * m.test_acc,
            m.seconds,
            m.samples_per_s
        );
        log.push(m);
        log.write_csv(&out.join("metrics.csv"))?;
        plot_metrics(&log, &out.join("curves.png"))?;
        args.files.save(&net, opt.as_ref(), &scaler, epoch + 1)?;
    }
    common::print_peak_memory("mantissa training", device)?;
    profile.finish()?;
    drop(ddp);
    if !dist.is_main() {
        return Ok(());
    }
    if start_epoch >= epochs {
        println!(
            "no epoch was run (--epochs {epochs}, starting after epoch {start_epoch}): no \
             metrics or curves written"
        );
    } else {
        println!("metrics and curves in {}", out.display());
    }
    Ok(())
}

fn main() {
    common::main_with(run);
}
