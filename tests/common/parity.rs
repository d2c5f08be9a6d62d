//! CPU-vs-CUDA parity helpers (tests/cuda_parity.rs, tests/cuda_semantics.rs): the GPU if
//! there is one, per-dtype bands, and `parity`, which runs an op and its backward on both.

use super::{assert_close, f32s, vals};
use mantissa::{DType, Device, Result, Tensor};

/// The first CUDA device; `None` (printing `skipped: no CUDA device`) without one.
pub fn gpu() -> Option<Device> {
    match Device::cuda(0) {
        Ok(d) => {
            // The GPU tests compare f32 results with the CPU's: exact f32 convolutions and
            // LSTM products, not TF32 (on by default for those, as in PyTorch).
            #[cfg(feature = "cuda-backend")]
            mantissa::backend::cuda::conv::set_cudnn_allow_tf32(false);
            Some(d)
        }
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            None
        }
    }
}

/// Whether `d` is the emulated device of tests/emulator (synchronous: nothing is ever still
/// running, and a product of large matrices takes minutes).
#[allow(dead_code)]
pub fn emulated(d: Device) -> bool {
    #[cfg(feature = "cuda-backend")]
    if let Device::Cuda(n) = d {
        return mantissa::backend::cuda::probe::report(n)
            .is_ok_and(|r| r.name.contains("emulated"));
    }
    let _ = d;
    false
}

/// The float dtypes the CUDA backend computes in.
pub const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Norm-wise band between the two devices: f32 differs by summation order only; a half
/// result may round the other way once.
pub fn band(dt: DType) -> f64 {
    match dt {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        _ => 1.6e-2,
    }
}

/// A copy of `x` on `d` that owns its storage: `to_device` to the same device returns `x`
/// itself (as PyTorch's `.to` does), and marking that as requiring grad, or stepping an
/// optimizer on it, would change the shared input.
pub fn own(x: &Tensor, d: Device) -> Tensor {
    x.to_device(d).unwrap().copy().unwrap()
}

pub fn input(shape: &[usize], dt: DType, seed: u64) -> Tensor {
    f32s(shape, seed).to_dtype(dt).unwrap()
}

/// Runs `f` on CPU and on GPU copies of `inputs` (float ones require grad), back-propagates
/// `sum(out * w)` for fixed weights `w`, and compares the outputs and every input gradient.
pub fn parity(what: &str, gpu: Device, inputs: &[Tensor], f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    let run = |d: Device| -> (Vec<f64>, Vec<Option<Vec<f64>>>, DType) {
        let xs: Vec<Tensor> = inputs
            .iter()
            .map(|x| {
                let float = x.dtype().is_float();
                own(x, d).requires_grad(float).unwrap()
            })
            .collect();
        let y = f(&xs).unwrap_or_else(|e| panic!("{what} on {d}: {e}"));
        assert_eq!(y.device(), d, "{what}: output device");
        // A float result of integer inputs (true division) has no graph to go back through.
        if y.dtype().is_float() && y.is_requires_grad() {
            let w = input(y.shape(), y.dtype(), 99).to_device(d).unwrap();
            let loss = y.mul(&w).unwrap().sum_all().unwrap();
            loss.backward()
                .unwrap_or_else(|e| panic!("{what} backward on {d}: {e}"));
        }
        let grads = xs.iter().map(|x| x.grad().map(|g| vals(&g))).collect();
        (vals(&y), grads, y.dtype())
    };
    let (want, want_g, dt) = run(Device::Cpu);
    let (got, got_g, _) = run(gpu);
    let tol = band(dt);
    assert_close(&got, &want, tol, &format!("{what} forward ({dt:?})"));
    for (i, (g, w)) in got_g.iter().zip(&want_g).enumerate() {
        match (g, w) {
            (Some(g), Some(w)) => assert_close(g, w, tol, &format!("{what} grad {i} ({dt:?})")),
            (None, None) => {}
            _ => panic!("{what}: gradient {i} present on one device only"),
        }
    }
}

/// cuDNN's deterministic algorithms only (`conv::set_cudnn_deterministic`) while this lives:
/// for tests that compare two runs bit for bit, which a backward algorithm that adds with
/// atomics would fail (on the emulated device, its algorithm 0 of backward data and filter
/// sums in another order each run). The switch is process-wide: hold it under the test's
/// serial lock.
pub struct CudnnDeterministic(());

impl CudnnDeterministic {
    pub fn on() -> CudnnDeterministic {
        #[cfg(feature = "cuda-backend")]
        mantissa::backend::cuda::conv::set_cudnn_deterministic(true);
        CudnnDeterministic(())
    }
}

impl Drop for CudnnDeterministic {
    fn drop(&mut self) {
        #[cfg(feature = "cuda-backend")]
        mantissa::backend::cuda::conv::set_cudnn_deterministic(false);
    }
}
