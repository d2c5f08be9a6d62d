//! What the training examples share: the run flags (device, precision, memory format, cuDNN
//! benchmark and determinism, loader workers, seed, profiling), the file flags (`files`), opening the device,
//! and `--profile`.

use clap::Args;
use mantissa::profiler::{Profiler, SortBy};
use mantissa::train::parse_precision;
use mantissa::{DType, Device, Error, MemoryFormat, Result, Tensor};
use std::path::{Path, PathBuf};

pub mod dist;
pub mod files;

/// Flags every training example takes (`#[command(flatten)]`).
#[derive(Args, Debug)]
pub struct RunFlags {
    /// auto, cpu or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// fp32, or fp16 / bf16: autocast (GEMMs and convolutions in the low dtype, f32
    /// parameters), with the dynamic loss scaler for fp16.
    #[arg(long, default_value = "fp32")]
    pub precision: String,
    /// Images and convolution weights in channels-last (NHWC) memory format, so convolutions
    /// run cuDNN's NHWC kernels on a GPU (PyTorch's `memory_format=torch.channels_last`).
    #[arg(long)]
    pub channels_last: bool,
    /// On a GPU: time cuDNN's convolution algorithms once per shape and keep the fastest
    /// (PyTorch's `cudnn.benchmark = True`).
    #[arg(long)]
    pub cudnn_benchmark: bool,
    /// On a GPU: deterministic convolution algorithms only, so that two runs of one seed
    /// give the same losses bit for bit (PyTorch's `cudnn.deterministic = True`): none that
    /// adds with atomics, with --cudnn-benchmark the fastest deterministic one, and the
    /// fused graphs of --fuse-conv-bn on deterministic engines or unfused.
    #[arg(long)]
    pub cudnn_deterministic: bool,
    /// On a GPU: training batch norm on channels-last input through cuDNN's NHWC batch norm
    /// (with its ReLU and residual-add fusions) instead of the engine's kernels.
    #[arg(long)]
    pub cudnn_batch_norm: bool,
    /// On a GPU: batch norm folded into f16 channels-last convolutions through cuDNN's graph
    /// API: their epilogues sum the output channels for the training batch norm after them
    /// (no statistics pass of its own), and a convolution that reads a batch norm's output
    /// applies its map in the weight gradient's prologue (`set_conv_bn_fusion`).
    #[arg(long)]
    pub fuse_conv_bn: bool,
    /// Keep every tensor a backward reads from the forward, as PyTorch does, instead of
    /// making batch norm outputs again in backward on a GPU (more memory, one pass less over
    /// each such output; `autograd::set_recompute`).
    #[arg(long)]
    pub keep_activations: bool,
    /// On a GPU: capture the whole training step (forward, backward, scaler, optimizer) as a
    /// CUDA graph after a few eager steps and replay it for every full batch
    /// (`mantissa::graph::CapturedStep`); the losses are those of the eager run.
    #[arg(long)]
    pub cuda_graph: bool,
    /// Gradient accumulation: an optimizer step every N batches, each batch's loss divided
    /// by N (the update of a batch N times as large, in the memory of one).
    #[arg(long, default_value_t = 1)]
    pub accumulate: usize,
    /// Data-loader worker threads.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Profile this many training steps after --profile-warmup steps: print the op and
    /// kernel table (top 25 by device time) and the per-step summary, and write trace.json
    /// (Perfetto, chrome://tracing) beside the metrics. Profiled steps are slower (two
    /// events per launch): throughput figures of a run that profiles are not benchmarks.
    #[arg(long, default_value_t = 0)]
    pub profile: usize,
    /// Steps run before the profiled ones (kernels compiled, algorithms chosen, caches warm).
    #[arg(long, default_value_t = 5)]
    pub profile_warmup: usize,
}

impl RunFlags {
    /// An error naming the convolution and batch-norm flags given to an example whose model
    /// has neither (rather than running as if they had not been given).
    #[allow(dead_code)] // The examples with convolutions do not call it.
    pub fn refuse_convolution_flags(&self, example: &'static str) -> Result<()> {
        let given: Vec<&str> = [
            (self.channels_last, "--channels-last"),
            (self.cudnn_benchmark, "--cudnn-benchmark"),
            (self.cudnn_deterministic, "--cudnn-deterministic"),
            (self.cudnn_batch_norm, "--cudnn-batch-norm"),
            (self.fuse_conv_bn, "--fuse-conv-bn"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect();
        if given.is_empty() {
            return Ok(());
        }
        Err(Error::Invalid {
            op: example,
            msg: format!(
                "{} {} to convolutions and batch norm; this model has neither",
                given.join(", "),
                if given.len() == 1 { "applies" } else { "apply" }
            ),
        })
    }

    /// The device (with its report printed, and cuDNN's switches set, on a GPU), the
    /// autocast dtype and the memory format the flags ask for.
    pub fn open(&self) -> Result<(Device, Option<DType>, MemoryFormat)> {
        // Launched by torchrun, srun or mpirun: cuda:LOCAL_RANK.
        let launched = dist::launched_device(&self.device)?;
        let device = match self.device.as_str() {
            _ if launched.is_some() => launched.expect("checked"),
            // The CPU when no GPU can be used, saying why (which library is missing, and
            // where it comes from).
            "auto" => Device::cuda(0).unwrap_or_else(|e| {
                eprintln!("--device auto: running on the CPU: {e}");
                Device::Cpu
            }),
            d => Device::parse(d)?.check_available()?,
        };
        #[cfg(feature = "cuda-backend")]
        if let Device::Cuda(n) = device {
            println!("{}", mantissa::backend::cuda::probe::report(n)?);
            mantissa::backend::cuda::conv::set_cudnn_benchmark(self.cudnn_benchmark);
            mantissa::backend::cuda::conv::set_cudnn_deterministic(self.cudnn_deterministic);
            mantissa::backend::cuda::dnn_norm::set_cudnn_batch_norm(self.cudnn_batch_norm);
            mantissa::backend::cuda::conv_stats::set_conv_bn_fusion(self.fuse_conv_bn);
        }
        if self.keep_activations {
            mantissa::autograd::set_recompute(mantissa::autograd::Recompute::Never);
        }
        let low = parse_precision(&self.precision, device)?;
        // The low dtype's kernels start compiling now, beside the f32 ones, while the model
        // is built (a first run on a machine compiles them; later ones read the cache).
        #[cfg(feature = "cuda-backend")]
        if let (Device::Cuda(n), Some(low)) = (device, low) {
            use mantissa::backend::cuda::{compile, kernels, runtime};
            compile::prefetch(runtime::runtime(n)?.arch(), &[kernels::part_for(low)]);
        }
        let format = match self.channels_last {
            true => MemoryFormat::ChannelsLast,
            false => MemoryFormat::Contiguous,
        };
        Ok((device, low, format))
    }
}

/// With --cuda-graph: the graph the example's training step is captured into and replayed
/// from (`mantissa::graph::StepGraph`, watching the parameters), else `None`. An error on the
/// CPU and with --accumulate (a graph holds one whole optimizer step).
pub fn step_graph(
    flags: &RunFlags,
    device: Device,
    params: &[Tensor],
    example: &'static str,
) -> Result<Option<mantissa::graph::StepGraph>> {
    if !flags.cuda_graph {
        return Ok(None);
    }
    if device == Device::Cpu || flags.accumulate != 1 {
        return Err(Error::Invalid {
            op: example,
            msg: "--cuda-graph needs a CUDA device and one optimizer step per batch (no \
                  --accumulate)"
                .into(),
        });
    }
    Ok(Some(mantissa::graph::StepGraph::new(device)?.watch(params)))
}

/// An example's `main`: parses its flags, runs `run` on the compute pool with freed host
/// memory kept mapped, says how long a GPU run waited for its kernels to compile, and prints
/// an error (exit status 1) instead of panicking.
pub fn main_with<A: clap::Parser + Send>(run: impl FnOnce(A) -> Result<()> + Send) {
    // The library's warnings (a dtype fallback, say) on stderr.
    let _ = log::set_logger(&StderrLog).map(|()| log::set_max_level(log::LevelFilter::Warn));
    mantissa::retain_freed_host_memory();
    let args = A::parse();
    let result = mantissa::in_compute_pool(|| run(args));
    // On a GPU: how long the run waited for its kernels to compile (the first run on a
    // machine; later ones read the disk cache).
    #[cfg(feature = "cuda-backend")]
    {
        let line = mantissa::backend::cuda::compile::summary();
        if !line.is_empty() {
            println!("{line}");
        }
    }
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

/// A `--batch-size`: a number, or `auto`, the largest batch whose training step fits in the
/// GPU's memory ([`mantissa::train::find_batch_size`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchSize {
    Auto,
    Fixed(usize),
}

impl std::str::FromStr for BatchSize {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<BatchSize, String> {
        match s {
            "auto" => Ok(BatchSize::Auto),
            n => match n.parse::<usize>() {
                Ok(0) | Err(_) => Err(format!(
                    "{n:?} is not a batch size (a number >= 1, or auto)"
                )),
                Ok(n) => Ok(BatchSize::Fixed(n)),
            },
        }
    }
}

impl BatchSize {
    /// The size to train with: the number given, or for `auto` the largest size up to `max`
    /// for which `trial` (a training step on a batch of that size that leaves no trace, such
    /// as [`mantissa::train::classifier_fits`]) runs on `device` without running out of
    /// memory.
    pub fn resolve(
        self,
        device: Device,
        max: usize,
        trial: impl FnMut(usize) -> Result<()>,
    ) -> Result<usize> {
        if let BatchSize::Fixed(n) = self {
            return Ok(n);
        }
        let search = mantissa::train::BatchSizeSearch { start: 8, max };
        let found = mantissa::train::find_batch_size(device, search, trial)?;
        let tried: Vec<String> = found
            .tried
            .iter()
            .map(|(b, fits)| format!("{b}{}", if *fits { "" } else { " (does not fit)" }))
            .collect();
        println!(
            "--batch-size auto: {} fits on {device} (tried {})",
            found.size,
            tried.join(", ")
        );
        Ok(found.size)
    }
}

/// `--profile N`: counts training steps, profiles steps `warmup + 1 ..= warmup + N`, then
/// prints the tables and writes `trace.json` into its folder.
pub struct StepProfile {
    want: usize,
    warmup: usize,
    seen: usize,
    running: Option<Profiler>,
    dir: PathBuf,
}

impl StepProfile {
    /// What `flags` ask for; `trace.json` goes into `dir`. Without warm-up steps the profile
    /// starts here, before the first step.
    pub fn new(flags: &RunFlags, dir: &Path) -> Result<StepProfile> {
        let start_now = flags.profile > 0 && flags.profile_warmup == 0;
        Ok(StepProfile {
            want: flags.profile,
            warmup: flags.profile_warmup,
            seen: 0,
            running: start_now.then(Profiler::start).transpose()?,
            dir: dir.to_path_buf(),
        })
    }

    /// Marks the end of a training step (call after the optimizer step).
    pub fn step(&mut self) -> Result<()> {
        if self.want == 0 {
            return Ok(());
        }
        self.seen += 1;
        match &self.running {
            Some(p) => {
                p.step();
                if self.seen == self.warmup + self.want {
                    self.finish()?;
                }
            }
            None if self.seen == self.warmup => self.running = Some(Profiler::start()?),
            None => {}
        }
        Ok(())
    }

    /// Reports a profile still running (training ended before its last step).
    pub fn finish(&mut self) -> Result<()> {
        let Some(p) = self.running.take() else {
            return Ok(());
        };
        let profile = p.stop()?;
        println!(
            "profile of {} steps after {} warm-up steps:",
            profile.steps().len(),
            self.warmup
        );
        println!("{}", profile.table(SortBy::DeviceTime, 25));
        println!("{}", profile.step_table());
        std::fs::create_dir_all(&self.dir).map_err(|e| mantissa::Error::Io {
            op: "--profile",
            path: self.dir.display().to_string(),
            source: e,
        })?;
        let trace = self.dir.join("trace.json");
        profile.export_chrome_trace(&trace)?;
        println!(
            "trace in {} (open it in Perfetto or chrome://tracing)",
            trace.display()
        );
        Ok(())
    }
}

/// On a GPU: the allocator's peak allocated and reserved memory so far (`label: peak ...`),
/// the line the PyTorch peers print from `torch.cuda.max_memory_allocated`.
pub fn print_peak_memory(label: &str, device: Device) -> Result<()> {
    #[cfg(feature = "cuda-backend")]
    if let Device::Cuda(n) = device {
        let s = mantissa::backend::cuda::runtime::runtime(n)?.memory_stats();
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        println!(
            "{label}: peak allocated {:.1} MiB, reserved {:.1} MiB",
            mib(s.peak_allocated),
            mib(s.peak_reserved)
        );
    }
    let _ = (label, device);
    Ok(())
}

/// Prints log records at warning level and above on stderr.
struct StderrLog;

impl log::Log for StderrLog {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= log::Level::Warn
    }
    fn log(&self, r: &log::Record) {
        if self.enabled(r.metadata()) {
            eprintln!("{}: {}", r.level().as_str().to_lowercase(), r.args());
        }
    }
    fn flush(&self) {}
}
