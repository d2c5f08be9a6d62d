//! Attention rows whose keys are all masked, as PyTorch 2.5 and later treat them: the query
//! attends to nothing, so its output row is 0 and no gradient flows through it, where
//! softmax over a row of -inf would give NaN and carry it into every gradient before it.
//! On the CPU and, where there is one, the CUDA device (the emulated one in CI), in f32,
//! f16 and bf16; through `scaled_dot_product_attention` with a boolean and an additive mask,
//! with the fused kernel asked for and not, and through `MultiheadAttention`'s
//! `key_padding_mask`.

mod common;
use common::{assert_close, vals};
use mantissa::nn::{Module, MultiheadAttention, TensorKind};
use mantissa::*;

/// The CPU, and the CUDA device when there is one.
fn devices() -> Vec<Device> {
    let mut d = vec![Device::Cpu];
    match Device::cuda(0) {
        Ok(g) => d.push(g),
        Err(e) => eprintln!("skipped on CUDA: no CUDA device ({e})"),
    }
    d
}

fn randn(shape: &[usize], seed: u64) -> Tensor {
    let mut g = Generator::new(seed);
    Tensor::randn_with(shape, 0.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap()
}

/// A copy of `t` on `d` in `dt`, a leaf of its own that requires grad.
fn leaf(t: &Tensor, d: Device, dt: DType) -> Tensor {
    t.to_dtype(dt)
        .unwrap()
        .to_device(d)
        .unwrap()
        .copy()
        .unwrap()
        .requires_grad(true)
        .unwrap()
}

/// Rows `rows` of dim 1 of `t`.
fn rows(t: &Tensor, rows: &[usize]) -> Tensor {
    let idx = Tensor::from_vec(
        rows.iter().map(|&r| r as i64).collect(),
        &[rows.len()],
        t.device(),
    )
    .unwrap();
    t.index_select(1, &idx).unwrap()
}

/// The tolerance of a comparison in `dt` (norm-wise relative error).
fn tol(dt: DType) -> f64 {
    match dt {
        DType::F32 => 1e-5,
        DType::F16 => 4e-3,
        _ => 3e-2,
    }
}

#[test]
fn a_query_with_every_key_masked_attends_to_nothing() {
    let (q0, k0, v0, w0) = (
        randn(&[2, 3, 4], 1),
        randn(&[2, 5, 4], 2),
        randn(&[2, 5, 6], 3),
        randn(&[2, 3, 6], 4),
    );
    // Query 1 keeps no key; queries 0 and 2 keep some.
    let keep: Vec<u8> = vec![1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 1];
    for d in devices() {
        for dt in [DType::F32, DType::F16, DType::BF16] {
            for fused in [AttentionKernel::Fused, AttentionKernel::Auto] {
                set_attention_kernel(fused);
                let bool_mask = Tensor::from_vec(keep.clone(), &[3, 5], Device::Cpu)
                    .unwrap()
                    .to_device(d)
                    .unwrap();
                // 0 where a key is kept, -inf where it is not.
                let additive = Tensor::zeros(&[3, 5], dt, d)
                    .unwrap()
                    .masked_fill(&bool_mask.eq(0).unwrap(), f64::NEG_INFINITY)
                    .unwrap();
                for mask in [&bool_mask, &additive] {
                    let what = format!("{d} {dt:?} {fused:?} {:?} mask", mask.dtype());
                    let (q, k, v) = (leaf(&q0, d, dt), leaf(&k0, d, dt), leaf(&v0, d, dt));
                    let w = w0.to_dtype(dt).unwrap().to_device(d).unwrap();
                    let opts = AttentionOptions {
                        attn_mask: Some(mask),
                        ..Default::default()
                    };
                    let y = q.scaled_dot_product_attention(&k, &v, opts).unwrap();
                    y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
                    // The masked query's row is exactly 0, and so is its gradient.
                    assert!(vals(&rows(&y, &[1])).iter().all(|&x| x == 0.0), "{what}");
                    let gq = q.grad().unwrap();
                    assert!(vals(&rows(&gq, &[1])).iter().all(|&x| x == 0.0), "{what}");
                    // The other rows, and the key and value gradients, are those of the
                    // attention of queries 0 and 2 alone.
                    let (rq, rk, rv) = (leaf(&q0, d, dt), leaf(&k0, d, dt), leaf(&v0, d, dt));
                    let sub_mask = rows(&mask.unsqueeze(0).unwrap(), &[0, 2])
                        .squeeze(0)
                        .unwrap();
                    let opts = AttentionOptions {
                        attn_mask: Some(&sub_mask),
                        ..Default::default()
                    };
                    let ry = rows(&rq, &[0, 2])
                        .scaled_dot_product_attention(&rk, &rv, opts)
                        .unwrap();
                    ry.mul(&rows(&w, &[0, 2]))
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .backward()
                        .unwrap();
                    let t = tol(dt);
                    assert_close(&vals(&rows(&y, &[0, 2])), &vals(&ry), t, &what);
                    let rgq = rq.grad().unwrap();
                    assert_close(&vals(&gq), &vals(&rgq), t, &format!("{what}: dq"));
                    for (g, r, n) in [(&k, &rk, "dk"), (&v, &rv, "dv")] {
                        let (g, r) = (vals(&g.grad().unwrap()), vals(&r.grad().unwrap()));
                        assert!(g.iter().all(|x| x.is_finite()), "{what}: {n}");
                        assert_close(&g, &r, t, &format!("{what}: {n}"));
                    }
                }
            }
        }
    }
    set_attention_kernel(AttentionKernel::Auto);
}

#[test]
fn a_causal_mask_with_an_attn_mask_is_refused() {
    let q = randn(&[1, 2, 4], 5);
    let m = Tensor::ones(&[2, 2], DType::U8, Device::Cpu).unwrap();
    let opts = AttentionOptions {
        attn_mask: Some(&m),
        is_causal: true,
        ..Default::default()
    };
    let e = q.scaled_dot_product_attention(&q, &q, opts).unwrap_err();
    assert!(e.to_string().contains("is_causal"), "{e}");
}

#[test]
fn one_padded_sequence_leaves_the_model_finite() {
    // Batch element 1's keys are all padding: its outputs are out_proj's bias, and every
    // parameter's gradient is that of batch element 0 alone.
    for d in devices() {
        let mut mha = MultiheadAttention::new(8, 2, true, &mut Generator::new(7)).unwrap();
        mha.to_device(d).unwrap();
        let mut solo = MultiheadAttention::new(8, 2, true, &mut Generator::new(7)).unwrap();
        solo.to_device(d).unwrap();
        let x = randn(&[2, 3, 8], 8).to_device(d).unwrap();
        let w = randn(&[2, 3, 8], 9).to_device(d).unwrap();
        let pad = Tensor::from_vec(vec![0u8, 0, 1, 1, 1, 1], &[2, 3], Device::Cpu)
            .unwrap()
            .to_device(d)
            .unwrap();
        let y = mha.attend(&x, &x, &x, Some(&pad), None).unwrap();
        y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        let bias = vals(&mha.out_proj.bias.clone().unwrap());
        let padded = vals(&y.narrow(0, 1, 1).unwrap());
        for (i, got) in padded.iter().enumerate() {
            assert!((got - bias[i % 8]).abs() < 1e-6, "{d}: output {i}: {got}");
        }
        let x0 = x.narrow(0, 0, 1).unwrap();
        let pad0 = pad.narrow(0, 0, 1).unwrap();
        let y0 = solo.attend(&x0, &x0, &x0, Some(&pad0), None).unwrap();
        assert_close(
            &vals(&y.narrow(0, 0, 1).unwrap()),
            &vals(&y0),
            1e-5,
            "outputs",
        );
        // The padded element's output is the bias: its share of the bias gradient is its
        // loss weights' sum, and nothing reaches the other parameters.
        y0.mul(&w.narrow(0, 0, 1).unwrap())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let named = mha.named_tensors(TensorKind::Parameter);
        for ((n, p), s) in named.iter().zip(solo.parameters()) {
            let (g, r) = (vals(&p.grad().unwrap()), vals(&s.grad().unwrap()));
            assert!(g.iter().all(|x| x.is_finite()), "{d}: {n}: not finite");
            if n == "out_proj.bias" {
                let extra = vals(&w.narrow(0, 1, 1).unwrap().sum(&[0, 1], false).unwrap());
                let want: Vec<f64> = r.iter().zip(&extra).map(|(a, b)| a + b).collect();
                assert_close(&g, &want, 1e-5, &format!("{d}: {n}"));
            } else {
                assert_close(&g, &r, 1e-5, &format!("{d}: {n}"));
            }
        }
    }
}
