//! Forward values against straightforward reference computations written here in plain Rust.

mod common;
use common::*;
use mantissa::*;

fn t(v: Vec<f64>, s: &[usize]) -> Tensor {
    Tensor::from_vec(v, s, Device::Cpu).unwrap()
}

fn randv(n: usize, seed: u64) -> Vec<f64> {
    Generator::new(seed).normal(n)
}

#[test]
fn matmul_matches_triple_loop_with_broadcast_batches() {
    let (b, m, k, n) = (3, 4, 5, 6);
    let a = randv(b * m * k, 1);
    let w = randv(k * n, 2);
    let got = vals(
        &t(a.clone(), &[b, m, k])
            .matmul(&t(w.clone(), &[k, n]))
            .unwrap(),
    );
    let mut want = vec![0.0; b * m * n];
    for bi in 0..b {
        for i in 0..m {
            for j in 0..n {
                want[(bi * m + i) * n + j] =
                    (0..k).map(|p| a[(bi * m + i) * k + p] * w[p * n + j]).sum();
            }
        }
    }
    assert_close(&got, &want, 1e-14, "batched matmul");
    // f32 products large enough (m*n*k >= 2^20) to be split across threads: by columns
    // (m < 256, n >= 64), by rows because m >= 256, by rows because n < 64; uneven blocks
    // and a transposed operand.
    for (m, k, n) in [(70, 130, 150), (300, 65, 90), (130, 200, 50)] {
        let a = randv(m * k, 3);
        let w = randv(n * k, 4);
        let af = t(a.clone(), &[m, k]).to_dtype(DType::F32).unwrap();
        let wf = t(w.clone(), &[n, k]).to_dtype(DType::F32).unwrap();
        let got = vals(&af.matmul(&wf.t().unwrap()).unwrap());
        let mut want = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                want[i * n + j] = (0..k)
                    .map(|p| a[i * k + p] as f32 as f64 * (w[j * k + p] as f32 as f64))
                    .sum();
            }
        }
        let what = format!("f32 {m}x{k}x{n} matmul with transposed rhs");
        assert_close(&got, &want, 1e-6, &what);
    }
}

/// Direct convolution by definition.
#[allow(clippy::too_many_arguments)]
fn conv_ref(
    x: &[f64],
    xs: [usize; 4],
    w: &[f64],
    ws: [usize; 4],
    s: usize,
    p: usize,
    d: usize,
    g: usize,
) -> (Vec<f64>, [usize; 4]) {
    let [n, c, h, wd] = xs;
    let [o, cg, kh, kw] = ws;
    let ho = (h + 2 * p - d * (kh - 1) - 1) / s + 1;
    let wo = (wd + 2 * p - d * (kw - 1) - 1) / s + 1;
    let og = o / g;
    let mut y = vec![0.0; n * o * ho * wo];
    for ni in 0..n {
        for oc in 0..o {
            let grp = oc / og;
            for oy in 0..ho {
                for ox in 0..wo {
                    let mut acc = 0.0;
                    for ci in 0..cg {
                        let ic = grp * cg + ci;
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let iy = (oy * s + ky * d) as isize - p as isize;
                                let ix = (ox * s + kx * d) as isize - p as isize;
                                if iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < wd {
                                    acc += x[((ni * c + ic) * h + iy as usize) * wd + ix as usize]
                                        * w[((oc * cg + ci) * kh + ky) * kw + kx];
                                }
                            }
                        }
                    }
                    y[((ni * o + oc) * ho + oy) * wo + ox] = acc;
                }
            }
        }
    }
    (y, [n, o, ho, wo])
}

#[test]
fn conv2d_matches_direct_definition() {
    for (s, p, d, g) in [(1, 0, 1, 1), (2, 1, 1, 1), (1, 2, 2, 2), (2, 1, 2, 4)] {
        let xs = [2, 4, 7, 6];
        let ws = [8, 4 / g, 3, 3];
        let x = randv(xs.iter().product(), 5);
        let w = randv(ws.iter().product(), 6);
        let (want, ys) = conv_ref(&x, xs, &w, ws, s, p, d, g);
        let opts = Conv2dOptions {
            stride: [s, s],
            padding: [p, p],
            dilation: [d, d],
            groups: g,
        };
        let y = t(x, &xs).conv2d(&t(w, &ws), None, opts).unwrap();
        assert_eq!(y.shape(), &ys);
        assert_close(
            &vals(&y),
            &want,
            1e-13,
            &format!("conv2d s{s} p{p} d{d} g{g}"),
        );
    }
}

/// The gradients of `sum(conv(x, w) * gy)` by the definition: `(dx, dw)`.
#[allow(clippy::too_many_arguments)]
fn conv_ref_backward(
    x: &[f64],
    xs: [usize; 4],
    w: &[f64],
    ws: [usize; 4],
    gy: &[f64],
    (s, p, d, g): (usize, usize, usize, usize),
) -> (Vec<f64>, Vec<f64>) {
    let [n, c, h, wd] = xs;
    let [o, cg, kh, kw] = ws;
    let ho = (h + 2 * p - d * (kh - 1) - 1) / s + 1;
    let wo = (wd + 2 * p - d * (kw - 1) - 1) / s + 1;
    let (mut dx, mut dw) = (vec![0.0; x.len()], vec![0.0; w.len()]);
    for (ni, oc, oy, ox) in (0..n).flat_map(|ni| {
        (0..o)
            .flat_map(move |oc| (0..ho).flat_map(move |oy| (0..wo).map(move |ox| (ni, oc, oy, ox))))
    }) {
        let gv = gy[((ni * o + oc) * ho + oy) * wo + ox];
        for ci in 0..cg {
            let ic = oc / (o / g) * cg + ci;
            for (ky, kx) in (0..kh).flat_map(|ky| (0..kw).map(move |kx| (ky, kx))) {
                let iy = (oy * s + ky * d) as isize - p as isize;
                let ix = (ox * s + kx * d) as isize - p as isize;
                if iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < wd {
                    let xi = ((ni * c + ic) * h + iy as usize) * wd + ix as usize;
                    let wi = ((oc * cg + ci) * kh + ky) * kw + kx;
                    dx[xi] += gv * w[wi];
                    dw[wi] += gv * x[xi];
                }
            }
        }
    }
    (dx, dw)
}

/// Batches of small images, which the CPU unfolds several at a time into one product (and
/// splits unevenly across threads): forward and both gradients against the definition.
#[test]
fn batched_small_image_convolutions_match_the_definition() {
    for (n, hw, (s, p, d, g)) in [
        (7, 3, (1, 1, 1, 1)),
        (9, 4, (2, 1, 1, 2)),
        (5, 2, (1, 1, 1, 1)),
        (6, 5, (1, 2, 2, 2)),
    ] {
        let xs = [n, 4, hw, hw + 1];
        let ws = [6, 4 / g, 3, 3];
        let x = randv(xs.iter().product(), 15);
        let w = randv(ws.iter().product(), 16);
        let (want, ys) = conv_ref(&x, xs, &w, ws, s, p, d, g);
        let opts = Conv2dOptions {
            stride: [s, s],
            padding: [p, p],
            dilation: [d, d],
            groups: g,
        };
        let gy = randv(want.len(), 17);
        let (dx, dw) = conv_ref_backward(&x, xs, &w, ws, &gy, (s, p, d, g));
        for format in [MemoryFormat::Contiguous, MemoryFormat::ChannelsLast] {
            let what = format!("n{n} {hw}x{} s{s} p{p} d{d} g{g} {format:?}", hw + 1);
            let leaf = |v: &[f64], shape: &[usize]| {
                let v = t(v.to_vec(), shape).to_memory_format(format).unwrap();
                v.requires_grad(true).unwrap()
            };
            let (xt, wt) = (leaf(&x, &xs), leaf(&w, &ws));
            let y = xt.conv2d(&wt, None, opts).unwrap();
            assert_eq!(y.shape(), &ys);
            assert_close(&vals(&y), &want, 1e-13, &what);
            let weighted = y.mul(&t(gy.clone(), &ys)).unwrap();
            weighted.sum_all().unwrap().backward().unwrap();
            assert_close(
                &vals(&xt.grad().unwrap()),
                &dx,
                1e-13,
                &format!("{what} dx"),
            );
            assert_close(
                &vals(&wt.grad().unwrap()),
                &dw,
                1e-13,
                &format!("{what} dw"),
            );
        }
    }
}

#[test]
fn conv_transpose2d_is_the_adjoint_of_conv2d() {
    // <conv(x), y> == <x, conv_transpose(y)> for the same weight and geometry.
    let (s, p, d) = (2, 1, 1);
    let xs = [1, 3, 7, 7];
    let w = randv(4 * 3 * 3 * 3, 8);
    let x = randv(xs.iter().product(), 9);
    let opts = Conv2dOptions {
        stride: [s, s],
        padding: [p, p],
        dilation: [d, d],
        groups: 1,
    };
    let cx = t(x.clone(), &xs)
        .conv2d(&t(w.clone(), &[4, 3, 3, 3]), None, opts)
        .unwrap();
    let y = randv(cx.numel(), 10);
    let topts = ConvTranspose2dOptions {
        stride: [s, s],
        padding: [p, p],
        ..Default::default()
    };
    let ty = t(y.clone(), cx.shape())
        .conv_transpose2d(&t(w, &[4, 3, 3, 3]), None, topts)
        .unwrap();
    assert_eq!(ty.shape(), &xs);
    let lhs: f64 = vals(&cx).iter().zip(&y).map(|(a, b)| a * b).sum();
    let rhs: f64 = x.iter().zip(vals(&ty)).map(|(a, b)| a * b).sum();
    assert!(
        (lhs - rhs).abs() < 1e-10 * lhs.abs().max(1.0),
        "{lhs} vs {rhs}"
    );
    // PyTorch's output size formula with output_padding.
    let o = ConvTranspose2dOptions {
        stride: [2, 2],
        padding: [1, 1],
        output_padding: [1, 1],
        ..Default::default()
    };
    let z = Tensor::ones(&[1, 4, 5, 5], DType::F32, Device::Cpu).unwrap();
    let wt = Tensor::ones(&[4, 2, 3, 3], DType::F32, Device::Cpu).unwrap();
    assert_eq!(
        z.conv_transpose2d(&wt, None, o).unwrap().shape(),
        &[1, 2, 10, 10]
    );
}

/// The unrolled 2x2 / stride-2 max pool picks the same cells as the general loop (reached here
/// through `ceil_mode`, which changes nothing on even sizes): the first maximum on ties, and
/// the first NaN. The gradient shows which cell was picked.
#[test]
fn max_pool_2x2_picks_like_the_general_loop() {
    // Few distinct values, so windows tie; a NaN in two windows (once in each position).
    let mut x: Vec<f64> = (0..2 * 6 * 8).map(|i| ((i * 7) % 3) as f64).collect();
    x[9] = f64::NAN;
    x[2 * 8 + 4] = f64::NAN;
    x[2 * 8 + 5] = f64::NAN;
    let run = |ceil_mode: bool| {
        let xt = t(x.clone(), &[1, 2, 6, 8]).requires_grad(true).unwrap();
        let o = MaxPool2dOptions {
            ceil_mode,
            ..MaxPool2dOptions::new(2)
        };
        let y = xt.max_pool2d(o).unwrap();
        let w = t((0..y.numel()).map(|i| i as f64 + 1.0).collect(), y.shape());
        y.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
        (vals(&y), vals(&xt.grad().unwrap()))
    };
    let (fast, general) = (run(false), run(true));
    let same = |a: &[f64], b: &[f64]| {
        a.iter()
            .zip(b)
            .all(|(p, q)| p == q || p.is_nan() && q.is_nan())
    };
    assert!(same(&fast.0, &general.0), "{:?} vs {:?}", fast.0, general.0);
    assert_eq!(fast.1, general.1);
    assert!(fast.0[0].is_nan() && fast.0[6].is_nan());
    assert_eq!(
        (fast.1[20], fast.1[21]),
        (7.0, 0.0),
        "the first NaN of a window is picked"
    );
}

#[test]
fn pooling_matches_definitions() {
    let x: Vec<f64> = randv(2 * 5 * 6, 11);
    let xt = t(x.clone(), &[1, 2, 5, 6]);
    let mp = xt.max_pool2d(MaxPool2dOptions::new(2)).unwrap();
    assert_eq!(mp.shape(), &[1, 2, 2, 3]);
    let ap = xt.avg_pool2d(AvgPool2dOptions::new(2)).unwrap();
    let mut want_max = vec![];
    let mut want_avg = vec![];
    for c in 0..2 {
        for oy in 0..2 {
            for ox in 0..3 {
                let cells: Vec<f64> = (0..4)
                    .map(|k| x[c * 30 + (2 * oy + k / 2) * 6 + 2 * ox + k % 2])
                    .collect();
                want_max.push(cells.iter().cloned().fold(f64::MIN, f64::max));
                want_avg.push(cells.iter().sum::<f64>() / 4.0);
            }
        }
    }
    assert_eq!(vals(&mp), want_max);
    assert_close(&vals(&ap), &want_avg, 1e-15, "avg_pool2d");
    // Padding not counted: a 3x3 window at the corner of a padded input averages 4 cells.
    let ones = Tensor::ones(&[1, 1, 4, 4], DType::F32, Device::Cpu).unwrap();
    let o = AvgPool2dOptions {
        kernel: [3, 3],
        stride: Some([1, 1]),
        padding: [1, 1],
        ceil_mode: false,
        count_include_pad: true,
    };
    assert!((vals(&ones.avg_pool2d(o).unwrap())[0] - 4.0 / 9.0).abs() < 1e-6);
    let o = AvgPool2dOptions {
        count_include_pad: false,
        ..o
    };
    assert!((vals(&ones.avg_pool2d(o).unwrap())[0] - 1.0).abs() < 1e-6);
    // Adaptive pooling to 1x1 is the plane mean; to 2x2 of a 5x6 uses overlapping windows.
    let aa = xt.adaptive_avg_pool2d([1, 1]).unwrap();
    let mean0 = x[..30].iter().sum::<f64>() / 30.0;
    assert!((vals(&aa)[0] - mean0).abs() < 1e-12);
    let a2 = xt.adaptive_avg_pool2d([2, 2]).unwrap();
    let win: f64 = (0..3)
        .flat_map(|r| (0..3).map(move |c| (r, c)))
        .map(|(r, c)| x[r * 6 + c])
        .sum::<f64>()
        / 9.0;
    assert!((vals(&a2)[0] - win).abs() < 1e-12);
}

#[test]
fn softmax_and_cross_entropy_match_formulas() {
    let (n, c) = (4, 5);
    let x = randv(n * c, 12);
    let target = vec![1i64, 4, -100, 0];
    let xt = t(x.clone(), &[n, c]);
    let sm = vals(&xt.softmax(1).unwrap());
    for i in 0..n {
        let row = &x[i * c..(i + 1) * c];
        let z: f64 = row.iter().map(|v| v.exp()).sum();
        for j in 0..c {
            assert!((sm[i * c + j] - row[j].exp() / z).abs() < 1e-14);
        }
    }
    let eps = 0.1;
    let opts = CrossEntropyOptions {
        label_smoothing: eps,
        ..Default::default()
    };
    let tt = Tensor::from_vec(target.clone(), &[n], Device::Cpu).unwrap();
    let got = xt.cross_entropy(&tt, opts).unwrap().item().unwrap();
    let (mut total, mut count) = (0.0, 0.0);
    for i in 0..n {
        if target[i] == -100 {
            continue;
        }
        let row = &x[i * c..(i + 1) * c];
        let lse = row.iter().map(|v| v.exp()).sum::<f64>().ln();
        let lp: Vec<f64> = row.iter().map(|v| v - lse).collect();
        total += -(1.0 - eps) * lp[target[i] as usize] - eps / c as f64 * lp.iter().sum::<f64>();
        count += 1.0;
    }
    assert!(
        (got - total / count).abs() < 1e-12,
        "{got} vs {}",
        total / count
    );
    let sum = xt.cross_entropy(
        &tt,
        CrossEntropyOptions {
            reduction: Reduction::Sum,
            label_smoothing: eps,
            ..Default::default()
        },
    );
    assert!((sum.unwrap().item().unwrap() - total).abs() < 1e-12);
    // Stable for large logits.
    let big = t(vec![1000.0, 0.0], &[1, 2]);
    let l = big.cross_entropy(
        &Tensor::from_vec(vec![1i64], &[1], Device::Cpu).unwrap(),
        Default::default(),
    );
    assert!((l.unwrap().item().unwrap() - 1000.0).abs() < 1e-9);
}

/// The fused cross-entropy in every float dtype against the f64 formulas on the same
/// (rounded) logits: value and logits' gradient within each dtype's band, both returned in
/// the logits' dtype; `[N, C, d]` logits through a transposed view; an all-ignored batch's
/// mean is NaN, as in PyTorch.
#[test]
fn cross_entropy_in_every_float_dtype_matches_f64() {
    let (n, c, d) = (6, 7, 3);
    let target: Vec<i64> = vec![1, 6, -100, 0, 3, 2, 5, -100, 4, 0, 6, 1, 2, 3, 3, 5, 0, 1];
    let tt = Tensor::from_vec(target.clone(), &[n, d], Device::Cpu).unwrap();
    let eps = 0.1;
    let opts = CrossEntropyOptions {
        label_smoothing: eps,
        ..Default::default()
    };
    for (dtype, band) in [
        (DType::F64, 1e-12),
        (DType::F32, 1e-6),
        (DType::F16, 2e-3),
        (DType::BF16, 1.5e-2),
    ] {
        // [N, d, C] in memory, seen as [N, C, d]: the class dim is strided.
        let base = t(randv(n * c * d, 31), &[n, d, c]).mul(3.0).unwrap();
        let x = base
            .to_dtype(dtype)
            .unwrap()
            .detach()
            .requires_grad(true)
            .unwrap();
        let view = x.transpose(1, 2).unwrap();
        let loss = view.cross_entropy(&tt, opts).unwrap();
        assert_eq!(loss.dtype(), dtype);
        loss.backward().unwrap();
        let grad = x.grad().unwrap();
        assert_eq!(grad.dtype(), dtype);
        // The f64 formulas on the rounded logits, rows (i, k) of x[i, k, :].
        let xv = vals(&x);
        let counted = target.iter().filter(|&&t| t != -100).count() as f64;
        let (mut total, mut want_grad) = (0.0, vec![0.0; xv.len()]);
        for (r, &tgt) in target.iter().enumerate() {
            if tgt == -100 {
                continue;
            }
            let row = &xv[r * c..(r + 1) * c];
            let lse = row.iter().map(|v| v.exp()).sum::<f64>().ln();
            let mean = row.iter().sum::<f64>() / c as f64;
            total += (1.0 - eps) * (lse - row[tgt as usize]) + eps * (lse - mean);
            for j in 0..c {
                let hot = if j as i64 == tgt { 1.0 - eps } else { 0.0 };
                want_grad[r * c + j] = ((row[j] - lse).exp() - hot - eps / c as f64) / counted;
            }
        }
        let got = loss.to_dtype(DType::F64).unwrap().item().unwrap();
        let want = total / counted;
        // The loss is rounded once to the dtype at the end.
        assert!(
            ((got - want) / want).abs() < band,
            "{dtype:?}: loss {got} vs {want}"
        );
        assert_close(
            &vals(&grad),
            &want_grad,
            band,
            &format!("{dtype:?} gradient"),
        );
    }
    let ignored = Tensor::from_vec(vec![-100i64; 2], &[2], Device::Cpu).unwrap();
    let l = t(randv(6, 3), &[2, 3]).cross_entropy(&ignored, Default::default());
    assert!(l.unwrap().item().unwrap().is_nan());
}

#[test]
fn reductions_match_loops() {
    let x = randv(3 * 4 * 5, 13);
    let xt = t(x.clone(), &[3, 4, 5]);
    let s = vals(&xt.sum(&[0, 2], false).unwrap());
    for j in 0..4 {
        let want: f64 = (0..3)
            .flat_map(|i| (0..5).map(move |k| (i, k)))
            .map(|(i, k)| x[i * 20 + j * 5 + k])
            .sum();
        assert!((s[j] - want).abs() < 1e-12);
    }
    let (mx, arg) = xt.max(1, false).unwrap();
    let arg = arg.to_vec::<i64>().unwrap();
    for i in 0..3 {
        for k in 0..5 {
            let col: Vec<f64> = (0..4).map(|j| x[i * 20 + j * 5 + k]).collect();
            let (bj, bv) =
                col.iter()
                    .enumerate()
                    .fold((0, f64::MIN), |b, (j, &v)| if v > b.1 { (j, v) } else { b });
            assert_eq!(arg[i * 5 + k], bj as i64);
            assert_eq!(vals(&mx)[i * 5 + k], bv);
        }
    }
    let v = xt.var(&[2], 1, false).unwrap();
    let row = &x[..5];
    let m = row.iter().sum::<f64>() / 5.0;
    let want = row.iter().map(|a| (a - m).powi(2)).sum::<f64>() / 4.0;
    assert!((vals(&v)[0] - want).abs() < 1e-12);
    assert!((xt.mean_all().unwrap().item().unwrap() - x.iter().sum::<f64>() / 60.0).abs() < 1e-12);
    // Large f32 sums stay accurate (blocked accumulation, parallel path).
    let n = 1 << 20;
    let ones = Tensor::full(&[n], 0.1, DType::F32, Device::Cpu).unwrap();
    let total = ones.sum_all().unwrap().item().unwrap();
    assert!(
        (total - 0.1f32 as f64 * n as f64).abs() / total < 1e-6,
        "{total}"
    );
    // NaN propagates through max.
    let nan = t(vec![1.0, f64::NAN, 3.0], &[3]);
    assert!(nan.max_all().unwrap().item().unwrap().is_nan());
}

/// Sums over leading dims whose kept dims lie side by side in memory (a bias gradient) take
/// a column-accumulating path; check it small, long (more than one 256-row block), parallel,
/// over two reduced dims and as a mean, in f64 and f32.
#[test]
fn column_sums_match_loops() {
    for &(b, r, c) in &[(1, 5, 16), (1, 700, 40), (3, 300, 130), (2, 128, 512)] {
        let x = randv(b * r * c, (b * r + c) as u64);
        let xt = t(x.clone(), &[b, r, c]);
        let want = |j: usize| -> f64 {
            (0..b)
                .flat_map(|i| (0..r).map(move |k| (i, k)))
                .map(|(i, k)| x[(i * r + k) * c + j])
                .sum()
        };
        let s = vals(&xt.sum(&[0, 1], false).unwrap());
        let m = vals(&xt.mean(&[0, 1], false).unwrap());
        let s32 = vals(
            &xt.to_dtype(DType::F32)
                .unwrap()
                .sum(&[0, 1], false)
                .unwrap(),
        );
        for j in 0..c {
            assert!((s[j] - want(j)).abs() < 1e-9, "{b}x{r}x{c} col {j}");
            assert!((m[j] - want(j) / (b * r) as f64).abs() < 1e-12);
            let scale: f64 = (0..b * r).map(|i| x[i * c + j].abs()).sum();
            assert!(
                (s32[j] - want(j)).abs() <= 1e-6 * scale,
                "f32 {b}x{r}x{c} col {j}"
            );
        }
        // Kept dims side by side but not starting at 0: a narrowed view.
        let v = xt.narrow(2, 3, c - 3).unwrap();
        let sv = vals(&v.sum(&[0, 1], false).unwrap());
        for (j, got) in sv.iter().enumerate() {
            assert!((got - want(j + 3)).abs() < 1e-9);
        }
    }
}

#[test]
fn indexing_matches_definitions() {
    let x = randv(4 * 3, 14);
    let xt = t(x.clone(), &[4, 3]);
    let idx = Tensor::from_vec(vec![3i64, 0, 3], &[3], Device::Cpu).unwrap();
    let sel = vals(&xt.index_select(0, &idx).unwrap());
    assert_eq!(sel[..3], x[9..12]);
    assert_eq!(sel[3..6], x[0..3]);
    let gi = Tensor::from_vec(vec![2i64, 0, 1, 1], &[4, 1], Device::Cpu).unwrap();
    let g = vals(&xt.gather(1, &gi).unwrap());
    assert_eq!(g, vec![x[2], x[3], x[7], x[10]]);
    let z = Tensor::zeros(&[2, 3], DType::F64, Device::Cpu).unwrap();
    let si = Tensor::from_vec(vec![1i64, 1, 0, 1, 0, 0], &[2, 3], Device::Cpu).unwrap();
    let src = t(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let sa = vals(&z.scatter_add(0, &si, &src).unwrap());
    assert_eq!(sa, vec![0.0, 5.0, 9.0, 5.0, 2.0, 0.0]);
    let emb = Tensor::embedding(
        &Tensor::from_vec(vec![1i64, 3], &[1, 2], Device::Cpu).unwrap(),
        &xt,
    )
    .unwrap();
    assert_eq!(emb.shape(), &[1, 2, 3]);
    assert_eq!(vals(&emb)[3..], x[9..12]);
}

#[test]
fn batch_norm_updates_running_stats_and_uses_them_in_eval() {
    let x = randv(4 * 2 * 3, 15);
    let xt = t(x.clone(), &[4, 2, 3]);
    let rm = Tensor::zeros(&[2], DType::F64, Device::Cpu).unwrap();
    let rv = Tensor::ones(&[2], DType::F64, Device::Cpu).unwrap();
    let y = xt
        .batch_norm(Some(&rm), Some(&rv), None, None, true, 0.1, 1e-5)
        .unwrap();
    let ch0: Vec<f64> = (0..4)
        .flat_map(|n| (0..3).map(move |k| n * 6 + k))
        .map(|i| x[i])
        .collect();
    let m = ch0.iter().sum::<f64>() / 12.0;
    let vb = ch0.iter().map(|a| (a - m).powi(2)).sum::<f64>() / 12.0;
    assert!((vals(&rm)[0] - 0.1 * m).abs() < 1e-12);
    assert!((vals(&rv)[0] - (0.9 + 0.1 * vb * 12.0 / 11.0)).abs() < 1e-12);
    assert!((vals(&y)[0] - (x[0] - m) / (vb + 1e-5).sqrt()).abs() < 1e-10);
    let e = xt
        .batch_norm(Some(&rm), Some(&rv), None, None, false, 0.1, 1e-5)
        .unwrap();
    let want = (x[0] - vals(&rm)[0]) / (vals(&rv)[0] + 1e-5).sqrt();
    assert!((vals(&e)[0] - want).abs() < 1e-12);
}

#[test]
fn softplus_matches_its_definition_and_pytorch_threshold() {
    // ln(1 + e^x) in f64 below PyTorch's threshold of 20, x itself above; across the whole
    // range (large negative inputs give tiny positive values, not zero).
    let mut xs = randv(200, 31);
    xs.iter_mut().for_each(|x| *x *= 12.0);
    xs.extend([-40.0, -20.5, 19.75, 20.0, 20.25, 35.0]);
    let x = t(xs.clone(), &[xs.len()]);
    let want: Vec<f64> = xs
        .iter()
        .map(|&x| if x > 20.0 { x } else { x.exp().ln_1p() })
        .collect();
    assert_close(&vals(&x.softplus().unwrap()), &want, 1e-12, "softplus f64");
    let y = x.to_dtype(DType::F32).unwrap().softplus().unwrap();
    assert_close(&vals(&y), &want, 1e-6, "softplus f32");
    // Its gradient is the logistic function (1 above the threshold).
    let xg = x.detach().requires_grad(true).unwrap();
    xg.softplus()
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let dwant: Vec<f64> = xs
        .iter()
        .map(|&x| {
            if x > 20.0 {
                1.0
            } else {
                1.0 / (1.0 + (-x).exp())
            }
        })
        .collect();
    assert_close(&vals(&xg.grad().unwrap()), &dwant, 1e-12, "softplus grad");
}

#[test]
fn half_dtypes_match_f32_within_rounding() {
    // Each op on f16/bf16 inputs equals the f32 op on the same (rounded) inputs, rounded once.
    type Op = fn(&Tensor, &Tensor) -> Result<Tensor>;
    let ops: Vec<(&str, Op)> = vec![
        ("add", |a, b| a.add(b)),
        ("mul", |a, b| a.mul(b)),
        ("div", |a, b| a.div(&b.abs()?.add(1.0)?)),
        ("exp", |a, _| a.exp()),
        ("gelu", |a, _| a.gelu()),
        ("softplus", |a, _| a.softplus()),
        ("tanh", |a, _| a.tanh()),
        ("matmul", |a, b| a.matmul(&b.t()?)),
        ("sum", |a, _| a.sum(&[1], false)),
        ("mean", |a, _| a.mean_all()),
        ("softmax", |a, _| a.softmax(1)),
        ("log_softmax", |a, _| a.log_softmax(0)),
        ("conv2d", |a, b| {
            a.reshape(&[1, 1, 16, 32])?.conv2d(
                &b.narrow(0, 0, 9)?.narrow(1, 0, 1)?.reshape(&[1, 1, 3, 3])?,
                None,
                Default::default(),
            )
        }),
        ("max_pool", |a, _| {
            a.reshape(&[1, 1, 16, 32])?
                .max_pool2d(MaxPool2dOptions::new(2))
        }),
        ("layer_norm", |a, _| a.layer_norm(&[32], None, None, 1e-5)),
    ];
    for (dt, tol) in [(DType::F16, 2e-3), (DType::BF16, 1.6e-2)] {
        let a = t(randv(16 * 32, 16), &[16, 32]).to_dtype(dt).unwrap();
        let b = t(randv(16 * 32, 17), &[16, 32]).to_dtype(dt).unwrap();
        let (af, bf) = (
            a.to_dtype(DType::F32).unwrap(),
            b.to_dtype(DType::F32).unwrap(),
        );
        for (name, f) in &ops {
            let lo = f(&a, &b).unwrap();
            assert_eq!(lo.dtype(), dt, "{name} keeps the dtype");
            let hi = f(&af, &bf).unwrap();
            assert_close(&vals(&lo), &vals(&hi), tol, &format!("{name} in {dt:?}"));
        }
    }
    // A half mean of values whose sum overflows f16 is still right (f32 accumulation).
    let big = Tensor::full(&[1000], 300.0, DType::F16, Device::Cpu).unwrap();
    assert_eq!(big.mean_all().unwrap().item().unwrap(), 300.0);
}

#[test]
fn mixed_dtypes_promote() {
    let a = Tensor::ones(&[2], DType::F16, Device::Cpu).unwrap();
    let b = Tensor::ones(&[2], DType::F32, Device::Cpu).unwrap();
    assert_eq!(a.add(&b).unwrap().dtype(), DType::F32);
    let c = Tensor::ones(&[2], DType::BF16, Device::Cpu).unwrap();
    assert_eq!(a.mul(&c).unwrap().dtype(), DType::F32);
    let i = Tensor::arange(0.0, 2.0, 1.0, DType::I64, Device::Cpu).unwrap();
    assert_eq!(a.add(&i).unwrap().dtype(), DType::F16);
}

#[test]
fn relu_clamp_maximum_and_minimum_keep_nan() {
    for dt in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let x = t(vec![-2.0, f64::NAN, 0.5, 3.0], &[4])
            .to_dtype(dt)
            .unwrap();
        let y = t(vec![1.0, 1.0, f64::NAN, -1.0], &[4])
            .to_dtype(dt)
            .unwrap();
        let v = |r: Result<Tensor>| r.unwrap().to_vec_f64().unwrap();
        let same = |got: Vec<f64>, want: [f64; 4], what: &str| {
            let ok = got
                .iter()
                .zip(want)
                .all(|(g, w)| *g == w || g.is_nan() && w.is_nan());
            assert!(ok, "{what} {dt:?}: {got:?} vs {want:?}");
        };
        let nan = f64::NAN;
        same(v(x.relu()), [0.0, nan, 0.5, 3.0], "relu");
        // Its gradient is zero where x <= 0 and passes elsewhere, NaN included (PyTorch's
        // threshold_backward); -0 gives zero.
        let xg = t(vec![-2.0, f64::NAN, 0.5, -0.0], &[4])
            .to_dtype(dt)
            .unwrap()
            .requires_grad(true)
            .unwrap();
        xg.relu().unwrap().sum_all().unwrap().backward().unwrap();
        same(
            v(Ok(xg.grad().unwrap())),
            [0.0, 1.0, 1.0, 0.0],
            "relu gradient",
        );
        // An infinite or NaN incoming gradient where the mask is off gives 0, not inf * 0:
        // PyTorch's threshold_backward, clamp and pow backward select; where the mask is on it
        // passes as it is.
        let inf = f64::INFINITY;
        let g = t(vec![inf, -inf, nan, inf], &[4]).to_dtype(dt).unwrap();
        let grad_of = |f: &dyn Fn(&Tensor) -> Result<Tensor>, at: [f64; 4]| {
            let x = t(at.to_vec(), &[4])
                .to_dtype(dt)
                .unwrap()
                .requires_grad(true)
                .unwrap();
            f(&x).unwrap().backward_with(&g).unwrap();
            v(Ok(x.grad().unwrap()))
        };
        let at = [-2.0, 0.0, -1.0, 0.5];
        same(
            grad_of(&|x| x.relu(), at),
            [0.0, 0.0, 0.0, inf],
            "relu, non-finite gradient",
        );
        same(
            grad_of(&|x| x.maximum(0.0), at),
            [0.0, 0.0, 0.0, inf],
            "clamp_min, non-finite gradient",
        );
        same(
            grad_of(&|x| x.minimum(0.0), [2.0, 0.0, 1.0, -0.5]),
            [0.0, 0.0, 0.0, inf],
            "clamp_max, non-finite gradient",
        );
        same(
            grad_of(&|x| x.pow(0.0), at),
            [0.0, 0.0, 0.0, 0.0],
            "x^0, non-finite gradient",
        );
        // Other derivatives multiply, as PyTorch's: tanh' = 1 - tanh^2 underflows to 0 far
        // out, and inf * 0 is NaN there.
        let far = grad_of(&|x| x.tanh(), [-40.0, 0.0, 0.0, 40.0]);
        assert!(far[0].is_nan() && far[3].is_nan(), "tanh {dt:?}: {far:?}");
        same(v(x.clamp(-1.0, 1.0)), [-1.0, nan, 0.5, 1.0], "clamp");
        same(v(x.maximum(0.0)), [0.0, nan, 0.5, 3.0], "maximum scalar");
        same(v(x.minimum(0.0)), [-2.0, nan, 0.0, 0.0], "minimum scalar");
        same(v(x.maximum(&y)), [1.0, nan, nan, 3.0], "maximum");
        same(v(x.minimum(&y)), [-2.0, nan, nan, -1.0], "minimum");
    }
}

/// One unbatched sample (logits `[C]`, a scalar target) is a batch of one, as in PyTorch:
/// the same loss (with `Reduction::None`, a scalar) and a `[C]` gradient equal to the batch's
/// row. Logits with no classes and some targets are an error; an empty batch is not.
#[test]
fn cross_entropy_and_nll_take_one_unbatched_sample() {
    let x = randv(5, 44);
    let single = t(x.clone(), &[5]).requires_grad(true).unwrap();
    let batch = t(x, &[1, 5]).requires_grad(true).unwrap();
    let target = |shape: &[usize]| Tensor::from_vec(vec![3i64], shape, Device::Cpu).unwrap();
    let a = single
        .cross_entropy(&target(&[]), Default::default())
        .unwrap();
    let b = batch
        .cross_entropy(&target(&[1]), Default::default())
        .unwrap();
    assert_eq!(a.item().unwrap(), b.item().unwrap());
    a.backward().unwrap();
    b.backward().unwrap();
    assert_eq!(single.grad().unwrap().shape(), &[5]);
    assert_eq!(vals(&single.grad().unwrap()), vals(&batch.grad().unwrap()));
    let none = single
        .log_softmax(0)
        .unwrap()
        .nll_loss(&target(&[]), Reduction::None, -100)
        .unwrap();
    assert_eq!(none.shape(), &[] as &[usize]);
    assert!((none.item().unwrap() - a.item().unwrap()).abs() < 1e-12);

    let no_classes = t(vec![], &[2, 0]);
    let two = Tensor::from_vec(vec![0i64, 0], &[2], Device::Cpu).unwrap();
    let m = no_classes
        .cross_entropy(&two, Default::default())
        .unwrap_err()
        .to_string();
    assert!(
        m.contains("cross_entropy") && m.contains("no classes"),
        "{m}"
    );
    let empty = Tensor::from_vec(Vec::<i64>::new(), &[0], Device::Cpu).unwrap();
    let sum = CrossEntropyOptions {
        reduction: Reduction::Sum,
        ..Default::default()
    };
    for c in [0, 3] {
        let l = t(vec![], &[0, c]).cross_entropy(&empty, sum).unwrap();
        assert_eq!(l.item().unwrap(), 0.0);
    }
}

/// Convolutions and pooling take one unbatched image `[c, h, w]` as PyTorch does: the
/// result is the batch-of-one result without its batch dim, and so is the input's gradient.
/// Other ranks are an error naming both accepted shapes.
#[test]
fn image_ops_take_one_unbatched_image() {
    let img = randv(3 * 6 * 5, 45);
    let w = t(randv(4 * 3 * 3 * 3, 46), &[4, 3, 3, 3]);
    let wt = t(randv(3 * 2 * 2 * 2, 47), &[3, 2, 2, 2]);
    type ImageOp = Box<dyn Fn(&Tensor) -> Result<Tensor>>;
    let (w2, wt2) = (w.clone(), wt.clone());
    let ops: Vec<(&str, ImageOp)> = vec![
        (
            "conv2d",
            Box::new(move |x| x.conv2d(&w2, None, Default::default())),
        ),
        (
            "conv_transpose2d",
            Box::new(move |x| x.conv_transpose2d(&wt2, None, Default::default())),
        ),
        (
            "max_pool2d",
            Box::new(|x| x.max_pool2d(MaxPool2dOptions::new(2))),
        ),
        (
            "avg_pool2d",
            Box::new(|x| x.avg_pool2d(AvgPool2dOptions::new(2))),
        ),
        (
            "adaptive_avg_pool2d",
            Box::new(|x| x.adaptive_avg_pool2d([2, 3])),
        ),
    ];
    for (name, op) in &ops {
        let single = t(img.clone(), &[3, 6, 5]).requires_grad(true).unwrap();
        let batch = t(img.clone(), &[1, 3, 6, 5]).requires_grad(true).unwrap();
        let (a, b) = (op(&single).unwrap(), op(&batch).unwrap());
        assert_eq!(a.shape(), &b.shape()[1..], "{name}");
        assert_eq!(vals(&a), vals(&b), "{name}");
        // A weighted sum, so the gradient is not the same everywhere.
        let g = t(randv(a.numel(), 48), a.shape());
        a.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
        b.mul(&g.unsqueeze(0).unwrap())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        assert_eq!(single.grad().unwrap().shape(), &[3, 6, 5], "{name}");
        assert_eq!(
            vals(&single.grad().unwrap()),
            vals(&batch.grad().unwrap()),
            "{name}"
        );
        let m = op(&t(randv(30, 49), &[6, 5])).unwrap_err().to_string();
        assert!(
            m.contains(name) && m.contains("[c, h, w]") && m.contains("[6, 5]"),
            "{m}"
        );
    }
}
