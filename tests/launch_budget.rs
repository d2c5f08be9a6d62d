//! Launch budgets of a training step on the CUDA device (the emulated one in CI, where the
//! profiler counts our kernel launches and library calls as on a GPU): a step may launch no
//! more than PyTorch eager's step launches kernels on an H100 (torch.profiler), W3 879 and W4
//! 994 (BENCHMARKS.md). The sizes are small; the counts do not depend on them: per-channel
//! and per-parameter work runs in launches shared by many tensors.
//!
//! A library call (cuBLAS, cuDNN) is counted as one launch; on a GPU it may run more than one
//! kernel, and PyTorch's count includes those.

mod common;
use common::parity::gpu;
use mantissa::amp::{GradScaler, GradScalerConfig};
use mantissa::nn::*;
use mantissa::optim::{clip_grad_norm, Adam, AdamConfig, Optimizer, Sgd, SgdConfig};
use mantissa::profiler::{Profiler, SortBy};
use mantissa::train::{autocast_maybe, classify_step};
use mantissa::*;
use std::sync::Mutex;

#[path = "../examples/common/resnet_model.rs"]
#[allow(dead_code)]
mod resnet_model;

/// One profile at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// Launches plus library calls of one `step` after `warmup` (optimizer states made, kernels
/// compiled, algorithms chosen), with the profile's op table for a failure's message.
fn per_step(warmup: usize, mut step: impl FnMut() -> Result<()>) -> (u64, String) {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..warmup {
        step().unwrap();
    }
    let p = Profiler::start().unwrap();
    step().unwrap();
    p.step();
    let profile = p.stop().unwrap();
    let s = &profile.steps()[0];
    (
        s.launches + s.library_calls,
        profile.table(SortBy::DeviceTime, 30),
    )
}

/// W3: ResNet-50, fp16 autocast with the loss scaler, channels-last, SGD with Nesterov
/// momentum and weight decay (`examples/resnet.rs`), at 32x32 with a batch of 2.
#[test]
fn resnet50_fp16_step_within_pytorchs_launches() {
    let Some(d) = gpu() else { return };
    let mut g = Generator::new(0);
    let spec = resnet_model::ResNetSpec {
        counts: [3, 4, 6, 3],
        bottleneck: true,
        width: 64,
        in_channels: 3,
        classes: 10,
        imagenet_stem: true,
        checkpoint: false,
    };
    let mut net = resnet_model::resnet(&spec, &mut g).unwrap();
    net.to_device(d).unwrap();
    net.to_memory_format(MemoryFormat::ChannelsLast).unwrap();
    let cfg = SgdConfig {
        momentum: 0.9,
        nesterov: true,
        weight_decay: 5e-4,
        ..SgdConfig::new(0.1)
    };
    let mut opt = Sgd::new(net.parameters(), cfg).unwrap();
    let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
    let x = Tensor::randn_with(&[2, 3, 32, 32], 0.0, 1.0, DType::F32, d, &mut g)
        .and_then(|x| x.to_memory_format(MemoryFormat::ChannelsLast))
        .unwrap();
    let y = Tensor::from_vec(vec![3i64, 7], &[2], Device::Cpu)
        .and_then(|y| y.to_device(d))
        .unwrap();
    let low = Some(DType::F16);
    let (launches, table) = per_step(1, || {
        classify_step(&net, &mut opt, &mut scaler, low, &x, &y).map(|_| ())
    });
    assert!(
        launches <= 879,
        "ResNet-50 step: {launches} launches and library calls, over 879\n{table}"
    );
    // Batch norm folded into the convolutions (cuDNN's graph API, where the emulated cuDNN
    // offers it too): the statistics pass of every batch norm after a convolution with
    // channels in whole vectors goes (52 of 53; the stem's input has 3 channels); the 32
    // recomputed outputs become 32 launches of the scale and bias the prologues apply, and
    // each of those 32 weight gradients is followed by the pass that multiplies back the
    // channels whose scale was divided to fit f16 (a read of the factors alone when none
    // was): 52 - 32 fewer. On the emulated device exactly; a real cuDNN may decline a graph
    // (that batch norm then makes its own statistics), so there the count may only not grow.
    #[cfg(feature = "cuda-backend")]
    {
        use mantissa::backend::cuda::conv_stats::set_conv_bn_fusion;
        set_conv_bn_fusion(true);
        let (fused, table) = per_step(1, || {
            classify_step(&net, &mut opt, &mut scaler, low, &x, &y).map(|_| ())
        });
        set_conv_bn_fusion(false);
        let (emulated, fewer) = (common::parity::emulated(d), launches - fused.min(launches));
        assert!(
            fused <= launches && (!emulated || fewer == 52 - 32),
            "ResNet-50 step with the fusion: {fused} launches and library calls, {launches} \
             without\n{table}"
        );
    }
}

/// W4's model and step (`examples/lstm.rs`): embedding, a 2-layer LSTM over 100 steps and a
/// read-out to 256 symbols, fp16 autocast, the scaled backward, gradients unscaled and
/// clipped, Adam through the scaler; hidden 32, batch 4.
#[test]
fn lstm_fp16_step_within_pytorchs_launches() {
    let Some(d) = gpu() else { return };
    let mut g = Generator::new(1);
    let (vocab, seq, batch) = (256, 100, 4);
    let mut embed = Embedding::new(vocab, 16, &mut g).unwrap();
    let mut lstm = Lstm::new(16, 32, 2, true, &mut g).unwrap();
    let mut head = Linear::new(32, vocab, true, &mut g).unwrap();
    embed.to_device(d).unwrap();
    lstm.to_device(d).unwrap();
    head.to_device(d).unwrap();
    let mut params = embed.parameters();
    params.extend(lstm.parameters());
    params.extend(head.parameters());
    let mut opt = Adam::new(params.clone(), AdamConfig::adam(3e-3)).unwrap();
    let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
    let tokens = |g: &mut Generator| {
        let v: Vec<i64> = g
            .uniform(batch * seq)
            .iter()
            .map(|u| (u * vocab as f64) as i64 % vocab as i64)
            .collect();
        Tensor::from_vec(v, &[batch, seq], Device::Cpu).and_then(|t| t.to_device(d))
    };
    let (x, y) = (tokens(&mut g).unwrap(), tokens(&mut g).unwrap());
    let (launches, table) = per_step(1, || {
        let loss = autocast_maybe(Some(DType::F16), || {
            let h = lstm.forward(&embed.forward(&x)?)?;
            let logits = head.forward(&h)?;
            logits
                .reshape(&[batch * seq, vocab])?
                .cross_entropy(&y.flatten(0, -1)?, CrossEntropyOptions::default())
        })?;
        opt.zero_grad();
        scaler.scale(&loss)?.backward()?;
        scaler.unscale_(&mut opt)?;
        clip_grad_norm(&params, 1.0)?;
        scaler.step(&mut opt)?;
        scaler.update()
    });
    assert!(
        launches <= 994,
        "LSTM step: {launches} launches and library calls, over 994\n{table}"
    );
}

/// Gradient clipping launches as many kernels for 3 gradients as for 60 (one sum-of-squares
/// pass and one scaling pass per dtype, and the norm's few scalar ops), and matches the CPU.
#[test]
fn clip_grad_norm_launches_do_not_grow_with_the_gradients() {
    let Some(d) = gpu() else { return };
    // The dense gradients of `clip_params` (its transposed view is copied first, per tensor).
    let dense = |sets: usize| -> Vec<Tensor> {
        (0..sets)
            .flat_map(|_| {
                let mut p = common::clip_params(d);
                p.remove(2);
                p
            })
            .collect()
    };
    let launches = |params: Vec<Tensor>| per_step(1, || clip_grad_norm(&params, 1.0).map(|_| ())).0;
    let (few, many) = (launches(dense(1)), launches(dense(20)));
    assert_eq!(few, many, "launches for 3 gradients and for 60");
    assert!(few <= 12, "{few} launches");

    let (cpu, dev) = (common::clip_params(Device::Cpu), common::clip_params(d));
    let norm_cpu = clip_grad_norm(&cpu, 1.0).unwrap().item().unwrap();
    let norm_dev = clip_grad_norm(&dev, 1.0).unwrap().item().unwrap();
    assert!(
        ((norm_dev - norm_cpu) / norm_cpu).abs() < 1e-5,
        "{norm_dev} vs {norm_cpu}"
    );
    for (c, g) in cpu.iter().zip(&dev) {
        let (c, g) = (c.grad().unwrap(), g.grad().unwrap());
        assert_eq!(g.memory_format(), c.memory_format());
        common::assert_close(
            &common::vals(&g),
            &common::vals(&c),
            1e-5,
            "clipped gradient",
        );
    }
}

/// A warm step finds every kernel at its launch site and every product's cuBLASLt plan in
/// the cache: no kernel is looked up through the runtime (a map under a lock, names
/// formatted) and no cuBLASLt descriptor or heuristic is built, step after step.
#[test]
#[cfg(feature = "cuda-backend")]
fn warm_steps_look_up_no_kernel_and_build_no_cublaslt_plan() {
    use mantissa::backend::cuda::{matmul::cublaslt_plans_cached, sites::kernel_lookups};
    let Some(d) = gpu() else { return };
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut g = Generator::new(3);
    let mut net = Sequential::new()
        .push(Linear::new(12, 32, true, &mut g).unwrap())
        .push(Activation::Relu)
        .push(Linear::new(32, 5, true, &mut g).unwrap());
    net.to_device(d).unwrap();
    let mut opt = Sgd::new(net.parameters(), SgdConfig::new(0.1)).unwrap();
    let mut scaler = GradScaler::new(GradScalerConfig::default()).unwrap();
    let x = Tensor::randn(&[16, 12], DType::F32, d).unwrap();
    let y = Tensor::from_vec(
        (0..16).map(|i| i % 5).collect::<Vec<i64>>(),
        &[16],
        Device::Cpu,
    )
    .unwrap()
    .to_device(d)
    .unwrap();
    for low in [None, Some(DType::F16)] {
        let mut step = || {
            classify_step(&net, &mut opt, &mut scaler, low, &x, &y)
                .unwrap()
                .0
                .item()
                .unwrap()
        };
        step();
        let (lookups, plans) = (kernel_lookups(), cublaslt_plans_cached());
        for _ in 0..3 {
            assert!(step().is_finite());
        }
        assert_eq!(
            kernel_lookups(),
            lookups,
            "{low:?}: kernels looked up again"
        );
        assert_eq!(
            cublaslt_plans_cached(),
            plans,
            "{low:?}: cuBLASLt plans built again"
        );
        assert!(
            plans > 0,
            "{low:?}: the bias epilogue's products have plans"
        );
    }
}
