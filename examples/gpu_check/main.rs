//! Prints the CUDA device report and runs quick checks of the CUDA backend: every kernel file
//! compiled by NVRTC for this GPU and loaded, a few kernels against the CPU backend, a GEMM
//! TFLOP/s figure (cuBLAS), a host-to-device copy bandwidth, one training step against the
//! CPU, a convolution timed in NCHW and channels-last, M2: elementwise forward and backward
//! bandwidth beside the device-to-device copy, M5: ResNet-50's pooling and batch norm
//! passes at its own shapes, in the same terms, and M6: its convolutions followed by training
//! batch norm, with the statistics from a pass and from the convolution's epilogue.
//!
//! `cargo run --release --example gpu_check` (needs the `cuda` feature, on by default). On a
//! machine without a usable GPU it says what is missing and exits with status 2 (nothing was
//! checked); a failed check exits with 1. `-- --quick` uses small
//! GEMM and convolution sizes: a dry run on the emulated device (tests/emulator), whose
//! figures mean nothing.

use cudarc::cublas::{sys as bs, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    sys, CudaContext, CudaModule, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use mantissa::amp::{GradScaler, GradScalerConfig};
use mantissa::backend::cuda::{compile, kernels, probe};
use mantissa::optim::{Adam, AdamConfig, Optimizer, Rounding, Sgd, SgdConfig};
use mantissa::{bf16, f16, DType, Device, Generator, Tensor};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

mod bandwidth;
mod engine;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn cfg(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(256).min(65_535), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn rel(a: &[f64], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-300)).sqrt()
}

fn randn(n: usize, seed: u64) -> Res<Vec<f32>> {
    let t = Tensor::randn_with(
        &[n],
        0.0,
        1.0,
        DType::F32,
        Device::Cpu,
        &mut Generator::new(seed),
    )?;
    Ok(t.to_vec::<f32>()?)
}

/// Kernel `name` of file `file` from the loaded parts (the part its name says).
fn function(
    modules: &HashMap<(&str, usize), Arc<CudaModule>>,
    file: &str,
    name: &str,
) -> Res<cudarc::driver::CudaFunction> {
    Ok(modules[&(file, kernels::part_of(name))].load_function(name)?)
}

fn check_kernels(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>, arch: u32) -> Res<()> {
    // Every part of every file, compiled in parallel as a run's first requests would start
    // them (or read from the disk cache), then loaded.
    let t0 = Instant::now();
    compile::prefetch(arch, &(0..compile::PARTS).collect::<Vec<_>>());
    let mut modules = HashMap::new();
    for (name, _) in kernels::KERNELS {
        for part in 0..compile::PARTS {
            let bin = compile::cubin(name, part, arch)?;
            modules.insert(
                (*name, part),
                ctx.load_module(Ptx::from_binary(bin.to_vec()))?,
            );
        }
    }
    let records = compile::records();
    let cached = records.iter().filter(|r| r.cached).count();
    println!(
        "kernels: {} files in {} parts compiled for sm_{arch} ({cached} from the disk cache) \
         and loaded in {:.2} s, in parallel",
        kernels::KERNELS.len(),
        modules.len(),
        t0.elapsed().as_secs_f64()
    );
    let per_file: Vec<String> = kernels::KERNELS
        .iter()
        .map(|(name, _)| {
            let mut mine: Vec<_> = records.iter().filter(|r| r.file == *name).collect();
            mine.sort_by_key(|r| r.part);
            let parts: Vec<String> = mine.iter().map(|r| format!("{:.2}", r.seconds)).collect();
            format!("{name} {}", parts.join("/"))
        })
        .collect();
    println!(
        "kernels: seconds per part (f32/f16/bf16): {}",
        per_file.join(", ")
    );
    let n = 1 << 20;
    let x = randn(n, 1)?;

    // Cast f32 -> bf16 must round exactly as the CPU does.
    let f = function(&modules, "cast", "cast_float_bf16")?;
    let dx = stream.clone_htod(&x)?;
    let mut dy = stream.alloc_zeros::<bf16>(n)?;
    let nn = n as i64;
    let mut b = stream.launch_builder(&f);
    b.arg(&dx).arg(&mut dy).arg(&nn);
    unsafe { b.launch(cfg(n)) }?;
    let got = stream.clone_dtoh(&dy)?;
    let same = got
        .iter()
        .zip(&x)
        .filter(|(g, x)| g.to_bits() == bf16::from_f32(**x).to_bits())
        .count();
    println!("cast f32->bf16: {same}/{n} bit-identical to the CPU");

    // GELU (erf) against the CPU backend.
    let f = function(&modules, "elementwise", "unary_float")?;
    let mut dg = stream.alloc_zeros::<f32>(n)?;
    let (op, a0, b0) = (14i32, 0.0f32, 0.0f32);
    let mut b = stream.launch_builder(&f);
    b.arg(&op).arg(&a0).arg(&b0).arg(&dx).arg(&mut dg).arg(&nn);
    unsafe { b.launch(cfg(n)) }?;
    let got: Vec<f64> = stream.clone_dtoh(&dg)?.iter().map(|&v| v as f64).collect();
    let want = Tensor::from_vec(x.clone(), &[n], Device::Cpu)?
        .gelu()?
        .to_vec_f64()?;
    println!("gelu f32: relative error vs CPU {:.2e}", rel(&got, &want));

    // AdamW with f32 master, bf16 working copy, stochastic rounding: one step through the
    // engine (the fused update's launcher and kernel) on the GPU against the CPU.
    let adamw = |device: Device| -> Res<(Vec<f64>, Vec<u16>, f64)> {
        let w = Tensor::from_vec(x.clone(), &[n], Device::Cpu)?
            .to_dtype(DType::BF16)?
            .to_device(device)?
            .requires_grad(true)?;
        let g16 = Tensor::from_vec(randn(n, 2)?, &[n], Device::Cpu)?
            .to_dtype(DType::BF16)?
            .to_device(device)?;
        let mut opt = Adam::new(vec![w.clone()], AdamConfig::adamw(1e-3))?;
        opt.use_master_weights(Rounding::Stochastic { seed: 7 })?;
        w.set_grad(Some(g16))?;
        opt.step()?;
        let state = &opt.states()[0].tensors;
        let bits = w.to_vec::<bf16>()?.iter().map(|v| v.to_bits()).collect();
        Ok((state["master"].to_vec_f64()?, bits, state["step"].item()?))
    };
    let (cpu_master, cpu_w, _) = adamw(Device::Cpu)?;
    let (gm, gw, steps) = adamw(Device::cuda(0)?)?;
    let same = gw.iter().zip(&cpu_w).filter(|(a, b)| a == b).count();
    println!(
        "AdamW master step (engine, GPU vs CPU): master relative error {:.2e}; bf16 copies {same}/{n} bit-identical; step count {steps}",
        rel(&gm, &cpu_master)
    );

    // The loss scaler through the engine (cuda/amp.cu's fused unscale and scale update): an
    // inf among the gradients skips the step, leaving the parameters as they were, and halves
    // the scale, with nothing read back until the check below.
    let gpu = Device::cuda(0)?;
    let w = Tensor::from_vec(x[..1024].to_vec(), &[1024], Device::Cpu)?
        .to_device(gpu)?
        .requires_grad(true)?;
    let mut c = vec![1.0f32; 1024];
    c[512] = f32::INFINITY;
    let c = Tensor::from_vec(c, &[1024], Device::Cpu)?.to_device(gpu)?;
    let mut opt = Sgd::new(vec![w.clone()], SgdConfig::new(0.1))?;
    let mut scaler = GradScaler::new(GradScalerConfig {
        init_scale: 1024.0,
        ..Default::default()
    })?;
    let before = w.to_vec::<f32>()?;
    scaler.scale(&w.mul(&c)?.sum_all()?)?.backward()?;
    scaler.step(&mut opt)?;
    scaler.update()?;
    println!(
        "GradScaler (engine): step skipped {}, scale {} (expected true, 512)",
        w.to_vec::<f32>()? == before,
        scaler.current_scale()?.unwrap_or(f64::NAN)
    );

    // Dropout: the same generator state gives the same mask as the CPU, element for element.
    let p = 0.3;
    let mut gen = Generator::new(11);
    gen.next_u32s(8);
    let cpu = Tensor::ones(&[n], DType::F32, Device::Cpu)?
        .dropout_with(p, true, &mut gen)?
        .to_vec::<f32>()?;
    let f = function(&modules, "random", "dropout_mask_float")?;
    let (seed, start) = (11u64, 2u64);
    let threshold = (p * 4_294_967_296.0f64).ceil() as u64;
    let scale = (1.0 / (1.0 - p)) as f32;
    let mut dm = stream.alloc_zeros::<f32>(n)?;
    let mut b = stream.launch_builder(&f);
    b.arg(&seed).arg(&start).arg(&threshold).arg(&scale);
    // No generator state in device memory (a CUDA graph's replay passes one).
    let state = 0u64;
    b.arg(&mut dm).arg(&nn).arg(&state);
    unsafe { b.launch(cfg(n / 4)) }?;
    let got = stream.clone_dtoh(&dm)?;
    let same = got.iter().zip(&cpu).filter(|(a, b)| a == b).count();
    println!("dropout mask p={p}: {same}/{n} identical to the CPU");
    Ok(())
}

/// The runtime's caching allocator: a freed block comes back from the cache, and a request
/// larger than the device is an `Err` naming the request and the statistics.
fn check_allocator(total: usize) -> Res<()> {
    let rt = mantissa::backend::cuda::runtime::runtime(0)?;
    let (p, _) = rt.alloc(256 << 20)?;
    rt.free(p)?;
    let (q, _) = rt.alloc(256 << 20)?;
    println!("allocator: block reused {}; {}", p == q, rt.memory_stats());
    rt.free(q)?;
    match rt.alloc(2 * total) {
        Err(e) => println!("allocator: 2x device memory -> Err: {e}"),
        Ok(_) => println!("allocator: 2x device memory was granted (unexpected)"),
    }
    Ok(())
}

/// TFLOP/s of an `n^3` cuBLAS GEMM (M1 of BENCHMARKS.md): median of 10 event-timed runs after
/// 3 warm-ups, on N(0, 1) operands; f32 with TF32 tensor cores allowed.
fn gemm_tflops<T>(stream: &Arc<CudaStream>, n: usize, to: impl Fn(f32) -> T) -> Res<f64>
where
    T: DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy + From<u8>,
    CudaBlas: Gemm<T>,
{
    let blas = CudaBlas::new(stream.clone())?;
    // SAFETY: a valid handle; TF32 only affects f32 GEMMs (the M1 "f32 with TF32" row).
    unsafe { bs::cublasSetMathMode(*blas.handle(), bs::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH) }
        .result()?;
    let host: Vec<T> = randn(n * n, 5)?.into_iter().map(&to).collect();
    let a = stream.clone_htod(&host)?;
    let bm = stream.clone_htod(&host)?;
    let mut c = stream.alloc_zeros::<T>(n * n)?;
    let op = bs::cublasOperation_t::CUBLAS_OP_N;
    let g = GemmConfig {
        transa: op,
        transb: op,
        m: n as i32,
        n: n as i32,
        k: n as i32,
        alpha: T::from(1),
        lda: n as i32,
        ldb: n as i32,
        beta: T::from(0),
        ldc: n as i32,
    };
    for _ in 0..3 {
        unsafe { blas.gemm(g, &a, &bm, &mut c) }?;
    }
    let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut times = Vec::new();
    for _ in 0..10 {
        let t0 = stream.record_event(flags)?;
        unsafe { blas.gemm(g, &a, &bm, &mut c) }?;
        let t1 = stream.record_event(flags)?;
        times.push(t0.elapsed_ms(&t1)? as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(2.0 * (n as f64).powi(3) / (times[5] * 1e-3) / 1e12)
}

fn copy_gbs(stream: &Arc<CudaStream>) -> Res<f64> {
    let host = vec![1.0f32; 64 << 20]; // 256 MB
    let mut dev = stream.alloc_zeros::<f32>(host.len())?;
    stream.memcpy_htod(&host, &mut dev)?;
    stream.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..5 {
        stream.memcpy_htod(&host, &mut dev)?;
    }
    stream.synchronize()?;
    Ok(5.0 * 256e6 / t0.elapsed().as_secs_f64() / 1e9)
}

const HELP: &str = "gpu_check: the CUDA device report and quick checks of the CUDA backend
(kernels against the CPU, GEMM rate, host-to-device copies, a training step, M2 bandwidth).

usage: gpu_check [--quick] [--attention]
  --quick       small GEMM and convolution sizes (a dry run; the figures mean nothing)
  --attention   the device report and the attention timings only (the fused op through
                cuDNN's fused attention and on the engine's own kernels, against the
                composition)

exit status: 0 every check ran and passed; 1 a check failed; 2 no usable CUDA device, so
nothing was checked.";

fn main() {
    if std::env::args().skip(1).any(|a| a == "--help" || a == "-h") {
        println!("{HELP}");
        return;
    }
    let report = match probe::report(0) {
        Ok(r) => r,
        Err(e) => {
            // Nothing was checked: a failure, so that a script that runs this on a machine
            // whose GPU cannot be used does not read it as a pass.
            eprintln!("no usable CUDA device: {e}");
            std::process::exit(2);
        }
    };
    println!("{report}");
    let quick = std::env::args().skip(1).any(|a| a == "--quick");
    if std::env::args().skip(1).any(|a| a == "--attention") {
        let d = Device::cuda(0).and_then(|d| engine::attention(d, quick));
        match d {
            Ok(line) => println!("{line}"),
            Err(e) => {
                eprintln!("gpu_check failed: {e}");
                std::process::exit(1);
            }
        }
        return;
    }
    let run = || -> Res<()> {
        let ctx = CudaContext::new(0)?;
        let stream = ctx.default_stream();
        let (ma, mi) = report.compute_capability;
        check_kernels(&ctx, &stream, (ma * 10 + mi) as u32)?;
        check_allocator(report.total_memory)?;
        let n = if quick { 128 } else { 8192 };
        let bf = gemm_tflops(&stream, n, bf16::from_f32)?;
        let hf = gemm_tflops(&stream, n, f16::from_f32)?;
        let tf = gemm_tflops(&stream, n, |x| x)?;
        println!(
            "GEMM {n}^3 (cuBLAS, f32 accumulate): bf16 {bf:.0} TFLOP/s, fp16 {hf:.0} TFLOP/s, f32 with TF32 {tf:.0} TFLOP/s"
        );
        println!(
            "host-to-device copy, pageable 256 MB: {:.1} GB/s",
            copy_gbs(&stream)?
        );
        let d = Device::cuda(0)?;
        println!("{}", engine::transfers(0)?);
        println!("{}", engine::training_step(d)?);
        println!("{}", engine::conv_formats(d, quick)?);
        println!("{}", engine::attention(d, quick)?);
        println!("{}", bandwidth::elementwise(d, quick)?);
        println!("{}", bandwidth::resnet_passes(d, quick)?);
        println!("{}", bandwidth::conv_bn_fusion(d, quick)?);
        Ok(())
    };
    if let Err(e) = run() {
        eprintln!("gpu_check failed: {e}");
        std::process::exit(1);
    }
}
