//! Training-run output: per-epoch metrics as CSV, a progress bar with ETA and throughput,
//! and a PNG plot of the curves (the last two with the default `train-ui` feature).

mod metrics;
#[cfg(feature = "train-ui")]
mod plot;
mod progress;

pub use metrics::{EpochMetrics, MetricsLog};
#[cfg(feature = "train-ui")]
pub use plot::plot_metrics;
pub use progress::EpochProgress;
