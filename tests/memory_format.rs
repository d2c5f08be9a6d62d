//! Channels-last (NHWC) memory format: conversion, propagation through elementwise ops,
//! convolutions, pooling and batch norm, and values and gradients equal to the NCHW ones.

mod common;
use common::*;
use mantissa::nn::*;
use mantissa::optim::Optimizer;
use mantissa::*;

const CL: MemoryFormat = MemoryFormat::ChannelsLast;

#[test]
fn conversion_sets_the_strides_and_keeps_the_values() {
    let x = f32s(&[2, 3, 4, 5], 1);
    let y = x.to_memory_format(CL).unwrap();
    assert_eq!(y.shape(), x.shape());
    assert_eq!(y.strides(), &[60, 1, 15, 3]);
    assert!(y.is_channels_last() && !y.is_contiguous());
    assert_eq!(y.memory_format(), CL);
    assert_eq!(vals(&y), vals(&x));
    // Converting again is the same tensor; back to contiguous is row-major again.
    assert!(y.to_memory_format(CL).unwrap().shares_storage(&y));
    let z = y.to_memory_format(MemoryFormat::Contiguous).unwrap();
    assert!(z.is_contiguous() && !z.is_channels_last());
    assert_eq!(vals(&z), vals(&x));
}

#[test]
fn one_channel_converts_without_a_copy() {
    // With one channel NCHW and NHWC hold the elements in the same order: a view.
    let x = f32s(&[2, 1, 3, 3], 2);
    let y = x.to_memory_format(CL).unwrap();
    assert!(y.shares_storage(&x));
    assert!(y.is_channels_last() && !x.is_channels_last());
    assert_eq!(vals(&y), vals(&x));
}

#[test]
fn channels_last_needs_four_dims() {
    let e = f32s(&[3, 4], 3)
        .to_memory_format(CL)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("to_memory_format") && e.contains("[3, 4]"),
        "{e}"
    );
}

#[test]
fn elementwise_ops_keep_a_dense_order() {
    let x = f32s(&[2, 3, 4, 5], 4);
    let b = f32s(&[1, 3, 1, 1], 5);
    let xc = x.to_memory_format(CL).unwrap();
    let cases: Vec<(&str, Tensor, Tensor)> = vec![
        ("relu", x.relu().unwrap(), xc.relu().unwrap()),
        ("exp", x.exp().unwrap(), xc.exp().unwrap()),
        ("x * x", x.mul(&x).unwrap(), xc.mul(&xc).unwrap()),
        // A broadcast operand does not decide the order, even when it comes first.
        ("bias + x", b.add(&x).unwrap(), b.add(&xc).unwrap()),
        ("x > 0", x.gt(0.0).unwrap(), xc.gt(0.0).unwrap()),
        (
            "to_dtype",
            x.to_dtype(DType::BF16).unwrap(),
            xc.to_dtype(DType::BF16).unwrap(),
        ),
        (
            "where",
            Tensor::where_cond(&x.gt(0.0).unwrap(), &x, &b).unwrap(),
            Tensor::where_cond(&xc.gt(0.0).unwrap(), &xc, &b).unwrap(),
        ),
    ];
    for (what, want, got) in cases {
        assert!(
            got.is_channels_last(),
            "{what}: strides {:?}",
            got.strides()
        );
        assert_eq!(vals(&got), vals(&want), "{what}");
    }
    // The first full-size operand decides: contiguous first gives contiguous.
    let mixed = x.add(&xc).unwrap();
    assert!(mixed.is_contiguous());
    assert_eq!(vals(&mixed), vals(&x.mul(2.0).unwrap()));
}

#[test]
fn a_transposed_operand_gives_a_transposed_output() {
    let m = f32s(&[5, 7], 6);
    let t = m.t().unwrap();
    let y = t.mul(3.0).unwrap().add(&t).unwrap();
    assert_eq!(y.shape(), &[7, 5]);
    assert_eq!(y.strides(), t.strides());
    let want = t.contiguous().unwrap().mul(4.0).unwrap();
    assert_close(&vals(&y), &vals(&want), 1e-7, "transposed");
    // A view with gaps has no dense order: its output is row-major.
    let gaps = f32s(&[4, 6], 7).narrow(1, 1, 3).unwrap();
    let y = gaps.neg().unwrap();
    assert!(y.is_contiguous());
    assert_eq!(vals(&y), vals(&gaps.mul(-1.0).unwrap()));
}

fn conv_opts() -> Conv2dOptions {
    Conv2dOptions {
        stride: [2, 1],
        padding: [1, 2],
        dilation: [1, 2],
        groups: 2,
    }
}

/// Runs `f` on `inputs` (leaves) with the first one in `format`, backpropagates
/// `sum(out * w)`, and returns the output and the gradient of each input.
fn run(
    inputs: &[Tensor],
    format: MemoryFormat,
    f: impl Fn(&Tensor, &[Tensor]) -> Result<Tensor>,
) -> (Tensor, Vec<Vec<f64>>) {
    let leaves: Vec<Tensor> = inputs
        .iter()
        .map(|x| x.copy().unwrap().requires_grad(true).unwrap())
        .collect();
    let x = leaves[0].to_memory_format(format).unwrap();
    let y = f(&x, &leaves[1..]).unwrap();
    let w = f32s(y.shape(), 77).to_dtype(y.dtype()).unwrap();
    y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    let grads = leaves.iter().map(|l| vals(&l.grad().unwrap())).collect();
    (y, grads)
}

/// Whether `t` is laid out channels-last (`cl`) or NCHW; a tensor whose two layouts are the
/// same (one channel, or 1x1 images) is both.
fn in_format(t: &Tensor, cl: bool) -> bool {
    (t.is_channels_last() && t.is_contiguous()) || t.is_channels_last() == cl
}

fn same_in_both_formats(
    what: &str,
    inputs: &[Tensor],
    tol: f64,
    f: impl Fn(&Tensor, &[Tensor]) -> Result<Tensor>,
) {
    let (want, want_g) = run(inputs, MemoryFormat::Contiguous, &f);
    let (got, got_g) = run(inputs, CL, &f);
    assert!(in_format(&want, false), "{what}: NCHW input");
    // An [n, 1, 1, 1] input has the same strides in both formats and counts as NCHW.
    let s = inputs[0].shape();
    let ambiguous = s[1] == 1 && s[2] * s[3] == 1;
    assert!(
        ambiguous || in_format(&got, true),
        "{what}: strides {:?}",
        got.strides()
    );
    assert_close(&vals(&got), &vals(&want), tol, &format!("{what} forward"));
    for (i, (g, w)) in got_g.iter().zip(&want_g).enumerate() {
        assert_close(g, w, tol, &format!("{what} grad {i}"));
    }
}

#[test]
fn convolutions_follow_the_input_format() {
    for dt in [DType::F32, DType::BF16] {
        let tol = if dt == DType::F32 { 1e-6 } else { 1e-2 };
        let x = f32s(&[3, 4, 9, 11], 10).to_dtype(dt).unwrap();
        let w = f32s(&[6, 2, 3, 3], 11).to_dtype(dt).unwrap();
        let b = f32s(&[6], 12).to_dtype(dt).unwrap();
        same_in_both_formats("conv2d", &[x.clone(), w.clone(), b], tol, |x, p| {
            x.conv2d(&p[0], Some(&p[1]), conv_opts())
        });
        // conv_transpose2d maps [n, 6, ., .] back with the same weight.
        let z = f32s(&[3, 6, 5, 7], 13).to_dtype(dt).unwrap();
        let opts = ConvTranspose2dOptions {
            stride: [2, 1],
            padding: [1, 2],
            dilation: [1, 2],
            groups: 2,
            output_padding: [1, 0],
        };
        same_in_both_formats("conv_transpose2d", &[z, w], tol, |x, p| {
            x.conv_transpose2d(&p[0], None, opts)
        });
    }
}

/// The CPU reads and writes channels-last convolutions in NHWC directly (its own unfolding,
/// and one product over the batch for a pointwise 1x1), so every shape case must agree with
/// the NCHW kernels: values, input and weight gradients, in f64 (summation order only) and
/// bf16.
#[test]
fn channels_last_convolutions_match_nchw_over_shapes() {
    // (input [n, c, h, w], weight [o, c / groups, kh, kw], stride, padding, dilation, groups)
    type Case = (
        [usize; 4],
        [usize; 4],
        [usize; 2],
        [usize; 2],
        [usize; 2],
        usize,
    );
    let cases: [Case; 9] = [
        ([2, 8, 5, 6], [12, 8, 1, 1], [1, 1], [0, 0], [1, 1], 1), // pointwise: one product
        ([2, 8, 5, 6], [12, 8, 1, 1], [2, 2], [0, 0], [1, 1], 1), // strided 1x1
        ([2, 8, 5, 6], [12, 4, 1, 1], [1, 1], [0, 0], [1, 1], 2), // grouped 1x1
        ([3, 1, 9, 9], [5, 1, 3, 3], [1, 1], [0, 0], [1, 1], 1),  // one input channel
        ([2, 3, 7, 8], [4, 3, 3, 3], [1, 1], [1, 1], [1, 1], 1),  // padded: whole-row runs
        ([2, 4, 9, 7], [6, 4, 3, 2], [2, 3], [1, 2], [1, 1], 1),  // uneven stride and pad
        ([1, 6, 8, 9], [6, 1, 3, 3], [1, 2], [2, 1], [2, 1], 6),  // depthwise, dilated
        ([2, 6, 4, 5], [9, 2, 5, 5], [1, 1], [2, 2], [1, 1], 3),  // window wider than image
        ([2, 4, 6, 6], [4, 4, 2, 2], [2, 2], [0, 0], [1, 2], 1),  // dilation along w only
    ];
    for (k, (xs, ws, stride, padding, dilation, groups)) in cases.into_iter().enumerate() {
        let opts = Conv2dOptions {
            stride,
            padding,
            dilation,
            groups,
        };
        for (dt, tol) in [(DType::F64, 1e-12), (DType::BF16, 1e-2)] {
            let x = f32s(&xs, 20 + k as u64).to_dtype(dt).unwrap();
            let w = f32s(&ws, 40 + k as u64).to_dtype(dt).unwrap();
            let what = format!("case {k} {xs:?} * {ws:?} {opts:?} {dt:?}");
            same_in_both_formats(&what, &[x, w], tol, |x, p| x.conv2d(&p[0], None, opts));
        }
    }
}

/// Channels-last pooling runs on NHWC in place on the CPU (no reorder before or after) and
/// must give the NCHW kernels' values and gradients exactly: the same cells picked, the same
/// window sums in the same order. Ties and NaNs decide which cell a max pool picks.
#[test]
fn channels_last_pooling_matches_nchw_exactly() {
    let max = |k: usize, s: usize, p: usize, dil: usize, ceil_mode: bool| MaxPool2dOptions {
        stride: Some([s, s]),
        padding: [p, p],
        dilation: [dil, dil],
        ceil_mode,
        ..MaxPool2dOptions::new(k)
    };
    let avg =
        |k: usize, s: usize, p: usize, ceil_mode: bool, count_include_pad: bool| AvgPool2dOptions {
            stride: Some([s, s]),
            padding: [p, p],
            ceil_mode,
            count_include_pad,
            ..AvgPool2dOptions::new(k)
        };
    // 21 channels: a block of 16 the max pool compares at once, and 5 more one by one. Few
    // distinct values, so windows tie, and NaNs in both parts.
    let shape = [2, 21, 9, 10];
    let mut ties: Vec<f32> = (0..2 * 21 * 9 * 10).map(|i| ((i * 7) % 3) as f32).collect();
    for i in [17, 400, 19 * 90 + 33, 21 * 90 + 5 * 90 + 61] {
        ties[i] = f32::NAN;
    }
    let ties = Tensor::from_vec(ties, &shape, Device::Cpu).unwrap();
    for dt in [DType::F32, DType::BF16] {
        for x in [f32s(&shape, 60), ties.clone()] {
            let x = x.to_dtype(dt).unwrap();
            let maxes = [
                max(2, 2, 0, 1, false),
                max(3, 2, 1, 1, false),
                max(3, 1, 1, 2, false),
                max(2, 3, 1, 1, true),
            ];
            for o in maxes {
                let what = format!("max_pool2d {o:?} {dt:?}");
                same_exactly(&what, &x, |x| x.max_pool2d(o));
            }
            for o in [
                avg(2, 2, 0, false, true),
                avg(3, 2, 1, false, true),
                avg(3, 2, 1, true, false),
            ] {
                let what = format!("avg_pool2d {o:?} {dt:?}");
                same_exactly(&what, &x, |x| x.avg_pool2d(o));
            }
            for out in [[1, 1], [4, 3], [9, 10]] {
                let what = format!("adaptive_avg_pool2d {out:?} {dt:?}");
                same_exactly(&what, &x, |x| x.adaptive_avg_pool2d(out));
            }
        }
    }
}

/// A reduction under test.
type Reduction = fn(&Tensor) -> Result<Tensor>;

/// Reductions walk a channels-last (or transposed) input in storage order; the results are
/// those of the NCHW input: sums up to rounding, extremes exactly, and arg-reductions still
/// count positions in the view's order (ties pick the first there, not in storage).
#[test]
fn reductions_of_a_channels_last_tensor_match() {
    // Few distinct values, so arg-reductions tie.
    let ties: Vec<f32> = (0..3 * 4 * 5 * 6).map(|i| ((i * 7) % 5) as f32).collect();
    let ties = Tensor::from_vec(ties, &[3, 4, 5, 6], Device::Cpu).unwrap();
    for x in [f32s(&[3, 4, 5, 6], 70), ties] {
        let cl = x.to_memory_format(CL).unwrap();
        assert!(cl.is_channels_last());
        let sums: [(&str, Reduction); 4] = [
            ("sum_all", |t| t.sum_all()),
            ("sum over n, h, w", |t| t.sum(&[0, 2, 3], false)),
            ("mean over h, w", |t| t.mean(&[2, 3], true)),
            ("sum over c", |t| t.sum(&[1], false)),
        ];
        for (what, f) in sums {
            assert_close(&vals(&f(&cl).unwrap()), &vals(&f(&x).unwrap()), 1e-6, what);
        }
        let exact: [(&str, Reduction); 6] = [
            ("max_all", |t| t.max_all()),
            ("min_all", |t| t.min_all()),
            ("max over c", |t| Ok(t.max(1, false)?.0)),
            ("where the max over c is", |t| Ok(t.max(1, false)?.1)),
            ("argmax over w", |t| t.argmax(3, false)),
            ("argmin over c", |t| t.argmin(1, false)),
        ];
        for (what, f) in exact {
            assert_eq!(vals(&f(&cl).unwrap()), vals(&f(&x).unwrap()), "{what}");
        }
    }
}

/// `f` on `x` in NCHW and in channels-last: the same bits forward and backward (NaN equal to
/// NaN), and a channels-last output and input gradient for the channels-last input.
fn same_exactly(what: &str, x: &Tensor, f: impl Fn(&Tensor) -> Result<Tensor>) {
    let run = |format: MemoryFormat| {
        let leaf = x.to_memory_format(format).unwrap().detach();
        let leaf = leaf.requires_grad(true).unwrap();
        let y = f(&leaf).unwrap();
        let w = f32s(y.shape(), 61).to_dtype(y.dtype()).unwrap();
        y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        let g = leaf.grad().unwrap();
        assert!(in_format(&y, format == CL), "{what}: output format");
        assert!(in_format(&g, format == CL), "{what}: gradient format");
        (vals(&y), vals(&g))
    };
    let (want, got) = (run(MemoryFormat::Contiguous), run(CL));
    let same = |a: &[f64], b: &[f64]| {
        a.iter()
            .zip(b)
            .all(|(p, q)| p == q || p.is_nan() && q.is_nan())
    };
    assert!(
        same(&got.0, &want.0),
        "{what} forward\n got  {:?}\n want {:?}",
        got.0,
        want.0
    );
    assert!(
        same(&got.1, &want.1),
        "{what} backward\n got  {:?}\n want {:?}",
        got.1,
        want.1
    );
}

/// A `[o, 1, 1, 1]` weight (a 1x1 kernel over one channel) has the same strides in both
/// formats; like PyTorch's `suggest_memory_format`, such an ambiguous tensor does not make a
/// convolution channels-last, so an NCHW network stays NCHW through it.
#[test]
fn an_ambiguous_weight_keeps_the_input_format() {
    let w = f32s(&[3, 1, 1, 1], 80);
    assert!(w.is_channels_last() && w.is_contiguous());
    let x = f32s(&[2, 1, 4, 5], 81);
    let y = x.conv2d(&w, None, Conv2dOptions::default()).unwrap();
    assert!(!y.is_channels_last(), "strides {:?}", y.strides());
    let y = x
        .to_memory_format(CL)
        .unwrap()
        .conv2d(&w, None, Conv2dOptions::default());
    assert!(y.unwrap().is_channels_last());
}

#[test]
fn a_channels_last_weight_makes_the_convolution_channels_last() {
    let x = f32s(&[2, 3, 6, 6], 14);
    let w = f32s(&[4, 3, 3, 3], 15);
    let y = x.conv2d(&w.to_memory_format(CL).unwrap(), None, Default::default());
    let y = y.unwrap();
    assert!(y.is_channels_last());
    let want = x.conv2d(&w, None, Default::default()).unwrap();
    assert_close(&vals(&y), &vals(&want), 1e-6, "channels-last weight");
}

/// A weight's gradient takes the weight's memory format, whichever format the convolution
/// ran in (PyTorch's layout contract for parameters), with the same values.
#[test]
fn a_weight_gradient_takes_the_weight_format() {
    let x = f32s(&[2, 4, 7, 7], 16);
    let w = f32s(&[6, 2, 3, 3], 17);
    let grad = |x_format: MemoryFormat, w_format: MemoryFormat| -> Tensor {
        // A fresh leaf each time (`to_memory_format` returns `w` itself when it matches).
        let leaf = w.copy().unwrap().to_memory_format(w_format).unwrap();
        let leaf = leaf.requires_grad(true).unwrap();
        let xi = x.to_memory_format(x_format).unwrap();
        let y = xi.conv2d(&leaf, None, conv_opts()).unwrap();
        y.mul(&f32s(y.shape(), 18))
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        leaf.grad().unwrap()
    };
    let want = grad(MemoryFormat::Contiguous, MemoryFormat::Contiguous);
    assert!(want.is_contiguous());
    for (xf, wf) in [
        (CL, MemoryFormat::Contiguous),
        (MemoryFormat::Contiguous, CL),
        (CL, CL),
    ] {
        let g = grad(xf, wf);
        assert_eq!(
            g.memory_format(),
            wf,
            "input {xf:?}, weight {wf:?}: {:?}",
            g.strides()
        );
        assert_close(
            &vals(&g),
            &vals(&want),
            1e-6,
            &format!("input {xf:?}, weight {wf:?}"),
        );
    }
}

#[test]
fn a_conv_net_block_stays_channels_last_with_equal_gradients() {
    let x = f32s(&[4, 3, 10, 10], 20);
    let w1 = f32s(&[8, 3, 3, 3], 21).mul(0.3).unwrap();
    let w2 = f32s(&[8, 8, 3, 3], 22).mul(0.2).unwrap();
    let gamma = f32s(&[8], 23);
    let beta = f32s(&[8], 24);
    let block = |x: &Tensor, p: &[Tensor]| -> Result<Tensor> {
        let pad = Conv2dOptions {
            padding: [1, 1],
            ..Default::default()
        };
        let h = x.conv2d(&p[0], None, pad)?;
        let h = h.batch_norm(None, None, Some(&p[2]), Some(&p[3]), true, 0.1, 1e-5)?;
        assert!(h.is_channels_last() == x.is_channels_last(), "batch_norm");
        let h = h.relu()?.max_pool2d(MaxPool2dOptions::new(2))?;
        assert!(h.is_channels_last() == x.is_channels_last(), "max_pool2d");
        let r = h.conv2d(&p[1], None, pad)?;
        let h = r.add(&h)?.relu()?.avg_pool2d(AvgPool2dOptions::new(2))?;
        assert!(h.is_channels_last() == x.is_channels_last(), "avg_pool2d");
        h.adaptive_avg_pool2d([2, 2])
    };
    same_in_both_formats("conv block", &[x, w1, w2, gamma, beta], 1e-6, block);
}

#[test]
fn a_channels_last_training_step_matches_the_nchw_one() {
    // Channels-last input only: the weights stay NCHW.
    let (want, _) = model_steps(MemoryFormat::Contiguous, false, DType::F32);
    let (got, _) = model_steps(CL, false, DType::F32);
    assert_close(&got, &want, 1e-5, "parameters after two Adam steps");
}

/// The MNIST-style block the model tests train: conv, batch norm, relu, pool, linear. The
/// conv has no bias: before batch norm its gradient is zero but for rounding, which Adam
/// would scale up to full steps in different directions in the two formats.
fn block_net(gen: &mut Generator) -> Sequential {
    Sequential::new()
        .push(Conv2d::new(3, 8, 3, Default::default(), false, gen).unwrap())
        .push(BatchNorm2d::new(8).unwrap())
        .push(Activation::Relu)
        .push(MaxPool2d(MaxPool2dOptions::new(2)))
        .push(Flatten)
        .push(Linear::new(8 * 3 * 3, 5, true, gen).unwrap())
}

/// Two Adam steps of `block_net` with the input (and the weights, when `weights`) in
/// `format`, parameters in `dtype` (with f32 masters rounded to nearest when half); the
/// parameters after.
fn model_steps(format: MemoryFormat, weights: bool, dtype: DType) -> (Vec<f64>, Sequential) {
    let mut net = block_net(&mut Generator::new(9));
    net.to_dtype(dtype).unwrap();
    if weights {
        net.to_memory_format(format).unwrap();
    }
    net.train();
    let mut opt = optim::Adam::new(net.parameters(), optim::AdamConfig::adam(1e-2)).unwrap();
    if dtype != DType::F32 {
        opt.use_master_weights(optim::Rounding::Nearest).unwrap();
    }
    let x = f32s(&[6, 3, 8, 8], 30)
        .to_dtype(dtype)
        .unwrap()
        .to_memory_format(format)
        .unwrap();
    let y = Tensor::from_vec(vec![0i64, 1, 2, 3, 4, 0], &[6], Device::Cpu).unwrap();
    for _ in 0..2 {
        opt.zero_grad();
        let loss = net
            .forward(&x)
            .unwrap()
            .cross_entropy(&y, Default::default())
            .unwrap();
        loss.backward().unwrap();
        opt.step().unwrap();
    }
    let values = net.parameters().iter().flat_map(vals).collect();
    (values, net)
}

#[test]
fn a_channels_last_model_trains_like_the_nchw_one() {
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2)] {
        let (want, _) = model_steps(MemoryFormat::Contiguous, true, dtype);
        let (got, net) = model_steps(CL, true, dtype);
        let w = &net.parameters()[0];
        assert!(
            w.is_channels_last(),
            "the conv weight after the steps ({dtype:?})"
        );
        assert_close(
            &got,
            &want,
            tol,
            &format!("parameters after two steps ({dtype:?})"),
        );
    }
}

#[test]
fn a_channels_last_model_round_trips_through_a_checkpoint() {
    let (want, net) = model_steps(CL, true, DType::F32);
    let path = std::env::temp_dir().join(format!("mantissa-cl-{}.safetensors", std::process::id()));
    mantissa::checkpoint::save(&path, &net, None, &[]).unwrap();
    // Loaded into an NCHW model: the same values, in its own layout.
    let mut nchw = block_net(&mut Generator::new(1));
    mantissa::checkpoint::load(&path, &mut nchw, None).unwrap();
    let _ = std::fs::remove_file(&path);
    let got: Vec<f64> = nchw.parameters().iter().flat_map(vals).collect();
    assert_eq!(got, want);
    assert!(!nchw.parameters()[0].is_channels_last());
}

mod random_shapes {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

        /// Random convolution geometry: the channels-last kernels (unfolding, whole-row runs,
        /// pointwise products, grouped outputs) agree with the NCHW ones in f64, and the
        /// channels-last pooling picks and sums exactly as the NCHW pooling does.
        #[test]
        fn channels_last_kernels_match_nchw(
            (n, groups, cg, og) in (1usize..3, 1usize..4, 1usize..5, 1usize..4),
            (h, w) in (1usize..9, 1usize..9),
            (kh, kw) in (1usize..4, 1usize..4),
            (sh, sw, ph, pw, dh, dw) in (1usize..3, 1usize..3, 0usize..2, 0usize..2, 1usize..3, 1usize..3),
            seed in any::<u64>(),
        ) {
            let c = groups * cg;
            // Windows that fit the padded input (the others are errors in both formats).
            prop_assume!(dh * (kh - 1) < h + 2 * ph && dw * (kw - 1) < w + 2 * pw);
            let x = f32s(&[n, c, h, w], seed).to_dtype(DType::F64).unwrap();
            let wt = f32s(&[groups * og, cg, kh, kw], seed ^ 1).to_dtype(DType::F64).unwrap();
            let opts = Conv2dOptions {
                stride: [sh, sw],
                padding: [ph, pw],
                dilation: [dh, dw],
                groups,
            };
            let what = format!("conv {:?} * {:?} {opts:?}", x.shape(), wt.shape());
            same_in_both_formats(&what, &[x.clone(), wt], 1e-12, |x, p| x.conv2d(&p[0], None, opts));
            // Pooling windows: padding at most half the kernel, as PyTorch requires.
            let (k, s) = (kh.max(2), sh);
            if k <= h && k <= w {
                let o = MaxPool2dOptions {
                    stride: Some([s, s]),
                    padding: [ph.min(k / 2), ph.min(k / 2)],
                    dilation: [1, dw.min(2)],
                    ..MaxPool2dOptions::new(k)
                };
                if dw.min(2) * (k - 1) < w + 2 * o.padding[1] {
                    same_exactly(&format!("max_pool {o:?}"), &x, |x| x.max_pool2d(o));
                }
                let a = AvgPool2dOptions {
                    stride: Some([s, s]),
                    padding: [ph.min(k / 2), pw.min(k / 2)],
                    count_include_pad: seed % 2 == 0,
                    ..AvgPool2dOptions::new(k)
                };
                same_exactly(&format!("avg_pool {a:?}"), &x, |x| x.avg_pool2d(a));
            }
            same_exactly("adaptive", &x, |x| x.adaptive_avg_pool2d([h.div_ceil(2), w.div_ceil(3)]));
        }
    }
}
