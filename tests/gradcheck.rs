//! Gradients of every differentiable op against central finite differences in f64, over
//! random shapes (proptest), with broadcasting and non-contiguous views.

mod common;
use common::*;
use mantissa::*;
use proptest::prelude::*;

fn cfg() -> ProptestConfig {
    ProptestConfig {
        cases: 32,
        ..ProptestConfig::default()
    }
}

fn shape() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1usize..4, 1..4)
}

/// An input of `shape`, contiguous or a permuted view of a leaf, with values at least 0.0025
/// from every multiple of 0.01 (the kinks of the ops below) and from `other(..)`'s values.
fn input(shape: &[usize], seed: u64, strided: bool) -> (Tensor, bool) {
    if strided {
        let rev: Vec<usize> = shape.iter().rev().copied().collect();
        (grid_leaf(&rev, seed, 0.25), true)
    } else {
        (grid_leaf(shape, seed, 0.25), false)
    }
}

/// A second operand whose values never tie with `input`'s (maximum, minimum).
fn other(shape: &[usize], seed: u64) -> Tensor {
    grid_leaf(shape, seed, 0.75)
}

fn view(x: &Tensor, strided: bool) -> Tensor {
    if strided {
        unreverse(x)
    } else {
        x.clone()
    }
}

type UnaryFn = fn(&Tensor) -> Result<Tensor>;

proptest! {
    #![proptest_config(cfg())]

    #[test]
    fn unary_ops(s in shape(), seed in any::<u64>(), strided in any::<bool>()) {
        let ops: Vec<(&str, UnaryFn)> = vec![
            ("neg", |x| x.neg()),
            ("abs", |x| x.abs()),
            ("exp", |x| x.exp()),
            ("log", |x| x.abs()?.add(0.5)?.log()),
            ("log1p", |x| x.abs()?.log1p()),
            ("sqrt", |x| x.abs()?.add(0.5)?.sqrt()),
            ("rsqrt", |x| x.abs()?.add(0.5)?.rsqrt()),
            ("recip", |x| x.abs()?.add(0.5)?.recip()),
            ("sin", |x| x.sin()),
            ("cos", |x| x.cos()),
            ("tanh", |x| x.tanh()),
            ("sigmoid", |x| x.sigmoid()),
            ("relu", |x| x.relu()),
            ("leaky_relu", |x| x.leaky_relu(0.1)),
            ("gelu", |x| x.gelu()),
            ("gelu_tanh", |x| x.gelu_tanh()),
            ("silu", |x| x.silu()),
            ("softplus", |x| x.softplus()),
            ("sqr", |x| x.sqr()),
            ("pow_scalar", |x| x.abs()?.add(0.5)?.pow(1.7)),
            ("scalar_pow", |x| x.scalar_pow(1.3)),
            ("scalar_arith", |x| x.add(1.5)?.mul(-2.0)?.sub(0.25)?.div(3.0)?.rsub(1.0)),
            ("clamp", |x| x.clamp(-0.5, 0.7)),
        ];
        let (x, st) = input(&s, seed, strided);
        for (name, f) in ops {
            eprintln!("{name}");
            gradcheck(std::slice::from_ref(&x), |xs| f(&view(&xs[0], st)));
        }
    }

    #[test]
    fn binary_ops_broadcast(s in shape(), seed in any::<u64>(), mask in any::<u8>(), drop in 0usize..2, strided in any::<bool>()) {
        // b's shape: a's with some dims set to 1 and maybe leading dims dropped.
        let mut bs: Vec<usize> = s.iter().enumerate().map(|(i, &d)| if mask >> i & 1 == 1 { 1 } else { d }).collect();
        let drop = drop.min(bs.len() - 1);
        bs.drain(..drop);
        let (a, st) = input(&s, seed, strided);
        let b = other(&bs, seed ^ 1);
        type BinaryFn = fn(&Tensor, &Tensor) -> Result<Tensor>;
        let ops: Vec<(&str, BinaryFn)> = vec![
            ("add", |a, b| a.add(b)),
            ("sub", |a, b| a.sub(b)),
            ("mul", |a, b| a.mul(b)),
            ("div", |a, b| a.div(&b.abs()?.add(0.5)?)),
            ("pow", |a, b| a.abs()?.add(0.5)?.pow(b)),
            ("maximum", |a, b| a.maximum(b)),
            ("minimum", |a, b| a.minimum(b)),
            ("rev_add", |a, b| b.add(a)),
        ];
        for (name, f) in ops {
            eprintln!("{name}");
            gradcheck(&[a.clone(), b.clone()], |xs| f(&view(&xs[0], st), &xs[1]));
        }
        gradcheck(&[a.clone(), b.clone()], |xs| {
            let av = view(&xs[0], st);
            Tensor::where_cond(&av.gt(0.0)?, &av, &xs[1])
        });
        gradcheck(std::slice::from_ref(&a), |xs| {
            let av = view(&xs[0], st);
            av.masked_fill(&av.lt(0.2)?, 3.0)
        });
    }

    #[test]
    fn reductions(s in shape(), seed in any::<u64>(), strided in any::<bool>(), keep in any::<bool>(), dsel in any::<u8>()) {
        let (x, st) = input(&s, seed, strided);
        let dims: Vec<isize> = (0..s.len() as isize).filter(|d| dsel >> d & 1 == 1).collect();
        let dim = (dsel as usize % s.len()) as isize;
        gradcheck(std::slice::from_ref(&x), |xs| view(&xs[0], st).sum(&dims, keep));
        gradcheck(std::slice::from_ref(&x), |xs| view(&xs[0], st).mean(&dims, keep));
        // Distinct values for the kinked reductions (finite differences are wrong at ties).
        let rev: Vec<usize> = s.iter().rev().copied().collect();
        let xd = distinct_leaf(if st { &rev } else { &s }, seed);
        gradcheck(std::slice::from_ref(&xd), |xs| Ok(view(&xs[0], st).max(dim, keep)?.0));
        gradcheck(std::slice::from_ref(&xd), |xs| Ok(view(&xs[0], st).min(-1, keep)?.0));
        gradcheck(std::slice::from_ref(&xd), |xs| view(&xs[0], st).max_all());
        if s.iter().product::<usize>() > 1 {
            gradcheck(std::slice::from_ref(&x), |xs| view(&xs[0], st).var(&[], 1, keep));
            gradcheck(std::slice::from_ref(&x), |xs| view(&xs[0], st).std(&[], 0, false));
        }
        let n = s[dim as usize];
        if n > 1 {
            gradcheck(std::slice::from_ref(&x), |xs| view(&xs[0], st).var(&[dim], 1, keep));
        }
    }

    #[test]
    fn matmul_shapes(m in 1usize..4, k in 1usize..4, n in 1usize..4, b in 1usize..3, seed in any::<u64>(), case in 0usize..6) {
        let (sa, sb): (Vec<usize>, Vec<usize>) = match case {
            0 => (vec![m, k], vec![k, n]),
            1 => (vec![b, m, k], vec![b, k, n]),
            2 => (vec![b, 1, m, k], vec![2, k, n]),
            3 => (vec![k], vec![k, n]),
            4 => (vec![b, m, k], vec![k]),
            _ => (vec![k], vec![k]),
        };
        let a = leaf(&sa, seed);
        let bt = leaf(&sb, seed ^ 7);
        gradcheck(&[a.clone(), bt.clone()], |xs| xs[0].matmul(&xs[1]));
        // Transposed (non-contiguous) operands.
        if case == 0 {
            let at = leaf(&[k, m], seed ^ 3);
            gradcheck(&[at, bt.clone()], |xs| xs[0].t()?.matmul(&xs[1]));
        }
        if case == 1 {
            let w = leaf(&[n, k], seed ^ 5);
            let bias = leaf(&[n], seed ^ 9);
            gradcheck(&[a, w, bias], |xs| xs[0].linear(&xs[1], Some(&xs[2])));
        }
    }

    #[test]
    fn views(s in prop::collection::vec(1usize..4, 2..4), seed in any::<u64>()) {
        let x = leaf(&s, seed);
        let r = s.len();
        let n: usize = s.iter().product();
        gradcheck(std::slice::from_ref(&x), |xs| xs[0].reshape(&[n]));
        gradcheck(std::slice::from_ref(&x), |xs| xs[0].transpose(0, -1)?.contiguous());
        gradcheck(std::slice::from_ref(&x), |xs| xs[0].permute(&(0..r).rev().collect::<Vec<_>>())?.reshape(&[n]));
        gradcheck(std::slice::from_ref(&x), |xs| xs[0].narrow(0, s[0] / 2, s[0] - s[0] / 2)?.sqr());
        gradcheck(std::slice::from_ref(&x), |xs| {
            let mut big = vec![2];
            big.extend(&s);
            xs[0].unsqueeze(0)?.expand(&big)?.mul(&xs[0])
        });
        gradcheck(std::slice::from_ref(&x), |xs| xs[0].unsqueeze(1)?.squeeze(1)?.flatten(0, -1));
        gradcheck(std::slice::from_ref(&x), |xs| xs[0].mt()?.copy()?.sqr());
        gradcheck(std::slice::from_ref(&x), |xs| {
            let parts = xs[0].split(2, 0)?;
            let refs: Vec<&Tensor> = parts.iter().rev().collect();
            Tensor::cat(&refs, 0)
        });
        let y = leaf(&s, seed ^ 11);
        gradcheck(&[x.clone(), y.clone()], |xs| Tensor::stack(&[&xs[0], &xs[1]], 1));
        gradcheck(&[x.clone(), y], |xs| Tensor::cat(&[&xs[0], &xs[1].sqr()?], -1));
    }

    #[test]
    fn indexing(n in 2usize..5, c in 1usize..4, seed in any::<u64>()) {
        let x = leaf(&[n, c], seed);
        let mut g = Generator::new(seed);
        let idx: Vec<i64> = g.next_u32s(5).iter().map(|v| (*v as usize % n) as i64).collect();
        let ix = Tensor::from_vec(idx.clone(), &[5], Device::Cpu).unwrap();
        gradcheck(std::slice::from_ref(&x), |xs| xs[0].index_select(0, &ix));
        gradcheck(std::slice::from_ref(&x), |xs| xs[0].t()?.index_select(1, &ix));
        gradcheck(std::slice::from_ref(&x), |xs| Tensor::embedding(&ix.reshape(&[5, 1])?, &xs[0]));
        let gidx: Vec<i64> = g.next_u32s(n * c).iter().map(|v| (*v as usize % n) as i64).collect();
        let gi = Tensor::from_vec(gidx, &[n, c], Device::Cpu).unwrap();
        gradcheck(std::slice::from_ref(&x), |xs| xs[0].gather(0, &gi));
        let src = leaf(&[n, c], seed ^ 2);
        gradcheck(&[x.clone(), src], |xs| xs[0].scatter_add(0, &gi, &xs[1]));
        // An index smaller than the source.
        let small = gi.narrow(0, 0, 1).unwrap().contiguous().unwrap();
        let src2 = leaf(&[n, c], seed ^ 4);
        gradcheck(&[x, src2], |xs| xs[0].scatter_add(0, &small, &xs[1]));
    }

    #[test]
    fn softmax_and_losses(n in 1usize..4, c in 2usize..5, seed in any::<u64>(), smooth in 0.0f64..0.3, strided in any::<bool>()) {
        let (x, st) = input(&[n, c], seed, strided);
        gradcheck(std::slice::from_ref(&x), |xs| view(&xs[0], st).softmax(1));
        gradcheck(std::slice::from_ref(&x), |xs| view(&xs[0], st).log_softmax(0));
        let mut g = Generator::new(seed);
        let t: Vec<i64> = g.next_u32s(n).iter().map(|v| (*v as usize % c) as i64).collect();
        let mut t_ign = t.clone();
        t_ign[0] = -100;
        let target = Tensor::from_vec(t, &[n], Device::Cpu).unwrap();
        let target_ign = Tensor::from_vec(t_ign, &[n], Device::Cpu).unwrap();
        for red in [Reduction::Mean, Reduction::Sum, Reduction::None] {
            let o = CrossEntropyOptions { reduction: red, label_smoothing: smooth, ..Default::default() };
            gradcheck(std::slice::from_ref(&x), |xs| view(&xs[0], st).cross_entropy(&target, o));
            gradcheck(std::slice::from_ref(&x), |xs| view(&xs[0], st).log_softmax(1)?.nll_loss(&target, red, -100));
            let y = leaf(&[n, c], seed ^ 3);
            gradcheck(&[x.clone(), y.clone()], |xs| view(&xs[0], st).mse_loss(&xs[1], red));
            let prob = Tensor::rand_with(&[n, c], 0.0, 1.0, DType::F64, Device::Cpu, &mut g).unwrap();
            gradcheck(std::slice::from_ref(&x), |xs| view(&xs[0], st).bce_with_logits(&prob, red));
        }
        if n > 1 {
            let o = CrossEntropyOptions { label_smoothing: smooth, ..Default::default() };
            gradcheck(std::slice::from_ref(&x), |xs| view(&xs[0], st).cross_entropy(&target_ign, o));
        }
        // Spatial cross-entropy: [n, c, 2] logits, [n, 2] targets.
        let x3 = leaf(&[n, c, 2], seed ^ 8);
        let t3: Vec<i64> = g.next_u32s(2 * n).iter().map(|v| (*v as usize % c) as i64).collect();
        let t3 = Tensor::from_vec(t3, &[n, 2], Device::Cpu).unwrap();
        gradcheck(&[x3], |xs| xs[0].cross_entropy(&t3, CrossEntropyOptions::default()));
    }

    #[test]
    fn convolutions(n in 1usize..3, g in 1usize..3, cpg in 1usize..3, opg in 1usize..3, k in 1usize..4,
                    stride in 1usize..3, pad in 0usize..2, dil in 1usize..3, seed in any::<u64>()) {
        let (c, o) = (g * cpg, g * opg);
        let h = (dil * (k - 1) + 1).max(3) + 1;
        let x = leaf(&[n, c, h, h + 1], seed);
        let w = leaf(&[o, cpg, k, k], seed ^ 1);
        let b = leaf(&[o], seed ^ 2);
        let opts = Conv2dOptions { stride: [stride, stride], padding: [pad, pad], dilation: [dil, dil], groups: g };
        gradcheck(&[x.clone(), w, b], |xs| xs[0].conv2d(&xs[1], Some(&xs[2]), opts));
        let wt = leaf(&[c, opg, k, k], seed ^ 3);
        let bt = leaf(&[o], seed ^ 4);
        let topts = ConvTranspose2dOptions {
            stride: [stride, stride], padding: [pad.min(k - 1), 0], output_padding: [stride - 1, 0],
            dilation: [dil, dil], groups: g,
        };
        gradcheck(&[x.clone(), wt, bt], |xs| xs[0].conv_transpose2d(&xs[1], Some(&xs[2]), topts));
        // Non-contiguous input (channels-last storage viewed as NCHW).
        let xl = leaf(&[n, h, h + 1, c], seed ^ 5);
        let w2 = leaf(&[o, cpg, k, k], seed ^ 6);
        gradcheck(&[xl, w2], |xs| xs[0].permute(&[0, 3, 1, 2])?.conv2d(&xs[1], None, opts));
    }

    #[test]
    fn pooling(n in 1usize..3, c in 1usize..3, h in 4usize..7, k in 2usize..4, stride in 1usize..3, pad in 0usize..2,
               ceil in any::<bool>(), incl in any::<bool>(), seed in any::<u64>()) {
        let x = distinct_leaf(&[n, c, h, h + 1], seed);
        let mp = MaxPool2dOptions { kernel: [k, k], stride: Some([stride, stride]), padding: [pad.min(k / 2); 2], dilation: [1, 1], ceil_mode: ceil };
        gradcheck(std::slice::from_ref(&x), |xs| xs[0].max_pool2d(mp));
        let mpd = MaxPool2dOptions { dilation: [2, 2], ..MaxPool2dOptions::new(2) };
        gradcheck(std::slice::from_ref(&x), |xs| xs[0].max_pool2d(mpd));
        let ap = AvgPool2dOptions { kernel: [k, k], stride: Some([stride, stride]), padding: [pad.min(k / 2); 2], ceil_mode: ceil, count_include_pad: incl };
        gradcheck(std::slice::from_ref(&x), |xs| xs[0].avg_pool2d(ap));
        gradcheck(std::slice::from_ref(&x), |xs| xs[0].adaptive_avg_pool2d([3, 2]));
        gradcheck(std::slice::from_ref(&x), |xs| xs[0].transpose(2, 3)?.adaptive_avg_pool2d([1, 1]));
    }

    #[test]
    fn normalisation(n in 3usize..5, c in 3usize..5, hw in 2usize..4, seed in any::<u64>()) {
        // Normalised outputs of tiny groups are nearly flat in x, so the gradients are small
        // and the finite differences noisier: 1e-5 instead of 1e-6.
        let x = leaf(&[n, c, hw, hw + 1], seed);
        let w = leaf(&[c], seed ^ 1);
        let b = leaf(&[c], seed ^ 2);
        gradcheck_tol(&[x.clone(), w.clone(), b.clone()], 1e-5, |xs| {
            xs[0].batch_norm(None, None, Some(&xs[1]), Some(&xs[2]), true, 0.1, 1e-5)
        });
        let x2 = leaf(&[n, c], seed ^ 3);
        gradcheck_tol(std::slice::from_ref(&x2), 1e-5, |xs| xs[0].batch_norm(None, None, None, None, true, 0.1, 1e-5));
        let lw = leaf(&[hw, hw + 1], seed ^ 4);
        let lb = leaf(&[hw, hw + 1], seed ^ 5);
        gradcheck_tol(&[x.clone(), lw, lb], 1e-5, |xs| xs[0].layer_norm(&[hw, hw + 1], Some(&xs[1]), Some(&xs[2]), 1e-5));
        gradcheck_tol(&[x2], 1e-5, |xs| xs[0].layer_norm(&[c], None, None, 1e-5));
    }

    #[test]
    fn dropout_is_a_fixed_mask(s in shape(), seed in any::<u64>(), p in 0.0f64..0.9) {
        let x = leaf(&s, seed);
        gradcheck(std::slice::from_ref(&x), |xs| {
            let mut g = Generator::new(seed);
            xs[0].dropout_with(p, true, &mut g)
        });
    }
}

#[test]
fn gradients_flow_through_casts_and_device_moves() {
    let x = leaf(&[3, 2], 1);
    let y = x
        .to_dtype(DType::F32)
        .unwrap()
        .mul(2.0)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap();
    let loss = y.to_dtype(DType::F64).unwrap().sum_all().unwrap();
    loss.backward().unwrap();
    let g = x.grad().unwrap();
    assert_eq!(g.dtype(), DType::F64);
    assert_eq!(vals(&g), vec![2.0; 6]);
}
