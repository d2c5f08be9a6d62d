//! TF32 where PyTorch has it by default: f32 convolutions and the LSTM layer's products may
//! round their operands to TF32 (`torch.backends.cudnn.allow_tf32 = True`), plain matrix
//! products stay exact f32 (`torch.backends.cuda.matmul.allow_tf32 = False`). With
//! `set_cudnn_allow_tf32(false)` the first two are exact too.
//!
//! Checked against the CPU's exact f32: TF32 rounds each operand to 10 mantissa bits, so a
//! product of a few hundred terms is off by about 1e-4 relative, where exact f32 differs by
//! summation order only (about 1e-7). The emulated device (tests/emulator) rounds operands
//! to TF32 where the libraries are allowed to. A binary of its own: the switches are
//! process-wide.
#![cfg(feature = "cuda-backend")]

mod common;
use common::*;
use mantissa::backend::cuda::conv::{cudnn_allow_tf32, set_cudnn_allow_tf32};
use mantissa::backend::cuda::matmul::allow_tf32;
use mantissa::*;

/// `f` run on the CPU and on `dev`: the device's relative error against the CPU.
fn error_on(dev: Device, inputs: &[Tensor], f: impl Fn(&[Tensor]) -> Tensor) -> f64 {
    let want = vals(&f(inputs));
    let on_dev: Vec<Tensor> = inputs.iter().map(|t| t.to_device(dev).unwrap()).collect();
    rel_err(&vals(&f(&on_dev)), &want)
}

#[test]
fn convolutions_and_the_lstm_use_tf32_by_default_and_matmul_does_not() {
    let dev = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            return;
        }
    };
    if module_path!().contains("::") {
        // A module of the combined GPU binary (tests/gpu_suite), whose other files' tests
        // turned TF32 off before this one: set to the defaults, which this file's own
        // binary checks.
        set_cudnn_allow_tf32(true);
    }
    assert!(cudnn_allow_tf32(), "cuDNN-class ops allow TF32 by default");
    assert!(!allow_tf32(), "plain products are exact by default");
    // A convolution large enough that cuDNN picks a tensor-core kernel: 576 products a sum.
    let conv = |t: &[Tensor]| {
        let o = Conv2dOptions {
            padding: [1, 1],
            ..Default::default()
        };
        t[0].conv2d(&t[1], None, o).unwrap()
    };
    let conv_in = [f32s(&[8, 64, 16, 16], 1), f32s(&[64, 64, 3, 3], 2)];
    // An LSTM layer of 16 steps, batch 4, 64 inputs and hidden units: its outputs.
    let lstm = |t: &[Tensor]| {
        let (y, _, _) = Tensor::lstm_layer(&t[0], &t[1], &t[2], &t[3], &t[4], &t[5]).unwrap();
        y
    };
    let s = 0.1f32;
    let scaled = |shape: &[usize], seed| f32s(shape, seed).mul(s).unwrap();
    let lstm_in = [
        f32s(&[16, 4, 64], 3),
        scaled(&[4, 64], 4),
        scaled(&[4, 64], 5),
        scaled(&[256, 64], 6),
        scaled(&[256, 64], 7),
        scaled(&[256], 8),
    ];
    let matmul = |t: &[Tensor]| t[0].matmul(&t[1]).unwrap();
    let mm_in = [f32s(&[64, 256], 9), f32s(&[256, 64], 10)];

    let conv_default = error_on(dev, &conv_in, conv);
    let lstm_default = error_on(dev, &lstm_in, lstm);
    let mm_default = error_on(dev, &mm_in, matmul);
    set_cudnn_allow_tf32(false);
    let conv_exact = error_on(dev, &conv_in, conv);
    let lstm_exact = error_on(dev, &lstm_in, lstm);
    set_cudnn_allow_tf32(true);
    println!(
        "relative error against the CPU: conv {conv_default:.2e} (TF32 off {conv_exact:.2e}), \
         LSTM {lstm_default:.2e} (off {lstm_exact:.2e}), matmul {mm_default:.2e}"
    );
    // TF32: about 2^-11 per operand, 1e-4 after a sum; exact f32: summation order only.
    for (what, e) in [("conv", conv_default), ("LSTM", lstm_default)] {
        assert!(
            (2e-5..5e-3).contains(&e),
            "{what} by default: {e:.2e} (TF32-sized expected)"
        );
    }
    for (what, e) in [
        ("conv, TF32 off", conv_exact),
        ("LSTM, TF32 off", lstm_exact),
        ("matmul by default", mm_default),
    ] {
        assert!(e < 5e-6, "{what}: {e:.2e} (exact f32 expected)");
    }
}
