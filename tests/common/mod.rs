//! Shared test helpers: seeded inputs, norm-wise comparison, finite-difference gradcheck.
#![allow(dead_code)]

pub mod attention;
pub mod examples;
pub mod parity;

use mantissa::{no_grad, DType, Device, Generator, Result, Tensor};

/// A leaf f64 tensor of normal values, requiring grad.
pub fn leaf(shape: &[usize], seed: u64) -> Tensor {
    let mut g = Generator::new(seed);
    Tensor::randn_with(shape, 0.0, 1.0, DType::F64, Device::Cpu, &mut g)
        .unwrap()
        .requires_grad(true)
        .unwrap()
}

/// A leaf f64 tensor of normal values moved onto the grid `(i + phase) / 100` (integer `i`,
/// `phase` in (0, 1)): every value is at least `min(phase, 1 - phase) / 100` from any multiple
/// of 0.01, where the tests put the kinks of abs, relu, clamp and masks, and two leaves with
/// different phases never tie (max, minimum). Central differences step 1e-6, so they never
/// straddle a kink.
pub fn grid_leaf(shape: &[usize], seed: u64, phase: f64) -> Tensor {
    let v: Vec<f64> = vals(&leaf(shape, seed))
        .iter()
        .map(|x| ((x * 100.0).floor() + phase) / 100.0)
        .collect();
    Tensor::from_vec(v, shape, Device::Cpu)
        .unwrap()
        .requires_grad(true)
        .unwrap()
}

/// An f32 tensor of normal values (no grad).
pub fn f32s(shape: &[usize], seed: u64) -> Tensor {
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

/// Values of `t` as f64.
pub fn vals(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().unwrap()
}

/// `||a - b|| / max(||b||, 1e-12)`.
pub fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).powi(2))
        .sum::<f64>()
        .sqrt();
    let den: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    num / den.max(1e-12)
}

pub fn assert_close(a: &[f64], b: &[f64], tol: f64, what: &str) {
    let e = rel_err(a, b);
    assert!(
        e <= tol,
        "{what}: relative error {e:.3e} > {tol:.1e}\n got  {a:?}\n want {b:?}"
    );
}

/// `y` and the gradients of `leaves` from `sum(y * g)`; the leaves' gradients are cleared
/// afterwards, so the same leaves can be used again.
pub fn output_and_grads(y: &Tensor, g: &Tensor, leaves: &[&Tensor]) -> Vec<Vec<f64>> {
    y.mul(&g.to_dtype(y.dtype()).unwrap())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let mut out = vec![vals(y)];
    for t in leaves {
        out.push(vals(&t.grad().expect("a gradient")));
        t.zero_grad();
    }
    out
}

/// Each of `got` (an output, then the inputs' gradients) within `tol` of `want`, norm-wise;
/// only the error is printed (the vectors are long).
pub fn assert_outputs_close(got: &[Vec<f64>], want: &[Vec<f64>], tol: f64, what: &str) {
    let names = [
        "output",
        "input gradient",
        "weight gradient",
        "bias gradient",
    ];
    assert_eq!(got.len(), want.len(), "{what}: number of results");
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        let e = rel_err(g, w);
        let name = names.get(k).copied().unwrap_or("gradient");
        assert!(
            e <= tol,
            "{what}: {name}: relative error {e:.3e} > {tol:.1e}"
        );
    }
}

/// Checks the gradients of `f` at `inputs` (f64 leaves) against central finite differences.
/// The output is contracted with fixed random weights, so every output element is tested.
pub fn gradcheck(inputs: &[Tensor], f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    gradcheck_tol(inputs, 1e-6, f)
}

pub fn gradcheck_tol(inputs: &[Tensor], tol: f64, f: impl Fn(&[Tensor]) -> Result<Tensor>) {
    for x in inputs {
        x.zero_grad();
    }
    let out = f(inputs).expect("forward");
    let mut gen = Generator::new(12345);
    let w = Tensor::randn_with(out.shape(), 0.0, 1.0, DType::F64, Device::Cpu, &mut gen).unwrap();
    let wv = vals(&w);
    out.mul(&w)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .expect("backward");
    let loss_at = |xs: &[Tensor]| -> f64 {
        no_grad(|| {
            let o = f(xs).expect("forward");
            vals(&o).iter().zip(&wv).map(|(a, b)| a * b).sum()
        })
    };
    let h = 1e-6;
    for (i, x) in inputs.iter().enumerate() {
        let base = vals(x);
        let mut numeric = vec![0.0; base.len()];
        for j in 0..base.len() {
            let eval = |delta: f64| {
                let mut v = base.clone();
                v[j] += delta;
                let xi = Tensor::from_vec(v, x.shape(), Device::Cpu).unwrap();
                let mut xs: Vec<Tensor> = inputs.to_vec();
                xs[i] = xi;
                loss_at(&xs)
            };
            numeric[j] = (eval(h) - eval(-h)) / (2.0 * h);
        }
        let analytic = match x.grad() {
            Some(g) => vals(&g),
            None => vec![0.0; base.len()],
        };
        // Relative to the gradient's norm, floored at 1e-3: central differences carry an
        // absolute rounding error of about eps * |loss| / h (~1e-10 here), which a gradient
        // that is itself tiny would turn into a large relative error.
        let num: f64 = analytic
            .iter()
            .zip(&numeric)
            .map(|(a, b)| (a - b).powi(2))
            .sum::<f64>()
            .sqrt();
        let den: f64 = numeric.iter().map(|b| b * b).sum::<f64>().sqrt().max(1e-3);
        assert!(
            num / den <= tol,
            "gradient of input {i} (shape {:?}): error {:.3e} > {tol:.1e}\n got  {analytic:?}\n want {numeric:?}",
            x.shape(),
            num / den
        );
    }
}

/// Permutes a reversed leaf back to the intended shape (a strided view).
pub fn unreverse(t: &Tensor) -> Tensor {
    let perm: Vec<usize> = (0..t.rank()).rev().collect();
    t.permute(&perm).unwrap()
}

/// A leaf f64 tensor whose values are a shuffled grid at least 0.05 apart, for ops with
/// kinks (max, pooling): finite differences are only valid away from ties.
pub fn distinct_leaf(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let keys = Generator::new(seed).next_u32s(n);
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| keys[i]);
    let mut v = vec![0.0; n];
    for (rank, &i) in order.iter().enumerate() {
        v[i] = (rank as f64 - n as f64 / 2.0) * 0.05;
    }
    Tensor::from_vec(v, shape, Device::Cpu)
        .unwrap()
        .requires_grad(true)
        .unwrap()
}

/// A checkpoint path in a folder of its own under the system's temporary folder, unique to
/// this process, the test file (`file`) and the test (`name`).
pub fn temp_checkpoint(file: &str, name: &str) -> std::path::PathBuf {
    std::env::temp_dir()
        .join(format!("mantissa-{file}-{}-{name}", std::process::id()))
        .join("ck.safetensors")
}

/// Parameters on `d` with gradients of every listed kind for gradient clipping: f32, f16
/// channels-last, bf16 as a transposed view that does not fill its storage, and an f32 one
/// spanning several 16,384-element chunks of the multi-tensor passes. Gradients of normal
/// values times 3 (a norm well above 1).
pub fn clip_params(d: Device) -> Vec<Tensor> {
    use mantissa::MemoryFormat;
    let grad = |shape: &[usize], seed: u64, dtype: DType| {
        f32s(shape, seed)
            .mul(3.0)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .to_device(d)
            .unwrap()
    };
    let param = |shape: &[usize], dtype: DType| {
        Tensor::zeros(shape, dtype, d)
            .unwrap()
            .requires_grad(true)
            .unwrap()
    };
    let a = param(&[3, 4], DType::F32);
    a.set_grad(Some(grad(&[3, 4], 1, DType::F32))).unwrap();
    let b = param(&[2, 3, 4, 5], DType::F16);
    let gb = grad(&[2, 3, 4, 5], 2, DType::F16)
        .to_memory_format(MemoryFormat::ChannelsLast)
        .unwrap();
    b.set_grad(Some(gb)).unwrap();
    let c = param(&[5, 3], DType::BF16);
    let gc = grad(&[4, 6], 3, DType::BF16)
        .narrow(1, 1, 5)
        .unwrap()
        .narrow(0, 0, 3)
        .unwrap()
        .transpose(0, 1)
        .unwrap();
    c.set_grad(Some(gc)).unwrap();
    let e = param(&[40_000], DType::F32);
    e.set_grad(Some(grad(&[40_000], 4, DType::F32))).unwrap();
    vec![a, b, c, e]
}

/// A tensor stored in a safetensors file (the PyTorch reference files of `tests/torch_ref/`)
/// as an engine tensor on the CPU: F32, I64 or U8.
pub fn stored(v: &safetensors::tensor::TensorView) -> Tensor {
    let (shape, data) = (v.shape(), v.data());
    match v.dtype() {
        safetensors::Dtype::F32 => {
            let x: Vec<f32> = data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            Tensor::from_vec(x, shape, Device::Cpu)
        }
        safetensors::Dtype::I64 => {
            let x: Vec<i64> = data
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                .collect();
            Tensor::from_vec(x, shape, Device::Cpu)
        }
        safetensors::Dtype::U8 => Tensor::from_vec(data.to_vec(), shape, Device::Cpu),
        d => panic!("unexpected dtype {d:?}"),
    }
    .unwrap()
}
