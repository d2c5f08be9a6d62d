//! cuDNN's 32-bit limits: a convolution whose activations pass 2^31 - 1 elements (cuDNN's
//! descriptors refuse such a tensor) runs in pieces of the batch, forward and both backward
//! passes, with the results of one call over the whole batch; one image past the limit is
//! `Error::TooLarge`. Every piece starts on a 16-byte boundary (odd image sizes in f16 and
//! f32: a whole number of images that lines both activations up, or aligned copies of a
//! piece where fewer than that many images fit).
//!
//! On a real GPU the limit is cuDNN's, and the batch here is gigabytes. On the emulated
//! device (tests/emulator) run it with `MANTISSA_CUDA_INDEX_LIMIT` set low (`.ci/run` uses
//! 4096): the engine splits at that limit and the emulated cuDNN refuses what passes it, so
//! the split runs on small tensors and is checked against the CPU as well.
#![cfg(feature = "cuda-backend")]

mod common;
use common::parity::{emulated, gpu};
use common::*;
use mantissa::backend::cuda::limits::library_index_limit;
use mantissa::nn::Module;
use mantissa::*;

/// `||a - b|| / ||b||`, computed on the device (the tensors may be gigabytes).
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (
        a.to_dtype(DType::F32).unwrap(),
        b.to_dtype(DType::F32).unwrap(),
    );
    let d = a.sub(&b).unwrap();
    let num = d.mul(&d).unwrap().sum_all().unwrap().item().unwrap();
    let den = b.mul(&b).unwrap().sum_all().unwrap().item().unwrap();
    (num / den.max(1e-30)).sqrt()
}

/// A leaf of normal values on `dev` in `dtype` and `format`.
fn leaf(shape: &[usize], seed: u64, dtype: DType, format: MemoryFormat, dev: Device) -> Tensor {
    let g = &mut Generator::new(seed);
    Tensor::randn_with(shape, 0.0, 1.0, DType::F32, dev, g)
        .and_then(|t| t.to_dtype(dtype))
        .and_then(|t| t.to_memory_format(format))
        .and_then(|t| t.requires_grad(true))
        .unwrap()
}

/// The convolution of `x` `[n, c, h, w]` with a 3x3 filter to `o` channels, padding 1, over
/// the whole batch (which passes the limit) against one call per image, and against the CPU
/// when `cpu` is set.
fn split_matches(x_shape: [usize; 4], o: usize, dtype: DType, format: MemoryFormat, cpu: bool) {
    let dev = gpu().unwrap();
    let [n, c, h, w] = x_shape;
    let what = format!("{dtype:?} {format:?} x {x_shape:?} to {o} channels");
    assert!(
        n * o * h * w > library_index_limit(),
        "{what}: the output must pass the limit"
    );
    let opts = Conv2dOptions {
        padding: [1, 1],
        ..Default::default()
    };
    let x = leaf(&x_shape, 1, dtype, format, dev);
    let wt = leaf(&[o, c, 3, 3], 2, dtype, format, dev);
    let g = leaf(&[n, o, h, w], 3, dtype, format, dev).detach();
    let y = x.conv2d(&wt, None, opts).unwrap();
    y.backward_with(&g).unwrap();
    let (gx, gw) = (x.grad().unwrap(), wt.grad().unwrap());
    // One call per image, each below the limit; the weight's gradient summed over them.
    let w1 = wt.detach().requires_grad(true).unwrap();
    let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
    for i in 0..n {
        let xi = x
            .narrow(0, i, 1)
            .unwrap()
            .detach()
            .requires_grad(true)
            .unwrap();
        let yi = xi.conv2d(&w1, None, opts).unwrap();
        yi.backward_with(&g.narrow(0, i, 1).unwrap()).unwrap();
        let e = rel(&y.narrow(0, i, 1).unwrap(), &yi);
        assert!(e < tol, "{what}: output of image {i}: {e:.2e}");
        let e = rel(&gx.narrow(0, i, 1).unwrap(), &xi.grad().unwrap());
        assert!(e < tol, "{what}: input gradient of image {i}: {e:.2e}");
    }
    let e = rel(&gw, &w1.grad().unwrap());
    assert!(e < tol, "{what}: weight gradient: {e:.2e}");
    if cpu {
        let on_cpu = |t: &Tensor| t.detach().to_device(Device::Cpu).unwrap();
        let (xc, wc) = (
            on_cpu(&x).requires_grad(true).unwrap(),
            on_cpu(&wt).requires_grad(true).unwrap(),
        );
        let yc = xc.conv2d(&wc, None, opts).unwrap();
        yc.backward_with(&on_cpu(&g)).unwrap();
        let tol = if dtype == DType::F32 { 1e-5 } else { 5e-3 };
        for (got, want, name) in [
            (&y, &yc, "output"),
            (&gx, &xc.grad().unwrap(), "input gradient"),
            (&gw, &wc.grad().unwrap(), "weight gradient"),
        ] {
            assert_close(
                &vals(got),
                &vals(want),
                tol,
                &format!("{what}: {name} vs CPU"),
            );
        }
    }
}

#[test]
fn a_convolution_past_the_32_bit_limit_runs_in_pieces_of_the_batch() {
    let Some(dev) = gpu() else { return };
    let limit = library_index_limit();
    let small = limit < (1 << 20);
    if emulated(dev) && !small {
        eprintln!("skipped: the emulated device needs MANTISSA_CUDA_INDEX_LIMIT (a small limit)");
        return;
    }
    let formats = [MemoryFormat::Contiguous, MemoryFormat::ChannelsLast];
    if small {
        // 16 x 16 images to 8 channels: 2048 output elements an image; the batch holds a
        // little more than two pieces' worth, so the last piece is smaller.
        let per_image = 8 * 16 * 16;
        assert!(
            per_image <= limit,
            "MANTISSA_CUDA_INDEX_LIMIT below {per_image}"
        );
        let n = 2 * (limit / per_image) + 1;
        for dtype in [DType::F32, DType::F16] {
            for format in formats {
                split_matches([n, 3, 16, 16], 8, dtype, format, true);
            }
        }
        // Odd image sizes (315 output elements an image, 13 of which fit 4096): pieces start
        // on 16-byte boundaries every 8 images in f16 and every 4 in f32, so the pieces hold
        // 8 or 12 images (the emulated cuDNN refuses an unaligned pointer).
        let n = 2 * (limit / 315) + 1;
        for dtype in [DType::F32, DType::F16] {
            for format in formats {
                split_matches([n, 3, 9, 7], 5, dtype, format, true);
            }
        }
        // Fewer than 8 such images fit (the largest odd side s with 5 s^2 elements within
        // the limit: 27 for 4096): no piece after the first starts aligned, and each runs
        // on aligned copies of its images.
        let side = (1..).step_by(2).take_while(|s| 5 * s * s <= limit).last();
        let side = side.expect("MANTISSA_CUDA_INDEX_LIMIT of 5 elements or more");
        assert!(8 * 5 * side * side > limit, "{side}");
        for format in formats {
            split_matches([3, 3, side, side], 5, DType::F16, format, true);
        }
        staged_residual(side, dev);
        // One image past the limit cannot be split: an error naming the limit.
        let x = Tensor::ones(&[1, 1, 128, 128], DType::F32, dev).unwrap();
        let w = Tensor::ones(&[1, 1, 3, 3], DType::F32, dev).unwrap();
        match x.conv2d(&w, None, Conv2dOptions::default()) {
            Err(Error::TooLarge { msg, .. }) => {
                assert!(msg.contains(&limit.to_string()), "{msg}")
            }
            other => panic!("one image past the limit: {other:?}"),
        }
    } else {
        // cuDNN's own limit: 33 images of 16 x 2048 x 2048 in f16 are 2.2e9 elements a
        // tensor (4.4 GB), past 2^31 - 1; five such tensors are alive at the peak.
        for format in formats {
            split_matches([33, 16, 2048, 2048], 16, DType::F16, format, false);
            memory::empty_cache(dev).unwrap();
        }
    }
}

/// A residual block `relu(relu(conv(h)) + h)` in f16 over `side` x `side` images of 3 channels (one
/// image a piece, see above): the convolution's backward adds the input's gradient onto the
/// shortcut's in cuDNN's own pass (`beta = 1`), so each unaligned piece's copy starts from
/// the shortcut's gradient; the gradients match the CPU's.
fn staged_residual(side: usize, dev: Device) {
    let x = common::parity::input(&[3, 3, side, side], DType::F16, 4);
    let w = common::parity::input(&[3, 3, 3, 3], DType::F16, 5)
        .mul(0.2)
        .unwrap();
    let block = |x: &[Tensor]| -> Result<Tensor> {
        // The input as an op's output: the engine sums the gradients of those (a leaf's go
        // to its `.grad()`).
        let conv = mantissa::nn::Conv2d {
            weight: x[1].mul(1.0)?,
            bias: None,
            options: Conv2dOptions {
                padding: [1, 1],
                ..Default::default()
            },
        };
        // A ReLU after the convolution: its gradient is a tensor of its own, so the
        // shortcut's (the add's incoming gradient) is held by nothing else when the
        // convolution's backward adds onto it.
        let main = mantissa::nn::Sequential::new()
            .push(conv)
            .push(mantissa::nn::Activation::Relu);
        mantissa::nn::Residual::new(main, None).forward(&x[0].mul(1.0)?)
    };
    let ins = [x, w];
    common::parity::parity("staged residual block", dev, &ins, block);
    let on: Vec<Tensor> = ins
        .iter()
        .map(|t| common::parity::own(t, dev).requires_grad(true).unwrap())
        .collect();
    let ((), p) = profiler::profile(|_| {
        block(&on).unwrap().sum_all().unwrap().backward().unwrap();
        vals(&on[0].grad().unwrap());
    })
    .unwrap();
    // Backward data and filter for each of the 3 images, and no add of the gradients: the
    // input's gradient was added in cuDNN's pass, the staged pieces' included.
    let conv = p.op("conv2d.backward").expect("the conv's backward ran");
    assert_eq!((conv.launches, conv.library_calls), (0, 6), "{conv:?}");
}
