//! The GPT example's training loop (nanoGPT's): the learning-rate schedule, one optimizer step
//! over `accumulate` micro-batches, evaluation of both splits, `metrics.csv` and
//! `curves.png`, `--save`/`--resume`, and the timed run on random tokens.

use super::common::dist::Dist;
use super::common::files::FileFlags;
use super::common::StepProfile;
use super::data::{random_windows, Splits};
use super::model::Gpt;
use super::step::{batch_generator, hits, lr_at, train_step, Model};
use mantissa::amp::GradScaler;
use mantissa::distributed::{DistributedDataParallel, ReduceOp};
use mantissa::graph::StepGraph;
use mantissa::nn::Module;
use mantissa::optim::{Adam, Optimizer};
use mantissa::train::{autocast_maybe, plot_metrics, EpochMetrics, EpochProgress, MetricsLog};
use mantissa::{no_grad, DType, Device, Error, Generator, Result, Tensor};
use std::path::Path;
use std::time::Instant;

/// The loop's settings.
pub struct Trainer {
    pub batch: usize,
    pub accumulate: usize,
    pub steps: usize,
    /// The step the cosine reaches `min_lr` at (nanoGPT's `lr_decay_iters`).
    pub decay_steps: usize,
    pub lr: f64,
    pub min_lr: f64,
    pub warmup: usize,
    pub grad_clip: f64,
    pub eval_interval: usize,
    pub eval_batches: usize,
    pub seed: u64,
    pub low: Option<DType>,
    pub device: Device,
    /// Steps profiled after the timed ones of a synthetic run (--profile-warmup + --profile,
    /// or 0): profiling adds an event pair per launch, so it stays out of the timing.
    pub profile_steps: usize,
}

/// A row of metrics.csv.
struct Row {
    step: usize,
    train_loss: f64,
    val_loss: f64,
    train_acc: f64,
    val_acc: f64,
    lr: f64,
    seconds: f64,
    tokens_per_s: f64,
}

const HEADER: &str = "step,train_loss,val_loss,train_acc,val_acc,lr,seconds,tokens_per_s";

fn write_metrics(rows: &[Row], out: &Path) -> Result<()> {
    let mut s = format!("{HEADER}\n");
    for r in rows {
        s += &format!(
            "{},{:.6},{:.6},{:.6},{:.6},{:.6e},{:.3},{:.1}\n",
            r.step,
            r.train_loss,
            r.val_loss,
            r.train_acc,
            r.val_acc,
            r.lr,
            r.seconds,
            r.tokens_per_s
        );
    }
    let csv = out.join("metrics.csv");
    std::fs::write(&csv, s).map_err(|e| Error::Io {
        op: "gpt metrics",
        path: csv.display().to_string(),
        source: e,
    })?;
    // The plot's "epochs" are the evaluation steps; its test curve is the validation split.
    let mut log = MetricsLog::default();
    for r in rows {
        log.push(EpochMetrics {
            epoch: r.step,
            train_loss: r.train_loss,
            train_acc: r.train_acc,
            test_loss: r.val_loss,
            test_acc: r.val_acc,
            lr: r.lr,
            seconds: r.seconds,
            samples_per_s: r.tokens_per_s,
            memory: None,
        });
    }
    plot_metrics(&log, &out.join("curves.png"))
}

/// The rows of an earlier run's metrics.csv up to `step` (none when there is no file).
fn read_metrics(out: &Path, step: usize) -> Result<Vec<Row>> {
    let csv = out.join("metrics.csv");
    let Ok(text) = std::fs::read_to_string(&csv) else {
        return Ok(Vec::new());
    };
    let bad = || Error::Format {
        op: "--resume",
        path: csv.display().to_string(),
        msg: format!("not the GPT example's metrics (header {HEADER})"),
    };
    let mut lines = text.lines();
    if lines.next() != Some(HEADER) {
        return Err(bad());
    }
    let mut rows = Vec::new();
    for l in lines {
        let v: Vec<f64> = l
            .split(',')
            .map(|x| x.parse().map_err(|_| bad()))
            .collect::<Result<_>>()?;
        if v.len() != 8 {
            return Err(bad());
        }
        let row = Row {
            step: v[0] as usize,
            train_loss: v[1],
            val_loss: v[2],
            train_acc: v[3],
            val_acc: v[4],
            lr: v[5],
            seconds: v[6],
            tokens_per_s: v[7],
        };
        if row.step <= step {
            rows.push(row);
        }
    }
    Ok(rows)
}

/// With `--resume`: the model, the optimizer, an enabled scaler's state and the steps done.
pub fn resume(
    files: &FileFlags,
    net: &mut Gpt,
    opt: &mut Adam,
    scaler: &mut GradScaler,
) -> Result<usize> {
    let Some(path) = &files.resume else {
        return Ok(0);
    };
    let meta = super::common::files::load_training(path, net, opt, scaler)?;
    let step = meta
        .get("epoch")
        .and_then(|s| s.parse::<usize>().ok())
        .ok_or_else(|| Error::Format {
            op: "--resume",
            path: path.display().to_string(),
            msg: "no step count in its metadata (not written by --save)".into(),
        })?;
    println!("resumed from {} after step {step}", path.display());
    Ok(step)
}

/// Peak dense bf16 tensor-core FLOP/s of the device (for the MFU), when known.
fn peak_flops(device: Device) -> Option<f64> {
    #[cfg(feature = "cuda-backend")]
    if let Device::Cuda(n) = device {
        let arch = mantissa::backend::cuda::runtime::runtime(n).ok()?.arch();
        return match arch {
            90 => Some(989e12),
            80 => Some(312e12),
            _ => None,
        };
    }
    let _ = device;
    None
}

/// Training FLOPs per token (nanoGPT's estimate: 6 N for the products with the weights,
/// and 12 L T C for attention's).
fn flops_per_token(net: &Gpt) -> f64 {
    let c = net.config;
    6.0 * net.num_parameters_without_positions() as f64
        + 12.0 * (c.n_layer * c.block_size * c.n_embd) as f64
}

impl Trainer {
    /// One step on `(x, y)` through `g`: run eagerly for its warm-up, then captured once and
    /// replayed (the batch copied into the graph's inputs). The loss and the tokens predicted.
    fn replayed(
        &self,
        g: &mut StepGraph,
        m: &mut Model,
        (x, y): &(Tensor, Tensor),
    ) -> Result<(Tensor, Tensor)> {
        let (low, clip) = (self.low, self.grad_clip);
        let o = g.run(&[x.clone(), y.clone()], &mut |b| {
            let (l, lg) = train_step(m, &[(b[0].clone(), b[1].clone())], low, clip, None)?;
            Ok(vec![l, lg])
        })?;
        Ok((o[0].clone(), o[1].clone()))
    }

    /// One step's micro-batches from `data` for `step` on this rank.
    fn batches(
        &self,
        data: &[u16],
        rank: usize,
        step: usize,
        block: usize,
    ) -> Result<Vec<(Tensor, Tensor)>> {
        let mut g = batch_generator(self.seed, rank, step);
        (0..self.accumulate)
            .map(|_| random_windows(data, self.batch, block, &mut g, self.device))
            .collect()
    }

    /// Mean loss and next-token accuracy of `data` over the evaluation batches (the same
    /// windows at every evaluation), averaged over the ranks.
    fn evaluate(&self, net: &Gpt, data: &[u16], dist: &Dist, salt: u64) -> Result<(f64, f64)> {
        let mut g = batch_generator(self.seed ^ salt, dist.group.rank(), usize::MAX);
        let (mut loss, mut right, mut n) = (0.0, 0.0, 0.0);
        for _ in 0..self.eval_batches {
            let (x, y) =
                random_windows(data, self.batch, net.config.block_size, &mut g, self.device)?;
            let (l, logits) = no_grad(|| autocast_maybe(self.low, || net.loss(&x, &y)))?;
            loss += l.item()?;
            right += hits(&logits, &y)?.item()?;
            n += y.numel() as f64;
        }
        let s = dist.combine(&[loss / self.eval_batches as f64, right / n], ReduceOp::Sum)?;
        let ranks = dist.group.world_size() as f64;
        Ok((s[0] / ranks, s[1] / ranks))
    }

    /// Steps `start..steps` on `splits.train`, evaluating both splits every
    /// `eval_interval` steps and at the end.
    #[allow(clippy::too_many_arguments)]
    pub fn train(
        &self,
        mut m: Model,
        splits: &Splits,
        start: usize,
        dist: &Dist,
        ddp: Option<&DistributedDataParallel>,
        (files, out): (&FileFlags, &Path),
        mut graph: Option<&mut StepGraph>,
        profile: &mut StepProfile,
    ) -> Result<()> {
        let block = m.net.config.block_size;
        let mut rows = read_metrics(out, start)?;
        let tokens = self.batch * block * self.accumulate;
        let flops = flops_per_token(m.net);
        let peak = peak_flops(self.device);
        let mut step = start;
        while step < self.steps {
            let end = ((step / self.eval_interval + 1) * self.eval_interval).min(self.steps);
            m.net.train();
            let label = format!("steps {}-{} of {}", step + 1, end, self.steps);
            let mut bar = EpochProgress::new(&label, end - step)
                .samples_named("tokens")
                .quiet(!dist.is_main());
            bar.show_memory(self.device);
            let clock = Instant::now();
            for s in step..end {
                let lr = lr_at(s, self.lr, self.min_lr, self.warmup, self.decay_steps);
                m.opt.set_lr(lr);
                let micro = self.batches(&splits.train, dist.group.rank(), s, block)?;
                let (loss, right) = match graph.as_deref_mut() {
                    Some(g) => self.replayed(g, &mut m, &micro[0])?,
                    None => train_step(&mut m, &micro, self.low, self.grad_clip, ddp)?,
                };
                bar.step_tensors(tokens, &loss, &right.mul(self.accumulate as f64)?)?;
                profile.step()?;
            }
            bar.finish()?;
            let seconds = clock.elapsed().as_secs_f64();
            step = end;
            m.net.eval();
            let (train_loss, train_acc) = self.evaluate(m.net, &splits.train, dist, 1)?;
            let (val_loss, val_acc) = self.evaluate(m.net, &splits.val, dist, 2)?;
            let rate = dist.combine(&[bar.samples_per_s()], ReduceOp::Sum)?[0];
            if !dist.is_main() {
                continue;
            }
            // Against every rank's GPU together.
            let gpus = dist.group.world_size() as f64;
            let mfu = match peak {
                Some(p) => format!(", MFU {:.1}%", 100.0 * flops * rate / (p * gpus)),
                None => String::new(),
            };
            println!(
                "step {step}: train loss {train_loss:.4}, val loss {val_loss:.4} (next-token accuracy {:.1}% / {:.1}%), lr {:.2e}, {rate:.0} tokens/s{mfu}",
                100.0 * train_acc,
                100.0 * val_acc,
                m.opt.lr()
            );
            rows.push(Row {
                step,
                train_loss,
                val_loss,
                train_acc,
                val_acc,
                lr: m.opt.lr(),
                seconds,
                tokens_per_s: rate,
            });
            write_metrics(&rows, out)?;
            files.save(&*m.net, &*m.opt, &*m.scaler, step)?;
        }
        if dist.is_main() && !rows.is_empty() {
            println!("metrics and curves in {}", out.display());
        }
        Ok(())
    }

    /// Tokens/s of `steps` training steps on one batch of random tokens, after 3 untimed
    /// ones (kernels compiled, memory reserved).
    #[allow(clippy::too_many_arguments)]
    pub fn synthetic(
        &self,
        net: &mut Gpt,
        opt: &mut Adam,
        scaler: &mut GradScaler,
        dist: &Dist,
        ddp: Option<&DistributedDataParallel>,
        mut graph: Option<&mut StepGraph>,
        profile: &mut StepProfile,
    ) -> Result<()> {
        let c = net.config;
        let data: Vec<u16> = Generator::new(self.seed)
            .uniform(1 << 16)
            .iter()
            .map(|u| (u * (c.vocab_size.min(50_257) as f64 - 0.01)) as u16)
            .collect();
        let micro = self.batches(&data, dist.group.rank(), 0, c.block_size)?;
        let warmup = 3;
        let mut m = Model { net, opt, scaler };
        let (mut start, mut secs) = (Instant::now(), 0.0);
        let total = warmup + self.steps;
        for step in 0..total + self.profile_steps {
            m.opt.set_lr(self.lr);
            let loss = match graph.as_deref_mut() {
                Some(g) => self.replayed(g, &mut m, &micro[0])?.0,
                None => train_step(&mut m, &micro, self.low, self.grad_clip, ddp)?.0,
            };
            if step >= total {
                profile.step()?;
            }
            if step + 1 == warmup {
                loss.item()?;
                start = Instant::now();
            }
            if step + 1 == total {
                let l = loss.item()?;
                secs = start.elapsed().as_secs_f64();
                if dist.is_main() {
                    println!("step {step}: loss {l:.4}");
                }
            }
        }
        let tokens = (self.steps * self.batch * c.block_size * self.accumulate) as f64;
        let rate = dist.combine(&[tokens / secs], ReduceOp::Sum)?[0];
        if dist.is_main() {
            let gpus = dist.group.world_size() as f64;
            let mfu = match peak_flops(self.device) {
                Some(p) => format!(
                    ", MFU {:.1}%",
                    100.0 * flops_per_token(m.net) * rate / (p * gpus)
                ),
                None => String::new(),
            };
            println!(
                "{} training tokens/s ({} steps in {secs:.2} s){mfu}",
                rate.round(),
                self.steps
            );
        }
        super::common::print_peak_memory("mantissa training", self.device)?;
        profile.finish()
    }
}
