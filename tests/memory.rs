//! Memory accounting: the bytes a forward pass keeps alive for backward, fp32 vs autocast,
//! and what a convolution, batch norm and ReLU keep. Alone in their test binary, and one at a
//! time, so no other test allocates while one measures the process-wide counter.

mod common;
use common::f32s;
use mantissa::nn::*;
use mantissa::*;

/// The tests here measure one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
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
    let _one = serial();
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
    // Activations grow with the batch, saved weights (and their f16 casts) do not: the
    // slope between two batch sizes is the activation bytes per sample.
    let per_sample = |low: Option<DType>| {
        let small = saved_bytes(&model, &f32s(&[16, 1, 28, 28], 9), low);
        let large = saved_bytes(&model, &f32s(&[64, 1, 28, 28], 9), low);
        (large - small) as f64 / 48.0
    };
    let (full, half) = (per_sample(None), per_sample(Some(DType::F16)));
    eprintln!(
        "MNIST CNN activations saved for backward: {full:.0} bytes/sample fp32, {half:.0} fp16 autocast ({:.2}x)",
        half / full
    );
    // About half; the i64 max-pool indices and f32 logits are the same size in both.
    assert!(half < 0.65 * full, "{half} vs {full}");
}

#[test]
fn conv_batch_norm_relu_keeps_two_activations_not_three() {
    let _one = serial();
    let mut g = Generator::new(4);
    let (c, side) = (8, 12);
    let model = Sequential::new()
        .push(
            Conv2d::new(
                3,
                c,
                3,
                Conv2dOptions {
                    padding: [1, 1],
                    ..Default::default()
                },
                false,
                &mut g,
            )
            .unwrap(),
        )
        .push(BatchNorm2d::new(c).unwrap())
        .push(Activation::Relu);
    let per_sample = |low: Option<DType>| {
        let small = saved_bytes(&model, &f32s(&[2, 3, side, side], 5), low);
        let large = saved_bytes(&model, &f32s(&[6, 3, side, side], 5), low);
        (large - small) as f64 / 4.0
    };
    // Per sample: the convolution's output (batch norm's saved input) and the ReLU's output
    // (what its backward reads, and the forward's result). The batch norm's output, ReLU's
    // input, is not kept.
    let act = (c * side * side * 4) as f64;
    assert_eq!(per_sample(None), 2.0 * act);
}
