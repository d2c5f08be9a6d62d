//! Memory accounting: the bytes a forward pass keeps alive for backward, fp32 vs autocast.
//! Alone in its test binary, so no other test allocates while it measures the process-wide
//! counter.

use mantissa::nn::*;
use mantissa::*;

fn f32s(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn_with(
        shape,
        0.0,
        1.0,
        DType::F32,
        Device::Cpu,
        &mut Generator::new(seed),
    )
    .unwrap()
}

/// Bytes kept alive by the graph of one CNN forward pass (activations saved for backward).
fn saved_bytes(model: &dyn Module, x: &Tensor, low: Option<DType>) -> u64 {
    let before = live_storage_bytes();
    let out = match low {
        Some(d) => amp::with_autocast(d, || model.forward(x)).unwrap().unwrap(),
        None => model.forward(x).unwrap(),
    };
    let held = live_storage_bytes() - before;
    drop(out);
    held
}

#[test]
fn half_autocast_keeps_about_half_the_activation_bytes() {
    let mut g = Generator::new(3);
    let model = Sequential::new()
        .push(Conv2d::new(1, 32, 3, Conv2dOptions::default(), true, &mut g).unwrap())
        .push(Activation::Relu)
        .push(Conv2d::new(32, 64, 3, Conv2dOptions::default(), true, &mut g).unwrap())
        .push(Activation::Relu)
        .push(MaxPool2d(MaxPool2dOptions::new(2)))
        .push(Flatten)
        .push(Linear::new(9216, 128, true, &mut g).unwrap())
        .push(Activation::Relu)
        .push(Linear::new(128, 10, true, &mut g).unwrap());
    let x = f32s(&[16, 1, 28, 28], 9);
    let full = saved_bytes(&model, &x, None);
    let half = saved_bytes(&model, &x, Some(DType::F16));
    eprintln!("MNIST CNN, batch 16: {full} bytes held after the forward in fp32, {half} under fp16 autocast ({:.2}x)", half as f64 / full as f64);
    // Not a full half: the half graph also holds the f16 weight casts (about 2.4 MB here), the
    // cast input, the i64 max-pool indices and f32 logits; and the graph keeps every op's
    // inputs alive, needed for backward or not (see the notes).
    assert!((half as f64) < 0.75 * full as f64, "{half} vs {full}");
}
