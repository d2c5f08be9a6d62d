//! The pieces every classifier's training loop repeats: the precision flag, one step under
//! autocast with the loss scaler, and an evaluation pass.

use crate::amp::{self, GradScaler};
use crate::data::DataLoader;
use crate::nn::Module;
use crate::optim::Optimizer;
use crate::{no_grad, CrossEntropyOptions, DType, Device, Error, MemoryFormat, Reduction};
use crate::{Result, Tensor};

/// The autocast dtype for a `--precision` flag: `fp32` (none), `fp16`, or `bf16` (f16, with
/// a warning, on a device without bf16).
///
/// ```
/// use mantissa::train::parse_precision;
/// use mantissa::{DType, Device};
/// assert_eq!(parse_precision("fp16", Device::Cpu)?, Some(DType::F16));
/// assert_eq!(parse_precision("fp32", Device::Cpu)?, None);
/// assert!(parse_precision("fp8", Device::Cpu).is_err());
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn parse_precision(flag: &str, device: Device) -> Result<Option<DType>> {
    match flag {
        "fp32" => Ok(None),
        "fp16" => Ok(Some(DType::F16)),
        "bf16" => Ok(Some(amp::supported_dtype(device, DType::BF16)?)),
        other => Err(Error::invalid(
            "parse_precision",
            format!("unknown precision {other:?}; use fp32, fp16 or bf16"),
        )),
    }
}

/// Runs `f` under autocast to `low` when set.
pub fn autocast_maybe<R>(low: Option<DType>, f: impl FnOnce() -> Result<R>) -> Result<R> {
    let _guard = low.map(amp::autocast).transpose()?;
    f()
}

/// One training step of a classifier: the forward pass and the mean cross-entropy under
/// autocast to `low`, the backward pass of the scaled loss, the optimizer step through the
/// scaler (skipped on an overflow) and the scale update. Returns the loss and the number of
/// correct predictions, both as tensors on the device (nothing is read back).
pub fn classify_step(
    net: &dyn Module,
    opt: &mut dyn Optimizer,
    scaler: &mut GradScaler,
    low: Option<DType>,
    x: &Tensor,
    y: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let mut one = Accumulation::new(1)?;
    classify_micro_step(net, opt, scaler, low, (x, y), &mut one, true)
}

/// Gradient accumulation: an optimizer step every `every` micro-batches, each micro-batch's
/// loss divided by `every`, so `every` micro-batches of `b` samples step as one batch of
/// `every * b` would (PyTorch's accumulation loop). Counts the micro-batches of a group.
#[derive(Debug, Clone)]
pub struct Accumulation {
    every: usize,
    seen: usize,
}

impl Accumulation {
    /// Steps every `every` micro-batches (1: every batch); 0 is an error.
    pub fn new(every: usize) -> Result<Accumulation> {
        if every == 0 {
            return Err(Error::invalid(
                "Accumulation",
                "micro-batches per step must be at least 1",
            ));
        }
        Ok(Accumulation { every, seen: 0 })
    }

    /// Micro-batches per optimizer step.
    pub fn every(&self) -> usize {
        self.every
    }

    /// True when the next micro-batch ends its group (the optimizer steps after it): it is
    /// the group's last, or the epoch's (`last`). The micro-batches before it can skip the
    /// data-parallel all-reduce (`DistributedDataParallel::no_sync`).
    pub fn steps_next(&self, last: bool) -> bool {
        self.seen + 1 >= self.every || last
    }
}

/// [`classify_step`] for one micro-batch of a gradient-accumulation group: the loss divided
/// by the group's size is backpropagated (gradients add up on the parameters), and the
/// optimizer and scaler step, then the gradients clear, once `acc` has seen its micro-batches
/// or at the `last` batch of an epoch (a short final group). Returns the micro-batch's mean
/// loss (undivided) and its correct predictions. A step that fails ends its group too: the
/// error is returned, and the next call starts a new group from cleared gradients.
///
/// ```
/// use mantissa::amp::GradScaler;
/// use mantissa::nn::{Linear, Module};
/// use mantissa::optim::{Sgd, SgdConfig};
/// use mantissa::train::{classify_micro_step, Accumulation};
/// use mantissa::{DType, Device, Generator, Tensor};
/// let net = Linear::new(4, 3, true, &mut Generator::new(0))?;
/// let mut opt = Sgd::new(net.parameters(), SgdConfig::new(0.1))?;
/// let mut scaler = GradScaler::new(Default::default())?;
/// let mut acc = Accumulation::new(2)?;
/// let x = Tensor::ones(&[8, 4], DType::F32, Device::Cpu)?;
/// let y = Tensor::from_vec(vec![0i64, 1, 2, 0, 1, 2, 0, 1], &[8], Device::Cpu)?;
/// for (i, (xb, yb)) in x.split(2, 0)?.iter().zip(y.split(2, 0)?.iter()).enumerate() {
///     classify_micro_step(&net, &mut opt, &mut scaler, None, (xb, yb), &mut acc, i == 3)?;
/// }
/// # Ok::<(), mantissa::Error>(())
/// ```
pub fn classify_micro_step(
    net: &dyn Module,
    opt: &mut dyn Optimizer,
    scaler: &mut GradScaler,
    low: Option<DType>,
    (x, y): (&Tensor, &Tensor),
    acc: &mut Accumulation,
    last: bool,
) -> Result<(Tensor, Tensor)> {
    let (logits, loss) = autocast_maybe(low, || {
        let logits = net.forward(x)?;
        let loss = logits.cross_entropy(y, CrossEntropyOptions::default())?;
        Ok((logits, loss))
    })?;
    if acc.seen == 0 {
        opt.zero_grad();
    }
    let part = match acc.every {
        1 => loss.clone(),
        n => loss.div(n as f64)?,
    };
    scaler.scale(&part)?.backward()?;
    acc.seen += 1;
    if acc.seen >= acc.every || last {
        // The group ends here whether its step succeeds or not: after a failed step the next
        // call clears the gradients and starts a new group.
        acc.seen = 0;
        if let Err(e) = scaler.step(opt) {
            // The scaler's iteration ends too (it forgets that it unscaled this optimizer's
            // gradients), so the next group's gradients are unscaled in their turn. The
            // step's error is the one to report.
            let _ = scaler.update();
            return Err(e);
        }
        scaler.update()?;
    }
    Ok((loss, hits(&logits, y)?))
}

/// How many rows of `logits` have their largest value at the target class (an f32 scalar).
fn hits(logits: &Tensor, y: &Tensor) -> Result<Tensor> {
    logits
        .argmax(1, false)?
        .eq(y)?
        .to_dtype(DType::F32)?
        .sum_all()
}

/// Mean cross-entropy and accuracy of `net` over one pass of `loader`, without gradients,
/// under autocast to `low`, the inputs moved to `device` in `format`.
pub fn evaluate_classifier(
    net: &dyn Module,
    loader: &mut DataLoader,
    device: Device,
    low: Option<DType>,
    format: MemoryFormat,
) -> Result<(f64, f64)> {
    let (mut loss, mut correct, mut n) = (0.0, 0.0, 0.0);
    for b in loader.epoch(0).to_device(device) {
        let b = b?;
        let (x, y) = (b.x.to_memory_format(format)?, b.y);
        let logits = no_grad(|| autocast_maybe(low, || net.forward(&x)))?;
        let opts = CrossEntropyOptions {
            reduction: Reduction::Sum,
            ..Default::default()
        };
        loss += logits.cross_entropy(&y, opts)?.item()?;
        correct += hits(&logits, &y)?.item()?;
        n += y.numel() as f64;
    }
    if n == 0.0 {
        return Err(Error::invalid("evaluate_classifier", "the loader is empty"));
    }
    Ok((loss / n, correct / n))
}
