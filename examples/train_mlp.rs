//! Trains a small MLP on synthetic data with plain SGD, written only against the public API.
//!
//! Four Gaussian blobs in 16 dimensions, a 16-64-64-4 ReLU network, cross-entropy loss,
//! mini-batch SGD. Run: `cargo run --release --example train_mlp [dtype]` where dtype is
//! f32 (default), bf16, f16 or f64.

use clap::{Parser, ValueEnum};
use mantissa::{no_grad, CrossEntropyOptions, DType, Device, Generator, Result, Tensor};
use std::time::Instant;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Precision {
    F32,
    Bf16,
    F16,
    F64,
}

#[derive(Parser, Debug)]
#[command(about = "Train a small MLP on synthetic blobs with plain SGD (public API only)")]
struct Args {
    /// The parameters' and inputs' dtype.
    #[arg(value_enum, default_value = "f32")]
    dtype: Precision,
}

const DIM: usize = 16;
const CLASSES: usize = 4;

/// `n` points: class c is centred at a random mean with unit noise.
fn blobs(n: usize, gen: &mut Generator) -> Result<(Tensor, Tensor)> {
    let means = Tensor::randn_with(
        &[CLASSES, DIM],
        0.0,
        0.7,
        DType::F32,
        Device::Cpu,
        &mut Generator::new(7),
    )?;
    let labels: Vec<i64> = gen
        .next_u32s(n)
        .iter()
        .map(|v| (*v as usize % CLASSES) as i64)
        .collect();
    let y = Tensor::from_vec(labels, &[n], Device::Cpu)?;
    let noise = Tensor::randn_with(&[n, DIM], 0.0, 1.0, DType::F32, Device::Cpu, gen)?;
    Ok((Tensor::embedding(&y, &means)?.add(&noise)?, y))
}

/// Kaiming-uniform weight and uniform bias, as PyTorch initialises `nn.Linear`.
fn linear(fan_in: usize, fan_out: usize, dtype: DType, gen: &mut Generator) -> Result<[Tensor; 2]> {
    let bound = 1.0 / (fan_in as f64).sqrt();
    let w = Tensor::rand_with(&[fan_out, fan_in], -bound, bound, dtype, Device::Cpu, gen)?;
    let b = Tensor::rand_with(&[fan_out], -bound, bound, dtype, Device::Cpu, gen)?;
    Ok([w.requires_grad(true)?, b.requires_grad(true)?])
}

fn forward(p: &[Tensor], x: &Tensor) -> Result<Tensor> {
    let h = x.linear(&p[0], Some(&p[1]))?.relu()?;
    let h = h.linear(&p[2], Some(&p[3]))?.relu()?;
    h.linear(&p[4], Some(&p[5]))
}

fn accuracy(logits: &Tensor, y: &Tensor) -> Result<f64> {
    let hits = logits
        .argmax(1, false)?
        .eq(y)?
        .to_dtype(DType::F32)?
        .mean_all()?;
    hits.item()
}

fn main() -> Result<()> {
    let dtype = match Args::parse().dtype {
        Precision::F32 => DType::F32,
        Precision::Bf16 => DType::BF16,
        Precision::F16 => DType::F16,
        Precision::F64 => DType::F64,
    };
    let mut gen = Generator::new(0);
    let (xtr, ytr) = blobs(4096, &mut gen)?;
    let (xte, yte) = blobs(1024, &mut gen)?;
    let (xtr, xte) = (xtr.to_dtype(dtype)?, xte.to_dtype(dtype)?);
    let mut params = Vec::new();
    for (i, o) in [(DIM, 64), (64, 64), (64, CLASSES)] {
        params.extend(linear(i, o, dtype, &mut gen)?);
    }
    let (batch, lr) = (64, 0.1);
    let start = Instant::now();
    for epoch in 1..=5 {
        let mut total = 0.0;
        let steps = xtr.shape()[0] / batch;
        for s in 0..steps {
            let xb = xtr.narrow(0, s * batch, batch)?;
            let yb = ytr.narrow(0, s * batch, batch)?;
            let loss = forward(&params, &xb)?.cross_entropy(&yb, CrossEntropyOptions::default())?;
            total += loss.item()?;
            loss.backward()?;
            no_grad(|| -> Result<()> {
                for p in &params {
                    if let Some(g) = p.grad() {
                        p.copy_(&p.sub(&g.mul(lr)?)?)?;
                    }
                    p.zero_grad();
                }
                Ok(())
            })?;
        }
        let acc = no_grad(|| accuracy(&forward(&params, &xte)?, &yte))?;
        println!(
            "epoch {epoch}: train loss {:.4}  test accuracy {:.2}%",
            total / steps as f64,
            100.0 * acc
        );
    }
    println!(
        "{dtype:?} training took {:.2} s",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
