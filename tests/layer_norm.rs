//! The fused layer norm against its definition, composed in f64 from differentiable ops:
//! outputs and gradients (input, weight, bias), with and without affine parameters, sizes
//! that run in parallel, half dtypes, inputs far from zero mean, and dtype promotion.

mod common;

use common::{assert_outputs_close, output_and_grads, vals};
use mantissa::{DType, Device, Generator, Result, Tensor};

fn input(shape: &[usize], dtype: DType, m: f64, s: f64, seed: u64) -> Tensor {
    let mut g = Generator::new(seed);
    Tensor::randn_with(shape, m, s, DType::F64, Device::Cpu, &mut g)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .requires_grad(true)
        .unwrap()
}

/// The definition over the trailing `k` dims, in f64.
fn reference(x: &Tensor, k: usize, w: Option<&Tensor>, b: Option<&Tensor>) -> Result<Tensor> {
    let dims: Vec<isize> = (-(k as isize)..0).collect();
    let mean = x.mean(&dims, true)?;
    let var = x.var(&dims, 0, true)?;
    let y = x.sub(&mean)?.mul(&var.add(1e-5)?.rsqrt()?)?;
    let y = match w {
        Some(w) => y.mul(w)?,
        None => y,
    };
    match b {
        Some(b) => y.add(b),
        None => Ok(y),
    }
}

fn check(shape: &[usize], k: usize, dtype: DType, mean: f64, affine: bool, tol: f64) {
    let what = format!("{shape:?} over {k} dims, {dtype:?}, mean {mean}, affine {affine}");
    let p = &shape[shape.len() - k..];
    let x = input(shape, dtype, mean, 2.0, 1);
    let x64 = Tensor::from_vec(vals(&x), shape, Device::Cpu)
        .unwrap()
        .requires_grad(true)
        .unwrap();
    let (w, b) = (input(p, dtype, 1.0, 0.5, 2), input(p, dtype, 0.0, 1.0, 3));
    let w64 = Tensor::from_vec(vals(&w), p, Device::Cpu)
        .unwrap()
        .requires_grad(true)
        .unwrap();
    let b64 = Tensor::from_vec(vals(&b), p, Device::Cpu)
        .unwrap()
        .requires_grad(true)
        .unwrap();
    let g = input(shape, DType::F64, 0.0, 1.0, 4);
    let (got, want) = if affine {
        let y = x.layer_norm(p, Some(&w), Some(&b), 1e-5).unwrap();
        assert_eq!(y.dtype(), dtype, "{what}: output dtype");
        let y64 = reference(&x64, k, Some(&w64), Some(&b64)).unwrap();
        (
            output_and_grads(&y, &g, &[&x, &w, &b]),
            output_and_grads(&y64, &g, &[&x64, &w64, &b64]),
        )
    } else {
        let y = x.layer_norm(p, None, None, 1e-5).unwrap();
        let y64 = reference(&x64, k, None, None).unwrap();
        (
            output_and_grads(&y, &g, &[&x]),
            output_and_grads(&y64, &g, &[&x64]),
        )
    };
    assert_outputs_close(&got, &want, tol, &what);
}

#[test]
fn fused_layer_norm_matches_its_definition() {
    // [64, 700] is 44,800 elements: rows in parallel; [300, 160], the parameters' gradients
    // summed over five groups of rows.
    let shapes = [
        (&[64, 700][..], 1),
        (&[300, 160][..], 1),
        (&[3, 7, 8][..], 2),
        (&[5, 1][..], 1),
    ];
    for (shape, k) in shapes {
        for affine in [true, false] {
            check(shape, k, DType::F64, 0.5, affine, 1e-12);
            check(shape, k, DType::F32, 0.5, affine, 1e-5);
            check(shape, k, DType::BF16, 0.5, affine, 2e-2);
            check(shape, k, DType::F16, 0.5, affine, 3e-3);
        }
    }
}

#[test]
fn rows_far_from_zero_keep_their_precision() {
    check(&[64, 700], 1, DType::F32, 1000.0, true, 3e-5);
}

#[test]
fn half_input_with_f32_parameters_promotes_to_f32() {
    let x = input(&[4, 6], DType::F16, 0.0, 1.0, 5);
    let w = input(&[6], DType::F32, 1.0, 0.5, 6);
    let y = x.layer_norm(&[6], Some(&w), None, 1e-5).unwrap();
    assert_eq!(y.dtype(), DType::F32);
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().dtype(), DType::F16);
    assert_eq!(w.grad().unwrap().dtype(), DType::F32);
}

/// `(x - mean) / sqrt(var + eps)` over the last dim, times `w`, plus `b`, on host values.
fn rows_ref(x: &[f64], n: usize, eps: f64, w: Option<&[f64]>, b: Option<&[f64]>) -> Vec<f64> {
    let mut out = Vec::new();
    for row in x.chunks(n) {
        let mean = row.iter().sum::<f64>() / n as f64;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n as f64;
        for (k, v) in row.iter().enumerate() {
            let y = (v - mean) / (var + eps).sqrt();
            out.push(y * w.map_or(1.0, |w| w[k]) + b.map_or(0.0, |b| b[k]));
        }
    }
    out
}

#[test]
fn layer_norm_module_options() {
    use mantissa::nn::{LayerNorm, Module};
    let x = input(&[3, 6], DType::F32, 0.5, 2.0, 7);
    let xv = vals(&x);
    // PyTorch's defaults.
    let ln = LayerNorm::new(&[6]).unwrap();
    assert_eq!(ln.eps, 1e-5);
    let (w, b) = (ln.weight.as_ref().unwrap(), ln.bias.as_ref().unwrap());
    assert_eq!((vals(w), vals(b)), (vec![1.0; 6], vec![0.0; 6]));
    assert_eq!(
        ln.state_dict().into_keys().collect::<Vec<_>>(),
        ["bias", "weight"]
    );
    // Weight without bias, another eps.
    let ln = LayerNorm::with_options(&[6], 0.1, true, false).unwrap();
    assert!(ln.bias.is_none());
    let names: Vec<String> = ln.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["weight"]);
    let wv: Vec<f64> = (0..6).map(|k| 0.5 + k as f64 * 0.25).collect();
    let w = ln.weight.as_ref().unwrap();
    mantissa::no_grad(|| w.copy_(&Tensor::from_vec(wv.clone(), &[6], Device::Cpu)?)).unwrap();
    let y = ln.forward(&x).unwrap();
    common::assert_close(
        &vals(&y),
        &rows_ref(&xv, 6, 0.1, Some(&wv), None),
        1e-6,
        "weight only",
    );
    y.sum_all().unwrap().backward().unwrap();
    assert!(ln.weight.as_ref().unwrap().grad().is_some());
    // No affine parameters at all (bias asked for but not made, as in PyTorch).
    let mut ln = LayerNorm::with_options(&[6], 1e-5, false, true).unwrap();
    assert!(ln.weight.is_none() && ln.bias.is_none() && ln.parameters().is_empty());
    assert!(ln.state_dict().is_empty());
    ln.to_dtype(DType::F16).unwrap();
    let y = ln.forward(&x).unwrap();
    common::assert_close(
        &vals(&y),
        &rows_ref(&xv, 6, 1e-5, None, None),
        1e-6,
        "no affine",
    );
    // Over two dims.
    let ln = LayerNorm::with_options(&[2, 3], 1e-5, true, true).unwrap();
    let y = ln.forward(&x.reshape(&[3, 2, 3]).unwrap()).unwrap();
    common::assert_close(
        &vals(&y),
        &rows_ref(&xv, 6, 1e-5, None, None),
        1e-6,
        "two dims",
    );
    // Refused: an empty shape, a zero, eps negative or not finite.
    for (shape, eps) in [
        (&[][..], 1e-5),
        (&[4, 0][..], 1e-5),
        (&[4][..], -1e-3),
        (&[4][..], f64::NAN),
        (&[4][..], f64::INFINITY),
    ] {
        let e = LayerNorm::with_options(shape, eps, true, true)
            .err()
            .expect("refused");
        let m = e.to_string();
        assert!(
            m.contains("LayerNorm") && m.contains(&format!("{shape:?}")),
            "{m}"
        );
    }
}

/// With the weight frozen, the input and the bias get the gradients they get when every
/// operand trains, and the weight none.
#[test]
fn a_frozen_weight_leaves_the_other_gradients_as_they_are() {
    let (shape, p) = (&[40, 24][..], &[24][..]);
    let run = |train_w: bool| {
        let x = input(shape, DType::F32, 0.5, 2.0, 1);
        let w = input(p, DType::F32, 1.0, 0.5, 2)
            .requires_grad(train_w)
            .unwrap();
        let b = input(p, DType::F32, 0.0, 1.0, 3);
        let g = input(shape, DType::F32, 0.0, 1.0, 4).detach();
        let y = x.layer_norm(p, Some(&w), Some(&b), 1e-5).unwrap();
        y.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
        (
            x.grad().map(|t| vals(&t)),
            w.grad(),
            b.grad().map(|t| vals(&t)),
        )
    };
    let (dx, dw, db) = run(true);
    let (fx, fw, fb) = run(false);
    assert!(dw.is_some() && fw.is_none(), "the frozen weight's gradient");
    assert_eq!((fx, fb), (dx, db), "the input's and the bias's gradients");
}
