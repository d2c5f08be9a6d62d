//! Trains a ResNet (18, 34 or 50): on MNIST to a test accuracy, or on synthetic ImageNet-sized
//! batches for throughput (W3 of BENCHMARKS.md: ResNet-50, 224x224, batch 256, AMP, channels-last).
//!
//! ```text
//! cargo run --release --example resnet -- --data mnist --arch resnet18 --width 16 --quick
//! cargo run --release --example resnet -- --data synthetic --arch resnet50 --batch-size 256 \
//!     --device cuda --precision fp16 --channels-last --cudnn-benchmark
//! ```
//! On MNIST the stem is CIFAR's (a 3x3 convolution, no max pool), on synthetic data
//! ImageNet's (7x7 stride 2, then a 3x3 max pool). SGD with Nesterov momentum 0.9, weight
//! decay 5e-4 and a one-cycle schedule. `bench/resnet_peer.py` is the PyTorch peer.
//! Data-parallel when launched so (`torchrun --standalone --nproc-per-node N --no-python
//! target/release/examples/resnet ...`, srun, mpirun): each process on `cuda:LOCAL_RANK`
//! with `--batch-size` images, gradients averaged by `DistributedDataParallel`.

use clap::{Parser, ValueEnum};
use mantissa::amp::{GradScaler, GradScalerConfig};
use mantissa::data::mnist::{locate_or_fetch, Mnist};
use mantissa::data::{DataLoader, DataLoaderConfig};
use mantissa::graph::StepGraph;
use mantissa::nn::*;
use mantissa::optim::*;
use mantissa::train::{
    classifier_fits, classify_micro_step, classify_step, evaluate_classifier, plot_metrics,
    Accumulation, EpochProgress, LossUnit, MetricsLog,
};
use mantissa::*;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

mod common;
use common::dist::Dist;
use common::files::FileFlags;
use common::{BatchSize, RunFlags};
#[path = "common/resnet_model.rs"]
mod resnet_model;
use resnet_model::ResNetSpec;

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum Arch {
    Resnet18,
    Resnet34,
    Resnet50,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum Data {
    /// MNIST, trained for --epochs and tested.
    Mnist,
    /// One fixed random batch of 3 x --image-size^2 images on the device, --steps times,
    /// timed after --warmup steps.
    Synthetic,
}

#[derive(Parser, Debug)]
#[command(about = "Train a ResNet with mantissa")]
struct Args {
    #[arg(long, value_enum, default_value = "resnet18")]
    arch: Arch,
    #[arg(long, value_enum, default_value = "mnist")]
    data: Data,
    /// Channels of the first stage (64 in the paper); later stages double it.
    #[arg(long, default_value_t = 64)]
    width: usize,
    /// A number, or `auto`: the largest batch whose training step fits in the GPU's memory.
    #[arg(long, default_value = "128")]
    batch_size: BatchSize,
    /// The batch size in use (--batch-size, resolved).
    #[arg(skip)]
    batch: usize,
    /// Peak learning rate of the one-cycle schedule.
    #[arg(long, default_value_t = 0.1)]
    lr: f64,
    #[arg(long, default_value_t = 1)]
    epochs: usize,
    /// Synthetic data: steps timed, after the warm-up.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    #[arg(long, default_value_t = 224)]
    image_size: usize,
    #[arg(long, default_value_t = 1000)]
    classes: usize,
    /// MNIST: 10k training and 2k test images.
    #[arg(long)]
    quick: bool,
    /// Runs each residual block under gradient checkpointing: its activations are
    /// recomputed in backward instead of kept (less memory, a second forward per block).
    #[arg(long)]
    grad_checkpoint: bool,
    #[command(flatten)]
    run: RunFlags,
    #[command(flatten)]
    files: FileFlags,
    /// The output folder in use (--out, or runs/resnet).
    #[arg(skip)]
    out: PathBuf,
}

/// The network `args` ask for, on `in_channels`-channel images and `classes` classes.
fn resnet(
    args: &Args,
    in_channels: usize,
    classes: usize,
    g: &mut Generator,
) -> Result<Sequential> {
    let (counts, bottleneck) = match args.arch {
        Arch::Resnet18 => ([2, 2, 2, 2], false),
        Arch::Resnet34 => ([3, 4, 6, 3], false),
        Arch::Resnet50 => ([3, 4, 6, 3], true),
    };
    let spec = ResNetSpec {
        counts,
        bottleneck,
        width: args.width,
        in_channels,
        classes,
        imagenet_stem: args.data == Data::Synthetic,
        checkpoint: args.grad_checkpoint,
    };
    resnet_model::resnet(&spec, g)
}

fn optimizer(net: &Sequential, lr: f64) -> Result<Sgd> {
    let cfg = SgdConfig {
        momentum: 0.9,
        nesterov: true,
        weight_decay: 5e-4,
        ..SgdConfig::new(lr)
    };
    Sgd::new(net.parameters(), cfg)
}

fn run(mut args: Args) -> Result<()> {
    let (device, low, format) = args.run.open()?;
    let dist = Dist::join(device, "resnet")?;
    dist.check_flags(args.run.cuda_graph, "resnet")?;
    if args.width == 0 {
        return Err(Error::Invalid {
            op: "resnet",
            msg: "--width must be at least 1".into(),
        });
    }
    let timing = (args.data == Data::Synthetic).then_some("--data synthetic");
    args.out = args.files.prepare("runs/resnet", timing)?;
    let mut scaler = GradScaler::new(GradScalerConfig {
        enabled: low == Some(DType::F16),
        ..Default::default()
    })?;
    let mut gen = Generator::new(args.run.seed);
    let (in_channels, classes) = match args.data {
        Data::Mnist => (1, 10),
        Data::Synthetic => (3, args.classes),
    };
    let mut net = resnet(&args, in_channels, classes, &mut gen)?;
    net.to_device(device)?;
    net.to_memory_format(format)?;
    let mut opt = optimizer(&net, args.lr)?;
    // Trial batches of random images (and, on MNIST, the loader's two prefetched batches).
    let (side, max) = match args.data {
        Data::Mnist => (28, 60_000),
        Data::Synthetic => (args.image_size, 1 << 16),
    };
    args.batch = args.batch_size.resolve(device, max, |b| {
        let shape = [b, in_channels, side, side];
        let x = || Tensor::randn(&shape, DType::F32, device)?.to_memory_format(format);
        let _prefetched = match args.data {
            Data::Mnist => Some((x()?, x()?)),
            Data::Synthetic => None,
        };
        let y = Tensor::zeros(&[b], DType::I64, device)?;
        classifier_fits(&net, &mut opt, low, &x()?, &y)
    })?;
    if dist.is_main() {
        println!(
        "{:?} width {} ({} parameters) on {:?}, batch {}, device {device}, precision {}, {format:?} memory format, {} threads",
        args.arch,
        args.width,
        net.num_parameters(),
        args.data,
        args.batch,
        args.run.precision,
        rayon::current_num_threads()
    );
    }
    // Every rank loads the checkpoint; the wrapper then broadcasts rank 0's parameters.
    let resumed = args
        .files
        .resume(&args.out, &mut net, &mut opt, &mut scaler, LossUnit::Nats)?;
    let ddp = dist.wrap(&net.parameters())?;
    let setting = (device, low, format);
    let ranks = (&dist, ddp.as_ref());
    match args.data {
        Data::Mnist => train_mnist(
            &args,
            &mut net,
            &mut opt,
            &mut scaler,
            setting,
            ranks,
            resumed,
        ),
        Data::Synthetic => throughput(
            &args,
            &mut net,
            &mut opt,
            &mut scaler,
            setting,
            &mut gen,
            &dist,
        ),
    }
}

type Setting = (Device, Option<DType>, MemoryFormat);

fn train_mnist(
    args: &Args,
    net: &mut Sequential,
    opt: &mut Sgd,
    scaler: &mut GradScaler,
    (device, low, format): Setting,
    (dist, ddp): (
        &Dist,
        Option<&mantissa::distributed::DistributedDataParallel>,
    ),
    (start_epoch, mut log): (usize, MetricsLog),
) -> Result<()> {
    let dir = locate_or_fetch()?;
    let (mut train, mut test) = (Mnist::load(&dir, true)?, Mnist::load(&dir, false)?);
    if args.quick {
        (train, test) = (train.take(10_000), test.take(2_000));
    }
    let cfg = DataLoaderConfig {
        sampler: dist.sampler(),
        shuffle: true,
        seed: args.run.seed,
        num_workers: args.run.workers,
        pin_memory: Some(device),
        ..DataLoaderConfig::new(args.batch)
    };
    let mut train_dl = DataLoader::new(Arc::new(train), cfg)?;
    let test_cfg = DataLoaderConfig {
        num_workers: args.run.workers,
        pin_memory: Some(device),
        ..DataLoaderConfig::new(500)
    };
    let mut test_dl = DataLoader::new(Arc::new(test), test_cfg)?;
    let steps = train_dl.len();
    // With --cuda-graph, every full batch's step replays the captured one.
    let mut graph = common::step_graph(&args.run, device, &net.parameters(), "resnet")?;
    let cycle = OneCycle::new(args.lr, args.epochs * steps);
    let mut profile = common::StepProfile::new(&args.run, &args.out)?;
    let mut acc = Accumulation::new(args.run.accumulate)?;
    for epoch in start_epoch..args.epochs {
        net.train();
        let label = format!("epoch {}/{} {}", epoch + 1, args.epochs, args.run.precision);
        let mut bar = EpochProgress::new(&label, steps).quiet(!dist.is_main());
        bar.show_memory(device);
        for (k, b) in train_dl.epoch(epoch).to_device(device).enumerate() {
            let b = b?;
            opt.set_lr(cycle.lr(epoch * steps + k));
            let (x, y) = (b.x.to_memory_format(format)?, b.y);
            let last = k + 1 == steps;
            let (loss, hits) = match graph.as_mut().filter(|_| y.numel() == args.batch) {
                Some(g) => graphed(g, net, opt, scaler, low, &x, &y)?,
                None => {
                    // Micro-batches before a group's last skip the all-reduce.
                    let sync = acc.steps_next(last);
                    let mut step =
                        || classify_micro_step(net, opt, scaler, low, (&x, &y), &mut acc, last);
                    match (ddp, sync) {
                        (Some(ddp), false) => ddp.no_sync(step)?,
                        _ => step()?,
                    }
                }
            };
            bar.step_tensors(y.numel(), &loss, &hits)?;
            profile.step()?;
        }
        bar.finish()?;
        dist.sync_buffers(ddp, net)?;
        net.eval();
        let (test_loss, test_acc) = evaluate_classifier(net, &mut test_dl, device, low, format)?;
        let mut m = bar.metrics(epoch + 1, (test_loss, test_acc), opt.lr());
        dist.reduce(&mut m)?;
        if !dist.is_main() {
            continue;
        }
        println!(
            "epoch {}: train loss {:.4} acc {:.2}% | test loss {:.4} acc {:.2}% | {:.1} s, {:.0} images/s",
            epoch + 1,
            m.train_loss,
            100.0 * m.train_acc,
            test_loss,
            100.0 * test_acc,
            m.seconds,
            m.samples_per_s
        );
        log.push(m);
        log.write_csv(&args.out.join("metrics.csv"))?;
        plot_metrics(&log, &args.out.join("curves.png"))?;
        args.files.save(net, opt, scaler, epoch + 1)?;
    }
    match (dist.is_main(), start_epoch >= args.epochs) {
        (false, _) => {}
        (true, true) => println!(
            "no epoch was run (--epochs {}, starting after epoch {start_epoch}): no metrics or \
             curves written",
            args.epochs
        ),
        (true, false) => println!("metrics and curves in {}", args.out.display()),
    }
    profile.finish()
}

/// Images per second of training steps on one fixed random batch that lives on the device
/// (no loader in the measurement, as in PyTorch's synthetic-data benchmarks).
fn throughput(
    args: &Args,
    net: &mut Sequential,
    opt: &mut Sgd,
    scaler: &mut GradScaler,
    (device, low, format): Setting,
    gen: &mut Generator,
    dist: &Dist,
) -> Result<()> {
    let (n, s) = (args.batch, args.image_size);
    let x = Tensor::randn_with(&[n, 3, s, s], 0.0, 1.0, DType::F32, Device::Cpu, gen)?
        .to_device(device)?
        .to_memory_format(format)?;
    let labels: Vec<i64> = gen
        .uniform(n)
        .iter()
        .map(|u| ((u * args.classes as f64) as i64).min(args.classes as i64 - 1))
        .collect();
    let y = Tensor::from_vec(labels, &[n], Device::Cpu)?.to_device(device)?;
    net.train();
    // What one forward keeps for backward (activations; weights and their casts are counted
    // too, but they are there either way): with --grad-checkpoint, the blocks' inputs only.
    let before = live_storage_bytes();
    let kept = mantissa::train::autocast_maybe(low, || {
        let _loss = net.forward(&x)?.cross_entropy(&y, Default::default())?;
        Ok(live_storage_bytes().saturating_sub(before))
    })?;
    println!(
        "one forward keeps {:.1} MiB for backward ({:.1} MiB per image){}",
        kept as f64 / 1048576.0,
        kept as f64 / 1048576.0 / n as f64,
        if args.grad_checkpoint {
            ", blocks checkpointed"
        } else {
            ""
        }
    );
    let mut start = Instant::now();
    let mut last = 0.0;
    // Profiled steps run after the timed ones: profiling adds an event pair per launch.
    let mut profile = common::StepProfile::new(&args.run, &args.out)?;
    // With --cuda-graph the steps replay the captured one (captured in the warm-up when
    // --warmup is above 3).
    let mut graph = common::step_graph(&args.run, device, &net.parameters(), "resnet")?;
    let mut step_on = |graph: &mut Option<StepGraph>| match graph.as_mut() {
        Some(g) => graphed(g, net, opt, scaler, low, &x, &y),
        None => classify_step(net, opt, scaler, low, &x, &y),
    };
    for step in 0..args.warmup + args.steps {
        let (loss, _) = step_on(&mut graph)?;
        // Reading the loss waits for the device: the clock starts after the warm-up's work.
        if step + 1 == args.warmup {
            loss.item()?;
            start = Instant::now();
        }
        if step + 1 == args.warmup + args.steps {
            last = loss.item()?;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let rate = (n * args.steps) as f64 / secs;
    // Data-parallel: every rank's images/s, summed.
    let total = dist.combine(&[rate], mantissa::distributed::ReduceOp::Sum)?[0];
    let ranks = dist.group.world_size();
    if dist.is_main() {
        println!(
            "{:?} synthetic {s}x{s}, batch {n}, {}, {format:?}: {:.1} images/s ({} steps in {:.2} s, last loss {last:.3}){}",
            args.arch,
            args.run.precision,
            total,
            args.steps,
            secs,
            match (ranks, dist.launched) {
                (1, false) => String::new(),
                (1, true) => ", data-parallel wrapper, world of one".to_string(),
                (r, _) => format!(", {r} processes, {rate:.1} images/s on rank 0"),
            }
        );
    }
    common::print_peak_memory("mantissa timed steps", device)?;
    if args.run.profile > 0 {
        // The profile's own warm-up steps, then the profiled ones.
        for _ in 0..args.run.profile_warmup + args.run.profile {
            step_on(&mut graph)?;
            profile.step()?;
        }
    }
    profile.finish()
}

/// [`classify_step`] through `graph`: eager during its warm-up, then replayed.
fn graphed(
    graph: &mut StepGraph,
    net: &Sequential,
    opt: &mut Sgd,
    scaler: &mut GradScaler,
    low: Option<DType>,
    x: &Tensor,
    y: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let out = graph.run(&[x.clone(), y.clone()], &mut |b| {
        let (loss, hits) = classify_step(net, opt, scaler, low, &b[0], &b[1])?;
        Ok(vec![loss, hits])
    })?;
    Ok((out[0].clone(), out[1].clone()))
}

fn main() {
    common::main_with(run);
}
