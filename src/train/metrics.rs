//! Per-epoch metrics and their CSV file.

use crate::{Error, Result};
use std::path::Path;

/// What one epoch measured.
#[derive(Debug, Clone, PartialEq)]
pub struct EpochMetrics {
    pub epoch: usize,
    pub train_loss: f64,
    pub train_acc: f64,
    pub test_loss: f64,
    pub test_acc: f64,
    pub lr: f64,
    pub seconds: f64,
    pub samples_per_s: f64,
}

/// The metrics of a run, in epoch order.
#[derive(Debug, Clone, Default)]
pub struct MetricsLog {
    pub epochs: Vec<EpochMetrics>,
}

const HEADER: &str = "epoch,train_loss,train_acc,test_loss,test_acc,lr,seconds,samples_per_s";

impl MetricsLog {
    pub fn push(&mut self, m: EpochMetrics) {
        self.epochs.push(m);
    }

    /// The CSV text (a header and one line per epoch).
    pub fn to_csv(&self) -> String {
        let mut s = format!("{HEADER}\n");
        for m in &self.epochs {
            s += &format!(
                "{},{:.6},{:.6},{:.6},{:.6},{:.6e},{:.3},{:.1}\n",
                m.epoch,
                m.train_loss,
                m.train_acc,
                m.test_loss,
                m.test_acc,
                m.lr,
                m.seconds,
                m.samples_per_s
            );
        }
        s
    }

    /// Writes the CSV atomically.
    pub fn write_csv(&self, path: &Path) -> Result<()> {
        crate::fs::write_atomic(path, self.to_csv().as_bytes())
    }

    /// Parses a CSV written by [`MetricsLog::to_csv`] (to continue a resumed run's log).
    pub fn from_csv(text: &str, path: &Path) -> Result<MetricsLog> {
        let mut lines = text.lines();
        if lines.next() != Some(HEADER) {
            return Err(Error::format("metrics", path, "unexpected CSV header"));
        }
        let epochs = lines
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                let f: Vec<f64> = l
                    .split(',')
                    .map(|x| x.parse::<f64>())
                    .collect::<std::result::Result<_, _>>()
                    .map_err(|e| Error::format("metrics", path, format!("bad line {l:?}: {e}")))?;
                if f.len() != 8 {
                    return Err(Error::format("metrics", path, format!("bad line {l:?}")));
                }
                Ok(EpochMetrics {
                    epoch: f[0] as usize,
                    train_loss: f[1],
                    train_acc: f[2],
                    test_loss: f[3],
                    test_acc: f[4],
                    lr: f[5],
                    seconds: f[6],
                    samples_per_s: f[7],
                })
            })
            .collect::<Result<_>>()?;
        Ok(MetricsLog { epochs })
    }
}
