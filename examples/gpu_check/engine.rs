//! Checks through the engine's public API: one training step on the GPU against the same
//! step on the CPU, the time of a ResNet-style convolution in NCHW and channels-last, and the
//! fused attention against its composition.

use mantissa::backend::cuda::conv::set_cudnn_benchmark;
use mantissa::nn::*;
use mantissa::optim::{Adam, AdamConfig, Optimizer};
use mantissa::*;
use std::time::Instant;

/// The MNIST CNN's first layers and head (smaller hidden layer), f32, seeded.
fn cnn(d: Device) -> Result<Sequential> {
    let mut gen = Generator::new(3);
    let mut net = Sequential::new()
        .push(Conv2d::new(1, 32, 3, Default::default(), true, &mut gen)?)
        .push(Activation::Relu)
        .push(Conv2d::new(32, 64, 3, Default::default(), true, &mut gen)?)
        .push(Activation::Relu)
        .push(MaxPool2d(MaxPool2dOptions::new(2)))
        .push(Flatten)
        .push(Linear::new(9216, 32, true, &mut gen)?)
        .push(Activation::Relu)
        .push(Linear::new(32, 10, true, &mut gen)?);
    net.to_device(d)?;
    Ok(net)
}

/// Loss and parameters after one f32 Adam step of the CNN on `d`.
fn step_on(d: Device) -> Result<(f64, Vec<f64>)> {
    let net = cnn(d)?;
    let mut opt = Adam::new(net.parameters(), AdamConfig::adam(1e-3))?;
    let mut gen = Generator::new(4);
    let x = Tensor::randn_with(
        &[16, 1, 28, 28],
        0.0,
        1.0,
        DType::F32,
        Device::Cpu,
        &mut gen,
    )?;
    let y: Vec<i64> = (0..16).map(|i| i % 10).collect();
    let y = Tensor::from_vec(y, &[16], Device::Cpu)?;
    let loss = net
        .forward(&x.to_device(d)?)?
        .cross_entropy(&y.to_device(d)?, Default::default())?;
    loss.backward()?;
    opt.step()?;
    let mut params = Vec::new();
    for p in net.parameters() {
        params.extend(p.to_vec_f64()?);
    }
    Ok((loss.item()?, params))
}

/// One training step (forward, backward, Adam) on the GPU and on the CPU from the same
/// weights and batch, in exact f32 (TF32 off by default).
pub fn training_step(d: Device) -> Result<String> {
    use mantissa::backend::cuda::conv::{cudnn_allow_tf32, set_cudnn_allow_tf32};
    let (cpu_loss, cpu) = step_on(Device::Cpu)?;
    // Exact f32 convolutions, so that the difference measures the engine, not TF32's
    // rounding (on by default for convolutions, as in PyTorch).
    let tf32 = cudnn_allow_tf32();
    set_cudnn_allow_tf32(false);
    let gpu_step = step_on(d);
    set_cudnn_allow_tf32(tf32);
    let (gpu_loss, gpu) = gpu_step?;
    let (num, den) = cpu.iter().zip(&gpu).fold((0.0, 0.0), |(n, s), (a, b)| {
        (n + (a - b) * (a - b), s + a * a)
    });
    Ok(format!(
        "training step (CNN, f32, Adam): loss CPU {cpu_loss:.6} GPU {gpu_loss:.6}; parameters after the step differ by {:.1e} (norm-wise)",
        (num / den).sqrt()
    ))
}

/// Milliseconds per forward + backward of a 3x3 c -> c convolution on `[n, c, h, h]` f16
/// (`[64, 64, 56, 56]`: a ResNet stage-1 layer), input in `format`: median of 5 timings of 10
/// iterations each, after warm-up, with cuDNN's benchmark mode.
fn conv_ms(d: Device, format: MemoryFormat, [n, c, h]: [usize; 3]) -> Result<f64> {
    let mut gen = Generator::new(6);
    let x = Tensor::randn_with(&[n, c, h, h], 0.0, 1.0, DType::F16, d, &mut gen)?
        .to_memory_format(format)?
        .requires_grad(true)?;
    let w = Tensor::randn_with(&[c, c, 3, 3], 0.0, 0.05, DType::F16, d, &mut gen)?
        .requires_grad(true)?;
    let g = Tensor::randn_with(&[n, c, h, h], 0.0, 1.0, DType::F16, d, &mut gen)?
        .to_memory_format(format)?;
    let opts = Conv2dOptions {
        padding: [1, 1],
        ..Default::default()
    };
    let iteration = || -> Result<()> {
        x.conv2d(&w, None, opts)?.backward_with(&g)?;
        x.zero_grad();
        w.zero_grad();
        Ok(())
    };
    median_ms(iteration, &w)
}

/// The median of five timings of ten `iteration`s after three warm-up ones, in ms per
/// iteration; reading a value of `sync` waits for the queued work.
fn median_ms(iteration: impl Fn() -> Result<()>, sync: &Tensor) -> Result<f64> {
    for _ in 0..3 {
        iteration()?;
    }
    sync.sum_all()?.item()?;
    let mut times = Vec::new();
    for _ in 0..5 {
        let t0 = Instant::now();
        for _ in 0..10 {
            iteration()?;
        }
        sync.sum_all()?.item()?;
        times.push(t0.elapsed().as_secs_f64() * 1e3 / 10.0);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[2])
}

/// Attention forward + backward: the fused op through cuDNN's fused attention, the fused op
/// on the engine's own kernels (cuDNN switched off: `set_cudnn_attention`), and the
/// composition (`set_attention_kernel`), their agreement, and the bytes each forward keeps
/// for backward; in f16 on [4, 16, 2048, 64], then causal in bf16 on GPT-2's [16, 12, 1024,
/// 64] with each one's rate (`quick`: [1, 2, 40, 16] and [1, 2, 40, 64]). At head size 64
/// in f16 and bf16 the engine's own fused op is the tensor-core kernels of `cuda/flash.cu`.
pub fn attention(d: Device, quick: bool) -> Result<String> {
    let (wide, gpt) = if quick {
        ([1, 2, 40, 16], [1, 2, 40, 64])
    } else {
        ([4, 16, 2048, 64], [16, 12, 1024, 64])
    };
    Ok(format!(
        "{}\n{}",
        attention_case(d, wide, DType::F16, false)?,
        attention_case(d, gpt, DType::BF16, true)?
    ))
}

/// How [`attention_case`] runs the attention.
#[derive(Clone, Copy, PartialEq)]
enum Path {
    Cudnn,
    Own,
    Composed,
}

impl Path {
    /// Sets the switches for this path; `Auto` and cuDNN back after `f`.
    fn run<R>(self, f: impl FnOnce() -> R) -> R {
        set_cudnn_attention(self == Path::Cudnn);
        set_attention_kernel(if self == Path::Composed {
            AttentionKernel::Composed
        } else {
            AttentionKernel::Fused
        });
        let r = f();
        set_attention_kernel(AttentionKernel::Auto);
        set_cudnn_attention(true);
        r
    }
}

fn attention_case(d: Device, [n, h, l, e]: [usize; 4], dt: DType, causal: bool) -> Result<String> {
    let mut gen = Generator::new(7);
    let mut make = || Tensor::randn_with(&[n, h, l, e], 0.0, 1.0, dt, d, &mut gen);
    let [q, k, v] = [make()?, make()?, make()?].map(|t| t.requires_grad(true));
    let (q, k, v) = (q?, k?, v?);
    let g = make()?;
    let opts = AttentionOptions {
        is_causal: causal,
        ..Default::default()
    };
    let run = |path: Path| -> Result<Tensor> {
        path.run(|| q.scaled_dot_product_attention(&k, &v, opts))
    };
    let kept = |path: Path| -> Result<u64> {
        let before = live_storage_bytes();
        let y = run(path)?;
        let bytes = live_storage_bytes().saturating_sub(before);
        drop(y);
        Ok(bytes)
    };
    let (fused_kept, composed_kept) = (kept(Path::Own)?, kept(Path::Composed)?);
    let c = run(Path::Composed)?.to_dtype(DType::F32)?;
    let rel = |path: Path| -> Result<f64> {
        let a = run(path)?.to_dtype(DType::F32)?;
        Ok(a.sub(&c)?.sqr()?.sum_all()?.sqrt()?.item()? / c.sqr()?.sum_all()?.sqrt()?.item()?)
    };
    let step = |path: Path| -> Result<()> {
        path.run(|| {
            q.scaled_dot_product_attention(&k, &v, opts)?
                .backward_with(&g)
        })?;
        [&q, &k, &v].iter().for_each(|t| t.zero_grad());
        Ok(())
    };
    // Whether cuDNN ran both directions (it declines what it does not take).
    let (_, p) = profiler::profile(|_| step(Path::Cudnn))?;
    let calls = |dir: &str| {
        p.kernels()
            .iter()
            .filter(|k| k.name.starts_with(dir))
            .count()
    };
    let by_cudnn = match (calls("cudnn sdpa fwd"), calls("cudnn sdpa bwd")) {
        (1, 1) => "forward and backward",
        (1, _) => "forward only",
        _ => "neither (declined)",
    };
    let cudnn = median_ms(|| step(Path::Cudnn), &q)?;
    let own = median_ms(|| step(Path::Own), &q)?;
    let composed = median_ms(|| step(Path::Composed), &q)?;
    let mib = |b: u64| b as f64 / 1048576.0;
    // FlashAttention's count: 4 n h l^2 e forward (two products), 2.5 times that backward,
    // halved when causal.
    let flops = 3.5 * 4.0 * (n * h * e) as f64 * (l * l) as f64 / if causal { 2.0 } else { 1.0 };
    let rate = |ms: f64| flops / ms / 1e9;
    Ok(format!(
        "attention [{n}, {h}, {l}, {e}] {dt:?}{}, forward + backward: cuDNN {cudnn:.3} ms \
         ({:.0} TFLOP/s; cuDNN ran {by_cudnn}), own kernels {own:.3} ms ({:.0} TFLOP/s, {:.2}x \
         cuDNN's rate), composition {composed:.3} ms ({:.2}x the own kernels' time); forward \
         keeps {:.1} MiB fused, {:.1} MiB composed; relative difference to the composition: \
         cuDNN {:.1e}, own {:.1e}",
        if causal { " causal" } else { "" },
        rate(cudnn),
        rate(own),
        cudnn / own,
        composed / own,
        mib(fused_kept),
        mib(composed_kept),
        rel(Path::Cudnn)?,
        rel(Path::Own)?,
    ))
}

/// The channels-last convolution against the NCHW one (`quick`: on [2, 8, 12, 12]).
pub fn conv_formats(d: Device, quick: bool) -> Result<String> {
    let [n, c, h] = if quick { [2, 8, 12] } else { [64, 64, 56] };
    set_cudnn_benchmark(true);
    let nchw = conv_ms(d, MemoryFormat::Contiguous, [n, c, h]);
    let nhwc = conv_ms(d, MemoryFormat::ChannelsLast, [n, c, h]);
    set_cudnn_benchmark(false);
    let (nchw, nhwc) = (nchw?, nhwc?);
    Ok(format!(
        "conv 3x3 {c}->{c} on [{n}, {c}, {h}, {h}] f16, forward + backward: NCHW {nchw:.3} ms, channels-last {nhwc:.3} ms ({:.2}x)",
        nchw / nhwc
    ))
}

/// M3 through the engine: 256 MB of f32 uploaded from a pinned buffer (a loader batch with
/// `pin_memory`) and from ordinary memory in 32 MB tensors (staged through the pinned pool),
/// the host's time to queue each (the uploads do not make it wait), and whether the values
/// arrived.
pub fn transfers(n: usize) -> Result<String> {
    use mantissa::backend::cuda::runtime::runtime;
    use mantissa::data::{HostBatch, HostBuffer};
    let d = Device::Cuda(n);
    let rt = runtime(n)?;
    let len = 64 << 20;
    let mut buf = rt.pinned_buffer(len * 4)?;
    for (i, v) in buf.as_mut_slice::<f32>(len)?.iter_mut().enumerate() {
        *v = (i % 1021) as f32 - 510.0;
    }
    let pinned = |buf| HostBuffer::Pinned {
        buf,
        dtype: DType::F32,
        len,
    };
    let mut x = pinned(buf);
    let mut pinned_ms = Vec::new();
    let mut queue_ms = Vec::new();
    let mut last = None;
    for _ in 0..4 {
        rt.synchronize()?;
        let t0 = Instant::now();
        let b = HostBatch {
            x,
            y: HostBuffer::Heap(mantissa::backend::cpu::CpuStorage::I64(vec![0])),
            shape: vec![1, len],
            y_shape: vec![1],
        }
        .into_batch(d)?;
        queue_ms.push(t0.elapsed().as_secs_f64() * 1e3);
        rt.synchronize()?;
        pinned_ms.push(t0.elapsed().as_secs_f64() * 1e3);
        // A new pinned buffer for the next round: the pool hands the same block back.
        let mut buf = rt.pinned_buffer(len * 4)?;
        buf.as_mut_slice::<f32>(len)?
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = (i % 1021) as f32 - 510.0);
        x = pinned(buf);
        last = Some(b.x);
    }
    let got = last.expect("four rounds").to_vec::<f32>()?;
    let pinned_ok = got
        .iter()
        .enumerate()
        .all(|(i, &v)| v == (i % 1021) as f32 - 510.0);
    let chunk = 8 << 20; // 32 MB of f32
    let host: Vec<Vec<f32>> = (0..8)
        .map(|k| (0..chunk).map(|i| ((i + k) % 997) as f32).collect())
        .collect();
    rt.synchronize()?;
    let t0 = Instant::now();
    let dev = host
        .iter()
        .map(|h| Tensor::from_vec(h.clone(), &[chunk], d))
        .collect::<Result<Vec<_>>>()?;
    rt.synchronize()?;
    let staged_ms = t0.elapsed().as_secs_f64() * 1e3;
    let staged_ok = dev
        .iter()
        .zip(&host)
        .all(|(t, h)| t.to_vec::<f32>().map(|v| &v == h).unwrap_or(false));
    // One 256 MB tensor from ordinary memory: the ring of pinned chunks (best of three).
    let big = Tensor::from_vec(
        (0..64usize << 20).map(|i| (i % 1013) as f32).collect(),
        &[64 << 20],
        Device::Cpu,
    )?;
    let mut ring_ms = Vec::new();
    let mut ring_ok = true;
    for _ in 0..3 {
        rt.synchronize()?;
        let t0 = Instant::now();
        let on = big.to_device(d)?;
        rt.synchronize()?;
        ring_ms.push(t0.elapsed().as_secs_f64() * 1e3);
        ring_ok &= on.to_vec::<f32>()? == big.to_vec::<f32>()?;
    }
    let min = |v: &[f64]| v.iter().cloned().fold(f64::INFINITY, f64::min);
    Ok(format!(
        "host-to-device through the engine, 256 MB: pinned {:.1} GB/s (host queued it in {:.3} ms), staged from ordinary memory {:.1} GB/s (8 x 32 MB, the host's copies into the pinned pool included), one pageable 256 MB tensor through the ring of pinned chunks {:.1} GB/s; values {}; pinned pool: {}",
        0.256 / min(&pinned_ms) * 1e3,
        min(&queue_ms),
        0.256 / staged_ms * 1e3,
        0.256 / min(&ring_ms) * 1e3,
        if pinned_ok && staged_ok && ring_ok { "identical" } else { "DIFFER" },
        rt.pinned_stats()
    ))
}
