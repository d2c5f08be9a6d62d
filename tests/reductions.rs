//! Reductions whose outputs sit side by side in memory (a max down the columns of a matrix, a
//! bias gradient over a channels-last activation), which the CPU reduces a row at a time:
//! against loops written here, on shapes that cross its 16-column blocks, its 64-row tiles
//! and its 4,096-row tasks, with ties and NaNs.

mod common;
use common::*;
use mantissa::*;

/// `rows x cols` f32 values: few distinct ones (so extremes tie), with a NaN in some columns
/// (first at row `(j * 7) % rows`, a second one later), in others the extremes planted twice
/// (in the middle row and the last, so across row tasks) or once (in the last row).
fn grid(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let noise = Generator::new(seed).normal(rows * cols);
    let mut v: Vec<f32> = noise.iter().map(|x| (x * 3.0).round() as f32).collect();
    for j in 0..cols {
        let (mid, last) = ((rows / 2) * cols + j, (rows - 1) * cols + j);
        match j % 5 {
            3 => {
                let r = (j * 7) % rows;
                v[r * cols + j] = f32::NAN;
                v[((r + rows / 2) % rows) * cols + j] = f32::NAN;
            }
            1 => (v[mid], v[last]) = (50.0, 50.0),
            2 => (v[mid], v[last]) = (-50.0, -50.0),
            4 => v[last] = if j % 2 == 0 { 60.0 } else { -60.0 },
            _ => {}
        }
    }
    v
}

/// The first maximum (or minimum) of each column, or its first NaN: value and row.
fn column_extremes(v: &[f32], rows: usize, cols: usize, max: bool) -> (Vec<f64>, Vec<i64>) {
    (0..cols)
        .map(|j| {
            let mut best = (v[j], 0);
            for r in 1..rows {
                let x = v[r * cols + j];
                let beats = if max { x > best.0 } else { x < best.0 };
                if !best.0.is_nan() && (x.is_nan() || beats) {
                    best = (x, r);
                }
            }
            (best.0 as f64, best.1 as i64)
        })
        .unzip()
}

fn same(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(p, q)| p == q || p.is_nan() && q.is_nan())
}

#[test]
fn extremes_down_columns_match_loops() {
    for (rows, cols) in [
        (2, 16),
        (65, 37),
        (300, 100),
        (400, 300),
        (4100, 19),
        (8200, 48),
    ] {
        let v = grid(rows, cols, rows as u64);
        let x = Tensor::from_vec(v.clone(), &[rows, cols], Device::Cpu).unwrap();
        // The same values as a transposed view: the reduced dim is the view's last.
        let xt = Tensor::from_vec(v.clone(), &[rows, cols], Device::Cpu)
            .unwrap()
            .t()
            .unwrap();
        for max in [true, false] {
            let (want_v, want_i) = column_extremes(&v, rows, cols, max);
            for (view, dim) in [(&x, 0), (&xt, 1)] {
                let (got_v, got_i) = match max {
                    true => view.max(dim, false).unwrap(),
                    false => view.min(dim, false).unwrap(),
                };
                let what = format!("{rows}x{cols} max={max} dim={dim}");
                assert!(same(&vals(&got_v), &want_v), "{what}: values");
                assert_eq!(got_i.to_vec::<i64>().unwrap(), want_i, "{what}: indices");
            }
        }
    }
}

#[test]
fn sums_down_columns_match_loops_whatever_the_thread_count() {
    for (rows, cols) in [(3, 16), (130, 33), (9000, 40)] {
        let v: Vec<f32> = Generator::new(cols as u64)
            .normal(rows * cols)
            .iter()
            .map(|&x| x as f32)
            .collect();
        let want: Vec<f64> = (0..cols)
            .map(|j| (0..rows).map(|r| v[r * cols + j] as f64).sum())
            .collect();
        let x = Tensor::from_vec(v, &[rows, cols], Device::Cpu).unwrap();
        let sum = || vals(&x.sum(&[0], false).unwrap());
        let got = sum();
        assert_close(
            &got,
            &want,
            1e-6,
            &format!("sum of {rows}x{cols} over rows"),
        );
        let mean = vals(&x.mean(&[0], false).unwrap());
        let want_mean: Vec<f64> = want.iter().map(|s| s / rows as f64).collect();
        assert_close(&mean, &want_mean, 1e-6, "mean over rows");
        // The row tasks are fixed in size, so one thread gives the same bits as the pool.
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap()
            .install(sum);
        assert_eq!(one, got, "{rows}x{cols}: one thread against the pool");
    }
}

#[test]
fn bias_gradient_sums_of_a_channels_last_activation_match() {
    // [n, c, h, w] with 48 channels, in channels-last: a sum over n, h, w reduces rows of 48
    // side-by-side channels, 4,608 of them (more than one task).
    let x = f32s(&[8, 48, 24, 24], 5);
    let cl = x.to_memory_format(MemoryFormat::ChannelsLast).unwrap();
    let xs = vals(&x);
    let want: Vec<f64> = (0..48)
        .map(|c| {
            (0..8)
                .flat_map(|n| (0..576).map(move |p| (n, p)))
                .map(|(n, p)| xs[(n * 48 + c) * 576 + p])
                .sum()
        })
        .collect();
    for what in ["NCHW", "channels-last"] {
        let t = if what == "NCHW" { &x } else { &cl };
        let got = vals(&t.sum(&[0, 2, 3], false).unwrap());
        assert_close(&got, &want, 1e-6, what);
    }
}

/// i64 values past 2^53 (where f64 has no odd integers) survive `to_vec`, and their extremes
/// are compared as integers, down the columns and along the rows, large and small.
#[test]
fn i64_extremes_are_exact_past_f64_integers() {
    let big = (1i64 << 53) + 1;
    for (rows, cols) in [(3, 4), (700, 300)] {
        let v: Vec<i64> = (0..rows * cols)
            .map(|i| big - (i as i64 * 7919 % 1013) * 2 + (i % 3 == 0) as i64)
            .collect();
        let x = Tensor::from_vec(v.clone(), &[rows, cols], Device::Cpu).unwrap();
        assert_eq!(x.to_vec::<i64>().unwrap(), v);
        for (dim, outer, inner, step) in [(0, cols, rows, cols), (1, rows, cols, 1)] {
            let at = |o: usize, k: usize| v[if dim == 0 { o + k * step } else { o * cols + k }];
            for max in [true, false] {
                let (vals, idx) = match max {
                    true => x.max(dim as isize, false).unwrap(),
                    false => x.min(dim as isize, false).unwrap(),
                };
                let (vals, idx) = (vals.to_vec::<i64>().unwrap(), idx.to_vec::<i64>().unwrap());
                for o in 0..outer {
                    // The first extreme, by a plain loop.
                    let mut best = 0;
                    for k in 1..inner {
                        let (a, b) = (at(o, k), at(o, best));
                        if (max && a > b) || (!max && a < b) {
                            best = k;
                        }
                    }
                    assert_eq!(
                        (vals[o], idx[o]),
                        (at(o, best), best as i64),
                        "{rows}x{cols} dim {dim} max {max}"
                    );
                }
            }
        }
    }
}
