//! Trains a character-level LSTM language model (embedding, stacked `nn::Lstm`, linear to the
//! vocabulary) on a text, reports held-out bits per character and samples from it; or, with
//! `--synthetic`, measures training tokens/s on random tokens (W4 of BENCHMARKS.md: 2 layers, hidden
//! 512, sequence 100, batch 64, AMP).
//!
//! ```text
//! cargo run --release --example lstm -- --hidden 128 --steps 300
//! cargo run --release --example lstm -- --synthetic --device cuda --precision bf16
//! ```
//! Without `--text` it trains on this crate's README and BENCHMARKS (bundled at build time).
//! Adam with a one-cycle schedule, gradients clipped to norm 1 (unscaled first under fp16).

use clap::Parser;
use mantissa::amp::{GradScaler, GradScalerConfig};
use mantissa::nn::*;
use mantissa::optim::*;
use mantissa::train::{autocast_maybe, step_fits};
use mantissa::*;
use std::path::PathBuf;
use std::time::Instant;

mod common;
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
    /// Training steps (with --synthetic: timed, after --warmup steps).
    #[arg(long, default_value_t = 200)]
    steps: usize,
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Peak learning rate of the one-cycle schedule.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    #[command(flatten)]
    run: RunFlags,
}

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

/// `count` windows of `len + 1` tokens from `data`, at random starts: inputs and next-token
/// targets, `[count, len]` each.
fn windows(data: &[i64], count: usize, len: usize, g: &mut Generator) -> Result<(Tensor, Tensor)> {
    let span = data.len() - len - 1;
    let (mut x, mut y) = (
        Vec::with_capacity(count * len),
        Vec::with_capacity(count * len),
    );
    for u in g.uniform(count) {
        let s = ((u * span as f64) as usize).min(span - 1);
        x.extend_from_slice(&data[s..s + len]);
        y.extend_from_slice(&data[s + 1..s + len + 1]);
    }
    Ok((
        Tensor::from_vec(x, &[count, len], Device::Cpu)?,
        Tensor::from_vec(y, &[count, len], Device::Cpu)?,
    ))
}

/// Mean cross-entropy of the logits `[b, s, v]` against targets `[b, s]`.
fn loss_of(logits: &Tensor, y: &Tensor) -> Result<Tensor> {
    let v = logits.shape()[2];
    logits
        .reshape(&[y.numel(), v])?
        .cross_entropy(&y.flatten(0, -1)?, CrossEntropyOptions::default())
}

fn run(mut args: Args) -> Result<()> {
    let (device, low, _) = args.run.open()?;
    if args.seq_len == 0 || args.steps == 0 {
        return Err(Error::Invalid {
            op: "lstm",
            msg: format!(
                "--seq-len {} and --steps {} must be at least 1",
                args.seq_len, args.steps
            ),
        });
    }
    // The vocabulary: the text's distinct characters (256 byte values when synthetic).
    let text = match &args.text {
        _ if args.synthetic => String::new(),
        Some(p) => std::fs::read_to_string(p).map_err(|e| Error::Invalid {
            op: "lstm",
            msg: format!("reading {}: {e}", p.display()),
        })?,
        None => BUNDLED.to_string(),
    };
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
    let total = if args.synthetic {
        args.warmup + args.steps
    } else {
        args.steps
    };
    let cycle = OneCycle::new(args.lr, total);
    // Synthetic data: one fixed batch of random tokens on the device.
    let fixed = if args.synthetic {
        let tok: Vec<i64> = g
            .uniform(args.batch * (args.seq_len + 1))
            .iter()
            .map(|u| (u * 255.99) as i64)
            .collect();
        let (x, y) = windows(&tok, args.batch, args.seq_len, &mut Generator::new(0))?;
        Some((x.to_device(device)?, y.to_device(device)?))
    } else {
        None
    };
    let mut start = Instant::now();
    let mut profile = common::StepProfile::new(&args.run, std::path::Path::new("runs/lstm"));
    // Timed synthetic runs profile steps of their own after the timed ones (profiling adds
    // an event pair per launch); a run on text profiles its first steps after the warm-up.
    let extra = match args.synthetic && args.run.profile > 0 {
        true => args.run.profile_warmup + args.run.profile,
        false => 0,
    };
    let mut secs = 0.0;
    for step in 0..total + extra {
        opt.set_lr(cycle.lr(step.min(total - 1)));
        let (x, y) = match &fixed {
            Some((x, y)) => (x.clone(), y.clone()),
            None => {
                let (x, y) = windows(train, args.batch, args.seq_len, &mut g)?;
                (x.to_device(device)?, y.to_device(device)?)
            }
        };
        let loss = autocast_maybe(low, || loss_of(&net.forward(&x)?, &y))?;
        opt.zero_grad();
        scaler.scale(&loss)?.backward()?;
        scaler.unscale_(&mut opt)?;
        clip_grad_norm(&net.parameters(), 1.0)?;
        scaler.step(&mut opt)?;
        scaler.update()?;
        if !args.synthetic || step >= total {
            profile.step()?;
        }
        if args.synthetic && step + 1 == args.warmup {
            loss.item()?;
            start = Instant::now();
        }
        // Reading the loss waits for the device: the last step's read ends the timing.
        if step + 1 == total || !args.synthetic && step % 50 == 0 {
            let l = loss.item()?;
            println!(
                "step {step}: loss {l:.3} ({:.2} bits/char)",
                l / std::f64::consts::LN_2
            );
        }
        if step + 1 == total {
            secs = start.elapsed().as_secs_f64();
        }
    }
    let timed = if args.synthetic { args.steps } else { total };
    let tokens = (timed * args.batch * args.seq_len) as f64;
    println!(
        "{} training tokens/s ({timed} steps in {secs:.2} s)",
        (tokens / secs).round()
    );
    common::print_peak_memory("mantissa training", device)?;
    profile.finish()?;
    if args.synthetic {
        return Ok(());
    }
    // Held-out bits per character, on windows of the last tenth of the text.
    net.set_training(false);
    let (x, y) = windows(test, args.batch, args.seq_len, &mut Generator::new(7))?;
    let l = no_grad(|| {
        autocast_maybe(low, || {
            loss_of(&net.forward(&x.to_device(device)?)?, &y.to_device(device)?)
        })
    })?
    .item()?;
    println!(
        "held-out: {:.3} bits/char (uniform over the vocabulary: {:.2})",
        l / std::f64::consts::LN_2,
        (vocab as f64).log2()
    );
    // A greedy continuation of the text's first characters, one character at a time.
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
    let sample: String = seq.iter().map(|&k| chars[k as usize]).collect();
    println!("sample: {sample:?}");
    Ok(())
}

fn main() {
    common::main_with(run);
}
