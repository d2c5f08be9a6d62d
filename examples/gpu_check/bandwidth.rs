//! M2: the engine's elementwise kernels against the device-to-device copy, in GB/s of the
//! bytes each must move: add, mul and relu forward, and relu's backward (which reads the saved
//! output and the gradient and writes the input's gradient), in f16 and f32, contiguous and
//! channels-last; M5: ResNet-50's pooling and batch norm passes, in the same terms; M6: a
//! convolution and the training batch norm after it, with and without the statistics made in
//! the convolution's epilogue (`set_conv_bn_fusion`).

use mantissa::nn::Module;
use mantissa::*;
use std::time::Instant;

/// Milliseconds per call of `f`: median of 5 timings of 10 calls each, after 3 warm-up calls;
/// the device is synchronised around each timing.
fn time_ms(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let sync = || mantissa::backend::cuda::runtime::runtime(0)?.synchronize();
    for _ in 0..3 {
        f()?;
    }
    let mut times = Vec::new();
    for _ in 0..5 {
        sync()?;
        let t0 = Instant::now();
        for _ in 0..10 {
            f()?;
        }
        sync()?;
        times.push(t0.elapsed().as_secs_f64() * 1e3 / 10.0);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[2])
}

/// One line per dtype and memory format (`quick`: on [2, 8, 12, 12]; else [256, 64, 112,
/// 112], a ResNet-50 stem activation, 205M elements).
pub fn elementwise(d: Device, quick: bool) -> Result<String> {
    let shape: [usize; 4] = if quick {
        [2, 8, 12, 12]
    } else {
        [256, 64, 112, 112]
    };
    let n: usize = shape.iter().product();
    let mut lines = vec![format!("M2 elementwise on {shape:?} (GB/s; % of the copy)")];
    let mut gen = Generator::new(8);
    for dtype in [DType::F16, DType::F32] {
        let plane = (n * dtype.size_in_bytes()) as f64;
        let gbs = |planes: f64, ms: f64| planes * plane / (ms * 1e-3) / 1e9;
        let r = |s: &mut Generator| Tensor::randn_with(&shape, 0.0, 1.0, dtype, d, s);
        let (a, b, g) = (r(&mut gen)?, r(&mut gen)?, r(&mut gen)?);
        let copy = gbs(2.0, time_ms(|| a.copy().map(drop))?);
        for format in [MemoryFormat::Contiguous, MemoryFormat::ChannelsLast] {
            let f = |t: &Tensor| t.to_memory_format(format);
            let (x, y, dy) = (f(&a)?, f(&b)?, f(&g)?);
            let add = gbs(3.0, time_ms(|| x.add(&y).map(drop))?);
            let mul = gbs(3.0, time_ms(|| x.mul(&y).map(drop))?);
            let relu_ms = time_ms(|| x.relu().map(drop))?;
            let xg = x.detach().requires_grad(true)?;
            let both_ms = time_ms(|| {
                xg.relu()?.backward_with(&dy)?;
                xg.zero_grad();
                Ok(())
            })?;
            let (relu, back) = (gbs(2.0, relu_ms), gbs(3.0, (both_ms - relu_ms).max(1e-6)));
            let pct = |v: f64| 100.0 * v / copy;
            lines.push(format!(
                "  {dtype:?} {format:?}: copy {copy:.0}; add {add:.0} ({:.0}%), mul {mul:.0} ({:.0}%), relu {relu:.0} ({:.0}%), relu backward {back:.0} ({:.0}%)",
                pct(add),
                pct(mul),
                pct(relu),
                pct(back)
            ));
        }
    }
    Ok(lines.join("\n"))
}

/// M5: ResNet-50's pooling and batch norm at its own shapes (`quick`: small ones), in GB/s
/// of the bytes each pass must move and % of the copy, channels-last and NCHW, f16 and f32:
/// the stem's 3 x 3 stride-2 max pool over [256, 64, 112, 112] (forward: x, y and the u8
/// taps; backward: dy, the taps and dx), the head's global average pool over [256, 2048, 7,
/// 7] (backward: dy and dx), and training batch norm over [256, 64, 112, 112] (forward: x
/// read twice, y written; backward: x and dy read twice, dx written), the engine's kernels
/// and cuDNN's.
pub fn resnet_passes(d: Device, quick: bool) -> Result<String> {
    let (stem, head): ([usize; 4], [usize; 4]) = if quick {
        ([2, 16, 12, 12], [2, 32, 7, 7])
    } else {
        ([256, 64, 112, 112], [256, 2048, 7, 7])
    };
    let mut lines = vec![format!(
        "M5 ResNet-50 passes on {stem:?} (pools, batch norm) and {head:?} (head) (GB/s; % of the copy)"
    )];
    let pool = MaxPool2dOptions {
        kernel: [3, 3],
        stride: Some([2, 2]),
        padding: [1, 1],
        dilation: [1, 1],
        ceil_mode: false,
    };
    let mut gen = Generator::new(9);
    for dtype in [DType::F16, DType::F32] {
        let size = dtype.size_in_bytes() as f64;
        let n = |s: &[usize]| s.iter().product::<usize>() as f64;
        let gbs = |bytes: f64, ms: f64| bytes / (ms.max(1e-6) * 1e-3) / 1e9;
        let x0 = Tensor::randn_with(&stem, 0.0, 1.0, dtype, d, &mut gen)?;
        let h0 = Tensor::randn_with(&head, 0.0, 1.0, dtype, d, &mut gen)?;
        let copy = gbs(2.0 * n(&stem) * size, time_ms(|| x0.copy().map(drop))?);
        let pct = |v: f64| 100.0 * v / copy;
        for format in [MemoryFormat::ChannelsLast, MemoryFormat::Contiguous] {
            let x = x0.to_memory_format(format)?.requires_grad(true)?;
            let h = h0.to_memory_format(format)?.requires_grad(true)?;
            // Forward alone, then forward and backward: the backward is the difference.
            let y = x.max_pool2d(pool)?;
            let (ny, nx) = (n(y.shape()), n(&stem));
            let dy = Tensor::randn_with(y.shape(), 0.0, 1.0, dtype, d, &mut gen)?
                .to_memory_format(format)?;
            let fwd = time_ms(|| x.max_pool2d(pool).map(drop))?;
            let both = time_ms(|| {
                x.max_pool2d(pool)?.backward_with(&dy)?;
                x.zero_grad();
                Ok(())
            })?;
            let pf = gbs(nx * size + ny * (size + 1.0), fwd);
            let pb = gbs(ny * (size + 1.0) + nx * size, both - fwd);
            let dh = Tensor::randn_with(&[head[0], head[1], 1, 1], 0.0, 1.0, dtype, d, &mut gen)?
                .to_memory_format(format)?;
            let afwd = time_ms(|| h.adaptive_avg_pool2d([1, 1]).map(drop))?;
            let aboth = time_ms(|| {
                h.adaptive_avg_pool2d([1, 1])?.backward_with(&dh)?;
                h.zero_grad();
                Ok(())
            })?;
            let ab = gbs((n(&head) + n(dh.shape())) * size, aboth - afwd);
            let mut line = format!(
                "  {dtype:?} {format:?}: copy {copy:.0}; max pool {pf:.0} ({:.0}%), backward {pb:.0} ({:.0}%); global avg pool backward {ab:.0} ({:.0}%)",
                pct(pf),
                pct(pb),
                pct(ab)
            );
            let gy = x0.to_memory_format(format)?;
            let was = mantissa::backend::cuda::dnn_norm::cudnn_batch_norm();
            for cudnn in [false, true] {
                mantissa::backend::cuda::dnn_norm::set_cudnn_batch_norm(cudnn);
                let mut bn = nn::BatchNorm2d::new(stem[1])?;
                bn.to_device(d)?;
                let f = time_ms(|| bn.forward(&x).map(drop))?;
                let b = time_ms(|| {
                    bn.forward(&x)?.backward_with(&gy)?;
                    x.zero_grad();
                    Ok(())
                })?;
                let (bf, bb) = (gbs(3.0 * nx * size, f), gbs(5.0 * nx * size, b - f));
                let who = if cudnn { "cuDNN" } else { "engine" };
                line += &format!(
                    "; {who} batch norm {bf:.0} ({:.0}%), backward {bb:.0} ({:.0}%)",
                    pct(bf),
                    pct(bb)
                );
            }
            mantissa::backend::cuda::dnn_norm::set_cudnn_batch_norm(was);
            lines.push(line);
        }
    }
    Ok(lines.join("\n"))
}

/// M6: f16 channels-last convolution + training batch norm forward at ResNet-50's shapes
/// (`quick`: small ones), with the batch norm's statistics from a pass over the output
/// (plain) and from the convolution's epilogue (`set_conv_bn_fusion`): milliseconds of each,
/// whether cuDNN ran the fused graph (the profiler's `cudnn conv+stats`), and the outputs'
/// norm-wise relative difference.
pub fn conv_bn_fusion(d: Device, quick: bool) -> Result<String> {
    use mantissa::backend::cuda::conv_stats::{conv_bn_fusion, set_conv_bn_fusion};
    // ([n, c, h], o, kernel, stride): bottleneck convolutions of stages 1 and 3.
    let shapes: &[([usize; 3], usize, usize, usize)] = if quick {
        &[([2, 8, 12], 16, 1, 1), ([2, 16, 6], 16, 3, 1)]
    } else {
        &[
            ([256, 64, 56], 64, 1, 1),
            ([256, 64, 56], 256, 1, 1),
            ([256, 64, 56], 64, 3, 1),
            ([256, 256, 14], 256, 3, 1),
            ([256, 256, 14], 1024, 1, 1),
        ]
    };
    let was = conv_bn_fusion();
    let mut gen = Generator::new(11);
    let mut lines = vec!["M6 f16 channels-last conv + training batch norm forward: statistics from a pass (plain) or from the conv's epilogue (fused)".to_string()];
    for &([n, c, h], o, k, stride) in shapes {
        let cl = MemoryFormat::ChannelsLast;
        let x = Tensor::randn_with(&[n, c, h, h], 0.0, 1.0, DType::F16, d, &mut gen)?
            .to_memory_format(cl)?;
        let w = Tensor::randn_with(&[o, c, k, k], 0.0, 0.1, DType::F16, d, &mut gen)?
            .to_memory_format(cl)?;
        let opts = Conv2dOptions {
            stride: [stride, stride],
            padding: [k / 2, k / 2],
            ..Default::default()
        };
        let mut bn = nn::BatchNorm2d::new(o)?;
        bn.to_device(d)?;
        let step = || no_grad(|| bn.forward(&x.conv2d(&w, None, opts)?));
        let mut ms = [0.0; 2];
        let mut outs = Vec::new();
        let mut fused_ran = false;
        for (i, on) in [false, true].into_iter().enumerate() {
            set_conv_bn_fusion(on);
            ms[i] = time_ms(|| step().map(drop))?;
            let (y, p) = profiler::profile(|_| step())?;
            fused_ran |= on
                && p.kernels()
                    .iter()
                    .any(|k| k.name.starts_with("cudnn conv+stats"));
            outs.push(y?.to_dtype(DType::F32)?.to_vec::<f32>()?);
        }
        let (num, den) = outs[0]
            .iter()
            .zip(&outs[1])
            .fold((0.0f64, 0.0f64), |(a, b), (p, f)| {
                let (p, f) = (f64::from(*p), f64::from(*f));
                (a + (p - f) * (p - f), b + p * p)
            });
        lines.push(format!(
            "  [{n}, {c}, {h}, {h}] {k}x{k} -> {o} s{stride}: plain {:.3} ms, fused {:.3} ms ({:.2}x), cuDNN ran the fused graph: {fused_ran}, relative difference {:.1e}",
            ms[0],
            ms[1],
            ms[0] / ms[1].max(1e-9),
            (num / den.max(1e-30)).sqrt()
        ));
    }
    set_conv_bn_fusion(was);
    Ok(lines.join("\n"))
}
