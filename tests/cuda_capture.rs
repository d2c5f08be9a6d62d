//! What a CUDA graph capture needs that the eager path does not, as the driver and the
//! libraries rule it (the emulated ones of tests/emulator refuse the same):
//!
//! - A module load (and its NVRTC compile), a cuBLAS, cuBLASLt or cuDNN handle, or cuDNN's
//!   benchmark search that would first happen inside a capture is refused by name
//!   ([`Error::NotCapturable`]) instead of failing in the driver; the step captures once the
//!   eager path has done it.
//! - A product captured on cuBLAS runs in the workspace its handle was given for its life.
//! - Opening a capture gives the general cache's free memory back to the driver first, so a
//!   step whose memory passes half the device still captures, and capturing again does not
//!   grow the reserved memory.
//!
//! Run on the emulated device with a small memory (.ci/run:
//! `MANTISSA_EMU_MEM_BYTES=134217728 bash tests/emulator/run.sh --release --test cuda_capture`);
//! a process of its own, so that no other test has loaded a kernel or made a handle first.
//! Without a GPU each test prints `skipped: no CUDA device` and passes.
#![cfg(feature = "cuda-backend")]

mod common;
use common::parity::gpu;
use mantissa::backend::memory::{empty_cache, mem_get_info, memory_stats};
use mantissa::graph::CapturedStep;
use mantissa::*;
use std::cell::Cell;

/// One test at a time: a capture records all work on the device's compute stream.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs a step whose eager warm-up call does `warm` and whose captured call does `first`
/// (work the warm-up did not do): the captured call's outcome.
fn capture_after(
    d: Device,
    x: &Tensor,
    warm: impl Fn(&Tensor) -> Result<Tensor>,
    first: impl Fn(&Tensor) -> Result<Tensor>,
) -> Result<Vec<Tensor>> {
    let calls = Cell::new(0);
    let mut step = CapturedStep::new(d, |b: &[Tensor]| {
        calls.set(calls.get() + 1);
        let y = match calls.get() {
            1 => warm(&b[0])?,
            _ => first(&b[0])?,
        };
        Ok(vec![y])
    })?
    .with_warmup(1);
    step.run(std::slice::from_ref(x))?;
    step.run(std::slice::from_ref(x))
}

/// Asserts a refusal naming `what`, then that the step captures and replays once the eager
/// path has done `first` (the device is usable after the refused capture).
fn refused_then_captured(
    d: Device,
    x: &Tensor,
    what: &str,
    first: impl Fn(&Tensor) -> Result<Tensor> + Copy,
) {
    let warm = |x: &Tensor| x.add(x);
    match capture_after(d, x, warm, first) {
        Err(Error::NotCapturable { op, .. }) => assert!(op.contains(what), "{op}"),
        Err(e) => panic!("expected a refusal naming {what}, got {e}"),
        Ok(_) => panic!("expected a refusal naming {what}, the capture went through"),
    }
    let eager = first(x).unwrap().to_vec::<f32>().unwrap();
    let replayed = capture_after(d, x, first, first).unwrap();
    assert_eq!(
        replayed[0].to_vec::<f32>().unwrap(),
        eager,
        "{what}: replay"
    );
}

#[test]
fn first_uses_inside_a_capture_are_refused_by_name() {
    let _s = serial();
    let Some(d) = gpu() else { return };
    let x = Tensor::randn(&[8, 8], DType::F32, d).unwrap();
    let w = Tensor::randn(&[8, 8], DType::F32, d).unwrap();
    let b = Tensor::randn(&[8], DType::F32, d).unwrap();
    let k = Tensor::randn(&[4, 1, 3, 3], DType::F32, d).unwrap();
    // The sort kernels' module, first loaded in the captured call.
    refused_then_captured(d, &x, "loading kernel file sort.cu", |x| {
        x.sort(-1, false).map(|(v, _)| v)
    });
    // The cuBLAS handle, first made by a product in the captured call; then the product is
    // captured and replayed in the handle's workspace (the emulated cuBLAS refuses a captured
    // product on a handle without one).
    refused_then_captured(d, &x, "creating the cuBLAS handle", |x| x.matmul(&w));
    // cuBLASLt's, for Linear's bias epilogue.
    refused_then_captured(d, &x, "creating the cuBLASLt handle", |x| {
        x.linear(&w, Some(&b))
    });
    // cuDNN's, at the first convolution.
    let image = |x: &Tensor| x.reshape(&[1, 1, 8, 8]);
    refused_then_captured(d, &x, "creating the cuDNN handle", |x| {
        image(x)?
            .conv2d(&k, None, Default::default())?
            .reshape(&[4, 36])
    });
    // cuDNN's benchmark search, for a convolution shape first seen in the captured call.
    backend::cuda::conv::set_cudnn_benchmark(true);
    let k2 = Tensor::randn(&[2, 1, 5, 5], DType::F32, d).unwrap();
    refused_then_captured(d, &x, "benchmark search", |x| {
        image(x)?
            .conv2d(&k2, None, Default::default())?
            .reshape(&[2, 16])
    });
    backend::cuda::conv::set_cudnn_benchmark(false);
}

#[test]
fn a_step_past_half_the_device_captures_and_captures_again_without_growing() {
    let _s = serial();
    let Some(d) = gpu() else { return };
    empty_cache(d).unwrap();
    let (free, total) = mem_get_info(d).unwrap();
    if total > 1 << 30 {
        eprintln!("skipped: meant for a device of at most 1 GiB (the emulated one with MANTISSA_EMU_MEM_BYTES)");
        return;
    }
    // Each step keeps four activations of an eighth of the free memory alive (its outputs):
    // half of it. The eager warm-up leaves them in the general cache; a capture whose
    // private pool could not take them would need 150% of the free memory.
    let n = free / 8 / 4;
    let step_fn = |b: &[Tensor]| -> Result<Vec<Tensor>> {
        let a = b[0].mul(2.0)?;
        let c = a.add(1.0)?;
        let r = c.relu()?;
        let e = r.mul(3.0)?;
        Ok(vec![a, c, r, e])
    };
    let mut step = CapturedStep::new(d, step_fn).unwrap().with_warmup(1);
    let mut reserved = Vec::new();
    for round in 0..5usize {
        // A new length each round: a new signature, so a warm-up and a new capture.
        let x = Tensor::randn(&[n - 64 * round], DType::F32, d).unwrap();
        for _ in 0..3 {
            let out = step.run(std::slice::from_ref(&x)).unwrap();
            assert_eq!(out.len(), 4);
        }
        assert_eq!(step.captures(), round + 1, "round {round}");
        // On the host: the device holds no room for an eager copy beside the graph's pool.
        let want: Vec<f32> = x
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|v| (v * 2.0 + 1.0).max(0.0) * 3.0)
            .collect();
        let got = step.run(std::slice::from_ref(&x)).unwrap();
        assert_eq!(got[3].to_vec::<f32>().unwrap(), want, "round {round}");
        drop((got, x));
        reserved.push(memory_stats(d).unwrap().reserved);
    }
    let first = reserved[0];
    assert!(
        reserved.iter().all(|&r| r <= first + (free / 8)),
        "reserved bytes after each capture: {reserved:?} (free at the start {free})"
    );
}
