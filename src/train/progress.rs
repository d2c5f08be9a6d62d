//! A per-epoch progress bar: ETA, samples/s, running loss and accuracy (plain log lines
//! without the `train-ui` feature or when output is not a terminal).

use std::time::Instant;

/// Progress of one epoch.
pub struct EpochProgress {
    #[cfg(feature = "train-ui")]
    bar: indicatif::ProgressBar,
    start: Instant,
    samples: usize,
    loss_sum: f64,
    hits: f64,
    batches: usize,
    extra: String,
    #[cfg_attr(feature = "train-ui", allow(dead_code))]
    label: String,
    #[cfg_attr(feature = "train-ui", allow(dead_code))]
    total: usize,
}

impl EpochProgress {
    /// A bar over `batches` steps, labelled e.g. `epoch 1/3 fp32`.
    pub fn new(label: &str, batches: usize) -> EpochProgress {
        #[cfg(feature = "train-ui")]
        let bar = {
            let b = indicatif::ProgressBar::new(batches as u64);
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
            extra: String::new(),
            label: label.to_string(),
            total: batches,
        }
    }

    /// Records one step: its batch size, mean loss and number of correct predictions.
    pub fn step(&mut self, batch: usize, loss: f64, correct: f64) {
        self.samples += batch;
        self.batches += 1;
        self.loss_sum += loss * batch as f64;
        self.hits += correct;
        #[cfg(feature = "train-ui")]
        {
            self.bar.set_message(format!(
                "loss {:.4} acc {:.2}% {:.0} samples/s {}",
                self.loss(),
                100.0 * self.accuracy(),
                self.samples_per_s(),
                self.extra
            ));
            self.bar.inc(1);
        }
        #[cfg(not(feature = "train-ui"))]
        if self.batches % 100 == 0 || self.batches == self.total {
            eprintln!(
                "{} {}/{} loss {:.4} acc {:.2}% {:.0} samples/s {}",
                self.label,
                self.batches,
                self.total,
                self.loss(),
                100.0 * self.accuracy(),
                self.samples_per_s(),
                self.extra
            );
        }
    }

    /// Extra text shown after the figures (e.g. the current loss scale).
    pub fn set_extra(&mut self, text: impl Into<String>) {
        self.extra = text.into();
    }

    /// Mean loss so far.
    pub fn loss(&self) -> f64 {
        self.loss_sum / self.samples.max(1) as f64
    }
    /// Accuracy so far.
    pub fn accuracy(&self) -> f64 {
        self.hits / self.samples.max(1) as f64
    }
    pub fn seconds(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }
    pub fn samples_per_s(&self) -> f64 {
        self.samples as f64 / self.seconds().max(1e-9)
    }

    /// Ends the bar (leaves it on screen).
    pub fn finish(&self) {
        #[cfg(feature = "train-ui")]
        self.bar.finish();
    }
}
