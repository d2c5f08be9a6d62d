//! Training runs: per-epoch metrics as CSV, a progress bar with ETA and throughput, a PNG
//! plot of the curves (the last two with the default `train-ui` feature), the steps a
//! classifier's training loop repeats, and the batch-size finder.

mod batch_size;
mod classify;
mod metrics;
#[cfg(feature = "train-ui")]
mod plot;
mod progress;

pub use crate::fs::{check_writable_dir, check_writable_file};
pub use batch_size::{
    classifier_fits, find_batch_size, step_fits, BatchSizeSearch, BatchSizeTrials,
};
pub use classify::{
    autocast_maybe, classify_micro_step, classify_step, evaluate_classifier, parse_precision,
    Accumulation,
};
pub use metrics::{EpochMetrics, LossUnit, MetricsLog};
#[cfg(feature = "train-ui")]
pub use plot::plot_metrics;
pub use progress::EpochProgress;
