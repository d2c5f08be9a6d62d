//! Per-epoch metrics and their CSV file.

use crate::memory::MemoryStats;
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
    /// The device's memory at the epoch's end, on a GPU ([`crate::memory::memory_stats`]:
    /// the peak is the run's so far, as `torch.cuda.max_memory_allocated` reports it unless
    /// reset); `None` on the CPU. The CSV keeps allocated, reserved and peak allocated.
    pub memory: Option<MemoryStats>,
}

/// The metrics of a run, in epoch order.
#[derive(Debug, Clone, Default)]
pub struct MetricsLog {
    pub epochs: Vec<EpochMetrics>,
    /// What the losses are measured in: named by the CSV's loss columns and the plot's axis.
    pub loss_unit: LossUnit,
}

/// The unit of a [`MetricsLog`]'s losses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LossUnit {
    /// Cross-entropy in nats (natural log), as `cross_entropy` returns it: CSV columns
    /// `train_loss` and `test_loss`.
    #[default]
    Nats,
    /// Cross-entropy per character in bits (nats / ln 2), a language model's usual figure:
    /// CSV columns `train_bits_per_char` and `test_bits_per_char`.
    BitsPerChar,
}

impl LossUnit {
    /// The loss columns' name after `train_` / `test_`.
    fn column(self) -> &'static str {
        match self {
            LossUnit::Nats => "loss",
            LossUnit::BitsPerChar => "bits_per_char",
        }
    }

    /// The plot's loss axis.
    pub fn axis(self) -> &'static str {
        match self {
            LossUnit::Nats => "loss (nats)",
            LossUnit::BitsPerChar => "loss (bits/char)",
        }
    }

    /// A loss in nats in this unit.
    pub fn from_nats(self, nats: f64) -> f64 {
        match self {
            LossUnit::Nats => nats,
            LossUnit::BitsPerChar => nats / std::f64::consts::LN_2,
        }
    }
}

/// The CSV header of `unit`, with the memory columns or without them (files written before
/// device memory was logged still read).
fn header(unit: LossUnit, memory: bool) -> String {
    let c = unit.column();
    let mut h = format!("epoch,train_{c},train_acc,test_{c},test_acc,lr,seconds,samples_per_s");
    if memory {
        h += ",allocated_mib,reserved_mib,peak_allocated_mib";
    }
    h
}

const MIB: f64 = (1u64 << 20) as f64;

impl MetricsLog {
    /// An empty log whose losses are in `unit`.
    pub fn with_unit(unit: LossUnit) -> MetricsLog {
        MetricsLog {
            epochs: Vec::new(),
            loss_unit: unit,
        }
    }

    /// Appends an epoch (its losses already in [`MetricsLog::loss_unit`]).
    pub fn push(&mut self, m: EpochMetrics) {
        self.epochs.push(m);
    }

    /// The CSV text (a header and one line per epoch).
    pub fn to_csv(&self) -> String {
        let mut s = format!("{}\n", header(self.loss_unit, true));
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
            // The memory columns, empty on the CPU.
            let mib = |b: usize| format!("{:.1}", b as f64 / MIB);
            let mem = match m.memory {
                Some(st) => [st.allocated, st.reserved, st.peak_allocated].map(mib),
                None => Default::default(),
            };
            s.pop();
            s += &format!(",{}\n", mem.join(","));
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
        let first = lines.next().unwrap_or("");
        let units = [LossUnit::Nats, LossUnit::BitsPerChar];
        let (loss_unit, columns) = units
            .iter()
            .flat_map(|&u| [(u, 11, true), (u, 8, false)])
            .find(|&(u, _, memory)| first == header(u, memory))
            .map(|(u, n, _)| (u, n))
            .ok_or_else(|| {
                Error::format(
                    "metrics",
                    path,
                    format!(
                        "unexpected CSV header {first:?} (expected {:?})",
                        header(LossUnit::Nats, true)
                    ),
                )
            })?;
        let epochs = lines
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                let bad =
                    |why: String| Error::format("metrics", path, format!("bad line {l:?}{why}"));
                let fields: Vec<&str> = l.split(',').collect();
                if fields.len() != columns {
                    return Err(bad(format!(": {} fields, not {columns}", fields.len())));
                }
                // Empty memory fields (a CPU run) read as NaN, then as no memory.
                let f: Vec<f64> = fields
                    .iter()
                    .map(|x| match x.is_empty() {
                        true => Ok(f64::NAN),
                        false => x.parse::<f64>(),
                    })
                    .collect::<std::result::Result<_, _>>()
                    .map_err(|e| bad(format!(": {e}")))?;
                if f[..8].iter().any(|v| v.is_nan()) {
                    return Err(bad(": an empty field".into()));
                }
                let memory = match f.get(8..11) {
                    Some(m) if m.iter().all(|v| v.is_finite() && *v >= 0.0) => {
                        let bytes = |v: f64| (v * MIB).round() as usize;
                        Some(MemoryStats {
                            allocated: bytes(m[0]),
                            reserved: bytes(m[1]),
                            peak_allocated: bytes(m[2]),
                            ..Default::default()
                        })
                    }
                    _ => None,
                };
                Ok(EpochMetrics {
                    epoch: f[0] as usize,
                    train_loss: f[1],
                    train_acc: f[2],
                    test_loss: f[3],
                    test_acc: f[4],
                    lr: f[5],
                    seconds: f[6],
                    samples_per_s: f[7],
                    memory,
                })
            })
            .collect::<Result<_>>()?;
        Ok(MetricsLog { epochs, loss_unit })
    }
}
