//! `+ - * /` and unary `-` on tensors equal the methods they stand for: values, dtypes,
//! broadcasting and gradients, for every pairing of references, owned tensors and scalars.

mod common;
use common::*;
use mantissa::*;

/// `a` and `b` computed two ways must be the same tensor, bit for bit, with the same dtype
/// and shape.
fn same(got: Result<Tensor>, want: Result<Tensor>, what: &str) {
    let (got, want) = (got.unwrap(), want.unwrap());
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    assert_eq!(vals(&got), vals(&want), "{what}: values");
}

#[test]
fn binary_operators_equal_their_methods() {
    let a = f32s(&[3, 1, 5], 1);
    let b = f32s(&[4, 5], 2);
    same(&a + &b, a.add(&b), "&a + &b");
    same(&a - &b, a.sub(&b), "&a - &b");
    same(&a * &b, a.mul(&b), "&a * &b");
    same(&a / &b, a.div(&b), "&a / &b");
    same(a.clone() + &b, a.add(&b), "a + &b");
    same(&a - b.clone(), a.sub(&b), "&a - b");
    same(a.clone() * b.clone(), a.mul(&b), "a * b");
    same(a.clone() / b.clone(), a.div(&b), "a / b");
    // Scalars of each kind on the right.
    same(&a + 2.5, a.add(2.5), "&a + f64");
    same(&a - 2.5f32, a.sub(2.5f32), "&a - f32");
    same(&a * 3i64, a.mul(3i64), "&a * i64");
    same(a.clone() / 4i32, a.div(4i32), "a / i32");
    same(-&a, a.neg(), "-&a");
    same(-a.clone(), a.neg(), "-a");
}

#[test]
fn scalars_on_the_left_match_the_formulas() {
    let x = f32s(&[2, 7], 3);
    let xv = vals(&x);
    let check = |got: Result<Tensor>, f: &dyn Fn(f64) -> f64, what: &str| {
        let got = got.unwrap();
        assert_eq!(
            (got.dtype(), got.shape()),
            (DType::F32, &[2, 7][..]),
            "{what}"
        );
        let want: Vec<f64> = xv.iter().map(|&v| f(v)).collect();
        assert_close(&vals(&got), &want, 1e-6, what);
    };
    check(1.5 + &x, &|v| 1.5 + v, "f64 + x");
    check(1.5 - &x, &|v| 1.5 - v, "f64 - x");
    check(1.5 * &x, &|v| 1.5 * v, "f64 * x");
    check(1.5 / &x, &|v| 1.5 / v, "f64 / x");
    // Integer tensors divide truly, as the method does.
    let i = Tensor::from_vec(vec![1i64, -4, 8], &[3], Device::Cpu).unwrap();
    same(
        2.0 / &i,
        Tensor::full(&[3], 2.0, DType::I64, Device::Cpu)
            .unwrap()
            .div(&i),
        "2 / int",
    );
    assert_eq!(
        (2.0 / &i).unwrap().to_vec::<f32>().unwrap(),
        vec![2.0, -0.5, 0.25]
    );
}

#[test]
fn operators_record_the_same_gradients_as_methods() {
    let (a, b) = (leaf(&[3, 4], 5), leaf(&[4], 6));
    let g = leaf(&[3, 4], 7).detach();
    let by_ops = {
        let y = (((&a * &b).unwrap() - 0.5).unwrap() / (2.0 + &b.sqr().unwrap()).unwrap()).unwrap();
        let y = (-y).unwrap();
        output_and_grads(&y, &g, &[&a, &b])
    };
    let by_methods = {
        let den = b.sqr().unwrap().add(2.0).unwrap();
        let y = a
            .mul(&b)
            .unwrap()
            .sub(0.5)
            .unwrap()
            .div(&den)
            .unwrap()
            .neg()
            .unwrap();
        output_and_grads(&y, &g, &[&a, &b])
    };
    assert_eq!(by_ops, by_methods);
}

#[test]
fn operator_errors_are_the_methods_errors() {
    let a = f32s(&[3], 1);
    let b = f32s(&[4], 2);
    let e = (&a + &b).unwrap_err().to_string();
    assert_eq!(e, a.add(&b).unwrap_err().to_string());
    assert!(e.contains("add"), "{e}");
}

/// `values` of `dtype` as a CPU tensor.
fn typed(values: &[f64], dtype: DType) -> Tensor {
    Tensor::from_vec(values.to_vec(), &[values.len()], Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// `got` has `dtype` and the values `want` (NaN equal to NaN).
fn is(got: Result<Tensor>, dtype: DType, want: &[f64], what: &str) {
    let got = got.unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(got.dtype(), dtype, "{what}: dtype");
    let v = vals(&got);
    let same = v.len() == want.len()
        && v.iter()
            .zip(want)
            .all(|(a, b)| a == b || (a.is_nan() && b.is_nan()));
    assert!(same, "{what}: {v:?}, want {want:?}");
}

/// PyTorch's result types for a Python float and a tensor, from either side: integer tensors
/// give f32 and keep the scalar whole; float tensors keep their dtype, the scalar not rounded
/// to it first.
#[test]
fn a_scalar_on_the_left_promotes_as_on_the_right() {
    for int in [DType::I64, DType::U8] {
        let x = typed(&[1.0, 2.0], int);
        is(2.5 / &x, DType::F32, &[2.5, 1.25], "2.5 / int");
        is(
            f64::NAN / &x,
            DType::F32,
            &[f64::NAN, f64::NAN],
            "NaN / int",
        );
        is(1.0 - &x, DType::F32, &[0.0, -1.0], "1.0 - int");
        is(
            x.sub(1.0).and_then(|t| t.neg()),
            DType::F32,
            &[0.0, -1.0],
            "-(int - 1.0)",
        );
        is(2.5 * &x, DType::F32, &[2.5, 5.0], "2.5 * int");
        is(0.5 + &x, DType::F32, &[1.5, 2.5], "0.5 + int");
        // The same as the scalar on the right where the operation commutes.
        same(2.5 * &x, &x * 2.5, "2.5 * int");
        same(0.5 + &x, &x + 0.5, "0.5 + int");
    }
    let q = (0.5f32 / 200.0f32) as f64;
    is(
        0.5 / &typed(&[200.0], DType::U8),
        DType::F32,
        &[q],
        "0.5 / u8",
    );
    // Negation keeps an integer dtype, wrapping as PyTorch's does.
    is(
        -&typed(&[1.0, -2.0], DType::I64),
        DType::I64,
        &[-1.0, 2.0],
        "-i64",
    );
    is(
        -&typed(&[200.0, 0.0], DType::U8),
        DType::U8,
        &[56.0, 0.0],
        "-u8",
    );
    // Low-precision floats: computed wide, rounded once.
    for low in [DType::F16, DType::BF16] {
        let x = typed(&[1000.0, 0.5], low);
        let want = |v: f64| vals(&typed(&[v], low))[0];
        is(1e6 / &x, low, &[1000.0, want(2e6)], "1e6 / low");
        is(
            70000.0 - &typed(&[10000.0], low),
            low,
            &[want(60000.0)],
            "70000 - low",
        );
        same(3.0 * &x, &x * 3.0, "3 * low");
    }
    // f32 and f64 divide in their own dtype.
    let x = typed(&[3.0, -0.5], DType::F64);
    is(1.0 / &x, DType::F64, &[1.0 / 3.0, -2.0], "1 / f64");
    let x = typed(&[4.0, 0.0], DType::F32);
    is(2.0 / &x, DType::F32, &[0.5, f64::INFINITY], "2 / f32");
}
