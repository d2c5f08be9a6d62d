//! The file flags every training example takes: `--out`, `--save`, `--resume`.

use clap::Args;
use mantissa::amp::GradScaler;
use mantissa::checkpoint;
use mantissa::nn::Module;
use mantissa::optim::Optimizer;
use mantissa::train::{check_writable_dir, check_writable_file, LossUnit, MetricsLog};
use mantissa::{Error, Result, Tensor};
use std::path::{Path, PathBuf};

/// Where a run writes its files and what it resumes from (`#[command(flatten)]`).
#[derive(Args, Debug)]
pub struct FileFlags {
    /// Folder for metrics.csv, curves.png and a profile's trace.json (default:
    /// runs/<example>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Save a checkpoint here after every epoch: the model, the optimizer's state, the loss
    /// scaler's and the epoch count (safetensors).
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Resume from a checkpoint written by --save: training goes on after its last epoch with
    /// the same schedule, and --out's metrics.csv is continued.
    #[arg(long)]
    pub resume: Option<PathBuf>,
}

impl FileFlags {
    /// The output folder (`--out`, else `default`), checked writable together with `--save`'s
    /// folder, and `--resume` checked to be a file: every path mistake is an error before the
    /// data is read or a step is run. `timing` names the mode the run is in when it times
    /// steps instead of training epochs ("--synthetic", say): `--save`/`--resume` are then
    /// refused.
    pub fn prepare(&self, default: &str, timing: Option<&str>) -> Result<PathBuf> {
        if let (Some(mode), true) = (timing, self.save.is_some() || self.resume.is_some()) {
            return Err(Error::Invalid {
                op: "--save/--resume",
                msg: format!("these are for training epochs; {mode} times steps and saves nothing"),
            });
        }
        let out = self.out.clone().unwrap_or_else(|| PathBuf::from(default));
        check_writable_dir(&out, "--out")?;
        if let Some(save) = &self.save {
            check_writable_file(save, "--save")?;
        }
        if let Some(resume) = &self.resume {
            if !resume.is_file() {
                let e =
                    std::io::Error::new(std::io::ErrorKind::NotFound, "no such checkpoint file");
                return Err(Error::Io {
                    op: "--resume",
                    path: resume.display().to_string(),
                    source: e,
                });
            }
        }
        Ok(out)
    }

    /// With `--resume`: loads the model's parameters and buffers, the optimizer's state (a
    /// checkpoint of another optimizer is refused) and an enabled loss scaler's state, and
    /// returns the number of epochs it had run with the metrics of those epochs from
    /// `out/metrics.csv` (when there is one). Without: `(0, an empty log in unit)`.
    pub fn resume(
        &self,
        out: &Path,
        net: &mut dyn Module,
        opt: &mut dyn Optimizer,
        scaler: &mut GradScaler,
        unit: LossUnit,
    ) -> Result<(usize, MetricsLog)> {
        let mut log = MetricsLog::with_unit(unit);
        let Some(path) = &self.resume else {
            return Ok((0, log));
        };
        let meta = load_training(path, net, opt, scaler)?;
        let epoch = match meta.get(EPOCH).map(|e| e.parse::<usize>()) {
            Some(Ok(e)) => e,
            _ => {
                return Err(format_error(
                    path,
                    "no epoch count in its metadata (not written by --save)".into(),
                ))
            }
        };
        let csv = out.join("metrics.csv");
        if let Ok(text) = std::fs::read_to_string(&csv) {
            log = MetricsLog::from_csv(&text, &csv)?;
            log.epochs.truncate(epoch);
            if log.loss_unit != unit {
                return Err(format_error(
                    &csv,
                    format!(
                        "its losses are in {:?}, this run's in {unit:?}",
                        log.loss_unit
                    ),
                ));
            }
        }
        println!("resumed from {} after epoch {epoch}", path.display());
        Ok((epoch, log))
    }

    /// With `--save`: writes the checkpoint after `epochs_done` epochs.
    pub fn save(
        &self,
        net: &dyn Module,
        opt: &dyn Optimizer,
        scaler: &GradScaler,
        epochs_done: usize,
    ) -> Result<()> {
        let Some(path) = &self.save else {
            return Ok(());
        };
        let extra: Vec<(String, Tensor)> = scaler
            .state_dict()?
            .into_iter()
            .map(|(n, t)| (format!("scaler.{n}"), t))
            .collect();
        checkpoint::save_with(
            path,
            net,
            Some(opt),
            &extra,
            &[(EPOCH, epochs_done.to_string())],
        )
    }
}

/// Loads a checkpoint written by [`FileFlags::save`]: the model, the optimizer's state and,
/// when `scaler` is enabled and the file has one, the loss scaler's. Returns the metadata.
pub fn load_training(
    path: &Path,
    net: &mut dyn Module,
    opt: &mut dyn Optimizer,
    scaler: &mut GradScaler,
) -> Result<std::collections::HashMap<String, String>> {
    let meta = checkpoint::load(path, net, Some(opt))?;
    let saved: Vec<(String, Tensor)> = checkpoint::read(path)?
        .0
        .into_iter()
        .filter_map(|(k, t)| k.strip_prefix("extra.scaler.").map(|n| (n.to_string(), t)))
        .collect();
    if scaler.is_enabled() && !saved.is_empty() {
        scaler.load_state_dict(&saved)?;
    }
    Ok(meta)
}

/// The checkpoint metadata key of the epochs run.
const EPOCH: &str = "epoch";

/// A `--resume` file that is not what a run wrote.
fn format_error(path: &Path, msg: String) -> Error {
    Error::Format {
        op: "--resume",
        path: path.display().to_string(),
        msg,
    }
}
