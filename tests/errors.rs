//! Bad input gives an `Err` with a message naming the op and the shapes or dtypes, never a panic.

use mantissa::*;

fn f(shape: &[usize]) -> Tensor {
    Tensor::ones(shape, DType::F32, Device::Cpu).unwrap()
}

fn msg<T: std::fmt::Debug>(r: Result<T>) -> String {
    r.expect_err("expected an error").to_string()
}

/// `fn main() -> mantissa::Result<()>` prints an error's Debug form: the same sentence.
#[test]
fn debug_prints_the_message() {
    let e = f(&[2, 3]).add(&f(&[4])).unwrap_err();
    assert_eq!(format!("{e:?}"), e.to_string());
    assert!(!format!("{e:?}").contains("Broadcast {"), "{e:?}");
    let r: Result<()> = Err(e);
    assert!(format!("{r:?}").contains("cannot be broadcast"), "{r:?}");
}

#[test]
fn shape_mismatches_name_the_op_and_shapes() {
    let m = msg(f(&[2, 3]).add(&f(&[4])));
    assert!(
        m.contains("add") && m.contains("[2, 3]") && m.contains("[4]"),
        "{m}"
    );
    let m = msg(f(&[2, 3]).matmul(&f(&[2, 3])));
    assert!(m.contains("matmul") && m.contains("[2, 3]"), "{m}");
    assert!(
        m.contains("inner dimensions differ, 3") && m.contains("vs 2"),
        "{m}"
    );
    let m = msg(f(&[4, 2, 5]).matmul(&f(&[4])));
    assert!(m.contains("5") && m.contains("vs 4 (the only dim"), "{m}");
    let m = msg(f(&[6]).reshape(&[4, 2]));
    assert!(m.contains("reshape") && m.contains("[4, 2]"), "{m}");
    let m = msg(Tensor::cat(&[&f(&[2, 3]), &f(&[2, 4])], 0));
    assert!(m.contains("cat"), "{m}");
    let m = msg(f(&[1, 3, 5, 5]).conv2d(&f(&[4, 2, 3, 3]), None, Conv2dOptions::default()));
    assert!(m.contains("conv2d"), "{m}");
    let m = msg(f(&[1, 3, 2, 2]).conv2d(&f(&[4, 3, 3, 3]), None, Conv2dOptions::default()));
    assert!(m.contains("conv2d") && m.contains("larger"), "{m}");
    let m = msg(f(&[3, 4]).linear(&f(&[5, 3]), None));
    assert!(
        m.contains("linear") && m.contains("4") && m.contains("vs 3 (the in_features"),
        "{m}"
    );
    let m = msg(f(&[3, 4]).layer_norm(&[3], None, None, 1e-5));
    assert!(m.contains("layer_norm"), "{m}");
    let m = msg(Tensor::from_vec(vec![1.0f32; 5], &[2, 3], Device::Cpu));
    assert!(m.contains("5 values") && m.contains("[2, 3]"), "{m}");
    let m = msg(f(&[2, 3]).mse_loss(&f(&[3, 2]), Reduction::Mean));
    assert!(m.contains("mse_loss"), "{m}");
    let m = msg(f(&[2, 3]).expand(&[3, 3]));
    assert!(m.contains("expand"), "{m}");
}

#[test]
fn dtype_errors() {
    let i = Tensor::arange(0.0, 4.0, 1.0, DType::I64, Device::Cpu).unwrap();
    let m = msg(i.exp());
    assert!(m.contains("exp") && m.contains("I64"), "{m}");
    let m = msg(f(&[4, 3]).index_select(0, &f(&[2])));
    assert!(m.contains("index_select") && m.contains("F32"), "{m}");
    let m = msg(Tensor::where_cond(&f(&[2]), &f(&[2]), &f(&[2])));
    assert!(m.contains("where") && m.contains("U8"), "{m}");
    let h = Tensor::ones(&[2, 2], DType::F16, Device::Cpu).unwrap();
    let m = msg(h.matmul(&f(&[2, 2])));
    assert!(
        m.contains("matmul") && m.contains("F16") && m.contains("F32"),
        "{m}"
    );
    let m = msg(f(&[2, 3]).cross_entropy(&f(&[2]), Default::default()));
    assert!(m.contains("cross_entropy") && m.contains("I64"), "{m}");
}

#[test]
fn out_of_range_indices_and_dims() {
    let x = f(&[4, 3]);
    let bad = Tensor::from_vec(vec![0i64, 4], &[2], Device::Cpu).unwrap();
    let m = msg(x.index_select(0, &bad));
    assert!(m.contains("index 4") && m.contains("size 4"), "{m}");
    let neg = Tensor::from_vec(vec![-1i64], &[1], Device::Cpu).unwrap();
    assert!(msg(x.index_select(0, &neg)).contains("-1"));
    let gi = Tensor::from_vec(vec![3i64; 4], &[4, 1], Device::Cpu).unwrap();
    assert!(msg(x.gather(1, &gi)).contains("gather"));
    let t = Tensor::from_vec(vec![0i64, 7, 1, 2], &[4], Device::Cpu).unwrap();
    let m = msg(x.cross_entropy(&t, Default::default()));
    assert!(
        m.contains("cross_entropy") && m.contains("target 7") && m.contains("3 classes"),
        "{m}"
    );
    // A negative target other than ignore_index is out of range too.
    let t = Tensor::from_vec(vec![0i64, -1, 1, -100], &[4], Device::Cpu).unwrap();
    let m = msg(x.cross_entropy(&t, Default::default()));
    assert!(m.contains("target -1"), "{m}");
    let m = msg(x.nll_loss(&t, Reduction::Mean, -100));
    assert!(m.contains("-1"), "{m}");
    let m = msg(x.sum(&[2], false));
    assert!(m.contains("dimension 2") && m.contains("rank 2"), "{m}");
    assert!(msg(x.narrow(0, 3, 2)).contains("out of bounds"));
    assert!(msg(x.transpose(0, -3)).contains("-3"));
    assert!(msg(x.permute(&[0, 0])).contains("permutation"));
    let emb = Tensor::from_vec(vec![9i64], &[1], Device::Cpu).unwrap();
    assert!(msg(Tensor::embedding(&emb, &x)).contains("index 9"));
}

#[test]
fn empty_tensors() {
    let e = f(&[0, 3]);
    assert!(msg(e.mean_all()).contains("empty"));
    assert!(msg(e.max(0, false)).contains("empty"));
    assert!(msg(e.var(&[], 1, false)).contains("empty"));
    assert!(msg(e.mean(&[0], false)).contains("empty"));
    // Reducing a non-empty dim of an empty tensor is an empty result, as in PyTorch.
    assert_eq!(e.mean(&[1], false).unwrap().shape(), &[0]);
    let (v, i) = e.max(1, false).unwrap();
    assert_eq!((v.shape(), i.shape()), (&[0][..], &[0][..]));
    assert_eq!(e.argmin(1, true).unwrap().shape(), &[0, 1]);
    assert_eq!(e.var(&[1], 1, false).unwrap().shape(), &[0]);
    assert_eq!(
        e.layer_norm(&[3], None, None, 1e-5).unwrap().shape(),
        &[0, 3]
    );
    let m = msg(f(&[3, 0]).layer_norm(&[0], None, None, 1e-5));
    assert!(m.contains("layer_norm") && m.contains("empty"), "{m}");
    // Sums of nothing are zero, as in PyTorch; shapes of empty results are kept.
    assert_eq!(e.sum_all().unwrap().item().unwrap(), 0.0);
    assert_eq!(e.sum(&[0], false).unwrap().shape(), &[3]);
    assert_eq!(e.exp().unwrap().shape(), &[0, 3]);
    assert!(msg(Tensor::cat(&[], 0)).contains("no tensors"));
    assert!(msg(f(&[1, 1, 0, 4]).max_pool2d(MaxPool2dOptions::new(2))).contains("max_pool2d"));
}

#[test]
fn bad_arguments() {
    assert!(msg(f(&[2]).dropout(1.5, true)).contains("probability"));
    assert!(msg(Tensor::arange(0.0, 1.0, 0.0, DType::F32, Device::Cpu)).contains("arange"));
    let o = Conv2dOptions {
        stride: [0, 1],
        ..Default::default()
    };
    assert!(msg(f(&[1, 1, 3, 3]).conv2d(&f(&[1, 1, 1, 1]), None, o)).contains("stride"));
    let ce = CrossEntropyOptions {
        label_smoothing: 2.0,
        ..Default::default()
    };
    let t = Tensor::from_vec(vec![0i64], &[1], Device::Cpu).unwrap();
    assert!(msg(f(&[1, 2]).cross_entropy(&t, ce)).contains("label_smoothing"));
    let m = msg(f(&[1, 4]).batch_norm(None, None, None, None, true, 0.1, 1e-5));
    assert!(m.contains("more than one value"), "{m}");
    assert!(
        msg(f(&[2, 3]).batch_norm(None, None, None, None, false, 0.1, 1e-5)).contains("running")
    );
    assert!(msg(f(&[3]).var(&[0], 3, false)).contains("correction"));
}

#[test]
fn cuda_without_a_gpu_is_a_clear_error() {
    if Device::cuda(0).is_ok() {
        assert_eq!(Device::best(), Device::Cuda(0));
        eprintln!("a GPU is present: the no-GPU errors are not checked here");
    } else {
        assert_eq!(Device::best(), Device::Cpu);
        let m = msg(Device::cuda(0));
        assert!(
            m.contains("CUDA backend not available") && m.contains("cuda:0"),
            "{m}"
        );
        assert!(msg(Tensor::zeros(&[2], DType::F32, Device::Cuda(0))).contains("CUDA"));
        let m = msg(f(&[2]).to_device(Device::Cuda(1)));
        assert!(m.contains("cuda:1"), "{m}");
    }
    assert_eq!(Device::parse("cuda:3").unwrap(), Device::Cuda(3));
    assert!(Device::parse("tpu").is_err());
}

#[test]
fn memory_statistics_name_the_device_they_cannot_count() {
    let m = msg(memory::memory_allocated(Device::Cpu));
    assert!(m.contains("memory_allocated") && m.contains("CPU"), "{m}");
    assert!(msg(memory::empty_cache(Device::Cpu)).contains("empty_cache"));
    match Device::cuda(0) {
        Err(_) => {
            let m = msg(memory::mem_get_info(Device::Cuda(0)));
            assert!(m.contains("cuda:0"), "{m}");
            assert!(memory::memory_stats(Device::Cuda(0)).is_err());
        }
        Ok(d) => {
            // Other tests of this binary allocate too: only relations that hold anyway.
            let x = Tensor::zeros(&[1 << 18], DType::F32, d).unwrap();
            let allocated = memory::memory_allocated(d).unwrap();
            assert!(allocated >= 1 << 20, "{allocated}");
            assert!(memory::max_memory_allocated(d).unwrap() >= allocated);
            assert!(memory::memory_reserved(d).unwrap() >= allocated);
            memory::reset_peak_memory_stats(d).unwrap();
            let s = memory::memory_stats(d).unwrap();
            assert!(s.peak_allocated >= s.allocated && s.peak_reserved >= s.reserved);
            drop(x);
            memory::empty_cache(d).unwrap();
            let (free, total) = memory::mem_get_info(d).unwrap();
            assert!(total > 0 && free <= total, "{free} of {total}");
            // The progress line shows the device's memory; on the CPU it has none to show.
            let mut bar = mantissa::train::EpochProgress::new("epoch 1", 10);
            let _held = Tensor::zeros(&[1 << 18], DType::F32, d).unwrap();
            bar.show_memory(d);
            let line = bar.status_line();
            assert!(
                line.contains(" mem ") && line.contains("iB peak "),
                "{line}"
            );
            bar.show_memory(Device::Cpu);
            assert!(!bar.status_line().contains("mem"));
        }
    }
}

#[test]
fn degenerate_convolutions_are_errors() {
    let t = ConvTranspose2dOptions::default();
    assert!(msg(f(&[1, 2, 0, 3]).conv_transpose2d(&f(&[2, 1, 3, 3]), None, t)).contains("empty"));
    assert!(msg(f(&[1, 2, 3, 3]).conv_transpose2d(&f(&[2, 1, 0, 3]), None, t)).contains("empty"));
    let big = ConvTranspose2dOptions {
        padding: [5, 5],
        ..t
    };
    assert!(
        msg(f(&[1, 2, 2, 2]).conv_transpose2d(&f(&[2, 1, 3, 3]), None, big))
            .contains("conv_transpose2d")
    );
    assert!(
        msg(f(&[1, 2, 3, 3]).conv2d(&f(&[2, 2, 0, 3]), None, Conv2dOptions::default()))
            .contains("conv2d")
    );
    assert!(msg(f(&[1, 1, 4, 4]).avg_pool2d(AvgPool2dOptions {
        kernel: [0, 2],
        ..AvgPool2dOptions::new(2)
    }))
    .contains("avg_pool2d"));
    // No output channels, or no input channels: errors (PyTorch refuses the first), not
    // panics in the kernels, in either memory format.
    let cl = MemoryFormat::ChannelsLast;
    for format in [MemoryFormat::Contiguous, cl] {
        let conv = |x: &[usize], w: &[usize]| {
            let x = f(x).to_memory_format(format).unwrap();
            x.conv2d(&f(w), None, Conv2dOptions::default())
        };
        for (x, w) in [([2, 3, 5, 5], [0, 3, 3, 3]), ([2, 0, 5, 5], [4, 0, 3, 3])] {
            let m = msg(conv(&x, &w));
            assert!(m.contains("conv2d") && m.contains("empty"), "{m}");
        }
        // No pixels, even where the padding would leave a window (PyTorch refuses it too).
        let padded = Conv2dOptions {
            padding: [1, 1],
            ..Default::default()
        };
        let x = f(&[1, 2, 0, 3]).to_memory_format(format).unwrap();
        let m = msg(x.conv2d(&f(&[2, 2, 1, 1]), None, padded));
        assert!(m.contains("conv2d") && m.contains("no pixels"), "{m}");
        let t = ConvTranspose2dOptions::default();
        let m = msg(f(&[1, 2, 3, 3])
            .to_memory_format(format)
            .unwrap()
            .conv_transpose2d(&f(&[2, 0, 3, 3]), None, t));
        assert!(m.contains("conv_transpose2d") && m.contains("empty"), "{m}");
    }
}

/// A Linear with no input features gives its bias in every row (PyTorch), not a division by
/// zero; its weight gradient is empty and its bias gradient counts the rows.
#[test]
fn a_linear_without_inputs_gives_its_bias() {
    let x = f(&[3, 0]).requires_grad(true).unwrap();
    let w = f(&[4, 0]).requires_grad(true).unwrap();
    let b = Tensor::from_vec(vec![1.0f32, -2.0, 0.5, 3.0], &[4], Device::Cpu)
        .unwrap()
        .requires_grad(true)
        .unwrap();
    let y = x.linear(&w, Some(&b)).unwrap();
    assert_eq!(y.shape(), &[3, 4]);
    assert_eq!(y.to_vec::<f32>().unwrap(), [1.0, -2.0, 0.5, 3.0].repeat(3));
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(w.grad().unwrap().shape(), &[4, 0]);
    assert_eq!(x.grad().unwrap().shape(), &[3, 0]);
    assert_eq!(b.grad().unwrap().to_vec::<f32>().unwrap(), vec![3.0; 4]);
}

/// An LSTM over a sequence of length 0 is an error naming the LSTM and the input as given
/// (PyTorch refuses it too); an empty batch runs.
#[test]
fn an_lstm_needs_a_step() {
    let lstm = mantissa::nn::Lstm::new(3, 4, 2, true, &mut Generator::new(1)).unwrap();
    let m = msg(lstm.forward_with_state(&f(&[2, 0, 3]), None));
    assert!(m.contains("lstm") && m.contains("[2, 0, 3]"), "{m}");
    let (y, (h, _)) = lstm.forward_with_state(&f(&[0, 5, 3]), None).unwrap();
    assert_eq!((y.shape(), h.shape()), (&[0, 5, 4][..], &[2, 0, 4][..]));
}

/// An empty batch convolves to an empty output, and its weight gradient is zero (PyTorch),
/// without asking a backend (cuDNN refuses a batch of 0).
#[test]
fn an_empty_batch_convolves_to_nothing() {
    for format in [MemoryFormat::Contiguous, MemoryFormat::ChannelsLast] {
        let x = f(&[0, 3, 5, 5])
            .to_memory_format(format)
            .unwrap()
            .detach()
            .requires_grad(true)
            .unwrap();
        let w = f(&[4, 3, 3, 3]).requires_grad(true).unwrap();
        let b = f(&[4]).requires_grad(true).unwrap();
        let y = x.conv2d(&w, Some(&b), Conv2dOptions::default()).unwrap();
        assert_eq!(y.shape(), &[0, 4, 3, 3]);
        y.sum_all().unwrap().backward().unwrap();
        assert_eq!(x.grad().unwrap().shape(), &[0, 3, 5, 5]);
        let gw = w.grad().unwrap();
        assert_eq!(gw.shape(), &[4, 3, 3, 3]);
        assert!(gw.to_vec::<f32>().unwrap().iter().all(|&v| v == 0.0));
        assert_eq!(b.grad().unwrap().to_vec::<f32>().unwrap(), vec![0.0; 4]);
    }
}
