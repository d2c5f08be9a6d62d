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
