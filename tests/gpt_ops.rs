//! The ops a GPT needs beside the usual ones, on the CPU and, where there is one, the CUDA
//! device (the emulated one in CI): `tril`/`triu` (values and gradient), `multinomial` (zero
//! weights never drawn, frequencies, distinct draws without replacement, seeds, errors),
//! cross-entropy and NLL with `[B, T, V]` logits and `[B, T]` targets, `MultiheadAttention`'s
//! `is_causal`, and a tied head weight that stays one tensor through `to_device`. Every
//! expectation is computed here from the definition, on the host.

mod common;
use common::{assert_close, vals};
use mantissa::nn::{Embedding, Linear, MhaForward, Module, MultiheadAttention};
use mantissa::nn::{Visitor, VisitorMut};
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

fn f32s(v: Vec<f32>, shape: &[usize], d: Device) -> Tensor {
    Tensor::from_vec(v, shape, d).unwrap()
}

fn i64s(v: Vec<i64>, shape: &[usize], d: Device) -> Tensor {
    Tensor::from_vec(v, shape, d).unwrap()
}

/// Whether `[.., i, j]` is in the triangle: `j - i <= k` (lower) or `>= k` (upper).
fn in_triangle(i: usize, j: usize, k: i64, upper: bool) -> bool {
    let off = j as i64 - i as i64;
    if upper {
        off >= k
    } else {
        off <= k
    }
}

/// `x` (row-major values of `[b, r, c]`) with the elements outside the triangle zeroed.
fn triangle_ref(x: &[f64], (b, r, c): (usize, usize, usize), k: i64, upper: bool) -> Vec<f64> {
    let mut out = x.to_vec();
    for n in 0..b {
        for i in 0..r {
            for j in 0..c {
                if !in_triangle(i, j, k, upper) {
                    out[(n * r + i) * c + j] = 0.0;
                }
            }
        }
    }
    out
}

#[test]
fn tril_and_triu_by_hand() {
    for d in devices() {
        // 1..=12 as [3, 4].
        let x = f32s((1..=12).map(|v| v as f32).collect(), &[3, 4], d);
        let lower: Vec<f32> = vec![1., 0., 0., 0., 5., 6., 0., 0., 9., 10., 11., 0.];
        assert_eq!(x.tril(0).unwrap().to_vec::<f32>().unwrap(), lower);
        let upper1: Vec<f32> = vec![0., 2., 3., 4., 0., 0., 7., 8., 0., 0., 0., 12.];
        assert_eq!(x.triu(1).unwrap().to_vec::<f32>().unwrap(), upper1);
        let lower_m1: Vec<f32> = vec![0., 0., 0., 0., 5., 0., 0., 0., 9., 10., 0., 0.];
        assert_eq!(x.tril(-1).unwrap().to_vec::<f32>().unwrap(), lower_m1);
        let upper_m1: Vec<f32> = vec![1., 2., 3., 4., 5., 6., 7., 8., 0., 10., 11., 12.];
        assert_eq!(x.triu(-1).unwrap().to_vec::<f32>().unwrap(), upper_m1);
        // Diagonals past the matrix keep everything or nothing.
        assert_eq!(vals(&x.tril(100).unwrap()), vals(&x));
        assert!(vals(&x.tril(i64::MIN).unwrap()).iter().all(|&v| v == 0.0));
        assert_eq!(vals(&x.triu(i64::MIN).unwrap()), vals(&x));
        assert!(vals(&x.triu(4).unwrap()).iter().all(|&v| v == 0.0));
    }
}

#[test]
fn tril_and_triu_on_batches_of_every_dtype() {
    let (b, r, c) = (2, 3, 5);
    let base: Vec<f64> = (0..b * r * c).map(|v| v as f64 + 1.0).collect();
    for d in devices() {
        for dt in [DType::F32, DType::F16, DType::BF16, DType::I64, DType::U8] {
            let x = Tensor::from_vec(base.clone(), &[b, r, c], Device::Cpu)
                .unwrap()
                .to_dtype(dt)
                .unwrap()
                .to_device(d)
                .unwrap();
            let xv = vals(&x);
            for k in -4..=6 {
                for upper in [false, true] {
                    let y = match upper {
                        true => x.triu(k),
                        false => x.tril(k),
                    }
                    .unwrap();
                    assert_eq!(y.dtype(), dt);
                    assert_eq!(y.shape(), &[b, r, c]);
                    let want = triangle_ref(&xv, (b, r, c), k, upper);
                    assert_eq!(vals(&y), want, "{d} {dt:?} k {k} upper {upper}");
                }
            }
        }
        // A transposed (strided) input.
        let x = f32s((0..12).map(|v| v as f32).collect(), &[4, 3], d);
        let xt = x.t().unwrap();
        let want = triangle_ref(&vals(&xt), (1, 3, 4), 0, false);
        assert_eq!(vals(&xt.tril(0).unwrap()), want);
        // Rank below 2 is refused, naming the op and the shape.
        let v = f32s(vec![1.0; 3], &[3], d);
        let e = v.tril(0).unwrap_err().to_string();
        assert!(e.contains("tril") && e.contains("[3]"), "{e}");
        assert!(v.triu(0).unwrap_err().to_string().contains("triu"));
    }
}

#[test]
fn the_gradient_of_tril_and_triu_is_the_same_mask() {
    let (b, r, c) = (2, 4, 3);
    let xv: Vec<f32> = (0..b * r * c).map(|v| (v as f32 * 0.37).sin()).collect();
    let gv: Vec<f32> = (0..b * r * c).map(|v| (v as f32 * 0.71).cos()).collect();
    for d in devices() {
        for (k, upper) in [
            (0, false),
            (-1, false),
            (2, false),
            (0, true),
            (1, true),
            (-2, true),
        ] {
            let x = f32s(xv.clone(), &[b, r, c], d).requires_grad(true).unwrap();
            let g = f32s(gv.clone(), &[b, r, c], d);
            let y = match upper {
                true => x.triu(k),
                false => x.tril(k),
            }
            .unwrap();
            y.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
            let gv64: Vec<f64> = gv.iter().map(|&v| v as f64).collect();
            let want = triangle_ref(&gv64, (b, r, c), k, upper);
            assert_eq!(vals(&x.grad().unwrap()), want, "{d} k {k} upper {upper}");
        }
    }
    // Against central differences in f64 on the CPU.
    let x = common::leaf(&[2, 3, 3], 5);
    common::gradcheck(&[x], |xs| xs[0].tril(-1)?.mul(&xs[0])?.triu(-1));
}

/// How often each of `c` categories occurs in `draws`.
fn counts(draws: &[i64], c: usize) -> Vec<usize> {
    let mut n = vec![0; c];
    for &i in draws {
        n[i as usize] += 1;
    }
    n
}

/// Every count within 5 standard deviations of `n * p` (binomial), `p` the weights normalised.
fn assert_frequencies(count: &[usize], weights: &[f64], n: usize, what: &str) {
    let total: f64 = weights.iter().sum();
    for (k, (&got, &w)) in count.iter().zip(weights).enumerate() {
        let p = w / total;
        let mean = n as f64 * p;
        let sigma = (n as f64 * p * (1.0 - p)).sqrt();
        assert!(
            (got as f64 - mean).abs() <= 5.0 * sigma.max(0.5),
            "{what}: category {k}: {got} draws, expected {mean:.1} +- {sigma:.1}"
        );
    }
}

#[test]
fn multinomial_never_draws_a_zero_weight() {
    for d in devices() {
        let mut g = Generator::new(3);
        let w = f32s(vec![0.0, 1.0, 0.0, 2.0, 0.0], &[5], d);
        let draws = w.multinomial(5000, true, &mut g).unwrap();
        assert_eq!((draws.shape(), draws.dtype()), (&[5000][..], DType::I64));
        assert!(draws
            .to_vec::<i64>()
            .unwrap()
            .iter()
            .all(|&i| i == 1 || i == 3));
        let mut both = w
            .multinomial(2, false, &mut g)
            .unwrap()
            .to_vec::<i64>()
            .unwrap();
        both.sort();
        assert_eq!(both, vec![1, 3]);
        // Rows with their zeros in other places, a tiny weight beside large ones, and a
        // last category of weight zero (the end of the running sums).
        let rows = vec![
            0.0, 0.0, 0.0, 5.0, 0.0, //
            1e-30, 1.0, 1.0, 0.0, 0.0, //
            3.0, 0.0, 0.5, 0.0, 0.0,
        ];
        let w = f32s(rows.clone(), &[3, 5], d);
        for replacement in [true, false] {
            let n = if replacement { 4000 } else { 1 };
            let draws = w.multinomial(n, replacement, &mut g).unwrap();
            assert_eq!(draws.shape(), &[3, n]);
            for (r, row) in draws.to_vec::<i64>().unwrap().chunks(n).enumerate() {
                for &i in row {
                    assert!(rows[r * 5 + i as usize] > 0.0, "{d} row {r} drew {i}");
                }
            }
        }
        // Half weights.
        let w = f32s(vec![0.0, 2.0, 0.0, 1.0], &[4], d)
            .to_dtype(DType::F16)
            .unwrap();
        let draws = w
            .multinomial(2000, true, &mut g)
            .unwrap()
            .to_vec::<i64>()
            .unwrap();
        assert!(draws.iter().all(|&i| i == 1 || i == 3));
    }
}

#[test]
fn multinomial_frequencies_follow_the_weights() {
    let n = 20_000;
    for d in devices() {
        let mut g = Generator::new(11);
        // Unnormalised weights, two rows.
        let rows = [[1.0, 2.0, 3.0, 4.0], [10.0, 0.5, 0.0, 0.25]];
        let flat: Vec<f32> = rows.iter().flatten().map(|&v| v as f32).collect();
        let w = f32s(flat, &[2, 4], d);
        let draws = w
            .multinomial(n, true, &mut g)
            .unwrap()
            .to_vec::<i64>()
            .unwrap();
        for (r, row) in draws.chunks(n).enumerate() {
            assert_frequencies(&counts(row, 4), &rows[r], n, &format!("{d} row {r}"));
        }
        // Without replacement: the first draw follows the weights, the second is drawn from
        // those left, P(second = j) = sum over i != j of p_i p_j / (1 - p_i).
        let p = [0.1, 0.2, 0.3, 0.4];
        let w = f32s(p.iter().map(|&v| v as f32).collect(), &[1, 4], d)
            .expand(&[n, 4])
            .unwrap();
        let draws = w
            .multinomial(2, false, &mut g)
            .unwrap()
            .to_vec::<i64>()
            .unwrap();
        let first: Vec<i64> = draws.iter().step_by(2).copied().collect();
        let second: Vec<i64> = draws.iter().skip(1).step_by(2).copied().collect();
        assert!(draws.chunks(2).all(|s| s[0] != s[1]));
        assert_frequencies(&counts(&first, 4), &p, n, &format!("{d} first draw"));
        let p2: Vec<f64> = (0..4)
            .map(|j| {
                (0..4)
                    .filter(|&i| i != j)
                    .map(|i| p[i] * p[j] / (1.0 - p[i]))
                    .sum()
            })
            .collect();
        assert_frequencies(&counts(&second, 4), &p2, n, &format!("{d} second draw"));
    }
}

#[test]
fn multinomial_without_replacement_draws_distinct_indices() {
    for d in devices() {
        let mut g = Generator::new(5);
        let w = f32s((0..18).map(|v| 1.0 + (v % 5) as f32).collect(), &[3, 6], d);
        let draws = w.multinomial(6, false, &mut g).unwrap();
        assert_eq!(draws.shape(), &[3, 6]);
        for row in draws.to_vec::<i64>().unwrap().chunks(6) {
            let mut r = row.to_vec();
            r.sort();
            assert_eq!(r, (0..6).collect::<Vec<i64>>(), "{d}");
        }
    }
}

#[test]
fn multinomial_draws_again_the_same_from_the_same_seed() {
    for d in devices() {
        let w = f32s(vec![0.5, 1.0, 2.0, 0.0, 4.0, 1.0], &[2, 3], d);
        for replacement in [true, false] {
            let draw = |seed| {
                let mut g = Generator::new(seed);
                w.multinomial(2, replacement, &mut g)
                    .unwrap()
                    .to_vec::<i64>()
                    .unwrap()
            };
            assert_eq!(draw(7), draw(7));
        }
        let many = |seed| {
            let mut g = Generator::new(seed);
            w.multinomial(64, true, &mut g)
                .unwrap()
                .to_vec::<i64>()
                .unwrap()
        };
        assert_ne!(many(1), many(2));
    }
}

#[test]
fn multinomial_refuses_what_pytorch_refuses() {
    for d in devices() {
        let mut g = Generator::new(0);
        let bad = |v: Vec<f32>, shape: &[usize], n: usize, repl: bool| {
            f32s(v, shape, d)
                .multinomial(n, repl, &mut Generator::new(0))
                .unwrap_err()
                .to_string()
        };
        for (v, what) in [
            (vec![1.0, -0.5, 1.0], "negative"),
            (vec![1.0, f32::INFINITY, 1.0], "infinite"),
            (vec![1.0, f32::NAN, 1.0], "NaN"),
        ] {
            let e = bad(v, &[3], 1, true);
            assert!(e.contains("multinomial") && e.contains(what), "{e}");
        }
        let e = bad(vec![1.0, 1.0, 0.0, 0.0], &[2, 2], 1, true);
        assert!(e.contains("row 1") && e.contains("sum to 0"), "{e}");
        let e = bad(vec![1.0, 1.0], &[2], 0, true);
        assert!(e.contains("0 samples"), "{e}");
        let e = bad(vec![1.0, 1.0], &[2], 3, false);
        assert!(e.contains("3 samples") && e.contains("2 categories"), "{e}");
        let e = bad(vec![1.0, 0.0, 1.0], &[3], 3, false);
        assert!(e.contains("2 categories of positive weight"), "{e}");
        let e = bad(vec![1.0; 8], &[2, 2, 2], 1, true);
        assert!(e.contains("[2, 2, 2]"), "{e}");
        let ints = i64s(vec![1, 2], &[2], d);
        assert!(ints.multinomial(1, true, &mut g).is_err());
    }
}

/// Cross-entropy per position of `[rows, c]` logits (host values), with label smoothing
/// `e` and ignored targets giving 0; and the count of counted rows.
fn cross_entropy_ref(x: &[f64], t: &[i64], c: usize, ignore: i64, e: f64) -> (Vec<f64>, f64) {
    let mut per = Vec::new();
    let mut counted = 0.0;
    for (row, &target) in x.chunks(c).zip(t) {
        if target == ignore {
            per.push(0.0);
            continue;
        }
        counted += 1.0;
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        let nll = lse - row[target as usize];
        let smooth = row.iter().map(|v| lse - v).sum::<f64>() / c as f64;
        per.push((1.0 - e) * nll + e * smooth);
    }
    (per, counted)
}

#[test]
fn cross_entropy_reads_bt_v_logits_with_the_classes_last() {
    let (b, t, v) = (2, 3, 5);
    let xv: Vec<f32> = (0..b * t * v)
        .map(|k| (k as f32 * 0.53).sin() * 2.0)
        .collect();
    let targets = vec![4i64, 0, -100, 2, 2, 1];
    for d in devices() {
        for (e, reduction) in [
            (0.0, Reduction::Mean),
            (0.1, Reduction::Mean),
            (0.0, Reduction::Sum),
            (0.2, Reduction::None),
        ] {
            let o = CrossEntropyOptions {
                reduction,
                label_smoothing: e,
                ..Default::default()
            };
            let x = f32s(xv.clone(), &[b, t, v], d).requires_grad(true).unwrap();
            let tt = i64s(targets.clone(), &[b, t], d);
            let loss = x.cross_entropy(&tt, o).unwrap();
            let x64: Vec<f64> = xv.iter().map(|&a| a as f64).collect();
            let (per, counted) = cross_entropy_ref(&x64, &targets, v, -100, e);
            let want = match reduction {
                Reduction::None => per.clone(),
                Reduction::Sum => vec![per.iter().sum()],
                Reduction::Mean => vec![per.iter().sum::<f64>() / counted],
            };
            let shape: &[usize] = match reduction {
                Reduction::None => &[b, t],
                _ => &[],
            };
            assert_eq!(loss.shape(), shape);
            assert_close(&vals(&loss), &want, 1e-6, &format!("{d} loss e {e}"));
            // The gradient against the same loss on the logits flattened by hand.
            loss.sum_all().unwrap().backward().unwrap();
            let x2 = f32s(xv.clone(), &[b * t, v], d)
                .requires_grad(true)
                .unwrap();
            let t2 = i64s(targets.clone(), &[b * t], d);
            x2.cross_entropy(&t2, o)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let (g, g2) = (vals(&x.grad().unwrap()), vals(&x2.grad().unwrap()));
            assert_close(&g, &g2, 1e-6, &format!("{d} gradient e {e}"));
            assert!(g[2 * v..3 * v].iter().all(|&a| a == 0.0), "ignored row");
        }
        // NLL the same way.
        let lp = f32s(xv.clone(), &[b, t, v], d).log_softmax(-1).unwrap();
        let tt = i64s(targets.clone(), &[b, t], d);
        let nll = lp.nll_loss(&tt, Reduction::Mean, -100).unwrap();
        let x64: Vec<f64> = xv.iter().map(|&a| a as f64).collect();
        let (per, counted) = cross_entropy_ref(&x64, &targets, v, -100, 0.0);
        let want = per.iter().sum::<f64>() / counted;
        assert_close(&vals(&nll), &[want], 1e-6, &format!("{d} nll"));
    }
}

#[test]
fn when_both_readings_fit_pytorchs_wins() {
    // [N, C, d] = [2, 4, 4] with targets [2, 4]: PyTorch reads classes in dim 1.
    let xv: Vec<f32> = (0..32).map(|k| (k as f32 * 0.29).cos()).collect();
    let targets = vec![3i64, 0, 1, 2, 2, 2, 0, 3];
    for d in devices() {
        let x = f32s(xv.clone(), &[2, 4, 4], d);
        let tt = i64s(targets.clone(), &[2, 4], d);
        let o = CrossEntropyOptions {
            reduction: Reduction::None,
            ..Default::default()
        };
        let loss = x.cross_entropy(&tt, o).unwrap();
        // Rows of classes: for sample n and position p, x[n, :, p].
        let mut rows = Vec::new();
        for n in 0..2 {
            for p in 0..4 {
                rows.extend((0..4).map(|c| xv[n * 16 + c * 4 + p] as f64));
            }
        }
        let (per, _) = cross_entropy_ref(&rows, &targets, 4, -100, 0.0);
        assert_close(&vals(&loss), &per, 1e-6, &format!("{d}"));
        // A target that fits neither reading names both.
        let e = x
            .cross_entropy(&i64s(vec![0; 3], &[3], d), o)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cross_entropy") && e.contains("[2, 4]"), "{e}");
    }
}

/// The additive causal mask `[l, s]` written out: 0 where key j <= query i, -inf after.
fn causal_float(l: usize, s: usize, d: Device) -> Tensor {
    let v: Vec<f32> = (0..l * s)
        .map(|k| match k % s > k / s {
            true => f32::NEG_INFINITY,
            false => 0.0,
        })
        .collect();
    f32s(v, &[l, s], d)
}

#[test]
fn multihead_attention_is_causal_matches_the_explicit_causal_mask() {
    for d in devices() {
        for bias_kv in [false, true] {
            let o = mantissa::nn::MhaOptions {
                batch_first: true,
                add_bias_kv: bias_kv,
                ..Default::default()
            };
            let mut mha =
                MultiheadAttention::with_options(8, 2, o, &mut Generator::new(1)).unwrap();
            mha.to_device(d).unwrap();
            let x = Tensor::randn_with(&[2, 5, 8], 0.0, 1.0, DType::F32, d, &mut Generator::new(2))
                .unwrap();
            let mask = causal_float(5, 5, d);
            let pad = Tensor::from_vec(vec![0u8, 0, 0, 0, 1, 0, 0, 0, 0, 0], &[2, 5], d).unwrap();
            for need_weights in [false, true] {
                for padding in [None, Some(&pad)] {
                    let run = |attn_mask, is_causal| {
                        let a = MhaForward {
                            attn_mask,
                            is_causal,
                            need_weights,
                            key_padding_mask: padding,
                            ..Default::default()
                        };
                        let (y, w) = mha.forward_with(&x, &x, &x, a).unwrap();
                        (vals(&y), w.map(|w| vals(&w)))
                    };
                    let want = run(Some(&mask), false);
                    let what = format!("{d} bias_kv {bias_kv} weights {need_weights}");
                    for got in [run(None, true), run(Some(&mask), true)] {
                        assert_close(&got.0, &want.0, 1e-6, &what);
                        if let (Some(g), Some(w)) = (&got.1, &want.1) {
                            assert_close(g, w, 1e-6, &what);
                        }
                    }
                }
            }
            // Query 0 of a causal self-attention sees key 0 only: its weights are [1, 0, ..]
            // (apart from the appended key).
            let a = MhaForward {
                is_causal: true,
                average_attn_weights: false,
                ..Default::default()
            };
            let w = vals(&mha.forward_with(&x, &x, &x, a).unwrap().1.unwrap());
            let s = 5 + usize::from(bias_kv);
            if !bias_kv {
                assert_eq!(&w[..s], &[1.0, 0.0, 0.0, 0.0, 0.0]);
            } else {
                assert!(w[1..5].iter().all(|&v| v == 0.0), "{w:?}");
            }
        }
    }
}

/// A token embedding and a head whose weight is the embedding's (GPT-2's tied weights).
struct Tied {
    wte: Embedding,
    head: Linear,
}

impl Module for Tied {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.head.forward(&self.wte.forward(x)?)
    }
    fn visit(&self, p: &str, f: &mut Visitor) {
        self.wte.visit(&mantissa::nn::join(p, "wte"), f);
        self.head.visit(&mantissa::nn::join(p, "head"), f);
    }
    fn visit_mut(&mut self, p: &str, f: &mut VisitorMut) -> Result<()> {
        self.wte.visit_mut(&mantissa::nn::join(p, "wte"), f)?;
        self.head.visit_mut(&mantissa::nn::join(p, "head"), f)
    }
}

fn tied(seed: u64) -> Tied {
    let mut g = Generator::new(seed);
    let wte = Embedding::new(7, 4, &mut g).unwrap();
    let mut head = Linear::new(4, 7, false, &mut g).unwrap();
    head.weight = wte.weight.clone();
    Tied { wte, head }
}

#[test]
fn a_tied_head_stays_tied_through_to_device() {
    for d in devices() {
        let mut m = tied(0);
        let before = vals(&m.wte.weight);
        m.to_device(d).unwrap();
        assert_eq!(m.wte.weight.device(), d);
        assert!(m.head.weight.shares_storage(&m.wte.weight), "{d}");
        assert_eq!(m.parameters().len(), 1);
        assert_eq!(m.state_dict().len(), 2);
        assert_eq!(vals(&m.head.weight), before);
        assert!(m.parameters()[0].is_leaf() && m.parameters()[0].is_requires_grad());
        // Both uses add into the one gradient: the embedding's rows read, and the head's
        // product.
        let idx = i64s(vec![1, 3], &[2], d);
        m.forward(&idx)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let g = m
            .head
            .weight
            .grad()
            .expect("one gradient for the tied weight");
        assert!(m.wte.weight.grad().is_some());
        // d/dW of sum(E[idx] W^T) = (column sums) for the head plus ones rows at idx.
        let w = before;
        let (rows, dim) = (7, 4);
        let mut want = vec![0.0; rows * dim];
        for r in 0..rows {
            for k in 0..dim {
                want[r * dim + k] = w[dim + k] + w[3 * dim + k];
            }
        }
        for &i in &[1usize, 3] {
            for k in 0..dim {
                want[i * dim + k] += (0..rows).map(|r| w[r * dim + k]).sum::<f64>();
            }
        }
        assert_close(&vals(&g), &want, 1e-6, &format!("{d} tied gradient"));
    }
}
