//! nn modules: initialisation, naming, modes, LSTM numerics and gradients.

mod common;
use common::*;
use mantissa::nn::*;
use mantissa::*;

fn mlp(g: &mut Generator) -> Sequential {
    Sequential::new()
        .push(Flatten)
        .push(Linear::new(784, 512, true, g).unwrap())
        .push(Activation::Relu)
        .push(Linear::new(512, 512, true, g).unwrap())
        .push(Activation::Relu)
        .push(Linear::new(512, 10, true, g).unwrap())
}

#[test]
fn linear_and_conv_init_like_pytorch() {
    let mut g = Generator::new(0);
    let net = mlp(&mut g);
    assert_eq!(net.num_parameters(), 669_706);
    let names: Vec<String> = net.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        ["1.weight", "1.bias", "3.weight", "3.bias", "5.weight", "5.bias"]
    );
    let w = vals(&net.parameters()[0]);
    let bound = 1.0 / 784f64.sqrt();
    assert!(w.iter().all(|v| v.abs() <= bound));
    // Uniform: the variance is bound^2 / 3.
    let var = w.iter().map(|v| v * v).sum::<f64>() / w.len() as f64;
    assert!((var / (bound * bound / 3.0) - 1.0).abs() < 0.02, "{var}");
    let c = Conv2d::new(32, 64, 3, Conv2dOptions::default(), true, &mut g).unwrap();
    assert_eq!(c.weight.shape(), &[64, 32, 3, 3]);
    let cb = 1.0 / (32.0f64 * 9.0).sqrt();
    assert!(vals(&c.weight).iter().all(|v| v.abs() <= cb));
    assert!(Conv2d::new(
        3,
        4,
        3,
        Conv2dOptions {
            groups: 2,
            ..Default::default()
        },
        true,
        &mut g
    )
    .is_err());
}

#[test]
fn modes_buffers_and_dtype_moves() {
    let mut net = Sequential::new()
        .push(
            Conv2d::new(
                1,
                4,
                3,
                Conv2dOptions::default(),
                false,
                &mut Generator::new(1),
            )
            .unwrap(),
        )
        .push(BatchNorm2d::new(4).unwrap())
        .push(Dropout::new(0.5, 9));
    let buffers: Vec<String> = net.named_buffers().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        buffers,
        ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    );
    let x = Tensor::randn_with(
        &[8, 1, 6, 6],
        0.0,
        1.0,
        DType::F32,
        Device::Cpu,
        &mut Generator::new(2),
    )
    .unwrap();
    let y1 = net.forward(&x).unwrap();
    let rm = net.named_buffers()[0].1.clone();
    assert!(vals(&rm).iter().any(|&v| v != 0.0), "running mean moved");
    assert_eq!(net.named_buffers()[2].1.item().unwrap(), 1.0);
    net.eval();
    let (e1, e2) = (net.forward(&x).unwrap(), net.forward(&x).unwrap());
    assert_eq!(vals(&e1), vals(&e2), "eval is deterministic");
    assert_ne!(vals(&e1), vals(&y1));
    assert_eq!(
        net.named_buffers()[2].1.item().unwrap(),
        1.0,
        "no tracking in eval"
    );
    net.to_dtype(DType::BF16).unwrap();
    assert!(net
        .parameters()
        .iter()
        .all(|p| p.dtype() == DType::BF16 && p.is_requires_grad() && p.is_leaf()));
    assert_eq!(
        net.named_buffers()[2].1.dtype(),
        DType::I64,
        "integer buffers keep their dtype"
    );
    assert_eq!(
        net.forward(&x.to_dtype(DType::BF16).unwrap())
            .unwrap()
            .dtype(),
        DType::BF16
    );
    assert!(net.to_device(Device::Cuda(0)).is_err());
}

#[test]
fn lstm_step_matches_the_gate_equations() {
    let mut g = Generator::new(5);
    let lstm = Lstm::new(3, 2, 1, false, &mut g).unwrap();
    let x = Tensor::randn_with(&[1, 1, 3], 0.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap();
    let h0 = Tensor::randn_with(&[1, 1, 2], 0.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap();
    let c0 = Tensor::randn_with(&[1, 1, 2], 0.0, 1.0, DType::F32, Device::Cpu, &mut g).unwrap();
    let (y, (h, c)) = lstm.forward_with_state(&x, Some((&h0, &c0))).unwrap();
    let p: Vec<Vec<f64>> = lstm.parameters().iter().map(vals).collect();
    let (wih, whh, bih, bhh) = (&p[0], &p[1], &p[2], &p[3]);
    let (xv, hv, cv) = (vals(&x), vals(&h0), vals(&c0));
    let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
    let pre: Vec<f64> = (0..8)
        .map(|r| {
            (0..3).map(|k| wih[r * 3 + k] * xv[k]).sum::<f64>()
                + (0..2).map(|k| whh[r * 2 + k] * hv[k]).sum::<f64>()
                + bih[r]
                + bhh[r]
        })
        .collect();
    let mut want_h = vec![];
    let mut want_c = vec![];
    for j in 0..2 {
        let (i, f, gg, o) = (
            sig(pre[j]),
            sig(pre[2 + j]),
            pre[4 + j].tanh(),
            sig(pre[6 + j]),
        );
        let cn = f * cv[j] + i * gg;
        want_c.push(cn);
        want_h.push(o * cn.tanh());
    }
    assert_close(&vals(&h), &want_h, 1e-6, "h");
    assert_close(&vals(&c), &want_c, 1e-6, "c");
    assert_eq!(vals(&y), vals(&h));
    assert!(lstm
        .forward_with_state(&x, Some((&c0, &h0.reshape(&[1, 2, 1]).unwrap())))
        .is_err());
    let bad = Tensor::zeros(&[2, 1, 2], DType::F32, Device::Cpu).unwrap();
    assert!(lstm.forward_with_state(&x, Some((&bad, &bad))).is_err());
}

#[test]
fn lstm_gradients_match_finite_differences() {
    let mut lstm = Lstm::new(2, 3, 2, true, &mut Generator::new(8)).unwrap();
    lstm.to_dtype(DType::F64).unwrap();
    let x = leaf(&[2, 4, 2], 1);
    let params = lstm.parameters();
    let mut inputs = vec![x];
    inputs.extend(params.iter().take(2).cloned());
    // Gradcheck the input and the first layer's weights by rebuilding the module's weights.
    gradcheck_tol(&inputs, 1e-5, |xs| {
        let mut m = Lstm::new(2, 3, 2, true, &mut Generator::new(8)).unwrap();
        m.to_dtype(DType::F64).unwrap();
        let mut k = 0;
        m.visit_mut("", &mut |_, t, _| {
            if k < 2 {
                *t = xs[1 + k].clone();
            }
            k += 1;
            Ok(())
        })
        .unwrap();
        let (y, (h, c)) = m.forward_with_state(&xs[0], None)?;
        y.sum_all()?.add(&h.mul(&c)?.sum_all()?)
    });
}

/// The fused LSTM cell against finite differences (f64, both outputs used, the cell state a
/// strided view), against the unfused gate equations built from elementwise ops in every
/// float dtype, and its shape errors.
#[test]
fn fused_lstm_cell_matches_the_unfused_equations_and_finite_differences() {
    let gates = leaf(&[3, 8], 11);
    let c_wide = leaf(&[3, 4], 12);
    gradcheck(&[gates.clone(), c_wide.clone()], |x| {
        let c = x[1].narrow(1, 1, 2)?;
        let (h, c2) = Tensor::lstm_cell(&x[0], &c)?;
        h.mul(&c2.add(1.5)?)?.sum_all()
    });
    let unfused = |g: &Tensor, c: &Tensor| -> mantissa::Result<(Tensor, Tensor)> {
        let hs = c.shape()[1];
        let gate = |k: usize| g.narrow(1, k * hs, hs);
        let (i, f) = (gate(0)?.sigmoid()?, gate(1)?.sigmoid()?);
        let (gg, o) = (gate(2)?.tanh()?, gate(3)?.sigmoid()?);
        let c2 = f.mul(c)?.add(&i.mul(&gg)?)?;
        Ok((o.mul(&c2.tanh()?)?, c2))
    };
    for (dt, tol) in [
        (DType::F64, 1e-12),
        (DType::F32, 1e-6),
        (DType::BF16, 1e-2),
        (DType::F16, 2e-3),
    ] {
        let run = |fused: bool| -> Vec<Vec<f64>> {
            let g = f32s(&[5, 24], 13)
                .to_dtype(dt)
                .unwrap()
                .requires_grad(true)
                .unwrap();
            let c = f32s(&[5, 6], 14)
                .to_dtype(dt)
                .unwrap()
                .requires_grad(true)
                .unwrap();
            let (h, c2) = if fused {
                Tensor::lstm_cell(&g, &c).unwrap()
            } else {
                unfused(&g, &c).unwrap()
            };
            let w = f32s(&[5, 6], 15).to_dtype(dt).unwrap();
            h.mul(&w)
                .unwrap()
                .add(&c2.mul(&w.sin().unwrap()).unwrap())
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            vec![
                vals(&h),
                vals(&c2),
                vals(&g.grad().unwrap()),
                vals(&c.grad().unwrap()),
            ]
        };
        let (got, want) = (run(true), run(false));
        for (k, what) in ["h", "c'", "d gates", "d c"].iter().enumerate() {
            assert_close(
                &got[k],
                &want[k],
                tol,
                &format!("lstm_cell {what} ({dt:?})"),
            );
        }
    }
    let z = |s: &[usize]| Tensor::zeros(s, DType::F32, Device::Cpu).unwrap();
    assert!(
        Tensor::lstm_cell(&z(&[2, 12]), &z(&[2, 4])).is_err(),
        "4H != 12"
    );
    assert!(
        Tensor::lstm_cell(&z(&[2, 12]), &z(&[3, 3])).is_err(),
        "batch differs"
    );
    assert!(Tensor::lstm_cell(&z(&[2, 12]), &z(&[2, 3]).to_dtype(DType::F16).unwrap()).is_err());
}

/// `linear_relu` is `linear` then `relu` (values, gradients, errors), and a Sequential of
/// Linear + ReLU layers gives the same outputs as the layers applied one by one (the fused
/// form runs on CUDA; tests/cuda_parity.rs compares it with these).
#[test]
fn linear_relu_matches_linear_then_relu() {
    let mut gen = Generator::new(21);
    let mut r = |s: &[usize]| Tensor::randn_with(s, 0.0, 1.0, DType::F32, Device::Cpu, &mut gen);
    let (x, w, b) = (r(&[6, 5]).unwrap(), r(&[4, 5]).unwrap(), r(&[4]).unwrap());
    let run = |fused: bool| {
        let w = w.detach().requires_grad(true).unwrap();
        let b = b.detach().requires_grad(true).unwrap();
        let y = match fused {
            true => x.linear_relu(&w, &b).unwrap(),
            false => x.linear(&w, Some(&b)).unwrap().relu().unwrap(),
        };
        y.mul(&y).unwrap().sum_all().unwrap().backward().unwrap();
        [vals(&y), vals(&w.grad().unwrap()), vals(&b.grad().unwrap())]
    };
    let (f, c) = (run(true), run(false));
    assert_eq!(f, c);
    assert!(f[0].contains(&0.0) && f[0].iter().any(|&v| v > 0.0));
    let err = x.linear_relu(&w.t().unwrap(), &b).unwrap_err().to_string();
    assert!(err.contains("linear"), "{err}");
    let err = x
        .linear_relu(&w, &r(&[3]).unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("bias"), "{err}");

    let net = Sequential::new()
        .push(Linear::new(5, 8, true, &mut Generator::new(3)).unwrap())
        .push(Activation::Relu)
        .push(Linear::new(8, 3, false, &mut Generator::new(4)).unwrap())
        .push(Activation::Relu);
    let y = net.forward(&x).unwrap();
    let p = net.named_parameters();
    let (w1, b1, w2) = (&p[0].1, &p[1].1, &p[2].1);
    let want = x.linear(w1, Some(b1)).unwrap().relu().unwrap();
    let want = want.linear(w2, None).unwrap().relu().unwrap();
    assert_eq!(vals(&y), vals(&want));
}

/// A basic ResNet block: two 3x3 convolutions with batch norms, and a shortcut that is the
/// identity or a strided 1x1 projection.
fn block(c_in: usize, c_out: usize, stride: usize, g: &mut Generator) -> Residual {
    let conv = |i, o, k, s, p, g: &mut Generator| {
        let opts = Conv2dOptions {
            stride: [s, s],
            padding: [p, p],
            ..Default::default()
        };
        Conv2d::new(i, o, k, opts, false, g).unwrap()
    };
    let main = Sequential::new()
        .push(conv(c_in, c_out, 3, stride, 1, g))
        .push(BatchNorm2d::new(c_out).unwrap())
        .push(Activation::Relu)
        .push(conv(c_out, c_out, 3, 1, 1, g))
        .push(BatchNorm2d::new(c_out).unwrap());
    let shortcut = (stride != 1 || c_in != c_out).then(|| {
        Sequential::new()
            .push(conv(c_in, c_out, 1, stride, 0, g))
            .push(BatchNorm2d::new(c_out).unwrap())
    });
    Residual::new(main, shortcut)
}

#[test]
fn residual_blocks_add_their_branches_and_pass_modes_on() {
    let mut g = Generator::new(3);
    for (c_in, c_out, stride) in [(4, 4, 1), (4, 6, 2)] {
        let mut b = block(c_in, c_out, stride, &mut g);
        let x = leaf(&[2, c_in, 6, 6], 9);
        let xf = x
            .detach()
            .to_dtype(DType::F32)
            .unwrap()
            .requires_grad(true)
            .unwrap();
        let y = b.forward(&xf).unwrap();
        // The same sum by hand, from the block's own branches (batch statistics both times).
        let s = match &b.shortcut {
            Some(m) => m.forward(&xf).unwrap(),
            None => xf.clone(),
        };
        let want = b
            .main
            .forward(&xf)
            .unwrap()
            .add(&s)
            .unwrap()
            .relu()
            .unwrap();
        assert_close(&vals(&y), &vals(&want), 1e-6, "block output");
        assert_eq!(y.shape(), &[2, c_out, 6 / stride, 6 / stride]);
        assert!(vals(&y).iter().all(|&v| v >= 0.0));
        // Gradients reach both branches.
        y.sum_all().unwrap().backward().unwrap();
        let names: Vec<String> = b.named_parameters().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names[0], "main.0.weight");
        assert_eq!(names.iter().any(|n| n == "shortcut.0.weight"), stride != 1);
        for (n, p) in b.named_parameters() {
            let gnorm: f64 = vals(&p.grad().unwrap()).iter().map(|v| v * v).sum();
            assert!(gnorm > 0.0, "{n} got no gradient");
        }
        // Eval mode reaches the batch norms in both branches: running statistics stay put
        // and the output no longer depends on the rest of the batch.
        b.eval();
        let buffers = |b: &Residual| -> Vec<f64> {
            b.named_buffers()
                .iter()
                .flat_map(|(_, t)| vals(t))
                .collect()
        };
        let before = buffers(&b);
        let one = b.forward(&xf.narrow(0, 0, 1).unwrap()).unwrap();
        let both = b.forward(&xf).unwrap();
        assert_eq!(buffers(&b), before);
        assert_close(
            &vals(&one),
            &vals(&both.narrow(0, 0, 1).unwrap()),
            1e-6,
            "eval",
        );
    }
    // A shortcut that does not match the main branch is an error naming both shapes.
    let bad = Residual::new(block(4, 6, 2, &mut g).main, None);
    let e = bad
        .forward(&f32s(&[1, 4, 6, 6], 1))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("Residual") && e.contains("[1, 6, 3, 3]") && e.contains("[1, 4, 6, 6]"),
        "{e}"
    );
}

/// A user's module written as the docs show (forward, visit, visit_mut, no set_training):
/// `fc1 -> dropout -> batch norm over the features -> fc2`.
struct Net {
    fc1: Linear,
    drop: Dropout,
    bn: BatchNorm2d,
    fc2: Linear,
}

impl Net {
    fn new(seed: u64) -> Net {
        let mut g = Generator::new(seed);
        Net {
            fc1: Linear::new(6, 8, true, &mut g).unwrap(),
            drop: Dropout::new(0.5, seed),
            bn: BatchNorm2d::new(8).unwrap(),
            fc2: Linear::new(8, 3, true, &mut g).unwrap(),
        }
    }
}

impl Module for Net {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.drop.forward(&self.fc1.forward(x)?)?;
        let n = h.shape()[0];
        let h = self
            .bn
            .forward(&h.reshape(&[n, 8, 1, 1])?)?
            .reshape(&[n, 8])?;
        self.fc2.forward(&h)
    }
    fn visit(&self, p: &str, f: &mut Visitor) {
        self.fc1.visit(&format!("{p}fc1."), f);
        self.drop.visit(&format!("{p}drop."), f);
        self.bn.visit(&format!("{p}bn."), f);
        self.fc2.visit(&format!("{p}fc2."), f);
    }
    fn visit_mut(&mut self, p: &str, f: &mut VisitorMut) -> Result<()> {
        self.fc1.visit_mut(&format!("{p}fc1."), f)?;
        self.drop.visit_mut(&format!("{p}drop."), f)?;
        self.bn.visit_mut(&format!("{p}bn."), f)?;
        self.fc2.visit_mut(&format!("{p}fc2."), f)
    }
}

/// Whether `m` is in training mode, seen from outside: two forwards of the same batch
/// differ (dropout draws anew) and the batch norm's running mean moves.
fn trains(m: &dyn Module, running_mean: &Tensor) -> bool {
    let x = f32s(&[5, 6], 3);
    let before = vals(running_mean);
    let (a, b) = (vals(&m.forward(&x).unwrap()), vals(&m.forward(&x).unwrap()));
    let moved = vals(running_mean) != before;
    assert_eq!(a != b, moved, "dropout and batch norm in one mode");
    moved
}

#[test]
fn eval_and_train_reach_the_children_of_a_users_module() {
    let mut net = Net::new(1);
    let rm = |n: &Net| n.bn.named_buffers()[0].1.clone();
    assert!(trains(&net, &rm(&net)));
    net.eval();
    assert!(
        !trains(&net, &rm(&net)),
        "eval() reaches the dropout and the batch norm"
    );
    net.train();
    assert!(trains(&net, &rm(&net)));
    // Inside a Sequential, and holding a Sequential.
    let inner = Net::new(2);
    let bn = rm(&inner);
    let mut seq = Sequential::new().push(inner).push(Activation::Tanh);
    seq.eval();
    assert!(!trains(&seq, &bn));
    seq.train();
    assert!(trains(&seq, &bn));
    struct Outer(Sequential);
    impl Module for Outer {
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.0.forward(x)
        }
        fn visit(&self, p: &str, f: &mut Visitor) {
            self.0.visit(p, f)
        }
        fn visit_mut(&mut self, p: &str, f: &mut VisitorMut) -> Result<()> {
            self.0.visit_mut(p, f)
        }
    }
    let inner = Net::new(3);
    let bn = rm(&inner);
    let mut outer = Outer(Sequential::new().push(inner));
    outer.eval();
    assert!(!trains(&outer, &bn));
    outer.train();
    assert!(trains(&outer, &bn));
}

#[test]
fn embedding_padding_row_starts_at_zero_and_gets_no_gradient() {
    // The same draws as without padding, the padding row then zeroed (PyTorch's order).
    let plain = Embedding::new(6, 3, &mut Generator::new(8)).unwrap();
    let emb = Embedding::with_padding_idx(6, 3, Some(-2), &mut Generator::new(8)).unwrap();
    assert_eq!(emb.padding_idx, Some(4));
    let (w, w0) = (vals(&emb.weight), vals(&plain.weight));
    for r in 0..6 {
        let want: Vec<f64> = match r {
            4 => vec![0.0; 3],
            _ => w0[r * 3..r * 3 + 3].to_vec(),
        };
        assert_eq!(&w[r * 3..r * 3 + 3], &want[..], "row {r}");
    }
    // Positions read their rows; the padding row's gradient stays zero however often it is
    // read, the others' gradients are the sums of the output gradients at their positions.
    no_grad(|| emb.weight.narrow(0, 4, 1).unwrap().fill_(0.5)).unwrap();
    let idx = Tensor::from_vec(vec![4i64, 1, 4, 4, 1, 0], &[2, 3], Device::Cpu).unwrap();
    let y = emb.forward(&idx).unwrap();
    assert_eq!(y.shape(), &[2, 3, 3]);
    assert_eq!(&vals(&y)[..3], &[0.5, 0.5, 0.5]);
    let gv: Vec<f32> = (0..18).map(|k| k as f32 + 1.0).collect();
    let g = Tensor::from_vec(gv.clone(), &[2, 3, 3], Device::Cpu).unwrap();
    y.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
    let mut want = vec![0.0; 18];
    for (p, &i) in [4usize, 1, 4, 4, 1, 0].iter().enumerate() {
        if i != 4 {
            for k in 0..3 {
                want[i * 3 + k] += gv[p * 3 + k] as f64;
            }
        }
    }
    assert_eq!(vals(&emb.weight.grad().unwrap()), want);
    // The functional form, and its range checks.
    let w = Tensor::ones(&[3, 2], DType::F32, Device::Cpu).unwrap();
    let i = Tensor::from_vec(vec![0i64, 2], &[2], Device::Cpu).unwrap();
    let e = Tensor::embedding_padded(&i, &w, Some(3))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("embedding") && e.contains("padding_idx 3"),
        "{e}"
    );
    for p in [6, -7] {
        let e = Embedding::with_padding_idx(6, 3, Some(p), &mut Generator::new(0));
        let m = e.err().expect("out of range").to_string();
        assert!(
            m.contains(&format!("padding_idx {p}")) && m.contains('6'),
            "{m}"
        );
    }
}

#[test]
fn an_embedding_index_out_of_range_is_the_embeddings_error() {
    let w = Tensor::ones(&[5, 3], DType::F32, Device::Cpu).unwrap();
    for bad in [7i64, 5, -1] {
        let idx = Tensor::from_vec(vec![0, bad, 1], &[3], Device::Cpu).unwrap();
        let e = Tensor::embedding(&idx, &w).unwrap_err();
        let m = e.to_string();
        assert!(
            m.starts_with("embedding:")
                && m.contains(&format!("index {bad}"))
                && m.contains("size 5"),
            "{m}"
        );
        assert!(matches!(
            e,
            Error::IndexOutOfRange {
                op: "embedding",
                ..
            }
        ));
        let emb = Embedding::new(5, 3, &mut Generator::new(0)).unwrap();
        assert!(emb
            .forward(&idx)
            .unwrap_err()
            .to_string()
            .starts_with("embedding:"));
    }
}

/// A token embedding and a linear head sharing its weight (GPT-2's tie).
struct TiedLm {
    wte: Embedding,
    head: Linear,
}

impl Module for TiedLm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.head.forward(&self.wte.forward(x)?)
    }
    fn visit(&self, p: &str, f: &mut Visitor) {
        self.wte.visit(&join(p, "wte"), f);
        self.head.visit(&join(p, "head"), f);
    }
    fn visit_mut(&mut self, p: &str, f: &mut VisitorMut) -> Result<()> {
        self.wte.visit_mut(&join(p, "wte"), f)?;
        self.head.visit_mut(&join(p, "head"), f)
    }
}

#[test]
fn a_tied_head_stays_tied_through_dtype_and_format_conversions() {
    let mut g = Generator::new(0);
    let wte = Embedding::new(10, 4, &mut g).unwrap();
    let mut head = Linear::new(4, 10, true, &mut g).unwrap();
    head.weight = wte.weight.clone();
    let mut m = TiedLm { wte, head };
    assert_eq!(m.parameters().len(), 2); // the tied weight, the head's bias
    let before = vals(&m.wte.weight);
    m.to_dtype(DType::F16).unwrap();
    assert_eq!(m.wte.weight.dtype(), DType::F16);
    assert!(m.head.weight.shares_storage(&m.wte.weight));
    let names: Vec<String> = m.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["wte.weight", "head.bias"]);
    assert_eq!(m.state_dict().len(), 3);
    let after = vals(&m.head.weight);
    for (a, b) in after.iter().zip(&before) {
        assert!((a - b).abs() <= 1e-3 * b.abs().max(1.0), "{a} vs {b}");
    }
    // Converting to the dtype it has already keeps one tensor too, and so does to_device on
    // the CPU and a memory format (no 4-D tensor here: nothing changes).
    m.to_dtype(DType::F16).unwrap();
    m.to_device(Device::Cpu).unwrap();
    m.to_memory_format(MemoryFormat::ChannelsLast).unwrap();
    assert!(m.head.weight.shares_storage(&m.wte.weight));
    assert_eq!(m.parameters().len(), 2);
    // One gradient, from both uses.
    let idx = Tensor::from_vec(vec![2i64, 7], &[2], Device::Cpu).unwrap();
    m.forward(&idx)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(m.parameters()[0].grad().is_some());
    assert!(m.wte.weight.grad().is_some() && m.head.weight.grad().is_some());
    assert_eq!(
        vals(&m.wte.weight.grad().unwrap()),
        vals(&m.head.weight.grad().unwrap())
    );
}
