//! Helpers of the fused-attention tests (flash_attention.rs, cudnn_attention.rs): the fused op
//! asked for under a lock, operands from fixed seeds, a run under the profiler, and the f32
//! composition on the CPU to compare with.

use super::parity::input;
use super::vals;
use mantissa::profiler;
use mantissa::*;

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Holds the lock with the fused op asked for and cuDNN's attention let run or not; puts
/// `Auto` and cuDNN back when dropped.
pub struct FusedKernel(#[allow(dead_code)] std::sync::MutexGuard<'static, ()>);

impl FusedKernel {
    pub fn take(cudnn: bool) -> FusedKernel {
        let guard = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        set_attention_kernel(AttentionKernel::Fused);
        set_cudnn_attention(cudnn);
        FusedKernel(guard)
    }
}

impl Drop for FusedKernel {
    fn drop(&mut self) {
        set_attention_kernel(AttentionKernel::Auto);
        set_cudnn_attention(true);
    }
}

/// Norm-wise band against the f32 composition: the output and the gradients are rounded to
/// `dt` once, and the probabilities and their gradients on the way into the products (the
/// emulated device's errors peak at about 3.2e-3 in bf16, 5e-4 in f16).
pub fn band(dt: DType) -> f64 {
    match dt {
        DType::F16 => 1.5e-3,
        _ => 8e-3,
    }
}

/// What [`attend`] gives: the output and the three gradients, and the names of the kernels
/// and library calls that ran.
pub struct Run {
    pub values: Vec<Vec<f64>>,
    pub kernels: Vec<String>,
}

/// Queries `[2, 2, l, e]`, keys and values `[2, 2, s, e]` (leaves that require grad) and the
/// loss's weights `[2, 2, l, e]`, from the same seeds for the same sizes in `dt`, each passed
/// through `to` first.
pub fn operands(
    dt: DType,
    (l, s, e): (usize, usize, usize),
    to: impl Fn(Tensor) -> Tensor,
) -> [Tensor; 4] {
    let seed = (l * 7 + s * 3 + e) as u64;
    let make = |shape: &[usize], k: u64| to(input(shape, dt, seed + k));
    let leaf = |shape: &[usize], k: u64| make(shape, k).requires_grad(true).unwrap();
    [
        leaf(&[2, 2, l, e], 1),
        leaf(&[2, 2, s, e], 2),
        leaf(&[2, 2, s, e], 3),
        make(&[2, 2, l, e], 4),
    ]
}

/// Attention of `[2, 2, l, e]` queries and `[2, 2, s, e]` keys and values in `dt` on `d`,
/// and the gradients of `sum(y * w)`: [y, dq, dk, dv], with the names of the kernels run.
pub fn attend(d: Device, dt: DType, sizes: (usize, usize, usize), causal: bool) -> Run {
    let [q, k, v, w] = operands(dt, sizes, |t| t.to_device(d).unwrap().copy().unwrap());
    let opts = AttentionOptions {
        is_causal: causal,
        ..Default::default()
    };
    let (y, p) = profiler::profile(|_| {
        let y = q.scaled_dot_product_attention(&k, &v, opts).unwrap();
        y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        y
    })
    .unwrap();
    let mut values = vec![vals(&y)];
    values.extend([&q, &k, &v].map(|t| vals(&t.grad().unwrap())));
    let kernels = p.kernels().iter().map(|k| k.name.clone()).collect();
    Run { values, kernels }
}

/// The same attention composed in f32 on the CPU from the inputs rounded to `dt`.
pub fn reference(dt: DType, sizes: (usize, usize, usize), causal: bool) -> Vec<Vec<f64>> {
    let [q, k, v, w] = operands(dt, sizes, |t| t.to_dtype(DType::F32).unwrap());
    let opts = AttentionOptions {
        is_causal: causal,
        ..Default::default()
    };
    set_attention_kernel(AttentionKernel::Composed);
    let y = q.scaled_dot_product_attention(&k, &v, opts).unwrap();
    set_attention_kernel(AttentionKernel::Fused);
    y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    let mut values = vec![vals(&y)];
    values.extend([&q, &k, &v].map(|t| vals(&t.grad().unwrap())));
    values
}

/// Every element finite and within `8 band` of the largest reference magnitude: an error
/// confined to a few elements hides in a norm-wise comparison.
pub fn elementwise(got: &[f64], want: &[f64], band: f64, what: &str) {
    let top = want.iter().fold(0f64, |m, x| m.max(x.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.is_finite() && (g - w).abs() <= 8.0 * band * top,
            "{what}: element {i} is {g}, the composition's {w} (largest {top})"
        );
    }
}

/// [`attend`] on `d` against [`reference`]: the output and the three gradients within
/// [`band`] norm-wise and element by element; the kernel and call names that ran.
pub fn check_against_reference(
    d: Device,
    dt: DType,
    (l, s, e): (usize, usize, usize),
    causal: bool,
) -> Vec<String> {
    let what = format!("{dt:?} head {e}, {l} queries x {s} keys, causal {causal}");
    let got = attend(d, dt, (l, s, e), causal);
    let want = reference(dt, (l, s, e), causal);
    for (i, name) in ["output", "dq", "dk", "dv"].iter().enumerate() {
        let what = format!("{what}: {name}");
        super::assert_close(&got.values[i], &want[i], band(dt), &what);
        elementwise(&got.values[i], &want[i], band(dt), &what);
    }
    got.kernels
}

/// What [`packed_heads`] gives: `y` and the packed product's gradient, and the names of the
/// kernels and library calls of the forward and of the backward.
pub struct PackedRun {
    pub values: Vec<Vec<f64>>,
    pub forward: Vec<String>,
    pub backward: Vec<String>,
}

/// The heads of one packed `[b, t, 3 h e]` product in `dt` on `d` (seed `seed`), as a GPT
/// splits them: q, k and v transposed `[b, h, t, e]` views, attended (the composition in
/// f32, the fused op otherwise), heads merged back to `[b, t, h e]`, and `sum(y * w)`'s
/// gradient.
pub fn packed_heads(
    d: Device,
    dt: DType,
    (b, t, h, e): (usize, usize, usize, usize),
    causal: bool,
    seed: u64,
) -> PackedRun {
    let qkv = input(&[b, t, 3 * h * e], DType::BF16, seed)
        .to_dtype(dt)
        .and_then(|x| x.to_device(d))
        .and_then(|x| x.copy())
        .and_then(|x| x.requires_grad(true))
        .unwrap();
    let w = input(&[b, t, h * e], DType::BF16, seed + 1)
        .to_dtype(dt)
        .unwrap();
    let w = w.to_device(d).unwrap();
    let heads = |i: usize| {
        qkv.narrow(2, i * h * e, h * e)
            .and_then(|x| x.reshape(&[b, t, h, e]))
            .and_then(|x| x.transpose(1, 2))
            .unwrap()
    };
    let (q, k, v) = (heads(0), heads(1), heads(2));
    let opts = AttentionOptions {
        is_causal: causal,
        ..Default::default()
    };
    if dt == DType::F32 {
        set_attention_kernel(AttentionKernel::Composed);
    }
    let (y, forward) = profiler::profile(|_| {
        q.scaled_dot_product_attention(&k, &v, opts)
            .and_then(|y| y.transpose(1, 2))
            .and_then(|y| y.reshape(&[b, t, h * e]))
            .unwrap()
    })
    .unwrap();
    let ((), backward) = profiler::profile(|_| {
        y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    })
    .unwrap();
    set_attention_kernel(AttentionKernel::Fused);
    let names = |p: &profiler::Profile| p.kernels().iter().map(|k| k.name.clone()).collect();
    PackedRun {
        values: vec![vals(&y), vals(&qkv.grad().unwrap())],
        forward: names(&forward),
        backward: names(&backward),
    }
}
