//! `Tensor::lstm_layer`, the whole-sequence LSTM layer: finite differences for every input,
//! the same results as the cell stepped by hand in every float dtype, autocast, errors.

mod common;
use common::*;
use mantissa::*;

/// The six inputs `x [T, B, I]`, `h0`, `c0` `[B, H]`, `w_ih`, `w_hh`, `bias`, as f64 leaves.
fn inputs(t: usize, b: usize, i: usize, h: usize, seed: u64) -> Vec<Tensor> {
    let shapes = [
        vec![t, b, i],
        vec![b, h],
        vec![b, h],
        vec![4 * h, i],
        vec![4 * h, h],
        vec![4 * h],
    ];
    shapes
        .iter()
        .enumerate()
        .map(|(k, s)| leaf(s, seed + k as u64))
        .collect()
}

/// `y`, `h` and `c` flattened into one vector, so one contraction tests all three.
fn joined(y: &Tensor, h: &Tensor, c: &Tensor) -> Result<Tensor> {
    let flat = |t: &Tensor| t.reshape(&[t.numel()]);
    Tensor::cat(&[&flat(y)?, &flat(h)?, &flat(c)?], 0)
}

/// The layer stepped by hand: one product and one fused cell per step.
fn stepped(x: &[Tensor]) -> Result<(Tensor, Tensor, Tensor)> {
    let (mut h, mut c) = (x[1].clone(), x[2].clone());
    let mut ys = vec![];
    for s in 0..x[0].shape()[0] {
        let xt = x[0].narrow(0, s, 1)?.squeeze(0)?;
        let g = xt
            .matmul(&x[3].t()?)?
            .add(&h.matmul(&x[4].t()?)?)?
            .add(&x[5])?;
        (h, c) = Tensor::lstm_cell(&g, &c)?;
        ys.push(h.clone());
    }
    let y = Tensor::stack(&ys.iter().collect::<Vec<_>>(), 0)?;
    Ok((y, h, c))
}

#[test]
fn gradients_of_every_input_match_finite_differences() {
    let xs = inputs(4, 3, 2, 3, 40);
    gradcheck(&xs, |x| {
        let (y, h, c) = Tensor::lstm_layer(&x[0], &x[1], &x[2], &x[3], &x[4], &x[5])?;
        joined(&y, &h, &c)
    });
    // Only the final cell state used: the outputs' gradient is zero but for its last row.
    gradcheck(&xs, |x| {
        let (_, _, c) = Tensor::lstm_layer(&x[0], &x[1], &x[2], &x[3], &x[4], &x[5])?;
        Ok(c)
    });
    // A strided input (batch first, transposed) and a single step.
    let xs = inputs(1, 2, 3, 2, 50);
    gradcheck(&xs, |x| {
        let xt = x[0].transpose(0, 1)?.contiguous()?.transpose(0, 1)?;
        let (y, h, c) = Tensor::lstm_layer(&xt, &x[1], &x[2], &x[3], &x[4], &x[5])?;
        joined(&y, &h, &c)
    });
}

/// The same outputs and gradients as the cell stepped by hand (f64 to rounding), and in
/// f32, f16 and bf16 within their bands of the f64 results.
#[test]
fn matches_the_stepped_cell_in_every_float_dtype() {
    let base = inputs(6, 5, 7, 4, 60);
    let run = |dt: DType, fused: bool| -> Vec<Vec<f64>> {
        let xs: Vec<Tensor> = base
            .iter()
            .map(|t| {
                t.detach()
                    .to_dtype(dt)
                    .unwrap()
                    .requires_grad(true)
                    .unwrap()
            })
            .collect();
        let (y, h, c) = if fused {
            Tensor::lstm_layer(&xs[0], &xs[1], &xs[2], &xs[3], &xs[4], &xs[5]).unwrap()
        } else {
            stepped(&xs).unwrap()
        };
        assert_eq!(y.dtype(), dt);
        let out = joined(&y, &h, &c).unwrap();
        let w = f32s(out.shape(), 70);
        output_and_grads(&out, &w, &xs.iter().collect::<Vec<_>>())
    };
    let want = run(DType::F64, false);
    assert_outputs_close(&run(DType::F64, true), &want, 1e-12, "f64");
    for (dt, tol) in [(DType::F32, 1e-5), (DType::F16, 5e-3), (DType::BF16, 4e-2)] {
        let got = run(dt, true);
        assert_outputs_close(&got, &want, tol, &format!("{dt:?}"));
        // The hand-stepped layer in the same dtype is no closer to f64 than the fused one
        // by more than a factor of two (the fused backward sums the weight gradient over all
        // steps in one f32 product).
        let stepped = run(dt, false);
        for k in 0..want.len() {
            let (e_fused, e_stepped) = (rel_err(&got[k], &want[k]), rel_err(&stepped[k], &want[k]));
            assert!(
                e_fused <= 2.0 * e_stepped + 1e-7,
                "{dt:?} result {k}: fused error {e_fused:.2e}, stepped {e_stepped:.2e}"
            );
        }
    }
}

/// Under autocast the layer runs in the low dtype; the f32 weights get f32 gradients.
#[test]
fn runs_in_the_low_dtype_under_autocast() {
    let xs: Vec<Tensor> = inputs(3, 2, 3, 2, 80)
        .iter()
        .map(|t| {
            t.detach()
                .to_dtype(DType::F32)
                .unwrap()
                .requires_grad(true)
                .unwrap()
        })
        .collect();
    let guard = amp::autocast(DType::BF16).unwrap();
    let (y, h, c) = Tensor::lstm_layer(&xs[0], &xs[1], &xs[2], &xs[3], &xs[4], &xs[5]).unwrap();
    drop(guard);
    assert_eq!(
        (y.dtype(), h.dtype(), c.dtype()),
        (DType::BF16, DType::BF16, DType::BF16)
    );
    joined(&y, &h, &c)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    for x in &xs {
        let g = x.grad().expect("a gradient");
        assert_eq!((g.dtype(), g.shape()), (DType::F32, x.shape()));
        assert!(vals(&g).iter().any(|&v| v != 0.0));
    }
}

#[test]
fn bad_shapes_and_dtypes_are_errors_that_name_the_op() {
    let z = |s: &[usize]| Tensor::zeros(s, DType::F32, Device::Cpu).unwrap();
    let good = [
        z(&[3, 2, 5]),
        z(&[2, 4]),
        z(&[2, 4]),
        z(&[16, 5]),
        z(&[16, 4]),
        z(&[16]),
    ];
    let call = |t: &[Tensor]| Tensor::lstm_layer(&t[0], &t[1], &t[2], &t[3], &t[4], &t[5]);
    assert!(call(&good).is_ok());
    let cases: Vec<(usize, Tensor, &str)> = vec![
        (0, z(&[0, 2, 5]), "seq > 0"),
        (0, z(&[6, 5]), "[seq, batch, features]"),
        (0, z(&[3, 2, 6]), "w_ih"),
        (1, z(&[3, 4]), "state"),
        (2, z(&[2, 5]), "state"),
        (4, z(&[16, 5]), "[4H, H]"),
        (4, z(&[12, 4]), "[4H, H]"),
        (5, z(&[12]), "bias"),
        (3, z(&[16, 5]).to_dtype(DType::F16).unwrap(), "F16"),
        (
            5,
            Tensor::from_vec(vec![0i64; 16], &[16], Device::Cpu).unwrap(),
            "float",
        ),
    ];
    for (k, bad, what) in cases {
        let mut t = good.to_vec();
        t[k] = bad;
        let err = call(&t).expect_err(what).to_string();
        assert!(
            err.contains("lstm_layer") && err.contains(what),
            "{what}: {err}"
        );
    }
}
