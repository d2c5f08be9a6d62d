//! One step of the GPT example's training (nanoGPT's): the learning-rate schedule, the
//! batches' generator, and an optimizer step over micro-batches with the loss scaler,
//! clipping and data-parallel averaging.

use super::model::Gpt;
use mantissa::amp::GradScaler;
use mantissa::distributed::DistributedDataParallel;
use mantissa::nn::Module;
use mantissa::optim::{clip_grad_norm, Adam, Optimizer};
use mantissa::train::autocast_maybe;
use mantissa::{no_grad, DType, Generator, Result, Tensor};

/// nanoGPT's schedule: linear warm-up over `warmup` steps to `lr`, then a cosine from `lr`
/// at `warmup` down to `min_lr` at `total`, and `min_lr` after it.
pub fn lr_at(step: usize, lr: f64, min_lr: f64, warmup: usize, total: usize) -> f64 {
    if step < warmup {
        return lr * (step + 1) as f64 / (warmup + 1) as f64;
    }
    if step > total || total <= warmup {
        return min_lr;
    }
    let ratio = (step - warmup) as f64 / (total - warmup) as f64;
    min_lr + 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos()) * (lr - min_lr)
}

/// The generator of the batches of `step` on `rank`: a resumed run draws what the
/// uninterrupted one would have, and each rank draws its own windows.
pub fn batch_generator(seed: u64, rank: usize, step: usize) -> Generator {
    // SplitMix64's finaliser over the three, so nearby seeds give unrelated streams.
    let mut z =
        seed ^ (rank as u64).rotate_left(40) ^ (step as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    Generator::new(z ^ (z >> 31))
}

/// The model and what trains it.
pub struct Model<'a> {
    pub net: &'a mut Gpt,
    pub opt: &'a mut Adam,
    pub scaler: &'a mut GradScaler,
}

/// One optimizer step over `micro` batches `(x, y)`: each loss divided by their number and
/// its (scaled) backward run, the gradients averaged over the ranks by `ddp` on the last
/// one, unscaled, clipped, and the step taken through the scaler. Returns the mean loss and
/// how many of the last micro-batch's tokens the model predicted, counted before its
/// backward: the logits are dropped by then, so the loss's backward writes their gradient
/// over them instead of allocating another `[tokens, vocabulary]`.
pub fn train_step(
    m: &mut Model,
    micro: &[(Tensor, Tensor)],
    low: Option<DType>,
    grad_clip: f64,
    ddp: Option<&DistributedDataParallel>,
) -> Result<(Tensor, Tensor)> {
    m.opt.zero_grad();
    let n = micro.len() as f64;
    let (mut total, mut last) = (None::<Tensor>, None);
    for (k, (x, y)) in micro.iter().enumerate() {
        let (loss, logits) = autocast_maybe(low, || m.net.loss(x, y))?;
        if k + 1 == micro.len() {
            last = Some(hits(&logits, y)?);
        }
        drop(logits);
        let mut backward = || m.scaler.scale(&loss.div(n)?)?.backward();
        match ddp {
            Some(d) if k + 1 < micro.len() => d.no_sync(&mut backward)?,
            _ => backward()?,
        }
        let l = loss.detach().to_dtype(DType::F32)?.div(n)?;
        total = Some(match total {
            Some(t) => t.add(&l)?,
            None => l,
        });
    }
    m.scaler.unscale_(m.opt)?;
    if grad_clip > 0.0 {
        clip_grad_norm(&m.net.parameters(), grad_clip)?;
    }
    m.scaler.step(m.opt)?;
    m.scaler.update()?;
    Ok((
        total.expect("one micro-batch"),
        last.expect("one micro-batch"),
    ))
}

/// How many of `y`'s tokens are the most likely ones of `logits` (`[B, T, V]`), as an f32
/// scalar on the device.
pub fn hits(logits: &Tensor, y: &Tensor) -> Result<Tensor> {
    no_grad(|| {
        logits
            .argmax(2, false)?
            .eq(y)?
            .to_dtype(DType::F32)?
            .sum_all()
    })
}
