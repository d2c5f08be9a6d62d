//! Trains a character-level LSTM language model (embedding, stacked `nn::Lstm`, linear to the
//! vocabulary) on a text, reports held-out bits per character and samples from it; or, with
//! `--synthetic`, measures training tokens/s on random tokens (W4 of BENCHMARKS.md: 2 layers,
//! hidden 512, sequence 100, batch 64, AMP).
//!
//! ```text
//! cargo run --release --example lstm -- --hidden 128 --epochs 20
//! cargo run --release --example lstm -- --synthetic --device cuda --precision bf16
//! ```
//! Without `--text` it trains on this crate's README and BENCHMARKS (bundled at build time).
//! The text's windows of `--seq-len` characters (every `--seq-len / 2`, each with the
//! characters that follow it as targets) come from a `DataLoader` with workers and pinned
//! memory like the other examples' images; each epoch ends with the held-out last tenth of
//! the text, and `runs/lstm` (or `--out`) gets `metrics.csv` and `curves.png` (loss in bits
//! per character, and per-character accuracy). Adam with a one-cycle schedule, gradients
//! clipped to norm 1 (unscaled first under fp16). `--save`/`--resume` as in the other
//! examples; `--quick` trains one epoch on the text's first 20,000 characters.

use clap::Parser;
use mantissa::amp::{GradScaler, GradScalerConfig};
use mantissa::data::{DataLoader, DataLoaderConfig, Dataset, SampleMut};
use mantissa::graph::StepGraph;
use mantissa::nn::*;
use mantissa::optim::*;
use mantissa::train::{
    autocast_maybe, plot_metrics, step_fits, EpochProgress, LossUnit, MetricsLog,
};
use mantissa::*;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

mod common;
use common::files::FileFlags;
use common::{BatchSize, RunFlags};

#[derive(Parser, Debug)]
#[command(about = "Train a character-level LSTM with mantissa")]
struct Args {
    /// A UTF-8 text to learn (default: the bundled README and BENCHMARKS).
    #[arg(long)]
    text: Option<PathBuf>,
    /// Random tokens over a 256-symbol vocabulary, timed: tokens/s.
    #[arg(long)]
    synthetic: bool,
    #[arg(long, default_value_t = 2)]
    layers: usize,
    #[arg(long, default_value_t = 512)]
    hidden: usize,
    #[arg(long, default_value_t = 64)]
    embedding: usize,
    #[arg(long, default_value_t = 100)]
    seq_len: usize,
    /// A number, or `auto`: the largest batch whose training step fits in the GPU's memory.
    #[arg(long, default_value = "64")]
    batch_size: BatchSize,
    /// The batch size in use (--batch-size, resolved).
    #[arg(skip)]
    batch: usize,
    /// Passes over the text's windows.
    #[arg(long, default_value_t = 20)]
    epochs: usize,
    /// With --synthetic: steps timed, after --warmup steps.
    #[arg(long, default_value_t = 200)]
    steps: usize,
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Peak learning rate of the one-cycle schedule.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// A fast run for trying things: one epoch on the text's first 20,000 characters.
    #[arg(long)]
    quick: bool,
    #[command(flatten)]
    run: RunFlags,
    #[command(flatten)]
    files: FileFlags,
    /// The output folder in use (--out, or runs/lstm).
    #[arg(skip)]
    out: PathBuf,
}

/// The characters of the text a --quick run learns from.
const QUICK_CHARS: usize = 20_000;

const BUNDLED: &str = concat!(
    include_str!("../README.md"),
    include_str!("../BENCHMARKS.md")
);

/// Embedding, LSTM stack, and a linear read-out to `vocab` logits per position.
struct CharModel {
    embed: Embedding,
    lstm: Lstm,
    head: Linear,
}

impl CharModel {
    fn new(args: &Args, vocab: usize, g: &mut Generator) -> Result<CharModel> {
        Ok(CharModel {
            embed: Embedding::new(vocab, args.embedding, g)?,
            lstm: Lstm::new(args.embedding, args.hidden, args.layers, true, g)?,
            head: Linear::new(args.hidden, vocab, true, g)?,
        })
    }

    /// Logits `[batch, seq, vocab]` for tokens `[batch, seq]`, and the final state.
    fn step(&self, tokens: &Tensor, state: Option<(&Tensor, &Tensor)>) -> Result<StepOut> {
        let (h, state) = self
            .lstm
            .forward_with_state(&self.embed.forward(tokens)?, state)?;
        Ok((self.head.forward(&h)?, state))
    }
}

type StepOut = (Tensor, (Tensor, Tensor));

impl Module for CharModel {
    fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        Ok(self.step(tokens, None)?.0)
    }
    fn visit(&self, p: &str, f: &mut Visitor) {
        self.embed.visit(&join(p, "embed"), f);
        self.lstm.visit(&join(p, "lstm"), f);
        self.head.visit(&join(p, "head"), f);
    }
    fn visit_mut(&mut self, p: &str, f: &mut VisitorMut) -> Result<()> {
        self.embed.visit_mut(&join(p, "embed"), f)?;
        self.lstm.visit_mut(&join(p, "lstm"), f)?;
        self.head.visit_mut(&join(p, "head"), f)
    }
}

/// Windows of `len` tokens of a text, one every `stride`, each with the `len` tokens that
/// follow it one position on as targets (`[len]` i64 each).
struct CharWindows {
    tokens: Vec<i64>,
    len: usize,
    stride: usize,
}

impl Dataset for CharWindows {
    fn len(&self) -> usize {
        (self.tokens.len() - 1 - self.len) / self.stride + 1
    }
    fn sample_shape(&self) -> Vec<usize> {
        vec![self.len]
    }
    fn feature_dtype(&self) -> DType {
        DType::I64
    }
    fn target_shape(&self) -> Vec<usize> {
        vec![self.len]
    }
    fn fill_sample(&self, i: usize, x: &mut SampleMut, y: &mut SampleMut) -> Result<()> {
        let s = i * self.stride;
        x.as_mut::<i64>()?
            .copy_from_slice(&self.tokens[s..s + self.len]);
        y.as_mut::<i64>()?
            .copy_from_slice(&self.tokens[s + 1..s + self.len + 1]);
        Ok(())
    }
}

/// `count` windows of `len` random tokens below `vocab` and their next tokens, on `device`.
fn random_batch(
    count: usize,
    len: usize,
    vocab: usize,
    device: Device,
    g: &mut Generator,
) -> Result<(Tensor, Tensor)> {
    let tok: Vec<i64> = g
        .uniform(count * (len + 1))
        .iter()
        .map(|u| (u * (vocab as f64 - 0.01)) as i64)
        .collect();
    let rows = |off: usize| -> Vec<i64> {
        tok.chunks(len + 1)
            .flat_map(|w| w[off..off + len].to_vec())
            .collect()
    };
    Ok((
        Tensor::from_vec(rows(0), &[count, len], device)?,
        Tensor::from_vec(rows(1), &[count, len], device)?,
    ))
}

/// One training step: the loss under autocast, the scaled backward, gradients unscaled and
/// clipped to norm 1, the optimizer step through the scaler. Returns the loss and the logits
/// (on the device; nothing is read back).
fn train_step(
    net: &CharModel,
    opt: &mut Adam,
    scaler: &mut GradScaler,
    low: Option<DType>,
    (x, y): (&Tensor, &Tensor),
) -> Result<(Tensor, Tensor)> {
    let (loss, logits) = autocast_maybe(low, || {
        let logits = net.forward(x)?;
        Ok((loss_of(&logits, y)?, logits))
    })?;
    opt.zero_grad();
    scaler.scale(&loss)?.backward()?;
    scaler.unscale_(opt)?;
    clip_grad_norm(&net.parameters(), 1.0)?;
    scaler.step(opt)?;
    scaler.update()?;
    Ok((loss, logits))
}

/// Characters whose largest logit is the target's.
fn hits(logits: &Tensor, y: &Tensor) -> Result<Tensor> {
    logits
        .argmax(2, false)?
        .eq(y)?
        .to_dtype(DType::F32)?
        .sum_all()
}

/// Mean loss and accuracy per character of the windows of `loader`.
fn evaluate(
    net: &CharModel,
    loader: &mut DataLoader,
    device: Device,
    low: Option<DType>,
) -> Result<(f64, f64)> {
    let (mut loss, mut correct, mut n) = (0.0, 0.0, 0.0);
    for b in loader.epoch(0).to_device(device) {
        let b = b?;
        let logits = no_grad(|| autocast_maybe(low, || net.forward(&b.x)))?;
        let chars = b.y.numel() as f64;
        loss += no_grad(|| loss_of(&logits, &b.y))?.item()? * chars;
        correct += hits(&logits, &b.y)?.item()?;
        n += chars;
    }
    Ok((loss / n.max(1.0), correct / n.max(1.0)))
}

/// Mean cross-entropy of the logits `[b, s, v]` against targets `[b, s]`.
fn loss_of(logits: &Tensor, y: &Tensor) -> Result<Tensor> {
    let v = logits.shape()[2];
    logits
        .reshape(&[y.numel(), v])?
        .cross_entropy(&y.flatten(0, -1)?, CrossEntropyOptions::default())
}

fn run(mut args: Args) -> Result<()> {
    args.run.refuse_convolution_flags("lstm")?;
    let (device, low, _) = args.run.open()?;
    let dist = common::dist::Dist::join(device, "lstm")?;
    dist.check_flags(args.run.cuda_graph, "lstm")?;
    if args.seq_len == 0 || args.steps == 0 || args.epochs == 0 {
        return Err(Error::Invalid {
            op: "lstm",
            msg: format!(
                "--seq-len {}, --steps {} and --epochs {} must be at least 1",
                args.seq_len, args.steps, args.epochs
            ),
        });
    }
    if args.synthetic && args.quick {
        return Err(Error::Invalid {
            op: "lstm",
            msg: "--quick shortens training on a text; --synthetic times --steps steps".into(),
        });
    }
    args.out = args
        .files
        .prepare("runs/lstm", args.synthetic.then_some("--synthetic"))?;
    // The vocabulary: the text's distinct characters (256 byte values when synthetic).
    let mut text = match &args.text {
        _ if args.synthetic => String::new(),
        Some(p) => std::fs::read_to_string(p).map_err(|e| Error::Invalid {
            op: "lstm",
            msg: format!("reading {}: {e}", p.display()),
        })?,
        None => BUNDLED.to_string(),
    };
    if args.quick {
        text = text.chars().take(QUICK_CHARS).collect();
        args.epochs = 1;
    }
    let mut chars: Vec<char> = text.chars().collect();
    chars.sort_unstable();
    chars.dedup();
    let vocab = if args.synthetic { 256 } else { chars.len() };
    let data: Vec<i64> = text
        .chars()
        .map(|c| chars.binary_search(&c).unwrap_or(0) as i64)
        .collect();
    let held_out = data.len() / 10;
    if !args.synthetic && held_out < args.seq_len + 2 {
        return Err(Error::Invalid {
            op: "lstm",
            msg: format!(
                "the text has {} characters: too short for --seq-len {}",
                data.len(),
                args.seq_len
            ),
        });
    }
    let (train, test) = data.split_at(data.len() - held_out);
    let mut g = Generator::new(args.run.seed);
    let mut net = CharModel::new(&args, vocab, &mut g)?;
    net.to_device(device)?;
    let mut opt = Adam::new(net.parameters(), AdamConfig::adam(args.lr))?;
    // Trial batches of random tokens.
    args.batch = args.batch_size.resolve(device, 1 << 16, |b| {
        let x = Tensor::zeros(&[b, args.seq_len], DType::I64, device)?;
        step_fits(&net, &mut opt, low, || loss_of(&net.forward(&x)?, &x))
    })?;
    let mut scaler = GradScaler::new(GradScalerConfig {
        enabled: low == Some(DType::F16),
        ..Default::default()
    })?;
    // Every rank loads the checkpoint; the wrapper then broadcasts rank 0's parameters.
    let resumed = args.files.resume(
        &args.out,
        &mut net,
        &mut opt,
        &mut scaler,
        LossUnit::BitsPerChar,
    )?;
    // Data-parallel when launched so: rank 0's parameters everywhere, gradients averaged.
    let ddp = dist.wrap(&net.parameters())?;
    if dist.is_main() {
        println!(
        "LSTM {} x {} (embedding {}, vocabulary {vocab}, {} parameters), sequence {}, batch {}, device {device}, precision {}, {} threads",
        args.layers,
        args.hidden,
        args.embedding,
        net.num_parameters(),
        args.seq_len,
        args.batch,
        args.run.precision,
        rayon::current_num_threads()
    );
    }
    let graph = common::step_graph(&args.run, device, &net.parameters(), "lstm")?;
    let mut run = Run {
        args: &args,
        net: &mut net,
        opt: &mut opt,
        scaler: &mut scaler,
        device,
        low,
        graph,
        dist: &dist,
        ddp: ddp.as_ref(),
    };
    if args.synthetic {
        return run.synthetic(&mut g);
    }
    run.train_text(train, test, resumed)?;
    if !dist.is_main() {
        return Ok(());
    }
    run.net.set_training(false);
    sample(run.net, &data, &chars, device)
}

/// A run's model, optimizer, loss scaler and setting.
struct Run<'a> {
    args: &'a Args,
    net: &'a mut CharModel,
    opt: &'a mut Adam,
    scaler: &'a mut GradScaler,
    device: Device,
    low: Option<DType>,
    /// With --cuda-graph: the step captured after a few eager ones and replayed for every
    /// full batch.
    graph: Option<StepGraph>,
    /// This process's place in a data-parallel run.
    dist: &'a common::dist::Dist,
    /// The data-parallel wrapper, when launched so.
    ddp: Option<&'a mantissa::distributed::DistributedDataParallel>,
}

impl Run<'_> {
    fn step(&mut self, x: &Tensor, y: &Tensor) -> Result<(Tensor, Tensor)> {
        let (net, opt, scaler, low) = (&*self.net, &mut *self.opt, &mut *self.scaler, self.low);
        // A short last batch runs eagerly: its shape would capture again.
        match self
            .graph
            .as_mut()
            .filter(|_| x.shape()[0] == self.args.batch)
        {
            Some(g) => {
                let out = g.run(&[x.clone(), y.clone()], &mut |b| {
                    let (loss, logits) = train_step(net, opt, scaler, low, (&b[0], &b[1]))?;
                    Ok(vec![loss, logits])
                })?;
                Ok((out[0].clone(), out[1].clone()))
            }
            None => train_step(net, opt, scaler, low, (x, y)),
        }
    }

    /// Tokens/s of --steps training steps on one fixed batch of random tokens on the device,
    /// timed after --warmup steps (no loader in the measurement).
    fn synthetic(&mut self, g: &mut Generator) -> Result<()> {
        let args = self.args;
        let (b, len) = (args.batch, args.seq_len);
        let (x, y) = random_batch(b, len, 256, self.device, g)?;
        let total = args.warmup + args.steps;
        let cycle = OneCycle::new(args.lr, total);
        let mut profile = common::StepProfile::new(&args.run, &args.out)?;
        // Profiled steps run after the timed ones (profiling adds an event pair per launch).
        let extra = match args.run.profile > 0 {
            true => args.run.profile_warmup + args.run.profile,
            false => 0,
        };
        let (mut start, mut secs) = (Instant::now(), 0.0);
        for step in 0..total + extra {
            self.opt.set_lr(cycle.lr(step.min(total - 1)));
            let (loss, _) = self.step(&x, &y)?;
            if step >= total {
                profile.step()?;
            }
            if step + 1 == args.warmup {
                loss.item()?;
                start = Instant::now();
            }
            // Reading the loss waits for the device: the last step's read ends the timing.
            if step + 1 == total {
                let l = loss.item()?;
                secs = start.elapsed().as_secs_f64();
                if self.dist.is_main() {
                    let bits = LossUnit::BitsPerChar.from_nats(l);
                    println!("step {step}: loss {bits:.3} bits/char");
                }
            }
        }
        let tokens = (args.steps * b * len) as f64;
        // Data-parallel: every rank's tokens/s, summed.
        let rate = self
            .dist
            .combine(&[tokens / secs], mantissa::distributed::ReduceOp::Sum)?[0];
        if self.dist.is_main() {
            println!(
                "{} training tokens/s ({} steps in {secs:.2} s)",
                rate.round(),
                args.steps
            );
        }
        common::print_peak_memory("mantissa training", self.device)?;
        profile.finish()
    }

    /// --epochs over the windows of `train` from a loader (after the `start` epochs a
    /// resumed run had done, whose metrics are in `log`), each followed by the held-out
    /// windows of `test`; metrics.csv and curves.png in the output folder.
    fn train_text(
        &mut self,
        train: &[i64],
        test: &[i64],
        (start, mut log): (usize, MetricsLog),
    ) -> Result<()> {
        let (args, device) = (self.args, self.device);
        let windows = |tokens: &[i64], stride: usize| {
            Arc::new(CharWindows {
                tokens: tokens.to_vec(),
                len: args.seq_len,
                stride,
            })
        };
        let cfg = DataLoaderConfig {
            num_workers: args.run.workers,
            pin_memory: Some(device),
            ..DataLoaderConfig::new(args.batch)
        };
        let shuffled = DataLoaderConfig {
            sampler: self.dist.sampler(),
            shuffle: true,
            seed: args.run.seed,
            ..cfg
        };
        let stride = (args.seq_len / 2).max(1);
        let mut train_dl = DataLoader::new(windows(train, stride), shuffled)?;
        let mut test_dl = DataLoader::new(windows(test, args.seq_len), cfg)?;
        let steps = train_dl.len();
        let cycle = OneCycle::new(args.lr, args.epochs * steps);
        let mut profile = common::StepProfile::new(&args.run, &args.out)?;
        for epoch in start..args.epochs {
            self.net.set_training(true);
            let label = format!("epoch {}/{} {}", epoch + 1, args.epochs, args.run.precision);
            let mut bar = EpochProgress::new(&label, steps)
                .quiet(!self.dist.is_main())
                .loss_unit(LossUnit::BitsPerChar);
            bar.show_memory(device);
            for (k, b) in train_dl.epoch(epoch).to_device(device).enumerate() {
                let b = b?;
                self.opt.set_lr(cycle.lr(epoch * steps + k));
                let (loss, logits) = self.step(&b.x, &b.y)?;
                let right = no_grad(|| hits(&logits, &b.y))?;
                bar.step_tensors(b.y.numel(), &loss, &right)?;
                profile.step()?;
            }
            bar.finish()?;
            // No buffers in this model today; a batch norm added to it would need them equal.
            self.dist.sync_buffers(self.ddp, &*self.net)?;
            self.net.set_training(false);
            let (test_loss, test_acc) = evaluate(self.net, &mut test_dl, device, self.low)?;
            let mut m = bar.metrics(epoch + 1, (test_loss, test_acc), self.opt.lr());
            self.dist.reduce(&mut m)?;
            if !self.dist.is_main() {
                continue;
            }
            // The bar reports bits per character: the log, its CSV and plot, and this line.
            println!(
                "epoch {}: train loss {:.3} bits/char, acc {:.2}% | held-out loss {:.3} bits/char, acc {:.2}% | {:.1} s, {:.0} characters/s",
                epoch + 1,
                m.train_loss,
                100.0 * m.train_acc,
                m.test_loss,
                100.0 * m.test_acc,
                m.seconds,
                m.samples_per_s
            );
            log.push(m);
            log.write_csv(&args.out.join("metrics.csv"))?;
            plot_metrics(&log, &args.out.join("curves.png"))?;
            self.files_save(epoch + 1)?;
        }
        common::print_peak_memory("mantissa training", device)?;
        profile.finish()?;
        if !self.dist.is_main() {
            return Ok(());
        }
        if start >= args.epochs {
            println!(
                "no epoch was run (--epochs {}, starting after epoch {start}): no metrics or \
                 curves written",
                args.epochs
            );
            return Ok(());
        }
        println!(
            "metrics (per character: loss in bits, accuracy, characters/s) and curves in {}; \
             uniform over the vocabulary would be {:.2} bits/char",
            args.out.display(),
            (self.net.head.weight.shape()[0] as f64).log2()
        );
        Ok(())
    }

    /// --save's checkpoint after `epochs_done` epochs.
    fn files_save(&self, epochs_done: usize) -> Result<()> {
        let args = self.args;
        args.files
            .save(&*self.net, &*self.opt, &*self.scaler, epochs_done)
    }
}

/// A greedy continuation of the text's first characters, one character at a time.
fn sample(net: &CharModel, data: &[i64], chars: &[char], device: Device) -> Result<()> {
    let mut seq: Vec<i64> = data[..data.len().min(20)].to_vec();
    let prompt = Tensor::from_vec(seq.clone(), &[1, seq.len()], Device::Cpu)?.to_device(device)?;
    let (mut logits, mut state) = no_grad(|| net.step(&prompt, None))?;
    for _ in 0..120 {
        let last = logits.narrow(1, logits.shape()[1] - 1, 1)?;
        let next = last.argmax(2, false)?.to_vec::<i64>()?[0];
        seq.push(next);
        let t = Tensor::from_vec(vec![next], &[1, 1], Device::Cpu)?.to_device(device)?;
        (logits, state) = no_grad(|| net.step(&t, Some((&state.0, &state.1))))?;
    }
    let text: String = seq.iter().map(|&k| chars[k as usize]).collect();
    println!("sample: {text:?}");
    Ok(())
}

fn main() {
    common::main_with(run);
}
