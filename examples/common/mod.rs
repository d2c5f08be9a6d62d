//! What the training examples share: the run flags (device, precision, memory format, cuDNN
//! benchmark, loader workers, seed) and opening the device.

use clap::Args;
use mantissa::train::parse_precision;
use mantissa::{DType, Device, MemoryFormat, Result};

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
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub cudnn_benchmark: bool,
    /// Data-loader worker threads.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

impl RunFlags {
    /// The device (with its report printed, and cuDNN's benchmark mode set, on a GPU), the
    /// autocast dtype and the memory format the flags ask for.
    pub fn open(&self) -> Result<(Device, Option<DType>, MemoryFormat)> {
        let device = match self.device.as_str() {
            "auto" => Device::best(),
            d => Device::parse(d)?.check_available()?,
        };
        #[cfg(feature = "cuda")]
        if let Device::Cuda(n) = device {
            println!("{}", mantissa::backend::cuda::probe::report(n)?);
            mantissa::backend::cuda::conv::set_cudnn_benchmark(self.cudnn_benchmark);
        }
        let low = parse_precision(&self.precision, device)?;
        let format = match self.channels_last {
            true => MemoryFormat::ChannelsLast,
            false => MemoryFormat::Contiguous,
        };
        Ok((device, low, format))
    }
}

/// An example's `main`: parses its flags, runs `run` on the compute pool with freed host
/// memory kept mapped, and prints an error (exit status 1) instead of panicking.
pub fn main_with<A: clap::Parser + Send>(run: impl FnOnce(A) -> Result<()> + Send) {
    mantissa::retain_freed_host_memory();
    let args = A::parse();
    if let Err(e) = mantissa::in_compute_pool(|| run(args)) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
