//! cuDNN's deterministic mode (`conv::set_cudnn_deterministic`, PyTorch's
//! `cudnn.deterministic`) on the GPU: with it, a convolution's backward runs twice to the
//! same bits, whether cuDNN's heuristics or its timed search (`set_cudnn_benchmark`) choose
//! the algorithms, and the graph API's fused weight gradient (`set_conv_bn_fusion`) runs on a
//! deterministic engine. On the emulated device (tests/emulator/dnn.cpp), whose algorithm 0
//! of backward data and backward filter is reported non-deterministic and adds in another
//! order each run (as atomics do), the tests also check the other side: without the mode
//! that algorithm is chosen and two runs differ in their bits, the choice is remembered per
//! setting of the switch, and the fused weight gradient runs on the engine whose numerical
//! note says non-deterministic. A binary of its own, its tests one at a time: the switches
//! are process-wide. Without a GPU each test prints `skipped: no CUDA device` and passes.
#![cfg(feature = "cuda-backend")]

mod common;
use common::parity::{emulated, gpu, input, own};
use mantissa::backend::cuda::conv::{set_cudnn_benchmark, set_cudnn_deterministic};
use mantissa::backend::cuda::conv_stats::set_conv_bn_fusion;
use mantissa::nn::{Activation, BatchNorm2d, Module, Sequential};
use mantissa::profiler;
use mantissa::*;

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Holds the lock; puts cuDNN's switches back to their defaults (off) when dropped.
struct Switches(#[allow(dead_code)] std::sync::MutexGuard<'static, ()>);

impl Switches {
    fn take() -> Switches {
        Switches(SERIAL.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

impl Drop for Switches {
    fn drop(&mut self) {
        set_cudnn_deterministic(false);
        set_cudnn_benchmark(false);
        set_conv_bn_fusion(false);
    }
}

/// The bits of each tensor.
fn bits(ts: &[Tensor]) -> Vec<Vec<u64>> {
    ts.iter()
        .map(|t| {
            t.to_vec_f64()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        })
        .collect()
}

/// The names of the library calls and kernels a profile saw.
fn names(p: &profiler::Profile) -> Vec<String> {
    p.kernels().iter().map(|k| k.name.clone()).collect()
}

/// The names among `names` that start with `prefix`.
fn starting<'a>(names: &'a [String], prefix: &str) -> Vec<&'a String> {
    names.iter().filter(|n| n.starts_with(prefix)).collect()
}

/// One f32 convolution's forward and backward on `d` (`[8, 6, 9, 9]` by `[10, 6, 3, 3]`,
/// padding 1, the loss a weighted sum of the output): the input's and the weight's gradients
/// as bits, and the names of the calls the profiler saw.
fn conv_backward(d: Device) -> (Vec<Vec<u64>>, Vec<String>) {
    let x = own(&input(&[8, 6, 9, 9], DType::F32, 1), d)
        .requires_grad(true)
        .unwrap();
    let w = own(&input(&[10, 6, 3, 3], DType::F32, 2), d)
        .requires_grad(true)
        .unwrap();
    let r = own(&input(&[8, 10, 9, 9], DType::F32, 3), d);
    let opts = Conv2dOptions {
        padding: [1, 1],
        ..Default::default()
    };
    let ((), p) = profiler::profile(|_| {
        let y = x.conv2d(&w, None, opts).unwrap();
        y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
    })
    .unwrap();
    (bits(&[x.grad().unwrap(), w.grad().unwrap()]), names(&p))
}

/// Which algorithm each backward pass ran, from the profiler's names: the data pass's and
/// the filter pass's (`..._ALGO_0`, say).
fn algorithms(names: &[String]) -> (String, String) {
    let algo = |pass: &str| -> String {
        let calls = starting(names, &format!("cudnn conv {pass} "));
        assert_eq!(calls.len(), 1, "one {pass} call in {names:?}");
        let at = calls[0].rfind("ALGO_").expect("the algorithm named");
        calls[0][at..].trim_end_matches(')').to_string()
    };
    (algo("Data"), algo("Filter"))
}

#[test]
fn deterministic_mode_repeats_a_convolutions_backward_bit_for_bit() {
    let _s = Switches::take();
    let Some(d) = gpu() else { return };
    for benchmark in [false, true] {
        set_cudnn_benchmark(benchmark);
        set_cudnn_deterministic(true);
        let (first, names_a) = conv_backward(d);
        let (second, names_b) = conv_backward(d);
        assert!(
            first == second,
            "benchmark {benchmark}: two runs of the backward differ in deterministic mode"
        );
        assert_eq!(algorithms(&names_a), algorithms(&names_b));
        if emulated(d) {
            // The emulated cuDNN lists (and times) its non-deterministic algorithm 0 first;
            // deterministic mode keeps algorithm 1 all the same.
            let one = ("ALGO_1".to_string(), "ALGO_1".to_string());
            assert_eq!(
                algorithms(&names_a),
                one,
                "benchmark {benchmark}: {names_a:?}"
            );
        }
    }
}

#[test]
fn without_it_the_emulated_non_deterministic_algorithm_runs_and_differs() {
    let _s = Switches::take();
    let Some(d) = gpu() else { return };
    if !emulated(d) {
        eprintln!("skipped: which algorithms a GPU's cuDNN offers is its own");
        return;
    }
    for benchmark in [false, true] {
        set_cudnn_benchmark(benchmark);
        // Off, on, off again on one shape: the choice is remembered per setting.
        for deterministic in [false, true, false] {
            set_cudnn_deterministic(deterministic);
            let (first, names) = conv_backward(d);
            let (second, _) = conv_backward(d);
            let algo = if deterministic { "ALGO_1" } else { "ALGO_0" };
            let what = format!("benchmark {benchmark} deterministic {deterministic}");
            assert_eq!(
                algorithms(&names),
                (algo.to_string(), algo.to_string()),
                "{what}: {names:?}"
            );
            // Both gradients sum over the images or the output channels, in another order
            // each run unless deterministic.
            for (i, (a, b)) in first.iter().zip(&second).enumerate() {
                assert_eq!(a == b, deterministic, "{what}: gradient {i}");
            }
        }
    }
}

/// conv 3x3 -> training batch norm -> ReLU -> conv 1x1, f16 channels-last (the fused weight
/// gradient's pattern): the second weight's gradient as bits, and the calls' names.
fn fused_backward(d: Device) -> (Vec<Vec<u64>>, Vec<String>) {
    let cl = MemoryFormat::ChannelsLast;
    let on = |t: Tensor| {
        own(&t, d)
            .to_memory_format(cl)
            .unwrap()
            .requires_grad(true)
            .unwrap()
    };
    let x = on(input(&[4, 8, 6, 5], DType::F16, 10));
    let w1 = on(input(&[16, 8, 3, 3], DType::F16, 11).mul(0.3).unwrap());
    let w2 = on(input(&[8, 16, 1, 1], DType::F16, 12).mul(0.3).unwrap());
    let pad = Conv2dOptions {
        padding: [1, 1],
        ..Default::default()
    };
    // f16 weight and bias, f32 running statistics (as cuda_fusions.rs builds it).
    let mut bn = BatchNorm2d::new(16).unwrap();
    bn.to_device(d).unwrap();
    bn.weight = own(&input(&[16], DType::F16, 13), d);
    bn.bias = own(&input(&[16], DType::F16, 14), d);
    let ((), p) = profiler::profile(|_| {
        let h = x.conv2d(&w1, None, pad).unwrap();
        let h = Sequential::new()
            .push(bn)
            .push(Activation::Relu)
            .forward(&h)
            .unwrap();
        let y = h.conv2d(&w2, None, Conv2dOptions::default()).unwrap();
        y.to_dtype(DType::F32)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
    })
    .unwrap();
    (bits(&[w2.grad().unwrap()]), names(&p))
}

#[test]
fn the_fused_weight_gradient_runs_on_a_deterministic_engine() {
    let _s = Switches::take();
    let Some(d) = gpu() else { return };
    set_conv_bn_fusion(true);
    set_cudnn_deterministic(true);
    let (first, names) = fused_backward(d);
    let (second, _) = fused_backward(d);
    assert!(first == second, "two runs differ in deterministic mode");
    let fused = starting(&names, "cudnn wgrad+bn");
    assert!(
        fused.iter().all(|n| !n.ends_with("nondeterministic")),
        "{names:?}"
    );
    if !emulated(d) {
        return;
    }
    // The emulated graph API offers a deterministic engine after the non-deterministic one:
    // the fused path still runs, on the second.
    assert_eq!(fused.len(), 1, "{names:?}");
    // Without the mode the heuristics' first engine runs, and its label says what it is.
    set_cudnn_deterministic(false);
    let (_, names) = fused_backward(d);
    let fused = starting(&names, "cudnn wgrad+bn");
    assert_eq!(fused.len(), 1, "{names:?}");
    assert!(fused[0].ends_with(" nondeterministic"), "{names:?}");
}
