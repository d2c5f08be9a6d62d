//! Fused paths on the GPU whose use the profiler confirms, against the CPU: training batch
//! norm through cuDNN's NHWC batch norm (`set_cudnn_batch_norm(true)`: the plain op, BN + ReLU
//! and BN + residual add + ReLU, forward, backward and the running statistics, and the cases
//! that keep the engine's own kernels), and a residual block's input gradient added in the
//! convolution's backward. A binary of its own, its tests one at a time, because the
//! profiler and the switch are process-wide. Without a GPU each test prints `skipped: no CUDA
//! device` and passes; on the emulated device (tests/emulator) cuDNN's fused ReLU operations
//! are offered for f16/bf16 with a multiple of 4 channels only, so both batch norm paths run
//! there.
#![cfg(feature = "cuda-backend")]
#![allow(clippy::cloned_ref_to_slice_refs)]

mod common;
use common::parity::*;
use common::*;
use mantissa::backend::cuda::dnn_norm::set_cudnn_batch_norm;
use mantissa::nn::{Activation, BatchNorm2d, Module, Residual, Sequential};
use mantissa::profiler;
use mantissa::*;

/// Held by each test: the profiler and the switch are process-wide.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// A BatchNorm2d with weight `w` and bias `b`, its buffers on their device.
fn batch_norm(w: &Tensor, b: &Tensor) -> Result<BatchNorm2d> {
    let mut bn = BatchNorm2d::new(w.numel())?;
    let dev = w.device();
    (bn.weight, bn.bias) = (w.clone(), b.clone());
    bn.running_mean = bn.running_mean.to_device(dev)?;
    bn.running_var = bn.running_var.to_device(dev)?;
    bn.num_batches_tracked = bn.num_batches_tracked.to_device(dev)?;
    Ok(bn)
}

/// A BatchNorm2d with weight `x[1]` and bias `x[2]`, and `x[0]` in channels-last.
fn layer(x: &[Tensor]) -> Result<(BatchNorm2d, Tensor)> {
    let bn = batch_norm(&x[1], &x[2])?;
    Ok((bn, x[0].to_memory_format(MemoryFormat::ChannelsLast)?))
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Case {
    Plain,
    Relu,
    AddRelu,
}

/// The case's network on `x` (a layer as `layer` makes it), with its op name checked.
fn run(case: Case, bn: BatchNorm2d, x: &Tensor) -> Result<Tensor> {
    let (y, name) = match case {
        Case::Plain => (bn.forward(x)?, "batch_norm"),
        Case::Relu => {
            let net = Sequential::new().push(bn).push(Activation::Relu);
            (net.forward(x)?, "batch_norm_relu")
        }
        Case::AddRelu => {
            let block = Residual::new(Sequential::new().push(bn), None);
            (block.forward(x)?, "batch_norm_add_relu")
        }
    };
    assert_eq!(y.op_name(), Some(name));
    assert!(y.is_channels_last(), "{case:?} keeps channels-last");
    Ok(y)
}

/// Whether the emulated cuDNN offers `case` for `dt` with `c` channels (dnn_norm.cpp).
fn emulator_offers(case: Case, dt: DType, c: usize) -> bool {
    case == Case::Plain || (dt != DType::F32 && c.is_multiple_of(4))
}

/// Forward and backward of `case` on the GPU under the profiler: the library calls and
/// kernels that ran, by name, with their counts.
fn calls(case: Case, d: Device, x: &[Tensor]) -> Vec<(String, u64)> {
    let ins: Vec<Tensor> = x
        .iter()
        .map(|t| own(t, d).requires_grad(true).unwrap())
        .collect();
    let ((), p) = profiler::profile(|_| {
        let (bn, x0) = layer(&ins).unwrap();
        let y = run(case, bn, &x0).unwrap();
        y.sum_all().unwrap().backward().unwrap();
        vals(&ins[0].grad().unwrap());
    })
    .unwrap();
    kernel_counts(&p)
}

/// The library calls and kernels a profile saw, by name, with their counts.
fn kernel_counts(p: &profiler::Profile) -> Vec<(String, u64)> {
    p.kernels()
        .iter()
        .map(|k| (k.name.clone(), k.count))
        .collect()
}

/// How many of `calls` have a name starting with `prefix`.
fn count(calls: &[(String, u64)], prefix: &str) -> u64 {
    calls
        .iter()
        .filter(|(n, _)| n.starts_with(prefix))
        .map(|(_, c)| c)
        .sum()
}

#[test]
fn cudnn_batch_norm_matches_the_cpu() {
    let Some(d) = gpu() else { return };
    let _serial = serial();
    set_cudnn_batch_norm(true);
    for dt in FLOATS {
        // 8 channels (offered for the fused ReLU on the emulator in f16/bf16) and 6 (not).
        for c in [8, 6] {
            let x = input(&[3, c, 5, 7], dt, 10 + c as u64);
            let (w, b) = (input(&[c], dt, 20), input(&[c], dt, 21));
            for case in [Case::Plain, Case::Relu, Case::AddRelu] {
                let what = format!("{case:?} {dt:?} c={c}");
                parity(&what, d, &[x.clone(), w.clone(), b.clone()], |x| {
                    let (bn, x0) = layer(x)?;
                    run(case, bn, &x0)
                });
                let names = calls(case, d, &[x.clone(), w.clone(), b.clone()]);
                let (cudnn, own) = (count(&names, "cudnn batch_norm"), count(&names, "bn_"));
                eprintln!("{what}: {cudnn} cuDNN batch norm calls, {own} own kernels");
                if emulated(d) && emulator_offers(case, dt, c) {
                    // Forward and backward; the batch counter's launch is the only own one.
                    assert_eq!((cudnn, own), (2, 1), "{what}: {names:?}");
                } else if emulated(d) {
                    // The engine's passes: the statistics, their combination and the affine
                    // pass, forward and backward.
                    assert_eq!((cudnn, own), (0, 6), "{what}: {names:?}");
                }
            }
        }
    }
    set_cudnn_batch_norm(false);
}

/// One pixel per image (ResNet's last stage on small images): a tensor that is both
/// channels-last and row-major, whose size-1 dims' strides may differ between operands.
#[test]
fn cudnn_batch_norm_of_single_pixels() {
    let Some(d) = gpu() else { return };
    let _serial = serial();
    set_cudnn_batch_norm(true);
    for dt in FLOATS {
        let x = input(&[6, 8, 1, 1], dt, 50);
        let (w, b) = (input(&[8], dt, 51), input(&[8], dt, 52));
        for case in [Case::Plain, Case::Relu, Case::AddRelu] {
            let what = format!("{case:?} {dt:?} 1 x 1");
            parity(&what, d, &[x.clone(), w.clone(), b.clone()], |x| {
                let (bn, x0) = layer(x)?;
                run(case, bn, &x0)
            });
        }
    }
    set_cudnn_batch_norm(false);
}

/// The running statistics and the batch counter after two training steps, as on the CPU.
#[test]
fn cudnn_batch_norm_updates_the_running_statistics() {
    let Some(d) = gpu() else { return };
    let _serial = serial();
    set_cudnn_batch_norm(true);
    for dt in FLOATS {
        let x = input(&[4, 8, 6, 6], dt, 30);
        let (w, b) = (input(&[8], dt, 31), input(&[8], dt, 32));
        let state = |dev: Device| {
            let ins = [own(&x, dev), own(&w, dev), own(&b, dev)];
            let (bn, x0) = layer(&ins).unwrap();
            // The buffers are updated in place: these handles see the updates.
            let (rm, rv) = (bn.running_mean.clone(), bn.running_var.clone());
            let tracked = bn.num_batches_tracked.clone();
            let net = Sequential::new().push(bn).push(Activation::Relu);
            for _ in 0..2 {
                net.forward(&x0.mul(1.5).unwrap()).unwrap();
            }
            (vals(&rm), vals(&rv), tracked.to_vec::<i64>().unwrap())
        };
        let (want_m, want_v, want_t) = state(Device::Cpu);
        let (got_m, got_v, got_t) = state(d);
        assert_close(&got_m, &want_m, band(dt), &format!("running_mean {dt:?}"));
        assert_close(&got_v, &want_v, band(dt), &format!("running_var {dt:?}"));
        assert_eq!(got_t, want_t, "num_batches_tracked {dt:?}");
        assert_eq!(got_t, vec![2]);
    }
    set_cudnn_batch_norm(false);
}

/// Where cuDNN's call does not apply, the engine's kernels run, with the same results: no
/// affine parameters, row-major input, eval mode, and running statistics in another dtype.
/// A network on the inputs, by name.
type Net = Box<dyn Fn(&[Tensor]) -> Result<Tensor>>;

#[test]
fn cudnn_batch_norm_falls_back_where_it_does_not_apply() {
    let Some(d) = gpu() else { return };
    let _serial = serial();
    set_cudnn_batch_norm(true);
    let dt = DType::F16;
    let x = input(&[2, 8, 4, 4], dt, 40);
    let (w, b) = (input(&[8], dt, 41), input(&[8], dt, 42));
    let cl = |t: &Tensor| t.to_memory_format(MemoryFormat::ChannelsLast);
    let cases: Vec<(&str, Net)> = vec![
        (
            "no affine",
            Box::new(move |x: &[Tensor]| {
                cl(&x[0])?.batch_norm(None, None, None, None, true, 0.1, 1e-5)
            }),
        ),
        (
            "row-major",
            Box::new(|x: &[Tensor]| {
                x[0].batch_norm(None, None, Some(&x[1]), Some(&x[2]), true, 0.1, 1e-5)
            }),
        ),
        (
            "eval",
            Box::new(move |x: &[Tensor]| {
                let (mut bn, x0) = layer(x)?;
                bn.eval();
                Sequential::new()
                    .push(bn)
                    .push(Activation::Relu)
                    .forward(&x0)
            }),
        ),
        (
            "f16 running statistics",
            Box::new(move |x: &[Tensor]| {
                let dev = x[0].device();
                let rm = Tensor::zeros(&[8], DType::F16, dev)?;
                let rv = Tensor::ones(&[8], DType::F16, dev)?;
                cl(&x[0])?.batch_norm(
                    Some(&rm),
                    Some(&rv),
                    Some(&x[1]),
                    Some(&x[2]),
                    true,
                    0.1,
                    1e-5,
                )
            }),
        ),
    ];
    for (what, f) in &cases {
        parity(what, d, &[x.clone(), w.clone(), b.clone()], f);
        let ins: Vec<Tensor> = [&x, &w, &b]
            .iter()
            .map(|t| own(t, d).requires_grad(true).unwrap())
            .collect();
        let ((), p) = profiler::profile(|_| {
            f(&ins).unwrap().sum_all().unwrap().backward().unwrap();
            vals(&ins[0].grad().unwrap());
        })
        .unwrap();
        let cudnn = p
            .kernels()
            .iter()
            .filter(|k| k.name.starts_with("cudnn batch_norm"))
            .count();
        assert_eq!(cudnn, 0, "{what}: the engine's kernels");
    }
    set_cudnn_batch_norm(false);
}

/// A residual block with a convolution in its main branch, `relu(bn(conv(h)) + h)`: the
/// convolution's backward adds `h`'s gradient onto the shortcut's, which the engine holds
/// until then, in cuDNN's own pass (`beta = 1`), so the conv's backward launches no add of
/// its own; the gradients match the CPU's, NCHW and channels-last, with the engine's batch
/// norm and with cuDNN's (channels-last) making the shortcut's gradient.
#[test]
fn residual_gradient_accumulates_in_the_convolution() {
    let Some(d) = gpu() else { return };
    let _serial = serial();
    for (dt, cl, lib) in FLOATS
        .into_iter()
        .flat_map(|dt| [(dt, false, false), (dt, true, false), (dt, true, true)])
    {
        set_cudnn_batch_norm(lib);
        {
            let x = input(&[2, 8, 6, 6], dt, 120);
            let w = input(&[8, 8, 3, 3], dt, 121).mul(0.2).unwrap();
            let (g, b) = (input(&[8], dt, 122), input(&[8], dt, 123));
            let block = |x: &[Tensor]| -> Result<Tensor> {
                let format = match cl {
                    true => MemoryFormat::ChannelsLast,
                    false => MemoryFormat::Contiguous,
                };
                // The block's input and the weight as outputs of recorded ops (the engine
                // sums the gradients of those; a leaf's go to its `.grad()`).
                let conv = mantissa::nn::Conv2d {
                    weight: x[1].mul(1.0)?.to_memory_format(format)?,
                    bias: None,
                    options: Conv2dOptions {
                        padding: [1, 1],
                        ..Default::default()
                    },
                };
                let h = x[0].mul(1.0)?.to_memory_format(format)?;
                let bn = batch_norm(&x[2], &x[3])?;
                Residual::new(Sequential::new().push(conv).push(bn), None).forward(&h)
            };
            let ins = [x, w, g, b];
            parity("residual block with a convolution", d, &ins, block);
            let on: Vec<Tensor> = ins
                .iter()
                .map(|t| own(t, d).requires_grad(true).unwrap())
                .collect();
            let ((), p) = profiler::profile(|_| {
                block(&on).unwrap().sum_all().unwrap().backward().unwrap();
                vals(&on[0].grad().unwrap());
            })
            .unwrap();
            let conv = p.op("conv2d.backward").expect("the conv's backward ran");
            // cuDNN's backward data and filter passes, and nothing else.
            let what = format!("{dt:?} channels-last {cl}, cuDNN batch norm {lib}: {conv:?}");
            assert_eq!((conv.launches, conv.library_calls), (0, 2), "{what}");
        }
    }
    set_cudnn_batch_norm(false);
}

/// conv2d -> training batch norm -> ReLU, channels-last or not, in `x[0]`'s dtype, with
/// weight `x[1]` (`stride`, `dilation`; padding keeps the size at stride 1) and batch norm
/// parameters `x[2]`, `x[3]`.
fn conv_bn(x: &[Tensor], cl: bool, stride: usize, dilation: usize) -> Result<Tensor> {
    let format = match cl {
        true => MemoryFormat::ChannelsLast,
        false => MemoryFormat::Contiguous,
    };
    let opts = Conv2dOptions {
        stride: [stride, stride],
        padding: [dilation, dilation],
        dilation: [dilation, dilation],
        ..Default::default()
    };
    let w = x[1].to_memory_format(format)?;
    let y = x[0].to_memory_format(format)?.conv2d(&w, None, opts)?;
    let bn = batch_norm(&x[2], &x[3])?;
    Sequential::new()
        .push(bn)
        .push(Activation::Relu)
        .forward(&y)
}

/// With `set_conv_bn_fusion(true)`, an f16 channels-last convolution with channels in whole
/// vectors sums its output channels in cuDNN's graph (`cudnn conv+stats`) and the batch norm
/// after it makes no statistics pass of its own (one `bn_partial`, the backward's, instead of
/// two); the results match the CPU in every case, fused or not, and so do the running
/// statistics. Other dtypes, layouts and channel counts, and (on the emulated cuDNN) a
/// dilated convolution, which it declines, run as before.
#[test]
fn convolution_sums_feed_the_next_batch_norm() {
    use mantissa::backend::cuda::conv_stats::set_conv_bn_fusion;
    let Some(d) = gpu() else { return };
    let _serial = serial();
    set_conv_bn_fusion(true);
    for dt in FLOATS {
        // (in channels, out channels, channels-last, stride, dilation, [n, h, w]); the last
        // has 8 values per channel (ResNet-50's last stage on small images; with 2 the input
        // gradient is 0 up to rounding, nothing to compare).
        for (c, o, cl, stride, dil, [n, h, w]) in [
            (8, 16, true, 1, 1, [3, 6, 5]),
            (16, 8, true, 2, 1, [3, 6, 5]),
            (8, 16, false, 1, 1, [3, 6, 5]),
            (6, 8, true, 1, 1, [3, 6, 5]),
            (8, 12, true, 1, 1, [3, 6, 5]),
            (8, 8, true, 1, 2, [3, 6, 5]),
            (16, 16, true, 1, 1, [2, 2, 2]),
        ] {
            let what = format!(
                "{dt:?} c={c} o={o} channels-last {cl} stride {stride} dil {dil} {n}x{h}x{w}"
            );
            // Inputs with a mean far from 0, so that statistics from sums that were wrong or
            // stale would show.
            let x = input(&[n, c, h, w], dt, 130).add(2.0).unwrap();
            let w = input(&[o, c, 3, 3], dt, 131).mul(0.3).unwrap();
            let (g, b) = (input(&[o], dt, 132), input(&[o], dt, 133));
            let ins = [x, w, g, b];
            parity(&what, d, &ins, |x| conv_bn(x, cl, stride, dil));
            let on: Vec<Tensor> = ins
                .iter()
                .map(|t| own(t, d).requires_grad(true).unwrap())
                .collect();
            let ((), p) = profiler::profile(|_| {
                let y = conv_bn(&on, cl, stride, dil).unwrap();
                y.sum_all().unwrap().backward().unwrap();
                vals(&on[0].grad().unwrap());
            })
            .unwrap();
            let names = kernel_counts(&p);
            let (fused, partials) = (
                count(&names, "cudnn conv+stats"),
                count(&names, "bn_partial"),
            );
            let eligible = dt == DType::F16 && cl && c % 8 == 0 && o % 8 == 0;
            if emulated(d) {
                let want = if eligible && dil == 1 { (1, 1) } else { (0, 2) };
                assert_eq!((fused, partials), want, "{what}: {names:?}");
            } else if !eligible {
                assert_eq!(fused, 0, "{what}: {names:?}");
            }
        }
    }
    set_conv_bn_fusion(false);
}

/// The sums kept beside a convolution's output serve only that output as it was made: after
/// an in-place write, or for a view of it, batch norm makes its own statistics.
#[test]
fn convolution_sums_are_not_used_for_changed_or_other_views() {
    use mantissa::backend::cuda::conv_stats::set_conv_bn_fusion;
    let Some(d) = gpu() else { return };
    let _serial = serial();
    set_conv_bn_fusion(true);
    let cl = MemoryFormat::ChannelsLast;
    let x = input(&[4, 8, 5, 5], DType::F16, 140).add(1.0).unwrap();
    let w = input(&[8, 8, 3, 3], DType::F16, 141).mul(0.3).unwrap();
    let opts = Conv2dOptions {
        padding: [1, 1],
        ..Default::default()
    };
    let norm = |y: &Tensor| -> Vec<f64> {
        let (g, b) = (input(&[8], DType::F32, 142), input(&[8], DType::F32, 143));
        let bn = batch_norm(&own(&g, y.device()), &own(&b, y.device())).unwrap();
        vals(&bn.forward(y).unwrap())
    };
    let conv = |dev: Device| -> Tensor {
        let (x, w) = (own(&x, dev), own(&w, dev));
        let w = w.to_memory_format(cl).unwrap();
        x.to_memory_format(cl)
            .unwrap()
            .conv2d(&w, None, opts)
            .unwrap()
    };
    // Written in place after the convolution: the sums are stale.
    let written = |dev: Device| {
        let y = conv(dev);
        y.copy_(&y.mul(3.0).unwrap().add(1.0).unwrap()).unwrap();
        norm(&y)
    };
    assert_close(
        &written(d),
        &written(Device::Cpu),
        band(DType::F16),
        "written",
    );
    // A view of the first two images: the sums cover all four.
    let view = |dev: Device| norm(&conv(dev).narrow(0, 0, 2).unwrap());
    assert_close(&view(d), &view(Device::Cpu), band(DType::F16), "a view");
    set_conv_bn_fusion(false);
}

/// conv2d -> training batch norm -> ReLU -> conv2d in `x[0]`'s dtype, channels-last, with
/// weights `x[1]`, `x[4]` (3x3, then 1x1) and batch norm parameters `x[2]`, `x[3]`.
fn conv_bn_conv(x: &[Tensor]) -> Result<Tensor> {
    let h = conv_bn(&x[..4], true, 1, 1)?;
    let w = x[4].to_memory_format(MemoryFormat::ChannelsLast)?;
    h.conv2d(&w, None, Conv2dOptions::default())
}

/// The kernels and library calls of [`conv_bn_conv`]'s forward and backward on `d` (copies of
/// `ins`), with the profile.
fn conv_bn_conv_profile(d: Device, ins: &[Tensor]) -> (Vec<(String, u64)>, profiler::Profile) {
    let on: Vec<Tensor> = ins
        .iter()
        .map(|t| own(t, d).requires_grad(true).unwrap())
        .collect();
    let ((), p) = profiler::profile(|_| {
        let y = conv_bn_conv(&on).unwrap();
        y.sum_all().unwrap().backward().unwrap();
        vals(&on[4].grad().unwrap());
    })
    .unwrap();
    (kernel_counts(&p), p)
}

/// With `set_conv_bn_fusion(true)`, the second convolution's weight gradient applies the
/// batch norm's map in its prologue (`cudnn wgrad+bn`, its f16 scale and bias from
/// `bn_scale_bias_f16`) instead of making the batch norm's output again
/// (`batch_norm.recompute`), where the problem is eligible (f16, channels in whole vectors);
/// every case matches the CPU. Inputs near zero mean: the f16 scale and bias cost a relative
/// error that grows with |mean| / std of the batch norm's input.
#[test]
fn weight_gradient_applies_batch_norm_in_its_prologue() {
    use mantissa::backend::cuda::conv_stats::set_conv_bn_fusion;
    let Some(d) = gpu() else { return };
    let _serial = serial();
    set_conv_bn_fusion(true);
    for dt in FLOATS {
        for (c, m, o) in [(8, 16, 8), (8, 12, 8), (16, 8, 24)] {
            let what = format!("{dt:?} {c} -> {m} -> {o}");
            let x = input(&[2, c, 5, 4], dt, 150);
            let w1 = input(&[m, c, 3, 3], dt, 151).mul(0.3).unwrap();
            let (g, b) = (input(&[m], dt, 152), input(&[m], dt, 153));
            let w2 = input(&[o, m, 1, 1], dt, 154).mul(0.3).unwrap();
            let ins = [x, w1, g, b, w2];
            parity(&what, d, &ins, conv_bn_conv);
            let (names, p) = conv_bn_conv_profile(d, &ins);
            let fused = (
                count(&names, "cudnn wgrad+bn"),
                count(&names, "bn_scale_bias"),
                p.op("batch_norm.recompute").is_some(),
            );
            let eligible = dt == DType::F16 && m % 8 == 0;
            if emulated(d) {
                let want = if eligible {
                    (1, 1, false)
                } else {
                    (0, 0, true)
                };
                assert_eq!(fused, want, "{what}: {names:?}");
            } else if !eligible {
                assert_eq!(fused.0, 0, "{what}: {names:?}");
            }
        }
    }
    set_conv_bn_fusion(false);
}

/// A batch norm channel whose map's f16 scale would overflow in the weight gradient's
/// prologue: channel 0's filters are zero, so its output is constant, its variance 0 and its
/// scale gamma / sqrt(eps) = 220 x 316 = 69,570, past f16's 65,504. The map is given to
/// cuDNN divided by a power of two and the gradient multiplied back (`wgrad_rescale_f16`),
/// so the weight gradient stays finite and matches the CPU, which computes it unfused.
#[test]
fn a_prologue_scale_past_f16_stays_finite() {
    use mantissa::backend::cuda::conv_stats::set_conv_bn_fusion;
    let Some(d) = gpu() else { return };
    let _serial = serial();
    set_conv_bn_fusion(true);
    let (c, m, o) = (8, 16, 8);
    let half = |v: Vec<f32>, shape: &[usize]| {
        Tensor::from_vec(v, shape, Device::Cpu)
            .unwrap()
            .to_dtype(DType::F16)
            .unwrap()
    };
    let mut w1 = vals(&input(&[m, c, 3, 3], DType::F32, 161).mul(0.3).unwrap());
    w1[..c * 9].iter_mut().for_each(|v| *v = 0.0);
    let mut g = vals(&input(&[m], DType::F32, 162));
    g[0] = 220.0;
    let mut b = vals(&input(&[m], DType::F32, 163));
    b[0] = 0.5;
    // Channel 0's input gradient through the batch norm is its scale times the gradient
    // that reaches it: small weights keep it inside f16 on both devices.
    let mut w2 = vals(&input(&[o, m, 1, 1], DType::F32, 164).mul(0.3).unwrap());
    w2.iter_mut().step_by(m).for_each(|v| *v *= 0.01);
    let f32s = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<_>>();
    let ins = [
        input(&[2, c, 5, 4], DType::F16, 160),
        half(f32s(w1), &[m, c, 3, 3]),
        half(f32s(g), &[m]),
        half(f32s(b), &[m]),
        half(f32s(w2), &[o, m, 1, 1]),
    ];
    parity("a scale past f16", d, &ins, conv_bn_conv);
    if emulated(d) {
        let (names, _) = conv_bn_conv_profile(d, &ins);
        let fused = (
            count(&names, "cudnn wgrad+bn"),
            count(&names, "wgrad_rescale_f16"),
        );
        assert_eq!(fused, (1, 1), "{names:?}");
    }
    set_conv_bn_fusion(false);
}

/// A graph whose plan cuDNN finalized but whose execution it refuses (NOT_SUPPORTED; the
/// emulated cuDNN does so with MANTISSA_EMU_GRAPH_EXECUTE=not-supported) is remembered as
/// declined: the plain convolutions and batch norm run, and the results match the CPU.
#[test]
fn graphs_refused_at_run_time_fall_back() {
    use mantissa::backend::cuda::conv_stats::set_conv_bn_fusion;
    let Some(d) = gpu() else { return };
    if !emulated(d) {
        eprintln!("skipped: the refusal is the emulated cuDNN's");
        return;
    }
    let _serial = serial();
    set_conv_bn_fusion(true);
    std::env::set_var("MANTISSA_EMU_GRAPH_EXECUTE", "not-supported");
    // Shapes no other test uses: the plans, and the refusal, are remembered per shape.
    let dt = DType::F16;
    let x = input(&[2, 24, 4, 3], dt, 160);
    let w1 = input(&[16, 24, 3, 3], dt, 161).mul(0.3).unwrap();
    let (g, b) = (input(&[16], dt, 162), input(&[16], dt, 163));
    let w2 = input(&[32, 16, 1, 1], dt, 164).mul(0.3).unwrap();
    let ins = [x, w1, g, b, w2];
    parity("refused graphs", d, &ins, conv_bn_conv);
    let (names, p) = conv_bn_conv_profile(d, &ins);
    std::env::remove_var("MANTISSA_EMU_GRAPH_EXECUTE");
    set_conv_bn_fusion(false);
    let fused = count(&names, "cudnn conv+stats") + count(&names, "cudnn wgrad+bn");
    assert_eq!(fused, 0, "{names:?}");
    assert_eq!(count(&names, "bn_partial"), 2, "{names:?}");
    assert!(p.op("batch_norm.recompute").is_some(), "{names:?}");
}
