//! A per-epoch progress bar: ETA, samples/s, running loss and accuracy, a GPU's memory; plain
//! lines on stdout instead without the `train-ui` feature, or when stdout is not a terminal (a
//! CI log, `| tee`).

use super::{EpochMetrics, LossUnit};
use crate::{memory, Device, Result, Tensor};
use std::time::Instant;

/// Steps between host reads of the running sums that [`EpochProgress::step_tensors`] keeps on
/// the device.
const READ_EVERY: usize = 25;

/// Progress of one epoch.
pub struct EpochProgress {
    #[cfg(feature = "train-ui")]
    bar: indicatif::ProgressBar,
    start: Instant,
    samples: usize,
    loss_sum: f64,
    hits: f64,
    batches: usize,
    /// Samples whose loss and hits are in `loss_sum` and `hits` (the rest are pending).
    counted: usize,
    /// Loss sum (weighted by batch size) and correct count not yet read back, their steps
    /// and their samples.
    pending: Option<(Tensor, Tensor, usize, usize)>,
    extra: String,
    label: String,
    total: usize,
    /// Plain lines instead of the bar.
    plain: bool,
    /// Nothing shown (a data-parallel rank other than 0).
    quiet: bool,
    /// The GPU whose memory is shown.
    device: Option<Device>,
    /// The steps (1-based, first and last) among which the loss first became non-finite.
    non_finite: Option<(usize, usize)>,
    /// The unit the loss is shown and reported in (recorded in nats).
    unit: LossUnit,
    /// What a sample is called in the rate shown (`samples/s`, `tokens/s`).
    per: &'static str,
}

impl EpochProgress {
    /// A bar over `batches` steps, labelled e.g. `epoch 1/3 fp32`.
    pub fn new(label: &str, batches: usize) -> EpochProgress {
        use std::io::IsTerminal;
        let plain = !cfg!(feature = "train-ui") || !std::io::stdout().is_terminal();
        #[cfg(feature = "train-ui")]
        let bar = {
            let b = match plain {
                true => indicatif::ProgressBar::hidden(),
                false => indicatif::ProgressBar::new(batches as u64),
            };
            let style = indicatif::ProgressStyle::with_template(
                "{prefix} [{bar:28}] {pos}/{len} {elapsed}<{eta} {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> ");
            b.set_style(style);
            b.set_prefix(label.to_string());
            b
        };
        EpochProgress {
            #[cfg(feature = "train-ui")]
            bar,
            start: Instant::now(),
            samples: 0,
            loss_sum: 0.0,
            hits: 0.0,
            batches: 0,
            counted: 0,
            pending: None,
            extra: String::new(),
            label: label.to_string(),
            total: batches,
            plain,
            quiet: false,
            device: None,
            non_finite: None,
            unit: LossUnit::Nats,
            per: "samples",
        }
    }

    /// Names the samples counted in the rate shown: `tokens` for a language model whose
    /// steps count tokens, so the bar shows `tokens/s`.
    ///
    /// ```
    /// # use mantissa::train::EpochProgress;
    /// let bar = EpochProgress::new("steps", 10).samples_named("tokens");
    /// assert!(bar.status_line().contains("tokens/s"));
    /// ```
    pub fn samples_named(mut self, name: &'static str) -> EpochProgress {
        self.per = name;
        self
    }

    /// Shows the loss in `unit` and reports it so in [`EpochProgress::metrics`] (the steps'
    /// losses are still given in nats, as `cross_entropy` returns them).
    pub fn loss_unit(mut self, unit: LossUnit) -> EpochProgress {
        self.unit = unit;
        self
    }

    /// The loss as shown: `loss 0.1234`, or `1.234 bits/char`.
    fn loss_text(&self) -> String {
        let l = self.unit.from_nats(self.loss());
        match self.unit {
            LossUnit::Nats => format!("loss {l:.4}"),
            LossUnit::BitsPerChar => format!("loss {l:.3} bits/char"),
        }
    }

    /// Shows nothing (the figures are still kept): for the data-parallel ranks other than
    /// rank 0, so that one bar is drawn.
    pub fn quiet(mut self, on: bool) -> EpochProgress {
        self.quiet = on;
        #[cfg(feature = "train-ui")]
        if on {
            self.bar = indicatif::ProgressBar::hidden();
        }
        self
    }

    /// Shows `device`'s memory with the figures: allocated / reserved and the peak allocated
    /// so far, as the caching allocator counts them (no device sync). Nothing on the CPU.
    pub fn show_memory(&mut self, device: Device) {
        self.device = (device != Device::Cpu).then_some(device);
    }

    /// The memory text of [`EpochProgress::show_memory`]'s device, empty without one.
    fn memory_text(&self) -> String {
        let Some(stats) = self.device.and_then(|d| memory::memory_stats(d).ok()) else {
            return String::new();
        };
        // GiB, or MiB while the reservation is below one GiB.
        let (unit, scale) = match stats.reserved.max(stats.peak_allocated) >= 1 << 30 {
            true => ("GiB", (1u64 << 30) as f64),
            false => ("MiB", (1u64 << 20) as f64),
        };
        let v = |b: usize| b as f64 / scale;
        format!(
            " mem {:.2}/{:.2} {unit} peak {:.2}",
            v(stats.allocated),
            v(stats.reserved),
            v(stats.peak_allocated)
        )
    }

    /// Records one step: its batch size, mean loss and number of correct predictions.
    pub fn step(&mut self, batch: usize, loss: f64, correct: f64) {
        self.samples += batch;
        self.batches += 1;
        self.counted += batch;
        self.loss_sum += loss * batch as f64;
        self.hits += correct;
        if !loss.is_finite() {
            self.note_non_finite(self.batches, self.batches, loss);
        }
        self.refresh();
        self.tick();
    }

    /// Says once that the loss became non-finite (`value`) at steps `first..=last`.
    fn note_non_finite(&mut self, first: usize, last: usize, value: f64) {
        if self.non_finite.is_some() {
            return;
        }
        self.non_finite = Some((first, last));
        let at = match first == last {
            true => format!("at step {first}"),
            false => format!("in steps {first}-{last}"),
        };
        let msg = format!(
            "{}: the training loss became non-finite ({value}) {at} of {}",
            self.label, self.total
        );
        if self.quiet {
            return;
        }
        #[cfg(feature = "train-ui")]
        if !self.plain {
            self.bar.println(msg);
            return;
        }
        println!("{msg}");
    }

    /// The steps of this epoch (1-based, first and last) among which the loss first became
    /// NaN or infinite: one step with [`EpochProgress::step`], the steps between two reads
    /// of the sums with [`EpochProgress::step_tensors`].
    pub fn first_non_finite(&self) -> Option<(usize, usize)> {
        self.non_finite
    }

    /// Records one step from one-element tensors (mean loss, correct count) without reading
    /// them: the sums stay on the tensors' device and are read back every 25 steps and by
    /// [`EpochProgress::flush`] / [`EpochProgress::finish`], so a GPU step does not wait for
    /// the host. The figures shown lag by at most that many steps.
    ///
    /// ```
    /// # use mantissa::{train::EpochProgress, DType, Device, Tensor};
    /// let mut bar = EpochProgress::new("epoch 1", 2);
    /// for _ in 0..2 {
    ///     let loss = Tensor::scalar(0.5, DType::F32, Device::Cpu)?;
    ///     let correct = Tensor::scalar(3.0, DType::F32, Device::Cpu)?;
    ///     bar.step_tensors(4, &loss, &correct)?;
    /// }
    /// bar.finish()?;
    /// assert_eq!((bar.loss(), bar.accuracy()), (0.5, 0.75));
    /// # Ok::<(), mantissa::Error>(())
    /// ```
    pub fn step_tensors(&mut self, batch: usize, loss: &Tensor, correct: &Tensor) -> Result<()> {
        let weighted = loss
            .detach()
            .to_dtype(crate::DType::F32)?
            .mul(batch as f64)?;
        let correct = correct.detach().to_dtype(crate::DType::F32)?;
        let pending = match self.pending.take() {
            Some((l, c, steps, n)) => (l.add(&weighted)?, c.add(&correct)?, steps + 1, n + batch),
            // A sum of its own: `correct` may be a tensor the caller overwrites (a CUDA
            // graph's output, rewritten by the next replay).
            None => (weighted, correct.copy()?, 1, batch),
        };
        self.samples += batch;
        self.batches += 1;
        let due = pending.2 >= READ_EVERY || self.batches == self.total;
        self.pending = Some(pending);
        if due {
            self.flush()?;
        }
        self.tick();
        Ok(())
    }

    /// Reads the sums [`EpochProgress::step_tensors`] kept on the device (one host read) and
    /// updates the figures.
    pub fn flush(&mut self) -> Result<()> {
        if let Some((l, c, steps, n)) = self.pending.take() {
            let both = Tensor::cat(&[&l.reshape(&[1])?, &c.reshape(&[1])?], 0)?;
            let v = both.to_vec_f64()?;
            self.loss_sum += v[0];
            self.hits += v[1];
            self.counted += n;
            if !v[0].is_finite() {
                let last = self.batches;
                self.note_non_finite(last + 1 - steps, last, v[0]);
            }
            self.refresh();
        }
        Ok(())
    }

    /// Shows the current figures on the bar.
    fn refresh(&self) {
        #[cfg(feature = "train-ui")]
        self.bar.set_message(format!(
            "{} acc {:.2}% {:.0} {}/s{} {}",
            self.loss_text(),
            100.0 * self.accuracy(),
            self.samples_per_s(),
            self.per,
            self.memory_text(),
            self.extra
        ));
    }

    /// Advances the bar by one step, or prints a plain line every 100 steps and at the last.
    fn tick(&self) {
        #[cfg(feature = "train-ui")]
        self.bar.inc(1);
        if self.plain
            && !self.quiet
            && (self.batches.is_multiple_of(100) || self.batches == self.total)
        {
            println!("{}", self.status_line());
        }
    }

    /// The figures as one line, as printed when stdout is not a terminal: label, steps,
    /// loss, accuracy, samples/s, the device's memory (with [`EpochProgress::show_memory`])
    /// and the extra text.
    pub fn status_line(&self) -> String {
        let line = format!(
            "{} {}/{} {} acc {:.2}% {:.0} {}/s{} {}",
            self.label,
            self.batches,
            self.total,
            self.loss_text(),
            100.0 * self.accuracy(),
            self.samples_per_s(),
            self.per,
            self.memory_text(),
            self.extra
        );
        line.trim_end().to_string()
    }

    /// Extra text shown after the figures (e.g. the current loss scale).
    pub fn set_extra(&mut self, text: impl Into<String>) {
        self.extra = text.into();
    }

    /// Mean loss in nats over the steps read so far (all of them after
    /// [`EpochProgress::flush`]).
    pub fn loss(&self) -> f64 {
        self.loss_sum / self.counted.max(1) as f64
    }
    /// Accuracy over the steps read so far.
    pub fn accuracy(&self) -> f64 {
        self.hits / self.counted.max(1) as f64
    }
    pub fn seconds(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }
    pub fn samples_per_s(&self) -> f64 {
        self.samples as f64 / self.seconds().max(1e-9)
    }

    /// The epoch's metrics: its number, the bar's loss, accuracy, time and throughput, the
    /// held-out `(loss in nats, accuracy)`, the learning rate, and the memory of the device
    /// given to [`EpochProgress::show_memory`] (none without one); both losses in the bar's
    /// [`EpochProgress::loss_unit`]. Call after [`EpochProgress::finish`].
    pub fn metrics(
        &self,
        epoch: usize,
        (test_loss, test_acc): (f64, f64),
        lr: f64,
    ) -> EpochMetrics {
        EpochMetrics {
            epoch,
            train_loss: self.unit.from_nats(self.loss()),
            train_acc: self.accuracy(),
            test_loss: self.unit.from_nats(test_loss),
            test_acc,
            lr,
            seconds: self.seconds(),
            samples_per_s: self.samples_per_s(),
            memory: self.device.and_then(|d| memory::memory_stats(d).ok()),
        }
    }

    /// Reads what is pending and ends the bar (leaves it on screen).
    pub fn finish(&mut self) -> Result<()> {
        self.flush()?;
        #[cfg(feature = "train-ui")]
        self.bar.finish();
        Ok(())
    }
}
