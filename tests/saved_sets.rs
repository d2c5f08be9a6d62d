//! What an op's backward keeps, as PyTorch keeps it: an operand read only for the other
//! operand's gradient is kept only when that operand requires grad, so writing it in place
//! after the forward is no error and the gradients stay right; a tensor the backward does
//! read, written in place, still makes backward refuse, naming the op.

use mantissa::*;

fn v(x: Vec<f32>, s: &[usize]) -> Tensor {
    Tensor::from_vec(x, s, Device::Cpu).unwrap()
}

fn leaf(x: Vec<f32>, s: &[usize]) -> Tensor {
    v(x, s).requires_grad(true).unwrap()
}

fn grad(t: &Tensor) -> Vec<f32> {
    t.grad().unwrap().to_vec::<f32>().unwrap()
}

/// Writes `t`'s storage in place (through a detached view, as an optimizer or a data loader
/// would) with `value` everywhere.
fn overwrite(t: &Tensor, value: f64) {
    t.detach().fill_(value).unwrap();
}

fn refused(r: Result<()>, op: &str) {
    let e = r.unwrap_err().to_string();
    assert!(
        e.contains(&format!("`{op}`")) && e.contains("modified in place"),
        "{e}"
    );
}

#[test]
fn a_product_keeps_each_operand_only_for_the_others_gradient() {
    // x * c with a constant c: x is never read, c is.
    let x = leaf(vec![1.0, -2.0, 3.0], &[3]);
    let c = v(vec![4.0, 5.0, -6.0], &[3]);
    let y = x.mul(&c).unwrap().sum_all().unwrap();
    overwrite(&x, 7.0);
    y.backward().unwrap();
    assert_eq!(grad(&x), vec![4.0, 5.0, -6.0]);
    // The constant operand is read for x's gradient: writing it is refused.
    let x = leaf(vec![1.0, -2.0, 3.0], &[3]);
    let y = x.mul(&c).unwrap().sum_all().unwrap();
    overwrite(&c, 0.0);
    refused(y.backward(), "mul");
    // Both require grad: both are read.
    let (a, b) = (leaf(vec![2.0, 3.0], &[2]), leaf(vec![5.0, 7.0], &[2]));
    let y = a.mul(&b).unwrap().sum_all().unwrap();
    overwrite(&a, 1.0);
    refused(y.backward(), "mul");
    // Broadcast operands too: the sum over the broadcast dim uses the kept operand.
    let x = leaf(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let row = v(vec![10.0, 20.0, 30.0], &[3]);
    let y = x.mul(&row).unwrap().sum_all().unwrap();
    overwrite(&x, -1.0);
    y.backward().unwrap();
    assert_eq!(grad(&x), vec![10.0, 20.0, 30.0, 10.0, 20.0, 30.0]);
}

#[test]
fn a_quotient_keeps_the_dividend_only_for_the_divisors_gradient() {
    let x = leaf(vec![1.0, 2.0], &[2]);
    let d = v(vec![4.0, -8.0], &[2]);
    let y = x.div(&d).unwrap().sum_all().unwrap();
    overwrite(&x, 3.0);
    y.backward().unwrap();
    assert_eq!(grad(&x), vec![0.25, -0.125]);
    // The divisor is always read.
    let x = leaf(vec![1.0, 2.0], &[2]);
    let y = x.div(&d).unwrap().sum_all().unwrap();
    overwrite(&d, 1.0);
    refused(y.backward(), "div");
    // A divisor that requires grad reads the dividend: d(n / x)/dx = -n / x^2.
    let n = v(vec![3.0, 6.0], &[2]);
    let x = leaf(vec![1.0, 2.0], &[2]);
    let y = n.div(&x).unwrap().sum_all().unwrap();
    overwrite(&n, 0.0);
    refused(y.backward(), "div");
    let n = v(vec![3.0, 6.0], &[2]);
    let x = leaf(vec![1.0, 2.0], &[2]);
    n.div(&x).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(grad(&x), vec![-3.0, -1.5]);
}

#[test]
fn scalar_affine_maps_and_negation_read_nothing() {
    let x = leaf(vec![1.0, 2.0, 3.0], &[3]);
    let y = x
        .mul(3.0)
        .unwrap()
        .add(1.0)
        .unwrap()
        .neg()
        .unwrap()
        .sub(2.0)
        .unwrap()
        .div(2.0)
        .unwrap();
    let loss = y
        .mul(&v(vec![1.0, 2.0, 4.0], &[3]))
        .unwrap()
        .sum_all()
        .unwrap();
    overwrite(&x, 100.0);
    loss.backward().unwrap();
    // d/dx of -(3x + 1 - ... ) / 2 weighted by [1, 2, 4]: -1.5 * w.
    assert_eq!(grad(&x), vec![-1.5, -3.0, -6.0]);
    // exp still reads its input.
    let x = leaf(vec![0.5, 1.0], &[2]);
    let y = x.mul(1.0).unwrap();
    let e = y.exp().unwrap().sum_all().unwrap();
    overwrite(&y, 0.0);
    refused(e.backward(), "exp");
}

#[test]
fn a_frozen_layer_keeps_no_input_and_a_constant_input_keeps_no_weight() {
    let xs = vec![1.0, 2.0, 3.0, -1.0, 0.5, 2.0];
    let ws = vec![0.5, -1.0, 2.0, 1.5, 0.25, -0.5];
    // Frozen weight: the input's gradient reads the weight only.
    let x = leaf(xs.clone(), &[2, 3]);
    let w = v(ws.clone(), &[2, 3]);
    let b = v(vec![0.1, 0.2], &[2]);
    let y = x.linear(&w, Some(&b)).unwrap().sum_all().unwrap();
    overwrite(&x, 9.0);
    y.backward().unwrap();
    // d sum(x W^T)/dx = the column sums of W, for each row.
    let col = [ws[0] + ws[3], ws[1] + ws[4], ws[2] + ws[5]];
    assert_eq!(grad(&x), [col, col].concat());
    // The weight is read: an optimizer step on it before backward is refused.
    let x = leaf(xs.clone(), &[2, 3]);
    let y = x.linear(&w, None).unwrap().sum_all().unwrap();
    overwrite(&w, 0.0);
    refused(y.backward(), "linear");
    // A constant input and a trained weight: the weight is not read, so an optimizer step
    // between forward and backward is no error, and the gradient is the input's.
    let x = v(xs.clone(), &[2, 3]);
    let w = leaf(ws.clone(), &[2, 3]);
    let y = x.linear(&w, None).unwrap().sum_all().unwrap();
    overwrite(&w, 5.0);
    y.backward().unwrap();
    let rows = [xs[0] + xs[3], xs[1] + xs[4], xs[2] + xs[5]];
    assert_eq!(grad(&w), [rows, rows].concat());
    // matmul keeps the same way.
    let a = leaf(xs.clone(), &[2, 3]);
    let m = v(ws.clone(), &[3, 2]);
    let y = a.matmul(&m).unwrap().sum_all().unwrap();
    overwrite(&a, 0.0);
    y.backward().unwrap();
    let msum = [ws[0] + ws[1], ws[2] + ws[3], ws[4] + ws[5]];
    assert_eq!(grad(&a), [msum, msum].concat());
    let y = a.matmul(&m).unwrap().sum_all().unwrap();
    overwrite(&m, 0.0);
    refused(y.backward(), "matmul");
}

#[test]
fn a_convolution_keeps_its_input_only_for_the_weights_gradient() {
    let x = leaf(
        (0..16).map(|i| i as f32 * 0.25 - 1.0).collect(),
        &[1, 1, 4, 4],
    );
    let w = v(vec![1.0, -1.0, 0.5, 2.0], &[1, 1, 2, 2]);
    let o = Conv2dOptions::default();
    let want = {
        let x2 = leaf(x.to_vec::<f32>().unwrap(), &[1, 1, 4, 4]);
        x2.conv2d(&w, None, o)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        grad(&x2)
    };
    let y = x.conv2d(&w, None, o).unwrap().sum_all().unwrap();
    overwrite(&x, 3.0);
    y.backward().unwrap();
    assert_eq!(grad(&x), want);
    // The weight is read for the input's gradient.
    let x = leaf(vec![0.5; 16], &[1, 1, 4, 4]);
    let y = x.conv2d(&w, None, o).unwrap().sum_all().unwrap();
    overwrite(&w, 0.0);
    refused(y.backward(), "conv2d");
    // A trained weight over a constant input: the weight is not read.
    let x = v(vec![0.5; 16], &[1, 1, 4, 4]);
    let w = leaf(vec![1.0, -1.0, 0.5, 2.0], &[1, 1, 2, 2]);
    let y = x.conv2d(&w, None, o).unwrap().sum_all().unwrap();
    overwrite(&w, 7.0);
    y.backward().unwrap();
    // Each weight sees nine input positions of 0.5.
    assert_eq!(grad(&w), vec![4.5; 4]);
}
