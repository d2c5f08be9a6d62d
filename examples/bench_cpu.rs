//! CPU micro-benchmarks: matmul 1024^3 and conv2d, in GFLOP/s, and reductions, in ms (median
//! of several runs after a warm-up), and batch and layer norm, in ms. Run: `cargo run --release --example
//! bench_cpu`; an argument (`matmul`, `conv2d`, `reduce`, `norm` or `overhead`) runs that
//! group alone.

use clap::{Parser, ValueEnum};
use mantissa::{Conv2dOptions, DType, Device, Generator, MemoryFormat, Result, Tensor};
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, ValueEnum)]
enum Group {
    /// GEMM 1024^3 and W1's products, in GFLOP/s.
    Matmul,
    /// Convolutions, forward and backward, NCHW and channels-last.
    Conv2d,
    /// Sums and extremes over rows and columns.
    Reduce,
    /// Fused batch and layer norm against their compositions.
    Norm,
    /// The host's cost per op on one-element tensors (BENCHMARKS.md's M4).
    Overhead,
}

#[derive(Parser, Debug)]
#[command(about = "CPU micro-benchmarks of mantissa (median of several runs after a warm-up)")]
struct Args {
    /// Run this group alone (default: all).
    #[arg(value_enum)]
    group: Option<Group>,
}

/// Median seconds of `runs` calls after two warm-up calls.
fn time(runs: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    f()?;
    let mut t = Vec::with_capacity(runs);
    for _ in 0..runs {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64());
    }
    t.sort_by(|a, b| a.total_cmp(b));
    Ok(t[runs / 2])
}

fn randn(shape: &[usize], dtype: DType, seed: u64) -> Result<Tensor> {
    Tensor::randn_with(
        shape,
        0.0,
        1.0,
        dtype,
        Device::Cpu,
        &mut Generator::new(seed),
    )
}

fn main() -> Result<()> {
    let only = Args::parse().group;
    let run = |group: Group| only.is_none_or(|o| o == group);
    println!("threads: {}", rayon::current_num_threads());
    println!("{:<44} {:>10} {:>10}", "workload", "ms", "GFLOP/s");
    if run(Group::Matmul) {
        matmul()?;
    }
    if run(Group::Conv2d) {
        conv2d()?;
    }
    if run(Group::Reduce) {
        reduce()?;
    }
    if run(Group::Norm) {
        norm()?;
    }
    if run(Group::Overhead) {
        overhead()?;
    }
    Ok(())
}

/// M4 of BENCHMARKS.md on the CPU: the host's cost per op on one-element tensors (dispatch,
/// layout, allocation, graph recording), where the arithmetic is nothing. The peer is
/// `bench/overhead_peer.py`.
fn overhead() -> Result<()> {
    let n = 10_000;
    let a = Tensor::from_vec(vec![1.5f32], &[1], Device::Cpu)?;
    let b = Tensor::from_vec(vec![0.25f32], &[1], Device::Cpu)?;
    let s = time(5, || {
        for _ in 0..n {
            a.add(&b)?;
        }
        Ok(())
    })?;
    println!(
        "{:<44} {:>10.3}",
        "us per tiny add, no grad",
        s / n as f64 * 1e6
    );
    let (ga, gb) = (
        a.clone().requires_grad(true)?,
        b.clone().requires_grad(true)?,
    );
    let s = time(5, || {
        for _ in 0..n {
            ga.add(&gb)?;
        }
        Ok(())
    })?;
    println!(
        "{:<44} {:>10.3}",
        "us per tiny add, recorded",
        s / n as f64 * 1e6
    );
    // A chain of 1000 recorded ops (mul, add alternating) and its backward pass.
    let chain = 1000;
    let mut back = 0.0;
    let s = time(5, || {
        let mut y = ga.clone();
        for k in 0..chain {
            y = if k % 2 == 0 { y.mul(&gb)? } else { y.add(&gb)? };
        }
        let t = Instant::now();
        y.backward()?;
        back = t.elapsed().as_secs_f64();
        Ok(())
    })?;
    println!(
        "{:<44} {:>10.3}",
        "us per op, chain forward+backward",
        s / chain as f64 * 1e6
    );
    println!(
        "{:<44} {:>10.3}",
        "us per op, chain backward (last run)",
        back / chain as f64 * 1e6
    );
    Ok(())
}

fn matmul() -> Result<()> {
    let n = 1024;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let (a, b) = (randn(&[n, n], dtype, 1)?, randn(&[n, n], dtype, 2)?);
        let s = time(7, || a.matmul(&b).map(drop))?;
        let flops = 2.0 * (n * n * n) as f64;
        println!(
            "{:<44} {:>10.2} {:>10.1}",
            format!("matmul {n}^3 {dtype:?}"),
            s * 1e3,
            flops / s / 1e9
        );
    }
    // The eight products of one W1 training step (MLP 784-512-512-10, batch 128), with the
    // layouts training uses: `x . W^T` forward, `g . W` and `g^T . x` backward. The peer is
    // `bench/gemm_peer.py`.
    let w1_step: [(usize, usize, usize, bool, bool); 8] = [
        (128, 512, 784, false, true),
        (128, 512, 512, false, true),
        (128, 10, 512, false, true),
        (128, 512, 10, false, false),
        (10, 512, 128, true, false),
        (128, 512, 512, false, false),
        (512, 512, 128, true, false),
        (512, 784, 128, true, false),
    ];
    let mut operands = Vec::new();
    for (i, &(m, n, k, ta, tb)) in w1_step.iter().enumerate() {
        let seed = 10 + 2 * i as u64;
        let a = match ta {
            true => randn(&[k, m], DType::F32, seed)?.t()?,
            false => randn(&[m, k], DType::F32, seed)?,
        };
        let b = match tb {
            true => randn(&[n, k], DType::F32, seed + 1)?.t()?,
            false => randn(&[k, n], DType::F32, seed + 1)?,
        };
        operands.push((a, b));
    }
    let flops: usize = w1_step.iter().map(|&(m, n, k, _, _)| 2 * m * n * k).sum();
    let s = time(15, || {
        for (a, b) in &operands {
            a.matmul(b)?;
        }
        Ok(())
    })?;
    println!(
        "{:<44} {:>10.2} {:>10.1}",
        "W1 step's 8 matmuls F32",
        s * 1e3,
        flops as f64 / s / 1e9
    );
    // One W1 step's forward and backward (three linear layers, ReLU, a summed output), run
    // inside the compute pool as the mnist example runs its loop: the products and the work
    // between them, without the loader, the loss or the optimizer.
    let x = randn(&[128, 784], DType::F32, 40)?;
    let mut params = Vec::new();
    for (i, &(o, n)) in [(512, 784), (512, 512), (10, 512)].iter().enumerate() {
        let seed = 41 + 2 * i as u64;
        params.push((
            randn(&[o, n], DType::F32, seed)?.requires_grad(true)?,
            randn(&[o], DType::F32, seed + 1)?.requires_grad(true)?,
        ));
    }
    let s = mantissa::in_compute_pool(|| {
        time(101, || {
            let mut h = x.clone();
            for (i, (w, b)) in params.iter().enumerate() {
                h = h.linear(w, Some(b))?;
                if i < 2 {
                    h = h.relu()?;
                }
            }
            h.sum_all()?.backward()?;
            for (w, b) in &params {
                w.zero_grad();
                b.zero_grad();
            }
            Ok(())
        })
    })?;
    println!(
        "{:<44} {:>10.2} {:>10}",
        "W1 step forward+backward F32",
        s * 1e3,
        "-"
    );
    Ok(())
}

fn conv2d() -> Result<()> {
    // conv2d: a ResNet stage-1 layer, the MNIST CNN's second layer and a 1x1 bottleneck, in
    // NCHW and channels-last (CL).
    let cases = [
        (
            "conv2d 16x64x56x56, 64x3x3, pad 1",
            [16, 64, 56, 56],
            [64, 64, 3, 3],
            1,
        ),
        (
            "conv2d 64x32x26x26, 64x3x3 (MNIST CNN)",
            [64, 32, 26, 26],
            [64, 32, 3, 3],
            0,
        ),
        (
            "conv2d 16x256x28x28, 64x1x1 (bottleneck)",
            [16, 256, 28, 28],
            [64, 256, 1, 1],
            0,
        ),
    ];
    for (name, xs, ws, pad) in cases {
        for format in [MemoryFormat::Contiguous, MemoryFormat::ChannelsLast] {
            let tag = match format {
                MemoryFormat::ChannelsLast => " CL",
                _ => "",
            };
            let x = randn(&xs, DType::F32, 3)?.to_memory_format(format)?;
            let w = randn(&ws, DType::F32, 4)?.to_memory_format(format)?;
            let opts = Conv2dOptions {
                padding: [pad, pad],
                ..Default::default()
            };
            let y = x.conv2d(&w, None, opts)?;
            let (ho, wo) = (y.shape()[2], y.shape()[3]);
            let flops = 2.0 * (xs[0] * ws[0] * ho * wo * ws[1] * ws[2] * ws[3]) as f64;
            let s = time(5, || x.conv2d(&w, None, opts).map(drop))?;
            println!(
                "{:<44} {:>10.2} {:>10.1}",
                format!("{name}{tag} fwd"),
                s * 1e3,
                flops / s / 1e9
            );
            let xg = x.detach().requires_grad(true)?;
            let wg = w.detach().requires_grad(true)?;
            let s = time(5, || {
                xg.conv2d(&wg, None, opts)?.sum_all()?.backward()?;
                xg.zero_grad();
                wg.zero_grad();
                Ok(())
            })?;
            // Forward + backward data + backward filter: three convolutions' worth of FLOPs.
            println!(
                "{:<44} {:>10.2} {:>10.1}",
                format!("{name}{tag} fwd+bwd"),
                s * 1e3,
                3.0 * flops / s / 1e9
            );
        }
    }
    Ok(())
}

/// Reductions whose outputs sit side by side in memory: bias gradients of a channels-last
/// activation (a sum over n, h, w), in NCHW for comparison, and a max down the columns of a
/// matrix.
fn reduce() -> Result<()> {
    for (c, hw) in [(32, 26), (64, 24)] {
        for format in [MemoryFormat::Contiguous, MemoryFormat::ChannelsLast] {
            let tag = match format {
                MemoryFormat::ChannelsLast => " CL",
                _ => "",
            };
            let x = randn(&[64, c, hw, hw], DType::F32, 5)?.to_memory_format(format)?;
            let s = time(21, || x.sum(&[0, 2, 3], false).map(drop))?;
            println!(
                "{:<44} {:>10.3} {:>10}",
                format!("sum 64x{c}x{hw}x{hw}{tag} over n,h,w"),
                s * 1e3,
                "-"
            );
        }
    }
    let x = randn(&[576, 4096], DType::F32, 6)?;
    let s = time(21, || x.max(0, false).map(drop))?;
    println!(
        "{:<44} {:>10.3} {:>10}",
        "max 576x4096 over dim 0",
        s * 1e3,
        "-"
    );
    let s = time(21, || x.sum(&[0], false).map(drop))?;
    println!(
        "{:<44} {:>10.3} {:>10}",
        "sum 576x4096 over dim 0",
        s * 1e3,
        "-"
    );
    Ok(())
}

/// A normalisation, as a closure of its input.
type Norm<'a> = &'a dyn Fn(&Tensor) -> Result<Tensor>;

/// Forward (no graph) and forward + backward (times a fixed gradient `g`) of the fused op and
/// of the composite it replaced, one row each.
fn fused_vs_composite(
    label: &str,
    x: &Tensor,
    g: &Tensor,
    fused: Norm,
    composite: Norm,
) -> Result<()> {
    for (name, f) in [("fused", fused), ("composite", composite)] {
        let fwd = time(11, || mantissa::no_grad(|| f(x)).map(drop))?;
        let both = time(11, || f(x)?.mul(g)?.sum_all()?.backward())?;
        for (pass, t) in [("fwd", fwd), ("fwd+bwd", both)] {
            println!(
                "{:<44} {:>10.3} {:>10}",
                format!("{label} {name} {pass}"),
                t * 1e3,
                "-"
            );
        }
    }
    Ok(())
}

/// Batch norm in training mode (32x64x32x32, both formats) and layer norm (256x1024), fused
/// against the same computations composed of elementwise ops and reductions.
fn norm() -> Result<()> {
    let (n, c, hw) = (32, 64, 32);
    let w = randn(&[c], DType::F32, 7)?.requires_grad(true)?;
    let b = randn(&[c], DType::F32, 8)?.requires_grad(true)?;
    let composite = |x: &Tensor| -> Result<Tensor> {
        let shape = [1, c, 1, 1];
        let mean = x.mean(&[0, 2, 3], false)?;
        let var = x.var(&[0, 2, 3], 0, false)?;
        x.sub(&mean.reshape(&shape)?)?
            .mul(&var.add(1e-5)?.rsqrt()?.reshape(&shape)?)?
            .mul(&w.reshape(&shape)?)?
            .add(&b.reshape(&shape)?)
    };
    let fused = |x: &Tensor| x.batch_norm(None, None, Some(&w), Some(&b), true, 0.1, 1e-5);
    for format in [MemoryFormat::Contiguous, MemoryFormat::ChannelsLast] {
        let tag = match format {
            MemoryFormat::ChannelsLast => " CL",
            _ => "",
        };
        let x = randn(&[n, c, hw, hw], DType::F32, 9)?
            .to_memory_format(format)?
            .requires_grad(true)?;
        let g = randn(&[n, c, hw, hw], DType::F32, 10)?.to_memory_format(format)?;
        let label = format!("batch_norm {n}x{c}x{hw}x{hw}{tag}");
        fused_vs_composite(&label, &x, &g, &fused, &composite)?;
    }
    // Layer norm over the last dim, weight and bias.
    let (rows, cols) = (256, 1024);
    let w = randn(&[cols], DType::F32, 11)?.requires_grad(true)?;
    let b = randn(&[cols], DType::F32, 12)?.requires_grad(true)?;
    let x = randn(&[rows, cols], DType::F32, 13)?.requires_grad(true)?;
    let g = randn(&[rows, cols], DType::F32, 14)?;
    let composite = |x: &Tensor| -> Result<Tensor> {
        let mean = x.mean(&[-1], true)?;
        let var = x.var(&[-1], 0, true)?;
        x.sub(&mean)?
            .mul(&var.add(1e-5)?.rsqrt()?)?
            .mul(&w)?
            .add(&b)
    };
    let fused = |x: &Tensor| x.layer_norm(&[cols], Some(&w), Some(&b), 1e-5);
    fused_vs_composite(
        &format!("layer_norm {rows}x{cols}"),
        &x,
        &g,
        &fused,
        &composite,
    )
}
